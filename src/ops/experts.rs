//! DeepSeekMoE's routed experts (and its shared experts, when frozen) as one op, when none of
//! the routed experts is adapted: gather each expert's tokens, run its frozen SwiGLU MLP over
//! them, sum the outputs weighted by the router, and add the shared experts' MLP of every token.
//!
//! Dimensions: N tokens, H hidden, K experts per token, I an expert's intermediate size,
//! Ne the tokens routed to expert e, Is the shared experts' intermediate size. A (token,
//! slot) "pair" t·K + s is token t's s-th choice.
//!
//! Why: built from candle ops (what the portable path and CUDA run, `Moe::routed_by_ops`), the
//! routed half of a layer is per expert an index_select, three matmuls and a SwiGLU, then a
//! cat, an index_select back to token order and a weighted sum over [N, K, H]: about six graph
//! nodes per expert (384 a layer for 64 experts), each with its own gradient buffers, and an
//! index_select whose backward copies the whole [N, H] gradient once per expert (256 MB a
//! layer at 1 x 512 on DeepSeek-V2-Lite's shapes). With frozen experts nothing in there is
//! trained, so one op with a hand-written backward does the same sums:
//!   s_p = silu(gate(x_t)) ⊙ up(x_t),  y_p = down(s_p)   for each pair p = (t, s) routed
//!   out_t = Σ_s w_ts y_p (+ shared(x_t))                   (f32, s in order, as the portable sum)
//!   ds'_p = down'(dy_t),  dw_ts = Σ_i ds'_pi s_pi,  dx_t = Σ_s (gate, up)'(x_t)ᵀ swiglu'(w_ts ds'_p)
//! dw is Σ_h dy_th y_ph summed over the intermediate dimension instead (y = down(s), so
//! dy·y = down'(dy)·s): the backward then needs the SwiGLU inputs only, not the [N·K, H]
//! expert outputs (25 MB a layer at 1 x 512 on V2-Lite's shapes), and reads nothing the
//! gradient GEMMs do not compute anyway. The gradient into x through the routing weights (the
//! router's softmax/sigmoid) is candle's, from dw. Compute stays sparse: an expert with no
//! tokens runs nothing.
//!
//! Threads: the routed experts are parallel tasks, one expert each, and the shared experts'
//! MLP (every token) runs across all threads after them. An expert's outputs (and in the
//! backward its rows of dx) are kept until all have run and then summed per token in one
//! fixed order (slot order for the output, the experts by id and then the shared experts for
//! dx), so the bits do not depend on which thread ran which expert or when it finished.
//!
//! Checkpointing (`ops::checkpoint`): a checkpointed forward keeps nothing, or, where the
//! layer keeps its SwiGLU inputs, leaves every expert's g and u in the layer's slot; the
//! recomputation then runs no GEMM at all (its value is never read: it returns zeros), else
//! only the gate and up GEMMs.

use super::checkpoint::{Keep, Pass, SwiGluInputs};
use super::linear::frozen_gemm;
use super::mlp::{swiglu_rows, swiglu_rows_bwd};
use super::{cpu_f32, f32_elems, par_zeroed, zeros_f32, Kernels, Op, Path};
use candle_core::{Result, Tensor};
use std::sync::Mutex;

/// One expert's frozen weights (routed or shared): gate [I, H], up [I, H], down [H, I].
pub type ExpertWeights<'w> = [&'w Tensor; 3];

