//! Generic strided CPU kernels: element-wise, reductions, GEMM, concatenation.
use super::simd::FastExp;
use crate::backend::{BinaryOp, ReduceOp, UnaryOp};
use crate::Layout;
use num_traits::Float;
use rayon::prelude::*;

/// Below this many elements the work is done on the calling thread.
const PAR_MIN: usize = 1 << 15;
/// Elements per parallel task on strided walks.
const CHUNK: usize = 1 << 13;

/// Elements per parallel task on contiguous element-wise work.
const GRAIN: usize = 1 << 12;

crate::multiversion! {
    fn map_into[T: Float, F: Fn(T) -> T](y: &mut [T], x: &[T], f: &F) {
        for (o, &v) in y.iter_mut().zip(x) {
            *o = f(v);
        }
    }
}

/// y = f(x) over contiguous slices, in parallel above PAR_MIN, each task's loop vectorised.
fn map_contiguous<T: Float + Send + Sync>(x: &[T], f: impl Fn(T) -> T + Sync) -> Vec<T> {
    let mut y = vec![T::zero(); x.len()];
    if x.len() >= PAR_MIN {
        y.par_chunks_mut(GRAIN).zip(x.par_chunks(GRAIN)).for_each(|(y, x)| map_into(y, x, &f));
    } else {
        map_into(&mut y, x, &f);
    }
    y
}

fn map_view<T: Float + Send + Sync>(x: &[T], l: &Layout, f: impl Fn(T) -> T + Sync) -> Vec<T> {
    if l.is_contiguous() {
        map_contiguous(&x[l.offset..l.offset + l.numel()], f)
    } else if l.numel() >= PAR_MIN {
        let mut out = vec![T::zero(); l.numel()];
        out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, o)| {
            let idx = l.indices_range(c * CHUNK, o.len());
            for (y, i) in o.iter_mut().zip(idx) {
                *y = f(x[i]);
            }
        });
        out
    } else {
        l.indices().map(|i| f(x[i])).collect()
    }
}

pub fn unary<T: FastExp + Send + Sync>(op: UnaryOp, x: &[T], l: &Layout) -> Vec<T> {
    let c = |v: f64| T::from(v).unwrap();
    match op {
        UnaryOp::Neg => map_view(x, l, |v| -v),
        UnaryOp::Exp => map_view(x, l, |v| v.fast_exp()),
        UnaryOp::Log => map_view(x, l, |v| v.ln()),
        UnaryOp::Sqrt => map_view(x, l, |v| v.sqrt()),
        UnaryOp::Rsqrt => map_view(x, l, |v| v.sqrt().recip()),
        UnaryOp::Recip => map_view(x, l, |v| v.recip()),
        UnaryOp::Sqr => map_view(x, l, |v| v * v),
        UnaryOp::Silu => map_view(x, l, |v| v / (T::one() + (-v).fast_exp())),
        UnaryOp::SiluGrad => map_view(x, l, |v| {
            let s = T::one() / (T::one() + (-v).fast_exp());
            s * (T::one() + v * (T::one() - s))
        }),
        UnaryOp::Powf(p) => {
            let p = c(p);
            map_view(x, l, move |v| v.powf(p))
        }
        UnaryOp::Affine { mul, add } => {
            let (m, a) = (c(mul), c(add));
            map_view(x, l, move |v| v * m + a)
        }
    }
}

#[inline(always)]
fn apply<T: Float>(op: BinaryOp, a: T, b: T) -> T {
    match op {
        BinaryOp::Add => a + b,
        BinaryOp::Sub => a - b,
        BinaryOp::Mul => a * b,
        BinaryOp::Div => a / b,
        BinaryOp::Eq => {
            if a == b {
                T::one()
            } else {
                T::zero()
            }
        }
    }
}

#[inline(always)]
fn zip_into<T: Float>(o: &mut [T], a: &[T], b: &[T], f: impl Fn(T, T) -> T) {
    for ((o, &x), &y) in o.iter_mut().zip(a).zip(b) {
        *o = f(x, y);
    }
}

