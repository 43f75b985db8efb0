"""Yuan2's LF gate on one-token rows (`pagoda/kernels/localized_filter.py`): the norms fused with the
state shifts against the unfused gate (the layer's norms and its gather / concatenate / scatter of the
state rows), and the previous-token terms against whole-weight convolutions. On CPU the kernels run
under the Triton interpreter (`conftest.py`), so shapes stay tiny.
"""

from __future__ import annotations

import platform
import sys

import pytest
import torch

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.importorskip("triton")

from pagoda.kernels import dispatch
from pagoda.kernels import localized_filter as lf_kernels
from pagoda.layers.norm import RMSNorm, rms_norm_reference
from tests.kernels.fused_checks import DEVICE, DTYPES, FUSED, check_normed, randn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "hidden, with_residual, with_snapshots", [(6, True, False), (10, False, True), (34, True, True)]
)
def test_lf_decode_kernels_match_the_unfused_gate(hidden, with_residual, with_snapshots, dtype):
    """`lf_decode_input` then `lf_decode_output` against the reference composition: the layer's
    input norm (`rms_norm_reference`, with or without the residual add), the LF gate's gather /
    concatenate / scatter of [x_prev | o1_prev] state rows, and its output norm. Rows sit in
    shuffled slots; snapshot rows include repeats of the null block 0 (whichever row writes it
    last wins, so only distinct real blocks are compared)."""
    rows, num_slots, half = 5, 9, hidden // 2
    width = hidden + half
    h = randn(rows, hidden, dtype=dtype, seed=40)
    residual = randn(rows, hidden, dtype=dtype, seed=41) if with_residual else None
    weight, out_weight = randn(hidden, dtype=dtype, seed=42), randn(hidden, dtype=dtype, seed=43)
    bias = randn(half, dtype=dtype, seed=44)
    state = randn(num_slots, width, dtype=dtype, seed=45)
    slots = torch.tensor([7, 2, 0, 5, 3], device=DEVICE)
    snapshots = randn(6, width, dtype=dtype, seed=46) if with_snapshots else None
    snap_index = torch.tensor([0, 4, 0, 1, 0], device=DEVICE) if with_snapshots else None
    old_state, old_snapshots = state.clone(), snapshots.clone() if with_snapshots else None

    if with_residual:
        x_ref, summed_ref = rms_norm_reference(h, weight, 1e-6, residual)
    else:
        x_ref, summed_ref = rms_norm_reference(h, weight, 1e-6), h
    in1, in2, summed = lf_kernels.lf_decode_input(h, residual, weight, 1e-6, bias, state, slots, snap_index, snapshots)
    check_normed(in1[:, hidden:], x_ref)
    assert torch.equal(summed, summed_ref)
    x = in1[:, hidden:]
    assert torch.equal(in1[:, :hidden], old_state[slots, :hidden])
    assert torch.equal(in2, torch.cat([old_state[slots, hidden:], bias.expand(rows, half)], dim=-1))
    want_state = old_state.clone()
    want_state[slots, :hidden] = x
    assert torch.equal(state, want_state)

    o1 = randn(rows, half, dtype=dtype, seed=47)
    in2[:, half:] = o1  # what conv1 accumulates there
    o2 = randn(rows, hidden, dtype=dtype, seed=48)
    y = lf_kernels.lf_decode_output(o2, x, out_weight, 1e-6, in2[:, half:], state, slots, snap_index, snapshots)
    check_normed(y, rms_norm_reference(o2, out_weight, 1e-6, x)[0])
    want_state[slots, hidden:] = o1
    assert torch.equal(state, want_state)
    if with_snapshots:
        for row, block in ((1, 4), (3, 1)):
            assert torch.equal(snapshots[block], torch.cat([x[row], o1[row]]))
        untouched = [2, 3, 5]
        assert torch.equal(snapshots[untouched], old_snapshots[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lf_one_row_fused_decode_step_matches_the_pytorch_gate(dtype, monkeypatch):
    """A one-row decode step of the gate through the fused kernels and the GEMV (conv1 accumulating in
    place, conv2, the output norm saving o1) against the unfused PyTorch gate: the same x in the state,
    o1 and the output within the dtype's tolerance, the other slots untouched."""
    from pagoda.kernels import gemv
    from pagoda.layers.localized_filter import LocalizedFilter
    from pagoda.layers.sequence_state import SequenceStateBatch

    hidden, half = 34, 17
    torch.manual_seed(7)
    lf = LocalizedFilter(hidden)
    norm = RMSNorm(hidden)
    for p in (*lf.parameters(), *norm.parameters()):
        p.data.normal_(0, 0.3)
    lf, norm = lf.to(DEVICE, dtype), norm.to(DEVICE, dtype)
    state0 = randn(5, hidden + half, dtype=dtype, seed=60)
    h, residual = randn(1, hidden, dtype=dtype, seed=61), randn(1, hidden, dtype=dtype, seed=62)
    slot = torch.tensor([3], device=DEVICE)
    batch = SequenceStateBatch(
        slots=slot,
        first_token=torch.tensor([0], device=DEVICE),
        last_token=torch.tensor([0], device=DEVICE),
        one_token_per_row=True,
    )
    with monkeypatch.context() as m:
        m.setattr(dispatch, "fused_for", lambda family, x: FUSED[family])
        m.setattr(dispatch, "gemv_for", lambda x: gemv)
        lf.bind_state(state0.clone(), torch.empty(0))
        x, _, inputs = lf.fused_decode_input(h, residual, norm, batch)
        y_fused, state_fused = lf(x, batch, inputs), lf.state
    with monkeypatch.context() as m:  # the PyTorch gate (what the CPU runs)
        m.setattr(dispatch, "fused_for", lambda family, x: None)
        m.setattr(dispatch, "gemv_for", lambda x: None)
        lf.bind_state(state0.clone(), torch.empty(0))
        x_ref, _ = norm(h, residual)
        y_ref, state_ref = lf(x_ref, batch), lf.state

    tolerance = {} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(state_fused[:, :hidden], state_ref[:, :hidden], **tolerance)
    torch.testing.assert_close(state_fused[:, hidden:], state_ref[:, hidden:], **tolerance)
    assert torch.equal(state_fused[[0, 1, 2, 4]], state0[[0, 1, 2, 4]])
    torch.testing.assert_close(y_fused, y_ref, **tolerance)
