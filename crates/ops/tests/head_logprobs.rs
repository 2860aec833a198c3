//! The per-row head (`head_logprobs`): each row's log-prob of its target from the fused, chunked
//! head, with a backward that takes a per-row upstream gradient. On the CPU: the values against
//! log_softmax of the whole logits; token cross-entropy written as an objective over the rows
//! (−Σ log-probs · s) bitwise the fused loss's gradients; finite differences in f64 with a random
//! per-row gradient; ignored rows 0 with no gradient; two vocabulary shards against one.
mod common;
mod threads;
use common::*;
use ferrolm_ops::{head_logprobs, head_logprobs_sharded, head_loss, HeadLossOptions, HeadRowsOptions, LossScale, Tokens};
use ferrolm_tensor::{DType, Result, Rng, Tensor};
use ferrolm_testing::tol::{assert_near as near, assert_same as same};
use std::sync::Arc;
use threads::Threads;

fn rows_opts(chunk: usize) -> HeadRowsOptions {
    HeadRowsOptions { ignore_index: IGNORE, chunk_tokens: chunk }
}

fn logprobs(x: &Tensor, w: &Tensor, t: &[i32], chunk: usize) -> Result<Tensor> {
    head_logprobs(x, w, &Tokens::upload(t.to_vec(), [t.len()], x.device())?, &rows_opts(chunk))
}

/// log_softmax(x W^T)[target] per row, in f64 on the host; 0 for ignored rows.
fn reference(x: &Tensor, w: &Tensor, t: &[i32]) -> Vec<f64> {
    let (xv, wv) = (x.to_vec_f64().unwrap(), w.to_vec_f64().unwrap());
    let (c, v) = (w.dim(1), w.dim(0));
    t.iter()
        .enumerate()
        .map(|(r, &tg)| {
            if tg == IGNORE {
                return 0.0;
            }
            let l: Vec<f64> = (0..v).map(|j| (0..c).map(|k| xv[r * c + k] * wv[j * c + k]).sum()).collect();
            let m = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + l.iter().map(|a| (a - m).exp()).sum::<f64>().ln();
            l[tg as usize] - lse
        })
        .collect()
}

/// The values are each row's log-prob of its target, whatever the chunks, 0 where ignored (a
/// chunk of ignored rows only among them); without grad the same values.
#[test]
fn the_values_are_each_rows_log_prob() {
    let g = &mut Rng::new(11);
    let (n, v, c) = (37, 101, 24);
    let x = Tensor::randn([n, c], 1.0, DType::F32, CPU, g).unwrap();
    let w = Tensor::randn([v, c], 0.5, DType::F32, CPU, g).unwrap();
    let t = targets(n, v, g, |i| i % 6 == 1 || (20..30).contains(&i));
    let want = reference(&x, &w, &t);
    for chunk in [1, 5, 37, 64] {
        let got = logprobs(&x, &w, &t, chunk).unwrap();
        assert_eq!(got.dims(), [n], "one value a row");
        near(&format!("chunks of {chunk}"), &got.to_vec_f64().unwrap(), &want, 1e-5);
        let got = got.to_vec_f64().unwrap();
        assert!(t.iter().zip(&got).all(|(&tg, &l)| (tg == IGNORE) == (l == 0.0) && l <= 0.0), "ignored rows give 0, others < 0");
    }
    let _ng = ferrolm_tensor::no_grad();
    let plain = logprobs(&leaf(&x), &w, &t, 5).unwrap();
    assert!(!plain.requires_grad());
    same("without grad", &plain.to_vec_f64().unwrap(), &logprobs(&x, &w, &t, 5).unwrap().to_vec_f64().unwrap());
}

/// Token cross-entropy as an objective over the rows, −s · Σ log-probs, has bitwise the fused
/// loss's dX and dW (each row's factor s in the same row kernel, the same GEMMs in the same
/// order), and its value to rounding (an f32 sum against the f64 one).
#[test]
fn token_cross_entropy_over_the_rows_is_the_fused_loss() {
    let g = &mut Rng::new(12);
    let (n, v, c) = (29, 53, 12);
    let x = Tensor::randn([n, c], 1.0, DType::F32, CPU, g).unwrap();
    let w = Tensor::randn([v, c], 0.5, DType::F32, CPU, g).unwrap();
    let t = targets(n, v, g, |i| i % 4 == 1);
    let s = 0.37;
    for chunk in [6, 29] {
        let o = HeadLossOptions { ignore_index: IGNORE, scale: LossScale::Sum(s), chunk_tokens: chunk };
        let want = on_leaves(&x, &w, |x, w| head_loss(x, w, &Tokens::upload(t.clone(), [n], x.device())?, &o));
        let got = on_leaves(&x, &w, |x, w| logprobs(x, w, &t, chunk)?.sum_all()?.mul_scalar(-s));
        near(&format!("chunks of {chunk}: loss"), &got.0, &want.0, 1e-6);
        same(&format!("chunks of {chunk}: dX"), &got.1, &want.1);
        same(&format!("chunks of {chunk}: dW"), &got.2, &want.2);
    }
}

