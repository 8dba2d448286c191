//! `finetune plan`: memory per device and on the host, from config.json and the recipe alone
//! (no weights read).
//!
//! The exact rows (frozen shard, gathered peak, LoRA params and grads, optimizer state) are
//! computed the way the run allocates them: the same per-tensor sharding (ceil(n / N)
//! elements per rank, padded), and the same gather/release [`Window`] replayed over the order
//! in which a training step asks for tensors. A CPU run's [`Account`](super::zero::Account)
//! records the same quantities, and a test holds the two equal. Activations are an estimate
//! (they are not in the account): the tensors one decoder layer keeps for backward.

use crate::weights::{Unit, Window};
use crate::config::ModelConfig;
use crate::ops::Kernels;
use crate::recipe::Recipe;
use candle_core::{DType, Device};
use std::collections::HashMap;

/// Bytes per device (one rank) and on the host, for one world size.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub world: usize,
    pub zero_stage: usize,
    /// The frozen base this rank keeps between uses (its shards, or all of it at stage 0).
    pub frozen: usize,
    /// Most gathered frozen bytes held at once (stage 3).
    pub gathered_peak: usize,
    pub lora_params: usize,
    pub lora_grads: usize,
    /// This rank's slice of the AdamW state (exp_avg and exp_avg_sq, f32).
    pub optimizer: usize,
    /// Optimizer state lives on the host ("cpu") or on the device ("none").
    pub optimizer_on_host: bool,
    /// Estimated activation memory with and without activation checkpointing.
    pub activations_ckpt: usize,
    pub activations_full: usize,
    pub checkpointing: bool,
    /// A quantized base: what holds it (`GGUF Q4_K, Q6_K, F32` or `model.quantize = q8_0`).
    pub quantized: Option<String>,
    /// Host bytes the rank's data loader may hold at most: the shuffle buffer's rows, and with
    /// batch_by = "tokens" the pool of rows a batch is cut from, each up to max_seq_len tokens.
    pub data_buffer: usize,
}

impl Plan {
    pub fn device_total(&self) -> usize {
        let act = if self.checkpointing { self.activations_ckpt } else { self.activations_full };
        self.frozen + self.gathered_peak + self.lora_params + self.lora_grads + act + if self.optimizer_on_host { 0 } else { self.optimizer }
    }
}

/// The frozen base of a quantized run: bytes of each tensor's blocks (by HF name), and what
/// holds them (for the plan's header).
pub struct QuantizedBase {
    pub bytes: HashMap<String, usize>,
    pub what: String,
}

/// The plan of `r` on `world` ranks. `on_gpu` plans the portable path a GPU runs (also what
/// `model.kernels = "portable"` allocates on a CPU): activations in the storage dtype and
/// tall attention strips; otherwise the fused CPU path (f32 activations).
pub fn plan(cfg: &ModelConfig, r: &Recipe, world: usize, on_gpu: bool) -> Plan {
    plan_with(cfg, r, world, on_gpu, None, &[])
}

