//! `pretrain_llama`: pretrain a LLaMA model from scratch (or continue a run).
use super::{env_help, prepare, LogArgs, Tool, TrainArgs, ENV_COMMON, ENV_DEVICE, ENV_LAUNCH, ENV_TRAIN};
use crate::data::{PrepareSummary, Shard, Tokenizer};
use crate::nn::generate::generate;
use crate::nn::LlamaConfig;
use crate::progress::report;
use crate::run_dir;
use crate::train::{check_validation_data, unigram_entropy, Trainer};
use crate::{AnyResult, DType, Device, Llama};
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
    /// Model: a preset (tiny, small) or a config.json
    #[arg(long, value_name = "tiny|small|FILE", default_value = "tiny", help_heading = "Model")]
    pub config: String,
    /// Pretrain a Ladder Transformer (Ladder Residual): `all`, the last N layers, or layer
    /// indices i,j,k [default: the standard Llama; a llamaLadder --config keeps its own]
    #[arg(long, value_name = "all|N|i,j,k", help_heading = "Model")]
    pub ladder_layers: Option<String>,
    /// Take the model, layout and batch from a train_config.json written by the autoconfig
    /// example; flags given here win (a flag given at its default value counts as not given)
    /// [default: every flag from the command line]
    #[arg(long, value_name = "FILE", help_heading = "Model")]
    pub config_from: Option<PathBuf>,
    #[command(flatten)]
    pub train: TrainArgs,
}

impl Tool for PretrainArgs {
    fn cli() -> Command {
        <Self as clap::CommandFactory>::command().mut_arg("out", |a| a.default_value("runs/pretrain_llama"))
    }
    fn log_args(&self) -> &LogArgs {
        &self.train.log
    }
}

/// Cache folder for tokenized text: named after the data and keyed by the files' names, sizes
/// and modification times and the tokenizer, so edited data or another tokenizer re-tokenizes.
fn cache_name(data: &Path, tokenizer: &Path) -> AnyResult<String> {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for f in crate::data::text_files(data)?.iter().chain([&tokenizer.to_path_buf()]) {
        let m = std::fs::metadata(f).with_context(|| format!("cannot read {}", f.display()))?;
        (f.file_name(), m.len(), m.modified().ok()).hash(&mut h);
    }
    let stem = data.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "data".into());
    Ok(format!("{stem}-{:016x}", h.finish()))
}

/// The shard directory for `data`: a prepared directory as is, text tokenized once into runs/cache.
pub(crate) fn shard_dir(data: &Path, tokenizer: &Tokenizer, tok_path: &Path) -> AnyResult<PathBuf> {
    let what = if data.extension().is_some() { "data file" } else { "data directory" };
    std::fs::metadata(data).with_context(|| format!("cannot open {what} {}", data.display()))?;
    if PrepareSummary::load(data)?.is_some() {
        return Ok(data.to_path_buf());
    }
    let dir = PathBuf::from("runs/cache").join(cache_name(data, tok_path)?);
    if PrepareSummary::load(&dir)?.is_none() {
        tracing::info!("tokenizing {} with {} into {}", data.display(), tok_path.display(), dir.display());
        let s = prepare::tokenize_text(data, tokenizer, &dir, 0.05, 1 << 24)?;
        report(&format!("  {} train / {} validation tokens in {}", s.train_tokens, s.val_tokens, dir.display()));
    }
    Ok(dir)
}

/// The train and validation shards for `--data`, checked at open against the tokenizer (manifest
/// vocabulary and fingerprint, every shard's dtype, length and ids): a bad id is found here, not
/// at the step that first draws it.
pub(crate) fn token_data(data: &Path, tokenizer: &Tokenizer, tok_path: &Path) -> AnyResult<(PathBuf, Vec<PathBuf>, Vec<PathBuf>)> {
    let shards = shard_dir(data, tokenizer, tok_path)?;
    let td = crate::data::check_token_data(&shards, tokenizer)
        .with_context(|| format!("the prepared data in {} does not fit the tokenizer {}", shards.display(), tok_path.display()))?;
    for w in &td.warnings {
        tracing::warn!("{w}");
    }
    Ok((shards, td.train_shards, td.val_shards))
}

