//! Examples -> rows of `seq_len` tokens, and the seeded, resumable order in which rows are
//! trained.
//!
//! - `--pack` (the default): best-fit decreasing. Examples are taken longest first (ties in
//!   data order) and each goes into the row whose free space is the smallest that fits it (the
//!   lowest-numbered such row), else a new row. Deterministic: the rows depend on the examples
//!   alone.
//! - `--no-pack`: one example per row, in data order, padded.
//! - An example longer than `seq_len` is dropped and counted, or with `truncate` cut to its first
//!   `seq_len` tokens (dropped after all if the cut leaves nothing trained).
//!
//! A row ([`PackedRow`]) is `seq_len` ids with per-token `targets` (the next token where it is
//! trained, else [`IGNORE_INDEX`]; an example's last position never predicts into its
//! neighbour), `positions` restarting at 0 in each example, and `cu_seqlens`, the cumulative
//! segment boundaries `[0, l1, l1 + l2, ..., seq_len]` (FlashAttention varlen's, per row).
//! Trailing padding is its own last segment: never trained, positions from 0 again, so the
//! segments always cover the row.
//!
//! [`PackedLoader`] serves rows in a permutation drawn from `(seed, epoch)`, as the pretraining
//! `DataLoader` serves windows; its [`PackState`] is saved with checkpoints so a resumed run
//! sees the same rows in the same order.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use super::mask::Example;
use super::IGNORE_INDEX;
use crate::error::{Error, Result};
use crate::loader::{check_batch, epoch_order, MAX_EPOCH};

/// One training row; see the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackedRow {
    pub ids: Vec<u32>,
    pub targets: Vec<i32>,
    pub positions: Vec<u32>,
    pub cu_seqlens: Vec<u32>,
}

impl PackedRow {
    /// Positions whose target is trained.
    pub fn trained_tokens(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE_INDEX).count()
    }
}

/// How to make rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackOptions {
    pub seq_len: usize,
    /// Best-fit decreasing (`--pack`), or one example per row (`--no-pack`).
    pub pack: bool,
    /// Keep the first `seq_len` tokens of a longer example instead of dropping it.
    pub truncate: bool,
    /// The id padding carries (never trained, never attended from a real token).
    pub pad_id: u32,
}

/// What packing did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PackStats {
    /// Examples given.
    pub examples: u64,
    /// Examples placed in rows (truncated ones included).
    pub packed: u64,
    /// Longer than `seq_len` and dropped (without `truncate`, or left with no trained token).
    pub dropped_too_long: u64,
    pub truncated: u64,
    pub rows: u64,
    pub seq_len: usize,
    /// Tokens of the placed examples (padding excluded).
    pub real_tokens: u64,
    pub trained_tokens: u64,
}

impl PackStats {
    /// Real tokens over row tokens.
    pub fn efficiency(&self) -> f64 {
        let row_tokens = self.rows as f64 * self.seq_len as f64;
        if row_tokens == 0.0 {
            0.0
        } else {
            self.real_tokens as f64 / row_tokens
        }
    }

    /// One line for the log.
    pub fn summary(&self) -> String {
        format!(
            "{} conversations in {} rows of {} tokens: packing efficiency {:.1}% ({} real tokens, {} trained); \
             {} over-long dropped, {} truncated",
            self.packed,
            self.rows,
            self.seq_len,
            100.0 * self.efficiency(),
            self.real_tokens,
            self.trained_tokens,
            self.dropped_too_long,
            self.truncated
        )
    }
}

/// Examples placed in rows.
#[derive(Clone, Debug)]
pub struct PackedData {
    examples: Vec<Example>,
    /// Each row's examples (indices into `examples`), in row order.
    rows: Vec<Vec<u32>>,
    seq_len: usize,
    pad_id: u32,
    stats: PackStats,
}

