"""`pagoda router`: an OpenAI-compatible front for several `pagoda serve` (or vLLM) backends.

Session affinity by consistent hashing (so a conversation keeps hitting the engine that holds its
prefix cache), bounded load, active health probes plus a passive circuit breaker, retries before the
first byte, byte-for-byte stream passthrough, per-key usage accounting and Prometheus metrics.

Modules: `config` (frozen settings, file loading, reload), `policy` (session keys and backend choice),
`health` (backends' runtime state, breaker, probes), `usage` (usage ledger, SSE tap), `metrics`,
`proxy` (the hot path, raw ASGI), `app` (the ASGI app and state), `cli`. Importing this package is
free: nothing heavy is imported until `pagoda router` runs.
"""
