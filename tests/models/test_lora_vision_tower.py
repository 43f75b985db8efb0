"""Adapters on Qwen2-VL's vision tower (`lora/manager.py`'s encoder groups) against PEFT's merged model.

PEFT's `target_modules="all-linear"` adapts the tower's blocks (qkv, proj, fc1, fc2) and merger MLP beside the
language model; the tower-only adapter also adapts the patch embedding (a Conv3d in transformers, so a conv LoRA
in PEFT, whose rows run in the items' order). One step encodes images of two sizes, so the tower runs their rows
regrouped by length (`SegmentLayout`) and the adapters' row mapping must follow; the same image goes to a request
with the adapter and one without, so their encoder outputs must be cached apart. Each request's first logits and
greedy tokens equal transformers' with the adapter merged (or the base model), whole and in chunks."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import numpy as np
import peft
import pytest
import torch

from pagoda.config import EngineArgs, EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.errors import InvalidRequest
from pagoda.frontend.multimodal.prompt import expand_prompt
from pagoda.lora.layers import EncoderLoRAStep, LoRAPart, LoRASlots
from pagoda.lora.request import LoRARequest
from pagoda.sampling_params import SamplingParams
from tests.conftest import finished_token_ids, tiny_qwen2vl_config
from tests.models.test_qwen2vl_parity import IMG_A, IMG_B, IMG_C, PLACEHOLDERS, VOCAB, _hf_reference, _prompt

STEPS = 6


def _randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # PEFT starts B at zero: an adapter that changes nothing would prove nothing
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)


@pytest.fixture(scope="module")
def tower_setup(tmp_path_factory):
    return make_tower_adapters(tmp_path_factory.mktemp("lora-tower"))


def make_tower_adapters(root: Path) -> tuple[str, dict[str, str], dict[str, tuple[torch.Tensor, list[int]]]]:
    """(base folder, {adapter: folder}, {request id in REQUESTS: transformers' first logits and greedy tokens})."""
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(tiny_qwen2vl_config(VOCAB, tie_word_embeddings=False))
    with torch.no_grad():  # random init leaves logits flat; sharpen them so greedy is robust
        model.lm_head.weight.mul_(30)
    model.save_pretrained(root / "base")

    def load():
        return transformers.Qwen2VLForConditionalGeneration.from_pretrained(root / "base", dtype=torch.float32).eval()

    adapters, models = {}, {None: load()}
    for seed, (name, targets) in enumerate(
        {
            "all": "all-linear",
            "tower": r".*visual\.(patch_embed\.proj|blocks\.\d+\.(attn\.(qkv|proj)|mlp\.fc[12])|merger\.mlp\.[02])",
        }.items()
    ):
        adapted = peft.get_peft_model(load(), peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets))
        tower = [n for n, _ in adapted.named_parameters() if "lora_A" in n and "visual" in n]
        assert any(".merger." in n for n in tower) and any(".blocks." in n for n in tower), tower
        # all-linear leaves the patch embedding (a Conv3d) alone; the tower-only adapter holds its conv LoRA
        assert any("patch_embed" in n for n in tower) == (name == "tower"), tower
        _randomize(adapted, seed + 3)
        adapted.save_pretrained(root / name)
        adapters[name] = str(root / name)
        models[name] = adapted.merge_and_unload().eval()
    expected = {}
    for rid, (adapter, before, images) in REQUESTS.items():
        expected[rid] = _hf_reference(models[adapter], _expanded(before, images), images, STEPS)
    # The tower's adapter matters: without it the same prompt reads other logits.
    _, before, images = REQUESTS["c-tower"]
    base_logits = _hf_reference(models[None], _expanded(before, images), images, STEPS)[0]
    assert (expected["c-tower"][0] - base_logits).abs().max() > 0.1
    return str(root / "base"), adapters, expected


def _expanded(before: list[int], images) -> list[int]:
    ids = _prompt(before, images, [400, 401])
    return expand_prompt(ids, [("image", v) for v in images], PLACEHOLDERS, "test")[0]


def run_tower_requests(engine, adapters: dict[str, str]) -> dict[str, list[int]]:
    """`REQUESTS` through `engine` (an LLMEngine serving the tiny Qwen2-VL with LoRA): each one's greedy tokens."""
    lora = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    for rid, (adapter, before, images) in REQUESTS.items():
        ids = _prompt(before, images, [400, 401])
        expanded, mm = expand_prompt(ids, [("image", v) for v in images], PLACEHOLDERS, "test")
        engine.add_request(rid, expanded, params, mm_inputs=mm, lora_request=lora.get(adapter))
    return finished_token_ids(engine)


# (adapter, prompt ids, images): A and C share a size and B is smaller, so one encoder call regroups the rows;
# A goes both with and without the adapter.
REQUESTS = {
    "a-all": ("all", [300, 301], [IMG_A]),
    "b-base": (None, [302], [IMG_B]),
    "c-tower": ("tower", [303, 304], [IMG_C]),
    "a-base": (None, [305], [IMG_A]),
    "bc-all": ("all", [306], [IMG_B, IMG_C]),
}


@pytest.mark.parametrize("chunk, one_at_a_time", [(None, False), (16, False), (None, True)])
def test_tower_adapters_in_one_step_equal_peft_merged(tower_setup, chunk, one_at_a_time):
    """All requests in one encoder call (each adapter a share of its rows), chunked, and one request per step (an
    adapter on every row of the call: `LoRASlots.add_grouped` adds in place, with no gather)."""
    base, adapters, expected = tower_setup
    kw = {"max_num_batched_tokens": chunk} if chunk else {}
    if one_at_a_time:
        kw["max_num_seqs"] = 1
    engine = LLMEngine(
        EngineConfig.create(
            EngineArgs(
                model=base,
                skip_tokenizer_init=True,
                dtype="float32",
                enable_lora=True,
                max_loras=2,
                max_lora_rank=8,
                enable_tower_connector_lora=True,
                num_gpu_blocks_override=128,
                **kw,
            )
        )
    )
    runner = getattr(engine.runner, "local", engine.runner)  # the driver's, when parallel
    first_logits: dict[str, torch.Tensor] = {}
    sample = runner._sample

    def capture(request_ids, states, logits, spec=None):
        for rid, row in zip(request_ids, logits):
            first_logits.setdefault(rid, row.detach().float().cpu())
        return sample(request_ids, states, logits, spec)

    runner._sample = capture
    tokens = run_tower_requests(engine, adapters)
    for rid, (ref_logits, ref_tokens) in expected.items():
        torch.testing.assert_close(first_logits[rid], ref_logits, atol=1e-4, rtol=1e-4, msg=rid)
        assert tokens[rid] == ref_tokens, rid


def test_a_conv_adapter_whose_b_spans_positions_is_refused_naming_it(tower_setup, tmp_path):
    """PEFT's conv LoRA has a 1×1×1 B; one over several positions has no matrix form: refused in one line."""
    import safetensors.torch

    base, adapters, _ = tower_setup
    folder = tmp_path / "adapter"
    shutil.copytree(adapters["tower"], folder)
    tensors = safetensors.torch.load_file(folder / "adapter_model.safetensors")
    (name,) = [n for n in tensors if "patch_embed" in n and "lora_B" in n]
    tensors[name] = tensors[name].repeat(1, 1, 2, 1, 1)  # [out, r, 2, 1, 1]
    safetensors.torch.save_file(tensors, folder / "adapter_model.safetensors")
    args = dict(model=base, skip_tokenizer_init=True, dtype="float32", enable_lora=True, max_lora_rank=8)
    engine = LLMEngine(EngineConfig.create(EngineArgs(**args, enable_tower_connector_lora=True)))
    with pytest.raises(InvalidRequest, match=r"patch_embed\.proj's lora_B is a \(2, 1, 1\) convolution"):
        engine.add_lora(LoRARequest("wide", 1, str(folder)))


def test_without_the_flag_a_tower_adapter_is_refused_naming_the_flag(tower_setup):
    """Tower slots cost KV cache (~0.3 GB at the 7B shape, rank 64, 4 slots), so they are vLLM's opt-in; an adapter
    with tower weights on a server without them is refused in one line naming the flag, not served half."""
    base, adapters, expected = tower_setup
    args = dict(model=base, skip_tokenizer_init=True, dtype="float32", enable_lora=True, max_lora_rank=8)
    engine = LLMEngine(EngineConfig.create(EngineArgs(**args, num_gpu_blocks_override=128)))
    with pytest.raises(InvalidRequest, match=r"vision tower, which takes adapters only with --enable-tower-connector"):
        engine.add_lora(LoRARequest("tower", 1, adapters["tower"]))
    assert not any("visual" in name for name in engine.runner.lora.layers)


def test_an_encoder_mapping_is_seen_by_the_thread_that_wrote_it_only():
    """The encoder's graph captures (and their warm-up forwards) run on a thread of their own while the engine's
    thread runs an adapted call: they must see the base model, whatever the engine's thread mapped."""
    step = EncoderLoRAStep(torch.device("cpu"))
    slots = LoRASlots((0, 8, 8), [LoRAPart(None, 0, 6)], 2, 4, torch.float32, torch.device("cpu"), step)
    g = torch.Generator().manual_seed(0)
    slots.set(1, {None: (torch.randn(4, 8, generator=g), torch.randn(6, 4, generator=g))})
    x, w = torch.randn(3, 8, generator=g), torch.randn(6, 8, generator=g)
    step.write(np.array([1, -1, 1]))
    seen = {}
    worker = threading.Thread(target=lambda: seen.update(out=slots.apply(x, lambda: x @ w.t())))
    worker.start()
    worker.join()
    torch.testing.assert_close(seen["out"], x @ w.t(), rtol=0, atol=0)
    mine = slots.apply(x, lambda: x @ w.t())
    delta = (x @ slots.a[0, 1].t()) @ slots.b[1].t()
    torch.testing.assert_close(mine, x @ w.t() + delta * torch.tensor([[1.0], [0.0], [1.0]]))
    with pytest.raises(RuntimeError, match="mapped for 3"):
        slots.apply(x[:2], lambda: x[:2] @ w.t())


@pytest.mark.parametrize("mapping", [[0, 0, 0, 0, 0], [1, -1, 0, 1, 0]], ids=["one-slot-every-row", "mixed"])
def test_grouped_adds_equal_the_per_part_reference_for_a_fused_layer(mapping):
    """`add_grouped` (the encoder's path: every part shrunk at once, one expand over the whole output) against
    `add_reference` (per slot and part) on a layer of three parts of different sizes, adapters of full and lower
    rank, every row on one adapter (added in place) and a mix with base rows (gathered)."""
    step = EncoderLoRAStep(torch.device("cpu"))
    parts = [LoRAPart("q", 0, 6), LoRAPart("k", 6, 2), LoRAPart("v", 8, 3)]
    slots = LoRASlots((0, 8, 8), parts, 2, 4, torch.float32, torch.device("cpu"), step)
    g = torch.Generator().manual_seed(1)
    for slot, rank in ((0, 4), (1, 2)):
        slots.set(
            slot, {p.name: (torch.randn(rank, 8, generator=g), torch.randn(p.size, rank, generator=g)) for p in parts}
        )
    x, y = torch.randn(5, 8, generator=g), torch.randn(5, 11, generator=g)
    step.write(np.array(mapping))
    expected = slots.add_reference(x, y.clone(), step.active)
    torch.testing.assert_close(slots.add_grouped(x, y.clone(), step.active), expected)
    assert (expected - y).abs().amax(dim=1).gt(0.1).tolist() == [m >= 0 for m in mapping]


def test_grouped_adds_read_the_adapter_a_slot_holds_now():
    """`add_grouped` keeps each slot's expand operand between calls; a slot given another adapter (`LoRASlots.set`)
    must not be expanded with the block of the one before."""
    step = EncoderLoRAStep(torch.device("cpu"))
    parts = [LoRAPart("q", 0, 6), LoRAPart("k", 6, 2)]
    slots = LoRASlots((0, 8, 8), parts, 1, 4, torch.float32, torch.device("cpu"), step)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    step.write(np.zeros(3, dtype=np.int64))
    for _ in range(2):
        slots.set(0, {p.name: (torch.randn(4, 8, generator=g), torch.randn(p.size, 4, generator=g)) for p in parts})
        expected = slots.add_reference(x, y.clone(), step.active)
        torch.testing.assert_close(slots.add_grouped(x, y.clone(), step.active), expected)
