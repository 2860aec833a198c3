//! `SimLink`: a communicator wrapper whose collectives complete only after the time the cost
//! model (`cost.rs`) charges for them, so a CPU run shows whether communication is hidden
//! behind compute or exposed.
//!
//! Each rank's link is a FIFO: a collective launched at `t` starts at
//! `start = max(t, end of the previous collective on this link)` and ends at
//! `end = start + cost::seconds(kind, span, total bytes, model)`. The delay is applied in the
//! result's pending fill (after the inner result is there, sleep until `end`), so a rank that
//! computes until after `end` before reading the result waits for nothing. Each group (and each
//! split sub-group) is its own link; contention between groups is not modelled, nor skew between
//! ranks beyond what the inner communicator's own wait adds.
use crate::comm::{Collective, CommStats, Communicator, Completion};
use crate::cost::{self, GroupSpan, LinkModel};
use ferrolm_tensor::{Result, Tensor};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub struct SimLink {
    inner: Arc<dyn Communicator>,
    model: LinkModel,
    span: GroupSpan,
    /// When the link finishes the last collective queued on it.
    free_at: Mutex<Instant>,
}

impl SimLink {
    /// Wraps `inner`; the group's placement on nodes comes from its world ranks and
    /// `model.ranks_per_node`.
    pub fn wrap(inner: Arc<dyn Communicator>, model: LinkModel) -> Arc<SimLink> {
        let span = GroupSpan::of(inner.world_ranks(), model.ranks_per_node);
        Arc::new(SimLink { inner, model, span, free_at: Mutex::new(Instant::now()) })
    }
    pub fn model(&self) -> &LinkModel {
        &self.model
    }
    pub fn span(&self) -> GroupSpan {
        self.span
    }
    /// Seconds this link charges for `op` on an input of `input_bytes`.
    pub fn seconds(&self, op: Collective, input_bytes: usize) -> f64 {
        cost::seconds(op.kind(), self.span, op.total_bytes(input_bytes, self.size()), &self.model)
    }
    /// Queues `secs` of link time; returns when it ends.
    fn reserve(&self, secs: f64) -> Instant {
        let mut free = self.free_at.lock().unwrap_or_else(|e| e.into_inner());
        let end = (*free).max(Instant::now()) + Duration::from_secs_f64(secs);
        *free = end;
        end
    }
}

fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

impl Communicator for SimLink {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn world_ranks(&self) -> &[usize] {
        self.inner.world_ranks()
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
    fn launch(&self, op: Collective, x: &Tensor) -> Result<Completion> {
        let secs = self.seconds(op, x.numel() * x.dtype().size_in_bytes());
        let c = self.inner.launch(op, x)?;
        let end = self.reserve(secs);
        Ok(c.then(
            move |s| {
                sleep_until(end);
                Ok(s)
            },
            move || Instant::now() >= end,
        ))
    }
    fn barrier(&self) -> Result<()> {
        let alpha = if self.size() <= 1 {
            0.0
        } else if self.span.nodes > 1 {
            self.model.inter.alpha_s
        } else {
            self.model.intra.alpha_s
        };
        let end = self.reserve(alpha);
        self.inner.barrier()?;
        sleep_until(end);
        Ok(())
    }
    fn split_named(&self, color: usize, key: usize, name: &str) -> Result<Arc<dyn Communicator>> {
        Ok(SimLink::wrap(self.inner.split_named(color, key, name)?, self.model))
    }
    fn stats(&self) -> CommStats {
        self.inner.stats()
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}
