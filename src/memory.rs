//! Will this run fit? A rough, deliberately simple estimate of a training run's memory, checked
//! before anything is allocated, so that `--batch-size 1000000000000` is an error naming the
//! flag instead of an abort inside the allocator. A full estimator (sharding, offload,
//! recomputation) replaces [`estimate_training_bytes`]; keep every caller going through it.
use crate::nn::LlamaConfig;
use crate::train::TrainOptions;
use anyhow::{bail, Result};
use ferrolm_tensor::{DType, Device};

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

/// Bytes a training step needs, roughly: weights, gradients and two f32 AdamW moments per
/// parameter (plus an f32 master copy below f32), and the activations kept for backward (every
/// layer's, or one layer's plus the layer inputs under activation checkpointing), the logits
/// and their gradient in f32, and the attention scores of the unfused path. None on overflow.
pub fn estimate_training_bytes(cfg: &LlamaConfig, dtype: DType, batch: usize, seq: usize, checkpointing: bool) -> Option<u64> {
    let params = param_count(cfg)?;
    let el = dtype.size_in_bytes() as u64;
    let master = if dtype == DType::F32 { 0 } else { 4 };
    let state = params.checked_mul(2 * el + 8 + master)?;
    let tokens = (batch as u64).checked_mul(seq as u64)?;
    let (h, i, heads) = (cfg.hidden_size as u64, cfg.intermediate_size as u64, cfg.num_attention_heads as u64);
    // Per token and layer: ~10 hidden-sized tensors (norms, q/k/v/o, residuals), ~4 MLP-sized
    // (gate, up, their product, the activation), and a row of attention scores per head.
    let per_layer = h.checked_mul(10)?.checked_add(i.checked_mul(4)?)?.checked_add(heads.checked_mul(seq as u64)?)?;
    let layers = cfg.num_hidden_layers as u64;
    let kept = if checkpointing { per_layer.checked_add(h.checked_mul(layers)?)? } else { per_layer.checked_mul(layers)? };
    let acts = tokens.checked_mul(kept)?.checked_mul(el)?;
    let logits = tokens.checked_mul(cfg.vocab_size as u64)?.checked_mul(12)?;
    state.checked_add(acts)?.checked_add(logits)
}

/// Memory the system can still give this process (`MemAvailable`), None where unknown.
pub fn available_host_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

/// Refuses, naming the flag, a batch whose sizes overflow or that cannot fit: the host batch
/// buffers against the host's available memory, and on the CPU the whole estimate as well.
/// (A CUDA device's free memory is not queried yet: only the host side is checked there.)
pub fn check_fits(cfg: &LlamaConfig, dtype: DType, device: Device, o: &TrainOptions, checkpointing: bool) -> Result<()> {
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
                gib(need),
                gib(avail)
            );
        }
    }
    let Some(need) = estimate_training_bytes(cfg, dtype, o.batch_size, o.seq_len, checkpointing).filter(|_| host.is_some()) else {
        bail!("--batch-size {} with --seq-len {}: the memory estimate overflows: lower --batch-size", o.batch_size, o.seq_len);
    };
    if device == Device::Cpu {
        if let Some(avail) = avail {
            if need > avail {
                bail!(
                    "--batch-size {} with --seq-len {} needs about {} (weights, gradients, optimizer state, activations) but {} are available: \
                     lower --batch-size (raise --grad-accum for the same tokens per step) or --seq-len, or pass --activation-checkpointing",
                    o.batch_size,
                    o.seq_len,
                    gib(need),
                    gib(avail)
                );
            }
        }
    }
    Ok(())
}
