//! A quantized frozen base (QLoRA): training straight from a GGUF file, and `model.quantize`
//! on a safetensors base. What must hold: the result equals training on the dequantised
//! base (the model code cannot tell), the blocks stay quantized in memory (the memory
//! account books the file's bytes as the frozen base), and misuse is refused by key.

mod common;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use common::gguf::*;
use common::*;
use finetune::synth::{counting_rows, write_model, write_tokenized_dataset, TinyShape};
use std::path::Path;

const RECIPE: &str = r#"
[model]
path = "MODEL"
dtype = "f32"
[lora]
rank = 4
alpha = 8
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
[data]
train = "data"
format = "tokenized"
shuffle = false
[train]
micro_batch_size = 2
grad_accum_steps = 2
max_steps = 3
lr = 0.01
[output]
dir = "out"
"#;

/// A temp folder with `hf/` (a tiny random model of `shape`), `model.gguf` (it in `dtype`,
/// llama.cpp's layout), `imported/` (that file dequantised by `finetune import`) and data.
fn workspace(shape: &TinyShape, dtype: GgmlDType) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    write_model(&d.path().join("hf"), shape, 5, 1).unwrap();
    write_gguf(&d.path().join("hf"), shape, dtype, &d.path().join("model.gguf"));
    finetune::gguf::import(&d.path().join("model.gguf"), &d.path().join("imported"), Some(candle_core::DType::F32), u64::MAX).unwrap();
    write_tokenized_dataset(&d.path().join("data"), &counting_rows(16, shape.vocab, 3, 6, 20)).unwrap();
    d
}

/// Train `model` (a path relative to `root`) with `extra` overrides; the run's summary.
fn train(root: &Path, name: &str, model: &str, extra: &[&str]) -> finetune::train::RunSummary {
    let dir = run_dir(root, name, &RECIPE.replace("MODEL", &format!("../{model}")));
    std::fs::create_dir_all(dir.join("data")).unwrap();
    copy_dir(&root.join("data"), &dir.join("data"));
    let o: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    let loaded = finetune::recipe::LoadedRecipe::load(&dir.join("recipe.toml"), &o).unwrap();
    finetune::train::run(&loaded).unwrap()
}

fn losses(root: &Path, name: &str) -> Vec<f64> {
    read_metrics(&root.join(name).join("out/metrics.jsonl")).iter().map(|m| m["loss"].as_f64().unwrap()).collect()
}

fn cache_env(_root: &Path) {
    test_cache();
}

#[test]
fn training_on_a_gguf_equals_training_on_its_dequantised_import() {
    for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_0] {
        let d = workspace(&shape(), dtype);
        cache_env(d.path());
        train(d.path(), "gguf", "model.gguf", &[]);
        train(d.path(), "imported", "imported", &[]);
        let (a, b) = (losses(d.path(), "gguf"), losses(d.path(), "imported"));
        assert_eq!(a.len(), 3);
        assert_eq!(a, b, "{dtype:?}: the GGUF base must train exactly as its dequantised import");
        // The adapters too, bit for bit.
        let ta = load_tensors(&d.path().join("gguf/out/adapter/adapter_model.safetensors"));
        let tb = load_tensors(&d.path().join("imported/out/adapter/adapter_model.safetensors"));
        for (k, t) in &ta {
            assert_eq!(max_abs_diff(t, &tb[k]), 0.0, "{k}");
        }
    }
}

#[test]
fn a_qwen2_gguf_with_biases_and_tied_embeddings_trains_as_its_import() {
    let s = TinyShape { arch: "Qwen2ForCausalLM", tie: true, ..shape() };
    let d = workspace(&s, GgmlDType::Q8_0);
    cache_env(d.path());
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(d.path().join("imported/config.json")).unwrap()).unwrap();
    assert_eq!((cfg["model_type"].as_str(), cfg["tie_word_embeddings"].as_bool()), (Some("qwen2"), Some(true)));
    // The import itself equals the original up to Q8_0 rounding: nothing was permuted.
    let (orig, got) = (load_tensors(&d.path().join("hf/model.safetensors")), load_tensors(&d.path().join("imported/model.safetensors")));
    let q = &orig["model.layers.1.self_attn.q_proj.weight"];
    assert!(max_abs_diff(q, &got["model.layers.1.self_attn.q_proj.weight"]) < 0.01 * q.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap());
    assert_eq!(max_abs_diff(&orig["model.layers.0.self_attn.k_proj.bias"], &got["model.layers.0.self_attn.k_proj.bias"]), 0.0);
    train(d.path(), "gguf", "model.gguf", &[]);
    train(d.path(), "imported", "imported", &[]);
    assert_eq!(losses(d.path(), "gguf"), losses(d.path(), "imported"));
}

