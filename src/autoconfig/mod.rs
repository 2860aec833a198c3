//! The auto-configurator: from a compute budget or a model, the model's size and shape, its
//! base hyper-parameters (each with its published source, docs/AUTOCONFIG.md), and the layouts
//! worth running (tensor parallelism, a `ShardSpec` over the data-parallel ranks, micro-batch
//! size, activation-checkpointed layers, optimizer offload), ranked by the planner's analytic
//! step time; `trial` then runs the best few with the real trainer and re-ranks by measured
//! tokens/s (`examples/autoconfig.rs`).
//!
//! The analytic model is `ferrolm_dist::plan::evaluate` (compute from the calibrated GEMM
//! throughput, the ShardSpec's collectives priced on the calibrated link, overlap, memory from
//! `plan::memory`), plus what it leaves out and a layout here changes:
//! - tensor parallelism's activation all-reduces (two per layer forward, two backward, two more
//!   per recomputed layer), intra-node; exposed in full for a Llama, and for a Ladder model's
//!   ladder layers overlapped with the next block's compute (Ladder Residual's point);
//! - optimizer offload: model states' optimizer part leaves the device and the update phase is
//!   Deep Optimizer States' model (`ferrolm_dist::dos`).
pub mod trial;

use anyhow::{bail, Result};
use ferrolm_dist::cost::{self, GroupSpan, Kind};
use ferrolm_dist::dos::{self, DosInputs};
use ferrolm_dist::plan::{self, Cluster, Estimate, Memory, ModelShape, Workload};
use ferrolm_dist::zero::{GradReduceDtype, ShardSpec};
use serde::Serialize;

/// FLOPs per parameter and token when training with full activation recompute: 6 (forward and
/// backward) + 2 (the recomputed forward). NeMo's auto-configurator uses the same 8.
pub const FLOPS_PER_PARAM_TOKEN: f64 = 8.0;

/// A compute budget.
#[derive(Clone, Debug, PartialEq)]
pub struct Budget {
    pub days: f64,
    pub gpus: usize,
    /// Achieved (not peak) TFLOP/s per GPU.
    pub tflops_per_gpu: f64,
    /// Training tokens.
    pub tokens: f64,
}

/// Parameters a budget trains: `P = days · 86400 · gpus · F / (8 · T)`.
pub fn params_from_budget(b: &Budget) -> Result<f64> {
    if !(b.days > 0.0 && b.tflops_per_gpu > 0.0 && b.tokens > 0.0 && b.gpus > 0) {
        bail!("--days, --gpus, --tflops-per-gpu and --tokens must all be positive");
    }
    Ok(b.days * 86400.0 * b.gpus as f64 * b.tflops_per_gpu * 1e12 / (FLOPS_PER_PARAM_TOKEN * b.tokens))
}

/// Days a run takes (the inverse).
pub fn days_for(params: f64, tokens: f64, gpus: usize, tflops_per_gpu: f64) -> f64 {
    params * FLOPS_PER_PARAM_TOKEN * tokens / (86400.0 * gpus as f64 * tflops_per_gpu * 1e12)
}

/// LLaMA-style shapes by size (layers, hidden, heads; kv heads = heads; SwiGLU width LLaMA's
/// 2/3 · 4h rounded up to a multiple of 256): GPT-3's Table 2.1 depths and widths below 7B,
/// NeMo's 5B GPT-3 (24 x 4096), LLaMA-1's Table 2 from 7B, GPT-3 175B's at the top.
const SIZES: &[(&str, usize, usize, usize)] = &[
    ("125m", 12, 768, 12),
    ("350m", 24, 1024, 16),
    ("760m", 24, 1536, 16),
    ("1.3b", 24, 2048, 16),
    ("2.7b", 32, 2560, 32),
    ("5b", 24, 4096, 32),
    ("7b", 32, 4096, 32),
    ("13b", 40, 5120, 40),
    ("30b", 60, 6656, 52),
    ("65b", 80, 8192, 64),
    ("175b", 96, 12288, 96),
];

fn llama_ffn(h: usize) -> usize {
    (8 * h / 3).div_ceil(256) * 256
}

/// Every shape of the size table with vocabulary `vocab`.
pub fn size_table(vocab: usize) -> Vec<ModelShape> {
    SIZES
        .iter()
        .map(|&(name, layers, hidden, heads)| ModelShape {
            name: name.into(),
            layers,
            hidden,
            intermediate: llama_ffn(hidden),
            heads,
            kv_heads: heads,
            head_dim: hidden / heads,
            vocab,
            tied: false,
        })
        .collect()
}

/// The table's shape nearest to `params` (by the ratio of parameter counts).
pub fn shape_for_params(params: f64, vocab: usize) -> ModelShape {
    let dist = |s: &ModelShape| (s.params() as f64 / params).ln().abs();
    size_table(vocab).into_iter().min_by(|a, b| dist(a).total_cmp(&dist(b))).expect("the size table is not empty")
}

/// One hyper-parameter, its value and where it comes from.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub name: &'static str,
    pub value: String,
    pub source: &'static str,
}

