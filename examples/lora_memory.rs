//! The memory estimator's prediction for LoRA against full fine-tuning (docs/BENCHMARKS.md,
//! "LoRA memory"): a Llama 3 8B (hidden 4096, 32 layers, 8 key/value heads, vocabulary 128256)
//! in bf16 on one GPU, one sequence per micro-batch, with and without activation checkpointing.
//! Full fine-tuning holds bf16 weights, f32 gradients, AdamW's m and v and f32 master weights (16
//! bytes a parameter); LoRA holds the bf16 weights frozen (2 bytes a parameter) and the f32
//! adapters with their gradients, m and v (16 bytes an adapter element). Pure arithmetic: the
//! same `planner::memory::estimate` the training tools print before a run.
//!
//!   cargo run --release --example lora_memory -- [--lora-rank 16] [--seq-len 2048]
use clap::Parser;
use ferrolm::nn::{LlamaConfig, LoraConfig, Proj};
use ferrolm::planner::memory::{estimate, human, LoraMem, MemParallelism};
use ferrolm::{AnyResult, DType, Device};

#[derive(Parser, Debug)]
#[command(name = "lora_memory", about = "Predicted peak memory of an 8B Llama fine-tuned in full and with LoRA on one GPU")]
struct Args {
    /// The adapters' rank (on all seven projections of every block)
    #[arg(long, default_value = "16")]
    lora_rank: usize,
    /// Tokens per sequence (one sequence per micro-batch)
    #[arg(long, default_value = "2048")]
    seq_len: usize,
}

const LLAMA3_8B: &str = r#"{"model_type":"llama","vocab_size":128256,"hidden_size":4096,"intermediate_size":14336,
    "num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"max_position_embeddings":8192,
    "rope_theta":500000.0,"tie_word_embeddings":false}"#;

fn main() -> AnyResult<()> {
    let a = Args::parse();
    let cfg = LlamaConfig::from_json_str(LLAMA3_8B)?;
    let lora = LoraConfig::new(a.lora_rank, None, 0.0, Proj::ALL.to_vec(), false)?;
    let adapters = LoraMem::new(&lora, cfg.num_hidden_layers);
    println!("Llama 3 8B, bf16, one GPU, 1 x {} tokens; LoRA rank {} on q,k,v,o,gate,up,down", a.seq_len, a.lora_rank);
    println!(
        "| {:<30} | {:>10} | {:>10} | {:>10} | {:>11} | {:>10} |",
        "run", "parameters", "gradients", "optimizer", "activations", "peak"
    );
    println!("|{:-<32}|{:-<12}|{:-<12}|{:-<12}|{:-<13}|{:-<12}|", "", "", "", "", "", "");
    for checkpointing in [false, true] {
        for (name, lora) in [("full fine-tuning", None), ("LoRA", Some(adapters))] {
            let l = MemParallelism { lora, ..MemParallelism::single(checkpointing) };
            let m = estimate(&cfg, DType::BF16, Device::Cuda(0), 1, a.seq_len, 1, &l).expect("sizes fit");
            let name = format!("{name}{}", if checkpointing { ", checkpointed" } else { "" });
            println!(
                "| {name:<30} | {:>10} | {:>10} | {:>10} | {:>11} | {:>10} |",
                human(m.params),
                human(m.grads),
                human(m.optim),
                human(m.activations),
                human(m.total())
            );
        }
    }
    Ok(())
}
