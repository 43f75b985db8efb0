"""`pagoda doctor`'s shard checksums (pagoda/tools/doctor/checksums.py): a SHA256SUMS and a `.sha256` beside the files,
an HF-hub-cache-shaped folder whose snapshot files are symlinks into blobs/<sha256>, right and wrong; a folder
with none known says so; progress on stderr; serve's preflight (doctor's fast subset) and --no-checksums hash
nothing."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import pytest

from pagoda.tools import doctor
from pagoda.tools.doctor import checksums
from pagoda.tools.doctor.checksums import expected_sha256, verify

A, B = b"weights of shard one" * 1000, b"shard two"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write(folder: Path, files: dict[str, bytes]) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return [str(folder / name) for name in files]


def test_sha256sums_right_and_wrong(tmp_path: Path) -> None:
    paths = write(tmp_path, {"m-1.safetensors": A, "m-2.safetensors": B})
    (tmp_path / "SHA256SUMS").write_text(f"{sha(A)}  m-1.safetensors\n{sha(b'other')} *m-2.safetensors\n")
    one, two = verify(paths)
    assert one.ok and one.expected is not None and one.expected.source == "SHA256SUMS"
    assert not two.ok and two.actual == sha(B) and two.expected is not None and two.expected.digest == sha(b"other")


def test_a_sha256_file_beside_the_shard(tmp_path: Path) -> None:
    (path,) = write(tmp_path, {"model.gguf": A})
    (tmp_path / "model.gguf.sha256").write_text(sha(A).upper() + "  model.gguf\n")
    assert verify([path])[0].ok
    (tmp_path / "model.gguf.sha256").write_text(sha(B) + "\n")
    assert not verify([path])[0].ok


def hub_cache(tmp_path: Path, blob_digest: str, content: bytes) -> str:
    """models--org--name/{blobs/<digest>, snapshots/<rev>/model.safetensors -> ../../blobs/<digest>}"""
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / blob_digest).write_bytes(content)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    os.symlink(f"../../blobs/{blob_digest}", snapshot / "model.safetensors")
    return str(snapshot / "model.safetensors")


def test_hf_cache_blob_names_right_and_wrong(tmp_path: Path) -> None:
    right = hub_cache(tmp_path / "right", sha(A), A)
    (result,) = verify([right])
    assert result.ok and result.expected is not None and result.expected.source == "the HF cache's blob name"
    corrupted = hub_cache(tmp_path / "wrong", sha(A), A[:-1] + b"!")  # a flipped byte after download
    assert not verify([corrupted])[0].ok
    git_blob = hub_cache(tmp_path / "git", "a" * 40, A)  # a file kept in git: a SHA-1 name, not a sha256
    assert expected_sha256(git_blob) is None


def test_none_known_is_not_hashed(tmp_path: Path, monkeypatch) -> None:
    (path,) = write(tmp_path, {"model.safetensors": A})
    monkeypatch.setattr(checksums, "sha256_file", lambda *a: pytest.fail("hashed a file with no expected sha256"))
    (result,) = verify([path])
    assert result.expected is None and not result.ok


def test_progress_goes_to_stderr_throttled(tmp_path: Path, monkeypatch) -> None:
    paths = write(tmp_path, {"m-1.safetensors": A, "m-2.safetensors": B})
    (tmp_path / "SHA256SUMS").write_text(f"{sha(A)}  m-1.safetensors\n{sha(B)}  m-2.safetensors\n")
    monkeypatch.setattr(checksums, "_CHUNK", 1000)  # 21 chunks
    out = io.StringIO()
    assert all(r.ok for r in verify(paths, stream=out, every_s=0.0))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("checksums: 0.0 of 0.0 GiB (5%), m-1.safetensors") and len(lines) == 21
    quiet = io.StringIO()
    verify(paths, stream=quiet, every_s=3600.0)
    assert quiet.getvalue() == ""  # throttled: nothing for a run shorter than the interval


def test_doctor_line_and_the_paths_that_never_hash(tmp_path: Path, monkeypatch, capsys) -> None:
    from tests.conftest import build_tiny_model
    from tests.unit.test_doctor import save_tiny_tokenizer

    folder = tmp_path / "model"
    build_tiny_model("llama", str(folder), max_shard_size="100KB")
    save_tiny_tokenizer(str(folder))
    shards = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))

    def line(**kw) -> str:
        checks = doctor.run_checks(str(folder), device="cpu", **kw)
        return "\n".join(f"{c.status} {c.detail}" for c in checks if c.name == "checksums")

    unknown = f"no expected sha256 known for {len(shards)} file(s) (no SHA256SUMS, *.sha256 or HF cache blob)"
    assert line() == f"ok {unknown}: not verified"
    sums = "".join(f"{sha((folder / n).read_bytes())}  {n}\n" for n in shards)
    (folder / "SHA256SUMS").write_text(sums)
    assert line() == f"ok {len(shards)} file(s) match their sha256 (SHA256SUMS)"
    (folder / shards[1]).write_bytes((folder / shards[1]).read_bytes()[:-1] + b"\x00")  # same size, one byte off
    assert line().startswith(f"FAIL {shards[1]} has sha256 ")
    # --no-checksums, and serve's preflight (doctor's fast subset): no check, nothing hashed.
    monkeypatch.setattr(checksums, "sha256_file", lambda *a: pytest.fail("hashed"))
    assert line(checksums=False) == ""
    assert "checksums" not in {c.name for c in doctor.run_checks(str(folder), fast=True)}
    assert doctor.main([str(folder), "--device", "cpu", "--no-checksums"]) == 0
    assert "checksums" not in capsys.readouterr().out
