"""The LoRA shrink/expand kernels (`pagoda/kernels/lora.py`) against a per-token float64 product and the
PyTorch reference path (`LoRASlots.add_reference`), through the layer's own slots and step mapping; then a
whole engine through them and the step graphs against PEFT's merged models (`tests/models/test_lora.py`).
On CPU the kernels run under the Triton interpreter (`conftest.py`), so shapes stay tiny."""

from __future__ import annotations

import platform
import sys

import numpy as np
import pytest
import torch

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.importorskip("triton")

from pagoda.kernels import dispatch
from pagoda.kernels import lora as lora_kernels
from pagoda.lora.layers import SMALL_STEP_TOKENS, TILE_TOKENS, LoRAPart, LoRASlots, LoRAStep
from tests.models import test_lora as peft_cases

lora_setup = peft_cases.lora_setup  # the fixture: adapters made with peft, and PEFT's merged outputs

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def _layer(sizes, in_features, max_loras, max_rank, dtype, max_tokens=512, seed=0):
    """Slots of a fused layer with output parts `sizes`, each slot holding an adapter of a different rank."""
    parts, offset = [], 0
    for i, size in enumerate(sizes):
        parts.append(LoRAPart(f"p{i}" if len(sizes) > 1 else None, offset, size))
        offset += size
    step = LoRAStep(max_loras, max_tokens, DEVICE)
    slots = LoRASlots((0, in_features, in_features), parts, max_loras, max_rank, dtype, DEVICE, step)
    g = torch.Generator().manual_seed(seed)
    for slot in range(max_loras):
        rank = max(1, max_rank >> slot)  # ranks below the slot width leave zero rows and columns
        weights = {
            p.name: (torch.randn(rank, in_features, generator=g) / 4, torch.randn(p.size, rank, generator=g) / 4)
            for p in parts
            if slot != 1 or p.name != "p1"  # slot 1 leaves a part out: it must add nothing there
        }
        slots.set(slot, {k: (a.to(dtype), b.to(dtype)) for k, (a, b) in weights.items()})
    return slots


def _naive(slots: LoRASlots, x, y, token_slots):
    """y + each token's (x·Aᵀ)·Bᵀ in float64, one token at a time."""
    out = y.double().clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        for i, p in enumerate(slots.parts):
            a = slots.a[i, slot].double().cpu()
            b = slots.b[slot, p.offset : p.offset + p.size].double().cpu()
            out[t, p.offset : p.offset + p.size] += (x[t].double() @ a.t()) @ b.t()
    return out


def _run(slots, x, y, token_slots):
    slots.step.write(np.asarray(token_slots, dtype=np.int64))
    meta, order_at, tile = slots.step.tiling(x.shape[0])
    return lora_kernels.add_lora(x, y.clone(), slots.a, slots.b, slots.bounds, meta, order_at, tile)


CASES = [
    # (output parts, in, tokens, slots, rank)
    ([40, 16, 16], 48, 7, 3, 8),  # decode-sized: one token block per slot, q/k/v parts of different widths
    ([24, 24], 40, 150, 3, 16),  # prefill-sized: 64-token blocks, gate/up
    ([70], 33, 19, 2, 4),  # one part wider than a column block, an input that is no multiple of the K block
    ([20, 12], 24, 150, 1, 8),  # one slot's ~75 tokens: five small tiles, the last partial
    ([24, 8], 24, 300, 2, 8),  # past SMALL_STEP_TOKENS: 64-token tiles
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sizes,in_features,tokens,max_loras,rank", CASES)
def test_kernels_match_the_per_token_product(sizes, in_features, tokens, max_loras, rank, dtype):
    slots = _layer(sizes, in_features, max_loras, rank, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, in_features, generator=g).to(dtype).to(DEVICE)
    y = torch.randn(tokens, sum(sizes), generator=g).to(dtype).to(DEVICE)
    token_slots = torch.randint(-1, max_loras, (tokens,), generator=g).numpy()
    token_slots[0], token_slots[-1] = -1, max_loras - 1
    out = _run(slots, x, y, token_slots)
    want = _naive(slots, x.cpu(), y.cpu(), token_slots)
    base = token_slots < 0
    assert torch.equal(out.cpu()[base], y.cpu()[base])  # the base model's tokens are left alone, bit for bit
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu().double(), want, rtol=1e-5, atol=1e-5)
    else:  # h rounded to bf16 between the two products, the sum rounded once
        torch.testing.assert_close(out.cpu().double(), want, rtol=2e-2, atol=3e-2)
    ref = y.clone()
    slots.add_reference(x, ref)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 3e-2}
    torch.testing.assert_close(out, ref, **tol)


