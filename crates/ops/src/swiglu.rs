//! The SwiGLU gate of LLaMA's MLP: y = silu(gate) · up, element-wise. Backward, with
//! s = sigmoid(gate): dgate = dy · up · s · (1 + gate · (1 − s)), dup = dy · silu(gate).
//! CUDA: kernels/swiglu.cu.
use crate::dispatch::{dev_ptr, on, On};
use ferrolm_tensor::backend::View;
use ferrolm_tensor::{bail, same_float, Result, Storage, Tensor};

/// silu(gate) * up, element-wise (same shapes).
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    same_float("swiglu", &[gate, up])?;
    if gate.shape() != up.shape() {
        bail!("swiglu", "gate {:?} and up {:?} differ in shape", gate.shape(), up.shape());
    }
    let (g, u) = (gate.contiguous()?, up.contiguous()?);
    let out = Tensor::new(Tensor::with_storages(&[&g, &u], |s| forward(s[0], s[1]))?, g.shape().clone())?;
    let backward_fn = move |dy: &Tensor| {
        let dy = dy.contiguous()?;
        let (dg, du) = Tensor::with_storages(&[&dy, &g, &u], |s| backward(s[0], s[1], s[2]))?;
        Ok(vec![Some(Tensor::new(dg, g.shape().clone())?), Some(Tensor::new(du, g.shape().clone())?)])
    };
    Ok(Tensor::from_op(out, "swiglu", &[gate, up], Box::new(backward_fn)))
}

/// gate, up contiguous (same length) -> silu(gate) * up.
pub fn forward(gate: View, up: View) -> Result<Storage> {
    match on("swiglu", gate.0)? {
        On::Cpu => cpu::forward(gate, up),
        On::Cuda(be) => cuda::forward(&be, gate, up),
    }
}

/// -> (dgate, dup)
pub fn backward(dy: View, gate: View, up: View) -> Result<(Storage, Storage)> {
    match on("swiglu", gate.0)? {
        On::Cpu => cpu::backward(dy, gate, up),
        On::Cuda(be) => cuda::backward(&be, dy, gate, up),
    }
}

mod cpu {
    //! The reference, element-wise in parallel, vectorised (`multiversion!`, `FastExp`).
    use super::*;
    use ferrolm_tensor::cpu::simd::FastExp;
    use ferrolm_tensor::{float_dispatch, multiversion};
    use rayon::prelude::*;

    pub(super) fn forward(g: View, u: View) -> Result<Storage> {
        let n = g.1.numel();
        let (og, ou) = (g.1.offset, u.1.offset);
        Ok(float_dispatch!("swiglu", g.0.dtype(), [g, u], swiglu(&g[og..og + n], &u[ou..ou + n])))
    }

    pub(super) fn backward(dy: View, g: View, u: View) -> Result<(Storage, Storage)> {
        let n = g.1.numel();
        let (od, og, ou) = (dy.1.offset, g.1.offset, u.1.offset);
        Ok(float_dispatch!("swiglu_backward", g.0.dtype(), [dy, g, u], swiglu_backward(&dy[od..od + n], &g[og..og + n], &u[ou..ou + n])))
    }

    /// Elements per parallel task: a few pages, so every core gets work and the vector loop
    /// inside runs long.
    const GRAIN: usize = 1 << 12;

    #[inline(always)]
    fn sigmoid<T: FastExp>(v: T) -> T {
        T::one() / (T::one() + (-v).fast_exp())
    }

    multiversion! {
        fn forward_chunk[T: FastExp](y: &mut [T], g: &[T], u: &[T]) {
            for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
                *y = g * sigmoid(g) * u;
            }
        }
    }

    multiversion! {
        fn backward_chunk[T: FastExp](dg: &mut [T], du: &mut [T], dy: &[T], g: &[T], u: &[T]) {
            for ((((dg, du), &dy), &g), &u) in dg.iter_mut().zip(du.iter_mut()).zip(dy).zip(g).zip(u) {
                let s = sigmoid(g);
                *dg = dy * u * s * (T::one() + g * (T::one() - s));
                *du = dy * g * s;
            }
        }
    }

    fn swiglu<T: FastExp + Send + Sync>(g: &[T], u: &[T]) -> Vec<T> {
        let mut y = vec![T::zero(); g.len()];
        y.par_chunks_mut(GRAIN).zip(g.par_chunks(GRAIN).zip(u.par_chunks(GRAIN))).for_each(|(y, (g, u))| forward_chunk(y, g, u));
        y
    }

    fn swiglu_backward<T: FastExp + Send + Sync>(dy: &[T], g: &[T], u: &[T]) -> (Vec<T>, Vec<T>) {
        let (mut dg, mut du) = (vec![T::zero(); g.len()], vec![T::zero(); g.len()]);
        let outs = dg.par_chunks_mut(GRAIN).zip(du.par_chunks_mut(GRAIN));
        outs.zip(dy.par_chunks(GRAIN).zip(g.par_chunks(GRAIN).zip(u.par_chunks(GRAIN))))
            .for_each(|((dg, du), (dy, (g, u)))| backward_chunk(dg, du, dy, g, u));
        (dg, du)
    }
}

mod cuda {
    //! Launchers of kernels/swiglu.cu.
    use super::*;
    use ferrolm_cuda::{kernels, CudaBackend, CudaStorage, DevPtr, Launch};
    use ferrolm_tensor::{DType, DeviceStorage};

    /// The launch over n elements of `dt`, in 16-byte vectors when every pointer allows it
    /// (the `vec` argument the kernels take).
    fn plan(be: &CudaBackend, n: usize, dt: DType, ptrs: &[DevPtr]) -> (Launch, i32) {
        let vec = ptrs.iter().all(|p| p.addr().is_multiple_of(16));
        (be.plan_elementwise(n, dt.size_in_bytes(), vec), vec as i32)
    }

    pub(super) fn forward(be: &CudaBackend, gate: View, up: View) -> Result<Storage> {
        let s = CudaStorage::of("swiglu", gate.0)?;
        let n = gate.1.numel();
        let out = be.alloc_storage(n, s.dtype())?;
        let (pg, pu) = (s.at(gate.1.offset), dev_ptr("swiglu", up)?);
        let (cfg, vec) = plan(be, n, s.dtype(), &[pg, pu, out.ptr()]);
        // SAFETY: gate and up hold n contiguous elements of one dtype; `out` holds n of it; `vec`
        // only where every pointer is 16-byte aligned.
        unsafe { kernels::swiglu_fwd(be, s.dtype(), cfg, pg, pu, out.ptr(), n as i64, vec)? };
        Ok(out.into())
    }

    pub(super) fn backward(be: &CudaBackend, dy: View, gate: View, up: View) -> Result<(Storage, Storage)> {
        let op = "swiglu_backward";
        let s = CudaStorage::of(op, gate.0)?;
        let n = gate.1.numel();
        let (dg, du) = (be.alloc_storage(n, s.dtype())?, be.alloc_storage(n, s.dtype())?);
        let (pdy, pg, pu) = (dev_ptr(op, dy)?, s.at(gate.1.offset), dev_ptr(op, up)?);
        let (cfg, vec) = plan(be, n, s.dtype(), &[pdy, pg, pu, dg.ptr(), du.ptr()]);
        // SAFETY: dy, gate and up hold n contiguous elements of one dtype; dg and du n of it;
        // `vec` only where every pointer is 16-byte aligned.
        unsafe { kernels::swiglu_bwd(be, s.dtype(), cfg, pdy, pg, pu, dg.ptr(), du.ptr(), n as i64, vec)? };
        Ok((dg.into(), du.into()))
    }
}
