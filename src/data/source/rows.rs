//! `Rows`: the rows of a source in order across its shards, by position (`Cursor`), with one
//! decoded block kept.
use super::{shard_files_and_split, Block, JsonRow, Shard, Split};
use crate::error::{Error, Result};
use arrow_array::RecordBatch;
use std::path::{Path, PathBuf};

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
