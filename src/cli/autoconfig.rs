//! `autoconfig`: the tool (`examples/autoconfig.rs` wraps `run`). Two targets:
//! - `--target cpu`: thread ranks of this machine behind a simulated two-level link; compute,
//!   the optimizer's rate and the communicator's cost are calibrated here, and `--trials K`
//!   runs the top K layouts with the real trainer;
//! - `--target gpu`: a modelled cluster (throughput, bandwidths and memory from the flags).
use super::{env_help, fraction, positive, LogArgs, Tool, ENV_COMMON};
use crate::autoconfig::trial::{calibrate, run_trial, Calibration, Measured, TrainConfig, TrialSetup};
use crate::autoconfig::{hyper_params, params_from_budget, search, shape_for_params, Budget, Candidate, OffloadRates, SearchSpace, GIB};
use crate::data::Tokenizer;
use crate::nn::{LadderLayers, LlamaConfig};
use crate::AnyResult;
use anyhow::{bail, Context};
use clap::{Parser, ValueEnum};
use ferrolm_dist::cost::{Link, LinkModel};
use ferrolm_dist::plan::{Cluster, ModelShape};
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Target {
    Cpu,
    Gpu,
}

#[derive(Parser, Debug, Clone)]
#[command(
    name = "autoconfig",
    about = "Pick a model size (from a budget), its base hyper-parameters, and the fastest parallel layout that fits: TP, a \
             ZeRO/AMSP ShardSpec, micro-batch size, checkpointed layers, optimizer offload; ranked by the analytic step-time \
             model, then (on CPU thread ranks) by measured trials. Writes train_config.json for pretrain_llama --config-from; \
             the last line of stdout is the chosen layout as JSON.",
    after_help = env_help(&[ENV_COMMON])
)]
pub struct AutoconfigArgs {
    /// Model: a preset (cpu: tiny, small; gpu: 7b, 13b, 30b, 70b, gpt3-5b, gpt3-175b) or a
    /// config.json; a GPU preset with GPU flags (--gpus ...) implies --target gpu
    /// [default: from the budget flags]
    #[arg(long, value_name = "PRESET|FILE", help_heading = "Model")]
    pub model: Option<String>,
    /// Budget: training days [default: no budget; --model gives the model]
    #[arg(long, help_heading = "Model", requires_all = ["tflops_per_gpu", "tokens"])]
    pub days: Option<f64>,
    /// Budget: achieved TFLOP/s per GPU (also the modelled GEMM throughput of --target gpu)
    /// [default: none; --target gpu then assumes 60% of --peak-tflops]
    #[arg(long, help_heading = "Model")]
    pub tflops_per_gpu: Option<f64>,
    /// Budget: training tokens [default: none]
    #[arg(long, help_heading = "Model")]
    pub tokens: Option<f64>,
    /// Vocabulary of a shape picked from the budget
    #[arg(long, default_value = "32000", value_parser = positive, help_heading = "Model")]
    pub vocab: usize,
    /// A Ladder Transformer: `all`, the last N layers, or i,j,k (its TP all-reduces overlap)
    /// [default: the model's own; a plain Llama]
    #[arg(long, value_name = "all|N|i,j,k", help_heading = "Model")]
    pub ladder_layers: Option<String>,

