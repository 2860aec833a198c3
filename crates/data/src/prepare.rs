//! Text -> token shards: `train_NNNNNN.bin` and `val_NNNNNN.bin` in one directory.
//!
//! The split is by position in the token stream (the last `val_fraction` of it
//! is validation), so it is deterministic and needs no RNG; with files sorted by
//! name the whole output is a pure function of the inputs. A `manifest.json`
//! is written last, so its presence means the directory is complete — callers
//! that build shards on first use check for it (see [`PrepareSummary::load`]).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::shard::{ShardWriter, TokenDtype};
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

/// The `.txt` files of `input` (itself, if it is a file), sorted by name.
pub fn text_files(input: &Path) -> Result<Vec<PathBuf>> {
    let meta = std::fs::metadata(input).map_err(|e| Error::io(input, e))?;
    if meta.is_file() {
        return Ok(vec![input.to_path_buf()]);
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(input).map_err(|e| Error::io(input, e))? {
        let path = entry.map_err(|e| Error::io(input, e))?.path();
        if path.is_file() && path.extension().is_some_and(|x| x == "txt") {
            files.push(path);
        }
    }
    files.sort();
    if files.is_empty() {
        return Err(Error::format(input, "no .txt files in this directory"));
    }
    Ok(files)
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

/// Tokenizes every `.txt` under `input` (one document per file, `<eos>`
/// appended to each when the tokenizer has one) and writes shards of at most
/// `shard_tokens` tokens into `out_dir`. The previous manifest and the shards it lists
/// are removed first so that a re-run never mixes outputs. The manifest records the
/// tokenizer's fingerprint and each shard's size and largest id.
///
/// The token stream is held in memory (4 bytes per token): fine up to a few
/// hundred million tokens; larger corpora want a streaming two-pass variant.
pub fn prepare_text_dir(
    input: impl AsRef<Path>,
    tokenizer: &Tokenizer,
    out_dir: impl AsRef<Path>,
    val_fraction: f64,
    shard_tokens: usize,
) -> Result<PrepareSummary> {
    prepare_text_dir_with_progress(input, tokenizer, out_dir, val_fraction, shard_tokens, &mut |_| {})
}

/// [`prepare_text_dir`], calling `on_bytes(n)` after each input file with the `n` bytes of
/// text it held (for a progress bar with a rate and an ETA).
pub fn prepare_text_dir_with_progress(
    input: impl AsRef<Path>,
    tokenizer: &Tokenizer,
    out_dir: impl AsRef<Path>,
    val_fraction: f64,
    shard_tokens: usize,
    on_bytes: &mut dyn FnMut(u64),
) -> Result<PrepareSummary> {
    let (input, out_dir) = (input.as_ref(), out_dir.as_ref());
    if !(0.0..1.0).contains(&val_fraction) {
        return Err(Error::invalid(format!("val_fraction must be in [0, 1), got {val_fraction}")));
    }
    if shard_tokens == 0 {
        return Err(Error::invalid("shard_tokens must be positive"));
    }
    let files = text_files(input)?;
    let eos = tokenizer.eos_id();
    let mut tokens: Vec<u32> = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).map_err(|e| Error::io(f, e))?;
        tokens.extend(tokenizer.encode(&text, false)?);
        tokens.extend(eos);
        on_bytes(text.len() as u64);
    }
    if tokens.is_empty() {
        return Err(Error::format(input, "input holds no text (0 tokens)"));
    }

    std::fs::create_dir_all(out_dir).map_err(|e| Error::io(out_dir, e))?;
    // Remove the previous output (the manifest first, so a crash in between leaves a
    // directory that reads as unprepared, never a manifest naming missing shards).
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

    let n_val = (tokens.len() as f64 * val_fraction).round() as usize;
    let (train, val) = tokens.split_at(tokens.len() - n_val);
    let vocab_size = tokenizer.vocab_size();
    let dtype = TokenDtype::for_vocab(vocab_size);
    let mut shards = Vec::new();
    let train_shards = write_shards(out_dir, "train", train, dtype, shard_tokens, &mut shards)?;
    let val_shards = write_shards(out_dir, "val", val, dtype, shard_tokens, &mut shards)?;
    let summary = PrepareSummary {
        documents: files.len(),
        train_tokens: train.len() as u64,
        val_tokens: val.len() as u64,
        vocab_size,
        dtype,
        train_shards,
        val_shards,
        tokenizer_fingerprint: Some(tokenizer.fingerprint()?),
        shards,
    };
    // Written last and atomically: its presence means the directory is complete.
    let tmp = out_dir.join(format!("{MANIFEST}.tmp"));
    std::fs::write(&tmp, summary.to_json()).map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, &manifest).map_err(|e| Error::io(&manifest, e))?;
    Ok(summary)
}

fn write_shards(
    dir: &Path,
    prefix: &str,
    tokens: &[u32],
    dtype: TokenDtype,
    shard_tokens: usize,
    info: &mut Vec<ShardInfo>,
) -> Result<Vec<PathBuf>> {
    let mut paths = Vec::new();
    for (i, chunk) in tokens.chunks(shard_tokens).enumerate() {
        let file = format!("{prefix}_{i:06}.bin");
        let path = dir.join(&file);
        let mut w = ShardWriter::create(&path, dtype)?;
        w.write(chunk)?;
        w.finish()?;
        info.push(ShardInfo { file, tokens: chunk.len() as u64, max_id: chunk.iter().copied().max() });
        paths.push(path);
    }
    Ok(paths)
}
