//! DeepSeek-V2 / V3 beyond the parity fixtures: generation with a KV cache, merged export,
//! FP8 bases, routed-expert adapters, the plan for the real shapes, and bad checkpoints.
//! Parity with transformers + PEFT itself is in `parity.rs`.

mod common;
use candle_core::{DType, Device, Tensor};
use common::*;
use finetune::config::ModelConfig;
use finetune::lora::Adapters;
use finetune::model::{KvCache, Model};
use finetune::weights::{ModelDir, ResidentWeights};
use std::path::Path;
use std::sync::Arc;

const V2: &str = "parity-deepseek-v2";

fn load_model(dir: &Path, adapters: Option<&Adapters>) -> (Model, Adapters) {
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let md = ModelDir { dir: dir.to_path_buf(), name: String::new(), commit: None, gguf: None };
    let src = Arc::new(ResidentWeights::new(md.open_weights().unwrap(), DType::F32, DType::F32, Device::Cpu));
    let none = Adapters::none(&cfg).unwrap();
    let m = Model::load(src, cfg, adapters.unwrap_or(&none)).unwrap();
    (m, none)
}

/// The fixture's trained adapter (PEFT's own, from expected/).
fn trained_adapter(fixture_name: &str, cfg: &ModelConfig) -> Adapters {
    finetune::export::PeftAdapter::open(&fixture(fixture_name).join("expected/adapter")).unwrap().load(cfg).unwrap()
}

#[test]
fn cached_generation_steps_equal_the_full_forward_on_mla() {
    let dir = fixture(V2).join("model");
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let adapters = trained_adapter(V2, &cfg);
    let (m, _) = load_model(&dir, Some(&adapters));
    let ids: Vec<u32> = vec![5, 17, 3, 99, 150, 42, 7, 8, 190, 1];
    let full = m.logits(&Tensor::new(&ids[..], &Device::Cpu).unwrap().unsqueeze(0).unwrap(), &adapters).unwrap(); // [1, S, V]
    // Prefill 4 tokens, then one at a time: each step's logits equal the full forward's row.
    let mut caches: Vec<KvCache> = vec![None; cfg.num_hidden_layers];
    let mut worst = 0f32;
    let prefill = m.step(&Tensor::new(&ids[..4], &Device::Cpu).unwrap().unsqueeze(0).unwrap(), 0, &mut caches, &adapters).unwrap();
    worst = worst.max(max_abs_diff(&prefill, &full.get(0).unwrap().get(3).unwrap()));
    for t in 4..ids.len() {
        let l = m.step(&Tensor::new(&ids[t..t + 1], &Device::Cpu).unwrap().unsqueeze(0).unwrap(), t, &mut caches, &adapters).unwrap();
        worst = worst.max(max_abs_diff(&l, &full.get(0).unwrap().get(t).unwrap()));
    }
    println!("cached vs full logits: max abs diff {worst:.2e}");
    assert!(worst < 1e-4, "cached generation differs from the full forward by {worst}");
}

#[test]
fn a_gguf_adapter_of_a_deepseek_base_is_refused_as_an_export_error() {
    // llama.cpp adapters are written for llama and qwen2 bases; the refusal is export's (its
    // hint named --model, which export --run does not take).
    let base = ModelDir { dir: fixture(V2).join("model"), name: String::new(), commit: None, gguf: None };
    let adapter = finetune::export::PeftAdapter::open(&fixture(V2).join("expected/adapter")).unwrap();
    let out = tempfile::tempdir().unwrap();
    let e = finetune::export::gguf::export_gguf_adapter(&adapter, &base, &out.path().join("a.gguf"), None).unwrap_err();
    assert!(matches!(e, finetune::Error::Export(_)), "{e:?}");
    assert!(e.to_string().contains("model_type `deepseek_v2`") && e.to_string().contains("export the PEFT adapter instead"), "{e}");
    assert!(!out.path().join("a.gguf").exists());
}

#[test]
fn merged_deepseek_export_verifies_and_equals_base_plus_adapter() {
    let out = tempfile::tempdir().unwrap();
    let base = ModelDir { dir: fixture(V2).join("model"), name: String::new(), commit: None, gguf: None };
    let adapter = finetune::export::PeftAdapter::open(&fixture(V2).join("expected/adapter")).unwrap();
    let opts = finetune::export::ExportOptions { merge: true, ..Default::default() };
    let rep = finetune::export::merge(&base, &adapter, &out.path().join("merged"), &opts).unwrap();
    // q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj in each of 3 layers.
    assert_eq!(rep.merged_tensors, 12);
    let diff = rep.max_logit_diff.expect("verified");
    println!("merged vs base + adapter logits: {diff:.2e}");
    assert!(diff < 1e-4);
    // The merged folder is a DeepSeek-V2 model of its own: same logits without adapters.
    let cfg = ModelConfig::from_file(&base.config_path()).unwrap();
    let adapters = trained_adapter(V2, &cfg);
    let ids = Tensor::new(&[[3u32, 60, 61, 7, 150, 2]], &Device::Cpu).unwrap();
    let (with, _) = load_model(&base.dir, Some(&adapters));
    let (merged, none) = load_model(&out.path().join("merged"), None);
    let d = max_abs_diff(&merged.logits(&ids, &none).unwrap(), &with.logits(&ids, &adapters).unwrap());
    assert!(d < 1e-4, "merged model logits differ by {d}");
}

