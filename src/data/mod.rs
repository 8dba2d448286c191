//! Training data: rows from Arrow, turned into token ids and labels, shuffled in a bounded
//! buffer (optional), and collated into padded micro-batches.
//!
//! Semantics the parity fixtures depend on: without shuffle, rows come in dataset order and
//! the stream is the dataset repeated end to end; a micro-batch is the next
//! `micro_batch_size` rows right-padded to its longest row (id 0, label -100); position t
//! predicts labels[t + 1].

pub mod format;
pub mod source;

use crate::error::{Error, Result};
use crate::rng::Rng;
use source::{Cursor, RowPos, RowRef, Rows};
use std::path::PathBuf;

/// Label value that contributes no loss (PyTorch's ignore_index).
pub const IGNORE: i64 = -100;

#[derive(Clone, Debug, PartialEq)]
pub struct Example {
    pub input_ids: Vec<u32>,
    /// Same length as `input_ids`; IGNORE where no loss is taken.
    pub labels: Vec<i64>,
    /// Position ids (0.. per record; restart at each packed record).
    pub positions: Vec<u32>,
    /// Record index within a packed row (all 0 when unpacked): attention never crosses it.
    pub segments: Vec<u32>,
}

impl Example {
    pub fn new(input_ids: Vec<u32>, labels: Vec<i64>) -> Self {
        let n = input_ids.len() as u32;
        Example { input_ids, labels, positions: (0..n).collect(), segments: vec![0; n as usize] }
    }

    /// As held while it waits in the shuffle buffer or a token-batch pool: an example read from
    /// the data is one record (positions 0.., segment 0), so those two are dropped and rebuilt
    /// by [`Example::unstowed`]: 12 bytes a token held instead of 20.
    fn stowed(mut self) -> Self {
        debug_assert!(self.segments.iter().all(|&s| s == 0) && self.positions.iter().enumerate().all(|(i, &p)| p as usize == i));
        self.positions = Vec::new();
        self.segments = Vec::new();
        // Tokenizing leaves slack (an EOS pushed onto an exact-size copy doubles it), and
        // truncation keeps the whole record's allocation (a buffer of 5000-token rows at
        // max_seq_len 256 held 20x what it used).
        self.input_ids.shrink_to_fit();
        self.labels.shrink_to_fit();
        self
    }

    fn unstowed(self) -> Self {
        Example::new(self.input_ids, self.labels)
    }
}

/// Bytes the loader may hold per buffered token ([`Example::stowed`]: an id and a label), and
/// per buffered row besides (the example's four vectors, its position, two allocations'
/// headers), for `finetune plan`.
pub const BUFFERED_BYTES_PER_TOKEN: usize = 4 + 8;
pub const BUFFERED_BYTES_PER_ROW: usize = 4 * 24 + 40 + 2 * 16;

pub use format::{alpaca_prompt, BadRecord, Formatter, Record};

