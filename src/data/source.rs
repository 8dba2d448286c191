//! Row sources with random access: HF `datasets` save_to_disk folders (Arrow IPC *stream*
//! shards listed in `state.json`), DatasetDict folders (a split picked by `dir:split` or
//! `data.split`), single `.arrow` files (stream or file format), `.parquet` and `.jsonl`
//! files, folders of them (one split when the file names say splits), or a list of any of
//! these, read one after another.
//!
//! Every shard is cut into blocks at open without decoding data: Arrow IPC files are
//! memory-mapped and their message framing scanned (record batches); Parquet files expose
//! their row groups from the footer; JSONL files are scanned once for line offsets (one block
//! per 1024 lines; a UTF-8 byte-order mark is skipped, and a line that is not a JSON object is
//! a bad record named by its line number). A block is decoded only when one of its rows is
//! needed, and only one is kept. So memory stays at one block however large the data, and a
//! saved [`Cursor`] is reached directly on resume without reading what came before.

use crate::error::{Error, Result};
use arrow_array::cast::AsArray;
use arrow_array::types::{Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type, UInt64Type, UInt8Type};
use arrow_array::{Array, RecordBatch};
use arrow_buffer::Buffer;
use arrow_ipc::MessageHeader;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Which split to read from a source that holds several (a DatasetDict, a folder of
/// train.jsonl and test.jsonl, a hub dataset repo).
#[derive(Clone, Copy, Debug)]
pub struct Split<'a> {
    /// The split named (data.split, or `:split` after the entry).
    pub name: Option<&'a str>,
    /// Named by `:split` after the entry (a source without splits is then an error; data.split
    /// applies to the sources of a list that have splits).
    pub explicit: bool,
    /// The split read when none is named and the source has several: TRL's defaults,
    /// `train` for training and `test` for evaluation (never train for evaluation).
    pub default: &'static str,
    /// `name` already chose among a hub dataset's splits (its files arrive as plain files),
    /// so it named something even where no local entry has splits.
    pub chose_on_hub: bool,
}

impl<'a> Split<'a> {
    pub fn train(name: Option<&'a str>) -> Self {
        Split { name, explicit: false, default: "train", chose_on_hub: false }
    }
    pub fn eval(name: Option<&'a str>) -> Self {
        Split { name, explicit: false, default: "test", chose_on_hub: false }
    }
    /// Whether data.split names the split (`name` set, not by a `:split` of the entry).
    fn by_data_split(&self) -> bool {
        !self.explicit && self.name.is_some()
    }

    /// `:name` after an entry.
    pub fn named(self, name: &'a str) -> Self {
        Split { name: Some(name), explicit: true, ..self }
    }

    /// A source with no splits given `:name` is an error (its rows are one set: reading them
    /// all would put a test set's name on training rows).
    fn none_here(&self, path: &Path, what: &str) -> Result<()> {
        match (self.explicit, self.name) {
            (true, Some(n)) => Err(Error::data(path, format!("has no splits ({what}), so `:{n}` names nothing; drop it, or point at the split's own files"))),
            _ => Ok(()),
        }
    }

    /// The split to read among `available`: the one named, else the default, else the only
    /// one. The error says what there is (callers add where and how to name one).
    pub fn pick<'s>(&self, available: &[&'s str]) -> std::result::Result<&'s str, String> {
        let list = available.join(", ");
        match self.name {
            Some(n) => available.iter().find(|&&a| a == n).copied().ok_or_else(|| format!("has no split `{n}` (its splits: {list})")),
            None => match available.iter().find(|&&a| a == self.default) {
                Some(a) => Ok(*a),
                None if available.len() == 1 => Ok(available[0]),
                None => Err(format!("has several splits ({list}) and none named {}", self.default)),
            },
        }
    }
}

/// Resolve one data entry to its shard files: `split` picks a DatasetDict's split (or a plain
/// folder's, when its file names say splits) when the entry does not name one (`dir:split`).
pub fn shard_files(spec: &Path, split: Split) -> Result<Vec<PathBuf>> {
    Ok(shard_files_and_split(spec, split)?.0)
}

/// [`shard_files`], and whether the entry had splits that `split`'s name (data.split, not a
/// `:split` of the entry's own) chose among.
fn shard_files_and_split(spec: &Path, split: Split) -> Result<(Vec<PathBuf>, bool)> {
    let s = spec.to_string_lossy();
    // "dir:split" (only when `dir` is a folder: a colon may be part of a file name).
    if let Some((dir, sp)) = s.rsplit_once(':') {
        let d = Path::new(dir);
        if d.is_dir() && !spec.exists() {
            return Ok((shard_files(d, split.named(sp))?, false));
        }
        // "file.jsonl:train": a single file has no splits (what a folder of it says).
        if d.is_file() && !spec.exists() {
            return Err(Error::data(d, format!("is a single file, which has no splits, so `:{sp}` names nothing; drop it, or point at the split's own files")));
        }
    }
    let path = spec;
    if path.is_file() {
        split.none_here(path, "a single file")?;
        return Ok((vec![path.to_path_buf()], false));
    }
    if !path.is_dir() {
        // A device, a pipe or a socket is there but holds no file to map or seek in.
        let what = if path.exists() { "is not a regular file or a folder (a device or a pipe?); data is read from files" } else { "does not exist" };
        return Err(Error::data(path, what));
    }
    let state = path.join("state.json");
    if state.is_file() {
        split.none_here(path, "a single `datasets` Dataset")?;
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
        return Ok((out, false));
    }
    let dict = path.join("dataset_dict.json");
    if dict.is_file() {
        let text = std::fs::read_to_string(&dict).map_err(|e| Error::io(&dict, e))?;
        // A broken file must not read as "no splits" (which blames the split name instead).
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::data(&dict, format!("not valid JSON: {e}")))?;
        let splits: Vec<String> = v
            .get("splits")
            .and_then(|s| s.as_array())
            .ok_or_else(|| Error::data(&dict, "expected a `splits` list"))?
            .iter()
            .filter_map(|s| s.as_str().map(String::from))
            .collect();
        let names: Vec<&str> = splits.iter().map(String::as_str).collect();
        let sp = split.pick(&names).map_err(|m| Error::data(path, format!("is a DatasetDict that {m}; pick one with `{}:<split>` (or data.split for data.train)", path.display())))?;
        return Ok((shard_files(&path.join(sp), Split::train(None))?, split.by_data_split()));
    }
    folder_files(path, split)
}

