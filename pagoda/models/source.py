"""Where a model comes from: an HF folder, a hub id (when online), or a GGUF file.

`resolve_model_source` reads only the config; weights are streamed later, one tensor at a time,
through `ModelSource.iter_weights()`, so a checkpoint is never held in memory twice. HF folders
hold safetensors or, for older checkpoints (Yuan2.0 on the hub), PyTorch `pytorch_model*.bin`
pickles; safetensors win when both are present.

Safetensors entries are yielded unread (`SafetensorsTensor`): a tensor-parallel rank narrows each
to its share and reads only that (`layers/linear.py`'s loaders). GGUF and .bin tensors are plain
(memory-mapped where the format allows); narrowing them is a view.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import huggingface_hub

from pagoda.errors import ModelLoadError
from pagoda.models.gguf_checkpoint import (
    DEFAULT_GENERATION_CONFIG,
    default_gguf_path,
    is_default_gguf,
    iter_gguf_tensors,
    read_gguf_config,
)
from pagoda.models.shards import has_safetensors, shard_set

logger = logging.getLogger(__name__)

# torch is imported where tensors are read (the engine's loader), never for the config: the API processes and
# the launcher resolve a source too, and stay without torch (its ~250 MB resident).
if TYPE_CHECKING:
    import torch

_SAFETENSORS_DTYPE_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


class SafetensorsTensor:
    """One entry of an open safetensors file, not read yet: its shape and dtype from the header,
    `narrow` (a range along one dim; composes) and `read()`, which reads only the narrowed range.

    Valid while its file is open: `iter_weights` keeps it open until the consumer asks for the next
    entry, so a loader reads what it needs before handing control back."""

    def __init__(self, handle: Any, name: str, ranges: tuple[tuple[int, int], ...] | None = None):
        self._handle, self.name = handle, name
        import torch

        info = handle.get_slice(name)
        dtype_name = _SAFETENSORS_DTYPE_NAMES.get(info.get_dtype())
        self.dtype: torch.dtype | None = None if dtype_name is None else getattr(torch, dtype_name)
        # (start, stop) per dim of the stored tensor; None = all of it.
        self._ranges = ranges
        full = tuple(int(n) for n in info.get_shape())
        self._full = full
        self.shape = torch.Size(full if ranges is None else tuple(b - a for a, b in ranges))

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> SafetensorsTensor:
        dim %= self.dim()
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(f"{self.name}: rows [{start}, {start + length}) out of range for {tuple(self.shape)}")
        ranges = list(self._ranges or tuple((0, n) for n in self._full))
        first = ranges[dim][0] + start
        ranges[dim] = (first, first + length)
        return SafetensorsTensor(self._handle, self.name, tuple(ranges))

    def read(self) -> torch.Tensor:
        if self._ranges is None:
            return self._handle.get_tensor(self.name)
        return self._handle.get_slice(self.name)[tuple(slice(a, b) for a, b in self._ranges)]


if TYPE_CHECKING:  # annotations only: this module runs without torch until tensors are read
    # What `iter_weights` yields: a plain tensor (GGUF, .bin) or an unread safetensors entry.
    CheckpointTensor = torch.Tensor | SafetensorsTensor


@dataclass(frozen=True)
class ModelSource:
    location: str  # folder or .gguf path
    kind: str  # "hf" or "gguf"
    hf_config: dict[str, Any] = field(repr=False)

    @property
    def folder(self) -> str:
        return self.location if self.kind == "hf" else os.path.dirname(self.location)

    def weight_files(self) -> list[str]:
        """The files `iter_weights` reads, in order (a shard set is checked against its index first)."""
        if self.kind == "gguf":
            return [self.location]
        return shard_set(self.location).paths()

    def iter_weights(self) -> Iterator[tuple[str, CheckpointTensor]]:
        """Every checkpoint tensor, file by file (safetensors entries unread: `SafetensorsTensor`);
        each file is announced in the log as it starts, the progress an operator watches while a
        checkpoint of tens of GiB loads."""
        paths = self.weight_files()
        for number, path in enumerate(paths, 1):
            logger.info(
                "loading shard %d/%d (%s, %s)...",
                number,
                len(paths),
                os.path.basename(path),
                format_bytes(os.path.getsize(path)),
            )
            if self.kind == "gguf":
                yield from iter_gguf_tensors(path, self.hf_config)
            elif path.endswith(".safetensors"):
                yield from _iter_safetensors_file(path)
            else:
                yield from _iter_bin_file(path)

    def generation_config(self) -> dict[str, Any]:
        """The folder's generation_config.json (sampling defaults, EOS ids), or {}; for the embedded
        default GGUF model, the defaults shipped with it."""
        if self.kind == "gguf":
            return dict(DEFAULT_GENERATION_CONFIG) if is_default_gguf(self.location) else {}
        path = os.path.join(self.folder, "generation_config.json")
        if self.kind != "hf" or not os.path.isfile(path):
            return {}
        with open(path) as f:
            return json.load(f)


def resolve_model_source(model: str | None) -> ModelSource:
    if model is None:
        model = default_gguf_path()
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ModelLoadError(f"GGUF file {model!r} does not exist.")
        return ModelSource(location=model, kind="gguf", hf_config=read_gguf_config(model))
    folder = model if os.path.isdir(model) else _download(model)
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"{folder!r} has no config.json; pass an HF model folder or a .gguf file.")
    with open(config_path) as f:
        hf_config = json.load(f)
    return ModelSource(location=folder, kind="hf", hf_config=hf_config)


def _download(model_id: str) -> str:
    """Resolve a hub id to a local snapshot (cache first, then the network)."""
    if model_id.startswith(("/", ".", "~")) or model_id.count("/") > 1:
        raise ModelLoadError(f"Model folder {model_id!r} does not exist.")
    try:
        folder = huggingface_hub.snapshot_download(
            model_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py"]
        )
        if not has_safetensors(folder):
            # Only now fetch the pickles: repos shipping both formats download one, not both.
            folder = huggingface_hub.snapshot_download(
                model_id, allow_patterns=["pytorch_model*.bin", "*.bin.index.json"]
            )
        return folder
    except Exception as exc:  # offline, unknown repo, auth... all mean the same to the user
        raise ModelLoadError(
            f"{model_id!r} is not a local folder and could not be fetched from the hub "
            f"({type(exc).__name__}); pass the path of a downloaded model folder."
        ) from None


def format_bytes(n: float) -> str:
    """4.9 GiB, 405.6 KiB: sizes in startup logs."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def iter_safetensors(folder: str) -> Iterator[tuple[str, SafetensorsTensor]]:
    """Yield (name, unread tensor) shard by shard; a shard missing from or extra to the index is an error."""
    for path in shard_set(folder, "safetensors").paths():
        yield from _iter_safetensors_file(path)


