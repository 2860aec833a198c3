//! `dpo`: preference tuning (DPO and its siblings, TRL's `loss_type`s) of a Llama or Ladder
//! checkpoint on TRL's preference data, with every training, parallel, offload and LoRA flag of
//! `finetune` (its flag structs, flattened). The data is `ferrolm_data::preference`, the losses
//! `ferrolm_nn::objective::preference`, the trainer's objective and reference `crate::dpo`.
use super::finetune::SaveArgs;
use super::pretrain::preflight;
use super::tune::{Defaults, Layout};
use super::{env_help, flag_error, fraction, LogArgs, Tool, TrainArgs, TrainData, ENV_COMMON, ENV_DEVICE, ENV_LAUNCH, ENV_TRAIN};
use crate::batches::PairData;
use crate::dpo::{Preference, RefLogps, Reference};
use crate::nn::objective::preference::{PreferenceConfig, PreferenceMetrics};
use crate::nn::LlamaConfig;
use crate::parallel::Comm;
use crate::progress::report;
use crate::train::TrainSet;
use crate::AnyResult;
use anyhow::Context;
use clap::{Args, Command, Parser};
use ferrolm_data::preference::{load_preference_pairs, PreferenceFormat, PreferenceOptions, PreferencePair};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The preference-data flags.
#[derive(Args, Debug, Clone, PartialEq)]
#[command(next_help_heading = "Preference data")]
pub struct PrefDataArgs {
    /// The record form of --data: auto (detected per record), standard (prompt, chosen, rejected
    /// strings), conversational (lists of messages) or implicit-prompt (chosen and rejected
    /// whole conversations sharing their prompt)
    #[arg(long, value_name = "FORMAT", default_value = "auto", value_parser = |s: &str| s.parse::<PreferenceFormat>())]
    pub data_format: PreferenceFormat,
    /// The chat template, a Jinja file [default: chat_template.jinja in --model, else the
    /// chat_template of its tokenizer_config.json; standard (text) records need none]
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// Validation pairs, scored with the same loss and metrics [default: the --val-fraction of
    /// --data]
    #[arg(long, value_name = "FILE|DIR|GLOB")]
    pub val_data: Option<PathBuf>,
    /// The fraction of --data's pairs held out for validation (0: none)
    #[arg(long, value_name = "F", default_value = "0.02", value_parser = fraction)]
    pub val_fraction: f64,
}

/// The objective's flags (TRL's `DPOConfig` names).
#[derive(Args, Debug, Clone, PartialEq)]
#[command(next_help_heading = "Preference objective")]
pub struct PrefArgs {
    /// β: how far the policy may move from the reference (TRL's beta)
    #[arg(long, value_name = "B", default_value = "0.1", allow_hyphen_values = true)]
    pub beta: f64,
    /// The loss, or a comma list of losses summed with --loss-weights: sigmoid (DPO), hinge,
    /// ipo, sigmoid_norm (length-normalised), sft (NLL of the chosen completion)
    #[arg(long, value_name = "LIST", default_value = "sigmoid")]
    pub loss_type: String,
    /// One weight per --loss-type, comma separated [default: 1 each]
    #[arg(long, value_name = "LIST", allow_hyphen_values = true)]
    pub loss_weights: Option<String>,
    /// The reference model (a model directory, a run directory or RUN/checkpoints/latest), frozen
    /// [default: the starting --model; with LoRA, the base with the adapters off, no second copy]
    #[arg(long, value_name = "DIR")]
    pub ref_model: Option<PathBuf>,
    /// Compute the reference log-probs once before training (training and validation pairs),
    /// keep them in OUT/ref_logps.json (reused by --resume) and hold no reference weights while
    /// training
    #[arg(long)]
    pub precompute_ref: bool,
    /// The most tokens of prompt + completion (TRL's max_length): longer pairs are cut (the
    /// completion's end), counted and logged; also the length of a packed row [default: --seq-len]
    #[arg(long, value_name = "N", value_parser = super::positive)]
    pub max_length: Option<usize>,
    /// The most tokens of a prompt: longer prompts lose their start (TRL's max_prompt_length),
    /// counted and logged [default: no limit]
    #[arg(long, value_name = "N", value_parser = super::positive)]
    pub max_prompt_length: Option<usize>,
}

