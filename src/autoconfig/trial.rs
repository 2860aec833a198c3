//! Measured trials on CPU thread ranks behind a simulated two-level link: a few steps of a
//! candidate with the real trainer (the calibration the analytic model needs is
//! `planner::calibrate`), and the `train_config.json` that `pretrain_llama --config-from` reads.
use crate::nn::remat::apply_activation_checkpointing;
use crate::nn::{Llama, LlamaConfig};
use crate::parallel::Parallelism;
use crate::planner::cost::LinkModel;
use crate::planner::layouts::Candidate;
use crate::train::{TrainOptions, Trainer};
use crate::{AnyResult, DType, Device};
use anyhow::Context;
use ferrolm_parallel::zero::GradReduceDtype;
use ferrolm_parallel::{CommOptions, Communicator, SimLink, ThreadComm};
use ferrolm_tensor::Rng;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

fn rank_err(e: anyhow::Error) -> ferrolm_tensor::Error {
    ferrolm_tensor::Error::new("trial", format!("{e:#}"))
}

/// Where trials train.
#[derive(Clone, Debug)]
pub struct TrialSetup {
    /// The model the trials build.
    pub cfg: LlamaConfig,
    /// Token shards.
    pub data: super::TrialData,
    /// The simulated link the thread ranks talk over, `ranks_per_node` to a node.
    pub link: LinkModel,
    pub ranks_per_node: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// The recipe's peak learning rate.
    pub lr: f64,
    /// Timed steps (after one warm-up step).
    pub steps: usize,
    /// The trials' compute dtype (`--dtype`).
    pub dtype: DType,
    /// The dtype gradients are reduced in (`--grad-reduce-dtype`), as the layouts were priced.
    pub grad_reduce: GradReduceDtype,
    /// Where each trial's run directory goes.
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
    // for_run's rate schedule, weight decay, clipping and seed; no evaluation, no checkpoints
    TrainOptions {
        batch_size: c.micro_batch,
        seq_len: seq,
        grad_accum: c.grad_accum,
        warmup_steps: 1,
        eval_every: 0,
        eval_batches: 1,
        save_every: 0,
        log_every: 1,
        ..TrainOptions::for_run(steps, lr)
    }
}

/// The layout of a candidate.
pub fn layout(c: &Candidate, ranks_per_node: usize, grad_reduce: GradReduceDtype) -> Parallelism {
    use ferrolm_parallel::offload::{GpuEvery, OffloadConfig};
    let gpu_every = match c.offload_k {
        Some(0) => GpuEvery::Never,
        Some(k) => GpuEvery::Every(k),
        None => GpuEvery::Auto,
    };
    let offload = c.offload_k.map(|_| OffloadConfig { subgroup: 10_000_000, gpu_every });
    Parallelism { tp: c.tp, dp: c.dp, spec: c.spec, ranks_per_node, offload, grad_reduce }
}

/// Runs `c` for one warm-up and `s.steps` timed steps with the real trainer on thread ranks
/// behind the simulated link.
pub fn run_trial(s: &TrialSetup, c: &Candidate) -> AnyResult<Measured> {
    if c.offload_k.is_some() {
        anyhow::bail!("{}: optimizer offload is modelled only, not run on thread ranks", c.name());
    }
    let par = layout(c, s.ranks_per_node, s.grad_reduce);
    let world = par.world();
    let opts = train_options(c, s.seq, s.lr, s.steps + 1);
    let out = s.out_dir.join(c.name().replace([' ', '(', ')', ','], "_"));
    let per = ThreadComm::run(world, CommOptions::default(), |comm| {
        (|| -> AnyResult<(f64, f64)> {
            let comm: Arc<dyn Communicator> = SimLink::wrap(comm, s.link);
            let mut model = Llama::new(s.cfg.clone(), s.dtype, Device::Cpu, &mut Rng::new(opts.seed))?;
            apply_activation_checkpointing(&mut model, c.checkpointed_layers);
            let engine = crate::parallel::attach(&mut model, Some(comm), &par, Trainer::adamw_config(&opts))?;
            let mut t = Trainer::with_engine(model, Box::new(engine), &s.data.train, &s.data.val, opts.clone(), &out)?;
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
    /// `--warmup-steps`: the recipe's warmup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup_steps: Option<usize>,
    /// Optimizer offload (`--offload-optimizer`).
    #[serde(default)]
    pub offload_optimizer: bool,
    /// `--offload-gpu-every`: `"auto"` or k.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offload_gpu_every: Option<serde_json::Value>,
    /// The compute dtype the layout was sized for (`--dtype`): "f32" or "bf16".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    /// The dtype the layout's gradients were priced in (`--grad-reduce-dtype`): "f32" or "bf16".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_reduce_dtype: Option<String>,
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
            warmup_steps: None,
            offload_optimizer: c.offload_k.is_some(),
            offload_gpu_every: c.offload_k.map(|k| if k == 0 { serde_json::json!("inf") } else { serde_json::json!(k) }),
            dtype: None,
            grad_reduce_dtype: None,
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
