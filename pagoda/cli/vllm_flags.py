"""`vllm serve`'s flags that `pagoda serve` does not have: each is recognised and answered, none is silently ignored.

A flag in `REFUSED` stops the server before anything loads: one line per flag naming why, the flags of one
feature together, exit 2. A flag in `IGNORED` only tunes a vLLM mechanism Pagoda does not have (its CUDA-graph
sizes, its compile levels, its cache of preprocessed images...), so dropping it changes no answer: it is accepted
with one warning line. docs/serving.md lists both.

Each entry is one feature's reason and its flags, written as `vllm serve --help` spells them:
- `--name` takes one value; `--name+` takes one or more (`--lora-modules a=/x b=/y`);
- `--name?` is a switch, and its `--no-name` form asks for what Pagoda does anyway, so it is accepted silently;
- `-x` after a name is its short alias; `=a,b` lists the values that ask for what Pagoda does anyway (accepted
  silently too: `--data-parallel-size 1`, `--swap-space 0`).

Flags `pagoda serve` already has are skipped when the parser is built, so Pagoda implementing one of these needs
no edit here. vLLM's `--json-flag.key value` spelling (`undot`): for Pagoda's own JSON-valued flags (`JSON_FLAGS`)
the keys are gathered into one JSON object, as vLLM's parser does; for the flags here the key is dropped, since
the flag is refused or ignored by name whatever its value.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from pagoda.config.engine import SWAP_SPACE_REASON

# (reason, flags): each flag's line is "--flag: reason".
REFUSED: tuple[tuple[str, str], ...] = (
    (
        "adapters that add tokens to the vocabulary are not supported (PEFT folders without extra tokens are)",
        "--lora-extra-vocab-size",
    ),
    (
        "not built: adapters are sharded under tensor parallelism as vLLM shards them without this flag (B with "
        "column-parallel layers, A with row-parallel ones)",
        "--fully-sharded-loras?",
    ),
    (
        "data parallelism is not supported: run one server per replica behind `pagoda router`",
        "--data-parallel-size -dp =1 --data-parallel-rank -dpn --data-parallel-start-rank -dpr "
        "--data-parallel-size-local -dpl --data-parallel-address -dpa --data-parallel-rpc-port -dpp "
        "--data-parallel-backend -dpb --data-parallel-hybrid-lb? --data-parallel-external-lb? --headless?",
    ),
    (
        "expert parallelism is not supported (MoE experts are split by tensor parallelism)",
        "--enable-expert-parallel? --all2all-backend --enable-eplb? --eplb-config --expert-placement-strategy "
        "--num-redundant-experts --eplb-window-size --eplb-step-interval --eplb-log-balancedness? "
        "--enable-elastic-ep? --enable-return-routed-experts?",
    ),
    (
        "context parallelism is not supported",
        "--decode-context-parallel-size -dcp =1 --prefill-context-parallel-size -pcp =1",
    ),
    (
        "multi-node launch is not supported: tensor parallelism across machines uses "
        "--distributed-executor-backend ray",
        "--nnodes =1 --node-rank =0 --master-addr --master-port",
    ),
    (
        "disaggregated prefill (KV transfer) and KV events are not supported",
        "--kv-transfer-config --kv-events-config",
    ),
    ("KV cache offloading to CPU memory is not supported", "--kv-offloading-size --kv-offloading-backend"),
    (SWAP_SPACE_REASON, "--swap-space =0"),
    (
        "the KV cache is sized by --gpu-memory-utilization (or --num-gpu-blocks-override), not in bytes",
        "--kv-cache-memory-bytes",
    ),
    (
        "KV cache scales come from the checkpoint (k_scale/v_scale) or are 1.0; they are not computed at run time",
        "--calculate-kv-scales?",
    ),
    (
        "only text generation is served (no pooling, embedding or scoring runners)",
        "--runner =generate,auto --convert =none,auto --task =generate,auto --pooler-config --override-pooler-config",
    ),
    (
        "Pagoda runs its own model implementations, never code from a model folder or a plugin",
        "--model-impl =auto,vllm --worker-cls =auto --worker-extension-cls --scheduler-cls --io-processor-plugin "
        "--logits-processors+ --logits-processor-pattern --tool-parser-plugin --reasoning-parser-plugin "
        "--middleware --additional-config",
    ),
    (
        "the model's config.json is used as it is: edit a copy of the folder to change it",
        "--hf-overrides --rope-scaling --rope-theta --hf-config-path --config-format =auto,hf "
        "--override-attention-dtype",
    ),
    (
        "hub revisions are not supported: download the revision and pass its folder",
        "--revision --code-revision --tokenizer-revision",
    ),
    (
        "hub downloads use huggingface_hub's own settings: set HF_TOKEN / HF_HUB_CACHE instead",
        "--hf-token --download-dir",
    ),
    (
        "loading options beyond --load-format are not supported",
        "--model-loader-extra-config --ignore-patterns+",
    ),
    (
        "the tokenizer is the model's own (transformers' fast tokenizer, or Yuan2's)",
        "--tokenizer-mode =auto,hf",
    ),
    ("prompt embeddings are not supported", "--enable-prompt-embeds? --enable-mm-embeds?"),
    ("reasoning parsers are not supported yet", "--reasoning-parser"),
    (
        "structured output has one backend; its vLLM options are not supported",
        "--structured-outputs-config --guided-decoding-disable-any-whitespace? "
        "--guided-decoding-disable-additional-properties?",
    ),
    ("generation defaults come from --generation-config only", "--override-generation-config"),
    (
        "logprobs are the model's raw log-probabilities, at most 20 per token",
        "--max-logprobs =20 --logprobs-mode =raw_logprobs",
    ),
    ("multimodal input options beyond --mm-processor-kwargs are not supported", "--media-io-kwargs"),
    ("video frame pruning is not supported", "--video-pruning-rate =0,0.0"),
    ("interleaving images and text in one prompt string is not supported", "--interleave-mm-strings?"),
    ("media URLs cannot be limited to domains (see --allow-private-media-urls)", "--allowed-media-domains+"),
    ("sleep mode is not supported", "--enable-sleep-mode?"),
    (
        "TLS is not supported: terminate it in a proxy in front of the server",
        "--ssl-keyfile --ssl-certfile --ssl-ca-certs --ssl-cert-reqs --ssl-ciphers --enable-ssl-refresh?",
    ),
    ("a Unix domain socket is not supported: use --host and --port", "--uds"),
    (
        "CORS headers are not supported: add them in a proxy in front of the server",
        "--allowed-origins --allowed-methods --allowed-headers --allow-credentials?",
    ),
    ("a path prefix is not supported: strip it in a proxy in front of the server", "--root-path"),
    ("reading flags from a YAML file is not supported: pass them on the command line", "--config"),
    ("a logging config file is not supported", "--log-config-file"),
    ("logging model outputs is not supported", "--enable-log-outputs?"),
    ("the assistant role is always 'assistant'", "--response-role =assistant"),
    (
        "message content is rendered as the chat template expects it; the format cannot be forced",
        "--chat-template-content-format =auto",
    ),
    ("default chat template arguments are not supported", "--default-chat-template-kwargs"),
    ("tool definitions are not dropped when tool_choice is none", "--exclude-tools-when-tool-choice-none?"),
    ("built-in tool servers (MCP) are not supported", "--tool-server"),
    (
        "this usage and response detail is not supported",
        "--enable-prompt-tokens-details? --enable-force-include-usage? --return-tokens-as-token-ids? "
        "--enable-request-id-headers?",
    ),
    (
        "this endpoint is not served",
        "--enable-server-load-tracking? --enable-tokenizer-info-endpoint? --tokens-only?",
    ),
    ("the OpenAPI documentation routes cannot be turned off", "--disable-fastapi-docs?"),
    ("OpenTelemetry tracing is not supported", "--otlp-traces-endpoint --collect-detailed-traces"),
)

IGNORED: tuple[tuple[str, str], ...] = (
    (
        "CUDA graph capture sizes and compile levels: Pagoda captures its own decode graphs (--enforce-eager "
        "turns them off)",
        "--compilation-config -O --cudagraph-capture-sizes+ --cuda-graph-sizes+ "
        "--max-seq-len-to-capture --optimization-level",
    ),
    (
        "vLLM's scheduler tuning (partial prefills, lookahead, micro-batching, stream chunking)",
        "--max-num-partial-prefills --max-long-partial-prefills --long-prefill-token-threshold "
        "--num-lookahead-slots --disable-chunked-mm-input? --disable-hybrid-kv-cache-manager? "
        "--disable-cascade-attn? --kv-sharing-fast-prefill? --enable-dbo? --dbo-decode-token-threshold "
        "--dbo-prefill-token-threshold --ubatch-size --stream-interval --disable-async-output-proc? "
        "--num-scheduler-steps --use-v2-block-manager? --preemption-mode "
        "--scheduler-reserve-full-isl?",
    ),
    ("vLLM's prefix-cache hash choice (Pagoda hashes blocks its own way)", "--prefix-caching-hash-algo"),
    (
        "vLLM's collective and loading tuning",
        "--disable-custom-all-reduce? --disable-nccl-for-dp-synchronization? --max-parallel-loading-workers "
        "--ray-workers-use-nsight? --safetensors-load-strategy --use-tqdm-on-load? --pt-load-map-location "
        "--dcp-kv-cache-interleave-size --cp-kv-cache-interleave-size",
    ),
    (
        "vLLM's multimodal preprocessor cache and encoder placement (Pagoda keeps no such cache)",
        "--mm-processor-cache-gb --disable-mm-preprocessor-cache? --mm-processor-cache-type "
        "--mm-shm-cache-max-object-size-mb --mm-encoder-tp-mode --mm-encoder-attn-backend --skip-mm-profiling? "
        "--enable-multimodal-encoder-data-parallel?",
    ),
    ("no Mamba models are served", "--mamba-cache-dtype --mamba-ssm-cache-dtype --mamba-block-size"),
    (
        "structured output has one backend (no fallback to choose)",
        "--guided-decoding-backend --guided-decoding-disable-fallback?",
    ),
    ("there is no sliding-window attention to disable", "--disable-sliding-window?"),
    (
        "vLLM's logging and metrics switches (Pagoda's /metrics and logs are fixed)",
        "--disable-uvicorn-access-log? --disable-access-log-for-endpoints --max-log-len --log-error-stack? "
        "--aggregate-engine-logging? --show-hidden-metrics-for-version --kv-cache-metrics? "
        "--kv-cache-metrics-sample --cudagraph-metrics? --enable-mfu-metrics? --enable-layerwise-nvtx-tracing? "
        "--enable-offline-docs?",
    ),
    ("the API always runs in its own process(es)", "--disable-frontend-multiprocessing?"),
)

_DEST = "vllm_only__"  # Namespace attributes of these flags: never a config field's name


@dataclasses.dataclass(frozen=True)
class VllmFlag:
    name: str  # "--enable-lora"
    aliases: tuple[str, ...]  # short spellings: ("-dp",)
    reason: str
    ignored: bool  # True: accepted with a warning; False: refused
    switch: bool  # takes no value (and has a --no- form)
    many: bool  # takes one or more values
    same: tuple[str, ...]  # values that ask for what Pagoda does anyway

    @property
    def dest(self) -> str:
        return _DEST + self.name[2:].replace("-", "_")


def _parse(table: tuple[tuple[str, str], ...], ignored: bool) -> list[VllmFlag]:
    flags: list[VllmFlag] = []
    for reason, spec in table:
        for token in spec.split():
            if token.startswith("--"):
                name = token.rstrip("?+")
                flags.append(VllmFlag(name, (), reason, ignored, token.endswith("?"), token.endswith("+"), ()))
            elif token.startswith("-"):
                flags[-1] = dataclasses.replace(flags[-1], aliases=(*flags[-1].aliases, token))
            elif token.startswith("="):
                flags[-1] = dataclasses.replace(flags[-1], same=tuple(token[1:].split(",")))
            else:
                raise ValueError(f"bad flag spec {token!r} in {spec!r}")
    return flags


FLAGS: tuple[VllmFlag, ...] = (*_parse(REFUSED, ignored=False), *_parse(IGNORED, ignored=True))


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Register every vLLM flag the parser does not have yet, hidden from --help (docs/serving.md lists them)."""
    taken = set(parser._option_string_actions)
    for flag in FLAGS:
        names = [n for n in (flag.name, *flag.aliases) if n not in taken]
        if flag.name not in names:
            continue  # Pagoda has this flag itself
        if flag.switch:
            parser.add_argument(*names, dest=flag.dest, action="store_const", const=True, help=argparse.SUPPRESS)
            no = "--no-" + flag.name[2:]
            if no not in taken:
                parser.add_argument(no, dest=flag.dest, action="store_const", const=False, help=argparse.SUPPRESS)
        else:
            # "?": a value that looks like a flag or is missing still parses, so every flag of the command line
            # gets its line instead of argparse stopping at the first.
            shape = {"nargs": "*"} if flag.many else {"nargs": "?", "const": ""}
            parser.add_argument(*names, dest=flag.dest, help=argparse.SUPPRESS, **shape)  # type: ignore[arg-type]
        parser.set_defaults(**{flag.dest: None})


