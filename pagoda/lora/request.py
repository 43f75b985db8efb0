"""What a request names its adapter with (vLLM's `vllm.lora.request.LoRARequest`), and which adapter a prompt
with images or video runs with when it names none (`--default-mm-loras`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from pagoda.errors import ConfigError, InvalidRequest

logger = logging.getLogger("pagoda")


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: what the API calls it (a request's `model`); lora_int_id: a positive integer unique per adapter
    (0 is the base model); lora_path: a PEFT folder; base_model_name: the name /v1/models gives as its parent (None:
    the first served name). vLLM has two fields between lora_path and base_model_name that Pagoda does not, so
    base_model_name is keyword-only: a positional call never binds it in their place. It is a label, not part of
    the adapter: it takes no part in equality (the engine tells adapters apart by id and folder). load_inplace
    (vLLM's): read the folder again though this id is loaded (its files changed); `LLMEngine.add_lora` does it,
    and `LLM.generate` calls that once per call for such a request."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = field(default=None, kw_only=True, compare=False)
    load_inplace: bool = field(default=False, kw_only=True, compare=False)
    # The id's epoch in the engine: how many times it was read again in place or removed before this read
    # (`LLMEngine.add_lora`). Part of equality and of the prefix-cache key, so no tensor-parallel rank keeps, and
    # no request hits, what the weights read before computed.
    epoch: int = field(default=0, init=False, repr=False)

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
        if self.base_model_name is not None and not isinstance(self.base_model_name, str):
            raise InvalidRequest(
                f"LoRA adapter {self.lora_name!r}: base_model_name must be a string, got {self.base_model_name!r}.",
                "lora_request",
            )

    def names_same_adapter(self, other: LoRARequest | None) -> bool:
        """Same name, id and folder, whatever the epoch."""
        return other is not None and (self.lora_name, self.lora_int_id, self.lora_path) == (
            other.lora_name,
            other.lora_int_id,
            other.lora_path,
        )

    def in_epoch(self, epoch: int) -> LoRARequest:
        """This request as the engine holds it in the id's epoch `epoch`."""
        copy = replace(self, load_inplace=False)
        object.__setattr__(copy, "epoch", epoch)
        return copy

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def parse_lora_modules(
    items: tuple[str, ...] | list[str] | None, default_mm_loras: tuple[tuple[str, str], ...] = ()
) -> dict[str, LoRARequest]:
    """`--lora-modules` as vLLM spells it: `name=path` or `{"name": ..., "path": ..., "base_model_name": ...}` (the
    optional `base_model_name` is the adapter's parent in /v1/models, as in vLLM; the adapter always runs on this
    server's model), then the `--default-mm-loras` adapters, named after their modality, as vLLM serves them. Ids
    are 1, 2, ... in that order."""
    modules: dict[str, LoRARequest] = {}
    for item in items or ():
        base_model_name = None
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                name, path = spec["name"], spec["path"]
                base_model_name = spec.get("base_model_name")
            except (ValueError, KeyError, TypeError):
                raise ConfigError(
                    f'--lora-modules {item!r}: expected name=path or {{"name": ..., "path": ...}}', "lora_modules"
                ) from None
            if not all(isinstance(v, str) and v for v in (name, path)) or not (
                base_model_name is None or isinstance(base_model_name, str)
            ):
                raise ConfigError(
                    f"--lora-modules {item!r}: name and path must be non-empty strings, base_model_name a string",
                    "lora_modules",
                )
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"--lora-modules {item!r}: expected name=path", "lora_modules")
        if name in modules:
            raise ConfigError(f"--lora-modules names {name!r} twice", "lora_modules")
        modules[name] = LoRARequest(name, len(modules) + 1, path, base_model_name=base_model_name or None)
    for modality, path in default_mm_loras:
        if modality in modules:
            raise ConfigError(
                f"--default-mm-loras {modality}: its adapter is served under the modality's name, which "
                "--lora-modules gives another adapter; rename that one",
                "default_mm_loras",
            )
        modules[modality] = LoRARequest(modality, len(modules) + 1, path)
    return modules


def offline_default_mm_loras(default_mm_loras: tuple[tuple[str, str], ...]) -> dict[str, LoRARequest]:
    """The `default_mm_loras` adapters of an offline `LLM`, as vLLM numbers them there: named after their modality,
    ids 1, 2, ... in the modalities' alphabetical order."""
    ordered = sorted(modality for modality, _ in default_mm_loras)
    return {m: LoRARequest(m, ordered.index(m) + 1, path) for m, path in default_mm_loras}


def default_mm_lora(adapters: Mapping[str, LoRARequest], modalities: Iterable[str]) -> LoRARequest | None:
    """The adapter a prompt with these modalities runs with when it names none: its one modality's among
    `adapters` (modality -> adapter); none when no modality has one, or when several do (one adapter per prompt, as
    in vLLM: logged)."""
    found = sorted({m for m in modalities if m in adapters})
    if len(found) > 1:
        logger.warning(
            "a prompt with %s has a default adapter for each (--default-mm-loras); a prompt runs with one adapter, so "
            "it runs with none of them",
            " and ".join(found),
        )
        return None
    return adapters[found[0]] if found else None
