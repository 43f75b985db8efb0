"""`run_checks`: every doctor check in order, each fed what the earlier ones found; a check never raises."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pagoda.config import EngineArgs
from pagoda.config.server import ServerConfig
from pagoda.tools.doctor.check import Check, State, is_qwen2_vl_config, is_yuan_config
from pagoda.tools.doctor.checksums import check_checksums
from pagoda.tools.doctor.fit import check_weights_match_model
from pagoda.tools.doctor.folder import (
    check_bin_files,
    check_index_consistency,
    check_permissions,
    check_safetensors,
    check_shards,
)
from pagoda.tools.doctor.machine import check_cuda, check_disk, check_port, check_shm
from pagoda.tools.doctor.model_config import (
    check_architecture,
    check_config,
    check_config_fields,
    check_pipeline_parallel,
    check_preprocessor,
    check_quantization,
    check_tensor_parallel,
    check_vision_config,
)
from pagoda.tools.doctor.tokenizer import check_chat_template, check_special_tokens, check_tokenizer, check_yuan_tokens

# The checks default to what `pagoda serve` would run with no flags (one place holds each default).
ENGINE_DEFAULTS = EngineArgs()
SERVER_DEFAULTS = ServerConfig()


def run_checks(
    model: str | None,
    *,
    port: int | None = None,
    tensor_parallel_size: int = ENGINE_DEFAULTS.tensor_parallel_size,
    pipeline_parallel_size: int = ENGINE_DEFAULTS.pipeline_parallel_size,
    distributed_executor_backend: str = ENGINE_DEFAULTS.distributed_executor_backend,
    fast: bool = False,
    tokenizer: str | None = ENGINE_DEFAULTS.tokenizer,
    host: str = SERVER_DEFAULTS.host,
    device: str = ENGINE_DEFAULTS.device,
    skip_tokenizer_init: bool = ENGINE_DEFAULTS.skip_tokenizer_init,
    chat_template: str | None = SERVER_DEFAULTS.chat_template,
    trust_remote_code: bool = ENGINE_DEFAULTS.trust_remote_code,
    load_format: str = ENGINE_DEFAULTS.load_format,
    checksums: bool = True,
    state: State | None = None,
) -> list[Check]:
    """All checks in order; `fast` keeps the subset `pagoda serve` runs before loading weights (which never
    hashes the shards); `checksums=False` skips hashing them (`--no-checksums`).

    `model` is an HF folder, hub id or .gguf file (None: the embedded default model), as for serve. `state`: the
    caller's, to keep what the checks loaded (the tokenizer); by default a fresh one.
    """
    state = state if state is not None else State(model=model, tokenizer_path=tokenizer)
    out: list[Check] = []

    def run(name: str, fn: Callable[[], Iterable[Check] | Check | None]) -> None:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - the report must always be complete
            out.append(
                Check(
                    name,
                    "FAIL",
                    f"unexpected error: {type(exc).__name__}: {exc}",
                    "report this as a Pagoda bug, with the model folder's file listing",
                )
            )
            return
        if isinstance(result, Check):
            out.append(result)
        elif result is not None:
            out.extend(result)

    run("config", lambda: check_config(state))
    if state.source is not None:
        run("architecture", lambda: check_architecture(state.hf_config))
        run("config fields", lambda: check_config_fields(state.hf_config))
        run("quantization", lambda: check_quantization(state, load_format))
        if is_qwen2_vl_config(state.hf_config):
            run("vision config", lambda: check_vision_config(state.hf_config))
            run("preprocessor config", lambda: check_preprocessor(state))
        if tensor_parallel_size != 1:
            run("tensor parallel", lambda: check_tensor_parallel(state.hf_config, tensor_parallel_size))
        if pipeline_parallel_size != 1:
            run(
                "pipeline parallel",
                lambda: check_pipeline_parallel(
                    state, pipeline_parallel_size, tensor_parallel_size, device, load_format, footprint=not fast
                ),
            )
        if load_format == "dummy":
            out.append(Check("shards", "ok", "--load-format dummy: random weights, no checkpoint is read", None))
        else:
            run("shards", lambda: check_shards(state))
        run("permissions", lambda: check_permissions(state, skip_tokenizer_init))
        if state.weight_format == "safetensors" and state.weight_files:
            run("safetensors", lambda: check_safetensors(state))
            run("index", lambda: check_index_consistency(state))
        elif state.weight_format == "bin" and state.weight_files:
            run("pytorch bin", lambda: check_bin_files(state))
        if not fast and checksums and state.weight_files and load_format != "dummy":
            run("checksums", lambda: check_checksums(state))
        quantized = any(c.name == "quantization" for c in out)
        # A quantized checkpoint's tensors are not the unquantized model's: the quantization check covers them.
        if not fast and state.headers_complete and not quantized:
            run("checkpoint vs model", lambda: check_weights_match_model(state))
        run("disk", lambda: check_disk(state))
        if skip_tokenizer_init:
            out.append(Check("tokenizer", "ok", "skipped (--skip-tokenizer-init: token-id prompts only)", None))
        else:
            run("tokenizer", lambda: check_tokenizer(state, trust_remote_code))
            if state.tokenizer is not None:
                run("special tokens", lambda: check_special_tokens(state))
                if is_yuan_config(state.hf_config):
                    run("yuan tokens", lambda: check_yuan_tokens(state.tokenizer))
                if not fast:
                    run("chat template", lambda: check_chat_template(state, chat_template))
    if not fast:
        tp, pp = tensor_parallel_size, pipeline_parallel_size
        run("cuda", lambda: check_cuda(state, device, tp, pp, distributed_executor_backend))
    if port is not None:
        run("port", lambda: check_port(host, port))
    if tensor_parallel_size * pipeline_parallel_size > 1:
        run("/dev/shm", check_shm)
    return out
