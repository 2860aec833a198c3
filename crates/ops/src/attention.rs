//! Causal scaled-dot-product attention with native grouped-query attention: q (b, hq, t, d),
//! k and v (b, hkv, t, d) with hq a multiple of hkv; query head h reads kv head h / (hq / hkv)
//! in place, K/V are never copied per query head. o = softmax(q·kᵀ·scale + causal mask)·v;
//! the forward saves the log-sum-exp of each row (f32), so the backward recomputes the
//! probabilities without a (t, t) matrix. dK/dV sum over a group's query heads in a fixed order
//! on every device (deterministic).
//! CUDA: kernels/attention.cu, FlashAttention-2 on tensor cores for bf16 with head dim 64/128
//! (forward; backward as dK/dV and dQ passes), one warp per row (SIMT) for everything else.
//! The tensor-core kernels read q, k, v (and write o, dq, dk, dv) in the time-major layout the
//! projections write (`HeadLayout`), so a model's heads are split and merged without copies;
//! the CPU reference and the SIMT kernels take head-major tensors.
//!
//! Packed rows (`segment_attention`): each batch row holds several sequences one after the other
//! (`Segments`, FlashAttention varlen's cu_seqlens per row), and a query sees only the keys of
//! its own segment, causally. No mask is built: the CPU runs each segment as its own sequence;
//! the CUDA kernels read each token's segment bounds, start their tile loops at the first tile
//! of the segment, skip the tiles a warp's rows cannot see, and mask only those partly covered
//! (`count_skipped_tiles` counts what they skipped). Rows that are one segment each take the
//! plain causal kernels, unchanged.
//!
//! Sliding window (`causal_attention_window`, `segment_attention_window`; Mistral, Qwen2,
//! Gemma 3): with window w, query i sees key j when i - w < j <= i, as transformers'
//! `sliding_window_causal_mask_function` has it; inside segments the positions count from each
//! segment's start, which gives the same keys. The CPU reference computes only the keys of each
//! block's windows; on CUDA w is an argument of the SIMT kernels and of the flash `_seg` twins
//! (with no segments, a null `seg`), which start their tile loops at the first tile a block's
//! windows reach and stop at the diagonal (dK/dV: at the last query that sees its
//! keys, j + w - 1), so the tiles visited grow with w, not t (`count_skipped_tiles` counts the
//! skipped ones). A window of t or more is plain causal attention, bit for bit; 0 is an error.
use crate::dispatch::{dev_ptr, f32_ptr, num, on, On};
use crate::heads::HeadLayout;
use crate::segments::Segments;
use ferrolm_tensor::backend::View;
use ferrolm_tensor::{bail, same_float, Device, Error, Layout, Result, Storage, Tensor};

/// Warps per block of the CUDA flash kernels on this thread: 8 (`FLASH_WARPS`), or 4
/// (`FLASH_WARPS_SMALL`, the `_w4` kernels: 64-row blocks, two to an SM) where `FERROLM_FLASH_WARPS=4`
/// is set or inside [`with_flash_warps`]. The choice between them is a GPU measurement
/// (`bench_cuda` times both); the results are the same to the bit, only the block size differs.
pub fn flash_warps() -> Result<usize> {
    if let Some(w) = FLASH_WARPS_HERE.get() {
        return Ok(w);
    }
    // Read once: this is asked on every attention call.
    static FROM_ENV: std::sync::OnceLock<std::result::Result<usize, String>> = std::sync::OnceLock::new();
    match FROM_ENV.get_or_init(|| parse_flash_warps(std::env::var("FERROLM_FLASH_WARPS").ok().as_deref())) {
        Ok(w) => Ok(*w),
        Err(e) => bail!("attention", "{e}"),
    }
}

/// `FERROLM_FLASH_WARPS`'s value (`None`: unset) as warps per block.
pub fn parse_flash_warps(v: Option<&str>) -> std::result::Result<usize, String> {
    match v.map(str::trim) {
        None | Some("") | Some("8") => Ok(8),
        Some("4") => Ok(4),
        Some(other) => Err(format!("FERROLM_FLASH_WARPS={other}: the flash kernels come with 4 or 8 warps per block")),
    }
}

