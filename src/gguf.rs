//! `finetune import --gguf`: a llama-architecture GGUF file (llama.cpp's format, often
//! quantized) to an HF model folder our trainer, transformers and candle load.
//!
//! - Tensors are dequantized (candle's GGUF reader) and renamed from llama.cpp's names
//!   (`blk.N.attn_q.weight`) to HF's (`model.layers.N.self_attn.q_proj.weight`).
//! - llama.cpp's converter permutes the rows of q/k so that its interleaved RoPE equals HF's
//!   rotate-half RoPE; we undo it (see `unpermute`), since our model uses rotate-half.
//! - `config.json` comes from the `llama.*` metadata; `tokenizer.json` is built from the
//!   `tokenizer.ggml.*` vocabulary, merges and token types as transformers' GGUF converter
//!   builds it (byte-level BPE for `gpt2` vocabularies); `tokenizer_config.json` carries the
//!   chat template and special tokens.

use crate::error::{Error, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::Path;

pub struct ImportReport {
    pub tensors: usize,
    pub config: serde_json::Value,
    pub shards: usize,
}

fn meta<'a>(c: &'a Content, key: &str, file: &Path) -> Result<&'a Value> {
    c.metadata.get(key).ok_or_else(|| Error::data(file, format!("GGUF metadata has no `{key}`")))
}

fn meta_u32(c: &Content, key: &str, file: &Path) -> Result<u32> {
    let v = meta(c, key, file)?;
    v.to_u32().or_else(|_| v.to_u64().map(|x| x as u32)).or_else(|_| v.to_i32().map(|x| x as u32))
        .map_err(|_| Error::data(file, format!("GGUF metadata `{key}` is not an integer")))
}

fn meta_f32(c: &Content, key: &str, file: &Path) -> Result<f32> {
    meta(c, key, file)?.to_f32().map_err(|_| Error::data(file, format!("GGUF metadata `{key}` is not a float")))
}

fn meta_opt_u32(c: &Content, key: &str) -> Option<u32> {
    c.metadata.get(key).and_then(|v| v.to_u32().ok().or_else(|| v.to_i32().ok().map(|x| x as u32)))
}

/// llama.cpp name -> HF name.
pub fn hf_name(gguf: &str) -> Option<String> {
    match gguf {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, name) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let hf = match name {
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "attn_q.bias" => "self_attn.q_proj.bias",
        "attn_k.bias" => "self_attn.k_proj.bias",
        "attn_v.bias" => "self_attn.v_proj.bias",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        "attn_norm.weight" => "input_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
}

/// Undo llama.cpp's q/k permutation. The converter maps HF rows with
/// `w.reshape(heads, 2, d/2, in).swapaxes(1, 2)`, i.e. within each head the two halves
/// (rotate-half pairs i, i + d/2) become interleaved pairs (2i, 2i + 1). Inverse:
/// [heads, d/2, 2, in] -> swap -> [heads, 2, d/2, in].
pub fn unpermute(w: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    let d = rows / heads;
    w.reshape((heads, d / 2, 2, cols))? // [heads, d/2, 2, in]
        .transpose(1, 2)? // [heads, 2, d/2, in]
        .contiguous()?
        .reshape((rows, cols))
}

/// The forward direction (what llama.cpp's converter does), for writing test files.
pub fn permute(w: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    let d = rows / heads;
    w.reshape((heads, 2, d / 2, cols))?.transpose(1, 2)?.contiguous()?.reshape((rows, cols))
}

fn strings(c: &Content, key: &str, file: &Path) -> Result<Vec<String>> {
    let v = meta(c, key, file)?.to_vec().map_err(|_| Error::data(file, format!("`{key}` is not an array")))?;
    v.iter()
        .map(|x| x.to_string().cloned().map_err(|_| Error::data(file, format!("`{key}` holds a non-string"))))
        .collect()
}

/// Build an HF `tokenizer.json` (and the special-token part of `tokenizer_config.json`).
fn tokenizer_files(c: &Content, file: &Path) -> Result<(serde_json::Value, serde_json::Value)> {
    let model = meta(c, "tokenizer.ggml.model", file)?.to_string().map_err(|_| Error::data(file, "tokenizer.ggml.model is not a string"))?.clone();
    if model != "gpt2" {
        return Err(Error::data(file, format!("tokenizer model `{model}` is not supported (byte-level BPE `gpt2` only)")));
    }
    let tokens = strings(c, "tokenizer.ggml.tokens", file)?;
    let merges = strings(c, "tokenizer.ggml.merges", file)?;
    let types: Vec<i32> = match c.metadata.get("tokenizer.ggml.token_type").and_then(|v| v.to_vec().ok()) {
        Some(v) => v.iter().map(|x| x.to_i32().unwrap_or(1)).collect(),
        None => vec![1; tokens.len()],
    };
    let mut vocab = serde_json::Map::new();
    let mut added = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        vocab.insert(t.clone(), i.into());
        // token_type 3 = control (special), 4 = user-defined (added, not special).
        let ty = types.get(i).copied().unwrap_or(1);
        if ty == 3 || ty == 4 {
            added.push(serde_json::json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": ty == 4, "special": ty == 3}));
        }
    }
    let bos = meta_opt_u32(c, "tokenizer.ggml.bos_token_id");
    let eos = meta_opt_u32(c, "tokenizer.ggml.eos_token_id");
    let unk = meta_opt_u32(c, "tokenizer.ggml.unknown_token_id");
    let pad = meta_opt_u32(c, "tokenizer.ggml.padding_token_id");
    let add_bos = c.metadata.get("tokenizer.ggml.add_bos_token").and_then(|v| v.to_bool().ok()).unwrap_or(false);
    let name = |id: Option<u32>| id.and_then(|i| tokens.get(i as usize)).cloned();
    let mut single = Vec::new();
    let mut special_tokens = serde_json::Map::new();
    if add_bos {
        if let Some(b) = name(bos) {
            single.push(serde_json::json!({"SpecialToken": {"id": b, "type_id": 0}}));
            special_tokens.insert(b.clone(), serde_json::json!({"id": b, "ids": [bos], "tokens": [b]}));
        }
    }
    single.push(serde_json::json!({"Sequence": {"id": "A", "type_id": 0}}));
    let mut pair = single.clone();
    pair.push(serde_json::json!({"Sequence": {"id": "B", "type_id": 1}}));
    let merges: Vec<serde_json::Value> = merges.iter().map(|m| serde_json::Value::String(m.clone())).collect();
    let tok = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special_tokens},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": name(unk), "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    });
    let mut cfg = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": false,
        "model_max_length": meta_opt_u32(c, "llama.context_length").unwrap_or(2048),
    });
    let obj = cfg.as_object_mut().ok_or_else(|| Error::data(file, "internal"))?;
    for (k, id) in [("bos_token", bos), ("eos_token", eos), ("unk_token", unk), ("pad_token", pad)] {
        if let Some(n) = name(id) {
            obj.insert(k.into(), n.into());
        }
    }
    if let Some(t) = c.metadata.get("tokenizer.chat_template").and_then(|v| v.to_string().ok()) {
        obj.insert("chat_template".into(), t.clone().into());
    }
    Ok((tok, cfg))
}

