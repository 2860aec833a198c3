//! The per-device state: context, streams, events, pool, kernel module and cuBLASLt handle.
use crate::emu_stream::{EmuEvent, EmuStream, Job};
use crate::gemm::{Gemm, GemmOut, LtCall, Operand};
use crate::kernels::Kernel;
use crate::launch::Launch;
use crate::pool::{DevBuf, Mem, Pool};
use crate::profile::{self, LaunchShape};
use crate::storage::CudaStorage;
use crate::{err, KernelImage};
use cudarc::driver::{result, sys, CudaContext, CudaFunction, CudaModule};
use ferrolm_tensor::{bail, DType, Error, Result};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// A CUDA stream: a driver stream on a GPU, or an emulated one (`emu_stream`), whose address is
/// the `cudaStream_t` that the emulated libraries (crates/parallel/emu) enqueue on.
#[derive(Debug)]
pub enum CudaStream {
    Gpu(Arc<cudarc::driver::CudaStream>),
    Emu(Arc<EmuStream>),
}

/// An event recorded on a `CudaStream`.
#[derive(Debug)]
pub enum CudaEvent {
    Gpu(cudarc::driver::CudaEvent),
    Emu(EmuEvent),
}

impl CudaStream {
    /// Later work on this stream waits for `ev` (the host does not).
    pub fn wait(&self, ev: &CudaEvent) -> Result<()> {
        match (self, ev) {
            (CudaStream::Gpu(s), CudaEvent::Gpu(e)) => s.wait(e).map_err(err("stream wait")),
            (CudaStream::Emu(s), CudaEvent::Emu(e)) => s.wait_event(e),
            _ => bail!("stream wait", "an event of one device kind on a stream of the other"),
        }
    }
    /// The host waits for everything queued on the stream (a counted host wait).
    #[track_caller]
    pub fn synchronize(&self) -> Result<()> {
        crate::emu_stream::count_host_wait();
        match self {
            CudaStream::Gpu(s) => s.synchronize().map_err(err("synchronize")),
            CudaStream::Emu(s) => s.synchronize(),
        }
    }
    /// The raw handle passed to libraries (cuBLASLt, NCCL; the emulated ones on the emulator).
    pub fn cu_stream(&self) -> sys::CUstream {
        match self {
            CudaStream::Gpu(s) => s.cu_stream(),
            CudaStream::Emu(s) => s.handle() as sys::CUstream,
        }
    }
    pub(crate) fn emu(&self, op: &'static str) -> Result<&Arc<EmuStream>> {
        match self {
            CudaStream::Emu(s) => Ok(s),
            CudaStream::Gpu(_) => bail!(op, "a GPU stream passed to the emulated device"),
        }
    }
}

impl CudaEvent {
    /// The host waits for the event (a counted host wait).
    #[track_caller]
    pub fn synchronize(&self) -> Result<()> {
        crate::emu_stream::count_host_wait();
        match self {
            CudaEvent::Gpu(e) => e.synchronize().map_err(err("event synchronize")),
            CudaEvent::Emu(e) => e.synchronize(),
        }
    }
    /// Whether the work before the event has run (no wait).
    pub fn try_is_complete(&self) -> Result<bool> {
        match self {
            CudaEvent::Gpu(e) => e.try_is_complete().map_err(err("event query")),
            CudaEvent::Emu(e) => Ok(e.is_complete()),
        }
    }
    /// As `try_is_complete`, an error reading as not complete.
    pub fn is_complete(&self) -> bool {
        self.try_is_complete().unwrap_or(false)
    }
    /// Milliseconds from this event to `end` (waits for `end`: a counted host wait).
    #[track_caller]
    pub fn elapsed_ms(&self, end: &CudaEvent) -> Result<f32> {
        crate::emu_stream::count_host_wait();
        match (self, end) {
            (CudaEvent::Gpu(a), CudaEvent::Gpu(b)) => a.elapsed_ms(b).map_err(err("elapsed_ms")),
            (CudaEvent::Emu(a), CudaEvent::Emu(b)) => a.elapsed_ms(b),
            _ => bail!("elapsed_ms", "events of different device kinds"),
        }
    }
}

/// Every backend created in this process (weak), for `CudaBackend::latest`.
static INSTANCES: Mutex<Vec<std::sync::Weak<CudaBackend>>> = Mutex::new(Vec::new());

