"""Loading images named by OpenAI content parts, safely.

A URL in a request is untrusted input that makes the *server* do work: fetch from the network,
read files, decode compressed pixels. So: private/internal addresses are refused unless the operator
allows them (SSRF; checked on every redirect hop), local files only under an operator-chosen
directory, bodies are size-capped while streaming, and the decoded pixel count is checked before
decompression (a tiny PNG can claim gigapixels). Every failure is an `InvalidRequest` (HTTP 400)
whose message starts with the content part's location, e.g. "messages[1].content[0]: ...".

Decoding runs in a worker thread so a large JPEG does not stall the event loop. Video files use the
same loading (`multimodal/video.py` decodes them).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import logging
import os
import re
import socket
import threading
import urllib.parse
import warnings
from dataclasses import dataclass
from io import BytesIO

import httpx
from PIL import Image, ImageOps, UnidentifiedImageError

from pagoda.config.multimodal import DEFAULT_MAX_VIDEO_SECONDS
from pagoda.errors import InvalidRequest
from pagoda.frontend.multimodal.image_processor import to_rgb

logger = logging.getLogger("pagoda.media")

MAX_REDIRECTS = 3
_PARAM = "messages"
# Image.open's bomb check reports through the (process-global) warnings filters; serialise the
# short header-parsing step that toggles them. Pixel decoding happens outside the lock.
_OPEN_LOCK = threading.Lock()


@dataclass(frozen=True)
class MediaPolicy:
    """Operator settings that bound what a request may make the server load."""

    allowed_local_media_path: str | None = None  # file:// allowed only below this directory
    allow_private_urls: bool = False  # allow loopback/private/link-local hosts
    fetch_timeout_s: float = 10.0  # whole fetch, all redirect hops included
    max_bytes: int = 20 * 2**20  # encoded image (or video file) size
    max_image_pixels: int = 64 * 2**20  # decoded width*height (decompression bomb guard)
    # Video files (multimodal/video.py): the longest duration, the most frames the file may hold (all
    # are demuxed, those up to the last sampled one decoded), the largest frame (4K UHD).
    max_video_seconds: float = DEFAULT_MAX_VIDEO_SECONDS
    max_video_frames: int = 36000  # 600 s at 60 fps
    max_video_frame_pixels: int = 3840 * 2160
    max_video_decode_s: float = 60.0  # wall time for demuxing + decoding one video file
    # The decoding a video may cost, known before it starts: the frames up to the last sampled one times
    # the frame size (2^33: ~1000 frames of 4K UHD, ~4000 of 1080p); and the CPU time decoding all of one
    # request's video files may take.
    max_video_decode_pixels: int = 2**33
    max_video_decode_cpu_s: float = 20.0


def _fail(where: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{where}: {message}", _PARAM)


def _short(url: str, limit: int = 120) -> str:
    """A URL fit for an error message (data URIs and huge URLs are cut)."""
    return url if len(url) <= limit else url[:limit] + "..."


# ----------------------------------------------------------------------------------------------
# Entry points


async def load_image(url: str, policy: MediaPolicy, where: str) -> Image.Image:
    """Fetch / decode the image behind `url` -> an RGB PIL image with EXIF orientation applied."""
    try:
        data = await _load_bytes(url, policy, where)
        return await asyncio.to_thread(decode_image, data, policy, where)
    except InvalidRequest:
        raise
    except Exception as e:  # the boundary: nothing raw reaches the server's 500 handler
        raise _fail(where, f"could not load the image: {type(e).__name__}: {e}") from e


async def load_video_frames(urls: list[str], policy: MediaPolicy, where: str) -> list[Image.Image]:
    """A video given as a list of frame images, loaded concurrently, in order."""
    if not isinstance(urls, list) or not urls:
        raise _fail(where, "a video given as frames needs a non-empty list of image URLs.")
    return list(await asyncio.gather(*(load_image(u, policy, f"{where}[frame {i}]") for i, u in enumerate(urls))))


async def _load_bytes(url: str, policy: MediaPolicy, where: str, kind: str = "image") -> bytes:
    """Dispatch on the URL scheme. `kind` ("image" | "video") is the data URI media type accepted
    and the word the error messages use."""
    if not isinstance(url, str) or not url.strip():
        raise _fail(where, f"the {kind} URL must be a non-empty string.")
    url = url.strip()
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":  # base64 of a 20 MB image takes tens of ms: keep it off the event loop
        return await asyncio.to_thread(_decode_data_uri, url, policy, where, kind)
    if scheme in ("http", "https"):
        return await _fetch_http(url, policy, where, kind)
    if scheme == "file":
        return await asyncio.to_thread(_read_local_file, url, policy, where)
    raise _fail(where, f"unsupported URL scheme {scheme!r}: use data:{kind}/...;base64, http(s):// or file://.")


# ----------------------------------------------------------------------------------------------
# data: URIs

_B64_STRIP = re.compile(r"\s+")


def _decode_data_uri(url: str, policy: MediaPolicy, where: str, kind: str = "image") -> bytes:
    """`data:image/png;base64,...` (also bare `data:image;base64,`) -> image bytes; with kind
    "video", `data:video/mp4;base64,...` -> the video file's bytes."""
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise _fail(where, "malformed data URI (no ',' after the media type).")
    params = [p.strip().lower() for p in header.split(";")]
    mime = params[0]
    if not (mime == kind or mime.startswith(f"{kind}/")):
        article = "an" if kind == "image" else "a"
        raise _fail(
            where, f"data URI media type {mime or '(none)'!r} is not {article} {kind}; use data:{kind}/...;base64,"
        )
    if "base64" not in params[1:]:
        raise _fail(where, f"only base64 data URIs are supported (data:{kind}/...;base64,...).")
    text = _B64_STRIP.sub("", payload)
    if len(text) * 3 // 4 > policy.max_bytes + 3:  # refuse before allocating the decoded copy
        raise _fail(where, f"{kind} data is over the limit of {policy.max_bytes} bytes.")
    return _b64decode(text, where)


