//! ferrolm-tensor: tensors (strided views over shared storage), reverse-mode autograd with
//! per-parameter gradient hooks and activation checkpointing, and the CPU reference backend.
//! Device backends plug in through [`backend::Backend`]; ops defined outside this crate (the
//! fused ops of ferrolm-ops) through `Tensor::from_op`, `Tensor::from_storage` and the CPU
//! helpers of [`cpu`].
pub mod autograd;
pub mod backend;
pub mod cpu;
pub mod cpu_adam;
mod dtype;
mod error;
mod optim_ops;
mod primitives;
mod rng;
mod shape;
mod storage;
mod tensor;
mod views;

pub use autograd::{is_grad_enabled, no_grad, recompute, set_grad_enabled};
pub use dtype::{bf16_from_f64, DType, Device};
pub use error::{Error, Result};
pub use half::bf16;
pub use optim_ops::{fused_adamw, fused_adamw_scaled, fused_global_norm, fused_sum_squares, AdamWRange};
pub use primitives::{same_device, same_float};
pub use rng::Rng;
pub use shape::{Layout, Shape};
pub use storage::{live_bytes, peak_bytes, reset_peak_bytes, CountedBytes, CpuStorage, DeviceStorage, Fill, Refill, Storage};
pub use tensor::{Element, Tensor};