#[test]
fn a_gguf_base_is_held_as_its_quantized_bytes_plus_one_dequantised_layer() {
    let s = TinyShape { layers: 4, ..shape() };
    let d = workspace(&s, GgmlDType::Q4_0);
    cache_env(d.path());
    let summary = train(d.path(), "gguf", "model.gguf", &[]);
    let m = &summary.memory[0];
    let g = finetune::gguf::open(&d.path().join("model.gguf")).unwrap();
    let file_bytes: u64 = g.bytes_by_type().values().sum();
    assert_eq!(m.frozen as u64, file_bytes, "the frozen base held is the file's tensor bytes");
    // The window: one layer, or the embedding table (the tied head is the largest unit).
    let layer_f32 = 4 * (2 * s.hidden * s.hidden + 2 * s.hidden * (s.hidden / s.heads * s.kv_heads) + 3 * s.hidden * s.inter + 2 * s.hidden);
    let head_f32 = 4 * s.vocab * s.hidden;
    assert!(m.gathered_peak <= layer_f32.max(head_f32), "{} > {}", m.gathered_peak, layer_f32.max(head_f32));
    assert!(m.gathered_peak >= layer_f32.min(head_f32), "{} dequantised bytes at most: no layer was ever held whole?", m.gathered_peak);
    // `finetune plan` predicts both from the header alone.
    let loaded = finetune::recipe::LoadedRecipe::load(&d.path().join("gguf/recipe.toml"), &[]).unwrap();
    let cfg = finetune::weights::ModelDir::config_for_plan(&loaded).unwrap();
    let q = finetune::weights::quantized::plan_base(&loaded, &cfg).unwrap().expect("a quantized base");
    let p = finetune::dist::plan::plan_with(&cfg, &loaded.recipe, 1, false, Some(&q), &[]);
    assert_eq!((p.frozen, p.gathered_peak), (m.frozen, m.gathered_peak));
    assert!(finetune::dist::plan::render(&cfg, &loaded.recipe, &[p], false).contains("GGUF blocks (Q4_0"));
}

/// Trains `hf` with `model.quantize = quantize` and a copy of it whose tensors were passed
/// through `roundtrip` (quantised and dequantised) beforehand: the losses must be equal, the
/// frozen bytes below `frozen_ratio` of the f32 base, and the plan must count them exactly.
fn quantize_on_load_matches(quantize: &str, roundtrip: impl Fn(&str, &candle_core::Tensor) -> candle_core::Tensor, frozen_ratio: f64) {
    let d = workspace(&shape(), GgmlDType::F32);
    cache_env(d.path());
    let src = load_tensors(&d.path().join("hf/model.safetensors"));
    let deq: Vec<(String, candle_core::Tensor)> = src.iter().map(|(k, t)| (k.clone(), roundtrip(k, t))).collect();
    std::fs::create_dir_all(d.path().join("deq")).unwrap();
    finetune::gguf::write_weights(&d.path().join("deq"), &deq, u64::MAX).unwrap();
    std::fs::copy(d.path().join("hf/config.json"), d.path().join("deq/config.json")).unwrap();
    let set = format!("model.quantize={quantize}");
    let summary = train(d.path(), "q", "hf", &[&set]);
    train(d.path(), "deq", "deq", &[]);
    assert_eq!(losses(d.path(), "q"), losses(d.path(), "deq"));
    let f32_bytes: usize = src.values().map(|t| t.elem_count() * 4).sum();
    let m = &summary.memory[0];
    assert!((m.frozen as f64) < frozen_ratio * f32_bytes as f64, "{} of {f32_bytes}", m.frozen);
    let loaded = finetune::recipe::LoadedRecipe::load(&d.path().join("q/recipe.toml"), &[set]).unwrap();
    let cfg = finetune::weights::ModelDir::config_for_plan(&loaded).unwrap();
    let q = finetune::weights::quantized::plan_base(&loaded, &cfg).unwrap().expect("a quantized base");
    assert_eq!(finetune::dist::plan::plan_with(&cfg, &loaded.recipe, 1, false, Some(&q), &[]).frozen, m.frozen);
}

#[test]
fn quantize_on_load_equals_training_on_the_base_quantised_and_dequantised_beforehand() {
    // Q8_0 holds 34 bytes per 32 weights for every matrix.
    quantize_on_load_matches(
        "q8_0",
        |k, t| match t.rank() == 2 && !k.contains("norm") {
            true => QTensor::quantize(t, GgmlDType::Q8_0).unwrap().dequantize(&Device::Cpu).unwrap(),
            false => t.clone(),
        },
        0.3,
    );
}

