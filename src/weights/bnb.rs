//! HF checkpoints saved by bitsandbytes (`quantization_config.quant_method = "bitsandbytes"`)
//! as a quantized base: 4-bit NF4 / FP4 (optionally with double-quantised absmax) and 8-bit
//! (LLM.int8) weights, held in their stored form and dequantised a layer at a time.
//!
//! What transformers + bitsandbytes 0.50 write for a 4-bit linear `W` [out, in] (n = out·in):
//! - `W`: uint8 [ceil(n/2), 1], W flattened row-major, element 2i in the high nibble and
//!   2i+1 in the low one;
//! - `W.absmax`: one scale per block of 64 consecutive flat elements (blocks run across row
//!   ends): f32, or uint8 codes with double quantisation;
//! - double quantisation: `W.nested_absmax` (f32, one per 256 blocks), `W.nested_quant_map`
//!   (the 256-entry dynamic map), and `nested_offset` in the JSON; a block's scale is
//!   `nested_quant_map[code] * nested_absmax[block / 256]` (rounded to f32) `+ offset`;
//! - `W.quant_map` (16 code values) and `W.quant_state.bitsandbytes__nf4` / `__fp4` (the
//!   UTF-8 JSON: quant_type, blocksize, dtype, shape, nested_*).
//!
//! W[i] = quant_map[code_i] * scale[i / blocksize], in f32, as bitsandbytes' dequantize_4bit
//! computes it (and as PEFT's backward on a bnb base multiplies with). 8-bit: `W` int8
//! [out, in] and `<module>.SCB` f32 [out]; W = W_int8 * (SCB * (1/127)), bitsandbytes' CPU
//! training path. Tensors without quantisation state (embeddings, norms, lm_head) are read
//! as they are.

use super::quantized::{BlockReader, Blocks};
use super::{stored_dtype, SafetensorsFiles};
use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};

/// bitsandbytes' NF4 code values, in code order.
const NF4: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];
/// The blocksize transformers' `BitsAndBytesConfig` uses by default.
const NF4_BLOCK: usize = 64;

/// A 4-bit weight as bitsandbytes stores it.
pub struct Bnb4 {
    shape: Vec<usize>,
    codes: Vec<u8>,
    table: [f32; 16],
    blocksize: usize,
    absmax: Absmax,
    /// The dtype the weight was quantised from (`quant_state`'s `dtype`): bitsandbytes'
    /// `dequantize_4bit` computes code x absmax in f32 and returns it in this dtype, so a bf16
    /// base's weights are that product rounded to bf16.
    dtype: DType,
}

enum Absmax {
    F32(Vec<f32>),
    /// Double quantisation: uint8 codes into `map`, scaled per `group` blocks, plus `offset`.
    Nested { codes: Vec<u8>, map: Vec<f32>, scales: Vec<f32>, group: usize, offset: f32 },
}

/// An 8-bit (LLM.int8) weight: int8 rows and one f32 scale per row.
pub struct Bnb8 {
    shape: Vec<usize>,
    w: Vec<i8>,
    scb: Vec<f32>,
}

impl Bnb4 {
    pub fn dims(&self) -> Vec<usize> {
        self.shape.clone()
    }
    pub fn bytes(&self) -> usize {
        self.codes.len()
            + match &self.absmax {
                Absmax::F32(a) => 4 * a.len(),
                Absmax::Nested { codes, map, scales, .. } => codes.len() + 4 * (map.len() + scales.len()),
            }
    }
    fn scale(&self, block: usize) -> f32 {
        match &self.absmax {
            Absmax::F32(a) => a[block],
            Absmax::Nested { codes, map, scales, group, offset } => map[codes[block] as usize] * scales[block / group] + offset,
        }
    }
    /// Bytes `quantize_nf4` holds for `n` weights: packed codes plus one f32 scale per block.
    pub fn nf4_bytes(n: usize) -> usize {
        n.div_ceil(2) + 4 * n.div_ceil(NF4_BLOCK)
    }

