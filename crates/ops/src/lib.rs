//! ferrolm-ops: the fused ops of the models, one module per op. A module holds everything of its
//! op: a purpose paragraph, the public op with its backward rule (a custom autograd op made with
//! `Tensor::from_op`, whose backward calls the op's own backward kernels, never a chain of small
//! ops), the storage-level `forward` / `backward` that dispatch on the device of the inputs, the
//! CPU reference (generic over f32/f64; bf16 is widened to f32 and rounded once) and the CUDA
//! launcher (the kernels of `kernels/<op>.cu` through the typed launches of
//! `ferrolm_cuda::kernels`).
//!
//! | op | module | CUDA kernels |
//! |---|---|---|
//! | `rms_norm` | `rmsnorm` | kernels/rmsnorm.cu |
//! | `rope`, `rope_at` | `rope` | kernels/rope.cu |
//! | `swiglu`, `geglu`, `glu` | `swiglu` | kernels/swiglu.cu |
//! | `rms_norm_offset` (Gemma's (1 + w)) | `rmsnorm` | kernels/rmsnorm.cu |
//! | `softcap` | `softcap` | kernels/softcap.cu |
//! | `bias_add`, `linear_bias` | `bias` | kernels/bias.cu |
//! | `causal_attention`, `segment_attention` (`_window`: sliding window) | `attention` | kernels/attention.cu |
//! | `cross_entropy` | `cross_entropy` | kernels/cross_entropy.cu |
//! | `embedding` | `embedding` | kernels/embedding.cu |
//! | `head_loss` (LM head + cross-entropy, chunked) | `head_loss` | kernels/head_loss.cu, kernels/cross_entropy.cu |
//! | `softmax_last` | `softmax` | kernels/softmax.cu |
//! | `Quant4` (NF4/FP4 + double quantization, bitsandbytes' format), `dequantize_cuda` | `nf4` | kernels/nf4.cu |
//!
//! `Tokens` carries a batch's ids with their host copy, so the embedding and the cross-entropy
//! check them on the host instead of reading the device back.
//!
//! Adding a fused op takes a module here and its `.cu` file: build.rs finds the new kernels and
//! generates their typed launchers; the tensor crate and the CUDA backend do not change.
pub mod attention;
pub mod bias;
mod ce_row;
pub mod cross_entropy;
mod dispatch;
pub mod embedding;
pub mod head_loss;
pub mod heads;
pub mod nf4;
pub mod rmsnorm;
pub mod rope;
pub mod segments;
pub mod softcap;
pub mod softmax;
pub mod swiglu;
pub mod tokens;

pub use attention::{causal_attention, causal_attention_window, segment_attention, segment_attention_window, AttnDims};
pub use bias::{bias_add, linear_bias};
pub use cross_entropy::{cross_entropy, cross_entropy_tokens};
pub use embedding::{embedding, embedding_tokens};
pub use head_loss::{
    head_logprobs, head_logprobs_sharded, head_loss, head_loss_sharded, HeadLossOptions, HeadRowsOptions, LossChunks, LossScale,
    VocabShards,
};
pub use heads::HeadLayout;
pub use rmsnorm::{rms_norm, rms_norm_offset};
pub use rope::{rope, rope_at};
pub use segments::Segments;
pub use softcap::softcap;
pub use softmax::softmax_last;
pub use swiglu::{geglu, glu, swiglu, Glu};
pub use tokens::Tokens;