#[test]
fn nf4_quantize_on_load_equals_training_on_the_base_quantised_and_dequantised_beforehand() {
    // NF4 as transformers' BitsAndBytesConfig applies it: the decoder's linear layers only
    // (embeddings and the head stay, so the ratio is higher than q8_0's at this tiny size).
    use finetune::weights::{bnb::Bnb4, quantized::nf4_quantizes};
    quantize_on_load_matches(
        "nf4",
        |k, t| match nf4_quantizes(k, t.dims()) {
            true => Bnb4::quantize_nf4(t).unwrap().dequantize(&Device::Cpu).unwrap(),
            false => t.clone(),
        },
        0.75,
    );
}

#[test]
fn nf4_quantisation_equals_bitsandbytes_bit_for_bit() {
    // tests/fixtures/nf4-quantize: bitsandbytes 0.50.2's quantize_4bit / dequantize_4bit on
    // gaussian, odd-sized, zero-tailed and crafted tie-breaking inputs (README there).
    let fx = load_tensors(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/nf4-quantize/cases.safetensors"));
    let bits = |t: &candle_core::Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let cases = ["f32_64x128", "f32_40x50", "bf16_32x64", "f32_3x7", "f32_2x40_zero_tail", "crafted_7x50"];
    for c in cases {
        let q = finetune::weights::bnb::Bnb4::quantize_nf4(&fx[&format!("{c}.input")]).unwrap();
        let (codes, absmax) = q.nf4_parts().unwrap();
        assert_eq!(codes, fx[&format!("{c}.codes")].to_vec1::<u8>().unwrap().as_slice(), "{c}: codes");
        assert_eq!(absmax.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), bits(&fx[&format!("{c}.absmax")]), "{c}: absmax");
        let deq = q.dequantize(&Device::Cpu).unwrap();
        assert_eq!(deq.dims(), fx[&format!("{c}.input")].dims(), "{c}");
        // A bf16 weight dequantises as `dequantize_4bit(q, state)` returns it to Linear4bit:
        // in bf16, the f32 product rounded (`dequant_native`), not the f32 output `dequant` holds.
        let want = match fx.get(&format!("{c}.dequant_native")) {
            Some(native) => native.to_dtype(candle_core::DType::F32).unwrap(),
            None => fx[&format!("{c}.dequant")].clone(),
        };
        assert_eq!(bits(&deq), bits(&want), "{c}: dequantised");
    }
    let inf = candle_core::Tensor::new(&[1f32, f32::INFINITY], &Device::Cpu).unwrap();
    let e = finetune::weights::bnb::Bnb4::quantize_nf4(&inf).err().expect("refused").to_string();
    assert!(e.contains("element 1") && e.contains("finite"), "{e}");
}

#[test]
fn a_quantized_base_refuses_quantize_twice_and_names_the_key() {
    let d = workspace(&shape(), GgmlDType::Q8_0);
    cache_env(d.path());
    let dir = run_dir(d.path(), "both", &RECIPE.replace("MODEL", "../model.gguf"));
    copy_dir(&d.path().join("data"), &dir.join("data"));
    let loaded = finetune::recipe::LoadedRecipe::load(&dir.join("recipe.toml"), &["model.quantize=q4_k".to_string()]).unwrap();
    let e = finetune::train::run(&loaded).expect_err("refused").to_string();
    assert!(e.contains("model.quantize") && e.contains("GGUF"), "{e}");
    assert!(!dir.join("out").exists(), "nothing written");
    let bad = finetune::recipe::LoadedRecipe::load(&dir.join("recipe.toml"), &["model.quantize=q3".to_string()]).expect_err("refused").to_string();
    assert!(bad.contains("model.quantize"), "{bad}");
}

