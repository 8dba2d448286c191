//! Causal self-attention with its own backward, computed in strips of query rows so no
//! [S, S] score matrix (or its gradient) is ever held: the fused CPU op over f32 slices
//! (`CausalAttention`) and the portable one from candle ops (`PortableAttention`, what CUDA
//! runs). The fused op keeps the log-sum-exp of each query row and recomputes the
//! probabilities from it in backward; the portable one recomputes them with one fused softmax
//! kernel per strip (a strip holds whole rows of keys), fewer passes over the scores than
//! exp(s − lse) from separate ops.
//!
//! Dimension legend (as in `model/llama.rs`):
//!   B  micro-batch rows   NH query heads   KV key/value heads   R = NH / KV
//!   S  sequence length    D  head_dim      Q  query rows per strip (`STRIP`, the last may be shorter)
//!
//! Why: attention from plain candle ops (`reference_attention`, kept for the tests)
//! materialises scores, probabilities and their gradients as [B, NH, S, S] tensors under
//! autograd, and computes the masked upper half anyway. Cost and memory then grow with S² per
//! layer, which is what made long sequences slow, and is what makes a GPU run run out of
//! memory.
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
//! That is the math; two layouts run it. The f32 strips (`group`) take the R query heads of
//! a kv head as the rows of one set of GEMMs and walk a strip's keys in blocks (the forward
//! with FlashAttention-2's online softmax); the bf16 unit's tiles (`tiles`: AMX, or
//! AVX512-BF16 on the same packing) take one query head and all of a strip's keys at a time.
//! GQA: query head h reads kv head h / R (transformers' `repeat_kv` order). Each task (a row's
//! kv head, or on tiles its query head; with few of those, each of several groups of its
//! strips: `parts_for`) accumulates its own dk/dv, summed per kv head afterwards in a fixed
//! order, so tasks run in parallel and results do not depend on the thread count.
//! Reference: Dao, "FlashAttention-2" (2023), Algorithms 1 and 2.

use candle_core::{CpuStorage, DType, Device, Layout, Result, Shape, Tensor, D};
use super::{exp_f32, sgemm, sum_f32, zeros_f32, Kernels, Op, Path, Shared};
use super::checkpoint::{Keep, Pass};
use rayon::prelude::*;
use std::sync::Mutex;

mod group;
mod tiles;

/// Query rows per strip of the fused op (per query head: the f32 path's rows are R·STRIP; on
/// tiles a strip's scores are STRIP x S floats, 512 KB at S = 2048).
const STRIP: usize = 64;

/// Most bytes of f32 scores one strip of the portable op holds ([B, NH, Q, W]): strips are
/// as tall as fit, so a GPU runs few, large matmuls, and at most this much is transient.
const PORTABLE_STRIP_BYTES: usize = 32 << 20;

/// Where each query's keys start: query i of row b sees keys `host[b * S + i]..=i`. All zeros
/// is plain causal attention; the start of each record is packed rows (attention stays within
/// a record). Built once per forward: the fused op reads `host`, the portable one `tensor`,
/// [B, S] u32 on the activations' device, and builds each strip's mask from it there.
#[derive(Clone)]
pub struct KeyStarts {
    pub host: Vec<u32>,
    pub tensor: Tensor,
}

impl KeyStarts {
    pub fn new(host: Vec<u32>, b: usize, s: usize, device: &Device) -> Result<Self> {
        if host.len() != b * s || host.iter().enumerate().any(|(r, &st)| st as usize > r % s.max(1)) {
            candle_core::bail!("causal-attention: key starts must be B x S = {} values, each at most its query's position", b * s);
        }
        let tensor = Tensor::from_slice(&host, (b, s), device)?;
        Ok(KeyStarts { host, tensor })
    }

    /// Plain causal attention over B rows of S.
    pub fn causal(b: usize, s: usize, device: &Device) -> Result<Self> {
        Self::new(vec![0; b * s], b, s, device)
    }

    /// The keys a strip of queries q0..q0+m of any row can see: kbeg..kend (kend = q0 + m).
    fn strip_keys(&self, b: usize, s: usize, q0: usize, m: usize) -> (usize, usize) {
        let kbeg = (0..b).map(|bi| strip_keys(&self.host[bi * s..][..s], q0, m).0).min().unwrap_or(0);
        (kbeg, q0 + m)
    }
}

/// softmax(q k^T · scale + mask) v for q [B, NH, S, D], k and v [B, KV, S, D] -> [B, NH, S, D],
/// where query i of row b sees keys `starts.host[b * S + i]..=i`.
///
/// `keep` is activation checkpointing's (`ops::checkpoint`): on the fused CPU path a
/// checkpointed forward leaves its output and log-sum-exp in the layer's slot, and the
/// recomputation hands them back instead of running the kernel again (the same bits).
///
/// `operands` is the dtype the run's matmuls take their operands in (`ForwardCtx::matmul`):
/// bf16 runs the fused op's strip GEMMs on the bf16 unit where it can (`tiles`: bf16 operands,
/// f32 sums, everything else f32), f32 keeps them f32.
#[allow(clippy::too_many_arguments)]
pub fn causal_attention(kern: Kernels, q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, starts: &KeyStarts, keep: Keep, operands: DType) -> Result<Tensor> {
    let (b, nh, s, d) = q.dims4()?;
    let (_, kv, _, _) = k.dims4()?;
    if kv == 0 || nh % kv != 0 || k.dims() != v.dims() || k.dim(0)? != b || k.dim(2)? != s || k.dim(3)? != d {
        candle_core::bail!("causal-attention: q {:?} and k/v {:?}/{:?} do not form GQA shapes", q.dims(), k.dims(), v.dims());
    }
    if starts.host.len() != b * s {
        candle_core::bail!("causal-attention: {} key starts for B x S = {}", starts.host.len(), b * s);
    }
    if s == 0 || d == 0 {
        return q.zeros_like();
    }
    match kern.pick(Op::Attention, q, &[]) {
        Path::Fused if [k.dtype(), v.dtype()].iter().all(|&t| t == DType::F32) => {
            let tiles = runs_on_tiles(operands, d);
            let op = CausalAttention { scale: scale as f32, key_start: starts.host.clone(), lse: Mutex::new(Vec::new()), keep, tiles };
            q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, op)
        }
        // Batched matmuls need one stride per batch dim: `cat` along the last dim (MLA's
        // nope | rope halves) leaves other layouts, so copy those.
        _ => portable_attention(&q.contiguous()?, &k.contiguous()?, &v.contiguous()?, scale, starts, portable_strip_rows(b, nh, s)),
    }
}

/// Whether the fused op runs its strip GEMMs on the bf16 unit (AMX tiles or AVX512-BF16) for
/// matmul operands in `operands` and head dim `d` (what `causal_attention` checks, for the
/// run's report).
pub fn runs_on_tiles(operands: DType, d: usize) -> bool {
    operands == DType::BF16 && tiles::usable(d)
}

/// Query rows per portable strip: as many as keep [B, NH, Q, S] f32 scores within
/// `PORTABLE_STRIP_BYTES`, a multiple of 64, at least 64.
fn portable_strip_rows(b: usize, nh: usize, s: usize) -> usize {
    let per_row = (b * nh * s * 4).max(1);
    ((PORTABLE_STRIP_BYTES / per_row) / 64 * 64).clamp(64, s.max(64))
}

