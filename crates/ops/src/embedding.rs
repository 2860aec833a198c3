//! Token embedding: rows of a weight (vocab, d) picked by i32 ids of any shape -> (ids.., d).
//! The backward scatter-adds the gradient's rows into a (vocab, d) gradient in token order on
//! every device (no float atomics on CUDA), so repeated ids sum deterministically. Ids outside
//! the vocabulary are an error, not a read out of bounds: checked on the host when the ids
//! carry their host copy (`Tokens::upload`, no device read), else on the device.
//! CUDA: kernels/embedding.cu (the backward accumulates in f32 and casts once).
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
    let (ids, vocab) = (ids.clone(), w.dims()[0]);
    let backward_fn = move |g: &Tensor| {
        let g = g.contiguous()?;
        let st = Tensor::with_storages(&[&g, &ids], |s| backward(s[0], s[1], vocab))?;
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

/// dy (n, d) contiguous, ids (n) -> the (vocab, d) gradient of the weight.
pub fn backward(dy: View, ids: View, vocab: usize) -> Result<Storage> {
    match on("embedding", dy.0)? {
        On::Cpu => cpu::backward(dy, ids, vocab),
        On::Cuda(be) => cuda::backward(&be, dy, ids, vocab),
    }
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
    use ferrolm_tensor::{DeviceStorage, Layout, Shape};

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
}
