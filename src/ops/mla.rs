//! MLA's attention operands from its projections: q, k and v in the heads-first layout the
//! attention op takes, each RoPE-rotated where it should be and padded to one head width.
//!
//! Dimensions: B micro-batch rows, S sequence, N = B·S tokens, NH heads, Dn / Dr the q/k
//! head's nope and rope parts (Dk = Dn + Dr), Dv the v head, C the kv latent, W = max(Dk, Dv)
//! the width the attention op runs at (the shorter operand zero padded).
//!
//!   q [B, NH, S, W] = q_nope | rope(q_rope)        from q [N, NH·Dk]
//!   k [B, NH, S, W] = k_nope | rope(k_rope)        k_nope from kv [N, NH·(Dn+Dv)], k_rope
//!                                                  from ckv [N, C+Dr], one for every head
//!   v [B, NH, S, W] = v | 0                        from kv
//!
//! Why an op: built from candle ops (the portable path, what CUDA runs) these are per layer
//! two head splits, five narrows, two RoPEs of six nodes each (plus an index_select when the
//! pairs are interleaved), a broadcast, two concatenations and a zero pad: each a copy in the
//! forward, and in the backward each narrow's gradient is a zero-padded copy of its input's
//! size and each node's gradient a zeroed buffer plus an add (candle's `or_insert`). On
//! DeepSeek-V2-Lite's shapes that glue was ~5% of a 1 x 512 MoE step on two cores, most of
//! it on one thread. Here each operand is one op over its rows whose backward writes each
//! input's gradient once (the shared k_rope's summed over heads). The same sums: the
//! rotation's products and differences are the portable path's, bit for bit.

use super::rope::Rotation;
use super::{cpu_f32, f32_elems, par_zeroed, Kernels, Op, Path};
use candle_core::{Result, Tensor};

/// MLA's head dims (the config's, per layer).
#[derive(Clone, Copy, Debug)]
pub struct MlaHeads {
    /// NH
    pub heads: usize,
    /// Dn
    pub nope: usize,
    /// Dr
    pub rope: usize,
    /// Dv
    pub v: usize,
    /// C: kv_a_proj_with_mqa's output is the latent [C] then the shared k_rope [Dr].
    pub latent: usize,
    /// RoPE on interleaved pairs (DeepSeek's checkpoints): the rope dims are taken evens
    /// first, then odds, and rotated as halves (see `model::deepseek`'s note).
    pub interleaved: bool,
}

impl MlaHeads {
    /// W: the head width q, k and v are padded to.
    pub fn width(&self) -> usize {
        (self.nope + self.rope).max(self.v)
    }
}

/// q [N, NH·Dk] -> [B, NH, S, W]: each head's nope part, then its rope part rotated, then
/// zeros. cos/sin are [B, 1, S, Dr].
pub fn q_heads(k: Kernels, q: &Tensor, d: &MlaHeads, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, s) = check(q, d.heads * (d.nope + d.rope), d, cos, sin, "q")?;
    match k.pick(Op::Heads, q, &[]) {
        Path::Fused => {
            let pieces = vec![Piece { src: 0, at: 0, per_head: d.nope + d.rope, len: d.nope, dst: 0, rope: false }, Piece { src: 0, at: d.nope, per_head: d.nope + d.rope, len: d.rope, dst: d.nope, rope: true }];
            let op = Assemble::new((b, s, d.heads, d.width()), vec![d.heads * (d.nope + d.rope)], pieces, d, cos, sin)?;
            q.contiguous()?.apply_op1(op)
        }
        Path::Portable => {
            let q = super::split_heads(k, q, b, s, d.heads)?; // [B, NH, S, Dk]
            let q_rope = portable_rope(&q.narrow(3, d.nope, d.rope)?, d, cos, sin)?; // [B, NH, S, Dr]
            pad(&Tensor::cat(&[&q.narrow(3, 0, d.nope)?, &q_rope], 3)?, d.width()) // [B, NH, S, W]
        }
    }
}

