//! bf16 forward (and the fused ops' backward) against f32 on the same, bf16-representable
//! inputs. The CPU backend computes bf16 in f32 and rounds each op's result once, so the
//! stated tolerance is: max |bf16 - f32| / max(1, |f32|) < 2e-2 for outputs of O(1)
//! (bf16 has an 8-bit mantissa, one rounding is <= 2^-9 relative); gradients, which pass
//! through several rounded ops, get 5e-2.
mod common;
use common::*;
use ferrolm_tensor::{DType, Result, Rng, Tensor};

const TOL: f64 = 2e-2;
const GRAD_TOL: f64 = 5e-2;

/// A bf16 tensor and its exact f32 copy.
fn pair(shape: &[usize], g: &mut Rng) -> (Tensor, Tensor) {
    let b = randn_dt(shape, DType::BF16, g);
    let f = b.to_dtype(DType::F32).unwrap();
    (b, f)
}
fn pos_pair(shape: &[usize], g: &mut Rng) -> (Tensor, Tensor) {
    let b = Tensor::rand_uniform(shape.to_vec(), 0.5, 2.0, DType::BF16, CPU, g).unwrap();
    let f = b.to_dtype(DType::F32).unwrap();
    (b, f)
}

/// Runs `f` on the bf16 inputs and on their f32 copies and compares.
#[track_caller]
fn check(name: &str, ins: &[(Tensor, Tensor)], f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    let b: Vec<Tensor> = ins.iter().map(|p| p.0.clone()).collect();
    let x: Vec<Tensor> = ins.iter().map(|p| p.1.clone()).collect();
    let (yb, yf) = (f(&b).unwrap(), f(&x).unwrap());
    assert_eq!(yb.dims(), yf.dims(), "{name}: shape");
    assert!(yb.dtype() == DType::BF16 || yb.dtype() == DType::F32, "{name}: dtype {}", yb.dtype());
    let e = rel_err(&yb.to_vec_f64().unwrap(), &yf.to_vec_f64().unwrap());
    assert!(e < TOL, "{name}: bf16 vs f32 rel err {e:.3e} >= {TOL:e}");
}

#[test]
fn bf16_elementwise_and_reductions() {
    let g = &mut Rng::new(1);
    let x = pair(&[4, 33], g);
    let p = pos_pair(&[4, 33], g);
    check("neg", std::slice::from_ref(&x), |x| x[0].neg());
    check("exp", std::slice::from_ref(&x), |x| x[0].exp());
    check("sqr", std::slice::from_ref(&x), |x| x[0].sqr());
    check("silu", std::slice::from_ref(&x), |x| x[0].silu());
    check("log", std::slice::from_ref(&p), |x| x[0].log());
    check("sqrt", std::slice::from_ref(&p), |x| x[0].sqrt());
    check("rsqrt", std::slice::from_ref(&p), |x| x[0].rsqrt());
    check("recip", std::slice::from_ref(&p), |x| x[0].recip());
    check("powf", std::slice::from_ref(&p), |x| x[0].powf(1.5));
    check("affine", std::slice::from_ref(&x), |x| x[0].affine(0.5, 0.25));
    let row = pair(&[33], g);
    check("add bcast", &[x.clone(), row.clone()], |x| x[0].add(&x[1]));
    check("sub bcast", &[x.clone(), row.clone()], |x| x[0].sub(&x[1]));
    check("mul bcast", &[x.clone(), row.clone()], |x| x[0].mul(&x[1]));
    check("div", &[x.clone(), p.clone()], |x| x[0].div(&x[1]));
    check("sum", std::slice::from_ref(&x), |x| x[0].sum(&[1], false));
    check("mean", std::slice::from_ref(&x), |x| x[0].mean(&[0], true));
    check("max", std::slice::from_ref(&x), |x| x[0].max(&[1], true));
    check("softmax", std::slice::from_ref(&x), |x| x[0].softmax_last());
    check("views", std::slice::from_ref(&x), |x| x[0].t()?.narrow(0, 3, 20)?.contiguous()?.reshape([4, 5, 4])?.permute(&[2, 0, 1]));
    check("cat", &[x.clone(), p.clone()], |x| Tensor::cat(x, 0));
    check("stack", &[x.clone(), p.clone()], |x| Tensor::stack(x, 1));
    check("split/chunk", std::slice::from_ref(&x), |x| {
        let s = x[0].split(&[10, 23], 1)?;
        let c = x[0].chunk(2, 0)?;
        Tensor::cat(&[s[1].clone(), s[0].clone(), c[1].broadcast_as([2, 2, 33])?.reshape([4, 33])?.sqr()?], 1)
    });
    check("unsqueeze/broadcast/squeeze", std::slice::from_ref(&x), |x| {
        x[0].unsqueeze(0)?.broadcast_as([3, 4, 33])?.transpose(0, 1)?.narrow(1, 1, 1)?.squeeze(1)
    });
    check("casts", std::slice::from_ref(&x), |x| x[0].to_dtype(DType::F32)?.to_dtype(DType::BF16));
    assert_eq!(x.0.exp().unwrap().dtype(), DType::BF16);
}

