"""`serving_gc.prepare_gc_for_serving`: what freezing the startup heap is for. Afterwards a full collection no
longer walks the objects that were alive at the call (they sit in the permanent generation), garbage that
existed at the call was collected rather than frozen forever, objects made later are collected as usual, and
the young generation's threshold is raised. Checked in this process (it is process-wide), which gets its
collector state back at the end."""

from __future__ import annotations

import gc
import os
import platform
import weakref

import pytest

from pagoda.serving_gc import GEN0_THRESHOLD, prepare_gc_for_serving, return_freed_memory


def _glibc() -> bool:
    return platform.libc_ver()[0] == "glibc"


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _garbage_cycle() -> weakref.ref:
    """Two nodes that refer to each other and to nothing else: only the cyclic collector frees them."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_prepare_gc_for_serving_freezes_the_startup_heap_and_raises_gen0_threshold() -> None:
    threshold = gc.get_threshold()
    assert gc.get_freeze_count() == 0, "an earlier test left objects frozen"
    startup = [[i] for i in range(20_000)]  # tracked containers: the model, tokenizer, schemas of a server
    gc.collect()
    heap = len(gc.get_objects())  # what a full collection walks today
    dead_at_call = _garbage_cycle()
    assert dead_at_call() is not None  # not yet collected
    try:
        prepare_gc_for_serving()
        frozen = gc.get_freeze_count()
        walked = gc.get_objects()  # every generation but the permanent one
        # Everything alive at the call is frozen, so a full collection skips it: the heap it walks is tiny. (A
        # few objects counted in `heap` may die before the call: another thread of the test runner, or an earlier
        # test's, can drop them.)
        assert frozen >= 0.99 * heap and heap >= len(startup), (frozen, heap)
        assert len(walked) < heap // 10, (len(walked), heap)
        walked_ids = {id(o) for o in walked}
        assert not any(id(o) in walked_ids for o in startup)
        assert id(startup) not in walked_ids
        # Garbage is collected before the freeze: frozen objects are never freed, so it would leak.
        assert dead_at_call() is None
        # Objects made after the call are collected as usual.
        dead_later = _garbage_cycle()
        gc.collect()
        assert dead_later() is None
        # Nothing made later joins the permanent generation. (Its count may drop: a frozen object whose last
        # reference goes away, say in a thread of the test runner, is still freed by reference counting.)
        assert gc.get_freeze_count() <= frozen
        # A young generation that is not collected at every few hundred container allocations.
        assert GEN0_THRESHOLD > threshold[0]
        assert gc.get_threshold() == (GEN0_THRESHOLD, *threshold[1:])
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def _anon_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError("no RssAnon line")


@pytest.mark.skipif(not os.path.exists("/proc/self/status") or not _glibc(), reason="glibc's heap on Linux")
def test_return_freed_memory_hands_the_freed_heap_back() -> None:
    """Freed chunks below a live one stay resident in glibc's heap (it only shrinks from the top on its own);
    `return_freed_memory` gives their pages back."""
    chunks = [bytearray(4000) for _ in range(20_000)]  # ~80 MB of heap chunks (below the mmap threshold)
    top = bytearray(4000)  # a live chunk above them: the heap cannot simply shrink
    del chunks
    before = _anon_kib()
    return_freed_memory()
    assert before - _anon_kib() > 40_000, "less than half of the freed ~80 MB went back"
    del top
