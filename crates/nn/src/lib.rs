//! ferrolm-nn: LLaMA on the ferrolm engine, Hugging Face compatible configs and safetensors
//! checkpoints, KV-cache generation, AdamW and learning-rate schedules. The same model file
//! runs the Ladder Transformer (Ladder Residual) as a residual schedule over the Llama blocks;
//! LoRA adapters on its linear layers, in PEFT's format.
pub mod bnb4;
pub mod buckets;
pub mod causal_lm;
pub mod config;
pub mod generate;
pub mod kv_cache;
pub mod ladder_hf;
pub mod llama;
pub mod lora;
pub mod module;
pub mod objective;
pub mod optim;
pub mod qlora;
pub mod quant_linear;
pub mod remat;
mod rope;
pub mod safetensors_io;
pub mod schedule;
pub mod spec;

pub use causal_lm::CausalLm;
pub use config::{Family, LadderLayers, LlamaConfig, RopeScaling, SlidingWindow, SUPPORTED_MODEL_TYPES};
pub use generate::{generate, generate_until, generate_within, Sampling};
pub use kv_cache::KvCache;
pub use llama::{shift_labels, Llama, Packing};
pub use lora::{LoraConfig, Proj};
pub use spec::{ParamSpec, TpRole};
