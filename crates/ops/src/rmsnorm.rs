//! RMSNorm over the last dimension (LLaMA's norm): y = x · r · w with r = 1 / sqrt(mean(x²) + eps)
//! per row; `rms_norm_offset` scales by (offset + w) instead (Gemma's `Gemma3RMSNorm`: offset 1,
//! x · r · (1 + w) in f32 and one rounding at the end, as transformers computes it). The forward
//! saves r (f32 even for bf16 activations) for the backward: with g = dy · (offset + w),
//! dx = r · (g − x · r² · mean(g · x)) and dw = Σ_rows dy · x · r (the same for any offset), a
//! sum over rows taken in a fixed order on every device, so results are deterministic.
//! Rows are the last dim whatever the leading dims: QK-norm (Qwen3, Gemma 3) is this op on
//! (B, T, H, D) with a weight of D, its dw a sum over B·T·H rows.
//! CUDA: kernels/rmsnorm.cu (a warp per row; dw in two passes through per-chunk partials, the
//! second folding them in levels where rows are many and narrow). There
//! the backward takes what autograd offers (`GradCtx::addend`, `GradCtx::param_dest`): the
//! gradient x has so far (the residual stream's) is added into dx by the dx kernel, and dw is
//! written by the last pass straight into w's gradient destination (its slice of an f32 bucket):
//! no add and no cast of their own. Elsewhere (the CPU) the helpers compose the add and the copy.
//! A weight that takes no gradient (frozen: LoRA's and QLoRA's base, a reference model) gets
//! none: its backward is the dx kernel alone (`backward_dx`, `Fused::no_dw`), with no pass over
//! dy and x for dw.
use crate::dispatch::{dev_ptr, f32_ptr, num, on, rows, with_views, On};
use ferrolm_tensor::autograd::GradCtx;
use ferrolm_tensor::backend::View;
use ferrolm_tensor::{bail, same_float, DType, Result, Storage, Tensor};

/// RMSNorm of `x` over its last dim with weight `w` (d). Saves the inverse RMS per row.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    rms_norm_offset(x, w, eps, 0.0)
}

/// RMSNorm scaled by (offset + w): x · r · (offset + w), computed in f32 (f64 for f64) and
/// rounded once. Offset 1 is Gemma's norm (weights stored as w, used as 1 + w); 0 is `rms_norm`.
pub fn rms_norm_offset(x: &Tensor, w: &Tensor, eps: f64, offset: f64) -> Result<Tensor> {
    same_float("rms_norm", &[x, w])?;
    if !offset.is_finite() {
        bail!("rms_norm", "the weight offset must be finite, got {offset}");
    }
    let d = *x.dims().last().unwrap_or(&0);
    if w.dims() != [d] {
        bail!("rms_norm", "weight shape {:?} does not match the last dim of {:?}", w.shape(), x.shape());
    }
    let (xc, wc) = (x.contiguous()?, w.contiguous()?);
    let (y, r) = Tensor::with_storages(&[&xc, &wc], |s| forward(s[0], s[1], eps, offset))?;
    let out = Tensor::new(y, x.shape().clone())?;
    let r = Tensor::new(r, [xc.numel() / d.max(1)])?;
    let xshape = x.shape().clone();
    // A frozen weight (LoRA's base, a reference model) takes no gradient: its backward skips
    // dw's passes over dy and x.
    let need_w = w.requires_grad();
    let backward_fn = move |g: &Tensor, ctx: &mut GradCtx| {
        let g = g.contiguous()?;
        // dx += the residual stream's gradient so far (added by the dx kernel where it takes it
        // as it is); dw = into w's gradient destination (the last dw pass writes it, f32 or w's).
        let acc = ctx.addend(0, |a| a.is_contiguous() && a.dtype() == xc.dtype() && a.shape() == &xshape)?;
        let dw_fits = |t: &Tensor| t.is_contiguous() && t.dims() == [d] && (t.dtype() == wc.dtype() || t.dtype() == DType::F32);
        let dw_to = need_w.then(|| ctx.param_dest(1, dw_fits)).transpose()?;
        let into = dw_to.as_ref().and_then(|t| t.fused());
        let fused = with_views(&[&g, &xc, &wc, &r], [acc.fused(), into], |s, [a, w]| {
            backward_into(s[0], s[1], s[2], s[3], offset, Fused { acc: a, dw_into: w, no_dw: !need_w })
        })?;
        let (dx, dw, took) = match fused {
            Some((dx, dw)) => (dx, dw, true),
            None if need_w => {
                let (dx, dw) = Tensor::with_storages(&[&g, &xc, &wc, &r], |s| backward(s[0], s[1], s[2], s[3], offset))?;
                (dx, Some(dw), false)
            }
            None => (Tensor::with_storages(&[&g, &xc, &wc, &r], |s| backward_dx(s[0], s[1], s[2], s[3], offset))?, None, false),
        };
        let dx = acc.finish(Tensor::new(dx, xshape.clone())?, took)?;
        let dw = match dw_to {
            Some(to) => Some(to.land(dw.map(|s| Tensor::new(s, [d])).transpose()?)?),
            None => None,
        };
        Ok(vec![Some(dx), dw])
    };
    Ok(Tensor::from_op_ctx(out, "rms_norm", &[x, w], Box::new(backward_fn)))
}

