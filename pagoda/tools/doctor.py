"""`pagoda doctor MODEL`: preflight checks of a model folder and of the machine, before any weight loads.

Every failure this catches would otherwise surface late: a missing or truncated shard half-way
through loading, a tokenizer error at startup, a broken chat template on the first chat request, a
taken port after minutes of loading. Each check reads metadata only (config
files, safetensors headers, zip directories of .bin shards), except the checksums check, which hashes
the weight files whose sha256 is known (tools/checksums.py; `--no-checksums` skips it), and reports one line:

    [ ok ] shards: 2 safetensors shards, all listed in model.safetensors.index.json
    [FAIL] safetensors: model-00002-of-00002.safetensors is truncated ... → re-download it

`run_checks(..., fast=True)` is the subset `pagoda serve` runs before loading weights: no GPU
context, no chat rendering, no model construction; everything in it takes well under a second
except reading a GGUF header or loading the tokenizer, which serving needs next anyway.
A check never raises: an unexpected exception becomes a FAIL line for that check.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shutil
import socket
import struct
import sys
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pagoda import envs
from pagoda.config import EngineArgs, _derived_max_model_len, text_field
from pagoda.config.parallel import tensor_parallel_error
from pagoda.config.quantization import resolve_quantization
from pagoda.config.server import ServerConfig
from pagoda.errors import ConfigError, ModelLoadError, PagodaError
from pagoda.frontend.chat_template import inspect_chat_template, template_folder
from pagoda.models.families import YUAN2, family_of
from pagoda.tools import checksums

Status = Literal["ok", "warn", "FAIL"]

_SAFETENSORS_INDEX = "model.safetensors.index.json"
_NUMBERED = re.compile(r"^(?P<prefix>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.(?P<ext>safetensors|bin)$")
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
# Bytes per element of each safetensors dtype; sub-byte and exotic dtypes are not size-checked.
_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "C64": 8,
}
# Files a tokenizer folder may hold (all of them must be readable when present).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.json",
    "chat_template.jinja",
)
_OTHER_FILES = (
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    _SAFETENSORS_INDEX,
    "pytorch_model.bin.index.json",
)
_DISK_FACTOR = 1.5
_SHM_MIN_BYTES = 1 << 30
_GIB = 1 << 30


@dataclass
class Check:
    name: str
    status: Status
    detail: str
    fix: str | None = None


@dataclass
class _State:
    """What earlier checks found, for the later ones (a check whose input failed is left out)."""

    model: str | None
    tokenizer_path: str | None
    source: Any = None  # ModelSource once config.json / the GGUF header parsed
    weight_format: str | None = None  # "safetensors" | "bin" | "gguf"
    weight_files: list[str] = field(default_factory=list)  # what the loader reads, in order
    unreadable: set[str] = field(default_factory=set)
    headers: dict[str, dict[str, Any]] = field(default_factory=dict)  # safetensors file -> header
    shards_ok: bool = False  # the shard set is complete and consistent with its index
    headers_complete: bool = False
    tokenizer: Any = None

    @property
    def folder(self) -> str | None:
        return self.source.folder if self.source is not None else None

    @property
    def hf_config(self) -> dict[str, Any]:
        return self.source.hf_config if self.source is not None else {}

    @property
    def weights_bytes(self) -> int:
        return sum(os.path.getsize(p) for p in self.weight_files if os.path.isfile(p))


def run_checks(
    model: str | None,
    *,
    port: int | None = None,
    tensor_parallel_size: int = 1,
    distributed_executor_backend: str = "mp",
    fast: bool = False,
    tokenizer: str | None = None,
    host: str = "0.0.0.0",
    device: str = "auto",
    skip_tokenizer_init: bool = False,
    chat_template: str | None = None,
    trust_remote_code: bool = False,
    load_format: str = "auto",
    checksums: bool = True,
) -> list[Check]:
    """All checks in order; `fast` keeps the subset `pagoda serve` runs before loading weights (which never
    hashes the shards); `checksums=False` skips hashing them (`--no-checksums`).

    `model` is an HF folder, hub id or .gguf file (None: the embedded default model), as for serve.
    """
    state = _State(model=model, tokenizer_path=tokenizer)
    out: list[Check] = []

    def run(name: str, fn: Callable[[], Iterable[Check] | Check | None]) -> None:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - the report must always be complete
            out.append(
                Check(
                    name,
                    "FAIL",
                    f"unexpected error: {type(exc).__name__}: {exc}",
                    "report this as a Pagoda bug, with the model folder's file listing",
                )
            )
            return
        if isinstance(result, Check):
            out.append(result)
        elif result is not None:
            out.extend(result)

    run("config", lambda: _check_config(state))
    if state.source is not None:
        run("architecture", lambda: _check_architecture(state.hf_config))
        run("config fields", lambda: _check_config_fields(state.hf_config))
        run("quantization", lambda: _check_quantization(state, load_format))
        if _is_qwen2_vl(state.hf_config):
            run("vision config", lambda: _check_vision_config(state.hf_config))
            run("preprocessor config", lambda: _check_preprocessor(state))
        if tensor_parallel_size != 1:
            run("tensor parallel", lambda: _check_tensor_parallel(state.hf_config, tensor_parallel_size))
        if load_format == "dummy":
            out.append(Check("shards", "ok", "--load-format dummy: random weights, no checkpoint is read", None))
        else:
            run("shards", lambda: _check_shards(state))
        run("permissions", lambda: _check_permissions(state, skip_tokenizer_init))
        if state.weight_format == "safetensors" and state.weight_files:
            run("safetensors", lambda: _check_safetensors(state))
            run("index", lambda: _check_index_consistency(state))
        elif state.weight_format == "bin" and state.weight_files:
            run("pytorch bin", lambda: _check_bin_files(state))
        if not fast and checksums and state.weight_files and load_format != "dummy":
            run("checksums", lambda: _check_checksums(state))
        quantized = any(c.name == "quantization" for c in out)
        # A quantized checkpoint's tensors are not the unquantized model's: the quantization check covers them.
        if not fast and state.headers_complete and not quantized:
            run("checkpoint vs model", lambda: _check_weights_match_model(state))
        run("disk", lambda: _check_disk(state))
        if skip_tokenizer_init:
            out.append(Check("tokenizer", "ok", "skipped (--skip-tokenizer-init: token-id prompts only)", None))
        else:
            run("tokenizer", lambda: _check_tokenizer(state, trust_remote_code))
            if state.tokenizer is not None:
                run("special tokens", lambda: _check_special_tokens(state))
                if _is_yuan(state.hf_config):
                    run("yuan tokens", lambda: _check_yuan_tokens(state.tokenizer))
                if not fast:
                    run("chat template", lambda: _check_chat_template(state, chat_template))
    if not fast:
        run("cuda", lambda: _check_cuda(state, device, tensor_parallel_size, distributed_executor_backend))
    if port is not None:
        run("port", lambda: _check_port(host, port))
    if tensor_parallel_size > 1:
        run("/dev/shm", _check_shm)
    return out


# ---------------------------------------------------------------------------------------------
# Model folder


def _check_config(state: _State) -> Check:
    from pagoda.models.source import ModelSource, resolve_model_source  # lazy: torch (`pagoda` starts without it)

    model = state.model
    if model is None or model.endswith(".gguf"):
        return _check_gguf_config(state)
    if os.path.isdir(model):
        path = os.path.join(model, "config.json")
        if not os.path.lexists(path):
            return Check(
                "config",
                "FAIL",
                f"{model} has no config.json",
                "pass an HF model folder (with config.json) or a .gguf file; re-download the model",
            )
        problem = _unreadable_reason(path)
        if problem:
            return Check("config", "FAIL", f"config.json {problem}", _read_fix(path))
        try:
            with open(path, encoding="utf-8") as f:
                hf_config = json.load(f)
        except ValueError as exc:
            return Check(
                "config",
                "FAIL",
                f"config.json is not valid JSON ({exc})",
                "re-download config.json or fix the syntax error",
            )
        if not isinstance(hf_config, dict):
            return Check(
                "config",
                "FAIL",
                f"config.json holds a {type(hf_config).__name__}, not a JSON object",
                "re-download config.json",
            )
        state.source = ModelSource(location=model, kind="hf", hf_config=hf_config)
        return Check("config", "ok", f"{path} parses", None)
    if model.startswith(("/", ".", "~")) or model.count("/") > 1 or os.path.exists(model):
        return Check(
            "config",
            "FAIL",
            f"model folder {model!r} does not exist",
            "pass the path of a downloaded model folder, a hub id, or a .gguf file",
        )
    try:
        state.source = resolve_model_source(model)  # a hub id: the local cache first, then the hub
    except (PagodaError, OSError, ValueError) as exc:
        return Check("config", "FAIL", str(exc), "download the model and pass its folder")
    return Check("config", "ok", f"{model} → {state.source.location}", None)


def _check_gguf_config(state: _State) -> Check:
    from pagoda.models.gguf_checkpoint import default_gguf_path, read_gguf_config  # lazy: torch
    from pagoda.models.source import ModelSource  # lazy: torch (`pagoda` starts without it)

    try:
        path = state.model if state.model is not None else default_gguf_path()
    except PagodaError as exc:
        return Check("config", "FAIL", exc.message, "pass a model folder or .gguf file")
    if not os.path.lexists(path):
        return Check("config", "FAIL", f"GGUF file {path!r} does not exist", "pass an existing .gguf file")
    problem = _unreadable_reason(path)
    if problem:
        return Check("config", "FAIL", f"{path} {problem}", _read_fix(path))
    try:
        hf_config = read_gguf_config(path)
    except PagodaError as exc:
        return Check("config", "FAIL", f"{path}: {exc.message}", "re-convert or re-download the GGUF file")
    except Exception as exc:  # noqa: BLE001 - the GGUF reader raises plain errors on damaged files
        return Check(
            "config",
            "FAIL",
            f"{path}: the GGUF reader cannot parse it ({type(exc).__name__}: {exc})",
            "re-download the GGUF file (it is damaged or truncated)",
        )
    state.source = ModelSource(location=path, kind="gguf", hf_config=hf_config)
    state.weight_format, state.weight_files = "gguf", [path]
    label = "embedded default model " if state.model is None else ""
    return Check("config", "ok", f"{label}{path}: GGUF metadata read", None)


def _check_architecture(hf_config: dict[str, Any]) -> Check:
    from pagoda.models.registry import supported_architectures  # lazy: torch (`pagoda` starts without it)

    archs = hf_config.get("architectures")
    supported = supported_architectures()
    if not archs or not isinstance(archs, list):
        return Check(
            "architecture",
            "FAIL",
            'config.json has no "architectures" list',
            f'add "architectures": ["..."] naming one of {", ".join(supported)}',
        )
    if archs[0] not in supported:
        return Check(
            "architecture",
            "FAIL",
            f"{archs[0]} is not supported",
            f"Pagoda serves {', '.join(supported)}; pick a model of one of these architectures",
        )
    return Check("architecture", "ok", f"{archs[0]} is supported", None)


def _check_config_fields(cfg: dict[str, Any]) -> Check:
    if _is_yuan(cfg):
        from pagoda.models.yuan import YuanShape  # lazy: torch (`pagoda` starts without it)

        missing = [
            k
            for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")
            if not _positive_int(cfg.get(k))
        ]
        if missing:
            return Check(
                "config fields",
                "FAIL",
                f"config.json lacks positive integers for {', '.join(missing)}",
                "re-download config.json",
            )
        try:
            shape = YuanShape(cfg)
        except PagodaError as exc:
            hint = "fix config.json (see docs/models.md, Yuan2: reading config.json)"
            return Check("config fields", "FAIL", exc.message, hint)
        kind = f"MoE {shape.num_experts} experts top-{shape.top_k}" if shape.use_moe else "dense"
        return Check(
            "config fields",
            "ok",
            f"Yuan2 {kind}: hidden {shape.hidden}, {shape.num_heads} heads, "
            f"{cfg['num_hidden_layers']} layers, vocab {cfg['vocab_size']}",
            None,
        )
    keys = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")
    values = {k: text_field(cfg, k) for k in keys}
    missing = [k for k, v in values.items() if not _positive_int(v)]
    if missing:
        return Check(
            "config fields",
            "FAIL",
            f"config.json lacks positive integers for {', '.join(missing)}",
            "re-download config.json (a text model's config names all of them)",
        )
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    kv_heads = text_field(cfg, "num_key_value_heads", heads)
    head_dim = text_field(cfg, "head_dim")
    problems = []
    if not _positive_int(kv_heads) or heads % kv_heads:
        problems.append(f"num_attention_heads {heads} must be a multiple of num_key_value_heads {kv_heads}")
    if head_dim is None and hidden % heads:
        problems.append(f"hidden_size {hidden} is not divisible by num_attention_heads {heads} (and no head_dim)")
    if head_dim is not None and not _positive_int(head_dim):
        problems.append(f"head_dim {head_dim!r} must be a positive integer")
    if problems:
        return Check("config fields", "FAIL", "; ".join(problems), "fix config.json or re-download it")
    return Check(
        "config fields",
        "ok",
        f"hidden {hidden}, {heads} heads ({kv_heads} KV), "
        f"{values['num_hidden_layers']} layers, vocab {values['vocab_size']}",
        None,
    )


def _check_quantization(state: _State, load_format: str) -> Check | None:
    """A quantized checkpoint: the layout `pagoda serve` will run, or the one-line refusal it would give
    (rather than letting the tensor mismatch read as a damaged download). Silent for unquantized ones."""
    source = state.source
    try:
        config = resolve_quantization(
            None, source.location, source.kind, source.hf_config, read_tensor_names=load_format != "dummy"
        )
    except ModelLoadError as exc:
        return Check("quantization", "FAIL", exc.message, "use a checkpoint in one of the supported layouts")
    if config is None:
        return None
    return Check("quantization", "ok", config.describe(), None)


def _check_vision_config(cfg: dict[str, Any]) -> Check:
    from pagoda.models.qwen2_vl_vision import vision_config_with_defaults  # lazy: torch (`pagoda` starts without it)

    if not isinstance(cfg.get("vision_config") or {}, dict):
        return Check("vision config", "FAIL", "config.json's vision_config is not an object", "re-download config.json")
    try:
        vision = vision_config_with_defaults(dict(cfg.get("vision_config") or {}), int(text_field(cfg, "hidden_size")))
    except PagodaError as exc:
        return Check("vision config", "FAIL", exc.message, "fix vision_config in config.json or re-download it")
    return Check(
        "vision config",
        "ok",
        f"depth {vision['depth']}, embed {vision['embed_dim']}, "
        f"{vision['num_heads']} heads, patch {vision['patch_size']}, merge {vision['spatial_merge_size']}, "
        f"output {vision['hidden_size']}",
        None,
    )


def _check_preprocessor(state: _State) -> Check:
    from pagoda.frontend.multimodal.image_processor import VisionPreprocessConfig  # lazy: PIL, numpy
    from pagoda.models.qwen2_vl_vision import vision_config_with_defaults  # lazy: torch (`pagoda` starts without it)

    folder = state.folder
    path = os.path.join(folder, "preprocessor_config.json")
    try:
        pre = VisionPreprocessConfig.from_model_folder(folder)
    except PagodaError as exc:
        return Check("preprocessor config", "FAIL", exc.message, "fix preprocessor_config.json or re-download it")
    where = "preprocessor_config.json" if os.path.isfile(path) else "no preprocessor_config.json: official defaults"
    try:
        vision = vision_config_with_defaults(
            dict(state.hf_config.get("vision_config") or {}), int(text_field(state.hf_config, "hidden_size"))
        )
    except (PagodaError, TypeError, ValueError):
        vision = None  # reported by the vision config check
    if vision is not None:
        clashes = [
            f"{key} {getattr(pre, key)} vs vision_config {vision[vkey]}"
            for key, vkey in (
                ("patch_size", "patch_size"),
                ("merge_size", "spatial_merge_size"),
                ("temporal_patch_size", "temporal_patch_size"),
            )
            if int(getattr(pre, key)) != int(vision[vkey])
        ]
        if clashes:
            return Check(
                "preprocessor config",
                "FAIL",
                f"{where} disagrees with config.json: {'; '.join(clashes)}",
                "the two files come from different checkpoints; re-download the model",
            )
    return Check(
        "preprocessor config",
        "ok",
        f"{where} (pixels {pre.min_pixels}..{pre.max_pixels}, patch {pre.patch_size}, merge {pre.merge_size})",
        None,
    )


def _check_tensor_parallel(cfg: dict[str, Any], tp: int) -> Check:
    """The rule `pagoda serve` refuses by (config/parallel.py): a FAIL carries serve's own refusal line."""
    error = tensor_parallel_error(cfg, tp)
    if error is not None:
        return Check("tensor parallel", "FAIL", error, "pass one of the valid sizes as --tensor-parallel-size")
    heads = int(text_field(cfg, "num_attention_heads"))
    kv = int(text_field(cfg, "num_key_value_heads") or heads)
    if kv >= tp:
        kv_split = f"{kv} KV heads split {kv // tp} per GPU"
    else:
        kv_split = f"{kv} KV heads replicated (each on {tp // kv} GPUs, 1 per GPU)"
    detail = f"{tp} GPUs: {heads} attention heads split {heads // tp} per GPU, {kv_split}"
    if _is_qwen2_vl(cfg):
        detail += "; the vision tower is replicated on every GPU"
    return Check("tensor parallel", "ok", detail, None)


