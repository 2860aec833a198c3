//! Batches of next-token windows over token shards, reproducible from a seed.
//!
//! Each shard is cut into non-overlapping windows of `T + 1` tokens at stride
//! `T` (`inputs = w[..T]`, `targets = w[1..]`), so every token is a target
//! exactly once per epoch. Windows never straddle two shards: that keeps a
//! window one contiguous memory-mapped read. Each epoch visits all windows in a
//! permutation drawn from `(seed, epoch)` alone, which is why the state is three
//! integers and restoring it replays the exact same batches.
//!
//! Data parallelism: with [`DataLoader::for_rank`], every step consumes
//! `world_size * B` windows and rank `r` takes the `r`-th block of `B`, so ranks
//! see disjoint data and share one [`LoaderState`].

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::shard::Shard;

/// `B` sequences of `T` tokens, row-major `(B, T)`; `targets` are `inputs` shifted by one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub inputs: Vec<i32>,  // (B, T)
    pub targets: Vec<i32>, // (B, T)
    pub batch: usize,
    pub seq: usize,
}

/// Where a [`DataLoader`] stands; saved with checkpoints for exact resume.
/// `seq_len` and `num_windows` are there to reject a state from other data.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    pub seed: u64,
    pub epoch: u64,
    /// Windows of this epoch's permutation already consumed (by all ranks).
    pub cursor: u64,
    pub seq_len: usize,
    pub num_windows: u64,
}

/// SplitMix64 (Steele, Lea & Flood 2014): tiny, fast, and well mixed enough to
/// shuffle; written here so the stream never changes under a dependency update.
pub(crate) struct SplitMix64(pub(crate) u64);

impl SplitMix64 {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform-enough integer in `0..n` by multiply-high; the bias, at most
    /// `n / 2^64`, is irrelevant for shuffling windows.
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

/// The windows of a list of shards, addressed by one global index.
struct Windows {
    shards: Vec<Shard>,
    seq: usize,
    /// `first[s]` = global index of shard `s`'s first window; last entry = total.
    first: Vec<u64>,
}

impl Windows {
    fn open<P: AsRef<Path>>(paths: &[P], seq: usize) -> Result<Self> {
        if paths.is_empty() {
            return Err(Error::invalid("no token shards given"));
        }
        if seq == 0 {
            return Err(Error::invalid("sequence length must be positive"));
        }
        let shards = paths.iter().map(Shard::open).collect::<Result<Vec<_>>>()?;
        let mut first = vec![0u64];
        for s in &shards {
            let n = if s.len() > seq { (s.len() - 1) / seq } else { 0 };
            first.push(first.last().unwrap() + n as u64);
        }
        if *first.last().unwrap() == 0 {
            let total: usize = shards.iter().map(Shard::len).sum();
            return Err(Error::invalid(format!(
                "not enough data: {} shard(s) starting with {} hold {total} tokens, but a window \
                 needs seq_len + 1 = {} tokens inside one shard",
                shards.len(),
                paths[0].as_ref().display(),
                seq + 1
            )));
        }
        Ok(Windows { shards, seq, first })
    }

    fn len(&self) -> u64 {
        *self.first.last().unwrap()
    }

