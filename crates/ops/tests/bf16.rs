//! bf16 forward and backward of the fused ops against f32 on the same, bf16-representable
//! inputs (tolerances: `BF16_TOL`, `BF16_GRAD_TOL` of the engine's test helpers).
mod common;
use common::*;
use ferrolm_ops::{causal_attention, cross_entropy, embedding, rms_norm, rope, softmax_last, swiglu};
use ferrolm_tensor::{DType, Result, Rng, Tensor};

#[test]
fn bf16_fused_forward() {
    let g = &mut Rng::new(3);
    let x = pair(&[4, 33], g);
    bf16_check("softmax", std::slice::from_ref(&x), |x| softmax_last(&x[0]));
    let w = pos_pair(&[16], g);
    bf16_check("rms_norm", &[pair(&[3, 5, 16], g), w], |x| rms_norm(&x[0], &x[1], 1e-5));
    let (cb, sb) = rope_cos_sin(9, 8, 10000.0, DType::BF16);
    let (cf, sf) = (cb.to_dtype(DType::F32).unwrap(), sb.to_dtype(DType::F32).unwrap());
    bf16_check("rope", &[pair(&[2, 3, 9, 8], g), (cb, cf), (sb, sf)], |x| rope(&x[0], &x[1], &x[2]));
    bf16_check("swiglu", &[pair(&[4, 21], g), pair(&[4, 21], g)], |x| swiglu(&x[0], &x[1]));
    let ins = [pair(&[2, 4, 11, 8], g), pair(&[2, 2, 11, 8], g), pair(&[2, 2, 11, 8], g)];
    bf16_check("attention", &ins, |x| causal_attention(&x[0], &x[1], &x[2], 0.35));
    let id = ids(&[3, 0, 3, 9], &[2, 2]);
    bf16_check("embedding", &[pair(&[10, 6], g)], |x| embedding(&id, &x[0]));
    let t = ids(&[3, -100, 0, 9, 2], &[5]);
    bf16_check("cross_entropy", &[pair(&[5, 10], g)], |x| cross_entropy(&x[0], &t, -100));
    let l = cross_entropy(&pair(&[5, 10], g).0, &t, -100).unwrap();
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
            assert!(e < BF16_GRAD_TOL, "{name}: grad {i} bf16 vs f32 rel err {e:.3e}");
        }
    };
    run("matmul", &[pair(&[5, 16], g), pair(&[16, 7], g)], &|x| x[0].matmul(&x[1]));
    run("rms_norm", &[pair(&[6, 16], g), pos_pair(&[16], g)], &|x| rms_norm(&x[0], &x[1], 1e-5));
    run("swiglu", &[pair(&[4, 9], g), pair(&[4, 9], g)], &|x| swiglu(&x[0], &x[1]));
    let ins = [pair(&[1, 4, 7, 8], g), pair(&[1, 2, 7, 8], g), pair(&[1, 2, 7, 8], g)];
    run("attention", &ins, &|x| causal_attention(&x[0], &x[1], &x[2], 0.35));
    let t = ids(&[3, -100, 0, 9, 2], &[5]);
    run("cross_entropy", &[pair(&[5, 10], g)], &|x| cross_entropy(&x[0], &t, -100));
    let id = ids(&[3, 0, 3, 9], &[4]);
    run("embedding", &[pair(&[10, 6], g)], &|x| embedding(&id, &x[0]));
    let (cb, sb) = rope_cos_sin(5, 4, 100.0, DType::BF16);
    run("rope", &[pair(&[1, 2, 5, 4], g)], &|x| {
        let (c, s) =
            if x[0].dtype() == DType::BF16 { (cb.clone(), sb.clone()) } else { (cb.to_dtype(DType::F32)?, sb.to_dtype(DType::F32)?) };
        rope(&x[0], &c, &s)
    });
}
