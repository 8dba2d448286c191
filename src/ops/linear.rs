//! Frozen linears: the plain frozen matmul (no weight gradient on any device) and the LoRA
//! linear built on it.

use super::checkpoint::LinearKeep;
use super::{cpu_f32, f32_elems, sgemm, zeros_f32, Kernels, Op, Path};
use candle_core::{DType, Result, Tensor};

/// For a frozen W [out, in] on CPU: x [n, in] · Wᵀ -> [n, out] (`input_grad` false), or
/// g [n, out] · W -> [n, in] (true). An f32 W by the f32 GEMM (Wᵀ read through strides, no
/// copy), or on few rows (an expert's tokens) by `few_rows`'s kernels; a bf16 W on the bf16 kernel (`bf16_gemm::linear`), packed for it on every call
/// except a forward over few rows, which reads W as it lies (a cache of packed weights
/// kept across steps measured 20% slower at 4 x 512 on Zen 4: packing right before the GEMM
/// leaves B in cache). A bf16 W on a CPU without a bf16 unit is widened to f32 block by block
/// inside the f32 GEMM, or read by `few_rows` on few rows (`widen`): f32 math on its exact
/// values.
pub(crate) fn frozen_gemm(x: &[f32], n: usize, w: &Tensor, input_grad: bool) -> Result<Vec<f32>> {
    let (out, inp) = w.dims2()?;
    let (k, cols) = if input_grad { (out, inp) } else { (inp, out) };
    if x.len() != n * k {
        candle_core::bail!("frozen-matmul: {} input elements for [{n}, {k}] (weight [{out}, {inp}])", x.len());
    }
    match w.dtype() {
        DType::F32 => {
            let w = f32_elems(w)?;
            let threads = candle_core::utils::get_num_threads();
            if let Some(c) = super::few_rows::gemm(x, n, &w, (out, inp), input_grad, threads) {
                return Ok(c);
            }
            let mut dst = zeros_f32(n * cols);
            // B = Wᵀ: B[kk, j] = W[j, kk]; B = W: B[kk, j] = W[kk, j].
            let (rs, cs) = if input_grad { (inp, 1) } else { (1, inp) };
            sgemm(n, cols, k, &mut dst, cols, false, x, k, 1, &w, rs, cs, 1.0, threads);
            Ok(dst)
        }
        DType::BF16 if super::bf16_gemm::available() => super::bf16_gemm::linear(x, n, w, input_grad),
        DType::BF16 => super::bf16_gemm::with_weight_bits(w, |bits, out, inp| {
            super::widen::gemm(x, n, bits, (out, inp), input_grad, candle_core::utils::get_num_threads())
        }),
        dt => candle_core::bail!("frozen-matmul: no CPU kernel for a {dt:?} weight"),
    }
}

/// `x @ W^T` for a frozen W, as a custom op whose backward returns only the input gradient.
///
/// candle's matmul backward always computes the weight gradient too (a full [out, in] GEMM
/// per linear, a third of all training FLOPs) even when W is a constant. This op runs the
/// forward and `grad @ W` for the backward, nothing else, on either path:
/// - fused (CPU f32 activations): [`frozen_gemm`] both ways (the gemm crate, the bf16 unit,
///   the widening path or the few-row kernels);
/// - portable (CUDA, `kernels = "portable"`): the forward is the backend's own matmul
///   (`BackendStorage::matmul`, cuBLAS on CUDA) on W read transposed through its layout, and
///   the backward is the tensor op `g @ W`, so no device needs a kernel of ours.
struct FrozenMatmul {
    /// [out, in], contiguous; f32 or bf16 on the fused path, the activations' dtype on the
    /// portable one.
    w: Tensor,
    /// false: x @ W^T -> [N, out]; true: g @ W -> [N, in] (the fused input gradient).
    input_grad: bool,
    path: Path,
    /// Activation checkpointing's hold on the output (fused forward only).
    keep: LinearKeep,
}

impl FrozenMatmul {
    /// x [N, in] @ W^T [in, out] by the backend that holds both (`S` is its storage type).
    fn backend_fwd<S: candle_core::backend::BackendStorage>(&self, x: &S, xl: &candle_core::Layout, w: &S, wl: &candle_core::Layout) -> Result<(S, candle_core::Shape)> {
        let (n, inp) = xl.shape().dims2()?;
        let (out, inp_w) = wl.shape().dims2()?;
        if inp != inp_w || self.input_grad {
            candle_core::bail!("frozen-matmul: x {:?} does not fit W {:?}", xl.shape(), wl.shape());
        }
        let wt = wl.transpose(0, 1)?; // W^T [in, out], strides (1, in): no copy
        Ok((x.matmul(w, (1, n, out, inp), xl, &wt)?, candle_core::Shape::from((n, out))))
    }
}

