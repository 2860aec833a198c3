//! Megatron-style tensor parallelism, attached to a model from outside.
//!
//! `parallelize(&mut model, &tp_group)` replaces each parameter by this rank's shard and
//! each op by its parallel form; the model file is untouched. Where each parameter goes is its
//! spec's role (`ferrolm_nn::spec::TpRole`, with the pieces its split dimension holds), never its
//! name; for the layers of a Llama block that is:
//! - q/k/v/gate/up: column-parallel (output features split). The forward is a plain GEMM on
//!   the replicated input, behind one Megatron `f` per input shared by the projections that
//!   read it, so q, k and v (and gate and up) sum their input gradients locally and all-reduce
//!   them once, as a fused QKV projection would. Each weight gradient is deferred work that
//!   the autograd engine runs while that all-reduce is in flight (Megatron's async TP).
//! - o/down: row-parallel (input features split); the output is a partial sum whose
//!   all-reduce is launched and returned pending, to be waited on where the residual schedule
//!   adds it (at once for a standard block, one branch later for a Ladder block).
//! - embedding and LM head: vocabulary-parallel (rows split); the cross-entropy works on the
//!   vocabulary shards and never gathers the logits: fused with the head and chunked
//!   (`ferrolm_ops::head_loss_sharded`: each chunk's row max, then its sums of exponentials and
//!   target logits, all-reduced, the max's in flight during the next chunk's GEMM); unfused
//!   (`--loss-chunk-tokens 0`) is one chunk of every token. Per-token log-probs (preference
//!   losses) use the same op's per-row form (`head_logprobs_sharded`). Ids and targets are split, checked and counted on their host copy
//!   (`Tokens`), so neither reads the device back.
//! - GQA with fewer key/value heads than ranks: each rank keeps the key/value head its query
//!   heads use (replicated, as Megatron does); its weight gradient is summed over the ranks
//!   that share it.
//! - LoRA adapters (`ferrolm_nn::lora`) split as their layer's weight does: a column-parallel
//!   layer's B by output rows (A whole on every rank), a row-parallel layer's A by input columns
//!   (B whole); the whole factor's gradient is summed over the ranks (over the ranks sharing a
//!   replicated key/value head, for its B). The frozen base weights get no gradient.
//! - Biases (`Linear::bias`): a column-parallel layer's is split with its weight's rows (its
//!   gradient summed over the ranks sharing a replicated key/value head); a row-parallel
//!   layer's is replicated and added once, after the all-reduce. Norms are replicated; the
//!   per-head q/k norms too (they act on head_dim, never split), but as each rank normalises
//!   only its heads, their gradient is summed over the group (`LinearOp::per_head`).
use crate::comm::{Comm, ReduceOp};
use crate::comm_ops::{copy_to_group, gather_from_group, reduce_from_group};
use ferrolm_nn::module::{linear, linear_adapted, EmbeddingOp, Factor, HeadLoss, HeadOp, LinearOp};
use ferrolm_nn::quant_linear::{QuantLinear, QuantOp};
use ferrolm_nn::spec::{parts, TpRole};
use ferrolm_nn::Llama;
use ferrolm_ops::{HeadLossOptions, Tokens, VocabShards};
use ferrolm_tensor::{bail, no_grad, DType, Error, Result, Tensor};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// How one parameter is laid out over the tensor-parallel group.
#[derive(Clone, Debug, PartialEq)]
pub struct Sharding {
    /// The dimension that is split (None: every rank holds the whole tensor).
    pub dim: Option<usize>,
    /// Number of distinct pieces along `dim`; rank r holds piece `r * parts / tp`.
    pub parts: usize,
    /// This rank's piece.
    pub index: usize,
    /// Ranks holding each piece (tp / parts): their gradients are summed.
    pub replicas: usize,
}

