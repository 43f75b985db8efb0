"""Kernel tests run natively on a GPU and under Triton's interpreter on CPU-only machines.

`TRITON_INTERPRET=1` must be set before any `@triton.jit` function is defined (the decorator picks
the interpreter at definition time), so it is set here, before the test modules import
`pagoda.kernels`.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and turns them into Python ints
    with `int(array)`, which NumPy >= 2.4 rejects ("only 0-dimensional arrays can be converted"), so
    any `range(start, end)` with runtime bounds fails under the interpreter. Fixed upstream
    (triton-lang/triton#9171); until then, redefine `__index__` the same way for interpreted runs."""
    try:
        from triton.runtime import interpreter
    except ImportError:                 # no Triton: the test module reports it
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_pagoda_patched", False):
        return

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._pagoda_patched = True
    interpreter._patch_lang_tensor = patch_lang_tensor


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_scalar_index()
