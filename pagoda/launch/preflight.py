"""`pagoda serve`'s preflight: `pagoda doctor`'s fast checks for the serve configs, before the model loads.

A missing shard, an unreadable tokenizer or a taken port then fails in seconds with every FAIL line, instead of
minutes into loading. The launcher runs it (`server.skip_preflight` turns it off); the checks are doctor's, so
`pagoda doctor MODEL --fast` shows the same lines.
"""

from __future__ import annotations

from typing import Any

from pagoda.config import EngineArgs
from pagoda.config.server import ServerConfig
from pagoda.errors import ConfigError
from pagoda.tools.doctor import Check, failed, format_report, run_checks
from pagoda.tools.doctor.check import State


def serve_preflight(engine: EngineArgs, server: ServerConfig, state: State | None = None) -> list[Check]:
    """The fast checks for `pagoda serve`'s configs; raises ConfigError listing every FAIL line. `state`: where the
    checks leave what they loaded (the tokenizer, which the launcher's own setup then need not load again)."""
    checks = run_checks(
        engine.model,
        port=server.port,
        tensor_parallel_size=engine.tensor_parallel_size,
        pipeline_parallel_size=engine.pipeline_parallel_size,
        distributed_executor_backend=engine.distributed_executor_backend,
        fast=True,
        tokenizer=engine.tokenizer,
        host=server.host,
        device=engine.device,
        skip_tokenizer_init=engine.skip_tokenizer_init,
        chat_template=server.chat_template,
        trust_remote_code=engine.trust_remote_code,
        load_format=engine.load_format,
        state=state,
    )
    bad = failed(checks)
    if bad:
        raise ConfigError("preflight failed (`pagoda doctor` shows every check):\n" + format_report(bad))
    return checks


def preflight_keeping_tokenizer(engine: EngineArgs, server: ServerConfig) -> tuple[str | None, Any]:
    """`serve_preflight`, then (the path its tokenizer was loaded from, that tokenizer): the launcher's own setup
    keeps it instead of loading the same one again (seconds: Yuan2's SentencePiece tokenizer takes two)."""
    state = State(model=engine.model, tokenizer_path=engine.tokenizer)
    serve_preflight(engine, server, state)
    return state.tokenizer_from, state.tokenizer
