//! The training loop shared by the training tools: gradient accumulation, AdamW with
//! warmup+cosine, global-norm clipping, periodic validation, JSONL metrics, progress, and when to
//! save checkpoints (every `--save-every` steps and at the end). Saving, `latest`, pruning and
//! resuming (bit-exactly) are `crate::checkpoint`.
//!
//! It never loses work: a directory holding a run is not written over without `overwrite`; a
//! step whose loss or gradient norm is not finite is skipped before the update (and the run
//! stops after `max_skipped_steps` in a row); weights that are not finite are never saved; a
//! failed validation still saves its checkpoint; a failed save leaves the previous checkpoint
//! as `latest` and removes its own partial files.
use crate::batches::Batches;
use crate::logging::is_rank_zero;
use crate::nn::CausalLm;
use crate::progress::{report, Progress};
use crate::run_dir::{self, METRICS};
use crate::{AnyResult, Llama};
use anyhow::{bail, Context};
use ferrolm_data::chat::PackedData;
use ferrolm_data::{eval_batches, Batch, DataLoader};
use ferrolm_nn::optim::AdamWConfig;
use ferrolm_nn::safetensors_io::write_atomic;
use ferrolm_nn::schedule::CosineSchedule;
use ferrolm_ops::Tokens;
use ferrolm_parallel::zero::{Placement, Zero};
use ferrolm_parallel::TrainEngine;
use ferrolm_tensor::{no_grad, Device, Rng, Tensor};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// The marker rank 0 of a multi-process run writes into the output directory at start-up, and
/// the store key that carries its value (`Trainer::check_shared_out_dir`).
pub const SHARED_MARKER: &str = ".ferrolm-shared-marker";
const SHARED_MARKER_KEY: &str = "ferrolm/shared-marker";

/// The options that shape training (saved with every checkpoint and compared on resume).
/// `Default` is `pretrain_llama`'s defaults for 500 steps at lr 2e-3.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainOptions {
    pub steps: usize,
    pub batch_size: usize,
    pub seq_len: usize,
    pub grad_accum: usize,
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: usize,
    pub weight_decay: f64,
    pub grad_clip: f64,
    pub eval_every: usize,
    pub eval_batches: usize,
    pub save_every: usize,
    pub log_every: usize,
    pub seed: u64,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions::for_run(500, 2e-3)
    }
}

impl TrainOptions {
    /// A run of `steps` steps at peak rate `lr`: warmup over min(steps / 10 + 1, 25) steps, cosine
    /// to lr / 10, weight decay 0.1, clipping at 1.0 (the tools' schedule), batch 16 x 128.
    pub fn for_run(steps: usize, lr: f64) -> TrainOptions {
        TrainOptions {
            steps,
            batch_size: 16,
            seq_len: 128,
            grad_accum: 1,
            lr,
            min_lr: lr / 10.0,
            warmup_steps: (steps / 10 + 1).min(25),
            weight_decay: 0.1,
            grad_clip: 1.0,
            eval_every: 100,
            eval_batches: 20,
            save_every: 250,
            log_every: 25,
            seed: 1337,
        }
    }
    /// The batch shape, as the memory estimator reads it.
    pub fn shape(&self) -> crate::planner::memory::RunShape {
        crate::planner::memory::RunShape { batch_size: self.batch_size, seq_len: self.seq_len, grad_accum: self.grad_accum }
    }

    /// Sizes positive, rates finite and not negative, a micro-batch and a step of sizes that
    /// fit; a flag error (exit code 2) naming the flag.
    pub fn validate(&self) -> AnyResult<()> {
        use crate::errors::flag_error;
        for (flag, v) in
            [("--steps", self.steps), ("--batch-size", self.batch_size), ("--seq-len", self.seq_len), ("--grad-accum", self.grad_accum)]
        {
            if v == 0 {
                return Err(flag_error(format!("{flag} must be positive, got 0")));
            }
        }
        let Some(tokens) = self.batch_size.checked_mul(self.seq_len) else {
            return Err(flag_error(format!("--batch-size {} x --seq-len {} overflows", self.batch_size, self.seq_len)));
        };
        let max = ferrolm_data::MAX_BATCH_TOKENS;
        if tokens as u64 > max {
            return Err(flag_error(format!(
                "--batch-size {} x --seq-len {} is more than the {max} tokens a micro-batch may hold",
                self.batch_size, self.seq_len
            )));
        }
        // A step draws its --grad-accum micro-batches at once (`Batches::next_step`): their
        // tokens are held together, so a huge --grad-accum would fill the host's memory.
        if tokens.checked_mul(self.grad_accum).is_none_or(|t| t as u64 > max) {
            return Err(flag_error(format!(
                "--grad-accum {} x --batch-size {} x --seq-len {} is more than the {max} tokens a step may hold on a rank (its \
                 micro-batches are drawn together): lower --grad-accum",
                self.grad_accum, self.batch_size, self.seq_len
            )));
        }
        for (flag, v) in [("--lr", self.lr), ("min_lr", self.min_lr), ("weight_decay", self.weight_decay), ("grad_clip", self.grad_clip)] {
            if !v.is_finite() || v < 0.0 {
                return Err(flag_error(format!("{flag} must be a finite number >= 0, got {v}")));
            }
        }
        Ok(())
    }
}

