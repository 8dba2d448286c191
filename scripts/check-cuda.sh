#!/usr/bin/env bash
# Compile-check the GPU build (`cargo check --features cuda,nccl`) on a machine with no GPU.
# candle's kernels are compiled by nvcc: about 30 minutes on 2 cores the first time, seconds
# afterwards (target/cuda-check).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/cuda-env.sh
exec cargo check --release --features cuda,nccl --target-dir target/cuda-check --all-targets "$@"
