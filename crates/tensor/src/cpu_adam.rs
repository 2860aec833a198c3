//! AdamW on host memory, for optimizer state offloaded from the GPU: multi-threaded over
//! chunks, each chunk a plain loop the compiler vectorises (with AVX2 when the CPU has it,
//! chosen at run time). It reads fp32 gradients, updates fp32 master weights and moments in
//! place, and writes the bf16 compute copy of the weights for the copy back to the device.
//!
//! The arithmetic is the CUDA kernel's (`kernels/optim.cu`), term for term, so the two paths
//! agree to rounding: m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
//! w -= lr ((m / bc1) / (sqrt(v / bc2) + eps) + wd w).
//!
//! Traffic per parameter: reads g, w, m, v (16 bytes), writes w, m, v (12 bytes) and the
//! bf16 copy (2 bytes): 30 bytes, or 28 without the bf16 copy. The update is memory bound.
use crate::backend::AdamWHyper;
use crate::{bf16, Error, Result};
use rayon::prelude::*;

/// Elements per task: large enough to amortise scheduling, small enough to balance threads.
const CHUNK: usize = 1 << 14;

/// Bytes moved per parameter by one update (see the module comment).
pub fn bytes_per_param(with_bf16_copy: bool) -> usize {
    if with_bf16_copy {
        30
    } else {
        28
    }
}

/// The scalar constants of one step, in f32 as the kernel uses them.
#[derive(Clone, Copy)]
struct Consts {
    lr: f32,
    b1: f32,
    b2: f32,
    eps: f32,
    inv_bc1: f32,
    inv_bc2: f32,
    wd: f32,
}

impl Consts {
    fn new(h: &AdamWHyper, weight_decay: f64) -> Self {
        let step = h.step.max(1) as i32;
        Consts {
            lr: h.lr as f32,
            b1: h.beta1 as f32,
            b2: h.beta2 as f32,
            eps: h.eps as f32,
            inv_bc1: (1.0 / (1.0 - h.beta1.powi(step))) as f32,
            inv_bc2: (1.0 / (1.0 - h.beta2.powi(step))) as f32,
            wd: weight_decay as f32,
        }
    }
}

/// Round-to-nearest-even f32 -> bf16 (NaN stays NaN), as `__float2bfloat16_rn`.
#[inline(always)]
fn to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

#[inline(always)]
fn update(c: Consts, w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], out: Option<&mut [u16]>) {
    let n = w.len();
    let (w, m, v, g) = (&mut w[..n], &mut m[..n], &mut v[..n], &g[..n]);
    for i in 0..n {
        let gi = g[i];
        let mi = c.b1 * m[i] + (1.0 - c.b1) * gi;
        let vi = c.b2 * v[i] + (1.0 - c.b2) * gi * gi;
        let wi = w[i];
        let upd = (mi * c.inv_bc1) / ((vi * c.inv_bc2).sqrt() + c.eps) + c.wd * wi;
        m[i] = mi;
        v[i] = vi;
        w[i] = wi - c.lr * upd;
    }
    if let Some(out) = out {
        for (o, &wi) in out[..n].iter_mut().zip(w.iter()) {
            *o = to_bf16(wi);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn update_avx2(c: Consts, w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], out: Option<&mut [u16]>) {
    update(c, w, m, v, g, out)
}

fn update_chunk(c: Consts, w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], out: Option<&mut [u16]>) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above), the only requirement of a
        // `target_feature(enable = "avx2")` function; the body is safe code.
        return unsafe { update_avx2(c, w, m, v, g, out) };
    }
    update(c, w, m, v, g, out)
}

/// One AdamW update of `master`, `m`, `v` in place from `grad` (all of one length), writing
/// the bf16 copy of the new weights into `param_bf16` when given.
pub fn adamw_step(
    master: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    grad: &[f32],
    param_bf16: Option<&mut [bf16]>,
    h: &AdamWHyper,
    weight_decay: f64,
) -> Result<()> {
    let n = master.len();
    if m.len() != n || v.len() != n || grad.len() != n || param_bf16.as_ref().is_some_and(|p| p.len() != n) {
        return Err(Error::new(
            "cpu_adamw",
            format!(
                "lengths differ: master {n}, m {}, v {}, grad {}, bf16 copy {:?}",
                m.len(),
                v.len(),
                grad.len(),
                param_bf16.as_ref().map(|p| p.len())
            ),
        ));
    }
    let c = Consts::new(h, weight_decay);
    // bf16 is a transparent u16 newtype; view the output as raw bits for the rounding above.
    let out: Option<&mut [u16]> = param_bf16.map(|p| {
        let len = p.len();
        // SAFETY: `half::bf16` is `#[repr(transparent)]` over `u16`, so the slice has the same
        // layout, length and alignment; the borrow of `p` is moved into the new slice.
        unsafe { std::slice::from_raw_parts_mut(p.as_mut_ptr() as *mut u16, len) }
    });
    let chunks = master.par_chunks_mut(CHUNK).zip(m.par_chunks_mut(CHUNK)).zip(v.par_chunks_mut(CHUNK)).zip(grad.par_chunks(CHUNK));
    match out {
        Some(out) => chunks.zip(out.par_chunks_mut(CHUNK)).for_each(|((((w, m), v), g), o)| update_chunk(c, w, m, v, g, Some(o))),
        None => chunks.for_each(|(((w, m), v), g)| update_chunk(c, w, m, v, g, None)),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The update against the formula in f64, and the bf16 copy against `half`'s rounding.
    #[test]
    fn matches_the_formula_and_rounds_like_half() {
        let n = 3 * CHUNK + 17;
        let mut r = crate::Rng::new(1);
        let g: Vec<f32> = (0..n).map(|_| r.normal() as f32).collect();
        let w0: Vec<f32> = (0..n).map(|_| r.normal() as f32).collect();
        let (mut w, mut m, mut v) = (w0.clone(), vec![0.01f32; n], vec![0.02f32; n]);
        let mut out = vec![bf16::ZERO; n];
        let h = AdamWHyper { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, step: 3 };
        adamw_step(&mut w, &mut m, &mut v, &g, Some(&mut out), &h, 0.1).unwrap();
        let (bc1, bc2) = (1.0 - 0.9f64.powi(3), 1.0 - 0.95f64.powi(3));
        for i in 0..n {
            let (gi, wi) = (g[i] as f64, w0[i] as f64);
            let mi = 0.9 * 0.01f32 as f64 + 0.1 * gi;
            let vi = 0.95 * 0.02f32 as f64 + 0.05 * gi * gi;
            let want = wi - 1e-3 * ((mi / bc1) / ((vi / bc2).sqrt() + 1e-8) + 0.1 * wi);
            assert!((w[i] as f64 - want).abs() <= 1e-6 * want.abs().max(1e-3), "{i}: {} vs {want}", w[i]);
            assert_eq!(out[i], bf16::from_f32(w[i]), "{i}");
        }
        let e = adamw_step(&mut w, &mut m, &mut v[..5], &g, None, &h, 0.1).unwrap_err().to_string();
        assert!(e.contains("lengths differ"), "{e}");
    }
}
