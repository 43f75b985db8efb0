"""Every Triton kernel of `pagoda/kernels/` compiles for the H100/H200 (sm_90), on a machine without a GPU.

The other kernel tests run under Triton's interpreter on CPU-only machines, and it accepts code the GPU
compiler rejects; `tests/kernels/sm90_compile.py` compiles each kernel variant to a cubin with a
compile-only driver instead. It runs in a subprocess because the interpreter is picked when a kernel
is decorated, and this process has TRITON_INTERPRET set (`conftest.py`) on a CPU-only machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _missing_toolchain() -> str | None:
    """Why sm_90 cubins cannot be built here (no Triton nvidia backend, or no ptxas), else None."""
    try:
        import triton.backends.nvidia.compiler  # noqa: F401
        from triton import knobs
    except ImportError as e:
        return f"Triton's nvidia backend is not importable: {e}"
    try:
        knobs.nvidia.ptxas.path  # noqa: B018 (the lookup raises when there is no ptxas)
    except RuntimeError as e:
        return f"Triton's nvidia backend has no ptxas: {e}"
    return None


def test_every_kernel_compiles_for_sm90(tmp_path):
    reason = _missing_toolchain()
    if reason is not None:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile from scratch, whatever an earlier run cached
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.sm90_compile"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, f"sm_90 compile failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    assert "kernels compiled for sm_90" in proc.stdout
