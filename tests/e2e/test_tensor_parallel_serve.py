"""`pagoda serve -tp 2` and `-pp 2` on the CPU (gloo), and the Ray backend across a two-node Ray cluster on
this machine.

The reference is the one-rank engine in this process: the served TP = 2 and PP = 2 models must give its text,
streamed and not. A rank that is killed or stopped (a hang) must turn /health into 503 within a few seconds and end the
server with a non-zero exit, and SIGTERM must stop every process: no orphan is left (checked by pid).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest
from e2e_helpers import API_KEY, MODEL
from e2e_server import ServerProcess, free_port

from tests.conftest import FIXTURES

YUAN = str(FIXTURES / "yuan2-tiny")
TOKENIZER = str(FIXTURES / "yuan2-tokenizer")
FLAGS = ["--model", YUAN, "--tokenizer", TOKENIZER, "--max-model-len", "256"]
# How each layout is asked for, what its startup log says, and how a fault line names its rank 1.
LAYOUTS = {
    "tp2": (
        ["-tp", "2"],
        ["Parallel: 2 ranks (tensor 2 x pipeline 1, mp backend)", "per rank"],
        "tensor-parallel rank 1",
    ),
    "pp2": (
        ["-pp", "2"],
        ["Parallel: 2 ranks (tensor 1 x pipeline 2, mp backend)", "stage 0: layers 0-0 (rank 0); stage 1: layers 1-1"],
        "pipeline stage 1 (rank 1)",
    ),
}
PROMPTS = [case["prompt_ids"] for case in json.loads((FIXTURES / "yuan2-tiny" / "golden.json").read_text())["cases"]]


def _tp1_texts() -> list[str]:
    from pagoda import LLM, SamplingParams

    llm = LLM(YUAN, tokenizer=TOKENIZER, max_model_len=256, cpu_kv_cache_space_gib=0.05)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _ranks(server: ServerProcess) -> list[psutil.Process]:
    """The rank processes: the engine core's children other than multiprocessing's resource tracker."""
    core = psutil.Process(server.engine_pid())
    return [c for c in core.children() if "resource_tracker" not in " ".join(c.cmdline())]


def _none_alive(procs: list[psutil.Process], timeout: float = 15.0) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return alive


def _health_503_within(server: ServerProcess, seconds: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 503:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass  # the server may already be gone: that also fails the check below
        time.sleep(0.1)
    raise AssertionError(f"/health did not turn 503 within {seconds} s:\n{server.log_tail()}")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_rank_server_gives_the_one_rank_text_streamed_and_not_then_sigterm_stops_every_rank(launch_server, layout):
    flags, logged, _ = LAYOUTS[layout]
    server = launch_server(*FLAGS, *flags)
    ranks = _ranks(server)
    assert len(ranks) == 1, ranks
    for line in logged:
        assert line in server.log_tail(20000)
    expected = _tp1_texts()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    extra = {"ignore_eos": True}
    for prompt, text in zip(PROMPTS, expected):
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body=extra)
        assert done.choices[0].text == text
        assert done.usage.completion_tokens == 12 and done.usage.prompt_tokens == len(prompt)
        stream = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True, extra_body=extra
        )
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == text
    everything = _descendants(server.proc.pid)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0
    assert not _none_alive(everything), f"left behind: {_none_alive(everything, 0)}"


@pytest.mark.parametrize("fault, layout", [("killed mid-step", "tp2"), ("stopped", "tp2"), ("killed mid-step", "pp2")])
def test_a_lost_rank_gives_503_then_a_nonzero_exit_naming_it(launch_server, fault, layout):
    """Killed while the ranks step (a stream is generating), the rank shows first as a failed gloo collective
    (or send/receive between stages) in the driver: still one line names it (and its stage) and how it died,
    and no traceback reaches the log. A stopped (hung) rank is found by the same heartbeat whatever the layout
    (`worker/rank_group.py`), so it is tested once, under tensor parallelism."""
    flags, _, label = LAYOUTS[layout]
    server = launch_server(*FLAGS, *flags, env={"PAGODA_TP_HEARTBEAT_TIMEOUT_S": "2"})
    (rank,) = _ranks(server)
    everything = _descendants(server.proc.pid)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data:"):
                    break
            rank.send_signal(signal.SIGKILL if fault.startswith("killed") else signal.SIGSTOP)
            rest = "\n".join(lines)
    assert '"error"' in rest and rest.rstrip().endswith("data: [DONE]"), rest[-500:]
    waited = _health_503_within(server, 15)
    assert server.proc.wait(60) != 0
    log = server.log_tail(20000)
    named = f"{label} (pid {rank.pid}) " + (
        "died: killed by SIGKILL" if fault.startswith("killed") else "is hung: no heartbeat"
    )
    assert named in log, log
    errors = [line for line in log.splitlines() if line.startswith("pagoda: error:")]
    assert len(errors) == 1 and named in errors[0], log
    assert "Traceback" not in log and "gloo" not in log.lower(), log
    assert not _none_alive(everything), f"left behind: {_none_alive(everything, 0)}"
    print(f"{fault}: /health 503 after {waited:.1f} s")


@pytest.fixture
def ray_cluster(tmp_path):
    """Two Ray nodes on loopback: a head without CPUs (so no rank can be placed there) and one worker node."""
    ray_bin = shutil.which("ray") or os.path.join(os.path.dirname(sys.executable), "ray")
    port = str(free_port())
    env = {**os.environ, "RAY_DISABLE_IMPORT_WARNING": "1"}

    def start(*flags: str, cpus: int) -> None:
        small = ["--object-store-memory", str(80 * 2**20), "--disable-usage-stats", "--node-ip-address", "127.0.0.1"]
        cmd = [ray_bin, "start", *flags, "--num-cpus", str(cpus), *small]
        subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=120)

    start("--head", "--port", port, "--include-dashboard=false", cpus=0)
    try:
        start("--address", f"127.0.0.1:{port}", cpus=1)
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([ray_bin, "stop", "--force"], env=env, capture_output=True, timeout=120)


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=str)
def test_ray_backend_places_rank_1_on_the_other_node_and_matches_one_rank(ray_cluster, monkeypatch, parallel):
    import ray

    from pagoda import LLM, SamplingParams

    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    expected = _tp1_texts()
    llm = LLM(
        YUAN,
        tokenizer=TOKENIZER,
        max_model_len=256,
        cpu_kv_cache_space_gib=0.05,
        distributed_executor_backend="ray",
        **parallel,
    )
    try:
        runner = llm.engine.runner
        (rank1_node,) = runner.ranks.node_ids()
        assert rank1_node != ray.get_runtime_context().get_node_id()  # across the two nodes
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert [o.outputs[0].text for o in outputs] == expected
    finally:
        llm.shutdown()
        ray.shutdown()
