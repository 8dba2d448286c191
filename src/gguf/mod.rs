//! GGUF files (llama.cpp's format, often quantized), llama, qwen2 and deepseek2 (`deepseek2.rs`)
//! architectures: read as a quantized base to train on directly (`GgufReader`,
//! `describe_in_cache`), or converted by `finetune import --gguf` to an HF model folder our
//! trainer, transformers and candle load.
//!
//! - The header is read by [`read_header`], which bounds every length, count, dimension and
//!   offset by the file's size; the metadata is then checked against itself and the
//!   tensors present (`Llama::from_gguf`) before any tensor is read or anything written.
//! - Tensors are dequantized (candle) and renamed from llama.cpp's names
//!   (`blk.N.attn_q.weight`) to HF's (`model.layers.N.self_attn.q_proj.weight`).
//! - llama.cpp's converter permutes the rows of llama's q/k so that its interleaved RoPE
//!   equals HF's rotate-half RoPE; we undo it (see `unpermute`), since our model uses
//!   rotate-half. Qwen2's are not permuted (llama.cpp runs it with NEOX, rotate-half, RoPE).
//! - `config.json` comes from the `llama.*` / `qwen2.*` metadata; `tokenizer.json` is built from the
//!   `tokenizer.ggml.*` vocabulary, merges and token types as transformers' GGUF converter
//!   builds it (byte-level BPE for `gpt2` vocabularies); `tokenizer_config.json` carries the
//!   chat template and special tokens.
//!
//! Files: `header` (the header and typed metadata), `llama` and `deepseek2` (the
//! architectures), `rope` (Llama 3's scaling recovered), `tokenizer` and `pretok`.

mod deepseek2;
mod header;
mod llama;
mod pretok;
mod rope;
mod tokenizer;
pub use header::*;
pub use llama::*;
use tokenizer::*;

use crate::error::{Error, Result};
use candle_core::quantized::gguf_file::{Content, TensorInfo};
use crate::weights::quantized::Blocks;
use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::{Path, PathBuf};

pub struct ImportReport {
    pub tensors: usize,
    pub config: serde_json::Value,
    pub shards: usize,
    /// What the weights were written in (the one asked for, or the file's own).
    pub dtype: DType,
}

fn gguf_err(file: &Path, key: impl Into<String>, msg: impl Into<String>) -> Error {
    Error::Gguf { file: file.to_path_buf(), key: key.into(), msg: msg.into() }
}

/// A checked GGUF model file: the header read (see [`read_header`]), the architecture's
/// metadata checked against itself and the tensors present, and the HF files that describe
/// it built (config, tokenizer, generation config). No tensor has been read yet.
pub struct GgufModel {
    pub path: PathBuf,
    file: std::fs::File,
    content: Content,
    arch: &'static str,
    /// HF name -> where its values are.
    sources: BTreeMap<String, Source>,
    /// `config.json` as transformers writes it for this model.
    pub config: serde_json::Value,
    /// `tokenizer.json` and `tokenizer_config.json`, when the file has a vocabulary.
    pub tokenizer: Option<(serde_json::Value, serde_json::Value)>,
    pub generation: serde_json::Value,
}

/// Open and check `gguf` (see [`GgufModel`]). A file without `tokenizer.ggml.*` metadata
/// opens (pre-tokenized data needs none); a malformed vocabulary is an error.
pub fn open(gguf: &Path) -> Result<GgufModel> {
    let (mut file, c) = read_header(gguf)?;
    let m = Meta { c: &c, file: gguf };
    // A LoRA adapter (`export --format gguf`, llama.cpp's convert_lora_to_gguf.py) has the
    // base's architecture but no model in it: say what it is, not which model key it lacks.
    if let Some(t) = m.string("general.type")?.filter(|t| *t != "model") {
        return Err(m.err("general.type", format!("is `{t}`: this file is not a model{}", if t == "adapter" { " but a LoRA adapter for llama.cpp (`llama-cli -m <base>.gguf --lora <this file>`); name its base model instead" } else { "" })));
    }
    let d = match m.string("general.architecture")? {
        Some("deepseek2") => deepseek2::describe(&m)?,
        _ => Llama::from_gguf(&m, &mut file)?.describe(&m),
    };
    let tokenizer = match c.metadata.contains_key("tokenizer.ggml.model") {
        true => Some(tokenizer_files(&m, d.vocab, d.context)?),
        false => None,
    };
    let mut config = d.config;
    if let Some(o) = config.as_object_mut() {
        for (k, key) in [("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id"), ("pad_token_id", "tokenizer.ggml.padding_token_id")] {
            // Range-checked against the vocabulary by `tokenizer_files` when there is one.
            if let Some(id) = m.uint(key)?.filter(|&i| (i as usize) < d.vocab) {
                o.insert(k.into(), id.into());
            }
        }
    }
    let mut generation = serde_json::json!({"do_sample": false});
    for k in ["bos_token_id", "eos_token_id", "pad_token_id"] {
        if let (Some(v), Some(o)) = (config.get(k).cloned(), generation.as_object_mut()) {
            o.insert(k.into(), v);
        }
    }
    Ok(GgufModel { path: gguf.to_path_buf(), file, content: c, arch: d.arch, sources: d.sources, config, tokenizer, generation })
}