/// Checks the flags and the output directory before anything slow or large happens.
pub(crate) fn preflight(a: &TrainArgs) -> AnyResult<()> {
    a.options().validate()?;
    let resumed = match &a.resume {
        Some(r) => {
            let dir = run_dir::resolve_checkpoint(r).with_context(|| format!("--resume {}", r.display()))?;
            let state = std::fs::read_to_string(dir.join(run_dir::TRAINER_STATE))?;
            let step = serde_json::from_str::<serde_json::Value>(&state)?
                .get("step")
                .and_then(|s| s.as_u64())
                .with_context(|| format!("{}: no step", dir.join(run_dir::TRAINER_STATE).display()))?;
            Some((run_dir::run_dir_of(&dir), step as usize))
        }
        None => None,
    };
    run_dir::check_out_dir(&a.out, resumed.as_ref().map(|(d, s)| (d.as_deref(), *s)), a.overwrite)
}

/// What every rank shares: the checked flags, the tokenizer and the prepared data.
struct Prepared {
    device: Device,
    dtype: DType,
    tok_path: PathBuf,
    tokenizer: Tokenizer,
    train: Vec<PathBuf>,
    val: Vec<PathBuf>,
    cfg: LlamaConfig,
}

fn prepare(args: &PretrainArgs) -> AnyResult<Prepared> {
    let a = &args.train;
    preflight(a)?;
    let opts = a.options();
    let device = a.device.pick()?;
    let dtype = if device == Device::Cpu { DType::F32 } else { DType::BF16 };

    let tok_path = a.tokenizer.clone().unwrap_or_else(|| super::bundled("data/tokenizer.json"));
    let tokenizer = Tokenizer::from_file(&tok_path).with_context(|| format!("cannot load the tokenizer {}", tok_path.display()))?;
    let data = a.data.clone().unwrap_or_else(|| super::bundled("data/corpus"));
    let (shards, train, val) = token_data(&data, &tokenizer, &tok_path)?;
    // The final validation always runs, so the split must serve one window whatever --eval-every.
    check_validation_data(&val, opts.batch_size, opts.seq_len).with_context(|| format!("{}", shards.display()))?;

    let mut cfg = if Path::new(&args.config).is_file() {
        LlamaConfig::from_file(Path::new(&args.config))?
    } else {
        let mut c = LlamaConfig::preset(&args.config).context("--config")?;
        c.vocab_size = tokenizer.vocab_size();
        c
    };
    if tokenizer.vocab_size() > cfg.vocab_size {
        bail!(
            "{}: the tokenizer has {} tokens but the model's vocab_size is {}",
            tok_path.display(),
            tokenizer.vocab_size(),
            cfg.vocab_size
        );
    }
    if let Some(l) = &args.ladder_layers {
        cfg.ladder_layers = Some(crate::nn::LadderLayers::parse_flag(l, cfg.num_hidden_layers)?);
        cfg.validate()?;
    }
    cfg.bos_token_id = tokenizer.bos_id();
    cfg.eos_token_id = tokenizer.eos_id().map(|e| vec![e]).unwrap_or_default();
    let layout = a.parallel.mem_layout(a.activation_checkpointing)?;
    let mem = crate::memory::check_layout(&cfg, dtype, device, &opts.shape(), &layout)?;
    report(&format!("memory: predicted peak {}", crate::memory::describe(&mem)));
    Ok(Prepared { device, dtype, tok_path, tokenizer, train, val, cfg })
}

