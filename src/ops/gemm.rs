//! The strided f32 GEMM every fused kernel shares (attention strips, the frozen f32 matmul,
//! LoRA), on the gemm crate. The bf16 one is `bf16_gemm`.

/// `threads` threads (1 where the caller already runs in parallel). Strides are (row, column)
/// in elements, so transposed operands need no copy.
#[allow(clippy::too_many_arguments)]
pub fn sgemm(m: usize, n: usize, k: usize, dst: &mut [f32], dst_rs: usize, acc: bool, lhs: &[f32], lhs_rs: usize, lhs_cs: usize, rhs: &[f32], rhs_rs: usize, rhs_cs: usize, beta: f32, threads: usize) {
    // The slices must cover the strided extents the kernel reads and writes.
    let last = |rows: usize, rs: usize, cols: usize, cs: usize| if rows == 0 || cols == 0 { 0 } else { (rows - 1) * rs + (cols - 1) * cs + 1 };
    assert!(dst.len() >= last(m, dst_rs, n, 1) && lhs.len() >= last(m, lhs_rs, k, lhs_cs) && rhs.len() >= last(k, rhs_rs, n, rhs_cs));
    let par = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: the assert above bounds every element the kernel touches, dst does not alias
    // lhs or rhs (it is a distinct &mut), and all strides are in elements of f32.
    unsafe {
        gemm::gemm(
            m, n, k,
            dst.as_mut_ptr(), 1, dst_rs as isize, acc,
            lhs.as_ptr(), lhs_cs as isize, lhs_rs as isize,
            rhs.as_ptr(), rhs_cs as isize, rhs_rs as isize,
            if acc { 1.0 } else { 0.0 }, beta,
            false, false, false, par,
        );
    }
}
