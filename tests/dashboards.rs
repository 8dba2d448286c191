//! What a run leaves for people to look at: TensorBoard events carrying metrics.jsonl's
//! numbers (continued, not duplicated, across a kill and resume), summary.json, and
//! `finetune report`'s page and plot. `make check-dashboards` also reads the events with the
//! `tensorboard` package's own reader.

mod common;

use common::{run_dir, spawn, tiny_workspace, wait_for_steps};
use std::collections::BTreeMap;
use std::path::Path;

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
eval_fraction = 0.2
[train]
max_steps = 100000
micro_batch_size = 2
lr = 5e-3
eval_every = 3
[checkpoint]
every_steps = 2
[output]
dir = "out"
tensorboard = true
"#;

/// step -> tag -> value, from every event file under `dir`; a step logged twice for a tag fails.
fn events(dir: &Path) -> BTreeMap<i64, BTreeMap<String, f32>> {
    let mut out: BTreeMap<i64, BTreeMap<String, f32>> = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        for (step, _, tag, v) in finetune::tensorboard::read_scalars(&e.path()).unwrap() {
            assert!(out.entry(step).or_default().insert(tag.clone(), v).is_none(), "step {step} {tag} logged twice");
        }
    }
    out
}

#[test]
fn tensorboard_events_equal_metrics_across_a_kill_and_resume_and_the_report_shows_them() {
    let root = tiny_workspace(40, (4, 18), None);
    let dir = run_dir(root.path(), "run", RECIPE);
    // Killed mid-run; the checkpoints of its last step are removed too (a kill between the
    // metrics line and the checkpoint), so steps after the newest checkpoint are already
    // logged: the resumed run must drop them and log them again, once.
    let mut child = spawn(&dir, &["train.max_steps=100000"]);
    wait_for_steps(&dir, 5, &mut child);
    child.kill().unwrap();
    child.wait().unwrap();
    let logged = common::read_metrics(&dir.join("out/metrics.jsonl")).len();
    for (step, ck) in finetune::checkpoint::list(&dir.join("out")) {
        if step >= logged {
            std::fs::remove_dir_all(ck).unwrap();
        }
    }
    let resumed_at = finetune::checkpoint::list(&dir.join("out"))[0].0;
    assert!(resumed_at < logged);
    let last = logged + 3;
    let out = spawn(&dir, &[&format!("train.max_steps={last}")]).wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let metrics = common::read_metrics(&dir.join("out/metrics.jsonl"));
    let steps: Vec<i64> = (1..=last as i64).collect();
    assert_eq!(metrics.iter().map(|m| m["step"].as_i64().unwrap()).collect::<Vec<_>>(), steps);
    let ev = events(&dir.join("out/tensorboard"));
    assert_eq!(ev.keys().copied().collect::<Vec<_>>(), steps);
    for m in &metrics {
        let at = &ev[&m["step"].as_i64().unwrap()];
        for (tag, key) in [("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm"), ("train/tokens_per_s", "tokens_per_s"), ("eval/loss", "eval_loss"), ("memory/rss_mb", "rss_mb")] {
            match m.get(key).and_then(|v| v.as_f64()) {
                Some(v) => assert_eq!(at.get(tag), Some(&(v as f32)), "step {}: {tag}", m["step"]),
                None => assert!(!at.contains_key(tag), "step {}: {tag} logged without a metrics value", m["step"]),
            }
        }
    }
    let evals: Vec<i64> = metrics.iter().filter(|m| m.get("eval_loss").is_some()).map(|m| m["step"].as_i64().unwrap()).collect();
    assert!(evals.contains(&3) && evals.contains(&(last as i64)), "eval every 3 steps and at the last: {evals:?}");

    let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("out/summary.json")).unwrap()).unwrap();
    assert!(summary["peak_rss_mb"].as_f64().unwrap() > 0.0 && summary["world_size"] == 1, "{summary}");

    let o = std::process::Command::new(env!("CARGO_BIN_EXE_finetune")).args(["report", "--run"]).arg(dir.join("out")).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let html = std::fs::read_to_string(dir.join("out/report.html")).unwrap();
    assert!(html.contains("loss.png") && html.contains("tensorboard = true"), "the page shows the plot and the recipe");
    let png = std::fs::read(dir.join("out/loss.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
}

#[test]
fn report_of_a_folder_without_metrics_names_the_file() {
    let d = tempfile::tempdir().unwrap();
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_finetune")).args(["report", "--run"]).arg(d.path()).output().unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("metrics.jsonl"), "{err}");
    assert!(!d.path().join("report.html").exists() && !d.path().join("loss.png").exists(), "no half-written output");
}

#[test]
fn tensorboard_turned_on_at_a_resume_covers_the_whole_run() {
    let root = tiny_workspace(40, (4, 18), None);
    let dir = run_dir(root.path(), "run", RECIPE);
    let first = spawn(&dir, &["train.max_steps=3", "output.tensorboard=false"]).wait_with_output().unwrap();
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    assert!(!dir.join("out/tensorboard").exists());
    let second = spawn(&dir, &["train.max_steps=5"]).wait_with_output().unwrap();
    assert!(second.status.success(), "{}", String::from_utf8_lossy(&second.stderr));
    let ev = events(&dir.join("out/tensorboard"));
    assert_eq!(ev.keys().copied().collect::<Vec<_>>(), (1..=5).collect::<Vec<_>>());
    let metrics = common::read_metrics(&dir.join("out/metrics.jsonl"));
    for m in &metrics {
        assert_eq!(ev[&m["step"].as_i64().unwrap()]["train/loss"], m["loss"].as_f64().unwrap() as f32);
    }
}
