//! Arrow IPC shards (stream or file format), memory-mapped, their messages scanned at open and
//! checked before arrow-ipc decodes them.
use super::{guarded, release};
use crate::error::{Error, Result};
use arrow_array::RecordBatch;
use arrow_buffer::Buffer;
use arrow_ipc::MessageHeader;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

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

/// One memory-mapped Arrow IPC file with the byte ranges of its messages.
pub(super) struct IpcShard {
    pub(super) path: PathBuf,
    map: Arc<memmap2::Mmap>,
    schema: Range<usize>,
    /// The schema's top-level column names.
    pub(super) columns: Vec<String>,
    /// (byte range of the whole message, rows)
    pub(super) batches: Vec<(Range<usize>, usize)>,
}

fn read_u32(b: &[u8], at: usize) -> Option<u32> {
    b.get(at..at + 4).map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

impl IpcShard {
    pub(super) fn open(path: &Path) -> Result<IpcShard> {
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

    pub(super) fn decode(&self, batch: usize) -> Result<RecordBatch> {
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