def _stacked(sizes, in_features, max_loras, rank, dtype, bias):
    """`_layer`'s slots on a Linear of random weight (and bias), their A stacked under it; the weight's values."""
    from pagoda.layers.linear import Linear

    slots = _layer(sizes, in_features, max_loras, rank, dtype)
    g = torch.Generator().manual_seed(8)
    layer = Linear(in_features, sum(sizes), bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(sum(sizes), in_features, generator=g) / 4)
        if bias:
            layer.bias.copy_(torch.randn(sum(sizes), generator=g))
    layer.to(dtype=dtype, device=DEVICE)
    weight, bias_values = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone()
    slots.stack_under(layer.weight, layer.bias)
    layer.lora = slots
    return layer, weight, bias_values


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sizes,in_features,tokens,max_loras,rank", CASES)
def test_a_layer_with_its_adapters_stacked_under_its_weight(sizes, in_features, tokens, max_loras, rank, dtype, bias,
                                                            monkeypatch):  # fmt: skip
    """`LoRASlots.stack_under`: the layer's weight and bias keep their values as views of W_ext; an adapter set into
    a slot afterwards lands in W_ext's rows; the layer's forward (the stacked matmul and the expand alone up to
    `policy.LORA_STACKED_MAX_TOKENS` tokens, the shrink from the A view past it) equals the per-token product."""
    monkeypatch.setattr(dispatch, "lora_for", lambda x: lora_kernels)
    layer, weight, bias_values = _stacked(sizes, in_features, max_loras, rank, dtype, bias)
    slots = layer.lora
    stacked, stacked_bias = slots.stacked
    assert torch.equal(layer.weight, weight) and layer.weight.data_ptr() == stacked.data_ptr()
    assert not bias or (torch.equal(layer.bias, bias_values) and layer.bias.data_ptr() == stacked_bias.data_ptr())
    g = torch.Generator().manual_seed(9)
    new = {p.name: (torch.randn(rank, in_features, generator=g) / 4, torch.randn(p.size, rank, generator=g) / 4)
           for p in slots.parts}  # fmt: skip
    slots.set(0, {k: (a.to(dtype), b.to(dtype)) for k, (a, b) in new.items()})
    assert torch.equal(
        stacked[sum(sizes) :].view(slots.a.shape)[0, 0, :rank].cpu(), new[slots.parts[0].name][0].to(dtype)
    )
    x = torch.randn(tokens, in_features, generator=g).to(dtype).to(DEVICE)
    token_slots = torch.randint(-1, max_loras, (tokens,), generator=g).numpy()
    token_slots[0], token_slots[-1] = -1, 0
    slots.step.write(token_slots)
    out = layer(x)
    base = x.cpu().double() @ weight.cpu().double().t() + (0 if bias_values is None else bias_values.cpu().double())
    want = _naive(slots, x.cpu(), base, token_slots)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    torch.testing.assert_close(out.cpu().double(), want, **tol)


@pytest.mark.parametrize(
    "tile,tiles",
    [(16, {"block_n": 256, "block_k": 128}), (16, {"splits": 16, "num_warps": 2}), (32, {"block_n": 128, "splits": 3})],
    ids=str,
)
def test_other_tile_sizes_give_the_same_products(tile, tiles):
    """The launcher's tile sizes (tokens per tile, output columns per expand program, the shrink's K block and
    split) change only how the work is cut: every case still equals the per-token product."""
    for sizes, in_features, tokens, max_loras, rank in CASES:
        slots = _layer(sizes, in_features, max_loras, rank, torch.float32)
        slots.step = LoRAStep(max_loras, 512, DEVICE, tile_sizes=(tile, tile))
        g = torch.Generator().manual_seed(4)
        x = torch.randn(tokens, in_features, generator=g).to(DEVICE)
        y = torch.randn(tokens, sum(sizes), generator=g).to(DEVICE)
        token_slots = torch.randint(-1, max_loras, (tokens,), generator=g).numpy()
        slots.step.write(token_slots)
        meta, order_at, _ = slots.step.tiling(tokens)
        out = lora_kernels.add_lora(x, y.clone(), slots.a, slots.b, slots.bounds, meta, order_at, tile, **tiles)
        want = _naive(slots, x.cpu(), y.cpu(), token_slots)
        torch.testing.assert_close(out.cpu().double(), want, rtol=1e-5, atol=1e-5)


