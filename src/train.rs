//! The training loop, as one visible function: setup, train, cleanup. No trainer framework.
//!
//! Data flow of one optimizer step (see ARCHITECTURE.md):
//!   rows -> micro-batches (padded) -> count the step's targets
//!   per micro-batch: embed -> layers (LoRA) -> final norm -> target rows -> chunked CE
//!                    -> dLoss/dhidden -> backward through the layers (recomputed per layer
//!                    when activation checkpointing is on) -> LoRA grads accumulated
//!   grads -> global norm, clip -> AdamW (host f32) -> write back to the Vars -> metrics line

use crate::config::ModelConfig;
use crate::data::{Formatter, Loader, LoaderOptions, MicroBatch, Role, IGNORE};
use crate::error::{CandleContext, Error, Result};
use crate::lora::{Adapters, DropoutCtx, LoraSpec, MODULES};
use crate::model::llama::{ForwardCtx, Llama};
use crate::optim::{clip_grad_norm, AdamW, Schedule};
use crate::recipe::LoadedRecipe;
use crate::weights::{parse_dtype, ModelDir, ResidentWeights, SafetensorsFiles};
use candle_core::{DType, Tensor, Var};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// What PEFT's `print_trainable_parameters` reports, from the config alone.
pub fn trainable_parameters(cfg: &ModelConfig, rank: usize, targets: &[String]) -> (u64, u64) {
    let per_layer: u64 = MODULES
        .iter()
        .filter(|m| targets.iter().any(|t| t == *m))
        .map(|m| {
            let (i, o) = cfg.proj_shape(m);
            (rank * (i + o)) as u64
        })
        .sum();
    let trainable = per_layer * cfg.num_hidden_layers as u64;
    (trainable, trainable + cfg.base_param_count())
}

pub fn format_trainable(trainable: u64, all: u64) -> String {
    let pct = 100.0 * trainable as f64 / all as f64;
    format!("trainable params: {} || all params: {} || trainable%: {pct:.4}", commas(trainable), commas(all))
}

fn commas(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
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
    /// Token-normalised loss on the evaluation set after this step's update, when evaluated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
}

pub struct RunSummary {
    /// Metrics of the steps run in this invocation.
    pub steps: Vec<StepMetrics>,
    pub output_dir: PathBuf,
    /// Set when a stop was requested (SIGINT = 2, SIGTERM = 15): the run saved a checkpoint
    /// after the current step and returned early.
    pub interrupted: Option<usize>,
    /// The last checkpoint written or resumed from.
    pub checkpoint: Option<PathBuf>,
}

/// How the caller talks to a running training loop.
#[derive(Clone, Default)]
pub struct RunOptions {
    /// Non-zero: finish the current optimizer step, checkpoint, and return (the value is the
    /// signal number that asked for it).
    pub stop: Option<Arc<AtomicUsize>>,
}

/// Train as the recipe says (see [`run_with`]).
pub fn run(loaded: &LoadedRecipe) -> Result<RunSummary> {
    run_with(loaded, &RunOptions::default())
}

