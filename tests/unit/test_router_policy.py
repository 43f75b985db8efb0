"""Routing policies: ring stability (only a removed/added backend's share of keys moves), bounded load, walking
the ring past unavailable backends, round-robin / least-loaded, and session keys (header > user > fingerprint)."""

from __future__ import annotations

from pagoda.tools.router.config import BackendConfig, BreakerConfig
from pagoda.tools.router.health import Backend
from pagoda.tools.router.policy import Balancer, opening, prefix_key, request_chars, session_key

KEYS = [f"s:session-{i}" for i in range(6000)]


def backends(*names: str, weight: int = 1) -> list[Backend]:
    return [Backend(BackendConfig(url=f"http://{n}:8000", name=n, weight=weight), BreakerConfig()) for n in names]


def owners(balancer: Balancer, pool: list[Backend]) -> dict[str, str]:
    return {k: balancer.plan(k, pool).order[0].name for k in KEYS}


def test_same_key_same_backend_and_spread() -> None:
    pool = backends("a", "b", "c")
    bal = Balancer("session")
    bal.set_backends(pool)
    first = owners(bal, pool)
    assert first == owners(bal, pool)
    share = {n: sum(1 for v in first.values() if v == n) / len(KEYS) for n in "abc"}
    assert all(0.22 < s < 0.45 for s in share.values()), share


def test_removing_a_backend_moves_only_its_keys() -> None:
    pool = backends("a", "b", "c")
    bal = Balancer("session")
    bal.set_backends(pool)
    before = owners(bal, pool)
    bal.set_backends(pool[:2])  # c removed from the ring
    after = owners(bal, pool[:2])
    moved = {k for k in KEYS if before[k] != after[k]}
    assert moved == {k for k in KEYS if before[k] == "c"}
    assert 0.22 < len(moved) / len(KEYS) < 0.45
    # an unavailable owner (ejected, breaker open) is skipped by walking the ring: the same keys move, to the
    # same places, as when it is removed
    bal.set_backends(pool)
    pool[2].healthy = False
    assert owners(bal, pool) == after
    pool[2].healthy = True
    assert owners(bal, pool) == before  # and they come back when it does


def test_adding_a_backend_moves_about_a_quarter_all_to_it() -> None:
    pool = backends("a", "b", "c", "d")
    bal = Balancer("session")
    bal.set_backends(pool[:3])
    before = owners(bal, pool[:3])
    bal.set_backends(pool)
    after = owners(bal, pool)
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == "d" for k in moved)
    assert 0.15 < len(moved) / len(KEYS) < 0.35


def test_affinity_reported() -> None:
    pool = backends("a", "b", "c")
    bal = Balancer("session")
    bal.set_backends(pool)
    plan = bal.plan("s:x", pool)
    assert plan.affinity == "hit" and plan.owner == plan.order[0].name
    assert [b.name for b in plan.order] == bal.ring_order("s:x")  # the retry order is the ring order
    next(b for b in pool if b.name == plan.owner).breaker.record_failure()
    for _ in range(2):
        next(b for b in pool if b.name == plan.owner).breaker.record_failure()
    moved = bal.plan("s:x", pool)
    assert moved.affinity == "miss" and moved.order[0].name == bal.ring_order("s:x")[1]


def test_bounded_load_falls_back_to_least_loaded() -> None:
    pool = backends("a", "b", "c")
    bal = Balancer("session", load_factor=1.25, load_floor=2)
    bal.set_backends(pool)
    owner = bal.plan("s:hot", pool).order[0]
    others = [b for b in pool if b is not owner]
    owner.inflight = 1  # 2 <= floor 2: stays
    assert bal.plan("s:hot", pool).affinity == "hit"
    owner.inflight = 2  # 3 > max(ceil(1.25 * 3 / 3), 2) = 2: moves to the least loaded
    others[0].inflight = 1
    plan = bal.plan("s:hot", pool)
    assert plan.order[0] is others[1] and plan.affinity == "miss"
    assert owner in plan.order[1:]  # still a retry candidate
    # a busy cluster: the bound grows with the mean (owner 10, others 9 and 8: 11 <= ceil(1.25 * 28 / 3) = 12)
    owner.inflight, others[0].inflight, others[1].inflight = 10, 9, 8
    assert bal.plan("s:hot", pool).order[0] is owner
    owner.inflight = 14  # 15 > ceil(1.25 * 32 / 3) = 14
    assert bal.plan("s:hot", pool).order[0] is others[1]
    bal_off = Balancer("session", load_factor=0)
    bal_off.set_backends(pool)
    assert bal_off.plan("s:hot", pool).order[0] is owner


