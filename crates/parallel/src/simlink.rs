//! `SimLink`: a communicator wrapper whose collectives complete only after the time the cost
//! model (`cost.rs`) charges for them, so a CPU run shows whether communication is hidden
//! behind compute or exposed.
//!
//! Each rank's link is a FIFO served by its own thread: a collective's transfer starts when
//! every rank of the group has posted it (the inner collective has completed) and the link is
//! free, `start = max(all posted, end of the previous collective on this link)`, and ends at
//! `end = start + cost::seconds(kind, span, total bytes, model)`. Data cannot move before the
//! last rank arrives, so a rank that waits for a late peer does not hide link time behind that
//! wait. The result is handed over at `end`; a rank that computes past it waits for nothing.
//! Each group (and each split sub-group) is its own link; contention between groups is not
//! modelled.
use crate::comm::{Collective, Communicator, Completion, InFlightResult};
use crate::cost::{self, GroupSpan, LinkModel};
use ferrolm_tensor::{Result, Tensor};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

type LinkJob = (Box<dyn FnOnce() -> Result<ferrolm_tensor::Storage> + Send>, f64, std::sync::mpsc::Sender<Result<ferrolm_tensor::Storage>>);

pub struct SimLink {
    inner: Arc<dyn Communicator>,
    model: LinkModel,
    span: GroupSpan,
    /// The link's thread: transfers in launch order.
    jobs: Mutex<std::sync::mpsc::Sender<LinkJob>>,
    /// When the link thread's last transfer ends (shared with it).
    busy_until: Arc<Mutex<Instant>>,
}

impl SimLink {
    /// Wraps `inner`; the group's placement on nodes comes from its world ranks and
    /// `model.ranks_per_node`.
    pub fn wrap(inner: Arc<dyn Communicator>, model: LinkModel) -> Arc<SimLink> {
        let span = GroupSpan::of(inner.world_ranks(), model.ranks_per_node);
        let (tx, rx) = std::sync::mpsc::channel::<LinkJob>();
        let busy_until = Arc::new(Mutex::new(Instant::now()));
        let busy = busy_until.clone();
        let name = format!("link-{}", inner.name());
        let spawned = std::thread::Builder::new().name(name).spawn(move || {
            for (wait, secs, result) in rx {
                let r = wait();
                let end = {
                    let mut b = busy.lock().unwrap_or_else(|e| e.into_inner());
                    *b = (*b).max(Instant::now()) + Duration::from_secs_f64(secs);
                    *b
                };
                sleep_until(end);
                let _ = result.send(r);
            }
        });
        if let Err(e) = spawned {
            panic!("cannot start the simulated link's thread: {e}");
        }
        Arc::new(SimLink { inner, model, span, jobs: Mutex::new(tx), busy_until })
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
}

fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

impl Communicator for SimLink {
    crate::forward_to_inner!();
    fn launch(&self, op: Collective, x: &Tensor) -> Result<Completion> {
        let secs = self.seconds(op, x.numel() * x.dtype().size_in_bytes());
        let c = self.inner.launch(op, x)?;
        let (tx, rx) = std::sync::mpsc::channel();
        let (shape, dtype, device, wait) = (c.shape, c.dtype, c.device, c.wait);
        self.jobs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send((wait, secs, tx))
            .map_err(|_| ferrolm_tensor::Error::new("simlink", "the link thread has stopped"))?;
        let got: Arc<Mutex<Option<Result<ferrolm_tensor::Storage>>>> = Arc::default();
        let (g1, g2) = (got.clone(), got);
        let rx = Arc::new(Mutex::new(rx));
        let rx2 = rx.clone();
        let c = Completion::new(
            shape,
            dtype,
            device,
            move || {
                if let Some(r) = g1.lock().unwrap_or_else(|e| e.into_inner()).take() {
                    return r;
                }
                let r = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                r.map_err(|_| ferrolm_tensor::Error::new("simlink", "the link thread has stopped"))?
            },
            move || {
                let mut g = g2.lock().unwrap_or_else(|e| e.into_inner());
                if g.is_none() {
                    if let Ok(r) = rx2.lock().unwrap_or_else(|e| e.into_inner()).try_recv() {
                        *g = Some(r);
                    }
                }
                g.is_some()
            },
        );
        // The result's wait is the link's: a collective reading it chains behind it.
        Ok(c.produced_by(InFlightResult::Comm.producer()))
    }
    fn barrier(&self) -> Result<()> {
        let alpha = if self.size() <= 1 {
            0.0
        } else if self.span.nodes > 1 {
            self.model.inter.alpha_s
        } else {
            self.model.intra.alpha_s
        };
        self.inner.barrier()?;
        // After everything queued on the link, like a collective.
        let end = {
            let mut b = self.busy_until.lock().unwrap_or_else(|e| e.into_inner());
            *b = (*b).max(Instant::now()) + Duration::from_secs_f64(alpha);
            *b
        };
        sleep_until(end);
        Ok(())
    }
    fn split_named(&self, color: usize, key: usize, name: &str) -> Result<Arc<dyn Communicator>> {
        Ok(SimLink::wrap(self.inner.split_named(color, key, name)?, self.model))
    }
}