/// [`plan`], for a quantized base when `quant` is given: every rank holds the blocks whole
/// (a quantized base is not sharded) and dequantises one layer at a time into the storage
/// dtype (`weights::quantized`, no layers prefetched). `copied`: tables the files hold in a
/// form that cannot be read by rows (`weights::tables_copied`), which a resident base on the
/// host copies instead of leaving them in their file.
pub fn plan_with(cfg: &ModelConfig, r: &Recipe, world: usize, on_gpu: bool, quant: Option<&QuantizedBase>, copied: &[String]) -> Plan {
    let storage = crate::weights::parse_dtype(&r.model.dtype);
    let es = storage.size_in_bytes();
    let es_of = |name: &str| crate::weights::stored_dtype(name, storage).size_in_bytes();
    let tensors = cfg.frozen_tensors();
    let numel = |s: &[usize]| s.iter().product::<usize>();
    let stage3 = r.dist.zero_stage == 3;
    // The dtype the frozen matmuls read (a bf16 base is converted for f32 math without a bf16 unit).
    let matmul = if on_gpu { storage } else { Kernels::Auto.matmul_dtype(&r.model.matmul, storage, DType::F32, &Device::Cpu) };
    let (frozen, gathered_peak) = if let Some(q) = quant {
        let frozen = tensors.iter().map(|(n, s)| q.bytes.get(n).copied().unwrap_or(numel(s) * es_of(n))).sum();
        let mut unit_bytes: HashMap<Unit, usize> = HashMap::new();
        for (name, s) in &tensors {
            *unit_bytes.entry(Unit::of(name)).or_default() += numel(s) * es_of(name);
        }
        // The embedding's picked rows are never held (their few KB are not counted); the head
        // is dequantised a chunk of vocabulary rows at a time (`ops::loss`), its size set by
        // the matmul dtype.
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let chunk = crate::ops::loss::vocab_chunk(v, h * matmul.size_in_bytes()) * h * es_of("lm_head.weight");
        unit_bytes.insert(Unit::Tensor("model.embed_tokens.weight".into()), 0);
        unit_bytes.insert(head_unit(cfg), chunk);
        (frozen, replay_peak(cfg, 0, &unit_bytes, false))
    } else if stage3 {
        let chunk = |s: &[usize]| super::Partition::new(numel(s), 0, world).chunk();
        let frozen = tensors.iter().map(|(n, s)| chunk(s) * es_of(n)).sum();
        // Gathered bytes per unit, as the source allocates them: N * ceil(n / N) per tensor.
        let mut unit_bytes: HashMap<Unit, usize> = HashMap::new();
        for (name, s) in &tensors {
            *unit_bytes.entry(Unit::of(name)).or_default() += world * chunk(s) * es_of(name);
        }
        (frozen, replay_peak(cfg, r.dist.prefetch_layers, &unit_bytes, true))
    } else {
        // On the host an untied token embedding and head stay in their file: only the rows a
        // batch picks are read of the one, a chunk of rows at a time of the other
        // (`weights::RowTable`, `ops::loss`).
        let table = |n: &str| n == "model.embed_tokens.weight" || n == "lm_head.weight";
        let in_file = |n: &str| !on_gpu && !cfg.tie_word_embeddings && table(n) && !copied.iter().any(|c| c == n);
        (tensors.iter().filter(|(n, _)| !in_file(n)).map(|(n, s)| numel(s) * es_of(n)).sum(), 0)
    };
    let lora: usize = crate::train::trainable_parameters(cfg, &r.lora.spec(cfg)).0 as usize;
    // Rank 0's share, the largest (the last rank's may be shorter).
    let optimizer = 2 * super::Partition::new(lora, 0, world).len() * 4;
    // What "auto" checkpointing keeps for the recomputation (`ops::checkpoint`), for the
    // largest pass of a micro-batch's rows (`train::pass_tokens`).
    let resident = !stage3 && quant.is_none() && matmul == storage;
    let fused = !on_gpu && r.model.kernels().fused_on(&Device::Cpu);
    let shape = crate::train::pass_shape(r, fused, resident);
    let (ckpt, full) = activations(cfg, shape, if on_gpu { es } else { 4 }, on_gpu);
    let costs = crate::train::kept_bytes_per_layer(cfg, shape);
    let keep = crate::train::checkpoint_layers(r, cfg, fused, resident).unwrap_or_default();
    let kept: usize = keep.iter().map(|k| k.bytes(costs)).sum();
    // Every layer whole: no checkpointing at all, whatever the recipe says.
    let ckpt = if !keep.is_empty() && keep.iter().all(|k| k.whole) { full } else { ckpt + kept };
    Plan {
        world,
        zero_stage: r.dist.zero_stage,
        frozen,
        gathered_peak,
        lora_params: lora * 4,
        lora_grads: lora * 8, // accumulated in f64 (see train::forward_backward)
        optimizer,
        optimizer_on_host: r.dist.offload_optimizer == "cpu",
        activations_ckpt: ckpt,
        activations_full: full,
        checkpointing: r.train.activation_checkpointing.is_on(),
        quantized: quant.map(|q| q.what.clone()),
        data_buffer: data_buffer(&r.data),
    }
}

/// [`Plan::data_buffer`]: the rows the loader can hold at once, at their longest.
fn data_buffer(d: &crate::recipe::DataSection) -> usize {
    let tokens = |rows: usize| rows * (d.max_seq_len * crate::data::BUFFERED_BYTES_PER_TOKEN + crate::data::BUFFERED_BYTES_PER_ROW);
    let shuffle = if d.shuffle { tokens(d.shuffle_buffer) } else { 0 };
    // The pool is shuffle_buffer rows too, drawn through the shuffle buffer when shuffling.
    let pool = if d.batch_by == "tokens" { tokens(d.shuffle_buffer) } else { 0 };
    shuffle + pool
}

fn head_unit(cfg: &ModelConfig) -> Unit {
    Unit::Tensor(if cfg.tie_word_embeddings { "model.embed_tokens.weight" } else { "lm_head.weight" }.into())
}

