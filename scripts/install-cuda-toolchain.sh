#!/usr/bin/env bash
# Installs the pinned PyPI CUDA 13.0 compiler toolchain (nvcc, ptxas, cicc/nvvm, headers, and
# NVRTC) into the git-ignored `.cuda/` virtual environment at the project root. No GPU or driver
# is needed: build.rs finds nvcc there and compiles kernels/*.cu into the embedded fatbin, and
# the NVRTC test (crates/cuda/tests/nvrtc.rs) compiles the embedded sources the way a GPU host
# without nvcc does, with `LD_LIBRARY_PATH` set to the folder this script prints.
#
# Every part is pinned: an unpinned nvidia-nvvm pulls a newer release whose PTX the 13.0 ptxas
# rejects ("Unsupported .version 9.5"). cuobjdump (with the nvdisasm it runs for -sass) reads
# the built fatbin for the machine code test (crates/cuda/tests/sass.rs); 13.2.86 reads the 13.0
# fatbin. Idempotent: does nothing when nvcc, NVRTC and cuobjdump are already there.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.cuda"
PY="${PYTHON:-python3}"

find_nvcc() {
    local n
    for n in "$VENV"/lib/python3.*/site-packages/nvidia/cu13/bin/nvcc; do
        [ -x "$n" ] && { echo "$n"; return 0; }
    done
    return 1
}

have_nvrtc() {
    ls "$VENV"/lib/python3.*/site-packages/nvidia/cu13/lib/libnvrtc.so.13 >/dev/null 2>&1
}

have_cuobjdump() {
    ls "$VENV"/lib/python3.*/site-packages/nvidia/cu13/bin/cuobjdump >/dev/null 2>&1 &&
        ls "$VENV"/lib/python3.*/site-packages/nvidia/cu13/bin/nvdisasm >/dev/null 2>&1
}

if NVCC="$(find_nvcc)" && "$NVCC" --version >/dev/null 2>&1 && have_nvrtc && have_cuobjdump; then
    echo "CUDA toolchain already installed."
else
    [ -x "$VENV/bin/pip" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install --disable-pip-version-check --quiet \
        nvidia-cuda-nvcc==13.0.88 \
        nvidia-cuda-crt==13.0.88 \
        nvidia-cuda-runtime==13.0.96 \
        nvidia-cuda-cccl==13.0.85 \
        nvidia-nvvm==13.0.88 \
        nvidia-cuda-nvrtc==13.0.88 \
        nvidia-cuda-cuobjdump==13.2.86 \
        nvidia-cuda-nvdisasm==13.2.86
    NVCC="$(find_nvcc)" || { echo "error: nvcc not found under $VENV after install" >&2; exit 1; }
fi

"$NVCC" --version | tail -n 2
echo "nvcc:    $NVCC"
echo "include: $(cd "$(dirname "$NVCC")/../include" && pwd)"
echo "nvrtc:   $(cd "$(dirname "$NVCC")/../lib" && pwd)"
echo "cuobjdump: $(dirname "$NVCC")/cuobjdump"
echo "build.rs finds it automatically; or export NVCC=$NVCC"