impl Sharding {
    /// The layout of a parameter of `role` whose split dimension holds `units` pieces
    /// (`ferrolm_nn::spec::ParamSpec`), on rank `rank` of `tp`.
    pub fn of(role: TpRole, units: usize, rank: usize, tp: usize) -> Self {
        match role.split_dim() {
            None => Sharding::replicated(tp),
            Some(dim) => Sharding::split(dim, parts(role, units, tp), rank, tp),
        }
    }
    fn replicated(tp: usize) -> Self {
        Sharding { dim: None, parts: 1, index: 0, replicas: tp }
    }
    fn split(dim: usize, parts: usize, rank: usize, tp: usize) -> Self {
        Sharding { dim: Some(dim), parts, index: rank * parts / tp, replicas: tp / parts }
    }
    /// This rank's piece of `full`, or, for a placeholder (a one-element broadcast: QLoRA's
    /// 4-bit layers carry one for their shape, `ferrolm_nn::qlora`), a placeholder of the
    /// piece's shape, never materialised.
    pub fn shard_or_placeholder(&self, full: &Tensor) -> Result<Tensor> {
        if full.numel() > 1 && full.layout().strides.iter().all(|&s| s == 0) {
            let mut dims = full.dims().to_vec();
            if let Some(d) = self.dim {
                dims[d] /= self.parts;
            }
            let one = Tensor::zeros(vec![1; dims.len()], full.dtype(), full.device())?;
            return one.broadcast_as(dims);
        }
        self.shard(full)
    }

    /// This rank's piece of the full tensor, in storage of its own (a view would keep the
    /// whole tensor alive on every rank).
    pub fn shard(&self, full: &Tensor) -> Result<Tensor> {
        let _g = no_grad();
        let Some(dim) = self.dim else { return full.deep_copy() };
        let n = full.dim(dim) / self.parts;
        full.narrow(dim, self.index * n, n)?.deep_copy()
    }
}

/// The result of `parallelize`: every parameter's layout, by transformers name.
#[derive(Clone, Debug)]
pub struct TpShardings {
    pub tp: usize,
    pub rank: usize,
    pub params: BTreeMap<String, Sharding>,
}

// ---- column-parallel: y_local = f(x) W_local^T ----------------------------------------------

/// Megatron's `f` (identity forward, all-reduce of the gradient in backward) applied once per
/// input tensor, shared by every column-parallel projection that reads it (q, k and v read
/// the same normed input, gate and up another): their input gradients are summed locally and
/// all-reduced once, as Megatron's fused QKV does, instead of once per projection.
#[derive(Default)]
pub struct SharedInput {
    last: Mutex<Option<(usize, Tensor)>>,
}

impl SharedInput {
    fn f(&self, x: &Tensor, comm: &Comm) -> Result<Tensor> {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((id, xf)) = last.as_ref() {
            if *id == x.id() {
                return Ok(xf.clone());
            }
        }
        let xf = copy_to_group(x, comm)?;
        *last = Some((x.id(), xf.clone()));
        Ok(xf)
    }
}

pub struct ColumnParallel {
    pub comm: Comm,
    /// Group whose ranks hold the same weight piece (replicated key/value heads); the weight
    /// gradient is summed over it. None when the weight is not replicated.
    pub replicas: Option<Comm>,
    pub input: Arc<SharedInput>,
}

impl LinearOp for ColumnParallel {
    fn forward(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let xf = self.input.f(x, &self.comm)?;
        let y = {
            let _g = no_grad();
            linear(&xf, w)? // (.., out_local)
        };
        let (xs, ws, rep) = (xf.clone(), w.clone(), self.replicas.clone());
        Ok(Tensor::from_op(
            y,
            "column_parallel_linear",
            &[&xf, w],
            Box::new(move |g| {
                // dX = dY W now: it completes the input gradient, whose all-reduce (the shared
                // f's backward) can then start. dW = dY^T X is deferred local work that the
                // engine runs while that all-reduce is in flight (Megatron's async TP); a frozen
                // weight (LoRA's base) has none.
                let dx = linear(g, &ws.t()?)?;
                if !ws.requires_grad() {
                    return Ok(vec![Some(dx), None]);
                }
                let (g, xs) = (g.clone(), xs.clone());
                let d = xs.dims().to_vec();
                let (shape, dtype, dev) = (ws.shape().clone(), ws.dtype(), ws.device());
                let dw = Tensor::deferred(shape, dtype, dev, move || {
                    let n: usize = d[..d.len() - 1].iter().product();
                    let g2 = g.reshape(vec![n, g.dim(g.rank() - 1)])?;
                    g2.t()?.matmul(&xs.reshape(vec![n, d[d.len() - 1]])?) // (out_local, in)
                })?;
                let dw = match &rep {
                    Some(r) => r.all_reduce_async(&dw, ReduceOp::Sum)?.tensor(),
                    None => dw,
                };
                Ok(vec![Some(dx), Some(dw)])
            }),
        ))
    }

