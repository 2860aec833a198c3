//! Streams and events of the emulated device, with a GPU's semantics: each stream is an in-order
//! queue run by its own worker thread, so the host returns from a launch, a copy or a memset at
//! once and only a synchronisation (of a stream, an event, a blocking copy) makes it wait; work on
//! two streams runs concurrently unless an event orders it.
//!
//! A stream is also what `emu/ferro_emu_stream.h` calls a `cudaStream_t`: its address points at a
//! `#[repr(C)]` struct whose first member is the `ferro_emu_stream_ops` table, so the emulated
//! NCCL enqueues its collectives on it the way a real library's kernels go on a CUDA stream.
//!
//! Race mode (`FERROLM_EMU_RACE=SEED`, or `CudaBackend::emulator_race`): every worker sleeps a
//! pseudo-random while (0 to 400 µs, from the seed and the stream) before each item. The result
//! of correctly ordered work does not change; a cross-stream read without an event wait, or a
//! host read without a synchronisation, then gives wrong or varying bits.
//!
//! Host waits and training steps are counted by `crate::instrument`, for GPU and emulator alike.
use ferrolm_tensor::{Error, Result};
use std::collections::VecDeque;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One queued item; an `Err` becomes the stream's sticky error (reported by the next wait).
pub(crate) type Job = Box<dyn FnOnce() -> std::result::Result<(), String> + Send>;

/// The table of `ferro_emu_stream.h`.
#[repr(C)]
struct StreamOps {
    magic: u32,
    enqueue: unsafe extern "C" fn(*mut c_void, Option<unsafe extern "C" fn(*mut c_void)>, *mut c_void) -> c_int,
}

const MAGIC: u32 = 0xFE57_A300;
static OPS: StreamOps = StreamOps { magic: MAGIC, enqueue: abi_enqueue };

/// A foreign item (the C ABI's fn and arg): called exactly once, on the worker.
struct Foreign(unsafe extern "C" fn(*mut c_void), *mut c_void);
// SAFETY: the ABI's contract: fn(arg) may run on any thread (the stream's worker).
unsafe impl Send for Foreign {}

/// `enqueue(stream, fn, arg)` of the C ABI: 0 when queued, non-zero when the stream is closed.
unsafe extern "C" fn abi_enqueue(stream: *mut c_void, f: Option<unsafe extern "C" fn(*mut c_void)>, arg: *mut c_void) -> c_int {
    let (Some(f), false) = (f, stream.is_null()) else { return 1 };
    // SAFETY: a non-null emulated stream handle is the address of a live `EmuStream` (the ABI's
    // contract: the caller holds the stream until it is destroyed).
    let s = unsafe { &*(stream as *const EmuStream) };
    if s.ops.magic != MAGIC {
        return 1;
    }
    let item = Foreign(f, arg);
    let job: Job = Box::new(move || {
        let item = item;
        // SAFETY: the ABI's contract: fn(arg) is called once, on the stream's worker.
        unsafe { (item.0)(item.1) };
        Ok(())
    });
    match s.q.push(job) {
        Ok(_) => 0,
        Err(job) => {
            // Not queued: the caller keeps arg, and fn must never run.
            std::mem::forget(job);
            1
        }
    }
}

struct State {
    jobs: VecDeque<Job>,
    /// Items ever queued / ever finished (an event is a count of queued items to wait for).
    queued: u64,
    done: u64,
    closed: bool,
    error: Option<String>,
}

struct Queue {
    st: Mutex<State>,
    cv: Condvar,
    /// Race mode: the seed (0: off), shared with the backend that made the stream.
    race: Arc<AtomicU64>,
    id: usize,
}

