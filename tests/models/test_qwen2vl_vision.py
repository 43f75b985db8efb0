"""Qwen2-VL vision tower parity with transformers (tiny random model, float32, CPU).

The HF model is saved with `save_pretrained` and only its `visual.*` tensors are loaded into our
module through each module's `weight_loader`, so the test covers the checkpoint names and the
Conv3d -> Linear reshape as well as the maths (2-D rotary order, segment attention, merger).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagoda.errors import ModelLoadError
from pagoda.layers.linear import default_weight_loader
from pagoda.models.qwen2_vl_vision import Qwen2VisionTransformer, split_by_item, vision_config_with_defaults

TEXT_HIDDEN = 64
VISION = {
    "depth": 2,
    "embed_dim": 32,
    "num_heads": 4,
    "mlp_ratio": 4,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "in_channels": 3,
    "hidden_size": TEXT_HIDDEN,
}
PATCH_DIM = 3 * 2 * 14 * 14


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory) -> tuple[nn.Module, Path]:
    """A tiny random Qwen2VLForConditionalGeneration, its vision weights made non-trivial, saved."""
    import transformers

    config = transformers.Qwen2VLConfig(
        text_config={
            "hidden_size": TEXT_HIDDEN,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "vocab_size": 512,
            "rms_norm_eps": 1e-6,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
        },
        vision_config=dict(VISION),
        image_token_id=500,
        video_token_id=501,
        vision_start_token_id=502,
        vision_end_token_id=503,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    hf = transformers.Qwen2VLForConditionalGeneration(config).eval()
    _randomize(hf.model.visual)
    folder = tmp_path_factory.mktemp("qwen2vl_tiny")
    hf.save_pretrained(folder)
    return hf, folder / "model.safetensors"


@torch.no_grad()
def _randomize(module: nn.Module) -> None:
    """Default init leaves biases at 0, LayerNorms at identity and weights at std 0.02, which would
    hide bias/norm loading bugs and make attention nearly uniform (rotary errors invisible)."""
    for name, param in module.named_parameters():
        scale = 0.3 if name.endswith("qkv.weight") else 0.1
        param.add_(torch.randn_like(param) * scale)


def _load_visual(path: Path) -> Qwen2VisionTransformer:
    """Our tower built like the engine does (meta device, then allocated), filled from `visual.*`."""
    from safetensors import safe_open

    cfg = vision_config_with_defaults(dict(VISION), TEXT_HIDDEN)
    with torch.device("meta"):
        model = Qwen2VisionTransformer(cfg)
    model = model.to_empty(device="cpu").to(torch.float32)
    params, modules = dict(model.named_parameters()), dict(model.named_modules())
    loaded: set[str] = set()
    with safe_open(str(path), "pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            name = _strip_visual_prefix(key)
            if name is None:
                continue
            owner = modules[name.rpartition(".")[0]]
            getattr(owner, "weight_loader", default_weight_loader)(params[name], f.get_tensor(key), None)
            loaded.add(name)
    assert loaded == set(params), f"not loaded: {set(params) - loaded}"
    return model.eval()


def _strip_visual_prefix(key: str) -> str | None:
    # transformers 5 writes the original `visual.*` names; 4.5x re-saves used `model.visual.*`.
    for prefix in ("visual.", "model.visual."):
        if key.startswith(prefix):
            return key[len(prefix) :]
    return None


@pytest.fixture(scope="module")
def ours(hf_checkpoint) -> Qwen2VisionTransformer:
    return _load_visual(hf_checkpoint[1])


def test_saved_checkpoint_uses_visual_prefix(hf_checkpoint):
    from safetensors import safe_open

    with safe_open(str(hf_checkpoint[1]), "pt") as f:
        visual = [k for k in f.keys() if "visual" in k]  # noqa: SIM118
    assert visual and all(k.startswith(("visual.", "model.visual.")) for k in visual)
    assert any(k.endswith("patch_embed.proj.weight") for k in visual)


GRID_CASES = {
    "one_image": [(1, 8, 12)],
    "two_images_different_sizes": [(1, 8, 12), (1, 4, 4)],
    "same_size_not_adjacent": [(1, 4, 6), (1, 2, 2), (1, 4, 6)],  # grouped SDPA over gathered rows
    "video_two_frame_pairs": [(2, 4, 6)],
    "video_and_image_mixed": [(2, 4, 6), (1, 4, 6), (1, 6, 2)],
    "video_between_same_size_images": [(1, 4, 6), (2, 2, 2), (1, 6, 2), (1, 4, 6)],  # the tower reorders rows
}


@pytest.mark.parametrize("grids", GRID_CASES.values(), ids=GRID_CASES.keys())
def test_matches_transformers(hf_checkpoint, ours, grids):
    hf = hf_checkpoint[0]
    torch.manual_seed(1)
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), PATCH_DIM)
    with torch.no_grad():
        expected = hf.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
        got = ours(pixels, grids)
    assert got.shape == (pixels.shape[0] // 4, TEXT_HIDDEN)
    assert expected.abs().max() > 0.1  # the comparison below is not between near-zeros
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_split_by_item_matches_get_image_features(hf_checkpoint, ours):
    hf = hf_checkpoint[0]
    grids = [(1, 8, 12), (1, 4, 4)]
    torch.manual_seed(2)
    pixels = torch.randn(8 * 12 + 4 * 4, PATCH_DIM)
    with torch.no_grad():
        expected = hf.model.get_image_features(pixels, torch.tensor(grids)).pooler_output
        got = split_by_item(ours(pixels, grids), grids)
    assert [g.shape[0] for g in got] == [24, 4]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_video_frame_pairs_do_not_attend_to_each_other(ours):
    """A 2-frame-pair video encodes exactly like its two frame pairs encoded as separate items."""
    torch.manual_seed(3)
    pixels = torch.randn(2 * 4 * 6, PATCH_DIM)
    with torch.no_grad():
        video = ours(pixels, [(2, 4, 6)])
        pair_0, pair_1 = ours(pixels[:24], [(1, 4, 6)]), ours(pixels[24:], [(1, 4, 6)])
    torch.testing.assert_close(video, torch.cat([pair_0, pair_1]), atol=1e-6, rtol=1e-6)


def test_rotary_tables_are_kept_for_a_bounded_number_of_sizes(hf_checkpoint, ours, monkeypatch):
    """The per-size rotary tables are a bounded LRU: past the bound the least recently used size goes, and a size
    met again after its eviction still encodes like transformers' tower."""
    from pagoda.models import qwen2_vl_vision

    monkeypatch.setattr(qwen2_vl_vision, "ROPE_CACHE_SIZES", 3)
    ours._rope_cache.clear()
    sizes = [(2, 2), (2, 4), (4, 2), (4, 4), (2, 6)]
    with torch.no_grad():
        for h, w in sizes:
            ours(torch.randn(h * w, PATCH_DIM), [(1, h, w)])
    assert [key[:2] for key in ours._rope_cache] == sizes[-3:]
    pixels = torch.randn(4, PATCH_DIM)
    with torch.no_grad():
        got = ours(pixels, [(1, 2, 2)])
        expected = hf_checkpoint[0].model.visual(pixels, grid_thw=torch.tensor([(1, 2, 2)])).pooler_output
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert [key[:2] for key in ours._rope_cache] == [(4, 4), (2, 6), (2, 2)]
    with torch.no_grad():  # a hit makes (4, 4) the most recent: the next new size evicts (2, 6)
        ours(torch.randn(16, PATCH_DIM), [(1, 4, 4)])
        ours(torch.randn(12, PATCH_DIM), [(1, 6, 2)])
    assert [key[:2] for key in ours._rope_cache] == [(2, 2), (4, 4), (6, 2)]


