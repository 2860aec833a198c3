//! LLaMA (Touvron et al. 2023) exactly as transformers' `LlamaForCausalLM` computes it (and, with
//! the block features their configs turn on, `Qwen2ForCausalLM`, `Qwen3ForCausalLM` and
//! `MistralForCausalLM`: q/k/v/o/MLP biases, per-head q/k RMSNorm; see docs/MODELS.md), and the
//! Ladder Transformer (Ladder Residual, arXiv 2501.06589) as a residual schedule over the same
//! blocks: token embedding, N pre-norm blocks of an attention branch (RMSNorm -> GQA attention
//! with RoPE) and an MLP branch (RMSNorm -> SwiGLU), a final RMSNorm and the LM head (tied or
//! not).
//!
//! Weights use transformers' names and layout ([out, in]: y = x W^T), so checkpoints move both
//! ways. Shapes: B batch, T time, C hidden, H query heads, KV key/value heads, D head_dim,
//! I intermediate, V vocab. Head counts come from the weights' shapes, so a tensor-parallel
//! plan that shards them needs no special case here. Parallelism and activation checkpointing
//! attach from outside (`module.rs`); this file never sees them.
use crate::config::{LadderLayers, LlamaConfig};
use crate::kv_cache::KvCache;
use crate::lora::LoraState;
use crate::module::{project, BranchFn, BranchHook, Embedding, HeadOp, Linear, ParamInfo, ParamKind, ParamVisitor};
use crate::rope::Rope;
use crate::safetensors_io::{self, TensorMap};
use crate::spec::ParamSpec;
use ferrolm_ops::{
    causal_attention, causal_attention_window, geglu, rms_norm_offset, rope, rope_at, segment_attention, segment_attention_window,
    softmax_last, swiglu, LossChunks, LossScale, Segments, Tokens,
};
use ferrolm_tensor::{no_grad, DType, Device, Error, Result, Rng, Tensor};
use std::path::Path;
use std::sync::Arc;

/// The attention branch: RMSNorm, then causal GQA attention with RoPE. The family's features
/// (`LlamaConfig::qkv_bias`, `o_bias`, `qk_norm`) are the projections' biases and the
/// per-head q/k norms; a Llama has none of them.
#[derive(Clone)]
pub struct Attention {
    pub input_layernorm: Tensor, // (C)
    pub q_proj: Linear,          // (H*D, C)
    pub k_proj: Linear,          // (KV*D, C)
    pub v_proj: Linear,          // (KV*D, C)
    pub o_proj: Linear,          // (C, H*D)
    /// Qwen3: RMSNorm of each query head over D, before RoPE.
    pub q_norm: Option<Tensor>, // (D)
    /// Qwen3: RMSNorm of each key head over D, before RoPE.
    pub k_norm: Option<Tensor>, // (D)
    /// The sandwich (Gemma 3's `post_attention_layernorm`): the branch output normed before
    /// the residual add.
    pub post_norm: Option<Tensor>, // (C)
    /// This layer's sliding window (`LlamaConfig::layer_windows`): position i attends to j
    /// with i - window < j <= i. `None`: full causal attention (Llama, full layers).
    window: Option<usize>,
    head_dim: usize,
    eps: f64,
    /// Every norm's weight offset (Gemma: 1, x · (1 + w)).
    norm_offset: f64,
    /// The softmax scale (1/sqrt(D), or Gemma's query_pre_attn_scalar^-0.5).
    scale: f64,
    /// RoPE from the layer's own tables (`Positions::local`: Gemma's sliding layers).
    local_rope: bool,
}

/// The MLP branch: RMSNorm, then SwiGLU (or Gemma's GeGLU).
#[derive(Clone)]
pub struct Mlp {
    /// The MLP's input norm (named `pre_feedforward_layernorm` in a sandwich block).
    pub post_attention_layernorm: Tensor, // (C)
    pub gate_proj: Linear, // (I, C)
    pub up_proj: Linear,   // (I, C)
    pub down_proj: Linear, // (C, I)
    /// The sandwich (Gemma 3's `post_feedforward_layernorm`): the output normed before the add.
    pub post_norm: Option<Tensor>, // (C)
    eps: f64,
    norm_offset: f64,
    /// gelu_tanh(gate) · up in place of silu(gate) · up.
    geglu: bool,
}

#[derive(Clone)]
pub struct Block {
    pub self_attn: Attention,
    pub mlp: Mlp,
    /// A Ladder block: each branch reads the stream without the previous branch's output.
    pub ladder: bool,
}

impl Block {
    /// The block's tensors in the order of its specs (`spec::layer_specs`, which names them).
    fn params_mut(&mut self) -> Vec<&mut Tensor> {
        let (a, m) = (&mut self.self_attn, &mut self.mlp);
        let mut out = Vec::new();
        for lin in [&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.o_proj] {
            out.push(&mut lin.weight);
            out.extend(lin.bias.as_mut());
        }
        out.extend(a.q_norm.as_mut());
        out.extend(a.k_norm.as_mut());
        for lin in [&mut m.gate_proj, &mut m.up_proj, &mut m.down_proj] {
            out.push(&mut lin.weight);
            out.extend(lin.bias.as_mut());
        }
        out.push(&mut a.input_layernorm);
        // The sandwich: post_attention_layernorm is the attention output's norm, and the MLP's
        // input norm is pre_feedforward_layernorm.
        if let Some(pa) = a.post_norm.as_mut() {
            out.push(pa);
        }
        out.push(&mut m.post_attention_layernorm);
        out.extend(m.post_norm.as_mut());
        out
    }

