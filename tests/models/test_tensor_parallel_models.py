"""Tensor-parallel models (2 and 4 ranks over gloo, CPU, float32) against the same model at TP = 1.

Each rank builds the model from a saved checkpoint folder through the real loader (so each rank reads
and loads only its shards), then runs the same steps through the paged KV cache: a prompt prefilled
in two chunks (for Yuan2 the LF state carries over from one chunk to the next), a second prompt
packed beside the second chunk, then greedy decode steps of both. Every rank's full logits of every
token must match the TP = 1 run, and their greedy tokens must be the same.

Covered: Llama with 2 KV heads (split over 2 ranks, replicated over 4), Qwen2 with one KV head
(replicated) and q/k/v biases, Yuan2 dense and M32 (the fixtures), and a tiny Qwen2-VL with an image
(replicated vision tower, M-RoPE), and the Llama as AWQ and act-order GPTQ int4 checkpoints. A second
test counts what a rank reads from the safetensors files.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks.quantization_accuracy import write_int4_checkpoint
from pagoda.config.quantization import resolve_quantization
from pagoda.distributed import parallel_state
from pagoda.layers.attention import AttentionBatch, StepAttention
from pagoda.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagoda.layers.sequence_state import SequenceStateBatch
from pagoda.layers.torch_attention import TorchAttentionBackend
from pagoda.models.loader import load_model
from pagoda.models.source import resolve_model_source
from tests.conftest import FIXTURES, QWEN2VL_PATCH_WIDTH, TINY_CONFIGS, build_tiny_model, tiny_qwen2vl_config

BLOCK_SIZE = 4
BLOCKS_PER_SEQ = 16  # room for 64 tokens per sequence
DECODE_STEPS = 3
LOGIT_ATOL = 1e-4

# A small vocabulary (the real one has 151,936 rows): the special ids are whatever config.json says.
QWEN2VL_VOCAB = 1024
IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = 1000, 1001, 1002, 1003
IMAGE_GRID = (1, 4, 8)  # 8 placeholder tokens after the 2x2 merge


# ---------------------------------------------------------------- checkpoints


def _qwen2vl_checkpoint(folder: str) -> str:
    import transformers

    config = tiny_qwen2vl_config(
        QWEN2VL_VOCAB, depth=1, special_ids=(IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END), tie_word_embeddings=False
    )
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # random init leaves logits flat; sharpen them so greedy is not a coin toss
        model.lm_head.weight.mul_(30)
    model.save_pretrained(folder)
    return folder


def _llama_checkpoint(folder: str, **overrides: Any) -> str:
    """The tiny Llama of conftest with config fields changed (rebuilt with transformers)."""
    import transformers

    torch.manual_seed(1234)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY_CONFIGS["llama"], **overrides})).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-checkpoints")
    return {
        "llama": build_tiny_model("llama", str(root / "llama")),  # 4 heads over 2 KV heads, tied head
        # 8 query heads over 4 KV heads (split over 2 and over 4 ranks), untied head
        "llama_untied": _llama_checkpoint(
            str(root / "llama-untied"), num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False
        ),
        "qwen2": build_tiny_model("qwen2", str(root / "qwen2"), max_shard_size="100KB"),  # 1 KV head, biases
        "yuan2": str(FIXTURES / "yuan2-tiny"),
        "yuan2_m32": str(FIXTURES / "yuan2-m32-tiny"),
        "qwen2_vl": _qwen2vl_checkpoint(str(root / "qwen2-vl")),
        # int4 checkpoints of the Llama: packed columns split by whole int32s, group scales with their
        # rows (AWQ, groups of 32), or whole on every rank (GPTQ act-order)
        "llama_awq": write_int4_checkpoint(str(root / "llama"), "awq", 32, str(root / "llama-awq")),
        "llama_gptq": write_int4_checkpoint(str(root / "llama"), "gptq", 32, str(root / "llama-gptq")),
    }


# ---------------------------------------------------------------- one model, some steps


def _image() -> tuple[np.ndarray, tuple[int, int, int]]:
    rng = np.random.default_rng(7)
    t, h, w = IMAGE_GRID
    return rng.standard_normal((t * h * w, QWEN2VL_PATCH_WIDTH)).astype(np.float32), IMAGE_GRID


def _prompts(kind: str) -> tuple[list[list[int]], Any]:
    """Two prompts, and for Qwen2-VL the first one's multimodal inputs (one image)."""
    a = [5, 17, 301, 44, 9, 260, 88, 13, 402, 77, 3, 19, 250, 111, 6, 7, 8, 200, 31]
    b = [400, 12, 97, 501, 2, 33, 45]
    if kind != "qwen2_vl":
        return [a, b], None
    from pagoda.frontend.multimodal.prompt import PlaceholderIds, expand_prompt

    pixels, grid = _image()

    class Visual:
        pixel_values = pixels
        grid_thw = grid
        num_tokens = grid[0] * grid[1] * grid[2] // 4

    ids = [300, 301, VISION_START, IMAGE_PAD, VISION_END, 302, 303, 304, 305]
    expanded, mm = expand_prompt(ids, [("image", Visual())], PlaceholderIds(IMAGE_PAD, VIDEO_PAD), "test")
    return [expanded, b], mm


