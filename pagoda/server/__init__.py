"""The OpenAI-compatible HTTP API: the app, its routes, request/response models, SSE and metrics."""
