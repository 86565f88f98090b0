"""OpenAI's request bodies, checked and turned into what the engine understands.

Every field of a request body is looked up in one of four tables below, so the server's contract
reads in one place and growing it (when the engine learns a new field) is a one-line move from
`UNSUPPORTED` to `SAMPLING_FIELDS`:

- `SAMPLING_FIELDS`: passed on to `SamplingParams` (which validates them; its message names the field).
- `REQUEST_FIELDS`: read by the server itself (the prompt, `stream`, `echo`, ...).
- `IGNORED`: bookkeeping fields OpenAI accepts that change nothing about the tokens (`user`, ...).
- `UNSUPPORTED`: fields labkit cannot honour; accepted only at their "off" value, refused otherwise
  rather than silently ignored, so a client never believes it got something it did not.

Anything else is refused as OpenAI does: "Unrecognized request argument supplied: <name>".
"""

import json
import sys
from dataclasses import dataclass, replace

from labkit.engine.inputs import CHAT_ROLES
from labkit.sampling import SamplingParams


class RequestError(Exception):
    """A request the server refuses; rendered as OpenAI's error JSON with its HTTP status."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# OpenAI name -> SamplingParams name. top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids,
# min_tokens, allowed_token_ids, prompt_logprobs and include_stop_str_in_output are not OpenAI's but
# vLLM's extra fields (the openai client sends them through `extra_body`).
SAMPLING_FIELDS = {
    "max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
    "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty", "seed": "seed",
    "stop": "stop", "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "n": "n",
    "min_tokens": "min_tokens", "logit_bias": "logit_bias", "allowed_token_ids": "allowed_token_ids",
    "prompt_logprobs": "prompt_logprobs", "include_stop_str_in_output": "include_stop_str_in_output",
}
# The legacy completions route's `logprobs` is a count (SamplingParams' own); the chat route's is a
# switch, with the count in `top_logprobs`.
COMPLETION_FIELDS = {"model", "prompt", "stream", "stream_options", "echo", "logprobs"}
CHAT_FIELDS = {"model", "messages", "stream", "stream_options", "logprobs", "top_logprobs"}
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
           "safety_identifier"}
# field -> (its "off" values, why it is refused otherwise)
UNSUPPORTED = {
    "best_of": ((None, 1), "labkit's server returns every sample it draws (ask for n); best_of must be 1"),
    "suffix": ((None, ""), "labkit's engine does not insert text (no suffix)"),
    "tools": ((None, []), "labkit's server has no tool calling"),
    "tool_choice": ((None, "none"), "labkit's server has no tool calling"),
    "functions": ((None, []), "labkit's server has no function calling"),
    "function_call": ((None, "none"), "labkit's server has no function calling"),
    "response_format": ((None, {"type": "text"}), "labkit's engine cannot constrain output to a format"),
    "modalities": ((None, ["text"]), "labkit's model produces text only"),
    "audio": ((None,), "labkit's model produces text only"),
    "prediction": ((None,), "labkit's engine has no predicted outputs"),
    "reasoning_effort": ((None,), "labkit's model is not a reasoning model"),
}


@dataclass(frozen=True)
class Limits:
    """What one request may cost the server, refused before it costs it."""

    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None  # None: whatever max_model_len leaves room for
    max_waiting: int = 256  # requests queued but not yet running; more get 503
    max_stop: int = 16  # stop strings, and stop_token_ids, per request (the stop check runs on each every token)
    max_stop_chars: int = 256  # characters in one stop string
    max_logit_bias: int = 300  # logit_bias entries per request
    max_allowed_token_ids: int = 4096  # allowed_token_ids entries per request
    read_timeout_s: float = 10.0  # a request's headers and body must arrive within this
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    max_connections: int = 256  # open connections; a request beyond them gets 503 (uvicorn's limit_concurrency)
    max_header_bytes: int = 16 * 1024  # a request's line and headers (h11's limit)
    death_drain_s: float = 2.0  # after the engine thread died: /health says so this long, then the server exits


def parse_json(body: bytes) -> dict:
    """A request body as a JSON object, or a RequestError saying why not. Python's parser takes more than
    the JSON a tokenizer can read, so it is checked here: a lone surrogate escape ("\\ud800") parses into
    a str no UTF-8 codec encodes, nesting deeper than the interpreter's recursion limit raises
    RecursionError, and an integer of over 4,300 digits ValueError."""
    try:
        data = json.loads(body)
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise RequestError("request body is nested too deeply", None) from None
    except UnicodeEncodeError as error:
        raise RequestError(f"request body holds a lone surrogate escape ({error.object[error.start]!r}), "
                           "which is not Unicode text", None) from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, an integer too long to convert
        raise RequestError(f"request body is not valid JSON: {error}", None) from None
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object", None)
    return data


@dataclass(frozen=True)
class CompletionRequest:
    """A checked request: the prompt (text or token ids), its sampling and how to answer."""

    prompt: str | list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool
    max_tokens_given: bool  # if not, the server fills max_tokens from the context left


def parse_completion(body: dict, model_name: str, limits: Limits = Limits()) -> CompletionRequest:
    _check_fields(body, COMPLETION_FIELDS)
    _check_model(body, model_name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        raise RequestError("prompt: labkit's server takes one prompt per request (a string or a list of "
                           f"token ids), got a batch of {len(prompt)}", "prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt is empty", "prompt")
    elif isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise RequestError("prompt must be a non-empty string or a non-empty list of token ids", "prompt")
    else:
        raise RequestError(f"prompt must be a string or a list of token ids, got {_json_type(prompt)}", "prompt")
    echo = _bool(body, "echo")
    params = _sampling(body, limits)
    if body.get("logprobs") is not None:
        params = _with_logprobs(params, body["logprobs"], "logprobs")
    return CompletionRequest(prompt, params, _bool(body, "stream"), _include_usage(body), echo,
                             _max_tokens_given(body))


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    params: SamplingParams
    stream: bool
    include_usage: bool
    max_tokens_given: bool
    top_logprobs: int | None  # None: no logprobs asked


def parse_chat(body: dict, model_name: str, limits: Limits = Limits()) -> ChatRequest:
    _check_fields(body, CHAT_FIELDS)
    _check_model(body, model_name)
    checked = _messages(body.get("messages"))
    params, top_logprobs = _sampling(body, limits), None
    if _bool(body, "logprobs"):
        top_logprobs = body.get("top_logprobs") or 0
        params = _with_logprobs(params, top_logprobs, "top_logprobs")
    elif body.get("top_logprobs") not in (None, 0):
        raise RequestError("top_logprobs needs logprobs set to true", "top_logprobs")
    return ChatRequest(checked, params, _bool(body, "stream"), _include_usage(body), _max_tokens_given(body),
                       top_logprobs)


TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_generation_prompt", "add_special_tokens", "return_token_strs"}


@dataclass(frozen=True)
class TokenizeRequest:
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template as /v1/chat/completions does."""

    prompt: str | None
    messages: list[dict] | None
    add_generation_prompt: bool
    add_special_tokens: bool
    return_token_strs: bool


