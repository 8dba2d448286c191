//! DeepSeek-V2 / V3 decoder for LoRA training: multi-head latent attention (MLA) and
//! DeepSeekMoE, as transformers' `modeling_deepseek_v2.py` / `modeling_deepseek_v3.py`
//! compute them (eager attention, eager experts). Moonlight is V3-shaped.
//!
//! Dimension legend:
//!   B  micro-batch rows        S  sequence length (padded)     N = B * S (flattened tokens)
//!   H  hidden_size             NH num_attention_heads          V  vocab_size
//!   Dn qk_nope_head_dim        Dr qk_rope_head_dim             Dk = Dn + Dr (q/k head dim)
//!   Dv v_head_dim              C  kv_lora_rank                 Q  q_lora_rank
//!   E  n_routed_experts        K  num_experts_per_tok          Ie moe_intermediate_size
//!   Ne tokens routed to expert e (0 ..= N)
//!
//! Blocks are built per layer from a [`Frozen`] view (see `super::Model`) and never know
//! where their tensors live. Where we differ from transformers:
//! - RoPE on interleaved pairs is computed as rotate-half on the de-interleaved rope dims
//!   (evens, then odds) of q and k alike. Scores are dot products, so the permutation, applied
//!   to both, changes nothing (transformers' deepseek_v3 does the same; deepseek_v2's complex
//!   product is the same rotation).
//! - Attention takes one head dim for q, k and v, so the shorter of Dk and Dv (v, in every
//!   released config) is padded with zeros (`ops::mla`; the padding's output columns are
//!   dropped; they get no gradient).
//! - Experts run sparsely: tokens are grouped by expert and each expert with tokens runs its
//!   three GEMMs once over them; the weighted outputs return to token order by one gather.
//!   transformers' eager path loops the same way and sums in another order (f32 noise).

use super::llama::Mlp;
use super::{linear, ForwardCtx, KvCache};
use crate::config::{Mla, ModelConfig, Moe as MoeConfig, Routing};
use crate::error::{Error, Result};
use crate::lora::{Adapters, DropoutCtx, LoraLinear};
use crate::ops::checkpoint::Keep;
use crate::ops::{self, Kernels};
use crate::weights::Frozen;
use candle_core::{DType, Tensor, D};

/// The small RMSNorms inside MLA (`q_a_layernorm`, `kv_a_layernorm`) use transformers'
/// default eps whatever `rms_norm_eps` says.
const MLA_NORM_EPS: f64 = 1e-6;

/// Query path: one projection, or the low-rank pair with a norm between.
enum QPath<'a> {
    Plain(LoraLinear<'a>),
    LowRank { q_a_proj: LoraLinear<'a>, q_a_layernorm: Tensor, q_b_proj: LoraLinear<'a> },
}

pub struct MlaAttention<'a> {
    q: QPath<'a>,
    kv_a_proj_with_mqa: LoraLinear<'a>,
    kv_a_layernorm: Tensor,
    kv_b_proj: LoraLinear<'a>,
    o_proj: LoraLinear<'a>,
    mla: Mla,
    num_heads: usize,
    scale: f64,
    layer: usize,
}

impl<'a> MlaAttention<'a> {
    /// `vb` is the layer's view (`model.layers.{layer}`).
    pub fn load(vb: &Frozen, cfg: &ModelConfig, layer: usize, lora: &'a Adapters) -> Result<Self> {
        let mla = cfg.mla.clone().ok_or_else(|| Error::model(&cfg.architecture_name, "MLA attention without an MLA config"))?;
        let q = match mla.q_lora_rank {
            None => QPath::Plain(linear(vb, cfg, layer, "self_attn.q_proj", lora)?),
            Some(r) => QPath::LowRank {
                q_a_proj: linear(vb, cfg, layer, "self_attn.q_a_proj", lora)?,
                q_a_layernorm: vb.get(&[r], "self_attn.q_a_layernorm.weight")?,
                q_b_proj: linear(vb, cfg, layer, "self_attn.q_b_proj", lora)?,
            },
        };
        Ok(MlaAttention {
            q,
            kv_a_proj_with_mqa: linear(vb, cfg, layer, "self_attn.kv_a_proj_with_mqa", lora)?,
            kv_a_layernorm: vb.get(&[mla.kv_lora_rank], "self_attn.kv_a_layernorm.weight")?,
            kv_b_proj: linear(vb, cfg, layer, "self_attn.kv_b_proj", lora)?,
            o_proj: linear(vb, cfg, layer, "self_attn.o_proj", lora)?,
            num_heads: cfg.num_attention_heads,
            scale: cfg.attention_scale(),
            layer,
            mla,
        })
    }

