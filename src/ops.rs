//! Differentiable building blocks. candle's fused `softmax_last_dim`, `rms_norm` and
//! `rotary_emb::rope` have no backward (autograd silently treats them as constants, see
//! shared/CANDLE-FACTS.md), so training code must use these instead.

use std::sync::Mutex;
use candle_core::{DType, Device, Result, Tensor, D};

/// e^x in f32 within 2 ulp of `f32::exp` on [-87, 88] (clamped outside), written so the
/// compiler vectorises loops over it: libm's `expf` is a scalar call, and softmax rows,
/// attention strips, the loss and SwiGLU evaluate hundreds of millions per step.
/// Cephes' `expf`: x = n·ln2 + r with |r| ≤ ln2/2 (n rounded by the 1.5·2^23 trick, so no
/// float→int conversion), e^r by a degree-6 polynomial, 2^n from its exponent bits.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let x = x.clamp(-87.0, 88.0); // e^-87 ≈ 1.6e-38 is still a normal f32; e^88 < f32::MAX
    let t = x * std::f32::consts::LOG2_E + MAGIC;
    let n = t - MAGIC;
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4; // ln2 split in two for precision
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 1.666_666_5e-1) * r + 5.000_000_1e-1;
    let er = p * r * r + r + 1.0;
    let pow2n = f32::from_bits(((t.to_bits() as i32 - MAGIC.to_bits() as i32 + 127) as u32) << 23);
    er * pow2n
}

/// Σ x with eight running sums (vectorisable; a single running sum is a serial chain).
pub fn sum_f32(x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for i in 0..8 {
            acc[i] += c[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `len` zeros, zeroed in parallel chunks of `chunk`, each chunk then handed to `fill(index,
/// chunk)`. Why not `vec![0; len]` and a parallel fill: that zeroes the whole buffer on the
/// calling thread first, a serial memset (and page faults) of up to tens of MB per GEMM or op
/// while the other cores wait.
pub fn par_zeroed<T: Copy + Default + Send>(len: usize, chunk: usize, fill: impl Fn(usize, &mut [T]) + Sync) -> Vec<T> {
    use rayon::prelude::*;
    let mut v: Vec<T> = Vec::with_capacity(len);
    v.spare_capacity_mut()[..len].par_chunks_mut(chunk.max(1)).enumerate().for_each(|(i, c)| {
        for x in c.iter_mut() {
            x.write(T::default());
        }
        // SAFETY: every element of `c` was initialised just above.
        let c = unsafe { &mut *(c as *mut [std::mem::MaybeUninit<T>] as *mut [T]) };
        fill(i, c);
    });
    // SAFETY: the chunks cover 0..len and each was initialised.
    unsafe { v.set_len(len) };
    v
}

/// An f32 buffer that parallel tasks write disjoint parts of (attention strips, GEMM tiles).
#[derive(Clone, Copy)]
pub(crate) struct Shared(pub(crate) *mut f32);
// SAFETY: users write only disjoint ranges from different tasks (see `rows`).
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    /// # Safety
    /// `at..at + len` is inside the buffer and no other task touches it meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn rows(&self, at: usize, len: usize) -> &mut [f32] {
        unsafe { std::slice::from_raw_parts_mut(self.0.add(at), len) }
    }
}

/// `len` f32 zeros, zeroed in parallel when large: output buffers of the fused ops are
/// allocated on the calling thread, and `vec![0f32; len]` there was a serial memset (plus
/// first-touch page faults) of every activation-sized buffer while the pool waited.
pub fn zeros_f32(len: usize) -> Vec<f32> {
    const SERIAL: usize = 1 << 16;
    if len <= SERIAL {
        return vec![0f32; len];
    }
    par_zeroed(len, SERIAL / 4, |_, _: &mut [f32]| {})
}

/// RMSNorm as transformers' LlamaRMSNorm: `x * rsqrt(mean(x^2) + eps) * weight`, in f32.
/// The weight is a frozen constant (it gets no gradient). On CPU f32 this is one fused op
/// (one pass forward, one backward) instead of eight element-wise ops, each with its own
/// buffer and backward, plus a full-size gradient for the broadcast weight.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == DType::F32 {
        return x.contiguous()?.apply_op1(RmsNorm::new(weight, eps)?);
    }
    rms_norm_generic(x, weight, eps)
}

/// RMSNorm through candle's differentiable ops (any device or dtype; the fused op's reference).
pub fn rms_norm_generic(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?; // [.., 1]
    let normed = x.broadcast_div(&(ms + eps)?.sqrt()?)?;
    normed.to_dtype(dtype)?.broadcast_mul(weight)
}

struct RmsNorm {
    w: Vec<f32>,
    eps: f32,
}

/// f32 rows of a contiguous CPU tensor, or an error naming the op.
fn cpu_f32<'a>(op: &str, storage: &'a candle_core::CpuStorage, layout: &candle_core::Layout) -> Result<&'a [f32]> {
    let candle_core::CpuStorage::F32(x) = storage else { candle_core::bail!("{op}: f32 only") };
    let Some((a, b)) = layout.contiguous_offsets() else { candle_core::bail!("{op}: input must be contiguous") };
    Ok(&x[a..b])
}

