//! llama.cpp's `deepseek2` GGUF files (DeepSeek-V2, -V2-Lite, -Coder-V2, -V3, Moonlight):
//! the metadata read back into a DeepSeek-V2/V3 `config.json`, and each HF tensor found in
//! the file. Where llama.cpp's converter (`conversion/deepseek.py`, `DeepseekV2Model`)
//! reshapes, we undo it:
//! - the routed experts of a layer are stacked into one [E, out, in] tensor per projection
//!   (`ffn_{gate,up,down}_exps`): expert j is read alone, as a slice of the stacked blocks;
//! - `kv_b_proj` is split into `attn_k_b` (the k rows, transposed per head) and `attn_v_b`
//!   for llama.cpp's absorbed MLA: both are held and joined when dequantised (files written
//!   before that split have `attn_kv_b`, taken as it is);
//! - nothing is permuted (DeepSeek rotates interleaved pairs, as llama.cpp does).
//!
//! What the converter does not write, and how it is read back:
//! - `topk_method`: V3 (sigmoid gating) is `noaux_tc`; V2 (softmax) is `group_limited_greedy`
//!   when groups restrict the choice (`expert_group_used_count` < `expert_group_count`), else
//!   `greedy` (the two choose the same experts when every group is allowed).
//! - YaRN's `mscale`: only `mscale_all_dim` is written (as `rope.scaling.yarn_log_multiplier`
//!   = 0.1 x mscale_all_dim); `mscale` is taken equal to it, as in every DeepSeek-V2/V3
//!   config published (V2: 0.707 / 0.707, V3: 1.0 / 1.0), which is also what llama.cpp
//!   computes (cos/sin unscaled).
//! - `moe_layer_freq`: 1 (llama.cpp's graph has no other).
//! - `n_group` / `topk_group` in files written before the converter stored them: see
//!   [`expert_groups`].
//!
//! Files from other converters that reuse the `deepseek2` architecture for different math are
//! refused by key ([`refuse_foreign_keys`]).

use super::{extend, Described, Meta, Source};
use crate::error::Result;
use std::collections::{BTreeMap, HashSet};

/// The numbers of a deepseek2 file, each checked.
struct Dims {
    hidden: usize,
    layers: usize,
    heads: usize,
    inter: usize,
    vocab: usize,
    q_lora: Option<usize>,
    kv_lora: usize,
    nope: usize,
    rope: usize,
    v: usize,
    experts: usize,
    used: usize,
    shared: usize,
    moe_inter: usize,
    dense: usize,
    sigmoid: bool,
}

