//! The CUDA backend's primitive ops (element-wise, broadcast, reductions, casts, GEMM) against
//! the CPU reference backend on fresh random inputs (several shapes, odd sizes); the fused ops'
//! tests are crates/ops/tests/cuda.rs. New device buffers are poisoned with NaN
//! (FERROLM_CUDA_POISON=1) so an unwritten output element fails; every element is compared.
//! Tolerances: f32 |d| <= 1e-4 + 1e-4 |ref| (1e-3 for GEMM sums), bf16 |d| <= 2e-2 + 2e-2 |ref|
//! (the CPU widens bf16 to f32 and rounds once).
//! With no CUDA device the tests print "skipped: no CUDA device" and pass, unless
//! FERROLM_REQUIRE_GPU=1, where they fail.
use ferrolm_cuda::{CudaBackend, KernelImage};
use ferrolm_tensor::{DType, Device, Tensor};

mod common;
use common::*;
use ferrolm_testing::poison;

#[test]
fn elementwise_and_broadcast() {
    each_float_dtype(1, |dt, r| {
        for shape in [vec![7usize], vec![3, 5, 33], vec![2, 1, 4, 129]] {
            let x = randn(&shape, dt, r);
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
            let row = randn(&[last], dt, r);
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
    });
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
    each_float_dtype(2, |dt, r| {
        for (b, m, k, n) in [(1, 1, 1, 1), (1, 17, 33, 9), (3, 64, 128, 96), (2, 5, 7, 3)] {
            let a = randn(&[b, m, k], dt, r);
            let w = randn(&[b, k, n], dt, r);
            check("matmul", &a.matmul(&w).unwrap(), &to_gpu(&a).matmul(&to_gpu(&w)).unwrap(), dt, true);
        }
    });
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

/// `matmul_into` (the gradient GEMMs of `Tensor::linear`) on the device against the CPU's
/// composition (matmul, then add, then assign), with and without a scale (alpha): f32 written from bf16 or f32 operands into a
/// slice of a larger poisoned buffer (a parameter's range of an f32 gradient bucket), an addend
/// of the output's dtype, and transposed operands. The slice must be written whole and nothing
/// around it.
#[test]
fn matmul_into_writes_slices_and_adds_in_one_pass() {
    each_float_dtype(12, |dt, r| {
        for (m, k, n, off) in [(17, 33, 9, 3), (64, 128, 96, 64), (1, 5, 1, 1)] {
            let (a, b, at) = (randn(&[m, k], dt, r), randn(&[k, n], dt, r), randn(&[k, m], dt, r));
            let (ga, gb, gat) = (to_gpu(&a), to_gpu(&b), to_gpu(&at));
            let buf = poison::nan_filled(&[off + m * n + 5], DType::F32, GPU);
            let dest = buf.narrow(0, off, m * n).unwrap().reshape([m, n]).unwrap();
            let outside = |what: &str| {
                let v = buf.to_vec_f64().unwrap();
                assert!(v[..off].iter().chain(&v[off + m * n..]).all(|x| x.is_nan()), "{what}: written outside its slice");
            };
            // Into an f32 slice.
            let got = ga.matmul_into(&gb, None, Some(&dest)).unwrap();
            assert!(got.same_view(&dest), "the result is not the destination");
            check("matmul_into f32 slice", &a.matmul(&b).unwrap().to_dtype(DType::F32).unwrap(), &got, dt, true);
            outside("matmul_into f32 slice");
            // Plus an addend, into a new tensor of the operands' dtype.
            let acc = randn(&[m, n], dt, r);
            let got = ga.matmul_into(&gb, Some(&to_gpu(&acc)), None).unwrap();
            assert_eq!(got.dtype(), dt);
            check("matmul_into + acc", &acc.add(&a.matmul(&b).unwrap()).unwrap(), &got, dt, true);
            // A transposed left operand, an f32 addend, into the f32 slice.
            let acc32 = randn(&[m, n], DType::F32, r);
            let want = acc32.add(&at.t().unwrap().matmul(&b).unwrap().to_dtype(DType::F32).unwrap()).unwrap();
            let got = gat.t().unwrap().matmul_into(&gb, Some(&to_gpu(&acc32)), Some(&dest)).unwrap();
            check("matmul_into lhs^T + acc f32", &want, &got, dt, true);
            outside("matmul_into lhs^T + acc f32");
            // A transposed right operand (G^T X's shape: x (k, n) read as its transpose).
            let bt = randn(&[n, k], dt, r);
            let got = ga.matmul_into(&to_gpu(&bt).t().unwrap(), None, Some(&dest)).unwrap();
            check("matmul_into rhs^T", &a.matmul(&bt.t().unwrap()).unwrap().to_dtype(DType::F32).unwrap(), &got, dt, true);
            // Scaled by the GEMM's alpha (LoRA's s): plus an addend, and into the f32 slice, each
            // against the CPU's composition (the product, scaled, then added).
            for alpha in [2.0, -0.375] {
                let want = acc.add(&a.matmul(&b).unwrap().mul_scalar(alpha).unwrap()).unwrap();
                let cpu = a.matmul_into_scaled(&b, alpha, Some(&acc), None).unwrap();
                check(&format!("CPU matmul_into_scaled {alpha} + acc"), &want, &cpu, dt, false);
                let got = ga.matmul_into_scaled(&gb, alpha, Some(&to_gpu(&acc)), None).unwrap();
                check(&format!("matmul_into_scaled {alpha} + acc"), &want, &got, dt, true);
                let got = ga.matmul_into_scaled(&to_gpu(&bt).t().unwrap(), alpha, None, Some(&dest)).unwrap();
                let want = a.matmul(&bt.t().unwrap()).unwrap().to_dtype(DType::F32).unwrap().mul_scalar(alpha).unwrap();
                check(&format!("matmul_into_scaled {alpha} rhs^T f32 slice"), &want, &got, dt, true);
                outside("matmul_into_scaled f32 slice");
            }
        }
        // Wrong shapes and dtypes are named, not computed.
        let (a, b) = (to_gpu(&randn(&[3, 4], dt, r)), to_gpu(&randn(&[4, 2], dt, r)));
        let e = a.matmul_into(&b, Some(&to_gpu(&randn(&[2, 3], dt, r))), None).unwrap_err().to_string();
        assert!(e.contains("matmul_into") && e.contains("addend"), "{e}");
        let e = a.matmul_into(&b, None, Some(&Tensor::zeros([3, 3], DType::F32, GPU).unwrap())).unwrap_err().to_string();
        assert!(e.contains("destination"), "{e}");
        let e = a.matmul_into_scaled(&b, f64::NAN, None, None).unwrap_err().to_string();
        assert!(e.contains("matmul_into") && e.contains("scale"), "{e}");
    });
}

/// The linear op forward and backward on the device against the CPU, with x read by two layers
/// (so the second layer's dX GEMM adds onto the first's) and a weight whose gradient goes to an
/// f32 destination.
#[test]
fn linear_forward_and_backward() {
    each_float_dtype(13, |dt, r| {
        let (x, w1, w2) = (randn(&[2, 7, 24], dt, r), randn(&[40, 24], dt, r), randn(&[16, 24], dt, r));
        let cot = (randn(&[2, 7, 40], dt, r), randn(&[2, 7, 16], dt, r));
        let run = |dev: Device| {
            let p = |t: &Tensor| {
                let t = t.detach().to_device(dev).unwrap();
                t.set_requires_grad(true).unwrap();
                t
            };
            let (x, w1, w2) = (p(&x), p(&w1), p(&w2));
            let dest = poison::grad_dest(&w1);
            let (y1, y2) = (x.linear(&w1).unwrap(), x.linear(&w2).unwrap());
            let l = y1.mul(&cot.0.to_device(dev).unwrap()).unwrap().sum_all().unwrap();
            let l = l.add(&y2.mul(&cot.1.to_device(dev).unwrap()).unwrap().sum_all().unwrap()).unwrap();
            l.backward().unwrap();
            (y1, x.grad().unwrap(), w1.grad().unwrap(), w2.grad().unwrap(), dest)
        };
        let (c, g) = (run(Device::Cpu), run(GPU));
        check("linear fwd", &c.0, &g.0, dt, true);
        check("linear dx (two layers)", &c.1, &g.1, dt, true);
        check("linear dw (into f32)", &c.2, &g.2, dt, true);
        assert_eq!(g.2.dtype(), DType::F32);
        check("linear dw destination", &c.4, &g.4, dt, true);
        check("linear dw (value)", &c.3, &g.3, dt, true);
    });
}
