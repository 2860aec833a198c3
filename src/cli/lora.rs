//! The LoRA flags of the fine-tuning tools (`finetune`, `finetune_ladder`): train low-rank
//! adapters on the frozen model instead of every weight (`ferrolm_nn::lora`), continue a PEFT
//! adapter, and fold the trained adapter into a plain checkpoint. Checkpoints then hold the
//! adapter in PEFT's format (`adapter_config.json`, `adapter_model.safetensors`). A tool
//! flattens [`LoraArgs`] into its flags and calls, in order: [`LoraArgs::memory`] in its
//! prepare (the estimate, and the flags checked before any work), [`attach`] on the loaded
//! model, [`with_base`] on its trainer, [`merge`] after training.
use super::{flag_error, fraction, non_negative, positive};
use crate::lora_base::BaseIdentity;
use crate::nn::lora::{LoraConfig, Proj};
use crate::{AnyResult, Llama};
use anyhow::{bail, Context};
use clap::Args;
use ferrolm_ops::nf4::QuantType;
use ferrolm_tensor::Rng;
use std::path::{Path, PathBuf};

#[derive(Args, Debug, Clone, PartialEq, Default)]
#[command(next_help_heading = "LoRA")]
pub struct LoraArgs {
    /// Train LoRA adapters of rank R on the frozen model instead of every weight: the base stays
    /// in --dtype with no gradient or optimizer state [default: off, full fine-tuning]
    #[arg(long, value_name = "R", value_parser = positive)]
    pub lora_rank: Option<usize>,
    /// The adapters' alpha: their output is scaled by alpha / R [default: 2R]
    #[arg(long, value_name = "A", value_parser = non_negative, allow_hyphen_values = true)]
    pub lora_alpha: Option<f64>,
    /// Probability of zeroing an element of an adapter's input in training [default: 0]
    #[arg(long, value_name = "P", value_parser = fraction)]
    pub lora_dropout: Option<f64>,
    /// The linear layers that get adapters: a comma-separated list of q, k, v, o, gate, up, down,
    /// or all-linear (the seven) [default: q,k,v,o,gate,up,down]
    #[arg(long, value_name = "LIST", value_parser = targets)]
    pub lora_targets: Option<Targets>,
    /// Rank-stabilised LoRA: scale by alpha / sqrt(R) instead of alpha / R
    #[arg(long)]
    pub rslora: bool,
    /// Continue training the PEFT adapter in DIR (adapter_config.json, adapter_model.safetensors),
    /// or a LoRA run's newest one; its settings are the run's (a --lora-* flag given too must
    /// agree; --lora-dropout may differ) [default: new adapters]
    #[arg(long, value_name = "DIR")]
    pub lora_init: Option<PathBuf>,
    /// After training, also write the model with the adapters folded in (W + scale B A), a plain
    /// Hugging Face checkpoint, to OUT/merged (finetune_ladder --steps 0: merge --lora-init's
    /// adapter)
    #[arg(long)]
    pub merge_lora: bool,
    /// QLoRA: hold the base's linear weights (q/k/v/o, gate/up/down) 4-bit, nf4 or fp4 as
    /// bitsandbytes stores them (blocks of 64, double quantization), quantized on load from a
    /// bf16/f32 --model; the embeddings, norms and LM head stay in --dtype. Needs --lora-rank (or
    /// --lora-init). A checkpoint saved 4-bit by transformers loads as 4-bit without it
    /// [default: off, the base in --dtype]
    #[arg(long, value_name = "nf4|fp4", value_parser = quant_type)]
    pub quantize_base: Option<QuantType>,
}

/// `--quantize-base`'s value: nf4 or fp4 (an unknown type is a flag error naming them).
pub fn quant_type(s: &str) -> Result<QuantType, String> {
    QuantType::parse(s).map_err(|_| format!("unknown 4-bit quant type {s:?}: nf4 or fp4"))
}

pub use crate::quant_base::{check_quant_layout, is_4bit_checkpoint, load_model, quant_spec};

/// `--lora-targets`' projections.
#[derive(Clone, Debug, PartialEq)]
pub struct Targets(pub Vec<Proj>);

fn targets(s: &str) -> Result<Targets, String> {
    Proj::parse_list(s).map(Targets).map_err(|e| e.msg)
}

