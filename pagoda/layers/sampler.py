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

Two ways to get a `SamplingBatch`:
  * `SamplingBatch.build(params, histories, ...)`: from scratch every step. Host work is
    O(rows) for the knobs and O(tokens in the histories) whenever a penalty needs them.
  * `SamplingState`: per-request rows that live from a request's first step to its end. Knobs
    are stored once when the request is added, the repetition penalty's seen-token mask and the
    frequency/presence penalties' token counts are device tensors updated in place with each
    step's sampled tokens (no host sync), so a step's batch is one gather by row: no per-token
    and almost no per-request Python work. Same batches, bit for bit, as `build` on the same
    histories (tests/unit/test_sampling_state.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import torch
from torch import Tensor, nn

from pagoda.device_copy import to_device
from pagoda.layers.token_mask import apply_token_bitmask
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
    # [B, L] int64: each row's SamplingParams.logprob_token_ids, padded with 0 (rows without: all 0); None
    # when no row has any. Their raw logprobs come back as SamplerOutput.chosen_logprobs.
    logprob_token_ids: Tensor | None = None
    # The unseeded rows' RNG: the engine's own generator (`SamplingState.generator`), None = torch's default.
    # Not the default on a GPU: while another thread captures a CUDA graph, torch holds the default CUDA
    # generator in capture mode, and a draw from it on any other stream raises.
    unseeded: torch.Generator | None = None

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

        # Each knob is read as a column (map + attrgetter: the loop runs in C) and becomes a tensor
        # only when some row is not neutral (list.count compares in C too).
        def column(name: str, neutral: float, dtype: torch.dtype = torch.float32) -> Tensor | None:
            values = list(map(attrgetter(name), params))
            return None if values.count(neutral) == b else to_device(values, device, dtype)

        temperatures = list(map(attrgetter("temperature"), params))
        if b and min(temperatures) < GREEDY_TEMPERATURE_EPS:  # SamplingParams.is_greedy rows
            temperatures = [0.0 if t < GREEDY_TEMPERATURE_EPS else t for t in temperatures]
        logprobs = list(map(attrgetter("logprobs"), params))
        wanted = [n for n in logprobs if n is not None] if logprobs.count(None) != b else []
        batch = cls(
            temperature=to_device(temperatures, device, torch.float32),
            top_k=column("top_k", 0, torch.int64),
            top_p=column("top_p", 1.0),
            min_p=column("min_p", 0.0),
            presence_penalty=column("presence_penalty", 0.0),
            frequency_penalty=column("frequency_penalty", 0.0),
            repetition_penalty=column("repetition_penalty", 1.0),
            output_token_counts=None,
            prompt_or_output_mask=None,
            suppress_mask=None,
            generators=list(generators),
            max_num_logprobs=max(wanted) if wanted else None,
            all_greedy=not any(temperatures),
        )

        if batch.presence_penalty is not None or batch.frequency_penalty is not None:
            batch.output_token_counts = torch.zeros(b, vocab_size, dtype=torch.int32, device=device)
            rows, toks = _flat_index(output_token_ids, device)
            batch.output_token_counts.index_put_(
                (rows, toks), torch.ones_like(toks, dtype=torch.int32), accumulate=True
            )

        if batch.repetition_penalty is not None:
            seen = torch.zeros(b, vocab_size, dtype=torch.bool, device=device)
            for histories in (prompt_token_ids, output_token_ids):
                rows, toks = _flat_index(histories, device)
                seen[rows, toks] = True
            batch.prompt_or_output_mask = seen

        if suppress_token_ids is not None and any(suppress_token_ids):
            batch.suppress_mask = torch.zeros(b, vocab_size, dtype=torch.bool, device=device)
            rows, toks = _flat_index(suppress_token_ids, device)
            batch.suppress_mask[rows, toks] = True
        batch.logprob_token_ids = _padded_ids([p.logprob_token_ids or [] for p in params], device)
        return batch


# Per-request knobs as rows of one float64 table [_NUM_KNOBS, B] (float64 holds every value,
# top_k and logprobs included, exactly): gathered and tested for neutrality with numpy, not per row.
_TEMPERATURE, _TOP_P, _MIN_P, _PRESENCE, _FREQUENCY, _REPETITION, _TOP_K, _LOGPROBS = range(8)
_NUM_KNOBS = 8
# The value that makes a knob a no-op (None in the batch when every row has it).
_NEUTRAL = np.array([np.nan, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, -1.0])


def _knob_row(p: SamplingParams) -> tuple[float, ...]:
    return (
        0.0 if p.is_greedy else p.temperature,
        p.top_p,
        p.min_p,
        p.presence_penalty,
        p.frequency_penalty,
        p.repetition_penalty,
        p.top_k,
        -1 if p.logprobs is None else p.logprobs,
    )


def _active_knobs(knobs: np.ndarray) -> np.ndarray:
    """[_NUM_KNOBS] 0/1: which knobs of one row's column are not neutral (temperature: not greedy)."""
    active = (knobs != _NEUTRAL).astype(np.int64)
    active[_TEMPERATURE] = knobs[_TEMPERATURE] != 0.0
    return active


def _batch_from_knobs(
    knobs: np.ndarray, generators: list[torch.Generator | None], device: torch.device | str
) -> SamplingBatch:
    """A SamplingBatch without histories or masks from a [_NUM_KNOBS, B] knob table: one host→device
    copy for all the float knobs that some row uses (temperature always)."""
    active = (knobs != _NEUTRAL[:, None]).any(axis=1)
    active[_TEMPERATURE] = True
    floats = [k for k in (_TEMPERATURE, _TOP_P, _MIN_P, _PRESENCE, _FREQUENCY, _REPETITION) if active[k]]
    table = to_device(knobs[floats].astype(np.float32), device)
    column = dict(zip(floats, table))
    top_k = None
    if active[_TOP_K]:
        top_k = to_device(knobs[_TOP_K].astype(np.int64), device)
    max_logprobs = int(knobs[_LOGPROBS].max()) if knobs.shape[1] else -1
    return SamplingBatch(
        temperature=column[_TEMPERATURE],
        top_k=top_k,
        top_p=column.get(_TOP_P),
        min_p=column.get(_MIN_P),
        presence_penalty=column.get(_PRESENCE),
        frequency_penalty=column.get(_FREQUENCY),
        repetition_penalty=column.get(_REPETITION),
        output_token_counts=None,
        prompt_or_output_mask=None,
        suppress_mask=None,
        generators=generators,
        max_num_logprobs=max_logprobs if max_logprobs >= 0 else None,
        all_greedy=not knobs[_TEMPERATURE].any(),
    )


def _padded_ids(ids_per_row: list[list[int]], device: torch.device | str) -> Tensor | None:
    """[B, L] int64 of ragged id lists padded with 0 (L the longest), or None when every list is empty."""
    width = max(map(len, ids_per_row), default=0)
    if not width:
        return None
    table = np.zeros((len(ids_per_row), width), dtype=np.int64)
    for row, ids in enumerate(ids_per_row):
        table[row, : len(ids)] = ids
    return to_device(table, device)


def _flat_index(ids_per_row: Sequence[Sequence[int]], device: torch.device | str) -> tuple[Tensor, Tensor]:
    """(row index, token id) pairs of a ragged list, as two [N] int64 tensors on `device`."""
    lengths = np.fromiter(map(len, ids_per_row), dtype=np.int64, count=len(ids_per_row))
    # Flattened in C (no per-token Python bytecode), then moved in one copy each.
    toks = np.fromiter(itertools.chain.from_iterable(ids_per_row), dtype=np.int64, count=int(lengths.sum()))
    rows = np.repeat(np.arange(len(ids_per_row), dtype=np.int64), lengths)
    return to_device(rows, device), to_device(toks, device)


class SamplingState:
    """Sampling rows that persist across steps, one per live request, so a step's `SamplingBatch`
    costs a gather instead of a rebuild.

    Use (the model runner): `add(request_id, params, prompt_token_ids, generator=...)` when a
    request first arrives, `batch(request_ids)` each step for the rows that sample, in row order,
    then `update(sampled_token_ids)` with the sampler's output for those same rows, and
    `remove(request_id)` when the request ends. A preempted request keeps its row (its output
    history is kept too). Rows grow past `capacity` if needed (preempted requests keep theirs
    while new ones arrive).

    Knobs live in a host table (float64, like `build`); the repetition penalty's seen-token mask
    [rows, V] bool and the frequency/presence penalties' output-token counts [rows, V] int32 are
    device tensors allocated the first time a request needs them, seeded from the prompt (mask)
    or the given output (both) on `add`, and updated by `update` with one scatter each (every
    row of the step is updated: a row whose penalty is neutral ignores both, exactly).
    `min_tokens` suppression needs only the number of outputs, counted on the host.
    """

    def __init__(
        self,
        capacity: int,
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Sequence[int] = (),
        seed: int = 0,
    ):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # Unseeded rows draw from this, seeded with the engine's seed: as reproducible as torch's default
        # generator after `manual_seed(seed)`, and never in a graph capture's hands (`SamplingBatch.unseeded`).
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.eos_token_ids = list(eos_token_ids)
        self.capacity = 0
        self._knobs = np.zeros((_NUM_KNOBS, 0))
        self._num_output = np.zeros(0, dtype=np.int64)
        self._min_tokens = np.zeros(0, dtype=np.int64)
        self._suppress: list[list[int]] = []  # per row: eos + stop ids (min_tokens rows)
        self._chosen: dict[int, list[int]] = {}  # row -> its logprob_token_ids (rows that have them)
        self._generators: list[torch.Generator | None] = []
        self._num_seeded = 0
        self._num_min_tokens = 0
        # Live rows whose knob k is not neutral (temperature: not greedy): knobs no live row uses
        # are not even looked at in batch().
        self._num_live_active = np.zeros(_NUM_KNOBS, dtype=np.int64)
        self._row: dict[str, int] = {}
        self._free: list[int] = []
        self._seen: Tensor | None = None  # [capacity, V] bool
        self._counts: Tensor | None = None  # [capacity, V] int32
        self._last_rows: Tensor | None = None  # the rows of the last batch(), on the device
        self._last_rows_np: np.ndarray | None = None
        self._zeros: Tensor | None = None  # float32 zeros on the device: all-greedy temperatures
        self._grow(max(1, capacity))

    def __len__(self) -> int:
        return len(self._row)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._row

    def _grow(self, capacity: int) -> None:
        extra = capacity - self.capacity
        self._knobs = np.concatenate([self._knobs, np.zeros((_NUM_KNOBS, extra))], axis=1)
        self._num_output = np.concatenate([self._num_output, np.zeros(extra, dtype=np.int64)])
        self._min_tokens = np.concatenate([self._min_tokens, np.zeros(extra, dtype=np.int64)])
        self._suppress += [[] for _ in range(extra)]
        self._generators += [None] * extra
        self._free += range(capacity - 1, self.capacity - 1, -1)  # lowest row first
        if self._seen is not None:
            self._seen = torch.cat([self._seen, self._seen.new_zeros(extra, self.vocab_size)])
        if self._counts is not None:
            self._counts = torch.cat([self._counts, self._counts.new_zeros(extra, self.vocab_size)])
        self.capacity = capacity

    def add(
        self,
        request_id: str,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int] = (),
        generator: torch.Generator | None = None,
    ) -> None:
        """Start a request's row. `generator`: its seeded RNG on this device (None = the global RNG).
        Raising leaves the state as it was (no row taken, no count moved): the runner then fails
        this one request and carries on."""
        assert request_id not in self._row, f"request {request_id} already has a sampling row"
        knobs = _knob_row(params)
        if not self._free:
            self._grow(2 * self.capacity)
        row = self._free[-1]
        # The device writes first: they are what can raise (a bad token id).
        if knobs[_REPETITION] != 1.0 or self._seen is not None:
            if self._seen is None:
                self._seen = torch.zeros(self.capacity, self.vocab_size, dtype=torch.bool, device=self.device)
            self._seen[row] = False
            if knobs[_REPETITION] != 1.0:
                ids = to_device(list(prompt_token_ids) + list(output_token_ids), self.device, torch.int64)
                self._seen[row, ids] = True
        if knobs[_PRESENCE] != 0.0 or knobs[_FREQUENCY] != 0.0 or self._counts is not None:
            if self._counts is None:
                self._counts = torch.zeros(self.capacity, self.vocab_size, dtype=torch.int32, device=self.device)
            self._counts[row] = 0
            if output_token_ids:
                ids = to_device(list(output_token_ids), self.device, torch.int64)
                self._counts[row].index_put_((ids,), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
        self._free.pop()
        self._row[request_id] = row
        self._knobs[:, row] = knobs
        self._num_output[row] = len(output_token_ids)
        self._min_tokens[row] = params.min_tokens
        self._suppress[row] = self.eos_token_ids + list(params.stop_token_ids) if params.min_tokens else []
        self._num_min_tokens += params.min_tokens > 0
        self._generators[row] = generator
        self._num_seeded += generator is not None
        self._num_live_active += _active_knobs(self._knobs[:, row])
        if params.logprob_token_ids:
            self._chosen[row] = list(params.logprob_token_ids)

    def remove(self, request_id: str) -> None:
        """End a request's row (unknown ids are ignored: the runner may finish a request it never sampled)."""
        row = self._row.pop(request_id, None)
        if row is None:
            return
        self._num_seeded -= self._generators[row] is not None
        self._num_live_active -= _active_knobs(self._knobs[:, row])
        self._num_min_tokens -= bool(self._min_tokens[row])
        self._generators[row] = None
        self._min_tokens[row] = 0
        self._suppress[row] = []
        self._chosen.pop(row, None)
        self._free.append(row)

    def _greedy_temperatures(self, rows: int) -> Tensor:
        """[rows] float32 zeros on the device, from one cached buffer: an all-greedy step (the batch-1
        serving case) then copies nothing to the device for sampling."""
        if self._zeros is None or self._zeros.numel() < rows:
            self._zeros = torch.zeros(max(rows, self.capacity), dtype=torch.float32, device=self.device)
        return self._zeros[:rows]

    def batch(self, request_ids: Sequence[str]) -> SamplingBatch:
        """The SamplingBatch of these requests (one row each, in this order) for this step."""
        row_of = self._row
        rows_np = np.fromiter((row_of[r] for r in request_ids), dtype=np.int64, count=len(request_ids))
        generators = [self._generators[r] for r in rows_np.tolist()] if self._num_seeded else [None] * len(rows_np)
        if self._num_live_active[_TOP_P:].any():
            batch = _batch_from_knobs(self._knobs[:, rows_np], generators, self.device)
        else:
            # Common case: only temperatures differ between live rows (greedy and/or plain sampling).
            temperature = self._knobs[_TEMPERATURE, rows_np]
            all_greedy = not self._num_live_active[_TEMPERATURE] or not temperature.any()
            batch = SamplingBatch(
                self._greedy_temperatures(len(rows_np))
                if all_greedy
                else to_device(temperature.astype(np.float32), self.device),
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                generators,
                None,
                all_greedy,
            )
        rows = None
        if (
            batch.repetition_penalty is not None
            or batch.presence_penalty is not None
            or batch.frequency_penalty is not None
            or self._seen is not None
            or self._counts is not None
        ):
            rows = to_device(rows_np, self.device)
        if batch.repetition_penalty is not None:
            assert self._seen is not None
            batch.prompt_or_output_mask = self._seen.index_select(0, rows)
        if batch.presence_penalty is not None or batch.frequency_penalty is not None:
            assert self._counts is not None
            batch.output_token_counts = self._counts.index_select(0, rows)
        if self._num_min_tokens:
            waiting = np.flatnonzero(self._num_output[rows_np] < self._min_tokens[rows_np])
            suppress = [self._suppress[row] for row in rows_np[waiting].tolist()]
            if any(suppress):
                rows_s, toks = _flat_index(suppress, self.device)
                mask = torch.zeros(len(rows_np), self.vocab_size, dtype=torch.bool, device=self.device)
                mask[to_device(waiting, self.device)[rows_s], toks] = True
                batch.suppress_mask = mask
        if self._chosen:
            batch.logprob_token_ids = _padded_ids([self._chosen.get(row, []) for row in rows_np.tolist()], self.device)
        self._last_rows, self._last_rows_np = rows, rows_np
        batch.unseeded = self.generator
        return batch

    def update(self, sampled_token_ids: Tensor, earlier: tuple[Tensor, Tensor] | None = None) -> None:
        """Record the tokens just sampled for the rows of the last `batch()` ([B] int64, on the device).
        `earlier`: tokens a row produced this step before its last one (accepted speculative proposals),
        [B, J] int64 with [B, J] bool saying which are real: they join the penalties' histories. They are
        not counted for min_tokens (a row only speculates once min_tokens is met)."""
        rows_np = self._last_rows_np
        assert rows_np is not None and sampled_token_ids.shape == (len(rows_np),), "update() needs the last batch()"
        self._num_output[rows_np] += 1
        if earlier is not None and (self._seen is not None or self._counts is not None):
            tokens, keep = earlier
            # Padding points at the row's last token, which is recorded below anyway (and counts 0 here).
            tokens = torch.where(keep, tokens, sampled_token_ids[:, None])
            rows = to_device(rows_np, self.device)[:, None].expand_as(tokens)
            if self._seen is not None:
                self._seen[rows, tokens] = True
            if self._counts is not None:
                self._counts.index_put_((rows, tokens), keep.to(torch.int32), accumulate=True)
        if self._seen is not None:
            self._seen[self._last_rows, sampled_token_ids] = True
        if self._counts is not None:
            self._counts.index_put_(
                (self._last_rows, sampled_token_ids),
                torch.ones_like(sampled_token_ids, dtype=torch.int32),
                accumulate=True,
            )
        self._last_rows = self._last_rows_np = None


@dataclass
class SamplerOutput:
    sampled_token_ids: Tensor  # [B] int64
    sampled_logprobs: Tensor | None  # [B] float32 logprob of the sampled token, raw distribution
    top_logprobs: Tensor | None  # [B, K] float32, K = max_num_logprobs, sorted descending, raw distribution
    top_token_ids: Tensor | None  # [B, K] int64
    chosen_logprobs: Tensor | None = None  # [B, L] float32: SamplingBatch.logprob_token_ids' raw logprobs


_PENALISED_LIMIT = 1e30


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
        # A penalty far from 1 can overflow float32 (30 / 1e-38): bounded to ±_PENALISED_LIMIT, which
        # the temperature (>= 1e-5) cannot push past float32 either, so no +inf (NaN after softmax)
        # appears; tokens already at -inf (grammar-masked) stay there.
        penalised = torch.where(x > 0, x / rp, x * rp).clamp_(-_PENALISED_LIMIT, _PENALISED_LIMIT)
        x = torch.where(batch.prompt_or_output_mask & (x > float("-inf")), penalised, x)
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


def _no_penalties(batch: SamplingBatch) -> bool:
    return (
        batch.repetition_penalty is None
        and batch.frequency_penalty is None
        and batch.presence_penalty is None
        and batch.suppress_mask is None
    )


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
    q = torch.empty(shape, dtype=torch.float32, device=device).exponential_(generator=batch.unseeded)
    for i, g in enumerate(batch.generators):
        if g is not None:
            # Drawn as a fresh [V] vector so the row's stream depends only on its seed and step.
            q[i] = torch.empty(shape[1], dtype=torch.float32, device=device).exponential_(generator=g)
    # exponential_ can return exactly 0; probs/0 would give inf or nan (argmax picks nan).
    # tiny keeps probs/q <= 1/tiny, still finite in float32.
    return q.clamp_min_(torch.finfo(torch.float32).tiny)


class Sampler(nn.Module):
    """Stateless: all per-request state arrives in the `SamplingBatch`."""

    def forward(
        self, logits: Tensor, batch: SamplingBatch, token_bitmask: tuple[Tensor, list[int]] | None = None
    ) -> SamplerOutput:
        """logits [B, V] of any float dtype; all math in float32. token_bitmask: the grammar masks of
        the constrained rows (`layers.token_mask`), applied before everything else; logprobs stay those
        of the unmasked distribution."""
        unmasked = logits
        if token_bitmask is not None:
            logits = apply_token_bitmask(logits, *token_bitmask)
        if batch.all_greedy and batch.max_num_logprobs is None and _no_penalties(batch):
            # Widening to float32 is exact and order-preserving, so the argmax (first maximum on
            # ties) is the same without the [B, V] float32 copy of a 135k vocabulary at B=256, the
            # plain greedy/ignore-eos benchmark case (benchmarks/h200.py).
            return SamplerOutput(logits.argmax(dim=-1), None, None, None)
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
        logprobs = (raw if token_bitmask is None else unmasked.float()).log_softmax(dim=-1)
        sampled_lp = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        top_lp, top_ids = logprobs.topk(batch.max_num_logprobs, dim=-1, sorted=True)
        chosen = None if batch.logprob_token_ids is None else logprobs.gather(1, batch.logprob_token_ids)
        return SamplerOutput(token_ids, sampled_lp, top_lp, top_ids, chosen)
