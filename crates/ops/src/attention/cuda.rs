//! Launchers of kernels/attention.cu: the tensor-core (flash) kernels for bf16 with head dim
//! 64 or 128, the SIMT kernels (one warp per row) otherwise. Packed rows take the flash kernels'
//! `_seg` twins, or the SIMT kernels with their segment bounds. A sliding window is an int
//! argument, 1..=t (t: none), of the SIMT kernels and the `_seg` twins, which then run with or
//! without segments (a null `seg`); the plain flash kernels are plain causal attention.
use super::*;
use ferrolm_cuda::consts::{
    ATTN_SIMT_PER_LANE, FLASH_BWD_TILE_D128, FLASH_BWD_TILE_D64, FLASH_FWD_TILE_D128, FLASH_FWD_TILE_D64, FLASH_PAD, FLASH_WARP_ROWS,
};
use ferrolm_cuda::{kernels, CudaBackend, CudaStorage, DevPtr, Launch};
use ferrolm_tensor::backend::Backend;
use ferrolm_tensor::{CpuStorage, DType, DeviceStorage, Shape};
use std::cell::Cell;

/// Threads per block of the SIMT kernels (a warp per row).
const SIMT_BLOCK: u32 = 128;
/// Threads per block of the backward's rowsum(dO * O) (a warp per row).
const DOT_BLOCK: u32 = 256;
const BF16_BYTES: usize = 2;

fn check(op: &str, a: AttnDims) -> Result<()> {
    if a.hkv == 0 || !a.hq.is_multiple_of(a.hkv) {
        bail!(op, "query heads ({}) must be a multiple of kv heads ({})", a.hq, a.hkv);
    }
    if a.d > 32 * ATTN_SIMT_PER_LANE {
        bail!(op, "head dim {} > {} is not supported on CUDA", a.d, 32 * ATTN_SIMT_PER_LANE);
    }
    if a.t > i32::MAX as usize {
        bail!(op, "sequence too long");
    }
    Ok(())
}

/// The tensor-core kernels take bf16 with head dim 64 or 128 and a positive scale (their
/// softmax takes the row maximum of the unscaled scores).
pub(super) fn flash(dt: DType, a: AttnDims, scale: f64) -> bool {
    dt == DType::BF16 && (a.d == 64 || a.d == 128) && scale > 0.0
}

/// Dynamic shared memory of the flash kernels with `warps` per block (16 rows each), bytes:
/// bf16 rows of d + FLASH_PAD elements (kernels/attention.cu states each layout). The forward
/// holds the Q tile and two stages of
/// (K, V) tiles; dK/dV its K and V rows and two stages of (Q, dO) tiles with their (lse, D)
/// in f32; dQ its Q and dO rows and two stages of (K, V) tiles.
pub(crate) struct FlashSmem {
    pub fwd: usize,
    pub dkdv: usize,
    pub dq: usize,
}
pub(crate) fn flash_smem(d: usize, warps: usize) -> FlashSmem {
    let (row, rows) = ((d + FLASH_PAD) * BF16_BYTES, FLASH_WARP_ROWS * warps);
    let (fwd_tile, bwd_tile) = flash_tiles(d);
    FlashSmem {
        fwd: (rows + 4 * fwd_tile) * row,
        dkdv: (2 * rows + 4 * bwd_tile) * row + 4 * bwd_tile * 4,
        dq: (2 * rows + 4 * bwd_tile) * row,
    }
}

/// Rows of the tiles a flash block stages per step at head dim `d`: (forward's kv tile, backward's
/// tile: query rows in dK/dV, kv rows in dQ).
fn flash_tiles(d: usize) -> (usize, usize) {
    if d == 64 {
        (FLASH_FWD_TILE_D64, FLASH_BWD_TILE_D64)
    } else {
        (FLASH_FWD_TILE_D128, FLASH_BWD_TILE_D128)
    }
}

// ---- counting the tiles skipped for segments ------------------------------------------------

thread_local! {
    static SKIPPED: Cell<Option<SkippedTiles>> = const { Cell::new(None) };
}

/// Runs `f` counting, per pass, the tiles the flash `_seg` kernels launched on this thread skip
/// for segments and sliding windows (`SkippedTiles`). Each such launch then reads its warps'
/// counts back (a host wait): for tests and measurements, not training.
pub fn count_skipped_tiles<R>(f: impl FnOnce() -> R) -> (R, SkippedTiles) {
    // Restored when `f` returns or unwinds, so counting nests.
    struct Restore(Option<SkippedTiles>);
    impl Drop for Restore {
        fn drop(&mut self) {
            SKIPPED.set(self.0);
        }
    }
    let _restore = Restore(SKIPPED.replace(Some(SkippedTiles::default())));
    let out = f();
    (out, SKIPPED.get().unwrap_or_default())
}

