"""`--lora-modules` as vLLM spells it, and `LoRARequest`'s checks."""

from __future__ import annotations

import pytest

from pagoda.errors import ConfigError, InvalidRequest
from pagoda.lora.request import LoRARequest, parse_lora_modules


def test_both_spellings_in_order_with_ids_from_one():
    modules = parse_lora_modules(["sql=/a/sql", '{"name": "chat", "path": "/b/chat", "base_model_name": "x"}'])
    assert modules == {"sql": LoRARequest("sql", 1, "/a/sql"), "chat": LoRARequest("chat", 2, "/b/chat")}
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
