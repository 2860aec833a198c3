//! The LM head and its cross-entropy, fused and chunked so that the (N, V) logits never exist
//! whole: loss = scale · Σ over trained rows of (lse(l) − l[target]) with l = x W^T, for hidden
//! states x (N, C), the head weight W (V, C) (tied to the embedding or not) and i32 targets (N),
//! rows whose target is `ignore_index` not trained. The rows are walked in chunks; for each, in
//! one buffer of (chunk, V):
//! - the logits GEMM, L = x_c W^T;
//! - the log-sum-exp and the row losses, then dlogits = (softmax − onehot) · scale written over L
//!   in place (the scale is the step's: `LossScale`);
//! - dX_c = dlogits W, a GEMM into the chunk's rows of x's gradient;
//! - dW += dlogits^T x_c, a GEMM accumulated in f32 (beta 1) straight into W's gradient
//!   destination, its slice of an f32 gradient bucket, asked for in the forward
//!   (`Tensor::grad_dest`); an f32 buffer of its own where there is none.
//!
//! So a step holds one chunk of logits (two under tensor parallelism, below), and reads and
//! writes their bytes once, where the unfused head keeps the whole logits and their gradient.
//!
//! The gradients are made in the forward, where the logits exist: the backward only hands the
//! saved dX and dW over (scaled by the output gradient, unless that is the seed 1 of
//! `backward()`, `GradCtx::grad_is_one`: the trainer passes the step's scale in and backpropagates
//! the loss itself). Recomputing them in backward would cost a fourth GEMM, a third more FLOPs.
//! Under activation checkpointing (`recompute`) the forward, and so this work, runs again in
//! backward: correct, and not done here (checkpointing wraps the blocks' branches, not the head).
//! Without grad (eval) a chunk is only its logits GEMM and its loss. A chunk whose targets are
//! all ignored is skipped (its dX rows are 0). The chunk size defaults to the largest whose
//! logits fit `CHUNK_BUDGET_BYTES` (`LossChunks::Auto`).
//!
//! On the CPU the loss and dX are bitwise those of the unfused head (`linear`, then
//! `cross_entropy`) for f32 and f64: the same row kernels (the lse in the same 16 lanes, the
//! gradient the same products), the loss summed in f64 in row order, and each row of dX one GEMM
//! over V as before. dW is a sum over the tokens: bitwise too when every chunk is a multiple of
//! the CPU GEMM's 256-row depth slice (the automatic size is) and so is the token count (the
//! unfused GEMM then sums the same slices in the same order), else equal to rounding. bf16
//! rounds where the unfused path does not (the gradient of the chunk, each chunk's dW): to
//! rounding. On CUDA the GEMMs are cuBLASLt's (`CudaBackend::gemm_into`) and the rows
//! kernels/cross_entropy.cu's `ce_fused` (the gradient in place) or `ce_fwd`: to rounding. The
//! row losses are summed in f64 per fixed block of rows, then the blocks' sums in order
//! (`hl_loss_partial`, `hl_finish`): the same bits run to run.
//!
//! Tensor parallelism (`head_loss_sharded`, `VocabShards`): each rank holds W's rows of its
//! part of the vocabulary and computes its chunk's logits over them; the row max, then the sum of
//! exponentials with the target logit, are all-reduced per chunk, and the logits are never
//! gathered. On CUDA (kernels/head_loss.cu) a rank reads its chunk once for each row's local max
//! and sum of exponentials (online) and target logit, all-reduces the max, rescales its sums to
//! the global max, all-reduces them, then reads and writes the chunk once more for the gradient:
//! the chunk is read twice, as on one device. The max's all-reduce is launched before the next
//! chunk's GEMM and read after it, so it overlaps that GEMM (two chunks are held then).
//! dX is this rank's part, which the caller's Megatron `f` all-reduces in backward.
use crate::dispatch::{on, On};
use crate::tokens::Tokens;
use ferrolm_tensor::autograd::GradCtx;
use ferrolm_tensor::backend::View;
use ferrolm_tensor::{bail, is_grad_enabled, no_grad, same_device, same_float, DType, Device, Layout, Result, Shape, Storage, Tensor};
use std::sync::Mutex;

/// How a batch's per-token cross-entropies make its loss.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LossScale {
    /// Their mean over the batch's trained tokens (targets not ignored); 0 when there is none.
    Mean,
    /// Their sum over the trained tokens times this factor: the optimizer step's
    /// 1 / (trained tokens of every micro-batch and data-parallel rank).
    Sum(f64),
}

/// How the head walks the tokens (`--loss-chunk-tokens`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LossChunks {
    /// The largest chunk whose logits fit `CHUNK_BUDGET_BYTES` (`auto_chunk_tokens`).
    #[default]
    Auto,
    /// Chunks of this many tokens (at least 1).
    Tokens(usize),
    /// The whole logits, then the cross-entropy: no fusion (`--loss-chunk-tokens 0`).
    Unfused,
}

/// The bytes of logits a chunk may hold by default (`LossChunks::Auto`).
pub const CHUNK_BUDGET_BYTES: usize = 256 << 20;

