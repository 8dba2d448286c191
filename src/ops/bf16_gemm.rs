//! bf16 GEMM on CPU for the frozen matmuls of a bf16 base: Intel AMX tiles, or AVX512-BF16
//! dot products (AMD Zen 4 and later, Intel Cooper Lake and later).
//!
//! Why: PyTorch with a bf16 model lets oneDNN run its matmuls on these units, at up to twice
//! (AVX512-BF16) or several times (AMX) the best f32 GEMM. Candle has neither on CPU; stable
//! Rust has AVX512-BF16 intrinsics but no AMX ones, so the AMX kernel is inline assembly.
//!
//! Numerics (the same contract as PyTorch's bf16 matmul): inputs are bf16 (activations are
//! rounded to nearest-even), products are summed in f32, the result is f32. Both units treat
//! bf16 subnormals as zero. Only a base that is *stored* in bf16 takes this path
//! (`ops::frozen_linear`, `loss::Head`); an f32 base keeps f32 math.
//!
//! Dimension legend: C [M, N] = A [M, K] · B [K, N].
//!   A is f32 (rounded to bf16 here); B is packed once per call into VNNI tiles:
//!   tile (nb, kb) holds rows 2kk, 2kk+1 of B's k-block kb interleaved per column, i.e.
//!   16 rows (pairs of k) x 16 columns x 2 bf16 = 1 KiB, the layout `tdpbf16ps` reads. One
//!   row of a tile (a k pair x 16 columns, 64 bytes) is also exactly the B operand of one
//!   `vdpbf16ps` on a zmm register, so both kernels read the same packing.
//!   K is padded to 32 (one A tile row), M and N to 32 (two tiles each), with zeros.
//!
//! AMX kernel: a 32 x 32 block of C in four accumulator tiles (tmm0-3); per step of 32 k,
//! two A tiles (tmm4-5) and two B tiles (tmm6-7): four `tdpbf16ps` per four loads. One tile
//! program runs a band of 32 rows across many column pairs (one tile configuration per
//! band), and A is converted into whole 1 KiB tiles too (`ATiles`), by each task for its own
//! rows where work is split by rows.
//! AVX512-BF16 kernel: an 8 x 32 block of C in sixteen zmm accumulators; per k pair, two B
//! rows and eight broadcast A pairs: sixteen `vdpbf16ps` per ten loads. The same kernel with
//! one to three B strips (8 x 16 S, up to 24 accumulators) runs the swapped forward on few
//! rows ([`gemm_wt`]), where W's rows are the broadcast operand, and the input gradient on
//! few rows against W packed a slab of K at a time ([`gemm_kn`]).

use rayon::prelude::*;
use std::borrow::Cow;
use std::sync::OnceLock;

/// Tiles are 16 rows of 64 bytes.
const TM: usize = 16;
/// bf16 per tile row.
const TK: usize = 32;

/// The units a bf16 GEMM can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Intel AMX tiles (`tdpbf16ps`), Sapphire Rapids and later.
    Amx,
    /// AVX512-BF16 (`vdpbf16ps` on zmm), AMD Zen 4 and later, Intel Cooper Lake and later.
    Avx512Bf16,
}

impl Kernel {
    /// Most K tiles (of 32) per panel: C is reloaded between panels, and in exchange the
    /// panel of B a task works on stays in cache while its row blocks pass. K is cut into
    /// equal panels of at most this many tiles ([`k_panels`]). AMX: 2048 of K (on a Xeon with
    /// AMX, 2026-11-25: panels of 512 cut K = 576 into 512 + 64 and the second panel was
    /// mostly C traffic; whole K up to 2048 ran the layer shapes 1.2-1.5x faster and the LM
    /// head's input gradient, whose K is the vocabulary, 1.5x). AVX512-BF16: 1024 of K
    /// (measured on Zen 4: 5-15% faster than 256 or 512 on the layers and the head; C traffic
    /// costs more there than B strips streaming from L2).
    fn k_panel(self) -> usize {
        match self {
            Kernel::Amx => 64,
            Kernel::Avx512Bf16 => 32,
        }
    }

    /// Rows of A (and C) each kernel call covers: M is padded to a multiple of it.
    fn row_block(self) -> usize {
        match self {
            Kernel::Amx => 2 * TM,
            Kernel::Avx512Bf16 => dot::MR,
        }
    }

    /// The unit's name, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Amx => "AMX tiles",
            Kernel::Avx512Bf16 => "AVX512-BF16",
        }
    }

    /// Can this CPU (and OS) run it? AMX asks Linux for tile permission once per process.
    pub fn supported(self) -> bool {
        static AMX: OnceLock<bool> = OnceLock::new();
        match self {
            Kernel::Amx => *AMX.get_or_init(crate::ops::cpu_bf16::amx_detect_and_enable),
            Kernel::Avx512Bf16 => crate::ops::cpu_bf16::avx512_bf16(),
        }
    }
}

/// The bf16 kernel this process uses, if any: AMX where the CPU has it (unless
/// `FINETUNE_NO_AMX` is set), else AVX512-BF16 where the CPU has that, else none (a bf16
/// base then computes in f32).
pub fn kernel() -> Option<Kernel> {
    static K: OnceLock<Option<Kernel>> = OnceLock::new();
    *K.get_or_init(|| {
        if std::env::var_os("FINETUNE_NO_AMX").is_none() && Kernel::Amx.supported() {
            Some(Kernel::Amx)
        } else if Kernel::Avx512Bf16.supported() {
            Some(Kernel::Avx512Bf16)
        } else {
            None
        }
    })
}

/// Is there a bf16 kernel on this CPU (see [`kernel`])?
pub fn available() -> bool {
    kernel().is_some()
}

/// Round an f32 to bf16 bits (nearest-even; NaN stays NaN).
#[inline(always)]
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

/// `dst[i] = bf16_bits(src[i])`, by `vcvtne2ps2bf16` where the CPU has AVX512-BF16 (every
/// CPU with a kernel here: the scalar loop was ~15% of a layer GEMM on AMX). The one
/// difference: the instruction reads f32 subnormals as zero, where `bf16_bits` keeps them as
/// bf16 subnormals, which both units read as zero too, so products do not change.
fn round_row(src: &[f32], dst: &mut [u16]) {
    debug_assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if crate::ops::cpu_bf16::avx512_bf16() {
        // SAFETY: AVX512-BF16 and AVX512F are present (checked just above).
        return unsafe { round_row_avx512(src, dst) };
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = bf16_bits(s);
    }
}

/// [`round_row`] 32 lanes at a time; the tail by `bf16_bits`.
///
/// # Safety
/// The CPU has AVX512F and AVX512-BF16; `dst` is as long as `src`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn round_row_avx512(src: &[f32], dst: &mut [u16]) {
    use std::arch::x86_64::*;
    let whole = src.len() / 32 * 32;
    for i in (0..whole).step_by(32) {
        let lo = _mm512_loadu_ps(src.as_ptr().add(i));
        let hi = _mm512_loadu_ps(src.as_ptr().add(i + 16));
        // Lanes 0-15 of the result come from the second operand.
        let r: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
        _mm512_storeu_si512(dst.as_mut_ptr().add(i) as *mut _, r);
    }
    for (d, &s) in dst[whole..].iter_mut().zip(&src[whole..]) {
        *d = bf16_bits(s);
    }
}

fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

/// B packed for the kernel: `kb` k-blocks of 32 and `nb` column blocks of 16 (nb even).
pub struct PackedB {
    k: usize,
    n: usize,
    kb: usize,
    nb: usize,
    /// [nb][kb][16 pair rows][16 cols][2] bf16 bits.
    tiles: Vec<u16>,
}

impl PackedB {
    /// B's columns N.
    pub fn cols(&self) -> usize {
        self.n
    }

    /// B [K, N] packed from `fill(bn, strip)`, which writes column strip `bn` (columns
    /// 16 bn .. 16 bn + 16, all K tiles; laid out as [`slot`] says) of the zeroed packing.
    fn packed(k: usize, n: usize, fill: impl Fn(usize, &mut [u16]) + Sync) -> Self {
        let (kb, nb) = Self::blocks(k, n);
        // (k or n is 0 when this is empty: `gemm` then returns zeros or nothing)
        let tiles = crate::ops::par_zeroed(nb * kb * TM * TK, kb * TM * TK, fill);
        PackedB { k, n, kb, nb, tiles }
    }

    /// K tiles and column blocks for B [K, N].
    fn blocks(k: usize, n: usize) -> (usize, usize) {
        (round_up(k, TK) / TK, round_up(n, 2 * TM) / TM)
    }

    /// As [`packed`](Self::packed) with a SIMD `fill` that stores every element of its pairs of
    /// strips (32 columns each: whole cache lines of a [K, N] source), padding included, so the
    /// packing is not zeroed first (packing runs on every call: the memset was a third of
    /// its time). Tasks take up to `group` pairs side by side.
    ///
    /// # Safety
    /// `fill(first, pairs, strips)` stores all `pairs * 2 * kb * 512` u16 of the strips of pairs
    /// first..first + pairs (`strips` points at the first strip; the others follow it).
    unsafe fn packed_by_simd(k: usize, n: usize, group: usize, fill: impl Fn(usize, usize, *mut u16) + Sync) -> Self {
        use rayon::prelude::*;
        let (kb, nb) = Self::blocks(k, n); // nb is even
        let pair = 2 * kb * TM * TK;
        let mut tiles: Vec<u16> = Vec::with_capacity(nb / 2 * pair);
        if pair > 0 {
            let g = group.max(1);
            tiles.spare_capacity_mut()[..nb / 2 * pair].par_chunks_mut(g * pair).enumerate().for_each(|(i, c)| fill(i * g, c.len() / pair, c.as_mut_ptr().cast()));
        }
        // SAFETY: the chunks cover 0..nb * strip and `fill` stored each element of each.
        unsafe { tiles.set_len(nb / 2 * pair) };
        PackedB { k, n, kb, nb, tiles }
    }

    /// Where B[kk, 16 nb + j] sits in `tiles`.
    fn index(&self, nb: usize, kk: usize, j: usize) -> usize {
        nb * self.kb * TM * TK + slot(kk, j)
    }

    /// B = Wᵀ for W [N, K] row-major (the forward `x · Wᵀ` of a linear layer).
    ///
    /// A tile row is one k pair for 16 columns, i.e. the 32-bit pairs W[n, 2p..2p+2] of 16
    /// rows of W: a 32-bit transpose, written a whole 64-byte tile row at a time (packing is
    /// done on every call, so it must stream, not scatter 16-bit stores).
    pub fn from_nk(w: &[u16], n: usize, k: usize) -> Self {
        Self::from_nk_with(w, n, k, simd_pack::available())
    }

    /// [`from_nk`](Self::from_nk) by the SIMD packing (`simd`: the CPU must have it) or the scalar loop.
    fn from_nk_with(w: &[u16], n: usize, k: usize, simd: bool) -> Self {
        assert!(w.len() >= n * k, "bf16 gemm: W has {} elements, [{n}, {k}] needs {}", w.len(), n * k);
        if simd {
            assert!(simd_pack::available(), "bf16 gemm: SIMD packing needs AVX-512 F + BW");
            // SAFETY: AVX-512 F + BW are present; `strips_nk` stores every element of its pair's
            // strips and reads rows of W [N, K] only (checked above).
            return unsafe { Self::packed_by_simd(k, n, 1, |pair, _, strips| simd_pack::strips_nk(w, n, k, pair, strips)) };
        }
        Self::packed(k, n, |bn, strip| {
            let rows = TM.min(n.saturating_sub(bn * TM));
            let w = &w[(bn * TM * k).min(w.len())..];
            for (p, dst) in strip.chunks_exact_mut(2 * TM).take(k.div_ceil(2)).enumerate() {
                let kk = 2 * p;
                for j in 0..rows {
                    let src = &w[j * k + kk..];
                    dst[2 * j] = src[0];
                    dst[2 * j + 1] = if kk + 1 < k { src[1] } else { 0 };
                }
            }
        })
    }

    /// From a frozen bf16 weight W [out, in] on CPU: B = Wᵀ for the forward `x · Wᵀ`
    /// (`input_grad` false), B = W for the input gradient `g · W` (true).
    pub fn from_weight(w: &candle_core::Tensor, input_grad: bool) -> candle_core::Result<Self> {
        with_weight_bits(w, |bits, out, inp| if input_grad { Self::from_kn(bits, out, inp) } else { Self::from_nk(bits, out, inp) })
    }

    /// B = W for W [K, N] row-major (the input gradient `g · W` of a linear layer).
    ///
    /// A tile row interleaves 16 columns of rows 2p and 2p + 1 of W (two contiguous runs).
    pub fn from_kn(w: &[u16], k: usize, n: usize) -> Self {
        Self::from_kn_with(w, k, n, simd_pack::available())
    }

    /// [`from_kn`](Self::from_kn) by the SIMD packing (`simd`: the CPU must have it) or the scalar loop.
    fn from_kn_with(w: &[u16], k: usize, n: usize, simd: bool) -> Self {
        assert!(w.len() >= n * k, "bf16 gemm: W has {} elements, [{k}, {n}] needs {}", w.len(), n * k);
        if simd {
            assert!(simd_pack::available(), "bf16 gemm: SIMD packing needs AVX-512 F + BW");
            // Several pairs per task: each row is then read a few cache lines at a time rather
            // than one line per 4 KB page (a TLB miss per line on wide rows), with enough tasks
            // left for every thread.
            let pairs = Self::blocks(k, n).1 / 2;
            let group = (pairs / (4 * rayon::current_num_threads().max(1))).clamp(1, 8);
            // SAFETY: AVX-512 F + BW are present; `strips_kn` stores every element of its pairs'
            // strips and reads rows of W [K, N] only (checked above).
            return unsafe { Self::packed_by_simd(k, n, group, |first, count, strips| simd_pack::strips_kn(w, k, n, first, count, (0, k.div_ceil(TK)), k.div_ceil(TK) * TM * TK, strips)) };
        }
        Self::packed(k, n, |bn, strip| {
            let c0 = bn * TM;
            if c0 >= n {
                return; // a zero strip that pads nb to even
            }
            let cols = TM.min(n - c0);
            for (p, dst) in strip.chunks_exact_mut(2 * TM).take(k.div_ceil(2)).enumerate() {
                let even = &w[2 * p * n + c0..][..cols];
                for (j, &v) in even.iter().enumerate() {
                    dst[2 * j] = v;
                }
                if 2 * p + 1 < k {
                    let odd = &w[(2 * p + 1) * n + c0..][..cols];
                    for (j, &v) in odd.iter().enumerate() {
                        dst[2 * j + 1] = v;
                    }
                }
            }
        })
    }
}

/// Offset of B[kk, j] within a 16-column strip: tile kk / 32, pair row (kk % 32) / 2, column
/// j, slot kk % 2.
#[inline(always)]
fn slot(kk: usize, j: usize) -> usize {
    (kk / TK) * TM * TK + ((kk % TK) / 2) * TK + j * 2 + (kk & 1)
}

/// C [M, N] = A [M, K] · B, with A f32 row-major (rounded to bf16) and C f32 row-major, on
/// this process's [`kernel`] (callers check [`available`] first; without a kernel the same
/// sums are computed by a portable loop, slowly).
pub fn gemm(a: &[f32], m: usize, b: &PackedB) -> Vec<f32> {
    match kernel() {
        Some(kern) => gemm_with(kern, a, m, b),
        None => portable(a, m, b),
    }
}

/// [`gemm`] on a given kernel, which must be [`Kernel::supported`] here (blocked as
/// [`run_into`] says).
pub fn gemm_with(kern: Kernel, a: &[f32], m: usize, b: &PackedB) -> Vec<f32> {
    check_a(a, m, b);
    gemm_rows(kern, Rows::F32(a), m, b)
}

/// [`gemm_with`] on rows in either form.
fn gemm_rows(kern: Kernel, a: Rows, m: usize, b: &PackedB) -> Vec<f32> {
    assert!(kern.supported(), "bf16 gemm: {kern:?} is not supported on this CPU");
    if b.k == 0 || m == 0 || b.n == 0 {
        return vec![0f32; m * b.n]; // an empty sum
    }
    let (mp, np) = padded_dims_with(kern, m, b);
    // C [MP, NP]: whole tile pairs. Not zeroed: the first K panel stores every tile.
    let mut c: Vec<f32> = Vec::with_capacity(mp * np);
    run_into(kern, a, m, b, crate::ops::Shared::uninit(&mut c.spare_capacity_mut()[..mp * np]), false);
    // SAFETY: k >= 1, so b.kb >= 1, and `run_into`'s first K panel stored every block of the
    // [MP, NP] buffer (its tasks cover all row blocks x column pairs), i.e. every element.
    unsafe { c.set_len(mp * np) };
    unpadded(c, m, b.n, np)
}

/// (MP, NP): the rows and columns of the C buffer the kernels write for A [M, K] · B on this
/// process's [`kernel`] (M padded to the kernel's row block, N to whole column pairs), which
/// [`gemm_acc`] takes. None without a bf16 unit.
pub fn padded_dims(m: usize, b: &PackedB) -> Option<(usize, usize)> {
    Some(padded_dims_with(kernel()?, m, b))
}

fn padded_dims_with(kern: Kernel, m: usize, b: &PackedB) -> (usize, usize) {
    // Rows padded to the kernel's row block: AMX's tile pairs (32), the dot kernel's 8 (an
    // expert's 48 rows would otherwise run as 64).
    (round_up(m, kern.row_block()), b.nb * TM)
}

