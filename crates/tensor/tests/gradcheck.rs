//! Finite-difference gradient checks (f64, central differences, eps = 1e-6) for every op of
//! the engine, and forward checks of the fused ops against naive compositions of basic ops.
//! Tolerance unless a test says otherwise: max |analytic - numeric| / max(1, |numeric|) < 1e-6.
mod common;
use common::*;
use ferrolm_tensor::{DType, Rng, Tensor};

#[test]
fn grad_matmul() {
    let g = &mut Rng::new(1);
    gradcheck("matmul 2d", &[randn(&[3, 5], g), randn(&[5, 4], g)], |x| x[0].matmul(&x[1]));
    gradcheck("matmul batched", &[randn(&[2, 3, 5], g), randn(&[2, 5, 7], g)], |x| x[0].matmul(&x[1]));
    gradcheck("matmul lhs^T", &[randn(&[5, 3], g), randn(&[5, 4], g)], |x| x[0].t()?.matmul(&x[1]));
    gradcheck("matmul rhs^T", &[randn(&[2, 3, 5], g), randn(&[4, 5], g)], |x| x[0].matmul(&x[1].t()?));
    gradcheck("matmul both^T batched", &[randn(&[2, 5, 3], g), randn(&[2, 4, 5], g)], |x| x[0].t()?.matmul(&x[1].t()?));
    gradcheck("matmul bcast batch", &[randn(&[2, 1, 3, 5], g), randn(&[3, 5, 4], g)], |x| x[0].matmul(&x[1]));
    gradcheck("matmul bcast both", &[randn(&[1, 3, 2, 5], g), randn(&[2, 1, 5, 3], g)], |x| x[0].matmul(&x[1]));
    gradcheck("matmul 2d lhs, batched rhs", &[randn(&[3, 5], g), randn(&[2, 5, 3], g)], |x| x[0].matmul(&x[1]));
    // The same operand twice (x @ x^T): both uses must add into one gradient.
    gradcheck("matmul x x^T", &[randn(&[3, 5], g)], |x| x[0].matmul(&x[0].t()?));
}

#[test]
fn grad_binary_broadcast() {
    let g = &mut Rng::new(2);
    let shapes: [(&[usize], &[usize]); 6] =
        [(&[3, 1, 5], &[4, 5]), (&[5], &[2, 3, 5]), (&[], &[3, 4]), (&[2, 3], &[2, 3]), (&[2, 1], &[1, 3]), (&[3, 4], &[1])];
    for (sa, sb) in shapes {
        let (a, b) = (randn(sa, g), randn(sb, g));
        let bp = uniform(sb, 0.5, 2.0, g);
        gradcheck(&format!("add {sa:?} {sb:?}"), &[a.clone(), b.clone()], |x| x[0].add(&x[1]));
        gradcheck(&format!("sub {sa:?} {sb:?}"), &[a.clone(), b.clone()], |x| x[0].sub(&x[1]));
        gradcheck(&format!("mul {sa:?} {sb:?}"), &[a.clone(), b.clone()], |x| x[0].mul(&x[1]));
        gradcheck(&format!("div {sa:?} {sb:?}"), &[a.clone(), bp.clone()], |x| x[0].div(&x[1]));
        // swapped operand order
        gradcheck(&format!("div {sb:?} {sa:?}"), &[bp, uniform(sa, 0.5, 2.0, g)], |x| x[0].div(&x[1]));
    }
    // non-contiguous operands
    gradcheck("mul transposed", &[randn(&[4, 3], g), randn(&[3, 4], g)], |x| x[0].t()?.mul(&x[1]));
    gradcheck("x*x", &[randn(&[3, 4], g)], |x| x[0].mul(&x[0]));
}

#[test]
fn grad_scalar_ops() {
    let g = &mut Rng::new(3);
    let x = randn(&[3, 5], g);
    gradcheck("affine", std::slice::from_ref(&x), |x| x[0].affine(1.7, -0.3));
    gradcheck("mul_scalar", std::slice::from_ref(&x), |x| x[0].mul_scalar(-2.5));
    gradcheck("add_scalar", std::slice::from_ref(&x), |x| x[0].add_scalar(0.7)?.sqr());
}

