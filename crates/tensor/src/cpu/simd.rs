//! Vector code for the CPU kernels without giving up exactness.
//!
//! `multiversion!` compiles a kernel for AVX-512, for AVX2 and portably (SSE2 on x86-64) and
//! runs the widest the CPU has (detected once at run time). The kernels it wraps are written
//! as element-wise loops and axpy forms (`y[j] += a * x[j]`), which the compiler vectorises
//! without reordering a single floating-point operation and without fusing a multiply and an
//! add: every path computes bit for bit what the scalar loop computes. Reductions (sums, dots)
//! stay sequential unless a kernel says otherwise.
//!
//! `FastExp::fast_exp` is `exp` as a branch-free polynomial that vectorises (f32: Cody-Waite
//! range reduction and a degree-6 polynomial, within 2 ulp of the correctly rounded result
//! over the range of normal results; 0 below -87.34, where the result would be subnormal; inf
//! above 88.72 and NaN for NaN); f64 keeps the library `exp`, so the f64 gradient checks see
//! the reference function.
use num_traits::Float;

/// `exp` that the compiler can vectorise in f32; the library `exp` in f64.
pub trait FastExp: Float {
    fn fast_exp(self) -> Self;
}

impl FastExp for f64 {
    #[inline(always)]
    fn fast_exp(self) -> f64 {
        self.exp()
    }
}

impl FastExp for f32 {
    #[inline(always)]
    fn fast_exp(self) -> f32 {
        exp_f32(self)
    }
}

/// exp(x) for f32: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a polynomial, times 2^n built
/// in the exponent bits. Branch-free (selects), so a loop of it vectorises.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln2 split in a part exact in few bits and the rest (Cody-Waite).
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    const HI: f32 = 88.722_83;
    const LO: f32 = -87.336_55;
    let xc = x.clamp(LO, HI);
    let n = (xc * LOG2E + ROUND) - ROUND;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 1.666_666_5e-1) * r + 0.5;
    let e = (p * r * r + r) + 1.0;
    // n is in [-126, 128]: 2^n as 2^h * 2^(n-h), h = n/2, both normal floats (exact products).
    let ni = n as i32;
    let h = ni >> 1;
    let pow2 = |k: i32| f32::from_bits(((k + 127) as u32) << 23);
    let y = e * pow2(h) * pow2(ni - h);
    if x < LO {
        0.0
    } else if x > HI {
        f32::INFINITY
    } else if x.is_nan() {
        x
    } else {
        y
    }
}

/// The vector unit the kernels run on: 2 AVX-512 (F, VL, BW, DQ), 1 AVX2 + FMA, 0 neither (or
/// `FERROLM_CPU_SIMD=portable`), detected once.
pub fn level() -> u8 {
    #[cfg(target_arch = "x86_64")]
    {
        static L: std::sync::OnceLock<u8> = std::sync::OnceLock::new();
        *L.get_or_init(|| {
            if std::env::var("FERROLM_CPU_SIMD").is_ok_and(|v| v == "portable") {
                0
            } else if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512dq")
            {
                2
            } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                1
            } else {
                0
            }
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        0
    }
}

/// The vector width the CPU kernels run at: "avx512", "avx2" or "portable" (`FERROLM_CPU_SIMD=
/// portable` forces the last, for checking that the paths agree).
pub fn simd_level() -> &'static str {
    match level() {
        2 => "avx512",
        1 => "avx2",
        _ => "portable",
    }
}

