"""How the driver finds a lost tensor-parallel rank (`worker/rank_group.py`), without processes: a rank that
exited (with or without a startup error) or was killed, one whose heartbeat went stale (stopped or frozen), a
driver call that never returned (a hung collective), a driver call that failed because a rank died, and the
watch's end: `on_fatal` with the line, then the exit."""

from __future__ import annotations

import logging
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


def test_an_exited_rank_is_named_with_its_exit_code_signal_or_startup_error():
    assert _ranks((FakeProc(11), 0.1, None), (FakeProc(12, -9), 0.1, None)).fault() == (
        "tensor-parallel rank 2 (pid 12) died: killed by SIGKILL"
    )
    assert _ranks((FakeProc(11, 3), 0.1, None)).fault() == "tensor-parallel rank 1 (pid 11) exited with code 3"
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


class Exited(Exception):
    pass


@pytest.fixture
def exits(monkeypatch) -> list[int]:
    """The exit codes the watch would have ended the process with (each call raises `Exited` instead)."""
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        raise Exited

    monkeypatch.setattr(rank_group.os, "_exit", fake_exit)
    monkeypatch.setattr(rank_group.logging, "shutdown", lambda: None)
    return codes


def test_the_watch_tells_on_fatal_then_exits_nonzero(monkeypatch, exits):
    told: list[str] = []
    monkeypatch.setattr(rank_group, "WATCH_INTERVAL_S", 0.01)
    watch = RankWatch(_ranks((FakeProc(11, -9), 0.1, None)), told.append)
    with pytest.raises(Exited):
        watch._run()
    assert told == ["tensor-parallel rank 1 (pid 11) died: killed by SIGKILL"] and exits == [1]


def test_a_call_failed_by_a_killed_rank_ends_the_core_with_its_line_and_the_traceback_at_debug(exits, caplog):
    """A rank killed mid-step fails the driver's collective (gloo: the peer closed the connection) before the
    watch thread looks: the driver's failed call names the rank, found a moment after the error, in one line."""
    told: list[str] = []
    killed = FakeProc(12)
    watch = RankWatch(_ranks((FakeProc(11), 0.1, None), (killed, 0.1, None)), told.append)
    calls = 0
    real_fault = watch.ranks.fault

    def fault() -> str | None:  # the killed process is reaped a few looks after its sockets closed
        nonlocal calls
        calls += 1
        if calls == 3:
            killed.exitcode = -9
        return real_fault()

    watch.ranks.fault = fault  # type: ignore[method-assign]
    try:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242")
    except RuntimeError as exc:
        error = exc
    with caplog.at_level(logging.DEBUG, logger="pagoda.core"), pytest.raises(Exited):
        watch.fail_call("launch", error)
    line = "tensor-parallel rank 2 (pid 12) died: killed by SIGKILL"
    assert told == [line] and exits == [1]
    by_level = {r.levelno: r for r in caplog.records}
    assert by_level[logging.ERROR].getMessage() == f"{line}; stopping the engine core"
    assert by_level[logging.ERROR].exc_info is None  # the one line at the default level
    assert by_level[logging.DEBUG].exc_info is not None and by_level[logging.DEBUG].exc_info[1] is error


def test_a_failed_call_with_every_rank_alive_is_the_drivers_own_error(exits):
    told: list[str] = []
    watch = RankWatch(_ranks((FakeProc(11), 0.1, None)), told.append)
    watch.fail_call("launch", ValueError("a bug in the driver's shard"), wait=0.1)  # returns: the caller raises
    assert told == [] and exits == []


class FakeRef:
    def __init__(self, answer: float | Exception | None = None):
        self.answer = answer  # None: not answered yet


class FakeRay:
    """The part of `ray` RayRanks' watch uses: refs that are done once they hold an answer."""

    def wait(self, refs: list[FakeRef], timeout: float):
        done = [r for r in refs if r.answer is not None]
        return done, [r for r in refs if r.answer is None]

    def get(self, ref: FakeRef):
        if isinstance(ref.answer, Exception):
            raise ref.answer
        return ref.answer


