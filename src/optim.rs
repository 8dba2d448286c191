//! AdamW, learning-rate schedules and gradient clipping, written to match PyTorch exactly:
//! `torch.optim.AdamW` (decoupled weight decay, bias correction, eps after the correction),
//! transformers' `get_{constant,linear,cosine}_schedule_with_warmup`, and
//! `torch.nn.utils.clip_grad_norm_`. Our own optimizer (not candle's) because resume needs the
//! moments and step count, which candle keeps private.
//!
//! State lives in host memory as flat f32 vectors (under data parallel, each rank's slice).

/// AdamW moments of a flat run of parameters (all LoRA tensors concatenated in
/// `Adapters::params` order, or one rank's slice of that).
#[derive(Clone, Debug, PartialEq)]
pub struct Moments {
    pub exp_avg: Vec<f32>,
    pub exp_avg_sq: Vec<f32>,
    /// torch's per-tensor `state["step"]`, per element (the same across a tensor): how many
    /// updates the element took. It falls behind the optimizer's step count only for a tensor
    /// that had no gradient in some step (a routed expert no token reached), which torch's
    /// AdamW skips. f32 so it travels with the moments (exact to 2^24 steps).
    pub steps: Vec<f32>,
}

impl Moments {
    pub fn zeros(n: usize) -> Self {
        Moments { exp_avg: vec![0.0; n], exp_avg_sq: vec![0.0; n], steps: vec![0.0; n] }
    }

    /// Elements `range` of each vector (a rank's slice).
    pub fn slice(&self, range: std::ops::Range<usize>) -> Self {
        Moments { exp_avg: self.exp_avg[range.clone()].to_vec(), exp_avg_sq: self.exp_avg_sq[range.clone()].to_vec(), steps: self.steps[range].to_vec() }
    }
}

#[derive(Clone, Debug)]
pub struct AdamW {
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    /// Optimizer steps taken (each parameter's own count is in `state.steps`).
    pub step: u64,
    /// Moments of the parameters this optimizer updates (a rank's slice under data parallel).
    pub state: Moments,
}

impl AdamW {
    pub fn new(n: usize, betas: (f64, f64), eps: f64, weight_decay: f64) -> Self {
        AdamW { betas, eps, weight_decay, step: 0, state: Moments::zeros(n) }
    }

    /// One update of `params` in place with learning rate `lr`. All LoRA tensors share one
    /// param group, so the update is element-wise and a flat run (or a rank's slice of it)
    /// gets exactly the numbers torch's per-tensor loop would.
    /// Follows torch's single-tensor `_single_tensor_adamw` op by op (f32 arithmetic on the
    /// tensors, Python-float scalars computed in f64), each op rounded on its own: torch's
    /// vectorised CPU kernels fuse `lerp_` and `addcmul_` into FMAs and order `addcdiv_` as
    /// `p + (-s·m) / denom`, so a moment or parameter may differ from torch's in the last bit
    /// (a review on 2026-11-29 counted up to a third of the moments' elements by step 2), far
    /// below the parity tests' tolerances. Our own runs, resumed or not, are bit for bit.
    ///
    /// `present[i] = false` marks an element whose tensor had no gradient this step (torch:
    /// `grad is None`): it is left alone entirely (no decay, no moment update, its step count
    /// unchanged), as torch's AdamW skips such parameters. `None`: every element has one.
    pub fn step(&mut self, p: &mut [f32], g: &[f32], present: Option<&[bool]>, lr: f64) {
        self.step += 1;
        let (b1, b2) = self.betas;
        // (lr / bias correction 1, sqrt(bias correction 2)) at an element's own step t.
        let corrections = |t: u64| {
            let t = t as i32;
            ((lr / (1.0 - b1.powi(t))) as f32, (1.0 - b2.powi(t)).sqrt() as f32)
        };
        let common = corrections(self.step);
        let decay = (1.0 - lr * self.weight_decay) as f32;
        let (w1, w2) = ((1.0 - b1) as f32, (1.0 - b2) as f32);
        let (b2f, eps) = (b2 as f32, self.eps as f32);
        let st = &mut self.state;
        assert!(g.len() == p.len() && st.steps.len() == p.len() && st.exp_avg.len() == p.len() && st.exp_avg_sq.len() == p.len(), "adamw: {} parameters, {} gradients, {} moments", p.len(), g.len(), st.steps.len());
        let this_step = self.step;
        // Element-wise, so chunks on every thread give the serial loop's numbers (a 1 x 512
        // SmolLM2 step spent 1.2% of its time in this loop on one of two threads).
        use rayon::prelude::*;
        const CHUNK: usize = 1 << 14;
        let chunks = p.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).zip(st.steps.par_chunks_mut(CHUNK)).zip(st.exp_avg.par_chunks_mut(CHUNK)).zip(st.exp_avg_sq.par_chunks_mut(CHUNK));
        chunks.enumerate().for_each(|(c, ((((p, g), steps), exp_avg), exp_avg_sq))| {
            let present = present.map(|m| &m[c * CHUNK..][..p.len()]);
            for i in 0..p.len() {
                if present.is_some_and(|m| !m[i]) {
                    continue;
                }
                steps[i] += 1.0;
                let t = steps[i] as u64;
                let (step_size, bias2_sqrt) = if t == this_step { common } else { corrections(t) };
                let gi = g[i];
                p[i] *= decay;
                // exp_avg.lerp_(grad, 1 - beta1)
                let m = exp_avg[i] + w1 * (gi - exp_avg[i]);
                // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                let v = exp_avg_sq[i] * b2f + w2 * gi * gi;
                exp_avg[i] = m;
                exp_avg_sq[i] = v;
                let denom = v.sqrt() / bias2_sqrt + eps;
                p[i] -= step_size * (m / denom);
            }
        });
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Schedule {
    Constant,
    Linear,
    Cosine,
}

impl Schedule {
    pub fn parse(s: &str) -> Schedule {
        match s {
            "linear" => Schedule::Linear,
            "cosine" => Schedule::Cosine,
            // "constant" and "constant_with_warmup" share the multiplier; the recipe check
            // refuses warmup_steps with "constant", which has none in transformers.
            _ => Schedule::Constant,
        }
    }

