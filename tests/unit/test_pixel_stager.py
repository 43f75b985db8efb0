"""The pixel stager (worker/pixel_stager.py): what `take` hands the encoder is the item's own pixels, staged
on the helper thread or pinned inline, normalised to exactly the host processor's patches; what it holds
staged stays within its bound; a cached item is not staged; a failed staging falls back to the inline copy.
On the CPU `pin` is a clone (pinned memory needs CUDA); the GPU path is the same code with `pin_memory`."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from PIL import Image

from pagoda.frontend.multimodal.image_processor import VisionPreprocessConfig, preprocess_image
from pagoda.inputs import MultiModalItem, content_hash
from pagoda.worker.encoder_runner import encoder_pixels
from pagoda.worker.pixel_stager import PixelStager

CPU = torch.device("cpu")


def _item(seed: int, size: tuple[int, int] = (112, 84)):
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    visual = preprocess_image(image, VisionPreprocessConfig())
    t, h, w = visual.grid_thw
    key = content_hash("image", visual.pixel_values, visual.grid_thw, "test", visual.pixel_lut)
    item = MultiModalItem("image", visual.pixel_values, visual.grid_thw, 0, t * h * w // 4, key, visual.pixel_lut)
    return item, visual.normalized()


class Pins:
    """A CPU stand-in for `Tensor.pin_memory`: a copy, recording which thread made it; fails when told to."""

    def __init__(self, fail_first: int = 0):
        self.threads: list[str] = []
        self.fail_first = fail_first

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        self.threads.append(threading.current_thread().name)
        if self.fail_first > 0:
            self.fail_first -= 1
            raise RuntimeError("out of pinned memory")
        return tensor.clone()


def test_staged_items_reach_the_encoder_as_their_own_normalised_patches() -> None:
    pins = Pins()
    stager = PixelStager(1 << 30, lambda key: False, pin=pins)
    items = [_item(seed, size) for seed, size in enumerate([(112, 84), (56, 140), (84, 84)])]
    stager.stage(item for item, _ in items)
    assert stager.staged_bytes == sum(item.pixel_values.nbytes for item, _ in items)
    # Taken in another order than staged: each gets its own pixels.
    for item, reference in reversed(items):
        levels, lut = stager.take(item)
        np.testing.assert_array_equal(encoder_pixels(levels, lut, CPU).numpy(), reference)
    assert stager.staged_hits == 3 and stager.staged_bytes == 0
    assert pins.threads and all(name.startswith("pagoda-pixels") for name in pins.threads)
    # Handed over once: a second take pins inline, on this thread, and is still right.
    item, reference = items[0]
    np.testing.assert_array_equal(encoder_pixels(*stager.take(item), CPU).numpy(), reference)
    assert stager.staged_hits == 3 and pins.threads[-1] == threading.current_thread().name


def test_what_is_staged_stays_within_its_bound_oldest_dropped_first() -> None:
    items = [_item(seed) for seed in range(4)]
    size = items[0][0].pixel_values.nbytes
    stager = PixelStager(2 * size, lambda key: False, pin=Pins())
    stager.stage(item for item, _ in items)
    assert stager.staged_bytes == 2 * size
    for index, (item, reference) in enumerate(items):
        np.testing.assert_array_equal(encoder_pixels(*stager.take(item), CPU).numpy(), reference)
        assert stager.staged_hits == max(0, index - 1)  # the two oldest were dropped, then pinned inline
    too_big = PixelStager(size - 1, lambda key: False, pin=Pins())
    too_big.stage([items[0][0]])
    assert too_big.staged_bytes == 0


def test_an_item_in_the_encoder_cache_is_not_staged() -> None:
    (cached, _), (fresh, _) = _item(0), _item(1)
    stager = PixelStager(1 << 30, lambda key: key == cached.content_hash, pin=Pins())
    stager.stage([cached, fresh, fresh])
    assert stager.staged_bytes == fresh.pixel_values.nbytes


@pytest.mark.parametrize("failures", [1, 3])
def test_a_failed_staging_is_pinned_again_inline(failures: int) -> None:
    item, reference = _item(0)
    stager = PixelStager(1 << 30, lambda key: False, pin=Pins(fail_first=failures))
    stager.stage([item])
    if failures == 1:  # the helper's copy failed; the inline one succeeds
        np.testing.assert_array_equal(encoder_pixels(*stager.take(item), CPU).numpy(), reference)
        assert stager.staged_hits == 0
    else:  # failing inline too, the error is the step's, as without staging
        with pytest.raises(RuntimeError, match="pinned"):
            stager.take(item)
