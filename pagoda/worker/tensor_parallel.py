"""The engine's model runner under tensor parallelism: rank 0 of N, driving the other N-1.

`make_runner` gives the engine a plain `ModelRunner` at TP = 1 and a `TensorParallelRunner` above: the
same calls, each first posted to the ranks (`rank_worker.serve_driver` makes it on each shard) and then
made on the driver's own shard. The scheduler and the block manager run once, in the engine; a step
crosses to the ranks as one pickled `SchedulerOutput`; the driver alone samples and returns tokens. Under
pipeline parallelism with several micro-batches in flight, a step's sampling waits until the engine reads it
(`PendingStep.result`), and reading it posts `finish_step` to the ranks, which take its tokens then.

Startup order: start ranks 1..N-1 (local processes or Ray actors), join the group as rank 0 (every rank
meets at the driver's tcp:// address), then every rank builds its shard and reads its slices of the
weights at the same time. A rank that is gone or hung ends the engine core (`rank_group.RankWatch`).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from pagoda import envs
from pagoda.config import EngineConfig
from pagoda.config.engine import text_field
from pagoda.distributed.parallel_state import (
    destroy_tensor_parallel,
    init_tensor_parallel,
    num_ranks,
    post_to_ranks,
    stage_layers,
)
from pagoda.errors import ConfigError
from pagoda.models.source import ModelSource
from pagoda.outputs import SchedulerOutput
from pagoda.worker.encoder_cache import EncoderCache
from pagoda.worker.memory import KVCacheLayout, KVCacheSpec
from pagoda.worker.model_runner import ModelRunner
from pagoda.worker.pending_step import DeferredStep, LaunchedStep
from pagoda.worker.rank_group import LocalRanks, RankWatch, RayRanks, free_port
from pagoda.worker.rank_worker import STOP, share_cpu_threads

logger = logging.getLogger("pagoda.core")


def make_runner(
    config: EngineConfig, source: ModelSource, eos_token_ids: set[int], on_fatal: Callable[[str], None] | None = None
) -> ModelRunner | TensorParallelRunner:
    if num_ranks() > 1:
        # The group is per process (the layers read it when built and when they run): one at a time.
        raise ConfigError(
            f"This process already runs a parallel engine ({num_ranks()} ranks); shut it down first "
            "(LLM.shutdown()) or build the new engine in another process.",
            "tensor_parallel_size",
        )
    if config.parallel.world_size == 1:
        if config.device.cpu_threads is not None:  # offline the default stays the user's process's own
            share_cpu_threads(config)
        return ModelRunner(config, source, eos_token_ids)
    return TensorParallelRunner(config, source, eos_token_ids, on_fatal)


def stage_summary(num_layers: int, parallel: Any) -> str:
    """'stage 0: layers 0-11 (ranks 0-1); stage 1: ...' for the startup log."""
    tp, parts = parallel.tensor_parallel_size, []
    for s in range(parallel.pipeline_parallel_size):
        r = stage_layers(num_layers, s, parallel.pipeline_parallel_size)
        ranks = f"rank {s * tp}" if tp == 1 else f"ranks {s * tp}-{s * tp + tp - 1}"
        parts.append(f"stage {s}: layers {r.start}-{r.stop - 1} ({ranks})")
    return "; ".join(parts)


def _init_failed(exc: BaseException, init_method: str, timeout: float) -> ConfigError:
    return ConfigError(
        f"The tensor-parallel ranks did not meet at {init_method} within {timeout:g} s "
        f"({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}). "
        "Rerun with NCCL_DEBUG=INFO to see where NCCL stops; on machines without working GPU peer-to-peer "
        "or InfiniBand set NCCL_P2P_DISABLE=1 and/or NCCL_IB_DISABLE=1; PAGODA_TP_INIT_TIMEOUT_S sets the wait.",
        "tensor_parallel_size",
    )


class TensorParallelRunner:
    """Rank 0's `ModelRunner`, whose every state-changing call is made on all ranks."""

    @property
    def lora(self) -> Any:
        """The driver's adapters (`lora/manager.py`): the engine reads and checks an adapter there; each other
        rank reads it when the adapter's first request reaches it, and drops it with `remove_lora`."""
        return self.local.lora

    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        eos_token_ids: set[int],
        on_fatal: Callable[[str], None] | None = None,
    ):
        parallel = config.parallel
        n = parallel.world_size  # tensor x pipeline parallel ranks, stage by stage
        if parallel.distributed_executor_backend == "ray":
            self.ranks: LocalRanks | RayRanks = RayRanks(n, config.device.device, parallel.tensor_parallel_size)
        else:
            self.ranks = LocalRanks(n, parallel.tensor_parallel_size)
        init_method = f"tcp://{self.ranks.host}:{free_port(self.ranks.host)}"
        self.ranks.start(config, init_method, sorted(eos_token_ids))
        self.watch = RankWatch(self.ranks, on_fatal)
        self.watch.start()
        # Whatever happens to this object (shutdown, garbage, interpreter exit), the ranks are told to stop.
        self._finalizer = weakref.finalize(self, _stop_ranks, self.ranks, self.watch)
        timeout = envs.TP_INIT_TIMEOUT_S.value
        try:
            with self.watch.calling("join the tensor-parallel group"):
                init_tensor_parallel(
                    0,
                    parallel.tensor_parallel_size,
                    init_method,
                    config.device.device,
                    timeout,
                    parallel.pipeline_parallel_size,
                )
        except Exception as exc:  # noqa: BLE001 - RuntimeError or DistStoreError, by torch version
            self._finalizer.detach()
            self.watch.stop()
            self.ranks.stop(timeout=2)
            raise _init_failed(exc, init_method, timeout) from None
        self._finalizer.detach()
        threads = share_cpu_threads(config)  # given back at shutdown (offline, this is the user's process)
        self._finalizer = weakref.finalize(self, _stop_group, self.ranks, self.watch, threads)
        self.local = ModelRunner(config, source, eos_token_ids)
        logger.info(
            "Parallel: %d ranks (tensor %d x pipeline %d, %s backend), rank 0 here, %s: %s",
            n,
            parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
            parallel.distributed_executor_backend,
            "rank 1" if n == 2 else f"ranks 1-{n - 1}",
            ", ".join(f"pid {p}" for p in self.ranks.pids()) or "Ray actors",
        )
        if parallel.pipeline_parallel_size > 1:
            layers = int(text_field(config.model.hf_config, "num_hidden_layers", 0))
            logger.info("Pipeline stages (decoder layers): %s", stage_summary(layers, parallel))

    def _on_all_ranks(self, method: str, *args: Any, local: Callable[..., Any] | None = None) -> Any:
        """`method(*args)` on every rank (here `local(*args)` instead, if given). A rank killed meanwhile fails
        the collectives here: the watch then ends the core with the line that names the rank
        (`RankWatch.fail_call`)."""
        with self.watch.calling(method):
            try:
                post_to_ranks((method, args))
                return (local or getattr(self.local, method))(*args)
            except Exception as exc:
                self.watch.fail_call(method, exc)
                raise

    # ---- what the engine calls (ModelRunner's surface) -----------------------------------------
    def launch(self, so: SchedulerOutput) -> LaunchedStep:
        step = self._on_all_ranks("launch", so)
        if isinstance(step, DeferredStep):  # micro-batches: the ranks take its tokens as the engine reads it
            step.read = lambda sample: self._on_all_ranks("finish_step", local=sample)
        return step

    def initialize_kv_cache(self, layout: KVCacheLayout) -> None:
        self._on_all_ranks("initialize_kv_cache", layout)

    def warm_up_attention(self) -> None:
        self._on_all_ranks("warm_up_attention")

    def enable_cuda_graphs(self, capture: bool = True) -> None:
        self._on_all_ranks("enable_cuda_graphs", capture)

    def profile_peak_memory(self, num_tokens: int) -> int:
        return self._on_all_ranks("profile_peak_memory", num_tokens)

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.local.kv_cache_spec()  # per rank: the same on every rank

    def remove_lora(self, lora_id: int) -> None:
        """Every rank drops its copy now: one kept would outlive the adapter (and serve its old files if the id
        were read again from a rewritten folder)."""
        self._on_all_ranks("remove_lora", lora_id)

    def set_token_masks(self, masks: Any) -> None:
        """Only the driver samples, so only its shard applies grammar masks."""
        self.local.set_token_masks(masks)

    def take_failures(self) -> list[tuple[str, str, Exception]]:
        return self.local.take_failures()

    @property
    def failures(self) -> list[tuple[str, str, Exception]]:
        return self.local.failures

    @property
    def vocab_size(self) -> int:
        return self.local.vocab_size

    @property
    def accepts_multimodal(self) -> bool:
        return self.local.accepts_multimodal

    @property
    def weight_bytes(self) -> int:
        return self.local.weight_bytes

    @property
    def encoder_cache(self) -> EncoderCache:
        return self.local.encoder_cache

    def rank_pids(self) -> list[int]:
        return self.ranks.pids()

    def shutdown(self) -> None:
        """Stop every rank and leave the group (the engine's end; also run at garbage collection)."""
        self._finalizer()


def _stop_ranks(ranks: LocalRanks | RayRanks, watch: RankWatch) -> None:
    watch.stop()
    ranks.stop(timeout=2)


def _stop_group(ranks: LocalRanks | RayRanks, watch: RankWatch, threads: int) -> None:
    watch.stop()
    try:
        post_to_ranks(STOP)
    except Exception:  # noqa: BLE001 - a rank already gone: stop the others by force
        logger.warning("a tensor-parallel rank did not take the stop call; ending the ranks")
    ranks.stop(timeout=10)
    destroy_tensor_parallel()
    torch.set_num_threads(threads)
