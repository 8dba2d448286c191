//! Causal self-attention as one op with its own backward, computed in strips of query rows so
//! no [S, S] score matrix (or its gradient) is ever held.
//!
//! Dimension legend (as in `model/llama.rs`):
//!   B  micro-batch rows   NH query heads   KV key/value heads   R = NH / KV
//!   S  sequence length    D  head_dim      Q  query rows per strip (`STRIP`, the last may be shorter)
//!
//! Why: the generic path (`generic_causal_attention`) materialises scores, probabilities and
//! their gradients as [B, NH, S, S] tensors, computes the masked upper half anyway, and runs
//! through candle's batched matmul, which is slow for these low-K shapes. Cost and memory then
//! grow with S² per layer, which is what made long sequences slow.
//!
//! Forward, per (row b, query head h) and per strip of Q query rows starting at q0 (keys
//! kbeg..q0+Q are the only ones a strip can see: kbeg = 0 for plain causal attention, the
//! first record start among the strip's queries for packed rows; W = q0 + Q − kbeg):
//!   scores [Q, W] = q_strip · k[kbeg..]^T · scale    (one GEMM)
//!   p = causal softmax of each row; lse = log Σ exp  (kept: S floats per head)
//!   out_strip [Q, D] = p · v                         (one GEMM)
//! Backward (FlashAttention-2's recurrences, strip by strip, recomputing p from lse):
//!   dv += p^T · dout,  dp = dout · v^T,  ds = p ⊙ (dp − rowsum(dout ⊙ out)) · scale,
//!   dq = ds · k,  dk += ds^T · q
//! GQA: query head h reads kv head h / R (transformers' `repeat_kv` order). Each query head
//! (with few heads, each of two groups of its strips: `parts_for`) accumulates its own dk/dv,
//! summed over the R heads of a group afterwards in a fixed order, so heads run in parallel
//! and results do not depend on the thread count.
//! Reference: Dao, "FlashAttention-2" (2023), Algorithm 2; we keep whole strips of keys
//! instead of tiling them because one strip row fits in cache at the lengths we train.

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};
use crate::ops::{exp_f32, sgemm, sum_f32, zeros_f32, Shared};
use rayon::prelude::*;
use std::sync::Mutex;

/// Query rows per strip: a strip's scores are STRIP x S floats (512 KB at S = 2048).
const STRIP: usize = 64;

/// softmax(q k^T · scale + mask) v for q [B, NH, S, D], k and v [B, KV, S, D] -> [B, NH, S, D],
/// where query i of row b sees keys `key_start[b * S + i]..=i`: all zeros is plain causal
/// attention, the start of each record is packed rows (attention stays within a record).
/// The fused op on CPU f32; the generic differentiable path elsewhere (same result).
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, key_start: &[u32]) -> Result<Tensor> {
    let (b, nh, s, d) = q.dims4()?;
    let (_, kv, _, _) = k.dims4()?;
    if kv == 0 || nh % kv != 0 || k.dims() != v.dims() {
        candle_core::bail!("causal-attention: q {:?} and k/v {:?}/{:?} do not form GQA shapes", q.dims(), k.dims(), v.dims());
    }
    if key_start.len() != b * s || key_start.iter().enumerate().any(|(r, &st)| st as usize > r % s) {
        candle_core::bail!("causal-attention: key_start must hold B x S = {} starts, each at most its query's position", b * s);
    }
    let fused = q.device().is_cpu() && [q.dtype(), k.dtype(), v.dtype()].iter().all(|&t| t == DType::F32);
    if !fused || s == 0 || d == 0 {
        return generic_causal_attention(q, k, v, scale, key_start);
    }
    let op = CausalAttention { scale: scale as f32, key_start: key_start.to_vec(), lse: Mutex::new(Vec::new()) };
    q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, op)
}

