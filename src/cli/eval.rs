//! `eval`: mean next-token cross-entropy of a checkpoint on a text file, or over the trained
//! tokens of a chat file's conversations (`--chat`), each scored alone as fine-tuning validates;
//! or the preference loss and TRL's reward metrics of a preference file (`--preference`).
use super::{env_help, flag_error, positive, LogArgs, ModelRunArgs, Tool, ENV_COMMON, ENV_DEVICE, ENV_LAUNCH};
use crate::data::chat::{DataFormat, TrainOn};
use crate::data::preference::PreferenceFormat;
use crate::data::Tokenizer;
use crate::eval::Score;
use crate::progress::report;
use crate::{AnyResult, Device, Llama};
use anyhow::{bail, Context};
use clap::Parser;
use std::path::{Path, PathBuf};

#[derive(Parser, Debug, Clone, PartialEq)]
#[command(
    allow_negative_numbers = true,
    name = "eval",
    about = "Mean next-token loss and perplexity of a checkpoint on a text file, or on a chat file. The text is \
             tokenized with the checkpoint's tokenizer.json (no special tokens) and scored on every full window \
             tokens[i*T .. i*T+T+1]. A chat file's conversations are rendered with the checkpoint's chat template and \
             each scored alone over the tokens fine-tuning trains (the assistant's, by default). The last line printed \
             is `loss <float> ppl <float> tokens <int>` (tokens: the tokens scored); with --chat it goes on \
             `conversations <int> dropped <int> cut <int> skipped <int>` (scored; longer than --seq-len; scored over \
             their first --seq-len tokens with --truncate; bad or with no trained token). A preference file \
             (--preference) is scored as DPO scores it against a reference (--ref-model; else with --lora the base with the \
             adapters off; else the model itself, every reward 0): the last line is \
             `dpo_loss <float> accuracy <float> margin <float> pairs <int>` (the mean loss over the pairs, TRL's \
             rewards/accuracies and rewards/margins), after the other metrics under TRL's names.",
    after_help = env_help(&[ENV_COMMON, ENV_DEVICE, ENV_LAUNCH])
)]
pub struct EvalArgs {
    /// The model: a checkpoint directory (config.json, model.safetensors, tokenizer.json), a run
    /// directory (its newest complete checkpoint) or RUN/checkpoints/latest
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Text file to score [default: none; --text, --chat or --preference is required]
    #[arg(long, value_name = "FILE", required_unless_present_any = ["chat", "preference"], conflicts_with_all = ["chat", "preference"])]
    pub text: Option<PathBuf>,
    /// Chat records to score (.jsonl, .jsonl.gz, .jsonl.zst or .parquet, or a .json array of
    /// them: a file, a directory of them (its .json files left out), or a quoted glob), each
    /// conversation alone over its trained tokens [default: none]
    #[arg(long, value_name = "FILE|DIR|GLOB", help_heading = "Chat", conflicts_with = "preference")]
    pub chat: Option<PathBuf>,
    /// Preference pairs to score (TRL's standard, conversational or implicit-prompt records;
    /// files as --chat): the DPO loss and TRL's reward metrics against the reference
    /// [default: none]
    #[arg(long, value_name = "FILE|DIR|GLOB", help_heading = "Preference")]
    pub preference: Option<PathBuf>,
    /// With --preference: the reference model, a checkpoint or run directory as --model
    /// [default: with --lora, the base with the adapters off; else --model itself, every reward 0]
    #[arg(long, value_name = "DIR", help_heading = "Preference", requires = "preference",
          conflicts_with_all = ["text", "chat"])]
    pub ref_model: Option<PathBuf>,
    /// With --preference: β, the strength of the reference's pull (TRL's beta)
    #[arg(long, value_name = "BETA", default_value = "0.1", help_heading = "Preference", requires = "preference",
          conflicts_with_all = ["text", "chat"])]
    pub beta: f64,
    /// With --preference: the loss, or a comma list of losses (sigmoid, hinge, ipo,
    /// sigmoid_norm, sft), as TRL's loss_type
    #[arg(long, value_name = "TYPE[,TYPE...]", default_value = "sigmoid", help_heading = "Preference", requires = "preference",
          conflicts_with_all = ["text", "chat"])]
    pub loss_type: String,
    /// With --preference: one weight per --loss-type, comma-separated, as TRL's loss_weights
    /// [default: 1 each]
    #[arg(long, value_name = "W[,W...]", help_heading = "Preference", requires = "preference",
          conflicts_with_all = ["text", "chat"])]
    pub loss_weights: Option<String>,
    /// With --preference: the most ids of prompt + completion; a longer completion loses its
    /// end, a pair whose prompt fills it is skipped (both counted) [default: the model's
    /// max_position_embeddings]
    #[arg(long, value_name = "N", value_parser = positive, help_heading = "Preference", requires = "preference",
          conflicts_with_all = ["text", "chat"])]
    pub max_length: Option<usize>,
    /// With --preference: the most ids of a prompt, its start cut (counted) [default: none]
    #[arg(long, value_name = "N", value_parser = positive, help_heading = "Preference", requires = "preference",
          conflicts_with_all = ["text", "chat"])]
    pub max_prompt_length: Option<usize>,
    /// Tokens per window (T); with --chat, the longest conversation scored (longer ones are
    /// dropped and counted) [default: required with --text; with --chat the model's
    /// max_position_embeddings]
    #[arg(long, value_name = "T", value_parser = positive, required_unless_present_any = ["chat", "preference"], conflicts_with = "preference")]
    pub seq_len: Option<usize>,
    /// Windows (with --chat: conversations; with --preference: pairs) per forward pass
    #[arg(long, default_value = "8", value_parser = positive)]
    pub batch_size: usize,
    /// With --chat or --preference: the chat template, a Jinja file [default: --lora's adapter's template
    /// (chat_template.jinja, else the chat_template of its tokenizer_config.json), else
    /// --model's, found the same way]
    #[arg(long, value_name = "FILE", help_heading = "Chat")]
    pub chat_template: Option<PathBuf>,
    /// With --chat: the tokens scored, as fine-tuning's --train-on: assistant, last or all
    #[arg(long, value_name = "assistant|last|all", default_value = "assistant", help_heading = "Chat",
          value_parser = |s: &str| s.parse::<TrainOn>())]
    pub train_on: TrainOn,
    /// The record form: with --chat auto, messages, sharegpt, alpaca, prompt-completion or text;
    /// with --preference auto, standard, conversational or implicit-prompt
    #[arg(long, value_name = "FORMAT", default_value = "auto", help_heading = "Chat", value_parser = data_format)]
    pub data_format: String,
    /// With --chat: score a conversation longer than --seq-len over its first --seq-len tokens
    /// instead of dropping it [default: dropped, and counted]
    #[arg(long, help_heading = "Chat", requires = "chat", conflicts_with = "text")]
    pub truncate: bool,
    /// With --chat: print the first N conversations of the file as scored (rendered, the scored
    /// tokens marked, their counts, whether --seq-len drops or cuts them) and exit without
    /// loading the model's weights [default: none]
    #[arg(long, value_name = "N", value_parser = positive, help_heading = "Chat", requires = "chat", conflicts_with = "text")]
    pub show_example: Option<usize>,
    #[command(flatten)]
    pub run: ModelRunArgs,
}

