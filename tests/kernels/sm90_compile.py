"""Compile every Triton kernel of `pagoda/kernels/` for an H100/H200 (CUDA sm_90) on a machine without a GPU.

Why: the kernel tests run under Triton's interpreter on CPU-only machines, and the interpreter accepts
code the GPU compiler rejects (a layout it cannot convert, a type the PTX backend does not lower, too
much shared memory, a ptxas error). Here Triton's active driver is replaced by one whose target is
sm_90 and whose launches do nothing, and each kernel's own launcher is called with small CPU tensors:
Triton then runs its whole pipeline (TTIR → TTGIR → LLVM IR → PTX → cubin, ptxas included) exactly as
for the GPU, and the launch itself is skipped. What the kernels would compute is not checked (the
interpreter tests and the GPU tests do that); only that every variant the GPU runs compiles.

Run it with TRITON_INTERPRET unset (the interpreter is chosen when `@triton.jit` decorates a kernel):
`env -u TRITON_INTERPRET python -m tests.kernels.sm90_compile`.
It prints one line per compiled kernel variant and exits non-zero, naming what failed, when a launcher
raises (a compile error) or when a kernel of `pagoda/kernels/` compiled no variant at all.
`tests/kernels/test_compile_sm90.py` runs it in a subprocess.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

TARGET_ARCH = 90  # Hopper: the H100/H200 the engine is tuned for (PDL needs it)


@dataclass
class Compiled:
    name: str
    pdl: bool
    num_warps: int
    cubin: bytes
    shared_bytes: int  # dynamic shared memory the launch asks for


class CompileOnlyDriver:
    """Triton's active driver for an sm_90 target without a GPU: device 0, stream 0, the H200's
    limits; loading a cubin records it and hands back dummy handles, launching does nothing."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.driver import ty_to_cpp

        self.target = GPUTarget("cuda", TARGET_ARCH, 32)
        self.compiled: list[Compiled] = []
        self._metadata: Any = None  # the metadata of the kernel being loaded
        self._ty_to_cpp = ty_to_cpp
        properties = {
            "max_shared_mem": 232448,  # 227 KiB of shared memory per block on sm_90
            "multiprocessor_count": 132,
            "max_num_regs": 65536,
            "warpSize": 32,
            "sm_clock_rate": 1980000,
            "mem_clock_rate": 2619000,
            "mem_bus_width": 5120,
        }
        self.utils = types.SimpleNamespace(
            load_binary=self._load_binary, get_device_properties=lambda device: properties
        )

    def launcher_cls(self, src, metadata) -> Callable[..., None]:
        """Triton makes a compiled kernel's launcher, then loads its cubin (`_load_binary`)."""
        self._metadata = metadata
        return lambda *args, **kwargs: None

    def _load_binary(self, name: str, cubin: bytes, shared: int, device: int) -> tuple[str, int, int, int, int]:
        meta = self._metadata
        self.compiled.append(Compiled(name, bool(meta.launch_pdl), meta.num_warps, cubin, shared))
        # module (not None: Triton loads a kernel until its module is set), function, registers,
        # spills, most threads per block
        return name, 0, 0, 0, 1024

    def is_active(self) -> bool:
        return True

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        pass

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def map_python_to_cpp_type(self, ty: str) -> str:
        return self._ty_to_cpp(ty)


def install() -> CompileOnlyDriver:
    """Make the compile-only driver Triton's active one and let the launchers take CPU tensors as the
    GPU's: the few host-side checks that ask for a CUDA tensor are patched here, not in pagoda."""
    from triton.runtime import driver as triton_driver

    from pagoda.kernels import dispatch, pdl

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: under the interpreter nothing is compiled")
    fake = CompileOnlyDriver()
    triton_driver.set_active(fake)
    # PDL is for a CUDA tensor on a Hopper GPU; here for whatever `dispatch.pdl_allowed` says, so both
    # the PDL and the plain variant of each kernel compile.
    pdl.enabled = lambda t, max_rows=None: dispatch.pdl_is_allowed()
    return fake