/// Options of the loader, from the recipe's [data] and [train].
#[derive(Clone, Debug)]
pub struct LoaderOptions {
    pub max_seq_len: usize,
    pub shuffle: bool,
    pub shuffle_buffer: usize,
    pub seed: u64,
    pub packing: bool,
    /// "truncate" or "drop" records longer than max_seq_len.
    pub overflow: String,
    /// "error" or "skip" records that cannot be used.
    pub on_bad_record: String,
    /// Hold out this fraction of rows (by a hash of the row index) for evaluation.
    pub eval_fraction: f64,
    /// Which side of the hold-out this loader reads.
    pub role: Role,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Role {
    Train,
    Eval,
}

/// Whether dataset row `index` belongs to the held-out evaluation part.
pub fn is_held_out(index: u64, fraction: f64, seed: u64) -> bool {
    fraction > 0.0 && (crate::rng::mix(index ^ crate::rng::mix(seed ^ 0xE7A1)) >> 11) as f64 / (1u64 << 53) as f64 <= fraction
}

/// Whether the note on a slow shuffle-buffer fill was printed (once a process: every rank
/// fills its own).
static BUFFER_FILL_NOTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Counts the run reports at the end (and keeps across resumes).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DataStats {
    pub truncated: u64,
    pub dropped: u64,
    pub bad: u64,
    /// The first few bad records' messages.
    pub bad_examples: Vec<String>,
    /// Records read on the first pass, what the counts above are of: with a shuffle buffer,
    /// more than were trained on (0 in checkpoints from before it was counted).
    #[serde(default)]
    pub read: u64,
}

impl DataStats {
    pub fn report(&self, max_seq_len: usize) -> Vec<String> {
        let mut out = Vec::new();
        let counted = self.read >= self.truncated + self.dropped + self.bad && self.read > 0;
        let of = |n: u64| if counted { format!("{n} of the {} records read", self.read) } else { format!("{n} record(s)") };
        if self.truncated > 0 {
            out.push(format!("{} were longer than data.max_seq_len = {max_seq_len} and truncated", of(self.truncated)));
        }
        if self.dropped > 0 {
            out.push(format!("{} were longer than data.max_seq_len = {max_seq_len} and dropped (data.overflow = \"drop\")", of(self.dropped)));
        }
        if self.bad > 0 {
            out.push(format!("{} bad record(s) skipped, e.g. {}", self.bad, self.bad_examples.join("; ")));
        }
        out
    }
}

/// An endless stream of examples.
pub struct Loader {
    rows: Rows,
    fmt: Formatter,
    opts: LoaderOptions,
    /// Shuffle buffer: examples ([`Example::stowed`]) with the position they were read from
    /// (saved in checkpoints as positions only and re-read on resume).
    buffer: Vec<(Example, RowPos)>,
    /// With packing: the example that did not fit in the last row, first in the next.
    carry: Option<(Example, RowPos)>,
    /// The first example of the next pass over the dataset, read while filling the shuffle
    /// buffer (or put back by a token-batch pool that ends with its pass): it waits until the
    /// buffer's pass is drained, so every pass is a permutation of the dataset.
    ahead: Option<(Example, RowPos)>,
    rng: Rng,
    pub stats: DataStats,
    /// Bad or dropped rows in a row; a full pass of them means nothing is usable.
    unusable_run: u64,
    /// With batch_by = "tokens": micro-batches cut from the last length-sorted pool.
    pending: std::collections::VecDeque<Vec<(Example, RowPos)>>,
}

/// Everything needed to continue the example stream exactly where it was.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LoaderState {
    pub cursor: Cursor,
    pub rng: u64,
    pub buffer: Vec<RowPos>,
    #[serde(default)]
    pub carry: Option<RowPos>,
    #[serde(default)]
    pub ahead: Option<RowPos>,
    #[serde(default)]
    pub stats: DataStats,
    #[serde(default)]
    pub pending: Vec<Vec<RowPos>>,
    /// The time the chat template's `strftime_now` renders (seconds since the epoch), so a
    /// run resumed on another day tokenizes its records as the uninterrupted run did.
    #[serde(default)]
    pub template_time: Option<u64>,
}

impl Loader {
    pub fn open(specs: &[PathBuf], split: source::Split, mut fmt: Formatter, opts: LoaderOptions) -> Result<Self> {
        let mut rows = Rows::open_all(specs, split)?;
        let mut files = rows.columns_by_file()?;
        if files.is_empty() {
            files.push(rows.columns_and_file()?); // its error: no file has a record
        }
        for (names, names_file) in files {
            for n in fmt.required_columns() {
                if !names.contains(&n) {
                    let hint = format!(
                        " (data.format = \"{}\" needs {}; remap names with [data.columns], or pick another data.format: {})",
                        fmt.format,
                        fmt.required_columns().join(", "),
                        format::FORMATS.join(", ")
                    );
                    return Err(Error::data(names_file, format!("no `{n}` column; columns are: {}{hint}", names.join(", "))));
                }
            }
            // A column remapped to one the data does not have would read as absent (an empty
            // alpaca input, no labels): the remap was meant for something.
            if let Some((k, v)) = fmt.mapped_columns().find(|(_, v)| !names.iter().any(|n| n == v)) {
                return Err(Error::data(names_file, format!("[data.columns] maps `{k}` to `{v}`, which is not a column; columns are: {}", names.join(", "))));
            }
        }
        // Tokens past max_seq_len are cut anyway: never tokenize (much) more than that.
        fmt.set_token_limit(Some(opts.max_seq_len));
        if opts.shuffle {
            rows.shuffle_blocks(opts.seed);
        }
        let rng = Rng::new(opts.seed ^ 0xDA7A);
        Ok(Loader { rows, fmt, opts, buffer: Vec::new(), carry: None, ahead: None, rng, stats: DataStats::default(), unusable_run: 0, pending: Default::default() })
    }

