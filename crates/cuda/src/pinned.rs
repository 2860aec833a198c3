//! Page-locked host buffers and asynchronous copies between them and device storage, on any
//! stream (the copy streams that optimizer offload and checkpointing use). A buffer keeps what
//! completes its copies in flight (an event on a GPU), and every access to its bytes waits for
//! them first, so a copy in flight is never read or overwritten; dropping a buffer waits too, so
//! its memory is never freed under a copy (the raw `memcpy_*_async` calls below bypass cudarc's
//! own bookkeeping, which would otherwise be the only thing `PinnedHostSlice`'s drop waits for).
//!
//! A copy from device storage waits for the compute stream's work so far (which produced the
//! storage); `copy_to_pinned_after_event` instead waits on a given event, for memory another
//! stream writes (a collective's result, complete when its event on the communication stream
//! fires), so neither the host nor the compute stream waits for the producer.
//!
//! On the emulated device the buffer is ordinary memory and the copies are items on emulated
//! streams (`emu_stream`), completing when the stream's worker gets to them; race mode
//! (`CudaBackend::emulator_race`) delays every item, so a read or reuse that does not wait sees
//! stale bytes.
use crate::device::CudaBackend;
use crate::err;
use crate::exec::{CudaEvent, CudaStream};
use crate::storage::CudaStorage;
use cudarc::driver::{result, PinnedHostSlice};
use ferrolm_tensor::{bail, Result};
use std::sync::Arc;

enum Mem {
    Pinned(PinnedHostSlice<u8>),
    /// u64 words so that the bytes can be viewed as f32 (the GPU path's page-locked memory is
    /// page aligned).
    Plain(Vec<u64>),
}

/// Which way a copy between the device and a buffer goes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    ToHost,
    FromHost,
}

/// A copy queued on an emulated stream: the addresses, kept alive by their owners until it runs
/// (the buffer waits for it before it is accessed, reused or freed; the device side is kept by
/// the stream order of the pool, or by `keep` for a detached copy).
struct EmuCopy {
    src: usize,
    dst: usize,
    n: usize,
}

impl EmuCopy {
    fn run(&self) {
        // SAFETY: see the struct comment: both ranges are n bytes of live, non-overlapping
        // allocations (a pool block and a buffer's Vec).
        unsafe { std::ptr::copy_nonoverlapping(self.src as *const u8, self.dst as *mut u8, self.n) }
    }
}

pub struct PinnedBuffer {
    mem: Mem,
    bytes: usize,
    /// Completes when the last copy into or out of this buffer has.
    pending: Option<CudaEvent>,
    /// What a detached copy's device side needs alive until it completes (dropped by `wait`).
    keep: Option<Box<dyn std::any::Any + Send>>,
}

impl PinnedBuffer {
    pub fn len(&self) -> usize {
        self.bytes
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Whether a copy into or out of the buffer may still be running (false once waited for).
    pub fn in_flight(&self) -> bool {
        self.pending.as_ref().is_some_and(|e| !e.is_complete())
    }
    /// Waits for every copy into or out of the buffer (a counted host wait, at the caller's
    /// site, when a copy was queued since the last wait).
    #[track_caller]
    pub fn wait(&mut self) -> Result<()> {
        if let Some(ev) = self.pending.take() {
            ev.synchronize()?;
        }
        self.keep = None;
        Ok(())
    }
    fn plain_bytes(v: &[u64], n: usize) -> &[u8] {
        // SAFETY: u64 words reinterpreted as their bytes; n <= 8 * len (alloc_pinned).
        unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, n) }
    }
    fn plain_bytes_mut(v: &mut [u64], n: usize) -> &mut [u8] {
        // SAFETY: as above, with the unique borrow of v.
        unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, n) }
    }
    /// The bytes, after every copy touching them has finished.
    #[track_caller]
    pub fn as_slice(&mut self) -> Result<&[u8]> {
        self.wait()?;
        match &self.mem {
            Mem::Pinned(p) => Ok(&p.as_slice().map_err(err("pinned"))?[..self.bytes]),
            Mem::Plain(v) => Ok(Self::plain_bytes(v, self.bytes)),
        }
    }
    #[track_caller]
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8]> {
        self.wait()?;
        match &mut self.mem {
            Mem::Pinned(p) => Ok(&mut p.as_mut_slice().map_err(err("pinned"))?[..self.bytes]),
            Mem::Plain(v) => Ok(Self::plain_bytes_mut(v, self.bytes)),
        }
    }
    /// The bytes as f32 (the buffer's length must be a multiple of 4), after every copy.
    #[track_caller]
    pub fn as_f32(&mut self) -> Result<&[f32]> {
        let b = self.as_slice()?;
        // SAFETY: the memory is 8-byte (Vec<u64>) or page aligned and any bit pattern is an f32.
        let (pre, mid, post) = unsafe { b.align_to::<f32>() };
        if !pre.is_empty() || !post.is_empty() {
            bail!("pinned", "a buffer of {} bytes is not a whole number of aligned f32", b.len());
        }
        Ok(mid)
    }
    #[track_caller]
    pub fn as_f32_mut(&mut self) -> Result<&mut [f32]> {
        let b = self.as_mut_slice()?;
        let n = b.len();
        // SAFETY: as in `as_f32`.
        let (pre, mid, post) = unsafe { b.align_to_mut::<f32>() };
        if !pre.is_empty() || !post.is_empty() {
            bail!("pinned", "a buffer of {n} bytes is not a whole number of aligned f32");
        }
        Ok(mid)
    }
    /// The buffer's address for an emulated copy (after `wait`).
    fn plain_ptr(&mut self) -> Option<*mut u8> {
        match &mut self.mem {
            Mem::Plain(v) => Some(v.as_mut_ptr() as *mut u8),
            Mem::Pinned(_) => None,
        }
    }
}