impl LossChunks {
    /// `--loss-chunk-tokens N`: 0 is `Unfused`, N > 0 `Tokens(N)`; no flag, `Auto`.
    pub fn from_flag(n: Option<usize>) -> LossChunks {
        match n {
            None => LossChunks::Auto,
            Some(0) => LossChunks::Unfused,
            Some(n) => LossChunks::Tokens(n),
        }
    }

    /// Tokens per chunk for a batch of `tokens` against `vocab` logits a token (this rank's) of
    /// `elem_bytes` each; `None` when unfused.
    pub fn chunk_tokens(self, tokens: usize, vocab: usize, elem_bytes: usize) -> Option<usize> {
        match self {
            LossChunks::Unfused => None,
            LossChunks::Tokens(n) => Some(n.clamp(1, tokens.max(1))),
            LossChunks::Auto => Some(auto_chunk_tokens(vocab, elem_bytes).min(tokens.max(1))),
        }
    }
}

/// The most tokens whose logits (`vocab` a token, `elem_bytes` each) fit `CHUNK_BUDGET_BYTES`:
/// a multiple of 256 when there are that many (the CPU GEMM's depth slice, so that dW is
/// bitwise the unfused one there; a GPU GEMM likes the round number too), at least 1.
pub fn auto_chunk_tokens(vocab: usize, elem_bytes: usize) -> usize {
    let n = CHUNK_BUDGET_BYTES / vocab.max(1).saturating_mul(elem_bytes.max(1));
    if n >= 256 {
        n / 256 * 256
    } else {
        n.max(1)
    }
}

/// What the fused head needs besides its tensors.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HeadLossOptions {
    /// The target value of rows that are not trained (transformers' -100).
    pub ignore_index: i32,
    pub scale: LossScale,
    /// Tokens per chunk (at least 1; `LossChunks::chunk_tokens` gives it).
    pub chunk_tokens: usize,
}

/// The head's vocabulary split over tensor-parallel ranks: this rank holds W's rows
/// `start()..start() + W's rows` of `vocab()`. The per-chunk statistics are summed (or maxed)
/// over the ranks by these; a result may come back pending (read where first used).
pub trait VocabShards: Send + Sync {
    fn start(&self) -> usize;
    fn vocab(&self) -> usize;
    /// The element-wise max over the ranks.
    fn all_reduce_max(&self, x: &Tensor) -> Result<Tensor>;
    /// The element-wise sum over the ranks.
    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor>;
}

/// The loss (a scalar: f32, f64 for f64 inputs) of the head W (V, C) on hidden states x
/// (..., C) against i32 targets with one per row of x, fused and chunked (module comment).
/// Targets with a host copy are checked and counted there; others are read back once.
pub fn head_loss(x: &Tensor, w: &Tensor, targets: &Tokens, o: &HeadLossOptions) -> Result<Tensor> {
    fused(x, w, targets, o, None)
}

/// `head_loss` with W this rank's rows of a vocabulary split over tensor-parallel ranks; the
/// gradient of x is this rank's part (the caller all-reduces it).
pub fn head_loss_sharded(x: &Tensor, w: &Tensor, targets: &Tokens, o: &HeadLossOptions, shards: &dyn VocabShards) -> Result<Tensor> {
    fused(x, w, targets, o, Some(shards))
}

/// A chunk of rows: the first, how many, and whether any of their targets is trained.
#[derive(Clone, Copy, Debug)]
struct Chunk {
    first: usize,
    rows: usize,
    trained: bool,
}

/// What a device's loop needs to know of the call.
struct Plan<'a> {
    /// Rows, hidden size, this rank's vocabulary rows and the first of them.
    n: usize,
    c: usize,
    v: usize,
    start: usize,
    chunks: Vec<Chunk>,
    ignore: i32,
    /// The gradient's factor: the loss scale for a loss gradient of 1.
    scale: f64,
    dx: bool,
    dw: bool,
    shards: Option<&'a dyn VocabShards>,
}

impl Plan<'_> {
    fn chunk_max(&self) -> usize {
        self.chunks.iter().filter(|c| c.trained).map(|c| c.rows).max().unwrap_or(0)
    }
    fn any_trained(&self) -> bool {
        self.chunks.iter().any(|c| c.trained)
    }
}

/// What a device's loop returns: the sum of the row losses (f64, unscaled) on the CPU or the
/// scaled loss on a device, and on the CPU the gradients it made (a device writes them into the
/// buffers it was given).
struct Made {
    loss: Storage,
    dx: Option<Storage>,
    dw: Option<Storage>,
}

