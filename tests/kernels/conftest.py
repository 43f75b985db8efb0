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
    except ImportError:  # no Triton: the test module reports it
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_pagoda_patched", False):
        return

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._pagoda_patched = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def _patch_interpreter_device_calls() -> None:
    """Triton 3.6's interpreter re-patches the language on every call of a @triton.jit function from a
    kernel (`InterpretedFunction.__call__` runs `_patch_lang`: `inspect.getmembers` over tl, tl.tensor,
    tl.math and the descriptor class, then a setattr per builtin found) and drops what it patched without
    restoring it, so from a helper's first call in a launch on, the modules it sees stay patched until the
    launch's own restore. Every later call of that helper in the launch (tl.sum, a load helper, once per
    tile of every program) repeats a patch that changes nothing, and a kernel that calls helpers per tile
    spends about half its time there. Here a helper's first call in each launch still goes through the
    interpreter's own path; its later calls in the launch run the same rewritten function without it."""
    import threading

    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    executor_call = interpreter.GridExecutor.__call__
    device_call = interpreter.InterpretedFunction.__call__
    if getattr(device_call, "_pagoda_patched", False):
        return
    local = threading.local()  # per thread: for each launch in progress, the helpers it has called

    def launch(self, *args, **kwargs):
        stack = local.__dict__.setdefault("launches", [])
        stack.append(set())
        try:
            return executor_call(self, *args, **kwargs)
        finally:
            stack.pop()

    def call(self, *args, **kwargs):
        stack = getattr(local, "launches", None)
        if not stack or self.fn not in stack[-1]:
            if stack:
                stack[-1].add(self.fn)
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    call._pagoda_patched = True
    interpreter.GridExecutor.__call__ = launch
    interpreter.InterpretedFunction.__call__ = call


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_scalar_index()
    _patch_interpreter_device_calls()