/// Split names `datasets` recognises in data file names, and the split each means (its
/// `KEYWORDS_IN_FILENAME_BASE_PATTERNS`: the keyword at the start of the name or after a
/// separator, followed by a separator or the end).
const SPLIT_KEYWORDS: &[(&str, &[&str])] =
    &[("train", &["train", "training"]), ("validation", &["validation", "valid", "dev", "val"]), ("test", &["test", "testing", "eval", "evaluation"])];

/// The split a data file's name says it holds (`train.jsonl`, `test-00000-of-00001.parquet`,
/// `my_valid.arrow`), if any.
fn split_of(file: &Path) -> Option<&'static str> {
    let name = file.file_stem()?.to_str()?.to_lowercase();
    let sep = |c: Option<char>| c.is_none_or(|c| "-._ ".contains(c) || c.is_ascii_digit());
    SPLIT_KEYWORDS.iter().find_map(|&(split, words)| {
        let named = words.iter().any(|w| {
            name.match_indices(w).any(|(i, _)| sep(name[..i].chars().next_back()) && sep(name[i + w.len()..].chars().next()))
        });
        named.then_some(split)
    })
}

/// How files without a split in their name are listed beside those with one.
const NO_SPLIT: &str = "(files without a split name)";

/// Whether a `.json` file may hold data, by its name: not the metadata `datasets` and model
/// folders keep beside it.
pub fn is_json_data_file(p: &Path) -> bool {
    const METADATA: [&str; 5] = ["dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json", "config.json"];
    p.file_name().and_then(|n| n.to_str()).is_some_and(|name| name.ends_with(".json") && !name.starts_with('.') && !METADATA.contains(&name))
}

/// The .arrow, .parquet and .jsonl files of a plain folder. When their names say which split
/// they hold (train.jsonl and test.jsonl), only the files of one split are read ([`Split`]),
/// never a mix (a test set trained on with exit 0).
fn folder_files(path: &Path, split: Split) -> Result<(Vec<PathBuf>, bool)> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(path).map_err(|e| Error::io(path, e))?.filter_map(|e| e.ok().map(|e| e.path())).collect();
    entries.sort();
    // `datasets`' json loader reads .json files too (JSON Lines or one array). Beside .jsonl,
    // .parquet or .arrow files a .json is more likely notes or metadata: it is named as not
    // read. A folder of .json files alone (metadata aside) is read.
    let json: Vec<PathBuf> = entries.iter().filter(|p| is_json_data_file(p)).cloned().collect();
    let mut files: Vec<PathBuf> = entries.iter().filter(|p| p.extension().is_some_and(|x| x == "arrow" || x == "parquet" || x == "jsonl")).cloned().collect();
    if files.is_empty() {
        files = json;
    } else if let Some(first) = json.first().and_then(|p| p.file_name()) {
        let more = if json.len() > 1 { format!(" and {} more", json.len() - 1) } else { String::new() };
        crate::note!("note: {}: {}{more} not read beside the folder's .jsonl, .parquet or .arrow files (move a .json data file to its own folder, or name it in data.train)", path.display(), first.to_string_lossy());
    }
    if files.is_empty() {
        return Err(Error::data(path, "has no state.json and no .arrow, .parquet, .jsonl or .json files"));
    }
    let tags: Vec<&str> = files.iter().map(|f| split_of(f).unwrap_or(NO_SPLIT)).collect();
    let mut groups = tags.clone();
    groups.sort();
    groups.dedup();
    if groups == [NO_SPLIT] {
        split.none_here(path, "no file name says a split")?;
        return Ok((files, false));
    }
    // "dev" or "valid" name the split "validation" does, as in file names.
    let named = split.name.map(|n| SPLIT_KEYWORDS.iter().find(|(_, words)| words.contains(&n)).map_or(n, |(name, _)| *name));
    let sp = Split { name: named, ..split }
        .pick(&groups)
        .map_err(|m| Error::data(path, format!("{m}, by its file names; pick one with `{}:<split>` (or data.split for data.train)", path.display())))?;
    Ok((files.into_iter().zip(tags).filter(|(_, t)| *t == sp).map(|(f, _)| f).collect(), split.by_data_split()))
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

/// One non-blank line of a JSONL file: an object, or why it is not one. Kept apart from the
/// data (rather than as a marker key in a JSON value) so no user key can be mistaken for it.
pub enum JsonRow {
    Object(serde_json::Map<String, serde_json::Value>),
    Bad(String),
}

/// Run a third-party decoder over bytes from `path`, turning a panic into an error naming the
/// file. arrow-ipc and parquet return errors for most malformed input, but some (a schema type
/// they do not know, a child count they assume, a length past a buffer) reach `panic!` or a
/// slice bound instead; the cheap checks in [`check_batch_layout`] catch the common ones
/// before decoding (and without the panic message on stderr), this catches the rest.
fn guarded<T>(path: &Path, what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
            Err(Error::data(path, format!("{what}: malformed data ({msg}); the file is damaged or not what its name says")))
        }
    }
}

/// The parts of a record batch message arrow-ipc trusts without checking: every buffer must
/// lie inside the message body, and a column with nulls cannot have more rows than its
/// validity bits could cover.
fn check_batch_layout(rb: &arrow_ipc::RecordBatch, body: usize) -> std::result::Result<(), String> {
    if rb.length() < 0 {
        return Err(format!("negative row count {}", rb.length()));
    }
    for (i, b) in rb.buffers().iter().flatten().enumerate() {
        let (o, l) = (b.offset(), b.length());
        let inside = o >= 0 && l >= 0 && (o as u64).checked_add(l as u64).is_some_and(|e| e <= body as u64);
        if !inside {
            return Err(format!("buffer {i} (offset {o}, length {l}) lies outside the {body}-byte message body"));
        }
    }
    for (i, n) in rb.nodes().iter().flatten().enumerate() {
        let (len, nulls) = (n.length(), n.null_count());
        if len < 0 || nulls < 0 || nulls > len || (nulls > 0 && len as u64 > 8 * body as u64) {
            return Err(format!("column node {i} claims {len} values with {nulls} nulls in a {body}-byte body"));
        }
    }
    Ok(())
}

/// Field types arrow-ipc would `panic!` on rather than refuse: a type tag of NONE, an integer
/// width other than 8, 16, 32 or 64 (at any depth).
fn check_field_type(f: arrow_ipc::Field<'_>) -> std::result::Result<(), String> {
    let name = f.name().unwrap_or("?");
    if f.type_type() == arrow_ipc::Type::NONE {
        return Err(format!("field `{name}` has no type"));
    }
    if let Some(i) = f.type_as_int() {
        if ![8, 16, 32, 64].contains(&i.bitWidth()) {
            return Err(format!("field `{name}` is a {}-bit integer", i.bitWidth()));
        }
    }
    for c in f.children().into_iter().flatten() {
        check_field_type(c)?;
    }
    Ok(())
}

