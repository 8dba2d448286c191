//! Writing GGUF files as llama.cpp does, from an HF folder (for import tests and the fuzzer).
#![allow(dead_code)]

use super::load_tensors;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use finetune::gguf::permute;
use finetune::synth::TinyShape;
use std::collections::HashMap;
use std::path::Path;

/// GPT-2's byte -> printable-char table (byte-level BPE symbols).
pub fn byte_chars() -> Vec<char> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut table = vec![' '; 256];
    for (b, c) in bs.iter().zip(cs) {
        table[*b as usize] = char::from_u32(c).unwrap();
    }
    table
}

/// A byte-level vocabulary of `vocab` tokens: 256 bytes, a few merges, two special tokens.
pub fn tokenizer_metadata(vocab: usize) -> Vec<(String, Value)> {
    let mut tokens: Vec<String> = byte_chars().iter().map(|c| c.to_string()).collect();
    let merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or"];
    for m in merges {
        tokens.push(m.replace(' ', ""));
    }
    let mut types = vec![1i32; tokens.len()];
    for s in ["<|im_start|>", "<|im_end|>"] {
        tokens.push(s.into());
        types.push(3);
    }
    while tokens.len() < vocab {
        tokens.push(format!("[unused{}]", tokens.len()));
        types.push(1);
    }
    let strs = |v: Vec<String>| Value::Array(v.into_iter().map(Value::String).collect());
    vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.tokens".into(), strs(tokens)),
        ("tokenizer.ggml.merges".into(), strs(merges.iter().map(|s| s.to_string()).collect())),
        ("tokenizer.ggml.token_type".into(), Value::Array(types.into_iter().map(Value::I32).collect())),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(263)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(264)),
        ("tokenizer.chat_template".into(), Value::String("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}".into())),
    ]
}

/// A GGUF file's metadata (key, value) and tensors (name, tensor), in file order.
pub type GgufParts = (Vec<(String, Value)>, Vec<(String, QTensor)>);

/// The metadata and tensors of `model` (an HF folder) as llama.cpp writes them, with
/// matrices in `dtype`: what `write_gguf` writes, for tests that break one part first.
pub fn gguf_parts(model: &Path, shape: &TinyShape, dtype: GgmlDType) -> GgufParts {
    let hf = load_tensors(&model.join("model.safetensors"));
    // Qwen2: q/k/v biases, and llama.cpp leaves its q/k rows as they are (NEOX RoPE).
    let qwen = shape.arch == "Qwen2ForCausalLM";
    let arch = if qwen { "qwen2" } else { "llama" };
    let reverse: HashMap<String, String> = (0..shape.layers)
        .flat_map(|l| {
            [("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
             ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj"), ("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")]
                .into_iter()
                .map(move |(g, h)| (format!("model.layers.{l}.{h}.weight"), format!("blk.{l}.{g}.weight")))
                .chain(["q", "k", "v"].map(|x| (format!("model.layers.{l}.self_attn.{x}_proj.bias"), format!("blk.{l}.attn_{x}.bias"))))
        })
        .chain([("model.embed_tokens.weight", "token_embd.weight"), ("model.norm.weight", "output_norm.weight"), ("lm_head.weight", "output.weight")].map(|(a, b)| (a.to_string(), b.to_string())))
        .collect();
    let mut qs: Vec<(String, QTensor)> = Vec::new();
    for (name, t) in &hf {
        let g = reverse[name].clone();
        let mut t = t.clone();
        if qwen {
        } else if g.ends_with("attn_q.weight") {
            t = permute(&t, shape.heads).unwrap();
        } else if g.ends_with("attn_k.weight") {
            t = permute(&t, shape.kv_heads).unwrap();
        }
        let d = if t.rank() == 1 { GgmlDType::F32 } else { dtype };
        qs.push((g, QTensor::quantize(&t, d).unwrap()));
    }
    let head_dim = shape.hidden / shape.heads;
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (format!("{arch}.attention.head_count"), Value::U32(shape.heads as u32)),
        (format!("{arch}.attention.head_count_kv"), Value::U32(shape.kv_heads as u32)),
        (format!("{arch}.block_count"), Value::U32(shape.layers as u32)),
        (format!("{arch}.embedding_length"), Value::U32(shape.hidden as u32)),
        (format!("{arch}.feed_forward_length"), Value::U32(shape.inter as u32)),
        (format!("{arch}.rope.dimension_count"), Value::U32(head_dim as u32)),
        (format!("{arch}.attention.layer_norm_rms_epsilon"), Value::F32(1e-6)),
        (format!("{arch}.rope.freq_base"), Value::F32(10000.0)),
        (format!("{arch}.context_length"), Value::U32(256)),
    ];
    md.extend(tokenizer_metadata(shape.vocab));
    (md, qs)
}

pub fn write_parts(md: &[(String, Value)], qs: &[(String, QTensor)], out: &Path) {
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = qs.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(out).unwrap();
    gguf_file::write(&mut f, &md_refs, &t_refs).unwrap();
}

/// Write `model` (an HF folder) as a llama.cpp-style GGUF with matrices in `dtype`.
pub fn write_gguf(model: &Path, shape: &TinyShape, dtype: GgmlDType, out: &Path) {
    let (md, qs) = gguf_parts(model, shape, dtype);
    write_parts(&md, &qs, out);
}

pub fn shape() -> TinyShape {
    TinyShape { vocab: 288, init_std: 0.2, ..Default::default() }
}

