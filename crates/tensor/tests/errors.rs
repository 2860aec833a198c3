//! Bad user input returns `Err` naming the op ("op: message" in Display), never a panic.
mod common;
use common::*;
use ferrolm_tensor::{DType, Device, Rng, Tensor};

#[test]
fn shape_errors() {
    expect_err(f32s(&[2, 3]).matmul(&f32s(&[4, 2])), "matmul", "inner dims");
    expect_err(f32s(&[3]).matmul(&f32s(&[3, 2])), "matmul", "at least 2 dims");
    expect_err(f32s(&[2, 2, 3]).matmul(&f32s(&[3, 3, 2])), "matmul", "broadcast");
    expect_err(f32s(&[2, 3]).add(&f32s(&[4])), "add", "broadcast");
    expect_err(f32s(&[2, 3]).mul(&f32s(&[3, 2])), "mul", "broadcast");
    expect_err(f32s(&[2, 3]).reshape([5]), "reshape", "6 elements");
    expect_err(f32s(&[2, 3]).narrow(1, 2, 2), "narrow", "outside");
    expect_err(f32s(&[2, 3]).narrow(2, 0, 1), "narrow", "outside");
    expect_err(f32s(&[2, 3]).narrow(0, 1, usize::MAX), "narrow", "outside");
    expect_err(f32s(&[2, 3]).permute(&[0, 0]), "permute", "not a permutation");
    expect_err(f32s(&[2, 3]).permute(&[0, 1, 2]), "permute", "not a permutation");
    expect_err(f32s(&[2, 3]).permute(&[2, 0]), "permute", "not a permutation");
    expect_err(f32s(&[2, 3]).transpose(0, 2), "transpose", "out of range");
    expect_err(f32s(&[3]).t(), "t", "at least 2 dims");
    expect_err(Tensor::cat(&[f32s(&[2, 3]), f32s(&[3, 3])], 1), "cat", "differ outside dim 1");
    expect_err(Tensor::cat(&[f32s(&[2, 3]), f32s(&[2, 3, 1])], 0), "cat", "invalid");
    expect_err(Tensor::cat(&[f32s(&[2, 3])], 2), "cat", "invalid");
    expect_err(Tensor::cat(&[], 0), "cat", "at least one");
    expect_err(Tensor::stack(&[f32s(&[2]), f32s(&[3])], 0), "cat", "differ");
    expect_err(f32s(&[2, 3]).split(&[1, 1], 1), "split", "do not add up");
    expect_err(f32s(&[2, 3]).chunk(2, 1), "chunk", "equal chunks");
    expect_err(f32s(&[2, 3]).chunk(0, 1), "chunk", "equal chunks");
    expect_err(f32s(&[2, 3]).squeeze(0), "squeeze", "not of size 1");
    expect_err(f32s(&[2, 3]).unsqueeze(3), "unsqueeze", "out of range");
    expect_err(f32s(&[2, 3]).flatten(1, 2), "flatten", "bad dims");
    expect_err(f32s(&[2, 3]).broadcast_as([3, 3]), "broadcast_as", "cannot broadcast");
    expect_err(f32s(&[2, 3]).broadcast_as([3]), "broadcast_as", "cannot broadcast");
    expect_err(f32s(&[2, 3]).sum(&[2], false), "sum", "out of range");
    expect_err(f32s(&[2, 3]).mean(&[5], true), "mean", "out of range");
    expect_err(f32s(&[2, 3]).max(&[2], true), "max", "out of range");
    expect_err(Tensor::from_vec(vec![1.0f32; 5], [2, 3], CPU), "from_vec", "do not fill");
    expect_err(f32s(&[2, 3]).item(), "item", "not 1");
    expect_err(f32s(&[2, 3]).assign(&f32s(&[3, 2])), "assign", "shape mismatch");
    expect_err(f32s(&[2, 3]).linear(&f32s(&[4, 2])), "linear", "(out, in)");
    expect_err(f32s(&[2, 3]).linear(&f32s(&[3])), "linear", "(out, in)");
    expect_err(f32s(&[2, 3]).linear_plus(&f32s(&[4, 3]), &f32s(&[2, 3])), "linear_plus", "residual");
    expect_err(f32s(&[2, 3]).linear_plus(&f32s(&[4, 2]), &f32s(&[2, 4])), "linear_plus", "(out, in)");
    expect_err(f32s(&[]).linear(&f32s(&[2, 1])), "linear", "(out, in)");
    expect_err(f32s(&[2, 3]).matmul_into(&f32s(&[4, 2]), None, None), "matmul_into", "(k, n)");
    expect_err(f32s(&[2, 2, 3]).matmul_into(&f32s(&[3, 2]), None, None), "matmul_into", "(k, n)");
    expect_err(f32s(&[2, 3]).matmul_into(&f32s(&[3, 4]), Some(&f32s(&[4, 2])), None), "matmul_into", "addend");
    expect_err(f32s(&[2, 3]).matmul_into(&f32s(&[3, 4]), None, Some(&f32s(&[2, 3]))), "matmul_into", "destination");
    let dest_t = f32s(&[4, 2]);
    expect_err(f32s(&[2, 3]).matmul_into(&f32s(&[3, 4]), None, Some(&dest_t.t().unwrap())), "matmul_into", "dense");
}