impl Drop for PinnedBuffer {
    /// Waits for the copies in flight before the memory goes back. If that wait fails (a broken
    /// context), the memory is leaked rather than freed under a transfer that may still run.
    fn drop(&mut self) {
        if self.wait().is_err() {
            // The device memory a detached copy reads is leaked too.
            std::mem::forget(self.keep.take());
            if let Mem::Pinned(p) = std::mem::replace(&mut self.mem, Mem::Plain(Vec::new())) {
                std::mem::forget(p);
            }
        }
    }
}

impl CudaBackend {
    /// `bytes` of page-locked host memory (zeroed).
    pub fn alloc_pinned(&self, bytes: usize) -> Result<PinnedBuffer> {
        // Page-locked memory on a GPU; ordinary memory serves the emulator.
        let mem = match self.exec.pinned_host(bytes)? {
            Some(p) => Mem::Pinned(p),
            None => Mem::Plain(vec![0; bytes.div_ceil(8)]),
        };
        Ok(PinnedBuffer { mem, bytes, pending: None, keep: None })
    }

    /// The emulator's mutation check: copies skip the wait that orders them after their producer.
    fn skip_copy_wait(&self) -> bool {
        self.exec.skip_copy_wait()
    }

    /// The stream to copy on, made to wait for the compute stream's work so far (which produced
    /// or last used the device storage).
    /// (`emulator_skip_copy_wait` removes that wait for D2H copies.)
    fn copy_stream<'a>(&'a self, stream: Option<&'a Arc<CudaStream>>, d2h: bool) -> Result<&'a Arc<CudaStream>> {
        let compute = self.compute_stream()?;
        let s = stream.unwrap_or(compute);
        let mutated = d2h && self.skip_copy_wait();
        if !Arc::ptr_eq(s, compute) && !mutated {
            let ev = self.record_event(compute)?;
            s.wait(&ev)?;
        }
        Ok(s)
    }
    /// After a copy on `s`: the compute stream waits for it (so later kernels see the data), and
    /// the buffer remembers it.
    fn after_copy(&self, s: &Arc<CudaStream>, buf: &mut PinnedBuffer) -> Result<()> {
        let compute = self.compute_stream()?;
        let ev = self.record_event(s)?;
        if !Arc::ptr_eq(s, compute) {
            compute.wait(&ev)?;
        }
        buf.pending = Some(ev);
        Ok(())
    }
    /// Checks that `buf.len()` bytes from byte `offset` lie inside a device range of `total` bytes.
    fn check_range(op: &str, total: usize, offset: usize, buf: &PinnedBuffer) -> Result<usize> {
        let n = buf.len();
        if offset.checked_add(n).is_none_or(|end| end > total) {
            bail!(op, "bytes {offset}..{} of a device range of {total} bytes", offset.saturating_add(n));
        }
        Ok(n)
    }
    fn check_sizes(op: &str, dev: &CudaStorage, buf: &PinnedBuffer) -> Result<()> {
        let n = dev.len * dev.dtype.size_in_bytes();
        if n != buf.len() {
            bail!(op, "device storage is {n} bytes, the host buffer {}", buf.len());
        }
        Ok(())
    }
    /// An emulated copy, queued on `s`.
    fn emu_copy(s: &CudaStream, job: EmuCopy) -> Result<()> {
        s.emu("copy")?.enqueue(Box::new(move || {
            job.run();
            Ok(())
        }))
    }

