//! The parallel layout flags (`--tp`, `--dp`, `--zero`, `--shard-*`, `--ranks-per-node`, the
//! offload flags), shared by every tool that takes them, and the plain [`Parallelism`] they describe.
use super::{flag_error, positive};
use crate::parallel::Parallelism;
use crate::AnyResult;
use anyhow::bail;
use clap::Args;
use ferrolm_parallel::offload::{GpuEvery, OffloadConfig};
use ferrolm_parallel::zero::{GradReduceDtype, ShardSpec};
use ferrolm_parallel::DistEnv;

/// Tensor parallelism for the inference tools (eval, generate).
#[derive(Args, Debug, Clone, PartialEq, Default)]
#[command(next_help_heading = "Parallelism")]
pub struct TpArgs {
    /// Tensor-parallel ranks (on the CPU, threads of this process; on GPUs, one process per
    /// GPU under torchrun or the launch example)
    #[arg(long, value_name = "N", default_value = "1", value_parser = positive)]
    pub tp: usize,
}

impl TpArgs {
    pub fn layout(&self) -> AnyResult<Parallelism> {
        ParallelArgs { tp: self.tp, dp: 1, ..Default::default() }.layout()
    }
}

/// The parallel layout flags.
#[derive(Args, Debug, Clone, PartialEq, Default)]
#[command(next_help_heading = "Parallelism")]
pub struct ParallelArgs {
    /// Tensor-parallel ranks (Megatron-style; on the CPU, threads of this process)
    #[arg(long, value_name = "N", default_value = "1", value_parser = positive)]
    pub tp: usize,
    /// Data-parallel ranks (each takes its share of every batch; --batch-size is per rank)
    #[arg(long, value_name = "N", default_value = "1", value_parser = positive)]
    pub dp: usize,
    /// ZeRO preset over the data-parallel ranks: 1 shards optimizer states, 2 also gradients,
    /// 3 also parameters (0: plain data parallelism) [default: the --shard-* flags, else 0]
    #[arg(long, value_name = "0|1|2|3", value_parser = clap::value_parser!(u8).range(0..=3),
          conflicts_with_all = ["shard_params", "shard_grads", "shard_optim"])]
    pub zero: Option<u8>,
    /// Group size over which parameters are sharded (AMSP's s_p) [default: 1]
    #[arg(long, value_name = "S", value_parser = positive)]
    pub shard_params: Option<usize>,
    /// Group size over which gradients are sharded (s_g: equal to s_p or s_os) [default: s_p]
    #[arg(long, value_name = "S", value_parser = positive)]
    pub shard_grads: Option<usize>,
    /// Group size over which optimizer states are sharded (s_os) [default: s_g]
    #[arg(long, value_name = "S", value_parser = positive)]
    pub shard_optim: Option<usize>,
    /// Ranks per node: sharding groups stay inside a node or span whole nodes
    /// [default: every rank on one node]
    #[arg(long, value_name = "N", value_parser = positive)]
    pub ranks_per_node: Option<usize>,
    /// Keep this rank's optimizer state (fp32 master, m, v) in pinned host memory and update it
    /// on the CPU, one subgroup in k on the GPU (Deep Optimizer States; docs/OFFLOAD.md). On
    /// --device cpu it runs but saves nothing (the state is in host memory already)
    #[arg(long)]
    pub offload_optimizer: bool,
    /// Elements per offloaded subgroup (the unit of the CPU/GPU interleaving)
    #[arg(long, value_name = "N", default_value = "10000000", value_parser = positive, requires = "offload_optimizer")]
    pub offload_subgroup_size: usize,
    /// Update one subgroup in k on the GPU: k >= 1, `auto` (the performance model's k, from
    /// throughputs measured at start-up) or `inf` (all on the CPU)
    #[arg(long, value_name = "k|auto|inf", default_value = "auto", requires = "offload_optimizer")]
    pub offload_gpu_every: GpuEvery,
    /// The dtype gradients are accumulated and reduced in: f32 main-gradient buffers (as
    /// Megatron-LM and DeepSpeed do with bf16 parameters), or bf16, the parameter dtype of
    /// --dtype bf16 (half the gradient memory and traffic; with f32 parameters both are f32)
    #[arg(long, value_name = "f32|bf16", default_value = "f32")]
    pub grad_reduce_dtype: GradReduceDtype,
}

impl ParallelArgs {
    pub fn world(&self) -> usize {
        self.tp * self.dp
    }

    /// The layout these flags describe, checked: a valid ShardSpec for --dp and the ranks per
    /// node, which default to the launcher's processes per node (`LOCAL_WORLD_SIZE`, SLURM's tasks
    /// per node) in a multi-process run and to every rank otherwise. A layout the flags cannot
    /// have is a flag error (exit code 2), naming the flag; the model's own constraints are
    /// `Parallelism::check_model`'s.
    pub fn layout(&self) -> AnyResult<Parallelism> {
        let env = DistEnv::from_env()?.filter(|e| e.world_size > 1);
        self.layout_in(env.as_ref()).map_err(|e| flag_error(format!("{e:#}")))
    }

    fn layout_in(&self, env: Option<&DistEnv>) -> AnyResult<Parallelism> {
        let rpn = match (self.ranks_per_node, env) {
            (Some(r), Some(e)) if r != e.local_world_size => bail!(
                "--ranks-per-node {r} but the launcher started {} processes on this node (LOCAL_WORLD_SIZE): drop the flag",
                e.local_world_size
            ),
            (Some(r), _) => r,
            (None, Some(e)) => e.local_world_size,
            (None, None) => self.world(),
        };
        let spec = match self.zero {
            Some(z) => ShardSpec::zero(z as usize, self.dp)?,
            None => {
                let p = self.shard_params.unwrap_or(1);
                let g = self.shard_grads.unwrap_or(p);
                let o = self.shard_optim.unwrap_or(g).max(g);
                ShardSpec { params: p, grads: g, optim: o }
            }
        };
        if !rpn.is_multiple_of(self.tp) {
            bail!("--ranks-per-node {rpn} must be a multiple of --tp {}", self.tp);
        }
        spec.validate(self.dp, (rpn / self.tp).max(1))?;
        let offload =
            self.offload_optimizer.then_some(OffloadConfig { subgroup: self.offload_subgroup_size, gpu_every: self.offload_gpu_every });
        if let Some(o) = &offload {
            o.validate()?;
        }
        Ok(Parallelism { tp: self.tp, dp: self.dp, spec, ranks_per_node: rpn, offload, grad_reduce: self.grad_reduce_dtype })
    }

    /// The `parallel:` line every training run prints (rank 0), and a warning when sharding was
    /// asked for over a single data-parallel rank, where it shards nothing.
    pub fn report(&self, spec: &ShardSpec) {
        if !crate::logging::is_rank_zero() {
            return;
        }
        crate::progress::report(&format!("parallel: tp {} x dp {} ranks, sharding {spec}", self.tp, self.dp));
        let mut asked: Vec<String> = self.zero.filter(|&z| z > 0).map(|z| format!("--zero {z}")).into_iter().collect();
        for (flag, v) in [("--shard-params", self.shard_params), ("--shard-grads", self.shard_grads), ("--shard-optim", self.shard_optim)] {
            asked.extend(v.map(|v| format!("{flag} {v}")));
        }
        if self.dp == 1 && !asked.is_empty() {
            tracing::warn!(
                "{} shards over the data-parallel ranks, and --dp is 1: sharding over a world of one shards nothing \
                 (this rank holds every parameter, gradient and optimizer state); add --dp N to shard",
                asked.join(" ")
            );
        }
    }
}
