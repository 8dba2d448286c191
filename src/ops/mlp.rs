//! The SwiGLU MLP: its gate op, and the whole MLP half of a layer as one fused op when none
//! of its projections is adapted.

use super::linear::frozen_gemm;
use super::norm::RmsNorm;
use super::checkpoint::{Keep, Pass, SwiGluInputs};
use super::{add_into, cpu_f32, exp_f32, f32_elems, par_zeroed, Kernels, Op, Path};
use candle_core::{Result, Tensor};
use std::sync::Mutex;

/// SwiGLU's gate: silu(g) ⊙ u for g, u [N, I]. One fused op on CPU f32; `silu(g) * u` from
/// candle ops on the portable path (same result).
pub fn swiglu(k: Kernels, g: &Tensor, u: &Tensor) -> Result<Tensor> {
    if g.dims() != u.dims() || g.dtype() != u.dtype() {
        candle_core::bail!("swiglu: gate {:?} {:?} and up {:?} {:?} differ", g.dims(), g.dtype(), u.dims(), u.dtype());
    }
    match k.pick(Op::SwiGlu, g, &[]) {
        Path::Fused => g.contiguous()?.apply_op2(&u.contiguous()?, SwiGlu),
        Path::Portable => g.silu()? * u,
    }
}

struct SwiGlu;

/// silu(g) ⊙ u, elementwise.
pub(crate) fn swiglu_rows(g: &[f32], u: &[f32]) -> Vec<f32> {
    par_zeroed(g.len(), 4096, |i, y: &mut [f32]| {
        let (g, u) = (&g[i * 4096..][..y.len()], &u[i * 4096..][..y.len()]);
        y.iter_mut().zip(g).zip(u).for_each(|((o, &g), &u)| *o = g / (1.0 + exp_f32(-g)) * u);
    })
}

/// (dg, du) of silu(g) ⊙ u for the upstream dy:
/// silu(g) = g σ(g), silu'(g) = σ(g) (1 + g (1 − σ(g))).
pub(crate) fn swiglu_rows_bwd(gv: &[f32], uv: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
    const CHUNK: usize = 4096;
    let len = gv.len();
    let mut du: Vec<f32> = Vec::with_capacity(len);
    let du_out = super::Shared::uninit(&mut du.spare_capacity_mut()[..len]);
    // Zipped chunks, no indexing: the loop vectorises (exp_f32 included).
    let dg = par_zeroed(len, CHUNK, |i, dg: &mut [f32]| {
        let at = i * CHUNK;
        // SAFETY: chunk i of du (the same range as dg's chunk i) is this task's alone and
        // inside du's capacity of `len`; it is zeroed before the slice over it is made.
        let du = unsafe {
            let p = du_out.ptr_at(at, dg.len());
            std::ptr::write_bytes(p, 0, dg.len());
            std::slice::from_raw_parts_mut(p, dg.len())
        };
        let (x, uu, d) = (&gv[at..][..dg.len()], &uv[at..][..dg.len()], &dy[at..][..dg.len()]);
        for ((((dg, du), &x), &uu), &d) in dg.iter_mut().zip(du.iter_mut()).zip(x).zip(uu).zip(d) {
            let sig = 1.0 / (1.0 + exp_f32(-x));
            *du = d * x * sig;
            *dg = d * uu * sig * (1.0 + x * (1.0 - sig));
        }
    });
    // SAFETY: the chunks of dg cover 0..len, and each task wrote the same range of du.
    unsafe { du.set_len(len) };
    (dg, du)
}

impl candle_core::CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn cpu_fwd(&self, s1: &candle_core::CpuStorage, l1: &candle_core::Layout, s2: &candle_core::CpuStorage, l2: &candle_core::Layout) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (g, u) = (cpu_f32("swiglu", s1, l1)?, cpu_f32("swiglu", s2, l2)?);
        Ok((candle_core::CpuStorage::F32(swiglu_rows(g, u)), l1.shape().clone()))
    }

    fn bwd(&self, g: &Tensor, u: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (gv, uv, dy) = (f32_elems(g)?, f32_elems(u)?, f32_elems(grad_res)?);
        let (dg, du) = swiglu_rows_bwd(&gv, &uv, &dy);
        let dg = Tensor::from_vec(dg, g.shape(), g.device())?;
        let du = Tensor::from_vec(du, u.shape(), u.device())?;
        Ok((Some(dg), Some(du)))
    }
}

