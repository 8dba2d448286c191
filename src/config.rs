//! Model configuration in two stages, as candle-transformers does it: [`HfConfig`] mirrors
//! `config.json` (every field optional where HF allows it), and [`ModelConfig`] is the resolved
//! form with no `Option`s that model code reads.
//!
//! Supported: `LlamaForCausalLM` (DeepSeek LLM, DeepSeek-Coder, DeepSeek-R1-Distill-Llama with
//! llama3 rope scaling), `Qwen2ForCausalLM` (DeepSeek-R1-Distill-Qwen: q/k/v bias, tied
//! embeddings on the small ones), and `DeepseekV2ForCausalLM` / `DeepseekV3ForCausalLM`
//! (MLA attention + DeepSeekMoE: [`Mla`], [`Moe`]; V3 also covers Moonlight). A DeepSeek field
//! whose value changes the math in a way the code does not implement is an error naming it.

use crate::error::{Error, Result};
use serde::Deserialize;
use std::path::Path;

#[derive(Clone, Debug, Deserialize)]
pub struct HfConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    #[serde(default)]
    pub model_type: Option<String>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    #[serde(default)]
    pub rms_norm_eps: Option<f64>,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_scaling: Option<RopeScalingHf>,
    /// transformers 5 moves rope_theta / scaling here.
    #[serde(default)]
    pub rope_parameters: Option<RopeScalingHf>,
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default)]
    pub attention_bias: Option<bool>,
    #[serde(default)]
    pub mlp_bias: Option<bool>,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
    /// Outside rope_scaling (Phi-3 style): transformers 5 takes it over the one inside for
    /// llama3 and yarn scaling.
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
    /// Qwen2's attention window (null: none) and the layers below which it does not apply.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default)]
    pub max_window_layers: Option<usize>,
    /// transformers 5: each layer's attention ("full_attention" / "sliding_attention").
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub bos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub torch_dtype: Option<String>,
    // DeepSeek-V2 / V3 (MLA + MoE). `q_lora_rank: null` means a plain q_proj; an absent key
    // means transformers' default (1536): `None` = absent, `Some(None)` = null.
    #[serde(default, deserialize_with = "present_or_null")]
    pub q_lora_rank: Option<Option<usize>>,
    #[serde(default)]
    pub kv_lora_rank: Option<usize>,
    #[serde(default)]
    pub qk_nope_head_dim: Option<usize>,
    #[serde(default)]
    pub qk_rope_head_dim: Option<usize>,
    #[serde(default)]
    pub v_head_dim: Option<usize>,
    #[serde(default, deserialize_with = "present_or_null")]
    pub n_routed_experts: Option<Option<usize>>,
    #[serde(default)]
    pub num_experts_per_tok: Option<usize>,
    #[serde(default)]
    pub n_shared_experts: Option<usize>,
    #[serde(default)]
    pub moe_intermediate_size: Option<usize>,
    #[serde(default)]
    pub first_k_dense_replace: Option<usize>,
    #[serde(default)]
    pub moe_layer_freq: Option<usize>,
    #[serde(default)]
    pub topk_method: Option<String>,
    #[serde(default)]
    pub n_group: Option<usize>,
    #[serde(default)]
    pub topk_group: Option<usize>,
    #[serde(default)]
    pub routed_scaling_factor: Option<f64>,
    #[serde(default)]
    pub norm_topk_prob: Option<bool>,
    #[serde(default)]
    pub scoring_func: Option<String>,
    #[serde(default)]
    pub rope_interleave: Option<bool>,
    /// DeepSeek's own configs: 1 (experts on one device) is the only value that describes
    /// the math rather than a deployment; any value is accepted (inference-time layout only).
    #[serde(default)]
    pub ep_size: Option<usize>,
    /// DeepSeek-V3's multi-token-prediction layers, stored after the last decoder layer.
    #[serde(default)]
    pub num_nextn_predict_layers: Option<usize>,
    /// FP8 checkpoints (DeepSeek-V3's own) say how their weights are stored here.
    #[serde(default)]
    pub quantization_config: Option<serde_json::Value>,
}

/// transformers' Auto classes build the model `model_type` names, not `architectures`: where
/// the two name different families of ours, the checkpoint describes two models. (Other
/// model types, and Kimi-K2's own for the DeepSeek-V3 network, are left alone.)
fn check_model_type(hf: &HfConfig, arch: Arch, name: &str) -> std::result::Result<(), String> {
    let typed = match hf.model_type.as_deref() {
        Some("llama") => Some(Arch::Llama),
        Some("qwen2") => Some(Arch::Qwen2),
        Some("deepseek_v2") => Some(Arch::DeepseekV2),
        Some("deepseek_v3" | "kimi_k2") => Some(Arch::DeepseekV3),
        _ => None,
    };
    match (typed, &hf.model_type) {
        (Some(t), Some(ty)) if t != arch => Err(format!(
            "`architectures` says {name} but `model_type` says `{ty}`, another model family (transformers builds the model `model_type` names): fix whichever is wrong"
        )),
        _ => Ok(()),
    }
}

/// A key that may be absent (`None`), null (`Some(None)`) or a value.
fn present_or_null<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Option<Option<usize>>, D::Error> {
    Option::<usize>::deserialize(d).map(Some)
}

#[derive(Clone, Debug, Deserialize)]
pub struct RopeScalingHf {
    /// transformers reads `rope_type`, else the older `type`; configs it saves may hold both
    /// (a `type` kept from the file it read), which is why they are two fields here.
    #[serde(default)]
    pub rope_type: Option<String>,
    #[serde(default, rename = "type")]
    pub legacy_type: Option<String>,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub factor: Option<f64>,
    #[serde(default)]
    pub low_freq_factor: Option<f64>,
    #[serde(default)]
    pub high_freq_factor: Option<f64>,
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
    // YaRN (DeepSeek-V2/V3)
    #[serde(default)]
    pub beta_fast: Option<f64>,
    #[serde(default)]
    pub beta_slow: Option<f64>,
    #[serde(default)]
    pub mscale: Option<f64>,
    #[serde(default)]
    pub mscale_all_dim: Option<f64>,
    #[serde(default)]
    pub attention_factor: Option<f64>,
    #[serde(default)]
    pub truncate: Option<bool>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arch {
    Llama,
    Qwen2,
    DeepseekV2,
    DeepseekV3,
}

#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (equivalently inv_freq / factor).
    Linear { factor: f64 },
    /// Llama 3.1 frequency-dependent scaling.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: usize },
    /// YaRN (DeepSeek-V2/V3): frequencies blended between interpolated and original along a
    /// linear ramp; `mscale` / `mscale_all_dim` set the cos/sin and softmax factors.
    Yarn { factor: f64, original_max_position_embeddings: usize, beta_fast: f64, beta_slow: f64, mscale: f64, mscale_all_dim: f64, attention_factor: Option<f64>, truncate: bool },
}

