"""The H200 benchmark: Pagoda vs transformers `generate()`, four model shapes, offline and served, one run.

    python benchmarks/h200.py [--shapes yuan2-2b,llama-yuan2-2b-dims,qwen2-vl-2b-text,llama-3-8b]
        [--systems pagoda,transformers] [--workloads offline,serve] [--out benchmarks/results/h200.json]
        [--merge] [--artifacts DIR]

Shapes (`benchmarks/h200_shapes.py`) are built with random bf16 weights (`--load-format dummy`; speed
depends on shapes only); prompts are random token ids (offline) or random words sized to 40 tokens
by `pagoda bench`'s calibration (served; the served models carry the SmolLM2 BPE tokenizer from
--tokenizer, default .gpu/smol-tokenizer). Each measurement runs in its own process (a clean GPU).

Pagoda
  offline   `LLM.generate` on 512 prompts x 512 random ids, 256 tokens each (greedy, ignore_eos),
            max_num_seqs 512, after a warm-up; output tok/s = 512 * 256 / wall.
  decode    then 256 requests of 168-token prompts (the mean context of the serving workload) run
            until all decode, and 20 decode steps are timed one by one (synchronised):
            decode_step_ms is their median; decode_floor_ms = (weight bytes read per step +
            256 * 168 * KV bytes per token) / the device-to-device copy bandwidth measured in the
            same process.
  serve     `pagoda serve` (max_num_seqs 256, --api-server-count 4 unless --serve-extra says otherwise)
            + `pagoda bench` on /v1/completions: closed-loop
            ladder 1, 8, 32, 64, 128, 256, 4 x c requests per level (at least 8), 40 in / 256 out,
            ignore_eos, 8 client processes; at the top level a second run with 16 client processes
            shows whether the client limits the number (with 4 client processes it did; docs/performance.md).
transformers (bf16, sdpa, greedy, the same shapes; no Yuan2 class exists in transformers, so the
llama-yuan2-2b-dims row is Yuan2-2B's stand-in)
  offline   one static batch of 64 prompts x 512 ids → 256 tokens (min_new_tokens = 256); the
            8 batches W1 needs take 8x as long, so tok/s is that batch's.
  serve     c=1: TTFT = a generate(max_new_tokens=1) call, TPOT = (E2E - TTFT) / 255 of a 256-token
            generate on a 40-token prompt; c=64: the same on a static batch of 64 prompts.

Output: one table, and `--out` as {"gpu", "commit", "date", "copy_bandwidth_tb_s", "rows": [...]}, one
row per shape x system x workload x concurrency with vLLM's key names.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from h200_shapes import SHAPES, copy_bandwidth, kv_bytes_per_token, write_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LADDER = [1, 8, 32, 64, 128, 256]
ROW_KEYS = [
    "shape",
    "system",
    "workload",
    "concurrency",
    "output_throughput",
    "median_ttft_ms",
    "p95_ttft_ms",
    "median_tpot_ms",
    "p95_tpot_ms",
    "decode_step_ms",
    "decode_floor_ms",
]
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def row(shape: str, system: str, workload: str, concurrency: int | None, **values) -> dict:
    out = {k: None for k in ROW_KEYS}
    out.update(shape=shape, system=system, workload=workload, concurrency=concurrency, **values)
    return out


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def weight_bytes_per_step(model) -> int:
    """Bytes of weights one decode step reads: everything but the vision tower and an untied input
    embedding (a gather of B rows); a tied embedding is read whole as the LM head."""
    total = 0
    tied = bool(getattr(model, "tie_word_embeddings", False))
    for name, p in model.named_parameters():
        if "visual" in name or ("embed_tokens" in name and not tied):
            continue
        total += p.numel() * p.element_size()
    return total


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    low = min(1000, vocab // 4)
    return [[rng.randrange(low, min(vocab, 32000)) for _ in range(length)] for _ in range(n)]


# ---- Pagoda, offline + decode step (one process) ------------------------------------------------
def pagoda_offline(folder: str, shape: str, args: argparse.Namespace) -> list[dict]:
    from pagoda import LLM, SamplingParams

    llm = LLM(
        model=folder,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=1024,
        max_num_seqs=args.offline_max_num_seqs,
        seed=0,
    )
    vocab = llm.engine.vocab_size
    prompts = random_prompts(args.offline_prompts, args.input_len, vocab, 0)
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:16]], warm, use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    _sync()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _sync()
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    rows = [
        row(
            shape,
            "pagoda",
            "offline",
            args.offline_max_num_seqs,
            output_throughput=produced / seconds,
            total_token_throughput=(produced + args.input_len * len(prompts)) / seconds,
            seconds=seconds,
            num_prompts=len(prompts),
            steps=llm.engine.scheduler.stats.num_steps,
            preemptions=llm.engine.scheduler.stats.num_preemptions,
        )
    ]

    # Decode step at batch 256, mean context 168.
    engine = llm.engine
    batch, context = 256, 168
    dparams = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i, p in enumerate(random_prompts(batch, context - 20, vocab, 1)):
        engine.add_request(f"d{i}", p, dparams)
    while engine.scheduler.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    for _ in range(19):  # to context 168 on average at the timed steps' middle
        engine.step()
    times = []
    for _ in range(20):
        _sync()
        t0 = time.perf_counter()
        engine.step()
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
    running = engine.scheduler.num_running
    engine.abort_request([f"d{i}" for i in range(batch)])
    model = engine.runner.model
    floor_bytes = weight_bytes_per_step(model) + batch * context * kv_bytes_per_token(args.shape_config)
    bandwidth = copy_bandwidth()
    times.sort()
    step = times[len(times) // 2]
    rows.append(
        row(
            shape,
            "pagoda",
            "decode",
            batch,
            decode_step_ms=step,
            output_throughput=batch / step * 1e3,
            decode_floor_ms=floor_bytes / bandwidth * 1e3 if bandwidth else None,
            running=running,
            floor_bytes=floor_bytes,
            copy_bandwidth_tb_s=bandwidth / 1e12 if bandwidth else None,
        )
    )
    return rows


# ---- transformers (one process) -----------------------------------------------------------------
def transformers_runs(folder: str, shape: str, args: argparse.Namespace) -> list[dict]:
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    cls = getattr(transformers, config.architectures[0])  # the concrete class has _from_config
    torch.manual_seed(0)
    with torch.device(_device()):
        model = cls._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    vocab = config.vocab_size if hasattr(config, "vocab_size") else config.text_config.vocab_size

    def generate(ids: list[list[int]], new: int) -> float:
        batch = torch.tensor(ids, device=_device())
        mask = torch.ones_like(batch)
        _sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=batch,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
        _sync()
        return time.perf_counter() - t0

    rows = []
    generate(random_prompts(2, 16, vocab, 9), 4)  # warm-up
    offline = random_prompts(64, args.input_len, vocab, 0)
    seconds = generate(offline, args.output_len)
    rows.append(
        row(
            shape,
            "transformers",
            "offline",
            64,
            output_throughput=64 * args.output_len / seconds,
            seconds_per_batch=seconds,
            note="one static batch of 64; W1 = 8 such batches",
        )
    )
    for c in (1, 64):
        prompts = random_prompts(c, 40, vocab, 2)
        ttfts = sorted(generate(prompts, 1) for _ in range(3))
        ttft = ttfts[1]
        e2e = generate(prompts, 256)
        tpot = (e2e - ttft) / 255
        rows.append(
            row(
                shape,
                "transformers",
                "serve",
                c,
                output_throughput=c * 256 / e2e,
                median_ttft_ms=ttft * 1e3,
                p95_ttft_ms=ttft * 1e3,
                median_tpot_ms=tpot * 1e3,
                p95_tpot_ms=tpot * 1e3,
                note="static batch" if c > 1 else "one request at a time",
            )
        )
    return rows


# ---- Pagoda served ----------------------------------------------------------------------------
def _env() -> dict[str, str]:
    """Children import this checkout's pagoda whether or not it is installed."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))


