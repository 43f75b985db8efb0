"""Speculative decoding's pieces against naive references: the n-gram proposer against a brute-force search,
greedy verification against a per-row loop, rejection sampling against the target distribution itself
(statistically, on a tiny vocabulary), and `--speculative-config` parsing by its messages."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from pagoda.errors import ConfigError
from pagoda.spec_decode.config import SpeculativeConfig, parse_speculative_config
from pagoda.spec_decode.ngram import NgramProposer
from pagoda.spec_decode.rejection import rejection_sample, verify_greedy


# ---- n-gram proposals ----------------------------------------------------------------------------
def naive_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize("seed", range(20))
def test_ngram_matches_the_brute_force_search(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 50])
    min_n = rng.randrange(1, 4)
    max_n = rng.randrange(min_n, 6)
    proposer = NgramProposer(rng.randrange(1, 8), min_n, max_n)
    for _ in range(30):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        k = rng.randrange(0, 9)
        assert proposer.propose(tokens, k) == naive_propose(tokens, k, min_n, max_n), tokens


@pytest.mark.parametrize("seed", range(6))
def test_ngram_matches_the_brute_force_search_on_long_repetitive_sequences(seed):
    # Hundreds of earlier occurrences of the last token: the search narrows them depth by depth first.
    rng = random.Random(seed)
    proposer = NgramProposer(5, 1, rng.randrange(2, 9))
    for _ in range(10):
        period = [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
        tokens = (period * 100)[: rng.randrange(50, 400)] + [rng.randrange(3) for _ in range(rng.randrange(0, 30))]
        assert proposer.propose(tokens) == naive_propose(tokens, 5, 1, proposer.max_n), tokens


def test_ngram_copies_the_span_that_follows_the_longest_match():
    context = [1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 0, 9, 1, 2, 3, 4]
    # [1, 2, 3, 4] (n=4) occurs at 0, followed by 5 6 7; [2, 3, 4] alone would pick the later 0 9 1.
    assert NgramProposer(3, 1, 4).propose(context) == [5, 6, 7]
    assert NgramProposer(3, 1, 3).propose(context) == [0, 9, 1]
    assert NgramProposer(3, 5, 6).propose(context) == []  # no 5-gram repeats
    assert NgramProposer(4, 1, 2).propose([7]) == []  # nothing before the suffix


# ---- greedy verification -------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_verify_greedy_keeps_the_prefix_that_matches_then_the_models_token(seed):
    g = torch.Generator().manual_seed(seed)
    rows, k, vocab = 64, 4, 3
    target = torch.randint(vocab, (rows, k + 1), generator=g)
    drafts = torch.randint(vocab, (rows, k), generator=g)
    num = torch.randint(0, k + 1, (rows,), generator=g)
    tokens, count = verify_greedy(target, drafts, num)
    for r in range(rows):
        want = []
        for j in range(num[r]):
            if drafts[r, j] != target[r, j]:
                break
            want.append(int(drafts[r, j]))
        want.append(int(target[r, len(want)]))
        assert count[r] == len(want) and tokens[r, : len(want)].tolist() == want
        assert (tokens[r, len(want) :] == -1).all()


# ---- rejection sampling --------------------------------------------------------------------------
def _close_to(samples: torch.Tensor, p: torch.Tensor) -> None:
    """The empirical distribution of `samples` equals p within 5 standard errors in every bin."""
    n = len(samples)
    assert n > 2000
    counts = torch.bincount(samples, minlength=len(p)).double() / n
    sigma = torch.sqrt(p * (1 - p) / n).clamp_min(1 / n)
    assert ((counts - p).abs() <= 5 * sigma + 1e-9).all(), (counts, p)


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["one-hot q", "draft model q"])
def test_rejection_sampling_gives_the_target_distribution_at_every_position(with_draft_probs):
    """Per position j the target p_j does not depend on earlier tokens here, so the j-th output token of
    every row that reaches it must be distributed as p_j, whatever was proposed."""
    g = torch.Generator().manual_seed(3)
    rows, k, vocab = 200_000, 3, 5
    p = torch.distributions.Dirichlet(torch.ones(vocab)).sample((k + 1,)).double()
    target = p.expand(rows, k + 1, vocab)
    if with_draft_probs:
        q = torch.distributions.Dirichlet(torch.ones(vocab)).sample((k,)).double()
        drafts = torch.stack([torch.multinomial(q[j], rows, replacement=True, generator=g) for j in range(k)], 1)
        draft_probs = q.expand(rows, k, vocab)
    else:
        drafts = p[:k].argmax(dim=1).expand(rows, k).contiguous()  # a fixed guess, as n-grams make
        draft_probs = None
    tokens, count = rejection_sample(target, drafts, torch.full((rows,), k), draft_probs, generator=g)
    assert ((count >= 1) & (count <= k + 1)).all()
    for j in range(k + 1):
        reached = count > j
        _close_to(tokens[reached, j], p[j])
    if not with_draft_probs:  # the first proposal survives with probability p_0(proposal)
        accepted = (count > 1).double().mean()
        assert math.isclose(accepted, p[0, drafts[0, 0]], abs_tol=5 * math.sqrt(0.25 / rows))


def test_rejection_sampling_respects_each_rows_number_of_proposals():
    g = torch.Generator().manual_seed(0)
    rows, k, vocab = 50_000, 2, 4
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    target = p.expand(rows, k + 1, vocab)
    drafts = torch.full((rows, k), 3)
    num = torch.tensor([0, 1, 2]).repeat(rows // 3 + 1)[:rows]
    tokens, count = rejection_sample(target, drafts, num, generator=g)
    assert (count <= num + 1).all()
    _close_to(tokens[num == 0, 0], p)  # no proposal: one plain sample
    no_draft = rejection_sample(target[:, :1], drafts[:, :0], torch.zeros(rows, dtype=torch.int64), generator=g)
    _close_to(no_draft[0][:, 0], p)


# ---- the config ----------------------------------------------------------------------------------
def test_config_parses_vllms_json_and_refuses_what_is_not_built():
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert cfg == SpeculativeConfig("ngram", 4, 3, 3, None)  # vLLM: a lone bound is both
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_max": 1}') == (
        SpeculativeConfig("ngram", 1, 1, 1, None)
    )
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 7}) == (
        SpeculativeConfig("ngram", 2, 7, 7, None)
    )
    assert parse_speculative_config(None) is None
    refusals = {
        "{bad": "not valid JSON",
        "[1]": "must be a JSON object",
        '{"num_speculative_tokens": 3}': 'needs "method"',
        '{"method": "eagle", "num_speculative_tokens": 3}': "vLLM's method 'eagle' is not supported; supported: ngram",
        '{"method": "magic", "num_speculative_tokens": 3}': "method 'magic' is not supported",
        '{"method": "ngram"}': 'needs "num_speculative_tokens"',
        '{"method": "ngram", "num_speculative_tokens": 0}': "num_speculative_tokens must be a positive integer",
        '{"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}': "keys not supported",
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}': "<=",
    }
    for text, message in refusals.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
            parse_speculative_config(text)


def test_method_and_ngram_lengths_follow_vllms_speculative_config():
    """vLLM infers "method" from "model" ("ngram"/"[ngram]": prompt lookup, any other: a draft model), reads
    method "[ngram]" as ngram, copies a lone n-gram bound to the other and defaults both to 5."""
    ngram = {"num_speculative_tokens": 3}
    assert parse_speculative_config({**ngram, "model": "ngram"}) == SpeculativeConfig("ngram", 3, 5, 5, None)
    assert parse_speculative_config({**ngram, "model": "[ngram]"}) == SpeculativeConfig("ngram", 3, 5, 5, None)
    assert parse_speculative_config({**ngram, "method": "[ngram]"}) == SpeculativeConfig("ngram", 3, 5, 5, None)
    assert parse_speculative_config({**ngram, "method": "ngram", "model": "[ngram]", "prompt_lookup_min": 2}) == (
        SpeculativeConfig("ngram", 3, 2, 2, None)
    )
    assert parse_speculative_config({**ngram, "method": "ngram", "prompt_lookup_max": 4}) == (
        SpeculativeConfig("ngram", 3, 4, 4, None)
    )
    draft = parse_speculative_config({**ngram, "model": "/models/draft"})
    assert draft == SpeculativeConfig("draft_model", 3, 0, 0, None, draft_model="/models/draft")
    refusals = {
        '{"model": "my_pkg.Proposer", "num_speculative_tokens": 3}': "reads as a Python class .vLLM's method",
        '{"method": "ngram", "model": "/models/draft", "num_speculative_tokens": 3}': "prompt lookup uses no model",
        '{"model": 7, "num_speculative_tokens": 3}': '"model" must be the draft model',
    }
    for text, message in refusals.items():
        with pytest.raises(ConfigError, match=message):
            parse_speculative_config(text)


@pytest.mark.parametrize("limit", [1, 0, -3, True, 2.5])
def test_a_disable_by_batch_size_below_2_is_refused_naming_the_fix(limit):
    """1 would accept a config under which no step ever proposes (vLLM refuses < 2 too)."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": limit}
    with pytest.raises(ConfigError, match=r"disable_by_batch_size .*at least 2.*leave --speculative-config out"):
        parse_speculative_config(spec)
    assert parse_speculative_config({**spec, "disable_by_batch_size": 2}).disable_by_batch_size == 2