/// A matrix in DeepSeek-V3's FP8 layout: (e4m3 values, f32 scales per 128 x 128 block = the
/// block's amax / 448, the values dequantised here in f64).
fn fp8_quantise(t: &Tensor) -> (Tensor, Tensor, Tensor) {
    let (rows, cols) = t.dims2().unwrap();
    let v = t.to_vec2::<f32>().unwrap();
    let (br, bc) = (rows.div_ceil(128), cols.div_ceil(128));
    let mut scale = vec![0f32; br * bc];
    for (i, row) in v.iter().enumerate() {
        for (j, x) in row.iter().enumerate() {
            let s = &mut scale[(i / 128) * bc + j / 128];
            *s = s.max(x.abs() / 448.0);
        }
    }
    let mut bytes = Vec::with_capacity(rows * cols);
    let mut back = Vec::with_capacity(rows * cols);
    for (i, row) in v.iter().enumerate() {
        for (j, x) in row.iter().enumerate() {
            let s = scale[(i / 128) * bc + j / 128];
            let q = float8::F8E4M3::from_f32(x / s);
            bytes.push(q.to_bits());
            back.push((q.to_f64() * s as f64) as f32);
        }
    }
    (
        Tensor::from_raw_buffer(&bytes, DType::F8E4M3, &[rows, cols], &Device::Cpu).unwrap(),
        Tensor::from_vec(scale, (br, bc), &Device::Cpu).unwrap(),
        Tensor::from_vec(back, (rows, cols), &Device::Cpu).unwrap(),
    )
}

#[test]
fn fp8_blocks_dequantise_exactly_whole_and_in_any_flat_range() {
    // 300 x 260 spans 3 x 3 blocks of 128 (the last ones partial), with a different scale each.
    let d = tempfile::tempdir().unwrap();
    let vals: Vec<f32> = (0..300 * 260).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * (1.0 + (i / 260 / 128 * 3 + i % 260 / 128) as f32)).collect();
    let (q, scale, want) = fp8_quantise(&Tensor::from_vec(vals, (300, 260), &Device::Cpu).unwrap());
    let map: std::collections::HashMap<String, Tensor> = [("w.weight".to_string(), q), ("w.weight_scale_inv".to_string(), scale)].into();
    candle_core::safetensors::save(&map, d.path().join("model.safetensors")).unwrap();
    let md = ModelDir { dir: d.path().to_path_buf(), name: String::new(), commit: None, gguf: None };
    let files = md.open_weights().unwrap();
    assert_eq!(max_abs_diff(&files.load("w.weight", &[300, 260], &Device::Cpu).unwrap(), &want), 0.0);
    let flat = want.flatten_all().unwrap();
    for (lo, hi) in [(0, 1), (100, 40_000), (33_279, 33_281), (77_999, 78_000), (0, 78_000)] {
        let got = files.load_fp8_flat("w.weight", &[300, 260], lo, hi).unwrap();
        assert_eq!(max_abs_diff(&got, &flat.narrow(0, lo, hi - lo).unwrap()), 0.0, "{lo}..{hi}");
    }
}

/// DeepSeek-V3's FP8 layout made from the fixture's f32 weights by this test: each 2-D
/// projection to e4m3 with one f32 scale per 128 x 128 block (amax / 448, as DeepSeek's
/// quantiser), written beside a copy whose weights are those FP8 values dequantised here in
/// f64. Training on either must give the same numbers.
fn quantise_fixture(root: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let src = fixture(V2).join("model");
    let tensors = load_tensors(&src.join("model.safetensors"));
    let (fp8_dir, deq_dir) = (root.join("fp8"), root.join("dequantised"));
    let mut fp8: Vec<(String, Tensor)> = Vec::new();
    let mut deq: Vec<(String, Tensor)> = Vec::new();
    for (name, t) in &tensors {
        let quantise = name.contains("_proj.weight") && t.rank() == 2;
        if !quantise {
            fp8.push((name.clone(), t.clone()));
            deq.push((name.clone(), t.clone()));
            continue;
        }
        let (q, scale, back) = fp8_quantise(t);
        fp8.push((name.clone(), q));
        fp8.push((format!("{name}_scale_inv"), scale));
        deq.push((name.clone(), back));
    }
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    for (dir, ts, quantised) in [(&fp8_dir, fp8, true), (&deq_dir, deq, false)] {
        std::fs::create_dir_all(dir).unwrap();
        let mut c = config.clone();
        if quantised {
            c["quantization_config"] = serde_json::json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]});
        }
        std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
        let map: std::collections::HashMap<String, Tensor> = ts.into_iter().collect();
        candle_core::safetensors::save(&map, dir.join("model.safetensors")).unwrap();
    }
    (fp8_dir, deq_dir)
}

/// An untied head stays in its file on the host only where it can be read by rows: an FP8
/// head is dequantised and held, and `finetune plan` (`weights::tables_copied`) counts it
/// so, as it counts a plain head as left in its file: the plan's frozen bytes are the run's.
#[test]
fn the_plan_counts_an_fp8_head_as_held_and_a_plain_one_as_left_in_its_file() {
    let root = tempfile::tempdir().unwrap();
    let (fp8_dir, _) = quantise_fixture(root.path());
    let fp8_head = root.path().join("fp8-head");
    std::fs::create_dir_all(&fp8_head).unwrap();
    std::fs::copy(fp8_dir.join("config.json"), fp8_head.join("config.json")).unwrap();
    let mut map = load_tensors(&fp8_dir.join("model.safetensors"));
    let (q, scale, _) = fp8_quantise(&map["lm_head.weight"]);
    map.insert("lm_head.weight".into(), q);
    map.insert("lm_head.weight_scale_inv".into(), scale);
    candle_core::safetensors::save(&map, fp8_head.join("model.safetensors")).unwrap();
    for (dir, held) in [(&fp8_dir, false), (&fp8_head, true)] {
        let out = root.path().join(format!("out-{held}"));
        let r = recipe(V2, &out, &[&format!("model.path={}", dir.display()), "train.max_steps=1"]);
        let copied = finetune::weights::tables_copied(&r);
        assert_eq!(copied.contains(&"lm_head.weight".to_string()), held, "{copied:?}");
        let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
        let planned = finetune::dist::plan::plan_with(&cfg, &r.recipe, 1, false, None, &copied).frozen;
        let ran = finetune::train::run(&r).unwrap().memory[0].frozen;
        assert_eq!(planned, ran, "head held: {held}");
    }
}