/// How a run guards against losing work; see the module docs.
#[derive(Clone, Debug, PartialEq)]
pub struct RunSafety {
    /// Stop with an error after this many skipped (non-finite) steps in a row.
    pub max_skipped_steps: usize,
    /// Keep only the newest N complete checkpoints (0: keep all).
    pub keep_last: usize,
    /// Replace what a fresh run would otherwise refuse to write over (removed first, and logged).
    pub overwrite: bool,
}

impl Default for RunSafety {
    fn default() -> Self {
        RunSafety { max_skipped_steps: 5, keep_last: 0, overwrite: false }
    }
}

/// Where the current run continues from (set by [`Trainer::resume`]).
#[derive(Clone, Debug)]
pub(crate) struct Resumed {
    pub(crate) run_dir: Option<PathBuf>,
    pub(crate) step: usize,
    /// `metrics.jsonl` lines of the resumed run up to its step: the start of this run's file.
    pub(crate) metrics: Vec<String>,
}

/// What a trainer trains and validates on.
#[derive(Clone, Debug)]
pub enum TrainSet {
    /// Token shards: shuffled windows of `seq_len + 1` tokens, every token trained; validation
    /// over the windows of the `val` shards.
    Shards { train: Vec<PathBuf>, val: Vec<PathBuf> },
    /// Packed rows of tokenized conversations (`crate::batches`); validation over `val`'s
    /// conversations (one a row), each scored alone (none: no validation).
    Rows { train: Arc<PackedData>, val: Option<Arc<PackedData>> },
    /// Preference pairs (DPO, `crate::dpo`): `train` in a seeded order, validated on `val`'s
    /// pairs (none: no validation). The trainer needs its objective ([`Trainer::with_preference`]).
    Pairs { train: crate::batches::PairData, val: Option<Arc<Vec<ferrolm_data::preference::PreferencePair>>> },
}

/// What validation scores.
#[derive(Clone, Debug)]
pub(crate) enum Validation {
    Shards(Vec<PathBuf>),
    /// One conversation a row.
    Conversations(Arc<PackedData>),
    /// Preference pairs, packed into rows of `row_tokens`.
    Pairs {
        pairs: Arc<Vec<ferrolm_data::preference::PreferencePair>>,
        row_tokens: usize,
        pad_id: u32,
    },
    None,
}

/// Logs how many passes over the `rows` packed rows the run's steps make (`200 steps x 8 rows
/// = 1600 rows = 32.0 epochs of 50 packed rows`), and warns when one step draws more rows than
/// there are: the same rows then come back within every step.
fn log_epochs(rows: usize, opts: &TrainOptions, dp: usize) {
    let per_step = opts.batch_size.saturating_mul(opts.grad_accum).saturating_mul(dp);
    let total = opts.steps.saturating_mul(per_step);
    let epochs = if rows == 0 { 0.0 } else { total as f64 / rows as f64 };
    tracing::info!("{} steps x {per_step} rows = {total} rows = {epochs:.1} epochs of {rows} packed rows", opts.steps);
    if per_step > rows {
        tracing::warn!(
            "one step draws {per_step} rows (--batch-size {} x --grad-accum {} x {dp} data-parallel) but the data packs into \
             {rows} rows: every step holds the whole data {:.1} times over; lower --batch-size or --grad-accum, or give more data",
            opts.batch_size,
            opts.grad_accum,
            per_step as f64 / rows.max(1) as f64
        );
    }
}

pub struct Trainer<M: CausalLm = Llama> {
    /// The model trained: any [`CausalLm`] (the one decoder, `Llama`, for every family).
    pub model: M,
    pub opts: TrainOptions,
    pub safety: RunSafety,
    pub out_dir: PathBuf,
    pub step: usize,
    pub rng: Rng,
    /// Owns where the parameters and optimizer state live; a world of one on one device.
    pub(crate) engine: Box<dyn TrainEngine>,
    pub(crate) sched: CosineSchedule,
    pub(crate) batches: Batches,
    pub(crate) val: Validation,
    pub(crate) tokenizer_file: Option<PathBuf>,
    /// The tokenizer of `tokenizer_file`, read before the output directory is prepared (an
    /// `--overwrite` clearing may remove the file: it is never read again after that).
    pub(crate) tokenizer: Option<Arc<ferrolm_data::Tokenizer>>,
    /// With LoRA: the base model's path that checkpoints' `adapter_config.json` names.
    pub(crate) adapter_base: Option<String>,
    /// With LoRA: the base's identity, written beside the adapter (`lora_base::BASE_RECORD`).
    pub(crate) adapter_base_record: Option<crate::lora_base::BaseIdentity>,
    /// Written into every checkpoint with the tokenizer (`tokenizer_files`).
    pub(crate) chat_template: Option<String>,
    /// A fine-tune's source model: what its checkpoints keep of it (`checkpoint::SourceModel`).
    pub(crate) source: Option<Arc<crate::checkpoint::SourceModel>>,
    /// Real tokens trained on so far, every rank (padding not counted).
    pub(crate) tokens_seen: u64,
    /// Real tokens of the last step, every rank.
    pub(crate) last_step_tokens: u64,
    pub(crate) skipped_total: u64,
    pub(crate) skipped_in_a_row: usize,
    pub(crate) resumed: Option<Resumed>,
    /// The step this trainer last saved a checkpoint of.
    pub(crate) last_saved: std::cell::Cell<Option<usize>>,
    /// (step, training loss) of every step, restored from `metrics.jsonl` on resume.
    pub history: Vec<(f64, f64)>,
    /// (step, validation loss), restored the same way.
    pub val_history: Vec<(f64, f64)>,
    /// Whether the last step of `run` validates on the whole split ([`Trainer::with_final_validation`]).
    pub(crate) whole_final_val: bool,
    /// The validation at the last step of `run` (`final_validation`).
    pub(crate) final_val: Option<(usize, ValScore)>,
    /// Preference pairs: the objective and its reference (`crate::dpo`).
    pub preference: Option<crate::dpo::Preference>,
}

