"""When the layers use the fused Triton kernels (`pagoda/kernels/fused_ops.py`) instead of PyTorch.

Only for CUDA tensors, and only when Triton imports; CPU tensors always take the PyTorch code,
which stays bit-identical to what it was. `PAGODA_FUSED_OPS=0` turns the kernels off (for A/B
timing or to rule them out); it is read once, like the import check.

Few-row matmuls (decode steps of up to `skinny_max_rows()` rows) take the skinny GEMM kernel
(`pagoda/kernels/skinny_gemm.py`) instead of cuBLAS: `PAGODA_SKINNY_GEMM=0` turns it off and
`PAGODA_SKINNY_MAX_ROWS=N` moves the row limit (both read once).

The kernels module is imported on first use, not with the layers: `@triton.jit` picks compiled vs
interpreted mode (TRITON_INTERPRET) when the kernels are defined, and importing a layer must not fix
that choice. Layers call `dispatch.fused_ops_for(x)` through this module, so a test can monkeypatch
it to run the kernels on CPU tensors under the interpreter.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch


@functools.cache
def fused_ops_module() -> ModuleType | None:
    """`pagoda.kernels.fused_ops`, or None when Triton cannot be imported or PAGODA_FUSED_OPS=0."""
    if os.environ.get("PAGODA_FUSED_OPS", "1") == "0":
        return None
    try:
        from pagoda.kernels import fused_ops
    except ImportError:
        return None
    return fused_ops


def fused_ops_for(x: torch.Tensor) -> ModuleType | None:
    """The kernels module when x lives on a CUDA device and the kernels are available, else None."""
    return fused_ops_module() if x.is_cuda else None


# Up to this many rows a bf16/fp16 matmul on CUDA goes to the skinny GEMM kernel. From the H200 sweep
# (benchmarks/skinny_gemm_sweep.py): the kernel streams the weights faster than cuBLAS's choices up to
# here; above it cuBLAS's tensor-core tiles catch up.
SKINNY_MAX_ROWS = 16


@functools.cache
def skinny_gemm_module() -> ModuleType | None:
    """`pagoda.kernels.skinny_gemm`, or None when Triton cannot be imported or PAGODA_SKINNY_GEMM=0."""
    if os.environ.get("PAGODA_SKINNY_GEMM", "1") == "0":
        return None
    try:
        from pagoda.kernels import skinny_gemm
    except ImportError:
        return None
    return skinny_gemm


@functools.cache
def skinny_max_rows() -> int:
    return int(os.environ.get("PAGODA_SKINNY_MAX_ROWS", SKINNY_MAX_ROWS))


def skinny_gemm_for(x: torch.Tensor) -> ModuleType | None:
    """The skinny GEMM module when x lives on a CUDA device and the kernel is available, else None."""
    return skinny_gemm_module() if x.is_cuda else None
