//! The model families' element-wise ops against PyTorch (transformers 5.23, torch 2.15): GeGLU
//! with the tanh GELU (`F.gelu(approximate="tanh")`), Gemma's RMSNorm (transformers' own
//! `Gemma3RMSNorm`, (1 + w) in f32 and one cast at the end), logit softcapping and a linear layer
//! with a bias (`F.linear`), forward and every gradient, in f32 and bf16. The reference is
//! tests/fixtures/model_ops.txt, made by scripts/make_ops_fixtures.py (CI has no Python).
//! Tolerances: f32 |d| <= 2e-6 + 2e-5 |ref|; bf16 |d| <= 1e-2 + 1e-2 |ref| (PyTorch rounds each
//! op's result to bf16, the fused op rounds once, so they may differ by an ulp or two).
mod common;
use common::*;
use ferrolm_ops::{geglu, linear_bias, rms_norm_offset, softcap};
use ferrolm_tensor::{DType, Tensor};
use std::collections::HashMap;
use std::path::Path;

/// name -> (dims, values) of the fixture file.
fn fixtures() -> HashMap<String, (Vec<usize>, Vec<f64>)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/model_ops.txt");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e} (made by scripts/make_ops_fixtures.py)", path.display()));
    text.lines()
        .map(|line| {
            let mut it = line.split_whitespace();
            let name = it.next().expect("a name").to_string();
            let dims = it.next().expect("dims").split(',').map(|d| d.parse().expect("a dim")).collect();
            let vals = it.map(|v| v.parse().unwrap_or_else(|e| panic!("{name}: {v}: {e}"))).collect();
            (name, (dims, vals))
        })
        .collect()
}

struct Case {
    all: HashMap<String, (Vec<usize>, Vec<f64>)>,
    prefix: String,
    dt: DType,
}

impl Case {
    fn get(&self, t: &str) -> &(Vec<usize>, Vec<f64>) {
        let key = format!("{}.{t}", self.prefix);
        self.all.get(&key).unwrap_or_else(|| panic!("{key} is not in the fixture"))
    }
    /// The fixture tensor `t` in the case's dtype, a leaf that records its gradient.
    fn leaf(&self, t: &str) -> Tensor {
        let (dims, v) = self.get(t);
        let x = Tensor::from_vec(v.clone(), dims.clone(), CPU).unwrap().to_dtype(self.dt).unwrap();
        param(&x)
    }
    fn expect(&self, what: &str, got: &Tensor) {
        let (dims, want) = self.get(what);
        assert_eq!(got.dims(), &dims[..], "{}.{what}: shape", self.prefix);
        assert_eq!(got.dtype(), self.dt, "{}.{what}: dtype", self.prefix);
        let got = got.to_vec_f64().unwrap();
        let (at, rt) = if self.dt == DType::BF16 { (1e-2, 1e-2) } else { (2e-6, 2e-5) };
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= at + rt * w.abs(), "{}.{what}[{i}]: ferrolm {g} vs torch {w}", self.prefix);
        }
    }
}

/// Runs `f` for the f32 and the bf16 case of `op`.
fn each(op: &str, f: impl Fn(&Case)) {
    let all = fixtures();
    for (name, dt) in [("f32", DType::F32), ("bf16", DType::BF16)] {
        f(&Case { all: all.clone(), prefix: format!("{op}.{name}"), dt });
    }
}

fn backward(y: &Tensor, dy: &Tensor) {
    y.mul(dy).unwrap().sum_all().unwrap().backward().unwrap();
}

#[test]
fn geglu_matches_torch_gelu_tanh() {
    each("geglu", |c| {
        let (g, u, dy) = (c.leaf("gate"), c.leaf("up"), c.leaf("dy").detach());
        let y = geglu(&g, &u).unwrap();
        c.expect("y", &y);
        backward(&y, &dy);
        c.expect("dgate", &g.grad().unwrap());
        c.expect("dup", &u.grad().unwrap());
    });
}

#[test]
fn rms_norm_offset_matches_gemma3_rmsnorm() {
    each("gemma_rms", |c| {
        let (x, w, dy) = (c.leaf("x"), c.leaf("w"), c.leaf("dy").detach());
        let y = rms_norm_offset(&x, &w, 1e-6, 1.0).unwrap();
        c.expect("y", &y);
        backward(&y, &dy);
        c.expect("dx", &x.grad().unwrap());
        c.expect("dw", &w.grad().unwrap());
    });
}

#[test]
fn softcap_matches_torch() {
    each("softcap", |c| {
        let (x, dy) = (c.leaf("x"), c.leaf("dy").detach());
        let y = softcap(&x, 30.0).unwrap();
        c.expect("y", &y);
        backward(&y, &dy);
        c.expect("dx", &x.grad().unwrap());
    });
}

#[test]
fn linear_bias_matches_torch_linear() {
    each("linear", |c| {
        let (x, w, b, dy) = (c.leaf("x"), c.leaf("w"), c.leaf("b"), c.leaf("dy").detach());
        let y = linear_bias(&x, &w, &b).unwrap();
        c.expect("y", &y);
        backward(&y, &dy);
        c.expect("dx", &x.grad().unwrap());
        c.expect("dw", &w.grad().unwrap());
        c.expect("db", &b.grad().unwrap());
    });
}
