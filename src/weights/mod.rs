//! Frozen base weights: finding a checkpoint, reading safetensors (one file or sharded),
//! and the provider interface model code reads them through.
//!
//! Invariant: frozen weights are plain tensors, never `Var`s, so autograd never makes them a
//! leaf it owes a gradient to. Model code asks a [`WeightSource`] for tensors by HF name; the
//! resident source here holds the whole base, and the ZeRO-3 source (a later layer) gathers
//! shards just in time. Model code cannot tell the difference.

use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub mod bnb;
pub mod quantized;
mod unread;
pub mod window;

pub use window::{Held, Unit, Window};
pub use unread::{note_unread, unread, Asked};

/// Where frozen tensors come from. `get` returns the tensor named `name` (full HF key) with the
/// given shape in the compute dtype, or an error naming the tensor and the files searched.
pub trait WeightSource: Send + Sync {
    /// The tensor in the storage dtype (shape checked).
    fn get_stored(&self, name: &str, shape: &[usize]) -> Result<Tensor>;
    /// What `get` hands out: f32 on CPU, the storage dtype on GPUs.
    fn compute_dtype(&self) -> DType;
    /// Whether a tensor exists (for optional tensors such as a tied lm_head).
    fn contains(&self, name: &str) -> bool;
    /// Where `get` puts tensors (asking for a tensor just to learn this would convert it,
    /// or under ZeRO-3 gather it).
    fn device(&self) -> &Device;
    /// The dtype of frozen matmul operands (`get_matmul`): the compute dtype, unless the
    /// source was told to hand bf16 weights to `ops::frozen_linear` (a bf16 base on a CPU with a bf16 unit).
    fn matmul_dtype(&self) -> DType {
        self.compute_dtype()
    }

    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        Ok(self.get_stored(name, shape)?.to_dtype(self.compute_dtype())?)
    }
    /// A projection weight as the frozen matmul takes it.
    fn get_matmul(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        Ok(self.get_stored(name, shape)?.to_dtype(self.matmul_dtype())?)
    }
    /// Check that `name` exists with `shape` (`Model::load`), materialising it only where
    /// the source must (a resident base reads it; ZeRO-3 joins the gather every rank makes).
    fn check(&self, name: &str, shape: &[usize]) -> Result<()> {
        self.get_stored(name, shape).map(drop)
    }
    /// Check a table the model reads only by rows through [`embedding`](Self::embedding)
    /// (an untied token embedding). A resident base on the host leaves it in its file (see
    /// [`RowTable`]).
    fn check_rows(&self, name: &str, shape: &[usize]) -> Result<()> {
        self.check(name, shape)
    }
    /// Check a table the model reads only in runs of rows through
    /// [`get_matmul_rows`](Self::get_matmul_rows) (an untied LM head, which the loss reads in
    /// chunks). A resident base told to (`ResidentWeights::with_head_in_file`) leaves it in its
    /// file.
    fn check_head(&self, name: &str, shape: &[usize]) -> Result<()> {
        self.check(name, shape)
    }
    /// Bytes of the base (in the storage dtype) left in files by `check_rows` and
    /// `check_head`, not held.
    fn bytes_in_files(&self) -> usize {
        0
    }
    /// Rows start..start+len of `name` [V, H] as the frozen matmul takes them: the LM head,
    /// which the loss reads in chunks (`ops::loss`). Only those rows are converted.
    fn get_matmul_rows(&self, name: &str, shape: &[usize], start: usize, len: usize) -> Result<Tensor> {
        Ok(self.get_stored(name, shape)?.narrow(0, start, len)?.to_dtype(self.matmul_dtype())?)
    }
    /// Rows `ids` [N] (u32) of the table `name` [V, H], as [N, H] in the compute dtype. Only
    /// the picked rows are converted: converting the whole table first cost a 113 MB copy
    /// per step (135M model).
    fn embedding(&self, name: &str, shape: &[usize], ids: &Tensor) -> Result<Tensor> {
        Ok(self.get_stored(name, shape)?.index_select(ids, 0)?.to_dtype(self.compute_dtype())?)
    }
    /// Called once the model has loaded (`Model::load` asks for every tensor it uses): drop
    /// what only loading needed (the memory map). Later requests for a tensor not asked for
    /// then are errors. Sources that read on every request keep everything.
    fn seal(&self) {}
}

/// A view of a [`WeightSource`] under a name prefix, like candle's `VarBuilder::pp`.
#[derive(Clone)]
pub struct Frozen<'a> {
    src: &'a dyn WeightSource,
    prefix: String,
}

impl<'a> Frozen<'a> {
    pub fn new(src: &'a dyn WeightSource) -> Self {
        Frozen { src, prefix: String::new() }
    }
    pub fn pp(&self, name: impl AsRef<str>) -> Self {
        let name = name.as_ref();
        let prefix = if self.prefix.is_empty() { name.to_string() } else { format!("{}.{name}", self.prefix) };
        Frozen { src: self.src, prefix }
    }
    fn full(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }
    pub fn get(&self, shape: &[usize], name: &str) -> Result<Tensor> {
        self.src.get(&self.full(name), shape)
    }
    /// A projection weight for `ops::frozen_linear` (see [`WeightSource::get_matmul`]).
    pub fn get_matmul(&self, shape: &[usize], name: &str) -> Result<Tensor> {
        self.src.get_matmul(&self.full(name), shape)
    }
    pub fn contains(&self, name: &str) -> bool {
        self.src.contains(&self.full(name))
    }
    /// A small tensor the model reads in f32 whatever the compute dtype (see [`stored_dtype`]).
    pub fn get_f32(&self, shape: &[usize], name: &str) -> Result<Tensor> {
        Ok(self.src.get_stored(&self.full(name), shape)?.to_dtype(DType::F32)?)
    }
}

/// The tables a resident base on the host would leave in their file (an untied embedding
/// and LM head) that the recipe's model files hold in a form read whole instead (FP8, f64):
/// those are copied at load, and `finetune plan` counts them so. Empty where the plan does not
/// look at weights (config.json alone, a GGUF file, a hub repo id).
pub fn tables_copied(loaded: &crate::recipe::LoadedRecipe) -> Vec<String> {
    let m = &loaded.recipe.model;
    let files = loaded.dir.join(&m.path).is_dir().then(|| ModelDir::resolve(&m.path, &loaded.dir).and_then(|d| d.open_weights()).ok()).flatten();
    let Some(files) = files else { return Vec::new() };
    let tables = ["model.embed_tokens.weight", "lm_head.weight"];
    tables.into_iter().filter(|n| files.file_of(n).is_some() && !files.rows_readable(n)).map(String::from).collect()
}

