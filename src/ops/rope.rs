//! RoPE (rotate-half, transformers' `apply_rotary_pos_emb`) and the head moves between the
//! projection layout [N, NH*D] and the attention layout [B, NH, S, D].

use super::{cpu_f32, f32_elems, host_f32, par_zeroed, Kernels, Op, Path};
use candle_core::{DType, Device, Result, Tensor, D};

/// cos/sin tables for rotate-half RoPE: positions [B, S] (u32) -> cos, sin [B, 1, S, D].
/// Computed in f64 from `inv_freq` (already scaled per the config's rope_scaling).
pub fn rope_tables(positions: &[Vec<u32>], inv_freq: &[f64], device: &Device, dtype: DType) -> Result<(Tensor, Tensor)> {
    let b = positions.len();
    let s = positions.first().map_or(0, |p| p.len());
    let half = inv_freq.len();
    let d = 2 * half;
    let mut cos = Vec::with_capacity(b * s * d);
    let mut sin = Vec::with_capacity(b * s * d);
    for row in positions {
        for &p in row {
            // emb = cat(freqs, freqs): the same angle for element i and i + D/2.
            for _ in 0..2 {
                for f in inv_freq {
                    let a = p as f64 * f;
                    cos.push(a.cos() as f32);
                    sin.push(a.sin() as f32);
                }
            }
        }
    }
    let cos = Tensor::from_vec(cos, (b, 1, s, d), device)?.to_dtype(dtype)?;
    let sin = Tensor::from_vec(sin, (b, 1, s, d), device)?.to_dtype(dtype)?;
    Ok((cos, sin))
}

/// Rotate-half RoPE (transformers' `apply_rotary_pos_emb`): x [B, N, S, D], cos/sin [B, 1, S, D].
/// Pairs are (i, i + D/2), not interleaved (i, i+1) as in the original paper.
/// The tables meet x in x's dtype, as transformers' `cos.to(x.dtype)` (bf16 activations
/// rotate with bf16-rounded tables).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (cos, sin) = (&cos.to_dtype(x.dtype())?, &sin.to_dtype(x.dtype())?);
    let d = x.dim(D::Minus1)?;
    let x1 = x.narrow(D::Minus1, 0, d / 2)?;
    let x2 = x.narrow(D::Minus1, d / 2, d / 2)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?; // [B, N, S, D]
    x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?
}

/// Heads out of a projection, rotated: x [B, S, N, D] or the projection's own [B*S, N*D]
/// (the same bytes) -> rope(x as [B, N, S, D]). On CPU f32 one fused op that transposes while
/// it rotates, with the inverse rotation as its backward (no gradients for the cos/sin
/// constants, which the generic path computes at full size and reduces). Taking the 2-D
/// projection output directly saves autograd a reshape node (a zeroed gradient buffer and an
/// add in candle's backward).
pub fn rope_heads(k: Kernels, x: &Tensor, n: usize, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, _, s, d) = cos.dims4()?;
    if n * b * s * d != x.elem_count() || sin.dims() != cos.dims() || d % 2 != 0 {
        candle_core::bail!("rope-heads: x {:?} is not {n} heads of cos/sin {:?}/{:?} (even head_dim)", x.dims(), cos.dims(), sin.dims());
    }
    match k.pick(Op::Heads, x, &[]) {
        Path::Fused => {
            let rot = Some(Rotation::new(cos, sin, false)?);
            x.contiguous()?.apply_op1(Heads { dims: (b, s, n, d), cols: d, rope: rot, split: true })
        }
        Path::Portable => rope(&x.reshape((b, s, n, d))?.transpose(1, 2)?.contiguous()?, cos, sin), // [B, N, S, D]
    }
}