/// kv [N, NH·(Dn+Dv)] and ckv [N, C+Dr] -> (k, v) [B, NH, S, W] each: k is each head's
/// k_nope, then ckv's k_rope rotated (the same for every head), then zeros; v is each head's
/// v, then zeros.
pub fn kv_heads(k: Kernels, kv: &Tensor, ckv: &Tensor, d: &MlaHeads, cos: &Tensor, sin: &Tensor) -> Result<(Tensor, Tensor)> {
    let (b, s) = check(kv, d.heads * (d.nope + d.v), d, cos, sin, "kv")?;
    if ckv.dims() != [b * s, d.latent + d.rope] {
        candle_core::bail!("mla-heads: ckv {:?} is not [{}, {} latent + {} rope]", ckv.dims(), b * s, d.latent, d.rope);
    }
    let per_head = d.nope + d.v;
    match k.pick(Op::Heads, kv, &[]) {
        Path::Fused => {
            let dims = (b, s, d.heads, d.width());
            let k_pieces = vec![Piece { src: 0, at: 0, per_head, len: d.nope, dst: 0, rope: false }, Piece { src: 1, at: d.latent, per_head: 0, len: d.rope, dst: d.nope, rope: true }];
            let k_op = Assemble::new(dims, vec![d.heads * per_head, d.latent + d.rope], k_pieces, d, cos, sin)?;
            let v_op = Assemble::new(dims, vec![d.heads * per_head], vec![Piece { src: 0, at: d.nope, per_head, len: d.v, dst: 0, rope: false }], d, cos, sin)?;
            let kv = kv.contiguous()?;
            Ok((kv.apply_op2(&ckv.contiguous()?, k_op)?, kv.apply_op1(v_op)?))
        }
        Path::Portable => {
            let k_rope = ckv.narrow(1, d.latent, d.rope)?.reshape((b, 1, s, d.rope))?; // [B, 1, S, Dr]: one rope key for all heads
            let k_rope = portable_rope(&k_rope, d, cos, sin)?.broadcast_as((b, d.heads, s, d.rope))?; // [B, NH, S, Dr]
            let kv = super::split_heads(k, kv, b, s, d.heads)?; // [B, NH, S, Dn+Dv]
            let key = pad(&Tensor::cat(&[&kv.narrow(3, 0, d.nope)?, &k_rope], 3)?, d.width())?; // [B, NH, S, W]
            Ok((key, pad(&kv.narrow(3, d.nope, d.v)?, d.width())?)) // v [B, NH, S, W]
        }
    }
}

/// (B, S) of the tables, after checking that x is [B·S, `cols`] and cos/sin [B, 1, S, Dr].
fn check(x: &Tensor, cols: usize, d: &MlaHeads, cos: &Tensor, sin: &Tensor, what: &str) -> Result<(usize, usize)> {
    let (b, _, s, dr) = cos.dims4()?;
    if x.dims() != [b * s, cols] || dr != d.rope || sin.dims() != cos.dims() || !d.rope.is_multiple_of(2) {
        candle_core::bail!("mla-heads: {what} {:?} is not [{}, {cols}] for cos/sin {:?}/{:?} and {d:?}", x.dims(), b * s, cos.dims(), sin.dims());
    }
    Ok((b, s))
}

/// RoPE from candle ops on x [B, n, S, Dr], the interleaved pairs taken evens first.
fn portable_rope(x: &Tensor, d: &MlaHeads, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let x = if d.interleaved {
        let perm: Vec<u32> = (0..d.rope as u32).step_by(2).chain((1..d.rope as u32).step_by(2)).collect();
        x.contiguous()?.index_select(&Tensor::from_vec(perm, d.rope, x.device())?, 3)? // [B, n, S, Dr]
    } else {
        x.clone()
    };
    super::rope::rope(&x, cos, sin)
}

/// t [B, n, S, D] zero padded to [B, n, S, W].
fn pad(t: &Tensor, width: usize) -> Result<Tensor> {
    let (b, n, s, d) = t.dims4()?;
    if d == width {
        return Ok(t.clone());
    }
    Tensor::cat(&[t, &Tensor::zeros((b, n, s, width - d), t.dtype(), t.device())?], 3)
}

/// `len` columns of an output row [W] from `dst` on: columns `at + head · per_head ..` of
/// source `src`'s token row (`per_head` 0: the same columns for every head), rotated when
/// `rope`.
#[derive(Clone, Copy, Debug)]
struct Piece {
    src: usize,
    at: usize,
    per_head: usize,
    len: usize,
    dst: usize,
    rope: bool,
}

