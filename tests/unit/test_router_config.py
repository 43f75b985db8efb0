"""Router settings: TOML/JSON/YAML files, flags over the file, validation, and live reload from a TOML file
(backends that stay keep their runtime state; an invalid file is ignored)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagoda.errors import ConfigError
from pagoda.tools.router.app import RouterState
from pagoda.tools.router.config import ConfigWatcher, build_config, key_label, parse_file

TOML = """
policy = "session"
backend_api_key = "backend-key"
load_factor = 1.5

[[backends]]
url = "http://127.0.0.1:8001/v1/"
name = "a"

[[backends]]
url = "http://127.0.0.1:8002"
weight = 2

[api_keys]
alice = "sk-alice"

[health]
interval = 0.5
fail_threshold = 3

[breaker]
open_seconds = 4

[limits]
long_request_chars = 10000
"""


def test_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text(TOML)
    cfg = build_config(parse_file(path), {"policy": None, "health.interval": 0.25})
    assert [(b.url, b.name, b.weight) for b in cfg.backends] == [
        ("http://127.0.0.1:8001", "a", 1),
        ("http://127.0.0.1:8002", "http://127.0.0.1:8002", 2),
    ]
    assert cfg.policy == "session" and cfg.load_factor == 1.5 and cfg.backend_api_key == "backend-key"
    assert cfg.api_keys == (("alice", "sk-alice"),)
    assert cfg.health.interval == 0.25 and cfg.health.fail_threshold == 3  # the flag wins over the file
    assert cfg.breaker.open_seconds == 4 and cfg.long_request_chars == 10000


def test_flags_add_backends_and_keys(tmp_path: Path) -> None:
    path = tmp_path / "router.json"
    path.write_text(json.dumps({"backends": ["http://h:1"], "api_keys": ["k1"]}))
    cfg = build_config(
        parse_file(path), {"backends": ["http://h:2", "http://h:1"], "api_keys": ["k2"], "policy": "prefix"}
    )
    assert [b.url for b in cfg.backends] == ["http://h:1", "http://h:2"]
    assert [label for label, _ in cfg.api_keys] == [key_label("k1"), key_label("k2")]
    assert "k1" not in key_label("k1") and cfg.policy == "prefix"


def test_yaml_file(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    path = tmp_path / "router.yaml"
    path.write_text("backends:\n  - url: http://h:1\n    name: one\npolicy: round-robin\nhealth:\n  timeout: 1\n")
    cfg = build_config(parse_file(path))
    assert cfg.backends[0].name == "one" and cfg.policy == "round-robin" and cfg.health.timeout == 1


@pytest.mark.parametrize(
    "text, message",
    [
        ("policy = 'random'\nbackends = ['http://h:1']", "policy must be one of"),
        ("backends = []", "no backends"),
        ("backends = ['h:1']", "must start with http"),
        ("backends = ['http://h:1']\ntypo = 1", "unknown key 'typo'"),
        ("backends = ['http://h:1']\n[health]\nintervall = 1", "unknown key [health]"),
        ("backends = ['http://h:1']\nload_factor = 0.5", "load_factor"),
        ("backends = [{url = 'http://h:1', name = 'x'}, {url = 'http://h:2', name = 'x'}]", "unique"),
        ("backends = ['http://h:1'\n", "cannot parse"),
    ],
)
def test_invalid_files(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        build_config(parse_file(path))


def test_reload_from_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text("policy = 'session'\nbackends = ['http://h:1', 'http://h:2']\n")
    state = RouterState(build_config(parse_file(path), {}))
    watcher = ConfigWatcher(path, {"max_attempts": 5}, state.apply)
    kept = state.backends[0]
    kept.healthy, kept.inflight = False, 3
    assert watcher.check() is False  # unchanged file: nothing to do

    path.write_text("policy = 'least-loaded'\nbackends = ['http://h:1', 'http://h:3']\n[api_keys]\nbob = 'k'\n")
    assert watcher.check() is True
    assert [b.url for b in state.backends] == ["http://h:1", "http://h:3"]
    assert state.backends[0] is kept and not kept.healthy and kept.inflight == 3  # runtime state survives
    assert state.config.policy == "least-loaded" and state.balancer.policy == "least-loaded"
    assert state.config.max_attempts == 5  # the command line still applies
    assert state.auth({"headers": [(b"authorization", b"Bearer k")]}) == "bob"
    assert state.reloads == 1

    path.write_text("policy = 'nope'\nbackends = ['http://h:9']\n")
    assert watcher.check() is False and watcher.errors == 1  # invalid: the running settings stay
    assert [b.url for b in state.backends] == ["http://h:1", "http://h:3"]
    path.write_text("policy = 'round-robin'\nbackends = ['http://h:9']\n")
    assert watcher.check() is True and state.config.policy == "round-robin" and state.reloads == 2