/// x [B*S, N*D] (or [B, S, N, D]) -> [B, N, S, D]: the heads-first layout attention wants,
/// in one copy with one autograd node (candle's reshape + transpose + contiguous is three).
pub fn split_heads(k: Kernels, x: &Tensor, b: usize, s: usize, n: usize) -> Result<Tensor> {
    let d = x.elem_count() / (b * s * n).max(1);
    if d * b * s * n != x.elem_count() {
        candle_core::bail!("split-heads: x {:?} is not [{b} x {s}, {n} heads x D]", x.dims());
    }
    match k.pick(Op::Heads, x, &[]) {
        Path::Fused => x.contiguous()?.apply_op1(Heads { dims: (b, s, n, d), cols: d, rope: None, split: true }),
        Path::Portable => x.reshape((b, s, n, d))?.transpose(1, 2)?.contiguous(), // [B, N, S, D]
    }
}

/// x [B, N, S, D] -> [B*S, N*D]: attention's output back in the projection layout (the
/// inverse of `split_heads`), in one copy with one autograd node.
pub fn merge_heads(k: Kernels, x: &Tensor) -> Result<Tensor> {
    merge_head_cols(k, x, x.dim(3)?)
}

/// x [B, N, S, D] -> [B*S, N*cols]: the first `cols` columns of each head (MLA's v width of
/// an output padded to the q/k width), merged as `merge_heads` does, in one copy with one
/// autograd node (a narrow first would be a copy too, and in the backward a zero-padded
/// copy of x's size, a zeroed buffer and an add).
pub fn merge_head_cols(k: Kernels, x: &Tensor, cols: usize) -> Result<Tensor> {
    let (b, n, s, d) = x.dims4()?;
    if cols > d {
        candle_core::bail!("merge-heads: {cols} columns of heads of {d}");
    }
    match k.pick(Op::Heads, x, &[]) {
        Path::Fused => x.contiguous()?.apply_op1(Heads { dims: (b, s, n, d), cols, rope: None, split: false }),
        Path::Portable => x.narrow(3, 0, cols)?.transpose(1, 2)?.reshape((b * s, n * cols)), // [N, NH*cols]
    }
}

/// Moves heads between the projection layout [B, S, N, D] and the attention layout
/// [B, N, S, D] (`split`), or back (`!split`), rotating by RoPE on the way in when `rope`
/// is set. `cols` < D (merges only): the projection layout
/// holds the first `cols` columns of each head, [B, S, N, cols].
struct Heads {
    dims: (usize, usize, usize, usize),
    cols: usize,
    rope: Option<Rotation>,
    split: bool,
}

/// Rotate-half RoPE on host rows: cos/sin [B·S, D] (the tables flattened, a row per token)
/// and how the rotated dims pair. The fused ops' one rotation (`Heads`, `mla::Assemble`).
pub(crate) struct Rotation {
    cos: Vec<f32>,
    sin: Vec<f32>,
    d: usize,
    /// Pairs (2i, 2i + 1) taken as the halves (evens, then odds), as DeepSeek's checkpoints
    /// rotate them; else (i, i + D/2).
    interleaved: bool,
}

impl Rotation {
    /// From cos/sin [B, 1, S, D].
    pub(crate) fn new(cos: &Tensor, sin: &Tensor, interleaved: bool) -> Result<Self> {
        Ok(Rotation { cos: host_f32(cos)?, sin: host_f32(sin)?, d: cos.dim(D::Minus1)?, interleaved })
    }

    /// o = rope(x) at token `t`: out1 = x1 c − x2 s, out2 = x2 c + x1 s (the same angle at i
    /// and i + D/2).
    pub(crate) fn rotate(&self, x: &[f32], o: &mut [f32], t: usize) {
        let (c, sn, h) = (&self.cos[t * self.d..][..self.d], &self.sin[t * self.d..][..self.d], self.d / 2);
        for i in 0..h {
            let (x1, x2) = if self.interleaved { (x[2 * i], x[2 * i + 1]) } else { (x[i], x[i + h]) };
            o[i] = x1 * c[i] - x2 * sn[i];
            o[i + h] = x2 * c[i + h] + x1 * sn[i + h];
        }
    }

