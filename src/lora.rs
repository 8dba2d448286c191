//! LoRA adapters: y = W x + b + (alpha / r) * B (A (dropout(x))).
//!
//! Init contract (as PEFT's default `init_lora_weights=True`): A ~ kaiming_uniform(a = sqrt(5)),
//! i.e. U(-1/sqrt(in), 1/sqrt(in)), and B = 0, so a fresh adapter leaves the model's output
//! unchanged. A and B are the only `Var`s in the program; the frozen W never is.
//!
//! [`LoraLinear`] wraps a frozen linear with an optional adapter so model code calls one
//! `forward` whether or not a module is targeted.

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::ops::checkpoint::Keep;
use crate::rng::{dropout_mask, stream, Rng};
use candle_core::{DType, Device, Tensor, Var};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Llama / Qwen2 module names, in the order of their layers' linears
/// ([`ModelConfig::linear_sites`]).
pub const MODULES: [&str; 7] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

/// Every name `lora.targets` may hold: the Llama / Qwen2 projections and DeepSeek's MLA ones.
/// Which of them a model has is checked against the model ([`Adapters::init`]).
pub const ALL_TARGETS: &[&str] =
    &["q_proj", "k_proj", "v_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

/// Whether the linear at `path` (`self_attn.q_proj`, `mlp.experts.3.up_proj`) gets an
/// adapter: its leaf name is a target, and a routed expert only with `routed_experts`. In MoE
/// layers `gate_proj`/`up_proj`/`down_proj` mean the shared experts; the router
/// (`mlp.gate`) is not a linear site and is never adapted.
pub fn is_targeted(path: &str, spec: &LoraSpec) -> bool {
    let leaf = path.rsplit('.').next().unwrap_or(path);
    spec.targets.iter().any(|t| t == leaf) && (spec.routed_experts || !path.starts_with("mlp.experts."))
}

pub struct LoraAdapter {
    /// [R, in]
    pub a: Var,
    /// [out, R]
    pub b: Var,
}

/// Settings shared by every adapter.
#[derive(Clone, Debug)]
pub struct LoraSpec {
    pub rank: usize,
    pub alpha: f64,
    pub dropout: f64,
    /// Targeted module names (leaf names, [`ALL_TARGETS`] order).
    pub targets: Vec<String>,
    /// Adapters on every routed expert too (`mlp.experts.{j}.*`), for the MLP targets.
    pub routed_experts: bool,
}

impl LoraSpec {
    /// What PEFT with transformers 5 does not apply of an adapter on a MoE model (measured
    /// with PEFT 0.21): it moves every `gate_proj`/`up_proj`/`down_proj` target to the stacked
    /// routed-expert parameters, so the adapters on dense layers' MLP and on shared experts
    /// are dropped there without a word. None when there is nothing to say.
    pub fn peft_caveat(&self, cfg: &crate::config::ModelConfig) -> Option<String> {
        let mlp: Vec<&str> = self.targets.iter().map(String::as_str).filter(|t| ["gate_proj", "up_proj", "down_proj"].contains(t)).collect();
        (cfg.moe.is_some() && !mlp.is_empty()).then(|| {
            format!(
                "note: PEFT with transformers 5 does not apply this adapter's {} on dense layers and shared experts (it takes those names for the stacked experts); \
                 load it with transformers 4, or export a merged model (finetune export --merge)",
                mlp.join("/")
            )
        })
    }
}

impl LoraSpec {
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }
}

/// All adapters of a model: `layers[i][m]` for the m-th linear of layer i
/// ([`ModelConfig::linear_sites`]; `sites[i][m]` is its path), `None` where not targeted.
pub struct Adapters {
    pub spec: LoraSpec,
    pub layers: Vec<Vec<Option<LoraAdapter>>>,
    pub sites: Vec<Vec<String>>,
}

/// Dropout context of one forward: which micro-batch, so masks are reproducible.
#[derive(Clone, Copy, Debug)]
pub struct DropoutCtx {
    pub seed: u64,
    pub micro_batch: u64,
    /// Tokens of the micro-batch before this pass's first row (a micro-batch whose rows run
    /// in several passes, `train::pass_tokens`): masks are drawn per element of the whole
    /// micro-batch, so the passes draw what one pass over all rows would.
    pub first_token: u64,
}

