//! A quantized frozen base (QLoRA): the weights stay in their quantized blocks, and a layer
//! is dequantised into the storage dtype when the model asks for it, held in the layer
//! [`Window`](super::Window) (so the recomputed forward and the backward of activation
//! checkpointing reuse one dequantisation), and dropped when the window moves on.
//!
//! Peak frozen memory is the quantized bytes plus one window of dequantised layers; the
//! [`Account`] books the first as `frozen` and the second as `gathered`.
//!
//! Where the blocks come from is a [`BlockReader`]: a GGUF file (`gguf::GgufReader`), a
//! checkpoint bitsandbytes saved (`weights::bnb`), or a safetensors checkpoint quantised as
//! it is read (`model.quantize`, [`QuantizeOnLoad`]).
//! Tensors are read on first request (`Model::load` asks for every tensor it uses), so only
//! what the model uses is held; `seal` then drops the reader.
//!
//! The forward matmul runs on the dequantised weight, not on the blocks: candle's quantized
//! matmul quantises the activations to 8 bits first (ggml's `vec_dot` scheme), which is not
//! what PEFT + bitsandbytes or transformers' GGUF loading compute (both dequantise), so
//! parity would be lost for a speed-up the backward (dx = g W, on the dequantised weight)
//! could not share anyway.

