//! The command line on bad input: each case exits non-zero with one clear message naming the
//! file or key, no panic, no backtrace, and no output folder.

mod common;
use arrow_array::{ArrayRef, RecordBatch, StringArray};
use finetune::synth::{write_model, write_tokenized_dataset, TinyShape};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

const RECIPE: &str = r#"
[model]
path = "model"
[lora]
rank = 4
alpha = 8
[data]
train = "data"
[train]
max_steps = 2
micro_batch_size = 2
lr = 1e-3
[output]
dir = "out"
"#;

/// A tiny model + dataset + recipe in a temp folder.
fn setup() -> tempfile::TempDir {
    common::tiny_workspace(8, (4, 12), Some(RECIPE))
}

fn run(dir: &Path, extra: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_finetune"))
        .arg("--recipe")
        .arg(dir.join("recipe.toml"))
        .args(extra.iter().flat_map(|s| ["--set", s]))
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).to_string())
}

/// Fails cleanly: non-zero, names `needles`, no panic/backtrace, nothing written.
fn assert_clean_failure(dir: &Path, extra: &[&str], needles: &[&str]) {
    let (ok, err) = run(dir, extra);
    assert!(!ok, "expected failure, got success; stderr:\n{err}");
    for n in needles {
        assert!(err.contains(n), "stderr should mention {n:?}:\n{err}");
    }
    assert_eq!(err.lines().filter(|l| l.starts_with("error: ")).count(), 1, "one clear message:\n{err}");
    for bad in ["panicked", "stack backtrace", "RUST_BACKTRACE", "   0: "] {
        assert!(!err.contains(bad), "stderr contains {bad:?}:\n{err}");
    }
    assert!(!dir.join("out").exists(), "output folder was created on bad input");
}

#[test]
fn the_setup_itself_trains() {
    let d = setup();
    let (ok, err) = run(d.path(), &[]);
    assert!(ok, "{err}");
    assert!(d.path().join("out/adapter/adapter_model.safetensors").is_file());
    assert!(err.contains("trainable params: "), "{err}");
}

/// train_on_prompt leaves a pre-tokenized row's `labels` alone (as TRL does), and says so once
/// rather than doing nothing in silence.
#[test]
fn train_on_prompt_on_rows_with_labels_says_it_keeps_them() {
    let d = setup();
    let (ok, err) = run(d.path(), &["data.train_on_prompt=true"]);
    assert!(ok, "{err}");
    assert_eq!(err.matches("data.train_on_prompt = true leaves rows that carry `labels`").count(), 1, "{err}");
    let (ok, err) = run(d.path(), &["output.dir=\"out2\""]);
    assert!(ok && !err.contains("train_on_prompt"), "{err}");
}

#[test]
fn an_error_s_cause_is_said_once() {
    // An I/O error names its file and its OS error; the cause chain used to repeat the latter.
    let d = setup();
    let out = Command::new(env!("CARGO_BIN_EXE_finetune")).args(["report", "--run"]).arg(d.path().join("no-such-run")).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
}