impl LoraArgs {
    /// Resolves `--lora-init` once, as `--lora` is: a PEFT adapter directory as it is, or a LoRA
    /// run's newest complete checkpoint (the log names it); the error names the flag. Call
    /// before anything reads the adapter or checks `--out` against it.
    pub fn settle(&mut self) -> AnyResult<()> {
        if let Some(init) = &self.lora_init {
            self.lora_init = Some(super::adapter_dir("--lora-init", init)?);
        }
        Ok(())
    }

    /// Whether the run trains adapters.
    pub fn enabled(&self) -> bool {
        self.lora_rank.is_some() || self.lora_init.is_some()
    }

    /// The new adapters' settings (None with --lora-init, which reads them from the adapter, or
    /// without LoRA). A LoRA flag without --lora-rank or --lora-init is refused.
    pub fn config(&self) -> AnyResult<Option<LoraConfig>> {
        if !self.enabled() {
            let given = [
                ("--lora-alpha", self.lora_alpha.is_some()),
                ("--lora-dropout", self.lora_dropout.is_some()),
                ("--lora-targets", self.lora_targets.is_some()),
                ("--rslora", self.rslora),
                ("--merge-lora", self.merge_lora),
                ("--quantize-base", self.quantize_base.is_some()),
            ];
            if let Some((flag, _)) = given.iter().find(|g| g.1) {
                return Err(flag_error(format!("{flag} applies to LoRA fine-tuning: add --lora-rank R (or --lora-init DIR)")));
            }
            return Ok(None);
        }
        let Some(rank) = self.lora_rank.filter(|_| self.lora_init.is_none()) else { return Ok(None) };
        let targets = self.lora_targets.clone().map_or_else(|| Proj::ALL.to_vec(), |t| t.0);
        LoraConfig::new(rank, self.lora_alpha, self.lora_dropout.unwrap_or(0.0), targets, self.rslora)
            .map(Some)
            .map_err(|e| flag_error(e.to_string()))
    }

    /// Refuses a --lora-* flag that disagrees with --lora-init's adapter `cfg` (read from `dir`),
    /// a flag error (exit code 2); --lora-dropout may differ.
    fn check_init(&self, cfg: &LoraConfig, dir: &Path) -> AnyResult<()> {
        let file = dir.join(crate::nn::lora::peft::ADAPTER_CONFIG);
        let differs = |flag: &str, given: String, field: &str, theirs: String| -> AnyResult<()> {
            if given != theirs {
                let msg =
                    format!("{flag} {given}, but {} has {field} {theirs}: drop the flag to continue the adapter as it is", file.display());
                return Err(flag_error(msg));
            }
            Ok(())
        };
        if let Some(r) = self.lora_rank {
            differs("--lora-rank", r.to_string(), "r", cfg.rank.to_string())?;
        }
        if let Some(a) = self.lora_alpha {
            differs("--lora-alpha", a.to_string(), "lora_alpha", cfg.alpha.to_string())?;
        }
        if let Some(t) = &self.lora_targets {
            let names = |v: &[Proj]| v.iter().map(|p| p.module()).collect::<Vec<_>>().join(",");
            differs("--lora-targets", names(&t.0), "target_modules", names(&cfg.targets))?;
        }
        if self.rslora && !cfg.rslora {
            let msg = format!("--rslora, but {} has use_rslora false: drop the flag to continue the adapter as it is", file.display());
            return Err(flag_error(msg));
        }
        Ok(())
    }

    /// The adapters as the memory estimator counts them (None without LoRA); reads --lora-init's
    /// adapter against the base `cfg`, so a flag or an adapter that does not fit is refused
    /// before any work. A 4-bit base (QLoRA: `--quantize-base`, or the `model` directory saved
    /// 4-bit, with its own quant type and double quantization) is charged as such
    /// (`LoraMem::quantized_base`; under `--tp` the estimator charges the pieces as
    /// `nn::qlora::shard_quant` cuts them).
    pub fn memory(&self, cfg: &crate::nn::LlamaConfig, model: &Path) -> AnyResult<Option<crate::planner::memory::LoraMem>> {
        let lora = match (self.config()?, &self.lora_init) {
            (Some(c), _) => c,
            (None, Some(dir)) => {
                let lora = crate::nn::lora::peft::read_adapter(dir, cfg, crate::Device::Cpu)
                    .with_context(|| format!("--lora-init {}", dir.display()))?
                    .0;
                self.check_init(&lora, dir)?;
                lora
            }
            (None, None) => return Ok(None),
        };
        let quantized_base = quant_spec(self.quantize_base, model)?;
        Ok(Some(crate::planner::memory::LoraMem { quantized_base, ..crate::planner::memory::LoraMem::new(&lora, cfg.num_hidden_layers) }))
    }

