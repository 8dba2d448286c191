#!/usr/bin/env python3
"""Several ranks over NCCL, on a machine with one GPU: what `dist` computes across processes.

Usage (on the GPU machine, from the repository root, with the binary from scripts/build-cuda.sh):
    python3 scripts/gpu_dist_check.py --bin target/cuda/release/finetune --out OUTDIR [--only NAME ...]

NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected") when they share
a host. Each process here is started as torchrun would start one per node (RANK, WORLD_SIZE,
LOCAL_RANK=0, MASTER_ADDR=127.0.0.1) with its own NCCL_HOSTID, so NCCL sees N one-GPU "nodes"
and joins them over its socket transport on loopback. Every process still drives the same GPU,
so this checks the collectives, the rendezvous, ZeRO-3's gathers and the reduce-scatter of the
LoRA gradients as a multi-node run uses them; it says nothing about NVLink/P2P speed.

Each case compares N processes with one rank on the same GPU (one process, no NCCL) at the parity
tolerances (losses and grad_norm 1e-5 relative, adapters 1e-5 absolute), the global batch held
(micro_batch_size 1, grad_accum_steps 4 / N):
  * DeepSeek-V2 (MLA + MoE, f32) with ZeRO-3 over 2 and 4 processes; one rank is also held to
    PEFT's numbers;
  * DeepSeek-V2 with adapters on every routed expert and 2-token rows over 4 processes, so each
    rank's micro-batch reaches at most 4 of the 6 experts of a layer (ranks skip experts);
  * DeepSeek-V3 (q low-rank path, sigmoid group-limited routing) with routed-expert adapters;
  * Llama with a bf16 base (bf16 gathers) and with zero_stage 0 (every rank holds the base);
  * a run saved on 2 processes at step 2 and resumed on 4 equals the uninterrupted one-rank run;
  * make bench's MoE model (DeepSeek-V2-Lite layer shapes, 3 layers, bf16 base: 3.2 GB) on 1, 2 and
    4 processes: each process's peak GPU memory (nvidia-smi) drops by at least 80% of what
    `finetune plan` says sharding saves, and the losses are the same (needs transformers);
  * last, a process killed mid-run: the other stops within dist.timeout_s with the watchdog's
    error (NCCL alone would wait forever).
It prints one line per case, writes OUTDIR/gpu-dist-check.json, and exits 1 if a case failed.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check as g  # noqa: E402 - the single-GPU check's helpers (fixture copies, comparisons)

TIMEOUT_S = 90
PORT = [29600]
CASES = []  # the running checks: after a launch that hung, the later cases are skipped, not each waited out


def spawn(binary, args, world, env):
    """Start `finetune args` as `world` processes, one rank each, all on cuda:0; (process, stdout
    file, stderr file) of each."""
    PORT[0] += 1
    procs = []
    for r in range(world):
        e = dict(env, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(PORT[0]),
                 # One "host" per process: NCCL's duplicate-GPU check compares host hashes.
                 NCCL_HOSTID=f"finetune-check-rank-{r}",
                 # The ranks meet over TCP on loopback: no InfiniBand, no shared memory or P2P
                 # between "hosts", no NVLink SHARP or multi-node NVLink.
                 NCCL_IB_DISABLE="1", NCCL_NET="Socket", NCCL_SOCKET_IFNAME="lo", NCCL_NVLS_ENABLE="0",
                 NCCL_MNNVL_ENABLE="0", NCCL_DEBUG="WARN")
        # Files, not pipes: a rank blocked on a full pipe while we wait on another would hang.
        so, se = (open(f"/tmp/gpu-dist-check/rank{r}.{k}", "w+") for k in ("out", "err"))
        procs.append((subprocess.Popen([binary, *args], stdout=so, stderr=se, text=True, env=e), so, se))
    return procs


def collect(procs, args, log, t, timeout=None, hang_skips=True):
    """Wait for the processes of `spawn` (killing all at `timeout` seconds after t, TIMEOUT_S by
    default; a kill then skips the later cases unless `hang_skips` is off); [(stdout, stderr, exit
    status)] of each, written to the log."""
    timeout = TIMEOUT_S if timeout is None else timeout
    outs = []
    for r, (p, so, se) in enumerate(procs):
        note = ""
        try:
            p.wait(timeout=max(1, timeout - (time.time() - t)))
        except subprocess.TimeoutExpired:
            for q, _, _ in procs:
                q.kill()
            p.wait()
            note = f"\n(killed after {timeout} s)"
            for c in CASES if hang_skips else []:
                c.skip = f"an earlier run hung: finetune {' '.join(args[:2])}"
        so.seek(0)
        se.seek(0)
        outs.append((so.read(), se.read() + note, p.returncode))
        so.close()
        se.close()
    with open(log, "a") as f:
        for r, (so, se, rc) in enumerate(outs):
            f.write(f"$ RANK={r} WORLD_SIZE={len(procs)} finetune {' '.join(args)}\n{so}\n{se}\nexit {rc}\n\n")
        f.write(f"({len(procs)} processes, {time.time() - t:.1f}s)\n\n")
    return outs


def launch(binary, args, world, env, log):
    """Run `finetune args` as `world` processes and wait for all; world 1 is a plain one-process
    run (no NCCL). Rank 0's stdout."""
    if world == 1:
        return g.run(binary, args, log, env)
    t = time.time()
    outs = collect(spawn(binary, args, world, env), args, log, t)
    failed = [r for r, o in enumerate(outs) if o[2] != 0]
    if failed:
        r = failed[0]
        raise RuntimeError(f"rank {r} of {world} exited {outs[r][2]}: {outs[r][1].strip()[-800:]}")
    return outs[0][0]


