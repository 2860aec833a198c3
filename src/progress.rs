//! Progress bars (indicatif) on stderr, and the report lines the tools print on stdout.
//!
//! Every bar hangs off one process-wide `MultiProgress`, so nested bars (evaluation inside
//! training) stack, and [`report`] lines and log lines are printed while the bars are lifted:
//! they land above the bars, never inside one. When stderr is not a terminal indicatif draws
//! nothing (no escape codes in a pipe or a log file); report lines are printed regardless. On
//! several ranks only rank 0 draws and reports (see [`crate::logging::set_rank`]).
use crate::logging::is_rank_zero;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use std::io::Write;
use std::sync::LazyLock;
use std::time::Duration;

static BARS: LazyLock<MultiProgress> = LazyLock::new(MultiProgress::new);

/// Runs `f` with the progress bars cleared from the terminal, then redraws them.
pub fn suspend<R>(f: impl FnOnce() -> R) -> R {
    BARS.suspend(f)
}

/// Prints `line` on stdout above the progress bars, on rank 0 only. Returns whether it
/// printed. For the lines users and scripts read (`step …`, `val loss …`, `saved checkpoint …`).
pub fn report(line: &str) -> bool {
    if !is_rank_zero() {
        return false;
    }
    suspend(|| {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    });
    true
}

/// A progress bar that is drawn on rank 0 and, there, only when stderr is a terminal. It is
/// cleared when dropped, so an error path leaves no stale bar behind.
pub struct Progress {
    bar: ProgressBar,
    draws: bool,
}

fn style(template: &str) -> ProgressStyle {
    ProgressStyle::with_template(template).expect("progress templates are fixed strings").progress_chars("=> ")
}

impl Progress {
    fn attach(bar: ProgressBar, template: &str, label: &str) -> Progress {
        if !is_rank_zero() {
            return Progress { bar: ProgressBar::hidden(), draws: false };
        }
        let bar = BARS.add(bar.with_style(style(template)).with_prefix(label.to_string()));
        Progress { bar, draws: true }
    }

    /// `total` optimizer or evaluation steps: position, rate and ETA, and a message (the loss).
    pub fn steps(total: u64, label: &str) -> Progress {
        Self::attach(ProgressBar::new(total), "{prefix} [{bar:30}] {pos}/{len} | {per_sec} | ETA {eta} {msg}", label)
    }

    /// `total` items of some work (tensors converted, files tokenized, windows scored).
    pub fn items(total: u64, label: &str) -> Progress {
        Self::attach(ProgressBar::new(total), "{prefix} [{bar:30}] {human_pos}/{human_len} | {per_sec} | ETA {eta} {msg}", label)
    }

    /// `total` bytes of some work (text tokenized, weights written or converted).
    pub fn bytes(total: u64, label: &str) -> Progress {
        Self::attach(ProgressBar::new(total), "{prefix} [{bar:30}] {bytes}/{total_bytes} | {bytes_per_sec} | ETA {eta} {msg}", label)
    }

    /// Work of unknown length: a spinner with the elapsed time.
    pub fn spinner(label: &str) -> Progress {
        let p = Self::attach(ProgressBar::new_spinner(), "{spinner} {prefix} {elapsed} {msg}", label);
        p.bar.enable_steady_tick(Duration::from_millis(120));
        p
    }

    /// Whether this bar is drawn at all on this rank (a terminal is still needed to see it).
    pub fn draws(&self) -> bool {
        self.draws
    }

    pub fn inc(&self, n: u64) {
        self.bar.inc(n);
    }

    pub fn set_position(&self, pos: u64) {
        self.bar.set_position(pos);
    }

    /// Where a resumed run starts: the rate and ETA count only the work done from here.
    pub fn start_at(&self, pos: u64) {
        self.bar.set_position(pos);
        self.bar.reset_eta();
    }

    pub fn set_message(&self, msg: impl Into<String>) {
        self.bar.set_message(msg.into());
    }

    /// The bar itself, for what this wrapper does not cover (`wrap_iter`, `wrap_read`).
    pub fn bar(&self) -> &ProgressBar {
        &self.bar
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
        if self.draws {
            BARS.remove(&self.bar);
        }
    }
}
