"""The driver's handle on tensor-parallel ranks 1..N-1: start them, tell whether one is gone, stop them.

Two backends, as vLLM's `--distributed-executor-backend` names them:
- `LocalRanks` (mp): local processes spawned by the engine core; each dies with it (PR_SET_PDEATHSIG)
  and stamps a shared heartbeat twice a second.
- `RayRanks` (ray): Ray actors on an existing Ray cluster (`ray start --head`, `ray start --address=...`),
  so a model can span machines; the ranks meet over TCP at the driver's address. Ray owns placement and
  the processes; nothing here manages a cluster.

`fault()` is the one question `RankWatch` asks (its thread twice a second, and the driver when a call to
the ranks fails): None while every rank is healthy, else one line that names the rank and what happened
to it.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from pagoda import envs
from pagoda.config import EngineConfig
from pagoda.worker.rank_worker import RankActor, run_rank_process

logger = logging.getLogger("pagoda.core")

WATCH_INTERVAL_S = 0.5
FAULT_WAIT_S = 2.0  # how long a failed call to the ranks looks for the rank that caused it
# Environment the ranks need from the driver's (Ray workers start from the raylet's, not the driver's).
_FORWARDED_ENV_PREFIXES = ("PAGODA_", "NCCL_", "TORCH_", "TRITON_", "GLOO_", "HF_")


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rank_label(rank: int, tp: int, world: int) -> str:
    """How a fault line names a rank: 'tensor-parallel rank 1', or under pipeline parallelism its stage too."""
    if tp >= world:
        return f"tensor-parallel rank {rank}"
    if tp == 1:
        return f"pipeline stage {rank} (rank {rank})"
    return f"pipeline stage {rank // tp}, tensor-parallel rank {rank % tp} (rank {rank})"


def _exit_text(exitcode: int) -> str:
    """How a process ended, as multiprocessing reports it (a negative exit code: the signal that killed it)."""
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    return f"died: killed by {name}"


class _Ranks:
    """What both rank launchers share: a rank's name in messages (`rank_label`)."""

    world_size: int
    tp: int  # ranks per pipeline stage

    def label(self, rank: int) -> str:
        return rank_label(rank, self.tp, self.world_size)


class LocalRanks(_Ranks):
    host = "127.0.0.1"

    def __init__(self, world_size: int, tp_size: int | None = None):
        self.world_size = world_size
        self.tp = tp_size or world_size  # ranks per pipeline stage
        self.procs: list[Any] = []
        self.heartbeats: list[Any] = []
        self.errors: list[Any] = []

    def start(self, config: EngineConfig, init_method: str, eos_token_ids: list[int]) -> None:
        ctx = multiprocessing.get_context("spawn")
        for rank in range(1, self.world_size):
            heartbeat = ctx.Value("d", 0.0, lock=False)
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=run_rank_process,
                args=(config, rank, init_method, eos_token_ids, heartbeat, writer, os.getpid()),
                name=f"pagoda-rank-{rank}",
                daemon=False,  # a daemon may not start processes (Triton compiles in some)
            )
            proc.start()
            writer.close()
            self.procs.append(proc)
            self.heartbeats.append(heartbeat)
            self.errors.append(reader)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def fault(self) -> str | None:
        now = time.monotonic()
        stale_after = envs.TP_HEARTBEAT_TIMEOUT_S.value
        for rank, (proc, beat, errors) in enumerate(zip(self.procs, self.heartbeats, self.errors), start=1):
            if proc.exitcode is not None:
                reason = ""
                with contextlib.suppress(EOFError, OSError):
                    if errors.poll():
                        reason = f": {errors.recv()}"
                if reason:
                    return f"{self.label(rank)} (pid {proc.pid}) failed to start{reason}"
                return f"{self.label(rank)} (pid {proc.pid}) {_exit_text(proc.exitcode)}"
            last = beat.value
            if last and now - last > stale_after:
                return (
                    f"{self.label(rank)} (pid {proc.pid}) is hung: no heartbeat for {now - last:.1f} s "
                    f"(PAGODA_TP_HEARTBEAT_TIMEOUT_S={stale_after:g})"
                )
        return None

    def stop(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.exitcode is None:
                proc.kill()
                proc.join(5)


class RayRanks(_Ranks):
    def __init__(self, world_size: int, device: str, tp_size: int | None = None):
        self.tp = tp_size or world_size  # ranks per pipeline stage
        import ray  # lazy: ray (optional: pip install 'pagoda[ray]')

        self.ray = ray
        self.world_size = world_size
        self.device = device
        ray.init(address=envs.RAY_ADDRESS.value, ignore_reinit_error=True, logging_level=logging.WARNING)
        self.host = ray.util.get_node_ip_address()
        self.actors: list[Any] = []
        self.runs: list[Any] = []
        self._sent: dict[int, tuple[Any, float]] = {}  # rank -> (its unanswered ping, when it was sent)
        self._answered: dict[int, float] = {}  # rank -> when it last answered a ping

    def start(self, config: EngineConfig, init_method: str, eos_token_ids: list[int]) -> None:
        env = {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_ENV_PREFIXES)}
        cls = self.ray.remote(RankActor)
        resources = {"num_gpus": 1} if self.device == "cuda" else {"num_cpus": 1}
        for rank in range(1, self.world_size):
            actor = cls.options(name=None, max_concurrency=2, runtime_env={"env_vars": env}, **resources).remote()
            self.actors.append(actor)
            self.runs.append(actor.run.remote(config, rank, init_method, eos_token_ids))

    def node_ids(self) -> list[str]:
        return list(self.ray.get([a.node_id.remote() for a in self.actors], timeout=60))

    def pids(self) -> list[int]:
        return []

    def fault(self) -> str | None:
        ray = self.ray
        for rank, run in enumerate(self.runs, start=1):
            done, _ = ray.wait([run], timeout=0)
            if done:
                try:
                    ray.get(run)
                    return f"{self.label(rank)} (Ray actor) stopped"
                except Exception as exc:  # noqa: BLE001 - what Ray says about the actor's end
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    return f"{self.label(rank)} (Ray actor) failed: {first}"
        return self._pings()

    def _pings(self) -> str | None:
        """Each actor answers a ping about once a second. The watch never blocks on one: a ping is sent,
        then looked at on later polls. An actor that has answered before and then leaves a ping
        unanswered for PAGODA_TP_HEARTBEAT_TIMEOUT_S is hung; one that has never answered is still
        being created (a process start and the imports, slow on a loaded host) and gets
        PAGODA_TP_INIT_TIMEOUT_S."""
        ray, now = self.ray, time.monotonic()
        for rank, actor in enumerate(self.actors, start=1):
            sent = self._sent.get(rank)
            if sent is None:
                if now - self._answered.get(rank, 0.0) >= 1.0:
                    self._sent[rank] = (actor.ping.remote(), now)
                continue
            ref, at = sent
            done, _ = ray.wait([ref], timeout=0)
            if done:
                del self._sent[rank]
                try:
                    ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - a dead actor: the next poll of its run says more
                    return f"{self.label(rank)} (Ray actor) is gone: {type(exc).__name__}"
                self._answered[rank] = now
                continue
            if rank in self._answered:
                limit, name = envs.TP_HEARTBEAT_TIMEOUT_S.value, "PAGODA_TP_HEARTBEAT_TIMEOUT_S"
                if now - at > limit:
                    return f"{self.label(rank)} (Ray actor) is hung: no answer to a ping within {limit:g} s ({name})"
            elif now - at > envs.TP_INIT_TIMEOUT_S.value:
                return (
                    f"{self.label(rank)} (Ray actor) did not start: no answer within "
                    f"{envs.TP_INIT_TIMEOUT_S.value:g} s (PAGODA_TP_INIT_TIMEOUT_S)"
                )
        return None

    def stop(self, timeout: float = 10.0) -> None:
        with contextlib.suppress(Exception):
            self.ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout)
        for actor in self.actors:
            with contextlib.suppress(Exception):
                self.ray.kill(actor)


