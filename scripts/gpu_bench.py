#!/usr/bin/env python3
"""Training speed and GPU memory on a GPU: finetune's CUDA build against PEFT on the same machine.

Usage (on the GPU machine, from the repository root, the binary from scripts/build-cuda.sh carried):
    python3 scripts/gpu_bench.py --bin target/cuda/release/finetune --out OUTDIR

The model is the random SmolLM2-135M-shaped Llama `finetune synth` writes (as `make bench` uses),
LoRA r16 on q/k/v/o, batch x 512 tokens of random ids, bf16 base, with and without activation
checkpointing. PEFT runs bench/reference/peft_bench.py with --device cuda (transformers' sdpa
attention; the LoRA parameters f32, as PEFT keeps them on a bf16 base). Tokens/s is the median of
the timed steps; GPU memory is the peak of the device's used memory (nvidia-smi, sampled every
50 ms) above what it used before the run, for both sides alike, so PyTorch's cached blocks count
as ours do. Writes OUTDIR/gpu-bench.json and prints a table.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "scripts"), os.path.join(ROOT, "bench")]
import bench  # noqa: E402
from gpu_check import lib_path, sampling  # noqa: E402
# make bench's recipe, on the GPU.
RECIPE = bench.RECIPE.replace("[lora]", 'device = "cuda"\n[lora]', 1)


def gpu_used_mb():
    q = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True)
    return float(q.stdout.split()[0])


def peak_gpu(cmd, env):
    """Run cmd; (stdout, peak GPU MB above the idle level)."""
    base = gpu_used_mb()
    peak = [base]

    def sample():
        peak[0] = max(peak[0], gpu_used_mb())

    p = sampling(lambda: subprocess.run(cmd, capture_output=True, text=True, env=env), sample, 0.05)
    if p.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {p.returncode}: {p.stderr[-1500:]}")
    return p.stdout, peak[0] - base


def ours(binary, model, data, batch, seq, steps, warmup, ckpt, env, targets=bench.LLAMA_TARGETS, fmt=None):
    out = tempfile.mkdtemp(prefix="ft-gpu-bench-")
    recipe = os.path.join(out, "bench.toml")
    text = RECIPE.format(model=model, data=data, seq=seq, steps=steps + warmup, batch=batch, ckpt=str(ckpt).lower(), out=os.path.join(out, "run"),
                         dtype="bf16", targets=json.dumps(targets.split(",")))
    if fmt:
        text = text.replace("[data]\n", f'[data]\nformat = "{fmt}"\n', 1)
    with open(recipe, "w") as f:
        f.write(text)
    _, mb = peak_gpu([binary, "--recipe", recipe], env)
    m = [json.loads(l) for l in open(os.path.join(out, "run", "metrics.jsonl")) if l.strip()]
    m = [x for x in m if "tokens_per_s" in x]
    secs = [batch * seq / x["tokens_per_s"] for x in m[warmup:]]
    return {"tokens_per_s": batch * seq / statistics.median(secs), "gpu_mb": mb, "losses": [x["loss"] for x in m]}


def peft(model, batch, seq, steps, warmup, ckpt, env, targets=bench.LLAMA_TARGETS, extra=()):
    cmd = [sys.executable, os.path.join(ROOT, "bench/reference/peft_bench.py"), "--model", model, "--batch", str(batch), "--seq", str(seq),
           "--steps", str(steps), "--warmup", str(warmup), "--dtype", "bf16", "--weight-decay", "0.0", "--device", "cuda", "--threads", "8",
           "--targets", targets, *extra]
    if ckpt:
        cmd.append("--grad-ckpt")
    out, mb = peak_gpu(cmd, env)
    r = json.loads(out.strip().splitlines()[-1])
    return {"tokens_per_s": r["tokens_per_s"], "gpu_mb": mb, "torch_peak_reserved_mb": r.get("gpu_peak_mb"), "losses": r["losses"]}


def compare(rows, name, batch, seq, ckpt, runs):
    """Run each (side, fn) of `runs`, append the rows, print them and the ratio line."""
    got = {}
    for side, fn in runs:
        try:
            r = fn()
        except Exception as e:  # noqa: BLE001 - a failed row is reported, the others still run
            r = {"error": str(e)[-800:]}
        r.update(model=name, side=side, batch=batch, seq=seq, ckpt=ckpt)
        rows.append(r)
        shown = f"{r['tokens_per_s']:9.0f} tok/s {r['gpu_mb']:7.0f} MB" if "error" not in r else "ERROR " + r["error"][-300:]
        print(f"{name} {side:28s} {batch}x{seq} ckpt={ckpt!s:5s} {shown}", flush=True)
        if "error" not in r:
            got[side] = r
    if "finetune" in got and len(got) > 1:
        best = max((r for s, r in got.items() if s != "finetune"), key=lambda r: r["tokens_per_s"])
        f = got["finetune"]
        print(f"{name} {batch}x{seq} ckpt={ckpt}: finetune {f['tokens_per_s'] / best['tokens_per_s']:.2f}x the tokens/s of {best['side']} "
              f"at {f['gpu_mb'] / max(best['gpu_mb'], 1):.2f}x its GPU memory", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="smol,moe")
    ap.add_argument("--batches", default="4,16")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    binary = os.path.abspath(a.bin)
    os.makedirs(a.out, exist_ok=True)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join(lib_path() + [env.get("LD_LIBRARY_PATH", "")])
    cache = tempfile.mkdtemp(prefix="gpu-bench-")
    seq = 512
    subprocess.run([binary, "synth", "--out", os.path.join(cache, "smol"), "--shape", "smollm2-135m", "--rows", "8"], check=True, env=env)
    subprocess.run([binary, "synth", "--out", os.path.join(cache, "d"), "--shape", "tiny", "--rows", "64", "--seq-min", str(seq), "--seq-max", str(seq)], check=True, env=env)
    model, data = os.path.join(cache, "smol", "model"), os.path.join(cache, "d", "data")
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    rows = []
    if "smol" in a.sections:
        for batch in [int(b) for b in a.batches.split(",")]:
            for ckpt in [True, False]:
                compare(rows, "smollm2", batch, seq, ckpt, [
                    ("finetune", lambda: ours(binary, model, data, batch, seq, a.steps, a.warmup, ckpt, env)),
                    ("PEFT", lambda: peft(model, batch, seq, a.steps, a.warmup, ckpt, env))])
    if "moe" in a.sections:
        # make bench's MoE model (DeepSeek-V2-Lite layer shapes, 3 layers) and uniform random ids,
        # as PEFT's benchmark draws them (routing follows the tokens).
        moe = os.path.join(cache, "ds-v2-lite-3l")
        subprocess.run([sys.executable, os.path.join(ROOT, "bench/make_deepseek_model.py"), "--out", moe, "--layers", "3", "--tokenizer", model], check=True)
        ids = os.path.join(cache, "random.jsonl")
        rng = __import__("numpy").random.default_rng(0)
        with open(ids, "w") as f:
            for _ in range(64):
                row = rng.integers(0, 102400, seq).tolist()
                f.write(json.dumps({"input_ids": row, "labels": row}) + "\n")
        targets = bench.MLA_TARGETS
        for batch in [1, 4]:
            for ckpt in [True, False]:
                compare(rows, "ds-v2-lite-3l", batch, seq, ckpt, [
                    ("finetune", lambda: ours(binary, moe, ids, batch, seq, a.steps, a.warmup, ckpt, env, targets, fmt="tokenized")),
                    ("PEFT grouped_mm experts", lambda: peft(moe, batch, seq, a.steps, a.warmup, ckpt, env, targets, ["--experts", "grouped_mm"])),
                    ("PEFT eager experts", lambda: peft(moe, batch, seq, a.steps, a.warmup, ckpt, env, targets, ["--experts", "eager"]))])
    json.dump({"gpu": gpu, "rows": rows}, open(os.path.join(a.out, "gpu-bench.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