/// Packs `examples` into rows (see the module docs).
pub fn pack(examples: Vec<Example>, opts: &PackOptions) -> Result<PackedData> {
    let seq = opts.seq_len;
    if seq == 0 {
        return Err(Error::invalid("--seq-len must be positive"));
    }
    if seq > u32::MAX as usize {
        return Err(Error::invalid(format!("--seq-len {seq} does not fit the u32 positions of a row")));
    }
    let mut stats = PackStats { examples: examples.len() as u64, seq_len: seq, ..PackStats::default() };
    let mut kept = Vec::with_capacity(examples.len());
    for mut ex in examples {
        if ex.is_empty() {
            continue;
        }
        if ex.len() > seq {
            if !opts.truncate {
                stats.dropped_too_long += 1;
                continue;
            }
            ex.ids.truncate(seq);
            ex.trained.truncate(seq);
            if ex.trained_targets() == 0 {
                stats.dropped_too_long += 1;
                continue;
            }
            stats.truncated += 1;
        }
        stats.real_tokens += ex.len() as u64;
        stats.trained_tokens += ex.trained_targets() as u64;
        kept.push(ex);
    }
    stats.packed = kept.len() as u64;
    let rows = if opts.pack { best_fit_decreasing(&kept, seq) } else { (0..kept.len() as u32).map(|i| vec![i]).collect() };
    stats.rows = rows.len() as u64;
    Ok(PackedData { examples: kept, rows, seq_len: seq, pad_id: opts.pad_id, stats })
}

/// Rows by best-fit decreasing; every example is at most `seq` long.
fn best_fit_decreasing(examples: &[Example], seq: usize) -> Vec<Vec<u32>> {
    let mut order: Vec<u32> = (0..examples.len() as u32).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(examples[i as usize].len()), i));
    let mut rows: Vec<Vec<u32>> = Vec::new();
    // (free space, row) of every row with space left: the best fit is the first at or above
    // the example's length.
    let mut free: BTreeSet<(usize, usize)> = BTreeSet::new();
    for i in order {
        let len = examples[i as usize].len();
        match free.range((len, 0)..).next().copied() {
            Some((space, row)) => {
                free.remove(&(space, row));
                rows[row].push(i);
                if space > len {
                    free.insert((space - len, row));
                }
            }
            None => {
                rows.push(vec![i]);
                if seq > len {
                    free.insert((seq - len, rows.len() - 1));
                }
            }
        }
    }
    rows
}

impl PackedData {
    pub fn num_rows(&self) -> usize {
        self.rows.len()
    }

    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    pub fn stats(&self) -> &PackStats {
        &self.stats
    }

    /// The examples placed, in data order.
    pub fn examples(&self) -> &[Example] {
        &self.examples
    }

    /// The examples of row `i`, in the order they sit in it.
    pub fn row_members(&self, i: usize) -> &[u32] {
        &self.rows[i]
    }

    /// Row `i`, built (see the module docs).
    pub fn row(&self, i: usize) -> PackedRow {
        let seq = self.seq_len;
        let mut r = PackedRow {
            ids: Vec::with_capacity(seq),
            targets: Vec::with_capacity(seq),
            positions: Vec::with_capacity(seq),
            cu_seqlens: vec![0],
        };
        for &e in &self.rows[i] {
            let ex = &self.examples[e as usize];
            let n = ex.len();
            r.ids.extend_from_slice(&ex.ids);
            r.targets.extend((1..n).map(|j| if ex.trained[j] { ex.ids[j] as i32 } else { IGNORE_INDEX }));
            r.targets.push(IGNORE_INDEX);
            r.positions.extend(0..n as u32);
            r.cu_seqlens.push(r.ids.len() as u32);
        }
        let pad = seq - r.ids.len();
        if pad > 0 {
            r.ids.resize(seq, self.pad_id);
            r.targets.resize(seq, IGNORE_INDEX);
            r.positions.extend(0..pad as u32);
            r.cu_seqlens.push(seq as u32);
        }
        r
    }
}

/// Where a [`PackedLoader`] stands; saved with checkpoints for exact resume. `seq_len` and
/// `num_rows` are there to refuse a state from other data.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PackState {
    pub seed: u64,
    pub epoch: u64,
    /// Rows of this epoch's permutation already consumed (by all ranks).
    pub cursor: u64,
    pub seq_len: usize,
    pub num_rows: u64,
}

/// Shuffled batches of rows; with [`PackedLoader::for_rank`], every step consumes
/// `world_size * batch` rows and rank `r` takes the `r`-th block of `batch`.
pub struct PackedLoader {
    data: PackedData,
    batch: usize,
    seed: u64,
    epoch: u64,
    cursor: u64,
    order: Vec<u64>,
    rank: usize,
    world_size: usize,
}

