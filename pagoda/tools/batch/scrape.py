"""The images of a web page: `<img>` (src, the largest `srcset` candidate, lazy `data-src`...), `<picture>`
sources, `og:image` / `twitter:image` meta and `<link rel=image_src>`.

Two stages. `extract_image_urls` is pure (HTML text in, ordered candidate URLs out): URLs are resolved
against `<base href>` or the page URL, normalised (fragment dropped, scheme/host lower-cased) and de-duplicated;
`data:` URIs, SVGs, non-http(s) URLs, tracking-pixel-looking URLs and images whose declared width/height is
below `min_side` are dropped. `scrape_page` fetches the page and the candidates (timeout + size cap), drops
what is not a decodable raster image or is smaller than `min_side` on either side, and removes duplicates by
content hash (the first occurrence in document order wins).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from html.parser import HTMLParser
from urllib.parse import urljoin, urlsplit

from pagoda.tools.batch import media
from pagoda.tools.batch.inputs import normalize_url

DEFAULT_MIN_SIDE = 32
MAX_PAGE_BYTES = 10 * 1024 * 1024

LAZY_SRC_ATTRS = (
    "data-src",
    "data-original",
    "data-lazy-src",
    "data-lazy",
    "data-url",
    "data-hi-res-src",
    "data-full-src",
)
LAZY_SRCSET_ATTRS = ("data-srcset", "data-lazy-srcset")
META_IMAGE_KEYS = ("og:image", "og:image:url", "og:image:secure_url", "twitter:image", "twitter:image:src")

# The file stem of a tracking pixel / spacer: /pixel.gif, /t/1x1.png, /img/spacer.gif, /beacon
_TRACKING_STEM = re.compile(
    r"^(pixel\d*|spacer|blank|beacon|tracking|tracker|track|1x1|transparent|clear|"
    r"trans|dot|empty)$",
    re.IGNORECASE,
)
_TRACKING_HOSTS = (
    "google-analytics.com",
    "doubleclick.net",
    "googletagmanager.com",
    "scorecardresearch.com",
    "quantserve.com",
    "bat.bing.com",
    "analytics.twitter.com",
    "ct.pinterest.com",
)


@dataclass
class Candidate:
    url: str  # absolute, normalised
    kind: str  # img | srcset | lazy | picture | meta | link
    declared: tuple[int | None, int | None] = (None, None)


@dataclass
class PageImage:
    url: str
    kind: str
    data: bytes
    sha256: str
    width: int
    height: int
    content_type: str


@dataclass
class ScrapeResult:
    page_url: str
    images: list[PageImage] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (url, reason)


# ---------------------------------------------------------------------------------------------- srcset


def parse_srcset(value: str) -> list[tuple[str, float | None, float | None]]:
    """`"a.jpg 480w, b.jpg 2x, c.jpg"` -> [(url, width descriptor, density descriptor)], in order.
    Follows the HTML algorithm closely enough: a URL is a run of non-space characters (commas inside it are
    kept, trailing commas end the candidate); descriptors run to the next comma outside parentheses."""
    out: list[tuple[str, float | None, float | None]] = []
    i, n = 0, len(value)
    while i < n:
        while i < n and (value[i].isspace() or value[i] == ","):
            i += 1
        if i >= n:
            break
        start = i
        while i < n and not value[i].isspace():
            i += 1
        url = value[start:i]
        descriptors = ""
        if url.endswith(","):
            url = url.rstrip(",")
        else:
            depth, start = 0, i
            while i < n:
                ch = value[i]
                if ch == "(":
                    depth += 1
                elif ch == ")":
                    depth = max(0, depth - 1)
                elif ch == "," and depth == 0:
                    break
                i += 1
            descriptors = value[start:i]
            i += 1
        if not url:
            continue
        w = x = None
        for token in descriptors.split():
            try:
                if token.endswith("w"):
                    w = float(token[:-1])
                elif token.endswith("x"):
                    x = float(token[:-1])
            except ValueError:
                pass
        out.append((url, w, x))
    return out


def largest_candidate(candidates: list[tuple[str, float | None, float | None]]) -> str | None:
    """The candidate with the largest width descriptor; without width descriptors the largest density
    (no descriptor = 1x). Ties keep the first."""
    if not candidates:
        return None
    if any(w is not None for _, w, _ in candidates):
        return max(candidates, key=lambda c: c[1] if c[1] is not None else -1.0)[0]
    return max(candidates, key=lambda c: c[2] if c[2] is not None else 1.0)[0]


# ---------------------------------------------------------------------------------------------- URLs


def skip_reason(url: str) -> str | None:
    """Why an absolute image URL is not worth fetching, or None."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return f"scheme {parts.scheme or 'none'}"
    if parts.path.lower().endswith((".svg", ".svgz")):
        return "svg"
    host = parts.netloc.lower().split(":")[0]
    if any(host == h or host.endswith("." + h) for h in _TRACKING_HOSTS) or host.startswith("pixel."):
        return "tracking host"
    if host.endswith("facebook.com") and parts.path.startswith("/tr"):
        return "tracking host"
    stem = parts.path.rstrip("/").rsplit("/", 1)[-1].split(".", 1)[0]
    if _TRACKING_STEM.match(stem):
        return "tracking-pixel name"
    return None