#[test]
fn dtype_errors() {
    let (a, b) = (f32s(&[2]), Tensor::zeros([2], DType::F64, CPU).unwrap());
    expect_err(a.add(&b), "add", "dtype mismatch");
    expect_err(f32s(&[2, 2]).matmul(&Tensor::zeros([2, 2], DType::F64, CPU).unwrap()), "matmul", "dtype mismatch");
    let i = ids(&[1, 2], &[2]);
    expect_err(i.exp(), "exp", "float");
    expect_err(i.add(&a), "add", "float");
    expect_err(a.add(&i), "add", "dtype mismatch");
    expect_err(i.sum(&[0], false), "sum", "float");
    expect_err(ids(&[1, 2, 3, 4], &[2, 2]).matmul(&ids(&[1, 2, 3, 4], &[2, 2])), "matmul", "float");
    expect_err(i.set_requires_grad(true).map(|_| ()), "set_requires_grad", "float");
    expect_err(a.to_vec::<f64>(), "to_vec", "f32");
    expect_err(Tensor::cat(&[a.clone(), b.clone()], 0), "cat", "mixed dtypes");
    // casts to and from i32 are allowed and exact for small integers
    let back = a.add_scalar(3.0).unwrap().to_dtype(DType::I32).unwrap();
    assert_eq!(back.to_vec::<i32>().unwrap(), vec![3, 3]);
    assert_eq!(i.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
}

#[test]
fn device_errors() {
    let cuda = Device::Cuda(0);
    expect_err(Tensor::from_vec(vec![1.0f32; 4], [2, 2], cuda), "from_vec", "no backend registered for cuda:0");
    expect_err(Tensor::zeros([2, 2], DType::F32, cuda), "full", "no backend registered for cuda:0");
    expect_err(Tensor::randn([2], 1.0, DType::F32, cuda, &mut Rng::new(0)), "to_device", "no backend registered");
    expect_err(f32s(&[2]).to_device(cuda), "to_device", "no backend registered for cuda:0");
    expect_err("tpu".parse::<Device>(), "device", "unknown device");
    assert_eq!("cuda:3".parse::<Device>().unwrap(), Device::Cuda(3));
}

#[test]
fn autograd_errors() {
    let x = f32s(&[2, 2]);
    expect_err(x.sum_all().unwrap().backward(), "backward", "does not require grad");
    let p = param(&f32s(&[2, 2]));
    expect_err(p.mul_scalar(2.0).unwrap().backward(), "backward", "one element");
    let y = p.exp().unwrap();
    expect_err(y.set_requires_grad(true).map(|_| ()), "set_requires_grad", "leaf");
}
