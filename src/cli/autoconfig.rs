//! `autoconfig`: the tool (`examples/autoconfig.rs` wraps `run`). Two targets:
//! - `--target cpu`: thread ranks of this machine behind a simulated two-level link; compute,
//!   the optimizer's rate and the communicator's cost are calibrated here, and `--trials K`
//!   runs the top K layouts with the real trainer;
//! - `--target gpu`: a modelled cluster (throughput, bandwidths and memory from the flags, the
//!   cluster flags and their defaults shared with `plan`: `cli::cluster`).
//!
//! The work is the library's (`autoconfig::run`, a `Request` in, a `Report` out); this module
//! turns the flags into the request and prints the report.
use super::cluster::{GpuClusterArgs, GradReduceArg};
use super::{env_help, fraction, positive, LogArgs, Tool, ENV_COMMON};
use crate::autoconfig::{Budget, Machines, ModelRequest, OffloadRequest, Request, SearchRequest, ThreadCluster, TrialData, Trials};
pub use crate::autoconfig::{Report, Target, CPU_PRESETS, GPU_PRESETS};
use crate::planner::layouts::Candidate;
use crate::planner::GIB;
use crate::AnyResult;
use anyhow::bail;
use clap::Parser;
use std::path::{Path, PathBuf};

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
    #[arg(long = "target", value_name = "cpu|gpu", help_heading = "Cluster")]
    pub target_flag: Option<Target>,
    /// GPUs in all (gpu; with a budget also on cpu) [default: --nodes x --ranks-per-node]
    #[arg(long, value_parser = positive, help_heading = "Cluster")]
    pub gpus: Option<usize>,
    /// The modelled GPU cluster (gpu), as `plan` takes it.
    #[command(flatten)]
    pub cluster: GpuClusterArgs,
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
    #[command(flatten)]
    pub grad_reduce: GradReduceArg,
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

impl AutoconfigArgs {
    /// `--dtype`, else the target's: f32 on the CPU, bf16 on GPUs.
    pub fn compute_dtype(&self, target: Target) -> super::ComputeDtype {
        self.dtype.unwrap_or(if target == Target::Cpu { super::ComputeDtype::F32 } else { super::ComputeDtype::Bf16 })
    }

    /// The GPU flags given on the command line (those that describe the modelled cluster).
    pub fn gpu_flags_given(&self) -> Vec<&'static str> {
        let mut given = if self.gpus.is_some() { vec!["--gpus"] } else { Vec::new() };
        given.extend(self.cluster.given());
        let offload = [("--offload-pcie-gb-s", self.offload_pcie_gb_s.is_some()), ("--offload-cpu-adam", self.offload_cpu_adam.is_some())];
        given.extend(offload.into_iter().filter(|g| g.1).map(|g| g.0));
        given
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

    fn tokenizer_path(&self) -> PathBuf {
        self.tokenizer.clone().unwrap_or_else(|| super::bundled("data/tokenizer.json"))
    }

    /// Trial data (`--data`, else the bundled corpus), prepared and checked as pretrain_llama's.
    fn trial_data(&self) -> AnyResult<TrialData> {
        let tok_path = self.tokenizer_path();
        let tok = crate::data::Tokenizer::from_file(&tok_path)
            .map_err(anyhow::Error::from)
            .map_err(|e| e.context(format!("cannot load the tokenizer {}", tok_path.display())))?;
        let data = self.data.clone().unwrap_or_else(|| super::bundled("data/corpus"));
        let (_, train, val) = crate::shards::token_data(&data, &tok, &tok_path)?;
        Ok(TrialData { train, val })
    }