    /// cpu: thread ranks here, calibrated, trials possible; gpu: a modelled cluster
    /// [default: gpu for a GPU preset given with a GPU flag, else cpu]
    #[arg(long = "target", value_enum, help_heading = "Cluster")]
    pub target_flag: Option<Target>,
    /// The target in effect (`--target`, else as its help says), set by `autoconfig`.
    #[arg(skip = Target::Cpu)]
    pub target: Target,
    /// GPUs in all (gpu; with a budget also on cpu) [default: --nodes x --ranks-per-node]
    #[arg(long, value_parser = positive, help_heading = "Cluster")]
    pub gpus: Option<usize>,
    /// GPUs per node (gpu) [default: 8]
    #[arg(long, value_parser = positive, help_heading = "Cluster")]
    pub gpus_per_node: Option<usize>,
    /// Memory per GPU, GiB (gpu) [default: 80]
    #[arg(long, help_heading = "Cluster")]
    pub gpu_mem_gib: Option<f64>,
    /// Peak dense bf16 TFLOP/s per GPU, for MFU (gpu) [default: 312, A100]
    #[arg(long, help_heading = "Cluster")]
    pub peak_tflops: Option<f64>,
    /// Intra-node bandwidth per rank and direction, GB/s (gpu) [default: 150, NVLink 3 at NCCL bus bandwidth]
    #[arg(long, help_heading = "Cluster")]
    pub intra_gb_s: Option<f64>,
    /// Inter-node bandwidth per rank and direction, GB/s (gpu) [default: 25, 8 x HDR 200 Gb/s per 8 GPUs]
    #[arg(long, help_heading = "Cluster")]
    pub inter_gb_s: Option<f64>,
    /// GPU memory bandwidth, GB/s (the on-device optimizer update is memory bound) (gpu) [default: 2000]
    #[arg(long, help_heading = "Cluster")]
    pub hbm_gb_s: Option<f64>,
    /// Consider optimizer offload (gpu): host link GB/s per direction [default: offload not considered]
    #[arg(long, value_name = "GB/S", help_heading = "Cluster")]
    pub offload_pcie_gb_s: Option<f64>,
    /// CPU AdamW rate per GPU's share of the host, elements/s, for offload (gpu) [default: 1e9]
    #[arg(long, help_heading = "Cluster")]
    pub offload_cpu_adam: Option<f64>,
    /// Elements per offload subgroup
    #[arg(long, default_value = "100000000", value_parser = positive, help_heading = "Cluster")]
    pub offload_subgroup_size: usize,
    /// Dtype of weights and activations the layouts are sized and the trials run in: f32, or bf16
    /// with fp32 master weights and optimizer state [default: f32 for --target cpu, bf16 for gpu]
    #[arg(long, value_name = "f32|bf16", help_heading = "Cluster")]
    pub dtype: Option<super::ComputeDtype>,
    /// Simulated nodes (cpu)
    #[arg(long, default_value = "2", value_parser = positive, help_heading = "Cluster")]
    pub nodes: usize,
    /// Thread ranks per simulated node (cpu)
    #[arg(long, default_value = "2", value_parser = positive, help_heading = "Cluster")]
    pub ranks_per_node: usize,
    /// Simulated intra-node link, MB/s per rank (cpu)
    #[arg(long, default_value = "400", help_heading = "Cluster")]
    pub intra_mb_s: f64,
    /// Simulated inter-node link, MB/s per rank (cpu)
    #[arg(long, default_value = "25", help_heading = "Cluster")]
    pub inter_mb_s: f64,
    /// Memory cap per rank, MiB (cpu) [default: the available RAM over the ranks]
    #[arg(long, help_heading = "Cluster")]
    pub mem_cap_mib: Option<f64>,
    /// Memory kept free, a fraction of the cap
    #[arg(long, default_value = "0.1", value_parser = fraction, help_heading = "Cluster")]
    pub margin: f64,

    /// Tokens per sequence [default: 2048, or the model's max_position_embeddings when shorter]
    #[arg(long = "seq-len", value_parser = positive, help_heading = "Search")]
    pub seq_len_flag: Option<usize>,
    /// The sequence length in effect (`--seq-len`, else the default above), set by `autoconfig`.
    #[arg(skip)]
    pub seq_len: usize,
    /// Tokens per optimizer step [default: the recipe's global batch]
    #[arg(long, value_parser = positive, help_heading = "Search")]
    pub global_batch_tokens: Option<usize>,
    /// Micro-batch sizes tried
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8", help_heading = "Search")]
    pub micro_batches: Vec<usize>,
    /// Largest tensor-parallel degree tried (inside a node)
    #[arg(long, default_value = "8", value_parser = positive, help_heading = "Search")]
    pub max_tp: usize,
    /// Rows of the modelled table
    #[arg(long, default_value = "12", value_parser = positive, help_heading = "Search")]
    pub top: usize,

    /// Run the top K layouts with the real trainer (cpu) and re-rank by measured tokens/s
    #[arg(long, default_value = "0", help_heading = "Trials")]
    pub trials: usize,
    /// Timed steps per trial (after one warm-up step; the median is used)
    #[arg(long, default_value = "3", value_parser = positive, help_heading = "Trials")]
    pub trial_steps: usize,
    /// Training data for trials: a prepared directory, or text and datasets as pretrain_llama's
    /// --data takes them [default: the bundled corpus]
    #[arg(long, help_heading = "Trials")]
    pub data: Option<PathBuf>,
    /// Tokenizer [default: data/tokenizer.json]
    #[arg(long, help_heading = "Trials")]
    pub tokenizer: Option<PathBuf>,

