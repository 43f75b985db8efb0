"""Request checks shared by the offline engine and the server (no heavy imports: the API process
uses them before anything reaches the engine core)."""

from __future__ import annotations

from pagoda.errors import ContextLengthExceeded, InvalidRequest
from pagoda.sampling_params import SamplingParams


def check_prompt_tokens(token_ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    """A prompt must have at least one token, every one inside the model's vocabulary; `param` is the
    request field the ids came in."""
    if not token_ids:
        raise InvalidRequest(f"The {param} is empty; send at least one token.", param)
    bad = next((i for i, t in enumerate(token_ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"Token id {token_ids[bad]} (position {bad}) is outside the model's vocabulary: ids "
            f"must be in [0, {vocab_size}).",
            param,
        )


def validate_request(
    prompt_token_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int, has_tokenizer: bool
) -> int:
    """Check a request against the model; returns the resolved max_tokens. Offline use clamps
    max_tokens to the room left in the context (the server checks the sum strictly first)."""
    check_prompt_tokens(prompt_token_ids, vocab_size)
    if len(prompt_token_ids) >= max_model_len:
        raise ContextLengthExceeded(
            f"The prompt (length {len(prompt_token_ids)}) is longer than the maximum model length of "
            f"{max_model_len}; shorten it or raise max_model_len.",
            "prompt",
        )
    if params.logprob_token_ids is not None and max(params.logprob_token_ids) >= vocab_size:
        raise InvalidRequest(
            f"logprob_token_ids has id {max(params.logprob_token_ids)}, outside the model's vocabulary "
            f"[0, {vocab_size}).",
            "logprob_token_ids",
        )
    if params.stop and not has_tokenizer:
        raise InvalidRequest("Stop strings need a tokenizer (skip_tokenizer_init=True); use stop_token_ids.", "stop")
    room = max_model_len - len(prompt_token_ids)
    return room if params.max_tokens is None else min(params.max_tokens, room)


def check_priority(priority: int, scheduling_policy: str, param: str = "priority") -> None:
    """A priority other than 0 needs the priority scheduling policy (vLLM refuses it too): under FCFS it
    would be accepted and have no effect."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidRequest(f"priority must be an integer, got {priority!r}.", param)
    if priority != 0 and scheduling_policy != "priority":
        raise InvalidRequest(
            f"priority {priority} needs a server started with --scheduling-policy priority (this one schedules "
            f"{scheduling_policy}); send 0 or leave it out.",
            param,
        )
