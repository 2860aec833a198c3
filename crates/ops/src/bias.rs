//! A linear layer's bias (Qwen2/2.5's q/k/v projections): y = x + b, b (d) broadcast over the
//! rows of x (..., d), and `linear_bias(x, w, b)` = x Wᵀ + b, the GEMM then this op. Nothing is
//! saved. Backward: dx = dy as it arrives (no kernel), db = Σ_rows dy (none for a frozen bias), summed in a fixed order
//! on every device: on the CPU in row order, on CUDA in two passes (f32 partials per chunk of
//! rows, then the chunks in order, folded in levels where they are many), so the bits do not
//! depend on timing.
//! CUDA: kernels/bias.cu.
use crate::dispatch::{dev_ptr, on, rows, On};
use ferrolm_tensor::backend::View;
use ferrolm_tensor::{bail, same_float, Result, Storage, Tensor};

/// x + b over the last dim of x (b has one element per column).
pub fn bias_add(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    same_float("bias_add", &[x, b])?;
    let d = *x.dims().last().unwrap_or(&0);
    if x.rank() == 0 || b.dims() != [d] {
        bail!("bias_add", "bias shape {:?} does not match the last dim of {:?}", b.shape(), x.shape());
    }
    let (xc, bc) = (x.contiguous()?, b.contiguous()?);
    let y = Tensor::new(Tensor::with_storages(&[&xc, &bc], |s| forward(s[0], s[1]))?, x.shape().clone())?;
    // A frozen bias (LoRA's base, a reference model) takes no gradient: no pass over dy for it.
    let need_b = b.requires_grad();
    let backward_fn = move |dy: &Tensor| {
        let db = match need_b {
            true => Some(Tensor::new(Tensor::with_storages(&[&dy.contiguous()?], |s| backward(s[0], d))?, [d])?),
            false => None,
        };
        Ok(vec![Some(dy.clone()), db])
    };
    Ok(Tensor::from_op(y, "bias_add", &[x, b], Box::new(backward_fn)))
}

/// x Wᵀ + b: x (..., k), w (n, k), b (n).
pub fn linear_bias(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    bias_add(&x.linear(w)?, b)
}

/// x (rows, d) and b (d), contiguous -> x + b.
pub fn forward(x: View, b: View) -> Result<Storage> {
    match on("bias_add", x.0)? {
        On::Cpu => cpu::forward(x, b),
        On::Cuda(be) => cuda::forward(&be, x, b),
    }
}

/// dy (rows, d) contiguous -> db (d) = Σ_rows dy, of dy's dtype.
pub fn backward(dy: View, d: usize) -> Result<Storage> {
    match on("bias_add", dy.0)? {
        On::Cpu => cpu::backward(dy, d),
        On::Cuda(be) => cuda::backward(&be, dy, d),
    }
}

mod cpu {
    //! The reference: rows in parallel for the forward; db summed over rows in row order.
    use super::*;
    use ferrolm_tensor::{float_dispatch, multiversion};
    use num_traits::Float;
    use rayon::prelude::*;

    pub(super) fn forward(x: View, b: View) -> Result<Storage> {
        let (ox, n, d) = rows(x.1);
        let ob = b.1.offset;
        Ok(float_dispatch!("bias_add", x.0.dtype(), [x, b], bias_add(&x[ox..ox + n * d], &b[ob..ob + d])))
    }

    pub(super) fn backward(dy: View, d: usize) -> Result<Storage> {
        let (o, n) = (dy.1.offset, dy.1.numel());
        Ok(float_dispatch!("bias_add_backward", dy.0.dtype(), [dy], column_sums(&dy[o..o + n], d)))
    }

    multiversion! {
        fn add_row[T: Float](y: &mut [T], x: &[T], b: &[T]) {
            for ((y, &x), &b) in y.iter_mut().zip(x).zip(b) {
                *y = x + b;
            }
        }
    }

    multiversion! {
        /// acc += row, for each row in order.
        fn add_rows[T: Float](acc: &mut [T], dy: &[T]) {
            for row in dy.chunks(acc.len()) {
                for (a, &g) in acc.iter_mut().zip(row) {
                    *a = *a + g;
                }
            }
        }
    }

    fn bias_add<T: Float + Send + Sync>(x: &[T], b: &[T]) -> Vec<T> {
        let d = b.len().max(1);
        let mut y = vec![T::zero(); x.len()];
        y.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(|(y, x)| add_row(y, x, b));
        y
    }

    fn column_sums<T: Float>(dy: &[T], d: usize) -> Vec<T> {
        let mut acc = vec![T::zero(); d];
        if d > 0 {
            add_rows(&mut acc, dy);
        }
        acc
    }
}