pub(super) fn describe(m: &Meta) -> Result<Described> {
    let k = |key: &str| format!("deepseek2.{key}");
    let d = dims(m)?;
    let sources = check_tensors(m, &d)?;
    let context = match m.uint(&k("context_length"))? {
        Some(n) => m.positive(&k("context_length"), n, "position")?,
        None => 4096,
    };
    let eps = m.positive_float(&k("attention.layer_norm_rms_epsilon"))?.ok_or_else(|| m.missing(&k("attention.layer_norm_rms_epsilon")))?;
    let theta = m.positive_float(&k("rope.freq_base"))?.unwrap_or(10000.0);
    refuse_foreign_keys(m)?;
    let (groups, groups_used) = expert_groups(m, &d)?;
    // Required, as llama.cpp requires it: the routed experts' output is scaled by it (2.5 in
    // DeepSeek-V3), so a default would train a different model.
    let scale = m.positive_float(&k("expert_weights_scale"))?.ok_or_else(|| m.missing(&k("expert_weights_scale")))?;
    let norm = m.bool(&k("expert_weights_norm"))?.unwrap_or(false);
    // As config.json's norm_topk_prob on V2 (`ModelConfig`): transformers ignores it there,
    // DeepSeek's code and llama.cpp normalise; named here, where the user's file says it.
    if norm && !d.sigmoid && d.used > 1 {
        return Err(m.err(&k("expert_weights_norm"), "is true with softmax gating (DeepSeek-V2): transformers ignores it there while DeepSeek's code and llama.cpp normalise the chosen experts' weights, so the model is not one both agree on; no published DeepSeek-V2 file sets it"));
    }
    let (arch, model_type, topk) = match (d.sigmoid, groups_used < groups) {
        (true, _) => ("DeepseekV3ForCausalLM", "deepseek_v3", "noaux_tc"),
        (false, true) => ("DeepseekV2ForCausalLM", "deepseek_v2", "group_limited_greedy"),
        (false, false) => ("DeepseekV2ForCausalLM", "deepseek_v2", "greedy"),
    };
    let mut config = serde_json::json!({
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": d.hidden,
        "intermediate_size": d.inter,
        "moe_intermediate_size": d.moe_inter,
        "num_hidden_layers": d.layers,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.heads,
        "n_routed_experts": d.experts,
        "n_shared_experts": d.shared,
        "num_experts_per_tok": d.used,
        "first_k_dense_replace": d.dense,
        "moe_layer_freq": 1,
        "routed_scaling_factor": scale,
        "norm_topk_prob": norm,
        "topk_method": topk,
        "scoring_func": if d.sigmoid { "sigmoid" } else { "softmax" },
        "n_group": groups,
        "topk_group": groups_used,
        "q_lora_rank": d.q_lora,
        "kv_lora_rank": d.kv_lora,
        "qk_nope_head_dim": d.nope,
        "qk_rope_head_dim": d.rope,
        "v_head_dim": d.v,
        "vocab_size": d.vocab,
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "rope_scaling": rope_scaling(m)?,
        "tie_word_embeddings": !m.c.tensor_infos.contains_key("output.weight"),
        "hidden_act": "silu",
        "attention_bias": false,
        "max_position_embeddings": context,
        "torch_dtype": "float32",
    });
    if d.sigmoid {
        extend(&mut config, serde_json::json!({"rope_interleave": true}));
    }
    Ok(Described { arch: "deepseek2", vocab: d.vocab, context, sources, config })
}

/// Keys other converters write into `deepseek2` files for models whose math is not DeepSeek's
/// (attention temperature tuning, extra YaRN factors, multi-token-prediction layers in the
/// block count): read as a DeepSeek model they would train on a different network, so such a
/// file is refused, naming the key. Neutral values (a factor of 1, no MTP layers) pass.
fn refuse_foreign_keys(m: &Meta) -> Result<()> {
    let k = |key: &str| format!("deepseek2.{key}");
    let why = "expected a DeepSeek-V2/V3 file from llama.cpp's convert_hf_to_gguf.py; this key comes from another model's converter and changes the math";
    for key in ["attention.temperature_length", "attention.temperature_scale"] {
        if m.c.metadata.contains_key(&k(key)) {
            return Err(m.err(&k(key), format!("is set (attention temperature tuning): {why}")));
        }
    }
    for key in ["rope.scaling.yarn_attn_factor", "rope.scaling.attn_factor", "rope.scaling.yarn_ext_factor"] {
        let neutral = matches!(m.c.metadata.get(&k(key)), None | Some(candle_core::quantized::gguf_file::Value::F32(1.0)));
        if !neutral {
            return Err(m.err(&k(key), format!("is {:?}, not 1: {why}", m.c.metadata[&k(key)])));
        }
    }
    if let Some(n) = m.uint(&k("nextn_predict_layers"))?.filter(|&n| n > 0) {
        return Err(m.err(&k("nextn_predict_layers"), format!("is {n}: multi-token-prediction layers are not read; {why}")));
    }
    Ok(())
}