/// Bytes of the whole frozen base held in `storage` (each tensor in its [`stored_dtype`]).
pub fn frozen_bytes(cfg: &crate::config::ModelConfig, storage: DType) -> usize {
    cfg.frozen_tensors().iter().map(|(n, s)| s.iter().product::<usize>() * stored_dtype(n, storage).size_in_bytes()).sum()
}

/// The dtype a frozen tensor is kept in: the run's storage dtype, except the MoE router
/// (`mlp.gate.weight`) and DeepSeek-V3's router bias, which transformers keeps in f32 in a
/// 16-bit model (`_keep_in_fp32_modules_strict`): expert scores differ by less than bf16's
/// rounding of them, so rounding would change the choice. (The router runs in f32 whatever
/// the base dtype: held in bf16, its weights would be bf16 values.)
pub fn stored_dtype(name: &str, storage: DType) -> DType {
    if name.ends_with("e_score_correction_bias") || name.ends_with("mlp.gate.weight") {
        DType::F32
    } else {
        storage
    }
}

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

/// The dtypes the checkpoint `path` names stores the tensors `which` keeps in, as far as
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
    let dtypes: Option<std::collections::BTreeSet<safetensors::Dtype>> = files.names().filter(|n| which(n)).map(|n| files.raw_view(n).ok().map(|v| v.dtype())).collect();
    dtypes.filter(|d| !d.is_empty())
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

/// Parse a dtype name from the recipe.
pub fn parse_dtype(s: &str) -> DType {
    match s {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        _ => DType::F32,
    }
}

/// Memory-mapped safetensors files with a name -> file routing table.
pub struct SafetensorsFiles {
    files: Vec<(PathBuf, candle_core::safetensors::MmapedSafetensors)>,
    routing: HashMap<String, usize>,
}

impl SafetensorsFiles {
    /// Open files that no index describes: a tensor stored in two of them is an error, since
    /// nothing says which copy is meant.
    pub fn open(paths: &[PathBuf]) -> Result<Self> {
        let files = Self::map_files(paths)?;
        let mut routing: HashMap<String, usize> = HashMap::new();
        for (i, (p, st)) in files.iter().enumerate() {
            for (name, _) in st.tensors() {
                if let Some(&j) = routing.get(&name) {
                    return Err(Error::Safetensors {
                        file: p.clone(),
                        msg: format!("tensor `{name}` is also in {}, and no model.safetensors.index.json says which copy to use", files[j].0.display()),
                    });
                }
                routing.insert(name, i);
            }
        }
        Ok(SafetensorsFiles { files, routing })
    }

    /// Open the shards an index names, routing each tensor to the shard the index gives it
    /// (a stale copy in another shard is never read). Tensors the index does not list are
    /// ignored, unless one is stored in two shards: then nothing settles which copy is meant.
    pub fn open_indexed(index: &Path, map: &std::collections::BTreeMap<String, PathBuf>) -> Result<Self> {
        let mut paths: Vec<PathBuf> = Vec::new();
        for f in map.values() {
            if !paths.contains(f) {
                paths.push(f.clone());
            }
        }
        // In file-name order (model-00001-of-00004, ...), not in the order of the tensors'
        // names: what reads files in turn (a merge writing its shards) keeps the base's order.
        paths.sort();
        let files = Self::map_files(&paths)?;
        let mut routing = HashMap::new();
        for (name, f) in map {
            let i = paths.iter().position(|p| p == f).unwrap_or_default();
            if files[i].1.get(name).is_err() {
                return Err(Error::Safetensors {
                    file: f.clone(),
                    msg: format!("{} says tensor `{name}` is in this shard, but it is not", index.display()),
                });
            }
            routing.insert(name.clone(), i);
        }
        let mut seen: HashMap<String, usize> = HashMap::new();
        for (i, (p, st)) in files.iter().enumerate() {
            for (name, _) in st.tensors() {
                if routing.contains_key(&name) {
                    continue;
                }
                if let Some(&j) = seen.get(&name) {
                    return Err(Error::Safetensors {
                        file: p.clone(),
                        msg: format!("tensor `{name}` is also in {}, and {} does not list it", files[j].0.display(), index.display()),
                    });
                }
                seen.insert(name, i);
            }
        }
        Ok(SafetensorsFiles { files, routing })
    }

