//! Sums over 10^8 elements against an f64 reference, on the CPU and on the CUDA device (the
//! emulator where there is no GPU): the global gradient norm (`fused_global_norm`,
//! `clip_grad_norm`), `sum_all`, and the cross-entropy mean over millions of rows. A sequential
//! f32 fold, which these once were, is percents off at this size (each addition to a sum near
//! 2^27 rounds to a multiple of 16).
mod common;

use ferrolm::nn::optim::clip_grad_norm;
use ferrolm::tensor::fused_global_norm;
use ferrolm::{DType, Device, Tensor};

const N: usize = 100_000_000;
const TOL: f64 = 1e-6;

/// Values in [0.5, 1.5): all of one sign and size, the worst case for a long f32 fold.
fn values(n: usize, salt: u64) -> Vec<f32> {
    (0..n as u64).map(|i| 0.5 + ((i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ salt) >> 40) as f32 / (1u64 << 24) as f32).collect()
}

fn f64_sum_squares(v: &[f32]) -> f64 {
    v.iter().map(|&x| x as f64 * x as f64).sum()
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs()
}

/// The global norm of four gradients of 2.5 * 10^7 elements, through `fused_global_norm` and
/// `clip_grad_norm` (which clips by the exact factor when `clip` is set), and `sum_all` of the
/// raw values (the reduction the tensor-parallel loss and the op path use).
fn check_norms(device: Device, clip: bool) {
    let parts: Vec<Vec<f32>> = (0..4).map(|k| values(N / 4, k)).collect();
    let want = parts.iter().map(|p| f64_sum_squares(p)).sum::<f64>().sqrt();
    let want_sum: f64 = parts.iter().flatten().map(|&x| x as f64).sum();
    let grads: Vec<Tensor> = parts.iter().map(|p| Tensor::from_vec(p.clone(), [p.len()], device).unwrap()).collect();
    drop(parts);
    let got = fused_global_norm(&grads.iter().collect::<Vec<_>>()).unwrap().expect("a fused norm on this device");
    assert!(rel(got, want) < TOL, "{device}: fused_global_norm {got} vs f64 {want}");
    let sum: f64 = grads.iter().map(|g| g.sum_all().unwrap().item().unwrap()).sum();
    assert!(rel(sum, want_sum) < TOL, "{device}: sum_all {sum} vs f64 {want_sum}");
    let params: Vec<(String, Tensor)> = grads
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let p = Tensor::zeros([1], DType::F32, device).unwrap().broadcast_as([g.numel()]).unwrap();
            p.set_requires_grad(true).unwrap();
            p.set_grad(Some(g.clone()));
            (format!("p{i}"), p)
        })
        .collect();
    let max_norm = if clip { want / 2.0 } else { 2.0 * want };
    let norm = clip_grad_norm(&params, max_norm).unwrap();
    assert!(rel(norm, want) < TOL, "{device}: clip_grad_norm {norm} vs f64 {want}");
    let g0 = params[0].1.grad().unwrap().narrow(0, 0, 4).unwrap().to_vec_f64().unwrap();
    let x0 = grads[0].narrow(0, 0, 4).unwrap().to_vec_f64().unwrap();
    let factor = if clip { 0.5 } else { 1.0 };
    for (a, b) in g0.iter().zip(&x0) {
        assert!((a - b * factor).abs() <= 1e-6 * b.abs(), "{device}: clipped by the exact factor: {a} vs {}", b * factor);
    }
}

#[test]
fn gradient_norm_of_1e8_elements_on_the_cpu() {
    check_norms(Device::Cpu, true);
    // A strided view (every second element of 2 * 10^7) and bf16 take the same f64 path.
    let v = values(N / 5, 9);
    let want = v.iter().step_by(2).map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
    let t = Tensor::from_vec(v, [N / 10, 2], Device::Cpu).unwrap().narrow(1, 0, 1).unwrap();
    let got = fused_global_norm(&[&t]).unwrap().unwrap();
    assert!(rel(got, want) < TOL, "strided: {got} vs {want}");
    let b = t.to_dtype(DType::BF16).unwrap();
    let want_b = b.to_vec_f64().unwrap().iter().map(|x| x * x).sum::<f64>().sqrt();
    let got_b = fused_global_norm(&[&b]).unwrap().unwrap();
    assert!(rel(got_b, want_b) < TOL, "bf16: {got_b} vs {want_b}");
}

#[test]
fn gradient_norm_of_1e8_elements_on_cuda() {
    if !common::cuda0() {
        return;
    }
    // Not clipped: scaling 10^8 elements costs the emulator seconds and tests no reduction.
    check_norms(Device::Cuda(0), false);
}

/// The mean loss over 4M rows (two classes each): summed in f64, not a sequential f32 fold.
#[test]
fn cross_entropy_mean_over_millions_of_rows() {
    let rows = 1usize << 22;
    let logits: Vec<f32> = values(2 * rows, 3).iter().map(|x| x * 3.0).collect();
    let targets: Vec<i32> = (0..rows).map(|r| (r % 2) as i32).collect();
    let mut want = 0.0f64;
    for r in 0..rows {
        let (a, b) = (logits[2 * r] as f64, logits[2 * r + 1] as f64);
        let m = a.max(b);
        let lse = m + ((a - m).exp() + (b - m).exp()).ln();
        want += lse - logits[2 * r + targets[r] as usize] as f64;
    }
    want /= rows as f64;
    let x = Tensor::from_vec(logits, [rows, 2], Device::Cpu).unwrap();
    let y = Tensor::from_vec(targets, [rows], Device::Cpu).unwrap();
    let got = ferrolm::ops::cross_entropy(&x, &y, -100).unwrap().item().unwrap();
    assert!(rel(got, want) < TOL, "mean loss {got} vs f64 {want}");
}