    /// The linear layers in the order of `LlamaConfig::linear_specs`.
    pub fn linears_mut(&mut self) -> [&mut Linear; 7] {
        let (a, m) = (&mut self.self_attn, &mut self.mlp);
        [&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.o_proj, &mut m.gate_proj, &mut m.up_proj, &mut m.down_proj]
    }
}

/// Rotary tables for the positions of one call.
#[derive(Clone)]
struct Positions {
    cos: Tensor, // (T, D); packed: (P, D), indexed by the packing's positions
    sin: Tensor, // likewise
    /// The (cos, sin) of layers with their own RoPE theta (Gemma's sliding layers), alike.
    local: Option<(Tensor, Tensor)>,
    past: usize,
    packed: Option<Packing>,
}

/// Rows packed with several sequences (conversations, documents) one after another: each
/// token's RoPE position, restarting at 0 in each sequence, and each row's segment boundaries
/// (cumulative lengths, FlashAttention varlen's cu_seqlens per row). Attention never crosses
/// a boundary, so each sequence is computed as if it were alone in its row.
#[derive(Clone, Debug)]
pub struct Packing {
    positions: Tokens, // (B, T) i32
    segments: Segments,
    max_position: usize,
}

impl Packing {
    /// Rows of `t` tokens: `positions` (b * t, row-major) and one `cu_seqlens` per row, `[0, l1,
    /// l1 + l2, ..., t]`; the positions are uploaded to `device` once.
    pub fn new(t: usize, positions: &[u32], cu_seqlens: Vec<Vec<u32>>, device: Device) -> Result<Packing> {
        let segments = Segments::new(t, cu_seqlens)?;
        let b = segments.rows();
        if positions.len() != b * t {
            return Err(Error::new("Packing", format!("{} positions for {b} rows of {t} tokens", positions.len())));
        }
        let max_position = positions.iter().copied().max().unwrap_or(0) as usize;
        if max_position > i32::MAX as usize {
            return Err(Error::new("Packing", format!("position {max_position} is out of range")));
        }
        let positions = Tokens::upload(positions.iter().map(|&p| p as i32).collect(), vec![b, t], device)?;
        Ok(Packing { positions, segments, max_position })
    }

    /// Each token's position (B, T).
    pub fn positions(&self) -> &Tokens {
        &self.positions
    }

    pub fn segments(&self) -> &Segments {
        &self.segments
    }
}

/// (B, T, heads*D) -> (B, heads, T, D)
fn split_heads(x: &Tensor, d: usize) -> Result<Tensor> {
    let (b, t, hd) = (x.dim(0), x.dim(1), x.dim(2));
    x.reshape(vec![b, t, hd / d, d])?.permute(&[0, 2, 1, 3])
}

/// (B, T, heads*D) -> (B, heads, T, D), each head RMS-normed over D first when `norm` is given
/// (QK-norm: the norm acts on the (B, T, heads, D) view, as transformers' `q_norm` does).
fn split_heads_normed(x: &Tensor, d: usize, norm: Option<&Tensor>, eps: f64, offset: f64) -> Result<Tensor> {
    let Some(w) = norm else { return split_heads(x, d) };
    let (b, t, hd) = (x.dim(0), x.dim(1), x.dim(2));
    rms_norm_offset(&x.reshape(vec![b, t, hd / d, d])?, w, eps, offset)?.permute(&[0, 2, 1, 3])
}

/// y, normed by the sandwich's post-norm when there is one, plus the stream x with `residual`.
fn finish_branch(y: Tensor, x: &Tensor, post: Option<&Tensor>, eps: f64, offset: f64, residual: bool) -> Result<Tensor> {
    let y = match post {
        Some(w) => rms_norm_offset(&y, w, eps, offset)?,
        None => y,
    };
    match residual {
        true => x.add(&y),
        false => Ok(y),
    }
}

/// (B, heads, T, D) -> (B, T, heads*D)
fn merge_heads(x: &Tensor) -> Result<Tensor> {
    let (b, h, t, d) = (x.dim(0), x.dim(1), x.dim(2), x.dim(3));
    x.permute(&[0, 2, 1, 3])?.reshape(vec![b, t, h * d])
}