    fn map_files(paths: &[PathBuf]) -> Result<Vec<(PathBuf, candle_core::safetensors::MmapedSafetensors)>> {
        let mut files = Vec::new();
        for p in paths {
            if !p.is_file() {
                return Err(Error::io(p, std::io::Error::new(std::io::ErrorKind::NotFound, "weight file not found")));
            }
            // SAFETY: the file is mapped read-only; we never write to it while mapped.
            let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(p) }
                .map_err(|e| Error::Safetensors { file: p.clone(), msg: crate::error::candle_msg(&e) })?;
            files.push((p.clone(), st));
        }
        Ok(files)
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.routing.keys()
    }

    pub fn file_of(&self, name: &str) -> Option<&Path> {
        self.routing.get(name).map(|&i| self.files[i].0.as_path())
    }

    fn file_list(&self) -> String {
        self.files.iter().map(|(p, _)| p.display().to_string()).collect::<Vec<_>>().join(", ")
    }

    /// Shape of a stored tensor without reading its data.
    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        let &i = self.routing.get(name).ok_or_else(|| Error::MissingTensor { name: name.into(), files: self.file_list() })?;
        let view = self.files[i].1.get(name).map_err(|e| Error::Safetensors {
            file: self.files[i].0.clone(),
            msg: crate::error::candle_msg(&e),
        })?;
        Ok(view.shape().to_vec())
    }

    /// The stored tensor as a zero-copy view into the map. Weights are floating point: an
    /// integer or bool tensor where a weight is asked for is an error, never cast and trained on.
    pub fn view(&self, name: &str) -> Result<safetensors::tensor::TensorView<'_>> {
        let view = self.raw_view(name)?;
        use safetensors::Dtype as D;
        if !matches!(view.dtype(), D::F32 | D::BF16 | D::F16 | D::F64) {
            return Err(Error::Safetensors {
                file: self.file_of(name).map(Path::to_path_buf).unwrap_or_default(),
                msg: format!("tensor `{name}` is stored as {:?}; a weight must be f32, bf16 or f16", view.dtype()),
            });
        }
        Ok(view)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.routing.contains_key(name)
    }

    /// Whether tensors `a` and `b` hold the same bytes: same dtype, same shape, same data,
    /// read in chunks of at most 32 MB each through the tables' files (never both whole in
    /// memory). A tensor that cannot be read by rows (FP8, quantized) compares unequal.
    pub fn tables_equal(&self, a: &str, b: &str) -> Result<bool> {
        let (sa, sb) = (self.shape(a)?, self.shape(b)?);
        if sa != sb || sa.len() != 2 {
            return Ok(false);
        }
        let (Some(ta), Some(tb)) = (self.row_table(a, &sa)?, self.row_table(b, &sb)?) else { return Ok(false) };
        if ta.dtype != tb.dtype {
            return Ok(false);
        }
        let chunk = (32 << 20) / (ta.cols * ta.dtype.size_in_bytes()).max(1);
        let mut start = 0;
        while start < ta.rows {
            let len = chunk.max(1).min(ta.rows - start);
            if ta.range_bytes(start, len)? != tb.range_bytes(start, len)? {
                return Ok(false);
            }
            start += len;
        }
        Ok(true)
    }

    /// The stored tensor whatever its dtype (for copying a checkpoint's tensors as they are).
    pub fn raw_view(&self, name: &str) -> Result<safetensors::tensor::TensorView<'_>> {
        let &i = self.routing.get(name).ok_or_else(|| Error::MissingTensor { name: name.into(), files: self.file_list() })?;
        self.files[i].1.get(name).map_err(|e| Error::Safetensors { file: self.files[i].0.clone(), msg: crate::error::candle_msg(&e) })
    }

    /// Tensor names per file, in file order (names sorted within a file).
    pub fn names_by_file(&self) -> Vec<(PathBuf, Vec<String>)> {
        self.files
            .iter()
            .enumerate()
            .map(|(i, (p, _))| {
                let mut names: Vec<String> = self.routing.iter().filter(|(_, &f)| f == i).map(|(n, _)| n.clone()).collect();
                names.sort();
                (p.clone(), names)
            })
            .collect()
    }

    /// Whether `name` can be read a row at a time where it lies (`row_table`): an f32, bf16 or
    /// f16 tensor (an FP8 one is dequantised whole at load).
    pub fn rows_readable(&self, name: &str) -> bool {
        !self.is_fp8(name) && self.raw_view(name).is_ok_and(|v| candle_dtype(v.dtype()).is_some())
    }

    /// Whether `name` is stored as FP8 (e4m3) with DeepSeek-V3's block scales beside it.
    pub fn is_fp8(&self, name: &str) -> bool {
        self.raw_view(name).is_ok_and(|v| v.dtype() == safetensors::Dtype::F8_E4M3)
    }

    /// An FP8 weight dequantised to f32 [rows, cols] on the host: element (i, j) times
    /// `{name without .weight}.weight_scale_inv`[i / 128, j / 128] (DeepSeek-V3's layout,
    /// `weight_block_size = [128, 128]`).
    fn load_fp8(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let rows = shape.first().copied().unwrap_or(0);
        let t = self.load_fp8_rows(name, shape, 0..rows)?;
        Ok(t.reshape(shape)?)
    }

    /// Elements `lo..hi` of an FP8 weight flattened row-major, dequantised to f32 [hi - lo]:
    /// only the rows they span are read (a ZeRO-3 rank's 1/N).
    pub fn load_fp8_flat(&self, name: &str, shape: &[usize], lo: usize, hi: usize) -> Result<Tensor> {
        let cols = shape.get(1).copied().unwrap_or(1).max(1);
        let (r0, r1) = (lo / cols, hi.div_ceil(cols));
        let t = self.load_fp8_rows(name, shape, r0..r1)?;
        Ok(t.narrow(0, lo - r0 * cols, hi - lo)?)
    }

    /// Rows `range` of an FP8 weight [rows, cols], dequantised, flat [len(range) * cols].
    fn load_fp8_rows(&self, name: &str, shape: &[usize], range: std::ops::Range<usize>) -> Result<Tensor> {
        let file = self.file_of(name).map(Path::to_path_buf).unwrap_or_default();
        let bad = |msg: String| Error::Safetensors { file: file.clone(), msg };
        let &[rows, cols] = shape else { return Err(bad(format!("tensor `{name}` is FP8 but not a matrix ({shape:?})"))) };
        let scale_name = format!("{}_scale_inv", name);
        if !self.routing.contains_key(&scale_name) {
            return Err(bad(format!("tensor `{name}` is FP8 (e4m3) but `{scale_name}` (its block scales) is missing")));
        }
        let (br, bc) = (rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK));
        let scale = self.load(&scale_name, &[br, bc], &Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let view = self.raw_view(name)?;
        let data = view.data();
        if data.len() != rows * cols {
            return Err(bad(format!("tensor `{name}`: {} bytes for an FP8 [{rows}, {cols}]", data.len())));
        }
        if range.start > range.end || range.end > rows {
            return Err(bad(format!("tensor `{name}`: rows {range:?} outside [0, {rows})")));
        }
        let mut out = vec![0f32; range.len() * cols];
        let src_rows = data[range.start * cols..range.end * cols].chunks(cols);
        for (i, (row, src)) in (range.start..).zip(out.chunks_mut(cols).zip(src_rows)) {
            let s = &scale[(i / FP8_BLOCK) * bc..][..bc];
            for (j, (o, &b)) in row.iter_mut().zip(src).enumerate() {
                *o = float8::F8E4M3::from_bits(b).to_f32() * s[j / FP8_BLOCK];
            }
        }
        if out.iter().any(|x| !x.is_finite()) {
            return Err(bad(format!("tensor `{name}`: FP8 values or their scales give NaN or inf")));
        }
        let n = out.len();
        Ok(Tensor::from_vec(out, n, &Device::Cpu)?)
    }

    /// Read one tensor (copied out of the map), checking its shape. FP8 weights come back
    /// dequantised to f32.
    pub fn load(&self, name: &str, shape: &[usize], device: &Device) -> Result<Tensor> {
        if self.is_fp8(name) {
            let got = self.shape(name)?;
            if got != shape {
                let file = self.file_of(name).map(|p| p.display().to_string()).unwrap_or_default();
                return Err(Error::Shape { name: name.into(), file, expected: shape.to_vec(), got });
            }
            let t = self.load_fp8(name, shape)?;
            release_pages(self.raw_view(name)?.data());
            return Ok(t.to_device(device)?);
        }
        let got = self.view(name)?.shape().to_vec();
        let &i = self.routing.get(name).ok_or_else(|| Error::MissingTensor { name: name.into(), files: self.file_list() })?;
        let file = &self.files[i].0;
        if got != shape {
            return Err(Error::Shape { name: name.into(), file: file.display().to_string(), expected: shape.to_vec(), got });
        }
        let t = self.files[i].1.load(name, device).map_err(|e| Error::Safetensors { file: file.clone(), msg: crate::error::candle_msg(&e) })?;
        // The tensor is a copy now: let the map's pages go, or a resident base is held twice
        // (the copy and the mapped file pages both count in the process's memory).
        release_pages(self.raw_view(name)?.data());
        Ok(t)
    }
}

