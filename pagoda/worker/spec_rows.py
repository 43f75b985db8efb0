"""A step's speculative rows in the runner: inputs that carry each row's proposals, the logits positions
that verify them, and the verification itself (`pagoda/spec_decode/rejection.py`).

A row with d proposals computes 1 + d tokens: its last known token, then the proposals. The model's output at
those 1 + d positions checks proposal 0 .. d - 1 and gives one token more. Rows without proposals in the same
step sample as always (`Sampler`, with grammar masks, logprobs and seeds); only proposal rows go through
verification, which the engine allows only for rows without a seed or logprob_token_ids
(`engine/speculation.py`). A constrained row's positions are masked with what its grammar allows after the
proposals before each (`GrammarManager.fill` with proposals), so a proposal the grammar refuses is rejected. A
proposal row that asks for logprobs gets them for every token it keeps, from the model's raw distribution at
that token's position, as the sampler gives them. Penalties apply at every verified position with the history
that position would have had decoding one token a step: the proposals before it count as output there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagoda import envs
from pagoda.device_copy import to_device
from pagoda.kernels import dispatch
from pagoda.layers.attention import AttentionBatch
from pagoda.layers.sampler import Sampler, SamplerOutput, SamplingBatch, SamplingState, apply_filters, apply_penalties
from pagoda.layers.token_mask import apply_token_bitmask
from pagoda.outputs import SchedulerOutput
from pagoda.sampling_params import GREEDY_TEMPERATURE_EPS
from pagoda.spec_decode.rejection import rejection_sample, verify_greedy
from pagoda.worker.request_states import RunnerRequestState
from pagoda.worker.step_inputs import SpecRows, StepInputs, StepInputsBuilder

if TYPE_CHECKING:
    from pagoda.worker.pipeline_link import PipelineLink
    from pagoda.worker.state_slots import StateSlotPool


LEAN_GREEDY = envs.SPEC_LEAN_GREEDY.value  # read once: the switch is set before the process starts


@dataclass
class Verified:
    """A speculative step's tokens per sampling row: the proposals that held, then the row's own token."""

    tokens: torch.Tensor  # [S, K + 1] int64, -1 past each row's count
    counts: torch.Tensor  # [S] tokens per row: 1 + the proposals that held
    # Rows that asked for logprobs: each position's token logprob [S, K + 1], top logprobs and ids
    # [S, K + 1, W] (W: the most any row asked for); None when no proposal row asked.
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def earlier(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' tokens before their last one ([S, K]) and which are real ([S, K] bool): what
        `SamplingState.update` adds to the penalties' histories besides the last tokens."""
        k = self.tokens.shape[1] - 1
        keep = torch.arange(k, device=self.tokens.device)[None, :] < (self.counts - 1)[:, None]
        return self.tokens[:, :k], keep


def build_inputs(
    builder: StepInputsBuilder,
    scheduled: dict[str, int],
    states: list[RunnerRequestState],
    so: SchedulerOutput,
    last_sampled: torch.Tensor | None,
    state_pool: StateSlotPool | None = None,
) -> StepInputs:
    """The step's inputs (rows: `scheduled`'s requests, its token counts; `states` theirs, in order); a row
    with proposals has them after its known tokens (appended to its state's tokens only while the inputs
    are built: they are not known tokens). A stateful model keeps the state after each position of a
    proposal row (`state_writes`), to roll back to (`roll_back_states`)."""
    request_ids, query_lens = list(scheduled), list(scheduled.values())
    spec = so.spec_token_ids
    if not spec:
        return builder.build(request_ids, states, query_lens, so.sampling_request_ids, last_sampled)
    by_id = dict(zip(request_ids, states))
    for request_id, proposals in spec.items():
        by_id[request_id].token_ids.extend(proposals)
    try:
        inputs = builder.build(request_ids, states, query_lens, so.sampling_request_ids, last_sampled)
    finally:
        for request_id, proposals in spec.items():
            del by_id[request_id].token_ids[-len(proposals) :]
    rows = inputs.sample_rows.tolist()
    proposals = [spec.get(request_ids[i], []) for i in rows]
    params = [states[i].sampling_params for i in rows]
    greedy = np.array([p.temperature < GREEDY_TEMPERATURE_EPS for p in params], dtype=bool)
    penalized = np.array(
        [p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params],
        dtype=bool,
    )
    wanted = np.array([-1 if p.logprobs is None else p.logprobs for p in params], dtype=np.int64)
    inputs.spec = SpecRows(np.fromiter(map(len, proposals), np.int64, len(rows)), proposals, greedy, penalized, wanted)
    if state_pool is not None and state_pool.spec_positions:
        counts = inputs.spec.counts + 1
        with_proposals = np.repeat(inputs.spec.counts > 0, counts)  # rows without proposals keep their own write
        ids = state_pool.spec_ids(np.repeat(np.arange(len(rows)), counts), _offsets_in_rows(counts))
        inputs.state_writes = (logits_positions(inputs)[with_proposals], ids[with_proposals])
    return inputs


