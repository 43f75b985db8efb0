"""Result files: OpenAI Batch output lines, appended and flushed one per line, and what resume reads back.

Output line (success):  {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null,
                         "x_meta": {...}}
Errors line:            {"id", "custom_id", "response": {...} | null, "error": {"code", "message"}, "x_meta": {...}}

`x_meta` (extra, namespaced so other readers ignore it): attempts, latency_s, source, started_at/finished_at,
image facts, and for failures the history of attempts. A process killed mid-write can leave a partial last
line: readers skip it and `repair_tail` cuts it off before the file is appended to again.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

FSYNC_EVERY = 64
MAX_TEXT_BODY = 10_000


def new_row_id() -> str:
    return "batch_req_" + uuid.uuid4().hex


def response_block(status: int | None, request_id: str | None, body: Any) -> dict[str, Any] | None:
    if status is None:
        return None
    return {"status_code": status, "request_id": request_id, "body": body}


def success_row(custom_id: str, status: int, request_id: str | None, body: Any, meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": new_row_id(),
        "custom_id": custom_id,
        "response": response_block(status, request_id, body),
        "error": None,
        "x_meta": meta,
    }


def error_row(
    custom_id: str, status: int | None, request_id: str | None, body: Any, code: str, message: str, meta: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": new_row_id(),
        "custom_id": custom_id,
        "response": response_block(status, request_id, body),
        "error": {"code": code, "message": message},
        "x_meta": meta,
    }


def is_success(row: dict[str, Any]) -> bool:
    response = row.get("response")
    return (
        row.get("error") is None
        and isinstance(response, dict)
        and isinstance(response.get("status_code"), int)
        and 200 <= response["status_code"] < 300
    )


# ---------------------------------------------------------------------------------------------- reading


def iter_rows(path: str, problems: list[str] | None = None) -> Iterator[dict[str, Any]]:
    """The JSON objects of a JSONL file. A line that does not parse is skipped (and described in `problems`):
    at the end of the file that is the usual truncated last line of a killed run."""
    if not os.path.exists(path):
        return
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except ValueError:
            if problems is not None:
                last = lineno == len(lines) or (lineno == len(lines) - 1 and not lines[-1])
                problems.append(
                    f"{path}:{lineno}: "
                    + ("truncated last line ignored" if last and not data.endswith(b"\n") else "not JSON, ignored")
                )
            continue
        if isinstance(row, dict) and isinstance(row.get("custom_id"), str):
            yield row
        elif problems is not None:
            problems.append(f"{path}:{lineno}: not a batch result row, ignored")


def done_ids(path: str, problems: list[str] | None = None) -> set[str]:
    """custom_ids with a successful row in an output file."""
    return {row["custom_id"] for row in iter_rows(path, problems) if is_success(row)}


def repair_tail(path: str) -> str | None:
    """Make `path` end with a newline before appending: a partial last line (a run killed mid-write) is cut
    off; a complete JSON object that merely lacks its newline gets one. Returns what was done, or None."""
    if not os.path.exists(path):
        return None
    with open(path, "rb+") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size == 0:
            return None
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return None
        pos, tail = size, b""
        while pos > 0:  # find the start of the last line
            step = min(65536, pos)
            pos -= step
            f.seek(pos)
            tail = f.read(step) + tail
            nl = tail.rfind(b"\n")
            if nl >= 0:
                start = pos + nl + 1
                tail = tail[nl + 1 :]
                break
        else:
            start = 0
        try:
            complete = isinstance(json.loads(tail), dict)
        except ValueError:
            complete = False
        if complete:
            f.seek(size)
            f.write(b"\n")
            return f"{path}: added the missing newline after the last row"
        f.truncate(start)
        return f"{path}: removed a truncated last line ({size - start} bytes) left by an interrupted run"


def compact_errors(path: str, drop_ids: set[str]) -> dict[str, int]:
    """Rewrite the errors file without the rows of `drop_ids` (requests about to be retried, or that have
    since succeeded), so each custom_id has at most one row across the output and errors files. Returns
    the attempts already spent per dropped id (carried into the next row's x_meta.attempts_before)."""
    if not os.path.exists(path):
        return {}
    kept: list[bytes] = []
    spent: dict[str, int] = {}
    dropped = 0
    for row in iter_rows(path):
        cid = row["custom_id"]
        if cid in drop_ids:
            meta = row.get("x_meta") or {}
            spent[cid] = spent.get(cid, 0) + int(meta.get("attempts") or 0) + int(meta.get("attempts_before") or 0)
            dropped += 1
        else:
            kept.append(json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return spent


# ---------------------------------------------------------------------------------------------- writing


class JsonlWriter:
    """Append-only JSONL: one `write` call per row, flushed at once (a kill loses at most the row being
    written), fsync'd every FSYNC_EVERY rows and on close."""

    def __init__(self, path: str):
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        self.path = path
        self._f = open(path, "ab")  # noqa: SIM115 - held open for the whole run, closed by close()
        self._since_sync = 0
        self.rows = 0

    def write(self, row: dict[str, Any]) -> None:
        self._f.write(json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n")
        self._f.flush()
        self.rows += 1
        self._since_sync += 1
        if self._since_sync >= FSYNC_EVERY:
            os.fsync(self._f.fileno())
            self._since_sync = 0

    def close(self) -> None:
        if self._f.closed:
            return
        self._f.flush()
        try:
            os.fsync(self._f.fileno())
        except OSError:
            pass
        self._f.close()


def write_json(path: str, obj: Any) -> None:
    """Atomic write (temp file + rename)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, path)


def ordered_rows(custom_ids: list[str], output_path: str, errors_path: str) -> list[dict[str, Any] | None]:
    """For each id in input order: its success row, else its latest error row, else None (not run yet)."""
    best: dict[str, dict[str, Any]] = {}
    for row in iter_rows(errors_path):
        best[row["custom_id"]] = row
    for row in iter_rows(output_path):
        if is_success(row) or row["custom_id"] not in best:
            best[row["custom_id"]] = row
    return [best.get(cid) for cid in custom_ids]
