//! The fused attention's strip GEMMs on the bf16 unit (AMX tiles, or the AVX512-BF16 kernel
//! on the same packed operands), for runs whose matmuls take bf16 operands (a bf16 base on a
//! CPU with a bf16 unit and `model.matmul = "auto"`, where the frozen projections already
//! run on it): q, k, v, the upstream gradient, the probabilities and the score
//! gradients are rounded to bf16 as the GEMMs' operands, every product is summed in f32, and
//! the rest (scores, softmax, log-sum-exp, outputs and gradients) stays f32. PyTorch's bf16
//! attention rounds the same operands and keeps its outputs in bf16 too.
//!
//! Why: in f32 the strips ran at a core's f32 peak and were a quarter of a default-recipe step
//! of SmolLM2 at 4 x 512 on a Xeon with AMX (2026-11-25), the biggest part left off the tiles.
//! On AVX512-BF16 the same packed operands go to the dot kernel (`tile_gemm` picks it): on a
//! Zen 5 EPYC (2026-11-26), `attention_speed` at 1 x 9 x 4096 x 64 ran forward 77 against
//! 130 ms and backward 231-237 against 281-298 ms in f32, and the default recipe on a bf16
//! base ran 1 x 4096 19-21% faster, 1 x 512 and 4 x 512 2-5% (alternating runs).
//!
//! Shapes (legend of `attention`, plus): per strip, Mp = its query rows padded to 32, K0 = its
//! first key rounded down to 32, Wp = its keys from K0 padded to 32 (keys below the first one
//! a query sees are masked like any other unseen key), Sp = S padded to 32. D is a multiple
//! of 32 (a tile's K step). The GEMMs, with B packed by `bf16_gemm::pack_*_into`:
//!   forward:  scores [Mp, Wp] = q_strip · kᵀ        out [Mp, D] = p · v
//!   backward: dp [Mp, Wp] = dout · vᵀ               dq [Mp, D] = ds · k
//!             dkᵀ [D, Wp] += q_stripᵀ · ds           dvᵀ [D, Wp] += doutᵀ · p
//! dk and dv are accumulated transposed (the strip's rows are then the GEMMs' K, which a
//! row-pair interleave of ds and p packs, rather than a transpose of each [Mp, Wp] strip) and
//! transposed once per task at the end.

use crate::ops::bf16_gemm::{pack_kn_into, pack_nk_into, round_into, tile_gemm, tiles_available, transpose_f32};

/// Rows and columns of a tile pair; a tile's K step.
const T: usize = 32;
/// u16 per tile.
const TILE: usize = 512;

/// Can the strips of head dim `d` run on tiles here?
pub(super) fn usable(d: usize) -> bool {
    d > 0 && d.is_multiple_of(T) && tiles_available()
}

fn pad(x: usize) -> usize {
    x.div_ceil(T) * T
}

/// `src` [rows, cols] f32 rounded to bf16 into `dst` [rows_pad, cols], zero rows past `rows`.
fn round_rows(src: &[f32], rows: usize, cols: usize, rows_pad: usize, dst: &mut Vec<u16>) {
    dst.resize(rows_pad * cols, 0);
    round_into(&src[..rows * cols], &mut dst[..rows * cols]);
    dst[rows * cols..].fill(0);
}

/// `src` [rows, cols] transposed into `dst` [cols, rows].
fn transpose(src: &[u16], rows: usize, cols: usize, dst: &mut Vec<u16>) {
    dst.resize(rows * cols, 0);
    for (r, row) in src.chunks_exact(cols).take(rows).enumerate() {
        for (c, &x) in row.iter().enumerate() {
            dst[c * rows + r] = x;
        }
    }
}

/// One (b, h) unit's task: its keys and values packed once as the GEMMs' B operands (shared by
/// the R query heads of a group, so every task packs its own: ~1% of the unit's GEMM work),
/// the strips' scratch, and in backward its dkᵀ and dvᵀ. Its buffers are its thread's (see
/// [`with_unit`]).
#[derive(Default)]
pub(super) struct Unit {
    s: usize,
    sp: usize,
    d: usize,
    /// kᵀ and vᵀ as B (strips of 16 keys, D/32 tiles each): scores, dp.
    k_nk: Vec<u16>,
    v_nk: Vec<u16>,
    /// k and v as B (strips of 16 of D, Sp/32 tiles each): out, dq.
    v_kn: Vec<u16>,
    k_kn: Vec<u16>,
    nk_strip: usize,
    kn_strip: usize,
    /// Scores, then probabilities [Mp, Wp]; dp, then ds [Mp, Wp].
    p: Vec<f32>,
    dp: Vec<f32>,
    /// bf16 operands: q or dout rows [Mp, D], p or ds [Mp, Wp], a transposed [D, Mp], a packed B.
    qa: Vec<u16>,
    ga: Vec<u16>,
    xa: Vec<u16>,
    ta: Vec<u16>,
    pk: Vec<u16>,
    /// An [Mp, D] result before its m rows are copied out.
    rows: Vec<f32>,
    /// dkᵀ, dvᵀ [D, Sp].
    dkt: Vec<f32>,
    dvt: Vec<f32>,
}

