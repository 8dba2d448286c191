//! Models and datasets named by a hub repo id arrive on first use.
//!
//! A repo id (`org/name`, with an optional revision) resolves to a snapshot folder in the
//! standard hub cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`:
//! `models--org--name/{blobs,refs,snapshots,.no_exist}`), so transformers and huggingface_hub
//! find the same files and we find theirs.
//!
//! - **Cache first, no request when complete.** A snapshot that holds every file a job needs
//!   (or a `.no_exist` marker for an optional file the repo lacks) is used without touching
//!   the network, so a second run works offline and starts at once.
//! - **Only what the job needs.** `plan` fetches config.json; training fetches config,
//!   tokenizer files and the safetensors shards the index names, never `.bin` or GGUF copies.
//! - **Downloads are the hf-hub crate's** (resolve URL, redirects, `Range` resume of the
//!   `.part` file, retries with backoff); we add the checks it lacks: the blob's size against
//!   what the hub announced, and its sha256 against the ETag when the ETag is one (LFS files).
//!   A bad blob is deleted and the error says so, so a rerun fetches it again.
//! - **Environment as huggingface_hub reads it:** `HF_ENDPOINT` (mirrors), `HF_TOKEN` (else the
//!   cache's `token` file) for gated repos, `HF_HUB_OFFLINE=1` for cache-only (a missing file is
//!   an error naming it).

use crate::data::source::Split;
use crate::error::{Error, Result};
use hf_hub::api::sync::{Api, ApiBuilder, ApiError};
use hf_hub::{Repo, RepoType};
use sha2::Digest;
use std::io::Read;
use std::path::{Path, PathBuf};

/// What a job needs from a model repo.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// config.json only (`finetune plan`).
    Config,
    /// config, tokenizer files and the safetensors weights.
    Model,
}

