"""Shard checksums for `pagoda doctor`: each weight file's sha256 against an expected one, where one is known.

Where an expected sha256 comes from, first found wins:
- `<file>.sha256` beside the file: the first word of its first line (`sha256sum`'s output or the bare digest);
- `SHA256SUMS` in the file's folder: `sha256sum`'s lines, `<digest>  <name>` (or `<digest> *<name>`);
- the Hugging Face hub cache: a snapshot's file is a symlink into `blobs/`, and a file stored with Git LFS
  (every weight shard) is named there by the sha256 of its content (64 hex digits; small files kept in git
  are named by a 40-digit git hash instead, which is not a sha256 and is not used).
A file with none of these is reported as not verifiable, never as verified.

Hashing reads every byte: about a minute per 100 GB on a fast disk, more on a network one. Progress goes to
stderr, one line at most every `PROGRESS_EVERY_S` seconds, so a long run is seen to move; the report itself
is `check_checksums`'s line. `pagoda serve`'s preflight never hashes (doctor's fast subset leaves this check out).
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from pagoda.tools.doctor.check import Check, State

SUMS_FILE = "SHA256SUMS"
PROGRESS_EVERY_S = 5.0
_CHUNK = 16 << 20
_SHA256 = re.compile(r"^[0-9a-fA-F]{64}$")


@dataclass
class Expected:
    digest: str  # lowercase hex
    source: str  # where it was found, for the report ("SHA256SUMS", "x.sha256", "the HF cache's blob name")


@dataclass
class Result:
    path: str
    expected: Expected | None
    actual: str | None = None  # None when not hashed (no expected digest)

    @property
    def ok(self) -> bool:
        return self.expected is not None and self.actual == self.expected.digest


def expected_sha256(path: str) -> Expected | None:
    """The sha256 `path` should have, if a sidecar file, a SHA256SUMS or the HF cache says so."""
    name, folder = os.path.basename(path), os.path.dirname(path)
    sidecar = path + ".sha256"
    if os.path.isfile(sidecar):
        with open(sidecar, encoding="utf-8", errors="replace") as f:
            words = f.readline().split()
        if words and _SHA256.match(words[0]):
            return Expected(words[0].lower(), os.path.basename(sidecar))
    sums = os.path.join(folder, SUMS_FILE)
    if os.path.isfile(sums):
        with open(sums, encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.strip().split(maxsplit=1)
                if len(parts) == 2 and _SHA256.match(parts[0]) and parts[1].lstrip("*") == name:
                    return Expected(parts[0].lower(), SUMS_FILE)
    if os.path.islink(path):
        target = os.path.realpath(path)
        blob = os.path.basename(target)
        if os.path.basename(os.path.dirname(target)) == "blobs" and _SHA256.match(blob):
            return Expected(blob.lower(), "the HF cache's blob name")
    return None


def sha256_file(path: str, on_bytes: Callable[[int], None] | None = None) -> str:
    """The file's sha256 (hex); `on_bytes(n)` after each chunk read."""
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            if on_bytes is not None:
                on_bytes(n)
    return digest.hexdigest()


class Progress:
    """`checksums: 12.0 of 140.3 GiB (9%), model-00003-of-00030.safetensors` on `stream`, at most once per
    `every_s` seconds (and nothing for a run shorter than that)."""

    def __init__(self, total_bytes: int, stream: TextIO | None = None, every_s: float = PROGRESS_EVERY_S):
        self.total, self.done, self.name = total_bytes, 0, ""
        self.stream, self.every_s = stream or sys.stderr, every_s
        self.last = time.monotonic()

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
            gib = 1 << 30
            print(
                f"checksums: {self.done / gib:.1f} of {self.total / gib:.1f} GiB{share}, {self.name}",
                file=self.stream,
                flush=True,
            )


def verify(paths: list[str], stream: TextIO | None = None, every_s: float = PROGRESS_EVERY_S) -> list[Result]:
    """Each file against its expected sha256; files with none are listed unhashed."""
    results = [Result(path, expected_sha256(path)) for path in paths]
    known = [r for r in results if r.expected is not None]
    progress = Progress(sum(os.path.getsize(r.path) for r in known), stream, every_s)
    for r in known:
        progress.name = os.path.basename(r.path)
        r.actual = sha256_file(r.path, progress)
    return results


def check_checksums(state: State) -> Check:
    """Each weight file's sha256 against the one SHA256SUMS, a `.sha256` or the HF cache gives (below)."""
    files = [p for p in state.weight_files if os.path.isfile(p) and p not in state.unreadable]
    results = verify(files)
    wrong = [r for r in results if r.expected is not None and not r.ok]
    verified = [r for r in results if r.ok]
    unknown = [os.path.basename(r.path) for r in results if r.expected is None]
    if wrong:
        lines = [
            f"{os.path.basename(r.path)} has sha256 {r.actual}, not {r.expected.digest} ({r.expected.source})"
            for r in wrong
            if r.expected is not None
        ]
        return Check(
            "checksums", "FAIL", "; ".join(lines), "re-download the file(s): the content is not what was published"
        )
    sources = sorted({r.expected.source for r in verified if r.expected is not None})
    parts = [f"{len(verified)} file(s) match their sha256 ({', '.join(sources)})"] if verified else []
    if unknown:
        parts.append(
            f"no expected sha256 known for {len(unknown)} file(s) (no {SUMS_FILE}, *.sha256 or HF cache "
            "blob): not verified"
        )
    return Check("checksums", "ok", "; ".join(parts), None)