def parse_tokenize(body: dict, model_name: str) -> TokenizeRequest:
    _only_fields(body, TOKENIZE_FIELDS)
    _check_model(body, model_name)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise RequestError("give a prompt (a string) or messages, one of them", "prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise RequestError(f"prompt must be a string, got {_json_type(prompt)}", "prompt")
    add_generation_prompt = body.get("add_generation_prompt", True) if messages is not None else False
    if not isinstance(add_generation_prompt, bool):
        raise RequestError("add_generation_prompt must be true or false", "add_generation_prompt")
    return TokenizeRequest(prompt, None if messages is None else _messages(messages), add_generation_prompt,
                           _bool(body, "add_special_tokens"), _bool(body, "return_token_strs"))


def parse_detokenize(body: dict, model_name: str, vocab_size: int) -> list[int]:
    """vLLM's /detokenize: the token ids to turn back into text."""
    _only_fields(body, {"model", "tokens"})
    _check_model(body, model_name)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
                                               for t in tokens):
        raise RequestError(f"tokens must be a list of token ids in [0, {vocab_size})", "tokens")
    return tokens


def _only_fields(body: dict, fields: set[str]) -> None:
    for name in body:
        if name not in fields:
            raise RequestError(f"Unrecognized request argument supplied: {name}", name)


def _with_logprobs(params: SamplingParams, count, name: str) -> SamplingParams:
    """`params` asking for `count` top logprobs per token; SamplingParams checks the range, named `name`."""
    try:
        return replace(params, logprobs=count)
    except (TypeError, ValueError) as error:
        raise RequestError(f"{name}: {error}", name) from None