def _bf16(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.bfloat16)


def _attention() -> list[tuple[str, Callable[[], object]]]:
    from pagoda.kernels.attention.store_kv import FP8
    from pagoda.kernels.attention.warmup import compile_variants

    # compile_variants: store_kv, decode (1 and 2 splits, with and without a query index), prefill,
    # each with and without PDL. GQA at head_dim 128, plain MHA at 64, and the fp8 cache. fp32 attention
    # compiles too (by hand: `compile_variants(4, 4, 64, 16, torch.float32, "cpu")`), but adds half
    # again to this script's time; the fp32 int4 GEMM below covers the exact fp32 `tl.dot`.
    return [
        ("attention bf16 Hq=8 Hkv=2 D=128", lambda: compile_variants(8, 2, 128, 16, torch.bfloat16, "cpu")),
        ("attention bf16 Hq=4 Hkv=4 D=64", lambda: compile_variants(4, 4, 64, 16, torch.bfloat16, "cpu")),
        (
            "attention bf16, fp8 cache, Hq=8 Hkv=2 D=128",
            lambda: compile_variants(8, 2, 128, 16, torch.bfloat16, "cpu", cache_dtype=FP8),
        ),
    ]


def _row_kernels() -> list[tuple[str, Callable[[], object]]]:
    from pagoda.kernels import activation, layer_norm, localized_filter, rms_norm, rotary
    from pagoda.kernels.attention.store_kv import FP8

    hidden, t = 2048, 2
    w = _bf16(hidden)

    def rope(q_heads: int, k_heads: int, head_dim: int, rotary_dim: int) -> tuple[torch.Tensor, ...]:
        qkv = _bf16(t, (q_heads + 2 * k_heads) * head_dim)  # strided views of a fused projection
        q = qkv[:, : q_heads * head_dim].view(t, q_heads, head_dim)
        k = qkv[:, q_heads * head_dim : (q_heads + k_heads) * head_dim].view(t, k_heads, head_dim)
        v = qkv[:, (q_heads + k_heads) * head_dim :].view(t, k_heads, head_dim)
        cos = _bf16(t, 1, rotary_dim // 2)
        return q, k, v, cos, cos.clone()

    def rotary_only(q_heads: int, k_heads: int, head_dim: int, rotary_dim: int) -> None:
        q, k, _, cos, sin = rope(q_heads, k_heads, head_dim, rotary_dim)
        rotary.rotary(q, k, cos, sin)

    def rotary_store(cache_dtype: torch.dtype) -> None:
        q, k, v, cos, sin = rope(8, 2, 128, 128)
        cache = torch.zeros(3, 16, 2, 128, dtype=cache_dtype)
        rotary.rotary_store_kv(q, k, v, cos, sin, cache, cache.clone(), torch.tensor([16, -1]), 0.5, 0.25)

    state = _bf16(4, hidden + hidden // 2)
    slots = torch.tensor([1, 3], dtype=torch.int32)
    lf_in = (w, 1e-6, _bf16(hidden // 2), state, slots)
    snapshot = (torch.tensor([0, 2], dtype=torch.int32), _bf16(4, hidden + hidden // 2))
    return [
        ("rms_norm bf16", lambda: rms_norm.rms_norm(_bf16(t, hidden), w, 1e-6)),
        ("fused_add_rms_norm bf16", lambda: rms_norm.fused_add_rms_norm(_bf16(t, hidden), _bf16(t, hidden), w, 1e-6)),
        (
            "layer_norm bf16 (the vision tower's width)",
            lambda: layer_norm.layer_norm(_bf16(t, 1280), _bf16(1280), _bf16(1280), 1e-6),
        ),
        (
            "fused_add_layer_norm bf16",
            lambda: layer_norm.fused_add_layer_norm(_bf16(t, 1280), _bf16(t, 1280), _bf16(1280), _bf16(1280), 1e-6),
        ),
        ("rotary bf16 GQA D=128", lambda: rotary_only(8, 2, 128, 128)),
        ("rotary bf16 partial (64 of D=128)", lambda: rotary_only(4, 4, 128, 64)),
        ("rotary_store_kv bf16 cache", lambda: rotary_store(torch.bfloat16)),
        ("rotary_store_kv fp8 cache", lambda: rotary_store(FP8)),
        ("silu_and_mul bf16", lambda: activation.silu_and_mul(_bf16(t, 2 * 5632))),
        ("quick_gelu bf16", lambda: activation.quick_gelu(_bf16(t, 5120))),
        ("lf_decode_input bf16", lambda: localized_filter.lf_decode_input(_bf16(t, hidden), None, *lf_in)),
        (
            "lf_decode_input bf16 residual+snapshot",
            lambda: localized_filter.lf_decode_input(_bf16(t, hidden), _bf16(t, hidden), *lf_in, *snapshot),
        ),
        (
            "lf_decode_output bf16",
            lambda: localized_filter.lf_decode_output(
                _bf16(t, hidden), _bf16(t, hidden), w, 1e-6, _bf16(t, hidden // 2), state, slots
            ),
        ),
        (
            "lf_decode_output bf16 snapshot",
            lambda: localized_filter.lf_decode_output(
                _bf16(t, hidden), _bf16(t, hidden), w, 1e-6, _bf16(t, hidden // 2), state, slots, *snapshot
            ),
        ),
    ]


def _matmuls() -> list[tuple[str, Callable[[], object]]]:
    from pagoda.kernels import fp8_quant, gemv, int4_gemm

    n, k = 256, 2048

    def fp8_weight(rows: int) -> torch.Tensor:
        return torch.zeros(rows, k, dtype=torch.float8_e4m3fn)

    def int4(
        m: int, layout: str, k: int = 1024, n: int = 512, bias: bool = False, dtype: torch.dtype = torch.bfloat16
    ) -> torch.Tensor:
        """AWQ checkpoints and GPTQ without act order keep rows in order (the kernel computes each row's
        group: `group_size`); GPTQ with act order reads g_idx (group_size None)."""
        group = {"groups": 128, "groups_per_row": 32, "act_order": 128, "one_group": -1}[layout]
        groups = max(1, k // group) if group > 0 else 1
        qweight = torch.zeros(k // 8, n, dtype=torch.int32)
        scales, zeros = torch.zeros(groups, n, dtype=dtype), torch.zeros(groups, n, dtype=dtype)
        g_idx = torch.arange(k, dtype=torch.int32) % groups
        return int4_gemm.int4_matmul(
            torch.zeros(m, k, dtype=dtype),
            qweight,
            scales,
            zeros,
            g_idx,
            torch.zeros(n, dtype=dtype) if bias else None,
            group_size=None if layout == "act_order" else group,
        )

    return [
        ("gemv bf16 1 row", lambda: gemv.gemv(_bf16(1, k), _bf16(n, k))),
        ("gemv bf16 1 row, masked K, bias", lambda: gemv.gemv(_bf16(1, 2000), _bf16(n, 2000), _bf16(n))),
        (
            "gemv bf16 1 row, accumulate into fp32",
            lambda: gemv.gemv(_bf16(1, k), _bf16(n, k), out=torch.zeros(1, n), accumulate=True),
        ),
        ("gemv bf16 4 rows (the row loop)", lambda: gemv.gemv(_bf16(4, k), _bf16(n, k))),
        ("gemv bf16 1 row, K in two tiles", lambda: gemv.gemv(_bf16(1, 4 * k), _bf16(n, 4 * k))),
        ("gemv bf16 3 rows, K in two tiles", lambda: gemv.gemv(_bf16(3, 4 * k), _bf16(n, 4 * k))),
        ("gemv bf16 2 rows, a wide head of short rows", lambda: gemv.gemv(_bf16(2, 576), _bf16(32768, 576))),
        (
            "gemv fp8 weight 1 row",
            lambda: gemv.gemv(_bf16(1, k), fp8_weight(n), weight_scale=torch.ones(n)),
        ),
        ("gemv_silu_and_mul bf16", lambda: gemv.gemv_silu_and_mul(_bf16(1, k), _bf16(2 * n, k))),
        (
            "gemv_silu_and_mul fp8 weight",
            lambda: gemv.gemv_silu_and_mul(_bf16(1, k), fp8_weight(2 * n), weight_scale=torch.ones(2 * n)),
        ),
        ("per_token_quant bf16 one tile", lambda: fp8_quant.per_token_quant(_bf16(4, k))),
        ("per_token_quant bf16 K tiles", lambda: fp8_quant.per_token_quant(_bf16(4, 10240))),
        ("scale_epilogue bf16", lambda: fp8_quant.scale_epilogue(_bf16(4, n), torch.ones(4, 1), torch.ones(n), None)),
        (
            "scale_epilogue bf16 bias",
            lambda: fp8_quant.scale_epilogue(_bf16(4, n), torch.ones(4, 1), torch.ones(n), _bf16(n)),
        ),
        ("int4 GEMV 1 row, groups (AWQ/GPTQ)", lambda: int4(1, "groups")),
        ("int4 GEMV 4 rows, act order (GPTQ), bias", lambda: int4(4, "act_order", bias=True)),
        ("int4 GEMV 1 row, group 32 < K tile", lambda: int4(1, "groups_per_row")),
        ("int4 GEMV 2 rows, one group, split K", lambda: int4(2, "one_group", k=8192, n=256)),
        ("int4 GEMM 16 rows, groups", lambda: int4(16, "groups")),
        ("int4 GEMM 64 rows, act order, bias", lambda: int4(64, "act_order", bias=True)),
        ("int4 GEMM 300 rows, group 32 < K tile", lambda: int4(300, "groups_per_row", n=1024)),
        ("int4 GEMV fp16 1 row, groups", lambda: int4(1, "groups", dtype=torch.float16)),
        ("int4 GEMM fp16 64 rows, groups", lambda: int4(64, "groups", dtype=torch.float16)),
        ("int4 GEMM fp32 (IEEE dot) 64 rows, groups", lambda: int4(64, "groups", dtype=torch.float32)),
    ]


def _lora() -> list[tuple[str, Callable[[], object]]]:
    from pagoda.kernels import lora
    from pagoda.lora.layers import LoRAPart, LoRASlots, LoRAStep

    def add(tokens: int, dtype: torch.dtype, sizes=(512, 128, 128), k: int = 4096) -> Callable[[], object]:
        parts = [LoRAPart(str(i), sum(sizes[:i]), n) for i, n in enumerate(sizes)]
        step = LoRAStep(4, 4096)
        slots = LoRASlots((0, k, k), parts, 4, 16, dtype, torch.device("cpu"), step)
        x, y = torch.zeros(tokens, k, dtype=dtype), torch.zeros(tokens, sum(sizes), dtype=dtype)
        meta, order_at, tile = step.tiling(tokens)
        return lambda: lora.add_lora(x, y, slots.a, slots.b, slots.bounds, meta, order_at, tile)

    return [
        ("lora shrink/expand bf16, 64 tokens (split K), q/k/v", add(64, torch.bfloat16)),
        ("lora shrink/expand bf16, 300 tokens, gate/up", add(300, torch.bfloat16, (1024, 1024))),
        ("lora shrink/expand fp32 (IEEE dot), 8 tokens, one part", add(8, torch.float32, (256,), k=1024)),
    ]


def _spec_verify() -> list[tuple[str, Callable[[], object]]]:
    from pagoda.kernels import spec_verify

    def verify(rows: int, k: int) -> Callable[[], object]:
        target = torch.zeros(rows, k + 1, dtype=torch.int64)
        drafts = torch.full((rows, k), -1, dtype=torch.int64)
        return lambda: spec_verify.verify_greedy(target, drafts)

    return [
        ("greedy verification, 1 row, k = 8", verify(1, 8)),
        ("greedy verification, 31 rows, k = 24 (a 32-wide block)", verify(31, 24)),
    ]


def launches() -> list[tuple[str, Callable[[], object]]]:
    return _attention() + _row_kernels() + _matmuls() + _lora() + _spec_verify()


def kernel_functions() -> dict[str, Any]:
    """Every launched kernel of pagoda/kernels/ (the `@triton.jit` functions named `*_kernel`; the
    others are device functions they call), by `module.name`."""
    from triton.runtime.jit import JITFunction

    import pagoda.kernels

    found = {}
    for info in pkgutil.walk_packages(pagoda.kernels.__path__, "pagoda.kernels."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, JITFunction) and name.endswith("_kernel") and value.__module__ == info.name:
                found[f"{info.name}.{name}"] = value
    return found


def _resource_usage(cubin: bytes) -> str:
    """Registers per thread and spilled bytes (ptxas' numbers, from the bundled cuobjdump), or ''."""
    from triton import knobs

    tool = os.path.join(os.path.dirname(knobs.nvidia.ptxas.path), "cuobjdump")
    if not os.path.exists(tool):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    usage = dict(field.split(":", 1) for line in out.splitlines() if "REG:" in line for field in line.split())
    return f", {usage.get('REG', '?')} registers, {usage.get('LOCAL', '?')} B spilled" if usage else ""


def main() -> int:
    from pagoda.kernels import dispatch

    fake = install()
    failures: list[str] = []
    start = time.perf_counter()
    for label, launch in launches():
        before = len(fake.compiled)
        # Both PDL variants (launchers without PDL compile the same kernel twice: a cache hit).
        # compile_variants sets PDL itself and compiles both on the first pass.
        try:
            for pdl_on in (True, False):
                with dispatch.pdl_allowed(pdl_on):
                    launch()
        except Exception:  # a compile error of any kind: report it, go on with the next launch
            failures.append(f"{label}: failed to compile for sm_{TARGET_ARCH}:\n{traceback.format_exc()}")
            print(f"{label}: FAILED", flush=True)
        else:
            if len(fake.compiled) == before:
                failures.append(f"{label}: compiled nothing (no kernel launched, or only variants compiled before)")
        for c in fake.compiled[before:]:
            print(
                f"{label}: {c.name}{' (PDL)' if c.pdl else ''} {c.num_warps} warps, cubin {len(c.cubin)} B, "
                f"shared {c.shared_bytes} B{_resource_usage(c.cubin)}",
                flush=True,
            )
    functions = kernel_functions()
    for qualified, fn in sorted(functions.items()):
        cache = fn.device_caches[0][0] if 0 in fn.device_caches else {}
        if not any(kernel.asm.get("cubin") for kernel in cache.values()):
            failures.append(f"{qualified}: no variant compiled (add a launch of it to tests/kernels/sm90_compile.py)")
        # An fp8 quantization must round torch's IEEE quotient: Triton's fp32 `/` is PTX's approximate
        # div.full.f32 (up to 2 ulp), which flips the e4m3 rounding of values near a tie (use tl.math.div_rn).
        for kernel in cache.values():
            ptx = kernel.asm.get("ptx") or ""
            if ".satfinite.e4m3" in ptx and "div.full.f32" in ptx:  # cvt to e4m3: a store
                failures.append(f"{qualified}: an fp8 store divides with div.full.f32 (approximate): use div_rn")
                break
    print(
        f"{len(fake.compiled)} variants of {len(functions)} kernels compiled for sm_{TARGET_ARCH} "
        f"in {time.perf_counter() - start:.0f} s"
    )
    for failure in failures:
        print(f"\nERROR {failure}", file=sys.stderr)
    if failures:
        heads = "; ".join(failure.split(":", 1)[0] for failure in failures)
        print(f"\n{len(failures)} sm_{TARGET_ARCH} compile failures: {heads}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
