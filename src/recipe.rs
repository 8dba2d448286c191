//! The TOML recipe: one file names model, LoRA, data, training and output.
//!
//! Parsing is two passes. First the raw TOML (with `--set section.key=value` overrides applied)
//! is checked against [`SCHEMA`]: unknown sections/keys (with the closest valid name suggested),
//! wrong types and missing required keys are errors naming the dotted key. Then serde fills the
//! typed [`Recipe`] (with `deny_unknown_fields` as a backstop; a test keeps both in step).
//! Relative paths resolve against the recipe file's folder.

use crate::error::{Error, Result};
use crate::lora::ALL_TARGETS;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Str,
    Int,
    Float,
    Bool,
    StrList,
    FloatPair,
    /// A string or a list of strings (one path or several).
    StrOrList,
    /// A table of string values (`[data.columns]`).
    StrMap,
    /// true, false or the string "auto".
    BoolOrAuto,
}

impl Kind {
    fn describe(self) -> &'static str {
        match self {
            Kind::Str => "a string",
            Kind::Int => "a non-negative integer",
            Kind::Float => "a number",
            Kind::Bool => "true or false",
            Kind::StrList => "a list of strings",
            Kind::FloatPair => "a list of two numbers",
            Kind::StrOrList => "a string or a list of strings",
            Kind::StrMap => "a table of strings",
            Kind::BoolOrAuto => "true, false or \"auto\"",
        }
    }
    fn accepts(self, v: &toml::Value) -> bool {
        use toml::Value as V;
        match (self, v) {
            (Kind::Str, V::String(_)) | (Kind::Bool, V::Boolean(_)) => true,
            (Kind::Int, V::Integer(i)) => *i >= 0,
            (Kind::Float, V::Float(_) | V::Integer(_)) => true,
            (Kind::StrList, V::Array(a)) => a.iter().all(|x| x.is_str()),
            (Kind::FloatPair, V::Array(a)) => {
                a.len() == 2 && a.iter().all(|x| x.is_float() || x.is_integer())
            }
            (Kind::StrOrList, V::String(_)) => true,
            (Kind::StrOrList, V::Array(a)) => !a.is_empty() && a.iter().all(|x| x.is_str()),
            (Kind::StrMap, V::Table(t)) => t.values().all(|x| x.is_str()),
            (Kind::BoolOrAuto, V::Boolean(_)) => true,
            (Kind::BoolOrAuto, V::String(s)) => s == "auto",
            _ => false,
        }
    }
}

struct KeySpec {
    name: &'static str,
    kind: Kind,
    required: bool,
    /// For string keys with a closed set of values.
    choices: &'static [&'static str],
    /// File name endings accepted besides `choices` (a path to such a file).
    or_file: &'static [&'static str],
}

