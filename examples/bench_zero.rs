//! ZeRO/AMSP benchmark: the step time and exposed communication of ZeRO-1, ZeRO-2, ZeRO-3,
//! MiCS, AMSP (s_p = s_g = ranks per node, s_os = world) and the planner's layout on CPU thread
//! ranks behind a simulated two-level link (fast inside a "node", slow between nodes), at one
//! memory cap; and the planner's modelled step time beside each measured one.
//!
//!   cargo run --release --example bench_zero -- [--nodes 2 --ranks-per-node 2] [--steps 3]
//!
//! Compute is calibrated once (the plain data-parallel step without a link); everything else the
//! planner predicts from the link parameters, the model and the layout. Exposed communication =
//! step time behind the link - step time of the same layout without it.
use clap::Parser;
use ferrolm::cli::{env_help, positive, LogArgs, Tool, ENV_CALLER_RESOLVE_HELP, ENV_COMMON};
use ferrolm::nn::optim::AdamWConfig;
use ferrolm::nn::{Llama, LlamaConfig};
use ferrolm::planner::cost::{Link, LinkModel};
use ferrolm::planner::step::{evaluate, search};
use ferrolm::planner::{Cluster, ModelShape, Workload};
use ferrolm::{AnyResult, DType, Device, Tensor};
use ferrolm_parallel::zero::{Placement, ShardSpec, Zero};
use ferrolm_parallel::{CommOptions, Communicator, DeviceMesh, SimLink, ThreadComm};
use ferrolm_tensor::Rng;
use std::sync::Arc;
use std::time::Instant;

#[derive(Parser, Debug, Clone)]
#[command(
    name = "bench_zero",
    about = "ZeRO/AMSP layouts on CPU thread ranks behind a simulated two-level link: measured step time and exposed \
             communication beside the planner's prediction, at one memory cap",
    after_help = env_help(&[
        ENV_COMMON,
        ENV_CALLER_RESOLVE_HELP
    ])
)]
struct Args {
    /// Simulated nodes
    #[arg(long, default_value = "2", value_parser = positive)]
    nodes: usize,
    /// Ranks per node
    #[arg(long, default_value = "2", value_parser = positive)]
    ranks_per_node: usize,
    /// Hidden size
    #[arg(long, default_value = "256", value_parser = positive)]
    hidden: usize,
    /// Transformer layers
    #[arg(long, default_value = "4", value_parser = positive)]
    layers: usize,
    /// Sequences per micro-batch per rank
    #[arg(long, default_value = "2", value_parser = positive)]
    batch_size: usize,
    /// Tokens per sequence
    #[arg(long, default_value = "128", value_parser = positive)]
    seq_len: usize,
    /// Micro-batches per step
    #[arg(long, default_value = "4", value_parser = positive)]
    grad_accum: usize,
    /// Timed steps per layout (after one warm-up step; the median is reported)
    #[arg(long, default_value = "3", value_parser = positive)]
    steps: usize,
    /// Intra-node link: MB/s per rank
    #[arg(long, default_value = "400")]
    intra_mb_s: f64,
    /// Inter-node link: MB/s per rank
    #[arg(long, default_value = "25")]
    inter_mb_s: f64,
    /// Memory cap per rank, MiB (model states + activations as the planner estimates them)
    #[arg(long, default_value = "80")]
    mem_cap_mib: f64,
    /// Measure only these layouts (comma-separated: zero-1, zero-2, zero-3, mics, amsp), for
    /// repeated runs of a few; the planner's pick is always measured
    #[arg(long, value_delimiter = ',', value_parser = ["zero-1", "zero-2", "zero-3", "mics", "amsp"])]
    only: Vec<String>,
    #[command(flatten)]
    log: LogArgs,
}

impl Tool for Args {
    fn log_args(&self) -> &LogArgs {
        &self.log
    }
}

fn config(a: &Args) -> AnyResult<LlamaConfig> {
    let mut c = LlamaConfig::preset("tiny")?;
    c.vocab_size = 4096;
    c.hidden_size = a.hidden;
    c.intermediate_size = a.hidden * 8 / 3 / 64 * 64;
    c.num_hidden_layers = a.layers;
    c.num_attention_heads = a.hidden / 64;
    c.num_key_value_heads = a.hidden / 64;
    c.head_dim = 64;
    c.max_position_embeddings = a.seq_len.max(256);
    c.tie_word_embeddings = false;
    c.validate()?;
    Ok(c)
}