/// Multi-head latent attention (DeepSeek-V2/V3): q through `q_proj`, or the low-rank
/// `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` when `q_lora_rank` is set; keys and values
/// from one latent of `kv_lora_rank` plus one shared rope key.
#[derive(Clone, Debug, PartialEq)]
pub struct Mla {
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// RoPE on interleaved pairs (2i, 2i+1) (DeepSeek's layout; transformers' deepseek_v3
    /// `rope_interleave`), else on halves (i, i + D/2).
    pub rope_interleave: bool,
}

impl Mla {
    /// Query/key head dim: nope + rope parts.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// The head width attention runs at: v is padded to the q/k width when narrower
    /// (`model::deepseek`), so its output is [B, NH, S, this].
    pub fn attention_width(&self) -> usize {
        self.qk_head_dim().max(self.v_head_dim)
    }
}

/// How a token chooses its experts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Routing {
    /// V2 `greedy`: softmax scores, top-k.
    SoftmaxGreedy,
    /// V2 `group_limited_greedy`: softmax; groups ranked by their best score, the best
    /// `topk_group` kept (others' scores set to 0), then top-k.
    SoftmaxGroupLimited,
    /// V3 `noaux_tc`: sigmoid scores; choice on score + `e_score_correction_bias`, groups
    /// ranked by the sum of their top 2; weights are the unbiased scores of the chosen.
    SigmoidNoauxTc,
}

/// DeepSeekMoE: routed experts (top-k of `n_routed_experts`) plus always-on shared experts.
#[derive(Clone, Debug, PartialEq)]
pub struct Moe {
    pub n_routed_experts: usize,
    pub num_experts_per_tok: usize,
    pub n_shared_experts: usize,
    pub moe_intermediate_size: usize,
    pub first_k_dense_replace: usize,
    pub routing: Routing,
    pub n_group: usize,
    pub topk_group: usize,
    pub routed_scaling_factor: f64,
    pub norm_topk_prob: bool,
}

/// Resolved configuration: what model code reads.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2, or Llama with attention_bias).
    pub qkv_bias: bool,
    /// o_proj carries a bias (Llama with attention_bias only).
    pub o_bias: bool,
    pub mlp_bias: bool,
    pub architecture_name: String,
    /// DeepSeek-V2/V3 attention; `None` for Llama / Qwen2.
    pub mla: Option<Mla>,
    /// DeepSeek-V2/V3 mixture of experts; `None` for dense models.
    pub moe: Option<Moe>,
    /// Layers stored after the last decoder layer that the model does not run (DeepSeek-V3's
    /// multi-token-prediction module): neither read nor counted as surplus.
    pub ignored_layers: usize,
    /// A sliding window some layer has, accepted because it covers `max_position_embeddings`:
    /// full attention equals it only while no position reaches it, so a longer sequence is
    /// refused (`check_positions`), not run past it.
    pub attention_window: Option<usize>,
}

pub const SUPPORTED: &[&str] = &["LlamaForCausalLM", "Qwen2ForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"];

