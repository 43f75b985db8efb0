"""The CUDA-graph policy that needs no GPU: which buckets are captured (`--max-cudagraph-capture-size`),
which bucket a step replays, and what the static buffers hold for a step and its padding."""

from __future__ import annotations

import numpy as np
import torch

from pagoda.worker.graph_runner import (
    DECODE,
    MIXED,
    GraphRunner,
    GraphSpec,
    capture_buckets,
    default_buckets,
    default_token_buckets,
)
from pagoda.worker.step_inputs import StepInputs

TOKEN_SIZES = [16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048]


def test_default_capture_is_every_bucket():
    decode, tokens = capture_buckets(1024, 8192, None, mixed=True)
    assert decode == default_buckets(1024) and len(decode) == 131  # 1, 2, 4, 8, 16, ..., 1024
    assert tokens == TOKEN_SIZES == default_token_buckets(8192)
    assert capture_buckets(256, 100, None, mixed=False) == (default_buckets(256), [])


def test_capture_size_caps_decode_rows_and_mixed_tokens():
    decode, tokens = capture_buckets(1024, 8192, 512, mixed=True)
    assert decode == [1, 2, 4, *range(8, 513, 8)] and len(decode) == 67
    assert tokens == [16, 32, 64, 128, 256, 384, 512]
    assert capture_buckets(1024, 8192, 100, mixed=True) == ([1, 2, 4, *range(8, 100, 8), 100], [16, 32, 64])
    assert capture_buckets(8, 8192, 1, mixed=True) == ([1], [])
    # A cap above what the engine can run changes nothing.
    assert capture_buckets(8, 100, 4096, mixed=True) == capture_buckets(8, 100, None, mixed=True)


def _spec(decode=(1, 2, 4, 8), tokens=(16, 32), **kw) -> GraphSpec:
    args = dict(
        decode_buckets=decode,
        token_buckets=tokens,
        max_rows=8,
        max_blocks_per_seq=6,
        block_size=4,
        block_m=16,
        max_seq_len=24,
        scratch_slot=9,
        with_snapshots=True,
        uses_mrope=False,
    )
    return GraphSpec(**(args | kw))


def test_bucket_for_a_step():
    spec = _spec()
    assert spec.bucket_for(3, 3, False) == (DECODE, 4)
    assert spec.bucket_for(8, 8, False) == (DECODE, 8)
    assert spec.bucket_for(1, 1, False) == (DECODE, 1)
    assert spec.bucket_for(2, 15, False) == (MIXED, 16)
    assert spec.bucket_for(2, 16, False) == (MIXED, 32)  # a mixed bucket keeps a spare token
    assert spec.bucket_for(2, 32, False) is None  # too many tokens: eager
    assert spec.bucket_for(3, 3, True) is None and spec.bucket_for(2, 9, True) is None  # the encoder runs
    # With room for encoder rows, a step that brings them takes a token bucket, never a decode one.
    vision = _spec(mm_rows=(8, torch.float32))
    assert vision.bucket_for(3, 3, True) == (MIXED, 16) and vision.bucket_for(2, 16, True) == (MIXED, 32)
    assert vision.bucket_for(2, 32, True) is None and vision.bucket_for(3, 3, False) == (DECODE, 4)
    capped = _spec(decode=(1, 2))
    assert capped.bucket_for(4, 4, False) == (MIXED, 16)  # past the decode buckets: a mixed one
    assert _spec(tokens=()).bucket_for(2, 9, False) is None
    assert (spec.num_tokens, spec.num_rows) == (32, 9)


class _NoModel:
    """Never called: these tests only write the host buffers."""


def _runner(**kw) -> GraphRunner:
    return GraphRunner(_spec(**kw), _NoModel(), None, torch.device("cpu"), capture=False)