def test_split_input_partials_sum_to_the_whole(monkeypatch):
    """Decode-sized steps split the input dimension over programs; the last split may be empty."""
    monkeypatch.setattr(lora_kernels, "split_k", lambda *args: 3)
    slots = _layer([20, 12], 200, 2, 8, torch.float32)  # 200 features → splits of 128: [0, 128), [128, 200), ∅
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(5, 200, generator=g).to(DEVICE), torch.randn(5, 32, generator=g).to(DEVICE)
    token_slots = np.array([1, 0, -1, 1, 0])
    out = _run(slots, x, y, token_slots)
    torch.testing.assert_close(out.cpu().double(), _naive(slots, x.cpu(), y.cpu(), token_slots), rtol=1e-5, atol=1e-5)


def test_one_launch_serves_any_mapping_written_into_the_step(monkeypatch):
    """What a CUDA graph relies on: the same layer, call after call, reads each step's mapping from `meta`
    (slots unused, all tokens on the base model, then every token adapted), through `LoRASlots.apply`."""
    monkeypatch.setattr(dispatch, "lora_for", lambda x: lora_kernels)
    slots = _layer([16, 8, 8], 24, 4, 8, torch.float32)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(9, 24, generator=g).to(DEVICE), torch.randn(9, 32, generator=g).to(DEVICE)
    for token_slots in ([3, 3, -1, 0, 0, 0, 3, -1, 0], [-1] * 9, [2, 1, 0, 3, 2, 1, 0, 3, 2]):
        token_slots = np.asarray(token_slots)
        slots.step.write(token_slots)
        out = slots.apply(x, y.clone)
        want = _naive(slots, x.cpu(), y.cpu(), token_slots)
        torch.testing.assert_close(out.cpu().double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not CUDA, reason="streams are CUDA's")
