//! Tolerances by dtype and the relative errors the tests compare with.
use ferrolm_tensor::{DType, Tensor};

/// Relative tolerance of a result computed in `dt` against an exact reference of the same
/// inputs: f64 1e-12 (plain loops in another order), f32 1e-5 (sums of O(100) terms in another
/// order), bf16 1e-2 (an 8-bit mantissa rounds each op's result to 2^-8); i32 must be exact.
pub fn rel_tol(dt: DType) -> f64 {
    match dt {
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        DType::BF16 => 1e-2,
        DType::I32 => 0.0,
    }
}

/// (absolute, relative) tolerance of a device's result against the CPU's for the same inputs in
/// the same dtype, element by element (|device - cpu| <= atol + rtol |cpu|): bf16 2e-2 (two
/// roundings that may differ by one step); f32 1e-4, or 1e-3 when `loose` (results through
/// several ops or long reductions summed in another order).
pub fn device_tol(dt: DType, loose: bool) -> (f64, f64) {
    match (dt, loose) {
        (DType::BF16, _) => (2e-2, 2e-2),
        (_, true) => (1e-3, 1e-3),
        _ => (1e-4, 1e-4),
    }
}

/// max |a - b| / max |b| (at least 1e-30): an f32 result against another order of its sums.
pub fn max_rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "max_rel: lengths differ");
    let d = a.iter().zip(b).map(|(x, y)| (x - y).abs() as f64).fold(0.0, f64::max);
    d / b.iter().map(|y| y.abs() as f64).fold(1e-30, f64::max)
}

/// max |a - b| / max |b| (at least 1e-30) over two tensors of one shape, in f64.
pub fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims(), "rel_err: shapes differ");
    let (a, b) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    let diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    let scale = b.iter().map(|y| y.abs()).fold(0.0, f64::max);
    diff / scale.max(1e-30)
}

/// Panics, naming `what` and the first element that differs, unless `a` and `b` are the same
/// bit for bit (as f64 values: -0 equals 0, NaN equals nothing).
#[track_caller]
pub fn assert_same(what: &str, a: &[f64], b: &[f64]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    if let Some(i) = (0..a.len()).find(|&i| a[i] != b[i]) {
        panic!("{what}: element {i} differs: {} vs {}", a[i], b[i]);
    }
}

/// Panics, naming `what`, unless max |a - b| / max |b| (at least 1e-30) is at most `tol`.
#[track_caller]
pub fn assert_near(what: &str, a: &[f64], b: &[f64], tol: f64) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f64, f64::max) / scale;
    assert!(worst <= tol, "{what}: max |difference| / max |reference| = {worst:e} > {tol:e}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrolm_tensor::Device;

    #[test]
    fn tolerances_widen_with_the_mantissa() {
        assert!(rel_tol(DType::F64) < rel_tol(DType::F32) && rel_tol(DType::F32) < rel_tol(DType::BF16));
        assert_eq!((rel_tol(DType::F32), rel_tol(DType::BF16)), (1e-5, 1e-2));
        assert_eq!(device_tol(DType::F32, false), (1e-4, 1e-4));
        assert_eq!(device_tol(DType::F32, true), (1e-3, 1e-3));
        assert_eq!(device_tol(DType::BF16, false), (2e-2, 2e-2));
    }

    #[test]
    fn relative_errors_are_to_the_largest_reference_element() {
        assert_eq!(max_rel(&[1.0, 2.5], &[1.0, 2.0]), 0.25);
        assert_eq!(max_rel(&[0.0], &[0.0]), 0.0);
        let t = |v: Vec<f64>| Tensor::from_vec(v, [2], Device::Cpu).unwrap();
        assert_eq!(rel_err(&t(vec![4.0, 1.0]), &t(vec![4.0, -2.0])), 0.75);
    }

    #[test]
    fn near_passes_at_the_tolerance_and_same_only_bitwise() {
        assert_near("at", &[1.0, 2.5], &[1.0, 2.0], 0.25);
        assert_same("equal", &[1.0, -0.0], &[1.0, 0.0]);
        let near = std::panic::catch_unwind(|| assert_near("over", &[1.0, 2.5], &[1.0, 2.0], 0.2499));
        assert!(near.unwrap_err().downcast_ref::<String>().unwrap().contains("over: max |difference| / max |reference| = 2.5e-1"));
        let same = std::panic::catch_unwind(|| assert_same("apart", &[1.0, 2.0], &[1.0, 2.0 + f64::EPSILON * 2.0]));
        assert!(same.unwrap_err().downcast_ref::<String>().unwrap().starts_with("apart: element 1 differs"));
    }
}