    /// Adds the run's adapters to `model` (before tensor parallelism and the engine attach; the
    /// same on every rank): new ones initialised from `seed`, or --lora-init's. Returns their
    /// settings, or None without LoRA.
    pub fn apply(&self, model: &mut Llama, seed: u64) -> AnyResult<Option<LoraConfig>> {
        if let Some(cfg) = self.config()? {
            model.add_lora(&cfg, &mut Rng::new(seed ^ 0x4C6F_5241))?; // "LoRA"
            return Ok(Some(cfg));
        }
        let Some(dir) = &self.lora_init else { return Ok(None) };
        // The flags were checked against this adapter by `memory`, before any work.
        model.load_adapter(dir).with_context(|| format!("--lora-init {}", dir.display()))?;
        if let Some(p) = self.lora_dropout {
            model.set_lora_dropout(p)?;
        }
        Ok(model.lora_config().cloned())
    }
}

/// The LoRA part of a fine-tuning tool's rank: adds the run's adapters to `model` (see
/// [`LoraArgs::apply`]) and reports their share. True when the run trains adapters.
pub fn attach(args: &LoraArgs, model: &mut Llama, seed: u64) -> AnyResult<bool> {
    let on = args.apply(model, seed)?.is_some();
    if on {
        crate::progress::report(&describe(model));
    }
    Ok(on)
}

/// `trainer` whose checkpoints hold its adapters in PEFT's format for the base model at `base`
/// (written absolute into `adapter_config.json`'s `base_model_name_or_path`, so PEFT, `eval
/// --lora` and `--merge-lora` find it from anywhere), with the base's identity `id` (see
/// [`base_identity`]) recorded beside it in `ferrolm_base.json`.
pub fn with_base(trainer: crate::train::Trainer, base: &Path, id: Option<&BaseIdentity>) -> crate::train::Trainer {
    let abs = std::path::absolute(base).unwrap_or_else(|_| base.to_path_buf());
    let trainer = trainer.with_adapter_base(&abs.display().to_string());
    match id {
        Some(id) => trainer.with_adapter_base_record(id.clone()),
        None => trainer,
    }
}

/// The identity of a LoRA run's base (None without LoRA): the model at `path` whose config is
/// `cfg` and whose weights are the files of the model directory `weights` (`finetune_ladder`'s
/// base is the converted config over the Llama's files). Hashes every weight once (the log says
/// how long it took).
///
/// A base saved 4-bit trains adapters only: without LoRA it is a flag error naming the flags.
pub fn base_identity(args: &LoraArgs, path: &Path, cfg: &crate::nn::LlamaConfig, weights: &Path) -> AnyResult<Option<BaseIdentity>> {
    if !args.enabled() {
        if is_4bit_checkpoint(weights)? {
            return Err(flag_error(format!(
                "--model {}: the checkpoint is saved 4-bit (quantization_config): its frozen 4-bit weights train through LoRA \
                 adapters only (QLoRA): add --lora-rank R (or --lora-init DIR)",
                weights.display()
            )));
        }
        return Ok(None);
    }
    BaseIdentity::compute(path, cfg, weights).map(Some)
}

