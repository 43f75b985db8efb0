"""Qwen2-VL through the engine against transformers' Qwen2VLForConditionalGeneration (tiny, random).

The reference model is saved with `save_pretrained` and loaded by our loader. Logits are captured
where the runner samples, so chunked prefill (an image cut across steps), batching and the prefix
cache are the real engine paths.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.config import EngineArgs, EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.frontend.multimodal.prompt import PlaceholderIds, expand_prompt
from pagoda.sampling_params import SamplingParams
from tests.conftest import QWEN2VL_PATCH_WIDTH as PATCH_WIDTH
from tests.conftest import RandomVisual, tiny_qwen2vl_config

IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = 151655, 151656, 151652, 151653
VOCAB = 151936
PLACEHOLDERS = PlaceholderIds(IMAGE_PAD, VIDEO_PAD)


def random_visual(grid: tuple[int, int, int], seed: int) -> RandomVisual:
    rng = np.random.default_rng(seed)
    return RandomVisual(rng.standard_normal((grid[0] * grid[1] * grid[2], PATCH_WIDTH)).astype(np.float32), grid)


@pytest.fixture(scope="module")
def tiny_qwen2vl(tmp_path_factory) -> str:
    import transformers

    config = tiny_qwen2vl_config(VOCAB, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # random init leaves logits flat; sharpen them so greedy is robust
        model.lm_head.weight.mul_(30)
    folder = tmp_path_factory.mktemp("tiny-qwen2vl")
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def hf_model(tiny_qwen2vl):
    import transformers

    return transformers.Qwen2VLForConditionalGeneration.from_pretrained(tiny_qwen2vl, dtype=torch.float32).eval()


def _prompt(text_before: list[int], images: list[RandomVisual], text_after: list[int]) -> list[int]:
    ids = list(text_before)
    for _ in images:
        ids += [VISION_START, IMAGE_PAD, VISION_END] + [1000 + len(ids)]
    return ids + list(text_after)


def _hf_reference(hf, ids: list[int], images: list[RandomVisual], steps: int) -> tuple[torch.Tensor, list[int]]:
    """Last-position logits and a greedy continuation from transformers, with M-RoPE positions from
    transformers' own get_rope_index."""
    kwargs = {}
    if images:
        kwargs = dict(
            pixel_values=torch.from_numpy(np.concatenate([v.pixel_values for v in images])),
            image_grid_thw=torch.tensor([v.grid_thw for v in images]),
        )
    input_ids = torch.tensor([ids])
    mm_types = (input_ids == IMAGE_PAD).long()
    with torch.no_grad():
        logits = hf(input_ids=input_ids, mm_token_type_ids=mm_types, **kwargs).logits[0, -1]
        out = hf.generate(
            input_ids=input_ids,
            mm_token_type_ids=mm_types,
            max_new_tokens=steps,
            do_sample=False,
            attention_mask=torch.ones_like(input_ids),
            **kwargs,
        )
    return logits, out[0, len(ids) :].tolist()


class Engine:
    def __init__(self, folder: str, **kw):
        kw.setdefault("num_gpu_blocks_override", 128)
        self.engine = LLMEngine(
            EngineConfig.create(EngineArgs(model=folder, skip_tokenizer_init=True, dtype="float32", **kw))
        )
        self.first_logits: dict[str, torch.Tensor] = {}
        runner = getattr(self.engine.runner, "local", self.engine.runner)  # the driver's, when parallel
        sample = runner._sample

        def capture(request_ids, states, logits, spec=None):
            for rid, row in zip(request_ids, logits):
                self.first_logits.setdefault(rid, row.detach().float().cpu())
            return sample(request_ids, states, logits, spec)

        runner._sample = capture

    def run(self, prompts: dict[str, tuple[list[int], list[RandomVisual]]], steps: int) -> dict[str, list[int]]:
        params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
        for rid, (ids, images) in prompts.items():
            expanded, mm = expand_prompt(ids, [("image", v) for v in images], PLACEHOLDERS, "test")
            self.engine.add_request(rid, expanded, params, mm_inputs=mm if images else None)
        tokens = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
        return tokens


