//! The sharding planner (AMSP's cost model over ferrolm's ZeRO engine): every valid
//! `ShardSpec` for a model and a cluster, ranked by modelled step time among those that fit.
//!
//!   cargo run --release --example plan -- --model 7b --gpus 1024 --gpus-per-node 8 --gpu-mem-gib 80
//!
//! The last line is one JSON object with the chosen layout.
use clap::Parser;
use ferrolm::cli::{env_help, fraction, positive, LogArgs, Tool, ENV_COMMON};
use ferrolm::AnyResult;
use ferrolm_dist::cost::{Link, LinkModel};
use ferrolm_dist::plan::{search, Cluster, Estimate, ModelShape, Workload};
use ferrolm_dist::{CommOptions, ReduceOp, ThreadComm};
use ferrolm_tensor::{DType, Device, Tensor};
use std::path::Path;
use std::time::Instant;

#[derive(Parser, Debug, Clone)]
#[command(
    name = "plan",
    about = "Rank every valid ZeRO/AMSP sharding (ShardSpec) of a model on a cluster by the modelled step time: memory per \
             rank, communication per step, exposed communication after overlap, MFU. The last line is the chosen layout as JSON.",
    after_help = env_help(&[ENV_COMMON])
)]
struct PlanArgs {
    /// Model: a LLaMA preset (7b, 13b, 30b, 70b) or a config.json
    #[arg(long, value_name = "PRESET|FILE")]
    model: String,
    /// GPUs (ranks) in all
    #[arg(long, value_parser = positive)]
    gpus: usize,
    /// GPUs per node
    #[arg(long, default_value = "8", value_parser = positive)]
    gpus_per_node: usize,
    /// Memory per GPU, GiB
    #[arg(long, default_value = "80")]
    gpu_mem_gib: f64,
    /// Intra-node bandwidth per rank and direction, GB/s [default: 150, NVLink 3 (A100/A800) at NCCL's bus bandwidth]
    #[arg(long, value_name = "GB/S")]
    intra_bw: Option<f64>,
    /// Intra-node latency per ring step, microseconds
    #[arg(long, value_name = "US", default_value = "5")]
    intra_latency: f64,
    /// Inter-node bandwidth per rank and direction, GB/s [default: 12.5, 4 x HDR 200 Gb/s per 8 GPUs]
    #[arg(long, value_name = "GB/S")]
    inter_bw: Option<f64>,
    /// Inter-node latency per ring step, microseconds
    #[arg(long, value_name = "US", default_value = "15")]
    inter_latency: f64,
    /// Measure the intra-node link instead: time all-reduces over --calibrate N thread ranks
    /// (the communicator this machine runs) and fit latency and bandwidth [default: off]
    #[arg(long, value_name = "N")]
    calibrate: Option<usize>,
    /// Tokens per sequence
    #[arg(long, default_value = "4096", value_parser = positive)]
    seq_len: usize,
    /// Sequences per micro-batch per rank
    #[arg(long, default_value = "1", value_parser = positive)]
    micro_batch: usize,
    /// Tokens per optimizer step over all ranks
    #[arg(long, default_value = "4194304", value_parser = positive)]
    global_batch_tokens: usize,
    /// Tensor-parallel degree (inside a node)
    #[arg(long, default_value = "1", value_parser = positive)]
    tp: usize,
    /// Transformer layers whose activations are recomputed
    #[arg(long, default_value = "0")]
    checkpointed_layers: usize,
    /// Sustained dense TFLOP/s per GPU on the model's GEMMs [default: 60% of --peak-tflops]
    #[arg(long)]
    tflops: Option<f64>,
    /// Peak dense bf16 TFLOP/s per GPU, for MFU
    #[arg(long, default_value = "312")]
    peak_tflops: f64,
    /// Memory kept free, a fraction of the GPU's
    #[arg(long, default_value = "0.1", value_parser = fraction)]
    margin: f64,
    /// Fraction of overlapped communication that still slows compute
    #[arg(long, default_value = "0.2", value_parser = fraction)]
    interference: f64,
    /// GPU memory bandwidth, GB/s (the optimizer update is memory bound)
    #[arg(long, default_value = "2000")]
    hbm_gb_s: f64,
    /// Rows of the table
    #[arg(long, default_value = "12", value_parser = positive)]
    top: usize,
    #[command(flatten)]
    log: LogArgs,
}

impl Tool for PlanArgs {
    fn log_args(&self) -> &LogArgs {
        &self.log
    }
}

