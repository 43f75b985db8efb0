"""What a request names its adapter with (vLLM's `vllm.lora.request.LoRARequest`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pagoda.errors import ConfigError, InvalidRequest


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: what the API calls it (a request's `model`); lora_int_id: a positive integer unique per adapter
    (0 is the base model); lora_path: a PEFT folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise InvalidRequest("A LoRA request needs a name.", "lora_request")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidRequest(
                f"LoRA adapter {self.lora_name!r}: lora_int_id must be a positive integer, got {self.lora_int_id!r}.",
                "lora_request",
            )
        if not self.lora_path:
            raise InvalidRequest(f"LoRA adapter {self.lora_name!r} needs lora_path (a PEFT folder).", "lora_request")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def parse_lora_modules(items: tuple[str, ...] | list[str] | None) -> dict[str, LoRARequest]:
    """`--lora-modules` as vLLM spells it: `name=path` or `{"name": ..., "path": ...}` (its `base_model_name` is
    accepted; the base is this server's model). Ids are 1, 2, ... in the order given."""
    modules: dict[str, LoRARequest] = {}
    for item in items or ():
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                name, path = spec["name"], spec["path"]
            except (ValueError, KeyError, TypeError):
                raise ConfigError(
                    f'--lora-modules {item!r}: expected name=path or {{"name": ..., "path": ...}}', "lora_modules"
                ) from None
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"--lora-modules {item!r}: expected name=path", "lora_modules")
        if name in modules:
            raise ConfigError(f"--lora-modules names {name!r} twice", "lora_modules")
        modules[name] = LoRARequest(name, len(modules) + 1, path)
    return modules