/// A 2-D table whose rows are read from its file when asked for (`pread`) and never held:
/// the token embedding, of which a step reads one row per token, while a resident copy of
/// the whole table is vocab x hidden (420 MB of DeepSeek-V2-Lite's in bf16, 840 MB of
/// DeepSeek 7B's). Reading through the memory map instead would leave every row ever read
/// (and the pages the kernel maps around it) in the process's memory.
pub struct RowTable {
    file: std::fs::File,
    path: PathBuf,
    name: String,
    /// Where row 0 starts in the file.
    offset: u64,
    rows: usize,
    cols: usize,
    /// As stored in the file.
    dtype: DType,
}

impl RowTable {
    /// Rows `ids` as stored: [ids.len(), cols] on the host.
    pub fn read(&self, ids: &[u32]) -> Result<Tensor> {
        Ok(Tensor::from_raw_buffer(&self.read_bytes(ids)?, self.dtype, &[ids.len(), self.cols], &Device::Cpu)?)
    }

    /// Rows start..start+len as stored, [len, cols] on the host: one read of contiguous bytes,
    /// straight into the tensor's buffer.
    pub fn read_range(&self, start: usize, len: usize) -> Result<Tensor> {
        if start + len > self.rows {
            let msg = format!("rows {start}..{} asked of the {} rows of `{}`", start + len, self.rows, self.name);
            return Err(Error::Model { what: "row range".into(), msg });
        }
        let (n, at) = (len * self.cols, self.offset + (start * self.cols * self.dtype.size_in_bytes()) as u64);
        let shape = (len, self.cols);
        Ok(match self.dtype {
            DType::BF16 => Tensor::from_vec(self.read_into::<half::bf16>(n, at)?, shape, &Device::Cpu)?,
            DType::F16 => Tensor::from_vec(self.read_into::<half::f16>(n, at)?, shape, &Device::Cpu)?,
            _ => Tensor::from_vec(self.read_into::<f32>(n, at)?, shape, &Device::Cpu)?,
        })
    }

    /// Rows start..start+len as the file's bytes.
    fn range_bytes(&self, start: usize, len: usize) -> Result<Vec<u8>> {
        let row = self.cols * self.dtype.size_in_bytes();
        self.read_into::<u8>(len * row, self.offset + (start * row) as u64)
    }

    /// `n` elements (f32, bf16, f16 or bytes) read from the file at byte `at`, straight into
    /// memory nothing zeroed first, in a piece per thread: the loss reads the LM head this way
    /// every step (420 MB of DeepSeek-V2-Lite's in 8 MB chunks, `ops::loss`). Measured with
    /// 30 MB chunks: 42-44 ms of a 1.4 s step on Zen 5 when each chunk was zeroed and then
    /// copied in by one thread, 19-22 ms so.
    fn read_into<T: PlainBits>(&self, n: usize, at: u64) -> Result<Vec<T>> {
        use rayon::prelude::*;
        let bytes = n * std::mem::size_of::<T>();
        let mut buf: Vec<T> = Vec::with_capacity(n);
        let base = buf.as_mut_ptr() as usize;
        let piece = bytes.div_ceil(rayon::current_num_threads().max(1)).max(4 << 20);
        (0..bytes.div_ceil(piece.max(1))).into_par_iter().try_for_each(|i| {
            let (from, to) = (i * piece, ((i + 1) * piece).min(bytes));
            // SAFETY: bytes from..to of the vector's capacity, written by this piece alone.
            unsafe { pread_exact(&self.file, (base + from) as *mut u8, to - from, at + from as u64) }
        })
        .map_err(|e| Error::io(&self.path, e))?;
        // SAFETY: the pieces wrote all `bytes` bytes; T is plain bits (`PlainBits`: every bit
        // pattern is a value).
        unsafe { buf.set_len(n) };
        Ok(buf)
    }

    /// Ask the kernel, from a thread of its own, to read the whole table into the page cache
    /// (which is not this process's memory). The embedding is read a few rows per step, and the
    /// rows a step's tokens name are otherwise read from disk one by one on the step's thread:
    /// DeepSeek-V2-Lite's untied embedding (420 MB) cost ~95 ms of a 2.8 s MoE step on random
    /// tokens (2-core Zen 4 VM, 2026-11-28: 512 blocking 4 KB reads), every step, as new ids
    /// came. A head read whole each step is in the cache after its first, and costs nothing here.
    fn read_ahead(&self) {
        #[cfg(target_os = "linux")]
        if let Ok(file) = self.file.try_clone() {
            use std::os::unix::io::AsRawFd;
            let (at, len) = (self.offset, (self.rows * self.cols * self.dtype.size_in_bytes()) as u64);
            // In 2 MB pieces: Linux reads at most the device's readahead window per call (8 MB of
            // the 420 MB here when asked for all of it at once). Advice only: a failure leaves
            // the reads as they were.
            const PIECE: u64 = 2 << 20;
            std::thread::spawn(move || {
                for from in (at..at + len).step_by(PIECE as usize) {
                    let n = PIECE.min(at + len - from);
                    // SAFETY: posix_fadvise reads no memory of ours; the fd is live for the call.
                    unsafe { libc::posix_fadvise(file.as_raw_fd(), from as libc::off_t, n as libc::off_t, libc::POSIX_FADV_WILLNEED) };
                }
            });
        }
    }

    fn read_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        use std::os::unix::fs::FileExt;
        let row = self.cols * self.dtype.size_in_bytes();
        let mut buf = vec![0u8; ids.len() * row];
        for (dst, &id) in buf.chunks_exact_mut(row.max(1)).zip(ids) {
            if id as usize >= self.rows {
                let msg = format!("token id {id} is past the {} rows of `{}` (the model's vocab_size; a tokenizer of another model?)", self.rows, self.name);
                return Err(Error::Model { what: "token ids".into(), msg });
            }
            self.file.read_exact_at(dst, self.offset + (id as usize * row) as u64).map_err(|e| Error::io(&self.path, e))?;
        }
        Ok(buf)
    }
}

