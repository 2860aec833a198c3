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
//! The rows depend on the examples alone, not on a seed: the trainer draws them in its seeded,
//! resumable order of items (one permutation per epoch, as the pretraining `DataLoader` draws
//! windows), so the order of packed rows is part of its resume state.

use std::collections::BTreeSet;

use super::mask::Example;
use super::IGNORE_INDEX;
use crate::error::{Error, Result};

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
}
