//! The training loop, as one visible function: setup, train, cleanup. No trainer framework.
//!
//! Data flow of one optimizer step (see ARCHITECTURE.md):
//!   rows -> micro-batches (padded) -> count the step's targets
//!   per micro-batch: embed -> layers (LoRA) -> final norm -> target rows -> chunked CE
//!                    -> dLoss/dhidden -> backward through the layers (recomputed per layer
//!                    when activation checkpointing is on) -> LoRA grads accumulated
//!   grads -> global norm, clip -> AdamW (host f32) -> write back to the Vars -> metrics line
//!
//! Beside it: `run_folder` (claiming output.dir, whether a checkpoint continues the same run),
//! `inputs` (the data and evaluation sets, evaluation) and `budget` (what activation
//! checkpointing keeps).

use crate::config::ModelConfig;
use crate::data::{Loader, MicroBatch, Role, IGNORE};
use crate::error::{CandleContext, Error, Result};
use crate::lora::{Adapters, DropoutCtx, LoraSpec};
use crate::model::Model;
use crate::dist::collective::{Collective, InProcessGroup};
use crate::dist::Partition;
use crate::dist::zero::{Account, MemoryUse, ShardedWeights};
use crate::ops::checkpoint::{KeepLayer, Kept, Pass};
use crate::optim::{AdamW, Moments, Schedule};
use crate::recipe::LoadedRecipe;
use crate::weights::quantized::{BlockReader, QuantizeOnLoad, QuantizedWeights};
use crate::weights::{parse_dtype, ModelDir, ResidentWeights, WeightSource};
use candle_core::{DType, Tensor, Var};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod budget;
mod inputs;
mod run_folder;
pub use budget::*;
pub use inputs::*;
pub use run_folder::*;

/// What PEFT's `print_trainable_parameters` reports, from the config alone.
pub fn trainable_parameters(cfg: &ModelConfig, spec: &LoraSpec) -> (u64, u64) {
    let trainable: u64 = (0..cfg.num_hidden_layers)
        .flat_map(|l| cfg.linear_sites(l))
        .filter(|path| crate::lora::is_targeted(path, spec))
        .filter_map(|path| cfg.linear_shape(&path))
        .map(|(i, o, _)| (spec.rank * (i + o)) as u64)
        .sum();
    (trainable, trainable + cfg.base_param_count())
}

pub fn format_trainable(trainable: u64, all: u64) -> String {
    let pct = 100.0 * trainable as f64 / all as f64;
    format!("trainable params: {} || all params: {} || trainable%: {pct:.4}", commas(trainable), commas(all))
}

/// How many records the training data has and what `max_steps` makes of them, as the
/// transformers Trainer's "Num examples / Num Epochs / Total optimization steps" lines say
/// (a recipe has steps, not epochs: this tells how many epochs they are).
pub fn describe_epoch(r: &crate::recipe::Recipe, records: u64, world: usize) -> String {
    let t = &r.train;
    let head = format!("training data: {} records; max_steps = {}", commas(records), t.max_steps);
    if r.data.batch_by == "tokens" {
        let n = t.grad_accum_steps * world;
        return format!("{head}, each step {n} token batch{} of at most {} tokens (grad_accum_steps x ranks)", if n == 1 { "" } else { "es" }, r.data.max_tokens);
    }
    if records == 0 {
        // The loader says why (every row held out for evaluation, say) when it reads.
        return head;
    }
    let rows = t.micro_batch_size * t.grad_accum_steps * world;
    let batch = format!("each step {rows} rows (micro_batch_size {} x grad_accum_steps {} x {world} rank{})", t.micro_batch_size, t.grad_accum_steps, if world == 1 { "" } else { "s" });
    let per_epoch = records as f64 / rows as f64;
    let epochs = t.max_steps as f64 / per_epoch.max(f64::MIN_POSITIVE);
    match r.data.packing {
        // A packed row holds one record or more: an epoch takes that many steps at most.
        true => format!("{head}, {batch} packed with one record or more: an epoch is at most {per_epoch:.1} steps, so the run reads at least {epochs:.2} epochs"),
        false => format!("{head}, {batch}: an epoch is {per_epoch:.1} steps, so the run reads {epochs:.2} epochs{}", if r.data.overflow == "drop" || r.data.on_bad_record == "skip" { " (fewer steps an epoch for records dropped or skipped)" } else { "" }),
    }
}

/// n with its digits in groups of three (1,234,567), as the trainable-parameter line and the
/// report print counts.
pub(crate) fn commas(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// One line of metrics.jsonl.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct StepMetrics {
    pub step: usize,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    /// Target tokens (labels != -100) in the step.
    pub tokens: usize,
    /// Non-padding input tokens processed per second of the step.
    pub tokens_per_s: f64,
    /// Seconds the step took (reading its batches, forward, backward and update; not the
    /// evaluation after it): with `tokens_per_s`, the run's throughput is their weighted sum.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_seconds: Option<f64>,
    /// Token-normalised loss on the evaluation set after this step's update, when evaluated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    /// When the step ended, seconds since the Unix epoch (TensorBoard's wall time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wall_time: Option<f64>,
    /// The process's resident set after the step, MB (where /proc has it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rss_mb: Option<f64>,
}

#[derive(Debug)]
pub struct RunSummary {
    /// Metrics of the steps run in this invocation.
    pub steps: Vec<StepMetrics>,
    pub output_dir: PathBuf,
    /// Set when a stop was requested (SIGINT = 2, SIGTERM = 15): the run saved a checkpoint
    /// after the current step and returned early.
    pub interrupted: Option<usize>,
    /// The last checkpoint written or resumed from.
    pub checkpoint: Option<PathBuf>,
    /// What each local rank held, from its memory account.
    pub memory: Vec<MemoryUse>,
    /// The lead's hold on the output folder: keep it while writing there after training
    /// (the merged export), drop it to let another run have the folder.
    pub lock: Option<crate::output::RunLock>,
}

/// How the caller talks to a running training loop.
#[derive(Clone, Default)]
pub struct RunOptions {
    /// Non-zero: finish the current optimizer step, checkpoint, and return (the value is the
    /// signal number that asked for it).
    pub stop: Option<Arc<AtomicUsize>>,
    /// Fault injection for tests: rank `.0` fails when it starts step `.1` (a rank dying).
    #[doc(hidden)]
    pub fail_rank_at_step: Option<(usize, usize)>,
}

/// Train as the recipe says (see [`run_with`]), and give the output folder up on return.
pub fn run(loaded: &LoadedRecipe) -> Result<RunSummary> {
    let mut s = run_with(loaded, &RunOptions::default())?;
    s.lock = None;
    Ok(s)
}

/// Train as the recipe says, on every rank `[dist]` asks for. Everything that can be wrong
/// with the input (model, adapter, data) is checked before the output folder is touched.
/// With `checkpoint.resume = "auto"` the newest valid checkpoint in the output folder is
/// continued exactly, whatever world size wrote it.
pub fn run_with(loaded: &LoadedRecipe, run_opts: &RunOptions) -> Result<RunSummary> {
    let kept_dtype = dtype_of_resumed_run(loaded);
    let loaded = &kept_dtype.unwrap_or_else(|| loaded.clone());
    let r = &loaded.recipe;
    note_rounded_auto_dtype(loaded);
    let out = loaded.resolve(&r.output.dir);
    if out.exists() && !out.is_dir() {
        let msg = format!("{} exists and is not a folder (the run's folder is created where none is)", out.display());
        return Err(Error::Recipe { file: loaded.file.display().to_string(), key: "output.dir".into(), msg });
    }
    let file = loaded.file.display().to_string();
    let layout = crate::dist::layout(&r.dist, &r.model.device, &|k| std::env::var(k).ok())
        .map_err(|(key, msg)| Error::Recipe { file: file.clone(), key, msg })?;
    let on_gpu = layout.local.iter().any(|(_, d)| *d != crate::device::DeviceSpec::Cpu);
    if on_gpu && r.dist.offload_optimizer == "none" {
        return Err(Error::Recipe {
            file: file.clone(),
            key: "dist.offload_optimizer".into(),
            msg: "AdamW runs on the host; keeping its state on the GPU (\"none\") is not implemented, use \"cpu\"".into(),
        });
    }
    // Hub repos are fetched here, once, before any rank starts: the ranks then find them in
    // the cache instead of racing each other for the same files (separate processes wait on
    // the repo's download lock).
    ModelDir::of_recipe(loaded)?;
    let d = &r.data;
    // (Without data.eval the held-out rows come from data.train's sources: fetched once.)
    let roles: &[Role] = if d.eval.is_some() { &[Role::Train, Role::Eval] } else { &[Role::Train] };
    for &role in roles {
        let (specs, split) = data_sources(d, role);
        for p in specs {
            hub_dataset(loaded, &p, split)?;
        }
    }
    if layout.world > 1 && on_gpu {
        #[cfg(feature = "nccl")]
        return crate::dist::nccl::run(loaded, run_opts, &layout);
        #[cfg(not(feature = "nccl"))]
        return Err(Error::Recipe {
            file,
            key: if r.dist.devices.is_some() { "dist.devices" } else { "dist.world_size" }.into(),
            msg: format!(
                "{} CUDA ranks need NCCL, which this binary was built without \
                 (cargo build --release --features nccl); CPU ranks need no feature",
                layout.world
            ),
        });
    }
    if layout.processes > 1 {
        return Err(Error::Recipe {
            file,
            key: "$WORLD_SIZE".into(),
            msg: format!(
                "WORLD_SIZE={} asks for several processes, but CPU ranks run as threads of one process: \
                 unset WORLD_SIZE/RANK and set dist.world_size",
                layout.processes
            ),
        });
    }
    let group = InProcessGroup::new(layout.world, Duration::from_secs(r.dist.timeout_s));
    let mut ranks: Vec<(Arc<dyn Collective>, candle_core::Device)> = Vec::new();
    for &(rank, spec) in &layout.local {
        ranks.push((Arc::new(group.member(rank)), open_device(loaded, spec)?));
    }
    run_ranks(loaded, run_opts, ranks, &|rank, why| group.abort(rank, why), &|| group.failure())
}

