//! Differentiable building blocks, one file per op family, and the one place that picks
//! which version of each runs ([`dispatch`]).
//!
//! Every family has up to three versions side by side in its file:
//! - the fused CPU kernel: one candle custom op over f32 slices (rayon, the gemm crate, the
//!   CPU's bf16 unit) with a hand-written backward;
//! - the portable version: candle ops, plus custom-op nodes whose forward calls the backend
//!   (`BackendStorage`) and whose backward is written in tensor ops. It is what CUDA and any
//!   other device run, and what `model.kernels = "portable"` runs on CPU;
//! - a CUDA forward where the op has its own node (`linear::FrozenMatmul`, the portable
//!   attention node), through the same backend call.
//!
//! Call sites pass the recipe's [`Kernels`] and never look at the device: [`Kernels::pick`]
//! does. ARCHITECTURE.md tabulates, per op, what runs on CPU f32, CPU bf16 and CUDA, and what
//! each version is tested against.
//!
//! Why not candle's own fused ops: `softmax_last_dim`, `rms_norm` and `rotary_emb::rope` have
//! no backward (autograd silently treats them as constants, see shared/CANDLE-FACTS.md).

pub mod attention;
pub mod bf16_gemm;
pub mod checkpoint;
pub(crate) mod cpu_bf16;
pub mod dispatch;
pub mod experts;
mod gemm;
pub mod linear;
pub mod loss;
pub mod mla;
pub mod mlp;
pub mod norm;
pub mod rope;
mod few_rows;
mod widen;

pub use attention::{causal_attention, causal_mask, KeyStarts};
pub use dispatch::{Kernels, Op, Path};
pub use experts::routed_experts;
pub(crate) use gemm::sgemm;
pub use linear::{frozen_linear, frozen_linear_kept, lora_linear};
pub use mlp::{frozen_mlp_residual, swiglu};
pub use norm::rms_norm;
pub use rope::{merge_head_cols, merge_heads, rope_heads, rope_tables, split_heads};

use candle_core::{DType, Result, Tensor, D};

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
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 1.666_666_5e-1) * r + 5e-1;
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

/// Σ a_i b_i with eight running sums, as [`sum_f32`].
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(&x, &y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
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

/// An f32 buffer that parallel tasks write disjoint parts of (attention strips, GEMM tiles):
/// the one place a `&mut` buffer is shared across rayon tasks.
///
/// SAFETY contract, for every user:
/// - the buffer outlives every access: [`Shared::new`] and [`Shared::uninit`] borrow it
///   mutably for `'a`, so it can be neither used directly, moved, nor freed meanwhile;
/// - each element is accessed by at most one task at a time: tasks write disjoint ranges
///   (`rows`, `ptr_at`), and nobody reads a range another task may be writing;
/// - every range lies inside the buffer: `len` travels with the pointer, and each access
///   checks `at + len <= self.len` in debug builds (`debug_assert!`), so a wrong index in a
///   kernel's block arithmetic fails a debug test instead of writing out of bounds.
#[derive(Clone, Copy)]
pub(crate) struct Shared<'a> {
    ptr: *mut f32,
    /// Elements behind `ptr`.
    len: usize,
    _buf: std::marker::PhantomData<&'a mut [f32]>,
}

// SAFETY: sending or sharing the handle is what it is for; the contract above (disjoint
// ranges, each checked to be inside the buffer) is what makes the accesses sound.
unsafe impl Send for Shared<'_> {}
unsafe impl Sync for Shared<'_> {}

impl<'a> Shared<'a> {
    pub(crate) fn new(buf: &'a mut [f32]) -> Self {
        Shared { ptr: buf.as_mut_ptr(), len: buf.len(), _buf: std::marker::PhantomData }
    }

    /// Over not-yet-initialised capacity (an output every element of which the tasks store
    /// before anyone reads it); only raw pointers ([`Shared::ptr_at`]) may touch it.
    pub(crate) fn uninit(buf: &'a mut [std::mem::MaybeUninit<f32>]) -> Self {
        Shared { ptr: buf.as_mut_ptr().cast(), len: buf.len(), _buf: std::marker::PhantomData }
    }