#[test]
fn an_fp8_base_trains_exactly_like_its_dequantised_copy_and_merges_to_bf16() {
    let root = tempfile::tempdir().unwrap();
    let (fp8_dir, deq_dir) = quantise_fixture(root.path());
    let mut losses = Vec::new();
    for (name, dir) in [("fp8", &fp8_dir), ("deq", &deq_dir)] {
        let out = root.path().join(format!("out-{name}"));
        let r = recipe(V2, &out, &[&format!("model.path={}", dir.display())]);
        finetune::train::run(&r).unwrap();
        losses.push(read_metrics(&out.join("metrics.jsonl")).iter().map(|m| (m["loss"].as_f64().unwrap(), m["grad_norm"].as_f64().unwrap())).collect::<Vec<_>>());
    }
    assert_eq!(losses[0], losses[1], "FP8 base vs its dequantised copy");
    // The FP8 weights really are coarser than the f32 ones they came from.
    let f32_run = tempfile::tempdir().unwrap();
    finetune::train::run(&recipe(V2, f32_run.path(), &[])).unwrap();
    let l32 = read_metrics(&f32_run.path().join("metrics.jsonl"))[0]["loss"].as_f64().unwrap();
    assert!(l32 != losses[0][0].0);

    // Merged: a plain bf16 model (no scales, no quantization_config) that verifies.
    let base = ModelDir { dir: fp8_dir.clone(), name: String::new(), commit: None, gguf: None };
    let adapter = finetune::export::PeftAdapter::open(&root.path().join("out-fp8/adapter")).unwrap();
    let merged = root.path().join("merged");
    let rep = finetune::export::merge(&base, &adapter, &merged, &finetune::export::ExportOptions { merge: true, ..Default::default() }).unwrap();
    assert!(rep.max_logit_diff.is_some());
    let t = load_tensors(&merged.join("model.safetensors"));
    assert!(t.keys().all(|k| !k.ends_with("_scale_inv")));
    assert_eq!(t["model.layers.1.self_attn.kv_b_proj.weight"].dtype(), DType::BF16);
    let c = std::fs::read_to_string(merged.join("config.json")).unwrap();
    assert!(!c.contains("quantization_config") && c.contains("bfloat16"), "{c}");
}

#[test]
fn an_fp8_weight_without_its_scales_is_an_error_naming_both() {
    let root = tempfile::tempdir().unwrap();
    let (fp8_dir, _) = quantise_fixture(root.path());
    let file = fp8_dir.join("model.safetensors");
    let mut t = load_tensors(&file);
    t.remove("model.layers.2.self_attn.o_proj.weight_scale_inv");
    candle_core::safetensors::save(&t, &file).unwrap();
    let out = root.path().join("out");
    let e = finetune::train::run(&recipe(V2, &out, &[&format!("model.path={}", fp8_dir.display())])).unwrap_err().to_string();
    assert!(e.contains("model.layers.2.self_attn.o_proj.weight") && e.contains("weight_scale_inv"), "{e}");
    assert!(!out.exists());
}

#[test]
fn the_plan_covers_deepseek_v2_lite_and_v3() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // Parameter counts from the configs alone (DeepSeek's published totals: 15.7 B, 671 B
    // without V3's multi-token-prediction layer).
    let lite = ModelConfig::from_file(&root.join("recipes/models/deepseek-v2-lite/config.json")).unwrap();
    let v3 = ModelConfig::from_file(&root.join("recipes/models/deepseek-v3/config.json")).unwrap();
    let (pl, p3) = (lite.base_param_count() as f64, v3.base_param_count() as f64);
    println!("V2-Lite {pl:.4e}, V3 {p3:.4e}");
    assert!((pl / 15.706e9 - 1.0).abs() < 0.002, "V2-Lite: {pl}");
    assert!((p3 / 671.03e9 - 1.0).abs() < 0.002, "V3: {p3}");
    for (recipe_file, worlds) in [("recipes/deepseek-v2-lite-lora.toml", "1,2,4,8"), ("recipes/deepseek-v3-lora.toml", "8,16,32,64")] {
        let model = if recipe_file.contains("v3") { "models/deepseek-v3" } else { "models/deepseek-v2-lite" };
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_finetune"))
            .args(["plan", "--recipe"])
            .arg(root.join(recipe_file))
            .args(["--world-size", worlds, "--set", &format!("model.path={model}")])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        println!("{text}{}", String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{recipe_file}");
        assert!(text.contains("frozen base kept") && text.contains("optimizer state per rank"));
    }
    // A rank's frozen shard is 1/N of the bf16 base, its routers f32 (per-tensor padding aside).
    let r = finetune::recipe::LoadedRecipe::load(&root.join("recipes/deepseek-v3-lora.toml"), &[]).unwrap().recipe;
    let f32_elems: usize = v3.frozen_tensors().iter().filter(|(n, _)| n.ends_with("mlp.gate.weight") || n.ends_with("e_score_correction_bias")).map(|(_, s)| s.iter().product::<usize>()).sum();
    for w in [8usize, 64] {
        let p = finetune::dist::plan::plan(&v3, &r, w, true);
        let share = ((p3 * 2.0 + f32_elems as f64 * 2.0) / w as f64) as usize;
        assert!(p.frozen >= share && p.frozen <= share + v3.frozen_tensors().len() * 2, "world {w}: {} vs {share}", p.frozen);
    }
}

