"""Bicubic resize of one RGB frame, bit for bit PIL's `Image.resize(size, BICUBIC)`, cut into bands that threads
resize at the same time.

Why: the resize is the largest piece of an image's preprocessing in the API process (about half of it for a
1000x750 JPEG: more than the decode), and a lone request's first token waits for it.

Why it is exact: PIL resamples uint8 images in two separable passes, each rounding to uint8. The horizontal pass
makes each output row from the same input row alone, the vertical pass each output column from the same input
column alone, with coefficients that depend only on the input and output lengths. So a horizontal pass over a
band of rows gives exactly those rows of the whole pass, and a vertical pass over a band of columns exactly those
columns. PIL releases the GIL while it resamples, so the bands of one pass run at once on a small thread pool.

The order of the two passes is PIL's own choice and differs between versions: Pillow 13 runs the vertical pass
first when the height shrinks by more than twice what the width shrinks (and the height shrinks at all); older
versions always run the horizontal pass first. Each rule is tried once per process on small probe images whose
sizes tell the rules apart, against the installed PIL's own resize; a PIL that follows neither keeps its own
resize for every frame.

The switch is `PAGODA_RESIZE_THREADS` (1: PIL's resize on the calling thread); frames under
`MIN_BANDED_PIXELS` output pixels are resized whole (threads cost more than they save there).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image

from pagoda import envs

BICUBIC = Image.Resampling.BICUBIC
MIN_BANDED_PIXELS = 1 << 18  # ~512x512
MIN_BAND = 32  # rows or columns per band at least

# (in_w, in_h, out_w, out_h) -> True where the horizontal pass runs first.
PassOrder = Callable[[int, int, int, int], bool]


def _horizontal_always(in_w: int, in_h: int, out_w: int, out_h: int) -> bool:
    return True


def _vertical_when_height_shrinks_most(in_w: int, in_h: int, out_w: int, out_h: int) -> bool:
    shrink_h, shrink_w = in_h - out_h, in_w - out_w
    return not (shrink_h > 0 and shrink_h > 2 * shrink_w)


# Probe sizes (in_w, in_h, out_w, out_h): the first two tell the rules apart (height shrinks, width grows; height
# shrinks much more than width), the third has both rules run the horizontal pass first.
_PROBES = ((40, 36, 44, 30), (40, 36, 38, 20), (40, 36, 30, 34))


def resize_bicubic(image: Image.Image, size_hw: tuple[int, int], threads: int | None = None) -> np.ndarray:
    """`image` (RGB) resized to size_hw = (height, width) -> uint8 [H, W, 3], equal to PIL's BICUBIC resize.
    `threads`: bands per pass (None: `PAGODA_RESIZE_THREADS`, else up to 4 and the machine's cores)."""
    out_h, out_w = size_hw
    in_w, in_h = image.size
    n = resize_threads() if threads is None else threads
    order = pass_order() if n > 1 and image.mode == "RGB" and out_w * out_h >= MIN_BANDED_PIXELS else None
    if order is None or (in_w, in_h) == (out_w, out_h):
        return np.asarray(image.resize((out_w, out_h), BICUBIC), dtype=np.uint8)
    return _two_passes(image, out_w, out_h, order(in_w, in_h, out_w, out_h), n)


def _two_passes(image: Image.Image, out_w: int, out_h: int, horizontal_first: bool, n: int) -> np.ndarray:
    in_w, in_h = image.size
    frame: Image.Image | np.ndarray = image
    for horizontal in (True, False) if horizontal_first else (False, True):
        source = frame if isinstance(frame, Image.Image) else Image.fromarray(frame)
        if horizontal and out_w != in_w:
            frame = _pass(source, out_w, source.height, n, rows=True)
        elif not horizontal and out_h != in_h:
            frame = _pass(source, source.width, out_h, n, rows=False)
    return frame if isinstance(frame, np.ndarray) else np.asarray(frame, dtype=np.uint8)


def _pass(source: Image.Image, out_w: int, out_h: int, n: int, *, rows: bool) -> np.ndarray:
    """One pass of PIL's resize (horizontal: `rows`, each band a range of rows; vertical: a range of columns)."""
    out = np.empty((out_h, out_w, 3), dtype=np.uint8)
    length = out_h if rows else out_w
    cuts = np.linspace(0, length, max(1, min(n, length // MIN_BAND)) + 1).astype(int).tolist()

    def band(lo: int, hi: int) -> None:
        if rows:  # the source's rows lo..hi: the height is unchanged by this pass
            out[lo:hi] = np.asarray(source.crop((0, lo, source.width, hi)).resize((out_w, hi - lo), BICUBIC))
        else:  # the source's columns lo..hi
            out[:, lo:hi] = np.asarray(source.crop((lo, 0, hi, source.height)).resize((hi - lo, out_h), BICUBIC))

    bands = list(zip(cuts[:-1], cuts[1:]))
    if len(bands) == 1:
        band(*bands[0])
    else:
        list(_pool(n).map(lambda b: band(*b), bands))
    return out


@functools.cache
def _pool(n: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(n, thread_name_prefix="resize")


def resize_threads() -> int:
    configured = envs.RESIZE_THREADS.value
    return max(1, configured if configured is not None else min(4, os.cpu_count() or 1))


@functools.cache
def pass_order() -> PassOrder | None:
    """The installed PIL's order of passes (the rule that reproduces its resize on every probe), or None."""
    rng = np.random.default_rng(0)
    probes = []
    for in_w, in_h, out_w, out_h in _PROBES:
        image = Image.fromarray(rng.integers(0, 256, (in_h, in_w, 3), dtype=np.uint8))
        probes.append((image, out_w, out_h, np.asarray(image.resize((out_w, out_h), BICUBIC))))
    for rule in (_vertical_when_height_shrinks_most, _horizontal_always):
        if all(
            np.array_equal(_two_passes(image, out_w, out_h, rule(*image.size, out_w, out_h), 1), want)
            for image, out_w, out_h, want in probes
        ):
            return rule
    return None
