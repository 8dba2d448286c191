//! RMSNorm (transformers' LlamaRMSNorm): the fused CPU op and the portable version.

use super::{cpu_f32, f32_elems, par_zeroed, Kernels, Op, Path};
use candle_core::{DType, Result, Tensor, D};

/// RMSNorm as transformers' LlamaRMSNorm: `x * rsqrt(mean(x^2) + eps) * weight`, in f32.
/// The weight is a frozen constant (it gets no gradient). On CPU f32 this is one fused op
/// (one pass forward, one backward) instead of eight element-wise ops, each with its own
/// buffer and backward, plus a full-size gradient for the broadcast weight.
pub fn rms_norm(k: Kernels, x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    match k.pick(Op::RmsNorm, x, &[]) {
        Path::Fused => x.contiguous()?.apply_op1(RmsNorm::new(weight, eps)?),
        Path::Portable => rms_norm_portable(x, weight, eps),
    }
}

/// RMSNorm through candle's differentiable ops, any device or dtype. As transformers does it:
/// the statistics in f32 whatever x's dtype, the normalised rows rounded back to x's dtype,
/// then scaled by the weight in that dtype.
pub fn rms_norm_portable(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?; // [.., 1]
    let normed = x.broadcast_div(&(ms + eps)?.sqrt()?)?;
    normed.to_dtype(dtype)?.broadcast_mul(&weight.to_dtype(dtype)?)
}

pub(crate) struct RmsNorm {
    w: Vec<f32>,
    eps: f32,
}

impl RmsNorm {
    /// From the frozen weight [H] (any float dtype) and eps.
    pub(crate) fn new(weight: &Tensor, eps: f64) -> Result<Self> {
        Ok(RmsNorm { w: weight.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, eps: eps as f32 })
    }

    /// x [rows, H] -> y = x · r · w per row, r = (mean(x²) + eps)^-1/2.
    pub(crate) fn forward_rows(&self, x: &[f32]) -> Vec<f32> {
        let h = self.w.len();
        par_zeroed(x.len(), h, |i, yr: &mut [f32]| {
            let xr = &x[i * h..(i + 1) * h];
            let ms = xr.iter().map(|v| v * v).sum::<f32>() / h as f32;
            let inv = 1.0 / (ms + self.eps).sqrt();
            yr.iter_mut().zip(xr).zip(&self.w).for_each(|((o, &v), &w)| *o = v * inv * w);
        })
    }

    /// dx for x [rows, H] and dy [rows, H]:
    /// dx_j = r w_j g_j − x_j r³ / H · Σ_i w_i g_i x_i
    pub(crate) fn backward_rows(&self, x: &[f32], g: &[f32]) -> Vec<f32> {
        let h = self.w.len();
        par_zeroed(x.len(), h, |i, dr: &mut [f32]| {
            let (xr, gr) = (&x[i * h..(i + 1) * h], &g[i * h..(i + 1) * h]);
            let ms = xr.iter().map(|v| v * v).sum::<f32>() / h as f32;
            let r = 1.0 / (ms + self.eps).sqrt();
            let dot: f32 = xr.iter().zip(gr).zip(&self.w).map(|((x, g), w)| w * g * x).sum();
            let c = r * r * r * dot / h as f32;
            dr.iter_mut().zip(xr).zip(gr).zip(&self.w).for_each(|(((o, &x), &g), &w)| *o = r * w * g - x * c);
        })
    }
}

