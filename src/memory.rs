//! Will this run fit? Peak memory per rank of a training configuration, predicted before
//! anything is allocated: parameters, gradients and optimizer states under the layout's
//! `ShardSpec` and tensor parallelism, activations with or without checkpointing, the engines'
//! transient buffers and a device workspace (with NCCL's buffers per communicator on a
//! multi-process GPU run). The model is `ferrolm_dist::plan::memory` (the
//! planner and the auto-configurator rank layouts with the same numbers); this module maps a
//! run's flags onto it and refuses, with the numbers, a run that cannot fit.
//!
//! Measured against `ferrolm_tensor::peak_bytes` on the CPU engine (tests/memory_estimator.rs
//! holds it within 10% for several shard specs, with and without checkpointing).
use crate::nn::LlamaConfig;
use anyhow::{bail, Result};
use ferrolm_dist::plan::{self, Memory, ModelShape, Workload};
use ferrolm_dist::zero::{GradReduceDtype, ShardSpec};
use ferrolm_tensor::{DType, Device};

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
pub struct MemLayout {
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

impl MemLayout {
    /// One device, no sharding.
    pub fn single(checkpointing: bool) -> MemLayout {
        MemLayout {
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
    l: &MemLayout,
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
    let mut m = plan::memory(&shape, &w, l.spec, grad_accum, workspace);
    // Offloaded optimizer state leaves a device, not the host: on the CPU it stays counted.
    if let (Some(sub), false) = (l.offload_subgroup, device == Device::Cpu) {
        m.optim = m.optim.min(24.0 * sub as f64);
    }
    m.total().is_finite().then_some(m)
}

/// NCCL's buffers on each rank of a multi-process GPU run: one `NCCL_BYTES_PER_COMMUNICATOR`
/// per communicator (see `ferrolm_dist::plan`); none for one rank or thread ranks (ThreadComm).
pub fn nccl_buffer_bytes(cfg: &LlamaConfig, l: &MemLayout) -> f64 {
    if l.world() <= 1 || l.thread_ranks {
        return 0.0;
    }
    plan::communicators(l.tp, l.dp, l.spec, cfg.num_key_value_heads) as f64 * plan::NCCL_BYTES_PER_COMMUNICATOR
}

/// Bytes a single-device training step needs at its peak. None on overflow.
pub fn estimate_training_bytes(cfg: &LlamaConfig, dtype: DType, batch: usize, seq: usize, checkpointing: bool) -> Option<u64> {
    estimate(cfg, dtype, Device::Cpu, batch, seq, 1, &MemLayout::single(checkpointing)).map(|m| m.total() as u64)
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
pub fn check_layout(cfg: &LlamaConfig, dtype: DType, device: Device, o: &RunShape, l: &MemLayout) -> Result<Memory> {
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