/// Tokenizer and generation files a model may have; fetched when present, none required.
const MODEL_OPTIONAL: &[&str] =
    &["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "chat_template.jinja", "tokenizer.model"];

/// Data files a dataset repo's splits are stored in (what `data::source` reads).
const DATA_EXTENSIONS: &[&str] = &["parquet", "arrow", "jsonl"];

/// Whether `s` names a hub repo rather than a local path: `org/name`, one slash, no leading
/// `.` or `/`. The caller checks the local path first, so a folder named like a repo wins.
pub fn looks_like_repo(s: &str) -> bool {
    !s.starts_with('.') && !s.starts_with('/') && s.matches('/').count() == 1 && !s.ends_with('/') && !s.contains(char::is_whitespace)
}

/// A hub error for a name that could also have been a local path: say that no such path
/// exists either, so a typo in a relative path is not read as a hub problem.
pub fn not_local_either(e: Error, local: &Path) -> Error {
    match e {
        Error::Hub { repo, msg } => Error::Hub { repo, msg: format!("{msg} (and no local path {} exists)", local.display()) },
        other => other,
    }
}

/// The hub as this process's environment describes it.
#[derive(Clone, Debug)]
pub struct Hub {
    /// The cache root (`.../hub`).
    pub cache: PathBuf,
    endpoint: String,
    token: Option<String>,
    offline: bool,
    /// How long a request may go without an answer: a listing (huggingface_hub's
    /// `HF_HUB_ETAG_TIMEOUT`) and a download without a byte (`HF_HUB_DOWNLOAD_TIMEOUT`), 10 s
    /// each by default as there.
    listing_timeout: std::time::Duration,
    download_timeout: std::time::Duration,
}

impl Hub {
    /// The cache, endpoint, token and offline switch, read as huggingface_hub reads them.
    pub fn from_env() -> Result<Hub> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        // huggingface_hub expands a leading `~` in these (an env file or a Dockerfile's ENV
        // leaves it unexpanded).
        let path = |v: String| match (v.strip_prefix('~'), var("HOME")) {
            (Some(rest), Some(home)) if rest.is_empty() || rest.starts_with('/') => PathBuf::from(format!("{home}{rest}")),
            _ => PathBuf::from(v),
        };
        let hf_home = match (var("HF_HOME"), var("XDG_CACHE_HOME"), var("HOME")) {
            (Some(h), _, _) => Some(path(h)),
            (None, Some(x), _) => Some(path(x).join("huggingface")),
            (None, None, Some(home)) => Some(PathBuf::from(home).join(".cache/huggingface")),
            (None, None, None) => None,
        };
        // HUGGINGFACE_HUB_CACHE: the older name huggingface_hub still reads.
        let cache = match (var("HF_HUB_CACHE").or_else(|| var("HUGGINGFACE_HUB_CACHE")), &hf_home) {
            (Some(c), _) => path(c),
            (None, Some(h)) => h.join("hub"),
            (None, None) => {
                return Err(Error::Hub { repo: "(any)".into(), msg: "none of HF_HUB_CACHE, HF_HOME or HOME is set, so there is no hub cache folder".into() })
            }
        };
        // HF_TOKEN wins over the file `huggingface-cli login` saves (HF_TOKEN_PATH, else
        // HF_HOME/token), wherever the cache itself lives.
        let token_file = var("HF_TOKEN_PATH").map(path).or_else(|| hf_home.map(|h| h.join("token")));
        let token = var("HF_TOKEN").or_else(|| std::fs::read_to_string(token_file?).ok().map(|t| t.trim().to_string()).filter(|t| !t.is_empty()));
        // TRANSFORMERS_OFFLINE=1 means offline to huggingface_hub too.
        let on = |k: &str| var(k).is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"));
        let offline = on("HF_HUB_OFFLINE") || on("TRANSFORMERS_OFFLINE");
        let endpoint = var("HF_ENDPOINT").unwrap_or_else(|| "https://huggingface.co".into()).trim_end_matches('/').to_string();
        // (huggingface_hub reads 0 as its default, 10 s.)
        let seconds = |k: &str| -> Result<std::time::Duration> {
            match var(k).map(|v| (v.trim().parse::<f64>().ok(), v)) {
                None => Ok(std::time::Duration::from_secs(10)),
                Some((Some(0.0), _)) => Ok(std::time::Duration::from_secs(10)),
                Some((s, v)) => s.filter(|s| s.is_finite() && *s > 0.0 && *s < 1e9).map(std::time::Duration::from_secs_f64).ok_or_else(|| Error::Hub {
                    repo: "(any)".into(),
                    msg: format!("{k} = {v:?}: expected a number of seconds (0 for the default, 10)"),
                }),
            }
        };
        let (listing_timeout, download_timeout) = (seconds("HF_HUB_ETAG_TIMEOUT")?, seconds("HF_HUB_DOWNLOAD_TIMEOUT")?);
        Ok(Hub { cache, endpoint, token, offline, listing_timeout, download_timeout })
    }

    /// The snapshot folder of model `id` at `revision` (default `main`) holding what `want`
    /// names, downloading what the cache lacks.
    pub fn model(&self, id: &str, revision: Option<&str>, want: Want) -> Result<PathBuf> {
        let repo = CachedRepo::new(self, id, RepoType::Model, revision)?;
        if let Some(dir) = repo.complete(want) {
            return Ok(dir);
        }
        if self.offline {
            return Err(repo.offline_err(&repo.first_missing(want)));
        }
        // One downloader per repo at a time, across ranks, processes and jobs: the others wait
        // here and then find the cache complete. A cache we cannot write (a shared read-only
        // mount filled by another tool) is used as it is when the weights are there.
        let _lock = match (repo.lock(), repo.required_present(want)) {
            (Ok(l), _) => l,
            (Err(e), Some(snap)) => {
                crate::note!("warning: {e}; using the cached snapshot {} as it is", snap.display());
                return Ok(snap);
            }
            (Err(e), None) => return Err(e),
        };
        if let Some(dir) = repo.complete(want) {
            return Ok(dir);
        }
        let listing = match repo.listing() {
            Ok(l) => l,
            // A cache filled by another tool may lack our markers for absent optional files;
            // with the weights there and the hub out of reach, use it, as transformers does.
            Err((true, msg)) if repo.required_present(want).is_some() => {
                let snap = repo.required_present(want).unwrap_or_default();
                crate::note!("warning: {msg}; using the cached snapshot {}", snap.display());
                return Ok(snap);
            }
            Err((_, msg)) => return Err(msg),
        };
        let has = |f: &str| listing.files.iter().any(|s| s == f);
        if !has("config.json") {
            return Err(repo.err(format!("has no config.json at commit {} (is it a model repo, and is the revision right?)", listing.commit)));
        }
        let mut files = vec!["config.json".to_string()];
        if want == Want::Model {
            files.extend(MODEL_OPTIONAL.iter().filter(|f| has(f)).map(|f| f.to_string()));
            // The single file first where a repo has both, as transformers downloads it (and
            // `ModelDir` reads it).
            if has("model.safetensors") {
                files.push("model.safetensors".into());
            } else if has("model.safetensors.index.json") {
                repo.fetch(&listing.commit, "model.safetensors.index.json")?;
                let index = repo.snapshot(&listing.commit).join("model.safetensors.index.json");
                files.extend(index_shards(&index)?);
            } else {
                return Err(repo.err("has no model.safetensors or model.safetensors.index.json (only safetensors weights are read)"));
            }
        }
        for f in &files {
            repo.fetch(&listing.commit, f)?;
        }
        if want == Want::Model {
            repo.mark_absent(&listing.commit, MODEL_OPTIONAL.iter().filter(|f| !has(f)).copied())?;
        }
        repo.set_ref(&listing.commit)?;
        Ok(repo.snapshot(&listing.commit))
    }

    /// config.json of model `id` when the cache has it (no request).
    pub fn cached_config(&self, id: &str, revision: Option<&str>) -> Option<PathBuf> {
        let repo = CachedRepo::new(self, id, RepoType::Model, revision).ok()?;
        repo.complete(Want::Config).map(|snap| snap.join("config.json"))
    }

    /// The snapshot folder of model `id` when the cache holds its weights (no request).
    pub fn cached_model(&self, id: &str, revision: Option<&str>) -> Option<PathBuf> {
        CachedRepo::new(self, id, RepoType::Model, revision).ok()?.complete(Want::Model)
    }

    /// The data files of dataset `id` (Parquet, Arrow or JSONL anywhere in the repo) of
    /// `split` (see [`choose_split`]).
    pub fn dataset(&self, id: &str, revision: Option<&str>, split: Split) -> Result<Vec<PathBuf>> {
        let repo = CachedRepo::new(self, id, RepoType::Dataset, revision)?;
        let cached = |repo: &CachedRepo| -> Result<Option<Vec<PathBuf>>> {
            let Some((commit, all, walked)) = repo.saved_listing() else { return Ok(None) };
            if walked {
                check_partial_snapshot(&all, split).map_err(|m| repo.err(m))?;
            }
            let chosen = choose_split(&all, split).map_err(|m| repo.err(m))?;
            let snap = repo.snapshot(&commit);
            Ok(chosen.iter().all(|f| snap.join(f).is_file()).then(|| chosen.iter().map(|f| snap.join(f)).collect()))
        };
        if let Some(files) = cached(&repo)? {
            return Ok(files);
        }
        if self.offline {
            return Err(repo.offline_err("its data files"));
        }
        let _lock = repo.lock()?;
        if let Some(files) = cached(&repo)? {
            return Ok(files);
        }
        let listing = repo.listing().map_err(|(_, msg)| msg)?;
        let mut all: Vec<String> = listing.files.iter().filter(|f| is_data_file(f)).cloned().collect();
        // A repo whose data is .json files (JSON lines or one array each, as
        // yahma/alpaca-cleaned's), read where it has no other data files.
        if all.is_empty() {
            all = listing.files.iter().filter(|f| crate::data::source::is_json_data_file(Path::new(f.as_str()))).cloned().collect();
        }
        if all.is_empty() {
            return Err(repo.err(format!("has no {} or .json files", DATA_EXTENSIONS.iter().map(|e| format!(".{e}")).collect::<Vec<_>>().join(", "))));
        }
        let chosen = choose_split(&all, split).map_err(|m| repo.err(m))?;
        for f in &chosen {
            repo.fetch(&listing.commit, f)?;
        }
        repo.save_listing(&listing.commit, &all)?;
        repo.set_ref(&listing.commit)?;
        let snap = repo.snapshot(&listing.commit);
        Ok(chosen.iter().map(|f| snap.join(f)).collect())
    }
}

