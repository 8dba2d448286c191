//! Row sources with random access: HF `datasets` save_to_disk folders (Arrow IPC *stream*
//! shards listed in `state.json`), DatasetDict folders (a split picked by `dir:split` or
//! `data.split`), single `.arrow` files (stream or file format), `.parquet` and `.jsonl`
//! files, or a list of any of these, read one after another.
//!
//! Every shard is cut into blocks at open without decoding data: Arrow IPC files are
//! memory-mapped and their message framing scanned (record batches); Parquet files expose
//! their row groups from the footer; JSONL files are scanned once for line offsets (one block
//! per 1024 lines). A block is decoded only when one of its rows is needed, and only one is
//! kept. So memory stays at one block however large the data, and a saved [`Cursor`] is
//! reached directly on resume without reading what came before.

use crate::error::{Error, Result};
use arrow_array::cast::AsArray;
use arrow_array::types::{Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type, UInt64Type, UInt8Type};
use arrow_array::{Array, RecordBatch};
use arrow_buffer::Buffer;
use arrow_ipc::MessageHeader;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Resolve one `data.train` entry to its shard files. `split` picks a DatasetDict split when
/// the entry does not name one (`dir:split`).
pub fn shard_files(spec: &Path, split: Option<&str>) -> Result<Vec<PathBuf>> {
    let s = spec.to_string_lossy();
    // "dir:split" (only when `dir` is a folder: a colon may be part of a file name).
    if let Some((dir, sp)) = s.rsplit_once(':') {
        let d = Path::new(dir);
        if d.is_dir() && d.join("dataset_dict.json").is_file() {
            return shard_files(&d.join(sp), None);
        }
    }
    let path = spec;
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
    let dict = path.join("dataset_dict.json");
    if dict.is_file() {
        let text = std::fs::read_to_string(&dict).map_err(|e| Error::io(&dict, e))?;
        let splits: Vec<String> = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v.get("splits").and_then(|s| s.as_array().cloned()))
            .unwrap_or_default()
            .iter()
            .filter_map(|s| s.as_str().map(String::from))
            .collect();
        return match split {
            Some(sp) if splits.iter().any(|s| s == sp) => shard_files(&path.join(sp), None),
            Some(sp) => Err(Error::data(path, format!("DatasetDict has no split `{sp}` (splits: {}); set data.split", splits.join(", ")))),
            None => Err(Error::data(
                path,
                format!("is a DatasetDict (splits: {}); pick one with `{}:<split>` or data.split", splits.join(", "), path.display()),
            )),
        };
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|e| Error::io(path, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "arrow" || x == "parquet" || x == "jsonl"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::data(path, "has no state.json and no .arrow, .parquet or .jsonl files"));
    }
    Ok(files)
}

/// Drop the pages of `range` from this process's resident set. The map is read-only and
/// file-backed, so the data stays in the page cache and a later access simply faults it back
/// in; without this, every page a pass over a large dataset touched would count as resident.
fn release(map: &memmap2::Mmap, range: Range<usize>) {
    const PAGE: usize = 4096;
    // The kernel maps up to 64 KiB around a faulting page ("fault-around"): release that much
    // on either side too.
    const AROUND: usize = 64 << 10;
    let start = range.start.saturating_sub(AROUND) / PAGE * PAGE;
    let end = (range.end + AROUND).min(map.len());
    if end > start {
        // SAFETY: MADV_DONTNEED on a read-only shared file mapping only discards our page
        // table entries; no Rust reference into the map outlives the copy made before.
        let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start) };
    }
}

/// A decoded block of rows.
pub enum Block {
    Arrow(RecordBatch),
    Json(Vec<serde_json::Value>),
}

impl Block {
    fn columns(&self) -> Vec<String> {
        match self {
            Block::Arrow(b) => b.schema().fields().iter().map(|f| f.name().clone()).collect(),
            Block::Json(rows) => rows
                .first()
                .and_then(|r| r.as_object())
                .map(|o| o.keys().cloned().collect())
                .unwrap_or_default(),
        }
    }
}

