//! Chunked cross-entropy through the frozen LM head, with its gradient computed directly.
//!
//! The full logits tensor of a batch ([N, V] f32, plus its gradient under autograd) is the
//! largest allocation of a training step (4 x 512 x 49152 x 4 B = 400 MB, twice), and the
//! head itself is the largest frozen tensor (a 7B model's [102400, 4096] is 0.84 GB in bf16,
//! twice a decoder layer). Neither is ever held whole here:
//! - The head is read in chunks of vocabulary rows (`head(start, len)`), so a quantized base
//!   dequantises, and a bf16 base on an f32 CPU converts, one chunk at a time.
//! - Each chunk's logits are folded into a running softmax per token row, as flash attention
//!   does over keys: the running max and sum of exp(l - max), and
//!   acc = Σ exp(l - max) W over the chunks seen, rescaled when the max grows.
//! - Because the head is frozen, dLoss/dhidden has a closed form,
//!   (softmax(logits) - onehot(target)) @ W = (acc - others W[target]) / sum, which is handed
//!   to autograd as the upstream gradient of the hidden rows. The target's own term is left
//!   out of acc and of others = Σ exp(l - max) (its sum over the other tokens): both sides
//!   then shrink as the softmax settles on the target, where acc / sum - W[target] would be a
//!   difference of two near-equal vectors, lost to rounding when acc is bf16 (a GPU's head).
//!
//! Each head chunk is read once and used for two GEMMs (logits, then p @ W), as the whole
//! head was before.

use super::bf16_gemm::{PackedB, RoundedRows};
use super::{f32_elems, zeros_f32, Kernels, Op, Path};
use candle_core::{DType, Result, Tensor, D};

/// Most logits elements held at once (28 MB of f32). Kept under glibc's largest mmap
/// threshold (32 MB, which `main` sets): a larger chunk's logits and gradient would each be a
/// fresh mmap, so every chunk of every step would fault in and zero new pages.
const CHUNK_ELEMS: usize = 7 << 20;

/// Most bytes of the head read at once, a small part of a decoder layer of any model whose
/// head is worth chunking (a 7B layer is 400 MB in bf16). A chunk is live with its two packed
/// copies and its logits at the end of the forward, when every kept activation is too: that
/// is the step's peak. 8 MB rather than 32 took SmolLM2's 1 x 512 peak from 702 to 642 MB
/// (4 x 512: 1630 -> 1611 MB; DeepSeek-V2-Lite's MoE cut: 2830 -> 2816 MB) at the same speed
/// in alternating runs (2-core Zen 4 VM, bf16 base).
const HEAD_CHUNK_BYTES: usize = 8 << 20;

/// Token rows per chunk for `v` vocabulary rows: as many as fit in `CHUNK_ELEMS`, rounded down to
/// whole 32-row GEMM blocks for each thread when that many fit. Why: the head GEMMs split a
/// chunk's row blocks over the threads, and the 149 rows that fit for a 49k vocabulary are 5
/// blocks, which 2 threads run as 3 + 2 (a sixth of the head's time idle); 128 rows are 2 + 2.
fn chunk_rows(v: usize, threads: usize) -> usize {
    let fit = (CHUNK_ELEMS / v.max(1)).max(1);
    let quantum = 32 * threads.max(1);
    if fit >= quantum { fit - fit % quantum } else { fit }
}

/// Vocabulary rows per head chunk for a head of `v` rows of `row_bytes` (as the loss reads
/// it: in the matmul dtype): equal chunks of at most `HEAD_CHUNK_BYTES`, in whole 64-row GEMM
/// panels. Depends on the head alone, so a token row's arithmetic is the same however many
/// rows a rank has (world sizes agree). `finetune plan` counts a quantized head's chunks by it.
pub fn vocab_chunk(v: usize, row_bytes: usize) -> usize {
    let chunks = (v * row_bytes).div_ceil(HEAD_CHUNK_BYTES).max(1);
    v.div_ceil(chunks).next_multiple_of(64).min(v).max(1)
}

/// The frozen head [V, H] as the loss reads it: `read(start, len)` gives rows
/// start..start+len [len, H] in `dtype`, the dtype its matmul takes.
pub struct HeadRows<'a> {
    pub vocab: usize,
    pub hidden: usize,
    pub dtype: DType,
    pub read: Box<dyn Fn(usize, usize) -> Result<Tensor> + 'a>,
}

impl<'a> HeadRows<'a> {
    /// A head held whole (tests, and callers that have the tensor anyway).
    pub fn of(head: &'a Tensor) -> Result<Self> {
        let (vocab, hidden) = head.dims2()?;
        Ok(HeadRows { vocab, hidden, dtype: head.dtype(), read: Box::new(move |start, len| head.narrow(0, start, len)) })
    }
}

/// rows [M, H] (final-normed hidden states of the positions that have a target), the head
/// [V, H], targets [M] -> (sum of token cross-entropies, d(scale * sum)/d rows [M, H]).
/// With `scale` 0 (evaluation) the gradient GEMMs are skipped and the gradient is zeros.
///
/// Every head chunk is read even when M = 0: under ZeRO-3 reading the head is a collective
/// all ranks join.
///
/// Fused path (CPU f32 rows): one parallel pass per chunk folds the logits into the running
/// softmax. Portable path: the same from candle ops; the logits of a chunk come out of the
/// head's own dtype (as transformers computes `lm_head` in the model dtype) and the softmax
/// and cross-entropy run in f32 (as its loss upcasts the logits).
pub fn cross_entropy_sum_and_grad(k: Kernels, rows: &Tensor, head: &HeadRows, targets: &[u32], scale: f64) -> Result<(f64, Tensor)> {
    let (m, h) = rows.dims2()?;
    let v = head.vocab;
    if head.hidden != h || targets.len() != m {
        candle_core::bail!("cross-entropy: rows {:?}, head [{v}, {}] and {} targets do not fit", rows.dims(), head.hidden, targets.len());
    }
    if let Some(t) = targets.iter().find(|&&t| t as usize >= v) {
        candle_core::bail!("cross-entropy: target token {t} is outside the vocabulary of {v}");
    }
    let vc = vocab_chunk(v, h * head.dtype.size_in_bytes());
    let chunk = chunk_rows(vc, rayon::current_num_threads());
    let spans: Vec<(usize, usize)> = (0..m).step_by(chunk.max(1)).map(|s| (s, chunk.min(m - s))).collect();
    let want_grad = scale != 0.0;
    let mut runs: Vec<Running> = Vec::new();
    let mut picked = None; // W[target] per row [M, H] f32, filled chunk by chunk
    for v0 in (0..v).step_by(vc) {
        let n = vc.min(v - v0);
        let w = (head.read)(v0, n)?; // [n, H]
        if m == 0 {
            continue;
        }
        let path = k.pick(Op::LossHead, rows, &[&w]);
        if runs.is_empty() {
            runs = spans.iter().map(|&(_, c)| Running::new(path, c, rows.device())).collect::<Result<_>>()?;
            picked = want_grad.then(|| Picked::new(path, m, h, w.device())).transpose()?;
        }
        if let Some(picked) = &mut picked {
            picked.add_rows(&w, targets, v0)?;
        }
        // A chunk read from the file (not a view of a held head) is dropped once prepared.
        let hd = Head::new(path, &w)?;
        drop(w);
        for (run, &(r0, c)) in runs.iter_mut().zip(&spans) {
            run.absorb(&hd, &rows.narrow(0, r0, c)?, &targets[r0..r0 + c], v0, want_grad)?; // rows [C, H]
        }
    }
    let mut total = 0f64;
    let mut grads = Vec::new();
    for (run, &(r0, _)) in runs.into_iter().zip(&spans) {
        let (ce, grad) = run.finish(picked.as_ref(), r0, scale)?; // grad [C, H]
        total += ce;
        grads.extend(grad.map(|g| g.to_dtype(rows.dtype())).transpose()?);
    }
    let grad = if grads.is_empty() { rows.zeros_like()? } else { Tensor::cat(&grads, 0)? };
    Ok((total, grad))
}