#[test]
fn grad_reductions() {
    let g = &mut Rng::new(4);
    let x = randn(&[3, 4, 5], g);
    let dimsets: [&[usize]; 6] = [&[0], &[1], &[2], &[0, 2], &[0, 1, 2], &[]];
    for dims in dimsets {
        for keep in [true, false] {
            gradcheck(&format!("sum {dims:?} {keep}"), std::slice::from_ref(&x), |x| x[0].sum(dims, keep));
            gradcheck(&format!("mean {dims:?} {keep}"), std::slice::from_ref(&x), |x| x[0].mean(dims, keep));
            gradcheck(&format!("max {dims:?} {keep}"), std::slice::from_ref(&x), |x| x[0].max(dims, keep));
        }
    }
    gradcheck("sum_all", std::slice::from_ref(&x), |x| x[0].sum_all());
    gradcheck("mean_all", std::slice::from_ref(&x), |x| x[0].mean_all());
    gradcheck("max of permuted", std::slice::from_ref(&x), |x| x[0].permute(&[2, 0, 1])?.max(&[1], false));
    gradcheck("sum of narrowed", std::slice::from_ref(&x), |x| x[0].narrow(2, 1, 3)?.sum(&[0, 2], true));
}

#[test]
fn grad_unary() {
    let g = &mut Rng::new(5);
    let x = randn(&[3, 7], g);
    let p = uniform(&[3, 7], 0.5, 2.0, g);
    gradcheck("exp", std::slice::from_ref(&x), |x| x[0].exp());
    gradcheck("neg", std::slice::from_ref(&x), |x| x[0].neg());
    gradcheck("sqr", std::slice::from_ref(&x), |x| x[0].sqr());
    gradcheck("silu", std::slice::from_ref(&x), |x| x[0].silu());
    gradcheck("silu transposed", std::slice::from_ref(&x), |x| x[0].t()?.silu());
    gradcheck("powf 3", std::slice::from_ref(&x), |x| x[0].powf(3.0));
    gradcheck("log", std::slice::from_ref(&p), |x| x[0].log());
    gradcheck("sqrt", std::slice::from_ref(&p), |x| x[0].sqrt());
    gradcheck("rsqrt", std::slice::from_ref(&p), |x| x[0].rsqrt());
    gradcheck("recip", std::slice::from_ref(&p), |x| x[0].recip());
    gradcheck("powf 1.7", std::slice::from_ref(&p), |x| x[0].powf(1.7));
    gradcheck("powf -0.5", std::slice::from_ref(&p), |x| x[0].powf(-0.5));
    gradcheck("exp(log) chain", std::slice::from_ref(&p), |x| x[0].log()?.mul_scalar(2.0)?.exp());
}

#[test]
fn grad_softmax() {
    let g = &mut Rng::new(6);
    gradcheck("softmax", &[randn(&[3, 4, 7], g)], |x| x[0].softmax_last());
    gradcheck("softmax transposed", &[randn(&[3, 7, 4], g)], |x| x[0].transpose(1, 2)?.softmax_last());
    gradcheck("softmax 1 wide", &[randn(&[5, 1], g)], |x| x[0].softmax_last());
}

#[test]
fn grad_embedding() {
    let g = &mut Rng::new(7);
    let w = randn(&[7, 3], g);
    let id2 = ids(&[1, 3, 1, 0, 6, 3, 3, 2, 1, 5], &[2, 5]);
    gradcheck("embedding repeated ids", std::slice::from_ref(&w), |x| Tensor::embedding(&id2, &x[0]));
    let id1 = ids(&[4, 4, 4, 0], &[4]);
    gradcheck("embedding 1-d ids", std::slice::from_ref(&w), |x| Tensor::embedding(&id1, &x[0]));
    // Tied use: embedding and output projection share the weight.
    gradcheck("embedding tied", &[w], |x| Tensor::embedding(&id1, &x[0])?.matmul(&x[0].t()?));
}

