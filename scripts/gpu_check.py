#!/usr/bin/env python3
"""Run the CUDA build of finetune on a GPU machine and check what it computes there.

Usage (on the GPU machine, from the repository root, with the binary built by
scripts/build-cuda.sh carried along):
    python3 scripts/gpu_check.py --bin target/cuda/release/finetune --out OUTDIR [--only NAME ...]

What it checks, each case on `model.device = "cuda"`:
  * every PEFT parity fixture (tests/fixtures/parity-*: dense llama/qwen2, DeepSeek-V2/V3 MLA + MoE,
    GGUF Q8_0 / Q4_K and bitsandbytes NF4 bases) against the numbers PEFT produced, at the parity
    tolerances of tests/parity.rs (losses, lr, grad_norm 1.5e-6 relative; adapter 8e-6 absolute);
  * a bf16 base (llama and DeepSeek-V3): its losses within bf16 reach of the f32 run;
  * ZeRO-3 (zero_stage = 3, optimizer state on the host) on one rank: the same numbers as without;
  * DeepSeek-V3 with adapters on every routed expert (lora.routed_experts), plain and ZeRO-3: the
    CPU's fused kernels' numbers (themselves held to an f64 reference by tests/deepseek.rs) at the
    parity tolerances;
  * resume: a run resumed from its step-2 checkpoint equals the uninterrupted run bit for bit;
  * export --merge of a GPU run (the export itself runs on the CPU and verifies the logits).
It prints one line per case and writes OUTDIR/gpu-check.json; the exit status is 1 if any case
failed. Needs python3 with numpy and safetensors (the GPU machines' PyTorch image has them).
"""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
from safetensors.numpy import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REL_TOL, ABS_TOL = 1.5e-6, 8e-6  # as tests/parity.rs; measured on the H200: 3.0e-7 and 5.0e-6


def lib_path():
    """Folders holding libcublas / libcurand / libnccl: PyTorch's nvidia wheels in this python's
    site-packages, else wherever under /opt, /usr/local and /usr/lib (a slow walk)."""
    import site
    pats = ["libcublas.so*", "libcurand.so*", "libnccl.so*", "libcublasLt.so*"]
    dirs, missing = [], pats
    for roots in [[os.path.join(p, "nvidia") for p in site.getsitepackages() + [site.getusersitepackages()]], ["/opt", "/usr/local", "/usr/lib"]]:
        found = {pat: sorted({os.path.dirname(f) for r in roots for f in glob.glob(os.path.join(r, "**", pat), recursive=True)}) for pat in missing}
        dirs += [d for ds in found.values() for d in ds if d not in dirs]
        missing = [pat for pat in missing if not found[pat]]
        if not missing:
            break
    return dirs


def sampling(fn, sample, every):
    """fn()'s result, while a thread calls sample() every `every` seconds until fn returns (the
    GPU memory samplers of gpu_bench.py and gpu_dist_check.py)."""
    done = threading.Event()

    def poll():
        while not done.is_set():
            sample()
            time.sleep(every)

    t = threading.Thread(target=poll)
    t.start()
    try:
        return fn()
    finally:
        done.set()
        t.join()


def run(binary, args, log, env):
    t = time.time()
    p = subprocess.run([binary, *args], capture_output=True, text=True, env=env)
    with open(log, "a") as f:
        f.write(f"$ finetune {' '.join(args)}\n{p.stdout}\n{p.stderr}\nexit {p.returncode} in {time.time() - t:.1f}s\n\n")
    if p.returncode != 0:
        raise RuntimeError(f"finetune {' '.join(args[:3])} ... exited {p.returncode}: {p.stderr.strip()[-600:]}")
    return p.stdout


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(l) for l in f if l.strip() and "loss" in json.loads(l)]


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def prepare(fixture, work, name, sets, drop=()):
    """Copy fixture to work/name, its recipe's `drop` keys removed; the command line that trains
    it on cuda with the --set overrides, and the run folder it will write."""
    d = os.path.join(work, name)
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(fixture, d, ignore=shutil.ignore_patterns("out", "expected", "*.py"))
    if drop:
        r = os.path.join(d, "recipe.toml")
        lines = open(r).read().splitlines(keepends=True)
        open(r, "w").write("".join(l for l in lines if l.split("=")[0].strip() not in drop))
    args = ["--recipe", os.path.join(d, "recipe.toml")]
    for s in ["model.device=cuda", *sets]:
        args += ["--set", s]
    return args, os.path.join(d, "out")


def train(binary, fixture, work, name, sets, log, env, drop=()):
    """Train a copy of fixture (see prepare) in one process; the run folder."""
    args, out = prepare(fixture, work, name, sets, drop)
    run(binary, args, log, env)
    return out


