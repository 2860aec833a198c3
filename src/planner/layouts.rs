//! The layout search of the auto-configurator: every layout worth running (tensor parallelism, a
//! `ShardSpec` over the data-parallel ranks, micro-batch size, activation-checkpointed layers,
//! optimizer offload), filtered by memory and ranked by modelled step time.
//!
//! The analytic model is `step::evaluate` (compute from the calibrated GEMM throughput, the
//! ShardSpec's collectives priced on the calibrated link, overlap, memory from
//! `memory::memory`), plus what it leaves out and a layout here changes:
//! - tensor parallelism's activation all-reduces (two per layer forward, two backward, two more
//!   per recomputed layer), intra-node; exposed in full for a Llama, and for a Ladder model's
//!   ladder layers overlapped with the next block's compute (Ladder Residual's point);
//! - optimizer offload: model states' optimizer part leaves the device and the update phase is
//!   Deep Optimizer States' model (`dos`).
use super::cluster::Cluster;
use super::cost::{self, GroupSpan, Kind};
use super::dos::{self, DosInputs};
use super::memory::{self, Memory};
use super::shape::ModelShape;
use super::step::{self, Estimate, Workload};
use ferrolm_parallel::zero::{GradReduceDtype, ShardSpec};

/// What a GPU gives optimizer offload (all measured or published; see docs/AUTOCONFIG.md).
#[derive(Clone, Debug)]
pub struct OffloadRates {
    pub cpu_adam_elems_per_s: f64,
    pub gpu_adam_elems_per_s: f64,
    pub h2d_bytes_per_s: f64,
    pub d2h_bytes_per_s: f64,
    pub subgroup: u64,
}

/// The search space and its limits.
#[derive(Clone, Debug)]
pub struct SearchSpace {
    /// Tokens per sequence and per optimizer step.
    pub seq: usize,
    pub global_batch_tokens: usize,
    /// Micro-batch sizes tried.
    pub micro_batches: Vec<usize>,
    /// Checkpointed-layer counts tried (0 and all layers are always tried).
    pub partial_checkpointing: bool,
    /// Largest tensor-parallel degree tried (inside a node).
    pub max_tp: usize,
    /// Optimizer offload as a candidate dimension (GPU clusters only).
    pub offload: Option<OffloadRates>,
    /// Ladder layers of the model (`None`: a plain Llama).
    pub ladder_layers: Option<usize>,
    /// Bytes per parameter element (4 for f32 on the CPU, 2 for bf16).
    pub elem_bytes: usize,
    /// `--grad-reduce-dtype`: the dtype gradients are accumulated and reduced in (the
    /// training tools' default, f32, prices gradient collectives at 4 bytes per element; bf16
    /// at the parameters' `elem_bytes`).
    pub grad_reduce: GradReduceDtype,
    /// Fixed device reserve per rank (CUDA context, cuBLAS workspace; 0 on the CPU).
    pub workspace_bytes: f64,
    /// Measured FLOP/s per rank by micro-batch size (GEMMs run faster on larger batches);
    /// sizes not listed use `Cluster::flops`.
    pub flops_by_micro_batch: Vec<(usize, f64)>,
}

/// One layout and the model's verdict.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub tp: usize,
    pub dp: usize,
    pub spec: ShardSpec,
    pub micro_batch: usize,
    pub grad_accum: usize,
    pub checkpointed_layers: usize,
    /// `Some(k)`: optimizer offloaded, one subgroup in k updated on the GPU (`Some(0)`: all on
    /// the CPU); `None`: no offload.
    pub offload_k: Option<u64>,
    pub mem: Memory,
    /// The planner's estimate (ShardSpec collectives, compute, update).
    pub base: Estimate,
    /// Exposed tensor-parallel all-reduce time per step.
    pub tp_comm_s: f64,
    /// Offload's update phase minus the on-device update it replaces.
    pub offload_s: f64,
    pub step_s: f64,
    pub tokens_per_s: f64,
    pub mfu: f64,
}

