//! The auto-configurator as one call: a [`Request`] (plain values, what the `autoconfig` tool's
//! flags say) in, a [`Report`] out. It picks the model (a preset, a config.json, or the size a
//! budget trains), its recipe, builds the cluster (modelled GPUs through
//! `planner::Cluster::gpu`, or thread ranks calibrated here), searches the layouts
//! (`planner::layouts`), runs the measured trials, and writes `train_config.json`. It prints
//! nothing; the tool (`cli::autoconfig`) prints the report.
use super::trial::{run_trial, Measured, TrainConfig, TrialSetup};
use super::{hyper_params, params_from_budget, shape_for_params, Budget, HyperParams};
use crate::nn::{LadderLayers, LlamaConfig};
use crate::planner::calibrate::{calibrate, Calibration};
use crate::planner::cost::{Link, LinkModel};
use crate::planner::layouts::{search, Candidate, OffloadRates, Rejected, SearchSpace};
use crate::planner::{memory, Cluster, GpuClusterSpec, ModelShape, GIB};
use crate::{AnyResult, DType};
use anyhow::{bail, Context};
use ferrolm_parallel::zero::GradReduceDtype;
use std::path::{Path, PathBuf};

/// Where the layouts run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Thread ranks of this machine behind a simulated two-level link: calibrated, trials possible.
    Cpu,
    /// A modelled GPU cluster.
    Gpu,
}

impl std::str::FromStr for Target {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Target::Cpu),
            "gpu" => Ok(Target::Gpu),
            other => Err(format!("{other:?} is not a target (cpu or gpu)")),
        }
    }
}

/// The presets of the model: built and calibrated here, or modelled on a GPU cluster.
pub const CPU_PRESETS: [&str; 2] = ["tiny", "small"];
pub const GPU_PRESETS: [&str; 6] = ["7b", "13b", "30b", "70b", "gpt3-5b", "gpt3-175b"];

/// The simulated cluster of thread ranks (`Target::Cpu`).
#[derive(Clone, Debug, PartialEq)]
pub struct ThreadCluster {
    pub nodes: usize,
    pub ranks_per_node: usize,
    /// Simulated links, MB/s per rank.
    pub intra_mb_s: f64,
    pub inter_mb_s: f64,
    /// Memory cap per rank, MiB (`None`: the available RAM over the ranks).
    pub mem_cap_mib: Option<f64>,
}

/// Optimizer offload as a candidate (`Target::Gpu` only).
#[derive(Clone, Debug, PartialEq)]
pub struct OffloadRequest {
    /// Host link GB/s per direction.
    pub pcie_gb_s: f64,
    /// CPU AdamW elements/s per GPU's share of the host (`None`: 1e9).
    pub cpu_adam: Option<f64>,
    pub subgroup: usize,
}

/// Trial data: token shards prepared by the caller.
#[derive(Clone, Debug, PartialEq)]
pub struct TrialData {
    pub train: Vec<PathBuf>,
    pub val: Vec<PathBuf>,
}

/// The top layouts run with the real trainer on the thread ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct Trials {
    /// How many of the top layouts run.
    pub count: usize,
    /// Timed steps of each (after one warm-up step).
    pub steps: usize,
    pub data: TrialData,
}

/// Where the layouts run, with what each kind of machine takes.
#[derive(Clone, Debug)]
pub enum Machines {
    /// Thread ranks of this machine behind a simulated two-level link: calibrated here, and the
    /// top layouts run with the real trainer when `trials` is given.
    Threads { cluster: ThreadCluster, trials: Option<Trials> },
    /// A modelled GPU cluster (its `gpus` 0 when not given); optimizer offload is a candidate
    /// when `offload` is given.
    Gpus { spec: GpuClusterSpec, offload: Option<OffloadRequest> },
}

impl Machines {
    pub fn target(&self) -> Target {
        match self {
            Machines::Threads { .. } => Target::Cpu,
            Machines::Gpus { .. } => Target::Gpu,
        }
    }
}

