"""What a batch sends: the lines of an OpenAI Batch JSONL file, or one chat request per image (a folder, a file
of URLs, the images of web pages) with a prompt template.

Generated requests get a deterministic `custom_id`: a short hash of the image's identity (absolute path or
URL), the rendered prompt, the system message, the model and the sampling parameters. Rerunning the same
command therefore yields the same ids, which is what resume keys on.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import json
import os
import string
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urldefrag, urlsplit, urlunsplit

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff")
PROMPT_FIELDS = ("filename", "stem", "path", "url", "page")
DEFAULT_PROMPT = "Describe this image."
CHAT_PATH = "/v1/chat/completions"


class InputError(Exception):
    """A problem with the inputs or flags: reported as one line, exit status 2."""


@dataclass
class ImageRef:
    kind: str  # file | url | page
    location: str  # absolute file path, or the image URL
    page: str | None = None  # the page an image was scraped from
    data: bytes | None = None  # bytes already fetched (page scraping fetches to de-duplicate)
    sha256: str | None = None

    @property
    def identity(self) -> str:
        return ("file:" if self.kind == "file" else "url:") + self.location


@dataclass
class BatchItem:
    custom_id: str
    url: str  # endpoint path, e.g. /v1/chat/completions
    body: dict[str, Any]
    source: str  # input.jsonl:LINE, a file path or an image URL (x_meta.source)
    index: int = 0  # position in the input, for the ordered output
    image: ImageRef | None = None  # generated image requests: filled into the body at send time
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- JSONL


def load_batch_jsonl(path: str, model: str | None = None) -> list[BatchItem]:
    """Read an OpenAI Batch input file. `model`, when given, replaces every body's model. `stream` is
    dropped from bodies (a batch result is one JSON response). Raises InputError naming the line."""
    items: list[BatchItem] = []
    first_line: dict[str, int] = {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as exc:
        raise InputError(f"--input {path}: {exc.strerror or exc}") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise InputError(f"{where}: not JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise InputError(f"{where}: expected a JSON object")
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid:
            raise InputError(f"{where}: custom_id must be a non-empty string")
        if cid in first_line:
            raise InputError(f"{where}: duplicate custom_id {cid!r} (first on line {first_line[cid]})")
        first_line[cid] = lineno
        method = obj.get("method", "POST")
        if not isinstance(method, str) or method.upper() != "POST":
            raise InputError(f"{where}: method must be POST, got {method!r}")
        url = obj.get("url")
        if not isinstance(url, str) or not url.startswith("/"):
            raise InputError(f"{where}: url must be an endpoint path such as {CHAT_PATH!r}, got {url!r}")
        body = obj.get("body")
        if not isinstance(body, dict):
            raise InputError(f"{where}: body must be a JSON object")
        body = dict(body)
        body.pop("stream", None)
        body.pop("stream_options", None)
        if model is not None:
            body["model"] = model
        items.append(BatchItem(cid, url, body, where, index=len(items)))
    if not items:
        raise InputError(f"--input {path}: no requests in the file")
    return items


# ---------------------------------------------------------------------------------------------- sources


def list_images(spec: str, pattern: str | None = None, recursive: bool = True) -> list[str]:
    """Image files of a folder (recursive unless told otherwise; `pattern` is a glob on the path relative to
    the folder, or on the file name) or of a glob (`photos/**/*.jpg`). Sorted; hidden entries skipped."""
    if any(ch in spec for ch in "*?[") and not os.path.exists(spec):
        paths = [p for p in glob.glob(spec, recursive=True) if os.path.isfile(p)]
    elif os.path.isdir(spec):
        paths = []
        for root, dirs, files in os.walk(spec):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            if not recursive and os.path.abspath(root) != os.path.abspath(spec):
                continue
            for name in files:
                if name.startswith("."):
                    continue
                full = os.path.join(root, name)
                rel = os.path.relpath(full, spec)
                if pattern is not None:
                    if fnmatch.fnmatch(rel, pattern) or fnmatch.fnmatch(name, pattern):
                        paths.append(full)
                elif name.lower().endswith(IMAGE_EXTENSIONS):
                    paths.append(full)
            if not recursive:
                dirs[:] = []
    elif os.path.isfile(spec):
        paths = [spec]
    else:
        raise InputError(f"--images {spec}: no such folder, file or matching glob")
    return sorted(os.path.abspath(p) for p in paths)


def normalize_url(url: str) -> str:
    url = urldefrag(url.strip())[0]
    parts = urlsplit(url)
    netloc = parts.netloc.lower()
    if parts.scheme.lower() == "http" and netloc.endswith(":80"):
        netloc = netloc[:-3]
    elif parts.scheme.lower() == "https" and netloc.endswith(":443"):
        netloc = netloc[:-4]
    return urlunsplit((parts.scheme.lower(), netloc, parts.path or "/", parts.query, ""))


def read_url_list(path: str) -> list[str]:
    """One http(s) URL per line; blank lines and `#` comments skipped; repeats dropped (first kept)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as exc:
        raise InputError(f"--urls {path}: {exc.strerror or exc}") from None
    seen: set[str] = set()
    urls = []
    for lineno, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if urlsplit(text).scheme not in ("http", "https"):
            raise InputError(f"{path}:{lineno}: not an http(s) URL: {text[:200]!r}")
        key = normalize_url(text)
        if key not in seen:
            seen.add(key)
            urls.append(text)
    return urls


