//! `finetune_ladder`: convert a Hugging Face checkpoint of any supported family (Llama, Qwen2,
//! Qwen3, Mistral, Gemma 3) to the Ladder Transformer (Ladder Residual, arXiv 2501.06589) and
//! fine-tune it. The conversion changes no weight: the chosen blocks read the residual stream
//! one branch late. The validation loss is reported for the plain model, for the converted one
//! before training and after it; checkpoints are written in the paper's released format
//! (`model_type: "llamaLadder"`, `ladder_layers`), plus `ladder_source_model_type` naming the
//! family when it is not a Llama (docs/LADDER.md).
use super::finetune::{data_help, prepare_data, ChatArgs, FinetuneData, SaveArgs};
use super::lora::LoraArgs;
use super::pretrain::preflight;
use super::tune::{Defaults, Layout};
use super::{env_help, LogArgs, Tool, TrainArgs, TrainData, ENV_COMMON, ENV_DEVICE, ENV_LAUNCH, ENV_TRAIN};
use crate::nn::LadderLayers;
use crate::parallel::Comm;
use crate::progress::report;
use crate::AnyResult;
use anyhow::Context;
use clap::{Command, Parser};
use std::path::PathBuf;

#[derive(Parser, Debug, Clone, PartialEq)]
#[command(
    allow_negative_numbers = true,
    name = "finetune_ladder",
    about = "Convert a Hugging Face checkpoint to the Ladder Transformer and fine-tune it (llama, qwen2, qwen3, mistral, \
             gemma3_text). Reports the validation loss of the plain model, of the converted model before training and \
             after it; writes checkpoints in the paper's llamaLadder format under OUT/checkpoints/ (another family's \
             keeps its config keys and says it in ladder_source_model_type). With --steps 0 it only converts.",
    after_help = env_help(&[ENV_COMMON, ENV_DEVICE, ENV_TRAIN, ENV_LAUNCH])
)]
pub struct FinetuneLadderArgs {
    /// The checkpoint to convert (config.json, model.safetensors, tokenizer.json): a
    /// checkpoint directory, a run directory (its newest complete checkpoint) or RUN/checkpoints/latest
    #[arg(long, value_name = "DIR", help_heading = "Model")]
    pub model: PathBuf,
    /// The blocks to make Ladder blocks: `all`, the last N layers, or indices i,j,k (a single
    /// index is written `3,`)
    #[arg(long, value_name = "N|i,j,k", help_heading = "Model", value_parser = super::ladder_layers_form)]
    pub ladder_layers: String,
    #[command(flatten)]
    pub chat: ChatArgs,
    #[command(flatten)]
    pub train: TrainArgs,
    #[command(flatten)]
    pub save: SaveArgs,
    #[command(flatten)]
    pub lora: LoraArgs,
}

impl Tool for FinetuneLadderArgs {
    fn cli() -> Command {
        let data_help = data_help("data/corpus, the bundled corpus");
        super::tune::command(
            <Self as clap::CommandFactory>::command(),
            Defaults { out: "runs/finetune_ladder", steps: "200", lr: "3e-4", data_help },
        )
        .mut_arg("steps", |a| a.value_parser(clap::value_parser!(usize)).help("Optimizer steps (0: only convert)"))
        .mut_arg("tokenizer", |a| a.help("Tokenizer (Hugging Face tokenizer.json) [default: the model's tokenizer.json]"))
    }
    fn log_args(&self) -> &LogArgs {
        &self.train.log
    }
    fn train_args_mut(&mut self) -> Option<&mut TrainArgs> {
        Some(&mut self.train)
    }
}

struct Prepared {
    data: TrainData,
    ft: FinetuneData,
    ladder: LadderLayers,
    /// What checkpoints keep of --model, read before any work.
    source: std::sync::Arc<crate::checkpoint::SourceModel>,
    /// With LoRA: the converted base's identity, recorded with the adapter.
    base_id: Option<crate::lora_base::BaseIdentity>,
}

fn prepare(args: &FinetuneLadderArgs) -> AnyResult<Prepared> {
    let a = &args.train;
    // --steps 0 converts only; the checks below are those of a run of at least one step.
    let mut checked = a.clone();
    checked.steps = checked.steps.max(1);
    preflight(&checked)?;
    let device = a.device.pick()?;
    let dtype = a.device.dtype(device);
    let dir = &args.model;
    std::fs::metadata(dir).with_context(|| format!("cannot open the model directory {}", dir.display()))?;
    let (cfg, cfg_path) = super::tune::model_config(a, dir)?; // before the data
    let ladder = super::ladder_layers(&args.ladder_layers, cfg.num_hidden_layers)?;
    // The adapters' base is the converted model (OUT/base): its config over --model's weight files.
    let mut converted = cfg.clone();
    converted.ladder_layers = Some(ladder.clone());
    let Layout { lora, base_id, parallelism } = super::tune::check_layout(a, &args.lora, &cfg, dir, (&a.out.join("base"), &converted))?;
    let (tok_path, tokenizer) = super::tune::tokenizer(a, dir, &cfg, &cfg_path)?;
    let ft = prepare_data(&checked, &args.chat, "data/corpus", dir, &tokenizer, &tok_path)?;
    let source = args.save.source(dir, a.tokenizer.as_deref(), ft.template.as_deref())?;
    let opts = checked.options();
    let layout = super::tune::mem_layout(&parallelism, a, lora)?;
    let mem = crate::planner::memory::check_layout(&cfg, dtype, device, &opts.shape(), &layout)?;
    report(&format!("memory: predicted peak {}", crate::planner::memory::describe_layout(&mem, &layout)));
    Ok(Prepared { data: TrainData { device, dtype, tok_path, set: ft.set.clone() }, ft, ladder, source, base_id })
}

