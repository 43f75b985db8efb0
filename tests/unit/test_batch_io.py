"""`pagoda batch` inputs and files: JSONL validation, image sources, deterministic ids, resume parsing
(truncated last line), error-file compaction, the ordered array, and image downscaling."""

from __future__ import annotations

import base64
import hashlib
import io
import json
from pathlib import Path

import pytest
from PIL import Image

from pagoda.tools.batch import inputs, media, output
from pagoda.tools.batch.inputs import ImageRef, InputError


def write_lines(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def line(cid: str, **body) -> dict:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": cid}], **body},
    }


# ---------------------------------------------------------------------------------------------- JSONL input


def test_load_batch_jsonl(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "in.jsonl", [line("a", stream=True, stream_options={"include_usage": True}), "", line("b")]
    )
    items = inputs.load_batch_jsonl(str(path))
    assert [(i.custom_id, i.index, i.source) for i in items] == [("a", 0, f"{path}:1"), ("b", 1, f"{path}:3")]
    assert "stream" not in items[0].body and "stream_options" not in items[0].body
    assert items[0].body["model"] == "m"
    assert inputs.load_batch_jsonl(str(path), model="other")[1].body["model"] == "other"


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "in.jsonl:2: not JSON"),
        ('["a"]', "in.jsonl:2: expected a JSON object"),
        (json.dumps({"method": "POST", "url": "/v1/x", "body": {}}), "custom_id must be a non-empty string"),
        (json.dumps({**line("z"), "method": "GET"}), "method must be POST"),
        (json.dumps({**line("z"), "url": "chat"}), "url must be an endpoint path"),
        (json.dumps({**line("z"), "body": []}), "body must be a JSON object"),
        (json.dumps(line("a")), "in.jsonl:2: duplicate custom_id 'a' (first on line 1)"),
    ],
)
def test_load_batch_jsonl_errors_name_the_line(tmp_path: Path, bad: str, message: str) -> None:
    path = write_lines(tmp_path / "in.jsonl", [line("a"), bad])
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        inputs.load_batch_jsonl(str(path))


def test_load_batch_jsonl_empty_or_missing(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(InputError, match="no requests"):
        inputs.load_batch_jsonl(str(tmp_path / "empty.jsonl"))
    with pytest.raises(InputError, match="No such file"):
        inputs.load_batch_jsonl(str(tmp_path / "nope.jsonl"))


# ---------------------------------------------------------------------------------------------- image sources


def png_bytes(w: int, h: int, color=(10, 20, 30), mode: str = "RGB", fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (w, h), color).save(buf, format=fmt)
    return buf.getvalue()


def test_list_images_recursive_glob_and_hidden(tmp_path: Path) -> None:
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / ".hidden").mkdir()
    for rel in ("b.png", "a.JPG", "notes.txt", "sub/c.webp", "sub/deeper/d.png", ".hidden/e.png", ".f.png"):
        (tmp_path / rel).write_bytes(b"x")
    root = str(tmp_path)

    def names(paths):
        return [str(Path(p).relative_to(tmp_path)) for p in paths]

    assert names(inputs.list_images(root)) == ["a.JPG", "b.png", "sub/c.webp", "sub/deeper/d.png"]
    assert names(inputs.list_images(root, recursive=False)) == ["a.JPG", "b.png"]
    assert names(inputs.list_images(root, pattern="*.png")) == ["b.png", "sub/deeper/d.png"]
    assert names(inputs.list_images(root, pattern="sub/*")) == ["sub/c.webp", "sub/deeper/d.png"]
    assert names(inputs.list_images(f"{root}/**/*.png")) == ["b.png", "sub/deeper/d.png"]
    with pytest.raises(InputError, match="no such folder"):
        inputs.list_images(str(tmp_path / "missing"))


def test_read_url_list(tmp_path: Path) -> None:
    path = tmp_path / "urls.txt"
    path.write_text("# images\nhttps://h.test/a.jpg\n\nhttps://H.TEST/a.jpg#x\nhttp://h.test/b.png  \n")
    assert inputs.read_url_list(str(path)) == ["https://h.test/a.jpg", "http://h.test/b.png"]
    path.write_text("https://h.test/a.jpg\nftp://h.test/b.png\n")
    with pytest.raises(InputError, match="urls.txt:2: not an http"):
        inputs.read_url_list(str(path))


