//! Finite-difference gradient checks (f64, central differences, eps = 1e-6) of the fused ops,
//! and their forward and backward against naive compositions of primitive ops.
//! Tolerance unless a test says otherwise: max |analytic - numeric| / max(1, |numeric|) < 1e-6.
mod common;
use common::*;
use ferrolm_ops::{
    bias_add, causal_attention, cross_entropy, embedding, geglu, linear_bias, rms_norm, rms_norm_offset, rope, softcap, softmax_last,
    swiglu,
};
use ferrolm_tensor::{no_grad, DType, Rng, Tensor};

#[test]
fn fused_ops_record_nothing_under_no_grad() {
    let g = &mut Rng::new(9);
    let p = param(&randn(&[3, 3], g));
    let _g = no_grad();
    let y = rms_norm(&p, &p.narrow(0, 0, 1).unwrap().squeeze(0).unwrap(), 1e-5).unwrap();
    assert!(!y.requires_grad() && y.is_leaf());
}

#[test]
fn grad_softmax() {
    let g = &mut Rng::new(6);
    gradcheck("softmax", &[randn(&[3, 4, 7], g)], |x| softmax_last(&x[0]));
    gradcheck("softmax transposed", &[randn(&[3, 7, 4], g)], |x| softmax_last(&x[0].transpose(1, 2)?));
    gradcheck("softmax 1 wide", &[randn(&[5, 1], g)], |x| softmax_last(&x[0]));
}

#[test]
fn grad_embedding() {
    let g = &mut Rng::new(7);
    let w = randn(&[7, 3], g);
    let id2 = ids(&[1, 3, 1, 0, 6, 3, 3, 2, 1, 5], &[2, 5]);
    gradcheck("embedding repeated ids", std::slice::from_ref(&w), |x| embedding(&id2, &x[0]));
    let id1 = ids(&[4, 4, 4, 0], &[4]);
    gradcheck("embedding 1-d ids", std::slice::from_ref(&w), |x| embedding(&id1, &x[0]));
    // Tied use: embedding and output projection share the weight.
    gradcheck("embedding tied", &[w], |x| embedding(&id1, &x[0])?.matmul(&x[0].t()?));
}

#[test]
fn grad_rms_norm() {
    let g = &mut Rng::new(11);
    let w = uniform(&[6], 0.5, 1.5, g);
    gradcheck("rms_norm", &[randn(&[2, 3, 6], g), w.clone()], |x| rms_norm(&x[0], &x[1], 1e-5));
    gradcheck("rms_norm transposed x", &[randn(&[6, 3], g), w.clone()], |x| rms_norm(&x[0].t()?, &x[1], 1e-5));
    gradcheck("rms_norm odd", &[randn(&[5, 7], g), uniform(&[7], 0.5, 1.5, g)], |x| rms_norm(&x[0], &x[1], 1e-2));
}

#[test]
fn grad_rope() {
    let g = &mut Rng::new(12);
    let (c, s) = rope_cos_sin(5, 4, 10000.0, DType::F64);
    gradcheck("rope t5 d4", &[randn(&[2, 3, 5, 4], g)], |x| rope(&x[0], &c, &s));
    let (c, s) = rope_cos_sin(7, 6, 10.0, DType::F64);
    gradcheck("rope t7 d6", &[randn(&[1, 2, 7, 6], g)], |x| rope(&x[0], &c, &s));
    // as a model calls it: (b, t, h, d) projections permuted to (b, h, t, d)
    gradcheck("rope permuted", &[randn(&[2, 7, 3, 6], g)], |x| rope(&x[0].permute(&[0, 2, 1, 3])?, &c, &s));
}

#[test]
fn grad_swiglu() {
    let g = &mut Rng::new(13);
    gradcheck("swiglu", &[randn(&[3, 7], g), randn(&[3, 7], g)], |x| swiglu(&x[0], &x[1]));
    gradcheck("swiglu transposed", &[randn(&[7, 3], g), randn(&[3, 7], g)], |x| swiglu(&x[0].t()?, &x[1]));
    gradcheck("swiglu same input", &[randn(&[2, 5], g)], |x| swiglu(&x[0], &x[0]));
}

