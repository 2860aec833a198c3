//! A process's place in a multi-process run, from its launcher's environment, and the world
//! communicator built on it.
//!
//! Sources, first found wins for each value (so explicit variables beat the launcher's own):
//! - torchrun (and the `launch` example): `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//!   `GROUP_RANK`, `MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_USE_AGENT_STORE`,
//!   `TORCHELASTIC_RESTART_COUNT`; `NODE_RANK` is read like `GROUP_RANK`;
//! - Open MPI's `mpirun`: `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
//!   `OMPI_COMM_WORLD_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_SIZE` (`MASTER_ADDR` must be exported);
//! - SLURM's `srun`: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NODEID`, the ranks
//!   per node from `SLURM_STEP_TASKS_PER_NODE` / `SLURM_TASKS_PER_NODE` (`4(x2),3`) or
//!   `SLURM_NTASKS_PER_NODE`, and the master from the first host of `SLURM_STEP_NODELIST` /
//!   `SLURM_JOB_NODELIST` (`gpu[01-04,07]`).
//!
//! `MASTER_PORT` defaults to [`DEFAULT_MASTER_PORT`] (29500, as torchrun's). Without an agent,
//! global rank 0 serves the rendezvous store there.
use crate::comm::{CommOptions, Communicator};
use crate::nccl::NcclComm;
use crate::slurm;
use crate::store::Store;
use crate::thread::ThreadComm;
use ferrolm_cuda::CudaBackend;
use ferrolm_tensor::{bail, Error, Result};
use std::sync::{Arc, Mutex, Weak};

/// The rendezvous port when `MASTER_PORT` is not set (torchrun's default too).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// The launcher variables, for a tool's `--help` (two spaces, name padded to 23).
pub const ENV_HELP: &str = concat!(
    "  RANK, WORLD_SIZE       this process's rank and the process count (torchrun, launch)\n",
    "  LOCAL_RANK             index on this node: the process uses cuda:LOCAL_RANK, or cuda:0\n",
    "                         when CUDA_VISIBLE_DEVICES shows it one GPU\n",
    "  LOCAL_WORLD_SIZE       processes per node [default: SLURM's tasks per node, else WORLD_SIZE]\n",
    "  MASTER_ADDR            host of global rank 0 [default under srun: first host of the node list]\n",
    "  MASTER_PORT            port of the rendezvous store [default: 29500]\n",
    "  TORCHELASTIC_USE_AGENT_STORE\n",
    "                         `True` (torchrun sets it): join the agent's store, do not serve one\n",
    "  SLURM_PROCID           under srun, with SLURM_NTASKS and SLURM_LOCALID: the ranks when RANK,\n",
    "                         WORLD_SIZE, LOCAL_RANK are not set (OMPI_COMM_WORLD_* likewise)\n",
    "  FERROLM_COMM_TIMEOUT_S seconds ranks wait for each other (rendezvous, collectives) [default: 600]\n",
    "  FERROLM_PREPARE_TIMEOUT\n",
    "                         seconds the other ranks wait for rank 0 to prepare the run [default: 3600]\n",
    "  FERROLM_COMM_CHECK     `1`: check every collective's arguments and call site against rank 0's\n",
    "  FERROLM_FORCE_NCCL     `1`: take the one-process-per-GPU NCCL path even at WORLD_SIZE=1",
);

/// Where the rank came from (for messages that name the variable).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// `RANK` and friends, set by hand or by the `launch` example.
    Env,
    /// `RANK` set by torchrun's agent (`TORCHELASTIC_*` present).
    Torchrun,
    /// `OMPI_COMM_WORLD_RANK`.
    OpenMpi,
    /// `SLURM_PROCID`.
    Slurm,
}

impl Launcher {
    /// The variable that gave this process its rank.
    pub fn rank_var(self) -> &'static str {
        match self {
            Launcher::Env | Launcher::Torchrun => "RANK",
            Launcher::OpenMpi => "OMPI_COMM_WORLD_RANK",
            Launcher::Slurm => "SLURM_PROCID",
        }
    }
}