use super::window::{Held, Unit};
use super::{stored_dtype, WeightSource};
use crate::dist::zero::Account;
use crate::error::{Error, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// One frozen tensor as held.
pub enum Blocks {
    /// ggml blocks (any type candle reads, F32/F16 included). `unpermute_heads`: llama.cpp
    /// permuted the rows of this q/k projection for its RoPE; undone after dequantising
    /// (see `gguf::unpermute`).
    Ggml { q: QTensor, unpermute_heads: Option<usize> },
    /// bitsandbytes 4-bit (NF4/FP4) and 8-bit weights (`weights::bnb`).
    Bnb4(super::bnb::Bnb4),
    Bnb8(super::bnb::Bnb8),
    /// Kept as it is (norms and biases, which quantising would save nothing on).
    Plain(Tensor),
    /// DeepSeek's `kv_b_proj` as llama.cpp writes it: `k_b` [heads, kv_lora, nope] (the k
    /// rows transposed, for its absorbed MLA) and `v_b` [heads, v, kv_lora]; joined into
    /// [heads x (nope + v), kv_lora] when dequantised.
    MlaKvB { k_b: QTensor, v_b: QTensor },
}

impl Blocks {
    pub fn dims(&self) -> Vec<usize> {
        match self {
            Blocks::Ggml { q, .. } => q.shape().dims().to_vec(),
            Blocks::Bnb4(b) => b.dims(),
            Blocks::Bnb8(b) => b.dims(),
            Blocks::Plain(t) => t.dims().to_vec(),
            Blocks::MlaKvB { k_b, v_b } => match (k_b.shape().dims(), v_b.shape().dims()) {
                (&[h, r, nope], &[_, v, _]) => vec![h * (nope + v), r],
                (k, _) => k.to_vec(),
            },
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            Blocks::Ggml { q, .. } => q.storage_size_in_bytes(),
            Blocks::Bnb4(b) => b.bytes(),
            Blocks::Bnb8(b) => b.bytes(),
            Blocks::Plain(t) => t.elem_count() * t.dtype().size_in_bytes(),
            Blocks::MlaKvB { k_b, v_b } => k_b.storage_size_in_bytes() + v_b.storage_size_in_bytes(),
        }
    }

    /// The full tensor in f32 (quantized) or its own dtype (plain), on `device`.
    pub fn dequantize(&self, device: &Device) -> candle_core::Result<Tensor> {
        let deq = |q: &QTensor| match device {
            Device::Cpu => dequantize_cpu(q),
            _ => q.dequantize(device),
        };
        match self {
            Blocks::Ggml { q, unpermute_heads } => {
                let t = deq(q)?;
                match unpermute_heads {
                    Some(h) => crate::gguf::unpermute(&t, *h),
                    None => Ok(t),
                }
            }
            Blocks::MlaKvB { k_b, v_b } => {
                let (k, v) = (deq(k_b)?, deq(v_b)?); // [heads, kv_lora, nope], [heads, v, kv_lora]
                let (h, r, _) = k.dims3()?;
                let kv = Tensor::cat(&[k.transpose(1, 2)?, v], 1)?; // [heads, nope + v, kv_lora]
                let rows = kv.dim(1)?;
                kv.reshape((h * rows, r))
            }
            Blocks::Bnb4(b) => b.dequantize(device),
            Blocks::Bnb8(b) => b.dequantize(device),
            Blocks::Plain(t) => t.to_device(device),
        }
    }
}

impl Blocks {
    /// Rows start..start+len of a matrix, as `dequantize` gives them, cut without
    /// dequantising the rest: held full-precision tensors, and ggml blocks on the CPU that
    /// tile the rows (F32/F16/BF16 rows are read from their bytes). `None` where only the
    /// whole tensor can be dequantised (blocks on a GPU, llama's q/k permutation, other formats).
    fn dequantize_rows(&self, start: usize, len: usize) -> Option<candle_core::Result<Tensor>> {
        match self {
            Blocks::Plain(t) => Some(t.narrow(0, start, len)),
            Blocks::Ggml { q, unpermute_heads: None } if q.device().is_cpu() => {
                let (_, cols) = q.shape().dims2().ok()?;
                if cols % q.dtype().block_size() != 0 {
                    return None;
                }
                let row = ggml_bytes(q.dtype(), cols);
                let data = q.data().ok()?;
                let bytes = data.get(start * row..(start + len) * row)?;
                let plain = |dtype: DType| Tensor::from_raw_buffer(bytes, dtype, &[len, cols], &Device::Cpu).and_then(|t| t.to_dtype(DType::F32));
                match q.dtype() {
                    GgmlDType::F32 => Some(plain(DType::F32)),
                    GgmlDType::F16 => Some(plain(DType::F16)),
                    GgmlDType::BF16 => Some(plain(DType::BF16)),
                    d => dequantize_blocks(bytes, d, &(len, cols).into()),
                }
            }
            _ => None,
        }
    }
}

/// candle's CPU dequantisation on all cores: the same `GgmlType::to_float` per block (so the
/// same values), over chunks of blocks in parallel (candle runs one thread; the dequantising
/// of each layer, twice a step with checkpointing, cost a third of a SmolLM2 step on 2 cores).
fn dequantize_cpu(q: &QTensor) -> candle_core::Result<Tensor> {
    let data = q.data()?;
    dequantize_blocks(&data, q.dtype(), q.shape()).unwrap_or_else(|| q.dequantize(&Device::Cpu))
}

/// `bytes`, whole blocks of ggml type `dtype`, dequantised to f32 in `shape` on the CPU in
/// parallel; `None` for a type without blocks (F32/F16/BF16) or bytes that do not fit.
fn dequantize_blocks(bytes: &[u8], dtype: GgmlDType, shape: &candle_core::Shape) -> Option<candle_core::Result<Tensor>> {
    use candle_core::quantized::k_quants::*;
    fn par<B: GgmlType>(bytes: &[u8], shape: &candle_core::Shape) -> Option<candle_core::Result<Tensor>> {
        use rayon::prelude::*;
        let n = shape.elem_count();
        let size = std::mem::size_of::<B>();
        // The storage is a Vec<B> viewed as bytes: aligned and whole; anything else falls back.
        if !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<B>()) || !bytes.len().is_multiple_of(size) || bytes.len() / size * B::BLCK_SIZE != n {
            return None;
        }
        // SAFETY: `bytes` are blocks of a QTensor of type B (checked above: aligned, a whole
        // number of blocks covering `n` elements); B is plain old data.
        let blocks: &[B] = unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const B, bytes.len() / size) };
        let per = (8192 / B::BLCK_SIZE).max(1);
        let mut out = vec![0f32; n];
        out.par_chunks_mut(per * B::BLCK_SIZE).zip(blocks.par_chunks(per)).for_each(|(o, b)| B::to_float(b, o));
        Some(Tensor::from_vec(out, shape, &Device::Cpu))
    }
    match dtype {
        GgmlDType::Q4_0 => par::<BlockQ4_0>(bytes, shape),
        GgmlDType::Q4_1 => par::<BlockQ4_1>(bytes, shape),
        GgmlDType::Q5_0 => par::<BlockQ5_0>(bytes, shape),
        GgmlDType::Q5_1 => par::<BlockQ5_1>(bytes, shape),
        GgmlDType::Q8_0 => par::<BlockQ8_0>(bytes, shape),
        GgmlDType::Q2K => par::<BlockQ2K>(bytes, shape),
        GgmlDType::Q3K => par::<BlockQ3K>(bytes, shape),
        GgmlDType::Q4K => par::<BlockQ4K>(bytes, shape),
        GgmlDType::Q5K => par::<BlockQ5K>(bytes, shape),
        GgmlDType::Q6K => par::<BlockQ6K>(bytes, shape),
        _ => None,
    }
}

