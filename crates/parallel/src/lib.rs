//! ferrolm-parallel: ferrolm's distributed runtime: communication, tensor parallelism, ZeRO
//! sharding and optimizer offload; the model never sees it. The performance model that ranks
//! layouts (the planner) is `ferrolm::planner` in the facade; of it only the pure functions the
//! runtime itself uses live here ([`cost`], [`dos`]).
//!
//! - [`comm`]: the [`Communicator`] trait (all_reduce, all_gather, reduce_scatter, broadcast,
//!   barrier, split; `*_async` variants return a [`Work`] whose result is a pending tensor,
//!   waited on where it is first read), [`ReduceOp`], per-communicator options (timeout) and
//!   byte counters ([`CommStats`]).
//! - [`thread`]: [`ThreadComm`], ranks as threads of one process (CPU runs and every parallel
//!   test): one communication thread per rank and group, deterministic fixed-order reductions,
//!   tensors of other devices staged through the host, and `ThreadComm::run`, which turns a
//!   rank's error or panic into prompt errors on the others.
//! - [`nccl`]: [`NcclComm`], NCCL on its own CUDA stream ordered with the compute stream by
//!   events, bootstrapped through [`store`], with a watchdog for hangs and peer failures;
//!   [`nccl_lib`] finds `libnccl.so.2` itself (cudarc's loader only tries `libnccl.so`), or
//!   opens the emulated NCCL (crates/parallel/emu) for multi-process runs on the CUDA emulator.
//! - [`store`]: the rendezvous store on `MASTER_ADDR:MASTER_PORT` (values, barriers with their
//!   own timeouts, failure notices), speaking PyTorch's TCPStore protocol ([`tcpstore`]): a
//!   client of torchrun's agent store, or of the store rank 0 serves without an agent.
//! - [`env`](mod@env): [`DistEnv`] (torchrun, srun and Open MPI variables: ranks, ranks per node,
//!   the GPU ordinal, who serves the store) and [`init_from_env`], which returns an `NcclComm`
//!   for a multi-process GPU run and a world of one otherwise; [`slurm`] expands SLURM's host
//!   and tasks-per-node lists; [`launcher`] starts one node's processes (the `launch` example).
//! - [`cost`]: the ring / hierarchical cost model as pure functions (bytes per rank, seconds per
//!   collective), shared by [`SimLink`], `CommStats` and the planner (`ferrolm::planner`).
//! - [`simlink`]: [`SimLink`], a wrapper that completes each collective only after the model's
//!   time on a FIFO link, so a CPU run measures exposed communication.
//! - [`dos`]: Deep Optimizer States' performance model (update phase of an offloaded step for
//!   one GPU subgroup in k) and the choice of k.
//! - [`mesh`]: [`DeviceMesh`], the tp and dp groups.
//! - [`engine`]: [`TrainEngine`], what a training loop drives (micro-batches, the step, skips,
//!   checkpoint state), and [`zero`], the engine: flexible ZeRO sharding over the flat parameter
//!   store, on one device as on many; [`offload`] keeps its optimizer state in host memory, and
//!   [`zero::ckpt`] writes and reads its sharded checkpoints and joins its full parameters.
//! - [`tp`]: Megatron-style tensor parallelism attached to a model from outside
//!   (`parallelize`): column/row/vocabulary-parallel ops, replicated KV heads for GQA.
//! - [`comm_ops`]: collectives as autograd ops (Megatron's f, g, sequence-parallel gather /
//!   reduce-scatter, scatter), pending in forward and in backward.
pub mod comm;
pub mod comm_ops;
pub mod cost;
pub mod dos;
pub mod engine;
pub mod env;
pub mod launcher;
pub mod mesh;
pub mod nccl;
pub mod nccl_lib;
pub mod offload;
mod reduce;
pub mod simlink;
pub mod slurm;
pub mod store;
pub mod tcpstore;
mod tcpstore_server;
pub mod thread;
pub mod tp;
pub mod zero;

pub use comm::{Collective, CommOptions, CommStats, Communicator, Completion, KindStats, ReduceOp, Work};
pub use engine::{StepReport, TrainEngine};
pub use env::{cuda_ordinal, init, init_from_env, world_store, DistEnv, Launcher, DEFAULT_MASTER_PORT};
pub use mesh::DeviceMesh;
pub use nccl::{report_panics_to_peers, NcclComm};
pub use nccl_lib::{library_candidates, nccl_version};
pub use simlink::SimLink;
pub use thread::ThreadComm;
