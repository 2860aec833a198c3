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
//!
//! Per-row values (`head_logprobs`): the same loop returns each row's log-prob of its target,
//! l[target] − lse, a tensor [rows], for objectives other than the token mean (per-sequence
//! log-probs of preference losses, nanochat's `loss_reduction='none'`). Its forward walks the
//! chunks for the values only (a logits GEMM and the row kernel a chunk); its backward takes the
//! per-row gradient g and walks them again with row r's dlogits = −g[r] (softmax − onehot), into
//! dX and dW. A row's factor is read per row by the same row kernels (`ce_fused`, `hl_grad`:
//! `scale[r * sstride]`, stride 0 for the cross-entropy's one scale). Ignored rows are 0 and get
//! no gradient.
//!
//! The loop is written once (`walk`) over `ChunkSteps`, which the CPU (`cpu::Loop`) and CUDA
//! (`cuda::Ctx`) implement: logits, rows (one device) or the statistics and their completion
//! (vocabulary shards), gradients. The CPU row math is `crate::ce_row`, shared with
//! `cross_entropy`.
use crate::dispatch::{on_device, On};
use crate::tokens::Tokens;
use ferrolm_tensor::autograd::{GradCtx, ParamDest};
use ferrolm_tensor::backend::View;
use ferrolm_tensor::{
    bail, is_grad_enabled, no_grad, same_device, same_float, CpuStorage, DType, Device, Layout, Result, Shape, Storage, Tensor,
};
use std::sync::Arc;
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

/// What the per-row head needs besides its tensors (`head_logprobs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadRowsOptions {
    /// The target value of rows that are not scored (transformers' -100): their log-prob is 0
    /// and they get no gradient.
    pub ignore_index: i32,
    /// Tokens per chunk (at least 1; `LossChunks::chunk_tokens` gives it).
    pub chunk_tokens: usize,
}

/// Per row of x, the log-probability of its target under the head W (V, C): l[target] − lse(l)
/// with l = x W^T, a tensor of shape [rows] (f32, f64 for f64 inputs; x (..., C) is taken as
/// rows of C), 0 for rows whose target is `ignore_index`. Chunked as `head_loss` (the logits
/// never whole), and differentiable: its backward takes a per-row gradient g [rows] and walks
/// the chunks again (the logits GEMM once more), with each row's dlogits = −g[r] (softmax −
/// onehot), into dX and dW. Token cross-entropy, per-sequence log-probs (segment sums) and the
/// preference losses over them are objectives over these values (ferrolm_nn::objective).
pub fn head_logprobs(x: &Tensor, w: &Tensor, targets: &Tokens, o: &HeadRowsOptions) -> Result<Tensor> {
    rows_op(x, w, targets, o, None)
}

/// `head_logprobs` with W this rank's rows of a vocabulary split over tensor-parallel ranks;
/// the values are whole (the statistics are reduced over the ranks), the gradient of x this
/// rank's part (the caller all-reduces it). The shards are held until the backward has run.
pub fn head_logprobs_sharded(
    x: &Tensor,
    w: &Tensor,
    targets: &Tokens,
    o: &HeadRowsOptions,
    shards: Arc<dyn VocabShards>,
) -> Result<Tensor> {
    rows_op(x, w, targets, o, Some(shards))
}

/// A chunk of rows: the first, how many, and whether any of their targets is trained.
#[derive(Clone, Copy, Debug)]
struct Chunk {
    first: usize,
    rows: usize,
    trained: bool,
}

/// Each row's factor of its dlogits (softmax − onehot): one for every row (the loss scale
/// times a loss gradient of 1), or one per row (a per-row upstream gradient, negated for
/// log-probs), f32 (f64 for f64 inputs) on x's device, contiguous.
#[derive(Clone)]
enum Factor {
    Uniform(f64),
    Rows(Tensor),
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
    factor: Factor,
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
    fn grad(&self) -> bool {
        self.dx || self.dw
    }
}

/// What a device's loop returns: the row losses lse − l[target] (n; f32, f64 for f64 inputs; 0
/// for ignored rows) and on the CPU the gradients it made (a device writes them into the
/// buffers it was given).
struct Made {
    rows: Storage,
    dx: Option<Storage>,
    dw: Option<Storage>,
}

