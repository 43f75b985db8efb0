"""How the driver finds a lost tensor-parallel rank (`worker/rank_group.py`), without processes: a rank that
exited (with or without a startup error), one whose heartbeat went stale (stopped or frozen), a driver call
that never returned (a hung collective), and the watch's end: `on_fatal` with the line, then the exit."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from pagoda.worker import rank_group
from pagoda.worker.rank_group import LocalRanks, RankWatch


@dataclass
class FakeProc:
    pid: int
    exitcode: int | None = None


@dataclass
class FakeBeat:
    value: float


class FakePipe:
    def __init__(self, message: str | None = None):
        self.message = message

    def poll(self) -> bool:
        return self.message is not None

    def recv(self) -> str:
        return self.message


def _ranks(*ranks: tuple[FakeProc, float, str | None]) -> LocalRanks:
    group = LocalRanks(len(ranks) + 1)
    for proc, beat_age, error in ranks:
        group.procs.append(proc)
        group.heartbeats.append(FakeBeat(time.monotonic() - beat_age if beat_age is not None else 0.0))
        group.errors.append(FakePipe(error))
    return group


def test_healthy_ranks_and_a_rank_not_yet_beating_are_no_fault():
    assert _ranks((FakeProc(11), 0.1, None), (FakeProc(12), None, None)).fault() is None


def test_an_exited_rank_is_named_with_its_exit_code_or_startup_error():
    assert _ranks((FakeProc(11), 0.1, None), (FakeProc(12, -9), 0.1, None)).fault() == (
        "tensor-parallel rank 2 (pid 12) exited with code -9"
    )
    failed = _ranks((FakeProc(11, 1), 0.1, "ModelLoadError: no weight for 'lm_head.weight'")).fault()
    assert failed == "tensor-parallel rank 1 (pid 11) failed to start: ModelLoadError: no weight for 'lm_head.weight'"


def test_a_stale_heartbeat_is_a_hung_rank(monkeypatch):
    monkeypatch.setenv("PAGODA_TP_HEARTBEAT_TIMEOUT_S", "2")
    assert _ranks((FakeProc(11), 1.0, None)).fault() is None
    line = _ranks((FakeProc(11), 0.1, None), (FakeProc(12), 7.0, None)).fault()
    assert line is not None and line.startswith("tensor-parallel rank 2 (pid 12) is hung: no heartbeat for 7.")


def test_a_call_that_does_not_return_is_a_hung_collective(monkeypatch):
    monkeypatch.setenv("PAGODA_TP_STEP_TIMEOUT_S", "5")
    watch = RankWatch(_ranks((FakeProc(11), 0.1, None)), None)
    assert watch._slow_call() is None
    with watch.calling("launch"):
        assert watch._slow_call() is None
        watch.call = ("launch", time.monotonic() - 6)
        line = watch._slow_call()
    assert line is not None and "'launch' has not returned in 5 s" in line and "NCCL_DEBUG=INFO" in line
    assert watch.call is None


def test_the_watch_tells_on_fatal_then_exits_nonzero(monkeypatch):
    told, exits = [], []

    class Exited(Exception):
        pass

    def fake_exit(code: int) -> None:
        exits.append(code)
        raise Exited

    monkeypatch.setattr(rank_group.os, "_exit", fake_exit)
    monkeypatch.setattr(rank_group, "WATCH_INTERVAL_S", 0.01)
    watch = RankWatch(_ranks((FakeProc(11, -9), 0.1, None)), told.append)
    with pytest.raises(Exited):
        watch._run()
    assert told == ["tensor-parallel rank 1 (pid 11) exited with code -9"] and exits == [1]
