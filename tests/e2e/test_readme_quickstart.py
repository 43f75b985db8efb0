"""The README's quick start, as a new user runs it: its `pagoda serve` command and its curl request, both read
out of README.md (so this test follows the README when it changes, and fails when they stop agreeing).

The one change made to the README's commands: the server gets `--port N` appended (a free port, so the test
cannot collide with another server on 8000) and the curl URL's port becomes N. Everything else is verbatim:
no `--served-model-name`, the body and headers as written. `pagoda` runs as `python -m pagoda`, the same
entry point the console script calls, with this checkout's code."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import httpx
from e2e_server import ServerProcess

README = Path(__file__).resolve().parents[2] / "README.md"
README_PORT = "8000"


def _quick_start_commands() -> list[str]:
    """The shell commands of the Quick start's bash blocks: continuation lines and quoted newlines joined."""
    text = README.read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands, pending = [], ""
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            pending = f"{pending}\n{line}" if pending else line
            try:
                shlex.split(pending)
            except ValueError:  # a quote still open: the command goes on on the next line
                continue
            if pending.strip():
                commands.append(pending.strip())
            pending = ""
    return commands


def _serve_argv(commands: list[str]) -> list[str]:
    line = next(c for c in commands if "pagoda serve" in c)  # the first: the default model (then a real one)
    argv = shlex.split(line.split("&&")[-1], comments=True)  # `bash install.sh && pagoda serve`: the server part
    assert argv[:2] == ["pagoda", "serve"], argv
    return argv


def _curl(commands: list[str]) -> tuple[str, dict[str, str], str]:
    line = next(c for c in commands if c.startswith("curl "))
    args = shlex.split(line)[1:]
    url, headers, body = None, {}, None
    i = 0
    while i < len(args):
        if args[i] == "-H":
            name, value = args[i + 1].split(":", 1)
            headers[name.strip()] = value.strip()
            i += 2
        elif args[i] in ("-d", "--data"):
            body = args[i + 1]
            i += 2
        elif args[i].startswith("-"):
            i += 1  # -s: no effect on the request
        else:
            url = args[i]
            i += 1
    assert url is not None and body is not None, line
    return url, headers, body


def test_the_readme_commands_answer(tmp_path):
    commands = _quick_start_commands()
    argv = _serve_argv(commands)
    url, headers, body = _curl(commands)
    assert f":{README_PORT}/" in url, url  # the README's server listens on its default port

    server = ServerProcess(tmp_path / "serve.log", extra_flags=[], base_flags=argv[2:])  # + `--port N` only
    try:
        server.wait_healthy()
        target = url.replace(f":{README_PORT}/", f":{server.port}/")
        target = target if "://" in target else "http://" + target  # curl's default scheme
        response = httpx.post(target, headers=headers, content=body, timeout=300)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"].strip() != ""

        asked = json.loads(body)["model"]
        models = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == [asked]  # the name the README asks for, not the GGUF's path

        # Only the engine core holds torch (~250 MB resident each): the launcher and the API processes
        # tokenize, template and serve HTTP without it (docs/serving.md, memory).
        with_torch = {pid for pid in [server.proc.pid, server.engine_pid(), *server.api_pids()] if _maps_torch(pid)}
        assert with_torch == {server.engine_pid()}, (with_torch, server.engine_pid(), server.api_pids())
    finally:
        server.stop()
    served = [line for line in server.log_tail(200_000).splitlines() if " served as " in line]
    assert len(served) == 1 and served[0].split(" served as ")[1].startswith(f"{asked} "), served


def _maps_torch(pid: int) -> bool:
    return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()
