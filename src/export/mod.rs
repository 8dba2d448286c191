//! Export: the adapter as PEFT writes it, or the base with the adapter merged in, as an HF
//! folder that transformers, vLLM and candle load.
//!
//! Merge: W' = W + scale · B·A for every targeted projection, in f32, stored in the base's
//! dtype (or `--dtype`); every other tensor is copied byte for byte (or converted when the
//! dtype changes); shards keep the base's layout (or are cut at `--max-shard-size`) with a
//! correct `model.safetensors.index.json`; config, generation config and tokenizer files are
//! copied. It streams: one output shard's tensors are held at a time (the report says how
//! many bytes at most). Tied embeddings stay tied: LoRA never targets them here.
//!
//! Verification: the merged folder is loaded and its logits on fixed token batches are
//! compared with base + adapter; a merge that disagrees is deleted, not reported.
//! The output appears only when complete (written to a sibling temporary and renamed).

pub mod gguf;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::lora::{peft_prefix, Adapters, LoraSpec};
use crate::model::Model;
use crate::weights::{candle_dtype, ModelDir, StreamingWeights};
use candle_core::{DType, Device, Tensor};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Clone, Debug, Default)]
pub struct ExportOptions {
    pub merge: bool,
    /// Output dtype of the merged model (default: the base's).
    pub dtype: Option<DType>,
    /// Cut shards at this many bytes (default: the base's shard layout).
    pub max_shard_size: Option<u64>,
    /// Skip the logits check (not recommended).
    pub no_verify: bool,
    /// The kernels the check's forwards run on (the recipe's `model.kernels`).
    pub kernels: crate::ops::Kernels,
    /// Replace an existing output folder once the new one is complete (the end-of-run merge
    /// of a run given more steps, or run again); else a non-empty one is refused.
    pub replace: bool,
    /// Where the signal handlers put the number of a signal that asks to stop (0: none). A
    /// merge looks before each tensor and before its check, and on a signal removes what it
    /// staged and returns [`Error::Interrupted`]: a 7B merge takes minutes, and Ctrl-C must
    /// not wait for it, nor end in an exit 0.
    pub stop: Option<Arc<std::sync::atomic::AtomicUsize>>,
}

impl ExportOptions {
    /// [`Error::Interrupted`] once a signal asked to stop.
    fn check_stop(&self) -> Result<()> {
        self.stop.as_deref().map_or(Ok(()), stop_requested)
    }
}

/// [`Error::Interrupted`] once the signal handlers' flag holds a signal (0: none): what the
/// merge checks per tensor, and the end-of-run exports before they start.
pub fn stop_requested(stop: &std::sync::atomic::AtomicUsize) -> Result<()> {
    match stop.load(std::sync::atomic::Ordering::Relaxed) {
        0 => Ok(()),
        signal => Err(Error::Interrupted { signal }),
    }
}

#[derive(Clone, Debug, Default)]
pub struct ExportReport {
    pub out: PathBuf,
    pub shards: usize,
    pub total_bytes: u64,
    /// Most tensor bytes held in memory at once.
    pub peak_buffered_bytes: u64,
    pub merged_tensors: usize,
    /// Max |logits(merged) - logits(base + adapter)|, when verified.
    pub max_logit_diff: Option<f32>,
}

/// "5GB", "500MB", "2GiB", "1048576": bytes (decimal units as transformers uses them).
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("`{s}` is not a size like 5GB or 500MB"))?;
    let mult = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1u64,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KIB" => 1 << 10,
        "MIB" => 1 << 20,
        "GIB" => 1 << 30,
        other => return Err(format!("unknown size unit `{other}` in `{s}` (B, KB, MB, GB, KiB, MiB, GiB)")),
    };
    Ok((n * mult as f64) as u64)
}

/// A PEFT adapter folder read for merging.
pub struct PeftAdapter {
    pub dir: PathBuf,
    pub spec: LoraSpec,
    pub base_model: Option<String>,
}

impl PeftAdapter {
    /// Read `adapter_config.json` (with the reader `lora.init_from` uses, so both refuse the
    /// same adapters).
    pub fn open(dir: &Path) -> Result<Self> {
        let c = crate::lora::AdapterConfig::read(dir)?;
        Ok(PeftAdapter { dir: dir.to_path_buf(), spec: c.spec, base_model: c.base_model })
    }