    fn adapter_input(&self, x: &Tensor) -> Result<Tensor> {
        self.input.f(x, &self.comm)
    }

    /// A is whole on every rank: its gradient is summed over the group. B is split as the
    /// weight is: summed over the ranks that share a replicated key/value head.
    fn adapter_factor(&self, f: &Tensor, which: Factor) -> Result<Tensor> {
        match (which, &self.replicas) {
            (Factor::A, _) => copy_to_group(f, &self.comm),
            (Factor::B, Some(r)) => copy_to_group(f, r),
            (Factor::B, None) => Ok(f.clone()),
        }
    }

    fn forward_adapted(&self, x: &Tensor, w: &Tensor, u: &Tensor, b: &Tensor, scale: f64, res: Option<&Tensor>) -> Result<Tensor> {
        let y = linear_adapted(&self.input.f(x, &self.comm)?, w, u, b, scale, None)?; // (.., out_local)
        match res {
            Some(r) => r.add(&y),
            None => Ok(y),
        }
    }

    /// The bias is split with the weight's rows: this rank's piece, its gradient summed over
    /// the ranks that share a replicated key/value head (as the weight's).
    fn bias(&self, b: &Tensor) -> Result<Tensor> {
        match &self.replicas {
            Some(r) => copy_to_group(b, r),
            None => Ok(b.clone()),
        }
    }

    /// The heads are split over the whole group (a replicated key/value head's gradient comes
    /// from the query heads of every rank sharing it): the gradient is summed over the group.
    fn per_head(&self, w: &Tensor) -> Result<Tensor> {
        copy_to_group(w, &self.comm)
    }
}

// ---- row-parallel: y = all_reduce(x_local W_local^T), returned pending ------------------------

pub struct RowParallel {
    pub comm: Comm,
}

impl LinearOp for RowParallel {
    fn forward(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        reduce_from_group(&linear(x, w)?, &self.comm)
    }

    /// A is split by input columns as the weight is; B is whole on every rank: its gradient is
    /// summed over the group.
    fn adapter_factor(&self, f: &Tensor, which: Factor) -> Result<Tensor> {
        match which {
            Factor::A => Ok(f.clone()),
            Factor::B => copy_to_group(f, &self.comm),
        }
    }

    /// The adapter's term joins the partial sum before its one all-reduce: sum_r u_r B^T is
    /// (sum_r u_r) B^T, u_r this rank's columns' share of x A^T.
    fn forward_adapted(&self, x: &Tensor, w: &Tensor, u: &Tensor, b: &Tensor, scale: f64, res: Option<&Tensor>) -> Result<Tensor> {
        let y = reduce_from_group(&linear_adapted(x, w, u, b, scale, None)?, &self.comm)?;
        match res {
            Some(r) => r.add(&y),
            None => Ok(y),
        }
    }
}

// ---- QLoRA: a column- or row-parallel layer over this rank's piece of a 4-bit weight ----------

/// A parallel layer (`parallel`: `ColumnParallel` or `RowParallel`) whose local GEMM is the
/// 4-bit `local` piece's (dequantized per pass): column-parallel reads Megatron's `f` of x,
/// row-parallel all-reduces the partial sum (the adapter's term joined before it). The
/// adapter's factors, the bias and the per-head norms are placed as `parallel` places them.
pub struct QuantParallel {
    pub parallel: Arc<dyn LinearOp>,
    pub local: QuantOp,
    pub row: bool,
    pub comm: Comm,
}

impl LinearOp for QuantParallel {
    fn forward(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        if self.row {
            return reduce_from_group(&self.local.forward(x, w)?, &self.comm);
        }
        self.local.forward(&self.parallel.adapter_input(x)?, w)
    }
    fn adapter_input(&self, x: &Tensor) -> Result<Tensor> {
        self.parallel.adapter_input(x)
    }
    fn adapter_factor(&self, f: &Tensor, which: Factor) -> Result<Tensor> {
        self.parallel.adapter_factor(f, which)
    }
    fn forward_adapted(&self, x: &Tensor, w: &Tensor, u: &Tensor, b: &Tensor, scale: f64, res: Option<&Tensor>) -> Result<Tensor> {
        let y = if self.row {
            reduce_from_group(&self.local.forward_adapted(x, w, u, b, scale, None)?, &self.comm)?
        } else {
            self.local.forward_adapted(&self.parallel.adapter_input(x)?, w, u, b, scale, None)?
        };
        match res {
            Some(r) => r.add(&y),
            None => Ok(y),
        }
    }
    fn bias(&self, b: &Tensor) -> Result<Tensor> {
        self.parallel.bias(b)
    }
    fn per_head(&self, w: &Tensor) -> Result<Tensor> {
        self.parallel.per_head(w)
    }
    fn quantized(&self) -> Option<&QuantLinear> {
        self.local.quantized()
    }
}

