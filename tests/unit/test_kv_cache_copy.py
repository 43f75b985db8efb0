"""`kv_cache.copy_blocks`: prefix hits copied into a request's own blocks (CPU), against a naive copy from a
snapshot of the caches taken before any write."""

from __future__ import annotations

import pytest
import torch

from pagoda.worker.kv_cache import copy_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_every_source_is_read_before_any_destination_is_written(dtype):
    torch.manual_seed(0)
    caches = [tuple(torch.randn(9, 4, 2, 8).to(dtype) for _ in range(2)) for _ in range(3)]  # 3 layers
    before = [(k.clone(), v.clone()) for k, v in caches]
    pairs = [(2, 5), (5, 7), (3, 2)]  # 5 is a destination and, later in the list, a source; so is 2
    copy_blocks(caches, pairs, torch.device("cpu"))
    for (k, v), (k0, v0) in zip(caches, before):
        for cache, old in ((k, k0), (v, v0)):
            expected = old.clone()
            for src, dst in pairs:
                expected[dst] = old[src]
            assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
