//! `finetune`: supervised fine-tuning of a Llama (or Ladder) checkpoint on conversations, with
//! every training, parallel and offload flag of `pretrain_llama`. The chat-data flags
//! ([`ChatArgs`]) and the data preparation ([`prepare_data`]) are shared with
//! `finetune_ladder`; flags of one tool only go in its own struct. Both take the LoRA flags
//! ([`super::lora::LoraArgs`]).
use super::pretrain::{check_vocab, preflight};
use super::{env_help, fraction, LogArgs, Tool, TrainArgs, TrainData, ENV_COMMON, ENV_DEVICE, ENV_LAUNCH, ENV_TRAIN};
use crate::chat::{ChatData, ChatOptions};
use crate::data::chat::{DataFormat, TrainOn};
use crate::data::Tokenizer;
use crate::nn::{LlamaConfig, Sampling};
use crate::parallel::Comm;
use crate::progress::report;
use crate::train::{check_validation_data, TrainSet, Trainer};
use crate::{AnyResult, Llama};
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
    pub lora: super::lora::LoraArgs,
}

/// `--data`'s help in the fine-tuning tools, whose bundled data is `default`.
pub(crate) fn data_help(default: &str) -> String {
    format!(
        "Training data: conversations (.jsonl, .jsonl.gz, .jsonl.zst or .parquet records: a file, a directory of them, \
         or a quoted glob), or token data (a directory prepared by prepare_data, .txt files) trained in windows as \
         pretraining [default: {default}]"
    )
}

impl Tool for FinetuneArgs {
    fn cli() -> Command {
        <Self as clap::CommandFactory>::command()
            .mut_arg("out", |a| a.default_value("runs/finetune"))
            .mut_arg("data", |a| a.help(data_help("data/chat.jsonl, the bundled chat file")))
            .mut_arg("steps", |a| a.default_value("200"))
            .mut_arg("lr", |a| a.default_value("1e-3"))
    }
    fn log_args(&self) -> &LogArgs {
        &self.train.log
    }
    fn train_args_mut(&mut self) -> Option<&mut TrainArgs> {
        Some(&mut self.train)
    }
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
    let ChatData { train, val, sample_prompt, template } = crate::chat::load(&data, Some(model), tokenizer, &opts, a.seq_len, a.seed)?;
    let set = TrainSet::Rows { train: std::sync::Arc::new(train), val: val.map(std::sync::Arc::new) };
    Ok(FinetuneData { set, sample_prompt, template: Some(template.text) })
}

/// What every rank shares.
struct Prepared {
    data: TrainData,
    ft: FinetuneData,
    model: PathBuf,
    tokenizer: Tokenizer,
    stop: Vec<u32>,
    /// With LoRA: the base's identity, recorded with the adapter.
    base_id: Option<crate::lora_base::BaseIdentity>,
}

fn prepare(args: &FinetuneArgs) -> AnyResult<Prepared> {
    let a = &args.train;
    preflight(a)?;
    let device = a.device.pick()?;
    let dtype = a.device.dtype(device);
    let model = args.model.clone();
    let cfg_path = model.join("config.json");
    let cfg = LlamaConfig::from_file(&cfg_path)?;
    let lora = args.lora.memory(&cfg)?; // the LoRA flags (and --lora-init's adapter) before any work
    let base_id = super::lora::base_identity(&args.lora, &model, &cfg, &model)?;
    super::lora::check_run_base(&args.lora, a.resume.as_deref(), base_id.as_ref(), &model)?;
    let parallelism = a.parallel.layout()?;
    parallelism.check_model(&cfg)?;
    let tok_path = a.tokenizer.clone().unwrap_or_else(|| model.join("tokenizer.json"));
    let tokenizer = Tokenizer::from_file(&tok_path).with_context(|| format!("cannot load the tokenizer {}", tok_path.display()))?;
    check_vocab(&tokenizer, &tok_path, cfg.vocab_size, &cfg_path.display().to_string())?;
    let ft = prepare_data(a, &args.chat, "data/chat.jsonl", &model, &tokenizer, &tok_path)?;
    let mut layout = parallelism.mem_layout(a.activation_checkpointing)?;
    layout.lora = lora;
    layout.loss_chunks = a.loss_chunks();
    let mem = crate::planner::memory::check_layout(&cfg, dtype, device, &a.options().shape(), &layout)?;
    report(&format!("memory: predicted peak {}", crate::planner::memory::describe(&mem)));
    let stop = crate::chat::stop_ids(&model, &cfg, &tokenizer)?;
    Ok(Prepared { data: TrainData { device, dtype, tok_path, set: ft.set.clone() }, ft, model, tokenizer, stop, base_id })
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
}

/// [`run`], returning what it reported (nothing when `--resume` names a finished run).
pub fn finetune(mut args: FinetuneArgs) -> AnyResult<Outcome> {
    args.model = super::model_dir("--model", &args.model)?;
    if !args.train.settle_resume()? {
        return Ok(Outcome::default());
    }
    if args.train.profile {
        crate::profile::enable();
    }
    let device = args.train.device.pick()?;
    crate::parallel::launch(&args.train.parallel.layout()?, device, || prepare(&args), |p, comm| finetune_rank(&args, p, comm))
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
    let mut model =
        Llama::from_pretrained(&p.model, p.data.dtype, p.data.device).with_context(|| format!("cannot load {}", p.model.display()))?;
    model.set_activation_checkpointing(a.activation_checkpointing);
    let kind = match &model.config().ladder_layers {
        Some(l) => format!(" (Ladder Transformer: {l} layers)"),
        None => String::new(),
    };
    report(&format!(
        "loaded {}: {} parameters, {} layers, on {} in {}{kind}",
        p.model.display(),
        model.num_params(),
        model.config().num_hidden_layers,
        p.data.device,
        p.data.dtype
    ));
    let lora = super::lora::attach(&args.lora, &mut model, a.seed)?;
    let (trainer, _) = p.data.trainer(model, a, a.options(), comm)?;
    let mut trainer = p.ft.carry_template(trainer);
    if lora {
        trainer = super::lora::with_base(trainer, &p.model, p.base_id.as_ref());
        // checkpoints: the adapter for this model
    }
    let mut out = Outcome::default();
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
    super::lora::merge(&args.lora, &p.model, None, &a.out)?;
    Ok(out)
}
