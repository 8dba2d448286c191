//! DeepSeekMoE's routed experts as one op, when none of them is adapted: gather each expert's
//! tokens, run its frozen SwiGLU MLP over them, and sum the outputs weighted by the router.
//!
//! Dimensions: N tokens, H hidden, K experts per token, I an expert's intermediate size,
//! Ne the tokens routed to expert e. A (token, slot) "pair" t·K + s is token t's s-th choice.
//!
//! Why: built from candle ops (what the portable path and CUDA run, `Moe::routed_by_ops`), the
//! routed half of a layer is per expert an index_select, three matmuls and a SwiGLU, then a
//! cat, an index_select back to token order and a weighted sum over [N, K, H]: about six graph
//! nodes per expert (384 a layer for 64 experts), each with its own gradient buffers, and an
//! index_select whose backward copies the whole [N, H] gradient once per expert (256 MB a
//! layer at 1 x 512 on DeepSeek-V2-Lite's shapes). With frozen experts nothing in there is
//! trained, so one op with a hand-written backward does the same sums:
//!   y_p = down(silu(gate(x_t)) ⊙ up(x_t)) for each pair p = (t, s) routed to its expert,
//!   out_t = Σ_s w_ts y_p                         (f32, s in order, as the portable sum)
//!   dw_ts = Σ_h dy_th y_ph,   dx_t = Σ_s expert'(x_t)ᵀ (w_ts dy_t)
//! The gradient into x through the routing weights (the router's softmax/sigmoid) is candle's,
//! from dw. Compute stays sparse: an expert with no tokens runs nothing.
//!
//! Checkpointing: a checkpointed forward keeps nothing (its graph is dropped); the
//! recomputation keeps the SwiGLU inputs and the expert outputs for the backward, as the
//! separate ops' graph would.

use super::checkpoint::Pass;
use super::linear::frozen_gemm;
use super::mlp::{swiglu_rows, swiglu_rows_bwd};
use super::{cpu_f32, f32_elems, par_zeroed, zeros_f32, Kernels, Op, Path};
use candle_core::{Result, Tensor};
use std::sync::Mutex;

/// One routed expert's frozen weights: gate [I, H], up [I, H], down [H, I].
pub type ExpertWeights<'w> = [&'w Tensor; 3];

/// The routed experts' output [N, H] for x [N, H] (f32), routing weights `w` [N, K] (f32,
/// differentiable) and `chosen` (the N·K expert ids, token-major), as one op where the fused
/// kernels run; `None` on the portable path (the caller then builds it from the separate ops).
pub fn routed_experts(k: Kernels, x: &Tensor, w: &Tensor, chosen: &[u32], experts: &[ExpertWeights], pass: Pass) -> Result<Option<Tensor>> {
    let weights: Vec<&Tensor> = experts.iter().flatten().copied().collect();
    if x.rank() != 2 || k.pick(Op::RoutedExperts, x, &weights) == Path::Portable {
        return Ok(None);
    }
    let (n, h) = x.dims2()?;
    let slots = w.dims2()?.1;
    if w.dims() != [n, slots] || chosen.len() != n * slots || w.dtype() != x.dtype() {
        candle_core::bail!("routed-experts: x {:?}, weights {:?} {:?} and {} choices do not match", x.dims(), w.dims(), w.dtype(), chosen.len());
    }
    let mut groups = Vec::new();
    for (e, pairs) in pairs_by_expert(chosen, experts.len())?.into_iter().enumerate() {
        let [gate, up, down] = experts[e];
        let i = gate.dim(0)?;
        if gate.dims() != [i, h] || up.dims() != [i, h] || down.dims() != [h, i] {
            candle_core::bail!("routed-experts: expert {e}'s gate {:?}, up {:?}, down {:?} do not form an MLP on {h}", gate.dims(), up.dims(), down.dims());
        }
        if !pairs.is_empty() {
            groups.push(Group { pairs, gate: gate.contiguous()?, up: up.contiguous()?, down: down.contiguous()? });
        }
    }
    let op = RoutedExperts { groups, slots, keep: pass != Pass::Checkpointed, kept: Mutex::new(None) };
    Ok(Some(x.contiguous()?.apply_op2(&w.contiguous()?, op)?))
}

/// The (token, slot) pairs t·K + s of `chosen` (token-major expert ids) grouped by expert,
/// ascending within each of the `experts` groups.
pub fn pairs_by_expert(chosen: &[u32], experts: usize) -> Result<Vec<Vec<u32>>> {
    let mut by_expert: Vec<Vec<u32>> = vec![Vec::new(); experts];
    for (pair, &e) in chosen.iter().enumerate() {
        let Some(list) = by_expert.get_mut(e as usize) else {
            candle_core::bail!("routed-experts: expert {e} chosen of {experts}");
        };
        list.push(pair as u32);
    }
    Ok(by_expert)
}

/// One expert with tokens: its pairs (t·K + s, ascending) and frozen weights.
struct Group {
    pairs: Vec<u32>,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
}

