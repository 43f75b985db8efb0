"""A PEFT LoRA folder's config checked without the model and without torch: what the launcher and the API
processes verify when an adapter is named (`--lora-modules`, /v1/load_lora_adapter) before the engine reads
its weights (`lora/peft.py`).

An adapter's path is a local folder or, as in vLLM, a Hugging Face hub id (`org/name`): the id resolves to its
snapshot in the local hub cache, fetched first if the network allows (`HF_HUB_OFFLINE=1` keeps to the cache)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from pagoda.errors import InvalidRequest
from pagoda.lora.request import LoRARequest


def adapter_failure(request: LoRARequest, why: str) -> InvalidRequest:
    return InvalidRequest(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {why}", "lora_request")


def _config(request: LoRARequest, folder: Path) -> dict:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise adapter_failure(request, "no adapter_config.json there (a PEFT LoRA folder is expected)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise adapter_failure(request, f"adapter_config.json is not readable JSON ({exc})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise adapter_failure(request, f"peft_type {config.get('peft_type')!r} is not LORA")
    unsupported = {
        "use_dora": "DoRA",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "modules_to_save": "fully trained modules (modules_to_save)",
    }
    for key, what in unsupported.items():
        if config.get(key):
            raise adapter_failure(request, f"{what} are not supported")
    if config.get("bias", "none") != "none":
        raise adapter_failure(request, f"trained biases (bias={config['bias']!r}) are not supported")
    return config


# What an adapter's snapshot needs: its config and one of the two weight files PEFT writes.
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"]


def adapter_folder(request: LoRARequest) -> Path:
    """The local folder of an adapter's path: the folder itself, or a hub id's snapshot."""
    folder = Path(request.lora_path).expanduser()
    if folder.is_dir():
        return folder
    path = request.lora_path
    if path.startswith(("/", ".", "~")) or path.count("/") != 1:
        raise adapter_failure(request, "no such folder")
    import huggingface_hub  # lazy: only for an adapter named by hub id

    try:
        return Path(huggingface_hub.snapshot_download(path, allow_patterns=ADAPTER_FILES))
    except Exception as exc:  # offline and not cached, unknown repo, auth...: the same to the user
        raise adapter_failure(
            request,
            f"no such folder, and {path!r} could not be fetched from the Hugging Face hub ({type(exc).__name__}); "
            "pass the path of a downloaded adapter folder",
        ) from None


def check_adapter_folder(request: LoRARequest, max_rank: int) -> tuple[Path, int, float]:
    """(folder, rank, scale) of an adapter's config, checked without the model (a server's startup check)."""
    folder = adapter_folder(request)
    config = _config(request, folder)
    rank = int(config.get("r", 0))
    if rank < 1:
        raise adapter_failure(request, f"rank r={rank} in adapter_config.json is not positive")
    if rank > max_rank:
        raise adapter_failure(request, f"its rank {rank} is above --max-lora-rank {max_rank}; raise --max-lora-rank")
    alpha = float(config.get("lora_alpha", rank))
    return folder, rank, alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
