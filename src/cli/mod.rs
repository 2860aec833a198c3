//! The command-line tools: their flags (clap derive) and what they run, as library functions
//! that `examples/*.rs` wrap in three lines and tests call directly.
//!
//! Shared flags are defined once and flattened into each tool: [`LogArgs`] and [`DeviceArgs`]
//! everywhere, [`TrainArgs`] in every training tool. A tool is a [`Tool`]: it may adjust the
//! derived command (a per-tool default of a shared flag, see `pretrain::PretrainArgs`), and
//! [`main_with`] runs it: flag errors are clap's (exit code 2, with suggestions), runtime errors
//! print their whole chain of causes (`error: cannot open data directory foo: No such file or
//! directory (os error 2)`) and exit with 1.
pub mod autoconfig;
pub mod cluster;
pub mod dpo;
pub mod eval;
pub mod export;
pub mod finetune;
pub mod finetune_ladder;
pub mod generate;
pub mod launch;
pub mod lora;
pub mod parallel;
pub mod plan;
pub mod prepare;
pub mod pretrain;
pub(crate) mod tune;

pub use crate::errors::{exit_code, flag_error, FlagError};
use crate::train::{RunSafety, TrainOptions};
use crate::AnyResult;
use clap::{ArgMatches, Args, Command, CommandFactory, Parser};
use std::ffi::OsString;
use std::path::PathBuf;

/// A command-line tool built from a clap derive.
pub trait Tool: Parser {
    /// The command as parsed: the derived one, adjusted where a tool needs (defaults of shared
    /// flags that differ per tool).
    fn cli() -> Command {
        <Self as CommandFactory>::command()
    }
    fn log_args(&self) -> &LogArgs;
    /// Sees the parsed matches (e.g. which flags were given on the command line).
    fn record_matches(&mut self, _m: &ArgMatches) {}
    /// A training tool's shared flags, so parsing can record which of them were given (a
    /// resumed run continues in its own directory unless `--out` is given).
    fn train_args_mut(&mut self) -> Option<&mut TrainArgs> {
        None
    }
}

/// Parses `args` (program name first) as tool `A`.
pub fn parse_from<A: Tool, I, T>(args: I) -> Result<A, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let mut cmd = A::cli();
    let m: ArgMatches = cmd.try_get_matches_from_mut(args)?;
    let mut a = A::from_arg_matches(&m).map_err(|e| e.format(&mut cmd))?;
    a.record_matches(&m);
    if let Some(t) = a.train_args_mut() {
        t.out_given = m.value_source("out") == Some(clap::parser::ValueSource::CommandLine);
    }
    Ok(a)
}

/// Parses `args`, sets up logging, runs `run`, and returns the process exit code: 0, 1 for a
/// runtime error (printed with its causes), or clap's code for a flag error (2; 0 for `--help`).
pub fn run_tool<A, I, T>(args: I, run: impl FnOnce(A) -> AnyResult<()>) -> i32
where
    A: Tool,
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let a: A = match parse_from(args) {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return e.exit_code();
        }
    };
    if let Err(e) = crate::logging::init(a.log_args().log_level.as_deref()) {
        eprintln!("error: --log-level {e}");
        return 2;
    }
    match run(a) {
        Ok(()) => 0,
        Err(e) => {
            crate::progress::suspend(|| eprintln!("{}", error_report(&e)));
            exit_code(&e)
        }
    }
}

/// `main` of a tool: `fn main() { ferrolm::cli::main_with(ferrolm::cli::eval::run) }`.
pub fn main_with<A: Tool>(run: impl FnOnce(A) -> AnyResult<()>) -> ! {
    std::process::exit(run_tool(std::env::args_os(), run))
}

/// What every rank of a training tool shares after preparation: the device and dtype, the
/// tokenizer file and the data (token shards, or packed conversations).
pub(crate) struct TrainData {
    pub device: crate::Device,
    pub dtype: crate::DType,
    pub tok_path: std::path::PathBuf,
    pub set: crate::train::TrainSet,
}

impl TrainData {
    /// This rank's trainer for `model` and the sharding its engine uses: the engine attached
    /// for the flags' layout, the data, the tokenizer saved with checkpoints, and the run's safety
    /// settings.
    pub(crate) fn trainer(
        &self,
        mut model: crate::Llama,
        a: &TrainArgs,
        opts: crate::train::TrainOptions,
        comm: Option<crate::parallel::Comm>,
    ) -> AnyResult<(crate::train::Trainer, ferrolm_parallel::zero::ShardSpec)> {
        model.loss_chunks = a.loss_chunks();
        let engine = crate::parallel::attach(&mut model, comm, &a.parallel.layout()?, crate::train::Trainer::adamw_config(&opts))?;
        let spec = engine.spec;
        a.parallel.report(&spec);
        let t = crate::train::Trainer::with_engine_on(model, Box::new(engine), &self.set, opts, &a.out)?;
        Ok((t.with_tokenizer(&self.tok_path).with_safety(a.safety()).with_final_validation(), spec))
    }