/// One operand [B, NH, S, W] assembled from the pieces of one or two sources' token rows.
struct Assemble {
    /// (B, S, NH, W)
    dims: (usize, usize, usize, usize),
    /// Each source's row length (its columns per token).
    cols: Vec<usize>,
    pieces: Vec<Piece>,
    /// For the pieces that rotate (None where none does).
    rot: Option<Rotation>,
}

impl Assemble {
    fn new(dims: (usize, usize, usize, usize), cols: Vec<usize>, pieces: Vec<Piece>, d: &MlaHeads, cos: &Tensor, sin: &Tensor) -> Result<Self> {
        let rot = if pieces.iter().any(|p| p.rope) { Some(Rotation::new(cos, sin, d.interleaved)?) } else { None };
        Ok(Assemble { dims, cols, pieces, rot })
    }

    /// The operand from the sources' elements.
    fn forward(&self, srcs: &[&[f32]]) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (b, s, nh, w) = self.dims;
        for (j, (src, &cols)) in srcs.iter().zip(&self.cols).enumerate() {
            if src.len() != b * s * cols {
                candle_core::bail!("mla-heads: source {j} has {} elements for [{}, {cols}]", src.len(), b * s);
            }
        }
        // One output row [W] per task: row (b, n, s) of [B, NH, S, W], token b·S + s.
        let out = par_zeroed(b * nh * s * w, w.max(1), |row, o: &mut [f32]| {
            let (head, tok) = (row / s % nh, row / (nh * s) * s + row % s);
            for p in &self.pieces {
                let x = &srcs[p.src][tok * self.cols[p.src] + p.at + head * p.per_head..][..p.len];
                let o = &mut o[p.dst..][..p.len];
                match &self.rot {
                    Some(rot) if p.rope => rot.rotate(x, o, tok),
                    _ => o.copy_from_slice(x),
                }
            }
        });
        Ok((candle_core::CpuStorage::F32(out), candle_core::Shape::from((b, nh, s, w))))
    }

    /// Source `j`'s gradient [N, cols] from the operand's g [B, NH, S, W]: one token row per
    /// task, its heads in order (a shared piece sums over them).
    fn backward(&self, g: &[f32], j: usize) -> Vec<f32> {
        let (b, s, nh, w) = self.dims;
        let cols = self.cols[j];
        par_zeroed(b * s * cols, cols.max(1), |tok, dx: &mut [f32]| {
            for head in 0..nh {
                let row = &g[((tok / s * nh + head) * s + tok % s) * w..][..w];
                for p in self.pieces.iter().filter(|p| p.src == j) {
                    let (g, dx) = (&row[p.dst..][..p.len], &mut dx[p.at + head * p.per_head..][..p.len]);
                    match &self.rot {
                        Some(rot) if p.rope => rot.unrotate_add(g, dx, tok),
                        _ => dx.iter_mut().zip(g).for_each(|(d, &v)| *d += v),
                    }
                }
            }
        })
    }
}

impl candle_core::CustomOp1 for Assemble {
    fn name(&self) -> &'static str {
        "mla-heads"
    }

    fn cpu_fwd(&self, s1: &candle_core::CpuStorage, l1: &candle_core::Layout) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        self.forward(&[cpu_f32("mla-heads", s1, l1)?])
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let g = f32_elems(grad)?;
        Ok(Some(Tensor::from_vec(self.backward(&g, 0), arg.shape(), arg.device())?))
    }
}