/// One backend's steps of the chunk loop (`walk`), over its own chunk buffer `Buf`.
trait ChunkSteps {
    type Buf;
    /// A chunk whose max is being all-reduced (tensor parallelism), with its statistics.
    type Pending;
    /// L = x_c W^T, the chunk's logits (rows, v).
    fn logits(&mut self, ch: Chunk) -> Result<Self::Buf>;
    /// One device: the rows' losses and, in place when the plan wants gradients, their
    /// dlogits times each row's factor.
    fn rows(&mut self, ch: Chunk, buf: &mut Self::Buf) -> Result<()>;
    /// Under tensor parallelism: this rank's row statistics, the max's all-reduce launched.
    fn launch_stats(&mut self, ch: Chunk, buf: Self::Buf, s: &dyn VocabShards) -> Result<Self::Pending>;
    /// The statistics completed over the ranks, then as `rows`. -> the chunk and its buffer.
    fn finish_stats(&mut self, pc: Self::Pending, s: &dyn VocabShards) -> Result<(Chunk, Self::Buf)>;
    /// dX_c = dlogits W into the chunk's rows; dW += dlogits^T x_c.
    fn gradients(&mut self, ch: Chunk, buf: Self::Buf) -> Result<()>;
}

/// The chunk loop, once for every backend: per chunk with a trained row, its logits, its row
/// losses and gradient, the gradient GEMMs. Under tensor parallelism a chunk's max is
/// all-reduced while the next chunk's GEMM runs (two chunks are held then).
fn walk<S: ChunkSteps>(s: &mut S, p: &Plan) -> Result<()> {
    let mut pending: Option<S::Pending> = None;
    for ch in p.chunks.iter().copied().filter(|c| c.trained) {
        let mut buf = s.logits(ch)?;
        match p.shards {
            None => {
                s.rows(ch, &mut buf)?;
                if p.grad() {
                    s.gradients(ch, buf)?;
                }
            }
            Some(sh) => {
                let next = s.launch_stats(ch, buf, sh)?;
                if let Some(prev) = pending.replace(next) {
                    let (ch, buf) = s.finish_stats(prev, sh)?;
                    if p.grad() {
                        s.gradients(ch, buf)?;
                    }
                }
            }
        }
    }
    if let (Some(prev), Some(sh)) = (pending, p.shards) {
        let (ch, buf) = s.finish_stats(prev, sh)?;
        if p.grad() {
            s.gradients(ch, buf)?;
        }
    }
    Ok(())
}

/// The checked shapes of a call and its host targets.
struct Call {
    n: usize,
    c: usize,
    v: usize,
    start: usize,
    host: Vec<i32>,
    count: usize,
    chunks: Vec<Chunk>,
}

fn check(
    op: &str,
    x: &Tensor,
    w: &Tensor,
    targets: &Tokens,
    ignore: i32,
    chunk_tokens: usize,
    shards: Option<&dyn VocabShards>,
) -> Result<Call> {
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
    if chunk_tokens == 0 {
        bail!(op, "chunks must hold at least one token (an unfused head is the caller's)");
    }
    let (start, vocab) = shards.map_or((0, v), |s| (s.start(), s.vocab()));
    if start + v > vocab {
        bail!(op, "this rank's vocabulary rows {start}..{} lie outside the vocabulary of {vocab}", start + v);
    }
    let host = targets.host_ids()?;
    let count = crate::tokens::count_targets(&host, vocab, ignore)?;
    let chunks = (0..n)
        .step_by(chunk_tokens)
        .map(|first| {
            let rows = chunk_tokens.min(n - first);
            Chunk { first, rows, trained: host[first..first + rows].iter().any(|&t| t != ignore) }
        })
        .collect();
    Ok(Call { n, c, v, start, host: host.into_owned(), count, chunks })
}