/// GeGLU with the tanh GELU (Gemma 3's MLP), gate values spread over the tanh's range (±4).
#[test]
fn grad_geglu() {
    let g = &mut Rng::new(31);
    let wide = |sh: &[usize], g: &mut Rng| randn(sh, g).mul_scalar(2.0).unwrap();
    gradcheck("geglu", &[wide(&[3, 7], g), randn(&[3, 7], g)], |x| geglu(&x[0], &x[1]));
    gradcheck("geglu transposed", &[wide(&[7, 3], g), randn(&[3, 7], g)], |x| geglu(&x[0].t()?, &x[1]));
    gradcheck("geglu same input", &[wide(&[2, 5], g)], |x| geglu(&x[0], &x[0]));
}

/// The forward of gelu_tanh against its formula in f64, for large |g| too (tanh saturates: no
/// NaN from exp overflowing), and GeGLU differs from SwiGLU (the activation is honoured).
#[test]
fn geglu_is_the_tanh_gelu() {
    let gv: [f64; 10] = [-30.0, -5.0, -1.5, -0.3, 0.0, 1e-4, 0.7, 2.0, 6.0, 40.0];
    let gate = Tensor::from_vec(gv.to_vec(), [gv.len()], CPU).unwrap();
    let up = Tensor::from_vec(vec![1.5; gv.len()], [gv.len()], CPU).unwrap();
    let y = geglu(&gate, &up).unwrap().to_vec::<f64>().unwrap();
    let k = (2.0 / std::f64::consts::PI).sqrt();
    let want: Vec<f64> = gv.iter().map(|&g| 0.5 * g * (1.0 + (k * (g + 0.044715 * g * g * g)).tanh()) * 1.5).collect();
    close("gelu_tanh formula", &y, &want);
    let s = swiglu(&gate, &up).unwrap().to_vec::<f64>().unwrap();
    assert!(s.iter().zip(&y).any(|(a, b)| (a - b).abs() > 1e-3), "geglu computed silu");
}

/// Gemma's RMSNorm, x · r · (1 + w): against finite differences and a composition of primitives;
/// offset 0 is `rms_norm` bit for bit.
#[test]
fn grad_rms_norm_offset() {
    let g = &mut Rng::new(32);
    let w = randn(&[6], g).mul_scalar(0.3).unwrap();
    gradcheck("rms_norm (1 + w)", &[randn(&[2, 3, 6], g), w.clone()], |x| rms_norm_offset(&x[0], &x[1], 1e-6, 1.0));
    gradcheck("rms_norm (1 + w) transposed x", &[randn(&[6, 3], g), w.clone()], |x| rms_norm_offset(&x[0].t()?, &x[1], 1e-6, 1.0));
    let x = randn(&[4, 6], g);
    let y = rms_norm_offset(&x, &w, 1e-6, 1.0).unwrap().to_vec::<f64>().unwrap();
    let want = naive_rms_norm(&x, &w.add_scalar(1.0).unwrap(), 1e-6).unwrap().to_vec::<f64>().unwrap();
    close("rms_norm (1 + w) vs x * rsqrt(mean(x^2) + eps) * (1 + w)", &y, &want);
    let (a, b) = (rms_norm_offset(&x, &w, 1e-6, 0.0).unwrap(), rms_norm(&x, &w, 1e-6).unwrap());
    assert_eq!(a.to_vec::<f64>().unwrap(), b.to_vec::<f64>().unwrap(), "offset 0 differs from rms_norm");
    expect_err(rms_norm_offset(&x, &w, 1e-6, f64::NAN), "rms_norm", "offset must be finite");
}

