"""`pagoda batch`: run an OpenAI-Batch-shaped job (JSONL, or images + a prompt) against a live server.

Modules: `inputs` (JSONL, image folders, URL lists, ids), `scrape` (images of a web page), `media` (fetch,
sniff, downscale, data URIs), `sender` (retry rules, token bucket, the async pool), `output` (append-only
JSONL, resume), `cli` (flags and the driver). Nothing here imports torch or the engine.
"""
