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