    /// Load the adapter's A/B tensors for a model config (strict, as for training).
    pub fn load(&self, cfg: &ModelConfig) -> Result<Adapters> {
        let a = Adapters::init(cfg, self.spec.clone(), 0, &Device::Cpu)?;
        a.load_peft(&self.dir)?;
        Ok(a)
    }
}

/// A tensor to write: borrowed bytes from the base's map, or computed bytes.
enum OutTensor<'a> {
    Copied(safetensors::tensor::TensorView<'a>),
    Owned { dtype: safetensors::Dtype, shape: Vec<usize>, data: Vec<u8> },
}

impl safetensors::View for &OutTensor<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        match self {
            OutTensor::Copied(v) => v.dtype(),
            OutTensor::Owned { dtype, .. } => *dtype,
        }
    }
    fn shape(&self) -> &[usize] {
        match self {
            OutTensor::Copied(v) => v.shape(),
            OutTensor::Owned { shape, .. } => shape,
        }
    }
    fn data(&self) -> Cow<'_, [u8]> {
        match self {
            OutTensor::Copied(v) => Cow::Borrowed(v.data()),
            OutTensor::Owned { data, .. } => Cow::Borrowed(data),
        }
    }
    fn data_len(&self) -> usize {
        match self {
            OutTensor::Copied(v) => v.data().len(),
            OutTensor::Owned { data, .. } => data.len(),
        }
    }
}

fn st_dtype(d: DType) -> Result<safetensors::Dtype> {
    crate::weights::safetensors_dtype(d).ok_or_else(|| Error::Export(format!("cannot export tensors of dtype {d:?}")))
}

fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => t.to_vec1::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::BF16 => t.to_vec1::<half::bf16>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F16 => t.to_vec1::<half::f16>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        other => return Err(Error::Export(format!("cannot export tensors of dtype {other:?}"))),
    })
}

/// Files copied beside the weights when present.
const SIDE_FILES: &[&str] = &[
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
];

/// Copy the side files `base` has into `dst`: [`SIDE_FILES`], and the remote-code modules its
/// config.json's `auto_map` names (`modeling_deepseek.py`, ...), which the copied config still
/// points to (transformers copies them too when it saves a remote-code model).
fn copy_side_files(base: &Path, dst: &Path, config: &serde_json::Value) -> Result<()> {
    let mut names: Vec<String> = SIDE_FILES.iter().map(|f| f.to_string()).collect();
    let refs = config.get("auto_map").and_then(|m| m.as_object()).into_iter().flat_map(|m| m.values());
    for r in refs.flat_map(|v| match v {
        serde_json::Value::Array(a) => a.iter().filter_map(|x| x.as_str()).collect::<Vec<_>>(),
        v => v.as_str().into_iter().collect(),
    }) {
        // "module.Class", or "org/repo--module.Class" for code in another repo (not copied).
        if let Some((module, _)) = r.rsplit_once('.').filter(|(m, _)| !m.contains("--") && !m.contains('/') && !m.contains('\\')) {
            names.push(format!("{module}.py"));
        }
    }
    names.sort();
    names.dedup();
    for f in names {
        let src = base.join(&f);
        if src.is_file() {
            crate::fsutil::copy_file(&src, &dst.join(&f))?;
        }
    }
    Ok(())
}

/// The template the adapter was trained with, where it carries one, in place of the base's:
/// as chat_template.jinja, which transformers reads before tokenizer_config.json's
/// `chat_template`, and with that key dropped from the copied tokenizer_config.json, as
/// transformers' `save_chat_templates` drops it (llama.cpp's converter reads the key first).
fn carry_adapter_template(adapter: &PeftAdapter, dst: &Path) -> Result<()> {
    let template = adapter.dir.join(crate::chat::TEMPLATE_FILE);
    if !template.is_file() {
        return Ok(());
    }
    crate::fsutil::copy_file(&template, &dst.join(crate::chat::TEMPLATE_FILE))?;
    let cfg_path = dst.join("tokenizer_config.json");
    let mut cfg = crate::chat::optional_json(dst, "tokenizer_config.json")?;
    if let Some(obj) = cfg.as_object_mut().filter(|o| o.contains_key("chat_template")) {
        obj.remove("chat_template");
        let text = serde_json::to_string_pretty(&cfg).map_err(|e| Error::Export(e.to_string()))?;
        crate::fsutil::write_atomic(&cfg_path, text.as_bytes())?;
    }
    Ok(())
}

