//! The 4-bit dequantize kernel (kernels/nf4.cu) on the CUDA device (the GPU, else the CPU
//! emulator) against the CPU's `Quant4::dequantize_*`, bit for bit: the kernel rounds each product
//! and sum in f32 one at a time as the CPU does. New device buffers are poisoned with NaN
//! (FERROLM_CUDA_POISON=1), so an element the kernel does not write fails. Shapes cover whole
//! 32-element groups, a tail of single elements (n % 32), an odd count, several nested blocks,
//! block sizes 64 and 128, plain absmax and FP4. Without a device the test prints "skipped: no
//! CUDA device" and passes, unless FERROLM_REQUIRE_GPU=1 / FERROLM_REQUIRE_EMU=1.
#[path = "../../cuda/tests/common/mod.rs"]
mod common;
use common::*;
use ferrolm_ops::nf4::{dequantize_cuda, DeviceQuant4, OrigDtype, Quant4, QuantSpec, QuantType};
use ferrolm_tensor::{CpuStorage, DType, Rng};

fn host_bits(t: &ferrolm_tensor::Tensor) -> Vec<u32> {
    match t.to_device(ferrolm_tensor::Device::Cpu).unwrap().to_cpu_storage().unwrap() {
        CpuStorage::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
        CpuStorage::BF16(v) => v.iter().map(|x| x.to_bits() as u32).collect(),
        other => panic!("unexpected storage {:?}", other.dtype()),
    }
}

#[test]
fn dequantize_kernel_equals_the_cpu_bit_for_bit() {
    let Some(_gpu) = gpu() else { return };
    let mut r = Rng::new(53);
    let nf4 = QuantSpec::QLORA;
    let cases: Vec<(Vec<usize>, QuantSpec)> = vec![
        (vec![64, 128], nf4),                                            // whole groups, one nested block
        (vec![300, 200], nf4),                                           // 938 blocks: 4 nested blocks, a tail of 32
        (vec![7, 13], nf4),                                              // 91: no whole group but 2, odd
        (vec![1001], nf4),                                               // odd, a tail of 9
        (vec![96, 160], QuantSpec { blocksize: 128, ..nf4 }),            // larger blocks
        (vec![40, 96], QuantSpec { double_quant: false, ..nf4 }),        // plain f32 absmax
        (vec![33, 64], QuantSpec { quant_type: QuantType::Fp4, ..nf4 }), // FP4
    ];
    for (shape, spec) in cases {
        let n: usize = shape.iter().product();
        let mut vals: Vec<f32> = normals(n, 0.02, &mut r).iter().map(|&v| v as f32).collect();
        // A zero block and a constant block where the weight has them.
        if n >= 256 {
            vals[64..128].iter_mut().for_each(|v| *v = 0.0);
            vals[128..192].iter_mut().for_each(|v| *v = 0.01);
        }
        let q = Quant4::quantize("w", &vals, &shape, OrigDtype::F32, spec).unwrap();
        let dq = DeviceQuant4::upload(&q, "w", GPU).unwrap();
        for dt in [DType::F32, DType::BF16] {
            let got = dequantize_cuda(&dq, dt).unwrap();
            assert_eq!(got.shape().dims(), &shape[..]);
            assert_eq!(got.dtype(), dt);
            let want: Vec<u32> = match dt {
                DType::F32 => q.dequantize_f32().iter().map(|v| v.to_bits()).collect(),
                _ => q.dequantize_bf16().iter().map(|v| v.to_bits() as u32).collect(),
            };
            let got = host_bits(&got);
            if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
                panic!("{shape:?} {spec:?} to {dt}: element {i} is {:#x} on the device, {:#x} on the CPU", got[i], want[i]);
            }
        }
    }
}

#[test]
fn a_host_weight_is_refused_by_the_device_dequantize() {
    let q = Quant4::quantize("w", &[0.5; 64], &[64], OrigDtype::F32, QuantSpec::QLORA).unwrap();
    let dq = DeviceQuant4::upload(&q, "w", ferrolm_tensor::Device::Cpu).unwrap();
    let e = dequantize_cuda(&dq, DType::F32).unwrap_err().to_string();
    assert!(e.contains("on the host"), "{e}");
}
