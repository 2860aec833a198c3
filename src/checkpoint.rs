//! The run's checkpoint policy, in one place: where a checkpoint goes
//! (`checkpoints/step-NNNNNN/`, through a temporary directory renamed into place), which one
//! `checkpoints/latest` names, pruning to `--keep-last`, what makes one complete, and resuming
//! from one (`Trainer::save_checkpoint`, `Trainer::resume`). When to save is the training loop's
//! (`Trainer::run`: every `--save-every` steps and at the end). The engine's own state I/O (each
//! rank's shards, the parameters joined from the ranks) is `ferrolm_parallel::zero::ckpt`; this module
//! decides around it and writes the Hugging Face files, the tokenizer and `trainer_state.json`.
//!
//! It never loses work: weights that are not finite are never saved; a failed save leaves the
//! previous checkpoint as `latest` and removes its own partial files.
use crate::run_dir::sync_dir;
use crate::train::{Resumed, TrainOptions, Trainer};
use crate::{AnyResult, Llama};
use anyhow::{bail, Context, Result};
use ferrolm_data::LoaderState;
use ferrolm_nn::lora::peft::{is_adapter_dir, read_adapter, save_adapter, ADAPTER_CONFIG, ADAPTER_WEIGHTS};
use ferrolm_nn::safetensors_io::{load_safetensors, save_safetensors, write_atomic, TensorMap};
use ferrolm_nn::LlamaConfig;
use ferrolm_tensor::{no_grad, DType, Device, Rng, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub const CHECKPOINTS: &str = "checkpoints";
pub const LATEST: &str = "latest";
/// Written last into a checkpoint: a directory holding it (and the files before it) is complete.
pub const TRAINER_STATE: &str = "trainer_state.json";

/// `step-NNNNNN` for `step`.
pub fn checkpoint_name(step: usize) -> String {
    format!("step-{step:06}")
}

/// The step of a `step-NNNNNN` directory name.
pub fn parse_checkpoint_name(name: &str) -> Option<usize> {
    name.strip_prefix("step-").filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit())).and_then(|d| d.parse().ok())
}

/// The files a checkpoint directory lacks (empty: complete). `trainer_state.json` is written
/// last and the directory is renamed into place whole, so this only fails on directories that
/// were damaged or copied partially by hand.
pub fn missing_files(dir: &Path) -> Vec<&'static str> {
    let mut missing = Vec::new();
    if is_adapter_dir(dir) {
        // A LoRA run's checkpoint: the adapter in PEFT's format instead of the model.
        if !dir.join(ADAPTER_WEIGHTS).is_file() {
            missing.push(ADAPTER_WEIGHTS);
        }
    } else {
        if !dir.join("config.json").is_file() {
            missing.push("config.json");
        }
        if !dir.join("model.safetensors").is_file() && !dir.join("model.safetensors.index.json").is_file() {
            missing.push("model.safetensors");
        }
    }
    // The optimizer state: one device's file, or the shards of a parallel run.
    if !dir.join("optimizer.safetensors").is_file() && !ferrolm_parallel::zero::ckpt::is_sharded(dir) {
        missing.push("optimizer.safetensors");
    }
    if !dir.join(TRAINER_STATE).is_file() {
        missing.push(TRAINER_STATE);
    }
    missing
}

pub fn is_complete(dir: &Path) -> bool {
    dir.is_dir() && missing_files(dir).is_empty()
}

