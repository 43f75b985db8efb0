"""One API process of `pagoda serve`: HTTP, tokenization, chat templates, SSE, in front of the engine core.

`ApiSetup` is everything an API process needs besides the engine (HTTP limits, tokenizer, chat template,
sampling defaults, served names), built from the `ServerConfig`, the `EngineConfig` and the
`MultiModalConfig`: first in the launcher, with its checks (so a bad flag fails with one line before the
core starts), then again in each API process. `run_api_server` is the process's entry point, started while the
core loads the model: the setup, then (once the core is Ready, from the launcher's pipe) its `CoreClient` and the
listening socket; an `AsyncEngine` attached to the core through the client, the app, and uvicorn on that socket
until SIGTERM (drain for `--shutdown-timeout`, then exit 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

import uvicorn

from pagoda import envs
from pagoda.config import EngineConfig
from pagoda.config.multimodal import MultiModalConfig
from pagoda.config.server import ServerConfig
from pagoda.engine.async_engine import AsyncEngine
from pagoda.engine.core_process import CoreClient, Ready
from pagoda.errors import ConfigError, InvalidRequest
from pagoda.frontend.chat_template import inspect_chat_template, load_chat_template, template_folder
from pagoda.frontend.multimodal.chat import multimodal_serving
from pagoda.frontend.prompt_work import PromptWork
from pagoda.frontend.tokenizer import load_tokenizer
from pagoda.lora.adapter_folder import check_adapter_folder
from pagoda.lora.request import parse_lora_modules
from pagoda.models.source import resolve_model_source
from pagoda.server import http_limits
from pagoda.server.app import build_app
from pagoda.server.host_metrics import gpu_collector, process_collector
from pagoda.server.metrics import ENGINE_INDEX, METRICS_PREFIXES, ServerMetrics, cache_config_labels
from pagoda.server.serving import OpenAIServing, ServingContext, sampling_defaults
from pagoda.server.warm_up import warm_up
from pagoda.serving_gc import prepare_gc_for_serving

logger = logging.getLogger("pagoda")

# uvicorn's graceful shutdown cancels what is still running at its timeout, which cuts a stream with
# neither an error event nor [DONE]. So at --shutdown-timeout the engine ends its open requests itself
# (`ApiServer._end_streams`), and uvicorn's own timeout comes this much later: for clients that stopped reading.
STREAM_END_GRACE_S = 2.0


class ApiSetup:
    """Everything an API process needs besides the engine. `check`: the launcher's validation (chat template
    render check, log lines); `preflight`: called once the HTTP limits are known good (doctor's fast checks), returns
    (the path its tokenizer came from, that tokenizer), kept when it is `config.model.tokenizer`'s."""

    def __init__(
        self,
        server: ServerConfig,
        config: EngineConfig,
        multimodal: MultiModalConfig,
        check: bool = True,
        preflight: Any = None,
    ):
        self.server, self.config = server, config
        self.http_limits = http_limits.HttpLimits.from_server(server)  # also raises the file-descriptor limit
        checked: tuple[str | None, Any] = (None, None)
        if preflight is not None:
            checked = preflight()  # shards, headers, tokenizer, port: fail in seconds, before the weights load
        source = resolve_model_source(config.model.model)
        self.multimodal = multimodal_serving(
            source.hf_config, source.folder if source.kind == "hf" else None, multimodal
        )
        self.tokenizer = None
        self.prompts: PromptWork | None = None
        if not config.model.skip_tokenizer_init:
            path = config.model.tokenizer
            # The preflight's tokenizer when it read the same path (`preflight_keeping_tokenizer`).
            reused = checked[1] if checked[0] == path else None
            if reused is None:  # (not `or`: a tokenizer's truth value is its length, the whole vocabulary)
                reused = load_tokenizer(source, path, config.model.trust_remote_code)
            self.tokenizer = reused
        self.names = list(server.served_model_name or [config.model.name])
        # adapter name → LoRARequest: --lora-modules, then --default-mm-loras' under their modalities' names
        self.default_mm_loras = tuple(m for m, _ in config.lora.default_mm_loras) if config.lora else ()
        self.loras = parse_lora_modules(server.lora_modules, config.lora.default_mm_loras if config.lora else ())
        if self.loras and config.lora is None:
            raise ConfigError("--lora-modules needs --enable-lora", "lora_modules")
        for name in self.loras:  # a request's `model` must say which one it means
            if name in self.names:
                raise ConfigError(
                    f"--lora-modules {name}: the adapter's name is also a served model name "
                    f"({', '.join(self.names)}); give the adapter another name (or change --served-model-name)",
                    "lora_modules",
                )
        self.runtime_lora = server.allow_runtime_lora_updating or envs.ALLOW_RUNTIME_LORA_UPDATING.value
        if self.runtime_lora and (config.lora is None or server.api_server_count > 1):
            raise ConfigError(
                "--allow-runtime-lora-updating needs --enable-lora and --api-server-count 1 (each API process keeps "
                "its own adapter names)",
                "allow_runtime_lora_updating",
            )
        for lora in self.loras.values():  # the folder and its config now; the shapes when the engine reads it
            try:
                check_adapter_folder(lora, config.lora.max_lora_rank if config.lora else 0)
            except InvalidRequest as exc:
                raise ConfigError(f"--lora-modules: {exc.message}", "lora_modules") from None
        self.chat_template = load_chat_template(server.chat_template)
        if check and self.tokenizer is not None:
            check_chat_template(self.tokenizer, source, server.chat_template, config.model.tokenizer)
        self.generation_defaults = generation_defaults(server.generation_config, source, sampling_defaults, log=check)

    def prepare_prompts(self) -> None:
        """The prompt work's tables now (the character bound decodes the whole vocabulary: seconds for a
        SentencePiece tokenizer), while the core loads the model, rather than once it is ready."""
        if self.tokenizer is not None:
            self.prompts = PromptWork(self.tokenizer, self.config.model.max_model_len)

    def app(self, engine: AsyncEngine, metrics: ServerMetrics) -> Any:
        config, server = self.config, self.server
        ctx = ServingContext(
            engine=engine,
            tokenizer=self.tokenizer,
            served_model_names=self.names,
            max_model_len=config.model.max_model_len,
            vocab_size=config.model.vocab_size,
            architecture=config.model.architecture,
            chat_template=self.chat_template,
            metrics=metrics,
            generation_defaults=self.generation_defaults,
            max_waiting_requests=server.max_waiting_requests,
            api_server_count=server.api_server_count,
            max_num_seqs=config.scheduler.max_num_seqs,
            log_requests=server.enable_log_requests,
            multimodal=self.multimodal,
            trust_request_chat_template=server.trust_request_chat_template,
            enable_auto_tool_choice=server.enable_auto_tool_choice,
            tool_call_parser=server.tool_call_parser,
            scheduling_policy=config.scheduler.scheduling_policy,
            lora_modules=dict(self.loras),
            default_mm_loras=self.default_mm_loras,
            max_lora_rank=config.lora.max_lora_rank if config.lora else 0,
            runtime_lora_updating=self.runtime_lora,
            prompts=self.prompts,
        )
        engine.add_listener(ctx.metrics.on_engine_outputs)
        # Token ids → text where there is CPU to spare. With several API processes, here: off the engine
        # core, spread over them (benchmarks/profile/api_burst.py). With one, that process already carries all
        # of HTTP and is the bottleneck, so the core keeps it.
        engine.use_tokenizer(self.tokenizer if server.api_server_count > 1 else None)
        return build_app(
            OpenAIServing(ctx),
            api_key=server.api_key_or_env,
            max_request_bytes=self.http_limits.max_request_bytes,
            ui=server.ui,
        )

    def metrics(self, index: int, ready: Ready) -> ServerMetrics:
        """Multiprocess metrics (the supervisor's PROMETHEUS_MULTIPROC_DIR); process 0 counts the engine's totals.
        `ready`: the core's sized cache, for `cache_config_info`."""
        config, name = self.config, self.names[0]
        parallel = config.parallel
        gpu = gpu_collector(
            config.device.device,
            parallel.tensor_parallel_size,
            parallel.distributed_executor_backend,
            (name, ENGINE_INDEX),
        )
        metrics = ServerMetrics(
            name,
            prefixes=METRICS_PREFIXES[self.server.metrics_prefix],
            multiprocess=True,
            count_engine_totals=index == 0,
            max_model_len=config.model.max_model_len,
            collectors=(gpu,) if gpu is not None else (),
            process_collector=process_collector(
                os.environ.get("PROMETHEUS_MULTIPROC_DIR"), self.server.api_server_count
            ),
        )
        metrics.publish_cache_config(cache_config_labels(self.config, ready.num_blocks))
        return metrics


class ApiServer(uvicorn.Server):
    """uvicorn's Server for an API process.

    SIGTERM (from the launcher) starts uvicorn's graceful shutdown, and is not re-raised afterwards, so the
    process exits 0 after the engine is detached; SIGINT stays ignored (a terminal's Ctrl-C reaches the whole
    process group; the launcher decides). `deadline_s` after shutdown begins, `engine.end_streams`: each open
    request fails with a 503 naming the shutdown (a stream's last events: that error and [DONE])."""

    engine: Any = None
    deadline_s: float = 30.0

    @contextlib.contextmanager
    def capture_signals(self):
        original = signal.signal(signal.SIGTERM, self.handle_exit)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, original)

    async def shutdown(self, sockets: Any = None) -> None:
        cut = asyncio.get_running_loop().call_later(self.deadline_s, self._end_streams)
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()

    def _end_streams(self) -> None:
        if self.engine is None:
            return
        if self.engine.num_pending:
            logger.warning(
                "--shutdown-timeout (%g s) reached: ending %d open requests", self.deadline_s, self.engine.num_pending
            )
        self.engine.end_streams(
            f"The server is shutting down: --shutdown-timeout ({self.deadline_s:g} s) ran out "
            "before this request finished; retry it."
        )


