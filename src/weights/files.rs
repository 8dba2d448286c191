//! Reading safetensors checkpoints, one file or sharded (`SafetensorsFiles`): every tensor from
//! the shard the index names, FP8 e4m3 weights dequantised with their 128 x 128 block scales,
//! and the dtype names and conversions the config and the exports share.
use super::RowTable;
use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

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

/// The safetensors dtype a float tensor of `d` is stored as (the inverse of [`candle_dtype`]).
pub(crate) fn safetensors_dtype(d: DType) -> Option<safetensors::Dtype> {
    match d {
        DType::F32 => Some(safetensors::Dtype::F32),
        DType::BF16 => Some(safetensors::Dtype::BF16),
        DType::F16 => Some(safetensors::Dtype::F16),
        _ => None,
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
