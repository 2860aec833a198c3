//! The replaceable parts of a model. A model holds its parameters as plain tensors (so one
//! visitor can name, load, save, shard or re-home them) beside the *op* that applies each one.
//! A parallel plan swaps the op (and the tensor for its local shard) from outside; the model
//! file never learns how it is parallelised. Activation checkpointing attaches the same way,
//! through a [`BranchHook`].
use crate::lora::Adapter;
use crate::spec::TpRole;
use ferrolm_ops::{HeadLossOptions, LossChunks, LossScale, Tokens};
use ferrolm_tensor::{DType, Result, Tensor};
use std::sync::Arc;

/// What kind of parameter a tensor is: the optimizer takes weight-decay groups from this,
/// not from name matching.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParamKind {
    /// A projection matrix: decayed.
    Matrix,
    /// A token embedding: not decayed.
    Embedding,
    /// An RMSNorm gain: not decayed, initialised to ones.
    Norm,
    /// A linear layer's bias: not decayed, initialised to zeros.
    Bias,
}

impl ParamKind {
    pub fn weight_decay(self) -> bool {
        self == ParamKind::Matrix
    }
}

/// One parameter as the visitor sees it (`crate::spec::ParamSpec::info`): its fully qualified
/// Hugging Face name, the full (unsharded) shape the config implies, its kind, and where tensor
/// parallelism puts it.
#[derive(Clone, Debug)]
pub struct ParamInfo<'a> {
    pub name: &'a str,
    pub shape: &'a [usize],
    pub kind: ParamKind,
    pub role: TpRole,
    /// The split dimension's indivisible pieces (`ParamSpec::units`).
    pub units: usize,
}

/// Visitor over `(ParamInfo, parameter)`. It may replace the tensor (with a loaded one, a
/// shard, a view into a flat store).
pub type ParamVisitor<'a> = dyn FnMut(&ParamInfo, &mut Tensor) -> Result<()> + 'a;

/// y = x W^T over the last dim of x: (..., in) -> (..., out), W (out, in) (`Tensor::linear`:
/// one GEMM forward; backward sums dX into x's gradient and writes dW where W's gradient goes).
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.linear(w)
}

/// (res +) x W^T + s · u B^T, LoRA's adapted linear layer (`crate::lora`), as one recorded op:
/// x (..., in), W (out, in), u (..., R) the adapter's down-projection (or its (N, R) rows), B
/// (out, R) of any float dtype (the f32 factor itself: cast once here to x's dtype for the
/// GEMMs), s its scale. The two GEMMs sum through their addends (no add kernel), s is the
/// up-projection GEMM's own scale (its alpha: no kernel, no scaled copy of a factor), and the
/// graph holds only what backward reads (x, W, u, B in x's dtype; res for its gradient): not
/// the base's (..., out) product that `u.linear_plus(b, &x.linear(w))` would keep as an input.
/// So an adapted layer saves for backward what a plain one does, plus u and the cast B.
/// Backward: dX = G W (summed into x's gradient so far), dU = s G B (likewise), dB = s G^T u
/// and dW = G^T x (where their gradients go: dB written in f32 by its GEMM straight into the
/// factor's gradient destination), dres = G.
pub fn linear_adapted(x: &Tensor, w: &Tensor, u: &Tensor, b: &Tensor, scale: f64, res: Option<&Tensor>) -> Result<Tensor> {
    adapted(x, BaseWeight::Input(w), u, b, scale, res)
}

/// Materialises a frozen base weight (out, in) in the given dtype, for one GEMM.
pub type WeightFn = Arc<dyn Fn(ferrolm_tensor::DType) -> Result<Tensor> + Send + Sync>;

