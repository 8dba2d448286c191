//! Build-time facts about the machine the tests will run on (its CPU, its kernel), for tests only.
//!
//! The bf16 GEMM (`src/ops/bf16_gemm.rs`) picks AMX or AVX512-BF16 at run time, and that
//! stays so: this script changes no code path. It lets the tests of those kernels be
//! *ignored* on a CPU without them (`cargo test` then reports them as ignored, with the
//! reason) instead of passing after printing a note, which reads as tested when nothing was.
//!
//! cfgs emitted (only when building for the machine this script runs on):
//! - `bf16_amx`: AMX-BF16 and AMX-TILE, and Linux grants tile permission;
//! - `bf16_avx512`: AVX512-BF16 (with AVX512F);
//! - `bf16_unit`: the process-wide kernel (`bf16_gemm::kernel()`) will be one of them:
//!   AVX512-BF16, or AMX unless `FINETUNE_NO_AMX` is set;
//! - `bf16_dot`: that kernel will be AVX512-BF16's dot kernel (no AMX, or `FINETUNE_NO_AMX`),
//!   for the tests of what only it has (token rows rounded once for many GEMMs);
//! - `avx2_fma`: AVX2 and FMA, which the few-row f32 kernels (`src/ops/few_rows.rs`) need;
//! - `thp`: the kernel has transparent huge pages (`src/alloc.rs` asks for them).
//!
//! Build scripts run natively on the build machine, so detection here is detection there.
//! Cargo reruns this when /proc/cpuinfo changes (its mtime is the boot's, and a work tree
//! moves between machines with different CPUs) or when `FINETUNE_NO_AMX` does.

fn main() {
    for cfg in ["bf16_unit", "bf16_amx", "bf16_avx512", "bf16_dot", "avx2_fma", "thp"] {
        println!("cargo::rustc-check-cfg=cfg({cfg})");
    }
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=src/ops/cpu_bf16.rs");
    println!("cargo::rerun-if-changed=/proc/cpuinfo");
    println!("cargo::rerun-if-env-changed=FINETUNE_NO_AMX");
    // Cross builds: this CPU says nothing about the target's.
    if std::env::var("HOST").ok() != std::env::var("TARGET").ok() {
        return;
    }
    if std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists() {
        println!("cargo::rustc-cfg=thp");
    }
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        println!("cargo::rustc-cfg=avx2_fma");
    }
    let amx = cpu_bf16::amx_detect_and_enable();
    let avx512 = cpu_bf16::avx512_bf16();
    if amx {
        println!("cargo::rustc-cfg=bf16_amx");
    }
    if avx512 {
        println!("cargo::rustc-cfg=bf16_avx512");
    }
    let amx_on = amx && std::env::var_os("FINETUNE_NO_AMX").is_none();
    if avx512 || amx_on {
        println!("cargo::rustc-cfg=bf16_unit");
    }
    if avx512 && !amx_on {
        println!("cargo::rustc-cfg=bf16_dot");
    }
}

// The detection bf16_gemm runs, shared by path so the two cannot drift apart.
#[path = "src/ops/cpu_bf16.rs"]
mod cpu_bf16;
