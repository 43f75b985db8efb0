"""Qwen2-VL image steps through the mixed-step CUDA graphs (`pagoda/worker/graph_runner.py`) against
transformers. On the CPU the graph buffers run without capture and attention runs under Triton's interpreter
(this folder's conftest.py); on a GPU the engine captures the graphs at startup."""

from __future__ import annotations

import torch

from pagoda.frontend.multimodal.prompt import expand_prompt
from pagoda.worker.graph_runner import MIXED
from tests.models import test_qwen2vl_parity as parity

tiny_qwen2vl, hf_model = parity.tiny_qwen2vl, parity.hf_model  # the fixtures: a tiny model and transformers' copy


def test_image_steps_through_mixed_step_graphs_match_transformers(tiny_qwen2vl, hf_model):
    """The graph path (`worker/graph_runner.py`; on the CPU its buffers run without capture, attention through
    the Triton interpreter): the vision tower runs eagerly, then the step replays a token bucket whose embedding
    rows at the placeholder tokens come from the static encoder-row buffer, padding entries on the bucket's last
    token. Two images cut across chunks of a 16-token budget, batched beside a text-only request: every step
    that brought encoder rows replayed a mixed bucket, and the greedy tokens and first logits equal
    transformers'."""
    cases = {name: case for name, case in parity.CASES.items() if name != "one_image"}
    prompts = {name: (parity._prompt(b, imgs, [400, 401]), imgs) for name, (b, imgs) in cases.items()}
    engine = parity.Engine(tiny_qwen2vl, max_num_batched_tokens=16, attention_backend="triton")
    runner = engine.engine.runner
    if not torch.cuda.is_available():
        runner.enable_cuda_graphs(capture=False)
    graphs, run, image_steps = runner.graphs, runner.graphs.run, []

    def counting(inputs, positions, mm=None):
        if inputs.needs_encoder:
            image_steps.append((graphs.bucket_for(inputs), 0 if mm is None else len(mm[0])))
        return run(inputs, positions, mm)

    graphs.run = counting
    tokens = engine.run(prompts, 4)
    # 28 placeholder tokens over 16-token chunks: at least two steps with encoder rows, all in mixed buckets.
    assert len(image_steps) >= 2 and all(kind == MIXED for (kind, _), _ in image_steps)
    assert sum(n for _, n in image_steps) == 28
    for name, (ids, imgs) in prompts.items():
        expanded, _ = expand_prompt(ids, [("image", v) for v in imgs], parity.PLACEHOLDERS, "test")
        ref_logits, ref_tokens = parity._hf_reference(hf_model, expanded, imgs, 4)
        assert tokens[name] == ref_tokens, name
        torch.testing.assert_close(engine.first_logits[name], ref_logits, atol=1e-4, rtol=1e-4)
