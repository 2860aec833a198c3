//! The per-device backend: a `CudaBackend` is an execution (`crate::exec`: a GPU or the
//! emulator) and a memory pool, with the checks, allocations and copies written once for both.
use crate::exec::{CudaEvent, CudaStream, Emulator, Exec, Gpu};
use crate::gemm::{GemmOut, LtCall, Operand};
use crate::instrument::profile::LaunchShape;
use crate::pool::{DevBuf, Mem, Pool};
use crate::storage::CudaStorage;
use crate::KernelImage;
use cudarc::driver::CudaContext;
use ferrolm_tensor::{bail, DType, Error, Result};
use std::sync::{Arc, Mutex};

/// Every backend created in this process (weak), for `CudaBackend::latest`.
static INSTANCES: Mutex<Vec<std::sync::Weak<CudaBackend>>> = Mutex::new(Vec::new());

pub struct CudaBackend {
    pub(crate) ordinal: usize,
    /// What runs the work: a real device (`exec::Gpu`), or the CPU emulator
    /// (`exec::Emulator`), which runs the same kernels/*.cu compiled as C++ over host memory,
    /// on emulated streams, for tests without a GPU.
    pub(crate) exec: Box<dyn Exec>,
    pub(crate) pool: Arc<Pool>,
    /// FERROLM_CUDA_POISON=1: every new buffer is filled with NaN bits (0xFF..) so a kernel
    /// that leaves an output element unwritten fails the tests.
    poison: bool,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if self.exec.is_emulated() { ", emulated on the CPU" } else { "" };
        write!(f, "CudaBackend(cuda:{}{kind})", self.ordinal)
    }
}

impl CudaBackend {
    /// Opens device `ordinal`, creates its compute stream and loads the kernels.
    pub fn new(ordinal: usize, image: KernelImage) -> Result<Arc<CudaBackend>> {
        let (gpu, pool) = Gpu::open(ordinal, image)?;
        Ok(Self::finish(ordinal, Box::new(gpu), pool))
    }

    /// A backend that presents itself as `cuda:ordinal` but runs every kernel of kernels/ on the
    /// CPU through the emulator (crates/cuda/emu) and GEMMs through a reference implementation
    /// of cuBLASLt's semantics. Slow (each CUDA thread is a fiber): it exists to check the
    /// backend's launch logic, the kernels' indexing, synchronisation and mma fragment layouts,
    /// and the engines' stream and event discipline where there is no GPU. Its streams are
    /// queues run by worker threads, as a GPU runs them (`emu_stream`); `FERROLM_EMU_RACE=SEED`
    /// turns on race mode, `FERROLM_EMU_REPORT=1` the host-wait report.
    pub fn emulated(ordinal: usize) -> Result<Arc<CudaBackend>> {
        Ok(Self::finish(ordinal, Box::new(Emulator::new()?), Pool::new(Mem::Host)))
    }

    /// Emulated device: race mode with `seed` (a pseudo-random delay before every queued item
    /// of every stream of this backend), or off with `None`. No effect on a GPU.
    pub fn emulator_race(&self, seed: Option<u64>) {
        self.exec.set_race(seed);
    }

    /// Test hook, emulated device only: while on, a D2H pinned copy on a side stream does not
    /// wait for the compute stream's work before it (one compute -> copy event wait removed), and
    /// `copy_to_pinned_after_event` does not wait on its event, so a race-mode run reads
    /// unfinished data. (Only D2H: an early H2D write could corrupt a block
    /// a kernel still reads, e.g. a pointer table, and crash rather than fail.) No effect on a
    /// GPU.
    pub fn emulator_skip_copy_wait(&self, on: bool) {
        self.exec.set_skip_copy_wait(on);
    }

    /// Test hook, emulated device only: while on, the compute stream's kernels, GEMMs, uploads,
    /// memsets and device copies are checked (arguments, shapes, bounds), counted by the profile
    /// and allocated for exactly as always, but not run, and a download reads zeros. The pool's
    /// books (`memory_stats`, `largest_allocation`) are then those of the real work, at shapes
    /// whose arithmetic the emulator could not do in a test's time, and the memory it hands out
    /// is never touched (a step's gigabytes stay virtual). Only for code whose allocations do
    /// not depend on the values it computes (a test proves that at a small shape: the books
    /// with and without the hook agree). Side streams (pinned copies, the emulated NCCL) still
    /// run. No effect on a GPU.
    pub fn emulator_books_only(&self, on: bool) {
        self.exec.set_books_only(on);
    }

