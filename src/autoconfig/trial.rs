//! Measured trials on CPU thread ranks behind a simulated two-level link: the calibration the
//! analytic model needs (compute throughput, the optimizer's rate, the thread communicator's
//! CPU cost per byte, as `examples/bench_zero.rs` calibrates them), a few steps of a candidate
//! with the real trainer, and the `train_config.json` that `pretrain_llama --config-from` reads.
use super::Candidate;
use crate::nn::optim::AdamWConfig;
use crate::nn::remat::apply_activation_checkpointing;
use crate::nn::{Llama, LlamaConfig};
use crate::parallel::Layout;
use crate::train::{TrainOptions, Trainer};
use crate::{AnyResult, DType, Device, Tensor};
use anyhow::Context;
use ferrolm_dist::cost::LinkModel;
use ferrolm_dist::plan::ModelShape;
use ferrolm_dist::zero::{Placement, ShardSpec, Zero};
use ferrolm_dist::{CommOptions, Communicator, DeviceMesh, ReduceOp, SimLink, ThreadComm, TrainEngine};
use ferrolm_tensor::Rng;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// What the analytic model needs from this machine.
#[derive(Clone, Debug, Serialize)]
pub struct Calibration {
    /// FLOP/s one rank sustains on the model while every rank computes.
    pub flops: f64,
    pub update_s_per_elem: f64,
    pub comm_cpu_s_per_byte: f64,
}

fn rank_err(e: anyhow::Error) -> ferrolm_tensor::Error {
    ferrolm_tensor::Error::new("trial", format!("{e:#}"))
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
    let sent = ferrolm_dist::zero::traffic_bytes(spec, world, buckets, &vec![0; buckets.len()], 4, 1);
    let compute = (t - upd - sent * comm_cpu_s_per_byte).max(1e-4);
    Ok(Calibration {
        flops: shape.flops_per_token(seq) * rows as f64 / compute,
        update_s_per_elem: upd / shape.params() as f64,
        comm_cpu_s_per_byte,
    })
}

/// Where trials train.
#[derive(Clone, Debug)]
pub struct TrialSetup {
    pub cfg: LlamaConfig,
    pub train: Vec<PathBuf>,
    pub val: Vec<PathBuf>,
    pub link: LinkModel,
    pub ranks_per_node: usize,
    pub seq: usize,
    pub lr: f64,
    /// Timed steps (after one warm-up step).
    pub steps: usize,
    /// The trials' compute dtype (`--dtype`).
    pub dtype: DType,
    pub out_dir: PathBuf,
}

/// One candidate's measurement.
#[derive(Clone, Debug, Serialize)]
pub struct Measured {
    /// Median step seconds (the slowest rank's).
    pub step_s: f64,
    pub tokens_per_s: f64,
    pub loss: f64,
}

/// The trainer options of a candidate.
pub fn train_options(c: &Candidate, seq: usize, lr: f64, steps: usize) -> TrainOptions {
    TrainOptions {
        steps,
        batch_size: c.micro_batch,
        seq_len: seq,
        grad_accum: c.grad_accum,
        lr,
        min_lr: lr / 10.0,
        warmup_steps: 1,
        weight_decay: 0.1,
        grad_clip: 1.0,
        eval_every: 0,
        eval_batches: 1,
        save_every: 0,
        log_every: 1,
        seed: 1337,
    }
}

/// The layout of a candidate.
pub fn layout(c: &Candidate, ranks_per_node: usize) -> Layout {
    use ferrolm_dist::offload::{GpuEvery, OffloadConfig};
    let gpu_every = match c.offload_k {
        Some(0) => GpuEvery::Never,
        Some(k) => GpuEvery::Every(k),
        None => GpuEvery::Auto,
    };
    let offload = c.offload_k.map(|_| OffloadConfig { subgroup: 10_000_000, gpu_every });
    Layout { tp: c.tp, dp: c.dp, spec: c.spec, ranks_per_node, offload, grad_reduce: Default::default() }
}

