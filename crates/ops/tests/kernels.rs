//! The fused ops' CPU kernels on inputs large enough to take the multi-threaded paths
//! (>= 32768 elements) and on layouts the small gradient checks do not reach (offset views,
//! strided ids), against plain Rust loops. f64, tolerance 1e-12 relative.
mod common;
use common::*;
use ferrolm_ops::{causal_attention, cross_entropy, embedding, rope, softmax_last};
use ferrolm_tensor::{DType, Rng};

#[test]
fn parallel_softmax() {
    let g = &mut Rng::new(1);
    let (r, c) = (257, 161); // 41377 elements
    let x = randn(&[r, c], g);
    let xv = x.to_vec::<f64>().unwrap();
    let m1: Vec<f64> = (0..r).map(|i| xv[i * c..(i + 1) * c].iter().cloned().fold(f64::MIN, f64::max)).collect();
    let sm: Vec<f64> = (0..r * c).map(|i| (xv[i] - m1[i / c]).exp()).collect();
    let z: Vec<f64> = (0..r).map(|i| sm[i * c..(i + 1) * c].iter().sum()).collect();
    let sm: Vec<f64> = sm.iter().enumerate().map(|(i, v)| v / z[i / c]).collect();
    close("softmax", &softmax_last(&x).unwrap().to_vec().unwrap(), &sm);
}

#[test]
fn fused_ops_on_offset_views() {
    let g = &mut Rng::new(3);
    // RoPE tables precomputed for 12 positions, used from position 3 on (a narrowed view with a
    // non-zero offset), must equal the formula at positions 3..3+t.
    let (t, d, theta) = (5, 6, 100.0);
    let (c, s) = rope_cos_sin(12, d, theta, DType::F64);
    let (c, s) = (c.narrow(0, 3, t).unwrap(), s.narrow(0, 3, t).unwrap());
    let x = randn(&[1, 2, t, d], g);
    let y = rope(&x, &c, &s).unwrap().to_vec::<f64>().unwrap();
    let xv = x.to_vec::<f64>().unwrap();
    let (cf, sf) = rope_tables(12, d, theta);
    let mut want = vec![0.0; xv.len()];
    for bh in 0..2 {
        for p in 0..t {
            for j in 0..d / 2 {
                let o = (bh * t + p) * d;
                let (cc, ss) = (cf[(p + 3) * d + j], sf[(p + 3) * d + j]);
                want[o + j] = xv[o + j] * cc - xv[o + j + d / 2] * ss;
                want[o + j + d / 2] = xv[o + j + d / 2] * cc + xv[o + j] * ss;
            }
        }
    }
    close("rope offset tables", &y, &want);
    // attention on q/k/v that are slices of one fused qkv projection (offsets, strides)
    let qkv = randn(&[1, 7, 8, 4], g); // (b, t, hq + 2*hkv, d) with hq = 4, hkv = 2
    let heads = |s: usize, n: usize| qkv.narrow(2, s, n).unwrap().permute(&[0, 2, 1, 3]).unwrap();
    let (q, k, v) = (heads(0, 4), heads(4, 2), heads(6, 2));
    let a = causal_attention(&q, &k, &v, 0.5).unwrap().to_vec::<f64>().unwrap();
    let n = naive_attention(&q, &k, &v, 0.5).unwrap().to_vec::<f64>().unwrap();
    close("attention on qkv slices", &a, &n);
    // embedding rows from an offset weight view, ids from a strided view
    let w = randn(&[10, 3], g);
    let wv = w.narrow(0, 4, 6).unwrap();
    let idt = ids(&[0, 5, 2, 5, 1, 3], &[2, 3]).t().unwrap();
    let e = embedding(&idt, &wv).unwrap().to_vec::<f64>().unwrap();
    let full = w.to_vec::<f64>().unwrap();
    let want: Vec<f64> = [0, 5, 5, 1, 2, 3].iter().flat_map(|&i| full[(i + 4) * 3..(i + 5) * 3].to_vec()).collect();
    close("embedding views", &e, &want);
    // cross-entropy with a strided target view
    let logits = randn(&[3, 4], g);
    let tg = ids(&[1, 9, 3, 9, 0, 9], &[3, 2]).narrow(1, 0, 1).unwrap().squeeze(1).unwrap();
    let l = cross_entropy(&logits, &tg, -100).unwrap().item().unwrap();
    let want = naive_cross_entropy(&logits, &[1, 3, 0], -100).unwrap().item().unwrap();
    assert!((l - want).abs() < 1e-12);
}
