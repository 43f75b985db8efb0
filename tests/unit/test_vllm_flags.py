"""`vllm serve` flags Pagoda does not have: refused with one line per flag naming why (exit 2, before anything
loads), or, for those that only tune vLLM internals, accepted with one warning line; the spellings that ask for
what Pagoda does anyway (`-dp 1`, `--no-enable-lora`) pass silently. `-q gguf` loads a GGUF as without it.
The subprocess check is tests/e2e/test_cli.py's."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from pagoda.cli.args import config_from
from pagoda.cli.main import build_parser, main
from pagoda.cli.vllm_flags import FLAGS, JSON_FLAGS, undot, vllm_only_flags
from pagoda.config import EngineArgs, EngineConfig
from pagoda.config.multimodal import MultiModalConfig
from pagoda.config.server import ServerConfig
from pagoda.errors import ModelLoadError
from pagoda.spec_decode.config import parse_speculative_config


def _lines(*argv: str) -> tuple[list[str], list[str]]:
    return vllm_only_flags(build_parser().parse_args(["serve", *argv]))


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--fully-sharded-loras"], "--fully-sharded-loras: not built: adapters are sharded under tensor"),
        (["--lora-extra-vocab-size", "8"], "--lora-extra-vocab-size: adapters that add tokens to the vocabulary"),
        (["-dp", "2"], "--data-parallel-size: data parallelism is not supported"),
        (["--enable-expert-parallel"], "--enable-expert-parallel: expert parallelism is not supported"),
        (["--kv-transfer-config", "{}"], "--kv-transfer-config: disaggregated prefill"),
        (["--ssl-keyfile", "key.pem"], "--ssl-keyfile: TLS is not supported"),
        (["--reasoning-parser", "deepseek_r1"], "--reasoning-parser: reasoning parsers are not supported yet"),
        (["--revision", "main"], "--revision: hub revisions are not supported"),
        (["--task", "embed"], "--task: only text generation is served"),
        (["--kv-transfer-config.kv_connector", "X"], "--kv-transfer-config: disaggregated prefill"),  # vLLM's dotted
        (["--swap-space", "4"], "--swap-space: preempted requests are recomputed, not swapped to host memory"),
    ],
)
def test_a_vllm_only_flag_is_refused_by_its_line(argv, line, capsys):
    assert main(["serve", *argv]) == 2  # before anything is resolved or loaded: no model, no port
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("pagoda: error: " + line), err


def test_every_flag_given_gets_its_line_grouped_by_feature(capsys):
    argv = ["--fully-sharded-loras", "--ssl-keyfile", "k", "--lora-extra-vocab-size", "4", "--uds", "/tmp/s"]
    assert main(["serve", *argv, "/models/x"]) == 2
    flags = [line.split(": ")[2] for line in capsys.readouterr().err.splitlines()]
    # One line per flag, in the table's order: LoRA's two, then TLS, then the socket.
    assert flags == ["--lora-extra-vocab-size", "--fully-sharded-loras", "--ssl-keyfile", "--uds"]


def test_internal_tuning_is_accepted_with_one_warning_each_and_the_model_stays_the_model():
    ns = build_parser().parse_args(
        ["serve", "--max-num-partial-prefills", "4", "--disable-custom-all-reduce", "-O3", "/models/x"]
    )
    refusals, warnings = vllm_only_flags(ns)
    assert refusals == []
    assert [w.split(":")[0] for w in warnings] == [
        "--compilation-config",
        "--max-num-partial-prefills",
        "--disable-custom-all-reduce",
    ]
    assert all("ignored" in w for w in warnings)
    assert ns.model_tag == "/models/x"  # a flag's value is not taken for the model


def test_a_warning_is_logged_once_per_ignored_flag(caplog, monkeypatch):
    import pagoda.cli.serve as serve_module

    def stop(ns):
        raise SystemExit(0)  # the flags are answered; nothing is loaded

    monkeypatch.setattr(serve_module, "prepare", stop)
    ns = build_parser().parse_args(["serve", "--max-num-partial-prefills", "4", "--mm-processor-cache-gb", "0"])
    with caplog.at_level(logging.WARNING, logger="pagoda"), pytest.raises(SystemExit):
        serve_module.serve(ns)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "--max-num-partial-prefills",
        "--mm-processor-cache-gb",
    ]


@pytest.mark.parametrize("argv", [["-dp", "1"], ["--no-enable-lora"], ["--max-logprobs", "20"], ["--swap-space", "0"]])
def test_what_pagoda_does_anyway_passes_silently(argv):
    assert _lines(*argv) == ([], [])


def test_the_flags_pagoda_has_are_its_own_and_every_name_is_unique():
    names = [n for f in FLAGS for n in (f.name, *f.aliases)]
    assert len(names) == len(set(names))
    ns = build_parser().parse_args(["serve", "--enable-prefix-caching", "-tp", "1", "--max-num-seqs", "8"])
    assert vllm_only_flags(ns) == ([], []) and ns.max_num_seqs == 8


def test_quantization_gguf_loads_a_gguf_and_is_refused_for_a_folder(tiny_llama):
    config = EngineConfig.create(quantization="gguf", device="cpu", skip_tokenizer_init=True, max_model_len=64)
    assert config.model.quantization is None  # dequantized on load, as without the flag
    with pytest.raises(ModelLoadError, match="--quantization gguf needs a .gguf file"):
        EngineConfig.create(model=tiny_llama, quantization="gguf", device="cpu", skip_tokenizer_init=True)


# ---- vLLM's dotted spelling of Pagoda's own JSON flags ----------------------------------------------------
def _serve_ns(*argv: str):
    return build_parser().parse_args(undot(["serve", *argv]))


@pytest.mark.parametrize(
    "argv",
    [
        ["--speculative-config.method", "ngram", "--speculative-config.num_speculative_tokens", "4"],
        ["--speculative-config.method=ngram", "--speculative-config.num_speculative_tokens=4"],
        [
            "--speculative-config.num_speculative_tokens",
            "2",
            "--speculative-config.num_speculative_tokens",
            "4",
            "--speculative-config.method",
            "ngram",
        ],  # a key given twice: its last value, as vLLM
    ],
)
def test_dotted_keys_of_the_speculative_config_gather_into_one_object(argv):
    ns = _serve_ns(*argv, "--port", "8001", "/models/x")
    assert json.loads(ns.speculative_config) == {"method": "ngram", "num_speculative_tokens": 4}
    assert (ns.port, ns.model_tag) == (8001, "/models/x")  # the other flags and the model as they were
    assert vllm_only_flags(ns) == ([], [])
    spec = parse_speculative_config(ns.speculative_config)
    assert spec is not None and (spec.method, spec.num_speculative_tokens) == ("ngram", 4)


def test_dotted_values_are_json_when_they_parse_and_keys_nest():
    ns = _serve_ns(
        "--speculative-config.model", "[ngram]",  # not JSON: a string
        "--speculative-config.num_speculative_tokens", "3",
        "--speculative-config.a.b", "true",
        "--speculative-config.a.c", '{"d": [1, 2]}',
        "--limit-mm-per-prompt.image", "4",
        "--mm-processor-kwargs.max_pixels=1003520",
    )  # fmt: skip
    assert json.loads(ns.speculative_config) == {
        "model": "[ngram]",
        "num_speculative_tokens": 3,
        "a": {"b": True, "c": {"d": [1, 2]}},
    }
    multimodal = config_from(ns, MultiModalConfig)
    assert multimodal.limit_mm_per_prompt == {"image": 4}
    assert multimodal.mm_processor_kwargs == {"max_pixels": 1003520}


def test_the_dotted_form_serves_where_it_exited_2_before(monkeypatch):
    """`pagoda serve --speculative-config.method ngram ...` reaches the engine's config with that object."""
    import pagoda.cli.serve as serve_module

    seen = {}

    def stop(ns):
        seen["spec"] = parse_speculative_config(ns.speculative_config)
        raise SystemExit(0)  # the flags are answered; nothing is loaded

    monkeypatch.setattr(serve_module, "prepare", stop)
    argv = ["--speculative-config.method", "ngram", "--speculative-config.num_speculative_tokens", "4"]
    with pytest.raises(SystemExit) as exited:
        main(["serve", *argv])
    assert exited.value.code == 0
    assert (seen["spec"].method, seen["spec"].num_speculative_tokens) == ("ngram", 4)


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["--speculative-config", '{"method": "ngram"}', "--speculative-config.num_speculative_tokens", "4"],
            "--speculative-config is given both as one JSON value and as --speculative-config.KEY",
        ),
        (
            ["--limit-mm-per-prompt.image", "4", "--limit-mm-per-prompt=image=2"],
            "--limit-mm-per-prompt is given both as one JSON value and as --limit-mm-per-prompt.KEY",
        ),
        (["--speculative-config.method"], "--speculative-config.method: expected a value"),
    ],
)
def test_a_json_flag_given_whole_and_dotted_is_refused_in_one_line(argv, line, capsys):
    """vLLM's parser would keep only the dotted keys and drop the whole value without a word."""
    with pytest.raises(SystemExit) as exited:
        main(["serve", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("pagoda: error: " + line), err


def test_json_flags_are_the_knobs_that_take_a_json_object():
    """A new dict-typed knob of `pagoda serve` joins JSON_FLAGS, so that its dotted spelling works too."""
    knobs = {
        "--" + f.name.replace("_", "-")
        for cls in (EngineArgs, ServerConfig, MultiModalConfig)
        for f in dataclasses.fields(cls)
        if "help" in f.metadata and "dict" in str(f.type)
    }
    assert knobs == set(JSON_FLAGS)
    parser_flags = set(build_parser()._subparsers._group_actions[0].choices["serve"]._option_string_actions)
    assert knobs <= parser_flags