/// (n_group, topk_group). llama.cpp's converter has written `expert_group_count` /
/// `expert_group_used_count` only since late 2025, and most published DeepSeek-V3 / R1 and
/// V2 (236B) GGUFs predate it; without them those models would route to experts the
/// checkpoint never chose together. Where the keys are missing, the two published shapes that
/// limit groups get their config.json values (V3: sigmoid, 256 experts -> 8 groups, top 4;
/// V2 / V2.5: softmax, 160 experts -> 8 groups, top 3) with a note saying so; every other
/// DeepSeek model published (V2-Lite, Coder-V2-Lite, Moonlight, Kimi) routes without groups.
fn expert_groups(m: &Meta, d: &Dims) -> Result<(usize, usize)> {
    let k = |key: &str| format!("deepseek2.{key}");
    let groups = m.uint(&k("expert_group_count"))?.map(|n| m.positive(&k("expert_group_count"), n, "expert group")).transpose()?;
    let used = m.uint(&k("expert_group_used_count"))?.map(|n| m.positive(&k("expert_group_used_count"), n, "expert group")).transpose()?;
    let (groups, used) = match (groups, used) {
        (Some(1), u) => (1, u.unwrap_or(1)),
        // llama.cpp reads a missing count as 0 groups: neither it nor "all groups" is safe to assume.
        (Some(g), None) => return Err(m.err(&k("expert_group_used_count"), format!("missing, while deepseek2.expert_group_count is {g}: how many groups a token may use"))),
        (Some(g), Some(u)) => (g, u),
        (None, Some(_)) => return Err(m.err(&k("expert_group_used_count"), "is set but deepseek2.expert_group_count is not")),
        (None, None) => match (d.sigmoid, d.experts) {
            (true, 256) | (false, 160) => {
                let inferred = if d.sigmoid { (8, 4) } else { (8, 3) };
                crate::note!(
                    "note: {} has no deepseek2.expert_group_count; its shape is DeepSeek-{}'s, so experts are routed in {} groups, the best {} per token, as that model's config.json says",
                    m.file.display(),
                    if d.sigmoid { "V3" } else { "V2" },
                    inferred.0,
                    inferred.1
                );
                inferred
            }
            _ => (1, 1),
        },
    };
    if used > groups || !d.experts.is_multiple_of(groups) {
        return Err(m.err(&k("expert_group_used_count"), format!("{used} of {groups} groups of deepseek2.expert_count {} experts: expected at most all groups, of equal size", d.experts)));
    }
    Ok((groups, used))
}

fn dims(m: &Meta) -> Result<Dims> {
    let k = |key: &str| format!("deepseek2.{key}");
    let hidden = m.count(&k("embedding_length"), "embedding dimension")?;
    let layers = m.count(&k("block_count"), "block")?;
    let heads = m.count(&k("attention.head_count"), "attention head")?;
    let inter = m.count(&k("feed_forward_length"), "feed-forward unit")?;
    let kv_lora = m.count(&k("attention.kv_lora_rank"), "latent dimension")?;
    let q_lora = match m.uint(&k("attention.q_lora_rank"))? {
        Some(0) | None => None,
        Some(n) => Some(n as usize),
    };
    let rope = m.count(&k("rope.dimension_count"), "rotated dimension")?;
    if rope % 2 != 0 {
        return Err(m.err(&k("rope.dimension_count"), format!("is {rope}, odd; RoPE rotates pairs of dimensions")));
    }
    // The per-head q/k and v sizes: `*_mla` in files written since llama.cpp absorbed MLA
    // (where key_length/value_length describe the latent form), else key/value_length.
    let (kl_key, vl_key) = match m.uint(&k("attention.key_length_mla"))? {
        Some(_) => (k("attention.key_length_mla"), k("attention.value_length_mla")),
        None => (k("attention.key_length"), k("attention.value_length")),
    };
    let qk = m.count(&kl_key, "dimension per head")?;
    if qk <= rope {
        return Err(m.err(&kl_key, format!("is {qk}, not more than deepseek2.rope.dimension_count {rope}: no unrotated part of a head")));
    }
    let v = m.count(&vl_key, "value dimension per head")?;
    let experts = m.count(&k("expert_count"), "routed expert")?;
    let used = m.count(&k("expert_used_count"), "expert per token")?;
    if used > experts {
        return Err(m.err(&k("expert_used_count"), format!("is {used}, more than deepseek2.expert_count {experts}")));
    }
    // Both required, as llama.cpp requires them (0 is a value).
    let shared = m.uint(&k("expert_shared_count"))?.ok_or_else(|| m.missing(&k("expert_shared_count")))? as usize;
    let moe_inter = m.count(&k("expert_feed_forward_length"), "expert feed-forward unit")?;
    let dense = m.uint(&k("leading_dense_block_count"))?.ok_or_else(|| m.missing(&k("leading_dense_block_count")))? as usize;
    let sigmoid = match m.uint(&k("expert_gating_func"))? {
        None | Some(1) => false,
        Some(2) => true,
        Some(g) => return Err(m.err(&k("expert_gating_func"), format!("is {g}; supported: 1 (softmax, DeepSeek-V2), 2 (sigmoid, DeepSeek-V3)"))),
    };
    let embd = m.c.tensor_infos.get("token_embd.weight").ok_or_else(|| m.err("token_embd.weight", "missing: the file has no token embedding"))?;
    let vocab = match *embd.shape.dims() {
        [v, w] if v > 0 && w == hidden => v,
        ref s => return Err(m.err("token_embd.weight", format!("has shape {s:?}, expected [vocabulary, deepseek2.embedding_length {hidden}]"))),
    };
    if let Some(v) = m.uint(&k("vocab_size"))? {
        if v as usize != vocab {
            return Err(m.err(&k("vocab_size"), format!("is {v} but token_embd.weight has {vocab} rows")));
        }
    }
    if !sigmoid && m.c.tensor_infos.keys().any(|n| n.ends_with(".exp_probs_b.bias")) {
        let said = if m.c.metadata.contains_key(&k("expert_gating_func")) { "is 1 (softmax)" } else { "is missing (softmax, DeepSeek-V2)" };
        return Err(m.err(&k("expert_gating_func"), format!("{said}, but the file has exp_probs_b tensors, DeepSeek-V3's sigmoid router bias: expected 2 (sigmoid)")));
    }
    Ok(Dims { hidden, layers, heads, inter, vocab, q_lora, kv_lora, nope: qk - rope, rope, v, experts, used, shared, moe_inter, dense, sigmoid })
}