#[test]
fn bf16_matmul() {
    let g = &mut Rng::new(2);
    check("matmul", &[pair(&[17, 64], g), pair(&[64, 9], g)], |x| x[0].matmul(&x[1]));
    check("matmul batched rhs^T", &[pair(&[2, 7, 32], g), pair(&[5, 32], g)], |x| x[0].matmul(&x[1].t()?));
}

#[test]
fn bf16_fused_forward() {
    let g = &mut Rng::new(3);
    let w = pos_pair(&[16], g);
    check("rms_norm", &[pair(&[3, 5, 16], g), w], |x| x[0].rms_norm(&x[1], 1e-5));
    let (cb, sb) = rope_cos_sin(9, 8, 10000.0, DType::BF16);
    let (cf, sf) = (cb.to_dtype(DType::F32).unwrap(), sb.to_dtype(DType::F32).unwrap());
    check("rope", &[pair(&[2, 3, 9, 8], g), (cb, cf), (sb, sf)], |x| x[0].rope(&x[1], &x[2]));
    check("swiglu", &[pair(&[4, 21], g), pair(&[4, 21], g)], |x| Tensor::swiglu(&x[0], &x[1]));
    let ins = [pair(&[2, 4, 11, 8], g), pair(&[2, 2, 11, 8], g), pair(&[2, 2, 11, 8], g)];
    check("attention", &ins, |x| Tensor::causal_attention(&x[0], &x[1], &x[2], 0.35));
    let id = ids(&[3, 0, 3, 9], &[2, 2]);
    check("embedding", &[pair(&[10, 6], g)], |x| Tensor::embedding(&id, &x[0]));
    let t = ids(&[3, -100, 0, 9, 2], &[5]);
    check("cross_entropy", &[pair(&[5, 10], g)], |x| Tensor::cross_entropy(&x[0], &t, -100));
    let l = Tensor::cross_entropy(&pair(&[5, 10], g).0, &t, -100).unwrap();
    assert_eq!(l.dtype(), DType::F32, "bf16 logits give an f32 loss");
}

/// Gradients of the fused ops (and matmul) in bf16 against f32, 5e-2 relative.
#[test]
fn bf16_fused_backward() {
    let g = &mut Rng::new(4);
    let run = |name: &str, ins: &[(Tensor, Tensor)], f: &dyn Fn(&[Tensor]) -> Result<Tensor>| {
        let mut grads = Vec::new();
        for k in 0..2 {
            let xs: Vec<Tensor> = ins.iter().map(|p| param(&if k == 0 { &p.0 } else { &p.1 }.detach())).collect();
            let y = f(&xs).unwrap();
            // A fixed weighting, exactly representable in bf16.
            let n = y.numel();
            let w: Vec<f32> = (0..n).map(|i| ((i * 37) % 7) as f32 * 0.25 - 0.75).collect();
            let w = Tensor::from_vec(w, y.dims().to_vec(), CPU).unwrap().to_dtype(y.dtype()).unwrap();
            y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
            grads.push(xs.iter().map(|x| x.grad().unwrap()).collect::<Vec<_>>());
        }
        for (i, (b, f)) in grads[0].iter().zip(&grads[1]).enumerate() {
            assert_eq!(b.dtype(), DType::BF16, "{name}: grad {i} dtype");
            let e = rel_err(&b.to_vec_f64().unwrap(), &f.to_vec_f64().unwrap());
            assert!(e < GRAD_TOL, "{name}: grad {i} bf16 vs f32 rel err {e:.3e}");
        }
    };
    run("matmul", &[pair(&[5, 16], g), pair(&[16, 7], g)], &|x| x[0].matmul(&x[1]));
    run("rms_norm", &[pair(&[6, 16], g), pos_pair(&[16], g)], &|x| x[0].rms_norm(&x[1], 1e-5));
    run("swiglu", &[pair(&[4, 9], g), pair(&[4, 9], g)], &|x| Tensor::swiglu(&x[0], &x[1]));
    let ins = [pair(&[1, 4, 7, 8], g), pair(&[1, 2, 7, 8], g), pair(&[1, 2, 7, 8], g)];
    run("attention", &ins, &|x| Tensor::causal_attention(&x[0], &x[1], &x[2], 0.35));
    let t = ids(&[3, -100, 0, 9, 2], &[5]);
    run("cross_entropy", &[pair(&[5, 10], g)], &|x| Tensor::cross_entropy(&x[0], &t, -100));
    let id = ids(&[3, 0, 3, 9], &[4]);
    run("embedding", &[pair(&[10, 6], g)], &|x| Tensor::embedding(&id, &x[0]));
    let (cb, sb) = rope_cos_sin(5, 4, 100.0, DType::BF16);
    run("rope", &[pair(&[1, 2, 5, 4], g)], &|x| {
        let (c, s) =
            if x[0].dtype() == DType::BF16 { (cb.clone(), sb.clone()) } else { (cb.to_dtype(DType::F32)?, sb.to_dtype(DType::F32)?) };
        x[0].rope(&c, &s)
    });
}