/// Train as the recipe says. Everything that can be wrong with the input (model, adapter,
/// data) is checked before the output folder is touched. With `checkpoint.resume = "auto"`
/// the newest valid checkpoint in the output folder is continued exactly.
pub fn run_with(loaded: &LoadedRecipe, run_opts: &RunOptions) -> Result<RunSummary> {
    // ---------------------------------------------------------------- setup
    let r = &loaded.recipe;
    let t = &r.train;
    let device_err = |msg: String| Error::Recipe { file: loaded.file.display().to_string(), key: "model.device".into(), msg };
    let spec = crate::device::parse_device(&r.model.device).map_err(device_err)?;
    let device = crate::device::open(spec).map_err(device_err)?;
    let model_dir = ModelDir::resolve(&r.model.path, &loaded.dir)?;
    let cfg = ModelConfig::from_file(&model_dir.config_path())?;
    let files = SafetensorsFiles::open(&model_dir.weight_files()?)?;
    let storage_dtype = parse_dtype(&r.model.dtype);
    // CPUs have no fast half-precision matmul (candle converts to f32 anyway), so compute in
    // f32 there and keep bf16/f16 only as the storage format of the frozen base.
    let compute_dtype = if device.is_cpu() { DType::F32 } else { storage_dtype };
    let src = Arc::new(ResidentWeights::new(files, storage_dtype, compute_dtype, device.clone()));
    let mut targets: Vec<String> = MODULES.iter().filter(|m| r.lora.targets.iter().any(|t| t == *m)).map(|s| s.to_string()).collect();
    targets.dedup();
    let lora_spec = LoraSpec { rank: r.lora.rank, alpha: r.lora.alpha, dropout: r.lora.dropout, targets };
    let adapters = Adapters::init(&cfg, lora_spec, t.seed, &device)?;
    if let Some(init) = &r.lora.init_from {
        adapters.load_peft(&loaded.resolve(init))?;
    }
    let model = Llama::load(src, cfg, &adapters)?;
    let mut loader = open_loader(loaded, &model_dir, model.cfg.vocab_size, Role::Train)?;
    // Evaluation examples are read once (eval sets are small) and reused at every eval.
    let eval_set = if r.data.eval.is_some() || r.data.eval_fraction > 0.0 {
        let mut l = open_loader(loaded, &model_dir, model.cfg.vocab_size, Role::Eval)?;
        let ex = l.one_pass()?;
        if ex.is_empty() {
            return Err(Error::Recipe { file: loaded.file.display().to_string(), key: "data.eval".into(), msg: "the evaluation set has no usable records".into() });
        }
        Some(ex)
    } else {
        None
    };
    let (trainable, all) = trainable_parameters(&model.cfg, r.lora.rank, &adapters.spec.targets);
    eprintln!("{}", format_trainable(trainable, all));

    let vars: Vec<Var> = adapters.params().into_iter().map(|(_, v)| v.clone()).collect();
    let sizes: Vec<usize> = vars.iter().map(|v| v.elem_count()).collect();
    let mut opt = AdamW::new(&sizes, (t.adam_betas[0], t.adam_betas[1]), t.adam_eps, t.weight_decay);
    let schedule = Schedule::parse(&t.lr_scheduler);

    // The output folder is created only once the first step has run, so input that fails on
    // its first rows (bad data, a model that does not fit) leaves nothing behind.
    let out_dir = loaded.resolve(&r.output.dir);
    let metrics_path = out_dir.join("metrics.jsonl");
    let mut metrics: Option<std::fs::File> = None;
    let recipe_text = toml::to_string(r).map_err(|e| Error::Train(e.to_string()))?;

    // ---------------------------------------------------------------- resume
    let mut start_step = 0;
    let mut micro_index = 0u64;
    let mut last_checkpoint = None;
    let resume_from = match r.checkpoint.resume.as_str() {
        "never" => None,
        "auto" => {
            crate::checkpoint::clean_temporaries(&out_dir);
            crate::checkpoint::latest_valid(&out_dir)
        }
        path => Some(loaded.resolve(std::path::Path::new(path))),
    };
    if let Some(dir) = resume_from {
        // Recipe rules first: a changed LoRA shape should be reported as the key that changed,
        // not as a tensor that no longer fits.
        let saved = std::fs::read_to_string(dir.join("recipe.toml")).map_err(|e| Error::io(dir.join("recipe.toml"), e))?;
        let warnings = crate::checkpoint::check_recipe_change(&saved, &recipe_text)
            .map_err(|msg| Error::Recipe { file: loaded.file.display().to_string(), key: "(resume)".into(), msg: format!("{msg} [checkpoint {}]", dir.display()) })?;
        for w in warnings {
            eprintln!("warning: {w}");
        }
        let l = crate::checkpoint::load(&dir, &adapters, &mut opt)?;
        loader.restore(&l.state.loader)?;
        start_step = l.state.step;
        micro_index = l.state.micro_index;
        metrics = Some(reopen_metrics(&metrics_path, start_step)?);
        eprintln!("resuming from {} (step {start_step})", dir.display());
        last_checkpoint = Some(dir);
    }
    let progress = crate::progress::Progress::new(t.max_steps as u64, t.log_every);
    let stop_requested = || run_opts.stop.as_ref().map_or(0, |s| s.load(Ordering::SeqCst));

    // ---------------------------------------------------------------- train
    let mut history = Vec::with_capacity(t.max_steps);
    let mut interrupted = None;
    for step in start_step + 1..=t.max_steps {
        let started = Instant::now();
        let mut batches = Vec::with_capacity(t.grad_accum_steps);
        for _ in 0..t.grad_accum_steps {
            let rows = if r.data.batch_by == "tokens" {
                loader.next_token_batch(r.data.max_tokens)?
            } else {
                (0..t.micro_batch_size).map(|_| loader.next_row()).collect::<Result<Vec<_>>>()?
            };
            batches.push(MicroBatch::collate(&rows));
        }
        // Token-normalised across accumulation: the divisor is the whole step's target count.
        let count: usize = batches.iter().map(|b| b.num_targets()).sum();
        if count == 0 {
            return Err(Error::Train(format!(
                "step {step}: no target tokens (every label is -100 after truncation to data.max_seq_len = {})",
                r.data.max_seq_len
            )));
        }
        let mut grads: Vec<Option<Tensor>> = vec![None; vars.len()];
        let mut loss_sum = 0.0;
        let mut real_tokens = 0;
        for mb in &batches {
            let drop = (r.lora.dropout > 0.0).then_some(DropoutCtx { seed: t.seed, micro_batch: micro_index });
            micro_index += 1;
            loss_sum += forward_backward(&model, &adapters, &vars, mb, 1.0 / count as f64, drop, t.activation_checkpointing, &mut grads)?;
            real_tokens += mb.real_tokens;
        }
        let loss = loss_sum / count as f64;
        if !loss.is_finite() {
            return Err(Error::Train(format!("step {step}: loss is {loss}; stopping (try a lower train.lr)")));
        }
        let mut g: Vec<Vec<f32>> = Vec::with_capacity(vars.len());
        for (gi, v) in grads.iter().zip(&vars) {
            g.push(match gi {
                Some(t) => t.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?,
                None => vec![0.0; v.elem_count()],
            });
        }
        let grad_norm = clip_grad_norm(&mut g, t.max_grad_norm);
        let lr = t.lr * schedule.lambda(step - 1, t.warmup_steps, t.max_steps);
        let mut p: Vec<Vec<f32>> = Vec::with_capacity(vars.len());
        for v in &vars {
            p.push(v.as_tensor().flatten_all()?.to_dtype(DType::F32)?.to_vec1()?);
        }
        opt.step(&mut p, &g, lr);
        if p.iter().flatten().any(|x| !x.is_finite()) {
            return Err(Error::Train(format!("step {step}: the update made LoRA weights non-finite; stopping before saving them (try a lower train.lr)")));
        }
        for (v, new) in vars.iter().zip(p) {
            v.set(&Tensor::from_vec(new, v.shape(), &device)?.to_dtype(v.dtype())?)?;
        }
        let secs = started.elapsed().as_secs_f64();
        let eval_loss = match &eval_set {
            Some(ex) if (t.eval_every > 0 && step % t.eval_every == 0) || step == t.max_steps => {
                Some(evaluate(&model, &adapters, ex, t.micro_batch_size)?)
            }
            _ => None,
        };
        let m = StepMetrics { step, loss, lr, grad_norm, tokens: count, tokens_per_s: real_tokens as f64 / secs.max(1e-9), eval_loss };
        let line = serde_json::to_string(&m).map_err(|e| Error::Train(e.to_string()))?;
        let file = match metrics.as_mut() {
            Some(f) => f,
            None => metrics.insert(create_output(&out_dir, r)?),
        };
        writeln!(file, "{line}").and_then(|_| file.flush()).map_err(|e| Error::io(&metrics_path, e))?;
        progress.step(&m, t.max_steps);
        history.push(m);

        // Checkpoints only at optimizer-step boundaries: mid-accumulation gradients are never
        // saved, so a resume is always at a clean step.
        let stop = stop_requested();
        let every = r.checkpoint.every_steps;
        if (every > 0 && step % every == 0) || step == t.max_steps || stop != 0 {
            let state = crate::checkpoint::TrainState { step, micro_index, loader: loader.state() };
            let dir = crate::checkpoint::save(&out_dir, &adapters, &opt, &state, &recipe_text, &model_dir.name)?;
            crate::checkpoint::prune(&out_dir, r.checkpoint.keep_last)?;
            last_checkpoint = Some(dir);
        }
        if stop != 0 {
            interrupted = Some(stop);
            break;
        }
    }
    if interrupted.is_none() && start_step >= t.max_steps {
        eprintln!("already complete: the checkpoint is at step {start_step} of train.max_steps = {}", t.max_steps);
    }

    // ---------------------------------------------------------------- cleanup
    progress.finish();
    for line in loader.stats.report(r.data.max_seq_len) {
        eprintln!("note: {line}");
    }
    if let Some(f) = &metrics {
        f.sync_all().map_err(|e| Error::io(&metrics_path, e))?;
    }
    if interrupted.is_none() {
        save_adapter_dir(&adapters, &out_dir.join("adapter"), &model_dir.name)?;
        eprintln!("adapter written to {}", out_dir.join("adapter").display());
    }
    Ok(RunSummary { steps: history, output_dir: out_dir, interrupted, checkpoint: last_checkpoint })
}

