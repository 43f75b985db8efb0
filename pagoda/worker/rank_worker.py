"""A tensor-parallel rank other than the driver: its own shard of the model, driven by rank 0's calls.

The driver (rank 0, in the engine core) posts every call it makes on its own `ModelRunner` — each
step's `launch(SchedulerOutput)` and the startup calls (profile, KV cache, graphs) — as one pickled
`(method, args)` over the gloo group; each rank makes the same call on its shard, in the same order, so
the collectives inside line up. Only the driver samples: a rank gets each step's tokens from the driver
inside `ModelRunner._sample`, and appends them to its request states one launch later (as the driver
does with async scheduling), so its host work for step N+1 never waits for step N's GPU work. With
pipeline micro-batches a step's tokens come at the driver's later `finish_step` call instead.

Two ways to run one: `run_rank_process` (a local process the engine core spawns: the `mp` backend) and
`RankActor` (a Ray actor, possibly on another machine: the `ray` backend).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import torch

from pagoda import envs
from pagoda.child_process import die_with_parent
from pagoda.config import EngineConfig
from pagoda.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel, receive_from_driver
from pagoda.models.source import resolve_model_source
from pagoda.worker.model_runner import ModelRunner

logger = logging.getLogger("pagoda.rank")

HEARTBEAT_INTERVAL_S = 0.5
STOP = None  # the call that ends a rank's loop


def share_cpu_threads(config: EngineConfig) -> int:
    """On the CPU, each of the N ranks computes on its share of the cores this process may run on (N processes
    each running one OpenMP thread per core would oversubscribe the machine N times over), or on
    --cpu-threads or OMP_NUM_THREADS. Returns the previous count."""
    previous = torch.get_num_threads()
    if config.device.device == "cpu":
        threads = cpu_threads_per_rank(config)
        torch.set_num_threads(threads)
        how = _thread_source(config) or f"{config.parallel.world_size} rank(s)"
        logger.info(
            "CPU threads: %d per rank (%d cores available to this process; %s)", threads, available_cores(), how
        )
    return previous


def gpu_serving_threads(config: EngineConfig) -> None:
    """A GPU engine's process, once built, keeps one CPU thread for PyTorch (--cpu-threads or OMP_NUM_THREADS win).
    Its CPU tensor work while serving is small (an image's staging copy into pinned memory, a few conversions): an
    OpenMP team spread over every core makes the launching thread wake and wait for the team at each such copy, and
    leaves its idle threads spinning on cores the API processes need. vLLM's GPU workers run with one thread too."""
    if config.device.device != "cuda":
        return
    source = _thread_source(config)
    threads = cpu_threads_per_rank(config) if source else 1
    torch.set_num_threads(threads)
    logger.info("CPU threads: %d for the GPU engine's own CPU work (%s)", threads, source or "default")


def _thread_source(config: EngineConfig) -> str | None:
    """Which setting fixes the thread count: "--cpu-threads", "OMP_NUM_THREADS", or None (the cores are shared)."""
    if config.device.cpu_threads is not None:
        return "--cpu-threads"
    omp = envs.OMP_NUM_THREADS.value
    return "OMP_NUM_THREADS" if omp and omp > 0 else None


def cpu_threads_per_rank(config: EngineConfig) -> int:
    """--cpu-threads; else OMP_NUM_THREADS as set for the process (a machine or a test runner sharing its cores
    among several servers says so there); else an equal share of the available cores."""
    if config.device.cpu_threads is not None:
        return config.device.cpu_threads
    if _thread_source(config) == "OMP_NUM_THREADS":
        return int(envs.OMP_NUM_THREADS.value)
    return max(1, available_cores() // config.parallel.world_size)


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. a container's cpuset), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def build_rank_runner(config: EngineConfig, rank: int, init_method: str, eos_token_ids: list[int]) -> ModelRunner:
    """Join the group, then build this rank's shard (it reads only its slices of the weights)."""
    torch.manual_seed(config.model.seed)
    share_cpu_threads(config)
    init_tensor_parallel(
        rank,
        config.parallel.tensor_parallel_size,
        init_method,
        config.device.device,
        envs.TP_INIT_TIMEOUT_S.value,
        config.parallel.pipeline_parallel_size,
    )
    return ModelRunner(config, resolve_model_source(config.model.model), set(eos_token_ids))


def serve_driver(runner: ModelRunner) -> None:
    """Make every call the driver makes, in its order, until it sends STOP."""
    pending = None  # the last launched step, read after the next launch (as the driver does)
    while True:
        call = receive_from_driver()
        if call is STOP:
            break
        method, args = call
        if method == "launch" and pending is not None and (pending.speculative or args[0].spec_token_ids):
            # Proposals go after a row's known tokens, and a step's kept ones are known tokens of the next: both
            # need the last step's tokens first (the driver read that step before scheduling this one:
            # `LLMEngine.step` reads a step with proposals at once and the steps in flight before proposing).
            pending.result()
            pending = None
        result = getattr(runner, method)(*args)
        if method == "launch":
            for request_id, stage, exc in runner.take_failures():  # the driver reports them to the client
                logger.debug("request %s left out (%s): %s", request_id, stage, exc)
            if pending is not None:
                pending.result()
            # A deferred step (micro-batches) takes its tokens at the driver's `finish_step` call instead.
            pending = None if runner.link.deferred else result
    if pending is not None:
        pending.result()


def _beat(heartbeat: Any) -> None:
    while True:
        heartbeat.value = time.monotonic()
        time.sleep(HEARTBEAT_INTERVAL_S)


def _log_as_rank(rank: int) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s rank {rank} %(name)s: %(message)s")


def run_rank_process(
    config: EngineConfig,
    rank: int,
    init_method: str,
    eos_token_ids: list[int],
    heartbeat: Any,
    errors: Any,
    parent: int,
) -> None:
    """Entry of a local rank process, spawned by the engine core `parent`, which it dies with. `heartbeat`: a
    shared double this process stamps with time.monotonic() twice a second (the core's watch reads it);
    `errors`: a pipe end for the one line that says why startup failed."""
    die_with_parent(parent, signal.SIGKILL)
    # The driver ends a rank (STOP, or its own death): a terminal's Ctrl-C or a SIGTERM to the process group
    # must not kill a rank in the middle of a collective the driver still waits on.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _log_as_rank(rank)
    threading.Thread(target=_beat, args=(heartbeat,), name="pagoda-heartbeat", daemon=True).start()
    if config.device.device == "cuda":
        torch.cuda.set_device(rank)  # local ranks: one visible GPU each, in rank order
    try:
        runner = build_rank_runner(config, rank, init_method, eos_token_ids)
    except Exception as exc:  # noqa: BLE001 - one line to the driver, which refuses to start with it
        errors.send(f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None
    gpu_serving_threads(config)
    serve_driver(runner)
    destroy_tensor_parallel()


class RankActor:
    """One rank as a Ray actor (the `ray` backend): `run` blocks in the rank's loop; `ping` answers on a
    second thread (the actor is created with max_concurrency=2) while `run` is inside a collective."""

    def node_id(self) -> str:
        import ray  # lazy: ray (optional; only the ray backend's actors import it)

        return ray.get_runtime_context().get_node_id()

    def ping(self) -> float:
        return time.monotonic()

    def run(self, config: EngineConfig, rank: int, init_method: str, eos_token_ids: list[int]) -> None:
        _log_as_rank(rank)
        if config.device.device == "cuda":
            torch.cuda.set_device(0)  # Ray gives each actor its own GPU as CUDA_VISIBLE_DEVICES
        runner = build_rank_runner(config, rank, init_method, eos_token_ids)
        gpu_serving_threads(config)
        serve_driver(runner)
        destroy_tensor_parallel()
