//! Checkpoints: exact resume, atomicity under SIGKILL, signals, NaN, recipe-change rules.

mod common;
use common::*;
use finetune::recipe::LoadedRecipe;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const RECIPE: &str = r#"
[model]
path = "../model"
[lora]
rank = 4
alpha = 8
dropout = 0.1
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]
[data]
train = "../data"
shuffle = true
shuffle_buffer = 7
packing = true
max_seq_len = 32
[train]
max_steps = 8
micro_batch_size = 2
grad_accum_steps = 2
lr = 5e-3
lr_scheduler = "cosine"
warmup_steps = 2
weight_decay = 0.01
seed = 3
[checkpoint]
every_steps = 1
keep_last = 0
[output]
dir = "out"
"#;

/// <tmp>/model, <tmp>/data, and run folders <tmp>/<name>/recipe.toml.
fn setup() -> tempfile::TempDir {
    tiny_workspace(23, (4, 18), None)
}

fn train(dir: &Path, extra: &[&str]) -> finetune::Result<finetune::train::RunSummary> {
    let o: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    finetune::train::run(&LoadedRecipe::load(&dir.join("recipe.toml"), &o)?)
}

/// (step, loss, lr, grad_norm) of each metrics line.
fn metric_lines(dir: &Path) -> Vec<(u64, f64, f64, f64)> {
    read_metrics(&dir.join("out/metrics.jsonl"))
        .iter()
        .map(|m| (m["step"].as_u64().unwrap(), m["loss"].as_f64().unwrap(), m["lr"].as_f64().unwrap(), m["grad_norm"].as_f64().unwrap()))
        .collect()
}

fn adapter_bytes(dir: &Path) -> Vec<u8> {
    std::fs::read(dir.join("out/adapter/adapter_model.safetensors")).unwrap()
}

#[test]
fn resume_from_any_step_reproduces_the_uninterrupted_run_bit_for_bit() {
    check_resume_from_any_step(&[]);
}

#[test]
fn resume_on_the_portable_path_reproduces_the_uninterrupted_run_bit_for_bit() {
    check_resume_from_any_step(&["model.kernels=portable"]);
}

fn check_resume_from_any_step(extra: &[&str]) {
    let root = setup();
    let full = run_dir(root.path(), "full", RECIPE);
    train(&full, extra).unwrap();
    let want = metric_lines(&full);
    assert_eq!(want.len(), 8);
    for k in [1, 2, 5, 7] {
        let part = run_dir(root.path(), &format!("resume-{k}"), RECIPE);
        let ck = format!("out/checkpoints/step-{k:06}");
        copy_dir(&full.join(&ck), &part.join(&ck));
        // The metrics of the steps before the checkpoint, as the stopped run left them.
        let lines: String = std::fs::read_to_string(full.join("out/metrics.jsonl")).unwrap().lines().take(k).map(|l| format!("{l}\n")).collect();
        std::fs::write(part.join("out/metrics.jsonl"), lines).unwrap();
        let s = train(&part, extra).unwrap();
        assert_eq!(s.steps.len(), 8 - k, "resumed at step {k}");
        assert_eq!(metric_lines(&part), want, "metrics after resuming at step {k}");
        assert_eq!(adapter_bytes(&part), adapter_bytes(&full), "adapter bytes after resuming at step {k}");
    }
}

#[test]
fn resume_restores_optimizer_moments() {
    let root = setup();
    let full = run_dir(root.path(), "full", RECIPE);
    train(&full, &["train.max_steps=3"]).unwrap();
    let ck = full.join("out/checkpoints/step-000003");
    let saved = load_tensors(&ck.join("optimizer.safetensors"));
    assert!(saved.keys().any(|k| k.ends_with("lora_A.weight.exp_avg_sq")));
    let cfg = finetune::config::ModelConfig::from_file(&root.path().join("model/config.json")).unwrap();
    let spec = finetune::lora::LoraSpec { rank: 4, alpha: 8.0, dropout: 0.1, targets: vec!["q_proj".into(), "k_proj".into(), "v_proj".into(), "o_proj".into(), "up_proj".into()], routed_experts: false };
    let adapters = finetune::lora::Adapters::init(&cfg, spec, 0, &candle_core::Device::Cpu).unwrap();
    let l = finetune::checkpoint::load(&ck, &adapters).unwrap();
    assert_eq!(l.adam_step, 3);
    assert_eq!(l.state.step, 3);
    let mut off = 0;
    for (key, var) in adapters.params() {
        let n = var.elem_count();
        let want: Vec<f32> = saved[&format!("{key}.exp_avg")].flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(&l.moments.exp_avg[off..off + n], &want[..], "{key}");
        assert!(l.moments.exp_avg_sq[off..off + n].iter().any(|&v| v > 0.0));
        off += n;
    }
}