/// With `model.dtype` left to "auto", a run that resumes keeps the dtype its checkpoint was
/// trained in (recorded in its recipe.toml), so an older run (the default was f32) or one
/// moved to a CPU of the other kind continues as it began, with a note. `None`: nothing to
/// change (the checkpoint itself is checked later, as always).
fn dtype_of_resumed_run(loaded: &LoadedRecipe) -> Option<LoadedRecipe> {
    let r = &loaded.recipe;
    if !loaded.dtype_auto {
        return None;
    }
    let dir = resume_dir(loaded)?;
    let saved: toml::Table = std::fs::read_to_string(dir.join("recipe.toml")).ok()?.parse().ok()?;
    let dtype = saved.get("model")?.get("dtype")?.as_str()?.to_string();
    if dtype == r.model.dtype || !["f32", "bf16", "f16"].contains(&dtype.as_str()) {
        return None;
    }
    crate::note!("model.dtype = \"auto\": resuming in {dtype}, the dtype {} was trained in (set model.dtype to choose)", dir.display());
    let mut l = loaded.clone();
    l.recipe.model.dtype = dtype;
    Some(l)
}

/// With `model.dtype` left to "auto" on a CPU with a bf16 unit, an f32 or f16 checkpoint
/// trains on its weights rounded to bf16 (as PEFT on a bf16 base): said once, with the key
/// that keeps them exact, since transformers' `dtype="auto"` would keep them as stored.
fn note_rounded_auto_dtype(loaded: &LoadedRecipe) {
    let m = &loaded.recipe.model;
    if !loaded.dtype_auto || m.dtype != "bf16" || m.quantize.is_some() {
        return;
    }
    // The tensors a bf16 base holds in bf16 (not the router's, kept f32; not FP8 scales,
    // not a bitsandbytes weight's quantisation state).
    let rounded = |n: &str| crate::weights::stored_dtype(n, DType::BF16) == DType::BF16 && !n.ends_with("_scale_inv") && !crate::weights::bnb::is_quant_state(n);
    // What gets rounded: the checkpoint's wider weights, or a local GGUF's (not a hub repo
    // yet to download) where its matrices are not bf16.
    let rounded_weights = match crate::weights::stored_dtypes(&m.path, m.revision.as_deref(), &loaded.dir, &rounded) {
        Some(stored) => {
            let wider: Vec<&str> = [(safetensors::Dtype::F32, "f32"), (safetensors::Dtype::F16, "f16")].into_iter().filter(|(d, _)| stored.contains(d)).map(|(_, name)| name).collect();
            (!wider.is_empty()).then(|| format!("checkpoint's {} weights", wider.join(" and ")))
        }
        None => {
            let file = loaded.resolve(std::path::Path::new(&m.path));
            let gguf = (file.is_file() && crate::weights::is_gguf_file(&file)).then(|| crate::gguf::open(&file).ok()).flatten();
            match gguf.map(|g| g.weights_dtype()) {
                Some(DType::F16) => Some("GGUF's f16 weights".to_string()),
                Some(DType::F32) => Some("GGUF's weights (f32 once dequantised)".to_string()),
                _ => None,
            }
        }
    };
    if let Some(what) = rounded_weights {
        crate::note!("note: model.dtype = \"auto\" runs the frozen base in bf16 on this CPU's bf16 unit: the {what} are rounded to bf16; model.dtype = \"f32\" keeps them exact (slower)");
    }
}

/// The checkpoint a run continues from, as `checkpoint.resume` says: none ("never"), the
/// newest valid one in output.dir ("auto"), or the folder named.
fn resume_dir(loaded: &LoadedRecipe) -> Option<PathBuf> {
    let r = &loaded.recipe;
    match r.checkpoint.resume.as_str() {
        "never" => None,
        "auto" => crate::checkpoint::latest_valid(&loaded.resolve(&r.output.dir)),
        path => Some(loaded.resolve(std::path::Path::new(path))),
    }
}

/// Open a rank's device; the error names the recipe key that chose it.
pub fn open_device(loaded: &LoadedRecipe, spec: crate::device::DeviceSpec) -> Result<candle_core::Device> {
    let key = if loaded.recipe.dist.devices.is_some() { "dist.devices" } else { "model.device" };
    crate::device::open(spec).map_err(|msg| Error::Recipe { file: loaded.file.display().to_string(), key: key.into(), msg })
}

/// Run one training loop per local rank, one thread each (the calling thread when there is
/// only one), and return the lead rank's summary, or the error of the rank that failed
/// first (the others only report that it did).
pub fn run_ranks(
    loaded: &LoadedRecipe,
    run_opts: &RunOptions,
    mut ranks: Vec<(Arc<dyn Collective>, candle_core::Device)>,
    abort: &(dyn Fn(usize, &str) + Sync),
    first_failure: &dyn Fn() -> Option<(usize, String)>,
) -> Result<RunSummary> {
    if ranks.len() == 1 {
        let (comm, dev) = ranks.remove(0);
        return train_rank(loaded, run_opts, comm, dev);
    }
    let mut results: Vec<(usize, Result<RunSummary>)> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|(comm, dev)| {
                let rank = comm.rank();
                // Deep autograd graphs recurse; rank threads get the main thread's headroom.
                let h = std::thread::Builder::new().name(format!("rank-{rank}")).stack_size(64 << 20).spawn_scoped(s, move || {
                    // Hold the handle until the failure is recorded: dropping it first would
                    // tell the others "rank r left" before they could learn why.
                    let handle = comm.clone();
                    let res = train_rank(loaded, run_opts, comm, dev);
                    if let Err(e) = &res {
                        abort(rank, &e.to_string());
                    }
                    drop(handle);
                    res
                });
                // Recorded as the cause, or the others report this rank as one that "left".
                if let Err(e) = &h {
                    abort(rank, &format!("rank {rank}: cannot start the rank's thread: {e}"));
                }
                (rank, h)
            })
            .collect();
        let finished = |h: &std::io::Result<std::thread::ScopedJoinHandle<'_, Result<RunSummary>>>| h.as_ref().map_or(true, |h| h.is_finished());
        let failed_at = std::cell::Cell::new(None::<std::time::Instant>);
        let timeout = Duration::from_secs(loaded.recipe.dist.timeout_s);
        serve_pool_until(|| {
            if handles.iter().all(|(_, h)| finished(h)) {
                return true;
            }
            // A rank blocked outside any collective (a file read or write that never returns)
            // would hold the scope, and the process, forever after the others stopped: as the
            // NCCL watchdog does, stop the process once timeout_s has passed since a failure.
            if let Some((rank, why)) = first_failure() {
                let at = failed_at.get().unwrap_or_else(std::time::Instant::now);
                failed_at.set(Some(at));
                if at.elapsed() > timeout {
                    let stuck: Vec<String> = handles.iter().filter(|(_, h)| !finished(h)).map(|(r, _)| r.to_string()).collect();
                    let cause = if why.starts_with(&format!("rank {rank}")) { why } else { format!("rank {rank}: {why}") };
                    crate::note!(
                        "error: {cause}\nerror: rank {} still running dist.timeout_s = {} s after that, blocked outside any collective (a file read or write that does not return?): stopping the process",
                        stuck.join(", "),
                        loaded.recipe.dist.timeout_s
                    );
                    std::process::exit(1);
                }
            }
            false
        });
        handles
            .into_iter()
            .map(|(rank, h)| {
                let res = match h {
                    Ok(h) => h.join().unwrap_or_else(|_| Err(Error::Dist { rank, msg: "the rank's thread panicked".into() })),
                    Err(e) => Err(Error::Dist { rank, msg: format!("cannot start the rank's thread: {e}") }),
                };
                (rank, res)
            })
            .collect()
    });
    // The error to show is the cause: the first rank that failed on its own, not the ranks
    // that stopped because of it.
    let cause = |res: &Result<RunSummary>| matches!(res, Err(e) if !matches!(e, Error::PeerFailed { .. }));
    let first = first_failure().map(|f| f.0);
    let pick = results
        .iter()
        .position(|(r, res)| Some(*r) == first && cause(res))
        .or_else(|| results.iter().position(|(_, res)| cause(res)))
        .or_else(|| results.iter().position(|(_, res)| res.is_err()));
    if let Some(i) = pick {
        return results.swap_remove(i).1;
    }
    let mut memory = Vec::new();
    let mut lead = None;
    for (rank, res) in results {
        let s = res?;
        memory.extend(s.memory.iter().cloned());
        if lead.is_none() {
            lead = Some((rank, s));
        }
    }
    let (_, mut s) = lead.ok_or_else(|| Error::Train("no ranks ran".into()))?;
    memory.sort_by_key(|m| m.rank);
    s.memory = memory;
    Ok(s)
}

