//! `pretrain_llama`: pretrain a LLaMA model from scratch (or continue a run).
use super::{env_help, LogArgs, Tool, TrainArgs, TrainData, ENV_COMMON, ENV_DEVICE, ENV_LAUNCH, ENV_TRAIN};
use crate::data::{Shard, Tokenizer};
use crate::nn::generate::generate_within;
use crate::nn::LlamaConfig;
use crate::progress::report;
use crate::run_dir;
use crate::train::{check_validation_data, unigram_entropy};
use crate::{AnyResult, Llama};
use anyhow::{bail, Context};
use clap::{Command, Parser};
use ferrolm_tensor::Rng;
use std::path::{Path, PathBuf};

#[derive(Parser, Debug, Clone, PartialEq)]
#[command(
    allow_negative_numbers = true,
    name = "pretrain_llama",
    about = "Pretrain a LLaMA model with Hugging Face compatible checkpoints. With no flags: a small model on the \
             bundled Shakespeare corpus, on the best device present, in a few minutes on a laptop CPU.",
    after_help = env_help(&[ENV_COMMON, ENV_DEVICE, ENV_TRAIN, ENV_LAUNCH])
)]
pub struct PretrainArgs {
    /// Model: a preset (tiny, small) or a Hugging Face config.json of any supported family
    /// (llama, llamaLadder, qwen2, qwen3, mistral, gemma3_text; checkpoints keep its family)
    #[arg(long, value_name = "tiny|small|FILE", default_value = "tiny", help_heading = "Model")]
    pub config: String,
    /// Pretrain a Ladder Transformer (Ladder Residual): `all`, the last N layers, or layer
    /// indices i,j,k [default: the standard Llama; a llamaLadder --config keeps its own]
    #[arg(long, value_name = "all|N|i,j,k", help_heading = "Model", value_parser = super::ladder_layers_form)]
    pub ladder_layers: Option<String>,
    /// Take the model, layout and batch from a train_config.json written by the autoconfig
    /// example; flags given here win, also when given at their default value
    /// [default: every flag from the command line]
    #[arg(long, value_name = "FILE", help_heading = "Model")]
    pub config_from: Option<PathBuf>,
    /// Text the closing sample continues [default: a line break]
    #[arg(long, value_name = "TEXT", help_heading = "Run")]
    pub sample_prompt: Option<String>,
    #[command(flatten)]
    pub train: TrainArgs,
    /// The flags given on the command line (clap ids), which `--config-from` leaves alone.
    #[arg(skip)]
    pub given: Vec<String>,
}

impl Tool for PretrainArgs {
    fn train_args_mut(&mut self) -> Option<&mut TrainArgs> {
        Some(&mut self.train)
    }
    fn cli() -> Command {
        <Self as clap::CommandFactory>::command().mut_arg("out", |a| a.default_value("runs/pretrain_llama"))
    }
    fn log_args(&self) -> &LogArgs {
        &self.train.log
    }
    fn record_matches(&mut self, m: &clap::ArgMatches) {
        self.given = m
            .ids()
            .filter(|id| m.value_source(id.as_str()) == Some(clap::parser::ValueSource::CommandLine))
            .map(|id| id.to_string())
            .collect();
    }
}

/// Checks the flags and the output directory before anything slow or large happens.
pub(crate) fn preflight(a: &TrainArgs) -> AnyResult<()> {
    a.options().validate()?;
    let resumed = match &a.resume {
        Some(r) => {
            let dir = run_dir::resolve_checkpoint(r).with_context(|| format!("--resume {}", r.display()))?;
            let step = crate::checkpoint::checkpoint_step(&dir).with_context(|| format!("--resume {}", r.display()))?;
            Some((run_dir::run_dir_of(&dir), step))
        }
        None => None,
    };
    run_dir::check_out_dir(&a.out, resumed.as_ref().map(|(d, s)| (d.as_deref(), *s)), a.overwrite)
}

