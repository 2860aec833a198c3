//! `generate`: sample text from a checkpoint with a KV cache.
use super::{env_help, non_negative, probability, LogArgs, ModelRunArgs, Tool, ENV_COMMON, ENV_DEVICE, ENV_LAUNCH};
use crate::nn::generate::generate_within;
use crate::progress::report;
use crate::AnyResult;
use anyhow::bail;
use clap::Parser;
use ferrolm_tensor::Rng;
use std::path::PathBuf;

#[derive(Parser, Debug, Clone, PartialEq)]
#[command(
    allow_negative_numbers = true,
    name = "generate",
    about = "Sample a continuation of a prompt from a checkpoint (temperature and nucleus sampling, with a KV cache)",
    after_help = env_help(&[ENV_COMMON, ENV_DEVICE, ENV_LAUNCH])
)]
pub struct GenerateArgs {
    /// Checkpoint directory (config.json, model.safetensors, tokenizer.json)
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Text to continue
    #[arg(long)]
    pub prompt: String,
    /// Tokens to sample
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
    fn log_args(&self) -> &LogArgs {
        &self.run.log
    }
}

pub fn run(a: GenerateArgs) -> AnyResult<()> {
    let dir = &a.model;
    a.run.with_model(dir, |model, tokenizer, _| {
        // The prompt as a document's start, as transformers encodes it with the checkpoint's files.
        let ids = tokenizer.encode_as_document(&a.prompt)?;
        if ids.is_empty() {
            bail!("--prompt encodes to no tokens");
        }
        let cfg_path = dir.join("config.json").display().to_string();
        super::pretrain::check_vocab(tokenizer, &dir.join("tokenizer.json"), model.config().vocab_size, &cfg_path)?;
        // Every rank samples the same tokens: the logits are gathered, the seed is shared.
        // Only the tokenizer's ids are drawn (a padded vocabulary has rows beyond them).
        let mut rng = Rng::new(a.seed);
        let out = generate_within(model, &ids, a.max_new_tokens, a.temperature, a.top_p, tokenizer.vocab_size(), &mut rng)?;
        report(&format!("{}{}", a.prompt, tokenizer.decode(&out)?));
        Ok(())
    })
}