const fn key(name: &'static str, kind: Kind) -> KeySpec {
    KeySpec { name, kind, required: false, choices: &[], or_file: &[] }
}
const fn req(name: &'static str, kind: Kind) -> KeySpec {
    KeySpec { name, kind, required: true, choices: &[], or_file: &[] }
}
const fn one_of(name: &'static str, choices: &'static [&'static str]) -> KeySpec {
    KeySpec { name, kind: Kind::Str, required: false, choices, or_file: &[] }
}
const fn one_of_or_file(name: &'static str, choices: &'static [&'static str], endings: &'static [&'static str]) -> KeySpec {
    KeySpec { name, kind: Kind::Str, required: false, choices, or_file: endings }
}


/// Every section and key the recipe accepts. Later issues add sections here.
const SCHEMA: &[(&str, bool, &[KeySpec])] = &[
    (
        "model",
        true,
        &[req("path", Kind::Str), key("revision", Kind::Str), one_of("dtype", &["auto", "f32", "bf16", "f16"]), key("device", Kind::Str), one_of("matmul", &["auto", "f32"]), one_of("kernels", &["auto", "portable"]), one_of("quantize", &["q8_0", "q4_k", "q4_0", "q5_k", "q6_k", "nf4"])],
    ),
    (
        "lora",
        true,
        &[
            req("rank", Kind::Int),
            req("alpha", Kind::Float),
            key("dropout", Kind::Float),
            key("targets", Kind::StrList),
            key("routed_experts", Kind::Bool),
            key("init_from", Kind::Str),
        ],
    ),
    (
        "data",
        true,
        &[
            req("train", Kind::StrOrList),
            key("split", Kind::Str),
            one_of("format", crate::data::format::FORMATS),
            one_of_or_file("template", crate::data::format::TEMPLATES, crate::data::format::TEMPLATE_FILE_ENDINGS),
            key("columns", Kind::StrMap),
            key("train_on_prompt", Kind::Bool),
            key("shuffle", Kind::Bool),
            key("shuffle_buffer", Kind::Int),
            key("packing", Kind::Bool),
            key("max_seq_len", Kind::Int),
            one_of("overflow", &["truncate", "drop"]),
            one_of("on_bad_record", &["error", "skip"]),
            key("eval", Kind::StrOrList),
            key("eval_fraction", Kind::Float),
            one_of("batch_by", &["rows", "tokens"]),
            key("max_tokens", Kind::Int),
        ],
    ),
    (
        "train",
        true,
        &[
            key("seed", Kind::Int),
            key("micro_batch_size", Kind::Int),
            key("grad_accum_steps", Kind::Int),
            req("max_steps", Kind::Int),
            req("lr", Kind::Float),
            one_of("lr_scheduler", &["constant", "constant_with_warmup", "linear", "cosine"]),
            key("warmup_steps", Kind::Int),
            key("weight_decay", Kind::Float),
            key("adam_betas", Kind::FloatPair),
            key("adam_eps", Kind::Float),
            key("max_grad_norm", Kind::Float),
            key("log_every", Kind::Int),
            key("activation_checkpointing", Kind::BoolOrAuto),
            key("activation_memory_mb", Kind::Int),
            key("eval_every", Kind::Int),
        ],
    ),
    ("output", true, &[req("dir", Kind::Str), key("tensorboard", Kind::Bool)]),
    ("checkpoint", false, &[key("every_steps", Kind::Int), key("keep_last", Kind::Int), key("resume", Kind::Str)]),
    ("export", false, &[key("merged", Kind::Bool), one_of("dtype", &["f32", "bf16", "f16"]), key("max_shard_size", Kind::Str), key("gguf", Kind::Bool)]),
    (
        "dist",
        false,
        &[
            key("world_size", Kind::Int),
            key("devices", Kind::StrList),
            key("zero_stage", Kind::Int),
            one_of("offload_optimizer", &["cpu", "none"]),
            key("prefetch_layers", Kind::Int),
            key("timeout_s", Kind::Int),
        ],
    ),
];

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    pub model: ModelSection,
    pub lora: LoraSection,
    pub data: DataSection,
    pub train: TrainSection,
    pub output: OutputSection,
    #[serde(default)]
    pub checkpoint: CheckpointSection,
    #[serde(default)]
    pub export: ExportSection,
    #[serde(default)]
    pub dist: DistSection,
}

/// Several devices: data parallel over ranks, the frozen base optionally sharded (ZeRO-3).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DistSection {
    /// Ranks in the whole run (all processes). With `devices` unset, this process drives
    /// `world_size / WORLD_SIZE` ranks on `model.device` (CPU ranks share the host).
    #[serde(default)]
    pub world_size: Option<usize>,
    /// This process's devices, one rank (thread) each, e.g. ["cuda:0", "cuda:1"].
    #[serde(default)]
    pub devices: Option<Vec<String>>,
    /// 0: every rank holds the whole frozen base. 3: each holds 1/N and gathers a layer at a time.
    #[serde(default)]
    pub zero_stage: usize,
    /// Where AdamW state lives and runs: "cpu" (host memory, host threads) or "none".
    #[serde(default = "default_offload")]
    pub offload_optimizer: String,
    /// Layers gathered ahead of the one running (ZeRO-3).
    #[serde(default = "one")]
    pub prefetch_layers: usize,
    /// Seconds a collective waits for the other ranks before giving up with an error.
    #[serde(default = "default_timeout")]
    pub timeout_s: u64,
}

impl Default for DistSection {
    fn default() -> Self {
        DistSection { world_size: None, devices: None, zero_stage: 0, offload_optimizer: default_offload(), prefetch_layers: 1, timeout_s: default_timeout() }
    }
}

fn default_offload() -> String {
    "cpu".into()
}
fn default_timeout() -> u64 {
    600
}

/// What to export at the end of training, besides the adapter (always written).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportSection {
    /// Also write `<output.dir>/merged`: the base with the adapter merged in.
    #[serde(default)]
    pub merged: bool,
    /// Dtype of the merged model (default: the base's).
    #[serde(default)]
    pub dtype: Option<String>,
    /// Cut merged shards at this size, e.g. "5GB" (default: the base's layout).
    #[serde(default)]
    pub max_shard_size: Option<String>,
    /// Also write `<output.dir>/adapter.gguf`: the adapter as a llama.cpp LoRA GGUF
    /// (`llama-cli -m base.gguf --lora adapter.gguf`; llama and qwen2 bases).
    #[serde(default)]
    pub gguf: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSection {
    /// Save every N optimizer steps (0: only at the end and on SIGINT/SIGTERM).
    #[serde(default = "default_every")]
    pub every_steps: usize,
    /// Checkpoints kept (0 keeps all).
    #[serde(default = "default_keep")]
    pub keep_last: usize,
    /// "auto" (newest valid checkpoint in output.dir, if any), "never", or a checkpoint folder.
    #[serde(default = "default_resume")]
    pub resume: String,
}

impl Default for CheckpointSection {
    fn default() -> Self {
        CheckpointSection { every_steps: default_every(), keep_last: default_keep(), resume: default_resume() }
    }
}

fn default_every() -> usize {
    100
}
fn default_keep() -> usize {
    3
}
fn default_resume() -> String {
    "auto".into()
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// Local HF folder (resolved against the recipe folder) or a hub repo id (`org/name`),
    /// downloaded into the hub cache on first use.
    pub path: String,
    /// Branch, tag or commit of a repo id (default `main`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// The frozen base's dtype. "auto" (the default) is resolved when the recipe loads: bf16
    /// on a CPU with a bf16 unit (AMX or AVX512-BF16, which run its matmuls about twice as
    /// fast as f32, with f32 sums), bf16 on other CPUs when the checkpoint is stored in bf16
    /// (kept as it is and widened to f32 math: half the memory, the same results), f32
    /// elsewhere (GPUs included: name bf16 there).
    #[serde(default = "default_dtype")]
    pub dtype: String,
    #[serde(default = "default_device")]
    pub device: String,
    /// "auto": a bf16 base on a CPU with AMX or AVX512-BF16 runs its frozen matmuls and the
    /// attention's GEMMs in bf16 (f32 sums);
    /// "f32": f32 math everywhere on CPU.
    #[serde(default = "default_matmul")]
    pub matmul: String,
    /// Which op versions run (`ops::dispatch`). "auto": the fused CPU kernels on a CPU (f32
    /// activations, fastest there), the portable ones on a GPU. "portable": the portable
    /// versions on any device: on a CPU, the exact path a GPU run takes, with activations in
    /// `dtype` (a bf16 base trains with bf16 activations); slower on a CPU, for checking what
    /// a GPU run will compute.
    #[serde(default = "default_matmul")]
    pub kernels: String,
    /// Quantise a safetensors base as it is read and train on it (QLoRA): "q8_0" (about
    /// 1/4 of f32, within 0.5% of the weights), "q4_k" (1/7, the llama.cpp Q4_K_M staple;
    /// coarser, so the base model itself changes more). Unset: the base stays in `dtype`.
    /// A GGUF `path` is quantized already and keeps its own types.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantize: Option<String>,
}

impl ModelSection {
    /// `kernels` as the dispatch reads it (validated on load).
    pub fn kernels(&self) -> crate::ops::Kernels {
        crate::ops::Kernels::parse(&self.kernels).unwrap_or_default()
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraSection {
    pub rank: usize,
    pub alpha: f64,
    #[serde(default)]
    pub dropout: f64,
    /// Leaf names of the linears to adapt; unset = the model's attention projections
    /// ([`LoraSection::spec`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub targets: Option<Vec<String>>,
    /// MoE models: adapt every routed expert's MLP targets too, not only the shared experts.
    #[serde(default)]
    pub routed_experts: bool,
    #[serde(default)]
    pub init_from: Option<PathBuf>,
}

impl LoraSection {
    /// The adapter settings for a model: `targets` as given, or by default its attention
    /// projections (Llama / Qwen2: q, k, v, o; DeepSeek MLA: q_proj or q_a_proj + q_b_proj,
    /// kv_a_proj_with_mqa, kv_b_proj, o_proj). Names the model lacks are refused later, by
    /// `Adapters::init`, with the list of names it has.
    pub fn spec(&self, cfg: &crate::config::ModelConfig) -> crate::lora::LoraSpec {
        let listed: Vec<String> = match &self.targets {
            Some(t) => t.clone(),
            // Every layer has the same attention: layer 0's names it.
            None => cfg.linear_sites(0).iter().filter_map(|p| p.strip_prefix("self_attn.")).map(String::from).collect(),
        };
        let targets = ALL_TARGETS.iter().filter(|m| listed.iter().any(|t| t == *m)).map(|s| s.to_string()).collect();
        crate::lora::LoraSpec { rank: self.rank, alpha: self.alpha, dropout: self.dropout, targets, routed_experts: self.routed_experts }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// One source or several, read one after another.
    pub train: Paths,
    /// DatasetDict split when `train` names a dict folder without `:split`.
    #[serde(default)]
    pub split: Option<String>,
    #[serde(default = "default_format")]
    pub format: String,
    /// How text records become tokens (default per format: alpaca -> "alpaca", else "model").
    #[serde(default)]
    pub template: Option<String>,
    /// Column renames: `columns = { instruction = "question", output = "answer" }`.
    #[serde(default)]
    pub columns: std::collections::BTreeMap<String, String>,
    /// Train on every token instead of only the assistant's.
    #[serde(default)]
    pub train_on_prompt: bool,
    /// On unless set false, as in transformers' Trainer (and so TRL): a file sorted by
    /// source or length would otherwise be trained on in that order.
    #[serde(default = "default_shuffle")]
    pub shuffle: bool,
    #[serde(default = "default_shuffle_buffer")]
    pub shuffle_buffer: usize,
    #[serde(default = "default_max_seq_len")]
    pub max_seq_len: usize,
    /// Pack several records into each max_seq_len row (attention and positions per record).
    #[serde(default)]
    pub packing: bool,
    /// Records longer than max_seq_len: "truncate" or "drop".
    #[serde(default = "default_overflow")]
    pub overflow: String,
    /// Records that cannot be used: "error" (stop, naming the row) or "skip" (count, report).
    #[serde(default = "default_on_bad")]
    pub on_bad_record: String,
    /// Evaluation data (same format), or hold out `eval_fraction` of `train`.
    #[serde(default)]
    pub eval: Option<Paths>,
    #[serde(default)]
    pub eval_fraction: f64,
    /// "rows" (micro_batch_size rows) or "tokens" (similar lengths together under max_tokens).
    #[serde(default = "default_batch_by")]
    pub batch_by: String,
    /// Padded tokens per micro-batch with batch_by = "tokens".
    #[serde(default = "default_max_tokens")]
    pub max_tokens: usize,
}

/// One path or a list of them.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum Paths {
    One(PathBuf),
    Many(Vec<PathBuf>),
}

impl Paths {
    pub fn list(&self) -> Vec<PathBuf> {
        match self {
            Paths::One(p) => vec![p.clone()],
            Paths::Many(v) => v.clone(),
        }
    }
}

fn default_overflow() -> String {
    "truncate".into()
}
fn default_on_bad() -> String {
    "error".into()
}
fn default_batch_by() -> String {
    "rows".into()
}
fn default_max_tokens() -> usize {
    4096
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainSection {
    #[serde(default)]
    pub seed: u64,
    #[serde(default = "one")]
    pub micro_batch_size: usize,
    #[serde(default = "one")]
    pub grad_accum_steps: usize,
    pub max_steps: usize,
    pub lr: f64,
    #[serde(default = "default_scheduler")]
    pub lr_scheduler: String,
    #[serde(default)]
    pub warmup_steps: usize,
    #[serde(default)]
    pub weight_decay: f64,
    #[serde(default = "default_betas")]
    pub adam_betas: [f64; 2],
    #[serde(default = "default_eps")]
    pub adam_eps: f64,
    #[serde(default = "default_clip")]
    pub max_grad_norm: f64,
    #[serde(default = "one")]
    pub log_every: usize,
    /// true: recompute every layer in backward, keeping only layer inputs (the leanest);
    /// false: keep every layer's activations (the fastest, ~L times the activation memory);
    /// "auto" (default): recompute, and keep the attention outputs, then the SwiGLU inputs,
    /// then the attention projections' outputs, of as many layers as `activation_memory_mb`
    /// allows, so their recomputation skips the attention kernel and the GEMMs, and with what
    /// is left leave the last layers out of checkpointing (`ops::checkpoint`; same gradients
    /// bit for bit).
    #[serde(default)]
    pub activation_checkpointing: Checkpointing,
    /// What "auto" checkpointing may keep per micro-batch, in MB (unset: with a 16-bit base
    /// every layer's attention output and SwiGLU inputs up to 2048 tokens and, beyond 1024,
    /// the projection outputs of up to two fifths of the layers; with an f32 base two to four
    /// times the saved layer inputs; and when every layer fits whole in a quarter of the base's
    /// bytes, all three kinds in every layer, or no checkpointing at all where some layer
    /// cannot keep its SwiGLU inputs: `train::checkpoint_layers`, `default_keep_budget`).
    /// Unset, micro-batches of rows over 2048 tokens also run in passes of at most 2048, each
    /// with that default (`train::pass_tokens`); set, the budget is for the whole micro-batch.
    #[serde(default)]
    pub activation_memory_mb: Option<usize>,
    /// Evaluate every N steps (0: only at the end when eval data is set).
    #[serde(default)]
    pub eval_every: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputSection {
    pub dir: PathBuf,
    /// TensorBoard event files under `<dir>/tensorboard/` (loss, lr, grad_norm, tokens/s,
    /// eval loss, memory): the numbers of metrics.jsonl, for `tensorboard --logdir`.
    #[serde(default)]
    pub tensorboard: bool,
}

/// `train.activation_checkpointing`: true, false or "auto" in the recipe.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Checkpointing {
    /// Keep every layer's activations until backward.
    Off,
    /// Keep each layer's input; recompute the layer in backward.
    On,
    /// As `On`, plus the attention outputs, SwiGLU inputs and projection outputs of the last
    /// layers that fit `activation_memory_mb`, then the last layers whole (not checkpointed)
    /// while they fit.
    #[default]
    Auto,
}

impl Checkpointing {
    pub fn is_on(self) -> bool {
        self != Checkpointing::Off
    }
}

impl Serialize for Checkpointing {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Checkpointing::Off => s.serialize_bool(false),
            Checkpointing::On => s.serialize_bool(true),
            Checkpointing::Auto => s.serialize_str("auto"),
        }
    }
}

impl<'de> Deserialize<'de> for Checkpointing {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bool(bool),
            Str(String),
        }
        match Raw::deserialize(d)? {
            Raw::Bool(true) => Ok(Checkpointing::On),
            Raw::Bool(false) => Ok(Checkpointing::Off),
            Raw::Str(s) if s == "auto" => Ok(Checkpointing::Auto),
            Raw::Str(s) => Err(serde::de::Error::custom(format!("expected true, false or \"auto\", found \"{s}\""))),
        }
    }
}