    /// x [N, H] -> [N, H]; with `cache` (generation) keys/values of earlier positions are
    /// prepended and kept, as [B, NH, T, W] each (W = max(Dk, Dv), the shorter padded).
    pub fn forward_cached(&self, x: &Tensor, ctx: &ForwardCtx, cache: Option<&mut KvCache>) -> Result<Tensor> {
        let (nh, kern, drop) = (self.num_heads, ctx.kernels, ctx.dropout);
        let Mla { kv_lora_rank: c, qk_nope_head_dim: dn, qk_rope_head_dim: dr, v_head_dim: dv, .. } = self.mla;
        let keep = ctx.keep(self.layer);
        let q = match &self.q {
            QPath::Plain(p) => p.forward_kept(kern, x, drop, &keep)?, // [N, NH*Dk]
            QPath::LowRank { q_a_proj, q_a_layernorm, q_b_proj } => {
                let qa = q_a_proj.forward_kept(kern, x, drop, &keep)?; // [N, Q]
                q_b_proj.forward_kept(kern, &ops::rms_norm(kern, &qa, q_a_layernorm, MLA_NORM_EPS)?, drop, &keep)? // [N, NH*Dk]
            }
        };
        let ckv = self.kv_a_proj_with_mqa.forward_kept(kern, x, drop, &keep)?; // [N, C + Dr]
        let latent = ckv.narrow(1, 0, c)?.contiguous()?; // [N, C]
        let kv = self.kv_b_proj.forward_kept(kern, &ops::rms_norm(kern, &latent, &self.kv_a_layernorm, MLA_NORM_EPS)?, drop, &keep)?; // [N, NH*(Dn+Dv)]
        // q, k, v [B, NH, S, W]: RoPE on the rope parts (k's one rope key broadcast to every
        // head), v padded to W = max(Dk, Dv) (the attention op takes one head dim; the
        // padding's output columns are dropped below).
        let heads = ops::mla::MlaHeads { heads: nh, nope: dn, rope: dr, v: dv, latent: c, interleaved: self.mla.rope_interleave };
        let q = ops::mla::q_heads(kern, &q, &heads, &ctx.cos, &ctx.sin)?; // [B, NH, S, W]
        let (mut k, mut v) = ops::mla::kv_heads(kern, &kv, &ckv, &heads, &ctx.cos, &ctx.sin)?; // [B, NH, S, W] each
        if let Some(cache) = cache {
            if let Some((pk, pv)) = cache.take() {
                k = Tensor::cat(&[&pk, &k], 2)?; // [B, NH, T, W]
                v = Tensor::cat(&[&pv, &v], 2)?; // [B, NH, T, W]
            }
            *cache = Some((k.clone(), v.clone()));
        }
        let out = match &ctx.cache_mask {
            None => ops::causal_attention(kern, &q, &k, &v, self.scale, &ctx.key_start, keep.clone(), ctx.matmul)?, // [B, NH, S, W]
            Some(mask) => ops::attention::cached_attention(&q, &k, &v, self.scale, mask)?, // [B, NH, S, W]
        };
        let out = ops::merge_head_cols(kern, &out, dv)?; // [N, NH*Dv]: each head's first Dv columns
        self.o_proj.forward_kept(kern, &out, drop, &keep) // [N, H]
    }
}

