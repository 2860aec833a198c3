//! The fixtures the workspace's test binaries share (a dev-dependency, never published): one
//! place for each piece of scaffolding a test would otherwise copy.
//!
//! - [`tiny`]: the tiny Llama configuration of the model tests and the families it covers;
//! - [`gate`]: the one "run on the device (a GPU, or the CUDA emulator) or skip" gate, which
//!   skips, saying so on stderr, only where nothing to run on exists, and fails instead under
//!   `FERROLM_REQUIRE_EMU=1` (CI) or `FERROLM_REQUIRE_GPU=1` (the GPU runner);
//! - [`tol`]: tolerances by dtype and the relative-error measures the tests compare with;
//! - [`poison`]: outputs filled with NaN (or a sentinel) before a kernel runs, so that an
//!   element the kernel does not write fails the comparison.
//!
//! Helpers tied to one crate's internals (the CUDA tests' storage moves, the engine's
//! finite-difference checker) stay in that crate's `tests/common`.
pub mod gate;
pub mod poison;
pub mod segments;
pub mod tiny;
pub mod tol;
pub mod tools;

pub use gate::Need;
pub use tiny::{tiny_gqa32, tiny_llama, tiny_llama_layers};
pub use tol::{max_rel, rel_err};
