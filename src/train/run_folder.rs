//! The run's folder: claiming `output.dir` (its lock, the previous run's files set aside, a
//! resumed checkpoint's newer ones too), and whether a checkpoint continues the same run (the
//! recipe it was written with, the examples per step, and fingerprints of the model, data
//! and template files). `export --run` checks its base here too.

use super::{pass_rows, recorded_recipe, RankRun};
use crate::data::Loader;
use crate::error::{Error, Result};
use crate::recipe::LoadedRecipe;
use crate::weights::ModelDir;
use std::path::PathBuf;

/// On resume, drop the checkpoints past `checkpoint.keep_last` at once, not after the next
/// save: the newest is the one resumed from (newer ones were set aside), so this never goes
/// below keep_last, and a run stopped by a full disk frees its space by lowering keep_last
/// instead of failing its next save again.
fn prune_to(loaded: &LoadedRecipe, out_dir: &std::path::Path) -> Result<()> {
    crate::checkpoint::prune(out_dir, loaded.recipe.checkpoint.keep_last)
}

/// Take the output folder for this run (see `output`): lock it, clear half-written
/// checkpoints, and move aside whatever belongs to a run this one does not continue.
///
/// `resumable` refuses a checkpoint this run may not continue; it runs before anything moves.
pub(super) fn claim_output(loaded: &LoadedRecipe, out_dir: &std::path::Path, resumable: &dyn Fn(&std::path::Path) -> Result<()>) -> Result<crate::output::RunLock> {
    use crate::output::{previous_run_files, set_aside};
    let file = loaded.file.display().to_string();
    check_output_is_its_own(loaded, out_dir)?;
    let lock = crate::output::RunLock::acquire(out_dir, &file)?;
    crate::checkpoint::clean_temporaries(out_dir);
    let resume = loaded.recipe.checkpoint.resume.as_str();
    let say = |moved: Option<PathBuf>, why: &str| {
        if let Some(d) = moved {
            crate::note!("{why}: moved to {} (nothing was deleted)", d.display());
        }
    };
    let rel = |p: &std::path::Path| p.strip_prefix(out_dir).map(std::path::Path::to_path_buf).unwrap_or_else(|_| p.to_path_buf());
    match resume {
        "never" => {
            let moved = set_aside(out_dir, &previous_run_files(out_dir), &[])?;
            say(moved, "checkpoint.resume = \"never\" starts a new run; the previous run's files");
        }
        "auto" => {
            let scan = crate::checkpoint::scan(out_dir);
            match &scan.valid {
                None if !scan.damaged.is_empty() => {
                    let list: Vec<String> = scan.damaged.iter().map(|(d, why)| format!("{} ({why})", d.display())).collect();
                    return Err(Error::Recipe {
                        file,
                        key: "checkpoint.resume".into(),
                        msg: format!(
                            "{} holds checkpoints but none is valid: {}. Nothing was changed. To start a new run there, set \
                             checkpoint.resume = \"never\" (the old files are moved to {}/previous/), or set output.dir \
                             to another folder",
                            out_dir.display(),
                            list.join("; "),
                            out_dir.display()
                        ),
                    });
                }
                None => {
                    let moved = set_aside(out_dir, &previous_run_files(out_dir), &[])?;
                    say(moved, "no checkpoint to continue from; the previous run's files");
                }
                Some((step, dir)) => {
                    resumable(dir)?;
                    for (d, why) in &scan.damaged {
                        crate::note!("warning: checkpoint {} is damaged ({why})", d.display());
                    }
                    let damaged: Vec<PathBuf> = scan.damaged.iter().map(|(d, _)| rel(d)).collect();
                    set_aside_newer(out_dir, *step, damaged, "damaged checkpoints newer than the one resumed from")?;
                    prune_to(loaded, out_dir)?;

                }
            }
        }
        path => {
            // Everything that could refuse this checkpoint is checked before anything moves:
            // a mistyped path must not set the folder's run aside.
            let from = loaded.resolve(std::path::Path::new(path));
            crate::checkpoint::verify(&from).map_err(|why| Error::Recipe {
                file: file.clone(),
                key: "checkpoint.resume".into(),
                msg: format!("{} is not a valid checkpoint ({why}); nothing was changed", from.display()),
            })?;
            resumable(&from)?;
            let ours = crate::checkpoint::list(out_dir).into_iter().find(|(_, d)| same_path(d, &from));
            match ours {
                // Continuing from an older checkpoint of this folder abandons the newer ones.
                Some((step, _)) => {
                    let newer: Vec<PathBuf> = crate::checkpoint::list(out_dir).into_iter().filter(|(s, _)| *s > step).map(|(_, d)| rel(&d)).collect();
                    set_aside_newer(out_dir, step, newer, &format!("resuming from step {step}: the later checkpoints"))?;
                    prune_to(loaded, out_dir)?;
                }
                None => {
                    let moved = set_aside(out_dir, &previous_run_files(out_dir), &[])?;
                    say(moved, &format!("resuming from {}, which is not this folder's: the folder's previous run", from.display()));
                }
            }
        }
    }
    Ok(lock)
}

