//! Pretrain a LLaMA model. With no arguments: a small model on the bundled Shakespeare corpus,
//! on the best device present, in a few minutes on a laptop CPU.
//!
//!   cargo run --release --example pretrain_llama -- [--config tiny|small|PATH/config.json]
//!     [--data DIR|FILE] [--tokenizer tokenizer.json] [--steps N] [--batch-size B] [--seq-len T]
//!     [--grad-accum K] [--lr LR] [--out DIR] [--resume DIR] [--device cpu|cuda[:N]] [--seed S]
//!     [--eval-every N] [--save-every N] [--activation-checkpointing]
use ferrolm::cli::Flags;
use ferrolm::data::{list_shards, prepare_text_dir, PrepareSummary, Shard, Tokenizer};
use ferrolm::nn::generate::generate;
use ferrolm::nn::LlamaConfig;
use ferrolm::train::{unigram_entropy, TrainOptions, Trainer};
use ferrolm::{AnyResult, DType, Device, Llama};
use ferrolm_tensor::Rng;
use std::path::{Path, PathBuf};

const USAGE: &str = "usage: pretrain_llama [--config tiny|small|FILE] [--data DIR|FILE] [--tokenizer FILE] [--steps N]
  [--batch-size B] [--seq-len T] [--grad-accum K] [--lr LR] [--out DIR] [--resume DIR]
  [--device cpu|cuda[:N]] [--seed S] [--eval-every N] [--save-every N] [--activation-checkpointing]";

struct Args {
    config: String,
    data: Option<PathBuf>,
    tokenizer: Option<PathBuf>,
    out: PathBuf,
    resume: Option<PathBuf>,
    device: Option<String>,
    ckpt: bool,
    opts: TrainOptions,
}

fn parse() -> AnyResult<Args> {
    let f = Flags::parse(
        USAGE,
        &[
            "config",
            "data",
            "tokenizer",
            "out",
            "resume",
            "device",
            "steps",
            "batch-size",
            "seq-len",
            "grad-accum",
            "lr",
            "seed",
            "eval-every",
            "save-every",
        ],
        &["activation-checkpointing"],
    )?;
    let steps = f.get("steps", 500usize)?;
    let lr = f.get("lr", 2e-3f64)?;
    Ok(Args {
        config: f.get("config", "tiny".to_string())?,
        data: f.str("data").map(PathBuf::from),
        tokenizer: f.str("tokenizer").map(PathBuf::from),
        out: f.get("out", PathBuf::from("runs/pretrain_llama"))?,
        resume: f.str("resume").map(PathBuf::from),
        device: f.str("device").map(String::from),
        ckpt: f.switch("activation-checkpointing"),
        opts: TrainOptions {
            steps,
            batch_size: f.get("batch-size", 16)?,
            seq_len: f.get("seq-len", 128)?,
            grad_accum: f.get("grad-accum", 1)?,
            lr,
            min_lr: lr / 10.0,
            warmup_steps: (steps / 10 + 1).min(25),
            weight_decay: 0.1,
            grad_clip: 1.0,
            eval_every: f.get("eval-every", 100)?,
            eval_batches: 20,
            save_every: f.get("save-every", 250)?,
            log_every: 25,
            seed: f.get("seed", 1337)?,
        },
    })
}

/// A bundled file: relative to the working directory, else beside the binary's folder (the
/// GPU staging layout), else in the source tree this binary was built from.
fn bundled(rel: &str) -> PathBuf {
    let exe_dir = std::env::current_exe().ok().and_then(|p| p.parent().and_then(|d| d.parent()).map(Path::to_path_buf));
    let cands = [Some(PathBuf::from(rel)), exe_dir.map(|d| d.join(rel)), Some(Path::new(env!("CARGO_MANIFEST_DIR")).join(rel))];
    cands.iter().flatten().find(|p| p.exists()).cloned().unwrap_or_else(|| PathBuf::from(rel))
}