    /// A fine-tuning rank's trainer (finetune, dpo): `model_dir` loaded (held 4-bit with
    /// `--quantize-base`), activation checkpointing as the flags say, reported, the LoRA adapters
    /// attached when the flags ask for them (the bool), and [`TrainData::trainer`] on it.
    pub(crate) fn fine_tune_trainer(
        &self,
        model_dir: &std::path::Path,
        lora_args: &lora::LoraArgs,
        a: &TrainArgs,
        comm: Option<crate::parallel::Comm>,
    ) -> AnyResult<(crate::train::Trainer, bool)> {
        let mut model = lora::load_model(model_dir, lora_args.quantize_base, self.dtype, self.device)?;
        model.set_activation_checkpointing(a.activation_checkpointing);
        report_loaded(model_dir, &model, self.device, self.dtype);
        let lora = lora::attach(lora_args, &mut model, a.seed)?;
        let (trainer, _) = self.trainer(model, a, a.options(), comm)?;
        Ok((trainer, lora))
    }
}

/// The flags of the tools that run a trained model (eval, generate): a LoRA adapter, tensor
/// parallelism, the device and dtype, logging.
#[derive(clap::Args, Debug, Clone, PartialEq)]
pub struct ModelRunArgs {
    /// A PEFT LoRA adapter to apply to --model: a directory with adapter_config.json and
    /// adapter_model.safetensors, or a LoRA run whose latest checkpoint holds one [default: none]
    #[arg(long, value_name = "DIR", help_heading = "Model")]
    pub lora: Option<PathBuf>,
    /// Hold --model's linear weights 4-bit (nf4 or fp4, quantized on load as a QLoRA run with
    /// --quantize-base does), so the model scored or sampled is the one QLoRA trained; a
    /// checkpoint saved 4-bit loads as 4-bit without it [default: off, --dtype weights]
    #[arg(long, value_name = "nf4|fp4", value_parser = lora::quant_type, help_heading = "Model")]
    pub quantize_base: Option<ferrolm_ops::nf4::QuantType>,
    #[command(flatten)]
    pub parallel: parallel::TpArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub log: LogArgs,
}

impl ModelRunArgs {
    /// `--lora`'s adapter directory (see [`lora::resolve_adapter`]), None without the flag.
    pub fn adapter(&self) -> AnyResult<Option<PathBuf>> {
        self.lora.as_deref().map(lora::resolve_adapter).transpose().map_err(|e| e.context("--lora"))
    }

    /// Where the chat template is looked for, in order: `--lora`'s adapter (a LoRA run's
    /// checkpoint carries the run's template), then the model directory `dir`.
    pub fn template_dirs(&self, dir: &std::path::Path) -> AnyResult<Vec<PathBuf>> {
        Ok(self.adapter()?.into_iter().chain([dir.to_path_buf()]).collect())
    }

    /// Loads the tokenizer of the model `dir` names (see [`model_dir`]: a model directory, a run
    /// directory or `checkpoints/latest`), then on every rank of `--tp` the model's weights with
    /// `--lora`'s adapter (this rank's shards), checked against `--tp` before any rank starts,
    /// and runs `f` there.
    pub fn with_model(
        &self,
        dir: &std::path::Path,
        f: impl Fn(&crate::Llama, &crate::data::Tokenizer, crate::Device) -> AnyResult<()> + Sync,
    ) -> AnyResult<()> {
        let dir = &model_dir("--model", dir)?;
        let tokenizer = model_dir_tokenizer(dir)?;
        let adapter = self.lora.as_deref().map(|p| adapter_dir("--lora", p)).transpose()?;
        if let Some(a) = &adapter {
            lora::warn_other_base(a, dir)?;
        }
        let device = self.device.pick()?;
        let dtype = self.device.dtype(device);
        let layout = self.parallel.layout()?;
        layout.check_model(&crate::nn::LlamaConfig::from_file(dir.join("config.json"))?)?;
        lora::check_quant_layout(self.quantize_base, dir, &layout)?;
        crate::parallel::launch(
            &layout,
            device,
            || Ok(()),
            |_, comm| {
                let model = crate::parallel::load_for_inference(dir, adapter.as_deref(), self.quantize_base, dtype, device, comm, &layout)?;
                f(&model, &tokenizer, device)
            },
        )
    }
}

