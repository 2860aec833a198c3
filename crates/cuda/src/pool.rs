//! Stream-ordered pooled device memory. Every buffer is used on the compute stream, so a freed
//! block goes straight back to a size-class free list and the next allocation on that stream may
//! reuse it: stream order guarantees the old kernels ran first. Steady-state training does no
//! cuMemAlloc at all. Work on another stream that touches a buffer must be ordered with events
//! (record on that stream, wait on the compute stream) before the buffer is dropped.
//! On the emulated device the blocks are host allocations (256-byte aligned) and the same
//! bookkeeping applies, so pool statistics are tested without a GPU too.
use crate::err;
use cudarc::driver::{result, sys, CudaContext};
use ferrolm_tensor::Result;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Size classes: 4 steps per power of two above 512 bytes (at most 25% waste). `None` when the
/// class would not fit `isize` (no allocator can serve it, and the rounding would overflow).
fn size_class(bytes: usize) -> Option<usize> {
    let b = bytes.max(512);
    let p = usize::BITS - 1 - b.leading_zeros(); // floor(log2 b)
    let step = (1usize << p) / 4;
    b.div_ceil(step).checked_mul(step).filter(|&c| c <= isize::MAX as usize)
}

#[derive(Default)]
struct Lists {
    free: HashMap<usize, Vec<sys::CUdeviceptr>>,
    current: usize,
    peak: usize,
    /// The largest block handed out since the peak was last reset.
    largest: usize,
    cached: usize,
    /// cuMemAlloc calls so far (successful ones).
    mallocs: usize,
}

/// Where the blocks come from.
pub enum Mem {
    Gpu(Arc<CudaContext>),
    /// Host memory standing in for device memory (the emulator).
    Host,
}

const HOST_ALIGN: usize = 256;

impl Mem {
    fn malloc(&self, bytes: usize) -> std::result::Result<sys::CUdeviceptr, String> {
        match self {
            Mem::Gpu(ctx) => {
                ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
                // SAFETY: cuMemAlloc of `bytes` (a size class, > 0) on the context bound above; the
                // memory is uninitialised until written, and no Rust reference is made to it.
                unsafe { result::malloc_sync(bytes) }.map_err(|e| format!("{e:?}"))
            }
            Mem::Host => {
                let l = std::alloc::Layout::from_size_align(bytes, HOST_ALIGN).map_err(|e| e.to_string())?;
                // SAFETY: `l` has a non-zero size (size classes are >= 512 bytes) and a valid
                // alignment (checked by from_size_align above).
                let p = unsafe { std::alloc::alloc(l) };
                if p.is_null() {
                    return Err("host allocation failed".into());
                }
                Ok(p as sys::CUdeviceptr)
            }
        }
    }
    fn free(&self, ptr: sys::CUdeviceptr, bytes: usize) {
        match self {
            Mem::Gpu(_) => {
                // SAFETY: `ptr` came from malloc_sync (pool blocks are only ever made there) and
                // sits in a free list, so no live DevBuf refers to it; callers synchronise the
                // streams before trimming, so no queued kernel still uses it.
                let _ = unsafe { result::free_sync(ptr) };
            }
            // SAFETY: `ptr` came from `alloc` above with size `bytes` (its size class, which is
            // what free lists are keyed by) and HOST_ALIGN, a layout that was valid then.
            Mem::Host => unsafe { std::alloc::dealloc(ptr as *mut u8, std::alloc::Layout::from_size_align_unchecked(bytes, HOST_ALIGN)) },
        }
    }
    fn synchronize(&self) -> Result<()> {
        match self {
            Mem::Gpu(ctx) => ctx.synchronize().map_err(err("alloc")),
            Mem::Host => Ok(()),
        }
    }
}

pub struct Pool {
    mem: Mem,
    lists: Mutex<Lists>,
}