def adapter_diff(got_dir, ref_dir):
    """Largest absolute difference between two runs' adapter tensors (the keys must agree), and
    how many tensors they hold."""
    got = load_file(os.path.join(got_dir, "adapter_model.safetensors"))
    ref = load_file(os.path.join(ref_dir, "adapter_model.safetensors"))
    assert sorted(got) == sorted(ref), "adapter keys differ"
    return max(float(np.abs(got[k].astype(np.float64) - ref[k]).max()) for k in ref), len(ref)


def compare_to_peft(fixture, out):
    exp = json.load(open(os.path.join(fixture, "expected/metrics.json")))["steps"]
    got = metrics(out)
    assert len(got) == len(exp), f"{len(got)} steps, PEFT {len(exp)}"
    d = {"loss": 0.0, "lr": 0.0, "grad_norm": 0.0}
    for g, e in zip(got, exp):
        assert g["tokens"] == e["tokens"], f"step {e['step']}: {g['tokens']} target tokens, PEFT {e['tokens']}"
        for k in d:
            d[k] = max(d[k], rel(g[k], e[k]))
    d["adapter"], _ = adapter_diff(os.path.join(out, "adapter"), os.path.join(fixture, "expected/adapter"))
    ok = d["loss"] < REL_TOL and d["lr"] < REL_TOL and d["grad_norm"] < REL_TOL and d["adapter"] < ABS_TOL
    return ok, d


class Cases:
    """The command line (--bin, --out, --only), a fresh work folder, the environment the binary
    runs in, and the named checks: each prints a line, and every result so far is kept in
    OUT/<name>.json."""

    def __init__(self, name, doc):
        ap = argparse.ArgumentParser(description=doc)
        ap.add_argument("--bin", required=True)
        ap.add_argument("--out", required=True)
        ap.add_argument("--only", nargs="*")
        a = ap.parse_args()
        self.binary, self.only, self.name, self.out = os.path.abspath(a.bin), a.only, name, a.out
        os.makedirs(a.out, exist_ok=True)
        self.log = os.path.join(a.out, f"{name}.log")
        self.work = f"/tmp/{name}"
        shutil.rmtree(self.work, ignore_errors=True)
        os.makedirs(self.work)
        self.env = dict(os.environ)
        self.env["LD_LIBRARY_PATH"] = ":".join(lib_path() + [self.env.get("LD_LIBRARY_PATH", "")])
        self.env["FINETUNE_CACHE"] = os.path.join(self.work, "cache")
        self.results = {}
        self.skip = None  # set to a reason, the cases after it are skipped

    def __call__(self, name, fn):
        if self.only and not any(o in name for o in self.only):
            return
        t = time.time()
        if self.skip:
            ok, detail = False, f"skipped: {self.skip}"
        else:
            try:
                ok, detail = fn()
            except Exception as e:  # noqa: BLE001 - every failure is reported, the rest still run
                ok, detail = False, f"{type(e).__name__}: {e}"
        self.results[name] = {"ok": ok, "detail": detail, "seconds": round(time.time() - t, 1)}
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail} ({time.time() - t:.1f}s)", flush=True)
        # Written after every case, so a run stopped by a time limit still leaves what it found.
        json.dump(self.results, open(os.path.join(self.out, f"{self.name}.json"), "w"), indent=1)

    def finish(self):
        bad = [n for n, r in self.results.items() if not r["ok"]]
        print(f"{len(self.results) - len(bad)} of {len(self.results)} cases passed" + (f"; failed: {bad}" if bad else ""))
        sys.exit(1 if bad else 0)


def fixture(n):
    return os.path.join(ROOT, "tests/fixtures", n)


