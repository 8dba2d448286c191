//! Typed errors for the library. Each variant carries the context a user needs to fix the
//! input: the file, the key, the tensor name, expected vs got. Only `main` turns these into
//! `anyhow` and prints the chain (once, without backtraces).

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}{}", errno_note(source))]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A recipe problem: `key` is the dotted TOML key (`train.lr`), `msg` says what was expected.
    #[error("recipe {file}: key `{key}`: {msg}")]
    Recipe { file: String, key: String, msg: String },

    #[error("{path}: {msg}")]
    Config { path: PathBuf, msg: String },

    #[error("model {what}: {msg}")]
    Model { what: String, msg: String },

    #[error("{file}: not a valid safetensors file: {msg}")]
    Safetensors { file: PathBuf, msg: String },

    #[error("tensor `{name}` missing (looked in {files})")]
    MissingTensor { name: String, files: String },

    #[error("tensor `{name}` in {file}: expected shape {expected:?}, got {got:?}")]
    Shape { name: String, file: String, expected: Vec<usize>, got: Vec<usize> },

    #[error("adapter {dir}: {msg}")]
    Adapter { dir: PathBuf, msg: String },

    /// A GGUF file `finetune import` cannot turn into a model folder: `key` is the metadata
    /// key at fault (`llama.attention.head_count`), else the tensor name or the header field.
    #[error("GGUF {file}: `{key}`: {msg}")]
    Gguf { file: PathBuf, key: String, msg: String },

    /// A hub download or cache lookup: `repo` is `model org/name@revision`.
    #[error("hub {repo}: {msg}")]
    Hub { repo: String, msg: String },

    #[error("dataset {path}: {msg}")]
    Data { path: PathBuf, msg: String },

    #[error("tokenizer {path}: {msg}")]
    Tokenizer { path: PathBuf, msg: String },

    #[error("training: {0}")]
    Train(String),

    /// `export`: what cannot be written as asked.
    #[error("export: {0}")]
    Export(String),

    /// `generate` / `eval`: a prompt or sampling option that cannot be used.
    #[error("generate: {0}")]
    Generate(String),

    /// A problem between ranks (a collective timed out, a rank left, ranks out of step).
    #[error("rank {rank}: {msg}")]
    Dist { rank: usize, msg: String },

    /// This rank stopped because another one failed (the other's error is the one to show).
    #[error("rank {rank}: {msg}")]
    PeerFailed { rank: usize, msg: String },

    /// Stopped by a signal (SIGINT 2, SIGTERM 15) before the work was done; what it would
    /// have written is not there (`main` exits with 128 + the signal).
    #[error("stopped by {}", signal_name(*signal as i64))]
    Interrupted { signal: usize },

    /// A candle error with its backtrace stripped (RUST_BACKTRACE=1 makes candle attach one;
    /// users want the message, not 60 frames).
    #[error("tensor op `{op}`: {msg}")]
    Candle { op: String, msg: String },
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
    pub fn data(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Data { path: path.into(), msg: msg.into() }
    }
    pub fn model(what: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Model { what: what.into(), msg: msg.into() }
    }
}

/// A signal's name as users know it.
pub fn signal_name(signal: i64) -> String {
    match signal {
        1 => "SIGHUP".into(),
        2 => "SIGINT (Ctrl-C)".into(),
        15 => "SIGTERM".into(),
        n => format!("signal {n}"),
    }
}

/// The errno name of the I/O failures a user must act on outside this tool, so the message
/// says "disk full" in words a search finds, not only as "os error 28".
fn errno_note(e: &std::io::Error) -> String {
    let name = match e.raw_os_error() {
        Some(libc::ENOSPC) => "ENOSPC: the disk is full",
        Some(libc::EDQUOT) => "EDQUOT: the disk quota is used up",
        Some(libc::EROFS) => "EROFS: the file system is read-only",
        Some(libc::EACCES) => "EACCES: permission denied",
        Some(libc::EFBIG) => "EFBIG: the file size limit (ulimit -f) was reached",
        _ => return String::new(),
    };
    format!(" [{name}]")
}

/// Message of a candle error without its backtrace wrapper.
pub fn candle_msg(e: &candle_core::Error) -> String {
    match e {
        candle_core::Error::WithBacktrace { inner, .. } => candle_msg(inner),
        candle_core::Error::WithPath { inner, path } => format!("{}: {}", path.display(), candle_msg(inner)),
        candle_core::Error::Context { inner, context } => format!("{context}: {}", candle_msg(inner)),
        other => other.to_string(),
    }
}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        Error::Candle { op: "compute".into(), msg: candle_msg(&e) }
    }
}

/// Attach the name of what was being computed to a candle error.
pub trait CandleContext<T> {
    fn ctx(self, op: &str) -> Result<T>;
}

impl<T> CandleContext<T> for std::result::Result<T, candle_core::Error> {
    fn ctx(self, op: &str) -> Result<T> {
        self.map_err(|e| Error::Candle { op: op.to_string(), msg: candle_msg(&e) })
    }
}
