//! The training loop shared by the examples: gradient accumulation, AdamW with warmup+cosine,
//! global-norm clipping, periodic validation, JSONL metrics, a progress line with ETA, and
//! atomic checkpoints (Hugging Face layout + training state) that resume bit-exactly.
use crate::{AnyResult, Llama};
use ferrolm_data::{eval_batches, Batch, DataLoader, LoaderState};
use ferrolm_nn::checkpoint::{load_safetensors, save_safetensors, write_atomic};
use ferrolm_nn::optim::{clip_grad_norm, AdamW, AdamWConfig};
use ferrolm_nn::schedule::CosineSchedule;
use ferrolm_tensor::{no_grad, DType, Device, Rng, Tensor};
use serde::{Deserialize, Serialize};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Clone, Debug, Serialize, Deserialize)]
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

#[derive(Serialize, Deserialize)]
struct TrainerState {
    step: usize,
    loader: LoaderState,
    rng: u64,
    options: TrainOptions,
    tokens_seen: u64,
}

pub struct Trainer {
    pub model: Llama,
    pub opts: TrainOptions,
    pub out_dir: PathBuf,
    pub step: usize,
    pub rng: Rng,
    opt: AdamW,
    sched: CosineSchedule,
    loader: DataLoader,
    val_shards: Vec<PathBuf>,
    tokenizer_file: Option<PathBuf>,
    tokens_seen: u64,
    pub history: Vec<(f64, f64)>,
    pub val_history: Vec<(f64, f64)>,
}

/// (B, T) i32 tensors for one batch on `device`.
pub fn batch_tensors(b: &Batch, device: Device) -> AnyResult<(Tensor, Tensor)> {
    let x = Tensor::from_vec(b.inputs.clone(), [b.batch, b.seq], device)?;
    let y = Tensor::from_vec(b.targets.clone(), [b.batch, b.seq], device)?;
    Ok((x, y))
}

impl Trainer {
    pub fn new(model: Llama, train_shards: &[PathBuf], val_shards: &[PathBuf], opts: TrainOptions, out_dir: &Path) -> AnyResult<Trainer> {
        if opts.steps == 0 || opts.batch_size == 0 || opts.seq_len == 0 || opts.grad_accum == 0 {
            return Err("steps, batch size, sequence length and gradient accumulation must all be positive".into());
        }
        let maxpos = model.config().max_position_embeddings;
        if opts.seq_len > maxpos {
            return Err(format!("--seq-len {} is longer than the model's max_position_embeddings ({maxpos})", opts.seq_len).into());
        }
        let params = model.parameters();
        let opt = AdamW::new(&params, AdamWConfig { weight_decay: opts.weight_decay, ..AdamWConfig::default() })?;
        let sched = CosineSchedule { max_lr: opts.lr, min_lr: opts.min_lr, warmup_steps: opts.warmup_steps, total_steps: opts.steps };
        let loader = DataLoader::open(train_shards, opts.batch_size, opts.seq_len, opts.seed)?;
        std::fs::create_dir_all(out_dir).map_err(|e| format!("cannot create {}: {e}", out_dir.display()))?;
        Ok(Trainer {
            model,
            rng: Rng::new(opts.seed),
            opts,
            out_dir: out_dir.to_path_buf(),
            step: 0,
            opt,
            sched,
            loader,
            val_shards: val_shards.to_vec(),
            tokenizer_file: None,
            tokens_seen: 0,
            history: Vec::new(),
            val_history: Vec::new(),
        })
    }

    /// Copies this tokenizer.json into every checkpoint so a checkpoint is self-contained.
    pub fn with_tokenizer(mut self, path: &Path) -> Self {
        self.tokenizer_file = Some(path.to_path_buf());
        self
    }

    /// Mean validation loss over at most `max_batches` windows-batches (all if 0).
    pub fn evaluate(&self, max_batches: usize) -> AnyResult<f64> {
        let _g = no_grad();
        let (mut sum, mut n) = (0.0, 0usize);
        for (i, b) in eval_batches(&self.val_shards, self.opts.batch_size, self.opts.seq_len)?.enumerate() {
            if max_batches > 0 && i >= max_batches {
                break;
            }
            let (x, y) = batch_tensors(&b, self.model.device())?;
            let rows = b.batch * b.seq;
            sum += self.model.loss(&x, &y)?.item()? * rows as f64;
            n += rows;
        }
        if n == 0 {
            return Err("validation split holds no full window: lower --seq-len or add data".into());
        }
        Ok(sum / n as f64)
    }