/// QK-norm (Qwen3, Gemma 3): RMSNorm over the head dim of q or k, (B, T, H, D) as projected, or
/// the (B, H, T, D) view of that memory, weight [D]; dw sums over every B·T·H row.
#[test]
fn grad_qk_norm() {
    let g = &mut Rng::new(33);
    let w = uniform(&[4], 0.5, 1.5, g);
    gradcheck("qk-norm (b, t, h, d)", &[randn(&[2, 3, 2, 4], g), w.clone()], |x| rms_norm(&x[0], &x[1], 1e-6));
    gradcheck("qk-norm (b, h, t, d) view", &[randn(&[2, 3, 2, 4], g), w.clone()], |x| rms_norm(&x[0].permute(&[0, 2, 1, 3])?, &x[1], 1e-6));
    gradcheck("qk-norm (1 + w) odd d", &[randn(&[1, 3, 2, 5], g), randn(&[5], g)], |x| rms_norm_offset(&x[0], &x[1], 1e-6, 1.0));
    // The same rows in either layout: the same values, moved.
    let x = randn(&[2, 5, 3, 8], g);
    let w = randn(&[8], g);
    let a = rms_norm(&x, &w, 1e-6).unwrap().permute(&[0, 2, 1, 3]).unwrap().contiguous().unwrap();
    let b = rms_norm(&x.permute(&[0, 2, 1, 3]).unwrap(), &w, 1e-6).unwrap();
    assert_eq!(a.to_vec::<f64>().unwrap(), b.contiguous().unwrap().to_vec::<f64>().unwrap(), "qk-norm depends on the head layout");
}

/// Logit softcapping, cap · tanh(x / cap), from inside the cap to well past it.
#[test]
fn grad_softcap() {
    let g = &mut Rng::new(34);
    let x = randn(&[4, 9], g).mul_scalar(20.0).unwrap();
    gradcheck("softcap 30", std::slice::from_ref(&x), |x| softcap(&x[0], 30.0));
    gradcheck("softcap 5 transposed", std::slice::from_ref(&x), |x| softcap(&x[0].t()?, 5.0));
    let xs: [f64; 7] = [-1e4, -50.0, -3.0, 0.0, 2.5, 49.0, 1e4];
    let t = Tensor::from_vec(xs.to_vec(), [xs.len()], CPU).unwrap();
    let y = softcap(&t, 50.0).unwrap().to_vec::<f64>().unwrap();
    let want: Vec<f64> = xs.iter().map(|&v| 50.0 * (v / 50.0).tanh()).collect();
    close("softcap formula", &y, &want);
    expect_err(softcap(&t, 0.0), "softcap", "positive finite");
    expect_err(softcap(&t, f64::INFINITY), "softcap", "positive finite");
}

/// The bias of a projection: y = x Wᵀ + b, db = Σ_rows dy, over 3-d activations.
#[test]
fn grad_bias() {
    let g = &mut Rng::new(35);
    gradcheck("bias_add", &[randn(&[2, 3, 5], g), randn(&[5], g)], |x| bias_add(&x[0], &x[1]));
    gradcheck("bias_add transposed x", &[randn(&[5, 3], g), randn(&[5], g)], |x| bias_add(&x[0].t()?, &x[1]));
    gradcheck("linear_bias", &[randn(&[2, 3, 4], g), randn(&[6, 4], g), randn(&[6], g)], |x| linear_bias(&x[0], &x[1], &x[2]));
    let (x, w, b) = (randn(&[3, 4], g), randn(&[5, 4], g), randn(&[5], g));
    let y = linear_bias(&x, &w, &b).unwrap().to_vec::<f64>().unwrap();
    let want = x.matmul(&w.t().unwrap()).unwrap().add(&b.unsqueeze(0).unwrap()).unwrap().to_vec::<f64>().unwrap();
    close("linear_bias vs x W^T + b", &y, &want);
    expect_err(bias_add(&x, &randn(&[3], g)), "bias_add", "does not match");
}

#[test]
fn grad_causal_attention() {
    let g = &mut Rng::new(14);
    // (b, hq, hkv, t, d)
    for (b, hq, hkv, t, d) in [(2, 4, 2, 5, 4), (1, 2, 2, 7, 6), (1, 4, 2, 7, 6), (2, 3, 1, 5, 4), (1, 4, 4, 1, 4)] {
        let scale = 1.0 / (d as f64).sqrt();
        let ins = [randn(&[b, hq, t, d], g), randn(&[b, hkv, t, d], g), randn(&[b, hkv, t, d], g)];
        gradcheck(&format!("attention b{b} hq{hq} hkv{hkv} t{t} d{d}"), &ins, |x| causal_attention(&x[0], &x[1], &x[2], scale));
    }
    // (b, t, h, d) inputs permuted to (b, h, t, d), as a model produces them
    let ins = [randn(&[1, 5, 4, 6], g), randn(&[1, 5, 2, 6], g), randn(&[1, 5, 2, 6], g)];
    gradcheck("attention permuted inputs", &ins, |x| {
        let p = |t: &Tensor| t.permute(&[0, 2, 1, 3]);
        causal_attention(&p(&x[0])?, &p(&x[1])?, &p(&x[2])?, 0.3)
    });
}

