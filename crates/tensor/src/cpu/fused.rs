//! CPU reference of the fused ops, each forward beside its backward. Rows run in parallel;
//! every gradient that sums over rows is summed in a fixed order, so results are deterministic.
use super::Stat;
use crate::backend::AttnDims;
use num_traits::Float;
use rayon::prelude::*;

fn c<T: Float>(v: f64) -> T {
    T::from(v).unwrap()
}

// ---- embedding ---------------------------------------------------------------------------

/// w: (vocab, d), ids: (n) -> (n, d)
pub fn embedding<T: Float>(w: &[T], d: usize, ids: &[i32]) -> Vec<T> {
    let mut out = Vec::with_capacity(ids.len() * d);
    for &i in ids {
        out.extend_from_slice(&w[i as usize * d..(i as usize + 1) * d]);
    }
    out
}

/// dy: (n, d) -> dw: (vocab, d), rows added in token order.
pub fn embedding_backward<T: Float>(dy: &[T], d: usize, ids: &[i32], vocab: usize) -> Vec<T> {
    let mut dw = vec![T::zero(); vocab * d];
    for (r, &i) in ids.iter().enumerate() {
        let dst = &mut dw[i as usize * d..(i as usize + 1) * d];
        for (a, &b) in dst.iter_mut().zip(&dy[r * d..(r + 1) * d]) {
            *a = *a + b;
        }
    }
    dw
}

// ---- softmax (last dim) --------------------------------------------------------------------

pub fn softmax<T: Float + Send + Sync>(x: &[T], d: usize) -> Vec<T> {
    let mut y = vec![T::zero(); x.len()];
    y.par_chunks_mut(d.max(1)).zip(x.par_chunks(d.max(1))).for_each(|(y, x)| {
        let m = x.iter().fold(T::neg_infinity(), |a, &b| a.max(b));
        let mut s = T::zero();
        for (o, &v) in y.iter_mut().zip(x) {
            *o = (v - m).exp();
            s = s + *o;
        }
        y.iter_mut().for_each(|o| *o = *o / s);
    });
    y
}

pub fn softmax_backward<T: Float + Send + Sync>(y: &[T], dy: &[T], d: usize) -> Vec<T> {
    let mut dx = vec![T::zero(); y.len()];
    dx.par_chunks_mut(d.max(1)).zip(y.par_chunks(d.max(1)).zip(dy.par_chunks(d.max(1)))).for_each(|(dx, (y, dy))| {
        let dot = y.iter().zip(dy).fold(T::zero(), |a, (&p, &g)| a + p * g);
        for ((o, &p), &g) in dx.iter_mut().zip(y).zip(dy) {
            *o = p * (g - dot);
        }
    });
    dx
}

// ---- RMSNorm -------------------------------------------------------------------------------

/// x: (n, d), w: (d) -> (y (n, d), inv_rms (n))
pub fn rmsnorm<T: Float + Send + Sync>(x: &[T], w: &[T], eps: f64) -> (Vec<T>, Stat<Vec<T>>) {
    let d = w.len().max(1);
    let mut y = vec![T::zero(); x.len()];
    let mut r = vec![T::zero(); x.len() / d];
    y.par_chunks_mut(d).zip(r.par_iter_mut()).zip(x.par_chunks(d)).for_each(|((y, r), x)| {
        let ms = x.iter().fold(T::zero(), |a, &v| a + v * v) / c(d as f64);
        *r = (ms + c(eps)).sqrt().recip();
        for ((o, &v), &g) in y.iter_mut().zip(x).zip(w) {
            *o = v * *r * g;
        }
    });
    (y, Stat(r))
}

/// -> (dx (n, d), dw (d))
pub fn rmsnorm_backward<T: Float + Send + Sync>(dy: &[T], x: &[T], w: &[T], r: &[T]) -> (Vec<T>, Vec<T>) {
    let d = w.len().max(1);
    let mut dx = vec![T::zero(); x.len()];
    dx.par_chunks_mut(d).zip(x.par_chunks(d).zip(dy.par_chunks(d))).zip(r.par_iter()).for_each(|((dx, (x, dy)), &r)| {
        // dx = r * (g - x * r^2 * mean(g * x)) with g = dy * w
        let gx = x.iter().zip(dy).zip(w).fold(T::zero(), |a, ((&xv, &g), &wv)| a + g * wv * xv) / c(d as f64);
        for (((o, &xv), &g), &wv) in dx.iter_mut().zip(x).zip(dy).zip(w) {
            *o = r * (g * wv - xv * r * r * gx);
        }
    });
    let mut dw = vec![T::zero(); d];
    for ((x, dy), &r) in x.chunks(d).zip(dy.chunks(d)).zip(r) {
        for ((a, &xv), &g) in dw.iter_mut().zip(x).zip(dy) {
            *a = *a + g * xv * r;
        }
    }
    (dx, dw)
}