/// Transient f32 bytes one attention strip holds in flight (scores, their exponentials and
/// the probabilities): the portable op's tall strips over all heads at once, or the fused
/// op's per task, the larger of a query head's 64 x S on tiles and a kv head's R·64 x 256 in
/// f32 (`group`) (one task per thread, counted for two).
pub fn strip_scratch_bytes(portable: bool, b: usize, (nh, kv): (usize, usize), s: usize) -> usize {
    if portable {
        3 * portable_strip_rows(b, nh, s).min(s) * b * nh * s * 4
    } else {
        2 * STRIP * s.max(nh / kv.max(1) * group::KEY_BLOCK.min(s)) * 4
    }
}

/// The portable attention: each strip of `strip` query rows from candle ops (two batched
/// matmuls, the mask built on the device from `starts.tensor`, candle-nn's softmax in f32),
/// with no autograd graph inside. One [`PortableAttention`] node joins q, k and v to the
/// result, and its backward runs FlashAttention-2's recurrences strip by strip in tensor ops.
///
/// Why a node that adopts a result computed outside it: candle hands a custom op storages,
/// not tensors, so a forward written in tensor ops cannot run inside one. Computing it on
/// detached inputs and letting the node take the finished output (one copy of [B, NH, S, D])
/// keeps autograd from storing every strip's [Q, W] probabilities, which is the point.
fn portable_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, starts: &KeyStarts, strip: usize) -> Result<Tensor> {
    let st = Strips::new(q, k, scale, starts, strip)?;
    let out = st.forward(&q.detach(), &k.detach(), &v.detach())?;
    let op = PortableAttention { strips: st, out: Mutex::new(Some(out)) };
    q.apply_op3(k, v, op)
}

/// One portable attention call's shapes and strips. GQA folds the R query heads of a kv head
/// into the rows of one matmul: q [B, NH, S, D] is viewed as [B, KV, R, S, D].
struct Strips {
    dims: (usize, usize, usize, usize, usize), // (B, NH, KV, S, D)
    scale: f64,
    starts: KeyStarts,
    /// (q0, m, kbeg, kend) per strip.
    list: Vec<(usize, usize, usize, usize)>,
}

impl Strips {
    fn new(q: &Tensor, k: &Tensor, scale: f64, starts: &KeyStarts, strip: usize) -> Result<Self> {
        let (b, nh, s, d) = q.dims4()?;
        let kv = k.dim(1)?;
        let list = (0..s)
            .step_by(strip.max(1))
            .map(|q0| {
                let m = strip.min(s - q0);
                let (kbeg, kend) = starts.strip_keys(b, s, q0, m);
                (q0, m, kbeg, kend)
            })
            .collect();
        Ok(Strips { dims: (b, nh, kv, s, d), scale, starts: starts.clone(), list })
    }

    /// Rows q0..q0+m of every head of x [B, NH, S, D] -> [B, KV, R*m, D].
    fn rows(&self, x: &Tensor, q0: usize, m: usize) -> Result<Tensor> {
        let (b, nh, kv, s, d) = self.dims;
        x.reshape((b, kv, nh / kv, s, d))?.narrow(3, q0, m)?.contiguous()?.reshape((b, kv, nh / kv * m, d)) // [B, KV, R*m, D]
    }

    /// Additive mask [B, 1, 1, m, W] (0 or -inf) of strip (q0, m) over keys kbeg..kend,
    /// built on the device: key j is seen by query i of row b iff start(b, i) <= j <= i.
    /// Rebuilt by the backward rather than kept: a few small device ops per strip, while all
    /// of a layer's strip masks together would be B·S²/2 floats held until backward.
    fn mask(&self, q0: usize, m: usize, kbeg: usize, kend: usize) -> Result<Tensor> {
        let b = self.dims.0;
        let (dev, w) = (self.starts.tensor.device(), kend - kbeg);
        let first = self.starts.tensor.narrow(1, q0, m)?.unsqueeze(2)?; // [B, m, 1]
        let keys = Tensor::arange(kbeg as u32, kend as u32, dev)?.reshape((1, 1, w))?; // [1, 1, W]
        let query = Tensor::arange(q0 as u32, (q0 + m) as u32, dev)?.reshape((1, m, 1))?; // [1, m, 1]
        let seen = keys.broadcast_ge(&first)?.broadcast_mul(&keys.broadcast_le(&query)?)?; // [B, m, W] u8
        let zero = Tensor::zeros((b, m, w), DType::F32, dev)?;
        let hidden = Tensor::full(f32::NEG_INFINITY, (b, m, w), dev)?;
        seen.where_cond(&zero, &hidden)?.reshape((b, 1, 1, m, w)) // [B, 1, 1, m, W]
    }

    /// Scaled, masked f32 scores of strip (q0, m): qs [B, KV, R*m, D] against keys
    /// kbeg..kend -> [B, KV, R, m, W].
    fn scores(&self, qs: &Tensor, k: &Tensor, (q0, m, kbeg, kend): (usize, usize, usize, usize)) -> Result<Tensor> {
        let (b, nh, kv, _, _) = self.dims;
        let ks = k.narrow(2, kbeg, kend - kbeg)?; // [B, KV, W, D]
        let sc = qs.matmul(&ks.t()?)?.to_dtype(DType::F32)?; // [B, KV, R*m, W]
        let sc = (sc.reshape((b, kv, nh / kv, m, kend - kbeg))? * self.scale)?; // [B, KV, R, m, W]
        sc.broadcast_add(&self.mask(q0, m, kbeg, kend)?)
    }

    /// Softmax over the keys of strip (q0, m), f32 [B, KV, R, m, W]. A strip holds every key
    /// its rows see, so this is each row's whole softmax: one fused kernel (candle-nn's, on
    /// CUDA too), where max, subtract, exp, sum and divide as separate ops were six passes
    /// over the scores, which is what a GPU step spent most of its time on.
    fn probs(&self, qs: &Tensor, k: &Tensor, strip: (usize, usize, usize, usize)) -> Result<Tensor> {
        // Every query sees at least itself, so no row is all -inf.
        candle_nn::ops::softmax_last_dim(&self.scores(qs, k, strip)?)
    }