/// One memory-mapped Arrow IPC file with the byte ranges of its messages.
struct IpcShard {
    path: PathBuf,
    map: Arc<memmap2::Mmap>,
    schema: Range<usize>,
    /// (byte range of the whole message, rows)
    batches: Vec<(Range<usize>, usize)>,
}

fn read_u32(b: &[u8], at: usize) -> Option<u32> {
    b.get(at..at + 4).map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

impl IpcShard {
    fn open(path: &Path) -> Result<IpcShard> {
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
        release(&map, 0..map.len());
        Ok(IpcShard { path: path.to_path_buf(), map: Arc::new(map), schema, batches })
    }

    fn buffer(&self, r: &Range<usize>) -> Buffer {
        Buffer::from_slice_ref(&self.map[r.clone()])
    }

    fn decode(&self, batch: usize) -> Result<RecordBatch> {
        let mut dec = arrow_ipc::reader::StreamDecoder::new();
        let bad = |e: arrow_schema::ArrowError| Error::data(&self.path, format!("corrupt record batch {batch}: {e}"));
        let mut s = self.buffer(&self.schema);
        dec.decode(&mut s).map_err(bad)?;
        let range = self.batches[batch].0.clone();
        let mut b = self.buffer(&range);
        release(&self.map, self.schema.clone());
        release(&self.map, range);
        while !b.is_empty() {
            if let Some(rb) = dec.decode(&mut b).map_err(bad)? {
                return Ok(rb);
            }
        }
        Err(Error::data(&self.path, format!("record batch {batch} did not decode")))
    }
}


/// A Parquet file: one block per row group.
struct ParquetShard {
    path: PathBuf,
    groups: Vec<usize>,
}

impl ParquetShard {
    fn open(path: &Path) -> Result<Self> {
        use parquet::file::reader::{FileReader, SerializedFileReader};
        let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let r = SerializedFileReader::new(f).map_err(|e| Error::data(path, format!("not a readable Parquet file: {e}")))?;
        let groups = r.metadata().row_groups().iter().map(|g| g.num_rows().max(0) as usize).collect();
        Ok(ParquetShard { path: path.to_path_buf(), groups })
    }

    fn decode(&self, group: usize) -> Result<RecordBatch> {
        use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
        let bad = |e: String| Error::data(&self.path, format!("row group {group}: {e}"));
        let f = std::fs::File::open(&self.path).map_err(|e| Error::io(&self.path, e))?;
        let reader = ParquetRecordBatchReaderBuilder::try_new(f)
            .map_err(|e| bad(e.to_string()))?
            .with_row_groups(vec![group])
            .with_batch_size(self.groups[group].max(1))
            .build()
            .map_err(|e| bad(e.to_string()))?;
        let batches: Vec<RecordBatch> = reader.collect::<std::result::Result<_, _>>().map_err(|e| bad(e.to_string()))?;
        let schema = batches.first().map(|b| b.schema()).ok_or_else(|| bad("empty".into()))?;
        arrow_select::concat::concat_batches(&schema, &batches).map_err(|e| bad(e.to_string()))
    }
}

/// JSON lines: one block per 1024 lines, found by a single scan for newlines.
struct JsonlShard {
    path: PathBuf,
    map: Arc<memmap2::Mmap>,
    /// Byte range and line count of each block.
    blocks: Vec<(Range<usize>, usize)>,
}

const JSONL_BLOCK: usize = 1024;

impl JsonlShard {
    fn open(path: &Path) -> Result<Self> {
        let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let len = f.metadata().map_err(|e| Error::io(path, e))?.len();
        // SAFETY: read-only map of a file we do not modify while training.
        let map = if len == 0 { None } else { Some(unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::io(path, e))?) };
        let mut blocks = Vec::new();
        if let Some(m) = &map {
            let (mut start, mut lines, mut pos) = (0usize, 0usize, 0usize);
            let mut released = 0usize;
            for line in m.split(|&b| b == b'\n') {
                // Keep the scan itself from making the whole file resident.
                if pos - released > 32 << 20 {
                    release(m, released..pos);
                    released = pos;
                }
                let end = pos + line.len();
                if !line.iter().all(|b| b.is_ascii_whitespace()) {
                    lines += 1;
                }
                pos = end + 1;
                if lines == JSONL_BLOCK {
                    blocks.push((start..end.min(m.len()), lines));
                    start = pos.min(m.len());
                    lines = 0;
                }
            }
            if lines > 0 {
                blocks.push((start..m.len(), lines));
            }
            release(m, 0..m.len());
        }
        let map = match map {
            Some(m) => Arc::new(m),
            None => Arc::new(memmap2::MmapOptions::new().len(0).map_anon().map_err(|e| Error::io(path, e))?.make_read_only().map_err(|e| Error::io(path, e))?),
        };
        Ok(JsonlShard { path: path.to_path_buf(), map, blocks })
    }

    /// Lines of a block as JSON values; a line that is not JSON becomes a string value holding
    /// the parse error, reported per row by the format code.
    fn decode(&self, block: usize) -> Result<Vec<serde_json::Value>> {
        let range = self.blocks[block].0.clone();
        let bytes = &self.map[range.clone()];
        let rows = bytes
            .split(|&b| b == b'\n')
            .filter(|l| !l.iter().all(|b| b.is_ascii_whitespace()))
            .map(|l| match std::str::from_utf8(l) {
                Err(_) => serde_json::json!({"__bad_record__": "invalid UTF-8"}),
                Ok(s) => serde_json::from_str(s).unwrap_or_else(|e| serde_json::json!({"__bad_record__": format!("not valid JSON: {e}")})),
            })
            .collect();
        release(&self.map, range);
        Ok(rows)
    }
}

