//! Running a tool on several ranks. The flags (`--tp`, `--dp`, `--zero`, `--shard-params`,
//! `--shard-grads`, `--shard-optim`, `--ranks-per-node`) are shared by every tool that takes
//! them; `launch` starts the ranks and `attach` wires tensor parallelism and the training
//! engine onto a model from outside.
//!
//! Where the ranks come from:
//! - a torchrun / SLURM / mpirun environment (`WORLD_SIZE` > 1): one process per GPU, NCCL;
//! - otherwise, on the CPU: `tp x dp` ranks as threads of this process (`ThreadComm`);
//! - several ranks on GPUs without such an environment is an error that says how to launch.
use crate::cli::positive;
use crate::AnyResult;
use anyhow::{bail, Context};
use clap::Args;
use ferrolm_dist::offload::{GpuEvery, OffloadConfig};
use ferrolm_dist::tp::{parallelize, TpLayout};
use ferrolm_dist::zero::{Placement, ShardSpec, Zero};
use ferrolm_dist::{CommOptions, Communicator, DeviceMesh, DistEnv, ThreadComm};
use ferrolm_nn::optim::AdamWConfig;
use ferrolm_nn::Llama;
use ferrolm_tensor::Device;
use std::sync::Arc;

pub type Comm = Arc<dyn Communicator>;

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
    pub fn layout(&self) -> ParallelArgs {
        ParallelArgs { tp: self.tp, dp: 1, ..Default::default() }
    }
}

/// Loads a checkpoint on every rank and shards it for tensor parallelism (inference tools).
pub fn load_for_inference(
    dir: &std::path::Path,
    dtype: ferrolm_tensor::DType,
    device: Device,
    comm: Option<Comm>,
    tp: &TpArgs,
) -> AnyResult<Llama> {
    let mut model = Llama::from_pretrained(dir, dtype, device).with_context(|| format!("cannot load the model in {}", dir.display()))?;
    if let Some(c) = comm {
        tensor_parallel(&mut model, c, &tp.layout())?;
    }
    Ok(model)
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
}

impl ParallelArgs {
    pub fn world(&self) -> usize {
        self.tp * self.dp
    }

    /// The offload settings, when `--offload-optimizer` is on.
    pub fn offload(&self) -> Option<OffloadConfig> {
        self.offload_optimizer.then_some(OffloadConfig { subgroup: self.offload_subgroup_size, gpu_every: self.offload_gpu_every })
    }

    pub fn ranks_per_node(&self) -> usize {
        self.ranks_per_node.unwrap_or(self.world())
    }

    /// The ShardSpec the flags give (validated against --dp and --ranks-per-node).
    pub fn spec(&self) -> AnyResult<ShardSpec> {
        let s = match self.zero {
            Some(z) => ShardSpec::zero(z as usize, self.dp)?,
            None => {
                let p = self.shard_params.unwrap_or(1);
                let g = self.shard_grads.unwrap_or(p);
                let o = self.shard_optim.unwrap_or(g).max(g);
                ShardSpec { params: p, grads: g, optim: o }
            }
        };
        let rpn = self.ranks_per_node();
        if !rpn.is_multiple_of(self.tp) {
            bail!("--ranks-per-node {rpn} must be a multiple of --tp {}", self.tp);
        }
        s.validate(self.dp, (rpn / self.tp).max(1))?;
        Ok(s)
    }

    /// The layout as the memory estimator reads it (thread ranks unless a launcher started
    /// processes).
    pub fn mem_layout(&self, checkpointing: bool) -> AnyResult<crate::memory::MemLayout> {
        Ok(crate::memory::MemLayout {
            tp: self.tp,
            dp: self.dp,
            spec: self.spec()?,
            checkpointed_layers: if checkpointing { usize::MAX } else { 0 },
            thread_ranks: self.world() > 1 && DistEnv::from_env()?.is_none_or(|e| e.world_size <= 1),
            offload_subgroup: self.offload().map(|o| o.subgroup),
        })
    }

    /// Checks the flags against the run (before anything is built).
    pub fn validate(&self, device: Device) -> AnyResult<()> {
        self.spec()?;
        if let Some(o) = self.offload() {
            o.validate()?;
        }
        let env = DistEnv::from_env()?;
        let procs = env.as_ref().map_or(1, |e| e.world_size);
        if procs > 1 && procs != self.world() {
            bail!("the launcher started {procs} processes but --tp {} x --dp {} is {} ranks", self.tp, self.dp, self.world());
        }
        if procs == 1 && self.world() > 1 && device != Device::Cpu {
            bail!(
                "--tp {} x --dp {} on {device} needs one process per GPU: run under torchrun, or `cargo run --release --example launch -- --nproc-per-node {} <tool> <flags>`",
                self.tp,
                self.dp,
                self.world()
            );
        }
        Ok(())
    }
}