def _dimension(value: str | None) -> int | None:
    if not value:
        return None
    m = re.match(r"\s*(\d+)(px)?\s*$", value)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------------------------- parser


class _Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.base: str | None = None
        self.raw: list[tuple[str, str, tuple[int | None, int | None]]] = []  # (url as written, kind, declared)
        self._picture: list[tuple[str, float | None, float | None]] | None = None
        self._picture_img: tuple[str, str, tuple[int | None, int | None]] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k.lower(): (v or "") for k, v in attrs}
        if tag == "base" and a.get("href") and self.base is None:
            self.base = a["href"].strip()
        elif tag == "meta":
            key = (a.get("property") or a.get("name") or a.get("itemprop") or "").strip().lower()
            if key in META_IMAGE_KEYS and a.get("content"):
                self.raw.append((a["content"], "meta", (None, None)))
        elif tag == "link":
            rels = a.get("rel", "").lower().split()
            if "image_src" in rels and a.get("href"):
                self.raw.append((a["href"], "link", (None, None)))
        elif tag == "picture":
            self._flush_picture()
            self._picture = []
        elif tag == "source" and self._picture is not None:
            for attr in ("srcset", *LAZY_SRCSET_ATTRS):
                self._picture.extend(parse_srcset(a.get(attr, "")))
        elif tag == "img":
            self._img(a)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)

    def handle_endtag(self, tag: str) -> None:
        if tag == "picture":
            self._flush_picture()

    def close(self) -> None:
        super().close()
        self._flush_picture()

    def _img(self, a: dict[str, str]) -> None:
        declared = (_dimension(a.get("width")), _dimension(a.get("height")))
        srcset: list[tuple[str, float | None, float | None]] = []
        for attr in ("srcset", *LAZY_SRCSET_ATTRS):
            srcset.extend(c for c in parse_srcset(a.get(attr, "")) if not c[0].startswith("data:"))
        lazy = next((a[k].strip() for k in LAZY_SRC_ATTRS if a.get(k, "").strip()), "")
        src = a.get("src", "").strip()
        if srcset:
            # The largest candidate; a plain src/data-src counts as a 1x candidate of the same image.
            fallback = lazy or (src if src and not src.startswith("data:") else "")
            pool = srcset + ([(fallback, None, 1.0)] if fallback and not any(w for _, w, _ in srcset) else [])
            choice = (largest_candidate(pool) or "", "srcset")
        elif lazy:
            choice = (lazy, "lazy")
        else:
            choice = (src, "img")
        if self._picture is not None:
            self._picture_img = (choice[0], choice[1], declared)
            if srcset:
                self._picture.extend(srcset)
            return
        if choice[0]:
            self.raw.append((choice[0], choice[1], declared))

    def _flush_picture(self) -> None:
        if self._picture is None:
            return
        sources, img = self._picture, self._picture_img
        self._picture, self._picture_img = None, None
        declared = img[2] if img else (None, None)
        if any(w is not None for _, w, _ in sources):
            url = largest_candidate(sources)
        else:  # no width descriptors: the <img> is the portable choice
            url = img[0] if img and img[0] else largest_candidate(sources)
        if url:
            self.raw.append((url, "picture", declared))