/// The routed experts' output [N, H] for x [N, H] (f32), routing weights `w` [N, K] (f32,
/// differentiable) and `chosen` (the N·K expert ids, token-major), plus the shared experts'
/// MLP of x where `shared` is given, as one op where the fused kernels run; `None` on the
/// portable path (the caller then builds it from the separate ops). `keep`: activation
/// checkpointing's pass and the layer's slot.
pub fn routed_experts(k: Kernels, x: &Tensor, w: &Tensor, chosen: &[u32], experts: &[ExpertWeights], shared: Option<ExpertWeights>, keep: Keep) -> Result<Option<Tensor>> {
    let mut weights: Vec<&Tensor> = experts.iter().flatten().copied().collect();
    weights.extend(shared.iter().flatten().copied());
    if x.rank() != 2 || k.pick(Op::RoutedExperts, x, &weights) == Path::Portable {
        return Ok(None);
    }
    let (n, h) = x.dims2()?;
    let slots = w.dims2()?.1;
    if w.dims() != [n, slots] || chosen.len() != n * slots || w.dtype() != x.dtype() {
        candle_core::bail!("routed-experts: x {:?}, weights {:?} {:?} and {} choices do not match", x.dims(), w.dims(), w.dtype(), chosen.len());
    }
    let mlp = |what: &str, [gate, up, down]: ExpertWeights, rows: Vec<u32>, shared: bool| -> Result<Group> {
        let i = gate.dim(0)?;
        if gate.dims() != [i, h] || up.dims() != [i, h] || down.dims() != [h, i] {
            candle_core::bail!("routed-experts: {what}'s gate {:?}, up {:?}, down {:?} do not form an MLP on {h}", gate.dims(), up.dims(), down.dims());
        }
        Ok(Group { rows, shared, inter: i, gate: gate.contiguous()?, up: up.contiguous()?, down: down.contiguous()? })
    };
    let mut groups = Vec::new();
    for (e, pairs) in pairs_by_expert(chosen, experts.len())?.into_iter().enumerate() {
        let group = mlp(&format!("expert {e}"), experts[e], pairs, false)?;
        if !group.rows.is_empty() {
            groups.push(group);
        }
    }
    let shared = shared.map(|m| mlp("the shared experts", m, (0..n as u32).collect(), true)).transpose()?;
    let op = RoutedExperts { groups, shared, slots, keep, kept: Mutex::new(None) };
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

/// One MLP and the rows it runs on: a routed expert with tokens (its pairs t·K + s,
/// ascending), or the shared experts (every token t).
struct Group {
    rows: Vec<u32>,
    /// The shared experts: rows are tokens, and no routing weight scales them.
    shared: bool,
    /// I: the intermediate size.
    inter: usize,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
}

struct RoutedExperts {
    groups: Vec<Group>,
    shared: Option<Group>,
    /// K: experts per token.
    slots: usize,
    /// The checkpointing pass, and where a checkpointed forward leaves the SwiGLU inputs.
    keep: Keep,
    /// Every group's SwiGLU inputs g, u [Ne, I] one after the other (the routed experts in
    /// order, then the shared experts), from the forward for the backward.
    kept: Mutex<Option<SwiGluInputs>>,
}

/// x·gateᵀ and x·upᵀ [Ne, I] for x [Ne, H]: bf16 weights on the bf16 unit over few rows in
/// one pass over both, on x packed once (`bf16_gemm::gemm_wt_shared`); else two frozen GEMMs.
/// The same bits either way.
fn gate_and_up(x: &[f32], ne: usize, gr: &Group) -> Result<(Vec<f32>, Vec<f32>)> {
    use candle_core::DType;
    if gr.gate.dtype() == DType::BF16 && gr.up.dtype() == DType::BF16 && super::bf16_gemm::available() {
        let (i, h) = gr.gate.dims2()?;
        let both = super::bf16_gemm::with_weight_bits(&gr.gate, |g, _, _| super::bf16_gemm::with_weight_bits(&gr.up, |u, _, _| super::bf16_gemm::gemm_wt_shared(x, ne, &[g, u], i, h)))??;
        if let Some(mut c) = both {
            let u = c.pop().expect("two outputs");
            let g = c.pop().expect("two outputs");
            return Ok((g, u));
        }
    }
    Ok((frozen_gemm(x, ne, &gr.gate, false)?, frozen_gemm(x, ne, &gr.up, false)?))
}

/// Rows `rows[r]` of x [_, H], gathered [rows.len(), H].
fn gather_rows(x: &[f32], h: usize, rows: impl Iterator<Item = usize>) -> Vec<f32> {
    let rows: Vec<usize> = rows.collect();
    par_zeroed(rows.len() * h, h.max(1), |r, dst: &mut [f32]| dst.copy_from_slice(&x[rows[r] * h..][..h]))
}

impl RoutedExperts {
    /// The token of each of a group's rows (a routed group's rows are pairs t·K + s, the
    /// shared experts' are tokens).
    fn tokens(&self, g: &Group) -> Vec<usize> {
        let k = if g.shared { 1 } else { self.slots };
        g.rows.iter().map(|&p| p as usize / k).collect()
    }

    /// Per pair t·K + s: (its routed group, its row in that group).
    fn pair_rows(&self, n: usize) -> Vec<(u32, u32)> {
        let mut at = vec![(0, 0); n * self.slots];
        for (gi, g) in self.groups.iter().enumerate() {
            for (r, &p) in g.rows.iter().enumerate() {
                at[p as usize] = (gi as u32, r as u32);
            }
        }
        at
    }

    /// Ne·I of each group in the order the kept g (and u) hold them: the routed groups, then
    /// the shared experts.
    fn kept_lens(&self) -> impl Iterator<Item = usize> + '_ {
        self.groups.iter().chain(&self.shared).map(|g| g.rows.len() * g.inter)
    }

    /// Σ Ne·I over the groups: the length of the kept g (and of u).
    fn kept_len(&self) -> usize {
        self.kept_lens().sum()
    }
}