/// The base weight W of an adapted linear layer ([`adapted`]).
pub enum BaseWeight<'a> {
    /// A tensor the op takes as an input (dense LoRA): it gets a gradient if it requires one.
    Input(&'a Tensor),
    /// A frozen weight that is no tensor of the graph (QLoRA's 4-bit base): `get` makes it in
    /// x's dtype for the forward's GEMM and again for the backward's dX, and each copy is
    /// dropped after its GEMM, so the graph never holds it. `name` is the layer's, for errors.
    Frozen { name: &'a str, out_features: usize, in_features: usize, get: WeightFn },
}

/// [`linear_adapted`] over any [`BaseWeight`], recorded as the op `op`: the one adapted forward
/// and backward that dense LoRA and QLoRA share. The gradients land through `GradCtx`'s helpers
/// (dX and dU summed into what their inputs have, dW and dB where their gradients go).
pub fn adapted(x: &Tensor, w: BaseWeight<'_>, u: &Tensor, b: &Tensor, scale: f64, res: Option<&Tensor>) -> Result<Tensor> {
    let r = x.rank();
    let (what, cout, cin) = match &w {
        BaseWeight::Input(t) if t.rank() == 2 => ("linear_adapted", t.dim(0), t.dim(1)),
        BaseWeight::Input(t) => ferrolm_tensor::bail!("linear_adapted", "expects w (out, in), got {:?}", t.shape()),
        BaseWeight::Frozen { name, out_features, in_features, .. } => (*name, *out_features, *in_features),
    };
    if b.rank() != 2 || r == 0 || u.rank() == 0 || x.dim(r - 1) != cin || b.dim(0) != cout {
        ferrolm_tensor::bail!(
            "linear_adapted",
            "{what}: expects x (..., {cin}), w ({cout}, {cin}), u (..., R) or (N, R), b ({cout}, R), got {:?}, {:?}, {:?}",
            x.shape(),
            u.shape(),
            b.shape()
        );
    }
    let (rank, n) = (b.dim(1), x.dims()[..r - 1].iter().product::<usize>());
    // u as x's rows (..., R), or as their (N, R) matrix: a shared down-projection's columns, a
    // view the GEMMs read in place (reshaping it would copy).
    let rows_match = (u.rank() == r && u.dims()[..r - 1] == x.dims()[..r - 1]) || (u.rank() == 2 && u.dim(0) == n);
    if !rows_match || u.dim(u.rank() - 1) != rank {
        ferrolm_tensor::bail!("linear_adapted", "{what}: u {:?} does not match x {:?} and b {:?}", u.shape(), x.shape(), b.shape());
    }
    let mut out = x.dims()[..r - 1].to_vec();
    out.push(cout);
    let dtype = x.dtype();
    // W for a GEMM: the input itself, or a frozen weight made for it and dropped after.
    let weight: WeightFn = match &w {
        BaseWeight::Input(t) => {
            let t = (*t).clone();
            Arc::new(move |_| Ok(t.clone()))
        }
        BaseWeight::Frozen { get, .. } => get.clone(),
    };
    let (y, bx) = {
        let _g = ferrolm_tensor::no_grad();
        // B in x's dtype for the GEMMs, forward and backward (one cast of the f32 factor).
        let bx = b.to_dtype(dtype)?;
        let acc = res.map(|t| t.reshape([n, cout])).transpose()?;
        let base = x.reshape([n, cin])?.matmul_into(&weight(dtype)?.t()?, acc.as_ref(), None)?;
        let y = u.reshape([n, rank])?.matmul_into_scaled(&bx.t()?, scale, Some(&base), None)?.reshape(out)?;
        (y, bx)
    };
    // The inputs: x, W if it is one, u, B, res if given.
    let mut inputs = vec![x];
    let iw = match &w {
        BaseWeight::Input(t) => {
            inputs.push(t);
            Some(1)
        }
        BaseWeight::Frozen { .. } => None,
    };
    let (iu, ib) = (inputs.len(), inputs.len() + 1);
    inputs.extend([u, b]);
    let ires = res.map(|t| {
        inputs.push(t);
        inputs.len() - 1
    });
    let need: Vec<bool> = inputs.iter().map(|t| t.requires_grad()).collect();
    let (xc, uc, bc, b_dtype) = (x.clone(), u.clone(), bx, b.dtype());
    Ok(Tensor::from_op_ctx(
        y,
        if iw.is_some() { "linear_adapted" } else { "quant_linear_adapted" },
        &inputs,
        Box::new(move |g, ctx| {
            let g2 = g.reshape([n, cout])?;
            let mut grads: Vec<Option<Tensor>> = vec![None; need.len()];
            // d(input) += alpha G F (the GEMM's addend: what it has so far), for input `i` whose
            // factor is F.
            let mut dinput = |i: usize, t: &Tensor, alpha: f64, f: &dyn Fn() -> Result<Tensor>| -> Result<Option<Tensor>> {
                if !need[i] {
                    return Ok(None);
                }
                let gi = ctx.accumulate_into(i, |acc| {
                    let acc = acc.map(|a| a.reshape([n, t.dim(t.rank() - 1)])).transpose()?;
                    g2.matmul_into_scaled(&f()?, alpha, acc.as_ref(), None)?.reshape(t.shape().clone())
                })?;
                Ok(Some(gi))
            };
            grads[0] = dinput(0, &xc, 1.0, &|| weight(dtype))?;
            grads[iu] = dinput(iu, &uc, scale, &|| Ok(bc.clone()))?;
            // d(factor) = alpha G^T t, written where the factor's gradient goes (else handed
            // over in `as_dtype`, the factor's own).
            let mut dfactor = |i: usize, alpha: f64, as_dtype: Option<DType>, t: &dyn Fn() -> Result<Tensor>| -> Result<Option<Tensor>> {
                if !need[i] {
                    return Ok(None);
                }
                let d = ctx.param_dest(i, |_| true)?;
                let v = g2.t()?.matmul_into_scaled(&t()?, alpha, None, d.fused())?;
                Ok(Some(d.land_as(v, as_dtype)?))
            };
            if let Some(iw) = iw {
                grads[iw] = dfactor(iw, 1.0, None, &|| xc.reshape([n, cin]))?;
            }
            grads[ib] = dfactor(ib, scale, Some(b_dtype), &|| uc.reshape([n, rank]))?;
            if let Some(i) = ires.filter(|&i| need[i]) {
                grads[i] = Some(g.clone());
            }
            Ok(grads)
        }),
    ))
}

/// Which factor of a LoRA adapter (`crate::lora`): A (R, in), the down-projection, or B
/// (out, R), the up-projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Factor {
    A,
    B,
}

