"""`pagoda serve`'s own flags (everything but the engine's and the model tag): one frozen `ServerConfig`.

Each field is one flag and carries its help (`knob`); `cli/args.add_config_args(parser, ServerConfig)` generates
the flags, `cli.args.config_from(ns, ServerConfig)` builds the config once in the launcher, and that object (never the
argparse Namespace) is what every API process and `pagoda doctor`'s serve preflight receive.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pagoda import envs
from pagoda.config.knobs import knob
from pagoda.errors import ConfigError

# What one request or connection may cost an API process (enforced by pagoda/server/http_limits.py, whose
# `HttpLimits` takes these defaults from here).
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024  # images travel base64-encoded inside the JSON body
DEFAULT_MAX_HEADER_BYTES = 64 * 1024  # request line + headers; nginx allows 32 KiB, Node 16 KiB
DEFAULT_MAX_HEADER_COUNT = 256  # vLLM's --h11-max-header-count default
DEFAULT_HEADER_TIMEOUT_S = 60.0  # nginx's client_header_timeout, Node's headersTimeout
DEFAULT_BODY_TIMEOUT_S = 300.0
# Long: an unused connection costs one descriptor, and clients that open connections ahead of use
# (pools, pinned connections) must not lose them; the connection cap covers a flood of them.
DEFAULT_IDLE_CONNECTION_TIMEOUT_S = 300.0
METRICS_PREFIX_CHOICES = ("both", "vllm", "pagoda")
TOOL_CALL_PARSERS = ("hermes", "qwen", "json")  # frontend/tool_calls/parsers.py

logger = logging.getLogger("pagoda")


@dataclass(frozen=True)
class ServerConfig:
    """The serve-only flags, spelled, defaulted and explained exactly as `pagoda serve --help` shows them."""

    host: str = knob("0.0.0.0", None)
    port: int = knob(8000, None)
    served_model_name: tuple[str, ...] | None = knob(
        None,
        "names clients use in 'model' (default: MODEL as given, e.g. a hub id or folder path; with no MODEL, "
        "the embedded model's name SmolLM2-135M-Instruct)",
    )
    lora_modules: tuple[str, ...] | None = knob(
        None,
        'LoRA adapters clients name in \'model\': name=path (a PEFT folder) or JSON {"name": ..., "path": ...}, '
        "several after one flag; needs --enable-lora",
    )
    allow_runtime_lora_updating: bool = knob(
        False,
        "serve /v1/load_lora_adapter and /v1/unload_lora_adapter (also VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); "
        "needs --enable-lora and one API process",
        store_true=True,
    )
    api_key: str | None = knob(None, "require 'Authorization: Bearer KEY' (or set PAGODA_API_KEY)")
    enable_chunked_prefill: bool = knob(True, "always on; accepted for vLLM compatibility")
    chat_template: str | None = knob(None, "Jinja chat template: a file or the template text")
    trust_request_chat_template: bool = knob(
        False,
        "let a chat request carry its own chat_template (rendered in a time- and size-bounded sandbox); "
        "without it such a request gets 400",
        store_true=True,
    )
    enable_auto_tool_choice: bool = knob(
        False, "let the model decide to call tools (tool_choice 'auto'); needs --tool-call-parser", store_true=True
    )
    tool_call_parser: str | None = knob(
        None,
        "how the model writes tool calls: hermes (alias qwen: <tool_call> blocks, the Qwen2/Qwen2-VL and Hermes "
        "templates) or json (a bare JSON call object, for models whose template has no tool format)",
        choices=TOOL_CALL_PARSERS,
    )
    enable_log_requests: bool = knob(False, "log one line per request", store_true=True)
    disable_log_requests: bool = knob(False, "accepted for compatibility (default)", store_true=True)
    disable_log_stats: bool = knob(False, "accepted for compatibility", store_true=True)
    generation_config: str = knob(
        "auto",
        "'auto': sampling defaults from the model's generation_config.json; 'vllm': none; or a folder "
        "holding a generation_config.json",
    )
    max_waiting_requests: int | None = knob(
        None, "answer 503 + Retry-After when this many requests are already waiting"
    )
    max_request_bytes: int = knob(
        DEFAULT_MAX_REQUEST_BYTES, "413 for a request body over this many bytes (default 32 MiB; images travel in it)"
    )
    max_header_bytes: int = knob(
        DEFAULT_MAX_HEADER_BYTES,
        "431 for a request line and headers over this many bytes (default 64 KiB)",
        flags=("--h11-max-incomplete-event-size",),
    )
    max_header_count: int = knob(
        DEFAULT_MAX_HEADER_COUNT, "431 beyond this many headers (default 256)", flags=("--h11-max-header-count",)
    )
    header_timeout: float = knob(
        DEFAULT_HEADER_TIMEOUT_S,
        "408 and close when a request's headers take longer from its first byte, in s (default 60)",
    )
    body_timeout: float = knob(
        DEFAULT_BODY_TIMEOUT_S, "408 and close when a request's body takes longer after its headers, in s (default 300)"
    )
    idle_connection_timeout: float = knob(
        DEFAULT_IDLE_CONNECTION_TIMEOUT_S, "close a new connection that sends nothing for this many s (default 300)"
    )
    # None: VLLM_HTTP_TIMEOUT_KEEP_ALIVE or 75, resolved when the config is built (`__post_init__`). Longer than
    # clients keep an idle pooled connection (httpx 5 s, aiohttp 15 s, vLLM's benchmark client 60 s): a server that
    # closes first can close a connection just as the client sends on it, and that request fails with a reset.
    timeout_keep_alive: float | None = knob(
        None, "close an idle keep-alive connection after this many s (default 75, or VLLM_HTTP_TIMEOUT_KEEP_ALIVE)"
    )
    max_connections: int | None = knob(
        None,
        "503 and close for new connections beyond this many per API process (default: the file-descriptor "
        "limit, raised to its hard limit, less a tenth; at most 65536)",
    )
    shutdown_timeout: float = knob(
        30.0,
        "seconds in-flight requests get to finish after SIGTERM; those still running then end with a 503 "
        "error (streams: an error event, then [DONE])",
    )
    metrics_prefix: str = knob(
        "both",
        "/metrics names: both vllm:NAME and pagoda:NAME, same values (default), or one of them",
        choices=METRICS_PREFIX_CHOICES,
    )
    api_server_count: int = knob(
        1,
        "API server processes (HTTP, tokenization, SSE) in front of the one engine core, all serving "
        "--host:--port (default 1)",
        flags=("-asc",),
    )
    ui: bool = knob(
        True,
        "serve the web playground at / and the live dashboard at /dashboard (static pages that call the API "
        "from the browser; they load without the API key and ask for it); --no-ui turns them off",
    )
    uvicorn_log_level: str = knob("warning", None)
    skip_preflight: bool = knob(
        False, "do not run `pagoda doctor`'s fast checks before loading the model", store_true=True
    )

    def __post_init__(self) -> None:
        if self.timeout_keep_alive is None:
            object.__setattr__(self, "timeout_keep_alive", float(envs.HTTP_TIMEOUT_KEEP_ALIVE.value))
        if self.served_model_name is not None and not isinstance(self.served_model_name, tuple):
            object.__setattr__(self, "served_model_name", tuple(self.served_model_name))
        if self.lora_modules is not None and not isinstance(self.lora_modules, tuple):
            object.__setattr__(self, "lora_modules", tuple(self.lora_modules))

    @property
    def api_key_or_env(self) -> str | None:
        return self.api_key or envs.API_KEY.value

    def check(self) -> None:
        """The one-line refusals of what this server does not do (ConfigError)."""
        if self.api_server_count < 1:
            raise ConfigError(f"--api-server-count must be at least 1 (got {self.api_server_count}).")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_CALL_PARSERS)}).")
        if self.enable_chunked_prefill is False:
            logger.warning("--no-enable-chunked-prefill ignored: chunked prefill is always on")
