//! Differentiable building blocks. candle's fused `softmax_last_dim`, `rms_norm` and
//! `rotary_emb::rope` have no backward (autograd silently treats them as constants, see
//! shared/CANDLE-FACTS.md), so training code must use these instead.

use candle_core::{DType, Device, Result, Tensor, D};

/// RMSNorm as transformers' LlamaRMSNorm: `x * rsqrt(mean(x^2) + eps) * weight`, in f32.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?; // [.., 1]
    let normed = x.broadcast_div(&(ms + eps)?.sqrt()?)?;
    normed.to_dtype(dtype)?.broadcast_mul(weight)
}

/// Softmax over the last dim. The max is detached: subtracting it does not change the
/// result, so it needs no gradient (saves a backward through `max`).
pub fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    let s = e.sum_keepdim(D::Minus1)?;
    e.broadcast_div(&s)
}

/// cos/sin tables for rotate-half RoPE: positions [B, S] (u32) -> cos, sin [B, 1, S, D].
/// Computed in f64 from `inv_freq` (already scaled per the config's rope_scaling).
pub fn rope_tables(positions: &[Vec<u32>], inv_freq: &[f64], device: &Device, dtype: DType) -> Result<(Tensor, Tensor)> {
    let b = positions.len();
    let s = positions.first().map_or(0, |p| p.len());
    let half = inv_freq.len();
    let d = 2 * half;
    let mut cos = Vec::with_capacity(b * s * d);
    let mut sin = Vec::with_capacity(b * s * d);
    for row in positions {
        for &p in row {
            // emb = cat(freqs, freqs): the same angle for element i and i + D/2.
            for _ in 0..2 {
                for f in inv_freq {
                    let a = p as f64 * f;
                    cos.push(a.cos() as f32);
                    sin.push(a.sin() as f32);
                }
            }
        }
    }
    let cos = Tensor::from_vec(cos, (b, 1, s, d), device)?.to_dtype(dtype)?;
    let sin = Tensor::from_vec(sin, (b, 1, s, d), device)?.to_dtype(dtype)?;
    Ok((cos, sin))
}

/// Rotate-half RoPE (transformers' `apply_rotary_pos_emb`): x [B, N, S, D], cos/sin [B, 1, S, D].
/// Pairs are (i, i + D/2), not interleaved (i, i+1) as in the original paper.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let x1 = x.narrow(D::Minus1, 0, d / 2)?;
    let x2 = x.narrow(D::Minus1, d / 2, d / 2)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?; // [B, N, S, D]
    x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

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
    fn rope_at_position_zero_is_identity() -> Result<()> {
        let dev = Device::Cpu;
        let (cos, sin) = rope_tables(&[vec![0, 1]], &[1.0, 0.01], &dev, DType::F32)?;
        let x = Tensor::arange(0f32, 8.0, &dev)?.reshape((1, 1, 2, 4))?;
        let y = rope(&x, &cos, &sin)?;
        let row0: Vec<f32> = y.get(0)?.get(0)?.get(0)?.to_vec1()?;
        assert_eq!(row0, vec![0.0, 1.0, 2.0, 3.0]);
        Ok(())
    }

    #[test]
    fn softmax_last_rows_sum_to_one() -> Result<()> {
        let x = Tensor::new(&[[1f32, 2.0, f32::NEG_INFINITY], [0.5, 0.5, 0.5]], &Device::Cpu)?;
        let s: Vec<f32> = softmax_last(&x)?.sum(D::Minus1)?.to_vec1()?;
        assert!(s.iter().all(|v| (v - 1.0).abs() < 1e-6));
        Ok(())
    }
}

/// `x @ W^T` for a frozen W, as a custom op whose backward returns only the input gradient.
///
/// candle's matmul backward always computes the weight gradient too (a full [out, in] GEMM
/// per linear, a third of all training FLOPs) even when W is a constant. This op calls the
/// same gemm kernel candle uses for the forward, and `grad @ W` for the backward, nothing else.
struct FrozenMatmul {
    /// [out, in], contiguous f32 (CPU path only).
    w: Tensor,
}

