//! Logit softcapping (Gemma 2/3's `final_logit_softcapping` and `attn_logit_softcapping`):
//! y = cap · tanh(x / cap), element-wise, bounding |y| below cap. The forward saves its output,
//! as PyTorch's tanh does, and the backward reads it: dx = dy · (1 − (y / cap)²).
//! CUDA: kernels/softcap.cu.
use crate::dispatch::{dev_ptr, on, On};
use ferrolm_tensor::backend::View;
use ferrolm_tensor::{bail, same_float, Result, Storage, Tensor};

/// cap · tanh(x / cap), element-wise; `cap` positive and finite.
pub fn softcap(x: &Tensor, cap: f64) -> Result<Tensor> {
    same_float("softcap", &[x])?;
    if !(cap.is_finite() && cap > 0.0) {
        bail!("softcap", "the cap must be a positive finite number, got {cap}");
    }
    let xc = x.contiguous()?;
    let y = Tensor::new(Tensor::with_storages(&[&xc], |s| forward(s[0], cap))?, x.shape().clone())?;
    let saved = y.detach();
    let backward_fn = move |dy: &Tensor| {
        let dy = dy.contiguous()?;
        let dx = Tensor::with_storages(&[&dy, &saved], |s| backward(s[0], s[1], cap))?;
        Ok(vec![Some(Tensor::new(dx, saved.shape().clone())?)])
    };
    Ok(Tensor::from_op(y, "softcap", &[x], Box::new(backward_fn)))
}

/// x contiguous -> cap · tanh(x / cap).
pub fn forward(x: View, cap: f64) -> Result<Storage> {
    match on("softcap", x.0)? {
        On::Cpu => cpu::forward(x, cap),
        On::Cuda(be) => cuda::forward(&be, x, cap),
    }
}

/// dy and the forward's output y, contiguous -> dx = dy · (1 − (y / cap)²).
pub fn backward(dy: View, y: View, cap: f64) -> Result<Storage> {
    match on("softcap", y.0)? {
        On::Cpu => cpu::backward(dy, y, cap),
        On::Cuda(be) => cuda::backward(&be, dy, y, cap),
    }
}

mod cpu {
    //! The reference, element-wise in parallel, vectorised (`multiversion!`, `FastExp`).
    use super::*;
    use crate::dispatch::num;
    use ferrolm_tensor::cpu::simd::FastExp;
    use ferrolm_tensor::{float_dispatch, multiversion};
    use rayon::prelude::*;

    pub(super) fn forward(x: View, cap: f64) -> Result<Storage> {
        let (n, o) = (x.1.numel(), x.1.offset);
        Ok(float_dispatch!("softcap", x.0.dtype(), [x], softcap(&x[o..o + n], cap)))
    }

    pub(super) fn backward(dy: View, y: View, cap: f64) -> Result<Storage> {
        let n = y.1.numel();
        let (od, oy) = (dy.1.offset, y.1.offset);
        Ok(float_dispatch!("softcap_backward", y.0.dtype(), [dy, y], softcap_backward(&dy[od..od + n], &y[oy..oy + n], cap)))
    }

    /// Elements per parallel task.
    const GRAIN: usize = 1 << 12;

    multiversion! {
        /// cap · tanh(x / cap), with the library's tanh: accurate relative to y near 0, where
        /// 1 − 2 / (exp(2v) + 1) would cancel (an absolute error of cap · eps).
        fn forward_chunk[T: FastExp](y: &mut [T], x: &[T], cap: T) {
            for (y, &x) in y.iter_mut().zip(x) {
                *y = cap * (x / cap).tanh();
            }
        }
    }

    multiversion! {
        fn backward_chunk[T: FastExp](dx: &mut [T], dy: &[T], y: &[T], cap: T) {
            for ((dx, &dy), &y) in dx.iter_mut().zip(dy).zip(y) {
                let t = y / cap;
                *dx = dy * (T::one() - t * t);
            }
        }
    }

    fn softcap<T: FastExp + Send + Sync>(x: &[T], cap: f64) -> Vec<T> {
        let mut y = vec![T::zero(); x.len()];
        y.par_chunks_mut(GRAIN).zip(x.par_chunks(GRAIN)).for_each(|(y, x)| forward_chunk(y, x, num(cap)));
        y
    }

    fn softcap_backward<T: FastExp + Send + Sync>(dy: &[T], y: &[T], cap: f64) -> Vec<T> {
        let mut dx = vec![T::zero(); y.len()];
        dx.par_chunks_mut(GRAIN)
            .zip(dy.par_chunks(GRAIN).zip(y.par_chunks(GRAIN)))
            .for_each(|(dx, (dy, y))| backward_chunk(dx, dy, y, num(cap)));
        dx
    }
}

mod cuda {
    //! Launchers of kernels/softcap.cu.
    use super::*;
    use ferrolm_cuda::{kernels, CudaBackend, CudaStorage, DevPtr, Launch};
    use ferrolm_tensor::{DType, DeviceStorage};

    /// The launch over n elements of `dt`, in 16-byte vectors when every pointer allows it.
    fn plan(be: &CudaBackend, n: usize, dt: DType, ptrs: &[DevPtr]) -> (Launch, i32) {
        let vec = ptrs.iter().all(|p| p.addr().is_multiple_of(16));
        (be.plan_elementwise(n, dt.size_in_bytes(), vec), vec as i32)
    }

    pub(super) fn forward(be: &CudaBackend, x: View, cap: f64) -> Result<Storage> {
        let s = CudaStorage::of("softcap", x.0)?;
        let n = x.1.numel();
        let y = be.alloc_storage(n, s.dtype())?;
        let px = s.at(x.1.offset);
        let (cfg, vec) = plan(be, n, s.dtype(), &[px, y.ptr()]);
        // SAFETY: x holds n contiguous elements of its dtype from px, y n of it; `vec` only where
        // both pointers are 16-byte aligned.
        unsafe { kernels::softcap_fwd(be, s.dtype(), cfg, px, y.ptr(), n as i64, cap as f32, vec)? };
        Ok(y.into())
    }

    pub(super) fn backward(be: &CudaBackend, dy: View, y: View, cap: f64) -> Result<Storage> {
        let op = "softcap_backward";
        let s = CudaStorage::of(op, y.0)?;
        let n = y.1.numel();
        let dx = be.alloc_storage(n, s.dtype())?;
        let (pdy, py) = (dev_ptr(op, dy)?, s.at(y.1.offset));
        let (cfg, vec) = plan(be, n, s.dtype(), &[pdy, py, dx.ptr()]);
        // SAFETY: dy and y hold n contiguous elements of one dtype; dx n of it; `vec` only where
        // every pointer is 16-byte aligned.
        unsafe { kernels::softcap_bwd(be, s.dtype(), cfg, pdy, py, dx.ptr(), n as i64, cap as f32, vec)? };
        Ok(dx.into())
    }
}