/// The model directory `path` names, for a flag such as `--model`: a model directory as it is,
/// a run directory's newest complete checkpoint, or the one `checkpoints/latest` names
/// (`checkpoint::resolve_model_dir`). Says in the log which checkpoint it chose when that is not
/// `path` itself; errors name the flag. Every tool that loads a model resolves its path here.
pub fn model_dir(flag: &str, path: &std::path::Path) -> AnyResult<PathBuf> {
    use anyhow::Context;
    let dir = crate::checkpoint::resolve_model_dir(path).with_context(|| format!("{flag} {}", path.display()))?;
    if dir != path {
        tracing::info!("{flag} {}: using the checkpoint {}", path.display(), dir.display());
    }
    Ok(dir)
}

/// The adapter directory `path` names, for a flag such as `--lora`: a PEFT adapter directory as it
/// is, or a LoRA run's newest complete checkpoint (`lora::resolve_adapter`, as [`model_dir`]
/// resolves a run). Says in the log which checkpoint it chose when that is not `path` itself;
/// errors name the flag.
pub fn adapter_dir(flag: &str, path: &std::path::Path) -> AnyResult<PathBuf> {
    let dir = lora::resolve_adapter(path).map_err(|e| e.context(flag.to_string()))?;
    if dir != path {
        tracing::info!("{flag} {}: using the checkpoint {}", path.display(), dir.display());
    }
    Ok(dir)
}

/// What a flag that takes a preset name or a file (`--config`, `plan --model`) names: `Some(path)`
/// for a file, `None` for a preset name, which the caller looks up. A value that looks like a path
/// (it ends in `.json` or holds a `/`) but is not a file is "no such file", not an unknown preset.
pub fn preset_or_file<'a>(flag: &str, value: &'a str) -> AnyResult<Option<&'a std::path::Path>> {
    let path = std::path::Path::new(value);
    if path.is_file() {
        return Ok(Some(path));
    }
    if value.ends_with(".json") || value.contains('/') || value.contains(std::path::MAIN_SEPARATOR) {
        let what = if path.is_dir() { "a directory, not a config.json file" } else { "no such file" };
        anyhow::bail!("{flag} {value}: {what}");
    }
    Ok(None)
}

/// The tokenizer of a model directory (eval, generate), with errors naming the directory or file.
pub fn model_dir_tokenizer(dir: &std::path::Path) -> AnyResult<crate::data::Tokenizer> {
    use anyhow::Context;
    std::fs::metadata(dir).with_context(|| format!("cannot open the model directory {}", dir.display()))?;
    let tok_path = dir.join("tokenizer.json");
    crate::data::Tokenizer::from_file(&tok_path).with_context(|| format!("cannot load the tokenizer {}", tok_path.display()))
}

/// `error: what failed: why: root cause` on one line, as a user sees it.
pub fn error_report(e: &anyhow::Error) -> String {
    format!("error: {e:#}")
}

// ---- value parsers: flags are checked where they are read, and the error names the flag ----

fn number(s: &str) -> Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|_| format!("`{s}` is not a number"))?;
    if !v.is_finite() {
        return Err(format!("`{s}` is not a finite number"));
    }
    Ok(v)
}

/// A finite number >= 0 (learning rates, temperatures).
pub fn non_negative(s: &str) -> Result<f64, String> {
    let v = number(s)?;
    if v < 0.0 {
        return Err(format!("must be >= 0, got {v}"));
    }
    Ok(v)
}

/// A finite number in (0, 1] (top-p).
pub fn probability(s: &str) -> Result<f64, String> {
    let v = number(s)?;
    if v <= 0.0 || v > 1.0 {
        return Err(format!("must be in (0, 1], got {v}"));
    }
    Ok(v)
}

/// A finite number in [0, 1) (the validation fraction).
pub fn fraction(s: &str) -> Result<f64, String> {
    let v = number(s)?;
    if !(0.0..1.0).contains(&v) {
        return Err(format!("must be in [0, 1), got {v}"));
    }
    Ok(v)
}

/// A log level or `RUST_LOG`-style directives.
pub fn log_level(s: &str) -> Result<String, String> {
    crate::logging::filter(Some(s)).map(|_| s.to_string())
}

