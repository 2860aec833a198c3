//! Every CUDA kernel against the CPU reference backend on fresh random inputs (several shapes,
//! odd sizes). New device buffers are poisoned with NaN (FERROLM_CUDA_POISON=1) so an unwritten
//! output element fails; every element is compared. Tolerances: f32 |d| <= 1e-4 + 1e-4 |ref|
//! (1e-3 for GEMM/attention sums), bf16 |d| <= 2e-2 + 2e-2 |ref| (the CPU widens bf16 to f32
//! and rounds once; the GPU rounds intermediates such as P in attention to bf16).
//! With no CUDA device the tests print "skipped: no CUDA device" and pass, unless
//! FERROLM_REQUIRE_GPU=1, where they fail.
use ferrolm_cuda::{CudaBackend, KernelImage};
use ferrolm_tensor::{DType, Device, Rng, Tensor};

mod common;
use common::{gpu, GPU, SOURCES};

fn rng(seed: u64) -> Rng {
    Rng::new(seed)
}
fn randn(shape: &[usize], dt: DType, r: &mut Rng) -> Tensor {
    Tensor::randn(shape.to_vec(), 1.0, dt, Device::Cpu, r).unwrap()
}
fn tol(dt: DType, loose: bool) -> (f64, f64) {
    match (dt, loose) {
        (DType::BF16, _) => (2e-2, 2e-2),
        (_, true) => (1e-3, 1e-3),
        _ => (1e-4, 1e-4),
    }
}
fn check(name: &str, cpu: &Tensor, gpu: &Tensor, dt: DType, loose: bool) {
    assert_eq!(cpu.dims(), gpu.dims(), "{name}: shape");
    let (a, b) = (cpu.to_vec_f64().unwrap(), gpu.to_cpu_storage().map(|_| gpu.to_vec_f64().unwrap()).unwrap());
    let (at, rt) = tol(dt, loose);
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(y.is_finite() || !x.is_finite(), "{name}: element {i} is {y} (reference {x}): unwritten or overflow");
        assert!((x - y).abs() <= at + rt * x.abs(), "{name}: element {i}: gpu {y} vs cpu {x}");
    }
}
fn to_gpu(t: &Tensor) -> Tensor {
    t.to_device(GPU).unwrap()
}

#[test]
fn elementwise_and_broadcast() {
    let Some(_) = gpu() else { return };
    let mut r = rng(1);
    for dt in [DType::F32, DType::BF16] {
        for shape in [vec![7usize], vec![3, 5, 33], vec![2, 1, 4, 129]] {
            let x = randn(&shape, dt, &mut r);
            let xp = x.affine(0.5, 2.0).unwrap(); // positive for log/sqrt/pow
            let g = to_gpu(&x);
            let gp = to_gpu(&xp);
            check("neg", &x.neg().unwrap(), &g.neg().unwrap(), dt, false);
            check("exp", &x.exp().unwrap(), &g.exp().unwrap(), dt, false);
            check("silu", &x.silu().unwrap(), &g.silu().unwrap(), dt, false);
            check("log", &xp.abs_like().log().unwrap(), &gp.abs_like().log().unwrap(), dt, false);
            check("powf", &xp.sqr().unwrap().powf(1.5).unwrap(), &gp.sqr().unwrap().powf(1.5).unwrap(), dt, false);
            check("affine", &x.affine(-3.0, 0.25).unwrap(), &g.affine(-3.0, 0.25).unwrap(), dt, false);
            // broadcast: a row vector against the whole tensor
            let last = *shape.last().unwrap();
            let row = randn(&[last], dt, &mut r);
            let growi = to_gpu(&row);
            check("add_bcast", &x.add(&row).unwrap(), &g.add(&growi).unwrap(), dt, false);
            check("mul_bcast", &x.mul(&row).unwrap(), &g.mul(&growi).unwrap(), dt, false);
            check("div", &x.div(&xp).unwrap(), &g.div(&gp).unwrap(), dt, false);
            check("sub", &x.sub(&xp).unwrap(), &g.sub(&gp).unwrap(), dt, false);
            check("eq", &x.eq_mask(&x).unwrap(), &g.eq_mask(&g).unwrap(), dt, false);
            for d in 0..shape.len() {
                check("sum", &x.sum_keepdim(&[d]).unwrap(), &g.sum_keepdim(&[d]).unwrap(), dt, true);
                check("max", &x.max(&[d], true).unwrap(), &g.max(&[d], true).unwrap(), dt, false);
            }
            check("cast", &x.to_dtype(DType::F32).unwrap(), &g.to_dtype(DType::F32).unwrap(), dt, false);
        }
    }
}

trait AbsLike {
    fn abs_like(&self) -> Tensor;
}
impl AbsLike for Tensor {
    /// sqrt(x^2 + 1): positive, defined on both backends with existing ops.
    fn abs_like(&self) -> Tensor {
        self.sqr().unwrap().add_scalar(1.0).unwrap().sqrt().unwrap()
    }
}

#[test]
fn matmul_shapes() {
    let Some(_) = gpu() else { return };
    let mut r = rng(2);
    for dt in [DType::F32, DType::BF16] {
        for (b, m, k, n) in [(1, 1, 1, 1), (1, 17, 33, 9), (3, 64, 128, 96), (2, 5, 7, 3)] {
            let a = randn(&[b, m, k], dt, &mut r);
            let w = randn(&[b, k, n], dt, &mut r);
            check("matmul", &a.matmul(&w).unwrap(), &to_gpu(&a).matmul(&to_gpu(&w)).unwrap(), dt, true);
        }
    }
}