/// Where a quantized base's tensors come from. `read` returns the tensor `name` (HF name),
/// or an error naming it and the file; `file` names the source for messages.
pub trait BlockReader: Send {
    fn contains(&self, name: &str) -> bool;
    fn read(&mut self, name: &str, device: &Device) -> Result<Blocks>;
    fn file(&self) -> String;
}

/// A safetensors checkpoint quantised to `dtype` as it is read (`model.quantize`).
///
/// Projection and embedding matrices are quantised; norms, biases and MoE router weights
/// stay in the storage dtype (they are a rounding error of the size, and the router picks
/// experts by score differences quantisation could flip). A matrix whose rows do not split
/// into `dtype`'s blocks takes the 32-wide fallback llama.cpp's quantiser also takes for
/// k-quants (q5_0 for q4_k), else stays as it is.
pub struct QuantizeOnLoad {
    pub files: super::SafetensorsFiles,
    pub target: Quantize,
    pub storage: DType,
}

/// What `model.quantize` quantises to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Quantize {
    /// A ggml type (candle's quantisers), as llama.cpp would store the model.
    Ggml(GgmlDType),
    /// bitsandbytes' NF4 with blocksize 64 and f32 absmax (`bnb_4bit_use_double_quant =
    /// False`, transformers' default), on the decoder's projections only, as transformers +
    /// bitsandbytes quantise a model (embeddings, the output head, norms and MoE routers
    /// stay): the QLoRA base PEFT users train on, made from a bf16/f32 checkpoint.
    Nf4,
}

/// The `model.quantize` value `s` names.
pub fn parse_quantize(s: &str) -> Option<Quantize> {
    if s == "nf4" {
        return Some(Quantize::Nf4);
    }
    parse_format(s).map(Quantize::Ggml)
}

/// Whether `model.quantize = "nf4"` quantises tensor `name` of shape `dims`: a decoder
/// layer's 2-D linear weight (bitsandbytes replaces the Linear modules of the layers:
/// DeepSeek's `kv_a_proj_with_mqa` too, which a `_proj.weight` test missed), not its norms,
/// nor the MoE router `mlp.gate`, which PEFT + bitsandbytes leaves unquantised. The routed
/// experts are quantised, as bitsandbytes quantises them where they are Linear modules
/// (transformers 4's DeepSeek code); transformers 5 stacks them into parameters it leaves in
/// full precision, which would keep most of a MoE model's weights out of the 4 bits.
pub fn nf4_quantizes(name: &str, dims: &[usize]) -> bool {
    dims.len() == 2 && name.starts_with("model.layers.") && name.ends_with(".weight") && !name.contains("norm") && !name.ends_with("mlp.gate.weight")
}