    /// out [B, NH, S, D] in q's dtype.
    fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let (b, nh, kv, _, d) = self.dims;
        let mut outs = Vec::new();
        for &(q0, m, kbeg, kend) in &self.list {
            let p = self.probs(&self.rows(q, q0, m)?, k, (q0, m, kbeg, kend))?; // [B, KV, R, m, W]
            let p = p.to_dtype(v.dtype())?.reshape((b, kv, nh / kv * m, kend - kbeg))?; // [B, KV, R*m, W]
            let o = p.matmul(&v.narrow(2, kbeg, kend - kbeg)?)?; // [B, KV, R*m, D]
            outs.push(o.reshape((b, kv, nh / kv, m, d))?); // [B, KV, R, m, D]
        }
        Tensor::cat(&outs, 3)?.reshape((b, nh, self.dims.3, d)) // [B, NH, S, D]
    }

    /// (dq, dk, dv) for the upstream gradient g [B, NH, S, D] of out = attention(q, k, v):
    ///   p = softmax(s) (recomputed),  dv += pᵀ g,  dp = g vᵀ,  ds = p ⊙ (dp − rowsum(g ⊙ out)) · scale,
    ///   dq = ds k,  dk += dsᵀ q
    /// dk and dv sum over the R query heads of each kv head inside the matmuls (their rows),
    /// and accumulate over strips in f32.
    fn backward(&self, q: &Tensor, k: &Tensor, v: &Tensor, out: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, nh, kv, s, d) = self.dims;
        let (r, dt) = (nh / kv, q.dtype());
        let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
        let delta = (f32_of(g)? * f32_of(out)?)?.sum_keepdim(D::Minus1)?.reshape((b, kv, r, s, 1))?; // [B, KV, R, S, 1]
        let dk = Tensor::zeros((b, kv, s, d), DType::F32, q.device())?;
        let dv = Tensor::zeros((b, kv, s, d), DType::F32, q.device())?;
        let mut dqs = Vec::new();
        for &(q0, m, kbeg, kend) in &self.list {
            let w = kend - kbeg;
            let (qs, gs) = (self.rows(q, q0, m)?, self.rows(g, q0, m)?); // [B, KV, R*m, D] each
            let (ks, vs) = (k.narrow(2, kbeg, w)?, v.narrow(2, kbeg, w)?); // [B, KV, W, D] each
            let p = self.probs(&qs, k, (q0, m, kbeg, kend))?; // [B, KV, R, m, W]
            let pd = p.to_dtype(dt)?.reshape((b, kv, r * m, w))?; // [B, KV, R*m, W]
            let dv_s = pd.t()?.matmul(&gs)?; // [B, KV, W, D]
            let dp = f32_of(&gs.matmul(&vs.t()?)?)?.reshape((b, kv, r, m, w))?; // [B, KV, R, m, W]
            let ds = ((p * dp.broadcast_sub(&delta.narrow(3, q0, m)?)?)? * self.scale)?; // [B, KV, R, m, W]
            let ds = ds.to_dtype(dt)?.reshape((b, kv, r * m, w))?; // [B, KV, R*m, W]
            dqs.push(ds.matmul(&ks)?.reshape((b, kv, r, m, d))?); // [B, KV, R, m, D]
            let dk_s = ds.t()?.matmul(&qs)?; // [B, KV, W, D]
            for (acc, part) in [(&dk, dk_s), (&dv, dv_s)] {
                let sum = (acc.narrow(2, kbeg, w)? + f32_of(&part)?)?.contiguous()?;
                acc.slice_set(&sum, 2, kbeg)?;
            }
        }
        let dq = Tensor::cat(&dqs, 3)?.reshape((b, nh, s, d))?; // [B, NH, S, D]
        Ok((dq, dk.to_dtype(k.dtype())?, dv.to_dtype(v.dtype())?))
    }
}

/// The autograd node of the portable attention (see [`portable_attention`]).
struct PortableAttention {
    strips: Strips,
    /// The finished output, taken by the forward.
    out: Mutex<Option<Tensor>>,
}

impl PortableAttention {
    /// The output computed outside the node, as the storage the node returns (a copy).
    fn adopt<S>(&self, pick: impl Fn(&candle_core::Storage, &Layout) -> Option<Result<S>>) -> Result<(S, Shape)> {
        let out = self.out.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(out) = out else { candle_core::bail!("portable-attention: forward ran twice") };
        let (st, layout) = out.storage_and_layout();
        // `cat` made it: contiguous from offset 0, so the whole storage is the output.
        if !layout.is_contiguous() || layout.start_offset() != 0 {
            candle_core::bail!("portable-attention: output is not a fresh contiguous tensor");
        }
        let storage = pick(&st, layout).unwrap_or_else(|| Err(candle_core::Error::Msg("portable-attention: output on another device".into())))?;
        Ok((storage, out.shape().clone()))
    }
}

impl candle_core::CustomOp3 for PortableAttention {
    fn name(&self) -> &'static str {
        "portable-attention"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        self.adopt(|st, layout| match st {
            candle_core::Storage::Cpu(s) => Some(s.try_clone(layout)),
            _ => None,
        })
    }

    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        self.adopt(|st, layout| match st {
            candle_core::Storage::Cuda(s) => Some(s.try_clone(layout)),
            _ => None,
        })
    }

    fn bwd(&self, q: &Tensor, k: &Tensor, v: &Tensor, res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dq, dk, dv) = self.strips.backward(q, k, v, res, &grad.contiguous()?)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// Attention of new queries over cached + new keys, for generation (no backward): q
/// [B, NH, S, D], k and v [B, KV, T, D], `mask` [1, 1, S, T] additive (0 or -inf) in f32.
/// GQA without copying k/v (transformers' repeat_kv): query head h uses kv head h / R, so the
/// R query heads of a kv head are contiguous and fold into the row dim. S is small here (a
/// prompt, then one token), so the [S, T] scores are held whole.
pub fn cached_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, mask: &Tensor) -> Result<Tensor> {
    let (b, nh, s, d) = q.dims4()?;
    let (kv, t) = (k.dim(1)?, k.dim(2)?);
    let r = nh / kv.max(1);
    let q = q.reshape((b, kv, r * s, d))?; // [B, KV, R*S, D]
    let scores = q.matmul(&k.t()?)?.reshape((b, nh, s, t))?.to_dtype(DType::F32)?; // [B, NH, S, T]
    let probs = super::softmax_last(&(scores * scale)?.broadcast_add(&mask.to_dtype(DType::F32)?)?)?.to_dtype(v.dtype())?;
    let probs = probs.reshape((b, kv, r * s, t))?; // [B, KV, R*S, T]
    probs.matmul(v)?.reshape((b, nh, s, d)) // [B, NH, S, D]
}

/// Additive causal mask [S, T] (0 or -inf): query i sits at position `offset + i` and sees
/// keys 0..=offset + i. `offset` is the number of cached positions during generation.
pub fn causal_mask(s: usize, t: usize, offset: usize, device: &Device) -> Result<Tensor> {
    let m: Vec<f32> = (0..s * t).map(|x| if x % t > offset + x / t { f32::NEG_INFINITY } else { 0.0 }).collect();
    Tensor::from_vec(m, (s, t), device)
}

/// Attention from plain candle ops over whole [B, NH, S, S] scores under autograd, with a
/// host-built mask: the reference both strip ops are tested against.
#[cfg(test)]
pub(crate) fn reference_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, key_start: &[u32]) -> Result<Tensor> {
    let (b, nh, s, d) = q.dims4()?;
    let kv = k.dim(1)?;
    let r = nh / kv;
    let q = q.reshape((b, kv, r * s, d))?; // [B, KV, R*S, D]
    let scores = q.matmul(&k.t()?)?.reshape((b, nh, s, s))?.to_dtype(DType::F32)?; // [B, NH, S, S]
    let mut m = Vec::with_capacity(b * s * s);
    for (row, &st) in key_start.iter().enumerate() {
        let i = row % s;
        m.extend((0..s).map(|j| if j >= st as usize && j <= i { 0.0 } else { f32::NEG_INFINITY }));
    }
    let mask = Tensor::from_vec(m, (b, 1, s, s), q.device())?; // [B, 1, S, S]
    let probs = super::softmax_last(&(scores * scale)?.broadcast_add(&mask)?)?;
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
    /// The checkpointing pass, and where a checkpointed forward leaves (out, lse).
    keep: Keep,
    /// The strip GEMMs on the bf16 unit with bf16 operands (`tiles`), else f32 (the gemm crate).
    tiles: bool,
}