/// C += A [M, K] · B (`accumulate`), or C = A · B, into a caller's C laid out as the kernels
/// leave it: [MP, NP] row-major ([`padded_dims`]), C [M, N] in its top-left corner. Rows past
/// M and columns past N are the kernels' scratch. The products and the order they are summed
/// in within a call are [`gemm`]'s; accumulating adds them to C panel by panel of K, where
/// `gemm` then an add would sum the panels first (the loss's running sum over head chunks
/// takes this: no [M, N] product written, read back and added per chunk).
///
/// Callers check [`available`] first.
pub fn gemm_acc(a: &[f32], m: usize, b: &PackedB, c: &mut [f32], accumulate: bool) {
    let kern = kernel().expect("bf16 gemm: gemm_acc without a bf16 unit (callers check available())");
    check_a(a, m, b);
    gemm_acc_rows(kern, Rows::F32(a), m, b, c, accumulate);
}

/// [`gemm_acc`] on rows in either form.
fn gemm_acc_rows(kern: Kernel, a: Rows, m: usize, b: &PackedB, c: &mut [f32], accumulate: bool) {
    let (mp, np) = padded_dims_with(kern, m, b);
    assert_eq!(c.len(), mp * np, "bf16 gemm: C has {} elements, [{mp}, {np}] needs {}", c.len(), mp * np);
    if b.k == 0 || m == 0 || b.n == 0 {
        if !accumulate {
            c.fill(0.0); // an empty sum
        }
        return;
    }
    run_into(kern, a, m, b, crate::ops::Shared::new(c), accumulate);
}

/// A's rows as `run_into` takes them: f32 (rounded to bf16 on the way in), or rounded once
/// already for several GEMMs ([`RoundedRows`]).
#[derive(Clone, Copy)]
enum Rows<'a> {
    F32(&'a [f32]),
    Rounded(&'a RoundedRows),
}

/// A [M, K] f32 rounded to bf16 once, zero padded to [MP, KP] as the dot kernel reads it, for
/// GEMMs against several B of the same K: the loss's rows meet every chunk of the LM head (50
/// a step at DeepSeek-V2-Lite's vocabulary) and were rounded, into a zeroed buffer, for each.
/// The same bits as [`gemm`] / [`gemm_acc`] on the f32 rows. The dot kernel only (AMX
/// converts its A to tiles inside the GEMM's tasks).
pub struct RoundedRows {
    bits: Vec<u16>,
    m: usize,
    k: usize,
}

impl RoundedRows {
    /// Rows of `k` in the dot kernel's layout: (MP, KP), M padded to its row block, K to tiles.
    fn dims(m: usize, k: usize) -> (usize, usize) {
        (round_up(m, dot::MR), round_up(k, TK))
    }

    /// A [M, K] rounded; None where this process's kernel is not the dot kernel.
    pub fn new(a: &[f32], m: usize, k: usize) -> Option<Self> {
        assert_eq!(a.len(), m * k, "bf16 gemm: rows [{m}, {k}] from {} values", a.len());
        Self::from_rows(m, k, |r, dst| round_row(&a[r * k..][..k], dst)).map(|(rows, _)| rows)
    }

    /// Rows written by `fill(r, row)` (row r's K values, as `round_row` would write them, into
    /// a row of K), with what `fill` returns for each row; None where this process's kernel is
    /// not the dot kernel. The padding is zeroed here; nothing else is zeroed first.
    pub fn from_rows<T: Send>(m: usize, k: usize, fill: impl Fn(usize, &mut [u16]) -> T + Sync) -> Option<(Self, Vec<T>)> {
        if kernel()? != Kernel::Avx512Bf16 {
            return None;
        }
        let (mp, kp) = Self::dims(m, k);
        let mut bits: Vec<u16> = vec![0; mp * kp - m * kp]; // the padding rows, at the end
        let mut rows: Vec<u16> = Vec::with_capacity(mp * kp);
        let out = rows.spare_capacity_mut()[..m * kp]
            .par_chunks_mut(kp.max(1))
            .enumerate()
            .map(|(r, row)| {
                // SAFETY: u16 has no invalid bit patterns; every element of the row is written
                // below (the first k by `fill`, the padding zeroed).
                let row = unsafe { &mut *(row as *mut [std::mem::MaybeUninit<u16>] as *mut [u16]) };
                let (vals, pad) = row.split_at_mut(k);
                pad.fill(0);
                fill(r, vals)
            })
            .collect();
        // SAFETY: the tasks wrote all M rows of KP.
        unsafe { rows.set_len(m * kp) };
        rows.append(&mut bits);
        Some((RoundedRows { bits: rows, m, k }, out))
    }
}

/// [`gemm`] on rows rounded once (the dot kernel: [`RoundedRows::new`] was Some).
pub fn gemm_rounded(a: &RoundedRows, b: &PackedB) -> Vec<f32> {
    assert_eq!(a.k, b.k, "bf16 gemm: rounded rows of {} against a B of K {}", a.k, b.k);
    gemm_rows(Kernel::Avx512Bf16, Rows::Rounded(a), a.m, b)
}

/// [`gemm_acc`] on rows rounded once (the dot kernel: [`RoundedRows::new`] was Some).
pub fn gemm_acc_rounded(a: &RoundedRows, b: &PackedB, c: &mut [f32], accumulate: bool) {
    assert_eq!(a.k, b.k, "bf16 gemm: rounded rows of {} against a B of K {}", a.k, b.k);
    gemm_acc_rows(Kernel::Avx512Bf16, Rows::Rounded(a), a.m, b, c, accumulate);
}

/// The blocked GEMM behind [`gemm_with`] and [`gemm_acc`], into C [MP, NP] (every element
/// stored, or, with `accumulate`, added to).
///
/// Blocking, so that neither operand is streamed from memory more than once per K panel:
/// K is cut into equal panels of at most `Kernel::k_panel` tiles (C is reloaded between panels);
/// within a panel, work is split over threads by row blocks or by column blocks (see
/// [`split`]: by rows for the layers' big M, by columns for an expert's few rows or the LM
/// head's chunk of rows against 49k columns). Each task
/// walks its columns in panels of B small enough to stay in L2 while its row blocks pass.
fn run_into(kern: Kernel, a: Rows, m: usize, b: &PackedB, cbuf: crate::ops::Shared, accumulate: bool) {
    let k = b.k;
    let kp = b.kb * TK;
    let (mp, np) = padded_dims_with(kern, m, b);
    let rows = mp.div_ceil(2 * TM); // blocks of 32 rows, the last one maybe short of 32
    let pairs = b.nb / 2;
    let threads = rayon::current_num_threads().max(1);
    let (by_rows, per) = split(rows, pairs, mp, np, threads);
    // A as bf16, zero padded to [MP, KP] so the loads need no masking: row-major for the dot
    // kernel, in whole tiles for AMX (see `ATiles`). AMX split by rows converts each task's
    // own rows as it starts (into a buffer its thread keeps), so they are in cache when its
    // tiles read them, and no [MP, KP] copy goes to memory and back (that pass was a fifth of
    // a layer GEMM).
    let (ab, at) = match (kern, a) {
        (Kernel::Amx, Rows::F32(_)) if by_rows => (Cow::Owned(Vec::new()), None),
        (Kernel::Amx, Rows::F32(a)) => (Cow::Owned(Vec::new()), Some(ATiles::convert(a, m, k, (0, mp / TM), (0, b.kb), true, Vec::new()))),
        (Kernel::Avx512Bf16, Rows::F32(a)) => (Cow::Owned(rounded_rows(a, m, k, mp, kp)), None),
        (Kernel::Avx512Bf16, Rows::Rounded(r)) => {
            assert!(r.m == m && r.k == k && r.bits.len() == mp * kp, "bf16 gemm: rounded rows [{}, {}] for A [{m}, {k}]", r.m, r.k);
            (Cow::Borrowed(&r.bits[..]), None)
        }
        (Kernel::Amx, Rows::Rounded(_)) => unreachable!("RoundedRows::new is None where AMX runs"),
    };
    let a = match a {
        Rows::F32(a) => a,
        Rows::Rounded(_) => &[],
    };
    let units = if by_rows { rows } else { pairs };
    let tasks = units.div_ceil(per);
    let kc = k_panels(b.kb, kern.k_panel());
    for k0 in (0..b.kb).step_by(kc) {
        let k1 = (k0 + kc).min(b.kb);
        // The first panel stores C, or adds to it when accumulating; later panels add.
        let load = k0 > 0 || accumulate;
        (0..tasks).into_par_iter().for_each(|t| {
            let cp = cbuf;
            let (lo, hi) = (t * per, ((t + 1) * per).min(units));
            let (r, p) = if by_rows { ((lo, hi), (0, pairs)) } else { ((0, rows), (lo, hi)) };
            // SAFETY: tasks write disjoint (row block, column pair) blocks of the [MP, NP]
            // buffer behind `cp` (each block's range checked against it in debug builds);
            // `ab` is [MP, KP] (or, for AMX by rows, the task converts its rows first); the
            // kernel is supported (asserted by the callers); C is read only when `load`,
            // where it holds what an earlier panel or the caller stored.
            unsafe {
                match kern {
                    Kernel::Amx => match &at {
                        Some(at) => amx::run_tiles(at, b, r, p, (k0, k1), np, cp, load),
                        None => TASK_A.with(|buf| {
                            let mut buf = buf.borrow_mut();
                            let own = ATiles::convert(a, m, k, (2 * r.0, 2 * r.1), (k0, k1), false, std::mem::take(&mut *buf));
                            amx::run_tiles(&own, b, r, p, (k0, k1), np, cp, load);
                            *buf = own.data;
                        }),
                    },
                    Kernel::Avx512Bf16 => dot::run_blocks(&ab, kp, b, r, p, (k0, k1), np, cp, load),
                }
            }
        });
    }
}

/// A [M, K] f32 rounded to bf16 and zero padded to [MP, KP], row-major (the dot kernel's A).
fn rounded_rows(a: &[f32], m: usize, k: usize, mp: usize, kp: usize) -> Vec<u16> {
    crate::ops::par_zeroed(mp * kp, kp, |r, dst: &mut [u16]| {
        if r < m {
            round_row(&a[r * k..][..k], &mut dst[..k]);
        }
    })
}

/// C [M, N] from the kernels' padded C [MP, NP] (rows past M, columns past N dropped).
fn unpadded(mut c: Vec<f32>, m: usize, n: usize, np: usize) -> Vec<f32> {
    if np == n {
        c.truncate(m * n); // padding rows are at the end
        return c;
    }
    crate::ops::par_zeroed(m * n, n, |r, row: &mut [f32]| row.copy_from_slice(&c[r * np..][..n]))
}

/// Rows of A up to which [`gemm_wt`] reads W where it lies rather than packing it.
const WT_MAX_ROWS: usize = 128;

/// Bytes of Aᵀ's packed strips up to which [`gemm_wt`]'s dot kernel runs K in one panel.
const WT_B_BYTES: usize = 256 << 10;

/// C [M, N] = A [M, K] · Wᵀ for a bf16 W [N, K] (row-major), with W read where it lies as
/// the kernel's first operand: Cᵀ = W · Aᵀ, so only A is packed (as Aᵀ, M columns). For the
/// few rows of an expert, packing its weight on every call took as long as the GEMM on AMX
/// (a quarter of a DeepSeek-V2-Lite MoE step there) and a fifth to a third of it on
/// AVX512-BF16 (Zen 5, 2026-11-26, `bf16_gemm_speed` with the weight in cache: 48 x 1408 x
/// 2048 at 637-694 GFLOP/s packing W each call against 780-899 reading it here; in a MoE
/// step, where the weights come from memory, the forward's packing fell from 6% of the
/// samples to 2% and the step gained 2-3%). The same products and sums as [`gemm`] on a
/// packed Wᵀ, the two operands' roles swapped (the dot kernel's M runs as whole 16-column
/// strips, three at a time, so 48 rows cost 48, not 64). None where it does not apply: no
/// bf16 unit, over `WT_MAX_ROWS` rows (packing W then pays for itself), N or K not a
/// multiple of 32.
///
/// The input gradient keeps a packing ([`gemm_kn`] on few rows): W read in place by rows
/// 2p, 2p + 1 interleaved in registers ran 2.3x slower where W's rows are 4 KB apart (a
/// column strip of W shares cache sets and does not stay in cache across row blocks).
pub fn gemm_wt(a: &[f32], m: usize, w: &[u16], n: usize, k: usize) -> Option<Vec<f32>> {
    gemm_wt_with(kernel()?, a, m, w, n, k)
}

/// [`gemm_wt`] on a given kernel, which must be [`Kernel::supported`] here.
fn gemm_wt_with(kern: Kernel, a: &[f32], m: usize, w: &[u16], n: usize, k: usize) -> Option<Vec<f32>> {
    gemm_wt_many(kern, a, m, &[w], n, k).map(|mut c| c.swap_remove(0))
}

/// C_i = A · W_iᵀ for several bf16 W_i [N, K] of one shape, the bits of [`gemm_wt`] on each,
/// with A rounded and packed once and every weight's row blocks handed out as the tasks of one
/// parallel pass: a routed expert's gate and up projections read the same ~48 rows, and two
/// calls paid twice for the packing and for a pass's hand-off and last-task wait (~2% of the
/// experts' forward in `routed_experts_speed`, 2-core Zen 4 VM, 2026-11-28: 212-224 against
/// 216-256 ms over six alternating runs, faster or equal in each). None where [`gemm_wt`] is.
pub fn gemm_wt_shared(a: &[f32], m: usize, ws: &[&[u16]], n: usize, k: usize) -> Option<Vec<Vec<f32>>> {
    gemm_wt_many(kernel()?, a, m, ws, n, k)
}

/// [`gemm_wt_shared`] on a given kernel, which must be [`Kernel::supported`] here.
fn gemm_wt_many(kern: Kernel, a: &[f32], m: usize, ws: &[&[u16]], n: usize, k: usize) -> Option<Vec<Vec<f32>>> {
    assert!(kern.supported(), "bf16 gemm: {kern:?} is not supported on this CPU");
    if m == 0 || m > WT_MAX_ROWS || n == 0 || !n.is_multiple_of(2 * TM) || k == 0 || !k.is_multiple_of(TK) || ws.is_empty() {
        return None;
    }
    assert!(a.len() == m * k && ws.iter().all(|w| w.len() >= n * k), "bf16 gemm: A [{m}, {k}] or W [{n}, {k}] short");
    let b = transposed_operand(a, m, k);
    // Cᵀ's row length (M padded to AMX's column pairs, or to the dot kernel's strips) and the
    // units of W's rows the tasks share (AMX's bands of 32, the dot kernel's blocks of 8). K
    // in panels as `gemm_with` cuts it where Aᵀ would not stay in L2 while a unit of W's rows
    // passes (at 128 rows and a long K); the dot kernel takes K whole where Aᵀ's strips fit
    // in `WT_B_BYTES`: each W row is then one stream read once, and C is stored once (48
    // rows x 2048 of K, Zen 5, 2026-11-27, `cold_expert_gemm_speed`: 530 -> 610 GFLOP/s).
    let (np, units, most) = match kern {
        Kernel::Amx => (b.nb * TM, n / (2 * TM), kern.k_panel()),
        Kernel::Avx512Bf16 => {
            let np = round_up(m, TM);
            (np, n / dot::MR, (WT_B_BYTES / (np * TK * 2)).max(kern.k_panel()))
        }
    };
    let kc = k_panels(b.kb, most);
    let mut cts: Vec<Vec<f32>> = ws.iter().map(|_| Vec::with_capacity(n * np)).collect(); // Cᵀ [N, NP] each
    let css: Vec<crate::ops::Shared> = cts.iter_mut().map(|ct| crate::ops::Shared::uninit(&mut ct.spare_capacity_mut()[..n * np])).collect();
    let per = units.div_ceil(2 * rayon::current_num_threads().max(1)).max(1);
    let tasks = units.div_ceil(per);
    for k0 in (0..b.kb).step_by(kc) {
        let k1 = (k0 + kc).min(b.kb);
        (0..ws.len() * tasks).into_par_iter().for_each(|i| {
            let (wi, t) = (i / tasks, i % tasks);
            let (w, cp) = (ws[wi], css[wi]);
            let us = (t * per, ((t + 1) * per).min(units));
            // SAFETY: `kern` is supported here (asserted); tasks write disjoint rows of each Cᵀ
            // [N, NP]; each W holds N rows of K (asserted), K and N are multiples of 32
            // (checked above), so K is whole tiles and the units cover N.
            unsafe {
                match kern {
                    Kernel::Amx => amx::run_w(w, k, &b, us, (k0, k1), np, cp),
                    Kernel::Avx512Bf16 => dot::run_w(w, k, &b, m, us, (k0, k1), np, cp),
                }
            }
        });
    }
    Some(
        cts.into_iter()
            .map(|mut ct| {
                // SAFETY: the first K panel stored every unit's rows across every column of NP: all of Cᵀ.
                unsafe { ct.set_len(n * np) };
                transposed(&ct, n, np, m)
            })
            .collect(),
    )
}

/// Aᵀ as [`gemm_wt`]'s B: A [M, K] rounded to bf16 and packed as the forward packs a weight
/// [N, K].
fn transposed_operand(a: &[f32], m: usize, k: usize) -> PackedB {
    let mut ab = vec![0u16; m * k];
    round_row(a, &mut ab);
    PackedB::from_nk(&ab, m, k)
}

/// C [M, N] from Cᵀ [N, NP] (NP >= M), each task transposing 16 whole rows of C (an
/// element-by-element copy read Cᵀ a column at a time: a cache line per element).
fn transposed(ct: &[f32], n: usize, np: usize, m: usize) -> Vec<f32> {
    use rayon::prelude::*;
    debug_assert!(ct.len() >= n * np && np >= m);
    let mut c: Vec<f32> = Vec::with_capacity(m * n);
    c.spare_capacity_mut()[..m * n].par_chunks_mut(TM * n.max(1)).enumerate().for_each(|(blk, rows)| {
        let (i0, count) = (blk * TM, rows.len() / n);
        transpose_f32(&ct[i0..], np, n, count, rows, n);
    });
    // SAFETY: the tasks cover all m rows, each writing every column of its rows.
    unsafe { c.set_len(m * n) };
    c
}

/// `dst[j * ldd + c] = src[c * lds + j]` for c < `rows`, j < `cols`: the [rows, cols] block of
/// `src` (row stride `lds`) transposed into `cols` rows of `dst` (row stride `ldd`). In 16 x 16
/// blocks transposed in registers where AVX-512 F is present, `rows` is a multiple of 16 and
/// `src` can be read in whole 16-column blocks (the columns past `cols` are read, never
/// written); element by element otherwise. Strided single loads were most of the time of the
/// attention backward's transposes (dkᵀ [D, Sp] at Sp = 512 has its rows 2 KB apart: a column
/// walk stays in two L1 sets).
pub(crate) fn transpose_f32(src: &[f32], lds: usize, rows: usize, cols: usize, dst: &mut [std::mem::MaybeUninit<f32>], ldd: usize) {
    if rows == 0 || cols == 0 {
        return;
    }
    assert!((rows - 1) * lds + cols <= src.len() && (cols - 1) * ldd + rows <= dst.len(), "transpose_f32: [{rows}, {cols}] does not fit its operands");
    if simd_pack::available() && rows.is_multiple_of(TM) && (rows - 1) * lds + cols.next_multiple_of(TM) <= src.len() {
        for c0 in (0..rows).step_by(TM) {
            for j0 in (0..cols).step_by(TM) {
                // SAFETY: AVX-512 F present; reads rows c0..c0 + 16, columns j0..j0 + 16 of src
                // (inside: the whole 16-column blocks fit, checked above), writes min(16, cols - j0)
                // rows of 16 from column c0 (c0 + 16 <= rows) of dst, inside by the assert.
                unsafe { simd_pack::transpose_block(src.as_ptr().add(c0 * lds + j0), lds, dst.as_mut_ptr().cast::<f32>().add(j0 * ldd + c0), ldd, TM.min(cols - j0)) };
            }
        }
    } else {
        for j in 0..cols {
            for (c, v) in dst[j * ldd..][..rows].iter_mut().enumerate() {
                v.write(src[c * lds + j]);
            }
        }
    }
}

/// Cache lines of a block of rows of a row-major bf16 matrix, to be asked for (into L2) a
/// few at a time while other work runs: rows `r0..r1`, columns `c0..c1`.
struct Ahead {
    at: *const u8,
    stride: usize,
    rows: usize,
    lines: usize,
    /// Next (row, line of the row) to ask for.
    cursor: (usize, usize),
}

impl Ahead {
    /// Rows r0..r1, columns cols.0..cols.1 of W [_, n] bf16 (nothing where the range is empty).
    fn rows(w: &[u16], n: usize, r0: usize, r1: usize, cols: (usize, usize)) -> Self {
        let (rows, lines) = (r1.saturating_sub(r0), (cols.1.saturating_sub(cols.0) * 2).div_ceil(64));
        Ahead { at: w.as_ptr().wrapping_add(r0 * n + cols.0).cast(), stride: 2 * n, rows, lines, cursor: (0, 0) }
    }

    /// All its lines.
    fn total(&self) -> usize {
        self.rows * self.lines
    }

    /// Asks for the next `count` lines.
    #[cfg(target_arch = "x86_64")]
    fn next(&mut self, count: usize) {
        for _ in 0..count {
            let (r, l) = self.cursor;
            if r >= self.rows {
                return;
            }
            // SAFETY: a prefetch only hints; the address is inside W (rows r0..r1, columns
            // cols), or past it only by the rounding of the last line.
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(self.at.wrapping_add(r * self.stride + l * 64).cast()) };
            self.cursor = if l + 1 < self.lines { (r, l + 1) } else { (r + 1, 0) };
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn next(&mut self, _: usize) {}
}

/// Bytes of W's packed strips a task holds at a time in [`gemm_kn`]: with its share of C, in L2.
const KN_SLAB_BYTES: usize = 256 << 10;

/// Fewest K tiles per slab in [`gemm_kn`] (a task's columns are cut into panels to keep it):
/// DeepSeek-V2-Lite's experts take one panel (slabs of 4 and 5 tiles); a V3 expert's input
/// gradient through gate and up (48 x 2048 x 7168, Zen 5, 16 weights read cold) ran at 510-540
/// GFLOP/s in one panel of 1-tile slabs, 580 in four panels, 415 packing W whole.
const KN_MIN_SLAB: usize = 4;

/// C [M, N] = A [M, K] · W for a bf16 W [K, N] (row-major; the input gradient `g · W` of a
/// linear layer) over few rows, packing W a slab of K at a time into a buffer that stays in
/// L2 instead of packing it whole. Each thread takes a range of column pairs; per slab of K
/// tiles it packs its columns of those rows of W (contiguous runs of rows: the read streams,
/// where the whole-matrix packing read 32-column pieces of rows kilobytes apart), asks for
/// the next slab's rows while it runs every row block of A against this one, C kept across
/// slabs. The same products, summed in the same order, as [`gemm`] on
/// [`PackedB::from_kn`]: the same bits. A DeepSeek-V2-Lite expert's input gradients over 48
/// rows (Zen 5, 2026-11-27, `cold_expert_gemm_speed`, 64 experts' weights read cold in
/// turn): 470-510 -> 620-660 GFLOP/s.
/// None where it does not apply: not the AVX512-BF16 kernel (AMX packs whole tiles of W; see
/// `amx::strided`), or over `WT_MAX_ROWS` rows (whole-matrix packing then pays for itself).
pub fn gemm_kn(a: &[f32], m: usize, w: &[u16], k: usize, n: usize) -> Option<Vec<f32>> {
    gemm_kn_with(kernel()?, a, m, w, k, n)
}

/// [`gemm_kn`] on a given kernel, which must be [`Kernel::supported`] here.
fn gemm_kn_with(kern: Kernel, a: &[f32], m: usize, w: &[u16], k: usize, n: usize) -> Option<Vec<f32>> {
    assert!(kern.supported(), "bf16 gemm: {kern:?} is not supported on this CPU");
    if kern != Kernel::Avx512Bf16 || !simd_pack::available() || m == 0 || m > WT_MAX_ROWS || k == 0 || n == 0 {
        return None;
    }
    assert!(a.len() == m * k && w.len() >= k * n, "bf16 gemm: A [{m}, {k}] or W [{k}, {n}] short");
    let (kb, mp, pairs) = (k.div_ceil(TK), round_up(m, dot::MR), n.div_ceil(2 * TM));
    let (kp, np) = (kb * TK, pairs * 2 * TM);
    let ab = rounded_rows(a, m, k, mp, kp);
    // One task per thread (each packs its own columns: more tasks would pack more often). A
    // task runs its columns in panels narrow enough for slabs of at least `KN_MIN_SLAB` tiles
    // (C is reloaded once per slab: DeepSeek-V3's 7168 columns in one panel would take slabs
    // of one tile), each panel's slabs in turn.
    let per = pairs.div_ceil(rayon::current_num_threads().max(1));
    let pair_bytes = 2 * TM * TK * 2; // one tile of a pair's two strips
    let panels = per.div_ceil((KN_SLAB_BYTES / (KN_MIN_SLAB * pair_bytes)).max(1));
    let panel = per.div_ceil(panels);
    let slab = k_panels(kb, (KN_SLAB_BYTES / (panel * pair_bytes)).max(1));
    let mut c: Vec<f32> = Vec::with_capacity(mp * np);
    let cs = crate::ops::Shared::uninit(&mut c.spare_capacity_mut()[..mp * np]);
    (0..pairs.div_ceil(per)).into_par_iter().for_each(|t| {
        let cp = cs;
        let task = (t * per, ((t + 1) * per).min(pairs));
        // (column pairs, K tiles) of each slab this task packs, in order.
        let steps: Vec<((usize, usize), (usize, usize))> = (task.0..task.1)
            .step_by(panel)
            .flat_map(|q0| (0..kb).step_by(slab).map(move |k0| ((q0, (q0 + panel).min(task.1)), (k0, (k0 + slab).min(kb)))))
            .collect();
        SLAB.with(|buf| {
            let mut buf = buf.borrow_mut();
            for (i, &(qs, ks)) in steps.iter().enumerate() {
                // Strips one cache line longer than their tiles: 4 KB multiples apart, the
                // stores of a k pair's row into every strip would all fall in one cache set.
                let strip = (ks.1 - ks.0) * TM * TK + TK;
                // The next slab's part of W, asked for while this one computes.
                let next = match steps.get(i + 1) {
                    Some(&(nq, nk)) => Ahead::rows(w, n, nk.0 * TK, (nk.1 * TK).min(k), (nq.0 * 2 * TM, (nq.1 * 2 * TM).min(n))),
                    None => Ahead::rows(w, n, 0, 0, (0, 0)),
                };
                // SAFETY: AVX-512 F + BW are present (checked above); `fill_uninit` hands the
                // strips' 2 pairs x strip u16, every one stored by `strips_kn` (the tiles) or
                // zeroed here (each strip's last line, its pad, never read); `strips_kn` reads
                // rows of W [K, N] only (asserted above).
                fill_uninit(&mut buf, (qs.1 - qs.0) * 2 * strip, |d| unsafe {
                    simd_pack::strips_kn(w, k, n, qs.0, qs.1 - qs.0, ks, strip, d);
                    for s in 1..=2 * (qs.1 - qs.0) {
                        std::ptr::write_bytes(d.add(s * strip - TK), 0, TK);
                    }
                });
                // SAFETY: AVX512-BF16 is present (the kernel is supported); the task's C
                // columns are its own (disjoint pairs), every row of a panel's stored by its
                // first slab (ks.0 = 0); `ab` is [MP, KP]; `buf` holds the pairs' strips.
                unsafe { dot::run_slab(&ab, kp, m, &buf, strip, qs, ks, np, cp, next) };
            }
        });
    });
    // SAFETY: the tasks cover every column pair and the first slab stored the first M rows of
    // each (rows past M, the padding of A, are left unwritten and outside the length).
    unsafe { c.set_len(m * np) };
    Some(unpadded(c, m, n, np))
}

/// `f(bits, out, in)` on the bits of a frozen bf16 weight W [out, in] on CPU.
pub(crate) fn with_weight_bits<R>(w: &candle_core::Tensor, f: impl FnOnce(&[u16], usize, usize) -> R) -> candle_core::Result<R> {
    use half::slice::HalfFloatSliceExt;
    let (out, inp) = w.dims2()?;
    let w = w.contiguous()?;
    let (st, l) = w.storage_and_layout();
    let candle_core::Storage::Cpu(candle_core::CpuStorage::BF16(data)) = &*st else {
        candle_core::bail!("bf16 gemm: the weight must be bf16 on cpu, got {:?}", w.dtype())
    };
    let Some((o, e)) = l.contiguous_offsets() else { candle_core::bail!("bf16 gemm: the weight must be contiguous") };
    Ok(f(data[o..e].reinterpret_cast(), out, inp))
}

/// A frozen linear's matmul with a bf16 W [out, in] on CPU: x [M, in] · Wᵀ (`input_grad`
/// false; by [`gemm_wt`] where it applies, else on W packed), or g [M, out] · W (true).
pub fn linear(x: &[f32], m: usize, w: &candle_core::Tensor, input_grad: bool) -> candle_core::Result<Vec<f32>> {
    with_weight_bits(w, |bits, out, inp| {
        if input_grad {
            gemm_kn(x, m, bits, out, inp).unwrap_or_else(|| gemm(x, m, &PackedB::from_kn(bits, out, inp)))
        } else {
            gemm_wt(x, m, bits, out, inp).unwrap_or_else(|| gemm(x, m, &PackedB::from_nk(bits, out, inp)))
        }
    })
}

/// Whether [`tile_gemm`] and the `pack_*_into` packings run here: a bf16 unit (AMX, or
/// AVX512-BF16) and AVX-512 F, BW, DQ and VL (the packing and the attention strips'
/// element-wise code), which every CPU with either unit has.
pub(crate) fn tiles_available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| kernel().is_some() && simd_pack::available() && wide_simd())
}