@pytest.mark.parametrize(
    "spec, device, line",
    [
        (
            {"method": "ngram", "num_speculative_tokens": 3},
            "cpu",
            "Speculative decoding: ngram, k=3: proposals while fewer than 2 requests run "
            "(disable_by_batch_size; the CPU's default)",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 4},
            "cuda",
            "Speculative decoding: ngram, k=4: proposals while fewer than 32 requests run "
            "(disable_by_batch_size; the GPU's default)",
        ),
        (
            {"method": "suffix", "num_speculative_tokens": 8, "disable_by_batch_size": 16},
            "cpu",
            "Speculative decoding: suffix, k=8: proposals while fewer than 16 requests run (disable_by_batch_size)",
        ),
    ],
)
def test_the_limit_in_effect_is_logged_once_at_startup(spec, device, line, caplog):
    """The CPU's default of 2 turns speculation off as soon as a second request runs: the startup log says so."""
    import logging

    from pagoda.engine.speculation import Speculator

    with caplog.at_level(logging.INFO, logger="pagoda"):
        Speculator(parse_speculative_config(spec), device)
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("Speculative")] == [line]


def test_ngram_on_a_long_context_is_fast_enough_to_run_every_step():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32000, 32768).tolist()
    tokens += tokens[1000:1006]  # the end repeats a span from the start
    assert NgramProposer(4, 1, 5).propose(tokens) == tokens[1006:1010]


