//! The sharding planner: AMSP's cost model (memory per rank of each model state under a
//! `ShardSpec`, the communication of each state's collectives over its group, the overlap with
//! compute) applied to ferrolm's own engine, and an exhaustive search over every valid spec.
//!
//! The communication terms are those `zero::Zero` performs (its tests hold it to
//! `zero::traffic_bytes`), priced with the same cost functions as the simulated link
//! (`cost::seconds`, hierarchical across nodes), over the actual members of each group:
//! - T_p: parameter all-gathers over P, `zero::expected_gathers` per bucket per micro-batch;
//! - T_g: the bucket reduce-scatter over G, per micro-batch;
//! - T_os0: the hand-over G -> optimizer ranges (reduce-scatter over the OS sub-group when
//!   s_os > s_g, then the all-reduce over the OS replicas), once per step;
//! - T_os1: the all-gather of updated ranges back into parameter ranges, once per step.
//!
//! Overlap, as the engine schedules it: a pass's parameter gathers run ahead of its compute
//! (prefetch) and the gradient reduce-scatters behind the backward; in the step's last
//! micro-batch the hand-over T_os0 runs behind the backward too. So each pass exposes what its
//! compute cannot cover plus one bucket's worth (the pipeline's fill or drain); T_os1 (after
//! the update) overlaps the update of the following buckets. Overlapped communication is not free on a GPU (NCCL kernels take
//! SMs and memory bandwidth from the GEMMs): `Cluster::interference` charges that fraction of
//! the hidden time (0 for the CPU simulated link, whose "communication" is a sleep).
use crate::cost::{self, GroupSpan, Kind, LinkModel};
use crate::zero::ShardSpec;
use ferrolm_tensor::{Error, Result};

/// The shapes that set parameter count, memory and FLOPs.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelShape {
    pub name: String,
    pub layers: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub tied: bool,
}

impl ModelShape {
    /// LLaMA shapes: `7b`, `13b`, `30b` (LLaMA-1's 32.5B) and `70b` (Llama 2, GQA); and the
    /// GPT-3 shapes NeMo's launcher trains, `gpt3-5b` (24 x 4096, 32 heads) and `gpt3-175b`
    /// (96 x 12288, 96 heads), vocabulary 51200, tied embeddings, their 4h GeLU MLP (8h² weights)
    /// written as the SwiGLU width with the same weights (3·h·i = 8h², i = 8h/3).
    pub fn preset(name: &str) -> Result<ModelShape> {
        let (layers, hidden, inter, heads, kv, vocab) = match name {
            "7b" => (32, 4096, 11008, 32, 32, 32000),
            "13b" => (40, 5120, 13824, 40, 40, 32000),
            "30b" => (60, 6656, 17920, 52, 52, 32000),
            "70b" => (80, 8192, 28672, 64, 8, 32000),
            "gpt3-5b" => (24, 4096, 10944, 32, 32, 51200),
            "gpt3-175b" => (96, 12288, 32768, 96, 96, 51200),
            other => {
                return Err(Error::new(
                    "--model",
                    format!("unknown preset {other:?} (known: 7b, 13b, 30b, 70b, gpt3-5b, gpt3-175b, or a config.json)"),
                ))
            }
        };
        Ok(ModelShape {
            name: name.into(),
            layers,
            hidden,
            intermediate: inter,
            heads,
            kv_heads: kv,
            head_dim: hidden / heads,
            vocab,
            tied: name.starts_with("gpt3"),
        })
    }

    pub fn from_config(c: &ferrolm_nn::LlamaConfig, name: &str) -> ModelShape {
        ModelShape {
            name: name.into(),
            layers: c.num_hidden_layers,
            hidden: c.hidden_size,
            intermediate: c.intermediate_size,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            vocab: c.vocab_size,
            tied: c.tie_word_embeddings,
        }
    }

    /// Parameters of one transformer layer held by one of `tp` tensor-parallel ranks (a key/
    /// value head shared by several ranks is held by each).
    pub fn layer_params(&self, tp: usize) -> u64 {
        let (h, i, d) = (self.hidden as u64, self.intermediate as u64, self.head_dim as u64);
        let tp = tp as u64;
        let q = self.heads as u64 * d * h / tp; // q_proj, and o_proj alike
        let kv = if self.kv_heads as u64 >= tp { self.kv_heads as u64 * d * h / tp } else { d * h }; // k_proj, v_proj each
        2 * q + 2 * kv + 3 * h * i / tp + 2 * h
    }

