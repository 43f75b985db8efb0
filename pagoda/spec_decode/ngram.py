"""Prompt lookup (n-gram) proposals: the tokens that followed an earlier occurrence of the sequence's end.

For n from `max_n` down to `min_n`, the last n tokens are looked for earlier in the sequence (prompt and
output so far); the latest earlier occurrence whose continuation is not empty proposes up to k of the
tokens after it. A longer match wins over a later one: it is the stronger evidence that the text is being
copied. Nothing found: no proposal (the step decodes one token for this request, as without speculation).
One vectorised pass per n (numpy's sliding windows), so a 32k-token context costs well under a millisecond.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int):
        assert 1 <= min_n <= max_n and num_speculative_tokens >= 1
        self.k, self.min_n, self.max_n = num_speculative_tokens, min_n, max_n

    def propose(self, tokens: np.ndarray | list[int], k: int | None = None) -> list[int]:
        """Up to `k` (default: the configured count) proposed next tokens for the sequence `tokens`."""
        k = self.k if k is None else k
        seq = np.asarray(tokens, dtype=np.int64)
        length = len(seq)
        if k <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. length - n - 1: every occurrence but the suffix itself.
            windows = sliding_window_view(seq[: length - 1], n)
            hits = np.flatnonzero((windows == seq[length - n :]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the latest occurrence's continuation (never empty: start < length)
                return seq[start : start + k].tolist()
        return []
