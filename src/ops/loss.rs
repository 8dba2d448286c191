//! Chunked cross-entropy through the frozen LM head, with its gradient computed directly.
//!
//! The full logits tensor of a batch ([N, V] f32, plus its gradient under autograd) is the
//! largest allocation of a training step (4 x 512 x 49152 x 4 B = 400 MB, twice). Because the
//! LM head is frozen, dLoss/dhidden has a closed form: (softmax(logits) - onehot(target)) @ W.
//! We compute it chunk by chunk for the target rows only, never holding more than one
//! [C, V] chunk, and hand the result to autograd as the upstream gradient of the hidden rows.

use super::bf16_gemm::PackedB;
use super::{Kernels, Op, Path};
use candle_core::{DType, Result, Tensor, D};

/// Most logits elements held at once (28 MB of f32). Kept under glibc's largest mmap
/// threshold (32 MB, which `main` sets): a larger chunk's logits and gradient would each be a
/// fresh mmap, so every chunk of every step would fault in and zero new pages.
const CHUNK_ELEMS: usize = 7 << 20;

/// Rows per chunk for a vocabulary of `v`: as many as fit in `CHUNK_ELEMS`, rounded down to
/// whole 32-row GEMM blocks for each thread when that many fit. Why: the head GEMMs split a
/// chunk's row blocks over the threads, and the 149 rows that fit for a 49k vocabulary are 5
/// blocks, which 2 threads run as 3 + 2 (a sixth of the head's time idle); 128 rows are 2 + 2.
fn chunk_rows(v: usize, threads: usize) -> usize {
    let fit = (CHUNK_ELEMS / v.max(1)).max(1);
    let quantum = 32 * threads.max(1);
    if fit >= quantum { fit - fit % quantum } else { fit }
}

/// rows [M, H] (final-normed hidden states of the positions that have a target),
/// head [V, H], targets [M] -> (sum of token cross-entropies, d(scale * sum)/d rows [M, H]).
///
/// Fused path (CPU f32 rows): one parallel pass per chunk computes the cross-entropy and
/// softmax − onehot together. Portable path: the same from candle ops; the logits of a chunk
/// come out of the head's own dtype (as transformers computes `lm_head` in the model dtype)
/// and the softmax and cross-entropy run in f32 (as its loss upcasts the logits).
pub fn cross_entropy_sum_and_grad(k: Kernels, rows: &Tensor, head: &Tensor, targets: &[u32], scale: f64) -> Result<(f64, Tensor)> {
    let (m, h) = rows.dims2()?;
    let v = head.dim(0)?;
    if head.dim(1)? != h || targets.len() != m {
        candle_core::bail!("cross-entropy: rows {:?}, head {:?} and {} targets do not fit", rows.dims(), head.dims(), targets.len());
    }
    let chunk = chunk_rows(v, rayon::current_num_threads());
    let mut total = 0f64;
    let mut grads = Vec::new();
    let mut start = 0;
    let path = k.pick(Op::LossHead, rows, &[head]);
    let head = Head::new(path, head)?;
    while start < m {
        let c = chunk.min(m - start);
        let x = rows.narrow(0, start, c)?; // [C, H]
        let logits = head.logits(&x)?; // [C, V] f32
        let t = &targets[start..start + c];
        let (ce, g_logits) = match path {
            // One parallel pass per row instead of seven whole-tensor ops.
            Path::Fused => softmax_ce_rows(&logits, t, scale)?,
            Path::Portable => softmax_ce_portable(&logits, t, scale)?,
        };
        total += ce;
        grads.push(head.input_grad(&g_logits)?.to_dtype(rows.dtype())?); // [C, H]
        start += c;
    }
    let grad = if grads.is_empty() { rows.zeros_like()? } else { Tensor::cat(&grads, 0)? };
    Ok((total, grad))
}

