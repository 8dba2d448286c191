//! Model families. One file per family's blocks (attention, MLP); this file holds what every
//! family shares: [`Model`] (embedding, layers built one at a time from a [`WeightSource`],
//! final norm, head, generation steps), the [`DecoderLayer`] both families' blocks sit in,
//! [`ForwardCtx`] and the frozen-linear builder.
//! Qwen2 is the Llama block plus q/k/v bias (and optionally tied embeddings), both expressed
//! by [`ModelConfig`], so it shares `llama.rs` rather than duplicating it (candle-transformers
//! keeps a separate qwen2.rs; the difference is three bias adds). DeepSeek-V2/V3 (MLA + MoE)
//! are `deepseek.rs`.
//!
//! The model holds no frozen tensors of its own: each block is built by `load(vb, cfg, ..)`
//! from a [`Frozen`] view just before it runs, so a sharded weight source can gather one
//! layer at a time.
//!
//! Dimension legend (as in `llama.rs`):
//!   B  micro-batch rows     S  sequence length     N = B * S (flattened tokens)
//!   H  hidden_size          V  vocab_size          T  positions cached so far plus S (generation)

pub mod deepseek;
pub mod llama;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::lora::{Adapters, DropoutCtx, LoraLinear};
use crate::ops::loss::HeadRows;
use crate::ops::checkpoint::{Keep, Kept, Pass};
use crate::ops::{self, KeyStarts, Kernels};
use crate::weights::{Frozen, WeightSource};
use candle_core::{DType, Device, Tensor, D};
use std::sync::Arc;

/// Keys and values of the positions seen so far, per layer: ([B, KV, T, D], [B, KV, T, D]).
pub type KvCache = Option<(Tensor, Tensor)>;

/// Per-forward inputs shared by all layers.
pub struct ForwardCtx {
    /// [B, 1, S, D] (D: the rotary dim), in the compute dtype (transformers' `cos.to(x.dtype)`)
    pub cos: Tensor,
    /// [B, 1, S, D], in the compute dtype
    pub sin: Tensor,
    /// Query i of row b attends to keys `key_start.host[b * S + i]..=i` (0 without packing;
    /// the first position of its record with packing).
    pub key_start: KeyStarts,
    /// Generation only: an additive mask [1, 1, S, T] (0 or -inf) over cached + new keys.
    pub cache_mask: Option<Tensor>,
    /// Dropout masks are drawn only when training.
    pub dropout: Option<DropoutCtx>,
    /// Which op versions run (`ops::dispatch`).
    pub kernels: Kernels,
    /// Activation checkpointing's pass (`ops::checkpoint`): in [`Pass::Recompute`] a layer's
    /// output value is a placeholder (only its backward is used).
    pub pass: Pass,
    /// What a checkpointed forward keeps for the recomputation, per layer.
    pub kept: Option<Arc<Kept>>,
    /// The dtype the run's matmuls take their operands in (the source's matmul dtype): bf16
    /// where the frozen projections run on a bf16 unit, and the fused attention's strip
    /// GEMMs then do too where they can (`ops::causal_attention`).
    pub matmul: DType,
}

impl ForwardCtx {
    /// What layer `layer`'s ops are told about checkpointing.
    pub fn keep(&self, layer: usize) -> Keep {
        Keep { pass: self.pass, slot: self.kept.as_ref().and_then(|k| k.slot(layer)) }
    }

    /// positions [B][S]; with `segments` [B][S] (packed rows: contiguous runs of one id per
    /// record, as `MicroBatch::collate` makes them), a token attends only to earlier tokens of
    /// its own record; without, to all earlier tokens. RoPE tables in `dtype`, on `device`;
    /// matmul operands in `matmul`.
    pub fn new(
        positions: &[Vec<u32>],
        segments: Option<&[Vec<u32>]>,
        (inv_freq, rope_factor): (&[f64], f64),
        dropout: Option<DropoutCtx>,
        kernels: Kernels,
        (dtype, matmul, device): (DType, DType, &Device),
    ) -> Result<Self> {
        let b = positions.len();
        let s = positions.first().map_or(0, |p| p.len());
        let (mut cos, mut sin) = ops::rope_tables(positions, inv_freq, device, dtype)?;
        // YaRN's attention factor scales the tables (transformers' `attention_scaling`).
        if rope_factor != 1.0 {
            (cos, sin) = ((cos * rope_factor)?, (sin * rope_factor)?);
        }
        let mut key_start = vec![0u32; b * s];
        if let Some(seg) = segments {
            for (row, ids) in seg.iter().enumerate() {
                let starts = &mut key_start[row * s..][..s];
                for i in 1..s.min(ids.len()) {
                    starts[i] = if ids[i] == ids[i - 1] { starts[i - 1] } else { i as u32 };
                    if ids[i] < ids[i - 1] {
                        return Err(crate::Error::Train(format!("packed row {row}: record ids are not contiguous runs at position {i}")));
                    }
                }
            }
        }
        let key_start = KeyStarts::new(key_start, b, s, device)?;
        Ok(ForwardCtx { cos, sin, key_start, cache_mask: None, dropout, kernels, pass: Pass::Plain, kept: None, matmul })
    }
}