pub struct CudaBackend {
    pub(crate) ordinal: usize,
    pub(crate) exec: Exec,
    pub(crate) pool: Arc<Pool>,
    /// FERROLM_CUDA_POISON=1: every new buffer is filled with NaN bits (0xFF..) so a kernel
    /// that leaves an output element unwritten fails the tests.
    poison: bool,
}

/// What runs the kernels: a real device, or the CPU emulator (crates/cuda/emu), which runs the
/// same kernels/*.cu compiled as C++ over host memory, on emulated streams, for tests without a
/// GPU.
pub(crate) enum Exec {
    Gpu(Gpu),
    Emu(Emu),
}

pub(crate) struct Emu {
    /// The compute stream: every op of the `Backend` trait is queued here.
    pub(crate) stream: Arc<CudaStream>,
    /// Race mode's seed (0: off), read by every stream of this backend before each item.
    race: Arc<AtomicU64>,
    /// Test hook (`emulator_skip_copy_wait`): copies on a side stream skip their wait for the
    /// compute stream (or for the producer's event), the mutation that race mode must catch.
    pub(crate) skip_copy_wait: std::sync::atomic::AtomicBool,
    /// Test hook (`emulator_refuse_fused_gemm`): GEMMs with an addend or an f32 output from bf16
    /// are refused as a cuBLASLt without an algorithm for them would refuse them.
    refuse_fused_gemm: std::sync::atomic::AtomicBool,
    /// Test hook (`emulator_books_only`): the compute stream's work is checked, counted and
    /// allocated for, but not run.
    books_only: std::sync::atomic::AtomicBool,
}

pub(crate) struct Gpu {
    pub(crate) ctx: Arc<CudaContext>,
    /// Every op of the `Backend` trait is enqueued here.
    pub(crate) stream: Arc<CudaStream>,
    raw_stream: Arc<cudarc::driver::CudaStream>,
    module: Arc<CudaModule>,
    /// The kernels' function handles, indexed by `Kernel`, each looked up on its first launch.
    funcs: Box<[OnceLock<CudaFunction>]>,
    pub(crate) gemm: Mutex<Gemm>,
    sm_count: OnceLock<u32>,
}

/// The SM count the emulator reports: an H100's and H200's, so CI checks their launch geometry.
pub const EMULATED_SMS: u32 = 132;

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.exec {
            Exec::Gpu(_) => write!(f, "CudaBackend(cuda:{})", self.ordinal),
            Exec::Emu(_) => write!(f, "CudaBackend(cuda:{}, emulated on the CPU)", self.ordinal),
        }
    }
}

impl CudaBackend {
    /// Opens device `ordinal`, creates its compute stream and loads the kernels.
    pub fn new(ordinal: usize, image: KernelImage) -> Result<Arc<CudaBackend>> {
        if !crate::is_available() {
            bail!("cuda", "no CUDA device available (libcuda missing, no driver, or no GPU)");
        }
        let n = crate::device_count();
        if ordinal >= n {
            bail!("cuda", "device cuda:{ordinal} does not exist ({n} device(s) visible)");
        }
        let ctx = CudaContext::new(ordinal).map_err(err("cuda"))?;
        // SAFETY: cudarc's event tracking orders its own CudaSlice buffers across streams; this
        // backend never uses CudaSlice for tensors: pool buffers are raw pointers ordered by its
        // own stream discipline (one compute stream, events for copy streams), so nothing
        // relies on the tracking being on. Called before any stream or buffer exists.
        unsafe { ctx.disable_event_tracking() };
        let raw_stream = ctx.new_stream().map_err(err("cuda"))?;
        let module = load_module(&ctx, image)?;
        let pool = Pool::new(Mem::Gpu(ctx.clone()));
        let gemm = Gemm::new(&ctx, &pool, &raw_stream)?;
        let funcs = (0..Kernel::COUNT).map(|_| OnceLock::new()).collect();
        let stream = Arc::new(CudaStream::Gpu(raw_stream.clone()));
        let gpu = Gpu { ctx, stream, raw_stream, module, funcs, gemm: Mutex::new(gemm), sm_count: OnceLock::new() };
        Ok(Self::finish(ordinal, Exec::Gpu(gpu), pool))
    }