impl candle_core::CustomOp1 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-matmul"
    }

    fn cpu_fwd(&self, storage: &candle_core::CpuStorage, layout: &candle_core::Layout) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        if self.path == Path::Portable {
            let (st, wl) = self.w.storage_and_layout();
            let candle_core::Storage::Cpu(w) = &*st else { candle_core::bail!("frozen-matmul: W is not on the CPU") };
            return self.backend_fwd(storage, layout, w, wl);
        }
        let (n, _) = layout.shape().dims2()?;
        let (out, inp) = self.w.dims2()?;
        let cols = if self.input_grad { inp } else { out };
        let y = match self.keep.reused(n * cols) {
            Some(y) => y,
            None => {
                let y = frozen_gemm(cpu_f32("frozen-matmul", storage, layout)?, n, &self.w, self.input_grad)?;
                self.keep.hold(&y);
                y
            }
        };
        Ok((candle_core::CpuStorage::F32(y), candle_core::Shape::from((n, cols))))
    }

    fn cuda_fwd(&self, storage: &candle_core::CudaStorage, layout: &candle_core::Layout) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        let (st, wl) = self.w.storage_and_layout();
        let candle_core::Storage::Cuda(w) = &*st else { candle_core::bail!("frozen-matmul: W is not on the GPU") };
        self.backend_fwd(storage, layout, w, wl)
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        // No second derivatives through a frozen matmul, and no input gradient where nothing
        // that trains lies below the input (see `LoraMatmul::bwd`).
        if self.input_grad || !arg.track_op() {
            return Ok(None);
        }
        match self.path {
            Path::Fused => {
                let op = FrozenMatmul { w: self.w.clone(), input_grad: true, path: Path::Fused, keep: LinearKeep::none() };
                Ok(Some(grad_res.contiguous()?.apply_op1(op)?))
            }
            // g [N, out] @ W [out, in]: plain tensors (neither tracks a gradient), no graph.
            Path::Portable => Ok(Some(grad_res.matmul(&self.w.to_dtype(grad_res.dtype())?)?)),
        }
    }
}

/// x [N, in] @ W^T for a frozen W [out, in] -> [N, out], with no weight gradient, by
/// [`FrozenMatmul`] on either path. On the portable path W meets x in x's dtype.
pub fn frozen_linear(k: Kernels, x: &Tensor, w: &Tensor) -> Result<Tensor> {
    frozen_linear_kept(k, x, w, LinearKeep::none())
}

/// [`frozen_linear`], whose output activation checkpointing may keep (`ops::checkpoint`; on
/// the fused path: the portable one always recomputes).
pub fn frozen_linear_kept(k: Kernels, x: &Tensor, w: &Tensor, keep: LinearKeep) -> Result<Tensor> {
    let path = k.pick(Op::FrozenLinear, x, &[w]);
    let w = match path {
        Path::Fused => w.contiguous()?,
        Path::Portable => w.to_dtype(x.dtype())?.contiguous()?,
    };
    x.contiguous()?.apply_op1(FrozenMatmul { w, input_grad: false, path, keep })
}

/// A LoRA linear without its bias, y = x Wᵀ + s · (m ⊙ x) Aᵀ Bᵀ, as one op on CPU: x [N, in],
/// A [R, in], B [out, R], frozen W [out, in], scale s, dropout mask m [N, in] (or none).
///
/// Why: built from candle ops this is six graph nodes per projection, each of whose backward
/// zeroes and adds full [N, out] or [N, in] buffers; here the backward is
///   u = g B [N, R],  dx = g W + s · m ⊙ (u A),  dA = s · uᵀ (m ⊙ x),  dB = s · gᵀ (m ⊙ x) Aᵀ
/// with (m ⊙ x) Aᵀ recomputed (N·in·R, small) rather than kept.
/// `adapter`: (A, B, s). `keep`: activation checkpointing's hold on the output (the fused
/// path; the portable one always recomputes).
pub fn lora_linear(k: Kernels, x: &Tensor, w: &Tensor, adapter: (&Tensor, &Tensor, f64), mask: Option<Vec<f32>>, keep: LinearKeep) -> Result<Tensor> {
    let (a, b, scale) = adapter;
    if k.pick(Op::LoraLinear, x, &[w, a, b]) == Path::Portable {
        // The same math from candle ops (any device), as PEFT computes it with a half-precision
        // base: the adapter's input is cast to A's dtype (f32), the adapter runs in f32, and
        // its output is rounded to x's dtype before it joins the frozen output. The scale
        // sits on B ([out, R]) rather than on the [N, out] product: exact for a power-of-two
        // alpha / rank.
        let xd = match mask {
            Some(m) => (x.to_dtype(DType::F32)? * Tensor::from_vec(m, x.shape(), x.device())?)?,
            None => x.to_dtype(DType::F32)?,
        };
        let (a, b) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
        let l = xd.matmul(&a.t()?)?.matmul(&(b * scale)?.t()?)?.to_dtype(x.dtype())?; // [N, out]
        return frozen_linear(k, x, w)? + l;
    }
    let op = LoraMatmul { w: w.contiguous()?, scale: scale as f32, mask, xa: std::sync::Mutex::new(None), keep };
    x.contiguous()?.apply_op3(&a.contiguous()?, &b.contiguous()?, op)
}

