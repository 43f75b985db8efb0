"""Doctor's checks of the model's config: config.json (or the GGUF header) parses, the architecture is served,
its fields are consistent, its quantization, vision and preprocessor configs, and the tensor- and pipeline-parallel
splits."""

from __future__ import annotations

import json
import os
from typing import Any

from pagoda.config import text_field
from pagoda.config.engine import auto_dtype
from pagoda.config.parallel import pipeline_parallel_error, tensor_parallel_error
from pagoda.config.quantization import resolve_quantization
from pagoda.distributed.stages import stage_layer_range
from pagoda.errors import ModelLoadError, PagodaError
from pagoda.tools.doctor.check import (
    Check,
    State,
    is_qwen2_vl_config,
    is_yuan_config,
    positive_int,
    read_fix,
    unreadable_reason,
)
from pagoda.tools.plan import describe_stage, pipeline_stages


def check_config(state: State) -> Check:
    from pagoda.models.source import ModelSource, resolve_model_source  # lazy: torch (`pagoda` starts without it)

    model = state.model
    if model is None or model.endswith(".gguf"):
        return check_gguf_config(state)
    if os.path.isdir(model):
        path = os.path.join(model, "config.json")
        if not os.path.lexists(path):
            return Check(
                "config",
                "FAIL",
                f"{model} has no config.json",
                "pass an HF model folder (with config.json) or a .gguf file; re-download the model",
            )
        problem = unreadable_reason(path)
        if problem:
            return Check("config", "FAIL", f"config.json {problem}", read_fix(path))
        try:
            with open(path, encoding="utf-8") as f:
                hf_config = json.load(f)
        except ValueError as exc:
            return Check(
                "config",
                "FAIL",
                f"config.json is not valid JSON ({exc})",
                "re-download config.json or fix the syntax error",
            )
        if not isinstance(hf_config, dict):
            return Check(
                "config",
                "FAIL",
                f"config.json holds a {type(hf_config).__name__}, not a JSON object",
                "re-download config.json",
            )
        state.source = ModelSource(location=model, kind="hf", hf_config=hf_config)
        return Check("config", "ok", f"{path} parses", None)
    if model.startswith(("/", ".", "~")) or model.count("/") > 1 or os.path.exists(model):
        return Check(
            "config",
            "FAIL",
            f"model folder {model!r} does not exist",
            "pass the path of a downloaded model folder, a hub id, or a .gguf file",
        )
    try:
        state.source = resolve_model_source(model)  # a hub id: the local cache first, then the hub
    except (PagodaError, OSError, ValueError) as exc:
        return Check("config", "FAIL", str(exc), "download the model and pass its folder")
    return Check("config", "ok", f"{model} → {state.source.location}", None)


def check_gguf_config(state: State) -> Check:
    from pagoda.models.gguf_checkpoint import default_gguf_path, read_gguf_config  # lazy: torch
    from pagoda.models.source import ModelSource  # lazy: torch (`pagoda` starts without it)

    try:
        path = state.model if state.model is not None else default_gguf_path()
    except PagodaError as exc:
        return Check("config", "FAIL", exc.message, "pass a model folder or .gguf file")
    if not os.path.lexists(path):
        return Check("config", "FAIL", f"GGUF file {path!r} does not exist", "pass an existing .gguf file")
    problem = unreadable_reason(path)
    if problem:
        return Check("config", "FAIL", f"{path} {problem}", read_fix(path))
    try:
        hf_config = read_gguf_config(path)
    except PagodaError as exc:
        return Check("config", "FAIL", f"{path}: {exc.message}", "re-convert or re-download the GGUF file")
    except Exception as exc:  # noqa: BLE001 - the GGUF reader raises plain errors on damaged files
        return Check(
            "config",
            "FAIL",
            f"{path}: the GGUF reader cannot parse it ({type(exc).__name__}: {exc})",
            "re-download the GGUF file (it is damaged or truncated)",
        )
    state.source = ModelSource(location=path, kind="gguf", hf_config=hf_config)
    state.weight_format, state.weight_files = "gguf", [path]
    label = "embedded default model " if state.model is None else ""
    return Check("config", "ok", f"{label}{path}: GGUF metadata read", None)


def check_architecture(hf_config: dict[str, Any]) -> Check:
    from pagoda.models.registry import supported_architectures  # lazy: the model table

    archs = hf_config.get("architectures")
    supported = supported_architectures()
    if not archs or not isinstance(archs, list):
        return Check(
            "architecture",
            "FAIL",
            'config.json has no "architectures" list',
            f'add "architectures": ["..."] naming one of {", ".join(supported)}',
        )
    if archs[0] not in supported:
        return Check(
            "architecture",
            "FAIL",
            f"{archs[0]} is not supported",
            f"Pagoda serves {', '.join(supported)}; pick a model of one of these architectures",
        )
    return Check("architecture", "ok", f"{archs[0]} is supported", None)


