//! The clap glue the fine-tuning tools (`finetune`, `finetune_ladder`, `dpo`) share. Their flag
//! groups are the shared structs each flattens into its own ([`TrainArgs`],
//! [`super::finetune::SaveArgs`], [`LoraArgs`]; [`super::finetune::ChatArgs`] for the chat
//! tools); here is what they make of them: each tool's defaults of the training flags
//! ([`command`]), the checks of `--model` against `--seq-len` ([`model_config`]), of the LoRA and
//! parallel flags ([`check_layout`]) and of the tokenizer ([`tokenizer`]) before any data is
//! read, the memory check's layout ([`mem_layout`]), and the launch on every rank ([`launch`]).
use super::lora::LoraArgs;
use super::TrainArgs;
use crate::data::Tokenizer;
use crate::nn::LlamaConfig;
use crate::parallel::{Comm, Parallelism};
use crate::planner::memory::{LoraMem, MemParallelism};
use crate::AnyResult;
use anyhow::Context;
use clap::Command;
use std::path::{Path, PathBuf};

/// A fine-tuning tool's defaults of the shared training flags.
pub(crate) struct Defaults {
    /// `--out`'s.
    pub out: &'static str,
    /// `--steps`'.
    pub steps: &'static str,
    /// `--lr`'s.
    pub lr: &'static str,
    /// `--data`'s help, which names the tool's bundled data.
    pub data_help: String,
}

/// The tool's command `cmd` with its defaults of `--out`, `--steps` and `--lr`, and its `--data`
/// help; a tool adjusts further flags of its own on what this returns.
pub(crate) fn command(cmd: Command, d: Defaults) -> Command {
    cmd.mut_arg("out", |a| a.default_value(d.out))
        .mut_arg("data", |a| a.help(d.data_help))
        .mut_arg("steps", |a| a.default_value(d.steps))
        .mut_arg("lr", |a| a.default_value(d.lr))
}

/// `model`'s config.json, its positions checked against `--seq-len` before the data is read:
/// the config and the file's name as errors give it.
pub(crate) fn model_config(a: &TrainArgs, model: &Path) -> AnyResult<(LlamaConfig, String)> {
    let cfg_path = model.join("config.json");
    let cfg = LlamaConfig::from_file(&cfg_path)?;
    let name = cfg_path.display().to_string();
    super::pretrain::check_seq_len(a.seq_len, &cfg, &name)?;
    Ok((cfg, name))
}

/// What the LoRA and parallel flags make of a run, checked before any work.
pub(crate) struct Layout {
    /// The adapters' memory (`--lora-*`, or `--lora-init`'s adapter), for the memory check.
    pub lora: Option<LoraMem>,
    /// With LoRA: the base's identity, recorded with the adapter.
    pub base_id: Option<crate::lora_base::BaseIdentity>,
    pub parallelism: Parallelism,
}

/// [`Layout`] of a run of the model `cfg`, whose weights are in `weights`: the LoRA flags (and
/// `--lora-init`'s adapter), the identity of the adapters' base (`base`: its directory and its
/// config, the model's own or, for `finetune_ladder`, the converted one), the base a resumed
/// run was trained on, and the parallel layout against the model and its 4-bit base.
pub(crate) fn check_layout(
    a: &TrainArgs,
    lora: &LoraArgs,
    cfg: &LlamaConfig,
    weights: &Path,
    base: (&Path, &LlamaConfig),
) -> AnyResult<Layout> {
    let lora_mem = lora.memory(cfg, weights)?;
    let base_id = super::lora::base_identity(lora, base.0, base.1, weights)?;
    super::lora::check_run_base(lora, a.resume.as_deref(), base_id.as_ref(), weights)?;
    let parallelism = a.parallel.layout()?;
    parallelism.check_model(cfg)?;
    super::lora::check_quant_layout(lora.quantize_base, weights, &parallelism)?;
    Ok(Layout { lora: lora_mem, base_id, parallelism })
}

/// The run's tokenizer (`--tokenizer`, else `model`'s tokenizer.json) and its path, its
/// vocabulary checked against the model's `cfg` (read from `cfg_path`).
pub(crate) fn tokenizer(a: &TrainArgs, model: &Path, cfg: &LlamaConfig, cfg_path: &str) -> AnyResult<(PathBuf, Tokenizer)> {
    let tok_path = a.tokenizer.clone().unwrap_or_else(|| model.join("tokenizer.json"));
    let tokenizer = Tokenizer::from_file(&tok_path).with_context(|| format!("cannot load the tokenizer {}", tok_path.display()))?;
    super::pretrain::check_vocab(&tokenizer, &tok_path, cfg.vocab_size, cfg_path)?;
    Ok((tok_path, tokenizer))
}

/// The memory check's layout of a run: `parallelism`'s, with `--activation-checkpointing`, the
/// adapters and the loss chunks.
pub(crate) fn mem_layout(parallelism: &Parallelism, a: &TrainArgs, lora: Option<LoraMem>) -> AnyResult<MemParallelism> {
    let mut layout = parallelism.mem_layout(a.activation_checkpointing)?;
    layout.lora = lora;
    layout.loss_chunks = a.loss_chunks();
    Ok(layout)
}

/// Runs `per_rank` on every rank of the run's parallel layout, after `prepare` (see
/// [`crate::parallel::launch`]); `--profile` is switched on first.
pub(crate) fn launch<P: Sync, T: Send>(
    a: &TrainArgs,
    prepare: impl Fn() -> AnyResult<P>,
    per_rank: impl Fn(&P, Option<Comm>) -> AnyResult<T> + Sync,
) -> AnyResult<T> {
    if a.profile {
        crate::profile::enable();
    }
    let device = a.device.pick()?;
    crate::parallel::launch(&a.parallel.layout()?, device, prepare, per_rank)
}
