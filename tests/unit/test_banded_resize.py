"""The banded, threaded bicubic resize (`frontend/multimodal/banded_resize.py`) against PIL's own
`Image.resize(size, BICUBIC)`, bit for bit, over sizes that take each order of PIL's two passes, the boundary of
Pillow 13's rule, one side unchanged, and enlargements and reductions of every kind."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from pagoda.frontend.multimodal import banded_resize
from pagoda.frontend.multimodal.banded_resize import BICUBIC, resize_bicubic


@pytest.fixture(autouse=True)
def _band_every_frame(monkeypatch):
    monkeypatch.setattr(banded_resize, "MIN_BANDED_PIXELS", 0)  # small frames too, so the cases stay small


def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    # smooth content plus noise: both the flat regions and the edges of real photos
    y, x = np.mgrid[0:h, 0:w]
    base = (127 + 100 * np.sin(x / 7.0 + seed) * np.cos(y / 11.0)).astype(np.int64)[..., None]
    return Image.fromarray(np.clip(base + rng.integers(-40, 41, (h, w, 3)), 0, 255).astype(np.uint8))


CASES = [
    # (in_w, in_h, out_w, out_h)
    (1000, 750, 1008, 756),  # both grow (the 1000x750 JPEG's smart_resize)
    (640, 480, 644, 476),  # height shrinks, width grows: Pillow 13 runs the vertical pass first
    (640, 480, 636, 476),  # both shrink alike: horizontal first
    (640, 480, 630, 455),  # height shrinks by more than twice the width: vertical first
    (640, 480, 630, 460),  # exactly twice: horizontal first (the rule's boundary)
    (300, 200, 196, 308),  # width shrinks, height grows
    (1280, 720, 1288, 728),
    (2000, 1500, 1036, 784),  # a large reduction
    (333, 517, 333, 700),  # width unchanged: one vertical pass
    (517, 333, 700, 333),  # height unchanged: one horizontal pass
    (97, 61, 97, 61),  # unchanged
    (45, 1200, 56, 1204),  # a tall strip
]


@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "{}x{}->{}x{}".format(*c))
def test_bands_equal_pils_resize(case, threads):
    in_w, in_h, out_w, out_h = case
    image = _image(in_w, in_h, seed=in_w + out_h)
    want = np.asarray(image.resize((out_w, out_h), BICUBIC))
    got = resize_bicubic(image, (out_h, out_w), threads=threads)
    assert got.dtype == np.uint8 and got.shape == (out_h, out_w, 3)
    assert np.array_equal(got, want)


def test_the_installed_pils_order_of_passes_is_known():
    # None would leave every frame on PIL's own resize: correct, but the fast path silently off
    assert banded_resize.pass_order() is not None


def test_one_thread_and_other_modes_are_pils_own_resize(monkeypatch):
    calls = []
    monkeypatch.setattr(banded_resize, "_two_passes", lambda *a: calls.append(a))
    image = _image(120, 90, seed=1)
    want = np.asarray(image.resize((140, 100), BICUBIC))
    assert np.array_equal(resize_bicubic(image, (100, 140), threads=1), want)
    rgba = image.convert("RGBA")
    assert np.array_equal(resize_bicubic(rgba, (100, 140), threads=4), np.asarray(rgba.resize((140, 100), BICUBIC)))
    assert not calls
    monkeypatch.setenv("PAGODA_RESIZE_THREADS", "1")
    assert banded_resize.resize_threads() == 1
    monkeypatch.setenv("PAGODA_RESIZE_THREADS", "3")
    assert banded_resize.resize_threads() == 3


def test_a_decoded_jpeg_as_the_api_process_holds_it():
    """The threads crop one decoded JPEG (a PIL ImageFile, loaded once) at the same time."""
    import io

    buf = io.BytesIO()
    _image(1000, 750, seed=5).save(buf, format="JPEG", quality=90)
    image = Image.open(io.BytesIO(buf.getvalue()))
    image.load()
    for out_w, out_h in ((1008, 756), (980, 700), (1030, 740)):
        want = np.asarray(image.resize((out_w, out_h), BICUBIC))
        assert np.array_equal(resize_bicubic(image, (out_h, out_w), threads=4), want)