    pub fn formatter(&self) -> &Formatter {
        &self.fmt
    }

    /// The files this loader reads (its shards: a hub dataset's cached files included).
    pub fn files(&self) -> Vec<PathBuf> {
        self.rows.files()
    }

    pub fn total_rows(&self) -> u64 {
        self.rows.total_rows
    }

    /// The records this loader serves: all of them, less those data.eval_fraction holds out
    /// of training (or only those, for evaluation). Counted by their hashes, not read.
    pub fn records(&self) -> u64 {
        let o = &self.opts;
        if o.eval_fraction <= 0.0 {
            return self.rows.total_rows;
        }
        (0..self.rows.total_rows).filter(|&i| is_held_out(i, o.eval_fraction, o.seed) == (o.role == Role::Eval)).count() as u64
    }

    pub fn state(&self) -> LoaderState {
        LoaderState {
            cursor: self.rows.cursor(),
            rng: self.rng.state(),
            buffer: self.buffer.iter().map(|(_, p)| *p).collect(),
            carry: self.carry.as_ref().map(|(_, p)| *p),
            ahead: self.ahead.as_ref().map(|(_, p)| *p),
            stats: self.stats.clone(),
            pending: self.pending.iter().map(|b| b.iter().map(|(_, p)| *p).collect()).collect(),
            template_time: self.fmt.template_time(),
        }
    }

    /// Continue from a saved state: jump to the cursor and re-read the buffered rows by
    /// position (nothing before them is read).
    pub fn restore(&mut self, st: &LoaderState) -> Result<()> {
        if let Some(t) = st.template_time {
            self.fmt.set_template_time(t);
        }
        self.rng = Rng::new(st.rng);
        self.buffer.clear();
        for &pos in &st.buffer {
            let ex = self.example_at(pos)?;
            self.buffer.push((ex.stowed(), pos));
        }
        self.carry = match st.carry {
            Some(pos) => Some((self.example_at(pos)?, pos)),
            None => None,
        };
        self.ahead = match st.ahead {
            Some(pos) => Some((self.example_at(pos)?, pos)),
            None => None,
        };
        self.pending.clear();
        for b in &st.pending {
            let mut batch = Vec::with_capacity(b.len());
            for &pos in b {
                batch.push((self.example_at(pos)?.stowed(), pos));
            }
            self.pending.push_back(batch);
        }
        self.rows.seek(st.cursor)?;
        self.stats = st.stats.clone();
        Ok(())
    }

    /// A row that was usable before, read again by position.
    fn example_at(&mut self, pos: RowPos) -> Result<Example> {
        let r = self.rows.row_at(pos)?;
        match convert(&self.fmt, &r, &self.opts)? {
            Converted::Ok { ex, .. } => Ok(ex),
            _ => Err(Error::data(r.file, format!("{} changed since the checkpoint (no longer usable)", r.at()))),
        }
    }

    /// The next usable example in dataset order (wrapping), applying overflow and the
    /// bad-record policy.
    fn read_one(&mut self) -> Result<(Example, RowPos)> {
        loop {
            let total = self.rows.total_rows;
            let (opts, fmt) = (&self.opts, &self.fmt);
            let (r, pos) = self.rows.next_row()?;
            let held = is_held_out(r.index, opts.eval_fraction, opts.seed);
            if opts.eval_fraction > 0.0 && held != (opts.role == Role::Eval) {
                self.unusable_run += 1;
                if self.unusable_run > total {
                    return Err(Error::data(r.file, "no rows left for this split (data.eval_fraction too large?)"));
                }
                continue;
            }
            let file = r.file.to_path_buf();
            // Records are counted on the first pass over the data only: a later pass reads
            // the same records again, and the counts say how many of the dataset's records
            // were truncated, dropped or bad (as `data inspect` does).
            let first_pass = pos.epoch == 0;
            self.stats.read += u64::from(first_pass);
            match convert(fmt, &r, opts)? {
                Converted::Ok { ex, full_len } => {
                    self.stats.truncated += u64::from(first_pass && full_len > opts.max_seq_len);
                    self.unusable_run = 0;
                    return Ok((ex, pos));
                }
                Converted::Dropped { .. } => self.stats.dropped += u64::from(first_pass),
                Converted::Bad(b) => self.skip_bad(&file, b, first_pass)?,
            }
            self.unusable_run += 1;
            if self.unusable_run > total {
                return Err(Error::data(&file, "no usable records: every row was bad or too long (see data.on_bad_record, data.overflow)"));
            }
        }
    }