#[test]
fn auto_resume_skips_a_damaged_checkpoint_and_ignores_half_written_ones() {
    let root = setup();
    let full = run_dir(root.path(), "full", RECIPE);
    train(&full, &["train.max_steps=4"]).unwrap();
    let cks = full.join("out/checkpoints");
    // Newest is damaged; a crash left a temporary and a folder without a manifest.
    let f = cks.join("step-000004/optimizer.safetensors");
    let mut b = std::fs::read(&f).unwrap();
    let n = b.len();
    b[n - 1] ^= 0xFF;
    std::fs::write(&f, b).unwrap();
    std::fs::create_dir_all(cks.join(".tmp-step-000005/adapter")).unwrap();
    std::fs::create_dir_all(cks.join("step-000006")).unwrap();
    let s = train(&full, &["train.max_steps=8"]).unwrap();
    assert!(s.checkpoint.is_some());
    assert_eq!(s.steps.first().map(|m| m.step), Some(4), "resumed from step 3, the newest valid");
    assert!(!cks.join(".tmp-step-000005").exists(), "stale temporary removed");
}

/// `model.dtype` left to "auto" resumes in the dtype the checkpoint was trained in (an older
/// run, whose default was f32, or one moved to a CPU of the other kind), bit for bit as the
/// uninterrupted run; naming another dtype is still an error naming the key.
#[test]
fn a_run_resumed_with_dtype_auto_continues_in_the_dtype_it_was_trained_in() {
    let root = setup();
    let full = run_dir(root.path(), "full", RECIPE);
    let auto = LoadedRecipe::load(&full.join("recipe.toml"), &[]).unwrap().recipe.model.dtype;
    let other = if auto == "bf16" { "f32" } else { "bf16" };
    let trained_in = format!("model.dtype={other}");
    train(&full, &[&trained_in, "train.max_steps=4"]).unwrap();
    let part = run_dir(root.path(), "part", RECIPE);
    let ck = "out/checkpoints/step-000002";
    copy_dir(&full.join(ck), &part.join(ck));
    let lines: String = std::fs::read_to_string(full.join("out/metrics.jsonl")).unwrap().lines().take(2).map(|l| format!("{l}\n")).collect();
    std::fs::write(part.join("out/metrics.jsonl"), lines).unwrap();
    let named = format!("model.dtype={auto}");
    let e = train(&part, &[&named, "train.max_steps=4"]).expect_err("a named dtype change must fail").to_string();
    assert!(e.contains("`model.dtype`"), "{e}");
    let s = train(&part, &["train.max_steps=4"]).unwrap();
    assert_eq!(s.steps.len(), 2);
    assert_eq!(metric_lines(&part), metric_lines(&full));
    assert_eq!(adapter_bytes(&part), adapter_bytes(&full));
}

#[test]
fn changing_the_model_shape_on_resume_is_an_error_naming_the_key() {
    let root = setup();
    let dir = run_dir(root.path(), "run", RECIPE);
    train(&dir, &["train.max_steps=2"]).unwrap();
    let e = train(&dir, &["lora.rank=8"]).expect_err("rank change must fail").to_string();
    assert!(e.contains("`lora.rank`") && e.contains("checkpoint.resume = \"never\""), "{e}");
    let e = train(&dir, &["train.seed=4"]).expect_err("seed change must fail").to_string();
    assert!(e.contains("`train.seed`"), "{e}");
    // max_steps may change (with a warning): the run continues.
    let s = train(&dir, &["train.max_steps=4"]).unwrap();
    assert_eq!(s.steps.iter().map(|m| m.step).collect::<Vec<_>>(), vec![3, 4]);
}

