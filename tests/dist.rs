//! Several ranks on CPU (the in-process backend): ZeRO-3 sharded base, data parallel,
//! optimizer state partitioned on the host, consolidated checkpoints.

mod common;
use common::*;
use finetune::recipe::LoadedRecipe;
use finetune::synth::{counting_rows, write_model, write_tokenized_dataset, TinyShape};
use std::path::Path;
use std::time::{Duration, Instant};

const RECIPE: &str = r#"
[model]
path = "../model"
[lora]
rank = 4
alpha = 8
dropout = 0.1
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]
[data]
train = "../data"
shuffle = true
shuffle_buffer = 5
max_seq_len = 24
eval_fraction = 0.15
[train]
eval_every = 2
max_steps = 5
micro_batch_size = 1
grad_accum_steps = 4
lr = 5e-3
# Constant: a run stopped at a lower max_steps and resumed (as here) trains its first steps at
# the learning rates of the straight run (a decaying schedule follows max_steps).
lr_scheduler = "constant"
weight_decay = 0.01
seed = 7
[checkpoint]
every_steps = 1
keep_last = 0
[dist]
zero_stage = 3
offload_optimizer = "cpu"
prefetch_layers = 1
timeout_s = 60
[output]
dir = "out"
"#;

/// <tmp>/model (a 3-layer Llama, or a tied Qwen2 with q/k/v bias) and <tmp>/data.
fn workspace(arch: &'static str, tie: bool) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let shape = TinyShape { arch, tie, layers: 3, ..TinyShape::default() };
    write_model(&d.path().join("model"), &shape, 0, 1).unwrap();
    write_tokenized_dataset(&d.path().join("data"), &counting_rows(40, 256, 1, 5, 22)).unwrap();
    d
}

fn run(root: &Path, name: &str, extra: &[&str]) -> finetune::Result<finetune::train::RunSummary> {
    run_opts(root, name, extra, &finetune::train::RunOptions::default())
}

fn run_opts(root: &Path, name: &str, extra: &[&str], opts: &finetune::train::RunOptions) -> finetune::Result<finetune::train::RunSummary> {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("recipe.toml"), RECIPE).unwrap();
    let o: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    // Released on return, as `train::run` does: the next call may train in the same folder.
    finetune::train::run_with(&LoadedRecipe::load(&dir.join("recipe.toml"), &o)?, opts).map(|mut s| {
        s.lock = None;
        s
    })
}

/// Training losses and evaluation losses (at the steps that evaluate), in step order.
fn losses(root: &Path, name: &str) -> Vec<f64> {
    let m = read_metrics(&root.join(name).join("out/metrics.jsonl"));
    let evals = m.iter().filter_map(|m| m["eval_loss"].as_f64());
    m.iter().map(|m| m["loss"].as_f64().unwrap()).chain(evals).collect()
}

fn adapter(root: &Path, name: &str) -> std::collections::HashMap<String, candle_core::Tensor> {
    load_tensors(&root.join(name).join("out/adapter/adapter_model.safetensors"))
}

/// Largest relative loss difference and largest absolute adapter difference between runs.
fn compare(root: &Path, a: &str, b: &str) -> (f64, f32) {
    let (la, lb) = (losses(root, a), losses(root, b));
    assert_eq!(la.len(), lb.len(), "{a} vs {b}: step counts");
    let dl = la.iter().zip(&lb).map(|(x, y)| rel(*x, *y)).fold(0.0, f64::max);
    let (ta, tb) = (adapter(root, a), adapter(root, b));
    assert_eq!(ta.len(), tb.len());
    let dw = ta.iter().map(|(k, t)| max_abs_diff(t, &tb[k])).fold(0.0, f32::max);
    (dl, dw)
}

fn check_world_sizes(arch: &'static str, tie: bool) {
    check_world_sizes_with(workspace(arch, tie), arch, tie, &[]);
}

