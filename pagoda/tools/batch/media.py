"""Image bytes for batch requests: bounded HTTP fetch, type sniffing with Pillow, optional downscale, data URIs.

Everything here is blocking; the sender calls it through `asyncio.to_thread`, so fetching and encoding never
run on the event loop.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import time
from dataclasses import dataclass

import httpx

from pagoda.tools.batch.retry import RETRY_STATUSES

USER_AGENT = "pagoda-batch/0.1 (+https://github.com/pagoda)"
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_FETCH_TIMEOUT_S = 30.0
MAX_REDIRECTS = 5

# What servers decode everywhere; anything else Pillow can read is re-encoded as PNG before sending.
_PASS_THROUGH = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp", "GIF": "image/gif"}


class MediaError(Exception):
    """An image that could not be fetched or decoded. `retryable` follows the HTTP retry rules."""

    def __init__(self, code: str, message: str, retryable: bool = False, status: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable
        self.status = status
        self.headers: dict[str, str] = {}


@dataclass
class ImageData:
    data: bytes  # what is sent (original bytes, or the downscaled re-encoding)
    mime: str
    width: int  # of what is sent
    height: int
    sha256: str  # of the original bytes
    original_size: tuple[int, int] = (0, 0)
    original_bytes: int = 0

    def data_uri(self) -> str:
        return f"data:{self.mime};base64," + base64.b64encode(self.data).decode("ascii")


@dataclass
class Fetched:
    data: bytes
    content_type: str
    url: str  # after redirects


def fetch(
    url: str,
    timeout: float = DEFAULT_FETCH_TIMEOUT_S,
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    accept: str = "image/*,*/*;q=0.5",
) -> Fetched:
    """GET `url` with a timeout and a size cap (redirects followed, at most 5). Raises MediaError."""
    headers = {"User-Agent": USER_AGENT, "Accept": accept}
    deadline = time.monotonic() + timeout
    try:
        with (
            httpx.Client(
                timeout=httpx.Timeout(timeout), follow_redirects=True, max_redirects=MAX_REDIRECTS, headers=headers
            ) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                err = MediaError(
                    "fetch_http_error",
                    f"GET {url}: HTTP {response.status_code}",
                    retryable=response.status_code in RETRY_STATUSES or response.status_code >= 500,
                    status=response.status_code,
                )
                err.headers = {k.lower(): v for k, v in response.headers.items()}
                raise err
            declared = response.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > max_bytes:
                raise MediaError("fetch_too_large", f"GET {url}: {declared} bytes > cap {max_bytes}")
            chunks, total = [], 0
            for chunk in response.iter_bytes():
                if time.monotonic() > deadline:  # httpx's timeouts bound each read, not the whole body
                    raise httpx.ReadTimeout("total fetch time exceeded")
                total += len(chunk)
                if total > max_bytes:
                    raise MediaError("fetch_too_large", f"GET {url}: more than the cap of {max_bytes} bytes")
                chunks.append(chunk)
            return Fetched(b"".join(chunks), response.headers.get("content-type", ""), str(response.url))
    except (httpx.TooManyRedirects, httpx.UnsupportedProtocol) as exc:
        raise MediaError("fetch_error", f"GET {url}: {exc}") from None
    except httpx.TimeoutException:
        raise MediaError(
            "fetch_timeout", f"GET {url}: no complete response within {timeout:g} s", retryable=True
        ) from None
    except httpx.TransportError as exc:
        raise MediaError("fetch_connection_error", f"GET {url}: {type(exc).__name__}: {exc}", retryable=True) from None
    except httpx.InvalidURL as exc:
        raise MediaError("fetch_error", f"GET {url}: {exc}") from None


def read_file_bytes(path: str, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> bytes:
    try:
        size = os.path.getsize(path)
        if size > max_bytes:
            raise MediaError("image_too_large", f"{path}: {size} bytes > cap {max_bytes}")
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise MediaError("image_read_error", f"{path}: {exc}") from None


def inspect(data: bytes, where: str = "image") -> tuple[str, int, int]:
    """(Pillow format, width, height) of encoded bytes, or MediaError("image_decode_error")."""
    from PIL import Image, UnidentifiedImageError  # lazy: PIL, only for image items

    try:
        with Image.open(io.BytesIO(data)) as im:
            return str(im.format or ""), int(im.width), int(im.height)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise MediaError("image_decode_error", f"{where}: not a decodable image ({exc})") from None


def _scaled(width: int, height: int, max_pixels: int) -> tuple[int, int]:
    scale = (max_pixels / float(width * height)) ** 0.5
    w, h = max(1, int(width * scale)), max(1, int(height * scale))
    while w * h > max_pixels and (w > 1 or h > 1):  # rounding can leave it a pixel over
        if w >= h:
            w -= 1
        else:
            h -= 1
    return w, h


def prepare(data: bytes, max_pixels: int | None = None, where: str = "image") -> ImageData:
    """Check that `data` is an image; downscale it (keeping the aspect ratio) when it has more than
    `max_pixels` pixels; re-encode formats servers may not read (BMP, TIFF...) as PNG."""
    from PIL import Image  # lazy: PIL, only for image items

    fmt, width, height = inspect(data, where)
    digest = hashlib.sha256(data).hexdigest()
    too_big = bool(max_pixels) and width * height > int(max_pixels or 0)
    if fmt in _PASS_THROUGH and not too_big:
        return ImageData(data, _PASS_THROUGH[fmt], width, height, digest, (width, height), len(data))
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.seek(0)
            frame = im.copy()
    except (OSError, ValueError) as exc:
        raise MediaError("image_decode_error", f"{where}: {exc}") from None
    if too_big:
        frame = frame.resize(_scaled(width, height, int(max_pixels or 0)), Image.Resampling.LANCZOS)
    has_alpha = frame.mode in ("RGBA", "LA", "PA") or (frame.mode == "P" and "transparency" in frame.info)
    buf = io.BytesIO()
    if fmt == "JPEG" and not has_alpha:
        frame.convert("RGB").save(buf, format="JPEG", quality=90)
        mime = "image/jpeg"
    else:
        if frame.mode not in ("RGB", "RGBA", "L", "LA"):
            frame = frame.convert("RGBA" if has_alpha else "RGB")
        frame.save(buf, format="PNG")
        mime = "image/png"
    return ImageData(buf.getvalue(), mime, frame.width, frame.height, digest, (width, height), len(data))