#[test]
fn grad_cross_entropy() {
    let g = &mut Rng::new(15);
    let t = ids(&[2, -100, 0, 4, -100, 1], &[6]);
    gradcheck("cross_entropy ignore", &[randn(&[6, 5], g)], |x| cross_entropy(&x[0], &t, -100));
    let t2 = ids(&[0, 6, 3], &[3]);
    gradcheck("cross_entropy transposed logits", &[randn(&[7, 3], g)], |x| cross_entropy(&x[0].t()?, &t2, -100));
    // Everything ignored: loss 0, zero gradient (no NaN from 0/0).
    let none = ids(&[-100, -100], &[2]);
    let x = param(&randn(&[2, 3], g));
    let l = cross_entropy(&x, &none, -100).unwrap();
    assert_eq!(l.item().unwrap(), 0.0);
    l.backward().unwrap();
    assert!(x.grad().unwrap().to_vec::<f64>().unwrap().iter().all(|&v| v == 0.0));
}

/// A whole pre-norm block in f64 (norm, q/k/v/o, RoPE, GQA attention, SwiGLU MLP, residuals,
/// tied-embedding logits, cross-entropy): every parameter's gradient against finite differences.
#[test]
fn grad_transformer_block() {
    let g = &mut Rng::new(16);
    let (t, dm, hq, hkv, hd, ff, vocab) = (5, 8, 2, 1, 4, 6, 7);
    let (c, s) = rope_cos_sin(t, hd, 100.0, DType::F64);
    let tok = ids(&[1, 4, 4, 0, 6], &[1, t]);
    let tgt = ids(&[4, 4, 0, -100, 2], &[t]);
    let sc = |sh: &[usize], g: &mut Rng| randn(sh, g).mul_scalar(0.4).unwrap();
    let params = [
        sc(&[vocab, dm], g),
        uniform(&[dm], 0.5, 1.5, g),
        sc(&[hq * hd, dm], g),
        sc(&[hkv * hd, dm], g),
        sc(&[hkv * hd, dm], g),
        sc(&[dm, hq * hd], g),
        uniform(&[dm], 0.5, 1.5, g),
        sc(&[ff, dm], g),
        sc(&[ff, dm], g),
        sc(&[dm, ff], g),
    ];
    gradcheck("transformer block", &params, |p| {
        let x = embedding(&tok, &p[0])?; // (1, t, dm)
        let h = rms_norm(&x, &p[1], 1e-5)?;
        let heads = |w: &Tensor, n: usize| h.matmul(&w.t()?)?.reshape([1, t, n, hd])?.permute(&[0, 2, 1, 3]);
        let q = rope(&heads(&p[2], hq)?, &c, &s)?;
        let k = rope(&heads(&p[3], hkv)?, &c, &s)?;
        let v = heads(&p[4], hkv)?;
        let a = causal_attention(&q, &k, &v, 0.5)?.permute(&[0, 2, 1, 3])?.reshape([1, t, hq * hd])?;
        let x = x.add(&a.matmul(&p[5].t()?)?)?;
        let h = rms_norm(&x, &p[6], 1e-5)?;
        let m = swiglu(&h.matmul(&p[7].t()?)?, &h.matmul(&p[8].t()?)?)?.matmul(&p[9].t()?)?;
        let x = x.add(&m)?;
        let logits = x.reshape([t, dm])?.matmul(&p[0].t()?)?;
        cross_entropy(&logits, &tgt, -100)
    });
}

// ---- fused forward (and backward) against naive compositions, f64 -------------------------

