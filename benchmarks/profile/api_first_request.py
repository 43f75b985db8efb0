"""An API process's first chat request against its later ones, on fresh servers: what `PAGODA_API_WARM_UP` saves.

    python benchmarks/profile/api_first_request.py MODEL [--servers 3] [--requests 4] [--out FILE.json] [-- SERVE ARGS]

For each variant (the API warm-up on, then off; `--servers` fresh servers each, alternated) it starts
`pagoda serve MODEL --api-server-count 1` (one API process, so every request lands on the one whose first
request is measured), sends `--requests` streamed chat requests one at a time, each with its own 1000x750
random-noise JPEG (no encoder or prefix cache hit; `--text`: 20 words instead), and reads the
server's own histograms (`/metrics`) after each: the server's TTFT, the core's queue time and its prefill time.
The API process's share of a request is the server's TTFT minus queue and prefill (parsing, the chat template,
tokenizing, the image's decode and preprocessing, the hand-off to the core). Prints, per variant, the first
request's API share and client TTFT against the median of the later ones. Runs on the CPU: the API process's
work does not depend on the device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import vs_vllm  # noqa: E402  (the server launcher)
from image_ttft_probe import HISTOGRAMS, first_token_ms, noise_jpeg, scrape  # noqa: E402


def one_server(
    model: str, warm: bool, images: bool, requests: int, port: int, serve_args: list[str], seed: int, log: Path
) -> list[dict]:
    cmd = [sys.executable, "-m", "pagoda", "serve", model, "--api-server-count", "1", "--port", str(port)]
    env = {"PAGODA_API_WARM_UP": "1" if warm else "0"}
    server = vs_vllm.start_server(cmd + serve_args, port, log, timeout_s=300, env=env)
    if server is None:
        sys.exit(f"the server did not come up; its log: {log}")
    url = f"http://127.0.0.1:{port}"
    try:
        served = json.load(urllib.request.urlopen(url + "/v1/models"))["data"][0]["id"]
        rows, before = [], scrape(url)
        for i in range(requests):
            if images:  # each its own image: no encoder or prefix cache hit
                client = first_token_ms(url, served, noise_jpeg(seed * 1000 + i))
            else:  # each its own words
                words = " ".join(f"word{(seed * 1000 + i) * 100 + k}" for k in range(20))
                client = first_token_ms(url, served, None, words)
            after = scrape(url)
            ms = {name: 1e3 * (after[f"{name}_sum"] - before[f"{name}_sum"]) for name in HISTOGRAMS}
            before = after
            api = ms[HISTOGRAMS[0]] - ms[HISTOGRAMS[1]] - ms[HISTOGRAMS[2]]
            rows.append({"client_ttft_ms": round(client, 2), "api_ms": round(api, 2), "images": images})
        return rows
    finally:
        vs_vllm.stop_server(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--port", type=int, default=8817)
    parser.add_argument("--text", action="store_true", help="text-only requests (a model without images)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--log", type=Path, default=Path("/tmp/api_first_request.log"), help="the last server's log")
    args, serve_args = parser.parse_known_args()
    serve_args = [a for a in serve_args if a != "--"]
    runs: dict[str, list[list[dict]]] = {"warm": [], "cold": []}
    for i in range(args.servers):
        for name in ("warm", "cold") if i % 2 == 0 else ("cold", "warm"):
            rows = one_server(
                args.model, name == "warm", not args.text, args.requests, args.port, serve_args, i, args.log
            )
            runs[name].append(rows)
            print(f"{name} server {i}: " + ", ".join(f"{r['api_ms']:.1f}" for r in rows) + " ms API share", flush=True)
    print(
        "| variant | first request: API ms | later: API ms (median) | first: client TTFT ms | later: client TTFT ms |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    summary = {}
    for name, servers in runs.items():
        first = [s[0] for s in servers]
        later = [r for s in servers for r in s[1:]]
        summary[name] = {
            "first_api_ms": [r["api_ms"] for r in first],
            "later_api_ms_median": statistics.median(r["api_ms"] for r in later),
            "first_client_ttft_ms": [r["client_ttft_ms"] for r in first],
            "later_client_ttft_ms_median": statistics.median(r["client_ttft_ms"] for r in later),
        }
        s = summary[name]
        print(
            f"| {name} | {', '.join(f'{v:.1f}' for v in s['first_api_ms'])} | {s['later_api_ms_median']:.1f} | "
            f"{', '.join(f'{v:.1f}' for v in s['first_client_ttft_ms'])} | {s['later_client_ttft_ms_median']:.1f} |"
        )
    if args.out:
        args.out.write_text(
            json.dumps({"model": args.model, "serve_args": serve_args, "runs": runs, "summary": summary}, indent=1)
            + "\n"
        )


if __name__ == "__main__":
    main()