/// How a linear layer applies its weight. `Dense` is the single-device op; tensor parallelism
/// supplies column- and row-parallel ones.
///
/// A layer with a LoRA adapter (`crate::lora`; its weight frozen) computes
/// `x W^T + u B^T` with `u = dropout(x') (s A)^T`; the three `adapter_*` hooks say where a
/// parallel op puts the adapter's pieces. Their defaults are the single-device ones.
pub trait LinearOp: Send + Sync {
    fn forward(&self, x: &Tensor, weight: &Tensor) -> Result<Tensor>;
    /// res + forward(x, weight): a residual connection. The default adds after the op (a
    /// tensor-parallel output is summed over the ranks first); `Dense` adds in the GEMM.
    fn forward_plus(&self, x: &Tensor, weight: &Tensor, res: &Tensor) -> Result<Tensor> {
        res.add(&self.forward(x, weight)?)
    }
    /// x', the tensor the adapter's A reads in place of x (column-parallel: Megatron's `f` of x,
    /// the one the base GEMM reads, so both input gradients are all-reduced together). Layers
    /// that read one x (q, k and v; gate and up) must answer the same tensor for it.
    fn adapter_input(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.clone())
    }
    /// A factor as this rank applies it: one that every rank of a group holds whole
    /// (column-parallel: A; row-parallel: B) gets its gradient summed over that group, as
    /// Megatron sums a replicated weight's.
    fn adapter_factor(&self, f: &Tensor, _which: Factor) -> Result<Tensor> {
        Ok(f.clone())
    }
    /// (res +) x W^T + s · u B^T for the frozen W, u (..., R) the adapter's down-projection, b
    /// its up-projection as `adapter_factor` gave it and s its scale. The default is [`linear_adapted`]; a
    /// row-parallel op adds u B^T to its partial sum before the all-reduce.
    fn forward_adapted(&self, x: &Tensor, weight: &Tensor, u: &Tensor, b: &Tensor, scale: f64, res: Option<&Tensor>) -> Result<Tensor> {
        linear_adapted(x, weight, u, b, scale, res)
    }
    /// The layer's bias as this rank adds it to the op's output (after a row-parallel op's
    /// reduction, so once). A column-parallel op whose weight piece several ranks hold
    /// (replicated key/value heads) sums the bias's gradient over them, as the weight's.
    fn bias(&self, b: &Tensor) -> Result<Tensor> {
        Ok(b.clone())
    }
    /// A parameter every rank holds whole that acts on this layer's output heads (Qwen3's
    /// q/k norm over head_dim), as this rank applies it: where the heads are split over ranks
    /// (column-parallel), each rank's gradient covers its heads only and is summed over them.
    fn per_head(&self, w: &Tensor) -> Result<Tensor> {
        Ok(w.clone())
    }
    /// The 4-bit weight this op applies in place of the layer's (QLoRA's `QuantOp`), if any.
    fn quantized(&self) -> Option<&crate::quant_linear::QuantLinear> {
        None
    }
}