/// Keep the metrics lines of steps up to `step` (what the checkpoint covers) and reopen the
/// file for appending, so a resumed run's metrics.jsonl reads as one uninterrupted run.
fn reopen_metrics(path: &std::path::Path, step: usize) -> Result<std::fs::File> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let kept: String = text
        .lines()
        .filter(|l| serde_json::from_str::<StepMetrics>(l).is_ok_and(|m| m.step <= step))
        .map(|l| format!("{l}\n"))
        .collect();
    crate::fsutil::write_atomic(path, kept.as_bytes())?;
    std::fs::OpenOptions::new().append(true).open(path).map_err(|e| Error::io(path, e))
}

/// The example stream a recipe describes (training side or held-out/eval side).
pub fn open_loader(loaded: &LoadedRecipe, model_dir: &ModelDir, vocab: usize, role: Role) -> Result<Loader> {
    let r = &loaded.recipe;
    let d = &r.data;
    let fmt = Formatter::new(&d.format, d.template.as_deref(), &d.columns, d.train_on_prompt, &model_dir.dir, vocab)?;
    let opts = LoaderOptions {
        max_seq_len: d.max_seq_len,
        shuffle: d.shuffle && role == Role::Train,
        shuffle_buffer: d.shuffle_buffer,
        seed: r.train.seed,
        packing: d.packing && role == Role::Train,
        overflow: d.overflow.clone(),
        on_bad_record: d.on_bad_record.clone(),
        eval_fraction: d.eval_fraction,
        role,
    };
    let specs: Vec<PathBuf> = match (&d.eval, role) {
        (Some(e), Role::Eval) => e.list(),
        _ => d.train.list(),
    };
    let specs: Vec<PathBuf> = specs.iter().map(|p| resolve_spec(loaded, p)).collect();
    Loader::open(&specs, d.split.as_deref(), fmt, opts)
}

