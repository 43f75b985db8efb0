"""`PAGODA_CORE_PROFILE` (`engine/core_process.profiled`): the engine core's serving loop under cProfile, its
pstats written when the loop ends, however it ends; nothing at all without a path."""

from __future__ import annotations

import logging
import pstats
import sys

import pytest

from pagoda.engine.core_process import profiled


def _work() -> int:
    return sum(i * i for i in range(20_000))


def test_the_blocks_functions_are_written_even_when_it_raises(tmp_path):
    path = tmp_path / "core.pstats"
    with pytest.raises(RuntimeError, match="boom"), profiled(str(path)):
        _work()
        raise RuntimeError("boom")
    calls = {func[2]: stat[1] for func, stat in pstats.Stats(str(path)).stats.items()}  # name -> calls
    assert calls.get("_work") == 1
    assert sys.getprofile() is None  # the profiler is off again


def test_without_a_path_nothing_profiles(tmp_path):
    with profiled(None):
        assert sys.getprofile() is None
    assert not list(tmp_path.iterdir())


def test_a_path_it_cannot_write_is_a_warning_not_an_error(tmp_path, caplog):
    with caplog.at_level(logging.WARNING), profiled(str(tmp_path / "missing-dir" / "core.pstats")):
        _work()
    assert "could not write" in caplog.text