class FakeActor:
    def __init__(self):
        self.pings: list[FakeRef] = []

        class _Ping:
            @staticmethod
            def remote() -> FakeRef:
                self.pings.append(FakeRef())
                return self.pings[-1]

        self.ping = _Ping


def _ray_ranks(n: int) -> tuple[rank_group.RayRanks, list[FakeActor]]:
    ranks = rank_group.RayRanks.__new__(rank_group.RayRanks)  # no cluster: the fake ray stands in
    actors = [FakeActor() for _ in range(n)]
    ranks.ray, ranks.world_size, ranks.tp, ranks.actors = FakeRay(), n + 1, n + 1, actors
    ranks.runs = [FakeRef() for _ in range(n)]  # runs that have not returned
    ranks._sent, ranks._answered = {}, {}
    return ranks, actors


def _age_pings(ranks: rank_group.RayRanks, seconds: float) -> None:
    ranks._sent = {rank: (ref, at - seconds) for rank, (ref, at) in ranks._sent.items()}


def test_a_ray_actor_still_starting_gets_the_init_timeout_not_the_heartbeat_one(monkeypatch):
    """A ping to an actor being created waits on its process start and imports: seconds on a loaded host.
    That is no hang until PAGODA_TP_INIT_TIMEOUT_S, and the watch never blocks on the ping."""
    monkeypatch.setenv("PAGODA_TP_HEARTBEAT_TIMEOUT_S", "2")
    monkeypatch.setenv("PAGODA_TP_INIT_TIMEOUT_S", "30")
    ranks, actors = _ray_ranks(1)
    assert ranks.fault() is None and len(actors[0].pings) == 1  # sent, not waited for
    _age_pings(ranks, 10)
    assert ranks.fault() is None and len(actors[0].pings) == 1  # 10 s unanswered while starting: fine
    _age_pings(ranks, 25)
    line = ranks.fault()
    assert line == "tensor-parallel rank 1 (Ray actor) did not start: no answer within 30 s (PAGODA_TP_INIT_TIMEOUT_S)"


def test_a_ray_actor_that_answered_then_goes_silent_is_hung(monkeypatch):
    monkeypatch.setenv("PAGODA_TP_HEARTBEAT_TIMEOUT_S", "2")
    ranks, actors = _ray_ranks(2)
    ranks.fault()
    for actor in actors:
        actor.pings[-1].answer = 1.0
    assert ranks.fault() is None and ranks._sent == {}  # both answered
    ranks._answered = {rank: at - 1.5 for rank, at in ranks._answered.items()}
    assert ranks.fault() is None and len(actors[1].pings) == 2  # a second ping each, a second later
    actors[0].pings[-1].answer = 2.0
    _age_pings(ranks, 1.0)
    assert ranks.fault() is None  # rank 2's ping is 1 s old: under the 2 s limit
    _age_pings(ranks, 2.0)
    line = ranks.fault()
    hung = "tensor-parallel rank 2 (Ray actor) is hung: no answer to a ping within 2 s (PAGODA_TP_HEARTBEAT_TIMEOUT_S)"
    assert line == hung


def test_a_ray_actor_whose_ping_fails_is_gone_and_a_returned_run_is_named():
    ranks, actors = _ray_ranks(1)
    ranks.fault()
    actors[0].pings[-1].answer = RuntimeError("actor died")
    assert ranks.fault() == "tensor-parallel rank 1 (Ray actor) is gone: RuntimeError"
    ranks.runs[0].answer = RuntimeError("ActorDiedError: the actor died unexpectedly")
    assert ranks.fault() == "tensor-parallel rank 1 (Ray actor) failed: ActorDiedError: the actor died unexpectedly"


def test_a_fault_line_names_the_pipeline_stage_of_its_rank():
    assert rank_group.rank_label(1, 2, 2) == "tensor-parallel rank 1"  # no pipeline: as before
    assert rank_group.rank_label(1, 1, 2) == "pipeline stage 1 (rank 1)"
    assert rank_group.rank_label(3, 2, 4) == "pipeline stage 1, tensor-parallel rank 1 (rank 3)"
    assert rank_group.rank_label(2, 2, 4) == "pipeline stage 1, tensor-parallel rank 0 (rank 2)"