/// Runs `launch` with a buffer of `slots` i32 (one per warp of its grid) when this thread counts,
/// else with null, and adds the warps' counts to the pass `pass` picks.
fn counted(
    be: &CudaBackend,
    slots: usize,
    pass: fn(&mut SkippedTiles) -> &mut u64,
    launch: impl FnOnce(DevPtr) -> Result<()>,
) -> Result<()> {
    if SKIPPED.get().is_none() {
        return launch(DevPtr::NULL);
    }
    let buf = be.alloc_storage(slots, DType::I32)?;
    launch(buf.ptr())?;
    let st: Storage = buf.into();
    let CpuStorage::I32(counts) = be.to_cpu((&st, &Layout::contiguous(Shape(vec![slots]))))? else {
        bail!("attention", "the skipped-tile counts came back in another dtype");
    };
    let n: u64 = counts.iter().map(|&c| c as u64).sum();
    SKIPPED.set(SKIPPED.get().map(|mut s| {
        *pass(&mut s) += n;
        s
    }));
    Ok(())
}

/// The per-token segment bounds on `be`'s device (uploaded once per `Segments`) and the tensor
/// that holds them, which the caller keeps until the launches are enqueued.
fn seg_ptr(be: &CudaBackend, op: &str, segs: &Segments) -> Result<(DevPtr, Tensor)> {
    let t = segs.on_device(be.device())?;
    let p = t.with_storage(|v| dev_ptr(op, v))?;
    Ok((p, t))
}

// ---- the flash kernels of one (head dim, warps) ---------------------------------------------

// Pointers, then hq, hkv, t, scale, layout (and for `_seg`, the window).
type FwdKernel = unsafe fn(&CudaBackend, Launch, DevPtr, DevPtr, DevPtr, DevPtr, DevPtr, i32, i32, i32, f32, i32) -> Result<()>;
type FwdSegKernel =
    unsafe fn(&CudaBackend, Launch, DevPtr, DevPtr, DevPtr, DevPtr, DevPtr, DevPtr, DevPtr, i32, i32, i32, f32, i32, i32) -> Result<()>;
type DkdvKernel =
    unsafe fn(&CudaBackend, Launch, DevPtr, DevPtr, DevPtr, DevPtr, DevPtr, DevPtr, DevPtr, DevPtr, i32, i32, i32, f32, i32) -> Result<()>;
#[rustfmt::skip]
type DkdvSegKernel = unsafe fn(
    &CudaBackend, Launch, DevPtr, DevPtr, DevPtr, DevPtr, DevPtr, DevPtr, DevPtr, DevPtr, DevPtr, DevPtr, i32, i32, i32, f32, i32, i32,
) -> Result<()>;
type DqKernel =
    unsafe fn(&CudaBackend, Launch, DevPtr, DevPtr, DevPtr, DevPtr, DevPtr, DevPtr, DevPtr, i32, i32, i32, f32, i32) -> Result<()>;
#[rustfmt::skip]
type DqSegKernel = unsafe fn(
    &CudaBackend, Launch, DevPtr, DevPtr, DevPtr, DevPtr, DevPtr, DevPtr, DevPtr, DevPtr, DevPtr, i32, i32, i32, f32, i32, i32,
) -> Result<()>;

/// The flash kernels at head dim `d` (64 or 128) with `w` warps per block (4 or 8).
struct FlashKernels {
    fwd: FwdKernel,
    dkdv: DkdvKernel,
    dq: DqKernel,
    fwd_seg: FwdSegKernel,
    dkdv_seg: DkdvSegKernel,
    dq_seg: DqSegKernel,
}

