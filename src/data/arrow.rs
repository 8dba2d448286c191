//! Streaming Arrow rows: an HF `datasets` save_to_disk folder (IPC *stream* shards listed in
//! `state.json`) or a single `.arrow` file (stream or file format). One record batch is held
//! at a time; at the end of the last shard the stream wraps to the first row (epochs).

use crate::error::{Error, Result};
use arrow_array::cast::AsArray;
use arrow_array::types::{Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type, UInt64Type, UInt8Type};
use arrow_array::{Array, RecordBatch};
use arrow_schema::{ArrowError, DataType};
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

type Batches = Box<dyn Iterator<Item = std::result::Result<RecordBatch, ArrowError>> + Send>;

/// The shard files of a dataset path, in order.
pub fn shard_files(path: &Path) -> Result<Vec<PathBuf>> {
    if path.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    if !path.is_dir() {
        return Err(Error::data(path, "does not exist (check data.train)"));
    }
    let state = path.join("state.json");
    if state.is_file() {
        let text = std::fs::read_to_string(&state).map_err(|e| Error::io(&state, e))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::data(&state, format!("not valid JSON: {e}")))?;
        let files = v
            .get("_data_files")
            .and_then(|f| f.as_array())
            .ok_or_else(|| Error::data(&state, "expected a `_data_files` list"))?;
        let mut out = Vec::new();
        for f in files {
            let name = f
                .get("filename")
                .and_then(|n| n.as_str())
                .ok_or_else(|| Error::data(&state, "`_data_files` entries need a `filename`"))?;
            out.push(path.join(name));
        }
        if out.is_empty() {
            return Err(Error::data(&state, "lists no data files"));
        }
        return Ok(out);
    }
    if path.join("dataset_dict.json").is_file() {
        return Err(Error::data(path, "is a DatasetDict folder; point data.train at one split (e.g. <dir>/train)"));
    }
    let mut arrows: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|e| Error::io(path, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "arrow"))
        .collect();
    arrows.sort();
    if arrows.is_empty() {
        return Err(Error::data(path, "has no state.json and no .arrow files"));
    }
    Ok(arrows)
}

fn open_batches(path: &Path) -> Result<Batches> {
    let mut f = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut magic = [0u8; 6];
    let n = f.read(&mut magic).map_err(|e| Error::io(path, e))?;
    drop(f);
    let f = File::open(path).map_err(|e| Error::io(path, e))?;
    let bad = |e: ArrowError| Error::data(path, format!("not a readable Arrow IPC file: {e}"));
    if n == 6 && &magic == b"ARROW1" {
        let r = arrow_ipc::reader::FileReader::try_new(BufReader::new(f), None).map_err(bad)?;
        Ok(Box::new(r))
    } else {
        let r = arrow_ipc::reader::StreamReader::try_new(BufReader::new(f), None).map_err(bad)?;
        Ok(Box::new(r))
    }
}

/// A row in the stream: its batch (shared, cheap to clone), its index in the batch, and where
/// it came from for error messages.
pub struct RowRef<'a> {
    pub batch: &'a RecordBatch,
    pub row: usize,
    pub file: &'a Path,
    /// 0-based row index within the dataset (across shards).
    pub index: u64,
}

pub struct ArrowRows {
    files: Vec<PathBuf>,
    file_idx: usize,
    batches: Option<Batches>,
    batch: Option<RecordBatch>,
    row: usize,
    index: u64,
    pub epoch: u64,
}

impl ArrowRows {
    pub fn open(path: &Path) -> Result<Self> {
        let files = shard_files(path)?;
        for f in &files {
            if !f.is_file() {
                return Err(Error::data(f, "listed in state.json but missing"));
            }
        }
        let batches = Some(open_batches(&files[0])?);
        Ok(ArrowRows { files, file_idx: 0, batches, batch: None, row: 0, index: 0, epoch: 0 })
    }

    pub fn first_file(&self) -> &Path {
        &self.files[0]
    }