/// The loop run on x2 (n, c), w2 (v, c) (contiguous) and targets `t` (n, contiguous) on their
/// device: (row losses (n), dX (n, c) in x's dtype, dW (v, c): in `dest` when given, else f32
/// on a device, W's working dtype on the CPU), each gradient when the plan asks for it.
fn execute(
    x2: &Tensor,
    w2: &Tensor,
    t: &Tensor,
    host: &[i32],
    p: &Plan,
    dest: Option<&Tensor>,
) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
    let op = "head_loss";
    let (n, c, v, dev) = (p.n, p.c, p.v, x2.device());
    let factor = match &p.factor {
        Factor::Rows(f) => Some(f),
        Factor::Uniform(_) => None,
    };
    let made = match on_device(op, dev)? {
        On::Cpu => {
            let fac = factor.map(|f| f.to_vec_f64()).transpose()?;
            let made = Tensor::with_storages(&[x2, w2], |s| cpu::run(s[0], s[1], fac.as_deref(), host, p))?;
            let dx = made.dx.map(|s| Tensor::new(s, [n, c])).transpose()?;
            let dw = made.dw.map(|s| Tensor::new(s, [v, c])).transpose()?;
            (Tensor::new(made.rows, [n])?, dx, dw)
        }
        On::Cuda(be) => {
            // Rows of skipped chunks are never written: then the buffer starts zeroed.
            let skipped = p.chunks.iter().any(|c| !c.trained);
            let dx = match (p.dx, skipped) {
                (false, _) => None,
                (true, true) => Some(Tensor::zeros([n, c], x2.dtype(), dev)?),
                (true, false) => Some(Tensor::empty([n, c], x2.dtype(), dev)?),
            };
            let dw = match dest {
                _ if !(p.dw && p.any_trained()) => None,
                Some(d) if d.dtype() == DType::F32 => Some(d.clone()),
                _ => Some(Tensor::empty([v, c], DType::F32, dev)?),
            };
            let mut ins = vec![x2, w2, t];
            ins.extend(factor);
            let k = ins.len();
            ins.extend(dx.iter().chain(dw.iter()));
            let made = Tensor::with_storages(&ins, |s| {
                let (dxv, dwv) = (dx.as_ref().map(|_| s[k]), dw.as_ref().map(|_| s[k + dx.is_some() as usize]));
                cuda::run(&be, s[0], s[1], s[2], factor.map(|_| s[3]), dxv, dwv, p)
            })?;
            (Tensor::new(made.rows, [n])?, dx, dw)
        }
    };
    Ok(made)
}

/// The sum of the trained rows' losses times `scale`, as the loss (a scalar: f32, f64 for f64
/// rows). CPU: in f64 in row order (`cross_entropy`'s mean); a device: in f64 per fixed block
/// of rows, then the blocks' sums in order (`hl_loss_partial`, `hl_finish`): the same bits run
/// to run.
fn sum_rows(rows: &Tensor, host: &[i32], ignore: i32, scale: f64) -> Result<Tensor> {
    let s = match on_device("head_loss", rows.device())? {
        On::Cpu => {
            let r = rows.to_vec_f64()?;
            let sum = host.iter().zip(&r).filter(|(&t, _)| t != ignore).fold(0f64, |a, (_, &x)| a + x);
            let v = sum * scale;
            Storage::Cpu(match rows.dtype() {
                DType::F64 => CpuStorage::F64(vec![v]),
                _ => CpuStorage::F32(vec![v as f32]),
            })
        }
        On::Cuda(be) => Tensor::with_storages(&[rows], |s| cuda::sum(&be, s[0], host.len(), scale))?,
    };
    Tensor::new(s, ())
}

