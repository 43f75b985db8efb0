"""Host time of one engine step beyond the model, at a full decode batch (CPU; no GPU needed).

    python benchmarks/profile/host_overhead.py [--arch llama|qwen2_vl] [--batch 256] [--steps 48] [--prompt-len 40]
        [--configs greedy,greedy+detok,sampled+detok,rep+detok] [--profile CONFIG] [--json FILE]

An `LLMEngine` on a tiny random Llama (2 layers, hidden 64, load_format="dummy"; `--arch qwen2_vl`: the same
language model in Qwen2-VL's layout, M-RoPE positions included) with the
SmolLM2 vocabulary (49152 ids; its tokenizer comes from the embedded default model's GGUF) gets
`--batch` requests of ~`--prompt-len` random prompt tokens (max_tokens large, ignore_eos) in
streaming (delta) mode, as the server drives it. Once every request decodes, `--steps` calls of
`LLMEngine.step()` are timed, each split into

  schedule    Scheduler.schedule()
  prep        ModelRunner.launch() + PendingStep.result() minus the timed parts below: state diff, input arrays and
              tensors, sample-row selection, token bookkeeping (the runner's host work)
  forward     model forward (+ compute_logits): device work, excluded from the host total
  samp_prep   the sampler's batch from the runner's SamplingState rows, and their updates: host work
  sampler     Sampler.forward: device work, excluded from the host total
  update      Scheduler.update()
  process     OutputProcessor.process() (incremental detokenization in the +detok configs)
  send        the step's outputs as wire tuples, pickled, as the core process sends them to the API
  gc          time in the garbage collector during the step (already counted in the rows above)

Times are this thread's CPU time by default (--clock thread: steady when other work shares the
cores; forward and sampler then miss torch's other intra-op threads) or wall time (--clock wall).
Per-step µs are medians over the timed steps (the per-block-boundary steps included; means are
in the JSON). Configs: greedy (no tokenizer), greedy+detok, sampled+detok (temperature 0.8,
top_p 0.95), rep+detok (greedy, repetition_penalty 1.05: Qwen2-VL's default), seeded+detok
(sampled with a per-request seed), logprobs+detok (greedy, logprobs=5), greedy+apidetok (greedy, a
tokenizer loaded, but requests added with detokenize=False: the server's case for requests without
stop strings, whose text the API process decodes).
--decode-graphs sends decode steps through the runner's CUDA-graph input path (static buffers,
`worker/graph_runner.py`) with the replay stubbed by fixed random logits: prep is then the host work
of a graph step as on the GPU machine.
--image (with --arch qwen2_vl) gives every prompt one small image (a 4x4-patch grid: 4 placeholder tokens, its own
content hash), so the decode steps take an image request's host path (M-RoPE positions from each request's table,
the encoder-overlap check).
--churn C keeps the batch full while C requests end and C new ones start at every step (each lives batch / C tokens),
as under steady load with short answers: each timed step then also prefills C prompts and finishes C requests.
--profile CONFIG prints cProfile's top functions for that config's timed steps (forward and sampler
compute included: read the host rows).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pickle
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.engine.core_process import Outputs, wire_output  # noqa: E402

VOCAB = 49152
TINY = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float32",
)

CONFIGS = {
    "greedy": (False, dict(temperature=0.0)),
    "greedy+detok": (True, dict(temperature=0.0)),
    "sampled+detok": (True, dict(temperature=0.8, top_p=0.95)),
    "rep+detok": (True, dict(temperature=0.0, repetition_penalty=1.05)),
    "seeded+detok": (True, dict(temperature=0.8, top_p=0.95, seed=1)),
    "logprobs+detok": (True, dict(temperature=0.0, logprobs=5)),
    # As the server runs a request without stop strings: the API process detokenizes it, not the core.
    "greedy+apidetok": (True, dict(temperature=0.0)),
}
API_DETOK = {"greedy+apidetok"}
PARTS = ["schedule", "prep", "samp_prep", "update", "process", "send", "forward", "sampler"]
HOST = ["schedule", "prep", "samp_prep", "update", "process", "send"]


def qwen2_vl_config() -> dict:
    """The same tiny language model as Qwen2-VL lays it out (M-RoPE sections, a 2-block vision tower that text
    requests never run): a step's host work with Qwen2-VL's position and input handling."""
    import transformers

    shared = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    text = {key: TINY[key] for key in (*shared, "num_key_value_heads", "max_position_embeddings")}
    text.update(
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
    )
    vision = dict(
        depth=2,
        embed_dim=32,
        num_heads=4,
        mlp_ratio=4,
        patch_size=14,
        temporal_patch_size=2,
        spatial_merge_size=2,
        in_channels=3,
        hidden_size=TINY["hidden_size"],
    )
    config = transformers.Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=VOCAB - 4,
        video_token_id=VOCAB - 3,
        vision_start_token_id=VOCAB - 2,
        vision_end_token_id=VOCAB - 1,
    ).to_dict()
    arch = {"architectures": ["Qwen2VLForConditionalGeneration"], "torch_dtype": "float32"}
    return config | arch | {"bos_token_id": 1, "eos_token_id": 2}


def model_folder(root: str, arch: str = "llama") -> str:
    """config.json of the tiny model (`arch`: llama or qwen2_vl) + the SmolLM2 tokenizer files."""
    from pagoda.models.gguf_checkpoint import default_gguf_path, load_gguf_tokenizer

    folder = os.path.join(root, "tiny-smol")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(TINY if arch == "llama" else qwen2_vl_config(), f)
    load_gguf_tokenizer(default_gguf_path()).save_pretrained(folder)
    return folder


class Timer:
    """Wraps callables so each call's time is added to one bucket of the current step."""

    clock = staticmethod(time.perf_counter)

    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)
        self.keep: list = []  # tensors freed only after a step's timing

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.step[name] += self.clock() - t0

        return timed


