//! The fused attention's f32 strips: each task runs the R query heads of one kv head (GQA) as
//! the rows of one set of GEMMs, and walks each strip's keys in blocks of `KEY_BLOCK`.
//!
//! Why: the strips' GEMMs are the gemm crate's, which packs its B operand on every call. Per
//! query head, every strip packed its kv head's keys and values again (twice each in backward)
//! for GEMMs of 64 rows, and the scores of a whole strip row (1 MB at S = 4096) went through
//! the softmax, the score gradients and the crate's packing from L3. With the R heads of a kv
//! head in one GEMM the keys and values are packed once for R·64 rows, dk and dv sum over R·64
//! rows inside their GEMMs, and a block of keys keeps the scores and their gradients
//! (R·64 x 256 floats each) in L2. Against the per-head strips over whole rows of keys, in
//! one process, alternating (`attention_speed`'s shapes, SmolLM2's 9 query heads over 3 kv
//! heads, D = 64, 2-core Zen 3 EPYC, median ratio of 12-30 rounds): forward 1.05-1.07x and
//! backward 1.05-1.19x as fast at 4 x 512, 1 x 512, 1 x 2048 and 1 x 4096 (backward 1.06-1.16x
//! at 1 x 4096 over three runs). Blocking the keys with the heads apart, or taking the heads
//! together over whole rows of keys, each gained 0-4% alone; blocks of 128 keys gained less
//! than 256, and 512 less in backward.
//!
//! Shapes (legend of `attention`, plus): per strip N = R·m rows, head j's at j·m..(j+1)·m;
//! per key block w <= `KEY_BLOCK` keys kb..ke of the strip's kbeg..kend.
//!   forward:  s [N, w] = q_rows · k[kb..ke]ᵀ · scale, then FlashAttention-2's online
//!             softmax: each row's running max and sum, its accumulator rescaled when the
//!             max grows; acc [N, D] += p · v[kb..ke]; out = acc / sum, lse = max + ln sum
//!   backward: p from lse per block; dv[kb..ke] += pᵀ · g_rows, dp = g_rows · v[kb..ke]ᵀ,
//!             ds = p ⊙ (dp − δ) · scale (δ = Σ_d g ⊙ out per row, once per strip),
//!             dq_rows += ds · k[kb..ke], dk[kb..ke] += dsᵀ · q_rows
//! Reference: Dao, "FlashAttention-2" (2023), Algorithms 1 and 2.

use super::{exp_f32, probs_from_lse, seen, sgemm, strip_scores, sum_f32, STRIP};

/// Keys per block: a block's scores and their gradients, R·64 x 256 f32 each (192 KB at
/// R = 3), stay in a core's L2 beside the block's keys and values.
pub(super) const KEY_BLOCK: usize = 256;

/// One task's view: its kv head's keys and values [S, D], R, the row's key starts and the
/// scale; and the scratch its strips reuse.
pub(super) struct Group<'a> {
    k: &'a [f32],
    v: &'a [f32],
    r: usize,
    s: usize,
    d: usize,
    starts: &'a [u32],
    scale: f32,
    /// The strip's rows of q (and, in backward, of the upstream gradient g) [N, D].
    qa: Vec<f32>,
    ga: Vec<f32>,
    /// forward: the output accumulators; backward: dq [N, D].
    acc: Vec<f32>,
    /// A block's scores, then probabilities; backward: dp, then ds [N, w].
    p: Vec<f32>,
    dp: Vec<f32>,
    /// Per row [N]: the forward's running max and sum, the backward's lse and δ.
    mx: Vec<f32>,
    sum: Vec<f32>,
    lse: Vec<f32>,
    delta: Vec<f32>,
}