/// A decoded block of rows.
pub enum Block {
    Arrow(RecordBatch),
    /// Rows with their 1-based line numbers in the file (blank lines are not rows).
    Json(Vec<(u64, JsonRow)>),
}

impl Block {
    /// Column names: the schema's, or for JSON lines every key of the valid records (`None`
    /// when no line of the block is a JSON object, so a broken first line decides nothing).
    fn columns(&self) -> Option<Vec<String>> {
        match self {
            Block::Arrow(b) => Some(b.schema().fields().iter().map(|f| f.name().clone()).collect()),
            Block::Json(rows) => {
                let (mut names, mut seen) = (Vec::new(), std::collections::HashSet::new());
                let mut any = false;
                for (_, r) in rows {
                    if let JsonRow::Object(o) = r {
                        any = true;
                        for k in o.keys() {
                            if seen.insert(k.as_str()) {
                                names.push(k.clone());
                            }
                        }
                    }
                }
                any.then_some(names)
            }
        }
    }

    /// The first bad line of a JSON block, as "line N: why".
    fn first_bad_line(&self) -> Option<String> {
        match self {
            Block::Json(rows) => rows.iter().find_map(|(line, r)| match r {
                JsonRow::Bad(m) => Some(format!("line {line}: {m}")),
                JsonRow::Object(_) => None,
            }),
            Block::Arrow(_) => None,
        }
    }
}

/// One memory-mapped Arrow IPC file with the byte ranges of its messages.
struct IpcShard {
    path: PathBuf,
    map: Arc<memmap2::Mmap>,
    schema: Range<usize>,
    /// The schema's top-level column names.
    columns: Vec<String>,
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
        // The file format is "ARROW1\0\0" + an IPC stream + footer + "ARROW1"; the stream
        // format is the stream alone. Either way the messages are scanned the same.
        let file_format = b.starts_with(b"ARROW1");
        let mut pos = if file_format { 8 } else { 0 };
        // The magic is padded to the writer's alignment: 8 bytes by the spec and pyarrow, 64
        // by arrow-rs. The schema message comes next, so zeros before it are padding.
        while file_format && pos < 64 && read_u32(b, pos) == Some(0) {
            pos += 8;
        }
        let mut schema = None;
        let mut columns = Vec::new();
        let mut batches = Vec::new();
        let mut ended = false;
        while pos < b.len() {
            let start = pos;
            let first = read_u32(b, pos).ok_or_else(|| bad(format!("truncated message header at byte {pos}")))?;
            let (len, header) = if first == 0xFFFF_FFFF {
                (read_u32(b, pos + 4).ok_or_else(|| bad(format!("truncated message header at byte {pos}")))? as usize, 8)
            } else {
                (first as usize, 4)
            };
            if len == 0 {
                ended = true; // end-of-stream marker
                break;
            }
            let meta = b.get(pos + header..pos + header + len).ok_or_else(|| bad(format!("truncated message at byte {pos}")))?;
            let msg = arrow_ipc::root_as_message(meta).map_err(|e| bad(format!("bad message at byte {pos}: {e}")))?;
            let body = usize::try_from(msg.bodyLength()).map_err(|_| bad("negative body length".into()))?;
            let end = pos + header + len + body;
            if end > b.len() {
                return Err(bad(format!("message at byte {pos} runs past the end of the file (truncated?)")));
            }
            match msg.header_type() {
                MessageHeader::Schema => {
                    for f in msg.header_as_schema().and_then(|s| s.fields()).into_iter().flatten() {
                        check_field_type(f).map_err(|m| bad(format!("schema: {m}")))?;
                        columns.push(f.name().unwrap_or_default().to_string());
                    }
                    schema = Some(start..end);
                }
                MessageHeader::RecordBatch => {
                    let rb = msg.header_as_record_batch().ok_or_else(|| bad(format!("record batch at byte {pos} has no header")))?;
                    check_batch_layout(&rb, body).map_err(|m| bad(format!("record batch at byte {pos}: {m}")))?;
                    let rows = usize::try_from(rb.length()).map_err(|_| bad(format!("record batch at byte {pos}: bad row count")))?;
                    batches.push((start..end, rows));
                }
                MessageHeader::DictionaryBatch => return Err(bad("dictionary-encoded columns are not supported".into())),
                _ => {}
            }
            pos = end;
        }
        // A stream may end where its writer closed it, marker or not (the IPC spec allows
        // both, and pyarrow reads either), but a file ends with its footer and magic: without
        // them it was cut short, and the batches after the cut would be lost without a word.
        if file_format && !(ended && b.len() >= 14 && b.ends_with(b"ARROW1")) {
            return Err(bad("an Arrow IPC file without its footer (it starts with ARROW1 but does not end with it): the file was cut short".into()));
        }
        let schema = schema.ok_or_else(|| bad("no schema message".into()))?;
        release(&map, 0..map.len());
        Ok(IpcShard { path: path.to_path_buf(), map: Arc::new(map), schema, columns, batches })
    }

    fn buffer(&self, r: &Range<usize>) -> Buffer {
        Buffer::from_slice_ref(&self.map[r.clone()])
    }

    fn decode(&self, batch: usize) -> Result<RecordBatch> {
        guarded(&self.path, &format!("record batch {batch}"), || self.decode_unguarded(batch))
    }

    fn decode_unguarded(&self, batch: usize) -> Result<RecordBatch> {
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
    /// The schema's top-level column names.
    columns: Vec<String>,
}

impl ParquetShard {
    fn open(path: &Path) -> Result<Self> {
        use parquet::file::reader::{FileReader, SerializedFileReader};
        let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let (groups, columns) = guarded(path, "Parquet footer", || {
            let r = SerializedFileReader::new(f).map_err(|e| Error::data(path, format!("not a readable Parquet file: {e}")))?;
            let m = r.metadata();
            let columns = m.file_metadata().schema_descr().root_schema().get_fields().iter().map(|f| f.name().to_string()).collect();
            Ok((m.row_groups().iter().map(|g| g.num_rows().max(0) as usize).collect(), columns))
        })?;
        Ok(ParquetShard { path: path.to_path_buf(), groups, columns })
    }

    fn decode(&self, group: usize) -> Result<RecordBatch> {
        guarded(&self.path, &format!("row group {group}"), || self.decode_unguarded(group))
    }