#[test]
fn a_gguf_base_merges_and_generates_as_its_import() {
    let d = workspace(&shape(), GgmlDType::Q8_0);
    cache_env(d.path());
    train(d.path(), "gguf", "model.gguf", &[]);
    let adapter = finetune::export::PeftAdapter::open(&d.path().join("gguf/out/adapter")).unwrap();
    let opts = finetune::export::ExportOptions { merge: true, ..Default::default() };
    let gguf = finetune::weights::ModelDir::resolve("model.gguf", d.path()).unwrap();
    assert!(gguf.gguf.is_some());
    let imported = finetune::weights::ModelDir::resolve("imported", d.path()).unwrap();
    finetune::export::merge(&gguf, &adapter, &d.path().join("m-gguf"), &opts).unwrap();
    finetune::export::merge(&imported, &adapter, &d.path().join("m-imported"), &opts).unwrap();
    let (a, b) = (load_tensors(&d.path().join("m-gguf/model.safetensors")), load_tensors(&d.path().join("m-imported/model.safetensors")));
    assert_eq!(a.len(), b.len());
    for (k, t) in &a {
        assert_eq!(max_abs_diff(t, &b[k]), 0.0, "{k}");
    }
    assert!(!std::fs::read_dir(d.path()).unwrap().any(|e| e.unwrap().file_name().to_string_lossy().contains("dequantised")), "the dequantised copy is removed");
    // Generation from the GGUF with the adapter: the logits of its import.
    let ids = candle_core::Tensor::new(&[[3u32, 17, 40, 99, 5]], &Device::Cpu).unwrap();
    let logits = |m: &finetune::weights::ModelDir| {
        let g = finetune::generate::Generator::load(m, Some(&d.path().join("gguf/out/adapter"))).unwrap();
        g.model.logits(&ids, &g.adapters).unwrap()
    };
    assert_eq!(max_abs_diff(&logits(&gguf), &logits(&imported)), 0.0);
}

/// A GGUF of F16 (or BF16) matrices merges, and imports, in that dtype by default: every
/// value fits, and f32 doubled the output. Quantized blocks stay f32 (Q8_0 above and here).
/// The merged weights are the f32 sum rounded once, as from the imported folder.
#[test]
fn a_16_bit_gguf_merges_and_imports_in_its_own_dtype() {
    use candle_core::DType;
    for (ggml, want) in [(GgmlDType::F16, DType::F16), (GgmlDType::BF16, DType::BF16), (GgmlDType::Q8_0, DType::F32)] {
        let d = workspace(&shape(), ggml);
        cache_env(d.path());
        let file = d.path().join("model.gguf");
        assert_eq!(finetune::gguf::open(&file).unwrap().weights_dtype(), want, "{ggml:?}");
        train(d.path(), "gguf", "model.gguf", &[]);
        let adapter = finetune::export::PeftAdapter::open(&d.path().join("gguf/out/adapter")).unwrap();
        let gguf = finetune::weights::ModelDir::resolve("model.gguf", d.path()).unwrap();
        let out = d.path().join("merged");
        finetune::export::merge(&gguf, &adapter, &out, &finetune::export::ExportOptions { merge: true, ..Default::default() }).unwrap();
        let merged = load_tensors(&out.join("model.safetensors"));
        assert!(merged.values().all(|t| t.dtype() == want), "{ggml:?}: {:?}", merged.iter().map(|(k, t)| (k, t.dtype())).collect::<Vec<_>>());
        let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(cfg["torch_dtype"], finetune::weights::torch_dtype_name(want));
        // The same as merging the import of the file in that dtype (import's default).
        let imported = d.path().join("imported-own");
        assert_eq!(finetune::gguf::import(&file, &imported, None, u64::MAX).unwrap().dtype, want, "{ggml:?}");
        let from_import = d.path().join("merged-import");
        let base = finetune::weights::ModelDir::resolve("imported-own", d.path()).unwrap();
        finetune::export::merge(&base, &adapter, &from_import, &finetune::export::ExportOptions { merge: true, ..Default::default() }).unwrap();
        let b = load_tensors(&from_import.join("model.safetensors"));
        for (k, t) in &merged {
            assert_eq!(max_abs_diff(&t.to_dtype(DType::F32).unwrap(), &b[k].to_dtype(DType::F32).unwrap()), 0.0, "{ggml:?} {k}");
        }
        // The matrices' values fit: the import equals the file's. (The norms, F32 in every
        // GGUF, come from the model's dtype in a real conversion; these random ones round.)
        let imported = load_tensors(&imported.join("model.safetensors"));
        let f32_import = load_tensors(&d.path().join("imported/model.safetensors"));
        for (k, t) in imported.iter().filter(|(_, t)| t.rank() == 2) {
            assert_eq!(max_abs_diff(&t.to_dtype(DType::F32).unwrap(), &f32_import[k]), 0.0, "{ggml:?} {k}");
        }
    }
}