impl<'a> Group<'a> {
    /// A task's group, with scratch for the forward or (`backward`) the backward.
    pub fn new((k, v): (&'a [f32], &'a [f32]), (r, s, d): (usize, usize, usize), starts: &'a [u32], scale: f32, backward: bool) -> Self {
        let (n, w) = (r * STRIP, KEY_BLOCK.min(s));
        let (fwd, bwd) = (usize::from(!backward), usize::from(backward));
        Group {
            k, v, r, s, d, starts, scale,
            qa: vec![0.0; n * d],
            ga: vec![0.0; bwd * n * d],
            acc: vec![0.0; n * d],
            p: vec![0.0; n * w],
            dp: vec![0.0; bwd * n * w],
            mx: vec![0.0; fwd * n],
            sum: vec![0.0; fwd * n],
            lse: vec![0.0; bwd * n],
            delta: vec![0.0; bwd * n],
        }
    }

    /// Rows q0..q0 + m of each of the R heads of `x` ([R, S, D]) into `dst` [R·m, D].
    fn gather(&self, x: &[f32], q0: usize, m: usize, dst: &mut [f32]) {
        let (s, d) = (self.s, self.d);
        for (j, rows) in dst[..self.r * m * d].chunks_exact_mut(m * d).enumerate() {
            rows.copy_from_slice(&x[(j * s + q0) * d..][..m * d]);
        }
    }

    /// The key blocks of a strip's keys kbeg..kend.
    fn blocks(kbeg: usize, kend: usize) -> impl Iterator<Item = (usize, usize)> {
        (kbeg..kend).step_by(KEY_BLOCK).map(move |kb| (kb, (kb + KEY_BLOCK).min(kend)))
    }

