//! What a run reads besides the model: the training and evaluation data (local paths, hub
//! datasets, splits) opened as `Loader`s, the held-out set read once, and evaluation over it.

use crate::data::source::Split;
use crate::data::{Formatter, Loader, LoaderOptions, MicroBatch, Role, IGNORE};
use crate::error::{CandleContext, Error, Result};
use crate::lora::Adapters;
use crate::model::Model;
use crate::recipe::LoadedRecipe;
use crate::weights::ModelDir;
use candle_core::Tensor;
use std::path::PathBuf;

/// The evaluation examples, when the recipe asks for evaluation.
/// `trained`: the files the training loader reads; data.eval must read none of them (an eval
/// loss on training rows says nothing of held-out ones: `data.eval_fraction` holds rows out).
pub(super) fn read_eval_set(loaded: &LoadedRecipe, model_dir: &ModelDir, vocab: usize, trained: &[PathBuf], lead: bool) -> Result<Option<Vec<crate::data::Example>>> {
    let r = &loaded.recipe;
    if r.data.eval.is_none() && r.data.eval_fraction <= 0.0 {
        return Ok(None);
    }
    let mut l = open_loader(loaded, model_dir, vocab, Role::Eval)?;
    if r.data.eval.is_some() {
        let canon = |p: &PathBuf| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone());
        let trained: std::collections::HashSet<PathBuf> = trained.iter().map(canon).collect();
        if let Some(f) = l.files().iter().find(|f| trained.contains(&canon(f))) {
            return Err(Error::Recipe {
                file: loaded.file.display().to_string(),
                key: "data.eval".into(),
                msg: format!("reads {}, which data.train reads too: name another split (`dir:test`) or source, or hold rows out with data.eval_fraction instead", f.display()),
            });
        }
    }
    let ex = l.one_pass()?;
    // No targets would make every eval_loss 0.0, which reads as a perfect model.
    let targets: usize = ex.iter().map(|e| e.labels.iter().skip(1).filter(|&&l| l != IGNORE).count()).sum();
    if ex.is_empty() || targets == 0 {
        let key = if r.data.eval.is_some() { "data.eval" } else { "data.eval_fraction" };
        let what = if ex.is_empty() { "no usable records" } else { "no target tokens (every label is -100)" };
        return Err(Error::Recipe { file: loaded.file.display().to_string(), key: key.into(), msg: format!("the evaluation set has {what}") });
    }
    // eval_loss is over what is left: say how much that is where data.max_seq_len cut some.
    let (dropped, truncated) = (l.stats.dropped, l.stats.truncated);
    if lead && dropped + truncated > 0 {
        crate::note!(
            "note: the evaluation set: {dropped} of {} records dropped and {truncated} truncated at data.max_seq_len = {} (data.overflow = \"{}\"): eval_loss is over the {} records and tokens left",
            ex.len() as u64 + dropped,
            r.data.max_seq_len,
            r.data.overflow,
            ex.len()
        );
    }
    Ok(Some(ex))
}

/// The example stream a recipe describes (training side or held-out/eval side).
pub fn open_loader(loaded: &LoadedRecipe, model_dir: &ModelDir, vocab: usize, role: Role) -> Result<Loader> {
    let r = &loaded.recipe;
    let d = &r.data;
    let template = loaded.existing_chat_template_file()?.map(|p| p.to_string_lossy().into_owned()).or_else(|| d.template.clone());
    let fmt = Formatter::new(&d.format, template.as_deref(), &d.columns, d.train_on_prompt, &model_dir.dir, vocab)?;
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
    let (specs, mut split) = data_sources(d, role);
    let mut files = Vec::new();
    for p in &specs {
        match hub_dataset(loaded, p, split)? {
            Some(hub_files) => {
                files.extend(hub_files);
                split.chose_on_hub |= crate::hub::DataEntry::parse(&p.to_string_lossy()).split.is_none();
            }
            None => files.push(resolve_spec(loaded, p)),
        }
    }
    Loader::open(&files, split, fmt, opts)
}

