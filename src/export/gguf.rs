//! `finetune export --format gguf`: a LoRA adapter as the GGUF file llama.cpp loads with
//! `llama-cli --lora` / `llama-server --lora` beside the base model's GGUF.
//!
//! The layout is what llama.cpp's `convert_lora_to_gguf.py` writes and `llama-adapter.cpp`
//! reads:
//! - metadata `general.architecture` (the base's: llama.cpp refuses an adapter of another),
//!   `general.type = "adapter"`, `adapter.type = "lora"`, `adapter.lora.alpha` (llama.cpp
//!   scales by alpha / rank, rank read from the tensors, as PEFT does);
//! - per adapted projection, `<llama.cpp name of the weight>.lora_a` holding PEFT's A [r, in]
//!   and `.lora_b` holding B [out, r] (ggml dims reversed: [in, r] and [r, out]), in F32;
//! - llama's q/k projections: llama.cpp's converter permutes the base's q/k rows for its
//!   RoPE, so B's rows (the output dimension) get the same permutation and A none, as the
//!   converter does. Qwen2's are not permuted.

use crate::error::{Error, Result};
use crate::export::{ExportReport, PeftAdapter};
use crate::weights::ModelDir;
use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QTensor};
use std::path::Path;

/// llama.cpp's architecture name for a config's `model_type`, where llama.cpp names the
/// tensors as `gguf::hf_name` maps them.
fn llama_cpp_arch(model_type: &str) -> Option<&'static str> {
    match model_type {
        "llama" => Some("llama"),
        "qwen2" => Some("qwen2"),
        _ => None,
    }
}

/// The llama.cpp architecture a GGUF adapter for `base` is written for, or why there is none
/// (also checked by training when the recipe asks for `export.gguf`, before any step).
pub fn adapter_arch(base: &ModelDir) -> Result<&'static str> {
    let model_type = read_model_type(&base.config_path())?;
    llama_cpp_arch(&model_type).ok_or_else(|| {
        Error::Export(format!("{}: model_type `{model_type}`: GGUF adapters are written for llama and qwen2 bases (export the PEFT adapter instead)", base.config_path().display()))
    })
}

/// Write `adapter` (trained on `base`) to `out`, a `.gguf` file path; `out` appears whole or
/// not at all. A signal caught while it is written (`stop`: the flag the signal handlers
/// set) leaves no file and returns [`Error::Interrupted`].
pub fn export_gguf_adapter(adapter: &PeftAdapter, base: &ModelDir, out: &Path, stop: Option<&std::sync::atomic::AtomicUsize>) -> Result<ExportReport> {
    let cfg = base.config()?;
    let adapters = adapter.load(&cfg)?;
    let arch = adapter_arch(base)?;
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for (layer, path, ad) in adapters.iter() {
        let hf = format!("model.layers.{layer}.{path}.weight");
        let g = crate::gguf::gguf_name(&hf)
            .ok_or_else(|| Error::Export(format!("{hf} has no llama.cpp tensor name; GGUF adapters cover the attention and MLP projections")))?;
        let a = ad.a.as_tensor().to_dtype(candle_core::DType::F32)?; // [r, in]
        let mut b = ad.b.as_tensor().to_dtype(candle_core::DType::F32)?; // [out, r]
        if arch == "llama" {
            if path == "self_attn.q_proj" {
                b = crate::gguf::permute(&b, cfg.num_attention_heads)?;
            } else if path == "self_attn.k_proj" {
                b = crate::gguf::permute(&b, cfg.num_key_value_heads)?;
            }
        }
        tensors.push((format!("{g}.lora_a"), QTensor::quantize(&a, GgmlDType::F32)?));
        tensors.push((format!("{g}.lora_b"), QTensor::quantize(&b, GgmlDType::F32)?));
    }
    if tensors.is_empty() {
        return Err(Error::Export(format!("{}: the adapter adapts no projection", adapter.dir.display())));
    }
    let md: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String(arch.into())),
        ("general.type", Value::String("adapter".into())),
        ("general.name", Value::String(format!("LoRA adapter for {}", adapter.base_model.as_deref().unwrap_or(&base.name)))),
        ("adapter.type", Value::String("lora".into())),
        ("adapter.lora.alpha", Value::F32(adapter.spec.alpha as f32)),
    ];
    // One writer of `out` at a time (its `.NAME.tmp` is shared): a `finetune export` and a
    // run's end-of-run write of the same file.
    let _lock = crate::output::StagingLock::acquire(out)?;
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    crate::fsutil::write_with(out, |f| {
        candle_core::quantized::gguf_file::write(f, &md_refs, &t_refs).map_err(|e| crate::fsutil::candle_write_error(out, e))?;
        stop.map_or(Ok(()), super::stop_requested)
    })?;
    let total_bytes = std::fs::metadata(out).map_err(|e| Error::io(out, e))?.len();
    Ok(ExportReport { out: out.to_path_buf(), shards: 1, total_bytes, ..Default::default() })
}

fn read_model_type(config: &Path) -> Result<String> {
    let text = std::fs::read_to_string(config).map_err(|e| Error::io(config, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Config { path: config.to_path_buf(), msg: e.to_string() })?;
    Ok(v.get("model_type").and_then(|m| m.as_str()).unwrap_or_default().to_string())
}