impl PrefArgs {
    /// The losses, a flag error naming the flag.
    pub fn config(&self) -> AnyResult<PreferenceConfig> {
        PreferenceConfig::parse(self.beta, &self.loss_type, self.loss_weights.as_deref()).map_err(|e| flag_error(e.to_string()))
    }
}

#[derive(Parser, Debug, Clone, PartialEq)]
#[command(
    allow_negative_numbers = true,
    name = "dpo",
    about = "Preference-tune a Llama or Ladder checkpoint (DPO and its siblings) on pairs of a preferred and a \
             dispreferred answer (TRL's standard, conversational and implicit-prompt formats), measured against a \
             frozen reference: live, the LoRA base with the adapters off, or precomputed. Logs TRL's metrics \
             (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected); \
             writes Hugging Face checkpoints under OUT/checkpoints/.",
    after_help = env_help(&[ENV_COMMON, ENV_DEVICE, ENV_TRAIN, ENV_LAUNCH])
)]
pub struct DpoArgs {
    /// The checkpoint to tune (the policy, and the reference unless --ref-model): a model
    /// directory (config.json, model.safetensors, tokenizer.json), a run directory (its newest
    /// complete checkpoint) or RUN/checkpoints/latest
    #[arg(long, value_name = "DIR", help_heading = "Model")]
    pub model: PathBuf,
    #[command(flatten)]
    pub data: PrefDataArgs,
    #[command(flatten)]
    pub pref: PrefArgs,
    #[command(flatten)]
    pub train: TrainArgs,
    #[command(flatten)]
    pub save: SaveArgs,
    #[command(flatten)]
    pub lora: super::lora::LoraArgs,
}

const DEFAULT_DATA: &str = "data/prefs.jsonl";

impl Tool for DpoArgs {
    fn cli() -> Command {
        let data_help = "Training pairs: preference records (.jsonl, .jsonl.gz, .jsonl.zst or .parquet, or a .json array of them: \
                         a file, a directory of them, or a quoted glob) [default: data/prefs.jsonl, the bundled pairs]"
            .to_string();
        super::tune::command(<Self as clap::CommandFactory>::command(), Defaults { out: "runs/dpo", steps: "100", lr: "5e-5", data_help })
            .mut_arg("batch_size", |a| a.default_value("4").help("Pairs a micro-batch (each pair is two sequences, packed into rows)"))
    }
    fn log_args(&self) -> &LogArgs {
        &self.train.log
    }
    fn train_args_mut(&mut self) -> Option<&mut TrainArgs> {
        Some(&mut self.train)
    }
}

/// What every rank shares.
struct Prepared {
    data: TrainData,
    model: PathBuf,
    /// The live reference's directory (None: adapters off, or precomputed).
    live_ref: Option<PathBuf>,
    refs: Option<RefLogps>,
    cfg: PreferenceConfig,
    template: Option<String>,
    source: Arc<crate::checkpoint::SourceModel>,
    base_id: Option<crate::lora_base::BaseIdentity>,
}

/// The pairs of `data`, logged as the data crate counts them.
fn load_pairs(data: &Path, opts: &PreferenceOptions, what: &str) -> AnyResult<Vec<PreferencePair>> {
    let inputs = crate::data::resolve_inputs(data).with_context(|| format!("cannot read the {what} {}", data.display()))?;
    let bar = crate::progress::Progress::bytes(inputs.iter().map(|f| f.bytes).sum(), what);
    let (pairs, stats) = load_preference_pairs(&inputs, opts, &mut |done, _, n| {
        bar.set_position(done);
        bar.set_message(format!("{n} pairs"));
    })
    .with_context(|| format!("cannot read the {what} {}", data.display()))?;
    drop(bar);
    // At info level (the default): what was skipped or cut is never only in debug.
    tracing::info!("{what} {}: {}", data.display(), stats.summary());
    for m in &stats.skip_messages {
        tracing::info!("  skipped: {m}");
    }
    Ok(pairs)
}

