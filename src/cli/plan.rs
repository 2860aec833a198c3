//! `plan`: the sharding planner's tool (`examples/plan.rs` wraps `run`): every valid
//! `ShardSpec` for a model and a cluster, ranked by modelled step time among those that fit.
//! The model is `crate::planner` (the cluster through `Cluster::gpu`, `step::search`); this
//! module turns flags into its inputs and its ranking into text.
//!
//!   cargo run --release --example plan -- --model 7b --gpus 1024 --gpus-per-node 8 --gpu-mem-gib 80
//!
//! The last line is one JSON object with the chosen layout.
use super::cluster::{GpuClusterArgs, GradReduceArg};
use super::{env_help, fraction, positive, LogArgs, Tool, ENV_COMMON};
use crate::planner::calibrate::calibrate_link;
use crate::planner::{step, Cluster, Estimate, ModelShape, Workload, GIB};
use crate::AnyResult;
use clap::Parser;

#[derive(Parser, Debug, Clone)]
#[command(
    name = "plan",
    about = "Rank every valid ZeRO/AMSP sharding (ShardSpec) of a model on a cluster by the modelled step time: memory per \
             rank, communication per step, exposed communication after overlap, MFU. The last line is the chosen layout as JSON.",
    after_help = env_help(&[ENV_COMMON])
)]
pub struct PlanArgs {
    /// Model: a preset (tiny, small, 7b, 13b, 30b, 70b, gpt3-5b, gpt3-175b: autoconfig's) or a
    /// config.json
    #[arg(long, value_name = "PRESET|FILE")]
    pub model: String,
    /// GPUs (ranks) in all
    #[arg(long, value_parser = positive, help_heading = "Cluster")]
    pub gpus: usize,
    #[command(flatten)]
    pub cluster: GpuClusterArgs,
    /// Sustained dense TFLOP/s per GPU on the model's GEMMs [default: 60% of --peak-tflops]
    #[arg(long, help_heading = "Cluster")]
    pub tflops: Option<f64>,
    /// Memory kept free, a fraction of the GPU's
    #[arg(long, default_value = "0.1", value_parser = fraction, help_heading = "Cluster")]
    pub margin: f64,
    /// Measure the intra-node link instead: time all-reduces over --calibrate N thread ranks
    /// (the communicator this machine runs) and fit latency and bandwidth [default: off]
    #[arg(long, value_name = "N")]
    pub calibrate: Option<usize>,
    /// Tokens per sequence
    #[arg(long, default_value = "4096", value_parser = positive)]
    pub seq_len: usize,
    /// Sequences per micro-batch per rank
    #[arg(long, default_value = "1", value_parser = positive)]
    pub micro_batch: usize,
    /// Tokens per optimizer step over all ranks
    #[arg(long, default_value = "4194304", value_parser = positive)]
    pub global_batch_tokens: usize,
    /// Tensor-parallel degree (inside a node)
    #[arg(long, default_value = "1", value_parser = positive)]
    pub tp: usize,
    /// Transformer layers whose activations are recomputed
    #[arg(long, default_value = "0")]
    pub checkpointed_layers: usize,
    #[command(flatten)]
    pub grad_reduce: GradReduceArg,
    /// Rows of the table
    #[arg(long, default_value = "12", value_parser = positive)]
    pub top: usize,
    #[command(flatten)]
    pub log: LogArgs,
}

impl Tool for PlanArgs {
    fn log_args(&self) -> &LogArgs {
        &self.log
    }
}

impl PlanArgs {
    /// The modelled cluster (`Cluster::gpu`), its intra-node link measured with `--calibrate`.
    pub fn cluster(&self) -> AnyResult<Cluster> {
        let mut c = self.cluster.cluster(self.gpus, self.tflops, self.margin)?;
        if let Some(n) = self.calibrate {
            let l = calibrate_link(n.max(2))?;
            println!(
                "calibrated over {} thread ranks: {:.1} us per ring step, {:.2} GB/s per rank",
                n.max(2),
                l.alpha_s * 1e6,
                l.bytes_per_s / 1e9
            );
            c.link.intra = l;
        }
        Ok(c)
    }

    /// What one step trains: bf16 parameters, gradients at `--grad-reduce-dtype`.
    pub fn workload(&self) -> Workload {
        Workload {
            seq: self.seq_len,
            micro_batch: self.micro_batch,
            global_batch_tokens: self.global_batch_tokens,
            tp: self.tp,
            elem_bytes: 2,
            grad_bytes: self.grad_reduce.grad_reduce_dtype.bytes(2),
            checkpointed_layers: self.checkpointed_layers,
            loss_chunks: Default::default(),
        }
    }

