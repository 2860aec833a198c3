//! Running a tool on several ranks: [`launch`] starts them, [`attach`] wires tensor parallelism
//! and the training engine onto a model from outside. The layout comes from the parallel flags
//! (`cli::ParallelArgs::layout`) as a plain [`Parallelism`].
//!
//! Where the ranks come from:
//! - a torchrun / srun / mpirun environment (`WORLD_SIZE` > 1): one process per GPU, NCCL. The
//!   processes meet at the rendezvous store; a rank-0-only phase (tokenising, a cache) runs before
//!   any collective, behind a store barrier with its own timeout (`FERROLM_PREPARE_TIMEOUT`
//!   seconds, default 3600), never inside a collective under the NCCL watchdog; a rank's error
//!   is posted to the store so the others stop promptly;
//!   `FERROLM_FORCE_NCCL=1` takes this path at `WORLD_SIZE=1` too (one GPU through NCCL);
//! - otherwise, on the CPU: `tp x dp` ranks as threads of this process (`ThreadComm`);
//! - several ranks on GPUs without such an environment is an error that says how to launch.
use crate::errors::flag_error;
use crate::AnyResult;
use anyhow::{bail, Context};
use ferrolm_nn::optim::AdamWConfig;
use ferrolm_nn::Llama;
use ferrolm_parallel::offload::OffloadConfig;
use ferrolm_parallel::tp::{parallelize, TpShardings};
use ferrolm_parallel::zero::{GradReduceDtype, Placement, ShardSpec, Zero};
use ferrolm_parallel::{CommOptions, DeviceMesh, DistEnv, ThreadComm};
use ferrolm_tensor::Device;
use std::time::Duration;

pub use ferrolm_parallel::comm::Comm;

/// Environment variable: `1` takes the multi-process path (`NcclComm`) also at a world size of
/// one under a launcher, so a single GPU exercises NCCL end to end.
pub const ENV_FORCE_NCCL: &str = "FERROLM_FORCE_NCCL";

/// Environment variable: seconds the other ranks wait for rank 0's preparation.
pub const ENV_PREPARE_TIMEOUT: &str = "FERROLM_PREPARE_TIMEOUT";

/// How a run is laid out over ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct Parallelism {
    pub tp: usize,
    pub dp: usize,
    pub spec: ShardSpec,
    /// Ranks per node: sharding groups stay inside a node or span whole nodes.
    pub ranks_per_node: usize,
    /// `--offload-optimizer`: the optimizer state in host memory.
    pub offload: Option<OffloadConfig>,
    /// `--grad-reduce-dtype`: the dtype gradients are accumulated and reduced in.
    pub grad_reduce: GradReduceDtype,
}

impl Parallelism {
    /// One device.
    pub fn single() -> Parallelism {
        Parallelism {
            tp: 1,
            dp: 1,
            spec: ShardSpec { params: 1, grads: 1, optim: 1 },
            ranks_per_node: 1,
            offload: None,
            grad_reduce: GradReduceDtype::default(),
        }
    }

    pub fn world(&self) -> usize {
        self.tp * self.dp
    }

    /// The layout as the memory estimator reads it (thread ranks unless a launcher started
    /// processes).
    pub fn mem_layout(&self, checkpointing: bool) -> AnyResult<crate::planner::memory::MemParallelism> {
        Ok(crate::planner::memory::MemParallelism {
            tp: self.tp,
            dp: self.dp,
            spec: self.spec,
            checkpointed_layers: if checkpointing { usize::MAX } else { 0 },
            thread_ranks: self.world() > 1 && DistEnv::from_env()?.is_none_or(|e| e.world_size <= 1),
            offload_subgroup: self.offload.as_ref().map(|o| o.subgroup),
            grad_reduce: self.grad_reduce,
            lora: None,
            loss_chunks: ferrolm_ops::LossChunks::Auto,
            preference: None,
        })
    }

