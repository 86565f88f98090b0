"""Incremental detokenization for streaming: text goes out only once its bytes are complete.

A character such as '€' or an emoji often spans two or more byte-level tokens; decoding
token by token would print replacement characters in between. The UTF-8 incremental
decoder holds back an incomplete tail until the next token completes it.
"""

import codecs
import numbers
from collections.abc import Iterable


class IncrementalDetokenizer:
    """Feed token ids as they are generated; get back the text that became complete.

    The pieces returned by `push` and `flush` concatenate to exactly `tokenizer.decode(all_ids)`.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: int | Iterable[int]) -> str:
        """Add one id or several; return the newly completed text (possibly '')."""
        ids = [token_ids] if isinstance(token_ids, numbers.Integral) else token_ids
        data = self.tokenizer.decode_bytes(ids, skip_special_tokens=self.skip_special_tokens)
        return self._utf8.decode(data)

    def state(self) -> tuple[bytes, int]:
        """A checkpoint of what is held back, for `restore` (the engine undoes an interrupted push)."""
        return self._utf8.getstate()

    def restore(self, state: tuple[bytes, int]) -> None:
        self._utf8.setstate(state)

    def flush(self) -> str:
        """End of stream: whatever is still held back, an incomplete character as U+FFFD."""
        return self._utf8.decode(b"", final=True)
