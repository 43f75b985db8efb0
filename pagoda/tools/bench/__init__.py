"""`pagoda bench`: a load tester for any OpenAI-compatible server (ours, vLLM, others).

Metric definitions and result keys follow `vllm bench serve` (see docs/tools.md, pagoda bench) so numbers are
comparable; on top of that it sweeps a concurrency ladder, scrapes the server's Prometheus `/metrics`, checks
an SLO per point, finds the throughput knee and recommends a `--max-num-seqs`.

Nothing here imports torch or the engine: the tool only needs httpx, numpy and (for images) Pillow.
"""