    /// NF4 (blocksize 64, f32 absmax, no double quantisation) exactly as bitsandbytes 0.50's
    /// `quantize_4bit` computes it on CPU, so a base quantised here is the base PEFT + bitsandbytes
    /// trains on (fixture `tests/fixtures/nf4-quantize`, whose README spells out each rounding rule).
    /// Refuses non-finite weights: bitsandbytes would turn a whole block into code 15.
    pub fn quantize_nf4(t: &Tensor) -> candle_core::Result<Bnb4> {
        let shape = t.dims().to_vec();
        // The cast is exact for bf16/f16; bitsandbytes quantises the f32 of the held dtype too.
        let x = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        if let Some(i) = x.iter().position(|v| !v.is_finite()) {
            candle_core::bail!("weight element {i} is {}: NF4 quantisation needs finite weights", x[i]);
        }
        let mids: [f32; 15] = std::array::from_fn(|i| (NF4[i] + NF4[i + 1]) / 2.0);
        let full = x.len() - x.len() % NF4_BLOCK;
        let mut absmax = Vec::with_capacity(x.len().div_ceil(NF4_BLOCK));
        let mut codes = vec![7u8; x.len().div_ceil(2) * 2]; // an odd count is padded with code 7
        for (b, block) in x.chunks(NF4_BLOCK).enumerate() {
            let am = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let clamped = am.max(1e-38);
            let tail = b * NF4_BLOCK >= full;
            // Full blocks multiply by the f32 reciprocal and store absmax as is; the partial last
            // block divides and stores the clamped value (bitsandbytes' two code paths).
            let recip = 1.0 / clamped;
            absmax.push(if tail { clamped } else { am });
            for (k, &v) in block.iter().enumerate() {
                let scaled = if tail { v / clamped } else { v * recip }.clamp(-1.0, 1.0);
                codes[b * NF4_BLOCK + k] = mids.iter().filter(|&&m| scaled > m).count() as u8;
            }
        }
        let codes = codes.chunks_exact(2).map(|p| p[0] << 4 | p[1]).collect();
        Ok(Bnb4 { shape, codes, table: NF4, blocksize: NF4_BLOCK, absmax: Absmax::F32(absmax), dtype: t.dtype() })
    }

    /// The packed codes and per-block scales (f32 absmax only), as bitsandbytes stores them.
    pub fn nf4_parts(&self) -> Option<(&[u8], &[f32])> {
        match &self.absmax {
            Absmax::F32(a) => Some((&self.codes, a)),
            Absmax::Nested { .. } => None,
        }
    }

    /// The weight in f32 on `device`: each value as bitsandbytes dequantises it, in the
    /// dtype it was quantised from (rounded to nearest-even from the f32 product), widened.
    pub fn dequantize(&self, device: &Device) -> candle_core::Result<Tensor> {
        use rayon::prelude::*;
        let n: usize = self.shape.iter().product();
        let mut out = vec![0f32; n];
        let round: fn(f32) -> f32 = match self.dtype {
            DType::BF16 => |v| half::bf16::from_f32(v).to_f32(),
            DType::F16 => |v| half::f16::from_f32(v).to_f32(),
            _ => |v| v,
        };
        const CHUNK: usize = 8192; // even: a chunk starts on a byte
        out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, o)| {
            for (k, y) in o.iter_mut().enumerate() {
                let i = c * CHUNK + k;
                let byte = self.codes[i / 2];
                let code = if i.is_multiple_of(2) { byte >> 4 } else { byte & 0x0f };
                *y = round(self.table[code as usize] * self.scale(i / self.blocksize));
            }
        });
        Tensor::from_vec(out, self.shape.as_slice(), device)
    }
}