fn default_dtype() -> String {
    "auto".into()
}

/// What `model.dtype = "auto"` means for this recipe on this machine (`dir`: the recipe's
/// folder): with the fused CPU kernels and bf16 matmuls (the defaults of `model.kernels` and
/// `model.matmul`) on every device, bf16 on a CPU with a bf16 unit, and bf16 elsewhere too
/// when the checkpoint is stored in bf16 and read as it is, not quantised (kept bf16, widened
/// to f32 math in the GEMM: half the memory, the same results); f32 otherwise, GPUs included.
fn auto_dtype(r: &Recipe, dir: &Path) -> &'static str {
    let devices = r.dist.devices.clone().unwrap_or_else(|| vec![r.model.device.clone()]);
    let cpu = devices.iter().all(|d| d.trim() == "cpu");
    let fused_bf16 = cpu && r.model.kernels == "auto" && r.model.matmul == "auto";
    let kept_bf16 = || r.model.quantize.is_none() && crate::weights::stored_all_bf16(&r.model.path, r.model.revision.as_deref(), dir);
    if fused_bf16 && (crate::ops::bf16_gemm::available() || kept_bf16()) {
        "bf16"
    } else {
        "f32"
    }
}
fn default_matmul() -> String {
    "auto".into()
}
fn default_device() -> String {
    "cpu".into()
}
const DEFAULT_FORMAT: &str = "tokenized";
/// The most ranks a run (or `finetune plan --world-size`) may have.
pub const MAX_WORLD_SIZE: usize = 1 << 16;
fn default_format() -> String {
    DEFAULT_FORMAT.into()
}
fn default_shuffle_buffer() -> usize {
    10_000
}
fn default_max_seq_len() -> usize {
    2048
}
/// transformers' Trainer's (and so TRL's) default: a recipe moved over from there without
/// `lr_scheduler_type` gets the same learning rates here.
fn default_scheduler() -> String {
    "linear".into()
}
fn default_shuffle() -> bool {
    true
}
fn default_betas() -> [f64; 2] {
    [0.9, 0.999]
}
fn default_eps() -> f64 {
    1e-8
}
fn default_clip() -> f64 {
    1.0
}
fn one() -> usize {
    1
}

/// A recipe as loaded: the typed sections plus where it came from.
#[derive(Clone, Debug)]
pub struct LoadedRecipe {
    pub recipe: Recipe,
    /// The recipe file (for error messages).
    pub file: PathBuf,
    /// Folder that relative paths resolve against.
    pub dir: PathBuf,
    /// `model.dtype` was "auto" (resolved in `recipe.model.dtype`): a resumed run then keeps
    /// the dtype its checkpoint was trained in (`train::run_with`).
    pub dtype_auto: bool,
    /// The `section.key`s the file and the overrides set (the rest are defaults): a resume
    /// refused over a key the recipe does not set says how to set it.
    pub written: std::collections::BTreeSet<String>,
}

impl LoadedRecipe {
    /// Read a recipe file and apply `section.key=value` overrides.
    pub fn load(file: &Path, overrides: &[String]) -> Result<Self> {
        let text = std::fs::read_to_string(file).map_err(|e| Error::io(file, e))?;
        let dir = file.parent().map(Path::to_path_buf).unwrap_or_default();
        let dir = if dir.as_os_str().is_empty() { PathBuf::from(".") } else { dir };
        Self::from_str(&text, file, &dir, overrides)
    }

    pub fn from_str(text: &str, file: &Path, dir: &Path, overrides: &[String]) -> Result<Self> {
        let fname = file.display().to_string();
        let mut value: toml::Table = toml::from_str(text).map_err(|e| Error::Recipe {
            file: fname.clone(),
            key: "(syntax)".into(),
            msg: e.to_string(),
        })?;
        for o in overrides {
            apply_override(&mut value, o, &fname)?;
        }
        let written = value.iter().flat_map(|(s, v)| v.as_table().into_iter().flat_map(move |t| t.keys().map(move |k| format!("{s}.{k}")))).collect();
        // Before the schema check, which reads `data.template = "$TEMPLATES/chat.jinja"`
        // by its expanded ending.
        expand_paths(&mut value, &fname)?;
        check_schema(&value, &fname)?;
        check_inert_keys(&value, &fname)?;
        for n in switched_off_knobs(&value) {
            crate::note!("note: recipe {fname}: {n}");
        }
        let recipe: Recipe = toml::Value::Table(value).try_into().map_err(|e: toml::de::Error| {
            Error::Recipe { file: fname.clone(), key: "(structure)".into(), msg: e.message().to_string() }
        })?;
        let dtype_auto = recipe.model.dtype == "auto";
        let mut loaded = LoadedRecipe { recipe, file: file.to_path_buf(), dir: dir.to_path_buf(), dtype_auto, written };
        if dtype_auto {
            loaded.recipe.model.dtype = auto_dtype(&loaded.recipe, &loaded.dir).into();
        }
        loaded.check_values()?;
        Ok(loaded)
    }

    /// The Jinja file `data.template` names, resolved against the recipe's folder (`None`
    /// when it names a built-in template or the model's own).
    pub fn chat_template_file(&self) -> Option<PathBuf> {
        self.recipe.data.template.as_deref().filter(|t| crate::data::format::is_template_file(t)).map(|t| self.resolve(Path::new(t)))
    }

    /// [`Self::chat_template_file`], which must be a file (checked where the data is read, so
    /// `export --run` needs no template the adapter already carries).
    pub fn existing_chat_template_file(&self) -> Result<Option<PathBuf>> {
        match self.chat_template_file() {
            Some(p) if !p.is_file() => Err(self.err("data.template", format!("{} is not a file (a path to a Jinja chat template, relative to the recipe's folder)", p.display()))),
            p => Ok(p),
        }
    }