impl Tool for EvalArgs {
    fn cli() -> clap::Command {
        super::inference_dtype_help(<Self as clap::CommandFactory>::command())
    }
    fn log_args(&self) -> &LogArgs {
        &self.run.log
    }
}

pub fn run(a: EvalArgs) -> AnyResult<()> {
    if a.preference.is_some() {
        return evaluate_preference(a).map(drop);
    }
    evaluate(a).map(drop)
}

/// `--data-format`: a chat record form or a preference one (which applies is checked against
/// --chat / --preference once the flags are read).
fn data_format(s: &str) -> Result<String, String> {
    if s.parse::<DataFormat>().is_ok() || s.parse::<PreferenceFormat>().is_ok() {
        return Ok(s.to_string());
    }
    Err(format!(
        "unknown record form `{s}`: with --chat one of auto, messages, sharegpt, alpaca, prompt-completion, text; with --preference \
         one of {}",
        PreferenceFormat::NAMES.join(", ")
    ))
}

/// [`run`], returning the score it printed. With `--show-example` it prints the examples and
/// scores nothing (`tokens` 0, `loss` NaN).
pub fn evaluate(mut a: EvalArgs) -> AnyResult<Score> {
    if a.preference.is_some() {
        bail!("--preference is scored by `evaluate_preference`");
    }
    a.model = super::model_dir("--model", &a.model)?;
    if a.chat.is_none() && a.chat_template.is_some() {
        bail!("--chat-template applies to --chat FILE");
    }
    if let Some(t) = a.seq_len {
        // Before the weights and the data: a flag error, as the training tools'.
        let cfg_path = a.model.join("config.json");
        super::pretrain::check_seq_len(t, &crate::nn::LlamaConfig::from_file(&cfg_path)?, &cfg_path.display().to_string())?;
    }
    if a.show_example.is_some() {
        report(show_examples(&a)?.trim_end());
        return Ok(Score { loss: f64::NAN, tokens: 0, chat: None });
    }
    let out = std::sync::Mutex::new(None);
    a.run.with_model(&a.model, |model, tokenizer, device| {
        let s = match (&a.chat, &a.text) {
            (Some(chat), _) => score_chat(&a, chat, model, tokenizer, device)?,
            (None, Some(text)) => {
                let t = std::fs::read_to_string(text).with_context(|| format!("cannot read the text file {}", text.display()))?;
                // A UTF-8 byte order mark is not text (prepare_data skips it too).
                let ids = tokenizer.encode(t.strip_prefix('\u{feff}').unwrap_or(&t), false)?;
                score(&a, text, model, tokenizer, &ids, device)?
            }
            (None, None) => bail!("give --text FILE or --chat FILE"),
        };
        report(&s.line());
        *out.lock().unwrap_or_else(|e| e.into_inner()) = Some(s);
        Ok(())
    })?;
    out.into_inner().unwrap_or_else(|e| e.into_inner()).context("no rank scored")
}