# ---- the scheduler with proposals ----------------------------------------------------------------
def _decoding_scheduler(max_tokens: int = 10, budget: int = 64, max_model_len: int = 256, prompt_len: int = 6):
    from pagoda.config import SchedulerConfig
    from pagoda.engine.block_manager import BlockManager
    from pagoda.engine.scheduler import Scheduler
    from pagoda.outputs import StepOutput
    from pagoda.request import Request
    from pagoda.sampling_params import SamplingParams

    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        async_scheduling=False,
        scheduling_policy="fcfs",
    )
    sched = Scheduler(config, BlockManager(64, 4, True), {0})
    request = Request("r", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), max_tokens)
    sched.add_request(request)
    so = sched.schedule()  # the prompt
    sched.update(so, StepOutput({"r": 50}))
    return sched, request


def test_scheduler_schedules_proposals_within_every_limit():
    sched, request = _decoding_scheduler(max_tokens=5)
    request.spec_token_ids = [7, 8, 9, 10, 11]
    so = sched.schedule()
    # One output so far, max_tokens 5: at most 3 proposals (the step yields up to 4 tokens).
    assert so.spec_token_ids == {"r": [7, 8, 9]} and so.num_scheduled_tokens == {"r": 4}
    assert "r" in so.sampling_request_ids and request.num_computed_tokens == 6 + 1 + 3
    sched, request = _decoding_scheduler(budget=3, prompt_len=3)
    request.spec_token_ids = [7, 8, 9]
    assert sched.schedule().spec_token_ids == {"r": [7, 8]}  # the token budget
    sched, request = _decoding_scheduler(max_model_len=10)
    request.spec_token_ids = [7, 8, 9]
    assert sched.schedule().spec_token_ids == {"r": [7, 8]}  # 7 tokens known, 10 the limit: 3 more at most
    sched, request = _decoding_scheduler(max_model_len=8)
    request.spec_token_ids = [7, 8, 9]
    assert sched.schedule().spec_token_ids == {}  # one more token at most: no proposal


@pytest.mark.parametrize("accepted", [0, 1, 3])
def test_scheduler_update_takes_the_accepted_proposals_and_moves_back_over_the_rest(accepted):
    from pagoda.outputs import StepOutput

    sched, request = _decoding_scheduler()
    request.spec_token_ids = [7, 8, 9]
    so = sched.schedule()
    updated = sched.update(so, StepOutput({"r": 60}, accepted_token_ids={"r": [7, 8, 9][:accepted]}))
    assert updated == [request] and request.num_new_tokens == accepted + 1
    assert request.output_token_ids == [50, *[7, 8, 9][:accepted], 60]
    assert request.num_computed_tokens == request.num_tokens - 1  # the last token is the next step's input


def test_scheduler_stops_on_an_accepted_eos_and_drops_what_follows():
    from pagoda.outputs import StepOutput
    from pagoda.request import RequestStatus

    sched, request = _decoding_scheduler()
    request.spec_token_ids = [7, 0, 9]  # 0 is EOS here
    so = sched.schedule()
    sched.update(so, StepOutput({"r": 60}, accepted_token_ids={"r": [7, 0, 9]}))
    assert request.output_token_ids == [50, 7, 0] and request.status is RequestStatus.FINISHED_STOPPED
    assert request.num_new_tokens == 2


