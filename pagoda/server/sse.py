"""Server-sent events: the framing of a streamed response (`data: …\n\n`, the `[DONE]` end marker, an error
event), the response that carries a stream, and the wait that cancels a request whose client went away."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pagoda.errors import PagodaError

logger = logging.getLogger("pagoda.server")
T = TypeVar("T")

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


def sse_data(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = sse_data("[DONE]")  # a stream's end marker (`sse_response` adds it unless the stream did)
SSE_DONE_BYTES = SSE_DONE.encode()


def sse_error(exc_message: str, error_type: str, code: int) -> str:
    return sse_data(json.dumps({"error": {"message": exc_message, "type": error_type, "param": None, "code": code}}))


def sse_response(events: AsyncIterator[str | bytes]) -> StreamingResponse:
    """Frame an event stream; errors mid-stream become one SSE error event. Client disconnects
    cancel the generator, whose cleanup aborts the engine request. The stream ends with the [DONE]
    event; a stream may write it itself with its last event (one write less per request)."""

    async def body() -> AsyncIterator[str | bytes]:
        last: str | bytes = ""
        try:
            async for event in events:
                last = event
                yield event
        except PagodaError as exc:
            yield sse_error(exc.message, exc.error_type, exc.http_status)
            last = ""
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the status line is already sent
            logger.exception("error while streaming")
            yield sse_error(f"Internal server error: {type(exc).__name__}", "InternalServerError", 500)
            last = ""
        if not (last.endswith(SSE_DONE_BYTES) if isinstance(last, bytes) else last.endswith(SSE_DONE)):
            yield SSE_DONE

    return _ClosingStreamingResponse(body(), events, media_type="text/event-stream", headers=STREAM_HEADERS)


class _ClosingStreamingResponse(StreamingResponse):
    """Closes the body and the event stream when the response ends however it ends, a client gone
    before the first event included: a stream that never started still holds its request's admission
    (`AsyncEngine.admit`), and left to the garbage collector (cycles through the cancellation's
    traceback; the serving process collects rarely) that room would stay taken long after the client left."""

    def __init__(self, body: AsyncIterator[str | bytes], events: AsyncIterator[str | bytes], **kwargs: Any):
        super().__init__(body, **kwargs)
        self._closing = (body, events)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._closing:
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    try:
                        await aclose()
                    except RuntimeError:  # still running in a task that is being cancelled: it ends there
                        pass


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T | Response:
    """Await `work`, cancelling it (which aborts the engine request) if the client goes away."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            # Nobody is listening; an empty 499 (nginx's "client closed request") instead of raising,
            # which uvicorn would log as an "Exception in ASGI application" traceback.
            return Response(status_code=499)