impl Candidate {
    /// A short name: `tp2 dp2 (1,1,2) mbs4 ck0`.
    pub fn name(&self) -> String {
        let off = match self.offload_k {
            None => String::new(),
            Some(0) => " off:cpu".into(),
            Some(k) => format!(" off:k{k}"),
        };
        format!(
            "tp{} dp{} ({},{},{}) mbs{} ck{}{off}",
            self.tp, self.dp, self.spec.params, self.spec.grads, self.spec.optim, self.micro_batch, self.checkpointed_layers
        )
    }
}

/// Why a layout did not reach the ranking.
#[derive(Clone, Debug, PartialEq)]
pub struct Rejected {
    pub layout: String,
    pub reason: String,
}

/// Exposed seconds per step of tensor parallelism's activation all-reduces (and the CPU cost
/// of the bytes on thread ranks).
fn tp_comm(m: &ModelShape, c: &Cluster, w: &Workload, micro: usize, fwd_s: f64, ladder: Option<usize>) -> f64 {
    if w.tp <= 1 {
        return 0.0;
    }
    let bytes = (w.micro_batch * w.seq * m.hidden * w.elem_bytes) as f64;
    let one = cost::seconds(Kind::AllReduce, GroupSpan::intra(w.tp), bytes, &c.link);
    let sent = cost::ring_bytes(Kind::AllReduce, w.tp, bytes);
    let per_layer = |recomputed: bool| if recomputed { 6.0 } else { 4.0 };
    let ck = w.checkpointed_layers.min(m.layers);
    let ladder = ladder.unwrap_or(0).min(m.layers);
    let (mut exposed, mut count) = (0.0, 0.0);
    for layer in 0..m.layers {
        let n = per_layer(layer < ck);
        count += n;
        // A ladder layer's all-reduces run behind the next block's compute (its forward, and
        // twice that in backward); a standard layer waits for each.
        let hidden_by = if layer >= m.layers - ladder { 3.0 * fwd_s / m.layers as f64 } else { 0.0 };
        exposed += (n * one - hidden_by).max(0.0);
    }
    micro as f64 * (exposed + count * sent * c.comm_cpu_s_per_byte)
}

/// Every layout for `shape` on `cluster`, filtered and ranked by modelled step time (fastest
/// first), and the rejected ones with their reasons.
pub fn search(shape: &ModelShape, cluster: &Cluster, space: &SearchSpace) -> (Vec<Candidate>, Vec<Rejected>) {
    let (mut out, mut rejected) = (Vec::new(), Vec::new());
    let mut reject = |layout: String, reason: String| {
        let r = Rejected { layout, reason };
        if !rejected.contains(&r) {
            rejected.push(r);
        }
    };
    let mut cks = vec![0, shape.layers];
    if space.partial_checkpointing {
        cks.extend([1, shape.layers / 4, shape.layers / 2, 3 * shape.layers / 4]);
    }
    cks.sort_unstable();
    cks.dedup();
    let elem_bytes = space.elem_bytes;
    for tp in (1..=space.max_tp.min(cluster.gpus_per_node)).filter(|t| cluster.gpus.is_multiple_of(*t)) {
        if !shape.heads.is_multiple_of(tp) {
            reject(format!("tp{tp}"), format!("{} heads do not split over tp {tp}", shape.heads));
            continue;
        }
        if !shape.kv_heads.is_multiple_of(tp) && !tp.is_multiple_of(shape.kv_heads) {
            reject(format!("tp{tp}"), format!("{} kv heads neither split over nor replicate to tp {tp}", shape.kv_heads));
            continue;
        }
        if !cluster.gpus_per_node.is_multiple_of(tp) {
            reject(format!("tp{tp}"), format!("tp {tp} does not divide the {} GPUs of a node", cluster.gpus_per_node));
            continue;
        }
        let dp = cluster.gpus / tp;
        let dpn = (cluster.gpus_per_node / tp).max(1);
        for spec in ShardSpec::all_valid(dp, dpn) {
            for &mbs in &space.micro_batches {
                let per_micro = mbs * space.seq * dp;
                if !space.global_batch_tokens.is_multiple_of(per_micro) {
                    reject(
                        format!("tp{tp} dp{dp} mbs{mbs}"),
                        format!("global batch {} tokens is not a multiple of {mbs} x {} x dp {dp}", space.global_batch_tokens, space.seq),
                    );
                    continue;
                }
                let micro = space.global_batch_tokens / per_micro;
                let mut cluster = cluster.clone();
                if let Some(&(_, f)) = space.flops_by_micro_batch.iter().find(|x| x.0 == mbs) {
                    cluster.flops = f;
                }
                let cluster = &cluster;
                for &ck in &cks {
                    let w = Workload {
                        seq: space.seq,
                        micro_batch: mbs,
                        global_batch_tokens: space.global_batch_tokens,
                        tp,
                        elem_bytes,
                        grad_bytes: space.grad_reduce.bytes(elem_bytes),
                        checkpointed_layers: ck,
                        loss_chunks: Default::default(),
                    };
                    let Some(base) = step::evaluate(shape, cluster, &w, spec) else { continue };
                    let offloads: Vec<Option<u64>> = match &space.offload {
                        Some(_) => vec![None, Some(u64::MAX)],
                        None => vec![None],
                    };
                    for off in offloads {
                        let c = candidate(shape, cluster, space, &w, spec, dp, micro, base.clone(), off);
                        let cap = cluster.mem_bytes * (1.0 - cluster.margin);
                        if c.mem.total() > cap {
                            reject(
                                c.name(),
                                format!("needs {}, over {} (memory less the margin)", memory::human(c.mem.total()), memory::human(cap)),
                            );
                            continue;
                        }
                        out.push(c);
                    }
                }
            }
        }
    }
    out.sort_by(|a, b| a.step_s.total_cmp(&b.step_s).then(a.mem.total().total_cmp(&b.mem.total())));
    (out, rejected)
}

