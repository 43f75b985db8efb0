"""A rank's links to the other ranks, as the runner uses them once per step: activations between pipeline
stages, the last stage's logits to the driver, the driver's sampled tokens back to every rank.

Every rank runs the same step (the driver posted it), so every rank knows the step's shapes: a stage
after the first receives the previous stage's (layer output, residual), each [T, H] in the model's dtype;
a stage before the last sends its own; the last stage's tensor-parallel rank 0 sends the logits of the
rows that sample ([S, V]) to the driver, which samples them and hands the tokens to every rank.
A step replayed as a CUDA graph (`worker/graph_runner.py`) sends and receives its whole bucket of B >= T
tokens (every stage picks the same bucket for the same step), into and out of the graph's static buffers.

Micro-batches (`SchedulerConfig.micro_batches` > 1, pipeline parallelism): the scheduler keeps that many
steps of disjoint requests in flight, so stage 0 computes step N+1 while the next stage computes step N. A
step's sampling then waits until the engine reads it: `defer` returns a `DeferredStep` whose `result()`
takes the last stage's logits and samples on the driver; the ranks keep their deferred steps in launch
order and take each one's tokens when the driver posts `finish_step` (the driver posts it as it reads the
step). With one micro-batch the driver takes the logits inside `launch` and broadcasts the tokens there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from pagoda.config import EngineConfig
from pagoda.config.engine import text_field
from pagoda.distributed.parallel_state import (
    broadcast_tensor,
    is_driver,
    num_ranks,
    pp_size,
    recv_from_previous_stage,
    recv_logits_on_driver,
    recv_tokens,
    send_logits_to_driver,
    send_to_next_stage,
    send_tokens_to_ranks,
)
from pagoda.layers.pipeline import PipelineStage, StageHidden
from pagoda.worker.pending_step import DeferredStep, PendingStep


class PipelineLink:
    def __init__(self, stage: PipelineStage, config: EngineConfig, dtype: torch.dtype, device):
        self.stage, self.vocab_size = stage, config.model.vocab_size
        self.hidden_size = int(text_field(config.model.hf_config, "hidden_size"))
        self.dtype, self.device = dtype, device
        self.active = pp_size() > 1
        self.deferred = self.active and config.scheduler.micro_batches > 1
        self.unfinished: deque[DeferredStep] = deque()  # a rank's deferred steps, oldest first

    def stage_input(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The previous stage's (layer output, residual) for a step of `num_tokens`, or None on the first stage."""
        if self.stage.first:
            return None
        buffers = torch.empty(2, num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        self.receive_into(buffers)
        return buffers[0], buffers[1]

    def receive_into(self, buffers: torch.Tensor) -> None:
        """The previous stage's activations into `buffers` [2, T, H] (a graph's static inputs); none on the first."""
        if not self.stage.first:
            recv_from_previous_stage([buffers[0], buffers[1]])

    def hand_on(self, out: torch.Tensor | StageHidden) -> torch.Tensor | None:
        """The model's output: a stage before the last sends it on (None); the last returns its hidden states."""
        if isinstance(out, StageHidden):
            send_to_next_stage([out.hidden, out.residual])
            return None
        return out

    def logits_for_driver(self, logits: torch.Tensor) -> None:
        if self.active:
            send_logits_to_driver(logits)

    def driver_logits(self, num_rows: int) -> torch.Tensor | None:
        """On the driver (a stage before the last): the last stage's logits of the step's sampling rows."""
        return recv_logits_on_driver((num_rows, self.vocab_size), self.dtype, self.device) if is_driver() else None

    # ---- sampled tokens ------------------------------------------------------------------------
    def share_tokens(self, tokens: torch.Tensor) -> None:
        """On the driver: its sampled tokens [S] (or [S, W]: a speculative step's, `spec_rows.shared_tokens`)
        to every other rank (they feed the ranks' next inputs)."""
        if num_ranks() > 1:
            send_tokens_to_ranks(tokens) if self.deferred else broadcast_tensor(tokens.contiguous())

    def driver_tokens(self, num_rows: int, width: int | None = None) -> torch.Tensor:
        """On a rank other than the driver: the driver's tokens of this step's `num_rows` sampling rows ([S], or
        [S, width] as shared)."""
        shape = (num_rows,) if width is None else (num_rows, width)
        out = torch.empty(shape, dtype=torch.int64, device=self.device)
        return recv_tokens(out) if self.deferred else broadcast_tensor(out)

    # ---- micro-batches -------------------------------------------------------------------------
    def defer(
        self, sample: Callable[[torch.Tensor | None], PendingStep], logits: torch.Tensor | None, rows: int
    ) -> DeferredStep:
        """The step's sampling for later: on the driver when the engine reads it, on the other ranks at the
        driver's `finish_step` (queued here). `logits`: this rank's, if it computed them (the last stage)."""

        def run() -> PendingStep:
            return sample(self.driver_logits(rows) if logits is None else logits)

        step = DeferredStep(run)
        if not is_driver():
            self.unfinished.append(step)
        return step

    def finish_oldest(self) -> None:
        """On a rank other than the driver: the oldest deferred step takes the driver's tokens."""
        self.unfinished.popleft().result()
