//! f32 GEMM with an AVX-512 register kernel: C (m, n) = alpha A (m, k) B (k, n) + beta C, any
//! non-negative strides. Where the CPU kernels do not run at AVX-512 (`simd::level`: F, VL, BW
//! and DQ; or on other architectures), and where `FERROLM_CPU_SGEMM=matrixmultiply` (or
//! `FERROLM_CPU_SIMD=portable`) is set, it is `matrixmultiply::sgemm` (`FERROLM_CPU_SGEMM=auto`,
//! the default, picks by the CPU).
//!
//! Blocking in the BLIS style: the depth is cut into KC slices; for each slice C's columns into
//! blocks of at most NC, B's (KC, NC) block packed into panels of NR = 32 columns (row after row,
//! 32 floats each, zero past n); A's rows into MC blocks packed into panels of MR = 14 rows
//! (column after column, 14 floats each), packed once per slice and kept across the column
//! blocks (up to A_WHOLE floats). The register kernel keeps an MR x NR tile of C in 28 zmm
//! registers, loads one row of the B panel (2 zmm) per k-step and broadcasts A's 14 values of
//! that step; tiles of at most 16 columns run a one-zmm variant, tiles of fewer rows a kernel
//! compiled for that many. One A panel (14 KB at KC = 256) stays in L1 while the kernel walks
//! the B panels of the block from L2. alpha and beta are applied once per tile when the first KC
//! slice is stored (with beta = 0 C is never read); later slices add to C, so the sum over k is
//! in order for every element. Masked loads and stores handle partial tiles; a C with column
//! stride other than 1 is written through a stack tile.
//!
//! A row-major A (csa = 1) is not packed at all where that pays (`reads_a_in_place`): the kernel
//! broadcasts each k-step's 14 values from the panel's 14 rows where they lie, each row read
//! start to end, and the panel stays in L1 across the B panels just as a packed one does. This
//! saves the pass over A that packing costs: 2-9% of a GEMM on the cpu-small model shapes and
//! 45% on attention's P V tile, one thread (`bench_cpu`, docs/BENCHMARKS.md). It does not pay,
//! and A is packed, where the rows are a multiple of 4 KiB apart (the panel's rows then share L1
//! sets) or B has more than two column blocks (a packed A is packed once and reused by each).
//!
//! Packing reads the operands contiguously whatever their layout: a row-major A (csa = 1) and a
//! column-major B (rsb = 1) are read 16 floats along each source row and turned by in-register
//! 16 x 16 transposes; a column-major A and a row-major B are read source row by source row,
//! start to end, and dealt out to the panels. Other strides take a generic loop. The packed
//! buffers live in a per-thread cache, so steady state allocates nothing.

/// Rows of the register tile.
pub const MR: usize = 14;
/// Columns of the register tile (two zmm).
pub const NR: usize = 32;
/// Depth of one packed slice.
const KC: usize = 256;
/// Rows of A packed at once (a multiple of MR).
const MC: usize = MR * 12;
/// Most columns of B packed at once (a multiple of NR): a (KC, NC) block of B, walked by every
/// A panel, stays in L2.
const NC: usize = 384;
/// Most floats of A kept packed across column blocks (4 MiB).
const A_WHOLE: usize = 1 << 20;

/// Which path `sgemm` takes, decided once: true for the AVX-512 kernel.
fn use_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static U: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *U.get_or_init(|| {
            let var = std::env::var("FERROLM_CPU_SGEMM").ok();
            let forced = forced_matrixmultiply(var.as_deref()).unwrap_or_else(|e| {
                eprintln!("{e}; using `auto`");
                false
            });
            // `simd::level()` is 2 only with AVX-512 (F, VL, BW, DQ) and without
            // FERROLM_CPU_SIMD=portable.
            !forced && super::simd::level() == 2
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether a `FERROLM_CPU_SGEMM` value (None: unset) forces matrixmultiply: `matrixmultiply`
/// does; `auto` and empty leave the choice to the CPU; anything else is an error naming it.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn forced_matrixmultiply(value: Option<&str>) -> Result<bool, String> {
    match value {
        Some("matrixmultiply") => Ok(true),
        None | Some("" | "auto") => Ok(false),
        Some(v) => Err(format!("FERROLM_CPU_SGEMM={v:?} is not `matrixmultiply` or `auto`")),
    }
}

/// The kernel `sgemm` runs on this machine: "avx512" or "matrixmultiply".
pub fn kernel_name() -> &'static str {
    if use_avx512() {
        "avx512"
    } else {
        "matrixmultiply"
    }
}

