#!/usr/bin/env python3
"""Side-by-side training-step benchmark: finetune vs PyTorch + PEFT on the same model shape,
threads and batch, measured in one run so only ratios matter.

  make bench                      # builds, prepares .venv and the model, runs everything
  python3 bench/bench.py --quick  # fewer steps
  python3 bench/bench.py --sections main,batch1 --steps 5   # the speed tables, more timed steps

The model is a random-weight SmolLM2-135M-shaped Llama written by `finetune synth` (HF layout,
so PEFT loads the very same files). The `moe` section writes a 6.7 GB f32 DeepSeek-V2-Lite-shaped
model (3 layers) with transformers and needs about 13 GB of free RAM (PEFT's rows) and 7 GB of disk. LoRA rank 16 on q/k/v/o, 2 threads. Sections: the data
loader; batch 4 x 512 and 1 x 512, each in f32 and with a bf16 base; sequence lengths
256..2048 at a fixed 2048 tokens per step. MFU is model FLOPs per second over the measured
GEMM peak of the row's base dtype (torch: MKL f32, oneDNN bf16, on the model's shapes). Peak RSS is each process's own ru_maxrss (a
fresh child per measurement). After each table the default recipe and PEFT's fastest row run
again alternately (`--pairs`, 3 by default), and the goal lines printed last read the median of
those paired ratios: on a shared VM the table's rows, minutes apart, can differ by the drift.
"""
import argparse
import json
import os
import statistics
import subprocess
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release", "finetune")
VENV_PY = os.path.join(ROOT, ".venv", "bin", "python")
PEFT_BENCH = os.path.join(ROOT, "bench", "reference", "peft_bench.py")

RECIPE = """
[model]
path = "{model}"
dtype = "{dtype}"
[lora]
rank = 16
alpha = 32
targets = {targets}
[data]
train = "{data}"
max_seq_len = {seq}
[train]
max_steps = {steps}
micro_batch_size = {batch}
lr = 1e-4
weight_decay = 0.0
max_grad_norm = 0.0
activation_checkpointing = {ckpt}
[output]
dir = "{out}"
"""


class Skipped(Exception):
    """A row that could not run (failed, or past its time limit): the table shows the reason."""


# A row's limit: PEFT's bf16 base on a CPU without a bf16 unit ran at ~2 GFLOP/s on the AVX2
# EPYC (over 10 minutes a step at 4 x 512) and took the whole bench down when stopped by hand.
ROW_TIMEOUT_S = int(os.environ.get("BENCH_ROW_TIMEOUT_S", "900"))


def peak_rss_of(cmd, env=None, timeout=None):
    """Run cmd in a fresh python child that reports the grandchild's max RSS (MB). Raises
    Skipped when it fails or runs past `timeout` seconds (ROW_TIMEOUT_S by default)."""
    timeout = ROW_TIMEOUT_S if timeout is None else timeout
    wrapper = ("import resource,subprocess,sys;"
               "t=float(sys.argv[1]);"
               "exec('try:\\n r=subprocess.run(sys.argv[2:],stdout=subprocess.PIPE,stderr=sys.stderr,timeout=t)\\n"
               "except subprocess.TimeoutExpired:\\n print(\\'TIMEOUT\\');sys.exit(124)');"
               "sys.stdout.write(r.stdout.decode());"
               "print('RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss);"
               "sys.exit(r.returncode)")
    p = subprocess.run([sys.executable, "-c", wrapper, str(timeout)] + cmd, stdout=subprocess.PIPE, env=env, text=True)
    if p.returncode == 124 and "TIMEOUT" in p.stdout:
        raise Skipped(f"stopped after {timeout} s (BENCH_ROW_TIMEOUT_S)")
    if p.returncode != 0:
        raise Skipped(f"exit status {p.returncode}: {' '.join(os.path.basename(c) for c in cmd[:2])} ...")
    lines = p.stdout.strip().splitlines()
    rss_kb = int([l for l in lines if l.startswith("RSS_KB")][-1].split()[1])
    return [l for l in lines if not l.startswith("RSS_KB")], rss_kb / 1024.0


