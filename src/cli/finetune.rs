//! `finetune`: supervised fine-tuning of a Llama (or Ladder) checkpoint on conversations, with
//! every training, parallel and offload flag of `pretrain_llama`. The chat-data flags
//! ([`ChatArgs`]) and the data preparation ([`prepare_data`]) are shared with
//! `finetune_ladder`; flags of one tool only go in its own struct. Both take the LoRA flags
//! ([`super::lora::LoraArgs`]).
use super::pretrain::preflight;
use super::tune::{Defaults, Layout};
use super::{env_help, fraction, LogArgs, Tool, TrainArgs, TrainData, ENV_COMMON, ENV_DEVICE, ENV_LAUNCH, ENV_TRAIN};
use crate::chat::{ChatData, ChatOptions};
use crate::data::chat::{DataFormat, TrainOn};
use crate::data::Tokenizer;
use crate::nn::Sampling;
use crate::parallel::Comm;
use crate::progress::report;
use crate::train::{check_validation_data, TrainSet, Trainer};
use crate::AnyResult;
use anyhow::Context;
use clap::{Args, Command, Parser};
use std::path::{Path, PathBuf};

/// The chat-data flags of the fine-tuning tools.
#[derive(Args, Debug, Clone, PartialEq)]
#[command(next_help_heading = "Chat data")]
pub struct ChatArgs {
    /// The record form of --data: auto (detected per record), messages, sharegpt, alpaca,
    /// prompt-completion, or text (plain text, every token trained, in windows as pretraining)
    #[arg(long, value_name = "FORMAT", default_value = "auto", value_parser = |s: &str| s.parse::<DataFormat>())]
    pub data_format: DataFormat,
    /// The chat template, a Jinja file [default: chat_template.jinja in --model, else the
    /// chat_template of its tokenizer_config.json]
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// The tokens the loss trains: assistant (every assistant message), last (the last one
    /// only) or all (every token)
    #[arg(long, value_name = "assistant|last|all", default_value = "assistant", value_parser = |s: &str| s.parse::<TrainOn>())]
    pub train_on: TrainOn,
    /// Pack conversations into --seq-len rows by best-fit decreasing, attention kept inside each
    /// (the default)
    #[arg(long, conflicts_with = "no_pack")]
    pub pack: bool,
    /// One conversation a row, padded (padding is never trained)
    #[arg(long)]
    pub no_pack: bool,
    /// Keep the first --seq-len tokens of a longer conversation instead of dropping it
    #[arg(long)]
    pub truncate: bool,
    /// Validation conversations, scored each alone over its trained tokens [default: the
    /// --val-fraction of --data]
    #[arg(long, value_name = "FILE|DIR|GLOB")]
    pub val_data: Option<PathBuf>,
    /// The fraction of --data's conversations held out for validation (0: none)
    #[arg(long, value_name = "F", default_value = "0.02", value_parser = fraction)]
    pub val_fraction: f64,
    /// Print the first N conversations of --data as trained (rendered, the trained tokens
    /// marked, their counts, whether --seq-len drops or cuts them) and exit, before loading the
    /// model's weights or touching --out [default: none]
    #[arg(long, value_name = "N", value_parser = super::positive)]
    pub show_example: Option<usize>,
}

impl ChatArgs {
    /// The flags as the library takes them.
    pub fn options(&self, skip_bad_records: bool) -> ChatOptions {
        ChatOptions {
            format: self.data_format,
            chat_template: self.chat_template.clone(),
            train_on: self.train_on,
            pack: !self.no_pack,
            truncate: self.truncate,
            val_data: self.val_data.clone(),
            val_fraction: self.val_fraction,
            skip_bad_records,
        }
    }
}

/// What the fine-tuning tools' checkpoints keep of the source model (`checkpoint::SourceModel`).
#[derive(Args, Debug, Clone, PartialEq)]
#[command(next_help_heading = "Run")]
pub struct SaveArgs {
    /// The dtype of the weights in checkpoints' model.safetensors and OUT/merged: f32, bf16
    /// (each weight rounded once, to nearest even), or source (as --model's weights are
    /// stored). The state --resume reads stays f32, so a resume is exact
    #[arg(long, value_name = "f32|bf16|source", default_value = "source", value_enum)]
    pub save_dtype: crate::checkpoint::SaveDtype,
}

