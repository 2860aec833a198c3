//! The allocator of every ferrolm program: mimalloc, keeping freed memory for reuse.
//!
//! A training step allocates and frees the same large buffers every step (activations, logits,
//! gradients: megabytes each on the CPU backend). An allocator that hands freed memory back to
//! the kernel gets fresh pages the next step, and the kernel zeroes each of them on first touch:
//! on the `tiny` CPU benchmark that was a fifth of the profile (`clear_page_erms`), and 1.0 s of
//! system time in 3.7 s (glibc malloc, or mimalloc with its default purge delay) against 0.25 s
//! with purging off. So purging is off: the process keeps its peak, which is the memory a
//! training run needs at every step anyway.
use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicBool, Ordering};

/// mimalloc 3's `mi_option_purge_delay` (mimalloc.h, `mi_option_e`; libmimalloc-sys names no
/// constant for it): milliseconds before freed memory is purged, -1 for never.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

static TUNED: AtomicBool = AtomicBool::new(false);

/// mimalloc with purging off, set on the first allocation.
pub struct Allocator;

#[inline]
fn tune() {
    if !TUNED.load(Ordering::Relaxed) && !TUNED.swap(true, Ordering::AcqRel) {
        // SAFETY: sets one option's value; it allocates nothing, and the option is read on each
        // purge, so setting it after mimalloc started is valid.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    }
}

/// The purge delay mimalloc runs with (for the test below and for diagnostics).
pub fn purge_delay() -> i64 {
    // SAFETY: reads one option.
    unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) as i64 }
}

// SAFETY: every call forwards to mimalloc's GlobalAlloc with the same arguments.
unsafe impl GlobalAlloc for Allocator {
    #[inline]
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        tune();
        mimalloc::MiMalloc.alloc(l)
    }
    #[inline]
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        tune();
        mimalloc::MiMalloc.alloc_zeroed(l)
    }
    #[inline]
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        mimalloc::MiMalloc.dealloc(p, l)
    }
    #[inline]
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        mimalloc::MiMalloc.realloc(p, l, new)
    }
}

#[cfg(test)]
mod tests {
    /// This process's resident memory in bytes (`/proc/self/statm`).
    fn resident() -> i64 {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
        let pages: i64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
        // SAFETY: sysconf reads a constant of the system.
        pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as i64
    }

    /// Allocates and touches a 64 MiB buffer, frees it, and returns how much resident memory
    /// the free gave back to the kernel.
    fn returned_by_free() -> i64 {
        let layout = std::alloc::Layout::from_size_align(64 << 20, 64).unwrap();
        // SAFETY: a non-zero-sized layout; every write is inside the allocation, which is freed
        // with the same layout. No byte is read.
        unsafe {
            let p = std::alloc::alloc(layout);
            assert!(!p.is_null());
            for i in (0..layout.size()).step_by(4096) {
                p.add(i).write_volatile(1);
            }
            let before = resident();
            std::alloc::dealloc(p, layout);
            before - resident()
        }
    }

    /// Index 15 is the purge delay, and the allocator's -1 keeps freed memory: with immediate
    /// purging (0) freeing a touched 64 MiB buffer hands most of it back to the kernel (to be
    /// faulted in and zeroed again on reuse); with -1 the memory stays resident for reuse.
    /// Resident bytes, not page faults, so the check holds with and without huge pages.
    #[test]
    fn freed_memory_is_kept_for_reuse() {
        returned_by_free();
        assert_eq!(super::purge_delay(), -1, "the allocator set no purge delay");
        // SAFETY: sets one option (see `tune`).
        let set = |v| unsafe { libmimalloc_sys::mi_option_set(super::MI_OPTION_PURGE_DELAY, v) };
        set(0);
        let purged = returned_by_free();
        set(-1);
        let kept = returned_by_free();
        assert!(purged > 32 << 20, "{purged} bytes returned with immediate purging: index 15 is not the purge delay");
        assert!(kept < 16 << 20, "{kept} bytes of a freed 64 MiB buffer returned to the kernel ({purged} when purging)");
    }
}