/// DeepSeekMoE: a router over E experts, the top K of them per token, plus shared experts.
pub struct Moe<'a> {
    /// Router [E, H] in f32 (the router runs in f32 whatever the base dtype, as transformers).
    gate: Tensor,
    /// V3: added to the scores for the choice only, [E] f32.
    e_score_correction_bias: Option<Vec<f32>>,
    experts: Vec<Mlp<'a>>,
    shared_experts: Option<Mlp<'a>>,
    cfg: MoeConfig,
}

impl<'a> Moe<'a> {
    pub fn load(vb: &Frozen, cfg: &ModelConfig, layer: usize, lora: &'a Adapters) -> Result<Self> {
        let m = cfg.moe.clone().ok_or_else(|| Error::model(&cfg.architecture_name, "MoE layer without an MoE config"))?;
        let e = m.n_routed_experts;
        let gate = vb.get_f32(&[e, cfg.hidden_size], "mlp.gate.weight")?;
        let e_score_correction_bias = match m.routing {
            Routing::SigmoidNoauxTc => {
                let bias = vb.get_f32(&[e], "mlp.gate.e_score_correction_bias")?.to_vec1::<f32>()?;
                Some(bias)
            }
            _ => None,
        };
        if !vb.contains("mlp.experts.0.gate_proj.weight") && vb.contains("mlp.experts.gate_up_proj") {
            let msg = "holds the routed experts stacked (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`: transformers 5's own layout, from save_pretrained(save_original_format=False)); \
                       this tool reads the per-expert tensors the hub's checkpoints hold (`mlp.experts.{j}.gate_proj.weight`): save the model again with transformers' default save_original_format=True";
            return Err(Error::model(format!("model.layers.{layer}"), msg));
        }
        let experts = (0..e).map(|j| Mlp::load(vb, cfg, layer, &format!("mlp.experts.{j}"), lora)).collect::<Result<Vec<_>>>()?;
        let shared_experts = if m.n_shared_experts > 0 { Some(Mlp::load(vb, cfg, layer, "mlp.shared_experts", lora)?) } else { None };
        Ok(Moe { gate, e_score_correction_bias, experts, shared_experts, cfg: m })
    }

    /// x [N, H] -> [N, H]: Σ_k weight_k · expert_k(x) + shared_experts(x). `keep`:
    /// activation checkpointing's (`ops::checkpoint`).
    pub fn forward(&self, kern: Kernels, x: &Tensor, drop: Option<DropoutCtx>, keep: Keep) -> Result<Tensor> {
        let n = x.dim(0)?;
        let (e, k) = (self.cfg.n_routed_experts, self.cfg.num_experts_per_tok);
        // Router in f32; gradients reach x through the routing weights (the router is frozen).
        let logits = ops::frozen_linear(kern, &x.to_dtype(DType::F32)?, &self.gate)?; // [N, E]
        let scores = match self.cfg.routing {
            Routing::SigmoidNoauxTc => sigmoid(&logits)?,
            _ => softmax_rows(&logits)?,
        }; // [N, E] f32
        let host = scores.detach().flatten_all()?.to_vec1::<f32>()?; // [N * E], row-major
        let chosen = choose_experts(&host, e, &self.cfg, self.e_score_correction_bias.as_deref())?; // N*K expert ids
        let idx = Tensor::from_vec(chosen.clone(), (n, k), x.device())?; // [N, K]
        let mut w = scores.gather(&idx, 1)?; // [N, K]
        if self.cfg.norm_topk_prob {
            w = w.broadcast_div(&(w.sum_keepdim(1)? + 1e-20)?)?; // [N, K]
        }
        let w = (w * self.cfg.routed_scaling_factor)?; // [N, K] f32
        // One op for all routed experts where the fused kernels run and none is adapted; the
        // shared experts join it when they are not adapted either.
        let frozen: Option<Vec<_>> = self.experts.iter().map(|m| m.frozen_weights()).collect();
        let shared_frozen = self.shared_experts.as_ref().and_then(|m| m.frozen_weights());
        let fused = match &frozen {
            Some(experts) => ops::routed_experts(kern, x, &w, &chosen, experts, shared_frozen, keep)?,
            None => None,
        };
        let (routed, shared) = match fused {
            Some(y) if shared_frozen.is_some() => return Ok(y), // [N, H], the shared experts' included
            Some(routed) => (routed, self.shared_experts.as_ref()), // [N, H]
            None => (self.routed_by_ops(kern, x, &w, &chosen, drop)?, self.shared_experts.as_ref()),
        };
        Ok(match shared {
            Some(sh) => (routed + sh.forward(kern, x, drop)?)?,
            None => routed,
        })
    }