fn fused(x: &Tensor, w: &Tensor, targets: &Tokens, o: &HeadLossOptions, shards: Option<&dyn VocabShards>) -> Result<Tensor> {
    let op = "head_loss";
    let call = check(op, x, w, targets, o.ignore_index, o.chunk_tokens, shards)?;
    let scale = match o.scale {
        LossScale::Mean => 1.0 / call.count.max(1) as f64,
        LossScale::Sum(s) => s,
    };
    if !scale.is_finite() {
        bail!(op, "the loss scale {scale} is not finite");
    }
    let grad = is_grad_enabled();
    let Call { n, c, v, start, host, chunks, .. } = call;
    let plan = Plan {
        n,
        c,
        v,
        start,
        chunks,
        ignore: o.ignore_index,
        factor: Factor::Uniform(scale),
        dx: grad && x.requires_grad(),
        dw: grad && w.requires_grad(),
        shards,
    };
    let guard = no_grad();
    let x2 = x.contiguous()?.reshape([n, c])?;
    let w2 = w.contiguous()?;
    let t = targets.tensor().contiguous()?.reshape([n])?;
    // Where dW accumulates: W's gradient destination when it is f32, else an f32 buffer of its
    // own (on the CPU the loop keeps its own and copies it over at the end).
    let dest = ParamDest::new(if plan.dw && plan.any_trained() { w.grad_dest()? } else { None });
    let (rows, dx, dw) = execute(&x2, &w2, &t, &host, &plan, dest.fused())?;
    let loss = sum_rows(&rows, &host, plan.ignore, scale)?;
    if !(plan.dx || plan.dw) {
        return Ok(loss);
    }
    // dW lands in the destination whatever the dtype (its own buffer cast on the way), or is
    // handed over in W's dtype.
    let dw = dw.map(|d| dest.land_as(d, Some(w.dtype()))).transpose()?;
    drop(guard); // the op below is recorded
    let saved = Mutex::new(Some((dx, dw)));
    let xshape = x.shape().clone();
    let backward = move |g: &Tensor, ctx: &mut GradCtx| {
        let Some((dx, dw)) = saved.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            bail!(op, "backward ran twice through one fused head + loss: compute the loss again");
        };
        let factor = if ctx.grad_is_one() { None } else { Some(g) };
        let gx = match dx {
            Some(d) => Some(ctx.accumulate(0, times(d.reshape(xshape.clone())?, factor)?)?),
            None => None,
        };
        // A scaled dW is a new tensor: a sink copies it over the destination's unscaled one.
        let gw = dw.map(|d| times(d, factor)).transpose()?;
        Ok(vec![gx, gw])
    };
    Ok(Tensor::from_op_ctx(loss, op, &[x, w], Box::new(backward)))
}

/// The per-row op (`head_logprobs`): the forward walks the chunks for the values only; the
/// backward walks them again with the per-row upstream gradient as each row's factor.
fn rows_op(x: &Tensor, w: &Tensor, targets: &Tokens, o: &HeadRowsOptions, shards: Option<Arc<dyn VocabShards>>) -> Result<Tensor> {
    let op = "head_logprobs";
    let Call { n, c, v, start, host, chunks, .. } = check(op, x, w, targets, o.ignore_index, o.chunk_tokens, shards.as_deref())?;
    let needs = is_grad_enabled() && (x.requires_grad() || w.requires_grad());
    let (dxq, dwq) = (x.requires_grad(), w.requires_grad());
    let plan = Plan {
        n,
        c,
        v,
        start,
        chunks,
        ignore: o.ignore_index,
        factor: Factor::Uniform(0.0),
        dx: false,
        dw: false,
        shards: shards.as_deref(),
    };
    let guard = no_grad();
    let x2 = x.contiguous()?.reshape([n, c])?;
    let w2 = w.contiguous()?;
    let t = targets.tensor().contiguous()?.reshape([n])?;
    let (rows, _, _) = execute(&x2, &w2, &t, &host, &plan, None)?;
    let logp = rows.neg()?;
    if !needs {
        return Ok(logp);
    }
    drop(guard);
    let Plan { chunks, ignore, .. } = plan;
    let (wdt, xshape) = (w.dtype(), x.shape().clone());
    let backward = move |g: &Tensor, ctx: &mut GradCtx| {
        let _g = no_grad();
        let stat = if x2.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
        let f = g.neg()?.to_dtype(stat)?.contiguous()?.reshape([n])?;
        let plan =
            Plan { n, c, v, start, chunks: chunks.clone(), ignore, factor: Factor::Rows(f), dx: dxq, dw: dwq, shards: shards.as_deref() };
        let (_, dx, dw) = execute(&x2, &w2, &t, &host, &plan, None)?;
        let gx = match dx {
            Some(d) => Some(ctx.accumulate(0, d.reshape(xshape.clone())?)?),
            None => None,
        };
        let gw = dw.map(|d| d.to_dtype(wdt)).transpose()?;
        Ok(vec![gx, gw])
    };
    Ok(Tensor::from_op_ctx(logp, op, &[x, w], Box::new(backward)))
}

