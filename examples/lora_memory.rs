//! The memory estimator's prediction for LoRA and QLoRA against full fine-tuning (docs/LORA.md,
//! "QLoRA"; docs/BENCHMARKS.md, "LoRA memory"): a Llama 3 8B (hidden 4096, 32 layers, 8
//! key/value heads, vocabulary 128256) in bf16 on one GPU, one sequence per micro-batch, with and
//! without activation checkpointing. Full fine-tuning holds bf16 weights, f32 gradients, AdamW's
//! m and v and f32 master weights (16 bytes a parameter); LoRA holds the bf16 weights frozen (2
//! bytes a parameter) and the f32 adapters with their gradients, m and v (16 bytes an adapter
//! element); QLoRA holds the blocks' linear weights in NF4 (4.127 bits a parameter) and one of
//! them dequantized at a time. Then QLoRA at the LLaMA shapes of published figures (the QLoRA
//! paper's and LLaMA-Factory's), beside them. Pure arithmetic: the same
//! `planner::memory::estimate` the training tools print before a run
//! (`planner::memory::lora_memory_tables`; tests/documented_numbers.rs checks the documents
//! quote its lines at the defaults).
//!
//!   cargo run --release --example lora_memory -- [--lora-rank 16] [--seq-len 2048]
use clap::Parser;
use ferrolm::planner::memory::lora_memory_tables;
use ferrolm::AnyResult;

#[derive(Parser, Debug)]
#[command(
    name = "lora_memory",
    about = "Predicted peak memory of an 8B Llama fine-tuned in full, with LoRA and with QLoRA on one GPU, and QLoRA beside published figures"
)]
struct Args {
    /// The adapters' rank (on all seven projections of every block)
    #[arg(long, default_value = "16")]
    lora_rank: usize,
    /// Tokens per sequence (one sequence per micro-batch)
    #[arg(long, default_value = "2048")]
    seq_len: usize,
}

fn main() -> AnyResult<()> {
    let a = Args::parse();
    for line in lora_memory_tables(a.lora_rank, a.seq_len)? {
        println!("{line}");
    }
    Ok(())
}
