"""What Pagoda knows about each model family, in one place, from config.json alone (no torch).

Generic code asks `family_of(hf_config)` instead of recognising a model itself: the tokenizer loader
(a family with its own tokenizer), the chat-template check (the format the family is trained on),
the tensor-parallel rule (which MLP size the ranks split) and `pagoda doctor` (the token ids the
family's tokenizer must give). A model with no record here is served with the generic behaviour.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def _plain_mlp(cfg: dict[str, Any]) -> tuple[Any, str]:
    return cfg.get("intermediate_size"), "intermediate size {}"


def _yuan_mlp(cfg: dict[str, Any]) -> tuple[Any, str]:
    """M32 (MoE): each expert's FFN is split over the ranks; its unused `intermediate_size` is not."""
    moe = cfg.get("moe_config") or {}
    if bool(cfg.get("use_moe")) or int(moe.get("moe_num_experts") or 0) > 0:  # as models/yuan.py YuanShape
        return moe.get("ffn_hidden_size"), "the experts' FFN size {} (moe_config.ffn_hidden_size)"
    return _plain_mlp(cfg)


def _yuan_chat(rendered: str, user1: str, assistant1: str, user2: str) -> bool:
    return f"{user1}<n>{assistant1}<n>{user2}" in rendered and rendered.endswith(f"{user2}<sep>")


def _qwen_chat(rendered: str, user1: str, assistant1: str, user2: str) -> bool:
    return (
        f"<|im_start|>user\n{user1}" in rendered
        and f"<|im_start|>assistant\n{assistant1}" in rendered
        and f"<|im_start|>user\n{user2}" in rendered
        and rendered.endswith("<|im_start|>assistant\n")
    )


@dataclass(frozen=True)
class ModelFamily:
    name: str  # as messages name it: "Yuan2", "Qwen"
    # The chat format the family is trained on, in words, and a check that a rendered two-turn probe
    # conversation (user, assistant, user + generation prompt) has it; None: not known here.
    chat_format: str | None = None
    renders_chat: Callable[[str, str, str, str], bool] | None = None
    # Tokens whose ids the family's tokenizer must give (a wrong tokenizer shifts them).
    special_token_ids: dict[str, int] = field(default_factory=dict)
    # Pagoda builds the tokenizer itself (`frontend/yuan_tokenizer.py`), never the checkpoint's.
    own_tokenizer: bool = False
    # (size, phrase with {} for it) of the MLP dimension the tensor-parallel ranks split.
    mlp_split: Callable[[dict[str, Any]], tuple[Any, str]] = _plain_mlp
    # Layers carry a state per sequence from token to token (Yuan2's LF convolution): a step cannot take
    # back tokens it computed (speculative proposals that fail) without restoring that state.
    sequence_state: bool = False


YUAN2 = ModelFamily(
    "Yuan2",
    chat_format="the Yuan2 chat format (turns joined by the text <n>, the prompt ending in <sep>)",
    renders_chat=_yuan_chat,
    special_token_ids={"<eod>": 77185, "<sep>": 77187},
    own_tokenizer=True,
    mlp_split=_yuan_mlp,
    sequence_state=True,
)
QWEN = ModelFamily(
    "Qwen",
    chat_format="the Qwen chat format (<|im_start|>role\\n ... <|im_end|> turns, ending in <|im_start|>assistant\\n)",
    renders_chat=_qwen_chat,
)
GENERIC = ModelFamily("generic")
FAMILIES = {family.name: family for family in (YUAN2, QWEN)}


def family_of(hf_config: dict[str, Any]) -> ModelFamily:
    """The family of a config.json (`GENERIC` when Pagoda knows nothing special about it)."""
    architectures = [str(a) for a in hf_config.get("architectures") or []]
    model_type = str(hf_config.get("model_type") or "")
    if model_type == "yuan" or "YuanForCausalLM" in architectures:
        return YUAN2
    if any(name.lower().startswith("qwen") for name in [model_type, *architectures]):
        return QWEN
    return GENERIC