thread_local! {
    static FLASH_WARPS_HERE: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with the flash kernels at `warps` (4 or 8) per block on this thread, whatever
/// `FERROLM_FLASH_WARPS` says; `bench_cuda` and the tests time and check both this way.
pub fn with_flash_warps<R>(warps: usize, f: impl FnOnce() -> R) -> Result<R> {
    if warps != 4 && warps != 8 {
        bail!("attention", "{warps} warps per block: the flash kernels come with 4 or 8");
    }
    // Restored when the closure returns or unwinds.
    struct Restore(Option<usize>);
    impl Drop for Restore {
        fn drop(&mut self) {
            FLASH_WARPS_HERE.set(self.0);
        }
    }
    let _restore = Restore(FLASH_WARPS_HERE.replace(Some(warps)));
    Ok(f())
}

/// Sizes of a causal attention call: q is (b, hq, t, d), k and v are (b, hkv, t, d).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnDims {
    pub b: usize,
    pub hq: usize,
    pub hkv: usize,
    pub t: usize,
    pub d: usize,
}

/// Causal attention of q (b, hq, t, d) over k, v (b, hkv, t, d), hq a multiple of hkv.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    attention_op(q, k, v, scale, None, None)
}

/// Causal attention with a sliding window: query i attends to keys j with i - window < j <= i
/// (transformers' sliding window); `None` is full causal attention, and so is a window of t or
/// more (bit for bit). A window of 0 is an error.
pub fn causal_attention_window(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, window: Option<usize>) -> Result<Tensor> {
    attention_op(q, k, v, scale, None, window)
}

/// Causal attention inside segments: batch row r of q, k, v holds the sequences that `segs`
/// gives for row r, and query i of a segment [s, e) attends to keys s..=i only. Its output
/// for a segment equals `causal_attention` of that segment alone.
pub fn segment_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, segs: &Segments) -> Result<Tensor> {
    attention_op(q, k, v, scale, Some(segs), None)
}

/// `segment_attention` with a sliding window inside each segment: query i of a segment [s, e)
/// attends to keys j with max(s, i - window + 1) <= j <= i, the same as
/// `causal_attention_window` of that segment alone.
pub fn segment_attention_window(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, segs: &Segments, window: Option<usize>) -> Result<Tensor> {
    attention_op(q, k, v, scale, Some(segs), window)
}

/// The window an attention call over t positions runs with: `None` for full causal attention
/// (no window, or one of t or more, which sees every earlier key); an error for 0.
pub fn effective_window(op: &str, window: Option<usize>, t: usize) -> Result<Option<usize>> {
    match window {
        Some(0) => bail!(op, "sliding window 0: a window must hold at least 1 position (the query's own)"),
        Some(w) if w < t => Ok(Some(w)),
        _ => Ok(None),
    }
}