def check_config_fields(cfg: dict[str, Any]) -> Check:
    if is_yuan_config(cfg):
        from pagoda.models.yuan import YuanShape  # lazy: torch (`pagoda` starts without it)

        missing = [
            k
            for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")
            if not positive_int(cfg.get(k))
        ]
        if missing:
            return Check(
                "config fields",
                "FAIL",
                f"config.json lacks positive integers for {', '.join(missing)}",
                "re-download config.json",
            )
        try:
            shape = YuanShape(cfg)
        except PagodaError as exc:
            hint = "fix config.json (see docs/models.md, Yuan2: reading config.json)"
            return Check("config fields", "FAIL", exc.message, hint)
        kind = f"MoE {shape.num_experts} experts top-{shape.top_k}" if shape.use_moe else "dense"
        return Check(
            "config fields",
            "ok",
            f"Yuan2 {kind}: hidden {shape.hidden}, {shape.num_heads} heads, "
            f"{cfg['num_hidden_layers']} layers, vocab {cfg['vocab_size']}",
            None,
        )
    keys = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")
    values = {k: text_field(cfg, k) for k in keys}
    missing = [k for k, v in values.items() if not positive_int(v)]
    if missing:
        return Check(
            "config fields",
            "FAIL",
            f"config.json lacks positive integers for {', '.join(missing)}",
            "re-download config.json (a text model's config names all of them)",
        )
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    kv_heads = text_field(cfg, "num_key_value_heads", heads)
    head_dim = text_field(cfg, "head_dim")
    problems = []
    if not positive_int(kv_heads) or heads % kv_heads:
        problems.append(f"num_attention_heads {heads} must be a multiple of num_key_value_heads {kv_heads}")
    if head_dim is None and hidden % heads:
        problems.append(f"hidden_size {hidden} is not divisible by num_attention_heads {heads} (and no head_dim)")
    if head_dim is not None and not positive_int(head_dim):
        problems.append(f"head_dim {head_dim!r} must be a positive integer")
    if problems:
        return Check("config fields", "FAIL", "; ".join(problems), "fix config.json or re-download it")
    return Check(
        "config fields",
        "ok",
        f"hidden {hidden}, {heads} heads ({kv_heads} KV), "
        f"{values['num_hidden_layers']} layers, vocab {values['vocab_size']}",
        None,
    )


def check_quantization(state: State, load_format: str) -> Check | None:
    """A quantized checkpoint: the layout `pagoda serve` will run, or the one-line refusal it would give
    (rather than letting the tensor mismatch read as a damaged download). Silent for unquantized ones."""
    source = state.source
    try:
        config = resolve_quantization(
            None, source.location, source.kind, source.hf_config, read_tensor_names=load_format != "dummy"
        )
    except ModelLoadError as exc:
        return Check("quantization", "FAIL", exc.message, "use a checkpoint in one of the supported layouts")
    if config is None:
        return None
    return Check("quantization", "ok", config.describe(), None)


def check_vision_config(cfg: dict[str, Any]) -> Check:
    from pagoda.models.qwen2_vl_vision import vision_config_with_defaults  # lazy: torch (`pagoda` starts without it)

    if not isinstance(cfg.get("vision_config") or {}, dict):
        return Check("vision config", "FAIL", "config.json's vision_config is not an object", "re-download config.json")
    try:
        vision = vision_config_with_defaults(dict(cfg.get("vision_config") or {}), int(text_field(cfg, "hidden_size")))
    except PagodaError as exc:
        return Check("vision config", "FAIL", exc.message, "fix vision_config in config.json or re-download it")
    return Check(
        "vision config",
        "ok",
        f"depth {vision['depth']}, embed {vision['embed_dim']}, "
        f"{vision['num_heads']} heads, patch {vision['patch_size']}, merge {vision['spatial_merge_size']}, "
        f"output {vision['hidden_size']}",
        None,
    )