/// The MLP half of a decoder layer when none of its projections is adapted (the default
/// q/k/v/o targets): y = x + down(silu(gate(n)) ⊙ up(n)) with n = rms_norm(x, norm), for
/// x [N, H], frozen gate/up [I, H] and down [H, I]. One op where the fused kernels run (`None`
/// on the portable path: the caller then builds it from the separate ops, with the same result).
///
/// Why: with frozen projections this half has nothing to train, so candle's graph gains
/// nothing from its seven nodes, while each of their edges costs a zeroed gradient buffer and
/// an add of [N, H] or [N, I] floats on the calling thread. The backward, by hand:
///   ds = dy Wd,  (dg, du) = swiglu'(g, u) ds,  dn = dg Wg + du Wu,  dx = dy + rms'(x) dn
/// with g and u kept from the forward (recomputing them would be two of the three GEMMs).
/// The sums are the ones the separate ops' backward makes (two terms each, so in any order),
/// so both paths give the same bits.
///
/// `keep` is activation checkpointing's (`ops::checkpoint`): a checkpointed forward leaves g
/// and u in the layer's slot; the recomputation takes them from there instead of running the
/// gate and up GEMMs, and skips the down GEMM (its value is never read: it returns x in place
/// of y). Gradients are the same bits either way.
pub fn frozen_mlp_residual(k: Kernels, x: &Tensor, norm: &Tensor, eps: f64, (gate, up, down): (&Tensor, &Tensor, &Tensor), keep: Keep) -> Result<Option<Tensor>> {
    if x.rank() != 2 || k.pick(Op::FrozenMlp, x, &[gate, up, down]) == Path::Portable {
        return Ok(None);
    }
    let (h, i) = (x.dim(1)?, gate.dim(0)?);
    if norm.dims() != [h] || gate.dims() != [i, h] || up.dims() != [i, h] || down.dims() != [h, i] {
        candle_core::bail!(
            "frozen-mlp: x {:?}, norm {:?}, gate {:?}, up {:?}, down {:?} do not form an MLP",
            x.dims(), norm.dims(), gate.dims(), up.dims(), down.dims()
        );
    }
    let op = FrozenMlp { rms: RmsNorm::new(norm, eps)?, gate: gate.contiguous()?, up: up.contiguous()?, down: down.contiguous()?, kept: Mutex::new(None), keep };
    Ok(Some(x.contiguous()?.apply_op1(op)?))
}

struct FrozenMlp {
    rms: RmsNorm,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    /// g and u [N, I] from the forward, taken by the backward.
    kept: Mutex<Option<SwiGluInputs>>,
    /// The checkpointing pass, and where a checkpointed forward leaves g and u.
    keep: Keep,
}

