#!/usr/bin/env bash
# One device-machine call: the engine's CUDA correctness check and an offline throughput table.
# Carry .gpu (smol-config.json + smol-tokenizer/, made on the dev machine) with the call.
#   bash .ci/device/gpu_check.sh   (writes under $OUT)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch, transformers; print('torch', torch.__version__, torch.cuda.get_device_name(), 'transformers', transformers.__version__)"
# 1. Correctness on CUDA: the tiny-model parity and engine tests run with device=auto → cuda.
python3 -m pytest -q -p no:cacheprovider tests/models/test_llama_parity.py tests/models/test_loader_errors.py \
    tests/kernels/test_fused_ops_gpu.py tests/engine/test_engine.py tests/unit/test_sampler.py \
    tests/unit/test_block_manager.py tests/unit/test_scheduler.py \
    2>&1 | tee "$OUT/pytest.txt" | tail -6
# 2. Throughput: a random-weight model of SmolLM2-135M's shape (speed depends on shapes only).
python3 benchmarks/random_model.py /tmp/smol --config .gpu/smol-config.json --tokenizer .gpu/smol-tokenizer --dtype bfloat16
python3 benchmarks/offline_throughput.py --model /tmp/smol --dtype bfloat16 --num-prompts 256 --input-len 256 \
    --output-len 128 --batch-size 64 --hf-single-prompts 2 --json "$OUT/gpu_offline.json" 2>&1 | tee "$OUT/gpu_offline.txt" | tail -12
