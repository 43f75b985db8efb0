"""`--lora-modules` as vLLM spells it (its JSON form's `base_model_name` too), `LoRARequest`'s checks and vLLM's
fields, an adapter named like a served model refused at startup, `VLLM_ALLOW_RUNTIME_LORA_UPDATING` read as
vLLM reads it, and `--default-mm-loras`: parsed, numbered and picked per prompt as vLLM does."""

from __future__ import annotations

import pytest

from pagoda import envs
from pagoda.config.lora import parse_default_mm_loras, resolve_lora
from pagoda.errors import ConfigError, InvalidRequest
from pagoda.lora.request import LoRARequest, default_mm_lora, offline_default_mm_loras, parse_lora_modules


def test_both_spellings_in_order_with_ids_from_one():
    modules = parse_lora_modules(["sql=/a/sql", '{"name": "chat", "path": "/b/chat", "base_model_name": "x"}'])
    assert modules == {"sql": LoRARequest("sql", 1, "/a/sql"), "chat": LoRARequest("chat", 2, "/b/chat")}
    assert modules["chat"].base_model_name == "x" and modules["sql"].base_model_name is None
    assert parse_lora_modules(None) == {} and parse_lora_modules(()) == {}


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (["sql"], "expected name=path"),
        (["=/a"], "expected name=path"),
        (["sql="], "expected name=path"),
        (['{"name": "x"}'], "expected name=path or"),
        (["{not json"], "expected name=path or"),
        (["a=/x", "a=/y"], "names 'a' twice"),
        (['{"name": "", "path": "/x"}'], "must be non-empty strings"),
        (['{"name": "a", "path": "/x", "base_model_name": 3}'], "base_model_name a string"),
    ],
)
def test_bad_modules_are_one_line(items, message):
    with pytest.raises(ConfigError, match=message):
        parse_lora_modules(items)


def test_a_lora_request_needs_a_name_a_positive_id_and_a_path():
    for args, message in (
        (("", 1, "/p"), "needs a name"),
        (("a", 0, "/p"), "positive integer"),
        (("a", -2, "/p"), "positive integer"),
        (("a", 1, ""), "needs lora_path"),
    ):
        with pytest.raises(InvalidRequest, match=message):
            LoRARequest(*args)
    assert LoRARequest("a", 3, "/p").adapter_id == 3


def test_vllms_base_model_name_field_is_keyword_only_and_a_label():
    lora = LoRARequest("a", 1, "/p", base_model_name="org/base")
    assert lora.base_model_name == "org/base"
    assert lora == LoRARequest("a", 1, "/p") and hash(lora) == hash(LoRARequest("a", 1, "/p"))
    with pytest.raises(TypeError):  # vLLM's 4th positional field is lora_local_path, which Pagoda has not
        LoRARequest("a", 1, "/p", "org/base")  # type: ignore[misc]
    with pytest.raises(InvalidRequest, match="base_model_name must be a string"):
        LoRARequest("a", 1, "/p", base_model_name=5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raw", "on"),
    [("1", True), ("true", True), ("True", True), (" TRUE ", True), ("0", False), ("false", False)]
    + [("yes", False), ("on", False), ("2", False), ("", False)],
)
def test_runtime_lora_updating_is_on_only_for_1_or_true(monkeypatch, raw, on):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raw)
    assert envs.ALLOW_RUNTIME_LORA_UPDATING.value is on
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    assert envs.ALLOW_RUNTIME_LORA_UPDATING.value is False


@pytest.mark.parametrize("served", [None, ("chat", "tiny")])
def test_an_adapter_named_like_a_served_model_stops_the_start_in_one_line(tiny_llama, served):
    from pagoda.config import EngineConfig
    from pagoda.config.multimodal import MultiModalConfig
    from pagoda.config.server import ServerConfig
    from pagoda.server.api_process import ApiSetup

    config = EngineConfig.create(model=tiny_llama, device="cpu", skip_tokenizer_init=True, enable_lora=True)
    name = "tiny" if served else tiny_llama  # without --served-model-name the model is served as typed
    server = ServerConfig(lora_modules=("ok=/a", f"{name}=/b"), served_model_name=served)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as info:
        ApiSetup(server, config, MultiModalConfig(), check=False)
    message = info.value.message
    assert message.startswith(f"--lora-modules {name}: the adapter's name is also a served model name")
    assert "give the adapter another name" in message and "\n" not in message


def test_default_mm_loras_are_served_after_the_modules_under_their_modality():
    """vLLM's --default-mm-loras: each adapter is also a served module named after its modality, numbered after the
    --lora-modules; offline, vLLM numbers them 1, 2, ... in the modalities' alphabetical order."""
    defaults = parse_default_mm_loras('{"video": "/v", "image": "/i"}')
    assert defaults == (("video", "/v"), ("image", "/i"))
    modules = parse_lora_modules(["sql=/a/sql"], defaults)
    assert modules == {
        "sql": LoRARequest("sql", 1, "/a/sql"),
        "video": LoRARequest("video", 2, "/v"),
        "image": LoRARequest("image", 3, "/i"),
    }
    assert offline_default_mm_loras(defaults) == {
        "image": LoRARequest("image", 1, "/i"),
        "video": LoRARequest("video", 2, "/v"),
    }
    with pytest.raises(ConfigError, match="--default-mm-loras image: its adapter is served under the modality's name"):
        parse_lora_modules(["image=/other"], defaults)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "is not valid JSON"),
        ('["/i"]', "expected a JSON object"),
        ('{"audio": "/a"}', "unknown modality 'audio' \\(image, video\\)"),
        ('{"image": ""}', "expected the adapter's folder as a non-empty string"),
        ({"image": 3}, "expected the adapter's folder as a non-empty string"),
    ],
)
def test_bad_default_mm_loras_are_one_line(value, message):
    with pytest.raises(ConfigError, match=message):
        resolve_lora(True, 1, 16, None, "auto", default_mm_loras=value)


def test_default_mm_loras_need_enable_lora():
    with pytest.raises(ConfigError, match="--default-mm-loras needs --enable-lora"):
        resolve_lora(False, 1, 16, None, "auto", default_mm_loras={"image": "/i"})
    assert resolve_lora(False, 1, 16, None, "auto", default_mm_loras=None) is None


def test_a_prompt_runs_with_its_one_modalitys_default_adapter(caplog):
    adapters = {"image": LoRARequest("image", 1, "/i"), "video": LoRARequest("video", 2, "/v")}
    assert default_mm_lora(adapters, ["image", "image"]) == adapters["image"]
    assert default_mm_lora({"image": adapters["image"]}, ["video", "image"]) == adapters["image"]
    assert default_mm_lora(adapters, []) is None and default_mm_lora({"video": adapters["video"]}, ["image"]) is None
    # Two modalities with an adapter each: one adapter per prompt, so none (as vLLM), and a line says why.
    with caplog.at_level("WARNING", logger="pagoda"):
        assert default_mm_lora(adapters, ["video", "image"]) is None
    assert "image and video" in caplog.text