/// A model config with one field changed, in a copy of the V2 fixture's model folder.
fn with_config(root: &Path, edit: impl Fn(&mut serde_json::Value)) -> std::path::PathBuf {
    let dir = root.join("model");
    copy_dir(&fixture(V2).join("model"), &dir);
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    edit(&mut c);
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    dir
}

/// Train the V2 fixture's recipe on `model`; the error text (and no output folder).
fn train_error(root: &Path, model: &Path, extra: &[&str]) -> String {
    let out = root.join("out");
    let mut o = vec![format!("model.path={}", model.display())];
    o.extend(extra.iter().map(|s| s.to_string()));
    let o: Vec<&str> = o.iter().map(String::as_str).collect();
    let e = finetune::train::run(&recipe(V2, &out, &o)).unwrap_err().to_string();
    assert!(!out.exists(), "bad input left {}", out.display());
    e
}

#[test]
fn unknown_routing_settings_are_errors_naming_the_key() {
    for (key, value, expect) in [
        ("topk_method", serde_json::json!("noaux_tc"), "topk_method `noaux_tc`"),
        ("scoring_func", serde_json::json!("sigmoid"), "scoring_func `sigmoid`"),
        ("n_group", serde_json::json!(4), "n_group (4)"),
        ("rope_interleave", serde_json::json!(false), "rope_interleave"),
        ("quantization_config", serde_json::json!({"quant_method": "gptq"}), "quant_method `gptq`"),
        ("moe_layer_freq", serde_json::json!(2), "moe_layer_freq = 2"),
    ] {
        let root = tempfile::tempdir().unwrap();
        let model = with_config(root.path(), |c| c[key] = value.clone());
        let e = train_error(root.path(), &model, &[]);
        assert!(e.contains(expect) && e.contains("config.json"), "{key}: {e}");
    }
}

/// Configs transformers would not build as they read (a router without its groups, YaRN
/// without the factor its attention scale reads, a model_type of another family), or would
/// build otherwise than DeepSeek's own code (norm_topk_prob on V2), are errors naming the key,
/// not a model trained on a guess.
#[test]
fn configs_the_references_disagree_on_or_refuse_are_errors_naming_the_key() {
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: [(Edit, &str); 4] = [
        (Box::new(|c| c["model_type"] = "deepseek_v3".into()), "`model_type` says `deepseek_v3`"),
        (
            Box::new(|c| {
                c["topk_method"] = "group_limited_greedy".into();
                c.as_object_mut().unwrap().remove("topk_group");
            }),
            "topk_group is required",
        ),
        (Box::new(|c| c["norm_topk_prob"] = true.into()), "norm_topk_prob = true"),
        (
            Box::new(|c| {
                for key in ["rope_scaling", "rope_parameters"] {
                    c[key].as_object_mut().unwrap().remove("factor");
                }
            }),
            "rope_scaling yarn needs `factor`",
        ),
    ];
    for (edit, expect) in cases {
        let root = tempfile::tempdir().unwrap();
        let model = with_config(root.path(), &edit);
        let e = train_error(root.path(), &model, &[]);
        assert!(e.contains(expect) && e.contains("config.json"), "{expect}: {e}");
    }
}

#[test]
fn a_missing_expert_or_a_misshapen_router_is_an_error_naming_the_tensor() {
    type Edit = Box<dyn Fn(&mut std::collections::HashMap<String, Tensor>)>;
    let cases: [(&str, Edit, &str); 3] = [
        ("missing expert", Box::new(|t| {
            t.remove("model.layers.2.mlp.experts.4.up_proj.weight");
        }), "model.layers.2.mlp.experts.4.up_proj.weight"),
        // transformers 5's own layout (save_original_format=False): named, with the way out.
        ("stacked experts", Box::new(|t| {
            let p = "model.layers.1.mlp.experts";
            let take = |t: &mut std::collections::HashMap<String, Tensor>, j: usize, w: &str| t.remove(&format!("{p}.{j}.{w}.weight")).unwrap();
            let (mut gate_up, mut down) = (vec![], vec![]);
            for j in 0..6 {
                let (g, u) = (take(t, j, "gate_proj"), take(t, j, "up_proj"));
                gate_up.push(Tensor::cat(&[g, u], 0).unwrap()); // [2I, H]
                down.push(take(t, j, "down_proj")); // [H, I]
            }
            t.insert(format!("{p}.gate_up_proj"), Tensor::stack(&gate_up, 0).unwrap()); // [E, 2I, H]
            t.insert(format!("{p}.down_proj"), Tensor::stack(&down, 0).unwrap()); // [E, H, I]
        }), "save_original_format=True"),
        ("router shape", Box::new(|t| {
            let g = t["model.layers.1.mlp.gate.weight"].narrow(0, 0, 5).unwrap();
            t.insert("model.layers.1.mlp.gate.weight".into(), g);
        }), "model.layers.1.mlp.gate.weight"),
    ];
    for (what, edit, name) in cases {
        let root = tempfile::tempdir().unwrap();
        let model = with_config(root.path(), |_| {});
        let file = model.join("model.safetensors");
        let mut t = load_tensors(&file);
        edit(&mut t);
        candle_core::safetensors::save(&t, &file).unwrap();
        let e = train_error(root.path(), &model, &[]);
        assert!(e.contains(name), "{what}: {e}");
    }
}

#[test]
fn q_lora_rank_without_q_a_proj_names_the_tensor() {
    let root = tempfile::tempdir().unwrap();
    let model = with_config(root.path(), |c| c["q_lora_rank"] = serde_json::json!(8));
    let r = fresh_recipe(root.path(), &["lora.targets=[\"o_proj\"]", &format!("model.path={}", model.display())]);
    let e = finetune::train::run(&r).unwrap_err().to_string();
    assert!(e.contains("self_attn.q_a_proj.weight"), "{e}");
    assert!(!root.path().join("out").exists());
}

