"""Chat messages → prompt text, with the model's Jinja chat template (or an override).

The server's own template (the model folder's, or `--chat-template`) is trusted: transformers
renders it, on the event loop for short messages: rendering a ChatML template costs less than the hop
to a worker thread would (benchmarks/profile/api_burst.py); long ones on `prompt_work.py`'s pool. A
template sent in a request body is not trusted: `template_sandbox.py`.

`inspect_chat_template` is the startup / `pagoda doctor` check: where the template comes from,
whether it renders a plain conversation, and whether the prompt has the model family's format.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass
from typing import Any

from pagoda.errors import ConfigError, InvalidRequest
from pagoda.models.families import FAMILIES, family_of


def load_chat_template(value: str | None) -> str | None:
    """A `--chat-template` value: a file path, or the template text itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--chat-template {value!r} cannot be read: {exc}", "chat_template") from None
    if "{" not in value:
        # A template without any {{ }} / {% %} would print itself for every conversation: a mistyped path.
        raise ConfigError(
            f"--chat-template {value!r} is neither a file nor a Jinja template; pass the path of an "
            "existing template file or the template text itself.",
            "chat_template",
        )
    return value


# Names the renderer itself sets (render_chat, apply_chat_template and the Jinja call under it): a
# chat_template_kwargs entry with one of these would collide with them instead of reaching the template.
_RENDERER_NAMES = frozenset(
    {
        "messages",
        "conversation",
        "conversations",
        "chat_template",
        "tokenizer",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "tokenizer_kwargs",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "sanitize_control_tokens",
        "template_kwargs",
    }
)
# Template inputs with a shape the renderer relies on (a list of objects each).
_LIST_OF_OBJECTS = ("tools", "documents")
# Where a request sets the same thing itself.
_REQUEST_FIELD = {
    "add_generation_prompt": "add_generation_prompt",
    "continue_final_message": "continue_final_message",
    "chat_template": "chat_template",
    "messages": "messages",
    "conversation": "messages",
    "conversations": "messages",
}
_renderer_params: dict[type, frozenset[str]] = {}


def _reserved_names(tokenizer: Any) -> frozenset[str]:
    """_RENDERER_NAMES and apply_chat_template's named parameters on this tokenizer's class (they
    vary across transformers versions)."""
    cls = type(tokenizer)
    names = _renderer_params.get(cls)
    if names is None:
        try:
            params = inspect.signature(cls.apply_chat_template).parameters.values()
            names = frozenset(
                p.name
                for p in params
                if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name not in ("self", *_LIST_OF_OBJECTS)
            )
        except (AttributeError, TypeError, ValueError):
            names = frozenset()
        names = _renderer_params[cls] = names | _RENDERER_NAMES
    return names