STEPS = 8
IMG_A = random_visual((1, 8, 12), 1)  # 24 placeholder tokens
IMG_B = random_visual((1, 4, 4), 2)  # 4 placeholder tokens
IMG_C = random_visual((1, 8, 12), 3)  # same size as A, other pixels
CASES = {
    "text_only": ([300, 301, 302, 303, 304], []),
    "one_image": ([300, 301, 302], [IMG_A]),
    "two_images": ([300, 301], [IMG_A, IMG_B]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("chunk", [None, 7])
def test_logits_and_greedy_match_transformers(tiny_qwen2vl, hf_model, case, chunk):
    before, images = CASES[case]
    ids = _prompt(before, images, [400, 401, 402])
    expanded, _ = expand_prompt(ids, [("image", v) for v in images], PLACEHOLDERS, "test")
    ref_logits, ref_tokens = _hf_reference(hf_model, expanded, images, STEPS)
    kw = {"max_num_batched_tokens": chunk} if chunk else {}
    engine = Engine(tiny_qwen2vl, **kw)
    tokens = engine.run({"r": (ids, images)}, STEPS)
    if chunk and images:
        assert engine.engine.scheduler.stats.num_chunked_prefills > 0  # the 24-token image was cut
    torch.testing.assert_close(engine.first_logits["r"], ref_logits, atol=1e-4, rtol=1e-4)
    assert tokens["r"] == ref_tokens


def test_batched_requests_with_different_images(tiny_qwen2vl, hf_model):
    prompts = {name: (_prompt(b, imgs, [400, 401]), imgs) for name, (b, imgs) in CASES.items()}
    engine = Engine(tiny_qwen2vl, max_num_batched_tokens=16)
    tokens = engine.run(prompts, STEPS)
    for name, (ids, imgs) in prompts.items():
        expanded, _ = expand_prompt(ids, [("image", v) for v in imgs], PLACEHOLDERS, "test")
        assert tokens[name] == _hf_reference(hf_model, expanded, imgs, STEPS)[1], name


def test_pipeline_stages_match_transformers_with_images(tiny_qwen2vl, hf_model):
    """Two pipeline stages (gloo): the vision tower and the embedding on stage 0 (the driver), the LM head
    on stage 1, which hands the logits back; images chunked across steps and batched with text."""
    prompts = {name: (_prompt(b, imgs, [400, 401]), imgs) for name, (b, imgs) in CASES.items()}
    engine = Engine(tiny_qwen2vl, max_num_batched_tokens=16, pipeline_parallel_size=2)
    try:
        model = engine.engine.runner.local.model
        assert model.stage.first and not model.stage.last and list(model.stage.layers) == [0]
        tokens = engine.run(prompts, STEPS)
    finally:
        engine.engine.shutdown()
    for name, (ids, imgs) in prompts.items():
        expanded, _ = expand_prompt(ids, [("image", v) for v in imgs], PLACEHOLDERS, "test")
        ref_logits, ref_tokens = _hf_reference(hf_model, expanded, imgs, STEPS)
        assert tokens[name] == ref_tokens, name
        torch.testing.assert_close(engine.first_logits[name], ref_logits, atol=1e-4, rtol=1e-4)


def test_prefix_cache_never_shares_blocks_across_different_images(tiny_qwen2vl, hf_model):
    # Identical token ids (32 text tokens, then the same-size image), different pixels.
    text = list(range(500, 532))
    ids = _prompt(text, [IMG_A], [400, 401])
    engine = Engine(tiny_qwen2vl, block_size=16)
    first = engine.run({"a": (ids, [IMG_A])}, STEPS)["a"]
    hits_before = engine.engine.block_manager.prefix_hits
    second = engine.run({"c": (ids, [IMG_C])}, STEPS)["c"]
    # Only the two text-only blocks may be shared; none that holds a placeholder of the image.
    assert engine.engine.block_manager.prefix_hits - hits_before == 32
    for image, got in ((IMG_A, first), (IMG_C, second)):
        expanded, _ = expand_prompt(ids, [("image", image)], PLACEHOLDERS, "test")
        assert got == _hf_reference(hf_model, expanded, [image], STEPS)[1]
    assert first != second

    # The same image again: a full-prompt cache hit and the encoder output from the encoder cache.
    hits_before = engine.engine.block_manager.prefix_hits
    again = engine.run({"a2": (ids, [IMG_A])}, STEPS)["a2"]
    assert again == first
    assert engine.engine.block_manager.prefix_hits - hits_before >= 48


def test_encoder_runs_once_per_image_across_chunks(tiny_qwen2vl):
    engine = Engine(tiny_qwen2vl, max_num_batched_tokens=5, enable_prefix_caching=False)
    calls = []
    encode = engine.engine.runner.model.encode

    def counting(pixels, grids):
        calls.append(list(grids))
        return encode(pixels, grids)

    engine.engine.runner.model.encode = counting
    engine.run({"r": (_prompt([300], [IMG_A, IMG_B], [400]), [IMG_A, IMG_B])}, 2)
    assert sorted(g for c in calls for g in c) == sorted([IMG_A.grid_thw, IMG_B.grid_thw])


def test_text_only_model_refuses_images(tiny_qwen2):
    engine = LLMEngine(
        EngineConfig.create(EngineArgs(model=tiny_qwen2, skip_tokenizer_init=True, num_gpu_blocks_override=80))
    )
    ids = [1, 2, 3]
    _, mm = expand_prompt([1, 500, 2], [("image", IMG_B)], PlaceholderIds(500, 501), "x")
    from pagoda.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="does not accept images"):
        engine.add_request("r", ids, SamplingParams(max_tokens=2), mm_inputs=mm)


@pytest.mark.parametrize(
    "rope",
    [
        {"type": "mrope", "mrope_section": [2, 3, 3]},
        {"type": "default", "rope_type": "default", "mrope_section": [2, 3, 3]},
    ],
)
def test_official_flat_config_and_renamed_weights_load_the_same_model(tiny_qwen2vl, hf_model, tmp_path, rope):
    """The official checkpoints' layout: flat config.json with `rope_scaling` (mrope or default
    spelling) and the weights under `model.language_model.*` / `model.visual.*` as 4.5x re-saves
    write them — must give exactly the reference logits."""
    import json

    from safetensors.torch import load_file, save_file

    nested = json.loads(open(f"{tiny_qwen2vl}/config.json").read())
    text = nested.pop("text_config")
    flat = {
        **nested,
        **{k: v for k, v in text.items() if k not in ("rope_parameters", "model_type", "dtype")},
        "rope_theta": 1e6,
        "rope_scaling": rope,
        "architectures": ["Qwen2VLForConditionalGeneration"],
    }
    flat["vision_config"] = {k: v for k, v in nested["vision_config"].items() if k not in ("dtype",)}
    folder = tmp_path / "flat"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(flat))
    weights = load_file(f"{tiny_qwen2vl}/model.safetensors")
    renamed = {
        ("model.language_model." + k[len("model.") :])
        if k.startswith("model.")
        else ("model." + k if k.startswith("visual.") else k): v
        for k, v in weights.items()
    }
    assert any(k.startswith("model.language_model.") for k in renamed)
    save_file(renamed, str(folder / "model.safetensors"))
    before, images = CASES["two_images"]
    ids = _prompt(before, images, [400])
    expanded, _ = expand_prompt(ids, [("image", v) for v in images], PLACEHOLDERS, "test")
    engine = Engine(str(folder))
    engine.run({"r": (ids, images)}, 2)
    torch.testing.assert_close(
        engine.first_logits["r"], _hf_reference(hf_model, expanded, images, 1)[0], atol=1e-4, rtol=1e-4
    )


