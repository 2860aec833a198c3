//! The CPU backend: the reference every other backend is checked against. Float kernels are
//! generic over f32/f64; bf16 inputs are widened to f32, computed, and rounded back once.
mod fused;
mod kernels;

use crate::backend::{AttnDims, Backend, BinaryOp, ReduceOp, Sl, UnaryOp};
use crate::{bail, CpuStorage, DType, Device, Layout, Result, Storage};
use half::bf16;
use std::borrow::Cow;
use std::sync::{Arc, OnceLock};

pub struct CpuBackend;

pub(crate) fn backend() -> Arc<dyn Backend> {
    static B: OnceLock<Arc<dyn Backend>> = OnceLock::new();
    B.get_or_init(|| Arc::new(CpuBackend)).clone()
}

fn cpu<'a>(op: &str, s: &'a Storage) -> Result<&'a CpuStorage> {
    match s {
        Storage::Cpu(c) => Ok(c),
        Storage::Device(d) => bail!(op, "CPU backend got storage on {}", d.device()),
    }
}

pub(crate) fn f32s<'a>(op: &str, s: &'a Storage) -> Result<Cow<'a, [f32]>> {
    Ok(match cpu(op, s)? {
        CpuStorage::F32(v) => Cow::Borrowed(v),
        CpuStorage::BF16(v) => Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
        CpuStorage::F64(v) => Cow::Owned(v.iter().map(|&x| x as f32).collect()),
        CpuStorage::I32(_) => bail!(op, "expected a float tensor, got i32"),
    })
}

pub(crate) fn f64s<'a>(op: &str, s: &'a Storage) -> Result<Cow<'a, [f64]>> {
    Ok(match cpu(op, s)? {
        CpuStorage::F64(v) => Cow::Borrowed(v),
        CpuStorage::F32(v) => Cow::Owned(v.iter().map(|&x| x as f64).collect()),
        CpuStorage::BF16(v) => Cow::Owned(v.iter().map(|x| x.to_f64()).collect()),
        CpuStorage::I32(_) => bail!(op, "expected a float tensor, got i32"),
    })
}

fn i32s<'a>(op: &str, s: &'a Storage) -> Result<&'a [i32]> {
    match cpu(op, s)? {
        CpuStorage::I32(v) => Ok(v),
        other => bail!(op, "expected i32 ids, got {}", other.dtype()),
    }
}

/// Converts a kernel's result (vectors, or tuples of them) back into storage of `dtype`.
pub(crate) trait Finish {
    type Out;
    fn finish(self, dtype: DType) -> Self::Out;
}
impl Finish for Vec<f32> {
    type Out = Storage;
    fn finish(self, dtype: DType) -> Storage {
        Storage::Cpu(match dtype {
            DType::BF16 => CpuStorage::BF16(self.iter().map(|&x| bf16::from_f32(x)).collect()),
            _ => CpuStorage::F32(self),
        })
    }
}
impl Finish for Vec<f64> {
    type Out = Storage;
    fn finish(self, _: DType) -> Storage {
        Storage::Cpu(CpuStorage::F64(self))
    }
}
/// A statistic (inverse RMS, log-sum-exp) kept in f32 even for bf16 activations.
pub(crate) struct Stat<V>(pub V);
impl Finish for Stat<Vec<f32>> {
    type Out = Storage;
    fn finish(self, _: DType) -> Storage {
        Storage::Cpu(CpuStorage::F32(self.0))
    }
}
impl Finish for Stat<Vec<f64>> {
    type Out = Storage;
    fn finish(self, _: DType) -> Storage {
        Storage::Cpu(CpuStorage::F64(self.0))
    }
}
impl<A: Finish, B: Finish> Finish for (A, B) {
    type Out = (A::Out, B::Out);
    fn finish(self, dt: DType) -> Self::Out {
        (self.0.finish(dt), self.1.finish(dt))
    }
}
impl<A: Finish, B: Finish, C: Finish> Finish for (A, B, C) {
    type Out = (A::Out, B::Out, C::Out);
    fn finish(self, dt: DType) -> Self::Out {
        (self.0.finish(dt), self.1.finish(dt), self.2.finish(dt))
    }
}