/// Holds out `fraction` of `pairs` (at least one when the fraction is not 0 and two or more
/// pairs are there), chosen by `seed`; the rest, in their order, train.
fn split_validation(pairs: Vec<PreferencePair>, fraction: f64, seed: u64) -> (Vec<PreferencePair>, Vec<PreferencePair>) {
    let n = pairs.len();
    let mut k = (n as f64 * fraction).round() as usize;
    if fraction > 0.0 && n >= 2 {
        k = k.max(1);
    }
    k = k.min(n.saturating_sub(1));
    let mut idx: Vec<usize> = (0..n).collect();
    let mut rng = crate::tensor::Rng::new(seed ^ 0x0005_eed0_f7a1);
    for i in (1..n).rev() {
        idx.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let mut held = vec![false; n];
    idx[..k].iter().for_each(|&i| held[i] = true);
    let (mut train, mut val) = (Vec::with_capacity(n - k), Vec::with_capacity(k));
    for (i, p) in pairs.into_iter().enumerate() {
        if held[i] {
            val.push(p)
        } else {
            train.push(p)
        }
    }
    (train, val)
}

/// `--out` may not be or hold `--model`, `--ref-model`, `--lora-init`, `--chat-template`,
/// `--val-data`, the data, nor the run's other inputs.
fn check_inputs(args: &DpoArgs, models: &[&Path]) -> AnyResult<()> {
    let mut inputs: Vec<(&str, &Path)> = models.iter().map(|m| ("--model", *m)).collect();
    let optional = [
        ("--ref-model", &args.pref.ref_model),
        ("--lora-init", &args.lora.lora_init),
        ("--chat-template", &args.data.chat_template),
        ("--val-data", &args.data.val_data),
    ];
    inputs.extend(optional.iter().filter_map(|(f, p)| p.as_deref().map(|p| (*f, p))));
    args.train.check_inputs_outside_out(DEFAULT_DATA, false, &inputs)
}

fn prepare(args: &DpoArgs) -> AnyResult<Prepared> {
    let a = &args.train;
    preflight(a)?;
    let cfg_pref = args.pref.config()?;
    let device = a.device.pick()?;
    let dtype = a.device.dtype(device);
    let model = args.model.clone();
    let (cfg, cfg_path) = super::tune::model_config(a, &model)?;
    let row_tokens = args.pref.max_length.unwrap_or(a.seq_len);
    if row_tokens > cfg.max_position_embeddings {
        return Err(flag_error(format!(
            "--max-length {row_tokens} is longer than the model's max_position_embeddings ({}) in {}",
            cfg.max_position_embeddings, cfg_path
        )));
    }
    let Layout { lora, base_id, parallelism } = super::tune::check_layout(a, &args.lora, &cfg, &model, (&model, &cfg))?;
    let ref_dir = match &args.pref.ref_model {
        Some(r) => {
            let d = super::model_dir("--ref-model", r)?;
            let rc = LlamaConfig::from_file(d.join("config.json"))?;
            if rc.vocab_size != cfg.vocab_size {
                return Err(flag_error(format!(
                    "--ref-model {}: its vocabulary has {} tokens, --model's {}: the reference must score the same tokens",
                    r.display(),
                    rc.vocab_size,
                    cfg.vocab_size
                )));
            }
            parallelism.check_model(&rc)?;
            super::lora::check_quant_layout(args.lora.quantize_base, &d, &parallelism)?;
            d
        }
        None => model.clone(),
    };
    let (tok_path, tokenizer) = super::tune::tokenizer(a, &model, &cfg, &cfg_path)?;
    let template = match crate::chat::template(Some(&model), args.data.chat_template.as_deref(), &tokenizer) {
        Ok((t, s)) => Some((t, s.text)),
        Err(e) if args.data.chat_template.is_some() => return Err(e.context("--chat-template")),
        Err(e) => {
            tracing::info!("no chat template ({e:#}): only standard (text) records can be read");
            None
        }
    };
    let mut opts = PreferenceOptions::new(&tokenizer, template.as_ref().map(|(t, _)| t));
    opts.format = args.data.data_format;
    opts.max_length = Some(row_tokens);
    opts.max_prompt_length = args.pref.max_prompt_length;
    opts.skip_bad_records = a.records.skip_bad_records;
    let data = a.data.clone().unwrap_or_else(|| super::bundled(DEFAULT_DATA));
    let pairs = load_pairs(&data, &opts, "training pairs")?;
    let (train, val) = match &args.data.val_data {
        Some(v) => {
            crate::run_dir::warn_val_is_data(&data, v, "pairs");
            (pairs, load_pairs(v, &opts, "validation pairs")?)
        }
        None => split_validation(pairs, args.data.val_fraction, a.seed),
    };
    if val.is_empty() && args.data.val_fraction > 0.0 && args.data.val_data.is_none() {
        tracing::warn!(
            "--val-fraction {} holds out none of the {} pair(s) of --data (one must train): no validation; give more data or \
             --val-data",
            args.data.val_fraction,
            train.len()
        );
    }
    report(&format!("{} training pairs, {} validation pairs, rows of {row_tokens} tokens", train.len(), val.len()));
    let pad_id = tokenizer.eos_id().unwrap_or(0);
    let source = args.save.source(&model, a.tokenizer.as_deref(), template.as_ref().map(|(_, s)| s.as_str()))?;
    let mut layout = super::tune::mem_layout(&parallelism, a, lora)?;
    // What the run holds beside the policy: a live reference's weights, or nothing (precomputed
    // log-probs; LoRA's base with the adapters off); rows of two sequences a pair.
    use crate::planner::memory::{PreferenceMem, ReferenceMode, RunShape};
    let reference = if args.pref.precompute_ref || (args.lora.enabled() && args.pref.ref_model.is_none()) {
        ReferenceMode::None
    } else {
        ReferenceMode::Separate
    };
    layout.preference = Some(PreferenceMem { reference });
    let shape = RunShape { seq_len: row_tokens, ..a.options().shape() };
    let mem = crate::planner::memory::check_layout(&cfg, dtype, device, &shape, &layout)?;
    report(&format!("memory: predicted peak {}", crate::planner::memory::describe(&mem)));
    // The reference.
    let (mut live_ref, mut refs) = (None, None);
    if args.pref.precompute_ref {
        let id = crate::dpo::identity(&train, &val, &crate::dpo::model_identity(&ref_dir, dtype));
        let mut dirs = vec![a.out.clone()];
        if let Some(run) = a.resume.as_deref().and_then(crate::run_dir::run_dir_of) {
            dirs.insert(0, run);
        }
        for d in &dirs {
            if let Some(r) = RefLogps::find(d, &id)? {
                report(&format!("reference: precomputed log-probs reused from {}", d.join(crate::dpo::REF_LOGPS).display()));
                refs = Some(r);
                break;
            }
        }
        if refs.is_none() {
            let mut m = super::lora::load_model(&ref_dir, args.lora.quantize_base, dtype, device)?;
            m.loss_chunks = a.loss_chunks();
            let bs = a.batch_size;
            let t = crate::dpo::precompute(&m, &train, bs, row_tokens, pad_id)?;
            let v = crate::dpo::precompute(&m, &val, bs, row_tokens, pad_id)?;
            report(&format!(
                "reference: log-probs of {} training and {} validation pairs precomputed with {}; no reference weights are held while training",
                t.len(),
                v.len(),
                ref_dir.display()
            ));
            refs = Some(RefLogps { identity: id, train: t, val: v });
        }
    } else if !(args.lora.enabled() && args.pref.ref_model.is_none()) {
        live_ref = Some(ref_dir);
    }
    let set =
        TrainSet::Pairs { train: PairData { pairs: Arc::new(train), row_tokens, pad_id }, val: (!val.is_empty()).then(|| Arc::new(val)) };
    Ok(Prepared {
        data: TrainData { device, dtype, tok_path, set },
        model,
        live_ref,
        refs,
        cfg: cfg_pref,
        template: template.map(|(_, s)| s),
        source,
        base_id,
    })
}

pub fn run(args: DpoArgs) -> AnyResult<()> {
    dpo(args).map(drop)
}

/// What a DPO run reported (rank 0's view).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outcome {
    /// The validation loss and metrics before (not on a resumed run) and after training.
    pub val_before: Option<(f64, PreferenceMetrics)>,
    pub val_after: Option<(f64, PreferenceMetrics)>,
}

