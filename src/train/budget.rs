//! Activation checkpointing's policy: what "auto" keeps per layer within the memory budget
//! (`checkpoint_layers`, `default_keep_budget`, `kept_bytes_per_layer`), and the passes a long
//! micro-batch runs in (`pass_tokens`, `pass_rows`). `finetune plan` replays the same choices.

use crate::config::ModelConfig;
use crate::ops::checkpoint::{KeepCosts, KeepLayer};
use crate::weights::parse_dtype;

/// What each layer of a checkpointed step keeps for its recomputation (`ops::checkpoint`);
/// `None` when checkpointing is off. "auto" spends `train.activation_memory_mb` (or the
/// default budget) on attention outputs first, then SwiGLU inputs, then the attention
/// projections' outputs, from the last layer down,
/// where the fused CPU ops run (elsewhere nothing would be kept, so nothing is reserved):
/// attention on a CPU with `model.kernels = "auto"`, the MLP where it is dense, unadapted and
/// unbiased too. Whole layers (not checkpointed) only there too (a GPU's memory is the tight
/// one: "auto" stays `true` on it), and only where `resident`: the frozen weights stay in
/// memory as the matmuls read them. A layer's graph holds the weights it was handed,
/// so with ZeRO-3 shards, a quantized base or a bf16 base converted for `model.matmul = "f32"` a whole
/// layer would keep its gathered, dequantised or converted copy until backward.
/// Without `train.activation_memory_mb`, a model whose layers all fit whole in a quarter of
/// its base's bytes (DeepSeek-V2-Lite's MoE cut at 1 x 512: 617 MB of activations beside a
/// 3.4 GB bf16 base) keeps in every layer all that is costly to recompute, or, where some
/// layer cannot keep its SwiGLU inputs (adapted MLPs or routed experts), is not checkpointed
/// at all: the peak is then the base plus at most a quarter, where recomputing whole MLPs
/// would save a few percent of it and cost ~30% of the step.
/// Where micro-batches run in passes of their rows ([`pass_tokens`]), all this is per pass.
/// `fused`: whether the fused CPU ops run (`Kernels::fused_on`).
pub fn checkpoint_layers(r: &crate::recipe::Recipe, cfg: &ModelConfig, fused: bool, resident: bool) -> Option<Vec<KeepLayer>> {
    use crate::recipe::Checkpointing;
    let l = cfg.num_hidden_layers;
    match r.train.activation_checkpointing {
        Checkpointing::Off => None,
        Checkpointing::On => Some(vec![KeepLayer::default(); l]),
        Checkpointing::Auto => {
            let shape = pass_shape(r, fused, resident);
            let costs = kept_bytes_per_layer(cfg, shape);
            let targets = r.lora.targets.as_deref().unwrap_or_default(); // unset: attention only
            let mlp_adapted = ["gate_proj", "up_proj", "down_proj"].iter().any(|p| targets.iter().any(|t| t == p));
            // A dense layer's fused MLP runs when no MLP projection is adapted; a MoE layer's
            // experts op when no routed expert is (it keeps the SwiGLU inputs of every expert,
            // and of the shared experts where they are not adapted either).
            let swiglu = |i: usize| fused && if cfg.is_moe_layer(i) { !r.lora.routed_experts } else { !mlp_adapted && !cfg.mlp_bias };
            let eligible = |i: usize| KeepLayer { attention: fused, swiglu: swiglu(i), linears: fused, whole: fused && resident };
            let base = cfg.base_param_count() as usize * parse_dtype(&r.model.dtype).size_in_bytes();
            if fused && resident && r.train.activation_memory_mb.is_none() && l * costs.whole <= base / 4 {
                // The base dwarfs the activations (a MoE model at short sequences). Where every
                // layer can keep its SwiGLU inputs (no MLP or routed expert adapted), each keeps
                // all that is costly to recompute, and the recomputation runs only norms, RoPE,
                // the router and element-wise ops: on make bench's MoE cut at 1 x 512 (2-core
                // Zen 5) as fast as no checkpointing (334-343 against 318-347 tokens/s) at 194 MB
                // less peak RSS (2850 against 3044 MB). Otherwise the MLPs would be recomputed
                // whole, and no layer is checkpointed.
                if (0..l).all(swiglu) {
                    return Some((0..l).map(|i| KeepLayer { whole: false, ..eligible(i) }).collect());
                }
                return Some(vec![KeepLayer { whole: true, ..KeepLayer::default() }; l]);
            }
            let budget = r.train.activation_memory_mb.map_or_else(|| default_keep_budget(r, cfg, costs, shape.0 * shape.1), |mb| mb << 20);
            Some(crate::ops::checkpoint::layers_to_keep(l, costs, budget, eligible))
        }
    }
}

/// The largest micro-batch as (rows, padded length): micro_batch_size x max_seq_len, or one
/// row of data.max_tokens with token batching (the most tokens, in the longest rows).
pub fn micro_batch_shape(r: &crate::recipe::Recipe) -> (usize, usize) {
    if r.data.batch_by == "tokens" { (1, r.data.max_tokens) } else { (r.train.micro_batch_size, r.data.max_seq_len) }
}

