"""`pagoda serve [MODEL] [flags]`: the OpenAI-compatible server, with `vllm serve`'s flags.

The engine core starts in its own process first (so a bad flag or a model that does not fit fails
with one line before any port is opened), then uvicorn serves until SIGTERM/SIGINT: new requests
stop, in-flight ones get `--shutdown-timeout` seconds to finish (those still running then end with a
503 error: a stream's last events are an error naming the shutdown and [DONE]), and the process exits 0.
`--api-server-count N > 1` runs N API processes in front of the one core (`serve_multi.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any

from pagoda.cli.args import add_engine_args, engine_args_from
from pagoda.errors import ConfigError
from pagoda.server import http_limits
from pagoda import envs

logger = logging.getLogger("pagoda")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="model folder, hub id or .gguf (same as --model)")
    add_engine_args(parser)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="names clients use in 'model' (default: the model path)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set PAGODA_API_KEY)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="always on; accepted for vLLM compatibility")
    parser.add_argument("--chat-template", default=None, help="Jinja chat template: a file or the template text")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="let a chat request carry its own chat_template (rendered in a time- and size-bounded "
                             "sandbox); without it such a request gets 400")
    parser.add_argument("--enable-log-requests", action="store_true", help="log one line per request")
    parser.add_argument("--disable-log-requests", action="store_true", help="accepted for compatibility (default)")
    parser.add_argument("--disable-log-stats", action="store_true", help="accepted for compatibility")
    parser.add_argument("--generation-config", default="auto",
                        help="'auto': sampling defaults from the model's generation_config.json; 'vllm': none; "
                             "or a folder holding a generation_config.json")
    parser.add_argument("--max-waiting-requests", type=int, default=None,
                        help="answer 503 + Retry-After when this many requests are already waiting")
    # What one request or connection may cost the API process (pagoda/server/http_limits.py).
    parser.add_argument("--max-request-bytes", type=int, default=http_limits.DEFAULT_MAX_REQUEST_BYTES,
                        help="413 for a request body over this many bytes (default 32 MiB; images travel in it)")
    parser.add_argument("--max-header-bytes", "--h11-max-incomplete-event-size", type=int,
                        default=http_limits.DEFAULT_MAX_HEADER_BYTES,
                        help="431 for a request line and headers over this many bytes (default 64 KiB)")
    parser.add_argument("--max-header-count", "--h11-max-header-count", type=int,
                        default=http_limits.DEFAULT_MAX_HEADER_COUNT, help="431 beyond this many headers (default 256)")
    parser.add_argument("--header-timeout", type=float, default=http_limits.DEFAULT_HEADER_TIMEOUT_S,
                        help="408 and close when a request's headers take longer from its first byte, in s "
                             "(default 60)")
    parser.add_argument("--body-timeout", type=float, default=http_limits.DEFAULT_BODY_TIMEOUT_S,
                        help="408 and close when a request's body takes longer after its headers, in s (default 300)")
    parser.add_argument("--idle-connection-timeout", type=float,
                        default=http_limits.DEFAULT_IDLE_CONNECTION_TIMEOUT_S,
                        help="close a new connection that sends nothing for this many s (default 300)")
    parser.add_argument("--timeout-keep-alive", type=float, default=http_limits.default_keep_alive(),
                        help="close an idle keep-alive connection after this many s (default 5, or "
                             "VLLM_HTTP_TIMEOUT_KEEP_ALIVE)")
    parser.add_argument("--max-connections", type=int, default=None,
                        help="503 and close for new connections beyond this many per API process (default: the "
                             "file-descriptor limit, raised to its hard limit, less a tenth; at most 65536)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGTERM; those still running then "
                             "end with a 503 error (streams: an error event, then [DONE])")
    parser.add_argument("--metrics-prefix", choices=("both", "vllm", "pagoda"), default="both",
                        help="/metrics names: both vllm:NAME and pagoda:NAME, same values (default), or one of them")
    parser.add_argument("--api-server-count", "-asc", type=int, default=1,
                        help="API server processes (HTTP, tokenization, SSE) in front of the one engine core, "
                             "all serving --host:--port (default 1)")
    parser.add_argument("--uvicorn-log-level", default="warning")
    parser.add_argument("--skip-preflight", action="store_true",
                        help="do not run `pagoda doctor`'s fast checks before loading the model")
    parser.add_argument("--limit-mm-per-prompt", default=None,
                        help='most images/videos per prompt: JSON \'{"image": 4, "video": 1}\' or image=4,video=1 '
                             "(default image=16, video=2)")
    parser.add_argument("--mm-processor-kwargs", default=None,
                        help='image preprocessing defaults, JSON, e.g. \'{"max_pixels": 1003520}\' '
                             "(default: the model's preprocessor_config.json)")
    parser.add_argument("--allowed-local-media-path", default=None,
                        help="folder from which file:// image urls may be read (default: none)")
    parser.add_argument("--allow-private-media-urls", action="store_true",
                        help="allow image urls that resolve to loopback/private/link-local addresses")


def serve(ns: argparse.Namespace) -> int:
    if ns.model_tag is not None:
        ns.model = ns.model_tag
    try:
        if ns.api_server_count > 1:
            from pagoda.cli.serve_multi import serve_multi

            return serve_multi(ns)
        return asyncio.run(_serve(ns))
    except ConfigError as exc:
        print(f"pagoda: error: {exc.message}", file=sys.stderr)
        return 2


def _unsupported(ns: argparse.Namespace) -> None:
    if ns.api_server_count < 1:
        raise ConfigError(f"--api-server-count must be at least 1 (got {ns.api_server_count}).")
    if ns.tensor_parallel_size != 1:
        raise ConfigError("--tensor-parallel-size > 1 is not supported yet; use 1.")
    if ns.pipeline_parallel_size != 1:
        raise ConfigError("--pipeline-parallel-size > 1 is not supported; use 1.")
    if ns.enable_chunked_prefill is False:
        logger.warning("--no-enable-chunked-prefill ignored: chunked prefill is always on")


class ServeSetup:
    """Everything an API process needs besides the engine: built (and validated, so a bad flag fails
    with one line) before the core starts; with several API processes, again in each of them."""

    def __init__(self, ns: argparse.Namespace, check: bool = True, config: Any = None):
        from pagoda.config import EngineConfig
        from pagoda.frontend.chat_template import load_chat_template
        from pagoda.frontend.tokenizer import load_tokenizer
        from pagoda.models.gguf_checkpoint import DEFAULT_SERVED_NAME
        from pagoda.models.source import resolve_model_source
        from pagoda.frontend.multimodal.chat import multimodal_serving
        from pagoda.server.serving import sampling_defaults

        if check:
            _unsupported(ns)
        self.ns = ns
        self.http_limits = http_limits.HttpLimits.from_args(ns)     # also raises the file-descriptor limit
        self.config = config = config or EngineConfig.create(engine_args_from(ns))
        if check and not ns.skip_preflight:
            from pagoda.tools.doctor import serve_preflight

            serve_preflight(ns)      # shards, headers, tokenizer, port: fail in seconds, before the weights load
        source = resolve_model_source(config.model.model)
        self.multimodal = multimodal_serving(source.hf_config, source.folder if source.kind == "hf" else None,
                                             ns.limit_mm_per_prompt, ns.mm_processor_kwargs,
                                             ns.allowed_local_media_path, ns.allow_private_media_urls)
        self.tokenizer = None
        if not config.model.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(source, config.model.tokenizer, config.model.trust_remote_code)
        self.names = ns.served_model_name or [ns.model or DEFAULT_SERVED_NAME]
        self.chat_template = load_chat_template(ns.chat_template)
        if check and self.tokenizer is not None:
            _check_chat_template(self.tokenizer, source, ns.chat_template, config.model.tokenizer)
        self.generation_defaults = _generation_defaults(ns.generation_config, source, sampling_defaults,
                                                        log=check)

    def app(self, engine, metrics):  # type: ignore[no-untyped-def]
        from pagoda.server.app import build_app
        from pagoda.server.serving import OpenAIServing, ServingContext

        config, ns = self.config, self.ns
        ctx = ServingContext(
            engine=engine, tokenizer=self.tokenizer, served_model_names=self.names,
            max_model_len=config.model.max_model_len, vocab_size=config.model.vocab_size,
            architecture=config.model.architecture, chat_template=self.chat_template, metrics=metrics,
            generation_defaults=self.generation_defaults, max_waiting_requests=ns.max_waiting_requests,
            api_server_count=ns.api_server_count, log_requests=ns.enable_log_requests, multimodal=self.multimodal,
            trust_request_chat_template=ns.trust_request_chat_template)
        engine.add_listener(ctx.metrics.on_engine_outputs)
        # Token ids → text where there is CPU to spare. With several API processes, here: off the engine
        # core, spread over them (H200, Yuan2-2B, c=256, 4 API processes: 41.9k-43.6k tok/s vs 39.9k-40.1k
        # with the core decoding). With one, that process already carries all of HTTP and was the
        # bottleneck: decoding there too fell from 36.7k to 28.7k tok/s, so the core keeps it.
        engine.use_tokenizer(self.tokenizer if ns.api_server_count > 1 else None)
        return build_app(OpenAIServing(ctx), api_key=ns.api_key or envs.API_KEY.value,
                         max_request_bytes=self.http_limits.max_request_bytes)

    def metrics(self, **kwargs: Any):  # type: ignore[no-untyped-def]
        from pagoda.server.metrics import METRICS_PREFIXES, ServerMetrics

        return ServerMetrics(self.names[0], prefixes=METRICS_PREFIXES[self.ns.metrics_prefix], **kwargs)

    def log_startup(self, ready) -> None:  # type: ignore[no-untyped-def]
        config, ns = self.config, self.ns
        logger.info("model=%s served as %s dtype=%s device=%s", config.model.model, ", ".join(self.names),
                    config.model.dtype, config.device.device)
        logger.info("KV cache: %d blocks of %d tokens; maximum concurrency for %d-token requests: %.2fx",
                    ready.num_blocks, ready.block_size, config.model.max_model_len, ready.max_concurrency)
        extra = f" ({ns.api_server_count} API server processes)" if ns.api_server_count > 1 else ""
        logger.info("Serving on http://%s:%d (OpenAI API under /v1)%s", ns.host, ns.port, extra)


async def _serve(ns: argparse.Namespace) -> int:
    import uvicorn

    from pagoda.engine.async_engine import AsyncEngine
    from pagoda.serving_gc import prepare_gc_for_serving

    setup = ServeSetup(ns)
    engine = AsyncEngine(setup.config)
    await engine.start()
    try:
        app = setup.app(engine, setup.metrics())
        ready = engine.ready
        assert ready is not None
        setup.log_startup(ready)
        prepare_gc_for_serving()
        server = _server_class()(uvicorn.Config(
            app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
            timeout_graceful_shutdown=ns.shutdown_timeout + STREAM_END_GRACE_S, access_log=False,
            **setup.http_limits.uvicorn_args()))
        server.engine, server.deadline_s = engine, ns.shutdown_timeout
        await server.serve()
    finally:
        await engine.shutdown()
    return 0


# uvicorn's graceful shutdown cancels what is still running at its timeout, which cuts a stream with
# neither an error event nor [DONE]. So at --shutdown-timeout the engine ends its open requests itself
# (`EndStreamsAtDeadline`), and uvicorn's own timeout comes this much later: for clients that stopped reading.
STREAM_END_GRACE_S = 2.0


class EndStreamsAtDeadline:
    """Mixin for uvicorn.Server: `deadline_s` after shutdown begins, `engine.end_streams` (each open
    request fails with a 503 naming the shutdown; new ones are refused)."""

    engine: Any = None
    deadline_s: float = 30.0

    async def shutdown(self, sockets: Any = None) -> None:
        cut = asyncio.get_running_loop().call_later(self.deadline_s, self._end_streams)
        try:
            await super().shutdown(sockets)  # type: ignore[misc]
        finally:
            cut.cancel()

    def _end_streams(self) -> None:
        if self.engine is None:
            return
        if self.engine.num_pending:
            logger.warning("--shutdown-timeout (%g s) reached: ending %d open requests", self.deadline_s,
                           self.engine.num_pending)
        self.engine.end_streams(f"The server is shutting down: --shutdown-timeout ({self.deadline_s:g} s) ran out "
                                "before this request finished; retry it.")


def _server_class():  # type: ignore[no-untyped-def]
    import contextlib
    import signal
    import threading

    import uvicorn

    class Server(EndStreamsAtDeadline, uvicorn.Server):
        """uvicorn re-raises a captured SIGTERM/SIGINT once its graceful shutdown is done, which kills
        this process (exit -15) before the engine core is stopped and orphans it. We shut down on the
        signal already, so catch it without re-raising: the engine stops and the process exits 0."""

        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[no-untyped-def]
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server


def _check_chat_template(tokenizer: Any, source: Any, override: str | None, tokenizer_path: str) -> None:
    """Log which chat template serves chats; stop here (seconds, not at the first chat request) when
    it cannot render a plain conversation; warn when its prompt is not the model family's format.
    A model without a template still serves completions: that is only logged."""
    from pagoda.frontend.chat_template import inspect_chat_template

    folder = tokenizer_path if os.path.isdir(tokenizer_path) else source.location   # a .gguf: its metadata
    report = inspect_chat_template(tokenizer, source.hf_config, override, folder)
    if report.error:
        raise ConfigError(f"the chat template ({report.origin}) does not render a user/assistant conversation: "
                          f"{report.error} → {report.fix}", "chat_template")
    if report.template is None:
        logger.info("Chat template: none (the tokenizer has none): /v1/chat/completions answers 400, completions "
                    "work; pass --chat-template to serve chats")
        return
    logger.info("Chat template: %s", report.origin)
    if report.mismatch:
        logger.warning("Chat template (%s) does not produce %s: a probe conversation renders as %r → %s",
                       report.origin, report.mismatch, report.rendered, report.fix)


def _generation_defaults(choice: str, source, to_defaults, log: bool = True) -> dict:  # type: ignore[no-untyped-def]
    import json

    if choice == "vllm":
        return {}
    if choice == "auto":
        defaults = to_defaults(source.generation_config())
    else:
        path = os.path.join(choice, "generation_config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"--generation-config {choice!r}: no generation_config.json there; use auto, vllm "
                              "or a folder that has one.")
        with open(path) as f:
            defaults = to_defaults(json.load(f))
    if defaults and log:
        logger.info("Sampling defaults from the generation_config (override with --generation-config vllm): %s",
                    defaults)
    return defaults
