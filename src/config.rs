//! Model configuration in two stages, as candle-transformers does it: [`HfConfig`] mirrors
//! `config.json` (every field optional where HF allows it), and [`ModelConfig`] is the resolved
//! form with no `Option`s that model code reads.
//!
//! Supported: `LlamaForCausalLM` (DeepSeek LLM, DeepSeek-Coder, DeepSeek-R1-Distill-Llama with
//! llama3 rope scaling) and `Qwen2ForCausalLM` (DeepSeek-R1-Distill-Qwen: q/k/v bias, tied
//! embeddings on the small ones).

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
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
    #[serde(default)]
    pub bos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub torch_dtype: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct RopeScalingHf {
    #[serde(default, alias = "type")]
    pub rope_type: Option<String>,
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
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arch {
    Llama,
    Qwen2,
}

#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (equivalently inv_freq / factor).
    Linear { factor: f64 },
    /// Llama 3.1 frequency-dependent scaling.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: usize },
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
}

pub const SUPPORTED: &[&str] = &["LlamaForCausalLM", "Qwen2ForCausalLM"];

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
            "" => return Err(format!("no `architectures` entry; supported: {}", SUPPORTED.join(", "))),
            other => {
                return Err(format!(
                    "architecture `{other}` is not supported; supported: {} (DeepSeek LLM/Coder and \
                     R1-Distill models use these)",
                    SUPPORTED.join(", ")
                ))
            }
        };
        if let Some(act) = &hf.hidden_act {
            if act != "silu" {
                return Err(format!("hidden_act `{act}` is not supported (expected silu)"));
            }
        }
        let heads = hf.num_attention_heads;
        let kv = hf.num_key_value_heads.unwrap_or(heads);
        if heads == 0 || kv == 0 || heads % kv != 0 {
            return Err(format!("num_attention_heads ({heads}) must be a positive multiple of num_key_value_heads ({kv})"));
        }
        for (key, v) in [("hidden_size", hf.hidden_size), ("intermediate_size", hf.intermediate_size), ("num_hidden_layers", hf.num_hidden_layers), ("vocab_size", hf.vocab_size)] {
            if v == 0 {
                return Err(format!("{key} must be positive, got 0"));
            }
        }
        let head_dim = hf.head_dim.unwrap_or(hf.hidden_size / heads);
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(format!("head_dim {head_dim} must be even and positive"));
        }
        let params = hf.rope_parameters.as_ref();
        // transformers 5 keeps theta (and scaling) in rope_parameters; 4.x at the top level.
        let rope_theta = params
            .and_then(|p| p.rope_theta)
            .or(hf.rope_theta)
            .unwrap_or(10000.0);
        let scaling = hf.rope_scaling.as_ref().or(params);
        let rope_scaling = match scaling {
            None => RopeScaling::None,
            Some(s) => match s.rope_type.as_deref().unwrap_or("default") {
                "default" => RopeScaling::None,
                "linear" => RopeScaling::Linear { factor: s.factor.ok_or("rope_scaling linear needs `factor`")? },
                "llama3" => RopeScaling::Llama3 {
                    factor: s.factor.ok_or("rope_scaling llama3 needs `factor`")?,
                    low_freq_factor: s.low_freq_factor.unwrap_or(1.0),
                    high_freq_factor: s.high_freq_factor.unwrap_or(4.0),
                    original_max_position_embeddings: s.original_max_position_embeddings.unwrap_or(8192),
                },
                other => return Err(format!("rope_scaling type `{other}` is not supported (default, linear, llama3)")),
            },
        };
        let attention_bias = hf.attention_bias.unwrap_or(false);
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
            qkv_bias: arch == Arch::Qwen2 || attention_bias,
            o_bias: arch == Arch::Llama && attention_bias,
            mlp_bias: hf.mlp_bias.unwrap_or(false),
            architecture_name: name,
        })
    }

    /// (in_features, out_features) of a projection by its HF module name.
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

    /// The frozen tensors the model reads, by HF name, with their shapes (a tied lm_head is
    /// the embedding and is not listed twice).
    pub fn frozen_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (h, v) = (self.hidden_size, self.vocab_size);
        let mut out = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
        for l in 0..self.num_hidden_layers {
            let p = format!("model.layers.{l}");
            for m in ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] {
                let parent = crate::lora::module_parent(m);
                let (i, o) = self.proj_shape(m);
                out.push((format!("{p}.{parent}.{m}.weight"), vec![o, i]));
                if self.proj_has_bias(m) {
                    out.push((format!("{p}.{parent}.{m}.bias"), vec![o]));
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
                let old = original_max_position_embeddings as f64;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }
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
    fn a_zero_size_is_an_error_naming_the_key() {
        let text = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":0,"num_hidden_layers":2,"num_attention_heads":4,"vocab_size":256}"#;
        let e = ModelConfig::resolve(&serde_json::from_str(text).unwrap()).unwrap_err();
        assert!(e.contains("intermediate_size must be positive"), "{e}");
        assert!(cfg("").is_ok());
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

    #[test]
    fn transformers5_rope_parameters_are_read() {
        let c = cfg(r#","rope_parameters":{"rope_theta":1234.0,"rope_type":"default"}"#).unwrap();
        assert_eq!(c.rope_theta, 1234.0);
        assert_eq!(c.rope_scaling, RopeScaling::None);
    }
}
