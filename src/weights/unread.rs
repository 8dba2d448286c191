//! Which stored tensors the model reads: [`Asked`] records every name `Model::load` asks a
//! source for, and [`unread`] / [`note_unread`] name what a checkpoint holds beyond them, as
//! transformers lists its unexpected keys.

use super::{ModelDir, WeightSource};
use crate::config::ModelConfig;
use crate::error::Result;
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeSet;

/// A source that remembers the name of every tensor asked of it (`Model::load` builds through
/// one), so that what a checkpoint holds and no layer reads can be named ([`unread`]).
/// Everything else is the wrapped source's.
pub struct Asked<'a> {
    src: &'a dyn WeightSource,
    names: std::sync::Mutex<BTreeSet<String>>,
}

impl<'a> Asked<'a> {
    pub fn new(src: &'a dyn WeightSource) -> Self {
        Asked { src, names: Default::default() }
    }
    fn ask(&self, name: &str) {
        self.names.lock().unwrap_or_else(|e| e.into_inner()).insert(name.to_string());
    }
    pub fn into_names(self) -> BTreeSet<String> {
        self.names.into_inner().unwrap_or_else(|e| e.into_inner())
    }
}

impl WeightSource for Asked<'_> {
    fn get_stored(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.ask(name);
        self.src.get_stored(name, shape)
    }
    fn compute_dtype(&self) -> DType {
        self.src.compute_dtype()
    }
    /// Not an ask: `Model::load` looks for a layer past the last this way.
    fn contains(&self, name: &str) -> bool {
        self.src.contains(name)
    }
    fn device(&self) -> &Device {
        self.src.device()
    }
    fn matmul_dtype(&self) -> DType {
        self.src.matmul_dtype()
    }
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.ask(name);
        self.src.get(name, shape)
    }
    fn get_matmul(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.ask(name);
        self.src.get_matmul(name, shape)
    }
    fn check(&self, name: &str, shape: &[usize]) -> Result<()> {
        self.ask(name);
        self.src.check(name, shape)
    }
    fn check_rows(&self, name: &str, shape: &[usize]) -> Result<()> {
        self.ask(name);
        self.src.check_rows(name, shape)
    }
    fn check_head(&self, name: &str, shape: &[usize]) -> Result<()> {
        self.ask(name);
        self.src.check_head(name, shape)
    }
    fn bytes_in_files(&self) -> usize {
        self.src.bytes_in_files()
    }
    fn get_matmul_rows(&self, name: &str, shape: &[usize], start: usize, len: usize) -> Result<Tensor> {
        self.ask(name);
        self.src.get_matmul_rows(name, shape, start, len)
    }
    fn embedding(&self, name: &str, shape: &[usize], ids: &Tensor) -> Result<Tensor> {
        self.ask(name);
        self.src.embedding(name, shape, ids)
    }
    fn seal(&self) {
        self.src.seal()
    }
}

/// The tensors among `stored` that no layer of a model of `layers` layers reads, given the
/// names it `asked` for: transformers' "unexpected keys". Not counted: what is stored beside
/// a tensor read (`….weight_scale_inv` of an FP8 weight, bitsandbytes' `….weight.absmax` and
/// quant state, its 8-bit `<module>.SCB` row scales and `weight_format`), layers past the last (DeepSeek-V3's multi-token-prediction module;
/// `Model::load` refuses any other), and old checkpoints' `rotary_emb.inv_freq` buffers
/// (transformers skips them too).
pub fn unread<'n>(stored: impl Iterator<Item = &'n String>, asked: &BTreeSet<String>, layers: usize) -> Vec<&'n str> {
    let companion = |name: &str| {
        let int8 = ["SCB", "weight_format"].iter().find_map(|s| name.strip_suffix(s)).is_some_and(|module| asked.contains(&format!("{module}weight")));
        int8 || name.match_indices(['.', '_']).any(|(i, _)| asked.contains(&name[..i]))
    };
    let past_last = |name: &str| {
        let layer = name.strip_prefix("model.layers.").and_then(|r| r.split('.').next()).and_then(|i| i.parse::<usize>().ok());
        layer.is_some_and(|i| i >= layers)
    };
    let mut out: Vec<&str> = stored
        .map(String::as_str)
        .filter(|n| !asked.contains(*n) && !companion(n) && !past_last(n) && !n.ends_with("rotary_emb.inv_freq"))
        .collect();
    out.sort_unstable();
    out
}

/// Name the tensors of a safetensors base that no part of the model reads (`asked`: what its
/// load asked for): a bias the config does not call for, say, would otherwise be dropped
/// without a word. A GGUF base is not looked at (its names are llama.cpp's).
pub fn note_unread(model_dir: &ModelDir, asked: &BTreeSet<String>, cfg: &ModelConfig) {
    if model_dir.gguf.is_some() {
        return;
    }
    let Ok(files) = model_dir.open_weights() else { return };
    let mut unread = unread(files.names(), asked, cfg.num_hidden_layers);
    // A stored head beside a tied config is read only to learn it equals the embedding (the
    // config is untied otherwise: `ModelConfig`), which transformers does not name either.
    unread.retain(|n| !(cfg.tie_word_embeddings && *n == "lm_head.weight"));
    if unread.is_empty() {
        return;
    }
    let shown = unread.iter().take(4).map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ");
    let more = if unread.len() > 4 { format!(" and {} more", unread.len() - 4) } else { String::new() };
    let why = if unread.iter().any(|n| n.ends_with(".bias")) {
        " (biases are read where the architecture or config.json's attention_bias / mlp_bias call for them)"
    } else {
        ""
    };
    crate::note!(
        "note: {} tensor{} in {} {} not read by a {} model with this config.json: {shown}{more}. They are left out, as transformers leaves out what it reports as unexpected keys; if the model needs them, config.json does not match the checkpoint{why}",
        unread.len(),
        if unread.len() == 1 { "" } else { "s" },
        model_dir.dir.display(),
        if unread.len() == 1 { "is" } else { "are" },
        cfg.architecture_name,
    );
}