/// Resolve a data path against the recipe folder, keeping a `:split` suffix.
fn resolve_spec(loaded: &LoadedRecipe, p: &std::path::Path) -> PathBuf {
    let s = p.to_string_lossy();
    match s.rsplit_once(':') {
        Some((dir, split)) if !dir.is_empty() && !split.contains('/') && !std::path::Path::new(&*s).exists() => {
            PathBuf::from(format!("{}:{split}", loaded.resolve(std::path::Path::new(dir)).display()))
        }
        _ => loaded.resolve(p),
    }
}

/// Token-normalised loss over `examples` (no gradients kept).
pub fn evaluate(model: &Llama, adapters: &Adapters, examples: &[crate::data::Example], batch: usize) -> Result<f64> {
    let (mut sum, mut count) = (0.0, 0usize);
    for chunk in examples.chunks(batch.max(1)) {
        let mb = MicroBatch::collate(chunk);
        let device = model.embed_tokens()?.device().clone();
        let ctx = ForwardCtx::new(&mb.positions, mb.segments.as_deref(), model.inv_freq(), None, &device)?;
        let ids = Tensor::from_slice(&mb.input_ids, (mb.rows, mb.seq), &device)?;
        let mut x = model.embed(&ids)?;
        for i in 0..model.cfg.num_hidden_layers {
            x = model.layer_forward(i, &x, &ctx, adapters)?.detach();
        }
        let (idx, tgt): (Vec<u32>, Vec<u32>) =
            mb.targets.iter().enumerate().filter(|(_, &t)| t != IGNORE).map(|(i, &t)| (i as u32, t as u32)).unzip();
        if tgt.is_empty() {
            continue;
        }
        let h = model.cfg.hidden_size;
        let rows = model.final_norm(&x)?.reshape((mb.rows * mb.seq, h))?.index_select(&Tensor::from_vec(idx, tgt.len(), &device)?, 0)?;
        let (ce, _) = crate::loss::cross_entropy_sum_and_grad(&rows, &model.lm_head()?, &tgt, 0.0).ctx("eval cross-entropy")?;
        sum += ce;
        count += tgt.len();
    }
    Ok(sum / count.max(1) as f64)
}

/// Create the output folder with the resolved recipe, and a fresh metrics.jsonl.
fn create_output(out_dir: &std::path::Path, r: &crate::recipe::Recipe) -> Result<std::fs::File> {
    std::fs::create_dir_all(out_dir).map_err(|e| Error::io(out_dir, e))?;
    let resolved = toml::to_string(r).map_err(|e| Error::Train(e.to_string()))?;
    crate::fsutil::write_atomic(&out_dir.join("recipe.resolved.toml"), resolved.as_bytes())?;
    let path = out_dir.join("metrics.jsonl");
    std::fs::File::create(&path).map_err(|e| Error::io(&path, e))
}

