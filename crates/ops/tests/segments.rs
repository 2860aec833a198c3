//! Attention inside segments (packed rows) and RoPE at per-token positions on the CPU: each
//! segment of a row gives exactly what the segment alone gives (output and every gradient, to
//! the bit: the reference runs each segment as its own sequence), finite differences in f64 with
//! segments, and the errors a bad layout gets.
mod common;
use common::*;
use ferrolm_ops::{causal_attention, rope, rope_at, segment_attention, Segments, Tokens};
use ferrolm_tensor::{DType, Rng, Tensor};
use ferrolm_testing::segments::{cu, segments};

/// Segment layouts of rows of `t` tokens, by lengths: one segment, many short ones (one of
/// length 1), lengths that cross the CPU's 64-row blocks, and a trailing padding segment.
fn layouts() -> Vec<(usize, Vec<Vec<usize>>)> {
    vec![(9, vec![vec![9], vec![4, 5]]), (12, vec![vec![1, 3, 1, 7], vec![2, 2, 2, 2, 2, 2]]), (150, vec![vec![70, 1, 79], vec![130, 20]])]
}

/// The (b, h, t, d) tensor's positions [s, e) of row r, as a (1, h, e - s, d) tensor.
fn piece(x: &Tensor, r: usize, s: usize, e: usize) -> Tensor {
    x.narrow(0, r, 1).unwrap().narrow(2, s, e - s).unwrap().contiguous().unwrap()
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64().unwrap().iter().map(|v| v.to_bits()).collect()
}