def _iter_safetensors_file(path: str) -> Iterator[tuple[str, SafetensorsTensor]]:
    from safetensors import safe_open  # lazy: safetensors, only when reading weights

    with safe_open(path, framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            yield name, SafetensorsTensor(f, name)


def iter_pytorch_bin(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from `pytorch_model*.bin` shards, one shard in memory at a time.

    Each tensor is popped before it is handed out and the shard dict is deleted before the next
    shard is opened, so a non-mmap (legacy format) shard is freed as the model takes it in.
    """
    for path in shard_set(folder, "bin").paths():
        yield from _iter_bin_file(path)


def _iter_bin_file(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    state = load_bin_shard(path)
    for name in list(state):
        yield name, state.pop(name)
    del state


def load_bin_shard(path: str) -> dict[str, torch.Tensor]:
    """Unpickle one shard with `weights_only=True`: a checkpoint is data, and Pagoda never runs code
    from one. mmap keeps the tensors on disk until used; legacy (non-zip) pickles cannot be mmapped."""
    import torch

    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=False)
    except pickle.UnpicklingError:
        raise _not_plain_tensors(path) from None
    except (RuntimeError, OSError, EOFError) as exc:
        raise ModelLoadError(f"Could not read {path} ({type(exc).__name__}: {exc}); re-download the model.") from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise _not_plain_tensors(path)
    return state


def _not_plain_tensors(path: str) -> ModelLoadError:
    return ModelLoadError(
        f"{path} is not a plain tensor checkpoint (it holds objects other than named tensors), and Pagoda "
        "never runs code from a checkpoint; convert it to safetensors (e.g. load it where you trust it and "
        "save with `save_pretrained(folder, safe_serialization=True)`)."
    )
