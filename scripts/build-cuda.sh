#!/usr/bin/env bash
# Build the GPU binary (features cuda + nccl) on a machine with no GPU, to carry to one:
# target/cuda/release/finetune. It loads libcuda, cuBLAS, cuRAND and NCCL at run time, so the
# GPU machine needs their .so files on LD_LIBRARY_PATH (PyTorch's wheels hold them; see
# scripts/gpu-check.sh). First build about 30 minutes on 2 cores (candle's kernels).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/cuda-env.sh
# Linking needs each library under its unversioned name, and libcuda, which only a driver
# installs: a stub exporting the driver API's names (from cuda.h) with libcuda.so.1's soname, so
# the binary loads the real driver's library on the GPU machine. Both go in the folder candle's
# build script puts on the link path ($CUDA_ROOT/lib).
LIB="$CUDA_ROOT/lib"
for f in "$LIB"/lib*.so.* "$CUDA_ROOT"/../nccl/lib/libnccl.so.*; do
  base=$(basename "$f"); ln -sf "$f" "$LIB/${base%%.so.*}.so"
done
if [ ! -f "$LIB/libcuda.so" ]; then
  python3 - "$CUDA_ROOT/include/cuda.h" "$LIB/libcuda_stub.c" <<'PY'
import re, sys
h = open(sys.argv[1]).read()
names = set(re.findall(r"CUDAAPI\s+(cu[A-Z]\w*)\s*\(", h)) | set(re.findall(r"#define\s+cu[A-Z]\w*\s+(cu[A-Z]\w*)", h))
open(sys.argv[2], "w").write("".join(f"void {n}(void) {{}}\n" for n in sorted(names)))
PY
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$LIB/libcuda.so" "$LIB/libcuda_stub.c"
fi
cargo build --release --features cuda,nccl --target-dir target/cuda --bin finetune "$@"
# What to carry to the GPU machine (the device tool's carry limit is 64 MB): stripped and gzipped,
# about 22 MB; scripts/gpu-checks.sh unpacks it there.
mkdir -p target/cuda-carry
strip -o target/cuda-carry/finetune target/cuda/release/finetune
gzip -f target/cuda-carry/finetune
echo "build-cuda: target/cuda/release/finetune; to carry: target/cuda-carry/finetune.gz ($(du -h target/cuda-carry/finetune.gz | cut -f1))"
