//! Training data: rows from Arrow, turned into token ids and labels, shuffled in a bounded
//! buffer (optional), and collated into padded micro-batches.
//!
//! Semantics the parity fixtures depend on: without shuffle, rows come in dataset order and
//! the stream is the dataset repeated end to end; a micro-batch is the next
//! `micro_batch_size` rows right-padded to its longest row (id 0, label -100); position t
//! predicts labels[t + 1].

pub mod arrow;

use crate::error::{Error, Result};
use crate::rng::Rng;
use arrow::{int_list, string_cell, ArrowRows, Cursor, RowPos, RowRef};
use std::path::{Path, PathBuf};

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
}

/// Turns alpaca records into token ids with the prompt masked out.
pub struct AlpacaFormatter {
    tokenizer: tokenizers::Tokenizer,
    eos: Option<u32>,
    path: PathBuf,
}

/// The Stanford Alpaca prompt (the plain template most instruction datasets were made for).
pub fn alpaca_prompt(instruction: &str, input: &str) -> String {
    if input.is_empty() {
        format!(
            "Below is an instruction that describes a task. Write a response that appropriately \
             completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
        )
    } else {
        format!(
            "Below is an instruction that describes a task, paired with an input that provides \
             further context. Write a response that appropriately completes the request.\n\n\
             ### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
        )
    }
}

impl AlpacaFormatter {
    /// Load `tokenizer.json` from the model folder; the end-of-sequence token comes from
    /// `tokenizer_config.json` (`eos_token`) or `config.json` (`eos_token_id`).
    pub fn load(model_dir: &Path) -> Result<Self> {
        let path = model_dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(Error::Tokenizer {
                path: path.clone(),
                msg: "not found; data.format = \"alpaca\" needs the model's tokenizer.json (or use format = \"tokenized\")".into(),
            });
        }
        let tokenizer = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| Error::Tokenizer { path: path.clone(), msg: e.to_string() })?;
        let mut eos = None;
        if let Ok(text) = std::fs::read_to_string(model_dir.join("tokenizer_config.json")) {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) {
                let tok = v.get("eos_token").and_then(|t| t.as_str().or_else(|| t.get("content").and_then(|c| c.as_str())));
                eos = tok.and_then(|t| tokenizer.token_to_id(t));
            }
        }
        if eos.is_none() {
            if let Ok(text) = std::fs::read_to_string(model_dir.join("config.json")) {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) {
                    let id = v.get("eos_token_id");
                    eos = id.and_then(|i| i.as_u64().or_else(|| i.get(0).and_then(|x| x.as_u64()))).map(|x| x as u32);
                }
            }
        }
        Ok(AlpacaFormatter { tokenizer, eos, path })
    }

    /// prompt tokens (with the tokenizer's special prefix, e.g. BOS) get IGNORE labels; the
    /// response and EOS are trained.
    pub fn format(&self, instruction: &str, input: &str, output: &str) -> Result<Example> {
        let enc = |text: &str, special: bool| -> Result<Vec<u32>> {
            self.tokenizer
                .encode(text, special)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| Error::Tokenizer { path: self.path.clone(), msg: e.to_string() })
        };
        let prompt = enc(&alpaca_prompt(instruction, input), true)?;
        let mut response = enc(output, false)?;
        if let Some(e) = self.eos {
            response.push(e);
        }
        let mut labels = vec![IGNORE; prompt.len()];
        labels.extend(response.iter().map(|&t| t as i64));
        let mut input_ids = prompt;
        input_ids.extend(response);
        Ok(Example::new(input_ids, labels))
    }
}

pub enum Format {
    Tokenized,
    Alpaca(Box<AlpacaFormatter>),
}

/// Options of the loader, from the recipe's [data] and [train].
pub struct LoaderOptions {
    pub max_seq_len: usize,
    pub vocab_size: usize,
    pub shuffle: bool,
    pub shuffle_buffer: usize,
    pub seed: u64,
    pub packing: bool,
}

/// An endless stream of examples.
pub struct Loader {
    rows: ArrowRows,
    format: Format,
    opts: LoaderOptions,
    /// Shuffle buffer: examples with the position they were read from (saved in checkpoints
    /// as positions only and re-read on resume).
    buffer: Vec<(Example, RowPos)>,
    /// With packing: the example that did not fit in the last row, first in the next.
    carry: Option<(Example, RowPos)>,
    rng: Rng,
    pub truncated: u64,
}

/// Everything needed to continue the example stream exactly where it was.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LoaderState {
    pub cursor: Cursor,
    pub rng: u64,
    pub buffer: Vec<RowPos>,
    #[serde(default)]
    pub carry: Option<RowPos>,
    pub truncated: u64,
}

impl Loader {
    pub fn open(path: &Path, format: Format, opts: LoaderOptions) -> Result<Self> {
        let mut rows = ArrowRows::open(path)?;
        let cols = rows.peek_columns()?;
        let names: Vec<&str> = cols.iter().map(|(n, _)| n.as_str()).collect();
        let need: &[&str] = match format {
            Format::Tokenized => &["input_ids"],
            Format::Alpaca(_) => &["instruction", "output"],
        };
        for n in need {
            if !names.contains(n) {
                let hint = match format {
                    Format::Tokenized => " (data.format = \"tokenized\" needs input_ids, and labels optionally; for instruction records set data.format = \"alpaca\")",
                    Format::Alpaca(_) => " (data.format = \"alpaca\" needs instruction, output and optionally input)",
                };
                return Err(Error::data(
                    rows.first_file(),
                    format!("no `{n}` column; columns are: {}{hint}", names.join(", ")),
                ));
            }
        }
        let rng = Rng::new(opts.seed ^ 0xDA7A);
        Ok(Loader { rows, format, opts, buffer: Vec::new(), carry: None, rng, truncated: 0 })
    }