/// How an embedding looks its rows up (dense, or vocabulary-parallel). Ids that carry their
/// host copy are checked (and, vocabulary-parallel, split) on the host, never read back.
pub trait EmbeddingOp: Send + Sync {
    /// i32 ids (B, T) -> (B, T, C)
    fn forward(&self, ids: &Tokens, weight: &Tensor) -> Result<Tensor>;
}

/// What a model asks its head's loss for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HeadLoss {
    /// The target of tokens that are not trained (transformers' -100).
    pub ignore_index: i32,
    /// The mean over the batch's trained tokens, or their sum times the step's factor.
    pub scale: LossScale,
    /// Fused and chunked (the default, or a chunk size), or unfused (`--loss-chunk-tokens 0`).
    pub chunks: LossChunks,
}

impl HeadLoss {
    /// The options of the fused op for a batch of `tokens` against `vocab` logits a token
    /// (this rank's) of `elem_bytes` each; `None` when unfused.
    pub fn fused(&self, tokens: usize, vocab: usize, elem_bytes: usize) -> Option<HeadLossOptions> {
        let chunk_tokens = self.chunks.chunk_tokens(tokens, vocab, elem_bytes)?;
        Some(HeadLossOptions { ignore_index: self.ignore_index, scale: self.scale, chunk_tokens })
    }

    /// The factor that turns the unfused path's mean over `counted` trained tokens into the
    /// loss asked for.
    pub fn factor_of_mean(&self, counted: usize) -> f64 {
        match self.scale {
            LossScale::Mean => 1.0,
            LossScale::Sum(s) => s * counted as f64,
        }
    }
}

/// How the output head turns the final hidden states into logits and the loss.
pub trait HeadOp: Send + Sync {
    /// Full logits (B, T, V) from hidden states (B, T, C).
    fn logits(&self, x: &Tensor, weight: &Tensor) -> Result<Tensor>;
    /// Cross-entropy of the logits of x against aligned i32 targets (B, T), `o.ignore_index`
    /// skipped, scaled as `o.scale` says; the logits never whole unless `o.chunks` is unfused
    /// (`ferrolm_ops::head_loss`). The loss stays on the device; targets with their host copy
    /// are checked and counted there.
    fn loss(&self, x: &Tensor, weight: &Tensor, targets: &Tokens, o: &HeadLoss) -> Result<Tensor>;
    /// Each token's log-prob of its target (one per element of `targets`, flattened; 0 where
    /// `o.ignore_index`), differentiable with a per-token upstream gradient
    /// (`ferrolm_ops::head_logprobs`); chunked as `o.chunks` says (unfused: one chunk of every
    /// token). `o.scale` is not used. A head that has no per-row form says so.
    fn logprobs(&self, x: &Tensor, weight: &Tensor, targets: &Tokens, o: &HeadLoss) -> Result<Tensor> {
        let _ = (x, weight, targets, o);
        Err(ferrolm_tensor::Error::new("HeadOp::logprobs", "this head has no per-token log-probs"))
    }
}

impl HeadLoss {
    /// The per-row head's options for `tokens` rows against `vocab` logits a token of
    /// `elem_bytes` each: unfused is one chunk of every token.
    pub fn rows(&self, tokens: usize, vocab: usize, elem_bytes: usize) -> ferrolm_ops::HeadRowsOptions {
        let chunk_tokens = self.chunks.chunk_tokens(tokens, vocab, elem_bytes).unwrap_or(tokens).max(1);
        ferrolm_ops::HeadRowsOptions { ignore_index: self.ignore_index, chunk_tokens }
    }
}

/// The single-device ops.
pub struct Dense;

impl LinearOp for Dense {
    fn forward(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        linear(x, w)
    }
    fn forward_plus(&self, x: &Tensor, w: &Tensor, res: &Tensor) -> Result<Tensor> {
        x.linear_plus(w, res)
    }
}

impl EmbeddingOp for Dense {
    fn forward(&self, ids: &Tokens, w: &Tensor) -> Result<Tensor> {
        ferrolm_ops::embedding_tokens(ids, w)
    }
}