    fn decode_unguarded(&self, group: usize) -> Result<RecordBatch> {
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

/// JSON lines: one block per 1024 lines, found by a single scan for newlines. Or a file that
/// is one JSON array of records (what `to_json(lines=False)` and Stanford's
/// `alpaca_data.json` hold, and `datasets`' json loader reads): one block per 1024 elements,
/// found by one scan of its brackets and strings, each element parsed where it lies.
struct JsonlShard {
    path: PathBuf,
    map: Arc<memmap2::Mmap>,
    blocks: Vec<JsonBlock>,
    /// The file is one JSON array; a block's range runs from its first element's start to
    /// its last one's end.
    array: bool,
}

/// Byte range, row count and the 1-based line number of the range's first line.
type JsonBlock = (Range<usize>, usize, u64);

const JSONL_BLOCK: usize = 1024;
const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// A line that holds no record (blank lines between records are allowed).
fn blank(line: &[u8]) -> bool {
    line.iter().all(|b| b.is_ascii_whitespace())
}

impl JsonlShard {
    /// `may_be_array`: a `.json` file, which may hold one JSON array instead of lines.
    fn open(path: &Path, may_be_array: bool) -> Result<Self> {
        let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let len = f.metadata().map_err(|e| Error::io(path, e))?.len();
        // SAFETY: read-only map of a file we do not modify while training.
        let map = if len == 0 { None } else { Some(unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::io(path, e))?) };
        let mut blocks = Vec::new();
        if let Some(m) = &map {
            // Every line of a UTF-16 file is "invalid UTF-8": say what the file is instead.
            if m.starts_with(b"\xFF\xFE") || m.starts_with(b"\xFE\xFF") {
                return Err(Error::data(path, "is UTF-16 (it starts with a UTF-16 byte-order mark); JSON lines must be UTF-8 (convert it, e.g. with `iconv -f UTF-16 -t UTF-8`)"));
            }
            // Editors on Windows write a UTF-8 byte-order mark; it is not part of line 1.
            let body = if m.starts_with(UTF8_BOM) { UTF8_BOM.len() } else { 0 };
            if may_be_array && is_one_array(&m[body..]) {
                let blocks = array_blocks(m, body).map_err(|why| Error::data(path, format!("is a JSON array of records, but {why}")))?;
                release(m, 0..m.len());
                return Ok(JsonlShard { path: path.to_path_buf(), map: Arc::new(map.expect("mapped")), blocks, array: true });
            }
            let (mut start, mut lines, mut pos) = (body, 0usize, body);
            let (mut line_no, mut first_line) = (0u64, 1u64);
            let mut released = 0usize;
            for line in m[body..].split(|&b| b == b'\n') {
                // Keep the scan itself from making the whole file resident.
                if pos - released > 32 << 20 {
                    release(m, released..pos);
                    released = pos;
                }
                line_no += 1;
                let end = pos + line.len();
                if !blank(line) {
                    lines += 1;
                }
                pos = end + 1;
                if lines == JSONL_BLOCK {
                    blocks.push((start..end.min(m.len()), lines, first_line));
                    start = pos.min(m.len());
                    first_line = line_no + 1;
                    lines = 0;
                }
            }
            if lines > 0 {
                blocks.push((start..m.len(), lines, first_line));
            }
            release(m, 0..m.len());
        }
        let map = match map {
            Some(m) => Arc::new(m),
            None => Arc::new(memmap2::MmapOptions::new().len(0).map_anon().map_err(|e| Error::io(path, e))?.make_read_only().map_err(|e| Error::io(path, e))?),
        };
        Ok(JsonlShard { path: path.to_path_buf(), map, blocks, array: false })
    }

    /// Lines of a block as JSON objects; a line that is not one becomes `JsonRow::Bad` with
    /// the reason, reported per row by the format code.
    fn decode(&self, block: usize) -> Result<Vec<(u64, JsonRow)>> {
        let (range, _, first_line) = self.blocks[block].clone();
        let bytes = &self.map[range.clone()];
        let rows = if self.array {
            let mut rows = Vec::new();
            // The block was scanned whole at open: its elements are well formed.
            array_elements(bytes, |r, newlines| rows.push((first_line + newlines, parse_line(&bytes[r])))).map_err(|why| Error::data(&self.path, why))?;
            rows
        } else {
            bytes.split(|&b| b == b'\n').zip(first_line..).filter(|(l, _)| !blank(l)).map(|(l, line)| (line, parse_line(l))).collect()
        };
        release(&self.map, range);
        Ok(rows)
    }
}

/// Whether `b` (a `.json` file's bytes) is one JSON array rather than JSON lines: it opens
/// with `[`, and its first line is not a whole JSON value on its own (JSON lines whose first
/// record is an array; a one-line array is both, and read as the array).
fn is_one_array(b: &[u8]) -> bool {
    let Some(start) = b.iter().position(|c| !c.is_ascii_whitespace()) else { return false };
    if b[start] != b'[' {
        return false;
    }
    let line_end = b[start..].iter().position(|&c| c == b'\n').map_or(b.len(), |n| start + n);
    let rest_blank = b[line_end..].iter().all(|c| c.is_ascii_whitespace());
    if rest_blank {
        return true;
    }
    // JSON lines: the first line is a value of its own (an array record), or the next line
    // with anything on it is a whole object (the first a broken record; a pretty-printed
    // array's second line is a `{` alone).
    let whole = |l: &[u8]| serde_json::from_slice::<serde::de::IgnoredAny>(l).is_ok();
    let next = b[line_end..].split(|&c| c == b'\n').find(|l| !blank(l));
    !whole(&b[start..line_end]) && !next.is_some_and(|l| l.trim_ascii_start().starts_with(b"{") && whole(l))
}

/// The blocks of a file that is one JSON array (its `[` the first byte after `body`'s start
/// and whitespace): byte ranges of [`JSONL_BLOCK`] elements each, as [`JsonlShard::blocks`].
fn array_blocks(m: &memmap2::Mmap, body: usize) -> std::result::Result<Vec<JsonBlock>, String> {
    let open = body + m[body..].iter().position(|&b| b == b'[').expect("checked by the caller");
    let close = m.iter().rposition(|b| !b.is_ascii_whitespace()).filter(|&c| m[c] == b']' && c > open).ok_or("it does not end with `]` (cut short?)")?;
    let inner = open + 1..close;
    let line_of_open = 1 + m[..open].iter().filter(|&&b| b == b'\n').count() as u64;
    let (mut blocks, mut current): (Vec<JsonBlock>, Option<JsonBlock>) = (Vec::new(), None);
    let mut released = inner.start;
    array_elements(&m[inner.clone()], |r, newlines| {
        let (start, end) = (inner.start + r.start, inner.start + r.end);
        let c = current.get_or_insert((start..end, 0, line_of_open + newlines));
        c.0.end = end;
        c.1 += 1;
        if c.1 == JSONL_BLOCK {
            blocks.extend(current.take());
        }
        // Keep the scan itself from making the whole file resident.
        if end - released > 32 << 20 {
            release(m, released..end);
            released = end;
        }
    })?;
    blocks.extend(current);
    Ok(blocks)
}

/// Calls `each` with the byte range of every element of `b`, a run of JSON values separated
/// by commas (an array's inside), and the newlines before the element's start. Strings (with
/// their escapes) and nesting are followed so that only a top-level comma separates; the
/// elements themselves are parsed later, one at a time.
fn array_elements(b: &[u8], mut each: impl FnMut(Range<usize>, u64)) -> std::result::Result<(), String> {
    let mut strings = JsonStrings::default();
    let mut depth = 0usize;
    let (mut start, mut last, mut newlines, mut start_newlines) = (None::<usize>, 0usize, 0u64, 0u64);
    let mut count = 0usize;
    for (i, &c) in b.iter().enumerate() {
        let in_string = strings.step(c);
        match c {
            b'\n' if !in_string => newlines += 1,
            c if !in_string && c.is_ascii_whitespace() => {}
            b',' if !in_string && depth == 0 => {
                let s = start.take().ok_or_else(|| format!("element {} is empty (two commas, or a comma first)", count + 1))?;
                each(s..last + 1, start_newlines);
                count += 1;
            }
            _ => {
                if start.is_none() {
                    (start, start_newlines) = (Some(i), newlines);
                }
                match c {
                    _ if in_string => {}
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => depth = depth.checked_sub(1).ok_or_else(|| format!("its brackets do not balance (a `{}` closes nothing)", c as char))?,
                    _ => {}
                }
                last = i;
            }
        }
    }
    if strings.inside() || depth > 0 {
        return Err("it ends inside a record (an unclosed string or bracket; cut short?)".into());
    }
    match start {
        Some(s) => each(s..last + 1, start_newlines),
        None if count > 0 => return Err("it ends with a comma".into()),
        None => {}
    }
    Ok(())
}

fn parse_line(l: &[u8]) -> JsonRow {
    let s = match std::str::from_utf8(l) {
        Ok(s) => s,
        Err(e) => return JsonRow::Bad(format!("invalid UTF-8 at byte {} of the line", e.valid_up_to())),
    };
    // Python's json.dumps writes NaN, Infinity and -Infinity (not JSON) for float fields, and
    // `datasets` reads them: they are read as null, pandas' and datasets' missing value.
    let parsed = serde_json::from_str::<serde_json::Value>(s).or_else(|e| match python_constants_as_null(s) {
        Some(fixed) => serde_json::from_str(&fixed).map_err(|_| e),
        None => Err(e),
    });
    match parsed {
        Ok(serde_json::Value::Object(o)) => JsonRow::Object(o),
        Ok(other) => {
            let kind = match other {
                serde_json::Value::Array(_) => "an array",
                serde_json::Value::String(_) => "a string",
                serde_json::Value::Number(_) => "a number",
                serde_json::Value::Bool(_) => "a boolean",
                _ => "null",
            };
            JsonRow::Bad(format!("expected a JSON object with the record's fields, got {kind}"))
        }
        Err(e) => {
            // serde_json says "at line 1 column N" (of this line alone): give the column only,
            // so it cannot be mistaken for the file's line number.
            let text = e.to_string();
            let msg = text.rsplit_once(" at line ").map_or(text.as_str(), |(m, _)| m);
            JsonRow::Bad(format!("not valid JSON: {msg} (column {})", e.column()))
        }
    }
}

/// `s` with Python's `NaN`, `Infinity` and `-Infinity` outside strings written as `null`;
/// `None` where it has none.
fn python_constants_as_null(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let (mut out, mut i, mut found) = (Vec::with_capacity(b.len()), 0, false);
    let mut strings = JsonStrings::default();
    while i < b.len() {
        // (The constants hold no quote, so the lexer need not see them.)
        if !strings.inside() {
            if let Some(t) = ["-Infinity", "Infinity", "NaN"].into_iter().find(|t| b[i..].starts_with(t.as_bytes())) {
                out.extend_from_slice(b"null");
                i += t.len();
                found = true;
                continue;
            }
        }
        strings.step(b[i]);
        out.push(b[i]);
        i += 1;
    }
    // Only ASCII was replaced, on character boundaries: still UTF-8.
    found.then(|| String::from_utf8(out).expect("UTF-8 in, UTF-8 out"))
}

/// Where a JSON text's string literals are, byte by byte: what [`array_elements`] and
/// [`python_constants_as_null`] must not look inside (a `,`, `]` or `NaN` in a string is text).
#[derive(Default)]
struct JsonStrings {
    inside: bool,
    escaped: bool,
}

impl JsonStrings {
    /// Take byte `c`; whether it is part of a string literal (its quotes included).
    fn step(&mut self, c: u8) -> bool {
        match (self.inside, c) {
            (true, _) if self.escaped => self.escaped = false,
            (true, b'\\') => self.escaped = true,
            (true, b'"') => self.inside = false,
            (true, _) => {}
            (false, b'"') => self.inside = true,
            (false, _) => return false,
        }
        true
    }