/// Finite differences in f64 for x and W, a random weighting of the rows (the gradcheck's), so
/// each row's upstream gradient differs; chunks that do not divide the rows, ignored rows, x
/// with leading dims.
#[test]
fn grad_head_logprobs_against_finite_differences() {
    let g = &mut Rng::new(13);
    let (n, v, c) = (7, 11, 5);
    let t = targets(n, v, g, |i| i == 4);
    for chunk in [3, 7] {
        gradcheck(&format!("head_logprobs chunks of {chunk}"), &[randn(&[n, c], g), randn(&[v, c], g)], |a| {
            logprobs(&a[0], &a[1], &t, chunk)
        });
    }
    gradcheck("head_logprobs (b, t, c)", &[randn(&[1, n, c], g), randn(&[v, c], g)], |a| logprobs(&a[0], &a[1], &t, 2));
    // A segment sum (a sequence's log-prob) through the op: a per-row gradient of 0 or 1.
    let seg = Tensor::from_vec(vec![1.0f64, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0], [n], CPU).unwrap();
    gradcheck("a segment's sum", &[randn(&[n, c], g), randn(&[v, c], g)], |a| logprobs(&a[0], &a[1], &t, 3)?.mul(&seg)?.sum_all());
}

/// Ignored rows get no gradient: dX's rows are exactly 0 whatever their upstream gradient.
#[test]
fn ignored_rows_get_no_gradient() {
    let g = &mut Rng::new(14);
    let (n, v, c) = (12, 17, 6);
    let x = Tensor::randn([n, c], 1.0, DType::F32, CPU, g).unwrap();
    let w = Tensor::randn([v, c], 0.5, DType::F32, CPU, g).unwrap();
    let t = targets(n, v, g, |i| i % 3 == 0);
    let up = Tensor::randn([n], 1.0, DType::F32, CPU, g).unwrap();
    let (_, dx, dw) = on_leaves(&x, &w, |x, w| logprobs(x, w, &t, 5)?.mul(&up)?.sum_all());
    for (r, &tg) in t.iter().enumerate() {
        let row = &dx[r * c..(r + 1) * c];
        assert_eq!(tg == IGNORE, row.iter().all(|&d| d == 0.0), "row {r} (target {tg}): dX {row:?}");
    }
    assert!(dw.iter().any(|&d| d != 0.0));
    // Every row ignored: values 0 and no gradient at all.
    let all = vec![IGNORE; n];
    let (l, dx, dw) = on_leaves(&x, &w, |x, w| logprobs(x, w, &all, 5)?.mul(&up)?.sum_all());
    assert!(l == [0.0] && dx.iter().all(|&d| d == 0.0) && dw.iter().all(|&d| d == 0.0));
}

/// Two ranks, each with half the vocabulary rows, against one: the same weighted sum of the
/// values, dX summed over
/// the ranks, each rank's rows of dW, for a random per-row gradient.
#[test]
fn two_vocabulary_shards_match_one() {
    let g = &mut Rng::new(15);
    let (n, v, c) = (23, 30, 10);
    let x = Tensor::randn([n, c], 1.0, DType::F32, CPU, g).unwrap();
    let w = Tensor::randn([v, c], 0.5, DType::F32, CPU, g).unwrap();
    let t = targets(n, v, g, |i| (8..12).contains(&i) || i % 7 == 0);
    let up = Tensor::randn([n], 1.0, DType::F32, CPU, g).unwrap();
    let want = on_leaves(&x, &w, |x, w| logprobs(x, w, &t, 4)?.mul(&up)?.sum_all());
    let got = Threads::each(2, v, |sh| {
        let wr = w.narrow(0, sh.start, v / 2).unwrap();
        let sh = Arc::new(sh);
        on_leaves(&x, &wr, |x, w| {
            head_logprobs_sharded(x, w, &Tokens::upload(t.clone(), [n], CPU)?, &rows_opts(4), sh.clone())?.mul(&up)?.sum_all()
        })
    });
    for (rank, (l, _, dw)) in got.iter().enumerate() {
        near(&format!("rank {rank} weighted sum"), l, &want.0, 1e-6);
        near(&format!("rank {rank} dW"), dw, &want.2[rank * v / 2 * c..(rank + 1) * v / 2 * c], 1e-5);
    }
    let dx: Vec<f64> = got[0].1.iter().zip(&got[1].1).map(|(a, b)| a + b).collect();
    near("dX summed over the ranks", &dx, &want.1, 1e-5);
}

#[test]
fn errors_name_what_is_wrong() {
    let g = &mut Rng::new(16);
    let x = Tensor::randn([4, 6], 1.0, DType::F32, CPU, g).unwrap();
    let w = Tensor::randn([9, 6], 1.0, DType::F32, CPU, g).unwrap();
    expect_err(logprobs(&x, &w, &[0, 1, 2], 2), "head_logprobs", "one per row of x (4)");
    expect_err(logprobs(&x, &w, &[0, 1, 2, 3], 0), "head_logprobs", "at least one token");
    expect_err(logprobs(&x, &w, &[0, 1, 2, 9], 2), "cross_entropy", "out of range");
}
