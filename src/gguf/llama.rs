//! The llama and qwen2 architectures: llama.cpp's tensor names to HF's, the config from the
//! `llama.*` / `qwen2.*` metadata (`Llama::from_gguf`), and q/k rows unpermuted.
use super::{extend, rope, Meta};
use crate::error::Result;
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeMap, HashSet};

/// llama.cpp's names of a block's tensors and HF's (under `model.layers.N.`).
const BLOCK_NAMES: [(&str, &str); 12] = [
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("attn_q.bias", "self_attn.q_proj.bias"),
    ("attn_k.bias", "self_attn.k_proj.bias"),
    ("attn_v.bias", "self_attn.v_proj.bias"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
];

/// llama.cpp's names of the tensors outside the blocks and HF's.
const TOP_NAMES: [(&str, &str); 3] = [("token_embd.weight", "model.embed_tokens.weight"), ("output_norm.weight", "model.norm.weight"), ("output.weight", "lm_head.weight")];

/// llama.cpp name -> HF name.
pub fn hf_name(gguf: &str) -> Option<String> {
    if let Some((_, hf)) = TOP_NAMES.iter().find(|(g, _)| *g == gguf) {
        return Some(hf.to_string());
    }
    let (layer, name) = block_of(gguf)?;
    let hf = BLOCK_NAMES.iter().find(|(g, _)| *g == name)?.1;
    Some(format!("model.layers.{layer}.{hf}"))
}

/// HF name -> llama.cpp name (the inverse of [`hf_name`]).
pub fn gguf_name(hf: &str) -> Option<String> {
    if let Some((g, _)) = TOP_NAMES.iter().find(|(_, h)| *h == hf) {
        return Some(g.to_string());
    }
    let (layer, rest) = hf.strip_prefix("model.layers.")?.split_once('.')?;
    let n: usize = layer.parse().ok().filter(|n: &usize| n.to_string() == layer)?;
    let g = BLOCK_NAMES.iter().find(|(_, h)| *h == rest)?.0;
    Some(format!("blk.{n}.{g}"))
}

/// `blk.N.rest` -> (N, rest), N written canonically (`blk.01` would alias `blk.1`).
fn block_of(gguf: &str) -> Option<(usize, &str)> {
    let (layer, name) = gguf.strip_prefix("blk.")?.split_once('.')?;
    let n: usize = layer.parse().ok()?;
    (n.to_string() == layer).then_some((n, name))
}

/// The tensors every block of a llama GGUF has.
const BLOCK_TENSORS: [&str; 9] =
    ["attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "attn_norm.weight", "ffn_norm.weight"];

/// Where an HF tensor's values are in a GGUF file.
#[derive(Clone, Debug)]
pub(crate) enum Source {
    /// One tensor as stored; `unpermute`: the heads of llama's q/k rows, whose llama.cpp
    /// permutation is undone after dequantising.
    Tensor { name: String, unpermute: Option<usize> },
    /// Expert `j` of a stacked [E, out, in] tensor (deepseek2's `ffn_*_exps`).
    Expert { name: String, j: usize },
    /// DeepSeek's `kv_b_proj` [heads x (nope + v), kv_lora], which llama.cpp writes as
    /// `attn_k_b` [heads, kv_lora, nope] (the k part transposed) and `attn_v_b` [heads, v, kv_lora].
    KvB { k_b: String, v_b: String },
}

/// What an architecture reader makes of a file: the HF tensors and where each is, and the
/// HF config (token ids are added by [`open`]).
pub(super) struct Described {
    pub(super) arch: &'static str,
    pub(super) vocab: usize,
    pub(super) context: usize,
    pub(super) sources: BTreeMap<String, Source>,
    pub(super) config: serde_json::Value,
}

/// The model a GGUF file describes, every number checked against the others and against
/// the tensors present before any tensor is read or anything written.
pub(super) struct Llama {
    /// `llama` or `qwen2`: the metadata key prefix. Qwen2 is llama plus q/k/v biases, and
    /// llama.cpp does not permute its q/k rows (its RoPE is the NEOX, rotate-half kind).
    arch: &'static str,
    heads: usize,
    kv_heads: usize,
    hidden: usize,
    layers: usize,
    inter: usize,
    head_dim: usize,
    vocab: usize,
    eps: f64,
    theta: f64,
    context: usize,
    tied: bool,
    /// config.json's `rope_scaling` (null for none): linear from the metadata, Llama 3's
    /// from `rope_freqs.weight`.
    rope_scaling: serde_json::Value,
}

/// The tensor llama.cpp writes Llama 3's rope scaling as (one divisor per rotated pair).
const ROPE_FREQS: &str = "rope_freqs.weight";

impl Llama {
    pub(super) fn from_gguf(m: &Meta, file: &mut std::fs::File) -> Result<Self> {
        let arch = m.string("general.architecture")?.ok_or_else(|| m.missing("general.architecture"))?;
        let a: &'static str = match arch {
            "llama" => "llama",
            "qwen2" => "qwen2",
            _ => return Err(m.err("general.architecture", format!("is `{arch}`; supported: llama, qwen2, deepseek2"))),
        };
        let k = |key: &str| format!("{a}.{key}");
        // Mixtral-style files are `llama` with experts: say so before their tensors' names
        // are refused one by one.
        if let Some(n) = m.uint(&k("expert_count"))?.filter(|&n| n > 0) {
            return Err(m.err(&k("expert_count"), format!("is {n}: a mixture-of-experts {a} file (Mixtral's layout) is not supported; the experts read from GGUF are deepseek2's")));
        }
        let heads = m.count(&k("attention.head_count"), "attention head")?;
        let kv_heads = match m.uint(&k("attention.head_count_kv"))? {
            Some(n) => m.positive(&k("attention.head_count_kv"), n, "key/value head")?,
            None => heads,
        };
        if heads % kv_heads != 0 {
            return Err(m.err(&k("attention.head_count_kv"), format!("is {kv_heads}, which does not divide {a}.attention.head_count {heads} (each key/value head serves a whole group of query heads)")));
        }
        let hidden = m.count(&k("embedding_length"), "embedding dimension")?;
        let layers = m.count(&k("block_count"), "block")?;
        let inter = m.count(&k("feed_forward_length"), "feed-forward unit")?;
        let eps = m.positive_float(&k("attention.layer_norm_rms_epsilon"))?.ok_or_else(|| m.missing(&k("attention.layer_norm_rms_epsilon")))?;
        let theta = m.positive_float(&k("rope.freq_base"))?.unwrap_or(10000.0);
        let context = match m.uint(&k("context_length"))? {
            Some(n) => m.positive(&k("context_length"), n, "position")?,
            None => 2048,
        };

        // The head size: key_length where the file states it, else the RoPE dimension (all
        // of a llama head rotates), else embedding / heads.
        let key_len = m.uint(&k("attention.key_length"))?;
        if let (Some(kl), Some(v)) = (key_len, m.uint(&k("attention.value_length"))?) {
            if kl != v {
                return Err(m.err(&k("attention.value_length"), format!("is {v} but {a}.attention.key_length is {kl}; a head has one size")));
            }
        }
        let rope = m.uint(&k("rope.dimension_count"))?;
        let head_dim = match (key_len, rope) {
            (Some(kl), _) => m.positive(&k("attention.key_length"), kl, "dimension per head")?,
            (None, Some(r)) => m.positive(&k("rope.dimension_count"), r, "rotated dimension")?,
            (None, None) if hidden % heads == 0 => hidden / heads,
            (None, None) => {
                return Err(m.err(&k("embedding_length"), format!("is {hidden}, not a multiple of {a}.attention.head_count {heads}, and the file states no head size ({a}.rope.dimension_count)")))
            }
        };
        if let Some(r) = rope {
            if r % 2 != 0 {
                return Err(m.err(&k("rope.dimension_count"), format!("is {r}, odd; RoPE rotates pairs of dimensions")));
            }
            if r as usize != head_dim {
                return Err(m.err(&k("rope.dimension_count"), format!("is {r} but heads have {head_dim} dimensions; rotating part of a head is not supported")));
            }
        }
        if head_dim % 2 != 0 {
            return Err(m.err(&k("attention.key_length"), format!("is {head_dim}, odd; RoPE rotates pairs of dimensions")));
        }

        let t = &m.c.tensor_infos;
        let embd = t.get("token_embd.weight").ok_or_else(|| m.err("token_embd.weight", "missing: the file has no token embedding"))?;
        let (vocab, width) = match *embd.shape.dims() {
            [v, w] if v > 0 => (v, w),
            ref d => return Err(m.err("token_embd.weight", format!("has shape {d:?}, expected [vocabulary, {a}.embedding_length {hidden}]"))),
        };
        if width != hidden {
            return Err(m.err(&k("embedding_length"), format!("is {hidden} but token_embd.weight is [{vocab}, {width}]: embeddings of {width}")));
        }
        if let Some(v) = m.uint(&k("vocab_size"))? {
            if v as usize != vocab {
                return Err(m.err(&k("vocab_size"), format!("is {v} but token_embd.weight has {vocab} rows")));
            }
        }
        let mut p = Llama { arch: a, heads, kv_heads, hidden, layers, inter, head_dim, vocab, eps, theta, context, tied: !t.contains_key("output.weight"), rope_scaling: serde_json::Value::Null };
        p.check_tensors(m)?;
        p.rope_scaling = p.rope_scaling(m, file)?;
        Ok(p)
    }

    /// config.json's `rope_scaling`: `{arch}.rope.scaling.type` linear (or the older
    /// `rope.scale_linear`), or Llama 3's from `rope_freqs.weight`, or none. A scaling this
    /// cannot express is an error: ignoring it would give other logits with exit 0.
    fn rope_scaling(&self, m: &Meta, file: &mut std::fs::File) -> Result<serde_json::Value> {
        let k = |key: &str| format!("{}.{key}", self.arch);
        let linear = |factor: f64| serde_json::json!({"rope_type": "linear", "factor": factor});
        let from_meta = match m.string(&k("rope.scaling.type"))? {
            Some("linear") => Some(linear(m.positive_float(&k("rope.scaling.factor"))?.ok_or_else(|| m.missing(&k("rope.scaling.factor")))?)),
            Some("none") => None,
            Some(t) => {
                return Err(m.err(&k("rope.scaling.type"), format!("is `{t}`; {} files are read with linear scaling or none (YaRN is read for deepseek2)", self.arch)))
            }
            None => match m.positive_float(&k("rope.scale_linear"))? {
                Some(f) if f != 1.0 => Some(linear(f)),
                _ => None,
            },
        };
        let Some(info) = m.c.tensor_infos.get(ROPE_FREQS) else { return Ok(from_meta.unwrap_or_default()) };
        if from_meta.is_some() {
            return Err(m.err(ROPE_FREQS, format!("scales RoPE, and so does {}: one scaling, not two", k("rope.scaling.type"))));
        }
        let q = info.read(file, m.c.tensor_data_offset, &Device::Cpu).map_err(|e| m.err(ROPE_FREQS, crate::error::candle_msg(&e)))?;
        let factors: Vec<f64> = q
            .dequantize(&Device::Cpu)
            .and_then(|t| t.flatten_all()?.to_dtype(DType::F64)?.to_vec1())
            .map_err(|e| m.err(ROPE_FREQS, crate::error::candle_msg(&e)))?;
        rope::llama3_from_freq_factors(&factors, self.theta, self.head_dim).map_err(|msg| m.err(ROPE_FREQS, msg))
    }

    /// Every tensor is one we convert, of the shape the metadata implies, and each of the
    /// `block_count` blocks is complete, with no block beyond it.
    fn check_tensors(&self, m: &Meta) -> Result<()> {
        let (a, t) = (self.arch, &m.c.tensor_infos);
        let k = |key: &str| format!("{a}.{key}");
        let mut blocks = HashSet::new();
        let mut names: Vec<&String> = t.keys().collect();
        names.sort();
        for name in names {
            if name == ROPE_FREQS {
                // Checked with its values (`rope_scaling`).
                continue;
            }
            if hf_name(name).is_none() {
                return Err(m.err(name, format!("is not a {a} tensor this reads (token_embd, output_norm, output, blk.N.{{attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down,attn_norm,ffn_norm}}.weight, and qwen2's blk.N.{{attn_q,attn_k,attn_v}}.bias)")));
            }
            if let Some((b, rest)) = block_of(name) {
                if b >= self.layers {
                    return Err(m.err(&k("block_count"), format!("is {} but the file has tensors of block {b} ({name})", self.layers)));
                }
                if rest.ends_with(".bias") && !self.qkv_bias() {
                    // HF's llama has biases only with attention_bias (q, k, v and o), which
                    // llama.cpp's converter permutes like the rows: not read here.
                    return Err(m.err(name, "is a bias in a llama file: only qwen2 files' q/k/v biases are read (a llama model with attention_bias is not supported from GGUF; use its safetensors folder)"));
                }
                blocks.insert(b);
            }
            let got = t[name].shape.dims();
            let want = self.shape_of(name);
            if got != want.as_slice() {
                return Err(m.err(name, format!("has shape {got:?}, but {} give {want:?}", self.why(name))));
            }
        }
        if let Some(b) = (0..self.layers).find(|b| !blocks.contains(b)) {
            return Err(m.err(&k("block_count"), format!("is {} but the file has no tensors of block {b} (blk.{b}.*)", self.layers)));
        }
        for name in ["output_norm.weight".to_string()].into_iter().chain((0..self.layers).flat_map(|b| BLOCK_TENSORS.iter().map(move |s| format!("blk.{b}.{s}")))) {
            if !t.contains_key(&name) {
                return Err(m.err(&name, format!("missing: every {a} block has q, k, v, output, gate, up, down and two norms")));
            }
        }
        for b in (0..self.layers).filter(|_| self.qkv_bias()) {
            for name in ["attn_q.bias", "attn_k.bias", "attn_v.bias"].map(|s| format!("blk.{b}.{s}")) {
                if !t.contains_key(&name) {
                    return Err(m.err(&name, "missing: every qwen2 block has q, k and v biases"));
                }
            }
        }
        Ok(())
    }

    pub(super) fn describe(self, m: &Meta) -> Described {
        let sources = m
            .c
            .tensor_infos
            .keys()
            .filter_map(|g| Some((hf_name(g)?, Source::Tensor { name: g.clone(), unpermute: self.permuted_heads(g) })))
            .collect();
        let p = &self;
        let mut config = match p.arch {
            "qwen2" => serde_json::json!({
                "architectures": ["Qwen2ForCausalLM"],
                "model_type": "qwen2",
                "use_sliding_window": false,
            }),
            _ => serde_json::json!({
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "head_dim": p.head_dim,
                "attention_bias": false,
                "mlp_bias": false,
            }),
        };
        let common = serde_json::json!({
            "hidden_size": p.hidden,
            "intermediate_size": p.inter,
            "num_hidden_layers": p.layers,
            "num_attention_heads": p.heads,
            "num_key_value_heads": p.kv_heads,
            "vocab_size": p.vocab,
            "rms_norm_eps": p.eps,
            "rope_theta": p.theta,
            "tie_word_embeddings": p.tied,
            "hidden_act": "silu",
            "max_position_embeddings": p.context,
            "torch_dtype": "float32",
        });
        extend(&mut config, common);
        if !p.rope_scaling.is_null() {
            extend(&mut config, serde_json::json!({ "rope_scaling": p.rope_scaling }));
        }
        Described { arch: p.arch, vocab: p.vocab, context: p.context, sources, config }
    }

    /// Qwen2 has q/k/v biases, llama none.
    fn qkv_bias(&self) -> bool {
        self.arch == "qwen2"
    }

    /// The q/k rows llama.cpp's converter permuted for this tensor (by head count), to undo.
    fn permuted_heads(&self, gguf_name: &str) -> Option<usize> {
        if self.arch != "llama" {
            return None;
        }
        let kind = block_of(gguf_name)?.1;
        match kind {
            "attn_q.weight" => Some(self.heads),
            "attn_k.weight" => Some(self.kv_heads),
            _ => None,
        }
    }

    /// The shape (outermost first) the metadata implies for a tensor `hf_name` accepts.
    fn shape_of(&self, name: &str) -> Vec<usize> {
        let (h, q, kv, f) = (self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.inter);
        let kind = block_of(name).map(|(_, rest)| rest).unwrap_or(name);
        match kind {
            "token_embd.weight" | "output.weight" => vec![self.vocab, h],
            "attn_q.weight" => vec![q, h],
            "attn_k.weight" | "attn_v.weight" => vec![kv, h],
            "attn_output.weight" => vec![h, q],
            "ffn_gate.weight" | "ffn_up.weight" => vec![f, h],
            "ffn_down.weight" => vec![h, f],
            "attn_q.bias" => vec![q],
            "attn_k.bias" | "attn_v.bias" => vec![kv],
            _ => vec![h], // the norms
        }
    }

    /// The metadata behind `shape_of`, for messages.
    fn why(&self, name: &str) -> String {
        let a = self.arch;
        let kind = block_of(name).map(|(_, rest)| rest).unwrap_or(name);
        let hd = format!("{} dimensions per head", self.head_dim);
        match kind {
            "token_embd.weight" | "output.weight" => format!("token_embd.weight's {} rows and {a}.embedding_length {}", self.vocab, self.hidden),
            "attn_q.weight" | "attn_output.weight" | "attn_q.bias" => format!("{a}.attention.head_count {} x {hd} and {a}.embedding_length {}", self.heads, self.hidden),
            "attn_k.weight" | "attn_v.weight" | "attn_k.bias" | "attn_v.bias" => format!("{a}.attention.head_count_kv {} x {hd} and {a}.embedding_length {}", self.kv_heads, self.hidden),
            "ffn_gate.weight" | "ffn_up.weight" | "ffn_down.weight" => format!("{a}.feed_forward_length {} and {a}.embedding_length {}", self.inter, self.hidden),
            _ => format!("{a}.embedding_length {}", self.hidden),
        }
    }
}

/// Undo llama.cpp's q/k permutation. The converter maps HF rows with
/// `w.reshape(heads, 2, d/2, in).swapaxes(1, 2)`, i.e. within each head the two halves
/// (rotate-half pairs i, i + d/2) become interleaved pairs (2i, 2i + 1). Inverse:
/// [heads, d/2, 2, in] -> swap -> [heads, 2, d/2, in].
pub fn unpermute(w: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (rows, cols, d) = head_rows(w, heads)?;
    w.reshape((heads, d / 2, 2, cols))? // [heads, d/2, 2, in]
        .transpose(1, 2)? // [heads, 2, d/2, in]
        .contiguous()?
        .reshape((rows, cols))
}

/// The forward direction (what llama.cpp's converter does), for writing test files.
pub fn permute(w: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (rows, cols, d) = head_rows(w, heads)?;
    w.reshape((heads, 2, d / 2, cols))?.transpose(1, 2)?.contiguous()?.reshape((rows, cols))
}

/// (rows, cols, rows per head) of a q/k matrix, or an error where the rows do not split
/// into `heads` heads of an even size (a division by zero or a wrong reshape otherwise).
fn head_rows(w: &Tensor, heads: usize) -> candle_core::Result<(usize, usize, usize)> {
    let (rows, cols) = w.dims2()?;
    if heads == 0 || rows % heads != 0 || !(rows / heads).is_multiple_of(2) {
        candle_core::bail!("{rows} rows do not split into {heads} heads of an even size");
    }
    Ok((rows, cols, rows / heads))
}
