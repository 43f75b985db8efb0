"""What the API process costs per streamed token: its CPU seconds (utime + stime from /proc) / tokens streamed.

    python benchmarks/profile/api_overhead.py --concurrency 64 --num-prompts 256 --output-len 256 [--rounds 3]

The API process here is the real one (AsyncEngine, the FastAPI app, uvicorn on the same event loop as
`pagoda serve`), but its engine core is a fake: `core_process`'s own loop and wire format around an engine
that has no model and emits one token (" tok") per running request per step, `--step-ms` apart (a decode
step's duration). So what remains is the API process's own work per token (receiving and routing the
core's outputs, building SSE chunks, HTTP), measurable on a small CPU. The client is a light in-process
raw HTTP streaming client (`/v1/completions`, token-id prompts, stream_options.include_usage, like `pagoda bench`
with --endpoint completions --ignore-eos).

1e6 / (us per token) is the token rate one API core can stream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the fake engine core ---------------------------------------------------------------------------------------
class FakeEngine:
    """The slice of LLMEngine that `core_process._loop` uses; every running request gets one token per step."""

    def __init__(self, step_s: float):
        from pagoda.outputs import EngineStats

        self.step_s = step_s
        self.running: dict[str, list[Any]] = {}  # id → [params, prompt ids, prompt, samples emitted, n]
        self.steps = 0
        self._stats = EngineStats

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: Any,
        prompt: str | None = None,
        delta: bool = True,
        arrival_time: float | None = None,
        mm_inputs: Any = None,
        detokenize: bool = True,
    ) -> None:
        # detokenize=False (API-side text, several API processes) is not modelled: this API process is
        # the one-process layout, where the core sends the text.
        self.running[request_id] = [params, prompt_token_ids, prompt, 0]

    def abort_request(self, request_ids: list[str]) -> list[Any]:
        from pagoda.outputs import CompletionOutput, RequestOutput

        outs = []
        for rid in request_ids:
            if (entry := self.running.pop(rid, None)) is not None:
                params, ids, prompt, _ = entry
                outs.append(
                    RequestOutput(
                        rid,
                        prompt,
                        ids,
                        [CompletionOutput(i, "", [], None, None, "abort") for i in range(params.n)],
                        True,
                        0,
                        0.0,
                    )
                )
        return outs

    def step(self) -> list[Any]:
        from pagoda.outputs import CompletionOutput, RequestOutput

        if self.step_s:
            time.sleep(self.step_s)
        self.steps += 1
        outs = []
        for rid, entry in list(self.running.items()):
            params, ids, prompt, emitted = entry
            emitted += 1
            entry[3] = emitted
            done = emitted >= params.max_tokens
            reason = "length" if done else None
            outs.append(
                RequestOutput(
                    rid,
                    prompt,
                    ids,
                    [CompletionOutput(i, " tok", [1000 + emitted % 100], None, None, reason) for i in range(params.n)],
                    done,
                    0,
                    0.001 if done else None,
                )
            )
            if done:
                del self.running[rid]
        return outs

    def stats(self) -> Any:
        return self._stats(len(self.running), 0, len(self.running) / 1000, 0, 0, 0, self.steps)


def fake_core(
    step_s: float, input_address: str, control_address: str, client_addresses: list[str], engine: Any = None
) -> None:
    """Like `core_process.run_engine_core`, with a FakeEngine (or `engine`, one like it)."""
    import signal

    import zmq

    from pagoda.engine import core_process

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(input_address)
    control = ctx.socket(zmq.PUSH)
    control.connect(control_address)
    outboxes = [ctx.socket(zmq.PUSH) for _ in client_addresses]
    for outbox, address in zip(outboxes, client_addresses):
        outbox.connect(address)
    control.send_pyobj(core_process.Ready(10_000, 16, 1000.0))
    try:
        core_process._loop(engine or FakeEngine(step_s), inbox, outboxes)
    finally:
        for box in [control, *outboxes]:
            box.close(linger=1000)
        inbox.close(linger=0)


def serve_fake_api(
    port: int,
    step_s: float,
    use_uvloop: bool = False,
    tokenizer: Any = None,
    core_entry: Any = None,
    instrument: Any = None,
) -> None:
    """The API process: AsyncEngine (over the fake core), the app, uvicorn, on asyncio.run like `pagoda serve`
    (or on a uvloop loop, to see what that would change). `tokenizer` (for text prompts), `core_entry` (a
    picklable `run_engine_core` stand-in) and `instrument(app, engine) -> app` are for `api_burst.py`."""
    import functools

    import uvicorn

    from pagoda.engine.async_engine import AsyncEngine
    from pagoda.engine.core_process import CoreProcess
    from pagoda.processes.supervisor import Supervisor
    from pagoda.server.app import build_app
    from pagoda.server.metrics import ServerMetrics
    from pagoda.server.serving import OpenAIServing, ServingContext

    async def main() -> None:
        supervisor = Supervisor(metrics=False)
        entry = core_entry or functools.partial(_core_entry, step_s)
        core = CoreProcess(supervisor, None, 1, target=entry)  # type: ignore[arg-type]
        core.wait_ready()
        engine = AsyncEngine(None, core.clients[0])  # type: ignore[arg-type]
        await engine.start()
        try:
            ctx = ServingContext(
                engine=engine,
                tokenizer=tokenizer,
                served_model_names=["fake"],
                max_model_len=4096,
                vocab_size=32000,
                architecture="Fake",
                chat_template=None,
                metrics=ServerMetrics("fake"),
            )
            engine.add_listener(ctx.metrics.on_engine_outputs)
            app = build_app(OpenAIServing(ctx))
            if instrument is not None:
                app = instrument(app, engine)
            from pagoda.serving_gc import prepare_gc_for_serving

            prepare_gc_for_serving()  # as `pagoda serve` does
            server = uvicorn.Server(
                uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, backlog=4096)
            )
            await server.serve()
        finally:
            await engine.shutdown()
            core.shutdown()
            core.close()
            supervisor.close()

    if use_uvloop:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main())
    else:
        asyncio.run(main())


def _core_entry(
    step_s: float,
    config: Any,
    input_address: str,
    control_address: str,
    client_addresses: list[str],
    heartbeat: Any = None,
) -> None:
    fake_core(step_s, input_address, control_address, client_addresses)


# -- measuring ------------------------------------------------------------------------------------------------
def wait_healthy(url: str, api: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or api.poll() is not None:
            raise RuntimeError("the API process did not come up")
        time.sleep(0.2)


def stop(api: subprocess.Popen, spy: subprocess.Popen | None) -> None:
    if spy is not None:
        spy.send_signal(2)
        spy.wait(30)
    api.terminate()
    api.wait(30)


def start_py_spy(path: str, pid: int) -> subprocess.Popen:
    """py-spy recording `pid` at 1 kHz in raw (collapsed stacks) format into `path`; stop it with SIGINT."""
    spy = subprocess.Popen(["py-spy", "record", "-o", path, "-p", str(pid), "-r", "1000", "--nonblocking", "-f", "raw"])
    time.sleep(1)
    return spy


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(utime, stime) of one process (not its children: the fake core is not the API's cost)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


async def drive(url: str, concurrency: int, prompts: int, ns: argparse.Namespace) -> tuple[int, int, int]:
    """(completion tokens per the usage chunks, data events, failures). A raw HTTP/1.1 keep-alive client
    (no parsing beyond counting events and finding the end), so that on a small box it takes less CPU
    than the server it measures."""
    body = json.dumps(
        {
            "model": "fake",
            "stream": True,
            "max_tokens": ns.output_len,
            "ignore_eos": True,
            "prompt": list(range(100, 100 + ns.input_len)),
            "n": ns.n,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    host, port = url.rsplit("/", 1)[1].split(":")
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    tokens = events = failures = 0
    todo = iter(range(prompts))

    async def worker() -> None:
        nonlocal tokens, events, failures
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            for _ in todo:
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.1 200"):
                    failures += 1
                    return
                tail = b""
                while not tail.endswith(b"0\r\n\r\n"):  # the chunked body's last chunk
                    chunk = await reader.read(65536)
                    if not chunk:
                        raise ConnectionError("closed mid-stream")
                    events += chunk.count(b"data:")
                    tail = (tail + chunk)[-400:]
                usage = tail.rsplit(b'"completion_tokens":', 1)
                tokens += int(usage[1].split(b",", 1)[0]) if len(usage) == 2 else 0
        except (OSError, asyncio.IncompleteReadError, ConnectionError):
            failures += 1
        finally:
            writer.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tokens, events, failures


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--serve-fake":
        serve_fake_api(int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "uvloop")
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=40)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--step-ms", type=float, default=5.0, help="fake decode step time (default 5)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--uvloop",
        action="store_true",
        help="run the API process on uvloop (`pagoda serve` runs on asyncio's default loop)",
    )
    p.add_argument("--profile", metavar="SVG", help="also record the API process with py-spy into SVG")
    p.add_argument("--out", help="write the results as JSON here")
    ns = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    api = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--serve-fake",
            str(port),
            str(ns.step_ms / 1000),
            "uvloop" if ns.uvloop else "asyncio",
        ],
        env=env,
    )
    spy = None
    try:
        wait_healthy(url, api)
        asyncio.run(drive(url, min(ns.concurrency, 8), 16, ns))  # warm-up
        if ns.profile:
            spy = start_py_spy(ns.profile, api.pid)
        rows = []
        for _ in range(ns.rounds):
            c0, t0 = cpu_seconds(api.pid), time.monotonic()
            tokens, events, failures = asyncio.run(drive(url, ns.concurrency, ns.num_prompts, ns))
            c1, wall = cpu_seconds(api.pid), time.monotonic() - t0
            user, system = c1[0] - c0[0], c1[1] - c0[1]
            cpu = user + system
            rows.append(
                {
                    "tokens": tokens,
                    "events": events,
                    "failures": failures,
                    "api_cpu_s": cpu,
                    "api_user_s": user,
                    "api_system_s": system,
                    "wall_s": wall,
                    "us_per_token": cpu / max(tokens, 1) * 1e6,
                    "tokens_per_s": tokens / wall,
                    "api_cores_busy": cpu / wall,
                }
            )
            print(
                f"{tokens} tokens ({events} events) in {wall:.2f} s ({tokens / wall:.0f}/s), {failures} failed; "
                f"API CPU {cpu:.2f} s ({cpu / wall:.2f} cores, {system / max(cpu, 1e-9):.0%} kernel): "
                f"{rows[-1]['us_per_token']:.1f} us/token",
                file=sys.stderr,
            )
        result = {
            "config": vars(ns),
            "runs": rows,
            "us_per_token_median": statistics.median(r["us_per_token"] for r in rows),
            "us_per_token_min": min(r["us_per_token"] for r in rows),
        }
        print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
        if ns.out:
            Path(ns.out).write_text(json.dumps(result, indent=2))
    finally:
        stop(api, spy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