impl ModelConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let hf: HfConfig = serde_json::from_str(&text)
            .map_err(|e| Error::Config { path: path.into(), msg: format!("not a valid HF config: {e}") })?;
        Self::resolve(&hf).map_err(|msg| Error::Config { path: path.into(), msg })
    }

    pub fn resolve(hf: &HfConfig) -> std::result::Result<Self, String> {
        let name = hf.architectures.first().cloned().unwrap_or_default();
        let arch = match name.as_str() {
            "LlamaForCausalLM" => Arch::Llama,
            "Qwen2ForCausalLM" => Arch::Qwen2,
            "DeepseekV2ForCausalLM" => Arch::DeepseekV2,
            "DeepseekV3ForCausalLM" => Arch::DeepseekV3,
            "" => return Err(format!("no `architectures` entry; supported: {}", SUPPORTED.join(", "))),
            other => {
                return Err(format!(
                    "architecture `{other}` is not supported; supported: {} (DeepSeek LLM/Coder and \
                     R1-Distill models use the first two, DeepSeek-V2/V3 and Moonlight the last two)",
                    SUPPORTED.join(", ")
                ))
            }
        };
        check_model_type(hf, arch, &name)?;
        if let Some(act) = &hf.hidden_act {
            if act != "silu" {
                return Err(format!("hidden_act `{act}` is not supported (expected silu)"));
            }
        }
        if let Some(q) = &hf.quantization_config {
            check_quantization(q)?;
        }
        let deepseek = matches!(arch, Arch::DeepseekV2 | Arch::DeepseekV3);
        let (mla, moe) = if deepseek { (Some(resolve_mla(hf, arch)?), resolve_moe(hf, arch)?) } else { (None, None) };
        let heads = hf.num_attention_heads;
        // MLA has no kv heads: every query head gets its own k/v from the latent.
        let kv = if deepseek { heads } else { hf.num_key_value_heads.unwrap_or(heads) };
        if heads == 0 || kv == 0 || !heads.is_multiple_of(kv) {
            return Err(format!("num_attention_heads ({heads}) must be a positive multiple of num_key_value_heads ({kv})"));
        }
        for (key, v, max) in [
            ("hidden_size", hf.hidden_size, 1 << 20),
            ("intermediate_size", hf.intermediate_size, MAX_INTERMEDIATE),
            ("num_hidden_layers", hf.num_hidden_layers, 1 << 12),
            ("vocab_size", hf.vocab_size, 1 << 24),
            ("num_attention_heads", heads, 1 << 12),
        ] {
            if v == 0 {
                return Err(format!("{key} must be positive, got 0"));
            }
            // Past these, sizes multiplied together would overflow (and no model is that big).
            if v > max {
                return Err(format!("{key} = {v} is more than this tool accepts ({max})"));
            }
        }
        let attention_window = check_sliding_window(hf)?;
        // DeepSeek: the rotary part of a head (transformers sets head_dim = qk_rope_head_dim).
        let head_dim = match &mla {
            Some(m) => m.qk_rope_head_dim,
            None => hf.head_dim.unwrap_or(hf.hidden_size / heads),
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(format!("head_dim {head_dim} must be even and positive"));
        }
        at_most(head_dim, "head_dim", MAX_HEAD_DIM)?;
        let params = hf.rope_parameters.as_ref();
        // transformers 5 keeps theta (and scaling) in rope_parameters; 4.x at the top level.
        let rope_theta = params
            .and_then(|p| p.rope_theta)
            .or(hf.rope_theta)
            .unwrap_or(10000.0);
        // Values that give NaN or meaningless rotations (a non-positive base or factor), and a
        // negative norm epsilon, are config errors, not a model trained on NaN logits.
        let positive = |key: &str, v: f64| if v.is_finite() && v > 0.0 { Ok(v) } else { Err(format!("{key} must be a positive number, got {v}")) };
        positive("rope_theta", rope_theta)?;
        if let Some(eps) = hf.rms_norm_eps {
            if !(eps.is_finite() && eps >= 0.0) {
                return Err(format!("rms_norm_eps must be a non-negative number, got {eps}"));
            }
        }
        let scaling = hf.rope_scaling.as_ref().or(params);
        let factor = |s: &RopeScalingHf, kind: &str| -> std::result::Result<f64, String> { positive("rope_scaling.factor", s.factor.ok_or(format!("rope_scaling {kind} needs `factor`"))?) };
        // The pretraining context of llama3 / yarn scaling, as transformers 5's
        // `standardize_rope_params` settles it: a top-level original_max_position_embeddings,
        // else rope_scaling's, else max_position_embeddings.
        let original = |s: &RopeScalingHf, kind: &str| -> std::result::Result<usize, String> {
            hf.original_max_position_embeddings.or(s.original_max_position_embeddings).or(hf.max_position_embeddings).filter(|&n| n > 0).ok_or(format!(
                "rope_scaling {kind} needs a positive `original_max_position_embeddings` (or max_position_embeddings)"
            ))
        };
        let rope_scaling = match scaling {
            None => RopeScaling::None,
            Some(s) => match s.rope_type.as_deref().or(s.legacy_type.as_deref()).unwrap_or("default") {
                "default" => RopeScaling::None,
                "linear" => RopeScaling::Linear { factor: factor(s, "linear")? },
                "llama3" => RopeScaling::Llama3 {
                    factor: factor(s, "llama3")?,
                    low_freq_factor: positive("rope_scaling.low_freq_factor", s.low_freq_factor.unwrap_or(1.0))?,
                    high_freq_factor: positive("rope_scaling.high_freq_factor", s.high_freq_factor.unwrap_or(4.0))?,
                    original_max_position_embeddings: original(s, "llama3")?,
                },
                "yarn" => {
                    let original = original(s, "yarn")?;
                    // Required: transformers refuses a yarn config without it when the config
                    // loads, and DeepSeek's own code reads it. A null, which transformers
                    // would replace by the ratio of the context lengths, is refused too: no
                    // released config has one, and DeepSeek's code would fail on it.
                    let factor = factor(s, "yarn")?;
                    RopeScaling::Yarn {
                        factor,
                        original_max_position_embeddings: original,
                        beta_fast: s.beta_fast.unwrap_or(32.0),
                        beta_slow: s.beta_slow.unwrap_or(1.0),
                        mscale: s.mscale.unwrap_or(0.0),
                        mscale_all_dim: s.mscale_all_dim.unwrap_or(0.0),
                        attention_factor: s.attention_factor,
                        truncate: s.truncate.unwrap_or(true),
                    }
                }
                other => return Err(format!("rope_scaling type `{other}` is not supported (default, linear, llama3, yarn)")),
            },
        };
        if matches!(rope_scaling, RopeScaling::Yarn { .. }) && !deepseek {
            return Err(format!("rope_scaling yarn is supported for DeepSeek-V2/V3 models only, not {name}"));
        }
        let attention_bias = hf.attention_bias.unwrap_or(false);
        if deepseek && (attention_bias || hf.mlp_bias == Some(true)) {
            return Err("attention_bias / mlp_bias = true is not supported for DeepSeek-V2/V3 (their checkpoints have no biases)".into());
        }
        Ok(ModelConfig {
            arch,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_hidden_layers: hf.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim,
            vocab_size: hf.vocab_size,
            rms_norm_eps: hf.rms_norm_eps.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(false),
            qkv_bias: arch == Arch::Qwen2 || (arch == Arch::Llama && attention_bias),
            o_bias: arch == Arch::Llama && attention_bias,
            mlp_bias: hf.mlp_bias.unwrap_or(false),
            architecture_name: name,
            mla,
            moe,
            ignored_layers: if arch == Arch::DeepseekV3 { hf.num_nextn_predict_layers.unwrap_or(0) } else { 0 },
            attention_window,
        })
    }

    /// Refuse position ids that reach the sliding window (`attention_window`): there the model
    /// attends to the last `window` positions only, where full attention sees them all.
    pub fn check_positions(&self, longest: usize) -> std::result::Result<(), String> {
        match self.attention_window {
            Some(w) if longest > w => Err(format!(
                "a sequence of {longest} tokens is longer than this model's sliding window (config.json sliding_window = {w}); \
                 sliding-window attention is not implemented, and full attention past the window gives other logits than the model"
            )),
            _ => Ok(()),
        }
    }

    /// (in_features, out_features) of a Llama / Qwen2 projection by its HF module name.
    pub fn proj_shape(&self, module: &str) -> (usize, usize) {
        let h = self.hidden_size;
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let i = self.intermediate_size;
        match module {
            "q_proj" => (h, q),
            "k_proj" | "v_proj" => (h, kv),
            "o_proj" => (q, h),
            "gate_proj" | "up_proj" => (h, i),
            "down_proj" => (i, h),
            _ => (0, 0),
        }
    }

    pub fn proj_has_bias(&self, module: &str) -> bool {
        match module {
            "q_proj" | "k_proj" | "v_proj" => self.qkv_bias,
            "o_proj" => self.o_bias,
            _ => self.mlp_bias,
        }
    }

    /// The head width attention runs at: `head_dim`, or MLA's (v padded to the q/k width).
    pub fn attention_head_width(&self) -> usize {
        self.mla.as_ref().map_or(self.head_dim, |m| m.attention_width())
    }

    /// Whether layer `layer` is a mixture of experts (transformers' rule: every layer from
    /// `first_k_dense_replace` on).
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| layer >= m.first_k_dense_replace)
    }

    /// The linear layers of layer `layer`, as paths under `model.layers.{layer}` without
    /// `.weight` (`self_attn.q_proj`, `mlp.experts.3.up_proj`), in a fixed order: adapter
    /// parameter order, dropout sites and PEFT keys all follow it. For Llama / Qwen2 it is
    /// [`crate::lora::MODULES`]' order.
    pub fn linear_sites(&self, layer: usize) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        let mlp = |out: &mut Vec<String>, prefix: &str| {
            for m in ["gate_proj", "up_proj", "down_proj"] {
                out.push(format!("{prefix}.{m}"));
            }
        };
        match &self.mla {
            None => {
                for m in ["q_proj", "k_proj", "v_proj", "o_proj"] {
                    out.push(format!("self_attn.{m}"));
                }
            }
            Some(a) => {
                let q: &[&str] = if a.q_lora_rank.is_some() { &["q_a_proj", "q_b_proj"] } else { &["q_proj"] };
                for m in q.iter().chain(&["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]) {
                    out.push(format!("self_attn.{m}"));
                }
            }
        }
        match &self.moe {
            Some(m) if self.is_moe_layer(layer) => {
                if m.n_shared_experts > 0 {
                    mlp(&mut out, "mlp.shared_experts");
                }
                for j in 0..m.n_routed_experts {
                    mlp(&mut out, &format!("mlp.experts.{j}"));
                }
            }
            _ => mlp(&mut out, "mlp"),
        }
        out
    }

    /// (in_features, out_features, has bias) of the linear at `path` (as in
    /// [`Self::linear_sites`]), or `None` when the model has no such linear.
    pub fn linear_shape(&self, path: &str) -> Option<(usize, usize, bool)> {
        let (parent, leaf) = path.rsplit_once('.')?;
        let h = self.hidden_size;
        let Some(a) = &self.mla else {
            let (i, o) = self.proj_shape(leaf);
            let ok = (parent == "self_attn" && ["q_proj", "k_proj", "v_proj", "o_proj"].contains(&leaf))
                || (parent == "mlp" && ["gate_proj", "up_proj", "down_proj"].contains(&leaf));
            return ok.then(|| (i, o, self.proj_has_bias(leaf)));
        };
        let nh = self.num_attention_heads;
        let shape = match (parent, leaf) {
            ("self_attn", "q_proj") if a.q_lora_rank.is_none() => (h, nh * a.qk_head_dim()),
            ("self_attn", "q_a_proj") => (h, a.q_lora_rank?),
            ("self_attn", "q_b_proj") => (a.q_lora_rank?, nh * a.qk_head_dim()),
            ("self_attn", "kv_a_proj_with_mqa") => (h, a.kv_lora_rank + a.qk_rope_head_dim),
            ("self_attn", "kv_b_proj") => (a.kv_lora_rank, nh * (a.qk_nope_head_dim + a.v_head_dim)),
            ("self_attn", "o_proj") => (nh * a.v_head_dim, h),
            _ => {
                let width = match parent {
                    "mlp" => self.intermediate_size,
                    "mlp.shared_experts" => self.moe.as_ref()?.moe_intermediate_size * self.moe.as_ref()?.n_shared_experts,
                    p if p.starts_with("mlp.experts.") => self.moe.as_ref()?.moe_intermediate_size,
                    _ => return None,
                };
                match leaf {
                    "gate_proj" | "up_proj" => (h, width),
                    "down_proj" => (width, h),
                    _ => return None,
                }
            }
        };
        Some((shape.0, shape.1, false))
    }

    /// The frozen tensors the model reads, by HF name, with their shapes (a tied lm_head is
    /// the embedding and is not listed twice).
    pub fn frozen_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (h, v) = (self.hidden_size, self.vocab_size);
        let mut out = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
        for l in 0..self.num_hidden_layers {
            let p = format!("model.layers.{l}");
            for site in self.linear_sites(l) {
                let Some((i, o, bias)) = self.linear_shape(&site) else { continue };
                out.push((format!("{p}.{site}.weight"), vec![o, i]));
                if bias {
                    out.push((format!("{p}.{site}.bias"), vec![o]));
                }
            }
            if let Some(a) = &self.mla {
                if let Some(q) = a.q_lora_rank {
                    out.push((format!("{p}.self_attn.q_a_layernorm.weight"), vec![q]));
                }
                out.push((format!("{p}.self_attn.kv_a_layernorm.weight"), vec![a.kv_lora_rank]));
            }
            if let Some(m) = self.moe.as_ref().filter(|_| self.is_moe_layer(l)) {
                out.push((format!("{p}.mlp.gate.weight"), vec![m.n_routed_experts, h]));
                if m.routing == Routing::SigmoidNoauxTc {
                    out.push((format!("{p}.mlp.gate.e_score_correction_bias"), vec![m.n_routed_experts]));
                }
            }
            out.push((format!("{p}.input_layernorm.weight"), vec![h]));
            out.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
        }
        out.push(("model.norm.weight".to_string(), vec![h]));
        if !self.tie_word_embeddings {
            out.push(("lm_head.weight".to_string(), vec![v, h]));
        }
        out
    }

    /// Leaf names of every linear the model has (`q_proj`, `kv_b_proj`, ...), for target checks.
    pub fn linear_names(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        let layers: Vec<usize> = (0..self.num_hidden_layers.min(1)).chain(self.moe.as_ref().map(|m| m.first_k_dense_replace).filter(|&l| l < self.num_hidden_layers)).collect();
        for l in layers {
            for site in self.linear_sites(l) {
                let leaf = site.rsplit('.').next().unwrap_or(&site).to_string();
                if !names.contains(&leaf) {
                    names.push(leaf);
                }
            }
        }
        names
    }

    /// Parameter count of the frozen base (what PEFT's `print_trainable_parameters` counts
    /// besides LoRA), from the config alone.
    pub fn base_param_count(&self) -> u64 {
        self.frozen_tensors().iter().map(|(_, s)| s.iter().product::<usize>() as u64).sum()
    }

    /// Inverse frequencies of the rotary embedding, with rope scaling applied as transformers'
    /// `ROPE_INIT_FUNCTIONS` do.
    pub fn inv_freq(&self) -> Vec<f64> {
        let d = self.head_dim;
        let base: Vec<f64> =
            (0..d / 2).map(|i| 1.0 / self.rope_theta.powf((2 * i) as f64 / d as f64)).collect();
        match self.rope_scaling {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                base.iter().map(|&f| llama3_inv_freq(f, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings as f64)).collect()
            }
            RopeScaling::Yarn { factor, original_max_position_embeddings, beta_fast, beta_slow, truncate, .. } => {
                // transformers' `_compute_yarn_parameters`: the dims that rotate more than
                // beta_fast times over the original context keep their frequency, those under
                // beta_slow are interpolated (/ factor), a linear ramp between.
                let (dim, base_theta) = (d as f64, self.rope_theta);
                let max_pos = original_max_position_embeddings as f64;
                let corr = |rot: f64| dim * (max_pos / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base_theta.ln());
                let (mut low, mut high) = (corr(beta_fast), corr(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001;
                }
                base.iter()
                    .enumerate()
                    .map(|(i, &f)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation = 1.0 - ramp;
                        (f / factor) * (1.0 - extrapolation) + f * extrapolation
                    })
                    .collect()
            }
        }
    }

    /// Factor on the cos/sin tables (YaRN's attention factor; 1 otherwise).
    pub fn rope_attention_factor(&self) -> f64 {
        match self.rope_scaling {
            RopeScaling::Yarn { factor, mscale, mscale_all_dim, attention_factor, .. } => attention_factor.unwrap_or(if mscale != 0.0 && mscale_all_dim != 0.0 {
                yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
            } else {
                yarn_mscale(factor, 1.0)
            }),
            _ => 1.0,
        }
    }

    /// Softmax scale of attention: head_dim^-0.5; for MLA (nope + rope)^-0.5, times
    /// mscale(factor, mscale_all_dim)^2 under YaRN (as transformers' DeepseekV2/V3Attention).
    pub fn attention_scale(&self) -> f64 {
        let Some(a) = &self.mla else { return 1.0 / (self.head_dim as f64).sqrt() };
        let base = 1.0 / (a.qk_head_dim() as f64).sqrt();
        match self.rope_scaling {
            RopeScaling::Yarn { factor, mscale_all_dim, .. } if mscale_all_dim != 0.0 => {
                let m = yarn_mscale(factor, mscale_all_dim);
                base * m * m
            }
            _ => base,
        }
    }
}