/// One group's forward over its rows' `tokens` of x [N, H]: (g, u) [Ne, I] and, `with_output`,
/// down(silu(g) ⊙ u) [Ne, H] (else empty).
fn group_forward(x: &[f32], h: usize, gr: &Group, tokens: &[usize], with_output: bool) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let ne = tokens.len();
    let xe = gather_rows(x, h, tokens.iter().copied()); // [Ne, H]
    let (gv, uv) = gate_and_up(&xe, ne, gr)?; // [Ne, I] each
    let ye = if with_output { frozen_gemm(&swiglu_rows(&gv, &uv), ne, &gr.down, false)? } else { Vec::new() }; // [Ne, H]
    Ok((gv, uv, ye))
}

/// One group's backward for dy [N, H] and its kept g, u [Ne, I]: (dx of its rows [Ne, H], and
/// for a routed group dw of its pairs [Ne], whose routing weights `w` [N·K] scale ds').
fn group_backward(dy: &[f32], w: &[f32], h: usize, gr: &Group, tokens: &[usize], (gv, uv): (&[f32], &[f32])) -> Result<(Vec<f32>, Vec<f32>)> {
    let (ne, i) = (tokens.len(), gr.inter);
    let dye = gather_rows(dy, h, tokens.iter().copied()); // [Ne, H]: dy of each row's token
    let mut ds = frozen_gemm(&dye, ne, &gr.down, true)?; // [Ne, I]: ds' = down'(dy)
    let mut dots = Vec::new();
    if !gr.shared {
        // dw_p = ds'_p · s_p, then the expert's gradient is w_p ds'_p.
        use rayon::prelude::*;
        let s = swiglu_rows(gv, uv);
        dots = ds
            .par_chunks_mut(i)
            .zip(s.par_chunks(i))
            .zip(gr.rows.par_iter())
            .map(|((d, sr), &p)| {
                let dot = super::dot_f32(d, sr);
                let ws = w[p as usize];
                d.iter_mut().for_each(|v| *v *= ws);
                dot
            })
            .collect();
    }
    let (dg, du) = swiglu_rows_bwd(gv, uv, &ds);
    let mut dxe = frozen_gemm(&dg, ne, &gr.gate, true)?; // [Ne, H]
    super::add_into(&mut dxe, &frozen_gemm(&du, ne, &gr.up, true)?);
    Ok((dxe, dots))
}

/// `buf`'s spare capacity cut into consecutive parts of `lens`, for parallel tasks to fill.
fn parts_of(buf: &mut Vec<f32>, lens: impl Iterator<Item = usize>) -> Vec<&mut [std::mem::MaybeUninit<f32>]> {
    let mut rest = buf.spare_capacity_mut();
    let mut parts = Vec::new();
    for len in lens {
        let (part, r) = std::mem::take(&mut rest).split_at_mut(len);
        parts.push(part);
        rest = r;
    }
    parts
}

/// Writes `src` into `dst` (the same length); `write_copy_of_slice` is newer than the MSRV.
fn fill(dst: &mut [std::mem::MaybeUninit<f32>], src: &[f32]) {
    for (d, &v) in dst.iter_mut().zip(src) {
        d.write(v);
    }
}