/// Runs `$body` in the working precision of `$dt` (f64 for f64, else f32) with each named
/// storage bound to a slice of that precision, then converts the result back to `$dt`.
macro_rules! fdispatch {
    ($op:expr, $dt:expr, [$($x:ident),*], $body:expr) => {{
        let dt: DType = $dt;
        if dt == DType::F64 {
            $(let $x = f64s($op, $x.0)?; let $x: &[f64] = &$x;)*
            Finish::finish($body, dt)
        } else {
            $(let $x = f32s($op, $x.0)?; let $x: &[f32] = &$x;)*
            Finish::finish($body, dt)
        }
    }};
}

/// Statistics stay f32 even for bf16 activations (f64 in f64 runs).
fn stat_dtype(dt: DType) -> DType {
    if dt == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Sum of squares of a view's elements, accumulated in f64 (deterministic; see `kernels::sum_f64`).
pub(crate) fn sum_squares(x: Sl) -> Result<f64> {
    fn sq<T: Copy + Send + Sync>(v: &[T], l: &Layout, f: impl Fn(T) -> f64 + Sync) -> f64 {
        if l.is_contiguous() {
            kernels::sum_f64(&v[l.offset..l.offset + l.numel()], |x| f(x) * f(x))
        } else {
            let idx: Vec<usize> = l.indices().collect();
            kernels::sum_f64(&idx, |i| f(v[i]) * f(v[i]))
        }
    }
    Ok(match cpu("sum_squares", x.0)? {
        CpuStorage::F32(v) => sq(v, x.1, |a| a as f64),
        CpuStorage::BF16(v) => sq(v, x.1, |a| a.to_f64()),
        CpuStorage::F64(v) => sq(v, x.1, |a| a),
        CpuStorage::I32(_) => bail!("sum_squares", "i32 tensors have no norm"),
    })
}

fn gather<T: Copy + Send + Sync>(v: &[T], l: &Layout) -> Vec<T> {
    const PAR_MIN: usize = 1 << 15;
    const CHUNK: usize = 1 << 13;
    let n = l.numel();
    if l.is_contiguous() {
        v[l.offset..l.offset + n].to_vec()
    } else if n >= PAR_MIN {
        use rayon::prelude::*;
        let mut out = vec![v[l.offset]; n];
        out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, o)| {
            let idx = l.indices_range(c * CHUNK, o.len());
            for (y, i) in o.iter_mut().zip(idx) {
                *y = v[i];
            }
        });
        out
    } else {
        l.indices().map(|i| v[i]).collect()
    }
}