/// Quantised checkpoints we read: DeepSeek-V3's FP8 (e4m3 weights, one f32 scale per
/// 128 x 128 block, dequantised at load) and bitsandbytes' 4-bit and 8-bit (a quantized
/// base, `weights::bnb`). Anything else is refused rather than misread.
fn check_quantization(q: &serde_json::Value) -> std::result::Result<(), String> {
    let method = q.get("quant_method").and_then(|m| m.as_str()).unwrap_or("");
    if method == "bitsandbytes" {
        // The weights say how each is stored (`weights::bnb`); the config only which kind.
        let four = q.get("load_in_4bit").and_then(|b| b.as_bool()) == Some(true);
        let eight = q.get("load_in_8bit").and_then(|b| b.as_bool()) == Some(true);
        if let Some(t) = q.get("bnb_4bit_quant_type").and_then(|t| t.as_str()).filter(|t| four && !["nf4", "fp4"].contains(t)) {
            return Err(format!("quantization_config.bnb_4bit_quant_type `{t}` is not supported (nf4, fp4)"));
        }
        if !four && !eight {
            return Err("quantization_config: bitsandbytes without load_in_4bit or load_in_8bit".into());
        }
        return Ok(());
    }
    if method != "fp8" {
        return Err(format!("quantization_config.quant_method `{method}` is not supported (DeepSeek-V3's block-scaled fp8, bitsandbytes 4-bit and 8-bit)"));
    }
    if let Some(f) = q.get("fmt").and_then(|f| f.as_str()).filter(|f| *f != "e4m3") {
        return Err(format!("quantization_config.fmt `{f}` is not supported (e4m3)"));
    }
    let block = crate::weights::FP8_BLOCK as u64;
    if let Some(b) = q.get("weight_block_size") {
        let ok = b.as_array().is_some_and(|a| a.len() == 2 && a.iter().all(|x| x.as_u64() == Some(block)));
        if !ok {
            return Err(format!("quantization_config.weight_block_size {b} is not supported ([{block}, {block}])"));
        }
    }
    Ok(())
}