def main():
    case = Cases("gpu-check", __doc__)
    binary, work, log, env, fx = case.binary, case.work, case.log, case.env, fixture

    parity = sorted(os.path.basename(p) for p in glob.glob(fx("parity-*")))
    for n in parity:
        case(f"{n} (f32, cuda) = PEFT", lambda n=n: compare_to_peft(fx(n), train(binary, fx(n), work, n, [], log, env)))

    def bf16_close(n):
        f32 = metrics(train(binary, fx(n), work, n + "-f32", [], log, env))
        b16 = metrics(train(binary, fx(n), work, n + "-bf16", ["model.dtype=bf16"], log, env))
        d = max(rel(b["loss"], f["loss"]) for b, f in zip(b16, f32))
        return d < 2e-2, {"max rel loss diff bf16 vs f32": d}

    for n in ["parity-llama-gqa", "parity-deepseek-v3"]:
        case(f"{n} bf16 base (cuda) ~ f32", lambda n=n: bf16_close(n))

    def zero3(n):
        plain = metrics(train(binary, fx(n), work, n + "-z0", [], log, env))
        z3 = metrics(train(binary, fx(n), work, n + "-z3", ["dist.zero_stage=3", "dist.offload_optimizer=cpu"], log, env))
        d = max(rel(z["loss"], p["loss"]) for z, p in zip(z3, plain))
        return d == 0.0, {"max rel loss diff": d}

    for n in ["parity-llama-gqa", "parity-deepseek-v2"]:
        case(f"{n} ZeRO-3 one rank (cuda) = plain", lambda n=n: zero3(n))

    def cuda_vs_cpu(n, sets):
        # The same recipe on the CPU's fused kernels: those are held to PEFT or to an independent
        # f64 reference by the tests, so the CUDA run must match them at the parity tolerances.
        # init_from names the fixture's MLA-only PEFT adapter: these runs start from fresh adapters.
        gpu = train(binary, fx(n), work, n + "-cuda", sets, log, env, drop=("init_from",))
        cpu = train(binary, fx(n), work, n + "-cpu", sets + ["model.device=cpu"], log, env, drop=("init_from",))
        g, c = metrics(gpu), metrics(cpu)
        assert len(g) == len(c), f"{len(g)} steps on cuda, {len(c)} on cpu"
        d = {k: max(rel(x[k], y[k]) for x, y in zip(g, c)) for k in ("loss", "grad_norm")}
        d["adapter"], d["adapted tensors"] = adapter_diff(os.path.join(gpu, "adapter"), os.path.join(cpu, "adapter"))
        return d["loss"] < REL_TOL and d["grad_norm"] < REL_TOL and d["adapter"] < ABS_TOL, d

    experts = ['lora.targets=["q_a_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj", "down_proj"]', "lora.routed_experts=true"]
    case("parity-deepseek-v3 routed-expert adapters (cuda) = cpu", lambda: cuda_vs_cpu("parity-deepseek-v3", experts))
    case("parity-deepseek-v3 routed-expert adapters, ZeRO-3 one rank (cuda) = cpu",
         lambda: cuda_vs_cpu("parity-deepseek-v3", experts + ["dist.zero_stage=3", "dist.offload_optimizer=cpu"]))

    def resume(n):
        every = ["checkpoint.every_steps=1"]
        full = train(binary, fx(n), work, n + "-full", every, log, env)
        part_dir = os.path.join(work, n + "-part")
        shutil.rmtree(part_dir, ignore_errors=True)
        shutil.copytree(fx(n), part_dir, ignore=shutil.ignore_patterns("out", "expected", "*.py"))
        ck = "checkpoints/step-000002"
        shutil.copytree(os.path.join(full, ck), os.path.join(part_dir, "out", ck))
        lines = open(os.path.join(full, "metrics.jsonl")).read().splitlines(keepends=True)
        kept = [l for l in lines if json.loads(l).get("step", 0) <= 2]
        open(os.path.join(part_dir, "out/metrics.jsonl"), "w").write("".join(kept))
        args = ["--recipe", os.path.join(part_dir, "recipe.toml"), "--set", "model.device=cuda"] + sum((["--set", e] for e in every), [])
        run(binary, args, log, env)
        key = lambda ms: [(m["step"], m["loss"], m["lr"], m["grad_norm"]) for m in ms]  # timings differ
        same_metrics = key(metrics(os.path.join(part_dir, "out"))) == key(metrics(full))
        a1 = open(os.path.join(full, "adapter/adapter_model.safetensors"), "rb").read()
        a2 = open(os.path.join(part_dir, "out/adapter/adapter_model.safetensors"), "rb").read()
        diff = [(x, y) for x, y in zip(key(metrics(os.path.join(part_dir, "out"))), key(metrics(full))) if x != y]
        return same_metrics and a1 == a2, {"metrics equal": same_metrics, "adapter bytes equal": a1 == a2, "differing (resumed, uninterrupted)": diff}

    case("parity-llama-gqa resumed at step 2 (cuda) = uninterrupted, bit for bit", lambda: resume("parity-llama-gqa"))

    def merge(n):
        out = train(binary, fx(n), work, n + "-merge", [], log, env)
        text = run(binary, ["export", "--run", out, "--merge", "--out", os.path.join(work, n + "-merged")], log, env)
        return True, {"export": text.strip()[-200:]}

    case("export --merge of a cuda run (logits verified)", lambda: merge("parity-llama-gqa"))

    case.finish()


if __name__ == "__main__":
    main()