    /// Elements `at..at + len` as a slice.
    ///
    /// # Safety
    /// `at..at + len` is inside the buffer (checked in debug builds), initialised, and no
    /// other task touches it while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn rows(&self, at: usize, len: usize) -> &mut [f32] {
        // SAFETY: the caller's contract; the bounds are also checked in debug builds.
        unsafe { std::slice::from_raw_parts_mut(self.ptr_at(at, len), len) }
    }

    /// Is `at..at + len` inside the buffer (without overflowing)?
    fn in_bounds(&self, at: usize, len: usize) -> bool {
        at.checked_add(len).is_some_and(|end| end <= self.len)
    }

    /// A pointer to element `at`, for a kernel that will access `at..at + len` through it
    /// (a C block of rows with a stride: `len` spans its first to its last element).
    ///
    /// # Safety
    /// `at..at + len` is inside the buffer (checked in debug builds) and no other task
    /// touches the elements written through the pointer while it is used (a strided block's
    /// span may hold other tasks' columns between its rows).
    pub(crate) unsafe fn ptr_at(&self, at: usize, len: usize) -> *mut f32 {
        debug_assert!(self.in_bounds(at, len), "Shared: elements {at}..{} of a buffer of {}", at.saturating_add(len), self.len);
        // SAFETY: `at <= self.len` (the caller's contract), so the offset stays inside (or
        // one past) the allocation.
        unsafe { self.ptr.add(at) }
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
/// f32 rows of a contiguous CPU tensor, or an error naming the op.
pub(crate) fn cpu_f32<'a>(op: &str, storage: &'a candle_core::CpuStorage, layout: &candle_core::Layout) -> Result<&'a [f32]> {
    let candle_core::CpuStorage::F32(x) = storage else { candle_core::bail!("{op}: f32 only") };
    let Some((a, b)) = layout.contiguous_offsets() else { candle_core::bail!("{op}: input must be contiguous") };
    Ok(&x[a..b])
}

/// A host copy of a tensor's elements in f32 (for custom-op backwards).
pub(crate) fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
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
/// result, so it needs no gradient (saves a backward through `max`).
pub fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    let s = e.sum_keepdim(D::Minus1)?;
    e.broadcast_div(&s)
}
/// A scalar whose backward hands `g` to `y` as its gradient, unchanged: the root a layer's
/// (or the head's) backward starts from when the upstream gradient is already known.
/// `(y * g).sum_all()` gave the same gradient through candle's generic backward, which for
/// the product alone ran two multiplies, and zeroed three buffers and added into them, each
/// the size of `y` (candle computes both operands' gradients, and every gradient it
/// accumulates starts as a zeroed buffer): a tenth of a step's backward at 4 x 512. The
/// scalar's value is 0 (never read).
pub fn pullback(y: &Tensor, g: &Tensor) -> Result<Tensor> {
    if y.shape() != g.shape() {
        candle_core::bail!("pullback: gradient {:?} for a tensor of {:?}", g.shape(), y.shape());
    }
    y.apply_op1(Pullback(g.clone()))
}

struct Pullback(Tensor);

impl candle_core::CustomOp1 for Pullback {
    fn name(&self) -> &'static str {
        "pullback"
    }

    fn cpu_fwd(&self, _: &candle_core::CpuStorage, _: &candle_core::Layout) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        Ok((candle_core::CpuStorage::F32(vec![0.0]), candle_core::Shape::from(())))
    }

    fn cuda_fwd(&self, s: &candle_core::CudaStorage, _: &candle_core::Layout) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        use candle_core::backend::{BackendDevice, BackendStorage};
        Ok((s.device().zeros_impl(&candle_core::Shape::from(()), DType::F32)?, candle_core::Shape::from(())))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, _: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(self.0.clone()))
    }
}

/// a += b, elementwise, in parallel chunks.
pub(crate) fn add_into(a: &mut [f32], b: &[f32]) {
    use rayon::prelude::*;
    a.par_chunks_mut(1 << 14).zip(b.par_chunks(1 << 14)).for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(x, y)| *x += y));
}

#[cfg(test)]
pub(crate) mod testutil {
    use candle_core::{Device, Result, Tensor, Var};

    /// Deterministic values in [-1, 1).
    pub fn pseudo(n: usize, seed: usize) -> Vec<f32> {
        (0..n).map(|i| (((i * 2654435761 + seed * 97) % 1000) as f32 / 1000.0 - 0.5) * 2.0).collect()
    }

    /// Value and input gradient of `a(x)` against `b(x)`, as max abs differences.
    pub fn compare(shape: &[usize], a: impl Fn(&Tensor) -> Result<Tensor>, b: impl Fn(&Tensor) -> Result<Tensor>) -> Result<(f32, f32)> {
        let n: usize = shape.iter().product();
        let x = Var::from_vec(pseudo(n, 1), shape, &Device::Cpu)?;
        let (ya, yb) = (a(&x)?, b(&x)?);
        let g = Tensor::from_vec(pseudo(ya.elem_count(), 2), ya.shape(), &Device::Cpu)?;
        let dv = (&ya - &yb)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let ga = (ya * &g)?.sum_all()?.backward()?.get(&x).expect("grad").clone();
        let gb = (yb * &g)?.sum_all()?.backward()?.get(&x).expect("grad").clone();
        Ok((dv, (ga - gb)?.abs()?.max_all()?.to_scalar::<f32>()?))
    }