/// Element types any bytes are a value of (no padding, no invalid bit patterns), which
/// `RowTable::read_into` fills straight from a file.
trait PlainBits: Copy + Send {}
impl PlainBits for f32 {}
impl PlainBits for half::bf16 {}
impl PlainBits for half::f16 {}
impl PlainBits for u8 {}

/// `len` bytes of `file` from byte `at` into `dst` (short reads continued, EINTR retried; the
/// end of the file first is an error).
///
/// # Safety
/// `dst` is valid for `len` bytes of writes, by this call alone.
unsafe fn pread_exact(file: &std::fs::File, dst: *mut u8, len: usize, at: u64) -> std::io::Result<()> {
    use std::os::unix::io::AsRawFd;
    let mut done = 0;
    while done < len {
        // SAFETY: dst + done .. dst + len is ours to write (the caller's contract).
        let got = unsafe { libc::pread(file.as_raw_fd(), dst.add(done).cast(), len - done, (at + done as u64) as libc::off_t) };
        match got {
            0 => return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, format!("the file ends before byte {}", at + len as u64))),
            n if n > 0 => done += n as usize,
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

/// transformers' name for a dtype, as config.json's `torch_dtype` / `dtype` say it.
pub fn torch_dtype_name(d: DType) -> &'static str {
    match d {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    }
}

/// Say in a config.json object that its weights are stored in `d`: `torch_dtype` (what
/// transformers 4 reads) and, where the config has it, `dtype` (transformers 5's name, which it
/// prefers), so the two never disagree and a loader with `dtype="auto"` never rounds the
/// weights to a dtype they are not in.
pub fn set_config_dtype(obj: &mut serde_json::Map<String, serde_json::Value>, d: DType) {
    let name = torch_dtype_name(d);
    obj.insert("torch_dtype".into(), name.into());
    if obj.contains_key("dtype") {
        obj.insert("dtype".into(), name.into());
    }
}

/// The candle dtype of a stored float tensor we read or write (f32, bf16, f16).
pub(crate) fn candle_dtype(d: safetensors::Dtype) -> Option<DType> {
    match d {
        safetensors::Dtype::F32 => Some(DType::F32),
        safetensors::Dtype::BF16 => Some(DType::BF16),
        safetensors::Dtype::F16 => Some(DType::F16),
        _ => None,
    }
}

impl SafetensorsFiles {
    /// `name` as a [`RowTable`] when it is an f32, bf16 or f16 matrix of `shape` (None for
    /// another dtype: the caller keeps a copy). Where its data starts is read from the file's
    /// header (8 bytes of header length, the JSON header, then the data, each tensor at its
    /// `data_offsets`), and the first and last rows are checked against the map.
    pub fn row_table(&self, name: &str, shape: &[usize]) -> Result<Option<RowTable>> {
        use std::io::Read;
        if !self.rows_readable(name) {
            return Ok(None); // FP8 (dequantised whole at load) or a dtype `view` names
        }
        let view = self.view(name)?;
        let path = self.file_of(name).map(Path::to_path_buf).unwrap_or_default();
        if view.shape() != shape {
            return Err(Error::Shape { name: name.into(), file: path.display().to_string(), expected: shape.to_vec(), got: view.shape().to_vec() });
        }
        let Some(dtype) = candle_dtype(view.dtype()) else { return Ok(None) };
        let &[rows, cols] = shape else { return Ok(None) };
        let bad = |msg: String| Error::Safetensors { file: path.clone(), msg };
        let mut file = std::fs::File::open(&path).map_err(|e| Error::io(&path, e))?;
        let mut len = [0u8; 8];
        file.read_exact(&mut len).map_err(|e| Error::io(&path, e))?;
        let len = u64::from_le_bytes(len);
        let mut header = vec![0u8; usize::try_from(len).map_err(|_| bad(format!("header length {len}")))?];
        file.read_exact(&mut header).map_err(|e| Error::io(&path, e))?;
        let header: serde_json::Value = serde_json::from_slice(&header).map_err(|e| bad(format!("header: {e}")))?;
        let start = header[name]["data_offsets"][0].as_u64().ok_or_else(|| bad(format!("header: no data_offsets for `{name}`")))?;
        let table = RowTable { file, path: path.clone(), name: name.into(), offset: 8 + len + start, rows, cols, dtype };
        let row = cols * dtype.size_in_bytes();
        for r in [0, rows.saturating_sub(1)].into_iter().filter(|_| rows > 0) {
            if table.read_bytes(&[r as u32])? != view.data()[r * row..][..row] {
                return Err(bad(format!("row {r} of `{name}` read at offset {} differs from the memory map", table.offset)));
            }
        }
        Ok(Some(table))
    }
}

/// A row table asked for as `shape`: an error naming the tensor and its file when it is not.
fn check_table_shape(name: &str, t: &RowTable, shape: &[usize]) -> Result<()> {
    if shape != [t.rows, t.cols] {
        return Err(Error::Shape { name: name.into(), file: t.path.display().to_string(), expected: shape.to_vec(), got: vec![t.rows, t.cols] });
    }
    Ok(())
}

/// Tell the kernel this process no longer needs the mapped file pages under `bytes` (whole
/// pages inside it only). The mapping is read-only, so a later read faults the same bytes back
/// in from the file: nothing can change, only memory is returned.
fn release_pages(bytes: &[u8]) {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize;
    let (start, end) = (bytes.as_ptr() as usize, bytes.as_ptr() as usize + bytes.len());
    let (lo, hi) = (start.div_ceil(page) * page, end / page * page);
    if hi > lo {
        // SAFETY: [lo, hi) lies inside a live read-only mapping owned by `self.files`; DONTNEED
        // on it only drops our page references.
        unsafe {
            libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_DONTNEED);
        }
    }
}

/// Rows and columns of one FP8 scale block (DeepSeek-V3's `weight_block_size`).
pub const FP8_BLOCK: usize = 128;