/// Checks a LoRA run's base `id` (of `--model` `model`) against the base recorded with the
/// adapter it continues, before any work. `--resume` onto another base is refused (a flag error
/// naming the recorded base and `--model`): its adapter was trained on the other one, and its
/// checkpoints would name this one. `--lora-init` from an adapter recorded on another base
/// warns: the new run starts from that adapter on this base, and its checkpoints record this
/// base. An adapter with no record (PEFT's, an older ferrolm's) is accepted with an info line.
pub fn check_run_base(args: &LoraArgs, resume: Option<&Path>, id: Option<&BaseIdentity>, model: &Path) -> AnyResult<()> {
    let Some(id) = id else { return Ok(()) };
    let given = format!("--model {}", model.display());
    if let Some(ckpt) = resume.filter(|r| crate::nn::lora::peft::is_adapter_dir(r)) {
        if let Some(m) = crate::lora_base::mismatch(ckpt, &given, || Ok(id.clone()))? {
            return Err(super::flag_error(format!(
                "--resume {}: {m}. Resume with that base as --model, or start a new run from this adapter on {given} with \
                 --lora-init {}",
                ckpt.display(),
                ckpt.display()
            )));
        }
    }
    if let Some(init) = &args.lora_init {
        if let Some(m) = crate::lora_base::mismatch(init, &given, || Ok(id.clone()))? {
            tracing::warn!(
                "--lora-init {}: {m}; this run continues the adapter on {given}, and its checkpoints record that base",
                init.display()
            );
        }
    }
    Ok(())
}

/// `eval --lora`, `generate --lora`, `export --lora`: a warning when the adapter in `adapter`
/// was recorded on another base than the model directory `model` (`--model`); the adapter is
/// applied all the same. The model's weights are hashed only when the adapter has a record.
pub fn warn_other_base(adapter: &Path, model: &Path) -> AnyResult<()> {
    let given = format!("--model {}", model.display());
    if let Some(m) = crate::lora_base::mismatch(adapter, &given, || BaseIdentity::of_dir(model))? {
        tracing::warn!("--lora: {m}; applying it anyway, but the adapted model is not the one trained");
    }
    Ok(())
}

/// `--merge-lora`: rank 0 folds the adapter of the checkpoint `ckpt` (None: the run `out`'s
/// latest) into the model at `base`, written to OUT/merged (nothing without the flag) with
/// `source`'s config keys and save dtype, as the run's checkpoints.
pub fn merge(args: &LoraArgs, base: &Path, ckpt: Option<&Path>, out: &Path, source: &crate::checkpoint::SourceModel) -> AnyResult<()> {
    if !args.merge_lora || !crate::logging::is_rank_zero() {
        return Ok(());
    }
    let ckpt = match ckpt {
        Some(c) => c.to_path_buf(),
        None => crate::checkpoint::resolve_checkpoint(out)?,
    };
    let merged = out.join("merged");
    write_merged(base, &ckpt, &merged, source, args.quantize_base)?;
    crate::progress::report(&format!("merged model (the adapter folded in): {}", merged.display()));
    Ok(())
}

/// What a LoRA run reports: the trainable share.
pub fn describe(model: &Llama) -> String {
    let adapters: usize = model.adapters().iter().map(|(_, t)| t.numel()).sum();
    let all = model.num_params();
    let cfg = model.lora_config().map_or(String::new(), |c| {
        let t: Vec<&str> = c.targets.iter().map(|p| p.flag()).collect();
        format!(" (rank {}, alpha {}, scale {:.4}, dropout {}, targets {})", c.rank, c.alpha, c.scale(), c.dropout, t.join(","))
    });
    format!(
        "LoRA: {adapters} trainable adapter parameters, {:.3}% of the {all} frozen ones{cfg}",
        100.0 * adapters as f64 / all.max(1) as f64
    )
}

/// Where an adapter lives: `dir` itself when it holds `adapter_config.json`, else the latest
/// checkpoint of the run (or checkpoints directory) `dir` when that holds one. The error names
/// what is missing.
pub fn resolve_adapter(dir: &Path) -> AnyResult<PathBuf> {
    if crate::nn::lora::peft::is_adapter_dir(dir) {
        return Ok(dir.to_path_buf());
    }
    std::fs::metadata(dir).with_context(|| format!("cannot open the adapter directory {}", dir.display()))?;
    if let Ok(ckpt) = crate::checkpoint::resolve_checkpoint(dir) {
        if crate::nn::lora::peft::is_adapter_dir(&ckpt) {
            return Ok(ckpt);
        }
    }
    bail!(
        "{} has no {}: not a PEFT adapter directory, nor a run whose latest checkpoint holds an adapter",
        dir.display(),
        crate::nn::lora::peft::ADAPTER_CONFIG
    )
}