/// Defines `fn NAME<GENERICS>(ARGS) -> RET BODY` compiled three times: for AVX-512, for AVX2 and
/// portable, and picks one at run time (`level()`). The body is an ordinary safe function body;
/// the helpers it calls should be `#[inline(always)]` so they are compiled inside each copy.
/// Generics go in brackets: `multiversion! { pub fn f[T: Float](x: &mut [T]) { ... } }`.
#[macro_export]
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis fn $name:ident [$($gen:tt)*] ($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name<$($gen)*>($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn inner<$($gen)*>($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,bmi1,bmi2,lzcnt,popcnt")]
            #[allow(clippy::too_many_arguments)]
            unsafe fn v512<$($gen)*>($($arg: $ty),*) $(-> $ret)? {
                inner($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma,bmi1,bmi2,lzcnt,popcnt")]
            #[allow(clippy::too_many_arguments)]
            unsafe fn v256<$($gen)*>($($arg: $ty),*) $(-> $ret)? {
                inner($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            match $crate::cpu::simd::level() {
                // SAFETY: level() detected the features each copy is compiled for.
                2 => return unsafe { v512($($arg),*) },
                1 => return unsafe { v256($($arg),*) },
                _ => {}
            }
            inner($($arg),*)
        }
    };
}

/// y[j] += a * x[j] (no fusing: the same bits on every path).
#[inline(always)]
pub fn axpy<T: Float>(y: &mut [T], a: T, x: &[T]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = *y + a * x;
    }
}

/// Lanes of the sums and maxima below: 16 partial results, combined in lane order at the end.
/// The split is part of the arithmetic (the same on every path), so it vectorises and stays
/// deterministic; it is also a shorter chain of roundings than one running sum.
const LANES: usize = 16;

/// The sum of `f(x)` over `x` in 16 interleaved lanes (see `LANES`).
#[inline(always)]
pub fn sum_map<T: Float>(x: &[T], f: impl Fn(T) -> T) -> T {
    let mut acc = [T::zero(); LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = *a + f(v);
        }
    }
    for (a, &v) in acc.iter_mut().zip(chunks.remainder()) {
        *a = *a + f(v);
    }
    acc.iter().fold(T::zero(), |s, &a| s + a)
}

/// `d[j] = f(x[j])`, returning the sum of the `d[j]` in the lanes and order of `sum_map`, so
/// the sum is bit for bit `sum_map(x, f)`.
#[inline(always)]
pub fn map_into_sum<T: Float>(d: &mut [T], x: &[T], f: impl Fn(T) -> T) -> T {
    assert_eq!(d.len(), x.len(), "map_into_sum: output and input lengths differ");
    let mut acc = [T::zero(); LANES];
    let (mut dc, mut xc) = (d.chunks_exact_mut(LANES), x.chunks_exact(LANES));
    for (o, c) in (&mut dc).zip(&mut xc) {
        for ((a, o), &v) in acc.iter_mut().zip(o.iter_mut()).zip(c) {
            *o = f(v);
            *a = *a + *o;
        }
    }
    for ((a, o), &v) in acc.iter_mut().zip(dc.into_remainder()).zip(xc.remainder()) {
        *o = f(v);
        *a = *a + *o;
    }
    acc.iter().fold(T::zero(), |s, &a| s + a)
}

/// `x[j] = f(x[j])` in place, returning the sum of the new values in the lanes and order of
/// `sum_map`, so the sum is bit for bit `map_into_sum` into another buffer.
#[inline(always)]
pub fn map_in_place_sum<T: Float>(x: &mut [T], f: impl Fn(T) -> T) -> T {
    let mut acc = [T::zero(); LANES];
    let mut xc = x.chunks_exact_mut(LANES);
    for c in &mut xc {
        for (a, o) in acc.iter_mut().zip(c.iter_mut()) {
            *o = f(*o);
            *a = *a + *o;
        }
    }
    for (a, o) in acc.iter_mut().zip(xc.into_remainder()) {
        *o = f(*o);
        *a = *a + *o;
    }
    acc.iter().fold(T::zero(), |s, &a| s + a)
}
/// The largest element (-inf for none; NaN elements are skipped, as `Float::max` does).
#[inline(always)]
pub fn max<T: Float>(x: &[T]) -> T {
    let mut acc = [T::neg_infinity(); LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = a.max(v);
        }
    }
    for (a, &v) in acc.iter_mut().zip(chunks.remainder()) {
        *a = a.max(v);
    }
    acc.iter().fold(T::neg_infinity(), |s, &a| s.max(a))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Within 2 ulp of the f64 exp rounded to f32 over the whole range, exact at the edges.
    #[test]
    fn exp_f32_matches_the_library() {
        let mut worst = 0u32;
        let mut x = -87.0f32;
        while x < 88.5 {
            for v in [x, x + 1e-3, -x * 1e-3] {
                let want = (v as f64).exp() as f32;
                let got = exp_f32(v);
                let ulp = (want.to_bits() as i64 - got.to_bits() as i64).unsigned_abs() as u32;
                assert!(ulp <= 2, "exp({v}) = {got}, want {want} ({ulp} ulp)");
                worst = worst.max(ulp);
            }
            x += 0.0137;
        }
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(-100.0), 0.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(100.0), f32::INFINITY);
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(worst <= 2);
    }

    crate::multiversion! {
        fn exp_axpy[](y: &mut [f32], x: &[f32]) {
            for (y, &x) in y.iter_mut().zip(x) {
                *y = exp_f32(x);
            }
            axpy(y, 0.3, x);
            let (s, m) = (sum_map(x, |v| v * v), max(x));
            y[0] = s;
            y[1] = m;
        }
    }

    /// The dispatched (vector) build of a kernel computes the same bits as plain scalar code.
    #[test]
    fn vector_paths_agree_bitwise() {
        let x: Vec<f32> = (0..1003).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.173).collect();
        let mut fast = vec![0f32; x.len()];
        exp_axpy(&mut fast, &x);
        let mut plain: Vec<f32> = x.iter().map(|&v| exp_f32(v) + 0.3 * v).collect();
        let mut lanes = [0f32; LANES];
        for (i, &v) in x.iter().enumerate() {
            lanes[i % LANES] += v * v;
        }
        plain[0] = lanes.iter().fold(0.0, |s, &a| s + a);
        plain[1] = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        assert_eq!(fast.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), plain.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        assert!(["avx512", "avx2", "portable"].contains(&simd_level()));
    }

    /// `map_into_sum` writes f(x) and sums it bit for bit as `sum_map` does, tail included.
    #[test]
    fn map_into_sum_is_sum_map_with_its_terms_stored() {
        for len in [0usize, 1, 15, 16, 17, 1003] {
            let x: Vec<f32> = (0..len).map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.091).collect();
            let mut d = vec![f32::NAN; len];
            let s = map_into_sum(&mut d, &x, |v| exp_f32(v - 1.5));
            assert_eq!(s.to_bits(), sum_map(&x, |v| exp_f32(v - 1.5)).to_bits(), "len {len}");
            for (o, &v) in d.iter().zip(&x) {
                assert_eq!(o.to_bits(), exp_f32(v - 1.5).to_bits());
            }
        }
    }
}