#[test]
fn missing_model_dir_is_named() {
    let d = setup();
    assert_clean_failure(d.path(), &["model.path=no-such-model"], &["no-such-model", "does not exist", "hint: model.path must name"]);
    // `finetune train --recipe` is the same command: its hint names the recipe key too, not
    // the flags of the commands without a recipe.
    let out = Command::new(env!("CARGO_BIN_EXE_finetune")).args(["train", "--recipe"]).arg(d.path().join("recipe.toml")).args(["--set", "model.path=no-such-model"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("hint: model.path must name"), "{err}");
}

#[test]
fn a_truncated_adapter_is_called_damaged_not_a_mismatched_checkpoint() {
    let d = setup();
    let (ok, err) = run(d.path(), &[]);
    assert!(ok, "{err}");
    let f = d.path().join("out/adapter/adapter_model.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() - 100]).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_finetune")).args(["logits", "--model"]).arg(d.path().join("model")).arg("--adapter").arg(d.path().join("out/adapter")).args(["--tokens", "1,5"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("adapter_model.safetensors") && err.contains("hint: the adapter file is damaged or incomplete"), "{err}");
}

#[test]
fn unsupported_architecture_names_config_and_arch() {
    let d = setup();
    let cfg = d.path().join("model/config.json");
    let text = std::fs::read_to_string(&cfg).unwrap().replace("LlamaForCausalLM", "GPT2LMHeadModel");
    std::fs::write(&cfg, text).unwrap();
    assert_clean_failure(d.path(), &[], &["config.json", "GPT2LMHeadModel", "LlamaForCausalLM"]);
}

#[test]
fn truncated_safetensors_names_the_file() {
    let d = setup();
    let f = d.path().join("model/model.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
    assert_clean_failure(d.path(), &[], &["model.safetensors", "not a valid safetensors file"]);
}

#[test]
fn wrong_shape_tensor_names_tensor_and_shapes() {
    let d = setup();
    // Weights with intermediate 96 under a config that says 128.
    let other = tempfile::tempdir().unwrap();
    write_model(other.path(), &TinyShape { inter: 96, ..Default::default() }, 0, 1).unwrap();
    std::fs::copy(other.path().join("model.safetensors"), d.path().join("model/model.safetensors")).unwrap();
    assert_clean_failure(d.path(), &[], &["mlp.gate_proj.weight", "expected shape [128, 64], got [96, 64]"]);
}

#[test]
fn missing_tensor_is_named() {
    let d = setup();
    let cfg = d.path().join("model/config.json");
    let text = std::fs::read_to_string(&cfg).unwrap().replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 3");
    std::fs::write(&cfg, text).unwrap();
    assert_clean_failure(d.path(), &[], &["model.layers.2.", "missing"]);
}

#[test]
fn dataset_without_input_ids_names_the_column() {
    let d = setup();
    let data = d.path().join("data");
    std::fs::remove_dir_all(&data).unwrap();
    std::fs::create_dir_all(&data).unwrap();
    let col: ArrayRef = Arc::new(StringArray::from(vec!["hello", "world"]));
    let batch = RecordBatch::try_from_iter(vec![("text", col)]).unwrap();
    finetune::synth::write_arrow_stream(&data.join("train.arrow"), &[batch]).unwrap();
    assert_clean_failure(d.path(), &[], &["train.arrow", "no `input_ids` column", "text"]);
}

#[test]
fn unknown_recipe_key_is_named_with_suggestion() {
    let d = setup();
    assert_clean_failure(d.path(), &["train.lrr=0.1"], &["`train.lrr`", "did you mean \"lr\""]);
}

#[test]
fn token_id_outside_vocab_names_the_row() {
    let d = setup();
    let data = d.path().join("data");
    std::fs::remove_dir_all(&data).unwrap();
    write_tokenized_dataset(&data, &[(vec![1, 2, 3], vec![1, 2, 3]), (vec![1, 999], vec![1, 999])]).unwrap();
    assert_clean_failure(d.path(), &[], &["row 1", "999", "outside the vocabulary"]);
}

#[test]
fn init_adapter_with_wrong_rank_is_named() {
    let d = setup();
    let (ok, err) = run(d.path(), &[]);
    assert!(ok, "{err}");
    std::fs::rename(d.path().join("out/adapter"), d.path().join("adapter-r4")).unwrap();
    std::fs::remove_dir_all(d.path().join("out")).unwrap();
    assert_clean_failure(d.path(), &["lora.init_from=adapter-r4", "lora.rank=8"], &["adapter-r4", "r = 4", "lora.rank"]);
}

#[test]
fn missing_gpus_and_bad_dist_keys_are_named() {
    let d = setup();
    assert_clean_failure(d.path(), &["dist.devices=[\"cuda:0\", \"cuda:1\"]"], &["dist.devices", "NCCL"]);
    assert_clean_failure(d.path(), &["dist.devices=[\"cuda:3\"]"], &["dist.devices", "cuda:3", "without CUDA"]);
    assert_clean_failure(d.path(), &["dist.zero_stage=2"], &["dist.zero_stage", "0 (replicated base) or 3"]);
    assert_clean_failure(d.path(), &["dist.zero_stage=3", "train.activation_checkpointing=false"], &["dist.zero_stage", "activation_checkpointing"]);
}

/// The binary makes its main thread worker 0 of rayon's pool; with one thread that is the
/// whole pool, so the rank threads' parallel loops run only if the main thread serves the
/// pool while it waits for them. A hang here is the failure: killed after two minutes.
#[test]
fn local_ranks_finish_when_the_main_thread_is_the_whole_thread_pool() {
    let d = setup();
    let mut child = Command::new(env!("CARGO_BIN_EXE_finetune"))
        .arg("--recipe")
        .arg(d.path().join("recipe.toml"))
        .args(["--set", "dist.world_size=2", "--set", "train.grad_accum_steps=2"])
        .env("RAYON_NUM_THREADS", "1")
        .env("CANDLE_NUM_THREADS", "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > std::time::Duration::from_secs(120) {
            child.kill().unwrap();
            panic!("two ranks on a one-thread pool did not finish in 120 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
    assert!(d.path().join("out/adapter/adapter_model.safetensors").is_file());
}

#[test]
fn two_cpu_ranks_train_from_the_command_line_and_report_their_memory() {
    let d = setup();
    let (ok, err) = run(d.path(), &["dist.world_size=2", "dist.zero_stage=3"]);
    assert!(ok, "{err}");
    assert!(err.contains("rank 0: frozen base held") && err.contains("rank 1: frozen base held"), "{err}");
    assert!(d.path().join("out/adapter/adapter_model.safetensors").is_file());
}

#[test]
fn logits_reads_token_ids_without_a_tokenizer() {
    // Parity fixtures' model folders have no tokenizer.json: logits takes ids, so it needs none.
    let d = setup();
    let model = d.path().join("model");
    assert!(!model.join("tokenizer.json").exists());
    let out = Command::new(env!("CARGO_BIN_EXE_finetune")).args(["logits", "--model"]).arg(&model).args(["--tokens", "1,2,3"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = v["logits"].as_array().unwrap();
    assert_eq!(rows.len(), 3);
    assert!(rows.iter().all(|r| r.as_array().is_some_and(|r| r.len() > 3 && r.iter().all(|x| x.as_f64().is_some_and(f64::is_finite)))));
}

#[test]
fn packing_with_token_batches_is_refused_not_ignored() {
    // Token batches group whole records by length and never pack.
    let d = setup();
    assert_clean_failure(d.path(), &["data.packing=true", "data.batch_by=tokens"], &["data.packing", "batch_by"]);
}

#[test]
fn a_closed_stderr_does_not_stop_a_run() {
    // `finetune ... | tee log` after Ctrl-C: the reader is gone, every progress line fails
    // with EPIPE; the run must still train, checkpoint and write its adapter.
    let d = setup();
    let mut child = Command::new(env!("CARGO_BIN_EXE_finetune"))
        .arg("--recipe")
        .arg(d.path().join("recipe.toml"))
        .args(["--set", "train.log_every=1"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stderr.take());
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(d.path().join("out/adapter/adapter_model.safetensors").is_file());
}

#[test]
fn logits_that_are_not_finite_are_an_error_not_json_nulls() {
    // serde_json prints NaN as null: `finetune logits` exited 0 with a page of nulls.
    let d = tempfile::tempdir().unwrap();
    let m = d.path().join("model");
    write_model(&m, &TinyShape::default(), 0, 1).unwrap();
    let file = m.join("model.safetensors");
    let mut t = common::load_tensors(&file);
    let name = "model.layers.0.self_attn.q_proj.weight";
    let w = t[name].flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let bad: Vec<f32> = w.iter().enumerate().map(|(i, &x)| if i == 0 { f32::NAN } else { x }).collect();
    t.insert(name.into(), candle_core::Tensor::from_vec(bad, t[name].shape(), &candle_core::Device::Cpu).unwrap());
    candle_core::safetensors::save(&t, &file).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_finetune")).args(["logits", "--model"]).arg(&m).args(["--tokens", "1,2,3"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("NaN or inf at position") && o.stdout.is_empty(), "{err}");
}

#[test]
fn generate_on_a_gguf_without_a_tokenizer_names_the_gguf_key() {
    // It named the tokenizer.json of finetune's own description cache, a file the user never made.
    let d = tempfile::tempdir().unwrap();
    let s = Command::new(env!("CARGO_BIN_EXE_finetune")).args(["synth", "--out"]).arg(d.path().join("s")).args(["--gguf", "q8_0"]).output().unwrap();
    assert!(s.status.success(), "{}", String::from_utf8_lossy(&s.stderr));
    let o = Command::new(env!("CARGO_BIN_EXE_finetune")).args(["generate", "--model"]).arg(d.path().join("s/model.gguf")).args(["--prompt", "hi"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("model.gguf") && err.contains("tokenizer.ggml.model"), "{err}");
}
