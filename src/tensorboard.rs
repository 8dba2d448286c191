//! TensorBoard event files for the training scalars (loss, lr, ...), written without a
//! protobuf dependency.
//!
//! TensorBoard reads `events.out.tfevents.*` files: TFRecord framing around serialized
//! `tensorflow.Event` protos. Scalars need only three small messages, so they are encoded by
//! hand here rather than pulling in a protobuf crate, generated code and a build step for them. `scripts/check_tensorboard.py` proves the `tensorboard` package's own reader
//! reads these files back value for value.
//!
//! The fields used (tensorboard/compat/proto/event.proto and summary.proto):
//!
//! ```text
//! Event   { double wall_time = 1; int64 step = 2;
//!           oneof what { string file_version = 3; Summary summary = 5; } }
//! Summary { repeated Value value = 1; }
//! Value   { string tag = 1; oneof value { float simple_value = 2; } }
//! ```
//!
//! A TFRecord is: u64 LE payload length, u32 LE masked CRC-32C of those 8 bytes, the payload,
//! u32 LE masked CRC-32C of the payload.
//!
//! Resuming a run: [`EventWriter::resume`] (or [`rewrite_upto`] then [`EventWriter::create`])
//! drops the events after the checkpoint's step, so the resumed run's events continue the
//! curve instead of drawing a second one over it.

use crate::error::{Error, Result};
use std::collections::HashSet;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The first event of every file says which format version follows; TensorBoard expects it.
const FILE_VERSION: &str = "brain.Event:2";
/// TensorBoard loads every file whose name contains this (`io_wrapper.IsTensorFlowEventsFile`),
/// so our own temporary file must not.
const EVENTS_MARK: &str = "tfevents";
const REWRITE_TMP: &str = ".events-rewrite.tmp";

/// Appends events to one event file.
///
/// Every call hands its whole event to the OS in one write, so a killed process loses only the
/// event it was writing; a failed write (a full disk) is cut off again, so the file never keeps
/// half a record that would stop TensorBoard's reader at that point.
pub struct EventWriter {
    path: PathBuf,
    file: File,
    /// Length of the file up to the last complete record.
    len: u64,
}

