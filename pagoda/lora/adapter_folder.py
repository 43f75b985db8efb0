"""A PEFT LoRA folder's config checked without the model and without torch: what the launcher and the API
processes verify when an adapter is named (`--lora-modules`, /v1/load_lora_adapter) before the engine reads
its weights (`lora/peft.py`)."""

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


def check_adapter_folder(request: LoRARequest, max_rank: int) -> tuple[Path, int, float]:
    """(folder, rank, scale) of an adapter's config, checked without the model (a server's startup check)."""
    folder = Path(request.lora_path).expanduser()
    if not folder.is_dir():
        raise adapter_failure(request, "no such folder")
    config = _config(request, folder)
    rank = int(config.get("r", 0))
    if rank < 1:
        raise adapter_failure(request, f"rank r={rank} in adapter_config.json is not positive")
    if rank > max_rank:
        raise adapter_failure(request, f"its rank {rank} is above --max-lora-rank {max_rank}; raise --max-lora-rank")
    alpha = float(config.get("lora_alpha", rank))
    return folder, rank, alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