def test_engine_config_refuses_speculation_where_proposals_cannot_be_verified(tiny_llama):
    from pagoda.config import EngineArgs, EngineConfig

    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    with pytest.raises(ConfigError, match="--speculative-config is not supported with pipeline parallelism"):
        args = EngineArgs(
            model=tiny_llama, skip_tokenizer_init=True, speculative_config=spec, pipeline_parallel_size=2, device="cpu"
        )
        EngineConfig.create(args)
    args = EngineArgs(model=tiny_llama, skip_tokenizer_init=True, speculative_config=spec, device="cpu")
    config = EngineConfig.create(args)
    assert config.scheduler.speculative == SpeculativeConfig("ngram", 3, 5, 5, None)  # vLLM's default n-grams
    assert not config.scheduler.async_scheduling


def test_a_draft_model_needs_a_folder_one_rank_and_the_targets_vocabulary(tiny_llama, tmp_path):
    from pagoda.config import EngineArgs, EngineConfig
    from pagoda.config.engine import _check_draft_model
    from pagoda.models.source import resolve_model_source
    from tests.conftest import build_tiny_model

    for text, message in {
        '{"method": "draft_model", "num_speculative_tokens": 3}': 'needs "model"',
        '{"method": "draft_model", "model": "", "num_speculative_tokens": 3}': 'needs "model"',
        '{"method": "draft_model", "model": "x", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}': (
            "only 1 is supported"
        ),
        '{"method": "draft_model", "model": "x", "num_speculative_tokens": 3, "prompt_lookup_max": 2}': (
            "keys not supported for 'draft_model'"
        ),
    }.items():
        with pytest.raises(ConfigError, match=message):
            parse_speculative_config(text)
    wider = build_tiny_model("llama", str(tmp_path), vocab_size=1024)
    spec = {"method": "draft_model", "model": wider, "num_speculative_tokens": 2}
    target = resolve_model_source(tiny_llama).hf_config
    with pytest.raises(ConfigError, match="vocabulary of 1024 tokens, the target 512: a draft must use"):
        EngineConfig.create(EngineArgs(model=tiny_llama, skip_tokenizer_init=True, speculative_config=spec))
    _check_draft_model(tiny_llama, target)  # the same vocabulary: accepted
    spec["model"] = tiny_llama
    config = EngineConfig.create(EngineArgs(model=tiny_llama, skip_tokenizer_init=True, speculative_config=spec))
    assert config.scheduler.speculative is not None and config.scheduler.speculative.draft_model == tiny_llama


def test_a_draft_model_that_cannot_be_read_is_named_as_the_draft(tiny_llama):
    """The target loads; the draft's missing folder is said to come from --speculative-config, not read as the
    target's own error."""
    from pagoda.config import EngineArgs, EngineConfig
    from pagoda.errors import ModelLoadError

    spec = {"method": "draft_model", "model": "/nonexistent/x", "num_speculative_tokens": 2}
    args = EngineArgs(model=tiny_llama, skip_tokenizer_init=True, speculative_config=spec, device="cpu")
    with pytest.raises(ModelLoadError) as caught:
        EngineConfig.create(args)
    assert caught.value.message == "--speculative-config draft model: Model folder '/nonexistent/x' does not exist."
    assert caught.value.param == "speculative_config"


def test_a_draft_on_a_gpu_gets_a_kv_pool_for_the_requests_it_can_be_asked_for(tiny_llama):
    """On a GPU a pool sized from free memory would take the target's share: the draft gets one for as many
    full-length requests as may get proposals (below disable_by_batch_size), at most its own context each."""
    import dataclasses

    from pagoda.config import EngineArgs, EngineConfig
    from pagoda.engine.speculation import draft_engine_args

    spec = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 2, "disable_by_batch_size": 8}
    args = EngineArgs(
        model=tiny_llama, skip_tokenizer_init=True, speculative_config=spec, max_model_len=1000, device="cpu"
    )
    target = EngineConfig.create(args)
    on_cpu = draft_engine_args(target, tiny_llama, context=600)
    assert (on_cpu.max_model_len, on_cpu.max_num_seqs, on_cpu.num_gpu_blocks_override) == (600, 8, None)
    gpu = dataclasses.replace(target, device=dataclasses.replace(target.device, device="cuda"))
    on_gpu = draft_engine_args(gpu, tiny_llama, context=4096)
    assert on_gpu.max_model_len == 1000 and on_gpu.max_num_seqs == 8
    assert on_gpu.num_gpu_blocks_override == 8 * -(-1000 // target.cache.block_size) + 1
