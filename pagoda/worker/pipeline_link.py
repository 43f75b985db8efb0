"""A pipeline stage's links to its neighbours, as the runner uses them once per step.

Every rank runs the same step (the driver broadcast it), so every rank knows the step's shapes: a stage
after the first receives the previous stage's (layer output, residual), each [T, H] in the model's dtype;
a stage before the last sends its own; the last stage's tensor-parallel rank 0 sends the logits of the
rows that sample ([S, V]) to the driver, which samples them and broadcasts the tokens to every rank.
A stage waits in `recv` for its input, so without several micro-batches in flight the stages take turns.
A step replayed as a CUDA graph (`worker/graph_runner.py`) sends and receives its whole bucket of B >= T
tokens (every stage picks the same bucket for the same step), into and out of the graph's static buffers.
"""

from __future__ import annotations

import torch

from pagoda.distributed.parallel_state import (
    is_driver,
    pp_size,
    recv_from_previous_stage,
    recv_logits_on_driver,
    send_logits_to_driver,
    send_to_next_stage,
)
from pagoda.layers.pipeline import PipelineStage, StageHidden


class PipelineLink:
    def __init__(self, stage: PipelineStage, hidden_size: int, vocab_size: int, dtype: torch.dtype, device):
        self.stage, self.hidden_size, self.vocab_size = stage, hidden_size, vocab_size
        self.dtype, self.device = dtype, device
        self.active = pp_size() > 1

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