impl Queue {
    /// Queues `job`; its position (1-based), or the job back when the stream is closed.
    fn push(&self, job: Job) -> std::result::Result<u64, Job> {
        let mut st = lock(&self.st);
        if st.closed {
            return Err(job);
        }
        st.jobs.push_back(job);
        st.queued += 1;
        let n = st.queued;
        drop(st);
        self.cv.notify_all();
        Ok(n)
    }
    fn wait_for(&self, target: u64) -> Result<()> {
        let mut st = lock(&self.st);
        while st.done < target {
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        match &st.error {
            Some(e) => Err(Error::new("emulated stream", e.clone())),
            None => Ok(()),
        }
    }
    fn run(self: Arc<Self>) {
        let mut rng = 0u64;
        loop {
            let job = {
                let mut st = lock(&self.st);
                loop {
                    if let Some(j) = st.jobs.pop_front() {
                        break j;
                    }
                    if st.closed {
                        return;
                    }
                    st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
                }
            };
            let seed = self.race.load(Ordering::Relaxed);
            if seed != 0 {
                if rng == 0 {
                    rng = splitmix(seed ^ (self.id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1;
                }
                rng = splitmix(rng);
                let us = rng % 400;
                if us < 40 {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(Duration::from_micros(us));
                }
            }
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job))
                .unwrap_or_else(|_| Err("an item on the stream panicked".into()));
            let mut st = lock(&self.st);
            st.done += 1;
            if let (Err(e), None) = (r, &st.error) {
                st.error = Some(e);
            }
            drop(st);
            self.cv.notify_all();
        }
    }
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// An emulated stream. Its address is the `cudaStream_t` of the C ABI (first member: the ops).
#[repr(C)]
pub struct EmuStream {
    ops: &'static StreamOps,
    q: Arc<Queue>,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for EmuStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EmuStream#{}", self.q.id)
    }
}

impl EmuStream {
    pub(crate) fn new(race: Arc<AtomicU64>) -> Result<Arc<EmuStream>> {
        static IDS: AtomicUsize = AtomicUsize::new(0);
        let id = IDS.fetch_add(1, Ordering::Relaxed);
        let st = State { jobs: VecDeque::new(), queued: 0, done: 0, closed: false, error: None };
        let q = Arc::new(Queue { st: Mutex::new(st), cv: Condvar::new(), race, id });
        let w = q.clone();
        let h = std::thread::Builder::new()
            .name(format!("emu-stream-{id}"))
            .spawn(move || w.run())
            .map_err(|e| Error::new("new_stream", format!("cannot start the emulated stream's worker: {e}")))?;
        Ok(Arc::new(EmuStream { ops: &OPS, q, worker: Mutex::new(Some(h)) }))
    }
    /// The C ABI's handle.
    pub fn handle(&self) -> *mut c_void {
        self as *const EmuStream as *mut c_void
    }
    /// Queues `job` behind everything queued so far.
    pub(crate) fn enqueue(&self, job: Job) -> Result<()> {
        self.q.push(job).map(|_| ()).map_err(|_| Error::new("emulated stream", "the stream is destroyed"))
    }
    /// An event at the current end of the stream (completes when everything queued so far has
    /// run). It carries the time its marker ran, for `elapsed_ms`.
    pub(crate) fn record(&self) -> Result<EmuEvent> {
        let at = Arc::new(OnceLock::new());
        let a = at.clone();
        let n = self.q.push(Box::new(move || {
            let _ = a.set(Instant::now());
            Ok(())
        }));
        let target = n.map_err(|_| Error::new("record_event", "the stream is destroyed"))?;
        Ok(EmuEvent { q: self.q.clone(), target, at })
    }
    /// Makes later work on this stream wait for `ev` (no host wait).
    pub(crate) fn wait_event(&self, ev: &EmuEvent) -> Result<()> {
        if Arc::ptr_eq(&self.q, &ev.q) {
            return Ok(()); // in-order already
        }
        let (q, target) = (ev.q.clone(), ev.target);
        self.enqueue(Box::new(move || q.wait_for(target).map_err(|e| e.to_string())))
    }
    /// Host wait for everything queued so far (counted by the caller, `CudaStream::synchronize`).
    pub(crate) fn synchronize(&self) -> Result<()> {
        let target = lock(&self.q.st).queued;
        self.q.wait_for(target)
    }
}

impl Drop for EmuStream {
    /// Destroying a stream lets its queued work finish (as cudaStreamDestroy): the worker drains
    /// the queue, then ends; the drop waits for it, so no item outlives the memory it uses.
    fn drop(&mut self) {
        lock(&self.q.st).closed = true;
        self.q.cv.notify_all();
        if let Some(h) = lock(&self.worker).take() {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

/// An event of an emulated stream: the count of items queued on it when it was recorded.
#[derive(Clone)]
pub struct EmuEvent {
    q: Arc<Queue>,
    target: u64,
    at: Arc<OnceLock<Instant>>,
}

impl std::fmt::Debug for EmuEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EmuEvent(stream {}, item {})", self.q.id, self.target)
    }
}

impl EmuEvent {
    pub(crate) fn is_complete(&self) -> bool {
        lock(&self.q.st).done >= self.target
    }
    /// Host wait for the event (counted by the caller, `CudaEvent::synchronize`).
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.q.wait_for(self.target)
    }
    pub(crate) fn elapsed_ms(&self, end: &EmuEvent) -> Result<f32> {
        end.synchronize()?;
        self.q.wait_for(self.target)?;
        match (self.at.get(), end.at.get()) {
            (Some(a), Some(b)) => Ok(b.saturating_duration_since(*a).as_secs_f32() * 1e3),
            _ => Err(Error::new("elapsed_ms", "an event's marker did not run")),
        }
    }
}

/// The race seed of `FERROLM_EMU_RACE` (0: off). A value that is not a number is refused once,
/// with the variable named, and race mode stays off.
pub(crate) fn race_from_env() -> u64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    *SEED.get_or_init(|| match std::env::var("FERROLM_EMU_RACE") {
        Err(_) => 0,
        Ok(v) if v.trim().is_empty() => 0,
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(s) => s.max(1),
            Err(_) => {
                eprintln!("ferrolm: FERROLM_EMU_RACE={v:?} is not a number (a seed, e.g. 1); race mode is off");
                0
            }
        },
    })
}
