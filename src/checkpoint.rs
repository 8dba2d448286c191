//! Checkpoints that never lose a run.
//!
//! A checkpoint is `<output.dir>/checkpoints/step-NNNNNN/` holding the adapter (PEFT format),
//! the AdamW moments (`optimizer.safetensors`), the training state (`state.json`: step, AdamW
//! step count, dropout counter, data cursor and shuffle buffer, RNG state), the resolved recipe,
//! and `manifest.json` with the size and SHA-256 of every other file.
//!
//! Saving is atomic: everything is written into `checkpoints/.tmp-step-NNNNNN/`, fsynced, the
//! manifest last, then the folder is renamed into place and the parent fsynced. A checkpoint
//! folder without a verifying manifest is never used, so a crash or a full disk at any moment
//! leaves the previous checkpoint as the newest valid one. Older checkpoints are pruned only
//! after the new one is in place.

use crate::data::LoaderState;
use crate::error::{Error, Result};
use crate::lora::Adapters;
use crate::optim::Moments;
use candle_core::{Device, Tensor};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

const MANIFEST: &str = "manifest.json";

/// Scalars of the training state saved with every checkpoint.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrainState {
    /// Optimizer steps completed.
    pub step: usize,
    /// Micro-batches consumed (the dropout-mask counter).
    pub micro_index: u64,
    /// Micro-batches per optimizer step over all ranks (grad_accum_steps x world size); 0 in
    /// checkpoints written before it was recorded.
    #[serde(default)]
    pub micro_batches_per_step: usize,
    pub loader: LoaderState,
    /// Rows of a micro-batch that one forward and backward pass ran (`train::pass_rows`): the
    /// passes' gradients are summed, so another split is another sum. None in checkpoints
    /// written before it was recorded.
    #[serde(default)]
    pub pass_rows: Option<usize>,
    /// `fsutil::fingerprint`s of the model's files and of the training data's, so that other
    /// files put at the same paths are not trained on as if they were the run's (None in
    /// checkpoints written before they were recorded).
    #[serde(default)]
    pub model_fingerprint: Option<String>,
    #[serde(default)]
    pub data_fingerprint: Option<String>,
    /// The fingerprint of the Jinja file `data.template` names (None where it names none, and
    /// in checkpoints written before it was recorded): an edited template tokenizes the
    /// same records otherwise.
    #[serde(default)]
    pub template_fingerprint: Option<String>,
    /// Which files `model_fingerprint` covered (`train::MODEL_FINGERPRINT_VERSION`; 0 in
    /// checkpoints from before special_tokens_map.json counted), so it is compared over them.
    #[serde(default)]
    pub model_fingerprint_version: u32,
    /// The run's peak RSS up to this checkpoint, over every process that ran it (the lead's
    /// VmHWM, MB): a resumed run's summary reports the whole run's peak.
    #[serde(default)]
    pub peak_rss_mb: Option<f64>,
    /// What the step's arithmetic ran on (`train::describe_kernels`: the bf16 unit or f32
    /// math for a bf16 base, the f32 GEMM's instruction set, or the device): a run resumed on
    /// other kernels goes on with a note saying it will not match bit for bit (None in
    /// checkpoints written before it was recorded).
    #[serde(default)]
    pub kernels: Option<String>,
}

pub struct Loaded {
    pub dir: PathBuf,
    /// AdamW moments of all LoRA parameters, flat in `Adapters::params` order, whatever the
    /// world size the run was saved with.
    pub moments: Moments,
    pub adam_step: u64,
    pub state: TrainState,
    /// The resolved recipe the checkpoint was written with.
    pub recipe: String,
}

pub fn root(out_dir: &Path) -> PathBuf {
    out_dir.join("checkpoints")
}

fn step_name(step: usize) -> String {
    format!("step-{step:06}")
}

fn sha256_file(path: &Path) -> Result<(u64, String)> {
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut h = Sha256::new();
    let n = std::io::copy(&mut f, &mut h).map_err(|e| Error::io(path, e))?;
    Ok((n, h.finalize().iter().map(|b| format!("{b:02x}")).collect()))
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
    f.write_all(bytes).and_then(|_| f.sync_all()).map_err(|e| Error::io(path, e))
}