/// A resumed run may split each step's examples otherwise (micro_batch_size x
/// grad_accum_steps x ranks kept, or other passes): what a run that no longer fits its
/// machine needs. It is the same run in exact arithmetic, and says it will not match bit for
/// bit; a step of other examples is still refused, naming the value that restores it.
#[test]
fn a_run_resumed_with_its_steps_split_otherwise_continues_and_says_so() {
    let root = setup();
    // f32 math: a bf16 base rounds each activation, which turns a sum's last-bit difference
    // into a bf16 step (3e-5 apart in the adapter after two steps here).
    let no_dropout = RECIPE.replace("dropout = 0.1", "dropout = 0.0").replace("path = \"../model\"", "path = \"../model\"\ndtype = \"f32\"");
    let full = run_dir(root.path(), "full", &no_dropout);
    train(&full, &["train.max_steps=4"]).unwrap();
    let dir = run_dir(root.path(), "split", &no_dropout);
    train(&dir, &["train.max_steps=2"]).unwrap();
    let resumed = |dir: &Path, extra: &[&str]| {
        let out = spawn(dir, extra).wait_with_output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    // 2 x 2 rows a step -> 1 x 4: the same 4 rows.
    let (ok, said) = resumed(&dir, &["train.max_steps=4", "train.micro_batch_size=1", "train.grad_accum_steps=4"]);
    assert!(ok, "{said}");
    assert!(said.contains("4 micro-batches of 1 row = 4 rows where it ran 2 micro-batches of 2 rows = 4 rows") && said.contains("will not match bit for bit"), "{said}");
    assert!(!said.contains("dropout"), "no dropout, no masks to differ: {said}");
    let (a, b) = (metric_lines(&full), metric_lines(&dir));
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.0, y.0);
        println!("step {}: loss {:e} grad_norm {:e} relative", x.0, (x.1 - y.1).abs() / x.1.abs(), (x.3 - y.3).abs() / x.3.abs());
        assert!((x.1 - y.1).abs() <= 2e-8 * x.1.abs(), "step {}: loss {} vs {}", x.0, x.1, y.1);
    }
    let (ta, tb) = (load_tensors(&full.join("out/adapter/adapter_model.safetensors")), load_tensors(&dir.join("out/adapter/adapter_model.safetensors")));
    let worst = ta.iter().map(|(k, t)| max_abs_diff(t, &tb[k])).fold(0.0, f32::max);
    println!("split otherwise: worst adapter difference {worst:e}");
    // Measured (Xeon, AMX; f32 math, default and portable kernels): adapter 0.97-1.5e-7,
    // loss 2.9-6.7e-9 relative.
    assert!(worst < 3e-7, "{worst}");
    // 1 x 2 rows: not the same examples per step; the error names the accumulation to set.
    let (ok, said) = resumed(&dir, &["train.max_steps=5", "train.micro_batch_size=1", "train.grad_accum_steps=2"]);
    assert!(!ok && said.contains("train.grad_accum_steps") && said.contains("= 4 rows") && said.contains("set train.grad_accum_steps = 4"), "{said}");

    // Passes: 72 rows of 32 tokens are over 2048 tokens, so "auto" checkpointing runs them in
    // passes of 64 rows; a budget set on resume runs them whole. With dropout, a split into
    // other micro-batches says its masks differ.
    let dir = run_dir(root.path(), "passes", RECIPE);
    train(&dir, &["train.max_steps=1", "train.micro_batch_size=72"]).unwrap();
    let (ok, said) = resumed(&dir, &["train.max_steps=2", "train.micro_batch_size=72", "train.activation_memory_mb=100"]);
    assert!(ok && said.contains("passes of 72 rows where it ran 64"), "{said}");
    let (ok, said) = resumed(&dir, &["train.max_steps=3", "train.micro_batch_size=36", "train.grad_accum_steps=4"]);
    assert!(ok && said.contains("4 micro-batches of 36 rows = 144 rows where it ran 2 micro-batches of 72 rows = 144 rows, drawing other lora.dropout masks"), "{said}");
    assert_eq!(metric_lines(&dir).iter().map(|m| m.0).collect::<Vec<_>>(), vec![1, 2, 3]);
}

/// A checkpoint verifies only as a whole: its manifest must list every file a checkpoint has,
/// and the manifest, state.json and the folder's name must say the same step (a manifest that
/// lost its optimizer entry, or a folder renamed to a later step, resumed from wrong state).
#[test]
fn a_checkpoint_whose_manifest_lost_an_entry_or_whose_steps_disagree_does_not_verify() {
    let root = setup();
    let dir = run_dir(root.path(), "run", RECIPE);
    train(&dir, &["train.max_steps=2"]).unwrap();
    let ck = dir.join("out/checkpoints/step-000002");
    assert_eq!(finetune::checkpoint::verify(&ck), Ok(2));
    let manifest = std::fs::read_dir(&ck).unwrap().map(|e| e.unwrap().path()).find(|p| p.extension().is_some_and(|x| x == "json") && p.file_name().unwrap() != "state.json").unwrap();
    let good = std::fs::read_to_string(&manifest).unwrap();
    let mut m: serde_json::Value = serde_json::from_str(&good).unwrap();
    m["files"].as_object_mut().unwrap().remove("optimizer.safetensors");
    std::fs::write(&manifest, m.to_string()).unwrap();
    let e = finetune::checkpoint::verify(&ck).unwrap_err();
    assert!(e.contains("does not list optimizer.safetensors"), "{e}");
    std::fs::write(&manifest, &good).unwrap();
    let moved = dir.join("out/checkpoints/step-000005");
    std::fs::rename(&ck, &moved).unwrap();
    let e = finetune::checkpoint::verify(&moved).unwrap_err();
    assert!(e.contains("named for another step"), "{e}");
}