def run_api_server(
    server: ServerConfig, config: EngineConfig, multimodal: MultiModalConfig, index: int, launcher: Connection
) -> None:
    """Process entry point (started by the launcher's Supervisor while the core loads the model): the setup,
    then this process's `CoreClient` and the listening socket from `launcher` once the core is Ready."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # Its own work (HTTP, tokens, text, image preprocessing) is not parallel math: one thread, so that the
    # engine core's threads keep the cores (each OpenMP thread per core here would compete with them). The
    # process does not import torch itself (its ~250 MB resident); a library that does still gets one thread.
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    setup = ApiSetup(server, config, multimodal, check=False)
    setup.prepare_prompts()
    try:
        client: CoreClient = launcher.recv()
        sock = socket.socket(fileno=reduction.recv_handle(launcher))
    except EOFError:  # the launcher stopped before the core was Ready (it says why)
        return
    finally:
        launcher.close()
    assert client.index == index, (client.index, index)
    asyncio.run(serve_api(setup, config, client, sock))


async def serve_api(setup: ApiSetup, config: EngineConfig, client: CoreClient, sock: socket.socket) -> None:
    server = setup.server
    engine = AsyncEngine(config, client)
    await engine.start()
    try:
        app = setup.app(engine, setup.metrics(client.index, client.ready))
        if envs.API_WARM_UP.value:
            done = await warm_up(app.state.serving)
            if done is not None:
                logger.debug(
                    "API process %d prepared a warm-up prompt of %d tokens in %.0f ms",
                    client.index,
                    done.prompt_tokens,
                    done.ms,
                )
        prepare_gc_for_serving()
        uv = ApiServer(
            uvicorn.Config(
                app,
                log_level=server.uvicorn_log_level,
                access_log=False,
                # uvicorn annotates it int but waits on a float timeout (asyncio.wait_for)
                timeout_graceful_shutdown=server.shutdown_timeout + STREAM_END_GRACE_S,  # type: ignore[arg-type]
                **setup.http_limits.uvicorn_args(),
            )
        )
        uv.engine, uv.deadline_s = engine, server.shutdown_timeout
        await uv.serve(sockets=[sock])
    finally:
        await engine.shutdown()


def check_chat_template(tokenizer: Any, source: Any, override: str | None, tokenizer_path: str) -> None:
    """Log which chat template serves chats; stop here (seconds, not at the first chat request) when
    it cannot render a plain conversation; warn when its prompt is not the model family's format.
    A model without a template still serves completions: that is only logged."""
    report = inspect_chat_template(
        tokenizer, source.hf_config, override, template_folder(tokenizer_path, source.location)
    )
    if report.error:
        raise ConfigError(
            f"the chat template ({report.origin}) does not render a user/assistant conversation: "
            f"{report.error} → {report.fix}",
            "chat_template",
        )
    if report.template is None:
        logger.info(
            "Chat template: none (the tokenizer has none): /v1/chat/completions answers 400, completions "
            "work; pass --chat-template to serve chats"
        )
        return
    logger.info("Chat template: %s", report.origin)
    if report.warning:
        logger.warning("Chat template: %s → %s", report.warning, report.fix)


def generation_defaults(choice: str, source: Any, to_defaults: Any, log: bool = True) -> dict:
    """`--generation-config`: the sampling defaults of 'auto' (the model's), 'vllm' (none) or a folder's file."""
    if choice == "vllm":
        return {}
    if choice == "auto":
        defaults = to_defaults(source.generation_config())
    else:
        path = os.path.join(choice, "generation_config.json")
        if not os.path.isfile(path):
            raise ConfigError(
                f"--generation-config {choice!r}: no generation_config.json there; use auto, vllm "
                "or a folder that has one."
            )
        with open(path) as f:
            defaults = to_defaults(json.load(f))
    if defaults and log:
        logger.info(
            "Sampling defaults from the generation_config (override with --generation-config vllm): %s", defaults
        )
    return defaults