/// All frozen tensors resident on one device in the storage dtype; converted to the compute
/// dtype when handed out. Only the tensors the model asks for at load are kept.
pub struct ResidentWeights {
    /// The memory map, until `seal`: the tensors are copies, and the map's pages would
    /// otherwise stay in the process's memory too (twice the base in RSS).
    files: std::sync::RwLock<Option<SafetensorsFiles>>,
    /// Every stored tensor name (what `contains` answers from once sealed).
    names: std::collections::HashSet<String>,
    tensors: std::sync::RwLock<HashMap<String, Tensor>>,
    /// Tables read by rows from their files (`check_rows`; on the host only).
    tables: std::sync::RwLock<HashMap<String, RowTable>>,
    /// Whether `check_rows` may leave a table in its file (`with_row_tables`).
    row_tables: bool,
    /// Whether `check_head` leaves the head in its file (`with_head_in_file`).
    head_in_file: bool,
    storage_dtype: DType,
    compute_dtype: DType,
    matmul_dtype: DType,
    device: Device,
}

impl ResidentWeights {
    pub fn new(files: SafetensorsFiles, storage_dtype: DType, compute_dtype: DType, device: Device) -> Self {
        let names = files.names().cloned().collect();
        ResidentWeights {
            files: std::sync::RwLock::new(Some(files)),
            names,
            tensors: Default::default(),
            tables: Default::default(),
            row_tables: device.is_cpu(),
            head_in_file: false,
            storage_dtype,
            compute_dtype,
            matmul_dtype: compute_dtype,
            device,
        }
    }


    /// Hand projection weights to the frozen matmul in `dtype` (see `ops::Kernels::matmul_dtype`).
    pub fn with_matmul_dtype(mut self, dtype: DType) -> Self {
        self.matmul_dtype = dtype;
        self
    }

    /// Whether a table read only by rows may stay in its file (on the host only; training
    /// keeps it resident on the portable path, which stands for a GPU's memory there).
    pub fn with_row_tables(mut self, allowed: bool) -> Self {
        self.row_tables = allowed && self.device.is_cpu();
        self
    }

    /// Leave an untied LM head in its file (on the host only), where it is read in chunks of
    /// rows by every step's loss (`ops::loss`) and never held whole: a step then re-reads
    /// the head from the page cache (~40 ms per GB on a 2-core Zen 5 VM), which the kernel
    /// may drop under memory pressure (the next step then reads it from disk). Training on
    /// the fused CPU ops only: `Model::logits` and `generate` read the head whole, each time.
    pub fn with_head_in_file(mut self, allowed: bool) -> Self {
        self.head_in_file = allowed && self.device.is_cpu();
        self
    }

    /// `name`'s table when it was left in its file (and not also copied).
    fn table<T>(&self, name: &str, f: impl FnOnce(&RowTable) -> Result<T>) -> Option<Result<T>> {
        if self.tensors.read().unwrap_or_else(|e| e.into_inner()).contains_key(name) {
            return None;
        }
        self.tables.read().unwrap_or_else(|e| e.into_inner()).get(name).map(f)
    }

    /// A table's rows as stored, converted as a copy would have been (storage dtype, then
    /// `dtype`): the same values.
    fn table_rows(&self, name: &str, rows: Tensor, dtype: DType) -> Result<Tensor> {
        Ok(rows.to_dtype(stored_dtype(name, self.storage_dtype))?.to_dtype(dtype)?.to_device(&self.device)?)
    }

    /// Leave `name` in its file as a row table when `allowed` and it can be read so.
    fn leave_in_file(&self, name: &str, shape: &[usize], allowed: bool) -> Result<()> {
        let table = match &*self.files.read().unwrap_or_else(|e| e.into_inner()) {
            Some(files) if allowed => files.row_table(name, shape)?,
            _ => None,
        };
        match table {
            Some(t) => {
                t.read_ahead();
                self.tables.write().unwrap_or_else(|e| e.into_inner()).insert(name.to_string(), t);
                Ok(())
            }
            None => self.check(name, shape),
        }
    }

    /// Bytes of frozen tensors held.
    pub fn resident_bytes(&self) -> usize {
        let t = self.tensors.read().unwrap_or_else(|e| e.into_inner());
        t.values().map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum()
    }
}

impl WeightSource for ResidentWeights {
    fn compute_dtype(&self) -> DType {
        self.compute_dtype
    }
    fn device(&self) -> &Device {
        &self.device
    }
    fn matmul_dtype(&self) -> DType {
        self.matmul_dtype
    }
    fn get_stored(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        // A table left in its file, asked for whole: read it all, and keep nothing.
        if let Some(read) = self.table(name, |t| {
            check_table_shape(name, t, shape)?;
            self.table_rows(name, t.read_range(0, t.rows)?, stored_dtype(name, self.storage_dtype))
        }) {
            return read;
        }
        let cached = self.tensors.read().unwrap_or_else(|e| e.into_inner()).get(name).cloned();
        let t = match cached {
            Some(t) => {
                if t.dims() != shape {
                    let files = self.files.read().unwrap_or_else(|e| e.into_inner());
                    return Err(Error::Shape {
                        name: name.into(),
                        file: files.as_ref().and_then(|f| f.file_of(name)).map(|p| p.display().to_string()).unwrap_or_default(),
                        expected: shape.to_vec(),
                        got: t.dims().to_vec(),
                    });
                }
                t
            }
            None => {
                let files = self.files.read().unwrap_or_else(|e| e.into_inner());
                let files = files.as_ref().ok_or_else(|| Error::MissingTensor { name: name.into(), files: "(weights sealed after load)".into() })?;
                let t = files.load(name, shape, &self.device)?.to_dtype(stored_dtype(name, self.storage_dtype))?;
                self.tensors.write().unwrap_or_else(|e| e.into_inner()).insert(name.to_string(), t.clone());
                t
            }
        };
        Ok(t)
    }