    /// Checks the layout against the launcher (before anything is built): a flag error (exit
    /// code 2) naming `--tp` and `--dp`.
    pub fn validate(&self, device: Device) -> AnyResult<()> {
        let env = DistEnv::from_env()?;
        let procs = env.as_ref().map_or(1, |e| e.world_size);
        if procs > 1 && procs != self.world() {
            return Err(flag_error(format!(
                "the launcher started {procs} processes but --tp {} x --dp {} is {} ranks",
                self.tp,
                self.dp,
                self.world()
            )));
        }
        if procs == 1 && self.world() > 1 && device != Device::Cpu {
            return Err(flag_error(format!(
                "--tp {} x --dp {} on {device} needs one process per GPU: run under torchrun, or `cargo run --release --example launch -- --nproc-per-node {} <tool> <flags>`",
                self.tp,
                self.dp,
                self.world()
            )));
        }
        Ok(())
    }

    /// Checks that `--tp` can split the model `cfg` (`tp::check_split`), before any rank starts:
    /// a flag error (exit code 2) naming the config field and `--tp`.
    pub fn check_model(&self, cfg: &ferrolm_nn::LlamaConfig) -> AnyResult<()> {
        if self.tp > 1 {
            ferrolm_parallel::tp::check_split(cfg, self.tp).map_err(|e| flag_error(e.to_string()))?;
        }
        Ok(())
    }
}

/// Loads a checkpoint (4-bit with `quantize`, `--quantize-base`, or when saved 4-bit; and a
/// PEFT adapter for it) on every rank and shards it for tensor
/// parallelism (inference tools).
pub fn load_for_inference(
    dir: &std::path::Path,
    adapter: Option<&std::path::Path>,
    quantize: Option<ferrolm_ops::nf4::QuantType>,
    dtype: ferrolm_tensor::DType,
    device: Device,
    comm: Option<Comm>,
    layout: &Parallelism,
) -> AnyResult<Llama> {
    let mut model = crate::quant_base::load_model(dir, quantize, dtype, device)?;
    if let Some(a) = adapter {
        model.load_adapter(a).with_context(|| format!("cannot apply the adapter in {} to {}", a.display(), dir.display()))?;
    }
    if let Some(c) = comm {
        tensor_parallel(&mut model, c, layout)?;
    }
    Ok(model)
}