/// W's rows for every token row's target, [M, H] f32, put in place chunk by chunk (each
/// target falls in one chunk, so each row is set once).
enum Picked {
    /// Fused path: on the host; a chunk copies in only the rows of its own targets (a few per
    /// chunk, where a gather of all M rows and a select wrote [M, H] twice per chunk: 50 chunks
    /// a step at DeepSeek-V2-Lite's vocabulary).
    Host { rows: Vec<f32>, h: usize },
    /// Portable path: a gather of M rows and a select per chunk, not an index_add (candle's
    /// index_add kernel walks the indices serially per column: a millisecond per chunk on a GPU).
    Device(Tensor),
}

impl Picked {
    fn new(path: Path, m: usize, h: usize, device: &candle_core::Device) -> Result<Self> {
        Ok(match path {
            Path::Fused => Picked::Host { rows: zeros_f32(m * h), h },
            Path::Portable => Picked::Device(Tensor::zeros((m, h), DType::F32, device)?),
        })
    }

    /// Puts in the rows of the targets that fall in the head chunk `w` = rows v0..v0+n.
    fn add_rows(&mut self, w: &Tensor, targets: &[u32], v0: usize) -> Result<()> {
        let (n, h) = w.dims2()?;
        let local = |t: u32| (t as usize).checked_sub(v0).filter(|&i| i < n);
        match self {
            Picked::Host { rows, .. } => {
                let (mine, idx): (Vec<usize>, Vec<u32>) = targets.iter().enumerate().filter_map(|(r, &t)| local(t).map(|i| (r, i as u32))).unzip();
                if mine.is_empty() {
                    return Ok(());
                }
                let got = w.index_select(&Tensor::from_vec(idx, mine.len(), w.device())?, 0)?.to_dtype(DType::F32)?; // [mine, H]
                let got = f32_elems(&got)?;
                for (j, &r) in mine.iter().enumerate() {
                    rows[r * h..][..h].copy_from_slice(&got[j * h..][..h]);
                }
            }
            Picked::Device(picked) => {
                let m = targets.len();
                let (idx, inside): (Vec<u32>, Vec<u8>) = targets.iter().map(|&t| local(t).map_or((0, 0), |i| (i as u32, 1))).unzip();
                if !inside.contains(&1) {
                    return Ok(());
                }
                let got = w.index_select(&Tensor::from_vec(idx, m, w.device())?, 0)?.to_dtype(DType::F32)?; // [M, H]
                let mask = Tensor::from_vec(inside, (m, 1), w.device())?.broadcast_as((m, h))?; // [M, H]
                *picked = mask.where_cond(&got, picked)?;
            }
        }
        Ok(())
    }
}

/// The running softmax of one chunk of token rows over the head chunks read so far.
struct Running {
    acc: Acc,
    stats: Stats,
    /// The token rows rounded to bf16 once for every head chunk's logits (a bf16 head on the
    /// dot kernel; None until the first chunk, and elsewhere).
    x_bits: Option<RoundedRows>,
}

/// Σ exp(l - max) W over the head chunks seen, the target's row left out, at the current max
/// [C, H] f32 (None before the first chunk).
enum Acc {
    /// Fused path: rows `ld` apart (the bf16 GEMM's padded C, which it adds each chunk's
    /// product into; the f32 GEMM's [C, H]).
    Host { acc: Option<Vec<f32>>, ld: usize },
    /// Portable path.
    Device(Option<Tensor>),
}

/// Per token row: the running max of its logits, the sum of exp(l - max) (and that sum
/// without the target's term), and the logit of its target (once its chunk has been seen).
enum Stats {
    /// Fused path: on the host, updated in one parallel pass per chunk.
    Host { rows: Vec<RowStats>, device: candle_core::Device },
    /// Portable path: [C, 1] f32 tensors on the rows' device.
    Device { max: Tensor, sum: Tensor, others: Tensor, target: Tensor },
}

#[derive(Clone, Copy)]
struct RowStats {
    max: f32,
    sum: f32,
    others: f32,
    target: f32,
}

impl Running {
    fn new(path: Path, c: usize, device: &candle_core::Device) -> Result<Self> {
        Ok(match path {
            Path::Fused => Running {
                x_bits: None,
                acc: Acc::Host { acc: None, ld: 0 },
                stats: Stats::Host { rows: vec![RowStats { max: f32::NEG_INFINITY, sum: 0.0, others: 0.0, target: 0.0 }; c], device: device.clone() },
            },
            Path::Portable => Running {
                x_bits: None,
                acc: Acc::Device(None),
                stats: Stats::Device {
                    max: Tensor::full(f32::NEG_INFINITY, (c, 1), device)?,
                    sum: Tensor::zeros((c, 1), DType::F32, device)?,
                    others: Tensor::zeros((c, 1), DType::F32, device)?,
                    target: Tensor::zeros((c, 1), DType::F32, device)?,
                },
            },
        })
    }