pub struct DevBuf {
    pub ptr: sys::CUdeviceptr,
    pub class: usize,
    pool: Arc<Pool>,
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        self.pool.release(self.ptr, self.class);
    }
}
impl std::fmt::Debug for DevBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevBuf({:#x}, {} bytes)", self.ptr, self.class)
    }
}

impl Pool {
    pub fn new(mem: Mem) -> Arc<Self> {
        Arc::new(Pool { mem, lists: Mutex::new(Lists::default()) })
    }
    pub fn alloc(self: &Arc<Self>, bytes: usize) -> Result<DevBuf> {
        let class = size_class(bytes).ok_or_else(|| ferrolm_tensor::Error::new("alloc", format!("{bytes} bytes cannot be allocated")))?;
        {
            let mut l = self.lists.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(ptr) = l.free.get_mut(&class).and_then(|v| v.pop()) {
                l.cached -= class;
                l.current += class;
                l.peak = l.peak.max(l.current);
                l.largest = l.largest.max(class);
                return Ok(DevBuf { ptr, class, pool: self.clone() });
            }
        }
        let ptr = match self.mem.malloc(class) {
            Ok(p) => p,
            Err(_) => {
                // Out of memory: give the cached blocks back to the driver and retry once.
                self.mem.synchronize()?;
                self.trim();
                self.mem
                    .malloc(class)
                    .map_err(|e| ferrolm_tensor::Error::new("alloc", format!("out of device memory allocating {bytes} bytes: {e}")))?
            }
        };
        let mut l = self.lists.lock().unwrap_or_else(|e| e.into_inner());
        l.current += class;
        l.peak = l.peak.max(l.current);
        l.largest = l.largest.max(class);
        l.mallocs += 1;
        Ok(DevBuf { ptr, class, pool: self.clone() })
    }
    fn release(&self, ptr: sys::CUdeviceptr, class: usize) {
        let mut l = self.lists.lock().unwrap_or_else(|e| e.into_inner());
        l.current -= class;
        l.cached += class;
        l.free.entry(class).or_default().push(ptr);
    }
    /// Frees every cached (unused) block. The caller must have synchronised the streams.
    pub fn trim(&self) {
        let mut l = self.lists.lock().unwrap_or_else(|e| e.into_inner());
        if let Mem::Gpu(ctx) = &self.mem {
            let _ = ctx.bind_to_thread();
        }
        for (class, v) in l.free.drain() {
            for p in v {
                self.mem.free(p, class);
            }
        }
        l.cached = 0;
    }
    /// (bytes in live buffers, peak of that, bytes cached in free lists)
    pub fn stats(&self) -> (usize, usize, usize) {
        let l = self.lists.lock().unwrap_or_else(|e| e.into_inner());
        (l.current, l.peak, l.cached)
    }
    /// Number of driver allocations (cuMemAlloc) made so far.
    pub fn mallocs(&self) -> usize {
        self.lists.lock().unwrap_or_else(|e| e.into_inner()).mallocs
    }
    /// The largest block (its size class, bytes) handed out since `reset_peak`.
    pub fn largest(&self) -> usize {
        self.lists.lock().unwrap_or_else(|e| e.into_inner()).largest
    }
    pub fn reset_peak(&self) {
        let mut l = self.lists.lock().unwrap_or_else(|e| e.into_inner());
        l.peak = l.current;
        l.largest = 0;
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let _ = self.mem.synchronize();
        self.trim();
    }
}

#[cfg(test)]
mod tests {
    use super::size_class;
    #[test]
    fn size_classes_cover_the_request_with_bounded_waste() {
        for b in [0usize, 1, 511, 512, 513, 1000, 4096, 5000, 1 << 20, (1 << 20) + 1, 123_456_789] {
            let c = size_class(b).unwrap();
            assert!(c >= b && c >= 512);
            assert!(b < 512 || c as f64 <= b as f64 * 1.25 + 1.0, "{b} -> {c}");
        }
        assert_eq!(size_class(usize::MAX), None);
        assert_eq!(size_class(isize::MAX as usize), None);
    }
}
