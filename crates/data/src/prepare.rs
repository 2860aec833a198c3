//! Documents -> token shards: `train_NNNNNN.bin` and `val_NNNNNN.bin` in one directory.
//!
//! [`prepare`] reads the inputs ([`resolve_inputs`]: text, JSON Lines plain or compressed,
//! Parquet), tokenizes them on every core into parts that an interrupted run resumes from
//! (`pipeline`), then writes the shards with the validation split (`finalize`). With inputs
//! sorted by path the whole output is a pure function of the inputs and the options. A
//! `manifest.json` is written last, so its presence means the directory is complete — callers
//! that build shards on first use check for it (see [`PrepareSummary::load`]).

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::finalize::{write_splits, Parts};
use crate::framing::DocFraming;
use crate::input::{resolve_inputs, InputFile};
use crate::pipeline::{Journal, PrepareProgress, TokenizePass, WORK_DIR};
use crate::shard::TokenDtype;
use crate::tokenizer::Tokenizer;

/// Name of the summary file written into the output directory.
pub const MANIFEST: &str = "manifest.json";

/// What [`prepare_text_dir`] produced. Shard paths are `out_dir.join(name)`;
/// `manifest.json` stores bare names so a prepared directory can be moved.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PrepareSummary {
    pub documents: usize,
    pub train_tokens: u64,
    pub val_tokens: u64,
    pub vocab_size: usize,
    pub dtype: TokenDtype,
    pub train_shards: Vec<PathBuf>,
    pub val_shards: Vec<PathBuf>,
    /// [`Tokenizer::fingerprint`] of the tokenizer that produced the ids; `None` in manifests
    /// written before it was recorded (they still load, with a warning from `check_token_data`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer_fingerprint: Option<String>,
    /// Per-shard token counts and largest ids, train shards first; empty in older manifests.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shards: Vec<ShardInfo>,
    /// How validation was cut: `"tokens"` (the end of the token stream) or `"documents"`
    /// (whole documents); absent in older manifests (always `"tokens"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<String>,
    /// Documents with tokens in the validation split.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_documents: Option<u64>,
    /// What separates documents (`"<|eos|> after each document"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub framing: Option<String>,
    /// The seed of `--shuffle-docs`, when the documents were shuffled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shuffle_docs: Option<u64>,
    /// Records skipped by `--skip-bad-records`, and the first few reasons.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub skipped_records: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped_examples: Vec<String>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// What the manifest records about one shard, so a replaced or damaged shard is noticed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardInfo {
    /// Bare file name, as in `train_shards` / `val_shards`.
    pub file: String,
    pub tokens: u64,
    /// Largest id in the shard (`None` when it is empty).
    pub max_id: Option<u32>,
}