/// Write a checkpoint for `state.step`; returns its folder. `moments` are the consolidated
/// AdamW moments of all parameters (flat, `Adapters::params` order), so the checkpoint does
/// not depend on how many ranks wrote it.
/// What an adapter folder records besides its tensors: the base it was trained on
/// (`base_model_name_or_path`), and the chat template the run used where it was not the
/// model's own, which the adapter carries as `chat_template.jinja` (listed in a checkpoint's
/// manifest), as TRL's output folder carries the tokenizer it trained with.
#[derive(Clone, Copy)]
pub struct AdapterOrigin<'a> {
    pub base_model: &'a str,
    pub chat_template: Option<&'a str>,
}

impl AdapterOrigin<'_> {
    /// Write the adapter and what it carries into `dir`.
    pub fn save(&self, adapters: &Adapters, dir: &Path) -> Result<()> {
        adapters.save_peft(dir, self.base_model)?;
        match self.chat_template {
            Some(t) => write_file(&dir.join(crate::chat::TEMPLATE_FILE), t.as_bytes()),
            None => Ok(()),
        }
    }
}

pub fn save(out_dir: &Path, adapters: &Adapters, moments: &Moments, adam_step: u64, state: &TrainState, recipe: &str, origin: AdapterOrigin) -> Result<PathBuf> {
    let root = root(out_dir);
    std::fs::create_dir_all(&root).map_err(|e| Error::io(&root, e))?;
    let name = step_name(state.step);
    let tmp = root.join(format!(".tmp-{name}"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;

    origin.save(adapters, &tmp.join("adapter"))?;
    let moments_in = moments;
    let mut moments: BTreeMap<String, Tensor> = BTreeMap::new();
    // Tensors whose own step count fell behind (skipped while they had no gradient): listed by
    // key; every other tensor took all `adam_step` updates.
    let mut behind = serde_json::Map::new();
    let mut off = 0;
    for (key, var) in adapters.params() {
        let n = var.elem_count();
        let (m, v) = (moments_in.exp_avg.get(off..off + n), moments_in.exp_avg_sq.get(off..off + n));
        let (Some(m), Some(v)) = (m, v) else {
            return Err(Error::Train(format!("optimizer state is shorter than the adapters (at {key})")));
        };
        moments.insert(format!("{key}.exp_avg"), Tensor::from_slice(m, var.shape(), &Device::Cpu)?);
        moments.insert(format!("{key}.exp_avg_sq"), Tensor::from_slice(v, var.shape(), &Device::Cpu)?);
        let s = moments_in.steps.get(off).copied().unwrap_or(adam_step as f32) as u64;
        if s != adam_step {
            behind.insert(key, s.into());
        }
        off += n;
    }
    let mut meta: std::collections::HashMap<String, String> = [("adam_step".to_string(), adam_step.to_string())].into();
    if !behind.is_empty() {
        meta.insert("adam_steps".into(), serde_json::Value::Object(behind).to_string());
    }
    let opt_path = tmp.join("optimizer.safetensors");
    crate::fsutil::write_safetensors(moments.iter().collect::<Vec<_>>(), Some(meta), &opt_path)?;
    std::fs::File::open(&opt_path).and_then(|f| f.sync_all()).map_err(|e| Error::io(&opt_path, e))?;
    let st = serde_json::to_vec_pretty(state).map_err(|e| Error::Train(e.to_string()))?;
    write_file(&tmp.join("state.json"), &st)?;
    write_file(&tmp.join("recipe.toml"), recipe.as_bytes())?;

    let mut files = BTreeMap::new();
    let carried = origin.chat_template.map(|_| format!("adapter/{}", crate::chat::TEMPLATE_FILE));
    for rel in CHECKPOINT_FILES.iter().map(|r| r.to_string()).chain(carried) {
        let (bytes, sha) = sha256_file(&tmp.join(&rel))?;
        files.insert(rel.to_string(), serde_json::json!({"bytes": bytes, "sha256": sha}));
    }
    let manifest = serde_json::json!({"format": 1, "step": state.step, "files": files});
    write_file(&tmp.join(MANIFEST), manifest.to_string().as_bytes())?;
    // The folder itself is fsynced by `replace_dir_durable`.
    crate::fsutil::sync_dir(&tmp.join("adapter"))?;
    let dst = root.join(&name);
    // Same step saved again (e.g. a signal right after a scheduled save): swapped in, so a
    // crash meanwhile leaves the old copy or the new one, never neither (when the old one was
    // removed first, the new one sat only in `.tmp-*`, which the next run's cleaning deletes).
    crate::fsutil::replace_dir_durable(&tmp, &dst)?;
    Ok(dst)
}

/// Verify a checkpoint folder against its manifest; the error says what is wrong.
pub fn verify(dir: &Path) -> std::result::Result<usize, String> {
    let text = std::fs::read_to_string(dir.join(MANIFEST)).map_err(|e| format!("no readable {MANIFEST}: {e}"))?;
    let m: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{MANIFEST} is not valid JSON: {e}"))?;
    let files = m.get("files").and_then(|f| f.as_object()).ok_or(format!("{MANIFEST} lists no files"))?;
    // Every file a checkpoint has, not only those the manifest names: a manifest that lost an
    // entry let a damaged optimizer state resume.
    if let Some(rel) = CHECKPOINT_FILES.iter().find(|rel| !files.contains_key(**rel)) {
        return Err(format!("{MANIFEST} does not list {rel}"));
    }
    for (rel, want) in files {
        let (bytes, sha) = sha256_file(&dir.join(rel)).map_err(|e| e.to_string())?;
        if Some(bytes) != want.get("bytes").and_then(|b| b.as_u64()) || Some(sha.as_str()) != want.get("sha256").and_then(|s| s.as_str()) {
            return Err(format!("{rel} does not match its checksum"));
        }
    }
    let step = m.get("step").and_then(|s| s.as_u64()).map(|s| s as usize).ok_or(format!("{MANIFEST} has no step"))?;
    // The step the manifest, state.json and the folder's name say must agree (state.json of
    // another step under a step-N name resumed as "step-N (step M)").
    let state: serde_json::Value = std::fs::read_to_string(dir.join("state.json")).ok().and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_default();
    if state.get("step").and_then(|s| s.as_u64()) != Some(step as u64) {
        return Err(format!("state.json is not of step {step}, the step {MANIFEST} says"));
    }
    let named = dir.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_prefix("step-")).and_then(|n| n.parse::<usize>().ok());
    if named.is_some_and(|n| n != step) {
        return Err(format!("the folder is named for another step than {MANIFEST}'s {step}"));
    }
    Ok(step)
}

/// The files of a checkpoint, each listed in its manifest with its size and SHA-256.
const CHECKPOINT_FILES: [&str; 5] = ["adapter/adapter_model.safetensors", "adapter/adapter_config.json", "optimizer.safetensors", "state.json", "recipe.toml"];

/// Checkpoint folders under `out_dir`, newest first.
pub fn list(out_dir: &Path) -> Vec<(usize, PathBuf)> {
    let mut v: Vec<(usize, PathBuf)> = std::fs::read_dir(root(out_dir))
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            name.strip_prefix("step-").and_then(|n| n.parse().ok()).map(|n| (n, e.path()))
        })
        .collect();
    v.sort_by_key(|e| std::cmp::Reverse(e.0));
    v
}