def extract_image_urls(
    html: str, page_url: str, min_side: int = DEFAULT_MIN_SIDE, skipped: list[tuple[str, str]] | None = None
) -> list[Candidate]:
    """Candidate image URLs of a page, in document order, resolved, normalised, filtered and de-duplicated
    by URL. Reasons for dropped URLs are appended to `skipped` when given."""
    parser = _Collector()
    parser.feed(html)
    parser.close()
    base = urljoin(page_url, parser.base) if parser.base else page_url
    seen: set[str] = set()
    out: list[Candidate] = []
    for raw, kind, declared in parser.raw:
        raw = raw.strip()
        if not raw:
            continue
        if raw.startswith("data:"):
            if skipped is not None:
                skipped.append((raw[:40], "inline data: URI"))
            continue
        url = normalize_url(urljoin(base, raw))
        if url in seen:
            continue
        seen.add(url)
        reason = skip_reason(url)
        if reason is None and any(d is not None and d < min_side for d in declared):
            reason = f"declared size {declared[0]}x{declared[1]} below {min_side} px"
        if reason is not None:
            if skipped is not None:
                skipped.append((url, reason))
            continue
        out.append(Candidate(url, kind, declared))
    return out


def _charset(content_type: str) -> str:
    m = re.search(r"charset=([\w\-]+)", content_type or "", re.IGNORECASE)
    return m.group(1) if m else "utf-8"


def scrape_page(
    page_url: str,
    timeout: float = media.DEFAULT_FETCH_TIMEOUT_S,
    max_bytes: int = media.DEFAULT_MAX_IMAGE_BYTES,
    min_side: int = DEFAULT_MIN_SIDE,
    max_images: int | None = None,
    workers: int = 8,
    fetch: Callable[..., media.Fetched] = media.fetch,
) -> ScrapeResult:
    """Fetch `page_url` and its images. Raises MediaError when the page itself cannot be fetched."""
    page = fetch(
        page_url, timeout=timeout, max_bytes=MAX_PAGE_BYTES, accept="text/html,application/xhtml+xml;q=0.9,*/*;q=0.5"
    )
    ctype = page.content_type.lower()
    if ctype and "html" not in ctype and "xml" not in ctype and not ctype.startswith("text/"):
        raise media.MediaError("page_not_html", f"{page_url}: content-type {page.content_type!r} is not HTML")
    html = page.data.decode(_charset(page.content_type), errors="replace")
    result = ScrapeResult(page_url=page.url or page_url)
    candidates = extract_image_urls(html, result.page_url, min_side, result.skipped)

    def get(c: Candidate) -> media.Fetched | media.MediaError:
        try:
            return fetch(c.url, timeout=timeout, max_bytes=max_bytes)
        except media.MediaError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        fetched = list(pool.map(get, candidates))
    hashes: set[str] = set()
    for cand, got in zip(candidates, fetched):
        if isinstance(got, media.MediaError):
            result.skipped.append((cand.url, got.message))
            continue
        if "svg" in got.content_type.lower():
            result.skipped.append((cand.url, "svg"))
            continue
        try:
            _fmt, width, height = media.inspect(got.data, cand.url)
        except media.MediaError as exc:
            result.skipped.append((cand.url, exc.message))
            continue
        if width < min_side or height < min_side:
            result.skipped.append((cand.url, f"{width}x{height} below {min_side} px"))
            continue
        digest = hashlib.sha256(got.data).hexdigest()
        if digest in hashes:
            result.skipped.append((cand.url, "duplicate content"))
            continue
        hashes.add(digest)
        result.images.append(PageImage(cand.url, cand.kind, got.data, digest, width, height, got.content_type))
        if max_images is not None and len(result.images) >= max_images:
            break
    return result
