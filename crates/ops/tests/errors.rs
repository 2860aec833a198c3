//! Bad input to a fused op returns `Err` naming the op ("op: message" in Display), never a panic.
mod common;
use common::*;
use ferrolm_ops::{causal_attention, cross_entropy, embedding, rms_norm, rope, softmax_last, swiglu};
use ferrolm_tensor::{DType, Rng, Tensor};

#[test]
fn fused_op_errors() {
    let g = &mut Rng::new(1);
    let x = randn_dt(&[2, 4], DType::F32, g);
    expect_err(rms_norm(&x, &f32s(&[3]), 1e-5), "rms_norm", "does not match");
    expect_err(rms_norm(&x, &f32s(&[4, 1]), 1e-5), "rms_norm", "does not match");
    // attention: heads not divisible, mismatched k/v, wrong rank
    let q = f32s(&[1, 3, 5, 4]);
    let kv = f32s(&[1, 2, 5, 4]);
    expect_err(causal_attention(&q, &kv, &kv, 0.5), "attention", "multiple of kv heads");
    expect_err(causal_attention(&f32s(&[1, 4, 5, 4]), &kv, &f32s(&[1, 2, 5, 6]), 0.5), "attention", "incompatible");
    expect_err(causal_attention(&f32s(&[1, 4, 5, 4]), &f32s(&[1, 2, 6, 4]), &f32s(&[1, 2, 6, 4]), 0.5), "attention", "incompatible");
    expect_err(causal_attention(&f32s(&[4, 5, 4]), &kv, &kv, 0.5), "attention", "(batch, heads, seq, head_dim)");
    expect_err(causal_attention(&f32s(&[1, 4, 5, 4]), &f32s(&[1, 0, 5, 4]), &f32s(&[1, 0, 5, 4]), 0.5), "attention", "multiple");
    // cross-entropy: target out of range, negative non-ignore target, wrong dtype, wrong shape
    let logits = randn_dt(&[3, 5], DType::F32, g);
    expect_err(cross_entropy(&logits, &ids(&[0, 5, 1], &[3]), -100), "cross_entropy", "out of range");
    expect_err(cross_entropy(&logits, &ids(&[0, -1, 1], &[3]), -100), "cross_entropy", "out of range");
    expect_err(cross_entropy(&logits, &f32s(&[3]), -100), "cross_entropy", "i32");
    expect_err(cross_entropy(&logits, &ids(&[0, 1], &[2]), -100), "cross_entropy", "shape");
    expect_err(cross_entropy(&f32s(&[3, 5, 1]), &ids(&[0, 1, 2], &[3]), -100), "cross_entropy", "matrix");
    expect_err(cross_entropy(&ids(&[0, 1, 2], &[1, 3]), &ids(&[0], &[1]), -100), "cross_entropy", "float");
    // embedding: id out of range, float ids, 1-D weight
    let w = f32s(&[4, 3]);
    expect_err(embedding(&ids(&[0, 4], &[2]), &w), "embedding", "out of range");
    expect_err(embedding(&ids(&[-1], &[1]), &w), "embedding", "out of range");
    expect_err(embedding(&f32s(&[2]), &w), "embedding", "i32");
    expect_err(embedding(&ids(&[0], &[1]), &f32s(&[4])), "embedding", "matrix");
    // rope: odd head dim, wrong table shape, wrong rank
    let (c, s) = rope_cos_sin(5, 4, 10000.0, DType::F32);
    expect_err(rope(&f32s(&[1, 2, 5, 3]), &c, &s), "rope", "even head_dim");
    expect_err(rope(&f32s(&[1, 2, 6, 4]), &c, &s), "rope", "cos/sin");
    expect_err(rope(&f32s(&[2, 5, 4]), &c, &s), "rope", "(batch, heads, seq, head_dim)");
    expect_err(swiglu(&f32s(&[2, 3]), &f32s(&[3, 2])), "swiglu", "differ in shape");
}

#[test]
fn fused_op_dtype_errors() {
    let (a, b) = (f32s(&[2]), Tensor::zeros([2], DType::F64, CPU).unwrap());
    let i = ids(&[1, 2], &[2]);
    expect_err(softmax_last(&i), "softmax", "float");
    expect_err(swiglu(&a, &b), "swiglu", "dtype mismatch");
    let x = f32s(&[1, 2, 3, 4]);
    expect_err(causal_attention(&x, &x, &x.to_dtype(DType::BF16).unwrap(), 1.0), "attention", "dtype mismatch");
    expect_err(rms_norm(&x, &Tensor::ones([4], DType::F64, CPU).unwrap(), 1e-5), "rms_norm", "dtype mismatch");
}
