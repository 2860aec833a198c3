//! The step-time model: AMSP's cost model (memory per rank of each model state under a
//! `ShardSpec` (`memory`), the communication of each state's collectives over its group, the
//! overlap with compute) applied to ferrolm's own engine, and an exhaustive search over every
//! valid spec (the `plan` tool's ranking).
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
use super::cluster::Cluster;
use super::cost::{self, GroupSpan, Kind};
use super::memory::{memory, Memory};
use super::shape::ModelShape;
use ferrolm_parallel::zero::{self, ShardSpec};

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
    /// How the LM head's loss walks the tokens (`--loss-chunk-tokens`): what it holds.
    pub loss_chunks: ferrolm_ops::LossChunks,
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
    use zero::{members, ZeroGroup};
    let g = if s.grads == s.params { ZeroGroup::Params } else { ZeroGroup::Block };
    [ZeroGroup::Params, g, ZeroGroup::OptimSub, ZeroGroup::OptimReplicas].map(|grp| members(grp, s, dp, 0))
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
    let buffers = if c.gpus > 1 { zero::groups::communicators(w.tp, dp, spec, m.kv_heads) as f64 * c.comm_buffer_bytes } else { 0.0 };
    let mem = memory(m, w, spec, micro, buffers, None);
    let fits = mem.total() <= c.mem_bytes * (1.0 - c.margin);

    // Communication, priced over each group's real placement.
    let rpn = c.link.ranks_per_node;
    let span = |members: &[usize]| GroupSpan::of(&members.iter().map(|&d| d * w.tp).collect::<Vec<_>>(), rpn);
    let [p, g, os, rep] = groups_of_rank0(dp, spec);
    let (sp_, sg_, so_, rep_) = (span(&p), span(&g), span(&os), span(&rep));
    let t = |k: Kind, sp: GroupSpan, bytes: f64| cost::seconds(k, sp, bytes, &c.link);
    let gathers = zero::expected_gathers(spec.params, buckets.len(), m.tied);
    let (mut tp_, mut tp_fwd, mut tg, mut t0, mut t1) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for (i, (&n, &ag)) in buckets.iter().zip(&gathers).enumerate() {
        let (b, gb) = (n * e, n * w.grad_bytes as f64);
        let one = t(Kind::AllGather, sp_, b);
        tp_ += ag as f64 * one;
        // In the forward pass: once per bucket, and the tied embedding again for the head.
        tp_fwd += ag.min(if i == 0 && ag == 3 { 2 } else { 1 }) as f64 * one;
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
    let sent = zero::traffic_bytes(spec, dp, &buckets.iter().map(|&b| b as usize).collect::<Vec<_>>(), &gathers, w.elem_bytes, micro);
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
