//! Mean softmax cross-entropy of logits (n, v) against i32 targets (n), rows whose target is
//! `ignore_index` not counted. The softmax is never stored: the forward keeps the log-sum-exp
//! per row (f32) and the backward recomputes dlogits = (exp(x − lse) − onehot) · g / count.
//! On the CPU, when f32 or f64 logits need a gradient, one pass over each row computes the loss
//! and the gradient for a root gradient of 1 (`cpu::forward_backward`); backward hands it back,
//! scaled in place for any other incoming gradient (bf16 logits keep the two-pass form, whose
//! gradient is rounded once). The mean and the count are summed in a fixed order. A target
//! outside [0, v) is an error: targets that carry their host copy (`Tokens::upload`) are checked and counted on the host,
//! others on the device (two host waits on a GPU: the check and the count).
//! CUDA: kernels/cross_entropy.cu, including a fused forward + backward in one pass over the
//! logits (`forward_backward_cuda`) with the gradient scale kept on the device.
use crate::dispatch::{f32_ptr, num, on, rows, On};
use crate::tokens::Tokens;
use ferrolm_tensor::backend::View;
use ferrolm_tensor::{bail, is_grad_enabled, same_device, DType, Device, Result, Storage, Tensor};

pub use cuda::forward_backward as forward_backward_cuda;

/// Mean cross-entropy of `logits` (n, v) against i32 `targets` (n), skipping `ignore_index`.
/// The loss is f32 for f32/bf16 logits (f64 for f64). The targets are checked and counted on
/// the device; `cross_entropy_tokens` does it on a host copy instead.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor, ignore_index: i32) -> Result<Tensor> {
    cross_entropy_tokens(logits, &Tokens::device(targets), ignore_index)
}

/// `cross_entropy` of `targets`, checked and counted on the host when they carry their host
/// copy: the loss then stays on the device (no host wait).
pub fn cross_entropy_tokens(logits: &Tensor, tokens: &Tokens, ignore_index: i32) -> Result<Tensor> {
    let targets = tokens.tensor();
    same_device("cross_entropy", &[logits, targets])?;
    if logits.rank() != 2 || !logits.dtype().is_float() {
        bail!("cross_entropy", "logits must be a float (rows, classes) matrix, got {:?} {}", logits.shape(), logits.dtype());
    }
    if targets.dtype() != DType::I32 || targets.dims() != [logits.dims()[0]] {
        bail!("cross_entropy", "targets must be i32 of shape [{}], got {:?} {}", logits.dims()[0], targets.shape(), targets.dtype());
    }
    let x = logits.contiguous()?;
    let known = tokens.count_targets(x.dims()[1], ignore_index)?;
    if x.device() == Device::Cpu && x.dtype() != DType::BF16 && is_grad_enabled() && logits.requires_grad() {
        return cpu_fused(logits, &x, targets, ignore_index);
    }
    let (loss, lse, count) = Tensor::with_storages(&[&x, targets], |s| forward_with(s[0], s[1], ignore_index, known))?;
    let out = Tensor::new(loss, ())?;
    let lse = Tensor::new(lse, [x.dims()[0]])?;
    let t = targets.clone();
    let backward_fn = move |g: &Tensor| {
        let scale = g.mul_scalar(1.0 / count.max(1) as f64)?;
        let st = Tensor::with_storages(&[&x, &t, &lse, &scale], |s| backward(s[0], s[1], s[2], ignore_index, s[3]))?;
        Ok(vec![Some(Tensor::new(st, x.shape().clone())?)])
    };
    Ok(Tensor::from_op(out, "cross_entropy", &[logits], Box::new(backward_fn)))
}

/// The CPU's training form for f32 and f64 logits: one pass over each row computes the loss and
/// the gradient for a loss gradient of 1, (softmax − onehot) / count, which backward returns as
/// it is when the incoming gradient is 1 (the loss is the root) and scales in place otherwise
/// (gradient accumulation's 1/accum). It reads the logits once instead of three times and skips
/// the backward's second exp of every logit.
fn cpu_fused(logits: &Tensor, x: &Tensor, targets: &Tensor, ignore_index: i32) -> Result<Tensor> {
    let (loss, grad) = Tensor::with_storages(&[x, targets], |s| cpu::forward_backward(s[0], s[1], ignore_index))?;
    let out = Tensor::new(loss, ())?;
    let shape = x.shape().clone();
    // Taken by the one backward call, so the graph does not keep a logits-sized buffer alive
    // through the rest of the backward pass.
    let grad = std::sync::Mutex::new(Some(grad));
    let backward_fn = move |g: &Tensor| {
        let Some(mut grad) = grad.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            bail!("cross_entropy", "backward ran twice through one CPU loss; compute the loss again");
        };
        let g = g.to_vec_f64()?[0];
        if g != 1.0 {
            cpu::scale_in_place(&mut grad, g)?;
        }
        Ok(vec![Some(Tensor::new(grad, shape.clone())?)])
    };
    Ok(Tensor::from_op(out, "cross_entropy", &[logits], Box::new(backward_fn)))
}