/// dst [m, n] (row stride `dst_rs`) = (acc ? dst : 0) + beta · lhs [m, k] · rhs [k, n], on
/// `threads` threads (1 where the caller already runs in parallel). Strides are (row, column)
/// in elements, so transposed operands need no copy.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgemm(m: usize, n: usize, k: usize, dst: &mut [f32], dst_rs: usize, acc: bool, lhs: &[f32], lhs_rs: usize, lhs_cs: usize, rhs: &[f32], rhs_rs: usize, rhs_cs: usize, beta: f32, threads: usize) {
    // The slices must cover the strided extents the kernel reads and writes.
    let last = |rows: usize, rs: usize, cols: usize, cs: usize| if rows == 0 || cols == 0 { 0 } else { (rows - 1) * rs + (cols - 1) * cs + 1 };
    assert!(dst.len() >= last(m, dst_rs, n, 1) && lhs.len() >= last(m, lhs_rs, k, lhs_cs) && rhs.len() >= last(k, rhs_rs, n, rhs_cs));
    let par = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: the assert above bounds every element the kernel touches, dst does not alias
    // lhs or rhs (it is a distinct &mut), and all strides are in elements of f32.
    unsafe {
        gemm::gemm(
            m, n, k,
            dst.as_mut_ptr(), 1, dst_rs as isize, acc,
            lhs.as_ptr(), lhs_cs as isize, lhs_rs as isize,
            rhs.as_ptr(), rhs_cs as isize, rhs_rs as isize,
            if acc { 1.0 } else { 0.0 }, beta,
            false, false, false, par,
        );
    }
}

/// A host copy of a tensor's elements in f32 (for custom-op backwards).
fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}

/// A tensor's elements as an f32 slice: borrowed from its storage when it is a contiguous
/// f32 CPU tensor (what custom-op backwards are handed almost always), else a host copy.
/// Borrowing saves a full-size copy per operand per backward.
pub(crate) enum F32Elems<G> {
    /// (read guard of the storage, element range)
    Borrowed(G, usize, usize),
    Owned(Vec<f32>),
}

pub(crate) fn f32_elems(t: &Tensor) -> Result<F32Elems<impl std::ops::Deref<Target = candle_core::Storage> + '_>> {
    let (st, layout) = t.storage_and_layout();
    if let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(_)), Some((a, b))) = (&*st, layout.contiguous_offsets()) {
        return Ok(F32Elems::Borrowed(st, a, b));
    }
    drop(st);
    Ok(F32Elems::Owned(host_f32(t)?))
}

impl<G: std::ops::Deref<Target = candle_core::Storage>> std::ops::Deref for F32Elems<G> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            F32Elems::Borrowed(st, a, b) => match &**st {
                candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => &v[*a..*b],
                _ => unreachable!("f32_elems borrows only f32 CPU storage"),
            },
            F32Elems::Owned(v) => v,
        }
    }
}

impl RmsNorm {
    /// From the frozen weight [H] (any float dtype) and eps.
    fn new(weight: &Tensor, eps: f64) -> Result<Self> {
        Ok(RmsNorm { w: weight.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, eps: eps as f32 })
    }

    /// x [rows, H] -> y = x · r · w per row, r = (mean(x²) + eps)^-1/2.
    fn forward_rows(&self, x: &[f32]) -> Vec<f32> {
        use rayon::prelude::*;
        let h = self.w.len();
        let mut y = zeros_f32(x.len());
        y.par_chunks_mut(h).zip(x.par_chunks(h)).for_each(|(yr, xr)| {
            let ms = xr.iter().map(|v| v * v).sum::<f32>() / h as f32;
            let inv = 1.0 / (ms + self.eps).sqrt();
            yr.iter_mut().zip(xr).zip(&self.w).for_each(|((o, &v), &w)| *o = v * inv * w);
        });
        y
    }