/// `--seq-len` against the positions of the model `cfg` (read from `model`), a flag error: checked
/// before any data is read or tokenized.
pub(crate) fn check_seq_len(seq_len: usize, cfg: &LlamaConfig, model: &str) -> AnyResult<()> {
    let max = cfg.max_position_embeddings;
    if seq_len > max {
        return Err(super::flag_error(format!(
            "--seq-len {seq_len} is longer than the model's max_position_embeddings ({max}, {model}): give --seq-len {max} or less"
        )));
    }
    Ok(())
}

/// What every rank shares: the checked flags, the tokenizer and the prepared data.
struct Prepared {
    data: TrainData,
    tokenizer: Tokenizer,
    cfg: LlamaConfig,
}

fn prepare(args: &PretrainArgs) -> AnyResult<Prepared> {
    let a = &args.train;
    preflight(a)?;
    let opts = a.options();
    let device = a.device.pick()?;
    let dtype = a.device.dtype(device);

    // The model first: --seq-len is checked against it before any data is read.
    let (mut cfg, preset) = match super::preset_or_file("--config", &args.config)? {
        Some(file) => (LlamaConfig::from_file(file)?, false),
        None => (LlamaConfig::preset(&args.config).map_err(|e| super::flag_error(format!("--config: {e}")))?, true),
    };
    check_seq_len(opts.seq_len, &cfg, &args.config)?;

    let tok_path = a.tokenizer.clone().unwrap_or_else(|| super::bundled("data/tokenizer.json"));
    let tokenizer = Tokenizer::from_file(&tok_path).with_context(|| format!("cannot load the tokenizer {}", tok_path.display()))?;
    if preset {
        cfg.vocab_size = tokenizer.vocab_size();
    }
    let data = a.data.clone().unwrap_or_else(|| super::bundled("data/corpus"));
    let (shards, train, val) = crate::shards::token_data_with(&data, &tokenizer, &tok_path, &a.data_options())?;
    // The final validation always runs, so the split must serve one window whatever --eval-every.
    check_validation_data(&val, opts.batch_size, opts.seq_len).with_context(|| format!("{}", shards.display()))?;

    check_vocab(&tokenizer, &tok_path, cfg.vocab_size, &args.config)?;
    if let Some(l) = &args.ladder_layers {
        cfg.ladder_layers = Some(super::ladder_layers(l, cfg.num_hidden_layers)?);
        cfg.validate()?;
    }
    // As the checkpoint's generation_config.json says them: the token documents start after, and
    // the one that ends them (crate::tokenizer_files).
    let special = crate::tokenizer_files::SpecialIds::of(&tokenizer)?;
    cfg.bos_token_id = special.bos;
    cfg.eos_token_id = special.eos.map(|e| vec![e]).unwrap_or_default();
    let parallelism = a.parallel.layout()?;
    parallelism.check_model(&cfg)?;
    let mut layout = parallelism.mem_layout(a.activation_checkpointing)?;
    layout.loss_chunks = a.loss_chunks();
    let mem = crate::planner::memory::check_layout(&cfg, dtype, device, &opts.shape(), &layout)?;
    report(&format!("memory: predicted peak {}", crate::planner::memory::describe_layout(&mem, &layout)));
    let set = crate::train::TrainSet::Shards { train, val };
    Ok(Prepared { data: TrainData { device, dtype, tok_path, set }, tokenizer, cfg })
}

/// The model's `vocab_size` against the tokenizer's ids: smaller is refused (the ids would index
/// past the embedding); larger (a vocabulary padded to a round size, e.g. 32000 for a 4096-token
/// tokenizer) trains, with one warning here, and the sample at the end draws only the
/// tokenizer's ids.
pub(crate) fn check_vocab(tokenizer: &Tokenizer, tok_path: &Path, model_vocab: usize, model: &str) -> AnyResult<()> {
    let tok_vocab = tokenizer.vocab_size();
    if tok_vocab > model_vocab {
        bail!(
            "{}: the tokenizer's ids go up to {} but the model's vocab_size ({model}) is {model_vocab}: its ids would index past \
             the embedding table; use a model with vocab_size >= {tok_vocab}",
            tok_path.display(),
            tok_vocab - 1,
        );
    }
    if model_vocab > tok_vocab {
        tracing::warn!(
            "the model's vocab_size ({model_vocab}, {model}) is larger than the tokenizer's {tok_vocab} ids ({}): rows {tok_vocab}..{} \
             of the embedding are padding that no text uses; sampling draws only the tokenizer's ids",
            tok_path.display(),
            model_vocab - 1
        );
    }
    Ok(())
}

