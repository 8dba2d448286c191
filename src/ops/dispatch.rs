//! The one place that decides which version of an op runs, per (device, dtype, op), and the
//! dtypes a run computes in: model, loss and op call sites pass a [`Kernels`] and are handed
//! the result. (`weights/` asks `is_cpu()` too, but only about where frozen tensors may stay:
//! row tables, a head read from its file, ggml rows cut on the host.)
//!
//! | op ([`Op`])    | CPU, f32 activations (`auto`)                     | CPU `portable`, CUDA (any dtype)               |
//! |----------------|---------------------------------------------------|------------------------------------------------|
//! | RmsNorm        | `norm::RmsNorm` op                                | candle ops, f32 inside                         |
//! | Heads          | `rope::Heads` op (move + rotate in one copy)      | reshape / transpose / rotate-half ops          |
//! | SwiGlu         | `mlp::SwiGlu` op                                  | `silu(g) * u`                                  |
//! | FrozenMlp      | `mlp::FrozenMlp` op (whole MLP half, frozen)      | none: the separate ops run                     |
//! | RoutedExperts  | `experts::RoutedExperts` op (all routed experts)  | none: the separate ops run                     |
//! | FrozenLinear   | `linear::FrozenMatmul`, gemm crate / bf16 unit / widened bf16 | `linear::FrozenMatmul`, backend matmul          |
//! | LoraLinear     | `linear::LoraMatmul` op                           | FrozenMatmul + adapter in f32 candle ops       |
//! | Attention      | `attention::CausalAttention` strips (f32 slices)  | `attention::PortableAttention` strips (ops)    |
//! | LossHead       | chunked, f32 or packed bf16 head                  | chunked, head in its own dtype, CE in f32      |
//!
//! The matmul families take the fused kernel only when the frozen weight is one it has a
//! kernel for: f32, or bf16 (on the bf16 unit where the CPU has one (AMX, AVX512-BF16),
//! else widened to f32 inside the f32 GEMM, `widen`).

use candle_core::{DType, Device, Tensor};

/// `model.kernels` in the recipe.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Kernels {
    /// The fused CPU kernels where they apply (CPU, f32 activations), the portable versions
    /// elsewhere (GPUs).
    #[default]
    Auto,
    /// The portable versions everywhere: on CPU, exactly the path a GPU takes, activations in
    /// the base's dtype included.
    Portable,
}

/// Which version of an op runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// The hand-written CPU kernel over f32 slices.
    Fused,
    /// Candle ops and backend calls: what CUDA runs.
    Portable,
}

/// The op families that have more than one version (ARCHITECTURE.md has a row for each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    RmsNorm,
    Heads,
    SwiGlu,
    FrozenMlp,
    RoutedExperts,
    FrozenLinear,
    LoraLinear,
    Attention,
    LossHead,
}

impl Op {
    /// Ops whose frozen weight must also suit the CPU kernel.
    fn has_weight(self) -> bool {
        matches!(self, Op::FrozenMlp | Op::RoutedExperts | Op::FrozenLinear | Op::LoraLinear | Op::LossHead)
    }
}

