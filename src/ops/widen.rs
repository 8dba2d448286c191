//! The frozen matmul of a bf16 weight on a CPU without a bf16 unit (AVX2-only, AVX-512F):
//! f32 math on the weight's exact values, the bf16 bits widened to f32 a block of output
//! columns at a time, right before the f32 GEMM reads the block.
//!
//! Why: a checkpoint stored in bf16 (the hub's SmolLM2, DeepSeek-V2-Lite, ...) then stays
//! bf16 in memory, half of an f32 copy, and the GEMM reads half the bytes from memory, while
//! every product and sum is the f32 one: bf16 -> f32 is exact, so the result is the f32
//! GEMM of the same values (what PyTorch computes after loading that checkpoint in f32).
//! Widening the whole weight first would write and re-read an f32 copy of it; a block of at
//! most [`BLOCK_FLOATS`] is written where the GEMM finds it in cache. On few rows (an
//! expert's tokens) `few_rows`'s kernels read the bf16 weight where it lies instead.
//!
//! Dimension legend: C [N, cols] = X [N, k] · B [k, cols], W [out, in] bf16.
//!   forward (x · Wᵀ): k = in, cols = out, B[kk, j] = W[j, kk]: a block of columns of B is
//!     a block of rows of W, contiguous;
//!   input gradient (g · W): k = out, cols = in, B[kk, j] = W[kk, j]: a block of columns of
//!     B is a strip of W's columns, one short run per row.

use super::few_rows::Element;
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
    // `few_rows::gemm` checks the shapes (and `blocked` again, for its direct callers).
    if let Some(c) = super::few_rows::gemm(x, n, bits, (out, inp), input_grad, threads) {
        return c;
    }
    blocked(x, n, bits, (out, inp), input_grad, threads)
}

/// [`gemm`] on the gemm crate: B widened a block of columns at a time.
pub(super) fn blocked(x: &[f32], n: usize, bits: &[u16], (out, inp): (usize, usize), input_grad: bool, threads: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let (k, cols) = if input_grad { (out, inp) } else { (inp, out) };
    assert!(x.len() == n * k && bits.len() == out * inp, "widened gemm: x {} for [{n}, {k}], W {} for [{out}, {inp}]", x.len(), bits.len());
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
                    u16::to_f32s(&bits[kk * inp + j0..][..wb], &mut s[kk * wb..][..wb]);
                }
                (wb, 1)
            } else {
                u16::to_f32s(&bits[j0 * inp..][..wb * inp], s);
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

/// Columns per block: at most [`BLOCK_FLOATS`] widened floats, a multiple of 16 (two AVX2
/// registers of a row of B), and as many blocks as keep every thread busy to the end.
fn block_width(k: usize, cols: usize, threads: usize) -> usize {
    let widest = (BLOCK_FLOATS / k).max(16) / 16 * 16;
    let threads = threads.max(1);
    let blocks = cols.div_ceil(widest).div_ceil(threads) * threads;
    cols.div_ceil(blocks).next_multiple_of(16).min(widest)
}


#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{assert_f32_math, bf16_weight};

    /// The claim of the module: f32 math on the weight's exact values, in both directions,
    /// on shapes of one block, several blocks, and a ragged last block. Bits can differ from
    /// one f32 GEMM over all columns (the gemm crate picks its K blocking from the whole
    /// shape), so both are held to the f64 product: the widened one no further from it than
    /// the whole f32 GEMM is, to within a quarter (rounding a single operand to bf16 would be
    /// hundreds of times further).
    #[test]
    fn widened_bf16_weights_give_f32_math_on_their_exact_values() {
        // The blocked path on every shape (where the CPU has AVX2 + FMA, `gemm` hands few
        // rows to `few_rows`, which has its own test): one block, several blocks, a ragged last
        // block, 1 row.
        for (n, out, inp, threads) in [(45, 300, 70, 2), (7, 1408, 2048, 2), (33, 100, 1500, 3), (1, 40, 9, 1), (64, 576, 576, 2), (200, 64, 300, 2)] {
            let (bits, w) = bf16_weight(out * inp, out + inp);
            for input_grad in [false, true] {
                let (k, cols) = if input_grad { (out, inp) } else { (inp, out) };
                let x = crate::ops::testutil::pseudo(n * k, n + k);
                let got = blocked(&x, n, &bits, (out, inp), input_grad, threads);
                let (rs, cs) = if input_grad { (inp, 1) } else { (1, inp) };
                let what = format!("[{n}, {k}] x W [{out}, {inp}] input_grad {input_grad}");
                let (e_got, e_f32) = assert_f32_math(&got, &x, &w, (n, k, cols), (rs, cs), &what);
                println!("{what}: widened {e_got:e}, f32 gemm {e_f32:e}");
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

    /// Timing only (`--ignored --nocapture`): the bf16 GEMM as training calls it (`gemm`:
    /// `few_rows` on an expert's 48 rows, the blocked widening on the rest) against the f32
    /// GEMM on an f32 copy of the same weight, on the layer shapes of the bench's models.
    #[test]
    #[ignore = "timing; run by hand"]
    fn widened_gemm_speed() {
        let threads = candle_core::utils::get_num_threads();
        for (n, out, inp) in [(48, 1408, 2048), (48, 2048, 1408), (512, 576, 576), (512, 1536, 576), (512, 576, 1536), (2048, 1536, 576)] {
            let (bits, w) = crate::ops::testutil::bf16_weight(out * inp, 3);
            for input_grad in [false, true] {
                let (k, cols) = if input_grad { (out, inp) } else { (inp, out) };
                let x = crate::ops::testutil::pseudo(n * k, 5);
                let (rs, cs) = if input_grad { (inp, 1) } else { (1, inp) };
                let time = |f: &dyn Fn()| crate::ops::testutil::gemm_gflops((n, k, cols), f);
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
                println!("[{n}, {k}] x [{k}, {cols}] ({}): bf16 gemm {wide:.0} GFLOP/s, f32 {f32g:.0}, f32 split like widened {split:.0}", if input_grad { "g·W" } else { "x·Wᵀ" });
            }
        }
    }
}