def _b64decode(text: str, where: str) -> bytes:
    """Strict base64 (standard or URL-safe alphabet); missing '=' padding is tolerated."""
    if len(text) % 4 == 1:
        raise _fail(where, "invalid base64 in the data URI (bad length).")
    text += "=" * (-len(text) % 4)
    altchars = b"-_" if ("-" in text or "_" in text) else None
    try:
        data = base64.b64decode(text, altchars=altchars, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _fail(where, f"invalid base64 in the data URI ({e}).") from e
    if not data:
        raise _fail(where, "the data URI is empty.")
    return data


# ----------------------------------------------------------------------------------------------
# http(s)://


def is_private_address(address: str) -> bool:
    """True for any address a public-URL fetch must not reach (SSRF guard).

    Anything not globally routable counts: loopback, RFC 1918, link-local (cloud metadata at
    169.254.169.254), multicast, reserved, unspecified, CGNAT, and IPv4-mapped forms of those.
    """
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone id
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return (
        ip.is_loopback
        or ip.is_private
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
        or not ip.is_global
    )


async def _resolve_addresses(host: str, port: int) -> list[str]:
    """All addresses `host` resolves to (literal IPs resolve to themselves)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


async def check_public_host(url: httpx.URL, policy: MediaPolicy, where: str) -> None:
    """Refuse a URL whose host resolves to any private address, unless the operator allows it.

    Any rather than all: a name with one public and one private record must not let the client
    pick. (The HTTP client resolves again; a DNS-rebinding attacker could still race this.)
    """
    if url.scheme not in ("http", "https"):
        raise _fail(where, f"unsupported URL scheme {url.scheme!r} in {_short(str(url))}.")
    host = url.host
    if not host:
        raise _fail(where, f"URL has no host: {_short(str(url))}.")
    if policy.allow_private_urls:
        return
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        addresses = await _resolve_addresses(host, port)
    except (socket.gaierror, UnicodeError, OSError) as e:
        raise _fail(where, f"cannot resolve host {host!r}: {e}.") from e
    if not addresses:
        raise _fail(where, f"cannot resolve host {host!r}.")
    for address in addresses:
        if is_private_address(address):
            raise _fail(
                where,
                f"host {host!r} resolves to the non-public address {address}; fetching from "
                "private networks is refused (start the server with --allow-private-media-urls "
                "to allow it).",
            )


def _http_client(policy: MediaPolicy) -> httpx.AsyncClient:
    """The client for media fetches (a function so tests can swap the transport)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(policy.fetch_timeout_s),
        follow_redirects=False,
        headers={"Accept": "image/*, video/*", "Accept-Encoding": "identity"},
    )


async def _fetch_http(url: str, policy: MediaPolicy, where: str, kind: str = "image") -> bytes:
    """GET with a whole-fetch deadline; timeouts become 400s that say so."""
    try:
        return await asyncio.wait_for(_fetch_following_redirects(url, policy, where, kind), policy.fetch_timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException) as e:
        raise _fail(where, f"timed out after {policy.fetch_timeout_s:g} s fetching {_short(url)}.") from e
    except httpx.InvalidURL as e:
        raise _fail(where, f"invalid URL {_short(url)}: {e}.") from e
    except httpx.HTTPError as e:
        raise _fail(where, f"could not fetch {_short(url)}: {type(e).__name__}: {e}.") from e