    /// A bad record under data.on_bad_record: "skip" counts it (and keeps the first few
    /// messages for the report), anything else stops with an error naming the file and row.
    /// `count`: whether this reading of the record counts (the first pass's).
    fn skip_bad(&mut self, file: &std::path::Path, BadRecord(msg): BadRecord, count: bool) -> Result<()> {
        if self.opts.on_bad_record != "skip" {
            return Err(Error::data(file, format!("{msg} (set data.on_bad_record = \"skip\" to skip such records)")));
        }
        if !count {
            return Ok(());
        }
        self.stats.bad += 1;
        if self.stats.bad_examples.len() < 5 {
            self.stats.bad_examples.push(msg);
        }
        Ok(())
    }

    /// The next example: in dataset order, or drawn from a seeded shuffle buffer of
    /// `shuffle_buffer` examples (memory bounded by the buffer, not the dataset). The buffer
    /// holds one pass over the dataset at a time, so a pass visits every usable row once
    /// (a buffer filled across the wrap would serve some rows twice and others never).
    pub fn next_example(&mut self) -> Result<Example> {
        Ok(self.next_with_pos()?.0)
    }

    fn next_with_pos(&mut self) -> Result<(Example, RowPos)> {
        if let Some(item) = self.carry.take() {
            return Ok(item);
        }
        if !self.opts.shuffle {
            return match self.ahead.take() {
                Some(item) => Ok(item),
                None => self.read_one(),
            };
        }
        if self.buffer.is_empty() {
            self.buffer.extend(self.ahead.take().map(|(e, p)| (e.stowed(), p)));
        }
        let filling = std::time::Instant::now();
        while self.ahead.is_none() && self.buffer.len() < self.opts.shuffle_buffer.max(1) {
            let item = self.read_one()?;
            if self.buffer.first().is_some_and(|(_, p)| p.epoch != item.1.epoch) {
                self.ahead = Some(item);
            } else {
                self.buffer.push((item.0.stowed(), item.1));
            }
            if filling.elapsed() > std::time::Duration::from_secs(10) && !BUFFER_FILL_NOTED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                crate::note!(
                    "note: filling the shuffle buffer ({} of data.shuffle_buffer = {} rows read so far): the first step waits for it, and a resumed run reads it again; \
                     a smaller data.shuffle_buffer starts sooner and mixes less",
                    self.buffer.len(),
                    self.opts.shuffle_buffer
                );
            }
        }
        let i = self.rng.below(self.buffer.len() as u64) as usize;
        let (ex, pos) = self.buffer.swap_remove(i);
        Ok((ex.unstowed(), pos))
    }

    /// Undo the last `next_with_pos` (its example is served again later).
    fn put_back(&mut self, item: (Example, RowPos)) {
        if self.opts.shuffle {
            self.buffer.push((item.0.stowed(), item.1));
        } else {
            self.ahead = Some(item);
        }
    }

    /// The next training row: one example, or with `packing` several whole examples packed
    /// greedily into at most `max_seq_len` tokens (an example that does not fit starts the
    /// next row; examples are never split).
    pub fn next_row(&mut self) -> Result<Example> {
        let (first, _) = self.next_with_pos()?;
        if !self.opts.packing {
            return Ok(first);
        }
        let mut row = first;
        loop {
            let item = self.next_with_pos()?;
            if row.input_ids.len() + item.0.input_ids.len() > self.opts.max_seq_len {
                self.carry = Some(item);
                return Ok(row);
            }
            let seg = row.segments.last().map_or(0, |s| s + 1);
            row.positions.extend(item.0.positions.iter());
            row.segments.extend(item.0.segments.iter().map(|_| seg));
            row.input_ids.extend(item.0.input_ids);
            row.labels.extend(item.0.labels);
        }
    }

    /// batch_by = "tokens": a micro-batch of similar-length examples whose padded size
    /// (rows x longest) stays within `max_tokens`. Examples are drawn `shuffle_buffer` at a
    /// time (through the shuffle buffer when shuffling; fewer at the end of a pass over the
    /// dataset, so a pool never holds a row twice), sorted by length, cut into batches, and
    /// the batches served in a seeded random order.
    pub fn next_token_batch(&mut self, max_tokens: usize) -> Result<Vec<Example>> {
        if self.pending.is_empty() {
            let n = self.opts.shuffle_buffer.max(1);
            let mut pool: Vec<(Example, RowPos)> = Vec::with_capacity(n.min(4096));
            while pool.len() < n {
                let item = self.next_with_pos()?;
                if pool.first().is_some_and(|(_, p)| p.epoch != item.1.epoch) {
                    self.put_back(item);
                    break;
                }
                pool.push((item.0.stowed(), item.1));
            }
            // A record is never split: one longer than the budget would run as a micro-batch
            // over it, past the memory the budget (and checkpointing's plan) allow.
            if let Some((len, pos)) = pool.iter().map(|(e, p)| (e.input_ids.len(), *p)).find(|&(len, _)| len > max_tokens) {
                let r = self.rows.row_at(pos)?;
                let msg = format!(
                    "{} is {len} tokens long, more than data.max_tokens = {max_tokens} (batch_by = \"tokens\" batches whole records): \
                     raise data.max_tokens to at least {len}, or lower data.max_seq_len to {max_tokens}",
                    r.at()
                );
                return Err(Error::data(r.file, msg));
            }
            pool.sort_by_key(|(e, p)| (e.input_ids.len(), p.index));
            let mut batches: Vec<Vec<(Example, RowPos)>> = Vec::new();
            let mut cur: Vec<(Example, RowPos)> = Vec::new();
            let mut longest = 0;
            for item in pool {
                let l = item.0.input_ids.len();
                if !cur.is_empty() && longest.max(l) * (cur.len() + 1) > max_tokens {
                    batches.push(std::mem::take(&mut cur));
                    longest = 0;
                }
                longest = longest.max(l);
                cur.push(item);
            }
            if !cur.is_empty() {
                batches.push(cur);
            }
            for i in (1..batches.len()).rev() {
                let j = self.rng.below(i as u64 + 1) as usize;
                batches.swap(i, j);
            }
            self.pending = batches.into();
        }
        Ok(self.pending.pop_front().map(|b| b.into_iter().map(|x| x.0.unstowed()).collect()).unwrap_or_default())
    }

    /// Token lengths (before truncation) of the first `limit` rows, and the bad records among
    /// them (count, first few messages), for `finetune data inspect`. Bad records are what
    /// training would find bad, records left with no target tokens after truncation included.
    /// With data.on_bad_record = "error" any bad record is an error (naming the first one's
    /// file and row, and how many there were), as training would stop on it. A record longer
    /// than the tokenized prefix bound (see [`Formatter::set_token_limit`]) reports a length
    /// of at least max_seq_len + 64 rather than its full length.
    pub fn scan_lengths(&mut self, limit: u64) -> Result<(Vec<usize>, u64, Vec<String>)> {
        let (mut lengths, mut bad, mut examples) = (Vec::new(), 0u64, Vec::new());
        let mut first_bad: Option<(PathBuf, String)> = None;
        let scanned = self.rows.total_rows.min(limit);
        self.rows.seek(Cursor::default())?;
        for _ in 0..scanned {
            let (r, _) = self.rows.next_row()?;
            match convert(&self.fmt, &r, &self.opts)? {
                Converted::Ok { full_len, .. } | Converted::Dropped { full_len } => lengths.push(full_len),
                Converted::Bad(BadRecord(m)) => {
                    bad += 1;
                    if first_bad.is_none() {
                        first_bad = Some((r.file.to_path_buf(), m.clone()));
                    }
                    if examples.len() < 5 {
                        examples.push(m);
                    }
                }
            }
        }
        self.rows.seek(Cursor::default())?;
        if let (Some((file, m)), true) = (first_bad, self.opts.on_bad_record != "skip") {
            return Err(Error::data(
                file,
                format!("{m} ({bad} bad record(s) among the {scanned} rows scanned; set data.on_bad_record = \"skip\" to skip such records)"),
            ));
        }
        Ok((lengths, bad, examples))
    }

    /// Every usable example of this loader's split once, in order (for evaluation). Bad
    /// records follow data.on_bad_record as in training; records over max_seq_len follow
    /// data.overflow. Both are counted in `stats`, which then hold this pass's counts (every
    /// evaluation reads the same records).
    pub fn one_pass(&mut self) -> Result<Vec<Example>> {
        let mut out = Vec::new();
        self.stats = DataStats::default();
        let total = self.rows.total_rows;
        self.rows.seek(Cursor::default())?;
        for _ in 0..total {
            let (r, _) = self.rows.next_row()?;
            if self.opts.eval_fraction > 0.0 && is_held_out(r.index, self.opts.eval_fraction, self.opts.seed) != (self.opts.role == Role::Eval) {
                continue;
            }
            let file = r.file.to_path_buf();
            match convert(&self.fmt, &r, &self.opts)? {
                Converted::Ok { ex, full_len } => {
                    self.stats.truncated += u64::from(full_len > self.opts.max_seq_len);
                    out.push(ex);
                }
                Converted::Dropped { .. } => self.stats.dropped += 1,
                Converted::Bad(b) => self.skip_bad(&file, b, true)?,
            }
        }
        Ok(out)
    }
}

