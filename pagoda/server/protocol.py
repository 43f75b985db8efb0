"""OpenAI-compatible request and response schemas (pydantic), plus vLLM's extra sampling fields.

Unknown request fields are accepted and ignored (as vLLM does), so clients that send newer OpenAI
fields keep working, except those that change the output in vLLM or OpenAI and that Pagoda does not
implement (`REFUSED_FIELDS`): those are a 400 naming the field, never silently dropped.

Field-level range checks live in `SamplingParams`; here only shapes, the cross-field rules that involve
OpenAI-only fields, and the bounds on list lengths and `n`: those are checked on the parsed JSON before
pydantic builds anything from it (a million tiny messages take ~10 s and ~800 MB to validate), so an
oversized field costs next to nothing.
"""

from __future__ import annotations

import time
import uuid
from json.encoder import encode_basestring as _json_str
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
)
from pydantic_core import PydanticCustomError

from pagoda.sampling_params import MAX_LOGPROB_TOKEN_IDS, MAX_N, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

MAX_MESSAGES = 2048  # OpenAI's cap on `messages`
MAX_CONTENT_PARTS = 4096  # content parts in all of a request's messages
MAX_PROMPTS = 2048  # prompts in one completion request (strings or token-id lists), times n


def _too_many(what: str, limit: int, got: int) -> PydanticCustomError:
    return PydanticCustomError(
        "too_many", "at most {limit} {what} are allowed, got {got}", {"limit": limit, "what": what, "got": got}
    )


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


