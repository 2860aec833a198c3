//! Token embedding: rows of a weight (vocab, d) picked by i32 ids of any shape -> (ids.., d).
//! The backward scatter-adds the gradient's rows into a (vocab, d) gradient in token order on
//! every device (no float atomics on CUDA), so repeated ids sum deterministically. Ids outside
//! the vocabulary are an error, not a read out of bounds: checked on the host when the ids
//! carry their host copy (`Tokens::upload`, no device read), else on the device.
//! CUDA: kernels/embedding.cu. With a host copy the backward sorts positions by id on the host
//! and sums each id's segment (`backward_sorted`: each gradient element read once, each weight
//! gradient element written once); a bare id tensor keeps the scan of every id per vocab block
//! (`backward`). Both accumulate in f32 and round once.
use crate::dispatch::{on, On};
use crate::tokens::Tokens;
use ferrolm_tensor::backend::View;
use ferrolm_tensor::{bail, same_device, DType, Result, Storage, Tensor};

/// Rows of `weight` (vocab, d) picked by i32 `ids` of any shape -> (ids.., d). The ids are
/// checked on the device (a host wait on a GPU); `embedding_tokens` checks a host copy instead.
pub fn embedding(ids: &Tensor, weight: &Tensor) -> Result<Tensor> {
    embedding_tokens(&Tokens::device(ids), weight)
}

/// `embedding` of `ids`, checked on the host when they carry their host copy.
pub fn embedding_tokens(tokens: &Tokens, weight: &Tensor) -> Result<Tensor> {
    let ids = tokens.tensor();
    same_device("embedding", &[ids, weight])?;
    if ids.dtype() != DType::I32 {
        bail!("embedding", "ids must be i32, got {}", ids.dtype());
    }
    if weight.rank() != 2 || !weight.dtype().is_float() {
        bail!("embedding", "weight must be a float (vocab, dim) matrix, got {:?} {}", weight.shape(), weight.dtype());
    }
    let w = weight.contiguous()?;
    tokens.check_ids(w.dims()[0])?;
    let device_check = tokens.host().is_none();
    let st = Tensor::with_storages(&[&w, ids], |s| forward_with(s[0], s[1], device_check))?;
    let out = Tensor::new(st, [ids.dims(), &[w.dims()[1]]].concat())?;
    let (tokens, vocab) = (tokens.clone(), w.dims()[0]);
    let backward_fn = move |g: &Tensor| {
        let g = g.contiguous()?;
        let st = Tensor::with_storages(&[&g, tokens.tensor()], |s| match tokens.host() {
            Some(h) => backward_sorted(s[0], h, vocab),
            None => backward(s[0], s[1], vocab),
        })?;
        Ok(vec![Some(Tensor::new(st, [vocab, g.dims()[g.rank() - 1]])?)])
    };
    Ok(Tensor::from_op(out, "embedding", &[weight], Box::new(backward_fn)))
}

/// w (vocab, d) contiguous, ids i32 of any layout -> (n ids, d).
pub fn forward(w: View, ids: View) -> Result<Storage> {
    forward_with(w, ids, true)
}

/// `forward`; `device_check` false when the caller has checked the ids' range (CUDA then skips
/// the check and its host wait; the CPU checks anyway, at no cost in waits).
fn forward_with(w: View, ids: View, device_check: bool) -> Result<Storage> {
    match on("embedding", w.0)? {
        On::Cpu => cpu::forward(w, ids),
        On::Cuda(be) => cuda::forward(&be, w, ids, device_check),
    }
}

/// dy (n, d) contiguous, ids (n) on dy's device -> the (vocab, d) gradient of the weight. On
/// CUDA this is the path for ids without a host copy: every block scans all n ids
/// (`backward_sorted` is the fast one).
pub fn backward(dy: View, ids: View, vocab: usize) -> Result<Storage> {
    match on("embedding", dy.0)? {
        On::Cpu => cpu::backward(dy, ids, vocab),
        On::Cuda(be) => cuda::backward(&be, dy, ids, vocab),
    }
}

/// `backward` with the ids on the host (`ids` row-major, n of them, each checked to lie in
/// [0, vocab)). On CUDA the positions are sorted by id here and uploaded with the segment
/// starts in one copy (no host wait); the kernel sums each id's rows in token order.
pub fn backward_sorted(dy: View, ids: &[i32], vocab: usize) -> Result<Storage> {
    crate::tokens::check_ids(ids, vocab)?;
    let d = *dy.1.dims().last().unwrap_or(&1);
    if dy.1.numel() != ids.len() * d {
        bail!("embedding_backward", "a gradient of shape {:?} for {} ids", dy.1.dims(), ids.len());
    }
    match on("embedding", dy.0)? {
        On::Cpu => cpu::backward_host(dy, ids, vocab),
        On::Cuda(be) => cuda::backward_sorted(&be, dy, ids, vocab),
    }
}