enum Converted {
    /// A usable example (truncated to max_seq_len) and its length before truncation.
    Ok { ex: Example, full_len: usize },
    Dropped { full_len: usize },
    Bad(BadRecord),
}

/// A row as an example, truncated (or dropped) at `max_seq_len`. A record left without a
/// single target token (position t predicts labels[t + 1], so labels[0] is never one) is bad:
/// it would cost a row of compute and train nothing, and a step of only such rows has no loss.
fn convert(fmt: &Formatter, r: &RowRef, opts: &LoaderOptions) -> Result<Converted> {
    let rec = match fmt.read(r)? {
        Ok(rec) => rec,
        Err(b) => return Ok(Converted::Bad(b)),
    };
    let mut ex = match fmt.tokenize(rec, r.number())? {
        Ok(ex) => ex,
        Err(b) => return Ok(Converted::Bad(b)),
    };
    let full_len = ex.input_ids.len();
    let truncated = full_len > opts.max_seq_len;
    if truncated {
        if opts.overflow == "drop" {
            return Ok(Converted::Dropped { full_len });
        }
        // (The allocation stays: a record that waits in the shuffle buffer is shrunk there,
        // `Example::stowed`.)
        ex.input_ids.truncate(opts.max_seq_len);
        ex.labels.truncate(opts.max_seq_len);
        ex.positions.truncate(opts.max_seq_len);
        ex.segments.truncate(opts.max_seq_len);
    }
    if ex.labels.iter().skip(1).all(|&l| l == IGNORE) {
        let why = if truncated {
            format!("every label is -100 after truncation to data.max_seq_len = {} (the trained part starts later, or was cut away)", opts.max_seq_len)
        } else {
            "every label is -100 (nothing to train on; an empty text or an all -100 labels list?)".to_string()
        };
        return Ok(Converted::Bad(BadRecord(format!("{}: no target tokens: {why}", r.at()))));
    }
    Ok(Converted::Ok { ex, full_len })
}