    /// dx for x [rows, H] and dy [rows, H]:
    /// dx_j = r w_j g_j − x_j r³ / H · Σ_i w_i g_i x_i
    fn backward_rows(&self, x: &[f32], g: &[f32]) -> Vec<f32> {
        use rayon::prelude::*;
        let h = self.w.len();
        let mut dx = zeros_f32(x.len());
        dx.par_chunks_mut(h).zip(x.par_chunks(h)).zip(g.par_chunks(h)).for_each(|((dr, xr), gr)| {
            let ms = xr.iter().map(|v| v * v).sum::<f32>() / h as f32;
            let r = 1.0 / (ms + self.eps).sqrt();
            let dot: f32 = xr.iter().zip(gr).zip(&self.w).map(|((x, g), w)| w * g * x).sum();
            let c = r * r * r * dot / h as f32;
            dr.iter_mut().zip(xr).zip(gr).zip(&self.w).for_each(|(((o, &x), &g), &w)| *o = r * w * g - x * c);
        });
        dx
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

/// SwiGLU's gate: silu(g) ⊙ u for g, u [N, I]. On CPU f32 one fused op; the generic ops
/// elsewhere (same result).
pub fn swiglu(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    if g.device().is_cpu() && g.dtype() == DType::F32 && u.dtype() == DType::F32 && g.dims() == u.dims() {
        return g.contiguous()?.apply_op2(&u.contiguous()?, SwiGlu);
    }
    g.silu()? * u
}

struct SwiGlu;

/// silu(g) ⊙ u, elementwise.
fn swiglu_rows(g: &[f32], u: &[f32]) -> Vec<f32> {
    use rayon::prelude::*;
    let mut y = zeros_f32(g.len());
    y.par_chunks_mut(4096).zip(g.par_chunks(4096)).zip(u.par_chunks(4096)).for_each(|((y, g), u)| {
        y.iter_mut().zip(g).zip(u).for_each(|((o, &g), &u)| *o = g / (1.0 + exp_f32(-g)) * u);
    });
    y
}

/// (dg, du) of silu(g) ⊙ u for the upstream dy:
/// silu(g) = g σ(g), silu'(g) = σ(g) (1 + g (1 − σ(g))).
fn swiglu_rows_bwd(gv: &[f32], uv: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
    use rayon::prelude::*;
    let mut dg = zeros_f32(gv.len());
    let mut du = zeros_f32(gv.len());
    // Zipped chunks, no indexing: the loop vectorises (exp_f32 included).
    dg.par_chunks_mut(4096)
        .zip(du.par_chunks_mut(4096))
        .zip(gv.par_chunks(4096).zip(uv.par_chunks(4096)).zip(dy.par_chunks(4096)))
        .for_each(|((dg, du), ((x, uu), d))| {
            for ((((dg, du), &x), &uu), &d) in dg.iter_mut().zip(du.iter_mut()).zip(x).zip(uu).zip(d) {
                let sig = 1.0 / (1.0 + exp_f32(-x));
                *du = d * x * sig;
                *dg = d * uu * sig * (1.0 + x * (1.0 - sig));
            }
        });
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

/// Heads out of a projection, rotated: x [B, S, N, D] or the projection's own [B*S, N*D]
/// (the same bytes) -> rope(x as [B, N, S, D]). On CPU f32 one fused op that transposes while
/// it rotates, with the inverse rotation as its backward (no gradients for the cos/sin
/// constants, which the generic path computes at full size and reduces). Taking the 2-D
/// projection output directly saves autograd a reshape node (a zeroed gradient buffer and an
/// add in candle's backward).
pub fn rope_heads(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, _, s, d) = cos.dims4()?;
    let n = x.elem_count() / (b * s * d).max(1);
    if x.device().is_cpu() && x.dtype() == DType::F32 && cos.dtype() == DType::F32 && sin.dims() == cos.dims() && d % 2 == 0 && n * b * s * d == x.elem_count() {
        let rot = Some((host_f32(cos)?, host_f32(sin)?));
        return x.contiguous()?.apply_op1(Heads { dims: (b, s, n, d), rope: rot, split: true });
    }
    rope(&x.reshape((b, s, n, d))?.transpose(1, 2)?.contiguous()?, cos, sin)
}

/// x [B*S, N*D] (or [B, S, N, D]) -> [B, N, S, D]: the heads-first layout attention wants,
/// in one copy with one autograd node (candle's reshape + transpose + contiguous is three).
pub fn split_heads(x: &Tensor, b: usize, s: usize, n: usize) -> Result<Tensor> {
    let d = x.elem_count() / (b * s * n).max(1);
    if x.device().is_cpu() && x.dtype() == DType::F32 && d * b * s * n == x.elem_count() {
        return x.contiguous()?.apply_op1(Heads { dims: (b, s, n, d), rope: None, split: true });
    }
    x.reshape((b, s, n, d))?.transpose(1, 2)?.contiguous()
}

/// x [B, N, S, D] -> [B*S, N*D]: attention's output back in the projection layout (the
/// inverse of `split_heads`), in one copy with one autograd node.
pub fn merge_heads(x: &Tensor) -> Result<Tensor> {
    let (b, n, s, d) = x.dims4()?;
    if x.device().is_cpu() && x.dtype() == DType::F32 {
        return x.contiguous()?.apply_op1(Heads { dims: (b, s, n, d), rope: None, split: false });
    }
    x.transpose(1, 2)?.reshape((b * s, n * d))
}

/// Moves heads between the projection layout [B, S, N, D] and the attention layout
/// [B, N, S, D] (`split`), or back (`!split`), rotating by RoPE on the way in when `rope`
/// holds cos/sin [B, 1, S, D] flattened.
struct Heads {
    dims: (usize, usize, usize, usize),
    rope: Option<(Vec<f32>, Vec<f32>)>,
    split: bool,
}

impl Heads {
    /// For each (b, s, n): `f(src row [D], dst row [D], t)` with t the offset of (b, s) in
    /// cos/sin, src read in `src_heads_first` layout ([B, N, S, D] if true, else [B, S, N, D])
    /// and dst written in the other.
    fn map(&self, src: &[f32], src_heads_first: bool, f: impl Fn(&[f32], &mut [f32], usize) + Sync) -> Vec<f32> {
        use rayon::prelude::*;
        let (_, s, n, d) = self.dims;
        let mut dst = zeros_f32(src.len());
        // One chunk per (b, s) row of [B, S, N, D] or per (b, n) of [B, N, S, D], whichever dst is.
        let chunk = if src_heads_first { n * d } else { s * d };
        dst.par_chunks_mut(chunk).enumerate().for_each(|(c, out)| {
            if src_heads_first {
                let (bi, si) = (c / s, c % s); // dst [B, S, N, D]: out = row (bi, si), all heads
                let t = (bi * s + si) * d;
                for ni in 0..n {
                    let from = ((bi * n + ni) * s + si) * d;
                    f(&src[from..from + d], &mut out[ni * d..(ni + 1) * d], t);
                }
            } else {
                let (bi, ni) = (c / n, c % n); // dst [B, N, S, D]: out = head (bi, ni), all positions
                for si in 0..s {
                    let t = (bi * s + si) * d;
                    let from = ((bi * s + si) * n + ni) * d;
                    f(&src[from..from + d], &mut out[si * d..(si + 1) * d], t);
                }
            }
        });
        dst
    }

    /// Move (and rotate forward if `rope`, or backward if `inverse`) from the `heads_first`
    /// layout to the other.
    fn apply(&self, src: &[f32], heads_first: bool, inverse: bool) -> Vec<f32> {
        let d = self.dims.3;
        match &self.rope {
            None => self.map(src, heads_first, |x, o, _| o.copy_from_slice(x)),
            // out1 = x1 c − x2 s, out2 = x2 c + x1 s (the same angle at i and i + D/2)
            Some((cos, sin)) if !inverse => self.map(src, heads_first, |x, o, t| {
                let (c, sn, h) = (&cos[t..t + d], &sin[t..t + d], d / 2);
                for i in 0..h {
                    o[i] = x[i] * c[i] - x[i + h] * sn[i];
                    o[i + h] = x[i + h] * c[i + h] + x[i] * sn[i + h];
                }
            }),
            // The transpose of the rotation: dx1 = g1 c + g2 s, dx2 = g2 c − g1 s
            Some((cos, sin)) => self.map(src, heads_first, |g, o, t| {
                let (c, sn, h) = (&cos[t..t + d], &sin[t..t + d], d / 2);
                for i in 0..h {
                    o[i] = g[i] * c[i] + g[i + h] * sn[i + h];
                    o[i + h] = g[i + h] * c[i + h] - g[i] * sn[i];
                }
            }),
        }
    }
}

impl candle_core::CustomOp1 for Heads {
    fn name(&self) -> &'static str {
        "heads"
    }

    fn cpu_fwd(&self, storage: &candle_core::CpuStorage, layout: &candle_core::Layout) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let x = cpu_f32("heads", storage, layout)?;
        let (b, s, n, d) = self.dims;
        if x.len() != b * s * n * d {
            candle_core::bail!("heads: {} elements for [{b}, {s}, {n}, {d}]", x.len());
        }
        // split: [B, S, N, D] -> [B, N, S, D]; merge: [B, N, S, D] -> [B*S, N*D]
        let y = self.apply(x, !self.split, false);
        let shape = if self.split { candle_core::Shape::from((b, n, s, d)) } else { candle_core::Shape::from((b * s, n * d)) };
        Ok((candle_core::CpuStorage::F32(y), shape))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let g = f32_elems(grad_res)?;
        let dx = self.apply(&g, self.split, true);
        Ok(Some(Tensor::from_vec(dx, arg.shape(), arg.device())?))
    }
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

/// For a frozen W [out, in] on CPU: x [n, in] · Wᵀ -> [n, out] (`input_grad` false), or
/// g [n, out] · W -> [n, in] (true). An f32 W by the f32 GEMM (Wᵀ read through strides, no
/// copy); a bf16 W on the bf16 kernel, packed for it on every call (a cache of packed weights
/// kept across steps measured 20% slower at 4 x 512 on Zen 4: packing right before the GEMM
/// leaves B in cache).
fn frozen_gemm(x: &[f32], n: usize, w: &Tensor, input_grad: bool) -> Result<Vec<f32>> {
    let (out, inp) = w.dims2()?;
    let (k, cols) = if input_grad { (out, inp) } else { (inp, out) };
    if x.len() != n * k {
        candle_core::bail!("frozen-matmul: {} input elements for [{n}, {k}] (weight [{out}, {inp}])", x.len());
    }
    match w.dtype() {
        DType::F32 => {
            let w = f32_elems(w)?;
            let mut dst = zeros_f32(n * cols);
            // B = Wᵀ: B[kk, j] = W[j, kk]; B = W: B[kk, j] = W[kk, j].
            let (rs, cs) = if input_grad { (inp, 1) } else { (1, inp) };
            sgemm(n, cols, k, &mut dst, cols, false, x, k, 1, &w, rs, cs, 1.0, candle_core::utils::get_num_threads());
            Ok(dst)
        }
        DType::BF16 if crate::bf16_gemm::available() => Ok(crate::bf16_gemm::gemm(x, n, &crate::bf16_gemm::PackedB::from_weight(w, input_grad)?)),
        dt => candle_core::bail!("frozen-matmul: no CPU kernel for a {dt:?} weight"),
    }
}

/// `x @ W^T` for a frozen W, as a custom op whose backward returns only the input gradient.
///
/// candle's matmul backward always computes the weight gradient too (a full [out, in] GEMM
/// per linear, a third of all training FLOPs) even when W is a constant. This op runs the
/// forward and `grad @ W` for the backward ([`frozen_gemm`]), nothing else.
struct FrozenMatmul {
    /// [out, in], contiguous, f32 or bf16 (CPU).
    w: Tensor,
    /// false: x @ W^T -> [N, out]; true: g @ W -> [N, in] (the input gradient).
    input_grad: bool,
}

impl candle_core::CustomOp1 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-matmul"
    }

    fn cpu_fwd(&self, storage: &candle_core::CpuStorage, layout: &candle_core::Layout) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (n, _) = layout.shape().dims2()?;
        let x = cpu_f32("frozen-matmul", storage, layout)?;
        let y = frozen_gemm(x, n, &self.w, self.input_grad)?;
        let (out, inp) = self.w.dims2()?;
        let cols = if self.input_grad { inp } else { out };
        Ok((candle_core::CpuStorage::F32(y), candle_core::Shape::from((n, cols))))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        if self.input_grad {
            return Ok(None); // no second derivatives through a frozen matmul
        }
        let op = FrozenMatmul { w: self.w.clone(), input_grad: true };
        Ok(Some(grad_res.contiguous()?.apply_op1(op)?))
    }
}