fn flash_kernels(d: usize, w: usize) -> FlashKernels {
    use kernels::*;
    match (d, w) {
        (64, 4) => FlashKernels {
            fwd: flash_fwd_bf16_d64_w4,
            dkdv: flash_bwd_dkdv_bf16_d64_w4,
            dq: flash_bwd_dq_bf16_d64_w4,
            fwd_seg: flash_fwd_seg_bf16_d64_w4,
            dkdv_seg: flash_bwd_dkdv_seg_bf16_d64_w4,
            dq_seg: flash_bwd_dq_seg_bf16_d64_w4,
        },
        (64, _) => FlashKernels {
            fwd: flash_fwd_bf16_d64,
            dkdv: flash_bwd_dkdv_bf16_d64,
            dq: flash_bwd_dq_bf16_d64,
            fwd_seg: flash_fwd_seg_bf16_d64,
            dkdv_seg: flash_bwd_dkdv_seg_bf16_d64,
            dq_seg: flash_bwd_dq_seg_bf16_d64,
        },
        (_, 4) => FlashKernels {
            fwd: flash_fwd_bf16_d128_w4,
            dkdv: flash_bwd_dkdv_bf16_d128_w4,
            dq: flash_bwd_dq_bf16_d128_w4,
            fwd_seg: flash_fwd_seg_bf16_d128_w4,
            dkdv_seg: flash_bwd_dkdv_seg_bf16_d128_w4,
            dq_seg: flash_bwd_dq_seg_bf16_d128_w4,
        },
        _ => FlashKernels {
            fwd: flash_fwd_bf16_d128,
            dkdv: flash_bwd_dkdv_bf16_d128,
            dq: flash_bwd_dq_bf16_d128,
            fwd_seg: flash_fwd_seg_bf16_d128,
            dkdv_seg: flash_bwd_dkdv_seg_bf16_d128,
            dq_seg: flash_bwd_dq_seg_bf16_d128,
        },
    }
}

/// The flash kernels copy 16-byte chunks (cp.async): an input whose address is not 16-byte
/// aligned (a view at an odd offset) is copied to a fresh buffer of its layout first; `keep`
/// holds it.
fn aligned_ptr(be: &CudaBackend, op: &str, x: View, layout: HeadLayout, keep: &mut Vec<CudaStorage>) -> Result<DevPtr> {
    let p = dev_ptr(op, x)?;
    if p.addr().is_multiple_of(16) {
        return Ok(p);
    }
    let c = be.contiguous(op, (x.0, &layout.memory_order(x.1)))?;
    let p = c.ptr();
    keep.push(c);
    Ok(p)
}

/// The `seg` pointer the `_seg` flash kernels take where a call has segments or a window (`win`
/// below t): the segment bounds, or null for a window alone; None for plain causal attention,
/// which takes the plain kernels.
fn bounded(seg: Option<DevPtr>, win: i32, a: AttnDims) -> Option<DevPtr> {
    match seg {
        Some(p) => Some(p),
        None if (win as usize) < a.t => Some(DevPtr::NULL),
        None => None,
    }
}

/// One block of `warps` warps per 16 `warps` rows of each of `heads` heads of each batch.
fn flash_grid(a: AttnDims, heads: usize, warps: usize, smem: usize) -> Launch {
    Launch::new((a.t.div_ceil(FLASH_WARP_ROWS * warps) as u32, heads as u32, a.b as u32), 32 * warps as u32).smem(smem)
}

/// Warps in `flash_grid(a, heads, warps, ..)`: the slots of a skipped-tile count.
fn flash_warps_of(a: AttnDims, heads: usize, warps: usize) -> usize {
    a.t.div_ceil(FLASH_WARP_ROWS * warps) * heads * a.b * warps
}