    /// Parameters held by one of `tp` ranks, per bucket (embedding, each layer, head).
    pub fn bucket_params(&self, tp: usize) -> Vec<u64> {
        let (h, v) = (self.hidden as u64, self.vocab as u64);
        let mut out = vec![v * h / tp as u64];
        out.extend(std::iter::repeat_n(self.layer_params(tp), self.layers));
        out.push(h + if self.tied { 0 } else { v * h / tp as u64 });
        out
    }

    /// Elements of the largest single parameter one of `tp` ranks holds (the embedding or the
    /// head in most shapes, an MLP projection where the intermediate size beats the vocabulary).
    pub fn largest_param(&self, tp: usize) -> u64 {
        let (h, tp) = (self.hidden as u64, tp.max(1) as u64);
        let q = self.heads as u64 * self.head_dim as u64 * h;
        [self.vocab as u64 * h, self.intermediate as u64 * h, q].into_iter().max().unwrap_or(0) / tp
    }

    /// Parameters of the whole model.
    pub fn params(&self) -> u64 {
        self.bucket_params(1).iter().sum()
    }

    /// Training FLOPs per token: 6 per parameter (forward and backward) plus attention
    /// (PaLM's 12 L T d count) for sequences of `seq`.
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        6.0 * self.params() as f64 + 12.0 * (self.layers * seq * self.heads * self.head_dim) as f64
    }
}

/// The machines.
#[derive(Clone, Debug)]
pub struct Cluster {
    pub gpus: usize,
    pub gpus_per_node: usize,
    pub mem_bytes: f64,
    pub link: LinkModel,
    /// Dense FLOP/s one rank sustains on the model's GEMMs.
    pub flops: f64,
    /// Peak FLOP/s of one rank (for MFU).
    pub peak_flops: f64,
    /// Memory kept free (allocator slack, CUDA workspace), as a fraction of `mem_bytes`.
    pub margin: f64,
    /// Fraction of overlapped communication time that still slows compute.
    pub interference: f64,
    /// Seconds the optimizer takes per parameter element it updates (AdamW moves 28 bytes per
    /// element: on a GPU, 28 / HBM bandwidth).
    pub update_s_per_elem: f64,
    /// Compute time the communicator itself takes per byte a rank sends (thread ranks copy and
    /// sum on the same cores as the model; 0 for NCCL, whose cost is `interference`).
    pub comm_cpu_s_per_byte: f64,
    /// Device bytes each communicator of more than one rank holds on every member: NCCL's
    /// buffers (`NCCL_BYTES_PER_COMMUNICATOR` on GPUs), 0 for thread ranks.
    pub comm_buffer_bytes: f64,
}

/// What one step trains.
#[derive(Clone, Debug)]
pub struct Workload {
    pub seq: usize,
    pub micro_batch: usize,
    pub global_batch_tokens: usize,
    pub tp: usize,
    /// Bytes per parameter element (2 for bf16 mixed precision, 4 for f32).
    pub elem_bytes: usize,
    /// Bytes per gradient element as accumulated and reduced (`--grad-reduce-dtype`: 4 for the
    /// default f32 main gradients, `elem_bytes` for bf16).
    pub grad_bytes: usize,
    /// Transformer layers whose activations are recomputed in backward.
    pub checkpointed_layers: usize,
}

#[derive(Clone, Debug)]
pub struct Memory {
    pub params: f64,
    pub grads: f64,
    pub optim: f64,
    pub activations: f64,
    /// Transients: gathered parameter buckets, gradient buckets in flight, the single engine's
    /// gradient temporary (or the largest gradient widened to the main-gradient dtype).
    pub buffers: f64,
    /// A fixed reserve (CUDA context, cuBLAS workspace), plus NCCL's buffers on a multi-rank GPU
    /// run (`communicators` × `Cluster::comm_buffer_bytes`).
    pub workspace: f64,
}

impl Memory {
    pub fn total(&self) -> f64 {
        self.params + self.grads + self.optim + self.activations + self.buffers + self.workspace
    }

    /// Model states alone (parameters, gradients, optimizer).
    pub fn states(&self) -> f64 {
        self.params + self.grads + self.optim
    }
}

/// The model's verdict on one layout.
#[derive(Clone, Debug)]
pub struct Estimate {
    pub spec: ShardSpec,
    pub dp: usize,
    pub micro_batches: usize,
    pub mem: Memory,
    pub fits: bool,
    /// Communication per step if nothing overlapped, by term (T_p, T_g, T_os0, T_os1).
    pub comm: [f64; 4],
    pub exposed: f64,
    pub compute: f64,
    pub step: f64,
    pub mfu: f64,
}

