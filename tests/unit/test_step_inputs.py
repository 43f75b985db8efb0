"""`StepInputsBuilder` against a naive construction, token by token, of what a step's rows ask for:
pure decode steps (the vectorised path) and mixed steps (prefill chunks among decodes), pending tokens
filled on the device, state slots, M-RoPE positions and the rows the scheduler says sample."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagoda.inputs import MultiModalInputs, MultiModalItem
from pagoda.sampling_params import SamplingParams
from pagoda.worker.request_states import RunnerRequestState
from pagoda.worker.step_inputs import StepInputsBuilder

BS = 4


def _state(rng: random.Random, decode: bool, next_block: list[int]) -> tuple[RunnerRequestState, int]:
    """A request mid-flight and how many tokens this step computes for it."""
    known = rng.randint(1, 30)
    pending = rng.random() < 0.4 and known > 1
    if decode:
        computed, query = known - 1 + pending, 1
    else:
        computed = rng.randint(0, known - 1)
        query = known + pending - computed
    total = computed + query
    blocks = list(range(next_block[0], next_block[0] + -(-total // BS) + rng.randint(0, 2)))
    rng.shuffle(blocks)
    next_block[0] += len(blocks)
    state = RunnerRequestState(
        [rng.randrange(1, 1000) for _ in range(known)],
        known,
        SamplingParams(),
        blocks,
        None,
        computed,
        state_slot=rng.randrange(100),
        num_pending=int(pending),
        pending_row=rng.randrange(8) if pending else -1,
    )
    return state, query


def _naive(states, query_lens, sampling_rows, last_sampled):
    ids, pos, slots, qsl, seq_lens, late = [], [], [], [0], [], []
    for s, q in zip(states, query_lens):
        for p in range(s.num_computed_tokens, s.num_computed_tokens + q):
            if p < len(s.token_ids):
                ids.append(s.token_ids[p])
            else:
                ids.append(0)
                late.append((len(ids) - 1, int(last_sampled[s.pending_row])))
            pos.append(p)
            slots.append(s.block_ids[p // BS] * BS + p % BS)
        qsl.append(qsl[-1] + q)
        seq_lens.append(s.num_computed_tokens + q)
    width = max(len(s.block_ids) for s in states)
    tables = [s.block_ids + [0] * (width - len(s.block_ids)) for s in states]
    return dict(
        token_ids=ids,
        positions=pos,
        slots=slots,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_tables=tables,
        sample_rows=sorted(sampling_rows),
        state_slots=[s.state_slot for s in states],
    ), sorted(late)


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_builder_matches_naive_construction(decode, seed):
    rng = random.Random(seed)
    next_block = [1]
    rows = [_state(rng, decode or rng.random() < 0.5, next_block) for _ in range(rng.randint(1, 8))]
    states, query_lens = [s for s, _ in rows], [q for _, q in rows]
    if not decode and all(q == 1 for q in query_lens):  # make it a mixed step
        states[0].num_computed_tokens, query_lens[0] = 0, len(states[0].token_ids) + states[0].num_pending
    ids = [f"r{i}" for i in range(len(states))]
    sampling = {rid for rid in ids if rng.random() < 0.7}
    last_sampled = torch.arange(100, 108)
    builder = StepInputsBuilder(BS, torch.device("cpu"), stateful=True, uses_mrope=False, has_encoder=False)
    got = builder.build(ids, states, query_lens, sampling, last_sampled)
    want, late = _naive(states, query_lens, [i for i, rid in enumerate(ids) if rid in sampling], last_sampled)
    for name, value in want.items():
        assert getattr(got, name).tolist() == value, name
    assert got.is_decode == (sum(query_lens) == len(states))
    if late:
        index, values = got.late_tokens
        assert sorted(zip(index.tolist(), values.tolist())) == late
    else:
        assert got.late_tokens is None
    assert got.mrope_positions is None and not got.needs_encoder


def test_stateless_model_has_no_state_slots():
    state = RunnerRequestState([5, 6, 7], 3, SamplingParams(), [1], None, 2)
    builder = StepInputsBuilder(BS, torch.device("cpu"), stateful=False, uses_mrope=False, has_encoder=False)
    got = builder.build(["a"], [state], [1], {"a"}, None)
    assert got.state_slots is None and got.token_ids.tolist() == [7] and got.sample_rows.tolist() == [0]


def test_mrope_positions_and_encoder_rows():
    """An image at prompt tokens [2, 6): its table gives (t, h, w) per prompt token; generated tokens sit at
    index + delta on all three axes; a text-only row uses plain positions."""
    table = np.stack([np.arange(8), np.arange(8) * 2, np.arange(8) * 3]).astype(np.int64)
    item = MultiModalItem("image", np.zeros((4, 3), np.uint8), (1, 2, 2), 2, 4, b"h" * 16)
    mm = MultiModalInputs([item], table, mrope_delta=-3)
    image = RunnerRequestState(list(range(10)), 8, SamplingParams(), [1, 2, 3], None, 6, mm_inputs=mm)
    text = RunnerRequestState([1, 2, 3], 3, SamplingParams(), [4], None, 2)
    builder = StepInputsBuilder(BS, torch.device("cpu"), stateful=False, uses_mrope=True, has_encoder=True)
    got = builder.build(["i", "t"], [image, text], [4, 1], {"i", "t"}, None)  # image row: tokens 6..9
    want = [[6, 7, 8 - 3, 9 - 3, 2], [12, 14, 8 - 3, 9 - 3, 2], [18, 21, 8 - 3, 9 - 3, 2]]
    assert got.mrope_positions.tolist() == want
    assert not got.needs_encoder  # tokens 6..9 are past the image
    image.num_computed_tokens = 4
    got = builder.build(["i", "t"], [image, text], [6, 1], {"i", "t"}, None)  # tokens 4..9 cut the image
    assert got.needs_encoder


def test_mrope_positions_of_a_decode_step():
    """One token per row: a row still inside its prompt's table reads the table, a row past it sits at position +
    delta on all three axes, a text-only row at its position."""
    table = np.stack([np.arange(8), np.arange(8) * 2, np.arange(8) * 3]).astype(np.int64)
    item = MultiModalItem("image", np.zeros((4, 3), np.uint8), (1, 2, 2), 2, 4, b"h" * 16)
    mm = MultiModalInputs([item], table, mrope_delta=-3)
    inside = RunnerRequestState(list(range(8)), 8, SamplingParams(), [1, 2], None, 7, mm_inputs=mm)
    past = RunnerRequestState(list(range(10)), 8, SamplingParams(), [3, 4, 5], None, 9, mm_inputs=mm)
    text = RunnerRequestState([1, 2, 3], 3, SamplingParams(), [6], None, 2)
    builder = StepInputsBuilder(BS, torch.device("cpu"), stateful=False, uses_mrope=True, has_encoder=True)
    got = builder.build(["a", "b", "c"], [inside, past, text], [1, 1, 1], {"a", "b", "c"}, None)
    assert got.mrope_positions.tolist() == [[7, 6, 2], [14, 6, 2], [21, 6, 2]]
    assert got.mrope_positions.dtype == np.int64 and got.mrope_positions.flags.c_contiguous
