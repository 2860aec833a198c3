//! A 4-bit linear layer holds no dequantized weight between its forward and its backward: the
//! autograd graph keeps the codes only, and each pass dequantizes W for its own GEMM and drops
//! it (`ferrolm_tensor::live_bytes` counts every tensor storage of the process; this binary runs
//! one test, so nothing else allocates meanwhile).
use ferrolm_nn::quant_linear::QuantLinear;
use ferrolm_ops::nf4::{OrigDtype, Quant4, QuantSpec};
use ferrolm_tensor::{live_bytes, peak_bytes, reset_peak_bytes, DType, Device, Rng, Tensor};

#[test]
fn no_dequantized_weight_lives_between_forward_and_backward() {
    let (out, cin, rows) = (512usize, 1024usize, 4usize);
    let mut r = Rng::new(53);
    let w = Tensor::randn([out, cin], 0.02, DType::F32, Device::Cpu, &mut r).unwrap().to_vec_f32().unwrap();
    let q = Quant4::quantize("w", &w, &[out, cin], OrigDtype::F32, QuantSpec::QLORA).unwrap();
    drop(w);
    let ql = QuantLinear::new("w", q, Device::Cpu).unwrap();
    let x = Tensor::randn([rows, cin], 1.0, DType::F32, Device::Cpu, &mut r).unwrap();
    x.set_requires_grad(true).unwrap();
    let weight_bytes = out * cin * 4; // 2 MiB in f32
    let before = live_bytes();
    reset_peak_bytes();
    let loss = ql.forward(&x).unwrap().sum_all().unwrap();
    let held = live_bytes() - before;
    assert!(peak_bytes() - before >= weight_bytes, "the forward dequantized W for its GEMM");
    assert!(held < weight_bytes / 8, "after the forward {held} bytes stay live: the dequantized W ({weight_bytes} bytes) was kept");
    reset_peak_bytes();
    let mid = live_bytes();
    loss.backward().unwrap();
    assert!(peak_bytes() - mid >= weight_bytes, "the backward dequantized W again for dX");
    assert!(x.grad().is_some_and(|g| g.dims() == [rows, cin]));
    drop(loss);
    let after = live_bytes() - before;
    assert!(after <= rows * cin * 4 + 4096, "after the backward {after} bytes stay live beside x's gradient");
}