/// Fills the flags left at their defaults from `--config-from` (the autoconfig example's
/// train_config.json); returns the flags unchanged without it.
pub fn apply_config_from(mut args: PretrainArgs) -> AnyResult<PretrainArgs> {
    let Some(path) = args.config_from.clone() else { return Ok(args) };
    let f = crate::autoconfig::trial::TrainConfig::load(&path).context("--config-from")?;
    let given = std::mem::take(&mut args.given);
    let mut filled = Vec::new();
    // A flag given on the command line wins, at whatever value; the file fills the others.
    macro_rules! fill {
        ($field:expr, $value:expr, $name:literal) => {
            if !given.iter().any(|g| g == $name) {
                $field = $value;
                filled.push($name);
            }
        };
    }
    if let Some(c) = f.config {
        fill!(args.config, c, "config");
    }
    if f.ladder_layers.is_some() {
        fill!(args.ladder_layers, f.ladder_layers, "ladder_layers");
    }
    let t = &mut args.train;
    fill!(t.parallel.tp, f.tp, "tp");
    fill!(t.parallel.dp, f.dp, "dp");
    // --zero conflicts with the --shard-* flags: a preset given here replaces the file's spec.
    if t.parallel.zero.is_none() {
        fill!(t.parallel.shard_params, Some(f.shard_params), "shard_params");
        fill!(t.parallel.shard_grads, Some(f.shard_grads), "shard_grads");
        fill!(t.parallel.shard_optim, Some(f.shard_optim), "shard_optim");
    }
    fill!(t.parallel.ranks_per_node, Some(f.ranks_per_node), "ranks_per_node");
    fill!(t.batch_size, f.batch_size, "batch_size");
    fill!(t.grad_accum, f.grad_accum, "grad_accum");
    fill!(t.seq_len, f.seq_len, "seq_len");
    fill!(t.lr, f.lr, "lr");
    fill!(t.activation_checkpointing, f.activation_checkpointing, "activation_checkpointing");
    if let Some(steps) = f.steps {
        fill!(t.steps, steps, "steps");
    }
    if let Some(w) = f.warmup_steps {
        fill!(t.warmup_steps, Some(w), "warmup_steps");
        if w >= t.steps {
            tracing::warn!(
                "{}: a warmup of {w} steps is not shorter than the run's {}: the rate never reaches its peak",
                path.display(),
                t.steps
            );
        }
    }
    if let Some(d) = &f.dtype {
        let d = super::ComputeDtype::parse(d)
            .ok_or_else(|| anyhow::anyhow!("{}: dtype must be \"f32\" or \"bf16\", got {d:?}", path.display()))?;
        fill!(t.device.dtype, Some(d), "dtype");
    }
    if let Some(g) = &f.grad_reduce_dtype {
        let g: ferrolm_parallel::zero::GradReduceDtype =
            g.parse().map_err(|e: String| anyhow::anyhow!("{}: grad_reduce_dtype: {e}", path.display()))?;
        fill!(t.parallel.grad_reduce_dtype, g, "grad_reduce_dtype");
    }
    if f.checkpointed_layers > 0 && !f.activation_checkpointing {
        tracing::warn!(
            "{}: the layout checkpoints {} layers; pretrain_llama checkpoints all or none, so none here",
            path.display(),
            f.checkpointed_layers
        );
    }
    if f.offload_optimizer {
        fill!(t.parallel.offload_optimizer, true, "offload_optimizer");
        if let Some(v) = &f.offload_gpu_every {
            let text = v.as_str().map(String::from).unwrap_or_else(|| v.to_string());
            let k: ferrolm_parallel::offload::GpuEvery =
                text.parse().map_err(|e: String| anyhow::anyhow!("{}: offload_gpu_every: {e}", path.display()))?;
            fill!(t.parallel.offload_gpu_every, k, "offload_gpu_every");
        }
    }
    report(&format!("--config-from {}: {}", path.display(), if filled.is_empty() { "nothing filled".into() } else { filled.join(", ") }));
    Ok(args)
}