impl EventWriter {
    /// Create `dir` and a new event file in it, named as TensorFlow and PyTorch name theirs.
    pub fn create(dir: &Path, wall_time: f64) -> Result<EventWriter> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let (path, file) = new_event_file(dir, wall_time)?;
        let mut w = EventWriter { path, file, len: 0 };
        w.write_event(&Event::version(wall_time))?;
        Ok(w)
    }

    /// Keep the events of `dir` up to `step` (see [`rewrite_upto`]) and continue that file, so a
    /// resumed run leaves one event file, as an uninterrupted run would.
    pub fn resume(dir: &Path, step: i64, wall_time: f64) -> Result<EventWriter> {
        match rewrite(dir, step)? {
            Some(path) => {
                let file = std::fs::OpenOptions::new().append(true).open(&path).map_err(|e| Error::io(&path, e))?;
                let len = file.metadata().map_err(|e| Error::io(&path, e))?.len();
                Ok(EventWriter { path, file, len })
            }
            None => Self::create(dir, wall_time),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One event holding all `values` (stored as f32, TensorBoard's scalar type).
    pub fn scalars(&mut self, step: i64, wall_time: f64, values: &[(&str, f64)]) -> Result<()> {
        if values.is_empty() {
            return Ok(());
        }
        let values = values.iter().map(|(t, v)| (t.to_string(), *v as f32)).collect();
        self.write_event(&Event { wall_time, step, file_version: None, values })
    }

    /// Force what was written to disk. Not needed against a killed process (every event already
    /// reached the OS), only against a machine that goes down.
    pub fn flush(&mut self) -> Result<()> {
        self.file.sync_data().map_err(|e| Error::io(&self.path, e))
    }

    fn write_event(&mut self, ev: &Event) -> Result<()> {
        let mut rec = Vec::with_capacity(128);
        frame(&encode_event(ev), &mut rec);
        if let Err(e) = self.file.write_all(&rec) {
            // The file is opened for appending, so cutting it back also puts the next record
            // where this one should have gone.
            let _ = self.file.set_len(self.len);
            return Err(Error::io(&self.path, e));
        }
        self.len += rec.len() as u64;
        Ok(())
    }
}

/// Seconds since the Unix epoch, the `wall_time` TensorBoard plots "relative" and "wall" axes by.
pub fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// Every scalar of one event file as (step, wall_time, tag, value), in file order. Both CRCs of
/// every record are checked; a corrupt or truncated record is an error naming the file and the
/// byte offset where the record starts.
pub fn read_scalars(path: &Path) -> Result<Vec<(i64, f64, String, f32)>> {
    let events = read_events(path, false)?;
    Ok(events.into_iter().flat_map(|ev| ev.values.into_iter().map(move |(tag, v)| (ev.step, ev.wall_time, tag, v))).collect())
}

/// Replace the event files of `dir` with one holding their scalar events of steps <= `step`,
/// each (step, tag) once (a later file wins, as it was written later). Nothing to do when
/// `dir` has no event files.
///
/// Dying at any point loses nothing: the new file is written in full under a name TensorBoard
/// ignores, synced, and renamed over the first (oldest) event file; only then are the others
/// deleted. Dying before the rename leaves the old files as they were; dying after it leaves
/// events twice until the next rewrite, which removes the duplicates. A torn last record (a
/// run killed mid-write, a full disk) is dropped, not an error: it is the step that was in
/// flight, which no checkpoint covers.
pub fn rewrite_upto(dir: &Path, step: i64) -> Result<()> {
    rewrite(dir, step).map(|_| ())
}

/// [`rewrite_upto`], returning the file now holding the events.
fn rewrite(dir: &Path, step: i64) -> Result<Option<PathBuf>> {
    let files = event_files(dir)?;
    let Some(first) = files.first() else { return Ok(None) };
    let mut version_time = None;
    let mut events = Vec::new();
    for f in &files {
        for ev in read_events(f, true)? {
            if ev.file_version.is_some() {
                version_time.get_or_insert(ev.wall_time);
            }
            if !ev.values.is_empty() {
                events.push(ev);
            }
        }
    }
    // Walk newest first so the last write of a (step, tag) is the one kept.
    let mut seen = HashSet::new();
    let mut kept = Vec::new();
    for mut ev in events.into_iter().rev().filter(|ev| ev.step <= step) {
        let s = ev.step;
        ev.values.retain(|(tag, _)| seen.insert((s, tag.clone())));
        if !ev.values.is_empty() {
            kept.push(ev);
        }
    }
    kept.reverse();

    let wall_time = version_time.or(kept.first().map(|e| e.wall_time)).unwrap_or(0.0);
    let mut bytes = Vec::new();
    frame(&encode_event(&Event::version(wall_time)), &mut bytes);
    for ev in &kept {
        frame(&encode_event(ev), &mut bytes);
    }
    let tmp = dir.join(REWRITE_TMP);
    // `create` truncates a temporary file left by a rewrite that died before its rename.
    if let Err(e) = File::create(&tmp).and_then(|mut f| f.write_all(&bytes)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io(&tmp, e));
    }
    // Taking the oldest name keeps TensorBoard's order (it reads a folder's files sorted by
    // name) right for event files created after this one.
    crate::fsutil::rename_durable(&tmp, first)?;
    for f in &files[1..] {
        match std::fs::remove_file(f) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::io(f, e)),
            _ => {}
        }
    }
    crate::fsutil::sync_dir(dir)?;
    Ok(Some(first.clone()))
}

/// The event files TensorBoard would load from `dir`, in the order it loads them.
fn event_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(dir, e)),
    };
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        if entry.file_name().to_string_lossy().contains(EVENTS_MARK) && entry.path().is_file() {
            files.push(entry.path());
        }
    }
    files.sort();
    Ok(files)
}

static FILE_SEQ: AtomicU64 = AtomicU64::new(0);