/// logits (n, v) contiguous, targets i32 (n) -> (mean loss () in f32, f64 for f64 logits;
/// lse (n) likewise; the count of counted rows).
pub fn forward(logits: View, targets: View, ignore_index: i32) -> Result<(Storage, Storage, usize)> {
    forward_with(logits, targets, ignore_index, None)
}

/// `forward`; `known`: the count of counted rows when the caller has checked the targets (CUDA
/// then neither checks nor reads the count back; the CPU checks anyway, at no cost in waits).
fn forward_with(logits: View, targets: View, ignore_index: i32, known: Option<usize>) -> Result<(Storage, Storage, usize)> {
    match on("cross_entropy", logits.0)? {
        On::Cpu => cpu::forward(logits, targets, ignore_index),
        On::Cuda(be) => cuda::forward(&be, logits, targets, ignore_index, known),
    }
}

/// dlogits = (softmax − onehot) · scale for counted rows, 0 for ignored ones; `scale` is a
/// one-element tensor (the loss gradient over the count).
pub fn backward(logits: View, targets: View, lse: View, ignore_index: i32, scale: View) -> Result<Storage> {
    match on("cross_entropy", logits.0)? {
        On::Cpu => cpu::backward(logits, targets, lse, ignore_index, scale),
        On::Cuda(be) => cuda::backward(&be, logits, targets, lse, ignore_index, scale),
    }
}

mod cpu {
    //! The reference: lse per row in parallel (the row math of `crate::ce_row`, shared with the
    //! fused head), the mean summed in row order.
    use super::*;
    use crate::ce_row::{row_lse, row_lse_grad, softmax_row};
    use ferrolm_tensor::cpu::simd::FastExp;
    use ferrolm_tensor::cpu::{f64s, gather, i32s, Stat};
    use ferrolm_tensor::{float_dispatch, CpuStorage};
    use rayon::prelude::*;

    /// The logits' element range, the classes, the targets gathered and checked, and the count
    /// of counted rows.
    fn prepare(logits: View, targets: View, ignore: i32) -> Result<(std::ops::Range<usize>, usize, Vec<i32>, usize)> {
        let (ol, n, v) = rows(logits.1);
        let t = gather(i32s("cross_entropy", targets.0)?, targets.1);
        let count = crate::tokens::count_targets(&t, v, ignore)?;
        Ok((ol..ol + n * v, v, t, count))
    }

    pub(super) fn forward(logits: View, targets: View, ignore: i32) -> Result<(Storage, Storage, usize)> {
        let (range, v, t, count) = prepare(logits, targets, ignore)?;
        // The loss and the statistics are f32 even for bf16 logits (f64 in f64 runs).
        let stat_dtype = if logits.0.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
        let (loss, lse) = float_dispatch!("cross_entropy", stat_dtype, [logits], cross_entropy(&logits[range], v, &t, ignore));
        Ok((loss, lse, count))
    }

    pub(super) fn backward(logits: View, targets: View, lse: View, ignore: i32, scale: View) -> Result<Storage> {
        let (ol, n, v) = rows(logits.1);
        let t = gather(i32s("cross_entropy_backward", targets.0)?, targets.1);
        let olse = lse.1.offset;
        let sc = f64s("cross_entropy_backward", scale.0)?[scale.1.offset];
        Ok(float_dispatch!(
            "cross_entropy_backward",
            logits.0.dtype(),
            [logits, lse],
            cross_entropy_backward(&logits[ol..ol + n * v], v, &t, &lse[olse..olse + n], ignore, sc)
        ))
    }

    /// logits (n, v) contiguous, targets (n) -> (mean loss over counted rows, f32 or f64 as in
    /// `forward`; dlogits for a loss gradient of 1, in the logits' dtype). f32 or f64 logits: bf16
    /// ones would be rounded here and again when scaled.
    pub(crate) fn forward_backward(logits: View, targets: View, ignore: i32) -> Result<(Storage, Storage)> {
        let (range, v, t, count) = prepare(logits, targets, ignore)?;
        Ok(float_dispatch!("cross_entropy", logits.0.dtype(), [logits], fused(&logits[range], v, &t, ignore, count)))
    }

