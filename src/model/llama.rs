//! Llama / Qwen2 decoder for LoRA training (transformers' `modeling_llama.py`, eager attention).
//!
//! Dimension legend:
//!   B  micro-batch rows            S  sequence length (padded)
//!   H  hidden_size                 I  intermediate_size
//!   NH num_attention_heads         KV num_key_value_heads      R = NH / KV (query heads per kv head)
//!   D  head_dim                    V  vocab_size               N = B * S (flattened tokens)
//!
//! Each block is built by `load(vb, cfg, ..)` from a [`Frozen`] view of its layer just before
//! it runs (`super::Model`), so a sharded weight source can gather one layer at a time.
//! Fields are named after the HF keys. Every op comes from `ops` and is handed the run's
//! [`Kernels`] (in [`ForwardCtx`]); which version runs on which device is decided there,
//! never here.

use super::{linear, ForwardCtx, KvCache};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::lora::{Adapters, DropoutCtx, LoraLinear};
use crate::ops::checkpoint::Keep;
use crate::ops::{self, Kernels};
use crate::weights::Frozen;
use candle_core::Tensor;

pub struct Attention<'a> {
    layer: usize,
    q_proj: LoraLinear<'a>,
    k_proj: LoraLinear<'a>,
    v_proj: LoraLinear<'a>,
    o_proj: LoraLinear<'a>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

impl<'a> Attention<'a> {
    /// `vb` is the layer's view (`model.layers.{layer}`).
    pub fn load(vb: &Frozen, cfg: &ModelConfig, layer: usize, lora: &'a Adapters) -> Result<Self> {
        Ok(Attention {
            layer,
            q_proj: linear(vb, cfg, layer, "self_attn.q_proj", lora)?,
            k_proj: linear(vb, cfg, layer, "self_attn.k_proj", lora)?,
            v_proj: linear(vb, cfg, layer, "self_attn.v_proj", lora)?,
            o_proj: linear(vb, cfg, layer, "self_attn.o_proj", lora)?,
            num_heads: cfg.num_attention_heads,
            num_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
        })
    }

    /// x [N, H] (rows of B sequences of S, as `ctx` says) -> [N, H]
    pub fn forward(&self, x: &Tensor, ctx: &ForwardCtx) -> Result<Tensor> {
        self.forward_cached(x, ctx, None)
    }

    /// As `forward`, with keys/values of earlier positions in `cache` (generation); `ctx`
    /// then carries `cache_mask` [1, 1, S, T] with T = cached + S.
    ///
    /// Hidden states stay [N, H] and heads move with one op each way (`ops::split_heads`,
    /// `rope_heads`, `merge_heads`): every reshape/transpose node would cost candle's backward
    /// a zeroed gradient buffer and an add of its full size.
    pub fn forward_cached(&self, x: &Tensor, ctx: &ForwardCtx, cache: Option<&mut KvCache>) -> Result<Tensor> {
        let (b, _, s, _) = ctx.cos.dims4()?;
        let (nh, kv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let kern = ctx.kernels;
        let keep = ctx.keep(self.layer);
        let q = self.q_proj.forward_kept(kern, x, ctx.dropout, &keep)?; // [N, NH*D]
        let k = self.k_proj.forward_kept(kern, x, ctx.dropout, &keep)?; // [N, KV*D]
        let v = self.v_proj.forward_kept(kern, x, ctx.dropout, &keep)?; // [N, KV*D]
        // Rotated and transposed to heads-first in one pass.
        let q = ops::rope_heads(kern, &q, nh, &ctx.cos, &ctx.sin)?; // [B, NH, S, D]
        let mut k = ops::rope_heads(kern, &k, kv, &ctx.cos, &ctx.sin)?; // [B, KV, S, D]
        let mut v = ops::split_heads(kern, &v, b, s, kv)?; // [B, KV, S, D]
        if let Some(cache) = cache {
            if let Some((pk, pv)) = cache.take() {
                k = Tensor::cat(&[&pk, &k], 2)?; // [B, KV, T, D]
                v = Tensor::cat(&[&pv, &v], 2)?; // [B, KV, T, D]
            }
            *cache = Some((k.clone(), v.clone()));
        }
        let scale = 1.0 / (d as f64).sqrt();
        let out = match &ctx.cache_mask {
            // Training and prefill: strips, never [S, S] scores (ops/attention.rs).
            None => ops::causal_attention(kern, &q, &k, &v, scale, &ctx.key_start, keep.clone(), ctx.matmul)?, // [B, NH, S, D]
            // Generation over cached keys.
            Some(mask) => ops::attention::cached_attention(&q, &k, &v, scale, mask)?, // [B, NH, S, D]
        };
        let out = ops::merge_heads(kern, &out)?; // [N, NH*D]
        self.o_proj.forward_kept(kern, &out, ctx.dropout, &keep) // [N, H]
    }
}

/// The SwiGLU MLP: Llama's, and DeepSeek's dense layers, shared experts and each routed expert.
pub struct Mlp<'a> {
    gate_proj: LoraLinear<'a>,
    up_proj: LoraLinear<'a>,
    down_proj: LoraLinear<'a>,
}

impl<'a> Mlp<'a> {
    /// The MLP at `prefix` (`mlp`, `mlp.shared_experts`, `mlp.experts.{j}`) of the layer `vb` views.
    pub fn load(vb: &Frozen, cfg: &ModelConfig, layer: usize, prefix: &str, lora: &'a Adapters) -> Result<Self> {
        Ok(Mlp {
            gate_proj: linear(vb, cfg, layer, &format!("{prefix}.gate_proj"), lora)?,
            up_proj: linear(vb, cfg, layer, &format!("{prefix}.up_proj"), lora)?,
            down_proj: linear(vb, cfg, layer, &format!("{prefix}.down_proj"), lora)?,
        })
    }

    /// x + mlp(rms_norm(x, norm)) as one op (`ops::frozen_mlp_residual`) when no projection
    /// here is adapted or biased; `None` when the separate ops must run (adapters, or the
    /// portable path).
    /// `keep`: activation checkpointing's (`ops::checkpoint`).
    pub fn frozen_residual(&self, kern: Kernels, x: &Tensor, norm: &Tensor, eps: f64, keep: Keep) -> Result<Option<Tensor>> {
        let Some([gate, up, down]) = self.frozen_weights() else {
            return Ok(None);
        };
        Ok(ops::frozen_mlp_residual(kern, x, norm, eps, (gate, up, down), keep)?)
    }

    /// gate, up, down weights when no projection here is adapted or biased (the MLP is then
    /// a frozen function the fused ops may run whole).
    pub fn frozen_weights(&self) -> Option<ops::experts::ExpertWeights<'_>> {
        let plain = [&self.gate_proj, &self.up_proj, &self.down_proj].iter().all(|p| p.lora.is_none() && p.bias.is_none());
        plain.then_some([&self.gate_proj.weight, &self.up_proj.weight, &self.down_proj.weight])
    }

    /// x [N, H] -> [N, H]
    pub fn forward(&self, kern: Kernels, x: &Tensor, drop: Option<DropoutCtx>) -> Result<Tensor> {
        let g = self.gate_proj.forward(kern, x, drop)?; // [N, I]
        let u = self.up_proj.forward(kern, x, drop)?; // [N, I]
        self.down_proj.forward(kern, &ops::swiglu(kern, &g, &u)?, drop)
    }
}
