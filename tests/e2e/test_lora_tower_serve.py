"""`pagoda serve --enable-lora --enable-tower-connector-lora --lora-modules ... --default-mm-loras ...` with an
adapter on Qwen2-VL's vision tower only: a chat request with an image through the adapter, by its name or as the
image default, answers what the offline `LLM.chat` with the same adapter answers (the engine path is checked
against PEFT in tests/models/test_lora_vision_tower.py), and not what the base model answers, so the served tower
ran the adapter. Without the flag the same `--lora-modules` stops the start in one line naming it. The server
listens on one of ports 18470-18479."""

from __future__ import annotations

import json
import subprocess
import sys

import e2e_server
import httpx
import peft
import pytest
import torch
from e2e_server import ServerProcess
from test_qwen2vl_serve import (  # noqa: F401 (qwen2vl_folder: a fixture)
    MAX_PIXELS,
    data_uri,
    encoded,
    image_part,
    qwen2vl_folder,
)

PORTS = range(18470, 18480)  # this module's server ports
TOWER = r".*visual\.(blocks\.\d+\.(attn\.(qkv|proj)|mlp\.fc[12])|merger\.mlp\.[02])"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tower_adapter(qwen2vl_folder, tmp_path_factory) -> tuple[str, str]:  # noqa: F811 (the imported fixture)
    """(the tiny Qwen2-VL's folder, a PEFT adapter on its tower only)."""
    import transformers

    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(qwen2vl_folder, dtype=torch.float32)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=TOWER))
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    folder = tmp_path_factory.mktemp("tower-adapter")
    adapted.save_pretrained(folder)
    return qwen2vl_folder, str(folder)


def _flags(folder: str, adapter: str) -> list[str]:
    return [
        "--model",
        folder,
        "--max-model-len",
        "512",
        "--mm-processor-kwargs",
        json.dumps({"max_pixels": MAX_PIXELS}),
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"tower={adapter}",
    ]


IMAGE = image_part(data_uri(encoded(56, 84, seed=3)))
MESSAGES = {
    "image": [{"role": "user", "content": [IMAGE, {"type": "text", "text": "hi"}]}],
    "text": [{"role": "user", "content": "hi there"}],
}


def test_a_tower_adapter_is_served_as_offline_and_is_the_image_default(tower_adapter, tmp_path):
    """The adapter by its name, and as `--default-mm-loras`' image adapter for requests to the base model that carry
    an image (a text-only one stays the base model's), against the offline engine with the adapter named and without
    it (which must differ, or the tower would not have run the adapter)."""
    from pagoda import LLM, SamplingParams
    from pagoda.lora.request import LoRARequest

    base, adapter = tower_adapter
    flags = [
        *_flags(base, adapter),
        "--enable-tower-connector-lora",
        "--default-mm-loras",
        json.dumps({"image": adapter}),
    ]
    with pytest.MonkeyPatch.context() as patch:  # ServerProcess takes its port from free_port
        patch.setattr(e2e_server, "free_port", lambda: e2e_server.free_port_in(PORTS))
        server = ServerProcess(tmp_path / "serve.log", flags)
    try:
        server.wait_healthy()
        answers = {}
        headers = {"Authorization": f"Bearer {e2e_server.API_KEY}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=120) as c:
            for key, model, messages in (
                ("tower", "tower", "image"),
                ("default", e2e_server.MODEL, "image"),
                ("text", e2e_server.MODEL, "text"),
            ):
                body = {"model": model, "messages": MESSAGES[messages], "max_tokens": MAX_TOKENS, "temperature": 0}
                response = c.post("/v1/chat/completions", json=body | {"logprobs": True, "ignore_eos": True})
                assert response.status_code == 200, response.text
                assert response.json()["model"] == model
                answers[key] = [t["logprob"] for t in response.json()["choices"][0]["logprobs"]["content"]]
            cards = {card["id"]: card for card in c.get("/v1/models").json()["data"]}
            assert cards["image"]["root"] == adapter and cards["image"]["parent"] == e2e_server.MODEL
    finally:
        server.stop()

    def engine(**extra) -> LLM:  # as the server was started, offline
        args = dict(max_model_len=512, mm_processor_kwargs={"max_pixels": MAX_PIXELS}, enable_lora=True)
        return LLM(base, **args, max_lora_rank=8, enable_tower_connector_lora=True, **extra)

    llm = engine()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)

    def offline(messages: str, lora: LoRARequest | None = None) -> list[float]:
        completion = llm.chat(MESSAGES[messages], params, lora_request=lora, use_tqdm=False)[0].outputs[0]
        return [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]

    adapted = offline("image", LoRARequest("tower", 1, adapter))
    assert answers["tower"] == pytest.approx(adapted, abs=1e-4)
    assert answers["default"] == pytest.approx(adapted, abs=1e-4)
    assert answers["text"] == pytest.approx(offline("text"), abs=1e-4)
    base_image = offline("image")
    assert base_image != pytest.approx(adapted, abs=1e-3)
    # Offline, vLLM's LLM(default_mm_loras=...): the image prompt that names no adapter runs with the image's.
    llm = engine(default_mm_loras={"image": adapter})
    assert offline("image") == pytest.approx(adapted, abs=1e-4)
    assert offline("text") == pytest.approx(answers["text"], abs=1e-4)


def test_without_the_flag_a_tower_adapter_stops_the_start_in_one_line(tower_adapter):
    base, adapter = tower_adapter
    result = subprocess.run(
        [sys.executable, "-m", "pagoda", "serve", *_flags(base, adapter), "--skip-preflight"]
        + ["--cpu-kv-cache-space-gib", "0.25", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode != 0, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "--lora-modules tower: " in line]
    assert len(errors) == 1 and "--enable-tower-connector-lora" in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