/// Where the fused CPU ops apply: f32 activations on CPU with an f32 W, or a bf16 W on a CPU
/// with a bf16 unit (the weight source hands out bf16 only then).
fn frozen_on_cpu(x: &Tensor, w: &Tensor) -> bool {
    x.device().is_cpu()
        && x.dtype() == DType::F32
        && (w.dtype() == DType::F32 || (w.dtype() == DType::BF16 && crate::bf16_gemm::available()))
}

/// x [N, in] @ W^T for a frozen W [out, in] -> [N, out], with no weight gradient: the
/// [`FrozenMatmul`] op on CPU, candle's matmul elsewhere.
pub fn frozen_linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if frozen_on_cpu(x, w) {
        let op = FrozenMatmul { w: w.contiguous()?, input_grad: false };
        x.contiguous()?.apply_op1(op)
    } else {
        x.matmul(&w.to_dtype(x.dtype())?.t()?)
    }
}

/// The MLP half of a decoder layer when none of its projections is adapted (the default
/// q/k/v/o targets): y = x + down(silu(gate(n)) ⊙ up(n)) with n = rms_norm(x, norm), for
/// x [N, H], frozen gate/up [I, H] and down [H, I]. One op on CPU (`None` elsewhere: the caller
/// then builds it from the separate ops, with the same result).
///
/// Why: with frozen projections this half has nothing to train, so candle's graph gains
/// nothing from its seven nodes, while each of their edges costs a zeroed gradient buffer and
/// an add of [N, H] or [N, I] floats on the calling thread. The backward, by hand:
///   ds = dy Wd,  (dg, du) = swiglu'(g, u) ds,  dn = dg Wg + du Wu,  dx = dy + rms'(x) dn
/// with g and u kept from the forward (recomputing them would be two of the three GEMMs).
/// The sums are the ones the separate ops' backward makes (two terms each, so in any order),
/// so both paths give the same bits.
pub fn frozen_mlp_residual(x: &Tensor, norm: &Tensor, eps: f64, gate: &Tensor, up: &Tensor, down: &Tensor) -> Result<Option<Tensor>> {
    if x.rank() != 2 || ![gate, up, down].iter().all(|w| frozen_on_cpu(x, w)) {
        return Ok(None);
    }
    let (h, i) = (x.dim(1)?, gate.dim(0)?);
    if norm.dims() != [h] || gate.dims() != [i, h] || up.dims() != [i, h] || down.dims() != [h, i] {
        candle_core::bail!(
            "frozen-mlp: x {:?}, norm {:?}, gate {:?}, up {:?}, down {:?} do not form an MLP",
            x.dims(), norm.dims(), gate.dims(), up.dims(), down.dims()
        );
    }
    let op = FrozenMlp { rms: RmsNorm::new(norm, eps)?, gate: gate.contiguous()?, up: up.contiguous()?, down: down.contiguous()?, kept: Mutex::new(None) };
    Ok(Some(x.contiguous()?.apply_op1(op)?))
}

