//! Packing against `--no-pack` on a length-skewed chat set, on the CPU: the trainer's real
//! (not padding) tokens per second, the packing efficiency, and the attention FLOPs each mode
//! computes against a dense causal mask over its rows (issue 42, "Speed of packing"; recorded in
//! docs/BENCHMARKS.md).
//!
//!     cargo run --release --example bench_packing -- --seq-len 512 --steps 8
//!
//! The conversations are synthetic (random ids; the second half of each trained), with lengths
//! drawn from a log-normal distribution (sigma 1: long-tailed) whose mean is a quarter of
//! `--seq-len`, clipped to [8, seq_len]. Both modes train the same model (the tiny preset with
//! `max_position_embeddings = --seq-len`) through the same trainer and single-device engine as
//! `finetune`: packed rows run segment attention (each conversation attends only to itself, its
//! positions restarting at 0), unpacked rows one conversation each, padded, with plain causal
//! attention over the whole row. Attention FLOPs per row: dense causal = T(T+1)/2 query-key
//! pairs; packed = the sum over the row's segments (padding included) of L(L+1)/2.
use clap::Parser;
use ferrolm::data::chat::{pack, Example, PackOptions, PackedData};
use ferrolm::nn::LlamaConfig;
use ferrolm::tensor::Rng;
use ferrolm::train::{TrainOptions, TrainSet, Trainer};
use ferrolm::{DType, Device, Llama};
use std::sync::Arc;
use std::time::Instant;

#[derive(Parser)]
#[command(about = "Packed against unpacked fine-tuning throughput on a length-skewed chat set (CPU)")]
struct Args {
    /// Row length T (the mean conversation is T/4 tokens)
    #[arg(long, default_value = "512")]
    seq_len: usize,
    /// Conversations in the set
    #[arg(long, default_value = "2000")]
    conversations: usize,
    /// Rows per step
    #[arg(long, default_value = "4")]
    batch_size: usize,
    /// Timed steps per mode (after one untimed)
    #[arg(long, default_value = "8")]
    steps: usize,
    #[arg(long, default_value = "1")]
    seed: u64,
}

/// The query-key pairs causal attention computes over a row whose segments end at `cu`.
fn pairs(cu: &[u32]) -> u64 {
    cu.windows(2).map(|w| (w[1] - w[0]) as u64).map(|l| l * (l + 1) / 2).sum()
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let cfg = LlamaConfig { max_position_embeddings: a.seq_len, ..LlamaConfig::preset("tiny")? };
    let t = a.seq_len;
    let mut rng = Rng::new(a.seed);
    // Log-normal with sigma 1 has mean exp(mu + 1/2): mu puts the mean at T/4.
    let mu = (t as f64 / 4.0).ln() - 0.5;
    let examples: Vec<Example> = (0..a.conversations)
        .map(|_| {
            let len = ((mu + rng.normal()).exp().round() as usize).clamp(8, t);
            Example {
                ids: (0..len).map(|_| 2 + rng.below(cfg.vocab_size as u64 - 2) as u32).collect(),
                trained: (0..len).map(|i| i >= len / 2).collect(),
            }
        })
        .collect();
    let mean = examples.iter().map(|e| e.ids.len()).sum::<usize>() as f64 / examples.len() as f64;
    println!(
        "{} conversations, mean {mean:.0} tokens (--seq-len {t}), longest {}; tiny model, batch {} rows, {} timed steps",
        examples.len(),
        examples.iter().map(|e| e.ids.len()).max().unwrap_or(0),
        a.batch_size,
        a.steps
    );
    println!("| mode | rows | packing efficiency | real tokens/s | attention pairs computed / dense |");
    println!("|---|---:|---:|---:|---:|");
    let mut speeds = Vec::new();
    for packed in [true, false] {
        let data = pack(examples.clone(), &PackOptions { seq_len: t, pack: packed, truncate: false, pad_id: 1 })?;
        let (computed, dense) = attention(&data, packed);
        let tok_s = train(&a, &cfg, data.clone())?;
        speeds.push(tok_s);
        println!(
            "| {} | {} | {:.1}% | {tok_s:.0} | {:.3} |",
            if packed { "packed" } else { "--no-pack" },
            data.num_rows(),
            100.0 * data.stats().efficiency(),
            computed as f64 / dense as f64
        );
    }
    println!("packed / --no-pack: {:.2}x real tokens/s", speeds[0] / speeds[1]);
    Ok(())
}

/// (query-key pairs the mode computes, pairs a dense causal mask over the same rows computes).
fn attention(data: &PackedData, packed: bool) -> (u64, u64) {
    let t = data.seq_len() as u64;
    let dense = data.num_rows() as u64 * t * (t + 1) / 2;
    if !packed {
        return (dense, dense); // one conversation a row: plain causal attention over the row
    }
    ((0..data.num_rows()).map(|i| pairs(&data.row(i).cu_seqlens)).sum(), dense)
}

/// Real tokens per second over `a.steps` steps after one untimed step.
fn train(a: &Args, cfg: &LlamaConfig, data: PackedData) -> anyhow::Result<f64> {
    let opts = TrainOptions { batch_size: a.batch_size, seq_len: a.seq_len, ..TrainOptions::for_run(a.steps + 1, 1e-3) };
    let mut model = Llama::new(cfg.clone(), DType::F32, Device::Cpu, &mut Rng::new(a.seed))?;
    let engine = ferrolm::parallel::attach(&mut model, None, &ferrolm::parallel::Parallelism::single(), Trainer::adamw_config(&opts))?;
    let out = std::env::temp_dir().join(format!("ferrolm-bench-packing-{}", std::process::id()));
    let set = TrainSet::Rows { train: Arc::new(data), val: None };
    let mut trainer = Trainer::with_engine_on(model, Box::new(engine), &set, opts, &out)?;
    trainer.train_step()?;
    let (t0, n0) = (Instant::now(), trainer.tokens_seen());
    for _ in 0..a.steps {
        trainer.train_step()?;
    }
    let tok_s = (trainer.tokens_seen() - n0) as f64 / t0.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&out);
    Ok(tok_s)
}