/// Wait until `done()`, running the rayon pool's pending jobs meanwhile. The binary makes
/// the main thread one of the pool's workers (`main.rs`, `tune_thread_pools`): blocked in a
/// join it would take a worker from the rank threads' parallel loops, and all of them when
/// the pool has one thread. Outside the pool (tests, library callers) this only polls.
fn serve_pool_until(done: impl Fn() -> bool) {
    while !done() {
        if rayon::yield_now() != Some(rayon::Yield::Executed) {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// The training loop of one rank: setup, resume, train, cleanup, each its own function below.
/// Every rank runs the same code and the same collectives in the same order; rank 0 (the
/// lead) alone writes files and prints. With one rank the collectives are identities.
///
/// Data parallel: each rank reads the same stream and takes its share of each step's
/// `grad_accum_steps * world` micro-batches (contiguous, in rank order), so the set of
/// examples in a step, their dropout masks and the token count that normalises the loss do
/// not depend on the world size.
fn train_rank(loaded: &LoadedRecipe, run_opts: &RunOptions, comm: Arc<dyn Collective>, device: candle_core::Device) -> Result<RunSummary> {
    let mut rk = setup(loaded, comm, device)?;
    let resumed = resume(&mut rk)?;
    let trained = train_steps(&mut rk, run_opts, &resumed)?;
    cleanup(rk, resumed, trained)
}

/// What a rank's setup builds and its later phases share.
struct RankRun<'a> {
    loaded: &'a LoadedRecipe,
    comm: Arc<dyn Collective>,
    device: candle_core::Device,
    rank: usize,
    world: usize,
    lead: bool,
    model_dir: ModelDir,
    model: Model,
    adapters: Adapters,
    loader: Loader,
    /// Evaluation examples, read once (eval sets are small) and reused at every eval.
    eval_set: Option<Vec<crate::data::Example>>,
    /// The LoRA parameters in `Adapters::params` order: the flattening the optimizer's
    /// partition indexes.
    vars: Vec<Var>,
    /// This rank's slice of the flattened parameters (and of the optimizer state).
    part: Partition,
    opt: AdamW,
    schedule: Schedule,
    account: Arc<Account>,
    out_dir: PathBuf,
    recipe_text: String,
    log: crate::runlog::RunLog,
    /// What ran, for summary.json (benchmarks label their rows with it, not with a guess).
    kernels_used: String,
    /// What the step's arithmetic runs on (`describe_kernels`; `kernels_used` before the
    /// checkpointing is added), recorded in checkpoints.
    kernels: String,
    sharded: bool,
    /// The fused CPU ops run / the base is resident as the matmuls read it: what
    /// checkpointing's choices depend on.
    fused: bool,
    resident: bool,
    /// `fsutil::fingerprint`s of the model's files and the training data's, recorded in
    /// checkpoints and compared on resume.
    model_fingerprint: String,
    data_fingerprint: String,
    template_fingerprint: Option<String>,
    /// The highest peak RSS of the run's earlier processes (the checkpoint resumed from
    /// records it), so a resumed run's summary reports the run's peak, not this process's.
    earlier_peak_rss_mb: Option<f64>,
}

impl RankRun<'_> {
    /// The run's peak RSS so far: this process's, or an earlier one's where higher (MB).
    fn run_peak_rss_mb(&self) -> Option<f64> {
        let now = crate::runlog::resident_mb(true);
        match (now, self.earlier_peak_rss_mb) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }

    /// What the run's adapters record besides their tensors: the base, and the chat template
    /// where the run's was not the model's own.
    fn adapter_origin(&self) -> crate::checkpoint::AdapterOrigin<'_> {
        crate::checkpoint::AdapterOrigin { base_model: &self.model_dir.name, chat_template: self.loader.formatter().template_not_the_models() }
    }
}

/// Where the step loop starts.
struct Resumed {
    start_step: usize,
    micro_index: u64,
    last_checkpoint: Option<PathBuf>,
    /// The lead's hold on the output folder.
    run_lock: Option<crate::output::RunLock>,
}

/// What the step loop leaves for cleanup.
struct Trained {
    history: Vec<StepMetrics>,
    /// The signal a requested stop came with.
    interrupted: Option<usize>,
    last_checkpoint: Option<PathBuf>,
}

// ---------------------------------------------------------------- setup

/// The model, adapters, data, optimizer and run log of one rank. Writes nothing yet.
fn setup(loaded: &LoadedRecipe, comm: Arc<dyn Collective>, device: candle_core::Device) -> Result<RankRun<'_>> {
    let r = &loaded.recipe;
    let t = &r.train;
    // Before the model loads (minutes for a large one): the data needs the template.
    loaded.existing_chat_template_file()?;
    let (rank, world) = (comm.rank(), comm.world_size());
    let lead = rank == 0;
    let model_dir = ModelDir::of_recipe(loaded)?;
    let cfg = model_dir.config()?;
    cfg.check_positions(r.data.max_seq_len).map_err(|msg| Error::Recipe {
        file: loaded.file.display().to_string(),
        key: "data.max_seq_len".into(),
        msg: format!("{msg}: set data.max_seq_len to at most {}", cfg.attention_window.unwrap_or(0)),
    })?;
    if r.export.gguf {
        // Refused now, not after the run trained.
        crate::export::gguf::adapter_arch(&model_dir).map_err(|e| match e {
            Error::Export(msg) => Error::Recipe { file: loaded.file.display().to_string(), key: "export.gguf".into(), msg },
            other => other,
        })?;
    }
    let storage_dtype = parse_dtype(&r.model.dtype);
    // The fused CPU kernels compute in f32 (a bf16/f16 base is only the storage format of the
    // frozen weights there); GPUs and the portable path compute in the storage dtype.
    let kernels = r.model.kernels();
    let compute_dtype = kernels.compute_dtype(storage_dtype, &device);
    let matmul = kernels.matmul_dtype(&r.model.matmul, storage_dtype, compute_dtype, &device);
    if lead && kernels == crate::ops::Kernels::Portable {
        crate::note!("portable kernels (the GPU path): activations in {compute_dtype:?}");
    }
    let kernels_used = describe_kernels(lead, kernels, &device, (compute_dtype, matmul), cfg.attention_head_width());
    let account = Arc::new(Account::default());
    let sharded = r.dist.zero_stage == 3;
    let frozen = FrozenPlacement { storage: storage_dtype, compute: compute_dtype, matmul, device: device.clone(), account: account.clone() };
    let (src, quantized) = frozen_source(loaded, &model_dir, &cfg, comm.clone(), frozen)?;
    if let (true, Some(crate::weights::quantized::Quantize::Ggml(q))) = (lead, r.model.quantize.as_deref().and_then(crate::weights::quantized::parse_quantize)) {
        if let Some(n) = crate::weights::quantized::fallback_note(q, &cfg) {
            crate::note!("{n}");
        }
    }
    let lora_spec = r.lora.spec(&cfg);
    // Same seed on every rank: every rank starts from the same adapters.
    let adapters = Adapters::init(&cfg, lora_spec, t.seed, &device)?;
    if let Some(init) = &r.lora.init_from {
        adapters.load_peft(&loaded.resolve(init))?;
    }
    let model = Model::load(src.clone(), cfg, &adapters)?.with_kernels(kernels);
    src.seal();
    if lead {
        crate::weights::note_unread(&model_dir, model.asked(), &model.cfg);
    }
    if !sharded && !quantized {
        // ShardedWeights and QuantizedWeights count what they hold as they read it.
        let bytes = crate::weights::frozen_bytes(&model.cfg, storage_dtype) - src.bytes_in_files();
        account.frozen.store(bytes, Ordering::SeqCst);
    }
    let loader = open_loader(loaded, &model_dir, model.cfg.vocab_size, Role::Train)?;
    let eval_set = read_eval_set(loaded, &model_dir, model.cfg.vocab_size, &loader.files(), lead)?;
    if lead {
        let (trainable, all) = trainable_parameters(&model.cfg, &adapters.spec);
        crate::note!("{}", format_trainable(trainable, all));
        crate::note!("{}", describe_epoch(r, loader.records(), world));
        if world > 1 {
            crate::note!("{world} ranks, zero_stage {}, optimizer state on the host", r.dist.zero_stage);
        }
    }

    // Optimizer state is partitioned: all LoRA parameters flattened (in `Adapters::params`
    // order) into P values; rank r owns [r c, (r+1) c) with c = ceil(P / world).
    let vars: Vec<Var> = adapters.params().into_iter().map(|(_, v)| v.clone()).collect();
    let total: usize = vars.iter().map(|v| v.elem_count()).sum();
    let part = Partition::new(total, rank, world);
    let opt = AdamW::new(part.len(), (t.adam_betas[0], t.adam_betas[1]), t.adam_eps, t.weight_decay);
    let schedule = Schedule::parse(&t.lr_scheduler);
    account.lora_params.store(total * 4, Ordering::SeqCst);
    account.lora_grads.store(total * 8, Ordering::SeqCst); // accumulated in f64
    account.optimizer.store(2 * part.len() * 4, Ordering::SeqCst);

    // The output folder is written only once the first step has run, so input that fails on
    // its first rows (bad data, a model that does not fit) leaves nothing behind (the lock
    // taken in `resume` removes a folder it created and nothing else wrote to).
    let out_dir = loaded.resolve(&r.output.dir);
    let recipe_text = recorded_recipe(loaded, &model.cfg, &model_dir)?;
    let log = crate::runlog::RunLog::new(&out_dir, &recipe_text, r.output.tensorboard);
    let (fused, resident) = (kernels.fused_on(&device), !sharded && !quantized && matmul == storage_dtype);
    let (model_fingerprint, data_fingerprint, template_fingerprint) = input_fingerprints(loaded, &model_dir, &loader);
    Ok(RankRun {
        loaded,
        comm,
        device,
        rank,
        world,
        lead,
        model_dir,
        model,
        adapters,
        loader,
        eval_set,
        vars,
        part,
        opt,
        schedule,
        account,
        out_dir,
        recipe_text,
        log,
        kernels: kernels_used.clone(),
        kernels_used,
        sharded,
        fused,
        resident,
        model_fingerprint,
        data_fingerprint,
        template_fingerprint,
        earlier_peak_rss_mb: None,
    })
}