fn fused(x: &Tensor, w: &Tensor, targets: &Tokens, o: &HeadLossOptions, shards: Option<&dyn VocabShards>) -> Result<Tensor> {
    let op = "head_loss";
    same_float(op, &[x, w])?;
    same_device(op, &[x, targets.tensor()])?;
    let r = x.rank();
    if w.rank() != 2 || r == 0 || x.dim(r - 1) != w.dim(1) || w.dims().contains(&0) {
        bail!(op, "expects x (..., hidden) and a head (vocab, hidden), got {:?} and {:?}", x.shape(), w.shape());
    }
    let (v, c) = (w.dim(0), w.dim(1));
    let n = x.numel() / c;
    let tg = targets.tensor();
    if tg.dtype() != DType::I32 || tg.numel() != n {
        bail!(op, "targets must be i32 with one per row of x ({n}), got {:?} {}", tg.shape(), tg.dtype());
    }
    if o.chunk_tokens == 0 {
        bail!(op, "chunks must hold at least one token (an unfused head is the caller's)");
    }
    let (start, vocab) = shards.map_or((0, v), |s| (s.start(), s.vocab()));
    if start + v > vocab {
        bail!(op, "this rank's vocabulary rows {start}..{} lie outside the vocabulary of {vocab}", start + v);
    }
    let host = targets.host_ids()?;
    let count = crate::tokens::count_targets(&host, vocab, o.ignore_index)?;
    let scale = match o.scale {
        LossScale::Mean => 1.0 / count.max(1) as f64,
        LossScale::Sum(s) => s,
    };
    if !scale.is_finite() {
        bail!(op, "the loss scale {scale} is not finite");
    }
    let grad = is_grad_enabled();
    let chunks = (0..n)
        .step_by(o.chunk_tokens)
        .map(|first| {
            let rows = o.chunk_tokens.min(n - first);
            Chunk { first, rows, trained: host[first..first + rows].iter().any(|&t| t != o.ignore_index) }
        })
        .collect();
    let plan = Plan {
        n,
        c,
        v,
        start,
        chunks,
        ignore: o.ignore_index,
        scale,
        dx: grad && x.requires_grad(),
        dw: grad && w.requires_grad(),
        shards,
    };
    let guard = no_grad();
    let x2 = x.contiguous()?.reshape([n, c])?;
    let w2 = w.contiguous()?;
    let dev = x.device();
    // Where dW accumulates: W's gradient destination when it is f32, else an f32 buffer of its
    // own (on the CPU the loop keeps its own and copies it over at the end).
    let dest = if plan.dw && plan.any_trained() { w.grad_dest()? } else { None };
    let (made, dx, dw) = if dev == Device::Cpu {
        (Tensor::with_storages(&[&x2, &w2], |s| cpu::run(s[0], s[1], &host, &plan))?, None, None)
    } else {
        // Rows of skipped chunks are never written: then the buffer starts zeroed.
        let skipped = plan.chunks.iter().any(|c| !c.trained);
        let dx = match (plan.dx, skipped) {
            (false, _) => None,
            (true, true) => Some(Tensor::zeros([n, c], x.dtype(), dev)?),
            (true, false) => Some(Tensor::empty([n, c], x.dtype(), dev)?),
        };
        let dw = match &dest {
            _ if !(plan.dw && plan.any_trained()) => None,
            Some(d) if d.dtype() == DType::F32 => Some(d.clone()),
            _ => Some(Tensor::empty([v, c], DType::F32, dev)?),
        };
        let t = tg.contiguous()?.reshape([n])?;
        let mut ins = vec![&x2, &w2, &t];
        ins.extend(dx.iter().chain(dw.iter()));
        let made = Tensor::with_storages(&ins, |s| {
            let (dxv, dwv) = (dx.as_ref().map(|_| s[3]), dw.as_ref().map(|_| s[3 + dx.is_some() as usize]));
            match on(op, s[0].0)? {
                On::Cuda(be) => cuda::run(&be, s[0], s[1], s[2], dxv, dwv, &plan),
                On::Cpu => bail!(op, "CPU storage on {dev}"),
            }
        })?;
        (made, dx, dw)
    };
    let loss = Tensor::new(made.loss, ())?;
    if !(plan.dx || plan.dw) {
        return Ok(loss);
    }
    let dx = match (dx, made.dx) {
        (Some(d), _) => Some(d),
        (None, Some(s)) => Some(Tensor::new(s, [n, c])?),
        (None, None) => None,
    };
    // dW lands in the destination whatever the dtype (its own buffer cast on the way), or is
    // handed over in W's dtype.
    let dw = match (dw.or(made.dw.map(|s| Tensor::new(s, [v, c])).transpose()?), dest) {
        (Some(d), Some(t)) if !d.same_view(&t) => {
            t.assign(&d)?;
            Some(t)
        }
        (Some(d), Some(_)) => Some(d),
        (Some(d), None) => Some(d.to_dtype(w.dtype())?),
        (None, _) => None,
    };
    drop(guard); // the op below is recorded
    let saved = Mutex::new(Some((dx, dw)));
    let xshape = x.shape().clone();
    let backward = move |g: &Tensor, ctx: &mut GradCtx| {
        let Some((dx, dw)) = saved.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            bail!(op, "backward ran twice through one fused head + loss: compute the loss again");
        };
        let factor = if ctx.grad_is_one() { None } else { Some(g) };
        let gx = match dx {
            Some(d) => {
                let d = times(d.reshape(xshape.clone())?, factor)?;
                Some(match ctx.take_partial(0)? {
                    Some(p) => p.add(&d)?, // the engine's order: what arrived first, then this
                    None => d,
                })
            }
            None => None,
        };
        // A scaled dW is a new tensor: a sink copies it over the destination's unscaled one.
        let gw = dw.map(|d| times(d, factor)).transpose()?;
        Ok(vec![gx, gw])
    };
    Ok(Tensor::from_op_ctx(loss, op, &[x, w], Box::new(backward)))
}

