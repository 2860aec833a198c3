//! The fused, chunked LM head + cross-entropy (`head_loss`) on the CPU against the unfused head
//! it replaces (`linear`, then `cross_entropy`): bitwise for f32 where the summation order
//! allows (the loss and dX always, dW when the chunks are whole 256-row GEMM slices), to
//! rounding elsewhere and in bf16; masks that ignore most rows, chunks that ignore all of theirs
//! and chunk sizes that do not divide the row count; the step's scale; a root gradient other than
//! 1; dW written into a gradient destination; finite differences in f64 for x and W; the
//! vocabulary split over two thread "ranks" against one; errors.
mod common;
mod threads;
use common::*;
use ferrolm_ops::{cross_entropy_tokens, head_loss, head_loss_sharded, HeadLossOptions, LossScale, Tokens};
use ferrolm_tensor::{no_grad, DType, Result, Rng, Tensor};
use ferrolm_testing::poison;
use ferrolm_testing::tol::{assert_near as near, assert_same as same};
use threads::Threads;

fn opts(chunk: usize) -> HeadLossOptions {
    HeadLossOptions { ignore_index: IGNORE, scale: LossScale::Mean, chunk_tokens: chunk }
}

fn unfused(x: &Tensor, w: &Tensor, t: &[i32]) -> Result<Tensor> {
    let logits = x.linear(w)?;
    cross_entropy_tokens(&logits, &Tokens::upload(t.to_vec(), [t.len()], x.device())?, IGNORE)
}

fn fused(x: &Tensor, w: &Tensor, t: &[i32], o: HeadLossOptions) -> Result<Tensor> {
    head_loss(x, w, &Tokens::upload(t.to_vec(), [t.len()], x.device())?, &o)
}

/// f32: the loss and dX bitwise the unfused head's whatever the chunks; dW to rounding (one
/// chunk: bitwise). Masks that ignore most rows, a chunk of ignored rows only, every row
/// ignored, and chunks of 1, 5 (not dividing 37), 37 and more than the rows.
#[test]
fn the_loss_and_dx_are_bitwise_the_unfused_heads_on_the_cpu() {
    let g = &mut Rng::new(1);
    let (n, v, c) = (37, 101, 24);
    let x = Tensor::randn([n, c], 1.0, DType::F32, CPU, g).unwrap();
    let w = Tensor::randn([v, c], 0.5, DType::F32, CPU, g).unwrap();
    let masks: Vec<(&str, Vec<i32>)> = vec![
        ("none ignored", targets(n, v, g, |_| false)),
        ("most ignored", targets(n, v, g, |i| i % 10 != 3)),
        ("rows 5..15 ignored", targets(n, v, g, |i| (5..15).contains(&i))),
        ("all ignored", targets(n, v, g, |_| true)),
    ];
    for (what, t) in &masks {
        let want = on_leaves(&x, &w, |x, w| unfused(x, w, t));
        for chunk in [1, 5, 37, 64] {
            let got = on_leaves(&x, &w, |x, w| fused(x, w, t, opts(chunk)));
            let case = format!("{what}, chunks of {chunk}");
            same(&format!("{case}: loss"), &got.0, &want.0);
            same(&format!("{case}: dX"), &got.1, &want.1);
            if chunk >= n {
                same(&format!("{case}: dW"), &got.2, &want.2);
            } else {
                near(&format!("{case}: dW"), &got.2, &want.2, 1e-6);
            }
        }
    }
    // Every row ignored: a loss of 0 and zero gradients, as unfused.
    let t = &masks[3].1;
    let (l, dx, dw) = on_leaves(&x, &w, |x, w| fused(x, w, t, opts(5)));
    assert!(l == [0.0] && dx.iter().all(|&d| d == 0.0) && dw.iter().all(|&d| d == 0.0));
}

/// dW is bitwise too when each chunk is a whole number of the CPU GEMM's 256-row depth slices
/// and so is the token count: the unfused GEMM sums the same slices in the same order.
#[test]
fn dw_is_bitwise_with_whole_gemm_slices() {
    let g = &mut Rng::new(2);
    let (n, v, c) = (512, 40, 16);
    let x = Tensor::randn([n, c], 1.0, DType::F32, CPU, g).unwrap();
    let w = Tensor::randn([v, c], 0.5, DType::F32, CPU, g).unwrap();
    let t = targets(n, v, g, |i| i % 3 == 0);
    let want = on_leaves(&x, &w, |x, w| unfused(x, w, &t));
    let got = on_leaves(&x, &w, |x, w| fused(x, w, &t, opts(256)));
    same("loss", &got.0, &want.0);
    same("dX", &got.1, &want.1);
    same("dW", &got.2, &want.2);
}