#[test]
fn a_llama_target_on_mla_lists_the_names_the_model_has() {
    let root = tempfile::tempdir().unwrap();
    let model = with_config(root.path(), |_| {});
    let e = train_error(root.path(), &model, &["lora.targets=[\"q_proj\", \"k_proj\", \"v_proj\"]"]);
    assert!(e.contains("`k_proj`") && e.contains("kv_a_proj_with_mqa") && e.contains("kv_b_proj"), "{e}");
    let e = train_error(root.path(), &model, &["lora.targets=[\"q_a_proj\"]"]);
    assert!(e.contains("`q_a_proj`") && e.contains("q_proj"), "{e}");
}

#[test]
fn the_default_targets_of_an_mla_model_are_its_attention_projections() {
    let out = tempfile::tempdir().unwrap();
    let r = recipe(V2, out.path(), &[]);
    let cfg = ModelConfig::from_file(&fixture(V2).join("model/config.json")).unwrap();
    let mut loaded = r.recipe.clone();
    loaded.lora.targets = None;
    assert_eq!(loaded.lora.spec(&cfg).targets, ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]);
    // Routed experts only when asked: MLP targets alone adapt the dense MLP and shared experts.
    loaded.lora.targets = Some(vec!["up_proj".into()]);
    let (n, _) = finetune::train::trainable_parameters(&cfg, &loaded.lora.spec(&cfg));
    assert_eq!(n, 4 * ((48 + 96) + 2 * (48 + 64)));
    loaded.lora.routed_experts = true;
    let (n, _) = finetune::train::trainable_parameters(&cfg, &loaded.lora.spec(&cfg));
    assert_eq!(n, 4 * ((48 + 96) + 2 * (48 + 64) + 2 * 6 * (48 + 32)));
}

/// The V2 fixture's recipe without its initial adapter (fresh adapters on other targets),
/// written to `root`, with `extra` overrides.
fn fresh_recipe(root: &Path, extra: &[&str]) -> finetune::recipe::LoadedRecipe {
    let f = fixture(V2);
    let text = std::fs::read_to_string(f.join("recipe.toml")).unwrap().replace("init_from = \"init\"\n", "");
    let text = text.replace("path = \"model\"", &format!("path = {:?}", f.join("model"))).replace("train = \"data\"", &format!("train = {:?}", f.join("data")));
    std::fs::write(root.join("recipe.toml"), text).unwrap();
    let mut o = vec![format!("output.dir={}", root.join("out").display())];
    o.extend(extra.iter().map(|s| s.to_string()));
    finetune::recipe::LoadedRecipe::load(&root.join("recipe.toml"), &o).unwrap()
}

#[test]
fn routed_expert_adapters_use_peft_per_module_keys_and_train() {
    let root = tempfile::tempdir().unwrap();
    let r = fresh_recipe(root.path(), &["lora.targets=[\"gate_proj\", \"up_proj\", \"down_proj\"]", "lora.routed_experts=true", "lora.dropout=0.1"]);
    finetune::train::run(&r).unwrap();
    let out = root.path().join("out");
    // PEFT with transformers 5 refuses to load routed-expert adapters whose config has
    // dropout (its ParamWrapper), which acts only in training.
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("adapter/adapter_config.json")).unwrap()).unwrap();
    assert_eq!(cfg["lora_dropout"], serde_json::json!(0.0));
    let t = load_tensors(&out.join("adapter/adapter_model.safetensors"));
    // Layer 0 dense, layers 1-2: shared experts + 6 routed experts, 3 projections, A and B.
    assert_eq!(t.len(), 2 * 3 * (1 + 2 * 7));
    for k in [
        "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight",
        "base_model.model.model.layers.1.mlp.shared_experts.up_proj.lora_B.weight",
        "base_model.model.model.layers.2.mlp.experts.5.down_proj.lora_A.weight",
    ] {
        assert!(t.contains_key(k), "{k}");
    }
    // Every expert that received tokens moved its B away from 0.
    let moved = t.iter().filter(|(k, v)| k.contains(".experts.") && k.ends_with("lora_B.weight") && v.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() > 0.0).count();
    assert!(moved > 0);
}

#[test]
fn an_expert_without_tokens_costs_nothing_and_gets_no_gradient() {
    // One token through MoE layer 1: top-2 of 6 experts, so 4 run no GEMM at all, and their
    // adapters get no gradient (the optimizer sees zeros), while the 2 chosen ones get one.
    let dir = fixture(V2).join("model");
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let root = tempfile::tempdir().unwrap();
    let r = fresh_recipe(root.path(), &["lora.targets=[\"up_proj\"]", "lora.routed_experts=true"]);
    let adapters = Adapters::init(&cfg, r.recipe.lora.spec(&cfg), 3, &Device::Cpu).unwrap();
    for (_, path, ad) in adapters.iter() {
        if path.contains("experts.") {
            ad.b.set(&Tensor::ones(ad.b.dims(), DType::F32, &Device::Cpu).unwrap()).unwrap();
        }
    }
    let (m, _) = load_model(&dir, Some(&adapters));
    let x = m.embed(&Tensor::new(&[[42u32]], &Device::Cpu).unwrap()).unwrap().reshape((1, 48)).unwrap(); // [N=1, H]
    let ctx = m.forward_ctx(&[vec![0]], None, None).unwrap();
    let y = m.layer_forward(1, &x, &ctx, &adapters).unwrap();
    let grads = y.sum_all().unwrap().backward().unwrap();
    let with_grad: Vec<&str> = adapters
        .iter()
        .filter(|(l, p, ad)| *l == 1 && p.starts_with("mlp.experts.") && grads.get(&ad.a).is_some())
        .map(|(_, p, _)| p)
        .collect();
    assert_eq!(with_grad.len(), 2, "{with_grad:?}");
}

