//! Synthetic models and datasets: a random-weight HF model folder and a tokenized Arrow
//! dataset in the layout HF `datasets` writes. The bundled default job and the tests train on
//! these (no hub access here); `finetune synth` writes them from the command line.

use crate::error::{Error, Result};
use crate::rng::Rng;
use arrow_array::builder::{Int32Builder, Int64Builder, ListBuilder};
use arrow_array::{ArrayRef, RecordBatch};
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// Shape of a synthetic model.
#[derive(Clone, Debug)]
pub struct TinyShape {
    pub arch: &'static str,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub inter: usize,
    pub vocab: usize,
    pub tie: bool,
    pub dtype: DType,
    pub init_std: f64,
}

impl Default for TinyShape {
    fn default() -> Self {
        TinyShape {
            arch: "LlamaForCausalLM",
            hidden: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            inter: 128,
            vocab: 256,
            tie: false,
            dtype: DType::F32,
            init_std: 0.1,
        }
    }
}

impl TinyShape {
    /// DeepSeek LLM 7B's shape (Llama: 30 layers, hidden 4096, 32 heads, vocab 102400).
    pub fn deepseek_llm_7b() -> Self {
        TinyShape { hidden: 4096, layers: 30, heads: 32, kv_heads: 32, inter: 11008, vocab: 102400, tie: false, init_std: 0.02, ..Default::default() }
    }

    /// SmolLM2-135M's shape (the benchmark shape).
    pub fn smollm2_135m() -> Self {
        TinyShape { hidden: 576, layers: 30, heads: 9, kv_heads: 3, inter: 1536, vocab: 49152, tie: true, init_std: 0.02, ..Default::default() }
    }
}

fn normal(rng: &mut Rng, n: usize, mean: f64, std: f64) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u1 = rng.next_f64().max(1e-300);
            let u2 = rng.next_f64();
            (mean + std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect()
}

/// The HF `config.json` of a model of `shape` (what [`write_model`] writes).
pub fn config_json(shape: &TinyShape) -> serde_json::Value {
    let head_dim = shape.hidden / shape.heads;
    let qwen = shape.arch == "Qwen2ForCausalLM";
    let dtype_name = crate::weights::torch_dtype_name(shape.dtype);
    serde_json::json!({
        "architectures": [shape.arch],
        "model_type": if qwen { "qwen2" } else { "llama" },
        "hidden_size": shape.hidden,
        "intermediate_size": shape.inter,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": head_dim,
        "vocab_size": shape.vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": if qwen { 1_000_000.0 } else { 10_000.0 },
        "tie_word_embeddings": shape.tie,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": dtype_name,
    })
}