/// AVX-512 DQ and VL, beside F and BW (`simd_pack::available`).
#[cfg(target_arch = "x86_64")]
fn wide_simd() -> bool {
    is_x86_feature_detected!("avx512dq") && is_x86_feature_detected!("avx512vl")
}

#[cfg(not(target_arch = "x86_64"))]
fn wide_simd() -> bool {
    false
}

/// `dst[i]` = the bf16 bits of `src[i]` (nearest-even; see `round_row` for subnormals).
pub(crate) fn round_into(src: &[f32], dst: &mut [u16]) {
    round_row(src, dst)
}

/// B = Wᵀ for W [N, K] (bf16 bits, row-major) packed into `dst` as [`tile_gemm`] reads it:
/// strips of 16 columns (N padded to 32 with zeros), each ⌈K/32⌉ tiles of 512 u16, K padded
/// with zeros. Returns the strip length in u16. One thread; `dst`'s memory is reused.
pub(crate) fn pack_nk_into(w: &[u16], n: usize, k: usize, dst: &mut Vec<u16>) -> usize {
    assert!(tiles_available() && w.len() >= n * k, "tile packing: W [{n}, {k}] in {} elements, or no bf16 unit", w.len());
    let strip = k.div_ceil(TK) * TM * TK;
    let pairs = n.div_ceil(2 * TM);
    fill_uninit(dst, pairs * 2 * strip, |d| {
        for pair in 0..pairs {
            // SAFETY: AVX-512 F + BW are present (tiles_available); `strips_nk` stores all
            // 2 * strip u16 of the pair's strips, inside `d`, and reads rows of W [N, K] only.
            unsafe { simd_pack::strips_nk(w, n, k, pair, d.add(2 * pair * strip)) };
        }
    });
    strip
}

/// B = W for W [K, N] (bf16 bits, row-major) packed into `dst` as [`tile_gemm`] reads it
/// (strips of 16 columns, N padded to 32, each ⌈K/32⌉ tiles). Returns the strip length in u16.
pub(crate) fn pack_kn_into(w: &[u16], k: usize, n: usize, dst: &mut Vec<u16>) -> usize {
    assert!(tiles_available() && w.len() >= n * k, "tile packing: W [{k}, {n}] in {} elements, or no bf16 unit", w.len());
    let strip = k.div_ceil(TK) * TM * TK;
    let pairs = n.div_ceil(2 * TM);
    // SAFETY: as in `pack_nk_into`, for `strips_kn` over all the pairs.
    fill_uninit(dst, pairs * 2 * strip, |d| unsafe { simd_pack::strips_kn(w, k, n, 0, pairs, (0, k.div_ceil(TK)), strip, d) });
    strip
}

/// `dst` as `len` elements, every one of which `fill` stores through the pointer it is handed.
fn fill_uninit(dst: &mut Vec<u16>, len: usize, fill: impl FnOnce(*mut u16)) {
    dst.clear();
    dst.reserve(len);
    fill(dst.spare_capacity_mut().as_mut_ptr().cast());
    // SAFETY: `fill` stored all `len` elements (the packings' contract).
    unsafe { dst.set_len(len) };
}

/// C [rows, cols] = A · B (or += with `accumulate`) on this process's bf16 unit (AMX tiles, or
/// the AVX512-BF16 kernel), on this thread, for operands the caller packed itself (the
/// attention strips): A [rows, 32 nk] bf16 bits row-major, `lda` u16 between rows; B as the
/// `pack_*_into` functions lay it out, `strip` u16 from one 16-column strip to the next, `nk`
/// tiles of K each; C f32 with `ldc` between rows. Rows and columns are multiples of 32.
#[allow(clippy::too_many_arguments)]
pub(crate) fn tile_gemm(a: &[u16], lda: usize, b: &[u16], strip: usize, nk: usize, (rows, cols): (usize, usize), c: &mut [f32], ldc: usize, accumulate: bool) {
    assert!(tiles_available(), "tile gemm: no bf16 unit (or no AVX-512 F, BW, DQ and VL) here");
    assert!(rows % (2 * TM) == 0 && cols % (2 * TM) == 0 && nk >= 1 && lda >= nk * TK && ldc >= cols && strip >= nk * TM * TK, "tile gemm: {rows} x {cols} over {nk} K tiles, lda {lda}, ldc {ldc}, strip {strip}");
    if rows == 0 || cols == 0 {
        return;
    }
    assert!(a.len() >= (rows - 1) * lda + nk * TK, "tile gemm: A short");
    assert!(b.len() >= (cols / TM - 1) * strip + nk * TM * TK, "tile gemm: B short");
    assert!(c.len() >= (rows - 1) * ldc + cols, "tile gemm: C short");
    // SAFETY: the kernel is this process's (enabled, supported); the asserts above keep every
    // block's reads inside A and B and its writes inside C, which the caller holds mutably.
    unsafe {
        match kernel() {
            Some(Kernel::Amx) => amx::strided(a.as_ptr(), lda, b.as_ptr(), strip, nk, (rows, cols), c.as_mut_ptr(), ldc, accumulate),
            _ => dot::strided(a.as_ptr(), lda, b.as_ptr(), strip, nk, (rows, cols), c.as_mut_ptr(), ldc, accumulate),
        }
    }
}

