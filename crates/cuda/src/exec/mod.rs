//! What runs the work: the `Exec` trait, with one implementation per kind of device, and the
//! stream and event handles they hand out.
//!
//! - `gpu::Gpu`: a real device (driver context, streams, the kernel module, cuBLASLt);
//! - `emulator::Emulator`: the CPU emulator (crates/cuda/emu), which runs the same kernels/*.cu
//!   compiled as C++ over host memory, on emulated streams (`emu_stream`), for tests without a
//!   GPU.
//!
//! `CudaBackend` (device.rs) holds one as `Box<dyn Exec>` and writes everything else once: its
//! checks, allocations and typed launches do not know which kind runs them. A new kind (CUDA
//! graphs, another vendor) is a new implementation here, not arms across the backend. Each
//! implementation feeds the instruments (`crate::instrument`) itself: the profile's launch
//! counts and timings; the host waits are counted by `CudaStream` and `CudaEvent`.
use crate::emu_stream::{EmuEvent, EmuStream};
use crate::err;
use crate::gemm::LtCall;
use crate::instrument::{count_host_wait, profile::LaunchShape};
use crate::launch::{Arg, Launch};
use cudarc::driver::{sys, CudaContext, PinnedHostSlice};
use ferrolm_tensor::{bail, Result};
use std::sync::Arc;

pub(crate) mod emulator;
pub(crate) mod gpu;

pub(crate) use emulator::Emulator;
pub(crate) use gpu::Gpu;
pub use gpu::{compile_sources, nvrtc_translation_unit};

/// One kind of device: the primitives `CudaBackend` is written with. Device addresses are
/// those of the backend's pool (host addresses on the emulator). Each operation that queues
/// work queues it on the compute stream (`compute_stream`), in order, and returns at once, unless
/// it says it waits.
pub(crate) trait Exec: Send + Sync {
    /// True for the CPU emulator.
    fn is_emulated(&self) -> bool;
    /// The device's name as the driver reports it (the emulator names itself).
    fn device_name(&self) -> String;
    /// Streaming multiprocessors (the emulator models an H100/H200's 132).
    fn sm_count(&self) -> u32;
    /// The driver context (a GPU's only).
    fn context(&self) -> Result<&Arc<CudaContext>>;
    /// The stream every op of the `Backend` trait is queued on.
    fn compute_stream(&self) -> &Arc<CudaStream>;
    /// A new stream of this device.
    fn new_stream(&self) -> Result<Arc<CudaStream>>;
    /// An event at the current end of `stream` (a stream of this device).
    fn record_event(&self, stream: &CudaStream) -> Result<CudaEvent>;
    /// A timing-enabled event at the current end of the compute stream.
    fn timing_event(&self) -> Result<CudaEvent>;
    /// Binds the device's context to the calling thread.
    fn bind(&self) -> Result<()>;

    /// Queues kernel `index` of `Kernel` (`name` for messages and the profile) over `cfg`'s
    /// grid, whose dimensions are all non-zero.
    ///
    /// # Safety
    /// As `CudaBackend::launch`: `args` holds one pointer per kernel parameter, to a value of that
    /// parameter's type, and every device pointer among those values addresses live memory of
    /// this device holding what the kernel accesses, until the stream has run the kernel.
    unsafe fn launch(&self, index: usize, name: &'static str, cfg: Launch, args: &mut [Arg]) -> Result<()>;
    /// Queues the planned cuBLASLt call (`name` and `shape` for the profile).
    fn gemm(&self, call: LtCall, name: &'static str, shape: LaunchShape) -> Result<()>;
    /// Queues the copy of `src` to device address `dst` (the bytes are staged before it returns).
    ///
    /// # Safety
    /// `dst` starts `src.len()` bytes of a live pool block, alive in stream order.
    unsafe fn upload(&self, dst: u64, src: &[u8]) -> Result<()>;
    /// Copies `dst.len()` bytes from device address `src` into `dst`: waits for the compute
    /// stream (a counted host wait, at the caller's site).
    ///
    /// # Safety
    /// `src` starts `dst.len()` bytes inside a live pool block.
    #[track_caller]
    unsafe fn download(&self, src: u64, dst: &mut [u8]) -> Result<()>;
    /// Queues the fill of `bytes` bytes from device address `dst` with `byte`.
    ///
    /// # Safety
    /// The range lies inside a live pool block, alive in stream order.
    unsafe fn memset(&self, dst: u64, byte: u8, bytes: usize) -> Result<()>;
    /// Queues a device-to-device copy of `bytes` bytes (recorded in the profile as `memcpy_dtod`;
    /// errors name `op`).
    ///
    /// # Safety
    /// Both ranges lie inside live pool blocks, alive in stream order.
    unsafe fn copy_dtod(&self, op: &'static str, dst: u64, src: u64, bytes: usize) -> Result<()>;
    /// `bytes` (at least 1) of zeroed page-locked host memory, or `None` where ordinary memory
    /// serves (the emulator).
    fn pinned_host(&self, bytes: usize) -> Result<Option<PinnedHostSlice<u8>>>;

    // The emulator's test hooks (`CudaBackend::emulator_*`): no effect on a GPU.

    /// Race mode's seed (`None`: off).
    fn set_race(&self, _seed: Option<u64>) {}
    /// Copies on a side stream skip their wait for their producer.
    fn set_skip_copy_wait(&self, _on: bool) {}
    fn skip_copy_wait(&self) -> bool {
        false
    }
    /// Fused GEMMs are refused as cuBLASLt without an algorithm for them would refuse them.
    fn set_refuse_fused_gemm(&self, _on: bool) {}
    /// The compute stream's work is checked, counted and allocated for, but not run.
    fn set_books_only(&self, _on: bool) {}
    /// Later launches from the calling thread schedule each block's threads in reverse order.
    fn set_reverse_schedule(&self, _on: bool) {}
}

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
        count_host_wait();
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
        count_host_wait();
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
        count_host_wait();
        match (self, end) {
            (CudaEvent::Gpu(a), CudaEvent::Gpu(b)) => a.elapsed_ms(b).map_err(err("elapsed_ms")),
            (CudaEvent::Emu(a), CudaEvent::Emu(b)) => a.elapsed_ms(b),
            _ => bail!("elapsed_ms", "events of different device kinds"),
        }
    }
}
