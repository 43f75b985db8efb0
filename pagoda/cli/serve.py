"""`pagoda serve [MODEL] [flags]`: the OpenAI-compatible server, with `vllm serve`'s flags.

One topology, whatever `--api-server-count N` (N >= 1, default 1):

```
launcher (this process: no HTTP)           validates flags, preflight, tokenizer, chat template first,
  │                                          then supervises from a fresh image (launch/supervise.py)
  ├─ engine core (started first; loads the model once)   core_process.CoreProcess / run_engine_core
  └─ API process i = 0..N-1 (started beside the core; serves once it is Ready)   server/api_process.run_api_server
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
import functools
import logging
import sys

from pagoda.cli.args import add_config_args, add_engine_args, config_from
from pagoda.cli.vllm_flags import add_vllm_flags, vllm_only_flags
from pagoda.config import EngineArgs, EngineConfig
from pagoda.config.engine import DEFAULT_MODEL_NAME
from pagoda.config.multimodal import MultiModalConfig
from pagoda.config.server import ServerConfig
from pagoda.errors import ConfigError
from pagoda.launch.preflight import preflight_keeping_tokenizer

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
        plan = prepare(ns)
    except ConfigError as exc:
        print(f"pagoda: error: {exc.message}", file=sys.stderr)
        return 2
    from pagoda.launch.supervise import launch  # lazy: the engine core's process contract (see `prepare`)

    return launch(plan)


def prepare(ns: argparse.Namespace):  # type: ignore[no-untyped-def]
    """Every one-line startup error, before the model loads: the configs (built once, here), the flags this
    server refuses, doctor's fast checks, tokenizer and chat template. Returns the `LaunchPlan`."""
    # `pagoda --help` and the other subcommands import this module too.
    from pagoda.launch.supervise import LaunchPlan  # lazy: the engine core's process contract
    from pagoda.server.api_process import ApiSetup  # lazy: transformers, FastAPI (only `serve` needs them)

    engine_args = config_from(ns, EngineArgs)
    server = config_from(ns, ServerConfig)
    multimodal = config_from(ns, MultiModalConfig)
    server.check()
    config = EngineConfig.create(engine_args)
    preflight = None if server.skip_preflight else functools.partial(preflight_keeping_tokenizer, engine_args, server)
    setup = ApiSetup(server, config, multimodal, check=True, preflight=preflight)
    # The API processes number the adapters alike; the names are for the startup log.
    return LaunchPlan(server, config, multimodal, tuple(setup.loras.values()), tuple(setup.names))
