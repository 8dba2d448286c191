//! What activation checkpointing keeps beyond each layer's input, and which pass an op is in.
//!
//! A checkpointed step runs every layer twice: once forward (graph dropped, only the layer's
//! input kept) and once more in backward, to rebuild the graph the gradient flows through.
//! The recomputation is a third of the step on a CPU. Five things make it cheaper without
//! changing a bit of the gradients:
//! - in the recomputation the layer's output value is never read (only its backward runs), so
//!   the fused MLP skips its down projection and residual add there ([`Pass::Recompute`]);
//! - the forward may leave the attention output and its log-sum-exp of chosen layers in a
//!   [`Kept`] slot, and the recomputation then skips the attention kernel (4·N·(NH·D + NH)
//!   bytes per layer: the best time saved per byte, so kept first);
//! - likewise the SwiGLU inputs g and u [N, I], and the recomputation skips the gate and up
//!   GEMMs (8·N·I bytes per layer);
//! - likewise the outputs of the attention projections (q, k, v, o; MLA's), and the
//!   recomputation skips their frozen GEMMs (4·N·Σ out bytes per layer). A kept output saves
//!   the inner dimension of its GEMM in multiply-adds per float, H for q/k/v/o as for a
//!   SwiGLU input (less for MLA's kv_b_proj, whose input is the latent), and the SwiGLU
//!   inputs also spare the norm before them, so they are kept first;
//! - the last layers may not be checkpointed at all ([`KeepLayer::whole`]), when the budget
//!   holds their whole graph (the plan's estimate of a layer's activations).
//!
//! `train.activation_checkpointing = "auto"` picks the layers from the memory the recipe
//! allows (`train::checkpoint_layers`). torchtune and PEFT checkpoint whole layers and
//! recompute everything; PyTorch's selective checkpointing saves chosen op outputs in the same
//! spirit (<https://pytorch.org/docs/stable/checkpoint.html>).

use std::sync::{Arc, Mutex};

/// The SwiGLU inputs of one layer: g = gate(n) and u = up(n), each [N, I] in f32.
pub type SwiGluInputs = (Vec<f32>, Vec<f32>);
/// One layer's attention output [B, NH, S, D] and log-sum-exp [B, NH, S], in f32.
pub type AttentionOutput = (Vec<f32>, Vec<f32>);
/// One linear's output [N, out] in f32, before its bias.
pub type LinearOutput = Vec<f32>;

/// Which pass a layer's forward belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// An ordinary forward: its value is used and its graph (if any) is what backward reads.
    Plain,
    /// A checkpointed step's forward: the value is used, the graph is dropped after.
    Checkpointed,
    /// The recomputation in a checkpointed step's backward: only the gradient is used. Ops
    /// may return a placeholder value (the fused MLP returns its input x unchanged).
    Recompute,
}

/// What one layer keeps, and where.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeepLayer {
    pub attention: bool,
    pub swiglu: bool,
    /// The outputs of the attention projections.
    pub linears: bool,
    /// Not checkpointed at all: the layer's graph is kept from the forward and backward runs
    /// through it with no recomputation. Always a run of the last layers (`train` runs them
    /// as one ordinary forward and backward after the checkpointed ones).
    pub whole: bool,
}

impl KeepLayer {
    /// Bytes this layer keeps per micro-batch, at `costs` per kind.
    pub fn bytes(&self, costs: KeepCosts) -> usize {
        if self.whole {
            return costs.whole;
        }
        self.attention as usize * costs.attention + self.swiglu as usize * costs.swiglu + self.linears as usize * costs.linears
    }

    /// Whether the layer keeps anything in a [`Kept`] slot.
    pub fn in_slot(&self) -> bool {
        self.attention || self.swiglu || self.linears
    }
}

/// Bytes per micro-batch (per pass where its rows run in passes, `train::pass_tokens`) one
/// layer keeps of each kind (`train::kept_bytes_per_layer`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeepCosts {
    /// Attention output + log-sum-exp.
    pub attention: usize,
    /// SwiGLU inputs g, u.
    pub swiglu: usize,
    /// The attention projections' outputs.
    pub linears: usize,
    /// The whole layer's graph (an estimate: `dist::plan::layer_activations`).
    pub whole: usize,
}

