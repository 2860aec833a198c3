//! Sliding-window attention on the CPU (`causal_attention_window`, `segment_attention_window`):
//! forward and every gradient against a dense masked softmax in f64 written out here (several t,
//! windows 1, 2, t - 1, t and past t, GQA, packed rows, blocks of the reference crossed), finite
//! differences, a window of t or more equal to plain causal attention to the bit, window 0
//! refused, and the off-by-one against transformers' own sliding-window mask
//! (fixtures/sliding_window.txt, `scripts/make_window_fixture.py`).
mod common;
use common::*;
use ferrolm_ops::{causal_attention, causal_attention_window, segment_attention, segment_attention_window, Segments};
use ferrolm_tensor::{DType, Rng, Tensor};
use ferrolm_testing::segments::segments;
use std::collections::HashMap;
use std::path::PathBuf;

/// Each row's segment start for every position (0 everywhere without packing).
fn starts(t: usize, rows: Option<&[Vec<usize>]>, b: usize) -> Vec<Vec<usize>> {
    (0..b)
        .map(|r| {
            let mut v = vec![0; t];
            if let Some(rows) = rows {
                let mut s = 0;
                for &l in &rows[r] {
                    v[s..s + l].fill(s);
                    s += l;
                }
            }
            v
        })
        .collect()
}

/// Dense masked softmax attention in f64, as plain loops: query i of row r sees key j when
/// j <= i, j >= its segment start and i - w < j (w = None: no window). Returns o and, for the
/// output gradient g, (dq, dk, dv), all (b, heads, t, d) row-major.
#[allow(clippy::type_complexity)]
fn dense(
    [q, k, v, g]: [&[f64]; 4],
    [b, hq, hkv, t, d]: [usize; 5],
    scale: f64,
    w: Option<usize>,
    seg_start: &[Vec<usize>],
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut o, mut dq) = (vec![0.0; b * hq * t * d], vec![0.0; b * hq * t * d]);
    let (mut dk, mut dv) = (vec![0.0; b * hkv * t * d], vec![0.0; b * hkv * t * d]);
    let sees = |r: usize, i: usize, j: usize| j <= i && j >= seg_start[r][i] && w.is_none_or(|w| j + w > i);
    for r in 0..b {
        for h in 0..hq {
            let kh = h / (hq / hkv);
            let qi = |i: usize, x: usize| ((r * hq + h) * t + i) * d + x;
            let kj = |j: usize, x: usize| ((r * hkv + kh) * t + j) * d + x;
            for i in 0..t {
                let s: Vec<f64> = (0..t)
                    .map(|j| if sees(r, i, j) { (0..d).map(|x| q[qi(i, x)] * k[kj(j, x)]).sum::<f64>() * scale } else { f64::NEG_INFINITY })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let l: f64 = e.iter().sum();
                let p: Vec<f64> = e.iter().map(|x| x / l).collect();
                for x in 0..d {
                    o[qi(i, x)] = (0..t).map(|j| p[j] * v[kj(j, x)]).sum();
                }
                // dP_j = g_i . v_j; dS_j = P_j (dP_j - sum_l P_l dP_l)
                let dp: Vec<f64> = (0..t).map(|j| (0..d).map(|x| g[qi(i, x)] * v[kj(j, x)]).sum()).collect();
                let dd: f64 = (0..t).map(|j| p[j] * dp[j]).sum();
                for j in 0..t {
                    let ds = p[j] * (dp[j] - dd) * scale;
                    for x in 0..d {
                        dq[qi(i, x)] += ds * k[kj(j, x)];
                        dk[kj(j, x)] += ds * q[qi(i, x)];
                        dv[kj(j, x)] += p[j] * g[qi(i, x)];
                    }
                }
            }
        }
    }
    (o, dq, dk, dv)
}

/// The op's output and gradients of sum(o * g) for q, k, v (in `dt`).
fn op_fwd_bwd(ins: &[Tensor; 4], f: impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor) -> [Vec<f64>; 4] {
    let [q, k, v] = [&ins[0], &ins[1], &ins[2]].map(|x| param(&x.detach()));
    let o = f(&q, &k, &v);
    o.mul(&ins[3]).unwrap().sum_all().unwrap().backward().unwrap();
    [
        o.to_vec_f64().unwrap(),
        q.grad().unwrap().to_vec_f64().unwrap(),
        k.grad().unwrap().to_vec_f64().unwrap(),
        v.grad().unwrap().to_vec_f64().unwrap(),
    ]
}

#[track_caller]
fn close_to(name: &str, got: &[f64], want: &[f64], tol: f64) {
    let e = rel_err(got, want);
    assert!(e < tol, "{name}: max |got - want| / max(1, |want|) = {e:e} >= {tol:e}");
}