fn attention_op(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, segs: Option<&Segments>, window: Option<usize>) -> Result<Tensor> {
    same_float("attention", &[q, k, v])?;
    if q.rank() != 4 || k.rank() != 4 || v.rank() != 4 {
        bail!("attention", "q, k, v must be (batch, heads, seq, head_dim), got {:?} {:?} {:?}", q.shape(), k.shape(), v.shape());
    }
    let (qd, kd) = (q.dims(), k.dims());
    if k.shape() != v.shape() || qd[0] != kd[0] || qd[2] != kd[2] || qd[3] != kd[3] || kd[1] == 0 || qd[1] % kd[1] != 0 {
        bail!(
            "attention",
            "incompatible q {:?}, k {:?}, v {:?}: k and v must match and q heads must be a multiple of kv heads",
            q.shape(),
            k.shape(),
            v.shape()
        );
    }
    let dims = AttnDims { b: qd[0], hq: qd[1], hkv: kd[1], t: qd[2], d: qd[3] };
    if let Some(s) = segs {
        check_segments("attention", s, dims)?;
    }
    let window = effective_window("attention", window, dims.t)?;
    // Rows that are one segment each are plain causal attention: the unsegmented kernels.
    let segs = segs.filter(|s| !s.is_whole()).cloned();
    // Time-major where the tensor-core kernels run and q, k, v all are (the projections' heads):
    // no copies in or out. Anything else is made head-major.
    let layout = match HeadLayout::common(&[q.layout(), k.layout(), v.layout()]) {
        Some(HeadLayout::TimeMajor) if !matches!(q.device(), Device::Cpu) && cuda::flash(q.dtype(), dims, scale) => HeadLayout::TimeMajor,
        _ => HeadLayout::HeadMajor,
    };
    let (qc, kc, vc) = (layout.arrange(q)?, layout.arrange(k)?, layout.arrange(v)?);
    let (o, lse) = Tensor::with_storages(&[&qc, &kc, &vc], |s| forward_window(s[0], s[1], s[2], dims, scale, segs.as_ref(), window))?;
    let (qs, kvs) = ([dims.b, dims.hq, dims.t, dims.d], [dims.b, dims.hkv, dims.t, dims.d]);
    let out = layout.tensor(o, qs)?;
    let lse = Tensor::new(lse, [dims.b, dims.hq, dims.t])?;
    let o = out.clone();
    let backward_fn = move |g: &Tensor| {
        let g = layout.arrange(g)?;
        let (dq, dk, dv) = Tensor::with_storages(&[&g, &qc, &kc, &vc, &o, &lse], |s| {
            backward_window([s[0], s[1], s[2], s[3], s[4], s[5]], dims, scale, segs.as_ref(), window)
        })?;
        Ok(vec![Some(layout.tensor(dq, qs)?), Some(layout.tensor(dk, kvs)?), Some(layout.tensor(dv, kvs)?)])
    };
    Ok(Tensor::from_op(out, "attention", &[q, k, v], Box::new(backward_fn)))
}

/// `segs` describes b rows of t tokens.
fn check_segments(op: &str, segs: &Segments, a: AttnDims) -> Result<()> {
    if segs.rows() != a.b || segs.seq_len() != a.t {
        bail!(op, "segments of {} rows of {} tokens for q of {} rows of {}", segs.rows(), segs.seq_len(), a.b, a.t);
    }
    Ok(())
}

/// The head layout that every view of `ls` is dense in, or an error naming the tensors.
fn layout_of(op: &str, names: &str, ls: &[&Layout]) -> Result<HeadLayout> {
    HeadLayout::common(ls).ok_or_else(|| {
        let strides: Vec<_> = ls.iter().map(|l| &l.strides).collect();
        Error::new(op, format!("{names} must be dense in one head layout, (b, heads, t, d) or (b, t, heads, d); strides {strides:?}"))
    })
}

/// The CPU reference and the SIMT kernels take head-major tensors only.
fn head_major(op: &str, layout: HeadLayout) -> Result<()> {
    if layout != HeadLayout::HeadMajor {
        bail!(op, "time-major (b, t, heads, d) inputs need the CUDA tensor-core kernels (bf16, head dim 64 or 128); copy them to (b, heads, t, d)");
    }
    Ok(())
}

/// q, k, v dense in one head layout (`HeadLayout`; head-major on the CPU and for the SIMT
/// kernels) -> (o (b, hq, t, d) in that layout, lse (b, hq, t) in f32, f64 for f64). With
/// `segs`, attention stays inside each row's segments (`segment_attention`).
pub fn forward(q: View, k: View, v: View, dims: AttnDims, scale: f64, segs: Option<&Segments>) -> Result<(Storage, Storage)> {
    forward_window(q, k, v, dims, scale, segs, None)
}

/// `forward` with a sliding window (`causal_attention_window`; `None`: full causal).
pub fn forward_window(
    q: View,
    k: View,
    v: View,
    dims: AttnDims,
    scale: f64,
    segs: Option<&Segments>,
    window: Option<usize>,
) -> Result<(Storage, Storage)> {
    let layout = layout_of("attention", "q, k, v", &[q.1, k.1, v.1])?;
    if let Some(s) = segs {
        check_segments("attention", s, dims)?;
    }
    let w = effective_window("attention", window, dims.t)?.unwrap_or(dims.t);
    match on("attention", q.0)? {
        On::Cpu => head_major("attention", layout).and_then(|_| cpu::forward(q, k, v, dims, scale, segs, w)),
        On::Cuda(be) => cuda::forward(&be, q, k, v, dims, layout, scale, segs, w),
    }
}