impl candle_core::CustomOp1 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-matmul"
    }

    fn cpu_fwd(&self, storage: &candle_core::CpuStorage, layout: &candle_core::Layout) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use candle_core::{CpuStorage, Storage};
        let (n, k) = layout.shape().dims2()?;
        let (out, k2) = self.w.dims2()?;
        if k != k2 {
            candle_core::bail!("frozen-matmul: input has {k} features, weight expects {k2}");
        }
        let Some((xs, xe)) = layout.contiguous_offsets() else {
            candle_core::bail!("frozen-matmul: input must be contiguous")
        };
        let CpuStorage::F32(x) = storage else { candle_core::bail!("frozen-matmul: f32 only") };
        let x = &x[xs..xe];
        let (wst, wl) = self.w.storage_and_layout();
        let Storage::Cpu(CpuStorage::F32(w)) = &*wst else { candle_core::bail!("frozen-matmul: weight must be f32 on cpu") };
        let Some((ws, we)) = wl.contiguous_offsets() else { candle_core::bail!("frozen-matmul: weight must be contiguous") };
        let w = &w[ws..we];
        let mut dst = vec![0f32; n * out];
        let threads = candle_core::utils::get_num_threads();
        let par = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
        // SAFETY: dst is [n, out] row-major, x is [n, k] row-major, and W^T is read from the
        // [out, k] row-major W with row stride 1 and column stride k; all bounds match the
        // dims checked above.
        unsafe {
            gemm::gemm(
                n, out, k,
                dst.as_mut_ptr(), 1, out as isize, false,
                x.as_ptr(), 1, k as isize,
                w.as_ptr(), k as isize, 1,
                0.0, 1.0, false, false, false, par,
            );
        }
        Ok((CpuStorage::F32(dst), candle_core::Shape::from((n, out))))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        // d(x W^T)/dx applied to g: g [N, out] @ W [out, in] -> [N, in]
        Ok(Some(grad_res.matmul(&self.w)?))
    }
}

/// x [N, in] @ W^T for a frozen W [out, in] -> [N, out], with no weight gradient.
/// Falls back to candle's matmul off the CPU f32 path.
pub fn frozen_linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == DType::F32 && w.dtype() == DType::F32 {
        let w = w.contiguous()?;
        x.contiguous()?.apply_op1(FrozenMatmul { w })
    } else {
        x.matmul(&w.t()?)
    }
}

#[cfg(test)]
mod frozen_tests {
    use super::*;
    use candle_core::Var;

    #[test]
    fn frozen_linear_matches_matmul_in_value_and_input_gradient() -> Result<()> {
        let dev = Device::Cpu;
        let x = Var::from_vec((0..35).map(|i| ((i * 17 % 13) as f32 - 6.0) * 0.1).collect(), (5, 7), &dev)?;
        let w = Tensor::from_vec((0..21).map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.1).collect(), (3, 7), &dev)?;
        let g = Tensor::from_vec((0..15).map(|i| (i as f32 - 7.0) * 0.05).collect(), (5, 3), &dev)?;
        let a = frozen_linear(x.as_tensor(), &w)?;
        let b = x.matmul(&w.t()?)?;
        let diff = (&a - &b)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6, "forward differs by {diff}");
        let ga = (a * &g)?.sum_all()?.backward()?.get(&x).expect("grad").clone();
        let gb = (b * &g)?.sum_all()?.backward()?.get(&x).expect("grad").clone();
        let diff = (ga - gb)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6, "input gradient differs by {diff}");
        Ok(())
    }
}

/// softmax(x · scale + causal mask) over the last dim, fused, for attention scores
/// x [.., S, S] (row i of each S x S matrix sees keys 0..=i).
///
/// The generic path materialises the scaled scores, the masked scores and five softmax
/// intermediates ([B, NH, S, S] each), and autograd then also reduces a gradient for the
/// broadcast mask. This op makes one pass forward (rows in parallel) and computes the
/// backward from the output alone: dx = scale · y ⊙ (g − Σ g ⊙ y).
struct CausalSoftmax {
    scale: f32,
}