    /// The model `--model` names: a config.json, one of the presets built here (`tiny`, `small`,
    /// with their vocabulary of 4096 and 32000), or a modelled GPU preset: the presets autoconfig
    /// takes.
    pub fn model_shape(&self) -> AnyResult<ModelShape> {
        use crate::autoconfig::run::{CPU_PRESETS, GPU_PRESETS};
        let m = self.model.as_str();
        Ok(match super::preset_or_file("--model", m)? {
            Some(file) => ModelShape::from_config(&crate::nn::LlamaConfig::from_file(file)?, m),
            None if CPU_PRESETS.contains(&m) => ModelShape::from_config(&crate::nn::LlamaConfig::preset(m)?, m),
            None if GPU_PRESETS.contains(&m) => ModelShape::preset(m)?,
            None => {
                return Err(super::flag_error(format!(
                    "--model {m}: not a preset ({}, {}) nor a config.json file",
                    CPU_PRESETS.join(", "),
                    GPU_PRESETS.join(", ")
                )))
            }
        })
    }

    /// Every valid layout, ranked (`step::search`), after the checks the flags need.
    pub fn rank(&self) -> AnyResult<(ModelShape, Cluster, Vec<Estimate>)> {
        let model = self.model_shape()?;
        if !self.gpus.is_multiple_of(self.tp) {
            anyhow::bail!("--tp {} must divide --gpus {}", self.tp, self.gpus);
        }
        let cluster = self.cluster()?;
        if !cluster.gpus_per_node.is_multiple_of(self.tp) {
            anyhow::bail!("--tp {} must divide the {} GPUs of a node (--gpus-per-node)", self.tp, cluster.gpus_per_node);
        }
        let ranked = step::search(&model, &cluster, &self.workload());
        Ok((model, cluster, ranked))
    }
}

/// One row of the table; `spec_width` is the widest spec shown, so 3-digit layouts line up.
fn row(e: &Estimate, spec_width: usize) -> String {
    format!(
        "{:<spec_width$} {:>5} {:>9.1} {:>9.1} {:>9.1} {:>9.3} {:>9.3} {:>9.3} {:>6.1}%",
        e.spec.to_string(),
        if e.fits { "yes" } else { "no" },
        e.mem.states() / GIB,
        (e.mem.total() - e.mem.states()) / GIB,
        e.mem.total() / GIB,
        e.comm_total(),
        e.exposed,
        e.step,
        e.mfu * 100.0
    )
}

/// The table's header and one row per estimate, each column as wide as its widest cell.
pub fn table(rows: &[Estimate]) -> Vec<String> {
    let w = rows.iter().map(|e| e.spec.to_string().len()).max().unwrap_or(0).max(32);
    let header = format!(
        "{:<w$} {:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7}",
        "spec", "fits", "states", "act+buf", "mem GiB", "comm s", "exposed", "step s", "MFU"
    );
    std::iter::once(header).chain(rows.iter().map(|e| row(e, w))).collect()
}

/// The chosen layout as the last line's JSON.
pub fn chosen_json(a: &PlanArgs, best: &Estimate) -> serde_json::Value {
    serde_json::json!({
        "params": best.spec.params, "grads": best.spec.grads, "optim": best.spec.optim,
        "tp": a.tp, "dp": best.dp, "micro_batches": best.micro_batches,
        "grad_reduce_dtype": a.grad_reduce.grad_reduce_dtype.to_string(),
        "mem_gib": best.mem.total() / GIB, "step_s": best.step, "exposed_comm_s": best.exposed, "mfu": best.mfu,
    })
}

pub fn run(a: PlanArgs) -> AnyResult<()> {
    let (model, cluster, ranked) = a.rank()?;
    let Some(best) = ranked.iter().find(|e| e.fits) else {
        anyhow::bail!(
            "no layout of {} fits {:.0} GiB per GPU on {} GPUs (tp {}): add GPUs, checkpoint activations (--checkpointed-layers), or shorten --micro-batch/--seq-len",
            model.name,
            cluster.mem_bytes / GIB,
            a.gpus,
            a.tp
        );
    };
    println!(
        "{}: {:.2}B parameters; {} GPUs ({} per node), tp {}, dp {}; {} micro-batch(es) of {} x {} tokens per step; gradients reduced in {}",
        model.name,
        model.params() as f64 / 1e9,
        a.gpus,
        cluster.gpus_per_node,
        a.tp,
        best.dp,
        best.micro_batches,
        a.micro_batch,
        a.seq_len,
        a.grad_reduce.grad_reduce_dtype
    );
    for line in table(&ranked[..a.top.min(ranked.len())]) {
        println!("{line}");
    }
    println!("{}", chosen_json(&a, best));
    Ok(())
}