/// A run resumed with a lower checkpoint.keep_last drops the checkpoints past it before its
/// next save (never the one it resumes from): a run stopped by a full disk freed nothing by
/// lowering keep_last and failed its next save again.
#[test]
fn a_resume_with_a_lower_keep_last_prunes_before_its_next_save() {
    let root = setup();
    let dir = run_dir(root.path(), "run", RECIPE);
    train(&dir, &["train.max_steps=5"]).unwrap();
    let steps = |d: &Path| finetune::checkpoint::list(&d.join("out")).into_iter().map(|(s, _)| s).collect::<Vec<_>>();
    assert_eq!(steps(&dir), [5, 4, 3, 2, 1]);
    // Nothing left to train: no save follows, so only a prune on resume can drop them.
    train(&dir, &["train.max_steps=5", "checkpoint.keep_last=2"]).unwrap();
    assert_eq!(steps(&dir), [5, 4]);
}

#[test]
fn a_model_or_data_path_spelt_another_way_to_the_same_place_resumes() {
    // Relative then absolute, through `..`, or through a symbolic link: the same files (their
    // fingerprints are checked as always). These had been refused as changed keys.
    let root = setup();
    let dir = run_dir(root.path(), "run", RECIPE);
    train(&dir, &["train.max_steps=2"]).unwrap();
    std::os::unix::fs::symlink(root.path().join("model"), root.path().join("link")).unwrap();
    let model = root.path().join("model").canonicalize().unwrap();
    let data = root.path().join("data").canonicalize().unwrap();
    let spelt = [
        format!("model.path=\"{}\"", model.display()),
        format!("data.train=\"{}/../data/\"", data.display()),
        format!("model.path=\"{}\"", root.path().join("link").display()),
    ];
    for (i, set) in spelt.iter().enumerate() {
        let s = train(&dir, &[set.as_str(), &format!("train.max_steps={}", 3 + i)]).unwrap_or_else(|e| panic!("{set}: {e}"));
        assert_eq!(s.steps.iter().map(|m| m.step).collect::<Vec<_>>(), vec![3 + i], "{set}");
    }
    // Another folder is still a change.
    copy_dir(&root.path().join("model"), &root.path().join("model2"));
    let e = train(&dir, &["model.path=\"../model2\"", "train.max_steps=9"]).unwrap_err().to_string();
    assert!(e.contains("`model.path`") && e.contains("changed since the checkpoint"), "{e}");
}

