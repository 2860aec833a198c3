//! What the trainer, ZeRO, the flat buckets and generation use of a causal language model: its
//! parameters through the visitors (named and described by the parameter spec, `crate::spec`),
//! its forward to logits or to the loss, its config, dtype and device. They take
//! `&dyn CausalLm`, not the concrete model, so a model is anything that answers these.
use crate::config::LlamaConfig;
use crate::kv_cache::KvCache;
use crate::llama::{Llama, Packing};
use crate::module::{ParamKind, ParamVisitor};
use ferrolm_ops::{LossScale, Tokens};
use ferrolm_tensor::{DType, Device, Result, Tensor};

pub trait CausalLm {
    /// The config the model was built from (its parameter spec is `config().param_specs()`).
    fn config(&self) -> &LlamaConfig;
    fn dtype(&self) -> DType;
    fn device(&self) -> Device;
    /// Every parameter with its spec, in the spec's order; `f` may replace the tensor.
    fn visit_params_mut(&mut self, f: &mut ParamVisitor) -> Result<()>;
    /// The parameters training updates (LoRA's adapters when the model has them, else every
    /// parameter), as `visit_params_mut` gives them.
    fn visit_trainable_mut(&mut self, f: &mut ParamVisitor) -> Result<()>;
    /// The trainable parameters with their names and kinds.
    fn trainable_parameters(&self) -> Vec<(String, Tensor, ParamKind)>;
    /// Logits (B, T, V) of i32 ids (B, T).
    fn logits(&self, ids: Tokens) -> Result<Tensor>;
    /// The loss of `inputs` against aligned `targets` (-100 ignored), of packed rows with a
    /// packing, scaled as `scale` says.
    fn loss_with(&self, inputs: Tokens, targets: Tokens, packing: Option<&Packing>, scale: LossScale) -> Result<Tensor>;
    /// Logits (B, T, V) of ids that continue the sequences held in `cache`, which it extends.
    fn forward_with_cache(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor>;
}

impl CausalLm for Llama {
    fn config(&self) -> &LlamaConfig {
        Llama::config(self)
    }
    fn dtype(&self) -> DType {
        Llama::dtype(self)
    }
    fn device(&self) -> Device {
        Llama::device(self)
    }
    fn visit_params_mut(&mut self, f: &mut ParamVisitor) -> Result<()> {
        Llama::visit_params_mut(self, f)
    }
    fn visit_trainable_mut(&mut self, f: &mut ParamVisitor) -> Result<()> {
        Llama::visit_trainable_mut(self, f)
    }
    fn trainable_parameters(&self) -> Vec<(String, Tensor, ParamKind)> {
        Llama::trainable_parameters(self)
    }
    fn logits(&self, ids: Tokens) -> Result<Tensor> {
        Llama::forward(self, ids)
    }
    fn loss_with(&self, inputs: Tokens, targets: Tokens, packing: Option<&Packing>, scale: LossScale) -> Result<Tensor> {
        Llama::loss_with(self, inputs, targets, packing, scale)
    }
    fn forward_with_cache(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        Llama::forward_with_cache(self, ids, cache)
    }
}