def wait_ready(server: subprocess.Popen, port: int, log_path: str, timeout: float = 900) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"pagoda serve exited ({server.returncode}):\n" + open(log_path).read()[-3000:])
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"pagoda serve not ready after {timeout:.0f} s")


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM the server's process group (engine core included), SIGKILL after 30 s; it may be gone."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pagoda_serve(folder: str, shape: str, args: argparse.Namespace) -> list[dict]:
    port = free_port()
    log_path = os.path.join(args.artifacts, f"server_{shape}.log")
    log = open(log_path, "w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagoda",
            "serve",
            folder,
            "--load-format",
            "dummy",
            "--dtype",
            "bfloat16",
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--max-num-seqs",
            str(max(args.ladder)),
            "--max-model-len",
            "2048",
            "--served-model-name",
            shape,
        ]
        + args.serve_extra,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=ROOT,
        env=_env(),
    )
    rows = []
    try:
        started = time.perf_counter()
        wait_ready(server, port, log_path)
        print(f"{shape}: server ready in {time.perf_counter() - started:.0f} s", flush=True)
        runs = [(args.ladder, args.client_processes)]
        if args.recheck_clients:
            runs.append(([max(args.ladder)], 2 * args.client_processes))
        for ladder, processes in runs:
            out = os.path.join(args.artifacts, f"bench_{shape}_p{processes}.json")
            cmd = [
                sys.executable,
                "-m",
                "pagoda",
                "bench",
                "--base-url",
                f"http://127.0.0.1:{port}",
                "--model",
                shape,
                "--endpoint",
                "completions",
                "--concurrency",
                ",".join(map(str, ladder)),
                "--input-len",
                "40",
                "--output-len",
                str(args.serve_output_len),
                "--ignore-eos",
                "--prompts-per-concurrency",
                str(args.prompts_per_level),
                "--warmup",
                str(args.serve_warmup),
                "--client-processes",
                str(processes),
                "--ready-timeout",
                "600",
                "--no-progress",
                "--save-detailed",
                "--out",
                out,
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env())
            with open(os.path.join(args.artifacts, f"bench_{shape}_p{processes}.txt"), "w") as f:
                f.write(proc.stdout + proc.stderr)
            if not os.path.exists(out):
                print(f"bench failed for {shape}:\n{proc.stderr[-2000:]}", flush=True)
                break
            for p in json.load(open(out))["points"]:
                rows.append(
                    row(
                        shape,
                        "pagoda",
                        "serve",
                        p["concurrency"],
                        **{
                            k: p.get(k)
                            for k in (
                                "output_throughput",
                                "median_ttft_ms",
                                "p95_ttft_ms",
                                "median_tpot_ms",
                                "p95_tpot_ms",
                                "completed",
                                "failed",
                                "client_processes",
                                "client_cpu_percent",
                                "total_input_tokens",
                            )
                        },
                        **{
                            k: (p.get("server_metrics") or {}).get(k)
                            for k in (
                                "server_mean_ttft_ms",
                                "engine_host_ms_per_step",
                                "engine_wait_ms_per_step",
                                "engine_cpu_ms_per_step",
                            )
                        },
                        api_server_count=_api_server_count(args.serve_extra),
                    )
                )
    except RuntimeError as exc:
        print(f"serve {shape} failed: {exc}", flush=True)
    finally:
        _stop(server)
        log.close()
    return rows


