"""`--cpu-offload-gb`: which layers move to host memory, and that a model streaming them back gives the same
tokens and logits as the resident one.

The mechanism (two staging slots that the offloaded layers take in turn, the next layer's copy queued as a
layer starts, or after it when the next one needs its slot) is the same code on the CPU, with plain copies:
a copy into the wrong slot, or one made too early or never, changes the logits here. The GPU's side stream,
pinned memory and events are checked on the H200 (tests/kernels run there).
"""

from __future__ import annotations

import pytest
import torch

from pagoda.config import EngineArgs, EngineConfig
from pagoda.errors import ConfigError
from pagoda.models.weight_offload import choose_layers, offload_layers
from tests.conftest import build_tiny_model
from tests.models.test_yuan_golden import LOGIT_ATOL, CapturingEngine, _check_all, _golden


def test_choose_layers_spreads_the_fewest_that_reach_the_budget():
    assert choose_layers([10] * 8, 25) == [1, 4, 6]  # 3 layers, at the middles of three equal parts
    assert choose_layers([10] * 8, 30) == [1, 4, 6]
    assert choose_layers([10] * 8, 31) == [1, 3, 5, 7]
    assert choose_layers([10] * 8, 0) == [] and choose_layers([], 10) == []
    assert choose_layers([10] * 8, 10**9) == list(range(8))  # more than the model: every layer
    assert choose_layers([10] * 3, 1) == [1]


@pytest.fixture(scope="module")
def llama6(tmp_path_factory) -> str:
    return build_tiny_model("llama", str(tmp_path_factory.mktemp("llama6")), num_hidden_layers=6)


def _offloaded(engine, layers: int) -> list:
    model = engine.runner.model
    own = model.stage.own(model.model.layers)
    per_layer = sum(p.numel() * p.element_size() for p in own[0].parameters())
    streamer = offload_layers(own, (layers - 0.5) * per_layer / 2**30, engine.runner.device)
    assert streamer is not None and len(streamer.layers) == layers
    slots = {t.data_ptr() for slot in streamer.slots for t in slot}
    for layer in streamer.layers:  # their parameters now alias a staging slot
        assert all(p.data_ptr() in slots for p in layer.parameters())
    return streamer.layers


@pytest.mark.parametrize("layers", [1, 2, 3])  # one slot; two slots in turn; an odd count that wraps around
def test_offloaded_layers_give_the_resident_models_tokens_and_logits(llama6, layers):
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(5 + 9 * i)] for i in range(4)]
    resident = CapturingEngine(llama6, block_size=4, max_model_len=256, max_num_batched_tokens=16)
    expected = resident.run(prompts, max_tokens=8)
    # Offloaded after the engine is built, so no CUDA graph may hold the old weights' addresses (on a GPU).
    streamed = CapturingEngine(llama6, block_size=4, max_model_len=256, max_num_batched_tokens=16, enforce_eager=True)
    _offloaded(streamed.engine, layers)
    assert streamed.run(prompts, max_tokens=8) == expected
    for rid in expected:
        for a, b in zip(streamed.logits[rid], resident.logits[rid], strict=True):
            torch.testing.assert_close(a, b, atol=LOGIT_ATOL, rtol=0)


def test_yuan_goldens_with_an_offloaded_layer():
    """Yuan2's LF layer state lives beside the weights, not in them: it is not offloaded and carries on."""
    capture = CapturingEngine("yuan2-tiny", block_size=4, max_num_batched_tokens=16, enforce_eager=True)
    _offloaded(capture.engine, 1)
    _check_all("yuan2-tiny", capture, capture.run([c["prompt_ids"] for c in _golden("yuan2-tiny")["cases"]]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flag is for GPUs (refused on the CPU)")
def test_the_flag_on_a_gpu_streams_two_layers_and_keeps_the_logits(llama6):
    """The whole path as `--cpu-offload-gb` takes it: pinned host copies on a side stream, eager steps."""
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(5 + 9 * i)] for i in range(4)]
    resident = CapturingEngine(llama6, block_size=4, max_model_len=256)
    expected = resident.run(prompts, max_tokens=8)
    model = resident.engine.runner.model
    per_layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    streamed = CapturingEngine(llama6, block_size=4, max_model_len=256, cpu_offload_gb=1.5 * per_layer / 2**30)
    streamer = streamed.engine.runner.model.weight_streamer
    assert len(streamer.layers) == 2 and streamer.stream is not None and streamer.host[0][0].is_pinned()
    assert streamed.engine.runner.graphs is None  # copies, not launches, bound such a step
    assert streamed.run(prompts, max_tokens=8) == expected
    for rid in expected:
        for a, b in zip(streamed.logits[rid], resident.logits[rid], strict=True):
            torch.testing.assert_close(a, b, atol=LOGIT_ATOL, rtol=0)


def test_the_flag_is_refused_on_the_cpu_and_below_zero(llama6):
    with pytest.raises(ConfigError, match="on the CPU they are there already"):
        EngineConfig.create(EngineArgs(model=llama6, device="cpu", cpu_offload_gb=1))
    with pytest.raises(ConfigError, match="cpu_offload_gb must be >= 0"):
        EngineConfig.create(EngineArgs(model=llama6, device="cpu", cpu_offload_gb=-1))