enum Shard {
    Ipc(IpcShard),
    Parquet(ParquetShard),
    Jsonl(JsonlShard),
}

impl Shard {
    fn open(path: &Path) -> Result<Shard> {
        match path.extension().and_then(|e| e.to_str()) {
            Some("parquet") => Ok(Shard::Parquet(ParquetShard::open(path)?)),
            Some("jsonl") | Some("json") => Ok(Shard::Jsonl(JsonlShard::open(path)?)),
            _ => Ok(Shard::Ipc(IpcShard::open(path)?)),
        }
    }
    fn path(&self) -> &Path {
        match self {
            Shard::Ipc(s) => &s.path,
            Shard::Parquet(s) => &s.path,
            Shard::Jsonl(s) => &s.path,
        }
    }
    fn block_rows(&self) -> Vec<usize> {
        match self {
            Shard::Ipc(s) => s.batches.iter().map(|b| b.1).collect(),
            Shard::Parquet(s) => s.groups.clone(),
            Shard::Jsonl(s) => s.blocks.iter().map(|b| b.1).collect(),
        }
    }
    fn decode(&self, block: usize) -> Result<Block> {
        Ok(match self {
            Shard::Ipc(s) => Block::Arrow(s.decode(block)?),
            Shard::Parquet(s) => Block::Arrow(s.decode(block)?),
            Shard::Jsonl(s) => Block::Json(s.decode(block)?),
        })
    }
}

/// Position of the next row: enough to resume without reading anything before it.
/// `slot` indexes the epoch's block order (the blocks of every shard in order, or a seeded
/// permutation of them when shuffling), `row` the row within that block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Cursor {
    pub epoch: u64,
    pub slot: usize,
    pub row: usize,
}

/// Where a row lives (for error messages and for re-fetching it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RowPos {
    pub file: usize,
    pub batch: usize,
    pub row: usize,
    pub index: u64,
}

/// One row of a block.
pub enum Row<'a> {
    Arrow { batch: &'a RecordBatch, row: usize },
    Json(&'a serde_json::Value),
}

/// A row and where it came from.
pub struct RowRef<'a> {
    pub row: Row<'a>,
    pub file: &'a Path,
    /// 0-based row index within the dataset (across shards).
    pub index: u64,
}