/// `t` times the output gradient `g` (a one-element tensor), unless there is none to apply or
/// it is 1 (read on the host only where that costs no wait: the CPU).
fn times(t: Tensor, g: Option<&Tensor>) -> Result<Tensor> {
    let Some(g) = g else { return Ok(t) };
    if g.device() == Device::Cpu {
        return match g.item()? {
            1.0 => Ok(t),
            f => t.mul_scalar(f),
        };
    }
    t.mul(&g.to_dtype(t.dtype())?.reshape(vec![1; t.rank()])?)
}

/// A dense (rows, cols) view at element `offset` with row stride `ld`; `t` swaps it to the
/// transposed view (cols, rows) of the same elements.
fn view(rows: usize, cols: usize, ld: usize, offset: usize, t: bool) -> Layout {
    match t {
        false => Layout { shape: Shape(vec![rows, cols]), strides: vec![ld, 1], offset },
        true => Layout { shape: Shape(vec![cols, rows]), strides: vec![1, ld], offset },
    }
}

mod cpu {
    //! The reference: the chunk's GEMMs through the CPU backend (multi-threaded), its rows in
    //! parallel with the cross-entropy's row kernels, the loss summed in f64 in row order.
    use super::*;
    use ferrolm_tensor::backend::Backend;
    use ferrolm_tensor::cpu::simd::{self, FastExp};
    use ferrolm_tensor::cpu::Finish;
    use ferrolm_tensor::{multiversion, CountedBytes, CpuStorage};
    use rayon::prelude::*;
    use std::sync::Arc;

    /// The loop's vectors live outside tensor storage: counted, so measured peaks see them.
    fn counted<T>(v: &[T]) -> CountedBytes {
        CountedBytes::new(std::mem::size_of_val(v))
    }

