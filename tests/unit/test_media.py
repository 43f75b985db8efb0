"""Loading images from content parts: data URIs, http(s) with the SSRF guard on every hop, file://
under the allowed root, and decoding that refuses bombs and truncated files. Every failure must be
a 400 whose message starts with the content part's location."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
from PIL import Image

from pagoda.errors import InvalidRequest
from pagoda.frontend.multimodal import media
from pagoda.frontend.multimodal.media import (
    MediaPolicy,
    check_public_host,
    is_private_address,
    load_image,
    load_video_frames,
)

WHERE = "messages[1].content[0]"


def _image(width: int = 32, height: int = 24, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _encode(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def _data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


PNG = _encode(_image())


def _load(url: str, policy: MediaPolicy | None = None) -> Image.Image:
    return asyncio.run(load_image(url, policy or MediaPolicy(), WHERE))


def _error(url: str, policy: MediaPolicy | None = None, match: str = "") -> InvalidRequest:
    """The 400 a URL must produce: message starts with the part's location and matches `match`."""
    with pytest.raises(InvalidRequest, match=match) as info:
        _load(url, policy)
    assert str(info.value).startswith(WHERE + ": ")
    assert info.value.param == "messages" and info.value.http_status == 400
    return info.value


def _png_claiming(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose IHDR (CRC fixed up) claims width x height."""
    data = bytearray(_encode(Image.new("RGB", (1, 1))))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


# ---------------------------------------------------------------------------------------------
# data: URIs and decoding


def test_data_uri_png_round_trip_is_pixel_exact():
    image = _load(_data_uri(PNG))
    assert image.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(image), np.asarray(_image()))


def test_data_uri_jpeg_and_bare_image_mime():
    image = _load(_data_uri(_encode(_image(), "JPEG"), "image/jpeg"))
    assert image.mode == "RGB" and image.size == (32, 24)
    assert _load(_data_uri(PNG, "image")).size == (32, 24)  # the Qwen README's form
    assert _load(_data_uri(PNG).rstrip("=")).size == (32, 24)  # missing padding tolerated


def test_rgba_is_composited_on_white():
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 0))  # fully transparent
    assert np.asarray(_load(_data_uri(_encode(rgba)))).min() == 255


def test_bad_data_uris():
    _error("data:image/png;base64,@@@not base64@@@", match="invalid base64")
    _error("data:image/png;base64,QUJD\x00", match="invalid base64")
    _error("data:image/png," + "x" * 10, match="only base64")
    _error(_data_uri(b"hello", "text/plain"), match="not an image")
    _error("data:image/png;base64", match="malformed")


def test_non_image_bytes():
    _error(_data_uri(b"this is plainly not an image" * 10), match="not a valid image")


def test_truncated_png():
    data = _encode(_image(64, 64))
    _error(_data_uri(data[: len(data) // 2]), match="not a valid image or is truncated")


def test_decompression_bombs():
    # Beyond PIL's own hard limit (it raises in Image.open).
    _error(_data_uri(_png_claiming(100_000, 100_000)), match="over the limit")
    # Between PIL's warning and error thresholds: the warning must not let it through.
    _error(_data_uri(_png_claiming(10_000, 10_000)), MediaPolicy(max_image_pixels=2**40), match="over the limit")
    # Our own limit, checked before decoding, names the size.
    _error(_data_uri(PNG), MediaPolicy(max_image_pixels=100), match=r"32x24 = 768 pixels, over the limit")


def test_exif_orientation_is_applied():
    image = _image(40, 20)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    loaded = _load(_data_uri(_encode(image, "JPEG", exif=exif.tobytes()), "image/jpeg"))
    assert loaded.size == (20, 40)


def test_max_bytes_for_data_uri():
    _error(_data_uri(PNG), MediaPolicy(max_bytes=100), match="over the limit of 100 bytes")


def test_unknown_schemes():
    _error("ftp://example.com/a.png", match="unsupported URL scheme 'ftp'")
    _error("s3://bucket/a.png", match="unsupported URL scheme")
    _error("just-a-name.png", match="unsupported URL scheme")
    _error("", match="non-empty")


# ---------------------------------------------------------------------------------------------
# http(s):// against a local server


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        try:
            self._route(self.path)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up first (size cap, timeout)

    def _route(self, path: str) -> None:
        if path == "/img.png":
            self._send(200, PNG)
        elif path == "/redirect":
            self._redirect("/img.png")
        elif path == "/loop":
            self._redirect("/loop")
        elif path == "/big":
            self._send(200, b"\0" * 5000)
        elif path == "/big-unsized":  # no Content-Length: must count while streaming
            self.send_response(200)
            self.end_headers()
            for _ in range(50):
                self.wfile.write(b"\0" * 100)
        elif path == "/slow":
            time.sleep(1.0)
            self._send(200, PNG)
        else:
            self._send(404, b"no")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def server_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


PRIVATE_OK = MediaPolicy(allow_private_urls=True)


def test_local_server_refused_by_default(server_url):
    _error(f"{server_url}/img.png", match="--allow-private-media-urls")


def test_http_fetch_when_private_urls_allowed(server_url):
    image = _load(f"{server_url}/img.png", PRIVATE_OK)
    np.testing.assert_array_equal(np.asarray(image), np.asarray(_image()))
    assert _load(f"{server_url}/redirect", PRIVATE_OK).size == (32, 24)


def test_http_failures(server_url):
    _error(f"{server_url}/missing", PRIVATE_OK, match="HTTP 404")
    small = MediaPolicy(allow_private_urls=True, max_bytes=1000)
    _error(f"{server_url}/big", small, match="over the limit of 1000 bytes")
    _error(f"{server_url}/big-unsized", small, match="over the limit of 1000 bytes")
    _error(f"{server_url}/loop", PRIVATE_OK, match="too many redirects")
    _error(f"{server_url}/slow", MediaPolicy(allow_private_urls=True, fetch_timeout_s=0.3), match="timed out")


def test_private_address_rule():
    for address in (
        "10.0.0.1",
        "169.254.1.1",
        "169.254.169.254",
        "::1",
        "127.0.0.1",
        "192.168.1.1",
        "0.0.0.0",
        "224.0.0.1",
        "100.64.0.1",
        "::ffff:127.0.0.1",
        "fe80::1%eth0",
        "fc00::1",
    ):
        assert is_private_address(address), address
    for address in ("8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"):
        assert not is_private_address(address), address


def test_host_check_on_literal_hosts():
    policy = MediaPolicy()

    async def check(url: str) -> None:
        await check_public_host(httpx.URL(url), policy, WHERE)

    for url in ("http://10.0.0.1/a.png", "http://169.254.1.1/", "http://[::1]:8080/x", "https://127.0.0.1/"):
        with pytest.raises(InvalidRequest, match="--allow-private-media-urls"):
            asyncio.run(check(url))
    asyncio.run(check("http://8.8.8.8/a.png"))  # public: passes (no connection made)
    asyncio.run(check_public_host(httpx.URL("http://10.0.0.1/"), PRIVATE_OK, WHERE))


def test_every_redirect_hop_is_checked(monkeypatch):
    """A public host that redirects to an internal one must not get the server to fetch it."""
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        if request.url.path == "/to-internal":
            return httpx.Response(302, headers={"Location": "http://127.0.0.1/secret"})
        if request.url.path == "/to-public":
            return httpx.Response(302, headers={"Location": "/img.png"})
        return httpx.Response(200, content=PNG)

    async def resolve(host: str, port: int) -> list[str]:
        return ["93.184.216.34"] if host == "public.example" else [host]

    monkeypatch.setattr(media, "_resolve_addresses", resolve)
    monkeypatch.setattr(media, "_http_client", lambda policy: httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    _error("http://public.example/to-internal", match="127.0.0.1.*--allow-private-media-urls")
    assert seen == ["http://public.example/to-internal"]  # the internal hop was never requested
    assert _load("http://public.example/to-public").size == (32, 24)


# ---------------------------------------------------------------------------------------------
# file://


def test_local_files(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a b.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    os.symlink(tmp_path / "secret.png", allowed / "link.png")
    policy = MediaPolicy(allowed_local_media_path=str(allowed))

    assert _load(f"file://{allowed}/a%20b.png", policy).size == (32, 24)
    _error(f"file://{tmp_path}/secret.png", policy, match="outside .*--allowed-local-media-path")
    _error(f"file://{allowed}/../secret.png", policy, match="outside")
    _error(f"file://{allowed}/link.png", policy, match="outside")  # symlinks resolved first
    _error(f"file://{allowed}/missing.png", policy, match="no such file")
    _error(f"file://{allowed}/a%20b.png", match="--allowed-local-media-path")  # disabled by default


# ---------------------------------------------------------------------------------------------
# Videos as frame lists


def test_video_frames():
    uris = [_data_uri(_encode(_image(seed=i))) for i in range(3)]
    frames = asyncio.run(load_video_frames(uris, MediaPolicy(), WHERE))
    assert [np.asarray(f).tolist() for f in frames] == [np.asarray(_image(seed=i)).tolist() for i in range(3)]
    with pytest.raises(InvalidRequest, match="non-empty"):
        asyncio.run(load_video_frames([], MediaPolicy(), WHERE))
    with pytest.raises(InvalidRequest) as info:
        asyncio.run(load_video_frames([uris[0], "data:image/png;base64,!!"], MediaPolicy(), WHERE))
    assert str(info.value).startswith(f"{WHERE}[frame 1]: ")
