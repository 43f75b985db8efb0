"""What a request names its adapter with (vLLM's `vllm.lora.request.LoRARequest`)."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.errors import InvalidRequest


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