/// One repo in the cache, and how to fill it.
struct CachedRepo<'a> {
    hub: &'a Hub,
    id: String,
    kind: RepoType,
    revision: String,
    dir: PathBuf,
}

struct Listing {
    commit: String,
    files: Vec<String>,
}

/// A name from outside (revision, commit, file) that becomes part of a path in the cache.
fn safe_relative(s: &str) -> bool {
    !s.is_empty() && !s.starts_with('/') && !s.contains('\\') && !s.split('/').any(|c| c.is_empty() || c == "." || c == "..")
}

/// The commit of the snapshot folder a cached file lies in (`.../snapshots/<commit>/...`).
pub fn snapshot_commit(file: &Path) -> Option<String> {
    let dirs: Vec<&std::ffi::OsStr> = file.iter().collect();
    let at = dirs.iter().rposition(|c| *c == "snapshots")?;
    dirs.get(at + 1).and_then(|c| c.to_str()).filter(|c| is_commit(c)).map(String::from)
}

/// A data entry in the hub's syntax, `org/name[@revision][:split]`, in its parts.
pub struct DataEntry<'a> {
    /// All before `:split` (what a local path would be).
    pub path: &'a str,
    pub id: &'a str,
    pub revision: Option<&'a str>,
    pub split: Option<&'a str>,
}

impl<'a> DataEntry<'a> {
    pub fn parse(s: &'a str) -> Self {
        let (path, split) = match s.rsplit_once(':') {
            Some((a, b)) if !b.contains('/') && !a.is_empty() => (a, Some(b)),
            _ => (s, None),
        };
        let (id, revision) = match path.split_once('@') {
            Some((i, r)) => (i, Some(r)),
            None => (path, None),
        };
        DataEntry { path, id, revision, split }
    }

    /// The entry at `revision` (none: without one), its split kept.
    pub fn at(&self, revision: Option<&str>) -> String {
        format!("{}{}{}", self.id, revision.map(|r| format!("@{r}")).unwrap_or_default(), self.split.map(|s| format!(":{s}")).unwrap_or_default())
    }
}