#[test]
fn a_finished_run_given_more_steps_sets_its_old_final_outputs_aside() {
    // Left in place, out/adapter would be the step-2 adapter beside checkpoints of steps 3 and
    // 4 until the run ends (and for good if it is stopped), and `export --run` would take it.
    let root = setup();
    let dir = run_dir(root.path(), "run", RECIPE);
    train(&dir, &["train.max_steps=2"]).unwrap();
    let at_2 = adapter_bytes(&dir);
    train(&dir, &["train.max_steps=4"]).unwrap();
    let prev: Vec<_> = std::fs::read_dir(dir.join("out/previous")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(prev.len(), 1, "{prev:?}");
    assert_eq!(std::fs::read(prev[0].join("adapter/adapter_model.safetensors")).unwrap(), at_2);
    assert!(prev[0].join("summary.json").is_file());
    assert_ne!(adapter_bytes(&dir), at_2, "the final adapter is the step-4 one");
    let resolved = std::fs::read_to_string(dir.join("out/recipe.resolved.toml")).unwrap();
    assert!(resolved.contains("max_steps = 4"), "the recipe the run continued with:\n{resolved}");
    // Fewer steps than the run reached is refused, naming the key, and nothing moves: it had
    // exited 0 as "already complete", recording max_steps = 3 beside the step-4 adapter.
    let at_4 = adapter_bytes(&dir);
    let e = train(&dir, &["train.max_steps=3"]).expect_err("fewer steps than the checkpoint").to_string();
    assert!(e.contains("`train.max_steps`") && e.contains("step 4") && e.contains("checkpoint.resume"), "{e}");
    assert_eq!(std::fs::read_to_string(dir.join("out/recipe.resolved.toml")).unwrap(), resolved);
    assert_eq!(adapter_bytes(&dir), at_4);
    // The same steps again: already complete, as before.
    train(&dir, &["train.max_steps=4"]).unwrap();
    assert_eq!(adapter_bytes(&dir), at_4);
}

#[test]
fn a_model_or_data_replaced_at_the_same_path_is_not_resumed_on() {
    use finetune::synth::{counting_rows, write_model, write_tokenized_dataset, TinyShape};
    let root = setup();
    let dir = run_dir(root.path(), "run", RECIPE);
    train(&dir, &["train.max_steps=2"]).unwrap();
    let (model, data) = (root.path().join("model"), root.path().join("data"));
    std::fs::rename(&model, root.path().join("model-kept")).unwrap();
    write_model(&model, &TinyShape::default(), 1, 1).unwrap(); // same shapes, other weights
    let e = train(&dir, &["train.max_steps=3"]).expect_err("another model").to_string();
    assert!(e.contains("model.path") && e.contains("differ from those the checkpoint was trained on"), "{e}");
    assert!(dir.join("out/adapter").is_dir() && !dir.join("out/previous").exists(), "a refused resume moves nothing");
    std::fs::remove_dir_all(&model).unwrap();
    std::fs::rename(root.path().join("model-kept"), &model).unwrap();
    std::fs::rename(&data, root.path().join("data-kept")).unwrap();
    write_tokenized_dataset(&data, &counting_rows(23, 256, 2, 4, 18)).unwrap(); // as many rows, others
    let e = train(&dir, &["train.max_steps=3"]).expect_err("other data").to_string();
    assert!(e.contains("data.train") && e.contains("differ from those the checkpoint was trained on"), "{e}");
    std::fs::remove_dir_all(&data).unwrap();
    std::fs::rename(root.path().join("data-kept"), &data).unwrap();
    // special_tokens_map.json can name the EOS that ends every response: part of the model.
    std::fs::write(model.join("special_tokens_map.json"), r#"{"eos_token": "<unk>"}"#).unwrap();
    let e = train(&dir, &["train.max_steps=3"]).expect_err("another EOS, maybe").to_string();
    assert!(e.contains("model.path") && e.contains("differ from those the checkpoint was trained on"), "{e}");
    std::fs::remove_file(model.join("special_tokens_map.json")).unwrap();
    // What the loader does not read is not the data: a README, a .git folder, datasets' cache.
    std::fs::write(data.join("README.md"), "rows").unwrap();
    std::fs::create_dir_all(data.join(".git")).unwrap();
    std::fs::write(data.join(".git/index"), "x").unwrap();
    std::fs::write(data.join("cache-0123.arrow"), "x").unwrap();
    let s = train(&dir, &["train.max_steps=3"]).unwrap();
    assert_eq!(s.steps.iter().map(|m| m.step).collect::<Vec<_>>(), vec![3], "the same files: it continues");
}

#[test]
fn metrics_lines_a_crash_lost_are_reported_on_resume() {
    let root = setup();
    let dir = run_dir(root.path(), "run", RECIPE);
    train(&dir, &["train.max_steps=4"]).unwrap();
    let m = dir.join("out/metrics.jsonl");
    let first_two: String = std::fs::read_to_string(&m).unwrap().lines().take(2).map(|l| format!("{l}\n")).collect();
    std::fs::write(&m, first_two).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_finetune"))
        .arg("--recipe")
        .arg(dir.join("recipe.toml"))
        .args(["--set", "train.max_steps=5"])
        .current_dir(&dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("has no lines for 2 of the steps 3..=4"), "{err}");
}

#[test]
fn a_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint() {
    let root = setup();
    let dir = run_dir(root.path(), "run", RECIPE);
    let e = train(&dir, &["train.lr=1e30", "train.warmup_steps=0", "train.max_grad_norm=0.0"]).expect_err("must stop").to_string();
    // Names the learning rate: the NaN came after updates, from a finite start.
    assert!(e.contains("train.lr") && (e.contains("non-finite") || e.contains("NaN")), "{e}");
    for (_, ck) in finetune::checkpoint::list(&dir.join("out")) {
        finetune::checkpoint::verify(&ck).unwrap();
        for (k, t) in load_tensors(&ck.join("adapter/adapter_model.safetensors")) {
            let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            assert!(v.iter().all(|x| x.is_finite()), "{k} in {} is not finite", ck.display());
        }
    }
}

fn signal(child: &std::process::Child, sig: i32) {
    let ok = Command::new("kill").arg(format!("-{sig}")).arg(child.id().to_string()).status().unwrap();
    assert!(ok.success());
}

#[test]
fn sigint_finishes_the_step_checkpoints_and_exits_130_then_resume_completes() {
    let root = setup();
    let dir = run_dir(root.path(), "run", RECIPE);
    let long = ["train.max_steps=100000", "checkpoint.every_steps=0"];
    let mut child = spawn(&dir, &long);
    wait_for_steps(&dir, 3, &mut child);
    signal(&child, 2);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(err.contains("stopped by SIGINT") && err.contains("resume"), "{err}");
    // Said when the signal arrives, before the step ends: a step can take minutes.
    let said = err.find("stop requested: training finishes the step in progress").expect(&err);
    assert!(said < err.find("stopped by SIGINT").unwrap(), "{err}");
    let steps = metric_lines(&dir).len();
    let newest = finetune::checkpoint::list(&dir.join("out"))[0].clone();
    assert_eq!(newest.0, steps, "checkpoint at the last finished step");
    finetune::checkpoint::verify(&newest.1).unwrap();

    let mut child = spawn(&dir, &long);
    wait_for_steps(&dir, steps + 2, &mut child);
    signal(&child, 15);
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(143), "{}", String::from_utf8_lossy(&out.stderr));
    let lines = metric_lines(&dir);
    let numbers: Vec<u64> = lines.iter().map(|l| l.0).collect();
    assert_eq!(numbers, (1..=lines.len() as u64).collect::<Vec<_>>(), "one uninterrupted sequence of steps");
}

#[test]
fn a_second_sigint_aborts_at_once_and_the_last_checkpoint_stands() {
    let root = setup();
    let dir = run_dir(root.path(), "run", RECIPE);
    let mut child = spawn(&dir, &["train.max_steps=100000"]);
    wait_for_steps(&dir, 3, &mut child);
    signal(&child, 2);
    // A SIGTERM second: two SIGINTs sent before the process runs are one pending signal.
    signal(&child, 15);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    // The second signal ends the run at once, saying why (it had exited without a word); or
    // it came after the first one's step and checkpoint were done and the run had left.
    match out.status.code() {
        Some(143) => assert!(err.contains("second stop signal") && err.contains("last complete checkpoint"), "{err}"),
        code => assert_eq!(code, Some(130), "{err}"),
    }
    let newest = finetune::checkpoint::latest_valid(&dir.join("out")).expect("a valid checkpoint");
    finetune::checkpoint::verify(&newest).unwrap();
}

/// SIGKILL at random moments (including during saves), resume each time; the final adapter
/// must equal the uninterrupted run's byte for byte.
#[test]
fn twenty_sigkills_in_a_row_lose_nothing() {
    let root = setup();
    let steps = ["train.max_steps=300", "checkpoint.keep_last=2"];
    let full = run_dir(root.path(), "full", RECIPE);
    train(&full, &steps).unwrap();
    let dir = run_dir(root.path(), "killed", RECIPE);
    let mut rng = finetune::rng::Rng::new(12345);
    let mut survived = 0;
    for _ in 0..20 {
        let mut child = spawn(&dir, &steps);
        let delay = 30 + rng.below(250);
        std::thread::sleep(Duration::from_millis(delay));
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap();
            survived += 1;
        }
        child.wait().unwrap();
    }
    let out = spawn(&dir, &steps).wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    println!("survived {survived} SIGKILLs");
    assert!(survived >= 10, "only {survived} kills landed mid-run; the test is not exercising anything");
    assert_eq!(adapter_bytes(&dir), adapter_bytes(&full));
    assert_eq!(metric_lines(&dir), metric_lines(&full));
}