/// x (rows, d) and w (d), contiguous -> (y (rows, d), inverse RMS (rows) in f32, f64 for f64);
/// y scaled by (offset + w).
pub fn forward(x: View, w: View, eps: f64, offset: f64) -> Result<(Storage, Storage)> {
    match on("rms_norm", x.0)? {
        On::Cpu => cpu::forward(x, w, eps, offset),
        On::Cuda(be) => cuda::forward(&be, x, w, eps, offset),
    }
}

/// -> (dx (rows, d), dw (d)), from the inverse RMS the forward saved (the forward's offset).
pub fn backward(dy: View, x: View, w: View, inv_rms: View, offset: f64) -> Result<(Storage, Storage)> {
    match on("rms_norm", x.0)? {
        On::Cpu => cpu::backward(dy, x, w, inv_rms, offset),
        On::Cuda(be) => {
            cuda::backward(&be, dy, x, w, inv_rms, offset, Fused::default()).map(|(dx, dw)| (dx, dw.expect("no destination given")))
        }
    }
}

/// -> dx (rows, d) alone, for a weight that takes no gradient (frozen): no pass over the rows
/// for dw.
pub fn backward_dx(dy: View, x: View, w: View, inv_rms: View, offset: f64) -> Result<Storage> {
    match on("rms_norm", x.0)? {
        On::Cpu => cpu::backward_dx(dy, x, w, inv_rms, offset),
        On::Cuda(be) => cuda::backward(&be, dy, x, w, inv_rms, offset, Fused { no_dw: true, ..Fused::default() }).map(|(dx, _)| dx),
    }
}

/// What the backward adds into dx and where it writes dw (`backward_into`).
#[derive(Clone, Copy, Default)]
pub struct Fused<'a> {
    /// (rows, d) of x's dtype, contiguous: added into dx.
    pub acc: Option<View<'a>>,
    /// A contiguous (d) view of w's dtype or f32 that receives dw (the returned dw is then `None`).
    pub dw_into: Option<View<'a>>,
    /// No dw at all (a frozen weight): only the dx kernel runs, and the returned dw is `None`.
    pub no_dw: bool,
}

/// As `backward`, with what `fused` asks. `Ok(None)`: the backend does not fuse these (the
/// CPU: the caller composes `backward`, an add and an assign).
pub fn backward_into(dy: View, x: View, w: View, inv_rms: View, offset: f64, fused: Fused) -> Result<Option<(Storage, Option<Storage>)>> {
    match on("rms_norm", x.0)? {
        On::Cpu => Ok(None),
        On::Cuda(be) => cuda::backward(&be, dy, x, w, inv_rms, offset, fused).map(Some),
    }
}

mod cpu {
    //! The reference: rows in parallel (sums of a row in 16 lanes, vectorised); dw summed over
    //! rows in row order.
    use super::*;
    use ferrolm_tensor::cpu::simd;
    use ferrolm_tensor::cpu::Stat;
    use ferrolm_tensor::{float_dispatch, multiversion};
    use num_traits::Float;
    use rayon::prelude::*;

    pub(super) fn forward(x: View, w: View, eps: f64, offset: f64) -> Result<(Storage, Storage)> {
        let (ox, n, d) = rows(x.1);
        let ow = w.1.offset;
        let dt = x.0.dtype();
        Ok(float_dispatch!("rmsnorm", dt, [x, w], rmsnorm(&x[ox..ox + n * d], &offset_weight(&w[ow..ow + d], offset), eps)))
    }