/// The keys a strip of queries q0..q0+m can see: kbeg..kend (kend = q0 + m).
fn strip_keys(starts: &[u32], q0: usize, m: usize) -> (usize, usize) {
    let kbeg = starts[q0..q0 + m].iter().min().map_or(0, |&x| x as usize);
    (kbeg, q0 + m)
}

/// The fewest tasks the f32 path splits a call into where its units (a row's kv heads: 3 at
/// batch 1 on SmolLM2) are fewer: each unit's strips are then dealt into groups of equal work.
const MIN_TASKS: usize = 16;

/// Strip groups per unit (a row's kv head) on the f32 path for `units` units of S queries:
/// at least `MIN_TASKS` tasks in all where the strips allow, each group at least a pair of
/// strips. A function of the shapes only, so results do not depend on the thread count.
fn parts_for(units: usize, s: usize) -> usize {
    MIN_TASKS.div_ceil(units.max(1)).clamp(1, (s.div_ceil(STRIP) / 2).max(1))
}

/// Strip groups per unit (a row's query head) on tiles: with fewer than 16 units (batch 1: 9
/// heads, which 2 threads run as 5 + 4) each unit's strips are dealt into 2 groups of equal
/// work. A function of the shapes only, so results do not depend on the thread count.
fn tile_parts(units: usize) -> usize {
    if units < 16 { 2 } else { 1 }
}

/// Whether strip `i` of `n` is in group `g` of `parts`: strips pair up from both ends (i and
/// n − 1 − i see about n + 1 strips of keys together) and the pairs are dealt in turn.
fn in_part(i: usize, n: usize, g: usize, parts: usize) -> bool {
    i.min(n - 1 - i) % parts == g
}

/// The strips of task group `part` of `parts` over S queries whose key starts are `starts`:
/// (q0, m, kbeg, kend) each.
fn task_strips(starts: &[u32], s: usize, part: usize, parts: usize) -> impl Iterator<Item = (usize, usize, usize, usize)> + '_ {
    let n = s.div_ceil(STRIP);
    (0..n).filter(move |&si| in_part(si, n, part, parts)).map(move |si| {
        let (q0, m) = (si * STRIP, STRIP.min(s - si * STRIP));
        let (kbeg, kend) = strip_keys(starts, q0, m);
        (q0, m, kbeg, kend)
    })
}

/// The keys query q0 + i sees among keys kb..ke, as columns of its scores over them: lo..hi
/// (empty where it sees none of them: a block of a strip's keys, on the f32 path).
#[inline(always)]
fn seen(starts: &[u32], q0: usize, (kb, ke): (usize, usize), i: usize) -> (usize, usize) {
    let lo = (starts[q0 + i] as usize).clamp(kb, ke) - kb;
    (lo, ((q0 + i + 1).clamp(kb, ke) - kb).max(lo))
}

/// Each row i of `p` (scores of query q0 + i over keys k0.., rows `w` apart) becomes its
/// causal softmax of scores x `scale` (0 at keys the query does not see); `lse[i]` its
/// log-sum-exp.
#[inline(always)]
fn softmax_rows(p: &mut [f32], w: usize, q0: usize, k0: usize, starts: &[u32], scale: f32, lse: &mut [f32]) {
    for (i, row) in p.chunks_mut(w).enumerate() {
        let (lo, hi) = seen(starts, q0, (k0, k0 + w), i);
        row[lo..hi].iter_mut().for_each(|x| *x *= scale);
        let max = row[lo..hi].iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
        row[lo..hi].iter_mut().for_each(|x| *x = exp_f32(*x - max));
        let sum = sum_f32(&row[lo..hi]);
        let inv = 1.0 / sum;
        row[lo..hi].iter_mut().for_each(|x| *x *= inv);
        row[..lo].fill(0.0);
        row[hi..].fill(0.0);
        lse[i] = max + sum.ln();
    }
}

/// The probabilities of `softmax_rows` again, from the scores and the kept log-sum-exp, for
/// `p` holding row i's scores of query q0 + i against keys kb..ke (a block of them: a row
/// may see none).
#[inline(always)]
fn probs_from_lse(p: &mut [f32], w: usize, q0: usize, (kb, ke): (usize, usize), starts: &[u32], scale: f32, lse: &[f32]) {
    for (i, row) in p.chunks_mut(w).enumerate() {
        let (lo, hi) = seen(starts, q0, (kb, ke), i);
        let li = lse[i];
        row[lo..hi].iter_mut().for_each(|x| *x = exp_f32(*x * scale - li));
        row[..lo].fill(0.0);
        row[hi..].fill(0.0);
    }
}

/// ds = p ⊙ (dp − Σ_d g ⊙ out) · scale in place of dp ([m, w] each; 0 where p is), with the
/// strip's rows of the upstream gradient g and the output (each [m, D]).
#[inline(always)]
fn score_grads(dp: &mut [f32], p: &[f32], w: usize, g: &[f32], o: &[f32], d: usize, scale: f32) {
    for ((dr, pr), (gr, or)) in dp.chunks_mut(w).zip(p.chunks(w)).zip(g.chunks(d).zip(o.chunks(d))) {
        score_grad_row(dr, pr, row_delta(gr, or), scale);
    }
}

/// δ = Σ_d g ⊙ out of one query row.
#[inline(always)]
fn row_delta(g: &[f32], o: &[f32]) -> f32 {
    g.iter().zip(o).map(|(a, b)| a * b).sum()
}

/// One row of `score_grads`: ds = p ⊙ (dp − δ) · scale in place of dp.
#[inline(always)]
fn score_grad_row(dp: &mut [f32], p: &[f32], delta: f32, scale: f32) {
    for (x, &pv) in dp.iter_mut().zip(p) {
        *x = pv * (*x - delta) * scale;
    }
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

/// (B, NH, KV, S, D) of one call.
type Dims = (usize, usize, usize, usize, usize);
/// The backward's inputs, whole: q, k, v, the output and its upstream gradient.
type Inputs<'a> = (&'a [f32], &'a [f32], &'a [f32], &'a [f32], &'a [f32]);

impl CausalAttention {
    /// The f32 forward (`group`): one task per (row, kv head) and strip group, the R query
    /// heads of the kv head together. Returns out [B, NH, S, D] and lse [B, NH, S].
    fn forward_groups(&self, q: &[f32], k: &[f32], v: &[f32], (b, nh, kv, s, d): Dims) -> (Vec<f32>, Vec<f32>) {
        let r = nh / kv;
        let units = b * kv;
        let parts = parts_for(units, s);
        forward_tasks((b * nh * s * d, b * nh * s), units * parts, |task, out_at, lse_at| {
            let (unit, part) = (task / parts, task % parts);
            // The group's first query head as a (row, head) index: (b·NH + g·R).
            let (kvo, h0) = (unit * s * d, unit / kv * nh + unit % kv * r);
            let starts = &self.key_start[unit / kv * s..][..s];
            let mut grp = group::Group::new((&k[kvo..][..s * d], &v[kvo..][..s * d]), (r, s, d), starts, self.scale, false);
            let q = &q[h0 * s * d..][..r * s * d]; // [R, S, D]
            for st @ (q0, m, _, _) in task_strips(starts, s, part, parts) {
                // SAFETY: strip (q0, m) of this unit's heads is in exactly one group, i.e. one task.
                grp.forward_strip(q, st, |j| unsafe { (out_at.rows(((h0 + j) * s + q0) * d, m * d), lse_at.rows((h0 + j) * s + q0, m)) });
            }
        })
    }