# ---------------------------------------------------------------------------------------------- requests


def check_template(template: str) -> None:
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise InputError(f"--prompt: bad template ({exc}); write literal braces as {{{{ and }}}}") from None
    for name in names:
        if name.split(".")[0].split("[")[0] not in PROMPT_FIELDS:
            raise InputError(
                f"--prompt: unknown placeholder {{{name}}}; known: " + ", ".join("{" + f + "}" for f in PROMPT_FIELDS)
            )


def prompt_fields(ref: ImageRef) -> dict[str, str]:
    if ref.kind == "file":
        name = os.path.basename(ref.location)
        return {
            "filename": name,
            "stem": os.path.splitext(name)[0],
            "path": ref.location,
            "url": "file://" + ref.location,
            "page": "",
        }
    path = unquote(urlsplit(ref.location).path)
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return {
        "filename": name,
        "stem": os.path.splitext(name)[0],
        "path": path,
        "url": ref.location,
        "page": ref.page or "",
    }


def render_prompt(template: str, ref: ImageRef) -> str:
    return template.format_map(prompt_fields(ref))


def make_custom_id(
    identity: str,
    prompt: str,
    system: str | None,
    model: str | None,
    params: dict[str, Any],
    max_pixels: int | None = None,
    detail: str | None = None,
) -> str:
    """`req-` + 20 hex digits of a SHA-256 over a canonical JSON of everything that defines the request.
    `detail` enters only when given, so the ids of runs without it stay what they were (resumable)."""
    fields: dict[str, Any] = {
        "source": identity,
        "prompt": prompt,
        "system": system,
        "model": model,
        "params": params,
        "max_pixels": max_pixels,
    }
    if detail is not None:
        fields["detail"] = detail
    key = json.dumps(
        fields,
        sort_keys=True,
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return "req-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:20]


def image_chat_body(
    model: str | None,
    prompt: str,
    system: str | None,
    params: dict[str, Any],
    image_url: str | None = None,
    detail: str | None = None,
) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": system})
    image: dict[str, Any] = {"url": image_url}
    if detail is not None:
        image["detail"] = detail
    messages.append(
        {"role": "user", "content": [{"type": "image_url", "image_url": image}, {"type": "text", "text": prompt}]}
    )
    body: dict[str, Any] = {"model": model, "messages": messages}
    body.update(params)
    return body


def set_image_url(body: dict[str, Any], url: str) -> dict[str, Any]:
    """A copy of a generated body with its image part pointing at `url` (a data URI or an http URL)."""
    messages = [dict(m) for m in body["messages"]]
    user = messages[-1]
    parts = [dict(p) for p in user["content"]]
    for part in parts:
        if part.get("type") == "image_url":
            part["image_url"] = {**part.get("image_url", {}), "url": url}
    user["content"] = parts
    return {**body, "messages": messages}


def build_image_items(
    refs: list[ImageRef],
    model: str | None,
    template: str,
    system: str | None,
    params: dict[str, Any],
    max_pixels: int | None = None,
    detail: str | None = None,
) -> list[BatchItem]:
    """One chat request per image; the same request twice (same id) is kept once."""
    check_template(template)
    items: list[BatchItem] = []
    seen: set[str] = set()
    for ref in refs:
        prompt = render_prompt(template, ref)
        cid = make_custom_id(ref.identity, prompt, system, model, params, max_pixels, detail)
        if cid in seen:
            continue
        seen.add(cid)
        items.append(
            BatchItem(
                cid,
                CHAT_PATH,
                image_chat_body(model, prompt, system, params, detail=detail),
                ref.location,
                index=len(items),
                image=ref,
            )
        )
    return items
