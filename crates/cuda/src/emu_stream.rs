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
//! Host waits (`FERROLM_EMU_REPORT=1`, `host_waits`): every synchronisation of the host with the
//! device, emulated or a GPU (the waiting functions of `device.rs` and `pinned.rs` count on both
//! paths), is counted with its call site: the caller's `file:line` (`#[track_caller]` through
//! the waiting functions, so it survives a stripped release binary), or where that caller is
//! inside this crate or the tensor crate, the first frame of a backtrace outside them. At exit the report prints `emulator host waits: TOTAL (PER_STEP per step)` and
//! one line per call site. Training marks its steps (`StepScope`), so the per-step figure counts
//! only the waits made for a step (on its thread, or on a thread working for it).
use ferrolm_tensor::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
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

// ---- host-wait accounting ----------------------------------------------------------------------

/// What the emulator counted: host waits in all, those made while a training step ran, the
/// number of steps, and the count per call site (most first; sites are tracked only with
/// `FERROLM_EMU_REPORT=1` or after `track_host_wait_sites(true)`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HostWaits {
    pub total: u64,
    pub in_steps: u64,
    pub steps: u64,
    pub sites: Vec<(String, u64)>,
}

impl HostWaits {
    /// Host waits per training step (0 with no step).
    pub fn per_step(&self) -> f64 {
        if self.steps == 0 {
            0.0
        } else {
            self.in_steps as f64 / self.steps as f64
        }
    }
}

static TOTAL: AtomicU64 = AtomicU64::new(0);
static IN_STEPS: AtomicU64 = AtomicU64::new(0);
static STEPS: AtomicU64 = AtomicU64::new(0);
static TRACK_SITES: AtomicBool = AtomicBool::new(false);
static SITES: Mutex<Option<HashMap<String, u64>>> = Mutex::new(None);

pub(crate) fn report_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("FERROLM_EMU_REPORT").is_ok_and(|v| v == "1"))
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

/// Registers the exit report once (first emulated backend, with `FERROLM_EMU_REPORT=1`).
pub(crate) fn install_report() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    if !report_enabled() {
        return;
    }
    ONCE.call_once(|| {
        TRACK_SITES.store(true, Ordering::Relaxed);
        extern "C" {
            fn atexit(f: extern "C" fn()) -> c_int;
        }
        extern "C" fn at_exit() {
            eprint!("{}", format_report(&host_waits()));
        }
        // SAFETY: registers a plain function with the C library's exit handlers.
        unsafe { atexit(at_exit) };
    });
}

/// The report's text: the summary line, then one line per call site.
pub fn format_report(w: &HostWaits) -> String {
    let mut s = format!("emulator host waits: {} ({:.2} per step)\n", w.total, w.per_step());
    for (site, n) in &w.sites {
        s.push_str(&format!("  {n:>8}  {site}\n"));
    }
    s
}

/// Counts one host wait on the device (a GPU or the emulator), at the caller's site.
#[track_caller]
pub(crate) fn count_host_wait() {
    TOTAL.fetch_add(1, Ordering::Relaxed);
    if StepScope::in_step() {
        IN_STEPS.fetch_add(1, Ordering::Relaxed);
    }
    if TRACK_SITES.load(Ordering::Relaxed) {
        let site = call_site(std::panic::Location::caller());
        *lock(&SITES).get_or_insert_with(HashMap::new).entry(site).or_insert(0) += 1;
    }
}

/// The site of a host wait: `at` ("file:line", the innermost caller not marked
/// `#[track_caller]`) when it lies outside this crate and the tensor crate; else the first
/// backtrace frame outside them ("function (file:line)"), which needs debug symbols; else `at`
/// marked "(inside)".
fn call_site(at: &std::panic::Location<'_>) -> String {
    let file = at.file().replace('\\', "/");
    let inside = ["crates/cuda/src/", "crates/tensor/src/"].iter().any(|d| file.contains(d));
    if !inside {
        return format!("{file}:{}", at.line());
    }
    backtrace_site().unwrap_or_else(|| format!("(inside) {file}:{}", at.line()))
}