def test_round_robin_least_loaded_and_keyless() -> None:
    pool = backends("a", "b", "c")
    rr = Balancer("round-robin")
    rr.set_backends(pool)
    assert [rr.plan(None, pool).order[0].name for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    ll = Balancer("least-loaded")
    ll.set_backends(pool)
    pool[0].inflight, pool[1].inflight, pool[2].inflight = 3, 1, 2
    assert [b.name for b in ll.plan(None, pool).order] == ["b", "c", "a"]
    pool[0].inflight = pool[1].inflight = pool[2].inflight = 0
    assert {ll.plan(None, pool).order[0].name for _ in range(3)} == {"a", "b", "c"}  # ties rotate
    session = Balancer("session")
    session.set_backends(pool)
    pool[1].inflight = 5
    assert session.plan(None, pool).order[0].name != "b"  # no key: least loaded
    pool[1].healthy = False
    pool[0].healthy = pool[2].healthy = False
    assert len(session.plan("s:x", pool).order) == 3  # nothing healthy: try them all anyway


SYSTEM = {"role": "system", "content": "You are a pirate."}


def test_session_key_sources() -> None:
    body = {"model": "m", "messages": [SYSTEM, {"role": "user", "content": "hi"}], "user": "u1"}
    assert session_key(body, "abc") == ("s:abc", "header")
    assert session_key(body, None) == ("u:u1", "user")
    key, source = session_key({**body, "user": None}, None)
    assert source == "fingerprint" and key.startswith("f:")
    assert session_key({"model": "m", "prompt": ""}, None) == (None, "none")
    assert session_key({"model": "m", "prompt": "Once"}, None)[1] == "fingerprint"


def test_fingerprint_from_system_and_first_user_message() -> None:
    turn1 = {"model": "m", "messages": [SYSTEM, {"role": "user", "content": "hi"}]}
    turn3 = {
        "model": "m",
        "messages": [
            SYSTEM,
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Arr"},
            {"role": "user", "content": "more"},
        ],
    }
    fp = session_key(turn1, None)[0]
    assert session_key(turn3, None)[0] == fp  # later turns keep the conversation's key
    assert session_key({**turn1, "model": "n"}, None)[0] != fp
    other_user = {"model": "m", "messages": [SYSTEM, {"role": "user", "content": "hello"}]}
    assert session_key(other_user, None)[0] != fp
    parts = {"model": "m", "messages": [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert session_key(parts, None)[0] == fp  # string or text parts: same text
    img = {
        "model": "m",
        "messages": [
            SYSTEM,
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hi"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            },
        ],
    }
    img2 = {
        "model": "m",
        "messages": [
            SYSTEM,
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hi"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,BBBB"}},
                ],
            },
        ],
    }
    assert len({fp, session_key(img, None)[0], session_key(img2, None)[0]}) == 3
    assert opening(turn3) == "system\nYou are a pirate.\nuser\nhi\n"


def test_prefix_key_and_request_chars() -> None:
    long_system = {"role": "system", "content": "S" * 2000}
    a = {"model": "m", "messages": [long_system, {"role": "user", "content": "question one"}]}
    b = {"model": "m", "messages": [long_system, {"role": "user", "content": "question two"}]}
    assert prefix_key(a, 1024) == prefix_key(b, 1024)  # same first 1024 chars: same backend
    assert prefix_key(a, 4096) != prefix_key(b, 4096)
    assert prefix_key({"model": "m", "prompt": "x" * 50}, 10) == prefix_key({"model": "m", "prompt": "x" * 60}, 10)
    assert request_chars(a) == 2000 + len("question one")
    assert request_chars({"prompt": ["abc", "de"]}) == 5
