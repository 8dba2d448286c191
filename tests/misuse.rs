//! Trust under misuse: what a careless or hostile user does to runs, model folders and
//! adapters ends in a clear error or in the right result, never in a wrong result with exit 0
//! or a lost run. Each test is a case that went wrong before it was fixed.

mod common;
use candle_core::{DType, Tensor};
use common::*;
use finetune::recipe::LoadedRecipe;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const RECIPE: &str = r#"
[model]
path = "../model"
[lora]
rank = 4
alpha = 8
targets = ["q_proj", "v_proj"]
[data]
train = "../data"
max_seq_len = 32
[train]
max_steps = 4
micro_batch_size = 2
lr = 5e-3
seed = 3
[checkpoint]
every_steps = 1
keep_last = 2
[output]
dir = "out"
"#;

fn train(dir: &Path, extra: &[&str]) -> finetune::Result<finetune::train::RunSummary> {
    let o: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    finetune::train::run(&LoadedRecipe::load(&dir.join("recipe.toml"), &o)?)
}

fn steps_of(dir: &Path) -> Vec<u64> {
    read_metrics(&dir.join("out/metrics.jsonl")).iter().map(|m| m["step"].as_u64().unwrap()).collect()
}

fn checkpoint_steps(out: &Path) -> Vec<usize> {
    let mut v: Vec<usize> = finetune::checkpoint::list(out).into_iter().map(|(s, _)| s).collect();
    v.sort();
    v
}

// ------------------------------------------------------------------ runs and checkpoints

#[test]
fn a_second_run_on_a_busy_folder_is_refused_at_once_and_the_first_is_untouched() {
    let root = tiny_workspace(23, (4, 18), None);
    let dir = run_dir(root.path(), "run", RECIPE);
    let long = ["train.max_steps=60", "checkpoint.every_steps=5"];
    let mut first = spawn(&dir, &long);
    wait_for_steps(&dir, 2, &mut first);
    let started = Instant::now();
    let second = spawn(&dir, &long).wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success(), "the second run must be refused: {err}");
    assert!(started.elapsed() < Duration::from_secs(20), "refused at once, not after training");
    assert!(err.contains("in use by another finetune run") && err.contains(&format!("pid {}", first.id())) && err.contains("output.dir"), "{err}");
    assert!(err.contains(&dir.join("out").display().to_string()), "names the folder: {err}");
    let out = first.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(steps_of(&dir), (1..=60).collect::<Vec<_>>(), "every metrics line of the first run is there");
    assert_eq!(checkpoint_steps(&dir.join("out")), vec![55, 60]);
}

#[test]
fn a_sigkilled_run_leaves_its_folder_free_for_the_next() {
    let root = tiny_workspace(23, (4, 18), None);
    let dir = run_dir(root.path(), "run", RECIPE);
    let long = ["train.max_steps=100000"];
    let mut child = spawn(&dir, &long);
    wait_for_steps(&dir, 3, &mut child);
    child.kill().unwrap();
    child.wait().unwrap();
    let s = train(&dir, &["train.max_steps=5"]).expect("the lock died with its process");
    assert!(s.steps.last().is_some_and(|m| m.step == 5));
}

#[test]
fn resume_never_sets_the_old_run_aside_and_its_checkpoints_survive_pruning() {
    let root = tiny_workspace(23, (4, 18), None);
    let dir = run_dir(root.path(), "run", RECIPE);
    train(&dir, &["train.max_steps=6"]).unwrap();
    let out = dir.join("out");
    assert_eq!(checkpoint_steps(&out), vec![5, 6]);

    // A new, shorter run: its step-1..3 checkpoints must not be pruned against steps 5 and 6.
    let s = train(&dir, &["checkpoint.resume=never", "train.max_steps=3"]).unwrap();
    assert_eq!(s.steps.first().map(|m| m.step), Some(1), "a new run starts at step 1");
    assert_eq!(checkpoint_steps(&out), vec![2, 3]);
    assert_eq!(s.checkpoint.as_deref(), Some(out.join("checkpoints/step-000003").as_path()));
    assert!(s.checkpoint.as_ref().unwrap().is_dir(), "the checkpoint the run reports exists");
    assert_eq!(steps_of(&dir), vec![1, 2, 3]);
    // The old run is set aside whole, not deleted.
    let previous: Vec<_> = std::fs::read_dir(out.join("previous")).unwrap().flatten().map(|e| e.path()).collect();
    assert_eq!(previous.len(), 1, "{previous:?}");
    assert_eq!(checkpoint_steps(&previous[0]), vec![5, 6]);
    assert_eq!(read_metrics(&previous[0].join("metrics.jsonl")).len(), 6);

    // The default rerun continues the new run, not the old one.
    let s = train(&dir, &["train.max_steps=4"]).unwrap();
    assert_eq!(s.steps.iter().map(|m| m.step).collect::<Vec<_>>(), vec![4]);
    assert_eq!(steps_of(&dir), vec![1, 2, 3, 4]);
}