impl Adapters {
    /// Fresh adapters: A kaiming-uniform from a seeded RNG, B = 0. A target the model does
    /// not have is an error listing the names it has (nothing is skipped silently).
    pub fn init(cfg: &ModelConfig, spec: LoraSpec, seed: u64, device: &Device) -> Result<Self> {
        Self::check_spec(cfg, &spec)?;
        let mut rng = Rng::new(seed);
        let (mut layers, mut sites) = (Vec::with_capacity(cfg.num_hidden_layers), Vec::with_capacity(cfg.num_hidden_layers));
        for l in 0..cfg.num_hidden_layers {
            let paths = cfg.linear_sites(l);
            let mut row = Vec::with_capacity(paths.len());
            for path in &paths {
                let shape = cfg.linear_shape(path).filter(|_| is_targeted(path, &spec));
                let Some((fan_in, out, _)) = shape else {
                    row.push(None);
                    continue;
                };
                let bound = 1.0 / (fan_in as f64).sqrt();
                let a: Vec<f32> = (0..spec.rank * fan_in).map(|_| ((rng.next_f64() * 2.0 - 1.0) * bound) as f32).collect();
                let a = Var::from_vec(a, (spec.rank, fan_in), device)?;
                let b = Var::zeros((out, spec.rank), DType::F32, device)?;
                row.push(Some(LoraAdapter { a, b }));
            }
            layers.push(row);
            sites.push(paths);
        }
        Ok(Adapters { spec, layers, sites })
    }

    /// The checks `init` makes of a recipe's adapters against a model (also `finetune plan`'s):
    /// every target is a linear the model has, and routed experts are asked for only where
    /// there are some and a target reaches them.
    pub fn check_spec(cfg: &ModelConfig, spec: &LoraSpec) -> Result<()> {
        let names = cfg.linear_names();
        if let Some(t) = spec.targets.iter().find(|t| !names.contains(t)) {
            return Err(Error::model(
                "lora.targets",
                format!("`{t}` is not a linear of {} models; this model has: {}", cfg.architecture_name, names.join(", ")),
            ));
        }
        let has_experts = cfg.moe.is_some();
        if spec.routed_experts && !has_experts {
            return Err(Error::model("lora.routed_experts", format!("is true but {} has no routed experts", cfg.architecture_name)));
        }
        if spec.routed_experts && !spec.targets.iter().any(|t| ["gate_proj", "up_proj", "down_proj"].contains(&t.as_str())) {
            return Err(Error::model(
                "lora.routed_experts",
                "is true but lora.targets names no expert projection (gate_proj, up_proj, down_proj): no expert would be adapted",
            ));
        }
        Ok(())
    }

    /// No adapters at all (the base model alone).
    pub fn none(cfg: &ModelConfig) -> Result<Self> {
        let spec = LoraSpec { rank: 1, alpha: 1.0, dropout: 0.0, targets: vec![], routed_experts: false };
        Self::init(cfg, spec, 0, &Device::Cpu)
    }

    /// The adapter of the linear at `path` in layer `layer`, with its site index (dropout
    /// masks are keyed by it).
    pub fn site(&self, layer: usize, path: &str) -> (usize, Option<&LoraAdapter>) {
        let Some(paths) = self.sites.get(layer) else { return (0, None) };
        match paths.iter().position(|p| p == path) {
            Some(i) => (i, self.layers[layer][i].as_ref()),
            None => (0, None),
        }
    }