/// The newest checkpoint whose manifest verifies; damaged ones are reported and skipped.
pub fn latest_valid(out_dir: &Path) -> Option<PathBuf> {
    scan(out_dir).valid.map(|(_, dir)| dir)
}

/// The checkpoints of an output folder as `resume = "auto"` sees them.
pub struct Scan {
    /// The newest checkpoint that verifies, with its step.
    pub valid: Option<(usize, PathBuf)>,
    /// Checkpoints newer than `valid` (all of them when none is valid) that do not verify,
    /// with what is wrong with each.
    pub damaged: Vec<(PathBuf, String)>,
}

pub fn scan(out_dir: &Path) -> Scan {
    let mut damaged = Vec::new();
    for (step, dir) in list(out_dir) {
        match verify(&dir) {
            Ok(_) => return Scan { valid: Some((step, dir)), damaged },
            Err(why) => damaged.push((dir, why)),
        }
    }
    Scan { valid: None, damaged }
}

/// Load a verified checkpoint: the adapter into `adapters`, the rest returned.
pub fn load(dir: &Path, adapters: &Adapters) -> Result<Loaded> {
    let bad = |msg: String| Error::Train(format!("checkpoint {}: {msg}", dir.display()));
    verify(dir).map_err(bad)?;
    adapters.load_peft(&dir.join("adapter"))?;
    let opt_path = dir.join("optimizer.safetensors");
    let bytes = std::fs::read(&opt_path).map_err(|e| Error::io(&opt_path, e))?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)
        .map_err(|e| Error::Safetensors { file: opt_path.clone(), msg: e.to_string() })?;
    let adam_step = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("adam_step"))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("optimizer.safetensors has no adam_step".into()))?;
    let tensors = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)
        .map_err(|e| Error::Safetensors { file: opt_path.clone(), msg: crate::error::candle_msg(&e) })?;
    let behind: serde_json::Map<String, serde_json::Value> = match meta.metadata().as_ref().and_then(|m| m.get("adam_steps")) {
        Some(s) => serde_json::from_str(s).map_err(|e| bad(format!("optimizer.safetensors: adam_steps is not a JSON object: {e}")))?,
        None => Default::default(),
    };
    let mut moments = Moments::zeros(0);
    for (key, var) in adapters.params() {
        let s = match behind.get(&key) {
            None => adam_step,
            Some(v) => v.as_u64().filter(|&s| s <= adam_step).ok_or_else(|| bad(format!("adam_steps of {key}: {v} is not a step count up to {adam_step}")))?,
        };
        moments.steps.extend(std::iter::repeat_n(s as f32, var.elem_count()));
        let get = |suffix: &str| -> Result<Vec<f32>> {
            let t = tensors.get(&format!("{key}.{suffix}")).ok_or_else(|| bad(format!("optimizer state for {key} missing")))?;
            if t.dims() != var.dims() {
                return Err(bad(format!("optimizer state for {key} has shape {:?}, expected {:?}", t.dims(), var.dims())));
            }
            Ok(t.flatten_all()?.to_vec1()?)
        };
        moments.exp_avg.extend(get("exp_avg")?);
        moments.exp_avg_sq.extend(get("exp_avg_sq")?);
    }
    let (state, recipe) = read_state(dir)?;
    Ok(Loaded { dir: dir.to_path_buf(), moments, adam_step, state, recipe })
}

