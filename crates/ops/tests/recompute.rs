//! Activation checkpointing gives bitwise the same gradients as the plain run.
//! (The memory comparison lives alone in checkpoint_memory.rs: live_bytes is process-global.)
mod common;
use common::*;
use ferrolm_ops::{causal_attention, rms_norm, rope, swiglu};
use ferrolm_tensor::{no_grad, recompute, DType, Result, Rng, Tensor};
use std::sync::{Arc, Mutex};

const D: usize = 16;
const HQ: usize = 4;
const HKV: usize = 2;
const HD: usize = 4;
const FF: usize = 24;

/// One pre-norm block's parameters: norm1, wq, wk, wv, wo, norm2, w1, w3, w2.
fn block_params(g: &mut Rng) -> Vec<Tensor> {
    let w = |s: &[usize], g: &mut Rng| param(&Tensor::randn(s.to_vec(), 0.2, DType::F32, CPU, g).unwrap());
    let n = |g: &mut Rng| param(&Tensor::rand_uniform([D], 0.8, 1.2, DType::F32, CPU, g).unwrap());
    vec![
        n(g),
        w(&[HQ * HD, D], g),
        w(&[HKV * HD, D], g),
        w(&[HKV * HD, D], g),
        w(&[D, HQ * HD], g),
        n(g),
        w(&[FF, D], g),
        w(&[FF, D], g),
        w(&[D, FF], g),
    ]
}

/// x: (b, t, D) -> (b, t, D); attention block or MLP block or both.
fn block(x: &Tensor, p: &[Tensor], cos: &Tensor, sin: &Tensor, attn: bool, mlp: bool) -> Result<Tensor> {
    let (b, t) = (x.dim(0), x.dim(1));
    let mut x = x.clone();
    if attn {
        let h = rms_norm(&x, &p[0], 1e-5)?;
        let heads = |w: &Tensor, n: usize| h.matmul(&w.t()?)?.reshape([b, t, n, HD])?.permute(&[0, 2, 1, 3]);
        let q = rope(&heads(&p[1], HQ)?, cos, sin)?;
        let k = rope(&heads(&p[2], HKV)?, cos, sin)?;
        let v = heads(&p[3], HKV)?;
        let a = causal_attention(&q, &k, &v, 0.5)?.permute(&[0, 2, 1, 3])?.reshape([b, t, HQ * HD])?;
        x = x.add(&a.matmul(&p[4].t()?)?)?;
    }
    if mlp {
        let h = rms_norm(&x, &p[5], 1e-5)?;
        let m = swiglu(&h.matmul(&p[6].t()?)?, &h.matmul(&p[7].t()?)?)?.matmul(&p[8].t()?)?;
        x = x.add(&m)?;
    }
    Ok(x)
}

/// Unused parameters (the attention weights of an MLP-only segment) have no gradient: None.
fn grads(ts: &[Tensor]) -> Vec<Option<Vec<f32>>> {
    ts.iter().map(|t| t.grad().map(|g| g.to_vec::<f32>().unwrap())).collect()
}

/// Runs `segments` blocks on x, plain or checkpointed, and returns (loss, grads of x and params).
fn run(segments: &[(bool, bool)], ckpt: bool, x_requires_grad: bool) -> (f32, Vec<Option<Vec<f32>>>) {
    let g = &mut Rng::new(42);
    let params: Vec<Vec<Tensor>> = segments.iter().map(|_| block_params(g)).collect();
    let x = Tensor::randn([2, 7, D], 1.0, DType::F32, CPU, g).unwrap();
    if x_requires_grad {
        x.set_requires_grad(true).unwrap();
    }
    let (cos, sin) = rope_cos_sin(7, HD, 10000.0, DType::F32);
    let mut h = x.clone();
    for (p, &(attn, mlp)) in params.iter().zip(segments) {
        if ckpt {
            let (p, c, s) = (p.clone(), cos.clone(), sin.clone());
            h = recompute(&[h], move |xs| block(&xs[0], &p, &c, &s, attn, mlp)).unwrap();
        } else {
            h = block(&h, p, &cos, &sin, attn, mlp).unwrap();
        }
    }
    let loss = h.sqr().unwrap().mean_all().unwrap();
    loss.backward().unwrap();
    let mut all: Vec<Tensor> = params.into_iter().flatten().collect();
    if x_requires_grad {
        all.insert(0, x);
    }
    (loss.item().unwrap() as f32, grads(&all))
}

#[test]
fn checkpoint_gradients_are_bitwise_equal() {
    for segs in [vec![(true, true), (true, true)], vec![(true, false), (false, true), (true, true)], vec![(false, true); 4]] {
        for xg in [true, false] {
            let (lp, gp) = run(&segs, false, xg);
            let (lc, gc) = run(&segs, true, xg);
            assert_eq!(lp.to_bits(), lc.to_bits(), "{segs:?}: loss");
            assert_eq!(gp.len(), gc.len());
            assert!(gp.iter().filter(|g| g.is_some()).count() >= 9, "{segs:?}: gradients reached the parameters");
            for (i, (a, b)) in gp.iter().zip(&gc).enumerate() {
                assert!(a == b, "{segs:?} x_grad={xg}: gradient {i} differs between plain and checkpointed runs");
            }
        }
    }
}

#[test]
fn checkpoint_hooks_fire_once_and_nested_checkpoints_work() {
    let g = &mut Rng::new(3);
    let w = param(&Tensor::randn([D, D], 0.3, DType::F32, CPU, g).unwrap());
    let x = Tensor::randn([3, D], 1.0, DType::F32, CPU, g).unwrap();
    let calls = Arc::new(Mutex::new(0));
    let c2 = calls.clone();
    w.register_hook(move |_| *c2.lock().unwrap() += 1);
    let f = {
        let w = w.clone();
        move |xs: &[Tensor]| xs[0].matmul(&w)?.silu()
    };
    // plain reference
    let plain = f(std::slice::from_ref(&x)).unwrap().matmul(&w).unwrap().sum_all().unwrap();
    plain.backward().unwrap();
    let want = w.grad().unwrap().to_vec::<f32>().unwrap();
    w.zero_grad();
    *calls.lock().unwrap() = 0;
    // the same inside a checkpoint nested in a checkpoint
    let w2 = w.clone();
    let y = recompute(std::slice::from_ref(&x), move |xs| {
        let f = f.clone();
        recompute(xs, move |ys| f(ys))?.matmul(&w2)
    })
    .unwrap()
    .sum_all()
    .unwrap();
    y.backward().unwrap();
    assert_eq!(*calls.lock().unwrap(), 1, "a parameter's hook fires once per backward with checkpointing");
    assert_eq!(w.grad().unwrap().to_vec::<f32>().unwrap(), want);
    // under no_grad a checkpoint is just the function
    let _ng = no_grad();
    let w3 = w.clone();
    let z = recompute(&[x], move |xs| xs[0].matmul(&w3)).unwrap();
    assert!(!z.requires_grad());
}