class Harness:
    """A model from `folder` with its own KV cache (and LF state slots), stepped like the runner does."""

    def __init__(self, folder: str, kind: str):
        source = resolve_model_source(folder)
        quantization = resolve_quantization(None, source.location, source.kind, source.hf_config)
        self.model = load_model(source, 256, torch.float32, "cpu", quantization=quantization)
        self.backend = TorchAttentionBackend()
        for layer in self.model.attention_layers():
            shape = (1 + 2 * BLOCKS_PER_SEQ, BLOCK_SIZE, layer.num_kv_heads, layer.head_dim)
            layer.bind_kv_cache(torch.zeros(shape), torch.zeros(shape))
        self.slots = None
        stateful = self.model.sequence_state_layers()
        if stateful:
            from pagoda.worker.state_slots import StateSlotPool

            self.pool = StateSlotPool(stateful, 4, torch.float32, torch.device("cpu"))
            self.slots = [self.pool.acquire(), self.pool.acquire()]
        self.prompts, self.mm = _prompts(kind)
        self.encoded = None
        if self.mm is not None:
            item = self.mm.items[0]
            with torch.inference_mode():
                self.encoded = self.model.encode(torch.from_numpy(item.pixel_values), [item.grid_thw])

    def step(self, rows: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """rows: (sequence 0 or 1, its new tokens, position of the first) → logits [T, V] of every token."""
        ids, positions, slot_mapping, starts = [], [], [], [0]
        for seq, tokens, first in rows:
            pos = list(range(first, first + len(tokens)))
            ids += tokens
            positions += pos
            slot_mapping += [(1 + seq * BLOCKS_PER_SEQ + p // BLOCK_SIZE) * BLOCK_SIZE + p % BLOCK_SIZE for p in pos]
            starts.append(starts[-1] + len(tokens))
        seq_lens = [first + len(tokens) for _, tokens, first in rows]
        tables = torch.tensor([[1 + seq * BLOCKS_PER_SEQ + b for b in range(BLOCKS_PER_SEQ)] for seq, _, _ in rows])
        batch = AttentionBatch(
            [len(t) for _, t, _ in rows],
            seq_lens,
            torch.tensor(starts),
            torch.tensor(seq_lens),
            tables,
            torch.tensor(slot_mapping),
            BLOCK_SIZE,
        )
        step = StepAttention(self.backend, self.backend.prepare(batch))
        if self.slots is not None:
            step.state = SequenceStateBatch.build(
                [self.slots[seq] for seq, _, _ in rows],
                np.array(starts),
                np.array(positions),
                np.array(slot_mapping),
                BLOCK_SIZE,
                False,
                torch.device("cpu"),
            )
        if self.mm is not None:
            step.mrope_positions, step.mm_embeds = self._multimodal(rows, starts)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), step)
            return self.model.compute_logits(hidden)

    def _multimodal(self, rows, starts) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """M-RoPE positions of the step (sequence 0 has the image) and its placeholder rows."""
        parts, index, embeds = [], [], []
        item = self.mm.items[0]
        for (seq, tokens, first), start in zip(rows, starts):
            end = first + len(tokens)
            table, delta = (self.mm.mrope_positions, self.mm.mrope_delta) if seq == 0 else (None, 0)
            known = min(end, table.shape[1]) if table is not None else first
            if known > first:
                parts.append(table[:, first:known])
            if end > known:
                parts.append(np.broadcast_to(np.arange(max(first, known), end) + delta, (3, end - max(first, known))))
            if seq == 0:
                for p in range(max(first, item.offset), min(end, item.end)):
                    index.append(start + p - first)
                    embeds.append(self.encoded[p - item.offset])
        mrope = torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=1)))
        mm = (torch.tensor(index), torch.stack(embeds)) if index else None
        return mrope, mm

    def run(self) -> dict[str, Any]:
        """Chunked prefill of prompt 0 with prompt 1 packed beside its second chunk, then greedy decode."""
        a, b = self.prompts
        cut = len(a) // 2 + 1
        logits = [self.step([(0, a[:cut], 0)]), self.step([(0, a[cut:], cut), (1, b, 0)])]
        lens = [len(a), len(b)]
        next_tokens = [int(logits[-1][len(a) - cut - 1].argmax()), int(logits[-1][-1].argmax())]
        greedy = [list(next_tokens)]
        for _ in range(DECODE_STEPS):
            logits.append(self.step([(0, [next_tokens[0]], lens[0]), (1, [next_tokens[1]], lens[1])]))
            lens = [n + 1 for n in lens]
            next_tokens = [int(row.argmax()) for row in logits[-1]]
            greedy.append(list(next_tokens))
        out: dict[str, Any] = {"logits": [x.clone() for x in logits], "greedy": greedy}
        # What this rank holds: its heads per attention layer and its embedding rows.
        out["heads"] = [(layer.num_heads, layer.num_kv_heads) for layer in self.model.attention_layers()]
        out["vocab_rows"] = self.model.model.embed_tokens.weight.shape[0]
        if self.encoded is not None:
            out["encoded"] = self.encoded.clone()
        return out