// ---- RoPE (Hugging Face rotate_half convention) ---------------------------------------------

/// x: (b, h, t, d); cos, sin: (t, d). Forward: x*cos + rotate_half(x)*sin with
/// rotate_half(x) = cat(-x2, x1). `inverse` applies the transposed rotation (the backward).
pub fn rope<T: Float + Send + Sync>(x: &[T], cos: &[T], sin: &[T], t: usize, d: usize, inverse: bool) -> Vec<T> {
    let h = d / 2;
    let mut y = vec![T::zero(); x.len()];
    y.par_chunks_mut(t * d).zip(x.par_chunks(t * d)).for_each(|(y, x)| {
        for p in 0..t {
            let (xr, yr) = (&x[p * d..(p + 1) * d], &mut y[p * d..(p + 1) * d]);
            let (cr, sr) = (&cos[p * d..(p + 1) * d], &sin[p * d..(p + 1) * d]);
            for j in 0..h {
                if inverse {
                    yr[j] = xr[j] * cr[j] + xr[j + h] * sr[j + h];
                    yr[j + h] = xr[j + h] * cr[j + h] - xr[j] * sr[j];
                } else {
                    yr[j] = xr[j] * cr[j] - xr[j + h] * sr[j];
                    yr[j + h] = xr[j + h] * cr[j + h] + xr[j] * sr[j + h];
                }
            }
        }
    });
    y
}

// ---- SwiGLU --------------------------------------------------------------------------------

fn sigmoid<T: Float>(v: T) -> T {
    T::one() / (T::one() + (-v).exp())
}

pub fn swiglu<T: Float + Send + Sync>(g: &[T], u: &[T]) -> Vec<T> {
    g.par_iter().zip(u.par_iter()).map(|(&g, &u)| g * sigmoid(g) * u).collect()
}

pub fn swiglu_backward<T: Float + Send + Sync>(dy: &[T], g: &[T], u: &[T]) -> (Vec<T>, Vec<T>) {
    let dg = dy
        .par_iter()
        .zip(g.par_iter().zip(u.par_iter()))
        .map(|(&dy, (&g, &u))| {
            let s = sigmoid(g);
            dy * u * s * (T::one() + g * (T::one() - s))
        })
        .collect();
    let du = dy.par_iter().zip(g.par_iter()).map(|(&dy, &g)| dy * g * sigmoid(g)).collect();
    (dg, du)
}

// ---- causal attention with GQA --------------------------------------------------------------

fn dot<T: Float>(a: &[T], b: &[T]) -> T {
    a.iter().zip(b).fold(T::zero(), |s, (&x, &y)| s + x * y)
}

/// q: (b, hq, t, d), k/v: (b, hkv, t, d). Query head h reads kv head h / (hq / hkv), in place,
/// with no copy of K/V. -> (o (b, hq, t, d), lse (b, hq, t))
pub fn attention<T: Float + Send + Sync>(q: &[T], k: &[T], v: &[T], a: AttnDims, scale: f64) -> (Vec<T>, Stat<Vec<T>>) {
    let (t, d, group) = (a.t, a.d, a.hq / a.hkv);
    let sc: T = c(scale);
    let mut o = vec![T::zero(); q.len()];
    let mut lse = vec![T::zero(); a.b * a.hq * t];
    o.par_chunks_mut(t * d).zip(lse.par_chunks_mut(t)).enumerate().for_each(|(bh, (o, lse))| {
        let (b, h) = (bh / a.hq, bh % a.hq);
        let kv = (b * a.hkv + h / group) * t * d;
        let (qh, kh, vh) = (&q[bh * t * d..(bh + 1) * t * d], &k[kv..kv + t * d], &v[kv..kv + t * d]);
        let mut s = vec![T::zero(); t];
        for i in 0..t {
            let qi = &qh[i * d..(i + 1) * d];
            let mut m = T::neg_infinity();
            for j in 0..=i {
                s[j] = dot(qi, &kh[j * d..(j + 1) * d]) * sc;
                m = m.max(s[j]);
            }
            let mut l = T::zero();
            let oi = &mut o[i * d..(i + 1) * d];
            for j in 0..=i {
                let p = (s[j] - m).exp();
                l = l + p;
                for (x, &vv) in oi.iter_mut().zip(&vh[j * d..(j + 1) * d]) {
                    *x = *x + p * vv;
                }
            }
            oi.iter_mut().for_each(|x| *x = *x / l);
            lse[i] = m + l.ln();
        }
    });
    (o, Stat(lse))
}