/// summary.json's peak RSS is the run's, not the last process's: a resumed run (or a rerun of
/// a finished one) carries the peak its checkpoint recorded.
#[test]
fn a_resumed_run_reports_the_peak_memory_of_the_whole_run() {
    let root = setup();
    let dir = run_dir(root.path(), "run", RECIPE);
    train(&dir, &["train.max_steps=2"]).unwrap();
    // An earlier process that peaked far higher than any this test runs: its checkpoint says so.
    edit_state(&dir.join("out/checkpoints/step-000002"), |state| {
        assert!(state["peak_rss_mb"].as_f64().is_some_and(|p| p > 0.0), "checkpoints record the peak: {state}");
        state["peak_rss_mb"] = 1.0e9.into();
    });
    train(&dir, &["train.max_steps=3"]).unwrap();
    let peak = |p: &Path| serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(p).unwrap()).unwrap()["peak_rss_mb"].as_f64();
    assert_eq!(peak(&dir.join("out/summary.json")), Some(1.0e9));
    assert_eq!(peak(&dir.join("out/checkpoints/step-000003/state.json")), Some(1.0e9), "and passes it on");
}

#[test]
fn a_run_resumed_on_other_kernels_says_it_will_not_match_bit_for_bit() {
    let root = setup();
    let dir = run_dir(root.path(), "run", RECIPE);
    let resumed = |steps: &str| {
        let out = spawn(&dir, &[&format!("train.max_steps={steps}")]).wait_with_output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let said = resumed("2");
    assert!(!said.contains("other kernels"), "{said}");
    let ckpt = dir.join("out/checkpoints/step-000002");
    let kernels = |ckpt: &Path| serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(ckpt.join("state.json")).unwrap()).unwrap()["kernels"].clone();
    let here = kernels(&ckpt);
    assert!(here.as_str().is_some_and(|k| !k.is_empty()), "checkpoints record the kernels: {here}");
    // The same machine: no note.
    assert!(!resumed("3").contains("other kernels"));
    // A checkpoint written on another machine (AVX2 only, say): the note names both.
    edit_state(&dir.join("out/checkpoints/step-000003"), |state| state["kernels"] = "elsewhere's kernels".into());
    let said = resumed("4");
    assert!(said.contains("was trained on other kernels (elsewhere's kernels)") && said.contains(here.as_str().unwrap()), "{said}");
    assert_eq!(kernels(&dir.join("out/checkpoints/step-000004")), here, "this run's own checkpoints record its kernels");
    // One from before they were recorded: no note.
    edit_state(&dir.join("out/checkpoints/step-000004"), |state| drop(state.as_object_mut().unwrap().remove("kernels")));
    assert!(!resumed("5").contains("other kernels"));
}