/// Metric lines without the timing field (which differs between runs).
/// The metrics lines without what measures the machine rather than the math (speed, time, memory).
fn metric_lines(out: &Path) -> Vec<String> {
    read_metrics(&out.join("metrics.jsonl"))
        .into_iter()
        .map(|mut m| {
            for k in ["tokens_per_s", "step_seconds", "wall_time", "rss_mb"] {
                m.as_object_mut().unwrap().remove(k);
            }
            m.to_string()
        })
        .collect()
}

/// Train 4 steps with packing, shuffle, dropout and routed-expert adapters; then start again
/// from the step-2 checkpoint in a fresh folder: the same metrics and adapter bytes.
fn check_deepseek_resume(extra: &[&str]) -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    let mut o = vec![
        "lora.targets=[\"q_proj\", \"kv_b_proj\", \"up_proj\"]",
        "lora.routed_experts=true",
        "lora.dropout=0.1",
        "data.packing=true",
        "data.shuffle=true",
        "data.max_seq_len=32",
        "train.max_steps=4",
        "checkpoint.every_steps=1",
        "checkpoint.keep_last=0",
    ];
    o.extend_from_slice(extra);
    let full = fresh_recipe(root.path(), &o);
    let s = finetune::train::run(&full).unwrap();
    assert_eq!(s.steps.len(), 4);
    let out = root.path().join("out");
    let part = root.path().join("part");
    copy_dir(&out.join("checkpoints/step-000002"), &part.join("out/checkpoints/step-000002"));
    let lines: String = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().take(2).map(|l| format!("{l}\n")).collect();
    std::fs::write(part.join("out/metrics.jsonl"), lines).unwrap();
    std::fs::create_dir_all(&part).unwrap();
    let resumed = fresh_recipe(&part, &o);
    let s = finetune::train::run(&resumed).unwrap();
    assert_eq!(s.steps.len(), 2);
    assert_eq!(metric_lines(&part.join("out")), metric_lines(&out));
    let bytes = |d: &Path| std::fs::read(d.join("adapter/adapter_model.safetensors")).unwrap();
    assert_eq!(bytes(&part.join("out")), bytes(&out), "adapter bytes after resuming at step 2");
    root
}

#[test]
fn deepseek_resume_with_packing_and_expert_adapters_is_exact() {
    check_deepseek_resume(&[]);
}

#[test]
fn deepseek_resume_on_the_portable_path_with_a_bf16_base_is_exact() {
    check_deepseek_resume(&["model.dtype=bf16", "model.kernels=portable", "train.activation_checkpointing=false"]);
}

/// `common::two_token_rows` at `dir`: one row per micro-batch reaches at most 2 x 2 of the 6
/// experts of each MoE layer, so every step leaves experts without tokens.
fn write_two_token_rows(dir: &Path) {
    finetune::synth::write_tokenized_dataset(dir, &two_token_rows()).unwrap();
}

#[test]
fn an_expert_no_token_reached_in_a_step_is_not_updated_not_even_by_weight_decay() {
    let root = tempfile::tempdir().unwrap();
    write_two_token_rows(&root.path().join("rows"));
    let data = format!("data.train={}", root.path().join("rows").display());
    let o = ["lora.targets=[\"up_proj\"]", "lora.routed_experts=true", "train.weight_decay=0.1", "train.micro_batch_size=1", "train.grad_accum_steps=1", "train.max_steps=1", &data];
    let r = fresh_recipe(root.path(), &o);
    let cfg = ModelConfig::from_file(&fixture(V2).join("model/config.json")).unwrap();
    let init = Adapters::init(&cfg, r.recipe.lora.spec(&cfg), r.recipe.train.seed, &Device::Cpu).unwrap();
    finetune::train::run(&r).unwrap();
    let after = load_tensors(&root.path().join("out/adapter/adapter_model.safetensors"));
    for layer in [1, 2] {
        let (mut same, mut moved) = (0, 0);
        for (key, var) in init.params() {
            if key.contains(&format!("layers.{layer}.mlp.experts.")) && key.ends_with("lora_A.weight") {
                if max_abs_diff(&after[&key], var.as_tensor()) == 0.0 { same += 1 } else { moved += 1 }
            }
        }
        // 2 tokens x top-2: at most 4 experts reached, at least 1 (decayed even with B = 0).
        assert!(same >= 2 && moved >= 1 && same + moved == 6, "layer {layer}: {same} untouched, {moved} updated");
    }
}

/// With routed-expert adapters a resume may not change micro_batch_size, even with the global
/// batch kept: the padding of rows batched together reaches experts, which AdamW then steps.
/// Without them the same change continues.
#[test]
fn a_resume_with_routed_expert_adapters_refuses_another_micro_batch_size() {
    for routed in [true, false] {
        let root = tempfile::tempdir().unwrap();
        let r = format!("lora.routed_experts={routed}");
        let o = ["lora.targets=[\"up_proj\"]", &r, "train.micro_batch_size=2", "train.grad_accum_steps=1", "train.max_steps=1"];
        finetune::train::run(&fresh_recipe(root.path(), &o)).unwrap();
        let more = ["lora.targets=[\"up_proj\"]", &r, "train.micro_batch_size=1", "train.grad_accum_steps=2", "train.max_steps=2"];
        let resumed = finetune::train::run(&fresh_recipe(root.path(), &more));
        match routed {
            true => {
                let e = resumed.expect_err("refused").to_string();
                assert!(e.contains("train.micro_batch_size") && e.contains("routed_experts") && e.contains("checkpoint's was 2"), "{e}");
            }
            false => assert_eq!(resumed.unwrap().steps.iter().map(|m| m.step).collect::<Vec<_>>(), vec![2]),
        }
    }
}