#[test]
fn auto_resume_with_only_damaged_checkpoints_stops_and_changes_nothing() {
    let root = tiny_workspace(23, (4, 18), None);
    let dir = run_dir(root.path(), "run", RECIPE);
    train(&dir, &["train.max_steps=2"]).unwrap();
    let out = dir.join("out");
    for (_, ck) in finetune::checkpoint::list(&out) {
        std::fs::write(ck.join("state.json"), "{}").unwrap();
    }
    let metrics = std::fs::read(out.join("metrics.jsonl")).unwrap();
    let e = train(&dir, &["train.max_steps=4"]).expect_err("must not restart silently").to_string();
    assert!(e.contains("none is valid") && e.contains("step-000002") && e.contains("checkpoint.resume = \"never\""), "{e}");
    assert_eq!(std::fs::read(out.join("metrics.jsonl")).unwrap(), metrics, "metrics.jsonl untouched");
    assert_eq!(checkpoint_steps(&out), vec![1, 2]);
    // The way out it names works, and keeps the damaged run.
    let s = train(&dir, &["train.max_steps=2", "checkpoint.resume=never"]).unwrap();
    assert_eq!(s.steps.len(), 2);
    assert!(out.join("previous").is_dir());
}

#[test]
fn resuming_from_an_older_checkpoint_sets_the_newer_ones_aside() {
    let root = tiny_workspace(23, (4, 18), None);
    let dir = run_dir(root.path(), "run", RECIPE);
    train(&dir, &["train.max_steps=4", "checkpoint.keep_last=0", "output.tensorboard=true"]).unwrap();
    let out = dir.join("out");
    let events = |d: &Path| std::fs::read_dir(d.join("tensorboard")).unwrap().flatten().map(|e| std::fs::read(e.path()).unwrap()).collect::<Vec<_>>();
    let before = events(&out);
    let s = train(&dir, &["train.max_steps=3", "checkpoint.keep_last=0", "checkpoint.resume=out/checkpoints/step-000002", "output.tensorboard=true"]).unwrap();
    assert_eq!(s.steps.iter().map(|m| m.step).collect::<Vec<_>>(), vec![3]);
    assert_eq!(checkpoint_steps(&out), vec![1, 2, 3]);
    let previous: Vec<_> = std::fs::read_dir(out.join("previous")).unwrap().flatten().map(|e| e.path()).collect();
    assert_eq!(checkpoint_steps(&previous[0]), vec![3, 4]);
    assert_eq!(read_metrics(&previous[0].join("metrics.jsonl")).len(), 4, "the abandoned steps' metrics are kept");
    assert_eq!(events(&previous[0]), before, "and their TensorBoard events, which the resumed run cuts back");
}

#[test]
fn resume_accepts_changes_to_export_and_eval_cadence() {
    let root = tiny_workspace(23, (4, 18), None);
    let dir = run_dir(root.path(), "run", RECIPE);
    train(&dir, &["train.max_steps=2", "data.eval_fraction=0.25"]).unwrap();
    let s = train(&dir, &["train.max_steps=3", "data.eval_fraction=0.25", "export.dtype=bf16", "train.eval_every=5"]).unwrap();
    assert_eq!(s.steps.iter().map(|m| m.step).collect::<Vec<_>>(), vec![3]);
}