// ---- vocabulary-parallel embedding and head ---------------------------------------------------

/// Rows `start..start + rows` of the (V, C) table live on this rank.
pub struct VocabParallel {
    pub comm: Comm,
    pub start: usize,
    pub rows: usize,
}

impl VocabParallel {
    /// Host-side split of i32 ids (their host copy; a bare tensor is read back) into local row
    /// ids (0 outside the shard, uploaded with their copy) and a mask. Ids outside the whole
    /// vocabulary are an error, as for a dense embedding.
    fn local_ids(&self, ids: &Tokens) -> Result<(Tokens, Tensor)> {
        let v = ids.host_ids()?;
        let t = ids.tensor();
        ferrolm_ops::tokens::check_ids(&v, self.rows * self.comm.size())?;
        let (lo, hi) = (self.start as i64, (self.start + self.rows) as i64);
        let inside = |x: i32| (lo..hi).contains(&(x as i64));
        let local: Vec<i32> = v.iter().map(|&x| if inside(x) { (x as i64 - lo) as i32 } else { 0 }).collect();
        let mask: Vec<f32> = v.iter().map(|&x| if inside(x) { 1.0 } else { 0.0 }).collect();
        let mut mshape = t.dims().to_vec();
        mshape.push(1);
        let dev = t.device();
        Ok((Tokens::upload(local, t.dims().to_vec(), dev)?, Tensor::from_vec(mask, mshape, dev)?))
    }
}

impl VocabParallel {
    /// The head's projection onto this rank's vocabulary rows.
    fn head(&self) -> ColumnParallel {
        ColumnParallel { comm: self.comm.clone(), replicas: None, input: Arc::default() }
    }
}

impl EmbeddingOp for VocabParallel {
    fn forward(&self, ids: &Tokens, w: &Tensor) -> Result<Tensor> {
        let (local, mask) = self.local_ids(ids)?;
        let rows = ferrolm_ops::embedding_tokens(&local, w)?.mul(&mask.to_dtype(w.dtype())?)?; // zero outside the shard
        reduce_from_group(&rows, &self.comm)
    }
}

impl HeadOp for VocabParallel {
    fn logits(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let local = self.head().forward(x, w)?; // (B, T, V/tp)
        gather_from_group(&local, &self.comm, local.rank() - 1)
    }

    /// Cross-entropy over vocabulary shards, fused with the head chunk by chunk
    /// (`head_loss_sharded`): each chunk's row max, then its sums of exponentials and target
    /// logits are reduced over the group; the (N, V) logits never are. Unfused
    /// (`--loss-chunk-tokens 0`) is the same op with one chunk of every token: the rank's whole
    /// (N, V/tp) logits at once, and one cross-entropy in the code base.
    fn loss(&self, x: &Tensor, w: &Tensor, targets: &Tokens, o: &HeadLoss) -> Result<Tensor> {
        let n = targets.tensor().numel();
        let f = o.fused(n, self.rows, w.dtype().size_in_bytes()).unwrap_or(HeadLossOptions {
            ignore_index: o.ignore_index,
            scale: o.scale,
            chunk_tokens: n.max(1),
        });
        // Megatron's f: the input's gradient (this rank's part) is all-reduced in backward.
        let xf = copy_to_group(x, &self.comm)?;
        ferrolm_ops::head_loss_sharded(&xf, w, targets, &f, self)
    }