impl Bnb8 {
    pub fn dims(&self) -> Vec<usize> {
        self.shape.clone()
    }
    pub fn bytes(&self) -> usize {
        self.w.len() + 4 * self.scb.len()
    }
    pub fn dequantize(&self, device: &Device) -> candle_core::Result<Tensor> {
        let cols = self.shape[1];
        let out: Vec<f32> = self.w.iter().enumerate().map(|(i, &q)| q as f32 * (self.scb[i / cols] * (1.0 / 127.0))).collect();
        Tensor::from_vec(out, self.shape.as_slice(), device)
    }
}

/// Whether `files` hold bitsandbytes-quantised weights.
pub fn is_bnb(files: &SafetensorsFiles) -> bool {
    files.names().any(|n| n.contains(".quant_state.bitsandbytes__") || n.ends_with(".SCB"))
}

/// Whether `name` is quantisation state beside a weight (its scales, maps, JSON), not a
/// model tensor.
pub fn is_quant_state(name: &str) -> bool {
    name.contains(".quant_state.") || [".absmax", ".quant_map", ".nested_quant_map", ".nested_absmax", ".SCB", ".weight_format"].iter().any(|s| name.ends_with(s))
}

/// A bitsandbytes checkpoint as a quantized base's block source.
pub struct BnbReader {
    pub files: SafetensorsFiles,
    /// What tensors without quantisation state are held in.
    pub storage: DType,
}

impl BnbReader {
    /// The dtype the model was in before quantisation (the base's dtype): what its 4-bit
    /// weights' `quant_state` says (bitsandbytes dequantises to it), else that of its tensors
    /// kept as they were (an 8-bit checkpoint: the embedding's, or the first by name of those
    /// a 16-bit model holds in 16 bits; not the router's, kept f32), else f32. Names are taken
    /// in sorted order, so the answer never depends on a hash map's.
    pub fn original_dtype(&self) -> Result<DType> {
        let mut names: Vec<&String> = self.files.names().collect();
        names.sort();
        let states = ["nf4", "fp4"].map(|q| format!(".quant_state.bitsandbytes__{q}"));
        if let Some((weight, state)) = names.iter().find_map(|n| states.iter().find_map(|s| Some((n.strip_suffix(s.as_str())?, n.as_str())))) {
            return Ok(self.read4(weight, state)?.dtype);
        }
        let kept = |n: &&&String| !is_quant_state(n) && stored_dtype(n, DType::BF16) == DType::BF16;
        names.sort_by_key(|n| !n.ends_with("embed_tokens.weight"));
        for n in names.iter().filter(kept) {
            if let Some(d) = super::candle_dtype(self.files.raw_view(n)?.dtype()) {
                return Ok(d);
            }
        }
        Ok(DType::F32)
    }

    fn err(&self, name: &str, msg: impl Into<String>) -> Error {
        Error::Safetensors { file: self.files.file_of(name).map(|p| p.to_path_buf()).unwrap_or_default(), msg: format!("tensor `{name}`: {}", msg.into()) }
    }

    fn bytes(&self, name: &str) -> Result<Vec<u8>> {
        Ok(self.files.raw_view(name)?.data().to_vec())
    }

