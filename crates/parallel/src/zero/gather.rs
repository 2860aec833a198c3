//! The ZeRO-3 parameter gatherer (s_p > 1): a released parameter bucket is all-gathered over P
//! when it is first read, and the next bucket in the direction of the pass is prefetched
//! (DeepSpeed's and AMSP's prefetch), with at most `MAX_LIVE` buckets materialised at a time.
use crate::comm::Comm;
use ferrolm_tensor::{Error, Refill, Result, Storage, Tensor};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};

/// Materialises released parameter buckets (s_p > 1): an all-gather over P on a miss, and a
/// prefetch of the next bucket in the direction of the pass (AMSP/DeepSpeed's prefetch), with
/// at most `MAX_LIVE` buckets materialised.
pub(crate) struct Gatherer {
    p: Comm,
    pshards: Vec<Tensor>,
    flats: Vec<Tensor>,
    me: Weak<Gatherer>,
    state: Mutex<GatherState>,
    /// Set while `release_all` waits for prefetches: their completion must not start more.
    releasing: std::sync::atomic::AtomicBool,
}

#[derive(Default)]
struct GatherState {
    live: VecDeque<usize>,
    backward: bool,
    gathers: Vec<usize>,
}

const MAX_LIVE: usize = 3;

struct BucketRefill {
    g: Weak<Gatherer>,
    i: usize,
}

impl Refill for BucketRefill {
    fn refill(&self) -> Result<Storage> {
        let g = self.g.upgrade().ok_or_else(|| Error::new("zero", "parameter bucket read after its engine was dropped"))?;
        let full = {
            let i = self.i;
            let _site = crate::comm::call_site(|| format!("bucket {i}, parameter all-gather on first read"));
            g.p.all_gather(&g.pshards[self.i])?
        };
        g.state.lock().unwrap_or_else(|e| e.into_inner()).gathers[self.i] += 1;
        g.materialised(self.i)?;
        full.storage_copy()
    }
}

impl Gatherer {
    fn refill_for(&self, i: usize) -> Arc<dyn Refill> {
        Arc::new(BucketRefill { g: self.me.clone(), i })
    }

    /// Bookkeeping after bucket `i` became readable: prefetch its successor, evict the oldest.
    fn materialised(&self, i: usize) -> Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.live.retain(|&k| k != i);
        st.live.push_back(i);
        let next = if st.backward { i.checked_sub(1) } else { Some(i + 1).filter(|&k| k < self.flats.len()) };
        if let Some(k) = next {
            if self.flats[k].is_released() {
                let phase = if st.backward { "backward" } else { "forward" };
                let _site = crate::comm::call_site(|| format!("bucket {k}, {phase} parameter prefetch all-gather"));
                let w = self.p.all_gather_async(&self.pshards[k])?;
                let me = self.me.clone();
                self.flats[k].prefetch(Box::new(move |s| {
                    *s = w.wait()?.storage_copy()?;
                    match me.upgrade() {
                        Some(g) if !g.releasing.load(std::sync::atomic::Ordering::Acquire) => g.materialised(k),
                        _ => Ok(()),
                    }
                }))?;
                st.gathers[k] += 1;
                st.live.retain(|&x| x != k);
                st.live.push_back(k);
            }
        }
        while st.live.len() > MAX_LIVE {
            let old = st.live.pop_front().expect("non-empty");
            if old == i || Some(old) == next || !self.flats[old].try_release(self.refill_for(old))? {
                st.live.push_back(old);
                break;
            }
        }
        Ok(())
    }

    /// Releases every materialised bucket (between passes).
    pub fn release_all(&self, backward: bool) -> Result<()> {
        use std::sync::atomic::Ordering;
        self.releasing.store(true, Ordering::Release);
        // Not under the state lock: waiting for a prefetch runs its fill.
        let res = (|| {
            for (i, f) in self.flats.iter().enumerate() {
                if !f.is_released() {
                    f.wait()?; // a prefetch in flight completes first
                    f.release(self.refill_for(i))?;
                }
            }
            Ok(())
        })();
        self.releasing.store(false, Ordering::Release);
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.backward = backward;
        st.live.clear();
        res
    }

    /// A gatherer over `pshards` (this rank's parameter range of each bucket) and `flats` (the
    /// buckets the model's parameters view), every bucket released.
    pub fn new(params: Comm, pshards: Vec<Tensor>, flats: Vec<Tensor>) -> Result<Arc<Gatherer>> {
        let n = flats.len();
        let g = Arc::new_cyclic(|me| Gatherer {
            p: params,
            pshards,
            flats,
            me: me.clone(),
            state: Mutex::new(GatherState { gathers: vec![0; n], ..Default::default() }),
            releasing: std::sync::atomic::AtomicBool::new(false),
        });
        g.release_all(false)?;
        Ok(g)
    }

    /// Parameter all-gathers each bucket has needed so far.
    pub fn gathers(&self) -> Vec<usize> {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).gathers.clone()
    }
}

/// Parameter all-gathers per bucket per micro-batch when s_p > 1: one before the bucket's
/// forward, one before (or prefetched for) its backward; a tied embedding, used again by the
/// head at the end of the forward pass, once more (the fused head + loss makes its gradients in
/// the forward and never reads the weight in backward; an unfused head, `--loss-chunk-tokens 0`,
/// reads it there once more, which this does not count). This is what the engine does (tests
/// hold it to it) and what the planner's cost model charges.
pub fn expected_gathers(params: usize, buckets: usize, tied: bool) -> Vec<usize> {
    (0..buckets)
        .map(|i| {
            if params == 1 {
                0
            } else if i == 0 && tied && buckets > MAX_LIVE {
                3
            } else {
                2
            }
        })
        .collect()
}