/// What the fused ops will run on (printed by the lead where a bf16 unit takes the frozen
/// matmuls), as summary.json records it.
fn describe_kernels(lead: bool, kernels: crate::ops::Kernels, device: &candle_core::Device, (compute_dtype, matmul): (DType, DType), head_width: usize) -> String {
    let attention_tiles = kernels == crate::ops::Kernels::Auto && crate::ops::attention::runs_on_tiles(matmul, head_width);
    // bf16 matmul operands run on the CPU's bf16 unit where it has one, else widen to f32.
    let bf16_unit = matmul != compute_dtype && crate::ops::bf16_gemm::available();
    if lead && bf16_unit {
        let unit = crate::ops::bf16_gemm::kernel().map_or("?", crate::ops::bf16_gemm::Kernel::name);
        let what = if attention_tiles { "frozen matmuls and attention's" } else { "frozen matmuls" };
        crate::note!("{what} run in bf16 on {unit} with f32 sums (model.matmul = \"f32\" for f32 math)");
    }
    match (device, kernels) {
        (candle_core::Device::Cpu, crate::ops::Kernels::Auto) => {
            let f32_gemm = if crate::runlog::cpu_has("avx512f") { "AVX-512" } else { "AVX2+FMA" };
            let frozen = match (bf16_unit, matmul != compute_dtype) {
                (true, _) => crate::ops::bf16_gemm::kernel().map_or("?", crate::ops::bf16_gemm::Kernel::name),
                (false, true) => "bf16 weights widened to f32 (f32 math)",
                (false, false) => "f32",
            };
            let attention = match (attention_tiles, crate::ops::bf16_gemm::kernel()) {
                (true, Some(k)) => format!("{} (bf16 operands)", k.name()),
                _ => "f32".to_string(),
            };
            format!("fused CPU ops; f32 GEMM: gemm crate ({f32_gemm}); frozen matmuls: {frozen}; attention GEMMs: {attention}")
        }
        (d, k) => {
            // The kind of device only: its Debug names candle's process-wide device counter,
            // which differs between runs and ranks (checkpoints compare this text on resume).
            let on = match d.location() {
                candle_core::DeviceLocation::Cpu => "CPU",
                candle_core::DeviceLocation::Cuda { .. } => "CUDA",
                candle_core::DeviceLocation::Metal { .. } => "Metal",
            };
            format!("{k:?} ops on {on}, activations in {compute_dtype:?}")
        }
    }
}

// ---------------------------------------------------------------- resume

/// Take the output folder, and continue from the newest valid checkpoint when there is one:
/// adapters, optimizer moments, data position. Every rank agrees on the step.
fn resume(rk: &mut RankRun) -> Result<Resumed> {
    let (loaded, rank, lead) = (rk.loaded, rk.rank, rk.lead);
    let mut start_step = 0;
    let mut micro_index = 0u64;
    let mut last_checkpoint = None;
    // The lead takes the folder (one run per folder) and sets aside what belongs to another
    // run; every rank learns whether it could before reading checkpoints.
    // Whether a checkpoint may be continued: its recipe allows this one, and it is the same
    // run (examples per step, files). Checked before anything in the folder moves.
    let resumable = |dir: &std::path::Path| -> Result<()> {
        check_resumable(loaded, dir)?;
        let (state, saved) = crate::checkpoint::read_state(dir)?;
        check_same_run(rk, &state, &saved, dir).map(|_| ())
    };
    let claimed = if lead { claim_output(loaded, &rk.out_dir, &resumable).map(Some) } else { Ok(None) };
    let said = from_lead(&*rk.comm, &rk.device, &[claimed.is_ok() as u8 as f64])?;
    let run_lock = claimed?;
    if said[0] == 0.0 {
        return Err(lead_failed(rank, "to take the output folder"));
    }
    if let Some(dir) = resume_dir(loaded) {
        // Recipe rules first: a changed LoRA shape should be reported as the key that changed,
        // not as a tensor that no longer fits.
        let saved = std::fs::read_to_string(dir.join("recipe.toml")).map_err(|e| Error::io(dir.join("recipe.toml"), e))?;
        let warnings = crate::checkpoint::check_recipe_change(&saved, &rk.recipe_text, &|p| recipe_place(loaded, p), &|k| loaded.written.contains(k))
            .map_err(|(key, msg)| Error::Recipe { file: loaded.file.display().to_string(), key, msg: format!("{msg} [checkpoint {}]", dir.display()) })?;
        for w in warnings.iter().filter(|_| lead) {
            crate::note!("warning: {w}");
        }
        let l = crate::checkpoint::load(&dir, &rk.adapters)?;
        if let Some(note) = check_same_run(rk, &l.state, &saved, &dir)?.filter(|_| lead) {
            crate::note!("{note}");
        }
        if let Some(then) = l.state.kernels.as_ref().filter(|k| **k != rk.kernels && lead) {
            crate::note!(
                "{} was trained on other kernels ({then}) than this run's ({}): the same math, but sums in another order (or activations rounded to bf16 \
                 on one side only), so the steps from here will not match bit for bit those the first machine would have computed",
                dir.display(),
                rk.kernels
            );
        }
        rk.opt.state = l.moments.slice(rk.part.range());
        rk.opt.step = l.adam_step;
        rk.loader.restore(&l.state.loader)?;
        // A run that ended (or stopped) at this step and now goes on: what it wrote then is
        // the step-N result, not this run's; left in place, `export --run` would take the
        // old adapter for the new one. Only now, once nothing above refused the resume.
        if loaded.recipe.train.max_steps > l.state.step {
            let finals: Vec<PathBuf> = crate::output::FINAL_OUTPUTS.iter().map(PathBuf::from).collect();
            let moved = if lead { crate::output::set_aside(&rk.out_dir, &finals, &[]) } else { Ok(None) };
            let said = from_lead(&*rk.comm, &rk.device, &[moved.is_ok() as u8 as f64])?;
            if let Some(d) = moved? {
                crate::note!("the run continues past step {}: what it wrote when it ended there (adapter, summary, ...): moved to {} (nothing was deleted)", l.state.step, d.display());
            }
            if said[0] == 0.0 {
                return Err(lead_failed(rank, "to set aside what the run wrote when it ended"));
            }
        }
        start_step = l.state.step;
        micro_index = l.state.micro_index;
        rk.earlier_peak_rss_mb = l.state.peak_rss_mb;
        last_checkpoint = Some(dir);
    }
    // Every rank must continue from the checkpoint rank 0 continues from (different steps would
    // mean the ranks see different folders: output.dir not shared between nodes).
    let reopened = if lead && start_step > 0 { rk.log.resume(start_step) } else { Ok(()) };
    let said = from_lead(&*rk.comm, &rk.device, &[start_step as f64, reopened.is_ok() as u8 as f64])?;
    reopened?;
    if said[1] == 0.0 {
        return Err(lead_failed(rank, "to reopen metrics.jsonl"));
    }
    if said[0] as usize != start_step {
        return Err(Error::Dist {
            rank,
            msg: format!(
                "rank 0 continues from step {} but this rank found step {start_step} in {}: output.dir must be storage every rank sees",
                said[0] as usize,
                rk.out_dir.display()
            ),
        });
    }
    if lead {
        if let Some(dir) = &last_checkpoint {
            crate::note!("resuming from {} (step {start_step})", dir.display());
        }
    }
    Ok(Resumed { start_step, micro_index, last_checkpoint, run_lock })
}

// ---------------------------------------------------------------- train

