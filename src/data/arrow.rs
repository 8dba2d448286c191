//! Arrow rows with random access: an HF `datasets` save_to_disk folder (IPC *stream* shards
//! listed in `state.json`) or a single `.arrow` file (stream or file format).
//!
//! Each shard is memory-mapped and its IPC message framing is scanned once at open (headers
//! only, no data decoded) to find every record batch's byte range and row count. A batch is
//! decoded only when a row of it is needed, straight from the map. So memory stays at one
//! decoded batch however large the data, and a saved [`Cursor`] is reached directly on resume
//! without re-reading what came before.

use crate::error::{Error, Result};
use arrow_array::cast::AsArray;
use arrow_array::types::{Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type, UInt64Type, UInt8Type};
use arrow_array::{Array, RecordBatch};
use arrow_buffer::Buffer;
use arrow_ipc::MessageHeader;
use arrow_schema::DataType;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

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

/// One memory-mapped Arrow IPC file with the byte ranges of its messages.
struct Shard {
    path: PathBuf,
    map: Arc<memmap2::Mmap>,
    schema: Range<usize>,
    /// (byte range of the whole message, rows)
    batches: Vec<(Range<usize>, usize)>,
}

fn read_u32(b: &[u8], at: usize) -> Option<u32> {
    b.get(at..at + 4).map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

impl Shard {
    fn open(path: &Path) -> Result<Shard> {
        let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: read-only map; datasets files are not modified while we train on them.
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::io(path, e))?;
        let bad = |msg: String| Error::data(path, format!("not a readable Arrow IPC file: {msg}"));
        let b: &[u8] = &map;
        // The file format is "ARROW1\0\0" + an IPC stream + footer; the stream format is the
        // stream alone. Either way the messages are scanned the same.
        let mut pos = if b.starts_with(b"ARROW1") { 8 } else { 0 };
        let mut schema = None;
        let mut batches = Vec::new();
        while pos < b.len() {
            let start = pos;
            let first = read_u32(b, pos).ok_or_else(|| bad(format!("truncated message header at byte {pos}")))?;
            let (len, header) = if first == 0xFFFF_FFFF {
                (read_u32(b, pos + 4).ok_or_else(|| bad(format!("truncated message header at byte {pos}")))? as usize, 8)
            } else {
                (first as usize, 4)
            };
            if len == 0 {
                break; // end-of-stream marker
            }
            let meta = b.get(pos + header..pos + header + len).ok_or_else(|| bad(format!("truncated message at byte {pos}")))?;
            let msg = arrow_ipc::root_as_message(meta).map_err(|e| bad(format!("bad message at byte {pos}: {e}")))?;
            let body = usize::try_from(msg.bodyLength()).map_err(|_| bad("negative body length".into()))?;
            let end = pos + header + len + body;
            if end > b.len() {
                return Err(bad(format!("message at byte {pos} runs past the end of the file (truncated?)")));
            }
            match msg.header_type() {
                MessageHeader::Schema => schema = Some(start..end),
                MessageHeader::RecordBatch => {
                    let rows = msg.header_as_record_batch().map(|r| r.length()).unwrap_or(0);
                    batches.push((start..end, usize::try_from(rows).unwrap_or(0)));
                }
                MessageHeader::DictionaryBatch => return Err(bad("dictionary-encoded columns are not supported".into())),
                _ => {}
            }
            pos = end;
        }
        let schema = schema.ok_or_else(|| bad("no schema message".into()))?;
        Ok(Shard { path: path.to_path_buf(), map: Arc::new(map), schema, batches })
    }

    fn buffer(&self, r: &Range<usize>) -> Buffer {
        Buffer::from_slice_ref(&self.map[r.clone()])
    }

    fn decode(&self, batch: usize) -> Result<RecordBatch> {
        let mut dec = arrow_ipc::reader::StreamDecoder::new();
        let bad = |e: arrow_schema::ArrowError| Error::data(&self.path, format!("corrupt record batch {batch}: {e}"));
        let mut s = self.buffer(&self.schema);
        dec.decode(&mut s).map_err(bad)?;
        let mut b = self.buffer(&self.batches[batch].0);
        while !b.is_empty() {
            if let Some(rb) = dec.decode(&mut b).map_err(bad)? {
                return Ok(rb);
            }
        }
        Err(Error::data(&self.path, format!("record batch {batch} did not decode")))
    }
}

/// Position of the next row: enough to resume without reading anything before it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Cursor {
    pub epoch: u64,
    pub file: usize,
    pub batch: usize,
    pub row: usize,
    /// 0-based index of the row in the dataset (across shards).
    pub index: u64,
}