impl PrepareSummary {
    /// Reads `out_dir/manifest.json`; `Ok(None)` when the directory was never
    /// (completely) prepared. Shard entries must be plain file names (no directories, no
    /// `..`), each listed once: the manifest alone says which files are the data.
    pub fn load(out_dir: impl AsRef<Path>) -> Result<Option<Self>> {
        let dir = out_dir.as_ref();
        let path = dir.join(MANIFEST);
        if !dir.is_dir() {
            // A file (text to tokenize) or nothing: not a prepared directory.
            return Ok(None);
        }
        let s = match std::fs::read_to_string(&path) {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(&path, e)),
        };
        Self::parse(&s, dir, &path).map(Some)
    }

    /// Parses the text of a manifest found at `path`; shard paths become `dir.join(name)`.
    pub fn parse(text: &str, dir: &Path, path: &Path) -> Result<Self> {
        let mut summary: Self = serde_json::from_str(text).map_err(|e| Error::format(path, format!("bad manifest: {e}")))?;
        let mut seen = std::collections::HashSet::new();
        for (field, list) in [("train_shards", &mut summary.train_shards), ("val_shards", &mut summary.val_shards)] {
            for p in list.iter_mut() {
                let name = plain_name(p).ok_or_else(|| {
                    Error::format(path, format!("field `{field}`: {:?} is not a plain file name inside the directory", p.display()))
                })?;
                if !seen.insert(name.clone()) {
                    return Err(Error::format(path, format!("field `{field}`: shard {name:?} is listed twice")));
                }
                *p = dir.join(name);
            }
        }
        if !summary.shards.is_empty() {
            let listed: Vec<String> = summary.train_shards.iter().chain(&summary.val_shards).map(|p| file_name(p)).collect();
            let recorded: Vec<&str> = summary.shards.iter().map(|s| s.file.as_str()).collect();
            if listed != recorded {
                return Err(Error::format(path, format!("field `shards` names {recorded:?}, but the shard lists name {listed:?}")));
            }
        }
        if summary.vocab_size == 0 {
            return Err(Error::format(path, "field `vocab_size`: must be positive"));
        }
        Ok(summary)
    }

    /// The manifest as written to disk: bare shard names.
    fn to_json(&self) -> String {
        let mut on_disk = self.clone();
        for p in on_disk.train_shards.iter_mut().chain(on_disk.val_shards.iter_mut()) {
            *p = PathBuf::from(file_name(p));
        }
        serde_json::to_string_pretty(&on_disk).expect("a manifest serialises")
    }
}

/// `p` when it is a single normal path component (what a manifest may name).
fn plain_name(p: &Path) -> Option<String> {
    let mut parts = p.components();
    match (parts.next(), parts.next()) {
        (Some(std::path::Component::Normal(n)), None) => n.to_str().map(str::to_string),
        _ => None,
    }
}

fn file_name(p: &Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

/// The `train` or `val` shards of a prepared directory, in order, as its `manifest.json`
/// lists them (never by file-name pattern: stray or stale files in the directory are not data).
/// A directory without a manifest is an error: it was never completely prepared.
pub fn list_shards(dir: impl AsRef<Path>, prefix: &str) -> Result<Vec<PathBuf>> {
    let dir = dir.as_ref();
    let summary = PrepareSummary::load(dir)?.ok_or_else(|| {
        Error::format(&dir.join(MANIFEST), "missing: not a (completely) prepared token directory; run prepare_data on it")
    })?;
    match prefix {
        "train" => Ok(summary.train_shards),
        "val" => Ok(summary.val_shards),
        other => Err(Error::invalid(format!("list_shards: unknown split {other:?} (a manifest has \"train\" and \"val\")"))),
    }
}

/// Settings of [`prepare`].
#[derive(Clone, Debug, PartialEq)]
pub struct PrepareOptions {
    /// Share of the tokens held out for validation, in [0, 1).
    pub val_fraction: f64,
    /// Tokens per output shard.
    pub shard_tokens: usize,
    /// JSON field / Parquet column (a dotted path for nested columns) holding the text.
    pub text_field: String,
    /// Count and report bad records (and unreadable files) instead of failing on the first.
    pub skip_bad_records: bool,
    /// Shuffle documents with this seed before the split and the shards.
    pub shuffle_docs: Option<u64>,
    /// Tokens per intermediate part: how much an interrupted run may have to redo.
    pub part_tokens: usize,
    /// Bytes of text per batch encoded in parallel.
    pub batch_bytes: usize,
}

impl Default for PrepareOptions {
    fn default() -> Self {
        PrepareOptions {
            val_fraction: 0.05,
            shard_tokens: 100_000_000,
            text_field: "text".into(),
            skip_bad_records: false,
            shuffle_docs: None,
            part_tokens: 1 << 24,
            batch_bytes: 8 << 20,
        }
    }
}

impl PrepareOptions {
    fn validate(&self) -> Result<()> {
        if !(0.0..1.0).contains(&self.val_fraction) {
            return Err(Error::invalid(format!("val_fraction must be in [0, 1), got {}", self.val_fraction)));
        }
        if self.shard_tokens == 0 || self.part_tokens == 0 || self.batch_bytes == 0 {
            return Err(Error::invalid("shard_tokens, part_tokens and batch_bytes must be positive"));
        }
        if self.text_field.is_empty() {
            return Err(Error::invalid("the text field name is empty"));
        }
        Ok(())
    }
}

/// What determines the ids of the parts: a resumed run must match it (an FNV-1a hash).
fn job_key(inputs: &[InputFile], fingerprint: &str, framing: &DocFraming, text_field: &str) -> String {
    use std::hash::Hasher;
    let mut h = fnv::FnvHasher::default();
    let mut put = |s: &str| {
        h.write(s.as_bytes());
        h.write_u8(0);
    };
    put("ferrolm-prepare-1");
    put(fingerprint);
    put(&format!("{:?}{:?}", framing.prefix, framing.suffix));
    put(text_field);
    for f in inputs {
        let mtime = f.modified.and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map_or(0, |d| d.as_nanos());
        put(&format!("{}\u{1}{}\u{1}{mtime}", f.path.display(), f.bytes));
    }
    format!("{:016x}", h.finish())
}

/// Removes the previous manifest (first, so a crash in between leaves a directory that reads as
/// unprepared, never a manifest naming missing shards), then the shards it listed.
fn remove_previous_output(out_dir: &Path) -> Result<()> {
    let manifest = out_dir.join(MANIFEST);
    let old = PrepareSummary::load(out_dir).ok().flatten();
    if manifest.exists() {
        std::fs::remove_file(&manifest).map_err(|e| Error::io(&manifest, e))?;
    }
    for old in old.iter().flat_map(|o| o.train_shards.iter().chain(&o.val_shards)) {
        match std::fs::remove_file(old) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::io(old, e)),
            _ => {}
        }
    }
    Ok(())
}

/// Tokenizes the documents of `input` (a file, directory or glob: see [`resolve_inputs`]) into
/// train/val shards of `out_dir` with a `manifest.json` recording the tokenizer's fingerprint,
/// each shard's size and largest id, the split and the skips. The previous manifest and its
/// shards are removed first, so a re-run never mixes outputs. A run that stops midway (an error,
/// a kill, `on_progress` returning `Break`) leaves its finished parts in `out_dir/.prepare/`, and
/// the next run with the same inputs, tokenizer and text field resumes from them, producing the
/// same shards as an uninterrupted run.
pub fn prepare(
    input: impl AsRef<Path>,
    tokenizer: &Tokenizer,
    out_dir: impl AsRef<Path>,
    opts: &PrepareOptions,
    on_progress: &mut dyn FnMut(&PrepareProgress) -> ControlFlow<()>,
) -> Result<PrepareSummary> {
    let (input, out_dir) = (input.as_ref(), out_dir.as_ref());
    opts.validate()?;
    let inputs = resolve_inputs(input)?;
    let framing = DocFraming::of(tokenizer)?;
    let fingerprint = tokenizer.fingerprint()?;
    let vocab_size = tokenizer.vocab_size();
    let dtype = TokenDtype::for_vocab(vocab_size);

    std::fs::create_dir_all(out_dir).map_err(|e| Error::io(out_dir, e))?;
    remove_previous_output(out_dir)?;
    let work = out_dir.join(WORK_DIR);
    let job = job_key(&inputs, &fingerprint, &framing, &opts.text_field);
    // A journal whose run skipped records resumes only a run that skips them too.
    let mut journal = match Journal::load(&work, &job).filter(|j| j.skipped_records == 0 || opts.skip_bad_records) {
        Some(j) => j,
        None => {
            if work.exists() {
                std::fs::remove_dir_all(&work).map_err(|e| Error::io(&work, e))?;
            }
            std::fs::create_dir_all(&work).map_err(|e| Error::io(&work, e))?;
            let j = Journal::new_for(job);
            j.save(&work)?;
            j
        }
    };
    if !journal.done {
        let pass = TokenizePass {
            inputs: &inputs,
            tokenizer,
            framing: &framing,
            text_field: &opts.text_field,
            skip_bad_records: opts.skip_bad_records,
            dtype,
            part_tokens: opts.part_tokens,
            batch_bytes: opts.batch_bytes,
        };
        pass.run(&work, &mut journal, on_progress)?;
    }

    let parts = Parts::open(&work, &journal.parts)?;
    if parts.tokens() == 0 {
        // With --skip-bad-records, "no text" is usually every record skipped: say so, and why.
        let why = match (journal.skipped_records, journal.skipped_examples.first()) {
            (0, _) => String::new(),
            (n, Some(first)) => format!(": {n} record(s) were skipped as bad (--skip-bad-records); the first: {first}"),
            (n, None) => format!(": {n} record(s) were skipped as bad (--skip-bad-records)"),
        };
        return Err(Error::format(input, format!("input holds no text (0 tokens){why}")));
    }
    let by_documents = !inputs.iter().all(|f| f.format.is_text());
    let w = write_splits(&parts, out_dir, dtype, opts.shard_tokens, opts.val_fraction, by_documents, opts.shuffle_docs)?;
    let summary = PrepareSummary {
        documents: parts.documents() as usize,
        train_tokens: w.train_tokens,
        val_tokens: w.val_tokens,
        vocab_size,
        dtype,
        train_shards: w.train_shards,
        val_shards: w.val_shards,
        tokenizer_fingerprint: Some(fingerprint),
        shards: w.shards,
        split: Some(w.split.name().to_string()),
        val_documents: Some(w.val_documents),
        framing: Some(framing.describe(tokenizer)),
        shuffle_docs: opts.shuffle_docs,
        skipped_records: journal.skipped_records,
        skipped_examples: journal.skipped_examples.clone(),
    };
    drop(parts);
    // Written last and atomically: its presence means the directory is complete.
    let (tmp, manifest) = (out_dir.join(format!("{MANIFEST}.tmp")), out_dir.join(MANIFEST));
    std::fs::write(&tmp, summary.to_json()).map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, &manifest).map_err(|e| Error::io(&manifest, e))?;
    std::fs::remove_dir_all(&work).map_err(|e| Error::io(&work, e))?;
    Ok(summary)
}

/// [`prepare`] with default options but the split and shard size: the entry point the tools
/// and tests used when only text was read (its name is kept; it reads every format).
pub fn prepare_text_dir(
    input: impl AsRef<Path>,
    tokenizer: &Tokenizer,
    out_dir: impl AsRef<Path>,
    val_fraction: f64,
    shard_tokens: usize,
) -> Result<PrepareSummary> {
    prepare_text_dir_with_progress(input, tokenizer, out_dir, val_fraction, shard_tokens, &mut |_| {})
}

/// [`prepare_text_dir`], calling `on_bytes(n)` as input is read with the `n` bytes read since
/// the previous call (for a progress bar with a rate and an ETA).
pub fn prepare_text_dir_with_progress(
    input: impl AsRef<Path>,
    tokenizer: &Tokenizer,
    out_dir: impl AsRef<Path>,
    val_fraction: f64,
    shard_tokens: usize,
    on_bytes: &mut dyn FnMut(u64),
) -> Result<PrepareSummary> {
    let opts = PrepareOptions { val_fraction, shard_tokens, ..PrepareOptions::default() };
    let mut last = None;
    prepare(input, tokenizer, out_dir, &opts, &mut |p| {
        let before = *last.get_or_insert(p.resumed_bytes);
        if p.bytes > before {
            on_bytes(p.bytes - before);
            last = Some(p.bytes);
        }
        ControlFlow::Continue(())
    })
}
