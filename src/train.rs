//! The training loop shared by the training tools: gradient accumulation, AdamW with
//! warmup+cosine, global-norm clipping, periodic validation, JSONL metrics, progress, and atomic
//! checkpoints (Hugging Face layout + training state) that resume bit-exactly.
//!
//! It never loses work: a directory holding a run is not written over without `overwrite`; a
//! step whose loss or gradient norm is not finite is skipped before the update (and the run
//! stops after `max_skipped_steps` in a row); weights that are not finite are never saved; a
//! failed validation still saves its checkpoint; a failed save leaves the previous checkpoint
//! as `latest` and removes its own partial files.
use crate::logging::is_rank_zero;
use crate::parallel::DistEngine;
use crate::progress::{report, Progress};
use crate::run_dir::{self, checkpoint_name, sync_dir, CHECKPOINTS, LATEST, METRICS, TRAINER_STATE};
use crate::{AnyResult, Llama};
use anyhow::{anyhow, bail, Context};
use ferrolm_data::{eval_batches, Batch, DataLoader, LoaderState};
use ferrolm_nn::checkpoint::{load_safetensors, save_safetensors, write_atomic};
use ferrolm_nn::optim::{clip_grad_norm, AdamW, AdamWConfig};
use ferrolm_nn::schedule::CosineSchedule;
use ferrolm_nn::LlamaConfig;
use ferrolm_tensor::{no_grad, DType, Device, Rng, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The options that shape training (saved with every checkpoint and compared on resume).
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

impl TrainOptions {
    /// Sizes positive, rates finite and not negative; the error names the flag.
    pub fn validate(&self) -> AnyResult<()> {
        for (flag, v) in
            [("--steps", self.steps), ("--batch-size", self.batch_size), ("--seq-len", self.seq_len), ("--grad-accum", self.grad_accum)]
        {
            if v == 0 {
                bail!("{flag} must be positive, got 0");
            }
        }
        let Some(tokens) = self.batch_size.checked_mul(self.seq_len) else {
            bail!("--batch-size {} x --seq-len {} overflows", self.batch_size, self.seq_len);
        };
        if tokens as u64 > ferrolm_data::MAX_BATCH_TOKENS {
            bail!(
                "--batch-size {} x --seq-len {} is more than the {} tokens a micro-batch may hold",
                self.batch_size,
                self.seq_len,
                ferrolm_data::MAX_BATCH_TOKENS
            );
        }
        for (flag, v) in [("--lr", self.lr), ("min_lr", self.min_lr), ("weight_decay", self.weight_decay), ("grad_clip", self.grad_clip)] {
            if !v.is_finite() || v < 0.0 {
                bail!("{flag} must be a finite number >= 0, got {v}");
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

#[derive(Serialize, Deserialize)]
struct TrainerState {
    step: usize,
    loader: LoaderState,
    rng: u64,
    options: TrainOptions,
    tokens_seen: u64,
    /// Steps whose update was skipped: AdamW's own step count is `step - skipped_steps`.
    #[serde(default)]
    skipped_steps: u64,
}

/// Where the current run continues from (set by [`Trainer::resume`]).
#[derive(Clone, Debug)]
struct Resumed {
    run_dir: Option<PathBuf>,
    step: usize,
    /// `metrics.jsonl` lines of the resumed run up to its step: the start of this run's file.
    metrics: Vec<String>,
}

/// What updates the weights: AdamW on one device, or the tensor-/data-parallel engine.
enum Engine {
    Single(AdamW),
    Dist(Box<DistEngine>),
}

pub struct Trainer {
    pub model: Llama,
    pub opts: TrainOptions,
    pub safety: RunSafety,
    pub out_dir: PathBuf,
    pub step: usize,
    pub rng: Rng,
    engine: Engine,
    sched: CosineSchedule,
    loader: DataLoader,
    val_shards: Vec<PathBuf>,
    tokenizer_file: Option<PathBuf>,
    tokens_seen: u64,
    skipped_total: u64,
    skipped_in_a_row: usize,
    resumed: Option<Resumed>,
    /// The step this trainer last saved a checkpoint of.
    last_saved: std::cell::Cell<Option<usize>>,
    /// (step, training loss) of every step, restored from `metrics.jsonl` on resume.
    pub history: Vec<(f64, f64)>,
    /// (step, validation loss), restored the same way.
    pub val_history: Vec<(f64, f64)>,
    /// Test hook: the checkpoint file whose write fails (as a full disk would), e.g.
    /// `Some("optimizer.safetensors".into())`.
    #[doc(hidden)]
    pub fail_checkpoint_file: Option<String>,
}

/// (B, T) i32 tensors for one batch on `device`.
pub fn batch_tensors(b: &Batch, device: Device) -> AnyResult<(Tensor, Tensor)> {
    let x = Tensor::from_vec(b.inputs.clone(), [b.batch, b.seq], device)?;
    let y = Tensor::from_vec(b.targets.clone(), [b.batch, b.seq], device)?;
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
    /// Checks the options (flags), that the batch fits in memory and, when it will be used, the
    /// validation split, before the loader or anything batch-sized is allocated.
    pub fn new(model: Llama, train_shards: &[PathBuf], val_shards: &[PathBuf], opts: TrainOptions, out_dir: &Path) -> AnyResult<Trainer> {
        Self::build(model, None, train_shards, val_shards, opts, out_dir)
    }

    /// A trainer on several ranks: `model` holds this rank's shards, `dist` was attached to it
    /// (`DistEngine::attach`). Every rank of the layout builds one and calls the same methods;
    /// each data-parallel rank reads its share of every batch, and rank 0 writes the files.
    pub fn new_distributed(
        model: Llama,
        dist: DistEngine,
        train_shards: &[PathBuf],
        val_shards: &[PathBuf],
        opts: TrainOptions,
        out_dir: &Path,
    ) -> AnyResult<Trainer> {
        Self::build(model, Some(dist), train_shards, val_shards, opts, out_dir)
    }

    /// The optimizer settings every engine uses.
    pub fn adamw_config(opts: &TrainOptions) -> AdamWConfig {
        AdamWConfig { weight_decay: opts.weight_decay, ..AdamWConfig::default() }
    }

    fn build(
        model: Llama,
        dist: Option<DistEngine>,
        train_shards: &[PathBuf],
        val_shards: &[PathBuf],
        opts: TrainOptions,
        out_dir: &Path,
    ) -> AnyResult<Trainer> {
        opts.validate()?;
        let maxpos = model.config().max_position_embeddings;
        if opts.seq_len > maxpos {
            bail!("--seq-len {} is longer than the model's max_position_embeddings ({maxpos})", opts.seq_len);
        }
        // A distributed run was checked for its layout before its ranks started (the tools'
        // `MemLayout::from_flags`); here, one device's whole model.
        if dist.is_none() {
            crate::memory::check_fits(model.config(), model.dtype(), model.device(), &opts, model.activation_checkpointing())?;
        }
        // Every run validates at its last step (`eval_every` 0 means only then).
        if opts.steps > 0 {
            check_validation_data(val_shards, opts.batch_size, opts.seq_len)?;
        }
        let sched = CosineSchedule { max_lr: opts.lr, min_lr: opts.min_lr, warmup_steps: opts.warmup_steps, total_steps: opts.steps };
        let mut loader =
            DataLoader::open(train_shards, opts.batch_size, opts.seq_len, opts.seed).context("cannot open the training split")?;
        let engine = match dist {
            None => Engine::Single(AdamW::new(&model.parameters(), Self::adamw_config(&opts))?),
            Some(d) => {
                loader = loader
                    .for_rank(d.mesh.dp_rank(), d.mesh.dp())
                    .context("cannot split the training data over the data-parallel ranks")?;
                Engine::Dist(Box::new(d))
            }
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
            loader,
            val_shards: val_shards.to_vec(),
            tokenizer_file: None,
            tokens_seen: 0,
            skipped_total: 0,
            skipped_in_a_row: 0,
            resumed: None,
            last_saved: std::cell::Cell::new(None),
            history: Vec::new(),
            val_history: Vec::new(),
            fail_checkpoint_file: None,
        })
    }

    /// Copies this tokenizer.json into every checkpoint so a checkpoint is self-contained.
    pub fn with_tokenizer(mut self, path: &Path) -> Self {
        self.tokenizer_file = Some(path.to_path_buf());
        self
    }

    pub fn with_safety(mut self, safety: RunSafety) -> Self {
        self.safety = safety;
        self
    }

    /// Mean validation loss over at most `max_batches` batches (all if 0).
    pub fn evaluate(&self, max_batches: usize) -> AnyResult<f64> {
        let _g = no_grad();
        let it = eval_batches(&self.val_shards, self.opts.batch_size, self.opts.seq_len).context("cannot open the validation split")?;
        let total = if max_batches > 0 { it.num_batches().min(max_batches) } else { it.num_batches() };
        let bar = Progress::steps(total as u64, "eval ");
        let (mut sum, mut n) = (0.0, 0usize);
        for b in it.take(total) {
            let (x, y) = batch_tensors(&b, self.model.device())?;
            let rows = b.batch * b.seq;
            sum += self.model.loss(&x, &y)?.item()? * rows as f64;
            n += rows;
            bar.inc(1);
        }
        if n == 0 {
            bail!("validation split holds no full window: lower --seq-len or add data");
        }
        Ok(sum / n as f64)
    }

    /// One optimizer step over `grad_accum` micro-batches: returns (loss, grad norm, lr).
    ///
    /// The loss and the gradient norm are checked before the update: when either is not
    /// finite the update is skipped (weights and optimizer state unchanged, the step and the
    /// data position still advance) with a warning, the values are returned as they were, and
    /// after `max_skipped_steps` such steps in a row this returns an error.
    pub fn train_step(&mut self) -> AnyResult<(f64, f64, f64)> {
        let (loss, norm) = match &mut self.engine {
            Engine::Single(opt) => {
                let params = self.model.parameters();
                opt.zero_grad();
                let mut loss_sum = 0.0;
                for _ in 0..self.opts.grad_accum {
                    let b = self.loader.next_batch();
                    let (x, y) = batch_tensors(&b, self.model.device())?;
                    let loss = self.model.loss(&x, &y)?;
                    loss_sum += loss.item()?;
                    loss.mul_scalar(1.0 / self.opts.grad_accum as f64)?.backward()?;
                    self.tokens_seen += (b.batch * b.seq) as u64;
                }
                (loss_sum / self.opts.grad_accum as f64, clip_grad_norm(&params, self.opts.grad_clip)?)
            }
            Engine::Dist(d) => {
                let accum = self.opts.grad_accum;
                let mut loss_sum = 0.0;
                for k in 0..accum {
                    let b = self.loader.next_batch();
                    let (x, y) = batch_tensors(&b, self.model.device())?;
                    d.zero.begin_forward()?;
                    let loss = self.model.loss(&x, &y)?;
                    loss_sum += loss.item()?;
                    d.zero.begin_backward(k + 1 == accum)?;
                    loss.mul_scalar(1.0 / accum as f64)?.backward()?;
                    d.zero.end_backward()?;
                    self.tokens_seen += (b.batch * b.seq * d.mesh.dp()) as u64;
                }
                // The step's loss over every data-parallel rank (the same decision on each).
                let dp = d.mesh.dp_group();
                let loss =
                    ferrolm_dist::comm::all_reduce_scalar(dp.as_ref(), loss_sum / accum as f64, self.model.device())? / dp.size() as f64;
                (loss, f64::NAN) // the norm comes with the update below
            }
        };
        let lr = self.sched.lr(self.step);
        self.step += 1;
        // Check the loss (and on one device the norm) before any update.
        let norm = match &mut self.engine {
            Engine::Single(opt) => {
                if loss.is_finite() && norm.is_finite() {
                    opt.step(lr)?;
                }
                opt.zero_grad();
                norm
            }
            Engine::Dist(d) => {
                if loss.is_finite() {
                    d.zero.step(lr, self.opts.grad_clip)? // skips the update itself when the norm is not finite
                } else {
                    d.zero.discard()?;
                    f64::NAN
                }
            }
        };
        if !loss.is_finite() || !norm.is_finite() {
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

    /// This rank's world communicator and rank when distributed.
    fn world(&self) -> Option<&std::sync::Arc<dyn ferrolm_dist::Communicator>> {
        match &self.engine {
            Engine::Dist(d) => Some(d.mesh.world()),
            Engine::Single(_) => None,
        }
    }

    fn barrier(&self) -> AnyResult<()> {
        if let Some(w) = self.world() {
            w.barrier()?;
        }
        Ok(())
    }

    /// Before the first write: refuses (or with `overwrite` clears) what this run would write
    /// over, and starts `metrics.jsonl` (on resume: with the resumed run's lines up to its step).
    fn prepare_out_dir(&self) -> AnyResult<std::fs::File> {
        let out = &self.out_dir;
        let resumed = self.resumed.as_ref().map(|r| (r.run_dir.as_deref(), r.step));
        run_dir::check_out_dir(out, resumed, self.safety.overwrite)?;
        std::fs::create_dir_all(out).with_context(|| format!("cannot create the output directory {}", out.display()))?;
        if self.safety.overwrite {
            run_dir::clear_for_new_run(out, self.resumed.as_ref().map(|r| r.step))?;
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

    /// Trains to `opts.steps`, logging, evaluating and checkpointing on the way.
    pub fn run(&mut self) -> AnyResult<()> {
        // Rank 0 owns the output directory; the others wait until it is ready.
        let mut log = if is_rank_zero() { Some(self.prepare_out_dir()) } else { None };
        let ready = log.as_ref().is_none_or(|r| r.is_ok());
        self.agree(ready, &format!("prepare the output directory {}", self.out_dir.display()))?;
        let mut log = log.take().transpose()?;
        let mut write_line = |v: serde_json::Value| -> AnyResult<()> {
            match &mut log {
                Some(log) => writeln!(log, "{v}").and_then(|()| log.flush()).context("cannot append to metrics.jsonl"),
                None => Ok(()),
            }
        };
        let start = Instant::now();
        let (start_step, tokens0) = (self.step, self.tokens_seen);
        // Tokens per step over every data-parallel rank, like `tokens_seen`.
        let dp = match &self.engine {
            Engine::Dist(d) => d.mesh.dp(),
            Engine::Single(_) => 1,
        };
        let step_tokens = (self.opts.batch_size * self.opts.seq_len * self.opts.grad_accum * dp) as f64;
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
                write_line(serde_json::json!({"step": self.step, "loss": loss, "lr": lr, "grad_norm": norm,
                "tokens_per_s": step_tokens / dt.max(1e-9), "elapsed_s": elapsed, "peak_tensor_mib": peak_mib, "mfu": mfu}))?;
            }
            bar.set_position(self.step as u64);
            bar.set_message(format!("loss {loss:.4}"));
            if self.step.is_multiple_of(self.opts.log_every.max(1)) || self.step == self.opts.steps || self.step == start_step + 1 {
                let dev = match mfu {
                    Some(m) => format!(" | MFU {:.1}% | peak mem {peak_mib:.0} MiB", m * 100.0),
                    None => String::new(),
                };
                report(&format!(
                    "step {:>5}/{} | loss {loss:.4} | lr {lr:.2e} | grad norm {norm:.3} | {tok_s:.0} tok/s{dev} | ETA {}",
                    self.step,
                    self.opts.steps,
                    fmt_secs(eta)
                ));
            }
            let last = self.step == self.opts.steps;
            let mut eval_error = None;
            // `--eval-every 0` means only at the end, as its help says.
            if last || (self.opts.eval_every > 0 && self.step.is_multiple_of(self.opts.eval_every)) {
                match self.evaluate(self.opts.eval_batches) {
                    Ok(v) => {
                        self.val_history.push((self.step as f64, v));
                        write_line(serde_json::json!({"step": self.step, "val_loss": v}))?;
                        report(&format!("step {:>5}/{} | val loss {v:.4}", self.step, self.opts.steps));
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

    /// Model FLOPs utilisation on CUDA: (6 N + 12 L T d_attn) FLOPs per token (PaLM's count)
    /// over the bf16 dense peak, `FERROLM_PEAK_TFLOPS` or 989 (H100/H200 SXM). None on CPU and
    /// on the emulated CUDA device.
    fn mfu(&self, tokens_per_s: f64) -> Option<f64> {
        let Device::Cuda(i) = self.model.device() else { return None };
        if ferrolm_cuda::CudaBackend::latest(i).is_none_or(|b| b.is_emulated()) {
            return None; // the CPU emulator: a GPU utilisation figure would be meaningless
        }
        let c = self.model.config();
        let attn = 12.0 * (c.num_hidden_layers * self.opts.seq_len * c.num_attention_heads * c.head_dim) as f64;
        let per_token = 6.0 * self.model.num_params() as f64 + attn;
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

    /// The first tensor holding a NaN or an infinity, if any. x * 0 is 0 for finite x and NaN
    /// otherwise, so one device-side sum over all tensors (one host sync) answers the common
    /// case; only when it is not finite are the tensors checked one by one to name the culprit.
    fn non_finite_tensor(tensors: &[&(String, Tensor)]) -> AnyResult<Option<String>> {
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
            if !probe(t)?.item()?.is_finite() {
                return Ok(Some(name.clone()));
            }
        }
        Ok(Some("(a sum of finite tensors)".into()))
    }

    /// Writes `checkpoints/step-NNNNNN/` through a temporary directory, fsyncs it, renames it
    /// into place, fsyncs `checkpoints/`, then points `checkpoints/latest` at it and prunes to
    /// `keep_last`. Refuses weights that are not finite and a step directory that exists. A
    /// failure midway removes the partial directory and leaves `latest` on the previous one.
    ///
    /// On several ranks every rank calls it: each writes its own shards (`shards/`), then rank 0
    /// joins them into the Hugging Face `model.safetensors` and finishes the directory.
    pub fn save_checkpoint(&self) -> AnyResult<PathBuf> {
        let name = checkpoint_name(self.step);
        // Every tensor the checkpoint stores, as this rank holds it.
        let (params, state) = match &self.engine {
            Engine::Single(opt) => (self.model.parameters(), opt.state_tensors()),
            Engine::Dist(d) => (Vec::new(), d.zero.shard_tensors()?),
        };
        let all: Vec<&(String, Tensor)> = params.iter().chain(&state).collect();
        let bad = Self::non_finite_tensor(&all)?;
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
        let prepared = if is_rank_zero() {
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
        let shards = match &self.engine {
            Engine::Dist(d) => ferrolm_dist::ckpt::save_shards(&tmp, &d.zero, d.tp.as_ref(), &d.mesh).map_err(anyhow::Error::from),
            Engine::Single(_) => Ok(()),
        };
        let old = root.join(format!(".{name}.old"));
        let finished = shards.and_then(|()| {
            if !is_rank_zero() {
                return Ok(());
            }
            self.write_checkpoint_files(&tmp, &state).and_then(|()| {
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
            if is_rank_zero() {
                let _ = std::fs::remove_dir_all(&tmp);
            }
            let kept = match previous {
                Some(p) => format!("latest still names {p}, which is intact"),
                None => "no earlier checkpoint exists".to_string(),
            };
            return Err(e.context(format!("saving checkpoint {name} failed; its partial files were removed and {kept}")));
        }
        self.last_saved.set(Some(self.step));
        if is_rank_zero() {
            write_atomic(&root.join(LATEST), name.as_bytes())?;
            sync_dir(&root)?;
            for old in run_dir::prune(&root, self.safety.keep_last)? {
                tracing::info!("removed old checkpoint {} (--keep-last {})", old.display(), self.safety.keep_last);
            }
        }
        self.barrier()?;
        Ok(dst)
    }

    /// On several ranks: whether every rank succeeded at `what` (an error on the ranks that
    /// did not fail themselves when another did).
    fn agree(&self, ok: bool, what: &str) -> AnyResult<()> {
        let Some(w) = self.world() else { return Ok(()) };
        // On the model's device: NCCL refuses a host tensor.
        let failed = ferrolm_dist::comm::all_reduce_scalar(w.as_ref(), if ok { 0.0 } else { 1.0 }, self.model.device())?;
        if failed > 0.0 && ok {
            bail!("another rank could not {what}");
        }
        Ok(())
    }

    fn write_checkpoint_files(&self, tmp: &Path, state: &[(String, Tensor)]) -> AnyResult<()> {
        let fault = |file: &str| -> AnyResult<()> {
            match &self.fail_checkpoint_file {
                Some(f) if f == file => Err(anyhow!(std::io::Error::from(std::io::ErrorKind::StorageFull)))
                    .with_context(|| format!("cannot write {}", tmp.join(file).display())),
                _ => Ok(()),
            }
        };
        std::fs::create_dir_all(tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        fault("model.safetensors")?;
        match &self.engine {
            Engine::Single(_) => {
                self.model.save_pretrained(tmp)?;
                fault("optimizer.safetensors")?;
                save_safetensors(&tmp.join("optimizer.safetensors"), state, None)?;
            }
            Engine::Dist(_) => {
                // The Hugging Face model, joined from the shards every rank just wrote.
                let (params, _) = ferrolm_dist::ckpt::load_full(tmp)?;
                let named: Vec<(String, Tensor)> = params.into_iter().collect();
                let path = ferrolm_nn::checkpoint::prepare_dir(tmp, "model.safetensors")?;
                save_safetensors(&path, &named, Some(DType::F32))?;
                write_atomic(&tmp.join("config.json"), self.model.config().to_json_string_dtype("float32").as_bytes())?;
            }
        }
        if let Some(t) = &self.tokenizer_file {
            fault("tokenizer.json")?;
            let dst = tmp.join("tokenizer.json");
            std::fs::copy(t, &dst).with_context(|| format!("cannot copy {} into the checkpoint", t.display()))?;
            std::fs::File::open(&dst).and_then(|f| f.sync_all()).with_context(|| format!("cannot fsync {}", dst.display()))?;
        }
        let st = TrainerState {
            step: self.step,
            loader: self.loader.state(),
            rng: self.rng.state,
            options: self.opts.clone(),
            tokens_seen: self.tokens_seen,
            skipped_steps: self.skipped_total,
        };
        fault(TRAINER_STATE)?;
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
        let dir = run_dir::resolve_checkpoint(path)?;
        let state_file = dir.join(TRAINER_STATE);
        let text = std::fs::read_to_string(&state_file).with_context(|| format!("cannot read {}", state_file.display()))?;
        let st: TrainerState = serde_json::from_str(&text).with_context(|| format!("{} is not a trainer state", state_file.display()))?;

        let cfg_file = dir.join("config.json");
        let saved_cfg = LlamaConfig::from_file(&cfg_file)?;
        let diffs = config_diff(&saved_cfg, self.model.config());
        if !diffs.is_empty() {
            bail!("cannot resume from {}: it holds a different model ({})", dir.display(), diffs.join("; "));
        }
        // Full weights by name (the Hugging Face files, whatever layout wrote them) and the full
        // optimizer state (one device's file, or joined from the shards of a parallel run).
        let sharded = ferrolm_dist::ckpt::is_sharded(&dir);
        let (weights, state): (HashMap<String, Tensor>, HashMap<String, Tensor>) = if sharded {
            let (p, s) = ferrolm_dist::ckpt::load_full(&dir)?;
            (p.into_iter().collect(), s.into_iter().collect())
        } else {
            let loaded = Llama::from_pretrained(&dir, DType::F32, Device::Cpu)?;
            let opt_file = dir.join("optimizer.safetensors");
            let s = load_safetensors(&opt_file, DType::F32, Device::Cpu)?;
            (loaded.parameters().into_iter().collect(), s.into_iter().collect())
        };
        let expected: Vec<String> = self.model.parameters().into_iter().map(|(n, _)| n).collect();
        if let Some(extra) = weights.keys().find(|k| !expected.contains(k)) {
            bail!("{}: weight `{extra}` is not a parameter of this model", dir.display());
        }
        if let Some(missing) = expected.iter().find(|k| !weights.contains_key(*k)) {
            bail!("{}: missing weight `{missing}`", dir.display());
        }
        for w in option_changes(&st.options, &self.opts) {
            tracing::warn!("resuming with a changed option: {w}");
        }
        let opt_step = st.step as u64 - st.skipped_steps.min(st.step as u64);
        let device = self.model.device();
        match &mut self.engine {
            Engine::Single(opt) => {
                let _g = no_grad();
                for (n, p) in self.model.parameters() {
                    p.assign(&weights[&n].to_dtype(p.dtype())?.to_device(device)?)
                        .with_context(|| format!("{}: weight `{n}`", dir.display()))?;
                }
                opt.load_state(opt_step, &|name| {
                    state
                        .get(name)
                        .map(|t| t.to_device(device))
                        .transpose()?
                        .ok_or_else(|| ferrolm_tensor::Error::new("resume", format!("{}: missing optimizer tensor {name}", dir.display())))
                })?;
            }
            Engine::Dist(d) => {
                let w: ferrolm_nn::checkpoint::TensorMap = weights.into_iter().collect();
                let s: ferrolm_nn::checkpoint::TensorMap = state.into_iter().collect();
                ferrolm_dist::ckpt::load_into(&mut d.zero, &w, &s, d.tp.as_ref(), opt_step, device)
                    .with_context(|| format!("cannot load {} into this rank's shards", dir.display()))?;
            }
        }
        if st.options.seq_len == self.opts.seq_len {
            self.loader.restore(&st.loader).with_context(|| format!("{}: cannot restore the data position", state_file.display()))?;
        } else {
            tracing::warn!("the data position cannot carry over to a new --seq-len: the data order restarts from the beginning");
        }
        self.rng = Rng { state: st.rng };
        self.step = st.step;
        self.tokens_seen = st.tokens_seen;
        self.skipped_total = st.skipped_steps;
        self.skipped_in_a_row = 0;

        let run_dir = run_dir::run_dir_of(&dir);
        let (lines, _) = match &run_dir {
            Some(r) => run_dir::read_metrics(r, st.step)?,
            None => (Vec::new(), 0),
        };
        self.history = lines.iter().filter_map(|l| Some((l.step as f64, l.loss?))).collect();
        self.val_history = lines.iter().filter_map(|l| Some((l.step as f64, l.val_loss?))).collect();
        self.resumed = Some(Resumed { run_dir, step: st.step, metrics: lines.into_iter().map(|l| l.raw).collect() });
        Ok(())
    }
}

/// `field: checkpoint A, this run B` for every model field that differs (the stored dtype is
/// not part of the model).
pub fn config_diff(saved: &LlamaConfig, current: &LlamaConfig) -> Vec<String> {
    let (a, b) = (saved.to_json_value("float32"), current.to_json_value("float32"));
    let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else { return vec!["config.json is not an object".into()] };
    let mut out = Vec::new();
    for (k, va) in a {
        let vb = b.get(k).cloned().unwrap_or_default();
        if *va != vb && k != "initializer_range" {
            out.push(format!("{k}: checkpoint {va}, this run {vb}"));
        }
    }
    out
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

/// A checkpoint directory, or a run directory whose `checkpoints/latest` names one (falling
/// back to the newest complete checkpoint when `latest` is missing or names a broken one).
pub fn resolve_checkpoint(path: &Path) -> AnyResult<PathBuf> {
    run_dir::resolve_checkpoint(path)
}

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
