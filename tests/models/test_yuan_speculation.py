"""Speculative decoding on Yuan2 (dense and M32) against the golden fixtures: a verification step runs every
proposal through the LF gate, whose per-sequence state then holds the state after the *last* proposal; each row
must roll its state back to the state after its last kept token (`worker/state_slots.py`).

The proposer here knows the golden answer and proposes its next two tokens and then a wrong one, so every
verification keeps some proposals and rejects the last: a state left after a rejected token, or rolled back to
the wrong position, changes the next token. Runs with prefix caching (block snapshots and the speculative
states share one pool; the second round restores LF state from snapshots), without it (only the speculative
states), and with prefill chunks mixed with verification rows.
"""

from __future__ import annotations

import pytest

from tests.models.test_yuan_golden import CHECKPOINTS, CapturingEngine, _golden

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 16}


def _golden_proposer(name: str):
    """propose(tokens, window): the golden continuation's next two tokens, then one that is not the third."""
    cases = _golden(name)["cases"]

    def propose(array, window: int) -> list[int]:
        tokens = array.tolist()  # the speculator hands proposers each request's kept int64 array
        case = next(c for c in cases if tokens[: len(c["prompt_ids"])] == c["prompt_ids"])
        done = len(tokens) - len(case["prompt_ids"])
        rest = case["greedy_16"][done:]
        return rest[:2] + [rest[2] + 1] if len(rest) > 2 else rest[:1]

    return propose


@pytest.mark.parametrize("name", CHECKPOINTS)
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_rejected_proposals_roll_the_lf_state_back(name, prefix_caching):
    capture = CapturingEngine(
        name, block_size=4, max_num_batched_tokens=16, enable_prefix_caching=prefix_caching, speculative_config=SPEC
    )
    speculator = capture.engine.speculator
    speculator.ngram.propose = _golden_proposer(name)
    cases = _golden(name)["cases"]
    prompts = [case["prompt_ids"] for case in cases]
    for round_ in "ab":  # the second round: prefix-cache hits restore LF state from block snapshots
        tokens = capture.run(prompts, prefix=round_)
        for i, case in enumerate(cases):
            assert tokens[f"{round_}{i}"] == case["greedy_16"], f"round {round_}, case {i}"
    counts = speculator.counts
    assert counts.num_accepted_tokens >= counts.num_drafts  # kept proposals ...
    assert counts.num_accepted_tokens < counts.num_draft_tokens  # ... and rejected ones, in most steps
    assert capture.engine.scheduler.stats.num_chunked_prefills > 0
    capture.engine.shutdown()


def test_speculative_states_are_counted_in_the_state_memory():
    """1 + k states per sequence beside the slots: the CPU pool is sized after them, the snapshot pool holds them
    past the blocks (and one null entry when prefix caching is off)."""
    plain = CapturingEngine("yuan2-tiny", max_num_seqs=8, enable_prefix_caching=False)
    spec = CapturingEngine("yuan2-tiny", max_num_seqs=8, enable_prefix_caching=False, speculative_config=SPEC)
    per_seq = 2 * 96 * 4  # 2 layers x (64 + 32) float32 values
    assert plain.engine.runner.kv_cache_spec().state_pool_bytes(8) == 8 * per_seq
    assert spec.engine.runner.kv_cache_spec().state_pool_bytes(8) == 8 * per_seq * (1 + 4)
    assert plain.engine.runner.state_pool.snapshots.shape[1] == 0
    assert spec.engine.runner.state_pool.snapshots.shape[1] == 1 + 8 * 4
