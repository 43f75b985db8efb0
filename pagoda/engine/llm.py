"""Offline inference shaped like vLLM's `LLM`: `LLM(model=...).generate(prompts, params)`.

It *uses* an `LLMEngine` (it is not one): queue every prompt, step until all are finished,
return the outputs in prompt order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import difflib
import itertools
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar, cast

from tqdm.auto import tqdm

from pagoda.config import EngineArgs, EngineConfig, MultiModalConfig
from pagoda.config.engine import SWAP_SPACE_REASON
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.offline_metrics import Metric, OfflineTotals, metrics_list
from pagoda.errors import ConfigError, InvalidRequest
from pagoda.frontend.multimodal.chat import multimodal_serving, preprocess_items, render_chat_prompt
from pagoda.lora.request import LoRARequest, default_mm_lora, offline_default_mm_loras
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

PromptType = str | dict[str, Any] | list[int]
Conversation = list[dict[str, Any]]
T = TypeVar("T")

# vLLM's `LLM(...)` keywords that are not engine knobs here: read by `LLM.__init__` itself.
_LLM_ONLY_KNOBS = ("disable_log_stats", "swap_space")


def _run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from sync code, also when the caller already runs an event loop
    (a notebook): then in a worker thread with its own loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _knobs_by_config(
    owner: str, kwargs: dict[str, Any], *classes: type, also: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """`kwargs` split by the config dataclass whose field each one is; an unknown keyword is a TypeError
    that names it (with the closest knob) and lists the valid ones (`also`: valid ones the caller reads itself,
    left out of the split)."""
    names = [[f.name for f in dataclasses.fields(cls)] for cls in classes]
    unknown = [key for key in kwargs if key not in also and not any(key in group for group in names)]
    if unknown:
        valid = sorted([*also, *(name for group in names for name in group)])
        close = difflib.get_close_matches(unknown[0], valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(
            f"{owner} got an unexpected keyword argument {unknown[0]!r}{hint}; valid keywords: {', '.join(valid)}."
        )
    return [{key: value for key, value in kwargs.items() if key in group} for group in names]


def _check_llm_only_knobs(kwargs: dict[str, Any]) -> None:
    """vLLM's `disable_log_stats` and `swap_space`, checked before anything loads."""
    disable_log_stats = kwargs.get("disable_log_stats", True)
    if not isinstance(disable_log_stats, bool):
        raise ConfigError(f"disable_log_stats must be True or False, got {disable_log_stats!r}.", "disable_log_stats")
    swap_space = kwargs.get("swap_space", 0)
    if isinstance(swap_space, bool) or not isinstance(swap_space, (int, float)) or swap_space != 0:
        raise ConfigError(f"swap_space={swap_space!r}: {SWAP_SPACE_REASON}; leave it out or pass 0.", "swap_space")


