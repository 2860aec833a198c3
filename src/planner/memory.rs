//! The memory estimator. Will this run fit? Peak memory per rank of a training configuration,
//! predicted before anything is allocated: parameters, gradients and optimizer states under the
//! layout's `ShardSpec` and tensor parallelism, activations with or without checkpointing, the
//! engines' transient buffers and a device workspace (with NCCL's buffers per communicator on a
//! multi-process GPU run). [`memory`] is the model (the step-time model, `plan` and
//! `autoconfig` rank layouts with it); [`estimate`] and [`check_layout`] map a run's flags onto
//! it and refuse, with the numbers, a run that cannot fit (`pretrain_llama`'s memory check).
//!
//! Measured against `ferrolm_tensor::peak_bytes` on the CPU engine (tests/memory_estimator.rs
//! holds it within 10% for several shard specs, with and without checkpointing).
use super::cluster::NCCL_BYTES_PER_COMMUNICATOR;
use super::shape::ModelShape;
use super::step::Workload;
use crate::nn::LlamaConfig;
use anyhow::{bail, Result};
use ferrolm_parallel::zero::{GradReduceDtype, ShardSpec};
use ferrolm_tensor::{DType, Device};

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

/// Activation bytes one rank keeps for backward per micro-batch of `b` sequences of `seq`
/// tokens, as ferrolm's ops save them (measured with `ferrolm_tensor::peak_bytes` on the CPU
/// engine, see docs/AUTOCONFIG.md): per token and layer about 10 hidden-sized tensors (norm
/// inputs, residuals, q/k/v, the attention output; the attention part split over `tp`) and 4
/// MLP-sized ones (gate, up, their SwiGLU and its input to down_proj); a checkpointed layer keeps
/// what its two residual branches return (2 hidden-sized tensors: a standard block's branches
/// return the stream with their output added, in their last GEMM; a Ladder block's, which add
/// late, keep 2 more, which the margin of the estimate covers), and the branch being recomputed
/// in backward holds its activations again. Plus the f32
/// logits (vocabulary split over `tp`) and the embedding output and final norm (2 hidden-sized).
pub fn activation_bytes(m: &ModelShape, w: &Workload) -> f64 {
    let (tokens, h, e) = ((w.micro_batch * w.seq) as f64, m.hidden as f64, w.elem_bytes as f64);
    let tp = w.tp.max(1) as f64;
    let i = m.intermediate as f64 / tp;
    let full = 4.0 * h + 6.0 * h / tp + 4.0 * i;
    let ck = w.checkpointed_layers.min(m.layers) as f64;
    // During backward one checkpointed branch at a time is recomputed: about half a layer.
    let recompute = if ck > 0.0 { 0.5 * full } else { 0.0 };
    let layers = (m.layers as f64 - ck) * full + ck * 2.0 * h + recompute;
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

/// Environment variable: `1` skips the refusal (the prediction is still printed).
pub const ENV_SKIP_CHECK: &str = "FERROLM_SKIP_MEMORY_CHECK";
/// Environment variable: a GPU's memory in GiB (no device query exists yet; without it a GPU
/// run is not refused, only told its prediction).
pub const ENV_DEVICE_GIB: &str = "FERROLM_DEVICE_MEMORY_GIB";

/// Bytes kept on a GPU for the CUDA context, cuBLAS(Lt) workspace and allocator slack.
pub const CUDA_WORKSPACE_BYTES: f64 = 1024.0 * 1024.0 * 1024.0;

/// Parameters of a LLaMA with this config, or None when the count overflows.
pub fn param_count(c: &LlamaConfig) -> Option<u64> {
    let u = |v: usize| v as u64;
    let (h, hd) = (u(c.hidden_size), u(c.head_dim));
    let q_o = h.checked_mul(u(c.num_attention_heads))?.checked_mul(hd)?.checked_mul(2)?;
    let k_v = h.checked_mul(u(c.num_key_value_heads))?.checked_mul(hd)?.checked_mul(2)?;
    let mlp = h.checked_mul(u(c.intermediate_size))?.checked_mul(3)?;
    let layer = q_o.checked_add(k_v)?.checked_add(mlp)?.checked_add(h.checked_mul(2)?)?;
    let embed = u(c.vocab_size).checked_mul(h)?;
    let head = if c.tie_word_embeddings { 0 } else { embed };
    layer.checked_mul(u(c.num_hidden_layers))?.checked_add(embed)?.checked_add(head)?.checked_add(h)
}

/// The batch of a run, as far as memory is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunShape {
    pub batch_size: usize,
    pub seq_len: usize,
    pub grad_accum: usize,
}

