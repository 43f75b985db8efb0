"""How long `LLM()` of the embedded default model takes to build, with and without the GGUF conversion
cache (`PAGODA_GGUF_CONVERSION_CACHE`), alternated in fresh processes of one run.

Usage:
    python benchmarks/profile/default_model_startup.py [--rounds 3]

Each sample is a new interpreter that imports torch first (not timed) and then times `LLM(...)`:
config, tokenizer, weights, KV cache. The cache is filled before the first cached sample.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

_CHILD = (
    "import time, torch\n"
    "from pagoda import LLM\n"
    "t = time.perf_counter()\n"
    "LLM(max_model_len=2048, cpu_kv_cache_space_gib=0.25, seed=0)\n"
    "print(time.perf_counter() - t)\n"
)


def sample(cache: bool) -> float:
    env = {**os.environ, "PAGODA_GGUF_CONVERSION_CACHE": "1" if cache else "0"}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sample(True)  # fills the cache
    times: dict[bool, list[float]] = {False: [], True: []}
    for round_index in range(args.rounds):
        for cache in (False, True):
            times[cache].append(sample(cache))
            print(f"round {round_index + 1} cache={'on' if cache else 'off'}: {times[cache][-1]:.2f} s", flush=True)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"\n| conversion cache | median LLM() s |\n| --- | ---: |\n| off | {off:.2f} |\n| on | {on:.2f} |")
    print(f"on / off: {on / off:.2f}x")


if __name__ == "__main__":
    main()