/// [`run`], returning what it reported (nothing when `--resume` names a finished run).
pub fn dpo(mut args: DpoArgs) -> AnyResult<Outcome> {
    let given = args.model.clone();
    args.model = super::model_dir("--model", &args.model)?;
    args.lora.settle()?;
    args.pref.config()?; // flag errors before anything else
    if !args.train.settle_resume()? {
        return Ok(Outcome::default());
    }
    check_inputs(&args, &[&given, &args.model])?;
    super::tune::launch(&args.train, || prepare(&args), |p, comm| dpo_rank(&args, p, comm))
}

fn dpo_rank(args: &DpoArgs, p: &Prepared, comm: Option<Comm>) -> AnyResult<Outcome> {
    let a = &args.train;
    let (trainer, lora) = p.data.fine_tune_trainer(&p.model, &args.lora, a, comm)?;
    let reference = match (&p.refs, &p.live_ref) {
        (Some(r), _) => Reference::Precomputed(r.clone()),
        (None, Some(dir)) => {
            // A 4-bit policy base (--quantize-base) scores against a reference held as it is.
            let mut m = super::lora::load_model(dir, args.lora.quantize_base, p.data.dtype, p.data.device)
                .with_context(|| format!("cannot load the reference {}", dir.display()))?;
            m.loss_chunks = a.loss_chunks();
            let mesh = trainer.engine.mesh();
            if mesh.tp() > 1 {
                ferrolm_parallel::tp::parallelize(&mut m, mesh.tp_group()).context("cannot shard the reference model")?;
            }
            Reference::Live(Box::new(m))
        }
        (None, None) => Reference::AdaptersOff,
    };
    report(&format!("reference: {}; loss {} (beta {})", reference.describe(), args.pref.loss_type, args.pref.beta));
    let mut trainer = trainer.with_preference(Preference::new(p.cfg.clone(), reference)).with_source(p.source.clone());
    if let Some(t) = &p.template {
        trainer = trainer.with_chat_template(t.clone());
    }
    if lora {
        trainer = super::lora::with_base(trainer, &p.model, p.base_id.as_ref());
    }
    let mut out = Outcome::default();
    if a.resume.is_none() && trainer.has_validation() {
        let v = trainer.validation(0)?;
        let m = v.metrics.clone().unwrap_or_default();
        report(&format!("validation before preference tuning: loss {:.4} | {} ({})", v.loss, crate::dpo::describe(&m), v.describe()));
        out.val_before = Some((v.loss, m));
    }
    if let Some(r) = &a.resume {
        trainer.resume(r).with_context(|| format!("--resume {}", r.display()))?;
        report(&format!("resumed from {} at step {}", r.display(), trainer.step));
    }
    trainer.run()?;
    if trainer.has_validation() {
        let v = trainer.final_validation()?;
        let m = v.metrics.clone().unwrap_or_default();
        report(&format!("validation after preference tuning: loss {:.4} | {}", v.loss, crate::dpo::describe(&m)));
        out.val_after = Some((v.loss, m));
    }
    report(&format!("checkpoint: {}  (loss curve: {})", a.out.join("checkpoints").display(), a.out.join("loss.png").display()));
    super::lora::merge(&args.lora, &p.model, None, &a.out, &p.source)?;
    Ok(out)
}