    /// Output directory: train_config.json (and the model's config.json on cpu)
    #[arg(long, default_value = "runs/autoconfig", help_heading = "Output")]
    pub out: PathBuf,
    #[command(flatten)]
    pub log: LogArgs,
}

/// The presets of `--model`, as `--help` names them.
pub const CPU_PRESETS: [&str; 2] = ["tiny", "small"];
pub const GPU_PRESETS: [&str; 6] = ["7b", "13b", "30b", "70b", "gpt3-5b", "gpt3-175b"];

impl AutoconfigArgs {
    /// `--dtype`, else the target's: f32 on the CPU, bf16 on GPUs.
    pub fn compute_dtype(&self) -> super::ComputeDtype {
        self.dtype.unwrap_or(if self.target == Target::Cpu { super::ComputeDtype::F32 } else { super::ComputeDtype::Bf16 })
    }
    /// The GPU flags given on the command line (those that describe the modelled cluster).
    pub fn gpu_flags_given(&self) -> Vec<&'static str> {
        let given = [
            ("--gpus", self.gpus.is_some()),
            ("--gpus-per-node", self.gpus_per_node.is_some()),
            ("--gpu-mem-gib", self.gpu_mem_gib.is_some()),
            ("--peak-tflops", self.peak_tflops.is_some()),
            ("--intra-gb-s", self.intra_gb_s.is_some()),
            ("--inter-gb-s", self.inter_gb_s.is_some()),
            ("--hbm-gb-s", self.hbm_gb_s.is_some()),
            ("--offload-pcie-gb-s", self.offload_pcie_gb_s.is_some()),
            ("--offload-cpu-adam", self.offload_cpu_adam.is_some()),
        ];
        given.into_iter().filter(|g| g.1).map(|g| g.0).collect()
    }

    /// `--target`, or what `--model` and the GPU flags imply: a GPU preset is a modelled
    /// cluster (far too large to calibrate on this CPU), so GPU flags with one mean gpu, and
    /// without them the error says which flag to add.
    pub fn resolve_target(&self) -> AnyResult<Target> {
        let gpu_preset = self.model.as_deref().filter(|m| GPU_PRESETS.contains(m) && !Path::new(m).is_file());
        let given = self.gpu_flags_given();
        match (self.target_flag, gpu_preset) {
            (Some(t), None) => Ok(t),
            (None, None) => Ok(Target::Cpu),
            (Some(Target::Gpu), Some(_)) => Ok(Target::Gpu),
            (Some(Target::Cpu), Some(m)) => bail!(
                "--model {m} is a GPU preset, modelled on a GPU cluster only (--target cpu calibrates models it can build here: \
                 {}): use --target gpu with --gpus N",
                CPU_PRESETS.join(", ")
            ),
            (None, Some(m)) if !given.is_empty() => {
                tracing::info!("--model {m} with {}: --target gpu", given.join(", "));
                Ok(Target::Gpu)
            }
            (None, Some(m)) => bail!(
                "--model {m} is a GPU preset: add --gpus N (the GPUs in all; --gpus-per-node and --gpu-mem-gib describe them, \
                 defaults 8 and 80), which implies --target gpu"
            ),
        }
    }
}

impl Tool for AutoconfigArgs {
    fn log_args(&self) -> &LogArgs {
        &self.log
    }
}

/// What a run found.
#[derive(Debug)]
pub struct Report {
    pub ranked: Vec<Candidate>,
    pub measured: Vec<(Candidate, Measured)>,
    pub chosen: Candidate,
    pub config_path: PathBuf,
    pub json: serde_json::Value,
}

fn config_for_shape(s: &ModelShape, seq: usize) -> LlamaConfig {
    let tiny = LlamaConfig::preset("tiny").expect("preset");
    LlamaConfig {
        vocab_size: s.vocab,
        hidden_size: s.hidden,
        intermediate_size: s.intermediate,
        num_hidden_layers: s.layers,
        num_attention_heads: s.heads,
        num_key_value_heads: s.kv_heads,
        head_dim: s.head_dim,
        max_position_embeddings: seq.max(tiny.max_position_embeddings),
        tie_word_embeddings: s.tied,
        ..tiny
    }
}