def ensure_model(cache, seq):
    # Stored in bf16, as the hub's SmolLM2-135M is: PEFT's f32 rows and ours load the same
    # values upcast, and the default recipe keeps them bf16 (model.dtype = "auto").
    model = os.path.join(cache, "smol-bf16", "model")
    data = os.path.join(cache, f"data-{seq}")
    if not os.path.isfile(os.path.join(model, "model.safetensors")):
        subprocess.run([BIN, "synth", "--out", os.path.join(cache, "smol-bf16"), "--shape", "smollm2-135m", "--rows", "8",
                        "--dtype", "bf16"], check=True)
    if not os.path.isdir(data):
        tmp = tempfile.mkdtemp(dir=cache)
        subprocess.run([BIN, "synth", "--out", tmp, "--shape", "tiny", "--rows", "16",
                        "--seq-min", str(seq), "--seq-max", str(seq)], check=True)
        # tiny's vocab (256) ids are valid for the 49152 vocab too.
        os.rename(os.path.join(tmp, "data"), data)
        shutil.rmtree(tmp, ignore_errors=True)  # the tiny model synth wrote beside the data
    return model, data


LLAMA_TARGETS = "q_proj,k_proj,v_proj,o_proj"
MLA_TARGETS = "q_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj"


def ours(model, data, batch, seq, steps, warmup, ckpt, dtype="f32", targets=LLAMA_TARGETS, quantize=None):
    """One row of ours. `ckpt` and `dtype` None: the keys are left out of the recipe (their
    defaults run, as for a user who does not set them)."""
    out = tempfile.mkdtemp(prefix="ft-bench-")
    try:
        return ours_in(out, model, data, batch, seq, steps, warmup, ckpt, dtype, targets, quantize)
    finally:
        # The run folder (adapter, checkpoints: ~30 MB on SmolLM2) is read above and not kept.
        shutil.rmtree(out, ignore_errors=True)