/// A full commit id: 40 hex digits.
pub fn is_commit(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

impl<'a> CachedRepo<'a> {
    fn new(hub: &'a Hub, id: &str, kind: RepoType, revision: Option<&str>) -> Result<Self> {
        let mut revision = revision.unwrap_or("main").to_string();
        // Snapshot folders are named by the lower-case commit.
        if is_commit(&revision) {
            revision = revision.to_ascii_lowercase();
        }
        let dir = hub.cache.join(Repo::new(id.to_string(), kind).folder_name());
        let repo = CachedRepo { hub, id: id.to_string(), kind, revision, dir };
        if !safe_relative(&repo.revision) {
            return Err(repo.err("the revision must be a branch, tag or commit name (no `..`, no leading `/`)"));
        }
        Ok(repo)
    }

    fn kind_name(&self) -> &'static str {
        if matches!(self.kind, RepoType::Dataset) { "dataset" } else { "model" }
    }

    fn err(&self, msg: impl std::fmt::Display) -> Error {
        Error::Hub { repo: format!("{} {}@{}", self.kind_name(), self.id, self.revision), msg: msg.to_string() }
    }

    fn offline_err(&self, missing: &str) -> Error {
        self.err(format!(
            "HF_HUB_OFFLINE is set and the cache at {} lacks {missing}; unset HF_HUB_OFFLINE to download it",
            self.hub.cache.display()
        ))
    }

    /// The hub's answer in words a user acts on. The hub says which case it is in
    /// `X-Error-Code`: a repo that does not exist (or that a missing token hides) answers 401
    /// too, so the status alone would send people after a token they do not need.
    fn api_err(&self, e: &ApiError, doing: &str) -> Error {
        let revision_key = if matches!(self.kind, RepoType::Dataset) { "the `@revision` of the data entry" } else { "model.revision" };
        let msg = match e {
            ApiError::RequestError(r) => match r.as_ref() {
                ureq::Error::Status(code, resp) => {
                    let what = resp.header("x-error-code").unwrap_or("").to_string();
                    let token = if self.hub.token.is_some() { "the token given (HF_TOKEN) was refused" } else { "no token is set" };
                    match (what.as_str(), *code) {
                        ("GatedRepo", _) => format!("the repo is gated: accept its terms on the hub and set HF_TOKEN to a token with access ({token}; HTTP {code} while trying to {doing})"),
                        ("RepoNotFound", _) | ("", 401) => format!(
                            "no such {} repo, or it is private ({token}): check the repo id, or set HF_TOKEN for a private repo (HTTP {code} while trying to {doing})",
                            self.kind_name()
                        ),
                        ("RevisionNotFound", _) => format!("the repo has no revision `{}`: check {revision_key} (HTTP {code})", self.revision),
                        ("EntryNotFound", _) => format!("the hub has no such file (HTTP {code} while trying to {doing})"),
                        (_, 403) => format!("the hub refused access ({token}; HTTP 403 while trying to {doing})"),
                        (_, 404) => format!("no such repo, revision or file (HTTP 404 while trying to {doing}): check the repo id and {revision_key}"),
                        (_, code) => format!("the hub answered HTTP {code} while trying to {doing}"),
                    }
                }
                ureq::Error::Transport(t) => format!(
                    "could not reach {} to {doing}: {t}; set HF_ENDPOINT for a mirror, or HF_HUB_OFFLINE=1 to use only the cache",
                    self.hub.endpoint
                ),
            },
            ApiError::LockAcquisition(p) => format!("another process is downloading {} (its lock is {}); wait for it, then run again", doing, p.display()),
            other => format!("could not {doing}: {other}"),
        };
        self.err(msg)
    }

    /// Wait for the repo's download lock (an `flock`: it dies with its process), saying so
    /// when another process holds it.
    fn lock(&self) -> Result<std::fs::File> {
        let path = self.dir.join(".finetune").join("download.lock");
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        }
        let f = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&path).map_err(|e| Error::io(&path, e))?;
        let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            crate::note!("waiting for another process downloading {} {} (lock {})", self.kind_name(), self.id, path.display());
            // SAFETY: as above; blocks until the lock is ours.
            if unsafe { libc::flock(fd, libc::LOCK_EX) } != 0 {
                return Err(Error::io(&path, std::io::Error::last_os_error()));
            }
        }
        Ok(f)
    }

    fn commit_of_ref(&self) -> Option<String> {
        if is_commit(&self.revision) {
            return Some(self.revision.clone());
        }
        let text = std::fs::read_to_string(self.dir.join("refs").join(&self.revision)).ok()?;
        Some(text.trim().to_ascii_lowercase()).filter(|c| is_commit(c))
    }

    fn snapshot(&self, commit: &str) -> PathBuf {
        self.dir.join("snapshots").join(commit)
    }

    /// The cached snapshot of the revision when it has the files `want` cannot do without.
    fn required_present(&self, want: Want) -> Option<PathBuf> {
        let snap = self.snapshot(&self.commit_of_ref()?);
        model_files_present(&snap, want).then_some(snap)
    }

    /// The cached snapshot of the revision when it holds what `want` needs. For training,
    /// each optional file must also be known: present, or marked absent by an earlier
    /// download (offline, what is there is all there is).
    fn complete(&self, want: Want) -> Option<PathBuf> {
        let snap = self.required_present(want)?;
        let commit = self.commit_of_ref()?;
        let marked = |f: &str| self.dir.join(".no_exist").join(&commit).join(f).exists();
        let known = want == Want::Config || MODEL_OPTIONAL.iter().all(|f| snap.join(f).is_file() || marked(f));
        (known || self.hub.offline).then_some(snap)
    }

    /// The first file the cache lacks for `want`, for the offline error.
    fn first_missing(&self, want: Want) -> String {
        let Some(commit) = self.commit_of_ref() else {
            return format!("refs/{} (the revision was never downloaded)", self.revision);
        };
        let snap = self.snapshot(&commit);
        let mut need = vec!["config.json".to_string()];
        if want == Want::Model {
            let index = snap.join("model.safetensors.index.json");
            match index_shards(&index) {
                Ok(shards) => need.extend(shards),
                Err(_) if index.is_file() => need.push("model.safetensors.index.json".into()),
                Err(_) => need.push("model.safetensors".into()),
            }
        }
        need.into_iter().find(|f| !snap.join(f).is_file()).unwrap_or_else(|| "nothing it needs".into())
    }

    /// The repo's commit for the revision and its file names (a failure carries the
    /// hub's error too, to tell an unreachable hub from a refusal).
    fn listing(&self) -> std::result::Result<Listing, (bool, Error)> {
        let repo = Repo::with_revision(self.id.clone(), self.kind, self.revision.clone());
        let api = self.api();
        let asked = answered(self.hub.listing_timeout, &Default::default(), move || api.and_then(|a| a.repo(repo).info()));
        let info = match asked {
            Some(Ok(i)) => i,
            Some(Err(e)) => return Err((is_unreachable(&e), self.api_err(&e, "list the repo's files"))),
            None => return Err((true, self.no_answer(self.hub.listing_timeout, "list the repo's files", "HF_HUB_ETAG_TIMEOUT"))),
        };
        let commit = info.sha.to_ascii_lowercase();
        let bad = |m: String| (false, self.err(m));
        if !is_commit(&commit) {
            return Err(bad(format!("the hub's listing gave `{}` as the commit, not a 40-digit hex id", info.sha)));
        }
        let files: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
        if let Some(f) = files.iter().find(|f| !safe_relative(f)) {
            return Err(bad(format!("the hub's listing names a file outside the repo: {f:?}")));
        }
        Ok(Listing { commit, files })
    }

    fn api(&self) -> std::result::Result<Api, ApiError> {
        ApiBuilder::from_cache(hf_hub::Cache::new(self.hub.cache.clone()))
            .with_endpoint(self.hub.endpoint.clone())
            .with_token(self.hub.token.clone())
            .with_progress(false)
            // A dropped connection resumes from the `.part` file's length, with backoff.
            .with_retries(5)
            .build()
    }

    /// Download `file` into the snapshot of `commit` unless it is there, and check it.
    fn fetch(&self, commit: &str, file: &str) -> Result<()> {
        let pointer = self.snapshot(commit).join(file);
        if pointer.is_file() {
            return Ok(());
        }
        // A link whose blob is gone (pruned by hand, or deleted by a failed check) would make
        // hf-hub's symlink fail on every run.
        if std::fs::symlink_metadata(&pointer).is_ok() {
            std::fs::remove_file(&pointer).map_err(|e| Error::io(&pointer, e))?;
        }
        let (got, bar) = self.download(commit, file)?;
        let got = match got {
            // A `.part` hf-hub cannot continue (already whole: the hub answers 416; longer than
            // the file: a server that ignored the range) is started over, once.
            Err(ApiError::InvalidResume) => {
                self.remove_partials()?;
                self.download(commit, file)?.0
            }
            // Only a `.part` the hub says is already whole (416) is reset; other failures keep
            // it, so a rerun resumes where this one stopped.
            Err(ApiError::TooManyRetries(inner)) if matches!(inner.as_ref(), ApiError::RequestError(r) if matches!(r.as_ref(), ureq::Error::Status(416, _))) => {
                self.remove_partials()?;
                self.download(commit, file)?.0
            }
            other => other,
        };
        let got = got.map_err(|e| self.api_err(&e, &format!("download {file}")))?;
        if got != pointer {
            return Err(self.err(format!("{file}: the hub served it from {} instead of commit {commit}", got.display())));
        }
        let blob = pointer.canonicalize().map_err(|e| Error::io(&pointer, e))?;
        if let Err(msg) = verify_blob(&blob, bar.size) {
            let _ = std::fs::remove_file(&pointer);
            let _ = std::fs::remove_file(&blob);
            return Err(self.err(format!("{file}: {msg}; the download was deleted, run again to fetch it anew")));
        }
        // hf-hub records the commit it was asked for as a ref; huggingface_hub keeps refs for
        // branch and tag names only.
        let _ = std::fs::remove_file(self.dir.join("refs").join(commit));
        Ok(())
    }

    /// One download of `file` (hf-hub's, with its retries), waited for while bytes arrive:
    /// an error naming HF_HUB_DOWNLOAD_TIMEOUT when none come for that long. Pinned to
    /// `commit`, so every file comes from the commit the listing named even if the branch
    /// moves meanwhile.
    fn download(&self, commit: &str, file: &str) -> Result<(std::result::Result<PathBuf, ApiError>, Bar)> {
        let progress = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut bar = Bar { progress: progress.clone(), ..Default::default() };
        let (api, repo, name) = (self.api(), Repo::with_revision(self.id.clone(), self.kind, commit.to_string()), file.to_string());
        let asked = answered(self.hub.download_timeout, &progress, move || {
            let got = api.and_then(|a| a.repo(repo).download_with_progress(&name, &mut bar));
            (got, bar)
        });
        asked.ok_or_else(|| self.no_answer(self.hub.download_timeout, &format!("download {file}"), "HF_HUB_DOWNLOAD_TIMEOUT"))
    }

    /// The hub (or the network) went silent for `timeout` while we tried `doing`.
    fn no_answer(&self, timeout: std::time::Duration, doing: &str, key: &str) -> Error {
        self.err(format!(
            "{} sent nothing for {:.0} s while we tried to {doing}; a slow connection can allow more with {key} (seconds), \
             HF_ENDPOINT names a mirror, HF_HUB_OFFLINE=1 uses only the cache",
            self.hub.endpoint,
            timeout.as_secs_f64()
        ))
    }

    /// Unfinished downloads of this repo (we hold its lock, so none is in progress).
    fn remove_partials(&self) -> Result<()> {
        let blobs = self.dir.join("blobs");
        for e in std::fs::read_dir(&blobs).map_err(|e| Error::io(&blobs, e))?.flatten() {
            if e.path().extension().is_some_and(|x| x == "part") {
                std::fs::remove_file(e.path()).map_err(|err| Error::io(e.path(), err))?;
            }
        }
        Ok(())
    }

    /// huggingface_hub's marker for "the repo has no such file at this commit", so the next
    /// run knows the cache is complete without asking.
    fn mark_absent<'f>(&self, commit: &str, files: impl Iterator<Item = &'f str>) -> Result<()> {
        let dir = self.dir.join(".no_exist").join(commit);
        for f in files {
            std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
            std::fs::write(dir.join(f), b"").map_err(|e| Error::io(dir.join(f), e))?;
        }
        Ok(())
    }

    fn set_ref(&self, commit: &str) -> Result<()> {
        if self.revision == commit {
            return Ok(());
        }
        let path = self.dir.join("refs").join(&self.revision);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        }
        crate::fsutil::write_atomic(&path, commit.as_bytes())
    }

    /// Where a dataset's file listing is kept: in our own folder beside the cache's, which
    /// huggingface_hub ignores.
    fn listing_path(&self, commit: &str) -> PathBuf {
        self.dir.join(".finetune").join(format!("{commit}.files.json"))
    }

    /// The dataset's data files at the revision's commit: our saved listing, or (offline, for
    /// a snapshot another tool filled) the data files the snapshot holds.
    /// The commit the ref names and the repo's data files: as the listing saved when they
    /// were fetched, or offline, without one (a cache another tool filled), the files its
    /// snapshot holds, which may be only part of the repo (`walked` true).
    fn saved_listing(&self) -> Option<(String, Vec<String>, bool)> {
        let commit = self.commit_of_ref()?;
        if let Some(files) = std::fs::read_to_string(self.listing_path(&commit)).ok().and_then(|t| serde_json::from_str(&t).ok()) {
            return Some((commit, files, false));
        }
        if !self.hub.offline {
            return None;
        }
        let snap = self.snapshot(&commit);
        let mut files = Vec::new();
        walk_files(&snap, &snap, &mut files);
        files.retain(|f| is_data_file(f));
        files.sort();
        (!files.is_empty()).then_some((commit, files, true))
    }

    fn save_listing(&self, commit: &str, files: &[String]) -> Result<()> {
        let path = self.listing_path(commit);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        }
        let text = serde_json::to_string(files).map_err(|e| self.err(e))?;
        crate::fsutil::write_atomic(&path, text.as_bytes())
    }
}

