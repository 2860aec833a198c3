//! The segments of packed rows: a row of t tokens holding several sequences (conversations,
//! documents) one after the other. Each row's boundaries are cumulative lengths, FlashAttention's
//! varlen `cu_seqlens` per row: `[0, l1, l1 + l2, ..., t]`. Attention keeps a query inside its
//! own segment (`attention::segment_attention`): query i of a segment [s, e) sees keys s..=i.
//!
//! What the kernels read is per token, never per (query, key) pair: the first position of the
//! token's segment and one past its last, as i32 (2, b, t) (`bounds`), uploaded once per device
//! and shared by every layer's forward and backward (a clone shares the upload).
use ferrolm_tensor::{bail, Device, Result, Tensor};
use std::sync::{Arc, Mutex};

/// The segments of each of b rows of t tokens.
#[derive(Clone)]
pub struct Segments(Arc<Inner>);

struct Inner {
    t: usize,
    /// Per row, the cumulative boundaries [0, ..., t].
    cu: Vec<Vec<u32>>,
    /// (2, b, t): the first position of each token's segment, then one past its last.
    bounds: Vec<i32>,
    /// `bounds` on a device, uploaded on first use there.
    device: Mutex<Option<Tensor>>,
}

impl std::fmt::Debug for Segments {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segments").field("t", &self.0.t).field("cu_seqlens", &self.0.cu).finish()
    }
}

impl Segments {
    /// The segments of rows of `t` tokens, one `cu_seqlens` per row: it starts at 0, ends at `t`
    /// and never decreases (an empty segment is allowed and holds nothing).
    pub fn new(t: usize, cu_seqlens: Vec<Vec<u32>>) -> Result<Segments> {
        if t == 0 || t > i32::MAX as usize {
            bail!("segments", "rows of {t} tokens: the length must be in 1..=2^31-1");
        }
        let b = cu_seqlens.len();
        let mut bounds = vec![0i32; 2 * b * t];
        let (lo, hi) = bounds.split_at_mut(b * t);
        for (r, cu) in cu_seqlens.iter().enumerate() {
            if cu.first() != Some(&0) || cu.last().map(|&e| e as usize) != Some(t) {
                bail!("segments", "row {r}: cu_seqlens must run from 0 to the row length {t}, got {cu:?}");
            }
            if let Some(w) = cu.windows(2).find(|w| w[1] < w[0]) {
                bail!("segments", "row {r}: cu_seqlens decrease ({} after {}) in {cu:?}", w[1], w[0]);
            }
            for w in cu.windows(2) {
                let (s, e) = (w[0] as usize, w[1] as usize);
                lo[r * t + s..r * t + e].fill(s as i32);
                hi[r * t + s..r * t + e].fill(e as i32);
            }
        }
        Ok(Segments(Arc::new(Inner { t, cu: cu_seqlens, bounds, device: Mutex::new(None) })))
    }

    /// Every row one segment: plain causal attention.
    pub fn whole(b: usize, t: usize) -> Result<Segments> {
        Segments::new(t, vec![vec![0, t as u32]; b])
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.0.cu.len()
    }

    /// Tokens per row.
    pub fn seq_len(&self) -> usize {
        self.0.t
    }

    /// Row `r`'s cumulative boundaries.
    pub fn cu_seqlens(&self, r: usize) -> &[u32] {
        &self.0.cu[r]
    }

    /// Row `r`'s non-empty segments as (start, end) position ranges.
    pub fn ranges(&self, r: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.0.cu[r].windows(2).map(|w| (w[0] as usize, w[1] as usize)).filter(|(s, e)| e > s)
    }

    /// True when every row is a single segment, where attention is the plain causal one.
    pub fn is_whole(&self) -> bool {
        self.0.cu.iter().all(|cu| cu.iter().all(|&c| c == 0 || c as usize == self.0.t))
    }

    /// Per token (row-major (b, t)): the first position of its segment, and one past its last.
    pub fn bounds(&self) -> (&[i32], &[i32]) {
        self.0.bounds.split_at(self.0.bounds.len() / 2)
    }

    /// The per-token bounds, i32 (2, b, t), on `device` (uploaded there once).
    pub fn on_device(&self, device: Device) -> Result<Tensor> {
        let mut cached = self.0.device.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = cached.as_ref().filter(|d| d.device() == device) {
            return Ok(d.clone());
        }
        let d = Tensor::from_vec(self.0.bounds.clone(), vec![2, self.rows(), self.0.t], Device::Cpu)?.to_device(device)?;
        *cached = Some(d.clone());
        Ok(d)
    }
}