/// Write `config.json` and `model.safetensors` (or `shards` shards plus
/// `model.safetensors.index.json` when `shards > 1`) with random weights.
pub fn write_model(dir: &Path, shape: &TinyShape, seed: u64, shards: usize) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let head_dim = shape.hidden / shape.heads;
    let qwen = shape.arch == "Qwen2ForCausalLM";
    let config = config_json(shape);
    let text = serde_json::to_string_pretty(&config).map_err(|e| Error::Train(e.to_string()))?;
    std::fs::write(dir.join("config.json"), text).map_err(|e| Error::io(dir.join("config.json"), e))?;

    let mut rng = Rng::new(seed);
    let (h, q, kv, i) = (shape.hidden, shape.heads * head_dim, shape.kv_heads * head_dim, shape.inter);
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    let mut add = |name: String, dims: Vec<usize>, mean: f64, std: f64, rng: &mut Rng| {
        let n = dims.iter().product();
        tensors.push((name, dims, normal(rng, n, mean, std)));
    };
    let s = shape.init_std;
    add("model.embed_tokens.weight".into(), vec![shape.vocab, h], 0.0, s, &mut rng);
    for l in 0..shape.layers {
        let p = format!("model.layers.{l}");
        for (m, o, inp) in [("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)] {
            add(format!("{p}.self_attn.{m}.weight"), vec![o, inp], 0.0, s, &mut rng);
            if qwen && m != "o_proj" {
                add(format!("{p}.self_attn.{m}.bias"), vec![o], 0.0, 0.1, &mut rng);
            }
        }
        for (m, o, inp) in [("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)] {
            add(format!("{p}.mlp.{m}.weight"), vec![o, inp], 0.0, s, &mut rng);
        }
        add(format!("{p}.input_layernorm.weight"), vec![h], 1.0, 0.1, &mut rng);
        add(format!("{p}.post_attention_layernorm.weight"), vec![h], 1.0, 0.1, &mut rng);
    }
    add("model.norm.weight".into(), vec![h], 1.0, 0.1, &mut rng);
    if !shape.tie {
        add("lm_head.weight".into(), vec![shape.vocab, h], 0.0, s, &mut rng);
    }
    let shards = shards.max(1);
    let per = tensors.len().div_ceil(shards);
    let mut weight_map = BTreeMap::new();
    for (si, chunk) in tensors.chunks(per).enumerate() {
        let file = if shards == 1 { "model.safetensors".to_string() } else { format!("model-{:05}-of-{:05}.safetensors", si + 1, shards) };
        let mut map = std::collections::HashMap::new();
        for (name, dims, data) in chunk {
            let t = Tensor::from_slice(data, dims.as_slice(), &Device::Cpu)?.to_dtype(shape.dtype)?;
            map.insert(name.clone(), t);
            weight_map.insert(name.clone(), file.clone());
        }
        let path = dir.join(&file);
        crate::fsutil::write_safetensors(map.iter().map(|(k, v)| (k.as_str(), v)), None, &path)?;
    }
    if shards > 1 {
        let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
        let p = dir.join("model.safetensors.index.json");
        std::fs::write(&p, serde_json::to_string_pretty(&index).unwrap_or_default()).map_err(|e| Error::io(&p, e))?;
    }
    Ok(())
}

/// A word-level `tokenizer.json` whose tokens are `<unk>`, `<s>`, `</s>`, then `w3` .. `w{V-1}`,
/// with `tokenizer_config.json`, so tools that insist on a tokenizer (transformers'
/// AutoTokenizer) can open a synthetic model folder.
pub fn write_tokenizer(dir: &Path, vocab: usize) -> Result<()> {
    let mut v = serde_json::Map::new();
    for i in 0..vocab {
        let t = match i {
            0 => "<unk>".to_string(),
            1 => "<s>".to_string(),
            2 => "</s>".to_string(),
            _ => format!("w{i}"),
        };
        v.insert(t, i.into());
    }
    let special = |id: usize, c: &str| serde_json::json!({"id": id, "content": c, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": v, "unk_token": "<unk>"}
    });
    let p = dir.join("tokenizer.json");
    std::fs::write(&p, tok.to_string()).map_err(|e| Error::io(&p, e))?;
    let cfg = serde_json::json!({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"});
    let p = dir.join("tokenizer_config.json");
    std::fs::write(&p, cfg.to_string()).map_err(|e| Error::io(&p, e))
}

/// Write an HF `datasets` save_to_disk folder (one Arrow IPC stream shard + state.json) with
/// columns `input_ids` list<int32> and `labels` list<int64>.
pub fn write_tokenized_dataset(dir: &Path, rows: &[(Vec<i32>, Vec<i64>)]) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let mut ids = ListBuilder::new(Int32Builder::new());
    let mut labels = ListBuilder::new(Int64Builder::new());
    for (i, l) in rows {
        ids.values().append_slice(i);
        ids.append(true);
        labels.values().append_slice(l);
        labels.append(true);
    }
    let cols: Vec<(&str, ArrayRef)> = vec![("input_ids", Arc::new(ids.finish())), ("labels", Arc::new(labels.finish()))];
    let batch = RecordBatch::try_from_iter(cols).map_err(|e| Error::data(dir, e.to_string()))?;
    write_arrow_stream(&dir.join("data-00000-of-00001.arrow"), &[batch])?;
    let state = serde_json::json!({
        "_data_files": [{"filename": "data-00000-of-00001.arrow"}],
        "_fingerprint": "synthetic", "_format_columns": null, "_format_kwargs": {},
        "_format_type": null, "_output_all_columns": false, "_split": null
    });
    let p = dir.join("state.json");
    std::fs::write(&p, state.to_string()).map_err(|e| Error::io(&p, e))
}

/// Write record batches as an Arrow IPC stream file (what `datasets` writes).
pub fn write_arrow_stream(path: &Path, batches: &[RecordBatch]) -> Result<()> {
    let schema = batches.first().map(|b| b.schema()).ok_or_else(|| Error::data(path, "no batches to write"))?;
    let f = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
    let mut w = arrow_ipc::writer::StreamWriter::try_new(f, &schema).map_err(|e| Error::data(path, e.to_string()))?;
    for b in batches {
        w.write(b).map_err(|e| Error::data(path, e.to_string()))?;
    }
    w.finish().map_err(|e| Error::data(path, e.to_string()))
}

/// A learnable toy task: each row counts up by a row-specific stride modulo the vocabulary,
/// with the first few tokens as an (unlabelled) prompt. A model that learns the rule drives
/// the loss well below ln(vocab).
pub fn counting_rows(n: usize, vocab: usize, seed: u64, min_len: usize, max_len: usize) -> Vec<(Vec<i32>, Vec<i64>)> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|_| {
            let len = min_len + rng.below((max_len - min_len + 1) as u64) as usize;
            let start = rng.below(vocab as u64) as i64;
            let stride = 1 + rng.below(3) as i64;
            let ids: Vec<i32> = (0..len as i64).map(|t| ((start + stride * t) % vocab as i64) as i32).collect();
            let prompt = 2.min(len);
            let labels = ids.iter().enumerate().map(|(t, &x)| if t < prompt { -100 } else { x as i64 }).collect();
            (ids, labels)
        })
        .collect()
}

