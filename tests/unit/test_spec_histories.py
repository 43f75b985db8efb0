"""The proposers' per-request token arrays (`spec_decode/history.py`) against the request's own lists."""

from __future__ import annotations

import random

import numpy as np

from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.spec_decode.history import TokenHistories


def _request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(), max_tokens=1000)


def test_each_request_reads_its_prompt_and_output_as_they_grow():
    rng = random.Random(0)
    histories = TokenHistories()
    requests = [_request(f"r{i}", [rng.randrange(100) for _ in range(rng.randrange(1, 90))]) for i in range(5)]
    for _ in range(200):
        request = rng.choice(requests)
        request.output_token_ids.extend(rng.randrange(100) for _ in range(rng.randrange(0, 9)))  # 0..8 a step
        got = histories.tokens(request)
        assert got.dtype == np.int64
        assert got.tolist() == request.prompt_token_ids + request.output_token_ids


def test_a_request_seen_shorter_than_its_array_is_rebuilt_and_finished_ones_are_forgotten():
    histories = TokenHistories()
    a, b = _request("a", [1, 2, 3]), _request("b", [7])
    a.output_token_ids = [4, 5]
    histories.tokens(a), histories.tokens(b)
    a.output_token_ids = [9]  # not how outputs change, but an array longer than the request is not trusted
    assert histories.tokens(a).tolist() == [1, 2, 3, 9]
    histories.keep_only(["b"])
    assert len(histories) == 1
    assert histories.tokens(b).tolist() == [7]