impl candle_core::CustomOp1 for FrozenMlp {
    fn name(&self) -> &'static str {
        "frozen-mlp"
    }

    fn cpu_fwd(&self, storage: &candle_core::CpuStorage, layout: &candle_core::Layout) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (n, _) = layout.shape().dims2()?;
        let x = cpu_f32("frozen-mlp", storage, layout)?;
        let from_forward = match (self.keep.pass, &self.keep.slot) {
            (Pass::Recompute, Some(slot)) => slot.take_swiglu(),
            _ => None,
        };
        let (g, u) = match from_forward {
            Some(gu) => gu,
            None => {
                let nx = self.rms.forward_rows(x); // [N, H]
                (frozen_gemm(&nx, n, &self.gate, false)?, frozen_gemm(&nx, n, &self.up, false)?) // [N, I] each
            }
        };
        let y = if self.keep.pass == Pass::Recompute {
            x.to_vec() // a placeholder: the recomputation's value is never read
        } else {
            let mut y = frozen_gemm(&swiglu_rows(&g, &u), n, &self.down, false)?; // [N, H]
            add_into(&mut y, x);
            y
        };
        match (self.keep.pass, &self.keep.slot) {
            (Pass::Checkpointed, Some(slot)) => slot.put_swiglu((g, u)),
            _ => *self.kept.lock().unwrap_or_else(|e| e.into_inner()) = Some((g, u)),
        }
        Ok((candle_core::CpuStorage::F32(y), layout.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let n = x.dim(0)?;
        let Some((g, u)) = self.kept.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            candle_core::bail!("frozen-mlp: backward without a forward");
        };
        let (xv, dyv) = (f32_elems(x)?, f32_elems(dy)?);
        let ds = frozen_gemm(&dyv, n, &self.down, true)?; // [N, I]
        let (dg, du) = swiglu_rows_bwd(&g, &u, &ds);
        let mut dn = frozen_gemm(&dg, n, &self.gate, true)?; // [N, H]
        add_into(&mut dn, &frozen_gemm(&du, n, &self.up, true)?);
        let mut dx = self.rms.backward_rows(&xv, &dn);
        add_into(&mut dx, &dyv);
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{compare, pseudo};
    use crate::ops::{frozen_linear, rms_norm};
    use candle_core::{DType, Device, Var};

    const K: Kernels = Kernels::Auto;

    #[test]
    fn fused_swiglu_matches_the_portable_path_for_both_inputs() -> Result<()> {
        let u = Var::from_vec(pseudo(5000, 4), (50, 100), &Device::Cpu)?;
        let (dv, dg) = compare(&[50, 100], |g| swiglu(Kernels::Auto, g, &u), |g| swiglu(Kernels::Portable, g, &u))?;
        let g = Tensor::from_vec(pseudo(5000, 5), (50, 100), &Device::Cpu)?;
        let (du_dv, du_dg) = compare(&[50, 100], |u| swiglu(Kernels::Auto, &g, u), |u| swiglu(Kernels::Portable, &g, u))?;
        println!("swiglu fused vs portable: value {dv:.1e}, grad gate {dg:.1e}, grad up {du_dg:.1e}");
        assert!(dv < 1e-6 && dg < 1e-6 && du_dv < 1e-6 && du_dg < 1e-6);
        Ok(())
    }

    /// The fused MLP half equals the separate ops it replaces (rms_norm, frozen_linear x3,
    /// swiglu, residual add) bit for bit, in value and in x's gradient: same kernels, and each
    /// gradient sum has two terms. For an f32 W here; a bf16 W below.
    #[test]
    fn frozen_mlp_residual_equals_the_separate_ops_in_value_and_input_gradient() -> Result<()> {
        check_frozen_mlp_residual(DType::F32)
    }

    #[test]
    #[cfg_attr(not(bf16_unit), ignore = "needs AMX or AVX512-BF16")]
    fn frozen_mlp_residual_with_a_bf16_weight_equals_the_separate_ops_on_a_bf16_unit() -> Result<()> {
        assert!(crate::ops::bf16_gemm::available(), "built for a bf16 unit this CPU lacks: rebuild on this machine");
        check_frozen_mlp_residual(DType::BF16)
    }

    /// A checkpointed forward leaves g and u in its slot; the recomputation takes them (the
    /// slot is empty after) and gives x's gradient bit for bit as a plain forward's backward.
    /// Without a slot the recomputation runs the gate and up GEMMs, to the same bits.
    #[test]
    fn the_recomputation_reuses_the_kept_swiglu_inputs_for_the_same_gradient() -> Result<()> {
        use crate::ops::checkpoint::{KeepLayer, Kept};
        let dev = Device::Cpu;
        let (n, h, i) = (33, 16, 40);
        let t = |len: usize, seed: usize, dims: (usize, usize)| Tensor::from_vec(pseudo(len, seed), dims, &dev);
        let (gate, up, down) = (t(i * h, 1, (i, h))?, t(i * h, 2, (i, h))?, t(h * i, 3, (h, i))?);
        let norm = Tensor::from_vec(pseudo(h, 4), h, &dev)?;
        let dy = t(n * h, 5, (n, h))?;
        let x = Var::from_tensor(&t(n * h, 6, (n, h))?)?;
        let w = (&gate, &up, &down);
        let dx = |pass: Pass, slot| -> Result<Tensor> {
            let y = frozen_mlp_residual(K, x.as_tensor(), &norm, 1e-5, w, Keep { pass, slot })?.expect("fused on cpu");
            Ok((y * &dy)?.sum_all()?.backward()?.get(&x).cloned().expect("dx"))
        };
        let want = dx(Pass::Plain, None)?;
        let kept = Kept::new(&[KeepLayer::default(), KeepLayer { swiglu: true, ..KeepLayer::default() }]);
        let y = frozen_mlp_residual(K, x.as_tensor(), &norm, 1e-5, w, Keep { pass: Pass::Checkpointed, slot: kept.slot(1) })?.expect("fused on cpu");
        let y_plain = frozen_mlp_residual(K, x.as_tensor(), &norm, 1e-5, w, Keep::plain())?.expect("fused on cpu");
        assert_eq!((y - y_plain)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0, "a checkpointed forward's value is the plain one");
        assert_eq!(kept.bytes(), 8 * n * i, "g and u kept");
        for (what, slot) in [("kept g, u", kept.slot(1)), ("recomputed g, u", None)] {
            let got = dx(Pass::Recompute, slot)?;
            assert_eq!((got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0, "{what}");
            assert_eq!(kept.bytes(), 0, "{what}: the slot is emptied");
        }
        Ok(())
    }

    fn check_frozen_mlp_residual(dt: DType) -> Result<()> {
        let dev = Device::Cpu;
        let (n, h, i) = (37, 24, 70);
        let vals = |len: usize, m: usize, k: usize| (0..len).map(move |v| ((v * m % k) as f32 - (k / 2) as f32) * 0.05).collect::<Vec<_>>();
        let norm = Tensor::from_vec(vals(h, 3, 7).iter().map(|v| 1.0 + v).collect::<Vec<_>>(), h, &dev)?;
        let g = Tensor::from_vec(vals(n * h, 7, 9), (n, h), &dev)?;
        {
            let gate = Tensor::from_vec(vals(i * h, 5, 11), (i, h), &dev)?.to_dtype(dt)?;
            let up = Tensor::from_vec(vals(i * h, 13, 17), (i, h), &dev)?.to_dtype(dt)?;
            let down = Tensor::from_vec(vals(h * i, 11, 13), (h, i), &dev)?.to_dtype(dt)?;
            let x = Var::from_vec(vals(n * h, 17, 19), (n, h), &dev)?;
            let got = frozen_mlp_residual(K, x.as_tensor(), &norm, 1e-5, (&gate, &up, &down), Keep::plain())?.expect("fused on cpu");
            let nx = rms_norm(K, x.as_tensor(), &norm, 1e-5)?;
            let m = frozen_linear(K, &swiglu(K, &frozen_linear(K, &nx, &gate)?, &frozen_linear(K, &nx, &up)?)?, &down)?;
            let want = (x.as_tensor() + m)?;
            let dv = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            let dx_got = (got * &g)?.sum_all()?.backward()?.get(&x).cloned().expect("fused dx");
            let dx_want = (want * &g)?.sum_all()?.backward()?.get(&x).cloned().expect("reference dx");
            let dd = (dx_got - dx_want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            println!("{dt:?} W: value max |diff| {dv:e}, dx max |diff| {dd:e}");
            assert!(dv == 0.0 && dd == 0.0, "{dt:?} W: value differs by {dv}, dx by {dd}");
        }
        Ok(())
    }

}