/// `events.out.tfevents.<seconds>.<host>.<pid>.<n>`, PyTorch's name. TensorBoard reads a
/// folder's files in name order, so the zero-padded time keeps that the order they were made.
fn new_event_file(dir: &Path, wall_time: f64) -> Result<(PathBuf, File)> {
    let secs = wall_time.max(0.0) as u64;
    let host = crate::fsutil::hostname();
    let pid = std::process::id();
    loop {
        let n = FILE_SEQ.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("events.out.{EVENTS_MARK}.{secs:010}.{host}.{pid}.{n}"));
        match std::fs::OpenOptions::new().append(true).create_new(true).open(&path) {
            Ok(f) => return Ok((path, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(Error::io(&path, e)),
        }
    }
}

// ------------------------------------------------------------------------------ records

#[derive(Debug, Default, Clone, PartialEq)]
struct Event {
    wall_time: f64,
    step: i64,
    file_version: Option<String>,
    values: Vec<(String, f32)>,
}

impl Event {
    fn version(wall_time: f64) -> Event {
        Event { wall_time, step: 0, file_version: Some(FILE_VERSION.into()), values: Vec::new() }
    }
}

const CRC_TABLE: [u32; 256] = crc_table();

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), TFRecord's checksum.
const fn crc_table() -> [u32; 256] {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { (c >> 1) ^ 0x82F6_3B78 } else { c >> 1 };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
}

pub fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc = CRC_TABLE[((crc ^ b as u32) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// TFRecord stores CRCs rotated and offset, because a CRC of data that itself holds CRCs is
/// weak (TensorFlow's `crc32c::Mask`).
fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn frame(payload: &[u8], out: &mut Vec<u8>) {
    let len = (payload.len() as u64).to_le_bytes();
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(payload);
    out.extend_from_slice(&masked_crc(payload).to_le_bytes());
}

/// Why a record could not be read: `torn` when the file ends inside it (what a killed writer
/// leaves), otherwise the bytes are wrong.
struct Bad {
    torn: bool,
    msg: String,
}

/// The payload of the record at the start of `rest`, and the record's length.
fn unframe(rest: &[u8]) -> std::result::Result<(&[u8], usize), Bad> {
    if rest.len() < 12 {
        return Err(Bad { torn: true, msg: format!("truncated record: the file ends {} bytes into a 12-byte header", rest.len()) });
    }
    let len_bytes = &rest[..8];
    if u32::from_le_bytes(rest[8..12].try_into().unwrap()) != masked_crc(len_bytes) {
        return Err(Bad { torn: false, msg: "CRC mismatch in the record's length header".into() });
    }
    let len = u64::from_le_bytes(len_bytes.try_into().unwrap());
    let have = (rest.len() - 12) as u64;
    if len.saturating_add(4) > have {
        return Err(Bad { torn: true, msg: format!("truncated record: {len} payload bytes and a 4-byte CRC announced, {have} bytes left") });
    }
    let payload = &rest[12..12 + len as usize];
    let crc = u32::from_le_bytes(rest[12 + len as usize..16 + len as usize].try_into().unwrap());
    if crc != masked_crc(payload) {
        return Err(Bad { torn: false, msg: format!("CRC mismatch in the record's {len}-byte payload") });
    }
    Ok((payload, 16 + len as usize))
}

fn corrupt(path: &Path, offset: usize, msg: &str) -> Error {
    Error::Config { path: path.to_path_buf(), msg: format!("bad TensorBoard event file: record at byte {offset}: {msg}") }
}

/// The events of one file. With `tolerate_torn_tail`, a last record the file ends inside, or a
/// zero-filled tail (what a crash can leave where the file grew but its data never reached the
/// disk), ends the file instead of being an error.
fn read_events(path: &Path, tolerate_torn_tail: bool) -> Result<Vec<Event>> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let mut events = Vec::new();
    let mut off = 0;
    while off < bytes.len() {
        match unframe(&bytes[off..]) {
            Ok((payload, used)) => {
                events.push(decode_event(payload).map_err(|m| corrupt(path, off, &m))?);
                off += used;
            }
            Err(b) if tolerate_torn_tail && (b.torn || bytes[off..].iter().all(|&x| x == 0)) => break,
            Err(b) => return Err(corrupt(path, off, &b.msg)),
        }
    }
    Ok(events)
}

// ----------------------------------------------------------------------------- protobuf

const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const FIXED32: u8 = 5;

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_key(out: &mut Vec<u8>, field: u32, wire: u8) {
    put_varint(out, (field as u64) << 3 | wire as u64);
}

fn put_len(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_key(out, field, LEN);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn encode_event(ev: &Event) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    put_key(&mut out, 1, FIXED64);
    out.extend_from_slice(&ev.wall_time.to_le_bytes());
    put_key(&mut out, 2, VARINT);
    // int64 is a plain two's-complement varint (not zigzag): a negative step takes 10 bytes.
    put_varint(&mut out, ev.step as u64);
    if let Some(v) = &ev.file_version {
        put_len(&mut out, 3, v.as_bytes());
    }
    if !ev.values.is_empty() {
        let mut summary = Vec::new();
        for (tag, v) in &ev.values {
            let mut value = Vec::with_capacity(tag.len() + 8);
            put_len(&mut value, 1, tag.as_bytes());
            put_key(&mut value, 2, FIXED32);
            value.extend_from_slice(&v.to_le_bytes());
            put_len(&mut summary, 1, &value);
        }
        put_len(&mut out, 5, &summary);
    }
    out
}

/// A protobuf message being read field by field.
struct Fields<'a> {
    buf: &'a [u8],
    pos: usize,
}