/// Every `step-NNNNNN` directory under `root` (complete or not), sorted by step.
pub fn list_checkpoints(root: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let mut out = Vec::new();
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e).with_context(|| format!("cannot list checkpoints in {}", root.display())),
    };
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot list checkpoints in {}", root.display()))?;
        if let Some(step) = entry.file_name().to_str().and_then(parse_checkpoint_name) {
            if entry.path().is_dir() {
                out.push((step, entry.path()));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// The checkpoint to resume from `path`: a checkpoint directory, a run directory (or its
/// `checkpoints/`) whose `latest` is followed, or the `checkpoints/latest` file itself. When
/// `latest` names a missing or incomplete checkpoint, the newest complete one is used instead,
/// with a warning.
pub fn resolve_checkpoint(path: &Path) -> Result<PathBuf> {
    // `checkpoints/latest` is a file naming the newest checkpoint: read as its folder is.
    if path.is_file() && path.file_name().is_some_and(|n| n == LATEST) {
        let root = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        return resolve_checkpoint(root);
    }
    if path.join(TRAINER_STATE).is_file() {
        let missing = missing_files(path);
        if !missing.is_empty() {
            bail!("{}: incomplete checkpoint (missing {})", path.display(), missing.join(", "));
        }
        return Ok(path.to_path_buf());
    }
    for root in [path.join(CHECKPOINTS), path.to_path_buf()] {
        let latest = root.join(LATEST);
        let named = std::fs::read_to_string(&latest).ok().map(|s| s.trim().to_string());
        if let Some(name) = &named {
            let d = root.join(name);
            if is_complete(&d) {
                return Ok(d);
            }
        }
        let newest = list_checkpoints(&root)?.into_iter().rev().find(|(_, d)| is_complete(d));
        match (named, newest) {
            (Some(name), Some((_, d))) => {
                tracing::warn!(
                    "{} names {name}, which is missing or incomplete; using the newest complete checkpoint {}",
                    latest.display(),
                    d.display()
                );
                return Ok(d);
            }
            (None, Some((_, d))) => {
                tracing::warn!("{} has no `latest` file; using the newest complete checkpoint {}", root.display(), d.display());
                return Ok(d);
            }
            (Some(name), None) => {
                bail!("{}: `latest` names {name}, which is missing or incomplete, and no complete checkpoint is left", root.display())
            }
            (None, None) => {}
        }
    }
    bail!("{}: no checkpoint found (expected trainer_state.json, or checkpoints/latest in a run directory)", path.display())
}

/// The model directory a `--model` flag names: a Hugging Face model directory (`config.json`
/// beside its weights: a checkpoint, or a model from elsewhere) as it is, else what
/// [`resolve_checkpoint`] finds (a run directory's newest complete checkpoint, or the one
/// `checkpoints/latest` names). Every tool that loads a model takes its path through this (the
/// CLI's `cli::model_dir` also says which checkpoint it chose).
pub fn resolve_model_dir(path: &Path) -> Result<PathBuf> {
    if path.is_dir() && path.join("config.json").is_file() {
        return Ok(path.to_path_buf());
    }
    std::fs::metadata(path).with_context(|| format!("cannot open the model directory {}", path.display()))?;
    let dir = resolve_checkpoint(path).with_context(|| {
        format!("{}: not a model directory (config.json), a run directory (checkpoints/) or checkpoints/latest", path.display())
    })?;
    if is_adapter_dir(&dir) {
        // Every tool resolves its models here, and they name an adapter differently: `--lora`
        // (eval, generate, export), `--lora-init` (the training tools); none takes one as
        // --ref-model, which needs the model folded.
        let base = adapter_base(&dir).map_or(String::new(), |b| format!(" (its base model is {b})"));
        bail!(
            "{d} is a LoRA run's adapter ({ADAPTER_CONFIG}), not a model{base}: give its base model as --model and the adapter \
             as --lora (eval, generate, export) or --lora-init (finetune, finetune_ladder, dpo), or fold it into the base \
             with `export --model BASE --lora {d} --out DIR` and give that DIR",
            d = dir.display()
        );
    }
    Ok(dir)
}

/// `base_model_name_or_path` of the adapter in `dir`, when its config names one.
fn adapter_base(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join(ADAPTER_CONFIG)).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v.get("base_model_name_or_path")?.as_str().filter(|b| !b.is_empty()).map(str::to_string)
}

/// The parts of a checkpoint that are training state, for resuming, not the model: what
/// [`export_model`] leaves out.
pub const TRAINING_STATE: [&str; 3] = ["shards", "optimizer.safetensors", TRAINER_STATE];

/// Copies the Hugging Face model of checkpoint `src` (every file but [`TRAINING_STATE`]:
/// `config.json`, the weights, the tokenizer files) into the new directory `dst`, through a
/// temporary directory renamed into place, and returns the names copied. Refuses a `dst` that
/// exists and is not empty.
pub fn export_model(src: &Path, dst: &Path) -> Result<Vec<String>> {
    // The model's files (or a LoRA run's adapter), whatever the training state.
    let missing: Vec<&str> =
        missing_files(src).into_iter().filter(|f| ["config.json", "model.safetensors", ADAPTER_WEIGHTS].contains(f)).collect();
    if !missing.is_empty() {
        bail!("{}: not a complete model (missing {})", src.display(), missing.join(", "));
    }
    write_new_dir(dst, |tmp| {
        let mut copied = Vec::new();
        let mut entries: Vec<_> =
            std::fs::read_dir(src).with_context(|| format!("cannot list {}", src.display()))?.collect::<std::io::Result<_>>()?;
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let file = e.file_name().to_string_lossy().into_owned();
            if TRAINING_STATE.contains(&file.as_str()) || !e.path().is_file() {
                continue;
            }
            let to = tmp.join(&file);
            std::fs::copy(e.path(), &to).with_context(|| format!("cannot copy {} to {}", e.path().display(), to.display()))?;
            copied.push(file);
        }
        Ok(copied)
    })
}