/// Refuse a verified checkpoint before anything in the folder moves: the recipe it was
/// written with must allow this one to continue it (the rules `train_rank` applies again
/// when it loads it, for every rank and with the warnings).
pub(super) fn check_resumable(loaded: &LoadedRecipe, dir: &std::path::Path) -> Result<()> {
    let saved = std::fs::read_to_string(dir.join("recipe.toml")).map_err(|e| Error::io(dir.join("recipe.toml"), e))?;
    let model_dir = ModelDir::of_recipe(loaded)?;
    let cfg = model_dir.config()?;
    let current = recorded_recipe(loaded, &cfg, &model_dir)?;
    crate::checkpoint::check_recipe_change(&saved, &current, &|p| recipe_place(loaded, p), &|k| loaded.written.contains(k)).map(|_| ()).map_err(|(key, msg)| Error::Recipe {
        file: loaded.file.display().to_string(),
        key,
        msg: format!("{msg} [checkpoint {}]; nothing was changed", dir.display()),
    })
}

/// Whether checkpoint `dir` (its state and the recipe it was written with) continues as the
/// same run under this one: the same examples per step, over the same model and data files.
/// An error naming the key that differs otherwise; a note where the examples are split into
/// other micro-batches or passes (the same run, not bit for bit).
pub(super) fn check_same_run(rk: &RankRun, state: &crate::checkpoint::TrainState, saved: &str, dir: &std::path::Path) -> Result<Option<String>> {
    let (loaded, world) = (rk.loaded, rk.world);
    // A lower max_steps than the run reached would stop at once and record that lower count
    // beside the adapter of the later step.
    let max_steps = loaded.recipe.train.max_steps;
    if state.step > max_steps {
        return Err(Error::Recipe {
            file: loaded.file.display().to_string(),
            key: "train.max_steps".into(),
            msg: format!(
                "is {max_steps}, but the run's checkpoint is at step {} (its adapter is that step's): raise it to continue the run, \
                 resume an earlier checkpoint by its path (checkpoint.resume = \"{}\"), or start over with checkpoint.resume = \"never\" \
                 (the run is moved to previous/, nothing is deleted) [checkpoint {}]; nothing was changed",
                state.step,
                dir.parent().unwrap_or(dir).join("step-NNNNNN").display(),
                dir.display()
            ),
        });
    }
    let t = &loaded.recipe.train;
    let (accum, micro) = (t.grad_accum_steps, t.micro_batch_size);
    // The world size may change between runs, and so may how a step's examples are split
    // into micro-batches and passes (to fit another machine's memory); the examples per
    // step may not (the same examples per step is what makes the resumed run the same run).
    // The saved recipe's value of a train key (read loosely: a recipe an older version wrote
    // may not parse as today's), or its default.
    let saved_table = toml::from_str::<toml::Table>(saved).ok();
    let saved_train = |key: &str, default: usize| saved_table.as_ref().and_then(|t| t.get("train")?.get(key)?.as_integer()).map_or(default, |n| n as usize);
    // (Both keys default to 1.)
    let saved_mbs = match state.micro_batches_per_step {
        0 => saved_train("grad_accum_steps", 1),
        n => n,
    };
    // batch_by = "rows": a step is micro-batches x rows; "tokens": its micro-batches are
    // token batches, so their count is the step's size (micro_batch_size is not used).
    let by_rows = loaded.recipe.data.batch_by != "tokens";
    let saved_micro = if by_rows { saved_train("micro_batch_size", 1) } else { 1 };
    let micro = if by_rows { micro } else { 1 };
    let size = |mbs: usize, m: usize| match by_rows {
        true => format!("{mbs} micro-batches of {m} row{} = {} rows", if m == 1 { "" } else { "s" }, mbs * m),
        false => format!("{mbs} token batches"),
    };
    if saved_mbs * saved_micro != accum * world * micro {
        // The accumulation that takes the checkpoint's rows a step at micro-batches of `m`.
        let accum_at = |m: usize| Some(saved_mbs * saved_micro).filter(|rows| rows % (world * m) == 0).map(|rows| rows / (world * m));
        let keeps_micro = saved_micro == micro || !loaded.recipe.lora.routed_experts;
        let (key, fix) = match (accum_at(micro).filter(|_| keeps_micro), accum_at(saved_micro)) {
            (Some(a), _) => ("train.grad_accum_steps", format!(": set train.grad_accum_steps = {a}")),
            (None, Some(a)) => ("train.micro_batch_size", format!(": restore train.micro_batch_size = {saved_micro} and set train.grad_accum_steps = {a}")),
            (None, None) => ("train.grad_accum_steps", format!(" (its {} rows do not split over {world} ranks)", saved_mbs * saved_micro)),
        };
        return Err(Error::Recipe {
            file: loaded.file.display().to_string(),
            key: key.into(),
            msg: format!(
                "the checkpoint's steps took {}, this run's take {} (grad_accum_steps {accum} x ranks {world}); \
                 the global batch must stay the same to continue the run{fix} [checkpoint {}]",
                size(saved_mbs, saved_micro),
                size(accum * world, micro),
                dir.display()
            ),
        });
    }
    // A routed expert that a micro-batch's padding reaches is updated (its gradient is zero,
    // not absent, as in PEFT): rows padded together otherwise update other experts.
    if saved_micro != micro && loaded.recipe.lora.routed_experts {
        return Err(Error::Recipe {
            file: loaded.file.display().to_string(),
            key: "train.micro_batch_size".into(),
            msg: format!(
                "is {micro}, the checkpoint's was {saved_micro}: with lora.routed_experts, the padding of rows batched together reaches experts, \
                 and AdamW steps every expert reached, so other micro-batches would update other experts. Restore it (another world size or \
                 grad_accum_steps with the same micro_batch_size continues the run) [checkpoint {}]",
                dir.display()
            ),
        });
    }
    // Another split of the same examples sums the same gradients in another order (and, with
    // LoRA dropout, draws other masks, which are seeded per micro-batch): the same run in
    // exact arithmetic, as on another world size, but not bit for bit. Said, not refused: a
    // run that no longer fits must be able to go on.
    let rows = pass_rows(&loaded.recipe, rk.fused, rk.resident);
    let mut split = Vec::new();
    if saved_micro != micro {
        let masks = if loaded.recipe.lora.dropout > 0.0 { ", drawing other lora.dropout masks" } else { "" };
        split.push(format!("{} where it ran {}{masks}", size(accum * world, micro), size(saved_mbs, saved_micro)));
    }
    if let Some(saved_rows) = state.pass_rows.filter(|&n| n != rows && saved_micro == micro) {
        split.push(format!("passes of {rows} rows where it ran {saved_rows} (train.activation_checkpointing and activation_memory_mb, and how the base is held, set them)"));
    }
    let note = (!split.is_empty()).then(|| {
        format!(
            "resuming {}: this run splits each step's examples otherwise, {}: the same examples, but the gradients summed in another order, \
             so the steps from here will not match bit for bit those of the run as it began",
            dir.display(),
            split.join("; and ")
        )
    });
    // The same paths must hold the same files: a model or dataset replaced in place is
    // not the run's.
    // (A checkpoint's model fingerprint is compared over the files it covered then.)
    let out = canonical(rk.out_dir.clone());
    let model_same = state.model_fingerprint.as_ref().is_none_or(|s| model_matches(s, state.model_fingerprint_version, &rk.model_dir, &out));
    let data_same = state.data_fingerprint.as_ref().is_none_or(|s| *s == rk.data_fingerprint);
    // (A template named by another path, or none, is a recipe change, refused before this.)
    let template_same = state.template_fingerprint.as_ref().zip(rk.template_fingerprint.as_ref()).is_none_or(|(s, c)| s == c);
    for (same, key, what) in [
        (model_same, "model.path", "the model's files (config.json, weights, tokenizer)"),
        (data_same, "data.train", "the training data's files"),
        (template_same, "data.template", "the chat template's file"),
    ] {
        if !same {
            return Err(Error::Recipe {
                file: loaded.file.display().to_string(),
                key: key.into(),
                msg: format!(
                    "{what} differ from those the checkpoint was trained on (replaced or changed since at the same path); resuming would not continue the same run. \
                     Restore them, or start over with checkpoint.resume = \"never\" or a new output.dir [checkpoint {}]",
                    dir.display()
                ),
            });
        }
    }
    Ok(note)
}

