//! Collectives as autograd ops (Megatron-LM's names in each doc comment). Forward results and
//! backward gradients are the pending tensors of the async collectives: nothing waits until a
//! consumer reads them, and the autograd engine runs other ready work before waiting on a
//! pending gradient, so communication overlaps compute in both passes.
//!
//! Every op is collective: all ranks of `comm` must call it (and run its backward) in the same
//! order. Collectives work along dim 0; the `dim` versions move `dim` to the front with a
//! transpose, copy once to make it contiguous, and transpose the result back as a view.
use crate::comm::{Communicator, ReduceOp};
use ferrolm_tensor::{bail, no_grad, Result, Tensor};
use std::sync::Arc;

fn check_dim(op: &str, x: &Tensor, dim: usize) -> Result<()> {
    if dim >= x.rank() {
        bail!(op, "dim {dim} is out of range for shape {:?}", x.dims());
    }
    Ok(())
}

/// `x` with `dim` moved to the front, contiguous (a copy unless dim is 0 and `x` is contiguous).
fn to_front(x: &Tensor, dim: usize) -> Result<Tensor> {
    if dim == 0 {
        x.contiguous()
    } else {
        x.transpose(0, dim)?.contiguous()
    }
}
fn from_front(x: Tensor, dim: usize) -> Result<Tensor> {
    if dim == 0 {
        Ok(x)
    } else {
        x.transpose(0, dim)
    }
}

/// All-gather along `dim`: the ranks' tensors concatenated in rank order. Pending (not waited).
pub fn all_gather_along(comm: &dyn Communicator, x: &Tensor, dim: usize) -> Result<Tensor> {
    check_dim("all_gather", x, dim)?;
    let _g = no_grad();
    from_front(comm.all_gather_async(&to_front(x, dim)?)?.tensor(), dim)
}

/// Reduce-scatter along `dim`: this rank's block of the reduction. Pending (not waited).
pub fn reduce_scatter_along(comm: &dyn Communicator, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
    check_dim("reduce_scatter", x, dim)?;
    let _g = no_grad();
    from_front(comm.reduce_scatter_async(&to_front(x, dim)?, op)?.tensor(), dim)
}

/// Megatron's `f` (`copy_to_tensor_model_parallel_region`): identity forward; backward
/// all-reduces (sums) the gradient over the group, returned pending.
pub fn copy_to_group(x: &Tensor, comm: &Arc<dyn Communicator>) -> Result<Tensor> {
    let c = comm.clone();
    Ok(Tensor::from_op(
        x.detach(),
        "copy_to_group",
        &[x],
        Box::new(move |g| Ok(vec![Some(c.all_reduce_async(g, ReduceOp::Sum)?.tensor())])),
    ))
}

/// Megatron's `g` (`reduce_from_tensor_model_parallel_region`): all-reduce (sum) forward,
/// returned pending; identity backward.
pub fn reduce_from_group(x: &Tensor, comm: &Arc<dyn Communicator>) -> Result<Tensor> {
    let out = {
        let _g = no_grad();
        comm.all_reduce_async(x, ReduceOp::Sum)?.tensor()
    };
    Ok(Tensor::from_op(out, "reduce_from_group", &[x], Box::new(|g| Ok(vec![Some(g.clone())]))))
}

/// Megatron's `gather_from_sequence_parallel_region`: all-gather along `dim` forward; backward
/// reduce-scatters (sums) the gradient along `dim` (the consumer of the gathered tensor is a
/// tensor-parallel layer whose ranks each hold a partial gradient).
pub fn gather_from_group(x: &Tensor, comm: &Arc<dyn Communicator>, dim: usize) -> Result<Tensor> {
    let out = all_gather_along(comm.as_ref(), x, dim)?;
    let c = comm.clone();
    Ok(Tensor::from_op(
        out,
        "gather_from_group",
        &[x],
        Box::new(move |g| Ok(vec![Some(reduce_scatter_along(c.as_ref(), g, dim, ReduceOp::Sum)?)])),
    ))
}

/// Megatron's `reduce_scatter_to_sequence_parallel_region`: reduce-scatter (sum) along `dim`
/// forward; all-gather of the gradient along `dim` backward.
pub fn reduce_scatter(x: &Tensor, comm: &Arc<dyn Communicator>, dim: usize) -> Result<Tensor> {
    let out = reduce_scatter_along(comm.as_ref(), x, dim, ReduceOp::Sum)?;
    let c = comm.clone();
    Ok(Tensor::from_op(out, "reduce_scatter", &[x], Box::new(move |g| Ok(vec![Some(all_gather_along(c.as_ref(), g, dim)?)]))))
}

/// Megatron's `scatter_to_sequence_parallel_region`: forward keeps this rank's block of `dim`
/// (a view, no communication; every rank holds the full tensor); backward all-gathers the
/// gradient along `dim`.
pub fn scatter_to_group(x: &Tensor, comm: &Arc<dyn Communicator>, dim: usize) -> Result<Tensor> {
    check_dim("scatter_to_group", x, dim)?;
    let (n, d) = (comm.size(), x.dims()[dim]);
    if d % n != 0 {
        bail!("scatter_to_group", "dim {dim} of shape {:?} is not divisible by the group size {n}", x.dims());
    }
    let out = {
        let _g = no_grad();
        x.narrow(dim, comm.rank() * (d / n), d / n)?
    };
    let c = comm.clone();
    Ok(Tensor::from_op(out, "scatter_to_group", &[x], Box::new(move |g| Ok(vec![Some(all_gather_along(c.as_ref(), g, dim)?)]))))
}