impl candle_core::CustomOp1 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(&self, storage: &candle_core::CpuStorage, layout: &candle_core::Layout) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let x = cpu_f32("rms-norm", storage, layout)?;
        let h = self.w.len();
        if layout.shape().dims().last() != Some(&h) || h == 0 {
            candle_core::bail!("rms-norm: input {:?} does not end in the weight's {h}", layout.shape());
        }
        Ok((candle_core::CpuStorage::F32(self.forward_rows(x)), layout.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let (x, g) = (f32_elems(arg)?, f32_elems(grad_res)?);
        Ok(Some(Tensor::from_vec(self.backward_rows(&x, &g), arg.shape(), arg.device())?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{compare, max_diff, pseudo};
    use candle_core::{Device, Var};

    /// The fused candle op silently drops gradients; ours must not. Finite differences in f64.
    #[test]
    fn rms_norm_gradient_matches_finite_differences() -> Result<()> {
        let dev = Device::Cpu;
        let x0: Vec<f64> = (0..8).map(|i| ((i * 7 % 5) as f64 - 2.0) * 0.3 + 0.1).collect();
        let w = Tensor::new(&[1.1f64, 0.9, 1.2, 0.8], &dev)?;
        let g = Tensor::new(&[0.3f64, -0.2, 0.5, 0.1, -0.4, 0.2, 0.7, -0.1], &dev)?.reshape((2, 4))?;
        let f = |x: &Tensor| -> Result<f64> {
            // mean_keepdim/sqrt path only; rms_norm casts to f32, so test the f64 math directly.
            let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
            let y = x.broadcast_div(&(ms + 1e-6)?.sqrt()?)?.broadcast_mul(&w)?;
            (y * &g)?.sum_all()?.to_scalar::<f64>()
        };
        let xv = Var::from_vec(x0.clone(), (2, 4), &dev)?;
        let ms = xv.sqr()?.mean_keepdim(D::Minus1)?;
        let y = xv.broadcast_div(&(ms + 1e-6)?.sqrt()?)?.broadcast_mul(&w)?;
        let grads = (y * &g)?.sum_all()?.backward()?;
        let an: Vec<f64> = grads.get(&xv).expect("grad").flatten_all()?.to_vec1()?;
        for i in 0..8 {
            let mut p = x0.clone();
            p[i] += 1e-6;
            let mut m = x0.clone();
            m[i] -= 1e-6;
            let num = (f(&Tensor::from_vec(p, (2, 4), &dev)?)? - f(&Tensor::from_vec(m, (2, 4), &dev)?)?) / 2e-6;
            assert!((num - an[i]).abs() < 1e-6, "elem {i}: numeric {num} analytic {}", an[i]);
        }
        Ok(())
    }

    #[test]
    fn fused_rms_norm_matches_the_portable_path() -> Result<()> {
        let w = Tensor::from_vec(pseudo(24, 3), 24, &Device::Cpu)?;
        let (dv, dg) = compare(&[2, 5, 24], |x| rms_norm(Kernels::Auto, x, &w, 1e-5), |x| rms_norm(Kernels::Portable, x, &w, 1e-5))?;
        println!("rms_norm fused vs portable: value {dv:.1e}, grad {dg:.1e}");
        assert!(dv < 1e-6 && dg < 1e-5, "value {dv}, grad {dg}");
        Ok(())
    }

    /// bf16 activations and weight: the portable op stays in bf16 and its result is the f32
    /// result to within bf16 rounding (one rounding of the normalised rows, one of the product).
    #[test]
    fn portable_rms_norm_in_bf16_is_the_f32_result_rounded() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::from_vec(pseudo(2 * 24, 5), (2, 24), &dev)?;
        let w = Tensor::from_vec(pseudo(24, 3), 24, &dev)?;
        let (xb, wb) = (x.to_dtype(DType::BF16)?, w.to_dtype(DType::BF16)?);
        let y = rms_norm(Kernels::Auto, &xb, &wb, 1e-5)?;
        assert_eq!(y.dtype(), DType::BF16);
        let want = rms_norm(Kernels::Auto, &xb.to_dtype(DType::F32)?, &wb.to_dtype(DType::F32)?, 1e-5)?;
        let rel = (max_diff(&y, &want)? / want.abs()?.max_all()?.to_scalar::<f32>()?) as f64;
        println!("bf16 rms_norm: max |diff| / max |y| = {rel:.1e}");
        assert!(rel < 2.0 * 2f64.powi(-8), "{rel}");
        Ok(())
    }
}
