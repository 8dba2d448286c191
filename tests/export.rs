//! Export: merged models equal base + adapter, match PEFT's merge_and_unload, keep shard
//! layout, dtype and tied embeddings; adapters round-trip.

mod common;
use common::*;
use candle_core::{DType, Device, Tensor};
use finetune::export::{merge, ExportOptions, ExportReport, PeftAdapter};
use finetune::synth::{counting_rows, write_model, write_tokenized_dataset, TinyShape};
use finetune::weights::ModelDir;
use std::path::{Path, PathBuf};

fn model_dir(p: &Path) -> ModelDir {
    ModelDir { dir: p.to_path_buf(), name: p.display().to_string(), commit: None, gguf: None }
}

fn merge_fixture(case: &str, out: &Path) -> ExportReport {
    let src = fixture(case);
    merge(&model_dir(&src.join("model")), &PeftAdapter::open(&src.join("expected/adapter")).unwrap(), out, &ExportOptions { merge: true, ..Default::default() }).unwrap()
}

#[test]
fn peft_trained_adapters_merge_to_what_merge_and_unload_produces() {
    for (case, src) in [("llama-gqa", "parity-llama-gqa"), ("qwen2-tied", "parity-qwen2-tied"), ("llama-mlp", "parity-llama-mlp")] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("merged");
        let rep = merge_fixture(src, &out);
        let ours = load_tensors(&out.join("model.safetensors"));
        let peft = load_tensors(&fixture("merge-peft").join(case).join("merged.safetensors"));
        let mut k1: Vec<_> = ours.keys().collect();
        let mut k2: Vec<_> = peft.keys().collect();
        k1.sort();
        k2.sort();
        assert_eq!(k1, k2, "{case}: tensor names");
        let mut worst = 0f32;
        for (k, t) in &peft {
            worst = worst.max(max_abs_diff(&ours[k], t));
        }
        println!("{case}: max |ours - merge_and_unload| = {worst:e}; verified logits diff {:?}", rep.max_logit_diff);
        assert!(worst <= 1e-6, "{case}: merged weights differ from PEFT's by {worst}");
        assert!(rep.max_logit_diff.unwrap() < 1e-4);
    }
}

#[test]
fn our_forward_matches_transformers_logits_with_and_without_merging() {
    for (case, src) in [("llama-gqa", "parity-llama-gqa"), ("qwen2-tied", "parity-qwen2-tied"), ("llama-mlp", "parity-llama-mlp")] {
        let f = load_tensors(&fixture("merge-peft").join(case).join("logits.safetensors"));
        let ids = f["input_ids"].to_dtype(DType::U32).unwrap();
        let base = model_dir(&fixture(src).join("model"));
        let cfg = finetune::config::ModelConfig::from_file(&base.config_path()).unwrap();
        let adapters = PeftAdapter::open(&fixture(src).join("expected/adapter")).unwrap().load(&cfg).unwrap();
        let files = base.open_weights().unwrap();
        let w = std::sync::Arc::new(finetune::weights::ResidentWeights::new(files, DType::F32, DType::F32, Device::Cpu));
        let model = finetune::model::Model::load(w, cfg, &adapters).unwrap();
        let logits = model.logits(&ids, &adapters).unwrap();
        let d = max_abs_diff(&logits, &f["logits_unmerged"]);
        println!("{case}: max |ours - transformers| logits = {d:e}");
        assert!(d < 1e-4, "{case}: {d}");
    }
}

/// A synthetic model with an adapter trained for a few steps (so B != 0).
fn trained(shape: TinyShape, shards: usize) -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    write_model(&d.path().join("model"), &shape, 5, shards).unwrap();
    write_tokenized_dataset(&d.path().join("data"), &counting_rows(12, shape.vocab, 2, 5, 16)).unwrap();
    let dtype = if shape.dtype == DType::BF16 { "bf16" } else { "f32" };
    std::fs::write(
        d.path().join("recipe.toml"),
        format!(
            "[model]\npath = \"model\"\ndtype = \"{dtype}\"\n[lora]\nrank = 4\nalpha = 8\ntargets = [\"q_proj\", \"v_proj\", \"o_proj\", \"down_proj\"]\n\
             [data]\ntrain = \"data\"\n[train]\nmax_steps = 3\nmicro_batch_size = 2\nlr = 2e-2\n[output]\ndir = \"out\"\n"
        ),
    )
    .unwrap();
    let r = finetune::recipe::LoadedRecipe::load(&d.path().join("recipe.toml"), &[]).unwrap();
    finetune::train::run(&r).unwrap();
    let run = d.path().join("out");
    (d, run)
}

