//! The built-in kernel profile, in the manner of `torch.profiler`'s `key_averages()`.
//!
//! Off by default; on with `FERROLM_PROFILE=1` in the environment or `profile::enable(true)`
//! (the training tools' `--profile`). While on, every kernel launch and every cuBLASLt GEMM on
//! any `CudaBackend` is recorded with its name, grid, block and the number of elements its
//! launcher says it touches (`Launch::elems`). On a GPU each launch is bracketed by two
//! timing events on its stream; their difference is the launch's device time (the events are
//! read lazily, in batches, so profiling adds no host wait per launch). On the emulator the
//! launches are counted and the times are zero: `ProfileReport::timed` is false there.
//!
//! Steps come from `StepScope` (the trainer marks each optimizer step), so the report can say
//! how many launches one training step makes. `report()` groups the records by kernel name.
//! The off path costs one relaxed atomic load per launch.
//!
//! Whether on or off, it counts the fused GEMMs (an addend, or f32 out of bf16) that cuBLASLt
//! refused and that were composed from separate kernels instead (`gemm_fallbacks`): on a GPU
//! that is a silent slowdown, which the report and `profile.json` make visible (target 0).
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;

/// 0: not yet read from the environment, 1: off, 2: on.
static STATE: AtomicU8 = AtomicU8::new(0);
static INNER: Mutex<Inner> = Mutex::new(Inner::new());
/// Whether any record was timed with events (a GPU backend recorded one).
static TIMED: AtomicBool = AtomicBool::new(false);
/// Fused GEMMs refused by cuBLASLt and composed instead, since the start or the last `reset`.
static GEMM_FALLBACKS: AtomicU64 = AtomicU64::new(0);

/// Elements above which a launch must use at least one block per SM (`ProfileReport::small_grids`).
pub const BIG_LAUNCH_ELEMS: u64 = 1 << 20;
/// Events are read back once this many launches are waiting (bounds the events held).
const RESOLVE_EVERY: usize = 4096;

/// Whether launches are being recorded.
pub fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        2 => true,
        1 => false,
        _ => {
            let on = env_turns_on(std::env::var("FERROLM_PROFILE").ok().as_deref());
            // Another thread may have called `enable` meanwhile: only fill in the unread state.
            let _ = STATE.compare_exchange(0, if on { 2 } else { 1 }, Ordering::Relaxed, Ordering::Relaxed);
            STATE.load(Ordering::Relaxed) == 2
        }
    }
}

/// Whether a `FERROLM_PROFILE` value turns the profile on: any value but none, empty, `0`,
/// `false` or `off`.
pub fn env_turns_on(v: Option<&str>) -> bool {
    v.is_some_and(|v| !matches!(v.trim().to_ascii_lowercase().as_str(), "" | "0" | "false" | "off"))
}