def _check_shards(state: _State) -> list[Check]:
    """Shards vs the index both ways (safetensors, else .bin), then the list the loader will read."""
    from pagoda.models import source as src  # lazy: torch (`pagoda` starts without it)

    if state.weight_format == "gguf":
        path = state.weight_files[0]
        return [Check("shards", "ok", f"single GGUF file ({_size(os.path.getsize(path))})", None)]
    folder = state.folder
    names = sorted(os.listdir(folder))
    if src.has_safetensors(folder):
        fmt, index, ext, pattern = "safetensors", _SAFETENSORS_INDEX, ".safetensors", src._SHARD_PATTERN
        list_paths: Callable[[str], list[str]] = src._shard_paths
    elif any(n.endswith(".bin") for n in names):
        fmt, index, ext, pattern = "bin", src._BIN_INDEX, ".bin", src._BIN_SHARD_PATTERN
        list_paths = src._bin_shard_paths
    else:
        return [
            Check(
                "shards",
                "FAIL",
                src._no_weights_error(folder).message,
                "download the weights (*.safetensors) into the folder",
            )
        ]
    state.weight_format = fmt
    present = [n for n in names if n.endswith(ext)]
    out: list[Check] = []
    if index in names:
        try:
            with open(os.path.join(folder, index), encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            listed = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return [
                Check(
                    "shards",
                    "FAIL",
                    f"{index} is unreadable or malformed ({type(exc).__name__}: {exc})",
                    f"re-download {index}",
                )
            ]
        missing = [n for n in listed if n not in present]
        extra = [n for n in present if n not in listed]
        numbered_extra = [n for n in extra if pattern.match(n)]
        if missing:
            out.append(
                Check(
                    "shards",
                    "FAIL",
                    f"{len(missing)} shard(s) listed in {index} are missing: {', '.join(missing)}",
                    "re-download the model (the download is incomplete)",
                )
            )
        if numbered_extra:
            out.append(
                Check(
                    "shards",
                    "FAIL",
                    f"shard(s) not listed in {index}: {', '.join(numbered_extra)}",
                    "remove them, or re-download the index (they may be a different checkpoint's)",
                )
            )
        other = [
            n for n in extra if n not in numbered_extra and (fmt == "safetensors" or n.startswith("pytorch_model"))
        ]
        if other:
            out.append(
                Check(
                    "shards",
                    "warn",
                    f"{', '.join(other)} not listed in {index}: the loader ignores them",
                    "remove them if they are leftovers (e.g. another precision's copy)",
                )
            )
        if any(c.status == "FAIL" for c in out):
            # Still check the headers and permissions of the listed shards that are there.
            state.weight_files = [os.path.join(folder, n) for n in listed if n in present]
            return out
    else:
        gaps = _numbering_gaps(present)
        if gaps:
            state.weight_files = [os.path.join(folder, n) for n in present]
            return [
                Check(
                    "shards",
                    "FAIL",
                    f"no {index}, and numbered shards are missing: {', '.join(gaps)}",
                    "re-download the model (the download is incomplete)",
                )
            ]
    try:
        state.weight_files = list_paths(folder)  # the loader's own choice, so the two never disagree
    except PagodaError as exc:
        return out + [Check("shards", "FAIL", exc.message, "re-download the model")]
    state.shards_ok = True
    how = f"all listed in {index}" if index in names else "no index"
    ignored = (
        " (pytorch_model*.bin beside them are ignored)"
        if fmt == "safetensors" and any(n.endswith(".bin") and n.startswith("pytorch_model") for n in names)
        else ""
    )
    out.append(
        Check(
            "shards",
            "ok",
            f"{len(state.weight_files)} {fmt} file(s), {how}, {_size(state.weights_bytes)}{ignored}",
            None,
        )
    )
    return out


def _numbering_gaps(names: list[str]) -> list[str]:
    """`x-0000i-of-0000n` files with no index: every i in 1..n must be there."""
    groups: dict[tuple[str, str, str], set[int]] = {}
    for name in names:
        m = _NUMBERED.match(name)
        if m:
            groups.setdefault((m["prefix"], m["n"], m["ext"]), set()).add(int(m["i"]))
    gaps = []
    for (prefix, n, ext), have in sorted(groups.items()):
        gaps += [f"{prefix}-{i:05d}-of-{n}.{ext}" for i in range(1, int(n) + 1) if i not in have]
    return gaps


def _check_permissions(state: _State, skip_tokenizer_init: bool) -> Check:
    paths = list(state.weight_files)
    folders = [state.folder] if state.source.kind == "hf" else []
    if not skip_tokenizer_init and state.tokenizer_path is not None and os.path.isdir(state.tokenizer_path):
        folders.append(state.tokenizer_path)
    for folder in dict.fromkeys(folders):
        for name in _OTHER_FILES + _TOKENIZER_FILES:
            path = os.path.join(folder, name)
            if os.path.lexists(path) and path not in paths:
                paths.append(path)
    bad = []
    for path in paths:
        reason = _unreadable_reason(path)
        if reason:
            state.unreadable.add(path)
            bad.append(f"{os.path.basename(path)} {reason}")
    if bad:
        return Check(
            "permissions",
            "FAIL",
            "; ".join(bad),
            "make them readable plain files (e.g. `chmod a+r`), or re-download the ones that are not files",
        )
    return Check("permissions", "ok", f"{len(paths)} model/tokenizer files are readable", None)


def _unreadable_reason(path: str) -> str | None:
    if not os.path.lexists(path):
        return "does not exist"
    if not os.path.exists(path):
        return "is a broken symlink"
    if os.path.isdir(path):
        return "is a directory, not a file"
    if not os.path.isfile(path):
        return "is not a regular file"
    if not os.access(path, os.R_OK):
        return f"is not readable by this user (uid {os.getuid()})"
    return None


def _read_fix(path: str) -> str:
    return f"make {path} a readable file (`chmod a+r`), or re-download it"


def _check_safetensors(state: _State) -> list[Check]:
    out, dtypes, checked = [], set(), 0
    for path in state.weight_files:
        if path in state.unreadable or not os.path.isfile(path):
            continue  # already reported by the shards or permissions check
        header, problem = _read_safetensors_header(path)
        if problem:
            out.append(Check("safetensors", "FAIL", f"{os.path.basename(path)} {problem}", "re-download it"))
            continue
        state.headers[path] = header
        dtypes.update(v["dtype"] for k, v in header.items() if k != "__metadata__")
        checked += 1
    state.headers_complete = state.shards_ok and not out and checked == len(state.weight_files)
    if not out:
        out.append(
            Check(
                "safetensors",
                "ok",
                f"{checked} file(s): headers parse and sizes match ({', '.join(sorted(dtypes)) or 'no tensors'})",
                None,
            )
        )
    return out


def _read_safetensors_header(path: str) -> tuple[dict[str, Any], str | None]:
    """(header, None), or ({}, what is wrong): 8-byte little-endian length, JSON, then the data."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return {}, f"is truncated ({size} bytes, shorter than a safetensors header)"
        (n,) = struct.unpack("<Q", prefix)
        if n > _MAX_HEADER_BYTES:
            return {}, f"is not a safetensors file (header length {n} is implausible)"
        if 8 + n > size:
            return {}, f"is truncated ({size} bytes on disk, its header alone needs {8 + n})"
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as exc:
        return {}, f"has a corrupt header (not JSON: {exc})"
    if not isinstance(header, dict):
        return {}, "has a corrupt header (not a JSON object)"
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            shape = [int(d) for d in info["shape"]]
            dtype = info["dtype"]
        except (KeyError, TypeError, ValueError):
            return {}, f"has a corrupt header entry for {name!r}"
        numel = 1
        for d in shape:
            numel *= d
        if dtype in _DTYPE_BYTES and end - begin != numel * _DTYPE_BYTES[dtype]:
            return {}, (
                f"tensor {name!r} spans {end - begin} bytes but {dtype}{shape} needs {numel * _DTYPE_BYTES[dtype]}"
            )
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position or end < begin:
            return {}, f"has overlapping or gapped tensor offsets at {name!r}"
        position = end
    expected = 8 + n + position
    if size < expected:
        return {}, f"is truncated ({size} bytes on disk, its header describes {expected})"
    if size > expected:
        return {}, f"has {size - expected} stray bytes after its last tensor ({size} on disk, header says {expected})"
    return header, None


def _check_index_consistency(state: _State) -> Check | None:
    """Index `total_size` and tensor → shard map vs the headers (a stale index after re-quantization)."""
    index_path = os.path.join(state.folder, _SAFETENSORS_INDEX)
    if not state.headers_complete or not os.path.isfile(index_path) or index_path in state.unreadable:
        return None
    with open(index_path, encoding="utf-8") as f:
        index = json.load(f)
    where = {}
    tensor_bytes = 0
    for path, header in state.headers.items():
        for name, info in header.items():
            if name != "__metadata__":
                where[name] = os.path.basename(path)
                tensor_bytes += int(info["data_offsets"][1]) - int(info["data_offsets"][0])
    weight_map = index["weight_map"]
    wrong = [n for n, shard in weight_map.items() if where.get(n) != shard]
    unmapped = [n for n in where if n not in weight_map]
    total = (index.get("metadata") or {}).get("total_size")
    problems = []
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) are not in the shard the index names (e.g. {wrong[0]!r})")
    if unmapped:
        problems.append(f"{len(unmapped)} tensor(s) in the shards are missing from the index (e.g. {unmapped[0]!r})")
    if isinstance(total, int) and total != tensor_bytes:
        problems.append(f"metadata.total_size {total} != {tensor_bytes} bytes of tensors in the headers")
    if problems:
        return Check(
            "index",
            "warn",
            f"{_SAFETENSORS_INDEX} looks stale: {'; '.join(problems)}",
            "re-download the index with its shards (the loader reads the shards' own headers)",
        )
    size_note = ", total_size matches the headers" if isinstance(total, int) else ""
    return Check("index", "ok", f"{len(weight_map)} tensors, each in the shard the index names{size_note}", None)


def _check_bin_files(state: _State) -> list[Check]:
    """Zip-format torch checkpoints keep a central directory at the end: a cheap truncation check."""
    out, legacy = [], 0
    for path in state.weight_files:
        if path in state.unreadable or not os.path.isfile(path):
            continue
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"PK\x03\x04":
            legacy += 1  # a legacy (pre-1.6) pickle: nothing to check without unpickling it
            if size == 0:
                out.append(Check("pytorch bin", "FAIL", f"{os.path.basename(path)} is empty", "re-download it"))
            continue
        try:
            with zipfile.ZipFile(path) as z:
                end = max((i.header_offset + i.compress_size for i in z.infolist()), default=0)
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            out.append(
                Check(
                    "pytorch bin", "FAIL", f"{os.path.basename(path)} is truncated or corrupt ({exc})", "re-download it"
                )
            )
            continue
        if end > size:
            out.append(Check("pytorch bin", "FAIL", f"{os.path.basename(path)} is truncated", "re-download it"))
    if not out:
        note = f", {legacy} legacy pickle(s) not checked" if legacy else ""
        out.append(Check("pytorch bin", "ok", f"{len(state.weight_files)} file(s) complete{note}", None))
    return out


def _check_checksums(state: _State) -> Check:
    """Each weight file's sha256 against the one SHA256SUMS, a `.sha256` or the HF cache gives (tools/checksums)."""
    files = [p for p in state.weight_files if os.path.isfile(p) and p not in state.unreadable]
    results = checksums.verify(files)
    wrong = [r for r in results if r.expected is not None and not r.ok]
    verified = [r for r in results if r.ok]
    unknown = [os.path.basename(r.path) for r in results if r.expected is None]
    if wrong:
        lines = [
            f"{os.path.basename(r.path)} has sha256 {r.actual}, not {r.expected.digest} ({r.expected.source})"
            for r in wrong
            if r.expected is not None
        ]
        return Check(
            "checksums", "FAIL", "; ".join(lines), "re-download the file(s): the content is not what was published"
        )
    sources = sorted({r.expected.source for r in verified if r.expected is not None})
    parts = [f"{len(verified)} file(s) match their sha256 ({', '.join(sources)})"] if verified else []
    if unknown:
        parts.append(
            f"no expected sha256 known for {len(unknown)} file(s) (no {checksums.SUMS_FILE}, *.sha256 or HF cache "
            "blob): not verified"
        )
    return Check("checksums", "ok", "; ".join(parts), None)


def _check_weights_match_model(state: _State) -> Check:
    """Build the model on the meta device and feed it the headers' names and shapes through the real
    name mapping and weight loaders: config/weights mismatches show up without reading a tensor."""
    import torch  # lazy: torch (`pagoda` starts without it)

    from pagoda.models.loader import WeightRouter  # lazy: torch (`pagoda` starts without it)
    from pagoda.models.registry import get_model_class  # lazy: torch (`pagoda` starts without it)

    cfg = state.hf_config
    try:
        model_class = get_model_class((cfg.get("architectures") or ["<missing>"])[0])
        with torch.device("meta"):
            model = model_class(cfg, _derived_max_model_len(cfg))
        model.tie_weights()
    except PagodaError as exc:
        return Check(
            "checkpoint vs model",
            "FAIL",
            f"the model cannot be built from config.json: {exc.message}",
            "fix config.json",
        )
    except (KeyError, TypeError, ValueError) as exc:
        return Check(
            "checkpoint vs model",
            "FAIL",
            f"the model cannot be built from config.json ({type(exc).__name__}: {exc})",
            "fix config.json or re-download it",
        )
    router = WeightRouter(model)
    params = router.params
    problems: list[str] = []
    count = 0
    for header in state.headers.values():
        for raw_name, info in header.items():
            if raw_name == "__metadata__":
                continue
            try:
                target = router.target(raw_name)
            except KeyError:
                problems.append(f"checkpoint tensor {raw_name!r} has no parameter in {model_class.__name__}")
                continue
            if target is None:
                continue
            try:
                empty = torch.empty([int(d) for d in info["shape"]], dtype=target.param.dtype, device="meta")
                target.loader(target.param, empty, target.shard)
            except ValueError as exc:
                problems.append(f"{raw_name!r}: {exc}")
            except (NotImplementedError, RuntimeError):
                pass  # this loader cannot run on meta tensors: loading will check the shape
            router.loaded.add(target.key)
            count += 1
    if not problems:
        try:
            router.check_complete()
        except PagodaError as exc:
            problems.append(exc.message)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return Check(
            "checkpoint vs model",
            "FAIL",
            problems[0] + more,
            "config.json does not match these weights: re-download the model, or fix its config.json",
        )
    return Check(
        "checkpoint vs model",
        "ok",
        f"{count} checkpoint tensors map onto all {len(params)} parameters of {model_class.__name__}, shapes match",
        None,
    )


def _check_disk(state: _State) -> Check:
    folder = state.folder or "."
    weights = state.weights_bytes
    free = shutil.disk_usage(folder).free
    need = int(_DISK_FACTOR * weights)
    if free < need:
        return Check(
            "disk",
            "warn",
            f"{_size(free)} free on the model's filesystem, less than {_DISK_FACTOR}× the weights ({_size(weights)})",
            "free space there: compile caches, logs and re-downloads need room next to the model",
        )
    return Check("disk", "ok", f"{_size(free)} free (weights {_size(weights)})", None)


# ---------------------------------------------------------------------------------------------
# Tokenizer and chat template


def _check_tokenizer(state: _State, trust_remote_code: bool) -> Check:
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
    state.tokenizer = tokenizer
    return Check("tokenizer", "ok", f"{type(tokenizer).__name__} with {len(tokenizer)} tokens from {path}", None)


def _check_special_tokens(state: _State) -> Check:
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
    if _positive_int(vocab):
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


def _check_yuan_tokens(tok: Any) -> Check:
    expected = YUAN2.special_token_ids  # `models/families.py`
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


def _check_chat_template(state: _State, override: str | None) -> Check:
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


# ---------------------------------------------------------------------------------------------
# Machine


def _check_cuda(state: _State, device: str, tp: int, backend: str = "mp") -> list[Check]:
    import torch  # lazy: torch (`pagoda` starts without it)

    visible = envs.CUDA_VISIBLE_DEVICES.value
    if device == "cpu" or visible in ("", "-1"):
        why = "--device cpu" if device == "cpu" else f"CUDA_VISIBLE_DEVICES={visible!r}"
        return [Check("cuda", "ok", f"running on CPU ({why})", None)]
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        detail = f"torch.cuda.is_available() is False (torch {torch.__version__}, {build})"
        fix = "check `nvidia-smi`, CUDA_VISIBLE_DEVICES and that torch is a CUDA build; or run on CPU with --device cpu"
        if device == "cuda":
            return [Check("cuda", "FAIL", detail + ", but --device cuda was asked for", fix)]
        return [Check("cuda", "warn", detail + ": Pagoda will run on the CPU", fix)]
    count = torch.cuda.device_count()
    out = [Check("cuda", "ok", f"torch {torch.__version__}, CUDA {torch.version.cuda}, {count} GPU(s) visible", None)]
    if tp > count and backend == "ray":
        out.append(Check("gpus", "ok", f"{count} visible here; Ray places the {tp} ranks on its cluster's GPUs", None))
    elif tp > count:  # serve's own refusal (config/engine.py)
        where = f"CUDA_VISIBLE_DEVICES={visible}" if visible is not None else "CUDA_VISIBLE_DEVICES is not set"
        out.append(
            Check(
                "gpus",
                "FAIL",
                f"--tensor-parallel-size {tp} needs {tp} GPUs but {count} {'is' if count == 1 else 'are'} "
                f"visible ({where})",
                "lower --tensor-parallel-size or expose more GPUs (CUDA_VISIBLE_DEVICES)",
            )
        )
    per_gpu = state.weights_bytes / max(tp, 1)
    for i in range(count):
        name = torch.cuda.get_device_name(i)
        free, total = torch.cuda.mem_get_info(i)
        detail = f"{name}: {_size(free)} free of {_size(total)}"
        if i < tp and free < per_gpu:
            out.append(
                Check(
                    f"gpu {i}",
                    "warn",
                    f"{detail}, less than this GPU's share of the weights ({_size(per_gpu)})",
                    "free the GPU, raise --tensor-parallel-size, or use --dtype bfloat16 if the checkpoint is float32",
                )
            )
        elif free < 0.9 * total:
            out.append(
                Check(
                    f"gpu {i}",
                    "warn",
                    f"{detail}: other processes hold {_size(total - free)}",
                    "stop them or lower --gpu-memory-utilization",
                )
            )
        else:
            out.append(Check(f"gpu {i}", "ok", detail, None))
    dtype = str(state.hf_config.get("torch_dtype") or state.hf_config.get("dtype") or "").replace("torch.", "")
    if torch.cuda.is_bf16_supported():
        out.append(Check("bf16", "ok", "bfloat16 is supported", None))
    elif dtype == "bfloat16" or not dtype:
        out.append(
            Check("bf16", "warn", "this GPU does not support bfloat16, the checkpoint's dtype", "pass --dtype float16")
        )
    else:
        out.append(Check("bf16", "ok", f"bfloat16 unsupported, checkpoint dtype is {dtype}", None))
    return out


def _check_port(host: str, port: int) -> Check:
    if port == 0:
        return Check("port", "ok", "port 0: the system picks a free port", None)
    if not 0 < port < 65536:
        return Check("port", "FAIL", f"port {port} is out of range", "pick --port between 1 and 65535")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return Check("port", "FAIL", f"host {host!r} does not resolve ({exc})", "pass --host 0.0.0.0 or an address")
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As uvicorn binds: SO_REUSEADDR, so a port in TIME_WAIT from a previous run counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return Check(
                    "port",
                    "FAIL",
                    f"another process listens on port {port}",
                    f"pick --port (another port), or stop the process on {port} (`ss -ltnp 'sport = :{port}'`)",
                )
            if exc.errno in (errno.EACCES, errno.EPERM):
                return Check("port", "FAIL", f"no permission to bind port {port}", "pick --port above 1023")
            return Check(
                "port",
                "FAIL",
                f"cannot bind {host}:{port} ({exc.strerror or exc})",
                "pick --port and --host that this machine can bind",
            )
    return Check("port", "ok", f"{host}:{port} is free", None)


def _check_shm() -> Check:
    path = "/dev/shm"
    if not os.path.isdir(path):
        return Check(
            "/dev/shm",
            "warn",
            "/dev/shm does not exist; NCCL needs shared memory for tensor parallelism",
            "run the container with --ipc=host or --shm-size=16g",
        )
    st = os.statvfs(path)
    total = st.f_frsize * st.f_blocks
    if total < _SHM_MIN_BYTES:
        return Check(
            "/dev/shm",
            "warn",
            f"/dev/shm is {_size(total)}, below 1 GiB: NCCL may crash with tensor parallelism",
            "run the container with --ipc=host or --shm-size=16g",
        )
    return Check("/dev/shm", "ok", f"{_size(total)} ({_size(st.f_frsize * st.f_bavail)} free)", None)


# ---------------------------------------------------------------------------------------------
# Report and command line


_TAGS = {"ok": "[ ok ]", "warn": "[warn]", "FAIL": "[FAIL]"}


def format_report(checks: list[Check]) -> str:
    lines = []
    for c in checks:
        line = f"{_TAGS[c.status]} {c.name}: {c.detail}"
        if c.fix and c.status != "ok":
            line += f" → {c.fix}"
        lines.append(" ".join(line.split()))  # one line per check, even for multi-line errors
    return "\n".join(lines)


def failed(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.status == "FAIL"]


def add_doctor_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="HF model folder, hub id or .gguf file (default: the embedded model)",
    )
    parser.add_argument("--model", default=None, help="same as MODEL")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder or hub id (default: the model's)")
    parser.add_argument("--port", type=int, default=None, help="check that the server port is free")
    parser.add_argument("--host", default="0.0.0.0", help="address the server will bind (with --port)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument(
        "--distributed-executor-backend",
        default="mp",
        choices=("mp", "ray"),
        help="ray: the ranks run on a Ray cluster, so this machine's GPU count does not limit -tp",
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--chat-template", default=None, help="template the server will use: a file or the text")
    parser.add_argument("--skip-tokenizer-init", action="store_true", help="the server will run without a tokenizer")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--fast", action="store_true", help="only the checks `pagoda serve` runs before loading")
    parser.add_argument(
        "--no-checksums",
        action="store_true",
        help="do not hash the weight files against SHA256SUMS / *.sha256 / the HF cache (minutes for 100 GB)",
    )
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")


def run_doctor(ns: argparse.Namespace) -> int:
    """Print the report; 1 when any check FAILs, else 0."""
    model = getattr(ns, "model_tag", None) or getattr(ns, "model", None)
    checks = run_checks(
        model,
        port=ns.port,
        tensor_parallel_size=ns.tensor_parallel_size,
        distributed_executor_backend=ns.distributed_executor_backend,
        fast=ns.fast,
        tokenizer=ns.tokenizer,
        host=ns.host,
        device=ns.device,
        skip_tokenizer_init=ns.skip_tokenizer_init,
        chat_template=ns.chat_template,
        trust_remote_code=ns.trust_remote_code,
        checksums=not getattr(ns, "no_checksums", False),
    )
    counts = {s: sum(c.status == s for c in checks) for s in ("ok", "warn", "FAIL")}
    if ns.json:
        print(json.dumps({"model": model, "checks": [asdict(c) for c in checks], "counts": counts}, indent=2))
    else:
        print(format_report(checks))
        print(f"{counts['ok']} ok, {counts['warn']} warn, {counts['FAIL']} FAIL")
    return 1 if counts["FAIL"] else 0


def serve_preflight(engine: EngineArgs, server: ServerConfig) -> list[Check]:
    """The fast checks for `pagoda serve`'s configs; raises ConfigError listing every FAIL line."""
    checks = run_checks(
        engine.model,
        port=server.port,
        tensor_parallel_size=engine.tensor_parallel_size,
        distributed_executor_backend=engine.distributed_executor_backend,
        fast=True,
        tokenizer=engine.tokenizer,
        host=server.host,
        device=engine.device,
        skip_tokenizer_init=engine.skip_tokenizer_init,
        chat_template=server.chat_template,
        trust_remote_code=engine.trust_remote_code,
        load_format=engine.load_format,
    )
    bad = failed(checks)
    if bad:
        raise ConfigError("preflight failed (`pagoda doctor` shows every check):\n" + format_report(bad))
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda doctor", description="preflight checks of a model and this machine")
    add_doctor_args(parser)
    return run_doctor(parser.parse_args(argv))


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_yuan(cfg: dict[str, Any]) -> bool:
    return family_of(cfg) is YUAN2


def _is_qwen2_vl(cfg: dict[str, Any]) -> bool:
    return "Qwen2VLForConditionalGeneration" in (cfg.get("architectures") or []) or cfg.get("model_type") == "qwen2_vl"


def _size(n: float) -> str:
    for unit, scale in (("GiB", _GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


if __name__ == "__main__":
    sys.exit(main())