class RankWatch:
    """The driver's watch thread: a rank that exits, stops beating or never returns from a step ends the
    engine core within about a second (one line naming the rank, then exit code 1), never a silent hang —
    the driver's own thread may be blocked inside a collective with that rank, so the watch cannot hand
    the error to it. `on_fatal(line)` runs first (the engine core tells the launcher and the API processes).

    A rank killed mid-step usually shows first on the driver's thread: its collective fails (gloo: a
    connection closed by the peer) before this thread's next look. The driver then asks `fail_call`, which
    ends the core the same way with the rank's line, the collective's traceback going to the debug log."""

    def __init__(self, ranks: LocalRanks | RayRanks, on_fatal: Callable[[str], None] | None):
        self.ranks, self.on_fatal = ranks, on_fatal
        self.call: tuple[str, float] | None = None  # the driver's call in progress and since when
        self._stopped = threading.Event()
        self._ending = threading.Lock()  # held by the one thread that ends the process
        self._asking = threading.Lock()  # `fault()` from one thread at a time (RayRanks keeps ping state)
        self._thread = threading.Thread(target=self._run, name="pagoda-rank-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    @contextlib.contextmanager
    def calling(self, method: str):
        self.call = (method, time.monotonic())
        try:
            yield
        finally:
            self.call = None

    def _run(self) -> None:
        while not self._stopped.wait(WATCH_INTERVAL_S):
            line = self._fault() or self._slow_call()
            if line is not None and not self._stopped.is_set():
                self._fatal(line)

    def _fault(self) -> str | None:
        with self._asking:
            return self.ranks.fault()

    def _slow_call(self) -> str | None:
        call, limit = self.call, envs.TP_STEP_TIMEOUT_S.value
        if call is None or time.monotonic() - call[1] <= limit:
            return None
        return (
            f"tensor-parallel call {call[0]!r} has not returned in {limit:g} s (PAGODA_TP_STEP_TIMEOUT_S): "
            "a collective is hung; rerun with NCCL_DEBUG=INFO to see which rank stopped"
        )

    def fail_call(self, method: str, exc: BaseException, wait: float = FAULT_WAIT_S) -> None:
        """The driver's call `method` to the ranks raised `exc`. If a rank is gone (a process that exits
        is seen a moment after its sockets close: looked at for up to `wait` s), end the core with its
        line; otherwise return and the caller raises `exc` (a failure of the driver's own)."""
        deadline = time.monotonic() + wait
        while True:
            line = self._fault()
            if line is not None:
                logger.debug("tensor-parallel call %r failed on the driver", method, exc_info=exc)
                self._fatal(line)
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _fatal(self, line: str) -> None:
        if not self._ending.acquire(blocking=False):
            while True:  # the other thread is ending the process
                time.sleep(60)
        logger.error("%s; stopping the engine core", line)
        if self.on_fatal is not None:
            with contextlib.suppress(Exception):
                self.on_fatal(line)
        logging.shutdown()
        os._exit(1)
