//! `export`: a checkpoint's Hugging Face model without its training state, ready to upload or
//! to load elsewhere. A checkpoint directory holds both (`config.json`, `model.safetensors`, the
//! tokenizer files; and `shards/`, `optimizer.safetensors`, `trainer_state.json` for `--resume`);
//! this copies only the first. With `--lora`, `--model` is a base model and the adapter is folded
//! into it (`lora::export_merged`): the plain model, in the base's format and dtype.
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
             upload, or load with transformers' from_pretrained. With --lora, fold a LoRA adapter into the base model \
             --model and write the merged model in the base's format and dtype.",
    after_help = env_help(&[ENV_COMMON])
)]
pub struct ExportArgs {
    /// The checkpoint: a checkpoint directory, a run directory (its newest complete checkpoint)
    /// or RUN/checkpoints/latest
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// A PEFT LoRA adapter to fold into --model, then the base model: an adapter directory
    /// (adapter_config.json, adapter_model.safetensors) or a LoRA run or checkpoint (its latest
    /// adapter). The merged model keeps the base's config.json, weight files and dtypes (each
    /// adapted weight W + scale B A rounded once from f32), and its tokenizer files, with the
    /// adapter's chat template when it has one [default: none, copy --model as it is]
    #[arg(long, value_name = "DIR")]
    pub lora: Option<PathBuf>,
    /// The new model directory (absent or empty; not --model or --lora, nor a directory holding
    /// them)
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
    let Some(lora) = &a.lora else {
        crate::run_dir::check_inputs_outside(&a.out, &[("--model", &a.model), ("--model", &src)])?;
        let files = crate::checkpoint::export_model(&src, &a.out)?;
        report(&format!("exported {} to {}: {}", src.display(), a.out.display(), files.join(", ")));
        return Ok(());
    };
    let adapter = super::adapter_dir("--lora", lora)?;
    crate::run_dir::check_inputs_outside(&a.out, &[("--model", &a.model), ("--model", &src), ("--lora", lora), ("--lora", &adapter)])?;
    super::lora::warn_other_base(&adapter, &src)?;
    let files = super::lora::export_merged(&src, &adapter, &a.out)?;
    report(&format!(
        "exported {} with the adapter {} folded in to {}: {}",
        src.display(),
        adapter.display(),
        a.out.display(),
        files.join(", ")
    ));
    Ok(())
}
