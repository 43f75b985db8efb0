"""The chat template at startup, on a tiny Yuan2 folder (tests/fixtures) whose tokenizer_config.json
carries a template: `pagoda doctor` warns when it is a foreign one (a Llama [INST] template in place
of Yuan's <n>/<sep> format), `pagoda serve` names it and warns the same way, so does `pagoda chat-template`
while it prints what that template renders, and a template that
does not render stops `pagoda serve` in seconds with one `pagoda: error:` line."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_server import free_port

from tests.conftest import FIXTURES

LLAMA2 = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def yuan_folder(folder: Path, chat_template: str | None) -> str:
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(FIXTURES / "yuan2-tiny" / name, folder / name)
    for name in ("tokenizer.model", "special_tokens_map.json"):
        shutil.copy(FIXTURES / "yuan2-tokenizer" / name, folder / name)
    config = json.loads((FIXTURES / "yuan2-tokenizer" / "tokenizer_config.json").read_text())
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def foreign(tmp_path_factory) -> str:
    return yuan_folder(tmp_path_factory.mktemp("yuan-foreign-template") / "model", LLAMA2)


def test_doctor_warns_about_a_foreign_template(foreign, capsys):
    from pagoda.tools import doctor

    assert doctor.main([foreign, "--device", "cpu"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if " chat template: " in x)
    assert line.startswith(
        "[warn] chat template: the model's tokenizer_config.json does not produce the Yuan2 "
        "chat format (turns joined by the text <n>, the prompt ending in <sep>)"
    )
    assert (
        "renders as '<s>[INST] Probe question one [/INST] Probe answer one<eod>[INST] Probe question two "
        "[/INST]'" in line
    )
    assert "remove the template from" in line and "--chat-template" in line


def test_serve_names_the_template_and_warns(foreign, caplog):
    from pagoda.cli.main import build_parser
    from pagoda.cli.serve import prepare

    ns = build_parser().parse_args(
        ["serve", foreign, "--port", str(free_port()), "--device", "cpu", "--max-model-len", "256"]
    )
    ns.model = ns.model_tag
    with caplog.at_level(logging.INFO, logger="pagoda"):
        prepare(ns)
    assert "Chat template: the model's tokenizer_config.json" in caplog.text
    warnings = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "Chat template" in r.getMessage()
    ]
    assert len(warnings) == 1 and "'<s>[INST] Probe question one [/INST]" in warnings[0]


def test_chat_template_prints_the_foreign_template_and_warns_as_serve_does(foreign, tmp_path, capsys):
    from pagoda.cli.main import main

    messages = tmp_path / "messages.json"
    messages.write_text(json.dumps([{"role": "user", "content": "Hi"}]))
    assert main(["chat-template", "--model", foreign, "--messages", str(messages)]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == repr("<s>[INST] Hi [/INST]")  # what serve would render, printed as it is
    (warning,) = [line for line in err.splitlines() if line.startswith("pagoda: warning: ")]
    assert warning.startswith(
        "pagoda: warning: chat template: the model's tokenizer_config.json does not produce the Yuan2 chat format"
    )
    assert "'<s>[INST] Probe question one [/INST]" in warning and "remove the template from" in warning

    # The built-in Yuan2 format (no template in the folder) is the family's own: no warning.
    own = yuan_folder(tmp_path / "own", None)
    assert main(["chat-template", "--model", own, "--messages", str(messages)]) == 0
    assert "warning" not in capsys.readouterr().err


def test_serve_with_a_broken_template_exits_in_seconds(tmp_path):
    folder = yuan_folder(tmp_path / "model", "{% for m in messages %}{{ m['content'] }}{% endfor")
    start = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagoda",
            "serve",
            folder,
            "--port",
            str(free_port()),
            "--host",
            "127.0.0.1",
            "--device",
            "cpu",
            "--max-model-len",
            "256",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - start
    assert out.returncode == 2, out.stderr
    assert took < 30, f"{took:.1f} s"
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("pagoda: error: the chat template (the model's tokenizer_config.json) does not render"), (
        out.stderr
    )
    assert "tokenizer_config.json, or pass --chat-template" in last and "Traceback" not in out.stderr
