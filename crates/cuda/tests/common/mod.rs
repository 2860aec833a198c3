//! Shared by the CUDA test binaries: the kernel sources for NVRTC (or a fatbin named by
//! FERROLM_KERNELS_FATBIN), and `gpu()`, which registers the backend once, prints
//! "skipped: no CUDA device" without a GPU, and panics instead when FERROLM_REQUIRE_GPU=1.
#![allow(dead_code)]
use ferrolm_cuda::{CudaBackend, KernelImage};
use ferrolm_tensor::{backend, Device};
use std::sync::{Arc, OnceLock};

pub const SOURCES: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../../../../kernels/common.cuh")),
    ("attention.cu", include_str!("../../../../kernels/attention.cu")),
    ("cross_entropy.cu", include_str!("../../../../kernels/cross_entropy.cu")),
    ("elementwise.cu", include_str!("../../../../kernels/elementwise.cu")),
    ("embedding.cu", include_str!("../../../../kernels/embedding.cu")),
    ("optim.cu", include_str!("../../../../kernels/optim.cu")),
    ("reduce.cu", include_str!("../../../../kernels/reduce.cu")),
    ("rmsnorm.cu", include_str!("../../../../kernels/rmsnorm.cu")),
    ("rope.cu", include_str!("../../../../kernels/rope.cu")),
    ("softmax.cu", include_str!("../../../../kernels/softmax.cu")),
    ("swiglu.cu", include_str!("../../../../kernels/swiglu.cu")),
];

pub const GPU: Device = Device::Cuda(0);

/// Creates and registers the backend once; None (test passes) when there is no GPU and none
/// is required.
pub fn gpu() -> Option<Arc<CudaBackend>> {
    static INIT: OnceLock<Option<Arc<CudaBackend>>> = OnceLock::new();
    let b = INIT.get_or_init(|| {
        if !ferrolm_cuda::is_available() {
            return None;
        }
        std::env::set_var("FERROLM_CUDA_POISON", "1");
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
        return Some(b.clone());
    }
    if std::env::var("FERROLM_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        panic!("FERROLM_REQUIRE_GPU=1 but no CUDA device is available");
    }
    println!("skipped: no CUDA device");
    None
}