impl Attention {
    /// Branch output (B, T, C) for the stream x (B, T, C), or with `residual` x plus it (added
    /// in the output projection's GEMM). With a cache, attends over the cached keys/values too
    /// and appends this call's.
    fn forward(&self, x: &Tensor, pos: &Positions, cache: Option<&mut Option<(Tensor, Tensor)>>, residual: bool) -> Result<Tensor> {
        let h = rms_norm_offset(x, &self.input_layernorm, self.eps, self.norm_offset)?;
        let d = self.head_dim;
        let (cos, sin) = match (&pos.local, self.local_rope) {
            (Some((c, s)), true) => (c, s),
            _ => (&pos.cos, &pos.sin),
        };
        let rotate = |x: &Tensor| match &pos.packed {
            None => rope(x, cos, sin),
            Some(p) => rope_at(x, cos, sin, &p.positions),
        };
        let [q, k, v] = project(&h, [&self.q_proj, &self.k_proj, &self.v_proj])?;
        let qn = self.q_norm.as_ref().map(|w| self.q_proj.op.per_head(w)).transpose()?;
        let kn = self.k_norm.as_ref().map(|w| self.k_proj.op.per_head(w)).transpose()?;
        let q = rotate(&split_heads_normed(&q, d, qn.as_ref(), self.eps, self.norm_offset)?)?; // (B, H, T, D)
        let k = rotate(&split_heads_normed(&k, d, kn.as_ref(), self.eps, self.norm_offset)?)?; // (B, KV, T, D)
        let v = split_heads(&v, d)?; // (B, KV, T, D)
        let scale = self.scale;
        let y = match (cache, &pos.packed, self.window) {
            (None, None, None) => causal_attention(&q, &k, &v, scale)?, // (B, H, T, D), GQA native
            (None, None, w) => causal_attention_window(&q, &k, &v, scale, w)?, // a sliding layer
            (None, Some(p), None) => segment_attention(&q, &k, &v, scale, &p.segments)?, // inside each sequence
            (None, Some(p), w) => segment_attention_window(&q, &k, &v, scale, &p.segments, w)?, // window inside each one
            // Every key stays cached; the window masks (what transformers' sliding cache layer,
            // which drops keys no query can see any more, computes too).
            (Some(kv), _, window) => {
                let (k, v) = match kv.take() {
                    Some((pk, pv)) => (Tensor::cat(&[pk, k], 2)?, Tensor::cat(&[pv, v], 2)?), // (B, KV, past+T, D)
                    None => (k, v),
                };
                *kv = Some((k.clone(), v.clone()));
                cached_attention(&q, &k, &v, pos.past, scale, window)?
            }
        };
        match (residual, &self.post_norm) {
            (true, None) => self.o_proj.forward_plus(&merge_heads(&y)?, x), // (B, T, C)
            (_, post) => finish_branch(self.o_proj.forward(&merge_heads(&y)?)?, x, post.as_ref(), self.eps, self.norm_offset, residual),
        }
    }
}

impl Mlp {
    /// Branch output (B, T, C), or with `residual` x plus it (added in down_proj's GEMM).
    fn forward(&self, x: &Tensor, residual: bool) -> Result<Tensor> {
        let h = rms_norm_offset(x, &self.post_attention_layernorm, self.eps, self.norm_offset)?;
        let [gate, up] = project(&h, [&self.gate_proj, &self.up_proj])?;
        let a = if self.geglu { geglu(&gate, &up)? } else { swiglu(&gate, &up)? }; // (B, T, I)
        match (residual, &self.post_norm) {
            (true, None) => self.down_proj.forward_plus(&a, x), // (B, T, C)
            (_, post) => finish_branch(self.down_proj.forward(&a)?, x, post.as_ref(), self.eps, self.norm_offset, residual),
        }
    }
}

/// Attention of T new queries at positions past..past+T over S = past+T keys, with GQA done by
/// grouping query heads per key/value head (never copying K/V). With a sliding `window` (as
/// `causal_attention_window`), the query at position p sees key j when p - window < j <= p.
fn cached_attention(q: &Tensor, k: &Tensor, v: &Tensor, past: usize, scale: f64, window: Option<usize>) -> Result<Tensor> {
    let (b, h, t, d) = (q.dim(0), q.dim(1), q.dim(2), q.dim(3));
    let (kvh, s) = (k.dim(1), k.dim(2));
    let window = ferrolm_ops::attention::effective_window("attention", window, s)?;
    let g = h / kvh;
    let q = q.contiguous()?.reshape(vec![b, kvh, g * t, d])?; // (B, KV, G*T, D)
    let scores = q.matmul(&k.t()?)?.mul_scalar(scale)?; // (B, KV, G*T, S)
    let sees = move |p: usize, j: usize| j <= p && window.is_none_or(|w| j + w > p);
    let mask: Vec<f32> = (0..g * t).flat_map(|r| (0..s).map(move |j| if sees(past + r % t, j) { 0.0 } else { -1e30 })).collect();
    let mask = Tensor::from_vec(mask, vec![g * t, s], Device::Cpu)?.to_dtype(q.dtype())?.to_device(q.device())?;
    let p = softmax_last(&scores.add(&mask)?)?;
    p.matmul(v)?.reshape(vec![b, h, t, d]) // (B, H, T, D)
}

/// x + a branch output that was held back, if there is one.
fn add_late(x: Tensor, pending: Option<Tensor>) -> Result<Tensor> {
    match pending {
        Some(p) => x.add(&p),
        None => Ok(x),
    }
}

pub struct Llama {
    cfg: LlamaConfig,
    pub embed_tokens: Embedding, // (V, C)
    pub layers: Vec<Block>,
    pub norm: Tensor, // (C)
    /// (V, C); `None` when tied to `embed_tokens`.
    pub lm_head: Option<Tensor>,
    /// How the head computes logits and the loss (dense, or vocabulary-parallel).
    pub head_op: Arc<dyn HeadOp>,
    /// How the head's loss walks the tokens: fused in chunks (the default: the largest chunk
    /// whose logits fit 256 MiB; or a given size), or unfused (`--loss-chunk-tokens`).
    pub loss_chunks: LossChunks,
    /// Runs each residual branch (activation checkpointing replaces it).
    pub branch_hook: Option<Arc<dyn BranchHook>>,
    rope: Arc<Rope>,
    /// The RoPE of layers with their own theta (Gemma's sliding layers), if any.
    rope_local: Option<Arc<Rope>>,
    dtype: DType,
    device: Device,
    /// LoRA (`crate::lora`): the adapters' settings; the base weights are then frozen.
    pub(crate) lora: Option<LoraState>,
    /// QLoRA (`crate::qlora`): the linear layers whose weights are 4-bit (`QuantOp`).
    pub(crate) quant: Option<crate::qlora::QuantBase>,
}

impl Llama {
    // ---- forward: the residual schedule ---------------------------------------------------

