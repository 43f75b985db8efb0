"""`pagoda serve --enable-lora --lora-modules ...`: a request's `model` picks the adapter (vLLM's interface).

Two PEFT adapters on a tiny random Llama (one given as name=path, one in vLLM's JSON form with a
`base_model_name`); completions through each and through the base model in one server equal PEFT's merged models
token for token (`tests/models/test_lora.py` makes them); `/v1/models` lists the adapters with the base (or the
given `base_model_name`) as parent; responses carry the adapter's name; an unknown name is a 404. An adapter
loaded at run time is read by the engine core before the answer: one it cannot serve is a 400 and never listed.
A bad `--lora-modules` stops the server in one line. The server listens on one of ports 18460-18469."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import e2e_server
import httpx
import pytest
from e2e_server import ServerProcess

from tests.conftest import build_tiny_model
from tests.models.test_lora import ADAPTERS, MAX_TOKENS, PROMPTS, _make_adapter, _reference

PORTS = range(18460, 18470)  # this module's server ports


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_serve")
    base = build_tiny_model("llama", str(root / "base"))
    adapters = {}
    for seed, name in enumerate(("attn", "mlp", "all")):
        rank, alpha, targets, rslora = ADAPTERS[name]
        adapters[name] = _make_adapter(base, root / name, rank, alpha, targets, rslora, seed)
    modules = [f"attn={adapters['attn']}", json.dumps({"name": "mlp", "path": adapters["mlp"], "base_model_name": "b"})]
    flags = ["--model", base, "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "256"]
    flags += ["--cpu-kv-cache-space-gib", "0.25", "--host", "127.0.0.1", "--enable-lora", "--max-loras", "2"]
    extra = ["--lora-modules", *modules, "--allow-runtime-lora-updating"]
    with pytest.MonkeyPatch.context() as patch:  # ServerProcess takes its port (and a retry's) from free_port
        patch.setattr(e2e_server, "free_port", lambda: e2e_server.free_port_in(PORTS))
        server = ServerProcess(root / "serve.log", extra, base_flags=flags)
        try:
            server.wait_healthy()
        except BaseException:
            server.stop()
            raise
    try:
        yield server, base, adapters
    finally:
        server.stop()


def _complete(client: httpx.Client, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    response = client.post("/v1/completions", json=body | {"ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()


def test_the_model_field_picks_the_adapter(lora_server):
    server, base, adapters = lora_server
    with httpx.Client(base_url=server.url, timeout=120) as client:
        cards = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
        assert cards["attn"]["parent"] == base and cards["attn"]["root"] == adapters["attn"]
        assert cards["mlp"]["parent"] == "b"  # its --lora-modules base_model_name, as vLLM lists it
        assert cards[base]["parent"] is None
        for name, model in (("attn", "attn"), ("mlp", "mlp"), (None, base)):
            expected = _reference(base, adapters.get(name))
            for prompt, (tokens, _) in zip(PROMPTS, expected):
                answer = _complete(client, model, prompt)
                assert answer["choices"][0]["token_ids"] == tokens, name
                assert answer["model"] == model
        missing = client.post("/v1/completions", json={"model": "nope", "prompt": [5, 6], "max_tokens": 2})
        assert missing.status_code == 404 and "attn" in missing.json()["error"]["message"]


def test_metrics_name_the_running_adapters(lora_server):
    """vLLM's lora_requests_info: while a request of `attn` streams, its labels name it as running."""
    server, _, _ = lora_server
    body = {"model": "attn", "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            text = client.get("/metrics").text
            for _ in lines:  # to the end
                pass
        info = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
        assert len(info) == 1 and 'max_lora="2"' in info[0] and 'running_lora_adapters="attn"' in info[0], info


def _wait_for_log(server: ServerProcess, line: str) -> None:
    """The engine core logs it soon after the API answered (it acts on the API process's message)."""
    deadline = time.monotonic() + 10
    while line not in server.log_tail(20_000) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert line in server.log_tail(20_000)


def test_adapters_load_and_unload_at_run_time(lora_server):
    server, base, adapters = lora_server
    with httpx.Client(base_url=server.url, timeout=120) as client:
        load = client.post("/v1/load_lora_adapter", json={"lora_name": "all", "lora_path": adapters["all"]})
        assert load.status_code == 200 and "added successfully" in load.text
        assert "all" in {card["id"] for card in client.get("/v1/models").json()["data"]}
        for prompt, (tokens, _) in zip(PROMPTS, _reference(base, adapters["all"])):
            assert _complete(client, "all", prompt)["choices"][0]["token_ids"] == tokens
        again = client.post("/v1/load_lora_adapter", json={"lora_name": "all", "lora_path": adapters["all"]})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        # vLLM's load_inplace: the name now serves another checkpoint (here attn's weights), under a new id (4);
        # the old id's memory is freed, as no request runs with it.
        swap = {"lora_name": "all", "lora_path": adapters["attn"], "load_inplace": True}
        assert client.post("/v1/load_lora_adapter", json=swap).status_code == 200
        for prompt, (tokens, _) in zip(PROMPTS, _reference(base, adapters["attn"])):
            assert _complete(client, "all", prompt)["choices"][0]["token_ids"] == tokens
        _wait_for_log(server, "LoRA adapter 3 unloaded: its host copy and device slot are free")  # attn 1, mlp 2
        # A --lora-modules adapter reloaded in place (id 5) keeps the parent its JSON form gave it.
        reload = {"lora_name": "mlp", "lora_path": adapters["mlp"], "load_inplace": True}
        assert client.post("/v1/load_lora_adapter", json=reload).status_code == 200
        assert {c["id"]: c for c in client.get("/v1/models").json()["data"]}["mlp"]["parent"] == "b"
        bad = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/folder"})
        assert bad.status_code == 400 and "no such folder" in bad.json()["error"]["message"]
        extra = client.post("/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": "/p", "other": 1})
        assert extra.status_code == 400
        unload = client.post("/v1/unload_lora_adapter", json={"lora_name": "all"})
        assert unload.status_code == 200 and "removed successfully" in unload.text
        _wait_for_log(server, "LoRA adapter 4 unloaded: its host copy and device slot are free")
        gone = client.post("/v1/completions", json={"model": "all", "prompt": [5, 6], "max_tokens": 2})
        assert gone.status_code == 404
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "all"}).status_code == 404