pub fn run(args: PretrainArgs) -> AnyResult<()> {
    let mut args = apply_config_from(args)?;
    if !args.train.settle_resume()? {
        return Ok(());
    }
    let a = &args.train;
    let config = Path::new(&args.config);
    let mut inputs = vec![("--config", config)];
    inputs.retain(|(_, p)| p.is_file()); // a preset name is no path
    if let Some(f) = &args.config_from {
        inputs.push(("--config-from", f));
    }
    a.check_inputs_outside_out("data/corpus", true, &inputs)?;
    if a.profile {
        crate::profile::enable();
    }
    let device = a.device.pick()?;
    crate::parallel::launch(&a.parallel.layout()?, device, || prepare(&args), |p, comm| train_rank(&args, p, comm))
}

/// One rank's run (the only one on a single device).
fn train_rank(args: &PretrainArgs, p: &Prepared, comm: Option<crate::parallel::Comm>) -> AnyResult<()> {
    let a = &args.train;
    let opts = a.options();
    let mut rng = Rng::new(opts.seed);
    let mut model = Llama::new(p.cfg.clone(), p.data.dtype, p.data.device, &mut rng)?;
    model.set_activation_checkpointing(a.activation_checkpointing);
    let kind = match &p.cfg.ladder_layers {
        Some(l) => format!(" (Ladder Transformer: {l} layers)"),
        None => String::new(),
    };
    report(&format!(
        "model: {} parameters ({:.2} M), {} layers, hidden {}, on {} in {}{kind}",
        model.num_params(),
        model.num_params() as f64 / 1e6,
        model.config().num_hidden_layers,
        model.config().hidden_size,
        p.data.device,
        p.data.dtype
    ));
    let (mut trainer, _) = p.data.trainer(model, a, opts.clone(), comm)?;
    if let Some(r) = &a.resume {
        trainer.resume(r).with_context(|| format!("--resume {}", r.display()))?;
        report(&format!("resumed from {} at step {}", r.display(), trainer.step));
    }
    trainer.run()?;

    // The last step's validation, over the whole split: the line in metrics.jsonl.
    let final_val = trainer.final_validation()?;
    let val_loss = final_val.loss;
    let mut tokens = Vec::new();
    let val = match &p.data.set {
        crate::train::TrainSet::Shards { val, .. } => val.as_slice(),
        crate::train::TrainSet::Rows { .. } | crate::train::TrainSet::Pairs { .. } => &[],
    };
    for s in val {
        let s = Shard::open(s)?;
        tokens.extend(s.slice(0, s.len()));
    }
    let baseline = unigram_entropy(tokens.into_iter());
    report(&format!(
        "final validation loss {val_loss:.4} ({}; unigram-entropy baseline {baseline:.4}, ppl {:.1} vs {:.1})",
        final_val.describe(),
        val_loss.exp(),
        baseline.exp()
    ));
    if val_loss >= baseline && crate::logging::is_rank_zero() {
        tracing::warn!("the model did not beat the unigram baseline; train longer or raise --lr");
    }
    report(&format!("checkpoint: {}  (loss curve: {})", a.out.join("checkpoints").display(), a.out.join("loss.png").display()));

    // The sample is a look at the model, not part of the run: a failure is a warning.
    let prompt = args.sample_prompt.as_deref().unwrap_or("\n");
    let sample = p.tokenizer.encode_as_document(prompt).map_err(anyhow::Error::from).and_then(|ids| {
        let out = generate_within(&trainer.model, &ids, 80, 0.8, 0.95, p.tokenizer.vocab_size(), &mut trainer.rng)?;
        Ok(p.tokenizer.decode(&out)?)
    });
    match sample {
        Ok(text) => {
            report(&format!("--- sample ---\n{prompt}{text}"));
        }
        Err(e) => tracing::warn!("no sample: {e:#}"),
    }
    Ok(())
}
