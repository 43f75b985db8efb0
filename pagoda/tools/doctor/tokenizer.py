"""Doctor's checks of the tokenizer: it loads, its special tokens are in its vocabulary and agree with the
model's, Yuan2's fixed ids, and the chat template renders a conversation in the model family's format."""

from __future__ import annotations

from typing import Any

from pagoda.config import text_field
from pagoda.errors import PagodaError
from pagoda.frontend.chat_template import inspect_chat_template, template_folder
from pagoda.models.families import YUAN2
from pagoda.tools.doctor.check import Check, State, positive_int


def check_tokenizer(state: State, trust_remote_code: bool) -> Check:
    from pagoda.frontend.tokenizer import load_tokenizer  # lazy: torch (`pagoda` starts without it)

    path = state.tokenizer_path or state.source.location
    try:
        tokenizer = load_tokenizer(state.source, path, trust_remote_code)
    except PagodaError as exc:
        return Check(
            "tokenizer",
            "FAIL",
            exc.message,
            "pass --tokenizer <folder with tokenizer files>, or --skip-tokenizer-init and send token ids",
        )
    except Exception as exc:  # noqa: BLE001 - tokenizer libraries raise anything on a damaged file
        return Check(
            "tokenizer",
            "FAIL",
            f"the tokenizer in {path!r} does not load ({type(exc).__name__}: {exc})",
            "re-download the tokenizer files, or pass --tokenizer <folder>",
        )
    state.tokenizer, state.tokenizer_from = tokenizer, path
    return Check("tokenizer", "ok", f"{type(tokenizer).__name__} with {len(tokenizer)} tokens from {path}", None)


def check_special_tokens(state: State) -> Check:
    from pagoda.frontend.tokenizer import tokenizer_info  # lazy: torch (`pagoda` starts without it)

    tok = state.tokenizer
    size = len(tok)
    unk_id = getattr(tok, "unk_token_id", None)
    problems = []
    for role in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = getattr(tok, role, None)
        if not isinstance(token, str) or not token:
            continue
        token_id = tok.convert_tokens_to_ids(token)
        if token_id is None or (token_id == unk_id and role != "unk_token"):
            problems.append(f"{role} {token!r} is not in the vocabulary")
    info = tokenizer_info(tok, state.source)
    if problems:
        return Check(
            "special tokens",
            "FAIL",
            "; ".join(problems),
            "the tokenizer files are inconsistent: re-download them, or pass --tokenizer <folder>",
        )
    if not info.eos_token_ids:
        return Check(
            "special tokens",
            "warn",
            "no EOS token id in generation_config.json, config.json or the "
            "tokenizer: generation stops only at max_tokens or stop strings",
            "set eos_token_id in generation_config.json",
        )
    vocab = text_field(state.hf_config, "vocab_size")
    if positive_int(vocab):
        beyond = sorted(i for i in info.eos_token_ids if i >= vocab)
        if beyond:
            problems.append(f"EOS id(s) {beyond} are outside vocab_size {vocab}: the model can never emit them")
        if size > vocab:
            problems.append(
                f"the tokenizer has {size} tokens but vocab_size is {vocab}: prompts with ids >= "
                f"{vocab} will be rejected"
            )
        elif size < vocab:
            problems.append(
                f"the tokenizer has {size} tokens, fewer than vocab_size {vocab}: ids {size}..{vocab - 1} "
                "have no text and decode to nothing (the model can still sample them; prompts may "
                "contain them)"
            )
    if problems:
        return Check(
            "special tokens",
            "warn",
            "; ".join(problems),
            "check that the tokenizer (--tokenizer) and generation_config.json belong to this model",
        )
    return Check("special tokens", "ok", f"EOS id(s) {sorted(info.eos_token_ids)}, BOS {info.bos_token_id}", None)


def check_yuan_tokens(tok: Any) -> Check:
    expected = YUAN2.special_token_ids  # models/families.py
    got = {token: tok.convert_tokens_to_ids(token) for token in expected}
    wrong = [f"{t} → {got[t]} (expected {want})" for t, want in expected.items() if got[t] != want]
    if wrong:
        return Check(
            "yuan tokens",
            "FAIL",
            "; ".join(wrong),
            "use the Yuan2 tokenizer.model (pass --tokenizer <folder with Yuan2's tokenizer.model>)",
        )
    return Check("yuan tokens", "ok", ", ".join(f"{t} = {i}" for t, i in got.items()), None)


def check_chat_template(state: State, override: str | None) -> Check:
    """Renders a short user/assistant conversation: FAIL when it cannot, warn when the prompt lacks
    the turns or is not the model family's format (Yuan2's <n>/<sep>, Qwen's <|im_start|> roles)."""
    folder = template_folder(state.tokenizer_path, state.source.location)
    report = inspect_chat_template(state.tokenizer, state.hf_config, override, folder)
    if report.error:
        detail = (
            report.error
            if report.template is None
            else (f"{report.origin} does not render a user/assistant conversation: {report.error}")
        )
        return Check("chat template", "FAIL", detail, report.fix)
    if report.template is None:
        return Check(
            "chat template",
            "warn",
            "the tokenizer has no chat template: /v1/chat/completions will fail (completions work)",
            "pass --chat-template <file or template text>",
        )
    if report.warning:
        return Check("chat template", "warn", report.warning, report.fix)
    family = f", {report.family} format" if report.family else ""
    return Check("chat template", "ok", f"{report.origin} renders ({len(report.rendered or '')} chars){family}", None)