    /// Every adapter with its layer and path, in parameter order.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &str, &LoraAdapter)> {
        self.layers.iter().zip(&self.sites).enumerate().flat_map(|(i, (row, paths))| {
            row.iter().zip(paths).filter_map(move |(ad, p)| ad.as_ref().map(|ad| (i, p.as_str(), ad)))
        })
    }

    /// The trainable tensors in a fixed order (layer, linear site, A then B) with their PEFT keys.
    pub fn params(&self) -> Vec<(String, &Var)> {
        let mut out = Vec::new();
        for (i, path, ad) in self.iter() {
            let base = peft_prefix(i, path);
            out.push((format!("{base}.lora_A.weight"), &ad.a));
            out.push((format!("{base}.lora_B.weight"), &ad.b));
        }
        out
    }

    pub fn num_params(&self) -> u64 {
        self.params().iter().map(|(_, v)| v.elem_count() as u64).sum()
    }

    /// Load A and B from a PEFT adapter folder (`adapter_model.safetensors`), strictly: every
    /// expected key present with the right shape, no unexpected keys, and r / lora_alpha in
    /// `adapter_config.json` equal to the recipe's.
    pub fn load_peft(&self, dir: &Path) -> Result<()> {
        let err = |msg: String| Error::Adapter { dir: dir.to_path_buf(), msg };
        let c = AdapterConfig::read(dir)?;
        if c.spec.rank != self.spec.rank {
            return Err(err(format!("adapter has r = {} but lora.rank = {}; set lora.rank = {}", c.spec.rank, self.spec.rank, c.spec.rank)));
        }
        if c.spec.alpha != self.spec.alpha {
            return Err(err(format!("adapter has lora_alpha = {} but lora.alpha = {}; set lora.alpha = {}", c.spec.alpha, self.spec.alpha, c.spec.alpha)));
        }
        // Every module this adapts must be one target_modules names, as PEFT matches them (the
        // name, or its dotted tail): paths naming some layers only adapt those in PEFT.
        for (l, path, _) in self.iter() {
            let module = format!("model.layers.{l}.{path}");
            if !c.target_modules.iter().any(|t| module == *t || module.ends_with(&format!(".{t}"))) {
                return Err(err(format!("adapter_config.json: target_modules does not name `{module}` (adapters on some layers or experts only are not supported)")));
            }
        }
        let file = dir.join("adapter_model.safetensors");
        if !file.is_file() {
            return Err(err("no adapter_model.safetensors (adapter_model.bin pickles are not read)".into()));
        }
        let tensors = candle_core::safetensors::load(&file, &Device::Cpu)
            .map_err(|e| Error::Safetensors { file: file.clone(), msg: crate::error::candle_msg(&e) })?;
        // PEFT may save keys with the adapter name (".default") in some versions; accept both.
        let tensors: HashMap<String, Tensor> =
            tensors.into_iter().map(|(k, v)| (k.replace(".default.weight", ".weight"), v)).collect();
        let params = self.params();
        let mut missing = Vec::new();
        for (key, var) in &params {
            match tensors.get(key) {
                None => missing.push(key.clone()),
                Some(t) => {
                    if t.dims() != var.dims() {
                        return Err(Error::Shape {
                            name: key.clone(),
                            file: file.display().to_string(),
                            expected: var.dims().to_vec(),
                            got: t.dims().to_vec(),
                        });
                    }
                    let t = t.to_dtype(DType::F32)?;
                    // NaN or inf in an adapter poisons every output; say which tensor.
                    if t.flatten_all()?.to_vec1::<f32>()?.iter().any(|x| !x.is_finite()) {
                        return Err(err(format!("tensor `{key}` in {} holds NaN or inf", file.display())));
                    }
                    var.set(&t.to_device(var.device())?)?;
                }
            }
        }
        if !missing.is_empty() {
            return Err(err(format!(
                "{} expected tensor(s) missing, e.g. `{}` (the adapter's target_modules, or lora.targets for lora.init_from, name modules it has no tensors for)",
                missing.len(),
                missing[0]
            )));
        }
        let expected: std::collections::HashSet<&String> = params.iter().map(|(k, _)| k).collect();
        let mut unexpected: Vec<&String> = tensors.keys().filter(|k| !expected.contains(k)).collect();
        unexpected.sort();
        if !unexpected.is_empty() {
            let hint = if unexpected[0].contains(".mlp.experts.") && !self.spec.routed_experts {
                "the adapter has routed-expert adapters: set lora.routed_experts = true"
            } else {
                "tensors of modules its target_modules (or lora.targets, for lora.init_from) do not name"
            };
            return Err(err(format!("{} unexpected tensor(s), e.g. `{}` ({hint})", unexpected.len(), unexpected[0])));
        }
        Ok(())
    }

    /// Write a PEFT adapter folder: `adapter_model.safetensors` (f32) and `adapter_config.json`.
    /// Each file is written to a temporary name and renamed, so a reader never sees half a file.
    pub fn save_peft(&self, dir: &Path, base_model: &str) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let mut map: BTreeMap<String, Tensor> = BTreeMap::new();
        for (k, v) in self.params() {
            map.insert(k, v.as_tensor().to_device(&Device::Cpu)?);
        }
        let file = dir.join("adapter_model.safetensors");
        let tmp = dir.join(".adapter_model.safetensors.tmp");
        let data: Vec<(&String, &Tensor)> = map.iter().collect();
        crate::fsutil::write_safetensors(data, None, &tmp)?;
        crate::fsutil::rename_durable(&tmp, &file)?;
        // PEFT with transformers 5 loads routed-expert adapters onto its stacked expert
        // parameters (`ParamWrapper`), which refuses any `lora_dropout` but 0. Dropout acts
        // only in training, so such an adapter says 0 (the run's recipe keeps what it used).
        let dropout = if self.spec.routed_experts { 0.0 } else { self.spec.dropout };
        let config = serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.spec.rank,
            "lora_alpha": self.spec.alpha,
            "lora_dropout": dropout,
            "target_modules": self.spec.targets,
            "bias": "none",
            "fan_in_fan_out": false,
            "inference_mode": true,
            "init_lora_weights": true,
            "modules_to_save": null,
            "layers_to_transform": null,
            "layers_pattern": null,
            "rank_pattern": {},
            "alpha_pattern": {},
            "use_rslora": false,
            "use_dora": false,
            "revision": null,
        });
        let text = serde_json::to_string_pretty(&config).map_err(|e| Error::Train(e.to_string()))?;
        crate::fsutil::write_atomic(&dir.join("adapter_config.json"), text.as_bytes())
    }
}

