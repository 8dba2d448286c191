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

mod deepseek2;
mod pretok;
mod rope;

use crate::error::{Error, Result};
use candle_core::quantized::gguf_file::{Content, TensorInfo, Value, VersionedMagic};
use crate::weights::quantized::Blocks;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Read;
use std::path::{Path, PathBuf};

pub struct ImportReport {
    pub tensors: usize,
    pub config: serde_json::Value,
    pub shards: usize,
}

fn gguf_err(file: &Path, key: impl Into<String>, msg: impl Into<String>) -> Error {
    Error::Gguf { file: file.to_path_buf(), key: key.into(), msg: msg.into() }
}

// ---------------------------------------------------------------------------------------
// The header reader. candle's `Content::read` trusts more of the header than a converter
// fed arbitrary files should (`general.alignment = 0` divides by zero; dimension products
// can overflow; every metadata array is materialised), so the header is read here: every
// length, count, dimension and offset is checked against the bytes the file still has
// before anything is allocated or multiplied, and the result is candle's `Content`, whose
// tensor reads bound themselves by the file size too.

/// ggml's GGML_MAX_DIMS: llama.cpp rejects tensors of more dimensions.
const MAX_DIMS: u32 = 4;
/// Arrays in arrays: the spec allows nesting, llama models never use it; this bounds the
/// recursion a crafted chain of nested arrays could drive.
const MAX_DEPTH: usize = 8;
/// Elements of one array the reader keeps in memory (a `Value` is 32 bytes, so a kept array
/// costs up to 32x its bytes on disk). The largest real vocabularies and merge lists are
/// ~10^6; a longer array is a corrupt or hostile file, not a tokenizer.
const MAX_KEPT_ARRAY: u64 = 1 << 22;

/// Metadata the import reads; the values of other keys are checked for their type and
/// length and skipped, so a large unrelated array costs no memory.
fn kept(key: &str) -> bool {
    key == "general.architecture" || key == "general.alignment" || key == "general.type" || ["llama.", "qwen2.", "deepseek2.", "tokenizer."].iter().any(|p| key.starts_with(p))
}

struct Reader<'a, R> {
    r: R,
    /// Bytes consumed so far.
    pos: u64,
    /// The file's length: nothing the header declares may reach past it.
    size: u64,
    file: &'a Path,
    /// GGUF v1 writes lengths and dimensions as u32, v2 and v3 as u64.
    v1: bool,
}

impl<R: Read> Reader<'_, R> {
    fn err(&self, key: &str, msg: impl Into<String>) -> Error {
        gguf_err(self.file, key, msg)
    }

    fn left(&self) -> u64 {
        self.size.saturating_sub(self.pos)
    }

    /// `n` more bytes must be in the file: checked before they are allocated or read.
    fn need(&self, n: u64, key: &str, what: &str) -> Result<()> {
        if n > self.left() {
            return Err(self.err(key, format!("{what}: {n} bytes needed at offset {}, but the file has {} left (truncated or corrupt header)", self.pos, self.left())));
        }
        Ok(())
    }

    fn fixed<const N: usize>(&mut self, key: &str, what: &str) -> Result<[u8; N]> {
        self.need(N as u64, key, what)?;
        let mut b = [0u8; N];
        self.r.read_exact(&mut b).map_err(|e| self.err(key, format!("reading {what}: {e}")))?;
        self.pos += N as u64;
        Ok(b)
    }

    fn u32(&mut self, key: &str, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.fixed(key, what)?))
    }

    fn u64(&mut self, key: &str, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.fixed(key, what)?))
    }

    /// A string length, array length or dimension: u32 in v1, u64 after.
    fn len(&mut self, key: &str, what: &str) -> Result<u64> {
        if self.v1 {
            Ok(self.u32(key, what)? as u64)
        } else {
            self.u64(key, what)
        }
    }

    fn len_prefix(&self) -> u64 {
        if self.v1 {
            4
        } else {
            8
        }
    }

    /// `n` bytes, kept (`Some`) or skipped.
    fn bytes(&mut self, n: u64, key: &str, what: &str, keep: bool) -> Result<Option<Vec<u8>>> {
        self.need(n, key, what)?;
        // n <= the file's remaining length, so it fits in memory's address space.
        let got = if keep {
            let mut v = vec![0u8; n as usize];
            self.r.read_exact(&mut v).map_err(|e| self.err(key, format!("reading {what}: {e}")))?;
            Some(v)
        } else {
            let copied = std::io::copy(&mut (&mut self.r).take(n), &mut std::io::sink()).map_err(|e| self.err(key, format!("reading {what}: {e}")))?;
            if copied != n {
                return Err(self.err(key, format!("{what}: the file ended early")));
            }
            None
        };
        self.pos += n;
        Ok(got)
    }

    fn string(&mut self, key: &str, what: &str, keep: bool) -> Result<Option<String>> {
        let n = self.len(key, &format!("the length of {what}"))?;
        Ok(self.bytes(n, key, what, keep)?.map(|mut v| {
            // As candle reads them: writers are meant to leave strings unterminated, some
            // do not; and not every tokenizer string is valid UTF-8.
            while v.last() == Some(&0) {
                v.pop();
            }
            String::from_utf8_lossy(&v).into_owned()
        }))
    }

    /// Bytes one value of GGUF type `ty` takes at least: what an array's length is checked
    /// against before its elements are read.
    fn min_size(&self, ty: u32) -> u64 {
        match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            8 => self.len_prefix(),
            _ => 4 + self.len_prefix(), // an array: its element type and length
        }
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize, keep: bool) -> Result<Option<Value>> {
        macro_rules! num {
            ($variant:ident, $t:ty) => {{
                let b = self.fixed::<{ std::mem::size_of::<$t>() }>(key, "the value")?;
                Value::$variant(<$t>::from_le_bytes(b))
            }};
        }
        let v = match ty {
            0 => num!(U8, u8),
            1 => num!(I8, i8),
            2 => num!(U16, u16),
            3 => num!(I16, i16),
            4 => num!(U32, u32),
            5 => num!(I32, i32),
            6 => num!(F32, f32),
            10 => num!(U64, u64),
            11 => num!(I64, i64),
            12 => num!(F64, f64),
            7 => match self.fixed::<1>(key, "the value")?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.err(key, format!("bool value is {b}, expected 0 or 1"))),
            },
            8 => match self.string(key, "the string value", keep)? {
                Some(s) => Value::String(s),
                None => return Ok(None),
            },
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(self.err(key, format!("arrays nested more than {MAX_DEPTH} deep")));
                }
                let elem = self.u32(key, "the array's element type")?;
                if elem > 12 {
                    return Err(self.err(key, format!("array element type {elem} is not a GGUF type (0..=12)")));
                }
                let n = self.len(key, "the array's length")?;
                self.need(n.saturating_mul(self.min_size(elem)), key, &format!("an array of {n} elements of GGUF type {elem}"))?;
                if keep && n > MAX_KEPT_ARRAY {
                    return Err(self.err(key, format!("array of {n} elements; more than {MAX_KEPT_ARRAY} is not a llama model's metadata")));
                }
                if !keep && elem != 8 && elem != 9 {
                    // Fixed-size elements: skipped in one go (the length was checked above).
                    self.bytes(n * self.min_size(elem), key, "the array", false)?;
                    return Ok(None);
                }
                let mut vs = Vec::new();
                for _ in 0..n {
                    if let Some(v) = self.value(elem, key, depth + 1, keep)? {
                        vs.push(v);
                    }
                }
                if !keep {
                    return Ok(None);
                }
                Value::Array(vs)
            }
            t => return Err(self.err(key, format!("value type {t} is not a GGUF type (0..=12)"))),
        };
        Ok(keep.then_some(v))
    }
}

