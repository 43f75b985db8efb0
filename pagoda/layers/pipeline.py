"""What one pipeline stage of a decoder holds, and what it hands to the next.

Under pipeline parallelism each stage builds only its share of the decoder layers
(`parallel_state.stage_layers`); the others stay in `layers` as `MissingLayer` placeholders, so the
layers keep their checkpoint names (`model.layers.{i}`) and indices. The embedding (and a multimodal
encoder) live on the first stage, the final norm and the LM head on the last. A stage other than the
last returns `StageHidden` instead of the normed hidden states; the runner sends it to the next stage,
which starts from it (`StepAttention.stage_input`) instead of the embedding.

The decoders here hand the residual stream from layer to layer beside the layer output (each add is
fused into the next norm), so a stage boundary carries both tensors, each [T, H].
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pagoda.distributed import parallel_state


class MissingLayer(nn.Module):
    """A module another pipeline stage holds: no parameters, never called."""

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("a pipeline stage ran a layer another stage holds")


@dataclass
class StageHidden:
    """A non-last stage's output: the last layer's output and the residual stream, each [T, H]."""

    hidden: torch.Tensor
    residual: torch.Tensor


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class PipelineStage:
    layers: range  # decoder layer indices this stage holds
    first: bool
    last: bool

    @classmethod
    def current(cls, num_layers: int) -> PipelineStage:
        """This rank's stage (the whole decoder without pipeline parallelism)."""
        stage, n = parallel_state.pp_rank(), parallel_state.pp_size()
        return cls(parallel_state.stage_layers(num_layers), stage == 0, stage == n - 1)

    @property
    def whole(self) -> bool:
        return self.first and self.last

    def build(self, num_layers: int, make: Callable[[], nn.Module]) -> nn.ModuleList:
        return nn.ModuleList(make() if i in self.layers else MissingLayer() for i in range(num_layers))

    def own(self, layers: nn.ModuleList) -> list[nn.Module]:
        return [layers[i] for i in self.layers]

    def holds(self, name: str, first_only: tuple[str, ...], last_only: tuple[str, ...]) -> bool:
        """Whether a parameter name (the model's spelling) lives on this stage: a decoder layer by its
        index, the `first_only` prefixes (embedding, encoder) on the first, `last_only` (norm, head) on
        the last, anything else everywhere."""
        if self.whole:
            return True
        m = _LAYER.search(name)
        if m is not None and not name.startswith(first_only):
            return int(m.group(1)) in self.layers
        if name.startswith(first_only):
            return self.first
        if name.startswith(last_only):
            return self.last
        return True
