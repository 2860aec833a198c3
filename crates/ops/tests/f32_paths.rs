//! The f32 CPU kernels of the fused ops (vectorised loops, the polynomial `exp`) against the same
//! ops in f64 on the same inputs, forward and backward, at shapes that take the parallel and
//! vector paths (rows longer than a vector, ragged tails, GQA). Tolerance: 2e-5 relative to the
//! largest magnitude of each output, about a hundred f32 roundings.
use ferrolm_ops::{causal_attention, cross_entropy, rms_norm, swiglu};
use ferrolm_tensor::{DType, Device, Result, Rng, Tensor};

const TOL: f64 = 2e-5;

fn randn(shape: &[usize], g: &mut Rng) -> Tensor {
    Tensor::randn(shape.to_vec(), 1.0, DType::F64, Device::Cpu, g).unwrap()
}

/// Runs `f` on f32 and f64 copies of `ins` with a fixed weighting of the output; compares the
/// outputs and the input gradients.
fn check(name: &str, ins: &[Tensor], f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    let mut outs = Vec::new();
    for dt in [DType::F32, DType::F64] {
        let xs: Vec<Tensor> = ins
            .iter()
            .map(|x| {
                let x = x.to_dtype(dt).unwrap();
                x.set_requires_grad(true).unwrap();
                x
            })
            .collect();
        let y = f(&xs).unwrap();
        let w: Vec<f64> = (0..y.numel()).map(|i| ((i * 37) % 11) as f64 * 0.2 - 1.0).collect();
        let w = Tensor::from_vec(w, y.shape().clone(), Device::Cpu).unwrap().to_dtype(y.dtype()).unwrap();
        y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        let mut vals = vec![y.to_vec_f64().unwrap()];
        vals.extend(xs.iter().map(|x| x.grad().unwrap().to_vec_f64().unwrap()));
        outs.push(vals);
    }
    for (i, (a, b)) in outs[0].iter().zip(&outs[1]).enumerate() {
        let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
        let err = a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale;
        let what = if i == 0 { "forward".to_string() } else { format!("grad {}", i - 1) };
        assert!(err < TOL, "{name} {what}: f32 vs f64 relative error {err:.2e} >= {TOL:.0e}");
    }
}

#[test]
fn f32_fused_ops_match_f64() {
    let g = &mut Rng::new(5);
    // GQA (4 query heads over 2 kv heads), t = 67 (rows of scores with vector tails), d = 24.
    let ins = [randn(&[2, 4, 67, 24], g), randn(&[2, 2, 67, 24], g), randn(&[2, 2, 67, 24], g)];
    check("attention", &ins, |x| causal_attention(&x[0], &x[1], &x[2], 0.3));
    // Rows of 1000 classes (16-lane sums with a tail), 70 rows, logits spread to +-12.
    let logits = randn(&[70, 1000], g).mul_scalar(4.0).unwrap();
    let t: Vec<i32> = (0..70).map(|i| i * 131 % 1000).collect();
    let t = Tensor::from_vec(t, [70], Device::Cpu).unwrap();
    check("cross_entropy", &[logits], |x| cross_entropy(&x[0], &t, -100));
    // 40000 elements: the parallel path, and gate values deep in both tails of the sigmoid.
    let gate = randn(&[40, 1000], g).mul_scalar(6.0).unwrap();
    check("swiglu", &[gate, randn(&[40, 1000], g)], |x| swiglu(&x[0], &x[1]));
    check("rms_norm", &[randn(&[33, 259], g), randn(&[259], g)], |x| rms_norm(&x[0], &x[1], 1e-5));
}
