//! The CUDA backend's primitive ops (element-wise, broadcast, reductions, casts, GEMM) against
//! the CPU reference backend on fresh random inputs (several shapes, odd sizes); the fused ops'
//! tests are crates/ops/tests/cuda.rs. New device buffers are poisoned with NaN
//! (FERROLM_CUDA_POISON=1) so an unwritten output element fails; every element is compared.
//! Tolerances: f32 |d| <= 1e-4 + 1e-4 |ref| (1e-3 for GEMM sums), bf16 |d| <= 2e-2 + 2e-2 |ref|
//! (the CPU widens bf16 to f32 and rounds once).
//! With no CUDA device the tests print "skipped: no CUDA device" and pass, unless
//! FERROLM_REQUIRE_GPU=1, where they fail.
use ferrolm_cuda::{CudaBackend, KernelImage};
use ferrolm_tensor::{DType, Tensor};

mod common;
use common::*;

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
