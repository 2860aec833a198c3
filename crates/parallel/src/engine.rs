//! What a training loop drives: one engine per rank, which owns the parameters' placement (its
//! shards, where the optimizer state lives) and the whole micro-batch/step protocol. The loop
//! itself is forward, backward, step: `micro_batch` for each micro-batch of a step, then `step`.
//! `zero::Zero` is the engine, on one device (a world of one) as on many.
use crate::DeviceMesh;
use ferrolm_nn::safetensors_io::TensorMap;
use ferrolm_tensor::{Result, Tensor};
use std::path::Path;

/// What one optimizer step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// The step's loss, averaged over the micro-batches and the data-parallel ranks.
    pub loss: f64,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    /// False when the loss or the norm was not finite: the update was skipped on every rank
    /// alike, weights and optimizer state unchanged.
    pub applied: bool,
}

pub trait TrainEngine {
    /// One micro-batch: `forward` runs the model and returns the loss to backpropagate (already
    /// divided by the step's micro-batch count); its gradients flow into the engine. `last`: the
    /// step's last micro-batch, whose gradient hand-over starts during its backward pass.
    fn micro_batch(&mut self, last: bool, forward: &mut dyn FnMut() -> Result<Tensor>) -> Result<()>;
    /// The optimizer step after the last micro-batch. `local_loss` is this rank's mean loss of
    /// the step. Gradients are averaged over the data-parallel ranks and clipped to `max_norm` by
    /// the global norm (`<= 0`: no clipping); a loss or norm that is not finite skips the update.
    fn step(&mut self, lr: f64, max_norm: f64, local_loss: f64) -> Result<StepReport>;
    /// Drops this step's gradients (waiting for collectives in flight) without an update.
    fn discard(&mut self) -> Result<()>;
    /// This rank's tensors of a sharded checkpoint (parameter and optimizer ranges).
    fn state(&self) -> Result<Vec<(String, Tensor)>>;
    /// The parameter that element `index` of the `state()` tensor `name` belongs to (for
    /// messages), e.g. `model.norm.weight` or `exp_avg of model.norm.weight`.
    fn owner_of(&self, name: &str, index: usize) -> Option<String>;
    /// Writes this rank's shards (and, on rank 0, their index) into `dir`; collective.
    fn save_shards(&self, dir: &Path) -> Result<()>;
    /// The full parameters by name, f32 on the CPU, joined from what the ranks hold (no shard
    /// file is read): Some on world rank 0, None on the others. Collective.
    fn full_params(&self) -> Result<Option<TensorMap>>;
    /// Loads full parameters and optimizer state by name (`exp_avg.<name>`, `exp_avg_sq.<name>`,
    /// `master.<name>`), as a checkpoint of any layout holds them, and the step count.
    fn load(&mut self, params: &TensorMap, state: &TensorMap, step: u64) -> Result<()>;
    /// The ranks this engine spans.
    fn mesh(&self) -> &DeviceMesh;
}
