#!/usr/bin/env bash
# One device-machine call for Qwen2-VL: parity tests on CUDA, then the image-throughput benchmark.
#   bash .ci/device/qwen2vl_gpu.sh   (writes under $OUT)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch, transformers; print('torch', torch.__version__, torch.cuda.get_device_name(), 'transformers', transformers.__version__)"
pip list 2>/dev/null | grep -i -E "^pillow " || pip install -q --no-index Pillow 2>&1 | tail -1
python3 -m pytest -q -p no:cacheprovider tests/models/test_qwen2vl_parity.py tests/models/test_qwen2vl_vision.py \
    tests/unit/test_mrope.py 2>&1 | tee "$OUT/pytest_qwen2vl.txt" | tail -4
python3 benchmarks/models/qwen2vl_image_throughput.py --concurrency ${CONCURRENCY:-1 16 64} --out "$OUT" 2>&1 \
    | tee "$OUT/qwen2vl_image_throughput.txt" | tail -12