/// Cache folder for tokenized text: named after the data and keyed by the files' names, sizes
/// and modification times and the tokenizer, so edited data or another tokenizer re-tokenizes.
fn cache_name(data: &Path, tokenizer: &Path) -> AnyResult<String> {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for f in ferrolm::data::text_files(data)?.iter().chain([&tokenizer.to_path_buf()]) {
        let m = std::fs::metadata(f).map_err(|e| format!("{}: {e}", f.display()))?;
        (f.file_name(), m.len(), m.modified().ok()).hash(&mut h);
    }
    let stem = data.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "data".into());
    Ok(format!("{stem}-{:016x}", h.finish()))
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> AnyResult<()> {
    let args = parse()?;
    let device = ferrolm::pick_device(args.device.as_deref())?;
    let dtype = if device == Device::Cpu { DType::F32 } else { DType::BF16 };

    let tok_path = args.tokenizer.clone().unwrap_or_else(|| bundled("data/tokenizer.json"));
    let tokenizer = Tokenizer::from_file(&tok_path)?;

    // Token shards: a prepared directory is used as is; text is tokenized once into runs/cache.
    let data = args.data.clone().unwrap_or_else(|| bundled("data/corpus"));
    let shard_dir = if PrepareSummary::load(&data).ok().flatten().is_some() {
        data.clone()
    } else {
        let dir = PathBuf::from("runs/cache").join(cache_name(&data, &tok_path)?);
        if PrepareSummary::load(&dir)?.is_none() {
            println!("tokenizing {} with {} ...", data.display(), tok_path.display());
            let s = prepare_text_dir(&data, &tokenizer, &dir, 0.05, 1 << 24)?;
            println!("  {} train / {} validation tokens in {}", s.train_tokens, s.val_tokens, dir.display());
        }
        dir
    };
    let train = list_shards(&shard_dir, "train")?;
    let val = list_shards(&shard_dir, "val")?;

    let mut cfg = if Path::new(&args.config).is_file() {
        LlamaConfig::from_file(Path::new(&args.config))?
    } else {
        let mut c = LlamaConfig::preset(&args.config)?;
        c.vocab_size = tokenizer.vocab_size();
        c
    };
    if tokenizer.vocab_size() > cfg.vocab_size {
        return Err(format!(
            "{}: the tokenizer has {} tokens but the model's vocab_size is {}",
            tok_path.display(),
            tokenizer.vocab_size(),
            cfg.vocab_size
        )
        .into());
    }
    cfg.bos_token_id = tokenizer.bos_id();
    cfg.eos_token_id = tokenizer.eos_id().map(|e| vec![e]).unwrap_or_default();
    let mut rng = Rng::new(args.opts.seed);
    let mut model = Llama::new(cfg, dtype, device, &mut rng)?;
    model.set_activation_checkpointing(args.ckpt);
    println!(
        "model: {} parameters ({:.2} M), {} layers, hidden {}, on {device} in {dtype}",
        model.num_params(),
        model.num_params() as f64 / 1e6,
        model.config().num_hidden_layers,
        model.config().hidden_size
    );

    let mut trainer = Trainer::new(model, &train, &val, args.opts.clone(), &args.out)?.with_tokenizer(&tok_path);
    if let Some(r) = &args.resume {
        trainer.resume(r)?;
        println!("resumed from {} at step {}", r.display(), trainer.step);
    }
    trainer.run()?;

    let val_loss = trainer.evaluate(0)?;
    let mut tokens = Vec::new();
    for p in &val {
        let s = Shard::open(p)?;
        tokens.extend(s.slice(0, s.len()));
    }
    let baseline = unigram_entropy(tokens.into_iter());
    println!(
        "final validation loss {val_loss:.4} (unigram-entropy baseline {baseline:.4}, ppl {:.1} vs {:.1})",
        val_loss.exp(),
        baseline.exp()
    );
    if val_loss >= baseline {
        println!("warning: the model did not beat the unigram baseline; train longer or raise --lr");
    }
    println!("checkpoint: {}  (loss curve: {})", args.out.join("checkpoints").display(), args.out.join("loss.png").display());

    let prompt = "ROMEO:\n";
    let ids = tokenizer.encode(prompt, false)?;
    let out = generate(&trainer.model, &ids, 80, 0.8, 0.95, &mut trainer.rng)?;
    println!("--- sample ---\n{}{}", prompt, tokenizer.decode(&out)?);
    Ok(())
}
