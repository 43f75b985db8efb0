"""What a long-lived serving process (the engine core, each API process) does to the garbage collector and
its heap once its startup is over. One function for both, so they cannot drift apart."""

from __future__ import annotations

import ctypes
import gc

# Young-generation GC threshold of a serving process (CPython's default is 700). The count is container
# allocations minus deallocations, so at 700 the short-lived objects of every step's outputs (256 rows:
# RequestOutputs, wire tuples, lists; in the API process also its streams' chunks) set off a collection
# or more per step (benchmarks/profile/host_overhead.py's gc row for the engine core,
# benchmarks/profile/api_burst.py for an API process); at 10,000 only real growth does.
GEN0_THRESHOLD = 10_000


def prepare_gc_for_serving() -> None:
    """Freeze every object alive now and raise the young generation's threshold.

    After startup the heap holds a few hundred thousand tracked objects (model, tokenizer, torch,
    FastAPI and pydantic schemas); a full collection walks them all, ~0.1-0.2 s with the process
    stopped, and the collector starts one on its own while serving (in an API process, in the middle
    of a burst's first tokens; in the engine core, a stall of dozens of GPU steps). Frozen, they are
    skipped. Frozen objects are never freed, so only a process that keeps its startup state until it
    exits may call this (not tests or notebooks that build and drop engines)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, *gc.get_threshold()[1:])
    return_freed_memory()


def return_freed_memory() -> None:
    """Hand the heap that startup freed back to the system. glibc keeps freed memory for reuse, and a startup
    frees a lot of it (a tokenizer's conversion, float32 weights packed to 4 bits, checkpoint buffers): tens
    to ~100 MB of resident memory per process that nothing would use again."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
