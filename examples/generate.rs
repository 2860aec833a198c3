//! Sample text from a checkpoint with a KV cache.
//!
//!   cargo run --release --example generate -- --model DIR --prompt TEXT --max-new-tokens N
//!     [--temperature 0.8] [--top-p 0.95] [--seed S] [--device D]
use ferrolm::cli::Flags;
use ferrolm::data::Tokenizer;
use ferrolm::nn::generate::generate;
use ferrolm::{AnyResult, DType, Device, Llama};
use ferrolm_tensor::Rng;
use std::path::Path;

const USAGE: &str =
    "usage: generate --model DIR --prompt TEXT --max-new-tokens N [--temperature T] [--top-p P] [--seed S] [--device cpu|cuda[:N]]";

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> AnyResult<()> {
    let f = Flags::parse(USAGE, &["model", "prompt", "max-new-tokens", "temperature", "top-p", "seed", "device"], &[])?;
    let dir = Path::new(f.required("model")?);
    let prompt = f.required("prompt")?;
    let n: usize = f.get("max-new-tokens", 100)?;
    let temperature: f64 = f.get("temperature", 0.8)?;
    let top_p: f64 = f.get("top-p", 0.95)?;
    if temperature < 0.0 || !(0.0..=1.0).contains(&top_p) || top_p == 0.0 {
        return Err("--temperature must be >= 0 and --top-p in (0, 1]".into());
    }
    let device = ferrolm::pick_device(f.str("device"))?;
    let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))?;
    let dtype = if device == Device::Cpu { DType::F32 } else { DType::BF16 };
    let model = Llama::from_pretrained(dir, dtype, device)?;
    if tokenizer.vocab_size() > model.config().vocab_size {
        return Err(format!(
            "{}: the tokenizer has {} tokens but the model's vocab_size is {}",
            dir.join("tokenizer.json").display(),
            tokenizer.vocab_size(),
            model.config().vocab_size
        )
        .into());
    }
    let ids = tokenizer.encode(prompt, false)?;
    if ids.is_empty() {
        return Err("--prompt encodes to no tokens".into());
    }
    let mut rng = Rng::new(f.get("seed", 0u64)?);
    let out = generate(&model, &ids, n, temperature, top_p, &mut rng)?;
    println!("{prompt}{}", tokenizer.decode(&out)?);
    Ok(())
}
