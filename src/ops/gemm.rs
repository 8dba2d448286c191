//! The strided f32 GEMM every fused kernel shares (attention strips, the frozen f32 matmul,
//! LoRA, the widened bf16 matmul), on the gemm crate. The bf16 one is `bf16_gemm`.

/// `threads` threads (1 where the caller already runs in parallel). Strides are (row, column)
/// in elements, so transposed operands need no copy.
#[allow(clippy::too_many_arguments)]
pub fn sgemm(m: usize, n: usize, k: usize, dst: &mut [f32], dst_rs: usize, acc: bool, lhs: &[f32], lhs_rs: usize, lhs_cs: usize, rhs: &[f32], rhs_rs: usize, rhs_cs: usize, beta: f32, threads: usize) {
    assert!(dst.len() >= extent(m, dst_rs, n, 1));
    // SAFETY: dst covers the extent (asserted above) and, a distinct &mut, aliases neither
    // operand.
    unsafe { sgemm_ptr(m, n, k, dst.as_mut_ptr(), dst_rs, acc, lhs, lhs_rs, lhs_cs, rhs, rhs_rs, rhs_cs, beta, threads) }
}

/// Elements from the first to the last one of a strided [rows, cols] block (0 when empty).
pub(crate) fn extent(rows: usize, rs: usize, cols: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * rs + (cols - 1) * cs + 1
    }
}

/// [`sgemm`] into a destination given by pointer: a block of columns of a buffer whose other
/// columns other tasks write at the same time, which no `&mut` slice may describe.
///
/// # Safety
/// `dst` is valid for writes over `extent(m, dst_rs, n, 1)` elements, aliases neither
/// operand, and no other task touches the m x n elements it addresses while this runs.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn sgemm_ptr(m: usize, n: usize, k: usize, dst: *mut f32, dst_rs: usize, acc: bool, lhs: &[f32], lhs_rs: usize, lhs_cs: usize, rhs: &[f32], rhs_rs: usize, rhs_cs: usize, beta: f32, threads: usize) {
    // The operands must cover the strided extents the kernel reads.
    assert!(lhs.len() >= extent(m, lhs_rs, k, lhs_cs) && rhs.len() >= extent(k, rhs_rs, n, rhs_cs));
    let par = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: the assert above bounds every operand element the kernel reads, the caller
    // vouches for dst, and all strides are in elements of f32.
    unsafe {
        gemm::gemm(
            m, n, k,
            dst, 1, dst_rs as isize, acc,
            lhs.as_ptr(), lhs_cs as isize, lhs_rs as isize,
            rhs.as_ptr(), rhs_cs as isize, rhs_rs as isize,
            if acc { 1.0 } else { 0.0 }, beta,
            false, false, false, par,
        );
    }
}