    /// Appends window `w` to the batch buffers.
    fn push(&self, w: u64, inputs: &mut Vec<i32>, targets: &mut Vec<i32>) {
        let s = self.first.partition_point(|&f| f <= w) - 1;
        let start = (w - self.first[s]) as usize * self.seq;
        let mut i = 0;
        self.shards[s].extend_into(start, self.seq + 1, |t| {
            if i < self.seq {
                inputs.push(t as i32);
            }
            if i > 0 {
                targets.push(t as i32);
            }
            i += 1;
        });
    }
}

/// Most token ids one step may draw (all ranks): 2^31, 16 GiB of i32 inputs and targets. A
/// larger request is a mistake (a batch size in the trillions), refused before allocating.
pub const MAX_BATCH_TOKENS: u64 = 1 << 31;

/// `batch` and `seq` positive, and `world_size * batch * seq` within [`MAX_BATCH_TOKENS`].
fn check_batch(batch: usize, seq: usize, world_size: usize) -> Result<()> {
    if batch == 0 {
        return Err(Error::invalid("batch size must be positive"));
    }
    if seq == 0 {
        return Err(Error::invalid("sequence length must be positive"));
    }
    let tokens = (batch as u64).checked_mul(seq as u64).and_then(|t| t.checked_mul(world_size as u64));
    if tokens.is_none_or(|t| t > MAX_BATCH_TOKENS) {
        return Err(Error::invalid(format!(
            "batch size {batch} x sequence length {seq} x {world_size} rank(s) is more than {MAX_BATCH_TOKENS} tokens per step"
        )));
    }
    Ok(())
}

/// Epoch counts a restored state may carry: far beyond any run, and the counter cannot overflow.
const MAX_EPOCH: u64 = 1 << 62;

/// A seeded order over `n` items (windows, packed rows), one permutation per epoch drawn from
/// `(seed, epoch)` alone: where it stands is three integers, and restoring them replays the
/// same items. [`DataLoader`] walks its windows in one; the trainer its packed rows.
#[derive(Clone, Debug)]
pub struct EpochOrder {
    seed: u64,
    epoch: u64,
    /// Items of this epoch's permutation already taken.
    cursor: u64,
    order: Vec<u64>,
}

impl EpochOrder {
    /// The order of `n` items for `seed`, at the start of epoch 0; `what` names the items in
    /// the error when there are none.
    pub fn new(n: u64, seed: u64, what: &str) -> Result<Self> {
        if n == 0 {
            return Err(Error::invalid(format!("no {what} to train on")));
        }
        let mut o = EpochOrder { seed, epoch: 0, cursor: 0, order: Vec::new() };
        o.shuffle(n);
        Ok(o)
    }

    /// This epoch's permutation: Fisher-Yates driven by `(seed, epoch)`.
    fn shuffle(&mut self, n: u64) {
        let mut rng = SplitMix64(self.seed ^ self.epoch.wrapping_mul(0xD1B5_4A32_D192_ED03));
        rng.next_u64(); // decorrelate nearby seeds before the first draw
        self.order = (0..n).collect();
        for i in (1..n).rev() {
            let j = rng.below(i + 1);
            self.order.swap(i as usize, j as usize);
        }
    }

    /// The next item; epochs roll over (and reshuffle) transparently.
    pub fn next_item(&mut self) -> u64 {
        let n = self.len();
        if self.cursor == n {
            self.epoch += 1;
            self.cursor = 0;
            self.shuffle(n);
        }
        self.cursor += 1;
        self.order[self.cursor as usize - 1]
    }

    /// Items per epoch.
    pub fn len(&self) -> u64 {
        self.order.len() as u64
    }

    /// Never true: an order holds at least one item.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Epochs completed so far.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Where it stands, for items of `seq_len` tokens (saved with checkpoints).
    pub fn state(&self, seq_len: usize) -> LoaderState {
        LoaderState { seed: self.seed, epoch: self.epoch, cursor: self.cursor, seq_len, num_windows: self.len() }
    }

    /// Continues from `state`: the following items equal those the saving order would have
    /// given. Fails, naming the fields, if the state belongs to other data (another count of
    /// items, or of another `seq_len`); `what` names the items in that message.
    pub fn restore(&mut self, state: &LoaderState, seq_len: usize, what: &str) -> Result<()> {
        if state.seq_len != seq_len || state.num_windows != self.len() {
            return Err(Error::invalid(format!(
                "loader state (fields `num_windows`, `seq_len`) is for {} {what} of {} tokens, this data gives {} {what} of {seq_len}",
                state.num_windows,
                state.seq_len,
                self.len(),
            )));
        }
        if state.cursor > state.num_windows {
            return Err(Error::invalid(format!(
                "loader state field `cursor`: {} is past the end of an epoch of {} {what}",
                state.cursor, state.num_windows
            )));
        }
        if state.epoch >= MAX_EPOCH {
            return Err(Error::invalid(format!("loader state field `epoch`: {} is out of range (at most {MAX_EPOCH})", state.epoch)));
        }
        let reshuffle = state.seed != self.seed || state.epoch != self.epoch;
        self.seed = state.seed;
        self.epoch = state.epoch;
        self.cursor = state.cursor;
        if reshuffle {
            self.shuffle(self.len());
        }
        Ok(())
    }
}

/// Shuffled training batches; see the module docs.
pub struct DataLoader {
    windows: Windows,
    batch: usize,
    order: EpochOrder,
    rank: usize,
    world_size: usize,
}

impl DataLoader {
    /// Opens `paths` and yields `(batch, seq)` batches; the order is a function of `seed`.
    pub fn open<P: AsRef<Path>>(paths: &[P], batch: usize, seq: usize, seed: u64) -> Result<Self> {
        check_batch(batch, seq, 1)?;
        let windows = Windows::open(paths, seq)?;
        let order = EpochOrder::new(windows.len(), seed, "windows")?;
        Ok(DataLoader { windows, batch, order, rank: 0, world_size: 1 })
    }