fn walk_files(root: &Path, dir: &Path, out: &mut Vec<String>) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            walk_files(root, &p, out);
        } else if let Ok(rel) = p.strip_prefix(root) {
            out.push(rel.to_string_lossy().to_string());
        }
    }
}

/// The hub could not be reached at all (as opposed to answering no).
fn is_unreachable(e: &ApiError) -> bool {
    matches!(e, ApiError::RequestError(r) if matches!(r.as_ref(), ureq::Error::Transport(_)))
}

/// A cached model snapshot holds what `want` needs: config, and for training the weights
/// the index names (or the single file).
fn model_files_present(snap: &Path, want: Want) -> bool {
    if !snap.join("config.json").is_file() {
        return false;
    }
    if want == Want::Config {
        return true;
    }
    let index = snap.join("model.safetensors.index.json");
    snap.join("model.safetensors").is_file() || index_shards(&index).is_ok_and(|shards| shards.iter().all(|s| snap.join(s).is_file()))
}

/// The shard files an index's weight_map names, each once (the index is read and checked as
/// loading reads it, `weights::read_index`).
fn index_shards(index: &Path) -> Result<Vec<String>> {
    let mut shards: Vec<String> = crate::weights::read_index(index)?.into_values().collect();
    shards.sort();
    shards.dedup();
    Ok(shards)
}