/// The most tokens one forward and backward pass runs of a micro-batch, where its rows are
/// split into passes: with "auto" checkpointing on the fused CPU ops, the weights resident
/// (see [`checkpoint_layers`]), no `train.activation_memory_mb` (a budget the recipe sets is
/// for a whole micro-batch) and micro-batches of rows that can hold more than `PASS_TOKENS`.
/// A micro-batch (padded to its longest row) then runs as many rows at a time as hold at most
/// that many tokens (at least one), each pass's gradients added to the step's in f64, as across
/// micro-batches, and the loss the same sum; dropout draws the masks of the whole micro-batch.
/// Not with dropout on routed-expert adapters: an expert's masks follow the order of the tokens
/// routed to it within a pass, not the micro-batch's.
/// Per-token work does not shrink with the pass (2048 tokens keep a CPU's GEMMs as busy as
/// more), while what the recomputation can keep in the default budget grows: at 8 x 512 on
/// SmolLM2 (bf16 base, LoRA q/k/v/o, 2-core Zen 3 EPYC, three alternating rounds) two passes
/// of 4 x 512 ran 141-143 tokens/s against one pass's 123-130, at 1.67 against 1.94 GB peak RSS.
pub fn pass_tokens(r: &crate::recipe::Recipe, fused: bool, resident: bool) -> Option<usize> {
    use crate::recipe::Checkpointing;
    let (b, s) = micro_batch_shape(r);
    let auto = r.train.activation_checkpointing == Checkpointing::Auto && r.train.activation_memory_mb.is_none();
    let token_masks = !(r.lora.routed_experts && r.lora.dropout > 0.0);
    (auto && fused && resident && token_masks && r.data.batch_by != "tokens" && b * s > PASS_TOKENS).then_some(PASS_TOKENS)
}

/// Rows of the largest micro-batch that one pass runs ([`pass_tokens`]; all of them where
/// micro-batches are not split).
pub fn pass_rows(r: &crate::recipe::Recipe, fused: bool, resident: bool) -> usize {
    pass_shape(r, fused, resident).0
}

/// Most tokens of a pass where [`pass_tokens`] splits micro-batches: the size up to which the
/// default budget keeps every layer's attention output and SwiGLU inputs.
const PASS_TOKENS: usize = 2048;

/// The largest pass as (rows, padded length): [`micro_batch_shape`], in as many rows as
/// [`pass_tokens`] lets a pass of max_seq_len rows hold.
pub fn pass_shape(r: &crate::recipe::Recipe, fused: bool, resident: bool) -> (usize, usize) {
    let (b, s) = micro_batch_shape(r);
    (rows_per_pass(pass_tokens(r, fused, resident), b, s), s)
}

/// Rows of a micro-batch of `rows` x `seq` tokens that one pass runs under [`pass_tokens`]' cap
/// (all of them without one, at least one with).
pub(super) fn rows_per_pass(cap: Option<usize>, rows: usize, seq: usize) -> usize {
    cap.map_or(rows, |cap| (cap / seq.max(1)).clamp(1, rows.max(1)))
}

/// Bytes one layer keeps per pass of `(b, s)` rows and tokens: attention output +
/// log-sum-exp, SwiGLU inputs, the attention projections' outputs (all f32), and the whole
/// layer's graph (the plan's estimate).
pub fn kept_bytes_per_layer(cfg: &ModelConfig, (b, s): (usize, usize)) -> KeepCosts {
    let tokens = b * s;
    let nh = cfg.num_attention_heads;
    let width = cfg.attention_head_width();
    KeepCosts {
        attention: 4 * tokens * nh * (width + 1),
        swiglu: 8 * tokens * swiglu_width(cfg),
        linears: 4 * tokens * attention_projection_outputs(cfg),
        whole: crate::dist::plan::layer_activations(cfg, b, s, 4, false),
    }
}

/// Floats per token of a layer's SwiGLU inputs (each of g and u): the dense MLP's
/// intermediate size, or in MoE layers the K routed experts' and the shared experts', the
/// larger of the two where a model has both kinds of layer.
fn swiglu_width(cfg: &ModelConfig) -> usize {
    let moe = cfg.moe.as_ref().filter(|m| cfg.num_hidden_layers > m.first_k_dense_replace);
    let experts = moe.map_or(0, |m| (m.num_experts_per_tok + m.n_shared_experts) * m.moe_intermediate_size);
    let dense = cfg.moe.as_ref().is_none_or(|m| m.first_k_dense_replace > 0);
    experts.max(if dense { cfg.intermediate_size } else { 0 })
}

/// Σ out_features over a layer's attention projections (q, k, v, o; MLA's).
fn attention_projection_outputs(cfg: &ModelConfig) -> usize {
    let attn = cfg.linear_sites(0).into_iter().filter(|p| p.starts_with("self_attn."));
    attn.filter_map(|p| cfg.linear_shape(&p)).map(|(_, out, _)| out).sum()
}