    /// Resolve a path from the recipe against the recipe's folder.
    pub fn resolve(&self, p: &Path) -> PathBuf {
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            clean(&self.dir.join(p))
        }
    }

    fn err(&self, key: &str, msg: impl Into<String>) -> Error {
        Error::Recipe { file: self.file.display().to_string(), key: key.into(), msg: msg.into() }
    }

    /// `data.batch_by = "tokens"`: whole records grouped by length under `data.max_tokens`.
    fn check_token_batches(&self) -> Result<()> {
        let d = &self.recipe.data;
        if d.batch_by != "tokens" {
            return Ok(());
        }
        // Token batching never packs: asking for both would silently train unpacked rows.
        if d.packing {
            return Err(self.err("data.packing", "cannot be combined with data.batch_by = \"tokens\" (token batches group whole records by length; set one of them)"));
        }
        // The shortest record that trains anything has two tokens (max_seq_len's floor too).
        if d.max_tokens < 2 {
            return Err(self.err("data.max_tokens", format!("is {}; a micro-batch must hold at least one record of 2 tokens", d.max_tokens)));
        }
        // (A record longer than max_tokens is refused when the loader meets one: a max_seq_len
        // over the budget is fine where no record is that long.)
        Ok(())
    }

    /// Checks that need more than one key or a value range, section by section.
    fn check_values(&self) -> Result<()> {
        self.check_lora()?;
        self.check_sizes()?;
        self.check_token_batches()?;
        self.check_train()?;
        self.check_data()?;
        self.check_dist()?;
        let r = &self.recipe;
        if let Some(s) = &r.export.max_shard_size {
            crate::export::parse_size(s).map_err(|m| self.err("export.max_shard_size", m))?;
        }
        Ok(())
    }

    fn check_lora(&self) -> Result<()> {
        let r = &self.recipe;
        if r.lora.rank == 0 {
            return Err(self.err("lora.rank", "must be at least 1"));
        }
        if !(0.0..1.0).contains(&r.lora.dropout) {
            return Err(self.err("lora.dropout", "must be in [0, 1)"));
        }
        let targets = r.lora.targets.as_deref().unwrap_or_default();
        if r.lora.targets.is_some() && targets.is_empty() {
            return Err(self.err("lora.targets", "needs at least one module"));
        }
        for t in targets {
            // DeepSeek-V2/V3's router (`mlp.gate`) chooses the experts: adapting it is not
            // LoRA on a projection, and transformers keeps it in f32 apart from the rest.
            if t == "gate" || t.ends_with("mlp.gate") {
                return Err(self.err("lora.targets", format!("\"{t}\" is the MoE router, which stays frozen (it is never a LoRA target); the experts' projections are gate_proj, up_proj and down_proj")));
            }
            if !ALL_TARGETS.contains(&t.as_str()) {
                return Err(self.err(
                    "lora.targets",
                    format!("unknown module \"{t}\"{}; valid: {}", suggest(t, ALL_TARGETS), ALL_TARGETS.join(", ")),
                ));
            }
        }
        if r.lora.alpha <= 0.0 || !(r.lora.alpha as f32).is_finite() {
            return Err(self.err("lora.alpha", format!("must be > 0 and below {:e}, an f32 (the LoRA update is scaled by alpha / rank in f32)", f32::MAX)));
        }
        Ok(())
    }

    /// Counts and sizes: at least 1 (2 tokens a row), and at most what memory and arithmetic hold.
    fn check_sizes(&self) -> Result<()> {
        let r = &self.recipe;
        for (k, v) in [
            ("train.micro_batch_size", r.train.micro_batch_size),
            ("train.grad_accum_steps", r.train.grad_accum_steps),
            ("train.max_steps", r.train.max_steps),
            ("train.log_every", r.train.log_every),
            ("data.max_seq_len", r.data.max_seq_len),
        ] {
            if v == 0 {
                return Err(self.err(k, "must be at least 1"));
            }
        }
        // Upper bounds: each of these sizes something held in memory (a step holds all its
        // micro-batches, the shuffle buffer holds its rows), so a typo such as 1e12 must be
        // a message here, not an allocation failure that aborts the process later.
        for (k, v, max, what) in [
            ("train.micro_batch_size", r.train.micro_batch_size, 1 << 16, "rows per micro-batch"),
            ("train.grad_accum_steps", r.train.grad_accum_steps, 1 << 16, "micro-batches held per step"),
            ("train.max_steps", r.train.max_steps, 1 << 40, "optimizer steps"),
            ("data.max_seq_len", r.data.max_seq_len, 1 << 20, "tokens per row"),
            ("data.max_tokens", r.data.max_tokens, 1 << 24, "tokens per micro-batch"),
            ("data.shuffle_buffer", r.data.shuffle_buffer, 1 << 22, "rows held for shuffling"),
            ("lora.rank", r.lora.rank, 1 << 16, "LoRA rank"),
            ("dist.prefetch_layers", r.dist.prefetch_layers, 1 << 10, "layers gathered ahead"),
            ("dist.timeout_s", r.dist.timeout_s as usize, 10_000_000, "seconds (about 115 days)"),
            ("dist.world_size", r.dist.world_size.unwrap_or(1), MAX_WORLD_SIZE, "ranks"),
        ] {
            if v > max {
                return Err(self.err(k, format!("{v} is more than this tool accepts ({max} {what})")));
            }
        }
        if r.data.max_seq_len < 2 {
            return Err(self.err("data.max_seq_len", "must be at least 2 (one input, one target)"));
        }
        Ok(())
    }

    /// The optimizer and its schedule.
    fn check_train(&self) -> Result<()> {
        let r = &self.recipe;
        let t = &r.train;
        if t.weight_decay < 0.0 {
            return Err(self.err("train.weight_decay", "must be >= 0"));
        }
        if t.adam_eps <= 0.0 {
            return Err(self.err("train.adam_eps", "must be > 0 (it keeps AdamW from dividing by zero)"));
        }
        // transformers' "constant" has no warmup ("constant_with_warmup" has); a recipe moved
        // over from there must not get another learning rate here.
        if t.lr_scheduler == "constant" && t.warmup_steps > 0 {
            return Err(self.err(
                "train.lr_scheduler",
                format!(
                    "\"constant\" has no warmup (as in transformers), but train.warmup_steps = {}; \
                     use \"constant_with_warmup\", or set train.warmup_steps = 0",
                    t.warmup_steps
                ),
            ));
        }
        if r.train.lr < 0.0 || !r.train.lr.is_finite() {
            return Err(self.err("train.lr", "must be a finite number >= 0"));
        }
        let [b1, b2] = r.train.adam_betas;
        if !(0.0..1.0).contains(&b1) || !(0.0..1.0).contains(&b2) {
            return Err(self.err("train.adam_betas", "both betas must be in [0, 1)"));
        }
        if r.train.max_grad_norm < 0.0 {
            return Err(self.err("train.max_grad_norm", "must be >= 0 (0 turns clipping off)"));
        }
        Ok(())
    }

    /// Shuffling, column remaps and the evaluation set.
    fn check_data(&self) -> Result<()> {
        let r = &self.recipe;
        // A buffer of 0 or 1 rows shuffles nothing within a block: the run would look shuffled
        // and read rows in the file's order.
        if r.data.shuffle && r.data.shuffle_buffer < 2 {
            return Err(self.err("data.shuffle_buffer", format!("is {}; with data.shuffle = true it must hold at least 2 rows (or set data.shuffle = false for the files' order)", r.data.shuffle_buffer)));
        }
        // A remap the format never reads (a typo: `inpt = "context"`) would silently train
        // without that column.
        let read = crate::data::Formatter::columns_read(&r.data.format);
        if let Some(k) = r.data.columns.keys().find(|k| !read.contains(&k.as_str())) {
            return Err(self.err(
                "data.columns",
                format!("`{k}` is not a column data.format = \"{}\" reads; it reads {}", r.data.format, read.join(", ")),
            ));
        }
        if let Some(k) = r.data.columns.iter().find(|(_, v)| v.trim().is_empty()).map(|(k, _)| k) {
            return Err(self.err("data.columns", format!("maps `{k}` to an empty column name; name the dataset's column, or drop `{k}` to read `{k}`")));
        }
        // Two read columns from one dataset column (`tools = "messages"`) would hand one
        // column's content to both: the effective column of every read name must differ.
        let effective = |k: &'static str| -> &str { r.data.columns.get(k).map_or(k, String::as_str) };
        for (i, a) in read.iter().enumerate() {
            if let Some(b) = read[i + 1..].iter().find(|&&b| effective(b) == effective(a)) {
                return Err(self.err("data.columns", format!("`{a}` and `{b}` would both read the dataset column `{}`", effective(a))));
            }
        }
        if r.train.eval_every > 0 && r.data.eval.is_none() && r.data.eval_fraction == 0.0 {
            return Err(self.err("train.eval_every", "there is nothing to evaluate on: set data.eval (a held-out source) or data.eval_fraction, or train.eval_every = 0"));
        }
        if !(0.0..1.0).contains(&r.data.eval_fraction) {
            return Err(self.err("data.eval_fraction", "must be in [0, 1)"));
        }
        if r.data.eval.is_some() && r.data.eval_fraction > 0.0 {
            return Err(self.err("data.eval_fraction", "set data.eval or data.eval_fraction, not both"));
        }
        Ok(())
    }

    /// Devices and ranks.
    fn check_dist(&self) -> Result<()> {
        let r = &self.recipe;
        crate::device::parse_device(&r.model.device).map_err(|m| self.err("model.device", m))?;
        let d = &r.dist;
        if d.zero_stage != 0 && d.zero_stage != 3 {
            return Err(self.err("dist.zero_stage", format!("must be 0 (replicated base) or 3 (sharded base), got {}", d.zero_stage)));
        }
        if d.world_size == Some(0) {
            return Err(self.err("dist.world_size", "must be at least 1"));
        }
        if let Some(devs) = &d.devices {
            if devs.is_empty() {
                return Err(self.err("dist.devices", "needs at least one device"));
            }
            for dev in devs {
                crate::device::parse_device(dev).map_err(|m| self.err("dist.devices", m))?;
            }
        }
        if d.timeout_s == 0 {
            return Err(self.err("dist.timeout_s", "must be at least 1 second"));
        }
        if d.zero_stage == 3 && r.train.activation_checkpointing == Checkpointing::Off {
            return Err(self.err(
                "dist.zero_stage",
                "ZeRO-3 needs train.activation_checkpointing = true or \"auto\": without it the autograd graph keeps \
                 every gathered layer until backward, i.e. the whole base on every rank",
            ));
        }
        Ok(())
    }
}

/// Lexically drop `.` and fold `dir/..` so printed paths read as users expect.
fn clean(p: &Path) -> PathBuf {
    use std::path::Component;
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                if matches!(out.components().next_back(), Some(Component::Normal(_))) {
                    out.pop();
                } else {
                    out.push("..");
                }
            }
            other => out.push(other),
        }
    }
    if out.as_os_str().is_empty() {
        PathBuf::from(".")
    } else {
        out
    }
}

fn apply_override(table: &mut toml::Table, o: &str, file: &str) -> Result<()> {
    let bad = |msg: String| Error::Recipe { file: file.into(), key: format!("--set {o}"), msg };
    let (k, v) = o
        .split_once('=')
        .ok_or_else(|| bad("expected section.key=value, e.g. --set train.lr=2e-4".into()))?;
    let (section, key) = k
        .trim()
        .split_once('.')
        .ok_or_else(|| bad("expected section.key=value, e.g. --set train.lr=2e-4".into()))?;
    let v = v.trim();
    if v.is_empty() {
        return Err(bad("no value after `=` (quote an empty string: --set 'key=\"\"')".into()));
    }
    // A value is TOML (numbers, bools, lists, quoted strings); anything that does not parse as
    // TOML is taken as a bare string so `--set model.path=/models/x` needs no quotes. No key
    // takes a date: `output.dir=2024-06-01` is the folder's name.
    let value = match toml::from_str::<toml::Table>(&format!("v = {v}")).ok().and_then(|mut t| t.remove("v")) {
        // A list or table that is not TOML (`[a.jsonl]`): taken as a string it became a path
        // or a hub repo named "[a.jsonl]".
        None if v.starts_with(['[', '{']) => {
            let msg = format!("got `{v}`, which is not a TOML list or table (quote each element: --set '{k}=[\"a\", \"b\"]')");
            return Err(Error::Recipe { file: file.into(), key: k.trim().to_string(), msg });
        }
        // Only TOML's own integers can overflow (no leading 0; i64 has 19 digits).
        None if is_long_toml_integer(v) => {
            return Err(bad(format!("{v} is beyond the integer range (quote it if it is a name: --set '{k}=\"{v}\"')")));
        }
        Some(toml::Value::Datetime(_)) | None => toml::Value::String(v.to_string()),
        Some(x) => x,
    };
    let sec = table
        .entry(section.to_string())
        .or_insert_with(|| toml::Value::Table(Default::default()));
    let toml::Value::Table(t) = sec else { return Err(bad(format!("`{section}` is not a section"))) };
    // One more level for table keys: `--set data.columns.prompt=question`.
    match key.split_once('.') {
        Some((key, sub)) => match t.entry(key.to_string()).or_insert_with(|| toml::Value::Table(Default::default())) {
            toml::Value::Table(inner) => {
                inner.insert(sub.to_string(), value);
                Ok(())
            }
            _ => Err(bad(format!("`{section}.{key}` is not a table of keys"))),
        },
        None => {
            t.insert(key.to_string(), value);
            Ok(())
        }
    }
}