/// The sort of `backward_sorted`: [start (vocab + 1) | perm (n)], where perm[start[v]..start[v+1]]
/// are the positions of id v in ascending order (a stable counting sort, O(n + vocab)). Ids
/// must lie in [0, vocab) and n in i32.
fn sort_plan(ids: &[i32], vocab: usize) -> Vec<i32> {
    let mut plan = vec![0i32; vocab + 1 + ids.len()];
    for &i in ids {
        plan[i as usize + 1] += 1;
    }
    for v in 0..vocab {
        plan[v + 1] += plan[v];
    }
    let mut next = plan[..vocab].to_vec();
    let (_, perm) = plan.split_at_mut(vocab + 1);
    for (p, &i) in ids.iter().enumerate() {
        let slot = &mut next[i as usize];
        perm[*slot as usize] = p as i32;
        *slot += 1;
    }
    plan
}

mod cpu {
    //! The reference: row copies, and a sequential scatter-add in token order.
    use super::*;
    use ferrolm_tensor::cpu::{gather, i32s};
    use ferrolm_tensor::float_dispatch;
    use num_traits::Float;

    pub(super) fn forward(w: View, ids: View) -> Result<Storage> {
        let d = w.1.dims()[1];
        let idv = gather(i32s("embedding", ids.0)?, ids.1);
        crate::tokens::check_ids(&idv, w.1.dims()[0])?;
        let off = w.1.offset;
        Ok(float_dispatch!("embedding", w.0.dtype(), [w], embedding(&w[off..], d, &idv)))
    }

    pub(super) fn backward(dy: View, ids: View, vocab: usize) -> Result<Storage> {
        let idv = gather(i32s("embedding_backward", ids.0)?, ids.1);
        let d = *dy.1.dims().last().unwrap_or(&1);
        let off = dy.1.offset;
        Ok(float_dispatch!("embedding_backward", dy.0.dtype(), [dy], embedding_backward(&dy[off..], d, &idv, vocab)))
    }

    pub(super) fn backward_host(dy: View, ids: &[i32], vocab: usize) -> Result<Storage> {
        let d = *dy.1.dims().last().unwrap_or(&1);
        let off = dy.1.offset;
        Ok(float_dispatch!("embedding_backward", dy.0.dtype(), [dy], embedding_backward(&dy[off..], d, ids, vocab)))
    }

    /// w: (vocab, d), ids: (n) -> (n, d)
    fn embedding<T: Float>(w: &[T], d: usize, ids: &[i32]) -> Vec<T> {
        let mut out = Vec::with_capacity(ids.len() * d);
        for &i in ids {
            out.extend_from_slice(&w[i as usize * d..(i as usize + 1) * d]);
        }
        out
    }

    /// dy: (n, d) -> dw: (vocab, d), rows added in token order.
    fn embedding_backward<T: Float>(dy: &[T], d: usize, ids: &[i32], vocab: usize) -> Vec<T> {
        let mut dw = vec![T::zero(); vocab * d];
        for (r, &i) in ids.iter().enumerate() {
            let dst = &mut dw[i as usize * d..(i as usize + 1) * d];
            for (a, &b) in dst.iter_mut().zip(&dy[r * d..(r + 1) * d]) {
                *a = *a + b;
            }
        }
        dw
    }
}

mod cuda {
    //! Launchers of kernels/embedding.cu.
    use super::*;
    use ferrolm_cuda::{consts, kernels, CudaBackend, CudaStorage, Launch};
    use ferrolm_tensor::backend::Backend;
    use ferrolm_tensor::{CpuStorage, DeviceStorage, Layout, Shape};

    /// The threads of the forward's row copy.
    const COPY_BLOCK: u32 = 128;