/// Turns recording on or off (on: as `FERROLM_PROFILE=1`).
pub fn enable(on: bool) {
    STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// Forgets every record and step (the enabled state stays).
pub fn reset() {
    let mut g = lock();
    let keep_step = g.in_step;
    *g = Inner::new();
    g.in_step = keep_step;
    TIMED.store(false, Ordering::Relaxed);
    GEMM_FALLBACKS.store(0, Ordering::Relaxed);
}

/// Counts one fused GEMM that cuBLASLt refused and the caller composes from separate kernels.
pub(crate) fn note_gemm_fallback() {
    GEMM_FALLBACKS.fetch_add(1, Ordering::Relaxed);
}

/// Fused GEMMs refused by cuBLASLt and composed from separate kernels instead, since the start
/// of the process or the last `reset` (counted with the profile off too).
pub fn gemm_fallbacks() -> u64 {
    GEMM_FALLBACKS.load(Ordering::Relaxed)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LaunchShape {
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub elems: u64,
}

/// A launch bracketed on its stream by two timing events, read back later (the execution
/// layer's events: the profile needs no CUDA type).
pub(crate) trait TimedSpan: Send {
    /// The host waits for the closing event (a counted host wait).
    fn wait_end(&self) -> ferrolm_tensor::Result<()>;
    /// Device milliseconds between the two events (waits for the closing one).
    fn elapsed_ms(&self) -> ferrolm_tensor::Result<f32>;
}

struct Pending {
    name: &'static str,
    /// The step it ran in (index into `steps_ms`), if inside one.
    step: Option<usize>,
    span: Box<dyn TimedSpan>,
}

#[derive(Default, Clone, Debug)]
struct Stat {
    launches: u64,
    total_ms: f64,
    max_grid: (u32, u32, u32),
    max_block: u32,
}

struct Inner {
    stats: BTreeMap<&'static str, Stat>,
    pending: Vec<Pending>,
    /// Launches made inside each finished step.
    steps: Vec<u64>,
    /// Device milliseconds of the launches inside each step (finished or open).
    steps_ms: Vec<f64>,
    /// Launches since the open step began.
    current: u64,
    in_step: u32,
    small: Vec<SmallGrid>,
    sm_count: u32,
    device: String,
}

impl Inner {
    const fn new() -> Inner {
        Inner {
            stats: BTreeMap::new(),
            pending: Vec::new(),
            steps: Vec::new(),
            steps_ms: Vec::new(),
            current: 0,
            in_step: 0,
            small: Vec::new(),
            sm_count: 0,
            device: String::new(),
        }
    }
    fn count(&mut self, name: &'static str, shape: LaunchShape, ms: f64, sm_count: u32, device: &dyn Fn() -> String) {
        let s = self.stats.entry(name).or_default();
        s.launches += 1;
        s.total_ms += ms;
        let blocks = |g: (u32, u32, u32)| g.0 as u64 * g.1 as u64 * g.2 as u64;
        if blocks(shape.grid) > blocks(s.max_grid) {
            s.max_grid = shape.grid;
        }
        s.max_block = s.max_block.max(shape.block);
        if self.in_step > 0 {
            self.current += 1;
        }
        if self.device.is_empty() {
            self.device = device();
            self.sm_count = sm_count;
        }
        if shape.elems > BIG_LAUNCH_ELEMS && blocks(shape.grid) < sm_count as u64 && self.small.len() < 64 {
            self.small.push(SmallGrid { name, elems: shape.elems, grid: shape.grid, block: shape.block });
        }
    }
    /// Reads back every pending pair of events (waits for the last one).
    fn resolve(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        if let Some(last) = pending.last() {
            let _ = last.span.wait_end();
        }
        for p in pending {
            let ms = p.span.elapsed_ms().map(f64::from).unwrap_or(0.0);
            if let Some(s) = self.stats.get_mut(p.name) {
                s.total_ms += ms;
            }
            if let Some(t) = p.step.and_then(|i| self.steps_ms.get_mut(i)) {
                *t += ms;
            }
        }
    }
}

fn lock() -> std::sync::MutexGuard<'static, Inner> {
    INNER.lock().unwrap_or_else(|e| e.into_inner())
}

/// Records one launch without timing (the emulator, or a GPU whose events failed).
pub(crate) fn count(name: &'static str, shape: LaunchShape, sm_count: u32, device: &dyn Fn() -> String) {
    lock().count(name, shape, 0.0, sm_count, device);
}

/// Records one timed launch: `span` brackets it on its stream.
pub(crate) fn timed(name: &'static str, shape: LaunchShape, span: Box<dyn TimedSpan>, sm_count: u32, device: &dyn Fn() -> String) {
    TIMED.store(true, Ordering::Relaxed);
    let mut g = lock();
    g.count(name, shape, 0.0, sm_count, device);
    let step = (g.in_step > 0).then(|| g.steps.len());
    g.pending.push(Pending { name, step, span });
    if g.pending.len() >= RESOLVE_EVERY {
        g.resolve();
    }
}

/// A training step begins (`StepScope::begin` on the outermost scope of a thread).
pub(crate) fn step_begin() {
    if !enabled() {
        return;
    }
    let mut g = lock();
    if g.in_step == 0 {
        g.current = 0;
        let n = g.steps.len();
        g.steps_ms.resize(n + 1, 0.0);
    }
    g.in_step += 1;
}

/// A training step ends.
pub(crate) fn step_end() {
    if !enabled() {
        return;
    }
    let mut g = lock();
    if g.in_step == 0 {
        return;
    }
    g.in_step -= 1;
    if g.in_step == 0 {
        let n = g.current;
        g.steps.push(n);
    }
}

/// A launch that touched more than `BIG_LAUNCH_ELEMS` elements on fewer blocks than the device
/// has SMs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SmallGrid {
    pub name: &'static str,
    pub elems: u64,
    pub grid: (u32, u32, u32),
    pub block: u32,
}