/// `--ladder-layers`' form (`all`, N, i,j,k; an index listed once), checked when the flags are
/// parsed, so a malformed value is a flag error before any work; the range is checked against
/// the model's layers once its config is read ([`ladder_layers`]).
pub fn ladder_layers_form(s: &str) -> Result<String, String> {
    let plain = |e: crate::Error| e.to_string().trim_start_matches("--ladder-layers: ").to_string();
    crate::nn::LadderLayers::parse_flag(s, usize::MAX).map(|_| s.to_string()).map_err(plain)
}

/// `--ladder-layers` for a model of `layers` layers: a value out of range is a flag error (exit
/// code 2), naming the flag.
pub fn ladder_layers(s: &str, layers: usize) -> AnyResult<crate::nn::LadderLayers> {
    crate::nn::LadderLayers::parse_flag(s, layers).map_err(|e| flag_error(e.to_string()))
}

/// A positive integer that fits this machine's `usize`.
pub fn positive(s: &str) -> Result<usize, String> {
    let v: usize = s.trim().parse().map_err(|_| format!("`{s}` is not a positive integer (or is too large)"))?;
    if v == 0 {
        return Err("must be at least 1".into());
    }
    Ok(v)
}

// ---- shared flags -------------------------------------------------------------------------

/// Environment variables every tool reads (help lines: two spaces, name padded to 23).
pub const ENV_COMMON: &str = concat!(
    "  RUST_LOG               log filter when --log-level is not given (`warn`, `ferrolm=debug`)\n",
    "  RAYON_NUM_THREADS      threads of the CPU backend [default: one per core]",
);

/// Environment variables of the tools that pick a device.
pub const ENV_DEVICE: &str = concat!(
    "  FERROLM_CUDA_EMULATOR  `1`: cuda:N is the CPU emulator of the CUDA backend (slow); processes\n",
    "                         started by a launcher then talk through the emulated NCCL\n",
    "  FERROLM_CUDA_POISON    `1`: fill new CUDA allocations with NaN (finds unset reads)\n",
    "  FERROLM_EMU_RACE       SEED: the emulator delays every queued item at random (shows missing waits)\n",
    "  FERROLM_EMU_REPORT     `1`: the emulator prints its host waits per call site at exit\n",
    "  FERROLM_FLASH_WARPS    `4`: flash attention in 64-row blocks of 4 warps [default: 8, 128 rows]\n",
    "  LD_LIBRARY_PATH        where the NVIDIA driver, cuBLAS(Lt), NVRTC and NCCL are found",
);

/// Environment variables of the tools that run as one process per GPU (torchrun, srun, launch).
pub const ENV_LAUNCH: &str = ferrolm_parallel::env::ENV_HELP;

macro_rules! caller_resolve_help {
    () => {
        concat!(
            "  FERROLM_THREADCOMM_CALLER_RESOLVE\n",
            "                         `1`: thread ranks wait for a pending collective input on the launching\n",
            "                         thread, as NCCL does (a collective's result in flight is still chained)",
        )
    };
}

/// Environment variables of the training tools.
pub const ENV_TRAIN: &str = concat!(
    "  FERROLM_PEAK_TFLOPS    the GPU's bf16 dense peak for MFU [default: 989, H100 SXM]\n",
    "  FERROLM_PROFILE        `1` (any value but 0, false, off): as --profile (profile.json in --out)\n",
    caller_resolve_help!()
);

/// `FERROLM_THREADCOMM_CALLER_RESOLVE` (thread ranks: `--dp`/`--tp` in one process, benchmarks).
pub const ENV_CALLER_RESOLVE_HELP: &str = caller_resolve_help!();

/// `Environment:` help section from the given lists.
pub fn env_help(parts: &[&str]) -> String {
    format!("Environment:\n{}", parts.join("\n"))
}

#[derive(Args, Debug, Clone, PartialEq)]
#[command(next_help_heading = "Logging")]
pub struct LogArgs {
    /// Log level or filter (error, warn, info, debug, trace, or RUST_LOG directives)
    /// [default: $RUST_LOG, else info]
    #[arg(long, value_name = "LEVEL", value_parser = log_level)]
    pub log_level: Option<String>,
}

#[derive(Args, Debug, Clone, PartialEq)]
#[command(next_help_heading = "Device")]
pub struct DeviceArgs {
    /// Device: cpu, cuda or cuda:N [default: cuda:0 when a GPU is visible, else cpu]
    #[arg(long, value_name = "DEVICE")]
    pub device: Option<String>,
    /// Compute dtype of weights and activations: f32, or bf16 with fp32 master weights and
    /// optimizer state [default: bf16 on CUDA, f32 on the CPU]
    #[arg(long, value_name = "f32|bf16")]
    pub dtype: Option<ComputeDtype>,
}