impl Estimate {
    pub fn comm_total(&self) -> f64 {
        self.comm.iter().sum()
    }
}

/// Data-parallel members of rank 0's groups (P, G, OS sub-group, OS replicas), as the engine
/// splits them.
fn groups_of_rank0(dp: usize, s: ShardSpec) -> [Vec<usize>; 4] {
    use crate::zero::{members, ZeroGroup};
    let g = if s.grads == s.params { ZeroGroup::Params } else { ZeroGroup::Block };
    [ZeroGroup::Params, g, ZeroGroup::OptimSub, ZeroGroup::OptimReplicas].map(|grp| members(grp, s, dp, 0))
}

/// NCCL's default `NCCL_BUFFSIZE`: the Simple protocol's buffer per channel and connection
/// (4 MiB, NCCL's environment-variable documentation).
pub const NCCL_BUFFSIZE: f64 = 4.0 * 1024.0 * 1024.0;
/// Channels assumed per communicator. NCCL picks them from the topology (its `NCCL_DEBUG=INFO`
/// logs show 16 to 32 on NVLink H100 nodes); 16 is a middle figure, not a measurement.
pub const NCCL_CHANNELS: f64 = 16.0;
/// Device bytes one rank holds for one NCCL communicator: per channel a ring connection to each
/// of its two neighbours, each with an `NCCL_BUFFSIZE` buffer (the LL and LL128 protocols' own
/// buffers, and NCCL's small per-communicator state, are not counted): 16 × 2 × 4 MiB = 128 MiB.
/// An assumption stated for the estimator, to be replaced by a measurement on a multi-GPU node.
pub const NCCL_BYTES_PER_COMMUNICATOR: f64 = NCCL_CHANNELS * 2.0 * NCCL_BUFFSIZE;

/// The communicators of more than one rank that world rank 0 of a `tp` × `dp` run holds, one
/// per distinct group as the mesh, tensor parallelism and the engine create them: the world,
/// the tp and dp groups when they are neither one rank nor the world, the group of ranks that
/// share a replicated key/value head (1 < `kv_heads` < tp), and the engine's groups under `spec`
/// that are neither one rank nor an earlier group.
pub fn communicators(tp: usize, dp: usize, spec: ShardSpec, kv_heads: usize) -> usize {
    use crate::zero::{members, ZeroGroup};
    let (tp, dp) = (tp.max(1), dp.max(1));
    let mut groups: Vec<Vec<usize>> = vec![(0..tp * dp).collect(), (0..tp).collect(), (0..dp).map(|d| d * tp).collect()];
    if kv_heads > 1 && kv_heads < tp {
        groups.push((0..tp / kv_heads).collect());
    }
    for g in [ZeroGroup::Params, ZeroGroup::OptimSub, ZeroGroup::Block, ZeroGroup::OptimReplicas] {
        groups.push(members(g, spec, dp, 0).into_iter().map(|d| d * tp).collect());
    }
    let mut distinct: Vec<Vec<usize>> = groups.into_iter().filter(|g| g.len() > 1).collect();
    distinct.sort();
    distinct.dedup();
    distinct.len()
}

/// Activation bytes one rank keeps for backward per micro-batch of `b` sequences of `seq`
/// tokens, as ferrolm's ops save them (measured with `ferrolm_tensor::peak_bytes` on the CPU
/// engine, see docs/AUTOCONFIG.md): per token and layer about 10 hidden-sized tensors (norm
/// inputs, residuals, q/k/v, the attention output; the attention part split over `tp`) and 4
/// MLP-sized ones (gate, up, their SwiGLU and its input to down_proj); a checkpointed layer keeps
/// the inputs and outputs of its two residual branches (4 hidden-sized tensors), and the
/// branch being recomputed in backward holds its activations again. Plus the f32
/// logits (vocabulary split over `tp`) and the embedding output and final norm (2 hidden-sized).
pub fn activation_bytes(m: &ModelShape, w: &Workload) -> f64 {
    let (tokens, h, e) = ((w.micro_batch * w.seq) as f64, m.hidden as f64, w.elem_bytes as f64);
    let tp = w.tp.max(1) as f64;
    let i = m.intermediate as f64 / tp;
    let full = 4.0 * h + 6.0 * h / tp + 4.0 * i;
    let ck = w.checkpointed_layers.min(m.layers) as f64;
    // During backward one checkpointed branch at a time is recomputed: about half a layer.
    let recompute = if ck > 0.0 { 0.5 * full } else { 0.0 };
    let layers = (m.layers as f64 - ck) * full + ck * 4.0 * h + recompute;
    tokens * (e * (layers + 2.0 * h) + 4.0 * m.vocab as f64 / tp)
}