    /// Folds a head chunk (vocabulary rows v0..) into the stats of the token rows x [C, H],
    /// and, with `want_grad`, its p @ W into acc, what was summed before rescaled by
    /// exp(old max - new max).
    fn absorb(&mut self, hd: &Head, x: &Tensor, targets: &[u32], v0: usize, want_grad: bool) -> Result<()> {
        if self.x_bits.is_none() && matches!(hd, Head::Bf16 { .. }) {
            let (c, h) = x.dims2()?;
            self.x_bits = RoundedRows::new(&f32_elems(&x.contiguous()?)?, c, h);
        }
        let logits = hd.logits(x, self.x_bits.as_ref())?; // [C, n] f32
        match (&mut self.stats, &mut self.acc) {
            (Stats::Host { rows, .. }, Acc::Host { acc, ld }) => {
                // p straight into the bf16 GEMM's rows where that GEMM takes it.
                let rounded = want_grad && self.x_bits.is_some();
                let (p, alpha) = if rounded { fold_rows_rounded(&logits, rows, targets, v0)? } else { fold_rows(&logits, rows, targets, v0).map(|(p, a)| (Probs::F32(p), a))? }; // [C, n], [C]
                drop(logits);
                if want_grad {
                    hd.accumulate(&p, &alpha, acc, ld)?;
                }
            }
            (Stats::Device { max, sum, others, target }, Acc::Device(acc)) => {
                let (p, alpha) = fold_device(&logits, (max, sum, others, target), targets, v0)?; // [C, n], [C, 1]
                if want_grad {
                    let g = hd.input_grad(&p)?.to_dtype(DType::F32)?; // [C, H]
                    *acc = Some(match acc.take() {
                        Some(acc) => (acc.broadcast_mul(&alpha)? + g)?,
                        None => g,
                    });
                }
            }
            _ => candle_core::bail!("cross-entropy: the stats and the sum took different paths"),
        }
        Ok(())
    }

    /// (the CE sum of the rows, summed in f64; with a gradient, d(scale * CE sum)/d rows
    /// [C, H] f32 = scale (softmax - onehot) @ W = scale (acc - others W[target]) / sum, for
    /// the rows from `r0` of `picked`).
    fn finish(self, picked: Option<&Picked>, r0: usize, scale: f64) -> Result<(f64, Option<Tensor>)> {
        match (self.stats, self.acc, picked) {
            (Stats::Host { rows, device }, Acc::Host { acc, ld }, picked) => {
                // CE = log(sum exp(l - max)) - (l_t - max)
                let ce = rows.iter().map(|s| (s.sum.ln() - (s.target - s.max)) as f64).sum();
                let (Some(acc), Some(Picked::Host { rows: picked, h })) = (acc, picked) else { return Ok((ce, None)) };
                let (c, h) = (rows.len(), *h);
                let picked = &picked[r0 * h..][..c * h];
                let grad = crate::ops::par_zeroed(c * h, h.max(1), |r, g: &mut [f32]| {
                    let (others, f) = (rows[r].others, (1.0 / rows[r].sum) * scale as f32);
                    for ((g, &a), &w) in g.iter_mut().zip(&acc[r * ld..][..h]).zip(&picked[r * h..][..h]) {
                        *g = (a - w * others) * f;
                    }
                });
                Ok((ce, Some(Tensor::from_vec(grad, (c, h), &device)?)))
            }
            (Stats::Device { max, sum, others, target }, Acc::Device(acc), picked) => {
                let ce = (sum.log()? - (target - max)?)?.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
                let (Some(acc), Some(Picked::Device(picked))) = (acc, picked) else { return Ok((ce, None)) };
                let c = acc.dim(0)?;
                let g = (acc - picked.narrow(0, r0, c)?.broadcast_mul(&others)?)?.broadcast_mul(&(sum.recip()? * scale)?)?; // [C, H]
                Ok((ce, Some(g)))
            }
            _ => candle_core::bail!("cross-entropy: the stats and the sum took different paths"),
        }
    }
}

/// The portable fold: the stats updated from a head chunk's logits [C, n] (vocabulary rows
/// v0..v0+n); returns p = exp(l - new max) [C, n] with each row's target entry zeroed, and
/// each row's factor exp(old max - new max) [C, 1], by which what was summed before is
/// rescaled.
fn fold_device(logits: &Tensor, (max, sum, others, target): (&mut Tensor, &mut Tensor, &mut Tensor, &mut Tensor), targets: &[u32], v0: usize) -> Result<(Tensor, Tensor)> {
    let (c, n) = logits.dims2()?;
    let new_max = max.maximum(&logits.max_keepdim(D::Minus1)?)?; // [C, 1]
    // 0 on the first chunk, where max is -inf and nothing was summed yet.
    let alpha = (&*max - &new_max)?.exp()?; // [C, 1]
    let mut p = logits.broadcast_sub(&new_max)?.exp()?; // [C, n]
    let (local, inside): (Vec<u32>, Vec<u8>) = targets.iter().map(|&t| (t as usize).checked_sub(v0).filter(|&i| i < n).map_or((0, 0), |i| (i as u32, 1))).unzip();
    let mut p_target = None;
    if inside.contains(&1) {
        let idx = Tensor::from_vec(local, (c, 1), logits.device())?;
        let mask = Tensor::from_vec(inside, (c, 1), logits.device())?;
        let zero = Tensor::zeros((c, 1), DType::F32, logits.device())?;
        *target = (&*target + mask.where_cond(&logits.gather(&idx, 1)?, &zero)?)?;
        let pt = mask.where_cond(&p.gather(&idx, 1)?, &zero)?; // [C, 1]
        p = p.scatter_add(&idx, &pt.neg()?, 1)?; // the target entries are now exactly 0
        p_target = Some(pt);
    }
    let rest = p.sum_keepdim(D::Minus1)?; // [C, 1]
    *others = ((&*others * &alpha)? + &rest)?;
    *sum = ((&*sum * &alpha)? + rest)?;
    if let Some(pt) = p_target {
        *sum = (&*sum + pt)?;
    }
    *max = new_max;
    Ok((p, alpha))
}

/// The fused fold (CPU f32 logits [C, n]), one parallel pass over the rows: what
/// [`fold_device`] computes, p [C, n] and alpha [C] on the host.
fn fold_rows(logits: &Tensor, stats: &mut [RowStats], targets: &[u32], v0: usize) -> Result<(Vec<f32>, Vec<f32>)> {
    use rayon::prelude::*;
    let (c, n) = logits.dims2()?;
    let logits = logits.contiguous()?;
    let (st, layout) = logits.storage_and_layout();
    let data = logit_rows(&st, layout, stats, targets, (c, n))?;
    // Not zeroed first: every element is written below (a 15 MB memset per head chunk at
    // DeepSeek-V2-Lite's vocabulary).
    let mut p: Vec<f32> = Vec::with_capacity(c * n);
    let mut alpha = vec![0f32; c];
    p.spare_capacity_mut()[..c * n].par_chunks_mut(n.max(1)).zip(data.par_chunks(n.max(1))).zip(stats.par_iter_mut()).zip(alpha.par_iter_mut()).zip(targets.par_iter()).for_each(
        |((((p, l), s), a), &t)| {
            (*s, *a) = fold_row(l, s, t, v0, p);
        },
    );
    drop(st);
    // SAFETY: the rows cover all c * n elements (data is [c, n]) and `fold_row` wrote each.
    unsafe { p.set_len(c * n) };
    Ok((p, alpha))
}