fn assert_close(name: &str, a: &Tensor, b: &Tensor, tol: f64) {
    assert_eq!(a.dims(), b.dims(), "{name}: shapes");
    let e = rel_err(&a.to_vec_f64().unwrap(), &b.to_vec_f64().unwrap());
    assert!(e < tol, "{name}: max rel err {e:e} >= {tol:e}");
}

/// Runs `fused` and `naive` on fresh leaves of the same values: outputs and input gradients agree
/// to 1e-12 (forward) and 1e-10 (backward), relative as in `rel_err`.
fn fused_vs_naive(
    name: &str,
    inputs: &[Tensor],
    fused: impl Fn(&[Tensor]) -> ferrolm_tensor::Result<Tensor>,
    naive: impl Fn(&[Tensor]) -> ferrolm_tensor::Result<Tensor>,
) {
    let leaves =
        || -> Vec<Tensor> { inputs.iter().map(|t| param(&t.contiguous().unwrap().detach().to_dtype(DType::F64).unwrap())).collect() };
    let (xa, xb) = (leaves(), leaves());
    let (ya, yb) = (fused(&xa).unwrap(), naive(&xb).unwrap());
    assert_close(&format!("{name} forward"), &ya, &yb, 1e-12);
    let w = Tensor::randn(ya.dims().to_vec(), 1.0, DType::F64, CPU, &mut Rng::new(99)).unwrap();
    ya.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    yb.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    for (i, (a, b)) in xa.iter().zip(&xb).enumerate() {
        assert_close(&format!("{name} grad {i}"), &a.grad().unwrap(), &b.grad().unwrap(), 1e-10);
    }
}

#[test]
fn fused_attention_matches_naive() {
    let g = &mut Rng::new(20);
    // t = 150: three blocks of query rows on the CPU (64, 64, 22), the last one partial.
    for (b, hq, hkv, t, d) in [(2, 4, 2, 5, 4), (1, 3, 3, 7, 6), (1, 8, 2, 9, 8), (2, 2, 1, 16, 4), (1, 4, 2, 150, 8)] {
        let ins = [randn(&[b, hq, t, d], g), randn(&[b, hkv, t, d], g), randn(&[b, hkv, t, d], g)];
        let sc = 1.0 / (d as f64).sqrt();
        fused_vs_naive(
            &format!("attention {b} {hq} {hkv} {t} {d}"),
            &ins,
            |x| causal_attention(&x[0], &x[1], &x[2], sc),
            |x| naive_attention(&x[0], &x[1], &x[2], sc),
        );
    }
}

#[test]
fn fused_rms_norm_matches_naive() {
    let g = &mut Rng::new(21);
    let ins = [randn(&[3, 4, 10], g), uniform(&[10], 0.5, 1.5, g)];
    fused_vs_naive("rms_norm", &ins, |x| rms_norm(&x[0], &x[1], 1e-6), |x| naive_rms_norm(&x[0], &x[1], 1e-6));
}

#[test]
fn fused_swiglu_matches_naive() {
    let g = &mut Rng::new(22);
    let ins = [randn(&[4, 9], g), randn(&[4, 9], g)];
    fused_vs_naive("swiglu", &ins, |x| swiglu(&x[0], &x[1]), |x| x[0].silu()?.mul(&x[1]));
}

