//! The two plain weight sources: `ResidentWeights` (the base copied into memory at load, row
//! tables left in their files) and `StreamingWeights` (read from the map on every request:
//! merge verification).
use super::{stored_dtype, RowTable, SafetensorsFiles, WeightSource};
use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;

/// A row table asked for as `shape`: an error naming the tensor and its file when it is not.
fn check_table_shape(name: &str, t: &RowTable, shape: &[usize]) -> Result<()> {
    if shape != [t.rows, t.cols] {
        return Err(Error::Shape { name: name.into(), file: t.path.display().to_string(), expected: shape.to_vec(), got: vec![t.rows, t.cols] });
    }
    Ok(())
}

/// All frozen tensors resident on one device in the storage dtype; converted to the compute
/// dtype when handed out. Only the tensors the model asks for at load are kept.
pub struct ResidentWeights {
    /// The memory map, until `seal`: the tensors are copies, and the map's pages would
    /// otherwise stay in the process's memory too (twice the base in RSS).
    files: std::sync::RwLock<Option<SafetensorsFiles>>,
    /// Every stored tensor name (what `contains` answers from once sealed).
    names: std::collections::HashSet<String>,
    tensors: std::sync::RwLock<HashMap<String, Tensor>>,
    /// Tables read by rows from their files (`check_rows`; on the host only).
    tables: std::sync::RwLock<HashMap<String, RowTable>>,
    /// Whether `check_rows` may leave a table in its file (`with_row_tables`).
    row_tables: bool,
    /// Whether `check_head` leaves the head in its file (`with_head_in_file`).
    head_in_file: bool,
    storage_dtype: DType,
    compute_dtype: DType,
    matmul_dtype: DType,
    device: Device,
}

impl ResidentWeights {
    pub fn new(files: SafetensorsFiles, storage_dtype: DType, compute_dtype: DType, device: Device) -> Self {
        let names = files.names().cloned().collect();
        ResidentWeights {
            files: std::sync::RwLock::new(Some(files)),
            names,
            tensors: Default::default(),
            tables: Default::default(),
            row_tables: device.is_cpu(),
            head_in_file: false,
            storage_dtype,
            compute_dtype,
            matmul_dtype: compute_dtype,
            device,
        }
    }


    /// Hand projection weights to the frozen matmul in `dtype` (see `ops::Kernels::matmul_dtype`).
    pub fn with_matmul_dtype(mut self, dtype: DType) -> Self {
        self.matmul_dtype = dtype;
        self
    }

    /// Whether a table read only by rows may stay in its file (on the host only; training
    /// keeps it resident on the portable path, which stands for a GPU's memory there).
    pub fn with_row_tables(mut self, allowed: bool) -> Self {
        self.row_tables = allowed && self.device.is_cpu();
        self
    }

    /// Leave an untied LM head in its file (on the host only), where it is read in chunks of
    /// rows by every step's loss (`ops::loss`) and never held whole: a step then re-reads
    /// the head from the page cache (~40 ms per GB on a 2-core Zen 5 VM), which the kernel
    /// may drop under memory pressure (the next step then reads it from disk). Training on
    /// the fused CPU ops only: `Model::logits` and `generate` read the head whole, each time.
    pub fn with_head_in_file(mut self, allowed: bool) -> Self {
        self.head_in_file = allowed && self.device.is_cpu();
        self
    }

    /// `name`'s table when it was left in its file (and not also copied).
    fn table<T>(&self, name: &str, f: impl FnOnce(&RowTable) -> Result<T>) -> Option<Result<T>> {
        if self.tensors.read().unwrap_or_else(|e| e.into_inner()).contains_key(name) {
            return None;
        }
        self.tables.read().unwrap_or_else(|e| e.into_inner()).get(name).map(f)
    }

    /// A table's rows as stored, converted as a copy would have been (storage dtype, then
    /// `dtype`): the same values.
    fn table_rows(&self, name: &str, rows: Tensor, dtype: DType) -> Result<Tensor> {
        Ok(rows.to_dtype(stored_dtype(name, self.storage_dtype))?.to_dtype(dtype)?.to_device(&self.device)?)
    }

    /// Leave `name` in its file as a row table when `allowed` and it can be read so.
    fn leave_in_file(&self, name: &str, shape: &[usize], allowed: bool) -> Result<()> {
        let table = match &*self.files.read().unwrap_or_else(|e| e.into_inner()) {
            Some(files) if allowed => files.row_table(name, shape)?,
            _ => None,
        };
        match table {
            Some(t) => {
                t.read_ahead();
                self.tables.write().unwrap_or_else(|e| e.into_inner()).insert(name.to_string(), t);
                Ok(())
            }
            None => self.check(name, shape),
        }
    }