/// Import `gguf` into `out` (which must not exist or be empty), storing weights in `dtype`.
pub fn import(gguf: &Path, out: &Path, dtype: DType, max_shard_bytes: u64) -> Result<ImportReport> {
    let mut f = std::fs::File::open(gguf).map_err(|e| Error::io(gguf, e))?;
    let c = Content::read(&mut f).map_err(|e| Error::data(gguf, format!("not a readable GGUF file: {}", crate::error::candle_msg(&e))))?;
    let arch = meta(&c, "general.architecture", gguf)?.to_string().map_err(|_| Error::data(gguf, "general.architecture is not a string"))?.clone();
    if arch != "llama" {
        return Err(Error::data(gguf, format!("architecture `{arch}` is not supported (llama only)")));
    }
    let heads = meta_u32(&c, "llama.attention.head_count", gguf)? as usize;
    let kv_heads = meta_opt_u32(&c, "llama.attention.head_count_kv").unwrap_or(heads as u32) as usize;
    let hidden = meta_u32(&c, "llama.embedding_length", gguf)? as usize;
    let layers = meta_u32(&c, "llama.block_count", gguf)? as usize;
    let inter = meta_u32(&c, "llama.feed_forward_length", gguf)? as usize;
    let eps = meta_f32(&c, "llama.attention.layer_norm_rms_epsilon", gguf)?;
    let theta = c.metadata.get("llama.rope.freq_base").and_then(|v| v.to_f32().ok()).unwrap_or(10000.0);
    let embd = c.tensor_infos.get("token_embd.weight").ok_or_else(|| Error::data(gguf, "no token_embd.weight tensor"))?;
    let vocab = embd.shape.dims()[0];
    let tied = !c.tensor_infos.contains_key("output.weight");
    let head_dim = meta_opt_u32(&c, "llama.rope.dimension_count").map(|d| d as usize).unwrap_or(hidden / heads);

    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    let mut names: Vec<&String> = c.tensor_infos.keys().collect();
    names.sort();
    for name in names {
        let hf = hf_name(name).ok_or_else(|| Error::data(gguf, format!("tensor `{name}` has no HF equivalent")))?;
        let q = c.tensor(&mut f, name, &Device::Cpu).map_err(|e| Error::data(gguf, format!("tensor `{name}`: {}", crate::error::candle_msg(&e))))?;
        let mut t = q.dequantize(&Device::Cpu)?;
        if name.ends_with("attn_q.weight") {
            t = unpermute(&t, heads)?;
        } else if name.ends_with("attn_k.weight") {
            t = unpermute(&t, kv_heads)?;
        }
        tensors.push((hf, t.to_dtype(dtype)?));
    }
    let torch_dtype = match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    };
    let mut config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "max_position_embeddings": meta_opt_u32(&c, "llama.context_length").unwrap_or(2048),
        "attention_bias": false,
        "mlp_bias": false,
        "torch_dtype": torch_dtype,
    });
    let (tok, tok_cfg) = tokenizer_files(&c, gguf)?;
    for (k, key) in [("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id"), ("pad_token_id", "tokenizer.ggml.padding_token_id")] {
        if let (Some(id), Some(o)) = (meta_opt_u32(&c, key), config.as_object_mut()) {
            o.insert(k.into(), id.into());
        }
    }
    // The folder appears whole or not at all.
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    if std::fs::read_dir(out).map(|mut d| d.next().is_some()).unwrap_or(false) {
        return Err(Error::io(out, std::io::Error::new(std::io::ErrorKind::AlreadyExists, "output folder is not empty (choose another --out)")));
    }
    let shards = write_weights(out, &tensors, max_shard_bytes)?;
    let w = |name: &str, v: &serde_json::Value| crate::fsutil::write_atomic(&out.join(name), serde_json::to_string_pretty(v).unwrap_or_default().as_bytes());
    w("config.json", &config)?;
    w("tokenizer.json", &tok)?;
    w("tokenizer_config.json", &tok_cfg)?;
    let mut gen = serde_json::json!({"do_sample": false});
    for k in ["bos_token_id", "eos_token_id", "pad_token_id"] {
        if let (Some(v), Some(o)) = (config.get(k).cloned(), gen.as_object_mut()) {
            o.insert(k.into(), v);
        }
    }
    w("generation_config.json", &gen)?;
    Ok(ImportReport { tensors: tensors.len(), config, shards })
}