def attention_batch(inputs: StepInputs, block_size: int, device: torch.device) -> AttentionBatch:
    """The step's attention batch. On the CPU a step whose tokens can run as rows (`StepInputs.tokens_as_rows`)
    runs each as a decode row of its own, attended as a one-token step attends it (`AttentionBatch.rows_alone`).
    Every other part of a layer gives each row what a one-row step gives it (the 4-bit matmuls too), so greedy
    speculation keeps a plain step's values there, bf16 activations and all; attending the verified tokens
    together rounds differently and flips near ties."""
    query_start_loc, seq_lens, tables = inputs.query_start_loc, inputs.seq_lens, inputs.block_tables
    alone = device.type == "cpu" and inputs.tokens_as_rows
    if alone:
        tables = np.repeat(tables, inputs.query_lens, axis=0)
        query_start_loc, seq_lens = np.arange(inputs.num_tokens + 1), inputs.positions + 1
    return AttentionBatch(
        query_lens=np.diff(query_start_loc).tolist(),
        seq_lens=seq_lens.tolist(),
        query_start_loc=to_device(query_start_loc, device),
        seq_lens_tensor=to_device(seq_lens, device),
        block_tables=to_device(tables, device),
        slot_mapping=to_device(inputs.slots, device),
        block_size=block_size,
        rows_alone=alone,
    )


def roll_back_states(pool: StateSlotPool, states: list[RunnerRequestState], spec: SpecRows, verified: Verified) -> None:
    """Each proposal row's state slot back to the state after its last kept token (entry `counts - 1` of the
    row's positions; `states`: the sampling rows')."""
    rows = np.flatnonzero(spec.counts > 0)
    if not len(rows):
        return
    device = verified.counts.device
    slots = to_device([states[i].state_slot for i in rows.tolist()], device, torch.int64)
    kept = verified.counts[to_device(rows, device)] - 1
    pool.roll_back(slots, to_device(pool.spec_ids(rows, np.zeros_like(rows)), device) + kept)


def logits_positions(inputs: StepInputs) -> np.ndarray:
    """Flat token indices whose logits the step needs: each sampling row's last token, and for a row with d
    proposals its last 1 + d tokens (in order)."""
    ends = inputs.query_start_loc[1:][inputs.sample_rows]
    if inputs.spec is None:
        return ends - 1
    counts = inputs.spec.counts + 1
    return np.repeat(ends - counts, counts) + _offsets_in_rows(counts)


def _offsets_in_rows(counts: np.ndarray) -> np.ndarray:
    """0, 1, ..., counts[0] - 1, 0, 1, ..., counts[1] - 1, ...: each position's place in its row."""
    return np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)


