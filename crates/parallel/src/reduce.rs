//! Host reductions for thread ranks, in a fixed order: rank 0 + rank 1 + ... element by element,
//! accumulated in f32 for bf16 and f32 (rounded to bf16 once at the end), f64 for f64 and i64
//! for i32 (overflow is an error). The result depends only on the inputs, never on which thread
//! arrived first, so repeated runs agree bit for bit.
use crate::comm::ReduceOp;
use ferrolm_tensor::{bail, bf16, CpuStorage, Result};

fn fold<T: Copy, A: Copy>(parts: &[&[T]], widen: impl Fn(T) -> A, step: impl Fn(A, A) -> A) -> Vec<A> {
    let mut acc: Vec<A> = parts[0].iter().map(|&x| widen(x)).collect();
    for p in &parts[1..] {
        for (a, &x) in acc.iter_mut().zip(p.iter()) {
            *a = step(*a, widen(x));
        }
    }
    acc
}

fn fmax<F: num_like::Float>(a: F, b: F) -> F {
    // NaN wins, as it would in a sum: a reduction never hides a NaN.
    if a.is_nan() || b.is_nan() {
        F::nan()
    } else if b > a {
        b
    } else {
        a
    }
}

/// Sum, max or mean of float parts, widened to the accumulator type `F` (the mean divides the
/// sum by the number of parts once, at the end).
fn float_reduce<T: Copy, F: num_like::Float>(op: ReduceOp, parts: &[&[T]], widen: impl Fn(T) -> F) -> Vec<F> {
    let acc = match op {
        ReduceOp::Max => fold(parts, widen, fmax),
        _ => fold(parts, widen, |a, b| a + b),
    };
    if op == ReduceOp::Avg {
        let n = F::count(parts.len());
        acc.into_iter().map(|a| a / n).collect()
    } else {
        acc
    }
}

mod num_like {
    pub trait Float: Copy + PartialOrd + std::ops::Add<Output = Self> + std::ops::Div<Output = Self> {
        fn is_nan(self) -> bool;
        fn nan() -> Self;
        /// `n` as this type (a rank count: exact).
        fn count(n: usize) -> Self;
    }
    macro_rules! float {
        ($t:ident) => {
            impl Float for $t {
                fn is_nan(self) -> bool {
                    $t::is_nan(self)
                }
                fn nan() -> Self {
                    $t::NAN
                }
                fn count(n: usize) -> Self {
                    n as $t
                }
            }
        };
    }
    float!(f32);
    float!(f64);
}

/// The element-wise reduction of `parts` (same dtype and length, checked by the caller).
pub(crate) fn reduce(op: ReduceOp, parts: &[CpuStorage]) -> Result<CpuStorage> {
    macro_rules! slices {
        ($v:ident) => {
            parts
                .iter()
                .map(|p| match p {
                    CpuStorage::$v(x) => Ok(x.as_slice()),
                    other => bail!("reduce", "mixed dtypes: {} among {}", other.dtype(), parts[0].dtype()),
                })
                .collect::<Result<Vec<_>>>()?
        };
    }
    Ok(match &parts[0] {
        CpuStorage::F32(_) => CpuStorage::F32(float_reduce(op, &slices!(F32), |x| x)),
        CpuStorage::BF16(_) => CpuStorage::BF16(float_reduce(op, &slices!(BF16), f32::from).into_iter().map(bf16::from_f32).collect()),
        CpuStorage::F64(_) => CpuStorage::F64(float_reduce(op, &slices!(F64), |x| x)),
        CpuStorage::I32(_) => {
            let s = slices!(I32);
            let acc = match op {
                ReduceOp::Max => fold(&s, i64::from, |a, b| a.max(b)),
                ReduceOp::Sum => fold(&s, i64::from, |a, b| a + b),
                ReduceOp::Avg => bail!("reduce", "cannot average i32 tensors"),
            };
            let out: Option<Vec<i32>> = acc.into_iter().map(|a| i32::try_from(a).ok()).collect();
            CpuStorage::I32(out.ok_or_else(|| ferrolm_tensor::Error::new("reduce", "i32 sum overflows"))?)
        }
    })
}

/// The parts one after the other (all of one dtype).
pub(crate) fn concat(parts: Vec<CpuStorage>) -> CpuStorage {
    let mut it = parts.into_iter();
    let mut out = it.next().expect("at least one rank");
    for p in it {
        match (&mut out, p) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => a.extend(b),
            (CpuStorage::BF16(a), CpuStorage::BF16(b)) => a.extend(b),
            (CpuStorage::F64(a), CpuStorage::F64(b)) => a.extend(b),
            (CpuStorage::I32(a), CpuStorage::I32(b)) => a.extend(b),
            _ => unreachable!("dtypes were checked equal before the gather"),
        }
    }
    out
}

/// `s` cut into `n` equal consecutive blocks.
pub(crate) fn split(s: CpuStorage, n: usize) -> Vec<CpuStorage> {
    let len = s.len() / n;
    macro_rules! cut {
        ($v:ident, $x:expr) => {
            $x.chunks(len.max(1))
                .map(|c| CpuStorage::$v(c.to_vec()))
                .chain(std::iter::repeat_with(|| CpuStorage::$v(Vec::new())))
                .take(n)
                .collect()
        };
    }
    match s {
        CpuStorage::F32(x) => cut!(F32, x),
        CpuStorage::BF16(x) => cut!(BF16, x),
        CpuStorage::F64(x) => cut!(F64, x),
        CpuStorage::I32(x) => cut!(I32, x),
    }
}
