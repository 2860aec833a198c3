//! Helpers shared by the engine's integration tests (and, through a `#[path]` module, by the
//! fused ops' tests in crates/ops): random tensors, a finite-difference gradient checker, bf16
//! against f32 comparisons and error assertions.
#![allow(dead_code)]
use ferrolm_tensor::{no_grad, DType, Device, Result, Rng, Tensor};

pub const CPU: Device = Device::Cpu;

pub fn randn(shape: &[usize], rng: &mut Rng) -> Tensor {
    Tensor::randn(shape.to_vec(), 1.0, DType::F64, CPU, rng).unwrap()
}
pub fn uniform(shape: &[usize], lo: f64, hi: f64, rng: &mut Rng) -> Tensor {
    Tensor::rand_uniform(shape.to_vec(), lo, hi, DType::F64, CPU, rng).unwrap()
}
pub fn randn_dt(shape: &[usize], dt: DType, rng: &mut Rng) -> Tensor {
    Tensor::randn(shape.to_vec(), 1.0, dt, CPU, rng).unwrap()
}
pub fn ids(v: &[i32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape.to_vec(), CPU).unwrap()
}
pub fn param(t: &Tensor) -> Tensor {
    t.set_requires_grad(true).unwrap();
    t.clone()
}

fn seed_of(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// Relative error in the sense the tests state: max_i |a_i - b_i| / max(1, |b_i|).
pub fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs().max(1.0)).fold(0.0, f64::max)
}

/// Asserts `rel_err(a, b) < 1e-12`: an f64 kernel against plain Rust loops.
#[track_caller]
pub fn close(name: &str, a: &[f64], b: &[f64]) {
    let e = rel_err(a, b);
    assert!(e < 1e-12, "{name}: {e:e}");
}

/// Default finite-difference check: central differences with eps = 1e-6 in f64 and
/// max |analytic - numeric| / max(1, |numeric|) < 1e-6 for every element of every input.
pub fn gradcheck(name: &str, inputs: &[Tensor], f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    gradcheck_with(name, inputs, 1e-6, 1e-6, f)
}

/// Checks `f`'s backward against central differences. The loss is a random weighted sum of
/// `f`'s output (so every output element's gradient matters). Each input is copied into a fresh
/// f64 leaf; its `.grad()` is compared element by element against the numeric derivative.
pub fn gradcheck_with(name: &str, inputs: &[Tensor], eps: f64, tol: f64, f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    let vals: Vec<Vec<f64>> = inputs.iter().map(|t| t.to_vec_f64().unwrap()).collect();
    let shapes: Vec<Vec<usize>> = inputs.iter().map(|t| t.dims().to_vec()).collect();
    let make = |vals: &[Vec<f64>]| -> Vec<Tensor> {
        vals.iter().zip(&shapes).map(|(v, s)| Tensor::from_vec(v.clone(), s.clone(), CPU).unwrap()).collect()
    };
    let xs = make(&vals);
    for x in &xs {
        x.set_requires_grad(true).unwrap();
    }
    let out = f(&xs).unwrap_or_else(|e| panic!("{name}: forward failed: {e}"));
    assert_eq!(out.dtype(), DType::F64, "{name}: gradcheck wants an f64 output");
    let mut rng = Rng::new(seed_of(name));
    let w = Tensor::randn(out.dims().to_vec(), 1.0, DType::F64, CPU, &mut rng).unwrap();
    let wv = w.to_vec::<f64>().unwrap();
    let loss = out.mul(&w).unwrap().sum_all().unwrap();
    loss.backward().unwrap_or_else(|e| panic!("{name}: backward failed: {e}"));

    let eval = |vals: &[Vec<f64>]| -> f64 {
        let _g = no_grad();
        let o = f(&make(vals)).unwrap().to_vec::<f64>().unwrap();
        o.iter().zip(&wv).map(|(a, b)| a * b).sum()
    };
    let mut vals = vals;
    for i in 0..xs.len() {
        let g = xs[i].grad().unwrap_or_else(|| panic!("{name}: input {i} got no gradient"));
        assert_eq!(g.dims(), xs[i].dims(), "{name}: gradient shape of input {i}");
        let analytic = g.to_vec::<f64>().unwrap();
        let mut numeric = vec![0.0; analytic.len()];
        for j in 0..numeric.len() {
            let x0 = vals[i][j];
            vals[i][j] = x0 + eps;
            let lp = eval(&vals);
            vals[i][j] = x0 - eps;
            let lm = eval(&vals);
            vals[i][j] = x0;
            numeric[j] = (lp - lm) / (2.0 * eps);
        }
        let err = rel_err(&analytic, &numeric);
        assert!(
            err < tol,
            "{name}: input {i} {:?}: max |analytic-numeric|/max(1,|numeric|) = {err:.3e} >= {tol:e}\n analytic {:?}\n numeric  {:?}",
            shapes[i],
            &analytic[..analytic.len().min(12)],
            &numeric[..numeric.len().min(12)]
        );
    }
}

/// bf16 against f32 on the same inputs: the CPU computes bf16 in f32 and rounds each op's result
/// once, so outputs of O(1) agree to 2e-2 relative (bf16 has an 8-bit mantissa); gradients, which
/// pass through several rounded ops, to 5e-2.
pub const BF16_TOL: f64 = 2e-2;
pub const BF16_GRAD_TOL: f64 = 5e-2;

/// A bf16 tensor and its exact f32 copy.
pub fn pair(shape: &[usize], g: &mut Rng) -> (Tensor, Tensor) {
    let b = randn_dt(shape, DType::BF16, g);
    let f = b.to_dtype(DType::F32).unwrap();
    (b, f)
}
pub fn pos_pair(shape: &[usize], g: &mut Rng) -> (Tensor, Tensor) {
    let b = Tensor::rand_uniform(shape.to_vec(), 0.5, 2.0, DType::BF16, CPU, g).unwrap();
    let f = b.to_dtype(DType::F32).unwrap();
    (b, f)
}

/// Runs `f` on the bf16 inputs and on their f32 copies and compares.
#[track_caller]
pub fn bf16_check(name: &str, ins: &[(Tensor, Tensor)], f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    let b: Vec<Tensor> = ins.iter().map(|p| p.0.clone()).collect();
    let x: Vec<Tensor> = ins.iter().map(|p| p.1.clone()).collect();
    let (yb, yf) = (f(&b).unwrap(), f(&x).unwrap());
    assert_eq!(yb.dims(), yf.dims(), "{name}: shape");
    assert!(yb.dtype() == DType::BF16 || yb.dtype() == DType::F32, "{name}: dtype {}", yb.dtype());
    let e = rel_err(&yb.to_vec_f64().unwrap(), &yf.to_vec_f64().unwrap());
    assert!(e < BF16_TOL, "{name}: bf16 vs f32 rel err {e:.3e} >= {BF16_TOL:e}");
}

/// Asserts `r` is an error whose Display starts with "`op`:" and contains `needle`.
#[track_caller]
pub fn expect_err<T: std::fmt::Debug>(r: Result<T>, op: &str, needle: &str) {
    let e = r.expect_err(&format!("expected an error from {op}"));
    let s = e.to_string();
    assert!(s.starts_with(&format!("{op}: ")), "error {s:?} does not name op {op:?}");
    assert_eq!(e.op, op);
    assert!(s.contains(needle), "error {s:?} does not mention {needle:?}");
}

pub fn f32s(shape: &[usize]) -> Tensor {
    Tensor::zeros(shape.to_vec(), DType::F32, CPU).unwrap()
}