impl HeadOp for Dense {
    fn logits(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        linear(x, w)
    }
    fn loss(&self, x: &Tensor, w: &Tensor, targets: &Tokens, o: &HeadLoss) -> Result<Tensor> {
        let n = targets.tensor().numel();
        if let Some(f) = o.fused(n, w.dim(0), w.dtype().size_in_bytes()) {
            return ferrolm_ops::head_loss(x, w, targets, &f);
        }
        let logits = linear(x, w)?; // (B, T, V)
        let v = logits.dim(logits.rank() - 1);
        let mean = ferrolm_ops::cross_entropy_tokens(&logits.reshape(vec![n, v])?, &targets.reshape(vec![n])?, o.ignore_index)?;
        match o.scale {
            LossScale::Mean => Ok(mean),
            LossScale::Sum(_) => {
                let counted = ferrolm_ops::tokens::count_targets(&targets.host_ids()?, v, o.ignore_index)?;
                mean.mul_scalar(o.factor_of_mean(counted))
            }
        }
    }
    fn logprobs(&self, x: &Tensor, w: &Tensor, targets: &Tokens, o: &HeadLoss) -> Result<Tensor> {
        let n = targets.tensor().numel();
        ferrolm_ops::head_logprobs(x, w, &targets.reshape(vec![n])?, &o.rows(n, w.dim(0), w.dtype().size_in_bytes()))
    }
}

/// A weight, its bias if it has one, the op that applies them and, under LoRA, its adapter
/// (cheap to clone: all are shared handles).
#[derive(Clone)]
pub struct Linear {
    pub weight: Tensor,
    /// (out): added to the op's output (Qwen2's q/k/v; `attention_bias`, `mlp_bias`). Under
    /// LoRA it stays frozen in the base, as PEFT keeps it.
    pub bias: Option<Tensor>,
    pub op: Arc<dyn LinearOp>,
    /// A LoRA adapter (`crate::lora`): the weight is then frozen.
    pub adapter: Option<Adapter>,
}

impl Linear {
    pub fn new(weight: Tensor) -> Self {
        Linear { weight, bias: None, op: Arc::new(Dense), adapter: None }
    }
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = match &self.adapter {
            Some(_) if crate::lora::adapters_enabled() => crate::lora::project(x, &[self], None)?.remove(0),
            _ => self.op.forward(x, &self.weight)?,
        };
        self.plus_bias(y)
    }
    /// res + forward(x) (see `LinearOp::forward_plus`).
    pub fn forward_plus(&self, x: &Tensor, res: &Tensor) -> Result<Tensor> {
        let y = match &self.adapter {
            Some(_) if crate::lora::adapters_enabled() => crate::lora::project(x, &[self], Some(res))?.remove(0),
            _ => self.op.forward_plus(x, &self.weight, res)?,
        };
        self.plus_bias(y)
    }
    /// y + bias over the leading dims (`ferrolm_ops::bias_add`: one launch, db a deterministic
    /// column sum), or y itself for a layer without one: no launch is added where there is no bias.
    fn plus_bias(&self, y: Tensor) -> Result<Tensor> {
        match &self.bias {
            None => Ok(y),
            Some(b) => ferrolm_ops::bias_add(&y, &self.op.bias(b)?),
        }
    }
}

/// x through several linear layers that all read it (q, k and v; gate and up), in order. With
/// LoRA adapters, their down-projections share one GEMM (`crate::lora::project`).
pub fn project<const N: usize>(x: &Tensor, layers: [&Linear; N]) -> Result<[Tensor; N]> {
    let out = match layers.iter().any(|l| l.adapter.is_some()) && crate::lora::adapters_enabled() {
        false => layers.iter().map(|l| l.forward(x)).collect::<Result<Vec<_>>>()?,
        true => {
            crate::lora::project(x, &layers, None)?.into_iter().zip(&layers).map(|(y, l)| l.plus_bias(y)).collect::<Result<Vec<_>>>()?
        }
    };
    out.try_into().map_err(|_| ferrolm_tensor::Error::new("project", "one output per layer"))
}

#[derive(Clone)]
pub struct Embedding {
    pub weight: Tensor,
    pub op: Arc<dyn EmbeddingOp>,
}

impl Embedding {
    pub fn new(weight: Tensor) -> Self {
        Embedding { weight, op: Arc::new(Dense) }
    }
    /// `ids`: a `&Tensor` (checked on the device) or `&Tokens`.
    pub fn forward(&self, ids: impl Into<Tokens>) -> Result<Tensor> {
        self.op.forward(&ids.into(), &self.weight)
    }
}

/// A residual branch as a value: hidden states in, the branch output out (for a standard
/// block, the hidden states plus it: the sum is made in the branch's last GEMM).
pub type BranchFn = Arc<dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync>;

/// Runs a residual branch of block `layer`. The default calls it; activation checkpointing
/// (see `remat`) recomputes it in backward instead of keeping its activations.
pub trait BranchHook: Send + Sync {
    fn call(&self, layer: usize, branch: BranchFn, x: &Tensor) -> Result<Tensor>;
}