/// [`fold_rows`] with p written rounded to bf16, as the input gradient's GEMM reads it (the
/// dot kernel's padded rows): no f32 p [C, n] written, read back and rounded into a zeroed
/// buffer per head chunk. The stats are summed from the f32 values, as in `fold_rows`: the
/// same bits. Callers take it only where [`RoundedRows`] exist (the dot kernel).
fn fold_rows_rounded(logits: &Tensor, stats: &mut [RowStats], targets: &[u32], v0: usize) -> Result<(Probs, Vec<f32>)> {
    let (c, n) = logits.dims2()?;
    let logits = logits.contiguous()?;
    let (st, layout) = logits.storage_and_layout();
    let data = logit_rows(&st, layout, stats, targets, (c, n))?;
    let prev: &[RowStats] = stats;
    let built = RoundedRows::from_rows(c, n, |r, dst| {
        let mut p: Vec<f32> = Vec::with_capacity(n);
        let out = fold_row(&data[r * n..][..n], &prev[r], targets[r], v0, &mut p.spare_capacity_mut()[..n]);
        // SAFETY: `fold_row` wrote all n elements.
        unsafe { p.set_len(n) };
        super::bf16_gemm::round_into(&p, dst);
        out
    });
    drop(st);
    let Some((bits, out)) = built else { candle_core::bail!("fold_rows_rounded: no dot kernel here (RoundedRows are its rows)") };
    let mut alpha = Vec::with_capacity(c);
    for (s, (next, a)) in stats.iter_mut().zip(out) {
        *s = next;
        alpha.push(a);
    }
    Ok((Probs::Rounded(bits), alpha))
}

/// The f32 data of contiguous logits [C, n], checked against the stats and targets.
fn logit_rows<'a>(st: &'a candle_core::Storage, layout: &candle_core::Layout, stats: &[RowStats], targets: &[u32], (c, n): (usize, usize)) -> Result<&'a [f32]> {
    let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(data)) = st else {
        candle_core::bail!("fold_rows: f32 cpu logits expected")
    };
    let Some((o, e)) = layout.contiguous_offsets() else { candle_core::bail!("fold_rows: contiguous logits expected") };
    let data = &data[o..e];
    if stats.len() != c || targets.len() != c || data.len() != c * n {
        candle_core::bail!("fold_rows: {} row stats and {} targets for logits [{c}, {n}]", stats.len(), targets.len());
    }
    Ok(data)
}

/// One token row's fold over a head chunk's logits `l` (vocabulary rows v0..): writes every
/// element of p = exp(l - new max) (the target's entry then taken out, see the module doc) and
/// returns the row's new stats and alpha = exp(old max - new max).
fn fold_row(l: &[f32], s: &RowStats, t: u32, v0: usize, p: &mut [std::mem::MaybeUninit<f32>]) -> (RowStats, f32) {
    let max = l.iter().fold(s.max, |m, &x| m.max(x));
    let a = if s.max == max {
        1.0
    } else if s.max == f32::NEG_INFINITY {
        0.0
    } else {
        super::exp_f32(s.max - max)
    };
    p.iter_mut().zip(l).for_each(|(pi, &li)| {
        pi.write(super::exp_f32(li - max));
    });
    // SAFETY: every element of p was written just above.
    let p = unsafe { &mut *(p as *mut [std::mem::MaybeUninit<f32>] as *mut [f32]) };
    // The target's term is taken out of p (see the module doc) and added to sum alone.
    let (mut next, mut p_target) = (*s, 0.0);
    if let Some(i) = (t as usize).checked_sub(v0).filter(|&i| i < l.len()) {
        next.target = l[i];
        p_target = std::mem::take(&mut p[i]);
    }
    let rest = super::sum_f32(p);
    next.others = s.others * a + rest;
    next.sum = s.sum * a + rest + p_target;
    next.max = max;
    (next, a)
}

/// A head chunk's p = exp(l - max) [C, n] as the input gradient's GEMM takes it.
enum Probs {
    F32(Vec<f32>),
    /// Rounded to bf16 in the dot kernel's rows ([`fold_rows_rounded`]).
    Rounded(RoundedRows),
}

/// A head chunk [n, H] in the form its two matmuls want, prepared once per chunk.
enum Head {
    /// Fused, f32 head: the f32 GEMM.
    F32(Tensor),
    /// Fused, bf16 head on a CPU with a bf16 unit:
    /// packed for x @ Wᵀ and for p @ W, so both run on it like the frozen projections.
    Bf16 { nk: PackedB, kn: PackedB },
    /// Portable: the head in its own dtype, chunks meeting it there.
    Native(Tensor),
}

impl Head {
    fn new(path: Path, head: &Tensor) -> Result<Self> {
        Ok(match (path, head.dtype()) {
            (Path::Fused, DType::BF16) if super::bf16_gemm::available() => Head::Bf16 { nk: PackedB::from_weight(head, false)?, kn: PackedB::from_weight(head, true)? },
            // Without a bf16 unit a bf16 chunk is widened to f32 (exact) once per chunk.
            (Path::Fused, _) => Head::F32(head.to_dtype(DType::F32)?),
            (Path::Portable, _) => Head::Native(head.clone()),
        })
    }

    /// x [C, H] -> logits [C, n] f32 (a bf16 head: from `x_bits`, x rounded once, where given).
    fn logits(&self, x: &Tensor, x_bits: Option<&RoundedRows>) -> Result<Tensor> {
        match self {
            Head::F32(w) => x.matmul(&w.t()?),
            Head::Bf16 { nk, .. } => match x_bits {
                Some(bits) => Tensor::from_vec(super::bf16_gemm::gemm_rounded(bits, nk), (x.dim(0)?, nk.cols()), x.device()),
                None => super::bf16_gemm::matmul(x, nk),
            },
            Head::Native(w) => x.to_dtype(w.dtype())?.matmul(&w.t()?)?.to_dtype(DType::F32),
        }
    }

    /// p [C, n] f32 -> p @ W [C, H] in the head's dtype (portable path; the fused heads add
    /// theirs into acc, [`Head::accumulate`]).
    fn input_grad(&self, p: &Tensor) -> Result<Tensor> {
        match self {
            Head::Native(w) => p.to_dtype(w.dtype())?.matmul(w),
            Head::F32(_) | Head::Bf16 { .. } => candle_core::bail!("cross-entropy: a fused head's product goes into acc (Head::accumulate)"),
        }
    }