/// One validation: the mean loss over the tokens of the first `rows` of the split's `of` rows
/// (windows or conversations).
#[derive(Clone, Debug, PartialEq)]
pub struct ValScore {
    pub loss: f64,
    /// Tokens scored.
    pub tokens: usize,
    pub rows: usize,
    pub of: usize,
    /// What a row is: `"windows"`, `"conversations"` or `"pairs"`.
    pub unit: &'static str,
    /// Preference pairs: the metric sums under TRL's names.
    pub metrics: Option<ferrolm_nn::objective::preference::PreferenceMetrics>,
}

impl ValScore {
    /// For the log line: `all 1502 windows`, or `first 320 of 1502 windows` for a subset.
    pub fn describe(&self) -> String {
        if self.rows >= self.of {
            format!("all {} {}", self.of, self.unit)
        } else {
            format!("first {} of {} {}", self.rows, self.of, self.unit)
        }
    }
}

/// (B, T) i32 inputs and targets of one batch on `device`, with their host copies: the model
/// checks them (and counts the targets) on the host, so a micro-batch never reads the device.
pub fn batch_tensors(b: &Batch, device: Device) -> AnyResult<(Tokens, Tokens)> {
    let x = Tokens::upload(b.inputs.clone(), [b.batch, b.seq], device)?;
    let y = Tokens::upload(b.targets.clone(), [b.batch, b.seq], device)?;
    Ok((x, y))
}

/// Full `(seq_len + 1)`-token windows in `shards`: the validation split must hold at least one.
pub fn check_validation_data(shards: &[PathBuf], batch_size: usize, seq_len: usize) -> AnyResult<()> {
    if shards.is_empty() {
        bail!("no validation shards (val_*.bin): prepare the data with a validation fraction > 0");
    }
    let hint =
        || format!("the validation split holds no full window of --seq-len {seq_len} + 1 tokens: lower --seq-len or add validation data");
    let n = eval_batches(shards, batch_size, seq_len).with_context(hint)?.num_batches();
    if n == 0 {
        bail!(hint());
    }
    Ok(())
}

impl Trainer {
    /// The optimizer settings every engine uses.
    pub fn adamw_config(opts: &TrainOptions) -> AdamWConfig {
        AdamWConfig { weight_decay: opts.weight_decay, ..AdamWConfig::default() }
    }
}

impl<M: CausalLm> Trainer<M> {
    /// A trainer on one device: the sharded engine on a world of one. Checks the options (flags),
    /// that the batch fits in memory and, when it will be used, the validation split, before the
    /// loader or anything batch-sized is allocated.
    pub fn new(mut model: M, train_shards: &[PathBuf], val_shards: &[PathBuf], opts: TrainOptions, out_dir: &Path) -> AnyResult<Self> {
        opts.validate()?; // the memory check needs valid options; `with_engine` checks the rest
        let mut layout = crate::planner::memory::MemParallelism::single(model.activation_checkpointing());
        layout.lora = model.lora_config().map(|c| crate::planner::memory::LoraMem {
            quantized_base: model.quant_spec(),
            ..crate::planner::memory::LoraMem::new(c, model.config().num_hidden_layers)
        });
        layout.loss_chunks = model.head().2;
        crate::planner::memory::check_layout(model.config(), model.dtype(), model.device(), &opts.shape(), &layout)?;
        let engine = Zero::single(&mut model, Trainer::adamw_config(&opts), Placement::Device)?;
        Self::with_engine(model, Box::new(engine), train_shards, val_shards, opts, out_dir)
    }

    /// A trainer with an engine attached to `model` (`crate::parallel::attach`: on several
    /// ranks `model` holds this rank's shards). Every rank of the layout builds one and calls the
    /// same methods; each data-parallel rank reads its share of every batch, and rank 0 writes
    /// the files. The tools check the layout's memory before their ranks start.
    pub fn with_engine(
        model: M,
        engine: Box<dyn TrainEngine>,
        train_shards: &[PathBuf],
        val_shards: &[PathBuf],
        opts: TrainOptions,
        out_dir: &Path,
    ) -> AnyResult<Self> {
        let data = TrainSet::Shards { train: train_shards.to_vec(), val: val_shards.to_vec() };
        Self::with_engine_on(model, engine, &data, opts, out_dir)
    }