    /// Whether the next byte is inside a string literal.
    fn inside(&self) -> bool {
        self.inside
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
            Some(x @ ("jsonl" | "json")) => Ok(Shard::Jsonl(JsonlShard::open(path, x == "json")?)),
            Some("arrow") | None => Ok(Shard::Ipc(IpcShard::open(path)?)),
            Some(x @ ("gz" | "bz2" | "xz" | "zst" | "zip" | "lz4")) => {
                Err(Error::data(path, format!("is compressed (.{x}); decompress it first: data files are read in place, as .jsonl, .json, .parquet or .arrow")))
            }
            Some(x) => Err(Error::data(path, format!("a .{x} file is not a data format this reads (.jsonl, .json, .parquet, .arrow)"))),
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
    /// Column names from the file's schema, where it has one (not JSON lines).
    fn schema_columns(&self) -> Option<&[String]> {
        match self {
            Shard::Ipc(s) => Some(&s.columns),
            Shard::Parquet(s) => Some(&s.columns),
            Shard::Jsonl(_) => None,
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
    /// The pass over the dataset it was read in: a shuffle buffer never mixes two.
    /// (Checkpoints from before it was recorded read 0, which costs one early drain.)
    #[serde(default)]
    pub epoch: u64,
}

/// One row of a block.
pub enum Row<'a> {
    Arrow { batch: &'a RecordBatch, row: usize },
    /// A JSON line (1-based `line` in its file) holding an object.
    Json { line: u64, fields: &'a serde_json::Map<String, serde_json::Value> },
    /// A JSON line that holds no record, and why.
    BadLine { line: u64, msg: &'a str },
}

/// A row and where it came from.
pub struct RowRef<'a> {
    pub row: Row<'a>,
    pub file: &'a Path,
    /// 0-based row index within the dataset (across shards).
    pub index: u64,
    /// 0-based row index within its file (what messages name: the file is named with it).
    pub file_row: u64,
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
    /// The files the rows are read from, in reading order.
    pub fn files(&self) -> Vec<PathBuf> {
        self.shards.iter().map(|s| s.path().to_path_buf()).collect()
    }

    pub fn open_all(specs: &[PathBuf], split: Split) -> Result<Self> {
        let mut shards = Vec::new();
        let mut chosen = split.chose_on_hub;
        for spec in specs {
            let (files, chose) = shard_files_and_split(spec, split)?;
            chosen |= chose;
            for f in files {
                if !f.is_file() {
                    return Err(Error::data(&f, "listed in state.json but missing"));
                }
                shards.push(Shard::open(&f)?);
            }
        }
        // data.split applies to the entries that have splits. Where none has any, their rows
        // are the one split `datasets` calls train; any other name names nothing, and reading
        // every row anyway trained on what was asked to be left out.
        if let (Some(name), true, false) = (split.name, split.by_data_split(), chosen || split.name == Some("train")) {
            let what = if specs.len() == 1 { "the data source has no" } else { "none of the data sources has" };
            return Err(Error::data(
                &specs[0],
                format!("data.split = \"{name}\", but {what} splits (a single file, a single `datasets` Dataset, or a folder whose file names say none): its rows are all one split, `train` as `datasets` names it; drop data.split"),
            ));
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
        Self::open_all(&[path.to_path_buf()], Split::eval(None))
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

    /// Column names of the first block with a valid record.
    pub fn peek_columns(&mut self) -> Result<Vec<String>> {
        Ok(self.columns_and_file()?.0)
    }

    /// Column names and the file they were read from: the first file's that has any
    /// ([`Self::file_columns`]); where none has, an error saying why (a broken or non-object
    /// line is a bad record, not what the columns are).
    pub fn columns_and_file(&mut self) -> Result<(Vec<String>, PathBuf)> {
        for f in 0..self.shards.len() {
            if let Some(cols) = self.file_columns(f)? {
                return Ok((cols, self.shards[f].path().to_path_buf()));
            }
        }
        for f in 0..self.shards.len() {
            for b in 0..self.blocks[f].len() {
                if self.blocks[f][b] > 0 {
                    if let Some(m) = self.block(f, b)?.first_bad_line() {
                        return Err(Error::data(self.shards[f].path(), format!("no line is a JSON object with a record's fields (e.g. {m})")));
                    }
                }
            }
        }
        Err(Error::data(self.first_file(), "dataset has no rows"))
    }

    /// The columns of file `f`: its schema's (Arrow, Parquet), or the keys of the valid
    /// records of its first JSON-lines block that has one; None where it has no rows or no
    /// record.
    fn file_columns(&mut self, f: usize) -> Result<Option<Vec<String>>> {
        if let Some(cols) = self.shards[f].schema_columns().filter(|_| self.blocks[f].iter().any(|&n| n > 0)) {
            return Ok(Some(cols.to_vec()));
        }
        for b in 0..self.blocks[f].len() {
            if self.blocks[f][b] > 0 {
                if let Some(cols) = self.block(f, b)?.columns() {
                    return Ok(Some(cols));
                }
            }
        }
        Ok(None)
    }

    /// The columns of each file that has a record, with the file ([`Self::file_columns`]).
    /// Every file of a list is checked when the loader opens, not only the first: the second
    /// file's missing column otherwise surfaced rows into training, and the run stopped
    /// without a checkpoint.
    pub fn columns_by_file(&mut self) -> Result<Vec<(Vec<String>, PathBuf)>> {
        let mut out = Vec::new();
        for f in 0..self.shards.len() {
            if let Some(cols) = self.file_columns(f)? {
                out.push((cols, self.shards[f].path().to_path_buf()));
            }
        }
        Ok(out)
    }

    /// Fail unless the data has every column in `names` (as found by [`Self::columns_and_file`]),
    /// naming the missing ones, the file, and the columns it does have.
    pub fn require_columns(&mut self, names: &[&str]) -> Result<()> {
        let (have, file) = self.columns_and_file()?;
        let missing: Vec<String> = names.iter().filter(|n| !have.iter().any(|h| h == *n)).map(|n| format!("`{n}`")).collect();
        if missing.is_empty() {
            return Ok(());
        }
        let s = if missing.len() == 1 { "" } else { "s" };
        Err(Error::data(file, format!("no {} column{s} (needed: {}); columns are: {}", missing.join(", "), names.join(", "), have.join(", "))))
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
        let pos = RowPos { file: f, batch: b, row: self.cur.row, index: self.starts[f][b] + self.cur.row as u64, epoch: self.cur.epoch };
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
        // A block that decodes to fewer rows than its header or footer promised (a damaged
        // file) is an error here, not an out-of-bounds panic in a column accessor.
        let short = || Error::data(file, format!("block {} holds fewer rows than its metadata says (damaged file?)", pos.batch));
        let row = match &self.cached {
            Some((_, _, Block::Arrow(b))) if pos.row < b.num_rows() => Row::Arrow { batch: b, row: pos.row },
            Some((_, _, Block::Json(rows))) => match rows.get(pos.row).ok_or_else(short)? {
                (line, JsonRow::Object(fields)) => Row::Json { line: *line, fields },
                (line, JsonRow::Bad(msg)) => Row::BadLine { line: *line, msg },
            },
            Some(_) => return Err(short()),
            None => return Err(Error::data(file, "internal: block cache empty")),
        };
        let file_row = pos.index - self.starts[pos.file].first().copied().unwrap_or(0);
        Ok(RowRef { row, file, index: pos.index, file_row })
    }
}

/// Said where messages have ShareGPT's keys instead of `role` and `content`.
const SHAREGPT: &str = " (they have `from` and `value`, ShareGPT's layout: convert them to `role` and `content` with the roles system, user and assistant, the layout transformers' chat templates and TRL read)";

impl RowRef<'_> {
    /// "row N" (N counted in the row's own file, which messages name with it: across a list
    /// of sources or a folder's shards a dataset-wide count pointed at the wrong row), with the
    /// file's line number for JSON lines: "row N (line L)".
    pub fn at(&self) -> String {
        format!("row {}", self.number())
    }

    /// [`Self::at`] without the word "row": "N" or "N (line L)".
    pub fn number(&self) -> String {
        match &self.row {
            Row::Json { line, .. } | Row::BadLine { line, .. } => format!("{} (line {line})", self.file_row),
            Row::Arrow { .. } => self.file_row.to_string(),
        }
    }

    fn err(&self, column: &str, msg: impl std::fmt::Display) -> Error {
        Error::data(self.file, format!("{}: column `{column}`: {msg}", self.at()))
    }

    /// A JSON line that holds no record: why, naming the row and line.
    pub fn bad_line(&self) -> Option<String> {
        match &self.row {
            Row::BadLine { msg, .. } => Some(format!("{}: {msg}", self.at())),
            _ => None,
        }
    }

    /// The error for reading any cell of a line that holds no record (rather than reading it
    /// as empty cells).
    fn bad_line_err(&self) -> Error {
        Error::data(self.file, self.bad_line().unwrap_or_else(|| self.at()))
    }

    pub fn has(&self, column: &str) -> bool {
        match &self.row {
            Row::Arrow { batch, .. } => batch.column_by_name(column).is_some(),
            Row::Json { fields, .. } => fields.get(column).is_some(),
            Row::BadLine { .. } => false,
        }
    }

    /// The cell of an Arrow column of JSON text (`arrow.json`, see [`holds_json_text`]),
    /// parsed; `None` for a JSON line or a column of any other type.
    fn json_text_cell(&self, column: &str) -> Result<Option<serde_json::Value>> {
        let Row::Arrow { batch, row } = &self.row else { return Ok(None) };
        let schema = batch.schema();
        let Some((i, _)) = schema.column_with_name(column).filter(|(_, f)| holds_json_text(f)) else { return Ok(None) };
        arrow_json_value(batch.column(i).as_ref(), true, *row).map(Some).map_err(|t| self.err(column, format!("holds {t}")))
    }

    /// An integer list cell (`list<int*>`, `large_list<int*>`, or a JSON array of integers).
    pub fn int_list(&self, column: &str) -> Result<Vec<i64>> {
        if let Some(v) = self.json_text_cell(column)? {
            return self.int_list_from_json(column, Some(&v));
        }
        match &self.row {
            Row::BadLine { .. } => Err(self.bad_line_err()),
            Row::Json { fields, .. } => self.int_list_from_json(column, fields.get(column)),
            Row::Arrow { batch, row } => {
                let col = batch.column_by_name(column).ok_or_else(|| self.err(column, "missing"))?;
                if null_at(col.as_ref(), *row) {
                    return Err(self.err(column, "is null"));
                }
                let values = list_cell(col, *row)
                    .ok_or_else(|| self.err(column, format!("expected a list of integers, got {}", col.data_type())))?;
                // `values()` of a primitive array reads a null slot as whatever its buffer
                // holds (usually 0): a null must not become a token id.
                if values.null_count() > 0 {
                    return Err(self.err(column, format!("holds {} null value(s); expected integers", values.null_count())));
                }
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

    fn int_list_from_json(&self, column: &str, v: Option<&serde_json::Value>) -> Result<Vec<i64>> {
        let a = v.ok_or_else(|| self.err(column, "missing"))?;
        let a = a.as_array().ok_or_else(|| self.err(column, format!("expected a list of integers, got {a}")))?;
        a.iter().map(|x| x.as_i64().ok_or_else(|| self.err(column, format!("expected integers, got {x}")))).collect()
    }

    /// Any cell as JSON (an Arrow struct as an object, a list as an array); `None` when the
    /// column is absent or the cell is null.
    pub fn json(&self, column: &str) -> Result<Option<serde_json::Value>> {
        match &self.row {
            Row::BadLine { .. } => Err(self.bad_line_err()),
            Row::Json { fields, .. } => Ok(fields.get(column).filter(|v| !v.is_null()).cloned()),
            Row::Arrow { batch, row } => {
                let schema = batch.schema();
                let Some((i, f)) = schema.column_with_name(column) else { return Ok(None) };
                let v = arrow_json_value(batch.column(i).as_ref(), holds_json_text(f), *row)
                    .map_err(|t| self.err(column, format!("holds {t}, which has no JSON form")))?;
                Ok(Some(v).filter(|v| !v.is_null()))
            }
        }
    }

    /// A string cell; `None` when the column is absent or the cell is null.
    pub fn string(&self, column: &str) -> Result<Option<String>> {
        if let Some(v) = self.json_text_cell(column)? {
            return self.string_from_json(column, Some(&v));
        }
        match &self.row {
            Row::BadLine { .. } => Err(self.bad_line_err()),
            Row::Json { fields, .. } => self.string_from_json(column, fields.get(column)),
            Row::Arrow { batch, row } => {
                let Some(col) = batch.column_by_name(column) else { return Ok(None) };
                if null_at(col.as_ref(), *row) {
                    return Ok(None);
                }
                match text_cell(col.as_ref(), *row) {
                    Some(s) => Ok(Some(s)),
                    None => Err(self.err(column, format!("expected a string, got {}", col.data_type()))),
                }
            }
        }
    }

    fn string_from_json(&self, column: &str, v: Option<&serde_json::Value>) -> Result<Option<String>> {
        match v {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(self.err(column, format!("expected a string, got {other}"))),
        }
    }

    /// A string cell that must be there: an error naming the file, row and column when the
    /// column is absent or the cell null (where reading it as "" would silently change what
    /// the row says, e.g. an expected answer in `finetune eval`).
    pub fn required_string(&self, column: &str) -> Result<String> {
        self.string(column)?.ok_or_else(|| self.err(column, "is missing or null"))
    }

    /// A list of {role, content} messages (`list<struct<role, content>>` or a JSON array).
    /// An Arrow cell is read as the JSON value `datasets` would hand Python (every message
    /// with every key any message has, null where it has none), so both read alike.
    pub fn messages(&self, column: &str) -> Result<Option<Vec<crate::chat::Message>>> {
        use crate::chat::Message;
        let cell = match &self.row {
            Row::BadLine { .. } => return Err(self.bad_line_err()),
            Row::Json { fields, .. } => fields.get(column).cloned(),
            Row::Arrow { batch, row } => {
                let schema = batch.schema();
                let Some((i, f)) = schema.column_with_name(column) else { return Ok(None) };
                let json = holds_json_text(f);
                let col = batch.column(i);
                if !json && !null_at(col.as_ref(), *row) && list_cell(col, *row).is_none() {
                    return Err(self.err(column, format!("expected a list of {{role, content}} structs, got {}", col.data_type())));
                }
                Some(arrow_json_value(col.as_ref(), json, *row).map_err(|t| self.err(column, format!("a message holds {t}, which a chat template cannot read")))?)
            }
        };
        match cell {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .map(|m| {
                    let role = m.get("role").and_then(|r| r.as_str()).ok_or_else(|| {
                        let sharegpt = m.get("from").is_some() && m.get("value").is_some();
                        self.err(column, format!("a message has no string `role`{}", if sharegpt { SHAREGPT } else { "" }))
                    })?;
                    let mut msg = match m.get("content") {
                        Some(serde_json::Value::String(c)) => Message::new(role, c),
                        // A tool-call turn: the template decides what None renders as.
                        Some(serde_json::Value::Null) if role == "assistant" => Message::without_content(role),
                        _ => return Err(self.err(column, "a message has no string `content` (only an assistant turn's may be null)")),
                    };
                    if let Some(o) = m.as_object() {
                        msg.extra.extend(o.iter().filter(|(k, _)| *k != "role" && *k != "content").map(|(k, v)| (k.clone(), v.clone())));
                    }
                    Ok(msg)
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(other) => Err(self.err(column, format!("expected a list of messages, got {other}"))),
        }
    }
}

/// Whether an Arrow field holds JSON text: the canonical `arrow.json` extension type, as
/// `datasets` 5 stores a `Json` feature (what `load_dataset("json")` infers for a field whose
/// shape differs between records: tool-call arguments, tool schemas, messages with different
/// keys) in `save_to_disk` and Parquet files, and as a Parquet column of the JSON logical type
/// reads. Its cells are JSON documents to parse, never strings to hand a template.
fn holds_json_text(f: &arrow_schema::Field) -> bool {
    f.metadata().get("ARROW:extension:name").is_some_and(|n| n == "arrow.json")
}

/// Whether element `i` is null. A column of Arrow's null type (what `datasets` types a column
/// that is None in every record, e.g. an alpaca `input` never given) is null everywhere, though
/// arrow's `is_null` says false for it (it has no validity buffer).
fn null_at(a: &dyn Array, i: usize) -> bool {
    a.data_type() == &arrow_schema::DataType::Null || a.is_null(i)
}

/// Element `i` (not null) of a string array: utf8, large_utf8, utf8_view, or a dictionary of
/// those (what a Parquet file of categorical or dictionary-typed columns reads as); None for
/// any other type.
fn text_cell(a: &dyn Array, i: usize) -> Option<String> {
    use arrow_schema::DataType as T;
    match a.data_type() {
        T::Utf8 => Some(a.as_string::<i32>().value(i).to_string()),
        T::LargeUtf8 => Some(a.as_string::<i64>().value(i).to_string()),
        T::Utf8View => Some(a.as_string_view().value(i).to_string()),
        T::Dictionary(_, v) if matches!(**v, T::Utf8 | T::LargeUtf8 | T::Utf8View) => {
            let one = arrow_cast::cast(&a.slice(i, 1), &T::Utf8).ok()?;
            Some(one.as_string::<i32>().value(0).to_string())
        }
        _ => None,
    }
}

/// Element `i` of an Arrow array as the JSON value `datasets` would hand a template in
/// Python (strings, numbers, booleans, lists and structs, null; other types as text).
/// `json`: the array holds JSON text ([`holds_json_text`]), parsed here.
fn arrow_json_value(a: &dyn Array, json: bool, i: usize) -> std::result::Result<serde_json::Value, String> {
    use arrow_array::types::{Float32Type, Float64Type};
    use arrow_schema::DataType as T;
    use serde_json::Value as V;
    if null_at(a, i) {
        return Ok(V::Null);
    }
    if let Some(t) = text_cell(a, i) {
        return match json {
            true => serde_json::from_str(&t).map_err(|e| format!("arrow.json text that is not JSON ({e})")),
            false => Ok(V::String(t)),
        };
    }
    macro_rules! num {
        ($t:ty) => {
            serde_json::json!(a.as_primitive::<$t>().value(i))
        };
    }
    Ok(match a.data_type() {
        T::Null => V::Null,
        T::Boolean => V::Bool(a.as_boolean().value(i)),
        T::Int8 => num!(Int8Type),
        T::Int16 => num!(Int16Type),
        T::Int32 => num!(Int32Type),
        T::Int64 => num!(Int64Type),
        T::UInt8 => num!(UInt8Type),
        T::UInt16 => num!(UInt16Type),
        T::UInt32 => num!(UInt32Type),
        T::UInt64 => num!(UInt64Type),
        T::Float32 => num!(Float32Type),
        T::Float64 => num!(Float64Type),
        T::List(f) | T::LargeList(f) => {
            let l: arrow_array::ArrayRef = if let Some(l) = a.as_list_opt::<i32>() { l.value(i) } else { a.as_list::<i64>().value(i) };
            V::Array((0..l.len()).map(|j| arrow_json_value(l.as_ref(), holds_json_text(f), j)).collect::<std::result::Result<_, _>>()?)
        }
        T::Struct(_) => {
            let st = a.as_struct();
            let mut o = serde_json::Map::new();
            for (f, c) in st.fields().iter().zip(st.columns()) {
                o.insert(f.name().clone(), arrow_json_value(c.as_ref(), holds_json_text(f), i)?);
            }
            V::Object(o)
        }
        // Anything else (timestamps, decimals, binary, ...) as arrow prints it: what a
        // template would print of the Python value, near enough, and never a reason to
        // refuse a record whose template does not read it.
        _ => {
            let f = arrow_cast::display::ArrayFormatter::try_new(a, &arrow_cast::display::FormatOptions::default()).map_err(|e| e.to_string())?;
            V::String(f.value(i).to_string())
        }
    })
}

/// The values of a `list` / `large_list` cell.
fn list_cell(col: &arrow_array::ArrayRef, row: usize) -> Option<arrow_array::ArrayRef> {
    if let Some(l) = col.as_list_opt::<i32>() {
        Some(l.value(row))
    } else {
        col.as_list_opt::<i64>().map(|l| l.value(row))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn message_fields_of_other_arrow_types_reach_the_template_as_text() {
        let ts = arrow_array::TimestampMillisecondArray::from(vec![Some(86_400_000), None]);
        assert_eq!(super::arrow_json_value(&ts, false, 0).unwrap(), serde_json::json!("1970-01-02T00:00:00"));
        assert_eq!(super::arrow_json_value(&ts, false, 1).unwrap(), serde_json::Value::Null);
        let n = arrow_array::Int32Array::from(vec![7]);
        assert_eq!(super::arrow_json_value(&n, false, 0).unwrap(), serde_json::json!(7));
    }
}
