"""Host time of one speculative proposal, per request per step, for the n-gram and suffix proposers (CPU only).

    python benchmarks/profile/spec_propose.py [--lengths 300 1000 3000 8000] [--steps 40] [--json FILE]

The text: this repository's docs, tokenized with the embedded default model's tokenizer (real text: common
tokens occur thousands of times, spans repeat). Each length gets 10 requests whose prompt is a window of that
text; every step each request gains one output token (the text's next one), then the engine's `Speculator`
sets its proposals. A step's proposing time is `Speculator.propose` for all 10, divided by 10. `--loop` instead
makes the output a short cycle (what a random-weight model falls into: the suffix search's deepest matches).
Prints µs per request per step; run it on two trees to compare.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

from pagoda.engine.speculation import Speculator
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.spec_decode.config import parse_speculative_config

METHODS = {
    "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "suffix k=8": {"method": "suffix", "num_speculative_tokens": 8},
}


def _text_tokens() -> list[int]:
    from pagoda.models.gguf_checkpoint import default_gguf_path, load_gguf_tokenizer

    docs = sorted((pathlib.Path(__file__).resolve().parents[2] / "docs").glob("*.md"))
    text = "\n".join(p.read_text() for p in docs)
    return load_gguf_tokenizer(default_gguf_path()).encode(text)


def _time(spec: dict, text: list[int], length: int, steps: int, loop: bool) -> float:
    speculator = Speculator(parse_speculative_config(spec), "cpu")
    speculator.limit = 10**6  # every request proposes: the host cost is what is measured
    requests = [
        Request(f"r{i}", text[i * 311 : i * 311 + length], SamplingParams(max_tokens=10**6), 10**6) for i in range(10)
    ]
    per_step = []
    for step in range(steps):
        for i, request in enumerate(requests):
            request.output_token_ids.append((7 * i + step % 5) if loop else text[i * 311 + length + step])
            request.num_computed_tokens = request.num_tokens - 1  # decoding: may speculate
        started = time.perf_counter()
        speculator.propose(requests, {r.request_id: r for r in requests})
        per_step.append((time.perf_counter() - started) / len(requests))
    return statistics.median(per_step[steps // 4 :]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[300, 1000, 3000, 8000])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--loop", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    text = _text_tokens()
    rows = []
    for name, spec in METHODS.items():
        for length in args.lengths:
            rows.append({"method": name, "length": length, "us": _time(spec, text, length, args.steps, args.loop)})
            print(f"{name:11s} {length:6d} tokens: {rows[-1]['us']:7.1f} µs a request a step", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"loop": args.loop, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
