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
}

impl PrepareSummary {
    /// Reads `out_dir/manifest.json`; `Ok(None)` when the directory was never
    /// (completely) prepared.
    pub fn load(out_dir: impl AsRef<Path>) -> Result<Option<Self>> {
        let path = out_dir.as_ref().join(MANIFEST);
        match std::fs::read_to_string(&path) {
            Ok(s) => {
                let mut summary: Self = serde_json::from_str(&s).map_err(|e| Error::format(&path, format!("bad manifest: {e}")))?;
                // The manifest stores bare file names so the directory can be moved.
                let dir = out_dir.as_ref();
                for p in summary.train_shards.iter_mut().chain(summary.val_shards.iter_mut()) {
                    *p = dir.join(p.file_name().unwrap_or_default());
                }
                Ok(Some(summary))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io(&path, e)),
        }
    }
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

/// Shards named `{prefix}_*.bin` in `dir`, sorted (the order they were written).
pub fn list_shards(dir: impl AsRef<Path>, prefix: &str) -> Result<Vec<PathBuf>> {
    let dir = dir.as_ref();
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let path = entry.map_err(|e| Error::io(dir, e))?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with(&format!("{prefix}_")) && name.ends_with(".bin") {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

/// Tokenizes every `.txt` under `input` (one document per file, `<eos>`
/// appended to each when the tokenizer has one) and writes shards of at most
/// `shard_tokens` tokens into `out_dir`. Old `train_*`/`val_*` shards and the
/// manifest there are removed first so that a re-run never mixes outputs.
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
    }
    if tokens.is_empty() {
        return Err(Error::format(input, "input holds no text (0 tokens)"));
    }

    std::fs::create_dir_all(out_dir).map_err(|e| Error::io(out_dir, e))?;
    let manifest = out_dir.join(MANIFEST);
    if manifest.exists() {
        std::fs::remove_file(&manifest).map_err(|e| Error::io(&manifest, e))?;
    }
    for old in list_shards(out_dir, "train")?.into_iter().chain(list_shards(out_dir, "val")?) {
        std::fs::remove_file(&old).map_err(|e| Error::io(&old, e))?;
    }

    let n_val = (tokens.len() as f64 * val_fraction).round() as usize;
    let (train, val) = tokens.split_at(tokens.len() - n_val);
    let dtype = TokenDtype::for_vocab(tokenizer.vocab_size());
    let summary = PrepareSummary {
        documents: files.len(),
        train_tokens: train.len() as u64,
        val_tokens: val.len() as u64,
        vocab_size: tokenizer.vocab_size(),
        dtype,
        train_shards: write_shards(out_dir, "train", train, dtype, shard_tokens)?,
        val_shards: write_shards(out_dir, "val", val, dtype, shard_tokens)?,
    };
    let mut on_disk = summary.clone();
    for p in on_disk.train_shards.iter_mut().chain(on_disk.val_shards.iter_mut()) {
        *p = PathBuf::from(p.file_name().unwrap_or_default());
    }
    let json = serde_json::to_string_pretty(&on_disk).expect("summary serializes");
    std::fs::write(&manifest, json).map_err(|e| Error::io(&manifest, e))?;
    Ok(summary)
}

fn write_shards(dir: &Path, prefix: &str, tokens: &[u32], dtype: TokenDtype, shard_tokens: usize) -> Result<Vec<PathBuf>> {
    let mut paths = Vec::new();
    for (i, chunk) in tokens.chunks(shard_tokens).enumerate() {
        let path = dir.join(format!("{prefix}_{i:06}.bin"));
        let mut w = ShardWriter::create(&path, dtype)?;
        w.write(chunk)?;
        w.finish()?;
        paths.push(path);
    }
    Ok(paths)
}