/// Write tensors as `model.safetensors`, or shards of at most `limit` bytes with an index.
pub fn write_weights(out: &Path, tensors: &[(String, Tensor)], limit: u64) -> Result<usize> {
    let mut shards: Vec<Vec<&(String, Tensor)>> = vec![Vec::new()];
    let mut size = 0u64;
    for t in tensors {
        let bytes = (t.1.elem_count() * t.1.dtype().size_in_bytes()) as u64;
        if size + bytes > limit && !shards.last().is_some_and(|s| s.is_empty()) {
            shards.push(Vec::new());
            size = 0;
        }
        if let Some(s) = shards.last_mut() {
            s.push(t);
        }
        size += bytes;
    }
    let n = shards.len();
    let mut weight_map = serde_json::Map::new();
    let mut total = 0u64;
    for (i, shard) in shards.iter().enumerate() {
        let fname = if n == 1 { "model.safetensors".to_string() } else { format!("model-{:05}-of-{n:05}.safetensors", i + 1) };
        let map: HashMap<String, Tensor> = shard.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        for (k, v) in &map {
            weight_map.insert(k.clone(), fname.clone().into());
            total += (v.elem_count() * v.dtype().size_in_bytes()) as u64;
        }
        let path = out.join(&fname);
        candle_core::safetensors::save(&map, &path).map_err(|e| Error::Safetensors { file: path.clone(), msg: e.to_string() })?;
    }
    if n > 1 {
        let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        crate::fsutil::write_atomic(&out.join("model.safetensors.index.json"), index.to_string().as_bytes())?;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_the_llama_cpp_permutation() -> candle_core::Result<()> {
        let w = Tensor::arange(0f32, 48.0, &Device::Cpu)?.reshape((12, 4))?; // 3 heads x d 4
        let back = unpermute(&permute(&w, 3)?, 3)?;
        assert_eq!(back.to_vec2::<f32>()?, w.to_vec2::<f32>()?);
        // Row 1 of a head (pair partner of row 0 in interleaved order) comes from row d/2 = 2.
        let p = permute(&w, 3)?.to_vec2::<f32>()?;
        assert_eq!(p[1], w.to_vec2::<f32>()?[2]);
        Ok(())
    }

    #[test]
    fn names_map_to_hf() {
        assert_eq!(hf_name("blk.3.attn_output.weight").as_deref(), Some("model.layers.3.self_attn.o_proj.weight"));
        assert_eq!(hf_name("token_embd.weight").as_deref(), Some("model.embed_tokens.weight"));
        assert_eq!(hf_name("blk.0.ffn_norm.weight").as_deref(), Some("model.layers.0.post_attention_layernorm.weight"));
        assert_eq!(hf_name("rope_freqs.weight"), None);
    }
}