/// The loss as the backward's root (incoming gradient exactly 1: the CPU hands back the gradient
/// its forward computed) and under a scaled root, against the naive form; without grad the
/// loss is the same value.
#[test]
fn cross_entropy_root_gradient_matches_naive() {
    let g = &mut Rng::new(24);
    let tv = [4, -100, 0, 9, 2];
    let t = ids(&tv, &[5]);
    let x0 = randn(&[5, 10], g).mul_scalar(2.0).unwrap();
    // f64 against the naive form in f64; f32 (its own storage arm of the in-place scaling)
    // against the same f64 reference at f32's precision.
    for (dt, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-6)] {
        for root_scale in [1.0, 0.25] {
            // Fresh leaves each time (`param` of the same tensor twice would be one leaf, and
            // its gradient compared with itself).
            let (xa, xb) = (param(&x0.detach().to_dtype(dt).unwrap()), param(&x0.detach()));
            let la = cross_entropy(&xa, &t, -100).unwrap();
            let lb = naive_cross_entropy(&xb, &tv, -100).unwrap();
            assert_close(&format!("cross_entropy root loss {dt:?}"), &la, &lb, tol);
            la.mul_scalar(root_scale).unwrap().backward().unwrap();
            lb.mul_scalar(root_scale).unwrap().backward().unwrap();
            let name = format!("cross_entropy root grad {dt:?} x{root_scale}");
            assert_close(&name, &xa.grad().unwrap(), &xb.grad().unwrap(), tol);
        }
    }
    // The CPU hands its gradient to the one backward; a second one through the same loss is
    // refused by name instead of returning a stale or missing gradient.
    let xd = param(&x0.detach());
    let ld = cross_entropy(&xd, &t, -100).unwrap();
    ld.backward().unwrap();
    let err = ld.backward().expect_err("a second backward through one CPU loss").to_string();
    assert!(err.contains("cross_entropy") && err.contains("twice"), "{err}");
    let _g = no_grad();
    let lc = cross_entropy(&x0, &t, -100).unwrap();
    assert_close("cross_entropy without grad", &lc, &naive_cross_entropy(&x0, &tv, -100).unwrap(), 1e-12);
}

#[test]
fn fused_cross_entropy_matches_naive() {
    let g = &mut Rng::new(23);
    let tv = [3, -100, 0, 10, 5, -100, 7];
    let t = ids(&tv, &[7]);
    let ins = [randn(&[7, 11], g).mul_scalar(3.0).unwrap()];
    fused_vs_naive("cross_entropy", &ins, |x| cross_entropy(&x[0], &t, -100), |x| naive_cross_entropy(&x[0], &tv, -100));
    // other ignore index; large logits stay finite (log-sum-exp is shifted)
    let tv = [1, 2, 0];
    let t = ids(&tv, &[3]);
    let big = randn(&[3, 4], g).mul_scalar(300.0).unwrap();
    let l = cross_entropy(&big, &t, 2).unwrap().item().unwrap();
    assert!(l.is_finite());
    let lv = big.to_vec::<f64>().unwrap();
    let mut want = 0.0;
    for (r, &tg) in tv.iter().enumerate().filter(|(_, &tg)| tg != 2) {
        let row = &lv[r * 4..r * 4 + 4];
        let m = row.iter().cloned().fold(f64::MIN, f64::max);
        want += m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln() - row[tg as usize];
    }
    want /= 2.0;
    assert!((l - want).abs() < 1e-9 * want.abs().max(1.0), "{l} vs {want}");
}

#[test]
fn fused_rope_matches_formula() {
    let g = &mut Rng::new(24);
    for (dims, theta) in [([2, 3, 5, 4], 10000.0), ([1, 2, 7, 6], 10.0), ([1, 1, 16, 8], 500000.0)] {
        let x = randn(&dims, g);
        let (c, s) = rope_cos_sin(dims[2], dims[3], theta, DType::F64);
        let y = rope(&x, &c, &s).unwrap().to_vec::<f64>().unwrap();
        let want = naive_rope(&x.to_vec::<f64>().unwrap(), dims, theta);
        let e = rel_err(&y, &want);
        assert!(e < 1e-12, "rope {dims:?}: {e:e}");
        // rotation keeps the norm of each (x_j, x_{j+d/2}) pair, so the whole norm
        let n = |v: &[f64]| v.iter().map(|a| a * a).sum::<f64>();
        assert!((n(&y) - n(&x.to_vec::<f64>().unwrap())).abs() < 1e-9);
    }
}

#[test]
fn fused_embedding_matches_rows() {
    let g = &mut Rng::new(25);
    let w = randn(&[6, 3], g);
    let idv = [5, 0, 5, 2];
    let y = embedding(&ids(&idv, &[2, 2]), &w).unwrap();
    assert_eq!(y.dims(), &[2, 2, 3]);
    let wv = w.to_vec::<f64>().unwrap();
    let want: Vec<f64> = idv.iter().flat_map(|&i| wv[i as usize * 3..i as usize * 3 + 3].to_vec()).collect();
    assert_eq!(y.to_vec::<f64>().unwrap(), want);
}