/// ggml's type codes, as candle maps them (its own mapping is crate-private).
fn ggml_dtype(code: u32) -> Option<GgmlDType> {
    Some(match code {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        // Q8_1 (9) and Q8_K (15) are llama.cpp's intermediate formats for activations, never
        // a model file's weights, and candle cannot dequantise them: refused with the header.
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// llama.cpp's name of a tensor type this does not read (`ggml_type` in ggml.h), for the
/// error refusing it.
fn ggml_type_name(code: u32) -> Option<&'static str> {
    Some(match code {
        9 => "Q8_1",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        // 31-33 and 36-38: repacked layouts llama.cpp no longer writes, found in older files.
        31 => "Q4_0_4_4",
        32 => "Q4_0_4_8",
        33 => "Q4_0_8_8",
        34 => "TQ1_0",
        35 => "TQ2_0",
        36 => "IQ4_NL_4_4",
        37 => "IQ4_NL_4_8",
        38 => "IQ4_NL_8_8",
        39 => "MXFP4",
        40 => "NVFP4",
        41 => "Q1_0",
        _ => return None,
    })
}

/// Read and check a GGUF header: the open file and candle's `Content` for it, holding the
/// metadata the import uses ([`kept`]: `general.architecture`, `general.alignment`,
/// `general.type`, `llama.*`, `qwen2.*`, `deepseek2.*`, `tokenizer.*`; other keys are checked
/// and skipped) and every tensor's record.
///
/// Nothing the header declares is trusted: lengths and counts are checked against the bytes
/// left in the file before anything is allocated, dimension products and data ranges with
/// checked arithmetic, and each tensor's data must lie inside the file. Errors are
/// [`Error::Gguf`] naming the file and the key, tensor or header field.
pub fn read_header(gguf: &Path) -> Result<(std::fs::File, Content)> {
    let f = std::fs::File::open(gguf).map_err(|e| Error::io(gguf, e))?;
    let size = f.metadata().map_err(|e| Error::io(gguf, e))?.len();
    let mut r = Reader { r: std::io::BufReader::new(&f), pos: 0, size, file: gguf, v1: false };
    let magic = r.fixed::<4>("magic", "the magic bytes")?;
    if &magic != b"GGUF" {
        return Err(r.err("magic", format!("starts with {magic:02x?}, not `GGUF`: not a GGUF file")));
    }
    let version = r.u32("version", "the version")?;
    let magic = match version {
        1 => VersionedMagic::GgufV1,
        2 => VersionedMagic::GgufV2,
        3 => VersionedMagic::GgufV3,
        v if v.swap_bytes() <= 3 => return Err(r.err("version", format!("{v:#x} is a big-endian GGUF file; only little-endian ones are supported"))),
        v => return Err(r.err("version", format!("{v}: only GGUF versions 1, 2 and 3 exist"))),
    };
    r.v1 = version == 1;
    let n_tensors = r.len("tensor_count", "the tensor count")?;
    let n_kv = r.len("metadata_kv_count", "the metadata count")?;
    // A metadata entry is at least a key length, a type and one byte; a tensor record at
    // least a name length, a dimension count, a type and an offset.
    let p = r.len_prefix();
    let kv_least = n_kv.saturating_mul(p + 4 + 1);
    r.need(kv_least, "metadata_kv_count", &format!("{n_kv} metadata entries"))?;
    let least = kv_least.saturating_add(n_tensors.saturating_mul(p + 4 + 4 + 8));
    r.need(least, "tensor_count", &format!("{n_tensors} tensor records after {n_kv} metadata entries"))?;

    let mut metadata = HashMap::new();
    let mut seen = HashSet::new();
    for i in 0..n_kv {
        let key = r.string(&format!("metadata entry {i}"), "its key", true)?.unwrap_or_default();
        if !seen.insert(key.clone()) {
            return Err(r.err(&key, "appears twice in the metadata"));
        }
        let ty = r.u32(&key, "the value type")?;
        let keep = kept(&key);
        if let Some(v) = r.value(ty, &key, 0, keep)? {
            metadata.insert(key, v);
        }
    }

    let mut records = Vec::new();
    let mut names = HashSet::new();
    for i in 0..n_tensors {
        let name = r.string(&format!("tensor record {i}"), "the tensor name", true)?.unwrap_or_default();
        if name.is_empty() {
            // Usually a header read at the wrong offsets (a damaged file, or the version field
            // saying 1 where the layout is 2 or 3): name the record, not an empty key.
            return Err(r.err(&format!("tensor record {i}"), "has an empty name (a damaged header?)"));
        }
        if !names.insert(name.clone()) {
            return Err(r.err(&name, "two tensors have this name"));
        }
        let n_dims = r.u32(&name, "the dimension count")?;
        if n_dims > MAX_DIMS {
            return Err(r.err(&name, format!("{n_dims} dimensions; GGUF tensors have at most {MAX_DIMS}")));
        }
        let mut dims = Vec::new();
        for _ in 0..n_dims {
            let d = r.len(&name, "a dimension")?;
            dims.push(usize::try_from(d).map_err(|_| r.err(&name, format!("dimension {d} does not fit this machine's address space")))?);
        }
        let code = r.u32(&name, "the tensor type")?;
        let dtype = ggml_dtype(code).ok_or_else(|| {
            let what = ggml_type_name(code).map_or(format!("tensor type {code}"), |n| format!("tensor type {n} ({code})"));
            r.err(&name, format!("{what} is not one this reads (f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k..q6_k): requantize the model to one of those (llama.cpp's llama-quantize, e.g. Q4_K_M)"))
        })?;
        let offset = r.u64(&name, "the data offset")?;
        records.push((name, dims, dtype, offset));
    }

    let alignment = match metadata.get("general.alignment") {
        None => candle_core::quantized::gguf_file::DEFAULT_ALIGNMENT,
        Some(v) => match as_uint(v) {
            Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 30 => a,
            Some(a) => return Err(gguf_err(gguf, "general.alignment", format!("is {a}; the data alignment must be a power of two"))),
            None => return Err(gguf_err(gguf, "general.alignment", format!("has GGUF type {}, expected an unsigned integer (uint32)", type_name(v)))),
        },
    };
    // pos <= size and alignment <= 2^30, so this cannot overflow.
    let data_start = r.pos.div_ceil(alignment) * alignment;

    let mut tensor_infos = HashMap::new();
    let mut spans = Vec::new();
    for (name, mut dims, dtype, offset) in records {
        let err = |msg: String| gguf_err(gguf, &name, msg);
        let elems = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| err(format!("dimensions {dims:?} multiply past 2^64 elements")))?;
        // ggml stores rows of whole blocks: the first (innermost) dimension is a multiple.
        let block = dtype.block_size();
        if dims.first().is_some_and(|d| d % block != 0) {
            return Err(err(format!("rows of {} elements do not split into {dtype:?} blocks of {block}", dims[0])));
        }
        let bytes = (elems / block).checked_mul(dtype.type_size()).ok_or_else(|| err(format!("{elems} {dtype:?} elements overflow a byte count")))?;
        if offset % alignment != 0 {
            return Err(err(format!("data offset {offset} is not a multiple of the alignment {alignment}")));
        }
        let end = data_start.checked_add(offset).and_then(|s| s.checked_add(bytes as u64));
        if end.is_none_or(|e| e > size) {
            return Err(err(format!("{bytes} bytes of data at offset {offset} after the header ({data_start}) reach past the end of the file ({size} bytes)")));
        }
        if bytes > 0 {
            spans.push((offset, offset + bytes as u64, name.clone()));
        }
        // GGUF lists dimensions innermost first; candle's shapes (and HF's) outermost first.
        dims.reverse();
        tensor_infos.insert(name, TensorInfo { ggml_dtype: dtype, shape: candle_core::Shape::from(dims), offset });
    }
    // Two tensors on the same bytes is a damaged file (llama.cpp refuses it too: it wants
    // each tensor where the one before it ends); read as it is, one tensor trains as another.
    spans.sort();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(gguf_err(gguf, &w[1].2, format!("its data (offset {}) overlaps `{}`'s (offsets {}..{}): a damaged file", w[1].0, w[0].2, w[0].0, w[0].1)));
        }
    }
    drop(r);
    Ok((f, Content { magic, metadata, tensor_infos, tensor_data_offset: data_start }))
}