    /// A backend that presents itself as `cuda:ordinal` but runs every kernel of kernels/ on the
    /// CPU through the emulator (crates/cuda/emu) and GEMMs through a reference implementation
    /// of cuBLASLt's semantics. Slow (each CUDA thread is a fiber): it exists to check the
    /// backend's launch logic, the kernels' indexing, synchronisation and mma fragment layouts,
    /// and the engines' stream and event discipline where there is no GPU. Its streams are
    /// queues run by worker threads, as a GPU runs them (`emu_stream`); `FERROLM_EMU_RACE=SEED`
    /// turns on race mode, `FERROLM_EMU_REPORT=1` the host-wait report.
    pub fn emulated(ordinal: usize) -> Result<Arc<CudaBackend>> {
        if !crate::emu::AVAILABLE {
            bail!("cuda", "the CUDA emulator was not built (no C++ compiler at build time, or FERROLM_NO_EMU=1)");
        }
        crate::emu_stream::install_report();
        let race = Arc::new(AtomicU64::new(crate::emu_stream::race_from_env()));
        let stream = Arc::new(CudaStream::Emu(EmuStream::new(race.clone())?));
        Ok(Self::finish(
            ordinal,
            Exec::Emu(Emu { stream, race, skip_copy_wait: false.into(), refuse_fused_gemm: false.into(), books_only: false.into() }),
            Pool::new(Mem::Host),
        ))
    }

    /// Emulated device: race mode with `seed` (a pseudo-random delay before every queued item
    /// of every stream of this backend), or off with `None`. No effect on a GPU.
    pub fn emulator_race(&self, seed: Option<u64>) {
        if let Exec::Emu(e) = &self.exec {
            e.race.store(seed.map_or(0, |s| s.max(1)), Ordering::Relaxed);
        }
    }

    /// Test hook, emulated device only: while on, a D2H pinned copy on a side stream does not
    /// wait for the compute stream's work before it (one compute -> copy event wait removed), and
    /// `copy_to_pinned_after_event` does not wait on its event, so a race-mode run reads
    /// unfinished data. (Only D2H: an early H2D write could corrupt a block
    /// a kernel still reads, e.g. a pointer table, and crash rather than fail.) No effect on a
    /// GPU.
    pub fn emulator_skip_copy_wait(&self, on: bool) {
        if let Exec::Emu(e) = &self.exec {
            e.skip_copy_wait.store(on, Ordering::Relaxed);
        }
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
        if let Exec::Emu(e) = &self.exec {
            e.books_only.store(on, Ordering::Relaxed);
        }
    }
    fn books_only(&self) -> bool {
        matches!(&self.exec, Exec::Emu(e) if e.books_only.load(Ordering::Relaxed))
    }

    /// Emulated device: queues `job` on the compute stream (its error, if any, is the stream's
    /// sticky error, reported by the next wait); drops it under `emulator_books_only`.
    pub(crate) fn emu_enqueue(&self, op: &'static str, job: Job) -> Result<()> {
        match &self.exec {
            Exec::Emu(e) if e.books_only.load(Ordering::Relaxed) => e.stream.emu(op).map(drop),
            Exec::Emu(e) => e.stream.emu(op)?.enqueue(job),
            Exec::Gpu(_) => bail!(op, "not an emulated device"),
        }
    }

    fn finish(ordinal: usize, exec: Exec, pool: Arc<Pool>) -> Arc<CudaBackend> {
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
        if self.is_emulated() {
            crate::emu::set_reverse_schedule(on);
        }
    }

    /// Test hook, emulated device only: while on, a GEMM with an addend or an f32 output from
    /// bf16 inputs is refused the way cuBLASLt refuses a combination it has no algorithm for
    /// (before anything is enqueued), so the composed fallback and its count
    /// (`profile::gemm_fallbacks`) can be checked without a GPU. No effect on a GPU.
    pub fn emulator_refuse_fused_gemm(&self, on: bool) {
        if let Exec::Emu(e) = &self.exec {
            e.refuse_fused_gemm.store(on, Ordering::Relaxed);
        }
    }

