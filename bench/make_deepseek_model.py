#!/usr/bin/env python3
"""A random DeepseekV2ForCausalLM with DeepSeek-V2-Lite's layer shapes, cut to a few layers, for
`make bench`'s MoE row: hidden 2048, 16 heads, MLA (q_proj, kv_lora_rank 512, nope 128, rope 64,
v 128), YaRN as V2-Lite, the first layer dense (intermediate 10944), then MoE layers of 64 routed
experts top-6 (softmax greedy) + 2 shared, moe_intermediate 1408, vocab 102400. Weights from
transformers' own init (seeded, in f32), saved in bf16 with experts stored one by one, as the
hub's V2-Lite checkpoint is. A tokenizer folder given with --tokenizer is copied beside it (PEFT's benchmark
loads one; ids stay below its vocab).

Usage: python bench/make_deepseek_model.py --out DIR [--layers 3] [--tokenizer DIR]
"""
import argparse
import os
import shutil

import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
    cfg = DeepseekV2Config(hidden_size=2048, intermediate_size=10944, num_hidden_layers=a.layers, num_attention_heads=16,
                           num_key_value_heads=16, vocab_size=102400, q_lora_rank=None, kv_lora_rank=512,
                           qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
                           num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408,
                           first_k_dense_replace=1, n_group=1, topk_group=1, topk_method="greedy",
                           routed_scaling_factor=1.0, norm_topk_prob=False, rms_norm_eps=1e-6,
                           max_position_embeddings=163840, rope_parameters=rope, tie_word_embeddings=False,
                           use_cache=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.device("cpu"):
        model = DeepseekV2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(a.out, safe_serialization=True)
    if a.tokenizer:
        for f in os.listdir(a.tokenizer):
            if f.startswith("tokenizer") or f == "special_tokens_map.json":
                shutil.copy(os.path.join(a.tokenizer, f), a.out)


if __name__ == "__main__":
    main()