/// `w`: the window, 1..=t (t: full causal).
#[allow(clippy::too_many_arguments)]
pub(super) fn forward(
    be: &CudaBackend,
    q: View,
    k: View,
    v: View,
    a: AttnDims,
    layout: HeadLayout,
    scale: f64,
    segs: Option<&Segments>,
    w: usize,
) -> Result<(Storage, Storage)> {
    let op = "attention";
    let s = CudaStorage::of(op, q.0)?;
    check(op, a)?;
    let o = be.alloc_storage(a.b * a.hq * a.t * a.d, s.dtype())?;
    let lse = be.alloc_storage(a.b * a.hq * a.t, DType::F32)?;
    let (pq, pk, pv) = (s.at(q.1.offset), dev_ptr(op, k)?, dev_ptr(op, v)?);
    let (hq, hkv, t, sc, win) = (a.hq as i32, a.hkv as i32, a.t as i32, scale as f32, w.min(a.t) as i32);
    let seg = segs.map(|sg| seg_ptr(be, op, sg)).transpose()?;
    // SAFETY (every branch): q is (b, hq, t, d), k and v (b, hkv, t, d), dense in `layout`
    // (head-major for SIMT), of one dtype; o holds b * hq * t * d elements of it and lse
    // b * hq * t f32; seg is the (2, b, t) i32 bounds of `segs`. The flash kernels get 16-byte
    // aligned inputs, the shared memory their tiles need (flash_smem) and a count buffer of one
    // i32 per warp of their grid, or null.
    if flash(s.dtype(), a, scale) {
        let mut keep = Vec::new();
        let mut ptr = |x: View| aligned_ptr(be, op, x, layout, &mut keep);
        let (pq, pk, pv) = (ptr(q)?, ptr(k)?, ptr(v)?);
        let nw = flash_warps()?;
        let (ks, cfg, lc) = (flash_kernels(a.d, nw), flash_grid(a, a.hq, nw, flash_smem(a.d, nw).fwd), layout.code());
        // Segments or a window: the `_seg` twin (a null `seg` without segments).
        match bounded(seg.as_ref().map(|s| s.0), win, a) {
            None => unsafe { (ks.fwd)(be, cfg, pq, pk, pv, o.ptr(), lse.ptr(), hq, hkv, t, sc, lc)? },
            Some(ps) => counted(
                be,
                flash_warps_of(a, a.hq, nw),
                |c| &mut c.fwd,
                |n| unsafe { (ks.fwd_seg)(be, cfg, pq, pk, pv, o.ptr(), lse.ptr(), ps, n, hq, hkv, t, sc, lc, win) },
            )?,
        }
    } else {
        head_major(op, layout)?;
        let cfg = Launch::cover(a.b * a.hq * a.t * 32, SIMT_BLOCK);
        let ps = seg.as_ref().map_or(DevPtr::NULL, |s| s.0);
        unsafe {
            kernels::attn_fwd_simt(be, s.dtype(), cfg, pq, pk, pv, o.ptr(), lse.ptr(), ps, a.b as i32, hq, hkv, t, a.d as i32, sc, win)?
        };
    }
    Ok((o.into(), lse.into()))
}

/// `views` are dout, q, k, v, out, lse; `w` the window as in `forward`.
pub(super) fn backward(
    be: &CudaBackend,
    views: [View; 6],
    a: AttnDims,
    layout: HeadLayout,
    scale: f64,
    segs: Option<&Segments>,
    w: usize,
) -> Result<(Storage, Storage, Storage)> {
    let op = "attention_backward";
    let [dout, q, k, v, out, lse] = views;
    let s = CudaStorage::of(op, q.0)?;
    let dt = s.dtype();
    check(op, a)?;
    let (lse, _keep) = f32_ptr(be, op, lse)?;
    let rows = a.b * a.hq * a.t;
    let dvec = be.alloc_storage(rows, DType::F32)?;
    let fl = flash(dt, a, scale);
    if !fl {
        head_major(op, layout)?;
    }
    let mut keep = Vec::new();
    let mut ptr = |x: View| if fl { aligned_ptr(be, op, x, layout, &mut keep) } else { dev_ptr(op, x) };
    let ins = Inputs { q: ptr(q)?, k: ptr(k)?, v: ptr(v)?, dout: ptr(dout)?, lse, dvec: dvec.ptr() };
    let dq = be.alloc_storage(rows * a.d, dt)?;
    let (dk, dv) = (be.alloc_storage(a.b * a.hkv * a.t * a.d, dt)?, be.alloc_storage(a.b * a.hkv * a.t * a.d, dt)?);
    let grads = [dq.ptr(), dk.ptr(), dv.ptr()];
    let seg = segs.map(|sg| seg_ptr(be, op, sg)).transpose()?;
    let ps = seg.as_ref().map(|s| s.0);
    // SAFETY: dout, q and out are (b, hq, t, d), k and v (b, hkv, t, d), dense in `layout`
    // (head-major for SIMT), of dtype dt; lse b * hq * t f32. dvec holds `rows` f32 (D = rowsum(dO * O)), dq rows * d
    // elements of dt, dk and dv b * hkv * t * d; seg (kept alive above) the (2, b, t) bounds.
    unsafe {
        kernels::attn_bwd_dot(
            be,
            dt,
            Launch::cover(rows * 32, DOT_BLOCK),
            ins.dout,
            dev_ptr(op, out)?,
            ins.dvec,
            rows as i64,
            a.d as i32,
            a.t as i32,
            a.hq as i32,
            layout.code(),
        )?;
        let win = w.min(a.t) as i32;
        if fl {
            flash_backward(be, a, &ins, grads, layout, scale as f32, ps, win)?;
        } else {
            simt_backward(be, dt, a, &ins, grads, scale as f32, ps.unwrap_or(DevPtr::NULL), win)?;
        }
    }
    Ok((dq.into(), dk.into(), dv.into()))
}

