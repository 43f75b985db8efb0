"""How the launcher tells a hung engine core from a busy one (`core_process.CoreHeartbeat`), without
processes: the core's heartbeat thread stamps shared doubles whatever its loop is doing, so only a beat that
stops counts, and only after PAGODA_CORE_HEARTBEAT_TIMEOUT_S of the launcher's own watching; then every API
process is told the line and the core is killed. The real thing (SIGSTOP, and a 20 s step that must not
trip it): tests/e2e/test_core_hang_serve.py."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagoda.engine.core_process import WATCHER_STALL_S, CoreHeartbeat, CoreProcess, Ready
from pagoda.launch.supervise import core_death


def _beating(beat_age: float | None, progress_age: float = 0.0) -> CoreHeartbeat:
    now = time.monotonic()
    return CoreHeartbeat([0.0 if beat_age is None else now - beat_age, now - progress_age])


def _watched(heartbeat: CoreHeartbeat, watching_for: float) -> CoreHeartbeat:
    """As if the launcher had been checking every fraction of a second for `watching_for` s."""
    heartbeat.silence(4242)
    heartbeat._grace_from -= watching_for
    return heartbeat


def test_a_core_that_beats_is_not_hung_however_long_its_loop_has_not_moved(monkeypatch):
    monkeypatch.setenv("PAGODA_CORE_HEARTBEAT_TIMEOUT_S", "3")
    assert _watched(_beating(0.4, progress_age=60.0), 100).silence(4242) is None  # a 60 s step


def test_a_core_silent_past_the_timeout_is_hung_with_its_pid_and_its_loops_last_move(monkeypatch):
    monkeypatch.setenv("PAGODA_CORE_HEARTBEAT_TIMEOUT_S", "3")
    assert _watched(_beating(2.5), 100).silence(4242) is None
    line = _watched(_beating(4.0, progress_age=9.0), 100).silence(4242)
    assert line is not None and line.startswith("the engine core process (pid 4242) is hung: no heartbeat for 4.0 s")
    assert "PAGODA_CORE_HEARTBEAT_TIMEOUT_S=3" in line and "its engine loop last moved 9.0 s ago" in line


def test_a_core_that_never_beat_is_not_hung(monkeypatch):
    monkeypatch.setenv("PAGODA_CORE_HEARTBEAT_TIMEOUT_S", "3")
    assert _watched(_beating(None), 100).silence(4242) is None


def test_silence_while_the_launcher_itself_was_not_running_does_not_count(monkeypatch):
    """Ctrl-Z stops the whole process group: on `fg` the core's last beat is as old as the stop, but the
    launcher was stopped too. Its own gap between checks restarts the core's timeout."""
    monkeypatch.setenv("PAGODA_CORE_HEARTBEAT_TIMEOUT_S", "3")
    heartbeat = _watched(_beating(30.0), 100)
    heartbeat._last_check = time.monotonic() - WATCHER_STALL_S - 30  # the launcher's last look: before the stop
    assert heartbeat.silence(4242) is None
    heartbeat._grace_from -= 3.5  # the launcher has watched for 3.5 s since, and the core is still silent
    assert heartbeat.silence(4242) is not None


@dataclass
class _FakeChild:
    pid: int = 4242
    alive: bool = True
    killed: list[bool] = field(default_factory=list)

    @property
    def process(self) -> _FakeChild:
        return self

    def kill(self) -> None:
        self.killed.append(True)
        self.alive = False


class _Quiet:
    def poll(self, timeout: int) -> bool:
        return False


def test_the_launcher_tells_every_api_process_the_line_then_kills_a_hung_core(monkeypatch):
    monkeypatch.setenv("PAGODA_CORE_HEARTBEAT_TIMEOUT_S", "3")
    core = CoreProcess.__new__(CoreProcess)  # no processes: the parts `poll` uses
    core.control, core.ready, core.hung, core.died_message = _Quiet(), Ready(1, 16, 1.0), None, None
    core.child = _FakeChild()  # type: ignore[assignment]
    told: list[str] = []
    core.tell_core_died = told.append  # type: ignore[method-assign]
    core.heartbeat = _watched(_beating(0.2), 100)
    core.poll(0)
    assert core.hung is None and not core.child.killed and told == []
    core.heartbeat = _watched(_beating(5.0), 100)
    core.poll(0)
    assert core.hung is not None and "(pid 4242) is hung" in core.hung
    assert told == [core.hung] and core.child.killed == [True]


def test_the_launchers_line_for_a_core_that_exited_names_what_it_said():
    rank = "tensor-parallel rank 1 (pid 77) died: killed by SIGKILL"
    assert core_death(rank, 42, 1) == f"the engine core process (pid 42) exited with code 1: {rank}"
    traceback = "Traceback (most recent call last):\n  ...\nRuntimeError: boom"
    assert core_death(traceback, 42, 1) == "the engine core process died (pid 42, exit code 1)"
    assert core_death(None, 42, -9) == "the engine core process died (pid 42, exit code -9)"