    /// offset + w in the working precision (w itself for offset 0): the factor y and dx use.
    fn offset_weight<T: Float>(w: &[T], offset: f64) -> Vec<T> {
        w.iter().map(|&v| if offset == 0.0 { v } else { num::<T>(offset) + v }).collect()
    }

    pub(super) fn backward(dy: View, x: View, w: View, r: View, offset: f64) -> Result<(Storage, Storage)> {
        let dx = backward_dx(dy, x, w, r, offset)?;
        let (ox, n, d) = rows(x.1);
        let (od, or) = (dy.1.offset, r.1.offset);
        let dw = float_dispatch!("rmsnorm_backward", x.0.dtype(), [dy, x, r], {
            let mut dw = vec![num(0.0); d];
            weight_grad(&mut dw, &x[ox..ox + n * d], &dy[od..od + n * d], &r[or..or + n]);
            dw
        });
        Ok((dx, dw))
    }

    pub(super) fn backward_dx(dy: View, x: View, w: View, r: View, offset: f64) -> Result<Storage> {
        let (ox, n, d) = rows(x.1);
        let (od, ow, or) = (dy.1.offset, w.1.offset, r.1.offset);
        Ok(float_dispatch!(
            "rmsnorm_backward",
            x.0.dtype(),
            [dy, x, w, r],
            rmsnorm_backward_dx(&dy[od..od + n * d], &x[ox..ox + n * d], &offset_weight(&w[ow..ow + d], offset), &r[or..or + n])
        ))
    }

    multiversion! {
        /// y = x * r * w for one row; returns r = 1 / rms(x).
        fn forward_row[T: Float](y: &mut [T], x: &[T], w: &[T], eps: f64) -> T {
            let ms = simd::sum_map(x, |v| v * v) / num(w.len() as f64);
            let r = (ms + num(eps)).sqrt().recip();
            for ((o, &v), &g) in y.iter_mut().zip(x).zip(w) {
                *o = v * r * g;
            }
            r
        }
    }

    multiversion! {
        /// dx = r * (g - x * r^2 * mean(g * x)) with g = dy * w, for one row.
        fn backward_row[T: Float](dx: &mut [T], x: &[T], dy: &[T], w: &[T], r: T) {
            for (((o, &xv), &g), &wv) in dx.iter_mut().zip(x).zip(dy).zip(w) {
                *o = g * wv * xv;
            }
            let gx = simd::sum_map(dx, |v| v) / num(w.len() as f64);
            for (((o, &xv), &g), &wv) in dx.iter_mut().zip(x).zip(dy).zip(w) {
                *o = r * (g * wv - xv * r * r * gx);
            }
        }
    }

    multiversion! {
        /// dw += dy * x * r over the rows, in row order.
        fn weight_grad[T: Float](dw: &mut [T], x: &[T], dy: &[T], r: &[T]) {
            let d = dw.len();
            for ((x, dy), &r) in x.chunks(d).zip(dy.chunks(d)).zip(r) {
                for ((a, &xv), &g) in dw.iter_mut().zip(x).zip(dy) {
                    *a = *a + g * xv * r;
                }
            }
        }
    }

    /// x: (n, d), w: (d) (the offset already added) -> (y (n, d), inv_rms (n))
    fn rmsnorm<T: Float + Send + Sync>(x: &[T], w: &[T], eps: f64) -> (Vec<T>, Stat<Vec<T>>) {
        let d = w.len().max(1);
        let mut y = vec![T::zero(); x.len()];
        let mut r = vec![T::zero(); x.len() / d];
        y.par_chunks_mut(d).zip(r.par_iter_mut()).zip(x.par_chunks(d)).for_each(|((y, r), x)| *r = forward_row(y, x, w, eps));
        (y, Stat(r))
    }

    /// -> dx (n, d); w with the offset already added.
    fn rmsnorm_backward_dx<T: Float + Send + Sync>(dy: &[T], x: &[T], w: &[T], r: &[T]) -> Vec<T> {
        let d = w.len().max(1);
        let mut dx = vec![T::zero(); x.len()];
        dx.par_chunks_mut(d).zip(x.par_chunks(d).zip(dy.par_chunks(d))).zip(r.par_iter()).for_each(|((dx, (x, dy)), &r)| {
            backward_row(dx, x, dy, w, r);
        });
        dx
    }
}

