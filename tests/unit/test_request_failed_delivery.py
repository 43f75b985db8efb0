"""The API side of a request the engine ended with an error, and of a stream whose decoding raises
in the API process: that request (only) gets a `RequestFailed` — a 500 JSON body, or an SSE error
event followed by [DONE] when streaming — and the reader goes on for every other stream."""

from __future__ import annotations

import asyncio
import json

from pagoda.engine.async_engine import _deliverable, _Stream
from pagoda.engine.core_process import wire_output
from pagoda.errors import RequestFailed
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.server.sse import sse_response


def _wire(request_id: str, reason: str | None, stop=None, tokens=(5,)):
    return wire_output(
        RequestOutput(
            request_id, None, [1], [CompletionOutput(0, "", list(tokens), None, None, reason, stop)], reason is not None
        )
    )


class _BrokenTokenizer:
    def decode(self, ids, **kwargs):
        raise IndexError("piece id is out of range")

    def __len__(self):
        return 1000


def test_an_error_finish_becomes_request_failed():
    stream = _Stream(None, [1])
    item = _deliverable(_wire("r", "error", "Internal error while checking its stop conditions: KeyError."), stream)
    assert isinstance(item, RequestFailed) and "stop conditions" in item.message and item.http_status == 500
    ok = _deliverable(_wire("r", "length"), stream)
    assert isinstance(ok, RequestOutput) and ok.outputs[0].finish_reason == "length"


def test_a_stream_whose_decoding_raises_fails_alone():
    from pagoda.frontend.detokenizer import IncrementalDetokenizer

    broken, fine = _Stream(None, [1]), _Stream(None, [1])

    class _Tok:
        def decode(self, ids, **kwargs):
            return "".join(chr(97 + i % 26) for i in ids)

        def __len__(self):
            return 1000

    fine.detokenizers = [IncrementalDetokenizer(_Tok(), [1])]
    bad_detok = IncrementalDetokenizer(_Tok(), [1])
    bad_detok._tokenizer = _BrokenTokenizer()  # raises from the first output token on
    bad_detok._decode = bad_detok._decode_general
    broken.detokenizers = [bad_detok]
    assert isinstance(_deliverable(_wire("a", None, tokens=(3, 4)), broken), RequestFailed)
    out = _deliverable(_wire("b", "length", tokens=(3, 4)), fine)
    assert isinstance(out, RequestOutput) and out.outputs[0].text == "de"


def test_sse_stream_ends_with_the_error_event_and_done():
    async def events():
        yield 'data: {"choices": []}\n\n'
        raise RequestFailed("Internal error while processing its output: IndexError.")

    async def collect() -> str:
        response = sse_response(events())
        parts = [part async for part in response.body_iterator]
        return "".join(p.decode() if isinstance(p, bytes) else p for p in parts)

    body = asyncio.run(collect())
    frames = [f[6:] for f in body.split("\n\n") if f.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    error = json.loads(frames[-2])["error"]
    assert error["code"] == 500 and "processing its output" in error["message"]
