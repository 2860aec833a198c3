//! `prepare_data` (text and datasets -> token shards) and `train_tokenizer` (a byte-level BPE
//! tokenizer.json).
use super::{env_help, fraction, positive, LogArgs, Tool, ENV_COMMON};
use crate::data::{text_files, train_byte_level_bpe, PrepareOptions, Tokenizer};
use crate::progress::{report, Progress};
use crate::AnyResult;
use anyhow::Context;
use clap::Parser;
use std::path::PathBuf;

#[derive(Parser, Debug, Clone, PartialEq)]
#[command(
    allow_negative_numbers = true,
    name = "prepare_data",
    about = "Tokenize text or a dataset (.txt, .json, .jsonl, .jsonl.gz, .jsonl.zst, .parquet: a file, a directory or a glob) into \
             train/validation token shards and a manifest.json, the prepared-data directory that pretrain_llama --data \
             reads. Runs on every core; an interrupted run resumes where it stopped.",
    after_help = env_help(&[ENV_COMMON])
)]
pub struct PrepareDataArgs {
    /// Input: a .txt file (one document), a .jsonl / .jsonl.gz / .jsonl.zst file (one document
    /// per line), a .json file (a JSON array, one document per element) or a .parquet file (one
    /// per row), a directory of these (.json files left out), or a quoted glob ("data/*.parquet")
    #[arg(long, value_name = "FILE|DIR|GLOB")]
    pub input: PathBuf,
    /// Tokenizer (Hugging Face tokenizer.json)
    #[arg(long, value_name = "FILE")]
    pub tokenizer: PathBuf,
    /// Output directory (its old shards and manifest are replaced)
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Fraction held out for validation: the end of the token stream for text files, whole
    /// documents for datasets
    #[arg(long, default_value = "0.05", value_parser = fraction, allow_hyphen_values = true)]
    pub val_fraction: f64,
    /// Tokens per shard file
    #[arg(long, default_value = "100000000", value_parser = positive)]
    pub shard_tokens: usize,
    #[command(flatten)]
    pub records: RecordArgs,
    /// Shuffle the documents with this seed before the split and the shards [default: input order]
    #[arg(long, value_name = "SEED")]
    pub shuffle_docs: Option<u64>,
    #[command(flatten)]
    pub log: LogArgs,
}

/// How records of a dataset are read (prepare_data and the training tools' --data).
#[derive(clap::Args, Debug, Clone, PartialEq)]
pub struct RecordArgs {
    /// The JSON field or Parquet column holding the text (a dotted path for a nested column)
    #[arg(long, value_name = "NAME", default_value = "text", help_heading = "Data")]
    pub text_field: String,
    /// Skip records that cannot be read (a missing or non-string field, bad UTF-8, a truncated
    /// stream: the rest of that file), counting and reporting them, instead of stopping
    #[arg(long, help_heading = "Data")]
    pub skip_bad_records: bool,
}

impl RecordArgs {
    /// The flags as the library takes them.
    pub fn options(&self) -> crate::shards::RecordOptions {
        crate::shards::RecordOptions { text_field: self.text_field.clone(), skip_bad_records: self.skip_bad_records, ..Default::default() }
    }
}

impl Tool for PrepareDataArgs {
    fn log_args(&self) -> &LogArgs {
        &self.log
    }
}

pub fn prepare_data(a: PrepareDataArgs) -> AnyResult<()> {
    crate::run_dir::check_inputs_outside(&a.out, &[("--input", &a.input), ("--tokenizer", &a.tokenizer)])?;
    let tok = Tokenizer::from_file(&a.tokenizer).with_context(|| format!("cannot load the tokenizer {}", a.tokenizer.display()))?;
    let opts = PrepareOptions {
        val_fraction: a.val_fraction,
        shard_tokens: a.shard_tokens,
        text_field: a.records.text_field.clone(),
        skip_bad_records: a.records.skip_bad_records,
        shuffle_docs: a.shuffle_docs,
        ..PrepareOptions::default()
    };
    let s = crate::shards::tokenize_data(&a.input, &tok, &a.out, &opts)?;
    crate::shards::report_prepared(&s, &a.out);
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
    crate::run_dir::check_inputs_outside(&a.out, &[("--corpus", &a.corpus)])?;
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