/// `--dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ComputeDtype {
    F32,
    Bf16,
}

impl ComputeDtype {
    /// The flag's spelling: "f32" or "bf16".
    pub fn name(self) -> &'static str {
        match self {
            ComputeDtype::F32 => "f32",
            ComputeDtype::Bf16 => "bf16",
        }
    }
    /// Parses the flag's spelling (as in train_config.json).
    pub fn parse(s: &str) -> Option<ComputeDtype> {
        <ComputeDtype as clap::ValueEnum>::from_str(s, false).ok()
    }
    pub fn dtype(self) -> ferrolm_tensor::DType {
        match self {
            ComputeDtype::F32 => ferrolm_tensor::DType::F32,
            ComputeDtype::Bf16 => ferrolm_tensor::DType::BF16,
        }
    }
    /// `flag`, or the device's default: bf16 on CUDA, f32 on the CPU.
    pub fn resolve(flag: Option<ComputeDtype>, device: ferrolm_tensor::Device) -> ferrolm_tensor::DType {
        match (flag, device) {
            (Some(d), _) => d.dtype(),
            (None, ferrolm_tensor::Device::Cpu) => ferrolm_tensor::DType::F32,
            (None, _) => ferrolm_tensor::DType::BF16,
        }
    }
}

/// `--dtype`'s help for the tools that only run a model (eval, generate): they hold no optimizer.
pub fn inference_dtype_help(cmd: Command) -> Command {
    cmd.mut_arg("dtype", |a| {
        a.help("Compute dtype of the weights and activations: f32, or bf16 [default: bf16 on CUDA, f32 on the CPU]").long_help(None::<&str>)
    })
}

impl DeviceArgs {
    /// The compute dtype on `device` (see `--dtype`).
    pub fn dtype(&self, device: ferrolm_tensor::Device) -> ferrolm_tensor::DType {
        ComputeDtype::resolve(self.dtype, device)
    }

    /// The device, its backend started. In a multi-process run (torchrun's `WORLD_SIZE` > 1)
    /// `cuda` (or no flag) means this process's GPU: `cuda:$LOCAL_RANK`, or `cuda:0` when
    /// `CUDA_VISIBLE_DEVICES` shows the process one GPU.
    pub fn pick(&self) -> AnyResult<ferrolm_tensor::Device> {
        let env = ferrolm_parallel::DistEnv::from_env()?.filter(|e| e.world_size > 1);
        let local = env.as_ref().map(|e| e.cuda_device());
        let flag = match (self.device.as_deref(), &local) {
            (None | Some("cuda"), Some(l)) => Some(l.as_str()),
            (f, _) => f,
        };
        crate::pick_device(flag).map_err(|e| match &env {
            // A launcher's processes need a GPU each: say what a CPU run looks like instead.
            Some(env) if flag.is_some_and(|f| f.starts_with("cuda")) => anyhow::anyhow!(
                "{e}; WORLD_SIZE={} is a launcher's (torchrun, srun, launch) multi-process run, one process per GPU \
                 (FERROLM_CUDA_EMULATOR=1 emulates them on the CPU). On a CPU, ranks are threads of one process: run the \
                 tool directly, without a launcher, with --device cpu and --tp/--dp",
                env.world_size
            ),
            _ => e.into(),
        })
    }
}

/// Flags every training tool shares. New groups of shared flags (parallelism: `--tp`, `--dp`,
/// `--zero`, sharding, offload) go in their own `#[derive(Args)]` struct flattened here, with
/// their own help heading; flags of one tool only (`--config`, `--ladder-layers`) go in that
/// tool's struct. A tool changes the default of a shared flag in its `Tool::cli()`.
#[derive(Args, Debug, Clone, PartialEq)]
pub struct TrainArgs {
    /// Training data: a directory prepared by prepare_data, or text and datasets tokenized once
    /// into --cache-dir: a .txt file, a .json (array of records) / .jsonl / .jsonl.gz /
    /// .jsonl.zst / .parquet file, a directory of these (.json files left out), or a quoted glob
    /// [default: data/corpus, the bundled corpus]
    #[arg(long, value_name = "DIR|FILE|GLOB", help_heading = "Data")]
    pub data: Option<PathBuf>,
    /// Where --data given as text or datasets is tokenized, once for each data, tokenizer and
    /// record flags (a relative path is under the working directory, not --out)
    #[arg(long, value_name = "DIR", default_value = crate::shards::DEFAULT_CACHE_DIR, help_heading = "Data")]
    pub cache_dir: PathBuf,
    /// Tokenizer (Hugging Face tokenizer.json) [default: data/tokenizer.json]
    #[arg(long, value_name = "FILE", help_heading = "Data")]
    pub tokenizer: Option<PathBuf>,
    #[command(flatten)]
    pub records: prepare::RecordArgs,