    /// The working precision of a dtype: f32 for f32 and bf16 (widened), f64 for f64.
    pub(super) trait Work: FastExp + Send + Sync + 'static {
        /// The elements of a CPU storage in this precision (moved out when already so).
        fn take(s: Storage) -> Result<Vec<Self>>;
        /// Back to storage of `dt` (bf16 rounded once).
        fn store(v: Vec<Self>, dt: DType) -> Storage;
    }
    impl Work for f32 {
        fn take(s: Storage) -> Result<Vec<f32>> {
            match s {
                Storage::Cpu(CpuStorage::F32(v)) => Ok(v),
                Storage::Cpu(CpuStorage::BF16(v)) => Ok(v.iter().map(|x| x.to_f32()).collect()),
                other => bail!("head_loss", "expected f32 or bf16 CPU storage, got {:?}", other.dtype()),
            }
        }
        fn store(v: Vec<f32>, dt: DType) -> Storage {
            v.finish(dt)
        }
    }
    impl Work for f64 {
        fn take(s: Storage) -> Result<Vec<f64>> {
            match s {
                Storage::Cpu(CpuStorage::F64(v)) => Ok(v),
                other => bail!("head_loss", "expected f64 CPU storage, got {:?}", other.dtype()),
            }
        }
        fn store(v: Vec<f64>, _: DType) -> Storage {
            v.finish(DType::F64)
        }
    }

    pub(super) fn run(x: View, w: View, t: &[i32], p: &Plan) -> Result<Made> {
        let be = ferrolm_tensor::backend::get("head_loss", Device::Cpu)?;
        match x.0.dtype() {
            DType::F64 => Loop::<f64>::new(be, x, w, t, p).run(),
            _ => Loop::<f32>::new(be, x, w, t, p).run(),
        }
    }

    multiversion! {
        /// One row of the fused form in place: x = exp(x − max), summed in `row_lse`'s lanes (so
        /// the lse is bit for bit the unfused forward's), then x = x · (sc / sum), x[target] −= sc
        /// (`cross_entropy`'s `row_lse_grad`). -> the lse.
        fn row_grad[T: FastExp](x: &mut [T], target: usize, sc: T) -> T {
            let m = simd::max(x);
            let l = simd::map_in_place_sum(x, |v| (v - m).fast_exp());
            let f = sc / l;
            x.iter_mut().for_each(|p| *p = *p * f);
            x[target] = x[target] - sc;
            m + l.ln()
        }
    }

    multiversion! {
        /// log-sum-exp of a row (`cross_entropy`'s `row_lse`).
        fn row_lse[T: FastExp](row: &[T]) -> T {
            let m = simd::max(row);
            m + simd::sum_map(row, |x| (x - m).fast_exp()).ln()
        }
    }

    multiversion! {
        /// Under tensor parallelism: the sum of exp(x − m) over this rank's columns.
        fn row_sumexp[T: FastExp](row: &[T], m: T) -> T {
            simd::sum_map(row, |x| (x - m).fast_exp())
        }
    }

    multiversion! {
        /// Under tensor parallelism: x = exp(x − lse) · sc in place.
        fn row_softmax[T: FastExp](x: &mut [T], lse: T, sc: T) {
            for p in x.iter_mut() {
                *p = (*p - lse).fast_exp() * sc;
            }
        }
    }

    /// The loop over the chunks of one call, in working precision `T`.
    struct Loop<'a, T: Work> {
        be: Arc<dyn Backend>,
        x: View<'a>,
        w: View<'a>,
        t: &'a [i32],
        p: &'a Plan<'a>,
        sc: T,
        dt: DType,
        /// The row losses' sum, in row order.
        sum: f64,
        dx: Option<(Vec<T>, CountedBytes)>,
        dw: Option<(Vec<T>, CountedBytes)>,
    }

    /// A chunk of logits whose max is being all-reduced (tensor parallelism).
    struct Pending<T> {
        chunk: Chunk,
        l: (Vec<T>, CountedBytes),
        max: Tensor,
        tgt: Vec<T>,
    }

    impl<'a, T: Work> Loop<'a, T> {
        fn new(be: Arc<dyn Backend>, x: View<'a>, w: View<'a>, t: &'a [i32], p: &'a Plan<'a>) -> Self {
            Loop {
                be,
                x,
                w,
                t,
                p,
                sc: num_traits::cast(p.scale).unwrap_or_else(T::nan),
                dt: x.0.dtype(),
                sum: 0.0,
                dx: p.dx.then(|| {
                    let v = vec![T::zero(); p.n * p.c];
                    let c = counted(&v);
                    (v, c)
                }),
                dw: None,
            }
        }

        fn run(mut self) -> Result<Made> {
            let mut pending: Option<Pending<T>> = None;
            for ch in self.p.chunks.clone() {
                if !ch.trained {
                    continue;
                }
                let l = self.logits(ch)?;
                match self.p.shards {
                    None => self.single(ch, l)?,
                    Some(s) => {
                        // The max is all-reduced while the next chunk's GEMM runs.
                        let next = self.launch_max(ch, l, s)?;
                        if let Some(prev) = pending.replace(next) {
                            self.sharded(prev, s)?;
                        }
                    }
                }
            }
            if let (Some(prev), Some(s)) = (pending, self.p.shards) {
                self.sharded(prev, s)?;
            }
            let loss = self.sum * self.p.scale;
            let one = |v: f64| if self.dt == DType::F64 { CpuStorage::F64(vec![v]) } else { CpuStorage::F32(vec![v as f32]) };
            let dt = self.dt;
            let dw_dt = if dt == DType::F64 { DType::F64 } else { DType::F32 };
            Ok(Made {
                loss: Storage::Cpu(one(loss)),
                dx: self.dx.map(|(v, _)| T::store(v, dt)),
                dw: self.dw.map(|(v, _)| T::store(v, dw_dt)),
            })
        }

        /// The chunk's logits (rows, v) in working precision.
        fn logits(&self, ch: Chunk) -> Result<(Vec<T>, CountedBytes)> {
            let (p, xo, wo) = (self.p, self.x.1.offset, self.w.1.offset);
            let xl = view(ch.rows, p.c, p.c, xo + ch.first * p.c, false);
            let wt = view(p.v, p.c, p.c, wo, true);
            let l = T::take(self.be.matmul((self.x.0, &xl), (self.w.0, &wt))?)?;
            let c = counted(&l);
            Ok((l, c))
        }

        /// One device: the rows' losses and, in place, their gradients; then the gradient GEMMs.
        fn single(&mut self, ch: Chunk, (mut l, lc): (Vec<T>, CountedBytes)) -> Result<()> {
            let (v, ignore, sc) = (self.p.v, self.p.ignore, self.sc);
            let t = &self.t[ch.first..ch.first + ch.rows];
            let grad = self.p.dx || self.p.dw;
            // Per row: lse − the target's logit (read before the gradient overwrites it).
            let rows: Vec<T> = l
                .par_chunks_mut(v)
                .zip(t.par_iter())
                .map(|(x, &tg)| {
                    if tg == ignore {
                        if grad {
                            x.iter_mut().for_each(|e| *e = T::zero());
                        }
                        return T::zero();
                    }
                    let xt = x[tg as usize];
                    let lse = if grad { row_grad(x, tg as usize, sc) } else { row_lse(x) };
                    lse - xt
                })
                .collect();
            self.add_losses(t, &rows);
            if grad {
                self.gradients(ch, (l, lc))?;
            }
            Ok(())
        }

        /// The row losses summed in row order, in f64 (`cross_entropy`'s `mean_loss`).
        fn add_losses(&mut self, t: &[i32], rows: &[T]) {
            for (&tg, &r) in t.iter().zip(rows) {
                if tg != self.p.ignore {
                    self.sum += r.to_f64().unwrap_or(f64::NAN);
                }
            }
        }

        /// Each row's local max and target logit (0 where another rank holds it); the max's
        /// all-reduce launched.
        fn launch_max(&self, ch: Chunk, l: (Vec<T>, CountedBytes), s: &dyn VocabShards) -> Result<Pending<T>> {
            let (v, start) = (self.p.v, self.p.start as i64);
            let t = &self.t[ch.first..ch.first + ch.rows];
            let (mx, tgt): (Vec<T>, Vec<T>) =
                l.0.par_chunks(v)
                    .zip(t.par_iter())
                    .map(|(x, &tg)| {
                        let j = tg as i64 - start;
                        let local = tg != self.p.ignore && (0..v as i64).contains(&j);
                        (simd::max(x), if local { x[j as usize] } else { T::zero() })
                    })
                    .unzip();
            let max = s.all_reduce_max(&Tensor::new(T::store(mx, self.stat_dt()), [ch.rows])?)?;
            Ok(Pending { chunk: ch, l, max, tgt })
        }

        fn stat_dt(&self) -> DType {
            if self.dt == DType::F64 {
                DType::F64
            } else {
                DType::F32
            }
        }

        /// Under tensor parallelism: the statistics completed over the ranks, then as `single`.
        fn sharded(&mut self, pc: Pending<T>, s: &dyn VocabShards) -> Result<()> {
            let Pending { chunk: ch, l: (mut l, lc), max, tgt } = pc;
            let (v, start, ignore, sc, n) = (self.p.v, self.p.start as i64, self.p.ignore, self.sc, ch.rows);
            let cast = |x: f64| num_traits::cast::<f64, T>(x).unwrap_or_else(T::nan);
            let m: Vec<T> = max.to_vec_f64()?.into_iter().map(cast).collect();
            let sums: Vec<T> = l.par_chunks(v).zip(m.par_iter()).map(|(x, &m)| row_sumexp(x, m)).collect();
            let st = s.all_reduce_sum(&Tensor::new(T::store([sums, tgt].concat(), self.stat_dt()), [2 * n])?)?;
            let st: Vec<T> = st.to_vec_f64()?.into_iter().map(cast).collect();
            let t = &self.t[ch.first..ch.first + n];
            let grad = self.p.dx || self.p.dw;
            let rows: Vec<T> = l
                .par_chunks_mut(v)
                .enumerate()
                .map(|(r, x)| {
                    if t[r] == ignore {
                        if grad {
                            x.iter_mut().for_each(|e| *e = T::zero());
                        }
                        return T::zero();
                    }
                    let lse = m[r] + st[r].ln();
                    if grad {
                        row_softmax(x, lse, sc);
                        let j = t[r] as i64 - start;
                        if (0..v as i64).contains(&j) {
                            x[j as usize] = x[j as usize] - sc;
                        }
                    }
                    lse - st[n + r]
                })
                .collect();
            self.add_losses(t, &rows);
            if grad {
                self.gradients(ch, (l, lc))?;
            }
            Ok(())
        }

        /// dX_c = dlogits W into the chunk's rows; dW += dlogits^T x_c.
        fn gradients(&mut self, ch: Chunk, (dl, dlc): (Vec<T>, CountedBytes)) -> Result<()> {
            let (p, xo, wo) = (self.p, self.x.1.offset, self.w.1.offset);
            let g = T::store(dl, self.dt);
            // The same bytes when the working precision is the dtype (moved, not copied).
            let _g = match g.dtype().size_in_bytes() == std::mem::size_of::<T>() {
                true => dlc,
                false => CountedBytes::elems(g.len(), g.dtype()),
            };
            if let Some((dx, _)) = &mut self.dx {
                let d = T::take(self.be.matmul((&g, &view(ch.rows, p.v, p.v, 0, false)), (self.w.0, &view(p.v, p.c, p.c, wo, false)))?)?;
                let _d = counted(&d);
                dx[ch.first * p.c..(ch.first + ch.rows) * p.c].copy_from_slice(&d);
            }
            if p.dw {
                let xl = view(ch.rows, p.c, p.c, xo + ch.first * p.c, false);
                let d = T::take(self.be.matmul((&g, &view(ch.rows, p.v, p.v, 0, true)), (self.x.0, &xl))?)?;
                let dc = counted(&d);
                match &mut self.dw {
                    // acc + this chunk's product: the order a GEMM adds its later depth slices.
                    Some((acc, _)) => acc.par_iter_mut().zip(d.par_iter()).for_each(|(a, &b)| *a = *a + b),
                    None => self.dw = Some((d, dc)),
                }
            }
            Ok(())
        }
    }
}