struct RoutedExperts {
    groups: Vec<Group>,
    /// K: experts per token.
    slots: usize,
    /// Whether the forward keeps what the backward reads (not in a checkpointed forward).
    keep: bool,
    kept: Mutex<Option<Kept>>,
}

/// What the backward reads: each group's SwiGLU inputs g, u [Ne, I], and every pair's expert
/// output y [N·K, H] (for the routing weights' gradient).
struct Kept {
    swiglu: Vec<(Vec<f32>, Vec<f32>)>,
    y: Vec<f32>,
}

/// Rows `rows[r]` of x [_, H], gathered [rows.len(), H].
fn gather_rows(x: &[f32], h: usize, rows: impl Iterator<Item = usize>) -> Vec<f32> {
    let rows: Vec<usize> = rows.collect();
    par_zeroed(rows.len() * h, h.max(1), |r, dst: &mut [f32]| dst.copy_from_slice(&x[rows[r] * h..][..h]))
}

impl candle_core::CustomOp2 for RoutedExperts {
    fn name(&self) -> &'static str {
        "routed-experts"
    }

    fn cpu_fwd(&self, s1: &candle_core::CpuStorage, l1: &candle_core::Layout, s2: &candle_core::CpuStorage, l2: &candle_core::Layout) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (x, w) = (cpu_f32("routed-experts", s1, l1)?, cpu_f32("routed-experts", s2, l2)?);
        let (n, h) = l1.shape().dims2()?;
        let k = self.slots;
        let mut y = zeros_f32(n * k * h); // [N·K, H] by pair
        let mut swiglu = Vec::with_capacity(self.groups.len());
        for g in &self.groups {
            let ne = g.pairs.len();
            let xe = gather_rows(x, h, g.pairs.iter().map(|&p| p as usize / k)); // [Ne, H]
            let (gv, uv) = (frozen_gemm(&xe, ne, &g.gate, false)?, frozen_gemm(&xe, ne, &g.up, false)?); // [Ne, I] each
            let ye = frozen_gemm(&swiglu_rows(&gv, &uv), ne, &g.down, false)?; // [Ne, H]
            for (r, &p) in g.pairs.iter().enumerate() {
                y[p as usize * h..][..h].copy_from_slice(&ye[r * h..][..h]);
            }
            if self.keep {
                swiglu.push((gv, uv));
            }
        }
        // out_t = Σ_s w_ts y_(t,s): each product rounded, then summed from 0 in slot order.
        let out = par_zeroed(n * h, h.max(1), |t, row: &mut [f32]| {
            for s in 0..k {
                let ws = w[t * k + s];
                row.iter_mut().zip(&y[(t * k + s) * h..][..h]).for_each(|(o, &v)| *o += v * ws);
            }
        });
        if self.keep {
            *self.kept.lock().unwrap_or_else(|e| e.into_inner()) = Some(Kept { swiglu, y });
        }
        Ok((candle_core::CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (n, h) = x.dims2()?;
        let k = self.slots;
        let Some(kept) = self.kept.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            candle_core::bail!("routed-experts: backward without a kept forward");
        };
        let (wv, dyv) = (f32_elems(w)?, f32_elems(dy)?);
        // dw_ts = Σ_h dy_th y_(t,s)h
        let dw = par_zeroed(n * k, k.max(1), |t, row: &mut [f32]| {
            let d = &dyv[t * h..][..h];
            for (s, o) in row.iter_mut().enumerate() {
                *o = d.iter().zip(&kept.y[(t * k + s) * h..][..h]).map(|(&a, &b)| a * b).sum();
            }
        });
        drop(kept.y);
        let mut dx = zeros_f32(n * h);
        for (g, (gv, uv)) in self.groups.iter().zip(kept.swiglu) {
            let ne = g.pairs.len();
            // The expert's upstream gradient: w_ts dy_t for each of its pairs [Ne, H].
            let mut dye = gather_rows(&dyv, h, g.pairs.iter().map(|&p| p as usize / k));
            for (r, &p) in g.pairs.iter().enumerate() {
                let ws = wv[p as usize];
                dye[r * h..][..h].iter_mut().for_each(|v| *v *= ws);
            }
            let ds = frozen_gemm(&dye, ne, &g.down, true)?; // [Ne, I]
            let (dg, du) = swiglu_rows_bwd(&gv, &uv, &ds);
            let mut dxe = frozen_gemm(&dg, ne, &g.gate, true)?; // [Ne, H]
            super::add_into(&mut dxe, &frozen_gemm(&du, ne, &g.up, true)?);
            for (r, &p) in g.pairs.iter().enumerate() {
                let t = p as usize / k;
                dx[t * h..][..h].iter_mut().zip(&dxe[r * h..][..h]).for_each(|(o, &v)| *o += v);
            }
        }
        let dx = Tensor::from_vec(dx, x.shape(), x.device())?;
        let dw = Tensor::from_vec(dw, w.shape(), w.device())?;
        Ok((Some(dx), Some(dw)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{max_diff, pseudo};
    use crate::ops::{frozen_linear, swiglu};
    use candle_core::{DType, Device, Var};

    /// The separate ops `Moe::routed_by_ops` runs on the portable path: per expert an index_select,
    /// the MLP, then the weighted sum back in token order.
    fn separate(kern: Kernels, x: &Tensor, w: &Tensor, chosen: &[u32], experts: &[ExpertWeights]) -> Result<Tensor> {
        let (n, h) = x.dims2()?;
        let k = w.dim(1)?;
        let mut out = Tensor::zeros((n, h), DType::F32, x.device())?;
        for (p, &e) in chosen.iter().enumerate() {
            let (t, s) = (p / k, p % k);
            let [gate, up, down] = experts[e as usize];
            let xt = x.narrow(0, t, 1)?;
            let a = swiglu(kern, &frozen_linear(kern, &xt, gate)?, &frozen_linear(kern, &xt, up)?)?;
            let y = frozen_linear(kern, &a, down)?; // [1, H]
            let row = y.broadcast_mul(&w.narrow(0, t, 1)?.narrow(1, s, 1)?)?; // [1, H]
            out = out.slice_assign(&[t..t + 1, 0..h], &(out.narrow(0, t, 1)? + row)?)?;
        }
        Ok(out)
    }

    /// Value and the gradients of x and w, fused against the separate ops, for `dtype` weights.
    fn check(dtype: DType, pass: Pass) -> Result<(f32, f32, f32)> {
        let dev = Device::Cpu;
        let (n, h, i, e, k) = (13, 64, 32, 5, 2);
        // Expert 4 gets no token; expert 0 gets most.
        let chosen: Vec<u32> = (0..n * k).map(|p| [0, 1, 0, 2, 3, 0][p % 6]).collect();
        let ws: Vec<[Tensor; 3]> = (0..e)
            .map(|j| {
                let m = |r, c, seed| Tensor::from_vec(pseudo(r * c, seed), (r, c), &dev)?.affine(0.2, 0.0)?.to_dtype(dtype);
                Ok([m(i, h, 10 + 3 * j)?, m(i, h, 11 + 3 * j)?, m(h, i, 12 + 3 * j)?])
            })
            .collect::<Result<_>>()?;
        let experts: Vec<ExpertWeights> = ws.iter().map(|[a, b, c]| [a, b, c]).collect();
        let x = Var::from_vec(pseudo(n * h, 1), (n, h), &dev)?;
        let w = Var::from_vec(pseudo(n * k, 2), (n, k), &dev)?;
        let fused = routed_experts(Kernels::Auto, &x, &w, &chosen, &experts, pass)?.expect("the fused path on CPU f32");
        let reference = separate(Kernels::Auto, &x, &w, &chosen, &experts)?;
        let g = Tensor::from_vec(pseudo(n * h, 3), (n, h), &dev)?;
        let gf = (fused.clone() * &g)?.sum_all()?.backward()?;
        let gr = (reference.clone() * &g)?.sum_all()?.backward()?;
        // Max differences relative to the reference's largest magnitude (the two sum in
        // different orders: an expert's rows together here, one row at a time there).
        let rel = |a: &Tensor, b: &Tensor| -> Result<f32> { Ok(max_diff(a, b)? / b.abs()?.max_all()?.to_scalar::<f32>()?) };
        let d = |v: &Tensor| rel(gf.get(v).expect("grad"), gr.get(v).expect("grad"));
        Ok((rel(&fused, &reference)?, d(&x)?, d(&w)?))
    }

    #[test]
    fn routed_experts_equal_the_separate_ops_in_value_and_both_gradients() -> Result<()> {
        for dtype in [DType::F32, DType::BF16] {
            let (dv, dx, dw) = check(dtype, Pass::Plain)?;
            println!("routed experts {dtype:?}: value {dv:.1e}, grad x {dx:.1e}, grad w {dw:.1e}");
            // Zen 5: f32 3.6e-7, 1.6e-7, 3.5e-7; bf16 (the same dot kernel both ways) 0, 0, 1.6e-7.
            assert!(dv < 1e-6 && dx < 1e-6 && dw < 1e-6, "{dtype:?}: value {dv:e}, grad x {dx:e}, grad w {dw:e}");
        }
        Ok(())
    }

    #[test]
    fn a_checkpointed_forward_keeps_nothing_for_backward() -> Result<()> {
        let err = check(DType::F32, Pass::Checkpointed).unwrap_err().to_string();
        assert!(err.contains("without a kept forward"), "{err}");
        let (dv, dx, dw) = check(DType::F32, Pass::Recompute)?;
        assert!(dv < 1e-6 && dx < 1e-6 && dw < 1e-6);
        Ok(())
    }

    #[test]
    fn an_expert_id_past_the_experts_is_an_error() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::zeros((2, 8), DType::F32, &dev)?;
        let w = Tensor::zeros((2, 1), DType::F32, &dev)?;
        let m = Tensor::zeros((4, 8), DType::F32, &dev)?;
        let d = Tensor::zeros((8, 4), DType::F32, &dev)?;
        let err = routed_experts(Kernels::Auto, &x, &w, &[0, 1], &[[&m, &m, &d]], Pass::Plain).unwrap_err().to_string();
        assert!(err.contains("expert 1 chosen of 1"), "{err}");
        Ok(())
    }
}
