//! finetune: LoRA fine-tuning of DeepSeek-style (Llama / Qwen2) checkpoints on candle.
//! See ARCHITECTURE.md for the map.

pub mod alloc;
pub mod checkpoint;
pub mod chat;
pub mod config;
pub mod data;
pub mod device;
pub mod dist;
pub mod error;
pub mod export;
pub mod fsutil;
pub mod generate;
pub mod gguf;
pub mod hub;
pub mod lora;
pub mod model;
pub mod ops;
pub mod optim;
pub mod output;
pub mod progress;
pub mod recipe;
pub mod report;
pub mod rng;
pub mod runlog;
pub mod synth;
pub mod tensorboard;
pub mod train;
pub mod weights;

pub use error::{Error, Result};

/// `eprintln!` that never panics: when stderr is closed or full (`finetune ... | tee log`
/// after Ctrl-C takes `tee` down, a log file on a full disk) a run must still finish its step,
/// checkpoint and exit as documented, not panic on a progress line.
#[macro_export]
macro_rules! note {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}
