//! Prepared token data checked when it is opened, not at the step that first draws a bad id.
//!
//! [`check_token_data`] is what a training run calls on a directory written by
//! [`prepare_text_dir`](crate::prepare_text_dir): the manifest must match the tokenizer (vocabulary
//! size and fingerprint), every shard it lists must open, carry the manifest's dtype and token
//! count, and hold only ids below the tokenizer's vocabulary size. Shards are memory-mapped, so
//! the id check is one sequential read of the data (about a second per GB from page cache); it is
//! skipped for u16 shards when the vocabulary covers every u16 value.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::prepare::{PrepareSummary, MANIFEST};
use crate::shard::Shard;
use crate::tokenizer::Tokenizer;

/// A prepared directory that passed [`check_token_data`].
#[derive(Clone, Debug)]
pub struct TokenData {
    /// Train shards, in manifest order.
    pub train_shards: Vec<PathBuf>,
    /// Validation shards, in manifest order (empty when prepared with `val_fraction` 0).
    pub val_shards: Vec<PathBuf>,
    pub summary: PrepareSummary,
    /// Problems that do not stop a run (an old manifest without a tokenizer fingerprint);
    /// the caller prints them.
    pub warnings: Vec<String>,
}

/// Opens the prepared directory `dir` and checks it against `tokenizer`; see the module docs.
/// Errors name the manifest field or the shard (and, for a bad id, its position).
pub fn check_token_data(dir: impl AsRef<Path>, tokenizer: &Tokenizer) -> Result<TokenData> {
    let dir = dir.as_ref();
    let manifest = dir.join(MANIFEST);
    let summary = PrepareSummary::load(dir)?
        .ok_or_else(|| Error::format(&manifest, "missing: not a (completely) prepared token directory; run prepare_data on it"))?;
    let vocab = tokenizer.vocab_size();
    if summary.vocab_size != vocab {
        return Err(Error::format(
            &manifest,
            format!(
                "field `vocab_size`: the data was prepared with a vocabulary of {}, this tokenizer has {vocab}: \
                 prepare the data again with this tokenizer",
                summary.vocab_size
            ),
        ));
    }
    let mut warnings = Vec::new();
    let fingerprint = tokenizer.fingerprint()?;
    match &summary.tokenizer_fingerprint {
        // Data prepared before the fingerprint left the post-processor out recorded the old one.
        Some(f) if *f != fingerprint && *f != tokenizer.legacy_fingerprint()? => {
            return Err(Error::format(
                &manifest,
                format!(
                    "field `tokenizer_fingerprint`: the data was prepared with tokenizer {f}, this one is {fingerprint} \
                     (same vocabulary size, different tokenizer): prepare the data again with this tokenizer"
                ),
            ))
        }
        Some(_) => {}
        None => warnings.push(format!(
            "{}: no `tokenizer_fingerprint` (written by an older ferrolm): only the vocabulary size ({vocab}) could be \
             checked against the tokenizer; prepare the data again to record it",
            manifest.display()
        )),
    }
    if summary.train_shards.is_empty() {
        return Err(Error::format(&manifest, "field `train_shards`: empty"));
    }
    for (field, list, total) in
        [("train_tokens", &summary.train_shards, summary.train_tokens), ("val_tokens", &summary.val_shards, summary.val_tokens)]
    {
        let mut sum = 0u64;
        for path in list {
            let shard = Shard::open(path)?;
            if shard.dtype() != summary.dtype {
                return Err(Error::format(path, format!("stores {:?} ids, but the manifest says {:?}", shard.dtype(), summary.dtype)));
            }
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            if let Some(info) = summary.shards.iter().find(|s| s.file == name) {
                if info.tokens != shard.len() as u64 {
                    return Err(Error::format(
                        path,
                        format!(
                            "holds {} tokens, but the manifest recorded {}: the shard changed after preparing",
                            shard.len(),
                            info.tokens
                        ),
                    ));
                }
                if let Some(m) = info.max_id.filter(|&m| m as usize >= vocab) {
                    return Err(Error::format(&manifest, format!("field `shards`: {name} has id {m}, outside the vocabulary of {vocab}")));
                }
            }
            shard.check_ids(vocab)?;
            sum += shard.len() as u64;
        }
        if sum != total {
            return Err(Error::format(&manifest, format!("field `{field}`: says {total}, the shards hold {sum}")));
        }
    }
    Ok(TokenData { train_shards: summary.train_shards.clone(), val_shards: summary.val_shards.clone(), summary, warnings })
}

/// Checks that every id in the shards at `paths` is below `vocab_size` (for shards that come
/// without a manifest; see [`Shard::check_ids`]). Call it before [`DataLoader::open`](crate::DataLoader::open)
/// with the model's vocabulary size.
pub fn check_shard_ids<P: AsRef<Path>>(paths: &[P], vocab_size: usize) -> Result<()> {
    for p in paths {
        Shard::open(p)?.check_ids(vocab_size)?;
    }
    Ok(())
}