/// Makes the new directory `dst` (absent or empty, else refused) whole or not at all: `fill`
/// writes into a temporary directory beside it and returns the names it wrote, which are
/// fsynced before the directory is renamed into place; on an error the temporary is removed.
pub fn write_new_dir(dst: &Path, fill: impl FnOnce(&Path) -> Result<Vec<String>>) -> Result<Vec<String>> {
    if dst.exists() && std::fs::read_dir(dst).map(|mut d| d.next().is_some()).unwrap_or(true) {
        bail!("{} already exists and is not empty: choose another directory", dst.display());
    }
    let name = dst.file_name().with_context(|| format!("{}: not a directory name", dst.display()))?.to_string_lossy().into_owned();
    let parent = dst.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    let tmp = parent.join(format!(".{name}.tmp"));
    let written = (|| -> Result<Vec<String>> {
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).with_context(|| format!("cannot remove {}", tmp.display()))?;
        }
        std::fs::create_dir(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        let written = fill(&tmp)?;
        for f in &written {
            let p = tmp.join(f);
            std::fs::File::open(&p).and_then(|f| f.sync_all()).with_context(|| format!("cannot fsync {}", p.display()))?;
        }
        sync_dir(&tmp)?;
        if dst.exists() {
            std::fs::remove_dir(dst).with_context(|| format!("cannot replace the empty directory {}", dst.display()))?;
        }
        std::fs::rename(&tmp, dst).with_context(|| format!("cannot rename {} to {}", tmp.display(), dst.display()))?;
        sync_dir(parent)?;
        Ok(written)
    })();
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    written
}

/// `--save-dtype`: how a fine-tune stores the weights of its checkpoints' `model.safetensors`
/// (and of `OUT/merged`). The training state `--resume` reads (`shards/`: master weights,
/// optimizer moments) is always kept in the run's own precision, so a resume is exact.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SaveDtype {
    /// f32: the weights as trained on the CPU, exactly.
    F32,
    /// bf16, each weight rounded once to nearest even.
    Bf16,
    /// As the source model's weights are stored (bf16 or f32; f32 for another dtype).
    #[default]
    Source,
}

/// What a fine-tune keeps of the model it starts from (issue 50, items 9 and 10), read once at
/// start: its `config.json` object, whose keys every checkpoint keeps (only the keys the run
/// changes are rewritten: [`LlamaConfig::to_json_over`]); the dtype its weights are stored in,
/// which checkpoints store theirs in (`--save-dtype source`); and its tokenizer files
/// ([`crate::tokenizer_files::SourceTokenizer`]). Pretraining has none: its checkpoints are f32,
/// with ferrolm's config and tokenizer files.
#[derive(Clone, Debug)]
pub struct SourceModel {
    config_file: PathBuf,
    config: serde_json::Map<String, serde_json::Value>,
    /// The source's stored dtype as `config.json` spells it (its `dtype`, else `torch_dtype`,
    /// else the safetensors dtype of its weights).
    dtype_name: String,
    /// What checkpoints store their weights as.
    save: DType,
    tokenizer: Option<crate::tokenizer_files::SourceTokenizer>,
}

impl SourceModel {
    /// Reads the model directory `dir`'s `config.json` and the dtype of its weights, and picks
    /// the dtype checkpoints store weights in for `save`.
    pub fn read(dir: &Path, save: SaveDtype) -> Result<SourceModel> {
        let config_file = dir.join("config.json");
        let text = std::fs::read_to_string(&config_file).with_context(|| format!("cannot read {}", config_file.display()))?;
        let serde_json::Value::Object(config) =
            serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", config_file.display()))?
        else {
            bail!("{} is not a JSON object", config_file.display());
        };
        LlamaConfig::from_file(&config_file)?;
        let stored = ferrolm_nn::safetensors_io::stored_float_dtype(dir)?;
        let said = ["dtype", "torch_dtype"].iter().find_map(|k| config.get(*k).and_then(|v| v.as_str()).map(str::to_string));
        let dtype_name = said.clone().or(stored.map(str::to_string)).unwrap_or_else(|| "float32".into());
        let save = match save {
            SaveDtype::F32 => DType::F32,
            SaveDtype::Bf16 => DType::BF16,
            SaveDtype::Source => match stored.or(said.as_deref()) {
                Some("bfloat16") => DType::BF16,
                Some("float32") | None => DType::F32,
                Some(other) => {
                    tracing::warn!(
                        "{}: its weights are {other}, which ferrolm does not store; checkpoints hold f32 weights (--save-dtype bf16 for half the size)",
                        dir.display()
                    );
                    DType::F32
                }
            },
        };
        Ok(SourceModel { config_file, config, dtype_name, save, tokenizer: None })
    }

    /// With the source's tokenizer files, which every checkpoint then holds as they are.
    pub fn with_tokenizer(mut self, tokenizer: Option<crate::tokenizer_files::SourceTokenizer>) -> Self {
        self.tokenizer = tokenizer;
        self
    }

    /// The source as a dense model saved as `save` (a merge over a 4-bit base): without its
    /// `quantization_config`, whose weights the merged model no longer has.
    pub fn dense(&self, save: DType) -> SourceModel {
        let mut s = self.clone();
        s.config.remove("quantization_config");
        s.save = save;
        if let Ok(name) = dtype_name(save) {
            s.dtype_name = name.to_string();
        }
        s
    }

