//! The performance model, in one place: what a layout costs in memory and time on a cluster.
//! `plan` (the ShardSpec ranking), `autoconfig` (the layout search) and the training tools'
//! memory check (`pretrain_llama`, `finetune_ladder`) all call it.
//!
//! - [`cluster`]: the machines ([`Cluster`]) and the one constructor of a modelled GPU cluster,
//!   [`Cluster::gpu`], with one set of defaults, each with its source ([`GpuDefaults`]);
//!   [`ADAMW_BYTES_PER_ELEM`], NCCL's buffers per communicator.
//! - [`shape`]: the model's shapes ([`ModelShape`]: presets, per-bucket parameters, FLOPs).
//! - [`memory`]: the memory estimator (peak bytes per rank under a layout) and the check a
//!   training run makes before it allocates anything.
//! - [`step`]: the step-time model (AMSP's terms over ferrolm's engine, overlap, interference)
//!   and the search over every valid `ShardSpec`.
//! - [`layouts`]: the auto-configurator's search over tensor parallelism, specs, micro-batches,
//!   checkpointed layers and optimizer offload, with tensor parallelism's all-reduces.
//! - [`calibrate`]: what the models need measured here (thread ranks' compute, optimizer and
//!   communicator rates; a link's latency and bandwidth).
//! - [`cost`] and [`dos`]: the collective cost model (bytes and seconds per collective) and Deep
//!   Optimizer States' offload model. They live in `ferrolm_parallel`, beside the runtime that also
//!   uses them (`SimLink` delays collectives by `cost`, `CommStats` counts bytes with it, the
//!   offload engine picks its k with `dos`), and are re-exported here so the model has one home.
pub mod calibrate;
pub mod cluster;
pub mod layouts;
pub mod memory;
pub mod shape;
pub mod step;

pub use cluster::{Cluster, GpuClusterSpec, GpuDefaults, ADAMW_BYTES_PER_ELEM, GIB, NCCL_BYTES_PER_COMMUNICATOR};
pub use ferrolm_parallel::{cost, dos};
pub use memory::Memory;
pub use shape::ModelShape;
pub use step::{Estimate, Workload};
