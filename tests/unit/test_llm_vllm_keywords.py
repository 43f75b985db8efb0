"""vLLM's `LLM(...)` keywords that are not engine knobs here: `disable_log_stats` (vLLM's spec-decode and metrics
examples pass False to get `get_metrics()` data; Pagoda always counts, so either value is accepted) and
`swap_space` (0 accepted silently; any other size refused in one line with the CLI's `--swap-space` reason)."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.cli.vllm_flags import REFUSED
from pagoda.engine.llm import SWAP_SPACE_REASON
from pagoda.errors import ConfigError


def test_the_swap_space_reason_is_the_clis():
    (cli_reason,) = [reason for reason, flags in REFUSED if "--swap-space" in flags.split()]
    assert SWAP_SPACE_REASON == cli_reason


@pytest.mark.parametrize("size", [4, 0.5, -1, "4", True])
def test_a_swap_space_is_refused_in_one_line_before_the_model_is_read(size):
    with pytest.raises(ConfigError) as info:  # the folder does not exist: the swap_space check comes first
        LLM(model="/no/such/folder", swap_space=size)
    message = info.value.message
    assert message.startswith(f"swap_space={size!r}: ") and SWAP_SPACE_REASON in message and "pass 0" in message
    assert "\n" not in message and info.value.param == "swap_space"
    assert info.value.__cause__ is None and info.value.__suppress_context__ is False


def test_disable_log_stats_must_be_a_bool():
    with pytest.raises(ConfigError, match="disable_log_stats must be True or False"):
        LLM(model="/no/such/folder", disable_log_stats="no")


def test_a_misspelt_one_is_still_a_type_error_that_lists_them():
    with pytest.raises(TypeError) as info:
        LLM(model="/no/such/folder", disable_log_stat=False)
    assert "did you mean 'disable_log_stats'" in str(info.value) and "swap_space" in str(info.value)


@pytest.mark.parametrize("disable_log_stats", [False, True])
def test_vllms_metrics_example_runs_and_get_metrics_counts_either_way(tiny_llama, disable_log_stats):
    llm = LLM(
        tiny_llama,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=128,
        num_gpu_blocks_override=32,
        disable_log_stats=disable_log_stats,
        swap_space=0,
    )
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    counters = {m.name: m for m in llm.get_metrics() if hasattr(m, "value")}
    assert counters["vllm:prompt_tokens"].value == 3 and counters["vllm:generation_tokens"].value == 3