/// The same attention through candle's ops: batched matmuls and a softmax over [B, NH, S, S]
/// scores (the fused causal softmax when no row is packed, else an explicit additive mask).
/// Kept as the reference the fused op is tested against, and for non-CPU / non-f32 tensors.
pub fn generic_causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, key_start: &[u32]) -> Result<Tensor> {
    let (b, nh, s, d) = q.dims4()?;
    let kv = k.dim(1)?;
    // GQA without copying k/v: the R query heads of a kv head are contiguous, so they fold
    // into the row dim.
    let r = nh / kv;
    let q = q.reshape((b, kv, r * s, d))?; // [B, KV, R*S, D]
    let scores = q.matmul(&k.t()?)?.reshape((b, nh, s, s))?.to_dtype(DType::F32)?; // [B, NH, S, S]
    let probs = if key_start.iter().all(|&st| st == 0) {
        crate::ops::causal_softmax(&scores, scale)?
    } else {
        let mut m = Vec::with_capacity(b * s * s);
        for (row, &st) in key_start.iter().enumerate() {
            let i = row % s;
            m.extend((0..s).map(|j| if j >= st as usize && j <= i { 0.0 } else { f32::NEG_INFINITY }));
        }
        let mask = Tensor::from_vec(m, (b, 1, s, s), q.device())?; // [B, 1, S, S]
        crate::ops::softmax_last(&(scores * scale)?.broadcast_add(&mask)?)?
    };
    let probs = probs.to_dtype(v.dtype())?.reshape((b, kv, r * s, s))?; // [B, KV, R*S, S]
    probs.matmul(v)?.reshape((b, nh, s, d)) // [B, NH, S, D]
}

struct CausalAttention {
    scale: f32,
    /// [B * S]: the first key each query sees.
    key_start: Vec<u32>,
    /// Log-sum-exp of each query row's scores, [B, NH, S], written by the forward for the
    /// backward (which recomputes the probabilities from it instead of storing them).
    lse: Mutex<Vec<f32>>,
}

/// The keys a strip of queries q0..q0+m can see: kbeg..kend (kend = q0 + m).
fn strip_keys(starts: &[u32], q0: usize, m: usize) -> (usize, usize) {
    let kbeg = starts[q0..q0 + m].iter().min().map_or(0, |&x| x as usize);
    (kbeg, q0 + m)
}

/// Strip groups per (b, head) unit. With few units (batch 1: 9 heads, which 2 threads run as
/// 5 + 4) each unit's strips are dealt into 2 groups of equal work, twice as many tasks. A
/// function of the shapes only, so results do not depend on the thread count.
fn parts_for(units: usize) -> usize {
    if units < 16 { 2 } else { 1 }
}

/// Whether strip `i` of `n` is in group `g` of `parts`: strips pair up from both ends (i and
/// n − 1 − i see about n + 1 strips of keys together) and the pairs are dealt in turn.
fn in_part(i: usize, n: usize, g: usize, parts: usize) -> bool {
    i.min(n - 1 - i) % parts == g
}

/// Shapes of one call: (B, NH, KV, S, D).
fn dims(q: &Layout, k: &Layout) -> Result<(usize, usize, usize, usize, usize)> {
    let (b, nh, s, d) = q.shape().dims4()?;
    let (b2, kv, s2, d2) = k.shape().dims4()?;
    if b != b2 || s != s2 || d != d2 {
        candle_core::bail!("causal-attention: q {:?} and k {:?} differ in batch, length or head_dim", q.shape(), k.shape());
    }
    Ok((b, nh, kv, s, d))
}

fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let CpuStorage::F32(x) = s else { candle_core::bail!("causal-attention: {what} must be f32") };
    let Some((a, b)) = l.contiguous_offsets() else { candle_core::bail!("causal-attention: {what} must be contiguous") };
    Ok(&x[a..b])
}

/// Scores of a strip: sc [m, kend] = q_strip [m, D] · k[..kend]^T · scale.
fn strip_scores(sc: &mut [f32], q: &[f32], k: &[f32], m: usize, kend: usize, d: usize, scale: f32) {
    sgemm(m, kend, d, sc, kend, false, q, d, 1, k, 1, d, scale, 1);
}