/// The chat options of `a` (`--chat`).
fn chat_options(a: &EvalArgs) -> AnyResult<crate::chat::ChatOptions> {
    let format = a.data_format.parse::<DataFormat>().map_err(|_| {
        flag_error(format!("--data-format {} is a preference record form: with --chat give one of auto, messages, sharegpt, alpaca, prompt-completion, text", a.data_format))
    })?;
    Ok(crate::chat::ChatOptions {
        format,
        chat_template: a.chat_template.clone(),
        train_on: a.train_on,
        pack: false,
        truncate: a.truncate,
        val_data: None,
        val_fraction: 0.0,
        skip_bad_records: false,
    })
}

/// The longest conversation `--chat` scores: --seq-len, at most (and by default) the model's
/// max_position_embeddings `max`.
fn chat_seq_len(a: &EvalArgs, max: usize) -> AnyResult<usize> {
    let t = a.seq_len.unwrap_or(max);
    if t > max {
        bail!("--seq-len {t} exceeds the model's max_position_embeddings {max}");
    }
    Ok(t)
}

/// `--show-example N`: the first N conversations of `--chat` as they would be scored
/// (`crate::chat::show_examples`), marked for stdout; reads the tokenizer, the template and
/// config.json, never the weights.
pub fn show_examples(a: &EvalArgs) -> AnyResult<String> {
    let (Some(chat), Some(n)) = (&a.chat, a.show_example) else { bail!("--show-example applies to --chat FILE") };
    let cfg = crate::nn::LlamaConfig::from_file(a.model.join("config.json"))?;
    let t = chat_seq_len(a, cfg.max_position_embeddings)?;
    let tokenizer = super::model_dir_tokenizer(&a.model)?;
    let dirs = a.run.template_dirs(&a.model)?;
    let dirs: Vec<&Path> = dirs.iter().map(PathBuf::as_path).collect();
    crate::chat::show_examples(chat, &dirs, &tokenizer, &chat_options(a)?, t, n, crate::chat::Marks::for_stdout())
}

/// `--chat`: the conversations one a row, each scored alone over its trained tokens
/// (`crate::eval::conversations_loss`, as fine-tuning's validation), with what became of each
/// conversation read.
fn score_chat(a: &EvalArgs, chat: &Path, model: &Llama, tokenizer: &Tokenizer, device: Device) -> AnyResult<Score> {
    check_vocab(a, model, tokenizer)?;
    let t = chat_seq_len(a, model.config().max_position_embeddings)?;
    let dirs = a.run.template_dirs(&a.model)?;
    let dirs: Vec<&Path> = dirs.iter().map(PathBuf::as_path).collect();
    let (rows, counts) = crate::chat::load_unpacked(chat, &dirs, tokenizer, &chat_options(a)?, t)?;
    let s = crate::eval::conversations_loss(model, &rows, a.batch_size, 0, device)?;
    Ok(Score { chat: Some(counts), ..s })
}

