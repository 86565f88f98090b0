"""What callers hand the engine, checked before anything is queued: prompts (text or token ids),
sampling params and priorities, chat conversations and beam-search prompts. Each refusal says what
is wrong, so one bad prompt leaves the engine untouched."""

import numbers

import numpy as np

from labkit.engine.speculative import check_supported
from labkit.sampling import SamplingParams

CHAT_ROLES = ("system", "developer", "user", "assistant")  # OpenAI's "developer" is the system prompt


def encode_prompt(prompt, tokenizer, vocab_size: int) -> tuple[list[int], str | None]:
    """A prompt's token ids, and its text if it was given as text."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty: give at least one character of text")
        token_ids = tokenizer.encode(prompt)
        if not token_ids:
            raise ValueError(f"prompt {prompt!r} encodes to no tokens")
        return token_ids, prompt
    if not is_token_ids(prompt):
        raise TypeError(f"a prompt must be a str (or a list of token ids), got {type(prompt).__name__}")
    token_ids = _token_ids(prompt)
    if not token_ids:
        raise ValueError("prompt is an empty list of token ids")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        raise ValueError(f"prompt token ids must lie in [0, {vocab_size}), got {min(token_ids)}..{max(token_ids)}")
    return token_ids, None


def check_request(params: SamplingParams, priority, vocab_size: int, eos_token_id: int | None,
                  max_num_seqs: int, speculative: bool = False) -> None:
    """Refuse sampling params and a priority this engine (speculative or not) cannot serve."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    if isinstance(priority, (bool, np.bool_)) or not isinstance(priority, numbers.Integral):
        raise TypeError(f"priority must be an integer, got {priority!r}")
    for field, ids in params.token_ids_named().items():
        if any(t >= vocab_size for t in ids):
            raise ValueError(f"{field} must hold token ids below the vocabulary size {vocab_size}, got {max(ids)}")
    banned = set(params.stop_token_ids) | ({eos_token_id} if not params.ignore_eos else set())
    if params.min_tokens and params.allowed_token_ids is not None and set(params.allowed_token_ids) <= banned:
        raise ValueError(f"allowed_token_ids {list(params.allowed_token_ids)} are all EOS or stop tokens, which "
                         f"min_tokens={params.min_tokens} masks: no token could be sampled")
    if params.n > max_num_seqs:
        raise ValueError(f"n={params.n} samples cannot run at once with max_num_seqs={max_num_seqs}; lower n or "
                         "raise max_num_seqs")
    if speculative:
        check_supported(params)


def requests(prompts, sampling_params, priority) -> list[tuple]:
    """`generate`'s arguments as one (prompt, params, priority) per prompt: one prompt (text or token
    ids) or a non-empty list of them; params and priority each one for all or a list of one per prompt."""
    if isinstance(prompts, (str, np.ndarray)) or (isinstance(prompts, list) and prompts and is_token_ids(prompts)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise TypeError("prompts must be a str or a non-empty list of prompts")
    params = _per_prompt(SamplingParams() if sampling_params is None else sampling_params, len(prompts),
                         "sampling_params")
    return list(zip(prompts, params, _per_prompt(priority, len(prompts), "priority"), strict=True))


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


def chat_prompts(tokenizer, messages) -> list[str]:
    """One conversation (a list of {"role", "content"} dicts) or a batch of them (a list of lists), as
    vLLM's `LLM.chat` takes them, rendered by the chat template."""
    if isinstance(messages, dict):
        raise TypeError("messages is a single message dict; a conversation is a list of messages: "
                        "wrap it in a list, [{'role': ..., 'content': ...}]")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError("messages must be a non-empty list of messages ({'role': ..., 'content': ...} "
                        f"dicts), or a list of such lists; got {type(messages).__name__}")
    conversations = messages if isinstance(messages[0], (list, tuple)) else [messages]
    for conversation in conversations:
        if not conversation or not all(isinstance(m, dict) and {"role", "content"} <= m.keys()
                                       for m in conversation):
            raise TypeError("each message must be a dict with 'role' and 'content', and each "
                            f"conversation a non-empty list of them; got {conversation!r}")
        for m in conversation:
            if m["role"] not in CHAT_ROLES or not isinstance(m["content"], str):
                raise ValueError(f"a message's role must be one of {', '.join(CHAT_ROLES)} and its content a "
                                 f"str (what labkit serve takes too); got {m['role']!r} with "
                                 f"{type(m['content']).__name__} content")
    return [render_chat(tokenizer, c) for c in conversations]


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """A conversation as the chat template renders it (what `LLM.chat` and the server's chat route
    tokenize); OpenAI's "developer" role is the template's system prompt."""
    return tokenizer.apply_chat_template([{**m, "role": "system" if m["role"] == "developer" else m["role"]}
                                          for m in messages], add_generation_prompt=add_generation_prompt)


def beam_prompts(prompts) -> list:
    """`beam_search`'s prompts as a list of str or token-id prompts: each may also be vLLM's
    {"prompt": ...} or {"prompt_token_ids": ...}."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise TypeError("prompts must be a str, a dict or a non-empty list of them")
    unwrapped = []
    for prompt in prompts:
        if isinstance(prompt, dict):
            if not ("prompt" in prompt) ^ ("prompt_token_ids" in prompt):
                raise ValueError(f"a prompt dict needs one of 'prompt' or 'prompt_token_ids', got {sorted(prompt)}")
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        unwrapped.append(prompt)
    return unwrapped


def is_token_ids(prompt) -> bool:
    """A prompt given as token ids: a list or tuple of integers (numpy's included) or a numpy array.
    Floats and bools are no token ids; `encode_prompt` says so."""
    if isinstance(prompt, np.ndarray):
        return True
    return isinstance(prompt, (list, tuple)) and all(isinstance(t, (numbers.Number, np.bool_)) for t in prompt)


def _token_ids(prompt) -> list[int]:
    array = np.asarray(prompt)
    if array.ndim != 1:
        raise TypeError(f"a prompt of token ids must be one-dimensional, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"token ids must be integers, got {array.dtype} values")
    return [int(t) for t in array]