fn is_data_file(f: &str) -> bool {
    Path::new(f).extension().and_then(|e| e.to_str()).is_some_and(|e| DATA_EXTENSIONS.contains(&e))
}

/// The split a data file belongs to by the hub's naming: the first part of its name
/// (`train` in `data/train-00000-of-00002.parquet` or `train.jsonl`, `train_sft` in
/// `train_sft-00000-of-00003.parquet`), or for generic names (`data-00000-of-00001.arrow`,
/// `0.parquet`, as `save_to_disk` and some converters write them) the folder it is in.
fn split_of(f: &str) -> String {
    let p = Path::new(f);
    let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let lead = name.split(['-', '.']).next().unwrap_or("");
    let generic = lead.is_empty() || lead == "data" || lead.bytes().all(|b| b.is_ascii_digit());
    match p.parent().and_then(|d| d.file_name()).and_then(|d| d.to_str()) {
        Some(dir) if generic => dir.to_string(),
        _ => lead.to_string(),
    }
}

/// The splits `files` hold, by the hub's file naming, sorted, each once.
fn split_names(files: &[String]) -> Vec<String> {
    let mut splits: Vec<String> = files.iter().map(|f| split_of(f)).collect();
    splits.sort();
    splits.dedup();
    splits
}

/// The files of one split ([`Split::pick`]): the one named; else the default (`train` for
/// training, `test` for evaluation) when the repo has files of that name, else every file
/// when they all carry one name (a single-file dataset). Several splits and not the default,
/// or one split spread over several folders (one per config) or file types, is an error
/// listing what there is: training silently on test files, or on two configs at once, would
/// be a wrong result with exit 0.
fn choose_split(files: &[String], split: Split) -> std::result::Result<Vec<String>, String> {
    let splits = split_names(files);
    let names: Vec<&str> = splits.iter().map(String::as_str).collect();
    let pick = split.pick(&names).map_err(|m| format!("{m}; pick one with `:<split>` after the repo id (or data.split for data.train)"))?;
    let chosen: Vec<String> = files.iter().filter(|f| split_of(f) == pick).cloned().collect();
    let group = |f: &String| {
        let p = Path::new(f.as_str());
        (p.parent().map(Path::to_path_buf), p.extension().map(|e| e.to_os_string()))
    };
    if chosen.iter().any(|f| group(f) != group(&chosen[0])) {
        return Err(format!(
            "split `{pick}` has files in several folders or formats ({}), e.g. one folder per config; download the repo and point the data entry at one folder",
            chosen.join(", ")
        ));
    }
    Ok(chosen)
}