def sample(
    sampler: Sampler,
    sampling: SamplingState,
    logits: torch.Tensor,
    request_ids: list[str],
    spec: SpecRows,
    token_bitmask,
) -> tuple[SamplerOutput, Verified]:
    """logits [sum(1 + d), V] in `logits_positions` order. Returns the SamplerOutput of every row's last token
    ([S]; logprobs only for ordinary rows), and the rows' verified tokens (`Verified`)."""
    device = logits.device
    counts = spec.counts
    if LEAN_GREEDY and token_bitmask is None and _plain_greedy(spec):
        return _sample_greedy(sampling, logits, request_ids, spec)
    plain, speculative = np.flatnonzero(counts == 0), np.flatnonzero(counts > 0)
    rows, k = len(counts), int(counts.max())
    spec_mask = None
    if token_bitmask is not None:  # [S * (K + 1)] positions' masks: the plain rows' first, renumbered
        mask, masked = token_bitmask
        constrained = set(masked)
        plain_first = plain * (k + 1)
        token_bitmask = (
            mask[torch.from_numpy(plain_first)],
            [i for i, f in enumerate(plain_first.tolist()) if f in constrained],
        )
        flat = (speculative[:, None] * (k + 1) + np.arange(k + 1)[None, :]).reshape(-1)
        spec_masked = [i for i, f in enumerate(flat.tolist()) if f in constrained]
        if spec_masked:
            spec_mask = (mask[torch.from_numpy(flat)], spec_masked)
    grid = logits[to_device(_positions(counts, k), device)].view(rows, k + 1, -1)
    last = torch.empty(rows, dtype=torch.int64, device=device)
    out = None
    if len(plain):  # ordinary rows: the sampler over their one position
        plain_rows = to_device(plain, device)
        out = sampler(grid[plain_rows, 0], sampling.batch([request_ids[i] for i in plain.tolist()]), token_bitmask)
        last[plain_rows] = out.sampled_token_ids
    tokens = torch.full((rows, k + 1), -1, dtype=torch.int64, device=device)
    num = torch.ones(rows, dtype=torch.int64, device=device)
    tokens[:, 0] = last
    spec_rows = to_device(speculative, device)
    spec_ids = [request_ids[i] for i in speculative.tolist()]
    drafts = to_device(  # pinned: a pageable copy would wait for the step's forward pass
        [spec.proposals[i] + [-1] * (k - len(spec.proposals[i])) for i in speculative.tolist()], device, torch.int64
    )
    n_drafts = to_device(counts[speculative], device)
    g = grid[spec_rows]  # [R, K + 1, V]
    if spec_mask is not None:  # a grammar: each position allows what follows the proposals before it
        g = apply_token_bitmask(g.reshape(len(speculative) * (k + 1), -1), *spec_mask).view_as(g)
    greedy, penalized = spec.greedy[speculative], bool(spec.penalized[speculative].any())
    batch = None
    if penalized or not greedy.all():  # every position with its row's knobs (each row's repeated)
        batch = sampling.batch([rid for rid in spec_ids for _ in range(k + 1)])
    if penalized:
        assert batch is not None
        _count_earlier_proposals(batch, [spec.proposals[i] for i in speculative.tolist()], k)
        g = apply_penalties(g.reshape(len(spec_ids) * (k + 1), -1), batch).view_as(g)
    t, n = verify_greedy(g.argmax(dim=-1), drafts, n_drafts)
    if not greedy.all():  # sampled rows: their distribution at every position
        assert batch is not None
        probs = apply_filters(g.reshape(len(spec_ids) * (k + 1), -1), batch).softmax(dim=-1).view_as(g)
        ts, ns = rejection_sample(probs, drafts, n_drafts, generator=sampling.generator)
        on_device = to_device(greedy, device)
        t, n = torch.where(on_device[:, None], t, ts), torch.where(on_device, n, ns)
    tokens[spec_rows], num[spec_rows] = t, n
    last[spec_rows] = t.gather(1, (n - 1)[:, None]).squeeze(1)
    sampling.batch(request_ids)  # `update` records every row's last token
    logprobs = _position_logprobs(grid, t, spec_rows, spec.logprobs[speculative], rows)  # unmasked, as the sampler
    return _with_logprobs(out, last, plain, logprobs, num), Verified(tokens, num, logprobs)


