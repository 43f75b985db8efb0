"""Greedy speculation on the CPU's default weights: the embedded GGUF's 4-bit layers, whose bf16 activations turn
any difference in rounding into a flipped near tie. A verification step runs its tokens as decode rows attended as
one-token steps (`worker/spec_rows.attention_batch`), so the output is a plain step's, token for token. The float32
identity checks are in test_spec_decode_engine.py."""

from __future__ import annotations

import sys
from pathlib import Path

from pagoda import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from spec_decode_cpu import CHAT, COPY  # noqa: E402  (the benchmark's prompts: copying, and open questions)

# Prompt lookup with n-grams from 2 tokens: proposals on open chat too, so most steps of these prompts verify.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


def test_greedy_speculation_on_the_4bit_layers_gives_the_plain_steps_tokens():
    params = SamplingParams(temperature=0, max_tokens=32)
    # The benchmark's prompts on which verifying the tokens together flipped a near tie within 32 tokens.
    chats = [[{"role": "user", "content": p}] for p in [(CHAT + COPY)[i] for i in (4, 5, 9)]]

    def answers(**kwargs) -> tuple[list[list[int]], LLM]:
        llm = LLM(max_model_len=2048, cpu_kv_cache_space_gib=0.25, **kwargs)
        out = [llm.chat([c], params, use_tqdm=False)[0].outputs[0].token_ids for c in chats]  # c = 1
        llm.shutdown()
        return out, llm

    plain, _ = answers()
    speculated, llm = answers(speculative_config=SPEC)
    assert speculated == plain
    assert llm.engine.speculator.counts.num_drafts > 0, "the prompts were meant to verify proposals"
