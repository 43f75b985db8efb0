"""`pagoda serve --speculative-config` (prompt lookup) through the official openai SDK: a streamed greedy chat
carries exactly the non-streamed text (steps that keep several proposals send several tokens at once), and
/metrics counts the verified proposals as vLLM names them. One server of its own, on a port of 18450-18459."""

from __future__ import annotations

import e2e_server
import httpx
from e2e_helpers import API_KEY, MODEL, metric, scrape
from openai import OpenAI

PORTS = range(18450, 18460)  # this module's share of the ports the suite's servers may take
SPEC = '{"method":"ngram","num_speculative_tokens":3}'
# Copying its context is what prompt lookup proposes: the answer repeats the prompt's sentence, so its n-grams
# (5 tokens, vLLM's default length) are found in the prompt and most proposals hold.
COPY = [
    {"role": "system", "content": "You repeat text exactly."},
    {
        "role": "user",
        "content": "Repeat this sentence exactly: The old lighthouse keeper climbed the spiral stairs every "
        "evening to light the lamp for the ships.",
    },
]


def test_streamed_text_equals_non_streamed_and_metrics_count_drafts(launch_server, monkeypatch) -> None:
    # ServerProcess picks its port (and a retry's) through free_port
    monkeypatch.setattr(e2e_server, "free_port", lambda: e2e_server.free_port_in(PORTS))
    # No prefix caching: the second run then computes the prompt exactly as the first did, so a near tie cannot
    # flip a token between the two runs (what this test checks is the streaming, not batch invariance).
    server = launch_server("--speculative-config", SPEC, "--no-enable-prefix-caching")
    assert server.port in PORTS
    # The CPU's default limit, said once at startup: proposals only while one request runs.
    assert (
        "Speculative decoding: ngram, k=3: proposals while fewer than 2 requests run "
        "(disable_by_batch_size; the CPU's default)" in server.log_tail(100_000)
    )
    client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    body = {"model": MODEL, "messages": COPY, "max_tokens": 24, "temperature": 0.0}

    whole = client.chat.completions.create(**body).choices[0].message.content
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as http:
        drafts = metric(scrape(http), "vllm:spec_decode_num_drafts_total")
        assert drafts > 0, "the copied sentence got no proposals"
        chunks = client.chat.completions.create(**body, stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        assert streamed == whole and whole
        samples = scrape(http)
    assert metric(samples, "vllm:spec_decode_num_drafts_total") > drafts  # the streamed run proposed too
    accepted = metric(samples, "vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= metric(samples, "vllm:spec_decode_num_draft_tokens_total")