impl candle_core::CustomOp3 for CausalAttention {
    fn name(&self) -> &'static str {
        "causal-attention"
    }

    fn cpu_fwd(&self, qs: &CpuStorage, ql: &Layout, ks: &CpuStorage, kl: &Layout, vs: &CpuStorage, vl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (b, nh, kv, s, d) = dims(ql, kl)?;
        let (q, k, v) = (f32_slice(qs, ql, "q")?, f32_slice(ks, kl, "k")?, f32_slice(vs, vl, "v")?);
        let r = nh / kv;
        let mut out = zeros_f32(b * nh * s * d);
        let mut lse = vec![0f32; b * nh * s];
        let scale = self.scale;
        let units = b * nh;
        let parts = parts_for(units);
        let n_strips = s.div_ceil(STRIP);
        let (out_at, lse_at) = (Shared(out.as_mut_ptr()), Shared(lse.as_mut_ptr()));
        // One task per (b, h) unit and strip group: its strips' out rows [m, D] and lse [m].
        (0..units * parts).into_par_iter().for_each(|task| {
            let (unit, part) = (task / parts, task % parts);
            let (bi, h) = (unit / nh, unit % nh);
            let q = &q[unit * s * d..][..s * d]; // [S, D]
            let kvo = (bi * kv + h / r) * s * d;
            let (k, v) = (&k[kvo..][..s * d], &v[kvo..][..s * d]); // [S, D] each
            let starts = &self.key_start[bi * s..][..s];
            let mut p = vec![0f32; STRIP * s];
            for (si, q0) in (0..s).step_by(STRIP).enumerate() {
                if !in_part(si, n_strips, part, parts) {
                    continue;
                }
                let m = STRIP.min(s - q0);
                // SAFETY: strip si of this unit is in exactly one group, i.e. one task.
                let (o, l) = unsafe { (out_at.rows((unit * s + q0) * d, m * d), lse_at.rows(unit * s + q0, m)) };
                let (kbeg, kend) = strip_keys(starts, q0, m);
                let w = kend - kbeg;
                let p = &mut p[..m * w]; // [m, w]: query q0 + i against key kbeg + j
                strip_scores(p, &q[q0 * d..], &k[kbeg * d..], m, w, d, scale);
                for (i, row) in p.chunks_mut(w).enumerate() {
                    let (lo, hi) = (starts[q0 + i] as usize - kbeg, q0 + i - kbeg + 1); // keys seen: lo..hi
                    let max = row[lo..hi].iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
                    row[lo..hi].iter_mut().for_each(|x| *x = exp_f32(*x - max));
                    let sum = sum_f32(&row[lo..hi]);
                    let inv = 1.0 / sum;
                    row[lo..hi].iter_mut().for_each(|x| *x *= inv);
                    row[..lo].fill(0.0);
                    row[hi..].fill(0.0);
                    l[i] = max + sum.ln();
                }
                // out[q0..q0+m] [m, D] = p [m, w] · v[kbeg..kend] [w, D]
                sgemm(m, d, w, o, d, false, p, w, 1, &v[kbeg * d..], d, 1, 1.0, 1);
            }
        });
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = lse;
        Ok((CpuStorage::F32(out), ql.shape().clone()))
    }

    fn bwd(&self, q: &Tensor, k: &Tensor, v: &Tensor, out: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (b, nh, s, d) = q.dims4()?;
        let kv = k.dim(1)?;
        let r = nh / kv;
        let lse = self.lse.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if lse.len() != b * nh * s {
            candle_core::bail!("causal-attention: backward without a forward");
        }
        let e = crate::ops::f32_elems;
        let (qe, ke, ve, oe, ge) = (e(q)?, e(k)?, e(v)?, e(out)?, e(g)?);
        let (qh, kh, vh, oh, gh): (&[f32], &[f32], &[f32], &[f32], &[f32]) = (&qe, &ke, &ve, &oe, &ge);
        let scale = self.scale;
        let mut dq = zeros_f32(b * nh * s * d);
        let units = b * nh;
        let parts = parts_for(units);
        let n_strips = s.div_ceil(STRIP);
        // Per task (query head and strip group): its contribution to its kv head's dk and dv.
        let mut dk_h = zeros_f32(units * parts * s * d);
        let mut dv_h = zeros_f32(units * parts * s * d);
        let dq_at = Shared(dq.as_mut_ptr());
        dk_h.par_chunks_mut(s * d)
            .zip(dv_h.par_chunks_mut(s * d))
            .enumerate()
            .for_each(|(task, (dk, dv))| {
                let (unit, part) = (task / parts, task % parts);
                let (bi, h) = (unit / nh, unit % nh);
                let at = unit * s * d;
                let (q, o, g) = (&qh[at..][..s * d], &oh[at..][..s * d], &gh[at..][..s * d]); // [S, D] each
                let kvo = (bi * kv + h / r) * s * d;
                let (k, v) = (&kh[kvo..][..s * d], &vh[kvo..][..s * d]);
                let l = &lse[unit * s..][..s];
                let starts = &self.key_start[bi * s..][..s];
                let mut p = vec![0f32; STRIP * s];
                let mut dp = vec![0f32; STRIP * s];
                for (si, q0) in (0..s).step_by(STRIP).enumerate() {
                    if !in_part(si, n_strips, part, parts) {
                        continue;
                    }
                    let m = STRIP.min(s - q0);
                    let (kbeg, kend) = strip_keys(starts, q0, m);
                    let w = kend - kbeg;
                    let (p, dp) = (&mut p[..m * w], &mut dp[..m * w]); // [m, w] each
                    let (ks, vs) = (&k[kbeg * d..kend * d], &v[kbeg * d..kend * d]); // [w, D] each
                    strip_scores(p, &q[q0 * d..], ks, m, w, d, scale);
                    for (i, row) in p.chunks_mut(w).enumerate() {
                        let (lo, hi) = (starts[q0 + i] as usize - kbeg, q0 + i - kbeg + 1);
                        let li = l[q0 + i];
                        row[lo..hi].iter_mut().for_each(|x| *x = exp_f32(*x - li));
                        row[..lo].fill(0.0);
                        row[hi..].fill(0.0);
                    }
                    let gs = &g[q0 * d..][..m * d]; // [m, D]
                    // dv[kbeg..kend] += p^T [w, m] · g_strip [m, D]
                    sgemm(w, d, m, &mut dv[kbeg * d..], d, true, p, 1, w, gs, d, 1, 1.0, 1);
                    // dp [m, w] = g_strip [m, D] · v[kbeg..kend]^T [D, w]
                    sgemm(m, w, d, dp, w, false, gs, d, 1, vs, 1, d, 1.0, 1);
                    // ds = p ⊙ (dp − Σ_d g ⊙ out) · scale, in place of dp (0 where p is)
                    for i in 0..m {
                        let row = q0 + i;
                        let delta: f32 = g[row * d..][..d].iter().zip(&o[row * d..][..d]).map(|(a, b)| a * b).sum();
                        let (pr, dr) = (&p[i * w..][..w], &mut dp[i * w..][..w]);
                        for (x, &pv) in dr.iter_mut().zip(pr) {
                            *x = pv * (*x - delta) * scale;
                        }
                    }
                    // SAFETY: strip si of this unit is in exactly one group, i.e. one task.
                    let dq = unsafe { dq_at.rows((unit * s + q0) * d, m * d) };
                    // dq_strip [m, D] = ds [m, w] · k[kbeg..kend] [w, D]
                    sgemm(m, d, w, dq, d, false, dp, w, 1, ks, d, 1, 1.0, 1);
                    // dk[kbeg..kend] += ds^T [w, m] · q_strip [m, D]
                    sgemm(w, d, m, &mut dk[kbeg * d..], d, true, dp, 1, w, &q[q0 * d..], d, 1, 1.0, 1);
                }
            });
        // dk, dv [B, KV, S, D]: the R query heads of each kv head (and their strip groups),
        // summed in a fixed order.
        let fold = |per_task: &[f32]| -> Vec<f32> {
            let mut acc = zeros_f32(b * kv * s * d);
            acc.par_chunks_mut(s * d).enumerate().for_each(|(unit, a)| {
                let (bi, gi) = (unit / kv, unit % kv);
                for j in 0..r * parts {
                    let t = (bi * nh + gi * r) * parts + j;
                    a.iter_mut().zip(&per_task[t * s * d..][..s * d]).for_each(|(x, y)| *x += y);
                }
            });
            acc
        };
        let dev = q.device();
        let dq = Tensor::from_vec(dq, q.shape(), dev)?;
        let dk = Tensor::from_vec(fold(&dk_h), k.shape(), dev)?;
        let dv = Tensor::from_vec(fold(&dv_h), v.shape(), dev)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn pseudo(n: usize, seed: usize) -> Vec<f32> {
        (0..n).map(|i| (((i * 2654435761 + seed * 97) % 1000) as f32 / 1000.0 - 0.5) * 2.0).collect()
    }

    /// The fused op equals the generic path in value and in all three gradients, with GQA
    /// (R = 3), several strips, a short last strip (S = 150 = 2 x 64 + 22), and packed
    /// records (one of a single token) in the second row; with few heads (strips split into
    /// two groups per head) and with enough heads (one task per head).
    #[test]
    fn fused_causal_attention_matches_the_generic_path() -> Result<()> {
        for (nh, kv) in [(6, 2), (9, 3)] {
            assert_eq!(parts_for(2 * nh), if nh == 6 { 2 } else { 1 }, "both task splits are covered");
            fused_matches_generic(nh, kv)?;
        }
        Ok(())
    }

    fn fused_matches_generic(nh: usize, kv: usize) -> Result<()> {
        let dev = Device::Cpu;
        let (b, s, d) = (2, 150, 16);
        let q = Var::from_vec(pseudo(b * nh * s * d, 1), (b, nh, s, d), &dev)?;
        let k = Var::from_vec(pseudo(b * kv * s * d, 2), (b, kv, s, d), &dev)?;
        let v = Var::from_vec(pseudo(b * kv * s * d, 3), (b, kv, s, d), &dev)?;
        let g = Tensor::from_vec(pseudo(b * nh * s * d, 4), (b, nh, s, d), &dev)?;
        let scale = 1.0 / (d as f64).sqrt();
        // Row 0 plain causal; row 1 packed: records at 0..40, 40..41, 41..150.
        let mut starts = vec![0u32; b * s];
        for i in 0..s {
            starts[s + i] = if i < 40 { 0 } else if i < 41 { 40 } else { 41 };
        }
        let fused = causal_attention(&q, &k, &v, scale, &starts)?;
        let generic = generic_causal_attention(&q, &k, &v, scale, &starts)?;
        let diff = |a: &Tensor, b: &Tensor| -> Result<f32> { (a - b)?.abs()?.max_all()?.to_scalar::<f32>() };
        let d_out = diff(&fused, &generic)?;
        let gf = (fused * &g)?.sum_all()?.backward()?;
        let gg = (generic * &g)?.sum_all()?.backward()?;
        let mut worst = vec![("out", d_out)];
        for (name, var) in [("dq", &q), ("dk", &k), ("dv", &v)] {
            let (a, b) = (gf.get(var).expect("fused grad"), gg.get(var).expect("generic grad"));
            worst.push((name, diff(a, b)?));
        }
        println!("fused vs generic attention, max abs diff: {worst:?}");
        for (name, dmax) in worst {
            assert!(dmax < 1e-5, "{name} differs by {dmax}");
        }
        Ok(())
    }

    /// Strips see only their past: a position's output is the same with the rest of the
    /// sequence cut off.
    #[test]
    fn fused_attention_output_depends_only_on_earlier_positions() -> Result<()> {
        let dev = Device::Cpu;
        let (s, d) = (300, 8);
        let q = Tensor::from_vec(pseudo(s * d, 5), (1, 1, s, d), &dev)?;
        let k = Tensor::from_vec(pseudo(s * d, 6), (1, 1, s, d), &dev)?;
        let v = Tensor::from_vec(pseudo(s * d, 7), (1, 1, s, d), &dev)?;
        let full = causal_attention(&q, &k, &v, 0.5, &[0; 300])?;
        // Position 100's output depends only on keys 0..=100: the prefix alone gives it too.
        let prefix = causal_attention(&q.narrow(2, 0, 101)?, &k.narrow(2, 0, 101)?, &v.narrow(2, 0, 101)?, 0.5, &[0; 101])?;
        let a = full.narrow(2, 100, 1)?;
        let b = prefix.narrow(2, 100, 1)?;
        let dmax = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(dmax < 1e-6, "position 100 saw the future: {dmax}");
        Ok(())
    }
}
