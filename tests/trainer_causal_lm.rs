//! The trainer takes what it uses of a model, the `CausalLm` trait, not the concrete decoder
//! (issue 51, "no concrete `Llama` type where the parameter visitors suffice"): a model that is
//! only reachable through the trait trains, with the decoder's own losses bit for bit, and its
//! checkpoint is the decoder's.
mod common;
use common::root;
use ferrolm::data::{list_shards, prepare_text_dir, Tokenizer};
use ferrolm::nn::{CausalLm, KvCache, LlamaConfig, LoraConfig, Packing};
use ferrolm::ops::{LossChunks, LossScale, Tokens};
use ferrolm::train::{TrainOptions, Trainer};
use ferrolm::{DType, Device, Llama, Result, Tensor};
use ferrolm_nn::module::{HeadOp, ParamKind, ParamVisitor};
use ferrolm_tensor::Rng;
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

fn model(vocab: usize) -> Llama {
    let cfg = LlamaConfig::from_json_str(&format!(
        r#"{{"model_type":"llama","vocab_size":{vocab},"hidden_size":32,"intermediate_size":64,"num_hidden_layers":2,
            "num_attention_heads":4,"num_key_value_heads":2,"max_position_embeddings":64,"tie_word_embeddings":true}}"#
    ))
    .unwrap();
    Llama::new(cfg, DType::F32, Device::Cpu, &mut Rng::new(7)).unwrap()
}

#[test]
fn a_model_seen_only_through_causal_lm_trains_as_the_decoder() {
    let tmp = std::env::temp_dir().join(format!("ferrolm-trainer-trait-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let tok_path = root().join("data/tokenizer.json");
    let tok = Tokenizer::from_file(&tok_path).unwrap();
    prepare_text_dir(root().join("data/corpus/sonnets.txt"), &tok, tmp.join("shards"), 0.1, 1 << 20).unwrap();
    let train = list_shards(tmp.join("shards"), "train").unwrap();
    let val = list_shards(tmp.join("shards"), "val").unwrap();
    let opts = TrainOptions { steps: 4, grad_accum: 2, warmup_steps: 1, ..common::opts(4) };

    let mut plain = Trainer::new(model(tok.vocab_size()), &train, &val, opts.clone(), &tmp.join("plain")).unwrap();
    let opaque = Opaque { inner: model(tok.vocab_size()), losses: Cell::new(0) };
    let mut through: Trainer<Opaque> = Trainer::new(opaque, &train, &val, opts, &tmp.join("trait")).unwrap();
    let mut losses = Vec::new();
    for step in 0..4 {
        let (a, ..) = plain.train_step().unwrap();
        let (b, ..) = through.train_step().unwrap();
        assert_eq!(a.to_bits(), b.to_bits(), "step {step}: the decoder's loss {a}, through the trait {b}");
        losses.push(b);
    }
    assert!(losses[3] < losses[0], "training lowers the loss: {losses:?}");
    // Two micro-batches a step, each one forward through the trait's loss.
    assert_eq!(through.model.losses.get(), 8, "every micro-batch's loss went through CausalLm::loss_with");
    assert_eq!(through.validation(4).unwrap().loss.to_bits(), plain.validation(4).unwrap().loss.to_bits());

    // The checkpoint of the opaque model is the decoder's, and loads as one.
    let dir = through.save_checkpoint().unwrap();
    let back = Llama::from_pretrained(&dir, DType::F32, Device::Cpu).unwrap();
    for ((n, a), (_, b)) in back.parameters().iter().zip(plain.model.parameters().iter()) {
        assert_eq!(a.to_vec_f32().unwrap(), b.to_vec_f32().unwrap(), "{n}");
    }
    let _ = std::fs::remove_dir_all(&tmp);
}