struct LoraMatmul {
    /// [out, in], contiguous, f32 or bf16.
    w: Tensor,
    scale: f32,
    /// [N * in] dropout mask (0 or 1 / (1 - p)) on the adapter's input.
    mask: Option<Vec<f32>>,
    /// xa = (m ⊙ x) Aᵀ [N, R] from the forward, for dB in the backward (N·R floats, where
    /// recomputing it re-read all of x).
    xa: std::sync::Mutex<Option<Vec<f32>>>,
    /// Activation checkpointing's hold on the output: a recomputation that gets it back runs
    /// no GEMM (xa is then recomputed in the backward).
    keep: LinearKeep,
}

/// xa [N, R] = xd [N, in] · Aᵀ for A [R, in].
fn down(xd: &[f32], n: usize, inp: usize, a: &[f32], r: usize) -> Vec<f32> {
    let mut xa = vec![0f32; n * r];
    sgemm(n, r, inp, &mut xa, r, false, xd, inp, 1, a, 1, inp, 1.0, candle_core::utils::get_num_threads());
    xa
}

impl LoraMatmul {
    /// m ⊙ x [N, in] (borrowed when there is no mask).
    fn dropped<'a>(&self, x: &'a [f32]) -> std::borrow::Cow<'a, [f32]> {
        match &self.mask {
            Some(m) => x.iter().zip(m).map(|(x, m)| x * m).collect::<Vec<f32>>().into(),
            None => x.into(),
        }
    }
}

