//! ferrolm: a native LLM training framework in Rust.
//!
//! This facade re-exports the workspace crates and holds what needs all of them: the
//! training loop (`train`), its run directories (`run_dir`), the command-line tools (`cli`) and
//! what they share: logs (`logging`), progress bars (`progress`), the loss curve (`plot`); and
//! the performance model (`planner`: cluster, memory estimator, step time, search, calibration)
//! that `plan`, `autoconfig` and the training tools' memory check share.
pub mod alloc;
pub mod autoconfig;
pub mod batches;
pub mod chat;
pub mod checkpoint;
pub mod cli;
pub mod dpo;
pub mod errors;
pub mod eval;
pub mod logging;
pub mod lora_base;
pub mod parallel;
pub mod planner;
pub mod plot;
pub mod profile;
pub mod progress;
pub mod quant_base;
pub mod run_dir;
pub mod shards;
pub mod tokenizer_files;
pub mod train;

pub use ferrolm_data as data;
pub use ferrolm_nn as nn;
pub use ferrolm_nn::Llama;
pub use ferrolm_ops as ops;
pub use ferrolm_tensor as tensor;
pub use ferrolm_tensor::{DType, Device, Error, Result, Shape, Tensor};

/// Result of the tools and the training loop: an error with its chain of causes (anyhow), which
/// the tools print as `error: what failed: why`.
pub type AnyResult<T> = anyhow::Result<T>;

/// The fatbin that `build.rs` compiles from `kernels/` when nvcc was found at build time (the
/// sources for NVRTC are `ferrolm_cuda::KERNEL_SOURCES`).
pub mod kernels_image {
    include!(concat!(env!("OUT_DIR"), "/kernels_image.rs"));
}

/// Creates the CUDA backend for GPU `i` and registers it, once per process and device.
///
/// With `FERROLM_CUDA_EMULATOR=1`, `cuda:i` is instead the CPU emulator of the CUDA backend
/// (`ferrolm_cuda::CudaBackend::emulated`): the same launchers and kernels/*.cu, run on the CPU.
/// It is slow and meant for checking the CUDA code path on a machine without a GPU.
pub fn init_cuda(i: usize) -> Result<()> {
    use std::sync::Mutex;
    static READY: Mutex<Vec<usize>> = Mutex::new(Vec::new());
    let mut ready = READY.lock().unwrap_or_else(|e| e.into_inner());
    if ready.contains(&i) {
        return Ok(());
    }
    if std::env::var("FERROLM_CUDA_EMULATOR").is_ok_and(|v| v == "1") {
        tracing::info!("FERROLM_CUDA_EMULATOR=1: cuda:{i} is the CPU emulator of the CUDA backend (slow; for checking, not for training)");
        tensor::backend::register(ferrolm_cuda::CudaBackend::emulated(i)?);
        ready.push(i);
        return Ok(());
    }
    let n = ferrolm_cuda::device_count();
    if i >= n {
        return Err(Error::new(
            "device",
            format!("cuda:{i} is not available: {n} CUDA device(s) visible (is the NVIDIA driver installed?)"),
        ));
    }
    let img = ferrolm_cuda::KernelImage::from_build(kernels_image::FATBIN, ferrolm_cuda::KERNEL_SOURCES);
    tensor::backend::register(ferrolm_cuda::CudaBackend::new(i, img)?);
    ready.push(i);
    Ok(())
}

/// The device named by a `--device` flag (`cpu`, `cuda`, `cuda:N`), or with none the best one
/// present: CUDA when a GPU is visible and its backend starts, else the CPU.
pub fn pick_device(flag: Option<&str>) -> Result<Device> {
    match flag {
        None | Some("auto") => {
            if ferrolm_cuda::device_count() == 0 {
                return Ok(Device::Cpu);
            }
            match init_cuda(0) {
                Ok(()) => Ok(Device::Cuda(0)),
                Err(e) => {
                    tracing::warn!("a GPU is visible but the CUDA backend did not start ({e}); using the CPU");
                    Ok(Device::Cpu)
                }
            }
        }
        Some(s) => {
            let d: Device = s.parse()?;
            if let Device::Cuda(i) = d {
                init_cuda(i)?;
            }
            Ok(d)
        }
    }
}

#[global_allocator]
static ALLOCATOR: alloc::Allocator = alloc::Allocator;
