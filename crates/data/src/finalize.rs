//! The last pass of `prepare`: the parts of the work directory become `train_NNNNNN.bin` and
//! `val_NNNNNN.bin`, in document order or shuffled by document (`--shuffle-docs SEED`).
//!
//! The validation split:
//! - text inputs (only `.txt`): the last `val_fraction` of the token stream, as text always had;
//! - otherwise by document: whole documents, spread evenly through the order, chosen so that
//!   validation holds about `val_fraction` of the tokens. When that leaves either side without
//!   a document (one long document, say) the token split is used instead.
//!
//! Documents are read back from the memory-mapped parts, so memory is the permutation (4 bytes
//! per document, with `--shuffle-docs`) and a bit per document for the split.

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{Error, Result};
use crate::loader::SplitMix64;
use crate::pipeline::PartInfo;
use crate::prepare::ShardInfo;
use crate::shard::{Shard, ShardWriter, TokenDtype};

/// How validation was cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitKind {
    Tokens,
    Documents,
}

impl SplitKind {
    pub fn name(self) -> &'static str {
        match self {
            SplitKind::Tokens => "tokens",
            SplitKind::Documents => "documents",
        }
    }
}

/// The finished parts, opened.
pub(crate) struct Parts {
    shards: Vec<Shard>,
    ends: Vec<Mmap>,
    /// `first_doc[p]`: global index of part `p`'s first document; the last entry is the total.
    first_doc: Vec<u64>,
}

impl Parts {
    pub(crate) fn open(work: &Path, infos: &[PartInfo]) -> Result<Self> {
        let (mut shards, mut ends, mut first_doc) = (Vec::new(), Vec::new(), vec![0u64]);
        for info in infos {
            let shard = Shard::open(work.join(format!("{}.bin", info.name)))?;
            let path = work.join(format!("{}.docs", info.name));
            let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
            // SAFETY: the work directory is this run's own; parts are written once, renamed into
            // place, and never modified (see ShardWriter for the same reasoning).
            let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
            let n = map.len() / 8;
            let mut prev = 0u64;
            for i in 0..n {
                let end = u64::from_le_bytes(map[i * 8..i * 8 + 8].try_into().unwrap());
                if end < prev || end > shard.len() as u64 {
                    return Err(Error::format(&path, format!("document {i} ends at {end}, outside {prev}..={}", shard.len())));
                }
                prev = end;
            }
            if map.len() % 8 != 0 || n as u64 != info.documents || shard.len() as u64 != info.tokens || prev != info.tokens {
                return Err(Error::format(&path, "the part does not match the journal: delete the .prepare directory and run again"));
            }
            first_doc.push(first_doc.last().unwrap() + n as u64);
            shards.push(shard);
            ends.push(map);
        }
        Ok(Parts { shards, ends, first_doc })
    }

    pub(crate) fn documents(&self) -> u64 {
        *self.first_doc.last().unwrap()
    }

    pub(crate) fn tokens(&self) -> u64 {
        self.shards.iter().map(|s| s.len() as u64).sum()
    }

    /// Part, start and length of document `d`.
    fn locate(&self, d: u64) -> (usize, usize, usize) {
        let p = self.first_doc.partition_point(|&f| f <= d) - 1;
        let i = (d - self.first_doc[p]) as usize;
        let end_at = |j: usize| u64::from_le_bytes(self.ends[p][j * 8..j * 8 + 8].try_into().unwrap()) as usize;
        let start = if i == 0 { 0 } else { end_at(i - 1) };
        (p, start, end_at(i) - start)
    }

    fn len_of(&self, d: u64) -> u64 {
        self.locate(d).2 as u64
    }

    fn tokens_of(&self, d: u64) -> Vec<u32> {
        let (p, start, len) = self.locate(d);
        self.shards[p].slice(start, len)
    }
}

/// Documents in output order: identity, or a Fisher-Yates permutation seeded by `seed`.
pub(crate) struct Order(Option<Vec<u32>>);

impl Order {
    pub(crate) fn new(documents: u64, shuffle: Option<u64>) -> Result<Self> {
        let Some(seed) = shuffle else { return Ok(Order(None)) };
        let n = u32::try_from(documents)
            .map_err(|_| Error::invalid(format!("--shuffle-docs: {documents} documents are more than this build shuffles (2^32)")))?;
        let mut perm: Vec<u32> = (0..n).collect();
        let mut rng = SplitMix64(seed ^ 0x5EED_D0C5_0000_0000);
        rng.next_u64();
        for i in (1..n as u64).rev() {
            let j = rng.below(i + 1);
            perm.swap(i as usize, j as usize);
        }
        Ok(Order(Some(perm)))
    }

    fn get(&self, i: u64) -> u64 {
        self.0.as_ref().map_or(i, |p| p[i as usize] as u64)
    }
}