mod cuda {
    //! The launcher: cuBLASLt GEMMs into one chunk buffer and the callers' gradient buffers,
    //! the row kernels of kernels/cross_entropy.cu (one device) or kernels/head_loss.cu
    //! (vocabulary-parallel), a two-level fixed-order sum of the row losses. No host wait.
    use super::*;
    use ferrolm_cuda::{consts, kernels, CudaBackend, CudaStorage, Launch};
    use ferrolm_tensor::backend::Backend;
    use ferrolm_tensor::{CpuStorage, DeviceStorage};

    /// A chunk of logits whose max is being all-reduced (tensor parallelism), with this rank's
    /// statistics: each row's local max `ml`, and `st` = [the sum of exp(x − ml) over the local
    /// columns (rows); the target logit, 0 where another rank holds it (rows)].
    struct Pending {
        chunk: Chunk,
        buf: Storage,
        max: Tensor,
        ml: CudaStorage,
        st: CudaStorage,
    }

    /// The loss (1, f32); writes dX's rows into `dx` (n, c; x's dtype) and accumulates dW into
    /// `dw` (v, c; f32), each when given. `t`: the n targets, contiguous.
    pub(super) fn run(be: &CudaBackend, x: View, w: View, t: View, dx: Option<View>, dw: Option<View>, p: &Plan) -> Result<Made> {
        let op = "head_loss";
        let dt = CudaStorage::of(op, x.0)?.dtype();
        ferrolm_cuda::check_kernel_dtype(op, dt)?;
        let rl = be.alloc_zeroed(p.n, DType::F32)?; // rows of skipped chunks stay 0
        let grad = p.dx || p.dw;
        let cm = p.chunk_max().max(1);
        let lse = be.alloc_storage(cm, DType::F32)?;
        let sc: Storage = be.from_cpu(&CpuStorage::F32(vec![p.scale as f32]))?;
        let ctx = Ctx { be, x, w, t, dx, dw, p, dt, rl: &rl, first_dw: std::cell::Cell::new(true) };
        // One buffer for every chunk (the pool hands the same block back for the next).
        let mut pending: Option<Pending> = None;
        for ch in p.chunks.iter().copied().filter(|c| c.trained) {
            let buf: Storage = be.alloc_storage(ch.rows * p.v, dt)?.into();
            ctx.logits(ch, &buf)?;
            match p.shards {
                None => {
                    let (b, tt, s) = (CudaStorage::of(op, &buf)?, CudaStorage::of(op, t.0)?, CudaStorage::of(op, &sc)?);
                    let (n, v, tp) = (ch.rows as i64, p.v as i64, tt.at(t.1.offset + ch.first));
                    let cfg = Launch::per_row(ch.rows, Launch::BLOCK);
                    // SAFETY: `b` holds the chunk's rows x v logits (written in place: ce_fused reads
                    // each element before its thread writes it); `tp` the chunk's targets (checked on
                    // the host); lse `cm` >= rows f32 and rl n f32 from the chunk's first row; `s` one f32.
                    unsafe {
                        match grad {
                            true => {
                                kernels::ce_fused(be, dt, cfg, b.ptr(), tp, s.ptr(), lse.ptr(), rl.at(ch.first), b.ptr(), n, v, p.ignore)?
                            }
                            false => kernels::ce_fwd(be, dt, cfg, b.ptr(), tp, lse.ptr(), rl.at(ch.first), n, v, p.ignore)?,
                        }
                    }
                    if grad {
                        ctx.gradients(ch, &buf)?;
                    }
                }
                Some(s) => {
                    let next = ctx.launch_stats(ch, buf, s)?;
                    if let Some(prev) = pending.replace(next) {
                        ctx.sharded(prev, s)?;
                    }
                }
            }
        }
        if let (Some(prev), Some(s)) = (pending, p.shards) {
            ctx.sharded(prev, s)?;
        }
        // The row losses summed in two levels: per HL_LOSS_ROWS rows in f64, then the partials.
        let (loss, nb) = (be.alloc_storage(1, DType::F32)?, p.n.div_ceil(consts::HL_LOSS_ROWS).max(1));
        let part = be.alloc_storage(2 * nb, DType::F32)?; // one f64 per block
        let block = consts::HL_LOSS_BLOCK as u32;
        let cfg = Launch::new((nb.min(1 << 20) as u32, 1, 1), block).elems(p.n);
        // SAFETY: rl holds n f32 row losses, `part` nb f64 (8 bytes each), loss one f32.
        unsafe {
            kernels::hl_loss_partial(be, cfg, rl.ptr(), p.n as i64, part.ptr())?;
            kernels::hl_finish(be, Launch::single(block), part.ptr(), nb as i64, p.scale as f32, loss.ptr())?;
        }
        Ok(Made { loss: loss.into(), dx: None, dw: None })
    }