thread_local! {
    /// The buffers of the last unit this thread ran: every task reuses its thread's, so the
    /// ~0.6 MB a backward task packs and works in are not fresh pages each time (page faults
    /// and zeroing were a tenth of the tile path).
    static UNIT: std::cell::RefCell<Unit> = std::cell::RefCell::new(Unit::default());
}

/// `f` on a unit set up for k, v [S, D] of the task's kv head (`backward`: packed for the
/// backward's GEMMs too, and dkᵀ, dvᵀ zeroed), in this thread's buffers. `f` must not start
/// another unit on this thread (it runs no rayon work, so no other task can start here).
pub(super) fn with_unit<R>(k: &[f32], v: &[f32], s: usize, d: usize, backward: bool, f: impl FnOnce(&mut Unit) -> R) -> R {
    UNIT.with(|cell| {
        let mut u = cell.borrow_mut();
        u.set_up(k, v, s, d, backward);
        f(&mut u)
    })
}

impl Unit {
    fn set_up(&mut self, k: &[f32], v: &[f32], s: usize, d: usize, backward: bool) {
        let sp = pad(s);
        (self.s, self.sp, self.d) = (s, sp, d);
        // xa and ga serve as the bf16 copies of k and v while packing.
        round_rows(k, s, d, sp, &mut self.xa);
        round_rows(v, s, d, sp, &mut self.ga);
        self.nk_strip = pack_nk_into(&self.xa, sp, d, &mut self.k_nk);
        self.kn_strip = pack_kn_into(&self.ga, sp, d, &mut self.v_kn);
        if backward {
            pack_nk_into(&self.ga, sp, d, &mut self.v_nk);
            pack_kn_into(&self.xa, sp, d, &mut self.k_kn);
            for t in [&mut self.dkt, &mut self.dvt] {
                t.clear();
                t.resize(d * sp, 0.0);
            }
        }
    }

    /// The strip's (Mp, K0, Wp).
    fn geometry(m: usize, kbeg: usize, kend: usize) -> (usize, usize, usize) {
        let k0 = kbeg / T * T;
        (pad(m), k0, pad(kend - k0))
    }

    /// Unscaled scores of the strip's rows `q` [m, D] against keys K0..K0 + Wp into `p`
    /// [Mp, Wp]; q's bf16 rows stay in `qa`.
    fn scores(&mut self, q: &[f32], m: usize, (mp, k0, wp): (usize, usize, usize)) {
        let d = self.d;
        round_rows(q, m, d, mp, &mut self.qa);
        self.p.resize(mp * wp, 0.0);
        tile_gemm(&self.qa, d, &self.k_nk[k0 / 16 * self.nk_strip..], self.nk_strip, d / T, (mp, wp), &mut self.p, wp, false);
    }

    /// C [Mp, D] = `a` [Mp, Wp] · (k or v from key K0) into `rows`, then its first m rows into `dst`.
    fn times_keys(a: &[u16], kn: &[u16], kn_strip: usize, (mp, k0, wp): (usize, usize, usize), d: usize, rows: &mut Vec<f32>, dst: &mut [f32]) {
        rows.resize(mp * d, 0.0);
        tile_gemm(a, wp, &kn[k0 / T * TILE..], kn_strip, wp / T, (mp, d), rows, d, false);
        dst.copy_from_slice(&rows[..dst.len()]);
    }