/// -> (dq, dk, dv). Parallel over (batch, kv head); the query heads of a group are visited in
/// order so dk/dv sums are deterministic.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<T: Float + Send + Sync>(
    dout: &[T],
    q: &[T],
    k: &[T],
    v: &[T],
    o: &[T],
    lse: &[T],
    a: AttnDims,
    scale: f64,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let (t, d, group) = (a.t, a.d, a.hq / a.hkv);
    let sc: T = c(scale);
    let mut dq = vec![T::zero(); q.len()];
    let mut dk = vec![T::zero(); k.len()];
    let mut dv = vec![T::zero(); v.len()];
    dq.par_chunks_mut(group * t * d).zip(dk.par_chunks_mut(t * d).zip(dv.par_chunks_mut(t * d))).enumerate().for_each(
        |(bkv, (dqg, (dk, dv)))| {
            let (kh, vh) = (&k[bkv * t * d..(bkv + 1) * t * d], &v[bkv * t * d..(bkv + 1) * t * d]);
            let mut p = vec![T::zero(); t];
            for g in 0..group {
                let bh = bkv * group + g; // q heads of one kv head are contiguous
                let base = bh * t * d;
                let dqh = &mut dqg[g * t * d..(g + 1) * t * d];
                for i in 0..t {
                    let qi = &q[base + i * d..base + (i + 1) * d];
                    let doi = &dout[base + i * d..base + (i + 1) * d];
                    let di = dot(doi, &o[base + i * d..base + (i + 1) * d]);
                    let l = lse[bh * t + i];
                    for j in 0..=i {
                        p[j] = (dot(qi, &kh[j * d..(j + 1) * d]) * sc - l).exp();
                    }
                    for j in 0..=i {
                        let dp = dot(doi, &vh[j * d..(j + 1) * d]);
                        let ds = p[j] * (dp - di) * sc;
                        let (kj, dkj, dvj) = (&kh[j * d..(j + 1) * d], &mut dk[j * d..(j + 1) * d], &mut dv[j * d..(j + 1) * d]);
                        for x in 0..d {
                            dqh[i * d + x] = dqh[i * d + x] + ds * kj[x];
                            dkj[x] = dkj[x] + ds * qi[x];
                            dvj[x] = dvj[x] + p[j] * doi[x];
                        }
                    }
                }
            }
        },
    );
    (dq, dk, dv)
}

// ---- cross-entropy -------------------------------------------------------------------------

/// logits: (n, v) -> (mean loss over counted rows (1), lse (n)). Rows whose target is
/// `ignore` do not count; with no counted row the loss is 0.
pub fn cross_entropy<T: Float + Send + Sync>(logits: &[T], v: usize, t: &[i32], ignore: i32) -> (Vec<T>, Stat<Vec<T>>) {
    let lse: Vec<T> = logits
        .par_chunks(v.max(1))
        .map(|row| {
            let m = row.iter().fold(T::neg_infinity(), |a, &b| a.max(b));
            m + row.iter().fold(T::zero(), |a, &x| a + (x - m).exp()).ln()
        })
        .collect();
    // The mean over every counted row, summed in f64 (a batch holds up to millions of rows).
    let (mut sum, mut n) = (0f64, 0usize);
    for (r, &tg) in t.iter().enumerate() {
        if tg != ignore {
            sum += (lse[r] - logits[r * v + tg as usize]).to_f64().unwrap_or(f64::NAN);
            n += 1;
        }
    }
    (vec![if n == 0 { T::zero() } else { c(sum / n as f64) }], Stat(lse))
}

pub fn cross_entropy_backward<T: Float + Send + Sync>(logits: &[T], v: usize, t: &[i32], lse: &[T], ignore: i32, scale: f64) -> Vec<T> {
    let sc: T = c(scale);
    let mut d = vec![T::zero(); logits.len()];
    d.par_chunks_mut(v.max(1)).zip(logits.par_chunks(v.max(1))).enumerate().for_each(|(r, (d, x))| {
        if t[r] == ignore {
            return;
        }
        for (o, &xv) in d.iter_mut().zip(x) {
            *o = (xv - lse[r]).exp() * sc;
        }
        d[t[r] as usize] = d[t[r] as usize] - sc;
    });
    d
}