/// Whether `model.quantize` (a ggml type) quantises tensor `name` of shape `dims`: every 2-D
/// weight but the norms and the MoE router (whose scores pick experts).
fn ggml_quantizes(name: &str, dims: &[usize]) -> bool {
    dims.len() == 2 && name.ends_with(".weight") && !name.contains("norm") && !name.ends_with("mlp.gate.weight")
}

/// The type `model.quantize = target` stores tensor `name` of shape `dims` in (see
/// [`QuantizeOnLoad`]); `None`: kept as it is.
pub fn quantized_format(target: GgmlDType, name: &str, dims: &[usize]) -> Option<GgmlDType> {
    let matrix = ggml_quantizes(name, dims);
    let cols = *dims.last()?;
    // llama.cpp's fallbacks (`llama_tensor_get_type`), except q2_k / q3_k, whose iq4_nl
    // candle does not write: q5_0 there.
    let fallback = match target {
        GgmlDType::Q4K | GgmlDType::Q3K | GgmlDType::Q2K => GgmlDType::Q5_0,
        GgmlDType::Q5K => GgmlDType::Q5_1,
        GgmlDType::Q6K => GgmlDType::Q8_0,
        other => other,
    };
    [target, fallback].into_iter().find(|d| matrix && cols % d.block_size() == 0)
}

/// What `model.quantize = target` does other than asked to the matrices of `cfg`: how many
/// take the fallback type (rows not a multiple of the target's block) and how many stay
/// unquantised (rows of no block at all), for a note at the start of a run.
pub fn fallback_note(target: GgmlDType, cfg: &crate::config::ModelConfig) -> Option<String> {
    let (mut fallback, mut kept, mut fell_to) = (0, 0, None);
    for (n, s) in cfg.frozen_tensors() {
        match quantized_format(target, &n, &s) {
            Some(d) if d != target => {
                fallback += 1;
                fell_to = Some(d);
            }
            None if ggml_quantizes(&n, &s) => kept += 1,
            _ => {}
        }
    }
    let mut parts = Vec::new();
    if let Some(d) = fell_to {
        parts.push(format!("{fallback} matrices whose rows are not a multiple of {} are stored as {d:?}, as llama.cpp does", target.block_size()));
    }
    if kept > 0 {
        parts.push(format!("{kept} matrices whose rows split into no block stay unquantised"));
    }
    (!parts.is_empty()).then(|| format!("model.quantize = {target:?}: {}", parts.join("; ")))
}

/// Bytes of `elems` weights in ggml type `d`.
pub fn ggml_bytes(d: GgmlDType, elems: usize) -> usize {
    elems / d.block_size() * d.type_size()
}