/// Fills the flags left at their defaults from `--config-from` (the autoconfig example's
/// train_config.json); returns the flags unchanged without it.
pub fn apply_config_from(mut args: PretrainArgs) -> AnyResult<PretrainArgs> {
    let Some(path) = args.config_from.clone() else { return Ok(args) };
    let f = crate::autoconfig::trial::TrainConfig::load(&path).context("--config-from")?;
    let d: PretrainArgs = super::parse_from(["pretrain_llama"])?;
    let mut filled = Vec::new();
    macro_rules! fill {
        ($field:expr, $default:expr, $value:expr, $name:literal) => {
            if $field == $default {
                $field = $value;
                filled.push($name);
            }
        };
    }
    if let Some(c) = f.config {
        fill!(args.config, d.config, c, "config");
    }
    if f.ladder_layers.is_some() {
        fill!(args.ladder_layers, d.ladder_layers, f.ladder_layers, "ladder_layers");
    }
    let (t, dt) = (&mut args.train, &d.train);
    fill!(t.parallel.tp, dt.parallel.tp, f.tp, "tp");
    fill!(t.parallel.dp, dt.parallel.dp, f.dp, "dp");
    // --zero conflicts with the --shard-* flags: a preset given here replaces the file's spec.
    if t.parallel.zero.is_none() {
        fill!(t.parallel.shard_params, dt.parallel.shard_params, Some(f.shard_params), "shard_params");
        fill!(t.parallel.shard_grads, dt.parallel.shard_grads, Some(f.shard_grads), "shard_grads");
        fill!(t.parallel.shard_optim, dt.parallel.shard_optim, Some(f.shard_optim), "shard_optim");
    }
    fill!(t.parallel.ranks_per_node, dt.parallel.ranks_per_node, Some(f.ranks_per_node), "ranks_per_node");
    fill!(t.batch_size, dt.batch_size, f.batch_size, "batch_size");
    fill!(t.grad_accum, dt.grad_accum, f.grad_accum, "grad_accum");
    fill!(t.seq_len, dt.seq_len, f.seq_len, "seq_len");
    fill!(t.lr, dt.lr, f.lr, "lr");
    fill!(t.activation_checkpointing, dt.activation_checkpointing, f.activation_checkpointing, "activation_checkpointing");
    if let Some(steps) = f.steps {
        fill!(t.steps, dt.steps, steps, "steps");
    }
    if f.checkpointed_layers > 0 && !f.activation_checkpointing {
        tracing::warn!(
            "{}: the layout checkpoints {} layers; pretrain_llama checkpoints all or none, so none here",
            path.display(),
            f.checkpointed_layers
        );
    }
    if f.offload_optimizer {
        fill!(t.parallel.offload_optimizer, dt.parallel.offload_optimizer, true, "offload_optimizer");
        if let Some(v) = &f.offload_gpu_every {
            let text = v.as_str().map(String::from).unwrap_or_else(|| v.to_string());
            let k: ferrolm_dist::offload::GpuEvery =
                text.parse().map_err(|e: String| anyhow::anyhow!("{}: offload_gpu_every: {e}", path.display()))?;
            fill!(t.parallel.offload_gpu_every, dt.parallel.offload_gpu_every, k, "offload_gpu_every");
        }
    }
    report(&format!("--config-from {}: {}", path.display(), if filled.is_empty() { "nothing filled".into() } else { filled.join(", ") }));
    Ok(args)
}

pub fn run(args: PretrainArgs) -> AnyResult<()> {
    let args = apply_config_from(args)?;
    let a = &args.train;
    let device = a.device.pick()?;
    crate::parallel::launch(&a.parallel, device, || prepare(&args), |p, comm| train_rank(&args, p, comm))
}

/// One rank's run (the only one on a single device).
fn train_rank(args: &PretrainArgs, p: &Prepared, comm: Option<crate::parallel::Comm>) -> AnyResult<()> {
    let a = &args.train;
    let opts = a.options();
    let mut rng = Rng::new(opts.seed);
    let mut model = Llama::new(p.cfg.clone(), p.dtype, p.device, &mut rng)?;
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
        p.device,
        p.dtype
    ));
    let parallel = comm.is_some();
    let engine = crate::parallel::attach(&mut model, comm, &a.parallel, Trainer::adamw_config(&opts))?;
    if parallel {
        report(&format!("parallel: tp {} x dp {} ranks, sharding {}", a.parallel.tp, a.parallel.dp, engine.spec));
    }
    let mut trainer = Trainer::with_engine(model, Box::new(engine), &p.train, &p.val, opts.clone(), &a.out)?;
    trainer = trainer.with_tokenizer(&p.tok_path).with_safety(a.safety());
    if let Some(r) = &a.resume {
        trainer.resume(r).with_context(|| format!("--resume {}", r.display()))?;
        report(&format!("resumed from {} at step {}", r.display(), trainer.step));
    }
    trainer.run()?;

    let val_loss = trainer.evaluate(0)?;
    let mut tokens = Vec::new();
    for s in &p.val {
        let s = Shard::open(s)?;
        tokens.extend(s.slice(0, s.len()));
    }
    let baseline = unigram_entropy(tokens.into_iter());
    report(&format!(
        "final validation loss {val_loss:.4} (unigram-entropy baseline {baseline:.4}, ppl {:.1} vs {:.1})",
        val_loss.exp(),
        baseline.exp()
    ));
    if val_loss >= baseline && crate::logging::is_rank_zero() {
        tracing::warn!("the model did not beat the unigram baseline; train longer or raise --lr");
    }
    report(&format!("checkpoint: {}  (loss curve: {})", a.out.join("checkpoints").display(), a.out.join("loss.png").display()));

    let prompt = "ROMEO:\n";
    let ids = p.tokenizer.encode(prompt, false)?;
    let out = generate(&trainer.model, &ids, 80, 0.8, 0.95, &mut trainer.rng)?;
    report(&format!("--- sample ---\n{}{}", prompt, p.tokenizer.decode(&out)?));
    Ok(())
}
