//! The frozen matmul on few rows (an expert's tokens: 48 on average for DeepSeek-V2-Lite at
//! 512 tokens), both ways, on AVX2 + FMA kernels that read the weight where it lies, bf16
//! (widened to f32 on the way, exact) or f32.
//!
//! Why: with 48 rows the gemm crate packs the rows again for every block of the weight's
//! columns, and its blocking is built for many rows. On two threads of an AVX2 EPYC it ran a
//! DeepSeek-V2-Lite expert's gate/up forward (48 x 2048 x 1408) at 55-62 GFLOP/s (MKL 79) and
//! the input gradients at 62-86; these kernels ran 101-113 and 110-113 (`few_rows_speed`).
//! The arithmetic is the f32 FMA on the weight's exact values, as in the gemm crate;
//! k is summed in runs of [`K_RUN`] added into the tile, an order of rounding error like the
//! gemm crate's (it blocks k too), so results differ from it in the last bits only.
//!
//! Dimension legend: x [n, in] rows, g [n, out] their output gradient, W [out, in].
//!   forward  C [n, out] = x · Wᵀ, computed as Cᵀ = W · xᵀ: W's rows are widened (or copied)
//!            six at a time into a contiguous scratch, xᵀ is packed once per call into panels
//!            of 16 rows of x, a 6 x 16 tile of Cᵀ is stored transposed.
//!   input gradient C [n, in] = g · W: g is packed once per call into panels of 6 rows, W is
//!            widened a K_RUN x 16 strip at a time (16 KB, in L1), and that strip serves every
//!            panel of g before the next is widened.

use super::gemm::extent;
use super::Shared;

/// k per accumulator run (see the module note).
const K_RUN: usize = 256;
/// The tiles: MR rows of W (forward) or of g (input gradient) by NR columns.
const MR: usize = 6;
const NR: usize = 16;

/// Rows of x for which the forward takes [`forward`]. Below 16 a panel of 16 would be mostly
/// padding; above 128 the gemm crate is as fast (measured on layer shapes, 512 rows).
const FORWARD_ROWS: std::ops::RangeInclusive<usize> = 16..=128;

/// Rows of g for which the input gradient takes [`input_grad_rows`]. On a DeepSeek-V2-Lite
/// expert's W (1408 x 2048), two threads of an AVX2 EPYC (`few_rows_speed`; one run in a fast
/// spell of the VM, one in a slow one), bf16 against the blocked widening path: 12 rows
/// 101-107 against 88-92 GFLOP/s and 61 against 40, 48 rows 147-153 against 133-134 and 109
/// against 68, 256 rows 163 against 154-155 and 109 against 100, 512 rows 164 for both and
/// 105 against 103; f32 against the gemm crate, slow spell: 12 rows 53 against 39, 48 rows 97
/// against 56, 256 rows 100 against 76. At 4 and 8 rows (one or two panels of 6, each strip
/// widened for them alone) the kernel ran 30-40 against 38-53.
const GRAD_ROWS: std::ops::RangeInclusive<usize> = 12..=256;

