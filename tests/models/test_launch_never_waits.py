"""Launching a step never makes the host wait for the GPU (CUDA only).

With async scheduling the engine prepares and launches step N+1 while step N runs; a host-device
synchronisation anywhere on the launch path (a copy from pageable memory, `.item()`, a `torch.tensor(...,
device=cuda)`) stalls the host until the GPU has drained, so the next step's host work no longer hides
under the running one. Eager steps are where such copies hide: every image step (the vision tower and
its placeholder prefill are too large for a graph), every step of `enforce_eager`. A copy from
pageable memory waits only when it is larger than the driver stages at once (the tiny steps of other
tests never show it), so these steps are large: ~200 KB of positions and slots. Each launch here
is queued behind a GPU kernel that sleeps for a quarter of a second: a launch that returns while that
kernel still runs never waited for the device. (`torch.cuda.set_sync_debug_mode` does not flag these
copies.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.config import EngineArgs, EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.frontend.multimodal.prompt import PlaceholderIds, expand_prompt
from pagoda.sampling_params import SamplingParams
from tests.conftest import QWEN2VL_PATCH_WIDTH, QWEN2VL_SPECIAL_IDS, RandomVisual, build_tiny_model, tiny_qwen2vl_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="host-device synchronisation needs a GPU")

IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = QWEN2VL_SPECIAL_IDS


def levels_visual(grid: tuple[int, int, int], seed: int) -> RandomVisual:
    """An image as the API processes send it: uint8 levels and the per-channel normalising table."""
    rng = np.random.default_rng(seed)
    levels = rng.integers(0, 256, (grid[0] * grid[1] * grid[2], QWEN2VL_PATCH_WIDTH), dtype=np.uint8)
    lut = ((np.arange(256, dtype=np.float32) / 255 - 0.5) / 0.25)[None, :].repeat(3, 0)
    return RandomVisual(levels, grid, lut)


@pytest.fixture(scope="module")
def tiny_qwen2vl(tmp_path_factory) -> str:
    import transformers

    torch.manual_seed(0)
    config = tiny_qwen2vl_config(max_positions=16384, tie_word_embeddings=False)
    model = transformers.Qwen2VLForConditionalGeneration(config)
    folder = tmp_path_factory.mktemp("tiny-qwen2vl-sync")
    model.save_pretrained(folder)
    return str(folder)


def engine_for(folder: str, **kw) -> LLMEngine:
    args = EngineArgs(model=folder, skip_tokenizer_init=True, dtype="bfloat16", num_gpu_blocks_override=4096, **kw)
    return LLMEngine(EngineConfig.create(args))


SLEEP_CYCLES = 500_000_000  # ~0.25 s at the GPU's clock: far longer than any tiny step's host work


def run(engine: LLMEngine, requests: list[tuple[list[int], object]], prefix: str, watch: bool) -> tuple[int, int]:
    """Serve `requests` ((prompt ids, mm inputs or None)) to the end; with `watch`, every launch is queued
    behind a sleeping kernel. Returns (steps launched, launches that returned only after the sleep ended)."""
    runner = getattr(engine.runner, "local", engine.runner)
    launch, launched, waited = runner.launch, [0], [0]

    def watched(so):
        torch.cuda._sleep(SLEEP_CYCLES)
        asleep = torch.cuda.Event()
        asleep.record()
        out = launch(so)
        waited[0] += asleep.query()  # True: the host reached here only after the GPU had drained
        asleep.synchronize()
        return out

    if watch:
        runner.launch = watched
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, (ids, mm) in enumerate(requests):
        engine.add_request(f"{prefix}{i}", ids, params, mm_inputs=mm)
    try:
        while engine.has_unfinished_requests():
            engine.step()
            launched[0] += 1
    finally:
        runner.launch = launch
    return launched[0], waited[0]


def image_requests(seed: int) -> list[tuple[list[int], object]]:
    placeholders = PlaceholderIds(IMAGE_PAD, VIDEO_PAD)
    out = []
    for i, grids in enumerate([[(1, 56, 56)] * 3, [(1, 4, 4), (1, 56, 56)], [], [(1, 56, 56)] * 4]):
        ids = [300 + i, 301]
        for _ in grids:
            ids += [VISION_START, IMAGE_PAD, VISION_END]
        ids += [302, 303]
        if not grids:
            out.append((ids, None))
            continue
        visuals = [("image", levels_visual(g, seed * 10 + j)) for j, g in enumerate(grids)]
        out.append(expand_prompt(ids, visuals, placeholders, "test"))
    return out


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_image_steps_launch_without_waiting(tiny_qwen2vl, enforce_eager):
    engine = engine_for(tiny_qwen2vl, enforce_eager=enforce_eager, max_num_batched_tokens=16384, max_model_len=8192)
    run(engine, image_requests(0), "warm", watch=False)  # kernels compiled, pools allocated
    steps, waited = run(engine, image_requests(1), "q", watch=True)
    assert steps > 6 and waited == 0, f"{waited} of {steps} launches waited for the GPU"


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory) -> str:
    return build_tiny_model("llama", str(tmp_path_factory.mktemp("long-llama")), max_position_embeddings=16384)


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_text_steps_launch_without_waiting(long_llama, enforce_eager):
    """Steps of ~24k prompt tokens (far beyond the largest mixed-step graph) beside decoding rows: their
    positions and slots are ~200 KB, more than a copy from pageable memory stages without waiting."""
    engine = engine_for(long_llama, enforce_eager=enforce_eager, max_num_batched_tokens=32768, max_model_len=16384)
    rng = np.random.default_rng(0)

    def requests():
        return [(rng.integers(3, 500, n).tolist(), None) for n in (5, 12000, 40, 12000, 700)]

    run(engine, requests(), "warm", watch=False)
    steps, waited = run(engine, requests(), "q", watch=True)
    assert steps > 6 and waited == 0, f"{waited} of {steps} launches waited for the GPU"