/// `views`: the output gradient, q, k, v and the forward's o, dense in one head layout as in
/// `forward`, and lse, contiguous -> (dq, dk, dv) in that layout; `segs` as in the forward.
pub fn backward(views: [View; 6], dims: AttnDims, scale: f64, segs: Option<&Segments>) -> Result<(Storage, Storage, Storage)> {
    backward_window(views, dims, scale, segs, None)
}

/// `backward` with a sliding window, the forward's.
pub fn backward_window(
    views: [View; 6],
    dims: AttnDims,
    scale: f64,
    segs: Option<&Segments>,
    window: Option<usize>,
) -> Result<(Storage, Storage, Storage)> {
    let [dout, q, k, v, out, _] = views;
    let layout = layout_of("attention_backward", "dO, q, k, v, o", &[dout.1, q.1, k.1, v.1, out.1])?;
    if let Some(s) = segs {
        check_segments("attention_backward", s, dims)?;
    }
    let w = effective_window("attention_backward", window, dims.t)?.unwrap_or(dims.t);
    match on("attention", q.0)? {
        On::Cpu => head_major("attention_backward", layout).and_then(|_| cpu::backward(views, dims, scale, segs, w)),
        On::Cuda(be) => cuda::backward(&be, views, dims, layout, scale, segs, w),
    }
}

mod cpu {
    //! The reference: forward parallel over (batch, query head), backward over (batch, kv head)
    //! with the group's query heads visited in order. K and V are read in place (GQA, no
    //! copies). Each task walks its query rows in blocks of BLOCK_Q: the scores of a block
    //! against the keys it may see, and every product with them, are single-threaded GEMMs
    //! (the tasks are the parallelism), the softmax between them is vectorised
    //! (`multiversion!`, `FastExp`), and the block's scores are the only (rows, t) buffer.
    use super::*;
    use ferrolm_tensor::cpu::simd::{max, sum_map, FastExp};
    use ferrolm_tensor::cpu::{GemmScalar, Stat};
    use ferrolm_tensor::{float_dispatch, multiversion};
    use num_traits::Float;
    use rayon::prelude::*;

    /// Each row's segments as (start, end) ranges: the whole row without `segs`.
    fn row_segments(segs: Option<&Segments>, a: AttnDims) -> Vec<Vec<(usize, usize)>> {
        (0..a.b).map(|r| segs.map_or_else(|| vec![(0, a.t)], |s| s.ranges(r).collect())).collect()
    }

    /// `w`: the window, 1..=t (t: full causal).
    pub(super) fn forward(
        q: View,
        k: View,
        v: View,
        dims: AttnDims,
        scale: f64,
        segs: Option<&Segments>,
        w: usize,
    ) -> Result<(Storage, Storage)> {
        let (oq, ok, ov) = (q.1.offset, k.1.offset, v.1.offset);
        let (nq, nk) = (q.1.numel(), k.1.numel());
        let dt = q.0.dtype();
        let rs = row_segments(segs, dims);
        Ok(float_dispatch!("attention", dt, [q, k, v], attention(&q[oq..oq + nq], &k[ok..ok + nk], &v[ov..ov + nk], dims, scale, &rs, w)))
    }

    /// `views`: the output gradient, q, k, v, and the forward's o and lse.
    pub(super) fn backward(
        views: [View; 6],
        dims: AttnDims,
        scale: f64,
        segs: Option<&Segments>,
        w: usize,
    ) -> Result<(Storage, Storage, Storage)> {
        let [dout, q, k, v, out, lse] = views;
        let (nq, nk) = (q.1.numel(), k.1.numel());
        let offs = [dout.1.offset, q.1.offset, k.1.offset, v.1.offset, out.1.offset, lse.1.offset];
        let nl = lse.1.numel();
        let rs = row_segments(segs, dims);
        Ok(float_dispatch!(
            "attention_backward",
            q.0.dtype(),
            [dout, q, k, v, out, lse],
            attention_backward(
                [
                    &dout[offs[0]..offs[0] + nq],
                    &q[offs[1]..offs[1] + nq],
                    &k[offs[2]..offs[2] + nk],
                    &v[offs[3]..offs[3] + nk],
                    &out[offs[4]..offs[4] + nq],
                    &lse[offs[5]..offs[5] + nl],
                ],
                dims,
                scale,
                &rs,
                w
            )
        ))
    }