impl candle_core::CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "causal-softmax"
    }

    fn cpu_fwd(&self, storage: &candle_core::CpuStorage, layout: &candle_core::Layout) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use rayon::prelude::*;
        let dims = layout.shape().dims();
        let s = dims[dims.len() - 1];
        if dims.len() < 2 || dims[dims.len() - 2] != s {
            candle_core::bail!("causal-softmax: expected [.., S, S], got {dims:?}");
        }
        let Some((start, end)) = layout.contiguous_offsets() else { candle_core::bail!("causal-softmax: input must be contiguous") };
        let candle_core::CpuStorage::F32(x) = storage else { candle_core::bail!("causal-softmax: f32 only") };
        let x = &x[start..end];
        let mut y = vec![0f32; x.len()];
        let scale = self.scale;
        y.par_chunks_mut(s).zip(x.par_chunks(s)).enumerate().for_each(|(r, (yr, xr))| {
            let i = r % s; // query position within its S x S matrix
            let seen = &xr[..=i];
            let max = seen.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v * scale));
            let mut sum = 0f32;
            for (o, &v) in yr[..=i].iter_mut().zip(seen) {
                *o = (v * scale - max).exp();
                sum += *o;
            }
            let inv = 1.0 / sum;
            yr[..=i].iter_mut().for_each(|o| *o *= inv);
        });
        Ok((candle_core::CpuStorage::F32(y), layout.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let dot = (grad_res * res)?.sum_keepdim(D::Minus1)?; // [.., S, 1]
        let dx = (grad_res.broadcast_sub(&dot)? * res)?;
        Ok(Some((dx * self.scale as f64)?))
    }
}

/// Attention probabilities softmax(x · scale + causal mask) for scores x [.., S, S].
/// Uses the fused CPU op when it applies, else the generic differentiable path.
pub fn causal_softmax(x: &Tensor, scale: f64) -> Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == DType::F32 {
        return x.contiguous()?.apply_op1(CausalSoftmax { scale: scale as f32 });
    }
    let s = x.dim(D::Minus1)?;
    let mask = causal_mask(s, s, 0, x.device())?.to_dtype(x.dtype())?;
    softmax_last(&(x * scale)?.broadcast_add(&mask)?)
}

/// Additive causal mask [S, T] (0 or -inf): query i sits at position `offset + i` and sees
/// keys 0..=offset + i. `offset` is the number of cached positions during generation.
pub fn causal_mask(s: usize, t: usize, offset: usize, device: &Device) -> Result<Tensor> {
    let m: Vec<f32> = (0..s * t).map(|x| if x % t > offset + x / t { f32::NEG_INFINITY } else { 0.0 }).collect();
    Tensor::from_vec(m, (s, t), device)
}

#[cfg(test)]
mod causal_softmax_tests {
    use super::*;
    use candle_core::Var;

    /// The fused op equals the generic path in value and gradient.
    #[test]
    fn fused_causal_softmax_matches_the_generic_path() -> Result<()> {
        let dev = Device::Cpu;
        let n = 2 * 3 * 5 * 5;
        let x = Var::from_vec((0..n).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.3).collect(), (2, 3, 5, 5), &dev)?;
        let g = Tensor::from_vec((0..n).map(|i| ((i * 11 % 7) as f32 - 3.0) * 0.1).collect(), (2, 3, 5, 5), &dev)?;
        let fused = causal_softmax(x.as_tensor(), 0.25)?;
        let m: Vec<f32> = (0..25).map(|i| if i % 5 > i / 5 { f32::NEG_INFINITY } else { 0.0 }).collect();
        let mask = Tensor::from_vec(m, (5, 5), &dev)?;
        let generic = softmax_last(&(x.as_tensor() * 0.25)?.broadcast_add(&mask)?)?;
        let d = (&fused - &generic)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(d < 1e-6, "forward differs by {d}");
        let ga = (fused * &g)?.sum_all()?.backward()?.get(&x).expect("grad").clone();
        let gb = (generic * &g)?.sum_all()?.backward()?.get(&x).expect("grad").clone();
        let d = (ga - gb)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(d < 1e-6, "gradient differs by {d}");
        Ok(())
    }
}