    fn finish(ordinal: usize, exec: Box<dyn Exec>, pool: Arc<Pool>) -> Arc<CudaBackend> {
        let poison = std::env::var("FERROLM_CUDA_POISON").is_ok_and(|v| v == "1");
        let b = Arc::new(CudaBackend { ordinal, exec, pool, poison });
        INSTANCES.lock().unwrap_or_else(|e| e.into_inner()).push(Arc::downgrade(&b));
        b
    }

    /// On the emulated device: run the blocks of later launches from this thread with their
    /// threads scheduled in reverse order (`true`) or in order. Comparing the two exposes data
    /// races (a missing `__syncthreads`, a lane reading another's shared memory too early). No
    /// effect on a GPU.
    pub fn emulator_reverse_schedule(&self, on: bool) {
        self.exec.set_reverse_schedule(on);
    }

    /// Test hook, emulated device only: while on, a GEMM with an addend or an f32 output from
    /// bf16 inputs is refused the way cuBLASLt refuses a combination it has no algorithm for
    /// (before anything is enqueued), so the composed fallback and its count
    /// (`profile::gemm_fallbacks`) can be checked without a GPU. No effect on a GPU.
    pub fn emulator_refuse_fused_gemm(&self, on: bool) {
        self.exec.set_refuse_fused_gemm(on);
    }

    /// True for a backend made by `emulated`.
    pub fn is_emulated(&self) -> bool {
        self.exec.is_emulated()
    }

    /// The most recently created backend for device `ordinal` that is still alive (e.g. the one
    /// `ferrolm::init_cuda` registered), for callers that need its streams, timing or memory
    /// statistics but did not create it.
    pub fn latest(ordinal: usize) -> Option<Arc<CudaBackend>> {
        let mut v = INSTANCES.lock().unwrap_or_else(|e| e.into_inner());
        v.retain(|w| w.strong_count() > 0);
        v.iter().rev().filter_map(|w| w.upgrade()).find(|b| b.ordinal == ordinal)
    }
    /// The device's name as the driver reports it (e.g. "NVIDIA H100 80GB HBM3").
    pub fn device_name(&self) -> String {
        self.exec.device_name()
    }
    /// Records a timing-enabled event on the compute stream; `start.elapsed_ms(&end)` gives the
    /// GPU time between two of them (it waits for `end`).
    pub fn timing_event(&self) -> Result<CudaEvent> {
        self.exec.timing_event()
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
    pub fn context(&self) -> Result<&Arc<CudaContext>> {
        self.exec.context()
    }
    pub fn compute_stream(&self) -> Result<&Arc<CudaStream>> {
        Ok(self.exec.compute_stream())
    }
    /// A new stream (communication, host<->device copies); order it with events.
    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        self.exec.new_stream()
    }
    /// Records an event on `stream` (for `wait` on another stream or timing).
    pub fn record_event(&self, stream: &CudaStream) -> Result<CudaEvent> {
        self.exec.record_event(stream)
    }
    /// Binds the device's context to the calling thread (nothing to do on the emulator).
    pub fn bind_to_thread(&self) -> Result<()> {
        self.bind()
    }
    /// The host waits for the compute stream (a counted host wait).
    #[track_caller]
    pub fn synchronize(&self) -> Result<()> {
        self.exec.compute_stream().synchronize()
    }
    /// (bytes in live device buffers, peak since `reset_peak_memory`, bytes cached by the pool)
    pub fn memory_stats(&self) -> (usize, usize, usize) {
        self.pool.stats()
    }
    /// Number of driver allocations (cuMemAlloc) the pool has made so far: constant across
    /// steady-state training steps.
    pub fn device_allocations(&self) -> usize {
        self.pool.mallocs()
    }
    /// Bytes of the largest buffer (its pool size class) allocated since `reset_peak_memory`.
    pub fn largest_allocation(&self) -> usize {
        self.pool.largest()
    }
    /// Starts a new peak (and largest allocation) from what is live now.
    pub fn reset_peak_memory(&self) {
        self.pool.reset_peak()
    }
    /// Returns cached free blocks to the driver (synchronises the compute stream).
    #[track_caller]
    pub fn empty_cache(&self) -> Result<()> {
        self.synchronize()?;
        self.pool.trim();
        Ok(())
    }