    /// The routed experts from separate ops (the portable path, and adapted experts): x [N,
    /// H], weights w [N, K] f32, `chosen` the N·K expert ids -> [N, H].
    fn routed_by_ops(&self, kern: Kernels, x: &Tensor, w: &Tensor, chosen: &[u32], drop: Option<DropoutCtx>) -> Result<Tensor> {
        let (n, h) = x.dims2()?;
        let k = self.cfg.num_experts_per_tok;
        // The (token, slot) pairs by expert; `row_of[t*K + s]` is the pair's row in the
        // expert-ordered outputs.
        let by_expert = ops::experts::pairs_by_expert(chosen, self.cfg.n_routed_experts)?;
        let mut row_of = vec![0u32; n * k];
        let mut outs = Vec::new();
        let mut row = 0u32;
        for (ex, pairs) in by_expert.iter().enumerate() {
            if pairs.is_empty() {
                continue; // an expert without tokens costs nothing
            }
            let tokens: Vec<u32> = pairs.iter().map(|&p| p / k as u32).collect();
            let xe = x.index_select(&Tensor::from_vec(tokens, pairs.len(), x.device())?, 0)?; // [Ne, H]
            outs.push(self.experts[ex].forward(kern, &xe, drop)?); // [Ne, H]
            for &p in pairs {
                row_of[p as usize] = row;
                row += 1;
            }
        }
        let sorted = Tensor::cat(&outs, 0)?; // [N*K, H] by expert
        let y = sorted.index_select(&Tensor::from_vec(row_of, n * k, x.device())?, 0)?.reshape((n, k, h))?; // [N, K, H]
        // Weighted in f32 (transformers multiplies the expert outputs by f32 weights), then
        // back to the activations' dtype.
        let w = w.unsqueeze(2)?; // [N, K, 1]
        Ok(y.to_dtype(DType::F32)?.broadcast_mul(&w)?.sum(1)?.to_dtype(x.dtype())?) // [N, K, H] -> [N, H]
    }
}

/// Row softmax from differentiable ops (candle's `softmax_last_dim` has no backward).
fn softmax_rows(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach(); // shift-invariant: no gradient needed
    let e = x.broadcast_sub(&max)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?)
}

/// 1 / (1 + exp(-x)) from differentiable ops.
fn sigmoid(x: &Tensor) -> Result<Tensor> {
    Ok((x.neg()?.exp()? + 1.0)?.recip()?)
}

