"""Doctor's checks of the model folder's files: the shard set against its index (`models.shards`, the loader's
own check), permissions, safetensors headers and sizes, the index against the headers, .bin zip directories."""

from __future__ import annotations

import json
import os
import struct
import zipfile
from typing import Any

from pagoda.errors import PagodaError
from pagoda.models.shards import (
    BIN_INDEX,
    SAFETENSORS_INDEX,
    ShardSet,
    has_safetensors,
    no_weights_error,
    read_index,
    shard_set,
)
from pagoda.tools.doctor.check import Check, State, format_size, unreadable_reason

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
    SAFETENSORS_INDEX,
    "pytorch_model.bin.index.json",
)


def check_shards(state: State) -> list[Check]:
    """Shards vs the index both ways (safetensors, else .bin), then the list the loader will read."""
    if state.weight_format == "gguf":
        path = state.weight_files[0]
        return [Check("shards", "ok", f"single GGUF file ({format_size(os.path.getsize(path))})", None)]
    folder = state.folder
    names = sorted(os.listdir(folder))
    if has_safetensors(folder):
        fmt = "safetensors"
    elif any(n.endswith(".bin") for n in names):
        fmt = "bin"
    else:
        return [
            Check(
                "shards",
                "FAIL",
                no_weights_error(folder).message,
                "download the weights (*.safetensors) into the folder",
            )
        ]
    state.weight_format = fmt
    index = SAFETENSORS_INDEX if fmt == "safetensors" else BIN_INDEX
    try:
        shards = shard_set(folder, fmt)
        if shards.listed is None and index in names:
            read_index(folder, index)  # there but not a file: what reading it raises
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return [
            Check(
                "shards",
                "FAIL",
                f"{index} is unreadable or malformed ({type(exc).__name__}: {exc})",
                f"re-download {index}",
            )
        ]
    out = _index_problems(shards, index)
    if any(c.status == "FAIL" for c in out):
        # Still check the headers and permissions of the shards that are there.
        listed = shards.listed if shards.listed is not None else shards.present
        state.weight_files = [os.path.join(folder, n) for n in listed if n in shards.present]
        return out
    try:
        state.weight_files = shards.paths()  # the loader's own choice, so the two never disagree
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
            f"{len(state.weight_files)} {fmt} file(s), {how}, {format_size(state.weights_bytes)}{ignored}",
            None,
        )
    )
    return out


def _index_problems(shards: ShardSet, index: str) -> list[Check]:
    """The shard set against its index both ways, or, without an index, the gaps in its numbering."""
    if shards.listed is None:
        if not shards.gaps:
            return []
        return [
            Check(
                "shards",
                "FAIL",
                f"no {index}, and numbered shards are missing: {', '.join(shards.gaps)}",
                "re-download the model (the download is incomplete)",
            )
        ]
    out = []
    if shards.missing:
        out.append(
            Check(
                "shards",
                "FAIL",
                f"{len(shards.missing)} shard(s) listed in {index} are missing: {', '.join(shards.missing)}",
                "re-download the model (the download is incomplete)",
            )
        )
    if shards.unlisted:
        out.append(
            Check(
                "shards",
                "FAIL",
                f"shard(s) not listed in {index}: {', '.join(shards.unlisted)}",
                "remove them, or re-download the index (they may be a different checkpoint's)",
            )
        )
    if shards.ignored:
        out.append(
            Check(
                "shards",
                "warn",
                f"{', '.join(shards.ignored)} not listed in {index}: the loader ignores them",
                "remove them if they are leftovers (e.g. another precision's copy)",
            )
        )
    return out


def check_permissions(state: State, skip_tokenizer_init: bool) -> Check:
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
        reason = unreadable_reason(path)
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


def check_safetensors(state: State) -> list[Check]:
    out, dtypes, checked = [], set(), 0
    for path in state.weight_files:
        if path in state.unreadable or not os.path.isfile(path):
            continue  # already reported by the shards or permissions check
        header, problem = read_safetensors_header(path)
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


def read_safetensors_header(path: str) -> tuple[dict[str, Any], str | None]:
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


def check_index_consistency(state: State) -> Check | None:
    """Index `total_size` and tensor → shard map vs the headers (a stale index after re-quantization)."""
    index_path = os.path.join(state.folder, SAFETENSORS_INDEX)
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
            f"{SAFETENSORS_INDEX} looks stale: {'; '.join(problems)}",
            "re-download the index with its shards (the loader reads the shards' own headers)",
        )
    size_note = ", total_size matches the headers" if isinstance(total, int) else ""
    return Check("index", "ok", f"{len(weight_map)} tensors, each in the shard the index names{size_note}", None)


def check_bin_files(state: State) -> list[Check]:
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