/// Whether `v` is spelt as a TOML integer of 19 digits or more (optionally signed, no leading
/// zero): one that fails to parse only by overflowing.
fn is_long_toml_integer(v: &str) -> bool {
    let digits = v.trim_start_matches(['-', '+']);
    digits.len() >= 19 && !digits.starts_with('0') && digits.bytes().all(|b| b.is_ascii_digit())
}

/// Knobs set in the recipe for a feature another key turns off, as "`knob` does nothing
/// with `switch`" lines. A note, not an error as in [`check_inert_keys`]: the shipped recipes
/// set some of them, and `--set` can switch a feature off for one run but cannot remove a
/// key, so an error would send the user to edit the recipe for a run that is what they asked.
fn switched_off_knobs(t: &toml::Table) -> Vec<String> {
    let get = |section: &str, key: &str| t.get(section).and_then(|s| s.as_table()).and_then(|s| s.get(key));
    let mut notes = Vec::new();
    let mut off = |knob: &str, on: bool, why: &str| {
        let (section, key) = knob.split_once('.').unwrap_or_default();
        if !on && get(section, key).is_some() {
            notes.push(format!("`{knob}` does nothing {why}"));
        }
    };
    let merged = get("export", "merged").and_then(|v| v.as_bool()) == Some(true);
    off("export.dtype", merged, "without export.merged = true (it is the merged model's dtype; the adapter is written as trained)");
    off("export.max_shard_size", merged, "without export.merged = true (it cuts the merged model's shards)");
    // With batch_by = "tokens" the buffer's size is also the pool a batch is cut from.
    let shuffle = get("data", "shuffle").and_then(|v| v.as_bool()) != Some(false);
    let pooled = get("data", "batch_by").and_then(|v| v.as_str()) == Some("tokens");
    off("data.shuffle_buffer", shuffle || pooled, "with data.shuffle = false (rows are read in the files' order)");
    let auto = get("train", "activation_checkpointing").is_none_or(|v| v.as_str() == Some("auto"));
    off("train.activation_memory_mb", auto, "unless train.activation_checkpointing = \"auto\" (it is what auto may keep)");
    let zero3 = get("dist", "zero_stage").and_then(|v| v.as_integer()) == Some(3);
    off("dist.prefetch_layers", zero3, "without dist.zero_stage = 3 (only a sharded base gathers layers)");
    notes
}

/// Keys set in the recipe that the rest of it would make do nothing: a user who sets one
/// means something by it, and training without it would be a silent surprise.
fn check_inert_keys(t: &toml::Table, file: &str) -> Result<()> {
    let data = t.get("data").and_then(|d| d.as_table());
    let get = |k: &str| data.and_then(|d| d.get(k));
    let err = |key: &str, msg: String| Err(Error::Recipe { file: file.into(), key: key.into(), msg });
    let format = get("format").and_then(|v| v.as_str()).unwrap_or(DEFAULT_FORMAT);
    if get("template").is_some() && matches!(format, "tokenized" | "text") {
        return err(
            "data.template",
            format!("data.format = \"{format}\" has no prompt to template (a template renders alpaca, prompt_completion and messages records); remove data.template"),
        );
    }
    if get("max_tokens").is_some() && get("batch_by").and_then(|v| v.as_str()) != Some("tokens") {
        return err("data.max_tokens", "is the token budget of data.batch_by = \"tokens\"; set that too, or remove data.max_tokens".into());
    }
    Ok(())
}

/// Keys that hold paths (or lists of them), where `~` and `$VAR` are expanded as a shell
/// would: a recipe shared between machines says `~/models/x` or `$DATA/alpaca`, and taking
/// those literally made a folder named `~` or looked `~/m` up as a hub repo.
pub const PATH_KEYS: &[(&str, &str)] =
    &[("model", "path"), ("data", "train"), ("data", "eval"), ("data", "template"), ("lora", "init_from"), ("output", "dir"), ("checkpoint", "resume")];