/// Make `out` appear whole: build in a sibling temporary, then rename (with `replace`, swap
/// it for the existing folder, which stays whole until then).
fn staged<T>(out: &Path, replace: bool, build: impl FnOnce(&Path) -> Result<T>) -> Result<T> {
    let refuse = |msg: &str| Err(Error::io(out, std::io::Error::new(std::io::ErrorKind::AlreadyExists, msg.to_string())));
    // Checked before the work: the rename at the end cannot put a folder there.
    if out.symlink_metadata().is_ok_and(|m| m.file_type().is_symlink()) {
        return refuse("is a symbolic link; give the output folder's own path (choose another --out)");
    }
    if out.exists() && !out.is_dir() {
        return refuse("exists and is not a folder (choose another --out)");
    }
    if !replace && out.exists() && std::fs::read_dir(out).map(|mut d| d.next().is_some()).unwrap_or(true) {
        return refuse("output folder exists and is not empty (choose another --out)");
    }
    let tmp = crate::output::beside(out, "tmp");
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    }
    let _lock = crate::output::StagingLock::acquire(out)?;
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let placed = build(&tmp).and_then(|v| {
        if replace && out.exists() {
            crate::fsutil::replace_dir_durable(&tmp, out)?;
        } else {
            if out.exists() {
                std::fs::remove_dir(out).map_err(|e| Error::io(out, e))?;
            }
            crate::fsutil::rename_durable(&tmp, out)?;
        }
        Ok(v)
    });
    if placed.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    placed
}

/// Copy a PEFT adapter folder (after checking it loads against `base`).
pub fn export_adapter_only(adapter: &PeftAdapter, base: &ModelDir, out: &Path) -> Result<ExportReport> {
    let cfg = base.config()?;
    adapter.load(&cfg)?;
    staged(out, false, |tmp| {
        let mut total = 0;
        for f in ["adapter_model.safetensors", "adapter_config.json", "README.md", crate::chat::TEMPLATE_FILE] {
            let src = adapter.dir.join(f);
            if src.is_file() {
                total += crate::fsutil::copy_file(&src, &tmp.join(f))?;
            }
        }
        Ok(ExportReport { out: out.to_path_buf(), shards: 1, total_bytes: total, ..Default::default() })
    })
}

