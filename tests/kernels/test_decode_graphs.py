"""Decode steps through the CUDA-graph path (`pagoda/worker/graph_runner.py`) reproduce the Yuan2
goldens: static buffers, padding rows (scratch LF state slot, no K/V store, null-block snapshots),
prefix-cache snapshots written inside the graph and restored by a later request.

On the CPU the graph path runs without capture (the Triton interpreter, same buffers and padding);
on a GPU the engine captures real CUDA graphs at startup and these tests replay them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from pagoda.config import EngineArgs, EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.sampling_params import SamplingParams
from pagoda.worker import graph_runner
from pagoda.worker.graph_runner import DECODE, MIXED, default_buckets, default_token_buckets
from tests.conftest import FIXTURES, finished_token_ids

CUDA = torch.cuda.is_available()
# Tokens per request in the golden tests here: the goldens' first 6 of 16 (on a GPU all 16). Under the
# interpreter every decode step costs seconds (rows x heads programs per layer, each interpreted), and the
# paths these tests pin are all taken within 6: a block boundary (block_size 4) in every request's decode,
# chunked prefill mixed with decodes, bucket padding, async input gathering, and the second round's
# restored LF snapshots (those are the prompts' blocks). All 16 tokens of every golden, on every path but
# the graphs: test_yuan_golden.py.
TOKENS = 16 if CUDA else 6
# Synchronous and async scheduling feed the graphs the same buffers; they differ in where a decode row's
# input token comes from (the host, or the last step's samples on the device). Under the interpreter each
# golden run here costs close to a minute, so the CPU runs these with async scheduling (the default on
# CUDA, and the one with more to get wrong: the device-side gather) and takes the synchronous graph path
# through `test_yuan_one_row_at_a_time_matches_golden_steps` (the CPU's default scheduling); a GPU runs both.
SCHEDULING = [False, True] if CUDA else [True]


def _engine(fixture: str, **overrides) -> LLMEngine:
    args = dict(
        model=str(FIXTURES / fixture),  # overridden by `model` for a model that is not a fixture
        skip_tokenizer_init=True,
        dtype="float32",
        attention_backend="triton",
        block_size=4,
        num_gpu_blocks_override=200,
        max_num_seqs=8,
        device="cuda" if CUDA else "cpu",
    )
    engine = LLMEngine(EngineConfig.create(EngineArgs(**(args | overrides))))
    if not CUDA:
        engine.runner.enable_cuda_graphs(capture=False)  # every rank's runner under pipeline parallelism
    return engine


def _run(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    return finished_token_ids(engine)


def test_default_buckets():
    assert default_buckets(1) == [1]
    assert default_buckets(6) == [1, 2, 4, 6]
    assert default_buckets(8) == [1, 2, 4, 8]
    assert default_buckets(256)[:6] == [1, 2, 4, 8, 16, 24] and default_buckets(256)[-1] == 256
    assert default_buckets(100)[-2:] == [96, 100]


def test_default_token_buckets():
    assert default_token_buckets(8) == [16]
    assert default_token_buckets(100)[-1] == 128 and default_token_buckets(8192)[-1] == 2048
    assert default_token_buckets(2048)[-1] == 2048  # a 2048-token step has no spare token: eager


def _count_buckets(graphs) -> dict[str, list[int]]:
    """The buckets replayed, by kind (decode: rows; mixed: tokens), and under "verify" the proposals that
    replayed steps verified."""
    used: dict[str, list] = {DECODE: [], MIXED: [], "verify": [], "verify_kinds": []}
    run = graphs.run

    def counting(inputs, positions, mm=None):
        kind, size = graphs.bucket_for(inputs)
        used[kind].append(size)
        if inputs.spec is not None:
            used["verify"].append(int(inputs.spec.counts.sum()))
            every_token_verified = len(positions) == inputs.num_tokens  # no prefill chunk beside the rows
            used["verify_kinds"].append((kind, every_token_verified))
        return run(inputs, positions, mm)

    graphs.run = counting
    return used


@pytest.mark.parametrize("async_scheduling", SCHEDULING)
def test_yuan_goldens_through_mixed_step_graphs(async_scheduling):
    """Chunked prefill (8-token budget) mixed with decodes: every step with a prefill chunk replays a
    token-bucket graph (decode rows through the prefill kernel's tiles, padding rows on the scratch
    slot), the second round restores LF snapshots those graphs wrote. With async scheduling the
    decode rows' input tokens are gathered on the device into the graph's static buffer."""
    golden = json.loads((FIXTURES / "yuan2-tiny" / "golden.json").read_text())
    # On the CPU three of the five prompts (1, 7 and 45 tokens: no chunk, two blocks, six chunks of
    # the 8-token budget) take every path here at 3/5 of the interpreter's time; a GPU runs all five.
    cases = golden["cases"] if CUDA else [golden["cases"][i] for i in (0, 2, 4)]
    engine = _engine("yuan2-tiny", max_num_batched_tokens=8, async_scheduling=async_scheduling)
    assert engine.runner.graphs.spec.token_buckets == (16,)
    used = _count_buckets(engine.runner.graphs)
    mixed, decode = used[MIXED], used[DECODE]
    for round_ in range(2):
        done = _run(engine, {f"{round_}-{i}": c["prompt_ids"] for i, c in enumerate(cases)}, TOKENS)
        for i, case in enumerate(cases):
            assert done[f"{round_}-{i}"] == case["greedy_16"][:TOKENS], f"round {round_}, case {i}"
    assert engine.scheduler.stats.num_chunked_prefills > 0 and engine.block_manager.prefix_hits > 0
    # At least the 45-token prompt's six chunks of round 1 went through a mixed graph, and most decodes too.
    assert len(mixed) >= 6 and len(decode) >= TOKENS


@pytest.mark.parametrize("async_scheduling", SCHEDULING)
def test_yuan_goldens_through_decode_graphs(async_scheduling):
    golden = json.loads((FIXTURES / "yuan2-tiny" / "golden.json").read_text())
    cases = golden["cases"]  # 1, 2, 7, 23 and 45 prompt tokens
    engine = _engine("yuan2-tiny", async_scheduling=async_scheduling)
    graphs = engine.runner.graphs
    assert graphs is not None
    used = _count_buckets(graphs)[DECODE]
    for round_ in range(2):  # round 1 restores LF snapshots written by graph steps
        done = _run(engine, {f"{round_}-{i}": c["prompt_ids"] for i, c in enumerate(cases)}, TOKENS)
        for i, case in enumerate(cases):
            assert done[f"{round_}-{i}"] == case["greedy_16"][:TOKENS], f"round {round_}, case {i}"
    assert engine.block_manager.prefix_hits > 0
    assert 8 in used and len(used) >= TOKENS - 1  # 5 rows padded to the bucket of 8, most steps graphed
    # Every slot but the scratch one is free again once the runner hears of the last finishes.
    engine.step()
    pool = engine.runner.state_pool
    assert sorted(pool._free) == list(range(pool.scratch_slot))


def test_yuan_one_row_at_a_time_matches_golden_steps():
    """Bucket 1 and 2 (no padding / one padding row), prompts decoded alone and in a pair."""
    golden = json.loads((FIXTURES / "yuan2-tiny" / "golden.json").read_text())
    engine = _engine("yuan2-tiny", max_num_seqs=2)
    assert engine.runner.graphs.spec.decode_buckets == (1, 2)
    a, b, c = golden["cases"][0], golden["cases"][2], golden["cases"][4]
    assert _run(engine, {"a": a["prompt_ids"]}, TOKENS)["a"] == a["greedy_16"][:TOKENS]
    done = _run(engine, {"b": b["prompt_ids"], "c": c["prompt_ids"]}, TOKENS)
    assert done["b"] == b["greedy_16"][:TOKENS] and done["c"] == c["greedy_16"][:TOKENS]


def test_enforce_eager_and_moe_skip_graphs():
    # The eager half can only fail on a GPU (the CPU never captures); the MoE half runs everywhere.
    engine = LLMEngine(
        EngineConfig.create(
            EngineArgs(
                model=str(FIXTURES / "yuan2-tiny"),
                skip_tokenizer_init=True,
                dtype="float32",
                enforce_eager=True,
                attention_backend="triton" if CUDA else "torch",
                num_gpu_blocks_override=50,
                device="cuda" if CUDA else "cpu",
            )
        )
    )
    assert not engine.config.device.cuda_graphs and engine.runner.graphs is None
    moe = _engine("yuan2-m32-tiny")
    assert moe.runner.graphs is None  # the expert loop syncs with the host


@pytest.mark.skipif(CUDA and torch.cuda.device_count() < 2, reason="two pipeline stages need two GPUs")
def test_yuan_goldens_through_graphs_of_two_pipeline_stages(tmp_path, monkeypatch):
    """PP = 2: each stage replays its own graphs (decode and mixed buckets); stage 1 receives stage 0's
    activations over the whole bucket into its static buffers, and the last stage's logits reach the driver."""
    if not CUDA:  # the spawned stage runs the interpreter too: give it this folder's interpreter fixes
        (tmp_path / "sitecustomize.py").write_text("import tests.kernels.conftest  # noqa: F401\n")
        root = str(Path(__file__).resolve().parents[2])
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), root, os.environ.get("PYTHONPATH", "")]))
    golden = json.loads((FIXTURES / "yuan2-tiny" / "golden.json").read_text())
    cases = golden["cases"] if CUDA else [golden["cases"][i] for i in (0, 2, 4)]
    engine = _engine("yuan2-tiny", max_num_batched_tokens=8, async_scheduling=True, pipeline_parallel_size=2)
    try:
        used = _count_buckets(engine.runner.local.graphs)
        done = _run(engine, {str(i): c["prompt_ids"] for i, c in enumerate(cases)}, TOKENS)
        for i, case in enumerate(cases):
            assert done[str(i)] == case["greedy_16"][:TOKENS], f"case {i}"
        assert used[MIXED] and len(used[DECODE]) >= TOKENS - 2
    finally:
        engine.shutdown()