/// The data entries a role reads, and which split of them. data.split belongs to data.train
/// (and the eval_fraction held out of it): data.eval names its own (`dir:validation`), else
/// reads `test` where there are several, never the train split.
pub(super) fn data_sources(d: &crate::recipe::DataSection, role: Role) -> (Vec<PathBuf>, Split<'_>) {
    match (&d.eval, role) {
        (Some(e), Role::Eval) => (e.list(), Split::eval(None)),
        _ => (d.train.list(), Split::train(d.split.as_deref())),
    }
}

/// A data entry that names no local path but a hub dataset repo (`org/name[@revision][:split]`):
/// its data files of that split (or `data.split`), downloaded into the hub cache.
pub(super) fn hub_dataset(loaded: &LoadedRecipe, p: &std::path::Path, split: Split) -> Result<Option<Vec<PathBuf>>> {
    let s = p.to_string_lossy();
    let e = crate::hub::DataEntry::parse(&s);
    if loaded.resolve(p).exists() || loaded.resolve(std::path::Path::new(e.path)).exists() {
        return Ok(None);
    }
    // A data file's name is a path that does not exist, not a repo.
    let file_like = ["jsonl", "json", "parquet", "arrow"].iter().any(|x| e.id.ends_with(&format!(".{x}")));
    if !crate::hub::looks_like_repo(e.id) || file_like {
        return Ok(None);
    }
    crate::hub::Hub::from_env()?.dataset(e.id, e.revision, e.split.map_or(split, |sp| split.named(sp))).map(Some).map_err(|err| crate::hub::not_local_either(err, &loaded.resolve(p)))
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
pub fn evaluate(model: &Model, adapters: &Adapters, examples: &[crate::data::Example], batch: usize) -> Result<f64> {
    let (sum, count) = evaluate_part(model, adapters, examples, batch, 0, 1)?;
    Ok(sum / count.max(1) as f64)
}

/// CE sum and target count over rank `rank`'s share of the evaluation batches (batch j goes
/// to rank j mod world). Every rank runs the same number of forwards and asks for the same
/// tensors in the same order, because under ZeRO-3 each request is a collective: a rank left
/// without a batch in the last round re-runs batch 0 and discards it, and the head is fetched
/// even for a batch without targets.
pub fn evaluate_part(model: &Model, adapters: &Adapters, examples: &[crate::data::Example], batch: usize, rank: usize, world: usize) -> Result<(f64, usize)> {
    let chunks: Vec<&[crate::data::Example]> = examples.chunks(batch.max(1)).collect();
    let (mut sum, mut count) = (0.0, 0usize);
    for round in 0..chunks.len().div_ceil(world) {
        let j = round * world + rank;
        let (chunk, keep) = if j < chunks.len() { (chunks[j], true) } else { (chunks[0], false) };
        let mb = MicroBatch::collate(chunk);
        let device = model.device();
        let ctx = model.forward_ctx(&mb.positions, mb.segments.as_deref(), None)?;
        let ids = Tensor::from_slice(&mb.input_ids, (mb.rows, mb.seq), &device)?;
        let mut x = model.embed(&ids)?;
        for i in 0..model.cfg.num_hidden_layers {
            x = model.layer_forward(i, &x, &ctx, adapters)?.detach();
        }
        let (idx, tgt): (Vec<u32>, Vec<u32>) =
            mb.targets.iter().enumerate().filter(|(_, &t)| t != IGNORE).map(|(i, &t)| (i as u32, t as u32)).unzip();
        let h = model.cfg.hidden_size;
        let normed = model.final_norm(&x)?.reshape((mb.rows * mb.seq, h))?; // [N, H]
        // Every rank reads the head, with no rows where it has nothing to score (under
        // ZeRO-3 reading it is a collective).
        let (idx, tgt) = if keep { (idx, tgt) } else { (Vec::new(), Vec::new()) };
        let rows = normed.index_select(&Tensor::from_vec(idx, tgt.len(), &device)?, 0)?; // [M, H]
        let (ce, _) = crate::ops::loss::cross_entropy_sum_and_grad(model.kernels(), &rows, &model.lm_head_rows(), &tgt, 0.0).ctx("eval cross-entropy")?;
        if tgt.is_empty() {
            continue;
        }
        sum += ce;
        count += tgt.len();
    }
    Ok((sum, count))
}