    /// Per-token log-probs over vocabulary shards (`head_logprobs_sharded`), chunked as the
    /// loss; the input's gradient all-reduced in backward as the loss's.
    fn logprobs(&self, x: &Tensor, w: &Tensor, targets: &Tokens, o: &HeadLoss) -> Result<Tensor> {
        let n = targets.tensor().numel();
        let xf = copy_to_group(x, &self.comm)?;
        let shards: Arc<dyn VocabShards> = Arc::new(VocabParallel { comm: self.comm.clone(), start: self.start, rows: self.rows });
        ferrolm_ops::head_logprobs_sharded(&xf, w, &targets.reshape(vec![n])?, &o.rows(n, self.rows, w.dtype().size_in_bytes()), shards)
    }
}

/// The vocabulary shards of the fused head's per-chunk statistics: all-reduces over the group,
/// returned in flight.
impl VocabShards for VocabParallel {
    fn start(&self) -> usize {
        self.start
    }
    fn vocab(&self) -> usize {
        self.rows * self.comm.size()
    }
    fn all_reduce_max(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.comm.all_reduce_async(x, ReduceOp::Max)?.tensor())
    }
    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.comm.all_reduce_async(x, ReduceOp::Sum)?.tensor())
    }
}

// ---- the plan -----------------------------------------------------------------------------------

/// Whether `tp` ranks can split a model of config `c` (what [`parallelize`] needs): query heads,
/// the MLP width and the vocabulary divisible by `tp`, and the key/value heads split over the
/// ranks or replicated (one of kv heads and `tp` divides the other). Tools check this before
/// any rank starts; the error names the config field and `--tp`.
pub fn check_split(c: &ferrolm_nn::LlamaConfig, tp: usize) -> Result<()> {
    let err = |m: String| Error::new("parallelize", m);
    let need =
        |what: &str, n: usize| if n.is_multiple_of(tp) { Ok(()) } else { Err(err(format!("{what} ({n}) is not divisible by --tp {tp}"))) };
    need("num_attention_heads", c.num_attention_heads)?;
    need("intermediate_size", c.intermediate_size)?;
    need("vocab_size", c.vocab_size)?;
    let kv = c.num_key_value_heads;
    if !kv.is_multiple_of(tp) && !tp.is_multiple_of(kv) {
        return Err(err(format!("num_key_value_heads ({kv}) and --tp {tp}: one must divide the other")));
    }
    Ok(())
}