    fn f32s(&self, name: &str) -> Result<Vec<f32>> {
        let v = self.files.raw_view(name)?;
        if v.dtype() != safetensors::Dtype::F32 {
            return Err(self.err(name, format!("is {:?}, expected f32", v.dtype())));
        }
        Ok(v.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    }

    fn read4(&self, name: &str, state: &str) -> Result<Bnb4> {
        let json: serde_json::Value =
            serde_json::from_slice(&self.bytes(state)?).map_err(|e| self.err(state, format!("is not the JSON bitsandbytes writes: {e}")))?;
        let field = |k: &str| json.get(k).ok_or_else(|| self.err(state, format!("has no `{k}`")));
        let dims = field("shape")?.as_array().cloned().unwrap_or_default();
        let shape: Vec<usize> = dims.iter().filter_map(|x| x.as_u64().and_then(|x| usize::try_from(x).ok())).collect();
        let blocksize = field("blocksize")?.as_u64().and_then(|b| usize::try_from(b).ok()).unwrap_or(0);
        let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).filter(|_| shape.len() == dims.len()).unwrap_or(0);
        if shape.len() != 2 || n == 0 || blocksize == 0 {
            return Err(self.err(state, format!("shape {shape:?} / blocksize {blocksize}: expected a 2-D weight and a positive blocksize")));
        }
        // torch's dtype name as bitsandbytes writes it (`str(dtype)` without "torch.").
        let dtype = match field("dtype")?.as_str() {
            Some("bfloat16") => DType::BF16,
            Some("float16") => DType::F16,
            Some("float32") => DType::F32,
            other => return Err(self.err(state, format!("dtype {}: expected \"bfloat16\", \"float16\" or \"float32\"", other.map_or_else(|| json["dtype"].to_string(), |d| format!("\"{d}\""))))),
        };
        let codes = self.bytes(name)?;
        if codes.len() != n.div_ceil(2) {
            return Err(self.err(name, format!("holds {} bytes; shape {shape:?} packs into {}", codes.len(), n.div_ceil(2))));
        }
        let map = self.f32s(&format!("{name}.quant_map"))?;
        let table: [f32; 16] = map.try_into().map_err(|m: Vec<f32>| self.err(&format!("{name}.quant_map"), format!("has {} values, expected 16", m.len())))?;
        let blocks = n.div_ceil(blocksize);
        let absmax_name = format!("{name}.absmax");
        let absmax = if json.get("nested_blocksize").is_some() {
            let group = json["nested_blocksize"].as_u64().unwrap_or(0) as usize;
            let offset = json.get("nested_offset").and_then(|o| o.as_f64()).ok_or_else(|| self.err(state, "has nested_blocksize but no nested_offset"))? as f32;
            let codes = self.bytes(&absmax_name)?;
            let map = self.f32s(&format!("{name}.nested_quant_map"))?;
            let scales = self.f32s(&format!("{name}.nested_absmax"))?;
            if group == 0 || codes.len() != blocks || map.len() != 256 || scales.len() != blocks.div_ceil(group) {
                return Err(self.err(&absmax_name, format!("double quantisation: {} codes, {} map values, {} scales for {blocks} blocks of {blocksize} in groups of {group}", codes.len(), map.len(), scales.len())));
            }
            Absmax::Nested { codes, map, scales, group, offset }
        } else {
            let a = self.f32s(&absmax_name)?;
            if a.len() != blocks {
                return Err(self.err(&absmax_name, format!("has {} scales for {blocks} blocks of {blocksize}", a.len())));
            }
            Absmax::F32(a)
        };
        Ok(Bnb4 { shape, codes, table, blocksize, absmax, dtype })
    }

    fn read8(&self, name: &str, scb: &str) -> Result<Bnb8> {
        let v = self.files.raw_view(name)?;
        let shape = v.shape().to_vec();
        if v.dtype() != safetensors::Dtype::I8 || shape.len() != 2 {
            return Err(self.err(name, format!("is {:?} {shape:?}; an 8-bit bitsandbytes weight is int8 [out, in]", v.dtype())));
        }
        let w: Vec<i8> = v.data().iter().map(|&b| b as i8).collect();
        let scb = self.f32s(scb)?;
        if scb.len() != shape[0] {
            return Err(self.err(name, format!("has {} row scales (SCB) for {} rows", scb.len(), shape[0])));
        }
        Ok(Bnb8 { shape, w, scb })
    }
}