// ---------------------------------------------------------------------------------------
// Typed metadata access: a missing required key, a value of the wrong GGUF type, or a
// value out of range is an error naming the key, never a silent default or a cast.

fn type_name(v: &Value) -> String {
    match v {
        Value::U8(_) => "uint8".into(),
        Value::I8(_) => "int8".into(),
        Value::U16(_) => "uint16".into(),
        Value::I16(_) => "int16".into(),
        Value::U32(_) => "uint32".into(),
        Value::I32(_) => "int32".into(),
        Value::U64(_) => "uint64".into(),
        Value::I64(_) => "int64".into(),
        Value::F32(_) => "float32".into(),
        Value::F64(_) => "float64".into(),
        Value::Bool(_) => "bool".into(),
        Value::String(_) => "string".into(),
        Value::Array(a) => match a.first() {
            Some(e) => format!("array of {}", type_name(e)),
            None => "empty array".into(),
        },
    }
}

/// Any non-negative integer (writers differ in the width they use for counts).
fn as_uint(v: &Value) -> Option<u64> {
    match *v {
        Value::U8(x) => Some(x as u64),
        Value::U16(x) => Some(x as u64),
        Value::U32(x) => Some(x as u64),
        Value::U64(x) => Some(x),
        Value::I8(x) => u64::try_from(x).ok(),
        Value::I16(x) => u64::try_from(x).ok(),
        Value::I32(x) => u64::try_from(x).ok(),
        Value::I64(x) => u64::try_from(x).ok(),
        _ => None,
    }
}