/// Edit a checkpoint's state.json as an earlier version (or process) wrote it, keeping its
/// manifest's checksum true.
fn edit_state(ckpt: &Path, f: impl Fn(&mut serde_json::Value)) {
    use sha2::Digest;
    let mut state: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(ckpt.join("state.json")).unwrap()).unwrap();
    f(&mut state);
    let bytes = serde_json::to_vec_pretty(&state).unwrap();
    std::fs::write(ckpt.join("state.json"), &bytes).unwrap();
    common::edit_json(&ckpt.join("manifest.json"), |m| {
        m["files"]["state.json"] = serde_json::json!({"bytes": bytes.len(), "sha256": sha2::Sha256::digest(&bytes).iter().map(|x| format!("{x:02x}")).collect::<String>()});
    });
}

/// A checkpoint written before special_tokens_map.json counted among the model's files
/// resumes beside one (its fingerprint is compared over the files it covered then).
#[test]
fn a_checkpoint_from_before_the_special_tokens_map_counted_still_resumes() {
    let root = setup();
    let dir = run_dir(root.path(), "run", RECIPE);
    train(&dir, &["train.max_steps=2"]).unwrap();
    edit_state(&dir.join("out/checkpoints/step-000002"), |state| {
        assert_eq!(state["model_fingerprint_version"], 1);
        state.as_object_mut().unwrap().remove("model_fingerprint_version");
    });
    std::fs::write(root.path().join("model/special_tokens_map.json"), r#"{"eos_token": "<unk>"}"#).unwrap();
    let s = train(&dir, &["train.max_steps=3"]).unwrap();
    assert_eq!(s.steps.iter().map(|m| m.step).collect::<Vec<_>>(), vec![3]);
    // Written with the map counted but no version recorded (the commits between): resumes too.
    edit_state(&dir.join("out/checkpoints/step-000003"), |state| {
        state.as_object_mut().unwrap().remove("model_fingerprint_version");
    });
    let s = train(&dir, &["train.max_steps=4"]).unwrap();
    assert_eq!(s.steps.iter().map(|m| m.step).collect::<Vec<_>>(), vec![4]);
}

/// The binary run on `dir`'s recipe under strace, which injects a fault at an exact system
/// call (`strace_args`: strace's own `-e trace=... -e inject=...`). The test machines have
/// strace (the machine image installs it); without it these tests fail rather than pass
/// having checked nothing.
fn run_under_strace(dir: &Path, extra: &[&str], strace_args: &[&str]) -> std::process::Output {
    let mut args = vec!["--recipe".to_string(), dir.join("recipe.toml").display().to_string()];
    args.extend(extra.iter().flat_map(|s| ["--set".to_string(), s.to_string()]));
    finetune_under_strace(&args, strace_args)
}

/// The binary with `args` under strace (as [`run_under_strace`]).
fn finetune_under_strace(args: &[String], strace_args: &[&str]) -> std::process::Output {
    let probe = Command::new("strace").args(["-o", "/dev/null", "true"]).status();
    assert!(probe.is_ok_and(|s| s.success()), "this test injects faults with strace: install it (apt install strace) and allow ptrace");
    Command::new("strace")
        .args(["-f", "-o", "/dev/null", "-e", "signal=none"])
        .args(strace_args)
        .arg(env!("CARGO_BIN_EXE_finetune"))
        .args(args)
        .output()
        .unwrap()
}

/// Resuming from an older checkpoint moves the newer branch under previous/ (its checkpoints,
/// final outputs and a copy of metrics.jsonl, whose later lines the resumed run replaces). A
/// kill between two of those moves, then the same command again: every line and checkpoint of
/// the old branch is still somewhere under previous/.
#[test]
fn a_kill_while_a_newer_branch_is_set_aside_loses_none_of_it() {
    let root = setup();
    for kill_at in [2, 3, 5] {
        let dir = run_dir(root.path(), &format!("run{kill_at}"), RECIPE);
        train(&dir, &["train.max_steps=6"]).unwrap();
        let branch: Vec<String> = std::fs::read_to_string(dir.join("out/metrics.jsonl")).unwrap().lines().skip(3).map(String::from).collect();
        assert_eq!(branch.len(), 3);
        let older = dir.join("out/checkpoints/step-000003");
        let args = ["train.max_steps=6".to_string(), format!("checkpoint.resume={}", older.display())];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let inject = format!("inject=rename:signal=KILL:when={kill_at}");
        let killed = run_under_strace(&dir, &args, &["-e", "trace=rename", "-e", &inject]);
        assert_eq!(killed.status.code(), None, "killed by the signal: {}", String::from_utf8_lossy(&killed.stderr));
        let out = spawn(&dir, &args).wait_with_output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let previous: Vec<_> = std::fs::read_dir(dir.join("out/previous")).unwrap().map(|e| e.unwrap().path()).collect();
        let kept: String = previous.iter().filter_map(|p| std::fs::read_to_string(p.join("metrics.jsonl")).ok()).collect();
        for line in &branch {
            assert!(kept.lines().any(|l| l == line), "kill at rename {kill_at}: the old branch's line {line} is lost (previous/: {previous:?})");
        }
        for step in ["step-000004", "step-000005", "step-000006"] {
            assert!(previous.iter().any(|p| p.join("checkpoints").join(step).is_dir()), "kill at rename {kill_at}: {step} is lost");
        }
        assert!(previous.iter().any(|p| p.join("adapter/adapter_model.safetensors").is_file()), "kill at rename {kill_at}: the old final adapter is lost");
    }
}

/// A folder's fsync makes the renames in it durable; one that fails with EIO (not a
/// filesystem that cannot fsync folders) is an error, and the checkpoints left are whole.
#[test]
fn a_folder_fsync_failing_with_eio_stops_the_run_with_an_error() {
    let root = setup();
    let dir = run_dir(root.path(), "run", RECIPE);
    let ckpts = dir.join("out/checkpoints");
    let ckpts_arg = ckpts.display().to_string();
    let out = run_under_strace(&dir, &["train.max_steps=4"], &["-P", &ckpts_arg, "-e", "trace=fsync", "-e", "inject=fsync:error=EIO:when=2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("checkpoints: ") && err.contains("is in place, but this folder's fsync after it failed") && err.contains("Input/output error"), "{err}");
    for (_, c) in finetune::checkpoint::list(&dir.join("out")) {
        finetune::checkpoint::verify(&c).unwrap();
    }
    train(&dir, &["train.max_steps=4"]).unwrap();
}

/// A signal while the end-of-run exports are written (the merged model, the llama.cpp GGUF
/// adapter) stops them: no half output, the exit code of the signal, and the command that
/// writes them later; the trained adapter stays.
#[test]
fn a_signal_during_the_end_of_run_exports_stops_them_naming_the_command_that_writes_them() {
    let root = setup();
    for (key, staged, syscall, unwritten) in [
        ("export.gguf=true", "out/.adapter.gguf.tmp", "openat", "adapter.gguf"),
        ("export.merged=true", "out/.merged.tmp", "mkdir", "merged"),
    ] {
        let dir = run_dir(root.path(), key, RECIPE);
        let path = dir.join(staged).display().to_string();
        let out = run_under_strace(&dir, &["train.max_steps=2", key], &["-P", &path, "-e", &format!("trace={syscall}"), "-e", &format!("inject={syscall}:signal=TERM:when=1")]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(143), "{key}: {err}");
        assert!(err.contains("was not written") && err.contains("finetune export --run") && err.contains("stopped by SIGTERM"), "{key}: {err}");
        assert!(!dir.join("out").join(unwritten).exists() && !dir.join(staged).exists(), "{key}: half an output left");
        assert!(dir.join("out/adapter/adapter_model.safetensors").is_file());
    }
    // `finetune export --format gguf` as well (it had no handlers: Ctrl-C left its temporary).
    let dir = run_dir(root.path(), "cli", RECIPE);
    train(&dir, &["train.max_steps=2"]).unwrap();
    let (out, staged) = (dir.join("a.gguf"), dir.join(".a.gguf.tmp"));
    let args: Vec<String> = ["export", "--run", &dir.join("out").display().to_string(), "--format", "gguf", "--out", &out.display().to_string()].map(String::from).to_vec();
    let got = finetune_under_strace(&args, &["-P", &staged.display().to_string(), "-e", "trace=openat", "-e", "inject=openat:signal=INT:when=1"]);
    let err = String::from_utf8_lossy(&got.stderr);
    assert_eq!(got.status.code(), Some(130), "{err}");
    assert!(!out.exists() && !staged.exists(), "half an output left: {err}");
}

/// A full disk while the end-of-run GGUF adapter is written: an error with the full-disk hint,
/// no half file, and the same command rerun (space freed) writes it.
#[test]
fn a_full_disk_while_the_gguf_adapter_is_written_gets_the_full_disk_hint_and_the_rerun_writes_it() {
    let root = setup();
    let dir = run_dir(root.path(), "run", RECIPE);
    let args = ["train.max_steps=2", "export.gguf=true"];
    let staged = dir.join("out/.adapter.gguf.tmp").display().to_string();
    let out = run_under_strace(&dir, &args, &["-P", &staged, "-e", "trace=write", "-e", "inject=write:error=ENOSPC:when=1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("adapter.gguf") && err.contains("No space left") && err.contains("hint: free space"), "{err}");
    assert!(!dir.join("out/adapter.gguf").exists() && !dir.join(&staged).exists());
    let out = spawn(&dir, &args).wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(dir.join("out/adapter.gguf").is_file());
}