#[test]
fn a_bitsandbytes_base_merges_into_its_dequantised_weights() {
    let fx = fixture("parity-bnb-nf4");
    let d = tempfile::tempdir().unwrap();
    let adapter = finetune::export::PeftAdapter::open(&fx.join("init")).unwrap();
    let base = finetune::weights::ModelDir::resolve(fx.join("model").to_str().unwrap(), Path::new(".")).unwrap();
    let opts = finetune::export::ExportOptions { merge: true, ..Default::default() };
    finetune::export::merge(&base, &adapter, &d.path().join("merged"), &opts).unwrap();
    let merged = load_tensors(&d.path().join("merged/model.safetensors"));
    let deq = load_tensors(&fx.join("expected/dequantized_sample.safetensors"));
    let init = load_tensors(&fx.join("init/adapter_model.safetensors"));
    let key = "model.layers.0.self_attn.q_proj";
    let a = &init[&format!("base_model.model.{key}.lora_A.weight")];
    let b = &init[&format!("base_model.model.{key}.lora_B.weight")];
    let want = (&deq[&format!("{key}.weight")] + (b.matmul(a).unwrap() * adapter.spec.scale()).unwrap()).unwrap();
    assert!(max_abs_diff(&merged[&format!("{key}.weight")], &want) < 1e-6);
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(d.path().join("merged/config.json")).unwrap()).unwrap();
    assert!(cfg.get("quantization_config").is_none(), "the merged model is not quantized");
    // Exactly the model's tensors: no quantisation state (absmax, quant maps, nested maps).
    let sums: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fx.join("expected/dequantized_sums.json")).unwrap()).unwrap();
    let mut want: Vec<&String> = sums["tensors"].as_object().unwrap().keys().collect();
    let mut got: Vec<&String> = merged.keys().collect();
    want.sort();
    got.sort();
    assert_eq!(got, want);
    assert_eq!(cfg["torch_dtype"], "float32", "the dequantised weights are f32");

    // transformers 5's layout names the dtype `dtype` (and prefers it): it must say f32 too,
    // or a loader with dtype="auto" rounds the merged weights to what the base config said.
    let v5 = d.path().join("v5");
    copy_dir(&fx.join("model"), &v5);
    let cp = v5.join("config.json");
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cp).unwrap()).unwrap();
    c.as_object_mut().unwrap().remove("torch_dtype");
    c["dtype"] = "bfloat16".into();
    std::fs::write(&cp, c.to_string()).unwrap();
    let base = finetune::weights::ModelDir::resolve(v5.to_str().unwrap(), Path::new(".")).unwrap();
    finetune::export::merge(&base, &adapter, &d.path().join("merged-v5"), &opts).unwrap();
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(d.path().join("merged-v5/config.json")).unwrap()).unwrap();
    assert_eq!((&cfg["dtype"], &cfg["torch_dtype"]), (&"float32".into(), &"float32".into()), "{cfg}");
}