pub struct Rows {
    shards: Vec<Shard>,
    /// Rows per block, per shard.
    blocks: Vec<Vec<usize>>,
    /// Dataset index of the first row of each block, per shard.
    starts: Vec<Vec<u64>>,
    /// Block order of the current epoch: (shard, block).
    order: Vec<(usize, usize)>,
    order_epoch: u64,
    /// Shuffle the block order per epoch with this seed.
    shuffle_seed: Option<u64>,
    cur: Cursor,
    cached: Option<(usize, usize, Block)>,
    pub total_rows: u64,
}

impl Rows {
    /// Open every source in order (one `data.train` entry or several).
    pub fn open_all(specs: &[PathBuf], split: Option<&str>) -> Result<Self> {
        let mut shards = Vec::new();
        for spec in specs {
            for f in shard_files(spec, split)? {
                if !f.is_file() {
                    return Err(Error::data(&f, "listed in state.json but missing"));
                }
                shards.push(Shard::open(&f)?);
            }
        }
        let blocks: Vec<Vec<usize>> = shards.iter().map(|s| s.block_rows()).collect();
        let mut starts = Vec::with_capacity(blocks.len());
        let mut total_rows = 0u64;
        for b in &blocks {
            let mut v = Vec::with_capacity(b.len());
            for &n in b {
                v.push(total_rows);
                total_rows += n as u64;
            }
            starts.push(v);
        }
        if total_rows == 0 {
            let p = shards.first().map(|s| s.path().to_path_buf()).unwrap_or_default();
            return Err(Error::data(p, "dataset has no rows"));
        }
        let mut r = Rows { shards, blocks, starts, order: Vec::new(), order_epoch: 0, shuffle_seed: None, cur: Cursor::default(), cached: None, total_rows };
        r.set_epoch_order(0);
        Ok(r)
    }

    pub fn open(path: &Path) -> Result<Self> {
        Self::open_all(&[path.to_path_buf()], None)
    }

    /// Visit the blocks of each epoch in a seeded random order (the shard/batch-order part of
    /// shuffling; rows within are mixed by the loader's shuffle buffer).
    pub fn shuffle_blocks(&mut self, seed: u64) {
        self.shuffle_seed = Some(seed);
        self.set_epoch_order(self.cur.epoch);
    }

    fn set_epoch_order(&mut self, epoch: u64) {
        let mut order: Vec<(usize, usize)> =
            self.blocks.iter().enumerate().flat_map(|(f, b)| (0..b.len()).map(move |i| (f, i))).collect();
        if let Some(seed) = self.shuffle_seed {
            let mut rng = crate::rng::Rng::new(crate::rng::stream(&[seed, epoch, 0xB10C]));
            for i in (1..order.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                order.swap(i, j);
            }
        }
        self.order = order;
        self.order_epoch = epoch;
    }

    pub fn first_file(&self) -> &Path {
        self.shards[0].path()
    }

    /// Column names of the first non-empty block.
    pub fn peek_columns(&mut self) -> Result<Vec<String>> {
        let (f, b) = self.blocks.iter().enumerate().find_map(|(f, bl)| bl.iter().position(|&n| n > 0).map(|b| (f, b))).unwrap_or((0, 0));
        Ok(self.block(f, b)?.columns())
    }

    pub fn cursor(&self) -> Cursor {
        self.cur
    }

    /// Continue from a saved cursor (checked against this dataset's shape).
    pub fn seek(&mut self, c: Cursor) -> Result<()> {
        if c.epoch != self.order_epoch {
            self.set_epoch_order(c.epoch);
        }
        let ok = c.slot <= self.order.len() && self.order.get(c.slot).is_none_or(|&(f, b)| c.row <= self.blocks[f][b]);
        if !ok {
            return Err(Error::data(self.first_file(), format!("saved data position {c:?} does not exist in this dataset (did it change?)")));
        }
        self.cur = c;
        Ok(())
    }

    fn block(&mut self, file: usize, batch: usize) -> Result<&Block> {
        let hit = matches!(&self.cached, Some((f, b, _)) if *f == file && *b == batch);
        if !hit {
            let rb = self.shards[file].decode(batch)?;
            self.cached = Some((file, batch, rb));
        }
        match &self.cached {
            Some((_, _, rb)) => Ok(rb),
            None => Err(Error::data(self.shards[file].path(), "internal: block cache empty")),
        }
    }