/// Shards of at most `shard_tokens` tokens, written in sequence.
struct RollingWriter<'a> {
    dir: &'a Path,
    prefix: &'static str,
    dtype: TokenDtype,
    shard_tokens: u64,
    current: Option<(ShardWriter, String, Option<u32>)>,
    paths: Vec<PathBuf>,
    infos: Vec<ShardInfo>,
    tokens: u64,
}

impl RollingWriter<'_> {
    fn write(&mut self, mut ids: &[u32]) -> Result<()> {
        while !ids.is_empty() {
            if self.current.is_none() {
                let file = format!("{}_{:06}.bin", self.prefix, self.paths.len());
                let w = ShardWriter::create(self.dir.join(&file), self.dtype)?;
                self.current = Some((w, file, None));
            }
            let (w, _, max) = self.current.as_mut().unwrap();
            let room = (self.shard_tokens - w.len()) as usize;
            let (now, later) = ids.split_at(room.min(ids.len()));
            w.write(now)?;
            *max = now.iter().copied().max().max(*max);
            self.tokens += now.len() as u64;
            ids = later;
            if w.len() == self.shard_tokens {
                self.close()?;
            }
        }
        Ok(())
    }

    fn close(&mut self) -> Result<()> {
        if let Some((w, file, max_id)) = self.current.take() {
            let tokens = w.finish()?;
            self.paths.push(self.dir.join(&file));
            self.infos.push(ShardInfo { file, tokens, max_id });
        }
        Ok(())
    }
}

/// What [`write_splits`] wrote.
pub(crate) struct Written {
    pub train_shards: Vec<PathBuf>,
    pub val_shards: Vec<PathBuf>,
    pub shards: Vec<ShardInfo>,
    pub train_tokens: u64,
    pub val_tokens: u64,
    pub val_documents: u64,
    pub split: SplitKind,
}

/// Which documents (by output position) go to validation, by the even-spread rule of the module
/// docs; `None` when that leaves train or validation without a document.
fn document_split(parts: &Parts, order: &Order, val_fraction: f64) -> Option<(Vec<u64>, u64)> {
    let n = parts.documents();
    let mut bits = vec![0u64; n.div_ceil(64) as usize];
    let (mut seen, mut val, mut val_docs) = (0u64, 0u64, 0u64);
    for i in 0..n {
        let len = parts.len_of(order.get(i));
        seen += len;
        // Take this document when validation, with half of it, stays within its share so far.
        if len > 0 && (2 * val + len) as f64 <= 2.0 * val_fraction * seen as f64 {
            val += len;
            val_docs += 1;
            bits[(i / 64) as usize] |= 1 << (i % 64);
        }
    }
    (val_docs > 0 && val_docs < n).then_some((bits, val_docs))
}

/// Writes the train and val shards of `parts` into `out_dir`.
pub(crate) fn write_splits(
    parts: &Parts,
    out_dir: &Path,
    dtype: TokenDtype,
    shard_tokens: usize,
    val_fraction: f64,
    by_documents: bool,
    shuffle: Option<u64>,
) -> Result<Written> {
    let n = parts.documents();
    let order = Order::new(n, shuffle)?;
    let split = if by_documents && val_fraction > 0.0 { document_split(parts, &order, val_fraction) } else { None };
    let writer = |prefix| RollingWriter {
        dir: out_dir,
        prefix,
        dtype,
        shard_tokens: shard_tokens as u64,
        current: None,
        paths: Vec::new(),
        infos: Vec::new(),
        tokens: 0,
    };
    let (mut train, mut val) = (writer("train"), writer("val"));
    let total = parts.tokens();
    let train_budget = total - (total as f64 * val_fraction).round() as u64;
    let mut val_documents = 0;
    for i in 0..n {
        let ids = parts.tokens_of(order.get(i));
        match &split {
            Some((bits, _)) if bits[(i / 64) as usize] >> (i % 64) & 1 == 1 => {
                val.write(&ids)?;
                val_documents += 1;
            }
            Some(_) => train.write(&ids)?,
            None => {
                let (a, b) = ids.split_at((train_budget - train.tokens).min(ids.len() as u64) as usize);
                train.write(a)?;
                val.write(b)?;
                val_documents += u64::from(!b.is_empty());
            }
        }
    }
    train.close()?;
    val.close()?;
    let mut shards = std::mem::take(&mut train.infos);
    shards.append(&mut val.infos);
    Ok(Written {
        train_tokens: train.tokens,
        val_tokens: val.tokens,
        train_shards: train.paths,
        val_shards: val.paths,
        shards,
        val_documents,
        split: if split.is_some() { SplitKind::Documents } else { SplitKind::Tokens },
    })
}
