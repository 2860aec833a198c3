use ferrolm_tensor::{DType, Device, Tensor};

#[test]
fn matmul_and_backward() {
    let a = Tensor::from_vec(vec![1.0f64, 2., 3., 4., 5., 6.], [2, 3], Device::Cpu).unwrap();
    let b = Tensor::from_vec(vec![1.0f64, 0., 0., 1., 1., 1.], [3, 2], Device::Cpu).unwrap();
    a.set_requires_grad(true).unwrap();
    let c = a.matmul(&b).unwrap();
    assert_eq!(c.to_vec::<f64>().unwrap(), vec![4., 5., 10., 11.]);
    c.sum_all().unwrap().backward().unwrap();
    assert_eq!(a.grad().unwrap().to_vec::<f64>().unwrap(), vec![1., 1., 2., 1., 1., 2.]);
    let _ = DType::F32;
}