/// One process's place in a multi-process run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistEnv {
    pub rank: usize,
    pub world_size: usize,
    /// The process's index on its node.
    pub local_rank: usize,
    /// Processes on this node (`LOCAL_WORLD_SIZE`, or SLURM's tasks per node): tensor-parallel
    /// groups must fit inside it.
    pub local_world_size: usize,
    /// This node's index (`GROUP_RANK`, `NODE_RANK`, `SLURM_NODEID`, else `rank / local_world_size`).
    pub node_rank: usize,
    /// Nodes in the job.
    pub num_nodes: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// torchrun's agent serves the store (`TORCHELASTIC_USE_AGENT_STORE=True`): join it as a
    /// client; otherwise rank 0 serves it.
    pub agent_store: bool,
    /// `TORCHELASTIC_RESTART_COUNT`: the store's keys live under `/worker/attempt_{n}/`.
    pub restart_count: u64,
    /// The CUDA ordinal this process drives (`cuda_ordinal`).
    pub cuda_ordinal: usize,
    pub launcher: Launcher,
}

/// The GPU a process drives: `cuda:0` when `CUDA_VISIBLE_DEVICES` shows it exactly one device
/// (the launcher gave each process its own), else `cuda:LOCAL_RANK`.
pub fn cuda_ordinal(local_rank: usize, cuda_visible_devices: Option<&str>) -> Result<usize> {
    let Some(v) = cuda_visible_devices.map(str::trim).filter(|v| !v.is_empty()) else { return Ok(local_rank) };
    let n = v.split(',').filter(|d| !d.trim().is_empty()).count();
    if n == 1 {
        return Ok(0);
    }
    if local_rank >= n {
        bail!(
            "dist env",
            "LOCAL_RANK={local_rank} but CUDA_VISIBLE_DEVICES={v:?} shows this process {n} GPUs: give each process one GPU, or all of the node's"
        );
    }
    Ok(local_rank)
}