    /// The forward on the bf16 unit (`tiles`): one task per (row, query head) and strip group.
    fn forward_tiles(&self, q: &[f32], k: &[f32], v: &[f32], (b, nh, kv, s, d): Dims) -> (Vec<f32>, Vec<f32>) {
        let r = nh / kv;
        let units = b * nh;
        let parts = tile_parts(units);
        forward_tasks((b * nh * s * d, b * nh * s), units * parts, |task, out_at, lse_at| {
            let (unit, part) = (task / parts, task % parts);
            let (bi, h) = (unit / nh, unit % nh);
            let q = &q[unit * s * d..][..s * d]; // [S, D]
            let kvo = (bi * kv + h / r) * s * d;
            let (k, v) = (&k[kvo..][..s * d], &v[kvo..][..s * d]); // [S, D] each
            let starts = &self.key_start[bi * s..][..s];
            tiles::with_unit(k, v, s, d, false, |t| {
                for st @ (q0, m, _, _) in task_strips(starts, s, part, parts) {
                    // SAFETY: strip (q0, m) of this unit is in exactly one group, i.e. one task.
                    let (o, l) = unsafe { (out_at.rows((unit * s + q0) * d, m * d), lse_at.rows(unit * s + q0, m)) };
                    t.forward_strip(&q[q0 * d..][..m * d], st, starts, self.scale, o, l);
                }
            });
        })
    }

    /// The f32 backward (`group`), tasks as in `forward_groups`: (dq, dk, dv) from q, k, v,
    /// the output and the upstream gradient (`x`) and the forward's lse. Each task
    /// accumulates its own dk and dv; the strip groups of a kv head are summed in a fixed order.
    fn backward_groups(&self, (q, k, v, o, g): Inputs, lse: &[f32], (b, nh, kv, s, d): Dims) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let r = nh / kv;
        let units = b * kv;
        let parts = parts_for(units, s);
        let (dq, dk_t, dv_t) = backward_tasks(b * nh * s * d, units * parts, s * d, |task, dq_at, dk, dv| {
            let (unit, part) = (task / parts, task % parts);
            let (kvo, h0) = (unit * s * d, unit / kv * nh + unit % kv * r);
            let starts = &self.key_start[unit / kv * s..][..s];
            let mut grp = group::Group::new((&k[kvo..][..s * d], &v[kvo..][..s * d]), (r, s, d), starts, self.scale, true);
            let span = h0 * s * d..(h0 + r) * s * d; // the group's heads [R, S, D]
            let rows = (&q[span.clone()], &g[span.clone()], &o[span], &lse[h0 * s..][..r * s]);
            for st @ (q0, m, _, _) in task_strips(starts, s, part, parts) {
                // SAFETY: strip (q0, m) of this unit's heads is in exactly one group, i.e. one task.
                grp.backward_strip(rows, st, dk, dv, |j| unsafe { dq_at.rows(((h0 + j) * s + q0) * d, m * d) });
            }
        });
        (dq, fold_parts(&dk_t, units, 1, parts, s * d), fold_parts(&dv_t, units, 1, parts, s * d))
    }

    /// The backward on the bf16 unit, tasks as in `forward_tiles`; the R query heads of a kv head
    /// and their strip groups summed in a fixed order.
    fn backward_tiles(&self, (q, k, v, o, g): Inputs, lse: &[f32], (b, nh, kv, s, d): Dims) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let r = nh / kv;
        let units = b * nh;
        let parts = tile_parts(units);
        let (dq, dk_t, dv_t) = backward_tasks(b * nh * s * d, units * parts, s * d, |task, dq_at, dk, dv| {
            let (unit, part) = (task / parts, task % parts);
            let (bi, h) = (unit / nh, unit % nh);
            let at = unit * s * d;
            let (q, o, g) = (&q[at..][..s * d], &o[at..][..s * d], &g[at..][..s * d]); // [S, D] each
            let kvo = (bi * kv + h / r) * s * d;
            let (k, v) = (&k[kvo..][..s * d], &v[kvo..][..s * d]);
            let l = &lse[unit * s..][..s];
            let starts = &self.key_start[bi * s..][..s];
            tiles::with_unit(k, v, s, d, true, |t| {
                for st @ (q0, m, _, _) in task_strips(starts, s, part, parts) {
                    let at = q0 * d..(q0 + m) * d;
                    // SAFETY: strip (q0, m) of this unit is in exactly one group, i.e. one task.
                    let dq = unsafe { dq_at.rows((unit * s + q0) * d, m * d) };
                    t.backward_strip((&q[at.clone()], &g[at.clone()], &o[at], &l[q0..q0 + m]), st, starts, self.scale, dq);
                }
                t.finish(dk, dv);
            });
        });
        // Query head h of row b is unit b·NH + h: the R heads of kv head (b, g) are consecutive units.
        (dq, fold_parts(&dk_t, b * kv, r, parts, s * d), fold_parts(&dv_t, b * kv, r, parts, s * d))
    }
}

/// out and lse of `lens` floats from `f(task, out, lse)` run for each of `tasks` tasks in
/// parallel, each writing only its own rows of the two.
fn forward_tasks(lens: (usize, usize), tasks: usize, f: impl Fn(usize, Shared, Shared) + Sync) -> (Vec<f32>, Vec<f32>) {
    let mut out = zeros_f32(lens.0);
    let mut lse = vec![0f32; lens.1];
    let (out_at, lse_at) = (Shared::new(&mut out), Shared::new(&mut lse));
    (0..tasks).into_par_iter().for_each(|task| f(task, out_at, lse_at));
    (out, lse)
}

/// dq of `dq_len` floats and each of `tasks` tasks' own dk and dv parts (`len` floats each,
/// task by task) from `f(task, dq, dk, dv)` run for each task in parallel, writing only its
/// own rows of dq.
fn backward_tasks(dq_len: usize, tasks: usize, len: usize, f: impl Fn(usize, Shared, &mut [f32], &mut [f32]) + Sync) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut dq = zeros_f32(dq_len);
    let mut dk_t = zeros_f32(tasks * len);
    let mut dv_t = zeros_f32(tasks * len);
    let dq_at = Shared::new(&mut dq);
    dk_t.par_chunks_mut(len).zip(dv_t.par_chunks_mut(len)).enumerate().for_each(|(task, (dk, dv))| f(task, dq_at, dk, dv));
    (dq, dk_t, dv_t)
}

/// [B, KV, S, D] from per-task parts: `per_task` holds, for each of `outs` outputs of
/// `len` floats, `heads` x `parts` consecutive tasks' parts, summed in that order.
fn fold_parts(per_task: &[f32], outs: usize, heads: usize, parts: usize, len: usize) -> Vec<f32> {
    let mut acc = zeros_f32(outs * len);
    acc.par_chunks_mut(len).enumerate().for_each(|(unit, a)| {
        for t in unit * heads * parts..(unit + 1) * heads * parts {
            a.iter_mut().zip(&per_task[t * len..][..len]).for_each(|(x, y)| *x += y);
        }
    });
    acc
}

