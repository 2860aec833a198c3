//! Rotary position embedding in Hugging Face's `rotate_half` convention, on x (b, h, t, d) with
//! precomputed cos/sin tables: y = x · cos + rotate_half(x) · sin, rotate_half(x) = cat(−x2, x1).
//! `rope` takes tables (t, d), row i for time i; `rope_at` takes each token's position (b, t)
//! into tables (n, d) (packed rows, whose positions restart in each segment). The rotation is
//! orthogonal, so the backward is the transposed rotation of the gradient (`inverse`); the
//! tables are constants and get no gradient. x is taken in place in either head layout
//! (`HeadLayout`: head-major, or time-major as split from a projection) and y, like the
//! gradient, comes out in x's; any other view is copied to head-major first.
//! CUDA: kernels/rope.cu (one thread per (row, pair); `rope_pos_*` read the positions).
use crate::dispatch::{dev_ptr, on, On};
use crate::heads::HeadLayout;
use crate::tokens::Tokens;
use ferrolm_tensor::backend::View;
use ferrolm_tensor::{bail, same_float, DType, Error, Result, Storage, Tensor};

/// RoPE on x (b, h, t, d) with an even head dim, from cos/sin tables of shape (t, d).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    check_x(x, cos, sin)?;
    let (t, d) = (x.dims()[2], x.dims()[3]);
    if cos.dims() != [t, d] || sin.dims() != [t, d] {
        bail!("rope", "cos/sin must be ({t}, {d}) for x {:?}, got {:?} and {:?}", x.shape(), cos.shape(), sin.shape());
    }
    rope_op(x, cos, sin, None)
}

/// RoPE on x (b, h, t, d) with an even head dim at per-token positions: token (b, i) is rotated
/// by row `positions[b, i]` of the cos/sin tables (n, d); positions are i32 (b, t) in [0, n).
pub fn rope_at(x: &Tensor, cos: &Tensor, sin: &Tensor, positions: &Tokens) -> Result<Tensor> {
    check_x(x, cos, sin)?;
    let (b, t, d) = (x.dims()[0], x.dims()[2], x.dims()[3]);
    if cos.rank() != 2 || cos.dims()[1] != d || sin.dims() != cos.dims() {
        bail!("rope", "cos/sin must be (positions, {d}) for x {:?}, got {:?} and {:?}", x.shape(), cos.shape(), sin.shape());
    }
    let pos = positions.tensor();
    if pos.dtype() != DType::I32 || pos.dims() != [b, t] || pos.device() != x.device() {
        bail!(
            "rope",
            "positions must be i32 ({b}, {t}) on {:?} for x {:?}, got {} {:?} on {:?}",
            x.device(),
            x.shape(),
            pos.dtype(),
            pos.shape(),
            pos.device()
        );
    }
    let n = cos.dims()[0];
    if let Some(bad) = positions.host_ids()?.iter().find(|&&p| p < 0 || p as usize >= n) {
        bail!("rope", "position {bad} is outside the tables' {n} positions");
    }
    rope_op(x, cos, sin, Some(&pos.contiguous()?))
}

fn check_x(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<()> {
    same_float("rope", &[x, cos, sin])?;
    if x.rank() != 4 || !x.dims()[3].is_multiple_of(2) {
        bail!("rope", "x must be (batch, heads, seq, head_dim) with an even head_dim, got {:?}", x.shape());
    }
    Ok(())
}

fn rope_op(x: &Tensor, cos: &Tensor, sin: &Tensor, pos: Option<&Tensor>) -> Result<Tensor> {
    let (cos, sin, pos) = (cos.contiguous()?, sin.contiguous()?, pos.cloned());
    let out = rotate(x, &cos, &sin, pos.as_ref(), false)?;
    Ok(Tensor::from_op(out, "rope", &[x], Box::new(move |g| Ok(vec![Some(rotate(g, &cos, &sin, pos.as_ref(), true)?)]))))
}

/// x rotated, in x's head layout (a copy to head-major first where x has neither).
fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor, pos: Option<&Tensor>, inverse: bool) -> Result<Tensor> {
    let layout = HeadLayout::common(&[x.layout()]).unwrap_or(HeadLayout::HeadMajor);
    let x = layout.arrange(x)?;
    let st = match pos {
        None => Tensor::with_storages(&[&x, cos, sin], |s| apply(s[0], s[1], s[2], None, inverse))?,
        Some(p) => Tensor::with_storages(&[&x, cos, sin, p], |s| apply(s[0], s[1], s[2], Some(s[3]), inverse))?,
    };
    let d = x.dims();
    layout.tensor(st, [d[0], d[1], d[2], d[3]])
}

/// x (b, h, t, d), dense in either head layout, and cos/sin, contiguous -> the rotated x,
/// written in x's layout; `inverse` applies the transposed rotation (the backward). Without
/// `pos` the tables are (t, d) and row i rotates time i; with `pos` (b, t) i32, contiguous,
/// token (b, i) takes table row pos[b, i] (the caller has checked it is in range).
pub fn apply(x: View, cos: View, sin: View, pos: Option<View>, inverse: bool) -> Result<Storage> {
    let Some(layout) = HeadLayout::common(&[x.1]) else {
        return Err(Error::new("rope", format!("x must be dense (b, h, t, d) or (b, t, h, d), got strides {:?}", x.1.strides)));
    };
    let inner = layout.inner(x.1.dims()[1]);
    match on("rope", x.0)? {
        On::Cpu => cpu::apply(x, cos, sin, pos, inner, inverse),
        On::Cuda(be) => cuda::apply(&be, x, cos, sin, pos, inner, inverse),
    }
}