    /// The next row (wrapping to the first after the last) and its position.
    pub fn next_row(&mut self) -> Result<(RowRef<'_>, RowPos)> {
        // Skip exhausted (or empty) blocks, wrapping into the next epoch.
        loop {
            if self.cur.epoch != self.order_epoch {
                self.set_epoch_order(self.cur.epoch);
            }
            match self.order.get(self.cur.slot) {
                Some(&(f, b)) if self.cur.row < self.blocks[f][b] => break,
                Some(_) => self.cur = Cursor { slot: self.cur.slot + 1, row: 0, ..self.cur },
                None => self.cur = Cursor { epoch: self.cur.epoch + 1, slot: 0, row: 0 },
            }
        }
        let (f, b) = self.order[self.cur.slot];
        let pos = RowPos { file: f, batch: b, row: self.cur.row, index: self.starts[f][b] + self.cur.row as u64 };
        self.cur.row += 1;
        Ok((self.row_at(pos)?, pos))
    }

    /// Random access to a row by position.
    pub fn row_at(&mut self, pos: RowPos) -> Result<RowRef<'_>> {
        if pos.file >= self.shards.len() || pos.batch >= self.blocks[pos.file].len() || pos.row >= self.blocks[pos.file][pos.batch] {
            return Err(Error::data(self.first_file(), format!("row position {pos:?} does not exist in this dataset")));
        }
        self.block(pos.file, pos.batch)?;
        let file = self.shards[pos.file].path();
        let row = match &self.cached {
            Some((_, _, Block::Arrow(b))) => Row::Arrow { batch: b, row: pos.row },
            Some((_, _, Block::Json(rows))) => Row::Json(&rows[pos.row]),
            None => return Err(Error::data(file, "internal: block cache empty")),
        };
        Ok(RowRef { row, file, index: pos.index })
    }
}

