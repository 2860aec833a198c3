//! `export`: a checkpoint's Hugging Face model without its training state, ready to upload or
//! to load elsewhere. A checkpoint directory holds both (`config.json`, `model.safetensors`, the
//! tokenizer files; and `shards/`, `optimizer.safetensors`, `trainer_state.json` for `--resume`);
//! this copies only the first.
use super::{env_help, model_dir, LogArgs, Tool, ENV_COMMON};
use crate::progress::report;
use crate::AnyResult;
use clap::Parser;
use std::path::PathBuf;

#[derive(Parser, Debug, Clone, PartialEq)]
#[command(
    name = "export",
    about = "Copy a checkpoint's Hugging Face model (config.json, the weights, the tokenizer files) into a new directory, \
             without the training state that --resume reads (shards/, optimizer.safetensors, trainer_state.json): what to \
             upload, or load with transformers' from_pretrained.",
    after_help = env_help(&[ENV_COMMON])
)]
pub struct ExportArgs {
    /// The checkpoint: a checkpoint directory, a run directory (its newest complete checkpoint)
    /// or RUN/checkpoints/latest
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// The new model directory (absent or empty; never --model nor a directory that holds it)
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    #[command(flatten)]
    pub log: LogArgs,
}

impl Tool for ExportArgs {
    fn log_args(&self) -> &LogArgs {
        &self.log
    }
}

pub fn run(a: ExportArgs) -> AnyResult<()> {
    let src = model_dir("--model", &a.model)?;
    crate::run_dir::check_inputs_outside(&a.out, &[("--model", &a.model), ("--model", &src)])?;
    let files = crate::checkpoint::export_model(&src, &a.out)?;
    report(&format!("exported {} to {}: {}", src.display(), a.out.display(), files.join(", ")));
    Ok(())
}