    /// [`Trainer::with_engine`] on any [`TrainSet`] (packed conversations, or shards).
    pub fn with_engine_on(model: M, engine: Box<dyn TrainEngine>, data: &TrainSet, opts: TrainOptions, out_dir: &Path) -> AnyResult<Self> {
        let val = match data {
            TrainSet::Shards { val, .. } => Validation::Shards(val.clone()),
            TrainSet::Rows { val: Some(v), .. } if v.num_rows() > 0 => Validation::Conversations(v.clone()),
            TrainSet::Rows { .. } => Validation::None,
            TrainSet::Pairs { train, val: Some(v) } if !v.is_empty() => {
                Validation::Pairs { pairs: v.clone(), row_tokens: train.row_tokens, pad_id: train.pad_id }
            }
            TrainSet::Pairs { .. } => Validation::None,
        };
        Self::check(&model, &val, &opts)?;
        let sched = CosineSchedule { max_lr: opts.lr, min_lr: opts.min_lr, warmup_steps: opts.warmup_steps, total_steps: opts.steps };
        let mesh = engine.mesh();
        let batches = match data {
            TrainSet::Shards { train, .. } => Batches::windows(
                DataLoader::open(train, opts.batch_size, opts.seq_len, opts.seed)
                    .context("cannot open the training split")?
                    .for_rank(mesh.dp_rank(), mesh.dp())
                    .context("cannot split the training data over the data-parallel ranks")?,
                mesh.dp(),
            ),
            TrainSet::Rows { train, .. } => {
                if train.seq_len() != opts.seq_len {
                    bail!("the rows are packed to {} tokens, but --seq-len is {}", train.seq_len(), opts.seq_len);
                }
                if crate::logging::is_rank_zero() {
                    log_epochs(train.num_rows(), &opts, mesh.dp());
                }
                Batches::rows(PackedData::clone(train), opts.batch_size, opts.seed, mesh.dp_rank(), mesh.dp())
                    .context("cannot order the training rows")?
            }
            TrainSet::Pairs { train, .. } => Batches::pairs(train.clone(), opts.batch_size, opts.seed, mesh.dp_rank(), mesh.dp())
                .context("cannot order the training pairs")?,
        };
        Ok(Trainer {
            model,
            rng: Rng::new(opts.seed),
            opts,
            safety: RunSafety::default(),
            out_dir: out_dir.to_path_buf(),
            step: 0,
            engine,
            sched,
            batches,
            val,
            tokenizer_file: None,
            tokenizer: None,
            adapter_base: None,
            adapter_base_record: None,
            chat_template: None,
            source: None,
            tokens_seen: 0,
            last_step_tokens: 0,
            skipped_total: 0,
            skipped_in_a_row: 0,
            resumed: None,
            last_saved: std::cell::Cell::new(None),
            history: Vec::new(),
            val_history: Vec::new(),
            whole_final_val: false,
            final_val: None,
            preference: None,
        })
    }

    fn check(model: &dyn crate::nn::CausalLm, val: &Validation, opts: &TrainOptions) -> AnyResult<()> {
        opts.validate()?;
        let maxpos = model.config().max_position_embeddings;
        if opts.seq_len > maxpos {
            bail!("--seq-len {} is longer than the model's max_position_embeddings ({maxpos})", opts.seq_len);
        }
        // Every run with validation data validates at its last step (`eval_every` 0: only then).
        if let (Validation::Shards(val), true) = (val, opts.steps > 0) {
            check_validation_data(val, opts.batch_size, opts.seq_len)?;
        }
        Ok(())
    }

    /// The tokenizer the data was prepared with: every checkpoint carries its Hugging Face files
    /// (`tokenizer_files::write_tokenizer_files`), so a checkpoint is self-contained.
    pub fn with_tokenizer(mut self, path: &Path) -> Self {
        self.tokenizer_file = Some(path.to_path_buf());
        self
    }

    /// With LoRA adapters: checkpoints hold the adapter in PEFT's format (not the model), for the
    /// base model at `base` (`adapter_config.json`'s `base_model_name_or_path`).
    pub fn with_adapter_base(mut self, base: &str) -> Self {
        self.adapter_base = Some(base.to_string());
        self
    }

    /// With LoRA adapters: every checkpoint also records the base's identity `id` beside the
    /// adapter (`ferrolm_base.json`), which `--resume`, `--lora-init`, `eval --lora`, `generate
    /// --lora` and `export --lora` check against the base they are given.
    pub fn with_adapter_base_record(mut self, id: crate::lora_base::BaseIdentity) -> Self {
        self.adapter_base_record = Some(id);
        self
    }

    /// The chat template every checkpoint carries with the tokenizer (`tokenizer_config.json`'s
    /// `chat_template` and `chat_template.jinja`).
    pub fn with_chat_template(mut self, template: String) -> Self {
        self.chat_template = Some(template);
        self
    }

    /// A fine-tune: checkpoints keep `source`'s config keys, store weights in its save dtype, and
    /// carry its tokenizer files when it has them (`checkpoint::SourceModel`).
    pub fn with_source(mut self, source: Arc<crate::checkpoint::SourceModel>) -> Self {
        self.source = Some(source);
        self
    }

    /// The last step of [`Trainer::run`] validates on the whole split, not the in-loop subset:
    /// that line (printed, and in `metrics.jsonl`) is then the run's final validation
    /// ([`Trainer::final_validation`]) and the same weights get one number. The tools' trainers
    /// do; a bare trainer (tests) keeps every validation to the subset.
    pub fn with_final_validation(mut self) -> Self {
        self.whole_final_val = true;
        self
    }

    /// Trains preference pairs ([`TrainSet::Pairs`]) with `objective` (`crate::dpo`).
    pub fn with_preference(mut self, objective: crate::dpo::Preference) -> Self {
        self.preference = Some(objective);
        self
    }

    pub fn with_safety(mut self, safety: RunSafety) -> Self {
        self.safety = safety;
        self
    }

    /// Real (not padding) tokens trained on so far, every rank: what `tok/s` counts.
    pub fn tokens_seen(&self) -> u64 {
        self.tokens_seen
    }

    /// Whether this run has validation data (conversations with `--val-fraction 0` and no
    /// `--val-data` have none).
    pub fn has_validation(&self) -> bool {
        !matches!(self.val, Validation::None)
    }

