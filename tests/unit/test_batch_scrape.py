"""`pagoda batch --page`: image extraction from a static HTML string, and the fetch-stage filters with a fake
fetcher (no network)."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from pagoda.tools.batch import media
from pagoda.tools.batch.inputs import normalize_url
from pagoda.tools.batch.scrape import extract_image_urls, largest_candidate, parse_srcset, scrape_page

PAGE = "https://Example.com/blog/post.html"

HTML = """<!doctype html>
<html><head>
  <meta property="og:image" content="https://example.com/og/cover.jpg">
  <meta name="twitter:image" content="/og/cover.jpg#twitter">
  <title>Post</title>
</head><body>
  <img src="photos/a.jpg" alt="relative">
  <img src="/static/b.png" width="640" height="480">
  <img src="thumb-small.jpg" srcset="thumb-small.jpg 320w, thumb-large.jpg 1280w, thumb-mid.jpg 640w">
  <img srcset="retina.jpg 2x, normal.jpg">
  <img src="data:image/gif;base64,R0lGODlhAQABAAAAACw=" data-src="lazy/real.jpg" class="lazyload">
  <img data-original="lazy/original.webp">
  <picture>
    <source srcset="pic-800.webp 800w, pic-1600.webp 1600w" type="image/webp">
    <img src="pic.jpg">
  </picture>
  <img src="https://www.google-analytics.com/collect?v=1&amp;tid=x">
  <img src="/t/pixel.gif">
  <img src="/img/spacer.gif">
  <img src="icon-dot.png" width="1" height="1">
  <img src="icons/logo.svg">
  <img src="data:image/png;base64,iVBORw0KGgo=">
  <img src="photos/a.jpg">
  <img src="HTTPS://EXAMPLE.COM:443/blog/photos/a.jpg#again">
  <img src="//cdn.example.org/img/c.jpg?size=large&amp;v=2">
  <img src="">