    /// One optimizer step over `grad_accum` micro-batches: returns (loss, grad norm, lr).
    pub fn train_step(&mut self) -> AnyResult<(f64, f64, f64)> {
        let params = self.model.parameters();
        self.opt.zero_grad();
        let mut loss_sum = 0.0;
        for _ in 0..self.opts.grad_accum {
            let b = self.loader.next_batch();
            let (x, y) = batch_tensors(&b, self.model.device())?;
            let loss = self.model.loss(&x, &y)?;
            loss_sum += loss.item()?;
            loss.mul_scalar(1.0 / self.opts.grad_accum as f64)?.backward()?;
            self.tokens_seen += (b.batch * b.seq) as u64;
        }
        let norm = clip_grad_norm(&params, self.opts.grad_clip)?;
        let lr = self.sched.lr(self.step);
        self.opt.step(lr)?;
        self.opt.zero_grad();
        self.step += 1;
        let loss = loss_sum / self.opts.grad_accum as f64;
        if !loss.is_finite() {
            return Err(format!("loss became {loss} at step {}: lower --lr or check the data", self.step).into());
        }
        Ok((loss, norm, lr))
    }

    /// Trains to `opts.steps`, logging, evaluating and checkpointing on the way.
    pub fn run(&mut self) -> AnyResult<()> {
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.out_dir.join("metrics.jsonl"))
            .map_err(|e| format!("cannot open metrics.jsonl in {}: {e}", self.out_dir.display()))?;
        let tty = std::io::stderr().is_terminal();
        let start = Instant::now();
        let (start_step, tokens0) = (self.step, self.tokens_seen);
        let step_tokens = (self.opts.batch_size * self.opts.seq_len * self.opts.grad_accum) as f64;
        while self.step < self.opts.steps {
            let t0 = Instant::now();
            let (loss, norm, lr) = self.train_step()?;
            let dt = t0.elapsed().as_secs_f64();
            let elapsed = start.elapsed().as_secs_f64();
            let done = self.step - start_step;
            let tok_s = (self.tokens_seen - tokens0) as f64 / elapsed.max(1e-9);
            let eta = elapsed / done as f64 * (self.opts.steps - self.step) as f64;
            self.history.push((self.step as f64, loss));
            let peak_mib = ferrolm_tensor::peak_bytes() as f64 / (1 << 20) as f64;
            let mfu = self.mfu(tok_s);
            writeln!(
                log,
                "{}",
                serde_json::json!({"step": self.step, "loss": loss, "lr": lr, "grad_norm": norm,
                "tokens_per_s": step_tokens / dt.max(1e-9), "elapsed_s": elapsed, "peak_tensor_mib": peak_mib, "mfu": mfu})
            )?;
            if self.step % self.opts.log_every.max(1) == 0 || self.step == self.opts.steps || self.step == start_step + 1 {
                if tty {
                    eprint!("\r\x1b[2K");
                }
                let dev = match mfu {
                    Some(m) => format!(" | MFU {:.1}% | peak mem {peak_mib:.0} MiB", m * 100.0),
                    None => String::new(),
                };
                println!(
                    "step {:>5}/{} | loss {loss:.4} | lr {lr:.2e} | grad norm {norm:.3} | {tok_s:.0} tok/s{dev} | ETA {}",
                    self.step,
                    self.opts.steps,
                    fmt_secs(eta)
                );
            } else if tty {
                let frac = self.step as f64 / self.opts.steps as f64;
                let bar = (frac * 30.0) as usize;
                eprint!(
                    "\r\x1b[2K[{}{}] {:>3.0}% step {} loss {loss:.4} ETA {}",
                    "=".repeat(bar),
                    " ".repeat(30 - bar),
                    frac * 100.0,
                    self.step,
                    fmt_secs(eta)
                );
            }
            let last = self.step == self.opts.steps;
            if self.opts.eval_every > 0 && (self.step % self.opts.eval_every == 0 || last) {
                let v = self.evaluate(self.opts.eval_batches)?;
                self.val_history.push((self.step as f64, v));
                writeln!(log, "{}", serde_json::json!({"step": self.step, "val_loss": v}))?;
                if tty {
                    eprint!("\r\x1b[2K");
                }
                println!("step {:>5}/{} | val loss {v:.4}", self.step, self.opts.steps);
            }
            if (self.opts.save_every > 0 && self.step % self.opts.save_every == 0) || last {
                let dir = self.save_checkpoint()?;
                if tty {
                    eprint!("\r\x1b[2K");
                }
                println!("saved checkpoint {}", dir.display());
            }
        }
        self.plot()?;
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

