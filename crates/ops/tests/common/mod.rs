//! Helpers of the fused ops' tests: the engine's (random tensors, the finite-difference checker,
//! bf16 comparisons, error assertions) from crates/tensor/tests/common, plus RoPE tables and the
//! naive compositions of primitive ops the fused ops are compared against.
#![allow(dead_code)]
#[path = "../../../tensor/tests/common/mod.rs"]
mod engine;
pub use engine::*;
use ferrolm_ops::softmax_last;
use ferrolm_tensor::{DType, Result, Rng, Tensor};

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
    softmax_last(&s.add(&mask)?)?.matmul(&v)
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
    softmax_last(logits)?.log()?.mul(&onehot)?.sum_all()?.mul_scalar(-1.0 / count.max(1) as f64)
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

// ---- the fused head's tests (head_loss.rs, head_logprobs.rs) ----

/// The target the head tests ignore.
pub const IGNORE: i32 = -100;

/// Targets for `n` rows over `v` classes; `ignored(i)` marks the ignored rows.
pub fn targets(n: usize, v: usize, g: &mut Rng, ignored: impl Fn(usize) -> bool) -> Vec<i32> {
    (0..n).map(|i| if ignored(i) { IGNORE } else { g.below(v as u64) as i32 }).collect()
}

/// A fresh leaf: a copy of `t`'s values that requires a gradient.
pub fn leaf(t: &Tensor) -> Tensor {
    let l = t.detach().deep_copy().unwrap();
    l.set_requires_grad(true).unwrap();
    l
}

/// (the value, dX, dW) of `f` on fresh leaves of x and w, backpropagating from the value. No
/// gradient (the fused head gives W none when every target is ignored) reads as zeros.
pub fn on_leaves(x: &Tensor, w: &Tensor, f: impl Fn(&Tensor, &Tensor) -> Result<Tensor>) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (x, w) = (leaf(x), leaf(w));
    let out = f(&x, &w).unwrap();
    out.backward().unwrap();
    let grad = |t: &Tensor| t.grad().map_or_else(|| vec![0.0; t.numel()], |g| g.to_vec_f64().unwrap());
    (out.to_vec_f64().unwrap(), grad(&x), grad(&w))
}