/// `config` with the keys of `more` added.
fn extend(config: &mut serde_json::Value, more: serde_json::Value) {
    if let (Some(o), serde_json::Value::Object(more)) = (config.as_object_mut(), more) {
        o.extend(more);
    }
}

impl GgufModel {
    /// The HF names of the model's tensors, sorted.
    pub fn hf_names(&self) -> Vec<String> {
        self.sources.keys().cloned().collect()
    }

    /// The architecture (`general.architecture`): `llama`, `qwen2` or `deepseek2`.
    pub fn arch(&self) -> &'static str {
        self.arch
    }

    /// The blocks of `gguf_name` as stored, on `device`.
    fn read(&mut self, gguf_name: &str, device: &Device) -> Result<QTensor> {
        let m = Meta { c: &self.content, file: &self.path };
        self.content.tensor(&mut self.file, gguf_name, device).map_err(|e| m.err(gguf_name, crate::error::candle_msg(&e)))
    }

    /// Expert `j` of the stacked tensor `gguf_name` [E, out, in], read alone.
    fn read_expert(&mut self, gguf_name: &str, j: usize, device: &Device) -> Result<QTensor> {
        let m = Meta { c: &self.content, file: &self.path };
        let info = &self.content.tensor_infos[gguf_name];
        let (e, out, inp) = info.shape.dims3().map_err(|e| m.err(gguf_name, crate::error::candle_msg(&e)))?;
        if j >= e {
            return Err(m.err(gguf_name, format!("has {e} experts; expert {j} asked for")));
        }
        let per = crate::weights::quantized::ggml_bytes(info.ggml_dtype, out * inp) as u64;
        let one = TensorInfo { ggml_dtype: info.ggml_dtype, shape: (out, inp).into(), offset: info.offset + j as u64 * per };
        one.read(&mut self.file, self.content.tensor_data_offset, device).map_err(|e| m.err(gguf_name, format!("expert {j}: {}", crate::error::candle_msg(&e))))
    }

    /// The HF tensor `hf` as held blocks, on `device`.
    pub fn read_blocks(&mut self, hf: &str, device: &Device) -> Result<Blocks> {
        let src = self.sources.get(hf).cloned().ok_or_else(|| Error::MissingTensor { name: hf.into(), files: self.path.display().to_string() })?;
        Ok(match src {
            Source::Tensor { name, unpermute } => Blocks::Ggml { q: self.read(&name, device)?, unpermute_heads: unpermute },
            Source::Expert { name, j } => Blocks::Ggml { q: self.read_expert(&name, j, device)?, unpermute_heads: None },
            Source::KvB { k_b, v_b } => Blocks::MlaKvB { k_b: self.read(&k_b, device)?, v_b: self.read(&v_b, device)? },
        })
    }

    /// The HF tensor `hf` in f32 on the CPU (llama's q/k permutation undone, experts cut
    /// out, DeepSeek's kv_b_proj joined).
    pub fn dequantize(&mut self, hf: &str) -> Result<Tensor> {
        let b = self.read_blocks(hf, &Device::Cpu)?;
        b.dequantize(&Device::Cpu).map_err(|e| gguf_err(&self.path, hf, crate::error::candle_msg(&e)))
    }

    /// The dtype an HF folder of this model holds its matrices in unrounded: F16 or BF16 where
    /// every matrix is stored so (llama.cpp's `-f16` / `-bf16` conversions), else f32 (a
    /// quantized block dequantises to values no 16-bit type holds, from a dtype the file does
    /// not record). The MoE router, which transformers keeps in f32 anyway, does not count.
    pub fn weights_dtype(&self) -> DType {
        use candle_core::quantized::GgmlDType as G;
        let infos = &self.content.tensor_infos;
        let mut kinds = self
            .sources
            .iter()
            .filter(|(hf, _)| crate::weights::stored_dtype(hf, DType::BF16) == DType::BF16)
            .flat_map(|(_, s)| match s {
                Source::Tensor { name, .. } | Source::Expert { name, .. } => vec![name],
                Source::KvB { k_b, v_b } => vec![k_b, v_b],
            })
            .filter(|g| infos[*g].shape.rank() >= 2)
            .map(|g| infos[g].ggml_dtype);
        match kinds.next() {
            Some(G::F16) if kinds.all(|k| k == G::F16) => DType::F16,
            Some(G::BF16) if kinds.all(|k| k == G::BF16) => DType::BF16,
            _ => DType::F32,
        }
    }

    /// Bytes of tensor data, by ggml type name (what a run holding the blocks holds).
    pub fn bytes_by_type(&self) -> std::collections::BTreeMap<String, u64> {
        let mut out = std::collections::BTreeMap::new();
        for t in self.content.tensor_infos.values() {
            let bytes = crate::weights::quantized::ggml_bytes(t.ggml_dtype, t.shape.elem_count()) as u64;
            *out.entry(format!("{:?}", t.ggml_dtype)).or_default() += bytes;
        }
        out
    }

    /// Bytes of each tensor's data, by HF name (an expert's share of its stacked tensor).
    pub fn hf_bytes(&self) -> HashMap<String, usize> {
        let infos = &self.content.tensor_infos;
        let bytes = |g: &str| crate::weights::quantized::ggml_bytes(infos[g].ggml_dtype, infos[g].shape.elem_count());
        let of = |s: &Source| match s {
            Source::Tensor { name, .. } => bytes(name),
            Source::Expert { name, .. } => bytes(name) / infos[name].shape.dims()[0],
            Source::KvB { k_b, v_b } => bytes(k_b) + bytes(v_b),
        };
        self.sources.iter().map(|(h, s)| (h.clone(), of(s))).collect()
    }

    /// The files [`GgufModel::write_description`] writes.
    pub fn description_files(&self) -> Vec<&'static str> {
        let mut f = vec!["config.json", "generation_config.json"];
        if self.tokenizer.is_some() {
            f.extend(["tokenizer.json", "tokenizer_config.json"]);
        }
        f
    }

    /// Write config.json, generation_config.json and (when the file has a vocabulary)
    /// tokenizer.json and tokenizer_config.json into `dir`.
    pub fn write_description(&self, dir: &Path) -> Result<()> {
        let w = |name: &str, v: &serde_json::Value| crate::fsutil::write_atomic(&dir.join(name), serde_json::to_string_pretty(v).unwrap_or_default().as_bytes());
        w("config.json", &self.config)?;
        w("generation_config.json", &self.generation)?;
        if let Some((tok, tok_cfg)) = &self.tokenizer {
            w("tokenizer.json", tok)?;
            w("tokenizer_config.json", tok_cfg)?;
        }
        Ok(())
    }
}

