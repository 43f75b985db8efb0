"""The command line as a user meets it: one-line errors (never a traceback) and the chat-template
inspector printing exactly what the tokenizer's template renders."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pagoda", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "flags, expected",
    [
        # The default model has 9 attention heads over 3 KV heads: 2 splits neither (valid: 1, 3).
        (["--tensor-parallel-size", "2"], "9 attention heads do not divide by 2; 3 KV heads do not divide by 2"),
        (["-tp", "4"], "valid sizes: 1, 3."),
        # Its 30 decoder layers fill at most 30 pipeline stages.
        (["--pipeline-parallel-size", "64"], "--pipeline-parallel-size 64 does not fit this model: 30 decoder layers"),
        (["--block-size", "3"], "block_size must be a power of two"),
        (["--model", "/no/such/model/folder"], "does not exist"),
        (["--dtype", "float8"], "dtype must be one of"),
        # vLLM's flags that Pagoda does not have: one line each, with the reason (tests/unit/test_vllm_flags.py).
        (["--fully-sharded-loras"], "pagoda: error: --fully-sharded-loras: not built: adapters are sharded under"),
    ],
)
def test_serve_refuses_bad_flags_in_one_line(flags, expected):
    result = _run("serve", *flags, "--port", "0")
    assert result.returncode == 2
    assert expected in result.stderr
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    assert [line for line in result.stderr.splitlines() if line.startswith("pagoda: error:")] != []


def test_chat_template_prints_the_exact_prompt(tmp_path):
    from pagoda.frontend.tokenizer import load_tokenizer
    from pagoda.models.source import resolve_model_source

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 你好"}]
    path = tmp_path / "messages.json"
    path.write_text(json.dumps(messages))
    result = _run("chat-template", "--messages", str(path))
    assert result.returncode == 0, result.stderr
    source = resolve_model_source(None)
    tokenizer = load_tokenizer(source, source.location)
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert result.stdout.splitlines()[0] == repr(expected)

    custom = _run(
        "chat-template",
        "--messages",
        str(path),
        "--no-generation-prompt",
        "--chat-template",
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}",
    )
    assert custom.stdout.splitlines()[0] == repr("<system>Be brief.<user>Hi 你好")


def test_serve_preflight_fails_fast_on_a_broken_folder_and_a_taken_port(tiny_llama, tmp_path):
    import shutil
    import socket

    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated download
    result = _run("serve", "--model", str(broken), "--port", "0")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "preflight failed" in result.stderr and "model.safetensors" in result.stderr
    assert "re-download" in result.stderr

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run("serve", "--model", tiny_llama, "--port", str(port), "--skip-tokenizer-init")
    assert result.returncode == 2 and f"port {port}" in result.stderr


def test_the_offline_import_works_beside_a_clone_named_pagoda(tmp_path):
    """The README's offline example run from the folder that holds a clone called `pagoda`: the clone (no
    __init__.py at its top) must not shadow the installed package as an empty namespace package, which an
    import-hook editable install lets happen (install.sh installs in compat mode: a path entry)."""
    (tmp_path / "pagoda" / "pagoda").mkdir(parents=True)  # the clone's layout: pagoda/pagoda/__init__.py ...
    (tmp_path / "pagoda" / "README.md").write_text("a clone\n")
    result = subprocess.run(
        [sys.executable, "-c", "from pagoda import LLM, SamplingParams; import pagoda; print(pagoda.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("__init__.py")