impl BlockReader for BnbReader {
    fn contains(&self, name: &str) -> bool {
        self.files.file_of(name).is_some()
    }
    fn file(&self) -> String {
        self.files.names_by_file().iter().map(|(p, _)| p.display().to_string()).collect::<Vec<_>>().join(", ")
    }
    fn read(&mut self, name: &str, device: &Device) -> Result<Blocks> {
        let state = ["nf4", "fp4"].map(|q| format!("{name}.quant_state.bitsandbytes__{q}")).into_iter().find(|s| self.files.file_of(s).is_some());
        if let Some(state) = state {
            return Ok(Blocks::Bnb4(self.read4(name, &state)?));
        }
        let scb = format!("{}.SCB", name.trim_end_matches(".weight"));
        if name.ends_with(".weight") && self.files.file_of(&scb).is_some() {
            return Ok(Blocks::Bnb8(self.read8(name, &scb)?));
        }
        let dims = self.files.shape(name)?;
        Ok(Blocks::Plain(self.files.load(name, &dims, &Device::Cpu)?.to_dtype(stored_dtype(name, self.storage))?.to_device(device)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An 8-bit weight dequantises row by row as W_int8 * (SCB / 127), the formula of
    /// bitsandbytes' CPU training path (no bitsandbytes-written 8-bit fixture yet).
    #[test]
    fn int8_rows_scale_by_their_scb_over_127() {
        let b = Bnb8 { shape: vec![2, 3], w: vec![127, -127, 0, 64, -1, 127], scb: vec![2.0, 0.5] };
        let t: Vec<Vec<f32>> = b.dequantize(&Device::Cpu).unwrap().to_vec2().unwrap();
        let s = |scb: f32| scb * (1.0 / 127.0);
        assert_eq!(t, vec![vec![127.0 * s(2.0), -127.0 * s(2.0), 0.0], vec![64.0 * s(0.5), -s(0.5), 127.0 * s(0.5)]]);
    }

    /// 4-bit: the first element of a byte is its high nibble, and blocks of `blocksize` run
    /// across row ends (bitsandbytes flattens the weight first).
    #[test]
    fn nf4_high_nibble_first_and_blocks_cross_rows() {
        let mut table = [0f32; 16];
        for (i, t) in table.iter_mut().enumerate() {
            *t = i as f32;
        }
        // 2 x 3 weight, blocks of 4: elements 0..4 scale 1, 4..6 scale 10.
        let b = Bnb4 { shape: vec![2, 3], codes: vec![0x12, 0x34, 0x56], table, blocksize: 4, absmax: Absmax::F32(vec![1.0, 10.0]), dtype: DType::F32 };
        let t: Vec<Vec<f32>> = b.dequantize(&Device::Cpu).unwrap().to_vec2().unwrap();
        assert_eq!(t, vec![vec![1.0, 2.0, 3.0], vec![4.0, 50.0, 60.0]]);
    }

    /// A weight quantised from bf16 (or f16) dequantises as bitsandbytes returns it: code x
    /// absmax in f32, then rounded to that dtype (`dequantize_4bit(...)` is `quant_state.dtype`).
    #[test]
    fn a_weight_quantised_from_bf16_or_f16_dequantises_rounded_to_it() {
        let table: [f32; 16] = std::array::from_fn(|i| NF4[i]);
        let absmax = 0.123_456_79_f32;
        for (dtype, round) in [(DType::BF16, (|v| half::bf16::from_f32(v).to_f32()) as fn(f32) -> f32), (DType::F16, |v| half::f16::from_f32(v).to_f32()), (DType::F32, |v| v)] {
            let b = Bnb4 { shape: vec![1, 16], codes: (0..8).map(|i| (2 * i) << 4 | (2 * i + 1)).collect(), table, blocksize: 16, absmax: Absmax::F32(vec![absmax]), dtype };
            let got: Vec<f32> = b.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let want: Vec<f32> = NF4.iter().map(|&c| round(c * absmax)).collect();
            assert_eq!(got, want, "{dtype:?}");
            if dtype != DType::F32 {
                assert_ne!(got, NF4.iter().map(|&c| c * absmax).collect::<Vec<_>>(), "{dtype:?}: the f32 products are not all {dtype:?} values");
            }
        }
    }
}