crate::multiversion! {
    /// o = a op b on contiguous slices; one loop per op (the match outside it), so each vectorises.
    fn binary_into[T: Float](op: BinaryOp, o: &mut [T], a: &[T], b: &[T]) {
        match op {
            BinaryOp::Add => zip_into(o, a, b, |x, y| x + y),
            BinaryOp::Sub => zip_into(o, a, b, |x, y| x - y),
            BinaryOp::Mul => zip_into(o, a, b, |x, y| x * y),
            BinaryOp::Div => zip_into(o, a, b, |x, y| x / y),
            BinaryOp::Eq => zip_into(o, a, b, |x, y| apply(BinaryOp::Eq, x, y)),
        }
    }
}

pub fn binary<T: Float + Send + Sync>(op: BinaryOp, a: &[T], la: &Layout, b: &[T], lb: &Layout) -> Vec<T> {
    let n = la.numel();
    if la.is_contiguous() && lb.is_contiguous() {
        let (a, b) = (&a[la.offset..la.offset + n], &b[lb.offset..lb.offset + n]);
        let mut out = vec![T::zero(); n];
        if n >= PAR_MIN {
            out.par_chunks_mut(GRAIN).zip(a.par_chunks(GRAIN).zip(b.par_chunks(GRAIN))).for_each(|(o, (a, b))| binary_into(op, o, a, b));
        } else {
            binary_into(op, &mut out, a, b);
        }
        return out;
    }
    // Broadcast or strided operands: walk both views; large outputs in parallel chunks.
    if n < PAR_MIN {
        return la.indices().zip(lb.indices()).map(|(i, j)| apply(op, a[i], b[j])).collect();
    }
    let mut out = vec![T::zero(); n];
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, o)| {
        let (ia, ib) = (la.indices_range(c * CHUNK, o.len()), lb.indices_range(c * CHUNK, o.len()));
        for ((x, i), j) in o.iter_mut().zip(ia).zip(ib) {
            *x = apply(op, a[i], b[j]);
        }
    });
    out
}

/// Sum of `f(x)` over a slice in f64, in fixed chunks whose partial sums are added in order:
/// deterministic whatever the thread count, and exact to f64 rounding however long the slice (a
/// sequential f32 fold loses digits as the sum grows: 6% of a 45M-element sum of squares).
pub fn sum_f64<T: Copy + Send + Sync>(x: &[T], f: impl Fn(T) -> f64 + Sync) -> f64 {
    if x.len() < PAR_MIN {
        return x.iter().map(|&v| f(v)).sum();
    }
    let parts: Vec<f64> = x.par_chunks(CHUNK).map(|c| c.iter().map(|&v| f(v)).sum()).collect();
    parts.iter().sum()
}

/// Sums accumulate in f64 whatever the element type (see `sum_f64`); maxima in the element type.
pub fn reduce<T: Float + Send + Sync>(op: ReduceOp, x: &[T], l: &Layout, dims: &[usize]) -> Vec<T> {
    let rank = l.shape.rank();
    let as_f64 = |v: T| v.to_f64().unwrap_or(f64::NAN);
    let back = |v: f64| T::from(v).unwrap_or_else(T::nan);
    // The whole of a contiguous view: one pass over the slice, no index table.
    if l.is_contiguous() && (0..rank).all(|d| dims.contains(&d)) {
        let s = &x[l.offset..l.offset + l.numel()];
        return vec![match op {
            ReduceOp::Sum => back(sum_f64(s, as_f64)),
            ReduceOp::Max => s.iter().fold(T::neg_infinity(), |a, &v| a.max(v)),
        }];
    }
    let (mut keep_d, mut keep_s, mut red_d, mut red_s) = (vec![], vec![], vec![], vec![]);
    for i in 0..rank {
        if dims.contains(&i) {
            red_d.push(l.shape.0[i]);
            red_s.push(l.strides[i]);
        } else {
            keep_d.push(l.shape.0[i]);
            keep_s.push(l.strides[i]);
        }
    }
    let outer = Layout { shape: keep_d.into(), strides: keep_s, offset: l.offset };
    let inner: Vec<usize> = Layout { shape: red_d.into(), strides: red_s, offset: 0 }.indices().collect();
    let f = |base: usize| -> T {
        match op {
            ReduceOp::Sum if inner.len() >= PAR_MIN => back(sum_f64(&inner, |i| as_f64(x[base + i]))),
            ReduceOp::Sum => back(inner.iter().map(|&i| as_f64(x[base + i])).sum()),
            ReduceOp::Max => inner.iter().fold(T::neg_infinity(), |acc, &i| acc.max(x[base + i])),
        }
    };
    let bases: Vec<usize> = outer.indices().collect();
    if bases.len() * inner.len() >= PAR_MIN && bases.len() > 1 {
        bases.par_iter().map(|&b| f(b)).collect()
    } else {
        bases.iter().map(|&b| f(b)).collect()
    }
}

