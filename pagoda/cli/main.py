"""`pagoda` command line: thin subcommands over the library.

    pagoda serve [MODEL] [--port 8000] [engine and server flags]   # OpenAI-compatible HTTP server
    pagoda generate "Once upon a time" [--max-tokens 64] [engine flags]
    pagoda chat "What is the capital of France?" [--system ...] [engine flags]
    pagoda chat-template --model M --messages messages.json     # the exact rendered prompt, as repr
    pagoda bench --base-url http://127.0.0.1:8000 --concurrency 1,8,32 --out result.json  # load test any server
    pagoda plan MODEL --gpu h200 [--tp N] [--max-model-len L] [--image 1000x750] [--json]   # KV/memory budget
    pagoda doctor MODEL [--port 8000] [--json]                   # preflight checks, exit 1 on any FAIL
    pagoda router --port 8080 --backend URL --backend URL [--policy session]  # front for several servers
    pagoda batch --input batch.jsonl --output results.jsonl      # OpenAI Batch file (or --images/--urls/--page)

A user mistake (bad flag value, missing model file...) prints one line and exits 2, no traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from pagoda.cli.args import add_engine_args, config_from
from pagoda.cli.serve import add_serve_args, serve
from pagoda.cli.vllm_flags import undot
from pagoda.config import EngineArgs
from pagoda.errors import InvalidRequest, PagodaError
from pagoda.frontend.chat_template import inspect_chat_template, load_chat_template, render_chat, template_folder
from pagoda.tools.bench.cli import add_bench_args, run_bench
from pagoda.tools.doctor import add_doctor_args, run_doctor
from pagoda.tools.plan import add_plan_args, run_plan


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--n", type=int, default=1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_serve_args(serve)
    gen = sub.add_parser("generate", help="complete prompts offline and print the results")
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    chat = sub.add_parser("chat", help="answer one chat message with the model's chat template")
    chat.add_argument("message")
    chat.add_argument("--system", default=None, help="optional system message")
    for p in (gen, chat):
        _sampling_args(p)
        add_engine_args(p)
    tmpl = sub.add_parser("chat-template", help="print the exact prompt a chat template renders (repr)")
    tmpl.add_argument("--model", default=None, help="model folder, hub id or .gguf (default: the embedded model)")
    tmpl.add_argument("--tokenizer", default=None)
    tmpl.add_argument("--messages", required=True, help="JSON file: a list of {role, content} messages")
    tmpl.add_argument("--chat-template", default=None, help="override template: a file or the template text")
    tmpl.add_argument("--no-generation-prompt", action="store_true", help="do not append the assistant header")
    tmpl.add_argument("--trust-remote-code", action="store_true")
    bench = sub.add_parser("bench", help="load-test any OpenAI-compatible server (concurrency sweep, SLO, knee)")
    add_bench_args(bench)
    plan = sub.add_parser("plan", help="memory plan from config.json: weights, KV per token, blocks, concurrency, TP")
    add_plan_args(plan)
    doctor = sub.add_parser("doctor", help="preflight checks of a model folder and this machine")
    add_doctor_args(doctor)
    # lazy: the subcommand's own modules (cli/main.py is the one dispatch); these two are argparse only
    from pagoda.tools.batch.cli import add_batch_args

    add_batch_args(
        sub.add_parser(
            "batch",
            help="run an OpenAI Batch JSONL or images + a prompt against a server, with retries, rate limit and resume",
        )
    )
    from pagoda.tools.router.cli import add_router_args  # lazy: the subcommand's own module (see above)

    add_router_args(
        sub.add_parser(
            "router",
            help="OpenAI-compatible front for several servers: session affinity, health checks, retries, usage per key",
        )
    )
    return parser


def _print_chat_template(ns: argparse.Namespace) -> None:
    """Render without loading weights, so separators can be checked before serving."""
    from pagoda.frontend.tokenizer import load_tokenizer  # lazy: torch (the subcommand's own modules)
    from pagoda.models.source import resolve_model_source  # lazy: torch (the subcommand's own modules)

    try:
        with open(ns.messages) as f:
            messages = json.load(f)
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"--messages {ns.messages!r}: {exc}") from None
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise InvalidRequest('--messages must hold a JSON list of {"role": ..., "content": ...} objects.')
    source = resolve_model_source(ns.model)
    tokenizer_path = ns.tokenizer or source.location
    tokenizer = load_tokenizer(source, tokenizer_path, ns.trust_remote_code)
    text = render_chat(tokenizer, messages, load_chat_template(ns.chat_template), not ns.no_generation_prompt)
    print(repr(text))
    print(f"# {len(tokenizer.encode(text, add_special_tokens=False))} tokens")
    # The check `pagoda serve` and `pagoda doctor` make: a template foreign to the model family is worth a line.
    folder = template_folder(tokenizer_path, source.location)
    report = inspect_chat_template(tokenizer, source.hf_config, ns.chat_template, folder)
    if report.warning:
        print(f"pagoda: warning: chat template: {report.warning} → {report.fix}", file=sys.stderr)


def _run_offline(ns: argparse.Namespace) -> None:
    from pagoda import LLM, SamplingParams  # lazy: torch, the engine (the subcommand's own modules)

    args = config_from(ns, EngineArgs)
    llm = LLM(**{k: v for k, v in vars(args).items()})
    params = SamplingParams(
        n=ns.n, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, max_tokens=ns.max_tokens
    )
    if ns.command == "chat":
        messages = [{"role": "system", "content": ns.system}] if ns.system else []
        messages.append({"role": "user", "content": ns.message})
        outputs = llm.chat(messages, params, use_tqdm=False)
    else:
        outputs = llm.generate(ns.prompts, params, use_tqdm=False)
    for output in outputs:
        for sample in output.outputs:
            text = sample.text if ns.command == "chat" else (output.prompt or "") + sample.text
            print(text.strip() if ns.command == "chat" else text)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        # vLLM's `--speculative-config.method x ...`: the keys gathered into one --speculative-config object
        argv = undot(argv)
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # lazy below: the subcommand's own modules (cli/main.py is the one dispatch)
    try:
        if ns.command == "serve":
            return serve(ns)
        if ns.command == "bench":
            return run_bench(ns)
        if ns.command == "plan":
            return run_plan(ns)
        if ns.command == "doctor":
            return run_doctor(ns)
        if ns.command == "batch":
            from pagoda.tools.batch.cli import run_batch

            return run_batch(ns)
        if ns.command == "router":
            from pagoda.tools.router.cli import run_router

            return run_router(ns)
        if ns.command == "chat-template":
            _print_chat_template(ns)
            return 0
        _run_offline(ns)
    except PagodaError as exc:
        print(f"pagoda: error: {exc.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