#[allow(clippy::too_many_arguments)]
fn candidate(
    m: &ModelShape,
    c: &Cluster,
    space: &SearchSpace,
    w: &Workload,
    spec: ShardSpec,
    dp: usize,
    micro: usize,
    base: Estimate,
    offload: Option<u64>,
) -> Candidate {
    let flops_token = m.flops_per_token(w.seq);
    let fwd_s = flops_token * (w.micro_batch * w.seq) as f64 / w.tp as f64 / 3.0 / c.flops;
    let tp_comm_s = tp_comm(m, c, w, micro, fwd_s, space.ladder_layers);
    let mut mem = memory::memory(m, w, spec, micro, space.workspace_bytes, None);
    let (mut offload_s, mut offload_k) = (0.0, None);
    if let (Some(_), Some(r)) = (offload, &space.offload) {
        let local: f64 = m.bucket_params(w.tp).iter().sum::<u64>() as f64;
        let elems = (local / spec.optim as f64).ceil() as u64;
        let inp = DosInputs {
            elems,
            subgroup: r.subgroup.max(1),
            cpu_adam_elems_per_s: r.cpu_adam_elems_per_s,
            gpu_adam_elems_per_s: r.gpu_adam_elems_per_s,
            h2d_bytes_per_s: r.h2d_bytes_per_s,
            d2h_bytes_per_s: r.d2h_bytes_per_s,
            param_bytes: w.elem_bytes as u64,
            // The offload engine streams every gradient to the host as f32 (offload.rs).
            grad_bytes: 4,
            backward_s: 2.0 * fwd_s * micro as f64,
            interference: 0.0,
        };
        let best = dos::choose_k(&inp);
        let on_device_update = local / spec.optim as f64 * c.update_s_per_elem;
        offload_s = best.total_s - on_device_update;
        offload_k = Some(best.k.unwrap_or(0));
        // The optimizer states live on the host; a GPU subgroup's states visit the device (its
        // prefetch and the one being updated).
        mem.optim = 2.0 * 12.0 * r.subgroup.min(elems) as f64;
    }
    let step_s = base.step + tp_comm_s + offload_s;
    let tokens_per_s = w.global_batch_tokens as f64 / step_s;
    let mfu = flops_token * tokens_per_s / (c.gpus as f64 * c.peak_flops);
    Candidate {
        tp: w.tp,
        dp,
        spec,
        micro_batch: w.micro_batch,
        grad_accum: micro,
        checkpointed_layers: w.checkpointed_layers,
        offload_k,
        mem,
        base,
        tp_comm_s,
        offload_s,
        step_s,
        tokens_per_s,
        mfu,
    }
}
