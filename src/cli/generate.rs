//! `generate`: sample text from a checkpoint with a KV cache: a continuation of `--prompt`, or
//! the assistant's reply to `--chat TEXT` / `--messages FILE.json` rendered with the chat
//! template (stopping at generation_config.json's `eos_token_id`).
use super::{env_help, non_negative, probability, LogArgs, ModelRunArgs, Tool, ENV_COMMON, ENV_DEVICE, ENV_LAUNCH};
use crate::data::chat::{encode_prompt, Conversation};
use crate::nn::{generate_until, Sampling};
use crate::progress::report;
use crate::AnyResult;
use anyhow::{bail, Context};
use clap::Parser;
use ferrolm_tensor::Rng;
use std::path::PathBuf;

#[derive(Parser, Debug, Clone, PartialEq)]
#[command(
    allow_negative_numbers = true,
    name = "generate",
    about = "Sample a continuation of a prompt from a checkpoint (temperature and nucleus sampling, with a KV cache), \
             or the assistant's reply to a conversation (--chat, --messages) rendered with the checkpoint's chat \
             template, stopping at its eos_token_id; prints the reply only",
    after_help = env_help(&[ENV_COMMON, ENV_DEVICE, ENV_LAUNCH])
)]
pub struct GenerateArgs {
    /// The model: a checkpoint directory (config.json, model.safetensors, tokenizer.json), a run
    /// directory (its newest complete checkpoint) or RUN/checkpoints/latest
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Text to continue [default: none; --prompt, --chat or --messages is required]
    #[arg(long, required_unless_present_any = ["chat", "messages"], conflicts_with_all = ["chat", "messages"])]
    pub prompt: Option<String>,
    /// One user message: the reply to it is generated with the chat template
    /// (add_generation_prompt) [default: none]
    #[arg(long, value_name = "TEXT", conflicts_with = "messages", help_heading = "Chat")]
    pub chat: Option<String>,
    /// A conversation to reply to: a JSON list of {"role", "content"} messages, or an object
    /// with a `messages` list [default: none]
    #[arg(long, value_name = "FILE.json", help_heading = "Chat")]
    pub messages: Option<PathBuf>,
    /// With --chat or --messages: the chat template, a Jinja file [default: --lora's adapter's
    /// template (chat_template.jinja, else the chat_template of its tokenizer_config.json), else
    /// --model's, found the same way]
    #[arg(long, value_name = "FILE", help_heading = "Chat")]
    pub chat_template: Option<PathBuf>,
    /// Tokens to sample (stops early at the end-of-sequence token); the prompt and the new
    /// tokens must fit the model's max_position_embeddings, else the run is refused
    #[arg(long, value_name = "N", default_value = "100")]
    pub max_new_tokens: usize,
    /// Sampling temperature (0: greedy)
    #[arg(long, default_value = "0.8", value_parser = non_negative, allow_hyphen_values = true)]
    pub temperature: f64,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches P
    #[arg(long, value_name = "P", default_value = "0.95", value_parser = probability, allow_hyphen_values = true)]
    pub top_p: f64,
    /// Seed of the sampler
    #[arg(long, default_value = "0")]
    pub seed: u64,
    #[command(flatten)]
    pub run: ModelRunArgs,
}

impl Tool for GenerateArgs {
    fn cli() -> clap::Command {
        super::inference_dtype_help(<Self as clap::CommandFactory>::command())
    }
    fn log_args(&self) -> &LogArgs {
        &self.run.log
    }
}

pub fn run(a: GenerateArgs) -> AnyResult<()> {
    generate(a).map(drop)
}