/// Shards `model` over the tensor-parallel group `tp` (Megatron's layout, see the module
/// comment) and returns every parameter's layout. The model must hold full (unsharded)
/// weights, identical on every rank.
pub fn parallelize(model: &mut Llama, comm: &Comm) -> Result<TpShardings> {
    let (tp, rank) = (comm.size(), comm.rank());
    let c = model.config().clone();
    check_split(&c, tp)?;
    // Every parameter's layout follows its spec's role (`ferrolm_nn::spec`): the split
    // dimension in as many pieces as it has units, at most one a rank.
    let mut layout = BTreeMap::new();
    model.visit_params_mut(&mut |p, t| {
        let s = Sharding::of(p.role, p.units, rank, tp);
        let shard = s.shard_or_placeholder(t)?;
        shard.set_requires_grad(t.requires_grad())?; // LoRA's base stays frozen
        *t = shard;
        layout.insert(p.name.to_string(), s);
        Ok(())
    })?;
    // LoRA factors: their specs derive the layout from the base weight's role (a column-parallel
    // layer's B splits as its weight, A whole; a row-parallel layer's A splits, B whole).
    model.visit_adapters_mut(&mut |p, t| {
        let s = Sharding::of(p.role, p.units, rank, tp);
        let shard = s.shard(t)?;
        shard.set_requires_grad(true)?;
        *t = shard;
        layout.insert(p.name.to_string(), s);
        Ok(())
    })?;
    // Ranks that share a replicated piece of a column-parallel weight (GQA's key/value heads
    // when there are fewer than ranks) sum its gradient: one group per number of pieces, made
    // in the same order on every rank (its own communicator, not a duplicate of the group's).
    let mut pieces: Vec<usize> = c.linear_specs(0).iter().filter(|s| s.role == TpRole::Column).map(|s| s.parts(tp)).collect();
    pieces.sort_unstable();
    pieces.dedup();
    let mut replicas = BTreeMap::new();
    for parts in pieces.into_iter().filter(|&p| p < tp) {
        replicas.insert(parts, crate::comm::sub_group(comm, tp / parts, rank * parts / tp, rank, "kv")?);
    }
    // One shared f for all the column-parallel projections: each input is all-reduced once.
    let input = Arc::new(SharedInput::default());
    let col = Arc::new(ColumnParallel { comm: comm.clone(), replicas: None, input: input.clone() });
    let mut cols: BTreeMap<usize, Arc<ColumnParallel>> = BTreeMap::new();
    for (parts, r) in replicas {
        cols.insert(parts, Arc::new(ColumnParallel { comm: comm.clone(), replicas: Some(r), input: input.clone() }));
    }
    let row = Arc::new(RowParallel { comm: comm.clone() });
    model.visit_linears_mut(&mut |s, l| {
        let base: Arc<dyn LinearOp> = match s.role {
            TpRole::Column => match cols.get(&s.parts(tp)) {
                Some(c) => c.clone(),
                None => col.clone(),
            },
            TpRole::Row => {
                // A split input's dropout masks: this rank's columns of the whole input's mask.
                let n = l.weight.dim(1); // this rank's input columns
                if let Some(ad) = l.adapter.as_mut() {
                    ad.columns = Some((n * tp, rank * n));
                }
                row.clone()
            }
            other => bail!("parallelize", "{}: a linear layer cannot be {other:?}", s.name),
        };
        // QLoRA's 4-bit base: this rank's piece of the codes and scales, quantized blocks
        // whole on one rank (a shape whose pieces would split a block is refused by name).
        let op: Arc<dyn LinearOp> = match (l.op.quantized(), &layout[&s.name]) {
            (Some(q), Sharding { dim: Some(dim), parts, index, .. }) => {
                let piece = ferrolm_nn::qlora::shard_quant(&s.name, q.quant(), *dim, *index, *parts)?;
                let local = QuantOp(QuantLinear::new(&s.name, piece, l.weight.device())?);
                Arc::new(QuantParallel { parallel: base, local, row: s.role == TpRole::Row, comm: comm.clone() })
            }
            (Some(_), _) => bail!("parallelize", "{}: a 4-bit weight must be split", s.name),
            (None, _) => base,
        };
        l.op = op;
        Ok(())
    })?;
    let rows = c.vocab_size / tp;
    let vp = Arc::new(VocabParallel { comm: comm.clone(), start: rank * rows, rows });
    model.embed_tokens.op = vp.clone();
    model.head_op = vp;
    Ok(TpShardings { tp, rank, params: layout })
}

impl TpShardings {
    /// The full tensor from this rank's piece `local` of parameter `name` (every rank of the
    /// group must call it, in the same order): all-gathers the pieces along the split dim and
    /// keeps one copy of each replicated piece.
    pub fn gather(&self, name: &str, local: &Tensor, comm: &Comm) -> Result<Tensor> {
        let s = self.params.get(name).ok_or_else(|| Error::new("TpShardings::gather", format!("unknown parameter {name}")))?;
        let Some(dim) = s.dim else { return Ok(local.clone()) };
        let _g = no_grad();
        let all = crate::comm_ops::all_gather_along(comm.as_ref(), &local.contiguous()?, dim)?; // tp pieces along dim
        if s.replicas == 1 {
            return Ok(all);
        }
        let n = local.dim(dim);
        let pieces: Vec<Tensor> = (0..s.parts).map(|p| all.narrow(dim, p * s.replicas * n, n)).collect::<Result<_>>()?;
        Tensor::cat(&pieces, dim)
    }

    /// Sum of squares of the gradients of the whole (unsharded) model, the same on every rank:
    /// each rank's pieces are summed over the group, a piece held by several ranks counted once.
    pub fn grad_sq_norm(&self, params: &[(String, Tensor)], comm: &Comm) -> Result<f64> {
        let _g = no_grad();
        let mut local = 0.0f64;
        let mut replicated = 0.0f64;
        for (name, p) in params {
            let Some(g) = p.grad() else { continue };
            let s = self.params.get(name).ok_or_else(|| Error::new("grad_sq_norm", format!("unknown parameter {name}")))?;
            let sq = g.to_dtype(DType::F32)?.sqr()?.sum_all()?.item()?;
            if s.dim.is_none() {
                replicated += sq; // identical on every rank
            } else {
                local += sq / s.replicas as f64;
            }
        }
        let device = params.first().map_or(ferrolm_tensor::Device::Cpu, |(_, p)| p.device());
        Ok(crate::comm::all_reduce_scalar(comm.as_ref(), local, device)? + replicated)
    }
}