/// The base training recipe for a model of `params` parameters on sequences of `seq` tokens.
#[derive(Clone, Debug, Serialize)]
pub struct HyperParams {
    pub lr: f64,
    pub min_lr: f64,
    pub schedule: &'static str,
    pub warmup_steps: usize,
    pub global_batch_tokens: usize,
    pub global_batch_sequences: usize,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub init_std: f64,
    pub grad_clip: f64,
    pub precision: &'static str,
    /// Chinchilla's compute-optimal tokens (~20 per parameter), when no budget gave them.
    pub chinchilla_tokens: f64,
    pub rows: Vec<Row>,
}

/// The recipe (docs/AUTOCONFIG.md has the table with the sources).
pub fn hyper_params(params: f64, seq: usize) -> HyperParams {
    let (lr, lr_src) = if params < 0.25e9 {
        (6e-4, "GPT-3 Table 2.1 (Small, 125M)")
    } else if params < 0.55e9 {
        (3e-4, "GPT-3 Table 2.1 (Medium, 350M)")
    } else if params < 1.0e9 {
        (2.5e-4, "GPT-3 Table 2.1 (Large, 760M)")
    } else if params < 20e9 {
        (3e-4, "LLaMA-1 Table 2 (6.7B, 13B); Ladder 1B/3B configs")
    } else {
        (1.5e-4, "LLaMA-1 Table 2 (32.5B, 65.2B); Llama 2 (34B, 70B)")
    };
    // Global batch: GPT-3's 0.5M tokens below 1B; ~4M tokens (LLaMA; Ladder's 2048 sequences of
    // 2048) from 1B. In whole sequences, a power of two.
    let (target, batch_src) = if params < 1.0e9 {
        (0.5e6, "GPT-3 Table 2.1 (0.5M tokens below 1B)")
    } else {
        (4.0e6, "LLaMA-1/2 (4M tokens); Ladder (2048 x 2048)")
    };
    let seqs = ((target / seq as f64).log2().round().max(0.0) as u32).min(30);
    let global_batch_sequences = 1usize << seqs;
    let h = HyperParams {
        lr,
        min_lr: lr / 10.0,
        schedule: "cosine",
        warmup_steps: 2000,
        global_batch_tokens: global_batch_sequences * seq,
        global_batch_sequences,
        weight_decay: 0.1,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-5,
        init_std: 0.02,
        grad_clip: 1.0,
        precision: "bf16 (f32 on the CPU)",
        chinchilla_tokens: 20.0 * params,
        rows: Vec::new(),
    };
    let rows = vec![
        Row { name: "peak lr", value: format!("{:.1e}", h.lr), source: lr_src },
        Row {
            name: "schedule",
            value: "warmup, then cosine to 10% of peak".into(),
            source: "LLaMA-1 §2.3; Llama 2 §2.2; Ladder (lr_decay_factor 0.1)",
        },
        Row { name: "warmup", value: "2000 steps".into(), source: "LLaMA-1 §2.3; Llama 2 §2.2; Ladder configs" },
        Row {
            name: "global batch",
            value: format!("{} x {} = {} tokens", h.global_batch_sequences, seq, h.global_batch_tokens),
            source: batch_src,
        },
        Row { name: "weight decay", value: "0.1".into(), source: "LLaMA-1/2; GPT-3; Ladder" },
        Row { name: "AdamW betas", value: "(0.9, 0.95)".into(), source: "LLaMA-1/2; GPT-3; Ladder" },
        Row { name: "AdamW eps", value: "1e-5".into(), source: "Llama 2 §2.2 (GPT-3: 1e-8; Ladder: 1e-10)" },
        Row { name: "init std", value: "0.02".into(), source: "Ladder configs (initializer_range); LLaMA does not state it" },
        Row { name: "gradient clipping", value: "1.0".into(), source: "LLaMA-1/2; GPT-3; Ladder" },
        Row { name: "precision", value: "bf16".into(), source: "Ladder configs; NeMo 175B config" },
        Row {
            name: "tokens",
            value: format!("{:.3e} (~20 per parameter)", h.chinchilla_tokens),
            source: "Chinchilla Table 3 (Approach 1 projections: 20.2-22 tokens per parameter)",
        },
    ];
    HyperParams { rows, ..h }
}

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
    pub seq: usize,
    pub global_batch_tokens: usize,
    pub micro_batches: Vec<usize>,
    /// Checkpointed-layer counts tried (0 and all layers are always tried).
    pub partial_checkpointing: bool,
    pub max_tp: usize,
    /// Optimizer offload as a candidate dimension (GPU clusters only).
    pub offload: Option<OffloadRates>,
    /// Ladder layers of the model (`None`: a plain Llama).
    pub ladder_layers: Option<usize>,
    /// Bytes per parameter element (4 for f32 on the CPU, 2 for bf16).
    pub elem_bytes: usize,
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
                        // The trainers' default: f32 main gradients.
                        grad_bytes: GradReduceDtype::default().bytes(elem_bytes),
                        checkpointed_layers: ck,
                    };
                    let Some(base) = plan::evaluate(shape, cluster, &w, spec) else { continue };
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
                                format!(
                                    "needs {}, over {} (memory less the margin)",
                                    crate::memory::human(c.mem.total()),
                                    crate::memory::human(cap)
                                ),
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

pub const GIB: f64 = (1u64 << 30) as f64;

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
    let mut mem = plan::memory(m, w, spec, micro, space.workspace_bytes);
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