impl candle_core::CustomOp3 for CausalAttention {
    fn name(&self) -> &'static str {
        "causal-attention"
    }

    fn cpu_fwd(&self, qs: &CpuStorage, ql: &Layout, ks: &CpuStorage, kl: &Layout, vs: &CpuStorage, vl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (b, nh, kv, s, d) = dims(ql, kl)?;
        let (q, k, v) = (f32_slice(qs, ql, "q")?, f32_slice(ks, kl, "k")?, f32_slice(vs, vl, "v")?);
        if let (Pass::Recompute, Some(slot)) = (self.keep.pass, &self.keep.slot) {
            if let Some((out, lse)) = slot.take_attention().filter(|(o, l)| o.len() == b * nh * s * d && l.len() == b * nh * s) {
                *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = lse;
                return Ok((CpuStorage::F32(out), ql.shape().clone()));
            }
        }
        let (out, lse) = if self.tiles { self.forward_tiles(q, k, v, (b, nh, kv, s, d)) } else { self.forward_groups(q, k, v, (b, nh, kv, s, d)) };
        if let (Pass::Checkpointed, Some(slot)) = (self.keep.pass, &self.keep.slot) {
            if slot.keeps_attention() {
                slot.put_attention((out.clone(), lse.clone()));
            }
        }
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = lse;
        Ok((CpuStorage::F32(out), ql.shape().clone()))
    }

    fn bwd(&self, q: &Tensor, k: &Tensor, v: &Tensor, out: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (b, nh, s, d) = q.dims4()?;
        let kv = k.dim(1)?;
        let lse = self.lse.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if lse.len() != b * nh * s {
            candle_core::bail!("causal-attention: backward without a forward");
        }
        let e = crate::ops::f32_elems;
        let (qe, ke, ve, oe, ge) = (e(q)?, e(k)?, e(v)?, e(out)?, e(g)?);
        let inputs: Inputs = (&qe, &ke, &ve, &oe, &ge);
        let shape = (b, nh, kv, s, d);
        let (dq, dk, dv) = if self.tiles { self.backward_tiles(inputs, &lse, shape) } else { self.backward_groups(inputs, &lse, shape) };
        let dev = q.device();
        let dq = Tensor::from_vec(dq, q.shape(), dev)?;
        let dk = Tensor::from_vec(dk, k.shape(), dev)?;
        let dv = Tensor::from_vec(dv, v.shape(), dev)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{max_diff, pseudo};
    use candle_core::{Device, Var};

    /// q, k, v as variables and an upstream gradient, for B = 2 rows of S with NH / KV heads.
    /// (pseudo-random in [-1, 1) times `spread`: 2 spreads them like a trained model's q and k.)
    fn inputs(nh: usize, kv: usize, s: usize, d: usize, dt: DType, spread: f32) -> Result<(Var, Var, Var, Tensor)> {
        let (dev, b) = (Device::Cpu, 2);
        let t = |n: usize, seed: usize, shape: (usize, usize, usize, usize)| Tensor::from_vec(pseudo(n, seed).iter().map(|x| spread * x).collect::<Vec<f32>>(), shape, &dev)?.to_dtype(dt);
        let q = Var::from_tensor(&t(b * nh * s * d, 1, (b, nh, s, d))?)?;
        let k = Var::from_tensor(&t(b * kv * s * d, 2, (b, kv, s, d))?)?;
        let v = Var::from_tensor(&t(b * kv * s * d, 3, (b, kv, s, d))?)?;
        Ok((q, k, v, t(b * nh * s * d, 4, (b, nh, s, d))?))
    }

    /// The tile path's math in f64 on its own (plain loops over whole rows, no strips): q, k,
    /// v, the upstream gradient g, p and ds rounded to bf16 where the tiles take them as
    /// operands; scores, softmax and the sums exact. Returns out, dq, dk, dv, each flat.
    fn emulated_bf16_attention((q, k, v, g): (&[f32], &[f32], &[f32], &[f32]), starts: &[u32], scale: f64, (nh, kv, s, d): (usize, usize, usize, usize)) -> [Vec<f64>; 4] {
        use crate::ops::bf16_gemm::bf16_bits;
        let bf = |x: f64| f32::from_bits((bf16_bits(x as f32) as u32) << 16) as f64;
        let b = q.len() / (nh * s * d);
        let r = nh / kv;
        let (mut out, mut dq) = (vec![0f64; q.len()], vec![0f64; q.len()]);
        let (mut dk, mut dv) = (vec![0f64; k.len()], vec![0f64; k.len()]);
        for bi in 0..b {
            for h in 0..nh {
                let (qo, ko) = ((bi * nh + h) * s * d, (bi * kv + h / r) * s * d);
                for i in 0..s {
                    let keys = starts[bi * s + i] as usize..=i;
                    let row = |x: &[f32], o: usize, j: usize| x[o + j * d..][..d].iter().map(|&e| bf(e as f64)).collect::<Vec<f64>>();
                    let (qi, gi) = (row(q, qo, i), row(g, qo, i));
                    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
                    let sc: Vec<f64> = keys.clone().map(|j| dot(&qi, &row(k, ko, j)) * scale).collect();
                    let max = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = sc.iter().map(|x| (x - max).exp()).sum();
                    let p: Vec<f64> = sc.iter().map(|x| (x - max).exp() / sum).collect();
                    let mut o = vec![0f64; d];
                    for (pj, j) in p.iter().zip(keys.clone()) {
                        row(v, ko, j).iter().zip(&mut o).for_each(|(vj, oc)| *oc += bf(*pj) * vj);
                    }
                    out[qo + i * d..][..d].copy_from_slice(&o);
                    // δ from the f32 output and gradient, as the kernel has them.
                    let delta: f64 = g[qo + i * d..][..d].iter().zip(&o).map(|(&gc, oc)| gc as f64 * oc).sum();
                    for (pj, j) in p.iter().zip(keys) {
                        let (kj, vj) = (row(k, ko, j), row(v, ko, j));
                        let ds = bf(pj * (dot(&gi, &vj) - delta) * scale);
                        (0..d).for_each(|c| {
                            dq[qo + i * d + c] += ds * kj[c];
                            dk[ko + j * d + c] += ds * qi[c];
                            dv[ko + j * d + c] += bf(*pj) * gi[c];
                        });
                    }
                }
            }
        }
        [out, dq, dk, dv]
    }

    /// Row 0 plain causal; row 1 packed: records at 0..40, 40..41 (one token), 41..S (41..300
    /// where S > 300), and from 300 on a fourth record, whose queries share a strip (256..320) with
    /// the third's and see none of the keys of that strip's first block (41..297).
    fn packed_starts(s: usize) -> Result<KeyStarts> {
        let mut starts = vec![0u32; 2 * s];
        for i in 0..s {
            starts[s + i] = match i {
                0..40 => 0,
                40 => 40,
                41..300 => 41,
                _ => 300,
            };
        }
        KeyStarts::new(starts, 2, s, &Device::Cpu)
    }

    /// Max |diff| of the outputs and of the q, k, v gradients of two attentions.
    fn compare(a: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>, b: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>, (nh, kv, s): (usize, usize, usize), dt: DType) -> Result<Vec<(&'static str, f32)>> {
        let (q, k, v, g) = inputs(nh, kv, s, 16, dt, 1.0)?;
        let (ya, yb) = (a(&q, &k, &v)?, b(&q, &k, &v)?);
        let mut worst = vec![("out", max_diff(&ya, &yb)?)];
        let ga = (ya.to_dtype(DType::F32)? * g.to_dtype(DType::F32)?)?.sum_all()?.backward()?;
        let gb = (yb.to_dtype(DType::F32)? * g.to_dtype(DType::F32)?)?.sum_all()?.backward()?;
        for (name, var) in [("dq", &q), ("dk", &k), ("dv", &v)] {
            worst.push((name, max_diff(ga.get(var).expect("grad a"), gb.get(var).expect("grad b"))?));
        }
        Ok(worst)
    }

    /// A checkpointed forward leaves the output and log-sum-exp in its slot; the recomputation
    /// hands them back (slot emptied) with the same value and gradients, bit for bit, as a
    /// plain forward.
    #[test]
    fn the_recomputation_hands_back_the_kept_attention_output_with_the_same_gradients() -> Result<()> {
        use crate::ops::checkpoint::{KeepLayer, Kept};
        let starts = packed_starts(150)?;
        let kept = Kept::new(&[KeepLayer { attention: true, ..KeepLayer::default() }]);
        let keep = |pass| Keep { pass, slot: kept.slot(0) };
        let run = |pass, q: &Tensor, k: &Tensor, v: &Tensor| causal_attention(Kernels::Auto, q, k, v, 0.25, &starts, keep(pass), DType::F32);
        let (q, k, v, _) = inputs(6, 2, 150, 16, DType::F32, 1.0)?;
        run(Pass::Checkpointed, &q, &k, &v)?;
        assert_eq!(kept.bytes(), 4 * 2 * 6 * 150 * 17, "out and lse kept");
        // The recomputation takes the slot that a checkpointed forward of the same inputs
        // has just filled.
        let both = |q: &Tensor, k: &Tensor, v: &Tensor| {
            run(Pass::Checkpointed, q, k, v)?;
            run(Pass::Recompute, q, k, v)
        };
        let diffs = compare(both, |q, k, v| causal_attention(Kernels::Auto, q, k, v, 0.25, &starts, Keep::plain(), DType::F32), (6, 2, 150), DType::F32)?;
        assert!(diffs.iter().all(|(_, d)| *d == 0.0), "{diffs:?}");
        assert_eq!(kept.bytes(), 0, "the slot is emptied");
        Ok(())
    }

    /// The fused op and the portable one each equal the whole-matrix reference in value and in
    /// all three gradients, with packed records, GQA (R = 3 and 2) and without (R = 1): at
    /// S = 150 (strips of 64, 64 and 22; the keys in one block) with one task per kv head,
    /// and at S = 600 (ten strips, keys in blocks of 256, 256 and 88, a record starting past a
    /// strip's first block) with each kv head's strips dealt to several tasks.
    #[test]
    fn fused_and_portable_attention_match_the_reference() -> Result<()> {
        let scale = 0.25;
        for (nh, kv, s, parts) in [(6, 2, 150, 1), (9, 3, 150, 1), (6, 2, 600, 4), (4, 4, 600, 2)] {
            let starts = packed_starts(s)?;
            assert_eq!(parts_for(2 * kv, s), parts, "strip groups per kv head");
            let reference = |q: &Tensor, k: &Tensor, v: &Tensor| reference_attention(q, k, v, scale, &starts.host);
            let fused = compare(|q, k, v| causal_attention(Kernels::Auto, q, k, v, scale, &starts, Keep::plain(), DType::F32), reference, (nh, kv, s), DType::F32)?;
            let portable = compare(|q, k, v| portable_attention(q, k, v, scale, &starts, 64), reference, (nh, kv, s), DType::F32)?;
            println!("NH {nh} KV {kv} S {s}: fused vs reference {fused:?}; portable vs reference {portable:?}");
            for (name, d) in fused.iter().chain(&portable) {
                assert!(*d < 1e-5, "{name} differs by {d}");
            }
        }
        Ok(())
    }

    /// bf16 matmul operands on a bf16 unit: the strips' GEMMs on tiles (q, k, v, the upstream
    /// gradient, p and ds rounded to bf16, f32 sums) track the f32 strips in the output and all
    /// three gradients within what that rounding allows, on ragged strips (S = 150: 64 + 64 + 22),
    /// packed records whose first keys are not tile aligned (40, 41), GQA (R = 3), both task
    /// splits and three head dims. Relative to each result's largest element.
    #[test]
    #[cfg_attr(not(bf16_unit), ignore = "needs a bf16 unit (AMX or AVX512-BF16)")]
    fn attention_on_tiles_tracks_the_f32_strips_within_bf16_rounding() -> Result<()> {
        let starts = packed_starts(150)?;
        // D = 192: MLA's padded width on DeepSeek-V2 (six K tiles), one kv head per query head.
        for (nh, kv, d) in [(6, 2, 32), (9, 3, 64), (4, 4, 192)] {
            assert!(tiles::usable(d), "a bf16 unit was found at build time but the tiles cannot run here");
            let (q, k, v, g) = inputs(nh, kv, 150, d, DType::F32, 2.0)?;
            let scale = 1.0 / (d as f64).sqrt();
            let run = |operands| -> Result<Vec<Tensor>> {
                let y = causal_attention(Kernels::Auto, &q, &k, &v, scale, &starts, Keep::plain(), operands)?;
                let grads = (&y * &g)?.sum_all()?.backward()?;
                Ok(vec![y, grads.get(&q).expect("dq").clone(), grads.get(&k).expect("dk").clone(), grads.get(&v).expect("dv").clone()])
            };
            let (tiles, f32s) = (run(DType::BF16)?, run(DType::F32)?);
            let host = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
            let emulated = emulated_bf16_attention((&host(&q)?, &host(&k)?, &host(&v)?, &host(&g)?), &starts.host, scale, (nh, kv, 150, d));
            for (i, name) in ["out", "dq", "dk", "dv"].iter().enumerate() {
                let peak = f32s[i].abs()?.max_all()?.to_scalar::<f32>()?;
                let vs_f32 = max_diff(&tiles[i], &f32s[i])? / peak;
                let got = host(&tiles[i])?;
                let vs_emulated = got.iter().zip(&emulated[i]).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max) / peak as f64;
                println!("NH {nh} KV {kv} D {d}: {name} on tiles, max |diff| / max |f32 result|: vs the f32 strips {vs_f32:.2e}, vs bf16 operands emulated in f64 {vs_emulated:.2e}");
                // Against f32: bf16 operands, 2^-9 relative each (measured: up to 5.6e-3). Against
                // the emulation: f32 sums in another order, and the p or ds elements whose bf16
                // rounding an f32 difference in the last bit flips (a flipped p of an early row,
                // which sees few keys, moves its output by up to 2^-8 p |v|), and in ds the
                // cancellation dp − δ of rows that see few keys, where dp comes from bf16
                // operands and δ from the f32 output (measured: up to 2.5e-4 at D <= 64, 5.1e-4
                // for dq at D = 192).
                assert!(vs_f32 < 6e-3, "{name}: {vs_f32}");
                assert!(vs_emulated < 6e-4, "{name}: {vs_emulated}");
            }
        }
        Ok(())
    }

    /// `kernels = "portable"` on CPU f32 takes the portable op, which then equals the fused one.
    #[test]
    fn portable_kernels_run_the_portable_op_and_agree_with_the_fused_one() -> Result<()> {
        let starts = packed_starts(150)?;
        let d = compare(
            |q, k, v| causal_attention(Kernels::Portable, q, k, v, 0.25, &starts, Keep::plain(), DType::F32),
            |q, k, v| causal_attention(Kernels::Auto, q, k, v, 0.25, &starts, Keep::plain(), DType::F32),
            (4, 2, 150),
            DType::F32,
        )?;
        println!("portable vs fused: {d:?}");
        assert!(d.iter().all(|(_, d)| *d < 1e-5), "{d:?}");
        Ok(())
    }

    /// bf16 q, k, v: the portable op keeps bf16 in and out, its statistics in f32, and stays
    /// within bf16 rounding of the f32 result on the same (bf16-valued) inputs.
    #[test]
    fn portable_attention_in_bf16_tracks_f32_within_bf16_rounding() -> Result<()> {
        let starts = packed_starts(150)?;
        let (q, k, v, _) = inputs(4, 2, 150, 16, DType::BF16, 1.0)?;
        let y = portable_attention(&q, &k, &v, 0.25, &starts, 64)?;
        assert_eq!(y.dtype(), DType::BF16);
        let f = |t: &Tensor| t.to_dtype(DType::F32);
        let want = portable_attention(&f(&q)?, &f(&k)?, &f(&v)?, 0.25, &starts, 64)?;
        let d = max_diff(&y, &want)?;
        println!("bf16 portable attention vs f32: max |diff| {d:.1e}");
        // Outputs are convex combinations of v (|v| <= 1): probabilities rounded to bf16
        // (relative 2^-8 each) and a bf16 output rounding bound the error by about 2 * 2^-8.
        assert!(d < 2.0 * 2f32.powi(-8), "{d}");
        Ok(())
    }

    /// Strips see only their past: a position's output is the same with the rest of the
    /// sequence cut off.
    #[test]
    fn attention_output_depends_only_on_earlier_positions() -> Result<()> {
        let dev = Device::Cpu;
        let (s, d) = (300, 8);
        let q = Tensor::from_vec(pseudo(s * d, 5), (1, 1, s, d), &dev)?;
        let k = Tensor::from_vec(pseudo(s * d, 6), (1, 1, s, d), &dev)?;
        let v = Tensor::from_vec(pseudo(s * d, 7), (1, 1, s, d), &dev)?;
        for kern in [Kernels::Auto, Kernels::Portable] {
            let full = causal_attention(kern, &q, &k, &v, 0.5, &KeyStarts::causal(1, s, &dev)?, Keep::plain(), DType::F32)?;
            // Position 100's output depends only on keys 0..=100: the prefix alone gives it too.
            let (qp, kp, vp) = (q.narrow(2, 0, 101)?, k.narrow(2, 0, 101)?, v.narrow(2, 0, 101)?);
            let prefix = causal_attention(kern, &qp, &kp, &vp, 0.5, &KeyStarts::causal(1, 101, &dev)?, Keep::plain(), DType::F32)?;
            let dmax = max_diff(&full.narrow(2, 100, 1)?, &prefix.narrow(2, 100, 1)?)?;
            assert!(dmax < 1e-6, "{kern:?}: position 100 saw the future: {dmax}");
        }
        Ok(())
    }

    /// Strip heights fit the byte budget, in multiples of 64, never below 64 (where 64 rows
    /// exceed the budget, 64 it is) or past S rounded up to 64.
    #[test]
    fn portable_strips_hold_at_most_the_budget_of_scores() {
        assert_eq!(portable_strip_rows(4, 9, 512), 448); // SmolLM2 4 x 512: two strips
        assert_eq!(portable_strip_rows(1, 32, 4096), 64);
        assert_eq!(portable_strip_rows(1, 1, 30), 64);
        assert_eq!(portable_strip_rows(8, 32, 2048), 64); // the floor: 64 MiB of scores per strip
        let rows = portable_strip_rows(2, 16, 1024);
        assert!(rows > 64 && rows * 2 * 16 * 1024 * 4 <= PORTABLE_STRIP_BYTES && rows.is_multiple_of(64), "{rows}");
    }
}

