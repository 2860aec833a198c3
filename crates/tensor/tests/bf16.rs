//! bf16 forward (and the fused ops' backward) against f32 on the same, bf16-representable
//! inputs. The CPU backend computes bf16 in f32 and rounds each op's result once, so the
//! stated tolerance is: max |bf16 - f32| / max(1, |f32|) < 2e-2 for outputs of O(1)
//! (bf16 has an 8-bit mantissa, one rounding is <= 2^-9 relative); gradients, which pass
//! through several rounded ops, get 5e-2.
mod common;
use common::*;
use ferrolm_tensor::{DType, Rng, Tensor};

#[test]
fn bf16_elementwise_and_reductions() {
    let g = &mut Rng::new(1);
    let x = pair(&[4, 33], g);
    let p = pos_pair(&[4, 33], g);
    bf16_check("neg", std::slice::from_ref(&x), |x| x[0].neg());
    bf16_check("exp", std::slice::from_ref(&x), |x| x[0].exp());
    bf16_check("sqr", std::slice::from_ref(&x), |x| x[0].sqr());
    bf16_check("silu", std::slice::from_ref(&x), |x| x[0].silu());
    bf16_check("log", std::slice::from_ref(&p), |x| x[0].log());
    bf16_check("sqrt", std::slice::from_ref(&p), |x| x[0].sqrt());
    bf16_check("rsqrt", std::slice::from_ref(&p), |x| x[0].rsqrt());
    bf16_check("recip", std::slice::from_ref(&p), |x| x[0].recip());
    bf16_check("powf", std::slice::from_ref(&p), |x| x[0].powf(1.5));
    bf16_check("affine", std::slice::from_ref(&x), |x| x[0].affine(0.5, 0.25));
    let row = pair(&[33], g);
    bf16_check("add bcast", &[x.clone(), row.clone()], |x| x[0].add(&x[1]));
    bf16_check("sub bcast", &[x.clone(), row.clone()], |x| x[0].sub(&x[1]));
    bf16_check("mul bcast", &[x.clone(), row.clone()], |x| x[0].mul(&x[1]));
    bf16_check("div", &[x.clone(), p.clone()], |x| x[0].div(&x[1]));
    bf16_check("sum", std::slice::from_ref(&x), |x| x[0].sum(&[1], false));
    bf16_check("mean", std::slice::from_ref(&x), |x| x[0].mean(&[0], true));
    bf16_check("max", std::slice::from_ref(&x), |x| x[0].max(&[1], true));
    bf16_check("views", std::slice::from_ref(&x), |x| x[0].t()?.narrow(0, 3, 20)?.contiguous()?.reshape([4, 5, 4])?.permute(&[2, 0, 1]));
    bf16_check("cat", &[x.clone(), p.clone()], |x| Tensor::cat(x, 0));
    bf16_check("stack", &[x.clone(), p.clone()], |x| Tensor::stack(x, 1));
    bf16_check("split/chunk", std::slice::from_ref(&x), |x| {
        let s = x[0].split(&[10, 23], 1)?;
        let c = x[0].chunk(2, 0)?;
        Tensor::cat(&[s[1].clone(), s[0].clone(), c[1].broadcast_as([2, 2, 33])?.reshape([4, 33])?.sqr()?], 1)
    });
    bf16_check("unsqueeze/broadcast/squeeze", std::slice::from_ref(&x), |x| {
        x[0].unsqueeze(0)?.broadcast_as([3, 4, 33])?.transpose(0, 1)?.narrow(1, 1, 1)?.squeeze(1)
    });
    bf16_check("casts", std::slice::from_ref(&x), |x| x[0].to_dtype(DType::F32)?.to_dtype(DType::BF16));
    assert_eq!(x.0.exp().unwrap().dtype(), DType::BF16);
}

#[test]
fn bf16_matmul() {
    let g = &mut Rng::new(2);
    bf16_check("matmul", &[pair(&[17, 64], g), pair(&[64, 9], g)], |x| x[0].matmul(&x[1]));
    bf16_check("matmul batched rhs^T", &[pair(&[2, 7, 32], g), pair(&[5, 32], g)], |x| x[0].matmul(&x[1].t()?));
}