impl Backend for CpuBackend {
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn from_cpu(&self, s: &CpuStorage) -> Result<Storage> {
        Ok(Storage::Cpu(s.clone()))
    }
    fn to_cpu(&self, x: Sl) -> Result<CpuStorage> {
        Ok(match cpu("to_cpu", x.0)? {
            CpuStorage::F32(v) => CpuStorage::F32(gather(v, x.1)),
            CpuStorage::BF16(v) => CpuStorage::BF16(gather(v, x.1)),
            CpuStorage::F64(v) => CpuStorage::F64(gather(v, x.1)),
            CpuStorage::I32(v) => CpuStorage::I32(gather(v, x.1)),
        })
    }
    fn full(&self, n: usize, dtype: DType, v: f64) -> Result<Storage> {
        Ok(Storage::Cpu(CpuStorage::full(n, dtype, v)))
    }
    fn copy_strided(&self, x: Sl) -> Result<Storage> {
        Ok(Storage::Cpu(self.to_cpu(x)?))
    }
    fn cast(&self, x: Sl, dtype: DType) -> Result<Storage> {
        let src = self.to_cpu(x)?;
        let f = |v: Vec<f64>| -> CpuStorage {
            match dtype {
                DType::F32 => CpuStorage::F32(v.iter().map(|&x| x as f32).collect()),
                DType::BF16 => CpuStorage::BF16(v.iter().map(|&x| crate::bf16_from_f64(x)).collect()),
                DType::F64 => CpuStorage::F64(v),
                DType::I32 => CpuStorage::I32(v.iter().map(|&x| x as i32).collect()),
            }
        };
        Ok(Storage::Cpu(match (&src, dtype) {
            (s, d) if s.dtype() == d => src,
            (CpuStorage::F32(v), DType::BF16) => CpuStorage::BF16(v.iter().map(|&x| bf16::from_f32(x)).collect()),
            (CpuStorage::BF16(v), DType::F32) => CpuStorage::F32(v.iter().map(|x| x.to_f32()).collect()),
            (CpuStorage::F32(v), _) => f(v.iter().map(|&x| x as f64).collect()),
            (CpuStorage::BF16(v), _) => f(v.iter().map(|x| x.to_f64()).collect()),
            (CpuStorage::F64(v), _) => f(v.clone()),
            (CpuStorage::I32(v), _) => f(v.iter().map(|&x| x as f64).collect()),
        }))
    }
    fn unary(&self, op: UnaryOp, x: Sl) -> Result<Storage> {
        let l = x.1;
        Ok(fdispatch!("unary", x.0.dtype(), [x], kernels::unary(op, x, l)))
    }
    fn binary(&self, op: BinaryOp, a: Sl, b: Sl) -> Result<Storage> {
        let (la, lb) = (a.1, b.1);
        Ok(fdispatch!("binary", a.0.dtype(), [a, b], kernels::binary(op, a, la, b, lb)))
    }
    fn reduce(&self, op: ReduceOp, x: Sl, dims: &[usize]) -> Result<Storage> {
        let l = x.1;
        Ok(fdispatch!("reduce", x.0.dtype(), [x], kernels::reduce(op, x, l, dims)))
    }
    fn matmul(&self, a: Sl, b: Sl) -> Result<Storage> {
        let (la, lb) = (a.1, b.1);
        let dt = a.0.dtype();
        if dt == DType::F64 {
            let (a, b) = (f64s("matmul", a.0)?, f64s("matmul", b.0)?);
            Ok(kernels::matmul_f64(&a, la, &b, lb)?.finish(dt))
        } else {
            let (a, b) = (f32s("matmul", a.0)?, f32s("matmul", b.0)?);
            Ok(kernels::matmul_f32(&a, la, &b, lb)?.finish(dt))
        }
    }
    fn cat(&self, parts: &[Sl], dim: usize) -> Result<Storage> {
        let hosts: Vec<CpuStorage> = parts.iter().map(|p| self.to_cpu(*p)).collect::<Result<_>>()?;
        let shapes: Vec<&[usize]> = parts.iter().map(|p| p.1.dims()).collect();
        macro_rules! cat_as {
            ($variant:ident) => {{
                let vs: Vec<&[_]> = hosts
                    .iter()
                    .map(|h| match h {
                        CpuStorage::$variant(v) => &v[..],
                        _ => unreachable!(),
                    })
                    .collect();
                CpuStorage::$variant(kernels::cat(&vs, &shapes, dim))
            }};
        }
        Ok(Storage::Cpu(match hosts[0].dtype() {
            DType::F32 => cat_as!(F32),
            DType::BF16 => cat_as!(BF16),
            DType::F64 => cat_as!(F64),
            DType::I32 => cat_as!(I32),
        }))
    }
    fn assign(&self, dst: &mut Storage, dl: &Layout, src: Sl) -> Result<()> {
        let src = self.to_cpu(src)?;
        let dst = match dst {
            Storage::Cpu(c) => c,
            Storage::Device(d) => bail!("assign", "CPU backend got storage on {}", d.device()),
        };
        macro_rules! put {
            ($d:expr, $s:expr) => {
                for (i, v) in dl.indices().zip($s.iter()) {
                    $d[i] = *v;
                }
            };
        }
        match (dst, &src) {
            (CpuStorage::F32(d), CpuStorage::F32(s)) => put!(d, s),
            (CpuStorage::BF16(d), CpuStorage::BF16(s)) => put!(d, s),
            (CpuStorage::F64(d), CpuStorage::F64(s)) => put!(d, s),
            (CpuStorage::I32(d), CpuStorage::I32(s)) => put!(d, s),
            (d, s) => bail!("assign", "dtype mismatch: destination {} source {}", d.dtype(), s.dtype()),
        }
        Ok(())
    }

