//! CPU kernels on inputs large enough to take the multi-threaded paths (>= 32768 elements),
//! and layouts the small gradient checks do not reach (offset views, permuted batch dims,
//! in-place assign), against plain Rust loops. f64, tolerance 1e-12 relative.
mod common;
use common::*;
use ferrolm_tensor::{DType, Rng, Tensor};

#[test]
fn parallel_elementwise_and_reduce() {
    let g = &mut Rng::new(1);
    let (r, c) = (257, 161); // 41377 elements
    let x = randn(&[r, c], g);
    let y = randn(&[r, c], g);
    let (xv, yv) = (x.to_vec::<f64>().unwrap(), y.to_vec::<f64>().unwrap());
    close("exp", &x.exp().unwrap().to_vec().unwrap(), &xv.iter().map(|v| v.exp()).collect::<Vec<_>>());
    close("silu", &x.silu().unwrap().to_vec().unwrap(), &xv.iter().map(|v| v / (1.0 + (-v).exp())).collect::<Vec<_>>());
    close("mul", &x.mul(&y).unwrap().to_vec().unwrap(), &xv.iter().zip(&yv).map(|(a, b)| a * b).collect::<Vec<_>>());
    // broadcast row and strided operand
    let row = randn(&[c], g);
    let rv = row.to_vec::<f64>().unwrap();
    let want: Vec<f64> = (0..r * c).map(|i| xv[i] - rv[i % c]).collect();
    close("sub row", &x.sub(&row).unwrap().to_vec().unwrap(), &want);
    let xt = x.t().unwrap().contiguous().unwrap().t().unwrap(); // same values, column-major
    close("add strided", &xt.add(&y).unwrap().to_vec().unwrap(), &xv.iter().zip(&yv).map(|(a, b)| a + b).collect::<Vec<_>>());
    let s0: Vec<f64> = (0..c).map(|j| (0..r).map(|i| xv[i * c + j]).sum()).collect();
    let s1: Vec<f64> = (0..r).map(|i| xv[i * c..(i + 1) * c].iter().sum()).collect();
    close("sum 0", &x.sum(&[0], false).unwrap().to_vec().unwrap(), &s0);
    close("sum 1", &x.sum(&[1], false).unwrap().to_vec().unwrap(), &s1);
    close("sum 1 strided", &xt.sum(&[1], false).unwrap().to_vec().unwrap(), &s1);
    let m1: Vec<f64> = (0..r).map(|i| xv[i * c..(i + 1) * c].iter().cloned().fold(f64::MIN, f64::max)).collect();
    close("max 1", &x.max(&[1], false).unwrap().to_vec().unwrap(), &m1);
    close("sum dup-free", &x.sum(&[0, 1], false).unwrap().to_vec().unwrap(), &[s1.iter().sum()]);
    assert!(x.sum(&[1, 1], false).is_err(), "repeated dims are rejected");
}

#[test]
fn matmul_layouts() {
    let g = &mut Rng::new(2);
    // (h, b, t, d) permuted to (b, h, t, d): non-contiguous batch dims
    let a = randn(&[3, 2, 4, 5], g).permute(&[1, 0, 2, 3]).unwrap();
    let b = randn(&[2, 3, 5, 6], g);
    let want = a.contiguous().unwrap().matmul(&b).unwrap().to_vec::<f64>().unwrap();
    close("permuted batch", &a.matmul(&b).unwrap().to_vec().unwrap(), &want);
    // narrowed operands (non-zero offsets, inner strides)
    let big = randn(&[6, 9], g);
    let a = big.narrow(0, 2, 3).unwrap().narrow(1, 1, 4).unwrap();
    let b = big.narrow(0, 1, 4).unwrap().narrow(1, 5, 2).unwrap();
    let want = a.contiguous().unwrap().matmul(&b.contiguous().unwrap()).unwrap().to_vec::<f64>().unwrap();
    close("narrowed", &a.matmul(&b).unwrap().to_vec().unwrap(), &want);
    // explicit loop check of a 2-D product
    let (av, bv) = (a.to_vec::<f64>().unwrap(), b.to_vec::<f64>().unwrap());
    let mut c = vec![0.0; 3 * 2];
    for i in 0..3 {
        for j in 0..2 {
            c[i * 2 + j] = (0..4).map(|k| av[i * 4 + k] * bv[k * 2 + j]).sum();
        }
    }
    close("loops", &want, &c);
    // f32 through the same path
    let a32 = a.to_dtype(DType::F32).unwrap();
    let b32 = b.to_dtype(DType::F32).unwrap();
    assert!(rel_err(&a32.matmul(&b32).unwrap().to_vec_f64().unwrap(), &c) < 1e-5);
    // k = 0 gives zeros, m = 0 an empty result
    let z = Tensor::zeros([3, 0], DType::F64, CPU).unwrap().matmul(&Tensor::zeros([0, 2], DType::F64, CPU).unwrap()).unwrap();
    assert_eq!(z.to_vec::<f64>().unwrap(), vec![0.0; 6]);
}

#[test]
fn assign_in_place() {
    let g = &mut Rng::new(4);
    let x = Tensor::zeros([3, 4], DType::F32, CPU).unwrap();
    let src = randn(&[3, 2], g); // f64 source, converted
    x.narrow(1, 1, 2).unwrap().assign(&src).unwrap();
    let xv = x.to_vec::<f32>().unwrap();
    let sv = src.to_vec::<f64>().unwrap();
    for i in 0..3 {
        assert_eq!(xv[i * 4], 0.0);
        assert_eq!(xv[i * 4 + 1], sv[i * 2] as f32);
        assert_eq!(xv[i * 4 + 2], sv[i * 2 + 1] as f32);
        assert_eq!(xv[i * 4 + 3], 0.0);
    }
    // overlapping source and destination: x = x^T on a square matrix
    let m = randn(&[3, 3], g);
    let before = m.to_vec::<f64>().unwrap();
    m.assign(&m.t().unwrap()).unwrap();
    let after = m.to_vec::<f64>().unwrap();
    for i in 0..3 {
        for j in 0..3 {
            assert_eq!(after[i * 3 + j], before[j * 3 + i]);
        }
    }
}

#[test]
fn max_ties_split_the_gradient() {
    let x = param(&Tensor::from_vec(vec![1.0f64, 3.0, 3.0, 2.0, 5.0, 0.0], [2, 3], CPU).unwrap());
    x.max(&[1], false).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![0.0, 0.5, 0.5, 0.0, 1.0, 0.0]);
}
