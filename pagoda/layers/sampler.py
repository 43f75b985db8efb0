"""Batched token sampling: logits [B, V] -> one next token per row (+ optional logprobs).

Owns the per-step sampling tensors (`SamplingBatch`, built once per step from each row's
`SamplingParams` and token history), the logit processing pipeline and the draw itself.
Pipeline, in vLLM/HF order:
  raw logits --(float32)--> repetition penalty -> frequency penalty -> presence penalty
  -> suppress mask (-inf)                                   = "penalised" (`apply_penalties`)
  greedy rows: argmax(penalised); they ignore temperature/top-k/top-p/min-p.
  other rows: / temperature -> top-k -> top-p -> min-p      = "filtered"  (`apply_filters`)
  -> softmax -> exponential race argmax(probs / Exp(1)).
Logprobs are those of the RAW model distribution (log_softmax of unprocessed logits),
like vLLM V1's default. Everything is whole-batch tensor ops with no host sync, so it runs
unchanged on CPU and CUDA; the only per-row Python loop draws noise for rows that carry a
seeded generator, which makes a seeded row independent of its batch-mates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pagoda.sampling_params import GREEDY_TEMPERATURE_EPS, SamplingParams


@dataclass
class SamplingBatch:
    """Per-step sampling arguments for B rows, prepared once per step (tensors on the logits' device).

    Optional tensors are None when every row is neutral for that knob, so the step skips
    that work entirely (the common case: plain temperature sampling).
    """

    temperature: Tensor  # [B] float32; 0 for greedy rows
    top_k: Tensor | None  # [B] int64, 0 = off; None when no row uses it
    top_p: Tensor | None  # [B] float32; None when all 1.0
    min_p: Tensor | None  # [B] float32; None when all 0.0
    presence_penalty: Tensor | None  # [B] float32; None when all 0.0
    frequency_penalty: Tensor | None  # [B] float32; None when all 0.0
    repetition_penalty: Tensor | None  # [B] float32; None when all 1.0
    output_token_counts: Tensor | None  # [B, V] int32 count of each token in the row's output so far
    prompt_or_output_mask: Tensor | None  # [B, V] bool: token seen in prompt or output
    suppress_mask: Tensor | None  # [B, V] bool: logits forced to -inf (min_tokens: EOS/stop ids)
    generators: list[torch.Generator | None]  # per-row seeded generator (on the logits' device) or None
    max_num_logprobs: int | None  # max over rows of SamplingParams.logprobs; None if no row wants any
    all_greedy: bool

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        suppress_token_ids: list[list[int]] | None,
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingBatch:
        """Gather B rows' params and histories into device tensors.

        Token ids must be < vocab_size (the engine validates prompts before this).
        `suppress_token_ids[i]` lists ids row i may not produce this step (None = none).
        """
        b = len(params)
        assert len(prompt_token_ids) == len(output_token_ids) == len(generators) == b
        assert suppress_token_ids is None or len(suppress_token_ids) == b

        def vec(values: list[float], neutral: float, dtype: torch.dtype = torch.float32) -> Tensor | None:
            # None lets the sampler skip the knob when no row uses it.
            if all(v == neutral for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=device)

        temperature = torch.tensor(
            [0.0 if p.is_greedy else p.temperature for p in params], dtype=torch.float32, device=device
        )
        presence = vec([p.presence_penalty for p in params], 0.0)
        frequency = vec([p.frequency_penalty for p in params], 0.0)
        repetition = vec([p.repetition_penalty for p in params], 1.0)

        counts = None
        if presence is not None or frequency is not None:
            counts = torch.zeros(b, vocab_size, dtype=torch.int32, device=device)
            rows, toks = _flat_index(output_token_ids, device)
            counts.index_put_((rows, toks), torch.ones_like(toks, dtype=torch.int32), accumulate=True)

        seen = None
        if repetition is not None:
            seen = torch.zeros(b, vocab_size, dtype=torch.bool, device=device)
            both = [pr + out for pr, out in zip(prompt_token_ids, output_token_ids)]
            rows, toks = _flat_index(both, device)
            seen[rows, toks] = True

        suppress = None
        if suppress_token_ids is not None and any(suppress_token_ids):
            suppress = torch.zeros(b, vocab_size, dtype=torch.bool, device=device)
            rows, toks = _flat_index(suppress_token_ids, device)
            suppress[rows, toks] = True

        wanted = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=temperature,
            top_k=vec([p.top_k for p in params], 0, torch.int64),
            top_p=vec([p.top_p for p in params], 1.0),
            min_p=vec([p.min_p for p in params], 0.0),
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            output_token_counts=counts,
            prompt_or_output_mask=seen,
            suppress_mask=suppress,
            generators=list(generators),
            max_num_logprobs=max(wanted) if wanted else None,
            all_greedy=all(p.is_greedy for p in params),
        )


def _flat_index(ids_per_row: list[list[int]], device: torch.device | str) -> tuple[Tensor, Tensor]:
    """(row index, token id) pairs of a ragged list, as two [N] int64 tensors on `device`."""
    rows = [i for i, ids in enumerate(ids_per_row) for _ in ids]
    toks = [t for ids in ids_per_row for t in ids]
    # Built on the host then moved in one copy each: no per-element device writes.
    return (
        torch.tensor(rows, dtype=torch.int64).to(device),
        torch.tensor(toks, dtype=torch.int64).to(device),
    )


@dataclass
class SamplerOutput:
    sampled_token_ids: Tensor  # [B] int64
    sampled_logprobs: Tensor | None  # [B] float32 logprob of the sampled token, raw distribution
    top_logprobs: Tensor | None  # [B, K] float32, K = max_num_logprobs, sorted descending, raw distribution
    top_token_ids: Tensor | None  # [B, K] int64


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Repetition, frequency, presence penalties then the suppress mask. [B, V] -> [B, V] float32.

    Out-of-place throughout: the caller's logits are never modified (the result may be the
    input itself when it is float32 and no knob applies).
    """
    x = logits.float()
    if batch.repetition_penalty is not None:
        assert batch.prompt_or_output_mask is not None
        rp = batch.repetition_penalty.unsqueeze(1)
        # HF semantics: shrink toward 0 from either side, so a seen token always gets less likely.
        penalised = torch.where(x > 0, x / rp, x * rp)
        x = torch.where(batch.prompt_or_output_mask, penalised, x)
    if batch.frequency_penalty is not None or batch.presence_penalty is not None:
        assert batch.output_token_counts is not None
        counts = batch.output_token_counts.float()
        if batch.frequency_penalty is not None:
            x = x - batch.frequency_penalty.unsqueeze(1) * counts
        if batch.presence_penalty is not None:
            x = x - batch.presence_penalty.unsqueeze(1) * (counts > 0).float()
    if batch.suppress_mask is not None:
        x = x.masked_fill(batch.suppress_mask, float("-inf"))
    return x


def apply_filters(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Temperature, top-k, top-p, min-p on penalised logits. [B, V] -> new [B, V] float32.

    Dropped tokens are -inf; kept ones are logits / temperature, so softmax of the result is
    the exact sampling distribution of each non-greedy row. Greedy rows (temperature 0) are
    divided by 1 instead; their result is meaningless but finite, and `Sampler` ignores it.
    """
    x = logits.float()
    greedy = batch.temperature < GREEDY_TEMPERATURE_EPS
    temp = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
    x = x / temp.unsqueeze(1)
    neg_inf = float("-inf")

    if batch.top_k is not None or batch.top_p is not None:
        # One descending sort serves both top-k (a rank cut) and top-p (a cumulative-mass cut).
        sorted_x, order = x.sort(dim=-1, descending=True)
        vocab = x.shape[-1]
        if batch.top_k is not None:
            k = batch.top_k.clamp(0, vocab)
            k = torch.where(k == 0, torch.full_like(k, vocab), k)
            kth = sorted_x.gather(1, (k - 1).unsqueeze(1))  # [B, 1] k-th largest value
            # Threshold, not rank: tokens tied with the k-th largest all stay.
            sorted_x = sorted_x.masked_fill(sorted_x < kth, neg_inf)
        if batch.top_p is not None:
            probs = sorted_x.softmax(dim=-1)
            cum = probs.cumsum(dim=-1)
            # Mass strictly before each position; a token stays while that is < top_p, which
            # keeps the smallest prefix reaching top_p and always the first token (mass 0).
            before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
            drop = before >= batch.top_p.unsqueeze(1)
            # Rows at top_p == 1 keep everything even if float rounding pushes `before` to 1.
            drop &= (batch.top_p < 1.0).unsqueeze(1)
            sorted_x = sorted_x.masked_fill(drop, neg_inf)
        x = torch.empty_like(x).scatter_(1, order, sorted_x)

    if batch.min_p is not None:
        probs = x.softmax(dim=-1)
        max_prob = probs.amax(dim=-1, keepdim=True)
        x = x.masked_fill(probs < batch.min_p.unsqueeze(1) * max_prob, neg_inf)
    return x


def _exponential_noise(shape: tuple[int, int], batch: SamplingBatch, device: torch.device) -> Tensor:
    """[B, V] i.i.d. Exp(1) noise; seeded rows draw theirs from their own generator."""
    q = torch.empty(shape, dtype=torch.float32, device=device).exponential_()
    for i, g in enumerate(batch.generators):
        if g is not None:
            # Drawn as a fresh [V] vector so the row's stream depends only on its seed and step.
            q[i] = torch.empty(shape[1], dtype=torch.float32, device=device).exponential_(generator=g)
    # exponential_ can return exactly 0; probs/0 would give inf or nan (argmax picks nan).
    # tiny keeps probs/q <= 1/tiny, still finite in float32.
    return q.clamp_min_(torch.finfo(torch.float32).tiny)


class Sampler(nn.Module):
    """Stateless: all per-request state arrives in the `SamplingBatch`."""

    def forward(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits [B, V] of any float dtype; all math in float32."""
        raw = logits.float()
        penalised = apply_penalties(raw, batch)
        greedy_ids = penalised.argmax(dim=-1)
        if batch.all_greedy:
            token_ids = greedy_ids
        else:
            probs = apply_filters(penalised, batch).softmax(dim=-1)
            # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) is a draw from p, and
            # needs neither a cumulative sum nor a host sync (unlike torch.multinomial).
            noise = _exponential_noise(tuple(probs.shape), batch, probs.device)
            sampled = (probs / noise).argmax(dim=-1)
            greedy = batch.temperature < GREEDY_TEMPERATURE_EPS
            token_ids = torch.where(greedy, greedy_ids, sampled)

        if batch.max_num_logprobs is None:
            return SamplerOutput(token_ids, None, None, None)
        logprobs = raw.log_softmax(dim=-1)
        sampled_lp = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        top_lp, top_ids = logprobs.topk(batch.max_num_logprobs, dim=-1, sorted=True)
        return SamplerOutput(token_ids, sampled_lp, top_lp, top_ids)