/// Device bytes one rank needs at its peak for `spec` with `micro_batches` micro-batches per
/// step, broken down. `workspace` is a fixed reserve (the CUDA context and cuBLAS workspace on a
/// GPU, 0 on the CPU, plus NCCL's buffers on a multi-rank GPU run:
/// `communicators` × `NCCL_BYTES_PER_COMMUNICATOR`) the caller passes.
///
/// Model states follow the engine's layout (one device is the spec (1, 1, 1)): each bucket's
/// parameter shard (`n / s_p`, plus up to `MAX_LIVE` = 3 gathered buckets when `s_p > 1`), the
/// gradients of its optimizer range at the step (`n / s_os`) with one whole bucket buffer in
/// flight towards it when `s_os > 1` (and the step's squared gradient of one bucket), with
/// several micro-batches an accumulator of `n / s_g` (about three quarters of it live at the
/// peak), gradients counted at `grad_bytes` per element (with gradients wider than the
/// parameters, the largest parameter's gradient in both dtypes during backward, in place of the
/// step's squared gradient when larger), and per optimizer element m and v (and a norm-weight mask under tensor parallelism)
/// plus the master below f32. The fractions are fitted to measured peaks (docs/AUTOCONFIG.md,
/// "Memory estimator"); the rest is counted.
pub fn memory(m: &ModelShape, w: &Workload, spec: ShardSpec, micro_batches: usize, workspace: f64) -> Memory {
    let (e, ge) = (w.elem_bytes as f64, w.grad_bytes as f64);
    let buckets: Vec<f64> = m.bucket_params(w.tp).iter().map(|&n| n as f64).collect();
    let local: f64 = buckets.iter().sum();
    let biggest = buckets.iter().copied().fold(0.0, f64::max);
    let master = if w.elem_bytes == 4 { 0.0 } else { 4.0 };
    let activations = activation_bytes(m, w);
    let (sp, sg, so) = (spec.params as f64, spec.grads as f64, spec.optim as f64);
    let gathered = if spec.params > 1 { 3.0 * biggest * e } else { 0.0 };
    let accumulator = if micro_batches > 1 { 0.75 * local * ge / sg } else { 0.0 };
    let in_flight = if spec.optim > 1 { biggest * ge } else { 0.0 };
    // Gradients accumulated wider than the parameters (f32 main gradients of bf16 ones): each
    // parameter's gradient arrives from autograd in the parameter dtype and is widened to a
    // copy of its own before it lands in its bucket, so the largest one is held twice, `e` and
    // `ge` bytes per element, late in the backward pass beside the activations. It never meets
    // the step's squared gradient, so the larger of the two counts.
    let step_sq = 4.0 * biggest / so;
    let widened = if ge > e { (e + ge) * m.largest_param(w.tp) as f64 } else { 0.0 };
    Memory {
        params: local * e / sp,
        grads: local * ge / so + accumulator,
        // m, v; the norm-weight mask only under tensor parallelism.
        optim: local * (8.0 + if w.tp > 1 { 4.0 } else { 0.0 } + master) / so,
        activations,
        buffers: gathered + in_flight + step_sq.max(widened),
        workspace,
    }
}