#[test]
fn grad_cat_split_stack_narrow_chunk() {
    let g = &mut Rng::new(8);
    let parts = [randn(&[2, 3, 4], g), randn(&[2, 1, 4], g), randn(&[2, 2, 4], g)];
    gradcheck("cat dim 1", &parts, |x| Tensor::cat(x, 1));
    let parts0 = [randn(&[1, 3, 4], g), randn(&[3, 3, 4], g)];
    gradcheck("cat dim 0", &parts0, |x| Tensor::cat(x, 0));
    let parts2 = [randn(&[2, 3, 1], g), randn(&[2, 3, 5], g)];
    gradcheck("cat dim 2", &parts2, |x| Tensor::cat(x, 2));
    gradcheck("cat transposed parts", &[randn(&[4, 3], g), randn(&[2, 3], g)], |x| Tensor::cat(&[x[0].t()?, x[1].t()?], 1));

    let x = randn(&[2, 7, 3], g);
    gradcheck("split", std::slice::from_ref(&x), |x| {
        let p = x[0].split(&[2, 4, 1], 1)?;
        Tensor::cat(&[p[2].clone(), p[0].sqr()?, p[1].clone()], 1)
    });
    gradcheck("split one piece unused", std::slice::from_ref(&x), |x| {
        let p = x[0].split(&[2, 4, 1], 1)?;
        p[1].exp()
    });
    let s = [randn(&[2, 3], g), randn(&[2, 3], g), randn(&[2, 3], g)];
    for d in 0..3 {
        gradcheck(&format!("stack dim {d}"), &s, |x| Tensor::stack(x, d));
    }
    let y = randn(&[4, 5, 3], g);
    gradcheck("narrow 1", std::slice::from_ref(&y), |x| x[0].narrow(1, 1, 3));
    gradcheck("narrow 0 full", std::slice::from_ref(&y), |x| x[0].narrow(0, 0, 4));
    gradcheck("narrow 2 end", std::slice::from_ref(&y), |x| x[0].narrow(2, 2, 1));
    gradcheck("narrow of narrow", std::slice::from_ref(&y), |x| x[0].narrow(1, 1, 4)?.narrow(1, 2, 2)?.narrow(0, 3, 1));
    gradcheck("chunk", &[randn(&[2, 6], g)], |x| {
        let c = x[0].chunk(3, 1)?;
        Tensor::cat(&[c[1].clone(), c[2].mul_scalar(3.0)?, c[0].clone()], 0)
    });
}

#[test]
fn grad_views() {
    let g = &mut Rng::new(9);
    let x = randn(&[2, 3, 4], g);
    gradcheck("reshape", std::slice::from_ref(&x), |x| x[0].reshape([6, 4]));
    gradcheck("reshape of permuted", std::slice::from_ref(&x), |x| x[0].permute(&[2, 0, 1])?.reshape([4, 6]));
    gradcheck("flatten", std::slice::from_ref(&x), |x| x[0].flatten(1, 2));
    gradcheck("permute", std::slice::from_ref(&x), |x| x[0].permute(&[2, 0, 1]));
    gradcheck("transpose", std::slice::from_ref(&x), |x| x[0].transpose(0, 2));
    gradcheck("contiguous", std::slice::from_ref(&x), |x| x[0].transpose(0, 1)?.contiguous());
    gradcheck("unsqueeze", std::slice::from_ref(&x), |x| x[0].unsqueeze(1));
    gradcheck("unsqueeze end", std::slice::from_ref(&x), |x| x[0].unsqueeze(3));
    gradcheck("squeeze", &[randn(&[3, 1, 4], g)], |x| x[0].squeeze(1));
    gradcheck("broadcast_as", &[randn(&[3, 1, 4], g)], |x| x[0].broadcast_as([2, 3, 5, 4]));
    gradcheck("broadcast_as permuted", &[randn(&[4, 1], g)], |x| x[0].t()?.broadcast_as([3, 1, 4])?.sqr());
    gradcheck("view chain", std::slice::from_ref(&x), |x| {
        x[0].permute(&[1, 2, 0])?.narrow(1, 1, 2)?.unsqueeze(0)?.broadcast_as([3, 3, 2, 2])?.reshape([9, 4])?.t()
    });
}

#[test]
fn grad_casts() {
    let g = &mut Rng::new(10);
    let x = randn(&[3, 5], g);
    // f64 -> f32 -> f64 loses precision in the forward, so the numeric derivative uses
    // eps = 1e-3 and the tolerance is 1e-3 (f32 rounding / 2eps ~ 1e-4 relative).
    gradcheck_with("to_dtype f32 round trip", std::slice::from_ref(&x), 1e-3, 1e-3, |x| {
        x[0].to_dtype(DType::F32)?.sqr()?.to_dtype(DType::F64)
    });
    // bf16 round trip: the gradient is the upstream gradient rounded through bf16, exactly.
    let p = param(&x.clone().detach());
    let w = randn(&[3, 5], g);
    p.to_dtype(DType::BF16).unwrap().to_dtype(DType::F64).unwrap().mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    let want = w.to_dtype(DType::BF16).unwrap().to_vec_f64().unwrap();
    assert_eq!(p.grad().unwrap().dtype(), DType::F64);
    assert_eq!(p.grad().unwrap().to_vec::<f64>().unwrap(), want);
}