    /// Validation over the first `max_rows` rows of the split (all if 0): every token of its
    /// windows of `seq_len + 1` tokens, or the trained tokens of its conversations, each scored
    /// alone. The rows, and so the loss, do not depend on the layout: every rank scores the same
    /// rows with the whole model (its TP shard of it), `batch_size` a forward pass; only the
    /// rounding of the sum over batches differs (it is in f64).
    pub fn validation(&self, max_rows: usize) -> AnyResult<ValScore> {
        let _g = no_grad();
        let bs = self.opts.batch_size.max(1);
        let shards = match &self.val {
            Validation::Shards(s) => s,
            Validation::Conversations(rows) => {
                let of = rows.num_rows();
                let take = if max_rows > 0 { of.min(max_rows) } else { of };
                // conversations_loss scores its first `batches x bs` rows: `take` is a multiple
                // of bs unless it is the whole split.
                let s = crate::eval::conversations_loss(&self.model, rows, bs, take.div_ceil(bs), self.model.device())?;
                return Ok(ValScore { loss: s.loss, tokens: s.tokens, rows: take, of, unit: "conversations", metrics: None });
            }
            Validation::Pairs { pairs, row_tokens, pad_id } => {
                let of = pairs.len();
                let take = if max_rows > 0 { of.min(max_rows) } else { of };
                let obj = self.preference.as_ref().context("preference pairs need the trainer's preference objective")?;
                let (loss, m) = obj.validate(&self.model, pairs, take, bs, *row_tokens, *pad_id)?;
                let tokens = pairs[..take].iter().map(|p| p.chosen_len() + p.rejected_len()).sum();
                return Ok(ValScore { loss, tokens, rows: take, of, unit: "pairs", metrics: Some(m) });
            }
            Validation::None => bail!("this run has no validation data"),
        };
        let it = eval_batches(shards, bs, self.opts.seq_len).context("cannot open the validation split")?;
        let of = it.num_windows() as usize;
        let take = if max_rows > 0 { of.min(max_rows) } else { of };
        let bar = Progress::steps(take.div_ceil(bs) as u64, "eval ");
        let (mut sum, mut n, mut rows) = (0.0, 0usize, 0usize);
        for b in it.take(take.div_ceil(bs)) {
            let (x, y) = batch_tensors(&b, self.model.device())?;
            let tokens = b.batch * b.seq;
            sum += self.model.loss((&x).into(), (&y).into())?.item()? * tokens as f64;
            n += tokens;
            rows += b.batch;
            bar.inc(1);
        }
        if n == 0 {
            bail!("validation split holds no full window: lower --seq-len or add data");
        }
        Ok(ValScore { loss: sum / n as f64, tokens: n, rows, of, unit: "windows", metrics: None })
    }

    /// Mean validation loss over the first `max_rows` rows of the split (all if 0), as
    /// [`Trainer::validation`].
    pub fn evaluate(&self, max_rows: usize) -> AnyResult<f64> {
        Ok(self.validation(max_rows)?.loss)
    }

    /// The rows the in-loop validation scores (0: all): the first `eval_batches` global batches
    /// of the split (`eval_batches x batch_size x dp` rows: the same rows on every layout of the
    /// same global batch, whatever its TP, DP or ZeRO), and at the last step, with
    /// [`Trainer::with_final_validation`], all of them.
    pub fn in_loop_rows(&self, step: usize) -> usize {
        if (step >= self.opts.steps && self.whole_final_val) || self.opts.eval_batches == 0 {
            return 0;
        }
        self.opts.eval_batches.saturating_mul(self.opts.batch_size).saturating_mul(self.engine.mesh().dp())
    }

    /// The validation of the trained weights over the whole split: the one the last step of
    /// [`Trainer::run`] logged (printed, and written to `metrics.jsonl`), or, when that step
    /// did not run here, scored now.
    pub fn final_validation(&self) -> AnyResult<ValScore> {
        match &self.final_val {
            Some((step, v)) if *step == self.step && v.rows >= v.of => Ok(v.clone()),
            _ => self.validation(0),
        }
    }