/// Merge `adapter` into `base` and write an HF model folder at `out`.
pub fn merge(base: &ModelDir, adapter: &PeftAdapter, out: &Path, opts: &ExportOptions) -> Result<ExportReport> {
    if let Some(g) = &base.gguf {
        return merge_gguf(g, adapter, out, opts);
    }
    let cfg = base.config()?;
    let adapters = adapter.load(&cfg)?;
    let files = base.open_weights()?;
    if crate::weights::bnb::is_bnb(&files) {
        return merge_bnb(base, files, adapter, out, opts);
    }
    // name -> (A, B) of every targeted projection.
    let mut lora: HashMap<String, (Tensor, Tensor)> = HashMap::new();
    for (i, path, ad) in adapters.iter() {
        let key = base_weight_name(i, path);
        lora.insert(key, (ad.a.as_tensor().clone(), ad.b.as_tensor().clone()));
    }
    let scale = adapter.spec.scale();
    let report = staged(out, opts.replace, |tmp| {
        // Output shards: the base's layout, or cut at max_shard_size.
        let by_file = files.names_by_file();
        let mut plan: Vec<Vec<String>> = Vec::new();
        match opts.max_shard_size {
            None => plan.extend(by_file.iter().map(|(_, names)| names.clone())),
            Some(limit) => {
                let mut cur: Vec<String> = Vec::new();
                let mut size = 0u64;
                for name in by_file.iter().flat_map(|(_, n)| n.iter()) {
                    if is_dropped_scale(&files, name) {
                        continue;
                    }
                    let v = files.raw_view(name)?;
                    let stored = if v.dtype() == safetensors::Dtype::F8_E4M3 { 2 } else { v.dtype().bitsize() / 8 };
                    let out_elem = opts.dtype.map(|d| crate::weights::stored_dtype(name, d).size_in_bytes()).unwrap_or(stored);
                    let bytes = (v.shape().iter().product::<usize>() * out_elem) as u64;
                    if !cur.is_empty() && size + bytes > limit {
                        plan.push(std::mem::take(&mut cur));
                        size = 0;
                    }
                    cur.push(name.clone());
                    size += bytes;
                }
                if !cur.is_empty() {
                    plan.push(cur);
                }
            }
        }
        let n = plan.len();
        let mut weight_map = BTreeMap::new();
        let mut rep = ExportReport { out: out.to_path_buf(), shards: n, ..Default::default() };
        for (si, names) in plan.iter().enumerate() {
            let fname = if n == 1 { "model.safetensors".to_string() } else { format!("model-{:05}-of-{n:05}.safetensors", si + 1) };
            let mut tensors: Vec<(String, OutTensor)> = Vec::with_capacity(names.len());
            let mut held = 0u64;
            for name in names {
                opts.check_stop()?;
                // An FP8 base merges into a plain one: its weights are dequantised (to bf16
                // unless --dtype says otherwise) and the block scales dropped.
                if is_dropped_scale(&files, name) {
                    continue;
                }
                let v = files.raw_view(name)?;
                let fp8 = v.dtype() == safetensors::Dtype::F8_E4M3;
                let stored = if fp8 { Some(DType::BF16) } else { candle_dtype(v.dtype()) };
                // --dtype keeps what transformers keeps in f32 in a 16-bit model (the router).
                let out_dtype = opts.dtype.map(|d| crate::weights::stored_dtype(name, d)).or(stored);
                let t = if let Some((a, b)) = lora.get(name) {
                    let w = files.load(name, v.shape(), &Device::Cpu)?.to_dtype(DType::F32)?;
                    let delta = (b.matmul(a)? * scale)?; // [out, R] x [R, in] -> [out, in]
                    let merged = (w + delta)?.to_dtype(out_dtype.unwrap_or(DType::F32))?;
                    rep.merged_tensors += 1;
                    let data = tensor_bytes(&merged)?;
                    held += data.len() as u64;
                    OutTensor::Owned { dtype: st_dtype(merged.dtype())?, shape: v.shape().to_vec(), data }
                } else if !fp8 && (out_dtype == stored || stored.is_none()) {
                    OutTensor::Copied(v)
                } else {
                    let t = files.load(name, v.shape(), &Device::Cpu)?.to_dtype(out_dtype.unwrap_or(DType::F32))?;
                    let data = tensor_bytes(&t)?;
                    held += data.len() as u64;
                    OutTensor::Owned { dtype: st_dtype(t.dtype())?, shape: v.shape().to_vec(), data }
                };
                rep.total_bytes += safetensors::View::data_len(&&t) as u64;
                weight_map.insert(name.clone(), fname.clone());
                tensors.push((name.clone(), t));
            }
            rep.peak_buffered_bytes = rep.peak_buffered_bytes.max(held);
            let path = tmp.join(&fname);
            let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
            let data: Vec<(&str, &OutTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
            crate::fsutil::write_safetensors(data, Some(meta), &path)?;
            std::fs::File::open(&path).and_then(|f| f.sync_all()).map_err(|e| Error::io(&path, e))?;
        }
        if n > 1 {
            let index = serde_json::json!({"metadata": {"total_size": rep.total_bytes}, "weight_map": weight_map});
            crate::fsutil::write_atomic(&tmp.join("model.safetensors.index.json"), index.to_string().as_bytes())?;
        }
        // config.json: the base's, with the dtype updated when it changed.
        let cp = base.config_path();
        let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cp).map_err(|e| Error::io(&cp, e))?)
            .map_err(|e| Error::Config { path: cp.clone(), msg: e.to_string() })?;
        if let Some(obj) = config.as_object_mut() {
            // The FP8 weights were dequantised: the output is not a quantised checkpoint.
            if obj.remove("quantization_config").is_some() && opts.dtype.is_none() {
                crate::weights::set_config_dtype(obj, DType::BF16);
            }
        }
        if let (Some(d), Some(obj)) = (opts.dtype, config.as_object_mut()) {
            crate::weights::set_config_dtype(obj, d);
        }
        let text = serde_json::to_string_pretty(&config).map_err(|e| Error::Export(e.to_string()))?;
        crate::fsutil::write_atomic(&tmp.join("config.json"), text.as_bytes())?;
        copy_side_files(&base.dir, tmp, &config)?;
        carry_adapter_template(adapter, tmp)?;
        if !opts.no_verify {
            opts.check_stop()?;
            let diff = verify_merge(base, &adapters, tmp, opts)?;
            rep.max_logit_diff = Some(diff);
        }
        Ok(rep)
    })?;
    Ok(report)
}

