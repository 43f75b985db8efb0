"""How long `pagoda serve` takes from its command to the first /health 200, for one or more checkouts, alternated.

Usage:
    python benchmarks/profile/serve_startup.py [--tree before=/path/to/other/checkout] [--rounds 5]
        [-- SERVE ARGS...]

Each sample starts `python -m pagoda serve SERVE ARGS --port P --host 127.0.0.1` with the tree as its working
directory and first on PYTHONPATH (so that tree's Pagoda runs), polls /health every 20 ms, records the seconds to
the first 200, then stops the server (`vs_vllm.stop_server`: SIGTERM to its session, SIGKILL if it lingers). The
trees take turns within every round, the order reversed every other round, so a neighbour's load on a shared
machine falls on both alike. This checkout is the tree named `this`. Without SERVE ARGS the embedded default model
is served (its GGUF conversion cache is warmed by a first, untimed start of each tree).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import vs_vllm  # noqa: E402  (its server launcher and stopper)

THIS = Path(__file__).resolve().parents[2]


def sample(tree: Path, serve_args: list[str], log: Path, timeout: float = 300.0) -> float:
    port = vs_vllm.free_port()
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "pagoda", "serve", *serve_args, "--host", "127.0.0.1", "--port", str(port)]
    started = time.perf_counter()
    proc = vs_vllm.launch_server(cmd, log, env=env, cwd=tree)
    try:
        while time.perf_counter() - started < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"{tree}: serve exited with {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        return time.perf_counter() - started
            except OSError:
                pass
            time.sleep(0.02)  # finer than vs_vllm.wait_healthy's polling: the time to the first 200 is the result
        raise RuntimeError(f"{tree}: not healthy after {timeout:.0f} s")
    finally:
        vs_vllm.stop_server(proc)


def _commit(tree: Path) -> str | None:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    status = ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"]
    dirty = subprocess.run(status, capture_output=True)
    return (out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")) if out.returncode == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", action="append", default=[], help="NAME=PATH of another checkout to compare")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write the samples and medians as JSON")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: the arguments of `pagoda serve`")
    args = parser.parse_args()
    serve_args = [a for a in args.serve_args if a != "--"]
    log = Path(tempfile.mkdtemp(prefix="serve-startup-")) / "serve.log"
    trees = {"this": THIS, **{n: Path(p).resolve() for n, p in (t.split("=", 1) for t in args.tree)}}
    for tree in trees.values():
        sample(tree, serve_args, log)  # untimed: caches (GGUF conversion, bytecode) warm for every tree
    times: dict[str, list[float]] = {name: [] for name in trees}
    for round_index in range(args.rounds):
        order = list(trees) if round_index % 2 == 0 else list(reversed(trees))
        for name in order:
            times[name].append(sample(trees[name], serve_args, log))
            print(f"round {round_index + 1} {name}: {times[name][-1]:.2f} s", flush=True)
    base = statistics.median(times["this"])
    print("\n| tree | median s to /health 200 | min s | / this |\n| --- | ---: | ---: | ---: |")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"| {name} | {median:.2f} | {min(samples):.2f} | {median / base:.2f}x |")
    if args.out:
        medians = {name: statistics.median(samples) for name, samples in times.items()}
        commits = {name: _commit(tree) for name, tree in trees.items()}
        record = {"serve_args": serve_args, "rounds": args.rounds, "commits": commits, "samples_s": times}
        record["median_s"] = medians
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