/// A checkpoint's training state (`state.json`) and the recipe it was written with.
pub fn read_state(dir: &Path) -> Result<(TrainState, String)> {
    let st_path = dir.join("state.json");
    let text = std::fs::read_to_string(&st_path).map_err(|e| Error::io(&st_path, e))?;
    let state: TrainState = serde_json::from_str(&text).map_err(|e| Error::Train(format!("checkpoint {}: state.json: {e}", dir.display())))?;
    let rp = dir.join("recipe.toml");
    let recipe = std::fs::read_to_string(&rp).map_err(|e| Error::io(&rp, e))?;
    Ok((state, recipe))
}

/// Keep the newest `keep_last` checkpoints (0 keeps all) and remove stale temporaries.
pub fn prune(out_dir: &Path, keep_last: usize) -> Result<()> {
    if keep_last > 0 {
        for (_, dir) in list(out_dir).into_iter().skip(keep_last) {
            std::fs::remove_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        }
    }
    Ok(())
}

/// Remove half-written `.tmp-*` folders a crash left behind.
pub fn clean_temporaries(out_dir: &Path) {
    for e in std::fs::read_dir(root(out_dir)).into_iter().flatten().flatten() {
        if e.file_name().to_string_lossy().starts_with(".tmp-") {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
    // A final adapter, merged model or GGUF adapter a crash left half-written
    // (`train::save_adapter_dir`, `fsutil::write_with`), unless a `finetune export` is staging
    // it right now.
    for out in ["adapter", "merged", "adapter.gguf"].map(|o| out_dir.join(o)) {
        if !crate::output::StagingLock::held(&out) {
            let tmp = crate::output::beside(&out, "tmp");
            let _ = if tmp.is_dir() { std::fs::remove_dir_all(&tmp) } else { std::fs::remove_file(&tmp) };
        }
    }
}

/// Keys that may change between a checkpoint and its resume (with a warning).
/// Besides these, `checkpoint.*`, `export.*` (what is written after training) and `dist.*`
/// (checked separately) may change. `data.eval` only chooses what is evaluated; checkpointing
/// only what is recomputed (the same bits either way), except where it splits micro-batches
/// into passes (`TrainState::pass_rows`: another split is said on resume not to match bit
/// for bit).
const MAY_CHANGE: &[&str] = &[
    "train.max_steps",
    "train.warmup_steps",
    "train.log_every",
    "train.eval_every",
    "train.activation_checkpointing",
    "train.activation_memory_mb",
    "data.eval",
    "output.dir",
    "output.tensorboard",
];

/// Compare the recipe a checkpoint was written with against the current one. Returns the
/// warnings for allowed changes, or the first key that may not change and why. `place`
/// gives where a path of the recipe leads (canonical: symbolic links and `..` resolved), or
/// `None` (not a local path): a path spelt another way (relative then absolute, through a
/// link) that leads to the same place is no change.
pub fn check_recipe_change(saved: &str, current: &str, place: &dyn Fn(&str) -> Option<std::path::PathBuf>, written: &dyn Fn(&str) -> bool) -> std::result::Result<Vec<String>, (String, String)> {
    // Both through the typed recipe first, so keys added since the checkpoint was written
    // compare as their defaults instead of as changes.
    let normal = |s: &str| {
        toml::from_str::<crate::recipe::Recipe>(s)
            .ok()
            .map(|mut r| {
                // Before transformers' names were enforced, "constant" with warmup meant what
                // "constant_with_warmup" means now: the same schedule, not a change.
                if r.train.lr_scheduler == "constant" && r.train.warmup_steps > 0 {
                    r.train.lr_scheduler = "constant_with_warmup".into();
                }
                // Targets are a set: compare them in one order.
                if let Some(t) = &mut r.lora.targets {
                    *t = crate::lora::ALL_TARGETS.iter().filter(|m| t.iter().any(|x| x == *m)).map(|s| s.to_string()).collect();
                }
                r
            })
            .and_then(|r| toml::to_string(&r).ok())
            .unwrap_or_else(|| s.to_string())
    };
    let (saved, current) = (normal(saved), normal(current));
    let parse = |s: &str| toml::from_str::<toml::Table>(s).map_err(|e| ("(resume)".to_string(), format!("saved recipe unreadable: {e}")));
    let (a, b) = (parse(&saved)?, parse(&current)?);
    let mut keys = std::collections::BTreeSet::new();
    for t in [&a, &b] {
        for (sec, v) in t {
            if let Some(tab) = v.as_table() {
                for k in tab.keys() {
                    keys.insert(format!("{sec}.{k}"));
                }
            }
        }
    }
    let get = |t: &toml::Table, dotted: &str| {
        let (s, k) = dotted.split_once('.').unwrap_or((dotted, ""));
        t.get(s).and_then(|v| v.get(k)).cloned()
    };
    let mut warnings = Vec::new();
    // Every refused change, so one rerun can fix them all.
    let mut refused: Vec<(String, String)> = Vec::new();
    // Paths, or lists of them, that lead to the same places.
    let same_places = |old: &toml::Value, new: &toml::Value| {
        let places = |v: &toml::Value| -> Option<Vec<std::path::PathBuf>> {
            match v {
                toml::Value::String(s) => Some(vec![place(s)?]),
                toml::Value::Array(a) => a.iter().map(|v| v.as_str().and_then(place)).collect(),
                _ => None,
            }
        };
        places(old).is_some_and(|o| places(new).is_some_and(|n| o == n))
    };
    for key in keys {
        let (old, new) = (get(&a, &key), get(&b, &key));
        if old == new {
            continue;
        }
        let path_key = crate::recipe::PATH_KEYS.iter().any(|(s, k)| key.split_once('.') == Some((*s, *k)));
        if path_key && old.as_ref().zip(new.as_ref()).is_some_and(|(o, n)| same_places(o, n)) {
            continue;
        }
        let show = |v: &Option<toml::Value>| v.as_ref().map_or("(unset)".to_string(), |v| v.to_string());
        // Checkpoints are consolidated, so the world size and how a step's examples are split
        // may change; the trainer checks that the examples per step (the global batch) stay
        // equal (`train::run_folder::check_same_run`).
        let layout_change = key.starts_with("dist.") || key == "train.grad_accum_steps" || key == "train.micro_batch_size";
        let after_training = key.starts_with("checkpoint.") || key.starts_with("export.");
        // Checkpoints from before commits were recorded say nothing about the base's commit:
        // continue, but say which one this run uses. A recorded commit that differs is an error.
        let unrecorded_commit = key == "model.revision" && old.is_none();
        // Likewise a hub dataset (`org/name@commit`) recorded since.
        let unrecorded_data_commit = key == "data.train" && matches!((&old, &new), (Some(o), Some(n)) if pinned_since(o, n));
        if after_training || MAY_CHANGE.contains(&key.as_str()) || layout_change || unrecorded_commit || unrecorded_data_commit {
            warnings.push(format!("`{key}` changed since the checkpoint: {} -> {}", show(&old), show(&new)));
        } else {
            // A key the recipe does not set (its default moved in a newer finetune, or a
            // key or --set was dropped): say how to set the value that continues the run.
            let unset = match (&old, written(&key), key.split_once('.')) {
                (Some(o), false, Some((sec, k))) => format!("; the recipe does not set it: add `{k} = {o}` under [{sec}], or --set {key}={o}"),
                _ => String::new(),
            };
            refused.push((key, format!("{} -> {}{unset}", show(&old), show(&new))));
        }
    }
    let Some(((key, change), others)) = refused.split_first() else { return Ok(warnings) };
    let also = match others {
        [] => String::new(),
        _ => format!(", and so did {}", others.iter().map(|(k, c)| format!("`{k}` ({c})")).collect::<Vec<_>>().join(", ")),
    };
    let msg = format!(
        "changed since the checkpoint ({change}){also}; resuming would not continue the same run. \
         Restore {}, or start over with checkpoint.resume = \"never\" or a new output.dir",
        if others.is_empty() { "it" } else { "them" }
    );
    Err((key.clone(), msg))
}

/// Whether data entries `new` are `old` with hub commits recorded where `old` named none,
/// entry by entry (`org/name` or `org/name@main` -> `org/name@<commit>`).
fn pinned_since(old: &toml::Value, new: &toml::Value) -> bool {
    match (old, new) {
        (toml::Value::String(o), toml::Value::String(n)) => o == n || (!has_pin(o) && unpinned(o) == unpinned(n)),
        (toml::Value::Array(a), toml::Value::Array(b)) => a.len() == b.len() && a.iter().zip(b).all(|(o, n)| pinned_since(o, n)),
        _ => false,
    }
}

/// A data entry without its `@revision` (`org/name@rev:split` -> `org/name:split`).
fn unpinned(s: &str) -> String {
    crate::hub::DataEntry::parse(s).at(None)
}

/// Whether a data entry names a hub commit (`@<commit>`).
fn has_pin(s: &str) -> bool {
    crate::hub::DataEntry::parse(s).revision.is_some_and(crate::hub::is_commit)
}

#[cfg(test)]
mod tests {
    use super::check_recipe_change;

    const OLD: &str = r#"
[model]
path = "m"
[lora]
rank = 4
alpha = 8
[data]
train = "d"
[train]
max_steps = 4
lr = 0.001
[output]
dir = "out"
"#;

    #[test]
    fn keys_added_since_the_checkpoint_compare_as_their_defaults() {
        // A checkpoint written before [dist] existed resumes under a recipe that spells the
        // defaults out.
        let now = format!("{OLD}[dist]\nzero_stage = 0\noffload_optimizer = \"cpu\"\nprefetch_layers = 1\n");
        assert_eq!(check_recipe_change(OLD, &now, &|_| None, &|_| true), Ok(vec![]));
    }

    #[test]
    fn every_refused_change_is_named_at_once() {
        // A run checkpointed before the defaults became shuffle = true and "linear" names both,
        // so one rerun restores them.
        let old = OLD.replace("train = \"d\"", "train = \"d\"\nshuffle = false").replace("lr = 0.001", "lr = 0.001\nlr_scheduler = \"constant\"");
        let (key, msg) = check_recipe_change(&old, OLD, &|_| None, &|_| true).unwrap_err();
        assert_eq!(key, "data.shuffle");
        assert!(msg.contains("(false -> true), and so did `train.lr_scheduler` (\"constant\" -> \"linear\")") && msg.contains("Restore them"), "{msg}");
        // A key the recipe does not set (its default moved): the message says how to set it.
        let (_, msg) = check_recipe_change(&old, OLD, &|_| None, &|k| k != "data.shuffle").unwrap_err();
        assert!(msg.contains("(false -> true; the recipe does not set it: add `shuffle = false` under [data], or --set data.shuffle=false)"), "{msg}");
    }

    #[test]
    fn a_checkpoint_from_before_constant_with_warmup_resumes_under_that_name() {
        let old = OLD.replace("lr = 0.001", "lr = 0.001\nlr_scheduler = \"constant\"\nwarmup_steps = 2");
        let now = old.replace("\"constant\"", "\"constant_with_warmup\"");
        assert_eq!(check_recipe_change(&old, &now, &|_| None, &|_| true), Ok(vec![]));
        let cosine = old.replace("\"constant\"", "\"cosine\"");
        assert!(check_recipe_change(&old, &cosine, &|_| None, &|_| true).unwrap_err().0.contains("lr_scheduler"));
    }

    #[test]
    fn a_base_commit_may_be_recorded_late_but_never_change() {
        let pinned = OLD.replace("path = \"m\"", "path = \"m\"\nrevision = \"aaaa\"");
        let w = check_recipe_change(OLD, &pinned, &|_| None, &|_| true).unwrap();
        assert!(w.iter().any(|w| w.contains("model.revision")), "{w:?}");
        let moved = OLD.replace("path = \"m\"", "path = \"m\"\nrevision = \"bbbb\"");
        assert!(check_recipe_change(&pinned, &moved, &|_| None, &|_| true).unwrap_err().0.contains("model.revision"));
    }

    #[test]
    fn a_hub_dataset_commit_may_be_recorded_late_but_never_change() {
        let hub = OLD.replace("train = \"d\"", "train = \"org/d:train_sft\"");
        let pinned = hub.replace("org/d", &format!("org/d@{}", "a".repeat(40)));
        let w = check_recipe_change(&hub, &pinned, &|_| None, &|_| true).unwrap();
        assert!(w.iter().any(|w| w.contains("data.train")), "{w:?}");
        let moved = hub.replace("org/d", &format!("org/d@{}", "b".repeat(40)));
        assert!(check_recipe_change(&pinned, &moved, &|_| None, &|_| true).unwrap_err().0.contains("data.train"));
        let other = hub.replace("org/d", &format!("org/e@{}", "a".repeat(40)));
        assert!(check_recipe_change(&hub, &other, &|_| None, &|_| true).unwrap_err().0.contains("data.train"));
        // In a list, entry by entry: one pinned before, one pinned now.
        let (a, b) = ("a".repeat(40), "b".repeat(40));
        let list = |x: &str, y: &str| OLD.replace("train = \"d\"", &format!("train = [\"org/x{x}\", \"org/y{y}\"]"));
        let w = check_recipe_change(&list(&format!("@{a}"), ""), &list(&format!("@{a}"), &format!("@{b}")), &|_| None, &|_| true).unwrap();
        assert!(w.iter().any(|w| w.contains("data.train")), "{w:?}");
        assert!(check_recipe_change(&list(&format!("@{a}"), ""), &list(&format!("@{b}"), &format!("@{b}")), &|_| None, &|_| true).unwrap_err().0.contains("data.train"));
    }

    #[test]
    fn the_world_size_may_change_but_the_model_may_not() {
        let more = format!("{OLD}[dist]\nworld_size = 4\nzero_stage = 3\n");
        let w = check_recipe_change(OLD, &more, &|_| None, &|_| true).unwrap();
        assert!(w.iter().any(|w| w.contains("dist.world_size")), "{w:?}");
        let other = OLD.replace("rank = 4", "rank = 8");
        assert!(check_recipe_change(OLD, &other, &|_| None, &|_| true).unwrap_err().0.contains("lora.rank"));
    }
}
