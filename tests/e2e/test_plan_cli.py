"""`pagoda plan --json` as a user runs it: a process whose stdout is the JSON alone, and a one-line error with
exit status 2 for an unknown GPU (the arithmetic itself: tests/unit/test_plan.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.unit.test_plan import QWEN2VL_7B, KiB


def test_cli_json_has_the_documented_keys(tmp_path):
    folder = tmp_path / "qwen2vl-7b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN2VL_7B))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagoda",
            "plan",
            str(folder),
            "--gpu",
            "a100-80g",
            "--image",
            "1000x750",
            "--images-per-request",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    for key in (
        "kv_bytes_per_token",
        "state_bytes_per_sequence",
        "weights_bytes_per_gpu",
        "kv_blocks",
        "max_concurrency",
        "recommended_max_num_seqs",
        "valid_tensor_parallel_sizes",
        "image_tokens",
    ):
        assert key in plan, key
    assert plan["kv_bytes_per_token"] == 56 * KiB and plan["image_tokens"] == 972
    assert plan["image_tokens_per_request"] == 2 * 974
    bad = subprocess.run(
        [sys.executable, "-m", "pagoda", "plan", str(folder), "--gpu", "tpu9000"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "Unknown --gpu" in bad.stderr and "Traceback" not in bad.stderr