def _messages(messages) -> list[dict]:
    """Chat messages checked: each a role the server takes and text content (LLM.chat takes the same)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {'role', 'content'} objects", "messages")
    checked = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with 'role' and 'content'", where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", f"{where}.role")
        checked.append({"role": role, "content": _message_text(message.get("content"), f"{where}.content")})
    return checked


def _message_text(content, where: str) -> str:
    """A message's text: a string, or OpenAI's list of content parts of which only text ones are served."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}[{j}]: labkit's model reads text parts only "
                                   "({'type': 'text', 'text': ...})", f"{where}[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"{where} must be a string or a list of text parts, got {_json_type(content)}", where)


def _check_fields(body: dict, own: set[str]) -> None:
    for name, value in body.items():
        if name in UNSUPPORTED:
            off, why = UNSUPPORTED[name]
            if value not in off:
                raise RequestError(f"{name}={value!r} is not supported: {why}", name)
        elif name not in own and name not in SAMPLING_FIELDS and name not in IGNORED:
            raise RequestError(f"Unrecognized request argument supplied: {name}", name)


def _check_model(body: dict, model_name: str) -> None:
    model = body.get("model", model_name)
    if model != model_name:
        raise RequestError(f"The model {model!r} does not exist; this server serves {model_name!r}", "model",
                           status=404, code="model_not_found")


def _sampling(body: dict, limits: Limits) -> SamplingParams:
    """SamplingParams from the body; each field is checked on its own so the error names it."""
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise RequestError("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    kwargs = {}
    for name, field in SAMPLING_FIELDS.items():
        value = body.get(name)
        if value is None:
            continue
        if name == "stop" and isinstance(value, str):
            value = [value]
        if name == "logit_bias":
            value = _logit_bias(value)
        _check_size(name, value, limits)
        # min_tokens alone is checked against any max_tokens (the server may fill max_tokens in later).
        alone = {field: value, **({"max_tokens": sys.maxsize} if field == "min_tokens" else {})}
        try:
            SamplingParams(**alone)
        except (TypeError, ValueError) as error:
            message = str(error)
            if field != name:
                message = f"{name}: {message}"
            raise RequestError(message, name) from None
        kwargs[field] = value
    if "max_tokens" not in kwargs:  # a stand-in the server replaces by what the context leaves
        kwargs["max_tokens"] = max(kwargs.get("min_tokens", 0), SamplingParams.max_tokens)
    try:
        return SamplingParams(**kwargs)
    except ValueError as error:  # fields that disagree, e.g. min_tokens above max_tokens: the message names one
        name = str(error).split()[0]
        raise RequestError(str(error), name if name in SAMPLING_FIELDS else None) from None


def _logit_bias(value):
    """OpenAI's logit_bias: JSON object keys are strings, so token ids come as "1234"."""
    if not isinstance(value, dict) or not all(isinstance(k, str) and k.isdecimal() and len(k) < 10 for k in value):
        raise RequestError("logit_bias must map token ids (as strings of digits, e.g. \"1234\") to a bias in "
                           "[-100, 100]", "logit_bias")
    return {int(k): v for k, v in value.items()}


def _check_size(name: str, value, limits: Limits) -> None:
    """The caps on what one request makes the engine check every token."""
    caps = {"stop": limits.max_stop, "stop_token_ids": limits.max_stop, "logit_bias": limits.max_logit_bias,
            "allowed_token_ids": limits.max_allowed_token_ids}
    if name in caps and isinstance(value, (list, dict)) and len(value) > caps[name]:
        raise RequestError(f"{name} has {len(value)} entries; this server takes at most {caps[name]}", name)
    if name == "stop" and isinstance(value, list):
        longest = max((len(s) for s in value if isinstance(s, str)), default=0)
        if longest > limits.max_stop_chars:
            raise RequestError(f"stop strings may be at most {limits.max_stop_chars} characters long, got one of "
                               f"{longest}", name)


def _max_tokens_given(body: dict) -> bool:
    return body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None


def _bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {_json_type(value)}", name)
    return value


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError("stream_options may only hold include_usage", "stream_options")
    if not _bool(body, "stream"):
        raise RequestError("stream_options is only allowed when stream is true", "stream_options")
    return _bool(options, "include_usage")


def _json_type(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")
