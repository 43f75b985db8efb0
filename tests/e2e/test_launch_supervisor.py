"""`pagoda.processes.supervisor`: the one supervisor of `pagoda serve` and `pagoda router --workers`. A dead child is
reported, a stop signal ends the watch, `stop` escalates to SIGKILL, children die with their parent, and the
Prometheus multiprocess directory exists for the children only and is removed on close."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from pagoda.processes.supervisor import Supervisor


def _exit_with(code: int) -> int:
    return code


def _sleep_forever() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL stops it
    while True:
        time.sleep(1)


def _report_metrics_dir(path: str) -> None:
    with open(path, "w") as f:
        f.write(os.environ.get("PROMETHEUS_MULTIPROC_DIR", ""))


def test_a_dead_child_is_reported_and_the_metrics_dir_goes(tmp_path) -> None:
    supervisor = Supervisor()
    try:
        supervisor.start("reporter", _report_metrics_dir, (str(tmp_path / "dir"),)).process.join(60)
        assert (tmp_path / "dir").read_text() == supervisor.metrics_dir
        assert (
            "PROMETHEUS_MULTIPROC_DIR" not in os.environ
            or os.environ["PROMETHEUS_MULTIPROC_DIR"] != supervisor.metrics_dir
        )
        stuck = supervisor.start("stuck", _sleep_forever, index=1)
        failing = supervisor.start("failing", _exit_with, (3,), index=2)
        assert supervisor.wait([stuck, failing]) is failing and failing.exitcode == 3
        started = time.monotonic()
        supervisor.stop([stuck], grace=0.5)  # ignores SIGTERM: killed after the grace
        assert not stuck.alive and time.monotonic() - started < 10
    finally:
        supervisor.close()
    assert not os.path.exists(supervisor.metrics_dir)


def test_a_stop_signal_ends_the_watch() -> None:
    supervisor = Supervisor(metrics=False)
    try:
        supervisor.catch_signals()
        child = supervisor.start("stuck", _sleep_forever)
        os.kill(os.getpid(), signal.SIGTERM)
        assert supervisor.wait([child]) is None and supervisor.signals == [signal.SIGTERM]
        supervisor.stop([child], grace=0.2)
    finally:
        supervisor.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


PARENT = """
import time
from test_launch_supervisor import _sleep_forever
from pagoda.processes.supervisor import Supervisor
if __name__ == "__main__":
    child = Supervisor(metrics=False).start("stuck", _sleep_forever, death_signal=9)
    time.sleep(3)                                  # the child is up, past its prctl
    print(child.pid, flush=True)
    time.sleep(60)
"""


def test_children_die_with_their_parent(tmp_path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([here, os.path.dirname(os.path.dirname(here)), os.environ.get("PYTHONPATH", "")])
    parent = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": path}
    )
    try:
        pid = int(parent.stdout.readline())
        assert psutil.pid_exists(pid)
        parent.kill()  # no chance to clean up
        parent.wait(10)
        gone, alive = psutil.wait_procs([psutil.Process(pid)], timeout=10) if psutil.pid_exists(pid) else ([], [])
        assert not alive, alive
    finally:
        parent.kill()
