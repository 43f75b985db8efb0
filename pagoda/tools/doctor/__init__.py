"""`pagoda doctor MODEL`: preflight checks of a model folder and of the machine, before any weight loads.

Every failure this catches would otherwise surface late: a missing or truncated shard half-way
through loading, a tokenizer error at startup, a broken chat template on the first chat request, a
taken port after minutes of loading. Each check reads metadata only (config
files, safetensors headers, zip directories of .bin shards), except the checksums check, which hashes
the weight files whose sha256 is known (`checksums.py`; `--no-checksums` skips it), and reports one line:

    [ ok ] shards: 2 safetensors shards, all listed in model.safetensors.index.json
    [FAIL] safetensors: model-00002-of-00002.safetensors is truncated ... → re-download it

`run_checks(..., fast=True)` is the subset `pagoda serve` runs before loading weights: no GPU
context, no chat rendering, no model construction; everything in it takes well under a second
except reading a GGUF header or loading the tokenizer, which serving needs next anyway.
A check never raises: an unexpected exception becomes a FAIL line for that check.

One module per concern: `check.py` (the `Check` record, the state the checks share), `model_config.py`
(config.json or the GGUF header, architecture, fields, quantization, vision, tensor and pipeline parallel: each
stage's weights and KV per GPU through `pagoda plan`'s own arithmetic, outside the fast subset), `folder.py`
(shards against their index through `models.shards`, permissions, safetensors headers, .bin files),
`checksums.py`, `fit.py` (checkpoint vs model), `tokenizer.py` (tokenizer, special tokens, chat template),
`machine.py` (CUDA, GPUs, disk, port, /dev/shm), `run.py` (the order), `cli.py` (the report and the flags).
`pagoda serve`'s preflight (launch/preflight.py) runs the fast subset.
"""

from pagoda.tools.doctor.check import Check
from pagoda.tools.doctor.cli import add_doctor_args, failed, format_report, main, run_doctor
from pagoda.tools.doctor.run import run_checks

__all__ = ["Check", "add_doctor_args", "failed", "format_report", "main", "run_checks", "run_doctor"]