impl SaveArgs {
    /// What checkpoints keep of the model directory `model`: its config keys and dtype, and its
    /// tokenizer files unless `--tokenizer` names another tokenizer than its own (then ferrolm's
    /// are written). `template` is the chat template the run trains with, written where the
    /// source keeps its own when it differs from it.
    pub(crate) fn source(
        &self,
        model: &Path,
        tokenizer: Option<&Path>,
        template: Option<&str>,
    ) -> AnyResult<std::sync::Arc<crate::checkpoint::SourceModel>> {
        let own = model.join("tokenizer.json");
        let same = |t: &Path| t == own || t.canonicalize().ok().zip(own.canonicalize().ok()).is_some_and(|(a, b)| a == b);
        let files = match tokenizer {
            Some(t) if !same(t) => None,
            _ => crate::tokenizer_files::SourceTokenizer::read(model, template)?,
        };
        Ok(std::sync::Arc::new(crate::checkpoint::SourceModel::read(model, self.save_dtype)?.with_tokenizer(files)))
    }
}

#[derive(Parser, Debug, Clone, PartialEq)]
#[command(
    allow_negative_numbers = true,
    name = "finetune",
    about = "Fine-tune a Llama or Ladder checkpoint on conversations (supervised fine-tuning): chat records rendered \
             with the model's chat template, the loss on the assistant's tokens, conversations packed into rows with \
             attention kept inside each. Reports the validation loss and a reply to a held-out prompt before and \
             after; writes Hugging Face checkpoints under OUT/checkpoints/.",
    after_help = env_help(&[ENV_COMMON, ENV_DEVICE, ENV_TRAIN, ENV_LAUNCH])
)]
pub struct FinetuneArgs {
    /// The checkpoint to fine-tune: a model directory (config.json, model.safetensors,
    /// tokenizer.json), a run directory (its newest complete checkpoint) or RUN/checkpoints/latest
    #[arg(long, value_name = "DIR", help_heading = "Model")]
    pub model: PathBuf,
    #[command(flatten)]
    pub chat: ChatArgs,
    #[command(flatten)]
    pub train: TrainArgs,
    #[command(flatten)]
    pub save: SaveArgs,
    #[command(flatten)]
    pub lora: super::lora::LoraArgs,
}

/// `--data`'s help in the fine-tuning tools, whose bundled data is `default`.
pub(crate) fn data_help(default: &str) -> String {
    format!(
        "Training data: conversations (.jsonl, .jsonl.gz, .jsonl.zst or .parquet records, or a .json array of them: a \
         file, a directory of them (its .json files left out), or a quoted glob), or token data (a directory prepared by prepare_data, .txt files) trained in windows as \
         pretraining [default: {default}]"
    )
}

impl Tool for FinetuneArgs {
    fn cli() -> Command {
        let data_help = data_help("data/chat.jsonl, the bundled chat file");
        super::tune::command(
            <Self as clap::CommandFactory>::command(),
            Defaults { out: "runs/finetune", steps: "200", lr: "1e-3", data_help },
        )
    }
    fn log_args(&self) -> &LogArgs {
        &self.train.log
    }
    fn train_args_mut(&mut self) -> Option<&mut TrainArgs> {
        Some(&mut self.train)
    }
}

/// `--show-example N`: the first N conversations of `--data` (the tool's bundled `default`
/// without it) as the run would train them (`crate::chat::show_examples`), marked for stdout.
/// Reads the tokenizer, the template and the data, never the weights or `--out`; token data has
/// no conversations to show and is refused.
pub(crate) fn show_examples(a: &TrainArgs, chat: &ChatArgs, default: &str, model: &Path) -> AnyResult<String> {
    super::tune::model_config(a, model)?;
    let n = chat.show_example.context("--show-example N was not given")?;
    let data = a.data.clone().unwrap_or_else(|| super::bundled(default));
    if crate::chat::is_token_data(&data, chat.data_format)? {
        anyhow::bail!(
            "--show-example shows conversations, but --data {} is token data (trained in windows, every token): give chat records",
            data.display()
        );
    }
    let tok_path = a.tokenizer.clone().unwrap_or_else(|| model.join("tokenizer.json"));
    let tokenizer = Tokenizer::from_file(&tok_path).with_context(|| format!("cannot load the tokenizer {}", tok_path.display()))?;
    let opts = chat.options(a.records.skip_bad_records);
    crate::chat::show_examples(&data, &[model], &tokenizer, &opts, a.seq_len, n, crate::chat::Marks::for_stdout())
}

/// What a fine-tuning run trains on, and what it shows of it.
pub(crate) struct FinetuneData {
    pub set: TrainSet,
    /// The held-out prompt whose reply is shown before and after training (chat data).
    pub sample_prompt: Option<Vec<u32>>,
    /// The chat template the run found, which its checkpoints carry (`tokenizer_config.json`'s
    /// `chat_template` and `chat_template.jinja`); with token data, the model's own if it has one.
    pub template: Option<String>,
}

impl FinetuneData {
    /// `trainer` writing this run's chat template into its checkpoints.
    pub fn carry_template(&self, trainer: Trainer) -> Trainer {
        match &self.template {
            Some(t) => trainer.with_chat_template(t.clone()),
            None => trainer,
        }
    }
}

