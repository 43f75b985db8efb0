"""Load the tokenizer for a model source and collect the token facts the engine needs."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import huggingface_hub

from pagoda.errors import ModelLoadError
from pagoda.frontend.detokenizer import single_token_decoder
from pagoda.models.families import family_of
from pagoda.models.gguf_checkpoint import load_gguf_tokenizer
from pagoda.models.source import ModelSource

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass(frozen=True)
class TokenizerInfo:
    """Facts discovered at load time (never written back into a config)."""

    eos_token_ids: frozenset[int]  # any of these ends a request (unless ignore_eos)
    bos_token_id: int | None


def load_tokenizer(source: ModelSource, tokenizer_path: str, trust_remote_code: bool = False) -> Any:
    if source.kind == "gguf" and tokenizer_path == source.location:
        return load_gguf_tokenizer(source.location)
    if family_of(source.hf_config).own_tokenizer:
        return _load_yuan(tokenizer_path)
    from transformers import AutoTokenizer  # lazy: transformers

    if os.path.isdir(tokenizer_path) and not any(
        os.path.isfile(os.path.join(tokenizer_path, name)) for name in _TOKENIZER_FILES
    ):
        raise ModelLoadError(
            f"{tokenizer_path!r} has no tokenizer files; pass tokenizer=<folder> (--tokenizer), or "
            "skip_tokenizer_init=True and send token-id prompts."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"Could not load the tokenizer from {tokenizer_path!r}: {exc}") from None
    if not getattr(tokenizer, "chat_template", None) and os.path.isdir(tokenizer_path):
        tokenizer.chat_template = _processor_chat_template(tokenizer_path)
    return tokenizer


def _processor_chat_template(folder: str) -> str | None:
    """Multimodal checkpoints (Qwen2-VL) ship the template beside the processor, in
    chat_template.json ({"chat_template": ...}) or chat_template.jinja, not in tokenizer_config."""
    path = os.path.join(folder, "chat_template.json")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                value = json.load(f).get("chat_template")
        except (OSError, ValueError, AttributeError) as exc:
            raise ModelLoadError(f"{path} is not a valid chat template file: {exc}") from None
        if isinstance(value, str) and value.strip():
            return value
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read() or None
    return None


def _load_yuan(tokenizer_path: str) -> Any:
    """Yuan2's SentencePiece tokenizer built as the official code builds it, never the checkpoint's
    remote code (its tokenizer_config names a class that does not exist and the wrong BOS/EOS)."""
    from pagoda.frontend.yuan_tokenizer import load_yuan_tokenizer  # lazy: transformers

    folder = tokenizer_path
    if not os.path.exists(folder):
        folder = _download_tokenizer(tokenizer_path)
    try:
        return load_yuan_tokenizer(folder, newline_token_as_text=True)
    except (FileNotFoundError, OSError, RuntimeError) as exc:
        raise ModelLoadError(
            f"Yuan2 needs its SentencePiece tokenizer.model: {exc}. Pass --tokenizer <folder with "
            "tokenizer.model>, or --skip-tokenizer-init and send token-id prompts."
        ) from None


def _download_tokenizer(repo_id: str) -> str:
    try:
        return huggingface_hub.snapshot_download(
            repo_id, allow_patterns=["tokenizer*", "*.model", "special_tokens_map.json", "chat_template*"]
        )
    except Exception as exc:  # offline, unknown repo, auth: one message for the user
        raise ModelLoadError(
            f"Tokenizer {repo_id!r} is not a local folder and could not be fetched from the hub ({type(exc).__name__})."
        ) from None


def tokenizer_info(tokenizer: Any | None, source: ModelSource) -> TokenizerInfo:
    """EOS ids from generation_config.json, config.json and the tokenizer, merged."""
    eos: set[int] = set()
    for value in (
        source.generation_config().get("eos_token_id"),
        source.hf_config.get("eos_token_id"),
        getattr(tokenizer, "eos_token_id", None),
    ):
        if isinstance(value, int):
            eos.add(value)
        elif isinstance(value, list):
            eos.update(v for v in value if isinstance(v, int))
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        bos = source.hf_config.get("bos_token_id")
    return TokenizerInfo(frozenset(eos), bos if isinstance(bos, int) else None)


def fast_encoder(tokenizer: Any, release_gil: bool = False) -> Callable[[str, bool], list[int]]:
    """`encode(text, add_special_tokens)` = `tokenizer.encode(text, add_special_tokens=...)`, straight through
    the backend's Rust `Tokenizer.encode` when that is provably the same function: a stock fast tokenizer
    (no overridden or patched encode) whose backend has no truncation or padding set and splits special
    tokens as the tokenizer says, and which agrees on a few probe texts. transformers' own path (a one-item
    `encode_batch` plus the BatchEncoding around it) costs more than the encode itself, and the API process
    tokenizes every completion prompt on its event loop: at a burst of hundreds of requests that is part
    of everyone's time to first token. Anything else gets `tokenizer.encode`.

    `release_gil`: for a worker thread, the backend's one-item `encode_batch` instead, which releases the
    GIL while it runs (its one-text `encode` holds it, which would stall the event loop as surely as
    calling it there)."""

    def general(text: str, add_special_tokens: bool) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    try:
        from transformers import PreTrainedTokenizerFast  # lazy: transformers
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase  # lazy: transformers

        cls = type(tokenizer)
        backend: Any = getattr(tokenizer, "_tokenizer", None)
        if not (
            isinstance(tokenizer, PreTrainedTokenizerFast)
            and cls.encode is PreTrainedTokenizerBase.encode
            and cls._encode_plus is PreTrainedTokenizerFast._encode_plus
            and "encode" not in vars(tokenizer)
            and "_encode_plus" not in vars(tokenizer)
            and callable(getattr(backend, "encode", None))
        ):
            return general

        def encode(text: str, add_special_tokens: bool) -> list[int]:
            if not _backend_as_configured(tokenizer, backend):
                return general(text, add_special_tokens)
            if release_gil:
                return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
            return backend.encode(text, add_special_tokens=add_special_tokens).ids

        specials = "".join(list(getattr(tokenizer, "all_special_tokens", None) or ())[:4])
        probes = ["Hello world", "  two  spaces\n\tand a tab", "héllo 世界 🙂", f"{specials}user hi{specials}", ""]
        if all(encode(text, flag) == general(text, flag) for text in probes for flag in (True, False)):
            return encode
    except Exception:  # noqa: BLE001 - anything unexpected: the general path is always right
        return general
    return general


def _backend_as_configured(tokenizer: Any, backend: Any) -> bool:
    """The backend has no truncation or padding set and splits special tokens as the tokenizer says."""
    return (
        backend.truncation is None
        and backend.padding is None
        and backend.encode_special_tokens == bool(tokenizer.split_special_tokens)
    )


# Texts on which a tokenizer that folds characters (drops or merges them while normalizing: runs of
# spaces, control or zero-width characters, combining marks) makes one token cover more characters
# than any of its pieces spells.
_FOLDING_PROBES = (" " * 512, "\n" * 512, "\t" * 512, "\u3000" * 512, "\x00" * 512, "\u200b" * 512, "e\u0301" * 256)


def longest_token_chars(tokenizer: Any) -> int | None:
    """The most characters of text one token can stand for: the longest piece of the vocabulary, decoded
    (and spelt: a byte-level piece spells one character per byte, which bounds the characters it decodes
    to). A prompt of more characters than `max_model_len` times this can never fit in the context.
    None when there is no such bound: a probe text took fewer tokens than its length allows, so this
    tokenizer's normalizer folds characters (e.g. SentencePiece collapsing runs of spaces)."""
    try:
        size = len(tokenizer)
        backend: Any = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and callable(getattr(backend, "decode_batch", None)):
            ids = [[i] for i in range(size)]
            decoded = backend.decode_batch(ids, skip_special_tokens=False)  # Rust, all cores: ~50 ms at 150k
        else:  # the detokenizer's exact shortcut where one applies (Yuan2's `fast_decode`), else `decode`
            token_text = single_token_decoder(tokenizer)
            decoded = [token_text(i) for i in range(size)]
        pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
        longest = max(
            max((len(text) for text in decoded), default=0),
            max((len(piece) for piece in pieces if isinstance(piece, str)), default=0),
        )
        if longest < 1:
            return None
        for probe in _FOLDING_PROBES:
            if len(probe) > longest * len(tokenizer.encode(probe, add_special_tokens=False)):
                return None
    except Exception:  # noqa: BLE001 - an exotic tokenizer: no bound, every prompt is tokenized
        return None
    return longest