/// Latency and bandwidth of the communicator this machine runs, from the times of all-reduces
/// of two sizes over `n` thread ranks (the fit of t = steps * alpha + bytes_per_rank / bw).
fn calibrate(n: usize) -> AnyResult<Link> {
    let sizes = [1usize << 10, 1 << 22]; // elements of f32: 4 KiB and 16 MiB
    let times = ThreadComm::run(n, CommOptions::default(), |c| {
        let mut out = Vec::new();
        for &s in &sizes {
            let x = Tensor::ones([s], DType::F32, Device::Cpu)?;
            c.all_reduce(&x, ReduceOp::Sum)?; // warm up
            c.barrier()?;
            let t0 = Instant::now();
            for _ in 0..5 {
                c.all_reduce(&x, ReduceOp::Sum)?;
            }
            out.push(t0.elapsed().as_secs_f64() / 5.0);
        }
        Ok(out)
    })?;
    let t = &times[0];
    let steps = 2.0 * (n as f64 - 1.0);
    let bytes = |s: usize| 2.0 * (n as f64 - 1.0) / n as f64 * (s * 4) as f64;
    let bw = (bytes(sizes[1]) - bytes(sizes[0])) / (t[1] - t[0]).max(1e-9);
    let alpha = ((t[0] - bytes(sizes[0]) / bw) / steps).max(0.0);
    Ok(Link::new(alpha, bw))
}

fn row(e: &Estimate) -> String {
    let gib = |b: f64| b / (1u64 << 30) as f64;
    format!(
        "{:<32} {:>5} {:>9.1} {:>9.1} {:>9.1} {:>9.3} {:>9.3} {:>9.3} {:>6.1}%",
        e.spec.to_string(),
        if e.fits { "yes" } else { "no" },
        gib(e.mem.params + e.mem.grads + e.mem.optim),
        gib(e.mem.activations + e.mem.buffers),
        gib(e.mem.total()),
        e.comm_total(),
        e.exposed,
        e.step,
        e.mfu * 100.0
    )
}

fn run(a: PlanArgs) -> AnyResult<()> {
    let model = if Path::new(&a.model).is_file() {
        ModelShape::from_config(&ferrolm::nn::LlamaConfig::from_file(&a.model)?, &a.model)
    } else {
        ModelShape::preset(&a.model)?
    };
    if !a.gpus.is_multiple_of(a.tp) || !a.gpus_per_node.is_multiple_of(a.tp) {
        anyhow::bail!("--tp {} must divide --gpus {} and --gpus-per-node {}", a.tp, a.gpus, a.gpus_per_node);
    }
    let intra = match a.calibrate {
        Some(n) => {
            let l = calibrate(n.max(2))?;
            println!(
                "calibrated over {} thread ranks: {:.1} us per ring step, {:.2} GB/s per rank",
                n.max(2),
                l.alpha_s * 1e6,
                l.bytes_per_s / 1e9
            );
            l
        }
        None => Link::new(a.intra_latency * 1e-6, a.intra_bw.unwrap_or(150.0) * 1e9),
    };
    let inter = Link::new(a.inter_latency * 1e-6, a.inter_bw.unwrap_or(12.5) * 1e9);
    let cluster = Cluster {
        gpus: a.gpus,
        gpus_per_node: a.gpus_per_node,
        mem_bytes: a.gpu_mem_gib * (1u64 << 30) as f64,
        link: LinkModel::two_level(intra, inter, a.gpus_per_node),
        flops: a.tflops.unwrap_or(0.6 * a.peak_tflops) * 1e12,
        peak_flops: a.peak_tflops * 1e12,
        margin: a.margin,
        interference: a.interference,
        update_s_per_elem: 28.0 / (a.hbm_gb_s * 1e9),
        comm_cpu_s_per_byte: 0.0,
        comm_buffer_bytes: ferrolm_dist::plan::NCCL_BYTES_PER_COMMUNICATOR,
    };
    let work = Workload {
        seq: a.seq_len,
        micro_batch: a.micro_batch,
        global_batch_tokens: a.global_batch_tokens,
        tp: a.tp,
        elem_bytes: 2,
        grad_bytes: 4, // f32 main gradients (the trainers' default)
        checkpointed_layers: a.checkpointed_layers,
    };
    let ranked = search(&model, &cluster, &work);
    let Some(best) = ranked.iter().find(|e| e.fits) else {
        anyhow::bail!(
            "no layout of {} fits {} GiB per GPU on {} GPUs (tp {}): add GPUs, checkpoint activations (--checkpointed-layers), or shorten --micro-batch/--seq-len",
            model.name,
            a.gpu_mem_gib,
            a.gpus,
            a.tp
        );
    };
    println!(
        "{}: {:.2}B parameters; {} GPUs ({} per node), tp {}, dp {}; {} micro-batch(es) of {} x {} tokens per step",
        model.name,
        model.params() as f64 / 1e9,
        a.gpus,
        a.gpus_per_node,
        a.tp,
        best.dp,
        best.micro_batches,
        a.micro_batch,
        a.seq_len
    );
    println!(
        "{:<32} {:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7}",
        "spec", "fits", "states", "act+buf", "mem GiB", "comm s", "exposed", "step s", "MFU"
    );
    for e in ranked.iter().take(a.top) {
        println!("{}", row(e));
    }
    println!(
        "{}",
        serde_json::json!({
            "params": best.spec.params, "grads": best.spec.grads, "optim": best.spec.optim,
            "tp": a.tp, "dp": best.dp, "micro_batches": best.micro_batches,
            "mem_gib": best.mem.total() / (1u64 << 30) as f64, "step_s": best.step, "exposed_comm_s": best.exposed, "mfu": best.mfu,
        })
    );
    Ok(())
}

fn main() {
    ferrolm::cli::main_with(run)
}