/// A padded micro-batch. `targets[b][t]` is the label position t predicts (labels shifted by
/// one), IGNORE where there is none (padding, the last token, and the last token of each
/// packed record, which must not predict the next record).
pub struct MicroBatch {
    pub rows: usize,
    pub seq: usize,
    /// [B * S] row-major, padding id 0.
    pub input_ids: Vec<u32>,
    /// [B * S]
    pub targets: Vec<i64>,
    /// [B][S] position ids (padding continues counting).
    pub positions: Vec<Vec<u32>>,
    /// [B][S] record index per token; padding gets its own segment. `None` when every row is
    /// a single record (plain causal attention).
    pub segments: Option<Vec<Vec<u32>>>,
    /// Each row's non-padding input tokens.
    pub lens: Vec<usize>,
}

impl MicroBatch {
    pub fn collate(examples: &[Example]) -> MicroBatch {
        let seq = examples.iter().map(|e| e.input_ids.len()).max().unwrap_or(0);
        let rows = examples.len();
        let mut input_ids = vec![0u32; rows * seq];
        let mut targets = vec![IGNORE; rows * seq];
        let packed = examples.iter().any(|e| e.segments.iter().any(|&s| s != 0));
        let mut positions = Vec::with_capacity(rows);
        let mut segments = Vec::with_capacity(rows);
        for (b, e) in examples.iter().enumerate() {
            let n = e.input_ids.len();
            input_ids[b * seq..b * seq + n].copy_from_slice(&e.input_ids);
            for t in 0..n.saturating_sub(1) {
                if e.segments[t + 1] == e.segments[t] {
                    targets[b * seq + t] = e.labels[t + 1];
                }
            }
            let mut p = e.positions.clone();
            let last = p.last().copied().unwrap_or(0);
            p.extend((1..=(seq - n) as u32).map(|i| last + i));
            positions.push(p);
            let mut sg = e.segments.clone();
            sg.resize(seq, u32::MAX);
            segments.push(sg);
        }
        MicroBatch {
            rows,
            seq,
            input_ids,
            targets,
            positions,
            segments: packed.then_some(segments),
            lens: examples.iter().map(|e| e.input_ids.len()).collect(),
        }
    }

