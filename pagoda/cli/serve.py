"""`pagoda serve [MODEL] [flags]`: the OpenAI-compatible server, with `vllm serve`'s flags.

The engine core starts in its own process first (so a bad flag or a model that does not fit fails
with one line before any port is opened), then uvicorn serves until SIGTERM/SIGINT: new requests
stop, in-flight ones get `--shutdown-timeout` seconds to finish, and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

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
        return asyncio.run(_serve(ns))
    except ConfigError as exc:
        print(f"pagoda: error: {exc.message}", file=sys.stderr)
        return 2


def _unsupported(ns: argparse.Namespace) -> None:
    if ns.tensor_parallel_size != 1:
        raise ConfigError("--tensor-parallel-size > 1 is not supported yet; use 1.")
    if ns.pipeline_parallel_size != 1:
        raise ConfigError("--pipeline-parallel-size > 1 is not supported; use 1.")
    if ns.enable_chunked_prefill is False:
        logger.warning("--no-enable-chunked-prefill ignored: chunked prefill is always on")


async def _serve(ns: argparse.Namespace) -> int:
    import uvicorn

    from pagoda.config import EngineConfig
    from pagoda.engine.async_engine import AsyncEngine
    from pagoda.frontend.chat_template import load_chat_template
    from pagoda.frontend.tokenizer import load_tokenizer
    from pagoda.models.gguf_checkpoint import DEFAULT_SERVED_NAME
    from pagoda.models.source import resolve_model_source
    from pagoda.server.app import build_app
    from pagoda.server.metrics import ServerMetrics
    from pagoda.multimodal.chat import multimodal_serving
    from pagoda.server.serving import OpenAIServing, ServingContext, sampling_defaults

    _unsupported(ns)
    config = EngineConfig.create(engine_args_from(ns))
    if not ns.skip_preflight:
        from pagoda.tools.doctor import serve_preflight

        serve_preflight(ns)          # shards, headers, tokenizer, port: fail in seconds, before the weights load
    source = resolve_model_source(config.model.model)
    multimodal = multimodal_serving(source.hf_config, source.folder if source.kind == "hf" else None,
                                    ns.limit_mm_per_prompt, ns.mm_processor_kwargs, ns.allowed_local_media_path,
                                    ns.allow_private_media_urls)
    tokenizer = None
    if not config.model.skip_tokenizer_init:
        tokenizer = load_tokenizer(source, config.model.tokenizer, config.model.trust_remote_code)
    names = ns.served_model_name or [ns.model or DEFAULT_SERVED_NAME]
    engine = AsyncEngine(config)
    await engine.start()
    try:
        ctx = ServingContext(
            engine=engine, tokenizer=tokenizer, served_model_names=names, max_model_len=config.model.max_model_len,
            vocab_size=config.model.vocab_size, architecture=config.model.architecture,
            chat_template=load_chat_template(ns.chat_template), metrics=ServerMetrics(names[0]),
            generation_defaults=_generation_defaults(ns.generation_config, source, sampling_defaults),
            max_waiting_requests=ns.max_waiting_requests, log_requests=ns.enable_log_requests,
            multimodal=multimodal)
        engine.add_listener(ctx.metrics.on_engine_outputs)
        app = build_app(OpenAIServing(ctx), api_key=ns.api_key or os.environ.get("PAGODA_API_KEY"))
        ready = engine.ready
        assert ready is not None
        logger.info("model=%s served as %s dtype=%s device=%s", config.model.model, ", ".join(names),
                    config.model.dtype, config.device.device)
        logger.info("KV cache: %d blocks of %d tokens; maximum concurrency for %d-token requests: %.2fx",
                    ready.num_blocks, ready.block_size, config.model.max_model_len, ready.max_concurrency)
        logger.info("Serving on http://%s:%d (OpenAI API under /v1)", ns.host, ns.port)
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


def _generation_defaults(choice: str, source, to_defaults) -> dict:  # type: ignore[no-untyped-def]
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
    if defaults:
        logger.info("Sampling defaults from generation_config.json (override with --generation-config vllm): %s",
                    defaults)
    return defaults