/// Write a random model of `shape` straight to a llama.cpp GGUF file with its matrices in
/// `dtype` (a row length that does not split into `dtype`'s blocks takes the fallback
/// `model.quantize` takes, see `weights::quantized::quantized_format`), norms in F32, q/k
/// rows permuted as llama.cpp's converter does. One tensor is generated in f32 at a time:
/// a 7B model is written holding its quantized bytes only. No tokenizer (the synthetic
/// datasets are tokenized).
pub fn write_gguf_model(path: &Path, shape: &TinyShape, seed: u64, dtype: candle_core::quantized::GgmlDType) -> Result<()> {
    use candle_core::quantized::gguf_file::Value;
    use candle_core::quantized::{GgmlDType, QTensor};
    if shape.arch != "LlamaForCausalLM" {
        return Err(Error::Train("synth --gguf writes llama models only".into()));
    }
    let head_dim = shape.hidden / shape.heads;
    let (h, q, kv, i) = (shape.hidden, shape.heads * head_dim, shape.kv_heads * head_dim, shape.inter);
    let mut specs: Vec<(String, Vec<usize>, f64, f64)> = vec![("token_embd.weight".into(), vec![shape.vocab, h], 0.0, shape.init_std)];
    for l in 0..shape.layers {
        for (m, o, inp) in [("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h), ("attn_output", h, q), ("ffn_gate", i, h), ("ffn_up", i, h), ("ffn_down", h, i)] {
            specs.push((format!("blk.{l}.{m}.weight"), vec![o, inp], 0.0, shape.init_std));
        }
        specs.push((format!("blk.{l}.attn_norm.weight"), vec![h], 1.0, 0.1));
        specs.push((format!("blk.{l}.ffn_norm.weight"), vec![h], 1.0, 0.1));
    }
    specs.push(("output_norm.weight".into(), vec![h], 1.0, 0.1));
    if !shape.tie {
        specs.push(("output.weight".into(), vec![shape.vocab, h], 0.0, shape.init_std));
    }
    let mut rng = Rng::new(seed);
    let mut qs: Vec<(String, QTensor)> = Vec::with_capacity(specs.len());
    for (name, dims, mean, std) in specs {
        let n = dims.iter().product();
        let mut t = Tensor::from_vec(normal(&mut rng, n, mean, std), dims.as_slice(), &Device::Cpu)?;
        if name.ends_with("attn_q.weight") {
            t = crate::gguf::permute(&t, shape.heads)?;
        } else if name.ends_with("attn_k.weight") {
            t = crate::gguf::permute(&t, shape.kv_heads)?;
        }
        let d = crate::weights::quantized::quantized_format(dtype, &name, &dims).unwrap_or(GgmlDType::F32);
        qs.push((name, QTensor::quantize(&t, d)?));
    }
    let u = |x: usize| Value::U32(x as u32);
    let md: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("llama".into())),
        ("general.name", Value::String("finetune synth".into())),
        ("llama.block_count", u(shape.layers)),
        ("llama.context_length", u(4096)),
        ("llama.embedding_length", u(h)),
        ("llama.feed_forward_length", u(i)),
        ("llama.attention.head_count", u(shape.heads)),
        ("llama.attention.head_count_kv", u(shape.kv_heads)),
        ("llama.rope.dimension_count", u(head_dim)),
        ("llama.rope.freq_base", Value::F32(10000.0)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
    ];
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = qs.iter().map(|(k, v)| (k.as_str(), v)).collect();
    crate::fsutil::write_with(path, |f| candle_core::quantized::gguf_file::write(f, &md_refs, &t_refs).map_err(|e| crate::fsutil::candle_write_error(path, e)))
}
