#!/usr/bin/env bash
# One device-machine call for Yuan2: golden tests on CUDA, then the LF-overhead benchmark.
# Carry `shared` (a copy of the yuan2 fixtures) with the call.   bash .ci/device/yuan_gpu.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider tests/models/test_yuan_golden.py tests/unit/test_localized_filter.py \
    2>&1 | tee "$OUT/pytest_yuan.txt" | tail -4
python3 benchmarks/models/yuan_lf_overhead.py --num-prompts 256 --input-len 512 --output-len 256 --repeats "${REPEATS:-1}" \
    --out "$OUT" 2>&1 | tee "$OUT/yuan_lf_overhead.txt" | tail -9