    pub(super) fn forward(be: &CudaBackend, w: View, ids: View, check: bool) -> Result<Storage> {
        let sw = CudaStorage::of("embedding", w.0)?;
        let (vocab, d) = (w.1.dims()[0], w.1.dims()[1]);
        let ids = be.contiguous("embedding", ids)?;
        let n = ids.len();
        if check {
            let bad = be.alloc_zeroed(1, DType::I32)?;
            // SAFETY: `ids` holds n i32, `bad` one.
            unsafe { kernels::ids_check(be, Launch::cover(n, Launch::BLOCK), ids.ptr(), n as i64, vocab as i64, bad.ptr())? };
            if be.read_i32(&bad, 0)? != 0 {
                bail!("embedding", "a token id is out of range for a vocabulary of {vocab}");
            }
        }
        let out = be.alloc_storage(n * d, sw.dtype())?;
        // SAFETY: every id is in [0, vocab) (checked above, or on the host by the caller), w is
        // (vocab, d) contiguous from its offset, `out` holds n * d elements of w's dtype.
        unsafe {
            kernels::embedding_fwd(
                be,
                sw.dtype(),
                Launch::per_row(n, COPY_BLOCK),
                sw.at(w.1.offset),
                ids.ptr(),
                out.ptr(),
                n as i64,
                d as i64,
            )?
        };
        Ok(out.into())
    }

    pub(super) fn backward(be: &CudaBackend, dy: View, ids: View, vocab: usize) -> Result<Storage> {
        let s = CudaStorage::of("embedding_backward", dy.0)?;
        let d = *dy.1.dims().last().unwrap_or(&1);
        let ids = be.contiguous("embedding_backward", ids)?;
        let n = ids.len();
        let acc = be.alloc_zeroed(vocab * d, DType::F32)?;
        let grid = (vocab.div_ceil(consts::EMB_ROWS).max(1) as u32, d.div_ceil(consts::EMB_COLS).max(1) as u32, 1);
        let cfg = Launch::new(grid, consts::EMB_COLS as u32);
        // SAFETY: dy is (n, d) contiguous from its offset, `ids` n i32 in [0, vocab) (the forward
        // checked them), `acc` (vocab, d) f32.
        unsafe { kernels::embedding_bwd(be, s.dtype(), cfg, s.at(dy.1.offset), ids.ptr(), acc.ptr(), n as i64, d as i64, vocab as i64)? };
        if s.dtype() == DType::F32 {
            return Ok(acc.into());
        }
        let acc: Storage = acc.into();
        Ok(be.to_dtype((&acc, &Layout::contiguous(Shape(vec![vocab * d]))), s.dtype())?.into())
    }

    pub(super) fn backward_sorted(be: &CudaBackend, dy: View, ids: &[i32], vocab: usize) -> Result<Storage> {
        let s = CudaStorage::of("embedding_backward", dy.0)?;
        let (dt, n) = (s.dtype(), ids.len());
        let d = *dy.1.dims().last().unwrap_or(&1);
        if n > i32::MAX as usize || vocab + 1 + n > i32::MAX as usize {
            bail!("embedding_backward", "{n} ids over a vocabulary of {vocab} do not fit the kernel's i32 plan");
        }
        let plan = be.from_cpu(&CpuStorage::I32(super::sort_plan(ids, vocab)))?;
        let plan = CudaStorage::of("embedding_backward", &plan)?;
        let dw = be.alloc_storage(vocab * d, dt)?;
        // Each thread moves 16 bytes (w elements) per row; a block's tile is threads * w columns.
        let w = 16 / dt.size_in_bytes();
        let threads = d.div_ceil(w).next_multiple_of(32).clamp(32, consts::EMB_SORT_THREADS);
        let src = s.at(dy.1.offset);
        let vec = d.is_multiple_of(w) && src.addr().is_multiple_of(16) && dw.ptr().addr().is_multiple_of(16);
        if vocab > i32::MAX as usize || d.div_ceil(threads * w) > 65535 {
            bail!("embedding_backward", "a ({vocab}, {d}) gradient exceeds the kernel's grid");
        }
        let grid = (vocab as u32, d.div_ceil(threads * w) as u32, 1);
        // SAFETY: dy is (n, d) contiguous from its offset (`src`), `plan` holds vocab + 1 segment
        // starts and a permutation of 0..n (every start <= n, the ids checked in [0, vocab) by
        // the caller), `dw` (vocab, d) of dy's dtype; with `vec` both are 16-byte aligned and
        // d % w == 0.
        unsafe {
            kernels::embedding_bwd_sorted(
                be,
                dt,
                Launch::new(grid, threads as u32),
                src,
                plan.ptr(),
                dw.ptr(),
                d as i64,
                vocab as i64,
                vec as i32,
            )?
        };
        Ok(dw.into())
    }
}