    /// The fused form's gradient times the incoming gradient `g`, in place (f32 or f64).
    pub(super) fn scale_in_place(grad: &mut Storage, g: f64) -> Result<()> {
        match grad {
            Storage::Cpu(CpuStorage::F32(v)) => {
                let g = g as f32;
                v.par_iter_mut().for_each(|x| *x *= g);
            }
            Storage::Cpu(CpuStorage::F64(v)) => v.par_iter_mut().for_each(|x| *x *= g),
            other => bail!("cross_entropy", "the fused CPU gradient is f32 or f64, not {:?} on {:?}", other.dtype(), other.device()),
        }
        Ok(())
    }

    /// -> (mean loss over counted rows as a statistic, dlogits (n, v)); `count` counted rows.
    /// Ignored rows get a zero gradient.
    fn fused<T: FastExp + Send + Sync>(logits: &[T], v: usize, t: &[i32], ignore: i32, count: usize) -> (Stat<Vec<T>>, Vec<T>) {
        let sc: T = num(1.0 / count.max(1) as f64);
        let mut d = vec![T::zero(); logits.len()];
        let lse: Vec<T> = d
            .par_chunks_mut(v.max(1))
            .zip(logits.par_chunks(v.max(1)))
            .zip(t.par_iter())
            .map(|((d, x), &tg)| if tg == ignore { T::zero() } else { row_lse_grad(d, x, tg as usize, sc) })
            .collect();
        (Stat(vec![mean_loss(logits, v, t, ignore, &lse)]), d)
    }

    /// The mean of lse − logit[target] over the counted rows, summed in f64 in row order (a
    /// batch holds up to millions of rows); 0 with no counted row.
    fn mean_loss<T: FastExp>(logits: &[T], v: usize, t: &[i32], ignore: i32, lse: &[T]) -> T {
        let (mut sum, mut n) = (0f64, 0usize);
        for (r, &tg) in t.iter().enumerate() {
            if tg != ignore {
                sum += (lse[r] - logits[r * v + tg as usize]).to_f64().unwrap_or(f64::NAN);
                n += 1;
            }
        }
        if n == 0 {
            T::zero()
        } else {
            num(sum / n as f64)
        }
    }

    /// logits: (n, v) -> (mean loss over counted rows (1), lse (n)). With no counted row the
    /// loss is 0.
    fn cross_entropy<T: FastExp + Send + Sync>(logits: &[T], v: usize, t: &[i32], ignore: i32) -> (Vec<T>, Stat<Vec<T>>) {
        let lse: Vec<T> = logits.par_chunks(v.max(1)).map(row_lse).collect();
        (vec![mean_loss(logits, v, t, ignore, &lse)], Stat(lse))
    }

    fn cross_entropy_backward<T: FastExp + Send + Sync>(logits: &[T], v: usize, t: &[i32], lse: &[T], ignore: i32, scale: f64) -> Vec<T> {
        let sc: T = num(scale);
        let mut d = vec![T::zero(); logits.len()];
        d.par_chunks_mut(v.max(1)).zip(logits.par_chunks(v.max(1))).enumerate().for_each(|(r, (d, x))| {
            if t[r] == ignore {
                return;
            }
            softmax_row(d, x, lse[r], sc);
            d[t[r] as usize] = d[t[r] as usize] - sc;
        });
        d
    }
}

mod cuda {
    //! Launchers of kernels/cross_entropy.cu.
    use super::*;
    use ferrolm_cuda::{check_kernel_dtype, kernels, CudaBackend, CudaStorage, DevPtr, Launch};
    use ferrolm_tensor::DeviceStorage;

    /// Threads of the one-block reductions over rows (ce_finish, ce_count_scale).
    const FINISH_BLOCK: u32 = 1024;

    /// `known`: the count of counted rows, the targets checked by the caller on the host (then
    /// nothing is read back); None: checked and counted here (two host waits).
    pub(super) fn forward(
        be: &CudaBackend,
        logits: View,
        targets: View,
        ignore: i32,
        known: Option<usize>,
    ) -> Result<(Storage, Storage, usize)> {
        let op = "cross_entropy";
        let s = CudaStorage::of(op, logits.0)?;
        let (_, n, v) = rows(logits.1);
        let t = be.contiguous(op, targets)?;
        let (lse, rl) = (be.alloc_storage(n, DType::F32)?, be.alloc_storage(n, DType::F32)?);
        let (ni, vi) = (n as i64, v as i64);
        let bad = match known {
            Some(_) => None,
            None => Some(be.alloc_zeroed(1, DType::I32)?),
        };
        // SAFETY: logits are (n, v) contiguous from their offset, `t` n i32 (range-checked on the
        // host, or by targets_check before any result is used), `bad` one i32, lse and rl n f32.
        unsafe {
            if let Some(bad) = &bad {
                kernels::targets_check(be, Launch::cover(n, Launch::BLOCK), t.ptr(), ni, vi, ignore, bad.ptr())?;
            }
            kernels::ce_fwd(
                be,
                s.dtype(),
                Launch::per_row(n, Launch::BLOCK),
                s.at(logits.1.offset),
                t.ptr(),
                lse.ptr(),
                rl.ptr(),
                ni,
                vi,
                ignore,
            )?;
        }
        let (loss, count) = finish(be, &rl, &t, n, ignore)?;
        if let Some(count) = known {
            return Ok((loss.into(), lse.into(), count));
        }
        let bad = bad.expect("the check ran: the count is not known");
        if be.read_i32(&bad, 0)? != 0 {
            bail!(op, "a target is out of range for {v} classes (ignore_index is {ignore})");
        }
        let count = be.read_i32(&count, 0)? as usize;
        Ok((loss.into(), lse.into(), count))
    }

