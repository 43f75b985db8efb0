"""Programmatic dependent launch (PDL) for the kernels of a decode step, on Hopper and newer.

Why: a batch-1 decode step of a 2B model is a serial chain of ~14 kernels per layer, most of them
a few µs long, and each normally starts only after the previous one has fully drained and the GPU
has launched it. With PDL a kernel is launched while its predecessor is still finishing; its
programs run up to `gdc_wait` (which returns once the predecessor has completed and its writes are
visible) and the launch latency is hidden. Work that does not depend on the predecessor can go
before the wait: the GEMV loads its weight tile there (`pagoda/kernels/gemv.py`).

The contract every kernel launched with PDL keeps (or the chain is not ordered any more):
- it calls `wait_for_inputs` before its first read of anything a previous kernel may write
  (activations, caches, state) and before its first write; only read-only data (weights) may be
  read earlier;
- every program calls it, so the kernel cannot complete before its predecessor has: a later kernel
  that waits on this one then also waits on that one.
`wait_for_inputs` also signals that the next kernel may launch (`gdc_launch_dependents`): from then
on its programs may occupy free SM slots while they wait.

Inside a CUDA graph capture the launches become programmatic graph edges. Kernels without PDL
(cuBLAS, PyTorch) are ordered as before. `PAGODA_PDL=0` turns it off (read once); the interpreter
and GPUs before compute capability 9.0 never use it. The model runner uses it only for steps of
few tokens (`dispatch.pdl_for_rows`, `policy.PDL_MAX_ROWS`): at batch 256 the H200's decode step
is slower with it (`benchmarks/h200.py`, the decode row; docs/performance.md). The LoRA shrink and expand
(`pagoda/kernels/lora.py`) have a bound of their own, `policy.LORA_PDL_MAX_ROWS`: beside cuBLAS and each other
they gained at 256 rows too (`benchmarks/lora_gpu.py`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pagoda import envs
from pagoda.kernels import dispatch


@functools.cache
def _switched_on() -> bool:
    return envs.PDL.value and not envs.TRITON_INTERPRET.value


@functools.cache
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(t: torch.Tensor, max_rows: int | None = None) -> bool:
    """Whether kernels working on t's device launch with PDL now: by the step's rule (`dispatch.pdl_allowed`),
    or, for a kernel with a bound of its own, when t has at most `max_rows` rows (`launch_args`)."""
    allowed = dispatch.pdl_is_allowed() if max_rows is None else t.shape[0] <= max_rows
    if not (t.is_cuda and _switched_on() and allowed):
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _device_has_pdl(index)


def launch_args(t: torch.Tensor, max_rows: int | None = None) -> dict[str, bool]:
    """Keyword arguments for a kernel launch: the kernel's PDL constexpr and Triton's launch option. max_rows:
    the kernel's own row bound instead of the step's (the LoRA kernels, `policy.LORA_PDL_MAX_ROWS`); either way
    a launch of a given size always takes the same variant."""
    return {"PDL": True, "launch_pdl": True} if enabled(t, max_rows) else {"PDL": False}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel has completed (its writes visible), then let the
    next kernel launch. Without: nothing (the stream already ordered this kernel after it)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