    /// True for a backend made by `emulated`.
    pub fn is_emulated(&self) -> bool {
        matches!(self.exec, Exec::Emu(_))
    }
    pub(crate) fn gpu(&self, op: &'static str) -> Result<&Gpu> {
        match &self.exec {
            Exec::Gpu(g) => Ok(g),
            Exec::Emu(_) => bail!(op, "not available on the emulated CUDA device"),
        }
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
        match &self.exec {
            Exec::Gpu(g) => g.ctx.name().unwrap_or_else(|e| format!("cuda:{} ({e:?})", self.ordinal)),
            Exec::Emu(_) => "CUDA emulator (CPU)".into(),
        }
    }
    /// Records a timing-enabled event on the compute stream; `start.elapsed_ms(&end)` gives the
    /// GPU time between two of them (it waits for `end`).
    pub fn timing_event(&self) -> Result<CudaEvent> {
        let g = match &self.exec {
            Exec::Gpu(g) => g,
            Exec::Emu(e) => return self.record_event(&e.stream),
        };
        let ev = g.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(err("timing_event"))?;
        ev.record(&g.raw_stream).map_err(err("timing_event"))?;
        Ok(CudaEvent::Gpu(ev))
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
    pub fn context(&self) -> Result<&Arc<CudaContext>> {
        Ok(&self.gpu("context")?.ctx)
    }
    pub fn compute_stream(&self) -> Result<&Arc<CudaStream>> {
        match &self.exec {
            Exec::Gpu(g) => Ok(&g.stream),
            Exec::Emu(e) => Ok(&e.stream),
        }
    }
    /// A new stream (communication, host<->device copies); order it with events.
    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        match &self.exec {
            Exec::Gpu(g) => Ok(Arc::new(CudaStream::Gpu(g.ctx.new_stream().map_err(err("new_stream"))?))),
            Exec::Emu(e) => Ok(Arc::new(CudaStream::Emu(EmuStream::new(e.race.clone())?))),
        }
    }
    /// Records an event on `stream` (for `wait` on another stream or timing).
    pub fn record_event(&self, stream: &CudaStream) -> Result<CudaEvent> {
        match (&self.exec, stream) {
            (Exec::Gpu(g), CudaStream::Gpu(s)) => {
                let ev = g.ctx.new_event(None).map_err(err("record_event"))?;
                ev.record(s).map_err(err("record_event"))?;
                Ok(CudaEvent::Gpu(ev))
            }
            (Exec::Emu(_), CudaStream::Emu(s)) => Ok(CudaEvent::Emu(s.record()?)),
            _ => bail!("record_event", "a stream of another device kind"),
        }
    }
    /// Binds the device's context to the calling thread (nothing to do on the emulator).
    pub fn bind_to_thread(&self) -> Result<()> {
        self.bind()
    }
    /// The host waits for the compute stream (a counted host wait).
    #[track_caller]
    pub fn synchronize(&self) -> Result<()> {
        match &self.exec {
            Exec::Gpu(g) => g.stream.synchronize(),
            Exec::Emu(e) => e.stream.synchronize(),
        }
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
        match &self.exec {
            Exec::Gpu(g) => g.ctx.bind_to_thread().map_err(err("cuda")),
            Exec::Emu(_) => Ok(()),
        }
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

    /// Enqueues `kernel` on the compute stream (runs it to completion on the emulator). Called
    /// by the generated typed launchers (`crate::kernels`).
    ///
    /// # Safety
    /// `args` holds one pointer per kernel parameter, to a value of that parameter's type, and
    /// every device pointer among those values addresses live memory of this device holding what
    /// the kernel accesses for this launch shape; pool blocks stay allocated until the stream has
    /// run the kernel.
    pub(crate) unsafe fn launch(&self, kernel: Kernel, cfg: Launch, args: &mut [crate::launch::Arg]) -> Result<()> {
        let Launch { grid, block, smem, elems } = cfg;
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let name = kernel.name();
        let shape = LaunchShape { grid, block, elems };
        let g = match &self.exec {
            Exec::Gpu(g) => g,
            Exec::Emu(_) => {
                if profile::enabled() {
                    profile::count(name, shape, self.sm_count(), &|| self.device_name());
                }
                // SAFETY: the caller's contract, which is the emulator's too.
                return unsafe { crate::emu::launch(self, kernel, cfg, args) };
            }
        };
        let timer = self.profile_start()?;
        self.bind()?;
        let f = g.func(kernel)?;
        if smem > 48 * 1024 {
            f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
                .map_err(|e| Error::new(name, format!("cannot enable {smem} bytes of shared memory: {e:?}")))?;
        }
        let mut ptrs: Vec<*mut c_void> = args.iter().map(|a| a.ptr).collect();
        // SAFETY: the caller's contract: one pointer per parameter, of its type, and live device
        // memory behind every device pointer until the stream has run the kernel.
        unsafe { result::launch_kernel(f.cu_function(), grid, (block, 1, 1), smem, g.stream.cu_stream(), &mut ptrs) }
            .map_err(|e| Error::new(name, format!("launch failed: {e:?}")))?;
        self.profile_end(timer, name, shape)
    }

    /// With the profile on, on a GPU: a timing event recorded on the compute stream before a
    /// launch (`profile_end` records its partner after it).
    pub(crate) fn profile_start(&self) -> Result<Option<CudaEvent>> {
        match &self.exec {
            Exec::Gpu(_) if profile::enabled() => self.timing_event().map(Some),
            _ => Ok(None),
        }
    }
    /// Records the launch `name` in the profile: timed between `start` and a new event on a GPU,
    /// counted on the emulator.
    pub(crate) fn profile_end(&self, start: Option<CudaEvent>, name: &'static str, shape: LaunchShape) -> Result<()> {
        match start {
            Some(start) => {
                let end = self.timing_event()?;
                profile::timed(name, shape, start, end, self.sm_count(), &|| self.device_name());
            }
            None if profile::enabled() => profile::count(name, shape, self.sm_count(), &|| self.device_name()),
            None => {}
        }
        Ok(())
    }

    /// The device's streaming multiprocessors (132 on the emulator, which models an H100/H200),
    /// for launch grids that fill the device.
    pub fn sm_count(&self) -> u32 {
        match &self.exec {
            Exec::Gpu(g) => *g.sm_count.get_or_init(|| {
                g.ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_or(132, |n| n.max(1) as u32)
            }),
            Exec::Emu(_) => EMULATED_SMS,
        }
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
        match &self.exec {
            Exec::Gpu(g) => {
                self.bind()?;
                let timer = self.profile_start()?;
                g.gemm.lock().unwrap_or_else(|e| e.into_inner()).run(&g.raw_stream, &call)?;
                self.profile_end(timer, name, shape)
            }
            Exec::Emu(e) => {
                if e.refuse_fused_gemm.load(Ordering::Relaxed) && (call.c.is_some() || call.out_bf16 != call.bf16) {
                    bail!("matmul", "{} for {call:?} (emulator_refuse_fused_gemm)", crate::gemm::NO_ALGORITHM);
                }
                crate::emu::lt_check(&call)?;
                self.profile_end(None, name, shape)?;
                self.emu_enqueue("matmul", Box::new(move || crate::emu::lt_matmul(&call).map_err(|e| e.to_string())))
            }
        }
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
        match &self.exec {
            Exec::Gpu(g) => {
                self.bind()?;
                // SAFETY: s holds v.len() elements of dtype, which has T's size (checked above), so
                // the destination has room for the bytes of v; a pageable source is staged by the
                // driver before the call returns, so v may be dropped afterwards.
                unsafe { result::memcpy_htod_async(s.buf.ptr, v, g.stream.cu_stream()) }.map_err(err("upload"))?;
            }
            Exec::Emu(_) => {
                // A pageable copy: the source is staged before the call returns (here into a
                // Vec the queued copy owns), the write lands in stream order.
                let staged: Vec<u8> = {
                    // SAFETY: v is size_of_val(v) initialised bytes of plain values.
                    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }.to_vec()
                };
                let dst = s.buf.ptr as usize;
                self.emu_enqueue(
                    "upload",
                    Box::new(move || {
                        // SAFETY: emulated device pointers are host addresses of live pool blocks;
                        // s has room for the staged bytes (element sizes checked above) and
                        // blocks are recycled in stream order, so it is alive when this runs.
                        unsafe { std::ptr::copy_nonoverlapping(staged.as_ptr(), dst as *mut u8, staged.len()) };
                        Ok(())
                    }),
                )?;
            }
        }
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
        match &self.exec {
            Exec::Gpu(g) => {
                self.bind()?;
                // SAFETY: the source range lies inside `buf` (checked above) and v has room for n
                // elements; v is neither read nor dropped before the synchronize below.
                unsafe { result::memcpy_dtoh_async(&mut v, ptr, g.stream.cu_stream()) }.map_err(err("download"))?;
                self.synchronize()?;
            }
            Exec::Emu(e) => {
                // A blocking copy: the host waits for the stream, then reads.
                e.stream.synchronize()?;
                if self.books_only() {
                    return Ok(v);
                }
                // SAFETY: emulated device pointers are host addresses of live pool blocks (256-byte
                // aligned, and `offset` is a multiple of T's size at every call site); the range
                // lies inside `buf` (checked above); v is a fresh Vec of n elements, so no overlap;
                // the stream has run everything that writes it.
                unsafe { std::ptr::copy_nonoverlapping(ptr as *const T, v.as_mut_ptr(), n) }
            }
        }
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
        let ptr = buf.ptr;
        match &self.exec {
            Exec::Gpu(g) => {
                self.bind()?;
                // SAFETY: the range lies inside `buf` (checked above), which stays alive until the
                // stream has run the memset (pool blocks are reused only in stream order).
                unsafe { result::memset_d8_async(ptr, byte, bytes, g.stream.cu_stream()) }.map_err(err("memset"))
            }
            Exec::Emu(_) => {
                let p = ptr as usize;
                self.emu_enqueue(
                    "memset",
                    Box::new(move || {
                        // SAFETY: emulated device pointers are host addresses of live pool blocks;
                        // the range lies inside `buf` (checked above), alive in stream order.
                        unsafe { std::ptr::write_bytes(p as *mut u8, byte, bytes) };
                        Ok(())
                    }),
                )
            }
        }
    }
}