/// Forward and backward of packed rows against each segment run alone through
/// `causal_attention`, in f32 and f64, with GQA: equal to the bit.
#[test]
fn each_segment_is_attended_as_if_alone() {
    let g = &mut Rng::new(31);
    for dt in [DType::F32, DType::F64] {
        for (t, rows) in layouts() {
            for (hq, hkv, d) in [(4, 2, 8), (2, 2, 16)] {
                let b = rows.len();
                let segs = segments(t, &rows);
                let name = format!("{dt} t{t} hq{hq} hkv{hkv} d{d} {rows:?}");
                let [q, k, v] = [hq, hkv, hkv].map(|h| param(&randn_dt(&[b, h, t, d], dt, g)));
                let cot = randn_dt(&[b, hq, t, d], dt, g);
                let o = segment_attention(&q, &k, &v, 0.3, &segs).unwrap();
                o.mul(&cot).unwrap().sum_all().unwrap().backward().unwrap();
                let (gq, gk, gv) = (q.grad().unwrap(), k.grad().unwrap(), v.grad().unwrap());
                for (r, lens) in rows.iter().enumerate() {
                    let bounds = cu(lens);
                    for w in bounds.windows(2) {
                        let (s, e) = (w[0] as usize, w[1] as usize);
                        let [qs, ks, vs] = [&q, &k, &v].map(|x| param(&piece(&x.detach(), r, s, e)));
                        let os = causal_attention(&qs, &ks, &vs, 0.3).unwrap();
                        os.mul(&piece(&cot, r, s, e)).unwrap().sum_all().unwrap().backward().unwrap();
                        let at = format!("{name} row {r} segment {s}..{e}");
                        assert_eq!(bits(&piece(&o, r, s, e)), bits(&os), "{at}: output");
                        for (what, packed, alone) in [("dq", &gq, &qs), ("dk", &gk, &ks), ("dv", &gv, &vs)] {
                            assert_eq!(bits(&piece(packed, r, s, e)), bits(&alone.grad().unwrap()), "{at}: {what}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn grad_segment_attention() {
    let g = &mut Rng::new(32);
    for (t, rows, hq, hkv, d) in
        [(7, vec![vec![3, 4], vec![1, 1, 5]], 4, 2, 4), (6, vec![vec![1, 2, 3]], 2, 1, 6), (5, vec![vec![5], vec![2, 1, 1, 1]], 3, 3, 4)]
    {
        let b = rows.len();
        let segs = segments(t, &rows);
        let ins = [randn(&[b, hq, t, d], g), randn(&[b, hkv, t, d], g), randn(&[b, hkv, t, d], g)];
        gradcheck(&format!("segment attention t{t} {rows:?} hq{hq} hkv{hkv} d{d}"), &ins, |x| {
            segment_attention(&x[0], &x[1], &x[2], 0.4, &segs)
        });
    }
    // (b, t, h, d) inputs permuted to (b, h, t, d), as a model produces them
    let segs = segments(6, &[vec![2, 4]]);
    let ins = [randn(&[1, 6, 4, 4], g), randn(&[1, 6, 2, 4], g), randn(&[1, 6, 2, 4], g)];
    gradcheck("segment attention permuted inputs", &ins, |x| {
        let p = |t: &Tensor| t.permute(&[0, 2, 1, 3]);
        segment_attention(&p(&x[0])?, &p(&x[1])?, &p(&x[2])?, 0.3, &segs)
    });
}

/// Rows that are one segment each are plain causal attention.
#[test]
fn whole_rows_are_causal_attention() {
    let g = &mut Rng::new(33);
    let [q, k, v] = [4, 2, 2].map(|h| randn(&[2, h, 11, 8], g));
    let a = segment_attention(&q, &k, &v, 0.5, &Segments::whole(2, 11).unwrap()).unwrap();
    let c = causal_attention(&q, &k, &v, 0.5).unwrap();
    assert_eq!(bits(&a), bits(&c));
}

/// Per-token positions: RoPE of packed rows equals RoPE of each segment alone at 0..len, in
/// either head layout, forward and backward.
#[test]
fn rope_at_positions_restarting_in_each_segment() {
    let g = &mut Rng::new(34);
    let (t, rows) = (10, vec![vec![4, 6], vec![1, 9]]);
    let (b, h, d) = (2, 3, 8);
    let (cos, sin) = rope_cos_sin(16, d, 100.0, DType::F64);
    let pos: Vec<i32> = rows.iter().flat_map(|r| r.iter().flat_map(|&l| 0..l as i32)).collect();
    let positions = Tokens::upload(pos, vec![b, t], CPU).unwrap();
    for time_major in [false, true] {
        let raw = randn(&[b, h, t, d], g);
        let x = if time_major { param(&raw.permute(&[0, 2, 1, 3]).unwrap().contiguous().unwrap()) } else { param(&raw) };
        let view = |x: &Tensor| if time_major { x.permute(&[0, 2, 1, 3]).unwrap() } else { x.clone() };
        let cot = randn(&[b, h, t, d], g);
        let y = rope_at(&view(&x), &cos, &sin, &positions).unwrap();
        y.mul(&cot).unwrap().sum_all().unwrap().backward().unwrap();
        let gx = view(&x.grad().unwrap());
        for (r, lens) in rows.iter().enumerate() {
            for w in cu(lens).windows(2) {
                let (s, e) = (w[0] as usize, w[1] as usize);
                let xs = param(&piece(&raw.detach(), r, s, e));
                let (c, sn) = (cos.narrow(0, 0, e - s).unwrap(), sin.narrow(0, 0, e - s).unwrap());
                let ys = rope(&xs, &c, &sn).unwrap();
                ys.mul(&piece(&cot, r, s, e)).unwrap().sum_all().unwrap().backward().unwrap();
                let at = format!("time-major {time_major} row {r} segment {s}..{e}");
                assert_eq!(bits(&piece(&y, r, s, e)), bits(&ys), "{at}: rope_at");
                assert_eq!(bits(&piece(&gx, r, s, e)), bits(&xs.grad().unwrap()), "{at}: its gradient");
            }
        }
    }
    let x = randn(&[b, h, t, d], g);
    gradcheck("rope_at", &[x], |x| rope_at(&x[0], &cos, &sin, &positions));
}

#[test]
fn bad_segments_and_positions_are_refused() {
    let err = |r: ferrolm_tensor::Result<Segments>| r.unwrap_err().to_string();
    assert!(err(Segments::new(8, vec![vec![1, 8]])).contains("from 0 to the row length 8"));
    assert!(err(Segments::new(8, vec![vec![0, 5]])).contains("from 0 to the row length 8"));
    assert!(err(Segments::new(8, vec![vec![0, 6, 3, 8]])).contains("decrease"));
    assert!(err(Segments::new(0, vec![vec![0]])).contains("1..="));
    // empty segments are allowed
    assert_eq!(Segments::new(4, vec![vec![0, 0, 2, 2, 4]]).unwrap().ranges(0).collect::<Vec<_>>(), [(0, 2), (2, 4)]);
    let g = &mut Rng::new(35);
    let [q, k, v] = [2, 2, 2].map(|h| randn(&[2, h, 6, 4], g));
    let e = segment_attention(&q, &k, &v, 1.0, &segments(6, &[vec![6]])).unwrap_err().to_string();
    assert!(e.contains("segments of 1 rows of 6 tokens for q of 2 rows of 6"), "{e}");
    let e = segment_attention(&q, &k, &v, 1.0, &segments(5, &[vec![5], vec![5]])).unwrap_err().to_string();
    assert!(e.contains("segments of 2 rows of 5 tokens"), "{e}");
    let (cos, sin) = rope_cos_sin(4, 4, 10.0, DType::F64);
    let pos = |p: Vec<i32>| Tokens::upload(p, vec![2, 6], CPU).unwrap();
    let e = rope_at(&q, &cos, &sin, &pos(vec![0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 0, 1])).unwrap_err().to_string();
    assert!(e.contains("position 4 is outside the tables' 4 positions"), "{e}");
    let e = rope_at(&q, &cos, &sin, &pos(vec![0, -1, 2, 3, 0, 0, 0, 1, 2, 3, 0, 1])).unwrap_err().to_string();
    assert!(e.contains("position -1"), "{e}");
    let short = Tokens::upload(vec![0; 6], vec![1, 6], CPU).unwrap();
    assert!(rope_at(&q, &cos, &sin, &short).unwrap_err().to_string().contains("positions must be i32 (2, 6)"));
}