/// Runs `per_rank` on every rank of the layout and returns rank 0's result. `prepare` runs
/// once before (on rank 0 first, then on the other processes of a multi-process run, so shared
/// caches are built once); its result is shared by the thread ranks.
pub fn launch<P, T>(
    layout: &Parallelism,
    device: Device,
    prepare: impl Fn() -> AnyResult<P>,
    per_rank: impl Fn(&P, Option<Comm>) -> AnyResult<T> + Sync,
) -> AnyResult<T>
where
    P: Sync,
    T: Send,
{
    layout.validate(device)?;
    let world = layout.world();
    let force_nccl = std::env::var(ENV_FORCE_NCCL).is_ok_and(|v| v == "1");
    if let Some(env) = DistEnv::from_env()?.filter(|e| e.world_size > 1 || force_nccl) {
        return launch_processes(&env, prepare, per_rank);
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

/// This process's rank of a multi-process run (see the module comment).
fn launch_processes<P, T>(
    env: &DistEnv,
    prepare: impl Fn() -> AnyResult<P>,
    per_rank: impl Fn(&P, Option<Comm>) -> AnyResult<T>,
) -> AnyResult<T> {
    let options = CommOptions::from_env()?;
    let backend = ferrolm_parallel::env::gpu_backend(env)?;
    let store = ferrolm_parallel::env::rendezvous(env, &options).context("cannot join the launcher's world")?;
    crate::logging::set_rank(env.rank, env.world_size);
    let timeout = match std::env::var(ENV_PREPARE_TIMEOUT) {
        Ok(v) => Duration::from_secs_f64(
            v.trim()
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s > 0.0)
                .ok_or_else(|| anyhow::anyhow!("{ENV_PREPARE_TIMEOUT}={v:?} is not a positive number of seconds"))?,
        ),
        Err(_) => Duration::from_secs(3600),
    };
    // Errors, not only panics, reach the other ranks through the store; the error names the
    // rank and what it was doing.
    let notify = |e: anyhow::Error, what: &str| -> anyhow::Error {
        let _ = store.report_failure(&format!("rank {} failed while {what}: {e:#}", env.rank));
        e.context(format!("rank {} of {} failed while {what}", env.rank, env.world_size))
    };
    let barrier = |what: &str| store.barrier_timeout("ferrolm/prepare", timeout).map_err(|e| notify(e.into(), what));
    let p = if env.rank == 0 {
        let p = drill_delay().and_then(|()| prepare()).map_err(|e| notify(e, "preparing the run"));
        barrier("waiting for the other ranks after preparing")?;
        p?
    } else {
        barrier("waiting for rank 0 to prepare the run")?;
        prepare().map_err(|e| notify(e, "preparing the run"))?
    };
    let comm = ferrolm_parallel::env::init_with_store(env, store.clone(), backend, options)
        .map_err(|e| notify(e.into(), "joining the NCCL communicator"))?;
    per_rank(&p, Some(comm)).map_err(|e| notify(e, "training"))
}

/// Environment variable for fault drills: rank 0 spends this many more seconds preparing the run
/// (as tokenising a large corpus would), so tests can check that the other ranks wait behind the
/// preparation barrier and not under the collective timeout.
pub const ENV_DRILL_PREPARE_DELAY: &str = "FERROLM_DRILL_PREPARE_DELAY_S";

fn drill_delay() -> AnyResult<()> {
    if let Ok(v) = std::env::var(ENV_DRILL_PREPARE_DELAY) {
        let s = v.trim().parse::<f64>().ok().filter(|s| s.is_finite() && *s >= 0.0);
        let s = s.ok_or_else(|| anyhow::anyhow!("{ENV_DRILL_PREPARE_DELAY}={v:?} is not a number of seconds"))?;
        std::thread::sleep(Duration::from_secs_f64(s));
    }
    Ok(())
}

/// This rank's training engine for `model` (built whole, the same on every rank): tensor
/// parallelism first, then its parameters move into the engine's store, sharded as the flags
/// say. Without a communicator (one device) the engine spans a world of one.
pub fn attach(model: &mut Llama, comm: Option<Comm>, layout: &Parallelism, cfg: AdamWConfig) -> AnyResult<Zero> {
    if let Some(q) = model.quant_base() {
        if layout.spec.params > 1 {
            return Err(flag_error(format!(
                "ZeRO-3 (--zero 3 or --shard-params {}) over a 4-bit base is not supported: its {} frozen 4-bit linear weights \
                 are held whole on every data-parallel rank (a QLoRA run shards only the adapters' gradients and optimizer \
                 state): use --zero 2 or less",
                layout.spec.params, q.weights
            )));
        }
    }
    let placement = match &layout.offload {
        Some(o) => Placement::Offload(o),
        None => Placement::Device,
    };
    let mut zero = match comm {
        None => Zero::single(model, cfg, placement)?,
        Some(comm) => {
            let mesh = DeviceMesh::new(comm, layout.tp, layout.dp, layout.ranks_per_node)?;
            let tp = if layout.tp > 1 { Some(parallelize(model, mesh.tp_group())?) } else { None };
            Zero::new(model, mesh, layout.spec, tp, cfg, placement)?
        }
    };
    zero.set_grad_reduce_dtype(layout.grad_reduce)?;
    if let Some(plan) = zero.offload_plan() {
        report_offload(&plan, model.device());
    }
    Ok(zero)
}

/// Tensor parallelism only (inference: eval, generate).
pub fn tensor_parallel(model: &mut Llama, comm: Comm, layout: &Parallelism) -> AnyResult<(DeviceMesh, Option<TpShardings>)> {
    if layout.dp != 1 || layout.spec != ShardSpec::zero(0, 1)? {
        bail!("this tool runs tensor parallelism only: drop --dp and the sharding flags");
    }
    let mesh = DeviceMesh::new(comm, layout.tp, 1, layout.ranks_per_node)?;
    let tp = if layout.tp > 1 { Some(parallelize(model, mesh.tp_group())?) } else { None };
    Ok((mesh, tp))
}

/// Prints where the optimizer state went and, for `auto`, the measured inputs and the chosen k.
fn report_offload(plan: &ferrolm_parallel::offload::OffloadPlan, device: Device) {
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
