//! Softmax over the last dimension: y = exp(x − max) / Σ exp(x − max) per row, and its backward
//! dx = y · (dy − ⟨y, dy⟩), both with the row reductions taken in a fixed order.
//! CUDA: kernels/softmax.cu (one block per row).
use crate::dispatch::{dev_ptr, on, rows, On};
use ferrolm_tensor::backend::View;
use ferrolm_tensor::{same_float, Result, Storage, Tensor};

/// Softmax of `x` over its last dim.
pub fn softmax_last(x: &Tensor) -> Result<Tensor> {
    same_float("softmax", &[x])?;
    let xc = x.contiguous()?;
    let out = Tensor::new(xc.with_storage(forward)?, x.shape().clone())?;
    let y = out.clone();
    let backward_fn = move |g: &Tensor| {
        let g = g.contiguous()?;
        let st = Tensor::with_storages(&[&y, &g], |s| backward(s[0], s[1]))?;
        Ok(vec![Some(Tensor::new(st, y.shape().clone())?)])
    };
    Ok(Tensor::from_op(out, "softmax", &[x], Box::new(backward_fn)))
}

/// x (rows, d) contiguous -> softmax over each row.
pub fn forward(x: View) -> Result<Storage> {
    match on("softmax", x.0)? {
        On::Cpu => cpu::forward(x),
        On::Cuda(be) => cuda::forward(&be, x),
    }
}

/// The forward's output y and the gradient dy, contiguous -> dx.
pub fn backward(y: View, dy: View) -> Result<Storage> {
    match on("softmax", y.0)? {
        On::Cpu => cpu::backward(y, dy),
        On::Cuda(be) => cuda::backward(&be, y, dy),
    }
}

mod cpu {
    //! The reference: rows in parallel.
    use super::*;
    use ferrolm_tensor::float_dispatch;
    use num_traits::Float;
    use rayon::prelude::*;

    pub(super) fn forward(x: View) -> Result<Storage> {
        let (off, n, d) = rows(x.1);
        Ok(float_dispatch!("softmax", x.0.dtype(), [x], softmax(&x[off..off + n * d], d)))
    }

    pub(super) fn backward(y: View, dy: View) -> Result<Storage> {
        let (oy, n, d) = rows(y.1);
        let (od, _, _) = rows(dy.1);
        Ok(float_dispatch!("softmax_backward", y.0.dtype(), [y, dy], softmax_backward(&y[oy..oy + n * d], &dy[od..od + n * d], d)))
    }

    fn softmax<T: Float + Send + Sync>(x: &[T], d: usize) -> Vec<T> {
        let mut y = vec![T::zero(); x.len()];
        y.par_chunks_mut(d.max(1)).zip(x.par_chunks(d.max(1))).for_each(|(y, x)| {
            let m = x.iter().fold(T::neg_infinity(), |a, &b| a.max(b));
            let mut s = T::zero();
            for (o, &v) in y.iter_mut().zip(x) {
                *o = (v - m).exp();
                s = s + *o;
            }
            y.iter_mut().for_each(|o| *o = *o / s);
        });
        y
    }

    fn softmax_backward<T: Float + Send + Sync>(y: &[T], dy: &[T], d: usize) -> Vec<T> {
        let mut dx = vec![T::zero(); y.len()];
        dx.par_chunks_mut(d.max(1)).zip(y.par_chunks(d.max(1)).zip(dy.par_chunks(d.max(1)))).for_each(|(dx, (y, dy))| {
            let dot = y.iter().zip(dy).fold(T::zero(), |a, (&p, &g)| a + p * g);
            for ((o, &p), &g) in dx.iter_mut().zip(y).zip(dy) {
                *o = p * (g - dot);
            }
        });
        dx
    }
}

mod cuda {
    //! Launchers of kernels/softmax.cu.
    use super::*;
    use ferrolm_cuda::{kernels, CudaBackend, CudaStorage, Launch};
    use ferrolm_tensor::DeviceStorage;

    pub(super) fn forward(be: &CudaBackend, x: View) -> Result<Storage> {
        let s = CudaStorage::of("softmax", x.0)?;
        let (_, n, d) = rows(x.1);
        let out = be.alloc_storage(n * d, s.dtype())?;
        // SAFETY: x is (n, d) contiguous from its offset; `out` holds n * d elements of its dtype.
        unsafe { kernels::softmax_fwd(be, s.dtype(), Launch::per_row(n, Launch::BLOCK), s.at(x.1.offset), out.ptr(), n as i64, d as i64)? };
        Ok(out.into())
    }

    pub(super) fn backward(be: &CudaBackend, y: View, dy: View) -> Result<Storage> {
        let s = CudaStorage::of("softmax_backward", y.0)?;
        let (_, n, d) = rows(y.1);
        let out = be.alloc_storage(n * d, s.dtype())?;
        let (py, pdy) = (s.at(y.1.offset), dev_ptr("softmax_backward", dy)?);
        // SAFETY: y and dy are (n, d) contiguous, of one dtype; `out` holds n * d elements of it.
        unsafe { kernels::softmax_bwd(be, s.dtype(), Launch::per_row(n, Launch::BLOCK), py, pdy, out.ptr(), n as i64, d as i64)? };
        Ok(out.into())
    }
}