# Pagoda's own flags whose value is a JSON object (the config fields typed dict; tests/unit/test_vllm_flags.py
# checks the list against them): vLLM's `--flag.key value` spellings of these are gathered into one object.
JSON_FLAGS = ("--speculative-config", "--limit-mm-per-prompt", "--mm-processor-kwargs", "--default-mm-loras")

# `--flag.key[.key...]` with an optional `=value`: the flag name, its dotted keys, the value.
_DOTTED = re.compile(r"(--[a-z0-9-]+)((?:\.[A-Za-z0-9_-]+)+)(?:=(.*))?$", re.DOTALL)


def undot(argv: Sequence[str]) -> list[str]:
    """vLLM's dotted spelling of JSON-valued flags, as its parser reads it.

    `--speculative-config.method ngram --speculative-config.num_speculative_tokens 4` becomes one
    `--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'`, where the first dotted key stood:
    each value is read as JSON when it parses (4, true, {...}), else kept as a string; `--flag.a.b x` nests
    ({"a": {"b": "x"}}); a key given twice keeps its last value. A flag given both whole and dotted is refused
    (exit 2, one line): vLLM's parser would keep only the dotted keys and drop the whole value silently.
    For vLLM's flags that Pagoda lacks (`FLAGS`) the key is dropped: `--compilation-config.level 3` is
    `--compilation-config 3`, answered by name."""
    vllm_names = {f.name for f in FLAGS}
    out: list[str] = []
    gathered: dict[str, dict[str, Any]] = {}  # flag -> the object its dotted keys built
    at: dict[str, int] = {}  # flag -> where in `out` its object goes (its first dotted key's place)
    whole: set[str] = set()  # JSON flags also given as one value
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token == "--":  # positionals only from here
            out.extend(argv[i - 1 :])
            break
        if (name := token.split("=", 1)[0]) in JSON_FLAGS:
            whole.add(name)
        m = _DOTTED.match(token)
        if m is None or m.group(1) not in (*JSON_FLAGS, *vllm_names):
            out.append(token)
            continue
        flag, keys, value = m.group(1), m.group(2)[1:].split("."), m.group(3)
        if flag in vllm_names:
            out.append(flag + ("" if value is None else "=" + value))
            continue
        if value is None:
            if i >= len(argv) or argv[i].startswith("--"):
                _refuse(f"{token}: expected a value ({token} VALUE or {token}=VALUE)")
            value = argv[i]
            i += 1
        if flag not in at:
            at[flag] = len(out)
            out.append(flag)  # the placeholder its object replaces
        _set_key(gathered.setdefault(flag, {}), keys, _json_or_text(value))
    for flag in at:
        if flag in whole:
            _refuse(
                f"{flag} is given both as one JSON value and as {flag}.KEY: give all its keys one way "
                f"(vLLM would keep only the {flag}.KEY ones)"
            )
    for flag, place in sorted(at.items(), key=lambda item: -item[1]):
        out[place : place + 1] = [flag, json.dumps(gathered[flag])]
    return out


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


def _set_key(obj: dict[str, Any], keys: list[str], value: Any) -> None:
    """obj[k1][k2]...[kn] = value, making (or replacing a non-object with) the objects between."""
    for key in keys[:-1]:
        if not isinstance(obj.get(key), dict):
            obj[key] = {}
        obj = obj[key]
    obj[keys[-1]] = value


def _refuse(line: str) -> NoReturn:
    """A user mistake found before the parser runs: one line and exit 2, as argparse's own errors do."""
    print(f"pagoda: error: {line}", file=sys.stderr)
    raise SystemExit(2)


def vllm_only_flags(ns: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The lines for the vLLM-only flags given: (refusals, warnings), in table order (one feature's together).

    A switch's --no- form and a value in `same` ask for what Pagoda does: no line."""
    refusals: list[str] = []
    warnings: list[str] = []
    for flag in FLAGS:
        value = getattr(ns, flag.dest, None)
        if value is None or value is False:
            continue
        if flag.same and isinstance(value, str) and value in flag.same:
            continue
        if flag.ignored:
            warnings.append(f"{flag.name}: ignored ({flag.reason})")
        else:
            refusals.append(f"{flag.name}: {flag.reason}")
    return refusals, warnings