/// Fingerprints (`fsutil::fingerprint`) of the model's files that training reads (config,
/// weights, tokenizer and its special_tokens_map.json, chat template; not a README beside
/// them, nor the run's own folder were it inside) and of the files the training loader reads (its shards, as it resolved
/// them: a DatasetDict split, a hub dataset's cached files), and of the Jinja file
/// `data.template` names, where it names one.
pub(super) fn input_fingerprints(loaded: &LoadedRecipe, model_dir: &ModelDir, loader: &Loader) -> (String, String, Option<String>) {
    let out = canonical(loaded.resolve(&loaded.recipe.output.dir));
    let data: Vec<PathBuf> = loader.files().into_iter().map(canonical).collect();
    let template = loaded.chat_template_file().map(|p| crate::fsutil::fingerprint(&[canonical(p)], &|_| true, &out, false));
    (model_fingerprint(model_dir, &out, MODEL_FINGERPRINT_VERSION), crate::fsutil::fingerprint(&data, &|_| true, &out, true), template)
}

/// Where a path of the recipe leads, if it is a local one that exists (for
/// `check_recipe_change`; a checkpoint's recipe is taken as written beside this one).
pub(super) fn recipe_place(loaded: &LoadedRecipe, p: &str) -> Option<PathBuf> {
    loaded.resolve(std::path::Path::new(p)).canonicalize().ok()
}

