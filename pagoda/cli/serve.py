"""`pagoda serve [MODEL] [flags]`: the OpenAI-compatible server, with `vllm serve`'s flags.

The engine core starts in its own process first (so a bad flag or a model that does not fit fails
with one line before any port is opened), then uvicorn serves until SIGTERM/SIGINT: new requests
stop, in-flight ones get `--shutdown-timeout` seconds to finish, and the process exits 0.
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
    parser.add_argument("--enable-log-requests", action="store_true", help="log one line per request")
    parser.add_argument("--disable-log-requests", action="store_true", help="accepted for compatibility (default)")
    parser.add_argument("--disable-log-stats", action="store_true", help="accepted for compatibility")
    parser.add_argument("--generation-config", default="auto",
                        help="'auto': sampling defaults from the model's generation_config.json; 'vllm': none; "
                             "or a folder holding a generation_config.json")
    parser.add_argument("--max-waiting-requests", type=int, default=None,
                        help="answer 503 + Retry-After when this many requests are already waiting")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGTERM")
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
        from pagoda.multimodal.chat import multimodal_serving
        from pagoda.server.serving import sampling_defaults

        if check:
            _unsupported(ns)
        self.ns = ns
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
            log_requests=ns.enable_log_requests, multimodal=self.multimodal)
        engine.add_listener(ctx.metrics.on_engine_outputs)
        # Token ids → text where there is CPU to spare. With several API processes, here: off the engine
        # core, spread over them (H200, Yuan2-2B, c=256, 4 API processes: 41.9k-43.6k tok/s vs 39.9k-40.1k
        # with the core decoding). With one, that process already carries all of HTTP and was the
        # bottleneck: decoding there too fell from 36.7k to 28.7k tok/s, so the core keeps it.
        engine.use_tokenizer(self.tokenizer if ns.api_server_count > 1 else None)
        return build_app(OpenAIServing(ctx), api_key=ns.api_key or os.environ.get("PAGODA_API_KEY"))

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
    from pagoda.server.metrics import ServerMetrics

    setup = ServeSetup(ns)
    engine = AsyncEngine(setup.config)
    await engine.start()
    try:
        app = setup.app(engine, ServerMetrics(setup.names[0]))
        ready = engine.ready
        assert ready is not None
        setup.log_startup(ready)
        prepare_gc_for_serving()
        server = _server_class()(uvicorn.Config(
            app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
            timeout_graceful_shutdown=ns.shutdown_timeout, access_log=False))
        await server.serve()
    finally:
        await engine.shutdown()
    return 0


def _server_class():  # type: ignore[no-untyped-def]
    import contextlib
    import signal
    import threading

    import uvicorn

    class Server(uvicorn.Server):
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
        logger.info("Sampling defaults from generation_config.json (override with --generation-config vllm): %s",
                    defaults)
    return defaults