/// The K experts of each of the N tokens (scores [N, E] row-major, host f32), as
/// transformers' routers choose them. `bias` (V3) shifts the scores for the choice only.
pub fn choose_experts(scores: &[f32], e: usize, m: &MoeConfig, bias: Option<&[f32]>) -> Result<Vec<u32>> {
    let k = m.num_experts_per_tok;
    if scores.iter().any(|s| !s.is_finite()) {
        return Err(Error::Train("router scores hold NaN or inf (the hidden states diverged)".into()));
    }
    let per_group = e / m.n_group;
    let mut out = Vec::with_capacity(scores.len() / e * k);
    let mut choice = vec![0f32; e];
    for row in scores.chunks(e) {
        for (j, c) in choice.iter_mut().enumerate() {
            *c = row[j] + bias.map_or(0.0, |b| b[j]);
        }
        let grouped = match m.routing {
            Routing::SoftmaxGreedy => false,
            Routing::SoftmaxGroupLimited | Routing::SigmoidNoauxTc => m.topk_group < m.n_group,
        };
        if grouped {
            // Group score: the best expert (V2) or the sum of the best two (V3).
            let group_score: Vec<f32> = choice
                .chunks(per_group)
                .map(|g| match m.routing {
                    Routing::SigmoidNoauxTc => top_k(g, 2).iter().map(|&i| g[i]).sum(),
                    _ => g.iter().cloned().fold(f32::NEG_INFINITY, f32::max),
                })
                .collect();
            let keep = top_k(&group_score, m.topk_group);
            for (gi, g) in choice.chunks_mut(per_group).enumerate() {
                if !keep.contains(&gi) {
                    // V2 sets other groups' scores to 0 (softmax scores are positive); V3 to
                    // -inf (biased scores can be negative).
                    let fill = if m.routing == Routing::SigmoidNoauxTc { f32::NEG_INFINITY } else { 0.0 };
                    g.fill(fill);
                }
            }
        }
        out.extend(top_k(&choice, k).into_iter().map(|i| i as u32));
    }
    Ok(out)
}

/// Indices of the `k` largest values, largest first (ties: lower index first).
fn top_k(x: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moe(routing: Routing, n_group: usize, topk_group: usize, k: usize) -> MoeConfig {
        MoeConfig {
            n_routed_experts: 8,
            num_experts_per_tok: k,
            n_shared_experts: 0,
            moe_intermediate_size: 4,
            first_k_dense_replace: 0,
            routing,
            n_group,
            topk_group,
            routed_scaling_factor: 1.0,
            norm_topk_prob: false,
        }
    }

    #[test]
    fn greedy_takes_the_top_k_scores() {
        let s = [0.1, 0.3, 0.05, 0.2, 0.15, 0.1, 0.05, 0.05];
        assert_eq!(choose_experts(&s, 8, &moe(Routing::SoftmaxGreedy, 1, 1, 2), None).unwrap(), [1, 3]);
    }

    #[test]
    fn v2_group_limited_greedy_ranks_groups_by_their_best_score() {
        // Groups {0,1} {2,3} {4,5} {6,7}; best per group 0.30, 0.20, 0.16, 0.10. Keeping 2
        // groups leaves experts 0-3: the top 3 there are 1, 3, 0 although 4 and 5 (0.15,
        // 0.16) beat expert 0 (0.05) overall.
        let s = [0.05, 0.30, 0.01, 0.20, 0.15, 0.16, 0.03, 0.10];
        let got = choose_experts(&s, 8, &moe(Routing::SoftmaxGroupLimited, 4, 2, 3), None).unwrap();
        assert_eq!(got, [1, 3, 0]);
    }

    #[test]
    fn v3_groups_rank_by_the_sum_of_their_top_two_and_the_bias_only_chooses() {
        // Group sums of the top 2: {0,1} 0.9+0.0=0.9, {2,3} 0.5+0.5=1.0, {4,5} 0.2+0.1, {6,7} 0.
        // One group kept: {2,3}, although expert 0 alone scores best.
        let s = [0.9, 0.0, 0.5, 0.5, 0.2, 0.1, 0.0, 0.0];
        let m = moe(Routing::SigmoidNoauxTc, 4, 1, 2);
        assert_eq!(choose_experts(&s, 8, &m, None).unwrap(), [2, 3]);
        // A bias moves the choice (group {0,1} now sums to 1.1) but not the weights, which
        // `Moe::forward` gathers from the unbiased scores.
        let bias = [0.0, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        assert_eq!(choose_experts(&s, 8, &m, Some(&bias)).unwrap(), [0, 1]);
    }

    #[test]
    fn non_finite_router_scores_are_an_error() {
        let s = [f32::NAN, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1];
        assert!(choose_experts(&s, 8, &moe(Routing::SoftmaxGreedy, 1, 1, 2), None).is_err());
    }
}