fn check_vocab(a: &EvalArgs, model: &Llama, tokenizer: &Tokenizer) -> AnyResult<()> {
    if tokenizer.vocab_size() > model.config().vocab_size {
        bail!(
            "{}: the tokenizer has {} tokens but the model's vocab_size is {}",
            a.model.join("tokenizer.json").display(),
            tokenizer.vocab_size(),
            model.config().vocab_size
        );
    }
    Ok(())
}

/// Checks the flags against the model and the text, and scores it (`crate::eval::mean_loss`).
fn score(a: &EvalArgs, text: &Path, model: &Llama, tokenizer: &Tokenizer, ids: &[u32], device: Device) -> AnyResult<Score> {
    let bs = a.batch_size;
    let t = a.seq_len.context("--seq-len is required with --text")?;
    check_vocab(a, model, tokenizer)?;
    if t > model.config().max_position_embeddings {
        bail!("--seq-len {t} exceeds the model's max_position_embeddings {}", model.config().max_position_embeddings);
    }
    let windows = crate::eval::windows(ids.len(), t);
    if windows == 0 {
        bail!("{}: {} tokens do not fill one window of {} tokens (--seq-len {t} + 1)", text.display(), ids.len(), t + 1);
    }
    let Some(need) = bs.min(windows).checked_mul(t).and_then(|n| n.checked_mul(8)) else {
        bail!("--batch-size {bs} × --seq-len {t} overflows");
    };
    if let Some(avail) = crate::planner::memory::available_host_bytes() {
        if need as u64 > avail {
            bail!("--batch-size {bs} × --seq-len {t} needs {need} bytes for one batch, {avail} are available: lower --batch-size");
        }
    }
    crate::eval::mean_loss(model, ids, t, bs, device)
}

/// `--preference`: scores the pairs of a preference file as DPO does (`crate::eval::preference_score`)
/// against the reference (`--ref-model`; else with `--lora` the base, adapters off; else the
/// model itself), printing the data's summary, the metrics under TRL's names and last
/// `dpo_loss X accuracy Y margin Z pairs N`. Flags that do not apply are refused by name (exit 2).
pub fn evaluate_preference(mut a: EvalArgs) -> AnyResult<crate::eval::PreferenceScore> {
    use crate::nn::objective::preference::PreferenceConfig;
    let Some(file) = a.preference.clone() else { bail!("give --preference FILE") };
    for (given, flag) in
        [(a.truncate, "--truncate"), (a.show_example.is_some(), "--show-example"), (a.train_on != TrainOn::default(), "--train-on")]
    {
        if given {
            return Err(flag_error(format!("{flag} applies to --chat FILE, not to --preference")));
        }
    }
    let format = a.data_format.parse::<PreferenceFormat>().map_err(|_| {
        flag_error(format!(
            "--data-format {} is a chat record form: with --preference give one of {}",
            a.data_format,
            PreferenceFormat::NAMES.join(", ")
        ))
    })?;
    let cfg = PreferenceConfig::parse(a.beta, &a.loss_type, a.loss_weights.as_deref()).map_err(|e| flag_error(e.to_string()))?;
    a.model = super::model_dir("--model", &a.model)?;
    let model_cfg = crate::nn::LlamaConfig::from_file(a.model.join("config.json"))?;
    let max = model_cfg.max_position_embeddings;
    if let Some(n) = a.max_length.filter(|&n| n > max) {
        return Err(flag_error(format!("--max-length {n} exceeds the model's max_position_embeddings {max}")));
    }
    let ref_dir = a.ref_model.as_deref().map(|p| super::model_dir("--ref-model", p)).transpose()?;
    if let Some(r) = &ref_dir {
        let rc = crate::nn::LlamaConfig::from_file(r.join("config.json"))?;
        if rc.vocab_size != model_cfg.vocab_size {
            return Err(flag_error(format!(
                "--ref-model {}: its vocab_size {} differs from --model's {}: the reference scores the same token ids and needs the same \
                 vocabulary",
                r.display(),
                rc.vocab_size,
                model_cfg.vocab_size
            )));
        }
    }
    let adapter = a.run.lora.as_deref().map(|p| super::adapter_dir("--lora", p)).transpose()?;
    if let Some(ad) = &adapter {
        super::lora::warn_other_base(ad, &a.model)?;
    }
    let tokenizer = super::model_dir_tokenizer(&a.model)?;
    if tokenizer.vocab_size() > model_cfg.vocab_size {
        bail!(
            "{}: the tokenizer has {} tokens but the model's vocab_size is {}",
            a.model.join("tokenizer.json").display(),
            tokenizer.vocab_size(),
            model_cfg.vocab_size
        );
    }
    let pairs = load_preference(&a, &file, &tokenizer, format, a.max_length.unwrap_or(max))?;
    let reference = match (&ref_dir, &adapter) {
        (Some(r), _) => format!("--ref-model {}", r.display()),
        (None, Some(_)) => "the base of --lora, its adapters off".into(),
        (None, None) => {
            tracing::warn!(
                "no --ref-model or --lora: the reference is --model itself, so every reward is 0 (rewards/accuracies 0, \
                 rewards/margins 0); give --ref-model DIR (the model before preference tuning) to score against it"
            );
            "--model itself".into()
        }
    };
    report(&format!("reference: {reference}"));
    let device = a.run.device.pick()?;
    let dtype = a.run.device.dtype(device);
    let layout = a.run.parallel.layout()?;
    layout.check_model(&model_cfg)?;
    // --quantize-base holds the policy's (and a --ref-model's) linear weights 4-bit, as the
    // QLoRA run that trained the adapter held its base.
    let quant = a.run.quantize_base;
    super::lora::check_quant_layout(quant, &a.model, &layout)?;
    if let Some(r) = &ref_dir {
        super::lora::check_quant_layout(quant, r, &layout)?;
    }
    let (dir, bs) = (&a.model, a.batch_size);
    let score = crate::parallel::launch(
        &layout,
        device,
        || Ok(()),
        |_, comm| {
            let model = crate::parallel::load_for_inference(dir, adapter.as_deref(), quant, dtype, device, comm.clone(), &layout)?;
            let ref_model = ref_dir
                .as_deref()
                .map(|r| crate::parallel::load_for_inference(r, None, quant, dtype, device, comm, &layout))
                .transpose()?;
            let which = match (&ref_model, &adapter) {
                (Some(m), _) => crate::eval::PreferenceReference::Model(m),
                (None, Some(_)) => crate::eval::PreferenceReference::AdaptersOff,
                (None, None) => crate::eval::PreferenceReference::Itself,
            };
            crate::eval::preference_score(&model, which, &pairs, &cfg, bs)
        },
    )?;
    for l in score.metric_lines() {
        report(&l);
    }
    report(&score.line());
    Ok(score)
}