MOE_RECIPE = """
[model]
path = "{model}"
dtype = "bf16"
device = "cuda"
[lora]
rank = 16
alpha = 32
targets = ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
[data]
train = "{data}"
format = "tokenized"
max_seq_len = 512
[train]
max_steps = 3
micro_batch_size = 1
grad_accum_steps = {accum}
lr = 1e-4
[dist]
zero_stage = 3
offload_optimizer = "cpu"
[output]
dir = "{out}"
"""


def peak_per_process(fn):
    """Run fn() while sampling nvidia-smi every 100 ms; {pid: peak GPU MiB} of the processes seen."""
    peaks = {}

    def sample():
        q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"], capture_output=True, text=True)
        for line in q.stdout.splitlines():
            pid, mb = (x.strip() for x in line.split(","))
            if mb.isdigit():
                peaks[pid] = max(peaks.get(pid, 0), int(mb))

    g.sampling(fn, sample, 0.1)
    return peaks


def train(binary, fixture, work, name, sets, world, env, log, drop=()):
    """Train a copy of fixture on `world` processes, the global batch held at 4 micro-batches of
    one row; the run folder."""
    sets = ["train.micro_batch_size=1", f"train.grad_accum_steps={4 // world}", *sets]
    args, out = g.prepare(fixture, work, name, sets, drop)
    launch(binary, args, world, env, log)
    return out


def against(out, ref):
    """Largest relative loss / grad_norm and absolute adapter differences of run `out` from `ref`."""
    a, b = g.metrics(out), g.metrics(ref)
    assert len(a) == len(b), f"{len(a)} steps against {len(b)}"
    assert [m["tokens"] for m in a] == [m["tokens"] for m in b], "target tokens per step differ"
    d = {k: max(g.rel(x[k], y[k]) for x, y in zip(a, b)) for k in ("loss", "grad_norm")}
    d["adapter"], d["adapted tensors"] = g.adapter_diff(os.path.join(out, "adapter"), os.path.join(ref, "adapter"))
    return d


def within(d):
    return d["loss"] < g.REL_TOL and d["grad_norm"] < g.REL_TOL and d["adapter"] < g.ABS_TOL