# Fields that change what vLLM or OpenAI generate and that Pagoda does not implement, with the value
# that means "off" (sent with that value they are harmless): any other value is refused.
REFUSED_FIELDS: dict[str, Any] = {
    "logit_bias": {},
    "bad_words": [],
    "allowed_token_ids": None,
    "prompt_logprobs": None,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "truncate_prompt_tokens": None,
    "guided_whitespace_pattern": None,
    "logits_processors": None,
    "functions": None,
    "function_call": None,
    "prediction": None,
    "audio": None,
    "structural_tag": None,
    # vLLM's extras that Pagoda does not implement (a reasoning parser, RAG documents in the template,
    # disaggregated serving, prompt embeddings, custom extensions, per-request media IO options).
    "repetition_detection": None,
    "thinking_token_budget": None,
    "reasoning_effort": None,
    "include_reasoning": True,
    "documents": None,
    "media_io_kwargs": None,
    "vllm_xargs": None,
    "kv_transfer_params": None,
    "ec_transfer_params": None,
    "prompt_embeds": None,
    "truncation_side": None,  # only means something with truncate_prompt_tokens, refused above
}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` request field (its newer name for the guided_* fields)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    model: str | None = None
    n: int = Field(default=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # The response id is chatcmpl-/cmpl- and this (the X-Request-Id header wins, as in vLLM).
    request_id: str | None = Field(default=None, max_length=256)
    # Salts the prefix cache: requests share cached blocks only with requests of the same salt.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    return_token_ids: bool | None = None  # choices carry token_ids, the response prompt_token_ids
    return_tokens_as_token_ids: bool | None = None  # logprob tokens as "token_id:N"
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)  # lower first (--scheduling-policy priority)
    # These tokens' logprobs at each position instead of the top ones (needs logprobs).
    logprob_token_ids: list[int] | None = Field(default=None, min_length=1, max_length=MAX_LOGPROB_TOKEN_IDS)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _bounded_stop(cls, stop: Any) -> Any:
        items = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else ()
        if len(items) > MAX_STOP_STRINGS:
            raise _too_many("stop strings", MAX_STOP_STRINGS, len(items))
        longest = max((len(s) for s in items if isinstance(s, str)), default=0)
        if longest > MAX_STOP_CHARS:
            raise PydanticCustomError(
                "too_many",
                "stop strings must be at most {limit} characters long, got one of {got}",
                {"limit": MAX_STOP_CHARS, "got": longest},
            )
        return stop

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _bounded_stop_token_ids(cls, ids: Any) -> Any:
        if isinstance(ids, list) and len(ids) > MAX_STOP_TOKEN_IDS:
            raise _too_many("stop_token_ids", MAX_STOP_TOKEN_IDS, len(ids))
        return ids


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class OtherPart(BaseModel):
    """Any non-text content part (image_url, input_audio, video...): accepted by the schema, then
    rejected with a clear 400 by models that cannot take it."""

    model_config = ConfigDict(extra="allow")
    type: str


ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


MAX_TOOLS = 128  # OpenAI's cap on `tools`


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: ChatRole
    content: str | list[TextPart | OtherPart] | None = Field(default=None, validate_default=True)
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content_required(cls, content: Any, info: ValidationInfo) -> Any:
        # As OpenAI: only an assistant turn may come without content (one that made tool calls).
        role = info.data.get("role")
        if content is None and role is not None and role != "assistant":
            raise ValueError(f"a {role} message needs content (a string or a list of content parts)")
        return content


def _bounded_messages(messages: Any) -> Any:
    if isinstance(messages, list):
        if len(messages) > MAX_MESSAGES:
            raise _too_many("messages", MAX_MESSAGES, len(messages))
        parts = sum(len(m["content"]) for m in messages if type(m) is dict and type(m.get("content")) is list)
        if parts > MAX_CONTENT_PARTS:
            raise _too_many("content parts (in all messages)", MAX_CONTENT_PARTS, parts)
    return messages


Messages = Annotated[list[ChatMessage], BeforeValidator(_bounded_messages)]


class ChatCompletionRequest(_SamplingFields):
    messages: Messages = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: the reply starts with the last message's content when it has the reply's role.
    echo: bool = False
    # vLLM's default for chat: the template writes BOS and the like; true adds the tokenizer's own too.
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # per-request min_pixels / max_pixels (vision models)
    tools: list[ToolParam] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True


_TOKEN_IDS = TypeAdapter(list[int])


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _bounded_prompt(cls, prompt: Any, handler: Any) -> Any:
        if isinstance(prompt, list) and prompt:
            if type(prompt[0]) is int:
                # One prompt of token ids: validated as such, not tried against each shape of the union
                # first (much faster for a long prompt).
                try:
                    return _TOKEN_IDS.validate_python(prompt)
                except ValidationError:
                    pass
            elif len(prompt) > MAX_PROMPTS:
                raise _too_many("prompts", MAX_PROMPTS, len(prompt))
        return handler(prompt)


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    # As a chat request renders them (vLLM's /tokenize takes the same): to count or inspect a prompt with tools.
    tools: list[ToolParam] | None = Field(default=None, max_length=MAX_TOOLS)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter body (with --allow-runtime-lora-updating)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    # Replace an adapter served under this name with the folder's weights (a fresh checkpoint of the same
    # adapter): later requests get the new one, running ones finish with the old.
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/unload_lora_adapter body."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


# ---- responses ------------------------------------------------------------------------------
def make_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class _TokenIdsWhenAsked(BaseModel):
    """vLLM's `return_token_ids` fields are left out of the JSON unless the request asked for them (None),
    so every other response keeps its exact shape."""

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for key in ("token_ids", "prompt_token_ids"):
            if key in data and data[key] is None:
                del data[key]
        return data


class ChatChoice(_TokenIdsWhenAsked):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(_TokenIdsWhenAsked):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None  # return_token_ids


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ToolDeltaMessage(DeltaMessage):
    """A delta of a stream with tools (other streams' chunks keep DeltaMessage's exact shape)."""

    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_TokenIdsWhenAsked):
    index: int
    delta: DeltaMessage | ToolDeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's tokens


class ChatCompletionChunk(_TokenIdsWhenAsked):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on the first chunk only


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_TokenIdsWhenAsked):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # return_token_ids: the choice's prompt (streamed: in its first chunk) and its tokens (streamed: this chunk's)
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagoda"
    root: str
    parent: str | None = None
    max_model_len: int
    permission: list[dict[str, Any]] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- streamed chunks without pydantic -----------------------------------------------------------
# One chunk per engine step per stream is the API process's hottest path: building the pydantic
# models and serializing them cost more than everything else per token. These write the same JSON,
# byte for byte, as `CompletionResponse.model_dump_json(exclude_none=True)` and
# `ChatCompletionChunk.model_dump_json()` for choices without logprobs (json's C string escaper
# matches pydantic's output for every code point); a choice with logprobs, or a stop reason of an
# unexpected type, is serialized by its pydantic model and spliced in (`choice` returns None for those).


def _stop_json(stop: int | str | None) -> str | None:
    if stop is None:
        return "null"
    if type(stop) is str:
        return _json_str(stop)
    if type(stop) is int:
        return str(stop)
    return None


class CompletionChunkTemplate:
    """`CompletionResponse` chunks of one stream (exclude_none: unset reasons are left out)."""

    def __init__(self, chunk_id: str, created: int, model: str):
        self.head = (
            f'data: {{"id":{_json_str(chunk_id)},"object":"text_completion","created":{int(created)},'
            f'"model":{_json_str(model)},"choices":['
        )

    def choice(self, index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> str | None:
        body = f'{{"index":{index},"text":{_json_str(text)}'
        if finish_reason is not None:
            body += ',"finish_reason":' + _json_str(finish_reason)
        if stop_reason is not None:
            stop = _stop_json(stop_reason)
            if stop is None:
                return None
            body += ',"stop_reason":' + stop
        return body + "}"

    def event(self, choices: list[str]) -> str:
        """The SSE event ("data: ...\\n\\n") of a chunk with these serialized choices."""
        return self.head + ",".join(choices) + "]}\n\n"


class ChatChunkTemplate:
    """`ChatCompletionChunk`s of one stream (every field present, unset ones as null)."""

    def __init__(self, chunk_id: str, created: int, model: str):
        self.head = (
            f'data: {{"id":{_json_str(chunk_id)},"object":"chat.completion.chunk","created":{int(created)},'
            f'"model":{_json_str(model)},"choices":['
        )

    def choice(self, index: int, content: str, finish_reason: str | None, stop_reason: int | str | None) -> str | None:
        stop = _stop_json(stop_reason)
        if stop is None:
            return None
        reason = "null" if finish_reason is None else _json_str(finish_reason)
        return (
            f'{{"index":{index},"delta":{{"role":null,"content":{_json_str(content)}}},"logprobs":null,'
            f'"finish_reason":{reason},"stop_reason":{stop}}}'
        )

    def event(self, choices: list[str]) -> str:
        return self.head + ",".join(choices) + '],"usage":null}\n\n'