pub fn run(mut args: FinetuneLadderArgs) -> AnyResult<()> {
    let given = args.model.clone();
    args.model = super::model_dir("--model", &args.model)?;
    args.lora.settle()?;
    if args.chat.show_example.is_some() {
        let text = super::finetune::show_examples(&args.train, &args.chat, "data/corpus", &args.model)?;
        report(text.trim_end());
        return Ok(());
    }
    if !args.train.settle_resume()? {
        return Ok(());
    }
    super::finetune::check_inputs(&args.train, &args.chat, &args.lora, "data/corpus", &[&given, &args.model])?;
    super::tune::launch(&args.train, || prepare(&args), |p, comm| finetune_rank(&args, p, comm))
}

fn finetune_rank(args: &FinetuneLadderArgs, p: &Prepared, comm: Option<Comm>) -> AnyResult<()> {
    let a = &args.train;
    let mut opts = a.options();
    opts.steps = opts.steps.max(1); // the trainer's schedule needs a length; --steps 0 never steps
    let mut model = super::lora::load_model(&args.model, args.lora.quantize_base, p.data.dtype, p.data.device)?;
    let before_kind = model.config().ladder_layers.clone();
    model.set_ladder_layers(None)?; // the plain model first, for its validation loss
    model.set_activation_checkpointing(a.activation_checkpointing);
    report(&format!("loaded {}: {} parameters, {} layers", args.model.display(), model.num_params(), model.config().num_hidden_layers));
    if let Some(l) = before_kind {
        report(&format!("note: {} is already a Ladder model ({l} layers); it is converted again from its weights", args.model.display()));
    }
    let lora = super::lora::attach(&args.lora, &mut model, a.seed)?;
    let (trainer, _) = p.data.trainer(model, a, opts.clone(), comm)?;
    let mut trainer = p.ft.carry_template(trainer).with_source(p.source.clone());
    let base = a.out.join("base");
    if lora {
        // The adapters' base is the converted model: its config, the same weight files.
        let mut converted = trainer.model.config().clone();
        converted.ladder_layers = Some(p.ladder.clone());
        if crate::logging::is_rank_zero() {
            super::lora::write_linked_base(&args.model, &base, &converted, &p.source)?;
        }
        trainer = super::lora::with_base(trainer, &base, p.base_id.as_ref());
    }
    let resuming = a.resume.is_some();
    let family = trainer.model.config().family;
    // As finetune: without validation data (--val-fraction 0 and no --val-data, or too few
    // conversations to hold one out) nothing is scored, and the run says so.
    let validates = trainer.has_validation();
    if !validates {
        report("no validation loss is reported: this run has no validation data (--val-fraction 0, or too few conversations, and no --val-data)");
    }
    let plain = if resuming || !validates { None } else { Some(trainer.evaluate(0)?) };
    trainer.model.set_ladder_layers(Some(p.ladder.clone()))?;
    if let Some(plain) = plain {
        let with = if args.lora.lora_init.is_some() { " (with the --lora-init adapter)" } else { "" };
        report(&format!("plain {family}{with} validation loss {plain:.4}"));
        let converted = trainer.evaluate(0)?;
        report(&format!("converted ({} layers Ladder) validation loss before fine-tuning {converted:.4}", p.ladder));
    }
    if let Some(r) = &a.resume {
        trainer.resume(r).with_context(|| format!("--resume {}", r.display()))?;
        report(&format!("resumed from {} at step {}", r.display(), trainer.step));
    }
    if a.steps == 0 {
        let dir = trainer.save_checkpoint()?;
        report(&format!("converted checkpoint {}", dir.display()));
        report_remote_code();
        return super::lora::merge(&args.lora, &base, Some(&dir), &a.out, &p.source);
    }
    trainer.run()?;
    if validates {
        // The last step's validation, over the whole split (the line in metrics.jsonl).
        let after = trainer.final_validation()?.loss;
        match plain {
            Some(plain) => report(&format!("validation loss after fine-tuning {after:.4} (plain {family} {plain:.4})")),
            None => report(&format!("validation loss after fine-tuning {after:.4}")),
        };
    }
    report(&format!("checkpoint: {}", a.out.join("checkpoints").display()));
    report_remote_code();
    super::lora::merge(&args.lora, &base, None, &a.out, &p.source)
}

/// How to load what this tool wrote in transformers: a Ladder checkpoint carries its modelling
/// code (`ferrolm_nn::ladder_hf`), which transformers runs only when asked to.
fn report_remote_code() {
    tracing::info!(
        "transformers loads the Ladder checkpoint with {} (configuration_llama_ladder.py and modeling_llama_ladder.py are written beside it)",
        crate::nn::ladder_hf::HOW_TO_LOAD
    );
}
