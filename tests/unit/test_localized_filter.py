"""The LF gate over packed, chunked steps equals the reference two-Conv2d computation per sequence."""

from __future__ import annotations

import random

import numpy as np
import torch

from pagoda.layers.localized_filter import LocalizedFilter, reference_localized_filter
from pagoda.layers.sequence_state import SequenceStateBatch

H = 16


def _random_filter(seed: int) -> tuple[LocalizedFilter, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    conv = {
        "conv1_weight": torch.randn(H // 2, H, 2, 1, generator=g) / 4,
        "conv1_bias": torch.randn(H // 2, generator=g),
        "conv2_weight": torch.randn(H, H // 2, 2, 1, generator=g) / 3,
        "conv2_bias": torch.randn(H, generator=g),
        "norm_weight": 1 + torch.randn(H, generator=g) / 5,
    }
    lf = LocalizedFilter(H)
    lf.conv1.weight_loader(lf.conv1.weight, conv["conv1_weight"])
    lf.conv1.weight_loader(lf.conv1.bias, conv["conv1_bias"])
    lf.conv2.weight_loader(lf.conv2.weight, conv["conv2_weight"])
    lf.conv2.weight_loader(lf.conv2.bias, conv["conv2_bias"])
    lf.output_layernorm.weight.data.copy_(conv["norm_weight"])
    return lf, conv


@torch.inference_mode()
def test_packed_chunked_steps_match_the_reference_per_sequence():
    rng = random.Random(0)
    lf, conv = _random_filter(0)
    block_size, num_slots = 4, 6
    lf.bind_state(torch.full((num_slots, lf.state_width), float("nan")), torch.zeros(64, lf.state_width))
    lengths = [1, 2, 7, 13, 30]
    inputs = [torch.randn(n, H) for n in lengths]
    slots = [5, 0, 3, 1, 4]  # state slots are not batch rows
    for slot in slots:
        lf.state[slot].zero_()  # a fresh sequence's state
    expected = [reference_localized_filter(x=x, **conv) for x in inputs]
    done = [0] * len(inputs)
    outputs = [[] for _ in inputs]
    blocks = {i: [10 * i + b for b in range(8)] for i in range(len(inputs))}
    while any(d < n for d, n in zip(done, lengths)):
        rows = [i for i in range(len(inputs)) if done[i] < lengths[i]]
        rng.shuffle(rows)  # row order changes every step
        chunks = [rng.randint(1, lengths[i] - done[i]) for i in rows]
        x = torch.cat([inputs[i][done[i] : done[i] + c] for i, c in zip(rows, chunks)])
        starts = [0]
        for c in chunks:
            starts.append(starts[-1] + c)
        positions = torch.cat([torch.arange(done[i], done[i] + c) for i, c in zip(rows, chunks)])
        slot_mapping = torch.cat(
            [
                torch.tensor(
                    [blocks[i][p // block_size] * block_size + p % block_size for p in range(done[i], done[i] + c)]
                )
                for i, c in zip(rows, chunks)
            ]
        )
        batch = SequenceStateBatch.build(
            [slots[i] for i in rows],
            np.array(starts),
            positions.numpy(),
            slot_mapping.numpy(),
            block_size,
            True,
            torch.device("cpu"),
        )
        y = lf(x, batch)
        for row, (i, c) in enumerate(zip(rows, chunks)):
            outputs[i].append(y[starts[row] : starts[row + 1]])
            done[i] += c
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(torch.cat(got), want, atol=1e-5, rtol=1e-5)

    # The snapshot of a full block is the state after its last token: restoring it and continuing
    # equals the uninterrupted reference.
    seq = 4
    restart = 2 * block_size
    lf.state[2] = lf.snapshots[blocks[seq][1]]
    rest = inputs[seq][restart:]
    positions = torch.arange(restart, lengths[seq])
    slot_mapping = torch.tensor([blocks[seq][p // block_size] * block_size + p % block_size for p in positions])
    y = lf(
        rest,
        SequenceStateBatch.build(
            [2],
            np.array([0, len(rest)]),
            positions.numpy(),
            slot_mapping.numpy(),
            block_size,
            True,
            torch.device("cpu"),
        ),
    )
    torch.testing.assert_close(y, expected[seq][restart:], atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_decode_rows_read_their_own_slots():
    lf, conv = _random_filter(1)
    lf.bind_state(torch.zeros(4, lf.state_width), torch.zeros(0, lf.state_width))
    a, b = torch.randn(5, H), torch.randn(5, H)
    ref_a, ref_b = reference_localized_filter(x=a, **conv), reference_localized_filter(x=b, **conv)
    for t in range(5):  # a in slot 3, b in slot 1, rows swap every step
        order = [(a, 3, ref_a), (b, 1, ref_b)] if t % 2 else [(b, 1, ref_b), (a, 3, ref_a)]
        x = torch.stack([seq[t] for seq, _, _ in order])
        positions = np.full(2, t)
        batch = SequenceStateBatch.build(
            [s for _, s, _ in order], np.array([0, 1, 2]), positions, positions, 16, False, torch.device("cpu")
        )
        assert batch.one_token_per_row
        y = lf(x, batch)
        for row, (_, _, ref) in enumerate(order):
            torch.testing.assert_close(y[row], ref[t], atol=1e-5, rtol=1e-5)