mod cuda {
    //! Launchers of kernels/rmsnorm.cu.
    use super::*;
    use crate::dispatch::{fold_launch, FOLD_GROUP, FOLD_MAX};
    use ferrolm_cuda::{kernels, CudaBackend, CudaStorage, DevPtr, Launch};
    use ferrolm_tensor::{DType, DeviceStorage};

    /// Rows each block of the first dw pass sums (a partial per chunk of rows) with a column a
    /// thread. With a 16-byte vector of columns a thread (8x fewer threads a row) chunks are
    /// shorter: at most 16 rows, fewer where the grid would give an SM under two blocks (few
    /// rows), at least 4 (the f32 partials then stay under a quarter of the bytes read).
    const ROWS_PER_CHUNK: usize = 64;
    const ROWS_PER_CHUNK_VEC: (usize, usize) = (4, 16);
    /// Rows of a block of the row kernels (a warp each), at most.
    const WARP_ROWS: usize = 8;

    /// Whether rows of d elements of dt at these addresses are whole 16-byte vectors.
    fn vectors(d: usize, dt: DType, ptrs: &[DevPtr]) -> bool {
        d.is_multiple_of(16 / dt.size_in_bytes()) && ptrs.iter().all(|p| p.addr().is_multiple_of(16))
    }

    /// The row kernels' launch over n rows of d, and their `vec`: 16-byte vectors where a row is
    /// whole vectors and every pointer is aligned. Up to WARP_ROWS rows a block, fewer where that
    /// would leave fewer than two blocks an SM (few long rows).
    fn row_plan(be: &CudaBackend, n: usize, d: usize, dt: DType, ptrs: &[DevPtr]) -> (Launch, i32) {
        let vec = vectors(d, dt, ptrs);
        let per_block = (n / (2 * be.sm_count() as usize)).clamp(1, WARP_ROWS);
        let grid = n.div_ceil(per_block).clamp(1, 1 << 20) as u32;
        (Launch::new((grid, 1, 1), 32 * per_block as u32).elems(n * d), vec as i32)
    }

    pub(super) fn forward(be: &CudaBackend, x: View, w: View, eps: f64, offset: f64) -> Result<(Storage, Storage)> {
        let s = CudaStorage::of("rmsnorm", x.0)?;
        let (_, n, d) = rows(x.1);
        let (y, r) = (be.alloc_storage(n * d, s.dtype())?, be.alloc_storage(n, DType::F32)?);
        let (px, pw) = (s.at(x.1.offset), dev_ptr("rmsnorm", w)?);
        let (cfg, vec) = row_plan(be, n, d, s.dtype(), &[px, pw, y.ptr()]);
        // SAFETY: x is (n, d) and w (d), both of x's dtype and contiguous from their offsets;
        // y holds n * d elements of that dtype, r n f32; `vec` as the kernel needs it.
        unsafe { kernels::rmsnorm_fwd(be, s.dtype(), cfg, px, pw, y.ptr(), r.ptr(), n as i64, d as i64, eps as f32, offset as f32, vec)? };
        Ok((y.into(), r.into()))
    }