fn merge_run(run: &Path, out: &Path, opts: ExportOptions) -> ExportReport {
    let a = PeftAdapter::open(&run.join("adapter")).unwrap();
    let base = ModelDir::resolve(a.base_model.as_deref().unwrap(), Path::new(".")).unwrap();
    merge(&base, &a, out, &ExportOptions { merge: true, ..opts }).unwrap()
}

#[test]
fn merged_logits_equal_base_plus_adapter_for_llama_and_qwen2_tied_and_untied() {
    for shape in [
        TinyShape::default(),
        TinyShape { tie: true, ..Default::default() },
        TinyShape { arch: "Qwen2ForCausalLM", tie: true, ..Default::default() },
        TinyShape { arch: "Qwen2ForCausalLM", ..Default::default() },
    ] {
        let (d, run) = trained(shape.clone(), 1);
        let rep = merge_run(&run, &d.path().join("merged"), ExportOptions::default());
        let diff = rep.max_logit_diff.unwrap();
        println!("{} tie={}: max logits diff {diff:e}", shape.arch, shape.tie);
        assert!(diff < 1e-4);
        assert_eq!(rep.merged_tensors, 2 * 4);
        let merged = load_tensors(&d.path().join("merged/model.safetensors"));
        assert_eq!(merged.contains_key("lm_head.weight"), !shape.tie, "tied embeddings stay tied");
        // Untargeted tensors are copied bit for bit.
        let base = load_tensors(&d.path().join("model/model.safetensors"));
        let k = "model.layers.0.mlp.up_proj.weight";
        assert_eq!(max_abs_diff(&merged[k], &base[k]), 0.0);
        assert!(max_abs_diff(&merged["model.layers.0.self_attn.q_proj.weight"], &base["model.layers.0.self_attn.q_proj.weight"]) > 0.0);
    }
}

/// Merge verification (merged logits against base + adapter) also holds when the forwards
/// run on the portable path, and both paths measure about the same difference.
#[test]
fn merge_verification_passes_on_the_portable_path() {
    let (d, run) = trained(TinyShape::default(), 1);
    let auto = merge_run(&run, &d.path().join("merged-auto"), ExportOptions::default());
    let portable = merge_run(&run, &d.path().join("merged-portable"), ExportOptions { kernels: finetune::ops::Kernels::Portable, ..Default::default() });
    let (a, p) = (auto.max_logit_diff.unwrap(), portable.max_logit_diff.unwrap());
    println!("merge verification: max logits diff auto {a:e}, portable {p:e}");
    assert!(p < 1e-4 && a < 1e-4);
}

#[test]
fn sharded_base_keeps_its_layout_with_a_valid_index() {
    let (d, run) = trained(TinyShape::default(), 3);
    // Swap the first and last shards' names, so that file order is not the order of the
    // tensors' names (as in real checkpoints, where lm_head often sits in the last shard).
    let model = d.path().join("model");
    let (first, last) = ("model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors");
    std::fs::rename(model.join(first), model.join("swap")).unwrap();
    std::fs::rename(model.join(last), model.join(first)).unwrap();
    std::fs::rename(model.join("swap"), model.join(last)).unwrap();
    let ip = model.join("model.safetensors.index.json");
    let swapped = std::fs::read_to_string(&ip).unwrap().replace(first, "swap").replace(last, first).replace("swap", last);
    std::fs::write(&ip, swapped).unwrap();
    let out = d.path().join("merged");
    let rep = merge_run(&run, &out, ExportOptions::default());
    assert_eq!(rep.shards, 3);
    check_index(&out, rep.total_bytes);
    for i in 1..=3 {
        assert!(out.join(format!("model-{i:05}-of-00003.safetensors")).is_file());
    }
    let map = |p: &Path| -> serde_json::Value { serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(p).unwrap()).unwrap()["weight_map"].clone() };
    assert_eq!(map(&out.join("model.safetensors.index.json")), map(&ip), "each tensor in the shard of the base's name");
}

