//! `eval`: mean next-token cross-entropy of a checkpoint on a text file.
use super::{env_help, positive, LogArgs, ModelRunArgs, Tool, ENV_COMMON, ENV_DEVICE, ENV_LAUNCH};
use crate::data::Tokenizer;
use crate::progress::report;
use crate::{AnyResult, Device, Llama};
use anyhow::{bail, Context};
use clap::Parser;
use std::path::PathBuf;

#[derive(Parser, Debug, Clone, PartialEq)]
#[command(
    allow_negative_numbers = true,
    name = "eval",
    about = "Mean next-token loss and perplexity of a checkpoint on a text file. The text is tokenized with the \
             checkpoint's tokenizer.json (no special tokens) and scored on every full window tokens[i*T .. i*T+T+1]; \
             the last line printed is `loss <float> ppl <float> tokens <int>`.",
    after_help = env_help(&[ENV_COMMON, ENV_DEVICE, ENV_LAUNCH])
)]
pub struct EvalArgs {
    /// Checkpoint directory (config.json, model.safetensors, tokenizer.json)
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Text file to score
    #[arg(long, value_name = "FILE")]
    pub text: PathBuf,
    /// Tokens per window (T)
    #[arg(long, value_name = "T", value_parser = positive)]
    pub seq_len: usize,
    /// Windows per forward pass
    #[arg(long, default_value = "8", value_parser = positive)]
    pub batch_size: usize,
    #[command(flatten)]
    pub run: ModelRunArgs,
}

impl Tool for EvalArgs {
    fn log_args(&self) -> &LogArgs {
        &self.run.log
    }
}

pub fn run(a: EvalArgs) -> AnyResult<()> {
    a.run.with_model(&a.model, |model, tokenizer, device| {
        let text = std::fs::read_to_string(&a.text).with_context(|| format!("cannot read the text file {}", a.text.display()))?;
        let ids = tokenizer.encode(&text, false)?;
        score(&a, model, tokenizer, &ids, device)
    })
}

/// Checks the flags against the model and the text, scores it (`crate::eval::mean_loss`), and
/// prints the result line.
fn score(a: &EvalArgs, model: &Llama, tokenizer: &Tokenizer, ids: &[u32], device: Device) -> AnyResult<()> {
    let (dir, t, bs) = (&a.model, a.seq_len, a.batch_size);
    let tok_path = dir.join("tokenizer.json");
    if tokenizer.vocab_size() > model.config().vocab_size {
        bail!(
            "{}: the tokenizer has {} tokens but the model's vocab_size is {}",
            tok_path.display(),
            tokenizer.vocab_size(),
            model.config().vocab_size
        );
    }
    if t > model.config().max_position_embeddings {
        bail!("--seq-len {t} exceeds the model's max_position_embeddings {}", model.config().max_position_embeddings);
    }
    let windows = crate::eval::windows(ids.len(), t);
    if windows == 0 {
        bail!("{}: {} tokens do not fill one window of {} tokens (--seq-len {t} + 1)", a.text.display(), ids.len(), t + 1);
    }
    let Some(need) = bs.min(windows).checked_mul(t).and_then(|n| n.checked_mul(8)) else {
        bail!("--batch-size {bs} × --seq-len {t} overflows");
    };
    if let Some(avail) = crate::planner::memory::available_host_bytes() {
        if need as u64 > avail {
            bail!("--batch-size {bs} × --seq-len {t} needs {need} bytes for one batch, {avail} are available: lower --batch-size");
        }
    }
    let s = crate::eval::mean_loss(model, ids, t, bs, device)?;
    report(&format!("loss {:.6} ppl {:.4} tokens {}", s.loss, s.perplexity(), s.tokens));
    Ok(())
}
