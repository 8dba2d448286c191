//! The frozen matmul of a bf16 weight on a CPU without a bf16 unit (AVX2-only, AVX-512F):
//! f32 math on the weight's exact values, the bf16 bits widened to f32 a block of output
//! columns at a time, right before the f32 GEMM reads the block.
//!
//! Why: a checkpoint stored in bf16 (the hub's SmolLM2, DeepSeek-V2-Lite, ...) then stays
//! bf16 in memory, half of an f32 copy, and the GEMM reads half the bytes from memory, while
//! every product and sum is the f32 one: bf16 -> f32 is exact, so the result is the f32
//! GEMM of the same values (what PyTorch computes after loading that checkpoint in f32).
//! Widening the whole weight first would write and re-read an f32 copy of it; a block of at
//! most [`BLOCK_FLOATS`] is written where the GEMM finds it in cache.
//!
//! Dimension legend: C [N, cols] = X [N, k] · B [k, cols], W [out, in] bf16.
//!   forward (x · Wᵀ): k = in, cols = out, B[kk, j] = W[j, kk]: a block of columns of B is
//!     a block of rows of W, contiguous;
//!   input gradient (g · W): k = out, cols = in, B[kk, j] = W[kk, j]: a block of columns of
//!     B is a strip of W's columns, one short run per row.

use super::gemm::{extent, sgemm_ptr};
use super::Shared;

/// Widened floats per block: 256 KB, which stays in a core's L2 (512 KB on the AMD EPYCs
/// and Intel Xeons our machines have had) beside the GEMM's packed operands. (Blocks growing
/// with the rows, to 4 MB at 2048, so that the GEMM packs x fewer times, measured slower at
/// 1 x 512 on an AVX2 EPYC in three paired runs of three.)
const BLOCK_FLOATS: usize = 1 << 16;

