//! What the trainer, ZeRO, the flat buckets and generation use of a causal language model: its
//! parameters through the visitors (named and described by the parameter spec, `crate::spec`),
//! its forward to logits or to the loss, its config, dtype and device. They take
//! `&dyn CausalLm`, not the concrete model, so a model is anything that answers these.
use crate::config::LlamaConfig;
use crate::kv_cache::KvCache;
use crate::llama::{Llama, Packing};
use crate::lora::LoraConfig;
use crate::module::{HeadOp, ParamKind, ParamVisitor};
use ferrolm_ops::nf4::QuantSpec;
use ferrolm_ops::{LossChunks, LossScale, Tokens};
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
    /// The final normed hidden states (B, T, C) of i32 ids (B, T), of packed rows with a
    /// packing: what an objective's head reads.
    fn hidden_states(&self, ids: Tokens, packing: Option<&Packing>) -> Result<Tensor>;
    /// Logits (B, T, V) of i32 ids (B, T).
    fn logits(&self, ids: Tokens) -> Result<Tensor>;
    /// The mean loss of `inputs` against aligned `targets` (-100 ignored).
    fn loss(&self, inputs: Tokens, targets: Tokens) -> Result<Tensor> {
        self.loss_with(inputs, targets, None, LossScale::Mean)
    }
    /// The loss of `inputs` against aligned `targets` (-100 ignored), of packed rows with a
    /// packing, scaled as `scale` says.
    fn loss_with(&self, inputs: Tokens, targets: Tokens, packing: Option<&Packing>, scale: LossScale) -> Result<Tensor>;
    /// Logits (B, T, V) of ids that continue the sequences held in `cache`, which it extends.
    fn forward_with_cache(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor>;
    /// The head an objective applies to `hidden_states`: how it computes (dense or
    /// vocabulary-parallel), its weight (V, C), and how its loss walks the tokens.
    fn head(&self) -> (&dyn HeadOp, &Tensor, LossChunks);
    /// Every parameter's element count (this rank's shards under TP).
    fn num_params(&self) -> usize;
    /// Whether the residual branches are recomputed in the backward (activation checkpointing).
    fn activation_checkpointing(&self) -> bool;
    /// LoRA's settings when the model carries adapters.
    fn lora_config(&self) -> Option<&LoraConfig>;
    /// LoRA's adapters (name, tensor), empty without LoRA.
    fn adapters(&self) -> Vec<(String, Tensor)>;
    /// Sets the count of training forwards LoRA's dropout masks are drawn from (an exact
    /// `--resume` restores it); nothing without LoRA.
    fn set_lora_forwards(&self, n: u64);
    /// How the frozen base's linear weights are held 4-bit (QLoRA), when they are: what the
    /// memory check charges for them.
    fn quant_spec(&self) -> Option<QuantSpec> {
        None
    }
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
    fn hidden_states(&self, ids: Tokens, packing: Option<&Packing>) -> Result<Tensor> {
        Llama::hidden_states(self, ids, packing)
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
    fn head(&self) -> (&dyn HeadOp, &Tensor, LossChunks) {
        (self.head_op.as_ref(), self.head_weight(), self.loss_chunks)
    }
    fn num_params(&self) -> usize {
        Llama::num_params(self)
    }
    fn activation_checkpointing(&self) -> bool {
        Llama::activation_checkpointing(self)
    }
    fn lora_config(&self) -> Option<&LoraConfig> {
        Llama::lora_config(self)
    }
    fn adapters(&self) -> Vec<(String, Tensor)> {
        Llama::adapters(self)
    }
    fn set_lora_forwards(&self, n: u64) {
        Llama::set_lora_forwards(self, n)
    }
    fn quant_spec(&self) -> Option<QuantSpec> {
        self.quant_base().map(|q| QuantSpec { quant_type: q.quant_type, double_quant: q.double_quant, ..QuantSpec::QLORA })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrolm_tensor::Rng;

    /// Through the trait: the head applied to the hidden states gives the logits, the loss is
    /// the model's, and the visitors see the spec's parameters in its order.
    #[test]
    fn a_model_through_the_trait() {
        let cfg = LlamaConfig::from_json_str(
            r#"{"model_type":"qwen2","vocab_size":32,"hidden_size":16,"intermediate_size":24,"num_hidden_layers":2,
                "num_attention_heads":2,"num_key_value_heads":1,"tie_word_embeddings":true}"#,
        )
        .unwrap();
        let model = Llama::new(cfg.clone(), DType::F32, Device::Cpu, &mut Rng::new(7)).unwrap();
        let head = model.embed_tokens.weight.clone();
        let mut m: Box<dyn CausalLm> = Box::new(model);
        let ids = Tokens::upload(vec![1, 5, 9, 3, 2, 7], vec![2, 3], Device::Cpu).unwrap();
        let logits = m.logits(ids.clone()).unwrap().to_vec_f64().unwrap();
        let via_hidden = m.hidden_states(ids.clone(), None).unwrap().linear(&head).unwrap().to_vec_f64().unwrap();
        assert_eq!(logits, via_hidden);
        let targets = Tokens::upload(vec![5, 9, -100, 2, 7, 1], vec![2, 3], Device::Cpu).unwrap();
        let loss = m.loss_with(ids, targets, None, LossScale::Mean).unwrap().item().unwrap();
        assert!(loss.is_finite() && loss > 0.0, "{loss}");
        let mut names = Vec::new();
        m.visit_params_mut(&mut |p, _| {
            names.push(p.name.to_string());
            Ok(())
        })
        .unwrap();
        assert_eq!(names, cfg.param_specs().into_iter().map(|s| s.name).collect::<Vec<_>>());
        assert_eq!(m.trainable_parameters().len(), names.len());
    }
}