def _positions(counts: np.ndarray, k: int) -> np.ndarray:
    """[S * (K + 1)] logits rows of each sampling row's K + 1 positions (`logits_positions` order), a row with fewer
    proposals repeating its last position."""
    first = np.cumsum(counts + 1) - (counts + 1)  # each row's first logits row
    return (first[:, None] + np.minimum(np.arange(k + 1)[None, :], counts[:, None])).reshape(-1)


def _plain_greedy(spec: SpecRows) -> bool:
    """Every row greedy with proposals, none with penalties or logprobs: `_sample_greedy` verifies them."""
    plain = (spec.counts > 0) & spec.greedy & ~spec.penalized & (spec.logprobs < 0)
    return bool(plain.all())


def _sample_greedy(
    sampling: SamplingState, logits: torch.Tensor, request_ids: list[str], spec: SpecRows
) -> tuple[SamplerOutput, Verified]:
    """`sample` for a step of greedy proposal rows only (`_plain_greedy`), no grammar: one argmax over every
    position, the proposals that match the model's tokens, and each row's tokens the model's own up to the first
    mismatch: on a GPU one Triton launch (`kernels/spec_verify.py`) after the argmax and one small pinned copy,
    else `verify_greedy`'s dozen; the general path's gathers of logits rows, per-row bookkeeping and scatters take
    ~40 (a speculating step is read before the next one is scheduled, so its host time is not hidden). Same tokens
    as the general path."""
    device = logits.device
    counts = spec.counts
    rows, k = len(counts), int(counts.max())
    if (counts == k).all():  # logits rows are [R, K + 1] already, in order
        target = logits.argmax(dim=-1).view(rows, k + 1)
    else:
        target = logits.argmax(dim=-1)[to_device(_positions(counts, k), device)].view(rows, k + 1)
    drafts = to_device(  # pinned: a pageable copy would wait for the step's forward pass
        np.array([row + [-1] * (k - len(row)) for row in spec.proposals], dtype=np.int64).reshape(rows, k), device
    )
    kernel = dispatch.spec_verify_for(target)
    if kernel is not None:  # one launch (`kernels/spec_verify.py`): -1 padding never matches, no counts needed
        tokens, num, last = kernel.verify_greedy(target, drafts)
    else:
        tokens, num = verify_greedy(target, drafts, to_device(counts, device))
        last = target.gather(1, (num - 1)[:, None]).squeeze(1)
    sampling.batch(request_ids)  # `update` records every row's last token
    return SamplerOutput(last, None, None, None), Verified(tokens, num, None)


def shared_tokens(out: SamplerOutput, verified: Verified | None) -> torch.Tensor:
    """What the driver sends the other ranks of a step: the sampled tokens [S]; with proposals [S, K + 3] (the
    last token, the row's count, its verified tokens), so that every rank keeps the tokens that held."""
    if verified is None:
        return out.sampled_token_ids
    return torch.cat([out.sampled_token_ids[:, None], verified.counts[:, None], verified.tokens], dim=1)


def driver_tokens(link: PipelineLink, rows: int, spec: SpecRows | None) -> tuple[SamplerOutput, Verified | None]:
    """On a rank other than the driver: the step's tokens as the driver shared them (`shared_tokens`)."""
    if spec is None:
        return SamplerOutput(link.driver_tokens(rows), None, None, None), None
    got = link.driver_tokens(rows, int(spec.counts.max()) + 3)
    return SamplerOutput(got[:, 0], None, None, None), Verified(got[:, 2:], got[:, 1])