// ------------------------------------------------------------------ models as their index says

/// Split the tiny model's single file into two shards with an index, optionally planting a
/// zeroed copy of `stale` in the shard the index does not name for it.
fn shard_model(model: &Path, stale: Option<&str>, list_stale: bool) {
    let all = load_tensors(&model.join("model.safetensors"));
    let mut names: Vec<&String> = all.keys().collect();
    names.sort();
    let (a, b) = names.split_at(names.len() / 2);
    let mut map = serde_json::Map::new();
    let mut shards: Vec<HashMap<String, Tensor>> = vec![HashMap::new(), HashMap::new()];
    for (i, part) in [a, b].iter().enumerate() {
        for n in part.iter() {
            shards[i].insert(n.to_string(), all[*n].clone());
            map.insert(n.to_string(), format!("model-0000{}-of-00002.safetensors", i + 1).into());
        }
    }
    if let Some(name) = stale {
        let home = if shards[0].contains_key(name) { 0 } else { 1 };
        shards[1 - home].insert(name.to_string(), all[name].zeros_like().unwrap());
        if !list_stale {
            map.remove(name);
            // Unlisted: the real copy is gone too, so both copies are "unlisted duplicates".
        }
    }
    for (i, s) in shards.iter().enumerate() {
        candle_core::safetensors::save(s, model.join(format!("model-0000{}-of-00002.safetensors", i + 1))).unwrap();
    }
    std::fs::remove_file(model.join("model.safetensors")).unwrap();
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(model.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

#[test]
fn a_stale_copy_of_a_tensor_in_another_shard_is_never_read() {
    let root = tiny_workspace(23, (4, 18), None);
    let dir = run_dir(root.path(), "run", RECIPE);
    let reference = train(&dir, &["train.max_steps=2", "output.dir=ref"]).unwrap();
    let losses = |s: &finetune::train::RunSummary| s.steps.iter().map(|m| (m.loss, m.grad_norm)).collect::<Vec<_>>();
    // A zeroed head would give loss ln(256) = 5.545 and grad_norm 0; a zeroed embedding (read
    // by rows from its shard, `weights::RowTable`) other losses too.
    for (i, name) in ["lm_head.weight", "model.embed_tokens.weight"].into_iter().enumerate() {
        let model = root.path().join("model");
        if i > 0 {
            // The same tiny model again (seed 0), single-file, before sharding it another way.
            std::fs::remove_dir_all(&model).unwrap();
            finetune::synth::write_model(&model, &finetune::synth::TinyShape::default(), 0, 1).unwrap();
        }
        shard_model(&model, Some(name), true);
        let s = train(&dir, &["train.max_steps=2", &format!("output.dir=run{i}")]).unwrap();
        assert_eq!(losses(&s), losses(&reference), "the index's copy of {name} is the one read");
    }
}

#[test]
fn a_tensor_in_two_shards_that_the_index_does_not_settle_is_an_error() {
    let root = tiny_workspace(23, (4, 18), None);
    let dir = run_dir(root.path(), "run", RECIPE);
    shard_model(&root.path().join("model"), Some("lm_head.weight"), false);
    let e = train(&dir, &[]).expect_err("ambiguous copies").to_string();
    assert!(e.contains("lm_head.weight") && e.contains("model.safetensors.index.json"), "{e}");
    assert!(!dir.join("out").exists(), "nothing written");
}

/// Rewrite the tiny model's file with `name` replaced by `f(tensor)`.
fn edit_weight(model: &Path, name: &str, f: impl Fn(&Tensor) -> Tensor) {
    let path = model.join("model.safetensors");
    let mut all = load_tensors(&path);
    let t = f(&all[name]);
    all.insert(name.to_string(), t);
    candle_core::safetensors::save(&all, &path).unwrap();
}

#[test]
fn an_integer_weight_is_an_error_naming_the_tensor() {
    let root = tiny_workspace(23, (4, 18), None);
    let dir = run_dir(root.path(), "run", RECIPE);
    let name = "model.layers.0.self_attn.k_proj.weight";
    edit_weight(&root.path().join("model"), name, |t| t.to_dtype(DType::I64).unwrap());
    let e = train(&dir, &[]).expect_err("an I64 weight must not be trained on").to_string();
    assert!(e.contains(name) && e.contains("I64") && e.contains("model.safetensors"), "{e}");
}

#[test]
fn a_resume_refused_for_its_global_batch_moves_nothing() {
    // The newer checkpoints used to be set aside before the global batch was compared.
    let root = tiny_workspace(23, (4, 18), None);
    let dir = run_dir(root.path(), "run", RECIPE);
    train(&dir, &["train.max_steps=4", "checkpoint.keep_last=0"]).unwrap();
    let out = dir.join("out");
    let e = train(&dir, &["train.max_steps=4", "checkpoint.keep_last=0", "train.grad_accum_steps=2", "checkpoint.resume=out/checkpoints/step-000002"]).unwrap_err().to_string();
    assert!(e.contains("train.grad_accum_steps"), "{e}");
    assert_eq!(checkpoint_steps(&out), vec![1, 2, 3, 4]);
    assert!(out.join("adapter").is_dir() && !out.join("previous").exists());
}

#[test]
fn a_sliding_window_that_covers_the_positions_bounds_max_seq_len() {
    // Accepted because it covers max_position_embeddings, the window still holds for longer
    // sequences, which full attention would get wrong.
    let root = tiny_workspace(23, (4, 18), None);
    let dir = run_dir(root.path(), "run", RECIPE);
    edit_json(&root.path().join("model/config.json"), |c| {
        c["layer_types"] = serde_json::json!(["sliding_attention", "sliding_attention"]);
        c["sliding_window"] = 16.into();
        c["max_position_embeddings"] = 16.into();
    });
    let e = train(&dir, &[]).expect_err("max_seq_len 32 past a window of 16").to_string();
    assert!(e.contains("data.max_seq_len") && e.contains("sliding_window = 16") && e.contains("at most 16"), "{e}");
    train(&dir, &["data.max_seq_len=16", "train.max_steps=1"]).unwrap();
}

#[test]
fn a_config_with_fewer_layers_than_the_weights_is_an_error() {
    let root = tiny_workspace(23, (4, 18), None);
    let dir = run_dir(root.path(), "run", RECIPE);
    edit_json(&root.path().join("model/config.json"), |c| c["num_hidden_layers"] = 1.into());
    let e = train(&dir, &[]).expect_err("a truncated model must not train").to_string();
    assert!(e.contains("num_hidden_layers = 1") && e.contains("model.layers.1."), "{e}");
}

#[test]
fn nan_in_the_base_is_named_as_the_cause_not_the_learning_rate() {
    let root = tiny_workspace(23, (4, 18), None);
    let dir = run_dir(root.path(), "run", RECIPE);
    edit_weight(&root.path().join("model"), "model.norm.weight", |t| (t * f64::NAN).unwrap());
    let e = train(&dir, &[]).expect_err("NaN loss").to_string();
    assert!(e.contains("before any update") && e.contains("base model") && !e.contains("lower train.lr"), "{e}");
}

// ------------------------------------------------------------------ adapters

fn trained_adapter(root: &Path) -> std::path::PathBuf {
    let dir = run_dir(root, "first", RECIPE);
    train(&dir, &["train.max_steps=1"]).unwrap();
    dir.join("out/adapter")
}

#[test]
fn init_from_refuses_the_adapters_export_refuses() {
    let root = tiny_workspace(23, (4, 18), None);
    let adapter = trained_adapter(root.path());
    let dir = run_dir(root.path(), "run", RECIPE);
    for (i, (key, value, what)) in [
        ("use_rslora", serde_json::json!(true), "rsLoRA"),
        ("use_dora", serde_json::json!(true), "DoRA"),
        ("fan_in_fan_out", serde_json::json!(true), "fan_in_fan_out"),
        ("alpha_pattern", serde_json::json!({"q_proj": 16}), "alpha_pattern"),
        ("rank_pattern", serde_json::json!({"q_proj": 2}), "rank_pattern"),
        // PEFT writes these itself (0.21): loaded as plain LoRA they computed something else.
        ("alora_invocation_tokens", serde_json::json!([7, 8]), "Activated LoRA"),
        ("target_parameters", serde_json::json!(["mlp.experts.gate_up_proj"]), "target_parameters"),
        ("layer_replication", serde_json::json!([[0, 2], [1, 2]]), "layer replication"),
        ("use_qalora", serde_json::json!(true), "QALoRA"),
        ("init_lora_weights", serde_json::json!("pissa_niter_4"), "changes the base weights"),
        ("init_lora_weights", serde_json::json!("olora"), "changes the base weights"),
        ("init_lora_weights", serde_json::json!("loftq"), "changes the base weights"),
        ("init_lora_weights", serde_json::json!("corda"), "changes the base weights"),
        ("modules_to_save", serde_json::json!(["lm_head"]), "modules_to_save"),
        ("bias", serde_json::json!("lora_only"), "trained base biases"),
        ("lora_bias", serde_json::json!(true), "lora_bias"),
        ("layers_to_transform", serde_json::json!([0]), "layers_to_transform"),
        ("exclude_modules", serde_json::json!(["o_proj"]), "exclude_modules"),
        // Past an f32: a GGUF adapter stored alpha = inf with exit 0.
        ("lora_alpha", serde_json::json!(1e39), "lora_alpha"),
        ("lora_alpha", serde_json::json!(0), "lora_alpha"),
    ]
    .into_iter()
    .enumerate()
    {
        let bad = root.path().join(format!("bad-{i}-{key}"));
        copy_dir(&adapter, &bad);
        edit_json(&bad.join("adapter_config.json"), |c| c[key] = value.clone());
        let init = format!("lora.init_from={}", bad.display());
        let trained = train(&dir, &[&init]).err().unwrap_or_else(|| panic!("{key}: init_from accepted it")).to_string();
        let exported = finetune::export::PeftAdapter::open(&bad).err().expect("export refuses it").to_string();
        assert!(trained.contains(what), "{key}: {trained}");
        assert_eq!(trained, exported, "{key}: one reader, one message");
    }
    // Initialisations that leave the base as it is load as the plain LoRA they are.
    for (i, value) in [serde_json::json!(true), serde_json::json!("gaussian"), serde_json::json!("eva"), serde_json::json!(null)].into_iter().enumerate() {
        let ok = root.path().join(format!("ok-{i}"));
        copy_dir(&adapter, &ok);
        edit_json(&ok.join("adapter_config.json"), |c| {
            c["init_lora_weights"] = value.clone();
            c["alora_invocation_tokens"] = serde_json::Value::Null;
            c["target_parameters"] = serde_json::json!([]);
            // As PEFT writes a plain LoRA's config.
            c["bias"] = serde_json::json!("none");
            c["modules_to_save"] = serde_json::Value::Null;
            c["layers_pattern"] = serde_json::json!("layers");
        });
        finetune::export::PeftAdapter::open(&ok).unwrap_or_else(|e| panic!("init_lora_weights = {value}: {e}"));
    }
}

/// What PEFT 0.21 writes for `gate_proj`/`up_proj`/`down_proj` targets on a transformers 5
/// MoE model: LoRA on the stacked expert parameters, with a rank_pattern for them. Refused
/// for the cause (`target_parameters`), not the rank_pattern beside it; an adapter whose
/// keys are stacked with that key edited out is refused by its keys.
#[test]
fn an_adapter_on_stacked_experts_is_refused_for_what_it_is() {
    let root = tiny_workspace(23, (4, 18), None);
    let adapter = trained_adapter(root.path());
    let both = root.path().join("both");
    copy_dir(&adapter, &both);
    edit_json(&both.join("adapter_config.json"), |c| {
        c["target_parameters"] = serde_json::json!(["mlp.experts.gate_up_proj"]);
        c["rank_pattern"] = serde_json::json!({"mlp.experts.gate_up_proj": 4});
    });
    let e = finetune::export::PeftAdapter::open(&both).err().unwrap().to_string();
    assert!(e.contains("`target_parameters` is set"), "{e}");
    let stacked = root.path().join("stacked");
    copy_dir(&adapter, &stacked);
    let file = stacked.join("adapter_model.safetensors");
    let mut t = load_tensors(&file);
    let (k, v) = t.iter().next().map(|(k, v)| (k.clone(), v.clone())).unwrap();
    t.remove(&k);
    t.insert("base_model.model.model.layers.0.mlp.experts.lora_A.weight".into(), v);
    candle_core::safetensors::save(&t, &file).unwrap();
    let e = finetune::export::PeftAdapter::open(&stacked).err().unwrap().to_string();
    assert!(e.contains("mlp.experts.lora_A.weight") && e.contains("stacked"), "{e}");
}

/// PEFT writes full module paths for `target_modules = "all-linear"` and matches entries by
/// their dotted tail: such an adapter loads as the leaf names it covers; one whose paths name
/// only some layers is refused (its other layers have no tensors), never half applied.
#[test]
fn target_modules_written_as_full_paths_load_as_their_leaf_names() {
    let root = tiny_workspace(23, (4, 18), None);
    let adapter = trained_adapter(root.path());
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(adapter.join("adapter_config.json")).unwrap()).unwrap();
    let leaves: Vec<String> = serde_json::from_value(cfg["target_modules"].clone()).unwrap();
    let layers = finetune::config::ModelConfig::from_file(&root.path().join("model/config.json")).unwrap().num_hidden_layers;
    let path_of = |l: usize, t: &str| format!("model.layers.{l}.{}.{t}", if ["gate_proj", "up_proj", "down_proj"].contains(&t) { "mlp" } else { "self_attn" });
    let logits = |a: &Path| {
        let dir = finetune::weights::ModelDir { dir: root.path().join("model"), name: String::new(), commit: None, gguf: None };
        let (m, ad) = finetune::generate::Generator::load_model(&dir, Some(a)).unwrap();
        m.logits(&candle_core::Tensor::new(&[[3u32, 5, 7]], &candle_core::Device::Cpu).unwrap(), &ad).unwrap()
    };
    let full = root.path().join("full-paths");
    copy_dir(&adapter, &full);
    edit_json(&full.join("adapter_config.json"), |c| c["target_modules"] = serde_json::json!((0..layers).flat_map(|l| leaves.iter().map(move |t| path_of(l, t))).collect::<Vec<_>>()));
    assert_eq!(max_abs_diff(&logits(&full), &logits(&adapter)), 0.0);
    let some = root.path().join("some-layers");
    copy_dir(&adapter, &some);
    edit_json(&some.join("adapter_config.json"), |c| c["target_modules"] = serde_json::json!(leaves.iter().map(|t| path_of(0, t)).collect::<Vec<_>>()));
    // (The tensors of every layer are there; the paths name layer 0's: PEFT would apply only
    // those, so loading all of them would be wrong.)
    let e = finetune::export::PeftAdapter::open(&some).and_then(|a| a.load(&finetune::config::ModelConfig::from_file(&root.path().join("model/config.json")).unwrap()));
    assert!(layers == 1 || e.is_err(), "an adapter whose target_modules name only layer 0 loaded whole");
}

#[test]
fn an_adapter_holding_nan_is_refused_naming_the_tensor() {
    let root = tiny_workspace(23, (4, 18), None);
    let adapter = trained_adapter(root.path());
    let file = adapter.join("adapter_model.safetensors");
    let mut t = load_tensors(&file);
    let key = t.keys().find(|k| k.contains("lora_B")).unwrap().clone();
    let nan = (&t[&key] * f64::NAN).unwrap();
    t.insert(key.clone(), nan);
    candle_core::safetensors::save(&t, &file).unwrap();
    let dir = run_dir(root.path(), "run", RECIPE);
    let e = train(&dir, &[&format!("lora.init_from={}", adapter.display())]).expect_err("NaN adapter").to_string();
    assert!(e.contains(&key) && e.contains("NaN"), "{e}");
}

// ------------------------------------------------------------------ generate

#[test]
fn generate_refuses_a_nan_temperature_and_nan_logits() {
    let root = tiny_workspace(23, (4, 18), None);
    let model = root.path().join("model");
    finetune::synth::write_tokenizer(&model, 256).unwrap();
    let dir = finetune::weights::ModelDir::resolve(model.to_str().unwrap(), Path::new(".")).unwrap();
    let g = finetune::generate::Generator::load(&dir, None).unwrap();
    let opts = |temperature: f64| finetune::generate::SampleOptions { max_new_tokens: 4, temperature, ..Default::default() };
    let e = g.generate_ids(&[1, 2, 3], &opts(f64::NAN)).expect_err("NaN temperature").to_string();
    assert!(e.contains("--temperature"), "{e}");
    g.generate_ids(&[1, 2, 3], &opts(0.7)).expect("a finite temperature samples");

    edit_weight(&model, "model.norm.weight", |t| (t * f64::NAN).unwrap());
    let g = finetune::generate::Generator::load(&dir, None).unwrap();
    let e = g.generate_ids(&[1, 2, 3], &opts(0.0)).expect_err("NaN logits").to_string();
    assert!(e.contains("NaN"), "{e}");
}

/// transformers' `generate` applies generation_config.json's repetition_penalty, greedy too
/// (Qwen2.5-Instruct ships 1.05): so does ours, and `--repetition-penalty 1` turns it off.
/// Tokens from `tests/fixtures/generate-penalty/make.py` (transformers 5.24).
#[test]
fn generate_follows_generation_config_s_repetition_penalty_as_transformers() {
    let root = tempfile::tempdir().unwrap();
    let model = root.path().join("model");
    copy_dir(&fixture("parity-llama-gqa").join("model"), &model);
    finetune::synth::write_tokenizer(&model, 256).unwrap();
    std::fs::write(model.join("generation_config.json"), r#"{"repetition_penalty": 1.3}"#).unwrap();
    let want: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("generate-penalty").join("expected.json")).unwrap()).unwrap();
    let ids = |k: &str| -> Vec<u32> { serde_json::from_value(want[k].clone()).unwrap() };
    let dir = finetune::weights::ModelDir::resolve(model.to_str().unwrap(), Path::new(".")).unwrap();
    let g = finetune::generate::Generator::load(&dir, None).unwrap();
    let opts = finetune::generate::SampleOptions { max_new_tokens: 24, ..Default::default() };
    assert_eq!(g.generate_ids(&ids("prompt"), &opts).unwrap(), ids("tokens_with_penalty"));
    let off = finetune::generate::SampleOptions { repetition_penalty: Some(1.0), ..opts };
    assert_eq!(g.generate_ids(&ids("prompt"), &off).unwrap(), ids("tokens_without"));
}

