"""The layers with the fused kernels (`dispatch.fused_for`): CPU tensors never take them, the layers
use them and fall back, and whole models through them reproduce the goldens (Yuan2, with the GEMV
too) and the PyTorch path's logits (bf16 Qwen2). On CPU the kernels run under the Triton interpreter
(`conftest.py`).
"""

from __future__ import annotations

import json
import platform
import sys

import pytest
import torch

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.importorskip("triton")

from pagoda.kernels import dispatch, policy
from pagoda.layers.activation import SiluAndMul, silu_and_mul_reference
from pagoda.layers.norm import RMSNorm, rms_norm_reference
from pagoda.layers.rotary import RotaryEmbedding, apply_rotary, apply_rotary_reference
from tests.kernels.fused_checks import DEVICE, FUSED, qkv_views, randn, ulps

# SiLU of ±100 overflows exp under the interpreter (NumPy warns; the result, inf → silu = -0, is right).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def test_cpu_tensors_never_take_the_kernels(monkeypatch):
    for family in dispatch.FUSED_FAMILIES:
        assert dispatch.fused_for(family, torch.zeros(2)) is None
    with pytest.raises(ValueError, match="unknown fused kernel family"):
        dispatch.fused_module("fused_ops")
    dispatch.fused_module.cache_clear()
    monkeypatch.setenv("PAGODA_FUSED_OPS", "0")
    try:
        assert all(dispatch.fused_module(family) is None for family in dispatch.FUSED_FAMILIES)
    finally:
        dispatch.fused_module.cache_clear()


@pytest.fixture
def kernels_everywhere(monkeypatch):
    """Layers use the kernels for every tensor, CPU included (interpreted there)."""
    calls: list[str] = []

    class Spy:
        def __init__(self, family: str) -> None:
            self.kernels = FUSED[family]

        def __getattr__(self, name):
            attr = getattr(self.kernels, name)
            if name in (
                "rms_norm",
                "fused_add_rms_norm",
                "rotary",
                "rotary_store_kv",
                "silu_and_mul",
                "lf_decode_input",
                "lf_decode_output",
            ):

                def wrapped(*args, **kwargs):
                    calls.append(name)
                    return attr(*args, **kwargs)

                return wrapped
            return attr

    monkeypatch.setattr(dispatch, "fused_for", lambda family, x: Spy(family))
    return calls


def test_layers_use_the_kernels_and_fall_back(kernels_everywhere):
    calls = kernels_everywhere
    norm = RMSNorm(24).to(DEVICE)
    x, residual = randn(3, 24, dtype=torch.float32, seed=17), randn(3, 24, dtype=torch.float32, seed=18)
    out, summed = norm(x, residual)
    assert torch.equal(summed, x + residual)
    assert ulps(out, rms_norm_reference(x, norm.weight, norm.eps, residual)[0]) <= 4
    norm(x)
    norm(x.to(torch.bfloat16))  # fp32 weight, bf16 input: PyTorch's promotion
    gate_up = randn(2, 12, dtype=torch.float32, seed=19)
    assert ulps(SiluAndMul()(gate_up), silu_and_mul_reference(gate_up)) <= 4
    q, k = qkv_views(2, 4, 2, 8, torch.float32, seed=20)
    cos_sin = RotaryEmbedding(8, 16, 1e4, None).cos_sin(torch.tensor([3, 9], device=DEVICE))
    assert all(torch.equal(a, b) for a, b in zip(apply_rotary(q, k, cos_sin), apply_rotary_reference(q, k, cos_sin)))
    assert calls == ["fused_add_rms_norm", "rms_norm", "silu_and_mul", "rotary"]