def _count_earlier_proposals(batch: SamplingBatch, proposals: list[list[int]], k: int) -> None:
    """Position j of a row (row-major [R, K + 1] batch rows) decodes after the row's proposals 0 .. j - 1:
    add them to that position's penalty history (the batch's own copies of the rows' masks and counts)."""
    flat, toks = [], []
    for r, row in enumerate(proposals):
        for j in range(1, len(row) + 1):
            flat += [r * (k + 1) + j] * j
            toks += row[:j]
    if not flat:
        return
    mask, counts = batch.prompt_or_output_mask, batch.output_token_counts
    some = mask if mask is not None else counts
    if some is None:
        return
    device = some.device
    index = (to_device(flat, device, torch.int64), to_device(toks, device, torch.int64))
    if mask is not None:
        mask[index] = True
    if counts is not None:
        counts.index_put_(index, torch.ones_like(index[0], dtype=torch.int32), accumulate=True)


def _position_logprobs(
    grid: torch.Tensor, t: torch.Tensor, spec_rows: torch.Tensor, wanted: np.ndarray, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Logprobs (raw distribution, as the sampler's) of the proposal rows' tokens at every position, laid out
    over all S rows; None when no proposal row asked for any. wanted: [R] each proposal row's count, -1: none."""
    if not len(wanted) or wanted.max() < 0:
        return None
    width = int(wanted.max())
    raw = grid[spec_rows].float().log_softmax(dim=-1)  # [R, K + 1, V]
    chosen = raw.gather(2, t.clamp(min=0)[..., None]).squeeze(2)
    top_lp, top_ids = raw.topk(width, dim=-1, sorted=True)
    positions = grid.shape[1]
    full = (
        chosen.new_zeros(rows, positions),
        top_lp.new_zeros(rows, positions, width),
        top_ids.new_zeros(rows, positions, width),
    )
    for tensor, part in zip(full, (chosen, top_lp, top_ids)):
        tensor[spec_rows] = part
    return full


def _with_logprobs(
    out: SamplerOutput | None,
    last: torch.Tensor,
    plain: np.ndarray,
    spec_logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    num: torch.Tensor,
) -> SamplerOutput:
    """Every row's token and, where rows asked, the logprobs of that token: the ordinary rows' from the
    sampler, the proposal rows' at their last kept position."""
    plain_lp = out is not None and out.sampled_logprobs is not None
    if not plain_lp and spec_logprobs is None:
        return SamplerOutput(last, None, None, None)
    rows = len(last)
    width = max(
        out.top_logprobs.shape[1] if plain_lp and out.top_logprobs is not None else 0,  # type: ignore[union-attr]
        spec_logprobs[1].shape[2] if spec_logprobs is not None else 0,
    )
    sampled = torch.zeros(rows, dtype=torch.float32, device=last.device)
    top_lp = torch.zeros(rows, width, dtype=torch.float32, device=last.device)
    top_ids = torch.zeros(rows, width, dtype=torch.int64, device=last.device)
    chosen = None
    if spec_logprobs is not None:  # every row's last position (ordinary rows: overwritten below)
        at = (num - 1)[:, None]
        sampled = spec_logprobs[0].gather(1, at).squeeze(1)
        w = spec_logprobs[1].shape[2]
        top_lp[:, :w] = spec_logprobs[1].gather(1, at[..., None].expand(-1, 1, w)).squeeze(1)
        top_ids[:, :w] = spec_logprobs[2].gather(1, at[..., None].expand(-1, 1, w)).squeeze(1)
    if plain_lp:
        assert out is not None and out.sampled_logprobs is not None
        idx = to_device(plain, last.device)
        sampled[idx] = out.sampled_logprobs
        if out.top_logprobs is not None and out.top_token_ids is not None:
            w = out.top_logprobs.shape[1]
            top_lp[idx, :w], top_ids[idx, :w] = out.top_logprobs, out.top_token_ids
        if out.chosen_logprobs is not None:
            chosen = out.chosen_logprobs.new_zeros((rows, *out.chosen_logprobs.shape[1:]))
            chosen[idx] = out.chosen_logprobs
    return SamplerOutput(last, sampled, top_lp, top_ids, chosen)