    /// acc = alpha ⊙ acc + p @ W on the host (fused path) for p [C, n] f32 and alpha [C]: the
    /// rows whose max grew are rescaled in place (after the first chunks most rows' max stays,
    /// alpha 1), then the GEMM adds its products into acc. The first chunk's GEMM stores acc
    /// (rows `ld` apart: the bf16 GEMM's padded C, or [C, H]). Where acc was a candle tensor,
    /// every chunk wrote p @ W, read it back with acc, and wrote alpha ⊙ acc and the sum: at
    /// DeepSeek-V2-Lite's vocabulary 50 chunks a step, 3% of a MoE step's samples with the
    /// picked rows' gathers (2-core Zen 4, 2026-11-28).
    fn accumulate(&self, p: &Probs, alpha: &[f32], acc: &mut Option<Vec<f32>>, ld: &mut usize) -> Result<()> {
        use rayon::prelude::*;
        let c = alpha.len();
        let accumulate = acc.is_some();
        if let Some(acc) = acc.as_mut() {
            acc.par_chunks_mut((*ld).max(1)).zip(alpha.par_iter()).filter(|(_, &a)| a != 1.0).for_each(|(row, &a)| row.iter_mut().for_each(|v| *v *= a));
        }
        match self {
            Head::Bf16 { kn, .. } => {
                let Some((mp, np)) = super::bf16_gemm::padded_dims(c, kn) else { candle_core::bail!("cross-entropy: a bf16-packed head without a bf16 unit") };
                let buf = acc.get_or_insert_with(|| {
                    *ld = np;
                    zeros_f32(mp * np)
                });
                match p {
                    Probs::F32(p) => super::bf16_gemm::gemm_acc(p, c, kn, buf, accumulate),
                    Probs::Rounded(bits) => super::bf16_gemm::gemm_acc_rounded(bits, kn, buf, accumulate),
                }
            }
            Head::F32(w) => {
                let Probs::F32(p) = p else { candle_core::bail!("cross-entropy: bf16-rounded p for an f32 head") };
                let (n, h) = w.dims2()?;
                let w = f32_elems(w)?;
                let buf = acc.get_or_insert_with(|| {
                    *ld = h;
                    zeros_f32(c * h)
                });
                super::sgemm(c, h, n, buf, h, accumulate, p, n, 1, &w, h, 1, 1.0, candle_core::utils::get_num_threads());
            }
            Head::Native(_) => candle_core::bail!("cross-entropy: a portable head on the host path"),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// A bf16 head on the CPU's bf16 unit gives what the f32 path gives for the bf16-rounded
    /// rows and head (the rounding is the contract; the sums are f32 either way).
    #[test]
    #[cfg_attr(not(bf16_unit), ignore = "needs AMX or AVX512-BF16")]
    fn a_bf16_head_on_a_bf16_unit_matches_the_f32_head_on_rounded_rows() -> Result<()> {
        assert!(crate::ops::bf16_gemm::available(), "build.rs found a bf16 unit but this process has none: rebuild on this machine");
        let dev = Device::Cpu;
        let (m, h, v) = (45, 64, 300);
        let rows = Tensor::from_vec((0..m * h).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.1).collect(), (m, h), &dev)?;
        let head = Tensor::from_vec((0..v * h).map(|i| ((i * 13 % 7) as f32 - 3.0) * 0.05).collect(), (v, h), &dev)?.to_dtype(DType::BF16)?;
        let targets: Vec<u32> = (0..m as u32).map(|i| i * 7 % v as u32).collect();
        let (ce, grad) = cross_entropy_sum_and_grad(Kernels::Auto, &rows, &HeadRows::of(&head)?, &targets, 0.25)?;
        let rounded = rows.to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
        let h32 = head.to_dtype(DType::F32)?;
        let (ce32, _) = cross_entropy_sum_and_grad(Kernels::Auto, &rounded, &HeadRows::of(&h32)?, &targets, 0.25)?;
        // The input gradient rounds p = exp(l - max) to bf16 too (one head chunk here): compare
        // with 0.25 (round(p) W - others W[target]) / sum, p from the same fold.
        let logits = rounded.matmul(&h32.t()?)?;
        let mut stats = vec![RowStats { max: f32::NEG_INFINITY, sum: 0.0, others: 0.0, target: 0.0 }; m];
        let (p, _) = fold_rows(&logits, &mut stats, &targets, 0)?;
        let p = Tensor::from_vec(p, (m, v), &dev)?; // [M, V]
        let col = |f: fn(&RowStats) -> f32| Tensor::from_vec(stats.iter().map(f).collect::<Vec<_>>(), (m, 1), &dev);
        let picked = h32.index_select(&Tensor::new(targets.as_slice(), &dev)?, 0)?;
        let acc = p.to_dtype(DType::BF16)?.to_dtype(DType::F32)?.matmul(&h32)?;
        let want = ((acc - picked.broadcast_mul(&col(|s| s.others)?)?)?.broadcast_div(&col(|s| s.sum)?)? * 0.25)?;
        let diff = (grad - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        println!("bf16 head: |ce diff| {:e}, max |grad diff| {diff:e}", (ce - ce32).abs());
        assert!((ce - ce32).abs() < 1e-4 * ce32.abs(), "ce {ce} vs {ce32}");
        assert!(diff < 1e-5, "grad differs by {diff}");
        Ok(())
    }

    /// The fold that writes p rounded for the bf16 GEMM leaves the stats, alpha and the input
    /// gradient's product exactly as the f32 fold and a GEMM rounding p itself do, on a
    /// second chunk (rows whose max grows, a target inside and outside it).
    #[test]
    #[cfg_attr(not(bf16_dot), ignore = "needs AVX512-BF16's dot kernel as the process kernel (on AMX the loss keeps its f32 p; FINETUNE_NO_AMX=1 runs it there)")]
    fn the_fold_into_rounded_rows_gives_the_bits_of_the_f32_fold() -> Result<()> {
        let dev = Device::Cpu;
        let (c, n, h) = (21, 70, 40);
        let chunk = |seed: usize| Tensor::from_vec((0..c * n).map(|i| (((i + seed) * 37 % 101) as f32 - 50.0) * 0.07).collect(), (c, n), &dev);
        let targets: Vec<u32> = (0..c as u32).map(|i| i * 11 % 160).collect();
        let fresh = vec![RowStats { max: f32::NEG_INFINITY, sum: 0.0, others: 0.0, target: 0.0 }; c];
        let (mut s32, mut sbf) = (fresh.clone(), fresh);
        fold_rows(&chunk(0)?, &mut s32, &targets, 0)?;
        assert!(crate::ops::bf16_gemm::RoundedRows::new(&[0.0; 32], 1, 32).is_some(), "build.rs found the dot kernel but this process runs another");
        fold_rows_rounded(&chunk(0)?, &mut sbf, &targets, 0)?;
        let (p32, a32) = fold_rows(&chunk(5)?, &mut s32, &targets, n)?;
        let (pbf, abf) = fold_rows_rounded(&chunk(5)?, &mut sbf, &targets, n)?;
        let bits = |s: &[RowStats]| s.iter().flat_map(|s| [s.max, s.sum, s.others, s.target].map(f32::to_bits)).collect::<Vec<u32>>();
        assert_eq!(bits(&s32), bits(&sbf), "stats");
        assert_eq!(a32.iter().map(|a| a.to_bits()).collect::<Vec<_>>(), abf.iter().map(|a| a.to_bits()).collect::<Vec<_>>(), "alpha");
        let w = Tensor::from_vec((0..n * h).map(|i| ((i * 13 % 7) as f32 - 3.0) * 0.05).collect(), (n, h), &dev)?.to_dtype(DType::BF16)?;
        let hd = Head::new(Path::Fused, &w)?;
        let (mut acc32, mut accbf, mut ld) = (None, None, 0);
        hd.accumulate(&Probs::F32(p32), &a32, &mut acc32, &mut ld)?;
        hd.accumulate(&pbf, &abf, &mut accbf, &mut ld)?;
        let (acc32, accbf) = (acc32.expect("stored"), accbf.expect("stored"));
        assert_eq!(acc32.iter().map(|a| a.to_bits()).collect::<Vec<_>>(), accbf.iter().map(|a| a.to_bits()).collect::<Vec<_>>(), "p @ W");
        Ok(())
    }

    /// The bf16 head's two products (logits x Wᵀ, input gradient g W), built as the fused path
    /// builds them, on every CPU: with a bf16 unit, f32 sums of bf16-rounded operands; without
    /// one, f32 math on the head's values, the rows and gradients not rounded (widened).
    #[test]
    fn the_bf16_heads_products_round_operands_only_on_a_bf16_unit() -> Result<()> {
        let dev = Device::Cpu;
        let (m, h, v) = (45, 64, 300);
        let rows = Tensor::from_vec((0..m * h).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.1).collect(), (m, h), &dev)?;
        let head = Tensor::from_vec((0..v * h).map(|i| ((i * 13 % 7) as f32 - 3.0) * 0.05).collect(), (v, h), &dev)?.to_dtype(DType::BF16)?;
        let g = Tensor::from_vec((0..m * v).map(|i| ((i * 7 % 9) as f32 - 4.0) * 0.01).collect(), (m, v), &dev)?;
        let built = Head::new(Path::Fused, &head)?;
        let unit = crate::ops::bf16_gemm::available();
        assert_eq!(matches!(built, Head::Bf16 { .. }), unit, "a bf16 head is packed for the bf16 GEMM exactly where a bf16 unit runs it");
        let round = |t: &Tensor| if unit { t.to_dtype(DType::BF16)?.to_dtype(DType::F32) } else { Ok(t.clone()) };
        let h32 = head.to_dtype(DType::F32)?;
        let d = (built.logits(&rows, None)? - round(&rows)?.matmul(&h32.t()?)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
        // The input gradient as the fused path forms it: the first chunk's product stored in acc.
        let (mut acc, mut ld) = (None, 0);
        built.accumulate(&Probs::F32(g.flatten_all()?.to_vec1::<f32>()?), &vec![1.0; m], &mut acc, &mut ld)?;
        let acc = acc.expect("the first chunk stores acc");
        let pg = Tensor::from_vec((0..m).flat_map(|r| acc[r * ld..][..h].to_vec()).collect::<Vec<f32>>(), (m, h), &dev)?; // [M, H]
        let dg = (pg - round(&g)?.matmul(&h32)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
        println!("bf16 head products: logits max |diff| {d:e}, input gradient {dg:e}");
        assert!(d < 1e-5 && dg < 1e-5, "logits differ by {d}, input gradient by {dg}");
        Ok(())
    }

    /// The closed-form gradient equals autograd through candle's log_softmax.
    #[test]
    fn closed_form_gradient_matches_autograd() -> Result<()> {
        let dev = Device::Cpu;
        let rows = Var::from_vec((0..24).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.1).collect(), (4, 6), &dev)?;
        let head = Tensor::from_vec((0..60).map(|i| ((i * 13 % 7) as f32 - 3.0) * 0.2).collect(), (10, 6), &dev)?;
        let targets = [3u32, 0, 9, 3];
        let (loss, grad) = cross_entropy_sum_and_grad(Kernels::Auto, rows.as_tensor(), &HeadRows::of(&head)?, &targets, 0.5)?;
        let logits = rows.matmul(&head.t()?)?;
        let lsm = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        let t = Tensor::new(&targets, &dev)?.unsqueeze(1)?;
        let ref_loss = lsm.gather(&t, 1)?.neg()?.sum_all()?;
        let g = (ref_loss.clone() * 0.5)?.backward()?;
        let ref_grad = g.get(&rows).expect("grad");
        let ref_loss = ref_loss.to_scalar::<f32>()? as f64;
        assert!((loss - ref_loss).abs() < 1e-5, "{loss} vs {ref_loss}");
        let diff = (grad - ref_grad)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6, "max diff {diff}");
        Ok(())
    }

    /// The portable loss equals the fused one (f32), and with a bf16 head and bf16 rows stays
    /// bf16 in and out with the CE within bf16 rounding of the f32 value.
    #[test]
    fn portable_loss_matches_the_fused_loss_and_keeps_a_bf16_head_bf16() -> Result<()> {
        let dev = Device::Cpu;
        let (m, h, v) = (45, 64, 300);
        let rows = Tensor::from_vec((0..m * h).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.1).collect(), (m, h), &dev)?;
        let head = Tensor::from_vec((0..v * h).map(|i| ((i * 13 % 7) as f32 - 3.0) * 0.05).collect(), (v, h), &dev)?;
        let targets: Vec<u32> = (0..m as u32).map(|i| i * 7 % v as u32).collect();
        let (ce_f, g_f) = cross_entropy_sum_and_grad(Kernels::Auto, &rows, &HeadRows::of(&head)?, &targets, 0.25)?;
        let (ce_p, g_p) = cross_entropy_sum_and_grad(Kernels::Portable, &rows, &HeadRows::of(&head)?, &targets, 0.25)?;
        let dg = (&g_f - &g_p)?.abs()?.max_all()?.to_scalar::<f32>()?;
        println!("portable vs fused loss: |ce diff| {:.1e}, max |grad diff| {dg:.1e}", (ce_f - ce_p).abs());
        assert!((ce_f - ce_p).abs() < 1e-6 * ce_f.abs() && dg < 1e-6);
        let (rb, hb) = (rows.to_dtype(DType::BF16)?, head.to_dtype(DType::BF16)?);
        let (ce_b, g_b) = cross_entropy_sum_and_grad(Kernels::Portable, &rb, &HeadRows::of(&hb)?, &targets, 0.25)?;
        assert_eq!(g_b.dtype(), DType::BF16);
        let rel = (ce_b - ce_f).abs() / ce_f.abs();
        println!("bf16 portable loss: relative CE diff {rel:.1e}");
        assert!(rel < 2f64.powi(-8), "{rel}");
        Ok(())
    }