impl Kernels {
    /// The recipe spelling ("auto" | "portable").
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "auto" => Some(Kernels::Auto),
            "portable" => Some(Kernels::Portable),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kernels::Auto => "auto",
            Kernels::Portable => "portable",
        }
    }

    /// The version of `op` that runs on activations `x` with the op's frozen/adapter
    /// `weights` (empty for ops without one).
    pub fn pick(self, op: Op, x: &Tensor, weights: &[&Tensor]) -> Path {
        if self == Kernels::Portable || !x.device().is_cpu() || x.dtype() != DType::F32 {
            return Path::Portable;
        }
        if op.has_weight() && !weights.iter().all(|w| cpu_kernel_for(w)) {
            return Path::Portable;
        }
        Path::Fused
    }

    /// The dtype activations compute in for a base stored as `storage` on `device`: f32
    /// where the fused kernels run (they are f32 kernels, and candle's CPU half-precision ops
    /// convert to f32 anyway), the storage dtype on a GPU and on the portable path, which
    /// keeps bf16 activations with a bf16 base exactly as the CUDA path does.
    pub fn compute_dtype(self, storage: DType, device: &Device) -> DType {
        if self == Kernels::Auto && device.is_cpu() {
            DType::F32
        } else {
            storage
        }
    }

    /// Whether the fused ops run on `device`, so that checkpointing can keep what they hand
    /// over between forward and recomputation (`ops::checkpoint`).
    pub fn fused_on(self, device: &Device) -> bool {
        self == Kernels::Auto && device.is_cpu()
    }

    /// The dtype frozen projection weights reach `frozen_linear` in. With `auto` kernels on
    /// CPU a bf16 base keeps them bf16: on a CPU with a bf16 unit (AMX or AVX512-BF16) the
    /// matmul runs on it (what PyTorch does with a bf16 model; activations are rounded to
    /// bf16, sums stay f32); elsewhere the f32 GEMM widens them block by block (`widen`:
    /// f32 math on their exact values, half the memory of an f32 copy). `model.matmul =
    /// "f32"` opts out (weights converted to f32 as a layer is loaded). Everything else gets
    /// the compute dtype.
    pub fn matmul_dtype(self, policy: &str, storage: DType, compute: DType, device: &Device) -> DType {
        if policy == "auto" && self == Kernels::Auto && device.is_cpu() && storage == DType::BF16 && compute == DType::F32 {
            DType::BF16
        } else {
            compute
        }
    }
}

/// Whether the fused CPU kernels have a GEMM for this weight (or adapter) tensor.
fn cpu_kernel_for(w: &Tensor) -> bool {
    w.device().is_cpu() && matches!(w.dtype(), DType::F32 | DType::BF16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn portable_is_chosen_for_every_op_when_asked_and_for_non_f32_activations() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::zeros((2, 4), DType::F32, &dev)?;
        let w = Tensor::zeros((3, 4), DType::F32, &dev)?;
        let w16 = Tensor::zeros((3, 4), DType::F16, &dev)?;
        let ops = [Op::RmsNorm, Op::Heads, Op::SwiGlu, Op::FrozenMlp, Op::RoutedExperts, Op::FrozenLinear, Op::LoraLinear, Op::Attention, Op::LossHead];
        for op in ops {
            assert_eq!(Kernels::Auto.pick(op, &x, &[&w]), Path::Fused, "{op:?}");
            assert_eq!(Kernels::Portable.pick(op, &x, &[&w]), Path::Portable, "{op:?}");
            assert_eq!(Kernels::Auto.pick(op, &x.to_dtype(DType::BF16)?, &[&w]), Path::Portable, "{op:?}");
        }
        // An f16 weight has no CPU kernel: the matmul families go portable, the rest do not care.
        assert_eq!(Kernels::Auto.pick(Op::FrozenLinear, &x, &[&w16]), Path::Portable);
        assert_eq!(Kernels::Auto.pick(Op::RmsNorm, &x, &[&w16]), Path::Fused);
        assert_eq!(Kernels::Portable.compute_dtype(DType::BF16, &dev), DType::BF16);
        assert_eq!(Kernels::Auto.compute_dtype(DType::BF16, &dev), DType::F32);
        assert_eq!(Kernels::Portable.matmul_dtype("auto", DType::BF16, DType::BF16, &dev), DType::BF16);
        assert_eq!(Kernels::Auto.matmul_dtype("f32", DType::BF16, DType::F32, &dev), DType::F32);
        // A bf16 base keeps bf16 operands on every CPU (the bf16 unit, or widened f32 math).
        assert_eq!(Kernels::Auto.matmul_dtype("auto", DType::BF16, DType::F32, &dev), DType::BF16);
        assert_eq!(Kernels::Auto.pick(Op::FrozenLinear, &x, &[&w.to_dtype(DType::BF16)?]), Path::Fused);
        Ok(())
    }
}