    /// Makes this loader serve rank `rank` of `world_size` data-parallel ranks.
    pub fn for_rank(mut self, rank: usize, world_size: usize) -> Result<Self> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::invalid(format!("rank {rank} is not in a world of size {world_size}")));
        }
        check_batch(self.batch, self.windows.seq, world_size)?;
        self.rank = rank;
        self.world_size = world_size;
        Ok(self)
    }

    /// The next `(B, T)` batch; epochs roll over (and reshuffle) transparently.
    pub fn next_batch(&mut self) -> Batch {
        let (b, t) = (self.batch, self.windows.seq);
        let mut inputs = Vec::with_capacity(b * t);
        let mut targets = Vec::with_capacity(b * t);
        for slot in 0..self.world_size * b {
            let w = self.order.next_item();
            if slot / b == self.rank {
                self.windows.push(w, &mut inputs, &mut targets);
            }
        }
        Batch { inputs, targets, batch: b, seq: t }
    }

    /// Position to save with a checkpoint.
    pub fn state(&self) -> LoaderState {
        self.order.state(self.windows.seq)
    }

    /// Continues from `state`: the following batches equal those the saving loader
    /// would have produced. Fails if the state belongs to other data or `seq_len`.
    pub fn restore(&mut self, state: &LoaderState) -> Result<()> {
        self.order.restore(state, self.windows.seq, "windows")
    }

    /// Windows (sequences) per epoch, across all ranks.
    pub fn num_windows(&self) -> u64 {
        self.windows.len()
    }

    /// Epochs completed so far.
    pub fn epoch(&self) -> u64 {
        self.order.epoch()
    }
}

/// In-order batches over every full window of `paths` (validation / eval).
/// The last batch holds the remaining windows and may have `batch < B`.
pub struct EvalBatches {
    windows: Windows,
    batch: usize,
    next: u64,
}

/// Sequential, unshuffled batches over all full `(seq + 1)`-token windows of `paths`.
pub fn eval_batches<P: AsRef<Path>>(paths: &[P], batch: usize, seq: usize) -> Result<EvalBatches> {
    check_batch(batch, seq, 1)?;
    Ok(EvalBatches { windows: Windows::open(paths, seq)?, batch, next: 0 })
}

impl EvalBatches {
    /// Number of windows the iterator yields in total.
    pub fn num_windows(&self) -> u64 {
        self.windows.len()
    }

    /// Number of batches the iterator yields in total.
    pub fn num_batches(&self) -> usize {
        self.windows.len().div_ceil(self.batch as u64) as usize
    }
}

impl Iterator for EvalBatches {
    type Item = Batch;

    fn next(&mut self) -> Option<Batch> {
        let remaining = self.windows.len() - self.next;
        if remaining == 0 {
            return None;
        }
        let b = remaining.min(self.batch as u64) as usize;
        let t = self.windows.seq;
        let (mut inputs, mut targets) = (Vec::with_capacity(b * t), Vec::with_capacity(b * t));
        for w in self.next..self.next + b as u64 {
            self.windows.push(w, &mut inputs, &mut targets);
        }
        self.next += b as u64;
        Some(Batch { inputs, targets, batch: b, seq: t })
    }
}