def ours_in(out, model, data, batch, seq, steps, warmup, ckpt, dtype, targets, quantize):
    """`ours` in the folder `out`."""
    recipe = os.path.join(out, "bench.toml")
    with open(recipe, "w") as f:
        text = RECIPE.format(model=model, data=data, seq=seq, steps=steps + warmup, batch=batch,
                             ckpt=str(ckpt).lower(), out=os.path.join(out, "run"), dtype=dtype,
                             targets=json.dumps(targets.split(",")))
        if ckpt is None:
            text = text.replace("activation_checkpointing = none\n", "")
        if dtype is None:
            text = text.replace('dtype = "None"\n', "")
        if quantize:
            text = text.replace("[lora]", f'quantize = "{quantize}"\n[lora]', 1)
        f.write(text)
    env = dict(os.environ, RAYON_NUM_THREADS="2", CANDLE_NUM_THREADS="2")
    _, rss = peak_rss_of([BIN, "--recipe", recipe], env=env)
    with open(os.path.join(out, "run", "metrics.jsonl")) as f:
        m = [json.loads(l) for l in f]
    with open(os.path.join(out, "run", "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out, "run", "recipe.resolved.toml")) as f:
        resolved = f.read()
    dtype_ran = next((l.split("=", 1)[1].strip().strip('"') for l in resolved.splitlines() if l.startswith("dtype")), "?")
    secs = [batch * seq / s["tokens_per_s"] for s in m[warmup:]]
    med = statistics.median(secs)
    return {"tokens_per_s": batch * seq / med, "s_per_step": med, "peak_rss_mb": rss,
            "losses": [s["loss"] for s in m], "kernels": summary.get("kernels", "?"), "cpu": summary.get("cpu", "?"),
            "dtype": dtype_ran}


def peft(model, batch, seq, steps, warmup, ckpt, dtype="f32", targets=LLAMA_TARGETS, extra=()):
    cmd = [VENV_PY, PEFT_BENCH, "--model", model, "--batch", str(batch), "--seq", str(seq),
           "--steps", str(steps), "--warmup", str(warmup), "--threads", "2", "--dtype", dtype,
           "--weight-decay", "0.0", "--targets", targets] + list(extra)
    if ckpt:
        cmd.append("--grad-ckpt")
    lines, rss = peak_rss_of(cmd)
    res = json.loads(lines[-1])
    res["peak_rss_mb"] = max(rss, res["peak_rss_mb"])
    return res


def qlora_7b(cache):
    """A DeepSeek-LLM-7B-shaped Llama (30 layers, random weights) as a Q4_K GGUF written by
    `finetune synth`: plan it, train one 1 x 256 step with activation checkpointing, and
    compare the peak RSS with 8 GB and the frozen bytes the run held with the file's size
    plus one dequantised layer window (bf16)."""
    d = os.path.join(cache, "ds7b-q4_k")
    gguf = os.path.join(d, "model.gguf")
    if not os.path.isfile(gguf):
        print("writing the 7B-shaped Q4_K GGUF (a few minutes) ...", file=sys.stderr, flush=True)
        subprocess.run([BIN, "synth", "--out", d, "--shape", "deepseek-llm-7b", "--rows", "4",
                        "--seq-min", "256", "--seq-max", "256", "--gguf", "q4_k"], check=True)
    out = tempfile.mkdtemp(prefix="ft-bench-7b-")
    try:
        qlora_7b_in(out, d, gguf)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def qlora_7b_in(out, d, gguf):
    """`qlora_7b`'s run in the folder `out`."""
    recipe = os.path.join(out, "bench.toml")
    with open(recipe, "w") as f:
        f.write(RECIPE.format(model=gguf, data=os.path.join(d, "data"), seq=256, steps=1, batch=1, ckpt="true",
                              out=os.path.join(out, "run"), dtype="bf16", targets=json.dumps(LLAMA_TARGETS.split(","))))
    plan = subprocess.run([BIN, "plan", "--recipe", recipe], stdout=subprocess.PIPE, text=True, check=True).stdout
    print("\n" + plan)
    env = dict(os.environ, RAYON_NUM_THREADS="2", CANDLE_NUM_THREADS="2")
    _, rss = peak_rss_of([BIN, "--recipe", recipe], env=env, timeout=3600)
    with open(os.path.join(out, "run", "summary.json")) as f:
        summary = json.load(f)
    mem = summary.get("memory") or {}
    mem = mem[0] if isinstance(mem, list) else mem
    size = os.path.getsize(gguf)
    layer = 2 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096)  # one layer in bf16
    print(f"7B-shaped Q4_K GGUF ({size / 1e9:.2f} GB), 1 x 256 step with checkpointing on {summary.get('cpu', '?')}: "
          f"peak RSS {rss / 1024:.2f} GB (goal: under 8 GB); frozen bytes held {mem.get('frozen', 0) / 1e9:.2f} GB, "
          f"dequantised peak {mem.get('gathered_peak', 0) / 1e9:.2f} GB; file + one bf16 layer = {(size + layer) / 1e9:.2f} GB "
          f"(goal: frozen within 10% of it)")


def data_bench(cache, rows):
    """Stream `rows` text records of ~300 characters (JSONL, shuffled, tokenized with the
    SmolLM2 tokenizer) through the loader: rows/s and peak RSS (no model weights loaded)."""
    import random
    d = os.path.join(cache, "data-1m")
    os.makedirs(d, exist_ok=True)
    data = os.path.join(d, f"text-{rows}.jsonl")
    if not os.path.isfile(data):
        rnd = random.Random(0)
        words = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()
        with open(data + ".tmp", "w") as f:
            for i in range(rows):
                text = " ".join(rnd.choice(words) for _ in range(60))[:300]
                f.write(json.dumps({"text": f"{i} {text}"}) + "\n")
        os.rename(data + ".tmp", data)
    model = os.path.join(d, "model")
    os.makedirs(model, exist_ok=True)
    fx = os.path.join(ROOT, "tests", "fixtures", "chat-templates")
    for n in ["tokenizer.json", "tokenizer_config.json"]:
        with open(os.path.join(fx, n)) as src, open(os.path.join(model, n), "w") as dst:
            dst.write(src.read())
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                   "num_attention_heads": 4, "vocab_size": 49152}, f)
    recipe = os.path.join(d, "stream.toml")
    with open(recipe, "w") as f:
        f.write(f'[model]\npath = "model"\n[lora]\nrank = 8\nalpha = 16\n[data]\ntrain = "{os.path.basename(data)}"\n'
                'format = "text"\nshuffle = true\nshuffle_buffer = 10000\nmax_seq_len = 512\n'
                '[train]\nmax_steps = 1\nlr = 1e-4\n[output]\ndir = "out"\n')
    lines, rss = peak_rss_of([BIN, "data", "stream", "--recipe", recipe, "--rows", str(rows)])
    res = json.loads(lines[-1])
    res["peak_rss_mb"] = rss
    size_mb = os.path.getsize(data) / 1e6
    print(f"\ndata loader: {rows} JSONL rows ({size_mb:.0f} MB), shuffled, tokenized: "
          f"{res['rows_per_s']:.0f} rows/s, {res['tokens_per_s']:.0f} tokens/s, peak RSS {rss:.0f} MB")
    return res