thread_local! {
    /// Each worker's block buffer, reused across calls rather than allocated per block.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// x [n, k] · B for a frozen bf16 W [out, in] given as its `bits`: x · Wᵀ -> [n, out]
/// (`input_grad` false) or g · W -> [n, in] (true), on `threads` threads.
pub(crate) fn gemm(x: &[f32], n: usize, bits: &[u16], (out, inp): (usize, usize), input_grad: bool, threads: usize) -> Vec<f32> {
    let k = if input_grad { out } else { inp };
    assert!(x.len() == n * k && bits.len() == out * inp, "widened gemm: x {} for [{n}, {k}], W {} for [{out}, {inp}]", x.len(), bits.len());
    if in_place::available() {
        if input_grad && (1..=GRAD_ROWS_MAX).contains(&n) {
            return in_place::input_grad(x, n, bits, (out, inp), threads);
        }
        if !input_grad && (FEW_ROWS_MIN..=FEW_ROWS_MAX).contains(&n) {
            return in_place::forward(x, n, bits, (out, inp), threads);
        }
    }
    blocked(x, n, bits, (out, inp), input_grad, threads)
}

/// [`gemm`] on the gemm crate: B widened a block of columns at a time.
fn blocked(x: &[f32], n: usize, bits: &[u16], (out, inp): (usize, usize), input_grad: bool, threads: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let (k, cols) = if input_grad { (out, inp) } else { (inp, out) };
    debug_assert!(x.len() == n * k);
    let mut dst = super::zeros_f32(n * cols);
    if n == 0 || cols == 0 || k == 0 {
        return dst;
    }
    let width = block_width(k, cols, threads);
    let c = Shared::new(&mut dst);
    (0..cols.div_ceil(width)).into_par_iter().for_each(|b| {
        let j0 = b * width;
        let wb = width.min(cols - j0);
        SCRATCH.with_borrow_mut(|s| {
            s.resize(wb * k, 0.0);
            // The block of B as [k, wb] (rs = 1, cs = k: rows of W) or [k, wb] (rs = wb, cs = 1).
            let (rs, cs) = if input_grad {
                for kk in 0..out {
                    widen(&bits[kk * inp + j0..][..wb], &mut s[kk * wb..][..wb]);
                }
                (wb, 1)
            } else {
                widen(&bits[j0 * inp..][..wb * inp], s);
                (1, inp)
            };
            // SAFETY: block b writes columns j0..j0 + wb of every row of dst, which no other
            // block touches, and `extent` of that block lies inside dst (j0 + wb <= cols).
            unsafe {
                let at = c.ptr_at(j0, extent(n, cols, wb, 1));
                sgemm_ptr(n, wb, k, at, cols, false, x, k, 1, s, rs, cs, 1.0, 1);
            }
        });
    });
    dst
}

/// Rows of x for which the forward reads W where it lies ([`in_place`]): an expert's tokens
/// (48 on average for DeepSeek-V2-Lite at 512 tokens). Below 16 a panel of 16 would be mostly
/// padding; above 128 the packed path is as fast (measured on layer shapes, 512 rows).
const FEW_ROWS_MIN: usize = 16;
const FEW_ROWS_MAX: usize = 128;

/// Most rows of g for which the input gradient takes [`in_place::input_grad`] (from one row:
/// its panels are 6 rows). On a DeepSeek-V2-Lite expert's W (1408 x 2048), two threads of an
/// AVX2 EPYC, against the blocked path (`widened_gemm_speed`, two runs): 4 rows 50 against
/// 44-45 GFLOP/s, 12 rows 101-107 against 88-92, 48 rows 147-153 against 133-134, 256 rows
/// 163 against 154-155, and 164 for both at 512.
const GRAD_ROWS_MAX: usize = 256;

/// The forward x · Wᵀ on few rows, computed as Cᵀ = W · xᵀ: W's bf16 rows are widened six at a
/// time into a contiguous f32 scratch (no packing of W), xᵀ is packed once per call into panels
/// of 16 rows of x, and an AVX2 + FMA kernel computes a 6 x 16 tile of Cᵀ and stores it
/// transposed. Why: with 48 rows the gemm crate ran an expert's gate/up forward
/// (48 x 2048 x 1408) at 55 GFLOP/s on two threads of an AVX2 EPYC (MKL 79); this ran it at 86
/// (103 against 83 for the down projection's 48 x 1408 x 2048). k is summed in runs of
/// [`in_place::K_RUN`] added into the tile, an order of rounding error like the gemm crate's.
/// The input gradient g · W on the same rows has a kernel of its own here
/// ([`in_place::input_grad`]).
mod in_place {
    use super::super::gemm::extent;
    use super::super::Shared;

    /// k per accumulator run (see the module note).
    pub(super) const K_RUN: usize = 256;
    const MR: usize = 6;
    const NR: usize = 16;

    thread_local! {
        /// Each worker's six widened rows of W.
        static ROWS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    pub(super) fn available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            *OK.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// The rows of x [n, k] as [panel][kk][width]: panel p holds rows p·width.. (p + 1)·width
    /// column by column, zero padded past n.
    fn panels(x: &[f32], k: usize, width: usize) -> Vec<f32> {
        let n = x.len() / k.max(1);
        let mut out = vec![0f32; n.div_ceil(width) * k * width];
        for (i, row) in x.chunks_exact(k).enumerate() {
            let (p, ii) = (i / width, i % width);
            for (kk, &v) in row.iter().enumerate() {
                out[(p * k + kk) * width + ii] = v;
            }
        }
        out
    }

    /// x [n, inp] · Wᵀ -> [n, out] for a bf16 W [out, inp]; only where [`available`].
    pub(super) fn forward(x: &[f32], n: usize, bits: &[u16], (out, inp): (usize, usize), threads: usize) -> Vec<f32> {
        use rayon::prelude::*;
        let k = inp;
        let mut dst = super::super::zeros_f32(n * out);
        if out == 0 || k == 0 {
            return dst;
        }
        let panels_x = n.div_ceil(NR);
        let xt = panels(x, k, NR); // xᵀ as [panel][kk][16]
        let panels_w = out.div_ceil(MR);
        // A few tasks per thread, so that one slow thread does not hold up the call.
        let per = panels_w.div_ceil(threads.max(1) * 4).max(1);
        let c = Shared::new(&mut dst);
        (0..panels_w.div_ceil(per)).into_par_iter().for_each(|t| {
            ROWS.with_borrow_mut(|w| {
                w.resize(MR * k, 0.0);
                for p in t * per..((t + 1) * per).min(panels_w) {
                    let rows = MR.min(out - p * MR);
                    // Rows past `rows` keep earlier (finite) values; their outputs are not stored.
                    super::widen(&bits[p * MR * k..][..rows * k], &mut w[..rows * k]);
                    for q in 0..panels_x {
                        let toks = NR.min(n - q * NR);
                        // SAFETY: `available` checked AVX2 + FMA; w holds MR rows of k, the
                        // panel k x NR floats; the tile's rows 16q.. x columns 6p.. of dst are
                        // this task's alone (panel p is), inside dst by `extent`.
                        unsafe {
                            let at = c.ptr_at(q * NR * out + p * MR, extent(toks, out, rows, 1));
                            tile(k, w.as_ptr(), xt[q * k * NR..].as_ptr(), at, out, rows, toks);
                        }
                    }
                }
            });
        });
        dst
    }

    /// C[i][j] = Σ_kk w[j][kk] · xt[kk][i] for j < rows (of 6), i < toks (of 16), C with row
    /// stride `ldc`: twelve 8-wide accumulators, a broadcast of W per row and two loads of xᵀ
    /// per kk; runs of K_RUN added into `total`.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile(k: usize, w: *const f32, xt: *const f32, c: *mut f32, ldc: usize, rows: usize, toks: usize) {
        use std::arch::x86_64::*;
        let mut total = [_mm256_setzero_ps(); 2 * MR];
        let mut k0 = 0;
        while k0 < k {
            let end = (k0 + K_RUN).min(k);
            let mut acc = [_mm256_setzero_ps(); 2 * MR];
            for kk in k0..end {
                // SAFETY (whole block): kk < k, so xt + kk * NR + 16 and w + j * k + kk stay
                // inside the panel and the six rows.
                let b0 = _mm256_loadu_ps(xt.add(kk * NR));
                let b1 = _mm256_loadu_ps(xt.add(kk * NR + 8));
                for j in 0..MR {
                    let a = _mm256_broadcast_ss(&*w.add(j * k + kk));
                    acc[2 * j] = _mm256_fmadd_ps(a, b0, acc[2 * j]);
                    acc[2 * j + 1] = _mm256_fmadd_ps(a, b1, acc[2 * j + 1]);
                }
            }
            for (t, a) in total.iter_mut().zip(acc) {
                *t = _mm256_add_ps(*t, a);
            }
            k0 = end;
        }
        let mut tile = [0f32; MR * NR];
        for (j, t) in total.iter().enumerate() {
            _mm256_storeu_ps(tile.as_mut_ptr().add(j * 8), *t);
        }
        for i in 0..toks {
            for j in 0..rows {
                *c.add(i * ldc + j) = tile[j * NR + i];
            }
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn tile(_: usize, _: *const f32, _: *const f32, _: *mut f32, _: usize, _: usize, _: usize) {
        unreachable!("in_place::available is false off x86_64")
    }

    /// The input gradient g [n, out] · W -> [n, inp] on few rows, for a bf16 W [out, inp]; only
    /// where [`available`]. g is packed once per call into panels of 6 rows; W is widened a
    /// [`K_RUN`] x 16 strip at a time (16 KB, in L1) and that strip serves every panel of g
    /// before the next is widened. Each thread's task is a run of adjacent strips, taken one
    /// k run at a time, so it reads W's rows k0..k0 + K_RUN over its whole run of columns:
    /// whole cache lines, front to back.
    /// Why: the blocked path hands the gemm crate 32-column blocks, and the crate packs all
    /// of g again for each (48 x 1408 floats per 32 columns of a DeepSeek-V2-Lite expert).
    pub(super) fn input_grad(g: &[f32], n: usize, bits: &[u16], (out, inp): (usize, usize), threads: usize) -> Vec<f32> {
        use rayon::prelude::*;
        let k = out;
        let mut dst = super::super::zeros_f32(n * inp);
        if inp == 0 || k == 0 {
            return dst;
        }
        let panels_g = n.div_ceil(MR);
        let gp = panels(g, k, MR); // g as [panel][kk][6]
        let strips = inp.div_ceil(NR);
        let per = strips.div_ceil(threads.max(1) * 4).max(1);
        let c = Shared::new(&mut dst);
        (0..strips.div_ceil(per)).into_par_iter().for_each(|t| {
            ROWS.with_borrow_mut(|w| {
                w.resize(K_RUN * NR, 0.0);
                for k0 in (0..k).step_by(K_RUN) {
                    let kn = K_RUN.min(k - k0);
                    for s in t * per..((t + 1) * per).min(strips) {
                        let (j0, cols) = (s * NR, NR.min(inp - s * NR));
                        // The strip as [kk][16]: W[k0 + kk, j0..j0 + cols], zero padded.
                        if cols == NR {
                            // SAFETY: `available` checked AVX2; rows k0..k0 + kn of W hold
                            // columns j0..j0 + 16, and w holds kn x 16 floats.
                            unsafe { widen_strip(bits[k0 * inp + j0..].as_ptr(), inp, kn, w.as_mut_ptr()) };
                        } else {
                            for kk in 0..kn {
                                let row = &mut w[kk * NR..][..NR];
                                super::widen(&bits[(k0 + kk) * inp + j0..][..cols], &mut row[..cols]);
                                row[cols..].fill(0.0);
                            }
                        }
                        for p in 0..panels_g {
                            let rows = MR.min(n - p * MR);
                            // SAFETY: `available` checked AVX2 + FMA; the panel holds kn x 6
                            // floats from (p * k + k0) * 6, the strip kn x 16; the tile's rows
                            // 6p.. x columns j0.. of dst are this task's alone (strip s is),
                            // inside dst by `extent`.
                            unsafe {
                                let at = c.ptr_at(p * MR * inp + j0, extent(rows, inp, cols, 1));
                                tile_add(kn, gp[(p * k + k0) * MR..].as_ptr(), w.as_ptr(), at, inp, rows, cols);
                            }
                        }
                    }
                }
            });
        });
        dst
    }

    /// dst [rows][16] f32 = 16 bf16 from each of `rows` rows `ld` apart from src, by SIMD (the
    /// bits are the top half of the f32's).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn widen_strip(src: *const u16, ld: usize, rows: usize, dst: *mut f32) {
        use std::arch::x86_64::*;
        for r in 0..rows {
            // SAFETY: the caller vouches for 16 u16 at src + r * ld and 16 f32 at dst + r * 16.
            let s = src.add(r * ld);
            let lo = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(s as *const __m128i)), 16);
            let hi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(s.add(8) as *const __m128i)), 16);
            _mm256_storeu_ps(dst.add(r * NR), _mm256_castsi256_ps(lo));
            _mm256_storeu_ps(dst.add(r * NR + 8), _mm256_castsi256_ps(hi));
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn widen_strip(_: *const u16, _: usize, _: usize, _: *mut f32) {
        unreachable!("in_place::available is false off x86_64")
    }

    /// C[i][j] += Σ_kk a[kk][i] · b[kk][j] for i < rows (of 6), j < cols (of 16), C with row
    /// stride `ldc`: twelve 8-wide accumulators, six broadcasts of a and two loads of b per kk.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile_add(k: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: usize, rows: usize, cols: usize) {
        use std::arch::x86_64::*;
        let mut acc = [_mm256_setzero_ps(); 2 * MR];
        for kk in 0..k {
            // SAFETY (whole block): kk < k, so a + kk * 6 + 6 and b + kk * 16 + 16 stay inside
            // the panel and the strip.
            let b0 = _mm256_loadu_ps(b.add(kk * NR));
            let b1 = _mm256_loadu_ps(b.add(kk * NR + 8));
            for i in 0..MR {
                let x = _mm256_broadcast_ss(&*a.add(kk * MR + i));
                acc[2 * i] = _mm256_fmadd_ps(x, b0, acc[2 * i]);
                acc[2 * i + 1] = _mm256_fmadd_ps(x, b1, acc[2 * i + 1]);
            }
        }
        if cols == NR {
            for i in 0..rows {
                let r = c.add(i * ldc);
                _mm256_storeu_ps(r, _mm256_add_ps(_mm256_loadu_ps(r), acc[2 * i]));
                _mm256_storeu_ps(r.add(8), _mm256_add_ps(_mm256_loadu_ps(r.add(8)), acc[2 * i + 1]));
            }
            return;
        }
        let mut tile = [0f32; MR * NR];
        for (i, t) in acc.iter().enumerate() {
            _mm256_storeu_ps(tile.as_mut_ptr().add(i * 8), *t);
        }
        for i in 0..rows {
            for j in 0..cols {
                *c.add(i * ldc + j) += tile[i * NR + j];
            }
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn tile_add(_: usize, _: *const f32, _: *const f32, _: *mut f32, _: usize, _: usize, _: usize) {
        unreachable!("in_place::available is false off x86_64")
    }
}

/// Columns per block: at most [`BLOCK_FLOATS`] widened floats, a multiple of 16 (two AVX2
/// registers of a row of B), and as many blocks as keep every thread busy to the end.
fn block_width(k: usize, cols: usize, threads: usize) -> usize {
    let widest = (BLOCK_FLOATS / k).max(16) / 16 * 16;
    let threads = threads.max(1);
    let blocks = cols.div_ceil(widest).div_ceil(threads) * threads;
    cols.div_ceil(blocks).next_multiple_of(16).min(widest)
}

/// bf16 bits -> f32: the bits are the top half of the f32's (exact).
fn widen(src: &[u16], dst: &mut [f32]) {
    for (d, &b) in dst.iter_mut().zip(src) {
        *d = f32::from_bits((b as u32) << 16);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::gemm::sgemm;

    /// A bf16 value per element (the bits of pseudo-random f32s, truncated) and its f32.
    pub(super) fn weight(len: usize, seed: usize) -> (Vec<u16>, Vec<f32>) {
        let bits: Vec<u16> = crate::ops::testutil::pseudo(len, seed).iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let vals = bits.iter().map(|&b| f32::from_bits((b as u32) << 16)).collect();
        (bits, vals)
    }

    /// The claim of the module: f32 math on the weight's exact values, in both directions,
    /// on shapes of one block, several blocks, and a ragged last block. Bits can differ from
    /// one f32 GEMM over all columns (the gemm crate picks its K blocking from the whole
    /// shape), so both are held to the f64 product: the widened one no further from it than
    /// the whole f32 GEMM is, to within a quarter (rounding a single operand to bf16 would be
    /// hundreds of times further).
    #[test]
    fn widened_bf16_weights_give_f32_math_on_their_exact_values() {
        // Where the CPU has AVX2 + FMA, forwards on 16-128 rows and input gradients on up to
        // 256 take the in-place kernels (45 rows x 300 outputs, 33 x 100: rows and outputs past
        // whole tiles; 70 and 1500 inputs: a last strip of 6 and of 12 columns; k of 300, 576
        // and 1500: several k runs; 7 and 1 rows: input gradients only); the rest the blocked
        // path, and 256 rows (`n` past the forward's range) both paths' results.
        for (n, out, inp, threads) in [(45, 300, 70, 2), (7, 1408, 2048, 2), (33, 100, 1500, 3), (1, 40, 9, 1), (64, 576, 576, 2), (200, 64, 300, 2)] {
            let (bits, w) = weight(out * inp, out + inp);
            for input_grad in [false, true] {
                let (k, cols) = if input_grad { (out, inp) } else { (inp, out) };
                let x = crate::ops::testutil::pseudo(n * k, n + k);
                let got = gemm(&x, n, &bits, (out, inp), input_grad, threads);
                let mut f32_gemm = vec![0f32; n * cols];
                let (rs, cs) = if input_grad { (inp, 1) } else { (1, inp) };
                sgemm(n, cols, k, &mut f32_gemm, cols, false, &x, k, 1, &w, rs, cs, 1.0, threads);
                let exact = |i: usize, j: usize| (0..k).map(|kk| x[i * k + kk] as f64 * w[kk * rs + j * cs] as f64).sum::<f64>();
                let (mut e_got, mut e_f32) = (0f64, 0f64);
                for i in 0..n {
                    for j in 0..cols {
                        let e = exact(i, j);
                        e_got = e_got.max((got[i * cols + j] as f64 - e).abs());
                        e_f32 = e_f32.max((f32_gemm[i * cols + j] as f64 - e).abs());
                    }
                }
                println!("[{n}, {k}] x W [{out}, {inp}] input_grad {input_grad}: widened {e_got:e}, f32 gemm {e_f32:e}");
                assert!(e_got <= 1.25 * e_f32 + 1e-6, "[{n}, {k}] x W [{out}, {inp}], input_grad {input_grad}: {e_got:e} from the f64 product, the f32 gemm {e_f32:e}");
            }
        }
    }

    #[test]
    fn blocks_fit_the_cache_and_split_evenly_over_threads() {
        // SmolLM2's projections (k 576): 576 columns in 2 x 3 blocks of 96.
        assert_eq!(block_width(576, 576, 2), 96);
        // A DeepSeek-V2-Lite expert's gate (k 2048): 32 columns, 256 KB.
        assert_eq!(block_width(2048, 1408, 2), 32);
        // k so long that 16 columns exceed the block: 16 anyway.
        assert_eq!(block_width(10_000, 64, 2), 16);
        for (k, cols, t) in [(70, 300, 2), (1500, 100, 3), (9, 40, 1)] {
            let w = block_width(k, cols, t);
            assert!(w.is_multiple_of(16) && (w * k <= BLOCK_FLOATS || w == 16), "k {k} cols {cols}: {w}");
        }
    }
}

#[cfg(test)]
mod speed {
    use super::*;
    use crate::ops::gemm::sgemm;

    /// Timing only (`--ignored --nocapture`): the widened bf16 GEMM against the f32 GEMM on
    /// an f32 copy of the same weight, on the layer shapes of the bench's models.
    #[test]
    #[ignore = "timing; run by hand"]
    fn widened_gemm_speed() {
        let threads = candle_core::utils::get_num_threads();
        for (n, out, inp) in [(48, 1408, 2048), (48, 2048, 1408), (512, 576, 576), (512, 1536, 576), (512, 576, 1536), (2048, 1536, 576)] {
            let (bits, w) = super::tests::weight(out * inp, 3);
            for input_grad in [false, true] {
                let (k, cols) = if input_grad { (out, inp) } else { (inp, out) };
                let x = crate::ops::testutil::pseudo(n * k, 5);
                let (rs, cs) = if input_grad { (inp, 1) } else { (1, inp) };
                let reps = (4e9 / (2.0 * (n * k * cols) as f64)).ceil() as usize;
                let time = |f: &dyn Fn()| {
                    f();
                    let t = std::time::Instant::now();
                    for _ in 0..reps {
                        f();
                    }
                    2.0 * (n * k * cols * reps) as f64 / t.elapsed().as_secs_f64() / 1e9
                };
                let wide = time(&|| drop(std::hint::black_box(gemm(&x, n, &bits, (out, inp), input_grad, threads))));
                let f32g = time(&|| {
                    let mut d = crate::ops::zeros_f32(n * cols);
                    sgemm(n, cols, k, &mut d, cols, false, &x, k, 1, &w, rs, cs, 1.0, threads);
                    std::hint::black_box(d);
                });
                // The f32 weight split into the same column blocks, one single-threaded GEMM per
                // block straight on W (no copy): is the gain the widening or the split?
                let width = block_width(k, cols, threads);
                let split = time(&|| {
                    use rayon::prelude::*;
                    let mut d = crate::ops::zeros_f32(n * cols);
                    let c = Shared::new(&mut d);
                    (0..cols.div_ceil(width)).into_par_iter().for_each(|b| {
                        let (j0, wb) = (b * width, width.min(cols - b * width));
                        let wj = if input_grad { &w[j0..] } else { &w[j0 * inp..] };
                        // SAFETY: block b writes only its own columns of d.
                        unsafe { sgemm_ptr(n, wb, k, c.ptr_at(j0, extent(n, cols, wb, 1)), cols, false, &x, k, 1, wj, rs, cs, 1.0, 1) };
                    });
                    std::hint::black_box(d);
                });
                println!("[{n}, {k}] x [{k}, {cols}] ({}): widened {wide:.0} GFLOP/s, f32 {f32g:.0}, f32 split like widened {split:.0}", if input_grad { "g·W" } else { "x·Wᵀ" });
            }
        }
        // Where the few-row kernels pay: both against the blocked path, by rows, on an expert.
        if in_place::available() {
            for n in [4, 8, 12, 16, 48, 128, 256, 512] {
                let (bits, _) = super::tests::weight(1408 * 2048, 3);
                for input_grad in [false, true] {
                    let x = crate::ops::testutil::pseudo(n * if input_grad { 1408 } else { 2048 }, 5);
                    let reps = (4e9 / (2.0 * (n * 1408 * 2048) as f64)).ceil() as usize;
                    let time = |f: &dyn Fn()| {
                        f();
                        let t = std::time::Instant::now();
                        for _ in 0..reps {
                            f();
                        }
                        2.0 * (n * 1408 * 2048 * reps) as f64 / t.elapsed().as_secs_f64() / 1e9
                    };
                    let few = time(&|| {
                        let c = if input_grad { in_place::input_grad(&x, n, &bits, (1408, 2048), threads) } else { in_place::forward(&x, n, &bits, (1408, 2048), threads) };
                        drop(std::hint::black_box(c));
                    });
                    let blk = time(&|| drop(std::hint::black_box(blocked(&x, n, &bits, (1408, 2048), input_grad, threads))));
                    println!("{n} rows, W [1408, 2048] ({}): in place {few:.0} GFLOP/s, blocked {blk:.0}", if input_grad { "g·W" } else { "x·Wᵀ" });
                }
            }
        }
    }
}
