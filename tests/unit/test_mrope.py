"""M-RoPE positions (docs/models.md, Qwen2-VL: M-RoPE positions) against worked examples and transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.frontend.multimodal.mrope import mrope_positions
from pagoda.inputs import MultiModalItem


def _item(grid, offset, modality="image"):
    t, h, w = grid
    return MultiModalItem(modality, np.zeros((1, 1), np.float32), grid, offset, t * h * w // 4, b"")


def test_worked_example_224_image():
    # 11 system tokens + 4 (<|im_start|> user \n <|vision_start|>), 64 pads at 15..78, then 10 tokens; L = 89.
    positions, delta = mrope_positions(89, [_item((1, 16, 16), 15)])
    assert delta == -56
    np.testing.assert_array_equal(positions[:, :15], np.tile(np.arange(15), (3, 1)))
    assert positions[:, 15].tolist() == [15, 15, 15] and positions[:, 78].tolist() == [15, 22, 22]
    assert positions[:, 15 + 8 * 3 + 5].tolist() == [15, 18, 20]  # pad (b=3, c=5)
    np.testing.assert_array_equal(positions[:, 79:], np.tile(np.arange(23, 33), (3, 1)))


def test_worked_example_1000x750_advances_by_36():
    positions, delta = mrope_positions(15 + 972 + 3, [_item((1, 54, 72), 15)])
    assert positions[:, 15 + 972].tolist() == [15 + 36] * 3
    assert delta == 36 - 972


def test_video_uses_max_of_t_h_w_original_rule():
    # grid (2, 16, 16): t in {s, s+1}, h/w in s..s+7, then next = s + 8.
    positions, _ = mrope_positions(15 + 128 + 2, [_item((2, 16, 16), 15, "video")])
    assert set(positions[0, 15:143].tolist()) == {15, 16}
    assert positions[1, 15:143].max() == 22
    assert positions[:, 143].tolist() == [23, 23, 23]
    # 32 frames of 56x56 -> grid (16, 4, 4): the original rule puts the next text token at 15 + 16 = 31
    # (transformers 5.24 advances by max(H, W) only and would say 17).
    positions, delta = mrope_positions(15 + 64 + 1, [_item((16, 4, 4), 15, "video")])
    assert positions[:, 79].tolist() == [31, 31, 31] and delta == -48


def test_text_only_is_plain_positions():
    positions, delta = mrope_positions(7, [])
    np.testing.assert_array_equal(positions, np.tile(np.arange(7), (3, 1)))
    assert delta == 0


@pytest.mark.parametrize("grids", [[(1, 8, 12)], [(1, 4, 4), (1, 8, 6), (1, 2, 2)]])
def test_images_match_transformers_get_rope_index(grids):
    import transformers

    config = transformers.Qwen2VLConfig(
        text_config=dict(
            vocab_size=151936,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(depth=1, embed_dim=32, num_heads=4, hidden_size=64),
    )
    model = transformers.Qwen2VLModel(config).eval()
    ids, items = [10, 11, 12], []
    for grid in grids:
        n = grid[0] * grid[1] * grid[2] // 4
        ids.append(151652)
        items.append(_item(grid, len(ids)))
        ids += [151655] * n + [151653, 20, 21]
    input_ids = torch.tensor([ids])
    ref, ref_delta = model.get_rope_index(input_ids, (input_ids == 151655).long(), image_grid_thw=torch.tensor(grids))
    positions, delta = mrope_positions(len(ids), items)
    np.testing.assert_array_equal(positions, ref[:, 0].numpy())
    assert delta == int(ref_delta.flatten()[0])
