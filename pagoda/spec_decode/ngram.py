"""Prompt lookup (n-gram) proposals: the tokens that followed an earlier occurrence of the sequence's end.

For n from `max_n` down to `min_n`, the last n tokens are looked for earlier in the sequence (prompt and
output so far); the latest earlier occurrence whose continuation is not empty proposes up to k of the
tokens after it. A longer match wins over a later one: it is the stronger evidence that the text is being
copied. Nothing found: no proposal (the step decodes one token for this request, as without speculation).
The search starts from the earlier occurrences of the last token and compares only there, all lengths at
once (`suffix.longest_match`): a step costs the one scan for that token plus work per occurrence.
"""

from __future__ import annotations

import numpy as np

from pagoda.spec_decode.suffix import longest_match


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
        # Earlier occurrences of the last token (every position but the last: its continuation is unknown).
        ends = np.flatnonzero(seq[: length - 1] == seq[length - 1]) if length > 1 else seq[:0]
        if not len(ends):
            return []
        ends, n = longest_match(seq, ends, seq, self.max_n)
        if n < self.min_n:
            return []
        start = int(ends[-1]) + 1  # the latest of the longest matches; its continuation is never empty
        return seq[start : start + k].tolist()