def instrument(engine, timer: Timer) -> None:
    runner = engine.runner
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)
    engine.scheduler.update = timer.wrap("update", engine.scheduler.update)
    engine.output_processor.process = timer.wrap("process", engine.output_processor.process)
    # The runner's step: launch() (inputs, forward, sampling queued) + PendingStep.result() (tokens read
    # back and appended); the engine calls the two, in order without async scheduling (the CPU default).
    from pagoda.worker.pending_step import PendingStep

    runner.launch = timer.wrap("execute", runner.launch)
    original = PendingStep.__dict__.get("_unwrapped_result", PendingStep.result)  # one wrap per config
    PendingStep._unwrapped_result = original
    PendingStep.result = timer.wrap("execute", original)
    runner.model.forward = timer.wrap("forward", runner.model.forward)
    # The logits ([B, V] float32, 50 MB here) are kept until the step's timing is over: on the CPU,
    # freeing them at the end of execute() is an munmap of several ms that a GPU's caching
    # allocator does not have, and it would be counted as the runner's host work.
    compute_logits = runner.model.compute_logits

    def keep_logits(*args, **kwargs):
        logits = compute_logits(*args, **kwargs)
        timer.keep.append(logits)
        return logits

    runner.model.compute_logits = timer.wrap("forward", keep_logits)
    runner.sampler.forward = timer.wrap("sampler", runner.sampler.forward)
    # The runner's persistent sampling rows (layers/sampler.py: SamplingState) are the sampling prep.
    state = runner.sampling
    for name in ("add", "remove", "batch", "update"):
        setattr(state, name, timer.wrap("samp_prep", getattr(state, name)))