    /// Bytes of frozen tensors held.
    pub fn resident_bytes(&self) -> usize {
        let t = self.tensors.read().unwrap_or_else(|e| e.into_inner());
        t.values().map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum()
    }
}

impl WeightSource for ResidentWeights {
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
        // A table left in its file, asked for whole: read it all, and keep nothing.
        if let Some(read) = self.table(name, |t| {
            check_table_shape(name, t, shape)?;
            self.table_rows(name, t.read_range(0, t.rows)?, stored_dtype(name, self.storage_dtype))
        }) {
            return read;
        }
        let cached = self.tensors.read().unwrap_or_else(|e| e.into_inner()).get(name).cloned();
        let t = match cached {
            Some(t) => {
                if t.dims() != shape {
                    let files = self.files.read().unwrap_or_else(|e| e.into_inner());
                    return Err(Error::Shape {
                        name: name.into(),
                        file: files.as_ref().and_then(|f| f.file_of(name)).map(|p| p.display().to_string()).unwrap_or_default(),
                        expected: shape.to_vec(),
                        got: t.dims().to_vec(),
                    });
                }
                t
            }
            None => {
                let files = self.files.read().unwrap_or_else(|e| e.into_inner());
                let files = files.as_ref().ok_or_else(|| Error::MissingTensor { name: name.into(), files: "(weights sealed after load)".into() })?;
                let t = files.load(name, shape, &self.device)?.to_dtype(stored_dtype(name, self.storage_dtype))?;
                self.tensors.write().unwrap_or_else(|e| e.into_inner()).insert(name.to_string(), t.clone());
                t
            }
        };
        Ok(t)
    }

    fn contains(&self, name: &str) -> bool {
        self.names.contains(name)
    }
    /// On the host a table read only by rows stays in its file. (On a GPU it is copied as
    /// before: reading rows from the file there is not tested yet.)
    fn check_rows(&self, name: &str, shape: &[usize]) -> Result<()> {
        self.leave_in_file(name, shape, self.row_tables)
    }
    fn check_head(&self, name: &str, shape: &[usize]) -> Result<()> {
        self.leave_in_file(name, shape, self.head_in_file)
    }
    /// A table kept whole (a tied head asked for it) is read from the copy; one left in its
    /// file is read there, row by row, and converted as a copy would have been (storage dtype,
    /// then compute dtype): the same values.
    fn embedding(&self, name: &str, shape: &[usize], ids: &Tensor) -> Result<Tensor> {
        if let Some(read) = self.table(name, |t| {
            check_table_shape(name, t, shape)?;
            let rows = t.read(&ids.to_dtype(DType::U32)?.to_vec1::<u32>()?)?; // [N, H] as stored
            self.table_rows(name, rows, self.compute_dtype)
        }) {
            return read;
        }
        Ok(self.get_stored(name, shape)?.index_select(ids, 0)?.to_dtype(self.compute_dtype())?)
    }
    /// A head left in its file is read there, the asked rows only, in one read.
    fn get_matmul_rows(&self, name: &str, shape: &[usize], start: usize, len: usize) -> Result<Tensor> {
        if let Some(read) = self.table(name, |t| {
            check_table_shape(name, t, shape)?;
            self.table_rows(name, t.read_range(start, len)?, self.matmul_dtype)
        }) {
            return read;
        }
        Ok(self.get_stored(name, shape)?.narrow(0, start, len)?.to_dtype(self.matmul_dtype)?)
    }
    fn bytes_in_files(&self) -> usize {
        let tables = self.tables.read().unwrap_or_else(|e| e.into_inner());
        tables.iter().map(|(name, t)| t.rows * t.cols * stored_dtype(name, self.storage_dtype).size_in_bytes()).sum()
    }
    /// From here on only the copies (and the row tables' files) are held.
    fn seal(&self) {
        *self.files.write().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// Frozen tensors read from the memory map on every request and never kept: peak memory is
/// one layer's weights. For one-off passes over a model (merge verification), not training.
pub struct StreamingWeights {
    files: SafetensorsFiles,
    compute_dtype: DType,
    device: Device,
}

impl StreamingWeights {
    pub fn new(files: SafetensorsFiles, compute_dtype: DType, device: Device) -> Self {
        StreamingWeights { files, compute_dtype, device }
    }
}

impl WeightSource for StreamingWeights {
    fn compute_dtype(&self) -> DType {
        self.compute_dtype
    }
    fn device(&self) -> &Device {
        &self.device
    }
    fn get_stored(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.files.load(name, shape, &self.device)
    }
    fn contains(&self, name: &str) -> bool {
        self.files.file_of(name).is_some()
    }
}
