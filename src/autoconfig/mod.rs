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
            extras: Default::default(),
            windows: vec![],
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

/// The base training recipe for a model of `params` parameters on sequences of `seq` tokens:
/// the published values ([`hyper_params`]), then what a run of it trains ([`HyperParams::for_run`]).
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
    pub precision: String,
    /// Chinchilla's compute-optimal tokens (~20 per parameter), when no budget gave them.
    pub chinchilla_tokens: f64,
    /// Optimizer steps of the run ([`HyperParams::for_run`]; 0 before).
    pub steps: usize,
    pub rows: Vec<Row>,
    #[serde(skip)]
    lr_source: &'static str,
    #[serde(skip)]
    batch_source: &'static str,
    #[serde(skip)]
    tokens_source: &'static str,
}

/// Warmup of the recipe: LLaMA's 2000 steps, at most a tenth of a shorter run.
pub const WARMUP_STEPS: usize = 2000;

/// The published recipe (docs/AUTOCONFIG.md has the table with the sources).
pub fn hyper_params(params: f64, seq: usize) -> HyperParams {
    let (lr, lr_source) = if params < 0.25e9 {
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
    let (target, batch_source) = if params < 1.0e9 {
        (0.5e6, "GPT-3 Table 2.1 (0.5M tokens below 1B)")
    } else {
        (4.0e6, "LLaMA-1/2 (4M tokens); Ladder (2048 x 2048)")
    };
    let seqs = ((target / seq as f64).log2().round().max(0.0) as u32).min(30);
    let global_batch_sequences = 1usize << seqs;
    let mut h = HyperParams {
        lr,
        min_lr: lr / 10.0,
        schedule: "cosine",
        warmup_steps: WARMUP_STEPS,
        global_batch_tokens: global_batch_sequences * seq,
        global_batch_sequences,
        weight_decay: 0.1,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-5,
        init_std: 0.02,
        grad_clip: 1.0,
        precision: "bf16".into(),
        chinchilla_tokens: 20.0 * params,
        steps: 0,
        rows: Vec::new(),
        lr_source,
        batch_source,
        tokens_source: "Chinchilla Table 3 (Approach 1 projections: 20.2-22 tokens per parameter)",
    };
    h.rows = h.make_rows(seq, None);
    h
}

impl HyperParams {
    /// The recipe as `pretrain_llama --config-from` trains it, and so as the tool prints it:
    /// the searched global batch of `global_batch_tokens` (`--global-batch-tokens` overrides the
    /// recipe's), `tokens` (a budget's, else Chinchilla's) in whole steps of it, LLaMA's warmup
    /// capped at a tenth of those steps, ferrolm's AdamW eps (GPT-3's 1e-8, not Llama 2's 1e-5)
    /// and `dtype`. Peak lr, the cosine to 10%, weight decay, betas, clipping and init std are
    /// pretrain_llama's own already (tests/autoconfig.rs holds each row to what trains).
    pub fn for_run(mut self, seq: usize, global_batch_tokens: usize, tokens: Option<f64>, dtype: crate::DType) -> HyperParams {
        if global_batch_tokens != self.global_batch_tokens {
            self.batch_source = "--global-batch-tokens";
        }
        self.global_batch_tokens = global_batch_tokens;
        self.global_batch_sequences = global_batch_tokens / seq.max(1);
        if tokens.is_some() {
            self.tokens_source = "the budget";
        }
        let tokens = tokens.unwrap_or(self.chinchilla_tokens);
        self.steps = ((tokens / global_batch_tokens.max(1) as f64).ceil() as usize).max(1);
        self.warmup_steps = WARMUP_STEPS.min(self.steps / 10).max(1);
        self.eps = ferrolm_nn::optim::AdamWConfig::default().eps;
        self.precision = if dtype == crate::DType::F32 { "f32".into() } else { "bf16 (fp32 master weights and optimizer state)".into() };
        self.rows = self.make_rows(seq, Some(tokens));
        self
    }

    fn make_rows(&self, seq: usize, tokens: Option<f64>) -> Vec<Row> {
        let warmup_source = if self.warmup_steps < WARMUP_STEPS {
            "LLaMA-1 §2.3; Llama 2 §2.2 (2000), at most a tenth of the run's steps"
        } else {
            "LLaMA-1 §2.3; Llama 2 §2.2; Ladder configs"
        };
        let (eps, eps_source) = if self.eps == 1e-5 {
            ("1e-5", "Llama 2 §2.2 (GPT-3: 1e-8; Ladder: 1e-10)")
        } else {
            ("1e-8", "GPT-3 (ferrolm's AdamW; Llama 2: 1e-5; Ladder: 1e-10)")
        };
        let mut rows = vec![
            Row { name: "peak lr", value: format!("{:.1e}", self.lr), source: self.lr_source },
            Row {
                name: "schedule",
                value: "warmup, then cosine to 10% of peak".into(),
                source: "LLaMA-1 §2.3; Llama 2 §2.2; Ladder (lr_decay_factor 0.1)",
            },
            Row { name: "warmup", value: format!("{} steps", self.warmup_steps), source: warmup_source },
            Row {
                name: "global batch",
                value: format!("{} x {} = {} tokens", self.global_batch_sequences, seq, self.global_batch_tokens),
                source: self.batch_source,
            },
            Row { name: "weight decay", value: format!("{}", self.weight_decay), source: "LLaMA-1/2; GPT-3; Ladder" },
            Row { name: "AdamW betas", value: format!("({}, {})", self.beta1, self.beta2), source: "LLaMA-1/2; GPT-3; Ladder" },
            Row { name: "AdamW eps", value: eps.into(), source: eps_source },
            Row {
                name: "init std",
                value: format!("{}", self.init_std),
                source: "Ladder configs (initializer_range); LLaMA does not state it",
            },
            Row { name: "gradient clipping", value: format!("{:.1}", self.grad_clip), source: "LLaMA-1/2; GPT-3; Ladder" },
            Row { name: "precision", value: self.precision.clone(), source: "Ladder configs; NeMo 175B config (f32 on the CPU)" },
        ];
        rows.push(match tokens {
            None => {
                Row { name: "tokens", value: format!("{:.3e} (~20 per parameter)", self.chinchilla_tokens), source: self.tokens_source }
            }
            Some(t) => Row { name: "tokens", value: format!("{t:.3e}: {} steps", self.steps), source: self.tokens_source },
        });
        rows
    }
}
