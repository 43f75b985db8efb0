"""The token embedding and the LM head split by vocabulary rows over the tensor-parallel group.

Rank r of N holds rows [r·V/N, (r+1)·V/N) of the [V, H] matrix (V must divide by N). At world size 1
both are the single-device layers: parameter `weight` [V, H], one lookup / one matmul, no collective.
- `VocabParallelEmbedding`: each rank looks up the ids in its rows (others read row 0 and are zeroed),
  then the all-reduce sums the one non-zero contribution per token: [T] → [T, H] on every rank.
- `ParallelLMHead`: each rank's [T, V/N] logits, all-gathered along the vocabulary: [T, V] on
  every rank. Tying it to the embedding shares the (equally split) weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed import parallel_state
from pagoda.layers.linear import QuantMethod, Weight, linear, read_weight, reads_shards


class _VocabRows(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_size = parallel_state.tp_world_size()
        self.vocab_size = vocab_size
        self.vocab_start, local = parallel_state.shard(vocab_size, "vocab_size")
        self.vocab_end = self.vocab_start + local
        self.weight = nn.Parameter(torch.empty(local, hidden_size))

    @reads_shards
    def weight_loader(self, param: nn.Parameter, loaded: Weight, shard_id: object = None) -> None:
        expected = (self.vocab_size, param.shape[1])
        if tuple(loaded.shape) != expected:
            raise ValueError(f"shape mismatch: parameter {expected} vs checkpoint {tuple(loaded.shape)}")
        if self.tp_size > 1:
            loaded = loaded.narrow(0, self.vocab_start, param.shape[0])
        param.data.copy_(read_weight(loaded, param.dtype))


class VocabParallelEmbedding(_VocabRows):
    """input_ids [T] → embeddings [T, H].

    rows: what looks the rows up in place of `weight` (then dropped): a CPU GGUF's Q8_0 levels widened per
    lookup (`layers/quantization/cpu_int4.py`)."""

    rows: Callable[[torch.Tensor], torch.Tensor] | None = None

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight) if self.rows is None else self.rows(ids)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mine, input_ids - self.vocab_start, 0)
        out = self._lookup(local).masked_fill_(~mine.unsqueeze(-1), 0)
        return parallel_state.all_reduce(out)


class ParallelLMHead(_VocabRows):
    """hidden [N, H] → logits [N, V] (the full vocabulary on every rank).

    quant: a method that multiplies in place of `weight` (the CPU's bf16 head, `layers/quantization/cpu_int4.py`);
    `weight` stays while a tied embedding looks its rows up in it."""

    quant: QuantMethod | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight) if self.quant is None else self.quant.apply(self, hidden, None)
        return logits if self.tp_size == 1 else parallel_state.all_gather(logits, dim=-1)
