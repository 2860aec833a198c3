//! The gated MLP activations, y = act(gate) · up, element-wise (`Glu`): SwiGLU (LLaMA, Qwen,
//! Mistral: act = silu) and GeGLU with the tanh GELU (Gemma 3's `gelu_pytorch_tanh`:
//! act(g) = 0.5 g (1 + tanh(√(2/π) (g + 0.044715 g³))), PyTorch's `gelu(approximate="tanh")`).
//! Backward: dgate = dy · up · act'(gate), dup = dy · act(gate); for silu, with s = sigmoid(g),
//! act' = s · (1 + g · (1 − s)); for gelu_tanh, with t the tanh above and k = √(2/π),
//! act' = 0.5 (1 + t) + 0.5 g (1 − t²) k (1 + 3 · 0.044715 g²). Nothing is saved but the inputs.
//! CUDA: kernels/swiglu.cu (one template, the activation its argument: `swiglu_*`, `geglu_*`).
use crate::dispatch::{dev_ptr, on, On};
use ferrolm_tensor::backend::View;
use ferrolm_tensor::{bail, same_float, Result, Storage, Tensor};

/// The activation of a gated MLP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Glu {
    /// silu(g) = g · sigmoid(g) (SwiGLU).
    Silu,
    /// The tanh approximation of GELU (GeGLU as Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

impl Glu {
    /// The op's name in errors and profiles.
    pub fn name(self) -> &'static str {
        match self {
            Glu::Silu => "swiglu",
            Glu::GeluTanh => "geglu",
        }
    }
}

/// silu(gate) * up, element-wise (same shapes).
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    glu(gate, up, Glu::Silu)
}

/// gelu_tanh(gate) * up, element-wise (same shapes): Gemma 3's MLP.
pub fn geglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    glu(gate, up, Glu::GeluTanh)
}

/// act(gate) * up, element-wise (same shapes).
pub fn glu(gate: &Tensor, up: &Tensor, act: Glu) -> Result<Tensor> {
    let name = act.name();
    same_float(name, &[gate, up])?;
    if gate.shape() != up.shape() {
        bail!(name, "gate {:?} and up {:?} differ in shape", gate.shape(), up.shape());
    }
    let (g, u) = (gate.contiguous()?, up.contiguous()?);
    let out = Tensor::new(Tensor::with_storages(&[&g, &u], |s| forward(s[0], s[1], act))?, g.shape().clone())?;
    let backward_fn = move |dy: &Tensor| {
        let dy = dy.contiguous()?;
        let (dg, du) = Tensor::with_storages(&[&dy, &g, &u], |s| backward(s[0], s[1], s[2], act))?;
        Ok(vec![Some(Tensor::new(dg, g.shape().clone())?), Some(Tensor::new(du, g.shape().clone())?)])
    };
    Ok(Tensor::from_op(out, name, &[gate, up], Box::new(backward_fn)))
}

/// gate, up contiguous (same length) -> act(gate) * up.
pub fn forward(gate: View, up: View, act: Glu) -> Result<Storage> {
    match on(act.name(), gate.0)? {
        On::Cpu => cpu::forward(gate, up, act),
        On::Cuda(be) => cuda::forward(&be, gate, up, act),
    }
}

/// -> (dgate, dup)
pub fn backward(dy: View, gate: View, up: View, act: Glu) -> Result<(Storage, Storage)> {
    match on(act.name(), gate.0)? {
        On::Cpu => cpu::backward(dy, gate, up, act),
        On::Cuda(be) => cuda::backward(&be, dy, gate, up, act),
    }
}

mod cpu {
    //! The reference, element-wise in parallel, vectorised (`multiversion!`, `FastExp`).
    use super::*;
    use crate::dispatch::num;
    use ferrolm_tensor::cpu::simd::FastExp;
    use ferrolm_tensor::{float_dispatch, multiversion};
    use rayon::prelude::*;

    pub(super) fn forward(g: View, u: View, act: Glu) -> Result<Storage> {
        let n = g.1.numel();
        let (og, ou) = (g.1.offset, u.1.offset);
        Ok(float_dispatch!(act.name(), g.0.dtype(), [g, u], glu(&g[og..og + n], &u[ou..ou + n], act)))
    }

    pub(super) fn backward(dy: View, g: View, u: View, act: Glu) -> Result<(Storage, Storage)> {
        let n = g.1.numel();
        let (od, og, ou) = (dy.1.offset, g.1.offset, u.1.offset);
        let op = match act {
            Glu::Silu => "swiglu_backward",
            Glu::GeluTanh => "geglu_backward",
        };
        Ok(float_dispatch!(op, g.0.dtype(), [dy, g, u], glu_backward(&dy[od..od + n], &g[og..og + n], &u[ou..ou + n], act)))
    }

    /// Elements per parallel task: a few pages, so every core gets work and the vector loop
    /// inside runs long.
    const GRAIN: usize = 1 << 12;

    #[inline(always)]
    fn sigmoid<T: FastExp>(v: T) -> T {
        T::one() / (T::one() + (-v).fast_exp())
    }

    /// gelu_tanh(g) and its derivative (the tanh approximation of GELU).
    #[inline(always)]
    fn gelu_tanh<T: FastExp>(g: T) -> (T, T) {
        let (k, c, half) = (num::<T>(0.797_884_560_802_865_4), num::<T>(0.044715), num::<T>(0.5));
        let t = (k * (g + c * g * g * g)).tanh(); // the library's tanh, accurate near 0
        let d = half * (T::one() + t) + half * g * (T::one() - t * t) * k * (T::one() + num::<T>(3.0) * c * g * g);
        (half * g * (T::one() + t), d)
    }