def flops_per_token(model, seq):
    """Model FLOPs of one training step per token (no recomputation counted, as MFU is
    usually defined): forward 2 x (frozen linear params + lm_head) + attention (QK^T and PV
    over the full seq x seq square, as eager/sdpa compute it), backward the same again for the
    input gradients (frozen weights get none), plus 6 x the LoRA params (forward + both grads)."""
    c = json.load(open(os.path.join(model, "config.json")))
    h, i, L, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    nh, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    d = h // nh
    lin = h * nh * d * 2 + 2 * h * kv * d + 3 * h * i  # q, o, k, v, gate/up/down
    lora = 16 * ((h + nh * d) * 2 + 2 * (h + kv * d))   # r16 on q/k/v/o
    fwd = 2 * (lin * L + v * h) + 4 * seq * nh * d * L
    return 2 * fwd + 6 * lora * L


def ensure_moe_model(cache, smol_model):
    """A random DeepSeek-V2-Lite-shaped model cut to 3 layers (1 dense, 2 MoE), stored in bf16
    as the hub's V2-Lite is (~3.3 GB)."""
    model = os.path.join(cache, "ds-v2-lite-3l-bf16")
    if not os.path.isfile(os.path.join(model, "config.json")):
        tmp = model + ".tmp"
        subprocess.run([VENV_PY, os.path.join(ROOT, "bench", "make_deepseek_model.py"), "--out", tmp, "--layers", "3",
                        "--tokenizer", smol_model], check=True)
        os.rename(tmp, model)
    return model


def ensure_random_data(cache, seq, vocab, rows=16):
    """A tokenized dataset of uniform random ids below `vocab` (labels = ids), as PEFT's
    benchmark draws its batches: routing in a random MoE follows the tokens, so both sides must
    see the same kind of ids for the experts' loads (and GEMM sizes) to match."""
    data = os.path.join(cache, f"random-{vocab}-{seq}")
    if not os.path.isdir(data):
        code = ("import sys, torch, datasets; g = torch.Generator().manual_seed(0); "
                "ids = torch.randint(0, int(sys.argv[2]), (int(sys.argv[4]), int(sys.argv[3])), generator=g).tolist(); "
                "datasets.Dataset.from_dict({'input_ids': ids, 'labels': ids}).save_to_disk(sys.argv[1])")
        subprocess.run([VENV_PY, "-c", code, data + ".tmp", str(vocab), str(seq), str(rows)], check=True)
        os.rename(data + ".tmp", data)
    return data


def moe_flops_per_token(model, seq):
    """As `flops_per_token`, for DeepSeek-V2 (MLA, q_proj) with MoE: the experts a token runs
    (top-k routed + shared) count, the others not; the router is counted too."""
    c = json.load(open(os.path.join(model, "config.json")))
    h, L, v, nh = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["num_attention_heads"]
    dn, dr, dv, kvr = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    attn = h * nh * (dn + dr) + h * (kvr + dr) + kvr * nh * (dn + dv) + nh * dv * h
    dense = 3 * h * c["intermediate_size"]
    e, k, sh, mi = c["n_routed_experts"], c["num_experts_per_tok"], c["n_shared_experts"], c["moe_intermediate_size"]
    moe = 3 * h * mi * (k + sh) + h * e
    kd = c["first_k_dense_replace"]
    lin = L * attn + kd * dense + (L - kd) * moe
    lora = 16 * ((h + nh * (dn + dr)) + (h + kvr + dr) + (kvr + nh * (dn + dv)) + (nh * dv + h))
    fwd = 2 * (lin + v * h) + 2 * seq * nh * (dn + dr + dv) * L
    return 2 * fwd + 6 * lora * L


