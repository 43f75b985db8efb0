"""The repository explains itself: no comment, docstring or doc cites a design note a clone lacks.

Every tracked .py and .md file under pagoda/, tests/, docs/, benchmarks/ (results/ excepted: data)
and README.md is scanned for citations of the private design notes: their folder, "spec <name>.md",
"research/<name>.md" and numbered sections of them (a section sign followed by a digit). A fact the
code relies on belongs in the comment itself or in docs/ (docs/models.md, docs/tools.md), cited by
file and section title. The patterns are assembled so that this file does not match them itself.

The tracked files are what `git ls-files` lists, read here from git's index file (versions 2 to 4)
rather than by running git: tests in tests/unit start no process.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
SCOPE = ("pagoda", "tests", "docs", "benchmarks", "README.md")
EXCLUDED = ("benchmarks/results/",)
OUTSIDE = re.compile(
    "|".join(
        (
            "shared" + "/specs",  # the design notes' folder
            r"\bspec [\w.-]+\.md",  # "spec <name>.md"
            r"\bresearch/[\w.-]+\.md",  # "research/<name>.md"
            "\u00a7" + r"\s?\d",  # a numbered section of a note
        )
    )
)


def _git_index() -> Path | None:
    dot_git = ROOT / ".git"
    if dot_git.is_file():  # a worktree or submodule: "gitdir: <path>"
        text = dot_git.read_text(encoding="utf-8").strip()
        if not text.startswith("gitdir:"):
            return None
        git_dir = Path(text[len("gitdir:") :].strip())
        dot_git = git_dir if git_dir.is_absolute() else ROOT / git_dir
    index = dot_git / "index"
    return index if index.is_file() else None


def _index_paths(data: bytes, hash_size: int = 20) -> list[str]:
    """The paths of a git index file (the format `git ls-files` reads), versions 2, 3 and 4."""
    signature, version, count = struct.unpack(">4sII", data[:12])
    assert signature == b"DIRC" and version in (2, 3, 4), f"unknown git index (version {version})"
    fixed = 40 + hash_size  # ctime, mtime, dev, ino, mode, uid, gid, size, object id
    paths, pos, previous = [], 12, b""
    for _ in range(count):
        start = pos
        (flags,) = struct.unpack(">H", data[pos + fixed : pos + fixed + 2])
        pos += fixed + 2 + (2 if version >= 3 and flags & 0x4000 else 0)
        if version == 4:  # the path is the previous one less N bytes, plus a NUL-terminated suffix
            byte = data[pos]
            strip = byte & 0x7F
            pos += 1
            while byte & 0x80:
                byte = data[pos]
                strip = ((strip + 1) << 7) | (byte & 0x7F)
                pos += 1
            end = data.index(b"\0", pos)
            path = previous[: len(previous) - strip] + data[pos:end]
            pos = end + 1
        else:  # NUL-terminated, the entry padded with NULs to a multiple of 8 bytes
            end = data.index(b"\0", pos)
            path = data[pos:end]
            pos = start + (end - start + 8) // 8 * 8
        paths.append(path.decode("utf-8"))
        previous = path
    return paths


def _tracked_files() -> list[str]:
    index = _git_index()
    if index is None:
        pytest.skip("not a git checkout: no list of tracked files")
    names = sorted(set(_index_paths(index.read_bytes())))  # conflicted paths appear once per stage
    in_scope = [n for n in names if n in SCOPE or n.startswith(tuple(f"{d}/" for d in SCOPE))]
    return [n for n in in_scope if n.endswith((".py", ".md")) and not n.startswith(EXCLUDED)]


def test_no_file_cites_design_notes_outside_the_repository() -> None:
    files = _tracked_files()
    assert any(f.startswith("pagoda/") for f in files), "git ls-files listed no source files"
    hits = []
    for name in files:
        path = ROOT / name
        if not path.is_file():  # deleted in the working tree, not yet committed
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            match = OUTSIDE.search(line)
            if match:
                hits.append(f"{name}:{number}: {match.group(0)!r} in {line.strip()[:100]}")
    assert not hits, (
        "These lines cite documents a user who clones the repository cannot open; state the fact in the"
        " comment or in docs/ (e.g. docs/models.md) and point there instead:\n" + "\n".join(hits)
    )


@pytest.mark.parametrize(
    "line",
    [
        "# see " + "shared" + "/specs/yuan2.md",
        "(spec " + "qwen2vl.md, " + "\u00a7" + "5.1)",
        "as research/" + "yuan2.md says",
        "spec " + "tools.md",
    ],
)
def test_the_patterns_catch_the_old_citation_forms(line: str) -> None:
    assert OUTSIDE.search(line)


@pytest.mark.parametrize(
    "line",
    [
        "# docs/models.md, Qwen2-VL: video frame sampling",
        "see [tools.md](tools.md#pagoda-bench)",
        "spec = importlib.util.find_spec('x')",
    ],
)
def test_the_patterns_leave_in_repository_pointers_alone(line: str) -> None:
    assert not OUTSIDE.search(line)