fn canonical(p: PathBuf) -> PathBuf {
    p.canonicalize().unwrap_or(p)
}

/// What [`model_fingerprint`] covers now: 1 counts special_tokens_map.json, 0 (checkpoints
/// written before) did not.
pub(super) const MODEL_FINGERPRINT_VERSION: u32 = 1;

/// The fingerprint of the model's files training reads: those at the top of its folder (a
/// model folder is flat; runs, merged exports or other models kept in subfolders of it are
/// not its files), over the files `version` of it covers.
pub(super) fn model_fingerprint(model_dir: &ModelDir, out: &std::path::Path, version: u32) -> String {
    let model_files = |n: &str| {
        n.ends_with(".safetensors") || n.ends_with(".safetensors.index.json") || n.ends_with(".gguf")
            || ["config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"].contains(&n)
            || (version >= 1 && n == "special_tokens_map.json")
    };
    let model: Vec<PathBuf> = std::iter::once(model_dir.dir.clone()).chain(model_dir.gguf.clone()).map(canonical).collect();
    crate::fsutil::fingerprint(&model, &model_files, out, false)
}

/// Whether the model's files are those a checkpoint recorded as `saved`, by the fingerprint
/// `version` it wrote. A version-0 checkpoint may be from before special_tokens_map.json
/// counted or from the commits that counted it before the version was recorded: either
/// fingerprint matching is a match.
fn model_matches(saved: &str, version: u32, model_dir: &ModelDir, out: &std::path::Path) -> bool {
    let versions: &[u32] = if version == 0 { &[0, 1] } else { &[version] };
    versions.iter().any(|&v| model_fingerprint(model_dir, out, v) == saved)
}

/// The base a run that just finished trained on (`ModelDir::of_run`: `path` at its recorded
/// hub commit), checked against the files it trained on ([`check_export_base`]): what the
/// end-of-run merge and GGUF export write from.
pub fn run_base(run: &std::path::Path, path: &str, recipe_dir: &std::path::Path) -> Result<ModelDir> {
    let base = ModelDir::of_run(run, path, recipe_dir)?;
    check_export_base(run, None, &base)?;
    Ok(base)
}

