#!/usr/bin/env bash
# `make check-llama-cpp` (part of `make interop` and CI): llama.cpp loads a base GGUF plus the
# LoRA GGUF `finetune export --format gguf` writes and computes our logits
# (scripts/check_interop.py says what is compared and how tightly).
#
# llama.cpp comes from PyPI's llama-cpp-python source package (it vendors llama.cpp; PyPI has
# no binary wheel of it), built once into .cache/venv-llama: ~10-15 min on 2 cores. The build
# is portable (GGML_NATIVE=OFF: an AVX2 baseline), so a cached venv runs on any of our CPUs.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.cache/venv-llama
PY=${PYTHON:-python3}
if ! "$VENV/bin/python" -c "import llama_cpp, gguf, numpy" 2>/dev/null; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  echo "check-llama-cpp: building llama-cpp-python 0.3.36 (llama.cpp 0c1e57098) into $VENV, ~10-15 min the first time" >&2
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DGGML_BLAS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$VENV/bin/pip" install --quiet "llama-cpp-python==0.3.36" "numpy" "gguf==0.19.0"
fi
"$VENV/bin/python" scripts/check_interop.py