#[derive(Default)]
struct Held {
    attention: Option<AttentionOutput>,
    swiglu: Option<SwiGluInputs>,
    /// By the linear's index among its layer's sites (`Adapters::site`).
    linears: Vec<(usize, LinearOutput)>,
}

/// Per-layer slots for what a checkpointed forward keeps for its recomputation.
pub struct Kept {
    keep: Vec<KeepLayer>,
    held: Vec<Mutex<Held>>,
}

impl Kept {
    pub fn new(keep: &[KeepLayer]) -> Arc<Self> {
        Arc::new(Kept { keep: keep.to_vec(), held: keep.iter().map(|_| Mutex::new(Held::default())).collect() })
    }

    /// Layer `layer`'s slot, when it keeps anything.
    pub fn slot(self: &Arc<Self>, layer: usize) -> Option<Slot> {
        self.keep.get(layer).filter(|k| k.in_slot()).map(|_| Slot { kept: self.clone(), layer })
    }

    /// Bytes held now.
    pub fn bytes(&self) -> usize {
        let pair = |p: &Option<(Vec<f32>, Vec<f32>)>| p.as_ref().map_or(0, |(a, b)| 4 * (a.len() + b.len()));
        let linears = |h: &Held| h.linears.iter().map(|(_, y)| 4 * y.len()).sum::<usize>();
        self.held.iter().map(|m| m.lock().unwrap_or_else(|e| e.into_inner())).map(|h| pair(&h.attention) + pair(&h.swiglu) + linears(&h)).sum()
    }
}

/// One layer's slot in a [`Kept`] (owned, so an op node can hold it).
#[derive(Clone)]
pub struct Slot {
    kept: Arc<Kept>,
    layer: usize,
}

impl Slot {
    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.kept.held[self.layer].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether this layer keeps its attention output.
    pub fn keeps_attention(&self) -> bool {
        self.kept.keep[self.layer].attention
    }

    /// Kept only if this layer keeps its SwiGLU inputs; otherwise dropped.
    pub fn put_swiglu(&self, v: SwiGluInputs) {
        if self.kept.keep[self.layer].swiglu {
            self.held().swiglu = Some(v);
        }
    }

    pub fn take_swiglu(&self) -> Option<SwiGluInputs> {
        self.held().swiglu.take()
    }

    /// Kept only if this layer keeps its attention output; otherwise dropped.
    pub fn put_attention(&self, v: AttentionOutput) {
        if self.kept.keep[self.layer].attention {
            self.held().attention = Some(v);
        }
    }

    pub fn take_attention(&self) -> Option<AttentionOutput> {
        self.held().attention.take()
    }

    /// Whether this layer keeps its attention projections' outputs.
    pub fn keeps_linears(&self) -> bool {
        self.kept.keep[self.layer].linears
    }

    /// Kept only if this layer keeps its projections' outputs; otherwise dropped.
    pub fn put_linear(&self, site: usize, y: LinearOutput) {
        if self.keeps_linears() {
            self.held().linears.push((site, y));
        }
    }

    pub fn take_linear(&self, site: usize) -> Option<LinearOutput> {
        let mut held = self.held();
        let at = held.linears.iter().position(|(s, _)| *s == site)?;
        Some(held.linears.swap_remove(at).1)
    }
}

/// What an op is told about checkpointing: the pass, and the layer's slot if it keeps anything.
#[derive(Clone)]
pub struct Keep {
    pub pass: Pass,
    pub slot: Option<Slot>,
}

impl Keep {
    /// An ordinary forward, nothing kept.
    pub fn plain() -> Self {
        Keep { pass: Pass::Plain, slot: None }
    }

    /// What the linear at index `site` of the layer's sites is told.
    pub fn linear(&self, site: usize) -> LinearKeep {
        let slot = self.slot.clone().filter(|s| s.keeps_linears());
        LinearKeep { pass: self.pass, slot, site }
    }
}