/// The NF4 fixture's model at `dst` as if quantised from bf16: its quant_states say bfloat16
/// (so its 4-bit weights dequantise to bf16 values) and its other tensors are bf16.
fn bnb_quantised_from_bf16(dst: &Path) {
    use candle_core::DType;
    copy_dir(&fixture("parity-bnb-nf4").join("model"), dst);
    let st = dst.join("model.safetensors");
    let mut tensors = load_tensors(&st);
    for (name, t) in tensors.iter_mut() {
        if name.contains(".quant_state.") {
            let json = String::from_utf8(t.to_vec1::<u8>().unwrap()).unwrap();
            let json = json.replace(r#""dtype": "float32""#, r#""dtype": "bfloat16""#);
            *t = candle_core::Tensor::new(json.as_bytes(), &Device::Cpu).unwrap();
        } else if !finetune::weights::bnb::is_quant_state(name) && t.dtype() == DType::F32 {
            *t = t.to_dtype(DType::BF16).unwrap();
        }
    }
    candle_core::safetensors::save(&tensors, &st).unwrap();
}

/// model.dtype = "auto" on a CPU with a bf16 unit runs the base in bf16, and says so where
/// that rounds its weights: a bitsandbytes checkpoint quantised from f32, a GGUF of F16
/// matrices; not one quantised from bf16 (its quantisation state is f32, its weights are not:
/// it was said to round "f32 weights"). Without a bf16 unit "auto" is f32: no note at all.
#[test]
fn auto_dtype_says_it_rounds_only_a_base_not_already_bf16() {
    let unit = finetune::ops::bf16_gemm::available();
    let fx = fixture("parity-bnb-nf4");
    let g = workspace(&shape(), GgmlDType::F16);
    cache_env(g.path());
    bnb_quantised_from_bf16(&g.path().join("bnb-bf16"));
    let cases = [
        ("bnb-f32", fx.join("model"), fx.join("data"), Some("the checkpoint's f32 weights")),
        ("bnb-from-bf16", g.path().join("bnb-bf16"), fx.join("data"), None),
        ("gguf-f16", g.path().join("model.gguf"), g.path().join("data"), Some("the GGUF's f16 weights")),
    ];
    for (name, model, data, rounds) in cases {
        let recipe = format!("[model]\npath = {model:?}\n[lora]\nrank = 2\nalpha = 4\n[data]\ntrain = {data:?}\nformat = \"tokenized\"\n[train]\nmax_steps = 1\nlr = 1e-3\n[output]\ndir = \"out\"\n");
        let out = spawn(&run_dir(g.path(), name, &recipe), &[]).wait_with_output().unwrap();
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{name}: {said}");
        match rounds.filter(|_| unit) {
            Some(w) => assert!(said.contains(&format!("{w} are rounded to bf16")), "{name}: {said}"),
            None => assert!(!said.contains("rounded to bf16"), "{name}: {said}"),
        }
    }
}

/// A checkpoint quantised from bf16 (its quant_states say so; its other tensors are bf16)
/// merges to bf16 unless --dtype says otherwise, as "the base's dtype" promises: its 4-bit
/// weights dequantise exactly to bf16, and f32 doubled the output. Each merged weight is the
/// bf16 dequantisation plus the adapter's delta, rounded once.
#[test]
fn a_bitsandbytes_base_quantised_from_bf16_merges_to_bf16() {
    use candle_core::DType;
    let fx = fixture("parity-bnb-nf4");
    let d = tempfile::tempdir().unwrap();
    let bf16 = d.path().join("bf16");
    bnb_quantised_from_bf16(&bf16);
    let adapter = finetune::export::PeftAdapter::open(&fx.join("init")).unwrap();
    let base = finetune::weights::ModelDir::resolve(bf16.to_str().unwrap(), Path::new(".")).unwrap();
    let out = d.path().join("merged");
    finetune::export::merge(&base, &adapter, &out, &finetune::export::ExportOptions { merge: true, ..Default::default() }).unwrap();
    let merged = load_tensors(&out.join("model.safetensors"));
    let not_bf16: Vec<&String> = merged.iter().filter(|(_, t)| t.dtype() != DType::BF16).map(|(k, _)| k).collect();
    assert!(not_bf16.is_empty(), "not bf16: {not_bf16:?}");
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["torch_dtype"], "bfloat16");
    let deq = load_tensors(&fx.join("expected/dequantized_sample.safetensors"));
    let init = load_tensors(&fx.join("init/adapter_model.safetensors"));
    let key = "model.layers.0.self_attn.q_proj";
    let a = &init[&format!("base_model.model.{key}.lora_A.weight")];
    let b = &init[&format!("base_model.model.{key}.lora_B.weight")];
    let w = deq[&format!("{key}.weight")].to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
    let want = (w + (b.matmul(a).unwrap() * adapter.spec.scale()).unwrap()).unwrap().to_dtype(DType::BF16).unwrap();
    let got = &merged[&format!("{key}.weight")];
    assert_eq!(max_abs_diff(&got.to_dtype(DType::F32).unwrap(), &want.to_dtype(DType::F32).unwrap()), 0.0);
    // --dtype still decides.
    let out32 = d.path().join("merged-f32");
    finetune::export::merge(&base, &adapter, &out32, &finetune::export::ExportOptions { merge: true, dtype: Some(DType::F32), ..Default::default() }).unwrap();
    assert!(load_tensors(&out32.join("model.safetensors")).values().all(|t| t.dtype() == DType::F32));
}

// ---------------------------------------------------------------------------------------
// DeepSeek-V2/V3 GGUFs as llama.cpp's own converter writes them (`fixtures/gguf-deepseek`,
// `make.py` beside them): experts stacked per layer, kv_b_proj split into attn_k_b/attn_v_b.

