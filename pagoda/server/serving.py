"""OpenAI request → prompt token ids + SamplingParams → engine stream → OpenAI responses / chunks.

Every handler here raises typed errors (`pagoda.errors`); `app.py` turns them into OpenAI-shaped
JSON. Outputs always arrive as per-step deltas from the engine; non-streaming responses are the
deltas accumulated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

from pagoda.engine.async_engine import Admission, AsyncEngine, free_seats
from pagoda.engine.validation import check_prompt_tokens
from pagoda.errors import ContextLengthExceeded, EngineDead, InvalidRequest, ModelNotFound, Overloaded
from pagoda.frontend.detokenizer import decode_ids
from pagoda.frontend.multimodal.chat import MultiModalServing, render_chat_prompt
from pagoda.frontend.prompt_work import PromptWork
from pagoda.frontend.template_sandbox import refused_message
from pagoda.frontend.tool_calls.parsers import ToolCallStream
from pagoda.lora.adapter_folder import check_adapter_folder
from pagoda.lora.request import LoRARequest, default_mm_lora
from pagoda.outputs import CompletionOutput, EngineStats, Logprob, RequestOutput
from pagoda.sampling_params import MAX_LOGPROBS, SamplingParams
from pagoda.server import protocol as p
from pagoda.server.metrics import RequestTiming, ServerMetrics
from pagoda.server.sse import SSE_DONE, sse_data
from pagoda.server.tool_requests import (
    RequestOptions,
    ToolPlan,
    check_tool_results,
    final_message,
    logprob_token,
    plan_tools,
    prepare_messages,
    refuse_unimplemented,
    request_options,
    structured_outputs_of,
)

logger = logging.getLogger("pagoda.server")

_GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass
class ServingContext:
    engine: AsyncEngine
    tokenizer: Any | None
    served_model_names: list[str]
    max_model_len: int
    vocab_size: int
    architecture: str
    chat_template: str | None
    metrics: ServerMetrics
    generation_defaults: dict[str, Any] = field(default_factory=dict)  # from generation_config.json
    max_waiting_requests: int | None = None
    api_server_count: int = 1  # API processes sharing the engine (--api-server-count)
    max_num_seqs: int | None = None  # the core's seats: requests that take one run at once (admission)
    log_requests: bool = False
    multimodal: MultiModalServing | None = None  # set for vision-language models
    trust_request_chat_template: bool = False  # --trust-request-chat-template
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice
    tool_call_parser: str | None = None  # --tool-call-parser
    scheduling_policy: str = "fcfs"  # --scheduling-policy: a request's priority needs "priority"
    lora_modules: dict[str, Any] = field(default_factory=dict)  # --lora-modules: name → lora.request.LoRARequest
    # --default-mm-loras: the modalities whose prompts run with the adapter served under the modality's name
    default_mm_loras: tuple[str, ...] = ()
    max_lora_rank: int = 0  # --max-lora-rank (0: adapters off)
    runtime_lora_updating: bool = False  # --allow-runtime-lora-updating: /v1/load_lora_adapter and unload
    prompts: PromptWork | None = None  # built ahead (`ApiSetup.prepare_prompts`); else by OpenAIServing

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


def sampling_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields a model's generation_config.json sets (used when a request leaves them unset)."""
    return {
        ours: generation_config[theirs]
        for theirs, ours in _GENERATION_CONFIG_FIELDS.items()
        if generation_config.get(theirs) is not None
    }