/// The model asked for.
#[derive(Clone, Debug)]
pub struct ModelRequest {
    /// A preset (`CPU_PRESETS`, `GPU_PRESETS`) or a config.json; `None`: from `budget`.
    pub name_or_path: Option<String>,
    /// The tokenizer a CPU preset is sized to and trials train with.
    pub tokenizer: PathBuf,
    /// `all`, the last N layers, or i,j,k.
    pub ladder_layers: Option<String>,
    /// Days, achieved TFLOP/s per GPU and tokens (its `gpus`: the GPUs in all).
    pub budget: Option<Budget>,
    /// Vocabulary of a shape picked from the budget.
    pub vocab: usize,
}

/// `SearchRequest::seq_len`'s default.
pub const DEFAULT_SEQ_LEN: usize = 2048;

/// What the search tries.
#[derive(Clone, Debug)]
pub struct SearchRequest {
    /// Tokens per sequence; `None`: [`DEFAULT_SEQ_LEN`], or the model's positions when fewer.
    pub seq_len: Option<usize>,
    /// `None`: the recipe's global batch.
    pub global_batch_tokens: Option<usize>,
    /// Micro-batch sizes tried.
    pub micro_batches: Vec<usize>,
    /// Largest tensor-parallel degree tried.
    pub max_tp: usize,
}

/// What to configure.
#[derive(Clone, Debug)]
pub struct Request {
    pub model: ModelRequest,
    pub machines: Machines,
    /// Weights and activations.
    pub dtype: DType,
    /// The dtype gradients are accumulated and reduced in.
    pub grad_reduce: GradReduceDtype,
    /// Memory kept free, a fraction of each rank's.
    pub margin: f64,
    pub search: SearchRequest,
    /// Where `train_config.json` (and the model's config.json on the CPU) go.
    pub out: PathBuf,
}

/// What a run found.
#[derive(Debug)]
pub struct Report {
    /// The model.
    pub shape: ModelShape,
    /// Parameters the budget trains, when a budget picked the model.
    pub budget_params: Option<f64>,
    /// The sequence length in effect.
    pub seq_len: usize,
    /// The recipe, each row with its source.
    pub hyper: HyperParams,
    /// Tokens per optimizer step in effect.
    pub global_batch_tokens: usize,
    /// The machines the layouts were modelled on.
    pub cluster: Cluster,
    /// `Target::Cpu`: the measurements, and the compute rate by micro-batch size.
    pub calibration: Option<Calibration>,
    pub flops_by_micro_batch: Vec<(usize, f64)>,
    /// Every layout that fits, fastest modelled first; the others with their reasons.
    pub ranked: Vec<Candidate>,
    pub rejected: Vec<Rejected>,
    /// The trialled layouts with their measurements, fastest measured first.
    pub measured: Vec<(Candidate, Measured)>,
    /// The fastest measured layout, else the fastest modelled.
    pub chosen: Candidate,
    /// The `train_config.json` written.
    pub config_path: PathBuf,
    /// The chosen layout, as the tool's last line.
    pub json: serde_json::Value,
}