/// `base_model.model.model.layers.{i}.{path}`: PEFT's key prefix of the linear at `path`
/// (`self_attn.q_proj`; routed experts as transformers-4 PEFT wrote them,
/// `mlp.experts.{j}.gate_proj`).
pub fn peft_prefix(layer: usize, path: &str) -> String {
    format!("base_model.model.model.layers.{layer}.{path}")
}

/// A frozen linear (W [out, in], optional bias [out]) with an optional LoRA adapter.
pub struct LoraLinear<'a> {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub lora: Option<&'a LoraAdapter>,
    pub scale: f64,
    pub dropout: f64,
    /// Identifies this module for dropout masks: (layer, module index).
    pub site: (usize, usize),
}

impl LoraLinear<'_> {
    /// x [N, in] -> [N, out]
    pub fn forward(&self, kern: crate::ops::Kernels, x: &Tensor, drop: Option<DropoutCtx>) -> Result<Tensor> {
        self.forward_kept(kern, x, drop, &Keep::plain())
    }

    /// As [`Self::forward`], for a linear whose output activation checkpointing may keep
    /// (`keep`: its layer's, `ops::checkpoint`).
    pub fn forward_kept(&self, kern: crate::ops::Kernels, x: &Tensor, drop: Option<DropoutCtx>, keep: &Keep) -> Result<Tensor> {
        // A checkpointed forward's graph is dropped unread (its layer's input is all backward
        // starts from): with the adapter's weights detached there, the only tensors that
        // require a gradient, no graph is built, and each op's activations are freed as soon
        // as the next op has read them instead of living to the end of the layer.
        let untracked = keep.pass == crate::ops::checkpoint::Pass::Checkpointed;
        let keep = keep.linear(self.site.1);
        let y = match self.lora {
            None => crate::ops::frozen_linear_kept(kern, x, &self.weight, keep)?,
            Some(ad) => {
                let mask = match drop {
                    Some(ctx) if self.dropout > 0.0 => {
                        let id = stream(&[ctx.seed, ctx.micro_batch, self.site.0 as u64, self.site.1 as u64]);
                        let width = x.dims().last().copied().unwrap_or(1) as u64; // x [N, in]
                        Some(dropout_mask(id, ctx.first_token * width, x.elem_count(), self.dropout))
                    }
                    _ => None,
                };
                let (a, b) = if untracked { (ad.a.as_tensor().detach(), ad.b.as_tensor().detach()) } else { (ad.a.as_tensor().clone(), ad.b.as_tensor().clone()) };
                crate::ops::lora_linear(kern, x, &self.weight, (&a, &b, self.scale), mask, keep)?
            }
        };
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(&b.to_dtype(y.dtype())?)?,
            None => y,
        })
    }
}

/// What `adapter_config.json` says, read one way for every use (`lora.init_from`, resume,
/// export): an adapter whose forward is not `W x + (alpha / r) B A x` with one r and alpha
/// (rsLoRA, DoRA, fan_in_fan_out, rank/alpha patterns, a non-LoRA PEFT type) is refused
/// everywhere, rather than loaded here and trained or merged with the wrong scale.
pub struct AdapterConfig {
    pub spec: LoraSpec,
    pub base_model: Option<String>,
    /// `target_modules` as written (leaf names, or module paths PEFT matches by their tail).
    pub target_modules: Vec<String>,
}

