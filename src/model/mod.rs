//! Model families. One file per family; Qwen2 is the Llama block plus q/k/v bias (and
//! optionally tied embeddings), both expressed by [`crate::config::ModelConfig`], so it shares
//! `llama.rs` rather than duplicating it (candle-transformers keeps a separate qwen2.rs; the
//! difference is three bias adds).

pub mod llama;