def main():
    case = g.Cases("gpu-dist-check", __doc__)
    binary, work, log, env, fx = case.binary, case.work, case.log, case.env, g.fixture
    CASES.append(case)

    def worlds(n, tag, sets, drop=(), peft=False):
        z3 = ["dist.zero_stage=3", "dist.offload_optimizer=cpu", *sets]
        one = train(binary, fx(n), work, f"{n}-{tag}-w1", z3, 1, env, log, drop)
        d = {}
        ok = True
        if peft:
            ok, d["one rank vs PEFT"] = g.compare_to_peft(fx(n), one)
        for w in (2, 4):
            d[f"{w} processes"] = against(train(binary, fx(n), work, f"{n}-{tag}-w{w}", z3, w, env, log, drop), one)
            ok = ok and within(d[f"{w} processes"])
        return ok, d

    case("parity-deepseek-v2 ZeRO-3, 2 and 4 processes (NCCL) = one rank", lambda: worlds("parity-deepseek-v2", "z3", [], peft=True))
    # The rows of tests/dist.rs's world_sizes_1_2_4_agree_on_a_moe_model_whose_ranks_skip_experts.
    rows = os.path.join(work, "two-token-rows.jsonl")
    with open(rows, "w") as f:
        for i in range(40):
            ids = [1 + i % 199, 1 + (7 * i + 3) % 199]
            f.write(json.dumps({"input_ids": ids, "labels": ids}) + "\n")
    experts = ['lora.targets=["q_proj", "kv_b_proj", "o_proj", "down_proj"]', "lora.routed_experts=true", f'data.train="{rows}"']
    case("parity-deepseek-v2 routed-expert adapters, 2-token rows (ranks skip experts), 2 and 4 processes = one rank",
         lambda: worlds("parity-deepseek-v2", "skip", experts, drop=("init_from",)))
    v3 = ['lora.targets=["q_a_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj", "down_proj"]', "lora.routed_experts=true"]
    case("parity-deepseek-v3 routed-expert adapters ZeRO-3, 2 and 4 processes = one rank",
         lambda: worlds("parity-deepseek-v3", "experts", v3, drop=("init_from",)))
    case("parity-llama-gqa bf16 base ZeRO-3, 2 and 4 processes = one rank", lambda: worlds("parity-llama-gqa", "bf16", ["model.dtype=bf16"]))

    def zero0(n):
        one = train(binary, fx(n), work, f"{n}-z0-w1", [], 1, env, log)
        d = against(train(binary, fx(n), work, f"{n}-z0-w2", ["dist.zero_stage=0", "dist.offload_optimizer=cpu"], 2, env, log), one)
        return within(d), d

    case("parity-llama-gqa zero_stage 0, 2 processes = one rank", lambda: zero0("parity-llama-gqa"))

    def resume(n):
        z3 = ["dist.zero_stage=3", "dist.offload_optimizer=cpu", "checkpoint.every_steps=1"]
        one = train(binary, fx(n), work, f"{n}-resume-w1", z3, 1, env, log)
        two = train(binary, fx(n), work, f"{n}-resume-w2", z3, 2, env, log)
        sets = ["train.micro_batch_size=1", "train.grad_accum_steps=1", *z3]
        args, four = g.prepare(fx(n), work, f"{n}-resume-w4", sets)
        ck = "checkpoints/step-000002"
        shutil.copytree(os.path.join(two, ck), os.path.join(four, ck))
        lines = open(os.path.join(two, "metrics.jsonl")).read().splitlines(keepends=True)
        open(os.path.join(four, "metrics.jsonl"), "w").write("".join(l for l in lines if json.loads(l).get("step", 0) <= 2))
        launch(binary, args, 4, env, log)
        d = against(four, one)
        return within(d), d

    case("parity-deepseek-v2 saved on 2 processes at step 2, resumed on 4 = uninterrupted one rank", lambda: resume("parity-deepseek-v2"))

    def memory():
        # make bench's MoE model (DeepSeek-V2-Lite layer shapes, 3 layers, bf16: 3.2 GB) on 1, 2
        # and 4 processes: what each process holds on the GPU, against `finetune plan`.
        cache = os.path.join(work, "moe")
        subprocess.run([binary, "synth", "--out", os.path.join(cache, "smol"), "--shape", "smollm2-135m", "--rows", "8"], check=True, env=env,
                       capture_output=True)
        model = os.path.join(cache, "model")
        subprocess.run([sys.executable, os.path.join(g.ROOT, "bench/make_deepseek_model.py"), "--out", model, "--layers", "3",
                        "--tokenizer", os.path.join(cache, "smol", "model")], check=True, capture_output=True)
        ids = os.path.join(cache, "ids.jsonl")
        with open(ids, "w") as f:
            for i in range(16):
                row = [(7919 * (i * 512 + j)) % 102400 for j in range(512)]
                f.write(json.dumps({"input_ids": row, "labels": row}) + "\n")
        d, losses, frozen = {}, {}, {}
        for w in (1, 2, 4):
            run_dir = os.path.join(cache, f"w{w}")
            recipe = os.path.join(cache, f"w{w}.toml")
            open(recipe, "w").write(MOE_RECIPE.format(model=model, data=ids, accum=4 // w, out=run_dir))
            plan = g.run(binary, ["plan", "--recipe", recipe, "--world-size", str(w)], log, env)
            def row(label):  # the plan's figure for one world size, in MiB ("3.10 GiB" or "295.5 MiB")
                v, unit = next(l for l in plan.splitlines() if l.strip().startswith(label)).split()[-2:]
                return float(v) * (1024 if unit == "GiB" else 1)
            frozen[w] = row("frozen base kept")
            peaks = peak_per_process(lambda: launch(binary, ["--recipe", recipe], w, env, log))
            losses[w] = [m["loss"] for m in g.metrics(run_dir)]
            d[f"{w} process(es)"] = {"GPU MiB per process (nvidia-smi peak)": sorted(peaks.values()), "plan: frozen base kept": frozen[w],
                                     "plan: total": row("total as the recipe runs")}
        one = min(d["1 process(es)"]["GPU MiB per process (nvidia-smi peak)"])
        ok = all(l == losses[1] for l in losses.values())
        d["losses equal"] = ok
        for w in (2, 4):
            # Sharding must show in what the device holds: a process of w ranks keeps at least
            # 80% less of the base than one rank, as the plan's own-shard row says it should.
            saved = one - max(d[f"{w} process(es)"]["GPU MiB per process (nvidia-smi peak)"])
            d[f"{w}: MiB saved per process, measured / planned"] = [round(saved), round(frozen[1] - frozen[w])]
            ok = ok and saved >= 0.8 * (frozen[1] - frozen[w])
        return ok, d

    case("DeepSeek-V2-Lite-shaped MoE (3 layers, bf16) ZeRO-3 on 1, 2, 4 processes: each holds 1/N of the base", memory)

    def killed_peer(n, timeout_s=15):
        # A long run on 2 processes; once rank 0 has finished 3 steps, rank 1 is killed (as an
        # OOM kill or a lost node would). Rank 0 is then waiting in a collective that can never
        # complete: its watchdog must stop it with an error naming the collective, a timeout_s
        # after the collective was issued, not leave it waiting forever.
        sets = ["train.micro_batch_size=1", "train.grad_accum_steps=2", "train.max_steps=100000", f"dist.timeout_s={timeout_s}",
                "dist.zero_stage=3", "dist.offload_optimizer=cpu"]
        args, _ = g.prepare(fx(n), work, f"{n}-killed", sets)
        t = time.time()
        procs = spawn(binary, args, 2, env)
        while "step 3/" not in open("/tmp/gpu-dist-check/rank0.err").read():  # progress goes to stderr
            if time.time() - t > 60 or any(p.poll() is not None for p, _, _ in procs):
                collect(procs, args, log, t, timeout=time.time() - t + 1, hang_skips=False)
                raise RuntimeError("rank 0 did not reach step 3 (or a rank exited first)")
            time.sleep(0.2)
        procs[1][0].kill()
        killed = time.time()
        outs = collect(procs, args, log, t, timeout=killed - t + timeout_s + 30)
        took = time.time() - killed
        err = outs[0][1]
        # The watchdog's own count of the wait: it must not have fired before timeout_s.
        waited = [float(w) for w in re.findall(r"has not completed after (\d+) s", err)]
        d = {"rank 0 exit": outs[0][2], "rank 1 exit": outs[1][2], "seconds after the kill": round(took, 1),
             "rank 0 said": err.strip().splitlines()[-2:]}
        ok = outs[0][2] == 1 and outs[1][2] == -9 and waited and waited[0] >= timeout_s and took < timeout_s + 10
        return bool(ok), d

    # Last: if the watchdog fails, the kill of the hung rank would skip every later case.
    case("a process killed mid-run: the other stops with the watchdog's error within dist.timeout_s", lambda: killed_peer("parity-deepseek-v2"))

    case.finish()


if __name__ == "__main__":
    main()
