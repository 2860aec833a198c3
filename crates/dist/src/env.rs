//! Picking the world communicator from the launcher's environment.
//!
//! torchrun sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` for every
//! process; SLURM (`srun`) and mpirun work when the job script exports the same variables, and
//! under Open MPI's `mpirun` the rank variables fall back to `OMPI_COMM_WORLD_RANK`,
//! `OMPI_COMM_WORLD_SIZE` and `OMPI_COMM_WORLD_LOCAL_RANK` (`MASTER_ADDR`/`MASTER_PORT` must
//! still be exported).
use crate::comm::{CommOptions, Communicator};
use crate::nccl::NcclComm;
use crate::store::Store;
use crate::thread::ThreadComm;
use ferrolm_cuda::CudaBackend;
use ferrolm_tensor::{bail, Error, Result};
use std::sync::Arc;

/// One process's place in a multi-process run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistEnv {
    pub rank: usize,
    pub world_size: usize,
    /// The process's index on its node: which GPU it drives.
    pub local_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
}

impl DistEnv {
    /// From the process environment; `None` when no launcher set a world size.
    pub fn from_env() -> Result<Option<DistEnv>> {
        Self::from_lookup(&|k| std::env::var(k).ok())
    }

    /// From any variable lookup (tests pass a map).
    pub fn from_lookup(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<DistEnv>> {
        fn var(env: &dyn Fn(&str) -> Option<String>, names: &[&'static str]) -> Option<(&'static str, String)> {
            names.iter().find_map(|n| env(n).map(|v| (*n, v)))
        }
        let var = |names: &[&'static str]| var(env, names);
        let num = |names: &[&'static str]| -> Result<Option<usize>> {
            match var(names) {
                None => Ok(None),
                Some((n, v)) => {
                    v.trim().parse().map(Some).map_err(|_| Error::new("dist env", format!("{n}={v:?} is not a non-negative integer")))
                }
            }
        };
        let Some(world_size) = num(&["WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"])? else { return Ok(None) };
        if world_size == 0 {
            bail!("dist env", "WORLD_SIZE must be at least 1");
        }
        let rank = num(&["RANK", "OMPI_COMM_WORLD_RANK"])?.ok_or_else(|| Error::new("dist env", "WORLD_SIZE is set but RANK is not"))?;
        if rank >= world_size {
            bail!("dist env", "RANK={rank} is not below WORLD_SIZE={world_size}");
        }
        let local_rank = num(&["LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"])?.unwrap_or(if world_size == 1 { 0 } else { usize::MAX });
        if local_rank == usize::MAX {
            bail!("dist env", "WORLD_SIZE={world_size} but LOCAL_RANK is not set (it picks the GPU of this process)");
        }
        let (master_addr, master_port) = if world_size == 1 {
            (env("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()), env("MASTER_PORT").and_then(|p| p.parse().ok()).unwrap_or(29500))
        } else {
            let addr = env("MASTER_ADDR").ok_or_else(|| Error::new("dist env", "WORLD_SIZE > 1 but MASTER_ADDR is not set"))?;
            let port = env("MASTER_PORT").ok_or_else(|| Error::new("dist env", "WORLD_SIZE > 1 but MASTER_PORT is not set"))?;
            let port = port.trim().parse().map_err(|_| Error::new("dist env", format!("MASTER_PORT={port:?} is not a port number")))?;
            (addr, port)
        };
        Ok(Some(DistEnv { rank, world_size, local_rank, master_addr, master_port }))
    }
}

/// The world communicator for this process: `NcclComm` when `env` describes a multi-process
/// run (the CUDA backend of the process's GPU must be initialised first: `cuda:LOCAL_RANK`, or
/// `cuda:0` when the launcher shows each process one GPU), else a world of one. For NCCL it also
/// installs `report_panics_to_peers`.
pub fn init(env: Option<DistEnv>, options: CommOptions) -> Result<Arc<dyn Communicator>> {
    let Some(env) = env.filter(|e| e.world_size > 1) else { return Ok(ThreadComm::solo(options)) };
    let backend = [env.local_rank, 0]
        .into_iter()
        .filter_map(CudaBackend::latest)
        .find(|b| !b.is_emulated() && (b.ordinal() == env.local_rank || ferrolm_cuda::device_count() == 1))
        .ok_or_else(|| {
            Error::new(
                "dist init",
                format!(
                    "WORLD_SIZE={} describes a multi-process run, which needs NCCL on a GPU: initialise CUDA on cuda:{} first. \
                     CPU runs use thread ranks in one process instead.",
                    env.world_size, env.local_rank
                ),
            )
        })?;
    let store = Arc::new(Store::rendezvous(&env.master_addr, env.master_port, env.rank, env.world_size, options.timeout)?);
    let comm = NcclComm::init(env.rank, env.world_size, store, backend, options)?;
    crate::nccl::report_panics_to_peers();
    Ok(comm)
}

/// `init` with the process environment and `CommOptions::from_env()`.
pub fn init_from_env() -> Result<Arc<dyn Communicator>> {
    init(DistEnv::from_env()?, CommOptions::from_env()?)
}