def gemm_peak():
    """Best GEMM rates of the best backend here (MKL / oneDNN through torch, 2 threads) on the
    model's matmul shapes, in FLOP/s: {"f32": ..., "bf16": ...}. bf16 counts because this CPU
    may have AMX / AVX512-BF16 units, which PEFT's bf16 rows use."""
    code = r"""
import time, torch, json
torch.set_num_threads(2)
out = {}
for name, dt in [("f32", torch.float32), ("bf16", torch.bfloat16)]:
    best = 0.0
    for (m, k, n) in [(2048, 576, 1536), (2048, 1536, 576), (2048, 576, 576), (2048, 576, 4096), (1024, 1024, 1024)]:
        a, b = torch.randn(m, k, dtype=dt), torch.randn(k, n, dtype=dt)
        for _ in range(3): a @ b
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 1.0:
            a @ b; reps += 1
        best = max(best, 2 * m * k * n * reps / (time.perf_counter() - t0))
    out[name] = best
print(json.dumps(out))
"""
    out = subprocess.run([VENV_PY, "-c", code], stdout=subprocess.PIPE, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# model.dtype and train.activation_checkpointing left unset: "auto" both (bf16 on a CPU with a
# bf16 unit, and on other CPUs for a checkpoint stored in bf16 such as the bench's models, there
# widened to f32 math; checkpointing that keeps what its budget allows).
DEFAULT_ROW = "finetune default recipe (dtype and checkpointing auto)"


def table(title, rows, peak, fpt_of):
    """Print one table; rows that could not run show their reason. Returns the default
    recipe's (speed vs PEFT fastest, RSS vs PEFT leanest, PEFT fastest row's name), if both ran."""
    ran = [(n, r, seq) for n, r, seq in rows if "skipped" not in r]
    peft_rows = [(n, r) for n, r, _ in ran if n.startswith("PEFT")]
    fastest = max(peft_rows, key=lambda x: x[1]["tokens_per_s"], default=None)
    peft_lean = min((r["peak_rss_mb"] for _, r in peft_rows), default=None)
    print(f"\n{title}")
    print("| configuration | tokens/s | s/step | peak RSS (MB) | MFU | speed vs PEFT fastest | RSS vs PEFT leanest |")
    print("|---|---|---|---|---|---|---|")
    default = None
    for name, r, seq in rows:
        if "skipped" in r:
            print(f"| {name} | skipped: {r['skipped']} | | | | | |", flush=True)
            continue
        # A bf16 row runs its matmuls on the bf16 peak only where the CPU has a bf16 unit; ours
        # computes in f32 elsewhere (PEFT's bf16 rows are skipped there).
        bf16 = "bf16" in name or r.get("dtype") == "bf16"
        mfu = r["tokens_per_s"] * fpt_of(seq) / peak["bf16" if bf16 and peak.get("bf16_unit") else "f32"]
        sp = r["tokens_per_s"] / fastest[1]["tokens_per_s"] if fastest else None
        rs = r["peak_rss_mb"] / peft_lean if peft_lean else None
        if name == DEFAULT_ROW and sp and rs:
            default = (sp, rs, fastest[0])
        shown = f"{name}: {r['dtype']} base" if name == DEFAULT_ROW else name
        print(f"| {shown} | {r['tokens_per_s']:.1f} | {r['s_per_step']:.2f} | {r['peak_rss_mb']:.0f} | {100 * mfu:.0f}% | "
              f"{f'{sp:.2f}x' if sp else '-'} | {f'{rs:.2f}x' if rs else '-'} |", flush=True)
    return default


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 warm-up + 1 timed step")
    # Each row is its own process, so a noisy neighbour can slow one row and not the next; the
    # median of 3 timed steps shrugs off one slow step, which 2 could not (their median is the
    # mean). More steps cost a longer run (each row is ~10-40 s per step here).
    ap.add_argument("--steps", type=int, default=3, help="timed steps per row (median taken), after 1 warm-up")
    # A shared VM's speed drifts by 10-50% within minutes (the 2-core AVX2 EPYC: one
    # configuration ran anywhere from 110 to 210 tokens/s within the hour), and the table runs
    # each row once, minutes apart from the others: a ratio from two rows can be the drift.
    # Alternating the two rows a ratio reads, back to back, pairs them within a minute or two.
    # Each pair costs two more runs (~2-3 min at 4 x 512 here); three make a median that one
    # odd pair cannot move; 0 reads ratios from the table.
    ap.add_argument("--pairs", type=int, default=3,
                    help="after each table, rerun the default recipe and PEFT's fastest row alternately this many times; "
                         "the goal lines then read the median of the paired ratios")
    ap.add_argument("--shapes", default="8x256,2x1024,1x2048,1x4096,8x512",
                    help="the scaling section's shapes, batch x seq (a subset reruns only those)")
    ap.add_argument("--data-only", action="store_true", help="only the data-loader benchmark")
    ap.add_argument("--data-rows", type=int, default=1_000_000)
    ap.add_argument("--sections", default="data,main,batch1,scaling,qlora,moe",
                    help="comma list of: data, main (4 x 512 f32/bf16), batch1 (1 x 512), scaling (seq 256..2048, 2048 tokens/step), "
                         "qlora (SmolLM2 shape from a Q4_1 GGUF vs its bf16 base, 4 x 512), "
                         "qlora7b (a 7B-shaped Q4_K GGUF, one 1 x 256 step: memory only; not in the default list, ~15 min), "
                         "moe (DeepSeek-V2-Lite layer shapes, 3 layers, 1 x 512)")
    a = ap.parse_args()
    if a.steps < 1:
        sys.exit("bench: --steps must be at least 1")
    if a.pairs < 0:
        sys.exit("bench: --pairs must be 0 or more")
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
        assert all(len(s) == 2 and min(s) > 0 for s in shapes)
    except (ValueError, AssertionError):
        sys.exit(f"bench: --shapes wants batch x seq pairs such as 8x512,1x4096, not {a.shapes!r}")
    steps, warmup = (1, 1) if a.quick else (a.steps, 1)
    sections = set(a.sections.split(","))
    cache = os.path.join(ROOT, ".cache", "bench")
    os.makedirs(cache, exist_ok=True)
    if "data" in sections or a.data_only:
        data_bench(cache, a.data_rows)
    if a.data_only:
        return
    model, _ = ensure_model(cache, 512)
    peak = gemm_peak()
    fpt = lambda seq: flops_per_token(model, seq)
    print(f"\nmachine: {os.uname().nodename} ({os.cpu_count()} cpus), 2 threads; SmolLM2-135M shape (hidden 576, 30 layers, "
          f"9 heads, 3 kv heads, vocab 49152), LoRA r16 q/k/v/o")
    print(f"GEMM peak (torch: MKL f32, oneDNN bf16; model shapes, 2 threads): f32 {peak['f32'] / 1e9:.0f} GFLOP/s, "
          f"bf16 {peak['bf16'] / 1e9:.0f} GFLOP/s; a training step is {fpt(512) / 1e9:.2f} GFLOP/token at seq 512; "
          f"MFU = tokens/s x that / the peak of the row's base dtype (torch's best GEMM here, not the CPU's: a "
          f"row above 100% ran faster GEMMs than torch, as our AVX-512 f32 kernels do on AMD Zen 5, where "
          f"torch's f32 peak measured far below the chip's)")
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    bf16_unit = "amx_bf16" in flags or "avx512_bf16" in flags
    peak["bf16_unit"] = bf16_unit
    model_name = next((l.split(":", 1)[1].strip() for l in flags.splitlines() if l.startswith("model name")), "?")
    feats = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags.split()]
    print(f"CPU: {model_name} ({', '.join(feats) or 'no AVX2'}); finetune's kernels are printed after the tables, as its runs report them")

    kernels = []

    def run_rows(configs):
        rows = []
        for name, seq, fn in configs:
            print(f"running: {name} ...", file=sys.stderr, flush=True)
            try:
                r = fn() if callable(fn) else {"skipped": fn}
            except Skipped as e:
                r = {"skipped": str(e)}
            if "kernels" in r and r["kernels"] not in kernels:
                kernels.append(r["kernels"])
            rows.append((name, r, seq))
        return rows

    def paired(configs, d, shape):
        """The default recipe and PEFT's fastest row of a table (`d` as `table` returns it),
        rerun back to back `--pairs` times (in turn each first): `d` with its speed ratio
        replaced by the median of the pairs' ratios, and a line saying each."""
        if not d or a.pairs == 0 or a.quick:
            return d
        fns = {n: fn for n, _, fn in configs}
        ratios = []
        for i in range(a.pairs):
            # Every other pair runs PEFT first, so that a steady drift does not favour one side.
            first = "default recipe" if i % 2 == 0 else d[2]
            print(f"running: pair {i + 1} of {a.pairs}, {shape}: {first} first ...", file=sys.stderr, flush=True)
            try:
                if i % 2 == 0:
                    o, p = fns[DEFAULT_ROW](), fns[d[2]]()
                else:
                    p, o = fns[d[2]](), fns[DEFAULT_ROW]()
            except Skipped as e:
                print(f"{shape}: pair {i + 1} skipped: {e}")
                continue
            ratios.append((o["tokens_per_s"] / p["tokens_per_s"], o["tokens_per_s"], p["tokens_per_s"]))
        if not ratios:
            return d
        med = statistics.median(r for r, _, _ in ratios)
        print(f"{shape}: default recipe against {d[2]} in {len(ratios)} alternating pairs after the table: "
              f"{', '.join(f'{r:.2f}x ({o:.0f} / {p:.0f} tokens/s)' for r, o, p in ratios)} (median {med:.2f}x; the table's rows gave {d[0]:.2f}x)")
        return (med, d[1], f"{d[2]}; median of {len(ratios)} alternating pairs, {d[0]:.2f}x in the table")

    def cfgs(batch, seq, with_bf16):
        _, data = ensure_model(cache, seq)
        c = [
            (DEFAULT_ROW, seq, lambda: ours(model, data, batch, seq, steps, warmup, None, None)),
            ("finetune f32, ckpt = true (recompute all)", seq, lambda: ours(model, data, batch, seq, steps, warmup, True)),
            ("finetune f32, no ckpt", seq, lambda: ours(model, data, batch, seq, steps, warmup, False)),
            ("PEFT f32, no ckpt", seq, lambda: peft(model, batch, seq, steps, warmup, False)),
            ("PEFT f32, grad ckpt", seq, lambda: peft(model, batch, seq, steps, warmup, True)),
        ]
        if with_bf16:
            c += [
                ("finetune bf16 base, ckpt = true (recompute all)", seq, lambda: ours(model, data, batch, seq, steps, warmup, True, "bf16")),
                ("finetune bf16 base, no ckpt", seq, lambda: ours(model, data, batch, seq, steps, warmup, False, "bf16")),
                ("PEFT bf16 base, no ckpt", seq, (lambda: peft(model, batch, seq, steps, warmup, False, "bf16")) if bf16_unit else
                 "no bf16 unit on this CPU: PyTorch's bf16 matmuls run at ~2 GFLOP/s here (over 10 minutes a step)"),
            ]
        return c

    defaults = []
    if "main" in sections:
        c = cfgs(4, 512, True)
        d = table("batch 4 x seq 512 (ratios against PEFT's f32 and bf16 rows together)", run_rows(c), peak, fpt)
        defaults.append(("4 x 512", paired(c, d, "4 x 512")))
    if "batch1" in sections:
        c = cfgs(1, 512, True)
        d = table("batch 1 x seq 512 (ratios against PEFT's f32 and bf16 rows together)", run_rows(c), peak, fpt)
        defaults.append(("1 x 512", paired(c, d, "1 x 512")))
    if "scaling" in sections:
        # The default recipe against PEFT's fastest dtype without checkpointing and PEFT's f32
        # with gradient checkpointing (its leanest f32), one small table per shape: 2048 tokens
        # per step at four sequence lengths, then 4096 tokens (1 x 4096 and 8 x 512).
        fast = "bf16" if bf16_unit else "f32"
        for batch, seq in shapes:
            _, data = ensure_model(cache, seq)
            c = [
                (DEFAULT_ROW, seq, lambda: ours(model, data, batch, seq, steps, warmup, None, None)),
                (f"PEFT {fast}{' base' if fast == 'bf16' else ''}, no ckpt", seq, lambda: peft(model, batch, seq, steps, warmup, False, fast)),
                ("PEFT f32, grad ckpt", seq, lambda: peft(model, batch, seq, steps, warmup, True)),
            ]
            d = table(f"batch {batch} x seq {seq}", run_rows(c), peak, fpt)
            defaults.append((f"{batch} x {seq}", paired(c, d, f"{batch} x {seq}")))
    if "qlora" in sections:
        # The same random SmolLM2-shaped weights (same synth seed) written as a Q4_1 GGUF: the
        # base a QLoRA user holds. Both rows dequantise/convert into bf16 (model.dtype).
        _, data = ensure_model(cache, 512)
        gguf = os.path.join(cache, "smol-q4_1", "model.gguf")
        if not os.path.isfile(gguf):
            subprocess.run([BIN, "synth", "--out", os.path.dirname(gguf), "--shape", "smollm2-135m", "--rows", "8", "--gguf", "q4_1"], check=True)
        print(f"\nQLoRA: SmolLM2-135M shape, Q4_1 GGUF ({os.path.getsize(gguf) / 1e6:.0f} MB) trained directly vs the bf16 safetensors base "
              f"({os.path.getsize(os.path.join(model, 'model.safetensors')) / 2e6:.0f} MB in bf16), batch 4 x 512, activation ckpt")
        rows = run_rows([
            ("finetune bf16 base, activation ckpt", 512, lambda: ours(model, data, 4, 512, steps, warmup, True, "bf16")),
            ("finetune Q4_1 GGUF base, activation ckpt", 512, lambda: ours(gguf, data, 4, 512, steps, warmup, True, "bf16")),
            ("finetune model.quantize = q8_0, activation ckpt", 512, lambda: ours(model, data, 4, 512, steps, warmup, True, "bf16", quantize="q8_0")),
            ("PEFT + bitsandbytes NF4 (double quant), grad ckpt", 512, lambda: peft(model, 4, 512, steps, warmup, True, extra=["--load-in-4bit"])),
        ])
        table("QLoRA, batch 4 x seq 512 (ratios against the bf16 base row)", rows, peak, fpt)
        base, q = rows[0][1], rows[1][1]
        if "tokens_per_s" in base and "tokens_per_s" in q:
            print(f"Q4_1 GGUF base: {q['tokens_per_s'] / base['tokens_per_s']:.2f}x the tokens/s of the bf16 base, "
                  f"{base['peak_rss_mb'] - q['peak_rss_mb']:.0f} MB less peak RSS (goals: at least 0.8x, at least 120 MB less)")
        bnb = rows[3][1]
        if "tokens_per_s" in q and "tokens_per_s" in bnb:
            print(f"Q4_1 GGUF base against PEFT + bitsandbytes NF4: {q['tokens_per_s'] / bnb['tokens_per_s']:.2f}x the tokens/s, "
                  f"{q['peak_rss_mb'] / bnb['peak_rss_mb']:.2f}x the peak RSS")
    if "qlora7b" in sections:
        qlora_7b(cache)
    if "moe" in sections:
        moe = ensure_moe_model(cache, model)
        data = ensure_random_data(cache, 512, 102400)
        mfpt = lambda seq: moe_flops_per_token(moe, seq)
        print(f"\nMoE: DeepSeek-V2-Lite layer shapes (hidden 2048, 16 heads, kv_lora_rank 512, 64 experts top-6 + 2 shared, "
              f"moe_intermediate 1408, vocab 102400) cut to 3 layers (1 dense, 2 MoE), LoRA r16 on q_proj/kv_a_proj_with_mqa/"
              f"kv_b_proj/o_proj; {mfpt(512) / 1e9:.2f} GFLOP/token (active experts only)")
        # The default recipe, our f32 rows, and PEFT with both experts implementations in f32
        # and, where the CPU has a bf16 unit, in bf16 loaded straight in bf16 (as from the
        # hub's bf16 V2-Lite checkpoint).
        c = [
            (DEFAULT_ROW, 512, lambda: ours(moe, data, 1, 512, steps, warmup, None, None, targets=MLA_TARGETS)),
            ("finetune f32, ckpt = true (recompute all)", 512, lambda: ours(moe, data, 1, 512, steps, warmup, True, targets=MLA_TARGETS)),
            ("finetune f32, no ckpt", 512, lambda: ours(moe, data, 1, 512, steps, warmup, False, targets=MLA_TARGETS)),
            ("PEFT f32, no ckpt, eager experts", 512, lambda: peft(moe, 1, 512, steps, warmup, False, targets=MLA_TARGETS, extra=["--experts", "eager"])),
            ("PEFT f32, no ckpt, grouped_mm experts", 512, lambda: peft(moe, 1, 512, steps, warmup, False, targets=MLA_TARGETS, extra=["--experts", "grouped_mm"])),
        ]
        if bf16_unit:
            c += [(f"PEFT bf16 base, no ckpt, {e} experts", 512,
                   lambda e=e: peft(moe, 1, 512, steps, warmup, False, "bf16", targets=MLA_TARGETS, extra=["--experts", e, "--load-in-dtype"]))
                  for e in ("eager", "grouped_mm")]
        d = table("DeepSeek-V2-Lite MoE cut, batch 1 x seq 512 (ratios against PEFT's fastest and leanest rows)", run_rows(c), peak, mfpt)
        d = paired(c, d, "MoE 1 x 512")
        if d:
            goal = "1.5x speed with the bf16 base" if bf16_unit else "1.2x speed in f32"
            print(f"MoE default recipe: {d[0]:.2f}x the speed of PEFT's fastest ({d[2]}), {d[1]:.2f}x the RSS of its leanest "
                  f"(#18's goals on this CPU: at least {goal}, at most 0.4x RSS)")
    for k in kernels:
        print(f"finetune ran: {k}")
    goal = "1.5x speed with the bf16 base" if bf16_unit else "1.1x speed in f32"
    for shape, d in defaults:
        if d:
            print(f"default recipe, {shape}: {d[0]:.2f}x the speed of PEFT's fastest ({d[2]}), {d[1]:.2f}x the RSS of its leanest "
                  f"(goals on this CPU: at least {goal}, at most 0.35x RSS)")
        else:
            print(f"default recipe, {shape}: no ratio (a row was skipped)")


if __name__ == "__main__":
    main()
