//! Activation checkpointing, applied to a model from outside (as a parallel plan is): the
//! chosen blocks' residual branches keep only their outputs in the forward pass and are
//! recomputed in backward. Gradients are bitwise those of the plain run.
use crate::llama::Llama;
use crate::module::{BranchFn, BranchHook};
use ferrolm_tensor::{recompute, Result, Tensor};
use std::sync::Arc;

/// Recomputes the branches of blocks `0..layers` (the first blocks: their activations live
/// longest) and runs the others normally.
pub struct Recompute {
    pub layers: usize,
}

impl BranchHook for Recompute {
    fn call(&self, layer: usize, branch: BranchFn, x: &Tensor) -> Result<Tensor> {
        if layer >= self.layers {
            return branch(x);
        }
        recompute(std::slice::from_ref(x), move |xs| branch(&xs[0]))
    }
}

/// Checkpoints the first `layers` blocks (all of them when `layers` >= the block count;
/// none when 0).
pub fn apply_activation_checkpointing(model: &mut Llama, layers: usize) {
    model.branch_hook = (layers > 0).then(|| Arc::new(Recompute { layers }) as Arc<dyn BranchHook>);
}

impl Llama {
    /// Checkpoints every block (`true`) or none (`false`).
    pub fn set_activation_checkpointing(&mut self, on: bool) {
        apply_activation_checkpointing(self, if on { usize::MAX } else { 0 });
    }
    pub fn activation_checkpointing(&self) -> bool {
        self.branch_hook.is_some()
    }
}
