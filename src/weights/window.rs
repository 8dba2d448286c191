//! The layer window: which frozen units (a decoder layer, or one non-layer tensor) are held
//! materialised at a time, for sources that keep the base in a compact form and expand a
//! unit when the model asks for it: ZeRO-3 gathers a layer's shards (`dist::zero`), a
//! quantized base dequantises a layer (`weights::quantized`).
//!
//! [`Window`] is the policy: after a request for a unit, keep it and the next
//! `prefetch` layers in the direction of travel (forward in the forward pass, backward in the
//! recomputed backward pass) and release the rest. [`Held`] applies it: it releases what
//! leaves the window, asks the source to materialise what enters, and books both in the
//! [`Account`] (`gathered`, `gathered_peak`), which `finetune plan` predicts by replaying the
//! same window (`dist::plan`).

use crate::dist::zero::Account;
use crate::error::{Error, Result};
use candle_core::Tensor;
use std::collections::HashMap;

/// What is gathered and released together.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Unit {
    Layer(usize),
    /// A non-layer tensor (embedding, final norm, lm_head) by name.
    Tensor(String),
}

impl Unit {
    pub fn of(name: &str) -> Unit {
        name.strip_prefix("model.layers.")
            .and_then(|rest| rest.split('.').next())
            .and_then(|i| i.parse().ok())
            .map_or_else(|| Unit::Tensor(name.to_string()), Unit::Layer)
    }
}

/// The gather/release policy: after a request for unit `u`, keep `u` and the next
/// `prefetch` layers in the direction of travel; release the rest.
#[derive(Clone, Debug)]
pub struct Window {
    pub n_layers: usize,
    pub prefetch: usize,
    last_layer: Option<usize>,
    /// A non-layer unit was requested since the last layer (embedding before layer 0, the
    /// head before the backward pass starts again at the last layer).
    other_since: bool,
    backward: bool,
}

impl Window {
    pub fn new(n_layers: usize, prefetch: usize) -> Self {
        Window { n_layers, prefetch, last_layer: None, other_since: true, backward: false }
    }

    /// Units to hold after a request for `u`, the requested one first.
    pub fn request(&mut self, u: &Unit) -> Vec<Unit> {
        let Unit::Layer(i) = *u else {
            self.other_since = true;
            return vec![u.clone()];
        };
        self.backward = match self.last_layer {
            _ if self.other_since && i == 0 => false,
            _ if self.other_since && i + 1 == self.n_layers => true,
            Some(l) if l + 1 == i => false,
            Some(l) if l == i + 1 => true,
            _ => self.backward,
        };
        self.last_layer = Some(i);
        self.other_since = false;
        let mut keep = vec![Unit::Layer(i)];
        for k in 1..=self.prefetch {
            let j = if self.backward { i.checked_sub(k) } else { Some(i + k).filter(|&j| j < self.n_layers) };
            match j {
                Some(j) => keep.push(Unit::Layer(j)),
                None => break,
            }
        }
        keep
    }
}

/// The materialised units of one source, under a [`Window`].
pub struct Held {
    window: Window,
    units: HashMap<Unit, HashMap<String, Tensor>>,
    bytes: HashMap<Unit, usize>,
}

impl Held {
    pub fn new(n_layers: usize, prefetch: usize) -> Self {
        Held { window: Window::new(n_layers, prefetch), units: HashMap::new(), bytes: HashMap::new() }
    }

    /// The tensor `name`, with its unit and the window's prefetched units materialised.
    /// `fill(unit, held, also)` adds to `held` every tensor of `unit` it lacks (plus `also`,
    /// the requested name, for the requested unit) and returns the bytes it added.
    /// Released units are dropped before new ones are filled: what is held never exceeds
    /// the window.
    pub fn fetch(
        &mut self,
        name: &str,
        account: &Account,
        mut fill: impl FnMut(&Unit, &mut HashMap<String, Tensor>, Option<&str>) -> Result<usize>,
    ) -> Result<Tensor> {
        let unit = Unit::of(name);
        let keep = self.request(&unit, account);
        for (k, u) in keep.iter().enumerate() {
            let held = self.units.entry(u.clone()).or_default();
            let added = fill(u, held, if k == 0 { Some(name) } else { None })?;
            *self.bytes.entry(u.clone()).or_default() += added;
            account.add_gathered(added);
        }
        self.units
            .get(&unit)
            .and_then(|h| h.get(name))
            .cloned()
            .ok_or_else(|| Error::MissingTensor { name: name.into(), files: "(layer window)".into() })
    }
}

impl Held {
    /// Move the window to `unit`, releasing what leaves it; the units to hold now.
    fn request(&mut self, unit: &Unit, account: &Account) -> Vec<Unit> {
        let keep = self.window.request(unit);
        let gone: Vec<Unit> = self.units.keys().filter(|u| !keep.contains(u)).cloned().collect();
        for u in gone {
            self.units.remove(&u);
            account.sub_gathered(self.bytes.remove(&u).unwrap_or(0));
        }
        keep
    }

    /// Part of `name` materialised by `make` and handed out without being held (the LM
    /// head's rows, read a chunk at a time by the loss): the window moves to its unit first,
    /// so what is held meanwhile is only that, and the part's bytes count towards the
    /// gathered peak while it is made. The caller holds one part at a time.
    pub fn transient(&mut self, name: &str, account: &Account, make: impl FnOnce() -> Result<Tensor>) -> Result<Tensor> {
        self.request(&Unit::of(name), account);
        let t = make()?;
        let bytes = t.elem_count() * t.dtype().size_in_bytes();
        account.add_gathered(bytes);
        account.sub_gathered(bytes);
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_prefetches_in_the_direction_of_travel() {
        let mut w = Window::new(4, 1);
        assert_eq!(w.request(&Unit::Tensor("model.embed_tokens.weight".into())), vec![Unit::Tensor("model.embed_tokens.weight".into())]);
        assert_eq!(w.request(&Unit::Layer(0)), vec![Unit::Layer(0), Unit::Layer(1)]);
        assert_eq!(w.request(&Unit::Layer(0)), vec![Unit::Layer(0), Unit::Layer(1)]);
        assert_eq!(w.request(&Unit::Layer(1)), vec![Unit::Layer(1), Unit::Layer(2)]);
        assert_eq!(w.request(&Unit::Layer(2)), vec![Unit::Layer(2), Unit::Layer(3)]);
        assert_eq!(w.request(&Unit::Layer(3)), vec![Unit::Layer(3)]);
        w.request(&Unit::Tensor("lm_head.weight".into()));
        // Recomputed backward: from the last layer down.
        assert_eq!(w.request(&Unit::Layer(3)), vec![Unit::Layer(3), Unit::Layer(2)]);
        assert_eq!(w.request(&Unit::Layer(2)), vec![Unit::Layer(2), Unit::Layer(1)]);
        assert_eq!(w.request(&Unit::Layer(0)), vec![Unit::Layer(0)]);
    }

    #[test]
    fn units_are_layers_or_single_tensors() {
        assert_eq!(Unit::of("model.layers.12.self_attn.q_proj.weight"), Unit::Layer(12));
        assert_eq!(Unit::of("model.norm.weight"), Unit::Tensor("model.norm.weight".into()));
    }
}