fn as_int(v: &Value) -> Option<i64> {
    match *v {
        Value::U8(x) => Some(x as i64),
        Value::U16(x) => Some(x as i64),
        Value::U32(x) => Some(x as i64),
        Value::U64(x) => i64::try_from(x).ok(),
        Value::I8(x) => Some(x as i64),
        Value::I16(x) => Some(x as i64),
        Value::I32(x) => Some(x as i64),
        Value::I64(x) => Some(x),
        _ => None,
    }
}

/// The metadata of one file, each access checked and its errors naming the file and key.
struct Meta<'a> {
    c: &'a Content,
    file: &'a Path,
}

impl Meta<'_> {
    fn err(&self, key: &str, msg: impl Into<String>) -> Error {
        gguf_err(self.file, key, msg)
    }

    fn missing(&self, key: &str) -> Error {
        self.err(key, "missing: a GGUF file of this architecture must have this key")
    }

    /// A uint32 count or id (any integer type holding a value in 0..=u32::MAX).
    fn uint(&self, key: &str) -> Result<Option<u64>> {
        let Some(v) = self.c.metadata.get(key) else { return Ok(None) };
        match as_uint(v) {
            Some(x) if x <= u32::MAX as u64 => Ok(Some(x)),
            Some(x) => Err(self.err(key, format!("is {x}, more than a uint32 holds"))),
            None => match as_int(v) {
                Some(x) => Err(self.err(key, format!("is {x}, expected an unsigned integer"))),
                None => Err(self.err(key, format!("has GGUF type {}, expected an unsigned integer (uint32)", type_name(v)))),
            },
        }
    }

    /// A count that must be present and at least 1.
    fn count(&self, key: &str, what: &str) -> Result<usize> {
        let n = self.uint(key)?.ok_or_else(|| self.missing(key))?;
        self.positive(key, n, what)
    }

    fn positive(&self, key: &str, n: u64, what: &str) -> Result<usize> {
        if n == 0 {
            return Err(self.err(key, format!("is 0; the model has at least one {what}")));
        }
        Ok(n as usize)
    }

    /// A float32 (or float64) that is finite and positive. A float32 is read as the decimal
    /// it was written from (its shortest round-trip form: 1e-6, not 9.99999997e-7), so
    /// config.json says what the original config said.
    fn positive_float(&self, key: &str) -> Result<Option<f64>> {
        let Some(v) = self.c.metadata.get(key) else { return Ok(None) };
        let x = match *v {
            Value::F32(x) => x.to_string().parse::<f64>().unwrap_or(x as f64),
            Value::F64(x) => x,
            _ => return Err(self.err(key, format!("has GGUF type {}, expected a float (float32)", type_name(v)))),
        };
        if !(x.is_finite() && x > 0.0) {
            return Err(self.err(key, format!("is {x}, expected a finite positive number")));
        }
        Ok(Some(x))
    }

    /// [`positive_float`](Self::positive_float), where 0 is a value too.
    fn non_negative_float(&self, key: &str) -> Result<Option<f64>> {
        if let Some(Value::F32(0.0) | Value::F64(0.0)) = self.c.metadata.get(key) {
            return Ok(Some(0.0));
        }
        self.positive_float(key)
    }

    fn string(&self, key: &str) -> Result<Option<&str>> {
        match self.c.metadata.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.err(key, format!("has GGUF type {}, expected a string", type_name(v)))),
        }
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.c.metadata.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.err(key, format!("has GGUF type {}, expected a bool", type_name(v)))),
        }
    }

    fn array(&self, key: &str) -> Result<Option<&[Value]>> {
        match self.c.metadata.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(v) => Err(self.err(key, format!("has GGUF type {}, expected an array", type_name(v)))),
        }
    }

    fn strings(&self, key: &str) -> Result<Vec<String>> {
        let a = self.array(key)?.ok_or_else(|| self.missing(key))?;
        a.iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(s.clone()),
                v => Err(self.err(key, format!("element {i} has GGUF type {}, expected an array of strings", type_name(v)))),
            })
            .collect()
    }
}