    /// One optimizer step over `grad_accum` micro-batches: returns (loss, grad norm, lr).
    ///
    /// The loss and the gradient norm are checked before the update: when either is not
    /// finite the update is skipped (weights and optimizer state unchanged, the step and the
    /// data position still advance) with a warning, the values are returned as they were, and
    /// after `max_skipped_steps` such steps in a row this returns an error.
    pub fn train_step(&mut self) -> AnyResult<(f64, f64, f64)> {
        // The CUDA emulator's host-wait accounting counts this step's waits (FERROLM_EMU_REPORT).
        let _step = ferrolm_cuda::StepScope::begin();
        let accum = self.opts.grad_accum;
        let dp = self.engine.mesh().dp();
        let step = self.batches.next_step(accum, self.model.device())?;
        // Each micro-batch's weighted loss stays on the device; the step reads them once.
        let mut losses = Vec::with_capacity(accum);
        let mut metrics = ferrolm_nn::objective::preference::PreferenceMetrics::default();
        for (k, mb) in step.micro.iter().enumerate() {
            let model = &self.model;
            let scale = step.loss_scale(dp);
            let pref = self.preference.as_ref();
            let step = &step;
            self.engine.micro_batch(k + 1 == accum, &mut || {
                let loss = match (&mb.pairs, pref) {
                    (Some(pm), Some(obj)) => {
                        let (loss, m) = obj.micro_loss(model, pm, step, dp)?;
                        metrics.merge(&m);
                        loss
                    }
                    (Some(_), None) => ferrolm_tensor::bail!("train_step", "preference pairs need the trainer's preference objective"),
                    _ => mb.loss(model, scale)?,
                };
                losses.push(loss.detach().reshape([1])?);
                Ok(loss)
            })?;
        }
        if let Some(p) = self.preference.as_mut() {
            crate::dpo::reduce_metrics(&mut metrics, self.engine.mesh().dp_group().as_ref(), self.model.device())?;
            p.last = Some(metrics);
        }
        self.tokens_seen += step.tokens;
        self.last_step_tokens = step.tokens;
        // This rank's share of the step's loss, `dp` times over: the engine averages the ranks.
        let local_loss = Tensor::cat(&losses, 0)?.to_vec_f64()?.iter().sum::<f64>();
        let lr = self.sched.lr(self.step);
        self.step += 1;
        let r = self.engine.step(lr, self.opts.grad_clip, local_loss)?;
        let (loss, norm) = (r.loss, r.grad_norm);
        if !r.applied {
            self.skipped_total += 1;
            self.skipped_in_a_row += 1;
            tracing::warn!(
                "step {}: loss {loss}, gradient norm {norm}: skipping this update ({} in a row, the run stops at {})",
                self.step,
                self.skipped_in_a_row,
                self.safety.max_skipped_steps
            );
            if self.skipped_in_a_row >= self.safety.max_skipped_steps.max(1) {
                bail!(
                    "stopping at step {}: {} steps in a row had a non-finite loss or gradient norm (--max-skipped-steps {}); \
                     lower --lr, check the data, or resume from the last checkpoint",
                    self.step,
                    self.skipped_in_a_row,
                    self.safety.max_skipped_steps
                );
            }
            return Ok((loss, norm, lr));
        }
        self.skipped_in_a_row = 0;
        Ok((loss, norm, lr))
    }

    pub(crate) fn barrier(&self) -> AnyResult<()> {
        Ok(self.engine.mesh().world().barrier()?)
    }

    /// On several ranks: whether every rank succeeded at `what` (an error on the ranks that
    /// did not fail themselves when another did).
    pub(crate) fn agree(&self, ok: bool, what: &str) -> AnyResult<()> {
        let w = self.engine.mesh().world();
        // On the model's device: NCCL refuses a host tensor.
        let failed = ferrolm_parallel::comm::all_reduce_scalar(w.as_ref(), if ok { 0.0 } else { 1.0 }, self.model.device())?;
        if failed > 0.0 && ok {
            bail!("another rank could not {what}");
        }
        Ok(())
    }