/// Writes `dst` as a model directory for the converted model `cfg` whose weights are those of
/// the checkpoint `src` (a Ladder conversion changes no weight): `config.json` for `cfg`, the
/// weight files linked to `src`'s (not copied), and `src`'s tokenizer files copied. A LoRA run of
/// `finetune_ladder` names it as its adapters' base, so PEFT and `--lora` find the Ladder model.
/// `config.json` keeps the keys of `source` (`src`'s, read at start) and its stored dtype.
pub fn write_linked_base(src: &Path, dst: &Path, cfg: &crate::nn::LlamaConfig, source: &crate::checkpoint::SourceModel) -> AnyResult<()> {
    let src = src.canonicalize().with_context(|| format!("cannot resolve {}", src.display()))?;
    std::fs::create_dir_all(dst).with_context(|| format!("cannot create {}", dst.display()))?;
    let index = src.join("model.safetensors.index.json");
    let mut weights = vec!["model.safetensors".to_string(), "model.safetensors.index.json".to_string()];
    if index.is_file() {
        weights.extend(crate::nn::safetensors_io::read_index(&index)?.into_values());
    }
    weights.sort();
    weights.dedup();
    for name in weights.iter().filter(|n| src.join(n).is_file()) {
        let link = dst.join(name);
        if std::fs::symlink_metadata(&link).is_ok() {
            std::fs::remove_file(&link).with_context(|| format!("cannot replace {}", link.display()))?;
        }
        link_file(&src.join(name), &link)?;
    }
    copy_tokenizer_files(&[&src], dst)?;
    crate::nn::safetensors_io::write_atomic(&dst.join("config.json"), source.linked_config_json(cfg)?.as_bytes())?;
    crate::nn::ladder_hf::write_remote_code(dst, cfg)?;
    Ok(())
}

/// Copies the tokenizer's files (`tokenizer_files::TOKENIZER_FILES`: tokenizer.json,
/// tokenizer_config.json with its chat template, generation_config.json, chat_template.jinja,
/// ...) into `dst`, each from the first of `from` that has it.
fn copy_tokenizer_files(from: &[&Path], dst: &Path) -> AnyResult<()> {
    for name in crate::tokenizer_files::TOKENIZER_FILES {
        if let Some(src) = from.iter().map(|d| d.join(name)).find(|f| f.is_file()) {
            std::fs::copy(&src, dst.join(name)).with_context(|| format!("cannot copy {} into {}", src.display(), dst.display()))?;
        }
    }
    Ok(())
}

#[cfg(unix)]
fn link_file(target: &Path, link: &Path) -> AnyResult<()> {
    std::os::unix::fs::symlink(target, link).with_context(|| format!("cannot link {} to {}", link.display(), target.display()))
}

#[cfg(not(unix))]
fn link_file(target: &Path, link: &Path) -> AnyResult<()> {
    std::fs::copy(target, link).map(|_| ()).with_context(|| format!("cannot copy {} to {}", target.display(), link.display()))
}

/// `--merge-lora`: the base at `base` with the adapter in `adapter` folded in, written as a plain
/// Hugging Face checkpoint to `out`: `source`'s config keys (the fine-tune's model, read at
/// start), the weights in its save dtype, the tokenizer's files (the adapter checkpoint's, which
/// carry the run's chat template, else the base's).
///
/// A 4-bit base (QLoRA: `quantize`, `--quantize-base`, or a checkpoint saved 4-bit) is the base
/// the adapter was trained against: it is loaded 4-bit as in training, dequantized to f32, the
/// adapter folded in in f32, and the sum rounded once to the base's original dtype: the source
/// checkpoint's (f32 or bf16) when it was quantized on load; for a checkpoint saved 4-bit, the
/// dtype its weights had before bitsandbytes quantized them (their quant_state's `dtype`; f16 is
/// stored as f32), written without `quantization_config`. The merged weights are the
/// dequantized ones plus the adapter, not the original 16-bit ones (peft#2321).
pub fn write_merged(
    base: &Path,
    adapter: &Path,
    out: &Path,
    source: &crate::checkpoint::SourceModel,
    quantize: Option<QuantType>,
) -> AnyResult<()> {
    let mut m = load_model(base, quantize, crate::DType::F32, crate::Device::Cpu)?;
    m.load_adapter(adapter).with_context(|| format!("cannot load the adapter {}", adapter.display()))?;
    let source = match m.quant_base().cloned() {
        None => std::borrow::Cow::Borrowed(source),
        Some(q) => {
            m.dequantize_base()?;
            let save = match (q.source, q.orig_dtype) {
                (crate::nn::qlora::QuantSource::OnLoad, _) => source.save_dtype(),
                (_, ferrolm_ops::nf4::OrigDtype::BF16) => crate::DType::BF16,
                _ => crate::DType::F32,
            };
            crate::progress::report(&format!(
                "merging over the 4-bit base: dequantized, the adapter folded in in f32, saved as {save} (the base's {} weights \
                 before quantization); the merged weights are the dequantized base plus the adapter (peft#2321)",
                q.orig_dtype.name()
            ));
            std::borrow::Cow::Owned(source.dense(save))
        }
    };
    m.merge_lora()?;
    source.write_model(out, m.config(), &m.parameters()).with_context(|| format!("cannot write the merged model to {}", out.display()))?;
    copy_tokenizer_files(&[adapter, base], out)
}