class OpenAIServing:
    def __init__(self, ctx: ServingContext):
        self.ctx = ctx
        # Tokenizing and rendering: the character bound, large texts off the event loop (`PromptWork`).
        self.prompts = ctx.prompts
        if self.prompts is None and ctx.tokenizer is not None:
            self.prompts = PromptWork(ctx.tokenizer, ctx.max_model_len)
        # The next runtime adapter's id: past --lora-modules', never an unloaded adapter's again.
        self._next_lora_id = max((lora.lora_int_id for lora in ctx.lora_modules.values()), default=0) + 1
        self._loading_loras: set[str] = set()  # runtime loads the core has not answered yet

    # ---- shared checks ------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        """A served name of the base model or of a LoRA adapter (`--lora-modules`), or no name."""
        if name is not None and name not in self.ctx.served_model_names and name not in self.ctx.lora_modules:
            served = ", ".join([*self.ctx.served_model_names, *self.ctx.lora_modules])
            raise ModelNotFound(f"The model `{_clip(name)}` does not exist. Served models: {served}.", "model")

    # ---- LoRA adapters at run time (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter) -----------
    async def load_lora(self, name: str, path: str, inplace: bool = False) -> str:
        """Serve a PEFT folder under `name` from now on. Its folder and config are checked here, then the engine
        core reads its weights and checks them against the model (as it does --lora-modules at startup): an
        adapter it cannot serve is a 400 naming why, and is not listed. Ids are never reused. `inplace` (vLLM's
        load_inplace): `name` may be served already; the new weights take a new id, later requests get them,
        and the old id is released (its running requests finish with it)."""
        ctx = self._runtime_lora()
        if name in ctx.served_model_names:
            raise InvalidRequest(
                f"The lora adapter name '{_clip(name)}' is a served model name; load it under another name.",
                "lora_name",
            )
        if name in self._loading_loras or (name in ctx.lora_modules and not inplace):
            raise InvalidRequest(f"The lora adapter '{_clip(name)}' has already been loaded.", "lora_name")
        current = ctx.lora_modules.get(name)  # replaced in place: its parent in /v1/models stays
        lora = LoRARequest(name, self._next_lora_id, path, base_model_name=current and current.base_model_name)
        # The id is taken before anything is awaited (a concurrent load gets the next one), and the name is held
        # until the core answers (a concurrent load of the same name is refused, not listed twice).
        self._next_lora_id = lora.lora_int_id + 1
        self._loading_loras.add(name)
        try:
            # A hub id may be fetched here: off the event loop, which keeps serving the running streams.
            await asyncio.to_thread(check_adapter_folder, lora, ctx.max_lora_rank)
            await ctx.engine.add_lora(lora)
        finally:
            self._loading_loras.discard(name)
        replaced = ctx.lora_modules.get(name)
        ctx.lora_modules[name] = lora
        if replaced is not None:
            await ctx.engine.remove_lora(replaced.lora_int_id)
        logger.info("Loaded LoRA adapter: name %r, path %r%s", name, path, " (in place)" if replaced else "")
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora(self, name: str, lora_id: int | None) -> str:
        """Stop serving `name` (requests already running with it finish with it); the core frees its memory when
        they have."""
        ctx = self._runtime_lora()
        lora = ctx.lora_modules.get(name)
        if lora is None or (lora_id is not None and lora.lora_int_id != lora_id):
            raise ModelNotFound(f"The lora adapter '{_clip(name)}' cannot be found.", "lora_name")
        del ctx.lora_modules[name]
        await ctx.engine.remove_lora(lora.lora_int_id)
        logger.info("Unloaded LoRA adapter: name %r", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _runtime_lora(self) -> ServingContext:
        if not self.ctx.runtime_lora_updating:
            raise ModelNotFound(
                "Loading and unloading LoRA adapters at run time is off: start the server with "
                "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) and --enable-lora.",
                "lora_name",
            )
        return self.ctx

    def _options(self, req: Any) -> RequestOptions:
        return request_options(req, self.ctx.scheduling_policy, self.ctx.lora_modules)

    def _with_default_mm_lora(self, opts: RequestOptions, mm_inputs: Any) -> RequestOptions:
        """A request with images or video that names no adapter runs with its modality's `--default-mm-loras`
        adapter (the one served under the modality's name now); its responses still carry the name it asked for."""
        if opts.lora_request is not None or mm_inputs is None or not self.ctx.default_mm_loras:
            return opts
        adapters = {m: self.ctx.lora_modules[m] for m in self.ctx.default_mm_loras if m in self.ctx.lora_modules}
        lora = default_mm_lora(adapters, (item.modality for item in mm_inputs.items))
        return opts if lora is None else dataclasses.replace(opts, lora_request=lora)

    def check_capacity(self, count: int = 1) -> Admission | None:
        """503 if the engine is dead or `--max-waiting-requests` are waiting; otherwise the room taken for
        these `count` requests until they are sent (None without a limit). See `admission_room`."""
        # Checked before a stream starts, so a dead engine is a 503, not a 200 with an error event.
        engine = self.ctx.engine
        if engine.is_dead:
            raise EngineDead(f"The engine is not running: {engine.dead_reason}")
        limit = self.ctx.max_waiting_requests
        if limit is None:
            return None
        stats, seats = engine.stats, self.ctx.max_num_seqs
        unreported = engine.num_unreported
        if unreported >= admission_room(stats, limit, seats, self.ctx.api_server_count):
            waiting = max(0, stats.num_waiting + unreported - free_seats(stats, seats))
            raise Overloaded(f"The server is overloaded ({waiting} requests waiting); retry later.")
        return engine.admit(count)

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        """A prompt's ids; one longer than the context could ever hold is refused before tokenizing."""
        if self.prompts is None:
            raise InvalidRequest("This server has no tokenizer (--skip-tokenizer-init); send token ids.", "prompt")
        self.prompts.check_chars(text, "prompt")
        check_unicode(text, "prompt")
        return await self.prompts.encode(text, add_special_tokens)

    async def tokenize_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """The ids of a completion request's list of prompts (all of them at once off the loop when long)."""
        if self.prompts is None:
            raise InvalidRequest("This server has no tokenizer (--skip-tokenizer-init); send token ids.", "prompt")
        for text in texts:
            self.prompts.check_chars(text, "prompt")
            check_unicode(text, "prompt")
        return await self.prompts.encode_many(texts, add_special_tokens)

    def _resolve_max_tokens(
        self, requested: int | None, prompt_len: int, prompt_param: str = "prompt", media_tokens: int = 0
    ) -> int:
        ctx = self.ctx
        if prompt_len >= ctx.max_model_len:
            parts = f" ({prompt_len - media_tokens} text + {media_tokens} image/video tokens)" if media_tokens else ""
            raise ContextLengthExceeded(
                f"This model's maximum context length is {ctx.max_model_len} tokens. However, your prompt has "
                f"{prompt_len} tokens{parts}, which leaves no room for the completion. Please reduce the length "
                f"of the {prompt_param}"
                + (" or the image sizes (mm_processor_kwargs max_pixels)." if media_tokens else "."),
                prompt_param,
            )
        if requested is None:
            requested = ctx.generation_defaults.get("max_tokens")
            if requested is None or prompt_len + requested > ctx.max_model_len:
                requested = ctx.max_model_len - prompt_len
        if requested < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {requested}.", "max_tokens")
        if prompt_len + max(requested, 1) > ctx.max_model_len:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {ctx.max_model_len} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the messages, {requested} in the completion). "
                "Please reduce the length of the messages or completion.",
                "max_tokens",
            )
        return requested

    def check_tokens(self, token_ids: list[int], param: str = "prompt") -> None:
        check_prompt_tokens(token_ids, self.ctx.vocab_size, param)

    def _sampling_params(
        self, req: p._SamplingFields, max_tokens: int, logprobs: int | None, tool_plan: ToolPlan | None = None
    ) -> SamplingParams:
        defaults = self.ctx.generation_defaults
        refuse_unimplemented(req)
        structured = structured_outputs_of(req)
        if tool_plan is not None and tool_plan.forced is not None:
            if structured is not None:
                raise InvalidRequest(
                    f"tool_choice {tool_plan.choice!r} already constrains the reply; drop {structured.param}.",
                    structured.param,
                )
            structured = tool_plan.forced

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(req, name)
            return value if value is not None else defaults.get(name, fallback)

        if req.stream_options is not None and not req.stream:
            raise InvalidRequest("stream_options can only be set when stream is true.", "stream_options")
        if req.logprob_token_ids is not None:
            if logprobs is None:
                raise InvalidRequest(
                    "logprob_token_ids needs logprobs (true on chat, a number on completions).", "logprob_token_ids"
                )
            check_prompt_tokens(req.logprob_token_ids, self.ctx.vocab_size, "logprob_token_ids")
        return SamplingParams(
            n=req.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            logprob_token_ids=req.logprob_token_ids,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            structured_outputs=structured,
        )

    # ---- chat ---------------------------------------------------------------------------------
    async def prepare_chat(
        self, req: p.ChatCompletionRequest
    ) -> tuple[str, list[int], SamplingParams, Any, ToolPlan | None]:
        """(rendered text, prompt ids with image/video placeholders expanded, params, mm inputs or None,
        how tool calls are read back or None)."""
        self.check_model(req.model)
        tool_plan = plan_tools(req, self.ctx.enable_auto_tool_choice, self.ctx.tool_call_parser)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}.", "top_logprobs"
            )
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true.", "top_logprobs")
        if req.add_generation_prompt and req.continue_final_message:
            raise InvalidRequest(
                "add_generation_prompt and continue_final_message cannot both be true.", "continue_final_message"
            )
        if not req.continue_final_message and all(m.role == "assistant" for m in req.messages):
            # Nothing to answer. With continue_final_message it is a prefill: the model continues that text.
            raise InvalidRequest(
                "The messages are all assistant messages; send a user (or system, developer, "
                "tool) message too, or set continue_final_message (and add_generation_prompt "
                "false) to continue the last one.",
                "messages",
            )
        if req.chat_template and not self.ctx.trust_request_chat_template:
            raise InvalidRequest(refused_message(), "chat_template")
        check_tool_results(req.messages)
        text, token_ids, mm_inputs = await self.chat_prompt(
            req.messages,
            self.ctx.chat_template,
            req.add_generation_prompt,
            req.chat_template_kwargs,
            req.mm_processor_kwargs,
            continue_final_message=req.continue_final_message,
            request_template=req.chat_template or None,
            tool_plan=tool_plan,
            add_special_tokens=req.add_special_tokens,
        )
        self.check_tokens(token_ids, "messages")
        media_tokens = sum(mm_inputs.counts.values()) if mm_inputs is not None else 0
        max_tokens = self._resolve_max_tokens(
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
            len(token_ids),
            "messages",
            media_tokens,
        )
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return text, token_ids, self._sampling_params(req, max_tokens, logprobs, tool_plan), mm_inputs, tool_plan

    async def chat_prompt(
        self,
        messages: list[p.ChatMessage],
        chat_template: str | None,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None = None,
        processor_kwargs: dict[str, Any] | None = None,
        *,
        continue_final_message: bool = False,
        request_template: str | None = None,
        tool_plan: ToolPlan | None = None,
        add_special_tokens: bool = False,
    ) -> tuple[str, list[int], Any]:
        """Render, tokenize, and for images/videos fetch, preprocess and expand their placeholders.
        `request_template` (a request's own, allowed by --trust-request-chat-template) replaces
        `chat_template` and is rendered in the bounded sandbox, off the event loop."""
        if self.ctx.tokenizer is None:
            raise InvalidRequest("Chat needs a tokenizer, but the server runs with --skip-tokenizer-init.", "messages")
        template = request_template or chat_template or getattr(self.ctx.tokenizer, "chat_template", None)
        dicts = prepare_messages([self._message_dict(m) for m in messages], tool_plan, template)
        if tool_plan is not None:
            template_kwargs = {**(template_kwargs or {}), "tools": tool_plan.template_tools}
        # All of it may end up in the rendered prompt, which the tokenizer must be able to take.
        for value, param in (
            (dicts, "messages"),
            (request_template, "chat_template"),
            (template_kwargs, "chat_template_kwargs"),
        ):
            check_unicode(value, param)
        return await render_chat_prompt(
            self.ctx.tokenizer,
            self.ctx.multimodal,
            dicts,
            chat_template,
            add_generation_prompt,
            f"{self.ctx.model_name} ({self.ctx.architecture})",
            template_kwargs,
            processor_kwargs,
            continue_final_message=continue_final_message,
            request_template=request_template,
            add_special_tokens=add_special_tokens,
            work=self.prompts,
        )

    async def tokenize_chat(self, req: p.TokenizeRequest) -> tuple[str, list[int], Any]:
        """/tokenize of messages: the prompt a chat request with the same messages, tools and template gets."""
        if req.chat_template and not self.ctx.trust_request_chat_template:
            raise InvalidRequest(refused_message(), "chat_template")
        kwargs = dict(req.chat_template_kwargs or {})
        if req.tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
        assert req.messages is not None
        return await self.chat_prompt(
            req.messages,
            self.ctx.chat_template,
            req.add_generation_prompt,
            kwargs or None,
            request_template=req.chat_template or None,
            # As a chat request: the template writes the special tokens unless the request asks for the tokenizer's.
            add_special_tokens=req.add_special_tokens if "add_special_tokens" in req.model_fields_set else False,
        )

    def _message_dict(self, message: p.ChatMessage) -> dict[str, Any]:
        data = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            data["content"] = [part.model_dump(exclude_none=True) for part in message.content]
        elif message.content is None:
            data["content"] = ""
        return data

    async def chat(self, req: p.ChatCompletionRequest, arrival: float) -> p.ChatCompletionResponse:
        text, ids, params, mm_inputs, tool_plan = await self.prepare_chat(req)
        opts = self._with_default_mm_lora(self._options(req), mm_inputs)
        admission = self.check_capacity()
        texts, token_counts, finals, logprobs = _accumulators(params.n)
        tokens: list[list[int]] = [[] for _ in range(params.n)]
        async for batch in self._generate(ids, params, text, arrival, opts.engine_id(), mm_inputs, admission, opts):
            for out in batch:
                for c in out.outputs:
                    texts[c.index].append(c.text)
                    token_counts[c.index] += len(c.token_ids)
                    if opts.return_token_ids:
                        tokens[c.index].extend(c.token_ids)
                    if c.logprobs is not None:
                        logprobs[c.index].extend(self._chat_logprobs(c.token_ids, c.logprobs, opts.tokens_as_ids))
                    if c.finish_reason is not None:
                        finals[c.index] = c
        echo = chat_echo(req)
        choices = []
        for i in range(params.n):
            message, reason = final_message("".join(texts[i]), tool_plan, _reason(finals[i]))
            if echo:
                message.content = echo + (message.content or "")
            choices.append(
                p.ChatChoice(
                    index=i,
                    message=message,
                    logprobs=p.ChatLogprobs(content=logprobs[i]) if params.logprobs is not None else None,
                    finish_reason=reason,
                    stop_reason=_stop(finals[i]),
                    token_ids=tokens[i] if opts.return_token_ids else None,
                )
            )
        return p.ChatCompletionResponse(
            id=opts.response_id("chatcmpl"),
            created=p.now(),
            model=opts.model or self.ctx.model_name,
            choices=choices,
            usage=_usage(len(ids), sum(token_counts)),
            prompt_token_ids=ids if opts.return_token_ids else None,
        )

    async def chat_stream(self, req: p.ChatCompletionRequest, arrival: float) -> AsyncIterator[str | bytes]:
        text, ids, params, mm_inputs, tool_plan = await self.prepare_chat(req)
        opts = self._with_default_mm_lora(self._options(req), mm_inputs)
        admission = self.check_capacity()
        return self._chat_stream(req, text, ids, params, arrival, mm_inputs, admission, tool_plan, opts)

    async def _chat_stream(
        self,
        req: p.ChatCompletionRequest,
        text: str,
        ids: list[int],
        params: SamplingParams,
        arrival: float,
        mm_inputs: Any = None,
        admission: Admission | None = None,
        tool_plan: ToolPlan | None = None,
        opts: RequestOptions | None = None,
    ) -> AsyncIterator[str | bytes]:
        opts = opts or self._options(req)
        chunk_id, created, name = opts.response_id("chatcmpl"), p.now(), opts.model or self.ctx.model_name
        # With tools, each sample's text goes through its tool-call parser: content deltas and tool_calls deltas.
        calls = [ToolCallStream(tool_plan.parser) for _ in range(params.n)] if tool_plan is not None else None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        completion_tokens = 0
        template = p.ChatChunkTemplate(chunk_id, created, name)

        def frame(
            choices: list[p.ChatStreamChoice], usage: p.UsageInfo | None = None, prompt_ids: list[int] | None = None
        ) -> str:
            chunk = p.ChatCompletionChunk(
                id=chunk_id, created=created, model=name, choices=choices, usage=usage, prompt_token_ids=prompt_ids
            )
            return sse_data(chunk.model_dump_json(exclude_unset=False))

        # The role chunk goes out with the first tokens, as vLLM's server sends it: clients (vLLM's `bench serve`
        # among them) take the first chunk with choices as the first token, so one sent before the prefill
        # would count the whole prefill, image encoding included, as decode time. With echo, the echoed
        # content follows it in a chunk of its own (as vLLM's).
        first = frame(
            [p.ChatStreamChoice(index=i, delta=p.DeltaMessage(role="assistant", content="")) for i in range(params.n)],
            prompt_ids=ids if opts.return_token_ids else None,
        )
        if echo := chat_echo(req):
            first += frame([p.ChatStreamChoice(index=i, delta=p.DeltaMessage(content=echo)) for i in range(params.n)])
        role: str | None = first
        # The pre-serialized chunks have no place for token ids or "token_id:N" logprobs: those go through pydantic.
        fast = not opts.return_token_ids
        async for batch in self._generate(ids, params, text, arrival, opts.engine_id(), mm_inputs, admission, opts):
            # One chunk per output that carries tokens, as they came, even when its text is empty (held back
            # as an incomplete UTF-8 sequence or a possible stop string, or ids the tokenizer has no piece
            # for): a client sees every step as an event, as from vLLM. One write per batch.
            events = [role] if role is not None else []
            role = None
            for out in batch:
                choices = []
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    if not c.token_ids and not c.text and c.finish_reason is None:
                        continue
                    if calls is not None:
                        choices.append(_tool_choice_chunk(calls[c.index], c, self._chat_logprobs, opts))
                        continue
                    choice = (
                        template.choice(c.index, c.text, _reason(c), c.stop_reason)
                        if c.logprobs is None and fast
                        else None
                    )
                    if choice is None:
                        lp = (
                            p.ChatLogprobs(content=self._chat_logprobs(c.token_ids, c.logprobs, opts.tokens_as_ids))
                            if c.logprobs is not None
                            else None
                        )
                        choice = p.ChatStreamChoice(
                            index=c.index,
                            delta=p.DeltaMessage(content=c.text),
                            logprobs=lp,
                            finish_reason=_reason(c),
                            stop_reason=_stop(c),
                            token_ids=list(c.token_ids) if opts.return_token_ids else None,
                        ).model_dump_json()
                    choices.append(choice)
                if choices:
                    events.append(template.event(choices))
            if batch[-1].finished:  # the last write: the usage chunk and the end marker go with it
                if include_usage:
                    events.append(frame([], _usage(len(ids), completion_tokens)))
                events.append(SSE_DONE)
            if events:
                yield "".join(events).encode()

    def _chat_logprobs(
        self, token_ids: list[int], entries: list[dict[int, Logprob]], as_ids: bool = False
    ) -> list[p.ChatTokenLogprob]:
        result = []
        for token, entry in zip(token_ids, entries):
            chosen = entry[token]
            top = sorted((item for item in entry.items() if item[1].rank is not None), key=lambda i: i[1].rank or 0)
            name = logprob_token(token, chosen.decoded_token, as_ids)
            result.append(
                p.ChatTokenLogprob(
                    token=name,
                    logprob=chosen.logprob,
                    bytes=_bytes(name if as_ids else chosen.decoded_token),
                    top_logprobs=[
                        p.TopLogprob(
                            token=(top_name := logprob_token(tid, e.decoded_token, as_ids)),
                            logprob=e.logprob,
                            bytes=_bytes(top_name if as_ids else e.decoded_token),
                        )
                        for tid, e in top
                    ],
                )
            )
        return result

    # ---- completions --------------------------------------------------------------------------
    async def prepare_completion(self, req: p.CompletionRequest) -> list[tuple[str | None, list[int], SamplingParams]]:
        self.check_model(req.model)
        if req.suffix is not None:
            raise InvalidRequest("suffix is not supported.", "suffix")
        if req.best_of not in (None, 1) and req.best_of != req.n:
            raise InvalidRequest("best_of is not supported; use n.", "best_of")
        if req.echo and req.logprobs is not None:
            # OpenAI's echo + logprobs gives the prompt tokens' logprobs too; this engine computes none.
            raise InvalidRequest(
                "echo with logprobs would need the prompt tokens' logprobs, which this server does not compute "
                "(prompt_logprobs); send one of them.",
                "echo",
            )
        prompt = req.prompt
        count = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
        if count * req.n > p.MAX_PROMPTS:
            raise InvalidRequest(
                f"n times the number of prompts must be at most {p.MAX_PROMPTS}, got n={req.n} for {count} prompts.",
                "n",
            )
        if isinstance(prompt, str):
            items: list[tuple[str | None, list[int]]] = [(prompt, await self.tokenize(prompt, req.add_special_tokens))]
        elif prompt and all(isinstance(x, str) for x in prompt):
            texts = cast("list[str]", prompt)
            items = list(zip(texts, await self.tokenize_many(texts, req.add_special_tokens)))
        elif prompt and all(isinstance(x, int) for x in prompt):
            items = [(None, list(cast("list[int]", prompt)))]
        elif prompt and all(isinstance(x, list) for x in prompt):
            items = [(None, list(x)) for x in cast("list[list[int]]", prompt)]
        else:
            raise InvalidRequest(
                "prompt must be a string, a list of strings, a list of token ids or a list of "
                "token-id lists, and not empty.",
                "prompt",
            )
        prepared = []
        params: SamplingParams | None = None
        for text, ids in items:
            max_tokens = self._resolve_max_tokens(req.max_tokens, len(ids))  # first: O(1) for an overlong prompt
            self.check_tokens(ids)
            # The request's fields (and its grammar) are checked once; prompts differ only in max_tokens.
            params = (
                self._sampling_params(req, max_tokens, req.logprobs)
                if params is None
                else dataclasses.replace(params, max_tokens=max_tokens)
            )
            prepared.append((text, ids, params))
        return prepared

    async def completion(self, req: p.CompletionRequest, arrival: float) -> p.CompletionResponse:
        opts = self._options(req)
        prepared = await self.prepare_completion(req)
        admission = self.check_capacity(len(prepared))
        n = req.n
        texts, counts, finals, logprobs = _accumulators(n * len(prepared))
        tokens: list[list[int]] = [[] for _ in range(n * len(prepared))]
        prompt_tokens = sum(len(ids) for _, ids, _ in prepared)
        async for k, batch in self._merged(prepared, arrival, opts, admission):
            for out in batch:
                for c in out.outputs:
                    i = k * n + c.index
                    texts[i].append(c.text)
                    counts[i] += len(c.token_ids)
                    if opts.return_token_ids:
                        tokens[i].extend(c.token_ids)
                    if c.logprobs is not None:
                        logprobs[i].append((c.token_ids, c.logprobs))
                    if c.finish_reason is not None:
                        finals[i] = c
        choices = []
        for i in range(n * len(prepared)):
            prefix = (prepared[i // n][0] or self.decode(prepared[i // n][1])) if req.echo else ""
            lp = (
                self._completion_logprobs(logprobs[i], len(prefix), opts.tokens_as_ids)
                if req.logprobs is not None
                else None
            )
            choices.append(
                p.CompletionChoice(
                    index=i,
                    text=prefix + "".join(texts[i]),
                    logprobs=lp,
                    finish_reason=_reason(finals[i]),
                    stop_reason=_stop(finals[i]),
                    prompt_token_ids=prepared[i // n][1] if opts.return_token_ids else None,
                    token_ids=tokens[i] if opts.return_token_ids else None,
                )
            )
        return p.CompletionResponse(
            id=opts.response_id("cmpl"),
            created=p.now(),
            model=opts.model or self.ctx.model_name,
            choices=choices,
            usage=_usage(prompt_tokens, sum(counts)),
        )

    async def completion_stream(self, req: p.CompletionRequest, arrival: float) -> AsyncIterator[str | bytes]:
        opts = self._options(req)
        prepared = await self.prepare_completion(req)
        admission = self.check_capacity(len(prepared))
        return self._completion_stream(req, prepared, arrival, admission, opts)

    async def _completion_stream(
        self,
        req: p.CompletionRequest,
        prepared: list,
        arrival: float,
        admission: Admission | None = None,
        opts: RequestOptions | None = None,
    ) -> AsyncIterator[str | bytes]:
        opts = opts or self._options(req)
        chunk_id, created, name, n = opts.response_id("cmpl"), p.now(), opts.model or self.ctx.model_name, req.n
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        completion_tokens = 0
        echoed: set[int] = set()
        offsets = [0] * (n * len(prepared))
        template = p.CompletionChunkTemplate(chunk_id, created, name)
        unfinished = len(prepared)
        async for k, batch in self._merged(prepared, arrival, opts, admission):
            events = []  # one chunk per output with tokens (see _chat_stream), a batch in one write
            for out in batch:
                unfinished -= out.finished
                choices = []
                for c in out.outputs:
                    i = k * n + c.index
                    completion_tokens += len(c.token_ids)
                    text = c.text
                    first = i not in echoed  # this choice's first chunk
                    if first:
                        echoed.add(i)
                        if req.echo:
                            text = (prepared[k][0] or self.decode(prepared[k][1])) + text
                    wants_ids = opts.return_token_ids and first  # the prompt's ids go in the first chunk
                    if not text and not c.token_ids and c.finish_reason is None and not wants_ids:
                        continue
                    choice = (
                        template.choice(i, text, _reason(c), c.stop_reason)
                        if c.logprobs is None and not opts.return_token_ids
                        else None
                    )
                    if choice is None:
                        lp = None
                        if c.logprobs is not None:
                            lp = self._completion_logprobs(
                                [(c.token_ids, c.logprobs)], offsets[i] + len(text) - len(c.text), opts.tokens_as_ids
                            )
                        choice = p.CompletionChoice(
                            index=i,
                            text=text,
                            logprobs=lp,
                            finish_reason=_reason(c),
                            stop_reason=_stop(c),
                            prompt_token_ids=prepared[k][1] if opts.return_token_ids and first else None,
                            token_ids=list(c.token_ids) if opts.return_token_ids else None,
                        ).model_dump_json(exclude_none=True)
                    offsets[i] += len(text)
                    choices.append(choice)
                if choices:
                    events.append(template.event(choices))
            if not unfinished:  # the last write: the usage chunk and the end marker go with it
                if include_usage:
                    prompt_tokens = sum(len(ids) for _, ids, _ in prepared)
                    chunk = p.CompletionResponse(
                        id=chunk_id,
                        created=created,
                        model=name,
                        choices=[],
                        usage=_usage(prompt_tokens, completion_tokens),
                    )
                    events.append(sse_data(chunk.model_dump_json(exclude_none=True)))
                events.append(SSE_DONE)
            if events:
                yield "".join(events).encode()

    def _completion_logprobs(
        self, parts: list[tuple[list[int], list[dict[int, Logprob]]]], offset: int = 0, as_ids: bool = False
    ) -> p.CompletionLogprobs:
        """OpenAI's legacy logprobs; text_offset counts characters from `offset` (where this text starts)
        (the text's, also when `as_ids` names the tokens "token_id:N")."""
        result = p.CompletionLogprobs()
        for token_ids, entries in parts:
            for token, entry in zip(token_ids, entries):
                chosen = entry[token]
                result.tokens.append(logprob_token(token, chosen.decoded_token, as_ids))
                result.token_logprobs.append(chosen.logprob)
                result.top_logprobs.append(
                    {
                        logprob_token(t, e.decoded_token, as_ids): e.logprob
                        for t, e in entry.items()
                        if e.rank is not None
                    }
                )
                result.text_offset.append(offset)
                offset += len(chosen.decoded_token or "")
        return result

    def decode(self, ids: list[int]) -> str:
        return decode_ids(self.ctx.tokenizer, ids) if self.ctx.tokenizer is not None else ""

    # ---- engine streams and metrics -----------------------------------------------------------
    async def _merged(
        self, prepared: list, arrival: float, opts: RequestOptions, admission: Admission | None = None
    ) -> AsyncIterator[tuple[int, list[RequestOutput]]]:
        """Run several prompts at once; yield (prompt index, batch of its outputs) as they come."""
        if len(prepared) == 1:
            text, ids, params = prepared[0]
            async for batch in self._generate(
                ids, params, text, arrival, opts.engine_id(), admission=admission, opts=opts
            ):
                yield 0, batch
            return
        queue: asyncio.Queue[tuple[int, list[RequestOutput] | None | BaseException]] = asyncio.Queue()

        async def pump(k: int, text: str | None, ids: list[int], params: SamplingParams) -> None:
            try:
                async for batch in self._generate(
                    ids, params, text, arrival, opts.engine_id(k), admission=admission, opts=opts
                ):
                    await queue.put((k, batch))
                await queue.put((k, None))
            except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
                await queue.put((k, exc))

        tasks = [asyncio.create_task(pump(k, *item)) for k, item in enumerate(prepared)]
        try:
            remaining = len(tasks)
            while remaining:
                k, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield k, item
        finally:
            for task in tasks:
                task.cancel()

    async def _generate(
        self,
        ids: list[int],
        params: SamplingParams,
        prompt: str | None,
        arrival: float,
        request_id: str | None,
        mm_inputs: Any = None,
        admission: Admission | None = None,
        opts: RequestOptions | None = None,
    ) -> AsyncIterator[list[RequestOutput]]:
        """The engine's outputs for one prompt, in batches (all that arrived since the last wake-up);
        feeds TTFT / inter-token latency (per output with tokens) and the finish-reason counters."""
        metrics = self.ctx.metrics
        if self.ctx.log_requests:
            logger.info("request: %d prompt tokens, params=%s", len(ids), params)
        timing = RequestTiming(arrival, time.monotonic())
        last = first = None
        tokens = 0
        reasons: dict[int, str | None] = {}
        try:
            # Passed only when there is one: without a limit, any engine with `generate_batches` will do.
            extra: dict[str, Any] = {"admission": admission} if admission is not None else {}
            if opts is not None:
                extra.update(opts.engine_kwargs())
            async for batch in self.ctx.engine.generate_batches(
                ids, params, prompt, delta=True, request_id=request_id, mm_inputs=mm_inputs, **extra
            ):
                now = time.monotonic()
                for out in batch:
                    if out.finished:
                        timing.queue_time = out.queue_time
                    has_tokens = False
                    for c in out.outputs:
                        if c.token_ids:
                            has_tokens = True
                            tokens += len(c.token_ids)
                        if c.finish_reason is not None:
                            reasons[c.index] = c.finish_reason
                    if has_tokens:
                        if last is None:
                            metrics.ttft.observe(now - arrival)
                            first = now
                        else:
                            metrics.itl.observe(now - last)
                        last = now
                yield batch
        finally:
            timing.first, timing.last = first, last
            metrics.on_request_finished([reasons.get(i) for i in range(params.n)], params, timing, len(ids), tokens)


def admission_room(stats: EngineStats, limit: int, max_num_seqs: int | None, processes: int) -> int:
    """How many requests not yet in the core's last count (`AsyncEngine.num_unreported`: sent since, or
    about to be) this API process may hold. A request that takes a free seat runs at once, so it is not
    waiting: the room is the limit plus the seats the core's count leaves free (`free_seats`) minus what
    waits for them. The core's count is as of its last report, and it reports only between steps, so a
    burst cannot pass on a stale count: every unreported request takes room. With N API processes each
    knows only its own, so each may hold its share, 1/N rounded up: a burst spread over them overshoots
    by at most N - 1."""
    room = limit + free_seats(stats, max_num_seqs) - stats.num_waiting
    return -(-room // processes)


def _tool_choice_chunk(stream: ToolCallStream, c: CompletionOutput, chat_logprobs: Any, opts: RequestOptions) -> str:
    """One streamed choice of a request with tools: content the parser let through, tool-call deltas."""
    content, deltas = stream.feed(c.text, final=c.finish_reason is not None)
    tool_calls = [
        p.DeltaToolCall(
            index=d.index,
            id=d.id,
            type="function" if d.id is not None else None,
            function=p.DeltaFunctionCall(name=d.name, arguments=d.arguments),
        )
        for d in deltas
    ]
    reason = _reason(c)
    if reason == "stop" and stream.call_ids:
        reason = "tool_calls"
    lp = (
        p.ChatLogprobs(content=chat_logprobs(c.token_ids, c.logprobs, opts.tokens_as_ids))
        if c.logprobs is not None
        else None
    )
    return p.ChatStreamChoice(
        index=c.index,
        delta=p.ToolDeltaMessage(content=content if content or not tool_calls else None, tool_calls=tool_calls or None),
        logprobs=lp,
        finish_reason=reason,
        stop_reason=_stop(c),
        token_ids=list(c.token_ids) if opts.return_token_ids else None,
    ).model_dump_json()


def chat_echo(req: p.ChatCompletionRequest) -> str:
    """What vLLM's chat `echo` puts before the reply: the last message's text when that message has the
    reply's role (assistant; without a generation prompt, the last message's own role), else ""."""
    if not req.echo:
        return ""
    last = req.messages[-1]
    role = "assistant" if req.add_generation_prompt else last.role
    if last.role != role:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "".join(part.text for part in last.content or () if isinstance(part, p.TextPart))


def check_unicode(value: Any, param: str) -> None:
    """Text (or text nested in lists and objects) that is not valid Unicode is a 400: JSON's \\ud800
    escapes decode to lone surrogates, which have no UTF-8 form, so the tokenizer cannot take them."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                code = ord(value[exc.start])
                raise InvalidRequest(
                    f"{param} is not valid Unicode: a lone surrogate (\\u{code:04x}) at character "
                    f"{exc.start}; send text as UTF-8.",
                    param,
                ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, param)
            check_unicode(item, param)
    elif isinstance(value, (list, tuple)):
        for item in value:
            check_unicode(item, param)


def _clip(text: str, limit: int = 100) -> str:
    """A client-sent value quoted in an error message, cut short (a 1 MB model name is not echoed back)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _accumulators(count: int) -> tuple[list[list[str]], list[int], list[CompletionOutput | None], list[list]]:
    return [[] for _ in range(count)], [0] * count, [None] * count, [[] for _ in range(count)]


def _reason(c: CompletionOutput | None) -> str | None:
    if c is None:
        return None
    return "stop" if c.finish_reason == "abort" else c.finish_reason


def _stop(c: CompletionOutput | None) -> int | str | None:
    return None if c is None else c.stop_reason


def _bytes(text: str | None) -> list[int] | None:
    return list(text.encode("utf-8")) if text is not None else None


def _usage(prompt_tokens: int, completion_tokens: int) -> p.UsageInfo:
    return p.UsageInfo(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )
