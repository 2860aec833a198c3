//! The token shards a run trains on: `--data` resolved into shards (a prepared directory as is;
//! text and datasets tokenized once into `--cache-dir`, by default `runs/cache` under the working
//! directory, resuming an interrupted tokenizing) and
//! checked against the tokenizer, and the tokenizing itself with its progress bar and report
//! (prepare_data, the training tools' first-use `--data`, autoconfig's trials).
use crate::data::{prepare, PrepareOptions, PrepareSummary, Tokenizer};
use crate::progress::{report, Progress};
use crate::AnyResult;
use anyhow::Context;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

/// How records of a dataset are read (`--text-field`, `--skip-bad-records`), and where text and
/// datasets are tokenized to (`--cache-dir`).
#[derive(Clone, Debug, PartialEq)]
pub struct RecordOptions {
    /// The JSON field or Parquet column that holds the text.
    pub text_field: String,
    /// Count and report bad records instead of stopping at the first.
    pub skip_bad_records: bool,
    /// The cache of tokenized data: one folder per data, tokenizer and record flags.
    pub cache_dir: PathBuf,
}

/// `--cache-dir`'s default, relative to the working directory.
pub const DEFAULT_CACHE_DIR: &str = "runs/cache";

impl Default for RecordOptions {
    fn default() -> Self {
        RecordOptions { text_field: "text".into(), skip_bad_records: false, cache_dir: PathBuf::from(DEFAULT_CACHE_DIR) }
    }
}

/// Tokenizes `input` into shards in `out` with a progress bar (bytes, documents, tokens/s, ETA),
/// shared by prepare_data and the first-use tokenizing of the training tools. A run interrupted
/// before resumes from its finished parts.
pub fn tokenize_data(input: &Path, tokenizer: &Tokenizer, out: &Path, opts: &PrepareOptions) -> AnyResult<PrepareSummary> {
    let bar = Progress::bytes(0, "tokenize");
    let start = std::time::Instant::now();
    let mut first = true;
    let s = prepare(input, tokenizer, out, opts, &mut |p| {
        if first {
            first = false;
            bar.bar().set_length(p.total_bytes);
            bar.start_at(p.resumed_bytes);
            if p.resumed_documents > 0 {
                report(&format!(
                    "resuming {}: {} documents ({} tokens) already tokenized",
                    out.display(),
                    p.resumed_documents,
                    p.resumed_tokens
                ));
            }
        }
        bar.set_position(p.bytes);
        let rate = (p.tokens - p.resumed_tokens) as f64 / start.elapsed().as_secs_f64().max(1e-3);
        let skipped = if p.skipped_records > 0 { format!(", {} skipped", p.skipped_records) } else { String::new() };
        bar.set_message(format!("{} docs, {} tok/s{skipped}", p.documents, human(rate)));
        ControlFlow::Continue(())
    })
    .with_context(|| format!("cannot prepare {} into {}", input.display(), out.display()))?;
    Ok(s)
}

/// `1.23M`-style counts for the progress line.
fn human(x: f64) -> String {
    match x {
        x if x >= 1e9 => format!("{:.2}G", x / 1e9),
        x if x >= 1e6 => format!("{:.2}M", x / 1e6),
        x if x >= 1e3 => format!("{:.1}k", x / 1e3),
        x => format!("{x:.0}"),
    }
}

/// The report lines after preparing: sizes, how documents were framed and split, and skips.
pub fn report_prepared(s: &PrepareSummary, out: &Path) {
    report(&format!(
        "{} document{} -> {} train tokens in {} shard(s), {} val tokens in {} shard(s) ({:?}) under {}",
        s.documents,
        if s.documents == 1 { "" } else { "s" },
        s.train_tokens,
        s.train_shards.len(),
        s.val_tokens,
        s.val_shards.len(),
        s.dtype,
        out.display()
    ));
    let split = match (s.split.as_deref(), s.val_documents) {
        (Some("documents"), Some(n)) => format!("validation: {n} whole documents"),
        _ => "validation: the end of the token stream".to_string(),
    };
    let shuffled = s.shuffle_docs.map(|seed| format!(", documents shuffled (seed {seed})")).unwrap_or_default();
    report(&format!("{}; {split}{shuffled}", s.framing.as_deref().unwrap_or("documents delimited")));
    if s.skipped_records > 0 {
        report(&format!("skipped {} bad record(s) (--skip-bad-records); the first:", s.skipped_records));
        for e in &s.skipped_examples {
            report(&format!("  {e}"));
        }
    }
}

/// Cache folder for tokenized data: named after the data and keyed by the input files' names,
/// sizes and modification times, the tokenizer, and the record flags when they are not the
/// defaults, so edited data, another tokenizer or another text field tokenizes again.
fn cache_name(data: &Path, tokenizer: &Path, records: &RecordOptions) -> AnyResult<String> {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let inputs = crate::data::resolve_inputs(data)?;
    for f in inputs.iter().map(|f| &f.path).chain([&tokenizer.to_path_buf()]) {
        let m = std::fs::metadata(f).with_context(|| format!("cannot read {}", f.display()))?;
        (f.file_name(), m.len(), m.modified().ok()).hash(&mut h);
    }
    if records.text_field != "text" || records.skip_bad_records {
        (&records.text_field, records.skip_bad_records).hash(&mut h);
    }
    let stem = data.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "data".into());
    // A glob's stem (`*`) and other odd characters do not belong in a directory name.
    let stem: String = stem.chars().map(|c| if c.is_alphanumeric() || "._-".contains(c) { c } else { '_' }).collect();
    Ok(format!("{stem}-{:016x}", h.finish()))
}

/// Whether `--data` is written as a glob (and is not a path that exists).
fn is_glob(data: &Path) -> bool {
    !data.exists() && data.to_str().is_some_and(|s| s.contains(['*', '?', '[']))
}

/// The shard directory for `data`: a prepared directory as is; text and datasets (a file, a
/// directory of them, a glob) tokenized once into the cache (`records.cache_dir`), resuming an
/// interrupted tokenizing.
pub fn shard_dir(data: &Path, tokenizer: &Tokenizer, tok_path: &Path, records: &RecordOptions) -> AnyResult<PathBuf> {
    if !is_glob(data) {
        let what = if data.is_file() || data.extension().is_some() { "data file" } else { "data directory" };
        std::fs::metadata(data).with_context(|| format!("cannot open {what} {}", data.display()))?;
    }
    if PrepareSummary::load(data)?.is_some() {
        return Ok(data.to_path_buf());
    }
    let name = cache_name(data, tok_path, records).with_context(|| format!("cannot read the data {}", data.display()))?;
    let dir = records.cache_dir.join(name);
    if PrepareSummary::load(&dir)?.is_none() {
        tracing::info!("tokenizing {} with {} into {}", data.display(), tok_path.display(), dir.display());
        let opts = PrepareOptions {
            val_fraction: 0.05,
            shard_tokens: 1 << 24,
            text_field: records.text_field.clone(),
            skip_bad_records: records.skip_bad_records,
            ..PrepareOptions::default()
        };
        let s = tokenize_data(data, tokenizer, &dir, &opts)?;
        report_prepared(&s, &dir);
    }
    Ok(dir)
}

/// The train and validation shards for `--data`, checked at open against the tokenizer (manifest
/// vocabulary and fingerprint, every shard's dtype, length and ids): a bad id is found here, not
/// at the step that first draws it. Datasets are read with the default record flags
/// (`--text-field text`); [`token_data_with`] takes them.
pub fn token_data(data: &Path, tokenizer: &Tokenizer, tok_path: &Path) -> AnyResult<(PathBuf, Vec<PathBuf>, Vec<PathBuf>)> {
    token_data_with(data, tokenizer, tok_path, &RecordOptions::default())
}

/// [`token_data`] with the record flags (`--text-field`, `--skip-bad-records`).
pub fn token_data_with(
    data: &Path,
    tokenizer: &Tokenizer,
    tok_path: &Path,
    records: &RecordOptions,
) -> AnyResult<(PathBuf, Vec<PathBuf>, Vec<PathBuf>)> {
    let shards = shard_dir(data, tokenizer, tok_path, records)?;
    let td = crate::data::check_token_data(&shards, tokenizer)
        .with_context(|| format!("the prepared data in {} does not fit the tokenizer {}", shards.display(), tok_path.display()))?;
    for w in &td.warnings {
        tracing::warn!("{w}");
    }
    Ok((shards, td.train_shards, td.val_shards))
}