/// Merge into a GGUF base: the base is dequantised into a hidden sibling folder of `out`
/// (in `--dtype`, default the file's own: F16 or BF16 where all its matrices are, else f32;
/// see `GgufModel::weights_dtype`), merged from there, and the sibling removed. The merged
/// model is a plain HF model: a quantized base is merged into its dequantised weights,
/// as PEFT's `merge_and_unload` on a bitsandbytes base does. Holds the dequantised base in
/// memory while writing it.
fn merge_gguf(gguf: &Path, adapter: &PeftAdapter, out: &Path, opts: &ExportOptions) -> Result<ExportReport> {
    merge_dequantised(gguf.display().to_string(), adapter, out, opts, |deq| crate::gguf::import(gguf, deq, opts.dtype, u64::MAX).map(|_| ()))
}

/// [`merge_gguf`] for a bitsandbytes base: its config without `quantization_config`, the
/// side files, and every tensor dequantised.
fn merge_bnb(base: &ModelDir, files: crate::weights::SafetensorsFiles, adapter: &PeftAdapter, out: &Path, opts: &ExportOptions) -> Result<ExportReport> {
    use crate::weights::quantized::BlockReader;
    let names: Vec<String> = files.names().filter(|n| !crate::weights::bnb::is_quant_state(n)).cloned().collect();
    let mut r = crate::weights::bnb::BnbReader { files, storage: DType::F32 };
    // "The base's dtype" is the one it was quantised from: a bf16 model's 4-bit weights
    // dequantise exactly to bf16 (bitsandbytes returns them so), and its merge is bf16, as a
    // QLoRA merge into the base reloaded in bf16 is (f32 would double the output for nothing).
    let dtype = match opts.dtype {
        Some(d) => d,
        None => r.original_dtype()?,
    };
    merge_dequantised(base.name.clone(), adapter, out, opts, |deq| {
        std::fs::create_dir_all(deq).map_err(|e| Error::io(deq, e))?;
        let mut tensors = Vec::new();
        for n in names {
            opts.check_stop()?;
            let t = r.read(&n, &Device::Cpu)?.dequantize(&Device::Cpu)?.to_dtype(crate::weights::stored_dtype(&n, dtype))?;
            tensors.push((n, t));
        }
        crate::gguf::write_weights(deq, &tensors, u64::MAX)?;
        let cp = base.config_path();
        let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cp).map_err(|e| Error::io(&cp, e))?).map_err(|e| Error::Config { path: cp.clone(), msg: e.to_string() })?;
        if let Some(o) = config.as_object_mut() {
            o.remove("quantization_config");
            crate::weights::set_config_dtype(o, dtype);
        }
        crate::fsutil::write_atomic(&deq.join("config.json"), config.to_string().as_bytes())?;
        copy_side_files(&base.dir, deq, &config)
    })
}

/// Write the dequantised base with `write` into a hidden sibling of `out`, merge from it,
/// and remove it, whatever happened.
fn merge_dequantised(name: String, adapter: &PeftAdapter, out: &Path, opts: &ExportOptions, write: impl FnOnce(&Path) -> Result<()>) -> Result<ExportReport> {
    let leaf = out.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    // What a killed merge left: its dequantised base, and that base's import staging.
    for stale in [format!(".{leaf}.dequantised-"), format!("..{leaf}.dequantised-")] {
        crate::fsutil::sweep_stale_staging(parent, &stale);
    }
    let deq = parent.join(crate::fsutil::staging_name(&format!(".{leaf}.dequantised-")));
    let _ = std::fs::remove_dir_all(&deq);
    let res = write(&deq).and_then(|_| opts.check_stop()).and_then(|_| merge(&ModelDir { dir: deq.clone(), name, commit: None, gguf: None }, adapter, out, opts));
    let _ = std::fs::remove_dir_all(&deq);
    res
}