/// What a snapshot another tool filled must show before its files stand for the repo's
/// (offline, the repo's own listing is unknown): the default split itself when none is
/// named (a snapshot holding only `test` files would otherwise pass for the only split and be
/// trained on), and every shard of a `-NNNNN-of-MMMMM` set (an interrupted download left part
/// of it). `datasets` refuses such a repo offline altogether.
fn check_partial_snapshot(files: &[String], split: Split) -> std::result::Result<(), String> {
    let fix = "another tool filled this cache, and offline the repo's own file list is unknown: unset HF_HUB_OFFLINE to complete it";
    let splits = split_names(files);
    if split.name.is_none() && !splits.iter().any(|s| s == split.default) {
        return Err(format!("its cached snapshot holds no `{}` split (only {}); {fix}, or name the split (`:<split>` after the repo id)", split.default, splits.join(", ")));
    }
    let mut sets: std::collections::BTreeMap<(String, usize), std::collections::HashSet<usize>> = Default::default();
    for f in files {
        let Some((stem, _)) = f.rsplit_once('.') else { continue };
        let parts: Vec<&str> = stem.rsplitn(4, '-').collect(); // [total, "of", index, prefix]
        if let [total, "of", index, prefix] = parts[..] {
            if let (Ok(t), Ok(i)) = (total.parse::<usize>(), index.parse::<usize>()) {
                sets.entry((prefix.to_string(), t)).or_default().insert(i);
            }
        }
    }
    if let Some(((prefix, total), got)) = sets.iter().find(|((_, t), got)| got.len() < *t) {
        return Err(format!("its cached snapshot holds {} of the {total} shards of {prefix}-*-of-{total:05}; {fix}", got.len()));
    }
    Ok(())
}

/// The checks hf-hub does not make: the size the hub announced, and the sha256 an LFS ETag is.
fn verify_blob(blob: &Path, announced: Option<usize>) -> std::result::Result<(), String> {
    let len = std::fs::metadata(blob).map_err(|e| e.to_string())?.len();
    if let Some(size) = announced {
        if len != size as u64 {
            return Err(format!("{len} bytes arrived, the hub announced {size}"));
        }
    }
    // The blob is named by its ETag; for LFS files that is the sha256 of the content.
    let etag = blob.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if etag.len() == 64 && etag.bytes().all(|b| b.is_ascii_hexdigit()) {
        let mut f = std::fs::File::open(blob).map_err(|e| e.to_string())?;
        let mut h = sha2::Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = f.read(&mut buf).map_err(|e| e.to_string())?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        let got: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        if !got.eq_ignore_ascii_case(etag) {
            return Err(format!("its sha256 is {got}, the hub's ETag says {etag}"));
        }
    }
    Ok(())
}

/// Run the hub request `request` on a thread of its own and wait for its answer while it
/// makes progress: `None` once `timeout` passes with no answer and no new byte counted in
/// `progress`. ureq, under hf-hub, has no read timeout, and a hub (or proxy) that accepts the
/// connection and then says nothing would hang the run before it starts; the abandoned
/// request dies with the process, which reports the error.
fn answered<T: Send + 'static>(timeout: std::time::Duration, progress: &std::sync::Arc<std::sync::atomic::AtomicU64>, request: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    use std::sync::atomic::Ordering;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(request());
    });
    // Bytes are looked for every tenth of the timeout, so a stall is seen within 1.1 of it.
    let (mut seen, mut last) = (progress.load(Ordering::Relaxed), std::time::Instant::now());
    loop {
        match rx.recv_timeout(timeout / 10) {
            Ok(v) => return Some(v),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                let now = progress.load(Ordering::Relaxed);
                if now != seen {
                    (seen, last) = (now, std::time::Instant::now());
                } else if last.elapsed() >= timeout {
                    return None;
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return None,
        }
    }
}

