"""`pagoda serve [MODEL] [flags]`: the OpenAI-compatible server, with `vllm serve`'s flags.

One topology, whatever `--api-server-count N` (N >= 1, default 1):

```
launcher (this process: no HTTP)           validates flags, preflight, tokenizer, chat template first
  ├─ engine core (started first; loads the model once)   core_process.CoreProcess / run_engine_core
  └─ API process i = 0..N-1 (started once the core is Ready)   server/api_process.run_api_server
        the same app on the launcher's one listening socket (the kernel hands each new connection to
        whichever process accepts it first), its AsyncEngine attached to the core as client i
```

The children are started and watched by `processes.Supervisor` (they die with the launcher; metrics go through
its Prometheus multiprocess directory, so /metrics sums over the processes). SIGTERM/SIGINT → SIGTERM to
every API process (each drains its in-flight requests for `--shutdown-timeout`; those still running then end
with a 503 error), then Shutdown to the core, exit 0. If the core dies, or stops beating (hung: then it is
killed), every API process is told (CoreDied: in-flight requests fail, /health answers 503), they are
stopped and the launcher exits 1 with one line; likewise if an API process dies.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pagoda.cli.args import add_config_args, add_engine_args, config_from
from pagoda.cli.vllm_flags import add_vllm_flags, vllm_only_flags
from pagoda.config import EngineArgs, EngineConfig
from pagoda.config.engine import DEFAULT_MODEL_NAME
from pagoda.config.multimodal import MultiModalConfig
from pagoda.config.server import ServerConfig
from pagoda.errors import ConfigError
from pagoda.launch.preflight import serve_preflight
from pagoda.processes.sockets import listen_socket
from pagoda.processes.supervisor import Supervisor

logger = logging.getLogger("pagoda")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "The OpenAI-compatible server, with vllm serve's flags. Without MODEL it serves the embedded "
        f"{DEFAULT_MODEL_NAME} under that name; a MODEL is served under the name as given (a hub id or a path) "
        "unless --served-model-name names it. vLLM flags Pagoda does not have are refused with the reason, or, "
        "for those that only tune vLLM internals, accepted with a warning (docs/serving.md lists them)."
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help=f"model folder, hub id or .gguf (same as --model; default: the embedded {DEFAULT_MODEL_NAME})",
    )
    add_engine_args(parser)
    add_config_args(parser, ServerConfig)
    add_config_args(parser, MultiModalConfig)
    add_vllm_flags(parser)  # last: vLLM's flags that Pagoda has are skipped there


def serve(ns: argparse.Namespace) -> int:
    refusals, warnings = vllm_only_flags(ns)
    if refusals:
        for line in refusals:
            print(f"pagoda: error: {line}", file=sys.stderr)
        return 2
    for line in warnings:
        logger.warning(line)
    if ns.model_tag is not None:
        ns.model = ns.model_tag
    try:
        return _Launch(*prepare(ns)).run()
    except ConfigError as exc:
        print(f"pagoda: error: {exc.message}", file=sys.stderr)
        return 2


def prepare(ns: argparse.Namespace):  # type: ignore[no-untyped-def]
    """Every one-line startup error, before the model loads: the configs (built once, here), the flags this
    server refuses, doctor's fast checks, tokenizer and chat template. Returns (ApiSetup, MultiModalConfig)."""
    # `pagoda --help` and the other subcommands import this module too.
    from pagoda.server.api_process import ApiSetup  # lazy: torch, transformers, FastAPI (only `serve` needs them)

    engine_args = config_from(ns, EngineArgs)
    server = config_from(ns, ServerConfig)
    multimodal = config_from(ns, MultiModalConfig)
    server.check()
    config = EngineConfig.create(engine_args)
    preflight = None if server.skip_preflight else (lambda: serve_preflight(engine_args, server))
    return ApiSetup(server, config, multimodal, check=True, preflight=preflight), multimodal


class _Launch:
    def __init__(self, setup, multimodal: MultiModalConfig):  # type: ignore[no-untyped-def]
        self.setup, self.multimodal = setup, multimodal
        self.server: ServerConfig = setup.server
        self.supervisor = Supervisor()
        self.core = None
        self.apis: list = []

    def run(self) -> int:
        try:
            return self._run()
        finally:
            self.supervisor.close()
            if self.core is not None:
                self.core.close()

    def _run(self) -> int:
        from pagoda.engine.core_process import CoreProcess  # lazy: torch, the engine (see `prepare`)
        from pagoda.server.api_process import run_api_server  # lazy: torch, FastAPI (see `prepare`)

        server, supervisor = self.server, self.supervisor
        supervisor.catch_signals()
        loras = tuple(self.setup.loras.values())  # parsed and checked by `prepare`; the API processes number them alike
        self.core = core = CoreProcess(supervisor, self.setup.config, server.api_server_count, loras=loras)
        ready = core.wait_ready(stop=lambda: supervisor.stopping)
        if ready is None:  # SIGTERM/SIGINT while the model loaded
            return 0
        sock = _listen_socket(server.host, server.port)
        try:
            for client in core.clients:
                self.apis.append(
                    supervisor.start(
                        f"pagoda-api-{client.index}",
                        run_api_server,
                        (server, self.setup.config, self.multimodal, client, sock),
                        index=client.index,
                    )
                )
        finally:
            sock.close()  # each API process holds its own copy; closing them all frees the port
        self.setup.log_startup(ready)
        return self._watch()

    def _watch(self) -> int:
        supervisor, core, server = self.supervisor, self.core, self.server
        assert core is not None
        dead = supervisor.wait([core.child, *self.apis], poll=core.poll)
        if dead is None:
            logger.info("Shutting down: draining in-flight requests (up to %.0f s)", server.shutdown_timeout)
            supervisor.stop(self.apis, grace=server.shutdown_timeout + 10.0)
            core.shutdown()
            return 0
        if dead is core.child:
            if core.hung is not None:  # found hung: the API processes were told, the core killed
                reason = f"{core.hung}; it was killed"
            else:
                core.poll(0.2)  # a last line it sent just before it exited
                reason = _core_death(core.died_message, dead.pid, dead.exitcode)
                core.tell_core_died(reason)
            supervisor.stop(self.apis, grace=5.0)
            print(f"pagoda: error: {reason}; the API servers were stopped.", file=sys.stderr)
            return 1
        supervisor.stop([a for a in self.apis if a is not dead], grace=5.0)
        core.shutdown()
        print(
            f"pagoda: error: API server {dead.index} exited unexpectedly (exit code {dead.exitcode}); "
            "the server was stopped.",
            file=sys.stderr,
        )
        return 1


def _core_death(message: str | None, pid: int, exitcode: int | None) -> str:
    """Why the core is gone, in one line: the one line it said (a lost tensor-parallel rank), else its exit
    (a traceback it sent goes to the log first)."""
    if message and "\n" not in message.strip():
        return f"the engine core process (pid {pid}) exited with code {exitcode}: {message.strip()}"
    if message:
        logger.error("Engine core failed:\n%s", message)
    return f"the engine core process died (pid {pid}, exit code {exitcode})"


def _listen_socket(host: str, port: int):  # type: ignore[no-untyped-def]
    """The one listening socket every API process accepts from; a bind error is one line."""
    try:
        return listen_socket(host, port)
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc} (is another server using port {port}?)"
        ) from None