@pytest.mark.parametrize("token_rows", [True, False], ids=["tokens-as-decode-rows", "mixed-buckets"])
def test_speculative_steps_replay_graphs_with_outputs_unchanged(tiny_llama, token_rows, monkeypatch):
    """Verification steps (rows of 1 + d tokens) replay a graph and take their logits at every verified position:
    greedy outputs equal the same engine's without speculation. By default (a model without per-sequence state)
    each token of such a step is a decode row of its own, its context ending at itself, through a decode bucket;
    with PAGODA_SPEC_DECODE_ROWS=0 the step replays a mixed bucket. Suffix proposals make the second round's
    proposals right by construction (the first round's outputs, same prompts), so most are kept — a token that
    saw a later one, or a wrong position, would change a kept token or the token after it."""
    monkeypatch.setattr(graph_runner, "SPEC_DECODE_ROWS", token_rows)
    prompts = {"a": [5, 6, 7, 8, 9, 10], "b": [40, 41, 40, 41, 40, 41, 40], "c": [3, 77, 12, 90]}
    # Decode buckets up to 16 rows: three requests' 1 + 3 tokens each fit one.
    overrides = dict(model=tiny_llama, max_model_len=256, max_num_seqs=16)
    expected = _run(_engine("", **overrides), prompts, 12)
    spec = {"method": "suffix", "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    engine = _engine("", **overrides, speculative_config=spec)
    used = _count_buckets(engine.runner.graphs)
    for _ in range(2):
        assert _run(engine, prompts, 12) == expected
    counts = engine.speculator.counts
    assert counts.num_drafts >= 6 and counts.num_accepted_tokens >= 0.75 * counts.num_draft_tokens
    assert sum(used["verify"]) == counts.num_draft_tokens  # every verification step replayed a graph
    # Steps of verification rows only take a decode bucket (several rows at once as well as one: tables and
    # contexts repeat per token); a step with a prefill chunk beside them, a mixed one.
    kinds = set(used["verify_kinds"])
    if token_rows:
        assert {kind for kind, only_rows in kinds if only_rows} == {DECODE}
        assert {kind for kind, only_rows in kinds if not only_rows} <= {MIXED}
    else:
        assert {kind for kind, _ in kinds} == {MIXED}
    assert max(used["verify"]) > 3


def test_yuan_verification_steps_roll_lf_state_back_inside_graphs():
    """Yuan2 verification steps replay mixed graphs that also keep the LF state after every proposal position
    (beside the prefix-cache snapshots); rows roll back to their last kept token. Proposals: the golden
    answer's next two tokens, then a wrong one (tests/models/test_yuan_speculation.py runs it eagerly)."""
    from tests.models.test_yuan_speculation import SPEC, _golden_proposer

    golden = json.loads((FIXTURES / "yuan2-tiny" / "golden.json").read_text())
    cases = golden["cases"] if CUDA else [golden["cases"][i] for i in (0, 2)]
    engine = _engine("yuan2-tiny", max_num_batched_tokens=8, speculative_config=SPEC)
    engine.speculator.ngram.propose = _golden_proposer("yuan2-tiny")
    used = _count_buckets(engine.runner.graphs)
    done = _run(engine, {str(i): c["prompt_ids"] for i, c in enumerate(cases)}, TOKENS)
    for i, case in enumerate(cases):
        assert done[str(i)] == case["greedy_16"][:TOKENS], f"case {i}"
    counts = engine.speculator.counts
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens
    assert sum(used["verify"]) == counts.num_draft_tokens  # every verification replayed a graph