/// `export --run`: the base about to be merged into (or described) must be the one the run
/// trained on, as resume requires (its checkpoints record the model's fingerprint): a base
/// replaced at the same path since would be merged into and verified against itself, exit 0.
/// `checkpoint` names the one exported (else the newest valid one); a run without
/// checkpoints has nothing recorded to compare.
pub fn check_export_base(run: &std::path::Path, checkpoint: Option<&str>, base: &ModelDir) -> Result<()> {
    let dir = match checkpoint {
        Some(c) => Some(run.join("checkpoints").join(c)),
        None => crate::checkpoint::latest_valid(run),
    };
    let Some(dir) = dir.filter(|d| d.join("state.json").is_file()) else { return Ok(()) };
    let (state, _) = crate::checkpoint::read_state(&dir)?;
    let Some(want) = state.model_fingerprint else { return Ok(()) };
    if !model_matches(&want, state.model_fingerprint_version, base, &canonical(run.to_path_buf())) {
        return Err(Error::Export(format!(
            "the base {}'s files (config.json, weights, tokenizer) differ from those run {} was trained on (recorded in {}): merge into the base it trained on, or pass --adapter {} and --base to use this one on purpose",
            base.dir.display(),
            run.display(),
            dir.join("state.json").display(),
            run.join("adapter").display()
        )));
    }
    Ok(())
}

/// Set aside `newer` (checkpoints after `step`, the one continued from) with what they
/// produced: the final adapter, a merged model, the summary and report, and a copy of
/// metrics.jsonl (whose lines after `step` the resumed run replaces). The finals go before
/// the checkpoints: a set-aside cut short is finished by the rerun only while one of the
/// newer checkpoints is left to find.
fn set_aside_newer(out_dir: &std::path::Path, step: usize, newer: Vec<PathBuf>, why: &str) -> Result<()> {
    if newer.is_empty() {
        return Ok(());
    }
    let names: Vec<PathBuf> = crate::output::FINAL_OUTPUTS.iter().map(PathBuf::from).chain(newer).collect();
    // The resumed run cuts metrics.jsonl and the TensorBoard events back to `step`: copies of
    // both keep the steps it replaces.
    let events: Vec<String> = std::fs::read_dir(out_dir.join("tensorboard"))
        .map(|d| d.flatten().filter(|e| e.path().is_file()).map(|e| format!("tensorboard/{}", e.file_name().to_string_lossy())).collect())
        .unwrap_or_default();
    let copies: Vec<&str> = std::iter::once("metrics.jsonl").chain(events.iter().map(String::as_str)).collect();
    if let Some(d) = crate::output::set_aside(out_dir, &names, &copies)? {
        let tb = if events.is_empty() { "" } else { " and of the TensorBoard events" };
        crate::note!("{why} (after step {step}), the final adapter and a copy of metrics.jsonl{tb}: moved to {} (nothing was deleted)", d.display());
    }
    Ok(())
}

fn same_path(a: &std::path::Path, b: &std::path::Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// `output.dir` must be a folder of its own: not a filesystem root, not the model's folder
/// (its adapter, checkpoints and metrics would be written among the weights), and not a data
/// folder (the next run would read its own metrics.jsonl as data). A folder inside either is
/// fine: the fingerprints and the loader skip it.
fn check_output_is_its_own(loaded: &LoadedRecipe, out_dir: &std::path::Path) -> Result<()> {
    let out = canonical(out_dir.to_path_buf());
    let d = &loaded.recipe.data;
    let data = d.train.list().into_iter().map(|p| ("data.train", p)).chain(d.eval.iter().flat_map(|e| e.list()).map(|p| ("data.eval", p)));
    let named = std::iter::once(("model.path", loaded.resolve(std::path::Path::new(&loaded.recipe.model.path)))).chain(data.map(|(k, p)| (k, loaded.resolve(&p))));
    let clash = named.filter(|(_, p)| p.is_dir()).find(|(_, p)| canonical(p.clone()) == out);
    let msg = match clash {
        _ if out.parent().is_none() => "is a filesystem root; give the run a folder of its own".to_string(),
        Some((key, p)) => format!("is the folder {key} names ({}); give the run a folder of its own (a folder inside it is fine)", p.display()),
        None => return Ok(()),
    };
    Err(Error::Recipe { file: loaded.file.display().to_string(), key: "output.dir".into(), msg: format!("{} {msg}", out_dir.display()) })
}