/// Runs `per_rank` on every rank of the layout and returns rank 0's result. `prepare` runs
/// once before (on rank 0 first, then on the other processes of a multi-process run, so shared
/// caches are built once); its result is shared by the thread ranks.
pub fn launch<P, T>(
    par: &ParallelArgs,
    device: Device,
    prepare: impl Fn() -> AnyResult<P>,
    per_rank: impl Fn(&P, Option<Comm>) -> AnyResult<T> + Sync,
) -> AnyResult<T>
where
    P: Sync,
    T: Send,
{
    par.validate(device)?;
    let world = par.world();
    if let Some(env) = DistEnv::from_env()?.filter(|e| e.world_size > 1) {
        let comm = ferrolm_dist::init(Some(env), CommOptions::from_env()?).context("cannot join the launcher's world")?;
        crate::logging::set_rank(comm.rank(), comm.size());
        let p = if comm.rank() == 0 {
            let p = prepare();
            comm.barrier()?;
            p?
        } else {
            comm.barrier()?;
            prepare()?
        };
        return per_rank(&p, Some(comm));
    }
    let p = prepare()?;
    if world == 1 {
        return per_rank(&p, None);
    }
    let mut out = ThreadComm::run(world, CommOptions::from_env()?, |comm| {
        crate::logging::set_thread_rank(Some((comm.rank(), world)));
        let r = per_rank(&p, Some(comm)).map_err(|e| ferrolm_tensor::Error::new("rank", format!("{e:#}")));
        crate::logging::set_thread_rank(None);
        r
    })?;
    Ok(out.swap_remove(0))
}

/// This rank's training engine for `model` (built whole, the same on every rank): tensor
/// parallelism first, then its parameters move into the engine's store, sharded as the flags
/// say. Without a communicator (one device) the engine spans a world of one.
pub fn attach(model: &mut Llama, comm: Option<Comm>, par: &ParallelArgs, cfg: AdamWConfig) -> AnyResult<Zero> {
    let offload = par.offload();
    let placement = match &offload {
        Some(o) => Placement::Offload(o),
        None => Placement::Device,
    };
    let zero = match comm {
        None => Zero::single(model, cfg, placement)?,
        Some(comm) => {
            let mesh = DeviceMesh::new(comm, par.tp, par.dp, par.ranks_per_node())?;
            let tp = if par.tp > 1 { Some(parallelize(model, mesh.tp_group())?) } else { None };
            Zero::new(model, mesh, par.spec()?, tp, cfg, placement)?
        }
    };
    if let Some(plan) = zero.offload_plan() {
        report_offload(&plan, model.device());
    }
    Ok(zero)
}

/// Tensor parallelism only (inference: eval, generate).
pub fn tensor_parallel(model: &mut Llama, comm: Comm, par: &ParallelArgs) -> AnyResult<(DeviceMesh, Option<TpLayout>)> {
    if par.dp != 1 || par.spec()? != ShardSpec::zero(0, 1)? {
        bail!("this tool runs tensor parallelism only: drop --dp and the sharding flags");
    }
    let mesh = DeviceMesh::new(comm, par.tp, 1, par.ranks_per_node())?;
    let tp = if par.tp > 1 { Some(parallelize(model, mesh.tp_group())?) } else { None };
    Ok((mesh, tp))
}

/// Prints where the optimizer state went and, for `auto`, the measured inputs and the chosen k.
fn report_offload(plan: &ferrolm_dist::offload::OffloadPlan, device: Device) {
    use crate::progress::report;
    let k = plan.k.map_or("inf (every subgroup on the CPU)".to_string(), |k| k.to_string());
    if device == Device::Cpu {
        report("offload: --device cpu: the schedule runs, but the optimizer state was in host memory already (no memory is saved)");
    }
    report(&format!(
        "offload: optimizer state of {} elements in host memory, {} subgroups, {} of them updated on the device: k = {k}",
        plan.elems, plan.subgroups, plan.device_subgroups
    ));
    if let (Some(i), Some(e)) = (&plan.inputs, &plan.estimate) {
        report(&format!(
            "offload: --offload-gpu-every auto: measured CPU AdamW {:.3e} elem/s, device AdamW {:.3e} elem/s, H2D {:.2} GB/s, D2H {:.2} GB/s; the model chose k = {k} (modelled update {:.3} s)",
            i.cpu_adam_elems_per_s,
            i.gpu_adam_elems_per_s,
            i.h2d_bytes_per_s / 1e9,
            i.d2h_bytes_per_s / 1e9,
            e.update_s
        ));
    }
}