mod cpu {
    //! The reference: one (batch, head) plane per task (head-major), or one position of every
    //! head (time-major).
    use super::*;
    use ferrolm_tensor::float_dispatch;
    use num_traits::Float;
    use rayon::prelude::*;

    pub(super) fn apply(x: View, cos: View, sin: View, pos: Option<View>, inner: usize, inverse: bool) -> Result<Storage> {
        let dims = x.1.dims();
        let (heads, t, d) = (dims[1], dims[2], dims[3]);
        let (ox, oc, os) = (x.1.offset, cos.1.offset, sin.1.offset);
        let (n, nt) = (x.1.numel(), cos.1.numel());
        let pos = match pos {
            Some((p, l)) => Some(&ferrolm_tensor::cpu::i32s("rope", p)?[l.offset..l.offset + l.numel()]),
            None => None,
        };
        let rows = nt / d.max(1);
        if let Some(bad) = pos.and_then(|p| p.iter().find(|&&p| p < 0 || p as usize >= rows)) {
            bail!("rope", "position {bad} is outside the tables' {rows} positions");
        }
        let shape = Shape { t, d, inner, heads };
        Ok(float_dispatch!(
            "rope",
            x.0.dtype(),
            [x, cos, sin],
            rope(&x[ox..ox + n], &cos[oc..oc + nt], &sin[os..os + nt], shape, pos, inverse)
        ))
    }

    /// x's rows: d wide, t positions, `inner` rows (heads) per position: (b, h, t, d) with inner
    /// 1, (b, t, h, d) with inner h.
    #[derive(Clone, Copy)]
    struct Shape {
        t: usize,
        d: usize,
        inner: usize,
        heads: usize,
    }

    /// x (`Shape`); cos, sin: (t, d), or (n, d) indexed by `pos` (b, t).
    fn rope<T: Float + Send + Sync>(x: &[T], cos: &[T], sin: &[T], sh: Shape, pos: Option<&[i32]>, inverse: bool) -> Vec<T> {
        let Shape { t, d, inner, heads } = sh;
        let h = d / 2;
        let mut y = vec![T::zero(); x.len()];
        if y.is_empty() {
            return y;
        }
        // A task: a (t, d) plane (head-major), or the `inner` rows of one position (time-major).
        let chunk = if inner == 1 { t * d } else { inner * d };
        y.par_chunks_mut(chunk).zip(x.par_chunks(chunk)).enumerate().for_each(|(c, (y, x))| {
            for r in 0..chunk / d {
                // The token (b, i) of this row, and its table row.
                let token = if inner == 1 { (c / heads) * t + r } else { c };
                let p = pos.map_or(token % t, |pos| pos[token] as usize);
                let (xr, yr) = (&x[r * d..(r + 1) * d], &mut y[r * d..(r + 1) * d]);
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
    use ferrolm_cuda::{kernels, CudaBackend, CudaStorage};
    use ferrolm_tensor::DeviceStorage;

    pub(super) fn apply(
        be: &CudaBackend,
        x: View,
        cos: View,
        sin: View,
        pos: Option<View>,
        inner: usize,
        inverse: bool,
    ) -> Result<Storage> {
        let s = CudaStorage::of("rope", x.0)?;
        let (heads, t, d) = (x.1.dims()[1], x.1.dims()[2], x.1.dims()[3]);
        let n = x.1.numel();
        let nrows = n.checked_div(d).unwrap_or(0);
        let out = be.alloc_storage(n, s.dtype())?;
        let (pc, ps) = (dev_ptr("rope", cos)?, dev_ptr("rope", sin)?);
        let px = s.at(x.1.offset);
        // 16-byte vectors of pairs where a half row is whole vectors and every pointer aligned.
        let per_vec = 16 / s.dtype().size_in_bytes();
        let vec = (d / 2).is_multiple_of(per_vec) && [px, pc, ps, out.ptr()].iter().all(|p| p.addr().is_multiple_of(16));
        let cfg = be.plan_elementwise(n / 2, s.dtype().size_in_bytes(), vec);
        // SAFETY: x holds nrows dense rows of d elements, `inner` per position, and cos/sin (t, d),
        // or (n, d) with pos (b, t) i32 in [0, n) (the caller's check), of one dtype, contiguous;
        // `out` holds n elements of it; `vec` as the kernel needs it.
        unsafe {
            let (rows, t, d, inner, vec) = (nrows as i64, t as i64, d as i64, inner as i64, vec as i32);
            match pos {
                None => kernels::rope(be, s.dtype(), cfg, px, pc, ps, out.ptr(), rows, t, d, inner, inverse as i32, vec)?,
                Some(p) => {
                    let pp = dev_ptr("rope", p)?;
                    kernels::rope_pos(be, s.dtype(), cfg, px, pc, ps, pp, out.ptr(), rows, t, d, inner, heads as i64, inverse as i32, vec)?
                }
            }
        };
        Ok(out.into())
    }
}
