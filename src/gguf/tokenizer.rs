//! An HF `tokenizer.json` (and the special tokens of `tokenizer_config.json`) built from the
//! `tokenizer.ggml.*` vocabulary, merges and token types, as transformers' GGUF converter does.
use super::{as_int, pretok, type_name, Meta};
use crate::error::Result;
use std::collections::HashSet;

/// Build an HF `tokenizer.json` (and the special-token part of `tokenizer_config.json`).
pub(super) fn tokenizer_files(m: &Meta, vocab: usize, context: usize) -> Result<(serde_json::Value, serde_json::Value)> {
    let model = m.string("tokenizer.ggml.model")?.ok_or_else(|| m.missing("tokenizer.ggml.model"))?;
    if model != "gpt2" {
        return Err(m.err("tokenizer.ggml.model", format!("is `{model}`; only byte-level BPE (`gpt2`) vocabularies are supported")));
    }
    let tokens = m.strings("tokenizer.ggml.tokens")?;
    if tokens.is_empty() || tokens.len() > vocab {
        return Err(m.err("tokenizer.ggml.tokens", format!("has {} tokens; token_embd.weight has rows for {vocab}", tokens.len())));
    }
    let merges = m.strings("tokenizer.ggml.merges")?;
    // The tokenizers crate panics on a merge whose parts or result are not in the
    // vocabulary: refuse such a file here, naming the merge.
    {
        let known: HashSet<&str> = tokens.iter().map(|t| t.as_str()).collect();
        for (i, mg) in merges.iter().enumerate() {
            let ok = mg.split_once(' ').is_some_and(|(a, b)| known.contains(a) && known.contains(b) && known.contains(format!("{a}{b}").as_str()));
            if !ok {
                return Err(m.err("tokenizer.ggml.merges", format!("merge {i} (`{mg}`) is not two vocabulary tokens joining into a third")));
            }
        }
    }
    let types: Vec<i64> = match m.array("tokenizer.ggml.token_type")? {
        Some(a) => a
            .iter()
            .enumerate()
            .map(|(i, v)| as_int(v).ok_or_else(|| m.err("tokenizer.ggml.token_type", format!("element {i} has GGUF type {}, expected an array of integers", type_name(v)))))
            .collect::<Result<_>>()?,
        None => vec![1; tokens.len()],
    };
    let mut vocab_map = serde_json::Map::new();
    let mut added = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        vocab_map.insert(t.clone(), i.into());
        // token_type 3 = control (special), 4 = user-defined (added, not special).
        let ty = types.get(i).copied().unwrap_or(1);
        if ty == 3 || ty == 4 {
            added.push(serde_json::json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": ty == 4, "special": ty == 3}));
        }
    }
    let id = |key: &str| -> Result<Option<u32>> {
        match m.uint(key)? {
            Some(i) if (i as usize) < tokens.len() => Ok(Some(i as u32)),
            Some(i) => Err(m.err(key, format!("is {i}, not a token id (tokenizer.ggml.tokens has {})", tokens.len()))),
            None => Ok(None),
        }
    };
    let (bos, eos, unk, pad) = (id("tokenizer.ggml.bos_token_id")?, id("tokenizer.ggml.eos_token_id")?, id("tokenizer.ggml.unknown_token_id")?, id("tokenizer.ggml.padding_token_id")?);
    let add_bos = m.bool("tokenizer.ggml.add_bos_token")?.unwrap_or(false);
    let chat_template = m.string("tokenizer.chat_template")?;
    let name = |id: Option<u32>| id.and_then(|i| tokens.get(i as usize)).cloned();
    let mut single = Vec::new();
    let mut special_tokens = serde_json::Map::new();
    if add_bos {
        if let Some(b) = name(bos) {
            single.push(serde_json::json!({"SpecialToken": {"id": b, "type_id": 0}}));
            special_tokens.insert(b.clone(), serde_json::json!({"id": b, "ids": [bos], "tokens": [b]}));
        }
    }
    single.push(serde_json::json!({"Sequence": {"id": "A", "type_id": 0}}));
    let mut pair = single.clone();
    pair.push(serde_json::json!({"Sequence": {"id": "B", "type_id": 1}}));
    let merges: Vec<serde_json::Value> = merges.into_iter().map(serde_json::Value::String).collect();
    let tok = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pretok::pre_tokenizer(m.string("tokenizer.ggml.pre")?, m.file),
        "post_processor": {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special_tokens},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": name(unk), "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab_map, "merges": merges}
    });
    let mut cfg = serde_json::Map::new();
    cfg.insert("tokenizer_class".into(), "PreTrainedTokenizerFast".into());
    cfg.insert("add_bos_token".into(), add_bos.into());
    cfg.insert("add_eos_token".into(), false.into());
    cfg.insert("model_max_length".into(), context.into());
    for (k, id) in [("bos_token", bos), ("eos_token", eos), ("unk_token", unk), ("pad_token", pad)] {
        if let Some(n) = name(id) {
            cfg.insert(k.into(), n.into());
        }
    }
    if let Some(t) = chat_template {
        cfg.insert("chat_template".into(), t.into());
    }
    Ok((tok, serde_json::Value::Object(cfg)))
}