/// The CE sum (f64) and scale · (softmax − onehot) [C, V] of f32 logits [C, V], from candle
/// ops (any device).
fn softmax_ce_portable(logits: &Tensor, targets: &[u32], scale: f64) -> Result<(f64, Tensor)> {
    let c = logits.dim(0)?;
    let max = logits.max_keepdim(D::Minus1)?; // [C, 1]
    let shifted = logits.broadcast_sub(&max)?; // [C, V]
    let exp = shifted.exp()?;
    let sum = exp.sum_keepdim(D::Minus1)?; // [C, 1]
    let t = Tensor::from_slice(targets, (c, 1), logits.device())?;
    let picked = shifted.gather(&t, 1)?; // [C, 1]
    // CE = log(sum exp(l - max)) - (l_t - max), summed in f64.
    let ce = (sum.log()? - picked)?.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
    // d CE / d logits = softmax - onehot.
    let probs = exp.broadcast_div(&sum)?; // [C, V]
    let minus_one = Tensor::full(-1f32, (c, 1), logits.device())?;
    Ok((ce, (probs.scatter_add(&t, &minus_one, 1)? * scale)?)) // [C, V]
}

/// The frozen head [V, H] in the form its two matmuls per chunk want, prepared once per call.
enum Head {
    /// Fused, f32 head: the f32 GEMM.
    F32(Tensor),
    /// Fused, bf16 head on a CPU with a bf16 unit (the weight source hands one out only then):
    /// packed for x @ Wᵀ and for g @ W, so both run on it like the frozen projections.
    Bf16 { nk: PackedB, kn: PackedB },
    /// Portable: the head in its own dtype (never converted whole), chunks meeting it there.
    Native(Tensor),
}

impl Head {
    fn new(path: Path, head: &Tensor) -> Result<Self> {
        Ok(match (path, head.dtype()) {
            (Path::Fused, DType::BF16) => Head::Bf16 { nk: PackedB::from_weight(head, false)?, kn: PackedB::from_weight(head, true)? },
            (Path::Fused, _) => Head::F32(head.to_dtype(DType::F32)?),
            (Path::Portable, _) => Head::Native(head.clone()),
        })
    }

    /// x [C, H] -> logits [C, V] f32
    fn logits(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Head::F32(w) => x.matmul(&w.t()?),
            Head::Bf16 { nk, .. } => super::bf16_gemm::matmul(x, nk),
            Head::Native(w) => x.to_dtype(w.dtype())?.matmul(&w.t()?)?.to_dtype(DType::F32),
        }
    }

    /// g [C, V] f32 -> g @ W [C, H] (f32, or the head's dtype on the portable path)
    fn input_grad(&self, g: &Tensor) -> Result<Tensor> {
        match self {
            Head::F32(w) => g.matmul(w),
            Head::Bf16 { kn, .. } => super::bf16_gemm::matmul(g, kn),
            Head::Native(w) => g.to_dtype(w.dtype())?.matmul(w),
        }
    }
}

