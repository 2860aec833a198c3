//! Page-locked host buffers and asynchronous copies between them and device storage, on any
//! stream (the copy streams that optimizer offload and checkpointing will use). A buffer keeps
//! the event of its last copy, and every access to its bytes waits for that event first, so a
//! copy in flight is never read or overwritten. On the emulated device the buffer is ordinary
//! memory and copies complete before they return.
use crate::device::{CudaBackend, CudaStream, Exec};
use crate::err;
use crate::storage::CudaStorage;
use cudarc::driver::{result, CudaEvent, PinnedHostSlice};
use ferrolm_tensor::{bail, Result};
use std::sync::Arc;

enum Mem {
    Pinned(PinnedHostSlice<u8>),
    Plain(Vec<u8>),
}

pub struct PinnedBuffer {
    mem: Mem,
    bytes: usize,
    /// Completes when the last copy into or out of this buffer has.
    pending: Option<CudaEvent>,
}

impl PinnedBuffer {
    pub fn len(&self) -> usize {
        self.bytes
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn wait(&mut self) -> Result<()> {
        if let Some(ev) = self.pending.take() {
            ev.synchronize().map_err(err("pinned"))?;
        }
        Ok(())
    }
    /// The bytes, after every copy touching them has finished.
    pub fn as_slice(&mut self) -> Result<&[u8]> {
        self.wait()?;
        match &self.mem {
            Mem::Pinned(p) => Ok(&p.as_slice().map_err(err("pinned"))?[..self.bytes]),
            Mem::Plain(v) => Ok(v),
        }
    }
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8]> {
        self.wait()?;
        match &mut self.mem {
            Mem::Pinned(p) => Ok(&mut p.as_mut_slice().map_err(err("pinned"))?[..self.bytes]),
            Mem::Plain(v) => Ok(v),
        }
    }
}

impl CudaBackend {
    /// `bytes` of page-locked host memory (zeroed).
    pub fn alloc_pinned(&self, bytes: usize) -> Result<PinnedBuffer> {
        let mem = match &self.exec {
            Exec::Gpu(g) => {
                self.bind()?;
                // SAFETY: cuMemHostAlloc of bytes.max(1) bytes with flags 0 (plain page-locked,
                // not write-combined: the host reads it) on the bound context; the memory is
                // uninitialised, and is zeroed below before anything reads it.
                let mut p = unsafe { g.ctx.alloc_pinned_with_flags::<u8>(bytes.max(1), 0) }.map_err(err("alloc_pinned"))?;
                p.as_mut_slice().map_err(err("alloc_pinned"))?.fill(0);
                Mem::Pinned(p)
            }
            Exec::Emu => Mem::Plain(vec![0; bytes]),
        };
        Ok(PinnedBuffer { mem, bytes, pending: None })
    }

    /// The stream to copy on, made to wait for the compute stream's work so far (which produced
    /// or last used the device storage).
    fn copy_stream<'a>(&'a self, stream: Option<&'a Arc<CudaStream>>) -> Result<&'a Arc<CudaStream>> {
        let g = self.gpu("copy")?;
        let s = stream.unwrap_or(&g.stream);
        if !Arc::ptr_eq(s, &g.stream) {
            let ev = self.record_event(&g.stream)?;
            s.wait(&ev).map_err(err("copy"))?;
        }
        Ok(s)
    }
    /// After a copy on `s`: the compute stream waits for it (so later kernels see the data), and
    /// the buffer remembers it.
    fn after_copy(&self, s: &Arc<CudaStream>, buf: &mut PinnedBuffer) -> Result<()> {
        let g = self.gpu("copy")?;
        let ev = self.record_event(s)?;
        if !Arc::ptr_eq(s, &g.stream) {
            g.stream.wait(&ev).map_err(err("copy"))?;
        }
        buf.pending = Some(ev);
        Ok(())
    }
    fn check_sizes(op: &str, dev: &CudaStorage, buf: &PinnedBuffer) -> Result<usize> {
        let n = dev.len * dev.dtype.size_in_bytes();
        if n != buf.len() {
            bail!(op, "device storage is {n} bytes, the host buffer {}", buf.len());
        }
        Ok(n)
    }

    /// Enqueues device -> host of all of `src` into `dst` on `stream` (default: the compute
    /// stream). Returns at once; `dst.as_slice()` waits for the copy.
    pub fn copy_to_pinned(&self, src: &CudaStorage, dst: &mut PinnedBuffer, stream: Option<&Arc<CudaStream>>) -> Result<()> {
        let n = Self::check_sizes("copy_to_pinned", src, dst)?;
        dst.wait()?;
        if n == 0 {
            return Ok(());
        }
        match &mut dst.mem {
            // SAFETY: emulated device pointers are host addresses of live pool blocks; check_sizes
            // made n = src.len * element size = v.len(), and src's block holds at least that
            // (alloc sized it); a pool block and a Vec never overlap.
            Mem::Plain(v) => unsafe { std::ptr::copy_nonoverlapping(src.buf.ptr as *const u8, v.as_mut_ptr(), n) },
            Mem::Pinned(p) => {
                let s = self.copy_stream(stream)?;
                self.bind()?;
                let host = &mut p.as_mut_slice().map_err(err("copy_to_pinned"))?[..n];
                // SAFETY: `host` is n bytes of a page-locked buffer owned by dst, which stays alive
                // and is not accessed until `pending` completes (wait() is called before every
                // access); the n-byte source range lies inside src's block (check_sizes), which the
                // copy stream reads after the work ordered before it.
                unsafe { result::memcpy_dtoh_async(host, src.buf.ptr, s.cu_stream()) }.map_err(err("copy_to_pinned"))?;
                self.after_copy(s, dst)?;
            }
        }
        Ok(())
    }

    /// Enqueues host -> device of `src` into all of `dst` on `stream` (default: the compute
    /// stream); kernels enqueued on the compute stream afterwards see the data.
    pub fn copy_from_pinned(&self, src: &mut PinnedBuffer, dst: &CudaStorage, stream: Option<&Arc<CudaStream>>) -> Result<()> {
        let n = Self::check_sizes("copy_from_pinned", dst, src)?;
        src.wait()?;
        if n == 0 {
            return Ok(());
        }
        match &mut src.mem {
            // SAFETY: as above, with the roles swapped: n = v.len() bytes fit dst's block.
            Mem::Plain(v) => unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), dst.buf.ptr as *mut u8, n) },
            Mem::Pinned(p) => {
                let s = self.copy_stream(stream)?;
                self.bind()?;
                let host = &p.as_slice().map_err(err("copy_from_pinned"))?[..n];
                // SAFETY: page-locked source of n bytes, kept alive and unmodified until `pending`
                // completes; the destination range lies inside dst's block (check_sizes).
                unsafe { result::memcpy_htod_async(dst.buf.ptr, host, s.cu_stream()) }.map_err(err("copy_from_pinned"))?;
                self.after_copy(s, src)?;
            }
        }
        Ok(())
    }
}