/// Storage offsets of every matrix in the batch dims of a (..., r, c) view.
fn batch_offsets(l: &Layout) -> Vec<usize> {
    let r = l.shape.rank();
    Layout { shape: l.shape.0[..r - 2].to_vec().into(), strides: l.strides[..r - 2].to_vec(), offset: l.offset }.indices().collect()
}

/// Checks that a (rows, cols) matrix at storage offset `base` with strides (rs, cs) lies inside
/// a storage of `len` elements: its last element, base + (rows-1)*rs + (cols-1)*cs, is below it.
fn check_extent(op: &str, len: usize, base: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> crate::Result<()> {
    let last = (rows.checked_sub(1).and_then(|r| r.checked_mul(rs)))
        .zip(cols.checked_sub(1).and_then(|c| c.checked_mul(cs)))
        .and_then(|(x, y)| x.checked_add(y)?.checked_add(base));
    match last {
        Some(l) if l < len => Ok(()),
        _ => crate::bail!(op, "a {rows}x{cols} matrix at offset {base} with strides ({rs}, {cs}) reaches past a storage of {len} elements"),
    }
}

/// A batched matmul's shape: rank, (m, k, n), and each operand's matrix offsets per batch.
struct MatmulDims {
    r: usize,
    m: usize,
    k: usize,
    n: usize,
    oa: Vec<usize>,
    ob: Vec<usize>,
}

fn matmul_dims(la: &Layout, lb: &Layout) -> crate::Result<MatmulDims> {
    let r = la.shape.rank();
    if r < 2 || lb.shape.rank() != r || la.shape.0[r - 1] != lb.shape.0[r - 2] {
        crate::bail!("matmul", "shapes {:?} and {:?} do not multiply", la.shape, lb.shape);
    }
    let (m, k, n) = (la.shape.0[r - 2], la.shape.0[r - 1], lb.shape.0[r - 1]);
    let (oa, ob) = (batch_offsets(la), batch_offsets(lb));
    if oa.len() != ob.len() {
        crate::bail!("matmul", "batch dims differ: {:?} and {:?}", la.shape, lb.shape);
    }
    Ok(MatmulDims { r, m, k, n, oa, ob })
}

/// A single-threaded GEMM on raw strided operands: C (m, n) = alpha A (m, k) B (k, n) + beta C,
/// the arguments (m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc) as
/// matrixmultiply takes them, element (i, j) of X at `x + i*rsx + j*csx`.
///
/// # Safety
/// Every index the product touches lies inside that operand's allocation; strides are
/// non-negative; C's elements do not alias each other or A and B; with beta = 0, C may be
/// uninitialised (it is never read).
pub type GemmFn<T> = unsafe fn(usize, usize, usize, T, *const T, isize, isize, *const T, isize, isize, T, *mut T, isize, isize);

/// The GEMM of an element type, for `matmul` and for fused CPU kernels that cut their own work
/// into tasks (attention): f32 through `sgemm` (AVX-512 where the CPU has it, else
/// matrixmultiply), f64 through matrixmultiply.
pub trait GemmScalar: Float {
    fn gemm() -> GemmFn<Self>;

    /// (rows, columns) of the register tile `gemm` runs: the alignment of parallel tasks.
    fn gemm_tile() -> (usize, usize) {
        (GEMM_ALIGN, GEMM_ALIGN)
    }
}

impl GemmScalar for f32 {
    #[inline(always)]
    fn gemm() -> GemmFn<f32> {
        super::sgemm::sgemm()
    }

    fn gemm_tile() -> (usize, usize) {
        super::sgemm::tile()
    }
}

impl GemmScalar for f64 {
    #[inline(always)]
    fn gemm() -> GemmFn<f64> {
        matrixmultiply::dgemm
    }
}

/// Output rows (or columns) of one parallel GEMM task through matrixmultiply are a multiple of
/// this, a multiple of every side of its micro-tiles (at most 16); the AVX-512 f32 GEMM aligns
/// them to its own tile (`GemmScalar::gemm_tile`). So no task ends in a partial tile where
/// another could start.
pub(crate) const GEMM_ALIGN: usize = 32;
/// Below this many multiply-adds per matrix a GEMM is one task.
const GEMM_PAR_MIN: usize = 1 << 18;

/// An address that crosses to the pool's threads. Every task writes a disjoint block of the
/// output and only reads the operands.
#[derive(Clone, Copy)]
struct Addr(usize);

/// The blocks one matrix of a batched GEMM is cut into: (rows, or columns when n > m, per task;
/// task count). The batch and the blocks together give the pool about one task per thread, on
/// rayon's pool, so the GEMM and the element-wise kernels share one set of threads.
/// `tile` is the GEMM's (rows, columns) register tile; a task's rows (columns) are a multiple of
/// its rows (columns).
fn gemm_split(batches: usize, m: usize, k: usize, n: usize, tile: (usize, usize)) -> (usize, usize) {
    let long = m.max(n);
    let align = if m >= n { tile.0 } else { tile.1 };
    let threads = rayon::current_num_threads();
    if threads <= 1 || batches >= threads || m * k * n < GEMM_PAR_MIN || long < 2 * align.max(GEMM_ALIGN) {
        return (long, 1);
    }
    let want = threads.div_ceil(batches);
    let per = long.div_ceil(want).div_ceil(align) * align;
    (per, long.div_ceil(per))
}

/// a: (..., m, k), b: (..., k, n) with equal batch dims; any strides (transposes are free).
/// Every matrix's extent is checked against its storage before the GEMM reads it. The
/// batch, and a large matrix's longer output side, are cut into tasks on rayon's pool;
/// each task is a single-threaded GEMM into its own block of the output.
pub fn matmul<T: GemmScalar + Send + Sync>(a: &[T], la: &Layout, b: &[T], lb: &Layout) -> crate::Result<Vec<T>> {
    let MatmulDims { r, m, k, n, oa, ob } = matmul_dims(la, lb)?;
    let len = oa.len() * m * n;
    // An empty batch as well: `gemm_split` divides by the batch count.
    if len == 0 || k == 0 {
        return Ok(vec![T::zero(); len]);
    }
    let (rsa, csa) = (la.strides[r - 2], la.strides[r - 1]);
    let (rsb, csb) = (lb.strides[r - 2], lb.strides[r - 1]);
    for (&pa, &pb) in oa.iter().zip(&ob) {
        check_extent("matmul", a.len(), pa, m, k, rsa, csa)?;
        check_extent("matmul", b.len(), pb, k, n, rsb, csb)?;
    }
    let (per, blocks) = gemm_split(oa.len(), m, k, n, T::gemm_tile());
    let rows = m >= n;
    let mut out: Vec<T> = Vec::with_capacity(len);
    let (pa0, pb0, pc0) = (Addr(a.as_ptr() as usize), Addr(b.as_ptr() as usize), Addr(out.as_mut_ptr() as usize));
    let task = |t: usize| {
        let (bi, blk) = (t / blocks, t % blocks);
        let (lo, hi) = (blk * per, ((blk + 1) * per).min(if rows { m } else { n }));
        // Row block: a's rows lo..hi into c's rows lo..hi; column block: b's columns.
        let (mm, nn) = if rows { (hi - lo, n) } else { (m, hi - lo) };
        let (da, db, dc) = if rows { (lo * rsa, 0, lo * n) } else { (0, lo * csb, lo) };
        // SAFETY: check_extent above proved that the last element of every operand,
        // base + (rows-1)*rs + (cols-1)*cs, lies inside its slice; strides are
        // non-negative, so every index this block's GEMM touches (a sub-range of those
        // rows or columns) does too, and a stride is multiplied only by indices below
        // its dim, so its isize cast is exact. `out` has capacity for the whole (batch,
        // m, n) output; this task writes exactly its own (mm, nn) block at strides
        // (n, 1), disjoint from every other task's, and with beta = 0 the GEMM never
        // reads the uninitialised output. `out` is not touched until every task ended.
        unsafe {
            let ap = (pa0.0 as *const T).add(oa[bi] + da);
            let bp = (pb0.0 as *const T).add(ob[bi] + db);
            let cp = (pc0.0 as *mut T).add(bi * m * n + dc);
            T::gemm()(mm, k, nn, T::one(), ap, rsa as isize, csa as isize, bp, rsb as isize, csb as isize, T::zero(), cp, n as isize, 1);
        }
    };
    let tasks = oa.len() * blocks;
    if tasks == 1 {
        task(0);
    } else {
        (0..tasks).into_par_iter().for_each(task);
    }
    // SAFETY: the tasks above wrote every element of the (batch, m, n) output once.
    unsafe { out.set_len(len) };
    Ok(out)
}

/// f32 `matmul`.
pub fn matmul_f32(a: &[f32], la: &Layout, b: &[f32], lb: &Layout) -> crate::Result<Vec<f32>> {
    matmul(a, la, b, lb)
}

/// bf16 a (..., m, k) · b (..., k, n) -> f32 (..., m, n) on AVX512-BF16 (`gemm_bf16`); the
/// caller checked `gemm_bf16::available()`. Extents are checked as in `matmul_f32`.
pub fn matmul_bf16(a: &[half::bf16], la: &Layout, b: &[half::bf16], lb: &Layout) -> crate::Result<Vec<f32>> {
    use super::gemm_bf16::{gemm, View};
    let MatmulDims { r, m, k, n, oa, ob } = matmul_dims(la, lb)?;
    let mut out = vec![0f32; oa.len() * m * n];
    if m == 0 || n == 0 || k == 0 {
        return Ok(out);
    }
    let (rsa, csa, rsb, csb) = (la.strides[r - 2], la.strides[r - 1], lb.strides[r - 2], lb.strides[r - 1]);
    for (c, (&pa, &pb)) in out.chunks_mut(m * n).zip(oa.iter().zip(&ob)) {
        check_extent("matmul", a.len(), pa, m, k, rsa, csa)?;
        check_extent("matmul", b.len(), pb, k, n, rsb, csb)?;
        gemm(m, k, n, View { data: a, off: pa, rs: rsa, cs: csa }, View { data: b, off: pb, rs: rsb, cs: csb }, c);
    }
    Ok(out)
}
/// f64 `matmul`.
pub fn matmul_f64(a: &[f64], la: &Layout, b: &[f64], lb: &Layout) -> crate::Result<Vec<f64>> {
    matmul(a, la, b, lb)
}

/// Concatenates contiguous parts of the given shapes along `dim`.
pub fn cat<T: Copy>(parts: &[&[T]], shapes: &[&[usize]], dim: usize) -> Vec<T> {
    let outer: usize = shapes[0][..dim].iter().product();
    let inner: Vec<usize> = shapes.iter().map(|s| s[dim..].iter().product()).collect();
    let mut out = Vec::with_capacity(inner.iter().sum::<usize>() * outer);
    for o in 0..outer {
        for (p, &w) in parts.iter().zip(&inner) {
            out.extend_from_slice(&p[o * w..(o + 1) * w]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Shape;

    /// The GEMM's unsafe read is guarded: a layout reaching past its storage is an error.
    #[test]
    fn matmul_refuses_layouts_past_the_storage() {
        let a = vec![1f32; 6];
        let la = Layout::contiguous(Shape(vec![2, 3]));
        let lb = Layout::contiguous(Shape(vec![3, 2]));
        assert_eq!(matmul_f32(&a, &la, &a, &lb).unwrap(), vec![3.0; 4]);
        let short = vec![1f32; 5];
        let e = matmul_f32(&short, &la, &a, &lb).unwrap_err().to_string();
        assert!(e.contains("reaches past a storage of 5 elements"), "{e}");
        let shifted = Layout { offset: 1, ..la.clone() };
        assert!(matmul_f32(&a, &shifted, &a, &lb).is_err());
        let wide = Layout { strides: vec![usize::MAX / 2, 1], ..la.clone() };
        assert!(matmul_f32(&a, &wide, &a, &lb).is_err());
        assert!(matmul_f64(&[0.0; 6], &la, &[0.0; 6], &la).is_err(), "inner dims differ");
    }

    /// The parallel split (row blocks, column blocks when n > m, a partial last block, batches,
    /// transposed operands, an empty batch) on a 4-thread pool against a naive f64 product.
    #[test]
    fn gemm_split_aligns_tasks_to_the_tile() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
        pool.install(|| {
            for (m, k, n, tile) in
                [(2048, 256, 256, (14, 32)), (300, 256, 2000, (14, 32)), (2048, 256, 688, (32, 32)), (997, 300, 50, (14, 32))]
            {
                let (per, blocks) = gemm_split(1, m, k, n, tile);
                let (long, align) = if m >= n { (m, tile.0) } else { (n, tile.1) };
                assert!(blocks > 1, "{m}x{k}x{n} is split");
                assert_eq!(per % align, 0, "{m}x{k}x{n}: {per} per task, tile {tile:?}");
                assert!(per * blocks >= long && per * (blocks - 1) < long, "{m}x{k}x{n}: {blocks} x {per}");
            }
        });
    }

    #[test]
    fn split_gemm_matches_a_naive_product() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
        pool.install(|| {
            for (batch, m, k, n, ta, tb) in [
                (1, 200, 300, 130, false, false),
                (1, 40, 300, 500, false, true),
                (1, 290, 310, 70, true, false),
                (3, 70, 60, 90, false, false),
            ] {
                assert!(batch > 1 || m * k * n >= GEMM_PAR_MIN, "a single matrix this small would not be split");
                let val = |i: usize| ((i * 7919) % 1009) as f32 / 1009.0 - 0.5;
                let a: Vec<f32> = (0..batch * m * k).map(val).collect();
                let b: Vec<f32> = (0..batch * k * n).map(|i| val(i + 13)).collect();
                // A transposed operand is stored (k, m) or (n, k) and viewed through its strides.
                let lay = |rows: usize, cols: usize, t: bool| {
                    let strides = if t { vec![rows * cols, 1, rows] } else { vec![rows * cols, cols, 1] };
                    Layout { shape: Shape(vec![batch, rows, cols]), strides, offset: 0 }
                };
                let (la, lb) = (lay(m, k, ta), lay(k, n, tb));
                let got = matmul_f32(&a, &la, &b, &lb).unwrap();
                let at = |l: &Layout, d: &[f32], bi: usize, i: usize, j: usize| {
                    d[bi * l.strides[0] + i * l.strides[1] + j * l.strides[2]] as f64
                };
                for bi in 0..batch {
                    for i in 0..m {
                        for j in 0..n {
                            let want: f64 = (0..k).map(|p| at(&la, &a, bi, i, p) * at(&lb, &b, bi, p, j)).sum();
                            let g = got[(bi * m + i) * n + j] as f64;
                            assert!(
                                (g - want).abs() <= 1e-4 * (1.0 + want.abs()),
                                "{batch}x{m}x{k}x{n} ({ta},{tb}) at {bi},{i},{j}: {g} vs {want}"
                            );
                        }
                    }
                }
            }
            let empty = Layout { shape: Shape(vec![0, 64, 64]), strides: vec![4096, 64, 1], offset: 0 };
            assert!(matmul_f32(&[], &empty, &[], &empty).unwrap().is_empty(), "an empty batch");
        });
    }
}
