//! JSONL (and JSON array) shards: line offsets scanned once at open, one block per 1024 lines.
use super::{release, JsonRow};
use crate::error::{Error, Result};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// JSON lines: one block per 1024 lines, found by a single scan for newlines. Or a file that
/// is one JSON array of records (what `to_json(lines=False)` and Stanford's
/// `alpaca_data.json` hold, and `datasets`' json loader reads): one block per 1024 elements,
/// found by one scan of its brackets and strings, each element parsed where it lies.
pub(super) struct JsonlShard {
    pub(super) path: PathBuf,
    map: Arc<memmap2::Mmap>,
    pub(super) blocks: Vec<JsonBlock>,
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
    pub(super) fn open(path: &Path, may_be_array: bool) -> Result<Self> {
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
    pub(super) fn decode(&self, block: usize) -> Result<Vec<(u64, JsonRow)>> {
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