    /// With a bf16 head on the portable path (what a GPU runs), the gradient stays within bf16
    /// rounding of the f32 gradient also where the softmax has all but settled on the target:
    /// there (softmax - onehot) @ W is a small difference of two near-equal vectors, which must
    /// not be formed from a bf16-rounded Σ p W.
    #[test]
    fn a_bf16_heads_gradient_is_accurate_where_the_softmax_settles_on_the_target() -> Result<()> {
        let dev = Device::Cpu;
        let (m, h, v) = (16, 64, 200);
        // Distinct pseudo-random rows in (-0.5, 0.5).
        let mix = |i: u64| {
            let z = (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (i >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            let z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let head = Tensor::from_vec((0..(v * h) as u64).map(mix).collect(), (v, h), &dev)?;
        let head = head.to_dtype(DType::BF16)?.to_dtype(DType::F32)?; // the bf16 values, exactly
        let targets: Vec<u32> = (0..m as u32).map(|i| i * 11 % v as u32).collect();
        // Each row points at its target's weight row, more sharply row by row: the target's
        // softmax runs from 0.05 to 1 - 1e-7.
        let picked = head.index_select(&Tensor::new(targets.as_slice(), &dev)?, 0)?;
        let sharp = Tensor::from_vec((0..m).map(|i| 0.5 + i as f32 * 0.4).collect(), (m, 1), &dev)?;
        let rows = picked.broadcast_mul(&sharp)?.to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
        let (rb, hb) = (rows.to_dtype(DType::BF16)?, head.to_dtype(DType::BF16)?);
        let (_, got) = cross_entropy_sum_and_grad(Kernels::Portable, &rb, &HeadRows::of(&hb)?, &targets, 1.0)?;
        // The exact gradient for the same bf16 logits: (softmax - onehot) @ W in f64 (in f32,
        // softmax - 1 at the target is already off by 6e-8 where the rest sums to 1e-7).
        let logits = rb.matmul(&hb.t()?)?.to_dtype(DType::F64)?;
        let t = Tensor::new(targets.as_slice(), &dev)?.unsqueeze(1)?;
        let onehot = Tensor::zeros((m, v), DType::F64, &dev)?.scatter_add(&t, &Tensor::ones((m, 1), DType::F64, &dev)?, 1)?;
        let want = (candle_nn::ops::softmax_last_dim(&logits)? - onehot)?.matmul(&head.to_dtype(DType::F64)?)?.to_dtype(DType::F32)?;
        // Per row, relative to that row's gradient: a few bf16 roundings (2^-9 each).
        let err = (got.to_dtype(DType::F32)? - &want)?.abs()?.max_keepdim(1)?;
        let size = want.abs()?.max_keepdim(1)?;
        let rel = (err / size)?.max_all()?.to_scalar::<f32>()?;
        let settled = candle_nn::ops::softmax_last_dim(&logits)?.gather(&t, 1)?.min_all()?.to_scalar::<f64>()?;
        println!("bf16 portable gradient: worst row relative error {rel:.1e}");
        assert!(rel < 5e-3, "{rel}");
        let sharpest = candle_nn::ops::softmax_last_dim(&logits.narrow(0, m - 1, 1)?)?.gather(&t.narrow(0, m - 1, 1)?, 1)?.to_vec2::<f64>()?[0][0];
        assert!(sharpest > 1.0 - 1e-6 && settled < 0.1, "the rows span the settled regime: {settled} .. {sharpest}");
        Ok(())
    }

    /// `head` as the loss reads it, each read's (start, rows) recorded in `reads`.
    fn recorded<'a>(head: &'a Tensor, reads: &'a std::cell::RefCell<Vec<(usize, usize)>>) -> Result<HeadRows<'a>> {
        let mut rows = HeadRows::of(head)?;
        rows.read = Box::new(move |s, n| {
            reads.borrow_mut().push((s, n));
            head.narrow(0, s, n)
        });
        Ok(rows)
    }

    /// A head larger than one chunk is read chunk by chunk, each chunk once, also when no row
    /// has a target (a ZeRO-3 gather is a collective), and the running softmax over the
    /// chunks gives the loss and gradient of the whole head, on both paths.
    #[test]
    fn a_head_read_in_chunks_gives_the_loss_and_gradient_of_the_whole_head() -> Result<()> {
        let dev = Device::Cpu;
        let (m, h, v) = (40, 112, 20_000); // 9 MB of f32: two chunks
        let rows = Tensor::from_vec((0..m * h).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.1).collect(), (m, h), &dev)?;
        let head = Tensor::from_vec((0..v * h).map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.01).collect(), (v, h), &dev)?;
        // Targets in both chunks, the chunk edge included.
        let targets: Vec<u32> = (0..m as u32).map(|i| [0, 9_999, 10_047, 10_048, 19_999][i as usize % 5] + i % 3).map(|t| t.min(v as u32 - 1)).collect();
        // The head, recording each read.
        let reads = std::cell::RefCell::new(Vec::new());
        let counted = || recorded(&head, &reads);
        // The whole head, from candle ops: CE = -log_softmax[target], grad = 0.5 (softmax - onehot) W.
        let logits = rows.matmul(&head.t()?)?;
        let t = Tensor::new(targets.as_slice(), &dev)?.unsqueeze(1)?;
        let want_ce = candle_nn::ops::log_softmax(&logits, D::Minus1)?.gather(&t, 1)?.neg()?.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
        let onehot = Tensor::zeros((m, v), DType::F32, &dev)?.scatter_add(&t, &Tensor::ones((m, 1), DType::F32, &dev)?, 1)?;
        let want_grad = ((candle_nn::ops::softmax_last_dim(&logits)? - onehot)?.matmul(&head)? * 0.5)?;
        for k in [Kernels::Auto, Kernels::Portable] {
            reads.borrow_mut().clear();
            let (ce, grad) = cross_entropy_sum_and_grad(k, &rows, &counted()?, &targets, 0.5)?;
            assert_eq!(*reads.borrow(), vec![(0, 10_048), (10_048, 9_952)], "{k:?}");
            let dce = (ce - want_ce).abs() / want_ce.abs();
            let dg = (grad - &want_grad)?.abs()?.max_all()?.to_scalar::<f32>()?;
            println!("{k:?}: chunked head: relative CE diff {dce:.1e}, max |grad diff| {dg:.1e}");
            assert!(dce < 5e-7 && dg < 1e-6, "{k:?}: CE {ce} vs {want_ce}, grad differs by {dg}");
        }
        let none = rows.narrow(0, 0, 0)?;
        reads.borrow_mut().clear();
        let (ce, grad) = cross_entropy_sum_and_grad(Kernels::Auto, &none, &counted()?, &[], 0.5)?;
        assert_eq!((ce, grad.dims()), (0.0, &[0, h][..]));
        assert_eq!(reads.borrow().len(), 2, "every chunk is read with no rows too");
        Ok(())
    }

    /// A bf16 head over two chunks on a bf16 unit (the fused path's running sum: each chunk's
    /// p @ W added into acc by the bf16 GEMM, acc's rows rescaled where the max grew) gives
    /// the loss and gradient of the whole head from candle ops on the same rounded values,
    /// within the rounding of p to bf16. The head's later rows are larger, so most rows' max
    /// grows in the second chunk.
    #[test]
    #[cfg_attr(not(bf16_unit), ignore = "needs AMX or AVX512-BF16")]
    fn a_bf16_head_in_two_chunks_on_a_bf16_unit_gives_the_whole_heads_loss_and_gradient() -> Result<()> {
        assert!(crate::ops::bf16_gemm::available(), "build.rs found a bf16 unit but this process has none: rebuild on this machine");
        let dev = Device::Cpu;
        let (m, h, v) = (40, 112, 40_000); // 9 MB of bf16: two chunks
        let rows = Tensor::from_vec((0..m * h).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.1).collect(), (m, h), &dev)?;
        let rows = rows.to_dtype(DType::BF16)?.to_dtype(DType::F32)?; // exact in bf16: the GEMMs' rounding is not measured
        let head = Tensor::from_vec((0..v * h).map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.01 * (1.0 + 2.0 * (i / h) as f32 / v as f32)).collect(), (v, h), &dev)?;
        let head = head.to_dtype(DType::BF16)?;
        let targets: Vec<u32> = (0..m as u32).map(|i| [2, 20_031, 20_034, 39_999][i as usize % 4] - i % 3).collect();
        let reads = std::cell::RefCell::new(Vec::new());
        let (ce, grad) = cross_entropy_sum_and_grad(Kernels::Auto, &rows, &recorded(&head, &reads)?, &targets, 0.5)?;
        assert_eq!(*reads.borrow(), vec![(0, 20_032), (20_032, 19_968)]);
        let h32 = head.to_dtype(DType::F32)?;
        let logits = rows.matmul(&h32.t()?)?;
        let t = Tensor::new(targets.as_slice(), &dev)?.unsqueeze(1)?;
        let grew = logits.narrow(1, 20_032, 19_968)?.max_keepdim(1)?.gt(&logits.narrow(1, 0, 20_032)?.max_keepdim(1)?)?;
        assert!(grew.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()? >= m as f32 / 2.0, "most rows' max grows in the second chunk");
        let want_ce = candle_nn::ops::log_softmax(&logits, D::Minus1)?.gather(&t, 1)?.neg()?.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
        let onehot = Tensor::zeros((m, v), DType::F32, &dev)?.scatter_add(&t, &Tensor::ones((m, 1), DType::F32, &dev)?, 1)?;
        let want_grad = ((candle_nn::ops::softmax_last_dim(&logits)? - onehot)?.matmul(&h32)? * 0.5)?;
        let dce = (ce - want_ce).abs() / want_ce.abs();
        let size = want_grad.abs()?.max_all()?.to_scalar::<f32>()?;
        let dg = (grad - &want_grad)?.abs()?.max_all()?.to_scalar::<f32>()? / size;
        println!("bf16 head in two chunks: relative CE diff {dce:.1e}, max |grad diff| / max |grad| {dg:.1e}");
        // Measured (Zen 4): 2.7e-8 and 1.4e-5.
        assert!(dce < 1e-7 && dg < 2e-5, "CE {ce} vs {want_ce}, grad differs by {dg} of its largest element");
        Ok(())
    }

    #[test]
    fn a_target_outside_the_vocabulary_is_an_error() -> Result<()> {
        let dev = Device::Cpu;
        let rows = Tensor::zeros((2, 8), DType::F32, &dev)?;
        let head = Tensor::zeros((10, 8), DType::F32, &dev)?;
        let e = cross_entropy_sum_and_grad(Kernels::Auto, &rows, &HeadRows::of(&head)?, &[3, 10], 1.0).unwrap_err().to_string();
        assert!(e.contains("target token 10 is outside the vocabulary of 10"), "{e}");
        Ok(())
    }

    /// `cargo test --release --lib loss_speed -- --ignored --nocapture`: GFLOP/s of the loss
    /// and its input gradient (the two head GEMMs, 4 M V H) for DeepSeek-V2-Lite's head
    /// ([102400, 2048] bf16, 512 rows; `LOSS_SPEED_SHAPE=m,h,v` for another), each chunk copied
    /// out of the head as a read from its file would be. Timing only, no assertion.
    #[test]
    #[ignore]
    fn loss_speed() -> Result<()> {
        // Large blocks from the heap, as `main` has them (glibc's mallopt locks its arena, so
        // setting it with the test harness's threads running is safe): fresh mmaps per chunk
        // otherwise fault and zero every page, and that is most of what would be timed.
        crate::alloc::tune();
        let dev = Device::Cpu;
        let shape: Vec<usize> = std::env::var("LOSS_SPEED_SHAPE").map_or_else(|_| vec![512, 2048, 102400], |v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect());
        let &[m, h, v] = shape.as_slice() else { candle_core::bail!("LOSS_SPEED_SHAPE is m,h,v") };
        let rows = Tensor::from_vec((0..m * h).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.1).collect(), (m, h), &dev)?;
        let head = Tensor::from_vec((0..v * h).map(|i| ((i * 13 % 7) as f32 - 3.0) * 0.01).collect(), (v, h), &dev)?.to_dtype(DType::BF16)?;
        let targets: Vec<u32> = (0..m).map(|i| (i * 7919 % v) as u32).collect();
        let read = HeadRows { vocab: v, hidden: h, dtype: DType::BF16, read: Box::new(|s, l| Tensor::from_vec(head.narrow(0, s, l)?.flatten_all()?.to_vec1::<half::bf16>()?, (l, h), &Device::Cpu)) };
        let mut best = f64::INFINITY;
        for i in 0..4 {
            let t = std::time::Instant::now();
            let (ce, _) = cross_entropy_sum_and_grad(Kernels::Auto, &rows, &read, &targets, 1.0)?;
            let s = t.elapsed().as_secs_f64();
            println!("run {i}: {:.1} ms, {:.0} GFLOP/s (ce {ce:.3})", s * 1e3, 4.0 * (m * v * h) as f64 / s / 1e9);
            best = best.min(s);
        }
        println!("loss [{m}, {h}] x head [{v}, {h}]: best {:.1} ms, {:.0} GFLOP/s", best * 1e3, 4.0 * (m * v * h) as f64 / best / 1e9);
        Ok(())
    }
}
