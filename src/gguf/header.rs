//! The GGUF header and its metadata, read with every length, count, dimension and offset
//! bounded by the file's size (`read_header`), and typed access to the metadata (`Meta`).
use super::gguf_err;
use crate::error::{Error, Result};
use candle_core::quantized::gguf_file::{Content, TensorInfo, Value, VersionedMagic};
use candle_core::quantized::GgmlDType;
use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::path::Path;

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
    pub(super) fn err(&self, key: &str, msg: impl Into<String>) -> Error {
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

    pub(super) fn string(&mut self, key: &str, what: &str, keep: bool) -> Result<Option<String>> {
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

pub(super) fn type_name(v: &Value) -> String {
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

pub(super) fn as_int(v: &Value) -> Option<i64> {
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
pub(super) struct Meta<'a> {
    pub(super) c: &'a Content,
    pub(super) file: &'a Path,
}

impl Meta<'_> {
    pub(super) fn err(&self, key: &str, msg: impl Into<String>) -> Error {
        gguf_err(self.file, key, msg)
    }

    pub(super) fn missing(&self, key: &str) -> Error {
        self.err(key, "missing: a GGUF file of this architecture must have this key")
    }

    /// A uint32 count or id (any integer type holding a value in 0..=u32::MAX).
    pub(super) fn uint(&self, key: &str) -> Result<Option<u64>> {
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
    pub(super) fn count(&self, key: &str, what: &str) -> Result<usize> {
        let n = self.uint(key)?.ok_or_else(|| self.missing(key))?;
        self.positive(key, n, what)
    }

    pub(super) fn positive(&self, key: &str, n: u64, what: &str) -> Result<usize> {
        if n == 0 {
            return Err(self.err(key, format!("is 0; the model has at least one {what}")));
        }
        Ok(n as usize)
    }

    /// A float32 (or float64) that is finite and positive. A float32 is read as the decimal
    /// it was written from (its shortest round-trip form: 1e-6, not 9.99999997e-7), so
    /// config.json says what the original config said.
    pub(super) fn positive_float(&self, key: &str) -> Result<Option<f64>> {
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
    pub(super) fn non_negative_float(&self, key: &str) -> Result<Option<f64>> {
        if let Some(Value::F32(0.0) | Value::F64(0.0)) = self.c.metadata.get(key) {
            return Ok(Some(0.0));
        }
        self.positive_float(key)
    }

    pub(super) fn string(&self, key: &str) -> Result<Option<&str>> {
        match self.c.metadata.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.err(key, format!("has GGUF type {}, expected a string", type_name(v)))),
        }
    }

    pub(super) fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.c.metadata.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.err(key, format!("has GGUF type {}, expected a bool", type_name(v)))),
        }
    }

    pub(super) fn array(&self, key: &str) -> Result<Option<&[Value]>> {
        match self.c.metadata.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(v) => Err(self.err(key, format!("has GGUF type {}, expected an array", type_name(v)))),
        }
    }

    pub(super) fn strings(&self, key: &str) -> Result<Vec<String>> {
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