/// [`run`], returning what it printed: the prompt and its continuation, or the reply alone.
pub fn generate(a: GenerateArgs) -> AnyResult<String> {
    if a.chat_template.is_some() && a.chat.is_none() && a.messages.is_none() {
        bail!("--chat-template applies to --chat TEXT or --messages FILE.json");
    }
    let conversation = match (&a.chat, &a.messages) {
        (Some(text), _) => Some(Conversation::user(text)),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("cannot read --messages {}", path.display()))?;
            let text = text.strip_prefix('\u{feff}').unwrap_or(&text); // a UTF-8 byte order mark
            Some(Conversation::from_json(text).map_err(|e| anyhow::anyhow!("--messages {}: {e}", path.display()))?)
        }
        (None, None) => None,
    };
    let dir = &super::model_dir("--model", &a.model)?;
    let out = std::sync::Mutex::new(String::new());
    a.run.with_model(dir, |model, tokenizer, _| {
        let cfg_path = dir.join("config.json").display().to_string();
        super::pretrain::check_vocab(tokenizer, &dir.join("tokenizer.json"), model.config().vocab_size, &cfg_path)?;
        // Every rank samples the same tokens: the logits are gathered, the seed is shared.
        // Only the tokenizer's ids are drawn (a padded vocabulary has rows beyond them).
        let mut rng = Rng::new(a.seed);
        let sampling = Sampling { temperature: a.temperature, top_p: a.top_p, vocab_limit: tokenizer.vocab_size() };
        let text = match &conversation {
            Some(conv) => {
                let dirs = a.run.template_dirs(dir)?;
                let dirs: Vec<&std::path::Path> = dirs.iter().map(PathBuf::as_path).collect();
                let (template, _) = crate::chat::template_in(&dirs, a.chat_template.as_deref(), tokenizer)?;
                let ids = encode_prompt(conv, &template, tokenizer).map_err(|e| anyhow::anyhow!("{e}"))?;
                check_context(ids.len(), a.max_new_tokens, model.config().max_position_embeddings)?;
                let stop = crate::chat::stop_ids(dir, model.config(), tokenizer)?;
                crate::chat::reply(model, tokenizer, &ids, a.max_new_tokens, &sampling, &stop, &mut rng)?
            }
            None => {
                let prompt = a.prompt.as_deref().unwrap_or_default();
                // The prompt as a document's start, as transformers encodes it with the checkpoint's files.
                let ids = tokenizer.encode_as_document(prompt)?;
                if ids.is_empty() {
                    bail!("--prompt encodes to no tokens");
                }
                check_context(ids.len(), a.max_new_tokens, model.config().max_position_embeddings)?;
                let stop = &model.config().eos_token_id;
                let gen = generate_until(model, &ids, a.max_new_tokens, &sampling, stop, &mut rng)?;
                format!("{prompt}{}", tokenizer.decode(&gen)?)
            }
        };
        report(&text);
        *out.lock().unwrap_or_else(|e| e.into_inner()) = text;
        Ok(())
    })?;
    Ok(out.into_inner().unwrap_or_else(|e| e.into_inner()))
}

/// Refuses, before sampling, a prompt of `prompt` tokens and `new` new tokens that do not fit
/// the model's `max_position_embeddings` (the last new token is sampled, never fed back, so it
/// needs no position): a flag error naming both flags and the model's limit (the prompt is
/// `--prompt`'s, or the conversation of `--chat` / `--messages` as the template renders it). Sampling past the
/// context would need a sliding window, which the model was never trained on.
pub fn check_context(prompt: usize, new: usize, max_positions: usize) -> AnyResult<()> {
    if prompt > max_positions {
        return Err(super::flag_error(format!(
            "the prompt is {prompt} tokens, more than the model's max_position_embeddings ({max_positions})"
        )));
    }
    let room = max_positions - prompt + 1;
    if new > room {
        return Err(super::flag_error(format!(
            "--max-new-tokens {new} with a prompt of {prompt} tokens needs {} positions, more than the model's \
             max_position_embeddings ({max_positions}): at most {room} new tokens fit after this prompt",
            prompt + new - 1
        )));
    }
    Ok(())
}