def _inputs(query_lens, seq_lens, token_ids, slots, tables, state_slots, positions=None) -> StepInputs:
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    if positions is None:
        positions = np.concatenate([np.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
    return StepInputs(
        np.asarray(token_ids, np.int64),
        np.asarray(positions, np.int64),
        np.asarray(slots, np.int64),
        qsl,
        np.asarray(seq_lens, np.int64),
        np.asarray(tables, np.int64),
        np.arange(len(seq_lens), dtype=np.int64),
        state_slots=np.asarray(state_slots, np.int64),
    )


def test_decode_step_and_its_padding_rows():
    runner = _runner()
    # Three rows at positions 6, 3, 11 (block size 4): position 3 and 11 end their blocks.
    tables = [[5, 6, 0], [2, 0, 0], [3, 4, 5]]
    x = _inputs([1, 1, 1], [7, 4, 12], [50, 51, 52], [26, 11, 23], tables, [0, 1, 2])
    assert runner.bucket_for(x) == (DECODE, 4)
    runner.write(x, DECODE, 4)
    tok, row, snap = runner.host["tok"], runner.host["row"], runner.host["snap"]
    assert tok[0, :4].tolist() == [50, 51, 52, 0] and tok[1, :4].tolist() == [6, 3, 11, 0]
    assert tok[2, :4].tolist() == [26, 11, 23, -1]  # the padding row stores no K/V
    assert row[0, :4].tolist() == [7, 4, 12, 0]  # context 0: attention returns zeros
    assert row[1, :4].tolist() == [0, 1, 2, 9]  # the padding row's state: the scratch slot
    assert snap[1, :4].tolist() == [0, 11 // 4, 23 // 4, 0]  # block-ending rows snapshot their block
    assert runner.host["tables"][:3, :3].tolist() == tables


def test_mixed_step_and_its_padding():
    runner = _runner()
    # Row 0 decodes at position 5; row 1 prefills 18 tokens (positions 2..19) after a 2-token hit.
    tables = [[7, 8, 0, 0, 0], [1, 2, 3, 4, 5]]
    slots = [7 * 4 + 1] + [tables[1][p // 4] * 4 + p % 4 for p in range(2, 20)]
    x = _inputs([1, 18], [6, 20], list(range(100, 119)), slots, tables, [3, 4])
    assert runner.bucket_for(x) == (MIXED, 32)
    runner.write(x, MIXED, 32)
    h, t = runner.host, 19
    assert h["tok"][2, :t].tolist() == slots and (h["tok"][2, t:32] == -1).all() and (h["tok"][0, t:32] == 0).all()
    row = h["row"]
    assert row[0].tolist() == [6, 20] + [0] * 7
    assert row[1].tolist() == [3, 4] + [9] * 7
    assert row[2].tolist() == [0, 1] + [t] * 7 and row[3].tolist() == [0, 18] + [t] * 7  # first, last token
    assert row[4].tolist() == [0] + [t] * 8  # decode query: the one-token row's token, else the spare one
    assert row[5].tolist() == [6] + [0] * 8  # decode context
    assert h["qsl"].tolist() == [0, 1, 19] + [t] * 7
    # 18 queries in tiles of 16: two tiles on row 1; the unused ones on the last (padding) row.
    assert h["tiles"][0, :3].tolist() == [1, 1, 8] and h["tiles"][1, :3].tolist() == [0, 16, 0]
    # Positions 3, 7, 11, 15, 19 end blocks 1..5 of row 1; the unused entries go to the spare token, block 0.
    ends = [2, 6, 10, 14, 18]
    assert h["snap"][0, :6].tolist() == [*ends, t] and h["snap"][1, :6].tolist() == [1, 2, 3, 4, 5, 0]
    assert (h["snap"][0, 6:] == t).all() and (h["snap"][1, 6:] == 0).all()


def test_the_flag_reaches_the_engine_config(tiny_llama):
    import argparse

    import pytest

    from pagoda.cli.args import add_engine_args, config_from
    from pagoda.config import EngineArgs, EngineConfig
    from pagoda.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    model = ["--model", tiny_llama, "--skip-tokenizer-init"]  # a folder: the embedded model need not be installed
    args = config_from(parser.parse_args(["--max-cudagraph-capture-size", "64", "--device", "cpu", *model]), EngineArgs)
    assert EngineConfig.create(args).device.max_cudagraph_capture_size == 64
    assert config_from(parser.parse_args([]), EngineArgs).max_cudagraph_capture_size is None  # default: no cap
    with pytest.raises(ConfigError, match="max_cudagraph_capture_size must be >= 1"):
        EngineConfig.create(config_from(parser.parse_args(["--max-cudagraph-capture-size", "0", *model]), EngineArgs))


def test_cpu_threads_default_to_the_available_cores_shared_among_ranks(tiny_llama, monkeypatch):
    import pytest
    import torch

    from pagoda.config import EngineArgs, EngineConfig
    from pagoda.errors import ConfigError
    from pagoda.worker import rank_worker

    def config(**kw):
        return EngineConfig.create(EngineArgs(model=tiny_llama, skip_tokenizer_init=True, device="cpu", **kw))

    monkeypatch.setattr(rank_worker, "available_cores", lambda: 6)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # set for the process (this suite sets it for its servers): kept
    assert rank_worker.cpu_threads_per_rank(config()) == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert rank_worker.cpu_threads_per_rank(config()) == 6
    assert rank_worker.cpu_threads_per_rank(config(tensor_parallel_size=4)) == 1  # 6 // 4
    assert rank_worker.cpu_threads_per_rank(config(cpu_threads=3, tensor_parallel_size=2)) == 3
    before = torch.get_num_threads()
    try:
        assert rank_worker.share_cpu_threads(config(cpu_threads=1)) == before
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ConfigError, match="cpu_threads must be >= 1"):
        config(cpu_threads=0)


def test_a_gpu_engine_serves_with_one_cpu_thread_unless_told(monkeypatch):
    """Once built, a GPU engine's process keeps one PyTorch thread; --cpu-threads or OMP_NUM_THREADS win; a CPU
    engine's count is left as its startup set it."""
    from types import SimpleNamespace

    import torch

    from pagoda.worker import rank_worker

    def config(device, cpu_threads=None):
        return SimpleNamespace(
            device=SimpleNamespace(device=device, cpu_threads=cpu_threads), parallel=SimpleNamespace(world_size=1)
        )

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        rank_worker.gpu_serving_threads(config("cpu"))
        assert torch.get_num_threads() == 2
        rank_worker.gpu_serving_threads(config("cuda"))
        assert torch.get_num_threads() == 1
        rank_worker.gpu_serving_threads(config("cuda", cpu_threads=3))
        assert torch.get_num_threads() == 3
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        rank_worker.gpu_serving_threads(config("cuda"))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
