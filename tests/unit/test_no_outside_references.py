"""The repository explains itself: no comment, docstring or doc cites a design note a clone lacks.

Every tracked .py and .md file under pagoda/, tests/, docs/, benchmarks/ (results/ excepted: data)
and README.md is scanned for citations of the private design notes: their folder, "spec <name>.md",
"research/<name>.md" and numbered sections of them (a section sign followed by a digit). A fact the
code relies on belongs in the comment itself or in docs/ (docs/models.md, docs/tools.md), cited by
file and section title. The patterns are assembled so that this file does not match them itself.

The files are those on disk under those folders (in a clean clone, exactly the tracked ones).
"""

from __future__ import annotations

import re
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
            r"\.\./" + "shared",  # anything beside the clone
            r"\bspec [\w.-]+\.md",  # "spec <name>.md"
            r"\bresearch/[\w.-]+\.md",  # "research/<name>.md"
            "\u00a7" + r"\s?\d",  # a numbered section of a note
        )
    )
)


def _files_in_scope() -> list[str]:
    paths: list[Path] = []
    for entry in SCOPE:
        top = ROOT / entry
        paths += [top] if top.is_file() else [*top.rglob("*.py"), *top.rglob("*.md")]
    names = sorted(p.relative_to(ROOT).as_posix() for p in paths)
    return [n for n in names if not n.startswith(EXCLUDED) and "/__pycache__/" not in n]


def test_no_file_cites_design_notes_outside_the_repository() -> None:
    files = _files_in_scope()
    assert any(f.startswith("pagoda/") for f in files), "no source files found"
    hits = []
    for name in files:
        path = ROOT / name
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