    /// Optimizer steps
    #[arg(long, value_name = "N", default_value = "500", value_parser = positive, help_heading = "Optimization")]
    pub steps: usize,
    /// Sequences per micro-batch
    #[arg(long, value_name = "B", default_value = "16", value_parser = positive, help_heading = "Optimization")]
    pub batch_size: usize,
    /// Tokens per sequence
    #[arg(long, value_name = "T", default_value = "128", value_parser = positive, help_heading = "Optimization")]
    pub seq_len: usize,
    /// Micro-batches per optimizer step
    #[arg(long, value_name = "K", default_value = "1", value_parser = positive, help_heading = "Optimization")]
    pub grad_accum: usize,
    /// Peak learning rate (warmup, then cosine decay to a tenth of it)
    #[arg(long, value_name = "LR", default_value = "2e-3", value_parser = non_negative, allow_hyphen_values = true, help_heading = "Optimization")]
    pub lr: f64,
    /// Steps of linear learning-rate warmup before the cosine decay [default: min(steps / 10 + 1, 25)]
    #[arg(long, value_name = "N", help_heading = "Optimization")]
    pub warmup_steps: Option<usize>,
    /// Seed of the model init and the data order
    #[arg(long, value_name = "S", default_value = "1337", help_heading = "Optimization")]
    pub seed: u64,
    /// Recompute each layer's activations in backward (less memory, ~1/3 more compute)
    #[arg(long, help_heading = "Optimization")]
    pub activation_checkpointing: bool,
    /// Tokens per chunk of the fused LM head + cross-entropy, which never holds the whole
    /// logits (0: the unfused head, which holds the whole logits and their gradient) [default:
    /// the most tokens whose logits fit 256 MiB]
    #[arg(long, value_name = "N", help_heading = "Optimization")]
    pub loss_chunk_tokens: Option<usize>,
    /// Stop after this many steps in a row whose loss or gradient norm is not finite (each is
    /// skipped without an update)
    #[arg(long, value_name = "N", default_value = "5", value_parser = positive, help_heading = "Optimization")]
    pub max_skipped_steps: usize,

    /// Output directory: checkpoints/, metrics.jsonl, loss.png (with --resume: the resumed run's
    /// directory unless given); never one that is or holds an input of the run
    #[arg(long, value_name = "DIR", default_value = "runs/train", help_heading = "Run")]
    pub out: PathBuf,
    /// Whether --out was given on the command line (else a resumed run continues in its own
    /// directory); set by `parse_from`.
    #[arg(skip)]
    pub out_given: bool,
    /// Continue from a checkpoint, a run directory (its newest complete checkpoint) or
    /// RUN/checkpoints/latest; the run continues in that run's directory unless --out is given
    /// [default: start a new run]
    #[arg(long, value_name = "DIR", help_heading = "Run")]
    pub resume: Option<PathBuf>,
    /// Replace the run already in --out (its checkpoints, metrics.jsonl and loss.png are deleted
    /// once every input is loaded; resumed in place, only checkpoints newer than the resumed one);
    /// without it such a directory is refused. An --out that is or holds an input (--model,
    /// --data, …) is refused either way
    #[arg(long, help_heading = "Run")]
    pub overwrite: bool,
    /// Validate every N steps on the first 20 global batches of the validation split, and at the
    /// end on all of it (0: only at the end of the run)
    #[arg(long, value_name = "N", default_value = "100", help_heading = "Run")]
    pub eval_every: usize,
    /// Save a checkpoint every N steps and at the end (0: only at the end)
    #[arg(long, value_name = "N", default_value = "250", help_heading = "Run")]
    pub save_every: usize,
    /// Keep only the newest N checkpoints (0: keep all); the latest is never removed
    #[arg(long, value_name = "N", default_value = "0", help_heading = "Run")]
    pub keep_last: usize,
    /// Time every CUDA kernel launch with CUDA events (as FERROLM_PROFILE=1): at the end of
    /// training print a table by kernel (launches, total ms, share, mean us, largest grid) and
    /// write it as profile.json in --out; on the emulator launches are counted, not timed
    #[arg(long, help_heading = "Run")]
    pub profile: bool,

    #[command(flatten)]
    pub parallel: parallel::ParallelArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub log: LogArgs,
}