type Parsed<T> = std::result::Result<T, String>;

impl<'a> Fields<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Fields { buf, pos: 0 }
    }

    fn take(&mut self, n: u64) -> Parsed<&'a [u8]> {
        let left = (self.buf.len() - self.pos) as u64;
        if n > left {
            return Err(format!("protobuf field of {n} bytes runs past the end of its message ({left} left)"));
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn varint(&mut self) -> Parsed<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.take(1)?[0];
            v |= ((b & 0x7f) as u64) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err("protobuf varint longer than 10 bytes".into())
    }

    /// The next (field number, wire type), or None at the end of the message.
    fn key(&mut self) -> Parsed<Option<(u64, u8)>> {
        if self.pos == self.buf.len() {
            return Ok(None);
        }
        let k = self.varint()?;
        Ok(Some((k >> 3, (k & 7) as u8)))
    }

    fn len_delimited(&mut self) -> Parsed<&'a [u8]> {
        let n = self.varint()?;
        self.take(n)
    }

    /// Step over a field this reader has no use for (a newer writer may add some).
    fn skip(&mut self, wire: u8) -> Parsed<()> {
        match wire {
            VARINT => self.varint().map(|_| ()),
            FIXED64 => self.take(8).map(|_| ()),
            LEN => self.len_delimited().map(|_| ()),
            FIXED32 => self.take(4).map(|_| ()),
            w => Err(format!("protobuf wire type {w} is not one an Event uses")),
        }
    }
}

fn decode_event(payload: &[u8]) -> Parsed<Event> {
    let mut ev = Event::default();
    let mut f = Fields::new(payload);
    while let Some((field, wire)) = f.key()? {
        match (field, wire) {
            (1, FIXED64) => ev.wall_time = f64::from_le_bytes(f.take(8)?.try_into().unwrap()),
            (2, VARINT) => ev.step = f.varint()? as i64,
            (3, LEN) => {
                let v = f.len_delimited()?;
                ev.file_version = Some(String::from_utf8(v.to_vec()).map_err(|_| "file_version is not UTF-8")?);
            }
            // A message field seen twice merges, so the values of both add up.
            (5, LEN) => decode_summary(f.len_delimited()?, &mut ev.values)?,
            (_, w) => f.skip(w)?,
        }
    }
    Ok(ev)
}

