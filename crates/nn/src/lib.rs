//! ferrolm-nn: LLaMA on the ferrolm engine, Hugging Face compatible configs and safetensors
//! checkpoints, KV-cache generation, AdamW and learning-rate schedules. The same model file
//! runs the Ladder Transformer (Ladder Residual) as a residual schedule over the Llama blocks;
//! LoRA adapters on its linear layers, in PEFT's format.
pub mod buckets;
pub mod config;
pub mod generate;
pub mod ladder_hf;
pub mod llama;
pub mod lora;
pub mod module;
pub mod objective;
pub mod optim;
pub mod remat;
mod rope;
pub mod safetensors_io;
pub mod schedule;

pub use config::{Family, LadderLayers, LlamaConfig, RopeScaling, SlidingWindow, SUPPORTED_MODEL_TYPES};
pub use generate::{generate, generate_until, generate_within, KvCache, Sampling};
pub use llama::{shift_labels, Llama, Packing};
pub use lora::{LoraConfig, Proj};