/// How a run is laid out over ranks, as far as memory is concerned.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemParallelism {
    pub tp: usize,
    pub dp: usize,
    pub spec: ShardSpec,
    /// Transformer layers whose activations are recomputed (the first ones; `usize::MAX`: all).
    pub checkpointed_layers: usize,
    /// Whether the ranks are threads of this process (their memory adds up in one RAM).
    pub thread_ranks: bool,
    /// `--offload-optimizer` with this subgroup size: the optimizer shard (master, m, v) lives
    /// in host memory; a device keeps two subgroups' state (12 B per element each: the one
    /// being updated and the next one's prefetch), as the autoconfig model counts it.
    pub offload_subgroup: Option<usize>,
    /// `--grad-reduce-dtype`: the dtype gradients are accumulated and reduced in.
    pub grad_reduce: GradReduceDtype,
}

impl MemParallelism {
    /// One device, no sharding.
    pub fn single(checkpointing: bool) -> MemParallelism {
        MemParallelism {
            tp: 1,
            dp: 1,
            spec: ShardSpec { params: 1, grads: 1, optim: 1 },
            checkpointed_layers: if checkpointing { usize::MAX } else { 0 },
            thread_ranks: false,
            offload_subgroup: None,
            grad_reduce: GradReduceDtype::default(),
        }
    }

    pub fn world(&self) -> usize {
        self.tp * self.dp
    }
}

/// Predicted peak bytes of one rank, broken down; None when the sizes overflow.
pub fn estimate(
    cfg: &LlamaConfig,
    dtype: DType,
    device: Device,
    batch: usize,
    seq: usize,
    grad_accum: usize,
    l: &MemParallelism,
) -> Option<Memory> {
    batch.checked_mul(seq)?.checked_mul(grad_accum)?;
    param_count(cfg)?;
    let shape = ModelShape::from_config(cfg, "run");
    let w = Workload {
        seq,
        micro_batch: batch,
        global_batch_tokens: (batch * seq * grad_accum).saturating_mul(l.dp),
        tp: l.tp.max(1),
        elem_bytes: dtype.size_in_bytes(),
        grad_bytes: l.grad_reduce.bytes(dtype.size_in_bytes()),
        checkpointed_layers: l.checkpointed_layers.min(cfg.num_hidden_layers),
    };
    let workspace = if device == Device::Cpu { 0.0 } else { CUDA_WORKSPACE_BYTES + nccl_buffer_bytes(cfg, l) };
    let mut m = memory(&shape, &w, l.spec, grad_accum, workspace);
    // Offloaded optimizer state leaves a device, not the host: on the CPU it stays counted.
    if let (Some(sub), false) = (l.offload_subgroup, device == Device::Cpu) {
        m.optim = m.optim.min(24.0 * sub as f64);
    }
    m.total().is_finite().then_some(m)
}

/// NCCL's buffers on each rank of a multi-process GPU run: one `NCCL_BYTES_PER_COMMUNICATOR`
/// per communicator (see `cluster::NCCL_BYTES_PER_COMMUNICATOR`); none for one rank or thread ranks (ThreadComm).
pub fn nccl_buffer_bytes(cfg: &LlamaConfig, l: &MemParallelism) -> f64 {
    if l.world() <= 1 || l.thread_ranks {
        return 0.0;
    }
    ferrolm_parallel::zero::groups::communicators(l.tp, l.dp, l.spec, cfg.num_key_value_heads) as f64 * NCCL_BYTES_PER_COMMUNICATOR
}