/// Appends the scalar values of a Summary; values of other kinds (images, histograms) are
/// skipped, as this reader only serves the scalars we write.
fn decode_summary(bytes: &[u8], out: &mut Vec<(String, f32)>) -> Parsed<()> {
    let mut s = Fields::new(bytes);
    while let Some((field, wire)) = s.key()? {
        if (field, wire) != (1, LEN) {
            s.skip(wire)?;
            continue;
        }
        let mut v = Fields::new(s.len_delimited()?);
        let (mut tag, mut value) = (String::new(), None);
        while let Some((field, wire)) = v.key()? {
            match (field, wire) {
                (1, LEN) => tag = String::from_utf8(v.len_delimited()?.to_vec()).map_err(|_| "summary tag is not UTF-8")?,
                (2, FIXED32) => value = Some(f32::from_le_bytes(v.take(4)?.try_into().unwrap())),
                (_, w) => v.skip(w)?,
            }
        }
        if let Some(value) = value {
            out.push((tag, value));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn only_file(dir: &Path) -> PathBuf {
        let files = event_files(dir).unwrap();
        assert_eq!(files.len(), 1, "{files:?}");
        files[0].clone()
    }

    /// (step, tag, value) of every scalar in `dir`'s only event file.
    fn steps(dir: &Path) -> Vec<(i64, String, f32)> {
        read_scalars(&only_file(dir)).unwrap().into_iter().map(|(s, _, t, v)| (s, t, v)).collect()
    }

    fn write_steps(w: &mut EventWriter, range: std::ops::RangeInclusive<i64>, scale: f64) {
        for s in range {
            w.scalars(s, 1000.0 + s as f64, &[("train/loss", scale * s as f64), ("train/lr", 1e-4)]).unwrap();
        }
    }

    #[test]
    fn crc32c_of_123456789_is_the_castagnoli_check_value() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn scalars_written_read_back_exactly() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("tb");
        let mut w = EventWriter::create(&dir, 1_700_000_000.25).unwrap();
        let name = w.path().file_name().unwrap().to_string_lossy().to_string();
        assert!(name.starts_with("events.out.tfevents.1700000000."), "{name}");
        type Case<'a> = (i64, f64, &'a [(&'a str, f64)]);
        let cases: &[Case] = &[
            (0, 1_700_000_000.5, &[("train/loss", 2.345_678_901_234_5), ("train/lr", 3e-5)]),
            (1, 1_700_000_001.123_456_7, &[("train/grad_norm", 1e30), ("memory/rss_mb", 12345.678)]),
            (300, 1_700_000_002.0, &[("eval/loss", -0.0), ("x", f64::MAX), ("tiny", 1e-45)]),
            (i64::MAX, 0.0, &[("neg", -1.5), ("inf", f64::NEG_INFINITY)]),
            (-7, -1.0, &[("ünïcode/tag", 0.1)]),
        ];
        for (step, wall, values) in cases {
            w.scalars(*step, *wall, values).unwrap();
        }
        w.scalars(5, 0.0, &[]).unwrap();
        w.flush().unwrap();
        let want: Vec<(i64, f64, String, f32)> =
            cases.iter().flat_map(|(s, t, vs)| vs.iter().map(move |(tag, v)| (*s, *t, tag.to_string(), *v as f32))).collect();
        let got = read_scalars(w.path()).unwrap();
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert_eq!((g.0, g.1.to_bits(), &g.2, g.3.to_bits()), (w.0, w.1.to_bits(), &w.2, w.3.to_bits()));
        }
        let events = read_events(w.path(), false).unwrap();
        assert_eq!(events[0], Event::version(1_700_000_000.25), "the first event names the format");
        assert!(events[1..].iter().all(|e| e.file_version.is_none()));

        // NaN survives bit for bit (a diverged loss must show as NaN, not vanish).
        w.scalars(9, 0.0, &[("nan", f64::NAN)]).unwrap();
        assert!(read_scalars(w.path()).unwrap().last().unwrap().3.is_nan());
    }

    #[test]
    fn a_flipped_byte_is_a_crc_error_naming_the_offset() {
        let tmp = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(tmp.path(), 1000.0).unwrap();
        write_steps(&mut w, 1..=3, 1.0);
        let path = w.path().to_path_buf();
        let good = std::fs::read(&path).unwrap();
        // Record starts: the version event, then steps 1, 2, 3.
        let mut starts = vec![0usize];
        while *starts.last().unwrap() < good.len() {
            let s = *starts.last().unwrap();
            starts.push(s + 16 + u64::from_le_bytes(good[s..s + 8].try_into().unwrap()) as usize);
        }
        let rec2 = starts[2];

        for (at, what) in [(rec2 + 20, "payload"), (rec2 + 1, "length header"), (rec2 + 9, "length header")] {
            let mut bad = good.clone();
            bad[at] ^= 0x10;
            std::fs::write(&path, &bad).unwrap();
            let msg = read_scalars(&path).unwrap_err().to_string();
            assert!(msg.contains(&path.display().to_string()), "{msg}");
            assert!(msg.contains(&format!("record at byte {rec2}:")) && msg.contains("CRC mismatch") && msg.contains(what), "{msg}");
        }

        std::fs::write(&path, &good[..good.len() - 3]).unwrap();
        let msg = read_scalars(&path).unwrap_err().to_string();
        assert!(msg.contains(&format!("record at byte {}: truncated", starts[3])), "{msg}");
    }

    #[test]
    fn rewrite_upto_keeps_only_earlier_steps() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let mut w = EventWriter::create(dir, 1000.0).unwrap();
        write_steps(&mut w, 1..=10, 1.0);
        let first = w.path().to_path_buf();
        drop(w);

        let mut w = EventWriter::resume(dir, 6, 2000.0).unwrap();
        assert_eq!(w.path(), first, "the resumed run continues the same file");
        let kept = steps(dir);
        assert_eq!(kept.len(), 12);
        assert_eq!(kept.iter().map(|s| s.0).max(), Some(6));
        write_steps(&mut w, 7..=9, 10.0);
        drop(w);

        let all = steps(dir);
        let loss: Vec<(i64, f32)> = all.iter().filter(|s| s.1 == "train/loss").map(|s| (s.0, s.2)).collect();
        let want: Vec<(i64, f32)> = (1..=9).map(|s| (s, if s <= 6 { s as f32 } else { 10.0 * s as f32 })).collect();
        assert_eq!(loss, want, "steps 1..=6 of the first run, 7..=9 of the resumed one, each once");
        assert_eq!(read_events(&first, false).unwrap().iter().filter(|e| e.file_version.is_some()).count(), 1);

        // rewrite_upto + create: the new file sorts after the kept one.
        rewrite_upto(dir, 8).unwrap();
        let mut w = EventWriter::create(dir, 3000.0).unwrap();
        write_steps(&mut w, 9..=9, 100.0);
        let files = event_files(dir).unwrap();
        assert_eq!(files, vec![first.clone(), w.path().to_path_buf()]);
        rewrite_upto(dir, 100).unwrap();
        let loss: Vec<(i64, f32)> = steps(dir).into_iter().filter(|s| s.1 == "train/loss").map(|s| (s.0, s.2)).collect();
        assert_eq!(loss.last(), Some(&(9, 900.0)), "{loss:?}");
        assert_eq!(loss.len(), 9);
    }

    #[test]
    fn a_rewrite_that_died_after_its_rename_is_finished_by_the_next() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        // What a rewrite to step 4 that died before deleting the old file leaves: the kept
        // events under the oldest name, the old file (the killed run's) still beside it, and a
        // temporary file from an even earlier attempt.
        let mut kept = EventWriter::create(dir, 1000.0).unwrap();
        write_steps(&mut kept, 1..=4, 1.0);
        let mut old = EventWriter::create(dir, 2000.0).unwrap();
        write_steps(&mut old, 1..=7, 1.0);
        let (kept, old) = (kept.path().to_path_buf(), old.path().to_path_buf());
        // ... and a torn last record.
        let mut f = std::fs::OpenOptions::new().append(true).open(&old).unwrap();
        f.write_all(&[9, 0, 0, 0, 0]).unwrap();
        std::fs::write(dir.join(REWRITE_TMP), b"half").unwrap();
        assert!(read_scalars(&old).is_err(), "the torn record is an error to a strict reader");

        rewrite_upto(dir, 4).unwrap();
        assert_eq!(only_file(dir), kept);
        assert!(!dir.join(REWRITE_TMP).exists());
        let got = steps(dir);
        let want: Vec<(i64, String, f32)> = (1..=4).flat_map(|s| [(s, "train/loss".to_string(), s as f32), (s, "train/lr".to_string(), 1e-4)]).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn a_corrupt_record_inside_a_file_stops_the_rewrite_and_keeps_the_files() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let mut w = EventWriter::create(dir, 1000.0).unwrap();
        write_steps(&mut w, 1..=3, 1.0);
        let path = w.path().to_path_buf();
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[30] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert!(rewrite_upto(dir, 2).unwrap_err().to_string().contains("CRC mismatch"));
        assert_eq!(std::fs::read(&path).unwrap(), bytes, "nothing is lost");
    }

    #[test]
    fn resuming_a_folder_without_events_starts_a_file() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("tensorboard");
        rewrite_upto(&dir, 5).unwrap();
        let mut w = EventWriter::resume(&dir, 5, 1000.0).unwrap();
        write_steps(&mut w, 6..=6, 1.0);
        assert_eq!(steps(&dir).len(), 2);
    }
}