    /// The library's request: the flags as plain values, the target and defaults resolved.
    pub fn request(&self) -> AnyResult<Request> {
        let target = self.resolve_target()?;
        let gpus_in_budget = self.gpus.unwrap_or(self.nodes * self.ranks_per_node);
        let budget = match (self.days, self.tflops_per_gpu, self.tokens) {
            (Some(days), Some(tflops_per_gpu), Some(tokens)) => Some(Budget { days, gpus: gpus_in_budget, tflops_per_gpu, tokens }),
            _ => None,
        };
        let model = ModelRequest {
            name_or_path: self.model.clone(),
            tokenizer: self.tokenizer_path(),
            ladder_layers: self.ladder_layers.clone(),
            budget,
            vocab: self.vocab,
        };
        let search = SearchRequest {
            seq_len: self.seq_len_flag,
            global_batch_tokens: self.global_batch_tokens,
            micro_batches: self.micro_batches.clone(),
            max_tp: self.max_tp,
        };
        Ok(Request {
            model,
            machines: self.machines(target)?,
            dtype: self.compute_dtype(target).dtype(),
            grad_reduce: self.grad_reduce.grad_reduce_dtype,
            margin: self.margin,
            search,
            out: self.out.clone(),
        })
    }

    /// The thread ranks with their trials, or the modelled GPUs with their offload.
    fn machines(&self, target: Target) -> AnyResult<Machines> {
        if target == Target::Gpu {
            if self.trials > 0 {
                bail!("--trials runs on CPU thread ranks (--target cpu); a GPU cluster is modelled only");
            }
            let offload = self.offload_pcie_gb_s.map(|bw| OffloadRequest {
                pcie_gb_s: bw,
                cpu_adam: self.offload_cpu_adam,
                subgroup: self.offload_subgroup_size,
            });
            return Ok(Machines::Gpus { spec: self.cluster.spec(self.gpus.unwrap_or(0), self.tflops_per_gpu, self.margin), offload });
        }
        let cluster = ThreadCluster {
            nodes: self.nodes,
            ranks_per_node: self.ranks_per_node,
            intra_mb_s: self.intra_mb_s,
            inter_mb_s: self.inter_mb_s,
            mem_cap_mib: self.mem_cap_mib,
        };
        // Data is prepared only for a request that can run (the library refuses a 0 micro-batch).
        let trials = if self.trials > 0 && !self.micro_batches.contains(&0) {
            Some(Trials { count: self.trials, steps: self.trial_steps, data: self.trial_data()? })
        } else {
            None
        };
        Ok(Machines::Threads { cluster, trials })
    }
}

