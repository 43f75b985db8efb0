"""Paged attention in Triton, one module per kernel family: `store_kv` writes new K/V into the paged
cache (and owns the cache's layout and fp8 format), `decode` attends one query token per row (split-K
"flash decoding"), `prefill` attends variable-length causal chunks; `tile` is the online-softmax step
both attention kernels share, and `warmup` compiles every variant at start-up.

The launchers check shapes and strides, pick block sizes, and launch. They never read device values
on the host except where documented (`num_splits=None`, `tiles=None`), so the backend can keep its
per-layer path free of host-device syncs. The PyTorch reference for these kernels is
`pagoda.layers.torch_attention.TorchAttentionBackend` (plus the dense per-request attention in
`tests/kernels/test_attention.py`); kernels may not import layers.
"""