    pub fn state(&self) -> LoaderState {
        LoaderState {
            cursor: self.rows.cursor(),
            rng: self.rng.state(),
            buffer: self.buffer.iter().map(|(_, p)| *p).collect(),
            carry: self.carry.as_ref().map(|(_, p)| *p),
            truncated: self.truncated,
        }
    }

    /// Continue from a saved state: jump to the cursor and re-read the buffered rows by
    /// position (nothing before them is read).
    pub fn restore(&mut self, st: &LoaderState) -> Result<()> {
        self.rows.seek(st.cursor)?;
        self.rng = Rng::new(st.rng);
        self.buffer.clear();
        for &pos in &st.buffer {
            let r = self.rows.row_at(pos)?;
            let ex = format_row(&self.format, &r, &self.opts)?.0;
            self.buffer.push((ex, pos));
        }
        self.carry = match st.carry {
            Some(pos) => {
                let r = self.rows.row_at(pos)?;
                Some((format_row(&self.format, &r, &self.opts)?.0, pos))
            }
            None => None,
        };
        self.rows.seek(st.cursor)?;
        self.truncated = st.truncated;
        Ok(())
    }

    fn read_one(&mut self) -> Result<(Example, RowPos)> {
        let (r, pos) = self.rows.next_row()?;
        let (ex, truncated) = format_row(&self.format, &r, &self.opts)?;
        self.truncated += u64::from(truncated);
        Ok((ex, pos))
    }

    /// The next example: in dataset order, or drawn from a seeded shuffle buffer of
    /// `shuffle_buffer` examples (memory bounded by the buffer, not the dataset).
    pub fn next_example(&mut self) -> Result<Example> {
        Ok(self.next_with_pos()?.0)
    }

    fn next_with_pos(&mut self) -> Result<(Example, RowPos)> {
        if let Some(item) = self.carry.take() {
            return Ok(item);
        }
        if !self.opts.shuffle {
            return self.read_one();
        }
        while self.buffer.len() < self.opts.shuffle_buffer.max(1) {
            let item = self.read_one()?;
            self.buffer.push(item);
        }
        let i = self.rng.below(self.buffer.len() as u64) as usize;
        Ok(self.buffer.swap_remove(i))
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
}

/// A row as an example, truncated to `max_seq_len` (the flag says whether it was).
fn format_row(format: &Format, r: &RowRef, opts: &LoaderOptions) -> Result<(Example, bool)> {
    let mut ex = match format {
        Format::Tokenized => tokenized(r, opts.vocab_size)?,
        Format::Alpaca(f) => {
            let get = |c: &str| string_cell(r, c);
            let instruction =
                get("instruction")?.ok_or_else(|| Error::data(r.file, format!("row {}: `instruction` is null", r.index)))?;
            let output = get("output")?.ok_or_else(|| Error::data(r.file, format!("row {}: `output` is null", r.index)))?;
            let input = get("input")?.unwrap_or_default();
            f.format(&instruction, &input, &output)?
        }
    };
    let truncated = ex.input_ids.len() > opts.max_seq_len;
    if truncated {
        ex.input_ids.truncate(opts.max_seq_len);
        ex.labels.truncate(opts.max_seq_len);
        ex.positions.truncate(opts.max_seq_len);
        ex.segments.truncate(opts.max_seq_len);
    }
    Ok((ex, truncated))
}

fn tokenized(r: &RowRef, vocab: usize) -> Result<Example> {
    let ids = int_list(r, "input_ids")?;
    let labels = if r.batch.column_by_name("labels").is_some() { int_list(r, "labels")? } else { ids.clone() };
    let bad = |msg: String| Error::data(r.file, format!("row {}: {msg}", r.index));
    if labels.len() != ids.len() {
        return Err(bad(format!("labels has {} entries but input_ids has {}", labels.len(), ids.len())));
    }
    if ids.is_empty() {
        return Err(bad("input_ids is empty".into()));
    }
    let mut input_ids = Vec::with_capacity(ids.len());
    for &t in &ids {
        if t < 0 || t as usize >= vocab {
            return Err(bad(format!("token id {t} outside the vocabulary [0, {vocab})")));
        }
        input_ids.push(t as u32);
    }
    for &l in &labels {
        if l != IGNORE && (l < 0 || l as usize >= vocab) {
            return Err(bad(format!("label {l} is neither -100 nor a token id in [0, {vocab})")));
        }
    }
    Ok(Example::new(input_ids, labels))
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
    /// Non-padding input tokens.
    pub real_tokens: usize,
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
            real_tokens: examples.iter().map(|e| e.input_ids.len()).sum(),
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
    fn collate_pads_right_and_shifts_labels() {
        let a = Example::new(vec![5, 6, 7], vec![IGNORE, 6, 7]);
        let b = Example::new(vec![8, 9], vec![8, 9]);
        let mb = MicroBatch::collate(&[a, b]);
        assert_eq!(mb.seq, 3);
        assert_eq!(mb.input_ids, vec![5, 6, 7, 8, 9, 0]);
        assert_eq!(mb.targets, vec![6, 7, IGNORE, 9, IGNORE, IGNORE]);
        assert_eq!(mb.num_targets(), 3);
        assert_eq!(mb.real_tokens, 5);
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
