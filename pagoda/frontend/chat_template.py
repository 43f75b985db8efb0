"""Chat messages → prompt text, with the model's Jinja chat template (or an override)."""

from __future__ import annotations

import os
from typing import Any

from pagoda.errors import InvalidRequest


def load_chat_template(value: str | None) -> str | None:
    """A `--chat-template` value: a file path, or the template text itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    return value


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], chat_template: str | None = None,
                add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
    if tokenizer is None:
        raise InvalidRequest("Chat needs a tokenizer, but the engine was started with skip_tokenizer_init=True.")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequest("This model has no chat template; pass one with --chat-template (file or inline).",
                             "chat_template")
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **template_kwargs)
    except Exception as exc:   # a template error is caused by the messages the user sent
        raise InvalidRequest(f"Could not render the chat template: {exc}", "messages") from None