    /// Enqueues device -> host of all of `src` into `dst` on `stream` (default: the compute
    /// stream). Returns at once; `dst.as_slice()` waits for the copy.
    pub fn copy_to_pinned(&self, src: &CudaStorage, dst: &mut PinnedBuffer, stream: Option<&Arc<CudaStream>>) -> Result<()> {
        Self::check_sizes("copy_to_pinned", src, dst)?;
        self.copy_to_pinned_at(src, 0, dst, stream)
    }

    /// Enqueues device -> host of `dst.len()` bytes of `src` from byte `offset` into `dst`.
    pub fn copy_to_pinned_at(
        &self,
        src: &CudaStorage,
        offset: usize,
        dst: &mut PinnedBuffer,
        stream: Option<&Arc<CudaStream>>,
    ) -> Result<()> {
        self.d2h(src, offset, dst, stream, None)
    }

    /// `copy_to_pinned_at` without making the compute stream wait for the copy, so the kernels
    /// after it run beside it (a gradient leaving for the host while the backward pass goes on).
    /// `keep` (the tensor that owns `src`) is held until `dst` is waited for, so the pool cannot
    /// hand the block to another kernel meanwhile; the caller must not enqueue writes to the range
    /// before then (they would race the copy, and the host would read a mix).
    pub fn copy_to_pinned_detached(
        &self,
        src: &CudaStorage,
        offset: usize,
        dst: &mut PinnedBuffer,
        stream: Option<&Arc<CudaStream>>,
        keep: Box<dyn std::any::Any + Send>,
    ) -> Result<()> {
        self.d2h(src, offset, dst, stream, Some(keep))
    }

    fn d2h(
        &self,
        src: &CudaStorage,
        offset: usize,
        dst: &mut PinnedBuffer,
        stream: Option<&Arc<CudaStream>>,
        keep: Option<Box<dyn std::any::Any + Send>>,
    ) -> Result<()> {
        let Some(s) = self.enqueue_copy(Direction::ToHost, src, offset, dst, stream)? else { return Ok(()) };
        match keep {
            None => self.after_copy(s, dst),
            Some(k) => {
                dst.pending = Some(self.record_event(s)?);
                dst.keep = Some(k);
                Ok(())
            }
        }
    }

