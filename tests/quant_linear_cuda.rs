//! The frozen 4-bit linear layer (`ferrolm_nn::quant_linear::QuantLinear`) on `cuda:0` (the GPU,
//! else the CPU emulator): its output and dX equal the CPU layer's (the same dequantized weight,
//! bit for bit; the GEMMs' sums within f32 rounding), and each pass is one dequantize launch and
//! one GEMM, counted by the kernel profile.
mod common;
use ferrolm::nn::quant_linear::QuantLinear;
use ferrolm::ops::nf4::{OrigDtype, Quant4, QuantSpec};
use ferrolm::{DType, Device, Tensor};
use ferrolm_cuda::profile;
use ferrolm_tensor::Rng;

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max) / scale
}

#[test]
fn a_4bit_layer_on_the_device_equals_the_cpu_in_one_dequantize_and_one_gemm_a_pass() {
    let Some(device) = common::cuda0_device() else { return };
    let (out, cin) = (96usize, 128usize);
    let mut r = Rng::new(53);
    let w = Tensor::randn([out, cin], 0.05, DType::F32, Device::Cpu, &mut r).unwrap().to_vec_f32().unwrap();
    let q = Quant4::quantize("w", &w, &[out, cin], OrigDtype::F32, QuantSpec::QLORA).unwrap();
    let (cpu, dev) = (QuantLinear::new("w", q.clone(), Device::Cpu).unwrap(), QuantLinear::new("w", q, device).unwrap());
    assert_eq!(
        dev.weight(DType::F32).unwrap().to_vec_f32().unwrap(),
        cpu.weight(DType::F32).unwrap().to_vec_f32().unwrap(),
        "the dequantized weight"
    );
    let x = Tensor::randn([3, 5, cin], 1.0, DType::F32, Device::Cpu, &mut r).unwrap();
    let c = Tensor::randn([3, 5, out], 1.0, DType::F32, Device::Cpu, &mut r).unwrap();
    let run = |layer: &QuantLinear, on: Device| {
        let x = x.to_device(on).unwrap().detach();
        x.set_requires_grad(true).unwrap();
        let y = layer.forward(&x).unwrap();
        y.mul(&c.to_device(on).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
        (y.to_vec_f32().unwrap(), x.grad().unwrap().to_vec_f32().unwrap())
    };
    let (y_cpu, dx_cpu) = run(&cpu, Device::Cpu);
    profile::enable(true);
    profile::reset();
    let (y_dev, dx_dev) = run(&dev, device);
    let rep = profile::report();
    profile::enable(false);
    println!("{}", rep.table());
    assert!(max_rel(&y_dev, &y_cpu) < 1e-5, "y: {}", max_rel(&y_dev, &y_cpu));
    assert!(max_rel(&dx_dev, &dx_cpu) < 1e-5, "dX: {}", max_rel(&dx_dev, &dx_cpu));
    let launches = |p: &str| rep.kernels.iter().filter(|k| k.name.starts_with(p)).map(|k| k.launches).sum::<u64>();
    assert_eq!(launches("nf4_dequant"), 2, "one dequantization in the forward, one in the backward");
    assert_eq!(launches("gemm"), 2, "y = x W^T and dX = dY W, no GEMM for the frozen weight's gradient");
}
