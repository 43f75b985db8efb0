"""The whole engine on the Triton attention backend reproduces the Yuan2 golden continuations
(on CPU through the Triton interpreter; natively on a GPU): chunked prefill mixed with decodes,
prefix-cache hits and the LF state all go through the Triton kernels' metadata. The runner does not
zero blocks for this backend, so the cache starts as NaN everywhere but the null block: any read of
a slot past a request's length would turn the continuation into garbage."""

from __future__ import annotations

import json

import torch

from pagoda.config import EngineArgs, EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.sampling_params import SamplingParams
from tests.conftest import FIXTURES


def test_yuan_goldens_on_the_triton_backend():
    golden = json.loads((FIXTURES / "yuan2-tiny" / "golden.json").read_text())
    cases = [golden["cases"][2], golden["cases"][3]]  # 7 and 23 prompt tokens
    engine = LLMEngine(
        EngineConfig.create(
            EngineArgs(
                model=str(FIXTURES / "yuan2-tiny"),
                skip_tokenizer_init=True,
                dtype="float32",
                attention_backend="triton",
                max_num_batched_tokens=8,
                block_size=4,
                num_gpu_blocks_override=80,
                device="cuda" if torch.cuda.is_available() else "cpu",
            )
        )
    )
    assert engine.runner.backend.name == "triton" and not engine.runner.backend.needs_zeroed_blocks
    for k, v in engine.runner.kv_caches:
        k[1:].fill_(float("nan"))
        v[1:].fill_(float("nan"))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for round_ in range(2):  # the second round hits the prefix cache
        for i, case in enumerate(cases):
            engine.add_request(f"{round_}-{i}", case["prompt_ids"], params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        for i, case in enumerate(cases):
            assert done[f"{round_}-{i}"] == case["greedy_16"][:8]
    assert engine.scheduler.stats.num_chunked_prefills > 0
    assert engine.block_manager.prefix_hits > 0