/// The (rows, columns) register tile `sgemm` runs on this machine: parallel callers cut C into
/// blocks that are multiples of it.
pub fn tile() -> (usize, usize) {
    if use_avx512() {
        (MR, NR)
    } else {
        (super::kernels::GEMM_ALIGN, super::kernels::GEMM_ALIGN)
    }
}

/// The f32 GEMM's signature and contract (`kernels::GemmFn`).
pub type Gemm = super::kernels::GemmFn<f32>;

/// The f32 GEMM of this machine (see the module): the AVX-512 one, or `matrixmultiply::sgemm`.
pub fn sgemm() -> Gemm {
    #[cfg(target_arch = "x86_64")]
    if use_avx512() {
        return avx512::sgemm::<true>;
    }
    matrixmultiply::sgemm
}

/// The AVX-512 GEMM with A always packed, where `sgemm()` is the AVX-512 one: what `sgemm()`
/// was before it read a row-major A in place. For the benchmark that compares the two.
pub fn sgemm_packed() -> Option<Gemm> {
    #[cfg(target_arch = "x86_64")]
    if use_avx512() {
        return Some(avx512::sgemm::<false>);
    }
    None
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use super::{A_WHOLE, KC, MC, MR, NC, NR};
    use std::arch::x86_64::*;
    use std::cell::RefCell;

    /// One cache line of packed floats; the packed buffers are vectors of these (64-byte aligned).
    #[derive(Clone, Copy)]
    #[repr(C, align(64))]
    struct Line([f32; 16]);

    thread_local! {
        /// (packed A block, packed B block) of this thread, grown on demand and kept.
        static BUFS: RefCell<(Vec<Line>, Vec<Line>)> = const { RefCell::new((Vec::new(), Vec::new())) };
    }

    fn reserve(v: &mut Vec<Line>, floats: usize) -> *mut f32 {
        let lines = floats.div_ceil(16);
        if v.len() < lines {
            v.resize(lines, Line([0.0; 16]));
        }
        v.as_mut_ptr() as *mut f32
    }

    /// The AVX-512 GEMM (the contract of `super::Gemm`). The caller checked `simd::level() == 2`.
    /// `IN_PLACE`: a row-major A is read where it lies where that pays (`reads_a_in_place`);
    /// false packs A whatever its layout, as before that existed (for the benchmark that
    /// compares the two, and for tests).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn sgemm<const IN_PLACE: bool>(
        m: usize,
        k: usize,
        n: usize,
        alpha: f32,
        a: *const f32,
        rsa: isize,
        csa: isize,
        b: *const f32,
        rsb: isize,
        csb: isize,
        beta: f32,
        c: *mut f32,
        rsc: isize,
        csc: isize,
    ) {
        if m == 0 || n == 0 {
            return;
        }
        if k == 0 {
            scale_c(m, n, beta, c, rsc, csc);
            return;
        }
        // Re-entrancy (a GEMM inside a GEMM) cannot happen; fall back to fresh buffers if the
        // cache is somehow borrowed rather than panic.
        let (a, b, c) = (Mat { p: a, rs: rsa, cs: csa }, Mat { p: b, rs: rsb, cs: csb }, Mat { p: c, rs: rsc, cs: csc });
        BUFS.with(|cell| match cell.try_borrow_mut() {
            Ok(mut bufs) => {
                let (pa, pb) = &mut *bufs;
                blocked(m, k, n, alpha, a, b, beta, c, pa, pb, IN_PLACE)
            }
            Err(_) => {
                let (mut pa, mut pb) = (Vec::new(), Vec::new());
                blocked(m, k, n, alpha, a, b, beta, c, &mut pa, &mut pb, IN_PLACE)
            }
        })
    }

    /// C = beta C (beta = 0: zeros, C unread).
    unsafe fn scale_c(m: usize, n: usize, beta: f32, c: *mut f32, rsc: isize, csc: isize) {
        for i in 0..m {
            for j in 0..n {
                let p = c.offset(i as isize * rsc + j as isize * csc);
                *p = if beta == 0.0 { 0.0 } else { beta * *p };
            }
        }
    }

    /// Whether the kernel reads A where it lies instead of packing it: for a row-major A
    /// (`csa == 1`), where each k-step of a panel is one float from each of its MR rows. Packing
    /// costs a pass over A per call, which in-place reads save, unless
    /// - the rows are a multiple of 4 KiB apart: all MR rows of a panel then fall into the same
    ///   L1 sets, more than its ways hold (measured 12-30% slower than packing);
    /// - B has more than two column blocks: A is then walked once per block, and a packed A is
    ///   packed once and read contiguously every time after.
    pub(super) fn reads_a_in_place(rsa: isize, csa: isize, column_blocks: usize) -> bool {
        csa == 1 && !(rsa.unsigned_abs() * 4).is_multiple_of(4096) && column_blocks <= 2
    }

    /// Column blocks of at most NC, of near-equal width rounded up to NR.
    fn col_block(n: usize) -> usize {
        let blocks = n.div_ceil(NC);
        n.div_ceil(blocks).div_ceil(NR) * NR
    }

    /// A strided operand: element (i, j) at `p + i*rs + j*cs`.
    #[derive(Clone, Copy)]
    struct Mat<P> {
        p: P,
        rs: isize,
        cs: isize,
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn blocked(
        m: usize,
        k: usize,
        n: usize,
        alpha: f32,
        a: Mat<*const f32>,
        b: Mat<*const f32>,
        beta: f32,
        c: Mat<*mut f32>,
        pa_buf: &mut Vec<Line>,
        pb_buf: &mut Vec<Line>,
        in_place: bool,
    ) {
        let (Mat { p: a, rs: rsa, cs: csa }, Mat { p: b, rs: rsb, cs: csb }, Mat { p: c, rs: rsc, cs: csc }) = (a, b, c);
        let ncb = col_block(n);
        let kcb = k.div_ceil(k.div_ceil(KC));
        let kc_max = kcb.min(k);
        let mp = m.div_ceil(MR) * MR;
        let direct = in_place && reads_a_in_place(rsa, csa, n.div_ceil(ncb));
        // With several column blocks, a packed A's whole KC slice is packed once and kept (up to
        // A_WHOLE floats) instead of once per column block.
        let whole = !direct && n > ncb && mp * kc_max <= A_WHOLE;
        let pa = if direct { std::ptr::null_mut() } else { reserve(pa_buf, if whole { mp } else { MC.min(mp) } * kc_max) };
        let pb = reserve(pb_buf, ncb.min(n.div_ceil(NR) * NR) * kc_max);
        let mut pc = 0;
        while pc < k {
            let kc = kcb.min(k - pc);
            let first = pc == 0;
            let mut jc = 0;
            while jc < n {
                let nc = ncb.min(n - jc);
                pack_b(kc, nc, b.offset(pc as isize * rsb + jc as isize * csb), rsb, csb, pb);
                let mut ic = 0;
                while ic < m {
                    let mc = MC.min(m - ic);
                    let pa = if whole { pa.add(ic * kc) } else { pa };
                    if !direct && (!whole || jc == 0) {
                        pack_a(mc, kc, a.offset(ic as isize * rsa + pc as isize * csa), rsa, csa, pa);
                    }
                    let mut ir = 0;
                    while ir < mc {
                        let rows = MR.min(mc - ir);
                        let ap = if direct {
                            APanel { p: a.offset((ic + ir) as isize * rsa + pc as isize), rs: rsa }
                        } else {
                            APanel { p: pa.add(ir * kc), rs: 0 }
                        };
                        let mut jr = 0;
                        while jr < nc {
                            let cols = NR.min(nc - jr);
                            let bp = pb.add(jr * kc);
                            let cp = c.offset((ic + ir) as isize * rsc + (jc + jr) as isize * csc);
                            let st = Store { c: cp, rsc, csc, rows, cols, alpha, beta: if first { beta } else { 1.0 } };
                            if direct {
                                tile::<true>(rows, kc, ap, bp, &st);
                            } else {
                                tile::<false>(rows, kc, ap, bp, &st);
                            }
                            jr += NR;
                        }
                        ir += MR;
                    }
                    ic += mc;
                }
                jc += nc;
            }
            pc += kc;
        }
    }

    /// Pack A (mc, kc) into panels of MR rows: panel p holds, for each kk, rows p*MR.. as MR
    /// consecutive floats (rows past mc are left as they are; the kernel never reads them).
    #[target_feature(enable = "avx512f")]
    unsafe fn pack_a(mc: usize, kc: usize, a: *const f32, rsa: isize, csa: isize, pa: *mut f32) {
        if rsa == 1 && csa != 1 {
            // Column-major: each k-step's rows are contiguous; read them start to end and deal
            // them out 14 per panel.
            for kk in 0..kc {
                let s = a.offset(kk as isize * csa);
                let mut p = 0;
                while p < mc {
                    let rm = ((1u32 << MR.min(mc - p)) - 1) as __mmask16;
                    _mm512_mask_storeu_ps(pa.add(p * kc + kk * MR), rm, _mm512_maskz_loadu_ps(rm, s.add(p)));
                    p += MR;
                }
            }
            return;
        }
        let mut p = 0;
        while p < mc {
            let rows = MR.min(mc - p);
            let dst = pa.add(p * kc);
            let src = a.offset(p as isize * rsa);
            if csa == 1 {
                // Row-major: read 16 k-steps of each row contiguously, transpose in registers.
                let mut kk = 0;
                while kk < kc {
                    let len = 16.min(kc - kk);
                    let lm = (((1u32 << len) - 1) & 0xffff) as __mmask16;
                    let v = transposed(src.add(kk), rsa, rows, lm);
                    for (t, x) in v.iter().enumerate().take(len) {
                        _mm512_mask_storeu_ps(dst.add((kk + t) * MR), (1 << MR) - 1, *x);
                    }
                    kk += 16;
                }
            } else {
                for kk in 0..kc {
                    for r in 0..rows {
                        *dst.add(kk * MR + r) = *src.offset(r as isize * rsa + kk as isize * csa);
                    }
                }
            }
            p += MR;
        }
    }

    /// Pack B (kc, nc) into panels of NR columns: panel q holds, for each kk, columns q*NR.. as
    /// NR consecutive floats, zero past nc.
    #[target_feature(enable = "avx512f")]
    unsafe fn pack_b(kc: usize, nc: usize, b: *const f32, rsb: isize, csb: isize, pb: *mut f32) {
        if csb == 1 {
            // Row-major: each row of the block is read once, start to end (the hardware
            // prefetcher follows it), and dealt out 32 floats per panel.
            for kk in 0..kc {
                let s = b.offset(kk as isize * rsb);
                let mut q = 0;
                while q + NR <= nc {
                    let d = pb.add(q * kc + kk * NR);
                    _mm512_store_ps(d, _mm512_loadu_ps(s.add(q)));
                    _mm512_store_ps(d.add(16), _mm512_loadu_ps(s.add(q + 16)));
                    q += NR;
                }
                if q < nc {
                    let (m0, m1) = masks(nc - q);
                    let d = pb.add(q * kc + kk * NR);
                    _mm512_store_ps(d, _mm512_maskz_loadu_ps(m0, s.add(q)));
                    _mm512_store_ps(d.add(16), _mm512_maskz_loadu_ps(m1, s.wrapping_add(q + 16)));
                }
            }
            return;
        }
        let mut q = 0;
        while q < nc {
            let cols = NR.min(nc - q);
            let dst = pb.add(q * kc);
            let src = b.offset(q as isize * csb);
            if cols < NR {
                for kk in 0..kc {
                    std::ptr::write_bytes(dst.add(kk * NR + cols), 0, NR - cols);
                }
            }
            if rsb == 1 {
                // Column-major: read 16 k-steps of each column contiguously, transpose in
                // registers, 16 columns at a time.
                let mut kk = 0;
                while kk < kc {
                    let len = 16.min(kc - kk);
                    let lm = (((1u32 << len) - 1) & 0xffff) as __mmask16;
                    let mut h = 0;
                    while h < cols {
                        let v = transposed(src.offset(h as isize * csb).add(kk), csb, cols - h, lm);
                        for (t, x) in v.iter().enumerate().take(len) {
                            _mm512_store_ps(dst.add((kk + t) * NR + h), *x);
                        }
                        h += 16;
                    }
                    kk += 16;
                }
            } else {
                for kk in 0..kc {
                    for j in 0..cols {
                        *dst.add(kk * NR + j) = *src.offset(kk as isize * rsb + j as isize * csb);
                    }
                }
            }
            q += NR;
        }
    }

    /// The first `lines` (<= 16) source lines `stride` apart, 16 floats each from `src` (lanes
    /// outside `lm` read as 0, unread), transposed: v[t] holds element t of every line.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn transposed(src: *const f32, stride: isize, lines: usize, lm: __mmask16) -> [__m512; 16] {
        let mut v = [_mm512_setzero_ps(); 16];
        for (r, x) in v.iter_mut().enumerate().take(lines) {
            *x = _mm512_maskz_loadu_ps(lm, src.offset(r as isize * stride));
        }
        transpose16(&mut v);
        v
    }

    /// Transpose a 16 x 16 block held as 16 rows: afterwards v[j] holds column j.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn transpose16(v: &mut [__m512; 16]) {
        // Pairs of rows interleaved by 32 bits, then by 64 bits: within each 128-bit lane l,
        // u[4g + j] holds (row 4g, 4g+1, 4g+2, 4g+3) at column 4l + j.
        let mut t = [_mm512_setzero_ps(); 16];
        for p in 0..8 {
            t[2 * p] = _mm512_unpacklo_ps(v[2 * p], v[2 * p + 1]);
            t[2 * p + 1] = _mm512_unpackhi_ps(v[2 * p], v[2 * p + 1]);
        }
        let mut u = [_mm512_setzero_ps(); 16];
        for g in 0..4 {
            let (a, b, c, d) = (t[4 * g], t[4 * g + 1], t[4 * g + 2], t[4 * g + 3]);
            let (a, b, c, d) = (_mm512_castps_pd(a), _mm512_castps_pd(b), _mm512_castps_pd(c), _mm512_castps_pd(d));
            u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
            u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
            u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
            u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
        }
        // A 4 x 4 transpose of 128-bit lanes across the four row groups, for each j.
        for j in 0..4 {
            let (u0, u1, u2, u3) = (u[j], u[4 + j], u[8 + j], u[12 + j]);
            let v0 = _mm512_shuffle_f32x4::<0x88>(u0, u1);
            let v1 = _mm512_shuffle_f32x4::<0xdd>(u0, u1);
            let v2 = _mm512_shuffle_f32x4::<0x88>(u2, u3);
            let v3 = _mm512_shuffle_f32x4::<0xdd>(u2, u3);
            v[j] = _mm512_shuffle_f32x4::<0x88>(v0, v2);
            v[4 + j] = _mm512_shuffle_f32x4::<0x88>(v1, v3);
            v[8 + j] = _mm512_shuffle_f32x4::<0xdd>(v0, v2);
            v[12 + j] = _mm512_shuffle_f32x4::<0xdd>(v1, v3);
        }
    }

    /// Lane masks of the first `cols` (<= 32) columns over the two zmm of a tile row.
    #[inline(always)]
    fn masks(cols: usize) -> (__mmask16, __mmask16) {
        let bits = if cols >= 32 { u32::MAX } else { (1u32 << cols) - 1 };
        (bits as __mmask16, (bits >> 16) as __mmask16)
    }

    /// Where and how a register tile is written: C = alpha acc + beta C (beta = 0: C unread).
    struct Store {
        c: *mut f32,
        rsc: isize,
        csc: isize,
        rows: usize,
        cols: usize,
        alpha: f32,
        beta: f32,
    }

    /// The A side of a register tile: a packed panel (`rs` unused: MR floats per k-step), or a
    /// row-major A read in place (rows `rs` floats apart, k-steps contiguous).
    #[derive(Clone, Copy)]
    struct APanel {
        p: *const f32,
        rs: isize,
    }

    /// One tile of `rows` (1..=MR) rows, through the kernel compiled for exactly that many, and
    /// for one zmm of columns where the tile has at most 16.
    #[inline(always)]
    unsafe fn tile<const IN_PLACE: bool>(rows: usize, kc: usize, a: APanel, bp: *const f32, st: &Store) {
        macro_rules! by_rows {
            ($w:literal) => {
                match rows {
                    14 => kernel::<14, $w, IN_PLACE>(kc, a, bp, st),
                    13 => kernel::<13, $w, IN_PLACE>(kc, a, bp, st),
                    12 => kernel::<12, $w, IN_PLACE>(kc, a, bp, st),
                    11 => kernel::<11, $w, IN_PLACE>(kc, a, bp, st),
                    10 => kernel::<10, $w, IN_PLACE>(kc, a, bp, st),
                    9 => kernel::<9, $w, IN_PLACE>(kc, a, bp, st),
                    8 => kernel::<8, $w, IN_PLACE>(kc, a, bp, st),
                    7 => kernel::<7, $w, IN_PLACE>(kc, a, bp, st),
                    6 => kernel::<6, $w, IN_PLACE>(kc, a, bp, st),
                    5 => kernel::<5, $w, IN_PLACE>(kc, a, bp, st),
                    4 => kernel::<4, $w, IN_PLACE>(kc, a, bp, st),
                    3 => kernel::<3, $w, IN_PLACE>(kc, a, bp, st),
                    2 => kernel::<2, $w, IN_PLACE>(kc, a, bp, st),
                    _ => kernel::<1, $w, IN_PLACE>(kc, a, bp, st),
                }
            };
        }
        if st.cols > 16 {
            by_rows!(2)
        } else {
            by_rows!(1)
        }
    }

    /// The register kernel: R rows x 16W columns (W = 1 or 2) of C in RW zmm accumulators over
    /// kc steps of an A panel (packed: MR floats per step, the first R used; IN_PLACE: R rows of
    /// A `a.rs` floats apart, one float of each per step) and a packed B panel (32 per step, the
    /// first 16W used).
    #[target_feature(enable = "avx512f")]
    unsafe fn kernel<const R: usize, const W: usize, const IN_PLACE: bool>(kc: usize, a: APanel, bp: *const f32, st: &Store) {
        let mut acc0 = [_mm512_setzero_ps(); R];
        let mut acc1 = [_mm512_setzero_ps(); R];
        let (mut ap, mut bp) = (a.p, bp);
        for _ in 0..kc {
            let b0 = _mm512_load_ps(bp);
            let b1 = if W == 2 { _mm512_load_ps(bp.add(16)) } else { _mm512_setzero_ps() };
            for r in 0..R {
                let av = _mm512_set1_ps(if IN_PLACE { *ap.offset(r as isize * a.rs) } else { *ap.add(r) });
                acc0[r] = _mm512_fmadd_ps(av, b0, acc0[r]);
                if W == 2 {
                    acc1[r] = _mm512_fmadd_ps(av, b1, acc1[r]);
                }
            }
            ap = ap.add(if IN_PLACE { 1 } else { MR });
            bp = bp.add(NR);
        }
        let alpha = _mm512_set1_ps(st.alpha);
        if st.csc == 1 {
            let (m0, m1) = masks(st.cols);
            let beta = _mm512_set1_ps(st.beta);
            for r in 0..R.min(st.rows) {
                let row = st.c.offset(r as isize * st.rsc);
                let mut x0 = _mm512_mul_ps(alpha, acc0[r]);
                let mut x1 = _mm512_mul_ps(alpha, acc1[r]);
                if st.beta != 0.0 {
                    x0 = _mm512_fmadd_ps(beta, _mm512_maskz_loadu_ps(m0, row), x0);
                    if m1 != 0 {
                        x1 = _mm512_fmadd_ps(beta, _mm512_maskz_loadu_ps(m1, row.wrapping_add(16)), x1);
                    }
                }
                _mm512_mask_storeu_ps(row, m0, x0);
                if m1 != 0 {
                    _mm512_mask_storeu_ps(row.wrapping_add(16), m1, x1);
                }
            }
        } else {
            // Strided C: through a stack tile.
            let mut t = [0f32; NR];
            for r in 0..R.min(st.rows) {
                _mm512_storeu_ps(t.as_mut_ptr(), _mm512_mul_ps(alpha, acc0[r]));
                _mm512_storeu_ps(t.as_mut_ptr().add(16), _mm512_mul_ps(alpha, acc1[r]));
                for (j, &x) in t.iter().enumerate().take(st.cols) {
                    let p = st.c.offset(r as isize * st.rsc + j as isize * st.csc);
                    *p = if st.beta == 0.0 { x } else { x + st.beta * *p };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::Rng;

    /// A float in [-1, 1).
    fn draw(rng: &mut Rng) -> f32 {
        (rng.uniform() * 2.0 - 1.0) as f32
    }

    /// Layouts of an (r, c) operand: (name, rows stride, cols stride, storage length).
    fn layout(kind: u8, r: usize, c: usize) -> (isize, isize, usize) {
        match kind {
            0 => (c as isize, 1, r * c),                             // row-major
            1 => (1, r as isize, r * c),                             // column-major
            _ => ((2 * c + 1) as isize, 2, r * (2 * c + 1) + 2 * c), // generic strides
        }
    }

    /// One product through `f` against a naive f64 product, C poisoned with NaN for beta = 0
    /// and holding random values for beta != 0; error relative to sum |alpha a b| + |beta c|.
    #[allow(clippy::too_many_arguments)]
    fn check(f: Gemm, m: usize, k: usize, n: usize, la: u8, lb: u8, ct: bool, alpha: f32, beta: f32, rng: &mut Rng) {
        let (rsa, csa, lena) = layout(la, m, k);
        let (rsb, csb, lenb) = layout(lb, k, n);
        let a: Vec<f32> = (0..lena).map(|_| draw(rng)).collect();
        let b: Vec<f32> = (0..lenb).map(|_| draw(rng)).collect();
        // C row-major, or transposed (csc != 1).
        let (rsc, csc) = if ct { (1, m as isize) } else { (n as isize, 1) };
        let c0: Vec<f32> = (0..m * n).map(|_| if beta == 0.0 { f32::NAN } else { draw(rng) }).collect();
        let mut c = c0.clone();
        unsafe { f(m, k, n, alpha, a.as_ptr(), rsa, csa, b.as_ptr(), rsb, csb, beta, c.as_mut_ptr(), rsc, csc) };
        for i in 0..m {
            for j in 0..n {
                let (mut s, mut mag) = (0f64, 0f64);
                for p in 0..k {
                    let x = a[(i as isize * rsa + p as isize * csa) as usize] as f64;
                    let y = b[(p as isize * rsb + j as isize * csb) as usize] as f64;
                    s += x * y;
                    mag += (x * y).abs();
                }
                let ci = (i as isize * rsc + j as isize * csc) as usize;
                let mut want = alpha as f64 * s;
                mag *= (alpha as f64).abs();
                if beta != 0.0 {
                    want += beta as f64 * c0[ci] as f64;
                    mag += (beta as f64 * c0[ci] as f64).abs();
                }
                let got = c[ci] as f64;
                assert!(
                    (got - want).abs() <= 1e-5 * mag.max(1e-30) + 1e-30,
                    "m={m} k={k} n={n} layouts=({la},{lb}) ct={ct} alpha={alpha} beta={beta}: c[{i},{j}] = {got}, want {want}"
                );
            }
        }
    }

    fn suite(f: Gemm) {
        let rng = &mut Rng::new(7);
        // Every edge: dims of 1, not multiples of the tile sides, k > KC, n > NC, m > MC.
        let shapes = [
            (1, 1, 1),
            (1, 7, 1),
            (1, 300, 33),
            (15, 1, 31),
            (14, 3, 32),
            (13, 17, 47),
            (29, 257, 65),
            (MC + 5, 40, 2 * NR + 1),
            (30, 2 * KC + 3, NC + NR + 7),
            (3, 5, NC * 2 + 1),
            // A row-major with rows 4 KiB apart: packed, not read in place.
            (MR + 3, 1024, NR + 5),
        ];
        for &(m, k, n) in &shapes {
            for la in 0..3 {
                for lb in 0..3 {
                    check(f, m, k, n, la, lb, false, 1.0, 0.0, rng);
                }
            }
            check(f, m, k, n, 0, 1, false, -0.75, 0.0, rng);
            check(f, m, k, n, 1, 0, false, 1.0, 1.0, rng);
            check(f, m, k, n, 0, 0, false, 0.5, -2.0, rng);
            check(f, m, k, n, 2, 1, true, 1.25, 0.0, rng);
            check(f, m, k, n, 0, 0, true, 1.0, 1.0, rng);
        }
        // A too large to stay packed across column blocks (repacked per block).
        let m_big = A_WHOLE / KC + 2 * MR + 1;
        check(f, m_big, KC, NC + 1, 0, 1, false, 1.0, 0.0, rng);
        // Attention: S = Q K^T (K row-major (256, 32): B strides (1, 32)), O = P V, accumulated.
        check(f, 64, 32, 256, 0, 1, false, 0.125, 0.0, rng);
        check(f, 64, 256, 32, 0, 0, false, 1.0, 1.0, rng);
        // k = 0: C = beta C (zeros for beta = 0, NaN poison gone).
        for beta in [0.0f32, 2.0] {
            let mut c = vec![if beta == 0.0 { f32::NAN } else { 1.5 }; 6];
            unsafe { f(2, 0, 3, 1.0, [].as_ptr(), 0, 1, [].as_ptr(), 3, 1, beta, c.as_mut_ptr(), 3, 1) };
            assert!(c.iter().all(|&x| x == 1.5 * beta), "k = 0, beta = {beta}: {c:?}");
        }
    }

    /// A row-major A is read in place unless its rows alias in L1 or B has over two column
    /// blocks; any other layout is packed.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn a_is_read_in_place_only_where_it_pays() {
        use avx512::reads_a_in_place as in_place;
        for rsa in [1, 17, 256, 512, 688, 768, 1536, 2048 + 1] {
            assert!(in_place(rsa, 1, 1) && in_place(rsa, 1, 2), "row stride {rsa}");
            assert!(!in_place(rsa, 1, 3), "row stride {rsa}, 3 column blocks");
        }
        for rsa in [1024, 2048, 4096, 3072 * 4] {
            assert!(!in_place(rsa, 1, 1), "row stride {rsa} floats: rows 4 KiB apart");
        }
        assert!(!in_place(1, 256, 1) && !in_place(513, 2, 1), "not row-major");
    }

    /// Every form of FERROLM_CPU_SGEMM the docs name, and a bad one refused by name.
    #[test]
    fn sgemm_variable_takes_matrixmultiply_or_auto() {
        assert_eq!(forced_matrixmultiply(Some("matrixmultiply")), Ok(true));
        for v in [None, Some(""), Some("auto")] {
            assert_eq!(forced_matrixmultiply(v), Ok(false), "{v:?}");
        }
        let e = forced_matrixmultiply(Some("mkl")).unwrap_err();
        assert!(e.contains("FERROLM_CPU_SGEMM") && e.contains("\"mkl\""), "{e}");
    }

    #[test]
    fn sgemm_matches_a_naive_product() {
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::simd::level() == 2 {
            println!("checking the AVX-512 kernel");
            suite(avx512::sgemm::<true>);
            println!("checking the AVX-512 kernel with A always packed");
            suite(avx512::sgemm::<false>);
        } else {
            println!("no AVX-512 (or FERROLM_CPU_SIMD=portable): the AVX-512 kernel is not checked here");
        }
        #[cfg(not(target_arch = "x86_64"))]
        println!("not x86-64: the AVX-512 kernel is not compiled");
        println!("checking `sgemm()` as dispatched here ({})", kernel_name());
        suite(sgemm());
        println!("checking the matrixmultiply fallback");
        suite(matrixmultiply::sgemm);
    }
}