    multiversion! {
        fn forward_chunk[T: FastExp](y: &mut [T], g: &[T], u: &[T], act: Glu) {
            match act {
                Glu::Silu => {
                    for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
                        *y = g * sigmoid(g) * u;
                    }
                }
                Glu::GeluTanh => {
                    for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
                        *y = gelu_tanh(g).0 * u;
                    }
                }
            }
        }
    }

    multiversion! {
        fn backward_chunk[T: FastExp](dg: &mut [T], du: &mut [T], dy: &[T], g: &[T], u: &[T], act: Glu) {
            let it = dg.iter_mut().zip(du.iter_mut()).zip(dy).zip(g).zip(u);
            match act {
                Glu::Silu => {
                    for ((((dg, du), &dy), &g), &u) in it {
                        let s = sigmoid(g);
                        *dg = dy * u * s * (T::one() + g * (T::one() - s));
                        *du = dy * g * s;
                    }
                }
                Glu::GeluTanh => {
                    for ((((dg, du), &dy), &g), &u) in it {
                        let (a, d) = gelu_tanh(g);
                        *dg = dy * u * d;
                        *du = dy * a;
                    }
                }
            }
        }
    }

    fn glu<T: FastExp + Send + Sync>(g: &[T], u: &[T], act: Glu) -> Vec<T> {
        let mut y = vec![T::zero(); g.len()];
        y.par_chunks_mut(GRAIN).zip(g.par_chunks(GRAIN).zip(u.par_chunks(GRAIN))).for_each(|(y, (g, u))| forward_chunk(y, g, u, act));
        y
    }

    fn glu_backward<T: FastExp + Send + Sync>(dy: &[T], g: &[T], u: &[T], act: Glu) -> (Vec<T>, Vec<T>) {
        let (mut dg, mut du) = (vec![T::zero(); g.len()], vec![T::zero(); g.len()]);
        let outs = dg.par_chunks_mut(GRAIN).zip(du.par_chunks_mut(GRAIN));
        outs.zip(dy.par_chunks(GRAIN).zip(g.par_chunks(GRAIN).zip(u.par_chunks(GRAIN))))
            .for_each(|((dg, du), (dy, (g, u)))| backward_chunk(dg, du, dy, g, u, act));
        (dg, du)
    }
}

mod cuda {
    //! Launchers of kernels/swiglu.cu (`swiglu_*` for silu, `geglu_*` for gelu_tanh).
    use super::*;
    use ferrolm_cuda::{kernels, CudaBackend, CudaStorage, DevPtr, Launch};
    use ferrolm_tensor::{DType, DeviceStorage};

    /// The launch over n elements of `dt`, in 16-byte vectors when every pointer allows it
    /// (the `vec` argument the kernels take).
    fn plan(be: &CudaBackend, n: usize, dt: DType, ptrs: &[DevPtr]) -> (Launch, i32) {
        let vec = ptrs.iter().all(|p| p.addr().is_multiple_of(16));
        (be.plan_elementwise(n, dt.size_in_bytes(), vec), vec as i32)
    }

    pub(super) fn forward(be: &CudaBackend, gate: View, up: View, act: Glu) -> Result<Storage> {
        let op = act.name();
        let s = CudaStorage::of(op, gate.0)?;
        let n = gate.1.numel();
        let out = be.alloc_storage(n, s.dtype())?;
        let (pg, pu) = (s.at(gate.1.offset), dev_ptr(op, up)?);
        let (cfg, vec) = plan(be, n, s.dtype(), &[pg, pu, out.ptr()]);
        // SAFETY: gate and up hold n contiguous elements of one dtype; `out` holds n of it; `vec`
        // only where every pointer is 16-byte aligned.
        unsafe {
            match act {
                Glu::Silu => kernels::swiglu_fwd(be, s.dtype(), cfg, pg, pu, out.ptr(), n as i64, vec)?,
                Glu::GeluTanh => kernels::geglu_fwd(be, s.dtype(), cfg, pg, pu, out.ptr(), n as i64, vec)?,
            }
        };
        Ok(out.into())
    }

    pub(super) fn backward(be: &CudaBackend, dy: View, gate: View, up: View, act: Glu) -> Result<(Storage, Storage)> {
        let op = match act {
            Glu::Silu => "swiglu_backward",
            Glu::GeluTanh => "geglu_backward",
        };
        let s = CudaStorage::of(op, gate.0)?;
        let n = gate.1.numel();
        let (dg, du) = (be.alloc_storage(n, s.dtype())?, be.alloc_storage(n, s.dtype())?);
        let (pdy, pg, pu) = (dev_ptr(op, dy)?, s.at(gate.1.offset), dev_ptr(op, up)?);
        let (cfg, vec) = plan(be, n, s.dtype(), &[pdy, pg, pu, dg.ptr(), du.ptr()]);
        // SAFETY: dy, gate and up hold n contiguous elements of one dtype; dg and du n of it;
        // `vec` only where every pointer is 16-byte aligned.
        unsafe {
            let (t, n) = (s.dtype(), n as i64);
            match act {
                Glu::Silu => kernels::swiglu_bwd(be, t, cfg, pdy, pg, pu, dg.ptr(), du.ptr(), n, vec)?,
                Glu::GeluTanh => kernels::geglu_bwd(be, t, cfg, pdy, pg, pu, dg.ptr(), du.ptr(), n, vec)?,
            }
        };
        Ok((dg.into(), du.into()))
    }
}