    /// The multiplier transformers' LambdaLR gives after `done` scheduler steps (so the lr of
    /// optimizer step i, 1-based, is `base * lambda(i - 1)`).
    pub fn lambda(self, done: usize, warmup: usize, total: usize) -> f64 {
        if done < warmup {
            return done as f64 / warmup.max(1) as f64;
        }
        match self {
            Schedule::Constant => 1.0,
            Schedule::Linear => (0f64).max((total as f64 - done as f64) / (total.saturating_sub(warmup)).max(1) as f64),
            Schedule::Cosine => {
                let progress = (done - warmup) as f64 / (total.saturating_sub(warmup)).max(1) as f64;
                // num_cycles = 0.5: half a cosine from 1 to 0.
                (0f64).max(0.5 * (1.0 + (std::f64::consts::PI * 2.0 * 0.5 * progress).cos()))
            }
        }
    }
}

/// Sum of squares of a gradient slice, in f64 (ranks add theirs to get the global norm).
pub fn sum_squares(g: &[f32]) -> f64 {
    g.iter().map(|&x| (x as f64) * (x as f64)).sum()
}

/// `clip_grad_norm_` given the global norm: scale by min(1, max_norm / (norm + 1e-6)).
pub fn clip_to(g: &mut [f32], norm: f64, max_norm: f64) {
    if max_norm > 0.0 {
        let coef = max_norm / (norm + 1e-6);
        if coef < 1.0 {
            let c = coef as f32;
            g.iter_mut().for_each(|x| *x *= c);
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_tensor_without_gradient_is_skipped_and_keeps_its_own_step_count() {
        // Element 1 has no gradient at step 1 (torch: grad None): untouched, even by weight
        // decay. At step 2 it takes its first update, with step-1 bias corrections, while
        // element 0 takes its second.
        let mut opt = AdamW::new(2, (0.9, 0.999), 1e-8, 0.1);
        let mut p = [1.0f32, 1.0];
        opt.step(&mut p, &[0.5, 0.0], Some(&[true, false]), 0.01);
        assert_eq!(p[1], 1.0);
        assert_eq!((opt.state.exp_avg[1], opt.state.exp_avg_sq[1], opt.state.steps[1]), (0.0, 0.0, 0.0));
        let before = p;
        opt.step(&mut p, &[0.5, 0.5], Some(&[true, true]), 0.01);
        assert_eq!(opt.state.steps, [2.0, 1.0]);
        // Element 1's first update equals a fresh optimizer's first update.
        let mut fresh = AdamW::new(1, (0.9, 0.999), 1e-8, 0.1);
        let mut q = [before[1]];
        fresh.step(&mut q, &[0.5], None, 0.01);
        assert_eq!(p[1], q[0]);
        assert_ne!(p[0], q[0]);
    }
    use super::*;

    #[test]
    fn warmup_then_cosine_matches_transformers() {
        // get_cosine_schedule_with_warmup(warmup=1, total=4): 0, 1, 0.75, 0.25 (parity fixture)
        let l: Vec<f64> = (0..4).map(|i| Schedule::Cosine.lambda(i, 1, 4)).collect();
        assert_eq!(l[0], 0.0);
        assert!((l[1] - 1.0).abs() < 1e-15 && (l[2] - 0.75).abs() < 1e-15 && (l[3] - 0.25).abs() < 1e-15, "{l:?}");
        let lin: Vec<f64> = (0..4).map(|i| Schedule::Linear.lambda(i, 0, 4)).collect();
        assert_eq!(lin, vec![1.0, 0.75, 0.5, 0.25]);
    }

    #[test]
    fn zero_lr_step_moves_moments_not_params() {
        let mut opt = AdamW::new(2, (0.9, 0.999), 1e-8, 0.01);
        let mut p = vec![1.0f32, -2.0];
        opt.step(&mut p, &[0.5, 0.5], None, 0.0);
        assert_eq!(p, vec![1.0, -2.0]);
        assert_eq!(opt.step, 1);
        assert!(opt.state.exp_avg[0] > 0.0);
    }

    #[test]
    fn first_adam_step_moves_each_param_by_lr() {
        // With bias correction the first update is lr * g / (|g| + eps') = ~lr * sign(g).
        let mut opt = AdamW::new(2, (0.9, 0.999), 1e-8, 0.0);
        let mut p = vec![0.0f32, 0.0];
        opt.step(&mut p, &[3.0, -0.1], None, 0.01);
        assert!((p[0] + 0.01).abs() < 1e-6 && (p[1] - 0.01).abs() < 1e-6, "{p:?}");
    }

    #[test]
    fn clipping_scales_to_max_norm() {
        let mut g = vec![3.0f32, 4.0];
        let n = sum_squares(&g).sqrt();
        clip_to(&mut g, n, 1.0);
        assert_eq!(n, 5.0);
        assert!((sum_squares(&g).sqrt() - 1.0).abs() < 1e-5);
    }
}
