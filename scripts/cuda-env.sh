# Sourced by check-cuda.sh and build-cuda.sh: the CUDA 13.0 toolkit from PyPI wheels in
# .cache/cuda (nvcc, headers, NCCL) and the environment candle's build reads. Nothing is
# installed system-wide.
#
# Pinned to 13.0 because the GPU machines we run on have driver 580 (CUDA 13.0): candle loads
# its kernels as PTX, which a driver JIT-compiles only if it is no newer than the driver.
VENV=.cache/cuda
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if [ -z "$(find "$VENV" -path '*/bin/nvcc' -type f 2>/dev/null | head -1)" ]; then
  "$VENV/bin/pip" install --quiet "cuda-toolkit[nvcc,cccl,cudart,nvrtc,curand,cublas]==13.0.*" nvidia-nccl-cu13
fi
NVCC=$(find "$PWD/$VENV" -path '*/bin/nvcc' -type f | head -1)
[ -n "$NVCC" ] || { echo "cuda-env: nvcc not found under $VENV after installing the wheels" >&2; exit 1; }
CUDA_ROOT=$(dirname "$(dirname "$NVCC")")
export PATH="$CUDA_ROOT/bin:$PATH" CUDA_ROOT CUDA_PATH="$CUDA_ROOT" CUDA_HOME="$CUDA_ROOT"
# sm_90: the H100 / H200. Set CUDA_COMPUTE_CAP for other GPUs (80 for the A100).
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
# cudarc (candle's) reads the toolkit version from here rather than probing.
export CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-13000}
# Each wheel's headers sit in its own nvidia/<package>/include: put those on nvcc's path (not the
# include folders nested deeper, such as cccl's own libcxx, which would shadow the C++ headers).
for d in "$PWD/$VENV"/lib/python*/site-packages/nvidia/*/include; do
  export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:-} -I$d"
done
echo "cuda-env: nvcc $(nvcc --version | tail -1), compute cap $CUDA_COMPUTE_CAP"
