//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod gguf;

use candle_core::{Device, Tensor};
use finetune::recipe::LoadedRecipe;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// Point finetune's cache (where a GGUF base's description is derived) at one folder of
/// this test binary's, never the user's; content-addressed, so tests may share it.
pub fn test_cache() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| std::env::set_var("FINETUNE_CACHE", Path::new(env!("CARGO_TARGET_TMPDIR")).join("finetune-cache")));
}

/// Load a fixture's recipe with its output redirected to `out` plus extra overrides.
pub fn recipe(name: &str, out: &Path, extra: &[&str]) -> LoadedRecipe {
    test_cache();
    let mut o = vec![format!("output.dir={}", out.display())];
    o.extend(extra.iter().map(|s| s.to_string()));
    LoadedRecipe::load(&fixture(name).join("recipe.toml"), &o).expect("fixture recipe loads")
}

pub fn read_metrics(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .expect("metrics.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect()
}

pub fn load_tensors(file: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(file, &Device::Cpu).expect("safetensors loads")
}

/// Max |a - b| over two tensors of the same shape.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

pub fn rel(a: f64, b: f64) -> f64 {
    if b == 0.0 {
        a.abs()
    } else {
        ((a - b) / b).abs()
    }
}

/// A temp folder with a tiny random Llama at `model/`, a counting dataset of `rows` rows
/// (lengths in `len`) at `data/`, and, when given, `recipe` written to `recipe.toml`.
pub fn tiny_workspace(rows: usize, len: (usize, usize), recipe: Option<&str>) -> tempfile::TempDir {
    use finetune::synth::{counting_rows, write_model, write_tokenized_dataset, TinyShape};
    let d = tempfile::tempdir().unwrap();
    write_model(&d.path().join("model"), &TinyShape::default(), 0, 1).unwrap();
    write_tokenized_dataset(&d.path().join("data"), &counting_rows(rows, 256, 1, len.0, len.1)).unwrap();
    if let Some(r) = recipe {
        std::fs::write(d.path().join("recipe.toml"), r).unwrap();
    }
    d
}

/// A recursive copy of a folder (a checkpoint, say) into `dst`.
pub fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
        }
    }
}

/// `<root>/<name>/recipe.toml` holding `recipe`; returns `<root>/<name>`.
pub fn run_dir(root: &Path, name: &str, recipe: &str) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("recipe.toml"), recipe).unwrap();
    dir
}

/// `finetune --recipe <dir>/recipe.toml --set ...` as a child process (stderr piped).
pub fn spawn(dir: &Path, extra: &[&str]) -> std::process::Child {
    std::process::Command::new(env!("CARGO_BIN_EXE_finetune"))
        .arg("--recipe")
        .arg(dir.join("recipe.toml"))
        .args(extra.iter().flat_map(|s| ["--set", s]))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// Wait until `<dir>/out/metrics.jsonl` has `n` lines while `child` keeps running.
pub fn wait_for_steps(dir: &Path, n: usize, child: &mut std::process::Child) {
    let start = std::time::Instant::now();
    while std::fs::read_to_string(dir.join("out/metrics.jsonl")).map_or(0, |t| t.lines().count()) < n {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                use std::io::Read;
                let _ = e.read_to_string(&mut err);
            }
            panic!("run ended early ({status}): {err}");
        }
        assert!(start.elapsed() < std::time::Duration::from_secs(60), "no progress");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// 40 rows of 2 tokens (one target each), ids below 200 (the DeepSeek fixtures' vocabulary):
/// one row per micro-batch reaches at most 2 x 2 experts of a top-2 MoE layer, so with more
/// experts than that every micro-batch leaves some without tokens.
pub fn two_token_rows() -> Vec<(Vec<i32>, Vec<i64>)> {
    (0..40).map(|i| (vec![1 + i % 199, 1 + (7 * i + 3) % 199], vec![1 + i as i64 % 199, 1 + (7 * i as i64 + 3) % 199])).collect()
}

/// Rewrite the JSON file at `path` with `f` applied.
pub fn edit_json(path: &Path, f: impl Fn(&mut serde_json::Value)) {
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, v.to_string()).unwrap();
}