impl TrainArgs {
    /// The training options these flags give (schedule details derived from --steps and --lr).
    pub fn options(&self) -> TrainOptions {
        TrainOptions {
            steps: self.steps,
            batch_size: self.batch_size,
            seq_len: self.seq_len,
            grad_accum: self.grad_accum,
            lr: self.lr,
            min_lr: self.lr / 10.0,
            warmup_steps: self.warmup_steps.unwrap_or((self.steps / 10 + 1).min(25)),
            weight_decay: 0.1,
            grad_clip: 1.0,
            eval_every: self.eval_every,
            eval_batches: 20,
            save_every: self.save_every,
            log_every: 25,
            seed: self.seed,
        }
    }

    /// How the head's loss walks the tokens (`--loss-chunk-tokens`).
    pub fn loss_chunks(&self) -> ferrolm_ops::LossChunks {
        ferrolm_ops::LossChunks::from_flag(self.loss_chunk_tokens)
    }

    /// How --data is read and where it is tokenized to (`--text-field`, `--skip-bad-records`,
    /// `--cache-dir`).
    pub fn data_options(&self) -> crate::shards::RecordOptions {
        crate::shards::RecordOptions { cache_dir: self.cache_dir.clone(), ..self.records.options() }
    }

    pub fn safety(&self) -> RunSafety {
        RunSafety { max_skipped_steps: self.max_skipped_steps, keep_last: self.keep_last, overwrite: self.overwrite }
    }

    /// Refuses an `--out` that is or holds one of the run's inputs, before anything is written or
    /// deleted (`run_dir::check_inputs_outside`, a flag error naming both paths): the tool's own
    /// (`extra`: `--model`, `--lora-init`, `--chat-template`, `--val-data`, …), `--data` (the
    /// bundled `default_data` when not given), `--tokenizer`, `--cache-dir` when `token_data` says
    /// the run reads text or datasets tokenized there (not a prepared directory), and `--resume`
    /// unless it is a checkpoint of the run in `--out` itself, which a resumed run continues.
    /// Call after [`TrainArgs::settle_resume`], which settles `--out`.
    pub fn check_inputs_outside_out(&self, default_data: &str, token_data: bool, extra: &[(&str, &std::path::Path)]) -> AnyResult<()> {
        let data = self.data.clone().unwrap_or_else(|| bundled(default_data));
        let mut inputs: Vec<(&str, &std::path::Path)> = extra.to_vec();
        inputs.push(("--data", &data));
        if let Some(t) = &self.tokenizer {
            inputs.push(("--tokenizer", t));
        }
        let prepared = data.join(crate::data::prepare::MANIFEST).is_file();
        if token_data && !prepared {
            inputs.push(("--cache-dir", &self.cache_dir));
        }
        let same_run = |r: &std::path::Path| crate::run_dir::run_dir_of(r).is_some_and(|d| crate::run_dir::same_dir(&d, &self.out));
        if let Some(r) = self.resume.as_deref().filter(|r| !same_run(r)) {
            inputs.push(("--resume", r));
        }
        crate::run_dir::check_inputs_outside(&self.out, &inputs)
    }

    /// Settles `--resume` before a run starts: the checkpoint it names is resolved once (a run
    /// directory's newest complete checkpoint, or the one `checkpoints/latest` names), and the
    /// run continues in that run's directory unless `--out` was given (a log line says where, and
    /// says so when `--out` names another directory). Returns false, having said so on stdout,
    /// when the checkpoint is already at `--steps`: nothing is left to train.
    pub fn settle_resume(&mut self) -> AnyResult<bool> {
        use anyhow::Context;
        let Some(given) = self.resume.clone() else { return Ok(true) };
        let dir = crate::run_dir::resolve_checkpoint(&given).with_context(|| format!("--resume {}", given.display()))?;
        let step = crate::checkpoint::checkpoint_step(&dir).with_context(|| format!("--resume {}", given.display()))?;
        if dir != given {
            tracing::info!("--resume {}: using the checkpoint {}", given.display(), dir.display());
        }
        match crate::run_dir::run_dir_of(&dir) {
            Some(run) if !self.out_given => {
                tracing::info!("continuing the run in {} (--out picks another directory)", run.display());
                self.out = run;
            }
            Some(run) if !crate::run_dir::same_dir(&run, &self.out) => tracing::info!(
                "the resumed checkpoint belongs to the run in {}; this run writes to --out {} instead",
                run.display(),
                self.out.display()
            ),
            Some(_) => {}
            None => tracing::info!(
                "{} is not inside a run directory (RUN/checkpoints/step-N): this run writes to --out {}",
                dir.display(),
                self.out.display()
            ),
        }
        self.resume = Some(dir.clone());
        if step >= self.steps {
            crate::progress::report(&format!(
                "nothing left to train: {} is at step {step} and --steps is {}; give a larger --steps to train further",
                dir.display(),
                self.steps
            ));
            return Ok(false);
        }
        Ok(true)
    }
}

