//! Llama / Qwen2 decoder for LoRA training (transformers' `modeling_llama.py`, eager attention).
//!
//! Dimension legend:
//!   B  micro-batch rows            S  sequence length (padded)
//!   H  hidden_size                 I  intermediate_size
//!   NH num_attention_heads         KV num_key_value_heads      R = NH / KV (query heads per kv head)
//!   D  head_dim                    V  vocab_size               N = B * S (flattened tokens)
//!
//! The model holds no frozen tensors of its own: each block is built by `load(vb, cfg, ..)`
//! from a [`Frozen`] view just before it runs, so a sharded weight source can gather one
//! layer at a time. Fields are named after the HF keys. Every op comes from `ops` and is
//! handed the run's [`Kernels`] (in [`ForwardCtx`]); which version runs on which device is
//! decided there, never here.

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::lora::{Adapters, DropoutCtx, LoraAdapter, LoraLinear, MODULES};
use crate::ops::{self, KeyStarts, Kernels};
use crate::weights::{Frozen, WeightSource};
use candle_core::{DType, Device, Tensor, D};
use std::sync::Arc;

/// Keys and values of the positions seen so far, per layer: ([B, KV, T, D], [B, KV, T, D]).
pub type KvCache = Option<(Tensor, Tensor)>;

/// Per-forward inputs shared by all layers.
pub struct ForwardCtx {
    /// [B, 1, S, D], in the compute dtype (transformers' `cos.to(x.dtype)`)
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
}

impl ForwardCtx {
    /// positions [B][S]; with `segments` [B][S] (packed rows: contiguous runs of one id per
    /// record, as `MicroBatch::collate` makes them), a token attends only to earlier tokens of
    /// its own record; without, to all earlier tokens. RoPE tables in `dtype`, on `device`.
    pub fn new(
        positions: &[Vec<u32>],
        segments: Option<&[Vec<u32>]>,
        inv_freq: &[f64],
        dropout: Option<DropoutCtx>,
        kernels: Kernels,
        (dtype, device): (DType, &Device),
    ) -> Result<Self> {
        let b = positions.len();
        let s = positions.first().map_or(0, |p| p.len());
        let (cos, sin) = ops::rope_tables(positions, inv_freq, device, dtype)?;
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
        Ok(ForwardCtx { cos, sin, key_start, cache_mask: None, dropout, kernels })
    }
}

fn linear<'a>(
    vb: &Frozen,
    cfg: &ModelConfig,
    layer: usize,
    module: &str,
    adapters: &'a [Option<LoraAdapter>; 7],
    lora: &Adapters,
) -> Result<LoraLinear<'a>> {
    let (i, o) = cfg.proj_shape(module);
    let weight = vb.get_matmul(&[o, i], &format!("{module}.weight"))?;
    let bias = if cfg.proj_has_bias(module) { Some(vb.get(&[o], &format!("{module}.bias"))?) } else { None };
    let mi = MODULES.iter().position(|m| *m == module).unwrap_or(0);
    Ok(LoraLinear {
        weight,
        bias,
        lora: adapters[mi].as_ref(),
        scale: lora.spec.scale(),
        dropout: lora.spec.dropout,
        site: (layer, mi),
    })
}

pub struct Attention<'a> {
    q_proj: LoraLinear<'a>,
    k_proj: LoraLinear<'a>,
    v_proj: LoraLinear<'a>,
    o_proj: LoraLinear<'a>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

impl<'a> Attention<'a> {
    pub fn load(vb: &Frozen, cfg: &ModelConfig, layer: usize, lora: &'a Adapters) -> Result<Self> {
        let ad = &lora.layers[layer];
        Ok(Attention {
            q_proj: linear(vb, cfg, layer, "q_proj", ad, lora)?,
            k_proj: linear(vb, cfg, layer, "k_proj", ad, lora)?,
            v_proj: linear(vb, cfg, layer, "v_proj", ad, lora)?,
            o_proj: linear(vb, cfg, layer, "o_proj", ad, lora)?,
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
        let q = self.q_proj.forward(kern, x, ctx.dropout)?; // [N, NH*D]
        let k = self.k_proj.forward(kern, x, ctx.dropout)?; // [N, KV*D]
        let v = self.v_proj.forward(kern, x, ctx.dropout)?; // [N, KV*D]
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
            None => ops::causal_attention(kern, &q, &k, &v, scale, &ctx.key_start)?, // [B, NH, S, D]
            // Generation over cached keys.
            Some(mask) => ops::attention::cached_attention(&q, &k, &v, scale, mask)?, // [B, NH, S, D]
        };
        let out = ops::merge_heads(kern, &out)?; // [N, NH*D]
        self.o_proj.forward(kern, &out, ctx.dropout) // [N, H]
    }
}

pub struct Mlp<'a> {
    gate_proj: LoraLinear<'a>,
    up_proj: LoraLinear<'a>,
    down_proj: LoraLinear<'a>,
}

