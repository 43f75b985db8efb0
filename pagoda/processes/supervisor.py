"""One supervisor for every multi-process command (`pagoda serve`, `pagoda router --workers N`).

It starts children (multiprocessing spawn: a fresh interpreter, arguments pickled), makes each die with
its parent (PR_SET_PDEATHSIG, so none is left behind even when the parent is SIGKILLed), turns
SIGTERM/SIGINT into a stop request that `wait` reports, says which child died when one does, and owns the
Prometheus multiprocess directory that every child's metrics go through (PROMETHEUS_MULTIPROC_DIR, set for
the children only, removed on `close`).

Generic on purpose: nothing here imports the engine, the server or the CLI, so the router uses it too. The
order in which children are stopped, and what a dead child means, is the caller's (`cli/serve.py`,
`tools/router/workers.py`).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from pagoda.child_process import die_with_parent

logger = logging.getLogger("pagoda.launch")


@dataclass
class Child:
    name: str
    index: int
    process: Any  # multiprocessing's Process (spawn context)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode


def _child_main(
    parent: int, death_signal: int, new_session: bool, target: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    if new_session:
        os.setsid()  # signals come from the supervisor only (not a terminal's Ctrl-C)
    die_with_parent(parent, death_signal)
    result = target(*args)
    if isinstance(result, int) and result:
        sys.exit(result)


class Supervisor:
    """Children of this process, and the stop request (a signal) that ends their watch.

    `metrics`: create the Prometheus multiprocess directory (prefix `metrics_prefix`) for the children."""

    def __init__(self, metrics: bool = True, metrics_prefix: str = "pagoda-metrics-"):
        self.mp = multiprocessing.get_context("spawn")
        self.children: list[Child] = []
        self.signals: list[int] = []  # the stop signals received, in order
        self.metrics_dir = tempfile.mkdtemp(prefix=metrics_prefix) if metrics else None
        self._old_handlers: dict[int, Any] = {}

    # ---- children -----------------------------------------------------------------------------
    def start(
        self,
        name: str,
        target: Callable[..., Any],
        args: tuple[Any, ...] = (),
        *,
        index: int = 0,
        death_signal: int = signal.SIGTERM,
        new_session: bool = False,
        daemon: bool = True,
    ) -> Child:
        """Start `target(*args)` in a spawned child (`target` and `args` must pickle). It gets `death_signal`
        when this process dies; `new_session`: its own session, so a terminal's signals reach only us.
        `daemon=False` for a child that starts processes of its own (multiprocessing forbids it to a daemon)."""
        process = self.mp.Process(
            target=_child_main,
            name=name,
            daemon=daemon,
            args=(os.getpid(), int(death_signal), new_session, target, args),
        )
        with self._child_environment():
            process.start()
        child = Child(name, index, process)
        self.children.append(child)
        return child

    @contextlib.contextmanager
    def _child_environment(self) -> Iterator[None]:
        """PROMETHEUS_MULTIPROC_DIR for the child (it is read when prometheus_client is imported there)."""
        if self.metrics_dir is None:
            yield
            return
        previous = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            else:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous

    # ---- signals ------------------------------------------------------------------------------
    def catch_signals(self) -> None:
        """From now on SIGTERM/SIGINT only record a stop request (`stopping`); `close` restores the handlers."""

        def on_signal(signum: int, _frame: Any) -> None:
            self.signals.append(signum)

        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old_handlers.setdefault(sig, signal.signal(sig, on_signal))

    @property
    def stopping(self) -> bool:
        return bool(self.signals)

    # ---- watching -----------------------------------------------------------------------------
    def wait(
        self,
        children: Iterable[Child] | None = None,
        poll: Callable[[float], None] | None = None,
        interval: float = 0.2,
    ) -> Child | None:
        """Until a stop signal arrives (None) or one of `children` (default: all) exits (that child).
        `poll(timeout)`: the caller's own wait between checks (a pipe to read), instead of a sleep."""
        watched = list(self.children if children is None else children)
        while not self.signals:
            for child in watched:
                if not child.alive:
                    self._mark_dead(child)
                    return child
            if poll is not None:
                poll(interval)
            else:
                time.sleep(interval)
        return None

    def stop(
        self, children: Iterable[Child], grace: float, sig: int = signal.SIGTERM, again: int | None = None
    ) -> None:
        """Send `sig` to each live child, wait up to `grace` s for all of them, then SIGKILL what is left.
        `again`: the signal passed on when a further stop signal arrives meanwhile (say SIGINT: stop at once)."""
        children = list(children)
        for child in children:
            if child.alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, sig)
        seen = len(self.signals)
        deadline = time.monotonic() + grace
        while any(child.alive for child in children) and time.monotonic() < deadline:
            if again is not None and len(self.signals) > seen:
                seen = len(self.signals)
                for child in children:
                    if child.alive:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(child.pid, again)
            time.sleep(0.05)
        for child in children:
            if child.alive:
                logger.warning("%s (pid %d) did not stop in time: killed", child.name, child.pid)
                child.process.kill()
                child.process.join(5)
            self._mark_dead(child)

    def _mark_dead(self, child: Child) -> None:
        child.process.join(0)
        if self.metrics_dir is not None:
            # lazy: prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR must be set before import)
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(child.pid, self.metrics_dir)  # its live gauges no longer count

    def close(self) -> None:
        """Whatever is still running (an error during startup, a second signal): kill it; remove the metrics
        directory; restore the signal handlers."""
        for child in self.children:
            if child.alive:
                child.process.kill()
                child.process.join(5)
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()
