//! The emulator's execution: every kernel of kernels/ runs on the CPU through the emulator
//! (crates/cuda/emu, `crate::emu`) and GEMMs through a reference implementation of cuBLASLt's
//! semantics, as items of emulated streams (`emu_stream`) run by worker threads, as a GPU runs
//! its streams. Launches are counted by the profile, never timed.
use super::{CudaEvent, CudaStream, Exec};
use crate::emu_stream::{EmuStream, Job};
use crate::gemm::LtCall;
use crate::instrument::profile::{self, LaunchShape};
use crate::launch::{Arg, Launch};
use cudarc::driver::{CudaContext, PinnedHostSlice};
use ferrolm_tensor::{bail, Result};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// The SM count the emulator reports: an H100's and H200's, so CI checks their launch geometry.
pub const EMULATED_SMS: u32 = 132;

pub(crate) struct Emulator {
    /// The compute stream: every op of the `Backend` trait is queued here.
    stream: Arc<CudaStream>,
    /// Race mode's seed (0: off), read by every stream of this backend before each item.
    race: Arc<AtomicU64>,
    /// Test hook (`emulator_skip_copy_wait`): copies on a side stream skip their wait for the
    /// compute stream (or for the producer's event), the mutation that race mode must catch.
    skip_copy_wait: AtomicBool,
    /// Test hook (`emulator_refuse_fused_gemm`): GEMMs with an addend or an f32 output from bf16
    /// are refused as a cuBLASLt without an algorithm for them would refuse them.
    refuse_fused_gemm: AtomicBool,
    /// Test hook (`emulator_books_only`): the compute stream's work is checked, counted and
    /// allocated for, but not run.
    books_only: AtomicBool,
}

impl Emulator {
    /// The emulated device with its compute stream (race mode from `FERROLM_EMU_RACE`).
    pub(crate) fn new() -> Result<Emulator> {
        if !crate::emu::AVAILABLE {
            bail!("cuda", "the CUDA emulator was not built (no C++ compiler at build time, or FERROLM_NO_EMU=1)");
        }
        crate::instrument::install_report();
        let race = Arc::new(AtomicU64::new(crate::emu_stream::race_from_env()));
        let stream = Arc::new(CudaStream::Emu(EmuStream::new(race.clone())?));
        Ok(Emulator { stream, race, skip_copy_wait: false.into(), refuse_fused_gemm: false.into(), books_only: false.into() })
    }

    fn books_only(&self) -> bool {
        self.books_only.load(Ordering::Relaxed)
    }

    /// Queues `job` on the compute stream (its error, if any, is the stream's sticky error,
    /// reported by the next wait); drops it under `emulator_books_only`.
    fn enqueue(&self, op: &'static str, job: Job) -> Result<()> {
        if self.books_only() {
            self.stream.emu(op).map(drop)
        } else {
            self.stream.emu(op)?.enqueue(job)
        }
    }

    /// Counts a launch in the profile (when it is on).
    fn count(&self, name: &'static str, shape: LaunchShape) {
        if profile::enabled() {
            profile::count(name, shape, self.sm_count(), &|| self.device_name());
        }
    }
}

impl Exec for Emulator {
    fn is_emulated(&self) -> bool {
        true
    }
    fn device_name(&self) -> String {
        "CUDA emulator (CPU)".into()
    }
    fn sm_count(&self) -> u32 {
        EMULATED_SMS
    }
    fn context(&self) -> Result<&Arc<CudaContext>> {
        bail!("context", "not available on the emulated CUDA device")
    }
    fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    fn new_stream(&self) -> Result<Arc<CudaStream>> {
        Ok(Arc::new(CudaStream::Emu(EmuStream::new(self.race.clone())?)))
    }
    fn record_event(&self, stream: &CudaStream) -> Result<CudaEvent> {
        let CudaStream::Emu(s) = stream else { bail!("record_event", "a stream of another device kind") };
        Ok(CudaEvent::Emu(s.record()?))
    }
    fn timing_event(&self) -> Result<CudaEvent> {
        self.record_event(&self.stream)
    }
    fn bind(&self) -> Result<()> {
        Ok(())
    }