/// Logits of the merged folder vs base + adapter on fixed token batches; errors when they
/// disagree beyond what the output dtype's rounding explains.
fn verify_merge(base: &ModelDir, adapters: &Adapters, merged_dir: &Path, opts: &ExportOptions) -> Result<f32> {
    let out_dtype = opts.dtype;
    let cfg = base.config()?;
    let reference_has_experts = cfg.moe.is_some();
    let mut rng = crate::rng::Rng::new(0x5EED);
    let ids: Vec<u32> = (0..2 * 16).map(|_| rng.below(cfg.vocab_size as u64) as u32).collect();
    let ids = Tensor::from_vec(ids, (2, 16), &Device::Cpu)?;
    let src = Arc::new(StreamingWeights::new(base.open_weights()?, DType::F32, Device::Cpu));
    let reference = Model::load(src, cfg.clone(), adapters)?.with_kernels(opts.kernels).logits(&ids, adapters)?;
    let merged_dir = ModelDir { dir: merged_dir.to_path_buf(), name: String::new(), commit: None, gguf: None };
    let src = Arc::new(StreamingWeights::new(merged_dir.open_weights()?, DType::F32, Device::Cpu));
    let none = Adapters::none(&cfg)?;
    let merged = Model::load(src, cfg, &none)?.with_kernels(opts.kernels).logits(&ids, &none)?;
    let diff = (&merged - &reference)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    let scale = reference.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?.max(1.0);
    // --dtype decides every tensor's rounding (f32: none, an FP8 base dequantised straight to it).
    let half = match out_dtype {
        Some(d) => matches!(d, DType::BF16 | DType::F16),
        None => merge_rounds_to_half(base, adapters),
    };
    let limit = if half { 5e-2 } else { 1e-4 } * scale;
    if diff.is_nan() || diff > limit {
        // A model with routed experts picks them by score: a merge rounded to bf16 can flip
        // a near-tied choice, which moves that token's logits far past the limit.
        let moe = if reference_has_experts { "; in a model with routed experts a lower-precision merge can flip a near-tied expert choice: merge in the base's dtype (no --dtype), or pass --no-verify to write it unchecked" } else { "" };
        return Err(Error::Export(format!(
            "merge verification failed: merged logits differ from base + adapter by {diff:e} (limit {limit:e}); the output was not written{moe}"
        )));
    }
    Ok(diff)
}

/// The block scales of an FP8 weight: not written, as the weight is written dequantised.
fn is_dropped_scale(files: &crate::weights::SafetensorsFiles, name: &str) -> bool {
    name.ends_with(".weight_scale_inv") && files.is_fp8(name.trim_end_matches("_scale_inv"))
}

/// The base tensor an adapter on layer `i`'s projection `path` merges into.
fn base_weight_name(i: usize, path: &str) -> String {
    peft_prefix(i, path).replace("base_model.model.", "") + ".weight"
}

/// Whether the merge writes an adapted weight rounded to 16 bits (its stored dtype, or bf16
/// for an FP8 base, all of whose weights are rounded so): the merged logits then differ from
/// base + adapter by that rounding. A tensor copied is the same bits in both, whatever its
/// dtype, so a base of mixed dtypes is judged by the tensors merged, not by any one tensor.
fn merge_rounds_to_half(base: &ModelDir, adapters: &Adapters) -> bool {
    let Ok(f) = base.open_weights() else { return false };
    if f.names().any(|n| f.is_fp8(n)) {
        return true;
    }
    adapters.iter().any(|(i, path, _)| matches!(f.raw_view(&base_weight_name(i, path)).map(|v| v.dtype()), Ok(safetensors::Dtype::BF16 | safetensors::Dtype::F16)))
}


#[cfg(test)]
mod tests {
    use super::*;

    /// The merge rounds what it merges: a bf16 weight adapted means a loose limit, a bf16
    /// weight beside the adapted ones (copied bit for bit) does not.
    #[test]
    fn merge_verification_is_loose_only_where_an_adapted_weight_is_16_bit() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("model");
        crate::synth::write_model(&dir, &crate::synth::TinyShape::default(), 1, 1).unwrap();
        let base = ModelDir { dir: dir.clone(), name: String::new(), commit: None, gguf: None };
        let cfg = base.config().unwrap();
        let spec = crate::lora::LoraSpec { rank: 2, alpha: 4.0, dropout: 0.0, targets: vec!["q_proj".into()], routed_experts: false };
        let adapters = Adapters::init(&cfg, spec, 0, &Device::Cpu).unwrap();
        let path = dir.join("model.safetensors");
        let f32_base = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
        for (in_bf16, loose) in [("model.layers.0.mlp.up_proj.weight", false), ("model.layers.1.self_attn.q_proj.weight", true)] {
            let mut t = f32_base.clone();
            t.insert(in_bf16.into(), t[in_bf16].to_dtype(DType::BF16).unwrap());
            candle_core::safetensors::save(&t, &path).unwrap();
            assert_eq!(merge_rounds_to_half(&base, &adapters), loose, "{in_bf16} in bf16");
        }
    }
}
