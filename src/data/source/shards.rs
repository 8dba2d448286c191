//! A shard of any format and its decoded blocks; third-party decoders run guarded.
use super::{IpcShard, JsonlShard, ParquetShard};
use crate::error::{Error, Result};
use arrow_array::RecordBatch;
use std::path::Path;

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
pub(super) fn guarded<T>(path: &Path, what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
            Err(Error::data(path, format!("{what}: malformed data ({msg}); the file is damaged or not what its name says")))
        }
    }
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
    pub(super) fn columns(&self) -> Option<Vec<String>> {
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
    pub(super) fn first_bad_line(&self) -> Option<String> {
        match self {
            Block::Json(rows) => rows.iter().find_map(|(line, r)| match r {
                JsonRow::Bad(m) => Some(format!("line {line}: {m}")),
                JsonRow::Object(_) => None,
            }),
            Block::Arrow(_) => None,
        }
    }
}

pub(super) enum Shard {
    Ipc(IpcShard),
    Parquet(ParquetShard),
    Jsonl(JsonlShard),
}

impl Shard {
    pub(super) fn open(path: &Path) -> Result<Shard> {
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
    pub(super) fn path(&self) -> &Path {
        match self {
            Shard::Ipc(s) => &s.path,
            Shard::Parquet(s) => &s.path,
            Shard::Jsonl(s) => &s.path,
        }
    }
    pub(super) fn block_rows(&self) -> Vec<usize> {
        match self {
            Shard::Ipc(s) => s.batches.iter().map(|b| b.1).collect(),
            Shard::Parquet(s) => s.groups.clone(),
            Shard::Jsonl(s) => s.blocks.iter().map(|b| b.1).collect(),
        }
    }
    /// Column names from the file's schema, where it has one (not JSON lines).
    pub(super) fn schema_columns(&self) -> Option<&[String]> {
        match self {
            Shard::Ipc(s) => Some(&s.columns),
            Shard::Parquet(s) => Some(&s.columns),
            Shard::Jsonl(_) => None,
        }
    }
    pub(super) fn decode(&self, block: usize) -> Result<Block> {
        Ok(match self {
            Shard::Ipc(s) => Block::Arrow(s.decode(block)?),
            Shard::Parquet(s) => Block::Arrow(s.decode(block)?),
            Shard::Jsonl(s) => Block::Json(s.decode(block)?),
        })
    }
}