    /// Strip (q0, m, kbeg, kend) forward: its rows `q` [m, D] -> `out` [m, D] and `lse` [m].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward_strip(&mut self, q: &[f32], (q0, m, kbeg, kend): (usize, usize, usize, usize), starts: &[u32], scale: f32, out: &mut [f32], lse: &mut [f32]) {
        let geo = Self::geometry(m, kbeg, kend);
        let (mp, k0, wp) = geo;
        self.scores(q, m, geo);
        wide::softmax_rows(&mut self.p[..m * wp], wp, q0, k0, starts, scale, lse);
        self.p[m * wp..].fill(0.0);
        round_rows(&self.p, mp, wp, mp, &mut self.xa);
        Self::times_keys(&self.xa, &self.v_kn, self.kn_strip, geo, self.d, &mut self.rows, out);
    }

    /// Strip (q0, m, kbeg, kend) backward from its rows of q, the upstream gradient g, the
    /// output o (each [m, D]) and the log-sum-exp [m]: dq rows [m, D]; dk, dv accumulate.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn backward_strip(&mut self, (q, g, o, lse): (&[f32], &[f32], &[f32], &[f32]), (q0, m, kbeg, kend): (usize, usize, usize, usize), starts: &[u32], scale: f32, dq: &mut [f32]) {
        let d = self.d;
        let geo = Self::geometry(m, kbeg, kend);
        let (mp, k0, wp) = geo;
        self.scores(q, m, geo);
        wide::probs_from_lse(&mut self.p[..m * wp], wp, q0, (k0, k0 + wp), starts, scale, lse);
        self.p[m * wp..].fill(0.0);
        // dp [Mp, Wp] = dout · vᵀ, then ds in its place.
        round_rows(g, m, d, mp, &mut self.ga);
        self.dp.resize(mp * wp, 0.0);
        tile_gemm(&self.ga, d, &self.v_nk[k0 / 16 * self.nk_strip..], self.nk_strip, d / T, (mp, wp), &mut self.dp, wp, false);
        wide::score_grads(&mut self.dp[..m * wp], &self.p[..m * wp], wp, g, o, d, scale);
        self.dp[m * wp..].fill(0.0);
        // dq = ds · k
        round_rows(&self.dp, mp, wp, mp, &mut self.xa);
        Self::times_keys(&self.xa, &self.k_kn, self.kn_strip, geo, d, &mut self.rows, dq);
        // dkᵀ[:, K0..] += qᵀ · ds: ds packed over its rows (the K of this product).
        let strip = pack_kn_into(&self.xa, mp, wp, &mut self.pk);
        transpose(&self.qa, mp, d, &mut self.ta);
        tile_gemm(&self.ta, mp, &self.pk, strip, mp / T, (d, wp), &mut self.dkt[k0..], self.sp, true);
        // dvᵀ[:, K0..] += doutᵀ · p
        round_rows(&self.p, mp, wp, mp, &mut self.xa);
        let strip = pack_kn_into(&self.xa, mp, wp, &mut self.pk);
        transpose(&self.ga, mp, d, &mut self.ta);
        tile_gemm(&self.ta, mp, &self.pk, strip, mp / T, (d, wp), &mut self.dvt[k0..], self.sp, true);
    }

    /// The task's dk and dv [S, D] (from dkᵀ, dvᵀ [D, Sp]).
    pub(super) fn finish(&self, dk: &mut [f32], dv: &mut [f32]) {
        for (dst, src) in [(dk, &self.dkt), (dv, &self.dvt)] {
            // SAFETY: f32 and MaybeUninit<f32> have one layout, and only f32 values are written.
            let dst = unsafe { &mut *(dst as *mut [f32] as *mut [std::mem::MaybeUninit<f32>]) };
            transpose_f32(src, self.sp, self.d, self.s, dst, self.d);
        }
    }
}

/// The strips' element-wise passes compiled for AVX-512 (16 lanes; the crate's baseline is
/// AVX2, and every CPU with a bf16 unit has AVX-512): the code of `super::softmax_rows` and
/// its neighbours (`probs_from_lse` and `score_grads` are the f32 path's too) and the same
/// bits as that code compiled for AVX2 (element by element, sums in the same order). With the
/// GEMMs on tiles, these passes and the bf16 rounding around them are most of the rest of the
/// tile path's time.
mod wide {
    macro_rules! avx512 {
        ($name:ident ( $($arg:ident : $ty:ty),* )) => {
            pub(super) fn $name($($arg: $ty),*) {
                #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl")]
                unsafe fn wide($($arg: $ty),*) {
                    super::super::$name($($arg),*)
                }
                assert!(super::tiles_available(), "attention tiles: AVX-512 element-wise code without AVX-512 F, BW, DQ and VL");
                // SAFETY: `tiles_available` checked AVX-512 F, BW, DQ and VL.
                unsafe { wide($($arg),*) }
            }
        };
    }
    avx512!(softmax_rows(p: &mut [f32], w: usize, q0: usize, k0: usize, starts: &[u32], scale: f32, lse: &mut [f32]));
    avx512!(probs_from_lse(p: &mut [f32], w: usize, q0: usize, keys: (usize, usize), starts: &[u32], scale: f32, lse: &[f32]));
    avx512!(score_grads(dp: &mut [f32], p: &[f32], w: usize, g: &[f32], o: &[f32], d: usize, scale: f32));
}