def test_segment_layout_groups_rows_by_length():
    from pagoda.models.qwen2_vl_vision import SegmentLayout

    # segments (rows): image 4x6 (0-23), image 2x2 (24-27), image 4x6 (28-51); merge windows of 4 rows
    layout = SegmentLayout.of([(1, 4, 6), (1, 2, 2), (1, 4, 6)], 4)
    assert layout.frames == [(4, 6), (4, 6), (2, 2)]
    assert layout.groups == [(24, 2, 0), (4, 1, 48)]
    assert layout.rows.tolist() == [*range(0, 24), *range(28, 52), *range(24, 28)]
    assert layout.merged.tolist() == [*range(0, 6), 12, *range(6, 12)]  # item order: first image, 2x2, second
    in_order = SegmentLayout.of([(2, 4, 6), (1, 2, 2)], 4)  # a video's two frame pairs, then an image
    assert in_order.groups == [(24, 2, 0), (4, 1, 48)] and in_order.rows is None and in_order.merged is None


def test_conv3d_weight_loads_into_patch_embed():
    cfg = vision_config_with_defaults(dict(VISION, depth=0), TEXT_HIDDEN)
    model = Qwen2VisionTransformer(cfg).to(torch.float64)  # float64: a layout bug, not summation noise
    proj = model.patch_embed.proj
    torch.manual_seed(4)
    conv_weight = torch.randn(32, 3, 2, 14, 14, dtype=torch.float64)  # checkpoint layout [D, C, T, p, p]
    proj.weight_loader(proj.weight, conv_weight)
    pixels = torch.randn(5, PATCH_DIM, dtype=torch.float64)
    expected = F.conv3d(pixels.view(5, 3, 2, 14, 14), conv_weight, stride=(2, 14, 14)).view(5, 32)
    torch.testing.assert_close(model.patch_embed(pixels), expected, atol=1e-10, rtol=1e-10)

    proj.weight_loader(proj.weight, conv_weight.reshape(32, -1) * 2)  # an already-flat weight
    torch.testing.assert_close(proj.weight, conv_weight.reshape(32, -1) * 2)
    with pytest.raises(ValueError, match="shape mismatch"):
        proj.weight_loader(proj.weight, torch.randn(32, 3, 1, 14, 14))