/// The model: its shape, and on the CPU target a config the trials can build.
const DEFAULT_SEQ_LEN: usize = 2048;

fn model(a: &mut AutoconfigArgs) -> AnyResult<(ModelShape, Option<LlamaConfig>, Option<f64>)> {
    let budget = match (a.days, a.tflops_per_gpu, a.tokens) {
        (Some(days), Some(tf), Some(tokens)) => {
            let gpus = a.gpus.unwrap_or(a.nodes * a.ranks_per_node);
            Some(params_from_budget(&Budget { days, gpus, tflops_per_gpu: tf, tokens })?)
        }
        _ => None,
    };
    let (shape, cfg) = match (&a.model, budget) {
        (Some(m), _) if Path::new(m).is_file() => {
            let c = LlamaConfig::from_file(m).with_context(|| format!("--model {m}"))?;
            (ModelShape::from_config(&c, m), Some(c))
        }
        (Some(m), _) if CPU_PRESETS.contains(&m.as_str()) => {
            let c = LlamaConfig::preset(m).context("--model")?;
            // On the CPU the trials train it with the tokenizer; a modelled GPU keeps its vocabulary.
            let c = if a.target == Target::Cpu { c.with_vocab_size(tokenizer(a)?.vocab_size()) } else { c };
            (ModelShape::from_config(&c, m), Some(c))
        }
        (Some(m), _) if GPU_PRESETS.contains(&m.as_str()) => (ModelShape::preset(m)?, None),
        (Some(m), _) => {
            bail!("--model {m}: not a preset (cpu: {}; gpu: {}) nor a config.json file", CPU_PRESETS.join(", "), GPU_PRESETS.join(", "))
        }
        (None, Some(p)) => {
            let s = shape_for_params(p, a.vocab);
            let c = config_for_shape(&s, a.seq_len);
            (s, Some(c))
        }
        (None, None) => bail!("give --model, or a budget: --days, --tflops-per-gpu and --tokens (with --gpus)"),
    };
    let mut cfg = cfg;
    if let (Some(c), Some(l)) = (cfg.as_mut(), &a.ladder_layers) {
        c.ladder_layers = Some(LadderLayers::parse_flag(l, c.num_hidden_layers).context("--ladder-layers")?);
        c.validate().context("--ladder-layers")?;
    }
    if let Some(c) = &cfg {
        if a.seq_len_flag.is_none() {
            a.seq_len = a.seq_len.min(c.max_position_embeddings);
        }
        if a.seq_len > c.max_position_embeddings {
            bail!("--seq-len {} is longer than the model's max_position_embeddings ({})", a.seq_len, c.max_position_embeddings);
        }
    }
    Ok((shape, cfg, budget))
}

fn tokenizer(a: &AutoconfigArgs) -> AnyResult<Tokenizer> {
    let p = a.tokenizer.clone().unwrap_or_else(|| crate::cli::bundled("data/tokenizer.json"));
    Tokenizer::from_file(&p).with_context(|| format!("cannot load the tokenizer {}", p.display()))
}

fn ladder_count(a: &AutoconfigArgs, shape: &ModelShape, cfg: Option<&LlamaConfig>) -> AnyResult<Option<usize>> {
    if let Some(l) = cfg.and_then(|c| c.ladder_layers.as_ref()) {
        return Ok(Some(l.mask(shape.layers).iter().filter(|&&b| b).count()));
    }
    match &a.ladder_layers {
        Some(l) => Ok(Some(LadderLayers::parse_flag(l, shape.layers)?.mask(shape.layers).iter().filter(|&&b| b).count())),
        None => Ok(None),
    }
}

fn mib(b: f64) -> f64 {
    b / (1u64 << 20) as f64
}

pub fn run(a: AutoconfigArgs) -> AnyResult<()> {
    let r = autoconfig(&a)?;
    println!("{}", r.json);
    Ok(())
}