/// `LossScale::Sum(s)`: s times the sum over trained rows, so with s = 1 / trained rows the
/// mean; a gradient flowing in other than 1 scales both gradients; without grad only the loss
/// is computed, and it is the same.
#[test]
fn the_step_scale_and_the_incoming_gradient_scale_the_loss_and_gradients() {
    let g = &mut Rng::new(3);
    let (n, v, c) = (29, 53, 12);
    let x = Tensor::randn([n, c], 1.0, DType::F32, CPU, g).unwrap();
    let w = Tensor::randn([v, c], 0.5, DType::F32, CPU, g).unwrap();
    let t = targets(n, v, g, |i| i % 4 == 1);
    let trained = t.iter().filter(|&&v| v != IGNORE).count() as f64;
    let mean = on_leaves(&x, &w, |x, w| fused(x, w, &t, opts(6)));
    let s = 0.37 / trained;
    let sum = on_leaves(&x, &w, |x, w| fused(x, w, &t, HeadLossOptions { scale: LossScale::Sum(s), ..opts(6) }));
    let scaled = |v: &[f64]| v.iter().map(|a| a * 0.37).collect::<Vec<_>>();
    near("Sum loss", &sum.0, &scaled(&mean.0), 1e-6);
    near("Sum dX", &sum.1, &scaled(&mean.1), 1e-6);
    near("Sum dW", &sum.2, &scaled(&mean.2), 1e-6);
    // The root is loss * 2.5: the op's backward sees 2.5.
    let times = on_leaves(&x, &w, |x, w| fused(x, w, &t, opts(6))?.mul_scalar(2.5));
    let by = |v: &[f64]| v.iter().map(|a| a * 2.5).collect::<Vec<_>>();
    near("dX times 2.5", &times.1, &by(&mean.1), 1e-6);
    near("dW times 2.5", &times.2, &by(&mean.2), 1e-6);
    let _g = no_grad();
    let plain = fused(&x, &w, &t, opts(6)).unwrap();
    assert!(!plain.requires_grad());
    same("loss without grad", &plain.to_vec_f64().unwrap(), &mean.0);
}

/// dW goes into W's gradient destination (poisoned first) in the forward, and that view comes
/// back as W's gradient; another consumer of W (a tied embedding) adds its part.
#[test]
fn dw_lands_in_the_gradient_destination() {
    let g = &mut Rng::new(4);
    let (n, v, c) = (21, 33, 8);
    let x = Tensor::randn([n, c], 1.0, DType::F32, CPU, g).unwrap();
    let w = Tensor::randn([v, c], 0.5, DType::F32, CPU, g).unwrap();
    let t = targets(n, v, g, |i| i % 5 == 0);
    let want = on_leaves(&x, &w, |x, w| fused(x, w, &t, opts(4)));
    let (xl, wl) = (leaf(&x), leaf(&w));
    let dest = poison::grad_dest(&wl);
    fused(&xl, &wl, &t, opts(4)).unwrap().backward().unwrap();
    assert!(wl.grad().unwrap().same_view(&dest), "W's gradient is the destination itself");
    same("dW in the destination", &dest.to_vec_f64().unwrap(), &want.2);
    // Tied: the embedding of the ids reads W too; its gradient adds to the head's.
    let ids = Tokens::upload((0..n as i32).map(|i| (i * 7) % v as i32).collect(), [n], CPU).unwrap();
    let tied = |x: &Tensor, w: &Tensor| -> Result<Tensor> {
        let e = ferrolm_ops::embedding_tokens(&ids, w)?; // (n, c)
        fused(&x.add(&e)?, w, &t, opts(4))
    };
    let reference = on_leaves(&x, &w, |x, w| {
        let e = ferrolm_ops::embedding_tokens(&ids, w)?;
        unfused(&x.add(&e)?, w, &t)
    });
    let (xl, wl) = (leaf(&x), leaf(&w));
    poison::grad_dest(&wl);
    tied(&xl, &wl).unwrap().backward().unwrap();
    near("tied dW", &wl.grad().unwrap().to_vec_f64().unwrap(), &reference.2, 1e-6);
    near("tied dX", &xl.grad().unwrap().to_vec_f64().unwrap(), &reference.1, 1e-6);
}