/// Runs `c` for one warm-up and `s.steps` timed steps with the real trainer on thread ranks
/// behind the simulated link.
pub fn run_trial(s: &TrialSetup, c: &Candidate) -> AnyResult<Measured> {
    if c.offload_k.is_some() {
        anyhow::bail!("{}: optimizer offload is modelled only, not run on thread ranks", c.name());
    }
    let par = layout(c, s.ranks_per_node);
    let world = par.world();
    let opts = train_options(c, s.seq, s.lr, s.steps + 1);
    let out = s.out_dir.join(c.name().replace([' ', '(', ')', ','], "_"));
    let per = ThreadComm::run(world, CommOptions::default(), |comm| {
        (|| -> AnyResult<(f64, f64)> {
            let comm: Arc<dyn Communicator> = SimLink::wrap(comm, s.link);
            let mut model = Llama::new(s.cfg.clone(), s.dtype, Device::Cpu, &mut Rng::new(opts.seed))?;
            apply_activation_checkpointing(&mut model, c.checkpointed_layers);
            let engine = crate::parallel::attach(&mut model, Some(comm), &par, Trainer::adamw_config(&opts))?;
            let mut t = Trainer::with_engine(model, Box::new(engine), &s.train, &s.val, opts.clone(), &out)?;
            let mut times = Vec::new();
            let mut loss = f64::NAN;
            for step in 0..=s.steps {
                let t0 = Instant::now();
                loss = t.train_step()?.0;
                if step > 0 {
                    times.push(t0.elapsed().as_secs_f64());
                }
            }
            times.sort_by(f64::total_cmp);
            Ok((times[times.len() / 2], loss))
        })()
        .map_err(rank_err)
    })
    .with_context(|| format!("trial {}", c.name()))?;
    let step_s = per.iter().map(|r| r.0).fold(0.0, f64::max);
    let tokens = (c.micro_batch * s.seq * c.dp * c.grad_accum) as f64;
    Ok(Measured { step_s, tokens_per_s: tokens / step_s, loss: per[0].1 })
}

/// The file `pretrain_llama --config-from` reads: its flags by their long names (snake case),
/// plus what the auto-configurator predicted, for the record (pretrain ignores `predicted`,
/// `measured` and `hyper_parameters`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// `--config`: a preset name or a config.json path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ladder_layers: Option<String>,
    pub tp: usize,
    pub dp: usize,
    pub shard_params: usize,
    pub shard_grads: usize,
    pub shard_optim: usize,
    pub ranks_per_node: usize,
    pub batch_size: usize,
    pub grad_accum: usize,
    pub seq_len: usize,
    pub lr: f64,
    pub activation_checkpointing: bool,
    /// Checkpointed layers the layout assumes (pretrain_llama checkpoints none or all).
    #[serde(default)]
    pub checkpointed_layers: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<usize>,
    /// Optimizer offload (`--offload-optimizer`).
    #[serde(default)]
    pub offload_optimizer: bool,
    /// `--offload-gpu-every`: `"auto"` or k.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offload_gpu_every: Option<serde_json::Value>,
    /// The compute dtype the layout was sized for (`--dtype`): "f32" or "bf16".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hyper_parameters: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured: Option<serde_json::Value>,
}

impl TrainConfig {
    /// The file for candidate `c`.
    pub fn of(c: &Candidate, layers: usize, ranks_per_node: usize, seq: usize, lr: f64) -> TrainConfig {
        TrainConfig {
            config: None,
            ladder_layers: None,
            tp: c.tp,
            dp: c.dp,
            shard_params: c.spec.params,
            shard_grads: c.spec.grads,
            shard_optim: c.spec.optim,
            ranks_per_node,
            batch_size: c.micro_batch,
            grad_accum: c.grad_accum,
            seq_len: seq,
            lr,
            activation_checkpointing: c.checkpointed_layers >= layers,
            checkpointed_layers: c.checkpointed_layers,
            steps: None,
            offload_optimizer: c.offload_k.is_some(),
            offload_gpu_every: c.offload_k.map(|k| if k == 0 { serde_json::json!("inf") } else { serde_json::json!(k) }),
            dtype: None,
            hyper_parameters: None,
            predicted: Some(serde_json::json!({
                "step_s": c.step_s, "tokens_per_s": c.tokens_per_s, "mfu": c.mfu, "mem_bytes_per_rank": c.mem.total(),
            })),
            measured: None,
        }
    }

    /// Reads and checks a file; errors name the file and the field.
    pub fn load(path: &Path) -> AnyResult<TrainConfig> {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
        let c: TrainConfig = serde_json::from_str(&text).with_context(|| format!("{} is not a train_config.json", path.display()))?;
        for (field, v) in [
            ("tp", c.tp),
            ("dp", c.dp),
            ("shard_params", c.shard_params),
            ("shard_grads", c.shard_grads),
            ("shard_optim", c.shard_optim),
            ("ranks_per_node", c.ranks_per_node),
            ("batch_size", c.batch_size),
            ("grad_accum", c.grad_accum),
            ("seq_len", c.seq_len),
        ] {
            if v == 0 {
                anyhow::bail!("{}: {field} must be at least 1", path.display());
            }
        }
        if !c.lr.is_finite() || c.lr < 0.0 {
            anyhow::bail!("{}: lr must be a finite number >= 0, got {}", path.display(), c.lr);
        }
        match &c.offload_gpu_every {
            None => {}
            Some(serde_json::Value::String(s)) if s == "auto" || s == "inf" => {}
            Some(v) if v.as_u64().is_some_and(|k| k >= 1) => {}
            Some(v) => anyhow::bail!("{}: offload_gpu_every must be \"auto\", \"inf\" or a positive integer, got {v}", path.display()),
        }
        Ok(c)
    }
}