/// Forward and gradients against the dense f64 reference, in f64 (to 1e-10) and f32 (1e-5):
/// whole rows and packed rows, windows 1, 2, 7, t - 1, t and past t, GQA, t up to 150 (the
/// reference's 64-row blocks, windows reaching back over a block boundary).
#[test]
fn window_attention_matches_a_dense_masked_softmax() {
    let mut r = Rng::new(51);
    #[allow(clippy::type_complexity)]
    let cases: Vec<(usize, usize, usize, usize, usize, Option<Vec<Vec<usize>>>)> = vec![
        (2, 4, 2, 9, 4, None),
        (1, 2, 2, 17, 8, None),
        (1, 3, 1, 150, 4, None),
        (2, 4, 2, 12, 4, Some(vec![vec![5, 1, 6], vec![12]])),
        (2, 2, 1, 150, 4, Some(vec![vec![70, 1, 79], vec![1, 64, 85]])),
    ];
    for (b, hq, hkv, t, d, rows) in cases {
        let st = starts(t, rows.as_deref(), b);
        let segs = rows.as_ref().map(|rows| segments(t, rows));
        for w in [1, 2, 7, t - 1, t, t + 3] {
            let ins = [
                randn(&[b, hq, t, d], &mut r),
                randn(&[b, hkv, t, d], &mut r),
                randn(&[b, hkv, t, d], &mut r),
                randn(&[b, hq, t, d], &mut r),
            ];
            let vals: Vec<Vec<f64>> = ins.iter().map(|x| x.to_vec_f64().unwrap()).collect();
            let scale = 1.0 / (d as f64).sqrt();
            let (o, dq, dk, dv) = dense([&vals[0], &vals[1], &vals[2], &vals[3]], [b, hq, hkv, t, d], scale, Some(w), &st);
            for (dt, tol) in [(DType::F64, 1e-10), (DType::F32, 1e-5)] {
                let ins = ins.clone().map(|x| x.to_dtype(dt).unwrap());
                let got = op_fwd_bwd(&ins, |q, k, v| match &segs {
                    None => causal_attention_window(q, k, v, scale, Some(w)).unwrap(),
                    Some(s) => segment_attention_window(q, k, v, scale, s, Some(w)).unwrap(),
                });
                for (what, g, want) in [("o", &got[0], &o), ("dq", &got[1], &dq), ("dk", &got[2], &dk), ("dv", &got[3], &dv)] {
                    close_to(&format!("{dt} b{b} hq{hq} hkv{hkv} t{t} d{d} window {w} {rows:?}: {what}"), g, want, tol);
                }
            }
        }
    }
}

/// The dense reference is itself a window: with w = 1 every query sees only itself (o = v of its
/// kv head), and the test above would not notice a reference that ignored w.
#[test]
fn the_dense_reference_honours_the_window() {
    let mut r = Rng::new(7);
    let (b, hq, hkv, t, d) = (1, 2, 1, 6, 3);
    let ins =
        [randn(&[b, hq, t, d], &mut r), randn(&[b, hkv, t, d], &mut r), randn(&[b, hkv, t, d], &mut r), randn(&[b, hq, t, d], &mut r)];
    let vals: Vec<Vec<f64>> = ins.iter().map(|x| x.to_vec_f64().unwrap()).collect();
    let (o, ..) = dense([&vals[0], &vals[1], &vals[2], &vals[3]], [b, hq, hkv, t, d], 0.5, Some(1), &starts(t, None, b));
    close("window 1 is v", &o[..t * d], &vals[2]);
    let (full, ..) = dense([&vals[0], &vals[1], &vals[2], &vals[3]], [b, hq, hkv, t, d], 0.5, None, &starts(t, None, b));
    let naive = naive_attention(&ins[0], &ins[1], &ins[2], 0.5).unwrap().to_vec_f64().unwrap();
    close_to("no window is naive causal attention", &full, &naive, 1e-12);
}

/// Central differences in f64 through the windowed backward, whole and packed rows, GQA.
#[test]
fn grad_window_attention() {
    let g = &mut Rng::new(52);
    for (b, hq, hkv, t, d, w) in [(1, 2, 1, 7, 3, 1), (2, 2, 2, 6, 4, 2), (1, 4, 2, 9, 3, 4)] {
        let ins = [randn(&[b, hq, t, d], g), randn(&[b, hkv, t, d], g), randn(&[b, hkv, t, d], g)];
        gradcheck(&format!("window attention b{b} hq{hq} hkv{hkv} t{t} d{d} w{w}"), &ins, |x| {
            causal_attention_window(&x[0], &x[1], &x[2], 0.4, Some(w))
        });
    }
    let segs = segments(10, &[vec![4, 1, 5], vec![10]]);
    let ins = [randn(&[2, 4, 10, 3], g), randn(&[2, 2, 10, 3], g), randn(&[2, 2, 10, 3], g)];
    gradcheck("window segment attention", &ins, |x| segment_attention_window(&x[0], &x[1], &x[2], 0.3, &segs, Some(3)));
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64().unwrap().iter().map(|v| v.to_bits()).collect()
}

