#!/usr/bin/env bash
# The wheels `pagoda serve` and `pagoda bench` need on a GPU machine whose image already holds PyTorch, transformers,
# numpy, Pillow, httpx, prometheus-client, uvloop, psutil and safetensors (Python 3.12, x86_64) but no package index:
# FastAPI's stack, pyzmq, xgrammar, jsonschema, uhashring, httptools and gguf, plus py-spy for profiling the served
# engine core. About 13 MB; `pip download` on this machine, for the other one.
#
#   bash benchmarks/device_wheels.sh DIR
#   # there: python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl
#   #        export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
set -euo pipefail
out=${1:?usage: bash benchmarks/device_wheels.sh DIR}
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$out" \
  fastapi==0.136.3 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing-extensions==4.16.0 sniffio==1.3.1 uvicorn==0.54.0 httptools==0.9.0 \
  uhashring==2.5 pyzmq==27.3.0 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 jsonschema==4.26.0 \
  jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 gguf==0.19.0 py-spy==0.4.3
ls "$out"
