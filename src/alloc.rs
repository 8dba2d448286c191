//! How the process allocates: the binary's global allocator and glibc's settings.
//!
//! A training step allocates and frees the same few hundred large tensors every step, and
//! the GEMMs stream through them. Two things about that are the allocator's business:
//! - glibc serves big allocations with fresh mmaps and trims freed heap back to the OS, so
//!   every step paid for zeroed pages again (page faults and clearing were ~10% of a step's
//!   samples). [`tune`] serves tensors up to 32 MB (glibc's maximum) from the heap and keeps
//!   freed memory for reuse; peak RSS does not grow, since the same sizes come back every step.
//! - With 4 KB pages, an op streaming through a multi-megabyte tensor walks the page tables
//!   every 4 KB. Most Linux machines (this project's included) leave transparent huge pages
//!   to `madvise`, so nothing gets them unless asked. [`HugePages`] asks for the heap and for
//!   every block of 2 MB and more: a SmolLM2 1 x 512 step then holds ~550 of its ~600 MB in
//!   huge pages (0 before), at the same peak RSS (the pages of a big tensor are all written
//!   anyway). Its speed effect is small next to a noisy VM's: on a 2-core AVX2 EPYC,
//!   glibc's own tunable for the same thing ran 1-10% faster in 3 of 3 alternating rounds,
//!   this allocator 1% faster on average over 6 rounds whose spread was 30%. PyTorch's CPU
//!   allocator does not ask by default (`THP_MEM_ALLOC_ENABLE`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The x86-64 PMD size: a transparent huge page.
const HUGE: usize = 2 << 20;

/// How much the heap grows at a time beyond what an allocation needs (glibc's M_TOP_PAD,
/// 128 KB by default). A growth is advised right after the allocation that made it, but glibc
/// has by then written the new top chunk's header past that allocation: the 2 MB page holding
/// it stays in small pages. Growing 32 MB at a time loses one such page per 32 MB. Untouched,
/// the padding costs no memory.
const TOP_PAD: usize = 32 << 20;

/// How far the heap (the main arena's brk area) has been advised: 0 before `tune`.
static HEAP_ADVISED: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, asking the kernel to back the heap and every large block with
/// transparent huge pages (`madvise(MADV_HUGEPAGE)` on their whole 2 MB pages) before anything
/// touches them, as glibc's own `glibc.malloc.hugetlb=1` tunable does (which can only be set
/// in the environment before the process starts). Only advice: where huge pages are off
/// (`never`) or unavailable it changes nothing, and memory touched before the advice keeps
/// its small pages until the kernel collapses them.
pub struct HugePages;

impl HugePages {
    fn advise(ptr: *mut u8, size: usize) {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        if !ptr.is_null() {
            // A block of its own (glibc mmaps those over 32 MB, see `tune`), or part of the heap.
            if size >= HUGE {
                madvise_huge(ptr as usize, ptr as usize + size);
            }
            // The heap grew since the last look: advise the new part before the caller writes
            // it (brk gives the growth a VMA of its own, without the flag). Every allocation
            // looks, since any may grow the heap; the look reads two words.
            // SAFETY: sbrk(0) only reads the current break.
            let top = unsafe { libc::sbrk(0) } as usize;
            let done = HEAP_ADVISED.load(Ordering::Relaxed);
            let upto = top & !(HUGE - 1);
            if done != 0 && upto > done && HEAP_ADVISED.compare_exchange(done, upto, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
                madvise_huge(done, upto);
            }
        }
    }
}

/// Asks for huge pages on the whole 2 MB pages within [from, to).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn madvise_huge(from: usize, to: usize) {
    let start = from.next_multiple_of(HUGE);
    let end = to & !(HUGE - 1);
    if end > start {
        // SAFETY: [start, end) lies inside memory mapped to us (an allocated block, or the heap
        // below its break); madvise only sets a flag on the mapping (errors are ignored: it is
        // advice).
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
}

// SAFETY: every call is forwarded to `System` unchanged; `advise` only adds a flag to pages
// of the block returned.
unsafe impl GlobalAlloc for HugePages {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        Self::advise(p, layout.size());
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // calloc of fresh memory does not write it (it is zero already), so the advice still
        // comes before the first touch there.
        let p = unsafe { System.alloc_zeroed(layout) };
        Self::advise(p, layout.size());
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        Self::advise(p, new_size);
        p
    }
}

/// glibc's settings for the step's allocation pattern (the module's first point). Call once,
/// before any thread starts.
pub fn tune() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_TOP_PAD, TOP_PAD as i32);
        HEAP_ADVISED.store(libc::sbrk(0) as usize, Ordering::Relaxed);
    }
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    /// The VmFlags line of /proc/self/smaps for the mapping holding `addr`.
    fn vm_flags(addr: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((lo, hi)) = range.split_once('-') {
                    if let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)) {
                        inside = (lo..hi).contains(&addr);
                        continue;
                    }
                }
            }
            if inside && line.starts_with("VmFlags:") {
                return line.to_string();
            }
        }
        panic!("no mapping holds {addr:#x}");
    }

    #[test]
    #[cfg_attr(not(thp), ignore = "this kernel has no transparent huge pages (build.rs found none)")]
    fn a_large_block_asks_for_huge_pages_and_a_small_one_does_not() {
        assert!(std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists(), "build.rs found transparent huge pages but this process sees none");
        let big = Layout::from_size_align(8 << 20, 64).unwrap();
        // SAFETY: a non-zero size; freed below with the same layout.
        let p = unsafe { HugePages.alloc(big) };
        assert!(!p.is_null());
        let page = (p as usize).next_multiple_of(HUGE);
        assert!(vm_flags(page).contains(" hg"), "{}", vm_flags(page));
        // SAFETY: allocated above with this layout.
        unsafe { HugePages.dealloc(p, big) };
        // A block smaller than a huge page holds none: nothing to ask for (glibc serves it from
        // a heap this test process never advised, since `tune` does not run here).
        let small = Layout::from_size_align(256 << 10, 64).unwrap();
        // SAFETY: as above.
        let q = unsafe { HugePages.alloc(small) };
        assert!(!vm_flags(q as usize).contains(" hg"), "{}", vm_flags(q as usize));
        // SAFETY: as above.
        unsafe { HugePages.dealloc(q, small) };
    }
}