/// The optimizer steps from the resumed one to `train.max_steps`, or to a requested stop
/// (which saves a checkpoint first).
fn train_steps(rk: &mut RankRun, run_opts: &RunOptions, resumed: &Resumed) -> Result<Trained> {
    let loaded = rk.loaded;
    let t = &loaded.recipe.train;
    let (rank, world, accum) = (rk.rank, rk.world, t.grad_accum_steps);
    let (checkpointing, pass_cap) = choose_checkpointing(rk);
    // This rank's f32 copy of its slice of the parameters (the "master" weights AdamW updates).
    let mut master = rk.part.slice(&flatten(&rk.vars)?);
    let progress = rk.lead.then(|| crate::progress::Progress::new(t.max_steps as u64, t.log_every));
    let stop_requested = || run_opts.stop.as_ref().map_or(0, |s| s.load(Ordering::SeqCst));
    let mut micro_index = resumed.micro_index;
    let mut done = Trained { history: Vec::new(), interrupted: None, last_checkpoint: resumed.last_checkpoint.clone() };
    for step in resumed.start_step + 1..=t.max_steps {
        if run_opts.fail_rank_at_step == Some((rank, step)) {
            return Err(Error::Train(format!("injected failure of rank {rank} at step {step}")));
        }
        let started = Instant::now();
        let batches = read_step_batches(rk)?;
        // Token-normalised across accumulation and ranks: the divisor is the whole global
        // batch's target count, which every rank knows because every rank reads the stream.
        let count: usize = batches.iter().map(|b| b.num_targets()).sum();
        if count == 0 {
            return Err(Error::Train(format!(
                "step {step}: no target tokens (every label is -100 after truncation to data.max_seq_len = {})",
                loaded.recipe.data.max_seq_len
            )));
        }
        let real_tokens: usize = batches.iter().map(|b| b.real_tokens()).sum();
        let (ce_sum, grads) = accumulate_gradients(rk, &batches, count, micro_index, checkpointing.as_deref(), pass_cap)?;
        micro_index += (accum * world) as u64;
        let loss = rk.comm.all_reduce(&Tensor::new(&[ce_sum], &rk.device)?)?.to_vec1::<f64>()?[0] / count as f64;
        if !loss.is_finite() {
            // Only step 1 comes before any update (a resumed run's weights were updated).
            return Err(non_finite_loss(loaded, step, step == 1, loss, &rk.adapters));
        }
        let (lr, grad_norm) = update(rk, &mut master, grads, step, loss)?;
        let secs = started.elapsed().as_secs_f64();
        let eval_loss = match &rk.eval_set {
            Some(ex) if (t.eval_every > 0 && step % t.eval_every == 0) || step == t.max_steps => {
                let (sum, n) = evaluate_part(&rk.model, &rk.adapters, ex, t.micro_batch_size, rank, world)?;
                let v = rk.comm.all_reduce(&Tensor::new(&[sum, n as f64], &rk.device)?)?.to_vec1::<f64>()?;
                Some(v[0] / v[1].max(1.0))
            }
            _ => None,
        };
        let m = StepMetrics {
            step,
            loss,
            lr,
            grad_norm,
            tokens: count,
            tokens_per_s: real_tokens as f64 / secs.max(1e-9),
            step_seconds: Some(secs),
            eval_loss,
            wall_time: Some(crate::tensorboard::now()),
            rss_mb: crate::runlog::resident_mb(false),
        };
        let written = if rk.lead { rk.log.append(&m) } else { Ok(()) };
        // The lead's view of a stop request (and of its own output) is everyone's, so all
        // ranks stop at the same step.
        let said = from_lead(&*rk.comm, &rk.device, &[stop_requested() as f64, written.is_ok() as u8 as f64])?;
        written?;
        if said[1] == 0.0 {
            return Err(lead_failed(rank, "to write metrics.jsonl"));
        }
        let stop = said[0] as usize;
        if let Some(p) = &progress {
            p.step(&m, t.max_steps);
        }
        done.history.push(m);
        // Checkpoints only at optimizer-step boundaries: mid-accumulation gradients are never
        // saved, so a resume is always at a clean step.
        let every = loaded.recipe.checkpoint.every_steps;
        if (every > 0 && step % every == 0) || step == t.max_steps || stop != 0 {
            if let Some(dir) = save_checkpoint(rk, step, micro_index)? {
                done.last_checkpoint = Some(dir);
            }
        }
        if stop != 0 {
            done.interrupted = Some(stop);
            break;
        }
    }
    if let Some(p) = &progress {
        p.finish();
    }
    if rk.lead && done.interrupted.is_none() && resumed.start_step >= t.max_steps {
        crate::note!("already complete: the checkpoint is at step {} of train.max_steps = {}", resumed.start_step, t.max_steps);
    }
    Ok(done)
}

/// What activation checkpointing keeps per layer (None: off) and the most tokens a pass of
/// a micro-batch's rows takes (None: whole micro-batches); said once, and recorded with the
/// kernels in summary.json.
fn choose_checkpointing(rk: &mut RankRun) -> (Option<Vec<KeepLayer>>, Option<usize>) {
    let r = &rk.loaded.recipe;
    let checkpointing = checkpoint_layers(r, &rk.model.cfg, rk.fused, rk.resident);
    let pass_cap = pass_tokens(r, rk.fused, rk.resident);
    let per = if pass_cap.is_some() { "pass" } else { "micro-batch" };
    let mut said = describe_checkpointing(checkpointing.as_deref(), kept_bytes_per_layer(&rk.model.cfg, pass_shape(r, rk.fused, rk.resident)), per);
    if let Some(cap) = pass_cap {
        said = format!("{said}; the rows of a micro-batch over {cap} tokens run in passes of at most {cap}");
    }
    if rk.lead {
        crate::note!("{said}");
    }
    rk.kernels_used = format!("{}; {said}", rk.kernels_used);
    (checkpointing, pass_cap)
}

/// The step's `grad_accum_steps * world` micro-batches, read by every rank from the same stream.
fn read_step_batches(rk: &mut RankRun) -> Result<Vec<MicroBatch>> {
    let r = &rk.loaded.recipe;
    let mut batches = Vec::with_capacity(r.train.grad_accum_steps * rk.world);
    for _ in 0..r.train.grad_accum_steps * rk.world {
        let rows = if r.data.batch_by == "tokens" {
            rk.loader.next_token_batch(r.data.max_tokens)?
        } else {
            (0..r.train.micro_batch_size).map(|_| rk.loader.next_row()).collect::<Result<Vec<_>>>()?
        };
        batches.push(MicroBatch::collate(&rows));
    }
    Ok(batches)
}

/// This rank's micro-batches of the step, forward and backward: the summed cross-entropy and
/// the LoRA gradients (f64, None for a tensor no token reached), each scaled by 1 / `count`.
fn accumulate_gradients(rk: &RankRun, batches: &[MicroBatch], count: usize, micro_index: u64, checkpointing: Option<&[KeepLayer]>, pass_cap: Option<usize>) -> Result<(f64, Vec<Option<Tensor>>)> {
    let r = &rk.loaded.recipe;
    let accum = r.train.grad_accum_steps;
    let mut grads: Vec<Option<Tensor>> = vec![None; rk.vars.len()];
    let mut ce_sum = 0.0;
    for (j, mb) in batches.iter().enumerate().skip(rk.rank * accum).take(accum) {
        // A micro-batch's rows in passes of at most `pass_cap` tokens (`pass_tokens`): the
        // same sums, in less memory. One pass is the micro-batch itself (no copy).
        let pass = rows_per_pass(pass_cap, mb.rows, mb.seq);
        for lo in (0..mb.rows.max(1)).step_by(pass) {
            let owned;
            let part = if pass >= mb.rows { mb } else { owned = mb.rows_range(lo, (lo + pass).min(mb.rows)); &owned };
            let first_token = (lo * mb.seq) as u64;
            let drop = (r.lora.dropout > 0.0).then_some(DropoutCtx { seed: r.train.seed, micro_batch: micro_index + j as u64, first_token });
            ce_sum += forward_backward(&rk.model, &rk.adapters, &rk.vars, part, 1.0 / count as f64, drop, checkpointing, &mut grads)?;
        }
    }
    Ok((ce_sum, grads))
}