    fn contains(&self, name: &str) -> bool {
        self.names.contains(name)
    }
    /// On the host a table read only by rows stays in its file. (On a GPU it is copied as
    /// before: reading rows from the file there is not tested yet.)
    fn check_rows(&self, name: &str, shape: &[usize]) -> Result<()> {
        self.leave_in_file(name, shape, self.row_tables)
    }
    fn check_head(&self, name: &str, shape: &[usize]) -> Result<()> {
        self.leave_in_file(name, shape, self.head_in_file)
    }
    /// A table kept whole (a tied head asked for it) is read from the copy; one left in its
    /// file is read there, row by row, and converted as a copy would have been (storage dtype,
    /// then compute dtype): the same values.
    fn embedding(&self, name: &str, shape: &[usize], ids: &Tensor) -> Result<Tensor> {
        if let Some(read) = self.table(name, |t| {
            check_table_shape(name, t, shape)?;
            let rows = t.read(&ids.to_dtype(DType::U32)?.to_vec1::<u32>()?)?; // [N, H] as stored
            self.table_rows(name, rows, self.compute_dtype)
        }) {
            return read;
        }
        Ok(self.get_stored(name, shape)?.index_select(ids, 0)?.to_dtype(self.compute_dtype())?)
    }
    /// A head left in its file is read there, the asked rows only, in one read.
    fn get_matmul_rows(&self, name: &str, shape: &[usize], start: usize, len: usize) -> Result<Tensor> {
        if let Some(read) = self.table(name, |t| {
            check_table_shape(name, t, shape)?;
            self.table_rows(name, t.read_range(start, len)?, self.matmul_dtype)
        }) {
            return read;
        }
        Ok(self.get_stored(name, shape)?.narrow(0, start, len)?.to_dtype(self.matmul_dtype)?)
    }
    fn bytes_in_files(&self) -> usize {
        let tables = self.tables.read().unwrap_or_else(|e| e.into_inner());
        tables.iter().map(|(name, t)| t.rows * t.cols * stored_dtype(name, self.storage_dtype).size_in_bytes()).sum()
    }
    /// From here on only the copies (and the row tables' files) are held.
    fn seal(&self) {
        *self.files.write().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// Frozen tensors read from the memory map on every request and never kept: peak memory is
/// one layer's weights. For one-off passes over a model (merge verification), not training.
pub struct StreamingWeights {
    files: SafetensorsFiles,
    compute_dtype: DType,
    device: Device,
}

impl StreamingWeights {
    pub fn new(files: SafetensorsFiles, compute_dtype: DType, device: Device) -> Self {
        StreamingWeights { files, compute_dtype, device }
    }
}

impl WeightSource for StreamingWeights {
    fn compute_dtype(&self) -> DType {
        self.compute_dtype
    }
    fn device(&self) -> &Device {
        &self.device
    }
    fn get_stored(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.files.load(name, shape, &self.device)
    }
    fn contains(&self, name: &str) -> bool {
        self.files.file_of(name).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(rows: usize, cols: usize, dtype: DType, seed: f32) -> Tensor {
        let v: Vec<f32> = (0..rows * cols).map(|i| ((i as f32 + seed) * 0.37).sin()).collect();
        Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
    }

    fn rows_of(t: &Tensor, ids: &[u32]) -> Tensor {
        t.index_select(&Tensor::new(ids, &Device::Cpu).unwrap(), 0).unwrap()
    }

    #[test]
    fn unread_names_what_no_layer_asks_for_but_not_what_is_stored_beside_it() {
        let asked: std::collections::BTreeSet<String> =
            ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.1.up_proj.weight"].iter().map(|s| s.to_string()).collect();
        let stored: Vec<String> = [
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.q_proj.weight_scale_inv",    // FP8 block scales
            "model.layers.0.self_attn.q_proj.weight.absmax",       // bitsandbytes' quant state
            "model.layers.0.self_attn.q_proj.SCB",                 // its 8-bit row scales
            "model.layers.0.self_attn.k_proj.SCB",                 // k_proj.weight was not asked
            "model.layers.0.self_attn.q_proj.bias",                // a bias the config left out
            "model.layers.0.self_attn.rotary_emb.inv_freq",        // an old buffer
            "model.layers.1.mlp.experts.1.up_proj.weight",
            "model.layers.1.mlp.experts.10.up_proj.weight",        // not experts.1's
            "model.layers.2.embed_tokens.weight",                  // V3's MTP layer (2 layers)
            "model.vision_tower.weight",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(
            unread(stored.iter(), &asked, 2),
            ["model.layers.0.self_attn.k_proj.SCB", "model.layers.0.self_attn.q_proj.bias", "model.layers.1.mlp.experts.10.up_proj.weight", "model.vision_tower.weight"]
        );
    }

    #[test]
    fn stored_dtypes_are_read_from_the_headers_and_only_all_bf16_is_all_bf16() {
        let root = tempfile::tempdir().unwrap();
        use safetensors::Dtype as S;
        for (name, dtype, want) in [("m16", DType::F16, S::F16), ("mbf", DType::BF16, S::BF16), ("m32", DType::F32, S::F32)] {
            crate::synth::write_model(&root.path().join(name), &crate::synth::TinyShape { dtype, ..Default::default() }, 1, 1).unwrap();
            let got = stored_dtypes(name, None, root.path(), &|_| true).unwrap();
            assert_eq!(got.into_iter().collect::<Vec<_>>(), [want], "{name}");
            assert_eq!(stored_all_bf16(name, None, root.path()), want == S::BF16, "{name}");
        }
        assert_eq!(stored_dtypes("missing", None, root.path(), &|_| true), None);
    }

    #[test]
    fn a_row_table_reads_the_rows_a_copy_holds_in_every_float_dtype() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        // A small tensor first, so the tables do not start at data offset 0.
        let mut map = HashMap::from([("a.norm".to_string(), table(1, 3, DType::F32, 0.0).flatten_all().unwrap())]);
        for (name, dtype) in [("t.bf16", DType::BF16), ("t.f32", DType::F32), ("t.f16", DType::F16)] {
            map.insert(name.to_string(), table(7, 5, dtype, name.len() as f32));
        }
        candle_core::safetensors::save(&map, &path).unwrap();
        let files = SafetensorsFiles::open(&[path]).unwrap();
        let ids = [6u32, 0, 3, 3];
        for name in ["t.bf16", "t.f32", "t.f16"] {
            let t = files.row_table(name, &[7, 5]).unwrap().expect("a float matrix");
            let want = rows_of(&files.load(name, &[7, 5], &Device::Cpu).unwrap(), &ids);
            let got = t.read(&ids).unwrap();
            assert_eq!(got.dtype(), want.dtype(), "{name}");
            let diff = (got.to_dtype(DType::F32).unwrap() - want.to_dtype(DType::F32).unwrap()).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0, "{name}");
            let err = t.read(&[7]).unwrap_err().to_string();
            assert!(err.contains("token id 7") && err.contains(name) && err.contains("7 rows"), "{err}");
        }
        assert!(matches!(files.row_table("t.bf16", &[7, 6]), Err(Error::Shape { .. })));
    }

    /// The resident source reads the embedding from its file after sealing, converted as its
    /// copy would have been: an f32 table in a bf16 run is rounded to bf16 first.
    #[test]
    fn a_resident_base_reads_embedding_rows_from_the_file_with_the_copys_rounding() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let emb = table(9, 4, DType::F32, 1.0);
        candle_core::safetensors::save(&HashMap::from([("model.embed_tokens.weight".to_string(), emb.clone())]), &path).unwrap();
        let src = ResidentWeights::new(SafetensorsFiles::open(&[path]).unwrap(), DType::BF16, DType::F32, Device::Cpu);
        src.check_rows("model.embed_tokens.weight", &[9, 4]).unwrap();
        src.seal();
        assert_eq!((src.resident_bytes(), src.bytes_in_files()), (0, 9 * 4 * 2), "the table is not copied, and counted as bf16 left in the file");
        let ids = Tensor::new(&[8u32, 2, 2], &Device::Cpu).unwrap();
        let got = src.embedding("model.embed_tokens.weight", &[9, 4], &ids).unwrap();
        let want = rows_of(&emb, &[8, 2, 2]).to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
        let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(diff, 0.0);
    }

    /// Pages of `path` in the page cache, of those in bytes `from..to` (mincore on a map).
    #[cfg(target_os = "linux")]
    fn pages_cached(path: &Path, from: usize, to: usize) -> (usize, usize) {
        let file = std::fs::File::open(path).unwrap();
        // SAFETY: a read-only map of a file no one writes while the test runs.
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        let page = 4096;
        let mut v = vec![0u8; map.len().div_ceil(page)];
        // SAFETY: the map is live and `v` has a byte per page of it.
        assert_eq!(unsafe { libc::mincore(map.as_ptr() as *mut libc::c_void, map.len(), v.as_mut_ptr()) }, 0);
        let pages = &v[from / page..to.div_ceil(page)];
        (pages.iter().filter(|&&b| b & 1 == 1).count(), pages.len())
    }

    /// An embedding left in its file is read into the page cache from a thread of its own, so
    /// a step's token rows are not each a blocking read from disk.
    #[test]
    #[cfg(target_os = "linux")]
    fn an_embedding_left_in_its_file_is_read_into_the_page_cache_ahead_of_its_rows() {
        use std::os::unix::io::AsRawFd;
        // Beside the test binary, in the build's folder: a disk's file system, where /tmp may
        // be tmpfs, which keeps every page and so could not show reading ahead.
        let beside_binary = std::env::current_exe().unwrap().parent().unwrap().to_path_buf();
        let dir = tempfile::tempdir_in(beside_binary).unwrap();
        let path = dir.path().join("model.safetensors");
        // 64 MB of bf16: more than the kernel reads around the map's first touch and the
        // check's reads of the first and last rows.
        let (rows, cols) = (32768, 1024);
        candle_core::safetensors::save(&HashMap::from([("model.embed_tokens.weight".to_string(), table(rows, cols, DType::BF16, 3.0))]), &path).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        file.sync_all().unwrap();
        // SAFETY: advice on a live fd.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        let len = std::fs::metadata(&path).unwrap().len() as usize;
        let (table_at, table_end) = (len - rows * cols * 2, len);
        let (cached, pages) = pages_cached(&path, table_at, table_end);
        assert!(cached <= 2, "the build folder's file system kept {cached} of {pages} pages after DONTNEED (tmpfs?), so reading ahead cannot be seen: build on a disk");
        let src = ResidentWeights::new(SafetensorsFiles::open(std::slice::from_ref(&path)).unwrap(), DType::BF16, DType::F32, Device::Cpu);
        src.check_rows("model.embed_tokens.weight", &[rows, cols]).unwrap();
        src.seal();
        let start = std::time::Instant::now();
        let mut seen = pages_cached(&path, table_at, table_end);
        while seen.0 < seen.1 && start.elapsed() < std::time::Duration::from_secs(20) {
            std::thread::sleep(std::time::Duration::from_millis(20));
            seen = pages_cached(&path, table_at, table_end);
        }
        assert_eq!(seen.0, seen.1, "pages of the table in the page cache, of its pages, 20 s after it was left in its file");
    }

    /// A head left in its file hands the loss the rows a resident copy would (an f32 table
    /// in a bf16 run with bf16 matmuls: rounded to bf16), a run of rows per read, and reads
    /// whole when asked for whole; only a source told to leaves it there.
    #[test]
    fn a_resident_base_reads_head_row_chunks_from_the_file_as_its_copy_would() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let head = table(9, 4, DType::F32, 2.0);
        let map = HashMap::from([("a.norm".to_string(), table(1, 3, DType::F32, 0.0).flatten_all().unwrap()), ("lm_head.weight".to_string(), head.clone())]);
        candle_core::safetensors::save(&map, &path).unwrap();
        let open = |in_file: bool| {
            let src = ResidentWeights::new(SafetensorsFiles::open(std::slice::from_ref(&path)).unwrap(), DType::BF16, DType::F32, Device::Cpu);
            let src = src.with_matmul_dtype(DType::BF16).with_head_in_file(in_file);
            src.check_head("lm_head.weight", &[9, 4]).unwrap();
            src.seal();
            src
        };
        let (file, copy) = (open(true), open(false));
        assert_eq!((file.resident_bytes(), file.bytes_in_files()), (0, 9 * 4 * 2), "the head is not copied, and counted as bf16 left in the file");
        assert_eq!((copy.resident_bytes(), copy.bytes_in_files()), (9 * 4 * 2, 0), "not told to: held");
        let same = |a: Tensor, b: Tensor| {
            assert_eq!((a.dtype(), a.dims()), (b.dtype(), b.dims()));
            let d = (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap()).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);
        };
        for (start, len) in [(0, 9), (2, 5), (8, 1)] {
            let got = file.get_matmul_rows("lm_head.weight", &[9, 4], start, len).unwrap();
            same(got.clone(), copy.get_matmul_rows("lm_head.weight", &[9, 4], start, len).unwrap());
            same(got, head.narrow(0, start, len).unwrap().to_dtype(DType::BF16).unwrap());
        }
        same(file.get_matmul("lm_head.weight", &[9, 4]).unwrap(), copy.get_matmul("lm_head.weight", &[9, 4]).unwrap());
        let err = file.get_matmul_rows("lm_head.weight", &[9, 4], 5, 5).unwrap_err().to_string();
        assert!(err.contains("rows 5..10") && err.contains("9 rows") && err.contains("lm_head.weight"), "{err}");
        assert!(matches!(file.get_matmul_rows("lm_head.weight", &[9, 5], 0, 1), Err(Error::Shape { .. })));
    }
}