type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The first of `names` that is set, with its name.
fn first(env: Lookup, names: &[&'static str]) -> Option<(&'static str, String)> {
    names.iter().find_map(|n| env(n).filter(|v| !v.trim().is_empty()).map(|v| (*n, v)))
}

fn parse_num(name: &str, v: &str) -> Result<usize> {
    v.trim().parse().map_err(|_| Error::new("dist env", format!("{name}={v:?} is not a non-negative integer")))
}

fn num(env: Lookup, names: &[&'static str]) -> Result<Option<(&'static str, usize)>> {
    first(env, names).map(|(n, v)| parse_num(n, &v).map(|x| (n, x))).transpose()
}

impl DistEnv {
    /// From the process environment; `None` when no launcher set a world size.
    pub fn from_env() -> Result<Option<DistEnv>> {
        Self::from_lookup(&|k| std::env::var(k).ok())
    }

    /// From any variable lookup (tests pass a map).
    pub fn from_lookup(env: Lookup) -> Result<Option<DistEnv>> {
        let Some((world_var, world_size)) = num(env, &["WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", "SLURM_NPROCS"])? else {
            return Ok(None);
        };
        if world_size == 0 {
            bail!("dist env", "{world_var} must be at least 1");
        }
        let (rank_var, rank) = num(env, &["RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"])?
            .ok_or_else(|| Error::new("dist env", format!("{world_var} is set but RANK is not")))?;
        if rank >= world_size {
            bail!("dist env", "{rank_var}={rank} is not below {world_var}={world_size}");
        }
        let launcher = match rank_var {
            "OMPI_COMM_WORLD_RANK" => Launcher::OpenMpi,
            "SLURM_PROCID" => Launcher::Slurm,
            _ if env("TORCHELASTIC_RUN_ID").is_some() || env("TORCHELASTIC_USE_AGENT_STORE").is_some() => Launcher::Torchrun,
            _ => Launcher::Env,
        };
        let agent_store = env("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.trim() == "True");
        let restart_count = match first(env, &["TORCHELASTIC_RESTART_COUNT"]) {
            Some((n, v)) => parse_num(n, &v)? as u64,
            None => 0,
        };
        let master_port = match first(env, &["MASTER_PORT"]) {
            None => DEFAULT_MASTER_PORT,
            Some((_, p)) => p
                .trim()
                .parse::<u16>()
                .ok()
                .filter(|&p| p > 0)
                .ok_or_else(|| Error::new("dist env", format!("MASTER_PORT={p:?} is not a port number (1-65535)")))?,
        };
        let visible = env("CUDA_VISIBLE_DEVICES");
        if world_size == 1 {
            let local_rank = num(env, &["LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"])?.map_or(0, |(_, v)| v);
            return Ok(Some(DistEnv {
                rank,
                world_size,
                local_rank,
                local_world_size: 1,
                node_rank: 0,
                num_nodes: 1,
                master_addr: env("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
                master_port,
                agent_store,
                restart_count,
                cuda_ordinal: cuda_ordinal(local_rank, visible.as_deref()).unwrap_or(local_rank),
                launcher,
            }));
        }

        let (local_var, local_rank) = num(env, &["LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"])?.ok_or_else(|| {
            Error::new("dist env", format!("{world_var}={world_size} but LOCAL_RANK is not set (it picks the GPU of this process)"))
        })?;
        let node_var = first(env, &["GROUP_RANK", "NODE_RANK", "SLURM_NODEID"]);
        let node_given = node_var.as_ref().map(|(n, v)| parse_num(n, v).map(|x| (*n, x))).transpose()?;
        let (lws_var, local_world_size) = match num(env, &["LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"])? {
            Some(x) => x,
            None => match slurm_tasks_per_node(env, node_given.map(|(_, x)| x))? {
                Some(x) => x,
                // Nothing says how ranks are spread: one node.
                None => ("WORLD_SIZE", world_size),
            },
        };
        if local_world_size == 0 || local_world_size > world_size {
            bail!("dist env", "{lws_var}={local_world_size} must be between 1 and {world_var}={world_size}");
        }
        if local_rank >= local_world_size {
            bail!("dist env", "{local_var}={local_rank} is not below {lws_var}={local_world_size}");
        }
        let num_nodes = match num(env, &["GROUP_WORLD_SIZE", "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"])? {
            Some((n, 0)) => bail!("dist env", "{n} must be at least 1"),
            Some((_, n)) => n,
            None => world_size.div_ceil(local_world_size),
        };
        let node_rank = match node_given {
            Some((n, x)) if x >= num_nodes => bail!("dist env", "{n}={x} is not below the node count {num_nodes}"),
            Some((_, x)) => x,
            None => rank / local_world_size,
        };
        let master_addr = match first(env, &["MASTER_ADDR"]) {
            Some((_, a)) => a.trim().to_string(),
            None => match first(env, &["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"]) {
                Some((n, list)) => slurm::first_host(&list).map_err(|e| Error::new("dist env", format!("{n}={list:?}: {e}")))?,
                None => bail!(
                    "dist env",
                    "{world_var}={world_size} but MASTER_ADDR is not set: export the host of global rank 0 as MASTER_ADDR (torchrun sets it; under srun it defaults to the first host of SLURM_JOB_NODELIST)"
                ),
            },
        };
        let cuda_ordinal = cuda_ordinal(local_rank, visible.as_deref())?;
        Ok(Some(DistEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            node_rank,
            num_nodes,
            master_addr,
            master_port,
            agent_store,
            restart_count,
            cuda_ordinal,
            launcher,
        }))
    }

    /// A one-node layout (`local_rank = rank`) with our own store: tests and tools that build
    /// an environment by hand.
    pub fn local(rank: usize, world_size: usize, master_addr: &str, master_port: u16) -> DistEnv {
        DistEnv {
            rank,
            world_size,
            local_rank: rank,
            local_world_size: world_size,
            node_rank: 0,
            num_nodes: 1,
            master_addr: master_addr.into(),
            master_port,
            agent_store: false,
            restart_count: 0,
            cuda_ordinal: rank,
            launcher: Launcher::Env,
        }
    }

    /// Whether this process serves the rendezvous store (global rank 0, no agent).
    pub fn serves_store(&self) -> bool {
        self.rank == 0 && !self.agent_store
    }

    /// "cuda:N" of the GPU this process drives.
    pub fn cuda_device(&self) -> String {
        format!("cuda:{}", self.cuda_ordinal)
    }
}

/// SLURM's tasks on this node: `SLURM_STEP_TASKS_PER_NODE` / `SLURM_TASKS_PER_NODE` (indexed
/// by the node) or `SLURM_NTASKS_PER_NODE`.
fn slurm_tasks_per_node(env: Lookup, node: Option<usize>) -> Result<Option<(&'static str, usize)>> {
    if let Some((n, v)) = first(env, &["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]) {
        let per_node = slurm::expand_tasks_per_node(&v).map_err(|e| Error::new("dist env", format!("{n}={v:?}: {e}")))?;
        let i = match (node, per_node.len()) {
            (_, 1) => 0,
            (Some(i), len) if i < len => i,
            (Some(i), len) => bail!("dist env", "{n}={v:?} lists {len} nodes but this is node {i} (SLURM_NODEID)"),
            (None, len) => bail!("dist env", "{n}={v:?} lists {len} nodes but SLURM_NODEID is not set"),
        };
        return Ok(Some((n, per_node[i])));
    }
    num(env, &["SLURM_NTASKS_PER_NODE"])
}

/// The store of this process's world, while the world communicator `init` made is alive.
static WORLD_STORE: Mutex<Weak<Store>> = Mutex::new(Weak::new());

/// The rendezvous store of the world `init` joined (for store barriers around rank-0-only
/// phases, and failure notices); `None` without a multi-process world.
pub fn world_store() -> Option<Arc<Store>> {
    WORLD_STORE.lock().unwrap_or_else(|e| e.into_inner()).upgrade()
}

/// Meets the other processes at the store (`Store::rendezvous`), bounded by `options.timeout`.
pub fn rendezvous(env: &DistEnv, options: &CommOptions) -> Result<Arc<Store>> {
    let store = Arc::new(Store::rendezvous(env, options.timeout)?);
    *WORLD_STORE.lock().unwrap_or_else(|e| e.into_inner()) = Arc::downgrade(&store);
    Ok(store)
}

/// The world communicator for this process: `NcclComm` when `env` describes a multi-process
/// run (the CUDA backend of the process's GPU must be initialised first: `cuda:{cuda_ordinal}`),
/// else a world of one. For NCCL it also installs `report_panics_to_peers`.
pub fn init(env: Option<DistEnv>, options: CommOptions) -> Result<Arc<dyn Communicator>> {
    let Some(env) = env.filter(|e| e.world_size > 1) else { return Ok(ThreadComm::solo(options)) };
    let backend = gpu_backend(&env)?;
    let store = rendezvous(&env, &options)?;
    init_with_store(&env, store, backend, options)
}

/// Environment variable: `1` makes `cuda:N` the CPU emulator of the CUDA backend (read by the
/// tools' `init_cuda`); a multi-process run then uses the emulated NCCL.
pub const ENV_CUDA_EMULATOR: &str = "FERROLM_CUDA_EMULATOR";

/// The CUDA backend `init` uses: the process's GPU, initialised. The emulated device is
/// accepted when `FERROLM_CUDA_EMULATOR=1` (its communicator then uses the emulated NCCL).
pub fn gpu_backend(env: &DistEnv) -> Result<Arc<CudaBackend>> {
    let emulator = std::env::var(ENV_CUDA_EMULATOR).is_ok_and(|v| v == "1");
    CudaBackend::latest(env.cuda_ordinal).filter(|b| !b.is_emulated() || emulator).ok_or_else(|| {
        Error::new(
            "dist init",
            format!(
                "WORLD_SIZE={} describes a multi-process run, which needs NCCL on a GPU (or the CUDA emulator with \
                 {ENV_CUDA_EMULATOR}=1): initialise CUDA on {} first. CPU runs use thread ranks in one process instead.",
                env.world_size,
                env.cuda_device()
            ),
        )
    })
}

/// `init` after `rendezvous`: NCCL's world communicator over the store.
pub fn init_with_store(env: &DistEnv, store: Arc<Store>, backend: Arc<CudaBackend>, options: CommOptions) -> Result<Arc<dyn Communicator>> {
    let comm = NcclComm::init(env.rank, env.world_size, store, backend, options)?;
    crate::nccl::report_panics_to_peers();
    Ok(comm)
}

/// `init` with the process environment and `CommOptions::from_env()`.
pub fn init_from_env() -> Result<Arc<dyn Communicator>> {
    init(DistEnv::from_env()?, CommOptions::from_env()?)
}
