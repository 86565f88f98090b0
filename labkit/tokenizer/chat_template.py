"""Rendering a chat template the way transformers does, so the engine builds identical prompts.

transformers renders templates in a sandboxed Jinja environment with trim_blocks and
lstrip_blocks on, the loopcontrols extension, and `raise_exception` available; the special
tokens (bos_token, eos_token, ...) are passed in as variables.
"""

from collections.abc import Mapping, Sequence
from functools import lru_cache


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def check_messages(messages) -> None:
    if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                        f"got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a chat template needs at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {message!r}")
        for key in ("role", "content"):
            if not isinstance(message[key], str):
                raise TypeError(f"messages[{i}][{key!r}] must be a str, got {type(message[key]).__name__}")


def render_chat_template(template: str, messages, add_generation_prompt: bool = False, **variables) -> str:
    """The prompt text for `messages` (a list of {'role', 'content'} dicts)."""
    check_messages(messages)
    return _compile(template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
    )