/// A GGUF file as the block source of a quantized base (`model.path = "x.gguf"`).
pub struct GgufReader {
    model: GgufModel,
}

impl GgufReader {
    pub fn new(model: GgufModel) -> Self {
        GgufReader { model }
    }
}

impl crate::weights::quantized::BlockReader for GgufReader {
    fn contains(&self, name: &str) -> bool {
        self.model.sources.contains_key(name)
    }
    fn file(&self) -> String {
        self.model.path.display().to_string()
    }
    fn read(&mut self, name: &str, device: &Device) -> Result<Blocks> {
        self.model.read_blocks(name, device)
    }
}

/// Where finetune keeps what it derives once and reuses: `FINETUNE_CACHE`, else
/// `$XDG_CACHE_HOME/finetune`, else `~/.cache/finetune`.
pub fn cache_root() -> Result<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    var("FINETUNE_CACHE")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("finetune")))
        .or_else(|| var("HOME").map(|d| d.join(".cache").join("finetune")))
        .ok_or_else(|| Error::model("FINETUNE_CACHE", "no cache folder: set FINETUNE_CACHE (or HOME) to a writable folder"))
}

/// The version of what `write_description` writes, kept in a cached description's folder:
/// one written by a finetune that described GGUF files otherwise (before the DeepSeek
/// pre-tokenizers or Llama 3's rope scaling were read) is rebuilt, never reused. Bump it when
/// the output of `write_description` changes.
const DESCRIPTION_VERSION: &str = "2";
const DESCRIPTION_STAMP: &str = "finetune-description-version";

