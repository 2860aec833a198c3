//! Trains a LoRA adapter with ferrolm on a committed base fixture and writes it in PEFT's format,
//! for the round trip `scripts/make_lora_fixtures.py --trained` then checks in PEFT:
//!
//!   cargo run -p ferrolm-nn --example train_lora -- tests/fixtures/lora_trained
//!   .venv/bin/python scripts/make_lora_fixtures.py --trained
//!
//! The base is tests/fixtures/llama_gqa_untied; rank 4 on every projection, AdamW (lr 1e-2, no
//! decay) for 30 steps on the base fixture's tokens, every next token trained.
use clap::Parser;
use ferrolm_nn::lora::{LoraConfig, Proj};
use ferrolm_nn::optim::{AdamW, AdamWConfig};
use ferrolm_nn::safetensors_io::load_safetensors;
use ferrolm_nn::{shift_labels, Llama};
use ferrolm_tensor::{DType, Device, Rng, Tensor};
use std::path::{Path, PathBuf};

/// Train a LoRA adapter on tests/fixtures/llama_gqa_untied and write it as a PEFT adapter
/// directory (adapter_config.json, adapter_model.safetensors).
#[derive(Parser)]
#[command(name = "train_lora")]
struct Args {
    /// Output directory (created if needed)
    dir: PathBuf,
}

const BASE: &str = "tests/fixtures/llama_gqa_untied";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Args { dir } = Args::parse();
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(BASE);
    let mut m = Llama::from_pretrained(&base, DType::F32, Device::Cpu)?;
    m.add_lora(&LoraConfig::new(4, None, 0.0, Proj::ALL.to_vec(), false)?, &mut Rng::new(5))?;
    let r = load_safetensors(&base.join("reference.safetensors"), DType::F32, Device::Cpu)?;
    let ids = &r["input_ids"];
    let (b, t) = (ids.dim(0), ids.dim(1));
    let targets = Tensor::from_vec(shift_labels(&ids.to_vec::<i32>()?, t), vec![b, t], Device::Cpu)?;
    let mut opt = AdamW::new(&m.trainable_parameters(), AdamWConfig { weight_decay: 0.0, ..AdamWConfig::default() })?;
    let mut first = None;
    let mut last = 0.0;
    for _ in 0..30 {
        let loss = m.loss(ids, &targets)?;
        loss.backward()?;
        opt.step(1e-2)?;
        opt.zero_grad();
        last = loss.item()?;
        first.get_or_insert(last);
    }
    m.save_adapter(&dir, BASE)?;
    println!("wrote {}: training loss {:.4} -> {last:.4}", dir.display(), first.unwrap_or(last));
    Ok(())
}