#[cfg(test)]
mod speed {
    use super::*;
    use crate::ops::testutil::pseudo;

    /// `cargo test --release --lib attention_speed -- --ignored --nocapture`: milliseconds of
    /// the fused op's forward and backward on the bench model's shape (SmolLM2-135M, 4 x 512),
    /// f32 strips against tiles where a bf16 unit runs (a look, not a test; `make bench` has the
    /// numbers).
    #[test]
    #[ignore]
    fn attention_speed() -> Result<()> {
        // ATTENTION_SPEED_SHAPE=b,nh,kv,s,d: another shape (1,9,3,4096,64: the scaling rows).
        let shape: Vec<usize> = std::env::var("ATTENTION_SPEED_SHAPE").map_or_else(|_| vec![4, 9, 3, 512, 64], |v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect());
        let [b, nh, kv, s, d] = shape[..] else { panic!("ATTENTION_SPEED_SHAPE wants b,nh,kv,s,d") };
        let dev = Device::Cpu;
        let t = |n: usize, seed: usize, shape: (usize, usize, usize, usize)| Tensor::from_vec(pseudo(n, seed), shape, &dev);
        let q = candle_core::Var::from_tensor(&t(b * nh * s * d, 1, (b, nh, s, d))?)?;
        let k = candle_core::Var::from_tensor(&t(b * kv * s * d, 2, (b, kv, s, d))?)?;
        let v = candle_core::Var::from_tensor(&t(b * kv * s * d, 3, (b, kv, s, d))?)?;
        let g = t(b * nh * s * d, 4, (b, nh, s, d))?;
        let starts = KeyStarts::causal(b, s, &dev)?;
        let mut kinds = vec![DType::F32];
        if tiles::usable(d) {
            kinds.push(DType::BF16);
        }
        // ATTENTION_SPEED_ONLY=bf16 (or f32): one kind, for a profiler.
        if let Ok(only) = std::env::var("ATTENTION_SPEED_ONLY") {
            kinds.retain(|k| k.as_str() == only);
        }
        for _round in 0..2 {
            for &operands in &kinds {
                let (mut fwd, mut bwd) = (f64::MAX, f64::MAX);
                for _ in 0..10 {
                    let t0 = std::time::Instant::now();
                    let y = causal_attention(Kernels::Auto, &q, &k, &v, 0.125, &starts, Keep::plain(), operands)?;
                    let t1 = std::time::Instant::now();
                    std::hint::black_box(crate::ops::pullback(&y, &g)?.backward()?);
                    fwd = fwd.min((t1 - t0).as_secs_f64());
                    bwd = bwd.min(t1.elapsed().as_secs_f64());
                }
                // Causal: half the S x S products; forward 2 GEMMs, backward 5 (scores again, dv, dp, dq, dk).
                let gemm = (b * nh * s * s * d) as f64; // 2 x S²/2 x D per GEMM and head
                println!(
                    "attention {b}x{nh}x{s}x{d} operands {operands:?}: forward {:.1} ms ({:.0} GFLOP/s), backward {:.1} ms ({:.0} GFLOP/s) (best of 10)",
                    fwd * 1e3, 2.0 * gemm / fwd / 1e9, bwd * 1e3, 5.0 * gemm / bwd / 1e9
                );
            }
        }
        Ok(())
    }
}