    unsafe fn launch(&self, index: usize, name: &'static str, cfg: Launch, args: &mut [Arg]) -> Result<()> {
        let Launch { grid, block, elems, .. } = cfg;
        self.count(name, LaunchShape { grid, block, elems });
        // SAFETY: the caller's contract, which is the emulator's too.
        let job = unsafe { crate::emu::launch(index, name, cfg, args)? };
        self.enqueue(name, job)
    }

    fn gemm(&self, call: LtCall, name: &'static str, shape: LaunchShape) -> Result<()> {
        if self.refuse_fused_gemm.load(Ordering::Relaxed) && (call.c.is_some() || call.out_bf16 != call.bf16) {
            bail!("matmul", "{} for {call:?} (emulator_refuse_fused_gemm)", crate::gemm::NO_ALGORITHM);
        }
        crate::emu::lt_check(&call)?;
        self.count(name, shape);
        self.enqueue("matmul", Box::new(move || crate::emu::lt_matmul(&call).map_err(|e| e.to_string())))
    }

    unsafe fn upload(&self, dst: u64, src: &[u8]) -> Result<()> {
        // A pageable copy: the source is staged before the call returns (here into a Vec the
        // queued copy owns), the write lands in stream order.
        let staged = src.to_vec();
        let dst = dst as usize;
        self.enqueue(
            "upload",
            Box::new(move || {
                // SAFETY: emulated device pointers are host addresses of live pool blocks; the
                // block has room for the staged bytes (the caller's contract) and blocks are
                // recycled in stream order, so it is alive when this runs.
                unsafe { std::ptr::copy_nonoverlapping(staged.as_ptr(), dst as *mut u8, staged.len()) };
                Ok(())
            }),
        )
    }

    #[track_caller]
    unsafe fn download(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        // A blocking copy: the host waits for the stream, then reads.
        self.stream.synchronize()?;
        if self.books_only() {
            return Ok(());
        }
        // SAFETY: emulated device pointers are host addresses of live pool blocks; the range
        // lies inside one (the caller's contract); dst is the caller's own memory, so no
        // overlap; the stream has run everything that writes it.
        unsafe { std::ptr::copy_nonoverlapping(src as usize as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    unsafe fn memset(&self, dst: u64, byte: u8, bytes: usize) -> Result<()> {
        let p = dst as usize;
        self.enqueue(
            "memset",
            Box::new(move || {
                // SAFETY: emulated device pointers are host addresses of live pool blocks; the
                // range lies inside one (the caller's contract), alive in stream order.
                unsafe { std::ptr::write_bytes(p as *mut u8, byte, bytes) };
                Ok(())
            }),
        )
    }

    unsafe fn copy_dtod(&self, op: &'static str, dst: u64, src: u64, bytes: usize) -> Result<()> {
        self.count("memcpy_dtod", LaunchShape { grid: (1, 1, 1), block: 0, elems: 0 });
        let (s, d) = (src as usize, dst as usize);
        self.enqueue(
            op,
            Box::new(move || {
                // SAFETY: emulated device pointers are host addresses of live pool blocks; both
                // ranges lie inside their buffers (the caller's contract), alive in stream order.
                unsafe { std::ptr::copy(s as *const u8, d as *mut u8, bytes) };
                Ok(())
            }),
        )
    }

    fn pinned_host(&self, _bytes: usize) -> Result<Option<PinnedHostSlice<u8>>> {
        Ok(None)
    }

    fn set_race(&self, seed: Option<u64>) {
        self.race.store(seed.map_or(0, |s| s.max(1)), Ordering::Relaxed);
    }
    fn set_skip_copy_wait(&self, on: bool) {
        self.skip_copy_wait.store(on, Ordering::Relaxed);
    }
    fn skip_copy_wait(&self) -> bool {
        self.skip_copy_wait.load(Ordering::Relaxed)
    }
    fn set_refuse_fused_gemm(&self, on: bool) {
        self.refuse_fused_gemm.store(on, Ordering::Relaxed);
    }
    fn set_books_only(&self, on: bool) {
        self.books_only.store(on, Ordering::Relaxed);
    }
    fn set_reverse_schedule(&self, on: bool) {
        crate::emu::set_reverse_schedule(on);
    }
}