def test_patch_embed_casts_pixels_to_weight_dtype():
    model = Qwen2VisionTransformer(vision_config_with_defaults(dict(VISION, depth=0), TEXT_HIDDEN))
    model.patch_embed.proj.weight.data.normal_()
    model.to(torch.bfloat16)
    assert model.patch_embed(torch.randn(3, PATCH_DIM)).dtype == torch.bfloat16


def test_config_defaults_and_aliases():
    # The official 7B/72B vision_config: only these four fields.
    cfg = vision_config_with_defaults(
        {"hidden_size": 3584, "in_chans": 3, "model_type": "qwen2_vl", "spatial_patch_size": 14}, 3584
    )
    assert (cfg["depth"], cfg["embed_dim"], cfg["num_heads"], cfg["mlp_ratio"]) == (32, 1280, 16, 4)
    assert (cfg["patch_size"], cfg["temporal_patch_size"], cfg["spatial_merge_size"]) == (14, 2, 2)
    assert (cfg["in_channels"], cfg["hidden_act"], cfg["hidden_size"]) == (3, "quick_gelu", 3584)
    assert vision_config_with_defaults({}, 1536)["hidden_size"] == 1536
    assert vision_config_with_defaults({"spatial_patch_size": 16}, 64)["patch_size"] == 16


def test_mismatching_vision_hidden_size_raises():
    with pytest.raises(ModelLoadError, match="hidden_size"):
        vision_config_with_defaults({"hidden_size": 3584}, 1536)


def test_bad_grid_is_rejected(ours):
    with pytest.raises(ValueError, match="multiples"):
        ours(torch.randn(15, PATCH_DIM), [(1, 3, 5)])
    with pytest.raises(ValueError, match="patch rows"):
        ours(torch.randn(10, PATCH_DIM), [(1, 2, 4)])