/// `t` times the output gradient `g` (a one-element tensor), unless there is none to apply or
/// it is 1 (read on the host only where that costs no wait: the CPU).
fn times(t: Tensor, g: Option<&Tensor>) -> Result<Tensor> {
    let Some(g) = g else { return Ok(t) };
    if let On::Cpu = on_device("head_loss", g.device())? {
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
    //! parallel with the cross-entropy's row kernels (`crate::ce_row`), the row losses kept.
    use super::*;
    use crate::ce_row::{row_lse, row_lse_grad_in_place, row_sumexp, softmax_row_in_place};
    use ferrolm_tensor::backend::Backend;
    use ferrolm_tensor::cpu::simd::{self, FastExp};
    use ferrolm_tensor::cpu::Finish;
    use ferrolm_tensor::CountedBytes;
    use rayon::prelude::*;

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

    /// `fac`: each row's factor when the plan's is per row (read on the host by the caller).
    pub(super) fn run(x: View, w: View, fac: Option<&[f64]>, t: &[i32], p: &Plan) -> Result<Made> {
        let be = ferrolm_tensor::backend::get("head_loss", Device::Cpu)?;
        match x.0.dtype() {
            DType::F64 => Loop::<f64>::new(be, x, w, fac, t, p).run(),
            _ => Loop::<f32>::new(be, x, w, fac, t, p).run(),
        }
    }

    /// The loop's steps over one call, in working precision `T`.
    struct Loop<'a, T: Work> {
        be: Arc<dyn Backend>,
        x: View<'a>,
        w: View<'a>,
        t: &'a [i32],
        p: &'a Plan<'a>,
        /// The factor of every row, or of each (`Factor`).
        sc: T,
        fac: Option<Vec<T>>,
        dt: DType,
        /// The row losses (n; 0 where ignored or skipped).
        rows: (Vec<T>, CountedBytes),
        dx: Option<(Vec<T>, CountedBytes)>,
        dw: Option<(Vec<T>, CountedBytes)>,
    }

    /// A chunk of logits whose max is being all-reduced (tensor parallelism).
    pub(super) struct Pending<T> {
        chunk: Chunk,
        l: (Vec<T>, CountedBytes),
        max: Tensor,
        tgt: Vec<T>,
    }

    fn cast<T: Work>(x: f64) -> T {
        num_traits::cast::<f64, T>(x).unwrap_or_else(T::nan)
    }

    impl<'a, T: Work> Loop<'a, T> {
        fn new(be: Arc<dyn Backend>, x: View<'a>, w: View<'a>, fac: Option<&[f64]>, t: &'a [i32], p: &'a Plan<'a>) -> Self {
            let with_count = |v: Vec<T>| {
                let c = counted(&v);
                (v, c)
            };
            Loop {
                be,
                x,
                w,
                t,
                p,
                sc: cast(match p.factor {
                    Factor::Uniform(s) => s,
                    Factor::Rows(_) => f64::NAN,
                }),
                fac: fac.map(|f| f.iter().map(|&v| cast(v)).collect()),
                dt: x.0.dtype(),
                rows: with_count(vec![T::zero(); p.n]),
                dx: p.dx.then(|| with_count(vec![T::zero(); p.n * p.c])),
                dw: None,
            }
        }

        fn run(mut self) -> Result<Made> {
            let p = self.p;
            walk(&mut self, p)?;
            let dt = self.dt;
            let stat = if dt == DType::F64 { DType::F64 } else { DType::F32 };
            Ok(Made {
                rows: T::store(self.rows.0, stat),
                dx: self.dx.map(|(v, _)| T::store(v, dt)),
                dw: self.dw.map(|(v, _)| T::store(v, stat)),
            })
        }

        fn stat_dt(&self) -> DType {
            if self.dt == DType::F64 {
                DType::F64
            } else {
                DType::F32
            }
        }
    }

    impl<T: Work> ChunkSteps for Loop<'_, T> {
        type Buf = (Vec<T>, CountedBytes);
        type Pending = Pending<T>;

        fn logits(&mut self, ch: Chunk) -> Result<Self::Buf> {
            let (p, xo, wo) = (self.p, self.x.1.offset, self.w.1.offset);
            let xl = view(ch.rows, p.c, p.c, xo + ch.first * p.c, false);
            let wt = view(p.v, p.c, p.c, wo, true);
            let l = T::take(self.be.matmul((self.x.0, &xl), (self.w.0, &wt))?)?;
            let c = counted(&l);
            Ok((l, c))
        }

        fn rows(&mut self, ch: Chunk, buf: &mut Self::Buf) -> Result<()> {
            let (v, ignore, sc, grad) = (self.p.v, self.p.ignore, self.sc, self.p.grad());
            let t = &self.t[ch.first..ch.first + ch.rows];
            let fac = self.fac.as_ref().map(|f| &f[ch.first..ch.first + ch.rows]);
            let out = &mut self.rows.0[ch.first..ch.first + ch.rows];
            // Per row: lse − the target's logit (read before the gradient overwrites it).
            buf.0.par_chunks_mut(v).zip(t.par_iter()).zip(out.par_iter_mut()).enumerate().for_each(|(r, ((x, &tg), o))| {
                if tg == ignore {
                    if grad {
                        x.iter_mut().for_each(|e| *e = T::zero());
                    }
                    return;
                }
                let xt = x[tg as usize];
                let s = fac.map_or(sc, |f| f[r]);
                let lse = if grad { row_lse_grad_in_place(x, tg as usize, s) } else { row_lse(x) };
                *o = lse - xt;
            });
            Ok(())
        }

        /// Each row's local max and target logit (0 where another rank holds it); the max's
        /// all-reduce launched.
        fn launch_stats(&mut self, ch: Chunk, l: Self::Buf, s: &dyn VocabShards) -> Result<Pending<T>> {
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

        fn finish_stats(&mut self, pc: Pending<T>, s: &dyn VocabShards) -> Result<(Chunk, Self::Buf)> {
            let Pending { chunk: ch, l: (mut l, lc), max, tgt } = pc;
            let (v, start, ignore, sc, n) = (self.p.v, self.p.start as i64, self.p.ignore, self.sc, ch.rows);
            let m: Vec<T> = max.to_vec_f64()?.into_iter().map(cast).collect();
            let sums: Vec<T> = l.par_chunks(v).zip(m.par_iter()).map(|(x, &m)| row_sumexp(x, m)).collect();
            let st = s.all_reduce_sum(&Tensor::new(T::store([sums, tgt].concat(), self.stat_dt()), [2 * n])?)?;
            let st: Vec<T> = st.to_vec_f64()?.into_iter().map(cast).collect();
            let t = &self.t[ch.first..ch.first + n];
            let fac = self.fac.as_ref().map(|f| &f[ch.first..ch.first + n]);
            let grad = self.p.grad();
            let out = &mut self.rows.0[ch.first..ch.first + n];
            l.par_chunks_mut(v).zip(out.par_iter_mut()).enumerate().for_each(|(r, (x, o))| {
                if t[r] == ignore {
                    if grad {
                        x.iter_mut().for_each(|e| *e = T::zero());
                    }
                    return;
                }
                let lse = m[r] + st[r].ln();
                if grad {
                    let s = fac.map_or(sc, |f| f[r]);
                    softmax_row_in_place(x, lse, s);
                    let j = t[r] as i64 - start;
                    if (0..v as i64).contains(&j) {
                        x[j as usize] = x[j as usize] - s;
                    }
                }
                *o = lse - st[n + r];
            });
            Ok((ch, (l, lc)))
        }

        fn gradients(&mut self, ch: Chunk, (dl, dlc): Self::Buf) -> Result<()> {
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
    use ferrolm_cuda::{consts, kernels, CudaBackend, CudaStorage, DevPtr, Launch};
    use ferrolm_tensor::backend::Backend;
    use ferrolm_tensor::DeviceStorage;

    /// A chunk of logits whose max is being all-reduced (tensor parallelism), with this rank's
    /// statistics: each row's local max `ml`, and `st` = [the sum of exp(x − ml) over the local
    /// columns (rows); the target logit, 0 where another rank holds it (rows)].
    pub(super) struct Pending {
        chunk: Chunk,
        buf: Storage,
        max: Tensor,
        ml: CudaStorage,
        st: CudaStorage,
    }

    /// The row losses (n, f32); writes dX's rows into `dx` (n, c; x's dtype) and accumulates dW
    /// into `dw` (v, c; f32), each when given. `t`: the n targets, contiguous; `f`: the n per-row
    /// factors (f32) when the plan's factor is per row.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run(
        be: &CudaBackend,
        x: View,
        w: View,
        t: View,
        f: Option<View>,
        dx: Option<View>,
        dw: Option<View>,
        p: &Plan,
    ) -> Result<Made> {
        let op = "head_loss";
        let dt = CudaStorage::of(op, x.0)?.dtype();
        ferrolm_cuda::check_kernel_dtype(op, dt)?;
        let rl = be.alloc_zeroed(p.n, DType::F32)?; // rows of skipped chunks stay 0
        let lse = be.alloc_storage(p.chunk_max().max(1), DType::F32)?;
        // Each row's factor: one device scalar read by every row (stride 0), or the row's own.
        let (one, fac) = match (&p.factor, f) {
            (Factor::Rows(_), Some(f)) => {
                if CudaStorage::of(op, f.0)?.dtype() != DType::F32 {
                    bail!(op, "the per-row gradient must be f32 on a device");
                }
                (None, Some(f))
            }
            (Factor::Uniform(s), _) => (Some(be.from_cpu(&ferrolm_tensor::CpuStorage::F32(vec![*s as f32]))?), None),
            (Factor::Rows(_), None) => bail!(op, "a per-row factor without its tensor"),
        };
        let mut ctx = Ctx { be, x, w, t, dx, dw, p, dt, rl: &rl, lse: &lse, one: one.as_ref(), fac, first_dw: true };
        walk(&mut ctx, p)?;
        Ok(Made { rows: rl.into(), dx: None, dw: None })
    }

    /// The loss (one f32): the n row losses `rows` (f32) summed per HL_LOSS_ROWS rows in f64,
    /// then the partials in order, times `scale`.
    pub(super) fn sum(be: &CudaBackend, rows: View, n: usize, scale: f64) -> Result<Storage> {
        let rl = CudaStorage::of("head_loss", rows.0)?;
        let (loss, nb) = (be.alloc_storage(1, DType::F32)?, n.div_ceil(consts::HL_LOSS_ROWS).max(1));
        let part = be.alloc_storage(2 * nb, DType::F32)?; // one f64 per block
        let block = consts::HL_LOSS_BLOCK as u32;
        let cfg = Launch::new((nb.min(1 << 20) as u32, 1, 1), block).elems(n);
        // SAFETY: rows holds n f32 row losses from its offset, `part` nb f64 (8 bytes each), loss one f32.
        unsafe {
            kernels::hl_loss_partial(be, cfg, rl.at(rows.1.offset), n as i64, part.ptr())?;
            kernels::hl_finish(be, Launch::single(block), part.ptr(), nb as i64, scale as f32, loss.ptr())?;
        }
        Ok(loss.into())
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
        lse: &'a CudaStorage,
        one: Option<&'a Storage>,
        fac: Option<View<'a>>,
        /// The next dW GEMM writes (beta 0) instead of adding: no chunk has added to it yet.
        first_dw: bool,
    }

    impl Ctx<'_> {
        /// The factor of the chunk's first row and the stride between rows' factors.
        fn factor(&self, ch: Chunk) -> Result<(DevPtr, i64)> {
            let op = "head_loss";
            match (self.fac, self.one) {
                (Some(f), _) => Ok((CudaStorage::of(op, f.0)?.at(f.1.offset + ch.first), 1)),
                (None, Some(s)) => Ok((CudaStorage::of(op, s)?.ptr(), 0)),
                (None, None) => bail!(op, "no gradient factor"),
            }
        }
    }

    impl ChunkSteps for Ctx<'_> {
        type Buf = Storage;
        type Pending = Pending;

        fn logits(&mut self, ch: Chunk) -> Result<Storage> {
            // One buffer for every chunk (the pool hands the same block back for the next).
            let buf: Storage = self.be.alloc_storage(ch.rows * self.p.v, self.dt)?.into();
            let (p, xo, wo) = (self.p, self.x.1.offset, self.w.1.offset);
            let xl = view(ch.rows, p.c, p.c, xo + ch.first * p.c, false);
            let wt = view(p.v, p.c, p.c, wo, true);
            self.be.gemm_into((self.x.0, &xl), (self.w.0, &wt), (&buf, &view(ch.rows, p.v, p.v, 0, false)), false)?;
            Ok(buf)
        }

        fn rows(&mut self, ch: Chunk, buf: &mut Storage) -> Result<()> {
            let op = "head_loss";
            let (b, tt) = (CudaStorage::of(op, buf)?, CudaStorage::of(op, self.t.0)?);
            let (n, v, tp) = (ch.rows as i64, self.p.v as i64, tt.at(self.t.1.offset + ch.first));
            let cfg = Launch::per_row(ch.rows, Launch::BLOCK);
            let (rl, lse, ig) = (self.rl.at(ch.first), self.lse.ptr(), self.p.ignore);
            if self.p.grad() {
                let (sp, ss) = self.factor(ch)?;
                // SAFETY: `b` holds the chunk's rows x v logits (written in place: ce_fused reads
                // each element before its thread writes it); `tp` the chunk's targets (checked on
                // the host); lse >= rows f32 and rl n f32 from the chunk's first row; `sp` one f32
                // (ss 0) or rows f32 (ss 1).
                unsafe { kernels::ce_fused(self.be, self.dt, cfg, b.ptr(), tp, sp, ss, lse, rl, b.ptr(), n, v, ig) }
            } else {
                // SAFETY: as above, read only.
                unsafe { kernels::ce_fwd(self.be, self.dt, cfg, b.ptr(), tp, lse, rl, n, v, ig) }
            }
        }

        /// The chunk read once for each row's local max, sum of exponentials and target logit
        /// (kernels/head_loss.cu's `hl_row_stats`); the max's all-reduce launched.
        fn launch_stats(&mut self, ch: Chunk, buf: Storage, s: &dyn VocabShards) -> Result<Pending> {
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
        /// target logits, then the row losses and the gradient in place (`hl_grad`).
        fn finish_stats(&mut self, pc: Pending, s: &dyn VocabShards) -> Result<(Chunk, Storage)> {
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
            let grad = self.p.grad();
            let tt = CudaStorage::of(op, self.t.0)?;
            let tp = tt.at(self.t.1.offset + ch.first);
            let cfg = Launch::per_row(ch.rows, Launch::BLOCK);
            let (sp, ss) = self.factor(ch)?;
            Tensor::with_storages(&[&max, &st], |m| {
                let mp = CudaStorage::of(op, m[0].0)?.at(m[0].1.offset);
                let stp = CudaStorage::of(op, m[1].0)?.at(m[1].1.offset);
                let ig = self.p.ignore;
                // SAFETY: `b` holds rows x v logits (overwritten in place by their gradient), `tp`
                // rows targets, mp rows f32, stp 2 rows f32, rl n f32 from the chunk's first row,
                // `sp` one f32 (ss 0) or rows f32 (ss 1).
                unsafe {
                    kernels::hl_grad(
                        self.be,
                        self.dt,
                        cfg,
                        b.ptr(),
                        tp,
                        mp,
                        stp,
                        self.rl.at(ch.first),
                        n,
                        v,
                        start,
                        ig,
                        sp,
                        ss,
                        grad as i32,
                    )
                }
            })?;
            Ok((ch, buf))
        }

        /// dX_c = dlogits W into the chunk's rows of `dx`; dW (+)= dlogits^T x_c.
        fn gradients(&mut self, ch: Chunk, dl: Storage) -> Result<()> {
            let (p, xo, wo) = (self.p, self.x.1.offset, self.w.1.offset);
            if let Some(dx) = self.dx {
                let rows = view(ch.rows, p.c, p.c, dx.1.offset + ch.first * p.c, false);
                self.be.gemm_into(
                    (&dl, &view(ch.rows, p.v, p.v, 0, false)),
                    (self.w.0, &view(p.v, p.c, p.c, wo, false)),
                    (dx.0, &rows),
                    false,
                )?;
            }
            if let Some(dw) = self.dw {
                let xl = view(ch.rows, p.c, p.c, xo + ch.first * p.c, false);
                let first = std::mem::replace(&mut self.first_dw, false);
                self.be.gemm_into((&dl, &view(ch.rows, p.v, p.v, 0, true)), (self.x.0, &xl), dw, !first)?;
            }
            Ok(())
        }
    }
}
