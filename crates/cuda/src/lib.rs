//! ferrolm-cuda: the CUDA backend. A `CudaBackend` owns one device's context, a compute stream
//! (plus extra streams and events for copies and communication), a stream-ordered memory pool,
//! a cuBLASLt handle and the module built from `kernels/` (the fatbin that the root `build.rs`
//! embeds, or the kernel sources compiled by NVRTC at first use). It implements
//! `ferrolm_tensor::backend::Backend` (memory, casts, primitive math) and is made visible to
//! tensors with `register`. Kernels are launched through the typed launchers that build.rs
//! generates from their signatures (`kernels`); the fused ops' launchers live with their ops
//! (crates/ops), written with the same public pieces (`DevPtr`, `Launch`, `kernels`, `consts`).
//!
//! Everything is loaded dynamically (cudarc `dynamic-loading`): this crate builds, and its tests
//! pass, on a machine with no CUDA at all; nothing is dlopened until a backend is created.
//!
//! NCCL is not loaded here: the distributed crate opens `libnccl.so.2` itself
//! (`crates/parallel/src/nccl_lib.rs`: `FERROLM_NCCL_LIB`, the loader's path, `NCCL_HOME`, the CUDA
//! toolkit, pip's `nvidia-nccl` wheels), so no `libnccl.so` symlink is needed.
//!
//! The modules are layers, each importing only those below it (a test, `tests/layers.rs`, scans
//! the sources for a `use` that goes up):
//!
//! 1. `instrument`: host-wait counts, `StepScope`, the kernel profile (GPU and emulator alike);
//! 2. `pool`, `storage`, `gemm`, `launch`, `emu_stream`, `emu`: memory, the cuBLASLt plan, launch
//!    shapes and arguments (no backend), the emulator's streams and kernel table;
//! 3. `exec`: the `Exec` trait and its two implementations, `Gpu` and `Emulator`, with the
//!    stream and event handles;
//! 4. `device`: `CudaBackend`, an execution and a pool;
//! 5. `kernels`: the typed launchers;
//! 6. `copy`, `optim`, `alloc`, `pinned`, `backend`: what is written with the launchers.
mod alloc;
mod backend;
mod copy;
mod device;
mod emu;
mod emu_stream;
mod exec;
mod gemm;
mod instrument;
pub mod kernels;
mod launch;
mod optim;
mod pinned;
mod pool;
mod storage;

pub use device::CudaBackend;
pub use exec::{compile_sources, nvrtc_translation_unit, CudaEvent, CudaStream};
pub use instrument::profile;
pub use instrument::{format_report, host_waits, reset_host_waits, track_host_wait_sites, HostWaits, StepScope};
pub use launch::{check_kernel_dtype, unsupported, DevPtr, Launch, ReducePlan};
pub use optim::{AdamWParams, AdamWTensor, NormPart};
pub use pinned::PinnedBuffer;
pub use storage::CudaStorage;

use ferrolm_tensor::Error;

/// The numbers the kernels and their launchers share (tile shapes, block sizes, op codes): the
/// definitions of kernels/constants.cuh, turned into Rust by build.rs.
pub mod consts {
    include!(concat!(env!("OUT_DIR"), "/consts.rs"));
}

/// Every kernels/*.cu and *.cuh as (file name, text): what NVRTC compiles when there is no fatbin.
pub const KERNEL_SOURCES: &[(&str, &str)] = include!(concat!(env!("OUT_DIR"), "/kernel_sources.rs"));

/// How many kernels kernels/ defines (`kernels::Kernel::COUNT`), from build.rs: the size of a
/// GPU's function table, known below the typed launchers.
pub(crate) const KERNEL_COUNT: usize = include!(concat!(env!("OUT_DIR"), "/kernel_count.rs"));

/// The compiled kernels handed over by the facade crate (from `OUT_DIR/kernels_image.rs`).
#[derive(Clone, Copy, Debug)]
pub enum KernelImage {
    /// A fatbin from nvcc (sm_80, sm_90 SASS + compute_90 PTX by default).
    Fatbin(&'static [u8]),
    /// `(file name, text)` of every kernels/*.cu and *.cuh: compiled by NVRTC at first use.
    Sources(&'static [(&'static str, &'static str)]),
}

impl KernelImage {
    /// The fatbin when there is one, else the sources.
    pub fn from_build(fatbin: Option<&'static [u8]>, sources: &'static [(&'static str, &'static str)]) -> Self {
        match fatbin {
            Some(f) => KernelImage::Fatbin(f),
            None => KernelImage::Sources(sources),
        }
    }
}

/// True when libnvrtc can be loaded (no GPU needed): the kernel sources can then be compiled.
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen libnvrtc and look up its symbols; no NVRTC function is called.
    // (catch_unwind: cudarc's loader panics when the library is missing.)
    std::panic::catch_unwind(|| unsafe { cudarc::nvrtc::sys::is_culib_present() }).unwrap_or(false)
}

/// True when libcuda can be loaded and reports at least one device. Never panics (cudarc's
/// loader panics when the library is missing; that is caught here).
pub fn is_available() -> bool {
    device_count() > 0
}

/// Number of CUDA devices (0 when the driver library is missing or fails to initialise).
pub fn device_count() -> usize {
    let r = std::panic::catch_unwind(|| {
        // SAFETY: only tries to dlopen libcuda and look up its symbols; no driver call is made.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return 0;
        }
        if cudarc::driver::result::init().is_err() {
            return 0;
        }
        cudarc::driver::result::device::get_count().map(|n| n.max(0) as usize).unwrap_or(0)
    });
    r.unwrap_or(0)
}

pub(crate) fn err<E: std::fmt::Debug>(op: &'static str) -> impl Fn(E) -> Error {
    move |e| Error::new(op, format!("CUDA error: {e:?}"))
}