/// Everything but the final JSON line.
pub fn autoconfig(a: &AutoconfigArgs) -> AnyResult<Report> {
    let mut args = a.clone();
    args.seq_len = a.seq_len_flag.unwrap_or(DEFAULT_SEQ_LEN);
    args.target = args.resolve_target()?;
    let a = &mut args;
    if a.micro_batches.contains(&0) {
        bail!("--micro-batches: sizes must be at least 1");
    }
    if a.trials > 0 && a.target == Target::Gpu {
        bail!("--trials runs on CPU thread ranks (--target cpu); a GPU cluster is modelled only");
    }
    let (shape, cfg, budget) = model(a)?;
    let a = &*a;
    let params = shape.params() as f64;
    if let Some(p) = budget {
        println!(
            "budget: {} days x {} GPUs x {} TFLOP/s on {:.3e} tokens trains P = days*86400*gpus*F/(8*T) = {:.3}B parameters; nearest shape {}",
            a.days.unwrap_or(0.0),
            a.gpus.unwrap_or(a.nodes * a.ranks_per_node),
            a.tflops_per_gpu.unwrap_or(0.0),
            a.tokens.unwrap_or(0.0),
            p / 1e9,
            shape.name
        );
    }
    println!(
        "model {}: {:.4}B parameters, {} layers, hidden {}, {} heads ({} kv), ffn {}, vocab {}",
        shape.name,
        params / 1e9,
        shape.layers,
        shape.hidden,
        shape.heads,
        shape.kv_heads,
        shape.intermediate,
        shape.vocab
    );
    let hp = hyper_params(params, a.seq_len);
    println!("{:<18} {:<40} source", "hyper-parameter", "value");
    for r in &hp.rows {
        println!("{:<18} {:<40} {}", r.name, r.value, r.source);
    }
    let global = a.global_batch_tokens.unwrap_or(hp.global_batch_tokens);
    let ladder = ladder_count(a, &shape, cfg.as_ref())?;

    let mut flops_by_mbs = Vec::new();
    let (cluster, calib) = match a.target {
        Target::Gpu => {
            let gpus = a.gpus.context("--target gpu needs --gpus N (the GPUs in all)")?;
            let per_node = a.gpus_per_node.unwrap_or(8).min(gpus);
            let peak = a.peak_tflops.unwrap_or(312.0);
            let tf = a.tflops_per_gpu.unwrap_or(0.6 * peak);
            let c = Cluster {
                gpus,
                gpus_per_node: per_node,
                mem_bytes: a.gpu_mem_gib.unwrap_or(80.0) * GIB,
                link: LinkModel::two_level(
                    Link::new(5e-6, a.intra_gb_s.unwrap_or(150.0) * 1e9),
                    Link::new(15e-6, a.inter_gb_s.unwrap_or(25.0) * 1e9),
                    per_node,
                ),
                flops: tf * 1e12,
                peak_flops: peak * 1e12,
                margin: a.margin,
                interference: 0.2,
                update_s_per_elem: 28.0 / (a.hbm_gb_s.unwrap_or(2000.0) * 1e9),
                comm_cpu_s_per_byte: 0.0,
                comm_buffer_bytes: ferrolm_dist::plan::NCCL_BYTES_PER_COMMUNICATOR,
            };
            (c, None)
        }
        Target::Cpu => {
            let cfg = cfg.as_ref().context("--target cpu needs a model it can build (a preset or config.json)")?;
            let world = a.nodes * a.ranks_per_node;
            let mut sizes = a.micro_batches.clone();
            sizes.sort_unstable();
            sizes.dedup();
            let mut by_mbs = Vec::new();
            let mut cal = None;
            for &mbs in &sizes {
                let c = calibrate(cfg, world, mbs, a.seq_len)?;
                by_mbs.push((mbs, c.flops));
                cal.get_or_insert(c);
            }
            let cal = Calibration { flops: by_mbs.iter().map(|x| x.1).fold(0.0, f64::max), ..cal.context("--micro-batches is empty")? };
            flops_by_mbs = by_mbs;
            let cap = match a.mem_cap_mib {
                Some(m) => m * (1u64 << 20) as f64,
                None => crate::memory::available_host_bytes().map_or(8.0 * GIB, |b| b as f64 / world as f64),
            };
            println!(
                "calibrated on {world} thread ranks: {} GFLOP/s per rank by micro-batch size, optimizer {:.1} ns/element, communicator {:.2} ns/byte; \
                 simulated link intra {} MB/s, inter {} MB/s ({} nodes x {}); memory cap {:.1} MiB per rank",
                flops_by_mbs.iter().map(|(m, f)| format!("{m}: {:.2}", f / 1e9)).collect::<Vec<_>>().join(", "),
                cal.update_s_per_elem * 1e9,
                cal.comm_cpu_s_per_byte * 1e9,
                a.intra_mb_s,
                a.inter_mb_s,
                a.nodes,
                a.ranks_per_node,
                mib(cap)
            );
            let c = Cluster {
                gpus: world,
                gpus_per_node: a.ranks_per_node,
                mem_bytes: cap,
                link: LinkModel::two_level(Link::new(20e-6, a.intra_mb_s * 1e6), Link::new(100e-6, a.inter_mb_s * 1e6), a.ranks_per_node),
                flops: cal.flops,
                peak_flops: cal.flops,
                margin: a.margin,
                interference: 0.0,
                update_s_per_elem: cal.update_s_per_elem,
                comm_cpu_s_per_byte: cal.comm_cpu_s_per_byte,
                comm_buffer_bytes: 0.0, // thread ranks (ThreadComm) hold no device buffers
            };
            (c, Some(cal))
        }
    };
    let offload = match (a.target, a.offload_pcie_gb_s) {
        (Target::Gpu, Some(bw)) => Some(OffloadRates {
            cpu_adam_elems_per_s: a.offload_cpu_adam.unwrap_or(1e9),
            gpu_adam_elems_per_s: a.hbm_gb_s.unwrap_or(2000.0) * 1e9 / 28.0,
            h2d_bytes_per_s: bw * 1e9,
            d2h_bytes_per_s: bw * 1e9,
            subgroup: a.offload_subgroup_size as u64,
        }),
        _ => None,
    };
    let space = SearchSpace {
        seq: a.seq_len,
        global_batch_tokens: global,
        micro_batches: a.micro_batches.clone(),
        partial_checkpointing: a.target == Target::Gpu,
        max_tp: a.max_tp,
        offload,
        ladder_layers: ladder,
        elem_bytes: a.compute_dtype().dtype().size_in_bytes(),
        workspace_bytes: if a.target == Target::Cpu { 0.0 } else { crate::memory::CUDA_WORKSPACE_BYTES },
        flops_by_micro_batch: flops_by_mbs.clone(),
    };
    let (ranked, rejected) = search(&shape, &cluster, &space);
    println!(
        "search: {} layouts fit, {} rejected (global batch {} tokens, margin {:.0}%)",
        ranked.len(),
        rejected.len(),
        global,
        a.margin * 100.0
    );
    for r in rejected.iter().take(6) {
        tracing::info!("rejected {}: {}", r.layout, r.reason);
    }
    let Some(best_modelled) = ranked.first().cloned() else {
        bail!(
            "no layout of {} fits: every one of the {} tried was rejected (first: {}); add memory or ranks, or lower --seq-len",
            shape.name,
            rejected.len(),
            rejected.first().map_or("none".into(), |r| format!("{}: {}", r.layout, r.reason))
        );
    };

    // Measured trials of the top K that can run here.
    let mut measured: Vec<(Candidate, Measured)> = Vec::new();
    if a.trials > 0 {
        let cfg = cfg.clone().context("trials need a model config")?;
        let tok_path = a.tokenizer.clone().unwrap_or_else(|| crate::cli::bundled("data/tokenizer.json"));
        let tok = tokenizer(a)?;
        let data = a.data.clone().unwrap_or_else(|| crate::cli::bundled("data/corpus"));
        let (_, train, val) = crate::cli::pretrain::token_data(&data, &tok, &tok_path)?;
        let setup = TrialSetup {
            cfg,
            train,
            val,
            link: cluster.link,
            ranks_per_node: a.ranks_per_node,
            seq: a.seq_len,
            lr: hp.lr,
            steps: a.trial_steps,
            dtype: a.compute_dtype().dtype(),
            out_dir: a.out.join("trials"),
        };
        for c in ranked.iter().filter(|c| c.offload_k.is_none()).take(a.trials) {
            let m = run_trial(&setup, c)?;
            tracing::info!("trial {}: {:.3} s per step (modelled {:.3} s)", c.name(), m.step_s, c.step_s);
            measured.push((c.clone(), m));
        }
        measured.sort_by(|x, y| y.1.tokens_per_s.total_cmp(&x.1.tokens_per_s));
    }
    let chosen = measured.first().map(|m| m.0.clone()).unwrap_or(best_modelled);

    // The table.
    println!(
        "{:<4} {:<30} {:>10} {:>9} {:>9} {:>8} {:>12} {:>7}",
        "rank", "candidate", "mem/rank", "model s", "meas. s", "error", "tokens/s", "MFU"
    );
    let flops_token = shape.flops_per_token(a.seq_len);
    let rows: Vec<&Candidate> =
        if measured.is_empty() { ranked.iter().take(a.top).collect() } else { measured.iter().map(|m| &m.0).collect() };
    for (i, c) in rows.iter().enumerate() {
        let m = measured.iter().find(|m| m.0.name() == c.name()).map(|m| &m.1);
        let (meas, err, tps) = match m {
            Some(m) => (format!("{:.3}", m.step_s), format!("{:+.1}%", (c.step_s - m.step_s) / m.step_s * 100.0), m.tokens_per_s),
            None => ("-".into(), "-".into(), c.tokens_per_s),
        };
        let mfu = flops_token * tps / (cluster.gpus as f64 * cluster.peak_flops);
        let mem =
            if a.target == Target::Cpu { format!("{:.1} MiB", mib(c.mem.total())) } else { format!("{:.1} GiB", c.mem.total() / GIB) };
        let mark = if c.name() == chosen.name() { "*" } else { "" };
        println!(
            "{:<4} {:<30} {:>10} {:>9.3} {:>9} {:>8} {:>12.0} {:>6.1}%",
            format!("{}{mark}", i + 1),
            c.name(),
            mem,
            c.step_s,
            meas,
            err,
            tps,
            mfu * 100.0
        );
    }

    // train_config.json.
    std::fs::create_dir_all(&a.out).with_context(|| format!("cannot create {}", a.out.display()))?;
    let mut tc = TrainConfig::of(&chosen, shape.layers, cluster.gpus_per_node, a.seq_len, hp.lr);
    tc.dtype = Some(a.compute_dtype().name().into());
    tc.config = match (&a.model, &cfg) {
        (Some(m), _) if !Path::new(m).is_file() && a.target == Target::Gpu => Some(m.clone()),
        (_, Some(c)) => {
            let p = a.out.join("config.json");
            std::fs::write(&p, c.to_json_string()).with_context(|| format!("cannot write {}", p.display()))?;
            Some(std::fs::canonicalize(&p)?.to_string_lossy().into_owned())
        }
        _ => None,
    };
    tc.ladder_layers = a.ladder_layers.clone();
    tc.hyper_parameters = Some(serde_json::to_value(&hp)?);
    if let Some(tokens) = a.tokens {
        tc.steps = Some((tokens / global as f64).ceil() as usize);
    }
    if let Some(m) = measured.iter().find(|m| m.0.name() == chosen.name()) {
        tc.measured = Some(serde_json::to_value(&m.1)?);
    }
    let config_path = a.out.join("train_config.json");
    std::fs::write(&config_path, serde_json::to_string_pretty(&tc)?).with_context(|| format!("cannot write {}", config_path.display()))?;
    println!("wrote {} (pretrain_llama --config-from {})", config_path.display(), config_path.display());
    let mut json = serde_json::json!({
        "chosen": chosen.name(), "tp": chosen.tp, "dp": chosen.dp,
        "shard_params": chosen.spec.params, "shard_grads": chosen.spec.grads, "shard_optim": chosen.spec.optim,
        "micro_batch": chosen.micro_batch, "grad_accum": chosen.grad_accum, "checkpointed_layers": chosen.checkpointed_layers,
        "offload_optimizer": chosen.offload_k.is_some(),
        "mem_bytes_per_rank": chosen.mem.total(), "predicted_step_s": chosen.step_s, "predicted_tokens_per_s": chosen.tokens_per_s,
        "train_config": config_path.to_string_lossy(),
    });
    if let Some(m) = measured.iter().find(|m| m.0.name() == chosen.name()) {
        json["measured_step_s"] = m.1.step_s.into();
        json["measured_tokens_per_s"] = m.1.tokens_per_s.into();
    }
    if let Some(c) = &calib {
        json["calibration"] = serde_json::to_value(c)?;
    }
    Ok(Report { ranked, measured, chosen, config_path, json })
}