impl candle_core::CustomOp3 for LoraMatmul {
    fn name(&self) -> &'static str {
        "lora-matmul"
    }

    fn cpu_fwd(
        &self,
        xs: &candle_core::CpuStorage,
        xl: &candle_core::Layout,
        as_: &candle_core::CpuStorage,
        al: &candle_core::Layout,
        bs: &candle_core::CpuStorage,
        bl: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (n, inp) = xl.shape().dims2()?;
        let (r, inp2) = al.shape().dims2()?;
        let (out, r2) = bl.shape().dims2()?;
        if inp != inp2 || r != r2 || self.w.dims() != [out, inp] || self.mask.as_ref().is_some_and(|m| m.len() != n * inp) {
            candle_core::bail!("lora-matmul: x {:?}, A {:?}, B {:?}, W {:?} do not fit", xl.shape(), al.shape(), bl.shape(), self.w.shape());
        }
        if let Some(y) = self.keep.reused(n * out) {
            return Ok((candle_core::CpuStorage::F32(y), candle_core::Shape::from((n, out))));
        }
        let (x, a, b) = (cpu_f32("lora-matmul", xs, xl)?, cpu_f32("lora-matmul", as_, al)?, cpu_f32("lora-matmul", bs, bl)?);
        let threads = candle_core::utils::get_num_threads();
        let mut y = frozen_gemm(x, n, &self.w, false)?; // [N, out]
        // xa [N, R] = (m ⊙ x) Aᵀ;  y += s · xa Bᵀ
        let xa = down(&self.dropped(x), n, inp, a, r);
        sgemm(n, out, r, &mut y, out, true, &xa, r, 1, b, 1, r, self.scale, threads);
        *self.xa.lock().unwrap_or_else(|e| e.into_inner()) = Some(xa);
        self.keep.hold(&y);
        Ok((candle_core::CpuStorage::F32(y), candle_core::Shape::from((n, out))))
    }

    fn bwd(&self, x: &Tensor, a: &Tensor, b: &Tensor, _res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let ((n, inp), (r, _), (out, _)) = (x.dims2()?, a.dims2()?, b.dims2()?);
        let (xe, ae, be, ge) = (f32_elems(x)?, f32_elems(a)?, f32_elems(b)?, f32_elems(g)?);
        let threads = candle_core::utils::get_num_threads();
        let s = self.scale;
        let xd = self.dropped(&xe); // [N, in]
        // u [N, R] = g B
        let mut u = vec![0f32; n * r];
        sgemm(n, r, out, &mut u, r, false, &ge, out, 1, &be, r, 1, 1.0, threads);
        // dx [N, in] = g W + s · m ⊙ (u A), only where x depends on something that trains
        // (candle asks every op for all its inputs' gradients, and adds them up even for an
        // input nothing reads them from): the first layer's projections read the frozen
        // embedding's rows, and their g W was the largest GEMM of its backward for nothing.
        let dx = if x.track_op() {
            let mut dx = frozen_gemm(&ge, n, &self.w, true)?;
            match &self.mask {
                None => sgemm(n, inp, r, &mut dx, inp, true, &u, r, 1, &ae, inp, 1, s, threads),
                Some(m) => {
                    let mut ua = zeros_f32(n * inp);
                    sgemm(n, inp, r, &mut ua, inp, false, &u, r, 1, &ae, inp, 1, s, threads);
                    dx.iter_mut().zip(&ua).zip(m).for_each(|((d, v), m)| *d += v * m);
                }
            }
            Some(Tensor::from_vec(dx, (n, inp), x.device())?)
        } else {
            None
        };
        // dA [R, in] = s · uᵀ (m ⊙ x)
        let mut da = vec![0f32; r * inp];
        sgemm(r, inp, n, &mut da, inp, false, &u, 1, r, &xd, inp, 1, s, threads);
        // dB [out, R] = s · gᵀ xa, xa = (m ⊙ x) Aᵀ [N, R] from the forward (recomputed if
        // this op's forward did not run on the CPU path)
        let kept = self.xa.lock().unwrap_or_else(|e| e.into_inner()).take();
        let xa = match kept {
            Some(xa) if xa.len() == n * r => xa,
            _ => down(&xd, n, inp, &ae, r),
        };
        let mut db = vec![0f32; out * r];
        sgemm(out, r, n, &mut db, r, false, &ge, 1, out, &xa, r, 1, s, threads);
        let dev = x.device();
        Ok((
            dx,
            Some(Tensor::from_vec(da, (r, inp), dev)?),
            Some(Tensor::from_vec(db, (out, r), dev)?),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// `len` small values in a pattern set by `m` and `k` (the tests' operands).
    fn vals(len: usize, m: usize, k: usize) -> Vec<f32> {
        (0..len).map(|v| ((v * m % k) as f32 - (k / 2) as f32) * 0.03).collect()
    }

    /// A dropout mask of `len`: every seventh element dropped, the rest scaled by 1 / (1 - p).
    fn dropout_mask(len: usize) -> Vec<f32> {
        (0..len).map(|v| if v % 7 == 3 { 0.0 } else { 1.25 }).collect()
    }

    /// The fused frozen linear with a bf16 W: only a CPU with a bf16 unit takes this path
    /// (elsewhere a bf16 W goes portable); the math it runs is checked on every CPU below.
    #[test]
    #[cfg_attr(not(bf16_unit), ignore = "needs AMX or AVX512-BF16")]
    fn a_bf16_weight_on_a_bf16_unit_matches_f32_math_on_bf16_rounded_inputs_in_value_and_input_gradient() -> Result<()> {
        let kernel = crate::ops::bf16_gemm::kernel().expect("build.rs found a bf16 unit but this process has none: rebuild on this machine");
        let dev = Device::Cpu;
        let round = |t: &Tensor| t.to_dtype(DType::BF16)?.to_dtype(DType::F32);
        let (n, i, o) = (37, 70, 50);
        let x = Var::from_vec((0..n * i).map(|v| ((v * 17 % 13) as f32 - 6.0) * 0.01).collect(), (n, i), &dev)?;
        let w = Tensor::from_vec((0..o * i).map(|v| ((v * 5 % 11) as f32 - 5.0) * 0.1).collect(), (o, i), &dev)?.to_dtype(DType::BF16)?;
        let g = Tensor::from_vec((0..n * o).map(|v| ((v % 9) as f32 - 4.0) * 0.05).collect(), (n, o), &dev)?;
        let w32 = w.to_dtype(DType::F32)?;
        let got = frozen_linear(Kernels::Auto, x.as_tensor(), &w)?;
        let want = round(x.as_tensor())?.matmul(&w32.t()?)?;
        let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        println!("{kernel:?} forward: max |diff| {diff:e}");
        assert!(diff < 1e-5, "forward differs by {diff}");
        let gx = (got * &g)?.sum_all()?.backward()?.get(&x).expect("grad").clone();
        let want = round(&g)?.matmul(&w32)?;
        let diff = (gx - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        println!("{kernel:?} input gradient: max |diff| {diff:e}");
        assert!(diff < 1e-5, "input gradient differs by {diff}");
        Ok(())
    }

    /// The bf16 GEMM a bf16 W runs on, fed as `frozen_gemm` feeds it (the weight packed by
    /// `PackedB::from_weight` both ways): f32 sums of bf16-rounded operands, on every CPU
    /// (the unit where there is one, the portable loop of the same math elsewhere).
    #[test]
    fn the_bf16_weight_gemm_is_f32_math_on_bf16_rounded_inputs_both_ways_on_every_cpu() -> Result<()> {
        use crate::ops::bf16_gemm::{gemm, PackedB};
        let dev = Device::Cpu;
        let round = |t: &Tensor| t.to_dtype(DType::BF16)?.to_dtype(DType::F32);
        let (n, i, o) = (37, 70, 50);
        let x = Tensor::from_vec((0..n * i).map(|v| ((v * 17 % 13) as f32 - 6.0) * 0.01).collect(), (n, i), &dev)?;
        let w = Tensor::from_vec((0..o * i).map(|v| ((v * 5 % 11) as f32 - 5.0) * 0.1).collect(), (o, i), &dev)?.to_dtype(DType::BF16)?;
        let g = Tensor::from_vec((0..n * o).map(|v| ((v % 9) as f32 - 4.0) * 0.05).collect(), (n, o), &dev)?;
        let w32 = w.to_dtype(DType::F32)?;
        let fwd = gemm(&x.flatten_all()?.to_vec1::<f32>()?, n, &PackedB::from_weight(&w, false)?);
        let want = round(&x)?.matmul(&w32.t()?)?.flatten_all()?.to_vec1::<f32>()?;
        let back = gemm(&g.flatten_all()?.to_vec1::<f32>()?, n, &PackedB::from_weight(&w, true)?);
        let want_back = round(&g)?.matmul(&w32)?.flatten_all()?.to_vec1::<f32>()?;
        for (what, got, want) in [("x Wᵀ", fwd, want), ("g W", back, want_back)] {
            assert_eq!(got.len(), want.len(), "{what}");
            let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            println!("{what}: max |diff| {d:e}");
            assert!(d < 1e-5, "{what} differs by {d}");
        }
        Ok(())
    }

    /// The fused LoRA op against the same math from candle ops: value and the gradients of
    /// x, A and B, with and without a dropout mask, for an f32 W (every CPU).
    #[test]
    fn lora_linear_matches_candle_ops_in_value_and_gradients_of_x_a_and_b() -> Result<()> {
        lora_linear_against_candle_ops(false)
    }

    /// The same for a bf16 W on a bf16 unit, against f32 math on bf16-rounded inputs.
    #[test]
    #[cfg_attr(not(bf16_unit), ignore = "needs AMX or AVX512-BF16")]
    fn lora_linear_with_a_bf16_weight_on_a_bf16_unit_matches_candle_ops_on_rounded_inputs() -> Result<()> {
        assert!(crate::ops::bf16_gemm::available(), "build.rs found a bf16 unit but this process has none: rebuild on this machine");
        lora_linear_against_candle_ops(true)
    }

    fn lora_linear_against_candle_ops(bf16: bool) -> Result<()> {
        let dev = Device::Cpu;
        let (n, i, o, r) = (37, 70, 50, 4);
        let w32 = Tensor::from_vec(vals(o * i, 5, 11), (o, i), &dev)?;
        let g = Tensor::from_vec(vals(n * o, 7, 9), (n, o), &dev)?;
        let mask = dropout_mask(n * i);
        let weights = if bf16 { vec![("bf16", w32.to_dtype(DType::BF16)?)] } else { vec![("f32", w32.clone())] };
        for (wname, w) in &weights {
            for masked in [false, true] {
                let x = Var::from_vec(vals(n * i, 17, 13), (n, i), &dev)?;
                let a = Var::from_vec(vals(r * i, 3, 7), (r, i), &dev)?;
                let b = Var::from_vec(vals(o * r, 11, 5), (o, r), &dev)?;
                let m = masked.then(|| mask.clone());
                let got = lora_linear(Kernels::Auto, x.as_tensor(), w, (a.as_tensor(), b.as_tensor(), 2.0), m.clone(), LinearKeep::none())?;
                // Reference: candle ops, with the frozen matmul's bf16 rounding of its input
                // (x forward, g backward) applied explicitly for a bf16 W.
                let round = |t: &Tensor| -> Result<Tensor> {
                    if *wname == "bf16" { t.to_dtype(DType::BF16)?.to_dtype(DType::F32) } else { Ok(t.clone()) }
                };
                let xd = match &m {
                    Some(m) => (x.as_tensor() * Tensor::from_vec(m.clone(), (n, i), &dev)?)?,
                    None => x.as_tensor().clone(),
                };
                let lora = xd.matmul(&a.t()?)?.matmul(&(b.as_tensor() * 2.0)?.t()?)?;
                let wf = w.to_dtype(DType::F32)?; // W as the kernel sees it
                let base = round(x.as_tensor())?.detach().matmul(&wf.t()?)?;
                let want = (&base + &lora)?;
                let d = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(d < 1e-5, "{wname} masked={masked}: value differs by {d}");
                let gg = (got * &g)?.sum_all()?.backward()?;
                let gw = (want * &g)?.sum_all()?.backward()?;
                // x's gradient through W is g W (rounded g for bf16), added by hand to the
                // reference, whose base term was detached.
                let dx_base = round(&g)?.matmul(&wf)?;
                let pairs = [
                    ("dx", gg.get(&x).cloned(), Some((gw.get(&x).expect("dx").clone() + dx_base)?)),
                    ("dA", gg.get(&a).cloned(), gw.get(&a).cloned()),
                    ("dB", gg.get(&b).cloned(), gw.get(&b).cloned()),
                ];
                for (name, got, want) in pairs {
                    let (got, want) = (got.expect("fused grad"), want.expect("reference grad"));
                    let d = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                    println!("{wname} W, mask {masked}: {name} max |diff| {d:e}");
                    assert!(d < 1e-5, "{wname} masked={masked}: {name} differs by {d}");
                }
            }
        }
        Ok(())
    }

    /// Where nothing that trains lies below x (the first layer's projections read the frozen
    /// embedding), the backward computes no gradient for x, and the adapter's gradients are
    /// the ones it gets when x does take one.
    #[test]
    fn an_input_nothing_trains_below_gets_no_gradient_and_the_adapter_the_same_one() -> Result<()> {
        let dev = Device::Cpu;
        let (n, i, o, r) = (9, 24, 20, 4);
        let w = Tensor::from_vec(vals(o * i, 5, 11), (o, i), &dev)?;
        let g = Tensor::from_vec(vals(n * o, 7, 9), (n, o), &dev)?;
        let mask = dropout_mask(n * i);
        for m in [None, Some(mask)] {
            let a = Var::from_vec(vals(r * i, 3, 7), (r, i), &dev)?;
            let b = Var::from_vec(vals(o * r, 11, 5), (o, r), &dev)?;
            let plain = Tensor::from_vec(vals(n * i, 17, 13), (n, i), &dev)?;
            let var = Var::from_tensor(&plain)?;
            let grads = |x: &Tensor| -> Result<candle_core::backprop::GradStore> {
                let y = lora_linear(Kernels::Auto, x, &w, (a.as_tensor(), b.as_tensor(), 2.0), m.clone(), LinearKeep::none())?;
                let frozen = frozen_linear(Kernels::Auto, x, &w)?;
                ((y + frozen)? * &g)?.sum_all()?.backward()
            };
            let (without, with) = (grads(&plain)?, grads(var.as_tensor())?);
            assert!(without.get(&plain).is_none(), "a gradient for an input nothing trains below");
            assert!(with.get(var.as_tensor()).is_some(), "no gradient for a variable input");
            for v in [&a, &b] {
                let d = crate::ops::testutil::max_diff(without.get(v).expect("adapter gradient"), with.get(v).expect("adapter gradient"))?;
                assert_eq!(d, 0.0, "the adapter's gradient depends on whether x takes one");
            }
        }
        Ok(())
    }

    #[test]
    fn frozen_linear_matches_matmul_in_value_and_input_gradient() -> Result<()> {
        let dev = Device::Cpu;
        let x = Var::from_vec((0..35).map(|i| ((i * 17 % 13) as f32 - 6.0) * 0.1).collect(), (5, 7), &dev)?;
        let w = Tensor::from_vec((0..21).map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.1).collect(), (3, 7), &dev)?;
        let g = Tensor::from_vec((0..15).map(|i| (i as f32 - 7.0) * 0.05).collect(), (5, 3), &dev)?;
        let a = frozen_linear(Kernels::Auto, x.as_tensor(), &w)?;
        let b = x.matmul(&w.t()?)?;
        let diff = (&a - &b)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6, "forward differs by {diff}");
        let ga = (a * &g)?.sum_all()?.backward()?.get(&x).expect("grad").clone();
        let gb = (b * &g)?.sum_all()?.backward()?.get(&x).expect("grad").clone();
        let diff = (ga - gb)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6, "input gradient differs by {diff}");
        Ok(())
    }

    /// The portable frozen matmul (backend matmul forward, tensor-op backward) against the
    /// fused one and against candle's matmul, in f32, and in bf16 against f32 math rounded;
    /// and it gives W no gradient even when W is a variable.
    #[test]
    fn portable_frozen_linear_matches_the_fused_op_and_gives_w_no_gradient() -> Result<()> {
        use crate::ops::testutil::{compare, max_diff, pseudo};
        let dev = Device::Cpu;
        let w = Tensor::from_vec(pseudo(9 * 14, 3), (9, 14), &dev)?;
        let (dv, dg) = compare(&[11, 14], |x| frozen_linear(Kernels::Portable, x, &w), |x| frozen_linear(Kernels::Auto, x, &w))?;
        println!("frozen_linear portable vs fused: value {dv:.1e}, input grad {dg:.1e}");
        assert!(dv < 1e-6 && dg < 1e-6, "value {dv}, grad {dg}");
        let wv = Var::from_tensor(&w)?;
        let x = Var::from_vec(pseudo(11 * 14, 4), (11, 14), &dev)?;
        let grads = frozen_linear(Kernels::Portable, x.as_tensor(), wv.as_tensor())?.sum_all()?.backward()?;
        assert!(grads.get(&wv).is_none(), "the frozen weight got a gradient");
        assert!(grads.get(&x).is_some());
        // bf16 x and W: the output is bf16, the f32 product of the same bf16 values rounded once.
        let (xb, wb) = (x.as_tensor().to_dtype(DType::BF16)?, w.to_dtype(DType::BF16)?);
        let y = frozen_linear(Kernels::Portable, &xb, &wb)?;
        assert_eq!(y.dtype(), DType::BF16);
        let want = xb.to_dtype(DType::F32)?.matmul(&wb.to_dtype(DType::F32)?.t()?)?;
        let d = max_diff(&y, &want)? / want.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(d <= 2f32.powi(-8), "bf16 frozen matmul off by {d} relative");
        Ok(())
    }

    /// The portable LoRA linear equals the fused op in value and in the gradients of x, A, B.
    #[test]
    fn portable_lora_linear_matches_the_fused_op_in_value_and_gradients() -> Result<()> {
        use crate::ops::testutil::{max_diff, pseudo};
        let dev = Device::Cpu;
        let (n, i, o, r) = (13, 20, 9, 4);
        let w = Tensor::from_vec(pseudo(o * i, 1), (o, i), &dev)?;
        let g = Tensor::from_vec(pseudo(n * o, 2), (n, o), &dev)?;
        let mask: Vec<f32> = (0..n * i).map(|v| if v % 5 == 2 { 0.0 } else { 1.25 }).collect();
        let mut got = Vec::new();
        for k in [Kernels::Auto, Kernels::Portable] {
            let x = Var::from_vec(pseudo(n * i, 3), (n, i), &dev)?;
            let a = Var::from_vec(pseudo(r * i, 4), (r, i), &dev)?;
            let b = Var::from_vec(pseudo(o * r, 5), (o, r), &dev)?;
            let y = lora_linear(k, x.as_tensor(), &w, (a.as_tensor(), b.as_tensor(), 2.0), Some(mask.clone()), LinearKeep::none())?;
            let gs = (&y * &g)?.sum_all()?.backward()?;
            got.push([y, gs.get(&x).expect("dx").clone(), gs.get(&a).expect("dA").clone(), gs.get(&b).expect("dB").clone()]);
        }
        for (j, name) in ["y", "dx", "dA", "dB"].iter().enumerate() {
            let d = max_diff(&got[0][j], &got[1][j])?;
            println!("lora_linear portable vs fused: {name} max |diff| {d:.1e}");
            assert!(d < 1e-5, "{name} differs by {d}");
        }
        Ok(())
    }

    /// bf16 activations and base with f32 adapters (PEFT's layout with a bf16 model): the
    /// output is bf16, A and B get f32 gradients, and all of it tracks the f32 computation on
    /// the same bf16-valued x and W within bf16 rounding.
    #[test]
    fn portable_lora_linear_meets_f32_adapters_with_bf16_activations() -> Result<()> {
        use crate::ops::testutil::{max_diff, pseudo};
        let dev = Device::Cpu;
        let (n, i, o, r) = (13, 20, 9, 4);
        let w = Tensor::from_vec(pseudo(o * i, 1), (o, i), &dev)?.to_dtype(DType::BF16)?;
        let g = Tensor::from_vec(pseudo(n * o, 2), (n, o), &dev)?;
        let x0 = Tensor::from_vec(pseudo(n * i, 3), (n, i), &dev)?.to_dtype(DType::BF16)?;
        let mut got = Vec::new();
        for dt in [DType::BF16, DType::F32] {
            let x = Var::from_tensor(&x0.to_dtype(dt)?)?;
            let a = Var::from_vec(pseudo(r * i, 4), (r, i), &dev)?;
            let b = Var::from_vec(pseudo(o * r, 5), (o, r), &dev)?;
            let y = lora_linear(Kernels::Portable, x.as_tensor(), &w.to_dtype(dt)?, (a.as_tensor(), b.as_tensor(), 2.0), None, LinearKeep::none())?;
            assert_eq!(y.dtype(), dt);
            let gs = (y.to_dtype(DType::F32)? * &g)?.sum_all()?.backward()?;
            let (da, db) = (gs.get(&a).expect("dA").clone(), gs.get(&b).expect("dB").clone());
            assert_eq!((da.dtype(), db.dtype()), (DType::F32, DType::F32));
            got.push([y, gs.get(&x).expect("dx").clone(), da, db]);
        }
        for (j, name) in ["y", "dx", "dA", "dB"].iter().enumerate() {
            let scale = got[1][j].abs()?.max_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()?;
            let d = max_diff(&got[0][j], &got[1][j])? / scale;
            println!("bf16 vs f32 lora_linear: {name} max |diff| / max |value| {d:.1e}");
            assert!(d < 2.0 * 2f32.powi(-8), "{name} differs by {d} relative");
        }
        Ok(())
    }

    /// A checkpointed forward of the frozen and the LoRA linear leaves its output in the
    /// layer's slot; the recomputation hands it back without running the GEMMs (fed other
    /// inputs, it still returns the kept value) and, fed the same inputs, gives the value and
    /// gradients of a plain forward bit for bit, emptying the slot.
    #[test]
    fn the_recomputation_of_a_linear_returns_its_kept_output_with_the_same_gradients() -> Result<()> {
        use crate::ops::checkpoint::{Keep, KeepLayer, Kept, Pass};
        use crate::ops::testutil::max_diff;
        let dev = Device::Cpu;
        let (n, i, o, r) = (37, 70, 50, 4);
        let w = Tensor::from_vec(vals(o * i, 5, 11), (o, i), &dev)?;
        let x = Var::from_vec(vals(n * i, 17, 13), (n, i), &dev)?;
        let a = Var::from_vec(vals(r * i, 3, 7), (r, i), &dev)?;
        let b = Var::from_vec(vals(o * r, 11, 5), (o, r), &dev)?;
        let mask = dropout_mask(n * i);
        let kept = Kept::new(&[KeepLayer { linears: true, ..KeepLayer::default() }]);
        let keep = |pass| Keep { pass, slot: kept.slot(0) }.linear(3);
        let lora = |x: &Tensor, keep: LinearKeep| lora_linear(Kernels::Auto, x, &w, (a.as_tensor(), b.as_tensor(), 2.0), Some(mask.clone()), keep);
        let frozen = |x: &Tensor, keep: LinearKeep| frozen_linear_kept(Kernels::Auto, x, &w, keep);
        type Forward<'f> = &'f dyn Fn(&Tensor, LinearKeep) -> Result<Tensor>;
        let ops: [(&str, Forward); 2] = [("lora", &lora), ("frozen", &frozen)];
        for (name, op) in ops {
            let plain = op(x.as_tensor(), LinearKeep::none())?;
            op(x.as_tensor(), keep(Pass::Checkpointed))?;
            assert_eq!(kept.bytes(), 4 * n * o, "{name}: the output kept");
            let other = (x.as_tensor() * 2.0)?;
            let y = op(&other, keep(Pass::Recompute))?;
            assert_eq!(max_diff(&y, &plain)?, 0.0, "{name}: the kept value, not a GEMM of the new input");
            assert_eq!(kept.bytes(), 0, "{name}: the slot is emptied");
            op(x.as_tensor(), keep(Pass::Checkpointed))?;
            let y = op(x.as_tensor(), keep(Pass::Recompute))?;
            let g = Tensor::from_vec(vals(n * o, 7, 9), (n, o), &dev)?;
            let (gp, gr) = ((&plain * &g)?.sum_all()?.backward()?, (&y * &g)?.sum_all()?.backward()?);
            for v in [&x, &a, &b] {
                match (gp.get(v), gr.get(v)) {
                    (Some(p), Some(q)) => assert_eq!(max_diff(p, q)?, 0.0, "{name}: a gradient differs"),
                    (p, q) => assert_eq!(p.is_some(), q.is_some(), "{name}: a gradient is missing"),
                }
            }
        }
        Ok(())
    }
}