/// Estimates one layout (see the module comment); `None` when the spec is invalid here.
pub fn evaluate(m: &ModelShape, c: &Cluster, w: &Workload, spec: ShardSpec) -> Option<Estimate> {
    let ranks_per_group = w.tp;
    if !c.gpus.is_multiple_of(ranks_per_group) || !c.gpus_per_node.is_multiple_of(w.tp) {
        return None;
    }
    let dp = c.gpus / w.tp;
    let dpn = (c.gpus_per_node / w.tp).max(1);
    spec.validate(dp, dpn).ok()?;
    let tokens_per_micro = w.micro_batch * w.seq * dp;
    if !w.global_batch_tokens.is_multiple_of(tokens_per_micro) {
        return None;
    }
    let micro = w.global_batch_tokens / tokens_per_micro;
    let e = w.elem_bytes as f64;
    let buckets: Vec<f64> = m.bucket_params(w.tp).iter().map(|&n| n as f64).collect();
    let local: f64 = buckets.iter().sum();
    // NCCL's buffers, one set per distinct group of more than one rank that rank 0 joins.
    let buffers = if c.gpus > 1 { communicators(w.tp, dp, spec, m.kv_heads) as f64 * c.comm_buffer_bytes } else { 0.0 };
    let mem = memory(m, w, spec, micro, buffers);
    let fits = mem.total() <= c.mem_bytes * (1.0 - c.margin);

    // Communication, priced over each group's real placement.
    let rpn = c.link.ranks_per_node;
    let span = |members: &[usize]| GroupSpan::of(&members.iter().map(|&d| d * w.tp).collect::<Vec<_>>(), rpn);
    let [p, g, os, rep] = groups_of_rank0(dp, spec);
    let (sp_, sg_, so_, rep_) = (span(&p), span(&g), span(&os), span(&rep));
    let t = |k: Kind, sp: GroupSpan, bytes: f64| cost::seconds(k, sp, bytes, &c.link);
    let gathers = crate::zero::expected_gathers(spec.params, buckets.len(), m.tied);
    let (mut tp_, mut tp_fwd, mut tg, mut t0, mut t1) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for (i, (&n, &ag)) in buckets.iter().zip(&gathers).enumerate() {
        let (b, gb) = (n * e, n * w.grad_bytes as f64);
        let one = t(Kind::AllGather, sp_, b);
        tp_ += ag as f64 * one;
        // In the forward pass: once per bucket, and the tied embedding again for the head.
        tp_fwd += ag.min(if i == 0 && ag == 4 { 2 } else { 1 }) as f64 * one;
        tg += t(Kind::ReduceScatter, sg_, gb);
        if spec.optim > spec.grads {
            t0 += t(Kind::ReduceScatter, so_, gb / spec.grads as f64);
        }
        t0 += t(Kind::AllReduce, rep_, gb / spec.optim as f64);
        t1 += t(Kind::AllGather, so_, b / spec.params as f64);
    }
    let comm = [micro as f64 * tp_, micro as f64 * tg, t0, t1];

    // Compute: the model's FLOPs over the ranks, recompute adding a forward per layer.
    let flops = m.flops_per_token(w.seq) * (w.micro_batch * w.seq) as f64 / w.tp as f64;
    let fwd = flops / 3.0 / c.flops;
    let recompute = fwd * w.checkpointed_layers.min(m.layers) as f64 / m.layers as f64;
    // Per micro-batch: forward gathers behind forward compute, backward gathers and
    // reduce-scatters behind backward compute; one bucket's worth each is not covered.
    let nb = buckets.len() as f64;
    let fwd_comm = tp_fwd;
    let bwd_comm = tp_ - tp_fwd + tg;
    // One pass: what compute cannot cover, plus one bucket's share (fill or drain).
    let pass = |comm: f64, compute: f64| (comm - compute).max(0.0) + comm / nb;
    let micro_f = micro as f64;
    let exposed_fwd = micro_f * pass(fwd_comm, fwd);
    let exposed_bwd = (micro_f - 1.0) * pass(bwd_comm, 2.0 * fwd + recompute) + pass(bwd_comm + t0, 2.0 * fwd + recompute);
    // The update runs bucket by bucket, each bucket's parameter all-gather behind the next
    // bucket's update.
    let update = local / spec.optim as f64 * c.update_s_per_elem;
    let exposed = exposed_fwd + exposed_bwd + pass(t1, update);
    let total_comm: f64 = comm.iter().sum();
    let hidden = (total_comm - exposed).max(0.0);
    let sent =
        crate::zero::traffic_bytes(spec, dp, &buckets.iter().map(|&b| b as usize).collect::<Vec<_>>(), &gathers, w.elem_bytes, micro);
    let compute = micro_f * (3.0 * fwd + recompute) + update + sent * c.comm_cpu_s_per_byte;
    let step = compute + exposed + c.interference * hidden;
    let tokens = w.global_batch_tokens as f64;
    let mfu = m.flops_per_token(w.seq) * tokens / (step * c.gpus as f64 * c.peak_flops);
    Some(Estimate { spec, dp, micro_batches: micro, mem, fits, comm, exposed, compute, step, mfu })
}

/// Every valid layout, fitting ones first, fastest first.
pub fn search(m: &ModelShape, c: &Cluster, w: &Workload) -> Vec<Estimate> {
    let dp = c.gpus / w.tp.max(1);
    let dpn = (c.gpus_per_node / w.tp.max(1)).max(1);
    let mut out: Vec<Estimate> = ShardSpec::all_valid(dp, dpn).into_iter().filter_map(|s| evaluate(m, c, w, s)).collect();
    out.sort_by(|a, b| b.fits.cmp(&a.fits).then(a.step.total_cmp(&b.step)).then(a.mem.total().total_cmp(&b.mem.total())));
    out
}
