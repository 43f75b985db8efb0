"""Yuan2.0's localized filtering (LF) gate over a flattened, continuously batched step.

As the official Yuan2 modeling code computes it (docs/models.md, Yuan2: localized-filtering attention).
For one sequence, with x the layer's input_layernorm output:

    o1[t] = A0·x[t-1]  + A1·x[t]  + a          conv1: [H/2, H, 2, 1], tap 0 = previous token
    o2[t] = B0·o1[t-1] + B1·o1[t] + b          conv2: [H, H/2, 2, 1]
    y[t]  = RMSNorm(o2[t] + x[t])              eps 1e-6
    with x[-1] = 0 and o1[-1] = 0 at a sequence's first token.

Each convolution is one GEMM over [previous | current] concatenated along features (weights
stored as [out, 2·in] = [tap 0 | tap 1]). "Previous" is the token before in the same sequence:
inside a row of the flat batch it is the row above; for a row's first token it comes from the
sequence's state slot (x_prev, o1_prev), which holds zeros for a fresh sequence — exactly the
reference's zero padding. Rows never see each other's tokens. After the step the slot holds the
row's last x and o1; every token that completes a KV block also writes a prefix-cache snapshot.

State layout per slot (and per snapshot): [x_prev (H) | o1_prev (H/2)], in the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import dispatch
from pagoda.layers.linear import linear
from pagoda.layers.norm import RMSNorm
from pagoda.layers.sequence_state import SequenceStateBatch


class TwoTapConv(nn.Module):
    """A width-2 causal convolution over time as a linear map of [previous | current] features.

    Loads the checkpoint's Conv2d weight [out, in, 2, 1] as [out, 2·in] = [W[..., 0, 0] | W[..., 1, 0]].
    """

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, 2 * in_features))
        self.bias = nn.Parameter(torch.empty(out_features))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.dim() == 4:  # Conv2d weight [out, in, 2, 1] → [out, 2, in] → [out, 2·in]
            if loaded.shape[2:] != (2, 1):
                raise ValueError(f"expected a (2, 1) convolution kernel, got {tuple(loaded.shape)}")
            loaded = loaded[..., 0].permute(0, 2, 1).reshape(loaded.shape[0], -1)
        if param.shape != loaded.shape:
            raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
        param.data.copy_(loaded)

    def forward(self, previous: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.cat([previous, current], dim=-1), self.weight, self.bias)


class LocalizedFilter(nn.Module):
    """x [T, H] (flattened step) → y [T, H]; reads and advances each sequence's state slot."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        if hidden_size % 2:
            raise ValueError(f"the LF gate needs an even hidden size, got {hidden_size}")
        self.hidden_size = hidden_size
        self.conv1 = TwoTapConv(hidden_size, hidden_size // 2)
        self.conv2 = TwoTapConv(hidden_size // 2, hidden_size)
        self.output_layernorm = RMSNorm(hidden_size, eps)
        self.state = torch.empty(0)  # [num_slots, 1.5·H], bound by the model runner
        self.snapshots = torch.empty(0)  # [num_blocks, 1.5·H] or empty (no prefix caching)

    @property
    def state_width(self) -> int:
        return self.hidden_size + self.hidden_size // 2

    def bind_state(self, state: torch.Tensor, snapshots: torch.Tensor) -> None:
        self.state, self.snapshots = state, snapshots

    def forward(
        self,
        x: torch.Tensor,
        batch: SequenceStateBatch,
        decode_inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """decode_inputs: what `fused_decode_input` prepared for this decode step (then x is its view)."""
        if decode_inputs is not None:
            return self._one_token_rows(x, batch, *decode_inputs)
        h = self.hidden_size
        saved = self.state.index_select(0, batch.slots)  # [B, 1.5H]
        x_prev, o1_prev = saved[:, :h], saved[:, h:]
        o1 = self.conv1(_previous(x, x_prev, batch), x)  # [T, H/2]
        o2 = self.conv2(_previous(o1, o1_prev, batch), o1)  # [T, H]
        y, _ = self.output_layernorm(o2, x)  # norm(o2 + x), one launch on CUDA

        _save_state(self.state, batch.slots, x, o1, batch.last_token, batch.one_token_per_row)
        if batch.snapshot_tokens is not None and self.snapshots.numel():
            _save_state(self.snapshots, batch.snapshot_blocks, x, o1, batch.snapshot_tokens, batch.snapshot_every_row)
        return y

    def fused_decode_input(
        self, h: torch.Tensor, residual: torch.Tensor | None, input_norm: RMSNorm, batch: SequenceStateBatch | None
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None:
        """On a CUDA decode step (every row one token): the decoder layer's input norm fused with this
        gate's state shifts (`pagoda/kernels/localized_filter.py`). Returns (x, residual stream, decode_inputs
        for `forward`), or None where the unfused path runs (CPU, prefill and mixed steps)."""
        ops = dispatch.fused_for("localized_filter", h) if batch is not None and batch.one_token_per_row else None
        if (
            ops is None
            or not ops.supports_lf_decode(h, input_norm.weight, self.state)
            or self.conv1.bias.dtype != h.dtype
        ):
            return None
        snap_index, snapshots = self._in_kernel_snapshots(batch)
        in1, in2, residual = ops.lf_decode_input(
            h,
            residual,
            input_norm.weight,
            input_norm.eps,
            self.conv1.bias,
            self.state,
            batch.slots,
            snap_index,
            snapshots,
        )
        return in1[:, self.hidden_size :], residual, (in1, in2)

    def _in_kernel_snapshots(self, batch: SequenceStateBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(snapshot block per row, snapshots) when every row writes a snapshot (captured decode
        steps: rows completing no block write the null block's), else (None, None)."""
        if batch.snapshot_every_row and batch.snapshot_tokens is not None and self.snapshots.numel():
            return batch.snapshot_blocks, self.snapshots
        return None, None

    def _one_token_rows(
        self,
        x: torch.Tensor,
        batch: SequenceStateBatch,
        in1: torch.Tensor,
        in2: torch.Tensor,
    ) -> torch.Tensor:
        """A decode step on CUDA, from `fused_decode_input`'s buffers: in1 = [x_prev | x] and
        in2 = [o1_prev | conv1 bias]. conv1 accumulates into in2's right half in place (so in2 is
        conv2's [o1_prev | o1] input with no copy), and the output norm's launch also saves o1 in
        the state: two launches per layer fewer than a shift kernel before each convolution."""
        h = self.hidden_size
        kernels = dispatch.gemv_for(in1)
        o1 = in2[:, h // 2 :]
        if kernels is not None and kernels.supports(in1, self.conv1.weight):
            kernels.gemv(in1, self.conv1.weight, out=o1, accumulate=True)  # [B, H/2] + bias
        else:
            o1.addmm_(in1, self.conv1.weight.t())
        o2 = linear(in2, self.conv2.weight, self.conv2.bias)  # [B, H]
        snap_index, snapshots = self._in_kernel_snapshots(batch)
        ops = dispatch.fused_for("localized_filter", x)
        y = ops.lf_decode_output(
            o2,
            x,
            self.output_layernorm.weight,
            self.output_layernorm.eps,
            o1,
            self.state,
            batch.slots,
            snap_index,
            snapshots,
        )
        if snapshots is None and batch.snapshot_tokens is not None and self.snapshots.numel():
            _save_state(self.snapshots, batch.snapshot_blocks, x, o1, batch.snapshot_tokens, False)
        return y


def _previous(values: torch.Tensor, carried: torch.Tensor, batch: SequenceStateBatch) -> torch.Tensor:
    """values [T, F] shifted down one token within each row; a row's first token gets its carried
    state [B, F] (never the last token of the row above)."""
    if batch.one_token_per_row:
        return carried
    shifted = torch.empty_like(values)
    shifted[1:] = values[:-1]
    shifted[batch.first_token] = carried
    return shifted


def _save_state(
    target: torch.Tensor, index: torch.Tensor, x: torch.Tensor, o1: torch.Tensor, tokens: torch.Tensor, every_row: bool
) -> None:
    """target[index[i]] = [x | o1] of token tokens[i]. every_row: tokens are 0..T-1 in order (a
    one-token-per-row step), so x and o1 go in as they are: two launches per step instead of four,
    which a decode step pays in every layer."""
    h = x.shape[-1]
    if not every_row:
        x, o1 = x.index_select(0, tokens), o1.index_select(0, tokens)
    target[:, :h].index_copy_(0, index, x)
    target[:, h:].index_copy_(0, index, o1)


def reference_localized_filter(
    conv1_weight: torch.Tensor,
    conv1_bias: torch.Tensor,
    conv2_weight: torch.Tensor,
    conv2_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    x: torch.Tensor,
    eps: float = 1e-6,
) -> torch.Tensor:
    """One whole sequence x [T, H] through the LF gate the way the reference code does it: two
    Conv2d over a zero-padded time axis, keeping the first T outputs (for tests)."""
    t, h = x.shape
    inputs = x.t().reshape(1, h, t, 1)  # [batch, channels, time, 1]
    out1 = F.conv2d(inputs, conv1_weight, conv1_bias, padding=(1, 0))[:, :, :t]
    out2 = F.conv2d(out1, conv2_weight, conv2_bias, padding=(1, 0))[:, :, :t]
    summed = out2.reshape(h, t).t() + x
    normed = F.rms_norm(summed.float(), (h,), eps=eps).to(x.dtype)
    return norm_weight * normed
