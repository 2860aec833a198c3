//! Shared by the CUDA test binaries: the kernel sources for NVRTC (or a fatbin named by
//! FERROLM_KERNELS_FATBIN), and `gpu()`, which registers the backend once: the real device when
//! there is one, else the CPU emulator (crates/cuda/emu: the same kernels/*.cu compiled as C++,
//! with fibers for CUDA threads), announced with "no CUDA device: running on the CUDA emulator".
//! FERROLM_REQUIRE_GPU=1 demands a real GPU (panics without one); FERROLM_REQUIRE_EMU=1 (CI)
//! demands a GPU or the emulator; with neither the tests print "skipped: no CUDA device".
#![allow(dead_code)]
use ferrolm_cuda::{CudaBackend, KernelImage};
use ferrolm_tensor::{backend, Device};
use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// The kernel sources NVRTC compiles (the crate's own list, generated from kernels/).
pub const SOURCES: &[(&str, &str)] = ferrolm_cuda::KERNEL_SOURCES;

pub const GPU: Device = Device::Cuda(0);

/// The registered backend, held for one test. Tests share the device (a read lock); a test that
/// measures the pool takes it alone (`gpu_exclusive`) so other tests' buffers do not count.
pub struct Gpu<G> {
    be: Arc<CudaBackend>,
    _guard: G,
}
impl<G> std::ops::Deref for Gpu<G> {
    type Target = CudaBackend;
    fn deref(&self) -> &CudaBackend {
        &self.be
    }
}
static DEVICE_LOCK: RwLock<()> = RwLock::new(());

/// Creates and registers the backend once; None (test passes) when there is no GPU and none
/// is required.
pub fn gpu() -> Option<Gpu<RwLockReadGuard<'static, ()>>> {
    let be = backend_once()?;
    Some(Gpu { be, _guard: DEVICE_LOCK.read().unwrap_or_else(|e| e.into_inner()) })
}
/// `gpu()` with no other test using the device meanwhile.
pub fn gpu_exclusive() -> Option<Gpu<RwLockWriteGuard<'static, ()>>> {
    let be = backend_once()?;
    Some(Gpu { be, _guard: DEVICE_LOCK.write().unwrap_or_else(|e| e.into_inner()) })
}

fn backend_once() -> Option<Arc<CudaBackend>> {
    static INIT: OnceLock<Option<Arc<CudaBackend>>> = OnceLock::new();
    let b = INIT.get_or_init(|| {
        std::env::set_var("FERROLM_CUDA_POISON", "1");
        if !ferrolm_cuda::is_available() {
            if std::env::var("FERROLM_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                return None;
            }
            let b = CudaBackend::emulated(0).ok()?;
            backend::register(b.clone());
            return Some(b);
        }
        // FERROLM_KERNELS_FATBIN=path tests a built fatbin instead of the NVRTC path.
        let image = match std::env::var("FERROLM_KERNELS_FATBIN") {
            Ok(p) => KernelImage::Fatbin(Box::leak(std::fs::read(p).expect("read fatbin").into_boxed_slice())),
            Err(_) => KernelImage::Sources(SOURCES),
        };
        let b = CudaBackend::new(0, image).expect("CUDA backend");
        backend::register(b.clone());
        Some(b)
    });
    if let Some(b) = b {
        if b.is_emulated() {
            println!("no CUDA device: running on the CUDA emulator");
        }
        return Some(b.clone());
    }
    if std::env::var("FERROLM_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        panic!("FERROLM_REQUIRE_GPU=1 but no CUDA device is available");
    }
    if std::env::var("FERROLM_REQUIRE_EMU").is_ok_and(|v| v == "1") {
        panic!("FERROLM_REQUIRE_EMU=1 but there is neither a CUDA device nor the CUDA emulator (no C++ compiler at build time?)");
    }
    println!("skipped: no CUDA device");
    None
}
