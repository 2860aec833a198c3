//! The CPU backend: the reference every other backend is checked against. Float kernels are
//! generic over f32/f64; bf16 inputs are widened to f32, computed, and rounded back once (the
//! GEMM reads bf16 directly on AVX512-BF16: `gemm_bf16`). `simd` compiles the hot loops for the
//! vector unit found at run time.
//!
//! The helpers below are public for the CPU forms of ops defined outside this crate (the fused
//! ops of the ops crate): `float_dispatch!` runs a generic kernel in the working precision of a
//! dtype and turns its result back into storage (`Finish`, `Stat`); `gather` and `i32s` read
//! views and ids.
pub mod gemm_bf16;
mod kernels;
pub mod sgemm;
pub use kernels::GemmScalar;
pub mod simd;

use crate::backend::{Backend, BinaryOp, ReduceOp, UnaryOp, View};
use crate::{bail, CpuStorage, DType, Device, Layout, Result, Storage};
use half::bf16;
use std::any::Any;
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

/// The elements of float storage as f32 (borrowed when they are f32).
pub fn f32s<'a>(op: &str, s: &'a Storage) -> Result<Cow<'a, [f32]>> {
    Ok(match cpu(op, s)? {
        CpuStorage::F32(v) => Cow::Borrowed(v),
        CpuStorage::BF16(v) => Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
        CpuStorage::F64(v) => Cow::Owned(v.iter().map(|&x| x as f32).collect()),
        CpuStorage::I32(_) => bail!(op, "expected a float tensor, got i32"),
    })
}

/// The elements of float storage as f64 (borrowed when they are f64).
pub fn f64s<'a>(op: &str, s: &'a Storage) -> Result<Cow<'a, [f64]>> {
    Ok(match cpu(op, s)? {
        CpuStorage::F64(v) => Cow::Borrowed(v),
        CpuStorage::F32(v) => Cow::Owned(v.iter().map(|&x| x as f64).collect()),
        CpuStorage::BF16(v) => Cow::Owned(v.iter().map(|x| x.to_f64()).collect()),
        CpuStorage::I32(_) => bail!(op, "expected a float tensor, got i32"),
    })
}

/// The elements of i32 storage (token ids, targets).
pub fn i32s<'a>(op: &str, s: &'a Storage) -> Result<&'a [i32]> {
    match cpu(op, s)? {
        CpuStorage::I32(v) => Ok(v),
        other => bail!(op, "expected i32 ids, got {}", other.dtype()),
    }
}

/// Converts a kernel's result (vectors, or tuples of them) back into storage of `dtype`.
pub trait Finish {
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
pub struct Stat<V>(pub V);
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
/// storage view (`View`) rebound to a slice of that precision, then converts the result back to
/// storage of `$dt` (`Finish`). Errors (a non-float storage) return from the enclosing function.
#[macro_export]
macro_rules! float_dispatch {
    ($op:expr, $dt:expr, [$($x:ident),*], $body:expr) => {{
        let dt: $crate::DType = $dt;
        if dt == $crate::DType::F64 {
            $(let $x = $crate::cpu::f64s($op, $x.0)?; let $x: &[f64] = &$x;)*
            $crate::cpu::Finish::finish($body, dt)
        } else {
            $(let $x = $crate::cpu::f32s($op, $x.0)?; let $x: &[f32] = &$x;)*
            $crate::cpu::Finish::finish($body, dt)
        }
    }};
}

/// Sum of squares of a view's elements, accumulated in f64 (deterministic; see `kernels::sum_f64`).
pub(crate) fn sum_squares(x: View) -> Result<f64> {
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

/// The elements of the view `l` of `v`, in row-major order. Views whose last dim is contiguous
/// (a permute of the leading dims: heads split or merged) are copied a row at a time.
pub fn gather<T: Copy + Send + Sync>(v: &[T], l: &Layout) -> Vec<T> {
    const PAR_MIN: usize = 1 << 15;
    const CHUNK: usize = 1 << 13;
    const MIN_ROW: usize = 8;
    let n = l.numel();
    let r = l.shape.rank();
    if l.is_contiguous() {
        v[l.offset..l.offset + n].to_vec()
    } else if n > 0 && r >= 2 && l.strides[r - 1] == 1 && l.shape.0[r - 1] >= MIN_ROW {
        let w = l.shape.0[r - 1];
        let rows = Layout { shape: l.shape.0[..r - 1].to_vec().into(), strides: l.strides[..r - 1].to_vec(), offset: l.offset };
        let mut out = vec![v[l.offset]; n];
        let copy_rows = |o: &mut [T], first_row: usize| {
            let idx = rows.indices_range(first_row, o.len() / w);
            for (o, i) in o.chunks_exact_mut(w).zip(idx) {
                o.copy_from_slice(&v[i..i + w]);
            }
        };
        if n >= PAR_MIN {
            use rayon::prelude::*;
            let per = CHUNK.div_ceil(w);
            out.par_chunks_mut(per * w).enumerate().for_each(|(c, o)| copy_rows(o, c * per));
        } else {
            copy_rows(&mut out, 0);
        }
        out
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
    fn into_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }
    fn from_cpu(&self, s: &CpuStorage) -> Result<Storage> {
        Ok(Storage::Cpu(s.clone()))
    }
    fn to_cpu(&self, x: View) -> Result<CpuStorage> {
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
    fn copy_strided(&self, x: View) -> Result<Storage> {
        Ok(Storage::Cpu(self.to_cpu(x)?))
    }
    fn cast(&self, x: View, dtype: DType) -> Result<Storage> {
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
    fn unary(&self, op: UnaryOp, x: View) -> Result<Storage> {
        let l = x.1;
        Ok(float_dispatch!("unary", x.0.dtype(), [x], kernels::unary(op, x, l)))
    }
    fn binary(&self, op: BinaryOp, a: View, b: View) -> Result<Storage> {
        let (la, lb) = (a.1, b.1);
        Ok(float_dispatch!("binary", a.0.dtype(), [a, b], kernels::binary(op, a, la, b, lb)))
    }
    fn reduce(&self, op: ReduceOp, x: View, dims: &[usize]) -> Result<Storage> {
        let l = x.1;
        Ok(float_dispatch!("reduce", x.0.dtype(), [x], kernels::reduce(op, x, l, dims)))
    }
    fn matmul(&self, a: View, b: View) -> Result<Storage> {
        let (la, lb) = (a.1, b.1);
        let dt = a.0.dtype();
        if dt == DType::F64 {
            let (a, b) = (f64s("matmul", a.0)?, f64s("matmul", b.0)?);
            Ok(kernels::matmul_f64(&a, la, &b, lb)?.finish(dt))
        } else if let (DType::BF16, true, CpuStorage::BF16(av), CpuStorage::BF16(bv)) =
            (dt, gemm_bf16::available(), cpu("matmul", a.0)?, cpu("matmul", b.0)?)
        {
            Ok(kernels::matmul_bf16(av, la, bv, lb)?.finish(dt))
        } else {
            let (a, b) = (f32s("matmul", a.0)?, f32s("matmul", b.0)?);
            Ok(kernels::matmul_f32(&a, la, &b, lb)?.finish(dt))
        }
    }
    fn cat(&self, parts: &[View], dim: usize) -> Result<Storage> {
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
    fn assign(&self, dst: &mut Storage, dl: &Layout, src: View) -> Result<()> {
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
}