/// One line on what checkpointing keeps, for the log and summary.json.
/// `per`: what the kept bytes are for ("micro-batch", or "pass" where micro-batches run in
/// passes, `pass_tokens`).
pub(super) fn describe_checkpointing(keep: Option<&[KeepLayer]>, costs: KeepCosts, per: &str) -> String {
    let Some(keep) = keep else { return "activation checkpointing off".into() };
    let a = keep.iter().filter(|k| k.attention).count();
    let m = keep.iter().filter(|k| k.swiglu).count();
    let p = keep.iter().filter(|k| k.linears).count();
    let w = keep.iter().filter(|k| k.whole).count();
    let l = keep.len();
    let mb = keep.iter().map(|k| k.bytes(costs)).sum::<usize>() as f64 / (1u64 << 20) as f64;
    match (a + m + p, w) {
        (0, 0) => "activation checkpointing: every layer recomputed from its input".into(),
        (_, w) if w == l => format!("activation checkpointing: none needed, every layer's activations fit the budget (~{mb:.0} MB per {per})"),
        (0, w) => format!("activation checkpointing: the last {w} of {l} layers not checkpointed, the others recomputed from their inputs (~{mb:.0} MB per {per})"),
        _ => format!(
            "activation checkpointing: layers recomputed from their inputs, reusing the attention outputs of {a}, the SwiGLU inputs of {m} and the projection outputs of {p} of {l} layers{} (~{mb:.0} MB per {per})",
            if w > 0 { format!("; the last {w} not checkpointed") } else { String::new() }
        ),
    }
}

/// The budget "auto" checkpointing keeps activations in when the recipe sets none.
/// - A 16-bit base: enough to keep every layer's attention output and SwiGLU inputs at up to
///   2048 tokens a micro-batch (their cost at 2048 tokens beyond that), and never less than
///   four times what checkpointing keeps anyway (each layer's input, L·N·H f32). The weights
///   take half the memory of f32 ones, which leaves that much room under a third of PEFT's
///   leanest RSS (SmolLM2, 2-core AVX2 EPYC, bf16 base widened, 1 x 512: keeping 252 MB
///   against 130 MB ran 136-145 against 126-130 tokens/s in 3 of 3 alternating rounds, this
///   default's 214 MB 149-210 against 142-197 in 5 of 5, at 0.30-0.31x PEFT's RSS; 4 x 512
///   with 857 MB peaked at 0.30x). What is then left to recompute is the
///   attention projections and norms, ~8% of a step. At 4096 tokens the floor (1 GB on
///   SmolLM2) is the larger, as before (0.27x PEFT's RSS on a Zen 4 VM).
///   Beyond 1024 tokens the budget also holds the attention projections' outputs of a share
///   of the layers, growing to two fifths at 2048 (SmolLM2 at 4 x 512: 1001 MB, the last 12
///   layers'). PEFT's leanest RSS grows with the tokens (~2.3 GB at 1 x 512, ~5.1 GB at
///   4 x 512) where ours is mostly the base, so the room under its third grows faster than
///   the tokens do: at 4 x 512 keeping the projection outputs of 15 layers (1040 MB) ran 139-151
///   against 128-141 tokens/s median in 4 of 4 alternating rounds (2-core AVX2 EPYC), 1.70
///   against 1.49 GB peak, 0.34x PEFT's leanest. At 1 x 512 they would cost 90 MB more
///   (304 MB) for ~5% (median 129-143 against 120-134 tokens/s, faster in 3 of 4 rounds, peak
///   795 against 699 MB): 0.34x PEFT's leanest RSS on that EPYC, but ~0.39x on the AMX VM,
///   where PEFT's leanest row (bf16 base) took 2045 MB, so none are kept there by default.
/// - An f32 base: twice the layer inputs up to 1024 tokens a micro-batch, growing to four
///   times at 2048 and beyond. Why it grows with the tokens faster than they do: at few tokens
///   the step's memory is mostly the base, and at 1 x 512 an f32 SmolLM2 run with more kept
///   passes a third of PEFT's leanest RSS; at 4 x 512 the same third leaves ~0.7 GB beside our
///   ~0.9 GB, and keeping the SwiGLU inputs of about ten more layers is worth it (4 x 512 f32
///   on a 2-core AVX2 EPYC, alternating runs at 260 and 520 MB: 123 and 134 tokens/s median,
///   1.12 and 1.38 GB peak). On SmolLM2: 540 MB at 4 x 512, 67 MB at 1 x 512.
fn default_keep_budget(r: &crate::recipe::Recipe, cfg: &ModelConfig, costs: KeepCosts, tokens: usize) -> usize {
    let inputs = cfg.num_hidden_layers * tokens * cfg.hidden_size * 4;
    if r.model.dtype == "f32" {
        return inputs * tokens.clamp(1024, 2048) / 512;
    }
    let (l, capped) = (cfg.num_hidden_layers, tokens.min(2048));
    let every_layer = l * (costs.attention + costs.swiglu) * capped / tokens.max(1);
    // Beyond 1024 tokens, the projection outputs of a share of the layers that grows to two
    // fifths at 2048.
    let projections = l * costs.linears * capped / tokens.max(1) * 2 * capped.saturating_sub(1024) / (5 * 1024);
    (every_layer + projections).max(4 * inputs)
}