    /// Enqueues the copy of `host.len()` bytes between `host` and `dev` from byte `offset`, in
    /// `dir`, on `stream` (default: the compute stream), after `host`'s previous copy completes.
    /// Returns the stream it went on, or `None` when there was nothing to copy.
    fn enqueue_copy<'a>(
        &'a self,
        dir: Direction,
        dev: &CudaStorage,
        offset: usize,
        host: &mut PinnedBuffer,
        stream: Option<&'a Arc<CudaStream>>,
    ) -> Result<Option<&'a Arc<CudaStream>>> {
        let op = match dir {
            Direction::ToHost => "copy_to_pinned",
            Direction::FromHost => "copy_from_pinned",
        };
        let n = Self::check_range(op, dev.len * dev.dtype.size_in_bytes(), offset, host)?;
        host.wait()?;
        if n == 0 {
            return Ok(None);
        }
        let s = self.copy_stream(stream, dir == Direction::ToHost)?;
        // SAFETY: the range was checked to lie inside dev's block, which the stream reaches
        // after the work ordered before it (`copy_stream`).
        unsafe { self.enqueue_raw(op, dir, dev.buf.ptr + offset as u64, host, s)? };
        Ok(Some(s))
    }

    /// Enqueues the copy of all of `host` (waited for already, not empty) to or from the device
    /// address `dev` on `s`.
    ///
    /// # Safety
    /// `dev` is the start of `host.len()` bytes of live device memory of this backend that stay
    /// alive, and are not written by other work (ToHost) or not read by it (FromHost), until the
    /// copy has run.
    unsafe fn enqueue_raw(&self, op: &'static str, dir: Direction, dev: u64, host: &mut PinnedBuffer, s: &CudaStream) -> Result<()> {
        let n = host.len();
        if let Some(h) = host.plain_ptr() {
            // Emulated device pointers are host addresses of live pool blocks (the caller's
            // contract) and the buffer holds n bytes; the two never overlap.
            let (src, dst) = match dir {
                Direction::ToHost => (dev as usize, h as usize),
                Direction::FromHost => (h as usize, dev as usize),
            };
            return Self::emu_copy(s, EmuCopy { src, dst, n });
        }
        let Mem::Pinned(p) = &mut host.mem else { unreachable!("plain memory handled above") };
        self.bind()?;
        let h = &mut p.as_mut_slice().map_err(err(op))?[..n];
        // SAFETY: `h` is n bytes of a page-locked buffer owned by `host`, which is not accessed,
        // reused or freed until `pending` completes (wait() runs before each of those); the
        // n-byte device range is the caller's contract.
        match dir {
            Direction::ToHost => unsafe { result::memcpy_dtoh_async(h, dev, s.cu_stream()) },
            Direction::FromHost => unsafe { result::memcpy_htod_async(dev, &*h, s.cu_stream()) },
        }
        .map_err(err(op))
    }

    /// Enqueues device -> host of `dst.len()` bytes from byte `offset` of the device allocation
    /// at `src` (`src_bytes` long) into `dst`, on `stream` once `ready` has fired: the stream
    /// waits on the event, and neither the host nor the compute stream waits for anything (a
    /// collective's result leaving for the host behind the collective's completion event,
    /// recorded on the communicator's stream). `keep` (what owns the allocation) is held until
    /// `dst` is waited for, as in `copy_to_pinned_detached`. Returns at once;
    /// `dst.as_slice()` waits for the copy.
    /// (`emulator_skip_copy_wait` removes the wait on `ready`.)
    ///
    /// # Safety
    /// `src` is the address of a device allocation of this backend of at least `src_bytes`
    /// bytes, which `keep` keeps alive; every write to the copied range is ordered before
    /// `ready`, and none is enqueued after it until `dst` has been waited for.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn copy_to_pinned_after_event(
        &self,
        ready: &CudaEvent,
        src: u64,
        src_bytes: usize,
        offset: usize,
        dst: &mut PinnedBuffer,
        stream: &Arc<CudaStream>,
        keep: Box<dyn std::any::Any + Send>,
    ) -> Result<()> {
        let op = "copy_to_pinned_after_event";
        let n = Self::check_range(op, src_bytes, offset, dst)?;
        dst.wait()?;
        if n == 0 {
            return Ok(());
        }
        let mutated = self.skip_copy_wait();
        if !mutated {
            self.bind()?;
            stream.wait(ready)?;
        }
        // SAFETY: the range lies inside the allocation (check_range), which the caller keeps
        // alive through `keep` and does not write after `ready`, which the stream waited on.
        unsafe { self.enqueue_raw(op, Direction::ToHost, src + offset as u64, dst, stream)? };
        dst.pending = Some(self.record_event(stream)?);
        dst.keep = Some(keep);
        Ok(())
    }

    /// Enqueues host -> device of `src` into all of `dst` on `stream` (default: the compute
    /// stream); kernels enqueued on the compute stream afterwards see the data.
    pub fn copy_from_pinned(&self, src: &mut PinnedBuffer, dst: &CudaStorage, stream: Option<&Arc<CudaStream>>) -> Result<()> {
        Self::check_sizes("copy_from_pinned", dst, src)?;
        self.copy_from_pinned_at(src, dst, 0, stream)
    }

    /// Enqueues host -> device of all of `src` into `dst` from byte `offset`.
    pub fn copy_from_pinned_at(
        &self,
        src: &mut PinnedBuffer,
        dst: &CudaStorage,
        offset: usize,
        stream: Option<&Arc<CudaStream>>,
    ) -> Result<()> {
        match self.enqueue_copy(Direction::FromHost, dst, offset, src, stream)? {
            Some(s) => self.after_copy(s, src),
            None => Ok(()),
        }
    }
}
