"""Flags generated from config dataclasses: one `--flag` per field, its help from the field's metadata.

A field made with `config.knob(default, help, flags=(...), choices=(...))` becomes `--field-name` (plus the
extra spellings in `flags`); a bool becomes `--name/--no-name`. Adding a knob is one edit, in its dataclass.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

from pagoda.config import EngineArgs

T = TypeVar("T")


def _base_type(annotation: Any) -> Any:
    hint = eval(annotation, {"typing": typing}) if isinstance(annotation, str) else annotation  # noqa: S307
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return args[0]
    return hint


def add_config_args(parser: argparse.ArgumentParser | Any, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of the dataclass `cls` that has help metadata (fields without it are not flags)."""
    for f in dataclasses.fields(cls):
        if f.name in skip or "help" not in f.metadata:
            continue
        meta = f.metadata
        flags = ["--" + f.name.replace("_", "-"), *meta.get("flags", ())]
        kind = meta.get("cli_type") or _base_type(f.type)  # cli_type: a string the config parses
        extra: dict[str, Any] = {"choices": meta["choices"]} if "choices" in meta else {}
        if kind is bool:
            action = "store_true" if meta.get("store_true") else argparse.BooleanOptionalAction
            parser.add_argument(*flags, action=action, default=f.default, help=meta["help"])
        elif typing.get_origin(kind) in (list, tuple):
            item = typing.get_args(kind)[0] if typing.get_args(kind) else str
            parser.add_argument(*flags, nargs="+", type=item, default=f.default, help=meta["help"], **extra)
        else:
            parser.add_argument(*flags, type=kind, default=f.default, help=meta["help"], dest=f.name, **extra)


def config_from(ns: argparse.Namespace, cls: type[T], **overrides: Any) -> T:
    """The one way a config is built from parsed flags: the dataclass `cls` from the flags `add_config_args`
    added (fields without a flag keep their default). A config with string-spelled knobs (`cli_type=str`)
    parses them itself, in its `from_cli`; the others are built directly."""
    fields = [f for f in dataclasses.fields(cls) if "help" in f.metadata]  # type: ignore[arg-type]
    values = {f.name: getattr(ns, f.name) for f in fields if hasattr(ns, f.name)}
    parses_strings = any(f.metadata.get("cli_type") is str for f in fields)
    build: Any = cls.from_cli if parses_strings else cls  # type: ignore[attr-defined]
    return build(**{**values, **overrides})  # type: ignore[no-any-return]


def add_engine_args(parser: argparse.ArgumentParser | Any, skip: tuple[str, ...] = ()) -> None:
    add_config_args(parser, EngineArgs, skip)