thread_local! {
    /// Each worker's widened rows (forward) or strip (input gradient) of W.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A frozen weight's element as these kernels read it.
pub(crate) trait Element: Copy + Sync {
    /// src as f32 (exact), into a dst of the same length.
    fn to_f32s(src: &[Self], dst: &mut [f32]);

    /// dst [rows][16] f32 = the 16 elements at src + r · ld for each r < rows.
    ///
    /// # Safety
    /// The CPU has AVX2; src + r · ld .. + 16 and dst .. + rows · 16 are in bounds for each r.
    unsafe fn strip16(src: *const Self, ld: usize, rows: usize, dst: *mut f32);
}

/// bf16, as its bits: the top half of the f32's.
impl Element for u16 {
    fn to_f32s(src: &[u16], dst: &mut [f32]) {
        debug_assert_eq!(src.len(), dst.len());
        for (d, &b) in dst.iter_mut().zip(src) {
            *d = f32::from_bits((b as u32) << 16);
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn strip16(src: *const u16, ld: usize, rows: usize, dst: *mut f32) {
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
    unsafe fn strip16(_: *const u16, _: usize, _: usize, _: *mut f32) {
        unreachable!("few_rows::available is false off x86_64")
    }
}

impl Element for f32 {
    fn to_f32s(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    unsafe fn strip16(src: *const f32, ld: usize, rows: usize, dst: *mut f32) {
        for r in 0..rows {
            // SAFETY: as the trait's contract.
            std::ptr::copy_nonoverlapping(src.add(r * ld), dst.add(r * NR), NR);
        }
    }
}

/// Whether the CPU runs these kernels (AVX2 + FMA).
fn available() -> bool {
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

/// x [n, k] · B for a frozen W [out, inp]: x · Wᵀ -> [n, out] (`input_grad` false) or
/// g · W -> [n, inp] (true), on `threads` threads; `None` where these kernels do not run (the
/// CPU, or n outside their range), and the caller takes its general GEMM.
pub(crate) fn gemm<E: Element>(x: &[f32], n: usize, w: &[E], (out, inp): (usize, usize), input_grad: bool, threads: usize) -> Option<Vec<f32>> {
    let k = if input_grad { out } else { inp };
    assert!(x.len() == n * k && w.len() == out * inp, "few-rows gemm: x {} for [{n}, {k}], W {} for [{out}, {inp}]", x.len(), w.len());
    if !available() {
        return None;
    }
    match input_grad {
        true if GRAD_ROWS.contains(&n) => Some(input_grad_rows(x, n, w, (out, inp), threads)),
        false if FORWARD_ROWS.contains(&n) => Some(forward(x, n, w, (out, inp), threads)),
        _ => None,
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

/// x [n, inp] · Wᵀ -> [n, out]; only where [`available`].
fn forward<E: Element>(x: &[f32], n: usize, w: &[E], (out, inp): (usize, usize), threads: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let k = inp;
    let mut dst = super::zeros_f32(n * out);
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
        SCRATCH.with_borrow_mut(|rows_f32| {
            rows_f32.resize(MR * k, 0.0);
            for p in t * per..((t + 1) * per).min(panels_w) {
                let rows = MR.min(out - p * MR);
                // Rows past `rows` keep stale values: each row's accumulators are its own, and
                // those rows' outputs are not stored.
                E::to_f32s(&w[p * MR * k..][..rows * k], &mut rows_f32[..rows * k]);
                for q in 0..panels_x {
                    let toks = NR.min(n - q * NR);
                    // SAFETY: `available` checked AVX2 + FMA; rows_f32 holds MR rows of k, the
                    // panel k x NR floats; the tile's rows 16q.. x columns 6p.. of dst are this
                    // task's alone (panel p is), inside dst by `extent`.
                    unsafe {
                        let at = c.ptr_at(q * NR * out + p * MR, extent(toks, out, rows, 1));
                        tile_t(k, rows_f32.as_ptr(), xt[q * k * NR..].as_ptr(), at, out, rows, toks);
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
unsafe fn tile_t(k: usize, w: *const f32, xt: *const f32, c: *mut f32, ldc: usize, rows: usize, toks: usize) {
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
unsafe fn tile_t(_: usize, _: *const f32, _: *const f32, _: *mut f32, _: usize, _: usize, _: usize) {
    unreachable!("few_rows::available is false off x86_64")
}

/// g [n, out] · W -> [n, inp]; only where [`available`]. Each thread's task is a run of
/// adjacent 16-column strips, taken one k run at a time, so it reads W's rows k0..k0 + K_RUN
/// over its whole run of columns: whole cache lines, front to back.
fn input_grad_rows<E: Element>(g: &[f32], n: usize, w: &[E], (out, inp): (usize, usize), threads: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let k = out;
    let mut dst = super::zeros_f32(n * inp);
    if inp == 0 || k == 0 {
        return dst;
    }
    let panels_g = n.div_ceil(MR);
    let gp = panels(g, k, MR); // g as [panel][kk][6]
    let strips = inp.div_ceil(NR);
    let per = strips.div_ceil(threads.max(1) * 4).max(1);
    let c = Shared::new(&mut dst);
    (0..strips.div_ceil(per)).into_par_iter().for_each(|t| {
        SCRATCH.with_borrow_mut(|strip| {
            strip.resize(K_RUN * NR, 0.0);
            for k0 in (0..k).step_by(K_RUN) {
                let kn = K_RUN.min(k - k0);
                for s in t * per..((t + 1) * per).min(strips) {
                    let (j0, cols) = (s * NR, NR.min(inp - s * NR));
                    // The strip as [kk][16]: W[k0 + kk, j0..j0 + cols], zero padded.
                    if cols == NR {
                        // SAFETY: `available` checked AVX2; rows k0..k0 + kn of W hold columns
                        // j0..j0 + 16, and the strip kn x 16 floats.
                        unsafe { E::strip16(w[k0 * inp + j0..].as_ptr(), inp, kn, strip.as_mut_ptr()) };
                    } else {
                        for kk in 0..kn {
                            let row = &mut strip[kk * NR..][..NR];
                            E::to_f32s(&w[(k0 + kk) * inp + j0..][..cols], &mut row[..cols]);
                            row[cols..].fill(0.0);
                        }
                    }
                    for p in 0..panels_g {
                        let rows = MR.min(n - p * MR);
                        // SAFETY: `available` checked AVX2 + FMA; the panel holds kn x 6 floats
                        // from (p * k + k0) * 6, the strip kn x 16; the tile's rows 6p.. x
                        // columns j0.. of dst are this task's alone (strip s is), inside dst by
                        // `extent`.
                        unsafe {
                            let at = c.ptr_at(p * MR * inp + j0, extent(rows, inp, cols, 1));
                            tile_add(kn, gp[(p * k + k0) * MR..].as_ptr(), strip.as_ptr(), at, inp, rows, cols);
                        }
                    }
                }
            }
        });
    });
    dst
}

/// C[i][j] += Σ_kk a[kk][i] · b[kk][j] for i < rows (of 6), j < cols (of 16), C with row
/// stride `ldc`: twelve 8-wide accumulators, six broadcasts of a and two loads of b per kk.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_add(k: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: usize, rows: usize, cols: usize) {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); 2 * MR];
    for kk in 0..k {
        // SAFETY (whole block): kk < k, so a + kk * 6 + 6 and b + kk * 16 + 16 stay inside the
        // panel and the strip.
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
    unreachable!("few_rows::available is false off x86_64")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::gemm::sgemm;
    use crate::ops::testutil::{assert_f32_math, bf16_weight as weight, pseudo};

    /// The claim of the module: f32 math on the weight's exact values, both ways, from bf16
    /// bits and from f32 alike (the same bits: both read the same values through the same
    /// kernel), held to the f64 product no further than the gemm crate's f32 GEMM is, to
    /// within a quarter (rounding a single operand to bf16 would be hundreds of times
    /// further). Shapes: rows and outputs past whole tiles (45 x 300, 33 x 100); a last strip
    /// of 6 and of 12 columns (70 and 1500 inputs); k of 300, 576 and 1500 (several k runs);
    /// 200 rows (input gradients only: forwards there are `None`); 7 and 1 rows (neither);
    /// 16 rows of a 5 x 9 W (both: one partial panel of W, one partial strip, k of 9 and 5).
    #[test]
    #[cfg_attr(not(avx2_fma), ignore = "needs AVX2 + FMA (build.rs found none on this machine)")]
    fn few_row_kernels_give_f32_math_on_the_weights_exact_values() {
        assert!(available(), "build.rs found AVX2 + FMA but this process has none");
        for (n, out, inp, threads) in [(45, 300, 70, 2), (7, 1408, 2048, 2), (33, 100, 1500, 3), (1, 40, 9, 1), (64, 576, 576, 2), (200, 64, 300, 2), (16, 5, 9, 1)] {
            let (bits, w) = weight(out * inp, out + inp);
            for input_grad in [false, true] {
                let (k, cols) = if input_grad { (out, inp) } else { (inp, out) };
                let x = pseudo(n * k, n + k);
                let from_bits = gemm(&x, n, &bits, (out, inp), input_grad, threads);
                let from_f32 = gemm(&x, n, &w, (out, inp), input_grad, threads);
                let runs = if input_grad { GRAD_ROWS.contains(&n) } else { FORWARD_ROWS.contains(&n) };
                assert_eq!(from_bits.is_some(), runs, "[{n}, {k}] input_grad {input_grad}");
                let (Some(got), Some(got_f32)) = (from_bits, from_f32) else { continue };
                assert!(got == got_f32, "[{n}, {k}] input_grad {input_grad}: bf16 bits and their f32 values differ");
                let (rs, cs) = if input_grad { (inp, 1) } else { (1, inp) };
                let what = format!("[{n}, {k}] x W [{out}, {inp}] input_grad {input_grad}");
                let (e_got, e_f32) = assert_f32_math(&got, &x, &w, (n, k, cols), (rs, cs), &what);
                println!("{what}: few rows {e_got:e}, f32 gemm {e_f32:e}");
            }
        }
    }

    /// Timing only (`cargo test --release --lib few_rows_speed -- --ignored --nocapture`): by
    /// rows, on a DeepSeek-V2-Lite expert's W (1408 x 2048), these kernels on bf16 and on f32
    /// against the blocked widening path (`widen`) and the gemm crate on the f32 weight.
    #[test]
    #[ignore = "timing; run by hand"]
    fn few_rows_speed() {
        if !available() {
            crate::note!("no AVX2 + FMA");
            return;
        }
        let threads = candle_core::utils::get_num_threads();
        let (out, inp) = (1408, 2048);
        let (bits, w) = weight(out * inp, 3);
        for n in [4, 8, 12, 16, 48, 128, 256, 512] {
            for input_grad in [false, true] {
                let (k, cols) = if input_grad { (out, inp) } else { (inp, out) };
                let x = pseudo(n * k, 5);
                let time = |f: &dyn Fn()| crate::ops::testutil::gemm_gflops((n, k, cols), f);
                let run = |f: &dyn Fn() -> Vec<f32>| time(&|| drop(std::hint::black_box(f())));
                let kernels = |e: &dyn Fn() -> Vec<f32>| if input_grad || FORWARD_ROWS.contains(&n) { format!("{:.0}", run(e)) } else { "-".into() };
                let bf16 = kernels(&|| if input_grad { input_grad_rows(&x, n, &bits, (out, inp), threads) } else { forward(&x, n, &bits, (out, inp), threads) });
                let f32k = kernels(&|| if input_grad { input_grad_rows(&x, n, &w, (out, inp), threads) } else { forward(&x, n, &w, (out, inp), threads) });
                let blocked = run(&|| crate::ops::widen::blocked(&x, n, &bits, (out, inp), input_grad, threads));
                let (rs, cs) = if input_grad { (inp, 1) } else { (1, inp) };
                let crate_f32 = run(&|| {
                    let mut d = crate::ops::zeros_f32(n * cols);
                    sgemm(n, cols, k, &mut d, cols, false, &x, k, 1, &w, rs, cs, 1.0, threads);
                    d
                });
                println!("{n} rows ({}): these kernels bf16 {bf16}, f32 {f32k}; blocked widening {blocked:.0}; gemm crate f32 {crate_f32:.0} GFLOP/s", if input_grad { "g·W" } else { "x·Wᵀ" });
            }
        }
    }
}