    /// Strip (q0, m, kbeg, kend) forward for the R heads' rows of `q` ([R, S, D]): each head
    /// j's output rows [m, D] and lse [m] into `out(j)`.
    pub fn forward_strip<'o>(&mut self, q: &[f32], (q0, m, kbeg, kend): (usize, usize, usize, usize), mut out: impl FnMut(usize) -> (&'o mut [f32], &'o mut [f32])) {
        let (d, n) = (self.d, self.r * m);
        let mut qa = std::mem::take(&mut self.qa);
        self.gather(q, q0, m, &mut qa);
        let qa_rows = &qa[..n * d];
        self.acc[..n * d].fill(0.0);
        self.mx[..n].fill(f32::NEG_INFINITY);
        self.sum[..n].fill(0.0);
        for (kb, ke) in Self::blocks(kbeg, kend) {
            let w = ke - kb;
            let p = &mut self.p[..n * w]; // [N, w]
            strip_scores(p, qa_rows, &self.k[kb * d..], n, w, d, self.scale);
            for (row, pr) in p.chunks_exact_mut(w).enumerate() {
                let (lo, hi) = seen(self.starts, q0, (kb, ke), row % m);
                let alpha = online_softmax_row(pr, lo, hi, &mut self.mx[row], &mut self.sum[row]);
                if alpha != 1.0 {
                    self.acc[row * d..][..d].iter_mut().for_each(|x| *x *= alpha);
                }
            }
            // acc [N, D] += p [N, w] · v[kb..ke] [w, D]
            sgemm(n, d, w, &mut self.acc, d, true, p, w, 1, &self.v[kb * d..], d, 1, 1.0, 1);
        }
        for j in 0..self.r {
            let (o, l) = out(j);
            for i in 0..m {
                let row = j * m + i;
                let inv = 1.0 / self.sum[row];
                o[i * d..][..d].iter_mut().zip(&self.acc[row * d..][..d]).for_each(|(y, &a)| *y = a * inv);
                l[i] = self.mx[row] + self.sum[row].ln();
            }
        }
        self.qa = qa;
    }

    /// Strip (q0, m, kbeg, kend) backward from the R heads' rows of q, the upstream gradient g
    /// and the output o (each [R, S, D]) and lse ([R, S]): each head j's dq rows [m, D] into
    /// `dq(j)`; dk and dv [S, D] (the task's) accumulate.
    pub fn backward_strip<'o>(&mut self, (q, g, o, lse): (&[f32], &[f32], &[f32], &[f32]), (q0, m, kbeg, kend): (usize, usize, usize, usize), dk: &mut [f32], dv: &mut [f32], mut dq: impl FnMut(usize) -> &'o mut [f32]) {
        let (s, d, n, scale) = (self.s, self.d, self.r * m, self.scale);
        let (mut qa, mut ga) = (std::mem::take(&mut self.qa), std::mem::take(&mut self.ga));
        self.gather(q, q0, m, &mut qa);
        self.gather(g, q0, m, &mut ga);
        let (qa_rows, ga_rows) = (&qa[..n * d], &ga[..n * d]);
        for j in 0..self.r {
            for i in 0..m {
                let at = (j * s + q0 + i) * d;
                self.lse[j * m + i] = lse[j * s + q0 + i];
                self.delta[j * m + i] = super::row_delta(&g[at..at + d], &o[at..at + d]);
            }
        }
        for (block, (kb, ke)) in Self::blocks(kbeg, kend).enumerate() {
            let w = ke - kb;
            let (p, dp) = (&mut self.p[..n * w], &mut self.dp[..n * w]); // [N, w] each
            let (ks, vs) = (&self.k[kb * d..ke * d], &self.v[kb * d..ke * d]); // [w, D] each
            strip_scores(p, qa_rows, ks, n, w, d, scale);
            for (pj, lj) in p.chunks_exact_mut(m * w).zip(self.lse[..n].chunks_exact(m)) {
                probs_from_lse(pj, w, q0, (kb, ke), self.starts, 1.0, lj);
            }
            // dv[kb..ke] += pᵀ [w, N] · g_rows [N, D]
            sgemm(w, d, n, &mut dv[kb * d..], d, true, p, 1, w, ga_rows, d, 1, 1.0, 1);
            // dp [N, w] = g_rows [N, D] · v[kb..ke]ᵀ [D, w]
            sgemm(n, w, d, dp, w, false, ga_rows, d, 1, vs, 1, d, 1.0, 1);
            for ((dr, pr), &delta) in dp.chunks_exact_mut(w).zip(p.chunks_exact(w)).zip(&self.delta[..n]) {
                super::score_grad_row(dr, pr, delta, scale);
            }
            // dq_rows [N, D] (+)= ds [N, w] · k[kb..ke] [w, D]
            sgemm(n, d, w, &mut self.acc, d, block > 0, dp, w, 1, ks, d, 1, 1.0, 1);
            // dk[kb..ke] += dsᵀ [w, N] · q_rows [N, D]
            sgemm(w, d, n, &mut dk[kb * d..], d, true, dp, 1, w, qa_rows, d, 1, 1.0, 1);
        }
        for j in 0..self.r {
            dq(j).copy_from_slice(&self.acc[j * m * d..][..m * d]);
        }
        (self.qa, self.ga) = (qa, ga);
    }
}

/// One row of a key block in the online softmax: the scores `row[lo..hi]` (the keys the
/// query sees in the block; 0 elsewhere after) become exp(x − max) against the row's running
/// max `mx`, which grows to cover them, and `sum` the running Σ exp; returns the factor
/// exp(old max − new max) the row's accumulated output must be scaled by (1 when the max did
/// not grow, 0 on the row's first keys).
#[inline(always)]
fn online_softmax_row(row: &mut [f32], lo: usize, hi: usize, mx: &mut f32, sum: &mut f32) -> f32 {
    if lo == hi {
        row.fill(0.0);
        return 1.0;
    }
    let block_max = row[lo..hi].iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
    let new = mx.max(block_max);
    let alpha = if *mx == f32::NEG_INFINITY { 0.0 } else if new == *mx { 1.0 } else { exp_f32(*mx - new) };
    row[lo..hi].iter_mut().for_each(|x| *x = exp_f32(*x - new));
    row[..lo].fill(0.0);
    row[hi..].fill(0.0);
    *sum = *sum * alpha + sum_f32(&row[lo..hi]);
    *mx = new;
    alpha
}
