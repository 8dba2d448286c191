#!/usr/bin/env bash
# Every GPU check in one call, on the GPU machine, from the repository root, with the binary that
# scripts/build-cuda.sh packed (target/cuda-carry/finetune.gz, carried along):
#   bash scripts/gpu-checks.sh OUTDIR [gpu_dist_check.py --only NAMES...]
# Single-GPU checks (gpu_check.py, ~50 s on an H200), then the NCCL ranks (gpu_dist_check.py,
# ~4 min with the MoE memory case); the killed-peer case runs last. Exit status 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu-checks.sh OUTDIR [--only NAMES...]}
shift
BIN=/tmp/finetune-cuda/finetune
mkdir -p "$(dirname "$BIN")" "$OUT"
gunzip -c target/cuda-carry/finetune.gz > "$BIN" && chmod +x "$BIN"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())" 2>/dev/null
rc=0
if [ $# -eq 0 ]; then
  timeout 150 python3 scripts/gpu_check.py --bin "$BIN" --out "$OUT/single" || rc=1
fi
timeout 400 python3 scripts/gpu_dist_check.py --bin "$BIN" --out "$OUT/dist" "$@" || rc=1
exit $rc