thread_local! {
    /// The A tiles of the task a thread runs last (AMX split by rows): kept, so the next
    /// task converts into memory that is already mapped and likely in cache.
    static TASK_A: std::cell::RefCell<Vec<u16>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The slab of packed W a [`gemm_kn`] task works on: kept, as `TASK_A`.
    static SLAB: std::cell::RefCell<Vec<u16>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A rounded to bf16 for the AMX kernel, in whole tiles: the 16-row groups `groups` of A
/// over its K tiles `ks`, laid out [group][K tile][16 rows][32 bf16] (1 KiB a tile, so a
/// tile load reads 1 KiB in a row: read from A's rows, 16 rows of 64 bytes KP apart, the
/// tile loads stalled), zeros past M and K.
struct ATiles {
    data: Vec<u16>,
    groups: (usize, usize),
    ks: (usize, usize),
}

impl ATiles {
    /// Converts A [M, K] (f32 row-major) into tiles, reusing `data`'s memory; the groups in
    /// parallel or on this thread.
    fn convert(a: &[f32], m: usize, k: usize, groups: (usize, usize), ks: (usize, usize), parallel: bool, mut data: Vec<u16>) -> Self {
        let per_group = (ks.1 - ks.0) * TM * TK;
        let len = (groups.1 - groups.0) * per_group;
        data.clear();
        data.reserve(len);
        let simd = crate::ops::cpu_bf16::avx512_bf16();
        let fill = |gi: usize, dst: &mut [std::mem::MaybeUninit<u16>]| {
            let g = groups.0 + gi;
            for r in 0..TM {
                let row = g * TM + r;
                let src: &[f32] = if row < m { &a[row * k..][..k] } else { &[] };
                // SAFETY: `dst` is one group: (ks.1 - ks.0) tiles of 16 rows of 32.
                unsafe { tile_rows(src, ks, &mut dst[r * TK..], simd) };
            }
        };
        let spare = &mut data.spare_capacity_mut()[..len];
        if parallel {
            spare.par_chunks_mut(per_group).enumerate().for_each(|(gi, d)| fill(gi, d));
        } else {
            spare.chunks_mut(per_group).enumerate().for_each(|(gi, d)| fill(gi, d));
        }
        // SAFETY: `tile_rows` wrote all 32 elements of each of the group's tile rows, i.e.
        // every element of 0..len.
        unsafe { data.set_len(len) };
        ATiles { data, groups, ks }
    }

    /// Index of tile (16-row group g, K tile kt) in `data`.
    fn tile(&self, g: usize, kt: usize) -> usize {
        debug_assert!((self.groups.0..self.groups.1).contains(&g) && (self.ks.0..self.ks.1).contains(&kt), "amx: A tile ({g}, {kt}) not converted");
        ((g - self.groups.0) * (self.ks.1 - self.ks.0) + kt - self.ks.0) * TM * TK
    }
}

/// One row of A (`src`: K f32, or empty for a padding row) into its row of each tile over
/// the K tiles `ks`: tile t's row is `dst[(t - ks.0) * 512..][..32]`, rounded to bf16, zeros
/// past K. `simd`: by AVX512-BF16 (the CPU must have it; see `round_row`), else `bf16_bits`.
///
/// # Safety
/// `dst` holds those rows; with `simd`, the CPU has AVX512F and AVX512-BF16.
unsafe fn tile_rows(src: &[f32], ks: (usize, usize), dst: &mut [std::mem::MaybeUninit<u16>], simd: bool) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        return tile_rows_avx512(src, ks, dst);
    }
    let _ = simd;
    for t in ks.0..ks.1 {
        let d = &mut dst[(t - ks.0) * TM * TK..][..TK];
        for (i, x) in d.iter_mut().enumerate() {
            x.write(src.get(t * TK + i).map_or(0, |&v| bf16_bits(v)));
        }
    }
}

/// [`tile_rows`] with masked loads (zeros past K) and `vcvtne2ps2bf16`.
///
/// # Safety
/// As `tile_rows` with `simd`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile_rows_avx512(src: &[f32], ks: (usize, usize), dst: &mut [std::mem::MaybeUninit<u16>]) {
    use std::arch::x86_64::*;
    let mask = |n: usize| if n >= 16 { u16::MAX } else { (1u16 << n) - 1 };
    for t in ks.0..ks.1 {
        let k0 = t * TK;
        let (lo_n, hi_n) = (src.len().saturating_sub(k0).min(16), src.len().saturating_sub(k0 + 16).min(16));
        // Masked-off lanes are not read, so the addresses past `src` are never touched.
        let lo = _mm512_maskz_loadu_ps(mask(lo_n), src.as_ptr().wrapping_add(k0));
        let hi = _mm512_maskz_loadu_ps(mask(hi_n), src.as_ptr().wrapping_add(k0 + 16));
        let r: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
        assert!((t - ks.0) * TM * TK + TK <= dst.len());
        _mm512_storeu_si512(dst.as_mut_ptr().add((t - ks.0) * TM * TK) as *mut _, r);
    }
}

/// How `gemm_with` shares a K panel between `threads`: by row blocks (true) or by column
/// pairs, and how many of them per task. Each task reads all of B when split by rows, all of
/// A by columns. Where one operand is four times the other or more (`mp`, `np`: A's and B's
/// padded rows and columns, both K long), the split re-reads the small one: a 48-row expert
/// against a 1408-column weight goes by columns, since by rows each task would stream the
/// whole 5.8 MB weight. Otherwise the split whose tasks (about two per thread) keep the threads
/// busiest wins (9 column pairs in tasks of 3 leave a thread idle a third of the time: 16 row
/// blocks of 4 do not), and between equally busy ones, the one that re-reads the smaller.
fn split(rows: usize, pairs: usize, mp: usize, np: usize, threads: usize) -> (bool, usize) {
    let threads = threads.max(1);
    // (busy fraction, units per task) of sharing `units` in tasks of about units / 2 threads.
    let busy = |units: usize| {
        let per = units.div_ceil(2 * threads).max(1);
        let rounds = units.div_ceil(per).div_ceil(threads);
        (units as f64 / (rounds * threads * per) as f64, per)
    };
    let (r, rper) = busy(rows);
    let (p, pper) = busy(pairs);
    let by_rows = if mp >= 4 * np && rows >= threads {
        true
    } else if np >= 4 * mp && pairs >= threads {
        false
    } else if (r - p).abs() > 0.05 {
        r > p
    } else {
        mp >= np
    };
    (by_rows, if by_rows { rper } else { pper })
}

/// Tiles per K panel: `kb` K tiles cut into the fewest panels of at most `most`, all of
/// about the same size (18 tiles with at most 16 are 9 + 9, not 16 + 2: a short last panel
/// costs a whole pass of C loads and stores for little work).
fn k_panels(kb: usize, most: usize) -> usize {
    kb.div_ceil(kb.div_ceil(most.max(1)).max(1)).max(1)
}

/// A must be exactly [M, K] for B's K: rows of another width would be read with the wrong
/// stride, not fail (`matmul` turns a mismatch into an error before it gets here).
fn check_a(a: &[f32], m: usize, b: &PackedB) {
    assert_eq!(a.len(), m * b.k, "bf16 gemm: A has {} elements, [{m}, {}] needs {}", a.len(), b.k, m * b.k);
}

/// The same products without a bf16 unit: bf16-rounded inputs, products summed in f32 in k
/// order (the units sum in another order and treat subnormals as zero, so results agree up
/// to rounding). Only reached if a caller skipped [`available`].
fn portable(a: &[f32], m: usize, b: &PackedB) -> Vec<f32> {
    check_a(a, m, b);
    let (k, n) = (b.k, b.n);
    let bf = |bits: u16| f32::from_bits((bits as u32) << 16);
    let mut c = vec![0f32; m * n];
    c.par_chunks_mut(n.max(1)).zip(a.par_chunks(k.max(1))).for_each(|(crow, arow)| {
        for (j, cv) in crow.iter_mut().enumerate() {
            let (nb, jj) = (j / TM, j % TM);
            *cv = (0..k).map(|kk| bf(bf16_bits(arow[kk])) * bf(b.tiles[b.index(nb, kk, jj)])).sum();
        }
    });
    c
}

/// Bytes of packed B a task keeps hot while its row blocks pass over it.
const B_PANEL_BYTES: usize = 512 << 10;

/// Column pairs (of 32) whose B tiles over the K tiles `ks` fit in `B_PANEL_BYTES`.
fn pairs_per_panel(ks: (usize, usize)) -> usize {
    let per_pair = 2 * (ks.1 - ks.0) * TM * TK * 2; // two strips of bf16
    (B_PANEL_BYTES / per_pair).max(1)
}

/// a [M, K] f32 (CPU) @ B -> [M, N] f32 as a tensor (no autograd: for closed-form gradients).
pub fn matmul(a: &candle_core::Tensor, b: &PackedB) -> candle_core::Result<candle_core::Tensor> {
    let (m, k) = a.dims2()?;
    if k != b.k {
        // gemm would read rows of another width with the wrong stride, not fail.
        candle_core::bail!("bf16 gemm: rows [{m}, {k}] do not match the packed weight's K {} (B [{}, {}])", b.k, b.k, b.n);
    }
    let a = a.contiguous()?;
    let (st, l) = a.storage_and_layout();
    let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(x)) = &*st else { candle_core::bail!("bf16 gemm: f32 cpu rows expected") };
    let Some((o, e)) = l.contiguous_offsets() else { candle_core::bail!("bf16 gemm: contiguous rows expected") };
    let out = gemm(&x[o..e], m, b);
    drop(st);
    candle_core::Tensor::from_vec(out, (m, b.n), a.device())
}

/// SIMD packing (AVX-512 F + BW; every CPU with a bf16 unit has them): the packing runs
/// on every call, over weights up to tens of MB, and the scalar loops moved 2-4 GB/s (a 48-row
/// expert GEMM of DeepSeek-V2-Lite spent 1.5x its GEMM time packing).
#[cfg(target_arch = "x86_64")]
mod simd_pack {
    use super::{TK, TM};
    use std::arch::x86_64::*;

    /// Are AVX-512 F and BW present?
    pub fn available() -> bool {
        static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *OK.get_or_init(|| is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw"))
    }

    /// Lanes `0..len` (at most 32) of a 32-lane mask.
    fn mask32(len: usize) -> u32 {
        if len >= 32 {
            u32::MAX
        } else {
            (1u32 << len) - 1
        }
    }

    /// Strips 2 `pair` and 2 `pair` + 1 of B = Wᵀ for W [N, K]: per K tile, 16 rows of W (32
    /// bf16 each, i.e. 16 k pairs as u32) transposed as a 16 x 16 matrix of u32, so that tile
    /// row p holds pair p of the 16 rows. Rows past N and k past K are zeros (masked loads).
    ///
    /// # Safety
    /// AVX-512 F + BW present; `w` holds [N, K]; `dst` points at the two strips' `2 kb * 512` u16.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn strips_nk(w: &[u16], n: usize, k: usize, pair: usize, dst: *mut u16) {
        let kb = k.div_ceil(TK);
        for half in 0..2 {
            let j0 = (2 * pair + half) * TM;
            let rows = TM.min(n.saturating_sub(j0));
            for t in 0..kb {
                let k0 = t * TK;
                let m = mask32(k - k0);
                let mut r = [_mm512_setzero_si512(); 16];
                for (j, v) in r.iter_mut().enumerate().take(rows) {
                    // SAFETY: the mask keeps the load inside row j0 + j of W [N, K].
                    *v = unsafe { _mm512_maskz_loadu_epi16(m, w.as_ptr().add((j0 + j) * k + k0).cast()) };
                    // The 16 rows are 16 streams, more than the hardware prefetcher follows
                    // well: ask for each row's line four tiles ahead (measured on Zen 4 with
                    // cold weights: 0.35 -> 0.25 ms for a 1408 x 2048 expert).
                    if k0 + 4 * TK < k {
                        _mm_prefetch::<_MM_HINT_T0>(w.as_ptr().wrapping_add((j0 + j) * k + k0 + 4 * TK).cast());
                    }
                }
                transpose_16x16_u32(&mut r);
                for (p, v) in r.iter().enumerate() {
                    // SAFETY: tile t's row p of strip `half`, inside the two strips.
                    unsafe { _mm512_storeu_si512(dst.add((half * kb + t) * TM * TK + p * TK).cast(), *v) };
                }
            }
        }
    }