fn expand_paths(t: &mut toml::Table, file: &str) -> Result<()> {
    for &(sec, key) in PATH_KEYS {
        let Some(v) = t.get_mut(sec).and_then(|s| s.as_table_mut()).and_then(|s| s.get_mut(key)) else { continue };
        let err = |msg: String| Error::Recipe { file: file.into(), key: format!("{sec}.{key}"), msg };
        // An empty path resolves to the recipe's own folder: output.dir = "" wrote the run
        // beside the recipe, model.path = "" looked for its config.json there.
        let expand = |s: &str| match s.trim().is_empty() {
            true => Err("is empty; expected a path".to_string()),
            false => expand_path(s),
        };
        match v {
            toml::Value::String(s) => *s = expand(s).map_err(err)?,
            toml::Value::Array(a) => {
                for item in a.iter_mut() {
                    if let toml::Value::String(s) = item {
                        *s = expand(s).map_err(err)?;
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// `~` or `~/...` at the start becomes $HOME; `$NAME` and `${NAME}` anywhere become that
/// environment variable (unset is an error naming it; a `$` not followed by a name stays).
pub fn expand_path(s: &str) -> std::result::Result<String, String> {
    let var = |name: &str| std::env::var(name).map_err(|_| format!("\"{s}\" uses ${name}, which is not set in the environment"));
    let mut out = String::new();
    let rest = match s.strip_prefix('~') {
        Some(r) if r.is_empty() || r.starts_with('/') => {
            out.push_str(&var("HOME")?);
            r
        }
        _ => s,
    };
    let mut chars = rest.char_indices();
    while let Some((i, c)) = chars.next() {
        if c != '$' {
            out.push(c);
            continue;
        }
        let after = &rest[i + 1..];
        let (name, used) = match after.strip_prefix('{') {
            Some(b) => match b.find('}') {
                Some(end) => (&b[..end], end + 2),
                None => return Err(format!("\"{s}\" has a `${{` without its `}}`")),
            },
            None => {
                let n = after.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(after.len());
                (&after[..n], n)
            }
        };
        if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
            out.push('$');
            continue;
        }
        out.push_str(&var(name)?);
        for _ in 0..used {
            chars.next();
        }
    }
    Ok(out)
}

/// Keys as transformers' TrainingArguments, PEFT's LoraConfig and TRL's SFTConfig name them,
/// with this recipe's key: the first thing a user of those tools types, in any section.
const HF_NAMES: &[(&str, &str)] = &[
    ("learning_rate", "train.lr"),
    ("per_device_train_batch_size", "train.micro_batch_size"),
    ("gradient_accumulation_steps", "train.grad_accum_steps"),
    ("lr_scheduler_type", "train.lr_scheduler"),
    ("gradient_checkpointing", "train.activation_checkpointing"),
    ("logging_steps", "train.log_every"),
    ("eval_steps", "train.eval_every"),
    ("warmup_ratio", "train.warmup_steps, in steps (ratio x max_steps)"),
    ("adam_epsilon", "train.adam_eps"),
    ("r", "lora.rank"),
    ("lora_r", "lora.rank"),
    ("lora_alpha", "lora.alpha"),
    ("lora_dropout", "lora.dropout"),
    ("target_modules", "lora.targets"),
    ("max_length", "data.max_seq_len"),
    ("max_seq_length", "data.max_seq_len"),
    ("completion_only_loss", "data.train_on_prompt (inverted)"),
    ("assistant_only_loss", "data.train_on_prompt = false, the default (it follows the chat template's {% generation %} blocks where it has them)"),
    ("save_steps", "checkpoint.every_steps"),
    ("save_total_limit", "checkpoint.keep_last"),
    ("output_dir", "output.dir"),
];

/// Names from the same tools with no key of the same meaning here: what to write instead.
const HF_OTHERS: &[(&str, &str)] = &[
    ("use_rslora", "rsLoRA's scale alpha / sqrt(rank) is plain LoRA's with lora.alpha = alpha x sqrt(rank), the same forward in every tool"),
    ("use_dora", "DoRA is not implemented; this trains plain LoRA"),
    ("bf16", "the base's dtype is model.dtype = \"bf16\"; LoRA weights and optimizer state stay f32"),
    ("fp16", "the base's dtype is model.dtype = \"f16\"; LoRA weights and optimizer state stay f32"),
    ("optim", "the optimizer is AdamW as torch's adamw_torch; its knobs are train.adam_betas, train.adam_eps and train.weight_decay"),
    ("dataset_text_field", "data.format = \"text\" reads the column `text`; name another with data.columns = { text = \"...\" }"),
    ("packing_strategy", "data.packing = true packs whole records into each row, none split (TRL's \"bfd\" in spirit)"),
    ("num_train_epochs", "a run is train.max_steps optimizer steps: `finetune data inspect --recipe ...` (and a run's first lines) say how many records the data has and how many steps an epoch is, so epochs x that is the max_steps to write"),
];

fn check_schema(t: &toml::Table, file: &str) -> Result<()> {
    let err = |key: String, msg: String| Error::Recipe { file: file.into(), key, msg };
    let sections: Vec<&str> = SCHEMA.iter().map(|s| s.0).collect();
    // The section a key of another section's name lives in (`max_seq_len` at the top, or
    // under [train]): the first thing to say about it.
    let home = |key: &str| SCHEMA.iter().find(|(_, _, keys)| keys.iter().any(|k| k.name == key)).map(|s| s.0);
    for (name, v) in t {
        let Some((_, _, keys)) = SCHEMA.iter().find(|s| s.0 == name) else {
            if !v.is_table() {
                if let Some(sec) = home(name) {
                    return Err(err(name.clone(), format!("is a key of [{sec}]: put it under [{sec}] ({sec}.{name})")));
                }
            }
            return Err(err(name.clone(), format!("unknown section{}; valid: {}", suggest(name, &sections), sections.join(", "))));
        };
        let toml::Value::Table(tab) = v else {
            return Err(err(name.clone(), format!("expected a [{name}] section")));
        };
        let names: Vec<&str> = keys.iter().map(|k| k.name).collect();
        for (k, val) in tab {
            let dotted = format!("{name}.{k}");
            let Some(spec) = keys.iter().find(|s| s.name == k) else {
                let other = HF_OTHERS.iter().find(|(hf, _)| *hf == k);
                let hint = match (HF_NAMES.iter().find(|(hf, _)| *hf == k), home(k), other) {
                    (Some((hf, ours)), _, _) => format!(" (`{hf}` in transformers / PEFT / TRL is `{ours}` here)"),
                    (None, Some(sec), _) => format!(" (it is a key of [{sec}]: {sec}.{k})"),
                    (None, None, Some((hf, what))) => format!(" (`{hf}` in transformers / PEFT / TRL: {what})"),
                    (None, None, None) => suggest(k, &names),
                };
                return Err(err(dotted, format!("unknown key{hint}; valid keys in [{name}]: {}", names.join(", "))));
            };
            if !spec.kind.accepts(val) {
                // A string that looks like a number or a bool (a model named 1234, a run dir
                // "true") parses as one, in the file and after --set alike.
                let wants_text = matches!(spec.kind, Kind::Str | Kind::StrOrList) && (val.is_integer() || val.is_float() || val.is_bool());
                // A list written as one string (`targets = "[q_proj]"`; a bare `--set
                // lora.targets=[q_proj]` is stopped earlier, in `apply_override`).
                let bare_list = matches!(spec.kind, Kind::StrList | Kind::StrOrList) && val.as_str().is_some_and(|s| s.starts_with('['));
                // transformers 5 reads a warmup_steps below 1 as a ratio of the steps (its
                // warmup_ratio, deprecated); here it counts steps.
                let ratio = (dotted == "train.warmup_steps").then(|| val.as_float().filter(|f| (0.0..1.0).contains(f))).flatten();
                let steps = tab.get("max_steps").and_then(|v| v.as_integer()).filter(|&n| n > 0);
                let quote = if let Some(f) = ratio {
                    let n = steps.map_or(String::new(), |n| format!(" = {}", (f * n as f64).ceil() as i64));
                    format!(" (a warmup_steps below 1 is a ratio of the steps in transformers; here it counts steps: ceil({f} x train.max_steps){n})")
                } else if wants_text {
                    format!(" (quote it as text: {dotted} = \"{val}\", or --set '{dotted}=\"{val}\"')")
                } else if bare_list {
                    format!(" (quote each element: --set '{dotted}=[\"q_proj\", \"v_proj\"]')")
                } else {
                    String::new()
                };
                return Err(err(dotted, format!("expected {}, got {}{quote}", spec.kind.describe(), show(val))));
            }
            // TOML spells NaN and infinity (`nan`, `inf`); no recipe number means either, and a
            // NaN compares false everywhere, so it would slip through every range check below.
            let non_finite = |v: &toml::Value| v.as_float().is_some_and(|f| !f.is_finite());
            if non_finite(val) || val.as_array().is_some_and(|a| a.iter().any(non_finite)) {
                return Err(err(dotted, format!("expected a finite number, got {}", show(val))));
            }
            if !spec.choices.is_empty() {
                let s = val.as_str().unwrap_or_default();
                let file = spec.or_file.iter().any(|e| s.ends_with(e));
                if !spec.choices.contains(&s) && !file {
                    let or_file = if spec.or_file.is_empty() { String::new() } else { format!(", or a path to a {} file", spec.or_file.join(" or ")) };
                    return Err(err(
                        dotted,
                        format!("\"{s}\" is not one of {}{or_file}{}", spec.choices.join(", "), suggest(s, spec.choices)),
                    ));
                }
            }
        }
    }
    for (name, required, keys) in SCHEMA {
        let tab = t.get(*name).and_then(|v| v.as_table());
        if tab.is_none() && *required {
            return Err(err(name.to_string(), format!("missing section [{name}]")));
        }
        for spec in keys.iter().filter(|k| k.required) {
            if tab.is_none_or(|t| !t.contains_key(spec.name)) {
                return Err(err(format!("{name}.{}", spec.name), format!("missing required key ({})", spec.kind.describe())));
            }
        }
    }
    Ok(())
}

fn show(v: &toml::Value) -> String {
    let s = v.to_string();
    let kind = v.type_str();
    if s.len() > 40 {
        kind.to_string()
    } else {
        format!("{kind} {s}")
    }
}

/// ` (did you mean "x"?)` for the closest candidate within a small edit distance.
pub fn suggest(word: &str, candidates: &[&str]) -> String {
    candidates
        .iter()
        .map(|c| (edit_distance(word, c), *c))
        // Or a name the word begins (`every` for `every_steps`).
        .filter(|(d, c)| *d <= 3.max(c.len() / 3) || (word.len() >= 4 && c.starts_with(word)))
        .min()
        .map(|(_, c)| format!(" (did you mean \"{c}\"?)"))
        .unwrap_or_default()
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_7b_recipe_lists_every_key() {
        // README: "every key is listed in recipes/deepseek-7b-lora.toml with what it trades
        // off" (set, or commented out with its default or an example).
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/recipes/deepseek-7b-lora.toml")).unwrap();
        for (section, _, keys) in SCHEMA {
            assert!(text.contains(&format!("[{section}]")), "[{section}] missing");
            for k in keys.iter().map(|k| k.name) {
                let listed = text.lines().any(|l| l.trim_start_matches(['#', ' ']).split_once('=').is_some_and(|(name, _)| name.trim() == k));
                assert!(listed, "{section}.{k} is not in the recipe");
            }
        }
    }

    const MINIMAL: &str = r#"
[model]
path = "m"
[lora]
rank = 8
alpha = 16
[data]
train = "d"
[train]
max_steps = 3
lr = 1e-3
[output]
dir = "out"
"#;

    fn load(text: &str, overrides: &[&str]) -> Result<LoadedRecipe> {
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        LoadedRecipe::from_str(text, Path::new("r.toml"), Path::new("/recipes"), &o)
    }

    fn err_text(text: &str, overrides: &[&str]) -> String {
        load(text, overrides).unwrap_err().to_string()
    }

    #[test]
    fn a_token_budget_under_one_two_token_record_is_refused() {
        for n in [0, 1] {
            let e = err_text(MINIMAL, &["data.batch_by=\"tokens\"", &format!("data.max_tokens={n}")]);
            assert!(e.contains("data.max_tokens") && e.contains("at least one record of 2 tokens"), "{e}");
        }
        load(MINIMAL, &["data.batch_by=\"tokens\"", "data.max_tokens=2"]).unwrap();
    }

    #[test]
    fn knobs_of_a_switched_off_feature_are_named_in_a_note() {
        let notes = |overrides: &[&str]| {
            let mut t: toml::Table = toml::from_str(MINIMAL).unwrap();
            for o in overrides {
                apply_override(&mut t, o, "r").unwrap();
            }
            load(MINIMAL, overrides).unwrap(); // a note, never an error
            switched_off_knobs(&t)
        };
        assert_eq!(notes(&[]), Vec::<String>::new());
        for (set, knob) in [
            (&["export.dtype=bf16"][..], "export.dtype"),
            (&["export.merged=false", "export.max_shard_size=1GB"], "export.max_shard_size"),
            (&["data.shuffle=false", "data.shuffle_buffer=100"], "data.shuffle_buffer"),
            (&["train.activation_checkpointing=true", "train.activation_memory_mb=512"], "train.activation_memory_mb"),
            (&["train.activation_checkpointing=false", "train.activation_memory_mb=512"], "train.activation_memory_mb"),
            (&["dist.prefetch_layers=2"], "dist.prefetch_layers"),
        ] {
            let n = notes(set);
            assert!(n.len() == 1 && n[0].contains(&format!("`{knob}` does nothing")), "{set:?}: {n:?}");
        }
        for set in [
            &["export.merged=true", "export.dtype=bf16", "export.max_shard_size=1GB"][..],
            &["data.shuffle_buffer=100"],
            // The pool a token batch is cut from, shuffled or not.
            &["data.shuffle=false", "data.batch_by=\"tokens\"", "data.shuffle_buffer=100"],
            &["train.activation_memory_mb=512"],
            &["train.activation_checkpointing=\"auto\"", "train.activation_memory_mb=512"],
            &["dist.zero_stage=3", "dist.prefetch_layers=2"],
        ] {
            assert_eq!(notes(set), Vec::<String>::new(), "{set:?}");
        }
    }

    #[test]
    fn minimal_recipe_fills_defaults() {
        let r = load(MINIMAL, &[]).unwrap().recipe;
        // "auto": bf16 on a CPU with a bf16 unit, f32 elsewhere (no checkpoint at /recipes/m).
        assert_eq!(r.model.dtype, if crate::ops::bf16_gemm::available() { "bf16" } else { "f32" });
        assert_eq!(r.train.activation_checkpointing, Checkpointing::Auto);
        assert_eq!(load(MINIMAL, &["model.matmul=f32"]).unwrap().recipe.model.dtype, "f32", "f32 math asked for: an f32 base");
        assert_eq!(load(MINIMAL, &["model.device=cuda:0"]).unwrap().recipe.model.dtype, "f32", "GPUs: bf16 only when named");
        assert_eq!(load(MINIMAL, &["train.activation_checkpointing=true"]).unwrap().recipe.train.activation_checkpointing, Checkpointing::On);
        let e = err_text(MINIMAL, &["train.activation_checkpointing=yes"]);
        assert!(e.contains("`train.activation_checkpointing`") && e.contains("\"auto\""), "{e}");
        assert_eq!(r.lora.targets, None);
        assert_eq!(r.train.adam_betas, [0.9, 0.999]);
        // transformers' Trainer's defaults (TRL's SFTConfig keeps them).
        assert_eq!(r.train.lr_scheduler, "linear");
        assert!(r.data.shuffle);
    }

    /// `model.dtype = "auto"` keeps a checkpoint stored in bf16 bf16 on every CPU (widened
    /// to f32 math where there is no bf16 unit, so nothing is rounded), and rounds an f32 one
    /// to bf16 only where a bf16 unit will run it; a quantised base dequantises into f32
    /// without a unit (bf16 would round its dequantised values).
    #[test]
    fn the_keys_a_recipe_writes_are_its_files_and_overrides_not_the_defaults() {
        let r = LoadedRecipe::from_str(MINIMAL, Path::new("r.toml"), Path::new("."), &["data.shuffle=false".to_string()]).unwrap();
        assert!(r.written.contains("data.shuffle") && r.written.contains("model.path") && r.written.contains("train.lr"), "{:?}", r.written);
        assert!(!r.written.contains("train.seed") && !r.written.contains("train.lr_scheduler"), "{:?}", r.written);
    }

    #[test]
    fn auto_dtype_keeps_a_bf16_checkpoint_bf16_on_every_cpu() {
        let root = tempfile::tempdir().unwrap();
        for (name, dtype) in [("m16", candle_core::DType::BF16), ("m32", candle_core::DType::F32)] {
            let shape = crate::synth::TinyShape { dtype, ..Default::default() };
            crate::synth::write_model(&root.path().join(name), &shape, 1, 1).unwrap();
        }
        let unit = crate::ops::bf16_gemm::available();
        let auto = |path: &str, overrides: &[&str]| {
            let text = MINIMAL.replace("path = \"m\"", &format!("path = \"{path}\""));
            let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
            LoadedRecipe::from_str(&text, Path::new("r.toml"), root.path(), &o).unwrap().recipe.model.dtype
        };
        assert_eq!(auto("m16", &[]), "bf16");
        assert_eq!(auto("m32", &[]), if unit { "bf16" } else { "f32" });
        assert_eq!(auto("m16", &["model.quantize=q8_0"]), if unit { "bf16" } else { "f32" });
        assert_eq!(auto("m16", &["model.kernels=portable"]), "f32");
        assert_eq!(auto("m16", &["model.matmul=f32"]), "f32");
    }

    #[test]
    fn unknown_key_is_named_with_suggestion() {
        let e = err_text(MINIMAL, &["train.lrr=0.1"]);
        assert!(e.contains("`train.lrr`") && e.contains("did you mean \"lr\""), "{e}");
        // The names transformers / PEFT / TRL users type first.
        let e = err_text(MINIMAL, &["train.learning_rate=1e-4"]);
        assert!(e.contains("`learning_rate` in transformers / PEFT / TRL is `train.lr` here"), "{e}");
        let e = err_text(MINIMAL, &["train.max_seq_length=512"]);
        assert!(e.contains("is `data.max_seq_len` here"), "{e}");
        // Names with no key of that meaning here say what to write instead.
        let e = err_text(MINIMAL, &["lora.use_rslora=true"]);
        assert!(e.contains("`use_rslora` in transformers / PEFT / TRL: ") && e.contains("lora.alpha = alpha x sqrt(rank)"), "{e}");
        let e = err_text(MINIMAL, &["train.bf16=true"]);
        assert!(e.contains("model.dtype = \"bf16\""), "{e}");
        // transformers 5's warmup ratio written as warmup_steps: the steps it means.
        let e = err_text(MINIMAL, &["train.warmup_steps=0.5"]);
        assert!(e.contains("ratio of the steps") && e.contains("ceil(0.5 x train.max_steps) = 2"), "{e}");
        let e = err_text(&MINIMAL.replace("[output]", "[outptu]"), &[]);
        assert!(e.contains("did you mean \"output\""), "{e}");
    }

    #[test]
    fn a_key_in_the_wrong_section_or_at_the_top_names_its_section() {
        let e = err_text(MINIMAL, &["train.max_seq_len=512"]);
        assert!(e.contains("`train.max_seq_len`") && e.contains("it is a key of [data]: data.max_seq_len"), "{e}");
        let e = err_text(MINIMAL, &["checkpoint.every=5"]);
        assert!(e.contains("did you mean \"every_steps\""), "{e}");
        let e = err_text(&format!("max_seq_len = 64\n{MINIMAL}"), &[]);
        assert!(e.contains("`max_seq_len`") && e.contains("put it under [data]"), "{e}");
    }

    #[test]
    fn wrong_type_names_key_and_expectation() {
        let e = err_text(MINIMAL, &["train.lr=\"fast\""]);
        assert!(e.contains("`train.lr`") && e.contains("expected a number"), "{e}");
        let e = err_text(MINIMAL, &["model.dtype=fp32"]);
        assert!(e.contains("`model.dtype`") && e.contains("did you mean \"f32\""), "{e}");
    }

    #[test]
    fn missing_required_key_is_named() {
        let e = err_text(&MINIMAL.replace("lr = 1e-3", ""), &[]);
        assert!(e.contains("`train.lr`") && e.contains("missing required key"), "{e}");
    }

    #[test]
    fn overrides_replace_values_and_parse_bare_strings() {
        let r = load(MINIMAL, &["train.lr=2e-4", "model.path=/abs/model", "lora.targets=[\"q_proj\"]"]).unwrap();
        assert_eq!(r.recipe.train.lr, 2e-4);
        assert_eq!(r.recipe.model.path, "/abs/model");
        assert_eq!(r.recipe.lora.targets, Some(vec!["q_proj".to_string()]));
        assert_eq!(r.resolve(&r.recipe.output.dir), PathBuf::from("/recipes/out"));
    }

    #[test]
    fn a_shuffle_buffer_that_cannot_shuffle_is_refused_when_shuffling() {
        for n in ["0", "1"] {
            let e = err_text(MINIMAL, &["data.shuffle=true", &format!("data.shuffle_buffer={n}")]);
            assert!(e.contains("`data.shuffle_buffer`") && e.contains("at least 2"), "{n}: {e}");
        }
        let ok = |o: &[&str]| load(MINIMAL, o).is_ok();
        assert!(ok(&["data.shuffle=false", "data.shuffle_buffer=0"]) && ok(&["data.shuffle=true", "data.shuffle_buffer=2"]));
    }

    #[test]
    fn unknown_lora_target_is_rejected() {
        let e = err_text(MINIMAL, &["lora.targets=[\"q_prj\"]"]);
        assert!(e.contains("did you mean \"q_proj\""), "{e}");
        let e = err_text(MINIMAL, &["lora.targets=[\"gate\"]"]);
        assert!(e.contains("router") && e.contains("never a LoRA target"), "{e}");
    }

    #[test]
    fn sizes_beyond_what_can_be_held_are_refused_up_front() {
        for (o, key) in [
            ("train.max_steps=1000000000000000", "train.max_steps"),
            ("train.grad_accum_steps=1000000000000", "train.grad_accum_steps"),
            ("train.micro_batch_size=10000000", "train.micro_batch_size"),
            ("data.shuffle_buffer=10000000000", "data.shuffle_buffer"),
            ("dist.timeout_s=100000000000", "dist.timeout_s"),
        ] {
            let e = err_text(MINIMAL, &[o]);
            assert!(e.contains(&format!("`{key}`")) && e.contains("more than this tool accepts"), "{o}: {e}");
        }
    }

    #[test]
    fn nan_and_infinity_are_refused_wherever_a_number_goes() {
        for o in ["train.max_grad_norm=nan", "train.lr=inf", "lora.alpha=nan", "train.adam_betas=[0.9, nan]", "train.weight_decay=-inf"] {
            let key = o.split('=').next().unwrap();
            let e = err_text(MINIMAL, &[o]);
            assert!(e.contains(&format!("`{key}`")) && e.contains("finite"), "{o}: {e}");
        }
    }

    #[test]
    fn numbers_outside_their_meaning_are_refused_naming_the_key() {
        for (o, key) in [("lora.alpha=0", "lora.alpha"), ("lora.alpha=1e39", "lora.alpha"), ("train.weight_decay=-0.1", "train.weight_decay"), ("train.adam_eps=0", "train.adam_eps")] {
            let e = err_text(MINIMAL, &[o]);
            assert!(e.contains(&format!("`{key}`")), "{o}: {e}");
        }
    }

    #[test]
    fn a_column_remap_the_format_does_not_read_is_refused() {
        let e = err_text(MINIMAL, &["data.format=\"alpaca\"", "data.columns={ inpt = \"context\" }"]);
        assert!(e.contains("`data.columns`") && e.contains("`inpt`") && e.contains("instruction, input, output"), "{e}");
        load(MINIMAL, &["data.format=\"alpaca\"", "data.columns={ input = \"context\" }"]).unwrap();
        let e = err_text(MINIMAL, &["data.format=\"messages\"", "data.columns={ tools = \"messages\" }"]);
        assert!(e.contains("`messages` and `tools` would both read the dataset column `messages`"), "{e}");
        let e = err_text(MINIMAL, &["data.format=\"alpaca\"", "data.columns={ instruction = \"q\", output = \"q\" }"]);
        assert!(e.contains("`instruction` and `output`"), "{e}");
        let e = err_text(MINIMAL, &["data.format=\"messages\"", "data.columns={ messages = \"\" }"]);
        assert!(e.contains("`data.columns`") && e.contains("maps `messages` to an empty column name"), "{e}");
        load(MINIMAL, &["data.format=\"alpaca\"", "data.columns={ instruction = \"output\", output = \"instruction\" }"]).unwrap();
    }

    #[test]
    fn paths_expand_home_and_environment_variables() {
        std::env::set_var("FINETUNE_TEST_DATA", "/srv/data");
        let home = std::env::var("HOME").unwrap();
        let r = load(MINIMAL, &["model.path=\"~/models/m\"", "data.train=[\"$FINETUNE_TEST_DATA/a\", \"${FINETUNE_TEST_DATA}x/b:train\"]", "output.dir=\"~\""]).unwrap();
        assert_eq!(r.recipe.model.path, format!("{home}/models/m"));
        assert_eq!(r.recipe.data.train.list(), [PathBuf::from("/srv/data/a"), PathBuf::from("/srv/datax/b:train")]);
        assert_eq!(r.recipe.output.dir, PathBuf::from(&home));
        assert_eq!(expand_path("a$/b~c$1").unwrap(), "a$/b~c$1", "no name after $: literal");
        let e = err_text(MINIMAL, &["output.dir=\"$FINETUNE_TEST_UNSET/out\""]);
        assert!(e.contains("`output.dir`") && e.contains("$FINETUNE_TEST_UNSET") && e.contains("not set"), "{e}");
    }

    #[test]
    fn a_template_file_is_named_by_its_jinja_or_j2_ending_after_expansion() {
        std::env::set_var("FINETUNE_TEST_DATA", "/srv/data");
        std::env::set_var("FINETUNE_TEST_TEMPLATE", "/srv/chat.j2");
        for (set, file) in [
            ("data.template=\"t/chat.jinja\"", "/recipes/t/chat.jinja"),
            ("data.template=\"t/chat.j2\"", "/recipes/t/chat.j2"),
            ("data.template=\"$FINETUNE_TEST_DATA/chat.jinja\"", "/srv/data/chat.jinja"),
            ("data.template=\"$FINETUNE_TEST_TEMPLATE\"", "/srv/chat.j2"),
        ] {
            let r = load(MINIMAL, &["data.format=\"messages\"", set]).unwrap();
            assert_eq!(r.chat_template_file(), Some(PathBuf::from(file)), "{set}");
        }
        assert_eq!(load(MINIMAL, &["data.format=\"messages\"", "data.template=\"chatml\""]).unwrap().chat_template_file(), None);
        let e = err_text(MINIMAL, &["data.format=\"messages\"", "data.template=\"t/chat.txt\""]);
        assert!(e.contains("`data.template`") && e.contains("a path to a .jinja or .j2 file"), "{e}");
    }

    #[test]
    fn an_empty_path_a_list_that_is_not_toml_and_an_integer_too_large_are_named() {
        for key in ["output.dir", "model.path", "data.train", "data.template", "lora.init_from"] {
            let e = err_text(MINIMAL, &["data.format=\"messages\"", &format!("{key}=\"\"")]);
            assert!(e.contains(&format!("`{key}`")) && e.contains("is empty; expected a path"), "{e}");
        }
        let e = err_text(MINIMAL, &["data.train=[\"a.jsonl\", \" \"]"]);
        assert!(e.contains("`data.train`") && e.contains("is empty"), "{e}");
        let e = err_text(MINIMAL, &["data.train=[d/chat.jsonl]"]);
        assert!(e.contains("`data.train`") && e.contains("not a TOML list") && e.contains("quote each element"), "{e}");
        let e = err_text(MINIMAL, &["data.max_seq_len=99999999999999999999"]);
        assert!(e.contains("beyond the integer range"), "{e}");
        // Names that are not TOML integers stay names.
        for name in ["007", "-", "1__2"] {
            assert_eq!(load(MINIMAL, &[&format!("output.dir={name}")]).unwrap().recipe.output.dir, PathBuf::from(name));
        }
        assert_eq!(load(MINIMAL, &["data.train=[\"d/chat.jsonl\"]"]).unwrap().recipe.data.train.list(), [PathBuf::from("d/chat.jsonl")]);
    }

    #[test]
    fn a_number_where_text_goes_says_to_quote_it() {
        let e = err_text(MINIMAL, &["output.dir=2024"]);
        assert!(e.contains("`output.dir`") && e.contains("--set 'output.dir=\"2024\"'"), "{e}");
        assert_eq!(load(MINIMAL, &["output.dir=\"2024\""]).unwrap().recipe.output.dir, PathBuf::from("2024"));
    }

    #[test]
    fn keys_the_rest_of_the_recipe_makes_inert_are_refused() {
        let e = err_text(MINIMAL, &["data.template=\"chatml\""]);
        assert!(e.contains("`data.template`") && e.contains("\"tokenized\""), "{e}");
        let e = err_text(MINIMAL, &["data.format=\"text\"", "data.template=\"chatml\""]);
        assert!(e.contains("`data.template`"), "{e}");
        let e = err_text(MINIMAL, &["data.max_tokens=4096"]);
        assert!(e.contains("`data.max_tokens`") && e.contains("batch_by"), "{e}");
        load(MINIMAL, &["data.max_tokens=4096", "data.batch_by=\"tokens\""]).unwrap();
        load(MINIMAL, &["data.format=\"messages\"", "data.template=\"chatml\""]).unwrap();
    }

    #[test]
    fn set_takes_table_keys_dates_as_text_and_says_what_a_bad_value_needs() {
        let r = load(MINIMAL, &["data.format=prompt_completion", "data.columns.prompt=question", "output.dir= 2024-06-01"]).unwrap();
        assert_eq!(r.recipe.data.columns.get("prompt").map(String::as_str), Some("question"));
        assert_eq!(r.recipe.output.dir, PathBuf::from("2024-06-01"));
        let e = err_text(MINIMAL, &["model.path="]);
        assert!(e.contains("--set model.path=") && e.contains("no value"), "{e}");
        let e = err_text(MINIMAL, &["lora.targets=[q_proj]"]);
        assert!(e.contains("`lora.targets`") && e.contains("quote each element"), "{e}");
    }

    #[test]
    fn eval_every_without_eval_data_is_refused() {
        let e = err_text(MINIMAL, &["train.eval_every=5"]);
        assert!(e.contains("`train.eval_every`") && e.contains("data.eval_fraction"), "{e}");
        load(MINIMAL, &["train.eval_every=5", "data.eval_fraction=0.1"]).unwrap();
    }

    #[test]
    fn constant_means_no_warmup_as_in_transformers() {
        let e = err_text(MINIMAL, &["train.warmup_steps=5", "train.lr_scheduler=constant"]);
        assert!(e.contains("`train.lr_scheduler`") && e.contains("constant_with_warmup"), "{e}");
        load(MINIMAL, &["train.warmup_steps=5"]).unwrap();
        let r = load(MINIMAL, &["train.warmup_steps=5", "train.lr_scheduler=constant_with_warmup"]).unwrap().recipe;
        assert_eq!(r.train.lr_scheduler, "constant_with_warmup");
        load(MINIMAL, &["train.warmup_steps=5", "train.lr_scheduler=cosine"]).unwrap();
    }

    /// Every key in SCHEMA must be accepted by the serde structs (and vice versa via
    /// deny_unknown_fields): write a recipe with every key set and parse it.
    #[test]
    fn schema_and_structs_agree() {
        let mut t = toml::Table::new();
        for (sec, _, keys) in SCHEMA {
            let mut s = toml::Table::new();
            for k in keys.iter() {
                let v = match (k.kind, k.choices.first()) {
                    // warmup_steps is set too, which "constant" refuses.
                    (Kind::Str, Some(_)) if k.name == "lr_scheduler" => toml::Value::String("constant_with_warmup".into()),
                    // template and max_tokens are set too, which need a templated format and
                    // token batches (and so no packing).
                    (Kind::Str, Some(_)) if k.name == "format" => toml::Value::String("messages".into()),
                    (Kind::Str, Some(_)) if k.name == "batch_by" => toml::Value::String("tokens".into()),
                    (Kind::Bool, _) if k.name == "packing" => toml::Value::Boolean(false),
                    (Kind::Str, Some(c)) => toml::Value::String(c.to_string()),
                    (Kind::Str, None) => toml::Value::String(match k.name {
                        "device" => "cpu".into(),
                        "max_shard_size" => "5GB".into(),
                        _ => "x".into(),
                    }),
                    (Kind::Int, _) => toml::Value::Integer(if k.name == "zero_stage" { 3 } else { 4 }),
                    (Kind::Float, _) => toml::Value::Float(if k.name == "eval_fraction" { 0.0 } else { 0.5 }),
                    (Kind::Bool, _) => toml::Value::Boolean(true),
                    (Kind::BoolOrAuto, _) => toml::Value::String("auto".into()),
                    (Kind::StrList, _) => toml::Value::Array(vec![toml::Value::String(if k.name == "devices" { "cpu" } else { "q_proj" }.into())]),
                    (Kind::FloatPair, _) => toml::Value::Array(vec![toml::Value::Float(0.5), toml::Value::Float(0.5)]),
                    (Kind::StrOrList, _) => toml::Value::Array(vec![toml::Value::String("a".into()), toml::Value::String("b".into())]),
                    (Kind::StrMap, _) => toml::Value::Table([("messages".to_string(), toml::Value::String("conversation".into()))].into_iter().collect()),
                };
                s.insert(k.name.to_string(), v);
            }
            t.insert(sec.to_string(), toml::Value::Table(s));
        }
        load(&toml::to_string(&t).unwrap(), &[]).unwrap();
    }
}