/// Bytes a single-device training step needs at its peak. None on overflow.
pub fn estimate_training_bytes(cfg: &LlamaConfig, dtype: DType, batch: usize, seq: usize, checkpointing: bool) -> Option<u64> {
    estimate(cfg, dtype, Device::Cpu, batch, seq, 1, &MemParallelism::single(checkpointing)).map(|m| m.total() as u64)
}

/// Memory the system can still give this process (`MemAvailable`), None where unknown.
pub fn available_host_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Bytes in GiB, or MiB below one GiB.
pub fn human(b: f64) -> String {
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", b / (1u64 << 20) as f64)
    }
}

fn gib(b: f64) -> String {
    human(b)
}

/// One line: the prediction per rank and its parts.
pub fn describe(m: &Memory) -> String {
    format!(
        "{} per rank (parameters {}, gradients {}, optimizer {}, activations {}, buffers {}, workspace {})",
        gib(m.total()),
        gib(m.params),
        gib(m.grads),
        gib(m.optim),
        gib(m.activations),
        gib(m.buffers),
        gib(m.workspace)
    )
}

/// Checks a run laid out by `l`: the batch sizes, the host batch buffers against the host's
/// available memory, and the predicted peak against the memory it will get: on the CPU the
/// host's available memory (thread ranks add up), on a GPU `FERROLM_DEVICE_MEMORY_GIB` when set.
/// `FERROLM_SKIP_MEMORY_CHECK=1` turns the refusal of the prediction into a warning. Returns
/// the prediction per rank.
pub fn check_layout(cfg: &LlamaConfig, dtype: DType, device: Device, o: &RunShape, l: &MemParallelism) -> Result<Memory> {
    let Some(tokens) = o.batch_size.checked_mul(o.seq_len) else {
        bail!("--batch-size {} × --seq-len {} overflows: lower --batch-size", o.batch_size, o.seq_len);
    };
    if tokens.checked_mul(o.grad_accum).is_none() {
        bail!("--batch-size {} × --seq-len {} × --grad-accum {} overflows: lower --grad-accum", o.batch_size, o.seq_len, o.grad_accum);
    }
    let avail = available_host_bytes();
    // Inputs and targets as i32 on the host, one batch at a time.
    let host = (tokens as u64).checked_mul(8);
    if let (Some(avail), Some(need)) = (avail, host) {
        if need > avail {
            bail!(
                "--batch-size {} with --seq-len {}: the batch alone needs {} of host memory, {} are available: lower --batch-size",
                o.batch_size,
                o.seq_len,
                gib(need as f64),
                gib(avail as f64)
            );
        }
    }
    let Some(mem) = estimate(cfg, dtype, device, o.batch_size, o.seq_len, o.grad_accum, l).filter(|_| host.is_some()) else {
        bail!("--batch-size {} with --seq-len {}: the memory estimate overflows: lower --batch-size", o.batch_size, o.seq_len);
    };
    let skip = std::env::var(ENV_SKIP_CHECK).is_ok_and(|v| v == "1");
    let (need, cap, what) = if device == Device::Cpu {
        let ranks = if l.thread_ranks { l.world() as f64 } else { 1.0 };
        (mem.total() * ranks, avail.map(|a| a as f64), if ranks > 1.0 { "host memory for all thread ranks" } else { "host memory" })
    } else {
        let cap = std::env::var(ENV_DEVICE_GIB).ok().and_then(|v| v.parse::<f64>().ok()).map(|g| g * (1u64 << 30) as f64);
        (mem.total(), cap, "device memory per rank")
    };
    if let Some(cap) = cap {
        if need > cap {
            let msg = format!(
                "--batch-size {} with --seq-len {} needs about {} of {what} ({}) but {} are available: lower --batch-size \
                 (raise --grad-accum for the same tokens per step) or --seq-len, pass --activation-checkpointing, or shard more \
                 (--zero, --shard-*); {ENV_SKIP_CHECK}=1 runs it anyway",
                o.batch_size,
                o.seq_len,
                gib(need),
                describe(&mem),
                gib(cap)
            );
            if skip {
                tracing::warn!("{msg}");
            } else {
                bail!("{msg}");
            }
        }
    }
    Ok(mem)
}