impl RowRef<'_> {
    fn err(&self, column: &str, msg: impl std::fmt::Display) -> Error {
        Error::data(self.file, format!("row {}: column `{column}`: {msg}", self.index))
    }

    /// A JSON line that could not be parsed.
    pub fn bad_line(&self) -> Option<String> {
        match &self.row {
            Row::Json(v) => v.get("__bad_record__").and_then(|m| m.as_str()).map(|m| format!("row {}: {m}", self.index)),
            _ => None,
        }
    }

    pub fn has(&self, column: &str) -> bool {
        match &self.row {
            Row::Arrow { batch, .. } => batch.column_by_name(column).is_some(),
            Row::Json(v) => v.get(column).is_some(),
        }
    }

    /// An integer list cell (`list<int*>`, `large_list<int*>`, or a JSON array of integers).
    pub fn int_list(&self, column: &str) -> Result<Vec<i64>> {
        match &self.row {
            Row::Json(v) => {
                let a = v.get(column).ok_or_else(|| self.err(column, "missing"))?;
                let a = a.as_array().ok_or_else(|| self.err(column, format!("expected a list of integers, got {a}")))?;
                a.iter().map(|x| x.as_i64().ok_or_else(|| self.err(column, format!("expected integers, got {x}")))).collect()
            }
            Row::Arrow { batch, row } => {
                let col = batch.column_by_name(column).ok_or_else(|| self.err(column, "missing"))?;
                if col.is_null(*row) {
                    return Err(self.err(column, "is null"));
                }
                let values = list_cell(col, *row)
                    .ok_or_else(|| self.err(column, format!("expected a list of integers, got {}", col.data_type())))?;
                macro_rules! ints {
                    ($($t:ty),*) => {
                        $( if let Some(p) = values.as_primitive_opt::<$t>() {
                            return Ok(p.values().iter().map(|&v| v as i64).collect());
                        } )*
                    };
                }
                ints!(Int32Type, Int64Type, UInt32Type, Int16Type, UInt16Type, Int8Type, UInt8Type);
                if let Some(p) = values.as_primitive_opt::<UInt64Type>() {
                    return p.values().iter().map(|&v| i64::try_from(v).map_err(|_| self.err(column, format!("value {v} out of range")))).collect();
                }
                Err(self.err(column, format!("expected integer elements, got {}", values.data_type())))
            }
        }
    }

    /// A string cell; `None` when the column is absent or the cell is null.
    pub fn string(&self, column: &str) -> Result<Option<String>> {
        match &self.row {
            Row::Json(v) => match v.get(column) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                Some(other) => Err(self.err(column, format!("expected a string, got {other}"))),
            },
            Row::Arrow { batch, row } => {
                let Some(col) = batch.column_by_name(column) else { return Ok(None) };
                if col.is_null(*row) {
                    return Ok(None);
                }
                if let Some(s) = col.as_string_opt::<i32>() {
                    return Ok(Some(s.value(*row).to_string()));
                }
                if let Some(s) = col.as_string_opt::<i64>() {
                    return Ok(Some(s.value(*row).to_string()));
                }
                if let Some(s) = col.as_string_view_opt() {
                    return Ok(Some(s.value(*row).to_string()));
                }
                Err(self.err(column, format!("expected a string, got {}", col.data_type())))
            }
        }
    }

    /// A list of {role, content} messages (`list<struct<role, content>>` or a JSON array).
    pub fn messages(&self, column: &str) -> Result<Option<Vec<crate::chat::Message>>> {
        use crate::chat::Message;
        match &self.row {
            Row::Json(v) => match v.get(column) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::Array(a)) => a
                    .iter()
                    .map(|m| {
                        let role = m.get("role").and_then(|r| r.as_str()).ok_or_else(|| self.err(column, "a message has no string `role`"))?;
                        let content = m.get("content").and_then(|r| r.as_str()).ok_or_else(|| self.err(column, "a message has no string `content`"))?;
                        Ok(Message::new(role, content))
                    })
                    .collect::<Result<Vec<_>>>()
                    .map(Some),
                Some(other) => Err(self.err(column, format!("expected a list of messages, got {other}"))),
            },
            Row::Arrow { batch, row } => {
                let Some(col) = batch.column_by_name(column) else { return Ok(None) };
                if col.is_null(*row) {
                    return Ok(None);
                }
                let list = list_cell(col, *row)
                    .ok_or_else(|| self.err(column, format!("expected a list of {{role, content}} structs, got {}", col.data_type())))?;
                let s = list.as_struct_opt().ok_or_else(|| self.err(column, format!("expected structs, got {}", list.data_type())))?;
                let field = |name: &str| -> Result<Vec<Option<String>>> {
                    let c = s.column_by_name(name).ok_or_else(|| self.err(column, format!("messages have no `{name}` field")))?;
                    if let Some(a) = c.as_string_opt::<i32>() {
                        return Ok((0..a.len()).map(|i| (!a.is_null(i)).then(|| a.value(i).to_string())).collect());
                    }
                    if let Some(a) = c.as_string_opt::<i64>() {
                        return Ok((0..a.len()).map(|i| (!a.is_null(i)).then(|| a.value(i).to_string())).collect());
                    }
                    Err(self.err(column, format!("message `{name}` is {}, expected a string", c.data_type())))
                };
                let (roles, contents) = (field("role")?, field("content")?);
                roles
                    .into_iter()
                    .zip(contents)
                    .map(|(r, c)| match (r, c) {
                        (Some(r), Some(c)) => Ok(Message { role: r, content: c }),
                        _ => Err(self.err(column, "a message has a null role or content")),
                    })
                    .collect::<Result<Vec<_>>>()
                    .map(Some)
            }
        }
    }
}

/// The values of a `list` / `large_list` cell.
fn list_cell(col: &arrow_array::ArrayRef, row: usize) -> Option<arrow_array::ArrayRef> {
    if let Some(l) = col.as_list_opt::<i32>() {
        Some(l.value(row))
    } else {
        col.as_list_opt::<i64>().map(|l| l.value(row))
    }
}