#[test]
fn weights_we_write_are_readable_as_the_umask_allows() {
    use std::os::unix::fs::PermissionsExt;
    let root = tiny_workspace(23, (4, 18), None);
    let dir = run_dir(root.path(), "run", RECIPE);
    train(&dir, &["train.max_steps=1"]).unwrap();
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let umask = status.lines().find_map(|l| l.strip_prefix("Umask:")).map(|v| u32::from_str_radix(v.trim(), 8).unwrap()).unwrap();
    for f in ["out/adapter/adapter_model.safetensors", "out/checkpoints/step-000001/optimizer.safetensors", "out/metrics.jsonl"] {
        let mode = std::fs::metadata(dir.join(f)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o666 & !umask, "{f} has mode {mode:o} under umask {umask:o}");
    }
}

#[test]
fn eval_on_data_without_the_alpaca_columns_names_them() {
    let root = tiny_workspace(23, (4, 18), None);
    let model = root.path().join("model");
    finetune::synth::write_tokenizer(&model, 256).unwrap();
    // A tokenized dataset: input_ids and labels, no instruction/output.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_finetune"))
        .args(["eval", "--model"])
        .arg(&model)
        .arg("--data")
        .arg(root.path().join("data"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("`instruction`") && err.contains("`output`") && err.contains("data"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_resume_path_that_cannot_be_continued_moves_nothing() {
    let root = tiny_workspace(23, (4, 18), None);
    let dir = run_dir(root.path(), "run", RECIPE);
    train(&dir, &["train.max_steps=4", "checkpoint.keep_last=0"]).unwrap();
    let out = dir.join("out");
    let before = (checkpoint_steps(&out), std::fs::read(out.join("metrics.jsonl")).unwrap());
    // A mistyped path, and an older checkpoint of this folder under a changed LoRA shape.
    let typo = train(&dir, &["checkpoint.resume=out/checkpoints/step-4"]).expect_err("no such checkpoint").to_string();
    assert!(typo.contains("checkpoint.resume") && typo.contains("nothing was changed"), "{typo}");
    let shape = train(&dir, &["checkpoint.resume=out/checkpoints/step-000002", "lora.rank=8"]).expect_err("rank changed").to_string();
    assert!(shape.contains("lora.rank") && shape.contains("nothing was changed"), "{shape}");
    assert!(!out.join("previous").exists(), "nothing set aside");
    assert_eq!((checkpoint_steps(&out), std::fs::read(out.join("metrics.jsonl")).unwrap()), before);
    assert!(out.join("adapter").is_dir());
    // And the folder's run continues as if nothing had happened.
    let s = train(&dir, &["train.max_steps=5", "checkpoint.keep_last=0"]).unwrap();
    assert_eq!(s.steps.iter().map(|m| m.step).collect::<Vec<_>>(), vec![5]);
}

#[test]
fn an_output_dir_that_is_the_model_or_data_folder_or_a_root_is_refused_before_anything_is_written() {
    // The run wrote adapter/, checkpoints/ and metrics.jsonl among the weights, into the data
    // folder (whose next run read metrics.jsonl as data), or into `/`.
    let root = tiny_workspace(23, (4, 18), None);
    let dir = run_dir(root.path(), "run", RECIPE);
    let listing = |p: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(p).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    };
    for (out, key) in [("../model", "model.path"), ("../data", "data.train"), ("/", "filesystem root")] {
        let watched = if out == "/" { PathBuf::from("/") } else { dir.join(out) };
        let before = listing(&watched);
        let e = train(&dir, &[&format!("output.dir={out}")]).err().unwrap_or_else(|| panic!("{out}: accepted")).to_string();
        assert!(e.contains("output.dir") && e.contains(key), "{out}: {e}");
        assert_eq!(listing(&watched), before, "{out}: nothing written");
    }
    // A folder inside the model's is a folder of its own, and what is written there (another
    // run, a merged export) is not the model's files: the first run still resumes and exports.
    train(&dir, &["output.dir=../model/run-1", "train.max_steps=1"]).unwrap();
    train(&dir, &["output.dir=../model/run-2", "train.max_steps=1"]).unwrap();
    let model = finetune::weights::ModelDir { dir: dir.join("../model"), name: String::new(), commit: None, gguf: None };
    finetune::train::check_export_base(&dir.join("../model/run-1"), None, &model).unwrap();
    train(&dir, &["output.dir=../model/run-1", "train.max_steps=2"]).unwrap();
}

#[test]
fn an_output_dir_that_is_a_file_or_an_adapter_path_at_a_runs_folder_names_what_to_fix() {
    let root = tiny_workspace(23, (4, 18), None);
    let dir = run_dir(root.path(), "run", RECIPE);
    // Named before the model loads, by its key (was "File exists (os error 17)" after it).
    std::fs::write(dir.join("taken"), b"notes").unwrap();
    let e = train(&dir, &["output.dir=\"taken\""]).unwrap_err().to_string();
    assert!(e.contains("`output.dir`") && e.contains("is not a folder"), "{e}");
    assert_eq!(std::fs::read(dir.join("taken")).unwrap(), b"notes");
    // An adapter path at the run's folder (or a checkpoint's) points at its adapter/.
    train(&dir, &["train.max_steps=1"]).unwrap();
    for at in [dir.join("out"), dir.join("out/checkpoints/step-000001")] {
        let e = finetune::lora::AdapterConfig::read(&at).err().unwrap().to_string();
        assert!(e.contains(&at.join("adapter").display().to_string()) && e.contains("run's or checkpoint's folder"), "{e}");
    }
}