/// Replay the order a run asks for frozen tensors (load check, then one training
/// micro-batch with recomputation, then an evaluation batch) through the [`Window`], and
/// return the most bytes held at once. `load_gathers`: the load check materialises the
/// embedding, norm and head (ZeRO-3 gathers them; a quantized source only reads blocks).
fn replay_peak(cfg: &ModelConfig, prefetch: usize, unit_bytes: &HashMap<Unit, usize>, load_gathers: bool) -> usize {
    let n = cfg.num_hidden_layers;
    let embed = Unit::Tensor("model.embed_tokens.weight".into());
    let norm = Unit::Tensor("model.norm.weight".into());
    let head = head_unit(cfg);
    let mut order = if load_gathers { vec![embed.clone(), norm.clone(), head.clone()] } else { Vec::new() };
    order.extend((0..n).map(Unit::Layer));
    // Training micro-batch: forward, head, recomputed backward from the top.
    order.push(embed.clone());
    order.extend((0..n).map(Unit::Layer));
    order.extend([norm.clone(), head.clone()]);
    order.extend((0..n).rev().map(Unit::Layer));
    // Evaluation batch.
    order.push(embed);
    order.extend((0..n).map(Unit::Layer));
    order.extend([norm, head]);
    let mut w = Window::new(n, prefetch);
    order.iter().map(|u| w.request(u).iter().map(|k| unit_bytes.get(k).copied().unwrap_or(0)).sum::<usize>()).max().unwrap_or(0)
}

/// Estimated activation bytes per rank: (with checkpointing, without). With checkpointing a
/// rank keeps each layer's input and one layer's tensors at a time (recomputed in backward);
/// without, every layer's. A layer keeps per token its norms, projections, attention output
/// and MLP intermediates, plus the f32 log-sum-exp of each query head (attention runs in
/// strips and never keeps scores); one strip's f32 scores are transient on top. `gpu` is the
/// portable path (activations in the storage dtype, tall strips), else the fused CPU ops.
fn activations(cfg: &ModelConfig, (b, s): (usize, usize), a: usize, gpu: bool) -> (usize, usize) {
    let (h, l) = (cfg.hidden_size, cfg.num_hidden_layers);
    let layer = layer_activations(cfg, b, s, a, gpu);
    // The loss head: one [chunk, V] block of f32 logits and its gradient.
    let head = 2 * (8 << 20) * 4;
    let saved_inputs = l * b * s * h * a;
    (saved_inputs + 2 * layer + head, l * layer + layer + head)
}

/// Estimated bytes one layer's graph holds for its backward, for `b` rows of `s` tokens with
/// activations of `a` bytes (see [`activations`]): what a layer that is not checkpointed keeps.
pub fn layer_activations(cfg: &ModelConfig, b: usize, s: usize, a: usize, gpu: bool) -> usize {
    let (h, l) = (cfg.hidden_size, cfg.num_hidden_layers);
    let nh = cfg.num_attention_heads;
    // Widths per token: q and each of k/v (MLA: per-head q/k of nope + rope, v padded to it,
    // plus the latent); the MLP's intermediate (MoE: K routed experts' and the shared ones',
    // plus each routed copy of the token's input and output).
    let (q, kv, i) = match (&cfg.mla, &cfg.moe) {
        (Some(m), moe) => {
            let w = m.attention_width();
            let ffn = match moe {
                Some(e) if l > e.first_k_dense_replace => {
                    (e.num_experts_per_tok + e.n_shared_experts) * e.moe_intermediate_size + 2 * e.num_experts_per_tok * h / 4
                }
                _ => cfg.intermediate_size,
            };
            (nh * w + m.q_lora_rank.unwrap_or(0), nh * w + m.kv_lora_rank / 2, ffn.max(cfg.intermediate_size))
        }
        (None, _) => (nh * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size),
    };
    let per_token = (8 * h + 3 * q + 3 * kv + 4 * i) * a + nh * 4;
    b * s * per_token + crate::ops::attention::strip_scratch_bytes(gpu, b, (cfg.num_attention_heads, cfg.num_key_value_heads), s)
}

fn gb(b: usize) -> String {
    if b >= 1 << 30 {
        format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    }
}

/// One cell of the table `render` prints: a plan's value in a row.
type Cell = Box<dyn Fn(&Plan) -> String>;

/// A parameter count as people say them: 6.91 B, 12.6 M, 40.1 k (a tiny model's base was
/// "0.00 B").
fn param_count(n: f64) -> String {
    match n {
        n if n >= 1e9 => format!("{:.2} B", n / 1e9),
        n if n >= 1e6 => format!("{:.1} M", n / 1e6),
        n if n >= 1e3 => format!("{:.1} k", n / 1e3),
        n => format!("{n:.0}"),
    }
}

