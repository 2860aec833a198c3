//! Training throughput of the CPU backend on fixed shapes, and f32 GEMM on the model's shapes:
//! the ferrolm side of `scripts/bench_cpu_vs_torch.py`, which runs PyTorch on the same shapes.
//!
//!     cargo run --release --example bench_train_cpu -- --shape cpu-small --steps 6
//!     cargo run --release --example bench_train_cpu -- --gemm
//!
//! A step is the trainer's step: the loss of one micro-batch of random tokens, backward, global
//! gradient-norm clipping at 1.0 and AdamW, through the same single-device engine as
//! `pretrain_llama` (so `--dtype bf16` keeps f32 master weights). Prints one JSON line per
//! shape (`tokens_per_s` is the median over the timed steps) or per GEMM shape (`gflops`).
use clap::Parser;
use ferrolm::nn::optim::AdamWConfig;
use ferrolm::nn::LlamaConfig;
use ferrolm::tensor::{no_grad, Rng};
use ferrolm::{DType, Device, Llama, Tensor};
use ferrolm_parallel::zero::{Placement, Zero};
use ferrolm_parallel::TrainEngine;
use std::time::Instant;

#[derive(Parser)]
#[command(about = "CPU training and GEMM throughput on the shapes of the PyTorch comparison")]
struct Args {
    /// tiny (the preset, batch 16 x 128), cpu-small (hidden 256, 4 layers, batch 8 x 256) or
    /// 124m (12 layers, hidden 768, vocabulary 32000, batch 2 x 512)
    #[arg(long, default_value = "cpu-small")]
    shape: String,
    /// Timed steps (after `--warmup` untimed ones)
    #[arg(long, default_value = "6")]
    steps: usize,
    #[arg(long, default_value = "1")]
    warmup: usize,
    /// f32, or bf16 with f32 master weights
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Measure GEMM (`Tensor::matmul` in --dtype) on the model's shapes instead of training
    #[arg(long)]
    gemm: bool,
}

/// (config, batch, seq) of a named shape.
pub fn shape(name: &str) -> anyhow::Result<(LlamaConfig, usize, usize)> {
    let tiny = LlamaConfig::preset("tiny")?;
    Ok(match name {
        "tiny" => (tiny, 16, 128),
        "cpu-small" => (
            LlamaConfig {
                vocab_size: 4096,
                hidden_size: 256,
                intermediate_size: 688,
                num_hidden_layers: 4,
                num_attention_heads: 8,
                num_key_value_heads: 4,
                head_dim: 32,
                max_position_embeddings: 256,
                ..tiny
            },
            8,
            256,
        ),
        "124m" => (
            LlamaConfig {
                vocab_size: 32000,
                hidden_size: 768,
                intermediate_size: 2048,
                num_hidden_layers: 12,
                num_attention_heads: 12,
                num_key_value_heads: 12,
                head_dim: 64,
                max_position_embeddings: 512,
                ..tiny
            },
            2,
            512,
        ),
        _ => anyhow::bail!("--shape {name:?}: expected tiny, cpu-small or 124m"),
    })
}

fn dtype(args: &Args) -> anyhow::Result<DType> {
    Ok(match args.dtype.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        d => anyhow::bail!("--dtype {d:?}: expected f32 or bf16"),
    })
}

fn train(args: &Args) -> anyhow::Result<()> {
    let (cfg, batch, seq) = shape(&args.shape)?;
    let dtype = dtype(args)?;
    let rng = &mut Rng::new(0);
    let mut model = Llama::new(cfg.clone(), dtype, Device::Cpu, rng)?;
    let mut engine = Zero::single(&mut model, AdamWConfig::default(), Placement::Device)?;
    let mut ids = |n: usize| -> Vec<i32> { (0..n).map(|_| (rng.next_u64() % cfg.vocab_size as u64) as i32).collect() };
    let mut times = Vec::new();
    let mut losses = Vec::new();
    for s in 0..args.warmup + args.steps {
        let x = Tensor::from_vec(ids(batch * seq), [batch, seq], Device::Cpu)?;
        let y = Tensor::from_vec(ids(batch * seq), [batch, seq], Device::Cpu)?;
        let t0 = Instant::now();
        let mut loss = 0.0;
        engine.micro_batch(true, &mut || {
            let l = model.loss(&x, &y)?;
            loss = l.item()?;
            Ok(l)
        })?;
        engine.step(1e-3, 1.0, loss)?;
        if s >= args.warmup {
            times.push(t0.elapsed().as_secs_f64());
        }
        losses.push(loss);
    }
    times.sort_by(f64::total_cmp);
    let med = times[times.len() / 2];
    let tok = (batch * seq) as f64;
    println!(
        "{}",
        serde_json::json!({"shape": args.shape, "dtype": args.dtype, "batch": batch, "seq": seq,
            "params": model.num_params(), "threads": rayon_threads(), "step_s": med,
            "tokens_per_s": tok / med, "best_tokens_per_s": tok / times[0], "losses": losses})
    );
    Ok(())
}

fn rayon_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))
}

/// The GEMMs of a training step of cpu-small and 124m: (m, k, n, lhs transposed, what).
pub const GEMM_SHAPES: &[(usize, usize, usize, bool, &str)] = &[
    (2048, 256, 256, false, "cpu-small x @ W_q"),
    (2048, 256, 688, false, "cpu-small x @ W_up"),
    (2048, 688, 256, false, "cpu-small h @ W_down"),
    (2048, 256, 4096, false, "cpu-small lm head"),
    (256, 2048, 688, true, "cpu-small x^T @ dY"),
    (1024, 768, 768, false, "124m x @ W_q"),
    (1024, 768, 2048, false, "124m x @ W_up"),
    (1024, 2048, 768, false, "124m h @ W_down"),
    (1024, 768, 32000, false, "124m lm head"),
    (768, 1024, 2048, true, "124m x^T @ dY"),
];

fn gemm(args: &Args) -> anyhow::Result<()> {
    let rng = &mut Rng::new(0);
    let dt = dtype(args)?;
    let _g = no_grad();
    for &(m, k, n, ta, what) in GEMM_SHAPES {
        let a = Tensor::randn(if ta { [k, m] } else { [m, k] }, 1.0, dt, Device::Cpu, rng)?;
        let b = Tensor::randn([k, n], 1.0, dt, Device::Cpu, rng)?;
        let a = if ta { a.t()? } else { a };
        let mut ts = Vec::new();
        let start = Instant::now();
        while ts.len() < 5 || (start.elapsed().as_secs_f64() < 0.5 && ts.len() < 100) {
            let t = Instant::now();
            std::hint::black_box(a.matmul(&b)?);
            ts.push(t.elapsed().as_secs_f64());
        }
        ts.sort_by(f64::total_cmp);
        let gflops = 2.0 * (m * k * n) as f64 / ts[ts.len() / 2] / 1e9;
        println!("{}", serde_json::json!({"m": m, "k": k, "n": n, "transposed_lhs": ta, "what": what, "gflops": gflops}));
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.gemm {
        gemm(&args)
    } else {
        train(&args)
    }
}