// ---- fused ops ------------------------------------------------------------------------------

#[test]
fn grad_rms_norm() {
    let g = &mut Rng::new(11);
    let w = uniform(&[6], 0.5, 1.5, g);
    gradcheck("rms_norm", &[randn(&[2, 3, 6], g), w.clone()], |x| x[0].rms_norm(&x[1], 1e-5));
    gradcheck("rms_norm transposed x", &[randn(&[6, 3], g), w.clone()], |x| x[0].t()?.rms_norm(&x[1], 1e-5));
    gradcheck("rms_norm odd", &[randn(&[5, 7], g), uniform(&[7], 0.5, 1.5, g)], |x| x[0].rms_norm(&x[1], 1e-2));
}

#[test]
fn grad_rope() {
    let g = &mut Rng::new(12);
    let (c, s) = rope_cos_sin(5, 4, 10000.0, DType::F64);
    gradcheck("rope t5 d4", &[randn(&[2, 3, 5, 4], g)], |x| x[0].rope(&c, &s));
    let (c, s) = rope_cos_sin(7, 6, 10.0, DType::F64);
    gradcheck("rope t7 d6", &[randn(&[1, 2, 7, 6], g)], |x| x[0].rope(&c, &s));
    // as a model calls it: (b, t, h, d) projections permuted to (b, h, t, d)
    gradcheck("rope permuted", &[randn(&[2, 7, 3, 6], g)], |x| x[0].permute(&[0, 2, 1, 3])?.rope(&c, &s));
}

#[test]
fn grad_swiglu() {
    let g = &mut Rng::new(13);
    gradcheck("swiglu", &[randn(&[3, 7], g), randn(&[3, 7], g)], |x| Tensor::swiglu(&x[0], &x[1]));
    gradcheck("swiglu transposed", &[randn(&[7, 3], g), randn(&[3, 7], g)], |x| Tensor::swiglu(&x[0].t()?, &x[1]));
    gradcheck("swiglu same input", &[randn(&[2, 5], g)], |x| Tensor::swiglu(&x[0], &x[0]));
}

#[test]
fn grad_causal_attention() {
    let g = &mut Rng::new(14);
    // (b, hq, hkv, t, d)
    for (b, hq, hkv, t, d) in [(2, 4, 2, 5, 4), (1, 2, 2, 7, 6), (1, 4, 2, 7, 6), (2, 3, 1, 5, 4), (1, 4, 4, 1, 4)] {
        let scale = 1.0 / (d as f64).sqrt();
        let ins = [randn(&[b, hq, t, d], g), randn(&[b, hkv, t, d], g), randn(&[b, hkv, t, d], g)];
        gradcheck(&format!("attention b{b} hq{hq} hkv{hkv} t{t} d{d}"), &ins, |x| Tensor::causal_attention(&x[0], &x[1], &x[2], scale));
    }
    // (b, t, h, d) inputs permuted to (b, h, t, d), as a model produces them
    let ins = [randn(&[1, 5, 4, 6], g), randn(&[1, 5, 2, 6], g), randn(&[1, 5, 2, 6], g)];
    gradcheck("attention permuted inputs", &ins, |x| {
        let p = |t: &Tensor| t.permute(&[0, 2, 1, 3]);
        Tensor::causal_attention(&p(&x[0])?, &p(&x[1])?, &p(&x[2])?, 0.3)
    });
}