impl Report {
    /// The measurement of `c`, if it was trialled.
    pub fn measured_of(&self, c: &Candidate) -> Option<&Measured> {
        self.measured.iter().find(|m| m.0.name() == c.name()).map(|m| &m.1)
    }
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

fn tokenizer(r: &Request) -> AnyResult<crate::data::Tokenizer> {
    let p = &r.model.tokenizer;
    crate::data::Tokenizer::from_file(p).with_context(|| format!("cannot load the tokenizer {}", p.display()))
}

/// The model: its shape, a config the trials can build (not for a GPU preset), the parameters
/// a budget trains, and the sequence length in effect.
fn model(r: &Request) -> AnyResult<(ModelShape, Option<LlamaConfig>, Option<f64>, usize)> {
    let m = &r.model;
    let budget = m.budget.as_ref().map(params_from_budget).transpose()?;
    let mut seq = r.search.seq_len.unwrap_or(DEFAULT_SEQ_LEN);
    let (shape, mut cfg) = match (&m.name_or_path, budget) {
        (Some(m), _) if Path::new(m).is_file() => {
            let c = LlamaConfig::from_file(m).with_context(|| format!("--model {m}"))?;
            (ModelShape::from_config(&c, m), Some(c))
        }
        (Some(m), _) if CPU_PRESETS.contains(&m.as_str()) => {
            let c = LlamaConfig::preset(m).context("--model")?;
            // On the CPU the trials train it with the tokenizer; a modelled GPU keeps its vocabulary.
            let c = if r.machines.target() == Target::Cpu { c.with_vocab_size(tokenizer(r)?.vocab_size()) } else { c };
            (ModelShape::from_config(&c, m), Some(c))
        }
        (Some(m), _) if GPU_PRESETS.contains(&m.as_str()) => (ModelShape::preset(m)?, None),
        (Some(m), _) => {
            bail!("--model {m}: not a preset (cpu: {}; gpu: {}) nor a config.json file", CPU_PRESETS.join(", "), GPU_PRESETS.join(", "))
        }
        (None, Some(p)) => {
            let s = shape_for_params(p, m.vocab);
            let c = config_for_shape(&s, seq);
            (s, Some(c))
        }
        (None, None) => bail!("give --model, or a budget: --days, --tflops-per-gpu and --tokens (with --gpus)"),
    };
    if let (Some(c), Some(l)) = (cfg.as_mut(), &m.ladder_layers) {
        c.ladder_layers = Some(LadderLayers::parse_flag(l, c.num_hidden_layers).context("--ladder-layers")?);
        c.validate().context("--ladder-layers")?;
    }
    if let Some(c) = &cfg {
        if r.search.seq_len.is_none() {
            seq = seq.min(c.max_position_embeddings);
        }
        if seq > c.max_position_embeddings {
            bail!("--seq-len {seq} is longer than the model's max_position_embeddings ({})", c.max_position_embeddings);
        }
    }
    Ok((shape, cfg, budget, seq))
}

fn ladder_count(r: &Request, shape: &ModelShape, cfg: Option<&LlamaConfig>) -> AnyResult<Option<usize>> {
    let count = |l: &LadderLayers| l.mask(shape.layers).iter().filter(|&&b| b).count();
    if let Some(l) = cfg.and_then(|c| c.ladder_layers.as_ref()) {
        return Ok(Some(count(l)));
    }
    r.model.ladder_layers.as_ref().map(|l| Ok(count(&LadderLayers::parse_flag(l, shape.layers)?))).transpose()
}

/// FLOP/s per rank by micro-batch size.
type FlopsByMicroBatch = Vec<(usize, f64)>;

/// The thread ranks of `Target::Cpu`, calibrated at every micro-batch size tried.
fn thread_cluster(
    r: &Request,
    t: &ThreadCluster,
    cfg: Option<&LlamaConfig>,
    seq: usize,
) -> AnyResult<(Cluster, Calibration, FlopsByMicroBatch)> {
    let cfg = cfg.context("--target cpu needs a model it can build (a preset or config.json)")?;
    let world = t.nodes * t.ranks_per_node;
    let mut sizes = r.search.micro_batches.clone();
    sizes.sort_unstable();
    sizes.dedup();
    let (mut by_mbs, mut cal) = (Vec::new(), None);
    for &mbs in &sizes {
        let c = calibrate(cfg, world, mbs, seq)?;
        by_mbs.push((mbs, c.flops));
        cal.get_or_insert(c);
    }
    let cal = Calibration { flops: by_mbs.iter().map(|x| x.1).fold(0.0, f64::max), ..cal.context("--micro-batches is empty")? };
    let cap = match t.mem_cap_mib {
        Some(m) => m * (1u64 << 20) as f64,
        None => memory::available_host_bytes().map_or(8.0 * GIB, |b| b as f64 / world as f64),
    };
    let link = LinkModel::two_level(Link::new(20e-6, t.intra_mb_s * 1e6), Link::new(100e-6, t.inter_mb_s * 1e6), t.ranks_per_node);
    Ok((Cluster::thread_ranks(world, t.ranks_per_node, cap, link, &cal, r.margin), cal, by_mbs))
}

/// The search space the request and the cluster give.
fn space(r: &Request, cluster: &Cluster, seq: usize, global: usize, ladder: Option<usize>, by_mbs: Vec<(usize, f64)>) -> SearchSpace {
    let offload = match &r.machines {
        Machines::Gpus { offload: Some(o), .. } => Some(OffloadRates {
            cpu_adam_elems_per_s: o.cpu_adam.unwrap_or(1e9),
            gpu_adam_elems_per_s: cluster.gpu_adam_elems_per_s(),
            h2d_bytes_per_s: o.pcie_gb_s * 1e9,
            d2h_bytes_per_s: o.pcie_gb_s * 1e9,
            subgroup: o.subgroup as u64,
        }),
        _ => None,
    };
    SearchSpace {
        seq,
        global_batch_tokens: global,
        micro_batches: r.search.micro_batches.clone(),
        partial_checkpointing: r.machines.target() == Target::Gpu,
        max_tp: r.search.max_tp,
        offload,
        ladder_layers: ladder,
        elem_bytes: r.dtype.size_in_bytes(),
        grad_reduce: r.grad_reduce,
        workspace_bytes: if r.machines.target() == Target::Cpu { 0.0 } else { memory::CUDA_WORKSPACE_BYTES },
        flops_by_micro_batch: by_mbs,
    }
}

/// Runs the top `trials` layouts that can run here; fastest measured first.
fn trials(
    r: &Request,
    cfg: Option<&LlamaConfig>,
    cluster: &Cluster,
    seq: usize,
    lr: f64,
    ranked: &[Candidate],
) -> AnyResult<Vec<(Candidate, Measured)>> {
    let mut measured: Vec<(Candidate, Measured)> = Vec::new();
    let Machines::Threads { cluster: threads, trials: Some(tr) } = &r.machines else {
        return Ok(measured);
    };
    let setup = TrialSetup {
        cfg: cfg.cloned().context("trials need a model config")?,
        data: tr.data.clone(),
        link: cluster.link,
        ranks_per_node: threads.ranks_per_node,
        seq,
        lr,
        steps: tr.steps,
        dtype: r.dtype,
        grad_reduce: r.grad_reduce,
        out_dir: r.out.join("trials"),
    };
    for c in ranked.iter().filter(|c| c.offload_k.is_none()).take(tr.count) {
        let m = run_trial(&setup, c)?;
        tracing::info!("trial {}: {:.3} s per step (modelled {:.3} s)", c.name(), m.step_s, c.step_s);
        measured.push((c.clone(), m));
    }
    measured.sort_by(|x, y| y.1.tokens_per_s.total_cmp(&x.1.tokens_per_s));
    Ok(measured)
}

/// Writes `train_config.json` (and on the CPU the model's config.json) for `chosen`.
fn write_train_config(r: &Request, rep: &Report, cfg: Option<&LlamaConfig>) -> AnyResult<PathBuf> {
    let out = &r.out;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let mut tc = TrainConfig::of(&rep.chosen, rep.shape.layers, rep.cluster.gpus_per_node, rep.seq_len, rep.hyper.lr);
    tc.dtype = Some(if r.dtype == DType::F32 { "f32" } else { "bf16" }.into());
    tc.grad_reduce_dtype = Some(r.grad_reduce.to_string());
    tc.config = match (&r.model.name_or_path, cfg) {
        (Some(m), _) if !Path::new(m).is_file() && r.machines.target() == Target::Gpu => Some(m.clone()),
        (_, Some(c)) => {
            let p = out.join("config.json");
            std::fs::write(&p, c.to_json_string()).with_context(|| format!("cannot write {}", p.display()))?;
            Some(std::fs::canonicalize(&p)?.to_string_lossy().into_owned())
        }
        _ => None,
    };
    tc.ladder_layers = r.model.ladder_layers.clone();
    tc.hyper_parameters = Some(serde_json::to_value(&rep.hyper)?);
    // The recipe's steps and warmup (its printed rows are what --config-from trains).
    tc.steps = Some(rep.hyper.steps);
    tc.warmup_steps = Some(rep.hyper.warmup_steps);
    if r.machines.target() == Target::Cpu {
        // Thread ranks have no peak: a utilisation of the calibrated rate is no MFU.
        if let Some(p) = tc.predicted.as_mut() {
            p["mfu"] = serde_json::Value::Null;
        }
    }
    if let Some(m) = rep.measured_of(&rep.chosen) {
        tc.measured = Some(serde_json::to_value(m)?);
    }
    let path = out.join("train_config.json");
    std::fs::write(&path, serde_json::to_string_pretty(&tc)?).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(path)
}

/// The chosen layout as one JSON object.
fn chosen_json(rep: &Report) -> AnyResult<serde_json::Value> {
    let c = &rep.chosen;
    let mut json = serde_json::json!({
        "chosen": c.name(), "tp": c.tp, "dp": c.dp,
        "shard_params": c.spec.params, "shard_grads": c.spec.grads, "shard_optim": c.spec.optim,
        "micro_batch": c.micro_batch, "grad_accum": c.grad_accum, "checkpointed_layers": c.checkpointed_layers,
        "offload_optimizer": c.offload_k.is_some(),
        "mem_bytes_per_rank": c.mem.total(), "predicted_step_s": c.step_s, "predicted_tokens_per_s": c.tokens_per_s,
        "train_config": rep.config_path.to_string_lossy(),
    });
    if let Some(m) = rep.measured_of(c) {
        json["measured_step_s"] = m.step_s.into();
        json["measured_tokens_per_s"] = m.tokens_per_s.into();
    }
    if let Some(c) = &rep.calibration {
        json["calibration"] = serde_json::to_value(c)?;
    }
    Ok(json)
}

/// The whole auto-configuration: model, recipe, cluster, search, trials, `train_config.json`.
pub fn run(r: &Request) -> AnyResult<Report> {
    if r.search.micro_batches.contains(&0) {
        bail!("--micro-batches: sizes must be at least 1");
    }
    let (shape, cfg, budget_params, seq) = model(r)?;
    let recipe = hyper_params(shape.params() as f64, seq);
    let global = r.search.global_batch_tokens.unwrap_or(recipe.global_batch_tokens);
    let hyper = recipe.for_run(seq, global, r.model.budget.as_ref().map(|b| b.tokens), r.dtype);
    let ladder = ladder_count(r, &shape, cfg.as_ref())?;
    let (cluster, calibration, by_mbs) = match &r.machines {
        Machines::Gpus { spec, .. } => {
            let gpus = if spec.gpus > 0 { spec.gpus } else { bail!("--target gpu needs --gpus N (the GPUs in all)") };
            (Cluster::gpu(&GpuClusterSpec { gpus, margin: Some(r.margin), ..spec.clone() })?, None, Vec::new())
        }
        Machines::Threads { cluster: t, .. } => {
            let (c, cal, by) = thread_cluster(r, t, cfg.as_ref(), seq)?;
            (c, Some(cal), by)
        }
    };
    let (ranked, rejected) = search(&shape, &cluster, &space(r, &cluster, seq, global, ladder, by_mbs.clone()));
    let Some(best_modelled) = ranked.first().cloned() else {
        bail!(
            "no layout of {} fits: every one of the {} tried was rejected (first: {}); add memory or ranks, or lower --seq-len",
            shape.name,
            rejected.len(),
            rejected.first().map_or("none".into(), |r| format!("{}: {}", r.layout, r.reason))
        );
    };
    let measured = trials(r, cfg.as_ref(), &cluster, seq, hyper.lr, &ranked)?;
    let chosen = measured.first().map(|m| m.0.clone()).unwrap_or(best_modelled);
    let mut rep = Report {
        shape,
        budget_params,
        seq_len: seq,
        hyper,
        global_batch_tokens: global,
        cluster,
        calibration,
        flops_by_micro_batch: by_mbs,
        ranked,
        rejected,
        measured,
        chosen,
        config_path: PathBuf::new(),
        json: serde_json::Value::Null,
    };
    rep.config_path = write_train_config(r, &rep, cfg.as_ref())?;
    rep.json = chosen_json(&rep)?;
    Ok(rep)
}