    /// Max |a - b| in f32, whatever the dtypes.
    pub fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        let f = |t: &Tensor| t.to_dtype(candle_core::DType::F32);
        (f(a)? - f(b)?)?.abs()?.max_all()?.to_scalar::<f32>()
    }

    /// GFLOP/s of a GEMM of m x k x n run by `f`: one warm-up call, then as many calls as make
    /// about 4 GFLOP, timed together (speed tests run by hand).
    pub fn gemm_gflops((m, k, n): (usize, usize, usize), f: &dyn Fn()) -> f64 {
        let flop = 2.0 * (m * k * n) as f64;
        let reps = (4e9 / flop).ceil() as usize;
        f();
        let t = std::time::Instant::now();
        for _ in 0..reps {
            f();
        }
        flop * reps as f64 / t.elapsed().as_secs_f64() / 1e9
    }

    /// A bf16 value per element (the bits of pseudo-random f32s, truncated) and its f32.
    pub fn bf16_weight(len: usize, seed: usize) -> (Vec<u16>, Vec<f32>) {
        let bits: Vec<u16> = pseudo(len, seed).iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let vals = bits.iter().map(|&b| f32::from_bits((b as u32) << 16)).collect();
        (bits, vals)
    }

    /// A frozen matmul's result `got` [n, cols] = x [n, k] · B, B[kk, j] = w[kk·rs + j·cs], held
    /// to the f64 product: no further from it than the gemm crate's f32 GEMM of the same
    /// operands, to within a quarter (rounding a single operand to bf16 would be hundreds of
    /// times further). Returns both errors.
    pub fn assert_f32_math(got: &[f32], x: &[f32], w: &[f32], (n, k, cols): (usize, usize, usize), (rs, cs): (usize, usize), what: &str) -> (f64, f64) {
        let mut f32_gemm = vec![0f32; n * cols];
        super::sgemm(n, cols, k, &mut f32_gemm, cols, false, x, k, 1, w, rs, cs, 1.0, 2);
        let exact = |i: usize, j: usize| (0..k).map(|kk| x[i * k + kk] as f64 * w[kk * rs + j * cs] as f64).sum::<f64>();
        let (mut e_got, mut e_f32) = (0f64, 0f64);
        for i in 0..n {
            for j in 0..cols {
                let e = exact(i, j);
                e_got = e_got.max((got[i * cols + j] as f64 - e).abs());
                e_f32 = e_f32.max((f32_gemm[i * cols + j] as f64 - e).abs());
            }
        }
        assert!(e_got <= 1.25 * e_f32 + 1e-6, "{what}: {e_got:e} from the f64 product, the f32 gemm {e_f32:e}");
        (e_got, e_f32)
    }
}

#[cfg(test)]
mod tests {
    use super::testutil::pseudo;
    use super::*;
    use candle_core::Device;

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
    fn shared_hands_out_disjoint_ranges_and_knows_which_ranges_are_inside_its_buffer() {
        use rayon::prelude::*;
        let mut buf = vec![0f32; 10];
        let s = Shared::new(&mut buf);
        assert!(s.in_bounds(0, 10) && s.in_bounds(8, 2) && s.in_bounds(10, 0));
        assert!(!s.in_bounds(9, 2) && !s.in_bounds(11, 0) && !s.in_bounds(usize::MAX, 2), "past the end, or overflowing");
        // SAFETY: the five ranges 2i..2i + 2 are disjoint and inside the 10 elements.
        (0..5).into_par_iter().for_each(|i| unsafe { s.rows(2 * i, 2) }.fill(i as f32));
        assert_eq!(buf, [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0]);
    }

    /// The check is a `debug_assert!`: release builds (`make test`) skip it, and this test;
    /// `make test-checked` (CI) runs both.
    #[test]
    #[cfg_attr(not(debug_assertions), ignore = "the bounds check is a debug assertion: `make test-checked` runs it")]
    #[should_panic(expected = "Shared: elements 9..11 of a buffer of 10")]
    fn shared_stops_an_access_past_the_end_of_its_buffer_in_debug_builds() {
        let mut buf = vec![0f32; 10];
        let s = Shared::new(&mut buf);
        // SAFETY: not safe, which is the point: the debug check must panic before the write.
        unsafe { s.rows(9, 2) }.fill(1.0);
    }

    #[test]
    fn softmax_last_rows_sum_to_one() -> Result<()> {
        let x = Tensor::new(&[[1f32, 2.0, f32::NEG_INFINITY], [0.5, 0.5, 0.5]], &Device::Cpu)?;
        let s: Vec<f32> = softmax_last(&x)?.sum(D::Minus1)?.to_vec1()?;
        assert!(s.iter().all(|v| (v - 1.0).abs() < 1e-6));
        Ok(())
    }
}