@pytest.mark.parametrize("with_gemv", [False, True])
def test_yuan_goldens_through_the_fused_kernels(kernels_everywhere, monkeypatch, with_gemv):
    """The whole engine with every norm, residual add, RoPE and SiLU-and-mul in the kernels (the LF
    gate's norms and, on decode steps, its state shifts fused into them) reproduces the official
    code's greedy continuations and logits: Yuan2 dense
    (full rotary) and M32 (partial rotary over a bf16-built table, experts). with_gemv: every
    matmul of at most 8 rows in the few-row GEMV kernel as well (the decode steps: LF conv1
    accumulating in place, conv2, q/k, v, o, down, lm_head), and the requests run one at a time, so
    the dense model's decode steps have one row and its MLP takes the GEMV with SiLU-and-mul fused.
    Under the interpreter each GEMV runs as four programs (BLOCK_N a quarter of N; the interpreter's own config,
    two columns a program, made this the suite's slowest test: ~750 launches of up to 256 programs, each
    interpreted one by one): the same kernels, the same K tiles (so the same numerics) and more than one
    program per launch; tests/kernels/test_gemv.py covers the configs themselves."""
    from types import SimpleNamespace

    import triton

    from pagoda.kernels import gemv
    from pagoda.kernels.triton_utils import interpreting

    gemv_calls: list[tuple[str, tuple[int, int]]] = []
    if with_gemv and interpreting():
        product_config = gemv.gemv_config

        def four_programs(m: int, n: int, k: int) -> gemv.GemvConfig:
            config = product_config(m, n, k)
            return gemv.GemvConfig(
                block_n=max(config.block_n, triton.next_power_of_2(n) // 4),
                block_k=config.block_k,
                num_warps=config.num_warps,
            )

        monkeypatch.setattr(gemv, "gemv_config", four_programs)
    if with_gemv:

        def spy(name):
            def call(*args, **kwargs):
                gemv_calls.append((name, tuple(args[1].shape)))
                return getattr(gemv, name)(*args, **kwargs)

            return call

        monkeypatch.setattr(policy, "GEMV_MAX_ROWS", 8)
        monkeypatch.setattr(
            dispatch,
            "gemv_for",
            lambda x: SimpleNamespace(
                supports=gemv.supports, gemv=spy("gemv"), gemv_silu_and_mul=spy("gemv_silu_and_mul")
            ),
        )
    from pagoda.config import EngineArgs, EngineConfig
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.sampling_params import SamplingParams
    from tests.conftest import FIXTURES

    # yuan2-tiny runs the Triton attention backend too (RoPE fused into its KV store); M32 the PyTorch one.
    for name, backend in (("yuan2-tiny", "triton"), ("yuan2-m32-tiny", "torch")):
        golden = json.loads((FIXTURES / name / "golden.json").read_text())
        engine = LLMEngine(
            EngineConfig.create(
                EngineArgs(
                    model=str(FIXTURES / name),
                    skip_tokenizer_init=True,
                    dtype="float32",
                    attention_backend=backend,
                    max_num_batched_tokens=16,
                    block_size=4,
                    num_gpu_blocks_override=80,
                    device=DEVICE,
                )
            )
        )
        runner, captured = engine.runner, {}
        sample = runner._sample

        def capture(request_ids, states, logits, spec=None, sample=sample, captured=captured):
            for rid, row in zip(request_ids, logits):
                captured.setdefault(rid, []).append(row.detach().float().cpu())
            return sample(request_ids, states, logits, spec)

        runner._sample = capture
        cases = golden["cases"][:3]
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        done = {}
        for batch in [list(enumerate(cases))] if not with_gemv else [[pair] for pair in enumerate(cases)]:
            for i, case in batch:
                engine.add_request(str(i), case["prompt_ids"], params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out.outputs[0].token_ids
        for i, case in enumerate(cases):
            assert done[str(i)] == case["greedy_16"][:6], name
            torch.testing.assert_close(captured[str(i)][0], torch.tensor(case["last_logits"]), atol=1e-4, rtol=0)
    assert {
        "fused_add_rms_norm",
        "rms_norm",
        "rotary",
        "rotary_store_kv",
        "silu_and_mul",
        "lf_decode_input",
        "lf_decode_output",
    } <= set(kernels_everywhere)
    if with_gemv:  # the LF convolutions conv1 [H/2, 2H] and conv2 [H, H], the MLP's up/gate [2I, H]
        cfg = json.loads((FIXTURES / "yuan2-tiny" / "config.json").read_text())
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        assert {
            ("gemv", (hidden // 2, 2 * hidden)),
            ("gemv", (hidden, hidden)),
            ("gemv_silu_and_mul", (2 * inter, hidden)),
        } <= set(gemv_calls)


def test_bf16_qwen2_through_the_fused_kernels(tiny_qwen2, monkeypatch):
    """bf16, where every rounding point shows: a tiny Qwen2 (GQA, q/k/v biases, fused qkv views into
    the RoPE kernel) gives the same logits and greedy tokens with the kernels as with PyTorch (exactly
    the same on CPU today). Eager on a GPU too: a CUDA graph captured in one run would replay in the other."""
    from pagoda import LLM, SamplingParams

    llm = LLM(
        model=tiny_qwen2,
        skip_tokenizer_init=True,
        num_gpu_blocks_override=64,
        max_model_len=128,
        dtype="bfloat16",
        device=DEVICE,
        enforce_eager=True,
    )
    runner, captured = llm.engine.runner, []
    sample = runner._sample
    monkeypatch.setattr(
        runner,
        "_sample",
        lambda ids, states, logits, spec=None: (
            captured.append(logits.float().cpu()) or sample(ids, states, logits, spec)
        ),
    )
    prompts = [{"prompt_token_ids": [5, 17, 301, 44, 9, 260, 88, 13, 402]}, {"prompt_token_ids": [400, 12, 97]}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(ops: dict | None) -> tuple[list[list[int]], torch.Tensor]:
        monkeypatch.setattr(dispatch, "fused_for", lambda family, x: ops and ops[family])
        captured.clear()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], torch.cat(captured)

    ref_tokens, ref_logits = run(None)  # the PyTorch code, on any device
    tokens, logits = run(FUSED)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=2e-2, rtol=0)