/// One kernel's line of the profile.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelStat {
    pub name: String,
    pub launches: u64,
    /// Device milliseconds over all its launches (0 when not `timed`).
    pub total_ms: f64,
    /// Its part of the profile's total time (0..1; 0 when not `timed`).
    pub share: f64,
    pub mean_us: f64,
    /// The largest grid it was launched with (by block count).
    pub max_grid: (u32, u32, u32),
    pub max_block: u32,
}

/// What the profile saw: kernels sorted by total time (by launches when not timed).
#[derive(Clone, Debug, PartialEq)]
pub struct ProfileReport {
    /// The device's name (the first backend that launched).
    pub device: String,
    /// SMs of that device (132 on the emulator, which models an H100/H200).
    pub sm_count: u32,
    /// True when times come from CUDA events on a GPU; false on the emulator, where only the
    /// counts mean anything.
    pub timed: bool,
    pub kernels: Vec<KernelStat>,
    /// Launches made inside each finished training step, in order.
    pub step_launches: Vec<u64>,
    /// Device milliseconds of each finished step's launches (zeros when not `timed`): against
    /// the step's wall time, the difference is time the device waited for the host.
    pub step_ms: Vec<f64>,
    pub small_grids: Vec<SmallGrid>,
    /// Fused GEMMs cuBLASLt refused, composed from a plain GEMM, an add and a cast instead
    /// (`gemm_fallbacks`; target 0).
    pub gemm_fallbacks: u64,
}

impl ProfileReport {
    pub fn launches(&self) -> u64 {
        self.kernels.iter().map(|k| k.launches).sum()
    }
    pub fn total_ms(&self) -> f64 {
        self.kernels.iter().map(|k| k.total_ms).sum()
    }
    /// The median of the per-step launch counts (None before a step has finished).
    pub fn launches_per_step(&self) -> Option<f64> {
        median(self.step_launches.iter().map(|&v| v as f64).collect())
    }
    /// The median of the per-step device milliseconds (None before a timed step has finished).
    pub fn ms_per_step(&self) -> Option<f64> {
        if !self.timed {
            return None;
        }
        median(self.step_ms.clone())
    }

    /// The table printed at exit: one line per kernel, the slowest first.
    pub fn table(&self) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let per_step = match (self.launches_per_step(), self.ms_per_step()) {
            (None, _) => "no finished step".to_string(),
            (Some(v), None) => format!("{v:.0} launches per step"),
            (Some(v), Some(ms)) => format!("{v:.0} launches and {ms:.3} ms of device time per step"),
        };
        let _ = writeln!(
            s,
            "kernel profile: {}, {} launches over {} steps ({per_step}), {:.3} ms of device time{}",
            self.device,
            self.launches(),
            self.step_launches.len(),
            self.total_ms(),
            if self.timed { " (CUDA events)" } else { " (emulator: launches counted, times meaningless)" }
        );
        let _ = writeln!(s, "{:>11} {:>7} {:>9} {:>10}  {:<18} kernel", "total ms", "share", "launches", "mean µs", "largest grid");
        for k in &self.kernels {
            let grid = format!("({}, {}, {})x{}", k.max_grid.0, k.max_grid.1, k.max_grid.2, k.max_block);
            let _ = writeln!(
                s,
                "{:>11.3} {:>6.1}% {:>9} {:>10.2}  {:<18} {}",
                k.total_ms,
                100.0 * k.share,
                k.launches,
                k.mean_us,
                grid,
                k.name
            );
        }
        for g in &self.small_grids {
            let _ = writeln!(
                s,
                "warning: {} touched {} elements on grid ({}, {}, {}), fewer blocks than the {} SMs",
                g.name, g.elems, g.grid.0, g.grid.1, g.grid.2, self.sm_count
            );
        }
        if self.gemm_fallbacks > 0 {
            let _ = writeln!(
                s,
                "warning: {} fused GEMMs refused by cuBLASLt were composed from separate kernels (gemm_fallbacks)",
                self.gemm_fallbacks
            );
        }
        s
    }
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 })
}

