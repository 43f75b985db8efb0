"""HTTP routes: each parses, calls serving, responds."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import pagoda
from pagoda.errors import EngineDead, InvalidRequest
from pagoda.server import protocol as p
from pagoda.server.serving import OpenAIServing
from pagoda.server.sse import run_until_disconnect, sse_response

router = APIRouter()

# What /openapi.json documents for each route's errors: all of them in OpenAI's shape (`app.py` drops
# FastAPI's 422, which this server never answers: schema errors are 400 too).
_ERROR_DESCRIPTIONS = {
    400: "Invalid request: not JSON, a field of the wrong type, or a value out of range",
    401: "Missing or wrong API key (when the server runs with --api-key)",
    404: "The model named is not served here",
    503: "The engine is not running, or too many requests are waiting (with Retry-After)",
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": p.ErrorResponse, "description": _ERROR_DESCRIPTIONS[status]} for status in statuses}


_GENERATE_ERRORS = _errors(400, 401, 404, 503)
_TOKENIZER_ERRORS = _errors(400, 401, 404)


def _serving(request: Request) -> OpenAIServing:
    return request.app.state.serving


def _take_request_id(body: p.ChatCompletionRequest | p.CompletionRequest, request: Request) -> None:
    """The X-Request-Id header names the request ahead of the body's request_id (as in vLLM)."""
    header = request.headers.get("x-request-id")
    if header:
        if len(header) > 256:
            raise InvalidRequest("The X-Request-Id header is longer than 256 characters.", "request_id")
        body.request_id = header


@router.post("/v1/chat/completions", responses=_GENERATE_ERRORS)
async def chat_completions(body: p.ChatCompletionRequest, request: Request):
    serving, arrival = _serving(request), time.monotonic()
    _take_request_id(body, request)
    if body.stream:
        return sse_response(await serving.chat_stream(body, arrival))
    return await run_until_disconnect(request, serving.chat(body, arrival))


@router.post("/v1/completions", responses=_GENERATE_ERRORS)
async def completions(body: p.CompletionRequest, request: Request):
    serving, arrival = _serving(request), time.monotonic()
    _take_request_id(body, request)
    if body.stream:
        return sse_response(await serving.completion_stream(body, arrival))
    return await run_until_disconnect(request, serving.completion(body, arrival))


@router.get("/v1/models", responses=_errors(401, 503))
async def models(request: Request) -> p.ModelList:
    ctx = _serving(request).ctx
    if ctx.engine.is_dead:  # as /health: a load balancer listing models must not route here
        raise EngineDead(f"The engine is not running: {ctx.engine.dead_reason}")
    created = p.now()
    base = ctx.served_model_names[0]
    cards = [
        p.ModelCard(id=name, created=created, root=base, max_model_len=ctx.max_model_len)
        for name in ctx.served_model_names
    ]
    cards += [  # LoRA adapters, as vLLM lists them: their folder as root, as parent their base_model_name if
        # one was given (--lora-modules' JSON form), else the first served name
        p.ModelCard(
            id=name,
            created=created,
            root=lora.lora_path,
            parent=lora.base_model_name or base,
            max_model_len=ctx.max_model_len,
        )
        for name, lora in ctx.lora_modules.items()
    ]
    return p.ModelList(data=cards)


@router.post("/v1/load_lora_adapter", responses=_errors(400, 401, 404, 503))
async def load_lora_adapter(body: p.LoadLoRAAdapterRequest, request: Request) -> Response:
    return Response(
        await _serving(request).load_lora(body.lora_name, body.lora_path, body.load_inplace), media_type="text/plain"
    )


@router.post("/v1/unload_lora_adapter", responses=_errors(400, 401, 404))
async def unload_lora_adapter(body: p.UnloadLoRAAdapterRequest, request: Request) -> Response:
    return Response(await _serving(request).unload_lora(body.lora_name, body.lora_int_id), media_type="text/plain")


@router.get("/health", responses=_errors(503))
async def health(request: Request) -> Response:
    engine = _serving(request).ctx.engine
    if engine.is_dead:
        raise EngineDead(f"The engine is not running: {engine.dead_reason}")
    return Response(status_code=200)


@router.get("/ping")
async def ping(request: Request) -> Response:
    return await health(request)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": pagoda.__version__}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    ctx = _serving(request).ctx
    # Between the core's reports (a long step) the waiting gauge also counts what this process sent since.
    waiting = ctx.engine.waiting_estimate(max_num_seqs=ctx.max_num_seqs)
    return Response(ctx.metrics.render(waiting), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize", responses=_TOKENIZER_ERRORS)
async def tokenize(body: p.TokenizeRequest, request: Request) -> JSONResponse:
    serving = _serving(request)
    serving.check_model(body.model)
    if body.messages is not None:
        _, tokens, _ = await serving.tokenize_chat(body)
    elif body.prompt is not None:
        tokens = await serving.tokenize(body.prompt, body.add_special_tokens)
    else:
        raise InvalidRequest("Send either prompt or messages.", "prompt")
    return JSONResponse({"count": len(tokens), "max_model_len": serving.ctx.max_model_len, "tokens": tokens})


@router.post("/detokenize", responses=_TOKENIZER_ERRORS)
async def detokenize(body: p.DetokenizeRequest, request: Request) -> JSONResponse:
    serving = _serving(request)
    serving.check_model(body.model)
    if body.tokens:  # no ids decode to "" (as vLLM); only a prompt must have some
        serving.check_tokens(body.tokens, "tokens")
    return JSONResponse({"prompt": serving.decode(body.tokens)})
