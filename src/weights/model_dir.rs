//! Finding a checkpoint: `model.path` as a local folder, a `.gguf` file (its HF description
//! derived once into finetune's cache) or a hub repo id in the cache (`ModelDir`), its
//! config.json and the dtypes its safetensors headers store.
use super::SafetensorsFiles;
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// `<models>/<folder>/config.json` for `repo` when `<models>/index.json` maps the repo id
/// (compared case-insensitively, as the hub does) to a folder.
fn shipped_config(models: &Path, repo: &str) -> Option<PathBuf> {
    let index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(models.join("index.json")).ok()?).ok()?;
    let folder = index.as_object()?.iter().find(|(k, _)| k.eq_ignore_ascii_case(repo))?.1.as_str()?;
    let path = models.join(folder).join("config.json");
    (!folder.contains("..") && path.is_file()).then_some(path)
}

/// An index's `weight_map`: tensor name -> shard file name, each a file beside the index.
pub fn read_index(index: &Path) -> Result<std::collections::BTreeMap<String, String>> {
    let bad = |msg: String| Error::Config { path: index.to_path_buf(), msg };
    let text = std::fs::read_to_string(index).map_err(|e| Error::io(index, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| bad("expected a `weight_map` object".into()))?;
    let mut out = std::collections::BTreeMap::new();
    for (name, f) in map {
        let f = f.as_str().ok_or_else(|| bad(format!("weight_map[\"{name}\"] must be a file name")))?;
        // A shard is a file beside the index, never a path out of the model folder.
        if f.is_empty() || f.contains('/') || f.contains('\\') || f == ".." {
            return Err(bad(format!("weight_map[\"{name}\"] = \"{f}\" is not a file name in this folder")));
        }
        out.insert(name.clone(), f.to_string());
    }
    if out.is_empty() {
        return Err(bad("`weight_map` lists no tensors".into()));
    }
    Ok(out)
}

/// A model folder on disk: config.json plus safetensors weights (and maybe a tokenizer).
#[derive(Clone, Debug)]
pub struct ModelDir {
    pub dir: PathBuf,
    /// What the user wrote (repo id or path), for adapter_config's base_model_name_or_path.
    pub name: String,
    /// The commit a hub repo id resolved to (its snapshot folder's name).
    pub commit: Option<String>,
    /// A GGUF base: the file holding the weights (then `dir` holds only the HF description
    /// derived from its header, see `gguf::describe_in_cache`).
    pub gguf: Option<PathBuf>,
}

impl ModelDir {
    /// Resolve a model named on the command line: a local folder, or a repo id at its
    /// `main` revision (see [`ModelDir::resolve_at`]).
    pub fn resolve(path: &str, recipe_dir: &Path) -> Result<Self> {
        Self::resolve_at(path, None, recipe_dir, crate::hub::Want::Model)
    }

    /// Resolve a recipe's `model.path` / `model.revision` for training.
    pub fn of_recipe(loaded: &crate::recipe::LoadedRecipe) -> Result<Self> {
        let m = &loaded.recipe.model;
        Self::resolve_at(&m.path, m.revision.as_deref(), &loaded.dir, crate::hub::Want::Model)
    }

    /// The base a finished run trained on: `path` (the recipe's model.path, or the base its
    /// adapter names) at the hub commit the run recorded in its recipe.resolved.toml, so a
    /// branch that moved since (another job's download) is not what gets merged into.
    pub fn of_run(run: &Path, path: &str, recipe_dir: &Path) -> Result<Self> {
        // Unreadable, it is an error: read as absent it would merge into the branch's head.
        let resolved = crate::runlog::read_resolved_recipe(run)?;
        let commit = resolved.as_ref().and_then(|t| t.get("model")?.get("revision")?.as_str().map(String::from));
        let repo = path.split_once('@').map_or(path, |(repo, _)| repo);
        match commit.filter(|_| !recipe_dir.join(path).exists() && crate::hub::looks_like_repo(repo)) {
            Some(c) => Self::resolve_at(repo, Some(&c), recipe_dir, crate::hub::Want::Model),
            None => Self::resolve_at(path, None, recipe_dir, crate::hub::Want::Model),
        }
    }

    /// Resolve `model.path`: a local folder (relative to the recipe folder), or a repo id
    /// (`org/name`) in the hub cache, downloaded there first when the cache lacks what `want`
    /// needs (see `hub`).
    pub fn resolve_at(path: &str, revision: Option<&str>, recipe_dir: &Path, want: crate::hub::Want) -> Result<Self> {
        let local = recipe_dir.join(path);
        // `org/name@rev` names a revision as data.train's hub ids do (a local path with an `@`
        // in it stays a path).
        if let Some((repo, rev)) = path.split_once('@').filter(|(repo, _)| !local.exists() && crate::hub::looks_like_repo(repo)) {
            if let Some(other) = revision.filter(|r| *r != rev) {
                return Err(Error::Model { what: path.into(), msg: format!("names revision `{rev}`, and model.revision says `{other}`: give it once") });
            }
            return Self::resolve_at(repo, Some(rev), recipe_dir, want);
        }
        if local.is_dir() {
            let abs = local.canonicalize().map_err(|e| Error::io(&local, e))?;
            if !abs.join("config.json").exists() && abs.join("adapter_config.json").is_file() {
                let base = crate::lora::AdapterConfig::read(&abs).ok().and_then(|c| c.base_model).map_or(String::new(), |b| format!(" ({b}, as adapter_config.json names it)"));
                return Err(Error::model(path, format!("{} holds a PEFT adapter (adapter_config.json), not a model: pass it as the adapter, and its base model{base} as the model", abs.display())));
            }
            return Ok(ModelDir { name: abs.display().to_string(), dir: abs, commit: None, gguf: None });
        }
        if local.is_file() && is_gguf_file(&local) {
            let abs = local.canonicalize().map_err(|e| Error::io(&local, e))?;
            let dir = crate::gguf::describe_in_cache(&abs)?;
            return Ok(ModelDir { name: abs.display().to_string(), dir, commit: None, gguf: Some(abs) });
        }
        if local.exists() && !local.is_dir() {
            return Err(Error::model(path, format!("{} is a file, not a model: a model is a folder (config.json and safetensors), a GGUF file, or a hub repo id", local.display())));
        }
        if crate::hub::looks_like_repo(path) {
            let dir = crate::hub::Hub::from_env()?.model(path, revision, want).map_err(|e| crate::hub::not_local_either(e, &local))?;
            let commit = dir.file_name().map(|c| c.to_string_lossy().to_string());
            return Ok(ModelDir { dir, name: path.to_string(), commit, gguf: None });
        }
        // (The caller's hint names the recipe key or the flag that gave the path.)
        let what = if path.to_ascii_lowercase().ends_with(".gguf") { "file" } else { "folder" };
        Err(Error::model(path, format!("{what} {} does not exist", local.display())))
    }

    /// The config a plan needs: a local folder's or the cache's; else the copy shipped for
    /// the recipes' models (`<recipe folder>/models/<repo name, lower case>/config.json`), so
    /// `finetune plan` works on a fresh machine with no network; else config.json alone from
    /// the hub. A local folder's config is read as training reads it ([`ModelDir::config`]: a tied
    /// config over a different stored head plans the head it trains on).
    pub fn config_for_plan(loaded: &crate::recipe::LoadedRecipe) -> Result<crate::config::ModelConfig> {
        let m = &loaded.recipe.model;
        if loaded.dir.join(&m.path).exists() || !crate::hub::looks_like_repo(&m.path) {
            return Self::resolve_at(&m.path, m.revision.as_deref(), &loaded.dir, crate::hub::Want::Config)?.config();
        }
        crate::config::ModelConfig::from_file(&Self::hub_config_for_plan(loaded)?)
    }

    /// [`ModelDir::config_for_plan`]'s config.json for a hub repo id.
    fn hub_config_for_plan(loaded: &crate::recipe::LoadedRecipe) -> Result<PathBuf> {
        let m = &loaded.recipe.model;
        let hub = crate::hub::Hub::from_env()?;
        if let Some(cached) = hub.cached_config(&m.path, m.revision.as_deref()) {
            return Ok(cached);
        }
        // The shipped copies are of each repo's main branch, listed by exact repo id.
        if let Some(shipped) = m.revision.is_none().then(|| shipped_config(&loaded.dir.join("models"), &m.path)).flatten() {
            crate::note!("plan: {} is not in the hub cache; using the config shipped at {}", m.path, shipped.display());
            return Ok(shipped);
        }
        Ok(hub.model(&m.path, m.revision.as_deref(), crate::hub::Want::Config)?.join("config.json"))
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir.join("config.json")
    }

    /// config.json as the weights beside it make it: a tied config whose checkpoint also
    /// stores an `lm_head.weight` that differs from the embedding is untied, as transformers
    /// (5.x) loads it: it keeps the file's head and warns, so the embedding as head would give
    /// other logits than every tool the user compares with. An equal stored head keeps the
    /// model tied (one table held). Weights that cannot be opened leave the config as it is;
    /// loading them names what is wrong.
    pub fn config(&self) -> Result<crate::config::ModelConfig> {
        let mut cfg = crate::config::ModelConfig::from_file(&self.config_path())?;
        let (embed, head) = ("model.embed_tokens.weight", "lm_head.weight");
        if !cfg.tie_word_embeddings || self.gguf.is_some() {
            return Ok(cfg); // a GGUF's description is tied exactly when it has no output.weight
        }
        let Ok(files) = self.open_weights() else { return Ok(cfg) };
        if files.contains(head) && files.contains(embed) && !files.tables_equal(embed, head)? {
            crate::note!(
                "{}: tie_word_embeddings is true, but {} stores an lm_head.weight that differs from model.embed_tokens.weight; \
                 using the stored head, as transformers does (set tie_word_embeddings to false in config.json to say so)",
                self.config_path().display(),
                files.file_of(head).map_or_else(|| self.dir.display().to_string(), |f| f.display().to_string()),
            );
            cfg.tie_word_embeddings = false;
        }
        Ok(cfg)
    }

    /// The weights, each tensor read from the file the index names for it.
    pub fn open_weights(&self) -> Result<SafetensorsFiles> {
        if let Some(g) = &self.gguf {
            return Err(Error::model(g.display().to_string(), "is a GGUF file; this command reads safetensors weights (run `finetune import --gguf` first)"));
        }
        match self.index()? {
            Some((index, map)) => SafetensorsFiles::open_indexed(&index, &map),
            None => SafetensorsFiles::open(&[self.single_file()?]),
        }
    }

    fn single_file(&self) -> Result<PathBuf> {
        let single = self.dir.join("model.safetensors");
        if single.is_file() {
            return Ok(single);
        }
        Err(Error::model(
            self.dir.display().to_string(),
            "no model.safetensors or model.safetensors.index.json (PyTorch .bin checkpoints are not read; \
             convert them to safetensors)",
        ))
    }

    /// `model.safetensors.index.json` when there is one: its path and the tensor -> shard map.
    /// None too where `model.safetensors` is there as well: transformers loads the single file
    /// then (`_get_resolved_checkpoint_files` looks for it first), so that is the base an
    /// adapter trained here must have been trained on.
    fn index(&self) -> Result<Option<(PathBuf, std::collections::BTreeMap<String, PathBuf>)>> {
        let index = self.dir.join("model.safetensors.index.json");
        if !index.is_file() {
            return Ok(None);
        }
        if self.dir.join("model.safetensors").is_file() {
            static NOTED: std::sync::Once = std::sync::Once::new();
            NOTED.call_once(|| {
                crate::note!(
                    "{}: both model.safetensors and model.safetensors.index.json are here; reading model.safetensors, \
                     as transformers does (remove the one that is not the model)",
                    self.dir.display()
                )
            });
            return Ok(None);
        }
        let map = read_index(&index)?.into_iter().map(|(name, f)| (name, self.dir.join(f))).collect();
        Ok(Some((index, map)))
    }
}

/// Whether every tensor of the checkpoint `path` names is stored in bf16 (a bitsandbytes
/// checkpoint's packed u8 weights are not), as
/// far as the headers tell without a download: a local folder, or a hub model the cache
/// already holds. `model.dtype = "auto"` keeps such a base bf16 on a CPU without a bf16 unit,
/// where the frozen matmuls widen it to f32 (`ops::widen`) and nothing is rounded. Anything
/// unknown (not yet downloaded, a GGUF file, an unreadable header) answers false: f32, which
/// is exact for every stored dtype.
pub fn stored_all_bf16(path: &str, revision: Option<&str>, recipe_dir: &Path) -> bool {
    stored_dtypes(path, revision, recipe_dir, &|_| true).is_some_and(|d| d.len() == 1 && d.contains(&safetensors::Dtype::BF16))
}

/// The dtypes the checkpoint `path` names stores the tensors `which` keeps in (and, for a
/// bitsandbytes checkpoint, the dtype its 4-bit weights were quantised from), as far as
/// [`stored_all_bf16`] can tell; `None` where it cannot.
pub fn stored_dtypes(path: &str, revision: Option<&str>, recipe_dir: &Path, which: &dyn Fn(&str) -> bool) -> Option<std::collections::BTreeSet<safetensors::Dtype>> {
    let local = recipe_dir.join(path);
    let dir = if local.is_dir() {
        Some(local)
    } else if crate::hub::looks_like_repo(path) {
        crate::hub::Hub::from_env().ok().and_then(|h| h.cached_model(path, revision))
    } else {
        None
    };
    let files = (ModelDir { name: path.to_string(), dir: dir?, commit: None, gguf: None }).open_weights().ok()?;
    let mut dtypes: std::collections::BTreeSet<safetensors::Dtype> = files.names().filter(|n| which(n)).map(|n| files.raw_view(n).ok().map(|v| v.dtype())).collect::<Option<_>>()?;
    // A bitsandbytes checkpoint's 4-bit weights (packed u8) dequantise to the dtype they
    // were quantised from.
    if super::bnb::is_bnb(&files) {
        let original = super::bnb::BnbReader { files, storage: candle_core::DType::F32 }.original_dtype().ok()?;
        dtypes.extend(super::safetensors_dtype(original));
    }
    Some(dtypes).filter(|d| !d.is_empty())
}

/// Whether the file at `p` is a GGUF model: by its `.gguf` extension or, named otherwise, by
/// its magic bytes.
pub fn is_gguf_file(p: &Path) -> bool {
    let magic = || std::fs::File::open(p).and_then(|mut f| {
        let mut m = [0u8; 4];
        std::io::Read::read_exact(&mut f, &mut m).map(|_| m)
    });
    p.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) || magic().is_ok_and(|m| &m == b"GGUF")
}