/// What every backward kernel reads: the inputs, the forward's lse and D = rowsum(dO * O).
struct Inputs {
    q: DevPtr,
    k: DevPtr,
    v: DevPtr,
    dout: DevPtr,
    lse: DevPtr,
    dvec: DevPtr,
}

/// The tensor-core backward: dK/dV per kv head (a block owns 16 `flash_warps()` kv rows and stages
/// FLASH_BWD_TILE_D* query rows of q, dO, lse and D at a time), then dQ per query head; with
/// `seg`, their `_seg` twins; `win` the window, 1..=t.
///
/// # Safety
/// As in `backward`: every pointer addresses the tensor it names, with the sizes of `a`.
#[allow(clippy::too_many_arguments)]
unsafe fn flash_backward(
    be: &CudaBackend,
    a: AttnDims,
    x: &Inputs,
    [dq, dk, dv]: [DevPtr; 3],
    layout: HeadLayout,
    sc: f32,
    seg: Option<DevPtr>,
    win: i32,
) -> Result<()> {
    let (hq, hkv, t, lc) = (a.hq as i32, a.hkv as i32, a.t as i32, layout.code());
    let w = flash_warps()?;
    let (smem, ks) = (flash_smem(a.d, w), flash_kernels(a.d, w));
    let (kv_grid, q_grid) = (flash_grid(a, a.hkv, w, smem.dkdv), flash_grid(a, a.hq, w, smem.dq));
    // SAFETY: the caller's contract; each kernel gets the shared memory its tiles take and a
    // count buffer of one i32 per warp of its grid, or null.
    unsafe {
        let Some(ps) = bounded(seg, win, a) else {
            (ks.dkdv)(be, kv_grid, x.q, x.k, x.v, x.dout, x.lse, x.dvec, dk, dv, hq, hkv, t, sc, lc)?;
            return (ks.dq)(be, q_grid, x.q, x.k, x.v, x.dout, x.lse, x.dvec, dq, hq, hkv, t, sc, lc);
        };
        counted(
            be,
            flash_warps_of(a, a.hkv, w),
            |c| &mut c.dkdv,
            |n| (ks.dkdv_seg)(be, kv_grid, x.q, x.k, x.v, x.dout, x.lse, x.dvec, dk, dv, ps, n, hq, hkv, t, sc, lc, win),
        )?;
        counted(
            be,
            flash_warps_of(a, a.hq, w),
            |c| &mut c.dq,
            |n| (ks.dq_seg)(be, q_grid, x.q, x.k, x.v, x.dout, x.lse, x.dvec, dq, ps, n, hq, hkv, t, sc, lc, win),
        )
    }
}

/// The SIMT backward: a warp per kv row (dK, dV), then a warp per query row (dQ); `seg` the
/// segment bounds or null, `win` the window, 1..=t.
///
/// # Safety
/// As in `backward`: every pointer addresses the tensor it names, with the sizes of `a`.
#[allow(clippy::too_many_arguments)]
unsafe fn simt_backward(
    be: &CudaBackend,
    dt: DType,
    a: AttnDims,
    x: &Inputs,
    [dq, dk, dv]: [DevPtr; 3],
    sc: f32,
    seg: DevPtr,
    win: i32,
) -> Result<()> {
    let (b, hq, hkv, t, d) = (a.b as i32, a.hq as i32, a.hkv as i32, a.t as i32, a.d as i32);
    let kv_rows = Launch::cover(a.b * a.hkv * a.t * 32, SIMT_BLOCK);
    let q_rows = Launch::cover(a.b * a.hq * a.t * 32, SIMT_BLOCK);
    // SAFETY: the caller's contract.
    unsafe {
        kernels::attn_bwd_dkdv_simt(be, dt, kv_rows, x.q, x.k, x.v, x.dout, x.lse, x.dvec, dk, dv, seg, b, hq, hkv, t, d, sc, win)?;
        kernels::attn_bwd_dq_simt(be, dt, q_rows, x.q, x.k, x.v, x.dout, x.lse, x.dvec, dq, seg, b, hq, hkv, t, d, sc, win)
    }
}