/// `bench_cuda`'s flags (the tool itself is `examples/bench_cuda.rs`).
#[derive(Parser, Debug, Clone, PartialEq)]
#[command(
    allow_negative_numbers = true,
    name = "bench_cuda",
    about = "Benchmark every CUDA kernel: median GPU time per kernel against its memory-bandwidth or GEMM-peak floor",
    long_about = None,
    after_help = env_help(&[
        ENV_COMMON,
        "  FERROLM_REQUIRE_GPU    `1`: no CUDA device is an error (exit 1), not a skip",
        "  OUT                    also write $OUT/bench_cuda.md and $OUT/bench_cuda.json",
        "  LD_LIBRARY_PATH        where the NVIDIA driver, cuBLAS(Lt) and NVRTC are found",
    ])
)]
pub struct BenchCudaArgs {
    /// Timed repetitions per kernel (at least 10; the median is reported)
    #[arg(long, default_value = "20", value_parser = clap::value_parser!(u32).range(10..))]
    pub reps: u32,
    /// Fewer and smaller shapes (a quick check, not a benchmark)
    #[arg(long)]
    pub quick: bool,
    /// Only attention (bf16, causal), at this shape: batch, query heads, kv heads, sequence, head
    /// dim, e.g. 4,16,16,2048,128; repeat for more shapes. The floors are still measured first
    /// [default: every kernel, and attention at its eight shapes]
    #[arg(long, value_name = "B,HQ,HKV,T,D", value_parser = attention_shape)]
    pub attention: Vec<AttentionShape>,
    /// Only attention, at its eight shapes (the floors are still measured first)
    #[arg(long, conflicts_with = "attention")]
    pub attention_only: bool,
    #[command(flatten)]
    pub log: LogArgs,
}

/// An attention shape of `bench_cuda --attention`: (batch, query heads, kv heads, sequence, head dim).
pub type AttentionShape = (usize, usize, usize, usize, usize);

/// `B,HQ,HKV,T,D`: five positive integers, the query heads a multiple of the kv heads.
pub fn attention_shape(s: &str) -> Result<AttentionShape, String> {
    let v = s.split(',').map(positive).collect::<Result<Vec<_>, _>>().map_err(|e| format!("`{s}`: {e} (want B,HQ,HKV,T,D)"))?;
    let [b, hq, hkv, t, d] = v[..] else {
        return Err(format!("`{s}`: want five numbers B,HQ,HKV,T,D (batch, query heads, kv heads, sequence, head dim)"));
    };
    if hq % hkv != 0 {
        return Err(format!("`{s}`: {hq} query heads are not a multiple of {hkv} kv heads"));
    }
    Ok((b, hq, hkv, t, d))
}

impl Tool for BenchCudaArgs {
    fn log_args(&self) -> &LogArgs {
        &self.log
    }
}

/// A bundled file: relative to the working directory, else beside the binary's folder (the
/// GPU staging layout), else in the source tree this library was built from.
pub fn bundled(rel: &str) -> PathBuf {
    let exe_dir = std::env::current_exe().ok().and_then(|p| p.parent().and_then(|d| d.parent()).map(std::path::Path::to_path_buf));
    let cands = [Some(PathBuf::from(rel)), exe_dir.map(|d| d.join(rel)), Some(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(rel))];
    cands.iter().flatten().find(|p| p.exists()).cloned().unwrap_or_else(|| PathBuf::from(rel))
}

/// The line a training tool reports once it has loaded `model` from `path`: its family and
/// `model_type`, size, layers, device and dtype, and whether it is a Ladder model.
pub(crate) fn report_loaded(path: &std::path::Path, model: &crate::Llama, device: crate::Device, dtype: crate::DType) {
    let c = model.config();
    let kind = match &c.ladder_layers {
        Some(l) => format!(" (Ladder Transformer: {l} layers)"),
        None => String::new(),
    };
    crate::progress::report(&format!(
        "loaded {}: a {} model ({}), {} parameters, {} layers, on {device} in {dtype}{kind}",
        path.display(),
        c.family,
        c.family.model_type(),
        model.num_params(),
        c.num_hidden_layers,
    ));
}