#[test]
fn resume_keeps_the_step_counts_of_experts_that_sat_out_steps() {
    let rows = tempfile::tempdir().unwrap();
    write_two_token_rows(&rows.path().join("rows"));
    let data = format!("data.train={}", rows.path().join("rows").display());
    let run = check_deepseek_resume(&["data.packing=false", "train.micro_batch_size=1", "train.grad_accum_steps=1", "train.weight_decay=0.1", &data]);
    // The checkpoint resumed from did record experts whose count fell behind.
    let bytes = std::fs::read(run.path().join("out/checkpoints/step-000002/optimizer.safetensors")).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let behind = meta.metadata().as_ref().and_then(|m| m.get("adam_steps").cloned()).expect("adam_steps in the checkpoint");
    assert!(behind.contains(".mlp.experts."), "{behind}");
}

#[test]
fn routed_experts_without_an_expert_projection_target_is_an_error() {
    let root = tempfile::tempdir().unwrap();
    let r = fresh_recipe(root.path(), &["lora.routed_experts=true"]);
    let e = finetune::train::run(&r).unwrap_err().to_string();
    assert!(e.contains("lora.routed_experts") && e.contains("gate_proj"), "{e}");
}

#[test]
fn default_targets_resume_under_an_explicit_list_in_any_order() {
    // Checkpoints record the resolved targets, so leaving them unset and listing them (as
    // checkpoints written before the default became per-model did) is the same recipe.
    let root = tempfile::tempdir().unwrap();
    finetune::train::run(&fresh_recipe(root.path(), &["train.max_steps=2"])).unwrap();
    let listed = "lora.targets=[\"o_proj\", \"kv_b_proj\", \"kv_a_proj_with_mqa\", \"q_proj\"]";
    let s = finetune::train::run(&fresh_recipe(root.path(), &["train.max_steps=3", listed])).unwrap();
    assert_eq!(s.steps.len(), 1);
}

#[test]
fn the_router_and_v3_router_bias_stay_f32_under_a_bf16_base_and_in_a_bf16_merge() {
    // transformers keeps the router (`gate.weight`, V2 and V3) and V3's e_score_correction_bias
    // in f32 in a bf16 model (`_keep_in_fp32_modules_strict`); rounding them would change which
    // experts win close calls.
    let dir = fixture("parity-deepseek-v3").join("model");
    let md = ModelDir { dir: dir.clone(), name: String::new(), commit: None, gguf: None };
    let src = ResidentWeights::new(md.open_weights().unwrap(), DType::BF16, DType::BF16, Device::Cpu);
    let files = md.open_weights().unwrap();
    let names = [("model.layers.1.mlp.gate.e_score_correction_bias", vec![8]), ("model.layers.1.mlp.gate.weight", vec![8, 48])];
    for (name, shape) in &names {
        let got = finetune::weights::Frozen::new(&src).get_f32(shape, name).unwrap();
        let want = files.load(name, shape, &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
        assert_eq!(max_abs_diff(&got, &want), 0.0, "{name}");
        assert!(max_abs_diff(&want.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap(), &want) > 0.0, "the test needs a {name} bf16 cannot hold");
    }
    // A merge written in bf16 keeps them f32, as transformers' save_pretrained of a bf16 model does.
    let root = tempfile::tempdir().unwrap();
    let out = root.path().join("run");
    finetune::train::run(&recipe("parity-deepseek-v3", &out, &["train.max_steps=1"])).unwrap();
    let adapter = finetune::export::PeftAdapter::open(&out.join("adapter")).unwrap();
    let merged = root.path().join("merged");
    let opts = finetune::export::ExportOptions { merge: true, dtype: Some(DType::BF16), no_verify: true, ..Default::default() };
    finetune::export::merge(&md, &adapter, &merged, &opts).unwrap();
    let mut t = std::collections::HashMap::new();
    for f in std::fs::read_dir(&merged).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "safetensors")) {
        t.extend(load_tensors(&f));
    }
    for (name, _) in &names {
        assert_eq!(t[*name].dtype(), DType::F32, "{name}");
    }
    assert_eq!(t["model.layers.1.self_attn.o_proj.weight"].dtype(), DType::BF16);
}

#[test]
fn an_fp8_base_shards_under_zero3_and_trains_as_on_one_rank() {
    // Each rank dequantises and keeps its 1/N of every FP8 weight; 2 ranks with half the
    // accumulation each equal one rank with the whole base.
    let root = tempfile::tempdir().unwrap();
    let (fp8_dir, _) = quantise_fixture(root.path());
    let model = format!("model.path={}", fp8_dir.display());
    let mut runs = Vec::new();
    for (name, extra) in [("one", vec!["dist.zero_stage=0"]), ("two", vec!["dist.zero_stage=3", "dist.world_size=2", "train.grad_accum_steps=1"])] {
        let out = root.path().join(name);
        let mut o = vec![model.as_str()];
        o.extend(extra);
        finetune::train::run(&recipe(V2, &out, &o)).unwrap();
        runs.push(out);
    }
    let (a, b) = (read_metrics(&runs[0].join("metrics.jsonl")), read_metrics(&runs[1].join("metrics.jsonl")));
    for (x, y) in a.iter().zip(&b) {
        assert!(rel(x["loss"].as_f64().unwrap(), y["loss"].as_f64().unwrap()) < 1e-6, "{x} vs {y}");
    }
    let (ta, tb) = (load_tensors(&runs[0].join("adapter/adapter_model.safetensors")), load_tensors(&runs[1].join("adapter/adapter_model.safetensors")));
    let d = ta.iter().map(|(k, t)| max_abs_diff(t, &tb[k])).fold(0.0, f32::max);
    assert!(d < 1e-6, "adapters differ by {d}");
}