/// What one linear op is told about checkpointing: a checkpointed forward leaves a copy of
/// its output in the layer's slot, and the recomputation returns that copy instead of running
/// its GEMMs (its backward needs only its input, its weights and the upstream gradient).
#[derive(Clone)]
pub struct LinearKeep {
    pass: Pass,
    slot: Option<Slot>,
    site: usize,
}

impl LinearKeep {
    /// Nothing kept, nothing reused.
    pub fn none() -> Self {
        LinearKeep { pass: Pass::Plain, slot: None, site: 0 }
    }

    /// In the recomputation: the output of `len` elements the checkpointed forward kept.
    pub fn reused(&self, len: usize) -> Option<LinearOutput> {
        match (self.pass, &self.slot) {
            (Pass::Recompute, Some(slot)) => slot.take_linear(self.site).filter(|y| y.len() == len),
            _ => None,
        }
    }

    /// In a checkpointed forward: keep a copy of the output `y`.
    pub fn hold(&self, y: &[f32]) {
        if let (Pass::Checkpointed, Some(slot)) = (self.pass, &self.slot) {
            slot.put_linear(self.site, y.to_vec());
        }
    }
}

/// What each of `n_layers` layers keeps within `budget` bytes: first the attention output of
/// every layer that can (`costs.attention` bytes each, from the last layer down: their
/// backward runs first, so their memory is freed first), then the SwiGLU inputs
/// (`costs.swiglu` each), then the attention projections' outputs (`costs.linears` each),
/// then, with what is left, whole layers from the last one down
/// (`costs.whole` each, less what the layer kept already): where the base dwarfs the
/// activations (a MoE model at short sequences) "auto" then checkpoints little or nothing.
/// `eligible(i)` says what layer i can keep (the fused CPU ops; whole layers anywhere).
pub fn layers_to_keep(n_layers: usize, costs: KeepCosts, budget: usize, eligible: impl Fn(usize) -> KeepLayer) -> Vec<KeepLayer> {
    let mut keep = vec![KeepLayer::default(); n_layers];
    let mut left = budget;
    let mut take = |cost: usize, refund: usize| {
        let fits = cost > 0 && cost <= left + refund;
        if fits {
            left = left + refund - cost;
        }
        fits
    };
    for i in (0..n_layers).rev() {
        keep[i].attention = eligible(i).attention && take(costs.attention, 0);
    }
    for i in (0..n_layers).rev() {
        keep[i].swiglu = eligible(i).swiglu && take(costs.swiglu, 0);
    }
    for i in (0..n_layers).rev() {
        keep[i].linears = eligible(i).linears && take(costs.linears, 0);
    }
    // Then whole layers, from the last down while they fit, each giving back what it kept.
    for i in (0..n_layers).rev() {
        if !(eligible(i).whole && take(costs.whole, keep[i].bytes(costs))) {
            break;
        }
        keep[i] = KeepLayer { whole: true, ..KeepLayer::default() };
    }
    keep
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_keeps_attention_outputs_first_then_swiglu_inputs_then_projection_outputs_then_whole_layers_from_the_last() {
        let both = KeepLayer { attention: true, swiglu: true, ..KeepLayer::default() };
        let att = KeepLayer { attention: true, ..KeepLayer::default() };
        let whole = KeepLayer { whole: true, ..KeepLayer::default() };
        let none = KeepLayer::default();
        let all = KeepLayer { attention: true, swiglu: true, whole: true, linears: false };
        // Layer 2 has no fused MLP (MoE, say): it can keep only its attention output.
        let elig = |i: usize| if i == 2 { KeepLayer { swiglu: false, ..all } } else { all };
        let costs = KeepCosts { attention: 1, swiglu: 10, linears: 0, whole: 30 };
        assert_eq!(layers_to_keep(4, costs, 15, elig), vec![att, att, att, both]);
        assert_eq!(layers_to_keep(4, costs, 24, elig), vec![att, both, att, both]);
        assert_eq!(layers_to_keep(4, costs, 2, elig), vec![none, none, att, att]);
        assert_eq!(layers_to_keep(4, costs, 0, elig), vec![none; 4]);
        // 4 + 30 = 34 kept first; layer 3 then gives back its 11 for 30 (53), layer 2 its 1 (82).
        assert_eq!(layers_to_keep(4, costs, 53, elig), vec![both, both, att, whole]);
        assert_eq!(layers_to_keep(4, costs, 82, elig), vec![both, both, whole, whole]);
        assert_eq!(layers_to_keep(4, costs, 120, elig), vec![whole; 4]);
        // Whole layers stay a run of the last ones: a layer that cannot be whole ends it.
        let elig = |i: usize| if i == 2 { both } else { all };
        assert_eq!(layers_to_keep(4, costs, 1000, elig), vec![both, both, both, whole]);
        // The projections' outputs come after the SwiGLU inputs: 4 + 20 leaves 6, for layer 3's.
        let all = KeepLayer { linears: true, ..all };
        let elig = |i: usize| if i == 2 { KeepLayer { swiglu: false, ..all } } else { all };
        let costs = KeepCosts { linears: 5, ..costs };
        let three = KeepLayer { linears: true, ..both };
        assert_eq!(layers_to_keep(4, costs, 30, elig), vec![att, both, att, three]);
        // 4 + 30 leaves 10: layers 3 and 2 keep theirs, layer 2 having no SwiGLU inputs to keep.
        assert_eq!(layers_to_keep(4, costs, 44, elig), vec![both, both, KeepLayer { linears: true, ..att }, three]);
    }

    #[test]
    fn a_linear_gets_back_its_own_output_only_in_the_recomputation_and_only_where_its_layer_keeps_them() {
        let lin = KeepLayer { linears: true, ..KeepLayer::default() };
        let kept = Kept::new(&[KeepLayer { attention: true, ..KeepLayer::default() }, lin]);
        let keep = |pass, layer| Keep { pass, slot: kept.slot(layer) };
        // Layer 0 keeps its attention output only: its linears keep nothing.
        keep(Pass::Checkpointed, 0).linear(1).hold(&[1.0; 4]);
        assert_eq!(kept.bytes(), 0);
        assert_eq!(keep(Pass::Recompute, 0).linear(1).reused(4), None);
        // Layer 1: sites 2 and 5 held in the checkpointed forward, nothing in a plain one.
        keep(Pass::Plain, 1).linear(2).hold(&[9.0; 3]);
        keep(Pass::Checkpointed, 1).linear(2).hold(&[2.0; 3]);
        keep(Pass::Checkpointed, 1).linear(5).hold(&[5.0; 6]);
        assert_eq!(kept.bytes(), 36);
        assert_eq!(keep(Pass::Checkpointed, 1).linear(5).reused(6), None, "reused only in the recomputation");
        assert_eq!(keep(Pass::Recompute, 1).linear(5).reused(6), Some(vec![5.0; 6]));
        assert_eq!(keep(Pass::Recompute, 1).linear(5).reused(6), None, "handed back once");
        assert_eq!(keep(Pass::Recompute, 1).linear(2).reused(4), None, "an output of another size is not this op's");
        assert_eq!(kept.bytes(), 0);
    }

    #[test]
    fn a_slot_hands_back_what_was_put_once_and_only_what_its_layer_keeps() {
        let kept = Kept::new(&[KeepLayer::default(), KeepLayer { swiglu: true, ..KeepLayer::default() }]);
        assert!(kept.slot(0).is_none() && kept.slot(7).is_none());
        let s = kept.slot(1).expect("layer 1 keeps");
        s.put_attention((vec![0.0; 5], vec![0.0; 1]));
        s.put_swiglu((vec![1.0; 3], vec![2.0; 3]));
        assert_eq!(kept.bytes(), 24, "only the SwiGLU inputs are kept");
        assert_eq!(s.take_attention(), None);
        assert_eq!(s.take_swiglu(), Some((vec![1.0; 3], vec![2.0; 3])));
        assert_eq!(s.take_swiglu(), None);
        assert_eq!(kept.bytes(), 0);
    }
}
