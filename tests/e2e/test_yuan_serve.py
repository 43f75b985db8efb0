"""`pagoda serve` on a Yuan2 model: the tiny golden architecture with the real Yuan tokenizer.

The fixture's weights have a 512-token vocabulary; the served copy widens the embedding to Yuan's
135,040 rows (the first 512 rows are the fixture's) so every id the real tokenizer produces is
valid, and uses the real special ids (<eod> 77185). The rendered chat prompt is pinned two ways:
`pagoda chat-template` prints the expected string (docs/models.md, Yuan2: chat format), and a chat
completion is token-for-token the greedy raw completion of that string.
"""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest
from e2e_helpers import API_KEY, MODEL

MESSAGES = [
    {"role": "system", "content": "You are helpful. "},
    {"role": "user", "content": "  Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Name a city.\n"},
]
# The Yuan2 chat format: system content.strip() + "\n"; turns stripped, joined by the literal "<n>", last + "<sep>".
EXPECTED_PROMPT = "You are helpful.\nHi there<n>Hello!<n>Name a city.<sep>"


@pytest.fixture(scope="module")
def yuan_folder(wide_yuan) -> str:
    return wide_yuan


def test_chat_template_command_prints_the_yuan_format(yuan_folder, tmp_path):
    messages = tmp_path / "messages.json"
    messages.write_text(json.dumps(MESSAGES))
    out = subprocess.run(
        [sys.executable, "-m", "pagoda", "chat-template", "--model", yuan_folder, "--messages", str(messages)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == repr(EXPECTED_PROMPT)


def test_serve_answers_chat_with_the_yuan_prompt(yuan_folder, launch_server):
    server = launch_server("--model", yuan_folder, "--max-model-len", "256", "--trust-remote-code")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    raw = client.completions.create(model=MODEL, prompt=EXPECTED_PROMPT, max_tokens=12, temperature=0)
    answer = chat.choices[0].message.content
    assert answer and answer == raw.choices[0].text
    assert chat.usage.prompt_tokens == raw.usage.prompt_tokens
    assert chat.choices[0].finish_reason in ("stop", "length")
    # The answer starts right away: no <sep> or other special token text leaks into it.
    assert "<sep>" not in answer and "<eod>" not in answer

    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answer
    log = server.log_tail(20000)
    assert "Per-sequence state (LF)" in log and "snapshot per block" in log
