//! Finite-difference gradient checks (f64, central differences, eps = 1e-6) for every op of
//! the engine (the fused ops' are in crates/ops/tests/gradcheck.rs).
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
fn grad_linear() {
    let g = &mut Rng::new(21);
    gradcheck("linear 2d", &[randn(&[3, 5], g), randn(&[4, 5], g)], |x| x[0].linear(&x[1]));
    gradcheck("linear 3d", &[randn(&[2, 3, 5], g), randn(&[4, 5], g)], |x| x[0].linear(&x[1]));
    gradcheck("linear of a transposed x", &[randn(&[5, 3], g), randn(&[4, 5], g)], |x| x[0].t()?.linear(&x[1]));
    // x read by two layers and an add: the second layer's dX is summed onto the first's.
    gradcheck("linear x twice", &[randn(&[3, 5], g), randn(&[4, 5], g), randn(&[4, 5], g)], |x| {
        x[0].linear(&x[1])?.add(&x[0].linear(&x[2])?)?.add(&x[0].sum(&[1], true)?)
    });
    // res + x W^T, the residual connection in the GEMM; res also read elsewhere.
    gradcheck("linear_plus", &[randn(&[2, 3, 5], g), randn(&[4, 5], g), randn(&[2, 3, 4], g)], |x| {
        x[0].linear_plus(&x[1], &x[2])?.mul(&x[2])
    });
    // One weight read by two layers (no gradient destination then).
    gradcheck("linear w twice", &[randn(&[3, 5], g), randn(&[4, 5], g)], |x| x[0].linear(&x[1])?.mul(&x[0].sqr()?.linear(&x[1])?));
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

/// The checker itself must catch a wrong derivative: x * detach(x) has numeric gradient 2x but
/// the recorded one is x.
#[test]
#[should_panic(expected = "max |analytic-numeric|")]
fn gradcheck_catches_wrong_gradient() {
    let g = &mut Rng::new(30);
    gradcheck("wrong on purpose", &[randn(&[2, 3], g)], |x| x[0].mul(&x[0].detach()));
}