struct FrozenMlp {
    rms: RmsNorm,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    /// g and u [N, I] from the forward, taken by the backward.
    kept: Mutex<Option<(Vec<f32>, Vec<f32>)>>,
}

impl candle_core::CustomOp1 for FrozenMlp {
    fn name(&self) -> &'static str {
        "frozen-mlp"
    }

    fn cpu_fwd(&self, storage: &candle_core::CpuStorage, layout: &candle_core::Layout) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (n, _) = layout.shape().dims2()?;
        let x = cpu_f32("frozen-mlp", storage, layout)?;
        let nx = self.rms.forward_rows(x); // [N, H]
        let g = frozen_gemm(&nx, n, &self.gate, false)?; // [N, I]
        let u = frozen_gemm(&nx, n, &self.up, false)?; // [N, I]
        let mut y = frozen_gemm(&swiglu_rows(&g, &u), n, &self.down, false)?; // [N, H]
        add_into(&mut y, x);
        *self.kept.lock().unwrap_or_else(|e| e.into_inner()) = Some((g, u));
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

/// a += b, elementwise, in parallel chunks.
fn add_into(a: &mut [f32], b: &[f32]) {
    use rayon::prelude::*;
    a.par_chunks_mut(1 << 14).zip(b.par_chunks(1 << 14)).for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(x, y)| *x += y));
}