def _api_server_count(serve_extra: list[str]) -> int:
    for i, flag in enumerate(serve_extra[:-1]):
        if flag in ("--api-server-count", "-asc"):
            return int(serve_extra[i + 1])
    return 1


# ---- driver -------------------------------------------------------------------------------------
def run_child(kind: str, folder: str, shape: str, args: argparse.Namespace) -> list[dict]:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        kind,
        "--child-folder",
        folder,
        "--shapes",
        shape,
        "--artifacts",
        args.artifacts,
        "--offline-prompts",
        str(args.offline_prompts),
        "--offline-max-num-seqs",
        str(args.offline_max_num_seqs),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
    ] + (["--tiny"] if args.tiny else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    with open(os.path.join(args.artifacts, f"{kind}_{shape}.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ROWS ")), None)
    if proc.returncode or line is None:
        print(f"{kind} {shape} failed ({proc.returncode}): {proc.stderr[-1500:]}", flush=True)
        return []
    return json.loads(line[5:])


def shape_config(shape: str, tiny: bool) -> dict:
    cfg = dict(SHAPES[shape])
    if tiny:
        cfg.update(TINY, num_key_value_heads=min(cfg.get("num_key_value_heads", 4), 4))
        if "vision_config" in cfg:
            cfg["vision_config"] = dict(cfg["vision_config"], depth=1, embed_dim=32, num_heads=2, hidden_size=64)
            cfg["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
    return cfg


def print_table(rows: list[dict]) -> None:
    def f(v, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v)

    print("| shape | system | workload | c | out tok/s | TTFT p50/p95 ms | TPOT p50/p95 ms | decode step / floor ms |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        c = f"{r['concurrency']}" + (f" ({r['client_processes']} clients)" if r.get("client_processes") else "")
        c += f" (commit {r['variant']})" if r.get("variant") else ""
        c += f", {r['api_server_count']} API procs" if (r.get("api_server_count") or 1) > 1 else ""
        c += f" [{r['run']}]" if r.get("run") else ""
        print(
            f"| {r['shape']} | {r['system']} | {r['workload']} | {c} | {f(r['output_throughput'], '{:,.0f}')} | "
            f"{f(r['median_ttft_ms'])} / {f(r['p95_ttft_ms'])}"
            + (f" (server mean {r['server_mean_ttft_ms']:.1f})" if r.get("server_mean_ttft_ms") else "")
            + f" | {f(r['median_tpot_ms'], '{:.2f}')} / {f(r['p95_tpot_ms'], '{:.2f}')}"
            # the engine core per step over the level: host work + waiting for the GPU (≈ 0: host-bound)
            + (
                f" (core host {r['engine_host_ms_per_step']:.2f} + GPU wait {r['engine_wait_ms_per_step']:.2f}"
                + (
                    f", core CPU {r['engine_cpu_ms_per_step']:.2f}"
                    if r.get("engine_cpu_ms_per_step") is not None
                    else ""
                )
                + ")"
                if r.get("engine_host_ms_per_step") is not None
                else ""
            )
            + f" | {f(r['decode_step_ms'], '{:.2f}')} / {f(r['decode_floor_ms'], '{:.2f}')} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--systems", default="pagoda,transformers")
    ap.add_argument("--workloads", default="offline,serve")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "h200.json"))
    ap.add_argument("--merge", action="store_true", help="keep --out's rows of shapes not run now")
    ap.add_argument("--artifacts", default=None, help="logs and raw bench JSON (default: a temp folder)")
    ap.add_argument(
        "--tokenizer",
        default=os.path.join(ROOT, ".gpu", "smol-tokenizer"),
        help="tokenizer files copied into every served model but Yuan2's",
    )
    ap.add_argument(
        "--yuan-tokenizer",
        default=next(
            (
                p
                for p in (
                    os.path.join(ROOT, "..", "shared", "fixtures", "yuan2-tokenizer"),
                    os.path.join(ROOT, "shared", "fixtures", "yuan2-tokenizer"),
                )
                if os.path.isdir(p)
            ),
            None,
        ),
        help="Yuan2's SentencePiece tokenizer folder (the served yuan2-2b shape needs it)",
    )
    ap.add_argument("--ladder", default=",".join(map(str, LADDER)))
    ap.add_argument("--prompts-per-level", type=int, default=4)
    ap.add_argument("--client-processes", type=int, default=8)
    ap.add_argument("--recheck-clients", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--offline-prompts", type=int, default=512)
    ap.add_argument("--offline-max-num-seqs", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--serve-output-len", type=int, default=256)
    ap.add_argument("--serve-warmup", type=int, default=16, help="unmeasured requests before each level")
    ap.add_argument(
        "--serve-extra",
        default="--api-server-count 4",
        help="extra `pagoda serve` flags, one string (default: four API processes. With the text "
        "decoded in the API processes, Yuan2-2B at c=256 on the H200 reached 41.5k-43.6k tok/s "
        "with four or three of them against 34.1k-38.3k with two)",
    )
    ap.add_argument("--tiny", action="store_true", help="shrink every shape (a CPU smoke run of this script)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-folder", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.ladder = [int(x) for x in args.ladder.split(",")]
    args.serve_extra = args.serve_extra.split()
    shapes = args.shapes.split(",")
    if args.child:
        args.shape_config = shape_config(shapes[0], args.tiny)
        fn = {"pagoda": pagoda_offline, "transformers": transformers_runs}[args.child]
        print("ROWS " + json.dumps(fn(args.child_folder, shapes[0], args)), flush=True)
        return

    # A `timeout` around this script must not leave a server holding the GPU for the next run:
    # SIGTERM unwinds through pagoda_serve's finally, which stops the server's process group.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.artifacts = args.artifacts or tempfile.mkdtemp(prefix="h200_")
    os.makedirs(args.artifacts, exist_ok=True)
    rows: list[dict] = []
    gpu = None
    with tempfile.TemporaryDirectory() as folder:
        for shape in shapes:
            tokenizer = args.yuan_tokenizer if SHAPES[shape]["model_type"] == "yuan" else args.tokenizer
            path = write_config(folder, shape, tokenizer)
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(shape_config(shape, args.tiny), f, indent=1)
            started = time.perf_counter()
            if "pagoda" in args.systems and "offline" in args.workloads:
                rows += run_child("pagoda", path, shape, args)
            if "pagoda" in args.systems and "serve" in args.workloads:
                rows += pagoda_serve(path, shape, args)
            if "transformers" in args.systems and shape != "yuan2-2b":
                rows += run_child("transformers", path, shape, args)
            print(f"{shape}: {time.perf_counter() - started:.0f} s", flush=True)
            print_table([r for r in rows if r["shape"] == shape])
    try:
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except ImportError:
        pass
    commit = os.environ.get("PAGODA_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT
            ).stdout.strip()
        except OSError:
            commit = None
    result = {"gpu": gpu, "commit": commit, "date": datetime.date.today().isoformat(), "rows": rows}
    if args.merge and os.path.exists(args.out):
        old = json.load(open(args.out))
        result["rows"] = [r for r in old["rows"] if r["shape"] not in shapes] + rows
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print()
    print_table(result["rows"])
    print(f"\nwrote {args.out}; logs in {args.artifacts}")


if __name__ == "__main__":
    main()