/// Reduce-scatter the gradients, clip by the global norm, AdamW on this rank's slice, and
/// all-gather the updated parameters into every rank's adapters. Returns (lr, grad_norm).
fn update(rk: &mut RankRun, master: &mut [f32], grads: Vec<Option<Tensor>>, step: usize, loss: f64) -> Result<(f64, f64)> {
    let r = &rk.loaded.recipe;
    let t = &r.train;
    let (comm, device, part, vars) = (&*rk.comm, &rk.device, &rk.part, &rk.vars);
    // Which tensors had a gradient on any rank (a routed expert no token reached in the
    // whole step has none, and AdamW leaves it alone, as torch's does).
    let had: Vec<f64> = grads.iter().map(|g| if g.is_some() { 1.0 } else { 0.0 }).collect();
    let had = comm.all_reduce(&Tensor::from_vec(had, vars.len(), device)?)?.to_vec1::<f64>()?;
    let present: Vec<bool> = had.iter().zip(vars).flat_map(|(&h, v)| std::iter::repeat_n(h > 0.0, v.elem_count())).collect();
    let present = &present[part.range()];
    // Each rank keeps the sum over ranks of its slice of the gradient (summed in f64 like
    // the accumulation, then rounded once to f32).
    let mut g: Vec<f64> = Vec::with_capacity(part.padded());
    for (gi, v) in grads.iter().zip(vars) {
        match gi {
            Some(t) => g.extend(t.flatten_all()?.to_vec1::<f64>()?),
            None => g.extend(std::iter::repeat_n(0.0, v.elem_count())),
        }
    }
    drop(grads);
    g.resize(part.padded(), 0.0);
    let g = comm.reduce_scatter(&Tensor::from_vec(g, part.padded(), device)?)?;
    let mut g: Vec<f32> = g.narrow(0, 0, part.len())?.to_dtype(DType::F32)?.to_vec1()?;
    let norm_sq = comm.all_reduce(&Tensor::new(&[crate::optim::sum_squares(&g)], device)?)?.to_vec1::<f64>()?[0];
    let grad_norm = norm_sq.sqrt();
    if !grad_norm.is_finite() {
        // Clipping cannot rescue an inf/NaN gradient; AdamW would spread it into every weight.
        return Err(Error::Train(format!(
            "step {step}: the gradient norm is {grad_norm} although the loss ({loss:.4}) is finite: the backward pass \
             overflowed{}; stopping before the update",
            if r.model.dtype == "f16" { " (model.dtype = \"f16\" overflows easily: use \"bf16\")" } else { " (try a lower train.lr)" }
        )));
    }
    crate::optim::clip_to(&mut g, grad_norm, t.max_grad_norm);
    let lr = t.lr * rk.schedule.lambda(step - 1, t.warmup_steps, t.max_steps);
    rk.opt.step(master, &g, Some(present), lr);
    // Updated slices back to every rank.
    let full = part.gather(comm, master, device)?;
    if full.iter().any(|x| !x.is_finite()) {
        return Err(Error::Train(format!(
            "step {step}: the update made LoRA weights non-finite from a finite gradient; stopping before saving them \
             (train.lr = {:e} is too high{})",
            t.lr,
            if t.weight_decay > 0.0 { format!(", or train.weight_decay = {}", t.weight_decay) } else { String::new() }
        )));
    }
    let mut off = 0;
    for v in vars {
        let n = v.elem_count();
        v.set(&Tensor::from_slice(&full[off..off + n], v.shape(), device)?.to_dtype(v.dtype())?)?;
        off += n;
    }
    Ok((lr, grad_norm))
}

/// A checkpoint after `step`: the optimizer state consolidated from every rank (one state
/// whatever the world size), written by the lead, older ones pruned. The folder written (lead).
fn save_checkpoint(rk: &RankRun, step: usize, micro_index: u64) -> Result<Option<PathBuf>> {
    let r = &rk.loaded.recipe;
    let (comm, device, part) = (&*rk.comm, &rk.device, &rk.part);
    let st = &rk.opt.state;
    let moments = Moments {
        exp_avg: part.gather(comm, &st.exp_avg, device)?,
        exp_avg_sq: part.gather(comm, &st.exp_avg_sq, device)?,
        steps: part.gather(comm, &st.steps, device)?,
    };
    let saved = if rk.lead {
        let state = crate::checkpoint::TrainState {
            step,
            micro_index,
            micro_batches_per_step: r.train.grad_accum_steps * rk.world,
            loader: rk.loader.state(),
            pass_rows: Some(pass_rows(r, rk.fused, rk.resident)),
            model_fingerprint: Some(rk.model_fingerprint.clone()),
            data_fingerprint: Some(rk.data_fingerprint.clone()),
            template_fingerprint: rk.template_fingerprint.clone(),
            model_fingerprint_version: MODEL_FINGERPRINT_VERSION,
            peak_rss_mb: rk.run_peak_rss_mb(),
            kernels: Some(rk.kernels.clone()),
        };
        rk.log
            .sync()
            .and_then(|_| crate::checkpoint::save(&rk.out_dir, &rk.adapters, &moments, rk.opt.step, &state, &rk.recipe_text, rk.adapter_origin()))
            .and_then(|dir| crate::checkpoint::prune(&rk.out_dir, r.checkpoint.keep_last).map(|_| Some(dir)))
    } else {
        Ok(None)
    };
    let said = from_lead(comm, device, &[saved.is_ok() as u8 as f64])?;
    let dir = saved?;
    if said[0] == 0.0 {
        return Err(lead_failed(rk.rank, &format!("to write the step-{step} checkpoint")));
    }
    Ok(dir)
}

// ---------------------------------------------------------------- cleanup

/// Memory report, data notes, summary.json and (unless stopped early) the adapter folder.
fn cleanup(mut rk: RankRun, resumed: Resumed, trained: Trained) -> Result<RunSummary> {
    let r = &rk.loaded.recipe;
    let memory = MemoryUse::of(rk.rank, &rk.account);
    if rk.world > 1 || rk.sharded {
        crate::note!("{memory}");
    }
    if rk.lead {
        for line in rk.loader.stats.report(r.data.max_seq_len) {
            crate::note!("note: {line}");
        }
        rk.log.finish(&crate::runlog::RunSummaryFile {
            data: rk.loader.stats.clone(),
            peak_rss_mb: rk.run_peak_rss_mb(),
            memory: serde_json::to_value(&memory).ok(),
            world_size: rk.world,
            interrupted: trained.interrupted,
            cpu: crate::runlog::cpu_description(),
            kernels: rk.kernels_used.clone(),
        })?;
        if trained.interrupted.is_none() {
            save_adapter_dir(&rk.adapters, &rk.out_dir.join("adapter"), rk.adapter_origin())?;
            crate::note!("adapter written to {}", rk.out_dir.join("adapter").display());
            if let Some(c) = rk.adapters.spec.peft_caveat(&rk.model.cfg) {
                crate::note!("{c}");
            }
        }
    }
    Ok(RunSummary {
        steps: trained.history,
        output_dir: rk.out_dir,
        interrupted: trained.interrupted,
        checkpoint: trained.last_checkpoint,
        memory: vec![memory],
        lock: resumed.run_lock,
    })
}

/// Why the loss is not finite, naming what to change. Before any update of this run the
/// learning rate cannot be the cause: the adapters loaded (`lora.init_from`, a checkpoint)
/// or the base's forward pass are.
fn non_finite_loss(loaded: &LoadedRecipe, step: usize, first: bool, loss: f64, adapters: &Adapters) -> Error {
    let r = &loaded.recipe;
    if !first {
        return Error::Train(format!("step {step}: the loss became {loss} after earlier updates; stopping (train.lr = {:e} is likely too high)", r.train.lr));
    }
    for (key, v) in adapters.params() {
        let bad = v.as_tensor().flatten_all().and_then(|t| t.to_dtype(DType::F32)).and_then(|t| t.to_vec1::<f32>()).map(|x| x.iter().any(|x| !x.is_finite()));
        if bad.unwrap_or(false) {
            let from = match &r.lora.init_from {
                Some(p) => format!(" (loaded from lora.init_from = {})", p.display()),
                None => String::new(),
            };
            return Error::Train(format!("step {step}: the loss is {loss} before any update: LoRA tensor `{key}` holds NaN or inf{from}"));
        }
    }
    let dtype = if r.model.dtype == "f16" { ", or model.dtype = \"f16\" overflows (use \"bf16\")" } else { "" };
    Error::Train(format!(
        "step {step}: the loss is {loss} before any update (so the learning rate is not the cause): the base model's forward pass is not finite \
         (model.path {} holds NaN/inf weights{dtype})",
        r.model.path
    ))
}

/// Rank 0's `vals` on every rank (a collective; the identity with one rank). Used wherever
/// only the lead does something that can fail (writing metrics, checkpoints), so every rank
/// learns of it at the same point and none is left waiting in a collective the lead skipped.
fn from_lead(comm: &dyn Collective, device: &candle_core::Device, vals: &[f64]) -> Result<Vec<f64>> {
    if comm.world_size() == 1 {
        return Ok(vals.to_vec());
    }
    Ok(comm.broadcast(&Tensor::new(vals, device)?, 0)?.to_vec1()?)
}

fn lead_failed(rank: usize, what: &str) -> Error {
    Error::PeerFailed { rank, msg: format!("stopping: rank 0 failed {what}") }
}

