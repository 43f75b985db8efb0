"""The paged KV cache's tensors: allocated per attention layer, bound to it, zeroed and copied per block.

Sizing (how many blocks fit) is `worker/memory.py`'s arithmetic; this module only makes the tensors.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from pagoda.device_copy import to_device

logger = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def allocate_kv_caches(
    layers: list, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> KVCaches:
    """K and V [num_blocks, block_size, Hkv, D] per layer, in the cache dtype, bound to the layers.

    Uninitialised (zeroing gigabytes costs seconds at startup): the null block 0 is zeroed here,
    every other block when it is handed out (`zero_blocks`) if the attention backend reads past a
    request's length (`needs_zeroed_blocks`; the Triton kernels never do)."""
    caches = []
    for layer in layers:
        shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        k = torch.empty(shape, dtype=dtype, device=device)
        v = torch.empty(shape, dtype=dtype, device=device)
        k[0].zero_()
        v[0].zero_()
        layer.bind_kv_cache(k, v)
        caches.append((k, v))
    return caches


def zero_blocks(caches: KVCaches, blocks: list[int], device: torch.device) -> None:
    """A block's unwritten tail is read (then masked) by block-granular attention; zero it on
    hand-out so stale or uninitialised memory can never inject NaN (0 * NaN = NaN)."""
    index = to_device(np.asarray(blocks, dtype=np.int64), device)
    for k, v in caches:
        if k.element_size() == 1:  # fp8: index_fill_ has no fp8 kernel; all-zero bits are +0.0
            k, v = k.view(torch.uint8), v.view(torch.uint8)
        k.index_fill_(0, index, 0)
        v.index_fill_(0, index, 0)


def copy_blocks(caches: KVCaches, pairs: list[tuple[int, int]], device: torch.device) -> None:
    """Each (source, destination) block's K and V copied, every layer. All sources are read before any
    destination is written, so a source that is also another pair's destination gives its old content."""
    src, dst = (to_device(np.asarray(ids, dtype=np.int64), device) for ids in zip(*pairs))
    for k, v in caches:
        if k.element_size() == 1:  # fp8: copied as its bits
            k, v = k.view(torch.uint8), v.view(torch.uint8)
        k.index_copy_(0, dst, k.index_select(0, src))
        v.index_copy_(0, dst, v.index_select(0, src))


def log_fp8_scales(layers: list) -> None:
    """Which scales an FP8 cache stores with: the checkpoint's, or 1.0 everywhere."""
    scaled = [layer for layer in layers if (layer.k_scale, layer.v_scale) != (1.0, 1.0)]
    if not scaled:
        logger.info(
            "FP8 KV cache: the checkpoint has no k_scale/v_scale: every scale is 1.0 (values beyond ±448 saturate)"
        )
        return
    k = [layer.k_scale for layer in scaled]
    v = [layer.v_scale for layer in scaled]
    logger.info(
        "FP8 KV cache: the checkpoint's scales in %d of %d layers (k %.4g..%.4g, v %.4g..%.4g)",
        len(scaled),
        len(layers),
        min(k),
        max(k),
        min(v),
        max(v),
    )