/// Where a row lives (for error messages and for re-fetching it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RowPos {
    pub file: usize,
    pub batch: usize,
    pub row: usize,
    pub index: u64,
}

/// A row: its batch, its index in the batch, and where it came from.
pub struct RowRef<'a> {
    pub batch: &'a RecordBatch,
    pub row: usize,
    pub file: &'a Path,
    /// 0-based row index within the dataset (across shards).
    pub index: u64,
}

pub struct ArrowRows {
    shards: Vec<Shard>,
    cur: Cursor,
    /// The decoded batch kept: (file, batch, data).
    cached: Option<(usize, usize, RecordBatch)>,
    /// First dataset index of each (file, batch), for random access by position.
    pub total_rows: u64,
}

impl ArrowRows {
    pub fn open(path: &Path) -> Result<Self> {
        let files = shard_files(path)?;
        let mut shards = Vec::with_capacity(files.len());
        for f in &files {
            if !f.is_file() {
                return Err(Error::data(f, "listed in state.json but missing"));
            }
            shards.push(Shard::open(f)?);
        }
        let total_rows = shards.iter().flat_map(|s| s.batches.iter().map(|b| b.1 as u64)).sum();
        if total_rows == 0 {
            return Err(Error::data(&files[0], "dataset has no rows"));
        }
        Ok(ArrowRows { shards, cur: Cursor::default(), cached: None, total_rows })
    }

    pub fn first_file(&self) -> &Path {
        &self.shards[0].path
    }

    /// Column names and types (from the first non-empty batch).
    pub fn peek_columns(&mut self) -> Result<Vec<(String, DataType)>> {
        let (f, b) = self.normalise(Cursor::default()).map(|c| (c.file, c.batch))?;
        let rb = self.batch(f, b)?;
        Ok(rb.schema().fields().iter().map(|f| (f.name().clone(), f.data_type().clone())).collect())
    }

    pub fn cursor(&self) -> Cursor {
        self.cur
    }

    /// Continue from a saved cursor (checked against this dataset's shape).
    pub fn seek(&mut self, c: Cursor) -> Result<()> {
        let ok = c.file < self.shards.len()
            && c.batch <= self.shards[c.file].batches.len()
            && self.shards[c.file].batches.get(c.batch).is_none_or(|b| c.row <= b.1);
        if !ok {
            return Err(Error::data(&self.shards[0].path, format!("saved data position {c:?} does not exist in this dataset (did it change?)")));
        }
        self.cur = c;
        Ok(())
    }

    /// Move `c` forward past exhausted batches/files (wrapping to the next epoch).
    fn normalise(&self, mut c: Cursor) -> Result<Cursor> {
        loop {
            let shard = &self.shards[c.file];
            if c.batch < shard.batches.len() && c.row < shard.batches[c.batch].1 {
                return Ok(c);
            }
            c.row = 0;
            c.batch += 1;
            if c.batch >= shard.batches.len() {
                c.batch = 0;
                c.file += 1;
                if c.file == self.shards.len() {
                    c.file = 0;
                    c.epoch += 1;
                    c.index = 0;
                }
            }
        }
    }

    fn batch(&mut self, file: usize, batch: usize) -> Result<&RecordBatch> {
        let hit = matches!(&self.cached, Some((f, b, _)) if *f == file && *b == batch);
        if !hit {
            let rb = self.shards[file].decode(batch)?;
            self.cached = Some((file, batch, rb));
        }
        match &self.cached {
            Some((_, _, rb)) => Ok(rb),
            None => Err(Error::data(&self.shards[file].path, "internal: batch cache empty")),
        }
    }

    /// The next row (wrapping to the first after the last) and its position.
    pub fn next_row(&mut self) -> Result<(RowRef<'_>, RowPos)> {
        let c = self.normalise(self.cur)?;
        self.cur = Cursor { row: c.row + 1, index: c.index + 1, ..c };
        let pos = RowPos { file: c.file, batch: c.batch, row: c.row, index: c.index };
        Ok((self.row_at(pos)?, pos))
    }

    /// Random access to a row by position.
    pub fn row_at(&mut self, pos: RowPos) -> Result<RowRef<'_>> {
        if pos.file >= self.shards.len() || pos.batch >= self.shards[pos.file].batches.len() {
            return Err(Error::data(&self.shards[0].path, format!("row position {pos:?} does not exist in this dataset")));
        }
        self.batch(pos.file, pos.batch)?;
        let batch = match &self.cached {
            Some((_, _, rb)) => rb,
            None => return Err(Error::data(&self.shards[pos.file].path, "internal: batch cache empty")),
        };
        Ok(RowRef { batch, row: pos.row, file: &self.shards[pos.file].path, index: pos.index })
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
