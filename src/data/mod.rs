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
        Ok(Example { input_ids, labels })
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
}

/// An endless stream of examples.
pub struct Loader {
    rows: ArrowRows,
    format: Format,
    opts: LoaderOptions,
    /// Shuffle buffer: examples with the position they were read from (saved in checkpoints
    /// as positions only and re-read on resume).
    buffer: Vec<(Example, RowPos)>,
    rng: Rng,
    pub truncated: u64,
}

/// Everything needed to continue the example stream exactly where it was.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LoaderState {
    pub cursor: Cursor,
    pub rng: u64,
    pub buffer: Vec<RowPos>,
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
        Ok(Loader { rows, format, opts, buffer: Vec::new(), rng, truncated: 0 })
    }

    pub fn state(&self) -> LoaderState {
        LoaderState {
            cursor: self.rows.cursor(),
            rng: self.rng.state(),
            buffer: self.buffer.iter().map(|(_, p)| *p).collect(),
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
        if !self.opts.shuffle {
            return Ok(self.read_one()?.0);
        }
        while self.buffer.len() < self.opts.shuffle_buffer.max(1) {
            let item = self.read_one()?;
            self.buffer.push(item);
        }
        let i = self.rng.below(self.buffer.len() as u64) as usize;
        Ok(self.buffer.swap_remove(i).0)
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
    Ok(Example { input_ids, labels })
}

/// A padded micro-batch. `targets[b][t]` is the label position t predicts (labels shifted by
/// one), IGNORE where there is none.
pub struct MicroBatch {
    pub rows: usize,
    pub seq: usize,
    /// [B * S] row-major, padding id 0.
    pub input_ids: Vec<u32>,
    /// [B * S]
    pub targets: Vec<i64>,
    /// Non-padding input tokens.
    pub real_tokens: usize,
}

impl MicroBatch {
    pub fn collate(examples: &[Example]) -> MicroBatch {
        let seq = examples.iter().map(|e| e.input_ids.len()).max().unwrap_or(0);
        let rows = examples.len();
        let mut input_ids = vec![0u32; rows * seq];
        let mut targets = vec![IGNORE; rows * seq];
        for (b, e) in examples.iter().enumerate() {
            input_ids[b * seq..b * seq + e.input_ids.len()].copy_from_slice(&e.input_ids);
            for t in 0..e.labels.len().saturating_sub(1) {
                targets[b * seq + t] = e.labels[t + 1];
            }
        }
        MicroBatch { rows, seq, input_ids, targets, real_tokens: examples.iter().map(|e| e.input_ids.len()).sum() }
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
        let a = Example { input_ids: vec![5, 6, 7], labels: vec![IGNORE, 6, 7] };
        let b = Example { input_ids: vec![8, 9], labels: vec![8, 9] };
        let mb = MicroBatch::collate(&[a, b]);
        assert_eq!(mb.seq, 3);
        assert_eq!(mb.input_ids, vec![5, 6, 7, 8, 9, 0]);
        assert_eq!(mb.targets, vec![6, 7, IGNORE, 9, IGNORE, IGNORE]);
        assert_eq!(mb.num_targets(), 3);
        assert_eq!(mb.real_tokens, 5);
    }
}
