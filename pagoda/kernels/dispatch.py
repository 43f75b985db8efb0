"""When the layers use the fused Triton kernels (one module per family: `pagoda/kernels/rms_norm.py`,
`layer_norm.py`, `rotary.py`, `activation.py`, and Yuan2's `localized_filter.py`) and the few-row GEMV
(`pagoda/kernels/gemv.py`) instead of PyTorch / cuBLAS.

Only for CUDA tensors, and only when Triton imports; CPU tensors always take the PyTorch code,
which stays bit-identical to what it was. `PAGODA_FUSED_OPS=0` turns the fused kernels off,
`PAGODA_GEMV=0` the GEMV (for A/B timing or to rule them out); each is read once, like the import
check.

The kernels module is imported on first use, not with the layers: `@triton.jit` picks compiled vs
interpreted mode (TRITON_INTERPRET) when the kernels are defined, and importing a layer must not fix
that choice. Layers call `dispatch.fused_for(family, x)` through this module, so a test can monkeypatch
it to run the kernels on CPU tensors under the interpreter.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from contextvars import ContextVar
from types import ModuleType

import torch

from pagoda import envs
from pagoda.kernels import policy


def _optional_kernels(name: str, switch: envs.Env) -> ModuleType | None:
    """`pagoda.kernels.<name>`, or None when Triton cannot be imported or the env switch is "0"."""
    if not switch.value:
        return None
    try:
        return importlib.import_module(f"pagoda.kernels.{name}")
    except ImportError:
        return None


# The fused kernel families the layers dispatch to, each a module `pagoda.kernels.<family>`.
FUSED_FAMILIES = ("rms_norm", "layer_norm", "rotary", "activation", "localized_filter")


@functools.cache
def fused_module(family: str) -> ModuleType | None:
    """`pagoda.kernels.<family>` (one of FUSED_FAMILIES), or None when Triton cannot be imported or
    PAGODA_FUSED_OPS=0."""
    if family not in FUSED_FAMILIES:
        raise ValueError(f"unknown fused kernel family {family!r}; one of {FUSED_FAMILIES}")
    return _optional_kernels(family, envs.FUSED_OPS)


def fused_for(family: str, x: torch.Tensor) -> ModuleType | None:
    """The family's kernels module when x lives on a CUDA device and the kernels are available, else None."""
    return fused_module(family) if x.is_cuda else None


@functools.cache
def gemv_module() -> ModuleType | None:
    """`pagoda.kernels.gemv`, or None when Triton cannot be imported or PAGODA_GEMV=0."""
    return _optional_kernels("gemv", envs.GEMV)


@functools.cache
def fp8_quant_module() -> ModuleType | None:
    """`pagoda.kernels.fp8_quant` (per-token activation quantization for fp8 matmuls), or None without Triton."""
    return _optional_kernels("fp8_quant", envs.FUSED_OPS)


@functools.cache
def int4_gemm_module() -> ModuleType | None:
    """`pagoda.kernels.int4_gemm` (AWQ/GPTQ dequantizing matmuls), or None without Triton."""
    return _optional_kernels("int4_gemm", envs.FUSED_OPS)


@functools.cache
def lora_module() -> ModuleType | None:
    """`pagoda.kernels.lora` (the adapters' shrink/expand pair), or None without Triton or PAGODA_LORA_KERNELS=0."""
    return _optional_kernels("lora", envs.LORA_KERNELS)


@functools.cache
def spec_verify_module() -> ModuleType | None:
    """`pagoda.kernels.spec_verify` (greedy verification of proposals in one launch), or None without Triton."""
    return _optional_kernels("spec_verify", envs.FUSED_OPS)


def spec_verify_for(x: torch.Tensor) -> ModuleType | None:
    """The verification kernel when x lives on a CUDA device and it is available, else None (the reference)."""
    return spec_verify_module() if x.is_cuda else None


def lora_for(x: torch.Tensor) -> ModuleType | None:
    """The LoRA kernels when x lives on a CUDA device and they are available, else None (the reference path)."""
    return lora_module() if x.is_cuda else None


def gemv_for(x: torch.Tensor) -> ModuleType | None:
    """The GEMV module when x lives on a CUDA device and Triton is available, else None."""
    return gemv_module() if x.is_cuda else None


# Whether kernels launched now may use programmatic dependent launch (`pagoda/kernels/pdl.py`, which
# also needs a Hopper GPU and PAGODA_PDL unset). The model runner allows it only for steps of at most
# `policy.PDL_MAX_ROWS` tokens (`pdl_for_rows`), captured or eager, so a kernel of a given size always launches
# (and is compiled at start-up) in one variant; kernels called directly (tests, benchmarks) keep it on.
_PDL_ALLOWED: ContextVar[bool] = ContextVar("pagoda_pdl_allowed", default=True)


@contextlib.contextmanager
def pdl_allowed(on: bool) -> Iterator[None]:
    token = _PDL_ALLOWED.set(on)
    try:
        yield
    finally:
        _PDL_ALLOWED.reset(token)


def pdl_for_rows(rows: int) -> contextlib.AbstractContextManager[None]:
    """`pdl_allowed` for a step (or graph bucket) of `rows` tokens."""
    return pdl_allowed(rows <= policy.PDL_MAX_ROWS)


def pdl_is_allowed() -> bool:
    return _PDL_ALLOWED.get()
