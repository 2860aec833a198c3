//! The trainer takes what it uses of a model, the `CausalLm` trait, not the concrete decoder
//! (issue 51, "no concrete `Llama` type where the parameter visitors suffice"): a model that is
//! only reachable through the trait trains, with the decoder's own losses bit for bit, and its
//! checkpoint is the decoder's.
mod common;
use ferrolm::nn::{CausalLm, KvCache, LlamaConfig, LoraConfig, Packing};
use ferrolm::ops::{LossChunks, LossScale, Tokens};
use ferrolm::train::{TrainOptions, Trainer};
use ferrolm::{DType, Device, Llama, Result, Tensor};
use ferrolm_nn::module::{HeadOp, ParamKind, ParamVisitor};
use std::cell::Cell;

/// A model the trainer can only use through `CausalLm`: every call is forwarded to a hidden
/// decoder and counted, so the test sees that training went through the trait.
struct Opaque {
    inner: Llama,
    losses: Cell<usize>,
}

impl CausalLm for Opaque {
    fn config(&self) -> &LlamaConfig {
        self.inner.config()
    }
    fn dtype(&self) -> DType {
        self.inner.dtype()
    }
    fn device(&self) -> Device {
        self.inner.device()
    }
    fn visit_params_mut(&mut self, f: &mut ParamVisitor) -> Result<()> {
        CausalLm::visit_params_mut(&mut self.inner, f)
    }
    fn visit_trainable_mut(&mut self, f: &mut ParamVisitor) -> Result<()> {
        CausalLm::visit_trainable_mut(&mut self.inner, f)
    }
    fn trainable_parameters(&self) -> Vec<(String, Tensor, ParamKind)> {
        self.inner.trainable_parameters()
    }
    fn hidden_states(&self, ids: Tokens, packing: Option<&Packing>) -> Result<Tensor> {
        self.inner.hidden_states(ids, packing)
    }
    fn logits(&self, ids: Tokens) -> Result<Tensor> {
        CausalLm::logits(&self.inner, ids)
    }
    fn loss_with(&self, inputs: Tokens, targets: Tokens, packing: Option<&Packing>, scale: LossScale) -> Result<Tensor> {
        self.losses.set(self.losses.get() + 1);
        self.inner.loss_with(inputs, targets, packing, scale)
    }
    fn forward_with_cache(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        self.inner.forward_with_cache(ids, cache)
    }
    fn head(&self) -> (&dyn HeadOp, &Tensor, LossChunks) {
        CausalLm::head(&self.inner)
    }
    fn num_params(&self) -> usize {
        self.inner.num_params()
    }
    fn activation_checkpointing(&self) -> bool {
        self.inner.activation_checkpointing()
    }
    fn lora_config(&self) -> Option<&LoraConfig> {
        self.inner.lora_config()
    }
    fn adapters(&self) -> Vec<(String, Tensor)> {
        self.inner.adapters()
    }
    fn set_lora_forwards(&self, n: u64) {
        self.inner.set_lora_forwards(n)
    }
}

#[test]
fn a_model_seen_only_through_causal_lm_trains_as_the_decoder() {
    let tmp = common::tmp("trainer-trait");
    let (train, val, vocab) = common::shards(&tmp);
    let opts = TrainOptions { steps: 8, grad_accum: 2, warmup_steps: 1, ..common::opts(8) };

    let mut plain = Trainer::new(common::model(vocab), &train, &val, opts.clone(), &tmp.join("plain")).unwrap();
    let opaque = Opaque { inner: common::model(vocab), losses: Cell::new(0) };
    let mut through: Trainer<Opaque> = Trainer::new(opaque, &train, &val, opts, &tmp.join("trait")).unwrap();
    let before = through.validation(8).unwrap().loss;
    let calls = through.model.losses.get();
    assert!(calls > 0, "validation scores through CausalLm::loss_with");
    for step in 0..8 {
        let (a, ..) = plain.train_step().unwrap();
        let (b, ..) = through.train_step().unwrap();
        assert_eq!(a.to_bits(), b.to_bits(), "step {step}: the decoder's loss {a}, through the trait {b}");
    }
    // Two micro-batches a step, each one forward through the trait's loss.
    assert_eq!(through.model.losses.get() - calls, 16, "every micro-batch's loss went through CausalLm::loss_with");
    let after = through.validation(8).unwrap().loss;
    assert_eq!(after.to_bits(), plain.validation(8).unwrap().loss.to_bits());
    assert!(after < before, "training through the trait lowers the validation loss: {before} -> {after}");

    // The checkpoint of the opaque model is the decoder's, and loads as one.
    let dir = through.save_checkpoint().unwrap();
    let back = Llama::from_pretrained(&dir, DType::F32, Device::Cpu).unwrap();
    for ((n, a), (_, b)) in back.parameters().iter().zip(plain.model.parameters().iter()) {
        assert_eq!(a.to_vec_f32().unwrap(), b.to_vec_f32().unwrap(), "{n}");
    }
    let _ = std::fs::remove_dir_all(&tmp);
}
