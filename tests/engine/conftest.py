"""Fixtures of the engine tests that run several ranks (tensor and pipeline parallelism)."""

from __future__ import annotations

import pytest

from pagoda.distributed.parallel_state import num_ranks
from tests.models.test_yuan_golden import CapturingEngine


@pytest.fixture
def engines():
    """Every engine a test builds is shut down at its end: its ranks stop, this process leaves the group."""
    built: list[CapturingEngine] = []

    def build(name: str, **engine_args) -> CapturingEngine:
        built.append(CapturingEngine(name, **engine_args))
        return built[-1]

    yield build
    for capture in built:
        capture.engine.shutdown()
    assert num_ranks() == 1
