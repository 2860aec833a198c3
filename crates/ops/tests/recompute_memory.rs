//! Activation checkpointing holds less memory after forward and gives bitwise the same
//! gradients. One #[test] in its own binary: `live_bytes()` is a process-global counter, so no
//! other test may allocate tensors concurrently.
use ferrolm_ops::{causal_attention, rms_norm, swiglu};
use ferrolm_tensor::{live_bytes, recompute, DType, Device, Result, Rng, Tensor};

// Sizes: model width, query heads (of width HD), kv heads, MLP width.
const D: usize = 32;
const H: usize = 4;
const HD: usize = D / H;
const HKV: usize = 2;
const FF: usize = 96;

fn params(g: &mut Rng) -> Vec<Tensor> {
    let mk = |s: &[usize], std: f64, g: &mut Rng| {
        let t = Tensor::randn(s.to_vec(), std, DType::F32, Device::Cpu, g).unwrap();
        t.set_requires_grad(true).unwrap();
        t
    };
    vec![
        Tensor::ones([D], DType::F32, Device::Cpu).unwrap(), // norm weight (requires grad: set in run)
        mk(&[H * HD, D], 0.2, g),
        mk(&[HKV * HD, D], 0.2, g),
        mk(&[HKV * HD, D], 0.2, g),
        mk(&[D, H * HD], 0.2, g),
        mk(&[FF, D], 0.2, g),
        mk(&[FF, D], 0.2, g),
        mk(&[D, FF], 0.2, g),
    ]
}

/// Attention + SwiGLU MLP with residuals. x: (B, T, D).
fn block(x: &Tensor, p: &[Tensor]) -> Result<Tensor> {
    let (b, t) = (x.dim(0), x.dim(1));
    let h = rms_norm(x, &p[0], 1e-5)?;
    let heads = |w: &Tensor, n: usize| h.matmul(&w.t()?)?.reshape([b, t, n, HD])?.permute(&[0, 2, 1, 3]);
    let (q, k, v) = (heads(&p[1], H)?, heads(&p[2], HKV)?, heads(&p[3], HKV)?);
    let a = causal_attention(&q, &k, &v, 0.35)?.permute(&[0, 2, 1, 3])?.reshape([b, t, D])?;
    let x = x.add(&a.matmul(&p[4].t()?)?)?;
    let h = rms_norm(&x, &p[0], 1e-5)?;
    x.add(&swiglu(&h.matmul(&p[5].t()?)?, &h.matmul(&p[6].t()?)?)?.matmul(&p[7].t()?)?)
}

/// -> (bytes held after forward beyond the parameters and input, gradients)
fn run(ckpt: bool) -> (usize, Vec<Vec<f32>>) {
    let g = &mut Rng::new(5);
    let layers: Vec<Vec<Tensor>> = (0..3).map(|_| params(g)).collect();
    for l in &layers {
        l[0].set_requires_grad(true).unwrap();
    }
    let x = Tensor::randn([2, 32, D], 1.0, DType::F32, Device::Cpu, g).unwrap(); // (B, T, D)
    x.set_requires_grad(true).unwrap();
    let base = live_bytes();
    let mut h = x.clone();
    for p in &layers {
        h = if ckpt {
            let p = p.clone();
            recompute(&[h], move |xs| block(&xs[0], &p)).unwrap()
        } else {
            block(&h, p).unwrap()
        };
    }
    let loss = h.sqr().unwrap().mean_all().unwrap();
    drop(h);
    let held = live_bytes() - base;
    loss.backward().unwrap();
    drop(loss);
    let mut grads = vec![x.grad().unwrap().to_vec::<f32>().unwrap()];
    for p in layers.iter().flatten() {
        grads.push(p.grad().unwrap().to_vec::<f32>().unwrap());
    }
    (held, grads)
}

#[test]
fn checkpointing_saves_memory_with_bitwise_equal_gradients() {
    let (plain_bytes, plain) = run(false);
    let (ckpt_bytes, ckpt) = run(true);
    eprintln!("live bytes after forward: plain {plain_bytes}, checkpointed {ckpt_bytes}");
    assert_eq!(plain.len(), ckpt.len());
    for (i, (a, b)) in plain.iter().zip(&ckpt).enumerate() {
        assert!(a == b, "gradient {i} differs with checkpointing");
    }
    // Three segments keep only their inputs and outputs (3 x B*T*D floats, plus the loss
    // path); the plain run keeps every activation (norms, q/k/v, attention output, MLP).
    assert!(ckpt_bytes < plain_bytes, "checkpointed {ckpt_bytes} >= plain {plain_bytes}");
    assert!(ckpt_bytes * 3 < plain_bytes, "checkpointing should save most activations: {ckpt_bytes} vs {plain_bytes}");
}