/// All parameters flattened in order, as f32.
fn flatten(vars: &[Var]) -> Result<Vec<f32>> {
    let mut out = Vec::new();
    for v in vars {
        out.extend(v.as_tensor().flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
    }
    Ok(out)
}


/// How the frozen base is held (`frozen_source`).
struct FrozenPlacement {
    storage: DType,
    compute: DType,
    matmul: DType,
    device: candle_core::Device,
    account: Arc<Account>,
}

/// The frozen base of one rank: quantized blocks dequantised a layer at a time (a GGUF
/// `model.path`, a bitsandbytes checkpoint, or `model.quantize`), 1/N shards gathered a layer at a time (ZeRO-3), or
/// the whole base resident. The bool says whether it is quantized.
fn frozen_source(loaded: &LoadedRecipe, model_dir: &ModelDir, cfg: &ModelConfig, comm: Arc<dyn Collective>, f: FrozenPlacement) -> Result<(Arc<dyn WeightSource>, bool)> {
    let r = &loaded.recipe;
    let n = cfg.num_hidden_layers;
    let reader: Option<Box<dyn BlockReader>> = match (&model_dir.gguf, &r.model.quantize) {
        (Some(g), Some(_)) => {
            let msg = format!("{} is a GGUF file, quantized already; remove model.quantize (it quantizes safetensors bases)", g.display());
            return Err(Error::Recipe { file: loaded.file.display().to_string(), key: "model.quantize".into(), msg });
        }
        (Some(g), None) => Some(Box::new(crate::gguf::GgufReader::new(crate::gguf::open(g)?))),
        (None, Some(q)) => {
            if crate::weights::bnb::is_bnb(&model_dir.open_weights()?) {
                let msg = format!("{} is quantized by bitsandbytes already; remove model.quantize", model_dir.dir.display());
                return Err(Error::Recipe { file: loaded.file.display().to_string(), key: "model.quantize".into(), msg });
            }
            let target = crate::weights::quantized::parse_quantize(q).ok_or_else(|| Error::Recipe {
                file: loaded.file.display().to_string(),
                key: "model.quantize".into(),
                msg: format!("`{q}` is not a format this quantizes to"),
            })?;
            Some(Box::new(QuantizeOnLoad { files: model_dir.open_weights()?, target, storage: f.storage }))
        }
        (None, None) => {
            let files = model_dir.open_weights()?;
            crate::weights::bnb::is_bnb(&files).then(|| Box::new(crate::weights::bnb::BnbReader { files, storage: f.storage }) as Box<dyn BlockReader>)
        }
    };
    if let Some(reader) = reader {
        check_quantized_unsharded(loaded, comm.world_size())?;
        // No layers ahead: dequantising is not overlapped with compute, so a prefetched
        // layer would only cost memory.
        let q = QuantizedWeights::new(reader, n, 0, f.storage, f.compute, f.device, f.account);
        return Ok((Arc::new(q.with_matmul_dtype(f.matmul)), true));
    }
    let files = model_dir.open_weights()?;
    if r.dist.zero_stage == 3 {
        let s = ShardedWeights::new(files, comm, n, r.dist.prefetch_layers, f.storage, f.compute, f.device, f.account);
        return Ok((Arc::new(s.with_matmul_dtype(f.matmul)), false));
    }
    // An untied embedding and head stay in their file where the fused CPU ops run (the
    // portable path keeps them resident, as on a GPU, whose memory `finetune plan` figures it
    // stands for).
    let in_file = loaded.recipe.model.kernels().fused_on(&f.device);
    let src = ResidentWeights::new(files, f.storage, f.compute, f.device).with_matmul_dtype(f.matmul);
    Ok((Arc::new(src.with_row_tables(in_file).with_head_in_file(in_file)), false))
}

/// A quantized base is held whole by every rank: ZeRO-3 over `world` > 1 ranks is refused
/// (by `train`, and by `plan` for the world sizes it is asked about).
pub fn check_quantized_unsharded(loaded: &LoadedRecipe, world: usize) -> Result<()> {
    if loaded.recipe.dist.zero_stage == 3 && world > 1 {
        let msg = format!("a quantized base is not sharded: with {world} ranks every rank holds the whole quantized base (set dist.zero_stage = 0)");
        return Err(Error::Recipe { file: loaded.file.display().to_string(), key: "dist.zero_stage".into(), msg });
    }
    Ok(())
}

/// The recipe as checkpoints and `recipe.resolved.toml` record it: `lora.targets` resolved
/// for the model (unset means its attention projections), so a recipe that leaves them unset
/// compares equal to one that lists them, and to checkpoints written when the default was
/// written out.
///
/// A base from the hub is recorded at the commit it resolved to, so a resume after the
/// branch moved is refused (different base weights) instead of silently continuing.
///
/// A hub dataset is recorded the same way, as `org/name@commit[:split]`.
fn recorded_recipe(loaded: &LoadedRecipe, cfg: &ModelConfig, model_dir: &ModelDir) -> Result<String> {
    let mut r = loaded.recipe.clone();
    r.lora.targets = Some(r.lora.spec(cfg).targets);
    if let Some(c) = &model_dir.commit {
        r.model.revision = Some(c.clone());
    }
    r.data.train = pinned_data(loaded, &r.data.train, Role::Train)?;
    if let Some(e) = &r.data.eval {
        r.data.eval = Some(pinned_data(loaded, e, Role::Eval)?);
    }
    toml::to_string(&r).map_err(|e| Error::Train(e.to_string()))
}

/// `paths` with each hub dataset entry (`org/name[@revision][:split]`) at the commit its files
/// were read from (the cache's snapshot folder), as `org/name@commit[:split]`; local paths as
/// they are. Resolving again reads the cache the loader just filled: no request.
fn pinned_data(loaded: &LoadedRecipe, paths: &crate::recipe::Paths, role: Role) -> Result<crate::recipe::Paths> {
    let split = data_sources(&loaded.recipe.data, role).1;
    let pin = |p: &PathBuf| -> Result<PathBuf> {
        let Some(files) = hub_dataset(loaded, p, split)? else { return Ok(p.clone()) };
        let commit = files.first().and_then(|f| crate::hub::snapshot_commit(f));
        let Some(commit) = commit else { return Ok(p.clone()) };
        Ok(PathBuf::from(crate::hub::DataEntry::parse(&p.to_string_lossy()).at(Some(&commit))))
    };
    Ok(match paths {
        crate::recipe::Paths::One(p) => crate::recipe::Paths::One(pin(p)?),
        crate::recipe::Paths::Many(v) => crate::recipe::Paths::Many(v.iter().map(pin).collect::<Result<_>>()?),
    })
}

/// Write the adapter into `<dir>.tmp` and swap it in, so `dir` is always a complete adapter
/// (with the chat template it carries, which `generate`, `eval` and `export` read there
/// before the base's).
pub fn save_adapter_dir(adapters: &Adapters, dir: &std::path::Path, origin: crate::checkpoint::AdapterOrigin) -> Result<()> {
    let name = dir.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let tmp = dir.with_file_name(format!(".{name}.tmp"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    origin.save(adapters, &tmp)?;
    crate::fsutil::replace_dir_durable(&tmp, dir)
}

/// Forward and backward of one micro-batch. Adds d(scale * CE_sum)/dparam into `grads` (f64)
/// and returns the micro-batch's CE sum.
#[allow(clippy::too_many_arguments)]
pub fn forward_backward(
    model: &Model,
    adapters: &Adapters,
    vars: &[Var],
    mb: &MicroBatch,
    scale: f64,
    dropout: Option<DropoutCtx>,
    checkpointing: Option<&[KeepLayer]>,
    grads: &mut [Option<Tensor>],
) -> Result<f64> {
    let device = model.device();
    let (b, s) = (mb.rows, mb.seq);
    let mut ctx = model.forward_ctx(&mb.positions, mb.segments.as_deref(), dropout)?;
    let ids = Tensor::from_slice(&mb.input_ids, (b, s), &device)?;
    let h = model.cfg.hidden_size;
    // The hidden states stay [N, H] through every layer (no reshape nodes in the graph).
    let x0 = model.embed(&ids)?.reshape((b * s, h))?; // [N, H]

    // Rows of the flattened [N, H] hidden states that have a target, and those targets.
    let (idx, tgt): (Vec<u32>, Vec<u32>) =
        mb.targets.iter().enumerate().filter(|(_, &t)| t != IGNORE).map(|(i, &t)| (i as u32, t as u32)).unzip();
    let idx = Tensor::from_vec(idx, tgt.len(), &device)?;

    // Loss through final norm + head for hidden states `x`; returns (CE sum, the scalar whose
    // backward gives the gradient of scale * CE sum).
    let head_loss = |x: &Tensor| -> Result<(f64, Tensor)> {
        let rows = model.final_norm(x)?.index_select(&idx, 0)?; // [N, H] -> [M, H]
        // Read just in time, in chunks: under ZeRO-3 the head is gathered only while it is
        // used, and a quantized head is dequantised a chunk at a time.
        let (ce, g_rows) = crate::ops::loss::cross_entropy_sum_and_grad(model.kernels(), &rows, &model.lm_head_rows(), &tgt, scale).ctx("cross-entropy")?;
        Ok((ce, crate::ops::pullback(&rows, &g_rows.detach())?))
    };
    // Accumulated in f64: a sum of a few f32 gradients is then exact in practice, so it does
    // not depend on how a step's micro-batches are split over ranks (in f32 it would, through
    // rounding, and AdamW turns that into visible differences for tiny gradients).
    let mut add = |store: &candle_core::backprop::GradStore| -> Result<()> {
        for (slot, v) in grads.iter_mut().zip(vars) {
            if let Some(g) = store.get(v) {
                let g = g.to_dtype(DType::F64)?;
                *slot = Some(match slot.take() {
                    Some(acc) => (acc + g)?,
                    None => g,
                });
            }
        }
        Ok(())
    };

    let Some(keep) = checkpointing else {
        let mut x = x0;
        for i in 0..model.cfg.num_hidden_layers {
            x = model.layer_forward(i, &x, &ctx, adapters)?;
        }
        let (ce, surrogate) = head_loss(&x)?;
        add(&surrogate.backward().ctx("backward")?)?;
        return Ok(ce);
    };

    // Activation checkpointing: keep each layer's input (and what `keep` names for each layer,
    // `ops::checkpoint`); in backward, recompute one layer at a time on its saved
    // input and backpropagate the upstream gradient through it. The last layers that `keep`
    // marks whole are not checkpointed: they run as an ordinary forward whose graph the
    // head's backward goes through.
    let n_layers = model.cfg.num_hidden_layers;
    let whole_from = keep.iter().rposition(|k| !k.whole).map_or(0, |i| i + 1);
    ctx.pass = Pass::Checkpointed;
    ctx.kept = keep.iter().any(|k| k.in_slot()).then(|| Kept::new(keep));
    let mut inputs = Vec::with_capacity(whole_from + 1);
    inputs.push(x0);
    for i in 0..whole_from {
        let y = model.layer_forward(i, &inputs[i], &ctx, adapters)?.detach();
        inputs.push(y);
    }
    // The whole layers on a leaf the gradient is read at (layer 0's input, the frozen
    // embedding, needs none).
    let top = if whole_from > 0 { Some(Var::from_tensor(&inputs[whole_from])?) } else { None };
    let mut x = top.as_ref().map_or(&inputs[whole_from], |v| v.as_tensor()).clone();
    ctx.pass = Pass::Plain;
    for i in whole_from..n_layers {
        x = model.layer_forward(i, &x, &ctx, adapters)?;
    }
    // From here on a layer's output value is a placeholder: only its backward is used.
    ctx.pass = Pass::Recompute;
    let (ce, surrogate) = head_loss(&x)?;
    drop(x);
    let store = surrogate.backward().ctx("backward (head)")?;
    drop(surrogate); // its graph (the final norm's input and output) is not read again
    add(&store)?; // the whole layers' adapters
    let Some(top) = top else { return Ok(ce) };
    let mut g_out = store.get(&top).cloned().ok_or_else(|| Error::Train("no gradient reached the last checkpointed hidden state".into()))?;
    drop(store);
    for i in (0..whole_from).rev() {
        // Layer 0's input (the frozen embedding) needs no gradient: keep it a plain tensor.
        let input = if i > 0 { Some(Var::from_tensor(&inputs[i])?) } else { None };
        let x_in = input.as_ref().map_or(&inputs[i], |v| v.as_tensor());
        let y = model.layer_forward(i, x_in, &ctx, adapters)?;
        let store = crate::ops::pullback(&y, &g_out)?.backward().ctx("backward (layer)")?;
        add(&store)?;
        if let Some(v) = &input {
            g_out = store.get(v).cloned().ok_or_else(|| Error::Train(format!("no gradient reached layer {i}'s input")))?;
        }
        inputs.pop();
    }
    Ok(ce)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// SmolLM2-135M's shape (the bench's model).
    fn smollm2() -> ModelConfig {
        let hf = serde_json::from_value(crate::synth::config_json(&crate::synth::TinyShape::smollm2_135m())).unwrap();
        ModelConfig::resolve(&hf).unwrap()
    }

    /// A SmolLM2 recipe with LoRA on q/k/v/o and `auto` checkpointing, plus `--set` overrides.
    fn recipe(dtype: &str, batch: usize, seq: usize, sets: &[&str]) -> crate::recipe::Recipe {
        let text = format!(
            "[model]\npath = \"m\"\ndtype = \"{dtype}\"\n[lora]\nrank = 16\nalpha = 32\ntargets = [\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\"]\n\
             [data]\ntrain = \"d\"\nmax_seq_len = {seq}\n[train]\nmax_steps = 1\nlr = 1e-4\nmicro_batch_size = {batch}\nactivation_checkpointing = \"auto\"\n[output]\ndir = \"o\"\n"
        );
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        crate::recipe::LoadedRecipe::from_str(&text, Path::new("r.toml"), Path::new("."), &sets).unwrap().recipe
    }

    /// What `auto` keeps by default for SmolLM2 with LoRA on q/k/v/o, on the fused CPU ops.
    fn kept(dtype: &str, batch: usize, seq: usize) -> Vec<KeepLayer> {
        checkpoint_layers(&recipe(dtype, batch, seq, &[]), &smollm2(), true, true).unwrap()
    }

    #[test]
    fn an_epoch_in_steps_is_the_records_over_the_rows_a_step_takes() {
        let r = recipe("f32", 4, 512, &["train.grad_accum_steps=2", "train.max_steps=250"]);
        // 1000 records, 4 x 2 x 2 ranks = 16 rows a step: 62.5 steps an epoch, 250 steps 4 epochs.
        let said = describe_epoch(&r, 1000, 2);
        assert!(said.contains("1,000 records") && said.contains("an epoch is 62.5 steps, so the run reads 4.00 epochs"), "{said}");
        let packed = describe_epoch(&recipe("f32", 4, 512, &["train.grad_accum_steps=2", "train.max_steps=250", "data.packing=true"]), 1000, 2);
        assert!(packed.contains("at most 62.5 steps") && packed.contains("at least 4.00 epochs"), "{packed}");
        let tokens = describe_epoch(&recipe("f32", 4, 512, &["data.batch_by=\"tokens\"", "data.max_tokens=4096"]), 1000, 1);
        assert!(tokens.contains("1 token batch of at most 4096 tokens") && !tokens.contains("epoch"), "{tokens}");
        assert!(!describe_epoch(&r, 0, 1).contains("epoch"), "no epochs of nothing");
    }

    #[test]
    fn micro_batches_of_more_than_2048_tokens_run_in_passes_of_2048_where_auto_keeps_its_default_budget() {
        let r = recipe("bf16", 8, 512, &[]);
        assert_eq!((pass_tokens(&r, true, true), pass_shape(&r, true, true)), (Some(2048), (4, 512)));
        // Each pass keeps what a micro-batch of 4 x 512 would.
        assert_eq!(kept("bf16", 8, 512), kept("bf16", 4, 512));
        // A single row cannot be split; 2048 tokens need no split.
        assert_eq!(pass_shape(&recipe("bf16", 2, 4096, &[]), true, true), (1, 4096));
        assert_eq!(pass_tokens(&recipe("bf16", 4, 512, &[]), true, true), None);
        // Not where the recipe sets the budget (for the whole micro-batch), not with
        // checkpointing on or off, not off the fused ops or with the base not resident, not
        // with token batching, not with dropout on routed-expert adapters.
        for sets in [&["train.activation_memory_mb=900"][..], &["train.activation_checkpointing=true"], &["train.activation_checkpointing=false"], &["data.batch_by=\"tokens\"", "data.max_tokens=4096"], &["lora.routed_experts=true", "lora.dropout=0.1"]] {
            let r = recipe("bf16", 8, 512, sets);
            assert_eq!(pass_tokens(&r, true, true), None, "{sets:?}");
        }
        assert_eq!((pass_tokens(&r, false, true), pass_tokens(&r, true, false)), (None, None));
        // Routed-expert adapters without dropout: passes as usual.
        assert_eq!(pass_tokens(&recipe("bf16", 8, 512, &["lora.routed_experts=true"]), true, true), Some(2048));
    }

    #[test]
    fn the_kernels_a_checkpoint_records_name_the_kind_of_device_not_candle_s_device_counter() {
        // candle's Debug of a CUDA device prints a process-wide counter, which would differ on
        // every resume; the portable path on the CPU shows the form.
        let said = describe_kernels(false, crate::ops::Kernels::Portable, &candle_core::Device::Cpu, (DType::F32, DType::F32), 64);
        assert_eq!(said, "Portable ops on CPU, activations in F32");
    }

    #[test]
    fn a_bf16_base_keeps_every_layers_attention_output_and_swiglu_inputs_up_to_2048_tokens_and_some_projection_outputs_beyond_1024() {
        // Up to 1024 tokens no projection outputs; at 2048 those of the last two fifths of
        // the layers.
        let every = KeepLayer { attention: true, swiglu: true, ..KeepLayer::default() };
        for (b, s) in [(1, 512), (2, 512), (1, 1024)] {
            assert_eq!(kept("bf16", b, s), vec![every; 30], "{b} x {s}");
        }
        let mut with_projections = vec![every; 30];
        with_projections[18..].iter_mut().for_each(|k| k.linears = true);
        for (b, s) in [(4, 512), (1, 2048)] {
            assert_eq!(kept("bf16", b, s), with_projections, "{b} x {s}");
        }
        // At 4096 tokens the floor, four times the layer inputs (as an f32 base's), is larger
        // than every layer's cost at 2048 tokens.
        let long = kept("bf16", 1, 4096);
        assert_eq!(long, kept("f32", 1, 4096));
        assert!(long.iter().all(|k| k.attention) && long.iter().filter(|k| k.swiglu).count() < 30);
        // An f32 base's weights take twice the memory: at 1 x 512 it keeps less.
        assert!(kept("f32", 1, 512).iter().filter(|k| k.swiglu).count() < 30);
    }
}
