"""Verifying proposals against the model's own distribution at each proposed position.

Shapes: R rows (requests), up to K proposals each (`num_drafts[r]` of them valid, the rest padding), and the
model's distribution at K + 1 positions per row: after the row's last known token (checks proposal 0), after
proposal 0 (checks proposal 1), ..., after proposal K - 1 (the bonus token when every proposal holds).

Both functions return `tokens` [R, K + 1] (int64, -1 past each row's end) and `num_tokens` [R]: the accepted
proposals, then one token of the model's own — so every row moves by at least one token, as without
speculation, and by at most num_drafts + 1.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _assemble(draft_ids: Tensor, accepted: Tensor, last: Tensor) -> tuple[Tensor, Tensor]:
    """tokens = draft_ids[:accepted] + [last] per row, -1 after; num_tokens = accepted + 1."""
    rows, k = draft_ids.shape
    cols = torch.arange(k + 1, device=draft_ids.device)
    padded = torch.cat([draft_ids, draft_ids.new_full((rows, 1), -1)], dim=1)
    tokens = torch.where(cols < accepted[:, None], padded, torch.full_like(padded, -1))
    tokens.scatter_(1, accepted[:, None], last[:, None])
    return tokens, accepted + 1


def _leading_true(mask: Tensor) -> Tensor:
    """Per row, how many leading entries of `mask` [R, K] are True."""
    return torch.cumprod(mask.to(torch.int64), dim=1).sum(dim=1)


def verify_greedy(target_ids: Tensor, draft_ids: Tensor, num_drafts: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy rows. target_ids [R, K + 1]: the model's argmax at each position; draft_ids [R, K]; num_drafts [R].
    The output is exactly what greedy decoding one token at a time gives."""
    k = draft_ids.shape[1]
    cols = torch.arange(k + 1, device=draft_ids.device)
    accepted = _leading_true((draft_ids == target_ids[:, :k]) & (cols[None, :k] < num_drafts[:, None]))
    # The accepted proposals equal the model's tokens at their positions, so a row's tokens are the model's own
    # up to and including position `accepted` (the first mismatch, or the bonus token).
    return torch.where(cols[None, :] <= accepted[:, None], target_ids, -1), accepted + 1


def rejection_sample(
    target_probs: Tensor,
    draft_ids: Tensor,
    num_drafts: Tensor,
    draft_probs: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Sampled rows. target_probs [R, K + 1, V]: the model's distribution at each position (after temperature,
    top-k/p...); draft_probs [R, K, V]: the proposer's, or None for a proposer without one (a one-hot q).

    Proposal j is accepted with probability min(1, p_j(x) / q_j(x)); at the first rejection the row's token is
    drawn from max(p_j - q_j, 0), normalised; when all are accepted, from p_K. Each output token is then
    distributed exactly as sampling the model one token at a time."""
    rows, k = draft_ids.shape
    device = target_probs.device
    if k == 0:  # nothing proposed: one token from p_0
        last = torch.multinomial(target_probs[:, 0], 1, generator=generator).squeeze(1)
        return _assemble(draft_ids, torch.zeros(rows, dtype=torch.int64, device=device), last)
    cols = torch.arange(k, device=device)
    valid = cols[None, :] < num_drafts[:, None]
    safe_ids = draft_ids.clamp_min(0)
    p_at = target_probs[:, :k].gather(2, safe_ids[:, :, None]).squeeze(2)
    if draft_probs is None:
        q = torch.zeros_like(target_probs[:, :k]).scatter_(2, safe_ids[:, :, None], 1.0)
    else:
        q = draft_probs
    q_at = q.gather(2, safe_ids[:, :, None]).squeeze(2)
    uniform = torch.rand((rows, k), device=device, generator=generator, dtype=p_at.dtype)
    accept = uniform * q_at < p_at  # u < p / q without dividing (q_at > 0 for a proposal drawn from q)
    accepted = _leading_true(accept & valid)
    rejected = accepted < num_drafts
    # The distribution the row's own token comes from: the residual at the rejected position, else p_K.
    row = torch.arange(rows, device=device)
    residual = (target_probs[row, accepted.clamp_max(k - 1)] - q[row, accepted.clamp_max(k - 1)]).clamp_min(0)
    dist = torch.where(rejected[:, None], residual, target_probs[row, accepted])
    dist = dist / dist.sum(dim=1, keepdim=True).clamp_min(torch.finfo(dist.dtype).tiny)
    last = torch.multinomial(dist, 1, generator=generator).squeeze(1)
    return _assemble(draft_ids, accepted, last)