fn check_index(out: &Path, total: u64) {
    let index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap()).unwrap();
    assert_eq!(index["metadata"]["total_size"].as_u64(), Some(total));
    let map = index["weight_map"].as_object().unwrap();
    let mut files = std::collections::HashMap::new();
    for (name, file) in map {
        let f = file.as_str().unwrap();
        let t = files.entry(f.to_string()).or_insert_with(|| load_tensors(&out.join(f)));
        assert!(t.contains_key(name), "{name} not in {f}");
    }
    let in_files: usize = files.values().map(|t| t.len()).sum();
    assert_eq!(in_files, map.len(), "every tensor in exactly one shard, all indexed");
}

#[test]
fn max_shard_size_cuts_shards_and_bounds_memory_below_the_model() {
    let (d, run) = trained(TinyShape::default(), 1);
    let out = d.path().join("merged");
    let limit = 100_000;
    let rep = merge_run(&run, &out, ExportOptions { max_shard_size: Some(limit), ..Default::default() });
    println!("total {} bytes in {} shards; peak buffered {} bytes", rep.total_bytes, rep.shards, rep.peak_buffered_bytes);
    assert!(rep.shards >= 4, "{} shards", rep.shards);
    assert!(rep.peak_buffered_bytes <= limit, "held {} bytes at once", rep.peak_buffered_bytes);
    assert!(rep.peak_buffered_bytes < rep.total_bytes / 2);
    check_index(&out, rep.total_bytes);
    for e in std::fs::read_dir(&out).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            assert!(std::fs::metadata(&p).unwrap().len() <= limit + 4096, "{} too large", p.display());
        }
    }
}

/// A base of mixed dtypes: the merge rounds only the adapted weights, so their dtype (bf16
/// here, in an otherwise f32 base) decides how far the merged logits may be from base +
/// adapter. It was decided by whichever tensor a hash map gave first: a random verdict.
#[test]
fn merge_verification_of_a_mixed_dtype_base_allows_for_the_rounding_of_what_it_merges() {
    let (d, run) = trained(TinyShape::default(), 1);
    let path = d.path().join("model/model.safetensors");
    let mut st = load_tensors(&path);
    let adapted = |k: &str| ["q_proj", "v_proj", "o_proj", "down_proj"].iter().any(|p| k.contains(p));
    for (k, t) in st.iter_mut() {
        if adapted(k) {
            *t = t.to_dtype(DType::BF16).unwrap();
        }
    }
    candle_core::safetensors::save(&st, &path).unwrap();
    let out = d.path().join("merged");
    let rep = merge_run(&run, &out, ExportOptions::default());
    println!("mixed-dtype merge: logits diff {:?}", rep.max_logit_diff);
    for (k, t) in load_tensors(&out.join("model.safetensors")) {
        assert_eq!(t.dtype(), if adapted(&k) { DType::BF16 } else { DType::F32 }, "{k} keeps its stored dtype");
    }
}

/// An adapter where a model is asked for, and a llama.cpp LoRA GGUF where an adapter is, are
/// named for what they are, not refused for a file they lack.
#[test]
fn an_adapter_given_as_the_model_or_a_gguf_given_as_the_adapter_is_named() {
    let (d, run) = trained(TinyShape::default(), 1);
    let e = ModelDir::resolve(&run.join("adapter").display().to_string(), Path::new(".")).unwrap_err().to_string();
    assert!(e.contains("holds a PEFT adapter") && e.contains("as adapter_config.json names it"), "{e}");
    let g = d.path().join("adapter.gguf");
    std::fs::write(&g, b"GGUF\x03\0\0\0").unwrap();
    let e = PeftAdapter::open(&g).err().unwrap().to_string();
    assert!(e.contains("is a GGUF file") && e.contains("PEFT adapter folder"), "{e}");
}

