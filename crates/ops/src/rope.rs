//! Rotary position embedding in Hugging Face's `rotate_half` convention, on x (b, h, t, d) with
//! precomputed cos/sin tables (t, d): y = x · cos + rotate_half(x) · sin, rotate_half(x) =
//! cat(−x2, x1). The rotation is orthogonal, so the backward is the transposed rotation of the
//! gradient (`inverse`); the tables are constants and get no gradient.
//! CUDA: kernels/rope.cu (one thread per (row, pair)).
use crate::dispatch::{dev_ptr, on, On};
use ferrolm_tensor::backend::View;
use ferrolm_tensor::{bail, same_float, Result, Storage, Tensor};

/// RoPE on x (b, h, t, d) with an even head dim, from cos/sin tables of shape (t, d).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    same_float("rope", &[x, cos, sin])?;
    if x.rank() != 4 || !x.dims()[3].is_multiple_of(2) {
        bail!("rope", "x must be (batch, heads, seq, head_dim) with an even head_dim, got {:?}", x.shape());
    }
    let (t, d) = (x.dims()[2], x.dims()[3]);
    if cos.dims() != [t, d] || sin.dims() != [t, d] {
        bail!("rope", "cos/sin must be ({t}, {d}) for x {:?}, got {:?} and {:?}", x.shape(), cos.shape(), sin.shape());
    }
    let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
    let out = rotate(&x.contiguous()?, &cos, &sin, false)?;
    Ok(Tensor::from_op(out, "rope", &[x], Box::new(move |g| Ok(vec![Some(rotate(&g.contiguous()?, &cos, &sin, true)?)]))))
}

fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor, inverse: bool) -> Result<Tensor> {
    let st = Tensor::with_storages(&[x, cos, sin], |s| apply(s[0], s[1], s[2], inverse))?;
    Tensor::new(st, x.shape().clone())
}

/// x (b, h, t, d) and cos/sin (t, d), contiguous -> the rotated x; `inverse` applies the
/// transposed rotation (the backward).
pub fn apply(x: View, cos: View, sin: View, inverse: bool) -> Result<Storage> {
    match on("rope", x.0)? {
        On::Cpu => cpu::apply(x, cos, sin, inverse),
        On::Cuda(be) => cuda::apply(&be, x, cos, sin, inverse),
    }
}

mod cpu {
    //! The reference: one (batch, head) plane per task.
    use super::*;
    use ferrolm_tensor::float_dispatch;
    use num_traits::Float;
    use rayon::prelude::*;

    pub(super) fn apply(x: View, cos: View, sin: View, inverse: bool) -> Result<Storage> {
        let dims = x.1.dims();
        let (t, d) = (dims[2], dims[3]);
        let (ox, oc, os) = (x.1.offset, cos.1.offset, sin.1.offset);
        let n = x.1.numel();
        Ok(float_dispatch!(
            "rope",
            x.0.dtype(),
            [x, cos, sin],
            rope(&x[ox..ox + n], &cos[oc..oc + t * d], &sin[os..os + t * d], t, d, inverse)
        ))
    }

    /// x: (b, h, t, d); cos, sin: (t, d).
    fn rope<T: Float + Send + Sync>(x: &[T], cos: &[T], sin: &[T], t: usize, d: usize, inverse: bool) -> Vec<T> {
        let h = d / 2;
        let mut y = vec![T::zero(); x.len()];
        y.par_chunks_mut(t * d).zip(x.par_chunks(t * d)).for_each(|(y, x)| {
            for p in 0..t {
                let (xr, yr) = (&x[p * d..(p + 1) * d], &mut y[p * d..(p + 1) * d]);
                let (cr, sr) = (&cos[p * d..(p + 1) * d], &sin[p * d..(p + 1) * d]);
                for j in 0..h {
                    if inverse {
                        yr[j] = xr[j] * cr[j] + xr[j + h] * sr[j + h];
                        yr[j + h] = xr[j + h] * cr[j + h] - xr[j] * sr[j];
                    } else {
                        yr[j] = xr[j] * cr[j] - xr[j + h] * sr[j];
                        yr[j + h] = xr[j + h] * cr[j + h] + xr[j] * sr[j + h];
                    }
                }
            }
        });
        y
    }
}

mod cuda {
    //! Launcher of kernels/rope.cu.
    use super::*;
    use ferrolm_cuda::{kernels, CudaBackend, CudaStorage, Launch};
    use ferrolm_tensor::DeviceStorage;

    pub(super) fn apply(be: &CudaBackend, x: View, cos: View, sin: View, inverse: bool) -> Result<Storage> {
        let s = CudaStorage::of("rope", x.0)?;
        let (t, d) = (x.1.dims()[2], x.1.dims()[3]);
        let n = x.1.numel();
        let nrows = n.checked_div(d).unwrap_or(0);
        let out = be.alloc_storage(n, s.dtype())?;
        let (pc, ps) = (dev_ptr("rope", cos)?, dev_ptr("rope", sin)?);
        let cfg = Launch::cover(nrows * d / 2, Launch::BLOCK);
        // SAFETY: x holds nrows rows of d elements and cos/sin (t, d), of one dtype, contiguous;
        // `out` holds n elements of it.
        unsafe {
            kernels::rope(be, s.dtype(), cfg, s.at(x.1.offset), pc, ps, out.ptr(), nrows as i64, t as i64, d as i64, inverse as i32)?
        };
        Ok(out.into())
    }
}