/// The HF description of `gguf` (config.json, tokenizer files, generation_config.json)
/// in a folder of the cache named by the digest of the file's header, written on first use
/// (whole or not at all): the folder `model.path = "x.gguf"` resolves to. The weights stay
/// in the GGUF file.
pub fn describe_in_cache(gguf: &Path) -> Result<PathBuf> {
    use sha2::Digest;
    let g = open(gguf)?;
    let mut header = vec![0u8; g.content.tensor_data_offset as usize];
    {
        use std::io::{Seek, SeekFrom};
        let mut f = &g.file;
        f.seek(SeekFrom::Start(0)).and_then(|_| f.read_exact(&mut header)).map_err(|e| Error::io(gguf, e))?;
    }
    let digest = sha2::Sha256::digest(&header);
    let hex: String = digest.iter().take(10).map(|b| format!("{b:02x}")).collect();
    let stem = gguf.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    let dir = cache_root()?.join("gguf").join(format!("{hex}-{}", stem.chars().filter(|c| c.is_ascii_alphanumeric() || "-_.".contains(*c)).take(60).collect::<String>()));
    // Complete, and written by a finetune that describes GGUF files as this one does.
    let stamp = |d: &Path| std::fs::read_to_string(d.join(DESCRIPTION_STAMP)).is_ok_and(|v| v.trim() == DESCRIPTION_VERSION);
    let complete = |d: &Path| stamp(d) && g.description_files().iter().all(|f| d.join(f).is_file());
    if !complete(&dir) {
        if dir.exists() {
            // Incomplete (written by hand, or damaged) or written by another version: rebuilt
            // whole.
            let _ = std::fs::remove_dir_all(&dir);
        }
        // Another process may have written it meanwhile: its copy is the same.
        let write = |tmp: &Path| {
            g.write_description(tmp)?;
            crate::fsutil::write_atomic(&tmp.join(DESCRIPTION_STAMP), DESCRIPTION_VERSION.as_bytes())
        };
        if let Err(e) = write_folder(&dir, write) {
            if !complete(&dir) {
                return Err(e);
            }
        }
    }
    Ok(dir)
}

/// Import `gguf` into `out` (which must not exist or be empty), storing weights in `dtype`.
///
/// Everything is checked before anything is written: the header (see [`read_header`]), the
/// metadata against itself and the tensors, the tokenizer. The folder is then built
/// under a hidden sibling name and renamed into place, so `out` appears whole or not at all:
/// a bad file, or a failure while writing, leaves no output behind.
/// `dtype`: what to write the weights in; `None`, the file's own ([`GgufModel::weights_dtype`]).
pub fn import(gguf: &Path, out: &Path, dtype: Option<DType>, max_shard_bytes: u64) -> Result<ImportReport> {
    // Cheap and before the minutes of dequantizing: the destination must be usable.
    if out.exists() && !std::fs::read_dir(out).is_ok_and(|mut d| d.next().is_none()) {
        return Err(Error::io(out, std::io::Error::new(std::io::ErrorKind::AlreadyExists, "output exists and is not an empty folder (choose another --out)")));
    }
    let mut g = open(gguf)?;
    if g.tokenizer.is_none() {
        return Err(gguf_err(gguf, "tokenizer.ggml.model", "missing: an imported model folder needs a tokenizer"));
    }
    let dtype = dtype.unwrap_or_else(|| g.weights_dtype());
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    for hf in g.hf_names() {
        let t = g.dequantize(&hf)?;
        // The MoE router stays f32 in a 16-bit folder, as transformers keeps it.
        let d = crate::weights::stored_dtype(&hf, dtype);
        tensors.push((hf.clone(), t.to_dtype(d).map_err(|e| gguf_err(gguf, &hf, crate::error::candle_msg(&e)))?));
    }
    if let Some(o) = g.config.as_object_mut() {
        crate::weights::set_config_dtype(o, dtype);
    }
    let shards = write_folder(out, |dir| {
        let shards = write_weights(dir, &tensors, max_shard_bytes)?;
        g.write_description(dir)?;
        Ok(shards)
    })?;
    Ok(ImportReport { tensors: tensors.len(), config: g.config, shards, dtype })
}