/// YaRN's magnitude correction: 0.1 * m * ln(scale) + 1 (1 for scale <= 1).
/// One inverse frequency `f` under Llama 3's rope scaling (transformers'
/// `_compute_llama3_parameters`): short wavelengths keep theirs, those longer than the
/// original context are divided by `factor`, and a linear blend in between.
pub fn llama3_inv_freq(f: f64, factor: f64, low_freq_factor: f64, high_freq_factor: f64, original: f64) -> f64 {
    let wavelen = 2.0 * std::f64::consts::PI / f;
    if wavelen < original / high_freq_factor {
        f
    } else if wavelen > original / low_freq_factor {
        f / factor
    } else {
        let smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
        (1.0 - smooth) * f / factor + smooth * f
    }
}

fn yarn_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

/// A size that must be positive.
fn positive(n: usize, key: &str) -> std::result::Result<usize, String> {
    if n == 0 {
        return Err(format!("{key} must be positive, got 0"));
    }
    Ok(n)
}

/// Bounds on the sizes a head, a latent or the experts are made of: past these, products of
/// sizes would overflow or the adapters' allocation would abort before any tensor's shape
/// is compared with the config (the largest released models use 192, 1536 and 384).
const MAX_HEAD_DIM: usize = 1 << 12;
const MAX_LATENT: usize = 1 << 16;
const MAX_EXPERTS: usize = 1 << 12;
/// An MLP's width: intermediate_size, an expert's, and the shared experts' summed.
const MAX_INTERMEDIATE: usize = 1 << 22;

/// `n`, or an error naming `key` when it is past `max`.
fn at_most(n: usize, key: &str, max: usize) -> std::result::Result<usize, String> {
    if n > max {
        return Err(format!("{key} = {n} is more than this tool accepts ({max})"));
    }
    Ok(n)
}

/// A positive size no larger than `max`.
fn size(n: usize, key: &str, max: usize) -> std::result::Result<usize, String> {
    at_most(positive(n, key)?, key, max)
}