/// (version, the q projections the version has).
const DEEPSEEK_GGUFS: [(&str, &str); 2] = [("v2", r#""q_proj""#), ("v3", r#""q_a_proj", "q_b_proj""#)];

#[test]
fn a_deepseek2_gguf_from_llama_cpps_converter_trains_exactly_as_its_hf_checkpoint() {
    test_cache();
    for (v, q) in DEEPSEEK_GGUFS {
        let fx = fixture("gguf-deepseek");
        let d = tempfile::tempdir().unwrap();
        copy_dir(&fx.join(format!("hf-{v}")), &d.path().join("hf"));
        std::fs::copy(fx.join(format!("model-{v}-f32.gguf")), d.path().join("model.gguf")).unwrap();
        let vocab = finetune::gguf::open(&d.path().join("model.gguf")).unwrap().config["vocab_size"].as_u64().unwrap() as usize;
        write_tokenized_dataset(&d.path().join("data"), &counting_rows(16, vocab, 3, 6, 20)).unwrap();
        let targets = format!(r#"lora.targets=[{q}, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]"#);
        let extra = [targets.as_str(), "lora.routed_experts=true"];
        train(d.path(), "gguf", "model.gguf", &extra);
        train(d.path(), "hf", "hf", &extra);
        let (a, b) = (losses(d.path(), "gguf"), losses(d.path(), "hf"));
        assert_eq!(a.len(), 3);
        assert_eq!(a, b, "{v}: the GGUF must train exactly as the checkpoint it was converted from");
        let ta = load_tensors(&d.path().join("gguf/out/adapter/adapter_model.safetensors"));
        let tb = load_tensors(&d.path().join("hf/out/adapter/adapter_model.safetensors"));
        assert_eq!(ta.len(), tb.len());
        assert!(ta.keys().any(|k| k.contains(".mlp.experts.")), "{v}: routed experts adapted");
        for (k, t) in &ta {
            assert_eq!(max_abs_diff(t, &tb[k]), 0.0, "{v}: {k}");
        }
    }
}

/// Every HF tensor of a Q8_0 deepseek2 GGUF, read as a quantized base reads it (an expert cut
/// out of its stacked blocks, kv_b_proj joined from attn_k_b and attn_v_b), equals gguf-py's
/// dequantisation mapped back to HF by the fixture script's own inverse of the converter.
#[test]
fn deepseek2_gguf_tensors_equal_gguf_pys_dequantisation_mapped_back_to_hf() {
    for (v, _) in DEEPSEEK_GGUFS {
        let fx = fixture("gguf-deepseek");
        let want = load_tensors(&fx.join(format!("dequant-{v}-q8_0.safetensors")));
        let mut g = finetune::gguf::open(&fx.join(format!("model-{v}-q8_0.gguf"))).unwrap();
        let names = g.hf_names();
        let mut sorted: Vec<&String> = want.keys().collect();
        sorted.sort();
        assert_eq!(names.iter().collect::<Vec<_>>(), sorted, "{v}: the HF tensors");
        let bytes = g.hf_bytes();
        for n in &names {
            let t = g.dequantize(n).unwrap();
            assert_eq!(t.dims(), want[n].dims(), "{v}: {n}");
            assert_eq!(max_abs_diff(&t, &want[n]), 0.0, "{v}: {n}");
            assert!(bytes[n] > 0, "{v}: {n}");
        }
        // The HF config the file describes is the one it was converted from, key by key.
        let hf: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fx.join(format!("hf-{v}/config.json"))).unwrap()).unwrap();
        let parse = |c: &serde_json::Value| finetune::config::ModelConfig::resolve(&serde_json::from_value(c.clone()).unwrap()).unwrap();
        let (ours, theirs) = (parse(&g.config), parse(&hf));
        assert_eq!(format!("{ours:?}"), format!("{theirs:?}"), "{v}: config");
    }
}

/// `logits` / `generate` / `eval` read a bitsandbytes base as training does (they refused its
/// U8 blocks as "not a float weight"): its logits equal those of its dequantised copy.
#[test]
fn a_bitsandbytes_base_runs_in_logits_as_its_dequantised_copy() {
    use finetune::weights::quantized::BlockReader;
    let d = tempfile::tempdir().unwrap();
    let bnb = fixture("parity-bnb-nf4").join("model");
    let dir = |p: &Path| finetune::weights::ModelDir { dir: p.to_path_buf(), name: String::new(), commit: None, gguf: None };
    let files = dir(&bnb).open_weights().unwrap();
    let names: Vec<String> = files.names().filter(|n| n.ends_with(".weight") && !n.contains(".quant_state.")).cloned().collect();
    let mut r = finetune::weights::bnb::BnbReader { files, storage: candle_core::DType::F32 };
    let tensors: Vec<(String, candle_core::Tensor)> =
        names.iter().map(|n| (n.clone(), r.read(n, &Device::Cpu).unwrap().dequantize(&Device::Cpu).unwrap())).collect();
    let plain = d.path().join("plain");
    std::fs::create_dir_all(&plain).unwrap();
    finetune::gguf::write_weights(&plain, &tensors, u64::MAX).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(bnb.join("config.json")).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("quantization_config");
    std::fs::write(plain.join("config.json"), cfg.to_string()).unwrap();
    let logits = |p: &Path| {
        let (m, a) = finetune::generate::Generator::load_model(&dir(p), None).unwrap();
        m.logits(&candle_core::Tensor::new(&[[1u32, 2, 3, 4]], &Device::Cpu).unwrap(), &a).unwrap()
    };
    assert_eq!(max_abs_diff(&logits(&bnb), &logits(&plain)), 0.0);
}

/// `fixture` (a deepseek2 GGUF) rewritten to `out` with `edit` applied to its metadata and
/// tensors.
fn edited_deepseek_gguf(fixture: &Path, out: &Path, edit: impl FnOnce(&mut Vec<(String, candle_core::quantized::gguf_file::Value)>, &mut Vec<(String, QTensor)>)) {
    use candle_core::quantized::gguf_file;
    let mut f = std::fs::File::open(fixture).unwrap();
    let c = gguf_file::Content::read(&mut f).unwrap();
    let mut md: Vec<(String, gguf_file::Value)> = c.metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    let mut ts: Vec<(String, QTensor)> = c.tensor_infos.keys().map(|n| (n.clone(), c.tensor(&mut f, n, &Device::Cpu).unwrap())).collect();
    edit(&mut md, &mut ts);
    let md_refs: Vec<(&str, &gguf_file::Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = ts.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut std::fs::File::create(out).unwrap(), &md_refs, &t_refs).unwrap();
}

/// What llama.cpp requires of a deepseek2 file is required here too, by name: a default would
/// train a different model (a missing expert_weights_scale read as 1 scaled V3's routed
/// experts by 1 instead of 2.5, with exit 0). Values llama.cpp accepts are accepted.
#[test]
fn deepseek2_gguf_metadata_llama_cpp_requires_is_required_by_name() {
    use candle_core::quantized::gguf_file::Value;
    let fx = fixture("gguf-deepseek").join("model-v3-q8_0.gguf");
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("m.gguf");
    let drop = |key: &'static str| move |md: &mut Vec<(String, Value)>, _: &mut Vec<(String, QTensor)>| md.retain(|(k, _)| k != key);
    let set = |key: &'static str, v: Value| move |md: &mut Vec<(String, Value)>, _: &mut Vec<(String, QTensor)>| md.iter_mut().filter(|(k, _)| k == key).for_each(|(_, x)| *x = v.clone());
    type Edit<'e> = &'e dyn Fn(&mut Vec<(String, Value)>, &mut Vec<(String, QTensor)>);
    let refused = |edit: Edit, key: &str, says: &str| {
        edited_deepseek_gguf(&fx, &p, |m, t| edit(m, t));
        let e = finetune::gguf::open(&p).err().unwrap_or_else(|| panic!("{key}: accepted")).to_string();
        assert!(e.contains(key) && e.contains(says), "{key}: {e}");
    };
    for key in ["deepseek2.expert_weights_scale", "deepseek2.expert_shared_count", "deepseek2.leading_dense_block_count"] {
        refused(&drop(key), key, "missing");
    }
    refused(&drop("deepseek2.expert_group_used_count"), "deepseek2.expert_group_used_count", "missing");
    refused(&drop("deepseek2.expert_gating_func"), "deepseek2.expert_gating_func", "exp_probs_b");
    refused(&set("deepseek2.vocab_size", Value::U32(300)), "deepseek2.vocab_size", "288 rows");
    // mscale_all_dim 0, as the converter writes it: accepted, as a missing key is.
    edited_deepseek_gguf(&fx, &p, set("deepseek2.rope.scaling.yarn_log_multiplier", Value::F32(0.0)));
    let zero = finetune::gguf::open(&p).unwrap().config["rope_scaling"]["mscale_all_dim"].clone();
    edited_deepseek_gguf(&fx, &p, drop("deepseek2.rope.scaling.yarn_log_multiplier"));
    assert_eq!(zero, finetune::gguf::open(&p).unwrap().config["rope_scaling"]["mscale_all_dim"]);
    // Q8_1 (an activation format candle cannot dequantise, as Q8_K) is refused with the header.
    edited_deepseek_gguf(&fx, &p, |_, ts| {
        let (_, t) = ts.iter_mut().find(|(n, _)| n == "blk.0.ffn_down.weight").unwrap();
        *t = QTensor::quantize(&t.dequantize(&Device::Cpu).unwrap(), GgmlDType::Q8_1).unwrap();
    });
    let e = finetune::gguf::open(&p).err().expect("Q8_1 accepted").to_string();
    assert!(e.contains("blk.0.ffn_down.weight") && e.contains("tensor type Q8_1 (9)"), "{e}");
    // V2 (softmax gating) with normalised weights: transformers and llama.cpp disagree there.
    let v2 = fixture("gguf-deepseek").join("model-v2-q8_0.gguf");
    edited_deepseek_gguf(&v2, &p, |md, _| {
        md.retain(|(k, _)| k != "deepseek2.expert_weights_norm");
        md.push(("deepseek2.expert_weights_norm".into(), Value::Bool(true)));
    });
    let e = finetune::gguf::open(&p).err().expect("normalised V2 weights accepted").to_string();
    assert!(e.contains("deepseek2.expert_weights_norm") && e.contains("softmax gating"), "{e}");
}