    fn plot(&self) -> AnyResult<()> {
        let series = [
            crate::plot::Series { points: &self.history, rgb: [31, 119, 180] },
            crate::plot::Series { points: &self.val_history, rgb: [214, 39, 40] },
        ];
        crate::plot::line_plot(&self.out_dir.join("loss.png"), 640, 400, &series)?;
        Ok(())
    }

    /// Writes `checkpoints/step-NNNNNN/` through a temporary directory and a rename, then
    /// points `checkpoints/latest` at it: a crash mid-save leaves the previous one intact.
    pub fn save_checkpoint(&self) -> AnyResult<PathBuf> {
        let root = self.out_dir.join("checkpoints");
        std::fs::create_dir_all(&root)?;
        let name = format!("step-{:06}", self.step);
        let tmp = root.join(format!(".{name}.tmp"));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp)?;
        self.model.save_pretrained(&tmp)?;
        save_safetensors(&tmp.join("optimizer.safetensors"), &self.opt.state_tensors(), None)?;
        let state = TrainerState {
            step: self.step,
            loader: self.loader.state(),
            rng: self.rng.state,
            options: self.opts.clone(),
            tokens_seen: self.tokens_seen,
        };
        write_atomic(&tmp.join("trainer_state.json"), serde_json::to_string_pretty(&state)?.as_bytes())?;
        if let Some(t) = &self.tokenizer_file {
            std::fs::copy(t, tmp.join("tokenizer.json")).map_err(|e| format!("cannot copy {}: {e}", t.display()))?;
        }
        let dst = root.join(&name);
        let _ = std::fs::remove_dir_all(&dst);
        std::fs::rename(&tmp, &dst)?;
        write_atomic(&root.join("latest"), name.as_bytes())?;
        Ok(dst)
    }

    /// Restores model, optimizer, data position, RNG and step from a checkpoint directory
    /// (or a run directory, whose `checkpoints/latest` is followed).
    pub fn resume(&mut self, path: &Path) -> AnyResult<()> {
        let dir = resolve_checkpoint(path)?;
        let state_file = dir.join("trainer_state.json");
        let text = std::fs::read_to_string(&state_file).map_err(|e| format!("{}: {e}", state_file.display()))?;
        let st: TrainerState = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", state_file.display()))?;
        let loaded = Llama::from_pretrained(&dir, self.model.dtype(), self.model.device())?;
        let _g = no_grad();
        for ((n, p), (_, q)) in self.model.parameters().iter().zip(loaded.parameters()) {
            p.assign(&q).map_err(|e| format!("{}: {n}: {e}", dir.display()))?;
        }
        let opt_file = dir.join("optimizer.safetensors");
        let tensors = load_safetensors(&opt_file, DType::F32, self.model.device())?;
        self.opt.load_state(st.step as u64, &|name| {
            tensors
                .get(name)
                .cloned()
                .ok_or_else(|| ferrolm_tensor::Error::new("resume", format!("{}: missing tensor {name}", opt_file.display())))
        })?;
        self.loader.restore(&st.loader)?;
        self.rng = Rng { state: st.rng };
        self.step = st.step;
        self.tokens_seen = st.tokens_seen;
        Ok(())
    }
}

/// A checkpoint directory, or a run directory whose `checkpoints/latest` names one.
pub fn resolve_checkpoint(path: &Path) -> AnyResult<PathBuf> {
    if path.join("trainer_state.json").is_file() {
        return Ok(path.to_path_buf());
    }
    for root in [path.join("checkpoints"), path.to_path_buf()] {
        if let Ok(name) = std::fs::read_to_string(root.join("latest")) {
            let d = root.join(name.trim());
            if d.join("trainer_state.json").is_file() {
                return Ok(d);
            }
        }
    }
    Err(format!("{}: no checkpoint found (expected trainer_state.json, or checkpoints/latest in a run directory)", path.display()).into())
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