def check_preprocessor(state: State) -> Check:
    from pagoda.frontend.multimodal.image_processor import VisionPreprocessConfig  # lazy: PIL, numpy
    from pagoda.models.qwen2_vl_vision import vision_config_with_defaults  # lazy: torch (`pagoda` starts without it)

    folder = state.folder
    path = os.path.join(folder, "preprocessor_config.json")
    try:
        pre = VisionPreprocessConfig.from_model_folder(folder)
    except PagodaError as exc:
        return Check("preprocessor config", "FAIL", exc.message, "fix preprocessor_config.json or re-download it")
    where = "preprocessor_config.json" if os.path.isfile(path) else "no preprocessor_config.json: official defaults"
    try:
        vision = vision_config_with_defaults(
            dict(state.hf_config.get("vision_config") or {}), int(text_field(state.hf_config, "hidden_size"))
        )
    except (PagodaError, TypeError, ValueError):
        vision = None  # reported by the vision config check
    if vision is not None:
        clashes = [
            f"{key} {getattr(pre, key)} vs vision_config {vision[vkey]}"
            for key, vkey in (
                ("patch_size", "patch_size"),
                ("merge_size", "spatial_merge_size"),
                ("temporal_patch_size", "temporal_patch_size"),
            )
            if int(getattr(pre, key)) != int(vision[vkey])
        ]
        if clashes:
            return Check(
                "preprocessor config",
                "FAIL",
                f"{where} disagrees with config.json: {'; '.join(clashes)}",
                "the two files come from different checkpoints; re-download the model",
            )
    return Check(
        "preprocessor config",
        "ok",
        f"{where} (pixels {pre.min_pixels}..{pre.max_pixels}, patch {pre.patch_size}, merge {pre.merge_size})",
        None,
    )


def check_pipeline_parallel(
    state: State, pp: int, tp: int = 1, device: str = "auto", load_format: str = "auto", footprint: bool = True
) -> Check:
    """`pagoda serve`'s refusal (config/parallel.py), else each stage's decoder layers as serve splits them and,
    with `footprint`, each stage's weights and KV per GPU as `pagoda plan` counts them (`plan.pipeline_stages`:
    the meta-device model, so not in serve's fast preflight)."""
    cfg = state.hf_config
    error = pipeline_parallel_error(cfg, pp)
    if error is not None:
        return Check("pipeline parallel", "FAIL", error, "pass at most one stage per decoder layer")
    layers = int(text_field(cfg, "num_hidden_layers"))
    ends = f"(embedding on stage 0, LM head on {pp - 1})"
    stages = _stage_footprints(state, pp, tp, device, load_format) if footprint else None
    if stages is None:
        ranges = [stage_layer_range(layers, s, pp) for s in range(pp)]
        detail = "; ".join(f"stage {s}: layers {r.start}-{r.stop - 1}" for s, r in enumerate(ranges))
        return Check("pipeline parallel", "ok", f"{pp} stages: {detail} {ends}", None)
    dtype, numbers = stages
    detail = "; ".join(f"stage {s}: {describe_stage(st)}" for s, st in enumerate(numbers))
    gpus = f"{tp} GPU{'s' if tp > 1 else ''}"
    return Check("pipeline parallel", "ok", f"{pp} stages of {gpus} ({dtype}): {detail} {ends}", None)


def _stage_footprints(
    state: State, pp: int, tp: int, device: str, load_format: str
) -> tuple[str, list[dict[str, int]]] | None:
    """(the dtype serve would load in, `Plan.stages`); None when there are no per-GPU numbers to give (a
    tensor-parallel size below 1 or a quantized layout serve refuses: their own checks FAIL)."""
    import torch  # lazy: torch (`pagoda` starts without it)

    if tp < 1:
        return None
    cfg, source = state.hf_config, state.source
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    dtype = auto_dtype(cfg, "cpu" if on_cpu else "cuda")  # serve's --dtype auto
    try:
        quantization = resolve_quantization(
            None, source.location, source.kind, cfg, read_tensor_names=load_format != "dummy"
        )
        return dtype, pipeline_stages(
            cfg, tensor_parallel_size=tp, pipeline_parallel_size=pp, dtype=dtype, quantization=quantization
        )
    except PagodaError:
        return None


def check_tensor_parallel(cfg: dict[str, Any], tp: int) -> Check:
    """The rule `pagoda serve` refuses by (config/parallel.py): a FAIL carries serve's own refusal line."""
    error = tensor_parallel_error(cfg, tp)
    if error is not None:
        return Check("tensor parallel", "FAIL", error, "pass one of the valid sizes as --tensor-parallel-size")
    heads = int(text_field(cfg, "num_attention_heads"))
    kv = int(text_field(cfg, "num_key_value_heads") or heads)
    if kv >= tp:
        kv_split = f"{kv} KV heads split {kv // tp} per GPU"
    else:
        kv_split = f"{kv} KV heads replicated (each on {tp // kv} GPUs, 1 per GPU)"
    detail = f"{tp} GPUs: {heads} attention heads split {heads // tp} per GPU, {kv_split}"
    if is_qwen2_vl_config(cfg):
        detail += "; the vision tower is replicated on every GPU"
    return Check("tensor parallel", "ok", detail, None)