impl PackedLoader {
    /// Batches of `batch` rows of `data`, in an order drawn from `seed`.
    pub fn new(data: PackedData, batch: usize, seed: u64) -> Result<Self> {
        check_batch(batch, data.seq_len, 1)?;
        if data.num_rows() == 0 {
            return Err(Error::invalid("no rows to train on: every conversation was dropped"));
        }
        let order = epoch_order(seed, 0, data.num_rows() as u64);
        Ok(PackedLoader { data, batch, seed, epoch: 0, cursor: 0, order, rank: 0, world_size: 1 })
    }

    /// Makes this loader serve rank `rank` of `world_size` data-parallel ranks.
    pub fn for_rank(mut self, rank: usize, world_size: usize) -> Result<Self> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::invalid(format!("rank {rank} is not in a world of size {world_size}")));
        }
        check_batch(self.batch, self.data.seq_len, world_size)?;
        self.rank = rank;
        self.world_size = world_size;
        Ok(self)
    }

    fn next_row(&mut self) -> usize {
        if self.cursor as usize == self.order.len() {
            self.epoch += 1;
            self.cursor = 0;
            self.order = epoch_order(self.seed, self.epoch, self.order.len() as u64);
        }
        self.cursor += 1;
        self.order[self.cursor as usize - 1] as usize
    }

    /// This rank's next `batch` rows; epochs roll over (and reshuffle) transparently.
    pub fn next_batch(&mut self) -> Vec<PackedRow> {
        let mut rows = Vec::with_capacity(self.batch);
        for slot in 0..self.world_size * self.batch {
            let r = self.next_row();
            if slot / self.batch == self.rank {
                rows.push(self.data.row(r));
            }
        }
        rows
    }

    /// Position to save with a checkpoint.
    pub fn state(&self) -> PackState {
        PackState { seed: self.seed, epoch: self.epoch, cursor: self.cursor, seq_len: self.data.seq_len, num_rows: self.order.len() as u64 }
    }

    /// Continues from `state`: the following batches equal those the saving loader would have
    /// produced. Refuses a state of other data (another row count or `seq_len`).
    pub fn restore(&mut self, state: &PackState) -> Result<()> {
        let n = self.order.len() as u64;
        if state.seq_len != self.data.seq_len || state.num_rows != n {
            return Err(Error::invalid(format!(
                "packed-data state (fields `num_rows`, `seq_len`) is for {} rows of {} tokens, these data give {n} rows of {}",
                state.num_rows, state.seq_len, self.data.seq_len
            )));
        }
        if state.cursor > n {
            return Err(Error::invalid(format!(
                "packed-data state field `cursor`: {} is past the end of an epoch of {n} rows",
                state.cursor
            )));
        }
        if state.epoch >= MAX_EPOCH {
            return Err(Error::invalid(format!("packed-data state field `epoch`: {} is out of range (at most {MAX_EPOCH})", state.epoch)));
        }
        (self.seed, self.epoch, self.cursor) = (state.seed, state.epoch, state.cursor);
        self.order = epoch_order(self.seed, self.epoch, n);
        Ok(())
    }

    pub fn data(&self) -> &PackedData {
        &self.data
    }

    /// Epochs completed so far.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(len: usize, first_id: u32) -> Example {
        Example { ids: (first_id..first_id + len as u32).collect(), trained: (0..len).map(|j| j % 2 == 1).collect() }
    }

    fn opts(seq_len: usize, pack: bool, truncate: bool) -> PackOptions {
        PackOptions { seq_len, pack, truncate, pad_id: 0 }
    }

    #[test]
    fn best_fit_decreasing_fills_rows() {
        // Lengths 6, 5, 4, 3, 2 into rows of 8: 6+2, 5+3, 4.
        let lens = [3, 6, 2, 5, 4];
        let examples: Vec<Example> = lens.iter().enumerate().map(|(i, &l)| ex(l, 100 * i as u32)).collect();
        let p = pack(examples, &opts(8, true, false)).unwrap();
        let rows: Vec<Vec<u32>> = (0..p.num_rows()).map(|r| p.row_members(r).to_vec()).collect();
        assert_eq!(rows, [vec![1, 2], vec![3, 0], vec![4]]);
        assert_eq!(p.stats().real_tokens, 20);
        assert!((p.stats().efficiency() - 20.0 / 24.0).abs() < 1e-12);
        let r = p.row(2);
        assert_eq!(r.ids, [400, 401, 402, 403, 0, 0, 0, 0]);
        assert_eq!(r.positions, [0, 1, 2, 3, 0, 1, 2, 3]);
        assert_eq!(r.cu_seqlens, [0, 4, 8]);
        // Token j of an example is trained when j is odd: position j-1 predicts it.
        assert_eq!(r.targets, [401, IGNORE_INDEX, 403, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]);
        let r = p.row(0);
        assert_eq!(r.cu_seqlens, [0, 6, 8]);
        assert_eq!(r.positions, [0, 1, 2, 3, 4, 5, 0, 1]);
        assert_eq!(r.targets[5], IGNORE_INDEX, "an example never predicts its neighbour's first token");
        assert_eq!(r.targets[6], 201);
    }

    #[test]
    fn no_pack_truncate_and_drops() {
        let examples = vec![ex(3, 0), ex(10, 10), ex(2, 30)];
        let p = pack(examples.clone(), &opts(4, false, false)).unwrap();
        assert_eq!((p.num_rows(), p.stats().dropped_too_long, p.stats().truncated), (2, 1, 0));
        assert_eq!(p.row(1).cu_seqlens, [0, 2, 4]);
        let p = pack(examples, &opts(4, false, true)).unwrap();
        assert_eq!((p.num_rows(), p.stats().dropped_too_long, p.stats().truncated), (3, 0, 1));
        assert_eq!(p.row(1).ids, [10, 11, 12, 13]);
        assert_eq!(p.row(1).cu_seqlens, [0, 4]);
        // A cut that leaves nothing trained drops the example.
        let untrained_head = Example { ids: vec![1, 2, 3, 4, 5], trained: vec![false, false, false, true, true] };
        let p = pack(vec![untrained_head], &opts(3, true, true)).unwrap();
        assert_eq!((p.num_rows(), p.stats().dropped_too_long), (0, 1));
        assert!(pack(vec![], &opts(0, true, false)).is_err());
    }

    #[test]
    fn loader_order_is_seeded_and_resumable() {
        let examples: Vec<Example> = (0..10).map(|i| ex(4, 10 * i)).collect();
        let data = pack(examples, &opts(4, true, false)).unwrap();
        let mut a = PackedLoader::new(data.clone(), 3, 7).unwrap();
        let first: Vec<Vec<PackedRow>> = (0..3).map(|_| a.next_batch()).collect();
        let state = a.state();
        let next: Vec<Vec<PackedRow>> = (0..5).map(|_| a.next_batch()).collect();
        assert_eq!(a.epoch(), 2, "10 rows, 24 drawn: the third epoch");
        let mut b = PackedLoader::new(data.clone(), 3, 99).unwrap();
        b.restore(&state).unwrap();
        assert_eq!((0..5).map(|_| b.next_batch()).collect::<Vec<_>>(), next);
        let mut c = PackedLoader::new(data.clone(), 3, 7).unwrap();
        assert_eq!((0..3).map(|_| c.next_batch()).collect::<Vec<_>>(), first);
        let mut d = PackedLoader::new(data.clone(), 3, 8).unwrap();
        assert_ne!((0..3).map(|_| d.next_batch()).collect::<Vec<_>>(), first, "another seed, another order");
        // Two ranks split what one rank of twice the batch would see.
        let mut whole = PackedLoader::new(data.clone(), 4, 5).unwrap();
        let mut r0 = PackedLoader::new(data.clone(), 2, 5).unwrap().for_rank(0, 2).unwrap();
        let mut r1 = PackedLoader::new(data.clone(), 2, 5).unwrap().for_rank(1, 2).unwrap();
        let w = whole.next_batch();
        assert_eq!([r0.next_batch(), r1.next_batch()].concat(), w);
        let bad = PackState { num_rows: 3, ..state };
        assert!(b.restore(&bad).unwrap_err().to_string().contains("num_rows"));
    }
}