    /// The mean of the row losses `rl` over the counted rows and that count, summed in a fixed
    /// order by one block: (loss (1) f32, count (1) i32).
    fn finish(be: &CudaBackend, rl: &CudaStorage, t: &CudaStorage, n: usize, ignore: i32) -> Result<(CudaStorage, CudaStorage)> {
        let (loss, count) = (be.alloc_storage(1, DType::F32)?, be.alloc_storage(1, DType::I32)?);
        // SAFETY: rl holds n f32 and t n i32; loss and count one element each; no scale output.
        unsafe {
            kernels::ce_finish(
                be,
                Launch::single(FINISH_BLOCK),
                rl.ptr(),
                t.ptr(),
                n as i64,
                ignore,
                1.0,
                loss.ptr(),
                count.ptr(),
                DevPtr::NULL,
            )?
        };
        Ok((loss, count))
    }

    pub(super) fn backward(be: &CudaBackend, logits: View, targets: View, lse: View, ignore: i32, scale: View) -> Result<Storage> {
        let op = "cross_entropy_backward";
        let s = CudaStorage::of(op, logits.0)?;
        let (_, n, v) = rows(logits.1);
        let t = be.contiguous(op, targets)?;
        let ((pl, _keep_lse), (ps, _keep_scale)) = (f32_ptr(be, op, lse)?, f32_ptr(be, op, scale)?);
        let out = be.alloc_storage(n * v, s.dtype())?;
        let cfg = Launch::per_row(n, Launch::BLOCK);
        // SAFETY: logits are (n, v) contiguous, `t` n i32 in range (checked by the forward), lse
        // n f32, the scale one f32; `out` holds n * v elements of the logits' dtype.
        unsafe { kernels::ce_bwd(be, s.dtype(), cfg, s.at(logits.1.offset), t.ptr(), pl, ps, out.ptr(), n as i64, v as i64, ignore)? };
        Ok(out.into())
    }

    /// Fused cross-entropy forward + backward in one pass over the logits: returns
    /// (mean loss () f32, lse (n) f32, dlogits (n, v) in the logits' dtype) with
    /// dlogits = (softmax - onehot) * grad_mult / count. No host synchronisation (and no check
    /// of the targets' range: the caller's loader guarantees it).
    pub fn forward_backward(
        be: &CudaBackend,
        logits: View,
        targets: &Storage,
        ignore_index: i32,
        grad_mult: f32,
    ) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
        let op = "cross_entropy_fused";
        let x = CudaStorage::of(op, logits.0)?;
        let t = CudaStorage::of(op, targets)?;
        check_kernel_dtype(op, x.dtype())?;
        let (_, n, v) = rows(logits.1);
        let scale = be.alloc_storage(1, DType::F32)?;
        let (lse, rl) = (be.alloc_storage(n, DType::F32)?, be.alloc_storage(n, DType::F32)?);
        let dx = be.alloc_storage(n * v, x.dtype())?;
        let (ni, vi, cfg) = (n as i64, v as i64, Launch::per_row(n, 256));
        // SAFETY: logits are (n, v) contiguous from their offset, `t` n i32, `scale` one f32,
        // lse and rl n f32, dx n * v elements of the logits' dtype.
        unsafe {
            kernels::ce_count_scale(be, Launch::single(FINISH_BLOCK), t.ptr(), ni, ignore_index, grad_mult, scale.ptr())?;
            kernels::ce_fused(
                be,
                x.dtype(),
                cfg,
                x.at(logits.1.offset),
                t.ptr(),
                scale.ptr(),
                0,
                lse.ptr(),
                rl.ptr(),
                dx.ptr(),
                ni,
                vi,
                ignore_index,
            )?;
        }
        let (loss, _count) = finish(be, &rl, t, n, ignore_index)?;
        Ok((loss, lse, dx))
    }
}