/// `rope_scaling` for config.json: none, or YaRN from the `rope.scaling.*` keys.
fn rope_scaling(m: &Meta) -> Result<serde_json::Value> {
    let k = |key: &str| format!("deepseek2.rope.scaling.{key}");
    match m.string(&k("type"))? {
        None | Some("none") => return Ok(serde_json::Value::Null),
        Some("yarn") => {}
        Some(t) => return Err(m.err(&k("type"), format!("is `{t}`; DeepSeek models use yarn or none"))),
    }
    let factor = m.positive_float(&k("factor"))?.ok_or_else(|| m.missing(&k("factor")))?;
    let original = m.count(&k("original_context_length"), "position")?;
    // Written as 0.1 x mscale_all_dim (a float32): read back to the 6 decimals configs use.
    // 0 (mscale_all_dim 0: no attention scaling) is what the converter writes for such
    // configs, and what a missing key means.
    let mscale = match m.non_negative_float(&k("yarn_log_multiplier"))? {
        Some(mul) => (mul / 0.1 * 1e6).round() / 1e6,
        None => 0.0,
    };
    let beta_fast = m.positive_float(&k("yarn_beta_fast"))?.unwrap_or(32.0);
    let beta_slow = m.positive_float(&k("yarn_beta_slow"))?.unwrap_or(1.0);
    Ok(serde_json::json!({
        "type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": original,
        "beta_fast": beta_fast,
        "beta_slow": beta_slow,
        "mscale": mscale,
        "mscale_all_dim": mscale,
    }))
}

