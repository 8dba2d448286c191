//! Which files a data entry means: splits (a DatasetDict, split-named files, `dir:split`,
//! `data.split`) and the shards of a folder.
use crate::error::{Error, Result};
use std::ops::Range;
use std::path::{Path, PathBuf};

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
    pub(super) fn by_data_split(&self) -> bool {
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
pub(super) fn shard_files_and_split(spec: &Path, split: Split) -> Result<(Vec<PathBuf>, bool)> {
    let s = spec.to_string_lossy();
    // "dir:split", or "file.jsonl:split" (refused below: a file has no splits); only where
    // no file is named so, since a colon may be part of a file name.
    if let Some((dir, sp)) = s.rsplit_once(':') {
        let d = Path::new(dir);
        if d.exists() && !spec.exists() {
            return Ok((shard_files(d, split.named(sp))?, false));
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
pub(super) fn release(map: &memmap2::Mmap, range: Range<usize>) {
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
