//! Instruments shared by the GPU and the emulator, the bottom layer of the crate (it imports no
//! other module of it): the host-wait counts with their call sites, the training-step marks
//! (`StepScope`), and the kernel profile (`profile`). The execution layer (`crate::exec`) feeds
//! them on both paths: a host wait is counted by the stream and event handles whichever device
//! runs them, and a GPU's timed launches reach the profile as a `profile::TimedSpan`, so this
//! module needs no CUDA type.
//!
//! Host waits (`FERROLM_EMU_REPORT=1`, `host_waits`): every synchronisation of the host with the
//! device, emulated or a GPU (the waiting functions of `exec`, `device.rs` and `pinned.rs` count on
//! both paths), is counted with its call site: the caller's `file:line` (`#[track_caller]` through
//! the waiting functions, so it survives a stripped release binary), or where that caller is
//! inside this crate or the tensor crate, the first frame of a backtrace outside them. At exit the report prints `emulator host waits: TOTAL (PER_STEP per step)` and
//! one line per call site. Training marks its steps (`StepScope`), so the per-step figure counts
//! only the waits made for a step (on its thread, or on a thread working for it).
use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

pub mod profile;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

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
        profile::step_begin();
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
            profile::step_end();
        }
        IN_STEP.with(|c| c.set(c.get().saturating_sub(1)));
    }
}