/// Reads and tokenizes the pairs of `file` (`ferrolm_data::preference`), with the chat template
/// when one is found (needed by conversational records only), and reports the data's summary.
fn load_preference(
    a: &EvalArgs,
    file: &Path,
    tokenizer: &Tokenizer,
    format: PreferenceFormat,
    max_length: usize,
) -> AnyResult<Vec<crate::data::preference::PreferencePair>> {
    use crate::data::preference::{load_preference_pairs, PreferenceOptions};
    let dirs = a.run.template_dirs(&a.model)?;
    let dirs: Vec<&Path> = dirs.iter().map(PathBuf::as_path).collect();
    // A given --chat-template must load; without one a model may have none (text pairs need none).
    let template = match crate::chat::template_in(&dirs, a.chat_template.as_deref(), tokenizer) {
        Ok((t, source)) => {
            report(&format!("chat template: {}", source.origin));
            Some(t)
        }
        Err(e) if a.chat_template.is_some() => return Err(e),
        Err(_) => None,
    };
    let opts = PreferenceOptions {
        format,
        max_length: Some(max_length),
        max_prompt_length: a.max_prompt_length,
        ..PreferenceOptions::new(tokenizer, template.as_ref())
    };
    let inputs = crate::data::resolve_inputs(file).with_context(|| format!("cannot read the preference data {}", file.display()))?;
    let bar = crate::progress::Progress::bytes(inputs.iter().map(|f| f.bytes).sum(), "data");
    let (pairs, stats) = load_preference_pairs(&inputs, &opts, &mut |done, _, n| {
        bar.set_position(done);
        bar.set_message(format!("{n} pairs"));
    })
    .with_context(|| format!("cannot read the preference data {}", file.display()))?;
    drop(bar);
    report(&format!("data {}: {}", file.display(), stats.summary()));
    for m in &stats.skip_messages {
        report(&format!("  skipped: {m}"));
    }
    Ok(pairs)
}
