"""Rendered prompt ids + preprocessed images/videos → expanded ids and `MultiModalInputs`.

The chat template writes one placeholder token per item (<|image_pad|> / <|video_pad|>). Here the
k-th placeholder of a modality becomes that modality's k-th item's run of `num_tokens` placeholders
(expansion on token ids, so no text is re-tokenized), and every item records where its run sits.
A placeholder count that does not match the items (e.g. a user typed "<|image_pad|>" in the text)
is refused: it would shift every image after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pagoda.errors import InvalidRequest
from pagoda.frontend.multimodal.mrope import mrope_positions
from pagoda.inputs import MultiModalInputs, MultiModalItem, content_hash


class Visual(Protocol):
    pixel_values: np.ndarray  # uint8 levels with `pixel_lut`, or float32 normalised patches (one frame per
    # temporal patch where the visual has `temporal_repeat` > 1)
    grid_thw: tuple[int, int, int]

    @property
    def num_tokens(self) -> int: ...


@dataclass(frozen=True)
class PlaceholderIds:
    image: int  # <|image_pad|>
    video: int  # <|video_pad|>


def expand_prompt(
    token_ids: list[int],
    visuals: Sequence[tuple[str, Visual]],
    placeholders: PlaceholderIds,
    settings: str,
    merge_size: int = 2,
) -> tuple[list[int], MultiModalInputs]:
    """visuals: (modality, preprocessed item) in the order the items appear in the messages."""
    by_modality: dict[str, list[Visual]] = {"image": [], "video": []}
    for modality, visual in visuals:
        by_modality[modality].append(visual)
    pad_of = {placeholders.image: "image", placeholders.video: "video"}
    for modality, pad in (("image", placeholders.image), ("video", placeholders.video)):
        found = token_ids.count(pad)
        if found != len(by_modality[modality]):
            raise InvalidRequest(
                f"The prompt has {found} {modality} placeholder token(s) for {len(by_modality[modality])} "
                f"{modality}(s); message text must not contain the model's {modality} placeholder token.",
                "messages",
            )
    expanded: list[int] = []
    items: list[MultiModalItem] = []
    taken = {"image": 0, "video": 0}
    for token in token_ids:
        kind = pad_of.get(token)
        if kind is None:
            expanded.append(token)
            continue
        visual = by_modality[kind][taken[kind]]
        taken[kind] += 1
        n = visual.num_tokens
        t, h, w = visual.grid_thw
        lut = getattr(visual, "pixel_lut", None)
        repeat = getattr(visual, "temporal_repeat", 1)
        items.append(
            MultiModalItem(
                kind,
                visual.pixel_values,
                (t, h, w),
                len(expanded),
                n,
                content_hash(kind, visual.pixel_values, (t, h, w), settings, lut, repeat),
                lut,
                repeat,
            )
        )
        expanded.extend([token] * n)
    positions, delta = mrope_positions(len(expanded), items, merge_size)
    counts = {m: sum(i.length for i in items if i.modality == m) for m in ("image", "video")}
    return expanded, MultiModalInputs(items, positions, delta, counts)