    /// dx (plus `fused.acc`), and dw into `fused.dw_into` when given (its dtype: w's or f32),
    /// else into a new storage that is returned.
    pub(super) fn backward(
        be: &CudaBackend,
        dy: View,
        x: View,
        w: View,
        inv_rms: View,
        offset: f64,
        fused: Fused,
    ) -> Result<(Storage, Option<Storage>)> {
        let (acc, dw_into) = (fused.acc, fused.dw_into);
        let op = "rmsnorm_backward";
        let s = CudaStorage::of(op, x.0)?;
        let (dt, (_, n, d)) = (s.dtype(), rows(x.1));
        let (r, _keep) = f32_ptr(be, op, inv_rms)?;
        let (pdy, px, pw) = (dev_ptr(op, dy)?, s.at(x.1.offset), dev_ptr(op, w)?);
        let pacc = match acc {
            Some(a) if CudaStorage::of(op, a.0)?.dtype() == dt && a.1.is_contiguous() && a.1.numel() == n * d => dev_ptr(op, a)?,
            Some(a) => bail!(op, "the addend must be contiguous ({n}, {d}) {dt}, got {:?} {}", a.1.dims(), a.0.dtype()),
            None => DevPtr::NULL,
        };
        // The first dw pass: v columns a thread (a 16-byte vector where dy and x allow).
        let dw_vec = vectors(d, dt, &[pdy, px]);
        let v = if dw_vec { 16 / dt.size_in_bytes() } else { 1 };
        // A block per (chunk of rows, up to BLOCK threads of v columns), no wider than the row.
        let threads = d.div_ceil(v).max(1);
        let bx = threads.next_multiple_of(32).min(Launch::BLOCK as usize);
        let gy = threads.div_ceil(bx);
        let rpc = match dw_vec {
            true => (n * gy / (2 * be.sm_count() as usize)).clamp(ROWS_PER_CHUNK_VEC.0, ROWS_PER_CHUNK_VEC.1),
            false => ROWS_PER_CHUNK,
        };
        let (ni, di, chunk) = (n as i64, d as i64, rpc as i64);
        let dx = be.alloc_storage(n * d, dt)?;
        let mut ptrs = vec![pdy, px, pw, dx.ptr()];
        if pacc != DevPtr::NULL {
            ptrs.push(pacc);
        }
        let (rows_cfg, vec) = row_plan(be, n, d, dt, &ptrs);
        // SAFETY: dy and x are (n, d) and w (d) of dtype dt, r n f32, all contiguous; acc, when
        // not null, n * d contiguous elements of dt (checked above); dx holds n * d elements;
        // `vec` as the row kernel needs it (every pointer it reads through counted).
        unsafe { kernels::rmsnorm_bwd_dx(be, dt, rows_cfg, pdy, px, pw, r, pacc, dx.ptr(), ni, di, offset as f32, vec)? };
        if fused.no_dw {
            return Ok((dx.into(), None));
        }
        let nchunks = n.div_ceil(rpc).max(1);
        // With no rows the partials must still sum to zero.
        let partial = if n == 0 { be.alloc_zeroed(nchunks * d, DType::F32)? } else { be.alloc_storage(nchunks * d, DType::F32)? };
        let (dw, pdw, dwt) = match dw_into {
            Some(o) => {
                let ot = CudaStorage::of(op, o.0)?.dtype();
                if !(ot == dt || ot == DType::F32) || !o.1.is_contiguous() || o.1.numel() != d {
                    bail!(op, "the weight gradient's destination must be contiguous ({d}) of {dt} or f32, got {:?} {ot}", o.1.dims());
                }
                (None, dev_ptr(op, o)?, ot)
            }
            None => {
                let dw = be.alloc_storage(d, dt)?;
                let p = dw.ptr();
                (Some(dw), p, dt)
            }
        };
        let cols = Launch::new((nchunks as u32, gy as u32, 1), bx as u32).elems(n * d);
        // SAFETY: dy and x are (n, d) of dtype dt, r n f32, contiguous (16-byte aligned with d
        // whole vectors where `dw_vec`, as the first dw pass needs); partial holds nchunks * d
        // f32 (chunk c covers rows [c * chunk, ..)).
        unsafe { kernels::rmsnorm_bwd_dw_partial(be, dt, cols, pdy, px, r, partial.ptr(), ni, di, chunk, dw_vec as i32)? };
        // The partials folded `FOLD_GROUP` chunks a block while there are over `FOLD_MAX`, then
        // summed into dw: every level in chunk order, so the bits do not depend on the launch.
        let (mut p, mut nc) = (partial, nchunks);
        while nc > FOLD_MAX {
            let next = nc.div_ceil(FOLD_GROUP);
            let out = be.alloc_storage(next * d, DType::F32)?;
            let cfg = fold_launch(next, d, nc);
            // SAFETY: p holds nc * d f32 (chunk-major), out next * d f32: block row g writes row
            // g from chunks [g * FOLD_GROUP, ..) of p, within nc.
            unsafe { kernels::rmsnorm_bwd_dw_finish(be, DType::F32, cfg, p.ptr(), out.ptr(), nc as i64, di, FOLD_GROUP as i64)? };
            (p, nc) = (out, next);
        }
        // SAFETY: p holds nc * d f32; one block row (group nc) writes d elements of dwt at pdw.
        unsafe { kernels::rmsnorm_bwd_dw_finish(be, dwt, fold_launch(1, d, nc), p.ptr(), pdw, nc as i64, di, nc.max(1) as i64)? };
        Ok((dx.into(), dw.map(Into::into)))
    }
}
