//! bf16 GEMM on AVX512-BF16 (`vdpbf16ps`): C (m, n) in f32 = A (m, k) · B (k, n), both bf16,
//! any strides. Each product of two bf16 is exact in f32 and the sums are f32, so the result is
//! what the f32 GEMM of the widened operands computes up to the order of the additions: two
//! k-steps are added per instruction and the k-steps are summed in order. Used by the CPU
//! backend for bf16 tensors where the CPU has AVX512-BF16 (detected at run time); elsewhere the
//! operands are widened to f32 and the f32 GEMM runs.
//!
//! B is packed once into panels of NR columns, each k-pair of a column as one 32-bit lane (the
//! layout `vdpbf16ps` reads); A is packed per task into MR-row panels of k-pairs. Tasks own
//! (MC rows, NC columns) tiles of C and run on rayon's pool; the microkernel keeps an MR x NR
//! f32 tile in 16 registers.
use half::bf16;
use rayon::prelude::*;

const MR: usize = 8;
const NR: usize = 32;
/// Rows and columns of C per task.
const MC: usize = 64;
const NC: usize = 256;

/// Whether this CPU runs `gemm` (AVX512-F and AVX512-BF16).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static A: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *A.get_or_init(|| {
            std::env::var("FERROLM_CPU_SIMD").map_or(true, |v| v != "portable")
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bf16")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// A strided bf16 matrix: element (i, j) at `data[off + i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub struct View<'a> {
    pub data: &'a [bf16],
    pub off: usize,
    pub rs: usize,
    pub cs: usize,
}

impl View<'_> {
    #[inline(always)]
    fn bits(&self, i: usize, j: usize) -> u32 {
        self.data[self.off + i * self.rs + j * self.cs].to_bits() as u32
    }
}

/// c (m, n) row-major = a (m, k) · b (k, n). The caller checked `available()` and that every
/// element of the views lies inside their slices (indexing would panic otherwise).
pub fn gemm(m: usize, k: usize, n: usize, a: View, b: View, c: &mut [f32]) {
    assert!(available() && c.len() == m * n);
    if m == 0 || n == 0 {
        return;
    }
    let kp = k.div_ceil(2);
    // B panels: panel p, k-pair q, column j -> lane (b[2q, j], b[2q+1, j]), zero past the edges.
    let panels = n.div_ceil(NR);
    let mut bp = vec![0u32; panels * kp * NR];
    bp.par_chunks_mut(kp * NR).enumerate().for_each(|(p, dst)| {
        for q in 0..kp {
            for jj in 0..NR.min(n - p * NR) {
                let j = p * NR + jj;
                let lo = b.bits(2 * q, j);
                let hi = if 2 * q + 1 < k { b.bits(2 * q + 1, j) } else { 0 };
                dst[q * NR + jj] = lo | (hi << 16);
            }
        }
    });
    let (row_blocks, col_blocks) = (m.div_ceil(MC), n.div_ceil(NC));
    // Tasks write disjoint (MC, NC) tiles of c; c is split into row blocks, each shared by
    // its column tiles through a raw pointer (disjoint column ranges).
    let cp = SendPtr(c.as_mut_ptr());
    (0..row_blocks * col_blocks).into_par_iter().for_each(|t| {
        let (rb, cb) = (t / col_blocks, t % col_blocks);
        let (r0, r1) = (rb * MC, ((rb + 1) * MC).min(m));
        let (c0, c1) = (cb * NC, ((cb + 1) * NC).min(n));
        // A panels of this row block: panel r, k-pair q, row ii -> (a[i, 2q], a[i, 2q+1]).
        let rpanels = (r1 - r0).div_ceil(MR);
        let mut ap = vec![0u32; rpanels * kp * MR];
        for (rp, dst) in ap.chunks_mut(kp * MR).enumerate() {
            for ii in 0..MR.min(r1 - r0 - rp * MR) {
                let i = r0 + rp * MR + ii;
                for q in 0..kp {
                    let lo = a.bits(i, 2 * q);
                    let hi = if 2 * q + 1 < k { a.bits(i, 2 * q + 1) } else { 0 };
                    dst[q * MR + ii] = lo | (hi << 16);
                }
            }
        }
        let cp = &cp;
        for rp in 0..rpanels {
            let i0 = r0 + rp * MR;
            let rows = MR.min(r1 - i0);
            let mut j0 = c0;
            while j0 < c1 {
                let cols = NR.min(c1 - j0);
                let bpan = &bp[(j0 / NR) * kp * NR..(j0 / NR + 1) * kp * NR];
                let apan = &ap[rp * kp * MR..(rp + 1) * kp * MR];
                // SAFETY: available() checked the CPU features; the panels hold kp * MR and
                // kp * NR lanes; the tile (rows, cols) at (i0, j0) lies inside c (m, n), and no
                // other task writes it (tasks own disjoint (row block, column block) tiles).
                unsafe { kernel(kp, apan.as_ptr(), bpan.as_ptr(), cp.0.add(i0 * n + j0), n, rows, cols) };
                j0 += cols;
            }
        }
    });
}

