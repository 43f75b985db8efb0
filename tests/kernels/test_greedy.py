"""The greedy-argmax kernel against `torch.argmax(dim=-1)`: the same index for every row, including
ties (the lowest index wins), NaN (wins over every number), -0.0 against +0.0 (equal), rows of
-inf, vocabularies that are not a multiple of the chunk, and fp32 / bf16 / fp16. On CPU the kernel
runs under the Triton interpreter (`conftest.py`) with a 64-wide chunk."""

from __future__ import annotations

import platform
import sys

import pytest
import torch

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.importorskip("triton")

from pagoda.kernels.greedy import GreedyArgmax
from pagoda.kernels.policy import GREEDY_MAX_ROWS as MAX_ROWS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCABS = [1, 63, 200, 1000] + ([151936, 135040] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", VOCABS)
def test_matches_torch_argmax(vocab: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(MAX_ROWS, vocab, generator=g) * 4).to(dtype)
    if vocab > 2:
        logits[1] = logits[1].round()  # many ties in value
        logits[2, vocab // 2] = logits[2, -1] = logits[2].max() + 1  # a tie for the maximum: lower index
        logits[3, vocab - 1] = float("nan")  # NaN wins, as in torch
        logits[3, vocab // 3] = float("inf")
        logits[4] = float("-inf")  # no finite value: index 0
        logits[5] = -0.0
        logits[5, vocab - 1] = 0.0  # -0.0 == +0.0: the first one
        logits[6] = torch.linspace(-3, -1, vocab)  # all negative: the last is largest
    logits = logits.to(DEVICE)
    argmax = GreedyArgmax()
    for rows in (1, 3, MAX_ROWS):
        got = argmax(logits[:rows])
        assert got.dtype == torch.int64
        assert got.tolist() == torch.argmax(logits[:rows], dim=-1).tolist()


def test_slots_are_reset_between_calls_and_strided_rows_work() -> None:
    """A second call with smaller values must not see the first call's keys; rows may be a strided
    view (unit column stride), as a slice of a larger logits buffer is."""
    argmax = GreedyArgmax()
    big = torch.zeros(2, 300, device=DEVICE)
    big[:, 250] = 5.0
    assert argmax(big).tolist() == [250, 250]
    small = torch.full((4, 600), -1.0, device=DEVICE)
    small[:, 7] = 0.5
    assert argmax(small[::2, :300]).tolist() == [7, 7]
    assert argmax(big[:1]).tolist() == [250]


def test_rejects_what_it_cannot_run() -> None:
    argmax = GreedyArgmax()
    assert not GreedyArgmax.supports(torch.zeros(MAX_ROWS + 1, 10, device=DEVICE))
    assert not GreedyArgmax.supports(torch.zeros(2, 10, device=DEVICE).t())
    assert not GreedyArgmax.supports(torch.zeros(2, 10, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="rows"):
        argmax(torch.zeros(MAX_ROWS + 1, 10, device=DEVICE))
