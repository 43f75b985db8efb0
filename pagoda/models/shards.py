"""Which weight files of an HF folder a checkpoint is: the one shard check, shared by the loader and `pagoda doctor`.

A folder holds safetensors (they win when both formats are there) or PyTorch `pytorch_model*.bin` pickles.
With an index (`model.safetensors.index.json`, `pytorch_model.bin.index.json`) the checkpoint is the shards its
`weight_map` names, and the set must agree with the folder both ways: a listed shard that is missing, or a
numbered shard (`x-0000i-of-0000n.ext`) that is not listed, means a half-downloaded or mixed-up folder that
would load wrong weights silently. Without an index: `model.safetensors` (or `pytorch_model.bin`), else every
file of the format (for .bin, every `pytorch_model*.bin`: never `training_args.bin` or optimizer state).

`ShardSet.paths()` is the loader's answer (the files, or a ModelLoadError naming the first problem); doctor reads
the same record to report every problem, and the numbering gaps of an index-less set, which the loader accepts.
Only file names and the index are read here, never a weight.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from pagoda.errors import ModelLoadError

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
_SINGLE = {"safetensors": "model.safetensors", "bin": "pytorch_model.bin"}
_NUMBERED = re.compile(r"^(?P<prefix>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.(?P<ext>safetensors|bin)$")


def has_safetensors(folder: str) -> bool:
    """Whether the folder is a safetensors checkpoint (then any .bin files beside it are ignored)."""
    names = os.listdir(folder)
    return SAFETENSORS_INDEX in names or any(n.endswith(".safetensors") for n in names)


def no_weights_error(folder: str) -> ModelLoadError:
    return ModelLoadError(
        f"No *.safetensors or pytorch_model*.bin weights found in {folder}; "
        "Pagoda loads safetensors or PyTorch .bin checkpoints."
    )


def read_index(folder: str, index: str) -> list[str]:
    """The shard names an index's `weight_map` lists, sorted (OSError, ValueError, KeyError... when unreadable)."""
    with open(os.path.join(folder, index), encoding="utf-8") as f:
        return sorted(set(json.load(f)["weight_map"].values()))


@dataclass(frozen=True)
class ShardSet:
    """One format's weight files of a folder, against its index."""

    folder: str
    format: str  # "safetensors" | "bin"
    present: list[str]  # the folder's files of the format, sorted
    listed: list[str] | None  # the index's shards; None without an index

    @property
    def index(self) -> str:
        return SAFETENSORS_INDEX if self.format == "safetensors" else BIN_INDEX

    @property
    def missing(self) -> list[str]:
        """Listed in the index, not in the folder."""
        return [n for n in self.listed or [] if n not in self.present]

    @property
    def unlisted(self) -> list[str]:
        """Numbered shards in the folder the index does not list (another checkpoint's, or a stale index)."""
        if self.listed is None:
            return []
        return [n for n in self.present if n not in self.listed and _NUMBERED.match(n)]

    @property
    def ignored(self) -> list[str]:
        """Other files of the format beside an index, which the loader leaves alone (for .bin, only the
        `pytorch_model*` ones count: other .bin files are not weights)."""
        if self.listed is None:
            return []
        return [
            n
            for n in self.present
            if n not in self.listed
            and not _NUMBERED.match(n)
            and (self.format == "safetensors" or n.startswith("pytorch_model"))
        ]

    @property
    def gaps(self) -> list[str]:
        """Without an index, the numbered shards that are not there: every i in 1..n of `x-0000i-of-0000n`."""
        if self.listed is not None:
            return []
        groups: dict[tuple[str, str, str], set[int]] = {}
        for name in self.present:
            m = _NUMBERED.match(name)
            if m:
                groups.setdefault((m["prefix"], m["n"], m["ext"]), set()).add(int(m["i"]))
        gaps = []
        for (prefix, n, ext), have in sorted(groups.items()):
            gaps += [f"{prefix}-{i:05d}-of-{n}.{ext}" for i in range(1, int(n) + 1) if i not in have]
        return gaps

    def paths(self) -> list[str]:
        """The files the loader reads, in order; the first problem with the index as a ModelLoadError."""
        if self.listed is not None:
            for name in self.missing:
                raise ModelLoadError(
                    f"Shard {name} is listed in {self.index} but missing from {self.folder}; re-download the model."
                )
            for name in self.unlisted:
                raise ModelLoadError(
                    f"Shard {name} in {self.folder} is not listed in {self.index}; remove it or fix the index."
                )
            return [os.path.join(self.folder, n) for n in self.listed]
        if _SINGLE[self.format] in self.present:
            return [os.path.join(self.folder, _SINGLE[self.format])]
        weights = (
            self.present if self.format == "safetensors" else [n for n in self.present if n.startswith("pytorch_model")]
        )
        if weights:
            return [os.path.join(self.folder, n) for n in weights]
        raise no_weights_error(self.folder)


def shard_set(folder: str, fmt: str | None = None) -> ShardSet:
    """The folder's shards of `fmt` ("safetensors" | "bin"; None: safetensors when there are any, else .bin),
    with its index read when there is one (an unreadable index raises what reading it raised)."""
    if fmt is None:
        fmt = "safetensors" if has_safetensors(folder) else "bin"
    ext = "." + fmt
    present = sorted(n for n in os.listdir(folder) if n.endswith(ext))
    index = SAFETENSORS_INDEX if fmt == "safetensors" else BIN_INDEX
    listed = read_index(folder, index) if os.path.isfile(os.path.join(folder, index)) else None
    return ShardSet(folder, fmt, present, listed)