/// Median step time of `spec` and of its optimizer update (max over ranks), behind `link` when
/// given.
fn measure(a: &Args, cfg: &LlamaConfig, spec: ShardSpec, link: Option<LinkModel>) -> AnyResult<(f64, f64)> {
    let world = a.nodes * a.ranks_per_node;
    let mut r = Rng::new(3);
    let n = world * a.batch_size * a.seq_len;
    let ids: Vec<i32> = (0..n).map(|_| r.below(cfg.vocab_size as u64) as i32).collect();
    let out = ThreadComm::run(world, CommOptions::default(), |comm| {
        let comm: Arc<dyn Communicator> = match link {
            Some(l) => SimLink::wrap(comm, l),
            None => comm,
        };
        let mesh = DeviceMesh::new(comm.clone(), 1, world, a.ranks_per_node)?;
        let (rows, d) = (a.batch_size * a.seq_len, mesh.dp_rank());
        let x = Tensor::from_vec(ids[d * rows..(d + 1) * rows].to_vec(), [a.batch_size, a.seq_len], Device::Cpu)?;
        let mut m = Llama::new(cfg.clone(), DType::F32, Device::Cpu, &mut Rng::new(1))?;
        let mut z = Zero::new(&mut m, mesh, spec, None, AdamWConfig::default(), Placement::Device)?;
        ferrolm::planner::calibrate::time_zero_steps(&m, &mut z, comm.as_ref(), &x, a.grad_accum, a.steps)
    })?;
    Ok(out.into_iter().fold((0.0, 0.0), |m, r| (m.0.max(r.0), m.1.max(r.1))))
}

/// Seconds of compute the thread communicator takes per byte a rank sends: all-reduces of 16
/// MiB over every rank, no link, nothing else running.
fn comm_cpu_cost(world: usize) -> AnyResult<f64> {
    let per = ThreadComm::run(world, CommOptions::default(), |c| {
        let x = Tensor::ones([1usize << 22], DType::F32, Device::Cpu)?;
        c.all_reduce(&x, ferrolm_parallel::ReduceOp::Sum)?;
        c.barrier()?;
        let t0 = Instant::now();
        for _ in 0..4 {
            c.all_reduce(&x, ferrolm_parallel::ReduceOp::Sum)?;
        }
        let sent = 4.0 * 2.0 * (world as f64 - 1.0) / world as f64 * (4usize << 22) as f64;
        Ok(t0.elapsed().as_secs_f64() / sent)
    })?;
    Ok(per.into_iter().fold(0.0, f64::max))
}

fn main() {
    ferrolm::cli::main_with(run)
}