impl Tool for AutoconfigArgs {
    fn log_args(&self) -> &LogArgs {
        &self.log
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

/// Runs the auto-configurator for the flags and prints everything but the final JSON line.
pub fn autoconfig(a: &AutoconfigArgs) -> AnyResult<Report> {
    let mut inputs: Vec<(&str, &Path)> =
        a.model.as_deref().map(Path::new).filter(|m| m.is_file()).map(|m| ("--model", m)).into_iter().collect();
    inputs.extend(a.data.as_deref().map(|d| ("--data", d)));
    inputs.extend(a.tokenizer.as_deref().map(|t| ("--tokenizer", t)));
    crate::run_dir::check_inputs_outside(&a.out, &inputs)?;
    let req = a.request()?;
    let r = crate::autoconfig::run(&req)?;
    print_model(a, &req, &r);
    print_cluster(&req, &r);
    print_table(&req, &r, a.top);
    println!("wrote {} (pretrain_llama --config-from {})", r.config_path.display(), r.config_path.display());
    Ok(r)
}

/// The budget, the model and its recipe.
fn print_model(a: &AutoconfigArgs, req: &Request, r: &Report) {
    let s = &r.shape;
    if let (Some(p), Some(b)) = (r.budget_params, &req.model.budget) {
        println!(
            "budget: {} days x {} GPUs x {} TFLOP/s on {:.3e} tokens trains P = days*86400*gpus*F/(8*T) = {:.3}B parameters; nearest shape {}",
            b.days,
            b.gpus,
            a.tflops_per_gpu.unwrap_or(0.0),
            b.tokens,
            p / 1e9,
            s.name
        );
    }
    println!(
        "model {}: {:.4}B parameters, {} layers, hidden {}, {} heads ({} kv), ffn {}, vocab {}",
        s.name,
        s.params() as f64 / 1e9,
        s.layers,
        s.hidden,
        s.heads,
        s.kv_heads,
        s.intermediate,
        s.vocab
    );
    println!("{:<18} {:<40} source", "hyper-parameter", "value");
    for row in &r.hyper.rows {
        println!("{:<18} {:<40} {}", row.name, row.value, row.source);
    }
}

/// The calibration (cpu) and the search's counts.
fn print_cluster(req: &Request, r: &Report) {
    if let (Some(cal), Machines::Threads { cluster: t, .. }) = (&r.calibration, &req.machines) {
        println!(
            "calibrated on {} thread ranks: {} GFLOP/s per rank by micro-batch size, optimizer {:.1} ns/element, communicator {:.2} ns/byte; \
             simulated link intra {} MB/s, inter {} MB/s ({} nodes x {}); memory cap {:.1} MiB per rank",
            r.cluster.gpus,
            r.flops_by_micro_batch.iter().map(|(m, f)| format!("{m}: {:.2}", f / 1e9)).collect::<Vec<_>>().join(", "),
            cal.update_s_per_elem * 1e9,
            cal.comm_cpu_s_per_byte * 1e9,
            t.intra_mb_s,
            t.inter_mb_s,
            t.nodes,
            t.ranks_per_node,
            mib(r.cluster.mem_bytes)
        );
    }
    println!(
        "search: {} layouts fit, {} rejected (global batch {} tokens, margin {:.0}%)",
        r.ranked.len(),
        r.rejected.len(),
        r.global_batch_tokens,
        req.margin * 100.0
    );
    for x in r.rejected.iter().take(6) {
        tracing::info!("rejected {}: {}", x.layout, x.reason);
    }
}

/// The ranked (or trialled) layouts, the chosen one marked.
fn print_table(req: &Request, r: &Report, top: usize) {
    print!("{}", layout_table(req, r, top));
}

/// The table of [`print_table`]. MFU is against the GPUs' peak; thread ranks have none (their
/// calibrated rate is no peak), so on the CPU target the column holds `-`.
pub fn layout_table(req: &Request, r: &Report, top: usize) -> String {
    let mut out = format!(
        "{:<4} {:<30} {:>10} {:>9} {:>9} {:>8} {:>12} {:>7}\n",
        "rank", "candidate", "mem/rank", "model s", "meas. s", "error", "tokens/s", "MFU"
    );
    let flops_token = r.shape.flops_per_token(r.seq_len);
    let cpu = req.machines.target() == Target::Cpu;
    let rows: Vec<&Candidate> =
        if r.measured.is_empty() { r.ranked.iter().take(top).collect() } else { r.measured.iter().map(|m| &m.0).collect() };
    for (i, c) in rows.iter().enumerate() {
        let (meas, err, tps) = match r.measured_of(c) {
            Some(m) => (format!("{:.3}", m.step_s), format!("{:+.1}%", (c.step_s - m.step_s) / m.step_s * 100.0), m.tokens_per_s),
            None => ("-".into(), "-".into(), c.tokens_per_s),
        };
        let mfu = if cpu {
            "-".to_string()
        } else {
            format!("{:.1}%", flops_token * tps / (r.cluster.gpus as f64 * r.cluster.peak_flops) * 100.0)
        };
        let mem = if cpu { format!("{:.1} MiB", mib(c.mem.total())) } else { format!("{:.1} GiB", c.mem.total() / GIB) };
        let mark = if c.name() == r.chosen.name() { "*" } else { "" };
        out += &format!(
            "{:<4} {:<30} {:>10} {:>9.3} {:>9} {:>8} {:>12.0} {:>7}\n",
            format!("{}{mark}", i + 1),
            c.name(),
            mem,
            c.step_s,
            meas,
            err,
            tps,
            mfu
        );
    }
    out
}