/// What `finetune plan` needs of a quantized base: a GGUF `model.path` (its tensors' types,
/// from the header), or `model.quantize` (the types [`quantized_format`] picks). `None` for
/// a base held as it is.
pub fn plan_base(loaded: &crate::recipe::LoadedRecipe, cfg: &crate::config::ModelConfig) -> Result<Option<crate::dist::plan::QuantizedBase>> {
    let m = &loaded.recipe.model;
    let local = loaded.dir.join(&m.path);
    if local.is_file() && super::is_gguf_file(&local) {
        let g = crate::gguf::open(&local)?;
        let types: Vec<String> = g.bytes_by_type().iter().rev().map(|(t, b)| format!("{t} {:.1} MB", *b as f64 / 1e6)).collect();
        return Ok(Some(crate::dist::plan::QuantizedBase { bytes: g.hf_bytes(), what: format!("GGUF blocks ({})", types.join(", ")) }));
    }
    // A folder's weights, where it has them (a plan may run on config.json alone).
    let files = local.is_dir().then(|| super::ModelDir::resolve(&m.path, &loaded.dir).and_then(|d| d.open_weights()).ok()).flatten();
    if let Some(files) = files {
        if super::bnb::is_bnb(&files) {
            // A weight's bytes: its own and those of its quantisation state (`W.absmax`, ...).
            let mut bytes: HashMap<String, usize> = HashMap::new();
            for n in files.names() {
                let v = files.raw_view(n)?;
                let of = |w: &str| n == w || n.starts_with(&format!("{w}.")) || *n == format!("{}.SCB", w.trim_end_matches(".weight"));
                let weight = cfg.frozen_tensors().iter().map(|(w, _)| w.clone()).find(|w| of(w)).unwrap_or_else(|| n.clone());
                *bytes.entry(weight).or_default() += v.data().len();
            }
            return Ok(Some(crate::dist::plan::QuantizedBase { bytes, what: "bitsandbytes 4/8-bit weights".into() }));
        }
    }
    let Some(q) = &m.quantize else { return Ok(None) };
    let target = parse_quantize(q).ok_or_else(|| Error::Recipe { file: loaded.file.display().to_string(), key: "model.quantize".into(), msg: format!("`{q}` is not a format this quantizes to") })?;
    let storage = super::parse_dtype(&m.dtype);
    let bytes = cfg
        .frozen_tensors()
        .into_iter()
        .map(|(n, s)| {
            let elems = s.iter().product::<usize>();
            let quantized = match target {
                Quantize::Ggml(t) => quantized_format(t, &n, &s).map(|d| ggml_bytes(d, elems)),
                Quantize::Nf4 => nf4_quantizes(&n, &s).then(|| super::bnb::Bnb4::nf4_bytes(elems)),
            };
            (n.clone(), quantized.unwrap_or(elems * stored_dtype(&n, storage).size_in_bytes()))
        })
        .collect();
    Ok(Some(crate::dist::plan::QuantizedBase { bytes, what: format!("model.quantize = {q}") }))
}

impl BlockReader for QuantizeOnLoad {
    fn contains(&self, name: &str) -> bool {
        self.files.file_of(name).is_some()
    }
    fn file(&self) -> String {
        self.files.names_by_file().iter().map(|(p, _)| p.display().to_string()).collect::<Vec<_>>().join(", ")
    }
    fn read(&mut self, name: &str, device: &Device) -> Result<Blocks> {
        let dims = self.files.shape(name)?;
        let t = self.files.load(name, &dims, &Device::Cpu)?;
        Ok(match self.target {
            Quantize::Ggml(target) => match quantized_format(target, name, &dims) {
                Some(d) => Blocks::Ggml { q: QTensor::quantize_onto(&t.to_dtype(DType::F32)?, d, device)?, unpermute_heads: None },
                None => Blocks::Plain(t.to_dtype(stored_dtype(name, self.storage))?.to_device(device)?),
            },
            // Quantised from the weight in the storage dtype, as transformers casts a
            // checkpoint to `torch_dtype` before bitsandbytes quantises it.
            Quantize::Nf4 if nf4_quantizes(name, &dims) => Blocks::Bnb4(super::bnb::Bnb4::quantize_nf4(&t.to_dtype(self.storage)?)?),
            Quantize::Nf4 => Blocks::Plain(t.to_dtype(stored_dtype(name, self.storage))?.to_device(device)?),
        })
    }
}

/// The ggml type a `model.quantize` value names.
pub fn parse_format(s: &str) -> Option<GgmlDType> {
    Some(match s {
        "q8_0" => GgmlDType::Q8_0,
        "q4_0" => GgmlDType::Q4_0,
        "q4_k" => GgmlDType::Q4K,
        "q5_k" => GgmlDType::Q5K,
        "q6_k" => GgmlDType::Q6K,
        _ => return None,
    })
}