#[test]
fn bf16_base_stays_bf16_and_dtype_override_converts() {
    let (d, run) = trained(TinyShape { dtype: DType::BF16, ..Default::default() }, 1);
    let out = d.path().join("merged");
    let rep = merge_run(&run, &out, ExportOptions::default());
    println!("bf16 merge: logits diff {:?}", rep.max_logit_diff);
    let merged = load_tensors(&out.join("model.safetensors"));
    assert!(merged.values().all(|t| t.dtype() == DType::BF16));
    let base = load_tensors(&d.path().join("model/model.safetensors"));
    let k = "model.norm.weight";
    assert_eq!(max_abs_diff(&merged[k].to_dtype(DType::F32).unwrap(), &base[k].to_dtype(DType::F32).unwrap()), 0.0);

    let out16 = d.path().join("merged-f32");
    merge_run(&run, &out16, ExportOptions { dtype: Some(DType::F32), ..Default::default() });
    let m32 = load_tensors(&out16.join("model.safetensors"));
    assert!(m32.values().all(|t| t.dtype() == DType::F32));
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out16.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["torch_dtype"], "float32");
}

#[test]
fn export_refuses_to_overwrite_and_leaves_nothing_on_failure() {
    let (d, run) = trained(TinyShape::default(), 1);
    let out = d.path().join("merged");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("keep.txt"), "mine").unwrap();
    let a = PeftAdapter::open(&run.join("adapter")).unwrap();
    let base = ModelDir::resolve(a.base_model.as_deref().unwrap(), Path::new(".")).unwrap();
    let e = merge(&base, &a, &out, &ExportOptions { merge: true, ..Default::default() }).unwrap_err().to_string();
    assert!(e.contains("not empty"), "{e}");
    assert_eq!(std::fs::read_to_string(out.join("keep.txt")).unwrap(), "mine");
    // A LoRA GGUF named by --out is not replaced either.
    let gguf = d.path().join("adapter.gguf");
    std::fs::write(&gguf, "mine").unwrap();
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_finetune"))
        .args(["export", "--adapter", &run.join("adapter").display().to_string(), "--format", "gguf", "--out", &gguf.display().to_string()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("the file exists"), "{err}");
    assert_eq!(std::fs::read_to_string(&gguf).unwrap(), "mine");
}