/// HF name -> where it is, with every tensor of the file accounted for, each of the shape
/// the metadata implies, and each layer complete.
fn check_tensors(m: &Meta, d: &Dims) -> Result<BTreeMap<String, Source>> {
    let t = &m.c.tensor_infos;
    let (h, qk) = (d.hidden, d.nope + d.rope);
    let mut want: Vec<(String, Vec<usize>, Option<String>)> = vec![
        ("token_embd.weight".into(), vec![d.vocab, h], Some("model.embed_tokens.weight".into())),
        ("output_norm.weight".into(), vec![h], Some("model.norm.weight".into())),
    ];
    if t.contains_key("output.weight") {
        want.push(("output.weight".into(), vec![d.vocab, h], Some("lm_head.weight".into())));
    }
    let mut sources = BTreeMap::new();
    for b in 0..d.layers {
        let g = |s: &str| format!("blk.{b}.{s}");
        let hf = |s: &str| Some(format!("model.layers.{b}.{s}"));
        let mut add = |name: String, shape: Vec<usize>, to: Option<String>| want.push((name, shape, to));
        add(g("attn_norm.weight"), vec![h], hf("input_layernorm.weight"));
        add(g("ffn_norm.weight"), vec![h], hf("post_attention_layernorm.weight"));
        match d.q_lora {
            None => add(g("attn_q.weight"), vec![d.heads * qk, h], hf("self_attn.q_proj.weight")),
            Some(r) => {
                add(g("attn_q_a.weight"), vec![r, h], hf("self_attn.q_a_proj.weight"));
                add(g("attn_q_a_norm.weight"), vec![r], hf("self_attn.q_a_layernorm.weight"));
                add(g("attn_q_b.weight"), vec![d.heads * qk, r], hf("self_attn.q_b_proj.weight"));
            }
        }
        add(g("attn_kv_a_mqa.weight"), vec![d.kv_lora + d.rope, h], hf("self_attn.kv_a_proj_with_mqa.weight"));
        add(g("attn_kv_a_norm.weight"), vec![d.kv_lora], hf("self_attn.kv_a_layernorm.weight"));
        if t.contains_key(&g("attn_kv_b.weight")) {
            add(g("attn_kv_b.weight"), vec![d.heads * (d.nope + d.v), d.kv_lora], hf("self_attn.kv_b_proj.weight"));
        } else {
            add(g("attn_k_b.weight"), vec![d.heads, d.kv_lora, d.nope], None);
            add(g("attn_v_b.weight"), vec![d.heads, d.v, d.kv_lora], None);
            sources.insert(format!("model.layers.{b}.self_attn.kv_b_proj.weight"), Source::KvB { k_b: g("attn_k_b.weight"), v_b: g("attn_v_b.weight") });
        }
        add(g("attn_output.weight"), vec![h, d.heads * d.v], hf("self_attn.o_proj.weight"));
        if b < d.dense {
            add(g("ffn_gate.weight"), vec![d.inter, h], hf("mlp.gate_proj.weight"));
            add(g("ffn_up.weight"), vec![d.inter, h], hf("mlp.up_proj.weight"));
            add(g("ffn_down.weight"), vec![h, d.inter], hf("mlp.down_proj.weight"));
            continue;
        }
        add(g("ffn_gate_inp.weight"), vec![d.experts, h], hf("mlp.gate.weight"));
        if d.sigmoid {
            add(g("exp_probs_b.bias"), vec![d.experts], hf("mlp.gate.e_score_correction_bias"));
        }
        for (p, shape) in [("gate", vec![d.experts, d.moe_inter, h]), ("up", vec![d.experts, d.moe_inter, h]), ("down", vec![d.experts, h, d.moe_inter])] {
            add(g(&format!("ffn_{p}_exps.weight")), shape, None);
            for j in 0..d.experts {
                sources.insert(format!("model.layers.{b}.mlp.experts.{j}.{p}_proj.weight"), Source::Expert { name: g(&format!("ffn_{p}_exps.weight")), j });
            }
        }
        if d.shared > 0 {
            let si = d.shared * d.moe_inter;
            add(g("ffn_gate_shexp.weight"), vec![si, h], hf("mlp.shared_experts.gate_proj.weight"));
            add(g("ffn_up_shexp.weight"), vec![si, h], hf("mlp.shared_experts.up_proj.weight"));
            add(g("ffn_down_shexp.weight"), vec![h, si], hf("mlp.shared_experts.down_proj.weight"));
        }
    }
    let mut expected = HashSet::new();
    for (name, shape, hf) in want {
        let info = t.get(&name).ok_or_else(|| m.err(&name, format!("missing: the metadata (deepseek2.block_count {}, leading_dense_block_count {}, q_lora_rank, expert counts) implies it", d.layers, d.dense)))?;
        if info.shape.dims() != shape.as_slice() {
            return Err(m.err(&name, format!("has shape {:?}, but the deepseek2 metadata gives {shape:?}", info.shape.dims())));
        }
        if let Some(hf) = hf {
            sources.insert(hf, Source::Tensor { name: name.clone(), unpermute: None });
        }
        expected.insert(name);
    }
    let mut names: Vec<&String> = t.keys().collect();
    names.sort();
    if let Some(extra) = names.into_iter().find(|n| !expected.contains(*n)) {
        return Err(m.err(extra, format!("is not a deepseek2 tensor this reads (for deepseek2.block_count {} and the expert counts)", d.layers)));
    }
    Ok(sources)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::{Content, Value, VersionedMagic};

    fn content(keys: &[(&str, Value)]) -> Content {
        let metadata = keys.iter().map(|(k, v)| (format!("deepseek2.{k}"), v.clone())).collect();
        Content { magic: VersionedMagic::GgufV3, metadata, tensor_infos: Default::default(), tensor_data_offset: 0 }
    }

    fn dims(experts: usize, sigmoid: bool) -> Dims {
        let (hidden, layers, heads, inter, vocab, kv_lora, nope, rope, v) = (8, 1, 1, 8, 8, 4, 4, 2, 4);
        Dims { hidden, layers, heads, inter, vocab, q_lora: None, kv_lora, nope, rope, v, experts, used: 2, shared: 1, moe_inter: 4, dense: 0, sigmoid }
    }

    #[test]
    fn files_without_expert_groups_get_the_groups_of_the_published_model_of_their_shape() -> Result<()> {
        let file = std::path::Path::new("x.gguf");
        let none = content(&[]);
        let m = Meta { c: &none, file };
        assert_eq!(expert_groups(&m, &dims(256, true))?, (8, 4), "DeepSeek-V3 / R1");
        assert_eq!(expert_groups(&m, &dims(160, false))?, (8, 3), "DeepSeek-V2 / V2.5");
        assert_eq!(expert_groups(&m, &dims(64, false))?, (1, 1), "V2-Lite");
        assert_eq!(expert_groups(&m, &dims(64, true))?, (1, 1), "Moonlight");
        let written = content(&[("expert_group_count", Value::U32(4)), ("expert_group_used_count", Value::U32(2))]);
        assert_eq!(expert_groups(&Meta { c: &written, file }, &dims(256, true))?, (4, 2), "the file's keys win");
        let uneven = content(&[("expert_group_count", Value::U32(3)), ("expert_group_used_count", Value::U32(2))]);
        let e = expert_groups(&Meta { c: &uneven, file }, &dims(64, false)).unwrap_err().to_string();
        assert!(e.contains("expert_group") && e.contains("equal size"), "{e}");
        // A group count without the used count is neither llama.cpp's reading (0 groups) nor
        // "all groups" for sure: refused by name.
        let half = content(&[("expert_group_count", Value::U32(8))]);
        let e = expert_groups(&Meta { c: &half, file }, &dims(256, true)).unwrap_err().to_string();
        assert!(e.contains("deepseek2.expert_group_used_count") && e.contains("missing"), "{e}");
        Ok(())
    }

    #[test]
    fn keys_from_other_converters_are_refused_by_name_and_neutral_values_pass() {
        let file = std::path::Path::new("x.gguf");
        for (key, value) in [
            ("attention.temperature_length", Value::U32(8192)),
            ("attention.temperature_scale", Value::F32(0.1)),
            ("rope.scaling.yarn_attn_factor", Value::F32(0.8)),
            ("rope.scaling.attn_factor", Value::F32(1.2)),
            ("rope.scaling.yarn_ext_factor", Value::F32(0.5)),
            ("nextn_predict_layers", Value::U32(1)),
        ] {
            let c = content(&[(key, value)]);
            let e = refuse_foreign_keys(&Meta { c: &c, file }).unwrap_err().to_string();
            assert!(e.contains(&format!("deepseek2.{key}")) && e.contains("x.gguf"), "{e}");
        }
        let neutral = content(&[("rope.scaling.yarn_attn_factor", Value::F32(1.0)), ("nextn_predict_layers", Value::U32(0))]);
        assert!(refuse_foreign_keys(&Meta { c: &neutral, file }).is_ok());
    }
}
