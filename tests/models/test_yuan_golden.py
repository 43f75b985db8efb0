"""Yuan2.0 (dense and M32) against the golden fixtures made with the official modeling code.

Every engine path must reproduce the batch-size-1 reference: one prompt at a time, all prompts in
one continuous batch, prefill chunked at 1/5/16/64 tokens (mixed with other requests' decodes),
forced preemption, prefix-cache hits (LF state restored from block snapshots) and n > 1.
Logits are captured where the engine samples from them, so these run the real runner and
scheduler, not a side path.
"""

from __future__ import annotations

import json

import pytest
import torch

from pagoda.config import EngineArgs, EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.errors import ModelLoadError
from pagoda.sampling_params import SamplingParams
from tests.conftest import FIXTURES

CHECKPOINTS = ("yuan2-tiny", "yuan2-m32-tiny")
LOGIT_ATOL = 1e-4


def _golden(name: str) -> dict:
    return json.loads((FIXTURES / name / "golden.json").read_text())


class CapturingEngine:
    """An LLMEngine over a fixture that records, per request, the logits of every sampled step."""

    def __init__(self, name: str, **engine_args):
        # A fixed pool: on a GPU the default would take 90% of its memory for every engine built here.
        engine_args.setdefault("num_gpu_blocks_override", 256)
        model = name if "/" in name else str(FIXTURES / name)
        args = EngineArgs(model=model, skip_tokenizer_init=True, dtype="float32", **engine_args)
        self.engine = LLMEngine(EngineConfig.create(args))
        self.logits: dict[str, list[torch.Tensor]] = {}
        runner = getattr(self.engine.runner, "local", self.engine.runner)  # rank 0's, under tensor parallelism
        sample = runner._sample

        def capture(request_ids, states, logits, spec=None):
            if spec is None:  # (a step with proposals has more logits rows than requests: not recorded)
                for rid, row in zip(request_ids, logits):
                    self.logits.setdefault(rid, []).append(row.detach().float().cpu())
            return sample(request_ids, states, logits, spec)

        runner._sample = capture

    def run(
        self, prompts: list[list[int]], max_tokens: int = 16, n: int = 1, prefix: str = "r"
    ) -> dict[str, list[int]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)
        ids = [f"{prefix}{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            self.engine.add_request(rid, prompt, params)
        tokens: dict[str, list[int]] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    for completion in out.outputs:
                        key = out.request_id if n == 1 else f"{out.request_id}#{completion.index}"
                        tokens[key] = completion.token_ids
        return tokens


def _check_case(got_tokens: list[int], got_logits: list[torch.Tensor], case: dict) -> None:
    assert got_tokens == case["greedy_16"]
    first = got_logits[0]
    torch.testing.assert_close(first, torch.tensor(case["last_logits"]), atol=LOGIT_ATOL, rtol=0)
    for step, (logits, expected) in enumerate(zip(got_logits, case["decode_steps"])):
        ids = torch.tensor(expected["top5_ids"])
        torch.testing.assert_close(
            logits[ids],
            torch.tensor(expected["top5_logits"]),
            atol=LOGIT_ATOL,
            rtol=0,
            msg=lambda m, s=step: f"decode step {s}: {m}",
        )


def _check_all(name: str, capture: CapturingEngine, tokens: dict[str, list[int]], prefix: str = "r") -> None:
    for i, case in enumerate(_golden(name)["cases"]):
        _check_case(tokens[f"{prefix}{i}"], capture.logits[f"{prefix}{i}"], case)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_one_prompt_at_a_time(name):
    capture = CapturingEngine(name)
    for i, case in enumerate(_golden(name)["cases"]):
        tokens = capture.run([case["prompt_ids"]], prefix=f"solo{i}-")
        _check_case(tokens[f"solo{i}-0"], capture.logits[f"solo{i}-0"], case)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_all_prompts_in_one_batch(name):
    capture = CapturingEngine(name)
    tokens = capture.run([c["prompt_ids"] for c in _golden(name)["cases"]])
    _check_all(name, capture, tokens)


@pytest.mark.parametrize("name", CHECKPOINTS)
@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_chunked_prefill_mixed_with_decodes(name, chunk):
    # The step budget is the chunk size: long prompts are split at arbitrary tokens and share steps
    # with other requests' decodes (a packed batch with several LF segments).
    capture = CapturingEngine(name, max_num_batched_tokens=chunk, max_num_seqs=5)
    tokens = capture.run([c["prompt_ids"] for c in _golden(name)["cases"]])
    _check_all(name, capture, tokens)
    if chunk < 45:
        assert capture.engine.scheduler.stats.num_chunked_prefills > 0


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_forced_preemption(name):
    # 4-token blocks, 20 usable: the 45-token prompt + 16 outputs needs 16, so the others get preempted.
    capture = CapturingEngine(
        name, block_size=4, num_gpu_blocks_override=21, max_model_len=64, enable_prefix_caching=False, max_num_seqs=5
    )
    for k, v in capture.engine.runner.kv_caches:  # a stale slot must never be read
        k[1:].fill_(float("nan"))
        v[1:].fill_(float("nan"))
    tokens = capture.run([c["prompt_ids"] for c in _golden(name)["cases"]])
    assert capture.engine.scheduler.stats.num_preemptions > 0
    _check_all(name, capture, tokens)
    _assert_all_slots_free(capture)


def _assert_all_slots_free(capture: CapturingEngine) -> None:
    """Preempted and finished sequences give their state slots back (5 slots for 5 prompts)."""
    capture.engine.step()  # an idle step tells the runner about the last finished requests
    pool = capture.engine.runner.state_pool
    assert sorted(pool._free) == list(range(pool.scratch_slot))  # all but the graphs' scratch slot


@pytest.mark.parametrize("name", CHECKPOINTS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefix_cache_hit_restores_lf_state(name, block_size):
    capture = CapturingEngine(name, block_size=block_size)
    cases = _golden(name)["cases"]
    capture.run([c["prompt_ids"] for c in cases], prefix="warm")
    hits_before = capture.engine.block_manager.prefix_hits
    tokens = capture.run([c["prompt_ids"] for c in cases])
    hits = capture.engine.block_manager.prefix_hits - hits_before
    assert hits >= (23 // block_size + 45 // block_size) * block_size  # the long prompts hit
    _check_all(name, capture, tokens)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_preemption_with_prefix_cache(name):
    # Recompute after preemption goes through the request's own cached blocks and their snapshots.
    capture = CapturingEngine(name, block_size=4, num_gpu_blocks_override=21, max_model_len=64, max_num_seqs=5)
    tokens = capture.run([c["prompt_ids"] for c in _golden(name)["cases"]])
    assert capture.engine.scheduler.stats.num_preemptions > 0
    assert capture.engine.block_manager.prefix_hits > 0
    _check_all(name, capture, tokens)
    _assert_all_slots_free(capture)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_async_scheduling_chunked_preempted_and_cached(name):
    """Step N+1 launched before step N's tokens are read: LF state, chunked prefill (5-token steps
    mixed with decodes), preemption and snapshot restores must still give the goldens."""
    chunked = CapturingEngine(name, max_num_batched_tokens=5, max_num_seqs=5, async_scheduling=True)
    _check_all(name, chunked, chunked.run([c["prompt_ids"] for c in _golden(name)["cases"]]))
    capture = CapturingEngine(
        name, block_size=4, num_gpu_blocks_override=21, max_model_len=64, max_num_seqs=5, async_scheduling=True
    )
    tokens = capture.run([c["prompt_ids"] for c in _golden(name)["cases"]])
    assert capture.engine.scheduler.stats.num_preemptions > 0
    assert capture.engine.block_manager.prefix_hits > 0
    _check_all(name, capture, tokens)
    _assert_all_slots_free(capture)


def test_prefix_hit_on_a_longer_prompt():
    """A new prompt that extends a cached one continues from the snapshot, not from zero state."""
    name = "yuan2-m32-tiny"
    case = _golden(name)["cases"][4]  # 45 tokens
    capture = CapturingEngine(name, block_size=8)
    capture.run([case["prompt_ids"][:20]], max_tokens=1, prefix="short")  # caches 2 blocks
    tokens = capture.run([case["prompt_ids"]], prefix="long")
    assert capture.engine.block_manager.prefix_hits >= 16
    _check_case(tokens["long0"], capture.logits["long0"], case)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_parallel_samples_each_equal_the_reference(name):
    capture = CapturingEngine(name)
    case = _golden(name)["cases"][3]
    tokens = capture.run([case["prompt_ids"]], n=3)
    assert [tokens[f"r0#{i}"] for i in range(3)] == [case["greedy_16"]] * 3


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_every_position_and_cache_contents_after_prefill(name):
    golden = _golden(name)
    # Eager: every position's hidden state is read off the model's forward, which a replayed CUDA
    # graph (GPU runs) never calls; the other golden tests cover the graphs.
    capture = CapturingEngine(name, enforce_eager=True)
    model = capture.engine.runner.model
    hidden_states = []
    forward = model.forward

    def keep_hidden(*args, **kwargs):
        hidden = forward(*args, **kwargs)
        hidden_states.append(hidden)
        return hidden

    model.forward = keep_hidden
    prompt = golden["all_positions"]["prompt_ids"]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    capture.engine.add_request("p", prompt, params)
    capture.engine.step()  # the prefill step only
    with torch.inference_mode():
        logits = model.compute_logits(hidden_states[0])
    torch.testing.assert_close(logits.cpu(), torch.tensor(golden["all_positions"]["logits"]), atol=LOGIT_ATOL, rtol=0)

    # K after RoPE and V per head, read back through the request's block table.
    runner = capture.engine.runner
    request = capture.engine.scheduler.requests["p"]
    bs = runner.block_size
    slots = torch.tensor([request.block_ids[p // bs] * bs + p % bs for p in range(len(prompt))])
    state = runner.states["p"]
    hidden = model.shape.hidden
    for layer, expected in zip(range(len(runner.kv_caches)), golden["cache_after_prefill"]["layers"]):
        k_cache, v_cache = runner.kv_caches[layer]
        k = k_cache.view(-1, *k_cache.shape[2:])[slots.to(k_cache.device)].transpose(0, 1).cpu()  # [heads, pos, D]
        v = v_cache.view(-1, *v_cache.shape[2:])[slots.to(v_cache.device)].transpose(0, 1).cpu()
        torch.testing.assert_close(k, torch.tensor(expected["key_post_rope"]), atol=1e-5, rtol=0)
        torch.testing.assert_close(v, torch.tensor(expected["value"]), atol=1e-5, rtol=0)
        # The reference keeps the last two LF inputs; our slot keeps the last one (x_prev).
        last_two = torch.tensor(expected["lf_memory_last2_normed_inputs"])
        x_prev = runner.state_pool.state[layer, state.state_slot, :hidden].cpu()
        torch.testing.assert_close(x_prev, last_two.reshape(-1, hidden)[-1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_eod_inside_a_prompt_uses_plain_causal_attention(name):
    golden = _golden(name)
    if "eod_in_prompt" not in golden:
        pytest.fail("fixture lacks eod_in_prompt")
    case = golden["eod_in_prompt"]
    capture = CapturingEngine(name)
    capture.run([case["prompt_ids"]], max_tokens=1)
    torch.testing.assert_close(
        capture.logits["r0"][0], torch.tensor(case["last_logits_plain_causal"]), atol=LOGIT_ATOL, rtol=0
    )


def test_startup_logs_the_lf_state_budget(caplog):
    with caplog.at_level("INFO", logger="pagoda"):
        capture = CapturingEngine("yuan2-tiny", max_num_seqs=8)
    spec = capture.engine.runner.kv_cache_spec()
    # 2 layers x (64 + 32) float32 values per sequence, and the same snapshot per block.
    assert spec.state_bytes_per_seq == 2 * 96 * 4
    assert spec.snapshot_bytes_per_block == 2 * 96 * 4
    assert capture.engine.kv_layout.bytes_per_block == 2 * 2 * 4 * 16 * 16 * 4 + 2 * 96 * 4
    assert any("Per-sequence state (LF)" in r.getMessage() and "8 slots" in r.getMessage() for r in caplog.records)


def test_use_shareqk_is_refused(tmp_path):
    import shutil

    folder = tmp_path / "shareqk"
    shutil.copytree(FIXTURES / "yuan2-tiny", folder)
    config = json.loads((folder / "config.json").read_text())
    config["use_shareqk"] = True
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="use_shareqk"):
        LLMEngine(
            EngineConfig.create(EngineArgs(model=str(folder), skip_tokenizer_init=True, num_gpu_blocks_override=64))
        )
