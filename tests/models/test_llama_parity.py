"""Logit parity with transformers for Llama and Qwen2 loaded by our loader (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams

PROMPTS = [
    [5, 17, 301, 44, 9, 260, 88, 13, 402, 77, 3, 19, 250, 111, 6, 7, 8, 200, 31, 99, 145, 67, 23],
    [400, 12, 97, 501, 2, 33],
]


def _hf_model(folder: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _our_prefill_logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """Our model's logits at every position of one prompt (one prefill with a block table)."""
    return llm.engine.runner.prompt_logits(token_ids)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_prefill_and_greedy_decode_match_transformers(kind, request):
    folder = request.getfixturevalue(f"tiny_{kind}")
    hf = _hf_model(folder)
    # device="auto": the CPU in CI (PyTorch backend), the GPU on the device machine (Triton backend,
    # decode steps replayed from CUDA graphs).
    llm = LLM(model=folder, skip_tokenizer_init=True, num_gpu_blocks_override=64, max_model_len=256, dtype="float32")

    for prompt in PROMPTS:
        ours = _our_prefill_logits(llm, prompt)
        with torch.inference_mode():
            ref = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)

    # 20 greedy steps: capture the logits our engine samples from at each step (where the runner
    # samples, so replayed CUDA graphs on a GPU are covered too).
    captured: list[torch.Tensor] = []
    runner = llm.engine.runner
    sample = runner._sample
    runner._sample = lambda ids, states, logits, spec=None: (
        captured.append(logits.detach().clone()) or sample(ids, states, logits, spec)
    )
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    runner._sample = sample
    ours_by_step = torch.cat(captured).cpu()  # rows: step-major, prompt order within a step
    for row, (prompt, out) in enumerate(zip(PROMPTS, outputs)):
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=20,
                min_new_tokens=20,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        ref_tokens = ref.sequences[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == ref_tokens
        ref_logits = torch.cat(ref.logits)  # [20, V]
        torch.testing.assert_close(ours_by_step[row :: len(PROMPTS)], ref_logits, atol=1e-4, rtol=0)


def test_sharded_checkpoint_loads_identically(tmp_path, tiny_qwen2):
    from tests.conftest import build_tiny_model

    folder = build_tiny_model("qwen2", str(tmp_path / "sharded"), max_shard_size="100KB")
    import os

    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = LLM(model=folder, skip_tokenizer_init=True, num_gpu_blocks_override=64, max_model_len=256).generate(
        [PROMPTS[0]], params, use_tqdm=False
    )
    b = LLM(model=tiny_qwen2, skip_tokenizer_init=True, num_gpu_blocks_override=64, max_model_len=256).generate(
        [PROMPTS[0]], params, use_tqdm=False
    )
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