/// `export --model BASE --lora ADAPTER --out DIR`: the base model directory `base` with the PEFT
/// adapter in `adapter` folded in, written to the new directory `out` (absent or empty) in the
/// base's format and dtype: its `config.json` as it is (every key kept), its weight files with
/// the same names, tensors, dtypes and shards, each adapted weight W + s B A summed in f32 and
/// rounded once to W's stored dtype (`ferrolm_nn::lora::peft::merge_adapter_files`), its
/// tokenizer's files, and the adapter's chat template when it carries one (as
/// `chat_template.jinja`, which transformers prefers). No training state. Written into a
/// temporary directory renamed into place; returns the names written.
///
/// A base saved 4-bit (QLoRA's) has no 16-bit weights to fold into: it is merged as `--merge-lora`
/// merges over a 4-bit base ([`write_merged`]: dequantized, merged in f32, saved in the dtype its
/// weights had before quantization, without `quantization_config`).
pub fn export_merged(base: &Path, adapter: &Path, out: &Path) -> AnyResult<Vec<String>> {
    let cfg = crate::nn::LlamaConfig::from_file(base.join("config.json"))?;
    if is_4bit_checkpoint(base)? {
        return crate::checkpoint::write_new_dir(out, |tmp| {
            let source = crate::checkpoint::SourceModel::read(base, crate::checkpoint::SaveDtype::Source)?;
            write_merged(base, adapter, tmp, &source, None)?;
            let mut written: Vec<String> = std::fs::read_dir(tmp)
                .with_context(|| format!("cannot list {}", tmp.display()))?
                .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
                .collect();
            written.sort();
            Ok(written)
        });
    }
    crate::checkpoint::write_new_dir(out, |tmp| {
        let (lora, mut written) = crate::nn::lora::peft::merge_adapter_files(base, &cfg, adapter, tmp)
            .with_context(|| format!("cannot fold the adapter {} into {}", adapter.display(), base.display()))?;
        tracing::info!("folded the adapter (rank {}, scale {:.4}) into {}", lora.rank, lora.scale(), base.display());
        for file in std::iter::once("config.json").chain(crate::tokenizer_files::TOKENIZER_FILES) {
            let src = base.join(file);
            if src.is_file() {
                std::fs::copy(&src, tmp.join(file)).with_context(|| format!("cannot copy {} into {}", src.display(), tmp.display()))?;
                written.push(file.to_string());
            }
        }
        // A Ladder base's config names its modelling code (auto_map): it goes along.
        crate::nn::ladder_hf::write_remote_code(tmp, &cfg)?;
        if cfg.ladder_layers.is_some() {
            written.extend(crate::nn::ladder_hf::FILES.iter().map(|(n, _)| n.to_string()));
        }
        // The adapter's template (a LoRA run's checkpoint carries the run's) over the base's.
        if let Ok(t) = crate::data::chat::find_template_source_in(&[adapter], None) {
            let to = tmp.join("chat_template.jinja");
            std::fs::write(&to, t.text.as_bytes()).with_context(|| format!("cannot write {}", to.display()))?;
            tracing::info!("chat template: {} (the adapter's)", t.origin);
            if !written.iter().any(|w| w == "chat_template.jinja") {
                written.push("chat_template.jinja".to_string());
            }
        }
        written.sort();
        written.dedup();
        Ok(written)
    })
}
