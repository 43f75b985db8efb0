"""An API process's warm-up prompt (`server/warm_up.py`), prepared as `pagoda serve`'s API process prepares
it: through the app `ApiSetup` builds, in this process, with stand-ins for the engine and the metrics that it
must not use. The image's placeholder count is worked out here from the preprocessing rules
(`test_qwen2vl_serve.image_tokens`), not by the server's code.
"""

from __future__ import annotations

import asyncio
from typing import Any
from unittest.mock import MagicMock

from test_qwen2vl_serve import MIN_PIXELS, image_tokens, qwen2vl_folder  # noqa: F401 (qwen2vl_folder: a fixture)

from pagoda.config import EngineConfig
from pagoda.config.multimodal import MultiModalConfig
from pagoda.config.server import ServerConfig
from pagoda.server import protocol as p
from pagoda.server.warm_up import WARM_IMAGE_SIDE, warm_up, warm_up_messages


def serving_for(model: str, multimodal: MultiModalConfig) -> tuple[Any, MagicMock]:
    """The app's serving object, and the engine and metrics it was built with (mocks, their build-time calls
    forgotten, so that what the warm-up calls on them shows)."""
    from pagoda.server.api_process import ApiSetup

    config = EngineConfig.create(model=model, device="cpu", max_model_len=2048)
    setup = ApiSetup(ServerConfig(), config, multimodal, check=False)
    setup.prepare_prompts()
    outside = MagicMock()
    serving = setup.app(outside.engine, outside.metrics).state.serving
    outside.reset_mock()
    return serving, outside


def test_a_vision_language_model_warms_up_on_a_chat_with_one_expanded_image(qwen2vl_folder):  # noqa: F811
    serving, outside = serving_for(qwen2vl_folder, MultiModalConfig())
    done = asyncio.run(warm_up(serving))
    assert done is not None and done.ms > 0
    assert outside.mock_calls == []  # neither the engine nor the metrics
    text_only = [{**m, "content": [c for c in m["content"] if c["type"] == "text"]} for m in warm_up_messages(True)]
    _, text_ids, _ = asyncio.run(serving.tokenize_chat(p.TokenizeRequest.model_validate({"messages": text_only})))
    # vision_start + the image's placeholders + vision_end (the checkpoint's bounds: min_pixels, 12845056)
    image = image_tokens(WARM_IMAGE_SIDE, WARM_IMAGE_SIDE, MIN_PIXELS, 12845056)
    assert image >= 1
    assert done.prompt_tokens == len(text_ids) + 2 + image


def test_a_warm_up_the_server_would_refuse_is_skipped_not_raised(qwen2vl_folder):  # noqa: F811
    serving, _ = serving_for(qwen2vl_folder, MultiModalConfig(limit_mm_per_prompt={"image": 0}))
    assert asyncio.run(warm_up(serving)) is None


def test_a_text_model_warms_up_on_text_alone():
    from pagoda.models.gguf_checkpoint import default_gguf_path

    serving, outside = serving_for(str(default_gguf_path()), MultiModalConfig())
    done = asyncio.run(warm_up(serving))
    assert done is not None and outside.mock_calls == []
    _, ids, _ = asyncio.run(
        serving.tokenize_chat(p.TokenizeRequest.model_validate({"messages": warm_up_messages(False)}))
    )
    assert done.prompt_tokens == len(ids)