/// DeepSeek-V2/V3 attention. Absent keys take the defaults of transformers'
/// `DeepseekV2Config` / `DeepseekV3Config` (what the reference would run), as does every
/// DeepSeek key below.
/// Sliding-window attention is not implemented: a config whose layers slide (transformers'
/// rule: `layer_types`, or Qwen2's `use_sliding_window` with a `sliding_window` from layer
/// `max_window_layers` on) is refused, unless the window covers every position the model has.
fn check_sliding_window(hf: &HfConfig) -> std::result::Result<Option<usize>, String> {
    let covers_all = |w: usize| hf.max_position_embeddings.is_some_and(|m| w >= m);
    if let Some(types) = &hf.layer_types {
        if let Some(i) = types.iter().position(|t| t != "full_attention") {
            if let Some(bad) = types.iter().find(|t| *t != "full_attention" && *t != "sliding_attention") {
                return Err(format!("layer_types has \"{bad}\": only full attention is implemented"));
            }
            if !hf.sliding_window.is_some_and(covers_all) {
                return Err(format!("layer_types[{i}] = \"{}\": only full attention is implemented (sliding-window attention would give other logits)", types[i]));
            }
            return Ok(hf.sliding_window);
        }
        return Ok(None);
    }
    // transformers' Qwen2Config default for max_window_layers.
    if hf.use_sliding_window == Some(true) && hf.max_window_layers.unwrap_or(28) < hf.num_hidden_layers {
        if let Some(w) = hf.sliding_window {
            if !covers_all(w) {
                return Err(format!(
                    "use_sliding_window = true with sliding_window = {w}: sliding-window attention is not implemented (it would give other logits past {w} tokens)"
                ));
            }
            return Ok(Some(w));
        }
    }
    Ok(None)
}

fn resolve_mla(hf: &HfConfig, arch: Arch) -> std::result::Result<Mla, String> {
    let q_lora_rank = hf.q_lora_rank.unwrap_or(Some(1536));
    if q_lora_rank == Some(0) {
        return Err("q_lora_rank must be null (plain q_proj) or positive, got 0".into());
    }
    if let Some(r) = q_lora_rank {
        at_most(r, "q_lora_rank", MAX_LATENT)?;
    }
    let rope = size(hf.qk_rope_head_dim.unwrap_or(64), "qk_rope_head_dim", MAX_HEAD_DIM)?;
    if rope % 2 != 0 {
        return Err(format!("qk_rope_head_dim must be even, got {rope}"));
    }
    // DeepSeek-V2 rotates interleaved pairs always; V3 says so with rope_interleave (default true).
    let rope_interleave = match arch {
        Arch::DeepseekV3 => hf.rope_interleave.unwrap_or(true),
        _ => {
            if hf.rope_interleave == Some(false) {
                return Err("rope_interleave = false is not what DeepSeek-V2 computes (it rotates interleaved pairs); remove the key".into());
            }
            true
        }
    };
    Ok(Mla {
        q_lora_rank,
        kv_lora_rank: size(hf.kv_lora_rank.unwrap_or(512), "kv_lora_rank", MAX_LATENT)?,
        qk_nope_head_dim: size(hf.qk_nope_head_dim.unwrap_or(128), "qk_nope_head_dim", MAX_HEAD_DIM)?,
        qk_rope_head_dim: rope,
        v_head_dim: size(hf.v_head_dim.unwrap_or(128), "v_head_dim", MAX_HEAD_DIM)?,
        rope_interleave,
    })
}