    fn dot<T: Float>(a: &[T], b: &[T]) -> T {
        a.iter().zip(b).fold(T::zero(), |s, (&x, &y)| s + x * y)
    }

    /// Query rows per block: a block's scores against its keys are one (rows, keys) GEMM.
    const BLOCK_Q: usize = 64;

    /// C (m, n) = alpha A (m, k) B (k, n) + beta C on slices, one thread; an operand is (slice,
    /// row stride, column stride), C's row stride is `rsc`. The extents are checked first.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn mm<T: GemmScalar>(
        m: usize,
        k: usize,
        n: usize,
        alpha: T,
        a: (&[T], usize, usize),
        b: (&[T], usize, usize),
        beta: T,
        c: &mut [T],
        rsc: usize,
    ) {
        let last = |rows: usize, cols: usize, rs: usize, cs: usize| (rows - 1) * rs + (cols - 1) * cs;
        assert!(m > 0 && k > 0 && n > 0 && rsc >= n, "attention: empty or overlapping GEMM ({m}, {k}, {n})");
        assert!(
            last(m, k, a.1, a.2) < a.0.len() && last(k, n, b.1, b.2) < b.0.len() && last(m, n, rsc, 1) < c.len(),
            "attention: GEMM operand out of range"
        );
        // SAFETY: the asserts above put the last element of every operand inside its slice
        // (strides are non-negative, so every other index is below it); C's rows are `rsc >= n`
        // apart, so its elements do not alias, and `c` is an exclusive borrow apart from a and b.
        unsafe {
            T::gemm()(
                m,
                k,
                n,
                alpha,
                a.0.as_ptr(),
                a.1 as isize,
                a.2 as isize,
                b.0.as_ptr(),
                b.1 as isize,
                b.2 as isize,
                beta,
                c.as_mut_ptr(),
                rsc as isize,
                1,
            )
        }
    }

    /// The keys a block of query rows [i0, i0 + rows) sees with window w: [first key of row i0,
    /// last row + 1).
    fn block_keys(i0: usize, rows: usize, w: usize) -> (usize, usize) {
        ((i0 + 1).saturating_sub(w), i0 + rows)
    }

    /// Row i's visible keys as a range of its block's key columns from `k0`: [i - w + 1, i] ∩ [0, t).
    fn live_cols(i: usize, w: usize, k0: usize) -> (usize, usize) {
        ((i + 1).saturating_sub(w) - k0, i + 1 - k0)
    }

    multiversion! {
    /// One (batch, query head): o and lse of its t rows, a block of BLOCK_Q query rows at a time:
    /// S = scale Q K^T against the keys the block's rows see (window w: from the first row's
    /// window start to the last row; GEMM), the causal windowed softmax of each row in place, then
    /// O = P V (GEMM).
    fn attention_head[T: FastExp + GemmScalar](qh: &[T], kh: &[T], vh: &[T], t: usize, d: usize, sc: T, w: usize, o: &mut [T], lse: &mut [T]) {
        let mut s = vec![T::zero(); BLOCK_Q.min(t) * BLOCK_Q.min(t).saturating_add(w).min(t)];
        for i0 in (0..t).step_by(BLOCK_Q) {
            let rows = BLOCK_Q.min(t - i0);
            let (k0, k1) = block_keys(i0, rows, w);
            let keys = k1 - k0;
            let s = &mut s[..rows * keys];
            mm(rows, d, keys, sc, (&qh[i0 * d..], d, 1), (&kh[k0 * d..], 1, d), T::zero(), s, keys);
            for (r, row) in s.chunks_exact_mut(keys).enumerate() {
                let (a, e) = live_cols(i0 + r, w, k0);
                let (before, rest) = row.split_at_mut(a);
                let (live, future) = rest.split_at_mut(e - a);
                let m = max(live);
                for v in live.iter_mut() {
                    *v = (*v - m).fast_exp();
                }
                let l = sum_map(live, |p| p);
                let inv = T::one() / l;
                live.iter_mut().for_each(|p| *p = *p * inv);
                before.fill(T::zero());
                future.fill(T::zero());
                lse[i0 + r] = m + l.ln();
            }
            mm(rows, keys, d, T::one(), (s, keys, 1), (&vh[k0 * d..], d, 1), T::zero(), &mut o[i0 * d..], d);
        }
    }
    }

    /// -> (o (b, hq, t, d), lse (b, hq, t)). Each segment of a row (`segs[b]`) is attended as a
    /// sequence of its own: the same blocks and sums as if it were alone.
    fn attention<T: FastExp + GemmScalar + Send + Sync>(
        q: &[T],
        k: &[T],
        v: &[T],
        a: AttnDims,
        scale: f64,
        segs: &[Vec<(usize, usize)>],
        w: usize,
    ) -> (Vec<T>, Stat<Vec<T>>) {
        let (t, d, group) = (a.t, a.d, a.hq / a.hkv);
        let sc: T = num(scale);
        let mut o = vec![T::zero(); q.len()];
        let mut lse = vec![T::zero(); a.b * a.hq * t];
        o.par_chunks_mut(t * d).zip(lse.par_chunks_mut(t)).enumerate().for_each(|(bh, (o, lse))| {
            let (b, h) = (bh / a.hq, bh % a.hq);
            let kv = (b * a.hkv + h / group) * t * d;
            let (qh, kh, vh) = (&q[bh * t * d..(bh + 1) * t * d], &k[kv..kv + t * d], &v[kv..kv + t * d]);
            for &(s, e) in &segs[b] {
                let rows = s * d..e * d;
                attention_head(&qh[rows.clone()], &kh[rows.clone()], &vh[rows.clone()], e - s, d, sc, w, &mut o[rows], &mut lse[s..e]);
            }
        });
        (o, Stat(lse))
    }

    /// The inputs of one kv head's backward: its k, v (t, d), and for each of its query heads
    /// q, dO, O (t, d) and lse (t) one after the other.
    struct KvGroup<'a, T> {
        k: &'a [T],
        v: &'a [T],
        q: &'a [T],
        dout: &'a [T],
        o: &'a [T],
        lse: &'a [T],
    }

    multiversion! {
    /// One kv head over the positions `seg` = [s, e) of its rows of `row_len` (a segment, or the
    /// whole row): dq of its query heads, its dk and dv (accumulated over the query heads in
    /// order, then blocks in order). Per block of query rows, over the keys its rows see (window
    /// w): P from the forward's lse and dP = dO V^T (GEMMs), dS = P (dP - rowsum(dO O)) scale in
    /// place, then dQ = dS K, dK += dS^T Q and dV += P^T dO (GEMMs).
    fn attention_head_backward[T: FastExp + GemmScalar](x: &KvGroup<T>, group: usize, row_len: usize, seg: (usize, usize), d: usize, sc: T, w: usize, dqg: &mut [T], dk: &mut [T], dv: &mut [T]) {
        let (s, e) = seg;
        let t = e - s;
        let n = BLOCK_Q.min(t) * BLOCK_Q.min(t).saturating_add(w).min(t);
        let (mut p, mut ds) = (vec![T::zero(); n], vec![T::zero(); n]);
        let (zero, one) = (T::zero(), T::one());
        let (k, v) = (&x.k[s * d..e * d], &x.v[s * d..e * d]);
        let (dk, dv) = (&mut dk[s * d..e * d], &mut dv[s * d..e * d]);
        for g in 0..group {
            let head = (g * row_len + s) * d..(g * row_len + e) * d;
            let (q, dout, o) = (&x.q[head.clone()], &x.dout[head.clone()], &x.o[head.clone()]);
            let lse = &x.lse[g * row_len + s..g * row_len + e];
            let dqh = &mut dqg[head];
            for i0 in (0..t).step_by(BLOCK_Q) {
                let rows = BLOCK_Q.min(t - i0);
                let (k0, k1) = block_keys(i0, rows, w);
                let keys = k1 - k0;
                let (kb, vb) = (&k[k0 * d..], &v[k0 * d..]);
                let (p, ds) = (&mut p[..rows * keys], &mut ds[..rows * keys]);
                mm(rows, d, keys, sc, (&q[i0 * d..], d, 1), (kb, 1, d), zero, p, keys);
                mm(rows, d, keys, one, (&dout[i0 * d..], d, 1), (vb, 1, d), zero, ds, keys);
                for (r, (pr, dr)) in p.chunks_exact_mut(keys).zip(ds.chunks_exact_mut(keys)).enumerate() {
                    let i = i0 + r;
                    let di = dot(&dout[i * d..(i + 1) * d], &o[i * d..(i + 1) * d]);
                    let l = lse[i];
                    let (a, e) = live_cols(i, w, k0);
                    for (pj, sj) in pr[a..e].iter_mut().zip(dr[a..e].iter_mut()) {
                        *pj = (*pj - l).fast_exp();
                        *sj = *pj * (*sj - di) * sc;
                    }
                    for x in [&mut *pr, &mut *dr] {
                        x[..a].fill(zero);
                        x[e..].fill(zero);
                    }
                }
                mm(rows, keys, d, one, (ds, keys, 1), (kb, d, 1), zero, &mut dqh[i0 * d..], d);
                mm(keys, rows, d, one, (ds, 1, keys), (&q[i0 * d..], d, 1), one, &mut dk[k0 * d..], d);
                mm(keys, rows, d, one, (p, 1, keys), (&dout[i0 * d..], d, 1), one, &mut dv[k0 * d..], d);
            }
        }
    }
    }

    /// [dO, q, k, v, o, lse] -> (dq, dk, dv). The query heads of one kv head are contiguous, so
    /// a task owns the dq rows of its group and the dk/dv rows of its kv head; it walks the
    /// row's segments in order.
    fn attention_backward<T: FastExp + GemmScalar + Send + Sync>(
        [dout, q, k, v, o, lse]: [&[T]; 6],
        a: AttnDims,
        scale: f64,
        segs: &[Vec<(usize, usize)>],
        w: usize,
    ) -> (Vec<T>, Vec<T>, Vec<T>) {
        let (t, d, group) = (a.t, a.d, a.hq / a.hkv);
        let sc: T = num(scale);
        let mut dq = vec![T::zero(); q.len()];
        let mut dk = vec![T::zero(); k.len()];
        let mut dv = vec![T::zero(); v.len()];
        let (hd, gd) = (t * d, group * t * d);
        dq.par_chunks_mut(gd).zip(dk.par_chunks_mut(hd).zip(dv.par_chunks_mut(hd))).enumerate().for_each(|(bkv, (dqg, (dk, dv)))| {
            let x = KvGroup {
                k: &k[bkv * hd..(bkv + 1) * hd],
                v: &v[bkv * hd..(bkv + 1) * hd],
                q: &q[bkv * gd..(bkv + 1) * gd],
                dout: &dout[bkv * gd..(bkv + 1) * gd],
                o: &o[bkv * gd..(bkv + 1) * gd],
                lse: &lse[bkv * group * t..(bkv + 1) * group * t],
            };
            for &seg in &segs[bkv / a.hkv] {
                attention_head_backward(&x, group, t, seg, d, sc, w, dqg, dk, dv);
            }
        });
        (dq, dk, dv)
    }
}

mod cuda;
pub use cuda::count_skipped_tiles;

/// Tiles the CUDA flash kernels skipped because they lay wholly outside the segments or the
/// sliding windows of a warp's rows (`count_skipped_tiles`): per pass, the (warp, tile) pairs of
/// the causal range a warp did not compute. The forward's and dQ's tiles are kv tiles, dK/dV's
/// query tiles of each query head.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SkippedTiles {
    pub fwd: u64,
    pub dkdv: u64,
    pub dq: u64,
}
