#!/usr/bin/env python3
"""`make interop`: llama.cpp (llama-cpp-python's build) loads a base GGUF plus the LoRA GGUF
`finetune export --format gguf` wrote, and its logits match ours.

Cases:
  llama, qwen2   an F32 base GGUF written here with gguf-py (random weights, a 256-token
                 byte-level vocabulary llama.cpp accepts); finetune trains 3 steps on it
                 straight from the GGUF, exports the adapter, and both runtimes evaluate the
                 same ids with and without it. Tolerance 5e-6 of the logits' scale (llama.cpp
                 with an F32 KV cache and flash attention off agrees to ~1e-5 in f32).
  q8_0 fixture   tests/fixtures/parity-gguf-q8_0/model.gguf (Q8_0, Q4_1, Q5_0, F16 tensors):
                 llama.cpp's quantized matmuls round the activations to 8 bits, so the two
                 differ on the base alone; with the adapter they may differ by at most twice
                 that (a misplaced adapter adds about its whole effect).
Each case also checks that the adapter changes the logits by far more than the tolerance,
so a wrong export (e.g. q/k rows of B not permuted) fails.

Run by scripts/check-interop.sh with the venv holding llama_cpp, numpy and gguf.
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import gguf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release", "finetune")
LLAMA_LOGITS = os.path.join(ROOT, "scripts", "llama_logits.py")
TOKENS = [5, 17, 99, 3, 200, 41, 8, 130, 77, 250, 12, 64]

RECIPE = """
[model]
path = "{model}"
dtype = "f32"
[lora]
rank = 8
alpha = 16
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
[data]
train = "{data}"
format = "tokenized"
[train]
micro_batch_size = 2
max_steps = 3
lr = 0.02
[output]
dir = "{out}"
"""


def byte_tokens():
    """GPT-2's byte -> printable-char table (256 unique tokens)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def permute_rows(w, heads):
    """llama.cpp's converter's q/k row order for its interleaved RoPE."""
    out = w.shape[0]
    return w.reshape(heads, 2, out // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_base(path, arch, seed):
    """A tiny random model as llama.cpp's converter writes it, all tensors F32."""
    rng = np.random.default_rng(seed)
    h, layers, heads, kv, inter, vocab = 256, 2, 4, 2, 512, 256
    hd = h // heads
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"interop-{arch}")
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hd)
    w.add_vocab_size(vocab)
    # A byte-level vocabulary whose one merge is valid for both runtimes: the last byte's
    # token becomes the merge result.
    toks = byte_tokens()
    toks[255] = "ĠĠ"
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types([1] * vocab)
    w.add_token_merges(["Ġ Ġ"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    f = lambda *shape: (rng.standard_normal(shape) * 0.05).astype(np.float32)
    norm = lambda: (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    w.add_tensor("token_embd.weight", f(vocab, h))
    w.add_tensor("output_norm.weight", norm())
    w.add_tensor("output.weight", f(vocab, h))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm())
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
        for name, shape in [("attn_q", (heads * hd, h)), ("attn_k", (kv * hd, h)), ("attn_v", (kv * hd, h)), ("attn_output", (h, heads * hd)),
                            ("ffn_gate", (inter, h)), ("ffn_up", (inter, h)), ("ffn_down", (h, inter))]:
            m = f(*shape)
            if arch == "llama" and name in ("attn_q", "attn_k"):
                m = permute_rows(m, heads if name == "attn_q" else kv)
            w.add_tensor(f"blk.{i}.{name}.weight", np.ascontiguousarray(m))
            if arch == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(f"blk.{i}.{name}.bias", (0.1 * rng.standard_normal(shape[0])).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_f32_copy(src, dst):
    """`src` with every tensor dequantised to F32 by gguf-py (metadata copied as it is): what
    finetune trains on when it trains on `src`."""
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(f.types) > 1 else None
        value = f.contents()
        if name == "tokenizer.ggml.merges" and not value:
            # gguf-py cannot write an empty array; llama.cpp wants the key, not its content,
            # to evaluate token ids.
            value = ["Ġ Ġ"]
        w.add_key_value(name, value, vtype, sub_type=sub)
    for t in r.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w.add_tensor(t.name, data.reshape([int(d) for d in reversed(t.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def run(cmd, **kw):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    if p.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)} exited {p.returncode}\n{p.stderr[-3000:]}")
    return p.stdout


def ours(model, adapter=None):
    cmd = [BIN, "logits", "--model", model, "--tokens", ",".join(map(str, TOKENS))]
    if adapter:
        cmd += ["--adapter", adapter]
    return np.array(json.loads(run(cmd))["logits"], dtype=np.float64)


def llama_cpp(model, lora=None):
    cmd = [sys.executable, LLAMA_LOGITS, "--model", model, "--tokens", ",".join(map(str, TOKENS))]
    if lora:
        cmd += ["--lora", lora]
    return np.array(json.loads(run(cmd))["logits"], dtype=np.float64)


def train_and_export(tmp, name, model, data):
    d = os.path.join(tmp, name)
    os.makedirs(d)
    recipe = os.path.join(d, "recipe.toml")
    with open(recipe, "w") as f:
        f.write(RECIPE.format(model=model, data=data, out=os.path.join(d, "out")))
    run([BIN, "--recipe", recipe])
    adapter = os.path.join(d, "out", "adapter")
    lora = os.path.join(d, "adapter.gguf")
    run([BIN, "export", "--adapter", adapter, "--base", model, "--format", "gguf", "--out", lora])
    return adapter, lora


def main():
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        env_cache = os.path.join(tmp, "cache")
        os.environ["FINETUNE_CACHE"] = env_cache
        run([BIN, "synth", "--out", os.path.join(tmp, "synth"), "--shape", "tiny", "--rows", "16"])
        data = os.path.join(tmp, "synth", "data")
        cases = []
        for arch in ["llama", "qwen2"]:
            base = os.path.join(tmp, f"{arch}.gguf")
            write_base(base, arch, seed=7)
            cases.append((arch, base, "logits"))
        q8 = os.path.join(ROOT, "tests", "fixtures", "parity-gguf-q8_0", "model.gguf")
        q8_f32 = os.path.join(tmp, "q8_0-dequantised.gguf")
        write_f32_copy(q8, q8_f32)
        cases.append(("q8_0 fixture", q8, "delta"))
        # The adapter trained on the Q8_0 base, run by llama.cpp on that base dequantised to
        # F32 by gguf-py: llama.cpp then computes what we computed, to f32 rounding.
        cases.append(("q8_0 fixture dequantised to F32 for llama.cpp", q8, "logits"))
        for name, base, mode in cases:
            adapter, lora = train_and_export(tmp, name.split(" ")[0] + "-" + mode, base, data)
            o0, o1 = ours(base), ours(base, adapter)
            cpp_base = q8_f32 if "dequantised" in name else base
            l0, l1 = llama_cpp(cpp_base), llama_cpp(cpp_base, lora)
            effect = np.abs(o1 - o0).max()
            scale = max(1.0, np.abs(o1).max())
            if mode == "logits":
                tol = 5e-6 * scale
                d0, d1 = np.abs(l0 - o0).max(), np.abs(l1 - o1).max()
                ok = d0 < tol and d1 < tol and effect > 100 * tol
                print(f"{name}: base {d0:.2e}, base + adapter {d1:.2e} max |llama.cpp - finetune| (tolerance {tol:.1e}); "
                      f"the adapter moves the logits by {effect:.3f} -> {'ok' if ok else 'FAIL'}")
            else:
                # llama.cpp's own error on this base (activation rounding) bounds what the
                # adapter may add: a misplaced adapter would add about its whole effect.
                d0, d1 = np.abs(l0 - o0).max(), np.abs(l1 - o1).max()
                ok = d1 < 2 * d0 + 1e-4 * scale and effect > 5 * d1
                print(f"{name}: base {d0:.2e}, base + adapter {d1:.2e} max |llama.cpp - finetune| (llama.cpp rounds activations "
                      f"to 8 bits for quantized matmuls; limit 2x the base's); the adapter moves the logits by {effect:.3f} "
                      f"(logits up to {scale:.1f}) -> {'ok' if ok else 'FAIL'}")
            if not ok:
                failures.append(name)
    if failures:
        sys.exit(f"interop FAILED: {', '.join(failures)}")
    print("interop ok: llama.cpp loads finetune's GGUF adapters and computes finetune's logits")


if __name__ == "__main__":
    main()
