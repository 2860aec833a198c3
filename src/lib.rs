//! ferrolm: a native LLM training framework in Rust.
//!
//! This facade re-exports the workspace crates so examples and users depend on one package.
pub use ferrolm_data as data;
pub use ferrolm_nn as nn;
pub use ferrolm_tensor as tensor;
pub use ferrolm_tensor::{DType, Device, Error, Result, Shape, Tensor};
