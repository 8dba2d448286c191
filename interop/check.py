#!/usr/bin/env python3
"""`make interop`: do the files finetune writes load in the Python stack and mean the same?

For a tiny Llama (untied) and a tiny Qwen2 (tied embeddings, q/k/v bias), written by
`finetune synth`: train a LoRA adapter with finetune, merge it with `finetune export --merge`,
then check with transformers + PEFT that
  1. PEFT loads our adapter (`PeftModel.from_pretrained`) onto the base, and
  2. transformers loads our merged folder (`AutoModelForCausalLM.from_pretrained`),
and that both give the same logits on a fixed batch (max abs difference printed).
Needs torch, transformers, peft (`make venv`). Not part of CI.
"""
import json
import os
import subprocess
import sys
import tempfile

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release", "finetune")
RECIPE = """[model]\npath = "model"\n[lora]\nrank = 4\nalpha = 8\ntargets = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]
[data]\ntrain = "data"\n[train]\nmax_steps = 5\nmicro_batch_size = 4\nlr = 2e-2\n[output]\ndir = "run"\n"""


def run(*args, cwd):
    subprocess.run([BIN, *args], cwd=cwd, check=True, stderr=subprocess.DEVNULL)


worst = 0.0
for arch in ["llama", "qwen2"]:
    d = tempfile.mkdtemp(prefix=f"interop-{arch}-")
    run("synth", "--out", d, "--arch", arch, "--rows", "32", *(["--tie"] if arch == "qwen2" else []), cwd=d)
    with open(os.path.join(d, "recipe.toml"), "w") as f:
        f.write(RECIPE)
    run("--recipe", "recipe.toml", cwd=d)
    run("export", "--run", "run", "--merge", "--out", "merged", cwd=d)
    base = AutoModelForCausalLM.from_pretrained(os.path.join(d, "model"), dtype=torch.float32)
    tied = base.config.tie_word_embeddings
    ids = torch.randint(0, base.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(base, os.path.join(d, "run", "adapter")).eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(os.path.join(d, "merged"), dtype=torch.float32).eval()
        merged_logits = merged(input_ids=ids).logits
    diff = float((peft_logits - merged_logits).abs().max())
    worst = max(worst, diff)
    print(json.dumps({"arch": arch, "tied": tied, "peft_loads_adapter": True, "transformers_loads_merged": True,
                      "max_abs_logits_diff": diff}))
ok = worst < 1e-4
print(f"interop {'OK' if ok else 'FAILED'}: max |PEFT(base + our adapter) - transformers(our merged)| = {worst:.2e}")
sys.exit(0 if ok else 1)