#[test]
fn recipe_export_merged_writes_a_verified_merged_folder_via_the_cli() {
    let (d, _) = trained(TinyShape::default(), 1);
    let recipe = d.path().join("recipe.toml");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_finetune"))
        .args(["--recipe", &recipe.display().to_string(), "--set", "export.merged=true", "--set", "output.dir=out2"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("verified: max |logits(merged)"), "{err}");
    assert!(d.path().join("out2/merged/model.safetensors").is_file());
    assert!(d.path().join("out2/merged/config.json").is_file());

    // And `finetune export --run` writes the adapter alone, loadable again.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_finetune"))
        .args(["export", "--run", &d.path().join("out2").display().to_string(), "--out", &d.path().join("adapter-copy").display().to_string()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let a = load_tensors(&d.path().join("adapter-copy/adapter_model.safetensors"));
    let b = load_tensors(&d.path().join("out2/adapter/adapter_model.safetensors"));
    for (k, t) in &a {
        assert_eq!(max_abs_diff(t, &b[k]), 0.0);
    }
    let _ = Tensor::zeros(1, DType::F32, &Device::Cpu);

    // A checkpoint is exported only if it is what its manifest says (as resume checks).
    let run = d.path().join("out2");
    let step = std::fs::read_dir(run.join("checkpoints")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).find(|n| n.starts_with("step-")).expect("a checkpoint");
    let export_named = |name: &str, to: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_finetune"))
            .args(["export", "--run", &run.display().to_string(), "--checkpoint", name, "--out", &d.path().join(to).display().to_string()])
            .output()
            .unwrap()
    };
    let export_ckpt = |to: &str| export_named(&step, to);
    // A name the run does not have is refused with the names it has.
    let missing = export_named("step-9", "from-missing");
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(!missing.status.success() && err.contains("--checkpoint step-9: no such checkpoint") && err.contains(&step), "{err}");
    let ok = export_ckpt("from-checkpoint");
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    // With --adapter instead of --run it is refused, not dropped (the final adapter had been
    // exported, exit 0).
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_finetune"))
        .args(["export", "--adapter", &run.join("adapter").display().to_string(), "--checkpoint", &step, "--out", &d.path().join("from-adapter").display().to_string()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--checkpoint") && err.contains("checkpoints/"), "{err}");
    assert!(!d.path().join("from-adapter").exists());
    let file = run.join("checkpoints").join(&step).join("adapter/adapter_model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let n = bytes.len();
    bytes[n - 10] ^= 0xff;
    std::fs::write(&file, bytes).unwrap();
    let bad = export_ckpt("from-damaged");
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && err.contains("damaged") && err.contains("does not match its checksum"), "{err}");
    assert!(!d.path().join("from-damaged").exists());
}

/// --dtype, --max-shard-size and --no-verify shape the merged model: without --merge they
/// were parsed and dropped, and an f32 adapter was written where bf16 was asked, exit 0.
#[test]
fn merge_options_without_merge_are_refused_not_ignored() {
    let (d, run) = trained(TinyShape::default(), 1);
    for (format, flag) in [("peft", &["--dtype", "bf16"][..]), ("gguf", &["--dtype", "f16"]), ("peft", &["--max-shard-size", "1KB"]), ("peft", &["--no-verify"])] {
        let out = d.path().join(format!("x-{}", flag[0].trim_start_matches('-')));
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_finetune"))
            .args(["export", "--run", &run.display().to_string(), "--format", format, "--out", &out.display().to_string()])
            .args(flag)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(flag[0]) && err.contains("--merge"), "{format} {flag:?}: {err}");
        assert!(!out.exists(), "{format} {flag:?}: wrote {}", out.display());
    }
}

#[test]
fn export_run_refuses_a_base_replaced_since_the_run_trained_on_it() {
    // The checkpoints record the model's fingerprint (resume refuses a changed base); export
    // --run merged into whatever now sits at the path and verified the merge against that
    // same new base, exit 0.
    let (d, run) = trained(TinyShape::default(), 1);
    let export = |out: &str, extra: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_finetune"))
            .current_dir(d.path())
            .args(["export", "--run", &run.display().to_string(), "--merge", "--out", out])
            .args(extra)
            .output()
            .unwrap()
    };
    let ok = export("merged-1", &[]);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    write_model(&d.path().join("model"), &TinyShape::default(), 99, 1).unwrap(); // other weights, same shape
    let bad = export("merged-2", &[]);
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && err.contains("differ from those run") && err.contains("--adapter"), "{err}");
    assert!(!d.path().join("merged-2").exists());
    // On purpose, through the adapter folder: merged into the new base.
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_finetune"))
        .current_dir(d.path())
        .args(["export", "--adapter", &run.join("adapter").display().to_string(), "--base", "model", "--merge", "--out", "merged-3"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// An existing merged folder is replaced only once the new one is complete (a rerun's
/// end-of-run merge), refused where replacing was not asked for, and a symlink as the output
/// is refused before any work, leaving nothing behind.
#[test]
fn a_merged_folder_is_replaced_whole_or_refused_and_a_symlink_is_refused_up_front() {
    let (d, run) = trained(TinyShape::default(), 1);
    let a = PeftAdapter::open(&run.join("adapter")).unwrap();
    let base = ModelDir::resolve(a.base_model.as_deref().unwrap(), Path::new(".")).unwrap();
    let out = d.path().join("merged");
    let opts = ExportOptions { merge: true, no_verify: true, ..Default::default() };
    merge(&base, &a, &out, &opts).unwrap();
    std::fs::write(out.join("old-marker"), "x").unwrap();
    let e = merge(&base, &a, &out, &opts).unwrap_err().to_string();
    assert!(e.contains("not empty"), "{e}");
    assert!(out.join("old-marker").is_file(), "a refused merge leaves the folder as it was");
    merge(&base, &a, &out, &ExportOptions { replace: true, ..opts.clone() }).unwrap();
    assert!(!out.join("old-marker").exists() && out.join("model.safetensors").is_file(), "replaced by the new merge");
    for target in [d.path().join("nowhere"), d.path().join("empty")] {
        if target.ends_with("empty") {
            std::fs::create_dir(&target).unwrap();
        }
        let link = d.path().join("link");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let e = merge(&base, &a, &link, &opts).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        assert!(!d.path().join(".link.tmp").exists(), "no staging folder left");
    }
}

/// One writer stages an output at a time: two exports of one merged folder (or an export and
/// a run's end-of-run merge) shared its staging folder, and one exited 0 over a folder the
/// other had half replaced; a run starting on the folder deleted an export's staging.
#[test]
fn an_output_being_staged_is_refused_to_a_second_writer_and_left_alone_by_a_run_s_cleanup() {
    let (d, run) = trained(TinyShape::default(), 1);
    let out = run.join("merged");
    let held = finetune::output::StagingLock::acquire(&out).unwrap();
    assert!(finetune::output::StagingLock::held(&out));
    let a = PeftAdapter::open(&run.join("adapter")).unwrap();
    let base = ModelDir::resolve(a.base_model.as_deref().unwrap(), Path::new(".")).unwrap();
    let err = merge(&base, &a, &out, &ExportOptions { merge: true, ..Default::default() }).unwrap_err().to_string();
    assert!(err.contains("being written by another finetune process"), "{err}");
    std::fs::create_dir_all(run.join(".merged.tmp")).unwrap();
    finetune::checkpoint::clean_temporaries(&run);
    assert!(run.join(".merged.tmp").is_dir(), "the staging of a writer that holds it was deleted");
    drop(held);
    assert!(!finetune::output::StagingLock::held(&out) && !run.join(".merged.lock").exists());
    finetune::checkpoint::clean_temporaries(&run);
    assert!(!run.join(".merged.tmp").exists(), "a crash's leftover staging is cleaned");
    merge(&base, &a, &out, &ExportOptions { merge: true, ..Default::default() }).unwrap();
    // The GGUF adapter, a file staged as `.adapter.gguf.tmp`, the same way.
    let gguf = run.join("adapter.gguf");
    let held = finetune::output::StagingLock::acquire(&gguf).unwrap();
    let err = finetune::export::gguf::export_gguf_adapter(&a, &base, &gguf, None).unwrap_err().to_string();
    assert!(err.contains("being written by another finetune process"), "{err}");
    std::fs::write(run.join(".adapter.gguf.tmp"), b"half").unwrap();
    finetune::checkpoint::clean_temporaries(&run);
    assert!(run.join(".adapter.gguf.tmp").is_file(), "the staging of a writer that holds it was deleted");
    drop(held);
    finetune::checkpoint::clean_temporaries(&run);
    assert!(!run.join(".adapter.gguf.tmp").exists(), "a crash's leftover staging is cleaned");
    finetune::export::gguf::export_gguf_adapter(&a, &base, &gguf, None).unwrap();
    assert!(gguf.is_file() && !run.join(".adapter.gguf.lock").exists());
    let _ = d;
}

/// A signal during a merge (Ctrl-C while a run's end-of-run merge writes, or during `finetune
/// export --merge`) stops it at the next tensor: the error names the signal, nothing is left
/// in the output's place or staged beside it, and a merged model already there (which the
/// end-of-run merge would replace) is untouched.
#[test]
fn a_merge_stopped_by_a_signal_writes_nothing_and_keeps_the_previous_output() {
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;
    let (d, run) = trained(TinyShape::default(), 1);
    let out = d.path().join("merged");
    merge_run(&run, &out, ExportOptions::default());
    let before = load_tensors(&out.join("model.safetensors"));
    let a = PeftAdapter::open(&run.join("adapter")).unwrap();
    let base = ModelDir::resolve(a.base_model.as_deref().unwrap(), Path::new(".")).unwrap();
    for no_verify in [false, true] {
        for (target, replace) in [(out.clone(), true), (d.path().join("fresh"), false)] {
            let opts = ExportOptions { merge: true, replace, no_verify, stop: Some(Arc::new(AtomicUsize::new(2))), ..Default::default() };
            let err = merge(&base, &a, &target, &opts).unwrap_err();
            assert!(matches!(err, finetune::Error::Interrupted { signal: 2 }), "{err}");
            assert!(err.to_string().contains("SIGINT"), "{err}");
            let staged: Vec<String> = std::fs::read_dir(d.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with('.')).collect();
            assert!(staged.is_empty(), "left behind: {staged:?}");
        }
        assert!(!d.path().join("fresh").exists());
        let after = load_tensors(&out.join("model.safetensors"));
        assert_eq!(after.len(), before.len());
        for (k, t) in &before {
            assert_eq!(max_abs_diff(&after[k], t), 0.0, "{k} changed");
        }
    }
}