#[test]
fn grad_cross_entropy() {
    let g = &mut Rng::new(15);
    let t = ids(&[2, -100, 0, 4, -100, 1], &[6]);
    gradcheck("cross_entropy ignore", &[randn(&[6, 5], g)], |x| Tensor::cross_entropy(&x[0], &t, -100));
    let t2 = ids(&[0, 6, 3], &[3]);
    gradcheck("cross_entropy transposed logits", &[randn(&[7, 3], g)], |x| Tensor::cross_entropy(&x[0].t()?, &t2, -100));
    // Everything ignored: loss 0, zero gradient (no NaN from 0/0).
    let none = ids(&[-100, -100], &[2]);
    let x = param(&randn(&[2, 3], g));
    let l = Tensor::cross_entropy(&x, &none, -100).unwrap();
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
        let x = Tensor::embedding(&tok, &p[0])?; // (1, t, dm)
        let h = x.rms_norm(&p[1], 1e-5)?;
        let heads = |w: &Tensor, n: usize| h.matmul(&w.t()?)?.reshape([1, t, n, hd])?.permute(&[0, 2, 1, 3]);
        let q = heads(&p[2], hq)?.rope(&c, &s)?;
        let k = heads(&p[3], hkv)?.rope(&c, &s)?;
        let v = heads(&p[4], hkv)?;
        let a = Tensor::causal_attention(&q, &k, &v, 0.5)?.permute(&[0, 2, 1, 3])?.reshape([1, t, hq * hd])?;
        let x = x.add(&a.matmul(&p[5].t()?)?)?;
        let h = x.rms_norm(&p[6], 1e-5)?;
        let m = Tensor::swiglu(&h.matmul(&p[7].t()?)?, &h.matmul(&p[8].t()?)?)?.matmul(&p[9].t()?)?;
        let x = x.add(&m)?;
        let logits = x.reshape([t, dm])?.matmul(&p[0].t()?)?;
        Tensor::cross_entropy(&logits, &tgt, -100)
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
    for (b, hq, hkv, t, d) in [(2, 4, 2, 5, 4), (1, 3, 3, 7, 6), (1, 8, 2, 9, 8), (2, 2, 1, 16, 4)] {
        let ins = [randn(&[b, hq, t, d], g), randn(&[b, hkv, t, d], g), randn(&[b, hkv, t, d], g)];
        let sc = 1.0 / (d as f64).sqrt();
        fused_vs_naive(
            &format!("attention {b} {hq} {hkv} {t} {d}"),
            &ins,
            |x| Tensor::causal_attention(&x[0], &x[1], &x[2], sc),
            |x| naive_attention(&x[0], &x[1], &x[2], sc),
        );
    }
}

#[test]
fn fused_rms_norm_matches_naive() {
    let g = &mut Rng::new(21);
    let ins = [randn(&[3, 4, 10], g), uniform(&[10], 0.5, 1.5, g)];
    fused_vs_naive("rms_norm", &ins, |x| x[0].rms_norm(&x[1], 1e-6), |x| naive_rms_norm(&x[0], &x[1], 1e-6));
}

#[test]
fn fused_swiglu_matches_naive() {
    let g = &mut Rng::new(22);
    let ins = [randn(&[4, 9], g), randn(&[4, 9], g)];
    fused_vs_naive("swiglu", &ins, |x| Tensor::swiglu(&x[0], &x[1]), |x| x[0].silu()?.mul(&x[1]));
}

#[test]
fn fused_cross_entropy_matches_naive() {
    let g = &mut Rng::new(23);
    let tv = [3, -100, 0, 10, 5, -100, 7];
    let t = ids(&tv, &[7]);
    let ins = [randn(&[7, 11], g).mul_scalar(3.0).unwrap()];
    fused_vs_naive("cross_entropy", &ins, |x| Tensor::cross_entropy(&x[0], &t, -100), |x| naive_cross_entropy(&x[0], &tv, -100));
    // other ignore index; large logits stay finite (log-sum-exp is shifted)
    let tv = [1, 2, 0];
    let t = ids(&tv, &[3]);
    let big = randn(&[3, 4], g).mul_scalar(300.0).unwrap();
    let l = Tensor::cross_entropy(&big, &t, 2).unwrap().item().unwrap();
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
        let y = x.rope(&c, &s).unwrap().to_vec::<f64>().unwrap();
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
    let y = Tensor::embedding(&ids(&idv, &[2, 2]), &w).unwrap();
    assert_eq!(y.dims(), &[2, 2, 3]);
    let wv = w.to_vec::<f64>().unwrap();
    let want: Vec<f64> = idv.iter().flat_map(|&i| wv[i as usize * 3..i as usize * 3 + 3].to_vec()).collect();
    assert_eq!(y.to_vec::<f64>().unwrap(), want);
}

/// The checker itself must catch a wrong derivative: x * detach(x) has numeric gradient 2x but
/// the recorded one is x.
#[test]
#[should_panic(expected = "max |analytic-numeric|")]
fn gradcheck_catches_wrong_gradient() {
    let g = &mut Rng::new(30);
    gradcheck("wrong on purpose", &[randn(&[2, 3], g)], |x| x[0].mul(&x[0].detach()));
}
