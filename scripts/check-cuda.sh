#!/usr/bin/env bash
# Compile-check the GPU build (`cargo check --features cuda,nccl`) on a machine with no GPU.
#
# The CUDA 13 toolkit comes from PyPI wheels into .cache/cuda (nvcc, headers, NCCL); nothing is
# installed system-wide. candle's kernels are compiled by nvcc for CUDA_COMPUTE_CAP (90 by
# default): about 30 minutes on 2 cores the first time, seconds afterwards (target/cuda-check).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.cache/cuda
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import nvidia" 2>/dev/null || [ -z "$(find "$VENV" -name nvcc -type f 2>/dev/null | head -1)" ]; then
  "$VENV/bin/pip" install --quiet "cuda-toolkit[nvcc,cccl,cudart,nvrtc,curand,cublas]" nvidia-nccl-cu13
fi
NVCC=$(find "$PWD/$VENV" -path '*/bin/nvcc' -type f | head -1)
[ -n "$NVCC" ] || { echo "check-cuda: nvcc not found under $VENV after installing the wheels" >&2; exit 1; }
CUDA_ROOT=$(dirname "$(dirname "$NVCC")")
export PATH="$CUDA_ROOT/bin:$PATH" CUDA_ROOT CUDA_PATH="$CUDA_ROOT" CUDA_HOME="$CUDA_ROOT"
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
# cudarc 0.19.10 (candle's) knows CUDA versions up to 13.4 and refuses newer nvcc wheels;
# the 13.4 driver API bindings are what it compiles against either way.
export CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-13040}
# Headers of the other wheels (cccl, cudart, nccl) sit in sibling folders: put them on nvcc's path.
INC=$(find "$PWD/$VENV" -type d -name include -path '*nvidia*' | tr '\n' ' ')
for d in $INC; do export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:-} -I$d"; done
echo "check-cuda: nvcc $(nvcc --version | tail -1), compute cap $CUDA_COMPUTE_CAP"
exec cargo check --release --features cuda,nccl --target-dir target/cuda-check --all-targets "$@"