/// The frozen linear at `path` (`self_attn.q_proj`, `mlp.experts.3.up_proj`) of the layer
/// `vb` views, with its adapter if it is targeted.
pub(crate) fn linear<'a>(vb: &Frozen, cfg: &ModelConfig, layer: usize, path: &str, lora: &'a Adapters) -> Result<LoraLinear<'a>> {
    let (i, o, has_bias) = cfg.linear_shape(path).ok_or_else(|| Error::model(path, format!("{} has no linear `{path}`", cfg.architecture_name)))?;
    let weight = vb.get_matmul(&[o, i], &format!("{path}.weight"))?;
    let bias = if has_bias { Some(vb.get(&[o], &format!("{path}.bias"))?) } else { None };
    let (site, adapter) = lora.site(layer, path);
    Ok(LoraLinear { weight, bias, lora: adapter, scale: lora.spec.scale(), dropout: lora.spec.dropout, site: (layer, site) })
}

/// A layer's attention half, by family.
enum SelfAttn<'a> {
    Llama(llama::Attention<'a>),
    Mla(deepseek::MlaAttention<'a>),
}

/// A layer's MLP half: a dense SwiGLU MLP (Llama, DeepSeek's first layers) or DeepSeekMoE.
enum Ffn<'a> {
    Dense(llama::Mlp<'a>),
    Moe(deepseek::Moe<'a>),
}

/// One decoder layer of any family: x + attn(norm(x)), then + mlp(norm(.)). The families
/// differ only in the two halves, chosen from the config.
pub struct DecoderLayer<'a> {
    layer: usize,
    self_attn: SelfAttn<'a>,
    mlp: Ffn<'a>,
    input_layernorm: Tensor,
    post_attention_layernorm: Tensor,
    eps: f64,
}

impl<'a> DecoderLayer<'a> {
    /// Build layer `layer` from `model.layers.{layer}.*` in `vb`.
    pub fn load(vb: &Frozen, cfg: &ModelConfig, layer: usize, lora: &'a Adapters) -> Result<Self> {
        let h = cfg.hidden_size;
        let self_attn = match cfg.mla {
            None => SelfAttn::Llama(llama::Attention::load(vb, cfg, layer, lora)?),
            Some(_) => SelfAttn::Mla(deepseek::MlaAttention::load(vb, cfg, layer, lora)?),
        };
        let mlp = if cfg.is_moe_layer(layer) { Ffn::Moe(deepseek::Moe::load(vb, cfg, layer, lora)?) } else { Ffn::Dense(llama::Mlp::load(vb, cfg, layer, "mlp", lora)?) };
        Ok(DecoderLayer {
            layer,
            self_attn,
            mlp,
            input_layernorm: vb.get(&[h], "input_layernorm.weight")?,
            post_attention_layernorm: vb.get(&[h], "post_attention_layernorm.weight")?,
            eps: cfg.rms_norm_eps,
        })
    }

    /// x [N, H] or [B, S, H] -> the same shape (training passes [N, H]: no reshape nodes).
    /// With `cache` (generation), keys/values of earlier positions are used and extended.
    pub fn forward_cached(&self, x: &Tensor, ctx: &ForwardCtx, cache: Option<&mut KvCache>) -> Result<Tensor> {
        let shape = x.shape().clone();
        let h = x.dim(D::Minus1)?;
        let x = if x.rank() == 2 { x.clone() } else { x.reshape(((), h))? }; // [N, H]
        let kern = ctx.kernels;
        let n = ops::rms_norm(kern, &x, &self.input_layernorm, self.eps)?; // [N, H]
        let a = match &self.self_attn {
            SelfAttn::Llama(att) => att.forward_cached(&n, ctx, cache)?,
            SelfAttn::Mla(att) => att.forward_cached(&n, ctx, cache)?,
        }; // [N, H]
        let x = (x + a)?; // [N, H]
        let fused = match &self.mlp {
            Ffn::Dense(m) => m.frozen_residual(kern, &x, &self.post_attention_layernorm, self.eps, ctx.keep(self.layer))?,
            Ffn::Moe(_) => None,
        };
        let y = match fused {
            Some(y) => y, // [N, H]
            None => {
                let n = ops::rms_norm(kern, &x, &self.post_attention_layernorm, self.eps)?; // [N, H]
                let m = match &self.mlp {
                    Ffn::Dense(m) => m.forward(kern, &n, ctx.dropout)?,
                    Ffn::Moe(m) => m.forward(kern, &n, ctx.dropout, ctx.keep(self.layer))?,
                }; // [N, H]
                (x + m)?
            }
        };
        Ok(if y.shape() == &shape { y } else { y.reshape(shape)? }) // [N, H] -> the input's [B, S, H]
    }
}

/// The whole decoder, of any family: a weight source, the config, and nothing else frozen.
pub struct Model {
    pub cfg: ModelConfig,
    src: Arc<dyn WeightSource>,
    inv_freq: Vec<f64>,
    kernels: Kernels,
    /// Every tensor `load` asked the source for (see [`crate::weights::unread`]).
    asked: std::collections::BTreeSet<String>,
}

impl Model {
    /// Check every frozen tensor exists with the right shape (so a bad checkpoint fails
    /// before training starts, naming the tensor), and keep the source.
    pub fn load(src: Arc<dyn WeightSource>, cfg: ModelConfig, lora: &Adapters) -> Result<Self> {
        let mut m = Model { inv_freq: cfg.inv_freq(), cfg, src, kernels: Kernels::Auto, asked: Default::default() };
        let (v, h) = (m.cfg.vocab_size, m.cfg.hidden_size);
        let src = crate::weights::Asked::new(&*m.src);
        if m.cfg.tie_word_embeddings {
            src.check("model.embed_tokens.weight", &[v, h])?; // the head too: held whole
        } else {
            src.check_rows("model.embed_tokens.weight", &[v, h])?;
        }
        src.check("model.norm.weight", &[h])?;
        if m.cfg.tie_word_embeddings {
            src.check(m.lm_head_name(), &[v, h])?;
        } else {
            src.check_head(m.lm_head_name(), &[v, h])?; // read by the loss in chunks
        }
        let vb = Frozen::new(&src);
        for i in 0..m.cfg.num_hidden_layers {
            DecoderLayer::load(&vb.pp(format!("model.layers.{i}")), &m.cfg, i, lora)?;
        }
        // Weights for a layer past the config's last: training would run a truncated model
        // and look fine. Refuse rather than guess which of the two is wrong. (DeepSeek-V3's
        // multi-token-prediction layers sit past the last on purpose and are not read.)
        let n = m.cfg.num_hidden_layers + m.cfg.ignored_layers;
        let extra = format!("model.layers.{n}.input_layernorm.weight");
        if vb.contains(&extra) {
            return Err(Error::model(
                "config.json",
                format!("num_hidden_layers = {n}, but the weights hold more layers (e.g. `{extra}`); fix num_hidden_layers or the checkpoint"),
            ));
        }
        m.asked = src.into_names();
        Ok(m)
    }

    /// Every tensor `load` asked its source for (for [`crate::weights::note_unread`]).
    pub fn asked(&self) -> &std::collections::BTreeSet<String> {
        &self.asked
    }

    /// Run with `kernels` (the recipe's `model.kernels`).
    pub fn with_kernels(mut self, kernels: Kernels) -> Self {
        self.kernels = kernels;
        self
    }

    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// The per-forward context for rows at `positions` (packed when `segments` is given).
    pub fn forward_ctx(&self, positions: &[Vec<u32>], segments: Option<&[Vec<u32>]>, dropout: Option<DropoutCtx>) -> Result<ForwardCtx> {
        let longest = positions.iter().flatten().max().map_or(0, |&p| p as usize + 1);
        self.cfg.check_positions(longest).map_err(|msg| crate::error::Error::Model { what: "sequence length".into(), msg })?;
        let rope = (&self.inv_freq[..], self.cfg.rope_attention_factor());
        ForwardCtx::new(positions, segments, rope, dropout, self.kernels, (self.src.compute_dtype(), self.src.matmul_dtype(), self.src.device()))
    }

    pub fn source(&self) -> &dyn WeightSource {
        &*self.src
    }

    pub fn inv_freq(&self) -> &[f64] {
        &self.inv_freq
    }

    /// [H]
    pub fn norm_weight(&self) -> Result<Tensor> {
        Frozen::new(&*self.src).get(&[self.cfg.hidden_size], "model.norm.weight")
    }

    /// The output projection [V, H]: `lm_head.weight`, or the embedding when tied (some tied
    /// checkpoints still store lm_head.weight; a tied config always reads the embedding).
    /// A matmul operand only, so in the source's matmul dtype (bf16 on a bf16 unit, see
    /// `loss::Head`).
    pub fn lm_head(&self) -> Result<Tensor> {
        let c = &self.cfg;
        Frozen::new(&*self.src).get_matmul(&[c.vocab_size, c.hidden_size], self.lm_head_name())
    }

    /// The output projection as the loss reads it, in chunks of vocabulary rows
    /// (`ops::loss`): a quantized base dequantises, and a bf16 base computing in f32
    /// converts, one chunk at a time.
    pub fn lm_head_rows(&self) -> HeadRows<'_> {
        let c = &self.cfg;
        let shape = [c.vocab_size, c.hidden_size];
        let name = self.lm_head_name();
        let read = move |start, len| self.src.get_matmul_rows(name, &shape, start, len).map_err(candle_core::Error::wrap);
        HeadRows { vocab: c.vocab_size, hidden: c.hidden_size, dtype: self.src.matmul_dtype(), read: Box::new(read) }
    }

    fn lm_head_name(&self) -> &'static str {
        if self.cfg.tie_word_embeddings { "model.embed_tokens.weight" } else { "lm_head.weight" }
    }

    /// The device the weight source puts tensors on.
    pub fn device(&self) -> Device {
        self.src.device().clone()
    }

    /// ids [B, S] (u32) -> [B, S, H]
    ///
    /// Rows are picked from the stored table (`WeightSource::embedding`).
    pub fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, s) = ids.dims2()?;
        let c = &self.cfg;
        let e = self.src.embedding("model.embed_tokens.weight", &[c.vocab_size, c.hidden_size], &ids.flatten_all()?)?; // [N, H]
        Ok(e.reshape((b, s, c.hidden_size))?) // [B, S, H]
    }

    /// Run decoder layer `i` on x [N, H] or [B, S, H] (same shape out): its frozen weights
    /// are fetched now and dropped after.
    pub fn layer_forward(&self, i: usize, x: &Tensor, ctx: &ForwardCtx, lora: &Adapters) -> Result<Tensor> {
        let vb = Frozen::new(&*self.src).pp(format!("model.layers.{i}"));
        DecoderLayer::load(&vb, &self.cfg, i, lora)?.forward_cached(x, ctx, None)
    }

    /// Inference forward (no dropout): ids [B, S] -> logits [B, S, V] in f32.
    pub fn logits(&self, ids: &Tensor, lora: &Adapters) -> Result<Tensor> {
        let (b, s) = ids.dims2()?;
        let positions: Vec<Vec<u32>> = (0..b).map(|_| (0..s as u32).collect()).collect();
        let ctx = self.forward_ctx(&positions, None, None)?;
        let mut x = self.embed(ids)?;
        for i in 0..self.cfg.num_hidden_layers {
            x = self.layer_forward(i, &x, &ctx, lora)?;
        }
        let h = self.final_norm(&x)?.reshape((b * s, self.cfg.hidden_size))?; // [N, H]
        let logits = h.to_dtype(DType::F32)?.matmul(&self.lm_head()?.to_dtype(DType::F32)?.t()?)?; // [N, V]
        Ok(logits.reshape((b, s, self.cfg.vocab_size))?) // [B, S, V]
    }

    /// Generation step: ids [1, S] at positions offset..offset+S, with per-layer caches
    /// (filled as it goes) -> logits of the last position [V] in f32.
    pub fn step(&self, ids: &Tensor, offset: usize, caches: &mut [KvCache], lora: &Adapters) -> Result<Tensor> {
        let (b, s) = ids.dims2()?;
        let positions: Vec<Vec<u32>> = (0..b).map(|_| (offset as u32..(offset + s) as u32).collect()).collect();
        let t = offset + s;
        let mut ctx = self.forward_ctx(&positions, None, None)?;
        ctx.cache_mask = Some(ops::causal_mask(s, t, offset, ids.device())?.reshape((1, 1, s, t))?); // [1, 1, S, T]
        let mut x = self.embed(ids)?;
        for (i, cache) in caches.iter_mut().enumerate().take(self.cfg.num_hidden_layers) {
            let vb = Frozen::new(&*self.src).pp(format!("model.layers.{i}"));
            x = DecoderLayer::load(&vb, &self.cfg, i, lora)?.forward_cached(&x, &ctx, Some(cache))?;
        }
        let last = x.narrow(1, s - 1, 1)?.reshape((b, self.cfg.hidden_size))?; // [B, H]
        let h = self.final_norm(&last)?.to_dtype(DType::F32)?;
        let logits = h.matmul(&self.lm_head()?.to_dtype(DType::F32)?.t()?)?; // [B, V]
        Ok(logits.get(0)?) // [V]: B = 1
    }

    /// Final RMSNorm: [.., H] -> [.., H]
    pub fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        Ok(ops::rms_norm(self.kernels, x, &self.norm_weight()?, self.cfg.rms_norm_eps)?)
    }
}