impl candle_core::CustomOp2 for Assemble {
    fn name(&self) -> &'static str {
        "mla-heads"
    }

    fn cpu_fwd(&self, s1: &candle_core::CpuStorage, l1: &candle_core::Layout, s2: &candle_core::CpuStorage, l2: &candle_core::Layout) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        self.forward(&[cpu_f32("mla-heads", s1, l1)?, cpu_f32("mla-heads", s2, l2)?])
    }

    fn bwd(&self, a1: &Tensor, a2: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = f32_elems(grad)?;
        let d1 = Tensor::from_vec(self.backward(&g, 0), a1.shape(), a1.device())?;
        let d2 = Tensor::from_vec(self.backward(&g, 1), a2.shape(), a2.device())?;
        Ok((Some(d1), Some(d2)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::rope_tables;
    use crate::ops::testutil::pseudo;
    use candle_core::{DType, Device, Var};

    /// The fused ops against the portable candle ops, in value and in the gradients of q, kv
    /// and ckv for a fixed upstream gradient of each operand: interleaved pairs or not, v
    /// narrower than q/k (V2's shapes) and wider (padding q and k instead), two rows with
    /// their own positions.
    #[test]
    fn fused_mla_heads_match_the_portable_ops_in_value_and_gradients() -> Result<()> {
        let dev = Device::Cpu;
        let (b, s) = (2, 5);
        let positions: Vec<Vec<u32>> = vec![(0..5).collect(), vec![3, 4, 0, 1, 2]];
        for (nope, v, interleaved) in [(6, 4, true), (6, 4, false), (2, 12, true)] {
            let d = MlaHeads { heads: 3, nope, rope: 4, v, latent: 5, interleaved };
            let (cos, sin) = rope_tables(&positions, &[1.0, 0.1], &dev, DType::F32)?;
            let var = |cols: usize, seed| Var::from_vec(pseudo(b * s * cols, seed), (b * s, cols), &dev);
            let (q, kv, ckv) = (var(d.heads * (nope + d.rope), 1)?, var(d.heads * (nope + v), 2)?, var(d.latent + d.rope, 3)?);
            let run = |kern: Kernels| -> Result<(Vec<Tensor>, Vec<Tensor>)> {
                let qh = q_heads(kern, &q, &d, &cos, &sin)?;
                let (kh, vh) = kv_heads(kern, &kv, &ckv, &d, &cos, &sin)?;
                let mut loss = Tensor::zeros((), DType::F32, &dev)?;
                for (i, t) in [&qh, &kh, &vh].into_iter().enumerate() {
                    assert_eq!(t.dims(), [b, d.heads, s, d.width()], "{kern:?} operand {i}");
                    let g = Tensor::from_vec(pseudo(t.elem_count(), 10 + i), t.dims(), &dev)?;
                    loss = (loss + (t * g)?.sum_all()?)?;
                }
                let grads = loss.backward()?;
                let get = |v: &Var| grads.get(v).cloned().ok_or_else(|| candle_core::Error::Msg("no gradient".into()));
                Ok((vec![qh, kh, vh], vec![get(&q)?, get(&kv)?, get(&ckv)?]))
            };
            let (fused, portable) = (run(Kernels::Auto)?, run(Kernels::Portable)?);
            for (i, (a, p)) in fused.0.iter().zip(&portable.0).enumerate() {
                assert_eq!(crate::ops::testutil::max_diff(a, p)?, 0.0, "{d:?}: operand {i} differs");
            }
            for (i, (a, p)) in fused.1.iter().zip(&portable.1).enumerate() {
                let diff = crate::ops::testutil::max_diff(a, p)?;
                println!("{d:?}: gradient {i} max |diff| {diff:.1e}");
                // The shared k_rope's gradient sums over heads in another order (measured at
                // most 2.4e-7 on Zen 4); q's and kv's are the same bits.
                assert!(if i == 2 { diff < 4e-7 } else { diff == 0.0 }, "{d:?}: gradient {i} differs by {diff}");
            }
        }
        Ok(())
    }

    #[test]
    fn a_kv_of_the_wrong_width_is_an_error_naming_it() -> Result<()> {
        let dev = Device::Cpu;
        let d = MlaHeads { heads: 2, nope: 4, rope: 2, v: 4, latent: 3, interleaved: false };
        let (cos, sin) = rope_tables(&[vec![0, 1]], &[1.0], &dev, DType::F32)?;
        let kv = Tensor::zeros((2, 15), DType::F32, &dev)?;
        let ckv = Tensor::zeros((2, 5), DType::F32, &dev)?;
        let err = kv_heads(Kernels::Auto, &kv, &ckv, &d, &cos, &sin).unwrap_err().to_string();
        assert!(err.contains("kv [2, 15] is not [2, 16]"), "{err}");
        Ok(())
    }
}
