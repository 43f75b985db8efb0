"""`pagoda doctor`'s command line and its report: one line per check, then the counts; exit 1 on any FAIL."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from pagoda.tools.doctor.check import Check
from pagoda.tools.doctor.run import ENGINE_DEFAULTS, SERVER_DEFAULTS, run_checks

_TAGS = {"ok": "[ ok ]", "warn": "[warn]", "FAIL": "[FAIL]"}


def format_report(checks: list[Check]) -> str:
    lines = []
    for c in checks:
        line = f"{_TAGS[c.status]} {c.name}: {c.detail}"
        if c.fix and c.status != "ok":
            line += f" → {c.fix}"
        lines.append(" ".join(line.split()))  # one line per check, even for multi-line errors
    return "\n".join(lines)


def failed(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.status == "FAIL"]


def add_doctor_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="HF model folder, hub id or .gguf file (default: the embedded model)",
    )
    parser.add_argument("--model", default=None, help="same as MODEL")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder or hub id (default: the model's)")
    parser.add_argument("--port", type=int, default=None, help="check that the server port is free")
    engine = ENGINE_DEFAULTS
    parser.add_argument("--host", default=SERVER_DEFAULTS.host, help="address the server will bind (with --port)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=engine.tensor_parallel_size)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=engine.pipeline_parallel_size)
    parser.add_argument(
        "--distributed-executor-backend",
        default=engine.distributed_executor_backend,
        choices=("mp", "ray"),
        help="ray: the ranks run on a Ray cluster, so this machine's GPU count does not limit -tp",
    )
    parser.add_argument("--device", default=engine.device, choices=("auto", "cpu", "cuda"))
    parser.add_argument("--chat-template", default=None, help="template the server will use: a file or the text")
    parser.add_argument("--skip-tokenizer-init", action="store_true", help="the server will run without a tokenizer")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--fast", action="store_true", help="only the checks `pagoda serve` runs before loading")
    parser.add_argument(
        "--no-checksums",
        action="store_true",
        help="do not hash the weight files against SHA256SUMS / *.sha256 / the HF cache (minutes for 100 GB)",
    )
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")


def run_doctor(ns: argparse.Namespace) -> int:
    """Print the report; 1 when any check FAILs, else 0."""
    model = getattr(ns, "model_tag", None) or getattr(ns, "model", None)
    checks = run_checks(
        model,
        port=ns.port,
        tensor_parallel_size=ns.tensor_parallel_size,
        pipeline_parallel_size=ns.pipeline_parallel_size,
        distributed_executor_backend=ns.distributed_executor_backend,
        fast=ns.fast,
        tokenizer=ns.tokenizer,
        host=ns.host,
        device=ns.device,
        skip_tokenizer_init=ns.skip_tokenizer_init,
        chat_template=ns.chat_template,
        trust_remote_code=ns.trust_remote_code,
        checksums=not getattr(ns, "no_checksums", False),
    )
    counts = {s: sum(c.status == s for c in checks) for s in ("ok", "warn", "FAIL")}
    if ns.json:
        print(json.dumps({"model": model, "checks": [asdict(c) for c in checks], "counts": counts}, indent=2))
    else:
        print(format_report(checks))
        print(f"{counts['ok']} ok, {counts['warn']} warn, {counts['FAIL']} FAIL")
    return 1 if counts["FAIL"] else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda doctor", description="preflight checks of a model and this machine")
    add_doctor_args(parser)
    return run_doctor(parser.parse_args(argv))