    /// The strips of pairs first..first + pairs of B = W for W [K, N] over the K tiles `ks`:
    /// per k pair p and pair q, the 32 columns 32 (first + q).. of rows 2p and 2p + 1 (one
    /// cache line each) interleaved into a 64-byte tile row of each of the pair's two strips,
    /// each strip `ks.1 - ks.0` tiles long. Columns past N and rows past K are zeros.
    ///
    /// # Safety
    /// AVX-512 F + BW present; `w` holds [K, N]; `ks.1` is at most K's tiles; `dst` points at
    /// the `2 pairs` strips, `strip` u16 apart (at least `(ks.1 - ks.0) * 512`), of which the
    /// first `(ks.1 - ks.0) * 512` u16 of each are stored.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn strips_kn(w: &[u16], k: usize, n: usize, first: usize, pairs: usize, ks: (usize, usize), strip: usize, dst: *mut u16) {
        // Lane 2j takes column j of the even row (lanes 0..32 of the pair), lane 2j + 1 that of
        // the odd row (lanes 32..64): columns 0..16 for the first strip, 16..32 for the second.
        let lo = _mm512_set_epi16(
            47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, //
            39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0,
        );
        let hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
        for p in ks.0 * TM..ks.1 * TM {
            for q in 0..pairs {
                let c0 = (first + q) * 2 * TM;
                let m = mask32(n.saturating_sub(c0));
                // SAFETY: reads inside rows 2p, 2p + 1 of W [K, N] only.
                let (even, odd) = unsafe { (row32(w, k, n, 2 * p, c0, m), row32(w, k, n, 2 * p + 1, c0, m)) };
                // Rows kilobytes apart defeat the hardware prefetcher: ask for the lines eight
                // pairs ahead (measured on Zen 4 with cold weights: 0.50 -> 0.33 ms for a
                // 1408 x 2048 expert).
                if 2 * p + 17 < k && m != 0 {
                    let ahead = w.as_ptr().wrapping_add((2 * p + 16) * n + c0);
                    _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(n).cast());
                }
                // SAFETY: tile row p of each strip of pair q, inside the pairs' strips.
                unsafe {
                    let d = dst.add(2 * q * strip + (p - ks.0 * TM) * TK);
                    _mm512_storeu_si512(d.cast(), _mm512_permutex2var_epi16(even, lo, odd));
                    _mm512_storeu_si512(d.add(strip).cast(), _mm512_permutex2var_epi16(even, hi, odd));
                }
            }
        }
    }

    /// Columns c0.. of row kk of W [K, N] where `m` has lanes (zeros past K or N).
    ///
    /// # Safety
    /// AVX-512 BW present; `w` holds [K, N]; `m` has no lane at or past column N - c0.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn row32(w: &[u16], k: usize, n: usize, kk: usize, c0: usize, m: u32) -> __m512i {
        if kk < k && m != 0 {
            // SAFETY: the mask keeps the load inside row kk of W [K, N].
            unsafe { _mm512_maskz_loadu_epi16(m, w.as_ptr().add(kk * n + c0).cast()) }
        } else {
            _mm512_setzero_si512()
        }
    }

    /// dst rows 0..rows (stride `ldd`), 16 f32 each, from the 16 x 16 block at src (stride
    /// `lds`) transposed: dst[i][j] = src[j][i].
    ///
    /// # Safety
    /// AVX-512 F present; src holds 16 rows of 16 f32 at stride `lds`, dst `rows` (at most 16)
    /// rows of 16 at stride `ldd`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn transpose_block(src: *const f32, lds: usize, dst: *mut f32, ldd: usize, rows: usize) {
        let mut r = [_mm512_setzero_si512(); 16];
        for (j, v) in r.iter_mut().enumerate() {
            // SAFETY: row j of the block, inside src's 16 rows.
            *v = unsafe { _mm512_loadu_si512(src.add(j * lds).cast()) };
        }
        transpose_16x16_u32(&mut r);
        for (i, v) in r.iter().enumerate().take(rows) {
            // SAFETY: row i of dst, inside its `rows` rows.
            unsafe { _mm512_storeu_si512(dst.add(i * ldd).cast(), *v) };
        }
    }

    /// r[j] lane q <- r[q] lane j, for 16 vectors of 16 u32: unpack 32-bit and 64-bit pairs
    /// within 128-bit lanes (after which u[4i + c] lane L holds column 4L + c of rows
    /// 4i..4i + 4), then gather the four 128-bit lanes of each column.
    #[target_feature(enable = "avx512f")]
    fn transpose_16x16_u32(r: &mut [__m512i; 16]) {
        let mut t = [_mm512_setzero_si512(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        let mut u = [_mm512_setzero_si512(); 16];
        for i in 0..4 {
            u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
            u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
            u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
            u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
        }
        for c in 0..4 {
            let (a, b, cc, d) = (u[c], u[4 + c], u[8 + c], u[12 + c]);
            let x0 = _mm512_shuffle_i32x4::<0x44>(a, b); // [a0 a1 b0 b1]
            let x1 = _mm512_shuffle_i32x4::<0xEE>(a, b); // [a2 a3 b2 b3]
            let y0 = _mm512_shuffle_i32x4::<0x44>(cc, d); // [c0 c1 d0 d1]
            let y1 = _mm512_shuffle_i32x4::<0xEE>(cc, d); // [c2 c3 d2 d3]
            r[c] = _mm512_shuffle_i32x4::<0x88>(x0, y0); // [a0 b0 c0 d0]: column c
            r[4 + c] = _mm512_shuffle_i32x4::<0xDD>(x0, y0); // column 4 + c
            r[8 + c] = _mm512_shuffle_i32x4::<0x88>(x1, y1); // column 8 + c
            r[12 + c] = _mm512_shuffle_i32x4::<0xDD>(x1, y1); // column 12 + c
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod simd_pack {
    pub fn available() -> bool {
        false
    }
    pub unsafe fn strips_nk(_: &[u16], _: usize, _: usize, _: usize, _: *mut u16) {
        unreachable!("x86-64 only")
    }
    pub unsafe fn transpose_block(_: *const f32, _: usize, _: *mut f32, _: usize, _: usize) {
        unreachable!("x86-64 only")
    }
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn strips_kn(_: &[u16], _: usize, _: usize, _: usize, _: usize, _: (usize, usize), _: usize, _: *mut u16) {
        unreachable!("x86-64 only")
    }
}

/// The AMX kernel.
///
/// Invariant: every use of tile state is one `asm!` block, a whole tile program that loads
/// the tile configuration (`ldtilecfg`), zeroes or loads its accumulators, runs its k loop
/// of tile loads and `tdpbf16ps`, stores the accumulators and ends with `tilerelease`.
/// The compiler knows nothing of tile registers or the tile configuration: Rust's
/// inline-assembly rules make every register an `asm!` block does not name as an operand
/// undefined on entry, and tile registers cannot be operands. So no tile state is kept from
/// one `asm!` block to the next (an accumulator loaded in one block and used in another
/// would rely on exactly that), and none is left configured for code the compiler emits
/// around the blocks. The OS saves and restores the tile state across context switches
/// (XSAVE component 18, which `cpu_bf16::amx_detect_and_enable` asks Linux permission for).
#[cfg(target_arch = "x86_64")]
mod amx {
    use super::{ATiles, PackedB, TK, TM};
    use crate::ops::Shared;
    use std::arch::asm;

    /// Palette 1, eight tiles of 16 rows x 64 bytes.
    #[repr(C, align(64))]
    struct TileCfg([u8; 64]);

    fn config() -> TileCfg {
        let mut c = [0u8; 64];
        c[0] = 1;
        for t in 0..8 {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&64u16.to_le_bytes());
            c[48 + t] = TM as u8;
        }
        TileCfg(c)
    }

    /// Tiles of C for row blocks `rows` (of 32) x column pairs `pairs` (of 32), over the
    /// K tiles `ks`: C += A · B with `load` (C loaded first), else C = A · B.
    ///
    /// # Safety
    /// AMX is enabled (`available()`), `a` holds the tiles of the row blocks over `ks`, and `c`
    /// is an [MP, np] f32 buffer whose tiles in this range nobody else touches (initialised
    /// where `load`).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run_tiles(a: &ATiles, b: &PackedB, rows: (usize, usize), pairs: (usize, usize), ks: (usize, usize), np: usize, c: Shared, load: bool) {
        // An empty k range would run the tile loop 2^64 times (it counts down to zero);
        // `gemm_with` never makes one (K >= 1, panels are non-empty).
        assert!(ks.0 < ks.1, "amx: empty K panel {ks:?}");
        let cfg = config();
        let tile = TM * TK; // u16 per tile
        let panel = super::pairs_per_panel(ks);
        for p0 in (pairs.0..pairs.1).step_by(panel) {
            let p1 = (p0 + panel).min(pairs.1);
            for blk in rows.0..rows.1 {
                let r0 = blk * 2 * TM;
                // The 32-row band of C: rows r0.., columns 32 p0 .. 32 p1 (stride np).
                let c0 = c.ptr_at(r0 * np + p0 * 2 * TM, (2 * TM - 1) * np + (p1 - p0) * 2 * TM);
                // The tile loads read A's tiles of rows r0..r0 + 32 over K tiles ks, and the
                // strips of pairs p0..p1 up to K tile ks.1.
                let (a0, a1) = (a.tile(2 * blk, ks.0), a.tile(2 * blk + 1, ks.0));
                debug_assert!(a.tile(2 * blk + 1, ks.1 - 1) + tile <= a.data.len(), "amx: A tiles past the conversion");
                debug_assert!((2 * p1 - 1) * b.kb * tile + ks.1 * tile <= b.tiles.len() && ks.1 <= b.kb, "amx: B strips past the packing");
                let band = Band {
                    cfg: &cfg,
                    a: a.data.as_ptr().add(a0),
                    b: b.tiles.as_ptr().add(2 * p0 * b.kb * tile + ks.0 * tile),
                    c: c0,
                    nk: ks.1 - ks.0,
                    pairs: p1 - p0,
                    accumulate: load as usize,
                    a_half: (a1 - a0) * 2,
                    c_stride: np * 4,
                    strip: b.kb * tile * 2,
                    a_stride: TK * 2,
                    a_step: tile * 2,
                };
                band_program(&band);
            }
        }
    }

    /// Bands of Cᵀ = W · Aᵀ with W [N, K] (bf16, row-major) as the tiles' first operand read
    /// where it lies (tile rows K apart): bands `bands` (32 rows of W each) across all column
    /// pairs of `b` (Aᵀ packed), over the K tiles `ks` (= or += as `run_tiles`).
    ///
    /// # Safety
    /// AMX is enabled; W has the bands' rows, K a multiple of 32 (`k` elements a row, so no
    /// tile row reads past its row); `c` is a [N, np] f32 buffer whose bands in this range
    /// nobody else touches.
    pub unsafe fn run_w(w: &[u16], k: usize, b: &PackedB, bands: (usize, usize), ks: (usize, usize), np: usize, c: Shared) {
        assert!(ks.0 < ks.1 && k.is_multiple_of(TK), "amx: K panel {ks:?} of K {k}");
        let cfg = config();
        let tile = TM * TK; // u16 per tile
        let pairs = b.nb / 2;
        for blk in bands.0..bands.1 {
            let r0 = blk * 2 * TM;
            debug_assert!((r0 + 2 * TM - 1) * k + ks.1 * TK <= w.len(), "amx: W band past W");
            let band = Band {
                cfg: &cfg,
                a: w.as_ptr().add(r0 * k + ks.0 * TK),
                b: b.tiles.as_ptr().add(ks.0 * tile),
                c: c.ptr_at(r0 * np, (2 * TM - 1) * np + pairs * 2 * TM),
                nk: ks.1 - ks.0,
                pairs,
                accumulate: (ks.0 > 0) as usize,
                a_half: TM * k * 2,
                c_stride: np * 4,
                strip: b.kb * tile * 2,
                a_stride: k * 2,
                a_step: TK * 2,
            };
            band_program(&band);
        }
    }

    /// [`super::tile_gemm`]: one band program per 32 rows of a row-major A.
    ///
    /// # Safety
    /// AMX is enabled; A has `rows` rows of `32 nk` u16 `lda` apart, B `cols / 16` strips of
    /// `nk` tiles `strip` u16 apart, C `rows` rows of `cols` f32 `ldc` apart that nobody else
    /// touches; rows and cols are multiples of 32, nk >= 1.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn strided(a: *const u16, lda: usize, b: *const u16, strip: usize, nk: usize, (rows, cols): (usize, usize), c: *mut f32, ldc: usize, accumulate: bool) {
        let cfg = config();
        for band in 0..rows / (2 * TM) {
            let band = Band {
                cfg: &cfg,
                a: a.add(band * 2 * TM * lda),
                b,
                c: c.add(band * 2 * TM * ldc),
                nk,
                pairs: cols / (2 * TM),
                accumulate: accumulate as usize,
                a_half: TM * lda * 2,
                c_stride: ldc * 4,
                strip: strip * 2,
                a_stride: lda * 2,
                a_step: TK * 2,
            };
            band_program(&band);
        }
    }

    /// What one tile program works on: a band of 32 rows of C across `pairs` column pairs.
    /// Fields are read by offset from the assembly (`repr(C)`, all 8 bytes wide).
    #[repr(C)]
    struct Band {
        cfg: *const TileCfg,  // +0
        a: *const u16,        // +8: A's first K tile for rows 0-15 of the band
        b: *const u16,        // +16: the first pair's left strip at that K tile
        c: *mut f32,          // +24: C's top-left
        nk: usize,            // +32: K tiles, >= 1
        pairs: usize,         // +40: column pairs, >= 1
        accumulate: usize,    // +48: 1: C += A · B (C loaded first), 0: C = A · B
        a_half: usize,        // +56: bytes from A's tiles of rows 0-15 to those of rows 16-31
        c_stride: usize,      // +64: bytes between rows of C
        strip: usize,         // +72: bytes of one strip (a pair is two, side by side)
        a_stride: usize,      // +80: bytes between the rows of one A tile
        a_step: usize,        // +88: bytes from one K tile of A to the next
    }

    /// `prefetcht0` of the 16 lines of the tiles two K steps (2 KiB) ahead of each register
    /// named, one line of every register before the next line of any.
    macro_rules! prefetch_ahead {
        ($($r:ident),*) => {
            concat!(
                $("prefetcht0 [{", stringify!($r), "} + 2048]\n",)*
                $("prefetcht0 [{", stringify!($r), "} + 2112]\n",)*
                $("prefetcht0 [{", stringify!($r), "} + 2176]\n",)*
                $("prefetcht0 [{", stringify!($r), "} + 2240]\n",)*
                $("prefetcht0 [{", stringify!($r), "} + 2304]\n",)*
                $("prefetcht0 [{", stringify!($r), "} + 2368]\n",)*
                $("prefetcht0 [{", stringify!($r), "} + 2432]\n",)*
                $("prefetcht0 [{", stringify!($r), "} + 2496]\n",)*
                $("prefetcht0 [{", stringify!($r), "} + 2560]\n",)*
                $("prefetcht0 [{", stringify!($r), "} + 2624]\n",)*
                $("prefetcht0 [{", stringify!($r), "} + 2688]\n",)*
                $("prefetcht0 [{", stringify!($r), "} + 2752]\n",)*
                $("prefetcht0 [{", stringify!($r), "} + 2816]\n",)*
                $("prefetcht0 [{", stringify!($r), "} + 2880]\n",)*
                $("prefetcht0 [{", stringify!($r), "} + 2944]\n",)*
                $("prefetcht0 [{", stringify!($r), "} + 3008]\n",)*
            )
        };
    }

    /// The tile program of [`band_program`], with `prefetcht0` lines spliced into its k loop
    /// before the `tdpbf16ps`: the tiles two K steps ahead, 16 lines of 64 bytes each, of the
    /// B strips and (A in whole tiles) of A. Tile loads do not seem to train the L1 prefetchers:
    /// asking for both operands' next tiles ran the layer GEMMs ~13% and the LM head's 15-20%
    /// faster on a Xeon with AMX (2026-11-25, alternating runs of `bf16_gemm_speed`); B alone
    /// about half of that, one step ahead or four less.
    macro_rules! band_asm {
        ($band:expr, $prefetch:expr) => {
            asm!(
                "mov {x}, [{p}]",
                "ldtilecfg [{x}]",
                "mov {c}, [{p} + 24]",
                "mov {b}, [{p} + 16]",
                "mov {n}, [{p} + 40]",
                "mov {sb}, 64",                      // packed B tile rows are 64 bytes apart
                // One column pair per pass.
                "2:",
                "mov {s}, [{p} + 64]",               // s: C's row stride here, A's in the k loop
                "mov {x}, {s}",
                "shl {x}, 4",
                "add {x}, {c}",                      // x: C's row 16
                "cmp qword ptr [{p} + 48], 0",
                "je 4f",
                "tileloadd tmm0, [{c} + {s}*1]",
                "tileloadd tmm1, [{c} + {s}*1 + 64]",
                "tileloadd tmm2, [{x} + {s}*1]",
                "tileloadd tmm3, [{x} + {s}*1 + 64]",
                "jmp 5f",
                "4:",
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "5:",
                "mov {a0}, [{p} + 8]",
                "mov {a1}, [{p} + 56]",
                "add {a1}, {a0}",                    // A's tiles of rows 16-31
                "mov {b0}, {b}",
                "mov {b1}, {b}",
                "add {b1}, [{p} + 72]",              // the pair's right strip
                "mov {k}, [{p} + 32]",
                "mov {s}, [{p} + 80]",
                // The k loop: per K tile, both halves of A advance one K tile (`a_step`) and both
                // B strips one 1 KiB tile.
                "3:",
                "tileloadd tmm4, [{a0} + {s}*1]",
                "tileloadd tmm5, [{a1} + {s}*1]",
                "tileloadd tmm6, [{b0} + {sb}*1]",
                "tileloadd tmm7, [{b1} + {sb}*1]",
                $prefetch,
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "add {a0}, [{p} + 88]",
                "add {a1}, [{p} + 88]",
                "add {b0}, 1024",
                "add {b1}, 1024",
                "dec {k}",
                "jnz 3b",
                "mov {s}, [{p} + 64]",
                "mov {x}, {s}",
                "shl {x}, 4",
                "add {x}, {c}",
                "tilestored [{c} + {s}*1], tmm0",
                "tilestored [{c} + {s}*1 + 64], tmm1",
                "tilestored [{x} + {s}*1], tmm2",
                "tilestored [{x} + {s}*1 + 64], tmm3",
                "add {c}, 128",                      // the next 32 columns of C
                "add {b}, [{p} + 72]",
                "add {b}, [{p} + 72]",               // the next pair's strips
                "dec {n}",
                "jnz 2b",
                "tilerelease",
                p = in(reg) $band as *const Band,
                x = out(reg) _,
                c = out(reg) _,
                b = out(reg) _,
                n = out(reg) _,
                s = out(reg) _,
                sb = out(reg) _,
                a0 = out(reg) _,
                a1 = out(reg) _,
                b0 = out(reg) _,
                b1 = out(reg) _,
                k = out(reg) _,
                options(nostack)
            )
        };
    }

    /// One self-contained tile program for a band, as the module invariant says: for each
    /// column pair in turn, the 32 x 32 block of C (four 16 x 16 f32 tiles tmm0-3, zeroed, or
    /// loaded when accumulating) += Σ over the K tiles of A (tmm4: rows 0-15, tmm5: rows
    /// 16-31; 16 rows x 32 bf16 each) · B (tmm6, tmm7: the pair's two 16-column strips,
    /// VNNI-packed), then stored.
    ///
    /// One `ldtilecfg` / `tilerelease` per band, not per block: per block they were about a
    /// third of a 576-wide K's time on Sapphire Rapids-class hardware (measured 2026-11-25).
    ///
    /// # Safety
    /// AMX is enabled; the band's pointers are as its fields say: A has 32 rows of `nk` tiles
    /// (32 u16 each), each pair's strips `nk` tiles of 512 u16 (pairs follow each other,
    /// `2 * strip` bytes apart), C 32 rows of `32 * pairs` f32 touched by no one else.
    #[inline(always)]
    unsafe fn band_program(band: &Band) {
        if band.a_step == TM * TK * 2 {
            // A in whole tiles (`ATiles`): its next tiles are contiguous too.
            band_asm!(band, prefetch_ahead!(b0, b1, a0, a1));
        } else {
            band_asm!(band, prefetch_ahead!(b0, b1));
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod amx {
    use super::{ATiles, PackedB};
    use crate::ops::Shared;
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run_tiles(_: &ATiles, _: &PackedB, _: (usize, usize), _: (usize, usize), _: (usize, usize), _: usize, _: Shared, _: bool) {
        unreachable!("AMX is x86-64 only; available() is false here")
    }
    pub unsafe fn run_w(_: &[u16], _: usize, _: &PackedB, _: (usize, usize), _: (usize, usize), _: usize, _: Shared) {
        unreachable!("AMX is x86-64 only; available() is false here")
    }
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn strided(_: *const u16, _: usize, _: *const u16, _: usize, _: usize, _: (usize, usize), _: *mut f32, _: usize, _: bool) {
        unreachable!("AMX is x86-64 only; available() is false here")
    }
}

/// The AVX512-BF16 kernel: C blocks of 8 rows x 16 S columns (S = 1 to 3 strips) in zmm
/// accumulators.
#[cfg(target_arch = "x86_64")]
mod dot {
    use super::{PackedB, TK, TM};
    use crate::ops::Shared;
    use std::arch::x86_64::*;

    /// Rows of C per micro-block (up to four per 32-row block of A).
    pub const MR: usize = 8;

    /// C blocks for row blocks `rows` (of 32) x column pairs `pairs` (of 32) over the K tiles
    /// `ks`: C += A · B with `load`, else C = A · B. The same contract and walk as
    /// `amx::run_tiles`, so `run_into` drives both.
    ///
    /// # Safety
    /// AVX512-BF16 is present (`detect()`), `ab` is [MP, kp] bf16 covering the row blocks, and
    /// `c` is an [MP, np] f32 buffer whose blocks in this range nobody else touches (initialised
    /// where `load`).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run_blocks(ab: &[u16], kp: usize, b: &PackedB, rows: (usize, usize), pairs: (usize, usize), ks: (usize, usize), np: usize, c: Shared, load: bool) {
        let tile = TM * TK; // u16 per tile
        let mp = ab.len() / kp; // rows of A (and C), a multiple of MR
        let panel = super::pairs_per_panel(ks);
        for p0 in (pairs.0..pairs.1).step_by(panel) {
            let p1 = (p0 + panel).min(pairs.1);
            for blk in rows.0..rows.1 {
                // The last block of 32 rows stops at MP (M padded to MR only).
                for r0 in (blk * 2 * TM..(blk + 1) * 2 * TM).step_by(MR).take_while(|&r0| r0 < mp) {
                    // `micro` reads A rows r0..r0 + 8 up to K tile ks.1, and both B strips
                    // of each pair up to K tile ks.1.
                    debug_assert!((r0 + MR - 1) * kp + ks.1 * TK <= ab.len() && ks.1 * TK <= kp, "avx512-bf16: A block past [MP, kp]");
                    debug_assert!((2 * p1 - 1) * b.kb * tile + ks.1 * tile <= b.tiles.len() && ks.1 <= b.kb, "avx512-bf16: B strips past the packing");
                    let a = ab.as_ptr().add(r0 * kp);
                    for pair in p0..p1 {
                        let bn = 2 * pair;
                        let b0 = b.tiles.as_ptr().add(bn * b.kb * tile);
                        let b1 = b0.add(b.kb * tile);
                        // The 8 x 32 block of C at rows r0.., columns 16 bn.. (stride np).
                        let cb = c.ptr_at(r0 * np + bn * TM, (MR - 1) * np + 2 * TM);
                        micro::<MR, 2, false>(a, kp, [b0, b1], ks, cb, np, load);
                    }
                }
            }
        }
    }

    /// Cᵀ [N, ns] = (over the K tiles `ks`; += past the first) W [N, K] · Aᵀ for the W row
    /// blocks `blocks` (of MR rows), W read where it lies as the left operand (a W row's k
    /// pair is one 32-bit broadcast, as an A row's is in `run_blocks`), Aᵀ packed as B with
    /// `ns / 16` strips (M columns, the last strip padded with zeros). Strips go three at a
    /// time (24 accumulators), so M = 48 runs as 48. A last strip with at most 8 of the `m`
    /// columns runs as 8 ([`micro_half`]: half the products, where it ran as 16 and wasted
    /// 16% of a DeepSeek-V2-Lite MoE step's routed-expert forward products on padding).
    ///
    /// # Safety
    /// AVX512-BF16 is present; `w` holds the rows of the blocks, `k` is `b.kb * TK` (W's K a
    /// multiple of 32); `b` has at least `ns / 16` strips, `ns` is `m` rounded up to 16; `c`
    /// is an [N, ns] f32 buffer whose rows of these blocks nobody else touches.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run_w(w: &[u16], k: usize, b: &PackedB, m: usize, blocks: (usize, usize), ks: (usize, usize), ns: usize, c: Shared) {
        let strip = b.kb * TM * TK;
        let strips = ns / TM;
        debug_assert!(k == b.kb * TK && strips <= b.nb && w.len() >= blocks.1 * MR * k && ns == m.next_multiple_of(TM), "avx512-bf16: W or Aᵀ short");
        let half = m > 0 && (m - 1) % TM < TM / 2 && super::wide_simd();
        let full = strips - usize::from(half);
        for blk in blocks.0..blocks.1 {
            let a = w.as_ptr().add(blk * MR * k);
            let bs = |s: usize| b.tiles.as_ptr().add(s * strip);
            for s0 in (0..full).step_by(3) {
                let bs = |s: usize| bs(s0 + s);
                let cb = c.ptr_at(blk * MR * ns + s0 * TM, (MR - 1) * ns + (full - s0).min(3) * TM);
                // The first pass over a block streams its W rows from memory: ask for them
                // ahead (later strips find them in L1).
                match (full - s0, s0 == 0) {
                    (1, true) => micro::<MR, 1, true>(a, k, [bs(0)], ks, cb, ns, ks.0 > 0),
                    (1, false) => micro::<MR, 1, false>(a, k, [bs(0)], ks, cb, ns, ks.0 > 0),
                    (2, true) => micro::<MR, 2, true>(a, k, [bs(0), bs(1)], ks, cb, ns, ks.0 > 0),
                    (2, false) => micro::<MR, 2, false>(a, k, [bs(0), bs(1)], ks, cb, ns, ks.0 > 0),
                    (_, true) => micro::<MR, 3, true>(a, k, [bs(0), bs(1), bs(2)], ks, cb, ns, ks.0 > 0),
                    (_, false) => micro::<MR, 3, false>(a, k, [bs(0), bs(1), bs(2)], ks, cb, ns, ks.0 > 0),
                }
            }
            if half {
                let cb = c.ptr_at(blk * MR * ns + full * TM, (MR - 1) * ns + TM);
                match full {
                    0 => micro_half::<true>(a, k, bs(full), ks, cb, ns, ks.0 > 0),
                    _ => micro_half::<false>(a, k, bs(full), ks, cb, ns, ks.0 > 0),
                }
            }
        }
    }

    /// C += A · B (C = A · B for the first slab, `ks.0` 0) for the column pairs `pairs` of C
    /// over the K tiles `ks`, every 8-row block of A, B being those pairs' strips of this slab
    /// only (`strips_kn` over `ks`: `2 (ks.1 - ks.0)` tiles a pair).
    ///
    /// Only the first `m` rows of C are computed: the last block of an expert's rows runs as
    /// the rows it has (an expert's M is padded to 8 for nothing else: 7% of the routed
    /// experts' input-gradient products were of zero rows in a DeepSeek-V2-Lite MoE step).
    ///
    /// # Safety
    /// AVX512-BF16 is present; `ab` is [MP, kp] bf16 (MP `m` rounded up to MR) with `ks.1` at
    /// most kp's tiles; `slab` holds the pairs' strips, `strip` u16 apart; `c` is an [MP, np]
    /// f32 buffer whose columns of these pairs nobody else touches.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run_slab(ab: &[u16], kp: usize, m: usize, slab: &[u16], strip: usize, pairs: (usize, usize), ks: (usize, usize), np: usize, c: Shared, mut next: super::Ahead) {
        let mp = ab.len() / kp;
        debug_assert!(slab.len() >= (pairs.1 - pairs.0) * 2 * strip && ks.1 * TK <= kp && m <= mp && mp <= m.next_multiple_of(MR), "avx512-bf16: slab or A short");
        // The pairs' strips three at a time (24 accumulators: 8 broadcasts feed 24 products,
        // not 16), `next`'s lines spread evenly over the micro-blocks.
        let strips = 2 * (pairs.1 - pairs.0);
        let per_block = next.total().div_ceil((strips.div_ceil(3) * mp / MR).max(1));
        let kt = (0, ks.1 - ks.0);
        for s0 in (0..strips).step_by(3) {
            let bs = |s: usize| slab.as_ptr().add((s0 + s) * strip);
            let cols = (strips - s0).min(3) * TM;
            for r0 in (0..m).step_by(MR) {
                next.next(per_block);
                let rows = MR.min(m - r0);
                let a = ab.as_ptr().add(r0 * kp + ks.0 * TK);
                let cb = c.ptr_at(r0 * np + pairs.0 * 2 * TM + s0 * TM, (rows - 1) * np + cols);
                match strips - s0 {
                    1 => micro_rows::<1>(rows, a, kp, [bs(0)], kt, cb, np, ks.0 > 0),
                    2 => micro_rows::<2>(rows, a, kp, [bs(0), bs(1)], kt, cb, np, ks.0 > 0),
                    _ => micro_rows::<3>(rows, a, kp, [bs(0), bs(1), bs(2)], kt, cb, np, ks.0 > 0),
                }
            }
        }
    }

    /// C [rows, cols] = (or += with `accumulate`) A · B for operands a caller packed itself,
    /// as `amx::strided` takes them (see `tile_gemm`): 8-row blocks of A across B's column
    /// pairs.
    ///
    /// # Safety
    /// AVX512-BF16 is present; A holds `rows` rows of `nk` K tiles (stride `lda`), B
    /// `cols / 16` strips of `nk` tiles (`strip` apart), C `rows` rows of `cols` (stride
    /// `ldc`); rows and cols are multiples of 32.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn strided(a: *const u16, lda: usize, b: *const u16, strip: usize, nk: usize, (rows, cols): (usize, usize), c: *mut f32, ldc: usize, accumulate: bool) {
        for r0 in (0..rows).step_by(MR) {
            for pair in 0..cols / (2 * TM) {
                let b0 = b.add(2 * pair * strip);
                micro::<MR, 2, false>(a.add(r0 * lda), lda, [b0, b0.add(strip)], (0, nk), c.add(r0 * ldc + pair * 2 * TM), ldc, accumulate);
            }
        }
    }

    /// [`micro`] for one strip's first 8 columns (C [8, 16], row stride `ldc`: its first 8
    /// columns computed, the other 8 stored as zeros), on 256-bit vectors: half a 512-bit
    /// `vdpbf16ps`'s work, and on Zen 4, which runs a 512-bit one as two 256-bit halves, half
    /// its time. The same sums, lane for lane, as the 512-bit kernel's first 8 columns.
    ///
    /// # Safety
    /// As `micro` with S = 1, and AVX-512 VL present.
    #[target_feature(enable = "avx512f,avx512bf16,avx512vl")]
    unsafe fn micro_half<const PREFETCH_A: bool>(a: *const u16, lda: usize, b: *const u16, ks: (usize, usize), c: *mut f32, ldc: usize, load: bool) {
        let mut acc = [_mm256_setzero_ps(); MR];
        if load {
            for (r, v) in acc.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(c.add(r * ldc));
            }
        }
        let tile = TM * TK;
        for kb in ks.0..ks.1 {
            if PREFETCH_A {
                // As `micro`: the next block's rows of W, this K tile's line of each.
                for r in MR..2 * MR {
                    _mm_prefetch::<_MM_HINT_T1>(a.wrapping_add(r * lda + kb * TK).cast());
                }
            }
            for p in 0..TM {
                // The first 8 columns' k pairs: the first 32 bytes of the 64-byte VNNI row.
                let ws = std::mem::transmute::<__m256i, __m256bh>(_mm256_loadu_si256(b.add(kb * tile + p * TK) as *const _));
                let kk = kb * TK + 2 * p;
                for (r, v) in acc.iter_mut().enumerate() {
                    let pair = (a.add(r * lda + kk) as *const i32).read_unaligned();
                    *v = _mm256_dpbf16_ps(*v, std::mem::transmute::<__m256i, __m256bh>(_mm256_set1_epi32(pair)), ws);
                }
            }
        }
        for (r, v) in acc.iter().enumerate() {
            _mm256_storeu_ps(c.add(r * ldc), *v);
            _mm256_storeu_ps(c.add(r * ldc + TM / 2), _mm256_setzero_ps());
        }
    }

    /// [`micro`] on the first `rows` (1 to 8) rows of a block.
    ///
    /// # Safety
    /// As `micro`, for `rows` rows of A and C.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    unsafe fn micro_rows<const S: usize>(rows: usize, a: *const u16, lda: usize, b: [*const u16; S], ks: (usize, usize), c: *mut f32, ldc: usize, load: bool) {
        match rows {
            1 => micro::<1, S, false>(a, lda, b, ks, c, ldc, load),
            2 => micro::<2, S, false>(a, lda, b, ks, c, ldc, load),
            3 => micro::<3, S, false>(a, lda, b, ks, c, ldc, load),
            4 => micro::<4, S, false>(a, lda, b, ks, c, ldc, load),
            5 => micro::<5, S, false>(a, lda, b, ks, c, ldc, load),
            6 => micro::<6, S, false>(a, lda, b, ks, c, ldc, load),
            7 => micro::<7, S, false>(a, lda, b, ks, c, ldc, load),
            _ => micro::<MR, S, false>(a, lda, b, ks, c, ldc, load),
        }
    }

    /// C [R, 16 S] (row stride `ldc`) = (or += with `load`) A [R, K tiles ks] · B [K tiles ks,
    /// 16 S], B given as its S 16-column tile strips `b`. A's k pairs are 32-bit broadcasts
    /// from rows of stride `lda`. `PREFETCH_A`: A is W read from memory (`run_w`), and the
    /// next 8 rows are asked for as these run.
    ///
    /// # Safety
    /// As `run_blocks` / `run_w` / `strided`; `a` points at R rows of stride `lda`, `c` at R
    /// rows of 16 S (stride `ldc`).
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn micro<const R: usize, const S: usize, const PREFETCH_A: bool>(a: *const u16, lda: usize, b: [*const u16; S], ks: (usize, usize), c: *mut f32, ldc: usize, load: bool) {
        let mut acc = [[_mm512_setzero_ps(); S]; R];
        if load {
            for (r, row) in acc.iter_mut().enumerate() {
                for (s, v) in row.iter_mut().enumerate() {
                    *v = _mm512_loadu_ps(c.add(r * ldc + s * TM));
                }
            }
        }
        let tile = TM * TK;
        let mut w: [__m512bh; S] = [std::mem::transmute::<__m512i, __m512bh>(_mm512_setzero_si512()); S];
        for kb in ks.0..ks.1 {
            if PREFETCH_A {
                // A K tile of a row is one cache line: the same line of each row of the next
                // block of MR rows (the next 8 rows of W in `run_w`), so that block streams
                // into L2 while this one computes. Lines a few tiles ahead in the same rows
                // measured no faster: 8 rows 4 KB apart are 8 streams the hardware prefetcher
                // already follows, 8 rows further on are the block it cannot foresee.
                for r in MR..2 * MR {
                    _mm_prefetch::<_MM_HINT_T1>(a.wrapping_add(r * lda + kb * TK).cast());
                }
            }
            for p in 0..TM {
                // One k pair for 16 columns of each strip: 64 bytes, the VNNI row.
                for (s, ws) in w.iter_mut().enumerate() {
                    *ws = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(b[s].add(kb * tile + p * TK) as *const _));
                }
                let kk = kb * TK + 2 * p;
                for (r, row) in acc.iter_mut().enumerate() {
                    // A[r, kk] and A[r, kk + 1] are adjacent bf16: one 32-bit broadcast.
                    let pair = (a.add(r * lda + kk) as *const i32).read_unaligned();
                    let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                    for (v, &ws) in row.iter_mut().zip(&w) {
                        *v = _mm512_dpbf16_ps(*v, x, ws);
                    }
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (s, v) in row.iter().enumerate() {
                _mm512_storeu_ps(c.add(r * ldc + s * TM), *v);
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod dot {
    use super::PackedB;
    use crate::ops::Shared;
    pub const MR: usize = 8;
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run_blocks(_: &[u16], _: usize, _: &PackedB, _: (usize, usize), _: (usize, usize), _: (usize, usize), _: usize, _: Shared) {
        unreachable!("AVX512-BF16 is x86-64 only; Kernel::supported() is false here")
    }
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run_w(_: &[u16], _: usize, _: &PackedB, _: usize, _: (usize, usize), _: (usize, usize), _: usize, _: Shared) {
        unreachable!("AVX512-BF16 is x86-64 only; Kernel::supported() is false here")
    }
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run_slab(_: &[u16], _: usize, _: usize, _: &[u16], _: usize, _: (usize, usize), _: (usize, usize), _: usize, _: Shared, _: super::Ahead) {
        unreachable!("AVX512-BF16 is x86-64 only; Kernel::supported() is false here")
    }
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn strided(_: *const u16, _: usize, _: *const u16, _: usize, _: usize, _: (usize, usize), _: *mut f32, _: usize, _: bool) {
        unreachable!("AVX512-BF16 is x86-64 only; Kernel::supported() is false here")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf(x: f32) -> f32 {
        f32::from_bits((bf16_bits(x) as u32) << 16)
    }

    /// Reference: the same bf16-rounded inputs, products summed in f64.
    fn reference(a: &[f32], w_nk: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        let mut c = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k).map(|p| bf(a[i * k + p]) as f64 * bf(w_nk[j * k + p]) as f64).sum();
                c[i * n + j] = s as f32;
            }
        }
        c
    }

    fn data(len: usize, seed: u32) -> Vec<f32> {
        (0..len).map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 2001) as f32 / 1000.0 - 1.0).collect()
    }

    #[test]
    fn bf16_rounding_is_nearest_even() {
        assert_eq!(bf16_bits(1.0), 0x3f80);
        // 1 + 2^-8 is exactly half-way between 1 and 1 + 2^-7: ties go to even (1.0).
        assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(bf16_bits(1.0 + 3.0 / 256.0), 0x3f82);
        assert!(f32::from_bits((bf16_bits(f32::NAN) as u32) << 16).is_nan());
    }

    /// Ragged edges; many row blocks (split by rows); few rows against many columns (split by
    /// columns, as for the LM head); K over one panel of either kernel (C reloaded between
    /// panels). (33, 40, 65): odd K over two K tiles and rows not a multiple of 8; (8, 0, 7):
    /// no columns; (256, 1100, 1100): a task walks B in several panels (`pairs_per_panel`).
    /// The last two have K past one AMX panel (2048), split by rows and by columns on two
    /// threads.
    const SHAPES: [(usize, usize, usize); 15] =
        [(3, 4, 0), (0, 4, 5), (8, 0, 7), (1, 1, 1), (5, 7, 3), (33, 17, 40), (33, 40, 65), (64, 64, 64), (70, 48, 96), (256, 192, 576), (40, 1000, 70), (20, 48, 1700), (256, 1100, 1100), (200, 20, 2100), (20, 1000, 2100)];

    /// `gemm` (a kernel, or the portable loop) against the f64 reference on every shape of
    /// `SHAPES`, with B packed both ways.
    fn matches_the_reference_on_ragged_shapes(name: &str, gemm: impl Fn(&[f32], usize, &PackedB) -> Vec<f32>) {
        for &(m, n, k) in &SHAPES {
            let a = data(m * k, 1);
            let w = data(n * k, 7); // W [N, K]
            let want = reference(&a, &w, m, n, k);
            let wb: Vec<u16> = w.iter().map(|&x| bf16_bits(x)).collect();
            let got = gemm(&a, m, &PackedB::from_nk(&wb, n, k));
            // The same B given as [K, N] (Wᵀ materialised) must pack to the same product.
            let got2 = gemm(&a, m, &PackedB::from_kn(&transpose(&wb, n, k), k, n));
            assert_eq!((got.len(), got2.len()), (m * n, m * n));
            let tol = 1e-5 * k as f32;
            let mut worst = 0f32;
            for (idx, ((g, g2), r)) in got.iter().zip(&got2).zip(&want).enumerate() {
                assert!((g - r).abs() <= tol, "{name} {m}x{n}x{k} from_nk: C[{idx}] = {g}, reference {r}");
                assert!((g2 - r).abs() <= tol, "{name} {m}x{n}x{k} from_kn: C[{idx}] = {g2}, reference {r}");
                worst = worst.max((g - r).abs());
            }
            println!("{name} {m}x{n}x{k}: max |C - reference| {worst:e}");
        }
    }

    /// Where build.rs found the unit but this process cannot use it, the test must fail, not
    /// pass vacuously: a binary built on another CPU, or an OS that refused tile permission.
    fn here(kern: Kernel) -> Kernel {
        assert!(kern.supported(), "built where {} was found (cfg from build.rs) but this CPU/OS cannot run it: rebuild on this machine", kern.name());
        kern
    }

    #[test]
    #[cfg_attr(not(bf16_amx), ignore = "needs AMX-BF16 (and Linux's tile permission)")]
    fn the_amx_kernel_matches_a_bf16_reference_on_ragged_shapes_both_packings() {
        let kern = here(Kernel::Amx);
        matches_the_reference_on_ragged_shapes("Amx", |a, m, b| gemm_with(kern, a, m, b));
    }

    #[test]
    #[cfg_attr(not(bf16_avx512), ignore = "needs AVX512-BF16")]
    fn the_avx512_bf16_kernel_matches_a_bf16_reference_on_ragged_shapes_both_packings() {
        let kern = here(Kernel::Avx512Bf16);
        matches_the_reference_on_ragged_shapes("Avx512Bf16", |a, m, b| gemm_with(kern, a, m, b));
    }

    /// Runs on every CPU: the portable loop computes the kernels' sums from the same packing.
    #[test]
    fn the_portable_fallback_matches_a_bf16_reference_on_ragged_shapes_both_packings() {
        matches_the_reference_on_ragged_shapes("portable", portable);
    }

    #[test]
    #[cfg_attr(not(bf16_avx512), ignore = "needs AVX512-BF16 (elsewhere round_row is the scalar loop it is compared with)")]
    fn rounding_a_row_by_simd_gives_the_scalar_bits_except_subnormals_read_as_zero() {
        assert!(crate::ops::cpu_bf16::avx512_bf16(), "build.rs found AVX512-BF16 but this process has none");
        // Ties both ways, values next to them, NaN, infinities, the largest finite, signed
        // zeros and f32 subnormals; 70 values: two 32-lane blocks and a scalar tail.
        let mut src: Vec<f32> = vec![
            f32::from_bits(0x3f80_8000), f32::from_bits(0x3f81_8000), f32::from_bits(0x3f80_8001), f32::from_bits(0x3f80_7fff),
            f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, -f32::MAX, 0.0, -0.0,
            f32::from_bits(1), -f32::from_bits(0x0040_0000), f32::from_bits(0x007f_ffff),
        ];
        src.extend(data(70 - src.len(), 3).iter().map(|x| x * 1e3));
        let mut got = vec![0u16; src.len()];
        round_row(&src, &mut got);
        for (i, (&x, &g)) in src.iter().zip(&got).enumerate() {
            let want = if x.is_subnormal() { ((x.to_bits() >> 16) & 0x8000) as u16 } else { bf16_bits(x) };
            assert_eq!(g, want, "element {i}: {x:e} rounded to {g:#06x}, want {want:#06x}");
        }
    }

    #[test]
    fn a_tiles_hold_each_row_of_a_where_the_tile_layout_says_and_zeros_elsewhere() {
        let (m, k) = (37, 70); // 3 groups of 16 rows (11 padding rows), 3 K tiles (26 padding)
        let a = data(m * k, 5);
        for parallel in [false, true] {
            let at = ATiles::convert(&a, m, k, (0, 3), (0, 3), parallel, vec![7; 5]);
            let part = ATiles::convert(&a, m, k, (1, 3), (1, 3), parallel, Vec::new());
            assert_eq!(at.data.len(), 3 * 3 * TM * TK);
            for g in 0..3 {
                for t in 0..3 {
                    for r in 0..TM {
                        for c in 0..TK {
                            let (row, col) = (g * TM + r, t * TK + c);
                            let want = if row < m && col < k { bf16_bits(a[row * k + col]) } else { 0 };
                            assert_eq!(at.data[at.tile(g, t) + r * TK + c], want, "A[{row}, {col}] (parallel {parallel})");
                            if g >= 1 && t >= 1 {
                                assert_eq!(part.data[part.tile(g, t) + r * TK + c], want, "A[{row}, {col}] in part");
                            }
                        }
                    }
                }
            }
        }
    }

    /// The scalar loop (CPUs with AMX but no AVX512-BF16, if any) writes the bits the
    /// AVX512-BF16 one does.
    #[test]
    #[cfg_attr(not(bf16_avx512), ignore = "needs AVX512-BF16 for the loop the scalar one is compared with")]
    fn a_tile_row_by_simd_gives_the_scalar_loop_s_bits() {
        assert!(crate::ops::cpu_bf16::avx512_bf16(), "build.rs found AVX512-BF16 but this process has none");
        let k = 70;
        let a = data(k, 5);
        let row = &a[..k];
        let mut simd = vec![std::mem::MaybeUninit::new(1u16); 3 * TM * TK];
        let mut scalar = vec![std::mem::MaybeUninit::new(2u16); 3 * TM * TK];
        // SAFETY: both hold three tiles; the CPU has AVX512-BF16 (asserted above).
        unsafe {
            tile_rows(row, (0, 3), &mut scalar, false);
            tile_rows(row, (0, 3), &mut simd, true);
        }
        for t in 0..3 {
            for c in 0..TK {
                let i = t * TM * TK + c;
                // SAFETY: tile_rows wrote the first row of each tile.
                let (x, y) = unsafe { (simd[i].assume_init(), scalar[i].assume_init()) };
                assert_eq!(x, y, "tile {t}, column {c}");
            }
        }
    }

    /// `tile_gemm` (the attention strips' GEMM, on this process's kernel) on operands laid out
    /// with room to spare (A rows `lda` > K apart, C rows `ldc` > N apart, B from a pair past
    /// the first): within the f64 reference's tolerance, the padding of A and C untouched; on
    /// the dot kernel bit for bit `gemm_with`'s; and K run as two calls, the second
    /// accumulating, gives the one call's bits (C stored and reloaded exactly).
    #[test]
    #[cfg_attr(not(bf16_unit), ignore = "needs a bf16 unit (build.rs found none on this machine)")]
    fn tile_gemm_matches_the_packed_gemm_and_accumulates_exactly() {
        let kern = here(kernel().expect("build.rs found a bf16 unit but this process has none"));
        let (m, n, k, nk1) = (64, 64, 160, 2); // 5 K tiles: 2 + 3
        let (lda, ldc) = (k + 32, n + 32);
        let a: Vec<f32> = data(m * k, 21).iter().map(|&x| bf(x)).collect(); // exact in bf16
        let w: Vec<u16> = data((n + 32) * k, 22).iter().map(|&x| bf16_bits(x)).collect(); // W [N + 32, K]
        let mut ab = vec![0u16; m * lda];
        for r in 0..m {
            for c in 0..k {
                ab[r * lda + c] = bf16_bits(a[r * k + c]);
            }
        }
        let mut packed = Vec::new();
        let strip = pack_nk_into(&w, n + 32, k, &mut packed);
        let b = &packed[2 * strip..]; // the second pair on: W's rows 32..
        let want_w = &w[32 * k..];
        let sentinel = 7.0f32;
        let run = |split: bool| {
            let mut c = vec![sentinel; m * ldc];
            if split {
                tile_gemm(&ab, lda, b, strip, nk1, (m, n), &mut c, ldc, false);
                tile_gemm(&ab[nk1 * TK..], lda, &b[nk1 * TM * TK..], strip, k / TK - nk1, (m, n), &mut c, ldc, true);
            } else {
                tile_gemm(&ab, lda, b, strip, k / TK, (m, n), &mut c, ldc, false);
            }
            c
        };
        let (whole, split) = (run(false), run(true));
        let wf: Vec<f32> = want_w.iter().map(|&x| f32::from_bits((x as u32) << 16)).collect();
        let reference = reference(&a, &wf[..n * k], m, n, k);
        let packed_gemm = gemm_with(kern, &a, m, &PackedB::from_nk(want_w, n, k));
        for r in 0..m {
            for j in 0..ldc {
                let (g, g2) = (whole[r * ldc + j], split[r * ldc + j]);
                if j >= n {
                    assert!(g == sentinel && g2 == sentinel, "C[{r}, {j}] past N was written");
                    continue;
                }
                let want = reference[r * n + j];
                assert!((g - want).abs() <= 1e-5 * k as f32, "{kern:?} C[{r}, {j}] = {g}, reference {want}");
                assert_eq!(g.to_bits(), g2.to_bits(), "{kern:?} C[{r}, {j}]: K in two calls {g2}, one call {g}");
                if kern == Kernel::Avx512Bf16 {
                    assert_eq!(g.to_bits(), packed_gemm[r * n + j].to_bits(), "C[{r}, {j}] = {g}, gemm_with {}", packed_gemm[r * n + j]);
                }
            }
        }
    }

    /// `gemm_acc` stores `gemm`'s bits in the top-left [M, N] of its padded C, and, when
    /// accumulating, adds the same products to what C holds: onto zeros the same bits again
    /// (the kernels start from zero too), onto X within rounding of X + A · B. Shapes with
    /// rows and columns to pad, and K over one panel of either kernel.
    #[test]
    #[cfg_attr(not(bf16_unit), ignore = "needs a bf16 unit (build.rs found none on this machine)")]
    fn gemm_acc_stores_the_gemms_bits_and_adds_its_products_to_c() {
        here(kernel().expect("build.rs found a bf16 unit but this process has none"));
        for &(m, n, k) in &[(33, 40, 65), (45, 48, 96), (20, 1000, 2100), (256, 192, 576)] {
            let a = data(m * k, 3);
            let wb: Vec<u16> = data(n * k, 4).iter().map(|&x| bf16_bits(x)).collect(); // W [N, K]
            let b = PackedB::from_nk(&wb, n, k);
            let want = gemm(&a, m, &b);
            let (mp, np) = padded_dims(m, &b).expect("a bf16 unit");
            assert!(mp >= m && np >= n);
            let corner = |c: &[f32]| -> Vec<f32> { (0..m).flat_map(|r| c[r * np..][..n].to_vec()).collect() };
            let bits = |v: &[f32]| -> Vec<u32> { v.iter().map(|x| x.to_bits()).collect() };
            let mut c = vec![7.0f32; mp * np];
            gemm_acc(&a, m, &b, &mut c, false);
            assert_eq!(bits(&corner(&c)), bits(&want), "{m}x{n}x{k}: stored");
            let mut c = vec![0.0f32; mp * np];
            gemm_acc(&a, m, &b, &mut c, true);
            assert_eq!(bits(&corner(&c)), bits(&want), "{m}x{n}x{k}: added to zeros");
            let x = data(mp * np, 5);
            let mut c = x.clone();
            gemm_acc(&a, m, &b, &mut c, true);
            let mut worst = 0f32;
            for r in 0..m {
                for j in 0..n {
                    let (got, sum) = (c[r * np + j], x[r * np + j] + want[r * n + j]);
                    worst = worst.max((got - sum).abs());
                    // Measured (Zen 4): at most 8.7e-8 k.
                    assert!((got - sum).abs() <= 1e-7 * k as f32, "{m}x{n}x{k}: C[{r}, {j}] = {got}, X + A·B = {sum}");
                }
            }
            println!("gemm_acc {m}x{n}x{k}: max |C - (X + A·B)| {worst:e}");
        }
    }

    /// Rows rounded once give the bits of rounding them in each GEMM, stored or added into a
    /// caller's C, for ragged M and K; where the dot kernel is not this process's kernel there
    /// are none to make.
    #[test]
    #[cfg_attr(not(bf16_dot), ignore = "needs AVX512-BF16's dot kernel as the process kernel (on an AMX CPU: FINETUNE_NO_AMX=1)")]
    fn rows_rounded_once_give_the_bits_of_rows_rounded_in_each_gemm() {
        assert_eq!(kernel(), Some(Kernel::Avx512Bf16), "build.rs found the dot kernel but this process runs another");
        for (m, k, n) in [(1, 32, 32), (13, 70, 96), (512, 256, 64), (45, 2048, 128)] {
            let a = data(m * k, 31);
            let w: Vec<u16> = data(k * n, 32).iter().map(|&x| bf16_bits(x)).collect();
            let b = PackedB::from_kn(&w, k, n);
            let rows = RoundedRows::new(&a, m, k).expect("the dot kernel takes rounded rows");
            same_bits(&format!("stored {m}x{k}x{n}"), &gemm_rounded(&rows, &b), &gemm(&a, m, &b));
            let (mp, np) = padded_dims(m, &b).unwrap();
            let start: Vec<f32> = data(mp * np, 33);
            let (mut got, mut want) = (start.clone(), start);
            gemm_acc_rounded(&rows, &b, &mut got, true);
            gemm_acc(&a, m, &b, &mut want, true);
            same_bits(&format!("added {m}x{k}x{n}"), &got, &want);
        }
    }

    /// C from `got` bit for bit equal to `want`'s.
    fn same_bits(what: &str, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        for (i, (g, r)) in got.iter().zip(want).enumerate() {
            assert_eq!(g.to_bits(), r.to_bits(), "{what}: C[{i}] = {g}, packed {r}");
        }
    }

    #[test]
    #[cfg_attr(not(bf16_unit), ignore = "needs a bf16 unit (build.rs found none on this machine)")]
    fn reading_w_where_it_lies_gives_the_bits_of_the_packed_gemm() {
        let _ = here(kernel().expect("build.rs found a bf16 unit but this process has none"));
        // Forward (M, N, K): one row, ragged M, K past one panel (AMX: 2048; the dot kernel:
        // 1024 at 128 rows, K whole up to 2720 at 48: Cᵀ reloaded between panels), the most
        // rows it takes; for the dot kernel's strips of 16 (three at a time): 1, 2, 3, 7 and
        // 8 strips, the last one partial, and a last strip of at most 8 columns (run 8 wide)
        // alone, after one, two and six full ones, and over two K panels. Each shape also
        // with a second weight on the same rows (`gemm_wt_many`: both from one packing of A).
        let fwd = [(1, 32, 32), (17, 64, 96), (48, 96, 2080), (48, 64, 4096), (128, 64, 2080), (128, 64, 64), (16, 32, 64), (20, 64, 32), (40, 96, 64), (100, 32, 96), (8, 32, 64), (100, 64, 2080)];
        for kern in [Kernel::Amx, Kernel::Avx512Bf16].into_iter().filter(|k| k.supported()) {
            for &(m, n, k) in &fwd {
                let a = data(m * k, 11);
                let w: Vec<u16> = data(n * k, 12).iter().map(|&x| bf16_bits(x)).collect();
                let got = gemm_wt_with(kern, &a, m, &w, n, k).expect("applies");
                same_bits(&format!("{kern:?} x·Wᵀ {m}x{n}x{k}"), &got, &gemm_with(kern, &a, m, &PackedB::from_nk(&w, n, k)));
                let w2: Vec<u16> = data(n * k, 13).iter().map(|&x| bf16_bits(x)).collect();
                let both = gemm_wt_many(kern, &a, m, &[&w, &w2], n, k).expect("applies");
                same_bits(&format!("{kern:?} x·W₁ᵀ beside x·W₂ᵀ {m}x{n}x{k}"), &both[0], &got);
                same_bits(&format!("{kern:?} x·W₂ᵀ beside x·W₁ᵀ {m}x{n}x{k}"), &both[1], &gemm_with(kern, &a, m, &PackedB::from_nk(&w2, n, k)));
            }
            let (a, w) = (data(129 * 64, 1), vec![0u16; 64 * 64]);
            assert!(gemm_wt_with(kern, &a, 129, &w, 64, 64).is_none(), "too many rows: W is packed");
            assert!(gemm_wt_with(kern, &a[..48 * 64], 48, &w[..48 * 64], 48, 64).is_none(), "N not a multiple of 32");
            assert!(gemm_wt_with(kern, &a[..40], 1, &w[..64 * 40], 64, 40).is_none(), "K not a multiple of 32");
        }
    }

    #[test]
    #[cfg_attr(not(bf16_unit), ignore = "needs a bf16 unit (build.rs found none on this machine)")]
    fn the_input_gradient_packed_a_slab_at_a_time_gives_the_bits_of_the_whole_packing() {
        let _ = here(kernel().expect("build.rs found a bf16 unit but this process has none"));
        // (M, K, N): one row; ragged M, K and N; a DeepSeek-V2-Lite expert's down and gate
        // projections (N = 2048 cuts K = 1408 into several slabs); several slabs with a short
        // last pair; DeepSeek-V3's hidden size as N (columns in several panels a task); the
        // most rows it takes.
        let shapes = [(1, 32, 32), (7, 100, 50), (17, 33, 96), (48, 2048, 1408), (48, 1408, 2048), (9, 700, 2050), (5, 300, 7168), (128, 96, 64)];
        let (a129, w64) = (data(129 * 64, 1), vec![0u16; 64 * 64]);
        for kern in [Kernel::Amx, Kernel::Avx512Bf16].into_iter().filter(|k| k.supported()) {
            for &(m, k, n) in &shapes {
                let a = data(m * k, 21);
                let w: Vec<u16> = data(k * n, 22).iter().map(|&x| bf16_bits(x)).collect();
                match gemm_kn_with(kern, &a, m, &w, k, n) {
                    Some(got) => same_bits(&format!("{kern:?} g·W {m}x{k}x{n}"), &got, &gemm_with(kern, &a, m, &PackedB::from_kn(&w, k, n))),
                    None => assert_eq!(kern, Kernel::Amx, "the dot kernel takes {m} rows"),
                }
            }
            assert!(gemm_kn_with(kern, &a129, 129, &w64, 64, 64).is_none(), "too many rows: W is packed whole");
        }
    }

    #[test]
    fn gemm_work_is_split_to_keep_two_threads_busy_without_streaming_a_big_operand_twice() {
        // (M padded, N padded) -> by rows?  Row blocks are 32 rows, column pairs 32 columns.
        let by_rows = |mp: usize, np: usize| split(mp.div_ceil(32), np / 32, mp, np, 2).0;
        assert!(by_rows(2048, 576), "a layer at 4 x 512: 64 row blocks");
        assert!(by_rows(512, 576), "1 x 512: 16 row blocks share evenly, 9 column pairs do not");
        assert!(by_rows(2048, 192), "k/v projections: B is small");
        assert!(!by_rows(64, 1408), "an expert's 48 rows: by rows each task would stream all of W");
        assert!(!by_rows(192, 49152), "an LM-head chunk: 49k columns");
        assert!(!by_rows(192, 576), "the head's input gradient: as busy either way, A is smaller");
        assert_eq!(split(64, 18, 2048, 576, 2), (true, 16));
    }

    #[test]
    fn k_panels_are_equal_and_no_longer_than_asked() {
        assert_eq!(k_panels(18, 16), 9);
        assert_eq!(k_panels(18, 64), 18);
        assert_eq!(k_panels(1536, 64), 64);
        assert_eq!(k_panels(44, 32), 22);
        assert_eq!(k_panels(1, 64), 1);
        for kb in 1..300 {
            let kc = k_panels(kb, 64);
            assert!(kc <= 64 && kb.div_ceil(kc) == kb.div_ceil(64), "{kb} tiles in panels of {kc}");
        }
    }

    #[test]
    fn matmul_rejects_rows_whose_width_is_not_the_packed_k() {
        let dev = candle_core::Device::Cpu;
        let b = PackedB::from_nk(&[bf16_bits(1.0); 8 * 6], 8, 6); // B [6, 8]
        for k in [5, 7] {
            let a = candle_core::Tensor::zeros((4, k), candle_core::DType::F32, &dev).expect("tensor");
            let err = matmul(&a, &b).expect_err("a width mismatch must be an error").to_string();
            assert!(err.contains(&format!("[4, {k}]")) && err.contains("K 6"), "{err}");
        }
        let a = candle_core::Tensor::ones((4, 6), candle_core::DType::F32, &dev).expect("tensor");
        let c = matmul(&a, &b).expect("matching widths").to_vec2::<f32>().expect("values");
        assert!(c.iter().flatten().all(|&v| v == 6.0), "{c:?}");
    }

    /// W [N, K] -> Wᵀ [K, N]
    fn transpose(w: &[u16], n: usize, k: usize) -> Vec<u16> {
        let mut t = vec![0u16; k * n];
        for j in 0..n {
            for p in 0..k {
                t[p * n + j] = w[j * k + p];
            }
        }
        t
    }

    /// Both ways (16 x 16 register blocks, element by element), every element lands where the
    /// transpose puts it, ragged edges and strides included, and nothing past the block is written.
    #[test]
    fn transpose_f32_puts_each_element_at_its_mirror_and_writes_nothing_else() {
        use std::mem::MaybeUninit;
        // (rows, cols, lds, ldd): whole blocks; ragged columns; rows not a multiple of 16
        // (element by element); the last block's columns past the end of src (element by element).
        for (rows, cols, lds, ldd) in [(32, 48, 48, 40), (32, 37, 48, 35), (20, 37, 40, 24), (16, 30, 30, 16)] {
            let src: Vec<f32> = (0..rows * lds).map(|i| i as f32).collect();
            let mut dst = vec![MaybeUninit::new(-1f32); (cols - 1) * ldd + rows + 3];
            transpose_f32(&src, lds, rows, cols, &mut dst, ldd);
            // SAFETY: every element was initialised above.
            let dst: Vec<f32> = dst.iter().map(|v| unsafe { v.assume_init() }).collect();
            for (i, &x) in dst.iter().enumerate() {
                let (j, c) = (i / ldd, i % ldd);
                let want = if j < cols && c < rows { src[c * lds + j] } else { -1.0 };
                assert_eq!(x, want, "rows {rows} cols {cols} lds {lds} ldd {ldd}: dst[{j}][{c}]");
            }
        }
    }

    /// Runs on every CPU, by the scalar loops and (where the CPU has AVX-512) the SIMD packing:
    /// each B[kk, col] sits where `slot` says, every other element of the packing (K and N
    /// padding, the strip that makes the strip count even) is zero. N 600 and 1100: the SIMD
    /// `from_kn` packs several pairs of strips per task, the last task fewer.
    #[test]
    fn both_packings_put_every_element_where_the_tile_layout_says_and_zeros_elsewhere() {
        let simd: &[bool] = if simd_pack::available() { &[false, true] } else { &[false] };
        let shapes = [(1, 1), (5, 3), (16, 32), (17, 33), (40, 65), (48, 70), (0, 5), (5, 0), (33, 1), (16, 31), (50, 100), (64, 96), (600, 40), (1100, 33)];
        for (&(n, k), &simd) in shapes.iter().flat_map(|s| simd.iter().map(move |b| (s, b))) {
            let w: Vec<u16> = (0..n * k).map(|i| i as u16 + 1).collect(); // W [N, K], no zeros
            for p in [PackedB::from_nk_with(&w, n, k, simd), PackedB::from_kn_with(&transpose(&w, n, k), k, n, simd)] {
                let mut want = vec![0u16; p.tiles.len()];
                for col in 0..n {
                    for kk in 0..k {
                        want[p.index(col / TM, kk, col % TM)] = w[col * k + kk];
                    }
                }
                assert_eq!(p.tiles, want, "n {n}, k {k}, simd {simd}");
            }
        }
    }
}