    /// The dtype checkpoints store their weights in.
    pub fn save_dtype(&self) -> DType {
        self.save
    }

    /// The source's tokenizer files, when checkpoints carry them instead of ferrolm's.
    pub fn tokenizer(&self) -> Option<&crate::tokenizer_files::SourceTokenizer> {
        self.tokenizer.as_ref()
    }

    /// The `config.json` text of the model `cfg` whose weights are stored as `dtype`, over the
    /// source's (see [`LlamaConfig::to_json_over`]).
    pub fn config_json(&self, cfg: &LlamaConfig, dtype: DType) -> Result<String> {
        self.config_text(cfg, dtype_name(dtype)?)
    }

    /// The `config.json` text of the model `cfg` whose weights are the source's own files (a
    /// Ladder conversion's base, its weights linked): the source's stored dtype.
    pub fn linked_config_json(&self, cfg: &LlamaConfig) -> Result<String> {
        self.config_text(cfg, &self.dtype_name)
    }

    fn config_text(&self, cfg: &LlamaConfig, dtype: &str) -> Result<String> {
        let v = cfg.to_json_over(dtype, &self.config, &self.dtype_name, &self.config_file.display().to_string())?;
        Ok(serde_json::to_string_pretty(&v)? + "\n")
    }

    /// Writes the model `cfg` with weights `params` into `dir`: `model.safetensors` in
    /// [`SourceModel::save_dtype`] and `config.json` over the source's.
    pub fn write_model(&self, dir: &Path, cfg: &LlamaConfig, params: &[(String, Tensor)]) -> Result<()> {
        let path = ferrolm_nn::safetensors_io::prepare_dir(dir, "model.safetensors")?;
        save_safetensors(&path, params, Some(self.save))?;
        write_atomic(&dir.join("config.json"), self.config_json(cfg, self.save)?.as_bytes())?;
        ferrolm_nn::ladder_hf::write_remote_code(dir, cfg)?; // a Ladder model's modelling code, which auto_map names
        Ok(())
    }
}

/// `config.json`'s name of a stored dtype.
fn dtype_name(d: DType) -> Result<&'static str> {
    Ok(match d {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        other => bail!("cannot store weights as {other}: use f32 or bf16"),
    })
}

