"""docs/architecture.md's module map names every module of `pagoda/`, and only modules that exist.

Pure and fast: walks the source tree and reads one Markdown file. A module is a `.py` file; an
`__init__.py` counts only when it holds code beyond a docstring. The tools that are packages
(`pagoda/tools/{bench,batch,router,doctor}/`) are named by their folder.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
FOLDERS_NAMED_WHOLE = ("pagoda/tools/bench/", "pagoda/tools/batch/", "pagoda/tools/router/", "pagoda/tools/doctor/")
PATH = re.compile(r"`(pagoda/[\w/]*?(?:\.py|/))`")


def _has_code(path: Path) -> bool:
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)) for n in body)


def _modules() -> set[str]:
    names = set()
    for path in (ROOT / "pagoda").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        folder = next((f for f in FOLDERS_NAMED_WHOLE if rel.startswith(f)), None)
        if folder:
            names.add(folder)
        elif path.name != "__init__.py" or _has_code(path):
            names.add(rel)
    return names


def _module_map() -> set[str]:
    """The paths in the first column of the doc's tables."""
    named = set()
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("| `pagoda/"):
            named.update(PATH.findall(line.split("|")[1]))
    return named


def test_every_module_is_in_the_module_map() -> None:
    missing = sorted(_modules() - _module_map())
    assert not missing, f"modules missing from docs/architecture.md's module map: {missing}"


def test_the_module_map_names_only_modules_that_exist() -> None:
    gone = sorted(p for p in _module_map() if not (ROOT / p).exists())
    assert not gone, f"docs/architecture.md names modules that do not exist: {gone}"


def test_the_doc_stays_a_map() -> None:
    """Read in one sitting: at most 150 lines (a module's details belong in its docstring or the other docs)."""
    lines = len(DOC.read_text(encoding="utf-8").splitlines())
    assert lines <= 150, f"docs/architecture.md has {lines} lines; condense it to 150 or fewer"