/// The quantized frozen-weight source.
pub struct QuantizedWeights {
    reader: Mutex<Option<Box<dyn BlockReader>>>,
    /// Where the blocks came from, for messages once the reader is gone.
    origin: String,
    blocks: Mutex<HashMap<String, Arc<Blocks>>>,
    held: Mutex<Held>,
    /// Keep every dequantised tensor (`keep_dequantised`): for generation, which runs every
    /// layer per token.
    kept: Option<Mutex<HashMap<String, Tensor>>>,
    storage_dtype: DType,
    compute_dtype: DType,
    matmul_dtype: DType,
    device: Device,
    account: Arc<Account>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl QuantizedWeights {
    /// Layers are dequantised into `storage_dtype` (the recipe's `model.dtype`), with
    /// `prefetch` layers ahead held too.
    #[allow(clippy::too_many_arguments)]
    pub fn new(reader: Box<dyn BlockReader>, n_layers: usize, prefetch: usize, storage_dtype: DType, compute_dtype: DType, device: Device, account: Arc<Account>) -> Self {
        QuantizedWeights {
            origin: reader.file(),
            reader: Mutex::new(Some(reader)),
            blocks: Default::default(),
            held: Mutex::new(Held::new(n_layers, prefetch)),
            kept: None,
            storage_dtype,
            compute_dtype,
            matmul_dtype: compute_dtype,
            device,
            account,
        }
    }

    /// Hand projection weights to the frozen matmul in `dtype` (see `ops::Kernels::matmul_dtype`).
    pub fn with_matmul_dtype(mut self, dtype: DType) -> Self {
        self.matmul_dtype = dtype;
        self
    }

    /// Keep each tensor once dequantised (memory of an unquantized base, dequantising once):
    /// what token-by-token generation wants, never training.
    pub fn keep_dequantised(mut self) -> Self {
        self.kept = Some(Mutex::new(HashMap::new()));
        self
    }

    /// The blocks of `name`, read on first request, shape checked.
    fn blocks(&self, name: &str, shape: &[usize]) -> Result<Arc<Blocks>> {
        // Bound first: a guard in the match scrutinee would live through the insert below.
        let cached = lock(&self.blocks).get(name).cloned();
        let b = match cached {
            Some(b) => b,
            None => {
                let mut reader = lock(&self.reader);
                let reader = reader.as_mut().ok_or_else(|| Error::MissingTensor { name: name.into(), files: format!("{} (weights sealed after load)", self.origin) })?;
                if !reader.contains(name) {
                    return Err(Error::MissingTensor { name: name.into(), files: self.origin.clone() });
                }
                // Read by another thread while this one waited for the reader.
                let again = lock(&self.blocks).get(name).cloned();
                if let Some(b) = again {
                    return self.check_shape(name, shape, b);
                }
                let b = Arc::new(reader.read(name, &self.device)?);
                self.account.frozen.fetch_add(b.bytes(), Ordering::SeqCst);
                lock(&self.blocks).insert(name.to_string(), b.clone());
                b
            }
        };
        self.check_shape(name, shape, b)
    }

    fn check_shape(&self, name: &str, shape: &[usize], b: Arc<Blocks>) -> Result<Arc<Blocks>> {
        if b.dims() != shape {
            return Err(Error::Shape { name: name.into(), file: self.origin.clone(), expected: shape.to_vec(), got: b.dims() });
        }
        Ok(b)
    }

    /// Dequantise every tensor of `unit` not yet in `held` (plus `also`).
    fn dequantize_unit(&self, unit: &Unit, held: &mut HashMap<String, Tensor>, also: Option<&str>) -> Result<usize> {
        let todo: Vec<(String, Arc<Blocks>)> = lock(&self.blocks)
            .iter()
            .filter(|(n, _)| (&Unit::of(n) == unit || Some(n.as_str()) == also) && !held.contains_key(*n))
            .map(|(n, b)| (n.clone(), b.clone()))
            .collect();
        let mut bytes = 0;
        for (name, b) in todo {
            let t = b.dequantize(&self.device).and_then(|t| t.to_dtype(stored_dtype(&name, self.storage_dtype))).map_err(|e| self.dequantize_error(&name, &e))?;
            bytes += t.elem_count() * t.dtype().size_in_bytes();
            held.insert(name, t);
        }
        Ok(bytes)
    }

    fn dequantize_error(&self, name: &str, e: &candle_core::Error) -> Error {
        Error::Safetensors { file: self.origin.clone().into(), msg: format!("dequantising `{name}`: {}", crate::error::candle_msg(e)) }
    }

    /// Bytes of quantized blocks held (the `frozen` of the memory account).
    pub fn quantized_bytes(&self) -> usize {
        lock(&self.blocks).values().map(|b| b.bytes()).sum()
    }
}

impl WeightSource for QuantizedWeights {
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
        self.blocks(name, shape)?;
        if let Some(kept) = &self.kept {
            if let Some(t) = lock(kept).get(name) {
                return Ok(t.clone());
            }
            let mut one = HashMap::new();
            self.dequantize_unit(&Unit::Tensor(String::new()), &mut one, Some(name))?;
            let t = one.remove(name).ok_or_else(|| Error::MissingTensor { name: name.into(), files: self.origin.clone() })?;
            lock(kept).insert(name.to_string(), t.clone());
            return Ok(t);
        }
        lock(&self.held).fetch(name, &self.account, |u, held, also| self.dequantize_unit(u, held, also))
    }
    /// Only these rows are dequantised (the LM head, which the loss reads a chunk at a time);
    /// the window moves on to the head, so the layers' dequantised weights are gone meanwhile.
    fn get_matmul_rows(&self, name: &str, shape: &[usize], start: usize, len: usize) -> Result<Tensor> {
        if self.kept.is_some() {
            return Ok(self.get_stored(name, shape)?.narrow(0, start, len)?.to_dtype(self.matmul_dtype)?);
        }
        let b = self.blocks(name, shape)?;
        // Probe with an empty cut: whether rows can be had alone (the bytes are not copied).
        if b.dequantize_rows(0, 0).is_none() {
            // Dequantised whole once, into the window (as a layer is), and cut there.
            return Ok(self.get_stored(name, shape)?.narrow(0, start, len)?.to_dtype(self.matmul_dtype)?);
        }
        let make = || {
            b.dequantize_rows(start, len)
                .unwrap_or_else(|| candle_core::bail!("rows {start}..{} of {shape:?}", start + len))
                .and_then(|t| t.to_device(&self.device))
                .and_then(|t| t.to_dtype(stored_dtype(name, self.storage_dtype)))
                .map_err(|e| self.dequantize_error(name, &e))
        };
        Ok(lock(&self.held).transient(name, &self.account, make)?.to_dtype(self.matmul_dtype)?)
    }
    /// Reads the blocks (checking the shape) without dequantising them.
    fn check(&self, name: &str, shape: &[usize]) -> Result<()> {
        self.blocks(name, shape).map(drop)
    }
    /// Only the picked rows are dequantised (candle's `QTensor::embedding`), never held in
    /// the window; a table whose rows do not split into blocks is dequantised whole for the
    /// moment (the transient bytes booked are the rows').
    fn embedding(&self, name: &str, shape: &[usize], ids: &Tensor) -> Result<Tensor> {
        let storage = stored_dtype(name, self.storage_dtype);
        let b = self.blocks(name, shape)?;
        if self.kept.is_some() {
            return Ok(self.get_stored(name, shape)?.index_select(ids, 0)?.to_dtype(self.compute_dtype)?);
        }
        let make = || {
            match &*b {
                Blocks::Ggml { q, unpermute_heads: None } if shape[1].is_multiple_of(q.dtype().block_size()) => q.embedding(ids),
                Blocks::Plain(t) => t.index_select(ids, 0),
                b => b.dequantize(&self.device).and_then(|t| t.index_select(ids, 0)),
            }
            .and_then(|t| t.to_dtype(storage))
            .map_err(|e| self.dequantize_error(name, &e))
        };
        // Through the window like the other tensors, so the layers are released meanwhile.
        Ok(lock(&self.held).transient(name, &self.account, make)?.to_dtype(self.compute_dtype)?)
    }
    fn contains(&self, name: &str) -> bool {
        // One lock at a time: `blocks()` takes the reader, then the blocks.
        let cached = lock(&self.blocks).contains_key(name);
        cached || lock(&self.reader).as_ref().is_some_and(|r| r.contains(name))
    }
    fn seal(&self) {
        *lock(&self.reader) = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nf4_quantizes_every_linear_of_a_deepseek_layer_but_the_router() {
        let q = |n: &str| nf4_quantizes(&format!("model.layers.3.{n}"), &[64, 32]);
        for n in ["self_attn.q_proj.weight", "self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight", "mlp.experts.7.down_proj.weight", "mlp.shared_experts.up_proj.weight", "mlp.gate_proj.weight"] {
            assert!(q(n), "{n}");
        }
        for n in ["mlp.gate.weight", "self_attn.kv_a_layernorm.weight", "input_layernorm.weight"] {
            assert!(!q(n), "{n}");
        }
        assert!(!nf4_quantizes("model.embed_tokens.weight", &[64, 32]) && !nf4_quantizes("lm_head.weight", &[64, 32]));
        assert!(!nf4_quantizes("model.layers.0.mlp.gate.e_score_correction_bias", &[8]));
    }

    #[test]
    fn k_quant_fallbacks_are_llama_cpp_s_and_the_run_says_so() {
        let w = |cols: usize| vec![64, cols];
        assert_eq!(quantized_format(GgmlDType::Q4K, "model.layers.0.mlp.up_proj.weight", &w(512)), Some(GgmlDType::Q4K));
        assert_eq!(quantized_format(GgmlDType::Q4K, "model.layers.0.mlp.up_proj.weight", &w(96)), Some(GgmlDType::Q5_0));
        assert_eq!(quantized_format(GgmlDType::Q5K, "model.layers.0.mlp.up_proj.weight", &w(96)), Some(GgmlDType::Q5_1));
        assert_eq!(quantized_format(GgmlDType::Q6K, "model.layers.0.mlp.up_proj.weight", &w(96)), Some(GgmlDType::Q8_0));
        assert_eq!(quantized_format(GgmlDType::Q4K, "model.layers.0.mlp.up_proj.weight", &w(48)), None);
        let cfg = |h: usize| {
            let text = format!(r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":{h},"intermediate_size":512,"num_hidden_layers":1,"num_attention_heads":2,"vocab_size":64}}"#);
            crate::config::ModelConfig::resolve(&serde_json::from_str(&text).unwrap()).unwrap()
        };
        assert_eq!(fallback_note(GgmlDType::Q4K, &cfg(512)), None);
        let n = fallback_note(GgmlDType::Q4K, &cfg(96)).unwrap();
        assert!(n.contains("not a multiple of 256") && n.contains("Q5_0"), "{n}");
    }

    /// A chunk of rows dequantised alone equals those rows of the whole tensor, for block
    /// sizes 32 and 256, at chunk edges that are not block multiples of rows.
    #[test]
    fn rows_dequantised_alone_equal_the_rows_of_the_whole_tensor() -> candle_core::Result<()> {
        let (v, h) = (300, 512);
        let t = Tensor::from_vec((0..v * h).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect(), (v, h), &Device::Cpu)?;
        for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_1, GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::F16, GgmlDType::BF16, GgmlDType::F32] {
            let b = Blocks::Ggml { q: QTensor::quantize(&t, dtype)?, unpermute_heads: None };
            let whole = b.dequantize(&Device::Cpu)?;
            for (start, len) in [(0, 64), (64, 173), (237, 63)] {
                let rows = b.dequantize_rows(start, len).expect("cut alone on the CPU")?;
                let d = (rows - whole.narrow(0, start, len)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert_eq!(d, 0.0, "{dtype:?} rows {start}+{len}");
            }
        }
        Ok(())
    }
}
