"""`pagoda bench`: flags and the driver (readiness -> model -> calibration -> points -> analysis -> outputs).

Only argparse is imported at module level, so `pagoda --help` stays cheap; the rest loads when the bench runs.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import sys
from typing import Any

from pagoda import envs
from pagoda.tools.bench import report

DEFAULT_LADDER = "1,8,32,64,128,256"
DEFAULT_SLO_TTFT_P95_MS = 1000.0  # SLO defaults: docs/tools.md, pagoda bench
DEFAULT_SLO_TPOT_P95_MS = 200.0


def _ladder(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("concurrency values must be integers >= 1")
    return sorted(set(values))


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("--request-rate must be > 0 (or inf)")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _optional_ms(text: str) -> float | None:
    if text.strip().lower() in ("none", "off", ""):
        return None
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("an SLO must be > 0 ms (or 'off')")
    return value


def add_bench_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is accepted)")
    g.add_argument("--model", default=None, help="model name to send (default: the first id of GET /v1/models)")
    g.add_argument("--api-key", default=None, help="bearer key (default: $OPENAI_API_KEY or $PAGODA_API_KEY)")
    g.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="chat",
        help="/v1/chat/completions or /v1/completions (default chat)",
    )
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in s, whole request (default 600)")
    g.add_argument(
        "--ready-timeout",
        type=float,
        default=60.0,
        help="wait up to this many s for /health or /v1/models before starting (default 60)",
    )

    g = p.add_argument_group("load")
    g.add_argument(
        "--concurrency",
        type=_ladder,
        default=None,
        help=f"closed-loop ladder, comma list (default {DEFAULT_LADDER}); with --request-rate: one "
        "value, the cap on requests in flight",
    )
    g.add_argument(
        "--request-rate",
        type=_rate,
        default=None,
        help="open loop: mean requests/s with gamma arrivals (inf = all at once)",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier, > 1 more regular",
    )
    g.add_argument(
        "--num-prompts",
        type=_positive,
        default=None,
        help="measured requests per point (default max(8*c, 16); open loop without a cap: 100)",
    )
    g.add_argument("--warmup", type=int, default=None, help="unmeasured requests before each point (default c)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--client-processes",
        type=_positive,
        default=1,
        help="spread each point's requests over N client processes, so the client is not the "
        "bottleneck at high concurrency (default 1; never more than the concurrency)",
    )
    g.add_argument(
        "--prompts-per-concurrency",
        type=_positive,
        default=None,
        help="measured requests per point = this x c (at least 8), instead of --num-prompts",
    )

    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=("random", "jsonl"), default="random")
    g.add_argument(
        "--dataset-path",
        default=None,
        help='jsonl: one object per line with "prompt" or "messages", optional "max_tokens"',
    )
    g.add_argument(
        "--input-len",
        type=_positive,
        default=1024,
        help="random dataset: target usage.prompt_tokens per request, chat template included "
        "(calibrated with two probe requests; default 1024)",
    )
    g.add_argument("--output-len", type=_positive, default=128, help="max_tokens per request (default 128)")
    g.add_argument("--ignore-eos", action="store_true", help='send "ignore_eos": true (vLLM extra field)')
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature sent (default 0)")
    g.add_argument(
        "--image",
        default=None,
        metavar="WxH[,WxH...]",
        help="vLLM's random-mm workload: every chat request carries a random JPEG of this size (base64 data "
        "URI, from --seed) after its random text, which is then --input-len tokens by itself (template and "
        "image not counted); a list cycles through the sizes",
    )
    g.add_argument("--images-per-request", type=_positive, default=1, help="images per request (default 1)")
    g.add_argument(
        "--image-detail",
        choices=("auto", "low", "high"),
        default=None,
        help="OpenAI's image_url.detail on every image (default: not sent; on Pagoda low is a 512x512 budget)",
    )
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    g.add_argument(
        "--no-calibrate",
        action="store_true",
        help="random dataset: assume one token per word instead of probing the server",
    )

    g = p.add_argument_group("SLO")
    g.add_argument(
        "--slo-ttft-p95-ms",
        type=_optional_ms,
        default=DEFAULT_SLO_TTFT_P95_MS,
        help=f"p95 TTFT limit per point (default {DEFAULT_SLO_TTFT_P95_MS:g}; 'off' to drop)",
    )
    g.add_argument(
        "--slo-tpot-p95-ms",
        type=_optional_ms,
        default=DEFAULT_SLO_TPOT_P95_MS,
        help=f"p95 TPOT limit per point (default {DEFAULT_SLO_TPOT_P95_MS:g}; 'off' to drop)",
    )
    g.add_argument("--slo-max-error-rate", type=float, default=0.01, help="error-rate limit (default 0.01)")

    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help="write the sweep result JSON here")
    g.add_argument("--csv", default=None, help="write one CSV row per point here")
    g.add_argument("--plot", default=None, help="write a PNG of throughput and p95 TTFT/TPOT vs concurrency")
    g.add_argument(
        "--save-detailed",
        action="store_true",
        help="keep per-request timings (ttft, e2el, itl, tokens, error) under points[].requests",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


class BenchUsageError(Exception):
    pass


def _plan_points(ns: argparse.Namespace) -> list[Any]:
    from pagoda.tools.bench.runner import PointConfig  # lazy: numpy, httpx (every `pagoda` run imports this)

    if ns.burstiness <= 0:
        raise BenchUsageError("--burstiness must be > 0")
    if ns.warmup is not None and ns.warmup < 0:
        raise BenchUsageError("--warmup must be >= 0")
    if ns.request_rate is not None:
        if ns.concurrency is not None and len(ns.concurrency) > 1:
            raise BenchUsageError("--request-rate takes at most one --concurrency value (the cap), not a ladder")
        cap = ns.concurrency[0] if ns.concurrency else None
        n = ns.num_prompts or (max(8 * cap, 16) if cap else 100)
        warmup = ns.warmup if ns.warmup is not None else (cap or 1)
        return [PointConfig(cap, n, warmup, ns.request_rate, ns.burstiness, open_loop=True)]
    ladder = ns.concurrency or _ladder(DEFAULT_LADDER)
    if ns.prompts_per_concurrency and ns.num_prompts:
        raise BenchUsageError("give --num-prompts or --prompts-per-concurrency, not both")

    def count(c: int) -> int:
        if ns.prompts_per_concurrency:
            return max(ns.prompts_per_concurrency * c, 8)
        return ns.num_prompts or max(8 * c, 16)

    return [PointConfig(c, count(c), c if ns.warmup is None else ns.warmup) for c in ladder]


def _build_workload(ns: argparse.Namespace, model: str) -> Any:
    from pagoda.tools.bench.workload import (  # lazy: numpy (every `pagoda` run imports this)
        Workload,
        load_jsonl,
        parse_image_sizes,
    )

    try:
        sizes = parse_image_sizes(ns.image)
    except ValueError as exc:
        raise BenchUsageError(str(exc)) from None
    if sizes and ns.endpoint != "chat":
        raise BenchUsageError("--image needs --endpoint chat")
    if ns.image_detail and not sizes:
        raise BenchUsageError("--image-detail needs --image (it is sent with the random images)")
    specs = None
    if ns.dataset == "jsonl":
        if not ns.dataset_path:
            raise BenchUsageError("--dataset jsonl needs --dataset-path")
        try:
            specs = load_jsonl(ns.dataset_path)
        except (OSError, ValueError) as exc:
            raise BenchUsageError(f"--dataset-path: {exc}") from None
    extra = {}
    if ns.extra_body:
        try:
            extra = json.loads(ns.extra_body)
        except ValueError as exc:
            raise BenchUsageError(f"--extra-body is not JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise BenchUsageError("--extra-body must be a JSON object")
    return Workload(
        endpoint=ns.endpoint,
        model=model,
        input_len=ns.input_len,
        output_len=ns.output_len,
        seed=ns.seed,
        dataset=ns.dataset,
        dataset_specs=specs,
        image_sizes=sizes,
        images_per_request=ns.images_per_request,
        image_detail=ns.image_detail,
        ignore_eos=ns.ignore_eos,
        temperature=ns.temperature,
        extra_body=extra,
    )


def _where(p: dict[str, Any]) -> str:
    if p.get("mode") != "open":
        return f"c={p['concurrency']}"
    return f"rate={p['request_rate']}/s" + (f" c<={p['concurrency']}" if p.get("concurrency") else "")


def _point_line(p: dict[str, Any]) -> str:
    def ms(key: str) -> str:
        v = p.get(key)
        return "n/a" if v is None else f"{v:.0f} ms" if v >= 100 else f"{v:.1f} ms"

    where = _where(p)
    return (
        f"{where}: {p['completed']} ok, {p['failed']} failed, {p['output_throughput']:.1f} out tok/s, "
        f"p95 TTFT {ms('p95_ttft_ms')}, p95 TPOT {ms('p95_tpot_ms')}, SLO {'pass' if p['slo_pass'] else 'FAIL'}"
    )


def run_bench(ns: argparse.Namespace) -> int:
    try:
        return _run(ns)
    except BenchUsageError as exc:
        print(f"pagoda bench: error: {exc}", file=sys.stderr)
        return 2


def _run(ns: argparse.Namespace) -> int:
    # lazy: numpy, httpx (every `pagoda` run imports this)
    from pagoda.tools.bench.client import auth_headers, first_model, wait_ready
    from pagoda.tools.bench.metrics import SLO
    from pagoda.tools.bench.runner import Target, calibrate, run_point
    from pagoda.tools.bench.sweep import KNEE_MIN_GAIN, analyze

    for name in ("httpx", "httpcore", "matplotlib"):
        logging.getLogger(name).setLevel(logging.WARNING)
    plan = _plan_points(ns)
    root = ns.base_url.rstrip("/")
    root = root.removesuffix("/v1")
    api_key = ns.api_key or envs.OPENAI_API_KEY.value or envs.API_KEY.value
    headers = auth_headers(api_key)

    problem = wait_ready(root, headers, ns.ready_timeout)
    if problem is not None:
        raise BenchUsageError(f"{root} not ready after {ns.ready_timeout:g} s ({problem})")
    model = ns.model
    if model is None:
        try:
            model = first_model(root, headers)
        except Exception as exc:  # noqa: BLE001 - HTTP or JSON trouble: one line, exit 2
            raise BenchUsageError(f"cannot pick a model: {exc}") from None
    workload = _build_workload(ns, model)
    target = Target(root=root, headers=headers, timeout=ns.timeout, endpoint=ns.endpoint)
    slo = SLO(ns.slo_ttft_p95_ms, ns.slo_tpot_p95_ms, ns.slo_max_error_rate)

    calibration: dict[str, Any] = {"calibrated": False, "reason": "dataset is not random"}
    if ns.dataset == "random":
        if ns.no_calibrate:
            calibration = {"calibrated": False, "reason": "--no-calibrate", "words_per_prompt": ns.input_len}
        else:
            calibration = asyncio.run(calibrate(target, workload))
            if not calibration["calibrated"]:
                print(
                    f"pagoda bench: prompt calibration failed ({calibration['reason'][:200]}); "
                    f"assuming one token per word",
                    file=sys.stderr,
                )
            elif calibration.get("note"):
                print(f"pagoda bench: {calibration['note']}", file=sys.stderr)

    config = {
        "base_url": root,
        "model": model,
        "endpoint": ns.endpoint,
        "dataset": ns.dataset,
        "dataset_path": ns.dataset_path,
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "ignore_eos": ns.ignore_eos,
        "temperature": ns.temperature,
        "image_sizes": ns.image,
        "images_per_request": ns.images_per_request if ns.image else 0,
        "image_detail": ns.image_detail,
        "concurrency": [p.concurrency for p in plan],
        "request_rate": ns.request_rate,
        "burstiness": ns.burstiness,
        "num_prompts": [p.num_prompts for p in plan],
        "warmup": [p.warmup for p in plan],
        "seed": ns.seed,
        "timeout": ns.timeout,
        "extra_body": workload.extra_body or None,
        "slo": {"ttft_p95_ms": slo.ttft_p95_ms, "tpot_p95_ms": slo.tpot_p95_ms, "max_error_rate": slo.max_error_rate},
        "calibration": calibration,
        "timing": (
            "closed loop: a request's clock starts when it gets a concurrency slot, so TTFT/E2EL include "
            "server-side queueing but not client-side waiting; open loop with a cap reports the client "
            "wait as *_client_queue_ms. TTFT/ITL/E2EL use token chunks (any chunk with choices, empty text "
            "included; not a chat role preamble); output tokens are usage.completion_tokens; duration = "
            "first request dispatched -> last response done (vLLM's benchmark_duration)"
        ),
        "knee_rule": (
            f"first c where the next rung adds < {KNEE_MIN_GAIN * 100:.0f}% output throughput per doubling of c"
        ),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }

    points: list[dict[str, Any]] = []
    interrupted = False
    try:
        for i, cfg in enumerate(plan):
            point = asyncio.run(
                run_point(
                    target, workload, cfg, slo, ns.seed + i, not ns.no_progress, ns.save_detailed, ns.client_processes
                )
            )
            points.append(point)
            print(_point_line(point), file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print("pagoda bench: interrupted; reporting the finished points", file=sys.stderr)

    summary = {"config": config, "points": points, **analyze(points, slo)}
    if interrupted:
        summary["interrupted"] = True
    print()
    print(f"pagoda bench: {model} at {root} ({ns.endpoint}), {len(points)} point(s)")
    if points:
        print(report.format_table(points))
    print()
    print(f"knee (output throughput): {summary['knee_concurrency']}")
    print(f"largest concurrency meeting the SLO: {summary['max_concurrency_meeting_slo']}")
    print(f"recommended --max-num-seqs: {summary['recommended_max_num_seqs']}")
    for line in summary["evidence"]:
        print(f"  - {line}")
    shown = 0
    for p in points:
        for err in p.get("errors", [])[: max(0, 3 - shown)]:
            print(f"error ({_where(p)}): {err[:500]}")
            shown += 1
    if ns.out:
        report.write_json(ns.out, summary)
        print(f"wrote {ns.out}")
    if ns.csv:
        report.write_csv(ns.csv, points)
        print(f"wrote {ns.csv}")
    if ns.plot:
        skipped = report.plot(ns.plot, points, summary)
        print(f"plot skipped: {skipped}" if skipped else f"wrote {ns.plot}")
    if interrupted:
        return 130
    if points and not any(p["completed"] for p in points):
        print("pagoda bench: no request completed", file=sys.stderr)
        return 1
    return 0
