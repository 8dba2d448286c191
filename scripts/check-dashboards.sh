#!/usr/bin/env bash
# `make check-dashboards`: the dashboards read what a run writes, with their own readers.
#
# A tiny run with TensorBoard on is killed mid-run and resumed; the `tensorboard` package from
# PyPI (into .cache/venv-tb, nothing system-wide) then reads its event files and must find
# exactly metrics.jsonl's numbers, each step once (scripts/check_tensorboard.py); and
# `finetune report` writes the page and the plot.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=./target/release/finetune
VENV=.cache/venv-tb
PY=${PYTHON:-python3}
if ! "$VENV/bin/python" -c "import tensorboard" 2>/dev/null; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet "tensorboard==2.21.0"
fi
RUN=$(mktemp -d)
trap 'rm -rf "$RUN"' EXIT
"$BIN" synth --out "$RUN" >/dev/null
cat > "$RUN/recipe.toml" <<TOML
[model]
path = "model"
[lora]
rank = 4
alpha = 8
[data]
train = "data"
max_seq_len = 48
eval_fraction = 0.1
[train]
max_steps = 40
micro_batch_size = 4
lr = 3e-3
lr_scheduler = "cosine"
warmup_steps = 4
eval_every = 10
[checkpoint]
every_steps = 7
[output]
dir = "out"
tensorboard = true
TOML
"$BIN" --recipe "$RUN/recipe.toml" 2>/dev/null &
pid=$!
while [ "$(cat "$RUN/out/metrics.jsonl" 2>/dev/null | wc -l)" -lt 24 ]; do
  kill -0 $pid 2>/dev/null || { echo "check-dashboards: the run ended before it could be killed" >&2; exit 1; }
  sleep 0.02
done
kill -9 $pid; wait $pid 2>/dev/null || true
echo "check-dashboards: killed after $(wc -l < "$RUN/out/metrics.jsonl") logged steps; resuming"
"$BIN" --recipe "$RUN/recipe.toml" 2>/dev/null
"$VENV/bin/python" scripts/check_tensorboard.py "$RUN/out"
"$BIN" report --run "$RUN/out"
test -s "$RUN/out/report.html" && test -s "$RUN/out/loss.png"
