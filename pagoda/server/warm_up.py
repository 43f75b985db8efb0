"""An API process's first chat prompt, prepared by the process itself before it takes connections.

Why: the first request an API process serves pays for work no later one does: the chat template's first
render, the image libraries' first decode, resize and patchify (modules imported on first use, numpy's and
PIL's first calls), the tokenizer's first encode, the first streamed response's task group. With
`--api-server-count 4` that is up to four requests per fresh server, enough to set a short point's TTFT p95.
Preparing one small chat prompt here (the work behind `/tokenize` of a chat: render, tokenize and, for a
vision-language model, decode, preprocess and expand one tiny image) moves that cost to startup, where the
process waits for nothing. It never reaches the engine, the metrics or the request log, and whatever fails
here (a model without a chat template, images refused by `--limit-mm-per-prompt`) is only logged: the
requests that would fail the same way are answered as usual.

The switch is `PAGODA_API_WARM_UP` (0: none); `benchmarks/profile/api_first_request.py` measures it.
"""

from __future__ import annotations

import base64
import io
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from pagoda.server import protocol as p

if TYPE_CHECKING:
    from pagoda.server.serving import OpenAIServing

logger = logging.getLogger(__name__)

WARM_IMAGE_SIDE = 56  # pixels: large enough to pass every resize step, small enough to cost ~nothing


def warm_up_messages(with_image: bool) -> list[dict[str, Any]]:
    """A one-message chat: a short text, and a tiny JPEG (the most common upload) where images are served."""
    content: list[dict[str, Any]] = [{"type": "text", "text": "What is in this picture?"}]
    if with_image:
        content.append({"type": "image_url", "image_url": {"url": _tiny_jpeg_uri()}})
    return [{"role": "user", "content": content}]


def _tiny_jpeg_uri() -> str:
    from PIL import Image

    buf = io.BytesIO()  # one flat colour: the decode, resize and patchify paths are the same as for any JPEG
    Image.new("RGB", (WARM_IMAGE_SIDE, WARM_IMAGE_SIDE), (128, 96, 64)).save(buf, format="JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


@dataclass(frozen=True)
class WarmUp:
    ms: float  # how long the prompt took to prepare
    prompt_tokens: int  # its tokens, the image's placeholders included


async def warm_up(serving: OpenAIServing) -> WarmUp | None:
    """Prepare one chat prompt through `serving`, as `/tokenize` of a chat does; None where it could not be (logged)."""
    if serving.ctx.tokenizer is None:
        return None
    start = time.perf_counter()
    try:
        # A streamed response runs in a task group (starlette's): the first one imports anyio's asyncio backend.
        async with anyio.create_task_group():
            pass
        request = p.TokenizeRequest.model_validate({"messages": warm_up_messages(serving.ctx.multimodal is not None)})
        _, token_ids, _ = await serving.tokenize_chat(request)
    except Exception as exc:  # noqa: BLE001 - a warm-up never stops a server; real requests report their own errors
        logger.debug("the API process's warm-up prompt was not prepared: %s", exc)
        return None
    return WarmUp((time.perf_counter() - start) * 1e3, len(token_ids))