def test_an_adapter_the_core_cannot_serve_is_a_400_at_load_and_never_listed(lora_server, tmp_path):
    """Only the engine core can check an adapter's weights against the model: the load waits for it, so a folder
    without weights or an adapter of another base model is refused then (not when a request names it)."""
    server, base, adapters = lora_server
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(Path(adapters["attn"]) / "adapter_config.json", no_weights)
    other = build_tiny_model("llama", str(tmp_path / "wider_base"), hidden_size=96)
    wider = _make_adapter(other, tmp_path / "wider", 4, 8, ["q_proj"], False, 7)
    cases = {
        "no_weights": (str(no_weights), "no adapter_model.safetensors (or adapter_model.bin) there"),
        "wider": (wider, "an adapter of another base model"),
        base: (adapters["all"], "is a served model name"),
    }
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for name, (path, reason) in cases.items():
            load = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
            assert load.status_code == 400, load.text
            error = load.json()["error"]
            assert reason in error["message"] and error["type"] == "BadRequestError", error
            assert name not in {card["id"] for card in client.get("/v1/models").json()["data"]} - {base}
            if name != base:
                body = {"model": name, "prompt": [5, 6], "max_tokens": 2}
                assert client.post("/v1/completions", json=body).status_code == 404
        # The engine carries on: the adapters it serves still answer.
        assert _complete(client, "attn", PROMPTS[0])["choices"][0]["token_ids"]


def test_lora_modules_without_enable_lora_is_one_line(lora_server):
    _, base, adapters = lora_server
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagoda",
            "serve",
            "--model",
            base,
            "--skip-tokenizer-init",
            "--skip-preflight",
            "--lora-modules",
            f"attn={adapters['attn']}",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode != 0 and "--lora-modules needs --enable-lora" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("bad", ["wide", "no_weights"])
def test_lora_modules_are_read_at_startup_and_a_bad_adapter_stops_it_in_one_line(lora_server, tmp_path, bad):
    server, base, adapters = lora_server
    # The fixture's server read both --lora-modules adapters before it reported ready.
    assert "LoRA adapters read: attn, mlp" in server.log_path.read_text()
    if bad == "wide":
        other = build_tiny_model("llama", str(tmp_path / "wider_base"), hidden_size=96)
        folder, reason = _make_adapter(other, tmp_path / "wider", 4, 8, ["q_proj"], False, 7), "another base model"
    else:
        folder, reason = str(tmp_path / "no_weights"), "no adapter_model.safetensors (or adapter_model.bin) there"
        Path(folder).mkdir()
        shutil.copy(Path(adapters["attn"]) / "adapter_config.json", folder)
    result = subprocess.run(
        [sys.executable, "-m", "pagoda", "serve", "--model", base, "--skip-tokenizer-init", "--skip-preflight"]
        + ["--dtype", "float32", "--max-model-len", "256", "--cpu-kv-cache-space-gib", "0.25"]
        + ["--enable-lora", "--lora-modules", f"attn={adapters['attn']}", f"{bad}={folder}", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode != 0, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if f"--lora-modules {bad}: " in line]
    assert len(errors) == 1 and reason in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