/// `--data` as the fine-tuning tools take it: conversations packed into rows (with held-out
/// validation conversations), or token data in windows with its prepared validation split.
/// `default` is the tool's bundled data, read without --data.
pub(crate) fn prepare_data(
    a: &TrainArgs,
    chat: &ChatArgs,
    default: &str,
    model: &Path,
    tokenizer: &Tokenizer,
    tok_path: &Path,
) -> AnyResult<FinetuneData> {
    let data = a.data.clone().unwrap_or_else(|| super::bundled(default));
    if crate::chat::is_token_data(&data, chat.data_format)? {
        let (shards, train, val) = crate::shards::token_data_with(&data, tokenizer, tok_path, &a.data_options())?;
        check_validation_data(&val, a.batch_size, a.seq_len).with_context(|| format!("{}", shards.display()))?;
        // Token data trains no template, but the checkpoint keeps the one the model came with.
        let template = match crate::data::chat::find_template_source(Some(model), chat.chat_template.as_deref()) {
            Ok(t) => Some(t.text),
            Err(_) if chat.chat_template.is_none() => None,
            Err(e) => return Err(e.into()),
        };
        return Ok(FinetuneData { set: TrainSet::Shards { train, val }, sample_prompt: None, template });
    }
    let opts = chat.options(a.records.skip_bad_records);
    let ChatData { train, val, sample_prompt, template, .. } = crate::chat::load(&data, Some(model), tokenizer, &opts, a.seq_len, a.seed)?;
    let set = TrainSet::Rows { train: std::sync::Arc::new(train), val: val.map(std::sync::Arc::new) };
    Ok(FinetuneData { set, sample_prompt, template: Some(template.text) })
}

/// The fine-tuning tools' [`TrainArgs::check_inputs_outside_out`]: `--out` may not be or hold
/// `--model` (each of `models`: as given, and the checkpoint it resolved to), `--lora-init`,
/// `--chat-template`, `--val-data`, nor the data and the run's other inputs.
pub(crate) fn check_inputs(a: &TrainArgs, chat: &ChatArgs, lora: &super::lora::LoraArgs, default: &str, models: &[&Path]) -> AnyResult<()> {
    let mut inputs: Vec<(&str, &Path)> = models.iter().map(|m| ("--model", *m)).collect();
    let optional = [("--lora-init", &lora.lora_init), ("--chat-template", &chat.chat_template), ("--val-data", &chat.val_data)];
    inputs.extend(optional.iter().filter_map(|(f, p)| p.as_deref().map(|p| (*f, p))));
    // Conversations are read where they are; text and datasets go through --cache-dir. An error
    // here is the data's, reported by its reader later: count the cache as read.
    let data = a.data.clone().unwrap_or_else(|| super::bundled(default));
    let token_data = crate::chat::is_token_data(&data, chat.data_format).unwrap_or(true);
    a.check_inputs_outside_out(default, token_data, &inputs)
}

/// What every rank shares.
struct Prepared {
    data: TrainData,
    ft: FinetuneData,
    model: PathBuf,
    tokenizer: Tokenizer,
    stop: Vec<u32>,
    /// What checkpoints keep of --model, read before any work.
    source: std::sync::Arc<crate::checkpoint::SourceModel>,
    /// With LoRA: the base's identity, recorded with the adapter.
    base_id: Option<crate::lora_base::BaseIdentity>,
    /// The "memory: predicted peak" line's bytes a rank.
    predicted_peak: f64,
}

fn prepare(args: &FinetuneArgs) -> AnyResult<Prepared> {
    let a = &args.train;
    preflight(a)?;
    let device = a.device.pick()?;
    let dtype = a.device.dtype(device);
    let model = args.model.clone();
    let (cfg, cfg_path) = super::tune::model_config(a, &model)?; // before the data
    let Layout { lora, base_id, parallelism } = super::tune::check_layout(a, &args.lora, &cfg, &model, (&model, &cfg))?;
    let (tok_path, tokenizer) = super::tune::tokenizer(a, &model, &cfg, &cfg_path)?;
    let ft = prepare_data(a, &args.chat, "data/chat.jsonl", &model, &tokenizer, &tok_path)?;
    let source = args.save.source(&model, a.tokenizer.as_deref(), ft.template.as_deref())?;
    let layout = super::tune::mem_layout(&parallelism, a, lora)?;
    let mem = crate::planner::memory::check_layout(&cfg, dtype, device, &a.options().shape(), &layout)?;
    report(&format!("memory: predicted peak {}", crate::planner::memory::describe(&mem)));
    let stop = crate::chat::stop_ids(&model, &cfg, &tokenizer)?;
    let predicted_peak = mem.total();
    Ok(Prepared {
        data: TrainData { device, dtype, tok_path, set: ft.set.clone() },
        ft,
        model,
        tokenizer,
        stop,
        source,
        base_id,
        predicted_peak,
    })
}