</body></html>
"""


def urls(html: str = HTML, page: str = PAGE, **kw) -> list[str]:
    return [c.url for c in extract_image_urls(html, page, **kw)]


def test_extracts_resolves_and_filters() -> None:
    assert urls() == [
        "https://example.com/og/cover.jpg",  # og:image (twitter:image is the same URL)
        "https://example.com/blog/photos/a.jpg",  # relative to the page
        "https://example.com/static/b.png",  # root-relative
        "https://example.com/blog/thumb-large.jpg",  # largest srcset width
        "https://example.com/blog/retina.jpg",  # largest density
        "https://example.com/blog/lazy/real.jpg",  # data-src over a data: placeholder
        "https://example.com/blog/lazy/original.webp",  # data-original
        "https://example.com/blog/pic-1600.webp",  # <picture>: largest source
        "https://cdn.example.org/img/c.jpg?size=large&v=2",  # protocol-relative, entities decoded
    ]


def test_skipped_reasons() -> None:
    skipped: list[tuple[str, str]] = []
    extract_image_urls(HTML, PAGE, skipped=skipped)
    reasons = dict(skipped)
    assert reasons["https://www.google-analytics.com/collect?v=1&tid=x"] == "tracking host"
    assert reasons["https://example.com/t/pixel.gif"] == "tracking-pixel name"
    assert reasons["https://example.com/img/spacer.gif"] == "tracking-pixel name"
    assert "below 32 px" in reasons["https://example.com/blog/icon-dot.png"]
    assert reasons["https://example.com/blog/icons/logo.svg"] == "svg"
    assert any(reason == "inline data: URI" for _, reason in skipped)


def test_base_href_and_min_side() -> None:
    html = '<base href="/assets/v2/"><img src="x.png" width="20" height="20"><img src="y.png">'
    assert urls(html, "https://h.test/a/b.html") == ["https://h.test/assets/v2/y.png"]
    assert urls(html, "https://h.test/a/b.html", min_side=16) == [
        "https://h.test/assets/v2/x.png",
        "https://h.test/assets/v2/y.png",
    ]


def test_picture_without_width_descriptors_keeps_the_img() -> None:
    html = '<picture><source srcset="a.avif" type="image/avif"><img src="a.jpg"></picture>'
    assert urls(html, "https://h.test/") == ["https://h.test/a.jpg"]


def test_srcset_parsing() -> None:
    assert parse_srcset("a.jpg 480w, b.jpg 1080w") == [("a.jpg", 480.0, None), ("b.jpg", 1080.0, None)]
    assert parse_srcset(" a.jpg, b.jpg 2x ,  c.jpg 1.5x") == [
        ("a.jpg", None, None),
        ("b.jpg", None, 2.0),
        ("c.jpg", None, 1.5),
    ]
    assert parse_srcset("img.php?a=1,2 100w, z.jpg 50w")[0] == ("img.php?a=1,2", 100.0, None)  # comma in URL
    assert parse_srcset("a.jpg,b.jpg 2x") == [("a.jpg,b.jpg", None, 2.0)]  # the HTML rule: no space, one URL
    assert parse_srcset("x.jpg, ,y.jpg 10w,") == [("x.jpg", None, None), ("y.jpg", 10.0, None)]
    assert largest_candidate(parse_srcset("s.jpg 300w, l.jpg 900w, m.jpg 600w")) == "l.jpg"
    assert largest_candidate(parse_srcset("a.jpg, b.jpg 3x, c.jpg 2x")) == "b.jpg"
    assert largest_candidate([]) is None


def test_normalize_url() -> None:
    assert normalize_url("HTTP://Example.COM:80/a/b.png#frag") == "http://example.com/a/b.png"
    assert normalize_url("https://example.com") == "https://example.com/"
    assert normalize_url("https://example.com/x?q=1") == "https://example.com/x?q=1"


def _png(w: int, h: int, color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


def test_scrape_page_fetch_stage_filters_and_dedupes() -> None:
    big, other = _png(64, 48, (200, 10, 10)), _png(50, 50, (10, 200, 10))
    site = {
        "https://h.test/page": (
            "text/html; charset=utf-8",
            (
                b'<meta property="og:image" content="/og.png">'
                b'<img src="a.png"><img src="a-copy.png"><img src="tiny.png"><img src="broken.png">'
                b'<img src="missing.png"><img src="b.png"><img src="vector.png">'
            ),
        ),
        "https://h.test/og.png": ("image/png", other),
        "https://h.test/a.png": ("image/png", big),
        "https://h.test/a-copy.png": ("image/png", big),  # same bytes, other URL
        "https://h.test/tiny.png": ("image/png", _png(1, 1, (0, 0, 0))),
        "https://h.test/broken.png": ("image/png", b"not an image"),
        "https://h.test/b.png": ("image/png", _png(40, 40, (1, 2, 3))),
        "https://h.test/vector.png": ("image/svg+xml", b"<svg/>"),
    }
    calls: list[str] = []

    def fake_fetch(url: str, timeout: float, max_bytes: int, accept: str = "") -> media.Fetched:
        calls.append(url)
        if url not in site:
            raise media.MediaError("fetch_http_error", f"GET {url}: HTTP 404", status=404)
        ctype, data = site[url]
        return media.Fetched(data, ctype, url)

    result = scrape_page("https://h.test/page", fetch=fake_fetch)
    assert [i.url for i in result.images] == ["https://h.test/og.png", "https://h.test/a.png", "https://h.test/b.png"]
    assert [(i.width, i.height) for i in result.images] == [(50, 50), (64, 48), (40, 40)]
    reasons = dict(result.skipped)
    assert reasons["https://h.test/a-copy.png"] == "duplicate content"
    assert "below 32 px" in reasons["https://h.test/tiny.png"]
    assert "not a decodable image" in reasons["https://h.test/broken.png"]
    assert "404" in reasons["https://h.test/missing.png"]
    assert reasons["https://h.test/vector.png"] == "svg"
    assert calls[0] == "https://h.test/page"

    limited = scrape_page("https://h.test/page", fetch=fake_fetch, max_images=2)
    assert len(limited.images) == 2


def test_scrape_page_rejects_non_html() -> None:
    def fake_fetch(url: str, **kw) -> media.Fetched:
        return media.Fetched(b"{}", "application/json", url)

    with pytest.raises(media.MediaError, match="not HTML"):
        scrape_page("https://h.test/api", fetch=fake_fetch)