/// Fill a hidden sibling folder of `out` with `fill`, then rename it to `out` (which may
/// exist as an empty folder). On any error the sibling is removed: `out` appears whole or
/// not at all.
fn write_folder<T>(out: &Path, fill: impl FnOnce(&Path) -> Result<T>) -> Result<T> {
    /// Removes the staging folder unless the rename happened (also on a panic in `fill`).
    struct Staging(Option<PathBuf>);
    impl Drop for Staging {
        fn drop(&mut self) {
            if let Some(p) = self.0.take() {
                let _ = std::fs::remove_dir_all(p);
            }
        }
    }
    let name = out.file_name().ok_or_else(|| Error::io(out, std::io::Error::new(std::io::ErrorKind::InvalidInput, "--out must name a folder")))?;
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    // Unique per process and call: two threads (or two containers whose processes share an
    // id) writing the same folder never share a staging folder.
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    let prefix = format!(".{}.import-", name.to_string_lossy());
    crate::fsutil::sweep_stale_staging(parent, &prefix);
    let tmp = parent.join(format!("{}-{call}-{nanos}", crate::fsutil::staging_name(&prefix)));
    std::fs::create_dir(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let mut staging = Staging(Some(tmp.clone()));
    let value = fill(&tmp)?;
    // rename(2) replaces an empty folder; `import` checked that `out` is absent or empty.
    if let Err(e) = std::fs::rename(&tmp, out) {
        if !out.is_dir() || std::fs::remove_dir(out).is_err() {
            return Err(Error::io(out, e));
        }
        std::fs::rename(&tmp, out).map_err(|e| Error::io(out, e))?;
    }
    staging.0 = None;
    crate::fsutil::sync_dir(parent).map_err(|e| crate::fsutil::placed_but(out, e))?;
    Ok(value)
}

/// Write tensors as `model.safetensors`, or shards of at most `limit` bytes with an index.
pub fn write_weights(out: &Path, tensors: &[(String, Tensor)], limit: u64) -> Result<usize> {
    let mut shards: Vec<Vec<&(String, Tensor)>> = vec![Vec::new()];
    let mut size = 0u64;
    for t in tensors {
        let bytes = (t.1.elem_count() * t.1.dtype().size_in_bytes()) as u64;
        if size + bytes > limit && !shards.last().is_some_and(|s| s.is_empty()) {
            shards.push(Vec::new());
            size = 0;
        }
        if let Some(s) = shards.last_mut() {
            s.push(t);
        }
        size += bytes;
    }
    let n = shards.len();
    let mut weight_map = serde_json::Map::new();
    let mut total = 0u64;
    for (i, shard) in shards.iter().enumerate() {
        let fname = if n == 1 { "model.safetensors".to_string() } else { format!("model-{:05}-of-{n:05}.safetensors", i + 1) };
        let map: HashMap<String, Tensor> = shard.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        for (k, v) in &map {
            weight_map.insert(k.clone(), fname.clone().into());
            total += (v.elem_count() * v.dtype().size_in_bytes()) as u64;
        }
        let path = out.join(&fname);
        crate::fsutil::write_safetensors(map.iter().map(|(k, v)| (k.as_str(), v)), None, &path)?;
    }
    if n > 1 {
        let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        crate::fsutil::write_atomic(&out.join("model.safetensors.index.json"), index.to_string().as_bytes())?;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_the_llama_cpp_permutation() -> candle_core::Result<()> {
        let w = Tensor::arange(0f32, 48.0, &Device::Cpu)?.reshape((12, 4))?; // 3 heads x d 4
        let back = unpermute(&permute(&w, 3)?, 3)?;
        assert_eq!(back.to_vec2::<f32>()?, w.to_vec2::<f32>()?);
        // Row 1 of a head (pair partner of row 0 in interleaved order) comes from row d/2 = 2.
        let p = permute(&w, 3)?.to_vec2::<f32>()?;
        assert_eq!(p[1], w.to_vec2::<f32>()?[2]);
        Ok(())
    }

    #[test]
    fn names_map_to_hf() {
        assert_eq!(hf_name("blk.3.attn_output.weight").as_deref(), Some("model.layers.3.self_attn.o_proj.weight"));
        assert_eq!(hf_name("token_embd.weight").as_deref(), Some("model.embed_tokens.weight"));
        assert_eq!(hf_name("blk.0.ffn_norm.weight").as_deref(), Some("model.layers.0.post_attention_layernorm.weight"));
        assert_eq!(hf_name("rope_freqs.weight"), None);
        for g in ["blk.3.attn_output.weight", "token_embd.weight", "blk.12.attn_k.bias", "output.weight"] {
            assert_eq!(gguf_name(&hf_name(g).unwrap()).as_deref(), Some(g));
        }
        // Only canonical block numbers: `blk.01` or `blk.+1` would alias `blk.1`.
        assert_eq!(hf_name("blk.01.attn_q.weight"), None);
        assert_eq!(hf_name("blk.+1.attn_q.weight"), None);
    }
}