    /// Schema column names of the first shard (for validating a format before training).
    pub fn peek_columns(&mut self) -> Result<Vec<(String, DataType)>> {
        self.fill()?;
        let b = self.batch.as_ref().ok_or_else(|| Error::data(&self.files[0], "dataset has no rows"))?;
        Ok(b.schema().fields().iter().map(|f| (f.name().clone(), f.data_type().clone())).collect())
    }

    /// Make `self.batch` hold a batch with `self.row` in range, wrapping at the end.
    fn fill(&mut self) -> Result<()> {
        let mut wrapped_empty = false;
        loop {
            if let Some(b) = &self.batch {
                if self.row < b.num_rows() {
                    return Ok(());
                }
            }
            self.batch = None;
            self.row = 0;
            let file = self.files[self.file_idx].clone();
            let next = match self.batches.as_mut() {
                Some(it) => it.next(),
                None => None,
            };
            match next {
                Some(Ok(b)) => self.batch = Some(b),
                Some(Err(e)) => return Err(Error::data(&file, format!("corrupt record batch: {e}"))),
                None => {
                    self.file_idx += 1;
                    if self.file_idx == self.files.len() {
                        if self.index == 0 {
                            if wrapped_empty {
                                return Err(Error::data(&self.files[0], "dataset has no rows"));
                            }
                            wrapped_empty = true;
                        }
                        self.file_idx = 0;
                        self.index = 0;
                        self.epoch += 1;
                    }
                    self.batches = Some(open_batches(&self.files[self.file_idx])?);
                }
            }
        }
    }

    /// The next row (wrapping to the first after the last).
    pub fn next_row(&mut self) -> Result<RowRef<'_>> {
        self.fill()?;
        let row = self.row;
        let index = self.index;
        self.row += 1;
        self.index += 1;
        let batch = self.batch.as_ref().ok_or_else(|| Error::data(&self.files[0], "dataset has no rows"))?;
        Ok(RowRef { batch, row, file: &self.files[self.file_idx], index })
    }
}

/// An integer list cell (`list<int*>` / `large_list<int*>`) as i64s.
pub fn int_list(r: &RowRef, column: &str) -> Result<Vec<i64>> {
    let err = |msg: String| Error::data(r.file, format!("row {}: column `{column}`: {msg}", r.index));
    let col = r.batch.column_by_name(column).ok_or_else(|| err("missing".into()))?;
    if col.is_null(r.row) {
        return Err(err("is null".into()));
    }
    let values = if let Some(l) = col.as_list_opt::<i32>() {
        l.value(r.row)
    } else if let Some(l) = col.as_list_opt::<i64>() {
        l.value(r.row)
    } else {
        return Err(err(format!("expected a list of integers, got {}", col.data_type())));
    };
    macro_rules! ints {
        ($($t:ty),*) => {
            $( if let Some(p) = values.as_primitive_opt::<$t>() {
                return Ok(p.values().iter().map(|&v| v as i64).collect());
            } )*
        };
    }
    ints!(Int32Type, Int64Type, UInt32Type, Int16Type, UInt16Type, Int8Type, UInt8Type);
    if let Some(p) = values.as_primitive_opt::<UInt64Type>() {
        return p.values().iter().map(|&v| i64::try_from(v).map_err(|_| err(format!("value {v} out of range")))).collect();
    }
    Err(err(format!("expected integer elements, got {}", values.data_type())))
}

/// A string cell (utf8 / large_utf8); `None` when the column is absent or the cell is null.
pub fn string_cell(r: &RowRef, column: &str) -> Result<Option<String>> {
    let Some(col) = r.batch.column_by_name(column) else { return Ok(None) };
    if col.is_null(r.row) {
        return Ok(None);
    }
    if let Some(s) = col.as_string_opt::<i32>() {
        return Ok(Some(s.value(r.row).to_string()));
    }
    if let Some(s) = col.as_string_opt::<i64>() {
        return Ok(Some(s.value(r.row).to_string()));
    }
    Err(Error::data(r.file, format!("row {}: column `{column}`: expected a string, got {}", r.index, col.data_type())))
}