fn run(a: Args) -> AnyResult<()> {
    let cfg = config(&a)?;
    let world = a.nodes * a.ranks_per_node;
    let link = LinkModel::two_level(Link::new(20e-6, a.intra_mb_s * 1e6), Link::new(100e-6, a.inter_mb_s * 1e6), a.ranks_per_node);
    let shape = ModelShape::from_config(&cfg, "bench");
    let work = Workload {
        seq: a.seq_len,
        micro_batch: a.batch_size,
        global_batch_tokens: world * a.batch_size * a.seq_len * a.grad_accum,
        tp: 1,
        elem_bytes: 4,
        grad_bytes: 4,
        checkpointed_layers: 0,
        loss_chunks: Default::default(),
    };
    // Calibrate compute and the optimizer's rate: plain data parallelism, no link.
    // The communicator's own CPU cost first: the plain step spends some of its time in it.
    let comm_cpu_s_per_byte = comm_cpu_cost(world)?;
    let plain = ShardSpec::zero(0, world)?;
    let (t_plain, t_update) = measure(&a, &cfg, plain, None)?;
    let padded: Vec<usize> = shape.bucket_params(1).iter().map(|&n| (n as usize).div_ceil(world * 8) * world * 8).collect();
    let plain_sent = ferrolm_parallel::zero::traffic_bytes(plain, world, &padded, &vec![0; padded.len()], 4, a.grad_accum);
    let tokens_per_rank = (a.batch_size * a.seq_len * a.grad_accum) as f64;
    let flops = shape.flops_per_token(a.seq_len) * tokens_per_rank / (t_plain - t_update - plain_sent * comm_cpu_s_per_byte).max(1e-3);
    let update_s_per_elem = t_update / shape.params() as f64;
    // The simulated link sleeps: it takes nothing from compute (thread ranks: no interference).
    let measured = ferrolm::planner::calibrate::Calibration { flops, update_s_per_elem, comm_cpu_s_per_byte };
    let cluster = Cluster::thread_ranks(world, a.ranks_per_node, a.mem_cap_mib * (1u64 << 20) as f64, link, &measured, 0.0);
    let caller = ferrolm_parallel::thread::caller_resolve_from_env()?;
    eprintln!(
        "bench_zero: pending collective inputs are waited for on the {} ({}={})",
        if caller { "launching thread, as NCCL does" } else { "communication thread" },
        ferrolm_parallel::thread::ENV_CALLER_RESOLVE,
        u8::from(caller)
    );
    eprintln!(
        "bench_zero: {} nodes x {} ranks, {:.2} M parameters, {} layers, link intra {} MB/s, inter {} MB/s, cap {} MiB; \
         calibrated compute {:.1} GFLOP/s per rank (plain step {t_plain:.3} s, update {t_update:.3} s), communicator {:.2} ns/byte",
        a.nodes,
        a.ranks_per_node,
        shape.params() as f64 / 1e6,
        a.layers,
        a.intra_mb_s,
        a.inter_mb_s,
        a.mem_cap_mib,
        flops / 1e9,
        comm_cpu_s_per_byte * 1e9
    );
    let ranked = search(&shape, &cluster, &work);
    let planner = ranked.iter().find(|e| e.fits).map(|e| e.spec).ok_or_else(|| anyhow::anyhow!("no layout fits {} MiB", a.mem_cap_mib))?;
    let mut candidates = vec![
        ("ZeRO-1", ShardSpec::zero(1, world)?),
        ("ZeRO-2", ShardSpec::zero(2, world)?),
        ("ZeRO-3", ShardSpec::zero(3, world)?),
        ("MiCS", ShardSpec::mics(a.ranks_per_node)),
    ];
    // AMSP's usual pick (parameters and gradients within a node, optimizer state over the
    // world): its last micro-batch chains collectives, whatever the planner picks on this run.
    let amsp = ShardSpec { params: a.ranks_per_node, grads: a.ranks_per_node, optim: world };
    if !candidates.iter().any(|(_, s)| *s == amsp) {
        candidates.push(("AMSP", amsp));
    }
    if !a.only.is_empty() {
        candidates.retain(|(name, s)| *s == planner || a.only.iter().any(|o| o.eq_ignore_ascii_case(name)));
    }
    if !candidates.iter().any(|(_, s)| *s == planner) {
        candidates.push(("planner", planner));
    }
    println!(
        "{:<8} {:<32} {:>7} {:>9} {:>10} {:>10} {:>10} {:>8}",
        "layout", "spec", "fits", "mem MiB", "step s", "exposed s", "model s", "error"
    );
    let mut rows = Vec::new();
    for (name, spec) in candidates {
        let Some(e) = evaluate(&shape, &cluster, &work, spec) else { continue };
        let (t0, t1) = (measure(&a, &cfg, spec, None)?.0, measure(&a, &cfg, spec, Some(link))?.0);
        let err = (e.step - t1) / t1;
        tracing::debug!("{spec}: no link {t0:.3} s; model compute {:.3} s, exposed {:.3} s, comm {:?}", e.compute, e.exposed, e.comm);
        let name = if spec == planner { format!("{name}*") } else { name.to_string() };
        println!(
            "{:<8} {:<32} {:>7} {:>9.1} {:>10.3} {:>10.3} {:>10.3} {:>7.1}%",
            name,
            spec.to_string(),
            if e.fits { "yes" } else { "no" },
            e.mem.total() / (1u64 << 20) as f64,
            t1,
            t1 - t0,
            e.step,
            err * 100.0
        );
        println!(
            "{}",
            serde_json::json!({"layout": name, "params": spec.params, "grads": spec.grads, "optim": spec.optim, "fits": e.fits,
                "mem_mib": e.mem.total() / (1u64 << 20) as f64, "step_s": t1, "exposed_comm_s": t1 - t0, "model_step_s": e.step})
        );
        rows.push((spec, e.fits, t1, e.step));
    }
    let fastest = rows.iter().filter(|r| r.1).min_by(|a, b| a.2.total_cmp(&b.2)).map(|r| r.0);
    let pick = rows.iter().find(|r| r.0 == planner).expect("measured");
    println!(
        "planner's pick {}: fastest measured layout that fits: {}; modelled step within {:.1}% of measured (* marks the pick)",
        planner,
        if fastest == Some(planner) { "yes".to_string() } else { format!("no ({} is)", fastest.map_or("none".into(), |s| s.to_string())) },
        ((pick.3 - pick.2) / pick.2 * 100.0).abs()
    );
    if caller {
        // Zero means every collective input was ready or chained: the schedule is the default
        // mode's, and any difference in exposed communication between the modes is noise.
        println!("caller-side waits for a pending collective input: {}", ThreadComm::caller_waits());
    }
    Ok(())
}