def _biased_mlp() -> torch.Tensor:
    """Column- then row-parallel layers with biases (no model here has a row-parallel bias: it must
    be added once, after the sum over the ranks), loaded through their weight loaders."""
    g = torch.Generator().manual_seed(3)
    col, row = ColumnParallelLinear(16, 32, bias=True), RowParallelLinear(32, 16, bias=True)
    for layer in (col, row):
        for param in (layer.weight, layer.bias):
            full = (32, 16) if layer is col else (16, 32)
            layer.weight_loader(param, torch.randn(full if param.dim() == 2 else full[:1], generator=g))
    with torch.inference_mode():
        return row(torch.relu(col(torch.randn(5, 16, generator=g))))


def run_models(checkpoints: dict[str, str]) -> dict[str, Any]:
    results: dict[str, Any] = {kind: Harness(folder, kind).run() for kind, folder in checkpoints.items()}
    results["biased_mlp"] = _biased_mlp()
    return results


# ---------------------------------------------------------------- the ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, checkpoints: dict[str, str], out_dir: str) -> None:
    torch.set_num_threads(1)  # several ranks share the machine's cores
    parallel_state.init_tensor_parallel(rank, world, f"tcp://127.0.0.1:{port}", "cpu", 120)
    try:
        torch.save(run_models(checkpoints), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        parallel_state.destroy_tensor_parallel()


def _run_ranks(world: int, checkpoints: dict[str, str], out_dir: Path) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    mp.start_processes(
        _rank_main, args=(world, _free_port(), checkpoints, str(out_dir)), nprocs=world, start_method="spawn"
    )
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


def _assert_same_as_tp1(got: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    assert got["greedy"] == ref["greedy"], f"{what}: greedy tokens differ"
    for step, (g, r) in enumerate(zip(got["logits"], ref["logits"], strict=True)):
        assert g.shape == r.shape, f"{what} step {step}: logits {tuple(g.shape)} vs {tuple(r.shape)}"
        torch.testing.assert_close(g, r, atol=LOGIT_ATOL, rtol=0, msg=lambda m, s=step: f"{what} step {s}: {m}")
    if "encoded" in ref:
        torch.testing.assert_close(got["encoded"], ref["encoded"], atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def tp1(checkpoints) -> dict[str, Any]:
    parallel_state.destroy_tensor_parallel()  # world size 1: the single-device models
    return run_models(checkpoints)


@pytest.mark.parametrize(
    ("world", "kinds"),
    [
        (2, ("llama", "llama_untied", "qwen2", "yuan2", "yuan2_m32", "qwen2_vl", "llama_awq", "llama_gptq")),
        # 4 ranks: Llama's 2 KV heads each replicated over 2 ranks, llama_untied's 4 split one per
        # rank, Qwen2's one KV head on all four; Yuan2's 4 heads one per rank.
        (4, ("llama", "llama_untied", "qwen2", "yuan2", "yuan2_m32")),
    ],
)
def test_tensor_parallel_logits_match_tp1(world, kinds, checkpoints, tp1, tmp_path):
    ranks = _run_ranks(world, {k: checkpoints[k] for k in kinds}, tmp_path)
    for rank, results in enumerate(ranks):
        torch.testing.assert_close(results["biased_mlp"], tp1["biased_mlp"], atol=1e-5, rtol=0)
        for kind in kinds:
            got, ref = results[kind], tp1[kind]
            # Sharded for real: a 1/world share of the query heads and of the vocabulary; KV heads
            # split, or one (replicated) where there are fewer than ranks.
            assert got["vocab_rows"] * world == ref["vocab_rows"]
            for (heads, kv_heads), (ref_heads, ref_kv_heads) in zip(got["heads"], ref["heads"], strict=True):
                assert heads * world == ref_heads
                assert kv_heads == max(1, ref_kv_heads // world)
            _assert_same_as_tp1(got, ref, f"{kind} tp={world} rank {rank}")


# ---------------------------------------------------------------- what a rank reads


class _CountingSlice:
    def __init__(self, inner, counter):
        self._inner, self._counter = inner, counter

    def get_shape(self):
        return self._inner.get_shape()

    def get_dtype(self):
        return self._inner.get_dtype()

    def __getitem__(self, index):
        tensor = self._inner[index]
        self._counter.append(tensor.numel())
        return tensor


class _CountingFile:
    """safe_open's handle, counting the elements of every tensor read through it."""

    def __init__(self, inner, counter):
        self._inner, self._counter = inner, counter

    def __enter__(self):
        self._inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)

    def keys(self):
        return self._inner.keys()

    def get_tensor(self, name):
        tensor = self._inner.get_tensor(name)
        self._counter.append(tensor.numel())
        return tensor

    def get_slice(self, name):
        return _CountingSlice(self._inner.get_slice(name), self._counter)


@pytest.mark.parametrize("kind", ["qwen2", "yuan2_m32"])
def test_a_rank_reads_only_its_shards(kind, checkpoints, monkeypatch):
    """Each element read from the checkpoint is one the rank holds, and each is read once: a rank of 2
    reads half the sharded weights plus the replicated ones, never a whole sharded tensor."""
    import safetensors

    real_open = safetensors.safe_open
    counter: list[int] = []
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: _CountingFile(real_open(*a, **k), counter))
    folder = checkpoints[kind]
    source = resolve_model_source(folder)
    with open(os.path.join(folder, "config.json")) as f:
        tied = json.load(f).get("tie_word_embeddings", True)

    def held(model) -> int:
        return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())

    whole = load_model(source, 256, torch.float32, "cpu")
    assert sum(counter) == held(whole)
    total, counter[:] = sum(counter), []
    try:
        for rank in range(2):
            parallel_state.assume_rank(rank, 2)  # loading runs no collective
            model = load_model(source, 256, torch.float32, "cpu")
            assert sum(counter) == held(model), f"rank {rank} read elements it does not hold"
            assert sum(counter) < 0.7 * total
            # The largest sharded tensor (the embedding) arrives as half its rows.
            embed = model.model.embed_tokens.weight
            assert embed.shape[0] * 2 == whole.model.embed_tokens.weight.shape[0]
            torch.testing.assert_close(embed, whole.model.embed_tokens.weight.chunk(2)[rank], atol=0, rtol=0)
            if not tied:
                head = model.lm_head.weight
                torch.testing.assert_close(head, whole.lm_head.weight.chunk(2)[rank], atol=0, rtol=0)
            counter[:] = []
    finally:
        parallel_state.destroy_tensor_parallel()