/// A byte progress bar per file on stderr (indicatif hides it when stderr is not a terminal),
/// the size the hub announced, for the check after, and the bytes received so far (what
/// [`answered`] watches).
#[derive(Default)]
struct Bar {
    bar: Option<indicatif::ProgressBar>,
    size: Option<usize>,
    progress: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl hf_hub::api::Progress for &mut Bar {
    fn init(&mut self, size: usize, filename: &str) {
        self.size = Some(size);
        if self.bar.is_none() {
            let bar = indicatif::ProgressBar::new(size as u64);
            let style = indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
            bar.set_style(style.progress_chars("=> "));
            bar.set_message(filename.to_string());
            self.bar = Some(bar);
        }
    }
    fn update(&mut self, n: usize) {
        self.progress.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        if let Some(b) = &self.bar {
            b.inc(n as u64);
        }
    }
    fn finish(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_partial_snapshot_read_offline_must_hold_the_default_split_and_whole_shard_sets() {
        // Offline without a saved listing, the snapshot's files stood for the repo's: only
        // the test file downloaded was "the only split" and trained on; half the train shards
        // were trained on as all of them.
        let train = Split::train(None);
        let only_test = names(&["data/test-00000-of-00001.parquet"]);
        let e = check_partial_snapshot(&only_test, train).unwrap_err();
        assert!(e.contains("no `train` split") && e.contains("HF_HUB_OFFLINE"), "{e}");
        assert!(check_partial_snapshot(&only_test, train.named("test")).is_ok(), "named: what is there is what was asked for");
        let half = names(&["data/train-00000-of-00002.parquet", "data/test-00000-of-00001.parquet"]);
        let e = check_partial_snapshot(&half, train).unwrap_err();
        assert!(e.contains("1 of the 2 shards of data/train-*-of-00002"), "{e}");
        let whole = names(&["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet", "train.jsonl"]);
        assert!(check_partial_snapshot(&whole, train).is_ok());
    }

    #[test]
    fn split_files_are_chosen_by_the_hubs_naming() {
        let files = names(&["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet", "data/test-00000-of-00001.parquet"]);
        let train = Split::train(None);
        assert_eq!(choose_split(&files, train).unwrap(), files[..2].to_vec());
        assert_eq!(choose_split(&files, train.named("test")).unwrap(), files[2..].to_vec());
        assert!(choose_split(&files, train.named("validation")).unwrap_err().contains("no split `validation`"));
        assert_eq!(choose_split(&files, Split::eval(None)).unwrap(), files[2..].to_vec(), "evaluation reads test, not train");
        let flat = names(&["alpaca.jsonl"]);
        assert_eq!(choose_split(&flat, train).unwrap(), flat);
        let dirs = names(&["train/data-00000-of-00001.arrow", "test/data-00000-of-00001.arrow"]);
        assert_eq!(choose_split(&dirs, train).unwrap(), names(&["train/data-00000-of-00001.arrow"]));
    }

    #[test]
    fn several_splits_without_train_or_several_configs_are_refused() {
        let ultrachat = names(&["data/train_sft-00000-of-00003.parquet", "data/test_sft-00000-of-00001.parquet", "data/train_gen-00000-of-00003.parquet"]);
        let train = Split::train(None);
        let e = choose_split(&ultrachat, train).unwrap_err();
        assert!(e.contains("none named train") && e.contains("train_sft"), "{e}");
        assert_eq!(choose_split(&ultrachat, train.named("train_sft")).unwrap(), ultrachat[..1].to_vec());
        let configs = names(&["en/train-00000-of-00001.parquet", "fr/train-00000-of-00001.parquet"]);
        assert!(choose_split(&configs, train).unwrap_err().contains("several folders"));
        let mixed = names(&["train.jsonl", "data/train-00000-of-00001.parquet"]);
        assert!(choose_split(&mixed, train).unwrap_err().contains("several folders or formats"));
    }

    #[test]
    fn names_from_outside_stay_inside_the_cache() {
        assert!(safe_relative("main") && safe_relative("refs/pr/1") && safe_relative("data/train.parquet"));
        assert!(!safe_relative("../x") && !safe_relative("/etc") && !safe_relative("a/../../b") && !safe_relative(""));
    }

    #[test]
    fn a_blob_whose_sha256_is_not_its_etag_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let good = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"; // sha256("hello")
        std::fs::write(dir.path().join(good), b"hello").unwrap();
        assert!(verify_blob(&dir.path().join(good), Some(5)).is_ok());
        assert!(verify_blob(&dir.path().join(good), Some(6)).unwrap_err().contains("announced 6"));
        let bad = "0".repeat(64);
        std::fs::write(dir.path().join(&bad), b"hello").unwrap();
        assert!(verify_blob(&dir.path().join(&bad), Some(5)).unwrap_err().contains("sha256"));
    }

    #[test]
    fn repo_ids_and_paths_are_told_apart() {
        assert!(looks_like_repo("deepseek-ai/deepseek-llm-7b-base"));
        assert!(!looks_like_repo("./models/x"));
        assert!(!looks_like_repo("/abs/x"));
        assert!(!looks_like_repo("a/b/c"));
        assert!(!looks_like_repo("model"));
    }
}
