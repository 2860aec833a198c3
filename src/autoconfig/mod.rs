//! The auto-configurator: from a compute budget or a model, the model's size and shape, its
//! base hyper-parameters (each with its published source, docs/AUTOCONFIG.md), and the layouts
//! worth running, ranked by the planner (`crate::planner::layouts`); `trial` then runs the best
//! few with the real trainer and re-ranks by measured tokens/s (`examples/autoconfig.rs`).
pub mod run;
pub mod trial;

pub use run::{
    run, Machines, ModelRequest, OffloadRequest, Report, Request, SearchRequest, Target, ThreadCluster, TrialData, Trials, CPU_PRESETS,
    DEFAULT_SEQ_LEN, GPU_PRESETS,
};

use crate::planner::ModelShape;
use anyhow::{bail, Result};
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
