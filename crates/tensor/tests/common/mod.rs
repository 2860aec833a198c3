//! Helpers shared by the engine's integration tests: random tensors, a finite-difference
//! gradient checker, RoPE tables, and naive compositions the fused ops are compared against.
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

/// Hugging Face rotate_half tables: inv_freq_i = theta^(-2i/d), angle = pos * inv_freq,
/// emb = cat(angles, angles); returns (cos, sin), each (t, d) row-major.
pub fn rope_tables(t: usize, d: usize, theta: f64) -> (Vec<f64>, Vec<f64>) {
    let h = d / 2;
    let (mut c, mut s) = (vec![0.0; t * d], vec![0.0; t * d]);
    for p in 0..t {
        for j in 0..d {
            let inv = theta.powf(-2.0 * (j % h) as f64 / d as f64);
            let a = p as f64 * inv;
            c[p * d + j] = a.cos();
            s[p * d + j] = a.sin();
        }
    }
    (c, s)
}
pub fn rope_cos_sin(t: usize, d: usize, theta: f64, dt: DType) -> (Tensor, Tensor) {
    let (c, s) = rope_tables(t, d, theta);
    (Tensor::from_vec(c, [t, d], CPU).unwrap().to_dtype(dt).unwrap(), Tensor::from_vec(s, [t, d], CPU).unwrap().to_dtype(dt).unwrap())
}

/// softmax(Q K^T * scale + causal mask) V with the K/V heads expanded to the query heads.
pub fn naive_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let (b, hq, t, d) = (q.dim(0), q.dim(1), q.dim(2), q.dim(3));
    let hkv = k.dim(1);
    let group = hq / hkv;
    let expand = |x: &Tensor| -> Result<Tensor> { x.unsqueeze(2)?.broadcast_as([b, hkv, group, t, d])?.reshape([b, hq, t, d]) };
    let (k, v) = (expand(k)?, expand(v)?);
    let s = q.matmul(&k.t()?)?.mul_scalar(scale)?;
    let mask: Vec<f64> = (0..t * t).map(|ij| if ij % t > ij / t { -1e30 } else { 0.0 }).collect();
    let mask = Tensor::from_vec(mask, [t, t], CPU)?.to_dtype(q.dtype())?;
    s.add(&mask)?.softmax_last()?.matmul(&v)
}

/// x * rsqrt(mean(x^2) + eps) * w over the last dim.
pub fn naive_rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let last = x.rank() - 1;
    x.mul(&x.sqr()?.mean(&[last], true)?.add_scalar(eps)?.rsqrt()?)?.mul(w)
}

/// mean over non-ignored rows of -log softmax(logits)[target].
pub fn naive_cross_entropy(logits: &Tensor, targets: &[i32], ignore: i32) -> Result<Tensor> {
    let (n, v) = (logits.dim(0), logits.dim(1));
    let mut onehot = vec![0.0; n * v];
    let mut count = 0;
    for (r, &t) in targets.iter().enumerate() {
        if t != ignore {
            onehot[r * v + t as usize] = 1.0;
            count += 1;
        }
    }
    let onehot = Tensor::from_vec(onehot, [n, v], CPU)?.to_dtype(logits.dtype())?;
    logits.softmax_last()?.log()?.mul(&onehot)?.sum_all()?.mul_scalar(-1.0 / count.max(1) as f64)
}

/// Explicit rotary formula on x (b, h, t, d) with positions 0..t.
pub fn naive_rope(x: &[f64], dims: [usize; 4], theta: f64) -> Vec<f64> {
    let [b, h, t, d] = dims;
    let half = d / 2;
    let mut y = vec![0.0; x.len()];
    for bh in 0..b * h {
        for p in 0..t {
            let base = (bh * t + p) * d;
            for j in 0..half {
                let a = p as f64 * theta.powf(-2.0 * j as f64 / d as f64);
                let (c, s) = (a.cos(), a.sin());
                let (x1, x2) = (x[base + j], x[base + j + half]);
                y[base + j] = x1 * c - x2 * s;
                y[base + j + half] = x2 * c + x1 * s;
            }
        }
    }
    y
}
