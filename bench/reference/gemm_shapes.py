#!/usr/bin/env python3
"""torch's f32 GEMM rate (MKL on x86) on the shapes `bf16_gemm_speed` times for the gemm crate:
the 135M bench model's projections and LM head chunk, then a DeepSeek-V2-Lite expert's 48 rows;
W [n, k] read as Wᵀ (a forward) and a [k, n] W read as is (the input gradient's layout).
Best of 20 calls, 2 threads, as the bench runs:

  .venv/bin/python bench/reference/gemm_shapes.py
  cargo test --release --lib bf16_gemm_speed -- --ignored --nocapture
"""
import time

import torch

torch.set_num_threads(2)
SHAPES = [(2048, 576, 576), (2048, 192, 576), (2048, 1536, 576), (2048, 576, 1536), (170, 49152, 576), (170, 576, 49152), (48, 1408, 2048), (48, 2048, 1408)]


def best(f, calls=20):
    f()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


for m, n, k in SHAPES:
    a, wt, w = torch.rand(m, k), torch.rand(n, k), torch.rand(k, n)
    flop = 2.0 * m * n * k / 1e9
    fwd = flop / best(lambda: a @ wt.t())
    bwd = flop / best(lambda: a @ w)
    print(f"{m}x{n}x{k}: torch f32 x·Wᵀ {fwd:.0f}, x·W {bwd:.0f} GFLOP/s")
