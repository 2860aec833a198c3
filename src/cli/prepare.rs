//! `prepare_data` (text -> token shards) and `train_tokenizer` (a byte-level BPE tokenizer.json).
use super::{env_help, fraction, positive, LogArgs, Tool, ENV_COMMON};
use crate::data::{prepare_text_dir_with_progress, text_files, train_byte_level_bpe, PrepareSummary, Tokenizer};
use crate::progress::{report, Progress};
use crate::AnyResult;
use anyhow::Context;
use clap::Parser;
use std::path::{Path, PathBuf};

#[derive(Parser, Debug, Clone, PartialEq)]
#[command(
    allow_negative_numbers = true,
    name = "prepare_data",
    about = "Tokenize text (a .txt file or a directory of them, one document per file) into train/validation token \
             shards and a manifest.json, the prepared-data directory that pretrain_llama --data reads",
    after_help = env_help(&[ENV_COMMON])
)]
pub struct PrepareDataArgs {
    /// Text: a .txt file or a directory of .txt files
    #[arg(long, value_name = "FILE|DIR")]
    pub input: PathBuf,
    /// Tokenizer (Hugging Face tokenizer.json)
    #[arg(long, value_name = "FILE")]
    pub tokenizer: PathBuf,
    /// Output directory (its old shards and manifest are replaced)
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Fraction of the tokens (the end of the stream) held out for validation
    #[arg(long, default_value = "0.05", value_parser = fraction, allow_hyphen_values = true)]
    pub val_fraction: f64,
    /// Tokens per shard file
    #[arg(long, default_value = "100000000", value_parser = positive)]
    pub shard_tokens: usize,
    #[command(flatten)]
    pub log: LogArgs,
}

impl Tool for PrepareDataArgs {
    fn log_args(&self) -> &LogArgs {
        &self.log
    }
}

/// Tokenizes `input` into shards in `out` with a progress indicator (shared by prepare_data and
/// the first-use tokenizing of pretrain_llama).
pub fn tokenize_text(input: &Path, tokenizer: &Tokenizer, out: &Path, val_fraction: f64, shard_tokens: usize) -> AnyResult<PrepareSummary> {
    let files = text_files(input).with_context(|| format!("cannot read the text in {}", input.display()))?;
    let bytes: u64 = files.iter().filter_map(|f| std::fs::metadata(f).ok()).map(|m| m.len()).sum();
    let bar = Progress::bytes(bytes, "tokenize");
    bar.set_message(format!("{} file(s)", files.len()));
    let s = prepare_text_dir_with_progress(input, tokenizer, out, val_fraction, shard_tokens, &mut |n| bar.inc(n))
        .with_context(|| format!("cannot prepare {} into {}", input.display(), out.display()))?;
    Ok(s)
}

pub fn prepare_data(a: PrepareDataArgs) -> AnyResult<()> {
    let tok = Tokenizer::from_file(&a.tokenizer).with_context(|| format!("cannot load the tokenizer {}", a.tokenizer.display()))?;
    let s = tokenize_text(&a.input, &tok, &a.out, a.val_fraction, a.shard_tokens)?;
    report(&format!(
        "{} documents -> {} train tokens in {} shard(s), {} val tokens in {} shard(s) ({:?}) under {}",
        s.documents,
        s.train_tokens,
        s.train_shards.len(),
        s.val_tokens,
        s.val_shards.len(),
        s.dtype,
        a.out.display()
    ));
    Ok(())
}

#[derive(Parser, Debug, Clone, PartialEq)]
#[command(
    allow_negative_numbers = true,
    name = "train_tokenizer",
    about = "Train a byte-level BPE tokenizer (Hugging Face tokenizer.json) on text",
    after_help = env_help(&[ENV_COMMON])
)]
pub struct TrainTokenizerArgs {
    /// Text: a .txt file or a directory of .txt files
    #[arg(long, value_name = "FILE|DIR")]
    pub corpus: PathBuf,
    /// Vocabulary size, special tokens included
    #[arg(long, default_value = "4096", value_parser = positive)]
    pub vocab_size: usize,
    /// Where to write tokenizer.json
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    #[command(flatten)]
    pub log: LogArgs,
}

impl Tool for TrainTokenizerArgs {
    fn log_args(&self) -> &LogArgs {
        &self.log
    }
}

pub fn train_tokenizer(a: TrainTokenizerArgs) -> AnyResult<()> {
    let files = text_files(&a.corpus).with_context(|| format!("cannot read the corpus {}", a.corpus.display()))?;
    let bytes: u64 = files.iter().filter_map(|f| std::fs::metadata(f).ok()).map(|m| m.len()).sum();
    tracing::info!("training byte-level BPE (vocab {}) on {} files, {bytes} bytes", a.vocab_size, files.len());
    let bar = Progress::spinner("train tokenizer");
    let tok = train_byte_level_bpe(&files, a.vocab_size)?;
    drop(bar);
    tok.save(&a.out).with_context(|| format!("cannot write {}", a.out.display()))?;
    report(&format!("wrote {}: vocab_size={} bos={:?} eos={:?}", a.out.display(), tok.vocab_size(), tok.bos_id(), tok.eos_id()));
    Ok(())
}