impl candle_core::CustomOp2 for RoutedExperts {
    fn name(&self) -> &'static str {
        "routed-experts"
    }

    /// The routed experts run as parallel tasks, one expert each (its GEMMs' own tasks run on
    /// the same thread unless the other one is idle and takes them), the shared experts' MLP
    /// over every token across all threads. Why: split across both threads, an expert's ~48
    /// rows made each GEMM, gather and SwiGLU a parallel pass of its own, about ten a routed
    /// expert, each with a hand-off, a last-task wait, and serial parts (rounding A, copies)
    /// while the other thread slept.
    fn cpu_fwd(&self, s1: &candle_core::CpuStorage, l1: &candle_core::Layout, s2: &candle_core::CpuStorage, l2: &candle_core::Layout) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use rayon::prelude::*;
        let (x, w) = (cpu_f32("routed-experts", s1, l1)?, cpu_f32("routed-experts", s2, l2)?);
        let (n, h) = l1.shape().dims2()?;
        let k = self.slots;
        let recompute = self.keep.pass == Pass::Recompute;
        let from_forward = match (self.keep.pass, &self.keep.slot) {
            (Pass::Recompute, Some(slot)) => slot.take_swiglu().filter(|(g, u)| g.len() == self.kept_len() && u.len() == g.len()),
            _ => None,
        };
        if let Some(gu) = from_forward {
            // The checkpointed forward's g and u: nothing to run, and the value is never read.
            *self.kept.lock().unwrap_or_else(|e| e.into_inner()) = Some(gu);
            return Ok((candle_core::CpuStorage::F32(zeros_f32(n * h)), l1.shape().clone()));
        }
        // Every group's g and u go straight into their place in the kept ones (the routed
        // groups in order, then the shared experts).
        let len = self.kept_len();
        let (mut g_all, mut u_all) = (Vec::with_capacity(len), Vec::with_capacity(len));
        let (mut g_parts, mut u_parts) = (parts_of(&mut g_all, self.kept_lens()), parts_of(&mut u_all, self.kept_lens()));
        let shared_gu = self.shared.as_ref().and_then(|_| Some((g_parts.pop()?, u_parts.pop()?)));
        let tokens: Vec<Vec<usize>> = self.groups.iter().map(|g| self.tokens(g)).collect();
        let routed: Vec<Vec<f32>> = (self.groups.par_iter().zip(&tokens), g_parts.into_par_iter().zip(u_parts))
            .into_par_iter()
            .map(|((gr, t), (gd, ud))| {
                let (gv, uv, ye) = group_forward(x, h, gr, t, !recompute)?;
                fill(gd, &gv);
                fill(ud, &uv);
                Ok(ye)
            })
            .collect::<Result<_>>()?;
        let shared = match (&self.shared, shared_gu) {
            (Some(gr), Some((gd, ud))) => {
                let (gv, uv, ye) = group_forward(x, h, gr, &self.tokens(gr), !recompute)?;
                fill(gd, &gv);
                fill(ud, &uv);
                Some(ye)
            }
            _ => None,
        };
        // SAFETY: the parts cover 0..len of both, and each group's task filled its own.
        unsafe {
            g_all.set_len(len);
            u_all.set_len(len);
        }
        // out_t = Σ_s w_ts y_(t,s): each product rounded, then summed from 0 in slot order;
        // then the shared experts' output added, as `routed + shared` in separate ops.
        let out = if recompute {
            zeros_f32(n * h) // the recomputation's value is never read
        } else {
            let at = self.pair_rows(n);
            par_zeroed(n * h, h.max(1), |t, row: &mut [f32]| {
                for s in 0..k {
                    let (ws, (gi, r)) = (w[t * k + s], at[t * k + s]);
                    row.iter_mut().zip(&routed[gi as usize][r as usize * h..][..h]).for_each(|(o, &v)| *o += v * ws);
                }
                if let Some(ys) = &shared {
                    row.iter_mut().zip(&ys[t * h..][..h]).for_each(|(o, &v)| *o += v);
                }
            })
        };
        match (self.keep.pass, &self.keep.slot) {
            (Pass::Checkpointed, Some(slot)) => slot.put_swiglu((g_all, u_all)),
            (Pass::Checkpointed, None) => {}
            _ => *self.kept.lock().unwrap_or_else(|e| e.into_inner()) = Some((g_all, u_all)),
        }
        Ok((candle_core::CpuStorage::F32(out), l1.shape().clone()))
    }

    /// As the forward: one task per routed expert, the shared experts across all threads; each
    /// token's dx then summed in the order the groups come (the routed experts by id, then the
    /// shared experts), whichever thread ran them.
    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        use rayon::prelude::*;
        let (n, h) = x.dims2()?;
        let k = self.slots;
        let Some((g_all, u_all)) = self.kept.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            candle_core::bail!("routed-experts: backward without a kept forward");
        };
        let (wv, dyv) = (f32_elems(w)?, f32_elems(dy)?);
        let (wv, dyv): (&[f32], &[f32]) = (&wv, &dyv);
        // Each group's g and u in the kept ones: the routed groups in order, then the shared.
        let mut spans = Vec::new();
        let mut at = 0;
        for len in self.kept_lens() {
            spans.push((&g_all[at..][..len], &u_all[at..][..len]));
            at += len;
        }
        let tokens: Vec<Vec<usize>> = self.groups.iter().map(|g| self.tokens(g)).collect();
        let routed: Vec<(Vec<f32>, Vec<f32>)> = self.groups.par_iter().zip(&tokens).zip(&spans).map(|((gr, t), &gu)| group_backward(dyv, wv, h, gr, t, gu)).collect::<Result<_>>()?;
        let shared = self.shared.as_ref().map(|gr| group_backward(dyv, wv, h, gr, &self.tokens(gr), spans[self.groups.len()])).transpose()?;
        let mut dw = zeros_f32(n * k);
        for (gr, (_, dots)) in self.groups.iter().zip(&routed) {
            for (&p, &dot) in gr.rows.iter().zip(dots) {
                dw[p as usize] = dot;
            }
        }
        let pairs = self.pair_rows(n);
        let dx = par_zeroed(n * h, h.max(1), |t, row: &mut [f32]| {
            let mut mine: Vec<(u32, u32)> = pairs[t * k..][..k].to_vec();
            mine.sort_unstable();
            for (gi, r) in mine {
                row.iter_mut().zip(&routed[gi as usize].0[r as usize * h..][..h]).for_each(|(o, &v)| *o += v);
            }
            if let Some((dxs, _)) = &shared {
                row.iter_mut().zip(&dxs[t * h..][..h]).for_each(|(o, &v)| *o += v);
            }
        });
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
        let mut out = Tensor::zeros((n, h), x.dtype(), x.device())?;
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

    /// The shared experts' MLP of every token from separate ops [N, H].
    fn shared_mlp(kern: Kernels, x: &Tensor, [gate, up, down]: ExpertWeights) -> Result<Tensor> {
        frozen_linear(kern, &swiglu(kern, &frozen_linear(kern, x, gate)?, &frozen_linear(kern, x, up)?)?, down)
    }

    /// A small MoE: 13 tokens, 5 experts of which 4 gets no token and 0 most, top 2, and
    /// shared experts of another intermediate size.
    struct Case {
        x: Var,
        w: Var,
        chosen: Vec<u32>,
        experts: Vec<[Tensor; 3]>,
        shared: [Tensor; 3],
    }

    impl Case {
        fn new(dtype: DType) -> Result<Self> {
            let dev = Device::Cpu;
            let (n, h, i, e, k) = (13, 64, 32, 5, 2);
            let chosen: Vec<u32> = (0..n * k).map(|p| [0, 1, 0, 2, 3, 0][p % 6]).collect();
            let m = |r, c, seed| Tensor::from_vec(pseudo(r * c, seed), (r, c), &dev)?.affine(0.2, 0.0)?.to_dtype(dtype);
            let experts = (0..e).map(|j| Ok([m(i, h, 10 + 3 * j)?, m(i, h, 11 + 3 * j)?, m(h, i, 12 + 3 * j)?])).collect::<Result<_>>()?;
            let shared = [m(48, h, 7)?, m(48, h, 8)?, m(h, 48, 9)?];
            Ok(Case { x: Var::from_vec(pseudo(n * h, 1), (n, h), &dev)?, w: Var::from_vec(pseudo(n * k, 2), (n, k), &dev)?, chosen, experts, shared })
        }

        fn experts(&self) -> Vec<ExpertWeights<'_>> {
            self.experts.iter().map(|[a, b, c]| [a, b, c]).collect()
        }

        fn shared(&self) -> ExpertWeights<'_> {
            let [a, b, c] = &self.shared;
            [a, b, c]
        }

        /// The fused op's value and the gradients of x and w for an upstream gradient.
        fn fused(&self, with_shared: bool, keep: Keep) -> Result<(Tensor, Tensor, Tensor)> {
            let y = routed_experts(Kernels::Auto, &self.x, &self.w, &self.chosen, &self.experts(), with_shared.then(|| self.shared()), keep)?;
            self.grads(y.expect("the fused path on the CPU"))
        }

        /// The same from the separate ops.
        fn separate(&self, with_shared: bool) -> Result<(Tensor, Tensor, Tensor)> {
            let mut y = separate(Kernels::Auto, &self.x, &self.w, &self.chosen, &self.experts())?;
            if with_shared {
                y = (y + shared_mlp(Kernels::Auto, &self.x, self.shared())?)?;
            }
            self.grads(y)
        }

        fn grads(&self, y: Tensor) -> Result<(Tensor, Tensor, Tensor)> {
            grads_of(y, &self.x, &self.w)
        }
    }

    /// y, and the gradients of x and w for a fixed upstream gradient of y's dtype.
    fn grads_of(y: Tensor, x: &Var, w: &Var) -> Result<(Tensor, Tensor, Tensor)> {
        let g = Tensor::from_vec(pseudo(y.elem_count(), 3), y.shape(), y.device())?.to_dtype(y.dtype())?;
        let store = (y.clone() * &g)?.sum_all()?.backward()?;
        let get = |v: &Var| store.get(v).cloned().ok_or_else(|| candle_core::Error::Msg("no gradient".into()));
        Ok((y, get(x)?, get(w)?))
    }

    /// Max difference relative to the reference's largest magnitude (the two sum in different
    /// orders: an expert's rows together in the op, one row at a time in the separate ops).
    fn rel(a: &Tensor, b: &Tensor) -> Result<f32> {
        Ok(max_diff(a, b)? / b.abs()?.max_all()?.to_scalar::<f32>()?)
    }

    /// The separate ops' value and gradients in f64 on the same (bf16- or f32-valued) weights:
    /// the exact sums both paths round.
    fn exact(case: &Case, with_shared: bool) -> Result<(Tensor, Tensor, Tensor)> {
        let f64s = |t: &Tensor| t.to_dtype(DType::F64);
        let experts64: Vec<[Tensor; 3]> = case.experts.iter().map(|m| Ok([f64s(&m[0])?, f64s(&m[1])?, f64s(&m[2])?])).collect::<Result<_>>()?;
        let shared64 = [f64s(&case.shared[0])?, f64s(&case.shared[1])?, f64s(&case.shared[2])?];
        let (x, w) = (Var::from_tensor(&f64s(&case.x)?)?, Var::from_tensor(&f64s(&case.w)?)?);
        let ex: Vec<ExpertWeights> = experts64.iter().map(|[a, b, c]| [a, b, c]).collect();
        let mut y = separate(Kernels::Portable, &x, &w, &case.chosen, &ex)?;
        if with_shared {
            y = (y + shared_mlp(Kernels::Portable, &x, [&shared64[0], &shared64[1], &shared64[2]])?)?;
        }
        let (y, gx, gw) = grads_of(y, &x, &w)?;
        let f32s = |t: Tensor| t.to_dtype(DType::F32);
        Ok((f32s(y)?, f32s(gx)?, f32s(gw)?))
    }

    #[test]
    fn routed_experts_equal_the_separate_ops_in_value_and_both_gradients() -> Result<()> {
        for dtype in [DType::F32, DType::BF16] {
            for with_shared in [false, true] {
                let case = Case::new(dtype)?;
                let (fy, fx, fw) = case.fused(with_shared, Keep::plain())?;
                let (ry, rx, rw) = case.separate(with_shared)?;
                let (dv, dx, dw) = (rel(&fy, &ry)?, rel(&fx, &rx)?, rel(&fw, &rw)?);
                println!("routed experts {dtype:?}, shared {with_shared}: value {dv:.1e}, grad x {dx:.1e}, grad w {dw:.1e}");
                if dtype == DType::F32 {
                    // Zen 5: at most 3.6e-7, 4.3e-7, 3.9e-7.
                    assert!(dv < 1e-6 && dx < 1e-6 && dw < 1e-6, "shared {with_shared}: value {dv:e}, grad x {dx:e}, grad w {dw:e}");
                    continue;
                }
                // bf16 weights: where a bf16 unit runs the GEMMs their operands are rounded to
                // bf16, and the op rounds down'(dy) where the separate ops round w·dy (and s
                // for dw): as far from the exact sums as they are, not the same bits.
                let (ey, ex, ew) = exact(&case, with_shared)?;
                let (fx_err, rx_err, fw_err, rw_err) = (rel(&fx, &ex)?, rel(&rx, &ex)?, rel(&fw, &ew)?, rel(&rw, &ew)?);
                println!("  against f64: value {:.1e} / {:.1e}, grad x {fx_err:.1e} / {rx_err:.1e}, grad w {fw_err:.1e} / {rw_err:.1e} (op / separate)", rel(&fy, &ey)?, rel(&ry, &ey)?);
                assert!(dv < 1e-6, "shared {with_shared}: value {dv:e}");
                assert!(fx_err <= 1.1 * rx_err + 1e-6 && fw_err <= 1.1 * rw_err + 1e-6, "shared {with_shared}: grad x {fx_err:e} against {rx_err:e}, grad w {fw_err:e} against {rw_err:e}");
            }
        }
        Ok(())
    }

    #[test]
    fn a_checkpointed_forward_keeps_nothing_for_backward_unless_its_slot_keeps_the_swiglu_inputs() -> Result<()> {
        let case = Case::new(DType::F32)?;
        let checkpointed = Keep { pass: Pass::Checkpointed, slot: None };
        let err = case.fused(true, checkpointed).unwrap_err().to_string();
        assert!(err.contains("without a kept forward"), "{err}");
        let (_, px, pw) = case.fused(true, Keep::plain())?;
        // Recomputed without a slot: the gate and up GEMMs run again, the same gradients.
        let (ry, rx, rw) = case.fused(true, Keep { pass: Pass::Recompute, slot: None })?;
        assert_eq!((max_diff(&rx, &px)?, max_diff(&rw, &pw)?), (0.0, 0.0));
        assert_eq!(ry.abs()?.max_all()?.to_scalar::<f32>()?, 0.0, "the recomputation's value is a placeholder");
        // With the SwiGLU inputs kept: the checkpointed forward's value is the plain one's, and
        // the recomputation takes g and u from the slot (it is empty after) for the same bits.
        let kept = crate::ops::checkpoint::Kept::new(&[crate::ops::checkpoint::KeepLayer { swiglu: true, ..Default::default() }]);
        let checkpointed = Keep { pass: Pass::Checkpointed, slot: kept.slot(0) };
        let cy = routed_experts(Kernels::Auto, &case.x, &case.w, &case.chosen, &case.experts(), Some(case.shared()), checkpointed)?.expect("fused");
        assert_eq!(max_diff(&cy, &case.fused(true, Keep::plain())?.0)?, 0.0);
        assert!(kept.bytes() > 0, "g and u are in the slot");
        let (_, kx, kw) = case.fused(true, Keep { pass: Pass::Recompute, slot: kept.slot(0) })?;
        assert_eq!(kept.bytes(), 0, "taken by the recomputation");
        assert_eq!((max_diff(&kx, &px)?, max_diff(&kw, &pw)?), (0.0, 0.0));
        Ok(())
    }

    /// The routed experts run as parallel tasks and each token's dx is summed in the groups'
    /// order after them, so the value and both gradients are the same bits on one thread as
    /// on four, where the experts finish in a different order each time.
    #[test]
    fn routed_experts_give_the_same_bits_on_one_thread_and_on_four() -> Result<()> {
        let dev = Device::Cpu;
        let (n, h, i, e, k) = (96, 64, 32, 24, 4);
        for dtype in [DType::F32, DType::BF16] {
            let m = |r: usize, c: usize, seed: usize| Tensor::from_vec(pseudo(r * c, seed), (r, c), &dev)?.affine(0.2, 0.0)?.to_dtype(dtype);
            let experts: Vec<[Tensor; 3]> = (0..e).map(|j| Ok([m(i, h, 10 + 3 * j)?, m(i, h, 11 + 3 * j)?, m(h, i, 12 + 3 * j)?])).collect::<Result<_>>()?;
            let shared = [m(48, h, 7)?, m(48, h, 8)?, m(h, 48, 9)?];
            let ex: Vec<ExpertWeights> = experts.iter().map(|[a, b, c]| [a, b, c]).collect();
            // Uneven loads, and each token's experts not in ascending order.
            let chosen: Vec<u32> = (0..n).flat_map(|t| (0..k).map(move |s| ((t * 7 + (t * t) % 5 + s * (2 * (t % 3) + 5)) % e) as u32)).collect();
            let run = |threads: usize| -> Result<Vec<Vec<u32>>> {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().map_err(candle_core::Error::wrap)?;
                pool.install(|| {
                    let x = Var::from_vec(pseudo(n * h, 1), (n, h), &dev)?;
                    let w = Var::from_vec(pseudo(n * k, 2), (n, k), &dev)?;
                    let y = routed_experts(Kernels::Auto, &x, &w, &chosen, &ex, Some([&shared[0], &shared[1], &shared[2]]), Keep::plain())?.expect("fused");
                    let (y, gx, gw) = grads_of(y, &x, &w)?;
                    [y, gx, gw].iter().map(|t| Ok(t.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())).collect()
                })
            };
            let one = run(1)?;
            for _ in 0..3 {
                let four = run(4)?;
                for (what, (a, b)) in ["value", "grad x", "grad w"].iter().zip(one.iter().zip(&four)) {
                    let differ = a.iter().zip(b).filter(|(a, b)| a != b).count();
                    assert_eq!(differ, 0, "{dtype:?}: {what} differs in {differ} of {} elements", a.len());
                }
            }
        }
        Ok(())
    }

    /// `cargo test --release --lib routed_experts_speed -- --ignored --nocapture`: the op's
    /// forward and backward on DeepSeek-V2-Lite's MoE layer (64 experts of 1408 on 2048, top
    /// 6, 2 shared) over 512 tokens with bf16 weights, GFLOP/s of the routed and shared
    /// GEMMs (a look, not a test).
    #[test]
    #[ignore]
    fn routed_experts_speed() -> Result<()> {
        crate::alloc::tune();
        let dev = Device::Cpu;
        let (n, h, i, e, k) = (512, 2048, 1408, 64, 6);
        let m = |r: usize, c: usize, seed: usize| Tensor::from_vec(pseudo(r * c, seed), (r, c), &dev)?.affine(0.05, 0.0)?.to_dtype(DType::BF16);
        let experts: Vec<[Tensor; 3]> = (0..e).map(|j| Ok([m(i, h, 10 + 3 * j)?, m(i, h, 11 + 3 * j)?, m(h, i, 12 + 3 * j)?])).collect::<Result<_>>()?;
        let shared = [m(2 * i, h, 7)?, m(2 * i, h, 8)?, m(h, 2 * i, 9)?];
        // Each token's k distinct experts (an odd stride is coprime with 64), unevenly spread
        // as a router's are: 48 rows an expert on average.
        let chosen: Vec<u32> = (0..n).flat_map(|t| (0..k).map(move |s| ((t * 7 + (t * t) % 11 + s * (2 * (t % 5) + 1)) % e) as u32)).collect();
        let rows: Vec<usize> = (0..e as u32).map(|j| chosen.iter().filter(|&&c| c == j).count()).collect();
        let ex: Vec<ExpertWeights> = experts.iter().map(|[a, b, c]| [a, b, c]).collect();
        let x = Var::from_vec(pseudo(n * h, 1), (n, h), &dev)?;
        let w = Var::from_vec(pseudo(n * k, 2), (n, k), &dev)?;
        let g = Tensor::from_vec(pseudo(n * h, 3), (n, h), &dev)?;
        let flops = 2.0 * 3.0 * ((n * k * i) + n * 2 * i) as f64 * h as f64;
        let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            let t = std::time::Instant::now();
            let y = routed_experts(Kernels::Auto, x.as_tensor(), w.as_tensor(), &chosen, &ex, Some([&shared[0], &shared[1], &shared[2]]), Keep::plain())?.expect("fused");
            fwd.push(t.elapsed().as_secs_f64());
            let t = std::time::Instant::now();
            let grads = (y * &g)?.sum_all()?.backward()?;
            bwd.push(t.elapsed().as_secs_f64());
            drop(grads);
        }
        let best = |v: &[f64]| v.iter().copied().fold(f64::MAX, f64::min);
        crate::note!(
            "routed experts, {n} tokens ({}-{} rows an expert): forward {:.0} ms ({:.0} GFLOP/s), backward {:.0} ms ({:.0} GFLOP/s); all forwards {:?}, backwards {:?}",
            rows.iter().min().unwrap_or(&0),
            rows.iter().max().unwrap_or(&0),
            1e3 * best(&fwd),
            flops / best(&fwd) / 1e9,
            1e3 * best(&bwd),
            flops / best(&bwd) / 1e9,
            fwd.iter().map(|t| (t * 1e3) as u32).collect::<Vec<_>>(),
            bwd.iter().map(|t| (t * 1e3) as u32).collect::<Vec<_>>()
        );
        Ok(())
    }

    #[test]
    fn an_expert_id_past_the_experts_is_an_error() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::zeros((2, 8), DType::F32, &dev)?;
        let w = Tensor::zeros((2, 1), DType::F32, &dev)?;
        let m = Tensor::zeros((4, 8), DType::F32, &dev)?;
        let d = Tensor::zeros((8, 4), DType::F32, &dev)?;
        let err = routed_experts(Kernels::Auto, &x, &w, &[0, 1], &[[&m, &m, &d]], None, Keep::plain()).unwrap_err().to_string();
        assert!(err.contains("expert 1 chosen of 1"), "{err}");
        Ok(())
    }
}