#[cfg(test)]
mod speed {
    use super::*;

    /// `cargo test --release --lib bf16_gemm_speed -- --ignored --nocapture`: GFLOP/s of each
    /// kernel here and of the f32 GEMM a bf16 base would otherwise use, on the 135M bench
    /// model's projection and head shapes (a look, not a test; `make bench` has the numbers).
    #[test]
    #[ignore]
    fn bf16_gemm_speed() {
        let gflops = |m: usize, n: usize, k: usize, f: &dyn Fn()| {
            f();
            // The best of 20 calls: other processes on a small VM only ever slow a call down.
            let best = (0..20)
                .map(|_| {
                    let t = std::time::Instant::now();
                    f();
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::MAX, f64::min);
            2.0 * (m * n * k) as f64 / best / 1e9
        };
        // The 135M model's layers and head, a DeepSeek-V2-Lite expert's 48 rows (both ways), then
        // the most rows `gemm_wt` takes and an expert with few tokens (one strip of 16).
        // `BF16_GEMM_SHAPES="m,n,k m,n,k"` for others (DeepSeek-V2-Lite's head chunks:
        // "512,2048,2048").
        let shapes = [(2048, 576, 576), (2048, 192, 576), (2048, 1536, 576), (2048, 576, 1536), (170, 49152, 576), (170, 576, 49152), (48, 1408, 2048), (48, 2048, 1408), (128, 1536, 576), (16, 1408, 2048)];
        let asked: Vec<(usize, usize, usize)> = std::env::var("BF16_GEMM_SHAPES")
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|s| match s.split(',').filter_map(|x| x.parse().ok()).collect::<Vec<usize>>()[..] {
                [m, n, k] => Some((m, n, k)),
                _ => None,
            })
            .collect();
        for &(m, n, k) in if asked.is_empty() { &shapes[..] } else { &asked[..] } {
            let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.1).collect();
            let w: Vec<u16> = (0..n * k).map(|i| bf16_bits((i % 5) as f32 * 0.1)).collect();
            let b = PackedB::from_nk(&w, n, k);
            // Packing counted as GEMM time, to compare with the GEMM alone.
            let packs = gflops(m, n, k, &|| {
                std::hint::black_box(PackedB::from_nk(&w, n, k));
            });
            let mut line = format!("{m}x{n}x{k}: packing as fast as {packs:.0} GFLOP/s;");
            for kern in [Kernel::Amx, Kernel::Avx512Bf16] {
                if kern.supported() {
                    let r = gflops(m, n, k, &|| {
                        std::hint::black_box(gemm_with(kern, &a, m, &b));
                    });
                    line += &format!(" {kern:?} {r:.0}");
                }
            }
            if let (Some(kern), Some(_)) = (kernel(), gemm_wt(&a, m, &w, n, k)) {
                // W read where it lies: no packing to add.
                let r = gflops(m, n, k, &|| drop(std::hint::black_box(gemm_wt(&a, m, &w, n, k))));
                let with_pack = gflops(m, n, k, &|| drop(std::hint::black_box(gemm_with(kern, &a, m, &PackedB::from_nk(&w, n, k)))));
                line += &format!(" ({kern:?} packing W each call {with_pack:.0}, reading W where it lies {r:.0})");
            }
            let wf: Vec<f32> = (0..n * k).map(|i| (i % 5) as f32 * 0.1).collect();
            // The f32 GEMM with W [n, k] read as Wᵀ (a forward), and with the same floats read
            // as a row-major [k, n] B (the input gradient's layout); torch's MKL on the same
            // shapes: `bench/reference/gemm_shapes.py`.
            let f32_rate = |(rs, cs): (isize, isize)| {
                gflops(m, n, k, &|| {
                    let mut c = vec![0f32; m * n];
                    // SAFETY: c [m, n], a [m, k], B [k, n] read through (rs, cs) inside wf's n·k floats.
                    unsafe {
                        gemm::gemm(m, n, k, c.as_mut_ptr(), 1, n as isize, false, a.as_ptr(), 1, k as isize, wf.as_ptr(), cs, rs,
                            0.0, 1.0, false, false, false, gemm::Parallelism::Rayon(rayon::current_num_threads()));
                    }
                    std::hint::black_box(c);
                })
            };
            let (wt, w) = (f32_rate((1, k as isize)), f32_rate((n as isize, 1)));
            crate::note!("{line} | f32 gemm x·Wᵀ {wt:.0}, x·W {w:.0} GFLOP/s");
        }
    }

    /// `cargo test --release --lib cold_packing_speed -- --ignored --nocapture`: packing time of
    /// a DeepSeek-V2-Lite expert's weight (1408 x 2048 bf16) read cold from memory, as training
    /// reads 64 experts a layer, both ways (a look, not a test).
    #[test]
    #[ignore]
    fn cold_packing_speed() {
        let (n, k) = (1408, 2048);
        let ws: Vec<Vec<u16>> = (0..64).map(|s| (0..n * k).map(|i| ((i * 7 + s) % 1000) as u16).collect()).collect();
        let each = |f: &dyn Fn(&[u16])| {
            let t = std::time::Instant::now();
            for w in &ws {
                f(w);
            }
            t.elapsed().as_secs_f64() * 1e3 / ws.len() as f64
        };
        for _ in 0..3 {
            let nk = each(&|w| drop(std::hint::black_box(PackedB::from_nk(w, n, k))));
            let kn = each(&|w| drop(std::hint::black_box(PackedB::from_kn(w, k, n))));
            let kn2 = each(&|w| drop(std::hint::black_box(PackedB::from_kn(w, n, k))));
            crate::note!("cold packing: W [{n}, {k}] as Wᵀ {nk:.3} ms, W [{k}, {n}] as W {kn:.3} ms, W [{n}, {k}] as W {kn2:.3} ms");
        }
    }

    /// `cargo test --release --lib cold_expert_gemm_speed -- --ignored --nocapture`: GFLOP/s of
    /// the four GEMM shapes of a DeepSeek-V2-Lite routed expert over 48 rows, each of 64
    /// experts' weights read cold from memory in turn, as a MoE layer reads them (a look, not
    /// a test).
    #[test]
    #[ignore]
    fn cold_expert_gemm_speed() {
        crate::alloc::tune(); // as `main`: without it every call's buffers were fresh pages
        let (i, h, m) = (1408, 2048, 48);
        // gate/up [I, H] and down [H, I] of 64 experts: 370 MB each set.
        // In huge pages, as training's allocator (`alloc::HugePages`) holds them.
        let huge = |f: &dyn Fn(usize) -> u16| {
            let mut v: Vec<u16> = Vec::with_capacity(i * h + (1 << 20));
            let p = v.as_mut_ptr() as usize;
            let start = p.next_multiple_of(2 << 20);
            // SAFETY: advice on whole 2 MB pages inside the allocation.
            unsafe { libc::madvise(start as *mut libc::c_void, (p + 2 * (i * h + (1 << 20)) - start) & !((2 << 20) - 1), libc::MADV_HUGEPAGE) };
            v.extend((0..i * h).map(f));
            v
        };
        let ih: Vec<Vec<u16>> = (0..64).map(|s| huge(&|j| bf16_bits(((j * 7 + s) % 13) as f32 * 0.01))).collect();
        let hi: Vec<Vec<u16>> = (0..64).map(|s| huge(&|j| bf16_bits(((j * 3 + s) % 11) as f32 * 0.01))).collect();
        let ah: Vec<f32> = (0..m * h).map(|j| (j % 7) as f32 * 0.1).collect();
        let ai: Vec<f32> = (0..m * i).map(|j| (j % 5) as f32 * 0.1).collect();
        let rate = |f: &dyn Fn(usize)| {
            let best = (0..4)
                .map(|_| {
                    let t = std::time::Instant::now();
                    for e in 0..64 {
                        f(e);
                    }
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::MAX, f64::min);
            64.0 * 2.0 * (m * i * h) as f64 / best / 1e9
        };
        let gate = rate(&|e| drop(std::hint::black_box(gemm_wt(&ah, m, &ih[e], i, h))));
        let down = rate(&|e| drop(std::hint::black_box(gemm_wt(&ai, m, &hi[e], h, i))));
        // Where `gemm_kn` declines (AMX) it returns at once: timing that would print a rate of
        // nothing, so those rates say it does not apply (the whole-weight packing below is then
        // what the input gradient runs).
        let kn = gemm_kn(&ai, m, &ih[0], i, h).is_some();
        let kn_rate = |f: &dyn Fn(usize)| if kn { format!("{:.0}", rate(f)) } else { "n/a (gemm_kn does not apply on this kernel)".to_string() };
        let down_grad = kn_rate(&|e| drop(std::hint::black_box(gemm_kn(&ah, m, &hi[e], h, i))));
        let gate_grad = kn_rate(&|e| drop(std::hint::black_box(gemm_kn(&ai, m, &ih[e], i, h))));
        let down_old = rate(&|e| drop(std::hint::black_box(gemm(&ah, m, &PackedB::from_kn(&hi[e], h, i)))));
        let gate_old = rate(&|e| drop(std::hint::black_box(gemm(&ai, m, &PackedB::from_kn(&ih[e], i, h)))));
        crate::note!("input grads packing W whole: down {down_old:.0}, gate/up {gate_old:.0}");
        if kernel() == Some(Kernel::Avx512Bf16) {
            // The dot kernel alone on the same cold weights (Aᵀ packed once, Cᵀ left as it
            // is, one task per thread): what `gemm_wt` adds around it is the rest.
            let bt = transposed_operand(&ah, m, h);
            let np = round_up(m, TM);
            let ct = std::sync::Mutex::new(vec![0f32; i * np]);
            let units = i / dot::MR;
            let threads = rayon::current_num_threads().max(1);
            let alone = rate(&|e| {
                let mut ct = ct.lock().unwrap_or_else(|e| e.into_inner());
                let cs = crate::ops::Shared::new(&mut ct);
                let per = units.div_ceil(threads);
                (0..threads).into_par_iter().for_each(|t| {
                    let cp = cs;
                    // SAFETY: AVX512-BF16 is the kernel; the tasks' W row blocks are disjoint
                    // and inside W [I, H]; Cᵀ [I, NP] holds them; Aᵀ has NP / 16 strips.
                    unsafe { dot::run_w(&ih[e], h, &bt, m, (t * per, ((t + 1) * per).min(units)), (0, bt.kb), np, cp) };
                });
            });
            let pack = rate(&|_| drop(std::hint::black_box(transposed_operand(&ah, m, h))));
            let back = rate(&|_| drop(std::hint::black_box(transposed(&ct.lock().unwrap_or_else(|e| e.into_inner()), i, np, m))));
            let us = |r: f64| 2.0 * (m * i * h) as f64 / r / 1e3;
            crate::note!("gate x·Wᵀ on the dot kernel alone {alone:.0} GFLOP/s; around it in gemm_wt: rounding and packing A {:.0} µs, Cᵀ transposed back {:.0} µs", us(pack), us(back));
        }
        let warm = rate(&|_| drop(std::hint::black_box(gemm_wt(&ah, m, &ih[0], i, h))));
        let warm_grad = kn_rate(&|_| drop(std::hint::black_box(gemm_kn(&ai, m, &ih[0], i, h))));
        crate::note!("warm: gate x·Wᵀ {warm:.0}, gate input grad {warm_grad}");
        crate::note!("cold experts, {m} rows: gate/up x·Wᵀ {gate:.0}, down x·Wᵀ {down:.0}, down input grad g·W {down_grad}, gate/up input grad g·W {gate_grad} GFLOP/s");
    }
}