fn check_world_sizes_with(root: tempfile::TempDir, arch: &'static str, tie: bool, extra: &[&str]) {
    let r = root.path();
    let with = |more: &[String]| -> Vec<String> { extra.iter().map(|s| s.to_string()).chain(more.iter().cloned()).collect() };
    let portable = extra.contains(&"model.kernels=portable");
    // The reference: one rank, the whole base resident, accumulation over 4 micro-batches.
    let single = with(&["dist.zero_stage=0".into()]);
    let one = run(r, "single", &single.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
    let cfg = finetune::config::ModelConfig::from_file(&r.join("model/config.json")).unwrap();
    let single_recipe = LoadedRecipe::load(&r.join("single/recipe.toml"), &single).unwrap().recipe;
    let es = finetune::weights::parse_dtype(&single_recipe.model.dtype).size_in_bytes();
    // The resident base as the plan counts it: an untied embedding left in its file on the
    // fused CPU path, held on the portable one.
    assert_eq!(one.memory[0].frozen, finetune::dist::plan::plan(&cfg, &single_recipe, 1, portable).frozen, "resident base bytes (tie={tie}, portable={portable})");
    // The routers (MoE) are held in f32 whatever the storage dtype, as transformers holds them.
    let storage = finetune::weights::parse_dtype(&single_recipe.model.dtype);
    let base_bytes = finetune::weights::frozen_bytes(&cfg, storage);
    for (world, accum) in [(1, 4), (2, 2), (4, 1)] {
        let name = format!("w{world}");
        let o = with(&[format!("dist.world_size={world}"), format!("train.grad_accum_steps={accum}")]);
        let s = run(r, &name, &o.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        let (dl, dw) = compare(r, "single", &name);
        println!("{arch} tie={tie} world {world} x accum {accum}: max loss rel diff {dl:.2e}, max adapter abs diff {dw:.2e}");
        assert!(dl < 1e-5 && dw < 1e-5, "world {world} differs from one rank: loss {dl:e}, adapter {dw:e}");

        // What each rank held, against what `finetune plan` says from the config alone.
        // On the portable path the run allocates what a GPU run would: the plan for a GPU.
        let loaded = LoadedRecipe::load(&r.join(&name).join("recipe.toml"), &o).unwrap();
        let plan = finetune::dist::plan::plan(&cfg, &loaded.recipe, world, portable);
        assert_eq!(s.memory.len(), world);
        for m in &s.memory {
            println!("  {m}  (plan: frozen {} gathered {} optimizer {})", plan.frozen, plan.gathered_peak, plan.optimizer);
            assert_eq!(m.frozen, plan.frozen, "rank {}: frozen shard bytes", m.rank);
            assert!(m.frozen <= base_bytes / world + cfg.frozen_tensors().len() * es, "rank {} holds more than 1/{world} of the base", m.rank);
            assert_eq!(m.gathered_peak, plan.gathered_peak, "rank {}: gathered peak", m.rank);
            assert_eq!(m.lora_params, plan.lora_params);
            assert_eq!(m.lora_grads, plan.lora_grads);
            assert!(m.optimizer <= plan.optimizer && (m.rank != 0 || m.optimizer == plan.optimizer), "rank {}: optimizer bytes", m.rank);
        }
        let opt_total: usize = s.memory.iter().map(|m| m.optimizer).sum();
        assert_eq!(opt_total, 2 * 4 * finetune::train::trainable_parameters(&cfg, &loaded.recipe.lora.spec(&cfg)).0 as usize);
    }
}

#[test]
fn world_sizes_1_2_4_train_the_same_adapter_with_a_sharded_base() {
    check_world_sizes("LlamaForCausalLM", false);
}

/// The portable path with a bf16 base (bf16 activations, as on a GPU): world sizes agree, and
/// each rank's account equals `finetune plan`'s figures for a GPU run.
#[test]
fn world_sizes_1_2_4_agree_on_the_portable_path_with_a_bf16_base_and_match_the_gpu_plan() {
    let d = tempfile::tempdir().unwrap();
    let shape = TinyShape { layers: 3, dtype: candle_core::DType::BF16, ..TinyShape::default() };
    write_model(&d.path().join("model"), &shape, 0, 1).unwrap();
    write_tokenized_dataset(&d.path().join("data"), &counting_rows(40, 256, 1, 5, 22)).unwrap();
    check_world_sizes_with(d, "LlamaForCausalLM", false, &["model.kernels=portable", "model.dtype=bf16"]);
}

#[test]
fn tied_qwen2_with_bias_shards_and_trains_the_same_on_two_ranks() {
    let root = workspace("Qwen2ForCausalLM", true);
    let r = root.path();
    run(r, "single", &["dist.zero_stage=0"]).unwrap();
    run(r, "w2", &["dist.world_size=2", "train.grad_accum_steps=2"]).unwrap();
    let (dl, dw) = compare(r, "single", "w2");
    println!("qwen2 tied world 2: max loss rel diff {dl:.2e}, max adapter abs diff {dw:.2e}");
    assert!(dl < 1e-5 && dw < 1e-5);
}

#[test]
fn a_run_saved_on_two_ranks_resumes_on_one_and_on_four() {
    let root = workspace("LlamaForCausalLM", false);
    let r = root.path();
    let w2 = ["dist.world_size=2", "train.grad_accum_steps=2"];
    run(r, "straight", &w2).unwrap();
    for (world, accum) in [(1, 4), (4, 1)] {
        let name = format!("to{world}");
        let mut first: Vec<&str> = w2.to_vec();
        first.push("train.max_steps=2");
        run(r, &name, &first).unwrap();
        let ws = format!("dist.world_size={world}");
        let ac = format!("train.grad_accum_steps={accum}");
        let s = run(r, &name, &[&ws, &ac]).unwrap();
        assert_eq!(s.steps.first().map(|m| m.step), Some(3), "resumed after step 2");
        let (dl, dw) = compare(r, "straight", &name);
        println!("saved on 2 ranks, resumed on {world}: max loss rel diff {dl:.2e}, max adapter abs diff {dw:.2e}");
        assert!(dl < 1e-5 && dw < 1e-5);
    }
    // A different global batch is refused, naming the key that fixes it.
    let mut first: Vec<&str> = w2.to_vec();
    first.push("train.max_steps=2");
    run(r, "bad", &first).unwrap();
    let e = run(r, "bad", &["dist.world_size=4", "train.grad_accum_steps=2"]).unwrap_err().to_string();
    assert!(e.contains("train.grad_accum_steps") && e.contains("global batch"), "{e}");
}

#[test]
fn a_rank_that_fails_stops_the_others_with_its_error_not_a_hang() {
    let root = workspace("LlamaForCausalLM", false);
    let r = root.path();
    let started = Instant::now();
    let opts = finetune::train::RunOptions { fail_rank_at_step: Some((1, 3)), ..Default::default() };
    let e = run_opts(r, "dies", &["dist.world_size=3", "train.grad_accum_steps=1", "dist.timeout_s=20"], &opts).unwrap_err().to_string();
    assert!(started.elapsed() < Duration::from_secs(20), "the other ranks waited for the timeout");
    assert!(e.contains("rank 1") && e.contains("step 3"), "{e}");
    // Steps 1 and 2 were checkpointed; nothing of step 3 was written.
    let ck = r.join("dies/out/checkpoints");
    assert!(ck.join("step-000002").is_dir() && !ck.join("step-000003").exists());
}

/// A rank blocked outside any collective (here the lead opening metrics.jsonl, a FIFO no one
/// writes: an NFS or FUSE mount that stopped answering) cannot be joined: the others time out,
/// and dist.timeout_s later the process stops with both errors instead of waiting forever.
#[test]
fn a_rank_blocked_outside_a_collective_stops_the_process_after_the_timeout() {
    let root = workspace("LlamaForCausalLM", false);
    let dir = root.path().join("fifo");
    std::fs::create_dir_all(dir.join("out")).unwrap();
    std::fs::write(dir.join("recipe.toml"), RECIPE).unwrap();
    let fifo = std::ffi::CString::new(dir.join("out/metrics.jsonl").to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_finetune"))
        .arg("--recipe")
        .arg(dir.join("recipe.toml"))
        .args(["--set", "dist.world_size=2", "--set", "train.grad_accum_steps=2", "--set", "dist.timeout_s=2"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("the process still ran 60 s after a rank timed out");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("timed out") && err.contains("rank 0 still running") && err.contains("blocked outside any collective"), "{err}");
}

#[test]
fn the_lead_failing_to_write_a_checkpoint_stops_every_rank() {
    let root = workspace("LlamaForCausalLM", false);
    let r = root.path();
    // `checkpoints` as a file: rank 0 cannot create the checkpoint folder after step 1.
    std::fs::create_dir_all(r.join("blocked/out")).unwrap();
    std::fs::write(r.join("blocked/out/checkpoints"), b"not a folder").unwrap();
    let started = Instant::now();
    let e = run(r, "blocked", &["dist.world_size=2", "train.grad_accum_steps=2", "dist.timeout_s=30"]).unwrap_err().to_string();
    assert!(started.elapsed() < Duration::from_secs(30), "the other rank waited for the timeout");
    assert!(e.contains("checkpoints"), "{e}");
}

#[test]
fn missing_devices_are_named_errors() {
    let root = workspace("LlamaForCausalLM", false);
    let r = root.path();
    let e = run(r, "gpu1", &["dist.devices=[\"cuda:0\"]"]).unwrap_err().to_string();
    assert!(e.contains("dist.devices") && e.contains("cuda:0"), "{e}");
    let e = run(r, "gpu2", &["dist.devices=[\"cuda:0\", \"cuda:1\"]"]).unwrap_err().to_string();
    assert!(e.contains("dist.devices") && e.contains("NCCL"), "{e}");
    let e = run(r, "mismatch", &["dist.world_size=3", "dist.devices=[\"cpu\", \"cpu\"]"]).unwrap_err().to_string();
    assert!(e.contains("dist.world_size") && e.contains("2 device(s)"), "{e}");
    assert!(!r.join("gpu1/out").exists() && !r.join("gpu2/out").exists());
}

#[test]
fn plan_for_deepseek_7b_shards_the_base_over_1_2_4_8_gpus() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_finetune"))
        .args(["plan", "--recipe"])
        .arg(root.join("recipes/deepseek-7b-lora.toml"))
        .args(["--world-size", "1,2,4,8", "--set", "model.path=models/deepseek-llm-7b-base"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success());
    assert!(text.contains("8 GPUs") && text.contains("frozen base kept") && text.contains("optimizer state per rank"));

    // The numbers, from first principles: 6.91 B bf16 params split 1/N (per-tensor padding
    // at most one element each), the largest unit gathered (the 102400 x 4096 embedding /
    // lm_head, bigger than two decoder layers), LoRA f32, AdamW 2 x f32 per owned parameter.
    let cfg = finetune::config::ModelConfig::from_file(&root.join("recipes/models/deepseek-llm-7b-base/config.json")).unwrap();
    let r = LoadedRecipe::load(&root.join("recipes/deepseek-7b-lora.toml"), &[]).unwrap().recipe;
    let base = cfg.base_param_count() as usize * 2;
    let n_tensors = cfg.frozen_tensors().len();
    let layer = (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096) * 2;
    for w in [1, 2, 4, 8] {
        let p = finetune::dist::plan::plan(&cfg, &r, w, true);
        assert!(p.frozen >= base / w && p.frozen <= base / w + n_tensors * 2, "world {w}: {} vs {}", p.frozen, base / w);
        assert_eq!(p.gathered_peak, (102400usize * 4096 * 2).max(2 * layer), "world {w}");
        assert_eq!(p.lora_params, 62_914_560 * 4);
        assert_eq!(p.optimizer, 2 * 4 * 62_914_560usize.div_ceil(w));
        assert!(p.optimizer_on_host);
    }
}

#[test]
fn plan_refuses_what_train_refuses_world_sizes_past_the_limit_a_sharded_quantized_base_and_missing_targets() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let plan = |extra: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_finetune"))
            .args(["plan", "--recipe"])
            .arg(root.join("recipes/deepseek-7b-lora.toml"))
            .args(["--set", "model.path=models/deepseek-llm-7b-base"])
            .args(extra)
            .output()
            .unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).to_string())
    };
    let (ok, err) = plan(&["--world-size", "4,18446744073709551615"]);
    assert!(!ok && err.contains("--world-size 18446744073709551615") && !err.contains("panicked"), "{err}");
    let (ok, err) = plan(&["--world-size", "1,2", "--set", "model.quantize=q4_k", "--set", "dist.zero_stage=3"]);
    assert!(!ok && err.contains("dist.zero_stage") && err.contains("quantized base is not sharded"), "{err}");
    assert!(plan(&["--world-size", "1", "--set", "model.quantize=q4_k", "--set", "dist.zero_stage=3"]).0, "one rank shards nothing");
    let (ok, err) = plan(&["--set", "lora.targets=[\"q_a_proj\"]"]);
    assert!(!ok && err.contains("lora.targets") && err.contains("q_a_proj") && err.contains("this model has"), "{err}");
}

/// DeepSeek-V2 (MLA + MoE, the parity fixture's model) with adapters on every routed expert:
/// world sizes 1/2/4 equal one rank. Rows are 2 tokens and micro-batches one row, so each
/// rank's micro-batch reaches at most 2 x 2 of the 6 experts in every MoE layer: ranks always
/// skip experts. Each layer, experts included, is one gathered unit, so such a rank still
/// takes part in every collective and finishes the step.
#[test]
fn world_sizes_1_2_4_agree_on_a_moe_model_whose_ranks_skip_experts() {
    let d = tempfile::tempdir().unwrap();
    copy_dir(&fixture("parity-deepseek-v2").join("model"), &d.path().join("model"));
    write_tokenized_dataset(&d.path().join("data"), &two_token_rows()).unwrap();
    let targets = "lora.targets=[\"q_proj\", \"kv_b_proj\", \"o_proj\", \"down_proj\"]";
    check_world_sizes_with(d, "DeepseekV2ForCausalLM", false, &[targets, "lora.routed_experts=true"]);
}