/// A LoRA linear without its bias, y = x Wᵀ + s · (m ⊙ x) Aᵀ Bᵀ, as one op on CPU: x [N, in],
/// A [R, in], B [out, R], frozen W [out, in], scale s, dropout mask m [N, in] (or none).
///
/// Why: built from candle ops this is six graph nodes per projection, each of whose backward
/// zeroes and adds full [N, out] or [N, in] buffers; here the backward is
///   u = g B [N, R],  dx = g W + s · m ⊙ (u A),  dA = s · uᵀ (m ⊙ x),  dB = s · gᵀ (m ⊙ x) Aᵀ
/// with (m ⊙ x) Aᵀ recomputed (N·in·R, small) rather than kept.
pub fn lora_linear(x: &Tensor, w: &Tensor, a: &Tensor, b: &Tensor, scale: f64, mask: Option<Vec<f32>>) -> Result<Tensor> {
    let fused = frozen_on_cpu(x, w) && a.dtype() == DType::F32 && b.dtype() == DType::F32 && a.device().is_cpu();
    if !fused {
        // The same math from candle ops (any device). The scale sits on B ([out, R]) rather
        // than on the [N, out] product: exact for a power-of-two alpha / rank.
        let xd = match mask {
            Some(m) => (x * Tensor::from_vec(m, x.shape(), x.device())?.to_dtype(x.dtype())?)?,
            None => x.clone(),
        };
        let xd = xd.to_dtype(DType::F32)?;
        let l = xd.matmul(&a.t()?)?.matmul(&(b * scale)?.t()?)?.to_dtype(x.dtype())?;
        return frozen_linear(x, w)? + l;
    }
    let op = LoraMatmul { w: w.contiguous()?, scale: scale as f32, mask };
    x.contiguous()?.apply_op3(&a.contiguous()?, &b.contiguous()?, op)
}

struct LoraMatmul {
    /// [out, in], contiguous, f32 or bf16.
    w: Tensor,
    scale: f32,
    /// [N * in] dropout mask (0 or 1 / (1 - p)) on the adapter's input.
    mask: Option<Vec<f32>>,
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
        let (x, a, b) = (cpu_f32("lora-matmul", xs, xl)?, cpu_f32("lora-matmul", as_, al)?, cpu_f32("lora-matmul", bs, bl)?);
        let threads = candle_core::utils::get_num_threads();
        let mut y = frozen_gemm(x, n, &self.w, false)?; // [N, out]
        // xa [N, R] = (m ⊙ x) Aᵀ;  y += s · xa Bᵀ
        let mut xa = vec![0f32; n * r];
        sgemm(n, r, inp, &mut xa, r, false, &self.dropped(x), inp, 1, a, 1, inp, 1.0, threads);
        sgemm(n, out, r, &mut y, out, true, &xa, r, 1, b, 1, r, self.scale, threads);
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
        // dx [N, in] = g W + s · m ⊙ (u A)
        let mut dx = frozen_gemm(&ge, n, &self.w, true)?;
        match &self.mask {
            None => sgemm(n, inp, r, &mut dx, inp, true, &u, r, 1, &ae, inp, 1, s, threads),
            Some(m) => {
                let mut ua = zeros_f32(n * inp);
                sgemm(n, inp, r, &mut ua, inp, false, &u, r, 1, &ae, inp, 1, s, threads);
                dx.iter_mut().zip(&ua).zip(m).for_each(|((d, v), m)| *d += v * m);
            }
        }
        // dA [R, in] = s · uᵀ (m ⊙ x)
        let mut da = vec![0f32; r * inp];
        sgemm(r, inp, n, &mut da, inp, false, &u, 1, r, &xd, inp, 1, s, threads);
        // dB [out, R] = s · gᵀ xa, xa = (m ⊙ x) Aᵀ [N, R] recomputed
        let mut xa = vec![0f32; n * r];
        sgemm(n, r, inp, &mut xa, r, false, &xd, inp, 1, &ae, 1, inp, 1.0, threads);
        let mut db = vec![0f32; out * r];
        sgemm(out, r, n, &mut db, r, false, &ge, 1, out, &xa, r, 1, s, threads);
        let dev = x.device();
        Ok((
            Some(Tensor::from_vec(dx, (n, inp), dev)?),
            Some(Tensor::from_vec(da, (r, inp), dev)?),
            Some(Tensor::from_vec(db, (out, r), dev)?),
        ))
    }
}

#[cfg(test)]
mod frozen_tests {
    use super::*;
    use candle_core::Var;