@pytest.mark.parametrize("late", ["shrink", "input"])
def test_the_side_stream_shrink_waits_for_its_input_and_the_expand_for_it(late, monkeypatch):
    """`LoRAStep.side_stream` (PAGODA_LORA_SIDE_STREAM): the shrink runs on another stream than the layer's
    matmul and the expand. Each end is made late in turn by sleeping on its stream: the shrink (the expand must
    wait for its partial sums), then the copy that writes x on the step's stream (the shrink must wait for x,
    which holds zeros until then). Every round scales x differently, so a missing wait reads zeros or the last
    round's sums and the result differs from the same layer's with the switch off."""
    slots = _layer([40, 16, 16], 256, 4, 16, torch.bfloat16)
    g = torch.Generator().manual_seed(6)
    x0 = torch.randn(24, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    y = torch.randn(24, 72, generator=g).to(torch.bfloat16).to(DEVICE)
    slots.step.write(torch.randint(-1, 4, (24,), generator=g).numpy())
    scales = [1.0, -2.0, 0.5]
    slots.step.side_stream = False
    wants = [slots.apply(x0 * s, y.clone) for s in scales]
    slots.step.side_stream = True
    shrink = lora_kernels.shrink
    if late == "shrink":
        monkeypatch.setattr(lora_kernels, "shrink", lambda *a, **k: (torch.cuda._sleep(50_000_000), shrink(*a, **k))[1])
    for scale, want in zip(scales, wants):
        x = torch.zeros_like(x0)
        torch.cuda.synchronize()
        if late == "input":
            torch.cuda._sleep(50_000_000)  # on the step's stream, before x is written
        x.copy_(x0).mul_(scale)
        torch.testing.assert_close(slots.apply(x, y.clone), want, rtol=0, atol=0)


def test_which_layers_stack_their_adapters(monkeypatch):
    """`manager._stacks`: a plain unquantized layer on a device with the kernels, A in its dtype and at most
    `policy.LORA_STACKED_MAX_EXTRA` of its rows; not with the switch off, a quantized or overridden layer, another
    dtype, too many A rows, or a row-parallel layer whose output the ranks all-reduce."""
    from types import SimpleNamespace

    from pagoda.kernels import policy
    from pagoda.layers.linear import Linear, RowParallelLinear
    from pagoda.lora import manager

    def slots_for(layer, max_loras=2, rank=4, dtype=torch.float32):
        parts = [LoRAPart(None, 0, layer.output_size)]
        step = LoRAStep(max_loras, 16, DEVICE)
        return LoRASlots((0, layer.input_size, layer.input_size), parts, max_loras, rank, dtype, DEVICE, step)

    def plain(out=64, cls=Linear):
        return cls(32, out).to(DEVICE)

    monkeypatch.setattr(dispatch, "lora_for", lambda x: lora_kernels)
    assert manager._stacks(plain(), slots_for(plain()))  # 8 A rows under 64: an eighth
    assert not manager._stacks(plain(out=24), slots_for(plain(out=24)))  # 8 under 24: a third
    monkeypatch.setattr(policy, "LORA_STACKED_MAX_EXTRA", 0.5)
    assert manager._stacks(plain(out=24), slots_for(plain(out=24)))
    assert not manager._stacks(plain(), slots_for(plain(), dtype=torch.float64))
    quantized = plain()
    quantized.quant = SimpleNamespace()
    assert not manager._stacks(quantized, slots_for(quantized))
    overridden = type("Overridden", (Linear,), {"forward": lambda self, x: x})(32, 64).to(DEVICE)
    assert not manager._stacks(overridden, slots_for(overridden))
    row = plain(cls=RowParallelLinear)
    assert manager._stacks(row, slots_for(row))
    row.tp_size = 2
    assert not manager._stacks(row, slots_for(row))
    monkeypatch.setenv("PAGODA_LORA_STACKED", "0")
    assert not manager._stacks(plain(), slots_for(plain()))
    monkeypatch.setattr(dispatch, "lora_for", lambda x: None)
    monkeypatch.delenv("PAGODA_LORA_STACKED")
    assert not manager._stacks(plain(), slots_for(plain()))


@pytest.mark.parametrize("stacked", [False, True], ids=["shrink-launch", "stacked"])
def test_adapters_through_the_kernels_and_step_graphs_equal_peft_merged(lora_setup, stacked, monkeypatch):
    """The same mixed batch through the Triton shrink/expand kernels inside the graph runner's static buffers
    (on the CPU: the interpreter and the graph path without capture; on a GPU: captured CUDA graphs), chunked
    prefill mixing adapters' prompts with decodes. Every step must replay a bucket. Once with every layer's
    shrink a launch of its own, once with every decoder layer's A stacked under its weight (`stack_under`)."""
    from pagoda.kernels import policy
    from pagoda.worker.graph_runner import DECODE, MIXED

    base, adapters, refs = lora_setup
    if not CUDA:
        monkeypatch.setattr(dispatch, "lora_for", lambda x: lora_kernels)
    if stacked:  # the tiny model's layers are narrower than 4x their adapters' A rows
        monkeypatch.setattr(policy, "LORA_STACKED_MAX_EXTRA", 1e9)
    else:
        monkeypatch.setenv("PAGODA_LORA_STACKED", "0")
    requests = peft_cases._requests(adapters)
    llm = peft_cases._llm(base, max_loras=3, attention_backend="triton", max_num_batched_tokens=16, max_num_seqs=8)
    runner = llm.llm_engine.runner
    assert [s.stacked is not None for s in runner.lora.layers.values()] == [stacked] * len(runner.lora.layers)
    if not CUDA:
        runner.enable_cuda_graphs(capture=False)
    used: list[str] = []
    run = runner.graphs.run
    runner.graphs.run = lambda inputs, positions, mm=None: (
        used.append(runner.graphs.bucket_for(inputs)[0]) or run(inputs, positions, mm)
    )
    names = [*peft_cases.ADAPTERS, None]
    prompts = [p for _ in names for p in peft_cases.PROMPTS]
    loras = [requests[n] if n else None for n in names for _ in peft_cases.PROMPTS]
    prompts = [{"prompt_token_ids": p} for p in prompts]
    outputs = llm.generate(prompts, peft_cases._params(), use_tqdm=False, lora_request=loras)
    for i, name in enumerate(names):
        n = len(peft_cases.PROMPTS)
        peft_cases._check(outputs[i * n : (i + 1) * n], refs[name])
    assert MIXED in used and DECODE in used


def test_a_small_step_in_a_larger_bucket_reads_the_large_tiling():
    """A graph bucket past SMALL_STEP_TOKENS may replay a step of fewer tokens: both tilings are written for it,
    and the launch over the bucket's rows reads the large one (the rows past the step are the base model's)."""
    slots = _layer([16, 8], 24, 3, 8, torch.float32)
    g = torch.Generator().manual_seed(5)
    token_slots = np.array([2, 0, -1, 2, 1, 1, 0])
    slots.step.write(token_slots)
    bucket = SMALL_STEP_TOKENS + 8
    x, y = torch.randn(bucket, 24, generator=g).to(DEVICE), torch.randn(bucket, 24, generator=g).to(DEVICE)
    meta, order_at, tile = slots.step.tiling(bucket)
    assert tile == TILE_TOKENS
    out = lora_kernels.add_lora(x, y.clone(), slots.a, slots.b, slots.bounds, meta, order_at, tile)
    padded = np.concatenate((token_slots, np.full(bucket - len(token_slots), -1)))
    torch.testing.assert_close(out.cpu().double(), _naive(slots, x.cpu(), y.cpu(), padded), rtol=1e-5, atol=1e-5)


def test_launcher_refuses_operands_that_do_not_fit():
    slots = _layer([8, 8], 16, 2, 4, torch.float32)
    x, y = torch.zeros(3, 16, device=DEVICE), torch.zeros(3, 16, device=DEVICE)
    meta, order_at, tile = slots.step.tiling(3)
    with pytest.raises(ValueError, match="do not fit"):
        lora_kernels.add_lora(x[:, :8], y, slots.a, slots.b, slots.bounds, meta, order_at, tile)
    with pytest.raises(ValueError, match="int32"):
        lora_kernels.add_lora(x, y, slots.a, slots.b, slots.bounds, meta.long(), order_at, tile)


def test_both_launches_take_pdl_by_their_own_row_bound(monkeypatch):
    """The shrink and the expand ask for PDL with `policy.LORA_PDL_MAX_ROWS`, not the step's rule; on CUDA a
    launch of up to that many tokens gets it even where the step's rule (`dispatch.pdl_allowed`) says no, and a
    larger one does not."""
    from types import SimpleNamespace

    from pagoda.kernels import pdl, policy

    asked = []

    def spy(t, max_rows=None):
        asked.append(max_rows)
        return {"PDL": False}

    monkeypatch.setattr(pdl, "launch_args", spy)
    sizes, in_features, tokens, max_loras, rank = CASES[0]
    slots = _layer(sizes, in_features, max_loras, rank, torch.float32)
    x = torch.randn(tokens, in_features).to(DEVICE)
    _run(slots, x, torch.zeros(tokens, sum(sizes)).to(DEVICE), np.arange(tokens) % max_loras)
    assert asked == [policy.LORA_PDL_MAX_ROWS] * 2

    monkeypatch.setattr(pdl, "_switched_on", lambda: True)
    monkeypatch.setattr(pdl, "_device_has_pdl", lambda index: True)

    def on_cuda(rows):
        return SimpleNamespace(is_cuda=True, shape=(rows, 8), device=SimpleNamespace(index=0))

    with dispatch.pdl_allowed(False):
        assert not pdl.enabled(on_cuda(1))
        assert pdl.enabled(on_cuda(256), max_rows=256)
        assert not pdl.enabled(on_cuda(257), max_rows=256)
    with dispatch.pdl_allowed(True):
        assert pdl.enabled(on_cuda(1)) and not pdl.enabled(on_cuda(300), max_rows=256)
    assert not pdl.enabled(SimpleNamespace(is_cuda=False, shape=(1, 8)), max_rows=256)