mod cuda {
    //! Launchers of kernels/bias.cu.
    use super::*;
    use crate::dispatch::{fold_launch, FOLD_GROUP, FOLD_MAX};
    use ferrolm_cuda::{kernels, CudaBackend, CudaStorage, DevPtr, Launch};
    use ferrolm_tensor::{DType, DeviceStorage};

    /// Rows a block of the first db pass sums into one partial, with a column (or a 16-byte
    /// vector of columns) a thread: between 4 and 64, fewer where the grid would give an SM
    /// under two blocks.
    const ROWS_PER_CHUNK: (usize, usize) = (4, 64);

    /// Whether rows of d elements of dt at these addresses are whole 16-byte vectors.
    fn vectors(d: usize, dt: DType, ptrs: &[DevPtr]) -> bool {
        d.is_multiple_of(16 / dt.size_in_bytes()) && ptrs.iter().all(|p| p.addr().is_multiple_of(16))
    }

    pub(super) fn forward(be: &CudaBackend, x: View, b: View) -> Result<Storage> {
        let s = CudaStorage::of("bias_add", x.0)?;
        let (_, n, d) = rows(x.1);
        let dt = s.dtype();
        let y = be.alloc_storage(n * d, dt)?;
        let (px, pb) = (s.at(x.1.offset), dev_ptr("bias_add", b)?);
        let vec = vectors(d, dt, &[px, pb, y.ptr()]);
        let cfg = be.plan_elementwise(n * d, dt.size_in_bytes(), vec);
        // SAFETY: x is (n, d) and b (d) of dtype dt, contiguous; y holds n * d elements of dt;
        // `vec` only where d is whole 16-byte vectors and every pointer is aligned.
        unsafe { kernels::bias_fwd(be, dt, cfg, px, pb, y.ptr(), n as i64, d as i64, vec as i32)? };
        Ok(y.into())
    }

    pub(super) fn backward(be: &CudaBackend, dy: View, d: usize) -> Result<Storage> {
        let op = "bias_add_backward";
        let s = CudaStorage::of(op, dy.0)?;
        let dt = s.dtype();
        let n = dy.1.numel().checked_div(d).unwrap_or(0);
        let pdy = s.at(dy.1.offset);
        let vec = vectors(d, dt, &[pdy]);
        let v = if vec { 16 / dt.size_in_bytes() } else { 1 };
        // A block per (chunk of rows, up to BLOCK threads of v columns), no wider than the row.
        let threads = d.div_ceil(v).max(1);
        let bx = threads.next_multiple_of(32).min(Launch::BLOCK as usize);
        let gy = threads.div_ceil(bx);
        let rpc = (n * gy / (2 * be.sm_count() as usize)).clamp(ROWS_PER_CHUNK.0, ROWS_PER_CHUNK.1);
        let nchunks = n.div_ceil(rpc).max(1);
        // With no rows the partials must still sum to zero.
        let partial = if n == 0 { be.alloc_zeroed(nchunks * d, DType::F32)? } else { be.alloc_storage(nchunks * d, DType::F32)? };
        let cfg = Launch::new((nchunks as u32, gy as u32, 1), bx as u32).elems(n * d);
        // SAFETY: dy is (n, d) of dt, contiguous (16-byte aligned with d whole vectors where
        // `vec`); partial holds nchunks * d f32, chunk c covering rows [c * rpc, ..).
        unsafe { kernels::bias_bwd_partial(be, dt, cfg, pdy, partial.ptr(), n as i64, d as i64, rpc as i64, vec as i32)? };
        let (mut p, mut nc) = (partial, nchunks);
        while nc > FOLD_MAX {
            let next = nc.div_ceil(FOLD_GROUP);
            let out = be.alloc_storage(next * d, DType::F32)?;
            // SAFETY: p holds nc * d f32, out next * d f32: block row g sums chunks
            // [g * FOLD_GROUP, ..) of p, within nc, into row g.
            unsafe {
                kernels::bias_bwd_finish(
                    be,
                    DType::F32,
                    fold_launch(next, d, nc),
                    p.ptr(),
                    out.ptr(),
                    nc as i64,
                    d as i64,
                    FOLD_GROUP as i64,
                )?
            };
            (p, nc) = (out, next);
        }
        let db = be.alloc_storage(d, dt)?;
        // SAFETY: p holds nc * d f32; one block row (group nc) writes d elements of dt into db.
        unsafe { kernels::bias_bwd_finish(be, dt, fold_launch(1, d, nc), p.ptr(), db.ptr(), nc as i64, d as i64, nc.max(1) as i64)? };
        Ok(db.into())
    }
}
