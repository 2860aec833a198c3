//! What the op modules share: the device an op runs on (`On`), the shapes and pointers their
//! launchers read off storage views, and f64 constants for the generic CPU kernels.
use ferrolm_cuda::{CudaBackend, CudaStorage, DevPtr, Launch};
use ferrolm_tensor::backend::{self, View};
use ferrolm_tensor::{DType, Device, DeviceStorage, Error, Layout, Result, Storage, Tensor};
use num_traits::Float;
use std::sync::Arc;

/// Where an op's storages live: the host (the CPU reference runs), or a CUDA device (its
/// launcher runs on the registered backend).
pub(crate) enum On {
    Cpu,
    Cuda(Arc<CudaBackend>),
}

/// The device of `x` (an op's inputs share one device: the op checked that), with its backend.
pub(crate) fn on(op: &str, x: &Storage) -> Result<On> {
    on_device(op, x.device())
}

/// `on` for a device named before any storage is at hand (an op that allocates its outputs per
/// backend).
pub(crate) fn on_device(op: &str, device: Device) -> Result<On> {
    match device {
        Device::Cpu => Ok(On::Cpu),
        device => backend::get(op, device)?
            .into_any()
            .downcast::<CudaBackend>()
            .map(On::Cuda)
            .map_err(|_| Error::new(op, format!("the backend of {device} has no kernels for {op}"))),
    }
}

/// `Tensor::with_storages` over `ts` and the optional `extra` (an addend or a destination a
/// backward's kernel may take, `GradCtx::addend` and `GradCtx::param_dest`): `f` gets the views
/// of `ts`, then each extra's view where it is given.
pub(crate) fn with_views<R, const K: usize>(
    ts: &[&Tensor],
    extra: [Option<&Tensor>; K],
    f: impl FnOnce(&[View], [Option<View>; K]) -> Result<R>,
) -> Result<R> {
    let all: Vec<&Tensor> = ts.iter().copied().chain(extra.iter().flatten().copied()).collect();
    Tensor::with_storages(&all, |s| {
        let mut rest = s[ts.len()..].iter();
        f(&s[..ts.len()], extra.map(|e| e.and_then(|_| rest.next().copied())))
    })
}

/// (offset, rows, last dim) of a contiguous view.
pub(crate) fn rows(l: &Layout) -> (usize, usize, usize) {
    let d = *l.dims().last().unwrap_or(&1);
    (l.offset, l.numel().checked_div(d).unwrap_or(0), d)
}

/// The device address of the first element of a CUDA view.
pub(crate) fn dev_ptr(op: &str, x: View) -> Result<DevPtr> {
    Ok(CudaStorage::of(op, x.0)?.at(x.1.offset))
}

/// A statistic or scale as an f32 device pointer: the view itself when it is f32, else an f32
/// copy, returned beside the pointer to keep it alive until the launch is enqueued.
pub(crate) fn f32_ptr(be: &CudaBackend, op: &str, x: View) -> Result<(DevPtr, Option<CudaStorage>)> {
    let s = CudaStorage::of(op, x.0)?;
    if s.dtype() == DType::F32 {
        return Ok((s.at(x.1.offset), None));
    }
    let c = be.to_dtype(x, DType::F32)?;
    Ok((c.ptr(), Some(c)))
}

/// `v` in the CPU kernels' working precision.
pub(crate) fn num<T: Float>(v: f64) -> T {
    T::from(v).unwrap()
}

/// Partials (one row of d f32 per chunk of rows) that the last pass of a column reduction
/// (RMSNorm's dw, the bias gradient) sums per column at most; over that (many short rows:
/// QK-norm's B·T·H rows of the head dim, a k/v bias over every token) a folding pass first sums
/// FOLD_GROUP chunks a block row, in chunk order, so no thread walks thousands of partials and
/// no level leaves the whole reduction to one block.
pub(crate) const FOLD_MAX: usize = 64;
pub(crate) const FOLD_GROUP: usize = 32;

/// The launch of a finishing (or folding) pass that writes `out_rows` rows of d columns from
/// `nchunks` partial rows: a block row per output row, up to BLOCK columns a block.
pub(crate) fn fold_launch(out_rows: usize, d: usize, nchunks: usize) -> Launch {
    let bx = d.next_multiple_of(32).clamp(32, Launch::BLOCK as usize);
    Launch::new((out_rows.max(1) as u32, d.div_ceil(bx).max(1) as u32, 1), bx as u32).elems(nchunks * d)
}