def use_decode_graph_path(runner) -> None:
    """Send pure decode steps through the runner's CUDA-graph input path (`worker/graph_runner.py`,
    static buffers, capture=False on the CPU) with the replay itself stubbed: it returns one of a few
    fixed random logits tensors, standing in for the GPU work of the captured forward. What is timed
    as prep is then exactly the host work a graph step has on the GPU machine."""
    from pagoda.layers.triton_attention import TritonAttentionBackend
    from pagoda.worker.graph_runner import DECODE

    runner.backend = TritonAttentionBackend()  # graphs need it; no kernel runs (replay is stubbed)
    runner.enable_cuda_graphs(capture=False)
    graphs = runner.graphs
    gen = torch.Generator().manual_seed(0)
    bank = [torch.randn(graphs.spec.num_rows, runner.vocab_size, generator=gen) * 4 for _ in range(3)]
    hidden = torch.zeros(max(graphs.spec.token_buckets, default=1), runner.link.hidden_size, dtype=runner.dtype)
    calls = [0]

    def replay(kind, b, attn):
        # A decode bucket's graph gives every row's logits; a mixed bucket's (--churn) its tokens' hidden states,
        # whose sampled rows the runner then takes through the LM head (the tiny model's: little work).
        calls[0] += 1
        return bank[calls[0] % len(bank)][:b] if kind == DECODE else hidden[:b]

    graphs._attention = lambda kind, b: None  # built once at capture on the GPU, not per step
    graphs._forward = replay


def one_image_prompt(text: list[int], index: int):
    """`text` + <vision_start> + 4 image placeholders (a 1x4x4 patch grid, random normalised patches) + <vision_end>,
    and its multimodal inputs as the frontend builds them."""
    import numpy as np

    from pagoda.frontend.multimodal.mrope import mrope_positions
    from pagoda.inputs import MultiModalInputs, MultiModalItem

    offset = len(text) + 1
    prompt = [*text, VOCAB - 2, *([VOCAB - 4] * 4), VOCAB - 1]
    pixels = np.random.default_rng(index).standard_normal((16, 3 * 2 * 14 * 14)).astype(np.float32)
    item = MultiModalItem("image", pixels, (1, 4, 4), offset, 4, index.to_bytes(16, "little"))
    positions, delta = mrope_positions(len(prompt), [item])
    return prompt, MultiModalInputs([item], positions, delta, {"image": 4})


WARM_STEPS = 3  # steps run before the timed ones, once every request decodes


