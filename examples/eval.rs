//! Mean next-token cross-entropy of a checkpoint on a text file.
//!
//!   cargo run --release --example eval -- --model DIR --text FILE --seq-len T [--device D] [--batch-size B]
//!
//! Tokenizes FILE with DIR/tokenizer.json (no special tokens), takes every full window
//! tokens[i*T .. i*T+T+1], and prints as its last line `loss <float> ppl <float> tokens <int>`.
use ferrolm::cli::Flags;
use ferrolm::data::Tokenizer;
use ferrolm::{AnyResult, DType, Device, Llama, Tensor};
use std::io::IsTerminal;
use std::path::Path;

const USAGE: &str = "usage: eval --model DIR --text FILE --seq-len T [--device cpu|cuda[:N]] [--batch-size B]";

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> AnyResult<()> {
    let f = Flags::parse(USAGE, &["model", "text", "seq-len", "device", "batch-size"], &[])?;
    let dir = Path::new(f.required("model")?);
    let text_path = f.required("text")?;
    let t: usize = f.get("seq-len", 0)?;
    if t == 0 {
        return Err(format!("--seq-len must be a positive integer\n{USAGE}").into());
    }
    let bs: usize = f.get("batch-size", 8usize)?.max(1);
    let device = ferrolm::pick_device(f.str("device"))?;
    let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))?;
    let text = std::fs::read_to_string(text_path).map_err(|e| format!("{text_path}: {e}"))?;
    let ids = tokenizer.encode(&text, false)?;
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
    if t > model.config().max_position_embeddings {
        return Err(format!("--seq-len {t} exceeds the model's max_position_embeddings {}", model.config().max_position_embeddings).into());
    }
    let windows = if ids.len() > t { (ids.len() - 1) / t } else { 0 };
    if windows == 0 {
        return Err(format!("{text_path}: {} tokens do not fill one window of {} tokens", ids.len(), t + 1).into());
    }
    let _g = ferrolm::tensor::no_grad();
    let (mut sum, mut n) = (0.0f64, 0usize);
    let tty = std::io::stderr().is_terminal();
    for start in (0..windows).step_by(bs) {
        let b = bs.min(windows - start);
        let (mut x, mut y) = (Vec::with_capacity(b * t), Vec::with_capacity(b * t));
        for w in start..start + b {
            let win = &ids[w * t..w * t + t + 1];
            x.extend(win[..t].iter().map(|&v| v as i32));
            y.extend(win[1..].iter().map(|&v| v as i32));
        }
        let xt = Tensor::from_vec(x, [b, t], device)?;
        let yt = Tensor::from_vec(y, [b, t], device)?;
        sum += model.loss(&xt, &yt)?.item()? * (b * t) as f64;
        n += b * t;
        if tty {
            eprint!("\r{n} / {} predictions", windows * t);
        }
    }
    if tty {
        eprintln!();
    }
    let loss = sum / n as f64;
    println!("loss {loss:.6} ppl {:.4} tokens {n}", loss.exp());
    Ok(())
}