impl<'a> Mlp<'a> {
    pub fn load(vb: &Frozen, cfg: &ModelConfig, layer: usize, lora: &'a Adapters) -> Result<Self> {
        let ad = &lora.layers[layer];
        Ok(Mlp {
            gate_proj: linear(vb, cfg, layer, "gate_proj", ad, lora)?,
            up_proj: linear(vb, cfg, layer, "up_proj", ad, lora)?,
            down_proj: linear(vb, cfg, layer, "down_proj", ad, lora)?,
        })
    }

    /// x + mlp(rms_norm(x, norm)) as one op (`ops::frozen_mlp_residual`) when no projection
    /// here is adapted or biased; `None` when the separate ops must run (adapters, or the
    /// portable path).
    pub fn frozen_residual(&self, kern: Kernels, x: &Tensor, norm: &Tensor, eps: f64) -> Result<Option<Tensor>> {
        let plain = [&self.gate_proj, &self.up_proj, &self.down_proj].iter().all(|p| p.lora.is_none() && p.bias.is_none());
        if !plain {
            return Ok(None);
        }
        Ok(ops::frozen_mlp_residual(kern, x, norm, eps, &self.gate_proj.weight, &self.up_proj.weight, &self.down_proj.weight)?)
    }

    /// x [N, H] -> [N, H]
    pub fn forward(&self, kern: Kernels, x: &Tensor, drop: Option<DropoutCtx>) -> Result<Tensor> {
        let g = self.gate_proj.forward(kern, x, drop)?; // [N, I]
        let u = self.up_proj.forward(kern, x, drop)?; // [N, I]
        self.down_proj.forward(kern, &ops::swiglu(kern, &g, &u)?, drop)
    }
}

pub struct DecoderLayer<'a> {
    self_attn: Attention<'a>,
    mlp: Mlp<'a>,
    input_layernorm: Tensor,
    post_attention_layernorm: Tensor,
    eps: f64,
}

impl<'a> DecoderLayer<'a> {
    /// Build layer `layer` from `model.layers.{layer}.*` in `vb`.
    pub fn load(vb: &Frozen, cfg: &ModelConfig, layer: usize, lora: &'a Adapters) -> Result<Self> {
        let h = cfg.hidden_size;
        Ok(DecoderLayer {
            self_attn: Attention::load(&vb.pp("self_attn"), cfg, layer, lora)?,
            mlp: Mlp::load(&vb.pp("mlp"), cfg, layer, lora)?,
            input_layernorm: vb.get(&[h], "input_layernorm.weight")?,
            post_attention_layernorm: vb.get(&[h], "post_attention_layernorm.weight")?,
            eps: cfg.rms_norm_eps,
        })
    }

    /// x [N, H] or [B, S, H] -> the same shape (training passes [N, H]: no reshape nodes).
    pub fn forward(&self, x: &Tensor, ctx: &ForwardCtx) -> Result<Tensor> {
        self.forward_cached(x, ctx, None)
    }

    pub fn forward_cached(&self, x: &Tensor, ctx: &ForwardCtx, cache: Option<&mut KvCache>) -> Result<Tensor> {
        let shape = x.shape().clone();
        let h = x.dim(D::Minus1)?;
        let x = if x.rank() == 2 { x.clone() } else { x.reshape(((), h))? }; // [N, H]
        let kern = ctx.kernels;
        let a = self.self_attn.forward_cached(&ops::rms_norm(kern, &x, &self.input_layernorm, self.eps)?, ctx, cache)?;
        let x = (x + a)?;
        let y = match self.mlp.frozen_residual(kern, &x, &self.post_attention_layernorm, self.eps)? {
            Some(y) => y, // [N, H]
            None => {
                let n = ops::rms_norm(kern, &x, &self.post_attention_layernorm, self.eps)?; // [N, H]
                let m = self.mlp.forward(kern, &n, ctx.dropout)?; // [N, H]
                (x + m)?
            }
        };
        Ok(if y.shape() == &shape { y } else { y.reshape(shape)? })
    }
}