fn resolve_moe(hf: &HfConfig, arch: Arch) -> std::result::Result<Option<Moe>, String> {
    let v3 = arch == Arch::DeepseekV3;
    let Some(experts) = hf.n_routed_experts.unwrap_or(Some(if v3 { 256 } else { 64 })) else { return Ok(None) };
    if experts == 0 {
        return Err("n_routed_experts must be positive (or null for a dense model), got 0".into());
    }
    at_most(experts, "n_routed_experts", MAX_EXPERTS)?;
    // transformers' DeepseekV2Config has no default (its router would fail): required there.
    let top_k = hf.num_experts_per_tok.or(v3.then_some(8)).ok_or("num_experts_per_tok is required for DeepSeek-V2 MoE models")?;
    let top_k = positive(top_k, "num_experts_per_tok")?;
    let scoring = hf.scoring_func.clone().unwrap_or_else(|| if arch == Arch::DeepseekV3 { "sigmoid" } else { "softmax" }.into());
    let method = hf.topk_method.clone().unwrap_or_else(|| if arch == Arch::DeepseekV3 { "noaux_tc" } else { "greedy" }.into());
    let routing = match (arch, scoring.as_str(), method.as_str()) {
        (Arch::DeepseekV2, "softmax", "greedy") => Routing::SoftmaxGreedy,
        (Arch::DeepseekV2, "softmax", "group_limited_greedy") => Routing::SoftmaxGroupLimited,
        (Arch::DeepseekV3, "sigmoid", "noaux_tc") => Routing::SigmoidNoauxTc,
        (Arch::DeepseekV2, "softmax", m) => return Err(format!("topk_method `{m}` is not supported for DeepSeek-V2 (greedy, group_limited_greedy)")),
        (Arch::DeepseekV3, "sigmoid", m) => return Err(format!("topk_method `{m}` is not supported for DeepSeek-V3 (noaux_tc)")),
        (Arch::DeepseekV2, f, _) => return Err(format!("scoring_func `{f}` is not supported for DeepSeek-V2 (softmax)")),
        (_, f, _) => return Err(format!("scoring_func `{f}` is not supported for DeepSeek-V3 (sigmoid)")),
    };
    // transformers' DeepseekV2Config has no defaults for these (its group-limited router
    // fails without them); V3's are DeepSeek-V3's.
    if routing == Routing::SoftmaxGroupLimited {
        for (key, v) in [("n_group", hf.n_group), ("topk_group", hf.topk_group)] {
            if v.is_none() {
                return Err(format!("{key} is required with topk_method `group_limited_greedy`"));
            }
        }
    }
    let n_group = hf.n_group.unwrap_or(if v3 { 8 } else { 1 });
    let topk_group = hf.topk_group.unwrap_or(if v3 { 4 } else { 1 });
    if n_group == 0 || experts % n_group != 0 {
        return Err(format!("n_group ({n_group}) must be positive and divide n_routed_experts ({experts})"));
    }
    if topk_group == 0 || topk_group > n_group {
        return Err(format!("topk_group ({topk_group}) must be in 1..=n_group ({n_group})"));
    }
    let reachable = if routing == Routing::SoftmaxGreedy { experts } else { topk_group * experts / n_group };
    if top_k > reachable {
        return Err(format!("num_experts_per_tok ({top_k}) exceeds the {reachable} experts its routing can choose from (n_routed_experts, n_group, topk_group)"));
    }
    if routing == Routing::SigmoidNoauxTc && experts / n_group < 2 {
        return Err(format!("n_group ({n_group}) leaves fewer than 2 experts per group; noaux_tc ranks groups by their top 2"));
    }
    let rsf = hf.routed_scaling_factor.unwrap_or(if v3 { 2.5 } else { 1.0 });
    // transformers makes every layer from first_k_dense_replace on a MoE layer; DeepSeek's own
    // code skips layers by moe_layer_freq. Every released config has 1, where both agree.
    if let Some(f) = hf.moe_layer_freq.filter(|&f| f != 1) {
        return Err(format!("moe_layer_freq = {f} is not supported (1: transformers ignores the key, DeepSeek's code would skip layers)"));
    }
    if !rsf.is_finite() {
        return Err("routed_scaling_factor must be a finite number".into());
    }
    // transformers' deepseek_v2 ignores norm_topk_prob (the weights are the softmax scores);
    // DeepSeek's own V2 code normalises them instead of scaling by routed_scaling_factor.
    // Every released V2 config says false, where both agree.
    if !v3 && top_k > 1 && hf.norm_topk_prob == Some(true) {
        return Err(
            "norm_topk_prob = true is not supported for DeepSeek-V2 (transformers ignores the key; DeepSeek's own code normalises the chosen experts' weights and skips routed_scaling_factor): set it to false to train as transformers does".into(),
        );
    }
    let shared = at_most(hf.n_shared_experts.unwrap_or(if v3 { 1 } else { 2 }), "n_shared_experts", MAX_EXPERTS)?;
    // The intermediate_size bound, for one expert and for the shared experts, which run as one
    // MLP of their summed width.
    let moe_intermediate_size = size(hf.moe_intermediate_size.unwrap_or(if v3 { 2048 } else { 1407 }), "moe_intermediate_size", MAX_INTERMEDIATE)?;
    at_most(shared * moe_intermediate_size, "n_shared_experts x moe_intermediate_size (the shared experts' MLP width)", MAX_INTERMEDIATE)?;
    let moe = Moe {
        n_routed_experts: experts,
        num_experts_per_tok: top_k,
        n_shared_experts: shared,
        moe_intermediate_size,
        first_k_dense_replace: hf.first_k_dense_replace.unwrap_or(if v3 { 3 } else { 0 }),
        routing,
        n_group,
        topk_group,
        routed_scaling_factor: rsf,
        // V2: refused above where it would differ; its weights are the softmax scores.
        norm_topk_prob: v3 && hf.norm_topk_prob.unwrap_or(true),
    };
    Ok(Some(moe))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &str) -> std::result::Result<ModelConfig, String> {
        let text = format!(
            r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"vocab_size":256{extra}}}"#
        );
        ModelConfig::resolve(&serde_json::from_str(&text).unwrap())
    }

    #[test]
    fn sliding_window_attention_is_refused_unless_it_covers_every_position() {
        let e = cfg(r#","use_sliding_window":true,"sliding_window":4,"max_window_layers":0"#).unwrap_err();
        assert!(e.contains("use_sliding_window") && e.contains("sliding_window = 4"), "{e}");
        let e = cfg(r#","layer_types":["full_attention","sliding_attention"],"sliding_window":4"#).unwrap_err();
        assert!(e.contains("layer_types[1]"), "{e}");
        // Qwen2 as released: the flag off, or the window past every layer or position.
        cfg(r#","use_sliding_window":false,"sliding_window":4096"#).unwrap();
        cfg(r#","use_sliding_window":true,"sliding_window":4,"max_window_layers":2"#).unwrap();
        cfg(r#","use_sliding_window":true,"sliding_window":4096,"max_position_embeddings":4096,"max_window_layers":0"#).unwrap();
        cfg(r#","layer_types":["full_attention","full_attention"]"#).unwrap();
    }

    #[test]
    fn a_window_that_covers_max_position_embeddings_still_bounds_the_sequence() {
        // Accepted: full attention equals the window up to it, and no further.
        let c = cfg(r#","use_sliding_window":true,"sliding_window":256,"max_position_embeddings":256,"max_window_layers":0"#).unwrap();
        assert_eq!(c.attention_window, Some(256));
        assert!(c.check_positions(256).is_ok());
        let e = c.check_positions(257).unwrap_err();
        assert!(e.contains("257 tokens") && e.contains("sliding_window = 256"), "{e}");
        let c = cfg(r#","layer_types":["sliding_attention","full_attention"],"sliding_window":64,"max_position_embeddings":64"#).unwrap();
        assert_eq!(c.attention_window, Some(64));
        // No layer slides: no bound.
        let c = cfg(r#","use_sliding_window":true,"sliding_window":4,"max_window_layers":2"#).unwrap();
        assert_eq!(c.attention_window, None);
        assert_eq!(cfg(r#","use_sliding_window":false,"sliding_window":4096"#).unwrap().attention_window, None);
    }

    #[test]
    fn a_rope_scaling_with_both_type_keys_reads_as_rope_type() {
        // transformers 5's save_pretrained keeps a 4.x `type` beside the `rope_type` it adds.
        let both = cfg(r#","rope_parameters":{"rope_theta":10000.0,"factor":4.0,"rope_type":"linear","type":"linear"}"#).unwrap();
        assert_eq!(both.rope_scaling, RopeScaling::Linear { factor: 4.0 });
        let old = cfg(r#","rope_scaling":{"factor":4.0,"type":"linear"}"#).unwrap();
        assert_eq!(old.rope_scaling, RopeScaling::Linear { factor: 4.0 });
    }

    #[test]
    fn sizes_past_what_the_arithmetic_holds_are_refused() {
        let text = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":4294967296,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,"vocab_size":256}"#;
        let e = ModelConfig::resolve(&serde_json::from_str(text).unwrap()).unwrap_err();
        assert!(e.contains("hidden_size") && e.contains("more than this tool accepts"), "{e}");
    }

    #[test]
    fn head_latent_and_expert_sizes_past_what_allocation_holds_are_refused() {
        // They reached the adapters' allocation (an abort) before any tensor was compared.
        let e = cfg(r#","head_dim":1099511627776"#).unwrap_err();
        assert!(e.contains("head_dim = 1099511627776") && e.contains("more than this tool accepts"), "{e}");
        let ds_with = |key: &str, more: &[(&str, u64)]| {
            let mut v: serde_json::Value = serde_json::from_str(
                r#"{"architectures":["DeepseekV2ForCausalLM"],"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
                "num_attention_heads":4,"vocab_size":256,"q_lora_rank":null,"kv_lora_rank":16,"qk_nope_head_dim":16,
                "qk_rope_head_dim":8,"v_head_dim":16,"n_routed_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":32}"#,
            )
            .unwrap();
            if !key.is_empty() {
                v[key] = 1_000_000_000.into();
            }
            for (k, n) in more {
                v[*k] = (*n).into();
            }
            ModelConfig::resolve(&serde_json::from_value(v).unwrap())
        };
        let ds = |key: &str| ds_with(key, &[]);
        assert!(ds("").is_ok());
        for key in ["n_routed_experts", "n_shared_experts", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "moe_intermediate_size"] {
            let e = ds(key).unwrap_err();
            assert!(e.contains(&format!("{key} = 1000000000")) && e.contains("more than this tool accepts"), "{key}: {e}");
        }
        // Each within its bound, their product (the shared experts' width) past it.
        let e = ds_with("", &[("n_shared_experts", 4096), ("moe_intermediate_size", 4_194_304)]).unwrap_err();
        assert!(e.contains("n_shared_experts x moe_intermediate_size"), "{e}");
    }

    #[test]
    fn a_zero_size_is_an_error_naming_the_key() {
        let text = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":0,"num_hidden_layers":2,"num_attention_heads":4,"vocab_size":256}"#;
        let e = ModelConfig::resolve(&serde_json::from_str(text).unwrap()).unwrap_err();
        assert!(e.contains("intermediate_size must be positive"), "{e}");
        assert!(cfg("").is_ok());
    }

    #[test]
    fn rope_and_norm_values_that_give_nan_are_errors_naming_the_key() {
        // They loaded, and every forward gave NaN logits (`logits` printed them as JSON null,
        // exit 0; training blamed the weights).
        for (extra, key) in [
            (r#","rope_theta":0.0"#, "rope_theta"),
            (r#","rope_theta":-10000.0"#, "rope_theta"),
            (r#","rms_norm_eps":-1e-6"#, "rms_norm_eps"),
            (r#","rope_scaling":{"rope_type":"linear","factor":0.0}"#, "rope_scaling.factor"),
            (r#","rope_scaling":{"rope_type":"llama3","factor":-8.0}"#, "rope_scaling.factor"),
            (r#","rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":0.0}"#, "rope_scaling.low_freq_factor"),
        ] {
            let e = cfg(extra).unwrap_err();
            assert!(e.contains(key) && (e.contains("positive") || e.contains("non-negative")), "{extra}: {e}");
        }
        assert!(cfg(r#","rms_norm_eps":0.0"#).is_ok(), "an epsilon of 0 is a value (transformers adds it as given)");
    }

    #[test]
    fn unsupported_architecture_names_it() {
        let e = ModelConfig::resolve(&serde_json::from_str(
            r#"{"architectures":["GPT2LMHeadModel"],"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,"vocab_size":256}"#,
        ).unwrap()).unwrap_err();
        assert!(e.contains("GPT2LMHeadModel") && e.contains("LlamaForCausalLM"), "{e}");
    }

    #[test]
    fn llama3_scaling_keeps_high_freqs_and_divides_low_freqs() {
        let c = cfg(r#","rope_theta":500000.0,"rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}"#).unwrap();
        let plain = cfg(r#","rope_theta":500000.0"#).unwrap();
        let (a, b) = (c.inv_freq(), plain.inv_freq());
        assert_eq!(a[0], b[0]);
        let last = a.len() - 1;
        assert!((a[last] - b[last] / 8.0).abs() < 1e-15);
    }

    /// transformers 5 (`standardize_rope_params`): llama3 scaling without
    /// original_max_position_embeddings takes max_position_embeddings, and a top-level
    /// original_max_position_embeddings wins over rope_scaling's.
    #[test]
    fn llama3_scaling_takes_its_pretraining_context_as_transformers_5_settles_it() {
        let scaling = |inner: &str, outer: &str| {
            cfg(&format!(r#","rope_theta":500000.0,"max_position_embeddings":4096{outer},"rope_scaling":{{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0{inner}}}"#)).unwrap().rope_scaling
        };
        let at = |n: usize| RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: n };
        assert_eq!(scaling("", ""), at(4096));
        assert_eq!(scaling(r#","original_max_position_embeddings":8192"#, ""), at(8192));
        assert_eq!(scaling(r#","original_max_position_embeddings":8192"#, r#","original_max_position_embeddings":2048"#), at(2048));
        let e = cfg(r#","rope_scaling":{"rope_type":"llama3","factor":8.0}"#).unwrap_err();
        assert!(e.contains("original_max_position_embeddings"), "{e}");
    }

    #[test]
    fn transformers5_rope_parameters_are_read() {
        let c = cfg(r#","rope_parameters":{"rope_theta":1234.0,"rope_type":"default"}"#).unwrap();
        assert_eq!(c.rope_theta, 1234.0);
        assert_eq!(c.rope_scaling, RopeScaling::None);
    }

    #[test]
    fn deepseek_yarn_reads_the_same_from_the_transformers_4_and_5_layouts() {
        let base = r#""architectures":["DeepseekV2ForCausalLM"],"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"vocab_size":256,"q_lora_rank":null,"kv_lora_rank":16,
            "qk_nope_head_dim":16,"qk_rope_head_dim":8,"v_head_dim":16,"n_routed_experts":4,"num_experts_per_tok":2,
            "moe_intermediate_size":32,"max_position_embeddings":2048"#;
        let yarn = r#""factor":4.0,"original_max_position_embeddings":16,"beta_fast":32,"beta_slow":1,"mscale":0.707,"mscale_all_dim":0.707"#;
        let v4 = format!(r#"{{{base},"rope_theta":10000.0,"rope_scaling":{{"type":"yarn",{yarn}}}}}"#);
        let v5 = format!(r#"{{{base},"rope_parameters":{{"rope_type":"yarn","rope_theta":10000.0,{yarn}}}}}"#);
        let (a, b) = (ModelConfig::resolve(&serde_json::from_str(&v4).unwrap()).unwrap(), ModelConfig::resolve(&serde_json::from_str(&v5).unwrap()).unwrap());
        assert!(matches!(a.rope_scaling, RopeScaling::Yarn { .. }));
        assert_eq!(a.rope_scaling, b.rope_scaling);
        assert_eq!(a.inv_freq(), b.inv_freq());
        assert_eq!(a.attention_scale(), b.attention_scale());
        // The values transformers computes for these numbers (see parity-deepseek-mlp's checks).
        let want = [1.0, 0.1 / 4.0, 0.01 / 4.0, 0.001 / 4.0];
        for (x, y) in a.inv_freq().iter().zip(want) {
            assert!((x - y).abs() < 1e-12, "{x} vs {y}");
        }
        assert!((a.attention_scale() - 0.24609782191507454).abs() < 1e-15);
    }
}