class LLM:
    """`LLM(model, **knobs)`: every keyword is a field of `config.EngineArgs` (the engine: dtype, max_model_len,
    num_gpu_blocks_override...) or of `config.MultiModalConfig` (images/videos: limit_mm_per_prompt,
    mm_processor_kwargs, allowed_local_media_path, allow_private_media_urls), with the same meaning and default
    as the `--flag` of that name. A bad value raises ConfigError naming the knob; an unknown keyword, TypeError.
    Two of vLLM's keywords are read here: `disable_log_stats` (accepted either way: `get_metrics()` always counts)
    and `swap_space` (0 only: nothing is swapped, see SWAP_SPACE_REASON)."""

    def __init__(self, model: str | None = None, **kwargs: Any):
        engine_kwargs, mm_kwargs = _knobs_by_config("LLM()", kwargs, EngineArgs, MultiModalConfig, also=_LLM_ONLY_KNOBS)
        _check_llm_only_knobs(kwargs)
        self.mm_config = MultiModalConfig(**mm_kwargs)  # cheap checks first, before the model is read
        self.config = EngineConfig.create(EngineArgs(model=model, **engine_kwargs))
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()
        self._totals = OfflineTotals()
        source = self.engine.source
        # Images/videos (vision-language models): the same settings and pipeline as the server's.
        self._multimodal = multimodal_serving(
            source.hf_config, source.folder if source.kind == "hf" else None, self.mm_config
        )
        # default_mm_loras: the adapter a prompt with images (videos) runs with when it names none
        lora = self.config.lora
        self._mm_loras = offline_default_mm_loras(lora.default_mm_loras) if lora is not None else {}

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_metrics(self) -> list[Metric]:
        """As vLLM's: the engine's counters and gauges under their `vllm:` names (`engine/offline_metrics.py`);
        with speculative decoding, its drafts, draft tokens and accepted tokens (per position a `Vector`). Counted
        whatever `disable_log_stats` says (vLLM's, whose default is True, has nothing to return without False)."""
        return metrics_list(self.engine.stats(), self._totals, self.config.model.model)

    def reset_prefix_cache(self) -> bool:
        """As vLLM's: forget every cached prefix block that no running request holds; True once done."""
        self.engine.block_manager.reset_prefix_cache()
        return True

    @property
    def llm_engine(self) -> LLMEngine:  # vLLM's name for it (`llm.llm_engine.add_lora(...)`)
        return self.engine

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks now (they also stop when this object is collected or the process
        exits); a process runs one tensor-parallel engine at a time."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """As vLLM's: `priority`, one per prompt, needs scheduling_policy="priority"; a prompt dict's
        "cache_salt" keeps its prefix-cache blocks to prompts of the same salt; `lora_request`, one for every
        prompt or a list with one per prompt (None: the base model), needs enable_lora=True."""
        batch: list[PromptType]
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            batch = [cast(PromptType, prompts)]  # one prompt: a string, a prompt dict or one list of token ids
        else:
            batch = list(cast(Sequence[PromptType], prompts))
        params_list = self._params_list(sampling_params, len(batch))
        priorities = list(priority) if priority is not None else [0] * len(batch)
        if len(priorities) != len(batch):
            raise InvalidRequest(
                f"Got {len(priorities)} priorities for {len(batch)} prompts; pass one per prompt.", "priority"
            )
        loras: list[LoRARequest | None] = (
            list(lora_request)
            if isinstance(lora_request, (list, tuple))
            else [cast(LoRARequest | None, lora_request)] * len(batch)
        )
        if len(loras) != len(batch):
            raise InvalidRequest(
                f"Got {len(loras)} LoRA requests for {len(batch)} prompts; pass one, or one per prompt.", "lora_request"
            )
        # An adapter asked to load in place (its folder's files changed) is read again once for this call.
        reload = {r.lora_int_id: r for r in loras if isinstance(r, LoRARequest) and r.load_inplace}
        for changed in reload.values():
            self.engine.add_lora(changed)
        ids: list[str] = []
        try:
            for prompt, params, rank, lora in zip(batch, params_list, priorities, loras):
                text, token_ids, mm_inputs = self._parse_prompt(prompt)
                if lora is None and mm_inputs is not None and self._mm_loras:  # default_mm_loras
                    lora = default_mm_lora(self._mm_loras, (item.modality for item in mm_inputs.items))
                salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
                if salt is not None and (not isinstance(salt, str) or not salt):
                    raise InvalidRequest("cache_salt must be a non-empty string.", "cache_salt")
                request_id = str(next(self._ids))
                self.engine.add_request(
                    request_id,
                    token_ids,
                    params,
                    prompt=text,
                    mm_inputs=mm_inputs,
                    cache_salt=salt,
                    priority=rank,
                    lora_request=lora,
                )
                ids.append(request_id)
        except BaseException:
            # A prompt refused part-way (a bad adapter, a bad prompt): the ones queued before it would otherwise
            # run with the next generate() and come back there. All or nothing, as in vLLM.
            if ids:
                self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Chat with OpenAI-style messages; content parts may carry images/videos (image_url with data:,
        http(s) or file:// urls, or Qwen's {"type": "image", ...}) on a vision-language model. `lora_request`: as
        `generate`'s (one adapter for every conversation, or one per conversation).

        The first five parameters are vLLM's, in its order. vLLM's sixth (chat_template_content_format) and
        some after it are not implemented here, so the rest are keyword-only: a positional call meant for vLLM's
        signature fails with a TypeError rather than binding a value to the wrong parameter."""
        if messages and isinstance(messages[0], dict):
            conversations = [cast(Conversation, messages)]
        else:
            conversations = list(cast(Sequence[Conversation], messages))
        if self.engine.tokenizer is None:
            raise InvalidRequest("Chat needs a tokenizer, but skip_tokenizer_init=True.", "messages")
        prompts: list[PromptType] = []
        for conversation in conversations:
            # The template already writes the special tokens (BOS etc.): they are not added twice.
            text, token_ids, mm_inputs = _run_sync(
                render_chat_prompt(
                    self.engine.tokenizer,
                    self._multimodal,
                    list(conversation),
                    chat_template,
                    add_generation_prompt,
                    self.config.model.architecture,
                    chat_template_kwargs,
                )
            )
            prompts.append({"prompt": text, "prompt_token_ids": token_ids, "_mm_inputs": mm_inputs})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _params_list(self, params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise InvalidRequest(
                f"Got {len(params)} sampling_params for {n} prompts; pass one, or one per prompt.", "sampling_params"
            )
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
                return text, *self._multimodal_prompt(
                    token_ids, prompt["multi_modal_data"], prompt.get("mm_processor_kwargs")
                )
            return text, token_ids, prompt.get("_mm_inputs")
        raise InvalidRequest("A prompt must be a string, {'prompt': str} or {'prompt_token_ids': [...]}.", "prompts")

    def _multimodal_prompt(
        self, token_ids: list[int], data: dict[str, Any], processor_kwargs: dict[str, Any] | None
    ) -> tuple[list[int], Any]:
        """vLLM's {"prompt": text with one placeholder per item, "multi_modal_data": {"image": PIL image(s),
        "video": list of frames (or a list of such lists)}}."""
        if self._multimodal is None:
            raise InvalidRequest(
                f"Model {self.config.model.model} ({self.config.model.architecture}) does not accept images or video.",
                "multi_modal_data",
            )
        media: list[tuple[str, Any]] = []
        for modality, value in data.items():
            if modality not in ("image", "video"):
                raise InvalidRequest(
                    f"multi_modal_data key {modality!r} is not supported (image, video).", "multi_modal_data"
                )
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
            progress = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    results[output.request_id] = output
                    self._totals.add(output)
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return [results[rid] for rid in request_ids]
