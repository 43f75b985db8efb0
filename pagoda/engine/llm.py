"""Offline inference shaped like vLLM's `LLM`: `LLM(model=...).generate(prompts, params)`.

It *uses* an `LLMEngine` (it is not one): queue every prompt, step until all are finished,
return the outputs in prompt order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar, Union

from pagoda.config import EngineArgs, EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.outputs import RequestOutput
from pagoda.errors import InvalidRequest
from pagoda.frontend.multimodal.chat import multimodal_serving, preprocess_items, render_chat_prompt
from pagoda.sampling_params import SamplingParams

PromptType = Union[str, dict[str, Any], list[int]]
Conversation = list[dict[str, Any]]
T = TypeVar("T")


def _run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from sync code, also when the caller already runs an event loop
    (a notebook): then in a worker thread with its own loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


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
        gpu_memory_utilization: float | None = None,
        num_gpu_blocks_override: int | None = None,
        swap_space: float = 4,
        device: str = "auto",
        seed: int = 0,
        trust_remote_code: bool = False,
        skip_tokenizer_init: bool = False,
        cpu_kv_cache_space_gib: float = 4.0,
        load_format: str = "auto",
        limit_mm_per_prompt: dict[str, int] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        allowed_local_media_path: str | None = None,
        allow_private_media_urls: bool = False,
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        async_scheduling: bool | None = None,
        quantization: str | None = None,
    ):
        self.config = EngineConfig.create(EngineArgs(
            model=model, tokenizer=tokenizer, dtype=dtype, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
            enable_prefix_caching=enable_prefix_caching, gpu_memory_utilization=gpu_memory_utilization,
            num_gpu_blocks_override=num_gpu_blocks_override, swap_space=swap_space,
            cpu_kv_cache_space_gib=cpu_kv_cache_space_gib, device=device, seed=seed,
            trust_remote_code=trust_remote_code, skip_tokenizer_init=skip_tokenizer_init, load_format=load_format,
            attention_backend=attention_backend, enforce_eager=enforce_eager, async_scheduling=async_scheduling,
            quantization=quantization))
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()
        source = self.engine.source
        # Images/videos (vision-language models): the same settings and pipeline as the server's.
        self._multimodal = multimodal_serving(
            source.hf_config, source.folder if source.kind == "hf" else None,
            json.dumps(limit_mm_per_prompt) if limit_mm_per_prompt else None,
            json.dumps(mm_processor_kwargs) if mm_processor_kwargs else None, allowed_local_media_path,
            allow_private_media_urls)

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
            text, token_ids, mm_inputs = self._parse_prompt(prompt)
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, token_ids, params, prompt=text, mm_inputs=mm_inputs)
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Chat with OpenAI-style messages; content parts may carry images/videos (image_url with data:,
        http(s) or file:// urls, or Qwen's {"type": "image", ...}) on a vision-language model."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if self.engine.tokenizer is None:
            raise InvalidRequest("Chat needs a tokenizer, but skip_tokenizer_init=True.", "messages")
        prompts: list[PromptType] = []
        for conversation in conversations:
            # The template already writes the special tokens (BOS etc.): they are not added twice.
            text, token_ids, mm_inputs = _run_sync(render_chat_prompt(
                self.engine.tokenizer, self._multimodal, list(conversation), chat_template, add_generation_prompt,
                self.config.model.architecture, chat_template_kwargs))
            prompts.append({"prompt": text, "prompt_token_ids": token_ids, "_mm_inputs": mm_inputs})
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

    def _parse_prompt(self, prompt: PromptType) -> tuple[str | None, list[int], Any]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenize(prompt), None
        if isinstance(prompt, list):
            return None, list(prompt), None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                text, token_ids = prompt["prompt"], self.engine.tokenize(prompt["prompt"])
            else:
                raise InvalidRequest("A prompt dict needs 'prompt' or 'prompt_token_ids'.", "prompts")
            if prompt.get("multi_modal_data"):
                return text, *self._multimodal_prompt(token_ids, prompt["multi_modal_data"],
                                                      prompt.get("mm_processor_kwargs"))
            return text, token_ids, prompt.get("_mm_inputs")
        raise InvalidRequest("A prompt must be a string, {'prompt': str} or {'prompt_token_ids': [...]}.", "prompts")

    def _multimodal_prompt(self, token_ids: list[int], data: dict[str, Any],
                           processor_kwargs: dict[str, Any] | None) -> tuple[list[int], Any]:
        """vLLM's {"prompt": text with one placeholder per item, "multi_modal_data": {"image": PIL image(s),
        "video": list of frames (or a list of such lists)}}."""
        if self._multimodal is None:
            raise InvalidRequest(f"Model {self.config.model.model} ({self.config.model.architecture}) does not "
                                 "accept images or video.", "multi_modal_data")
        media: list[tuple[str, Any]] = []
        for modality, value in data.items():
            if modality not in ("image", "video"):
                raise InvalidRequest(f"multi_modal_data key {modality!r} is not supported (image, video).",
                                     "multi_modal_data")
            if modality == "image":
                items = value if isinstance(value, (list, tuple)) else [value]
            else:
                items = value if value and isinstance(value[0], (list, tuple)) else [value]
            media += [(modality, item) for item in items]
        return preprocess_items(self._multimodal, token_ids, media, processor_kwargs)

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