    fn embedding(&self, w: Sl, ids: Sl) -> Result<Storage> {
        let d = w.1.dims()[1];
        let idv = gather(i32s("embedding", ids.0)?, ids.1);
        let vocab = w.1.dims()[0];
        if let Some(bad) = idv.iter().find(|&&i| i < 0 || i as usize >= vocab) {
            bail!("embedding", "token id {bad} out of range for a vocabulary of {vocab}");
        }
        let off = w.1.offset;
        Ok(fdispatch!("embedding", w.0.dtype(), [w], fused::embedding(&w[off..], d, &idv)))
    }
    fn embedding_backward(&self, dy: Sl, ids: Sl, vocab: usize) -> Result<Storage> {
        let idv = gather(i32s("embedding_backward", ids.0)?, ids.1);
        let d = *dy.1.dims().last().unwrap_or(&1);
        let off = dy.1.offset;
        Ok(fdispatch!("embedding_backward", dy.0.dtype(), [dy], fused::embedding_backward(&dy[off..], d, &idv, vocab)))
    }
    fn softmax_last(&self, x: Sl) -> Result<Storage> {
        let (off, n, d) = rows(x.1);
        Ok(fdispatch!("softmax", x.0.dtype(), [x], fused::softmax(&x[off..off + n * d], d)))
    }
    fn softmax_last_backward(&self, y: Sl, dy: Sl) -> Result<Storage> {
        let (oy, n, d) = rows(y.1);
        let (od, _, _) = rows(dy.1);
        Ok(fdispatch!("softmax_backward", y.0.dtype(), [y, dy], fused::softmax_backward(&y[oy..oy + n * d], &dy[od..od + n * d], d)))
    }
    fn rmsnorm(&self, x: Sl, w: Sl, eps: f64) -> Result<(Storage, Storage)> {
        let (ox, n, d) = rows(x.1);
        let ow = w.1.offset;
        let dt = x.0.dtype();
        Ok(fdispatch!("rmsnorm", dt, [x, w], fused::rmsnorm(&x[ox..ox + n * d], &w[ow..ow + d], eps)))
    }
    fn rmsnorm_backward(&self, dy: Sl, x: Sl, w: Sl, r: Sl) -> Result<(Storage, Storage)> {
        let (ox, n, d) = rows(x.1);
        let (od, ow, or) = (dy.1.offset, w.1.offset, r.1.offset);
        Ok(fdispatch!(
            "rmsnorm_backward",
            x.0.dtype(),
            [dy, x, w, r],
            fused::rmsnorm_backward(&dy[od..od + n * d], &x[ox..ox + n * d], &w[ow..ow + d], &r[or..or + n])
        ))
    }
    fn rope(&self, x: Sl, cos: Sl, sin: Sl, inverse: bool) -> Result<Storage> {
        let dims = x.1.dims();
        let (t, d) = (dims[2], dims[3]);
        let (ox, oc, os) = (x.1.offset, cos.1.offset, sin.1.offset);
        let n = x.1.numel();
        Ok(fdispatch!(
            "rope",
            x.0.dtype(),
            [x, cos, sin],
            fused::rope(&x[ox..ox + n], &cos[oc..oc + t * d], &sin[os..os + t * d], t, d, inverse)
        ))
    }
    fn swiglu(&self, g: Sl, u: Sl) -> Result<Storage> {
        let n = g.1.numel();
        let (og, ou) = (g.1.offset, u.1.offset);
        Ok(fdispatch!("swiglu", g.0.dtype(), [g, u], fused::swiglu(&g[og..og + n], &u[ou..ou + n])))
    }
    fn swiglu_backward(&self, dy: Sl, g: Sl, u: Sl) -> Result<(Storage, Storage)> {
        let n = g.1.numel();
        let (od, og, ou) = (dy.1.offset, g.1.offset, u.1.offset);
        Ok(fdispatch!("swiglu_backward", g.0.dtype(), [dy, g, u], fused::swiglu_backward(&dy[od..od + n], &g[og..og + n], &u[ou..ou + n])))
    }
    fn attention(&self, q: Sl, k: Sl, v: Sl, dims: AttnDims, scale: f64) -> Result<(Storage, Storage)> {
        let (oq, ok, ov) = (q.1.offset, k.1.offset, v.1.offset);
        let (nq, nk) = (q.1.numel(), k.1.numel());
        let dt = q.0.dtype();
        Ok(fdispatch!("attention", dt, [q, k, v], fused::attention(&q[oq..oq + nq], &k[ok..ok + nk], &v[ov..ov + nk], dims, scale)))
    }
    fn attention_backward(
        &self,
        dout: Sl,
        q: Sl,
        k: Sl,
        v: Sl,
        out: Sl,
        lse: Sl,
        dims: AttnDims,
        scale: f64,
    ) -> Result<(Storage, Storage, Storage)> {
        let (nq, nk) = (q.1.numel(), k.1.numel());
        let offs = [dout.1.offset, q.1.offset, k.1.offset, v.1.offset, out.1.offset, lse.1.offset];
        let nl = lse.1.numel();
        Ok(fdispatch!(
            "attention_backward",
            q.0.dtype(),
            [dout, q, k, v, out, lse],
            fused::attention_backward(
                &dout[offs[0]..offs[0] + nq],
                &q[offs[1]..offs[1] + nq],
                &k[offs[2]..offs[2] + nk],
                &v[offs[3]..offs[3] + nk],
                &out[offs[4]..offs[4] + nq],
                &lse[offs[5]..offs[5] + nl],
                dims,
                scale
            )
        ))
    }
    fn cross_entropy(&self, logits: Sl, targets: Sl, ignore: i32) -> Result<(Storage, Storage, usize)> {
        let (ol, n, v) = rows(logits.1);
        let t = gather(i32s("cross_entropy", targets.0)?, targets.1);
        check_targets(&t, v, ignore)?;
        let dt = logits.0.dtype();
        let sd = stat_dtype(dt);
        let count = t.iter().filter(|&&x| x != ignore).count();
        let (loss, lse) = fdispatch!("cross_entropy", sd, [logits], fused::cross_entropy(&logits[ol..ol + n * v], v, &t, ignore));
        Ok((loss, lse, count))
    }
    fn cross_entropy_backward(&self, logits: Sl, targets: Sl, lse: Sl, ignore: i32, scale: Sl) -> Result<Storage> {
        let (ol, n, v) = rows(logits.1);
        let t = gather(i32s("cross_entropy_backward", targets.0)?, targets.1);
        let olse = lse.1.offset;
        let sc = f64s("cross_entropy_backward", scale.0)?[scale.1.offset];
        Ok(fdispatch!(
            "cross_entropy_backward",
            logits.0.dtype(),
            [logits, lse],
            fused::cross_entropy_backward(&logits[ol..ol + n * v], v, &t, &lse[olse..olse + n], ignore, sc)
        ))
    }
}

/// (offset, rows, last dim) of a contiguous view.
fn rows(l: &Layout) -> (usize, usize, usize) {
    let d = *l.dims().last().unwrap_or(&1);
    (l.offset, l.numel().checked_div(d).unwrap_or(0), d)
}

fn check_targets(t: &[i32], v: usize, ignore: i32) -> Result<()> {
    if let Some(bad) = t.iter().find(|&&x| x != ignore && (x < 0 || x as usize >= v)) {
        bail!("cross_entropy", "target {bad} out of range for {v} classes (ignore_index is {ignore})");
    }
    Ok(())
}
