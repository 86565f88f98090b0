"""The few attributes of a sequence that the BlockManager reads and writes.

The engine's full `Sequence` (status, sampling parameters, outputs, ...) lives elsewhere; the
block manager only needs this view of it, so any object with these four attributes will do:

- `seq_id`: a unique, hashable id (it keys the CPU copy of a swapped-out sequence);
- `token_ids`: every token of the sequence so far, prompt then outputs (read only);
- `block_table`: the physical block ids holding its K/V, in order (written by the manager);
- `num_cached_tokens`: how many leading tokens already have their K/V stored in those blocks.
  `allocate` sets it to the prefix-cache hit; the engine advances it after every forward step
  (to the number of tokens whose K/V that step wrote). The manager only shares blocks whose
  tokens all lie below this mark, so a block is never offered to another sequence before its
  K/V exists, even with chunked prefill.
"""

from dataclasses import dataclass, field
from typing import Protocol


class SequenceBlocks(Protocol):
    seq_id: object
    token_ids: list[int]
    block_table: list[int]
    num_cached_tokens: int


@dataclass
class BlockSequence:
    """A minimal concrete sequence for tests, labs and simulations."""

    seq_id: object
    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)