    /// dx += the transpose of the rotation applied to g at token `t` (dx1 = g1 c + g2 s,
    /// dx2 = g2 c − g1 s), put back in the pairs' order.
    pub(crate) fn unrotate_add(&self, g: &[f32], dx: &mut [f32], t: usize) {
        let (c, sn, h) = (&self.cos[t * self.d..][..self.d], &self.sin[t * self.d..][..self.d], self.d / 2);
        for i in 0..h {
            let (d1, d2) = (g[i] * c[i] + g[i + h] * sn[i + h], g[i + h] * c[i + h] - g[i] * sn[i]);
            let (j1, j2) = if self.interleaved { (2 * i, 2 * i + 1) } else { (i, i + h) };
            dx[j1] += d1;
            dx[j2] += d2;
        }
    }
}

impl Heads {
    /// For each (b, s, n): `f(src row [D], dst row [D], t)` with t the token b·S + s (the
    /// row of cos/sin), src read in `src_heads_first` layout ([B, N, S, D] if true, else [B, S, N, D])
    /// and dst written in the other.
    fn map(&self, src: &[f32], src_heads_first: bool, f: impl Fn(&[f32], &mut [f32], usize) + Sync) -> Vec<f32> {
        let (b, s, n, d) = self.dims;
        let c = self.cols;
        // Row lengths: D in the heads-first layout, `cols` in the projection layout; `f`
        // maps the first `cols` of each (the rest of a longer dst row stays zero).
        let (src_d, dst_d) = if src_heads_first { (d, c) } else { (c, d) };
        // One row per task: dst row r is (b, s, n) of [B, S, N, _] or (b, n, s) of
        // [B, N, S, _], whichever dst is (a whole head per task left one of two threads idle
        // for the three kv heads of a 1 x 512 micro-batch).
        par_zeroed(b * s * n * dst_d, dst_d.max(1), |r, out: &mut [f32]| {
            let (bi, si, ni) = if src_heads_first { (r / (s * n), r / n % s, r % n) } else { (r / (n * s), r % s, r / s % n) };
            let t = bi * s + si;
            let from = if src_heads_first { ((bi * n + ni) * s + si) * src_d } else { ((bi * s + si) * n + ni) * src_d };
            f(&src[from..from + c], &mut out[..c], t);
        })
    }

    /// Move (and rotate forward if `rope`, or backward if `inverse`) from the `heads_first`
    /// layout to the other.
    fn apply(&self, src: &[f32], heads_first: bool, inverse: bool) -> Vec<f32> {
        match &self.rope {
            None => self.map(src, heads_first, |x, o, _| o.copy_from_slice(x)),
            Some(rot) if !inverse => self.map(src, heads_first, |x, o, t| rot.rotate(x, o, t)),
            // Into the zeroed row: the transposed rotation itself.
            Some(rot) => self.map(src, heads_first, |g, o, t| rot.unrotate_add(g, o, t)),
        }
    }
}