struct SendPtr(*mut f32);
// SAFETY: the tasks that share it write disjoint tiles (see `gemm`).
unsafe impl Sync for SendPtr {}
unsafe impl Send for SendPtr {}

/// c[r, j] = sum over k-pairs of a-pair(r) · b-pair(j), for r < rows, j < cols.
///
/// # Safety
/// AVX512-F and AVX512-BF16 are present; `a` holds kp * MR lanes, `b` kp * NR, and c rows
/// `rows` of `cols` elements at stride `ldc`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn kernel(kp: usize, a: *const u32, b: *const u32, c: *mut f32, ldc: usize, rows: usize, cols: usize) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    for q in 0..kp {
        // SAFETY: q < kp, so the loads stay inside the panels (caller's contract).
        unsafe {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(q * NR) as *const _));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(q * NR + 16) as *const _));
            for (r, acc) in acc.iter_mut().enumerate() {
                let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a.add(q * MR + r) as i32));
                acc[0] = _mm512_dpbf16_ps(acc[0], av, b0);
                acc[1] = _mm512_dpbf16_ps(acc[1], av, b1);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate().take(rows) {
        let mut tile = [0f32; NR];
        // SAFETY: tile holds NR = 2 * 16 floats; the copy below writes cols <= NR elements of
        // row r < rows of c (caller's contract).
        unsafe {
            _mm512_storeu_ps(tile.as_mut_ptr(), acc[0]);
            _mm512_storeu_ps(tile.as_mut_ptr().add(16), acc[1]);
            std::ptr::copy_nonoverlapping(tile.as_ptr(), c.add(r * ldc), cols);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel(_: usize, _: *const u32, _: *const u32, _: *mut f32, _: usize, _: usize, _: usize) {
    unreachable!("available() is false off x86-64")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the f32 product of the widened operands, transposed operands and ragged edges
    /// included: each bf16 product is exact in f32, so only the order of the sums differs.
    #[test]
    fn matches_the_widened_f32_product() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX512-BF16 (the portable path is the f32 GEMM)");
            return;
        }
        for &(m, k, n) in &[(1, 1, 1), (7, 5, 33), (70, 131, 300), (9, 64, 31)] {
            let av: Vec<bf16> = (0..m * k).map(|i| bf16::from_f32(((i * 37 % 19) as f32 - 9.0) * 0.13)).collect();
            let bv: Vec<bf16> = (0..k * n).map(|i| bf16::from_f32(((i * 11 % 23) as f32 - 11.0) * 0.07)).collect();
            for ta in [false, true] {
                // A stored (m, k) row-major, or (k, m) read transposed.
                let a = if ta { View { data: &av, off: 0, rs: 1, cs: m } } else { View { data: &av, off: 0, rs: k, cs: 1 } };
                let b = View { data: &bv, off: 0, rs: n, cs: 1 };
                let mut c = vec![f32::NAN; m * n];
                gemm(m, k, n, a, b, &mut c);
                for i in 0..m {
                    for j in 0..n {
                        let want: f64 = (0..k)
                            .map(|p| bf16::from_bits(a.bits(i, p) as u16).to_f64() * bf16::from_bits(b.bits(p, j) as u16).to_f64())
                            .sum();
                        let got = c[i * n + j] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()) * k as f64,
                            "({m},{k},{n}) ta {ta} at ({i},{j}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