/// llama.cpp's names of a block's tensors and HF's (under `model.layers.N.`).
const BLOCK_NAMES: [(&str, &str); 12] = [
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("attn_q.bias", "self_attn.q_proj.bias"),
    ("attn_k.bias", "self_attn.k_proj.bias"),
    ("attn_v.bias", "self_attn.v_proj.bias"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
];

/// llama.cpp's names of the tensors outside the blocks and HF's.
const TOP_NAMES: [(&str, &str); 3] = [("token_embd.weight", "model.embed_tokens.weight"), ("output_norm.weight", "model.norm.weight"), ("output.weight", "lm_head.weight")];

/// llama.cpp name -> HF name.
pub fn hf_name(gguf: &str) -> Option<String> {
    if let Some((_, hf)) = TOP_NAMES.iter().find(|(g, _)| *g == gguf) {
        return Some(hf.to_string());
    }
    let (layer, name) = block_of(gguf)?;
    let hf = BLOCK_NAMES.iter().find(|(g, _)| *g == name)?.1;
    Some(format!("model.layers.{layer}.{hf}"))
}

/// HF name -> llama.cpp name (the inverse of [`hf_name`]).
pub fn gguf_name(hf: &str) -> Option<String> {
    if let Some((g, _)) = TOP_NAMES.iter().find(|(_, h)| *h == hf) {
        return Some(g.to_string());
    }
    let (layer, rest) = hf.strip_prefix("model.layers.")?.split_once('.')?;
    let n: usize = layer.parse().ok().filter(|n: &usize| n.to_string() == layer)?;
    let g = BLOCK_NAMES.iter().find(|(_, h)| *h == rest)?.0;
    Some(format!("blk.{n}.{g}"))
}

/// `blk.N.rest` -> (N, rest), N written canonically (`blk.01` would alias `blk.1`).
fn block_of(gguf: &str) -> Option<(usize, &str)> {
    let (layer, name) = gguf.strip_prefix("blk.")?.split_once('.')?;
    let n: usize = layer.parse().ok()?;
    (n.to_string() == layer).then_some((n, name))
}

/// The tensors every block of a llama GGUF has.
const BLOCK_TENSORS: [&str; 9] =
    ["attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "attn_norm.weight", "ffn_norm.weight"];

/// Where an HF tensor's values are in a GGUF file.
#[derive(Clone, Debug)]
pub(crate) enum Source {
    /// One tensor as stored; `unpermute`: the heads of llama's q/k rows, whose llama.cpp
    /// permutation is undone after dequantising.
    Tensor { name: String, unpermute: Option<usize> },
    /// Expert `j` of a stacked [E, out, in] tensor (deepseek2's `ffn_*_exps`).
    Expert { name: String, j: usize },
    /// DeepSeek's `kv_b_proj` [heads x (nope + v), kv_lora], which llama.cpp writes as
    /// `attn_k_b` [heads, kv_lora, nope] (the k part transposed) and `attn_v_b` [heads, v, kv_lora].
    KvB { k_b: String, v_b: String },
}

/// What an architecture reader makes of a file: the HF tensors and where each is, and the
/// HF config (token ids are added by [`open`]).
struct Described {
    arch: &'static str,
    vocab: usize,
    context: usize,
    sources: BTreeMap<String, Source>,
    config: serde_json::Value,
}

/// The model a GGUF file describes, every number checked against the others and against
/// the tensors present before any tensor is read or anything written.
struct Llama {
    /// `llama` or `qwen2`: the metadata key prefix. Qwen2 is llama plus q/k/v biases, and
    /// llama.cpp does not permute its q/k rows (its RoPE is the NEOX, rotate-half kind).
    arch: &'static str,
    heads: usize,
    kv_heads: usize,
    hidden: usize,
    layers: usize,
    inter: usize,
    head_dim: usize,
    vocab: usize,
    eps: f64,
    theta: f64,
    context: usize,
    tied: bool,
    /// config.json's `rope_scaling` (null for none): linear from the metadata, Llama 3's
    /// from `rope_freqs.weight`.
    rope_scaling: serde_json::Value,
}

/// The tensor llama.cpp writes Llama 3's rope scaling as (one divisor per rotated pair).
const ROPE_FREQS: &str = "rope_freqs.weight";

impl Llama {
    fn from_gguf(m: &Meta, file: &mut std::fs::File) -> Result<Self> {
        let arch = m.string("general.architecture")?.ok_or_else(|| m.missing("general.architecture"))?;
        let a: &'static str = match arch {
            "llama" => "llama",
            "qwen2" => "qwen2",
            _ => return Err(m.err("general.architecture", format!("is `{arch}`; supported: llama, qwen2, deepseek2"))),
        };
        let k = |key: &str| format!("{a}.{key}");
        let heads = m.count(&k("attention.head_count"), "attention head")?;
        let kv_heads = match m.uint(&k("attention.head_count_kv"))? {
            Some(n) => m.positive(&k("attention.head_count_kv"), n, "key/value head")?,
            None => heads,
        };
        if heads % kv_heads != 0 {
            return Err(m.err(&k("attention.head_count_kv"), format!("is {kv_heads}, which does not divide {a}.attention.head_count {heads} (each key/value head serves a whole group of query heads)")));
        }
        let hidden = m.count(&k("embedding_length"), "embedding dimension")?;
        let layers = m.count(&k("block_count"), "block")?;
        let inter = m.count(&k("feed_forward_length"), "feed-forward unit")?;
        let eps = m.positive_float(&k("attention.layer_norm_rms_epsilon"))?.ok_or_else(|| m.missing(&k("attention.layer_norm_rms_epsilon")))?;
        let theta = m.positive_float(&k("rope.freq_base"))?.unwrap_or(10000.0);
        let context = match m.uint(&k("context_length"))? {
            Some(n) => m.positive(&k("context_length"), n, "position")?,
            None => 2048,
        };

        // The head size: key_length where the file states it, else the RoPE dimension (all
        // of a llama head rotates), else embedding / heads.
        let key_len = m.uint(&k("attention.key_length"))?;
        if let (Some(kl), Some(v)) = (key_len, m.uint(&k("attention.value_length"))?) {
            if kl != v {
                return Err(m.err(&k("attention.value_length"), format!("is {v} but {a}.attention.key_length is {kl}; a head has one size")));
            }
        }
        let rope = m.uint(&k("rope.dimension_count"))?;
        let head_dim = match (key_len, rope) {
            (Some(kl), _) => m.positive(&k("attention.key_length"), kl, "dimension per head")?,
            (None, Some(r)) => m.positive(&k("rope.dimension_count"), r, "rotated dimension")?,
            (None, None) if hidden % heads == 0 => hidden / heads,
            (None, None) => {
                return Err(m.err(&k("embedding_length"), format!("is {hidden}, not a multiple of {a}.attention.head_count {heads}, and the file states no head size ({a}.rope.dimension_count)")))
            }
        };
        if let Some(r) = rope {
            if r % 2 != 0 {
                return Err(m.err(&k("rope.dimension_count"), format!("is {r}, odd; RoPE rotates pairs of dimensions")));
            }
            if r as usize != head_dim {
                return Err(m.err(&k("rope.dimension_count"), format!("is {r} but heads have {head_dim} dimensions; rotating part of a head is not supported")));
            }
        }
        if head_dim % 2 != 0 {
            return Err(m.err(&k("attention.key_length"), format!("is {head_dim}, odd; RoPE rotates pairs of dimensions")));
        }

        let t = &m.c.tensor_infos;
        let embd = t.get("token_embd.weight").ok_or_else(|| m.err("token_embd.weight", "missing: the file has no token embedding"))?;
        let (vocab, width) = match *embd.shape.dims() {
            [v, w] if v > 0 => (v, w),
            ref d => return Err(m.err("token_embd.weight", format!("has shape {d:?}, expected [vocabulary, {a}.embedding_length {hidden}]"))),
        };
        if width != hidden {
            return Err(m.err(&k("embedding_length"), format!("is {hidden} but token_embd.weight is [{vocab}, {width}]: embeddings of {width}")));
        }
        if let Some(v) = m.uint(&k("vocab_size"))? {
            if v as usize != vocab {
                return Err(m.err(&k("vocab_size"), format!("is {v} but token_embd.weight has {vocab} rows")));
            }
        }
        let mut p = Llama { arch: a, heads, kv_heads, hidden, layers, inter, head_dim, vocab, eps, theta, context, tied: !t.contains_key("output.weight"), rope_scaling: serde_json::Value::Null };
        p.check_tensors(m)?;
        p.rope_scaling = p.rope_scaling(m, file)?;
        Ok(p)
    }

    /// config.json's `rope_scaling`: `{arch}.rope.scaling.type` linear (or the older
    /// `rope.scale_linear`), or Llama 3's from `rope_freqs.weight`, or none. A scaling this
    /// cannot express is an error: ignoring it would give other logits with exit 0.
    fn rope_scaling(&self, m: &Meta, file: &mut std::fs::File) -> Result<serde_json::Value> {
        let k = |key: &str| format!("{}.{key}", self.arch);
        let linear = |factor: f64| serde_json::json!({"rope_type": "linear", "factor": factor});
        let from_meta = match m.string(&k("rope.scaling.type"))? {
            Some("linear") => Some(linear(m.positive_float(&k("rope.scaling.factor"))?.ok_or_else(|| m.missing(&k("rope.scaling.factor")))?)),
            Some("none") => None,
            Some(t) => {
                return Err(m.err(&k("rope.scaling.type"), format!("is `{t}`; {} files are read with linear scaling or none (YaRN is read for deepseek2)", self.arch)))
            }
            None => match m.positive_float(&k("rope.scale_linear"))? {
                Some(f) if f != 1.0 => Some(linear(f)),
                _ => None,
            },
        };
        let Some(info) = m.c.tensor_infos.get(ROPE_FREQS) else { return Ok(from_meta.unwrap_or_default()) };
        if from_meta.is_some() {
            return Err(m.err(ROPE_FREQS, format!("scales RoPE, and so does {}: one scaling, not two", k("rope.scaling.type"))));
        }
        let q = info.read(file, m.c.tensor_data_offset, &Device::Cpu).map_err(|e| m.err(ROPE_FREQS, crate::error::candle_msg(&e)))?;
        let factors: Vec<f64> = q
            .dequantize(&Device::Cpu)
            .and_then(|t| t.flatten_all()?.to_dtype(DType::F64)?.to_vec1())
            .map_err(|e| m.err(ROPE_FREQS, crate::error::candle_msg(&e)))?;
        rope::llama3_from_freq_factors(&factors, self.theta, self.head_dim).map_err(|msg| m.err(ROPE_FREQS, msg))
    }

    /// Every tensor is one we convert, of the shape the metadata implies, and each of the
    /// `block_count` blocks is complete, with no block beyond it.
    fn check_tensors(&self, m: &Meta) -> Result<()> {
        let (a, t) = (self.arch, &m.c.tensor_infos);
        let k = |key: &str| format!("{a}.{key}");
        let mut blocks = HashSet::new();
        let mut names: Vec<&String> = t.keys().collect();
        names.sort();
        for name in names {
            if name == ROPE_FREQS {
                // Checked with its values (`rope_scaling`).
                continue;
            }
            if hf_name(name).is_none() {
                return Err(m.err(name, format!("is not a {a} tensor this reads (token_embd, output_norm, output, blk.N.{{attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down,attn_norm,ffn_norm}}.weight, and qwen2's blk.N.{{attn_q,attn_k,attn_v}}.bias)")));
            }
            if let Some((b, rest)) = block_of(name) {
                if b >= self.layers {
                    return Err(m.err(&k("block_count"), format!("is {} but the file has tensors of block {b} ({name})", self.layers)));
                }
                if rest.ends_with(".bias") && !self.qkv_bias() {
                    // HF's llama has biases only with attention_bias (q, k, v and o), which
                    // llama.cpp's converter permutes like the rows: not read here.
                    return Err(m.err(name, "is a bias in a llama file: only qwen2 files' q/k/v biases are read (a llama model with attention_bias is not supported from GGUF; use its safetensors folder)"));
                }
                blocks.insert(b);
            }
            let got = t[name].shape.dims();
            let want = self.shape_of(name);
            if got != want.as_slice() {
                return Err(m.err(name, format!("has shape {got:?}, but {} give {want:?}", self.why(name))));
            }
        }
        if let Some(b) = (0..self.layers).find(|b| !blocks.contains(b)) {
            return Err(m.err(&k("block_count"), format!("is {} but the file has no tensors of block {b} (blk.{b}.*)", self.layers)));
        }
        for name in ["output_norm.weight".to_string()].into_iter().chain((0..self.layers).flat_map(|b| BLOCK_TENSORS.iter().map(move |s| format!("blk.{b}.{s}")))) {
            if !t.contains_key(&name) {
                return Err(m.err(&name, format!("missing: every {a} block has q, k, v, output, gate, up, down and two norms")));
            }
        }
        for b in (0..self.layers).filter(|_| self.qkv_bias()) {
            for name in ["attn_q.bias", "attn_k.bias", "attn_v.bias"].map(|s| format!("blk.{b}.{s}")) {
                if !t.contains_key(&name) {
                    return Err(m.err(&name, "missing: every qwen2 block has q, k and v biases"));
                }
            }
        }
        Ok(())
    }

    fn describe(self, m: &Meta) -> Described {
        let sources = m
            .c
            .tensor_infos
            .keys()
            .filter_map(|g| Some((hf_name(g)?, Source::Tensor { name: g.clone(), unpermute: self.permuted_heads(g) })))
            .collect();
        let p = &self;
        let mut config = match p.arch {
            "qwen2" => serde_json::json!({
                "architectures": ["Qwen2ForCausalLM"],
                "model_type": "qwen2",
                "use_sliding_window": false,
            }),
            _ => serde_json::json!({
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "head_dim": p.head_dim,
                "attention_bias": false,
                "mlp_bias": false,
            }),
        };
        let common = serde_json::json!({
            "hidden_size": p.hidden,
            "intermediate_size": p.inter,
            "num_hidden_layers": p.layers,
            "num_attention_heads": p.heads,
            "num_key_value_heads": p.kv_heads,
            "vocab_size": p.vocab,
            "rms_norm_eps": p.eps,
            "rope_theta": p.theta,
            "tie_word_embeddings": p.tied,
            "hidden_act": "silu",
            "max_position_embeddings": p.context,
            "torch_dtype": "float32",
        });
        extend(&mut config, common);
        if !p.rope_scaling.is_null() {
            extend(&mut config, serde_json::json!({ "rope_scaling": p.rope_scaling }));
        }
        Described { arch: p.arch, vocab: p.vocab, context: p.context, sources, config }
    }

    /// Qwen2 has q/k/v biases, llama none.
    fn qkv_bias(&self) -> bool {
        self.arch == "qwen2"
    }

    /// The q/k rows llama.cpp's converter permuted for this tensor (by head count), to undo.
    fn permuted_heads(&self, gguf_name: &str) -> Option<usize> {
        if self.arch != "llama" {
            return None;
        }
        let kind = block_of(gguf_name)?.1;
        match kind {
            "attn_q.weight" => Some(self.heads),
            "attn_k.weight" => Some(self.kv_heads),
            _ => None,
        }
    }

    /// The shape (outermost first) the metadata implies for a tensor `hf_name` accepts.
    fn shape_of(&self, name: &str) -> Vec<usize> {
        let (h, q, kv, f) = (self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.inter);
        let kind = block_of(name).map(|(_, rest)| rest).unwrap_or(name);
        match kind {
            "token_embd.weight" | "output.weight" => vec![self.vocab, h],
            "attn_q.weight" => vec![q, h],
            "attn_k.weight" | "attn_v.weight" => vec![kv, h],
            "attn_output.weight" => vec![h, q],
            "ffn_gate.weight" | "ffn_up.weight" => vec![f, h],
            "ffn_down.weight" => vec![h, f],
            "attn_q.bias" => vec![q],
            "attn_k.bias" | "attn_v.bias" => vec![kv],
            _ => vec![h], // the norms
        }
    }

    /// The metadata behind `shape_of`, for messages.
    fn why(&self, name: &str) -> String {
        let a = self.arch;
        let kind = block_of(name).map(|(_, rest)| rest).unwrap_or(name);
        let hd = format!("{} dimensions per head", self.head_dim);
        match kind {
            "token_embd.weight" | "output.weight" => format!("token_embd.weight's {} rows and {a}.embedding_length {}", self.vocab, self.hidden),
            "attn_q.weight" | "attn_output.weight" | "attn_q.bias" => format!("{a}.attention.head_count {} x {hd} and {a}.embedding_length {}", self.heads, self.hidden),
            "attn_k.weight" | "attn_v.weight" | "attn_k.bias" | "attn_v.bias" => format!("{a}.attention.head_count_kv {} x {hd} and {a}.embedding_length {}", self.kv_heads, self.hidden),
            "ffn_gate.weight" | "ffn_up.weight" | "ffn_down.weight" => format!("{a}.feed_forward_length {} and {a}.embedding_length {}", self.inter, self.hidden),
            _ => format!("{a}.embedding_length {}", self.hidden),
        }
    }
}

/// Undo llama.cpp's q/k permutation. The converter maps HF rows with
/// `w.reshape(heads, 2, d/2, in).swapaxes(1, 2)`, i.e. within each head the two halves
/// (rotate-half pairs i, i + d/2) become interleaved pairs (2i, 2i + 1). Inverse:
/// [heads, d/2, 2, in] -> swap -> [heads, 2, d/2, in].
pub fn unpermute(w: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (rows, cols, d) = head_rows(w, heads)?;
    w.reshape((heads, d / 2, 2, cols))? // [heads, d/2, 2, in]
        .transpose(1, 2)? // [heads, 2, d/2, in]
        .contiguous()?
        .reshape((rows, cols))
}

/// The forward direction (what llama.cpp's converter does), for writing test files.
pub fn permute(w: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (rows, cols, d) = head_rows(w, heads)?;
    w.reshape((heads, 2, d / 2, cols))?.transpose(1, 2)?.contiguous()?.reshape((rows, cols))
}

/// (rows, cols, rows per head) of a q/k matrix, or an error where the rows do not split
/// into `heads` heads of an even size (a division by zero or a wrong reshape otherwise).
fn head_rows(w: &Tensor, heads: usize) -> candle_core::Result<(usize, usize, usize)> {
    let (rows, cols) = w.dims2()?;
    if heads == 0 || rows % heads != 0 || !(rows / heads).is_multiple_of(2) {
        candle_core::bail!("{rows} rows do not split into {heads} heads of an even size");
    }
    Ok((rows, cols, rows / heads))
}

/// Build an HF `tokenizer.json` (and the special-token part of `tokenizer_config.json`).
fn tokenizer_files(m: &Meta, vocab: usize, context: usize) -> Result<(serde_json::Value, serde_json::Value)> {
    let model = m.string("tokenizer.ggml.model")?.ok_or_else(|| m.missing("tokenizer.ggml.model"))?;
    if model != "gpt2" {
        return Err(m.err("tokenizer.ggml.model", format!("is `{model}`; only byte-level BPE (`gpt2`) vocabularies are supported")));
    }
    let tokens = m.strings("tokenizer.ggml.tokens")?;
    if tokens.is_empty() || tokens.len() > vocab {
        return Err(m.err("tokenizer.ggml.tokens", format!("has {} tokens; token_embd.weight has rows for {vocab}", tokens.len())));
    }
    let merges = m.strings("tokenizer.ggml.merges")?;
    // The tokenizers crate panics on a merge whose parts or result are not in the
    // vocabulary: refuse such a file here, naming the merge.
    {
        let known: HashSet<&str> = tokens.iter().map(|t| t.as_str()).collect();
        for (i, mg) in merges.iter().enumerate() {
            let ok = mg.split_once(' ').is_some_and(|(a, b)| known.contains(a) && known.contains(b) && known.contains(format!("{a}{b}").as_str()));
            if !ok {
                return Err(m.err("tokenizer.ggml.merges", format!("merge {i} (`{mg}`) is not two vocabulary tokens joining into a third")));
            }
        }
    }
    let types: Vec<i64> = match m.array("tokenizer.ggml.token_type")? {
        Some(a) => a
            .iter()
            .enumerate()
            .map(|(i, v)| as_int(v).ok_or_else(|| m.err("tokenizer.ggml.token_type", format!("element {i} has GGUF type {}, expected an array of integers", type_name(v)))))
            .collect::<Result<_>>()?,
        None => vec![1; tokens.len()],
    };
    let mut vocab_map = serde_json::Map::new();
    let mut added = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        vocab_map.insert(t.clone(), i.into());
        // token_type 3 = control (special), 4 = user-defined (added, not special).
        let ty = types.get(i).copied().unwrap_or(1);
        if ty == 3 || ty == 4 {
            added.push(serde_json::json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": ty == 4, "special": ty == 3}));
        }
    }
    let id = |key: &str| -> Result<Option<u32>> {
        match m.uint(key)? {
            Some(i) if (i as usize) < tokens.len() => Ok(Some(i as u32)),
            Some(i) => Err(m.err(key, format!("is {i}, not a token id (tokenizer.ggml.tokens has {})", tokens.len()))),
            None => Ok(None),
        }
    };
    let (bos, eos, unk, pad) = (id("tokenizer.ggml.bos_token_id")?, id("tokenizer.ggml.eos_token_id")?, id("tokenizer.ggml.unknown_token_id")?, id("tokenizer.ggml.padding_token_id")?);
    let add_bos = m.bool("tokenizer.ggml.add_bos_token")?.unwrap_or(false);
    let chat_template = m.string("tokenizer.chat_template")?;
    let name = |id: Option<u32>| id.and_then(|i| tokens.get(i as usize)).cloned();
    let mut single = Vec::new();
    let mut special_tokens = serde_json::Map::new();
    if add_bos {
        if let Some(b) = name(bos) {
            single.push(serde_json::json!({"SpecialToken": {"id": b, "type_id": 0}}));
            special_tokens.insert(b.clone(), serde_json::json!({"id": b, "ids": [bos], "tokens": [b]}));
        }
    }
    single.push(serde_json::json!({"Sequence": {"id": "A", "type_id": 0}}));
    let mut pair = single.clone();
    pair.push(serde_json::json!({"Sequence": {"id": "B", "type_id": 1}}));
    let merges: Vec<serde_json::Value> = merges.into_iter().map(serde_json::Value::String).collect();
    let tok = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pretok::pre_tokenizer(m.string("tokenizer.ggml.pre")?, m.file),
        "post_processor": {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special_tokens},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": name(unk), "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab_map, "merges": merges}
    });
    let mut cfg = serde_json::Map::new();
    cfg.insert("tokenizer_class".into(), "PreTrainedTokenizerFast".into());
    cfg.insert("add_bos_token".into(), add_bos.into());
    cfg.insert("add_eos_token".into(), false.into());
    cfg.insert("model_max_length".into(), context.into());
    for (k, id) in [("bos_token", bos), ("eos_token", eos), ("unk_token", unk), ("pad_token", pad)] {
        if let Some(n) = name(id) {
            cfg.insert(k.into(), n.into());
        }
    }
    if let Some(t) = chat_template {
        cfg.insert("chat_template".into(), t.into());
    }
    Ok((tok, serde_json::Value::Object(cfg)))
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
pub fn import(gguf: &Path, out: &Path, dtype: DType, max_shard_bytes: u64) -> Result<ImportReport> {
    // Cheap and before the minutes of dequantizing: the destination must be usable.
    if out.exists() && !std::fs::read_dir(out).is_ok_and(|mut d| d.next().is_none()) {
        return Err(Error::io(out, std::io::Error::new(std::io::ErrorKind::AlreadyExists, "output exists and is not an empty folder (choose another --out)")));
    }
    let mut g = open(gguf)?;
    if g.tokenizer.is_none() {
        return Err(gguf_err(gguf, "tokenizer.ggml.model", "missing: an imported model folder needs a tokenizer"));
    }
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
    Ok(ImportReport { tensors: tensors.len(), config: g.config, shards })
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
