//! `eval`: mean next-token cross-entropy of a checkpoint on a text file, or over the trained
//! tokens of a chat file's conversations (`--chat`), each scored alone as fine-tuning validates.
use super::{env_help, positive, LogArgs, ModelRunArgs, Tool, ENV_COMMON, ENV_DEVICE, ENV_LAUNCH};
use crate::data::chat::{DataFormat, TrainOn};
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
             their first --seq-len tokens with --truncate; bad or with no trained token).",
    after_help = env_help(&[ENV_COMMON, ENV_DEVICE, ENV_LAUNCH])
)]
pub struct EvalArgs {
    /// The model: a checkpoint directory (config.json, model.safetensors, tokenizer.json), a run
    /// directory (its newest complete checkpoint) or RUN/checkpoints/latest
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Text file to score [default: none; --text or --chat is required]
    #[arg(long, value_name = "FILE", required_unless_present = "chat", conflicts_with = "chat")]
    pub text: Option<PathBuf>,
    /// Chat records to score (.jsonl, .jsonl.gz, .jsonl.zst or .parquet, or a .json array of
    /// them: a file, a directory of them (its .json files left out), or a quoted glob), each
    /// conversation alone over its trained tokens [default: none]
    #[arg(long, value_name = "FILE|DIR|GLOB", help_heading = "Chat")]
    pub chat: Option<PathBuf>,
    /// Tokens per window (T); with --chat, the longest conversation scored (longer ones are
    /// dropped and counted) [default: required with --text; with --chat the model's
    /// max_position_embeddings]
    #[arg(long, value_name = "T", value_parser = positive, required_unless_present = "chat")]
    pub seq_len: Option<usize>,
    /// Windows (with --chat: conversations) per forward pass
    #[arg(long, default_value = "8", value_parser = positive)]
    pub batch_size: usize,
    /// With --chat: the chat template, a Jinja file [default: --lora's adapter's template
    /// (chat_template.jinja, else the chat_template of its tokenizer_config.json), else
    /// --model's, found the same way]
    #[arg(long, value_name = "FILE", help_heading = "Chat")]
    pub chat_template: Option<PathBuf>,
    /// With --chat: the tokens scored, as fine-tuning's --train-on: assistant, last or all
    #[arg(long, value_name = "assistant|last|all", default_value = "assistant", help_heading = "Chat",
          value_parser = |s: &str| s.parse::<TrainOn>())]
    pub train_on: TrainOn,
    /// With --chat: the record form (auto, messages, sharegpt, alpaca, prompt-completion, text)
    #[arg(long, value_name = "FORMAT", default_value = "auto", help_heading = "Chat",
          value_parser = |s: &str| s.parse::<DataFormat>())]
    pub data_format: DataFormat,
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
    evaluate(a).map(drop)
}

/// [`run`], returning the score it printed. With `--show-example` it prints the examples and
/// scores nothing (`tokens` 0, `loss` NaN).
pub fn evaluate(mut a: EvalArgs) -> AnyResult<Score> {
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
fn chat_options(a: &EvalArgs) -> crate::chat::ChatOptions {
    crate::chat::ChatOptions {
        format: a.data_format,
        chat_template: a.chat_template.clone(),
        train_on: a.train_on,
        pack: false,
        truncate: a.truncate,
        val_data: None,
        val_fraction: 0.0,
        skip_bad_records: false,
    }
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
    crate::chat::show_examples(chat, &dirs, &tokenizer, &chat_options(a), t, n, crate::chat::Marks::for_stdout())
}

/// `--chat`: the conversations one a row, each scored alone over its trained tokens
/// (`crate::eval::conversations_loss`, as fine-tuning's validation), with what became of each
/// conversation read.
fn score_chat(a: &EvalArgs, chat: &Path, model: &Llama, tokenizer: &Tokenizer, device: Device) -> AnyResult<Score> {
    check_vocab(a, model, tokenizer)?;
    let t = chat_seq_len(a, model.config().max_position_embeddings)?;
    let dirs = a.run.template_dirs(&a.model)?;
    let dirs: Vec<&Path> = dirs.iter().map(PathBuf::as_path).collect();
    let (rows, counts) = crate::chat::load_unpacked(chat, &dirs, tokenizer, &chat_options(a), t)?;
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