    /// The final hidden states (B, T, C), before the final norm.
    ///
    /// Every branch output is added to the residual stream exactly once; `pending` holds one
    /// that is added late. A standard block adds each branch's output as it is made, in the
    /// branch's last GEMM (the stream is its addend: no add kernel), after adding any output
    /// left pending; it holds its MLP output back only when a Ladder block follows, whose
    /// attention reads the stream without it. A Ladder block does not: its attention reads the stream without the previous
    /// MLP's output, which is added only after the attention has been launched, and its MLP
    /// reads the stream without this block's attention output, which is added after the MLP
    /// has been launched. A branch output may be a value still in flight (a tensor-parallel
    /// all-reduce); adding it late is what lets the communication overlap the next branch.
    /// This is exactly the recurrence of the paper's released `LlamaLadderModel`, including
    /// mixed layers and a Ladder layer at position 0.
    fn hidden(&self, ids: &Tokens, pos: &Positions, mut cache: Option<&mut KvCache>) -> Result<Tensor> {
        if let Some(l) = &self.lora {
            l.tick(); // a new forward: fresh adapter dropout masks
        }
        let mut x = self.embed_tokens.forward(ids)?; // (B, T, C)
        if let Some(s) = self.cfg.embed_scale() {
            // transformers' Gemma3TextScaledWordEmbedding: the scale rounded to the weights' dtype.
            let s = Tensor::from_vec(vec![s], vec![1], Device::Cpu)?.to_dtype(self.dtype)?.to_vec_f64()?[0];
            x = x.mul_scalar(s)?;
        }
        let mut pending: Option<Tensor> = None; // a branch output not yet added to x
        for (i, blk) in self.layers.iter().enumerate() {
            let kv = cache.as_deref_mut().map(|c| c.layer(i));
            if blk.ladder {
                let a = self.attention(i, blk, &x, pos, kv, false)?; // reads x without the last MLP output
                x = add_late(x, pending.take())?;
                let m = self.mlp(i, blk, &x, false)?; // reads x without this attention output
                x = x.add(&a)?;
                pending = Some(m);
            } else {
                x = add_late(x, pending.take())?;
                x = self.attention(i, blk, &x, pos, kv, true)?; // x + attention(x)
                                                                // A Ladder block next reads the stream without this MLP's output: held back then.
                match self.layers.get(i + 1).is_some_and(|b| b.ladder) {
                    true => pending = Some(self.mlp(i, blk, &x, false)?),
                    false => x = self.mlp(i, blk, &x, true)?, // x + mlp(x)
                }
            }
        }
        add_late(x, pending)
    }

    /// Block `i`'s attention branch on x, or with `residual` x plus it.
    fn attention(
        &self,
        i: usize,
        blk: &Block,
        x: &Tensor,
        pos: &Positions,
        kv: Option<&mut Option<(Tensor, Tensor)>>,
        residual: bool,
    ) -> Result<Tensor> {
        match (&self.branch_hook, kv) {
            (Some(h), None) => {
                let (a, pos) = (blk.self_attn.clone(), pos.clone());
                h.call(i, Arc::new(move |x: &Tensor| a.forward(x, &pos, None, residual)) as BranchFn, x)
            }
            (_, kv) => blk.self_attn.forward(x, pos, kv, residual),
        }
    }

    /// Block `i`'s MLP branch on x, or with `residual` x plus it.
    fn mlp(&self, i: usize, blk: &Block, x: &Tensor, residual: bool) -> Result<Tensor> {
        match &self.branch_hook {
            Some(h) => {
                let m = blk.mlp.clone();
                h.call(i, Arc::new(move |x: &Tensor| m.forward(x, residual)) as BranchFn, x)
            }
            None => blk.mlp.forward(x, residual),
        }
    }