/// Per row of logits [C, V] (CPU, f32): the cross-entropy against `targets` (summed in f64)
/// and scale · (softmax − onehot), computed in one parallel pass over the rows.
fn softmax_ce_rows(logits: &Tensor, targets: &[u32], scale: f64) -> Result<(f64, Tensor)> {
    use rayon::prelude::*;
    let (c, v) = logits.dims2()?;
    let logits = logits.contiguous()?;
    let (st, layout) = logits.storage_and_layout();
    let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(data)) = &*st else {
        candle_core::bail!("softmax_ce_rows: f32 cpu logits expected")
    };
    let Some((o, e)) = layout.contiguous_offsets() else { candle_core::bail!("softmax_ce_rows: contiguous logits expected") };
    let data = &data[o..e];
    let mut grad = super::zeros_f32(c * v);
    let scale = scale as f32;
    let ce: f64 = grad
        .par_chunks_mut(v)
        .zip(data.par_chunks(v))
        .zip(targets.par_iter())
        .map(|((g, l), &t)| {
            let max = l.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            g.iter_mut().zip(l).for_each(|(gi, &li)| *gi = super::exp_f32(li - max));
            let sum = super::sum_f32(g);
            let k = scale / sum;
            g.iter_mut().for_each(|gi| *gi *= k);
            g[t as usize] -= scale;
            // CE = log(sum exp(l - max)) - (l_t - max)
            (sum.ln() - (l[t as usize] - max)) as f64
        })
        .sum();
    drop(st);
    Ok((ce, Tensor::from_vec(grad, (c, v), logits.device())?))
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
        let (ce, grad) = cross_entropy_sum_and_grad(Kernels::Auto, &rows, &head, &targets, 0.25)?;
        let rounded = rows.to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
        let (ce32, _) = cross_entropy_sum_and_grad(Kernels::Auto, &rounded, &head.to_dtype(DType::F32)?, &targets, 0.25)?;
        // The input gradient rounds g = softmax - onehot to bf16 too: compare with that.
        let logits = rounded.matmul(&head.to_dtype(DType::F32)?.t()?)?;
        let (_, g_logits) = softmax_ce_rows(&logits, &targets, 0.25)?;
        let want = g_logits.to_dtype(DType::BF16)?.to_dtype(DType::F32)?.matmul(&head.to_dtype(DType::F32)?)?;
        let diff = (grad - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        println!("bf16 head: |ce diff| {:e}, max |grad diff| {diff:e}", (ce - ce32).abs());
        assert!((ce - ce32).abs() < 1e-4 * ce32.abs(), "ce {ce} vs {ce32}");
        assert!(diff < 1e-5, "grad differs by {diff}");
        Ok(())
    }

    /// The bf16 head's two products (logits x Wᵀ, input gradient g W), built as the fused path
    /// builds them, on every CPU (the unit where there is one, the portable loop of the same
    /// math elsewhere): f32 sums of bf16-rounded operands.
    #[test]
    fn the_bf16_heads_products_are_f32_math_on_bf16_rounded_operands_on_every_cpu() -> Result<()> {
        let dev = Device::Cpu;
        let (m, h, v) = (45, 64, 300);
        let rows = Tensor::from_vec((0..m * h).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.1).collect(), (m, h), &dev)?;
        let head = Tensor::from_vec((0..v * h).map(|i| ((i * 13 % 7) as f32 - 3.0) * 0.05).collect(), (v, h), &dev)?.to_dtype(DType::BF16)?;
        let g = Tensor::from_vec((0..m * v).map(|i| ((i * 7 % 9) as f32 - 4.0) * 0.01).collect(), (m, v), &dev)?;
        let built = Head::new(Path::Fused, &head)?;
        assert!(matches!(built, Head::Bf16 { .. }), "a bf16 head on the fused path is packed for the bf16 GEMM");
        let round = |t: &Tensor| t.to_dtype(DType::BF16)?.to_dtype(DType::F32);
        let h32 = head.to_dtype(DType::F32)?;
        let d = (built.logits(&rows)? - round(&rows)?.matmul(&h32.t()?)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let dg = (built.input_grad(&g)? - round(&g)?.matmul(&h32)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
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
        let (loss, grad) = cross_entropy_sum_and_grad(Kernels::Auto, rows.as_tensor(), &head, &targets, 0.5)?;
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
        let (ce_f, g_f) = cross_entropy_sum_and_grad(Kernels::Auto, &rows, &head, &targets, 0.25)?;
        let (ce_p, g_p) = cross_entropy_sum_and_grad(Kernels::Portable, &rows, &head, &targets, 0.25)?;
        let dg = (&g_f - &g_p)?.abs()?.max_all()?.to_scalar::<f32>()?;
        println!("portable vs fused loss: |ce diff| {:.1e}, max |grad diff| {dg:.1e}", (ce_f - ce_p).abs());
        assert!((ce_f - ce_p).abs() < 1e-6 * ce_f.abs() && dg < 1e-6);
        let (rb, hb) = (rows.to_dtype(DType::BF16)?, head.to_dtype(DType::BF16)?);
        let (ce_b, g_b) = cross_entropy_sum_and_grad(Kernels::Portable, &rb, &hb, &targets, 0.25)?;
        assert_eq!(g_b.dtype(), DType::BF16);
        let rel = (ce_b - ce_f).abs() / ce_f.abs();
        println!("bf16 portable loss: relative CE diff {rel:.1e}");
        assert!(rel < 2f64.powi(-8), "{rel}");
        Ok(())
    }
}