/// bf16 against the f32 head on the same (rounded) values: to bf16 rounding.
#[test]
fn bf16_matches_f32_to_rounding() {
    let g = &mut Rng::new(5);
    let (n, v, c) = (40, 77, 32);
    let x = Tensor::randn([n, c], 1.0, DType::BF16, CPU, g).unwrap();
    let w = Tensor::randn([v, c], 0.5, DType::BF16, CPU, g).unwrap();
    let t = targets(n, v, g, |i| i % 3 == 2);
    let want = on_leaves(&x.to_dtype(DType::F32).unwrap(), &w.to_dtype(DType::F32).unwrap(), |x, w| unfused(x, w, &t));
    for chunk in [7, 40] {
        let got = on_leaves(&x, &w, |x, w| fused(x, w, &t, opts(chunk)));
        near(&format!("bf16 loss, chunks of {chunk}"), &got.0, &want.0, 1e-2);
        near(&format!("bf16 dX, chunks of {chunk}"), &got.1, &want.1, 2e-2);
        near(&format!("bf16 dW, chunks of {chunk}"), &got.2, &want.2, 2e-2);
    }
}

/// Finite differences in f64 for x and W, chunks of 3 over 7 rows, one row ignored, through a
/// random weighting of the loss (so the incoming gradient is not 1).
#[test]
fn grad_head_loss_against_finite_differences() {
    let g = &mut Rng::new(6);
    let (n, v, c) = (7, 11, 5);
    let t = targets(n, v, g, |i| i == 4);
    for (chunk, scale) in [(3, LossScale::Mean), (7, LossScale::Sum(0.25))] {
        let o = HeadLossOptions { scale, ..opts(chunk) };
        gradcheck(&format!("head_loss chunks of {chunk}"), &[randn(&[n, c], g), randn(&[v, c], g)], |a| fused(&a[0], &a[1], &t, o));
    }
    // x with leading dims, as the model passes (B, T, C).
    gradcheck("head_loss (b, t, c)", &[randn(&[1, n, c], g), randn(&[v, c], g)], |a| fused(&a[0], &a[1], &t, opts(2)));
}

/// Two ranks, each with half the vocabulary rows, against one: the same loss, dX summed over the
/// ranks, each rank's dW the rows it holds. Several chunks (the max of one is reduced while the
/// next one's GEMM runs), one of them all ignored.
#[test]
fn two_vocabulary_shards_match_one() {
    let g = &mut Rng::new(7);
    let (n, v, c) = (23, 30, 10);
    let x = Tensor::randn([n, c], 1.0, DType::F32, CPU, g).unwrap();
    let w = Tensor::randn([v, c], 0.5, DType::F32, CPU, g).unwrap();
    let t = targets(n, v, g, |i| (8..12).contains(&i) || i % 7 == 0);
    let want = on_leaves(&x, &w, |x, w| fused(x, w, &t, opts(4)));
    let got = Threads::each(2, v, |sh| {
        let wr = w.narrow(0, sh.start, v / 2).unwrap();
        on_leaves(&x, &wr, |x, w| head_loss_sharded(x, w, &Tokens::upload(t.clone(), [n], CPU)?, &opts(4), &sh))
    });
    for (rank, (l, _, dw)) in got.iter().enumerate() {
        near(&format!("rank {rank} loss"), l, &want.0, 1e-6);
        near(&format!("rank {rank} dW"), dw, &want.2[rank * v / 2 * c..(rank + 1) * v / 2 * c], 1e-5);
    }
    let dx: Vec<f64> = got[0].1.iter().zip(&got[1].1).map(|(a, b)| a + b).collect();
    near("dX summed over the ranks", &dx, &want.1, 1e-5);
}

#[test]
fn errors_name_what_is_wrong() {
    let g = &mut Rng::new(8);
    let x = Tensor::randn([4, 6], 1.0, DType::F32, CPU, g).unwrap();
    let w = Tensor::randn([9, 6], 1.0, DType::F32, CPU, g).unwrap();
    expect_err(fused(&x, &w, &[0, 1, 2, 9], opts(2)), "cross_entropy", "target 9 out of range for 9 classes");
    expect_err(fused(&x, &w, &[0, 1, 2], opts(2)), "head_loss", "one per row of x (4)");
    expect_err(fused(&x, &w.narrow(1, 0, 5).unwrap(), &[0, 1, 2, 3], opts(2)), "head_loss", "expects x (..., hidden)");
    expect_err(fused(&x, &w, &[0, 1, 2, 3], opts(0)), "head_loss", "at least one token");
    let nan = HeadLossOptions { scale: LossScale::Sum(f64::NAN), ..opts(2) };
    expect_err(fused(&x, &w, &[0, 1, 2, 3], nan), "head_loss", "not finite");
}