/// The step a checkpoint directory was saved at (its `trainer_state.json`).
pub fn checkpoint_step(dir: &Path) -> Result<usize> {
    let file = dir.join(TRAINER_STATE);
    let text = std::fs::read_to_string(&file).with_context(|| format!("cannot read {}", file.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{} is not JSON", file.display()))?;
    v.get("step").and_then(|s| s.as_u64()).map(|s| s as usize).with_context(|| format!("{}: no step", file.display()))
}

/// The run directory a checkpoint lives in (`RUN/checkpoints/step-N` -> `RUN`), if it has that layout.
pub fn run_dir_of(checkpoint: &Path) -> Option<PathBuf> {
    let parent = checkpoint.parent()?;
    (parent.file_name()? == CHECKPOINTS).then(|| parent.parent().map(Path::to_path_buf)).flatten()
}

/// Deletes the oldest complete checkpoints so that `keep` remain, never the one `latest` names
/// (the newest complete one). Returns the removed directories.
pub fn prune(root: &Path, keep: usize) -> Result<Vec<PathBuf>> {
    if keep == 0 {
        return Ok(Vec::new());
    }
    let latest = std::fs::read_to_string(root.join(LATEST)).ok().map(|s| s.trim().to_string());
    let complete: Vec<(usize, PathBuf)> = list_checkpoints(root)?.into_iter().filter(|(_, d)| is_complete(d)).collect();
    let mut removed = Vec::new();
    let excess = complete.len().saturating_sub(keep);
    for (step, dir) in complete.into_iter().take(excess) {
        if latest.as_deref() == Some(checkpoint_name(step).as_str()) {
            continue;
        }
        std::fs::remove_dir_all(&dir).with_context(|| format!("cannot remove old checkpoint {}", dir.display()))?;
        removed.push(dir);
    }
    if !removed.is_empty() {
        sync_dir(root)?;
    }
    Ok(removed)
}

#[derive(Serialize, Deserialize)]
pub(crate) struct TrainerState {
    step: usize,
    /// Where the order of windows or of packed rows stands.
    loader: LoaderState,
    rng: u64,
    options: TrainOptions,
    tokens_seen: u64,
    /// Steps whose update was skipped: AdamW's own step count is `step - skipped_steps`.
    #[serde(default)]
    skipped_steps: u64,
    /// What the run trains on (`Batches::kind`: `windows`, `rows`, `pairs`); absent in
    /// checkpoints written before it was recorded, which are not checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    trains: Option<String>,
    /// A preference run's objective (`--beta`, `--loss-type`, `--loss-weights`), so a resume
    /// that changes it is warned about as a changed training option is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    preference: Option<ObjectiveRecord>,
}

/// The preference objective as `trainer_state.json` records it, in the flags' own words.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
struct ObjectiveRecord {
    beta: f64,
    loss_type: String,
    loss_weights: String,
}

impl ObjectiveRecord {
    fn of(cfg: &ferrolm_nn::objective::preference::PreferenceConfig) -> Self {
        let join = |f: &dyn Fn(&(ferrolm_nn::objective::preference::PreferenceLoss, f64)) -> String| {
            cfg.losses.iter().map(f).collect::<Vec<_>>().join(",")
        };
        ObjectiveRecord { beta: cfg.beta, loss_type: join(&|(l, _)| l.name().to_string()), loss_weights: join(&|(_, w)| w.to_string()) }
    }

    /// Sentences for each flag that differs between a checkpoint's objective and this run's.
    fn changes(&self, new: &ObjectiveRecord) -> Vec<String> {
        let note = " (the preference loss changes from the resumed step on)";
        [
            ("--beta", self.beta.to_string(), new.beta.to_string()),
            ("--loss-type", self.loss_type.clone(), new.loss_type.clone()),
            ("--loss-weights", self.loss_weights.clone(), new.loss_weights.clone()),
        ]
        .into_iter()
        .filter(|(_, a, b)| a != b)
        .map(|(flag, a, b)| format!("{flag} {a} -> {b}{note}"))
        .collect()
    }
}

/// What a run of `kind` (`Batches::kind`) trains on, and the tool that trains it, for errors.
fn trains_what(kind: &str) -> String {
    match kind {
        "windows" => "token windows (pretrain_llama, or finetune on token data)".into(),
        "rows" => "packed conversations (finetune, finetune_ladder)".into(),
        "pairs" => "preference pairs (dpo)".into(),
        other => format!("`{other}`"),
    }
}

impl<M: crate::nn::CausalLm> Trainer<M> {
    /// The first tensor holding a NaN or an infinity, if any. x * 0 is 0 for finite x and NaN
    /// otherwise, so one device-side sum over all tensors (one host sync) answers the common
    /// case; only when it is not finite are the tensors checked one by one to name the culprit.
    /// The first of this rank's checkpoint tensors that holds a NaN or an infinity, named by the
    /// parameter the bad element belongs to. One host read when every tensor is finite.
    fn non_finite_state(&self, tensors: &[(String, Tensor)]) -> AnyResult<Option<String>> {
        let _g = no_grad();
        let probe = |t: &Tensor| -> AnyResult<Tensor> { Ok(t.to_dtype(DType::F32)?.mul_scalar(0.0)?.sum_all()?) };
        let mut acc: Option<Tensor> = None;
        for (_, t) in tensors {
            let s = probe(t)?;
            acc = Some(match acc {
                // Offloaded optimizer state is on the host, the weights on the device.
                Some(a) if a.device() != s.device() => a.add(&s.to_device(a.device())?)?,
                Some(a) => a.add(&s)?,
                None => s,
            });
        }
        match acc {
            Some(a) if !a.item()?.is_finite() => {}
            _ => return Ok(None),
        }
        for (name, t) in tensors {
            if let Some(i) = t.to_vec_f64()?.iter().position(|v| !v.is_finite()) {
                return Ok(Some(self.engine.owner_of(name, i).unwrap_or_else(|| name.clone())));
            }
        }
        Ok(Some("(a sum of finite tensors)".into()))
    }

    /// Writes `checkpoints/step-NNNNNN/` through a temporary directory, fsyncs it, renames it
    /// into place, fsyncs `checkpoints/`, then points `checkpoints/latest` at it and prunes to
    /// `keep_last`. Refuses weights that are not finite and a step directory that exists. A
    /// failure midway removes the partial directory and leaves `latest` on the previous one.
    ///
    /// On several ranks every rank calls it: each writes its own shards (`shards/`), the ranks
    /// join their parameters (`TrainEngine::full_params`: collectives, no shard is read back), and
    /// world rank 0 of the engine's mesh writes the Hugging Face `model.safetensors` and
    /// finishes the directory.
    pub fn save_checkpoint(&self) -> AnyResult<PathBuf> {
        let name = checkpoint_name(self.step);
        // Every tensor the checkpoint stores, as this rank holds it.
        let state = self.engine.state()?;
        let bad = self.non_finite_state(&state)?;
        self.agree(bad.is_none(), &format!("save checkpoint {name}: it holds NaN or infinite values (the previous checkpoint is kept)"))?;
        if let Some(bad) = bad {
            bail!("refusing to save checkpoint {name}: `{bad}` holds NaN or infinite values (the previous checkpoint is kept)");
        }
        let root = self.out_dir.join(CHECKPOINTS);
        let dst = root.join(&name);
        let tmp = root.join(format!(".{name}.tmp"));
        // Only this trainer's own checkpoint of this very step may be rewritten (saving again
        // after `run()` saved its last step); anything else under that name is not ours.
        let rewrite = dst.exists();
        if rewrite && self.last_saved.get() != Some(self.step) {
            bail!("{} already exists: refusing to overwrite a saved checkpoint", dst.display());
        }
        let rank0 = self.engine.mesh().world().rank() == 0;
        let prepared = if rank0 {
            (|| -> AnyResult<()> {
                std::fs::create_dir_all(&root).with_context(|| format!("cannot create {}", root.display()))?;
                if tmp.exists() {
                    // Only a save of this same step that was interrupted leaves this name behind.
                    std::fs::remove_dir_all(&tmp)
                        .with_context(|| format!("cannot remove the stale partial checkpoint {}", tmp.display()))?;
                }
                std::fs::create_dir_all(&tmp).with_context(|| format!("cannot create {}", tmp.display()))
            })()
        } else {
            Ok(())
        };
        self.agree(prepared.is_ok(), "prepare the checkpoint directory")?;
        prepared?;
        let previous = std::fs::read_to_string(root.join(LATEST)).ok().map(|s| s.trim().to_string());
        let shards = self.engine.save_shards(&tmp).map_err(anyhow::Error::from);
        // Every rank takes part in joining the parameters once every rank's shards are written.
        let params = shards.and_then(|()| self.engine.full_params().map_err(anyhow::Error::from));
        let old = root.join(format!(".{name}.old"));
        let finished = params.and_then(|params| {
            let Some(params) = params else { return Ok(()) };
            self.write_checkpoint_files(&tmp, params).and_then(|()| {
                if rewrite {
                    std::fs::rename(&dst, &old).with_context(|| format!("cannot move {} aside", dst.display()))?;
                }
                std::fs::rename(&tmp, &dst).with_context(|| format!("cannot rename {} to {}", tmp.display(), dst.display()))?;
                if rewrite {
                    std::fs::remove_dir_all(&old).with_context(|| format!("cannot remove {}", old.display()))?;
                }
                sync_dir(&root)
            })
        });
        let agreed = self.agree(finished.is_ok(), "write the checkpoint");
        if let Err(e) = finished.and(agreed) {
            if rank0 {
                let _ = std::fs::remove_dir_all(&tmp);
            }
            let kept = match previous {
                Some(p) => format!("latest still names {p}, which is intact"),
                None => "no earlier checkpoint exists".to_string(),
            };
            return Err(e.context(format!("saving checkpoint {name} failed; its partial files were removed and {kept}")));
        }
        self.last_saved.set(Some(self.step));
        if rank0 {
            write_atomic(&root.join(LATEST), name.as_bytes())?;
            sync_dir(&root)?;
            for old in prune(&root, self.safety.keep_last)? {
                tracing::info!("removed old checkpoint {} (--keep-last {})", old.display(), self.safety.keep_last);
            }
        }
        self.barrier()?;
        Ok(dst)
    }

    /// Rank 0, after every rank wrote its shards into `tmp`: the Hugging Face model from the full
    /// parameters the ranks joined, the tokenizer's files and, last, the trainer state that marks
    /// the checkpoint complete.
    fn write_checkpoint_files(&self, tmp: &Path, params: TensorMap) -> AnyResult<()> {
        let named: Vec<(String, Tensor)> = params.into_iter().collect();
        match self.model.lora_config() {
            // A LoRA run's parameters are its adapters: PEFT's files, for the frozen base.
            Some(cfg) => {
                save_adapter(tmp, cfg, self.adapter_base.as_deref().unwrap_or_default(), &named)?;
                if let Some(id) = &self.adapter_base_record {
                    id.write(tmp)?;
                }
            }
            // A fine-tune: the source's dtype and config keys (`SourceModel`).
            None => match &self.source {
                Some(source) => source.write_model(tmp, self.model.config(), &named)?,
                None => {
                    let path = ferrolm_nn::safetensors_io::prepare_dir(tmp, "model.safetensors")?;
                    save_safetensors(&path, &named, Some(DType::F32))?;
                    write_atomic(&tmp.join("config.json"), self.model.config().to_json_string_dtype("float32").as_bytes())?;
                    ferrolm_nn::ladder_hf::write_remote_code(tmp, self.model.config())?;
                }
            },
        }
        // The tokenizer read when the run started (`Trainer::run`), else (a save outside `run`) now.
        let loaded = match (&self.tokenizer, &self.tokenizer_file) {
            (Some(t), _) => Some(t.clone()),
            (None, Some(t)) => Some(std::sync::Arc::new(
                ferrolm_data::Tokenizer::from_file(t).with_context(|| format!("cannot load the tokenizer {}", t.display()))?,
            )),
            (None, None) => None,
        };
        if let Some(files) = self.source.as_ref().and_then(|s| s.tokenizer()) {
            // A fine-tune of a Hugging Face model: its tokenizer files as they were.
            files.write(tmp)?;
        } else if let Some(tokenizer) = loaded {
            crate::tokenizer_files::write_tokenizer_files(tmp, &tokenizer, self.chat_template.as_deref())?;
        }
        let st = TrainerState {
            step: self.step,
            loader: self.batches.state(),
            rng: self.rng.state,
            options: self.opts.clone(),
            tokens_seen: self.tokens_seen,
            skipped_steps: self.skipped_total,
            trains: Some(self.batches.kind().to_string()),
            preference: self.preference.as_ref().map(|p| ObjectiveRecord::of(&p.cfg)),
        };
        // Last: its presence marks the checkpoint complete.
        write_atomic(&tmp.join(TRAINER_STATE), serde_json::to_string_pretty(&st)?.as_bytes())?;
        sync_dir(tmp)
    }

    /// Restores model, optimizer, data position, RNG, step and the loss history from a
    /// checkpoint directory (or a run directory, whose `checkpoints/latest` is followed).
    ///
    /// The checkpoint's `config.json` must describe the model being trained (else an error
    /// naming the fields that differ); weights are matched by name. Changed training options
    /// are warned about with their old and new values.
    pub fn resume(&mut self, path: &Path) -> AnyResult<()> {
        let dir = resolve_checkpoint(path)?;
        let state_file = dir.join(TRAINER_STATE);
        let text = std::fs::read_to_string(&state_file).with_context(|| format!("cannot read {}", state_file.display()))?;
        let st: TrainerState = serde_json::from_str(&text).with_context(|| format!("{} is not a trainer state", state_file.display()))?;
        // A run of another kind (a DPO run resumed by `finetune`, a fine-tune by `dpo`) would
        // continue its optimizer state under another objective and mix both losses in one
        // metrics.jsonl: its weights start a new run through --model instead.
        let ours = self.batches.kind();
        if let Some(theirs) = st.trains.as_deref().filter(|t| *t != ours) {
            bail!(
                "cannot resume from {}: it is a checkpoint of a run that trained {} (`trains` in {TRAINER_STATE}), and this run \
                 trains {}; to start a new run from its weights, pass it as --model instead of --resume",
                dir.display(),
                trains_what(theirs),
                trains_what(ours)
            );
        }

        match (is_adapter_dir(&dir), self.model.lora_config()) {
            (false, None) => {
                let cfg_file = dir.join("config.json");
                let saved_cfg = LlamaConfig::from_file(&cfg_file)?;
                let diffs = config_diff(&saved_cfg, self.model.config());
                if !diffs.is_empty() {
                    bail!("cannot resume from {}: it holds a different model ({})", dir.display(), diffs.join("; "));
                }
            }
            (true, Some(ours)) => {
                // The adapter must fit this base (read_adapter checks every shape) and be the run's.
                let (theirs, _) = read_adapter(&dir, self.model.config(), Device::Cpu)?;
                let diffs = lora_diff(&theirs, ours);
                if !diffs.is_empty() {
                    bail!("cannot resume from {}: its adapter differs from this run's ({})", dir.display(), diffs.join("; "));
                }
            }
            (true, None) => bail!(
                "cannot resume from {}: it holds a LoRA adapter ({ADAPTER_CONFIG}); resume it with the run's --lora-* flags",
                dir.display()
            ),
            (false, Some(_)) => {
                bail!(
                    "cannot resume from {}: it holds a fully fine-tuned model, not a LoRA adapter; drop the --lora-* flags",
                    dir.display()
                )
            }
        }
        // Full weights by name (the Hugging Face files, whatever layout wrote them) and the full
        // optimizer state (one device's file, or joined from the shards of a parallel run).
        let sharded = ferrolm_parallel::zero::ckpt::is_sharded(&dir);
        let (weights, state): (HashMap<String, Tensor>, HashMap<String, Tensor>) = if sharded {
            let (p, s) = ferrolm_parallel::zero::ckpt::load_full(&dir)?;
            (p.into_iter().collect(), s.into_iter().collect())
        } else {
            let loaded = Llama::from_pretrained(&dir, DType::F32, Device::Cpu)?;
            let opt_file = dir.join("optimizer.safetensors");
            let s = load_safetensors(&opt_file, DType::F32, Device::Cpu)?;
            (loaded.parameters().into_iter().collect(), s.into_iter().collect())
        };
        let expected: Vec<String> = self.model.trainable_parameters().into_iter().map(|(n, ..)| n).collect();
        if let Some(extra) = weights.keys().find(|k| !expected.contains(k)) {
            bail!("{}: weight `{extra}` is not a parameter of this model", dir.display());
        }
        if let Some(missing) = expected.iter().find(|k| !weights.contains_key(*k)) {
            bail!("{}: missing weight `{missing}`", dir.display());
        }
        let objective = match (&st.preference, &self.preference) {
            (Some(old), Some(new)) => old.changes(&ObjectiveRecord::of(&new.cfg)),
            _ => Vec::new(),
        };
        for w in option_changes(&st.options, &self.opts).into_iter().chain(objective) {
            tracing::warn!("resuming with a changed option: {w}");
        }
        let opt_step = st.step as u64 - st.skipped_steps.min(st.step as u64);
        let w: TensorMap = weights.into_iter().collect();
        let s: TensorMap = state.into_iter().collect();
        self.engine.load(&w, &s, opt_step).with_context(|| format!("cannot load {} into this rank's shards", dir.display()))?;
        if st.options.seq_len == self.opts.seq_len {
            self.batches.restore(&st.loader).with_context(|| format!("{}: cannot restore the data position", state_file.display()))?;
        } else {
            tracing::warn!("the data position cannot carry over to a new --seq-len: the data order restarts from the beginning");
        }
        self.rng = Rng { state: st.rng };
        // LoRA dropout continues with the masks of the run it resumes: one forward a micro-batch.
        self.model.set_lora_forwards((st.step * st.options.grad_accum) as u64);
        self.step = st.step;
        self.tokens_seen = st.tokens_seen;
        self.skipped_total = st.skipped_steps;
        self.skipped_in_a_row = 0;

        let run_dir = run_dir_of(&dir);
        let (lines, _) = match &run_dir {
            Some(r) => crate::run_dir::read_metrics(r, st.step)?,
            None => (Vec::new(), 0),
        };
        self.history = lines.iter().filter_map(|l| Some((l.step as f64, l.loss?))).collect();
        self.val_history = lines.iter().filter_map(|l| Some((l.step as f64, l.val_loss?))).collect();
        self.resumed = Some(Resumed { run_dir, step: st.step, metrics: lines.into_iter().map(|l| l.raw).collect() });
        Ok(())
    }
}

/// `field: checkpoint A, this run B` for every model field that differs (the stored dtype, the
/// init and the tokenizer's special ids are not part of the model).
pub fn config_diff(saved: &LlamaConfig, current: &LlamaConfig) -> Vec<String> {
    let (a, b) = (saved.to_json_value("float32"), current.to_json_value("float32"));
    let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else { return vec!["config.json is not an object".into()] };
    let mut out = Vec::new();
    for (k, va) in a {
        let vb = b.get(k).cloned().unwrap_or_default();
        if *va != vb && !["initializer_range", "bos_token_id", "eos_token_id"].contains(&k.as_str()) {
            out.push(format!("{k}: checkpoint {va}, this run {vb}"));
        }
    }
    out
}

/// `field: checkpoint A, this run B` for every adapter setting that differs (dropout may).
pub fn lora_diff(saved: &ferrolm_nn::LoraConfig, current: &ferrolm_nn::LoraConfig) -> Vec<String> {
    let names = |t: &[ferrolm_nn::Proj]| t.iter().map(|p| p.module()).collect::<Vec<_>>().join(",");
    let fields = [
        ("r", saved.rank.to_string(), current.rank.to_string()),
        ("lora_alpha", saved.alpha.to_string(), current.alpha.to_string()),
        ("use_rslora", saved.rslora.to_string(), current.rslora.to_string()),
        ("target_modules", names(&saved.targets), names(&current.targets)),
        ("layers_to_transform", format!("{:?}", saved.layers), format!("{:?}", current.layers)),
    ];
    fields.into_iter().filter(|(_, a, b)| a != b).map(|(k, a, b)| format!("{k}: checkpoint {a}, this run {b}")).collect()
}

/// Sentences for each training option that differs between a checkpoint and this run.
pub fn option_changes(old: &TrainOptions, new: &TrainOptions) -> Vec<String> {
    let mut out = Vec::new();
    let mut cmp = |name: &str, a: String, b: String, note: &str| {
        if a != b {
            out.push(format!("{name} {a} -> {b}{note}"));
        }
    };
    cmp("--steps", old.steps.to_string(), new.steps.to_string(), " (the learning-rate schedule is reshaped to the new length)");
    cmp("--batch-size", old.batch_size.to_string(), new.batch_size.to_string(), "");
    cmp("--seq-len", old.seq_len.to_string(), new.seq_len.to_string(), "");
    cmp("--grad-accum", old.grad_accum.to_string(), new.grad_accum.to_string(), "");
    cmp("--lr", old.lr.to_string(), new.lr.to_string(), "");
    cmp("min_lr", old.min_lr.to_string(), new.min_lr.to_string(), "");
    cmp("warmup_steps", old.warmup_steps.to_string(), new.warmup_steps.to_string(), "");
    cmp("weight_decay", old.weight_decay.to_string(), new.weight_decay.to_string(), "");
    cmp("grad_clip", old.grad_clip.to_string(), new.grad_clip.to_string(), "");
    cmp("--seed", old.seed.to_string(), new.seed.to_string(), " (the data order of the checkpoint is kept)");
    out
}