/// Activation checkpointing on MLA + MoE that keeps the projections' outputs (q_a / q_b,
/// kv_a_proj_with_mqa, kv_b_proj, o_proj), the attention output and the SwiGLU inputs (the
/// dense MLP's; in MoE layers every routed and shared expert's) for the recomputation gives
/// the bits of recomputing everything, and the gradients of no checkpointing.
#[test]
fn mla_and_moe_checkpointing_that_keeps_projection_outputs_and_expert_inputs_gives_the_bits_of_recomputing_everything() {
    use finetune::data::{Example, MicroBatch};
    use finetune::ops::checkpoint::KeepLayer;
    let dir = fixture("parity-deepseek-v3").join("model");
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let targets = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"].map(String::from).to_vec();
    let spec = finetune::lora::LoraSpec { rank: 4, alpha: 8.0, dropout: 0.0, targets, routed_experts: false };
    let adapters = Adapters::init(&cfg, spec, 1, &Device::Cpu).unwrap();
    // Non-zero B, so that every adapter changes its output and every gradient is non-trivial.
    for (_, v) in adapters.params() {
        v.set(&(v.as_tensor().ones_like().unwrap() * 0.01).unwrap()).unwrap();
    }
    let (model, _) = load_model(&dir, Some(&adapters));
    let vars: Vec<candle_core::Var> = adapters.params().into_iter().map(|(_, v)| v.clone()).collect();
    let records: Vec<Example> = finetune::synth::counting_rows(2, 200, 9, 7, 13).into_iter().map(|(i, l)| Example::new(i.iter().map(|&x| x as u32).collect(), l)).collect();
    let mb = MicroBatch::collate(&records);
    let run = |ckpt: Option<&[KeepLayer]>| {
        let mut grads = vec![None; vars.len()];
        let loss = finetune::train::forward_backward(&model, &adapters, &vars, &mb, 1.0, None, ckpt, &mut grads).unwrap();
        (loss, grads.into_iter().map(|g| g.expect("every adapter gets a gradient")).collect::<Vec<_>>())
    };
    let layers = cfg.num_hidden_layers;
    let (plain, recompute) = (run(None), run(Some(&vec![KeepLayer::default(); layers])));
    let all = KeepLayer { linears: true, attention: true, swiglu: true, whole: false };
    for keep in [KeepLayer { linears: true, ..KeepLayer::default() }, KeepLayer { linears: true, attention: true, ..KeepLayer::default() }, all] {
        let kept = run(Some(&vec![keep; layers]));
        assert_eq!(kept.0, recompute.0, "{keep:?}");
        // The summed gradients are f64.
        let diff = |a: &Tensor, b: &Tensor| (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap();
        for ((k, r), p) in kept.1.iter().zip(&recompute.1).zip(&plain.1) {
            assert_eq!(diff(k, r), 0.0, "{keep:?}");
            assert!(diff(k, p) < 1e-6, "{keep:?}: {} from no checkpointing", diff(k, p));
        }
    }
}

#[test]
fn a_gguf_adapter_export_on_a_deepseek_recipe_is_refused_before_any_step() {
    // llama.cpp LoRA GGUFs are written for llama and qwen2 bases only: a DeepSeek recipe that
    // asks for one is refused at start, not after the run has trained.
    let root = tempfile::tempdir().unwrap();
    let out = root.path().join("run");
    let err = finetune::train::run(&recipe(V2, &out, &["export.gguf=true"])).unwrap_err();
    assert!(matches!(&err, finetune::Error::Recipe { key, msg, .. } if key == "export.gguf" && msg.contains("deepseek_v2") && msg.contains("llama and qwen2")), "{err}");
    assert!(!out.join("metrics.jsonl").exists(), "no step ran");
}

#[test]
fn a_merge_copies_the_remote_code_modules_its_config_names() {
    // Hub DeepSeek-V2/V3 folders name their modeling code in config.json's `auto_map`; the
    // merged folder keeps that config, so it needs those files beside it to load with
    // trust_remote_code (code in another repo, `org/repo--module.Class`, is not copied).
    let root = tempfile::tempdir().unwrap();
    let base = root.path().join("base");
    copy_dir(&fixture(V2).join("model"), &base);
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(base.join("config.json")).unwrap()).unwrap();
    c["auto_map"] = serde_json::json!({"AutoConfig": "configuration_deepseek.DeepseekV2Config", "AutoModelForCausalLM": ["modeling_deepseek.DeepseekV2ForCausalLM", null], "AutoTokenizer": "org/other--tokenization_x.T"});
    std::fs::write(base.join("config.json"), c.to_string()).unwrap();
    for f in ["configuration_deepseek.py", "modeling_deepseek.py", "tokenization_x.py", "unrelated.py"] {
        std::fs::write(base.join(f), format!("# {f}\n")).unwrap();
    }
    let out = root.path().join("run");
    finetune::train::run(&recipe(V2, &out, &["train.max_steps=1", &format!("model.path={}", base.display())])).unwrap();
    let adapter = finetune::export::PeftAdapter::open(&out.join("adapter")).unwrap();
    let merged = root.path().join("merged");
    let md = ModelDir { dir: base.clone(), name: String::new(), commit: None, gguf: None };
    finetune::export::merge(&md, &adapter, &merged, &finetune::export::ExportOptions { merge: true, no_verify: true, ..Default::default() }).unwrap();
    for (f, copied) in [("configuration_deepseek.py", true), ("modeling_deepseek.py", true), ("tokenization_x.py", false), ("unrelated.py", false)] {
        assert_eq!(merged.join(f).is_file(), copied, "{f}");
    }
}
