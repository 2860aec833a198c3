//! ferrolm-nn: LLaMA on the ferrolm engine, Hugging Face compatible configs and safetensors
//! checkpoints, KV-cache generation, AdamW and learning-rate schedules.
pub mod checkpoint;
pub mod config;
pub mod generate;
pub mod llama;
pub mod optim;
pub mod schedule;

pub use config::{LlamaConfig, RopeScaling};
pub use generate::{generate, KvCache};
pub use llama::{shift_labels, Llama};