impl Gpu {
    /// The function handle of `kernel`, looked up in the module on its first launch only.
    fn func(&self, kernel: Kernel) -> Result<&CudaFunction> {
        let slot = &self.funcs[kernel as usize];
        if let Some(f) = slot.get() {
            return Ok(f);
        }
        let name = kernel.name();
        let f = self.module.load_function(name).map_err(|e| Error::new(name, format!("kernel not found in the image: {e:?}")))?;
        Ok(slot.get_or_init(|| f))
    }
}

fn load_module(ctx: &Arc<CudaContext>, image: KernelImage) -> Result<Arc<CudaModule>> {
    let ptx = match image {
        KernelImage::Fatbin(b) => cudarc::nvrtc::Ptx::from_binary(b.to_vec()),
        KernelImage::Sources(srcs) => {
            let (maj, min) = ctx.compute_capability().map_err(err("nvrtc"))?;
            compile_sources(srcs, &format!("compute_{maj}{min}"))?
        }
    };
    ctx.load_module(ptx).map_err(|e| Error::new("cuda", format!("loading the kernel image failed (wrong GPU architecture?): {e:?}")))
}

/// The kernel sources as the one translation unit NVRTC compiles: every `.cu` in order, with
/// each `#include "x"` of an embedded file replaced by its text the first time (the files use
/// `#pragma once`). Other includes stay for the preprocessor (e.g. the emulator's header, behind
/// `#ifdef FERRO_EMU`).
pub fn nvrtc_translation_unit(srcs: &[(&str, &str)]) -> Result<String> {
    fn expand(name: &str, srcs: &[(&str, &str)], done: &mut Vec<String>, out: &mut String, depth: usize) -> Result<()> {
        if done.iter().any(|d| d == name) {
            return Ok(());
        }
        let Some((_, text)) = srcs.iter().find(|(n, _)| *n == name) else {
            bail!("nvrtc", "kernel source {name} is included but not embedded");
        };
        if depth > 16 {
            bail!("nvrtc", "#include nesting too deep at {name}");
        }
        done.push(name.to_string());
        out.push_str(&format!("// ---- {name}\n"));
        for line in text.lines() {
            let t = line.trim_start();
            let inc = t.strip_prefix("#include \"").and_then(|r| r.split('"').next());
            if let Some(inc) = inc.filter(|i| srcs.iter().any(|(n, _)| n == i)) {
                expand(inc, srcs, done, out, depth + 1)?;
            } else if !t.starts_with("#pragma once") {
                out.push_str(line);
                out.push('\n');
            }
        }
        Ok(())
    }
    let (mut done, mut out) = (Vec::new(), String::new());
    for (name, _) in srcs.iter().filter(|(n, _)| n.ends_with(".cu")) {
        expand(name, srcs, &mut done, &mut out, 0)?;
    }
    Ok(out)
}

/// Compiles the kernel sources with NVRTC for `arch` (e.g. "compute_90"). Needs libnvrtc on
/// the library path, not a GPU.
pub fn compile_sources(srcs: &[(&str, &str)], arch: &str) -> Result<cudarc::nvrtc::Ptx> {
    use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
    let all = nvrtc_translation_unit(srcs)?;
    let arch: &'static str = Box::leak(arch.to_string().into_boxed_str());
    let opts = CompileOptions { arch: Some(arch), options: vec!["-std=c++17".into(), "-DFERRO_NVRTC".into()], ..Default::default() };
    compile_ptx_with_opts(all, opts).map_err(|e| Error::new("nvrtc", format!("compiling kernels/ failed: {e}")))
}