/// Write the adapter into `<dir>.tmp` and swap it in, so `dir` is always a complete adapter.
pub fn save_adapter_dir(adapters: &Adapters, dir: &std::path::Path, base: &str) -> Result<()> {
    let name = dir.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let tmp = dir.with_file_name(format!(".{name}.tmp"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    adapters.save_peft(&tmp, base)?;
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    crate::fsutil::rename_durable(&tmp, dir)
}

/// Forward and backward of one micro-batch. Adds d(scale * CE_sum)/dparam into `grads` and
/// returns the micro-batch's CE sum.
#[allow(clippy::too_many_arguments)]
pub fn forward_backward(
    model: &Llama,
    adapters: &Adapters,
    vars: &[Var],
    mb: &MicroBatch,
    scale: f64,
    dropout: Option<DropoutCtx>,
    checkpointing: bool,
    grads: &mut [Option<Tensor>],
) -> Result<f64> {
    let device = model.embed_tokens()?.device().clone();
    let (b, s) = (mb.rows, mb.seq);
    let ctx = ForwardCtx::new(&mb.positions, mb.segments.as_deref(), model.inv_freq(), dropout, &device)?;
    let ids = Tensor::from_slice(&mb.input_ids, (b, s), &device)?;
    let x0 = model.embed(&ids)?; // [B, S, H]

    // Rows of the flattened [N, H] hidden states that have a target, and those targets.
    let (idx, tgt): (Vec<u32>, Vec<u32>) =
        mb.targets.iter().enumerate().filter(|(_, &t)| t != IGNORE).map(|(i, &t)| (i as u32, t as u32)).unzip();
    let idx = Tensor::from_vec(idx, tgt.len(), &device)?;
    let head = model.lm_head()?;
    let h = model.cfg.hidden_size;

    // Loss through final norm + head for hidden states `x`; returns (CE sum, the scalar whose
    // backward gives the gradient of scale * CE sum).
    let head_loss = |x: &Tensor| -> Result<(f64, Tensor)> {
        let rows = model.final_norm(x)?.reshape((b * s, h))?.index_select(&idx, 0)?; // [M, H]
        let (ce, g_rows) = crate::loss::cross_entropy_sum_and_grad(&rows, &head, &tgt, scale).ctx("cross-entropy")?;
        Ok((ce, (rows * g_rows.detach())?.sum_all()?))
    };
    let mut add = |store: &candle_core::backprop::GradStore| -> Result<()> {
        for (slot, v) in grads.iter_mut().zip(vars) {
            if let Some(g) = store.get(v) {
                *slot = Some(match slot.take() {
                    Some(acc) => (acc + g)?,
                    None => g.clone(),
                });
            }
        }
        Ok(())
    };

    if !checkpointing {
        let mut x = x0;
        for i in 0..model.cfg.num_hidden_layers {
            x = model.layer_forward(i, &x, &ctx, adapters)?;
        }
        let (ce, surrogate) = head_loss(&x)?;
        add(&surrogate.backward().ctx("backward")?)?;
        return Ok(ce);
    }

    // Activation checkpointing: keep each layer's input only; in backward, recompute one layer
    // at a time on its saved input and backpropagate the upstream gradient through it.
    let n_layers = model.cfg.num_hidden_layers;
    let mut inputs = Vec::with_capacity(n_layers + 1);
    inputs.push(x0);
    for i in 0..n_layers {
        let y = model.layer_forward(i, &inputs[i], &ctx, adapters)?.detach();
        inputs.push(y);
    }
    let last = Var::from_tensor(&inputs[n_layers])?;
    let (ce, surrogate) = head_loss(last.as_tensor())?;
    let store = surrogate.backward().ctx("backward (head)")?;
    let mut g_out = store.get(&last).cloned().ok_or_else(|| Error::Train("no gradient reached the last hidden state".into()))?;
    drop(store);
    for i in (0..n_layers).rev() {
        // Layer 0's input (the frozen embedding) needs no gradient: keep it a plain tensor.
        let input = if i > 0 { Some(Var::from_tensor(&inputs[i])?) } else { None };
        let x_in = input.as_ref().map_or(&inputs[i], |v| v.as_tensor());
        let y = model.layer_forward(i, x_in, &ctx, adapters)?;
        let store = (y * &g_out)?.sum_all()?.backward().ctx("backward (layer)")?;
        add(&store)?;
        if let Some(v) = &input {
            g_out = store.get(v).cloned().ok_or_else(|| Error::Train(format!("no gradient reached layer {i}'s input")))?;
        }
        inputs.pop();
    }
    Ok(ce)
}