def test_prompt_template() -> None:
    ref = ImageRef("url", "https://h.test/dir/My%20Cat.jpg?s=1", page="https://h.test/p")
    assert (
        inputs.render_prompt("Describe {filename} ({stem}) from {page}", ref)
        == "Describe My Cat.jpg (My Cat) from https://h.test/p"
    )
    fref = ImageRef("file", "/data/imgs/x.png")
    assert (
        inputs.render_prompt("{path} {url} {{literal}}", fref) == "/data/imgs/x.png file:///data/imgs/x.png {literal}"
    )
    with pytest.raises(InputError, match="unknown placeholder {name}"):
        inputs.check_template("Describe {name}")
    with pytest.raises(InputError, match="bad template"):
        inputs.check_template("Describe {filename")


def test_custom_ids_are_deterministic_and_sensitive() -> None:
    base = {"identity": "file:/a.png", "prompt": "Describe", "system": None, "model": "m", "params": {"max_tokens": 8}}
    cid = inputs.make_custom_id(**base)
    assert cid == inputs.make_custom_id(**base)
    assert cid.startswith("req-") and len(cid) == 24
    assert cid == inputs.make_custom_id(**{**base, "params": {"max_tokens": 8}})  # key order irrelevant
    variants = [
        {"identity": "file:/b.png"},
        {"prompt": "Describe!"},
        {"system": "be brief"},
        {"model": "n"},
        {"params": {"max_tokens": 9}},
        {"params": {"max_tokens": 8, "temperature": 0.0}},
    ]
    ids = {inputs.make_custom_id(**{**base, **v}) for v in variants}
    assert cid not in ids and len(ids) == len(variants)
    assert inputs.make_custom_id(**base, max_pixels=1000) != cid
    assert len({cid, *(inputs.make_custom_id(**base, detail=d) for d in ("auto", "low", "high"))}) == 4
    # A run without --detail keeps the ids earlier versions wrote (its output files resume): the canonical JSON
    # of the fields as they were.
    canonical = {"source": "file:/a.png", "prompt": "Describe", "system": None, "model": "m"}
    canonical |= {"params": {"max_tokens": 8}, "max_pixels": None}
    text = json.dumps(canonical, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    assert cid == "req-" + hashlib.sha256(text.encode()).hexdigest()[:20]


def test_build_image_items(tmp_path: Path) -> None:
    refs = [ImageRef("file", "/x/a.png"), ImageRef("url", "https://h.test/b.jpg"), ImageRef("file", "/x/a.png")]
    items = inputs.build_image_items(refs, "m", "Describe {filename}", "sys", {"max_tokens": 4})
    assert len(items) == 2  # the same request twice is kept once
    again = inputs.build_image_items(refs, "m", "Describe {filename}", "sys", {"max_tokens": 4})
    assert [i.custom_id for i in items] == [i.custom_id for i in again]
    body = items[1].body
    assert body["model"] == "m" and body["max_tokens"] == 4
    assert body["messages"][0] == {"role": "system", "content": "sys"}
    assert body["messages"][1]["content"][1] == {"type": "text", "text": "Describe b.jpg"}
    filled = inputs.set_image_url(body, "data:image/png;base64,AAAA")
    assert filled["messages"][1]["content"][0] == {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64,AAAA"},
    }
    assert body["messages"][1]["content"][0]["image_url"]["url"] is None  # the template body is untouched
    low = inputs.build_image_items(refs, "m", "Describe {filename}", "sys", {"max_tokens": 4}, detail="low")
    assert {i.custom_id for i in low}.isdisjoint(i.custom_id for i in items)
    filled = inputs.set_image_url(low[1].body, "data:image/png;base64,AAAA")
    assert filled["messages"][1]["content"][0]["image_url"] == {"url": "data:image/png;base64,AAAA", "detail": "low"}


# ---------------------------------------------------------------------------------------------- resume files


def ok_row(cid: str) -> dict:
    return output.success_row(cid, 200, "req_1", {"choices": []}, {"attempts": 1})


def err_row(cid: str, attempts: int = 1) -> dict:
    return output.error_row(cid, 503, None, "busy", "http_503", "HTTP 503: busy", {"attempts": attempts})


def test_truncated_last_line_is_tolerated_and_repaired(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    good = "".join(json.dumps(ok_row(c)) + "\n" for c in ("a", "b"))
    partial = json.dumps(ok_row("c"))[:37]
    path.write_text(good + partial)
    problems: list[str] = []
    assert output.done_ids(str(path), problems) == {"a", "b"}
    assert problems and "truncated last line" in problems[0]
    note = output.repair_tail(str(path))
    assert note and "truncated" in note
    assert path.read_text() == good
    assert output.repair_tail(str(path)) is None
    writer = output.JsonlWriter(str(path))
    writer.write(ok_row("c"))
    writer.close()
    assert [json.loads(x)["custom_id"] for x in path.read_text().splitlines()] == ["a", "b", "c"]


def test_repair_keeps_a_complete_row_without_newline(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text(json.dumps(ok_row("a")) + "\n" + json.dumps(ok_row("b")))
    assert "newline" in (output.repair_tail(str(path)) or "")
    assert output.done_ids(str(path)) == {"a", "b"} and path.read_text().endswith("\n")
    single = tmp_path / "one.jsonl"
    single.write_text('{"custom_id": "x", "respo')
    output.repair_tail(str(single))
    assert single.read_text() == ""


def test_done_ids_only_counts_successes_and_skips_bad_lines(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "out.jsonl",
        [
            ok_row("a"),
            "garbage",
            err_row("b"),
            {**ok_row("c"), "response": {"status_code": 500, "body": None}},
            {"no": "id"},
        ],
    )
    problems: list[str] = []
    assert output.done_ids(str(path), problems) == {"a"}
    assert any("out.jsonl:2: not JSON" in p for p in problems) and any("not a batch result row" in p for p in problems)
    assert output.done_ids(str(tmp_path / "absent.jsonl")) == set()


def test_compact_errors_keeps_one_row_per_id(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "errors.jsonl",
        [err_row("a", 3), err_row("other", 1), {**err_row("b", 2), "x_meta": {"attempts": 2, "attempts_before": 4}}],
    )
    spent = output.compact_errors(str(path), {"a", "b", "c"})
    assert spent == {"a": 3, "b": 6}
    assert [r["custom_id"] for r in output.iter_rows(str(path))] == ["other"]
    assert output.compact_errors(str(tmp_path / "absent.jsonl"), {"a"}) == {}


def test_ordered_rows(tmp_path: Path) -> None:
    out = write_lines(tmp_path / "out.jsonl", [ok_row("b")])
    err = write_lines(tmp_path / "err.jsonl", [err_row("a"), err_row("b")])
    rows = output.ordered_rows(["a", "b", "c"], str(out), str(err))
    assert rows[0]["error"]["code"] == "http_503"
    assert rows[1]["error"] is None and rows[1]["response"]["status_code"] == 200
    assert rows[2] is None


def test_row_shapes() -> None:
    row = ok_row("a")
    assert set(row) == {"id", "custom_id", "response", "error", "x_meta"} and row["id"].startswith("batch_req_")
    assert row["response"] == {"status_code": 200, "request_id": "req_1", "body": {"choices": []}}
    assert output.is_success(row)
    failed = output.error_row("a", None, None, None, "timeout", "no response", {})
    assert failed["response"] is None and failed["error"] == {"code": "timeout", "message": "no response"}
    assert not output.is_success(failed)


# ---------------------------------------------------------------------------------------------- media


def test_prepare_passes_through_and_downscales() -> None:
    data = png_bytes(300, 200)
    img = media.prepare(data)
    assert (img.mime, img.width, img.height, img.data) == ("image/png", 300, 200, data)
    assert img.data_uri().startswith("data:image/png;base64,")
    small = media.prepare(data, max_pixels=6000)
    assert small.width * small.height <= 6000 and small.original_size == (300, 200)
    assert abs(small.width / small.height - 1.5) < 0.05
    assert small.sha256 == img.sha256  # the hash is of the original bytes
    decoded = Image.open(io.BytesIO(base64.b64decode(small.data_uri().split(",", 1)[1])))
    assert decoded.size == (small.width, small.height)
    jpeg = media.prepare(png_bytes(400, 400, fmt="JPEG"), max_pixels=10_000)
    assert jpeg.mime == "image/jpeg" and jpeg.width == jpeg.height == 100
    bmp = media.prepare(png_bytes(10, 10, fmt="BMP"))
    assert bmp.mime == "image/png"  # re-encoded: not every server reads BMP
    with pytest.raises(media.MediaError, match="not a decodable image"):
        media.prepare(b"hello")
