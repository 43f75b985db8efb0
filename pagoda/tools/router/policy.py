"""Which backend serves a request: session keys, the consistent-hash ring, bounded load, other policies.

Session key (policy "session"), first match wins:
  1. the `X-Session-ID` header (name configurable),
  2. the OpenAI `user` field,
  3. a conversation fingerprint: sha256 of the model, the system/developer messages and the first user
     message (text, plus a hash of each image URL). Every turn of a chat resends that opening, so a
     conversation keeps its backend without any client change.
  Without any of these (e.g. an empty prompt) the request goes to the least-loaded backend.

Policy "prefix": the key is a hash of the model and the first `prefix_chars` characters of the same
rendered opening ("role\\ntext\\n" per message; a completion's prompt as is), ignoring session ids, so
different conversations that share a long system prompt land where that prefix is already cached.

Ring: uhashring (md5, 160 points per backend times its weight). Its points depend only on backend names,
so adding or removing a backend moves only the keys that land on that backend's points. When the
owner is not available (ejected by probes, breaker open) the key walks the ring to the next available
backend. Bounded load: when the chosen backend would hold more than max(ceil(load_factor * mean), load_floor)
requests in flight (mean over the available backends, counting this request), the request goes to the
least-loaded available backend instead. The floor keeps a few concurrent requests of one session together
on an idle cluster, where continuous batching makes them nearly free. The rest of the ring order is the
retry order.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagoda.tools.router.health import Backend

KEY_SOURCES = ("header", "user", "fingerprint", "prefix", "none")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def content_text(content: Any) -> str:
    """Text of an OpenAI message content (string or list of parts); images become a short hash of their URL."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    out = []
    for part in content:
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind == "text":
            out.append(str(part.get("text", "")))
        else:
            ref = part.get(kind) if isinstance(kind, str) else None
            url = ref.get("url") if isinstance(ref, dict) else ref
            out.append(f"<{kind}:{_sha(str(url))[:16]}>")
    return "".join(out)


def opening(body: dict[str, Any]) -> str | None:
    """The rendered start of a conversation: system/developer messages up to and including the first user
    message, "role\\ntext\\n" each; for /v1/completions the (first) prompt. None when there is nothing."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            role = m.get("role")
            if role in ("system", "developer", "user"):
                parts.append(f"{role}\n{content_text(m.get('content'))}\n")
                if role == "user":
                    break
        return "".join(parts) or None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if isinstance(prompt[0], (str, list)) else prompt  # batch of prompts or token ids
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt) or None
    if isinstance(prompt, str) and prompt:
        return prompt
    return None


def request_chars(body: dict[str, Any]) -> int:
    """Characters of all message text (or of the prompts): what the long-request limit compares."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(len(content_text(m.get("content"))) for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(p) if isinstance(p, (str, list)) else 1 for p in prompt)
    return 0


def session_key(body: dict[str, Any], header_value: str | None) -> tuple[str | None, str]:
    """(ring key, source) for the "session" policy."""
    if header_value:
        return "s:" + header_value, "header"
    user = body.get("user")
    if isinstance(user, str) and user:
        return "u:" + user, "user"
    start = opening(body)
    if start is not None:
        return "f:" + _sha(f"{body.get('model')}\x00{start}"), "fingerprint"
    return None, "none"


def prefix_key(body: dict[str, Any], prefix_chars: int) -> tuple[str | None, str]:
    """(ring key, source) for the "prefix" policy."""
    start = opening(body)
    if start is None:
        return None, "none"
    return "p:" + _sha(f"{body.get('model')}\x00{start[:prefix_chars]}"), "prefix"


@dataclass
class Plan:
    order: list[Backend]  # the chosen backend first, then the retry order
    owner: str | None  # the ring owner of the key (None without a key or a ring policy)
    affinity: str  # "hit": chosen == owner; "miss": moved (owner unavailable or over the bound); "none"


class Balancer:
    def __init__(self, policy: str, vnodes: int = 160, load_factor: float = 1.25, load_floor: int = 4):
        self.policy = policy
        self.vnodes = vnodes
        self.load_factor = load_factor
        self.load_floor = load_floor
        self._ring: Any = None
        self._by_name: dict[str, Backend] = {}
        self._rr = itertools.count()

    def set_backends(self, backends: Sequence[Backend]) -> None:
        from uhashring import HashRing  # lazy: optional (uhashring), only the session policy's ring

        self._by_name = {b.name: b for b in backends}
        nodes = {b.name: {"instance": b.name, "vnodes": self.vnodes, "weight": b.cfg.weight} for b in backends}
        self._ring = HashRing(nodes=nodes) if nodes else None

    def ring_order(self, key: str) -> list[str]:
        """Backend names in ring order from the key's position (the first is the key's owner)."""
        if self._ring is None:
            return []
        return list(self._ring.iterate_nodes(key))

    def owner(self, key: str) -> str | None:
        return self._ring.get_node(key) if self._ring is not None else None

    def plan(self, key: str | None, candidates: Sequence[Backend], now: float | None = None) -> Plan:
        """Order `candidates` (backends that may serve the request's model) for this request."""
        pool = [b for b in candidates if b.available(now)]
        if not pool:  # nothing passes health + breaker: try the healthy ones, then anything
            pool = [b for b in candidates if b.healthy] or list(candidates)
        if not pool:
            return Plan([], None, "none")
        if self.policy in ("session", "prefix") and key is not None and self._ring is not None:
            return self._plan_ring(key, pool)
        if self.policy == "round-robin":
            start = next(self._rr) % len(pool)
            return Plan(pool[start:] + pool[:start], None, "none")
        return Plan(self._least_loaded(pool), None, "none")

    def _least_loaded(self, pool: list[Backend]) -> list[Backend]:
        # Ties rotate, so idle backends share the work instead of the first one taking it all.
        offset = next(self._rr)
        n = len(pool)
        ranked = sorted(range(n), key=lambda i: (pool[i].inflight, (i - offset) % n))
        return [pool[i] for i in ranked]

    def _plan_ring(self, key: str, pool: list[Backend]) -> Plan:
        allowed = {b.name for b in pool}
        names = self.ring_order(key)
        owner = names[0] if names else None
        order = [self._by_name[n] for n in names if n in allowed]
        order += [b for b in pool if b.name not in self._by_name]  # not on the ring (should not happen)
        chosen = order[0]
        if self.load_factor and len(pool) > 1:
            total = sum(b.inflight for b in pool)
            bound = max(math.ceil(self.load_factor * (total + 1) / len(pool)), self.load_floor)
            if chosen.inflight + 1 > bound:
                chosen = min(order, key=lambda b: b.inflight)  # ring order breaks ties
                order = [chosen] + [b for b in order if b is not chosen]
        return Plan(order, owner, "hit" if chosen.name == owner else "miss")