    /// The final norm (`model.norm`) of the hidden states.
    fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        rms_norm_offset(x, &self.norm, self.cfg.rms_norm_eps, self.cfg.norm_offset())
    }

    /// The head (vocab, hidden): `lm_head`, or the embedding when tied.
    pub fn head_weight(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens.weight)
    }

    fn check_ids(&self, ids: &Tensor, past: usize) -> Result<Positions> {
        if ids.dtype() != DType::I32 || ids.rank() != 2 {
            return Err(Error::new("Llama::forward", format!("ids must be i32 (batch, seq), got {:?} {}", ids.shape(), ids.dtype())));
        }
        let t = ids.dim(1);
        let max = self.cfg.max_position_embeddings;
        if t == 0 || past + t > max {
            return Err(Error::new(
                "Llama::forward",
                format!("sequence positions {past}..{} exceed max_position_embeddings {max} (or are empty)", past + t),
            ));
        }
        let (cos, sin) = self.rope.tables(past, t)?;
        let local = self.rope_local.as_ref().map(|r| r.tables(past, t)).transpose()?;
        Ok(Positions { cos, sin, local, past, packed: None })
    }

    /// The rotary tables and packing of a call on ids (B, T): packed rows take each token's
    /// position from `packing`, else positions are 0..T.
    fn positions(&self, ids: &Tensor, packing: Option<&Packing>) -> Result<Positions> {
        let Some(p) = packing else { return self.check_ids(ids, 0) };
        let (rows, t) = (p.segments.rows(), p.segments.seq_len());
        if ids.dtype() != DType::I32 || ids.dims() != [rows, t] {
            return Err(Error::new(
                "Llama::forward",
                format!("ids must be i32 ({rows}, {t}) for a packing of {rows} rows of {t} tokens, got {:?} {}", ids.shape(), ids.dtype()),
            ));
        }
        let max = self.cfg.max_position_embeddings;
        if p.max_position >= max {
            return Err(Error::new("Llama::forward", format!("packed position {} exceeds max_position_embeddings {max}", p.max_position)));
        }
        let (cos, sin) = self.rope.tables(0, p.max_position + 1)?;
        let local = self.rope_local.as_ref().map(|r| r.tables(0, p.max_position + 1)).transpose()?;
        Ok(Positions { cos, sin, local, past: 0, packed: Some(p.clone()) })
    }

    /// Logits (B, T, V) for i32 token ids (B, T): a `&Tensor` (its range checked on the device)
    /// or `&Tokens` (checked on their host copy).
    pub fn forward(&self, ids: impl Into<Tokens>) -> Result<Tensor> {
        self.logits_of(ids.into(), None)
    }

    /// Logits (B, T, V) of packed rows: as `forward`, with each token at its packed position and
    /// attention kept inside each row's segments, so a sequence's logits do not depend on what
    /// else its row holds.
    pub fn forward_packed(&self, ids: impl Into<Tokens>, packing: &Packing) -> Result<Tensor> {
        self.logits_of(ids.into(), Some(packing))
    }

    fn logits_of(&self, ids: Tokens, packing: Option<&Packing>) -> Result<Tensor> {
        let x = self.hidden_states(ids, packing)?;
        self.head_op.logits(&x, self.head_weight())
    }

    /// The final normed hidden states (B, T, C) of ids (B, T), packed rows with a packing: what
    /// the head reads (`CausalLm::hidden_states`).
    pub fn hidden_states(&self, ids: impl Into<Tokens>, packing: Option<&Packing>) -> Result<Tensor> {
        let ids = ids.into();
        let pos = self.positions(ids.tensor(), packing)?;
        self.final_norm(&self.hidden(&ids, &pos, None)?)
    }

    /// Mean cross-entropy (f32 scalar) of `forward(inputs)` against `targets` (B, T) i32, aligned
    /// so that position t predicts targets[t]; -100 is ignored. Ids and targets are `&Tensor`s
    /// (checked and counted on the device: host waits on a GPU) or `&Tokens` uploaded with their
    /// host copy (checked and counted there: the loss is computed without a host wait).
    pub fn loss(&self, inputs: impl Into<Tokens>, targets: impl Into<Tokens>) -> Result<Tensor> {
        self.loss_with(inputs, targets, None, LossScale::Mean)
    }

    /// `loss` of packed rows (`forward_packed`): the mean over the targets that are not -100,
    /// whichever sequence of whichever row they belong to.
    pub fn loss_packed(&self, inputs: impl Into<Tokens>, targets: impl Into<Tokens>, packing: &Packing) -> Result<Tensor> {
        self.loss_with(inputs, targets, Some(packing), LossScale::Mean)
    }

    /// `loss` (or `loss_packed`, with a packing) scaled as `scale` says: the mean over the
    /// trained targets, or their sum times a factor (the optimizer step's 1 / trained tokens, so
    /// that micro-batches and data-parallel ranks of unequal trained counts weigh each token
    /// alike). The head fuses the logits and the cross-entropy chunk by chunk as `loss_chunks`
    /// says.
    pub fn loss_with(
        &self,
        inputs: impl Into<Tokens>,
        targets: impl Into<Tokens>,
        packing: Option<&Packing>,
        scale: LossScale,
    ) -> Result<Tensor> {
        let (ids, tg) = (inputs.into(), targets.into());
        let (inputs, targets) = (ids.tensor(), tg.tensor());
        if targets.dims() != inputs.dims() || targets.dtype() != DType::I32 {
            return Err(Error::new(
                "Llama::loss",
                format!("targets must be i32 of the inputs' shape {:?}, got {:?} {}", inputs.shape(), targets.shape(), targets.dtype()),
            ));
        }
        let pos = self.positions(inputs, packing)?;
        let x = self.final_norm(&self.hidden(&ids, &pos, None)?)?;
        self.head_loss(&x, &tg, scale)
    }

    /// The final normed hidden states (B, T, C) of `inputs` (packed when given a packing): what
    /// an objective (`crate::objective`) turns into a loss through the head.
    pub fn final_hidden(&self, inputs: impl Into<Tokens>, packing: Option<&Packing>) -> Result<Tensor> {
        let ids = inputs.into();
        let pos = self.positions(ids.tensor(), packing)?;
        self.final_norm(&self.hidden(&ids, &pos, None)?)
    }

    /// The head's loss of the final normed hidden states x (B, T, C) against targets (B, T):
    /// the token cross-entropy objective.
    fn head_loss(&self, x: &Tensor, targets: &Tokens, scale: LossScale) -> Result<Tensor> {
        let ce = crate::objective::TokenCrossEntropy { ignore_index: -100, scale, chunks: self.loss_chunks };
        ce.loss(self.head_op.as_ref(), self.head_weight(), x, targets)
    }

    /// Logits (B, T, V) for ids that continue the sequences held in `cache` (generation).
    pub fn forward_with_cache(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let pos = self.check_ids(ids, cache.len())?;
        cache.prepare(self.layers.len(), ids.dim(0))?;
        let x = self.final_norm(&self.hidden(&Tokens::device(ids), &pos, Some(cache))?)?;
        cache.advance(ids.dim(1));
        self.head_op.logits(&x, self.head_weight())
    }

    // ---- parameters: one visitor, in transformers' named_parameters() order ------------------

    /// Calls `f` on every parameter with its spec (`LlamaConfig::param_specs`: transformers'
    /// name, the full shape the config implies, its kind and tensor-parallel role), in
    /// transformers' `named_parameters()` order; `f` may replace the tensor.
    pub fn visit_params_mut(&mut self, f: &mut ParamVisitor) -> Result<()> {
        let specs = self.cfg.param_specs();
        let mut tensors = vec![&mut self.embed_tokens.weight];
        for b in &mut self.layers {
            tensors.extend(b.params_mut());
        }
        tensors.push(&mut self.norm);
        tensors.extend(self.lm_head.as_mut());
        if tensors.len() != specs.len() {
            return Err(Error::new("Llama", format!("{} tensors for {} parameter specs", tensors.len(), specs.len())));
        }
        for (s, t) in specs.iter().zip(tensors) {
            f(&s.info(), t)?;
        }
        Ok(())
    }

    /// Calls `f` on every linear layer LoRA may adapt (`LlamaConfig::linear_specs`), with its
    /// weight's spec: its name, shape, role and PEFT target name.
    pub fn visit_linears_mut(&mut self, f: &mut dyn FnMut(&ParamSpec, &mut Linear) -> Result<()>) -> Result<()> {
        for (l, b) in self.layers.iter_mut().enumerate() {
            for (s, lin) in self.cfg.linear_specs(l).iter().zip(b.linears_mut()) {
                f(s, lin)?;
            }
        }
        Ok(())
    }

    /// The parameters training updates, as `visit_params_mut` gives them: the LoRA adapters
    /// when the model has them (`crate::lora`; the base weights are then frozen), else every
    /// parameter. The engine, its buckets and checkpoints see only these.
    pub fn visit_trainable_mut(&mut self, f: &mut ParamVisitor) -> Result<()> {
        match self.lora.is_some() {
            true => self.visit_adapters_mut(f),
            false => self.visit_params_mut(f),
        }
    }

    /// The trainable parameters (`visit_trainable_mut`) with their names and kinds.
    pub fn trainable_parameters(&self) -> Vec<(String, Tensor, ParamKind)> {
        let mut out = Vec::new();
        let mut m = self.shallow_clone();
        m.visit_trainable_mut(&mut |p, t| {
            out.push((p.name.to_string(), t.clone(), p.kind));
            Ok(())
        })
        .expect("collecting never fails");
        out
    }

    /// Every parameter with transformers' name (tied models have no `lm_head.weight`).
    pub fn parameters(&self) -> Vec<(String, Tensor)> {
        self.named_parameters().into_iter().map(|(n, t, _)| (n, t)).collect()
    }

    /// Every parameter with its name and kind (weight-decay groups come from the kind).
    pub fn named_parameters(&self) -> Vec<(String, Tensor, ParamKind)> {
        let mut out = Vec::new();
        let mut m = self.shallow_clone();
        m.visit_params_mut(&mut |p, t| {
            out.push((p.name.to_string(), t.clone(), p.kind));
            Ok(())
        })
        .expect("collecting never fails");
        out
    }

    /// A second handle on the same parameters (tensors are shared, nothing is copied).
    pub fn shallow_clone(&self) -> Llama {
        Llama {
            cfg: self.cfg.clone(),
            embed_tokens: self.embed_tokens.clone(),
            layers: self.layers.clone(),
            norm: self.norm.clone(),
            lm_head: self.lm_head.clone(),
            head_op: self.head_op.clone(),
            loss_chunks: self.loss_chunks,
            branch_hook: self.branch_hook.clone(),
            rope: self.rope.clone(),
            rope_local: self.rope_local.clone(),
            dtype: self.dtype,
            device: self.device,
            lora: self.lora.clone(),
            quant: self.quant.clone(),
        }
    }

    pub fn num_params(&self) -> usize {
        self.parameters().iter().map(|(_, t)| t.numel()).sum()
    }

    // ---- construction and checkpoints ------------------------------------------------------

    /// The model's structure for `cfg` with every parameter made by `make(info)`.
    fn build(cfg: LlamaConfig, dtype: DType, device: Device, make: &mut dyn FnMut(&ParamInfo) -> Result<Tensor>) -> Result<Self> {
        cfg.validate()?;
        let none = || Tensor::zeros([0], dtype, device);
        // A linear layer, with a bias when the family's feature asks for one.
        let lin = |bias: bool| -> Result<Linear> { Ok(Linear { bias: bias.then(none).transpose()?, ..Linear::new(none()?) }) };
        let (qkv_b, o_b, mlp_b, qk_norm) = (cfg.qkv_bias(), cfg.o_bias(), cfg.mlp_bias, cfg.qk_norm());
        let ladder =
            cfg.ladder_layers.as_ref().map(|l| l.mask(cfg.num_hidden_layers)).unwrap_or_else(|| vec![false; cfg.num_hidden_layers]);
        let (eps, head_dim) = (cfg.rms_norm_eps, cfg.head_dim);
        let (norm_offset, scale, sandwich, geglu) = (cfg.norm_offset(), cfg.attn_scale(), cfg.sandwich_norms(), cfg.geglu());
        let windows = cfg.layer_windows();
        let layers = ladder
            .iter()
            .zip(windows)
            .enumerate()
            .map(|(i, (&ladder, window))| {
                Ok(Block {
                    self_attn: Attention {
                        input_layernorm: none()?,
                        q_proj: lin(qkv_b)?,
                        k_proj: lin(qkv_b)?,
                        v_proj: lin(qkv_b)?,
                        o_proj: lin(o_b)?,
                        q_norm: qk_norm.then(none).transpose()?,
                        k_norm: qk_norm.then(none).transpose()?,
                        post_norm: sandwich.then(none).transpose()?,
                        window,
                        head_dim,
                        eps,
                        norm_offset,
                        scale,
                        local_rope: cfg.layer_rope_theta(i).is_some(),
                    },
                    mlp: Mlp {
                        post_attention_layernorm: none()?,
                        gate_proj: lin(mlp_b)?,
                        up_proj: lin(mlp_b)?,
                        down_proj: lin(mlp_b)?,
                        post_norm: sandwich.then(none).transpose()?,
                        eps,
                        norm_offset,
                        geglu,
                    },
                    ladder,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut m = Llama {
            embed_tokens: Embedding::new(none()?),
            layers,
            norm: none()?,
            lm_head: if cfg.tie_word_embeddings { None } else { Some(none()?) },
            head_op: Arc::new(crate::module::Dense),
            loss_chunks: LossChunks::Auto,
            branch_hook: None,
            rope: Arc::new(Rope::new(&cfg, dtype, device)),
            rope_local: cfg.gemma.as_ref().map(|g| Arc::new(Rope::with_theta(&cfg, g.rope_local_theta, dtype, device))),
            cfg,
            dtype,
            device,
            lora: None,
            quant: None,
        };
        m.visit_params_mut(&mut |p, t| {
            *t = make(p)?;
            t.set_requires_grad(true)?;
            Ok(())
        })?;
        Ok(m)
    }

    /// Fresh model with transformers' init: every matrix N(0, initializer_range), norms 1
    /// (0 for (1 + w) norms: the same identity), biases 0.
    pub fn new(cfg: LlamaConfig, dtype: DType, device: Device, rng: &mut Rng) -> Result<Self> {
        let std = cfg.initializer_range;
        let offset = cfg.norm_offset();
        Self::build(cfg, dtype, device, &mut |p| match p.kind {
            ParamKind::Norm if offset != 0.0 => Tensor::zeros(p.shape.to_vec(), dtype, device),
            ParamKind::Norm => Tensor::ones(p.shape.to_vec(), dtype, device),
            ParamKind::Bias => Tensor::zeros(p.shape.to_vec(), dtype, device),
            _ => Tensor::randn(p.shape.to_vec(), std, dtype, device, rng),
        })
    }

    /// A model of zeros (norms 1) filled on its device, with no work on the host: for measuring
    /// what a shape costs (its memory, its launches), where `new`'s draws on the host would take
    /// longer than the measurement.
    pub fn zeros(cfg: LlamaConfig, dtype: DType, device: Device) -> Result<Self> {
        let offset = cfg.norm_offset();
        Self::build(cfg, dtype, device, &mut |p| match p.kind {
            ParamKind::Norm if offset != 0.0 => Tensor::zeros(p.shape.to_vec(), dtype, device),
            ParamKind::Norm => Tensor::ones(p.shape.to_vec(), dtype, device),
            _ => Tensor::zeros(p.shape.to_vec(), dtype, device),
        })
    }

    /// Builds the model from a name -> tensor map that must hold exactly its parameters with
    /// the config's shapes (`file` names the source in errors).
    pub fn from_tensors(cfg: LlamaConfig, mut tensors: TensorMap, dtype: DType, device: Device, file: &Path) -> Result<Self> {
        let err = |msg: String| Error::new("Llama::from_pretrained", format!("{}: {msg}", file.display()));
        let cfg_arch = cfg.family.architecture();
        // Buffers some older exports include; they are recomputed, never learned.
        tensors.retain(|n, _| !n.ends_with("rotary_emb.inv_freq"));
        if cfg.tie_word_embeddings {
            tensors.remove("lm_head.weight"); // transformers ties it to the embedding too
        }
        let m = Self::build(cfg, dtype, device, &mut |p| {
            let t = tensors.remove(p.name).ok_or_else(|| err(format!("missing tensor `{}` (expected shape {:?})", p.name, p.shape)))?;
            if t.dims() != p.shape {
                return Err(err(format!("tensor `{}` has shape {:?}, but config.json implies {:?}", p.name, t.dims(), p.shape)));
            }
            Ok(t)
        })?;
        if let Some(name) = tensors.keys().next() {
            let arch = cfg_arch;
            return Err(err(format!("unknown tensor `{name}` (not a {arch} parameter for this config)")));
        }
        Ok(m)
    }

    /// Loads a transformers checkpoint directory: `config.json` plus `model.safetensors` (or a
    /// sharded `model.safetensors.index.json`); f32/bf16/f16 weights are converted to `dtype`.
    /// A `llamaLadder` config gives a Ladder model; a plain `llama` one the standard model.
    pub fn from_pretrained(dir: &Path, dtype: DType, device: Device) -> Result<Self> {
        if !dtype.is_float() {
            return Err(Error::new("Llama::from_pretrained", format!("{}: model dtype must be a float type, got {dtype}", dir.display())));
        }
        let cfg = LlamaConfig::from_file(dir.join("config.json"))?;
        // A checkpoint transformers saved 4-bit (`quantization_config`): a 4-bit base, no flag.
        if let Some(ck) = crate::bnb4::read_bnb4_dir(dir)? {
            return Self::from_quantized(cfg, ck, dtype, device, dir, crate::qlora::QuantSource::Checkpoint);
        }
        let single = dir.join("model.safetensors");
        let file = if single.is_file() { single } else { dir.join("model.safetensors.index.json") };
        let tensors = safetensors_io::load_model_dir(dir, dtype, device)?;
        Self::from_tensors(cfg, tensors, dtype, device, &file)
    }

    /// Writes `config.json` and `model.safetensors` (f32) with transformers' names.
    pub fn save_pretrained(&self, dir: &Path) -> Result<()> {
        self.save_pretrained_dtype(dir, DType::F32)
    }

    /// As `save_pretrained`, storing weights as `dtype` (F32 or BF16). Files are written
    /// atomically (temp file, then rename).
    pub fn save_pretrained_dtype(&self, dir: &Path, dtype: DType) -> Result<()> {
        let hf = match dtype {
            DType::F32 => "float32",
            DType::BF16 => "bfloat16",
            other => return Err(Error::new("Llama::save_pretrained", format!("cannot save weights as {other}: use f32 or bf16"))),
        };
        if let Some(q) = &self.quant {
            return Err(Error::new(
                "Llama::save_pretrained",
                format!(
                    "the base's {} linear weights are 4-bit ({}): save its adapters, or dequantize the base first",
                    q.weights,
                    q.quant_type.name()
                ),
            ));
        }
        let path = safetensors_io::prepare_dir(dir, "model.safetensors")?;
        safetensors_io::save_safetensors(&path, &self.parameters(), Some(dtype))?;
        safetensors_io::write_atomic(&dir.join("config.json"), self.cfg.to_json_string_dtype(hf).as_bytes())?;
        crate::ladder_hf::write_remote_code(dir, &self.cfg)
    }

    // ---- Ladder conversion -----------------------------------------------------------------

    /// Makes the chosen blocks Ladder blocks (the rest standard). No weight changes: a Llama
    /// checkpoint converts by rescheduling its residual stream. `None` makes it a plain Llama.
    pub fn set_ladder_layers(&mut self, ladder: Option<LadderLayers>) -> Result<()> {
        let mut cfg = self.cfg.clone();
        cfg.ladder_layers = ladder;
        cfg.validate()?;
        let mask = cfg.ladder_layers.as_ref().map(|l| l.mask(cfg.num_hidden_layers)).unwrap_or_else(|| vec![false; self.layers.len()]);
        for (b, on) in self.layers.iter_mut().zip(mask) {
            b.ladder = on;
        }
        self.cfg = cfg;
        Ok(())
    }

    /// Copies every parameter from `other` by name (both must have the same names and shapes).
    pub fn copy_params_from(&self, other: &Llama) -> Result<()> {
        let _g = no_grad();
        let theirs: std::collections::HashMap<String, Tensor> = other.parameters().into_iter().collect();
        for (n, p) in self.parameters() {
            let q = theirs.get(&n).ok_or_else(|| Error::new("copy_params_from", format!("missing parameter {n}")))?;
            p.assign(q).map_err(|e| Error::new("copy_params_from", format!("{n}: {e}")))?;
        }
        Ok(())
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn device(&self) -> Device {
        self.device
    }
}

/// HF's causal-LM label shift as aligned targets: row-wise `labels[1:]` followed by -100, so
/// that `Llama::loss(ids, shift_labels(labels))` equals transformers' loss for `labels`.
pub fn shift_labels(labels: &[i32], seq_len: usize) -> Vec<i32> {
    labels.chunks(seq_len.max(1)).flat_map(|row| row[1..].iter().copied().chain([-100])).collect()
}

#[cfg(test)]
mod tests {
    use super::cached_attention;
    use ferrolm_ops::{causal_attention_window, segment_attention_window, Segments};
    use ferrolm_tensor::{DType, Device, Rng, Tensor};

    /// Generation with a KV cache under a sliding window: a prefill and then one token at a time,
    /// past the window, gives the rows of `causal_attention_window` over the whole sequence (the
    /// op checked against transformers); without a window, plain causal; window 0 is refused.
    #[test]
    fn cached_attention_with_a_window_matches_the_op() {
        let mut r = Rng::new(51);
        let (t, d, prefill) = (11, 4, 4);
        let x = |h: usize, r: &mut Rng| Tensor::randn(vec![2, h, t, d], 1.0, DType::F64, Device::Cpu, r).unwrap();
        let (q, k, v) = (x(4, &mut r), x(2, &mut r), x(2, &mut r));
        let upto = |x: &Tensor, a: usize, e: usize| x.narrow(2, a, e - a).unwrap();
        for window in [Some(1), Some(3), Some(prefill + 2), None] {
            let full = causal_attention_window(&q, &k, &v, 0.5, window).unwrap();
            let mut steps = vec![(0, prefill)];
            steps.extend((prefill..t).map(|p| (p, p + 1)));
            for (past, end) in steps {
                let y = cached_attention(&upto(&q, past, end), &upto(&k, 0, end), &upto(&v, 0, end), past, 0.5, window).unwrap();
                let want = upto(&full, past, end).contiguous().unwrap().to_vec_f64().unwrap();
                let err = y.to_vec_f64().unwrap().iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
                assert!(err < 1e-12, "window {window:?}, positions {past}..{end}: off by {err:e}");
            }
        }
        // The same window inside a packed row's second sequence: its positions count from its start.
        let segs = Segments::new(t, vec![vec![0, 5, t as u32]; 2]).unwrap();
        let packed = segment_attention_window(&q, &k, &v, 0.5, &segs, Some(3)).unwrap();
        let alone = cached_attention(&upto(&q, 5, t), &upto(&k, 5, t), &upto(&v, 5, t), 0, 0.5, Some(3)).unwrap();
        let err = alone
            .to_vec_f64()
            .unwrap()
            .iter()
            .zip(&upto(&packed, 5, t).contiguous().unwrap().to_vec_f64().unwrap())
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(err < 1e-12, "a packed sequence alone: off by {err:e}");
        let e = cached_attention(&q, &k, &v, 0, 0.5, Some(0)).unwrap_err().to_string();
        assert!(e.contains("sliding window 0"), "{e}");
    }
}