    /// Before the first write: refuses (or with `overwrite` clears) what this run would write
    /// over, and starts `metrics.jsonl` (on resume: with the resumed run's lines up to its step).
    /// Every input is read before this: the tokenizer the checkpoints carry is loaded here, first,
    /// so that clearing never removes a file a later save needs.
    fn prepare_out_dir(&mut self) -> AnyResult<std::fs::File> {
        self.load_tokenizer()?;
        let out = &self.out_dir;
        let resumed = self.resumed.as_ref().map(|r| (r.run_dir.as_deref(), r.step));
        run_dir::check_out_dir(out, resumed, self.safety.overwrite)?;
        std::fs::create_dir_all(out).with_context(|| format!("cannot create the output directory {}", out.display()))?;
        if self.safety.overwrite {
            // Resumed in place: the resumed checkpoint and those before it stay (only newer ones
            // go). Resumed from another run: everything of the run in `out` goes, as for a new one.
            let in_place = self.resumed.as_ref().filter(|r| r.run_dir.as_deref().is_some_and(|d| run_dir::same_dir(d, out)));
            run_dir::clear_for_new_run(out, in_place.map(|r| r.step))?;
        }
        let metrics = out.join(METRICS);
        if let Some(r) = &self.resumed {
            let (_, later) = run_dir::read_metrics(out, r.step)?;
            if later > 0 {
                tracing::warn!("{}: dropping {later} line(s) after step {}, which this run repeats", metrics.display(), r.step);
            }
            let mut text = r.metrics.join("\n");
            if !text.is_empty() {
                text.push('\n');
            }
            write_atomic(&metrics, text.as_bytes())?;
        }
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&metrics)
            .with_context(|| format!("cannot open {} for writing", metrics.display()))
    }

    /// The tokenizer the checkpoints carry (`with_tokenizer`), read once.
    pub(crate) fn load_tokenizer(&mut self) -> AnyResult<Option<Arc<ferrolm_data::Tokenizer>>> {
        if let (None, Some(t)) = (&self.tokenizer, &self.tokenizer_file) {
            let tok = ferrolm_data::Tokenizer::from_file(t).with_context(|| format!("cannot load the tokenizer {}", t.display()))?;
            self.tokenizer = Some(Arc::new(tok));
        }
        Ok(self.tokenizer.clone())
    }

    /// A multi-process run (ranks meeting at a store, possibly on several nodes): every rank
    /// writes its checkpoint shards into the output directory and rank 0 joins them, so the
    /// directory must be one filesystem for all of them. Rank 0 writes a marker with a fresh
    /// value there and publishes the value through the store; every rank reads the marker back
    /// and the run stops at start-up, with that reason, when one cannot (instead of failing at
    /// the first save). Thread ranks share the process's filesystem: nothing to check.
    fn check_shared_out_dir(&self) -> AnyResult<()> {
        let Some(store) = ferrolm_parallel::env::world_store() else { return Ok(()) };
        let marker = self.out_dir.join(SHARED_MARKER);
        let rank = store.rank();
        let seen = if rank == 0 {
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
            let value = format!("{}-{nanos}", std::process::id());
            write_atomic(&marker, value.as_bytes())
                .map_err(anyhow::Error::from)
                .and_then(|()| Ok(store.set(SHARED_MARKER_KEY, value.as_bytes())?))
                .with_context(|| format!("cannot write the marker {}", marker.display()))
        } else {
            (|| -> AnyResult<()> {
                let value = store.get(SHARED_MARKER_KEY).context("waiting for rank 0's marker value")?;
                let not_shared = ": checkpoints of a multi-node run need a filesystem shared by all ranks (give every node the same --out on shared storage)";
                match std::fs::read(&marker) {
                    Ok(b) if b == value => Ok(()),
                    Ok(_) => bail!(
                        "rank {rank}: {} holds another run's marker, not the one rank 0 just wrote: the output directory {} is not the one rank 0 sees{not_shared}",
                        marker.display(),
                        self.out_dir.display()
                    ),
                    Err(e) => bail!(
                        "rank {rank}: cannot read the marker {} that rank 0 wrote ({e}): the output directory {} is not shared with rank 0{not_shared}",
                        marker.display(),
                        self.out_dir.display()
                    ),
                }
            })()
        };
        self.agree(seen.is_ok(), &format!("see the output directory {} that rank 0 prepared (it is not shared)", self.out_dir.display()))?;
        seen?;
        if rank == 0 {
            // Every rank has read it (agree is a collective after the reads).
            let _ = std::fs::remove_file(&marker);
        }
        Ok(())
    }

    /// Trains to `opts.steps`, logging, evaluating and checkpointing on the way. With the kernel
    /// profile on (`FERROLM_PROFILE=1`, `--profile`), prints its table at the end, failed or not,
    /// and writes it as `profile.json` in the run directory (`crate::profile`).
    pub fn run(&mut self) -> AnyResult<()> {
        let r = self.run_steps();
        if ferrolm_cuda::profile::enabled() {
            if let Err(e) = crate::profile::finish(&self.out_dir) {
                tracing::warn!("kernel profile: {e:#}");
            }
        }
        r
    }

    fn run_steps(&mut self) -> AnyResult<()> {
        // Rank 0 owns the output directory; the others wait until it is ready.
        let mut log = if is_rank_zero() { Some(self.prepare_out_dir()) } else { None };
        let ready = log.as_ref().is_none_or(|r| r.is_ok());
        self.agree(ready, &format!("prepare the output directory {}", self.out_dir.display()))?;
        let mut log = log.take().transpose()?;
        self.check_shared_out_dir()?;
        if let (true, Some(crate::dpo::Preference { reference: crate::dpo::Reference::Precomputed(r), .. })) =
            (is_rank_zero(), &self.preference)
        {
            r.write(&self.out_dir)?; // beside checkpoints/: what --resume reuses
        }
        let mut write_line = |v: serde_json::Value| -> AnyResult<()> {
            match &mut log {
                Some(log) => writeln!(log, "{v}").and_then(|()| log.flush()).context("cannot append to metrics.jsonl"),
                None => Ok(()),
            }
        };
        let start = Instant::now();
        let (start_step, tokens0) = (self.step, self.tokens_seen);
        let dp = self.engine.mesh().dp();
        let bar = Progress::steps(self.opts.steps as u64, "train");
        bar.start_at(self.step as u64);
        while self.step < self.opts.steps {
            let t0 = Instant::now();
            let (loss, norm, lr) = self.train_step()?;
            let skipped = !loss.is_finite() || !norm.is_finite();
            let dt = t0.elapsed().as_secs_f64();
            let elapsed = start.elapsed().as_secs_f64();
            let done = self.step - start_step;
            let tok_s = (self.tokens_seen - tokens0) as f64 / elapsed.max(1e-9);
            let eta = elapsed / done as f64 * (self.opts.steps - self.step) as f64;
            let peak_mib = ferrolm_tensor::peak_bytes() as f64 / (1 << 20) as f64;
            // One device's utilisation: its share of the tokens (its parameters are its
            // tensor-parallel share already).
            let mfu = self.mfu(tok_s / dp as f64);
            if skipped {
                write_line(serde_json::json!({"step": self.step, "skipped": true, "lr": lr}))?;
            } else {
                self.history.push((self.step as f64, loss));
                let mut line = serde_json::json!({"step": self.step, "loss": loss, "lr": lr, "grad_norm": norm,
                "tokens_per_s": self.last_step_tokens as f64 / dt.max(1e-9), "elapsed_s": elapsed, "peak_tensor_mib": peak_mib, "mfu": mfu});
                if let Some(m) = self.preference.as_ref().and_then(|p| p.last.as_ref()) {
                    for (k, v) in m.means() {
                        line[k] = serde_json::json!(v);
                    }
                }
                write_line(line)?;
            }
            bar.set_position(self.step as u64);
            bar.set_message(format!("loss {loss:.4}"));
            if self.step.is_multiple_of(self.opts.log_every.max(1)) || self.step == self.opts.steps || self.step == start_step + 1 {
                let dev = match mfu {
                    Some(m) => format!(" | MFU {:.1}% | peak mem {peak_mib:.0} MiB", m * 100.0),
                    None => String::new(),
                };
                let pref = match self.preference.as_ref().and_then(|p| p.last.as_ref()) {
                    Some(m) => format!(" | {}", crate::dpo::describe(m)),
                    None => String::new(),
                };
                report(&format!(
                    "step {:>5}/{} | loss {loss:.4}{pref} | lr {lr:.2e} | grad norm {norm:.3} | {tok_s:.0} tok/s{dev} | ETA {}",
                    self.step,
                    self.opts.steps,
                    fmt_secs(eta)
                ));
            }
            let last = self.step == self.opts.steps;
            let mut eval_error = None;
            // `--eval-every 0` means only at the end, as its help says.
            let due = last || (self.opts.eval_every > 0 && self.step.is_multiple_of(self.opts.eval_every));
            if due && self.has_validation() {
                match self.validation(self.in_loop_rows(self.step)) {
                    Ok(v) => {
                        self.val_history.push((self.step as f64, v.loss));
                        let mut line = serde_json::json!({"step": self.step, "val_loss": v.loss, "val_tokens": v.tokens});
                        let mut pref = String::new();
                        if let Some(m) = &v.metrics {
                            for (k, x) in m.means() {
                                line[format!("val_{k}")] = serde_json::json!(x);
                            }
                            pref = format!(" | {}", crate::dpo::describe(m));
                        }
                        write_line(line)?;
                        report(&format!("step {:>5}/{} | val loss {:.4}{pref} ({})", self.step, self.opts.steps, v.loss, v.describe()));
                        if last {
                            self.final_val = Some((self.step, v));
                        }
                    }
                    Err(e) => eval_error = Some(e),
                }
            }
            // A failed validation must not cost the checkpoint of this step: save, then report.
            if (self.opts.save_every > 0 && self.step.is_multiple_of(self.opts.save_every)) || last || eval_error.is_some() {
                let dir = self.save_checkpoint()?;
                report(&format!("saved checkpoint {}", dir.display()));
                self.plot();
            }
            if let Some(e) = eval_error {
                return Err(e.context(format!("validation at step {} failed (the checkpoint of this step was saved)", self.step)));
            }
        }
        drop(bar);
        self.plot();
        Ok(())
    }

    /// Model FLOPs utilisation on CUDA: (6 N + 12 L T d_attn) FLOPs per token (PaLM's count; a
    /// layer with a sliding window w < T counts its share of the keys, about 2w / T)
    /// over the bf16 dense peak, `FERROLM_PEAK_TFLOPS` or 989 (H100/H200 SXM); with LoRA the
    /// frozen weights count 4 FLOPs each (forward, input gradient) and the adapters 6. None on
    /// CPU and on the emulated CUDA device.
    fn mfu(&self, tokens_per_s: f64) -> Option<f64> {
        let Device::Cuda(i) = self.model.device() else { return None };
        if ferrolm_cuda::CudaBackend::latest(i).is_none_or(|b| b.is_emulated()) {
            return None; // the CPU emulator: a GPU utilisation figure would be meaningless
        }
        let c = self.model.config();
        // A sliding layer scores each query against its window only (`planner::shape::window_share`).
        let t = self.opts.seq_len;
        let attn = c.layer_windows().iter().map(|&w| crate::planner::shape::window_share(w, t)).sum::<f64>()
            * 12.0
            * (t * c.num_attention_heads * c.head_dim) as f64;
        let adapters: usize = self.model.adapters().iter().map(|(_, t)| t.numel()).sum();
        let frozen = if adapters > 0 { 4.0 } else { 6.0 };
        let per_token = frozen * self.model.num_params() as f64 + 6.0 * adapters as f64 + attn;
        let peak = std::env::var("FERROLM_PEAK_TFLOPS").ok().and_then(|v| v.parse::<f64>().ok()).unwrap_or(989.0) * 1e12;
        Some(per_token * tokens_per_s / peak)
    }

    /// `loss.png` from the whole history (restored on resume). A failed plot is a warning: the
    /// curve is never worth a run.
    fn plot(&self) {
        if !is_rank_zero() {
            return;
        }
        let chart = crate::plot::Chart {
            title: "loss",
            x_label: "step",
            y_label: "loss (nats/token)",
            series: vec![
                crate::plot::Series { points: &self.history, rgb: [31, 119, 180], label: "train" },
                crate::plot::Series { points: &self.val_history, rgb: [214, 39, 40], label: "validation" },
            ],
        };
        let path = self.out_dir.join(run_dir::LOSS_PNG);
        if let Err(e) = chart.write_png(&path, 640, 400) {
            tracing::warn!("cannot write {}: {e}", path.display());
        }
    }
}

pub use crate::checkpoint::{config_diff, option_changes, resolve_checkpoint};

fn fmt_secs(s: f64) -> String {
    if !s.is_finite() {
        return "?".into();
    }
    let s = s.round() as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, s / 60 % 60)
    } else {
        format!("{}m{:02}s", s / 60, s % 60)
    }
}

/// Entropy (nats) of the unigram distribution of `tokens`: the loss of a model that knows
/// only token frequencies. A trained model must beat it clearly.
pub fn unigram_entropy(tokens: impl Iterator<Item = u32>) -> f64 {
    let mut counts = std::collections::HashMap::new();
    let mut n = 0u64;
    for t in tokens {
        *counts.entry(t).or_insert(0u64) += 1;
        n += 1;
    }
    counts
        .values()
        .map(|&c| {
            let p = c as f64 / n as f64;
            -p * p.ln()
        })
        .sum()
}