/// The profile so far (reads back every pending event: waits for the last recorded launch).
pub fn report() -> ProfileReport {
    let mut g = lock();
    g.resolve();
    let timed = TIMED.load(Ordering::Relaxed);
    let total: f64 = g.stats.values().map(|s| s.total_ms).sum();
    let mut kernels: Vec<KernelStat> = g
        .stats
        .iter()
        .map(|(name, s)| KernelStat {
            name: name.to_string(),
            launches: s.launches,
            total_ms: s.total_ms,
            share: if total > 0.0 { s.total_ms / total } else { 0.0 },
            mean_us: if s.launches > 0 { 1e3 * s.total_ms / s.launches as f64 } else { 0.0 },
            max_grid: s.max_grid,
            max_block: s.max_block,
        })
        .collect();
    kernels.sort_by(|a, b| b.total_ms.total_cmp(&a.total_ms).then(b.launches.cmp(&a.launches)).then(a.name.cmp(&b.name)));
    ProfileReport {
        device: if g.device.is_empty() { "no CUDA launch".into() } else { g.device.clone() },
        sm_count: g.sm_count,
        timed,
        kernels,
        step_launches: g.steps.clone(),
        step_ms: g.steps_ms.iter().take(g.steps.len()).copied().collect(),
        small_grids: g.small.clone(),
        gemm_fallbacks: gemm_fallbacks(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_documented_form_of_ferrolm_profile() {
        for on in ["1", "yes", "true", "on"] {
            assert!(env_turns_on(Some(on)), "{on}");
        }
        for off in [None, Some(""), Some("0"), Some("false"), Some("OFF"), Some(" 0 ")] {
            assert!(!env_turns_on(off), "{off:?}");
        }
    }

    #[test]
    fn the_median_of_the_step_counts_and_the_table() {
        let k = |name: &str, launches, total_ms| KernelStat {
            name: name.into(),
            launches,
            total_ms,
            share: 0.0,
            mean_us: 0.0,
            max_grid: (132, 1, 1),
            max_block: 256,
        };
        let mut r = ProfileReport {
            device: "dev".into(),
            sm_count: 132,
            timed: true,
            kernels: vec![k("a", 10, 3.0), k("b", 4, 1.0)],
            step_launches: vec![],
            step_ms: vec![],
            small_grids: vec![],
            gemm_fallbacks: 0,
        };
        assert_eq!(r.launches_per_step(), None);
        r.step_launches = vec![9, 5, 7];
        assert_eq!(r.launches_per_step(), Some(7.0));
        r.step_launches = vec![9, 5, 7, 6];
        assert_eq!(r.launches_per_step(), Some(6.5));
        assert_eq!((r.launches(), r.total_ms()), (14, 4.0));
        r.step_launches = vec![9, 5, 7];
        let t = r.table();
        assert!(t.contains("14 launches over 3 steps (7 launches per step)"), "{t}");
        assert!(t.lines().nth(2).is_some_and(|l| l.ends_with(" a") && l.contains("(132, 1, 1)x256")), "{t}");
        assert!(!t.contains("gemm_fallbacks"), "{t}");
        r.gemm_fallbacks = 3;
        assert!(r.table().contains("warning: 3 fused GEMMs refused by cuBLASLt were composed"), "{}", r.table());
    }
}