def check_template_kwargs(kwargs: Any, tokenizer: Any = None) -> dict[str, Any]:
    """`chat_template_kwargs` as template variables, or InvalidRequest (400) naming the bad key.

    A key the renderer sets itself is refused rather than merged: the request has its own field for
    the ones that matter (add_generation_prompt, continue_final_message, chat_template, messages)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidRequest(
            f"chat_template_kwargs must be an object, got {type(kwargs).__name__}.", "chat_template_kwargs"
        )
    if not kwargs:
        return kwargs
    reserved = _reserved_names(tokenizer)
    for key, value in kwargs.items():
        if not isinstance(key, str):
            raise InvalidRequest(f"chat_template_kwargs keys must be strings, got {key!r}.", "chat_template_kwargs")
        if key in reserved:
            field = _REQUEST_FIELD.get(key)
            hint = (
                f"set the request field `{field}` instead"
                if field
                else "it is a parameter of the chat renderer, not a template variable"
            )
            raise InvalidRequest(f"chat_template_kwargs may not contain {key!r}: {hint}.", "chat_template_kwargs")
        if (
            key in _LIST_OF_OBJECTS
            and value is not None
            and (not isinstance(value, list) or not all(isinstance(item, dict) for item in value))
        ):
            raise InvalidRequest(
                f"chat_template_kwargs.{key} must be a list of objects, got {_short(value)}.", "chat_template_kwargs"
            )
    return kwargs


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
) -> str:
    """The prompt for `messages` with a trusted template (`chat_template`, else the tokenizer's).
    `template_kwargs` are extra template variables (a request's chat_template_kwargs)."""
    if tokenizer is None:
        raise InvalidRequest("Chat needs a tokenizer, but the engine was started with skip_tokenizer_init=True.")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequest(
            "This model has no chat template; pass one with --chat-template (file or inline).", "chat_template"
        )
    variables = dict(check_template_kwargs(template_kwargs, tokenizer))
    if continue_final_message:
        variables["continue_final_message"] = True
    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt, **variables
        )
    except Exception as exc:  # a template error is caused by the messages the user sent
        raise InvalidRequest(f"Could not render the chat template: {exc}", "messages") from None


# ---------------------------------------------------------------------------------------------
# Which template is in use, and does it fit the model family (startup log, `pagoda doctor`)

PROBE = (
    {"role": "user", "content": "Probe question one"},
    {"role": "assistant", "content": "Probe answer one"},
    {"role": "user", "content": "Probe question two"},
)


@dataclass(frozen=True)
class TemplateReport:
    origin: str  # where the template comes from, for messages
    template: str | None  # None: the model has none
    rendered: str | None = None  # the probe conversation's prompt
    error: str | None = None  # why it does not render the probe conversation
    family: str | None = None  # "Yuan2" / "Qwen" when the model has a known chat format
    mismatch: str | None = None  # the format the family needs, when the prompt does not have it
    fix: str | None = None  # what to do about an error or a mismatch

    @property
    def warning(self) -> str | None:
        """The mismatch in words, the same for `pagoda serve`, `pagoda doctor` and `pagoda chat-template`
        (each adds `fix`): None when the prompt has the family's format."""
        if not self.mismatch:
            return None
        return f"{self.origin} does not produce {self.mismatch}: a probe conversation renders as {self.rendered!r}"


def template_folder(tokenizer_path: str | None, location: str) -> str:
    """Where a model's chat template file may be: the tokenizer's folder, else the model's (a .gguf: its metadata)."""
    return tokenizer_path if tokenizer_path and os.path.isdir(tokenizer_path) else location


def template_family(hf_config: dict[str, Any]) -> str | None:
    """The family whose chat format the model is trained on, where Pagoda knows it (`models/families.py`)."""
    family = family_of(hf_config)
    return family.name if family.chat_format is not None else None


def family_mismatch(family: str | None, rendered: str) -> str | None:
    """How `rendered` (the PROBE conversation with a generation prompt) departs from the family's
    format, or None when it has it (or the family's format is not known)."""
    known = FAMILIES.get(family) if family else None
    if known is None or known.renders_chat is None:
        return None
    u1, a1, u2 = (m["content"] for m in PROBE)
    return None if known.renders_chat(rendered, u1, a1, u2) else known.chat_format


def inspect_chat_template(
    tokenizer: Any, hf_config: dict[str, Any], override: str | None = None, folder: str | None = None
) -> TemplateReport:
    """The template in use (`override`: a `--chat-template` value, else the tokenizer's), where it
    comes from, and how it renders PROBE. Never raises: a template that does not render has `error`."""
    family = template_family(hf_config)
    try:
        template = (
            load_chat_template(override) if override else _template_text(getattr(tokenizer, "chat_template", None))
        )
    except ConfigError as exc:
        return TemplateReport(
            "--chat-template",
            None,
            error=exc.message,
            family=family,
            fix="pass the path of an existing template file, or the template text",
        )
    origin, model_file = _origin(override, template, folder)
    if template is None:
        return TemplateReport(origin, None, family=family)
    try:
        rendered = render_chat(tokenizer, [dict(m) for m in PROBE], template, True)
        render_chat(tokenizer, [dict(PROBE[0])], template, True)
    except InvalidRequest as exc:
        fix: str | None
        if override:
            fix = "fix the --chat-template template, or pass another one"
        elif model_file:
            fix = f"fix (or remove) the template in {model_file}, or pass --chat-template <file or template text>"
        else:
            fix = "pass --chat-template <file or template text>"
        return TemplateReport(
            origin,
            template,
            error=exc.message.removeprefix("Could not render the chat template: "),
            family=family,
            fix=fix,
        )
    mismatch = family_mismatch(family, rendered)
    fix = None
    if mismatch:
        fix = (
            f"remove the template from {model_file} (Pagoda then uses its built-in {family} format), or pass "
            "--chat-template <file>"
            if family is not None and FAMILIES[family].own_tokenizer and model_file
            else f"pass --chat-template with the model's own ({family}) template"
        )
    elif not all(m["content"] in rendered for m in PROBE):
        mismatch, fix = (
            "a prompt holding the messages (some turns are missing)",
            "check the template, or pass --chat-template",
        )
    return TemplateReport(origin, template, rendered, None, family, mismatch, fix)


def _template_text(value: Any) -> str | None:
    if isinstance(value, dict):  # several named templates: the default one renders chats
        value = value.get("default")
    return value if isinstance(value, str) and value.strip() else None


def _origin(override: str | None, template: str | None, folder: str | None) -> tuple[str, str | None]:
    """(where the template comes from, in words; the model file that holds it, if one does)."""
    if override:
        return (f"--chat-template {override}" if os.path.isfile(override) else "--chat-template (inline text)"), None
    if template is None:
        return "none", None
    from pagoda.frontend.yuan_tokenizer import YUAN_CHAT_TEMPLATE  # lazy: transformers

    if template == YUAN_CHAT_TEMPLATE:
        return "the built-in Yuan2 format", None
    if folder and os.path.isdir(folder):
        for name, key in (
            ("chat_template.jinja", None),
            ("tokenizer_config.json", "chat_template"),
            ("chat_template.json", "chat_template"),
        ):
            path = os.path.join(folder, name)
            if _file_template(path, key) == template:
                return f"the model's {name}", path
    if folder and folder.endswith(".gguf"):
        return "the GGUF file's tokenizer.chat_template", None
    return "the tokenizer's chat_template", None


def _file_template(path: str, key: str | None) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            if key is None:
                return f.read()
            value = json.load(f).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
        named = {d.get("name"): d.get("template") for d in value if isinstance(d, dict)}
        value = named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) else None