impl AdapterConfig {
    pub fn read(dir: &Path) -> Result<Self> {
        let err = |msg: String| Error::Adapter { dir: dir.to_path_buf(), msg };
        let p = dir.join("adapter_config.json");
        if dir.is_file() {
            let what = if crate::weights::is_gguf_file(dir) { "a GGUF file (llama.cpp's LoRA format is written for llama.cpp, not read back)" } else { "a file" };
            return Err(err(format!("is {what}: an adapter here is a PEFT adapter folder (adapter_config.json and adapter_model.safetensors)")));
        }
        // A run's folder or a checkpoint's holds its adapter in `adapter/`.
        if !p.exists() && dir.join("adapter/adapter_config.json").is_file() {
            return Err(err(format!("has no adapter_config.json; its adapter is in {} (a run's or checkpoint's folder holds it there)", dir.join("adapter").display())));
        }
        let text = std::fs::read_to_string(&p).map_err(|e| Error::io(&p, e))?;
        let c: serde_json::Value = serde_json::from_str(&text).map_err(|e| err(format!("adapter_config.json is not valid JSON: {e}")))?;
        if !c.is_object() {
            return Err(err("adapter_config.json must hold a JSON object".into()));
        }
        if let Some(t) = c.get("peft_type").filter(|t| t.as_str() != Some("LORA")) {
            return Err(err(format!("adapter_config.json: peft_type {t} is not LORA")));
        }
        for (k, what) in [("use_dora", "DoRA"), ("use_rslora", "rsLoRA scaling (alpha / sqrt(r))"), ("fan_in_fan_out", "fan_in_fan_out")] {
            if c.get(k).and_then(|v| v.as_bool()) == Some(true) {
                return Err(err(format!("adapter_config.json: {what} adapters are not supported ({k} = true)")));
            }
        }
        // Trained base biases ("all", "lora_only") are part of the adapter, a base change.
        if let Some(b) = c.get("bias").and_then(|v| v.as_str()).filter(|b| *b != "none") {
            return Err(err(format!("adapter_config.json: bias = \"{b}\" adapters (trained base biases) are not supported")));
        }
        // PEFT variants whose forward is not Wx + (alpha/r)·B·A·x on the unmodified base: any
        // of these set (not null, false or empty) would be loaded as a plain LoRA and compute
        // something else without a word.
        for (k, what) in [
            ("alora_invocation_tokens", "Activated LoRA (the adapter applies only after its invocation tokens)"),
            ("use_qalora", "QALoRA (the adapter reads pooled inputs)"),
            ("target_parameters", "LoRA on parameters (`target_parameters`, e.g. transformers 5's stacked expert weights)"),
            ("layer_replication", "layer replication (the base's layers repeated)"),
            ("use_bdlora", "BD-LoRA"),
            ("arrow_config", "Arrow routing between adapters"),
            ("kasa_config", "KaSA"),
            ("velora_config", "VeLoRA"),
            ("monteclora_config", "MonteCLoRA"),
            ("modules_to_save", "fully trained extra modules (`modules_to_save`, e.g. lm_head)"),
            ("lora_bias", "LoRA with a bias on B (`lora_bias`)"),
            ("layers_to_transform", "some layers only (`layers_to_transform`)"),
            ("exclude_modules", "excluded modules (`exclude_modules`)"),
        ] {
            let set = match c.get(k) {
                None | Some(serde_json::Value::Null) | Some(serde_json::Value::Bool(false)) => false,
                Some(serde_json::Value::Array(a)) => !a.is_empty(),
                Some(serde_json::Value::Object(o)) => !o.is_empty(),
                Some(_) => true,
            };
            if set {
                return Err(err(format!("adapter_config.json: {what} adapters are not supported (`{k}` is set)")));
            }
        }
        // After the variants: PEFT writes a rank_pattern for `target_parameters` too, which
        // is the cause to name.
        for k in ["rank_pattern", "alpha_pattern"] {
            if c.get(k).and_then(|v| v.as_object()).is_some_and(|m| !m.is_empty()) {
                return Err(err(format!("adapter_config.json: per-module `{k}` is not supported")));
            }
        }
        // Initialisations after which PEFT rewrites the base weights when it loads the adapter
        // (PiSSA, CorDA, OLoRA, LoftQ, LoRA-GA: W - B·A at load), so the saved A and B are only
        // right against that rewritten base. Only those that leave the base as it is pass.
        match c.get("init_lora_weights") {
            None | Some(serde_json::Value::Null) | Some(serde_json::Value::Bool(_)) => {}
            Some(serde_json::Value::String(s)) if ["gaussian", "eva", "orthogonal", "mica"].contains(&s.to_ascii_lowercase().as_str()) => {}
            Some(v) => {
                return Err(err(format!(
                    "adapter_config.json: init_lora_weights = {v}: PEFT changes the base weights for this initialisation when it loads the adapter, \
                     so its A and B do not apply to the base as it is; convert it to a plain LoRA first (PEFT's `path_initial_model_for_weight_conversion` when saving)"
                )))
            }
        }
        // Bounded like the recipe's lora.rank: `r` sizes every A and B allocated from it.
        let rank = c.get("r").and_then(|v| v.as_u64()).filter(|&r| r > 0 && r <= 1 << 16);
        let rank = rank.ok_or_else(|| err(format!("adapter_config.json: `r` must be an integer in 1..=65536, got {}", c.get("r").map_or("nothing".into(), |v| v.to_string()))))?;
        // Finite as an f32 too: training scales in f32, and a GGUF adapter stores it as one.
        let alpha = c.get("lora_alpha").and_then(|v| v.as_f64()).filter(|&a| a > 0.0 && (a as f32).is_finite());
        let alpha = alpha.ok_or_else(|| err(format!("adapter_config.json: `lora_alpha` must be a positive number below {:e} (an f32), got {}", f32::MAX, c.get("lora_alpha").map_or("nothing".into(), |v| v.to_string()))))?;
        let listed: Vec<String> = match c.get("target_modules") {
            Some(serde_json::Value::Array(a)) => a.iter().filter_map(|v| v.as_str().map(String::from)).collect(),
            Some(serde_json::Value::String(s)) => return Err(err(format!("adapter_config.json: target_modules as a regex (`{s}`) is not supported"))),
            _ => return Err(err("adapter_config.json has no `target_modules` list".into())),
        };
        // PEFT matches an entry against a module's name or its dotted tail, and writes full
        // paths (`model.layers.1.mlp.up_proj`) for `target_modules = "all-linear"`: an entry
        // means its last component. One that names only some layers or experts leaves the
        // others without tensors, which loading refuses.
        let target_modules = listed.clone();
        let listed: Vec<String> = listed.iter().map(|t| t.rsplit('.').next().unwrap_or(t).to_string()).collect();
        for t in &listed {
            if !ALL_TARGETS.contains(&t.as_str()) {
                return Err(err(format!("adapter_config.json: target module `{t}` is not one of {}", ALL_TARGETS.join(", "))));
            }
        }
        let targets = ALL_TARGETS.iter().filter(|m| listed.iter().any(|t| t == *m)).map(|s| s.to_string()).collect();
        // Routed-expert adapters are per-module keys (`...mlp.experts.{j}.gate_proj.lora_A`);
        // their presence, not a config field PEFT would not know, says the adapter has them.
        let keys = adapter_keys(&dir.join("adapter_model.safetensors"))?;
        let per_expert = |k: &str| k.split(".mlp.experts.").nth(1).and_then(|rest| rest.split('.').next()).is_some_and(|j| j.parse::<usize>().is_ok());
        if let Some(k) = keys.iter().find(|k| k.contains(".mlp.experts.") && !per_expert(k)) {
            return Err(err(format!(
                "adapter_model.safetensors: `{k}` adapts the routed experts stacked (transformers 5's expert parameters, PEFT's `target_parameters`), which is not supported: expert adapters here are per expert (`mlp.experts.{{j}}.gate_proj`)"
            )));
        }
        let routed_experts = keys.iter().any(|k| per_expert(k));
        let dropout = c.get("lora_dropout").and_then(|v| v.as_f64()).unwrap_or(0.0);
        let base_model = c.get("base_model_name_or_path").and_then(|v| v.as_str()).map(String::from);
        Ok(AdapterConfig { spec: LoraSpec { rank: rank as usize, alpha, dropout, targets, routed_experts }, base_model, target_modules })
    }
}

/// Tensor names in a safetensors file (empty when the file does not exist: the loaders
/// report that themselves), read through the same checked map the weights use.
fn adapter_keys(file: &Path) -> Result<Vec<String>> {
    if !file.is_file() {
        return Ok(Vec::new());
    }
    Ok(crate::weights::SafetensorsFiles::open(&[file.to_path_buf()])?.names().cloned().collect())
}