/// The first frame of the current backtrace outside the CUDA backend, the tensor crate and the
/// standard library: "function (file:line)", the file relative to the workspace; None when the
/// backtrace has no such frame or no file names (a binary without debug information).
fn backtrace_site() -> Option<String> {
    let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = here.parent().and_then(|p| p.parent()).unwrap_or(here);
    let internal = [here.join("src"), root.join("crates/tensor/src")];
    let cwd = std::env::current_dir().unwrap_or_default();
    let bt = std::backtrace::Backtrace::force_capture().to_string();
    let mut func: Option<&str> = None;
    for line in bt.lines() {
        let t = line.trim();
        if let Some(at) = t.strip_prefix("at ") {
            let Some(f) = func.take() else { continue };
            let at = at.rsplit_once(':').map_or(at, |(a, _col)| a); // file:line
                                                                    // Backtraces print paths under the working directory relative to it.
            let abs = if at.starts_with('/') { std::path::PathBuf::from(at) } else { cwd.join(at.trim_start_matches("./")) };
            if at.contains("/rustc/") || at.contains("/.cargo/registry/") || internal.iter().any(|d| abs.starts_with(d)) {
                continue;
            }
            let shown = abs.strip_prefix(root).unwrap_or(&abs).display().to_string();
            let f = f.rsplit_once("::h").filter(|(_, h)| h.len() == 16).map_or(f, |(a, _)| a);
            return Some(format!("{f} ({shown})"));
        }
        func = t.split_once(": ").map(|(_, f)| f).filter(|_| t.chars().next().is_some_and(|c| c.is_ascii_digit()));
    }
    None
}

/// What was counted since the start (or the last `reset_host_waits`).
pub fn host_waits() -> HostWaits {
    let mut sites: Vec<(String, u64)> = lock(&SITES).as_ref().map(|m| m.iter().map(|(k, v)| (k.clone(), *v)).collect()).unwrap_or_default();
    sites.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    HostWaits {
        total: TOTAL.load(Ordering::Relaxed),
        in_steps: IN_STEPS.load(Ordering::Relaxed),
        steps: STEPS.load(Ordering::Relaxed),
        sites,
    }
}

/// Zeroes the counts (tests measure one configuration at a time).
pub fn reset_host_waits() {
    TOTAL.store(0, Ordering::Relaxed);
    IN_STEPS.store(0, Ordering::Relaxed);
    STEPS.store(0, Ordering::Relaxed);
    *lock(&SITES) = None;
}

/// Records call sites from now on (`FERROLM_EMU_REPORT=1` does this too).
pub fn track_host_wait_sites(on: bool) {
    TRACK_SITES.store(on || report_enabled(), Ordering::Relaxed);
}

thread_local! {
    /// How many step scopes are open on this thread.
    static IN_STEP: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Marks a training step while alive: host waits made meanwhile on this thread count as the
/// step's, and its end counts one step. Work done for the step on another thread (a
/// communication thread staging a collective's input) is attributed with `on_behalf`.
pub struct StepScope {
    counts: bool,
}

impl StepScope {
    pub fn begin() -> StepScope {
        IN_STEP.with(|c| c.set(c.get() + 1));
        crate::profile::step_begin();
        StepScope { counts: true }
    }
    /// Whether this thread is inside a step.
    pub fn in_step() -> bool {
        IN_STEP.with(|c| c.get() > 0)
    }
    /// While alive, this thread's host waits count as a step's when `in_step` (the submitting
    /// thread's `in_step()`); counts no step of its own.
    pub fn on_behalf(in_step: bool) -> Option<StepScope> {
        in_step.then(|| {
            IN_STEP.with(|c| c.set(c.get() + 1));
            StepScope { counts: false }
        })
    }
}

impl Drop for StepScope {
    fn drop(&mut self) {
        if self.counts {
            STEPS.fetch_add(1, Ordering::Relaxed);
            crate::profile::step_end();
        }
        IN_STEP.with(|c| c.set(c.get().saturating_sub(1)));
    }
}