impl candle_core::CustomOp1 for Heads {
    fn name(&self) -> &'static str {
        "heads"
    }

    fn cpu_fwd(&self, storage: &candle_core::CpuStorage, layout: &candle_core::Layout) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let x = cpu_f32("heads", storage, layout)?;
        let (b, s, n, d) = self.dims;
        if x.len() != b * s * n * d {
            candle_core::bail!("heads: {} elements for [{b}, {s}, {n}, {d}]", x.len());
        }
        // split: [B, S, N, D] -> [B, N, S, D]; merge: [B, N, S, D] -> [B*S, N*cols]
        let y = self.apply(x, !self.split, false);
        let shape = if self.split { candle_core::Shape::from((b, n, s, d)) } else { candle_core::Shape::from((b * s, n * self.cols)) };
        Ok((candle_core::CpuStorage::F32(y), shape))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let g = f32_elems(grad_res)?;
        let dx = self.apply(&g, self.split, true);
        Ok(Some(Tensor::from_vec(dx, arg.shape(), arg.device())?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{compare, max_diff, pseudo};

    #[test]
    fn rope_at_position_zero_is_identity() -> Result<()> {
        let dev = Device::Cpu;
        let (cos, sin) = rope_tables(&[vec![0, 1]], &[1.0, 0.01], &dev, DType::F32)?;
        let x = Tensor::arange(0f32, 8.0, &dev)?.reshape((1, 1, 2, 4))?;
        let y = rope(&x, &cos, &sin)?;
        let row0: Vec<f32> = y.get(0)?.get(0)?.get(0)?.to_vec1()?;
        assert_eq!(row0, vec![0.0, 1.0, 2.0, 3.0]);
        Ok(())
    }

    #[test]
    fn fused_rope_heads_matches_the_portable_transpose_then_rope() -> Result<()> {
        let (b, s, n, d) = (2, 7, 3, 8);
        let positions: Vec<Vec<u32>> = vec![(0..7).collect(), vec![0, 1, 2, 0, 1, 2, 3]];
        let (cos, sin) = rope_tables(&positions, &[1.0, 0.1, 0.01, 0.001], &Device::Cpu, DType::F32)?;
        let (dv, dg) = compare(&[b, s, n, d], |x| rope_heads(Kernels::Auto, x, n, &cos, &sin), |x| rope(&x.transpose(1, 2)?.contiguous()?, &cos, &sin))?;
        println!("rope_heads fused vs generic: value {dv:.1e}, grad {dg:.1e}");
        assert!(dv < 1e-6 && dg < 1e-6, "value {dv}, grad {dg}");
        // The projection's own [B*S, N*D] layout gives the same.
        let (dv, dg) = compare(&[b * s, n * d], |x| rope_heads(Kernels::Auto, x, n, &cos, &sin), |x| rope(&x.reshape((b, s, n, d))?.transpose(1, 2)?.contiguous()?, &cos, &sin))?;
        assert!(dv < 1e-6 && dg < 1e-6, "2-D input: value {dv}, grad {dg}");
        Ok(())
    }

    #[test]
    fn split_and_merge_heads_match_reshape_and_transpose_in_value_and_gradient() -> Result<()> {
        let (b, s, n, d) = (2, 5, 3, 4);
        let (dv, dg) = compare(&[b * s, n * d], |x| split_heads(Kernels::Auto, x, b, s, n), |x| x.reshape((b, s, n, d))?.transpose(1, 2)?.contiguous())?;
        assert!(dv == 0.0 && dg == 0.0, "split: value {dv}, grad {dg}");
        let (dv, dg) = compare(&[b, n, s, d], |x| merge_heads(Kernels::Auto, x), |x| x.transpose(1, 2)?.reshape((b * s, n * d)))?;
        assert!(dv == 0.0 && dg == 0.0, "merge: value {dv}, grad {dg}");
        // The first 3 of each head's 4 columns (the columns past them get zero gradient).
        let (dv, dg) = compare(&[b, n, s, d], |x| merge_head_cols(Kernels::Auto, x, 3), |x| x.narrow(3, 0, 3)?.transpose(1, 2)?.reshape((b * s, n * 3)))?;
        assert!(dv == 0.0 && dg == 0.0, "merge of 3 columns: value {dv}, grad {dg}");
        Ok(())
    }

    /// bf16 activations with f32 tables (a caller that built them in f32): the tables are
    /// converted to x's dtype, the result is bf16 and equals the f32 rotation to bf16 rounding.
    #[test]
    fn portable_rope_heads_meets_f32_tables_in_bf16() -> Result<()> {
        let (b, s, n, d) = (2, 7, 3, 8);
        let positions: Vec<Vec<u32>> = vec![(0..7).collect(), (3..10).collect()];
        let (cos, sin) = rope_tables(&positions, &[1.0, 0.1, 0.01, 0.001], &Device::Cpu, DType::F32)?;
        let x = Tensor::from_vec(pseudo(b * s * n * d, 3), (b * s, n * d), &Device::Cpu)?.to_dtype(DType::BF16)?;
        let y = rope_heads(Kernels::Portable, &x, n, &cos, &sin)?;
        assert_eq!((y.dtype(), y.dims()), (DType::BF16, &[b, n, s, d][..]));
        let want = rope_heads(Kernels::Auto, &x.to_dtype(DType::F32)?, n, &cos, &sin)?;
        let d = max_diff(&y, &want)?;
        println!("bf16 rope vs f32: max |diff| {d:.1e}");
        assert!(d < 3.0 * 2f32.powi(-8), "{d}");
        Ok(())
    }
}