    /// Non-padding input tokens.
    pub fn real_tokens(&self) -> usize {
        self.lens.iter().sum()
    }

    /// Rows `lo..hi` as a micro-batch of their own, padded to the same length (a pass of a
    /// micro-batch that runs in several: `train::pass_tokens`).
    pub fn rows_range(&self, lo: usize, hi: usize) -> MicroBatch {
        let span = lo * self.seq..hi * self.seq;
        MicroBatch {
            rows: hi - lo,
            seq: self.seq,
            input_ids: self.input_ids[span.clone()].to_vec(),
            targets: self.targets[span].to_vec(),
            positions: self.positions[lo..hi].to_vec(),
            segments: self.segments.as_ref().map(|s| s[lo..hi].to_vec()),
            lens: self.lens[lo..hi].to_vec(),
        }
    }

    pub fn num_targets(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_counts_say_what_they_are_of() {
        // A shuffle buffer reads ahead of the steps: 8824 truncated of a 3-step run read as
        // if the run had trained on them.
        let s = DataStats { truncated: 8824, read: 10_024, ..Default::default() };
        assert_eq!(s.report(2048), ["8824 of the 10024 records read were longer than data.max_seq_len = 2048 and truncated"]);
        // A checkpoint from before reads were counted.
        let old = DataStats { truncated: 3, ..Default::default() };
        assert_eq!(old.report(64), ["3 record(s) were longer than data.max_seq_len = 64 and truncated"]);
    }

    #[test]
    fn collate_pads_right_and_shifts_labels() {
        let a = Example::new(vec![5, 6, 7], vec![IGNORE, 6, 7]);
        let b = Example::new(vec![8, 9], vec![8, 9]);
        let mb = MicroBatch::collate(&[a, b]);
        assert_eq!(mb.seq, 3);
        assert_eq!(mb.input_ids, vec![5, 6, 7, 8, 9, 0]);
        assert_eq!(mb.targets, vec![6, 7, IGNORE, 9, IGNORE, IGNORE]);
        assert_eq!(mb.num_targets(), 3);
        assert_eq!(mb.real_tokens(), 5);
        let second = mb.rows_range(1, 2);
        assert_eq!((second.rows, second.seq, second.real_tokens()), (1, 3, 2));
        assert_eq!((second.input_ids, second.targets), (vec![8, 9, 0], vec![9, IGNORE, IGNORE]));
        assert!(mb.segments.is_none());
    }

    #[test]
    fn a_packed_record_never_predicts_the_next_one() {
        let mut row = Example::new(vec![5, 6], vec![5, 6]);
        row.input_ids.extend([7, 8]);
        row.labels.extend([7, 8]);
        row.positions.extend([0, 1]);
        row.segments.extend([1, 1]);
        let mb = MicroBatch::collate(&[row]);
        assert_eq!(mb.targets, vec![6, IGNORE, 8, IGNORE]);
        assert_eq!(mb.positions, vec![vec![0, 1, 0, 1]]);
        assert!(mb.segments.is_some());
    }
}
