//! Run-time detection of the CPU's bf16 units, in one place for the two users that cannot
//! share a crate: `bf16_gemm` (which kernel runs) and `build.rs` (which kernel tests are
//! ignored on this machine), which includes this file by path. No crate imports here.

/// AMX-BF16 and AMX-TILE per CPUID, and Linux's permission to use the tile data
/// (arch_prctl ARCH_REQ_XCOMP_PERM), which a kernel without AMX support or a sandbox refuses.
#[cfg(target_arch = "x86_64")]
pub fn amx_detect_and_enable() -> bool {
    // CPUID.(7,0):EDX bit 22 = AMX-BF16, bit 24 = AMX-TILE.
    let leaf = std::arch::x86_64::__cpuid_count(7, 0);
    if leaf.edx & (1 << 22) == 0 || leaf.edx & (1 << 24) == 0 {
        return false;
    }
    #[cfg(target_os = "linux")]
    {
        const SYS_ARCH_PRCTL: usize = 158;
        const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
        const XFEATURE_XTILEDATA: usize = 18;
        let ret: isize;
        // SAFETY: a plain Linux syscall; it only changes this process's XSAVE permissions.
        unsafe {
            std::arch::asm!("syscall",
                inlateout("rax") SYS_ARCH_PRCTL as isize => ret,
                in("rdi") ARCH_REQ_XCOMP_PERM, in("rsi") XFEATURE_XTILEDATA,
                lateout("rcx") _, lateout("r11") _, options(nostack));
        }
        ret == 0
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

/// AVX512-BF16 (with AVX512F).
#[cfg(target_arch = "x86_64")]
pub fn avx512_bf16() -> bool {
    std::arch::is_x86_feature_detected!("avx512bf16") && std::arch::is_x86_feature_detected!("avx512f")
}

#[cfg(not(target_arch = "x86_64"))]
pub fn amx_detect_and_enable() -> bool {
    false
}

#[cfg(not(target_arch = "x86_64"))]
pub fn avx512_bf16() -> bool {
    false
}
