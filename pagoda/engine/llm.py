"""Offline inference shaped like vLLM's `LLM`: `LLM(model=...).generate(prompts, params)`.

It *uses* an `LLMEngine` (it is not one): queue every prompt, step until all are finished,
return the outputs in prompt order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Union

from pagoda.config import EngineArgs, EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.outputs import RequestOutput
from pagoda.errors import InvalidRequest
from pagoda.frontend.chat_template import render_chat
from pagoda.sampling_params import SamplingParams

PromptType = Union[str, dict[str, Any], list[int]]
Conversation = list[dict[str, Any]]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        gpu_memory_utilization: float = 0.9,
        num_gpu_blocks_override: int | None = None,
        swap_space: float = 4,
        device: str = "auto",
        seed: int = 0,
        trust_remote_code: bool = False,
        skip_tokenizer_init: bool = False,
        cpu_kv_cache_space_gib: float = 4.0,
        load_format: str = "auto",
    ):
        self.config = EngineConfig.create(EngineArgs(
            model=model, tokenizer=tokenizer, dtype=dtype, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
            enable_prefix_caching=enable_prefix_caching, gpu_memory_utilization=gpu_memory_utilization,
            num_gpu_blocks_override=num_gpu_blocks_override, swap_space=swap_space,
            cpu_kv_cache_space_gib=cpu_kv_cache_space_gib, device=device, seed=seed,
            trust_remote_code=trust_remote_code, skip_tokenizer_init=skip_tokenizer_init, load_format=load_format))
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                  and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params_list = self._params_list(sampling_params, len(prompts))
        ids = []
        for prompt, params in zip(prompts, params_list):
            text, token_ids = self._parse_prompt(prompt)
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, token_ids, params, prompt=text)
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = render_chat(self.engine.tokenizer, conversation, chat_template,  # type: ignore[arg-type]
                               add_generation_prompt, **(chat_template_kwargs or {}))
            # The template already wrote the special tokens (BOS etc.): don't add them twice.
            prompts.append({"prompt": text,
                            "prompt_token_ids": self.engine.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _params_list(self, params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise InvalidRequest(f"Got {len(params)} sampling_params for {n} prompts; pass one, or one per prompt.",
                                 "sampling_params")
        return params

    def _parse_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenize(prompt)
        if isinstance(prompt, list):
            return None, list(prompt)
        if isinstance(prompt, dict):
            if "multi_modal_data" in prompt:
                raise InvalidRequest(f"{self.config.model.architecture} is a text-only model; it cannot take "
                                     "multi_modal_data.", "multi_modal_data")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.engine.tokenize(prompt["prompt"])
        raise InvalidRequest("A prompt must be a string, {'prompt': str} or {'prompt_token_ids': [...]}.", "prompts")

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    results[output.request_id] = output
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return [results[rid] for rid in request_ids]