def test_encoder_budget_keeps_outputs_and_bounds_each_encode(tiny_qwen2vl, hf_model):
    """`max_encoder_tokens_per_step=24`: the requests' 24 + 4 + 24 + 4 placeholder tokens are spread over
    several steps, no encoder call goes over 24 tokens (A's 24 alone at most), and the greedy tokens are
    still transformers'."""
    prompts = {name: (_prompt(b, imgs, [400, 401]), imgs) for name, (b, imgs) in CASES.items()}
    prompts["again"] = (_prompt([305], [IMG_C, IMG_B], [402]), [IMG_C, IMG_B])
    engine = Engine(tiny_qwen2vl, max_num_batched_tokens=256, max_encoder_tokens_per_step=24)
    calls = []
    encode = engine.engine.runner.model.encode

    def counting(pixels, grids):
        calls.append([t * h * w // 4 for t, h, w in grids])  # placeholder tokens (2x2 merge)
        return encode(pixels, grids)

    engine.engine.runner.model.encode = counting
    tokens = engine.run(prompts, STEPS)
    assert len(calls) >= 3 and all(sum(c) <= 24 for c in calls), calls
    for name, (ids, imgs) in prompts.items():
        expanded, _ = expand_prompt(ids, [("image", v) for v in imgs], PLACEHOLDERS, "test")
        assert tokens[name] == _hf_reference(hf_model, expanded, imgs, STEPS)[1], name