/// A window of t or more (or none) is plain causal attention to the bit, forward and backward;
/// a window of 0 is refused, naming it.
#[test]
fn window_of_t_or_more_is_causal_and_zero_is_refused() {
    let mut r = Rng::new(53);
    let t = 70;
    let segs = segments(t, &[vec![30, 40]]);
    for dt in [DType::F32, DType::F64] {
        let ins = [
            randn_dt(&[1, 4, t, 4], dt, &mut r),
            randn_dt(&[1, 2, t, 4], dt, &mut r),
            randn_dt(&[1, 2, t, 4], dt, &mut r),
            randn_dt(&[1, 4, t, 4], dt, &mut r),
        ];
        let want = op_fwd_bwd(&ins, |q, k, v| causal_attention(q, k, v, 0.3).unwrap());
        let want_seg = op_fwd_bwd(&ins, |q, k, v| segment_attention(q, k, v, 0.3, &segs).unwrap());
        for w in [None, Some(t), Some(t + 1), Some(usize::MAX)] {
            let got = op_fwd_bwd(&ins, |q, k, v| causal_attention_window(q, k, v, 0.3, w).unwrap());
            let got_seg = op_fwd_bwd(&ins, |q, k, v| segment_attention_window(q, k, v, 0.3, &segs, w).unwrap());
            for i in 0..4 {
                let b = |x: &[f64]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(b(&got[i]), b(&want[i]), "{dt} window {w:?}: output/gradient {i} differs from causal_attention");
                assert_eq!(b(&got_seg[i]), b(&want_seg[i]), "{dt} window {w:?}: output/gradient {i} differs from segment_attention");
            }
        }
        // t - 1 is a real window: it differs.
        let o = causal_attention_window(&ins[0], &ins[1], &ins[2], 0.3, Some(t - 1)).unwrap();
        assert_ne!(bits(&o), bits(&causal_attention(&ins[0], &ins[1], &ins[2], 0.3).unwrap()), "window t - 1 changed nothing");
    }
    let x = randn(&[1, 1, 4, 2], &mut r);
    expect_err(causal_attention_window(&x, &x, &x, 1.0, Some(0)), "attention", "sliding window 0");
    expect_err(segment_attention_window(&x, &x, &x, 1.0, &segments(4, &[vec![2, 2]]), Some(0)), "attention", "sliding window 0");
}

/// The fixture's tensors by name (`name dims.. : values..` lines).
fn fixture() -> HashMap<String, Tensor> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sliding_window.txt");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (head, vals) = l.split_once(':').unwrap();
            let mut head = head.split_whitespace();
            let name = head.next().unwrap().to_string();
            let dims: Vec<usize> = head.map(|x| x.parse().unwrap()).collect();
            let vals: Vec<f32> = vals.split_whitespace().map(|x| x.parse().unwrap()).collect();
            (name, Tensor::from_vec(vals, dims, CPU).unwrap())
        })
        .collect()
}

/// transformers' sliding window (Mistral/Qwen2 eager attention under
/// `create_sliding_window_causal_mask`) against ours in f32, to rel 1e-5: windows 1, 2, 5, t - 1,
/// t and past t, a whole row and a packed one (position_ids restarting at 0, which transformers
/// masks per sequence; ours: the segments they imply), and the gradients at window 5.
#[test]
fn window_matches_transformers() {
    let fx = fixture();
    let (q, k, v, g) = (&fx["q"], &fx["k"], &fx["v"], &fx["g"]);
    let (t, d) = (q.dim(2), q.dim(3));
    let pos: Vec<f32> = fx["positions"].to_vec().unwrap();
    // Segments: a new one wherever the position restarts at 0.
    let rows: Vec<Vec<u32>> =
        pos.chunks(t).map(|p| (0..t).filter(|&i| p[i] == 0.0).map(|i| i as u32).chain(std::iter::once(t as u32)).collect()).collect();
    assert_eq!(rows[1], vec![0, 5, 6, 12], "the fixture's packed row");
    let segs = Segments::new(t, rows).unwrap();
    let scale = 1.0 / (d as f64).sqrt();
    let mut windows = 0;
    for (name, want) in &fx {
        let Some(w) = name.strip_prefix("o_w") else { continue };
        let w: usize = w.parse().unwrap();
        let o = segment_attention_window(q, k, v, scale, &segs, Some(w)).unwrap();
        close_to(&format!("window {w}"), &o.to_vec_f64().unwrap(), &want.to_vec_f64().unwrap(), 1e-5);
        windows += 1;
    }
    assert_eq!(windows, 6, "the fixture's windows");
    // Off by one either way differs from transformers by far more than the tolerance.
    for w in [4, 6] {
        let o = segment_attention_window(q, k, v, scale, &segs, Some(w)).unwrap();
        assert!(rel_err(&o.to_vec_f64().unwrap(), &fx["o_w5"].to_vec_f64().unwrap()) > 1e-2, "window {w} looks like transformers' 5");
    }
    let got = op_fwd_bwd(&[q.clone(), k.clone(), v.clone(), g.clone()], |q, k, v| {
        segment_attention_window(q, k, v, scale, &segs, Some(5)).unwrap()
    });
    for (i, what) in ["dq_w5", "dk_w5", "dv_w5"].iter().enumerate() {
        close_to(what, &got[i + 1], &fx[*what].to_vec_f64().unwrap(), 1e-5);
    }
}