pub fn run(args: FinetuneArgs) -> AnyResult<()> {
    finetune(args).map(drop)
}

/// What a fine-tuning run reported (rank 0's view): the validation loss over trained tokens
/// before (not on a resumed run) and after training, and the greedy replies to the held-out
/// prompt (chat data with validation).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outcome {
    pub val_before: Option<f64>,
    pub val_after: Option<f64>,
    /// The held-out prompt as rendered (the conversation up to the assistant's header).
    pub prompt: Option<String>,
    pub reply_before: Option<String>,
    pub reply_after: Option<String>,
    /// What `--show-example` printed (the run then trains nothing).
    pub examples: Option<String>,
    /// The peak the memory estimator predicted a rank, in bytes (the "memory: predicted peak"
    /// line's).
    pub predicted_peak: Option<f64>,
}

/// [`run`], returning what it reported (nothing when `--resume` names a finished run).
pub fn finetune(mut args: FinetuneArgs) -> AnyResult<Outcome> {
    let given = args.model.clone();
    args.model = super::model_dir("--model", &args.model)?;
    args.lora.settle()?;
    if args.chat.show_example.is_some() {
        let text = show_examples(&args.train, &args.chat, "data/chat.jsonl", &args.model)?;
        report(text.trim_end());
        return Ok(Outcome { examples: Some(text), ..Outcome::default() });
    }
    if !args.train.settle_resume()? {
        return Ok(Outcome::default());
    }
    check_inputs(&args.train, &args.chat, &args.lora, "data/chat.jsonl", &[&given, &args.model])?;
    super::tune::launch(&args.train, || prepare(&args), |p, comm| finetune_rank(&args, p, comm))
}

/// The greedy reply to the held-out prompt, logged (a failure is a warning: the reply is a look
/// at the model, not part of the run).
pub(crate) fn show_reply(trainer: &Trainer, tokenizer: &Tokenizer, prompt: &Option<Vec<u32>>, stop: &[u32], when: &str) -> Option<String> {
    let prompt = prompt.as_ref()?;
    let sampling = Sampling { temperature: 0.0, top_p: 1.0, vocab_limit: tokenizer.vocab_size() };
    let mut rng = crate::tensor::Rng::new(0);
    match crate::chat::reply(&trainer.model, tokenizer, prompt, 64, &sampling, stop, &mut rng) {
        Ok(r) => {
            report(&format!("reply {when}: {r:?}"));
            Some(r)
        }
        Err(e) => {
            tracing::warn!("no reply {when}: {e:#}");
            None
        }
    }
}

fn finetune_rank(args: &FinetuneArgs, p: &Prepared, comm: Option<Comm>) -> AnyResult<Outcome> {
    let a = &args.train;
    let (trainer, lora) = p.data.fine_tune_trainer(&p.model, &args.lora, a, comm)?;
    let mut trainer = p.ft.carry_template(trainer).with_source(p.source.clone());
    if lora {
        trainer = super::lora::with_base(trainer, &p.model, p.base_id.as_ref());
        // checkpoints: the adapter for this model
    }
    let mut out = Outcome { predicted_peak: Some(p.predicted_peak), ..Outcome::default() };
    if a.resume.is_none() && trainer.has_validation() {
        let v = trainer.evaluate(0)?;
        report(&format!("validation loss before fine-tuning {v:.4}"));
        if let Some(prompt) = &p.ft.sample_prompt {
            let text = p.tokenizer.decode(prompt)?;
            report(&format!("held-out prompt: {text:?}"));
            out.prompt = Some(text);
        }
        out.reply_before = show_reply(&trainer, &p.tokenizer, &p.ft.sample_prompt, &p.stop, "before fine-tuning");
        out.val_before = Some(v);
    }
    if let Some(r) = &a.resume {
        trainer.resume(r).with_context(|| format!("--resume {}", r.display()))?;
        report(&format!("resumed from {} at step {}", r.display(), trainer.step));
    }
    trainer.run()?;
    if trainer.has_validation() {
        // The last step's validation, over every held-out conversation (its metrics.jsonl line).
        let after = trainer.final_validation()?.loss;
        match out.val_before {
            Some(b) => report(&format!("validation loss after fine-tuning {after:.4} (before {b:.4})")),
            None => report(&format!("validation loss after fine-tuning {after:.4}")),
        };
        out.reply_after = show_reply(&trainer, &p.tokenizer, &p.ft.sample_prompt, &p.stop, "after fine-tuning");
        out.val_after = Some(after);
    }
    report(&format!("checkpoint: {}  (loss curve: {})", a.out.join("checkpoints").display(), a.out.join("loss.png").display()));
    super::lora::merge(&args.lora, &p.model, None, &a.out, &p.source)?;
    Ok(out)
}