/// The whole decoder: a weight source, the config, and nothing else frozen.
pub struct Llama {
    pub cfg: ModelConfig,
    src: Arc<dyn WeightSource>,
    inv_freq: Vec<f64>,
    kernels: Kernels,
}

impl Llama {
    /// Check every frozen tensor exists with the right shape (so a bad checkpoint fails
    /// before training starts, naming the tensor), and keep the source.
    pub fn load(src: Arc<dyn WeightSource>, cfg: ModelConfig, lora: &Adapters) -> Result<Self> {
        let m = Llama { inv_freq: cfg.inv_freq(), cfg, src, kernels: Kernels::Auto };
        m.embed_tokens()?;
        m.norm_weight()?;
        m.lm_head()?;
        let vb = Frozen::new(&*m.src);
        for i in 0..m.cfg.num_hidden_layers {
            DecoderLayer::load(&vb.pp(format!("model.layers.{i}")), &m.cfg, i, lora)?;
        }
        // Weights for a layer past the config's last: training would run a truncated model
        // and look fine. Refuse rather than guess which of the two is wrong.
        let n = m.cfg.num_hidden_layers;
        let extra = format!("model.layers.{n}.input_layernorm.weight");
        if vb.contains(&extra) {
            return Err(Error::model(
                "config.json",
                format!("num_hidden_layers = {n}, but the weights hold more layers (e.g. `{extra}`); fix num_hidden_layers or the checkpoint"),
            ));
        }
        Ok(m)
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
        ForwardCtx::new(positions, segments, &self.inv_freq, dropout, self.kernels, (self.src.compute_dtype(), self.src.device()))
    }

    pub fn source(&self) -> &dyn WeightSource {
        &*self.src
    }

    pub fn inv_freq(&self) -> &[f64] {
        &self.inv_freq
    }

    /// [V, H]
    pub fn embed_tokens(&self) -> Result<Tensor> {
        let c = &self.cfg;
        Frozen::new(&*self.src).get(&[c.vocab_size, c.hidden_size], "model.embed_tokens.weight")
    }

    /// [H]
    pub fn norm_weight(&self) -> Result<Tensor> {
        Frozen::new(&*self.src).get(&[self.cfg.hidden_size], "model.norm.weight")
    }

    /// The output projection [V, H]: `lm_head.weight`, or the embedding when tied (some tied
    /// checkpoints still store lm_head.weight; a tied config always reads the embedding).
    /// A matmul operand only, so in the source's matmul dtype (bf16 on AMX, see `loss::Head`).
    pub fn lm_head(&self) -> Result<Tensor> {
        let c = &self.cfg;
        let name = if c.tie_word_embeddings { "model.embed_tokens.weight" } else { "lm_head.weight" };
        Frozen::new(&*self.src).get_matmul(&[c.vocab_size, c.hidden_size], name)
    }

    /// The device the weight source puts tensors on.
    pub fn device(&self) -> Device {
        self.src.device().clone()
    }

    /// ids [B, S] (u32) -> [B, S, H]
    ///
    /// Rows are picked from the stored table and only they are converted to the compute
    /// dtype: converting the whole [V, H] table first cost a 113 MB copy per step (135M model).
    pub fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, s) = ids.dims2()?;
        let c = &self.cfg;
        let table = self.src.get_stored("model.embed_tokens.weight", &[c.vocab_size, c.hidden_size])?; // [V, H]
        let e = table.index_select(&ids.flatten_all()?, 0)?.to_dtype(self.src.compute_dtype())?; // [N, H]
        Ok(e.reshape((b, s, c.hidden_size))?)
    }

    /// Run decoder layer `i` on x [N, H] or [B, S, H] (same shape out): its frozen weights
    /// are fetched now and dropped after.
    pub fn layer_forward(&self, i: usize, x: &Tensor, ctx: &ForwardCtx, lora: &Adapters) -> Result<Tensor> {
        let vb = Frozen::new(&*self.src).pp(format!("model.layers.{i}"));
        DecoderLayer::load(&vb, &self.cfg, i, lora)?.forward(x, ctx)
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
        Ok(logits.reshape((b, s, self.cfg.vocab_size))?)
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
        Ok(logits.get(0)?)
    }

    /// Final RMSNorm: [.., H] -> [.., H]
    pub fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        Ok(ops::rms_norm(self.kernels, x, &self.norm_weight()?, self.cfg.rms_norm_eps)?)
    }
}
