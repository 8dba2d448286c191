#!/usr/bin/env python3
"""Evaluate token ids with llama.cpp (llama-cpp-python's low-level ctypes API) and print
the logits of every position as JSON.

Usage:
  llama_logits.py --model base.gguf [--lora adapter.gguf [--lora-scale 1.0]] --tokens 1,2,3
                  [--threads 2] [--out logits.json] [--verbose]

Output JSON: {"n_vocab": V, "tokens": [...], "logits": [[V floats] for each position]}
Exit codes: 0 ok, 1 llama.cpp failure (reason from llama.cpp's log printed on stderr), 2 usage.

Notes:
- Token ids go straight into a llama_batch: nothing is tokenized and no BOS is added
  (BOS is only added by tokenization, e.g. Llama.tokenize(add_bos=True)).
- Every position is marked as an output (batch.logits[i] = 1): this replaces the old
  context-level `logits_all` flag, which no longer exists in llama.cpp itself
  (llama-cpp-python's Llama(logits_all=True) just sets the per-token flags).
- KV cache is F32 (llama.cpp's default is F16, costing ~1e-3 relative accuracy) and flash
  attention is off, so results can be compared tightly with an f32 reference.
- The LoRA is loaded with llama_adapter_lora_init and checked for NULL here: the high-level
  Llama(lora_path=...) of llama-cpp-python 0.3.36 does not detect a NULL return (restype is
  POINTER(c_void_p), never None) and then segfaults in llama_set_adapters_lora.
- --lora-scale is the *user* scale; llama.cpp multiplies it by adapter.lora.alpha / rank.
"""
import argparse
import ctypes
import json
import sys

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--lora", default=None)
    ap.add_argument("--lora-scale", type=float, default=1.0)
    ap.add_argument("--tokens", required=True, help="comma-separated token ids")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write JSON here instead of stdout")
    ap.add_argument("--verbose", action="store_true", help="echo all llama.cpp log output")
    args = ap.parse_args()

    try:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip() != ""]
    except ValueError:
        print("bad --tokens", file=sys.stderr)
        return 2
    if not tokens:
        print("no tokens", file=sys.stderr)
        return 2

    import llama_cpp as L

    # capture llama.cpp's log: errors/warnings always go to stderr, the rest with --verbose
    # (ggml.h: NONE=0 DEBUG=1 INFO=2 WARN=3 ERROR=4 CONT=5; llama-cpp-python's own _logger.py
    # still uses an older numbering)
    log_lines = []
    last_level = [2]

    @L.llama_log_callback
    def _log(level, text, user_data):
        s = text.decode("utf-8", errors="replace")
        if level != 5:
            last_level[0] = level
        log_lines.append(s)
        if args.verbose or last_level[0] >= 3:
            sys.stderr.write(s)

    L.llama_log_set(_log, ctypes.c_void_p(0))
    L.llama_backend_init()

    def fail(msg):
        print(f"llama_logits: {msg}", file=sys.stderr)
        return 1

    mparams = L.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = L.llama_model_load_from_file(args.model.encode(), mparams)
    if not model:
        return fail(f"failed to load model {args.model}")

    ctx = None
    batch = None
    try:
        vocab = L.llama_model_get_vocab(model)
        n_vocab = L.llama_vocab_n_tokens(vocab)
        n = len(tokens)
        bad = [t for t in tokens if not 0 <= t < n_vocab]
        if bad:
            return fail(f"token ids out of range [0,{n_vocab}): {bad[:5]}")

        cparams = L.llama_context_default_params()
        cparams.n_ctx = max(256, n)          # rounded up to a multiple of 256 by llama.cpp anyway
        cparams.n_batch = n                  # whole sequence in one decode call ...
        cparams.n_ubatch = n                 # ... and one micro-batch
        cparams.n_seq_max = 1
        cparams.n_threads = args.threads
        cparams.n_threads_batch = args.threads
        cparams.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.type_k = L.GGML_TYPE_F32
        cparams.type_v = L.GGML_TYPE_F32
        cparams.offload_kqv = False
        cparams.no_perf = True
        ctx = L.llama_init_from_model(model, cparams)
        if not ctx:
            return fail("failed to create context")

        if args.lora:
            adapter = L.llama_adapter_lora_init(model, args.lora.encode())
            if not adapter:  # NULL -> loader threw; its reason was logged at ERROR level
                reason = [s.strip() for s in log_lines if "failed to apply lora adapter" in s or "failed to open" in s]
                return fail(f"failed to load LoRA adapter {args.lora}: {reason[-1] if reason else '?'}")
            adapters = (L.llama_adapter_lora_p_ctypes * 1)(adapter)
            scales = (ctypes.c_float * 1)(args.lora_scale)
            if L.llama_set_adapters_lora(ctx, adapters, 1, scales) != 0:
                return fail("llama_set_adapters_lora failed")
            # the adapter is owned by the model and freed with it

        batch = L.llama_batch_init(n, 0, 1)
        batch.n_tokens = n
        for i, t in enumerate(tokens):
            batch.token[i] = t
            batch.pos[i] = i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            return fail(f"llama_decode returned {rc}")

        logits = np.empty((n, n_vocab), dtype=np.float32)
        for i in range(n):
            p = L.llama_get_logits_ith(ctx, i)
            if not p:
                return fail(f"no logits for position {i}")
            logits[i] = np.ctypeslib.as_array(p, shape=(n_vocab,))
    finally:
        if batch is not None:
            L.llama_batch_free(batch)
        if ctx:
            L.llama_free(ctx)
        L.llama_model_free(model)

    out = {"n_vocab": int(n_vocab), "tokens": tokens, "logits": logits.tolist()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f)
    else:
        json.dump(out, sys.stdout)
        sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
