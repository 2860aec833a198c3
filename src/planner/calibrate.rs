//! Calibration: what the models need measured on this machine. For thread ranks (autoconfig's
//! `--target cpu`) the compute throughput, the optimizer's rate and the thread communicator's CPU
//! cost per byte, from timed ZeRO steps of the real model (`calibrate`, as
//! `examples/bench_zero.rs` measures them); for the `plan` tool's `--calibrate`, the latency and
//! bandwidth of the communicator this machine runs (`calibrate_link`).
use super::cost::Link;
use super::shape::ModelShape;
use crate::nn::optim::AdamWConfig;
use crate::nn::{Llama, LlamaConfig};
use crate::{AnyResult, DType, Device, Tensor};
use ferrolm_parallel::zero::{Placement, ShardSpec, Zero};
use ferrolm_parallel::{CommOptions, Communicator, DeviceMesh, ReduceOp, ThreadComm, TrainEngine};
use ferrolm_tensor::Rng;
use serde::Serialize;
use std::time::Instant;

/// What the analytic model needs from this machine.
#[derive(Clone, Debug, Serialize)]
pub struct Calibration {
    /// FLOP/s one rank sustains on the model while every rank computes.
    pub flops: f64,
    pub update_s_per_elem: f64,
    pub comm_cpu_s_per_byte: f64,
}

/// Seconds of compute the thread communicator takes per byte a rank sends (all-reduces of 4
/// MiB over every rank, no link).
fn comm_cpu_cost(world: usize) -> AnyResult<f64> {
    let per = ThreadComm::run(world, CommOptions::default(), |c| {
        let x = Tensor::ones([1usize << 20], DType::F32, Device::Cpu)?;
        c.all_reduce(&x, ReduceOp::Sum)?;
        c.barrier()?;
        let t0 = Instant::now();
        for _ in 0..4 {
            c.all_reduce(&x, ReduceOp::Sum)?;
        }
        let sent = 4.0 * 2.0 * (world as f64 - 1.0) / world as f64 * (4usize << 20) as f64;
        Ok(t0.elapsed().as_secs_f64() / sent)
    })?;
    Ok(per.into_iter().fold(0.0, f64::max))
}

/// Times `steps` ZeRO steps of `grad_accum` micro-batches of `x` (inputs as targets) after one
/// warm-up step; the medians of the step time and of its optimizer update, on this rank. Shared
/// by the calibration here and `examples/bench_zero.rs`.
pub fn time_zero_steps(
    m: &Llama,
    z: &mut Zero,
    comm: &dyn Communicator,
    x: &Tensor,
    grad_accum: usize,
    steps: usize,
) -> ferrolm_tensor::Result<(f64, f64)> {
    let (mut times, mut updates) = (Vec::new(), Vec::new());
    for step in 0..=steps {
        comm.barrier()?;
        let t0 = Instant::now();
        for k in 0..grad_accum {
            z.micro_batch(k + 1 == grad_accum, &mut || m.loss(x, x)?.mul_scalar(1.0 / grad_accum as f64))?;
        }
        z.step(1e-4, 1.0, 0.0)?;
        if step > 0 {
            times.push(t0.elapsed().as_secs_f64());
            updates.push(z.last_update_s);
        }
    }
    times.sort_by(f64::total_cmp);
    updates.sort_by(f64::total_cmp);
    Ok((times[times.len() / 2], updates[updates.len() / 2]))
}

/// Calibrates on `world` thread ranks: plain data parallelism (every rank a whole model), no
/// link, `micro_batch` sequences of `seq`, 3 timed steps after one warm-up (medians).
pub fn calibrate(cfg: &LlamaConfig, world: usize, micro_batch: usize, seq: usize) -> AnyResult<Calibration> {
    let comm_cpu_s_per_byte = comm_cpu_cost(world)?;
    let spec = ShardSpec::zero(0, world)?;
    let mut r = Rng::new(3);
    let rows = micro_batch * seq;
    let ids: Vec<i32> = (0..world * rows).map(|_| r.below(cfg.vocab_size as u64) as i32).collect();
    let out = ThreadComm::run(world, CommOptions::default(), |comm| {
        let mesh = DeviceMesh::new(comm.clone(), 1, world, world)?;
        let dp_rank = mesh.dp_rank();
        let mut m = Llama::new(cfg.clone(), DType::F32, Device::Cpu, &mut Rng::new(1))?;
        let mut z = Zero::new(&mut m, mesh, spec, None, AdamWConfig::default(), Placement::Device)?;
        let x = Tensor::from_vec(ids[dp_rank * rows..(dp_rank + 1) * rows].to_vec(), [micro_batch, seq], Device::Cpu)?;
        let (t, upd) = time_zero_steps(&m, &mut z, comm.as_ref(), &x, 1, 3)?;
        Ok((t, upd, z.bucket_numel()))
    })?;
    let (t, upd) = out.iter().fold((0.0f64, 0.0f64), |m, r| (m.0.max(r.0), m.1.max(r.1)));
    let shape = ModelShape::from_config(cfg, "trial");
    let buckets = &out[0].2;
    let sent = ferrolm_parallel::zero::traffic_bytes(spec, world, buckets, &vec![0; buckets.len()], 4, 1);
    let compute = (t - upd - sent * comm_cpu_s_per_byte).max(1e-4);
    Ok(Calibration {
        flops: shape.flops_per_token(seq) * rows as f64 / compute,
        update_s_per_elem: upd / shape.params() as f64,
        comm_cpu_s_per_byte,
    })
}

/// Latency and bandwidth of the communicator this machine runs, from the times of all-reduces
/// of two sizes over `n` thread ranks (the fit of t = steps * alpha + bytes_per_rank / bw).
pub fn calibrate_link(n: usize) -> AnyResult<Link> {
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