    pub(crate) fn bind(&self) -> Result<()> {
        self.exec.bind()
    }
    pub(crate) fn raw_alloc(&self, bytes: usize) -> Result<DevBuf> {
        self.pool.alloc(bytes.max(1))
    }
    /// Uninitialised storage of `n` elements.
    pub(crate) fn alloc(&self, n: usize, dtype: DType) -> Result<CudaStorage> {
        if dtype == DType::F64 {
            bail!("cuda", "f64 tensors are not supported on CUDA (use f32 or bf16)");
        }
        let bytes = n.checked_mul(dtype.size_in_bytes()).ok_or_else(|| Error::new("alloc", format!("{n} elements of {dtype} overflow")))?;
        let buf = self.raw_alloc(bytes)?;
        if self.poison && n > 0 {
            self.memset(&buf, 0xFF, bytes)?;
        }
        Ok(CudaStorage { buf, dtype, len: n, ordinal: self.ordinal })
    }

    /// The device's streaming multiprocessors (132 on the emulator, which models an H100/H200),
    /// for launch grids that fill the device.
    pub fn sm_count(&self) -> u32 {
        self.exec.sm_count()
    }

    /// out (batch, m, n) contiguous = a · b through cuBLASLt (or its reference on the emulator).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm(
        &self,
        dtype: DType,
        a: Operand,
        b: Operand,
        m: usize,
        n: usize,
        k: usize,
        batch: usize,
        out: GemmOut,
    ) -> Result<()> {
        let call = LtCall::plan(dtype, a, b, m, n, k, batch, out)?;
        let name = if dtype == DType::BF16 { "gemm_bf16 (cuBLASLt)" } else { "gemm_f32 (cuBLASLt)" };
        let shape = LaunchShape { grid: (1, 1, 1), block: 0, elems: 0 };
        self.exec.gemm(call, name, shape)
    }

    /// Host -> device copy of a slice into new storage.
    pub(crate) fn upload<T: Copy>(&self, v: &[T], dtype: DType) -> Result<CudaStorage> {
        if std::mem::size_of::<T>() != dtype.size_in_bytes() {
            bail!("upload", "{}-byte host elements cannot fill {dtype} storage", std::mem::size_of::<T>());
        }
        let s = self.alloc(v.len(), dtype)?;
        if v.is_empty() {
            return Ok(s);
        }
        // SAFETY: v is size_of_val(v) initialised bytes of plain values.
        let bytes = unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) };
        // SAFETY: s holds v.len() elements of dtype, which has T's size (checked above), so the
        // destination has room for the bytes of v.
        unsafe { self.exec.upload(s.buf.ptr, bytes)? };
        Ok(s)
    }
    /// Device -> host copy of `n` elements `offset` bytes into `buf` (synchronises the compute
    /// stream: a counted host wait). `T` must be a plain number type (every bit pattern valid).
    #[track_caller]
    pub(crate) fn download<T: Copy + Default>(&self, buf: &DevBuf, offset: usize, n: usize) -> Result<Vec<T>> {
        let end = n.checked_mul(std::mem::size_of::<T>()).and_then(|b| b.checked_add(offset));
        if end.is_none_or(|e| e > buf.class) {
            bail!("download", "{n} elements at byte {offset} are past the end of a {}-byte buffer", buf.class);
        }
        let ptr = buf.ptr + offset as u64;
        let mut v = vec![T::default(); n];
        if n == 0 {
            return Ok(v);
        }
        // SAFETY: v's n elements of a plain number type, as bytes (every bit pattern valid).
        let bytes = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, n * std::mem::size_of::<T>()) };
        // SAFETY: the source range lies inside `buf` (checked above) and has bytes.len() bytes.
        unsafe { self.exec.download(ptr, bytes)? };
        Ok(v)
    }
    /// Zero-fills the first `bytes` of `buf` on the compute stream.
    pub(crate) fn memset0(&self, buf: &DevBuf, bytes: usize) -> Result<()> {
        self.memset(buf, 0, bytes)
    }
    fn memset(&self, buf: &DevBuf, byte: u8, bytes: usize) -> Result<()> {
        if bytes > buf.class {
            bail!("memset", "{bytes} bytes do not fit a {}-byte buffer", buf.class);
        }
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the range lies inside `buf` (checked above), which stays alive until the
        // stream has run the memset (pool blocks are reused only in stream order).
        unsafe { self.exec.memset(buf.ptr, byte, bytes) }
    }
}