def run_config(
    folder: str,
    name: str,
    batch: int,
    steps: int,
    prompt_len: int,
    profile: bool,
    decode_graphs: bool = False,
    image: bool = False,
    churn: int = 0,
) -> dict:
    detok, knobs = CONFIGS[name]
    llm = LLM(
        model=folder,
        load_format="dummy",
        skip_tokenizer_init=not detok,
        max_model_len=2048,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch),
        cpu_kv_cache_space_gib=1.0,
        seed=0,
    )
    engine = llm.engine
    rng = random.Random(0)
    # --churn c: every request lives batch / c tokens, the first batch's staggered so that c of them end at each
    # timed step, and each one that ends is replaced at once: each step then also prefills c new prompts.
    life = batch // churn if churn else 0
    added = [0]

    def add(max_tokens: int) -> None:
        i = added[0]
        added[0] += 1
        prompt = [rng.randrange(3, VOCAB - 4) for _ in range(rng.randint(prompt_len - 8, prompt_len + 8))]
        mm = None
        if image:
            prompt, mm = one_image_prompt(prompt, i)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **knobs)
        engine.add_request(str(i), prompt, params, delta=True, detokenize=name not in API_DETOK, mm_inputs=mm)

    for i in range(batch):
        add(WARM_STEPS + 2 + i // churn if churn else 1000)  # group i // churn ends at that timed step
    while engine.scheduler.num_waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    if decode_graphs:
        use_decode_graph_path(engine.runner)
    for _ in range(WARM_STEPS):  # warm up the decode path
        for _ in range(sum(out.finished for out in engine.step())):
            add(life)
    timer = Timer()
    instrument(engine, timer)
    if decode_graphs:
        graphs = engine.runner.graphs
        graphs._forward = timer.wrap("forward", graphs._forward)
    samples: list[dict[str, float]] = []
    prof = cProfile.Profile() if profile else None
    gc_start = [0.0]

    def on_gc(phase: str, info: dict) -> None:  # time in the garbage collector, any generation
        if phase == "start":
            gc_start[0] = timer.clock()
        else:
            timer.step["gc"] += timer.clock() - gc_start[0]

    gc.callbacks.append(on_gc)
    for _ in range(steps):
        timer.step = defaultdict(float)
        t0 = timer.clock()
        if prof:
            prof.enable()
        outs = engine.step()
        for _ in range(sum(out.finished for out in outs)):
            add(life)  # before the next step: the engine takes it in its next schedule
        # What the core process then sends: the outputs as wire tuples, pickled (ZMQ's send_pyobj).
        t_send = timer.clock()
        pickle.dumps(Outputs([wire_output(out) for out in outs], engine.stats()), pickle.DEFAULT_PROTOCOL)
        timer.step["send"] += timer.clock() - t_send
        if prof:
            prof.disable()
        total = timer.clock() - t0
        timer.keep.clear()
        assert len(outs) >= batch - churn and engine.scheduler.num_running + engine.scheduler.num_waiting == batch
        s = dict(timer.step)
        s["prep"] = s.pop("execute") - s.get("forward", 0) - s.get("sampler", 0) - s.get("samp_prep", 0)
        s["other"] = (
            total
            - sum(s.get(k, 0) for k in ("schedule", "update", "process", "send"))
            - (s["prep"] + s.get("forward", 0) + s.get("sampler", 0) + s.get("samp_prep", 0))
        )
        s["host"] = sum(s.get(k, 0) for k in HOST) + s["other"]
        s["step"] = total
        samples.append(s)
    gc.callbacks.remove(on_gc)
    if prof:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
        print(out.getvalue())
    keys = PARTS + ["other", "host", "step", "gc"]
    return {
        "median_us": {k: 1e6 * statistics.median(s.get(k, 0.0) for s in samples) for k in keys},
        "mean_us": {k: 1e6 * statistics.fmean(s.get(k, 0.0) for s in samples) for k in keys},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--configs", default="greedy,greedy+detok,sampled+detok,rep+detok")
    ap.add_argument("--profile", default=None, help="cProfile this config")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: on a shared CPU, waking a second OpenMP thread "
        "for tiny ops can cost milliseconds)",
    )
    ap.add_argument(
        "--decode-graphs",
        action="store_true",
        help="decode steps through the CUDA-graph input path with the replay stubbed (host "
        "work of a graph step; forward = the stub)",
    )
    ap.add_argument(
        "--clock",
        choices=["thread", "wall"],
        default="thread",
        help="thread: this thread's CPU time (steady on a shared machine; torch's intra-op "
        "threads in forward/sampler are not counted); wall: perf_counter",
    )
    ap.add_argument("--arch", choices=["llama", "qwen2_vl"], default="llama", help="the tiny model's layout")
    ap.add_argument("--image", action="store_true", help="one small image per prompt (--arch qwen2_vl)")
    ap.add_argument(
        "--churn", type=int, default=0, help="requests that end, and new ones that start, at every step (0: none)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.image and args.arch != "qwen2_vl":
        ap.error("--image needs --arch qwen2_vl")
    if args.churn and not 0 < args.churn <= args.batch // 2:
        ap.error("--churn must be between 1 and half of --batch")
    torch.set_num_threads(args.threads)
    if args.clock == "thread":
        Timer.clock = staticmethod(time.thread_time)
    names = args.configs.split(",")
    if args.profile and args.profile not in names:
        names.append(args.profile)
    results = {}
    with tempfile.TemporaryDirectory() as root:
        folder = model_folder(root, args.arch)
        for name in names:
            results[name] = run_config(
                folder,
                name,
                args.batch,
                args.steps,
                args.prompt_len,
                name == args.profile,
                args.decode_graphs,
                args.image,
                args.churn,
            )
    cols = ["schedule", "prep", "samp_prep", "update", "process", "send", "other", "host", "gc", "forward", "sampler"]
    print(
        f"\nbatch {args.batch}, {args.steps} decode steps, median µs per step ({args.clock} clock"
        f"{', decode-graph input path, replay stubbed' if args.decode_graphs else ''}) "
        f"(host = schedule+prep+samp_prep+update+process+send+other; gc = garbage collection, already "
        f"inside those; forward/sampler = device work on CPU)"
    )
    print(f"{'config':18s}" + "".join(f"{c:>10s}" for c in cols))
    for name, r in results.items():
        print(f"{name:18s}" + "".join(f"{r['median_us'][c]:10.0f}" for c in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "steps": args.steps, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