async def _fetch_following_redirects(url: str, policy: MediaPolicy, where: str, kind: str = "image") -> bytes:
    """Follow up to MAX_REDIRECTS redirects by hand so that every hop passes the address check."""
    current = httpx.URL(url)
    async with _http_client(policy) as client:
        for _hop in range(MAX_REDIRECTS + 1):
            await check_public_host(current, policy, where)
            async with client.stream("GET", current) as response:
                if response.has_redirect_location and response.next_request is not None:
                    current = response.next_request.url
                    continue
                if not response.is_success:
                    raise _fail(where, f"fetching {_short(url)} failed with HTTP {response.status_code}.")
                return await _read_capped(response, policy, where, kind)
    raise _fail(where, f"too many redirects (more than {MAX_REDIRECTS}) fetching {_short(url)}.")


async def _read_capped(response: httpx.Response, policy: MediaPolicy, where: str, kind: str = "image") -> bytes:
    """The body, aborting as soon as it exceeds max_bytes (whatever Content-Length claims)."""
    too_big = f"the {kind} at {_short(str(response.url))} is over the limit of {policy.max_bytes} bytes."
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > policy.max_bytes:
        raise _fail(where, too_big)
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > policy.max_bytes:
            raise _fail(where, too_big)
    return bytes(body)


# ----------------------------------------------------------------------------------------------
# file://


def _read_local_file(url: str, policy: MediaPolicy, where: str) -> bytes:
    """A file:// URL, only when its real path (symlinks resolved) lies under the allowed root."""
    if policy.allowed_local_media_path is None:
        raise _fail(
            where,
            "file:// URLs are disabled; start the server with --allowed-local-media-path DIR "
            "to serve local files under DIR.",
        )
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise _fail(where, f"file:// URL with a remote host {parsed.netloc!r} is not supported.")
    path = urllib.parse.unquote(parsed.path)
    root = os.path.realpath(policy.allowed_local_media_path)
    real = os.path.realpath(path)
    if os.path.commonpath([real, root]) != root:
        raise _fail(where, f"{path} is outside the directory allowed by --allowed-local-media-path.")
    if not os.path.isfile(real):
        raise _fail(where, f"no such file: {path}.")
    with open(real, "rb") as f:
        data = f.read(policy.max_bytes + 1)
    if len(data) > policy.max_bytes:
        raise _fail(where, f"{path} is over the limit of {policy.max_bytes} bytes.")
    return data


# ----------------------------------------------------------------------------------------------
# Decoding


def decode_image(data: bytes, policy: MediaPolicy, where: str) -> Image.Image:
    """Encoded bytes -> RGB image, refusing bombs and truncated files, EXIF orientation applied."""
    image = _open_checked(data, policy, where)
    width, height = image.size
    if width * height > policy.max_image_pixels:
        raise _fail(
            where,
            f"image is {width}x{height} = {width * height} pixels, over the limit of {policy.max_image_pixels} pixels.",
        )
    try:
        image.load()  # decode now, so a truncated or corrupt file fails here, not in the engine
    except Image.DecompressionBombError as e:
        raise _bomb(where, policy, e) from e
    except Exception as e:
        raise _fail(where, f"the data is not a valid image or is truncated ({type(e).__name__}: {e}).") from e
    try:
        image = ImageOps.exif_transpose(image)
    except Exception as e:  # noqa: BLE001 - a malformed EXIF block should not cost the user their image
        logger.debug("%s: ignoring unreadable EXIF orientation: %s", where, e)
    return to_rgb(image)


def _open_checked(data: bytes, policy: MediaPolicy, where: str) -> Image.Image:
    """Image.open (header only) with PIL's own bomb warning turned into our error."""
    try:
        with _OPEN_LOCK, warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise _bomb(where, policy, e) from e
    except UnidentifiedImageError as e:
        raise _fail(where, "the data is not a valid image (unrecognised format).") from e
    except Exception as e:
        raise _fail(where, f"the data is not a valid image ({type(e).__name__}: {e}).") from e


def _bomb(where: str, policy: MediaPolicy, error: Exception) -> InvalidRequest:
    """PIL refused the size itself (its limit can sit below ours); report it like our own check."""
    found = re.search(r"\((\d+) pixels\)", str(error))
    size = f"{found.group(1)} pixels" if found else "too many pixels"
    pil_limit = re.search(r"limit of (\d+) pixels", str(error))
    limit = min(policy.max_image_pixels, int(pil_limit.group(1))) if pil_limit else policy.max_image_pixels
    return _fail(where, f"image is {size}, over the limit of {limit} pixels (decompression bomb guard).")