/// The table `finetune plan` prints: one column per world size.
pub fn render(cfg: &ModelConfig, r: &Recipe, plans: &[Plan], on_gpu: bool) -> String {
    let dev = if on_gpu { "GPU" } else { "rank" };
    let base = cfg.base_param_count();
    let lora = crate::train::trainable_parameters(cfg, &r.lora.spec(cfg)).0;
    let mut out = format!(
        "{} ({} layers, hidden {}, vocab {}): base {} params in {}, LoRA {} params (f32), micro-batch {} x {} tokens, zero_stage {}\n\n",
        cfg.architecture_name,
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.vocab_size,
        param_count(base as f64),
        r.model.dtype,
        param_count(lora as f64),
        r.train.micro_batch_size,
        r.data.max_seq_len,
        r.dist.zero_stage
    );
    if let Some(q) = plans.first().and_then(|p| p.quantized.as_ref()) {
        out.insert_str(out.len() - 1, &format!("quantized base: {q}; each layer dequantised into {} when it runs\n", r.model.dtype));
    }
    let mut head = format!("{:<44}", "");
    for p in plans {
        head.push_str(&format!("{:>14}", format!("{} {dev}{}", p.world, if p.world > 1 { "s" } else { "" })));
    }
    out.push_str(&head);
    out.push('\n');
    let rows: Vec<(&str, Cell)> = vec![
        ("per device", Box::new(|_| String::new())),
        ("  frozen base kept (own shard)", Box::new(|p| gb(p.frozen))),
        (if plans.iter().any(|p| p.quantized.is_some()) { "  dequantised layers, peak" } else { "  gathered layers, peak" }, Box::new(|p| gb(p.gathered_peak))),
        ("  LoRA parameters", Box::new(|p| gb(p.lora_params))),
        ("  LoRA gradients", Box::new(|p| gb(p.lora_grads))),
        ("  optimizer state", Box::new(|p| if p.optimizer_on_host { "(host)".into() } else { gb(p.optimizer) })),
        ("  activations, checkpointing on (est.)", Box::new(|p| gb(p.activations_ckpt))),
        ("  activations, checkpointing off (est.)", Box::new(|p| gb(p.activations_full))),
        ("  total as the recipe runs", Box::new(|p| gb(p.device_total()))),
        ("host", Box::new(|_| String::new())),
        ("  optimizer state per rank", Box::new(|p| if p.optimizer_on_host { gb(p.optimizer) } else { "-".into() })),
        ("  optimizer state, all ranks", Box::new(|p| if p.optimizer_on_host { gb(p.optimizer * p.world) } else { "-".into() })),
        ("  data buffer per rank, at most", Box::new(|p| gb(p.data_buffer))),
    ];
    for (label, f) in rows {
        let mut line = format!("{label:<44}");
        for p in plans {
            line.push_str(&format!("{:>14}", f(p)));
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out.push_str(
        "\nExact rows are what a run allocates (a CPU run's account matches them); activations are estimates; the data buffer \
         is its bound (data.shuffle_buffer rows of up to data.max_seq_len tokens, 12 bytes each, twice that with batch_by = \"tokens\" \
         and shuffle; smaller where rows are shorter; the allocator's slack, a few percent, and an evaluation set, held whole, come on top).\n\
         With checkpointing off, ZeRO-3 is refused: the autograd graph would keep every gathered layer.\n",
    );
    if on_gpu {
        // Measured by scripts/gpu_dist_check.py (nvidia-smi's per-process peak against the total
        // above, DeepSeek-V2-Lite-shaped MoE on 1, 2 and 4 processes, H200, CUDA 13).
        out.push_str("Each GPU process also holds the CUDA context, kernels and cuBLAS workspace: 1.0-1.2 GiB measured on an H200.\n");
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_data_buffer_bound_follows_the_shuffle_buffer_and_the_token_pool() {
        let text = "[model]\npath = \"m\"\n[lora]\nrank = 2\nalpha = 4\n[data]\ntrain = \"d\"\nmax_seq_len = 100\nshuffle_buffer = 10\n[train]\nmax_steps = 1\nlr = 1e-4\n[output]\ndir = \"o\"\n";
        let data = |shuffle: bool, batch_by: &str| {
            let mut r: crate::recipe::Recipe = toml::from_str(text).unwrap();
            (r.data.shuffle, r.data.batch_by) = (shuffle, batch_by.into());
            super::data_buffer(&r.data)
        };
        let rows = 10 * (100 * 12 + crate::data::BUFFERED_BYTES_PER_ROW);
        assert_eq!(data(true, "rows"), rows);
        assert_eq!(data(false, "rows"), 0, "one row at a time");
        assert_eq!(data(false, "tokens"), rows, "the pool");
        assert_eq!(data(true, "tokens"), 2 * rows, "the pool, drawn through the shuffle buffer");
    }

    #[test]
    fn parameter_counts_read_at_every_size() {
        let got: Vec<String> = [6.91e9, 12.6e6, 40_100.0, 999.0].map(super::param_count).into();
        assert_eq!(got, ["6.91 B", "12.6 M", "40.1 k", "999"]);
    }
}
