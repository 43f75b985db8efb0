"""`knob`: a user-facing config field, its default and its `--flag` help in one place.

A module of its own so that a config of flags (config/server.py) imports nothing of the engine's resolution
(config/engine.py reads the model through `models`), and the HTTP transport (server/http_limits.py) and the
router can take their defaults from it.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def knob(default: Any, help: str | None, **metadata: Any) -> Any:
    """A user-facing config field: its default and its `--flag` help (None: a flag without help text).

    Metadata read by cli/args.py: `flags=(...)` extra spellings, `choices=(...)`, `store_true=True` (a bool
    flag without --no-), `cli_type=str` (the flag takes a string that the config's `from_cli` parses).
    """
    return field(default=default, metadata={"help": help, **metadata})