    struct Ctx<'a> {
        be: &'a CudaBackend,
        x: View<'a>,
        w: View<'a>,
        t: View<'a>,
        dx: Option<View<'a>>,
        dw: Option<View<'a>>,
        p: &'a Plan<'a>,
        dt: DType,
        rl: &'a CudaStorage,
        /// The next dW GEMM writes (beta 0) instead of adding: no chunk has added to it yet.
        first_dw: std::cell::Cell<bool>,
    }

    impl Ctx<'_> {
        /// L = x_c W^T into `buf` (rows, v).
        fn logits(&self, ch: Chunk, buf: &Storage) -> Result<()> {
            let (p, xo, wo) = (self.p, self.x.1.offset, self.w.1.offset);
            let xl = view(ch.rows, p.c, p.c, xo + ch.first * p.c, false);
            let wt = view(p.v, p.c, p.c, wo, true);
            self.be.gemm_into((self.x.0, &xl), (self.w.0, &wt), (buf, &view(ch.rows, p.v, p.v, 0, false)), false)
        }

        /// dX_c = dlogits W into the chunk's rows of `dx`; dW (+)= dlogits^T x_c.
        fn gradients(&self, ch: Chunk, dl: &Storage) -> Result<()> {
            let (p, xo, wo) = (self.p, self.x.1.offset, self.w.1.offset);
            if let Some(dx) = self.dx {
                let rows = view(ch.rows, p.c, p.c, dx.1.offset + ch.first * p.c, false);
                self.be.gemm_into(
                    (dl, &view(ch.rows, p.v, p.v, 0, false)),
                    (self.w.0, &view(p.v, p.c, p.c, wo, false)),
                    (dx.0, &rows),
                    false,
                )?;
            }
            if let Some(dw) = self.dw {
                let xl = view(ch.rows, p.c, p.c, xo + ch.first * p.c, false);
                let first = self.first_dw.replace(false);
                self.be.gemm_into((dl, &view(ch.rows, p.v, p.v, 0, true)), (self.x.0, &xl), dw, !first)?;
            }
            Ok(())
        }

        /// The chunk read once for each row's local max, sum of exponentials and target logit
        /// (kernels/head_loss.cu's `hl_row_stats`); the max's all-reduce launched.
        fn launch_stats(&self, ch: Chunk, buf: Storage, s: &dyn VocabShards) -> Result<Pending> {
            let op = "head_loss";
            let (mx, ml) = (self.be.alloc_storage(ch.rows, DType::F32)?, self.be.alloc_storage(ch.rows, DType::F32)?);
            let st = self.be.alloc_storage(2 * ch.rows, DType::F32)?;
            let (b, tt) = (CudaStorage::of(op, &buf)?, CudaStorage::of(op, self.t.0)?);
            let tp = tt.at(self.t.1.offset + ch.first);
            let cfg = Launch::per_row(ch.rows, Launch::BLOCK);
            let (n, v, start) = (ch.rows as i64, self.p.v as i64, self.p.start as i64);
            // SAFETY: `b` holds rows x v logits, `tp` the chunk's rows targets, mx and ml rows f32,
            // st 2 rows f32.
            unsafe { kernels::hl_row_stats(self.be, self.dt, cfg, b.ptr(), tp, mx.ptr(), ml.ptr(), st.ptr(), n, v, start, self.p.ignore)? };
            let max = s.all_reduce_max(&Tensor::new(mx.into(), [ch.rows])?)?;
            Ok(Pending { chunk: ch, buf, max, ml, st })
        }

        /// The local sums brought to the global max (`hl_rescale`) and all-reduced with the
        /// target logits, then the row losses and the gradient in place (`hl_grad`), then the
        /// gradient GEMMs.
        fn sharded(&self, pc: Pending, s: &dyn VocabShards) -> Result<()> {
            let op = "head_loss";
            let Pending { chunk: ch, buf, max, ml, st } = pc;
            let (n, v, start) = (ch.rows as i64, self.p.v as i64, self.p.start as i64);
            let b = CudaStorage::of(op, &buf)?;
            Tensor::with_storages(&[&max], |m| {
                let mp = CudaStorage::of(op, m[0].0)?.at(m[0].1.offset);
                // SAFETY: ml and mp rows f32, st at least rows f32 (its sums, rescaled in place).
                unsafe { kernels::hl_rescale(self.be, Launch::cover(ch.rows, Launch::BLOCK), ml.ptr(), mp, st.ptr(), n) }
            })?;
            let st = s.all_reduce_sum(&Tensor::new(st.into(), [2 * ch.rows])?)?;
            let grad = self.p.dx || self.p.dw;
            let tt = CudaStorage::of(op, self.t.0)?;
            let tp = tt.at(self.t.1.offset + ch.first);
            let cfg = Launch::per_row(ch.rows, Launch::BLOCK);
            Tensor::with_storages(&[&max, &st], |m| {
                let mp = CudaStorage::of(op, m[0].0)?.at(m[0].1.offset);
                let sp = CudaStorage::of(op, m[1].0)?.at(m[1].1.offset);
                let (sc, ig) = (self.p.scale as f32, self.p.ignore);
                // SAFETY: `b` holds rows x v logits (overwritten in place by their gradient), `tp`
                // rows targets, mp rows f32, sp 2 rows f32, rl n f32 from the chunk's first row.
                unsafe {
                    kernels::hl_grad(self.be, self.dt, cfg, b.ptr(), tp, mp, sp, self.rl.at(ch.first), n, v, start, ig, sc, grad as i32)
                }
            })?;
            if grad {
                self.gradients(ch, &buf)?;
            }
            Ok(())
        }
    }
}