/// Runs `f` on CPU and GPU copies of `inputs`, back-propagates a random cotangent and compares
/// the output and every input gradient.
fn fwd_bwd(name: &str, dt: DType, inputs: &[Tensor], loose: bool, f: impl Fn(&[Tensor]) -> Tensor) {
    let mut r = rng(99);
    let run = |dev: Device, cot: Option<&Tensor>| {
        let xs: Vec<Tensor> = inputs
            .iter()
            .map(|x| {
                let t = x.to_device(dev).unwrap().detach();
                if t.dtype() != DType::I32 {
                    t.set_requires_grad(true).unwrap();
                }
                t
            })
            .collect();
        let y = f(&xs);
        (xs, y, cot.map(|c| c.to_device(dev).unwrap()))
    };
    let (cx, cy, _) = run(Device::Cpu, None);
    let cot = randn(cy.dims(), cy.dtype(), &mut r);
    let (gx, gy, gcot) = run(GPU, Some(&cot));
    check(name, &cy, &gy, dt, loose);
    cy.mul(&cot).unwrap().sum_all().unwrap().backward().unwrap();
    gy.mul(gcot.as_ref().unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
    for (i, (c, g)) in cx.iter().zip(&gx).enumerate() {
        if let (Some(a), Some(b)) = (c.grad(), g.grad()) {
            check(&format!("{name}.grad[{i}]"), &a, &b, dt, true);
        }
    }
}

#[test]
fn fused_norm_rope_swiglu_softmax() {
    let Some(_) = gpu() else { return };
    let mut r = rng(3);
    for dt in [DType::F32, DType::BF16] {
        for (n, d) in [(1, 8), (37, 96), (130, 1000)] {
            let x = randn(&[n, d], dt, &mut r);
            let w = randn(&[d], dt, &mut r);
            fwd_bwd("rmsnorm", dt, &[x.clone(), w], true, |t| t[0].rms_norm(&t[1], 1e-5).unwrap());
            fwd_bwd("softmax", dt, std::slice::from_ref(&x), true, |t| t[0].softmax_last().unwrap());
            let u = randn(&[n, d], dt, &mut r);
            fwd_bwd("swiglu", dt, &[x, u], true, |t| Tensor::swiglu(&t[0], &t[1]).unwrap());
        }
        for (b, h, t, d) in [(1, 1, 1, 2), (2, 3, 17, 64), (1, 2, 33, 128)] {
            let x = randn(&[b, h, t, d], dt, &mut r);
            let cos = randn(&[t, d], dt, &mut r);
            let sin = randn(&[t, d], dt, &mut r);
            fwd_bwd("rope", dt, &[x], true, |v| {
                v[0].rope(&cos.to_device(v[0].device()).unwrap(), &sin.to_device(v[0].device()).unwrap()).unwrap()
            });
        }
    }
}

#[test]
fn embedding_fwd_bwd_deterministic() {
    let Some(_) = gpu() else { return };
    let mut r = rng(4);
    for dt in [DType::F32, DType::BF16] {
        for (vocab, d, n) in [(5, 3, 7), (300, 65, 1500), (1000, 128, 64)] {
            let w = randn(&[vocab, d], dt, &mut r);
            let ids: Vec<i32> = (0..n).map(|i| ((i * 7919 + 13) % vocab) as i32).collect();
            let ids = Tensor::from_vec(ids, vec![n], Device::Cpu).unwrap();
            fwd_bwd("embedding", dt, &[ids, w], false, |t| Tensor::embedding(&t[0], &t[1]).unwrap());
        }
    }
}

#[test]
fn cross_entropy_with_ignore() {
    let Some(_) = gpu() else { return };
    let mut r = rng(5);
    for dt in [DType::F32, DType::BF16] {
        for (n, v) in [(1, 2), (9, 1001), (64, 32000)] {
            let x = randn(&[n, v], dt, &mut r);
            let t: Vec<i32> = (0..n).map(|i| if i % 4 == 3 { -100 } else { ((i * 131) % v) as i32 }).collect();
            let t = Tensor::from_vec(t, vec![n], Device::Cpu).unwrap();
            fwd_bwd("cross_entropy", dt, &[x, t], true, |a| Tensor::cross_entropy(&a[0], &a[1], -100).unwrap());
        }
    }
}

#[test]
fn flash_attention_fwd_bwd_gqa() {
    let Some(_) = gpu() else { return };
    let mut r = rng(6);
    // (dtype, b, hq, hkv, t, d): bf16 d64/d128 take the tensor-core path, the rest SIMT.
    let cases = [
        (DType::BF16, 1, 2, 2, 1, 64),
        (DType::BF16, 2, 4, 2, 77, 64),
        (DType::BF16, 1, 8, 2, 130, 128),
        (DType::BF16, 1, 2, 1, 19, 32),
        (DType::F32, 2, 4, 1, 45, 64),
        (DType::F32, 1, 2, 2, 17, 40),
    ];
    for (dt, b, hq, hkv, t, d) in cases {
        let q = randn(&[b, hq, t, d], dt, &mut r);
        let k = randn(&[b, hkv, t, d], dt, &mut r);
        let v = randn(&[b, hkv, t, d], dt, &mut r);
        let scale = 1.0 / (d as f64).sqrt();
        fwd_bwd(&format!("attention {dt} b{b} hq{hq} hkv{hkv} t{t} d{d}"), dt, &[q, k, v], true, |x| {
            Tensor::causal_attention(&x[0], &x[1], &x[2], scale).unwrap()
        });
    }
}

#[test]
fn no_gpu_is_reported_without_panicking() {
    // Must hold everywhere: probing never panics, and a missing device is an Err, not a crash.
    let n = ferrolm_cuda::device_count();
    if n == 0 {
        assert!(!ferrolm_cuda::is_available());
        assert!(CudaBackend::new(0, KernelImage::Sources(SOURCES)).is_err());
    }
}
