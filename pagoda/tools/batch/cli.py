"""`pagoda batch`: flags and the driver (inputs -> resume scan -> async send -> summary).

Only argparse is imported at module level, so `pagoda --help` stays cheap; the rest loads when a batch runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from typing import Any

from pagoda import envs
from pagoda.tools.batch import inputs, output
from pagoda.tools.batch.inputs import InputError

DEFAULT_CONCURRENCY = 16


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def add_batch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is accepted)")
    g.add_argument(
        "--model",
        default=None,
        help="model name: set on every request (JSONL bodies included); default: the body's own "
        "model, else the first id of GET /v1/models",
    )
    g.add_argument("--api-key", default=None, help="bearer key (default: $OPENAI_API_KEY or $PAGODA_API_KEY)")

    g = p.add_argument_group("inputs (an OpenAI Batch JSONL file, or images; image sources can be combined)")
    g.add_argument(
        "--input",
        default=None,
        metavar="BATCH.jsonl",
        help="OpenAI Batch input: one {custom_id, method, url, body} object per line",
    )
    g.add_argument(
        "--images",
        action="append",
        default=[],
        metavar="DIR|GLOB",
        help="a folder of images (recursive) or a glob such as 'photos/**/*.jpg'; repeatable",
    )
    g.add_argument(
        "--glob",
        default=None,
        metavar="PATTERN",
        help="with a folder: only files whose relative path or name matches (default: image extensions)",
    )
    g.add_argument("--no-recursive", action="store_true", help="with a folder: do not descend into subfolders")
    g.add_argument(
        "--urls",
        action="append",
        default=[],
        metavar="FILE",
        help="a file of image URLs, one per line (# comments); repeatable",
    )
    g.add_argument(
        "--page",
        action="append",
        default=[],
        metavar="URL",
        help="a web page whose images are scraped (img src/srcset/data-src, picture, og:image); repeatable",
    )
    g.add_argument(
        "--min-image-side",
        type=_positive_int,
        default=32,
        help="scraping: skip images narrower or shorter than this many pixels (default 32)",
    )
    g.add_argument("--max-images", type=_positive_int, default=None, help="scraping: at most this many per page")

    g = p.add_argument_group("image requests: prompt and sampling (ignored with --input)")
    g.add_argument(
        "--prompt",
        default=None,
        help="prompt template; placeholders {filename} {stem} {path} {url} {page} (default: 'Describe this image.')",
    )
    g.add_argument("--prompt-file", default=None, help="read the prompt template from a file")
    g.add_argument("--system", default=None, help="system message")
    g.add_argument("--max-tokens", type=_positive_int, default=None)
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None, help="the request's sampling seed")
    g.add_argument("--stop", action="append", default=None, help="stop string; repeatable")
    g.add_argument("--extra-body", default=None, help="JSON object merged into every generated request body")
    g.add_argument(
        "--send-urls",
        action="store_true",
        help="pass image URLs through to the server instead of fetching and inlining them as base64",
    )
    g.add_argument(
        "--max-pixels",
        type=_positive_int,
        default=None,
        help="downscale (aspect kept) images with more pixels than this before sending",
    )
    g.add_argument(
        "--detail",
        choices=("auto", "low", "high"),
        default=None,
        help="OpenAI's image_url.detail for every image (low: a 512x512 budget, fewer tokens; default: not sent)",
    )
    g.add_argument(
        "--fetch-timeout", type=_positive_float, default=30.0, help="seconds per image/page download (default 30)"
    )
    g.add_argument(
        "--max-image-bytes",
        type=_positive_int,
        default=20 * 1024 * 1024,
        help="size cap per image download or file (default 20 MiB)",
    )

    g = p.add_argument_group("sending")
    g.add_argument(
        "--concurrency",
        type=_positive_int,
        default=DEFAULT_CONCURRENCY,
        help=f"requests in flight (default {DEFAULT_CONCURRENCY})",
    )
    rate = g.add_mutually_exclusive_group()
    rate.add_argument("--rps", type=_positive_float, default=None, help="at most this many requests per second")
    rate.add_argument("--rpm", type=_positive_float, default=None, help="at most this many requests per minute")
    g.add_argument(
        "--burst",
        type=_positive_float,
        default=1.0,
        help="token-bucket capacity: requests that may go at once after idling (default 1)",
    )
    g.add_argument(
        "--timeout",
        type=_positive_float,
        default=600.0,
        help="seconds per attempt for the whole response (default 600)",
    )
    g.add_argument(
        "--max-retries",
        type=_non_negative_int,
        default=5,
        help="retries after the first attempt for 408/409/429/5xx, timeouts and connection errors (default 5)",
    )

    g = p.add_argument_group("output")
    g.add_argument(
        "--output",
        required=True,
        metavar="RESULTS.jsonl",
        help="successes, OpenAI Batch output lines; appended to; rerunning resumes from it",
    )
    g.add_argument(
        "--errors",
        default=None,
        metavar="ERRORS.jsonl",
        help="failures with status, body and attempts (default: OUTPUT with .errors.jsonl)",
    )
    g.add_argument(
        "--summary", default=None, metavar="SUMMARY.json", help="run summary (default: OUTPUT with .summary.json)"
    )
    g.add_argument(
        "--ordered-json",
        default=None,
        metavar="FILE.json",
        help="also write one JSON array in input order (the success row, else the error row, else null)",
    )
    g.add_argument(
        "--no-retry-failed",
        action="store_true",
        help="on a rerun, skip requests that already have a row in the errors file",
    )
    g.add_argument("--dry-run", action="store_true", help="list what would be sent (custom_id, source) and exit")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


class BatchUsageError(Exception):
    pass


def _sibling(path: str, suffix: str) -> str:
    base = path.removesuffix(".jsonl")
    return base + suffix


def _sampling(ns: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for key in ("max_tokens", "temperature", "top_p", "seed", "stop"):
        value = getattr(ns, key)
        if value is not None:
            params[key] = value
    if ns.extra_body:
        try:
            extra = json.loads(ns.extra_body)
        except ValueError as exc:
            raise BatchUsageError(f"--extra-body is not JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise BatchUsageError("--extra-body must be a JSON object")
        params.update(extra)
    return params


def _say(msg: str) -> None:
    print(f"pagoda batch: {msg}", file=sys.stderr, flush=True)


def run_batch(ns: argparse.Namespace) -> int:
    from pagoda.tools.batch.media import MediaError  # lazy: httpx, PIL (every `pagoda` run imports this)

    try:
        return _run(ns)
    except (BatchUsageError, InputError) as exc:
        print(f"pagoda batch: error: {exc}", file=sys.stderr)
        return 2
    except MediaError as exc:
        print(f"pagoda batch: error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pagoda batch: interrupted", file=sys.stderr)
        return 130


def _model_from_server(root: str, headers: dict[str, str]) -> str:
    from pagoda.tools.bench.client import first_model  # lazy: httpx (every `pagoda` run imports this)

    try:
        return first_model(root, headers)
    except Exception as exc:  # noqa: BLE001 - HTTP or JSON trouble: one line, exit 2
        raise BatchUsageError(f"cannot pick a model from {root}/v1/models ({exc}); pass --model") from None


def _build_items(ns: argparse.Namespace, root: str, headers: dict[str, str]) -> tuple[list[Any], dict[str, Any]]:
    from pagoda.tools.batch import scrape  # lazy: httpx (every `pagoda` run imports this)

    image_sources = bool(ns.images or ns.urls or ns.page)
    if ns.input and image_sources:
        raise BatchUsageError("--input cannot be combined with --images/--urls/--page")
    if not ns.input and not image_sources:
        raise BatchUsageError("give --input BATCH.jsonl, or images with --images, --urls or --page")
    info: dict[str, Any] = {}
    if ns.input:
        ignored = [
            flag
            for flag, value in (
                ("--prompt", ns.prompt),
                ("--prompt-file", ns.prompt_file),
                ("--system", ns.system),
                ("--max-tokens", ns.max_tokens),
                ("--temperature", ns.temperature),
                ("--top-p", ns.top_p),
                ("--seed", ns.seed),
                ("--stop", ns.stop),
                ("--extra-body", ns.extra_body),
                ("--max-pixels", ns.max_pixels),
                ("--detail", ns.detail),
            )
            if value is not None
        ]
        if ignored:
            _say(f"{', '.join(ignored)} ignored with --input (the request bodies are sent as written)")
        items = inputs.load_batch_jsonl(ns.input, ns.model)
        if any(not item.body.get("model") for item in items):
            model = _model_from_server(root, headers)
            for item in items:
                if not item.body.get("model"):
                    item.body["model"] = model
        info["source"] = {"input": ns.input}
        return items, info

    if ns.prompt is not None and ns.prompt_file is not None:
        raise BatchUsageError("give --prompt or --prompt-file, not both")
    template = ns.prompt if ns.prompt is not None else inputs.DEFAULT_PROMPT
    if ns.prompt_file is not None:
        try:
            with open(ns.prompt_file, encoding="utf-8") as f:
                template = f.read().strip()
        except OSError as exc:
            raise BatchUsageError(f"--prompt-file {ns.prompt_file}: {exc.strerror or exc}") from None
    inputs.check_template(template)
    params = _sampling(ns)
    refs: list[inputs.ImageRef] = []
    for spec in ns.images:
        files = inputs.list_images(spec, ns.glob, not ns.no_recursive)
        if not files:
            _say(f"--images {spec}: no image files found")
        refs += [inputs.ImageRef("file", path) for path in files]
    for path in ns.urls:
        refs += [inputs.ImageRef("url", url) for url in inputs.read_url_list(path)]
    pages = []
    for page in ns.page:
        result = scrape.scrape_page(
            page,
            timeout=ns.fetch_timeout,
            max_bytes=ns.max_image_bytes,
            min_side=ns.min_image_side,
            max_images=ns.max_images,
        )
        _say(f"{page}: {len(result.images)} image(s) found, {len(result.skipped)} skipped")
        pages.append(
            {
                "page": page,
                "images": [i.url for i in result.images],
                "skipped": [{"url": u, "reason": r} for u, r in result.skipped],
            }
        )
        refs += [
            inputs.ImageRef("page", img.url, page=result.page_url, data=img.data, sha256=img.sha256)
            for img in result.images
        ]
    if not refs:
        raise BatchUsageError("no images found in the given sources")
    model = ns.model or _model_from_server(root, headers)
    items = inputs.build_image_items(refs, model, template, ns.system, params, ns.max_pixels, ns.detail)
    info["model"] = model
    info["source"] = {"images": ns.images, "urls": ns.urls, "pages": ns.page}
    info["prompt"] = template
    info["system"] = ns.system
    info["params"] = params
    if pages:
        info["scraped"] = pages
    return items, info


def _run(ns: argparse.Namespace) -> int:
    from pagoda.tools.batch.sender import Runner, SendConfig  # lazy: httpx (every `pagoda` run imports this)
    from pagoda.tools.bench.client import auth_headers  # lazy: httpx (every `pagoda` run imports this)

    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)
    root = ns.base_url.rstrip("/").removesuffix("/v1")
    api_key = ns.api_key or envs.OPENAI_API_KEY.value or envs.API_KEY.value
    headers = auth_headers(api_key)
    out_path = ns.output
    err_path = ns.errors or _sibling(out_path, ".errors.jsonl")
    summary_path = ns.summary or _sibling(out_path, ".summary.json")
    paths = [os.path.abspath(p) for p in (out_path, err_path, summary_path)]
    if len(set(paths)) != 3:
        raise BatchUsageError("--output, --errors and --summary must be different files")
    if ns.input and os.path.abspath(ns.input) in paths:
        raise BatchUsageError("--input must not be one of the result files")

    items, info = _build_items(ns, root, headers)
    ids = [item.custom_id for item in items]

    # Resume: successes in the output are skipped; failures are retried (their old error rows dropped, so
    # each id keeps one row) unless --no-retry-failed.
    notes: list[str] = []
    for path in (out_path, err_path):
        fixed = output.repair_tail(path)
        if fixed:
            notes.append(fixed)
    problems: list[str] = []
    done = output.done_ids(out_path, problems) & set(ids)
    failed_before = {row["custom_id"] for row in output.iter_rows(err_path, problems)} & set(ids)
    for line in notes + problems[:5]:
        _say(line)
    skip = (done | failed_before) if ns.no_retry_failed else done
    pending = [item for item in items if item.custom_id not in skip]
    if ns.dry_run:
        for item in pending:
            print(f"{item.custom_id}\t{item.source}")
        _say(f"{len(items)} request(s), {len(items) - len(pending)} already done, {len(pending)} to send")
        return 0
    attempts_before: dict[str, int] = {}
    if failed_before and not ns.no_retry_failed:
        attempts_before = output.compact_errors(err_path, set(ids))
    if done or failed_before:
        _say(
            f"resuming: {len(done)} of {len(items)} already done"
            + (
                f", {len(failed_before)} earlier failure(s) " + ("skipped" if ns.no_retry_failed else "retried")
                if failed_before
                else ""
            )
            + f"; {len(pending)} to send"
        )

    rate = ns.rps if ns.rps is not None else (ns.rpm / 60.0 if ns.rpm is not None else None)
    cfg = SendConfig(
        root=root,
        headers=headers,
        concurrency=ns.concurrency,
        timeout=ns.timeout,
        max_retries=ns.max_retries,
        rate=rate,
        burst=ns.burst,
        send_urls=ns.send_urls,
        max_pixels=ns.max_pixels,
        fetch_timeout=ns.fetch_timeout,
        max_image_bytes=ns.max_image_bytes,
        progress=not ns.no_progress,
    )
    out_w, err_w = output.JsonlWriter(out_path), output.JsonlWriter(err_path)
    t0 = time.monotonic()
    runner = Runner(cfg, pending, out_w, err_w, attempts_before)
    try:
        stats = asyncio.run(runner.run()) if pending else runner.stats
    finally:
        out_w.close()
        err_w.close()
    duration = time.monotonic() - t0

    not_run = len(pending) - stats.ok - stats.failed
    skipped_failed = len(failed_before) if ns.no_retry_failed else 0
    summary: dict[str, Any] = {
        "output": out_path,
        "errors": err_path,
        "config": {
            "base_url": root,
            "model": ns.model,
            **info,
            "concurrency": ns.concurrency,
            "rate_per_s": rate,
            "burst": ns.burst,
            "timeout_s": ns.timeout,
            "max_retries": ns.max_retries,
            "send_urls": ns.send_urls,
            "max_pixels": ns.max_pixels,
            "detail": ns.detail,
            "retry_failed": not ns.no_retry_failed,
        },
        "inputs": len(items),
        "already_done": len(done),
        "skipped_failed": skipped_failed,
        "to_send": len(pending),
        "succeeded": stats.ok,
        "failed": stats.failed,
        "not_run": not_run,
        "retries": stats.retries,
        "status_counts": {str(k): v for k, v in sorted(stats.statuses.items(), key=lambda kv: str(kv[0]))},
        "error_codes": dict(stats.error_codes),
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "duration_s": round(duration, 3),
        "requests_per_s": round((stats.ok + stats.failed) / duration, 3) if duration > 0 else None,
        "output_tokens_per_s": round(stats.completion_tokens / duration, 3) if duration > 0 else None,
        "total_succeeded": len(done) + stats.ok,
        "total_failed": stats.failed + skipped_failed,
        "complete": not_run == 0,
        "interrupted": stats.interrupted,
    }
    output.write_json(summary_path, summary)
    if ns.ordered_json:
        output.write_json(ns.ordered_json, output.ordered_rows(ids, out_path, err_path))
    _say(
        f"{stats.ok} succeeded, {stats.failed} failed, {stats.retries} retries, {not_run} not run "
        f"({len(done)} done before) in {duration:.1f} s; {stats.completion_tokens} output tokens"
    )
    if stats.error_codes:
        _say("errors: " + ", ".join(f"{k} x{v}" for k, v in stats.error_codes.most_common(5)) + f" (see {err_path})")
    _say(f"wrote {out_path}, {err_path}, {summary_path}" + (f", {ns.ordered_json}" if ns.ordered_json else ""))
    if stats.interrupted or not_run:
        _say("interrupted: rerun the same command to resume")
        return 130
    return 1 if summary["total_failed"] else 0
