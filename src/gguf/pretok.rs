//! How a GGUF vocabulary splits text before BPE: tokenizer.json's `pre_tokenizer` for the
//! file's `tokenizer.ggml.pre`, the name llama.cpp's converter gives the split the model was
//! trained with. A wrong split gives other token ids than the model's own tokenizer, with no
//! error, so each name maps to the split of the tokenizer.json it came from:
//! - Llama 3's (`llama-bpe` and the names llama.cpp gives its copies) and Qwen2's (and so
//!   DeepSeek-R1-Distill-Qwen's), as transformers' GGUF loader maps them;
//! - DeepSeek LLM / Coder-v1.5 / V2's (`deepseek-llm`), DeepSeek-Coder's (`deepseek-coder`) and
//!   DeepSeek-V3 / R1's (`deepseek-v3`): the `pre_tokenizer` of the original tokenizer.json,
//!   verbatim, in `deepseek-pre-tokenizers.json` beside this file. transformers' GGUF loader
//!   reads these with GPT-2's split (other ids than the original); llama.cpp splits them as the
//!   original does, and so do we, so training sees the ids llama.cpp serves with;
//! - anything else: GPT-2's byte-level split, as transformers reads it, with a note where the
//!   name says the model had its own.

use std::path::{Path, PathBuf};

/// How Llama 3 splits text before BPE (`llama-bpe` and the types llama.cpp gives its copies).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's (and so DeepSeek-R1-Distill-Qwen's): Llama 3's with single digits.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// `tokenizer.ggml.pre` values split by one regex (then byte-level, without its own regex).
const PRE_SPLITS: &[(&str, &str)] = &[
    ("llama3", LLAMA3_SPLIT),
    ("llama-v3", LLAMA3_SPLIT),
    ("llama-bpe", LLAMA3_SPLIT),
    ("smaug-bpe", LLAMA3_SPLIT),
    ("dbrx", LLAMA3_SPLIT),
    ("falcon3", LLAMA3_SPLIT),
    ("qwen2", QWEN2_SPLIT),
    ("deepseek-r1-qwen", QWEN2_SPLIT),
];
/// The DeepSeek tokenizers' own `pre_tokenizer`s by `tokenizer.ggml.pre` (sequences of
/// regex splits, digits and byte-level), copied from their tokenizer.json files (see
/// tests/fixtures/gguf-pre-tokenizers/make_fixture.py, which checks them against the originals).
const DEEPSEEK: &str = include_str!("deepseek-pre-tokenizers.json");
/// Values whose own split is GPT-2's, or that transformers also reads with it.
const PRE_GPT2: &[&str] = &["default", "gpt-2", "gpt2", "smollm", "olmo", "mpt", "starcoder", "jais", "refact"];

/// tokenizer.json's `pre_tokenizer` for a file's `tokenizer.ggml.pre` (`pre`); `file` names it
/// in the note for a name without a known split.
pub fn pre_tokenizer(pre: Option<&str>, file: &Path) -> serde_json::Value {
    let byte_level = |regex: bool| serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": regex});
    if let Some(&(_, split)) = PRE_SPLITS.iter().find(|(p, _)| Some(*p) == pre) {
        return serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": false},
            byte_level(false),
        ]});
    }
    if let Some(own) = pre.and_then(|p| deepseek().get(p)) {
        return own.clone();
    }
    if let Some(p) = pre.filter(|p| !PRE_GPT2.contains(p) && first_note(file)) {
        crate::note!(
            "{}: tokenizer.ggml.pre = `{p}` is read with GPT-2's split, as transformers' GGUF loader reads it; \
             token ids may differ from the model's original tokenizer.json (use its HF folder for those)",
            file.display()
        );
    }
    byte_level(true)
}

fn deepseek() -> &'static serde_json::Map<String, serde_json::Value> {
    static PARSED: std::sync::OnceLock<serde_json::Map<String, serde_json::Value>> = std::sync::OnceLock::new();
    PARSED.get_or_init(|| serde_json::from_str(DEEPSEEK).expect("deepseek-pre-tokenizers.json is a JSON object (checked by a test)"))
}

/// Whether this is the first note for `file`: a run opens its GGUF base more than once.
fn first_note(file: &Path) -> bool {
    static NOTED: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());
    let mut seen = NOTED.lock().unwrap_or_else(|e| e.into_inner());
    let new = !seen.iter().any(|s| s == file);
    if new {
        seen.push(file.to_path_buf());
    }
    new
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_deepseek_split_is_a_pre_tokenizer_the_tokenizers_crate_reads() {
        for name in ["deepseek-llm", "deepseek-coder", "deepseek-v3"] {
            let v = pre_tokenizer(Some(name), Path::new("x.gguf"));
            assert_eq!(v["type"], "Sequence", "{name}");
            let parsed: Result<tokenizers::pre_tokenizers::PreTokenizerWrapper, _> = serde_json::from_value(v);
            assert!(parsed.is_ok(), "{name}: {parsed:?}");
        }
        assert_eq!(deepseek().len(), 3);
    }
}