    #[test]
    fn a_bf16_weight_on_a_bf16_unit_matches_f32_math_on_bf16_rounded_inputs_in_value_and_input_gradient() -> Result<()> {
        let Some(kernel) = crate::bf16_gemm::kernel() else {
            eprintln!("SKIPPED: no AMX or AVX512-BF16 here, so a bf16 weight takes candle's matmul");
            return Ok(());
        };
        let dev = Device::Cpu;
        let round = |t: &Tensor| t.to_dtype(DType::BF16)?.to_dtype(DType::F32);
        let (n, i, o) = (37, 70, 50);
        let x = Var::from_vec((0..n * i).map(|v| ((v * 17 % 13) as f32 - 6.0) * 0.01).collect(), (n, i), &dev)?;
        let w = Tensor::from_vec((0..o * i).map(|v| ((v * 5 % 11) as f32 - 5.0) * 0.1).collect(), (o, i), &dev)?.to_dtype(DType::BF16)?;
        let g = Tensor::from_vec((0..n * o).map(|v| ((v % 9) as f32 - 4.0) * 0.05).collect(), (n, o), &dev)?;
        let w32 = w.to_dtype(DType::F32)?;
        let got = frozen_linear(x.as_tensor(), &w)?;
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

    /// The fused LoRA op against the same math from candle ops: value and the gradients of
    /// x, A and B, with and without a dropout mask, for an f32 W and (where there is a bf16
    /// unit) a bf16 W against f32 math on bf16-rounded inputs.
    #[test]
    fn lora_linear_matches_candle_ops_in_value_and_gradients_of_x_a_and_b() -> Result<()> {
        let dev = Device::Cpu;
        let (n, i, o, r) = (37, 70, 50, 4);
        let vals = |len: usize, m: usize, k: usize| (0..len).map(move |v| ((v * m % k) as f32 - (k / 2) as f32) * 0.03).collect::<Vec<_>>();
        let w32 = Tensor::from_vec(vals(o * i, 5, 11), (o, i), &dev)?;
        let g = Tensor::from_vec(vals(n * o, 7, 9), (n, o), &dev)?;
        let mask: Vec<f32> = (0..n * i).map(|v| if v % 7 == 3 { 0.0 } else { 1.25 }).collect();
        let mut weights = vec![("f32", w32.clone())];
        if crate::bf16_gemm::available() {
            weights.push(("bf16", w32.to_dtype(DType::BF16)?));
        }
        for (wname, w) in &weights {
            for masked in [false, true] {
                let x = Var::from_vec(vals(n * i, 17, 13), (n, i), &dev)?;
                let a = Var::from_vec(vals(r * i, 3, 7), (r, i), &dev)?;
                let b = Var::from_vec(vals(o * r, 11, 5), (o, r), &dev)?;
                let m = masked.then(|| mask.clone());
                let got = lora_linear(x.as_tensor(), w, a.as_tensor(), b.as_tensor(), 2.0, m.clone())?;
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

    /// The fused MLP half equals the separate ops it replaces (rms_norm, frozen_linear x3,
    /// swiglu, residual add) bit for bit, in value and in x's gradient: same kernels, and each
    /// gradient sum has two terms. For an f32 W and, with a bf16 unit, a bf16 W.
    #[test]
    fn frozen_mlp_residual_equals_the_separate_ops_in_value_and_input_gradient() -> Result<()> {
        let dev = Device::Cpu;
        let (n, h, i) = (37, 24, 70);
        let vals = |len: usize, m: usize, k: usize| (0..len).map(move |v| ((v * m % k) as f32 - (k / 2) as f32) * 0.05).collect::<Vec<_>>();
        let norm = Tensor::from_vec(vals(h, 3, 7).iter().map(|v| 1.0 + v).collect::<Vec<_>>(), h, &dev)?;
        let g = Tensor::from_vec(vals(n * h, 7, 9), (n, h), &dev)?;
        let mut dtypes = vec![DType::F32];
        if crate::bf16_gemm::available() {
            dtypes.push(DType::BF16);
        }
        for dt in dtypes {
            let gate = Tensor::from_vec(vals(i * h, 5, 11), (i, h), &dev)?.to_dtype(dt)?;
            let up = Tensor::from_vec(vals(i * h, 13, 17), (i, h), &dev)?.to_dtype(dt)?;
            let down = Tensor::from_vec(vals(h * i, 11, 13), (h, i), &dev)?.to_dtype(dt)?;
            let x = Var::from_vec(vals(n * h, 17, 19), (n, h), &dev)?;
            let got = frozen_mlp_residual(x.as_tensor(), &norm, 1e-5, &gate, &up, &down)?.expect("fused on cpu");
            let nx = rms_norm(x.as_tensor(), &norm, 1e-5)?;
            let m = frozen_linear(&swiglu(&frozen_linear(&nx, &gate)?, &frozen_linear(&nx, &up)?)?, &down)?;
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

#[cfg(test)]
mod fused_tests {
    use super::*;
    use candle_core::Var;

    fn pseudo(n: usize, seed: usize) -> Vec<f32> {
        (0..n).map(|i| (((i * 2654435761 + seed * 97) % 1000) as f32 / 1000.0 - 0.5) * 2.0).collect()
    }

    /// Value and input gradient of `fused(x)` against `generic(x)`, as max abs differences.
    fn compare(shape: &[usize], fused: impl Fn(&Tensor) -> Result<Tensor>, generic: impl Fn(&Tensor) -> Result<Tensor>) -> Result<(f32, f32)> {
        let n: usize = shape.iter().product();
        let x = Var::from_vec(pseudo(n, 1), shape, &Device::Cpu)?;
        let (a, b) = (fused(&x)?, generic(&x)?);
        let g = Tensor::from_vec(pseudo(a.elem_count(), 2), a.shape(), &Device::Cpu)?;
        let dv = (&a - &b)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let ga = (a * &g)?.sum_all()?.backward()?.get(&x).expect("grad").clone();
        let gb = (b * &g)?.sum_all()?.backward()?.get(&x).expect("grad").clone();
        Ok((dv, (ga - gb)?.abs()?.max_all()?.to_scalar::<f32>()?))
    }

    #[test]
    fn fast_exp_is_within_two_ulp_of_libm_on_its_range() {
        let mut worst = 0f32;
        for i in 0..=4_000_000 {
            let x = -87.0 + 175.0 * i as f32 / 4_000_000.0;
            let (a, b) = (exp_f32(x), x.exp());
            worst = worst.max((a - b).abs() / b);
        }
        println!("fast exp: max relative error {worst:.2e} on [-87, 88]");
        assert!(worst < 2.5e-7, "{worst}");
        let x: Vec<f32> = pseudo(1001, 9);
        let d = (sum_f32(&x) as f64 - x.iter().map(|&v| v as f64).sum::<f64>()).abs();
        assert!(d < 1e-4, "sum off by {d}");
    }

    #[test]
    fn fused_rms_norm_matches_the_generic_path() -> Result<()> {
        let w = Tensor::from_vec(pseudo(24, 3), 24, &Device::Cpu)?;
        let (dv, dg) = compare(&[2, 5, 24], |x| rms_norm(x, &w, 1e-5), |x| rms_norm_generic(x, &w, 1e-5))?;
        println!("rms_norm fused vs generic: value {dv:.1e}, grad {dg:.1e}");
        assert!(dv < 1e-6 && dg < 1e-5, "value {dv}, grad {dg}");
        Ok(())
    }

    #[test]
    fn fused_swiglu_matches_the_generic_path_for_both_inputs() -> Result<()> {
        let u = Var::from_vec(pseudo(5000, 4), (50, 100), &Device::Cpu)?;
        let (dv, dg) = compare(&[50, 100], |g| swiglu(g, &u), |g| g.silu()? * u.as_tensor())?;
        let g = Tensor::from_vec(pseudo(5000, 5), (50, 100), &Device::Cpu)?;
        let (du_dv, du_dg) = compare(&[50, 100], |u| swiglu(&g, u), |u| g.silu()? * u)?;
        println!("swiglu fused vs generic: value {dv:.1e}, grad gate {dg:.1e}, grad up {du_dg:.1e}");
        assert!(dv < 1e-6 && dg < 1e-6 && du_dv < 1e-6 && du_dg < 1e-6);
        Ok(())
    }

    #[test]
    fn fused_rope_heads_matches_transpose_then_rope() -> Result<()> {
        let (b, s, n, d) = (2, 7, 3, 8);
        let positions: Vec<Vec<u32>> = vec![(0..7).collect(), vec![0, 1, 2, 0, 1, 2, 3]];
        let (cos, sin) = rope_tables(&positions, &[1.0, 0.1, 0.01, 0.001], &Device::Cpu, DType::F32)?;
        let (dv, dg) = compare(&[b, s, n, d], |x| rope_heads(x, &cos, &sin), |x| rope(&x.transpose(1, 2)?.contiguous()?, &cos, &sin))?;
        println!("rope_heads fused vs generic: value {dv:.1e}, grad {dg:.1e}");
        assert!(dv < 1e-6 && dg < 1e-6, "value {dv}, grad {dg}");
        // The projection's own [B*S, N*D] layout gives the same.
        let (dv, dg) = compare(&[b * s, n * d], |x| rope_heads(x, &cos, &sin), |x| rope(&x.reshape((b, s, n, d))?.transpose(1, 2)?.contiguous()?, &cos, &sin))?;
        assert!(dv < 1e-6 && dg < 1e-6, "2-D input: value {dv}, grad {dg}");
        Ok(())
    }

    #[test]
    fn split_and_merge_heads_match_reshape_and_transpose_in_value_and_gradient() -> Result<()> {
        let (b, s, n, d) = (2, 5, 3, 4);
        let (dv, dg) = compare(&[b * s, n * d], |x| split_heads(x, b, s, n), |x| x.reshape((b, s, n, d))?.transpose(1, 2)?.contiguous())?;
        assert!(dv == 0.0 && dg == 0.0, "split: value {dv}, grad {dg}");
        let (dv, dg) = compare(&[b, n, s, d], merge_heads, |x| x.transpose(1, 2)?.reshape((b * s, n * d)))?;
        assert!(dv == 0.0 && dg == 0.0, "merge: value {dv}, grad {dg}");
        Ok(())
    }
}
