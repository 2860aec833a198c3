//! Logs (`tracing`) on stderr, printed above any progress bar, and the rank of this process.
//!
//! A run on several ranks calls [`set_rank`] once at start: every log line then carries
//! `[rank R/W]`, and only rank 0 draws progress bars and prints the periodic report lines
//! (`step …`, `val loss …`, see [`crate::progress::report`]); warnings and errors come from
//! every rank. The level comes from `--log-level`, else `RUST_LOG`, else `info`.
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, MakeWriter};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

static RANK: AtomicUsize = AtomicUsize::new(0);
static WORLD: AtomicUsize = AtomicUsize::new(1);

/// Declares this process rank `rank` of `world` (torchrun's RANK / WORLD_SIZE).
pub fn set_rank(rank: usize, world: usize) {
    let world = world.max(1);
    RANK.store(rank.min(world - 1), Ordering::Relaxed);
    WORLD.store(world, Ordering::Relaxed);
}

thread_local! {
    /// A thread rank's own (rank, world): ranks that are threads of one process (CPU runs).
    static THREAD_RANK: std::cell::Cell<Option<(usize, usize)>> = const { std::cell::Cell::new(None) };
}

/// Declares the calling thread rank `rank` of `world` (thread ranks of one process); it takes
/// precedence over the process rank on this thread. `None` clears it.
pub fn set_thread_rank(r: Option<(usize, usize)>) {
    THREAD_RANK.with(|c| c.set(r.map(|(rank, world)| (rank.min(world.max(1) - 1), world.max(1)))));
}

/// (rank, world size): the calling thread's rank if it is a thread rank, else the process's as
/// set by [`set_rank`]; (0, 1) by default.
pub fn rank() -> (usize, usize) {
    THREAD_RANK.with(|c| c.get()).unwrap_or_else(|| (RANK.load(Ordering::Relaxed), WORLD.load(Ordering::Relaxed)))
}

/// Whether this process draws progress and prints report lines: rank 0 only.
pub fn is_rank_zero() -> bool {
    rank().0 == 0
}

/// `level: message` lines (`warning: …`, `error: …`), prefixed `[rank R/W] ` on several
/// ranks. No timestamps or module paths: these are a tool's messages to its user.
pub struct LineFormat;

impl<S, N> FormatEvent<S, N> for LineFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut w: Writer<'_>, event: &Event<'_>) -> std::fmt::Result {
        let (r, world) = rank();
        if world > 1 {
            write!(w, "[rank {r}/{world}] ")?;
        }
        let level = match *event.metadata().level() {
            Level::ERROR => "error",
            Level::WARN => "warning",
            Level::INFO => "info",
            Level::DEBUG => "debug",
            Level::TRACE => "trace",
        };
        write!(w, "{level}: ")?;
        ctx.format_fields(w.by_ref(), event)?;
        writeln!(w)
    }
}

/// stderr, written while the progress bars are lifted so a line never lands inside a bar.
#[derive(Clone, Copy)]
pub struct StderrAboveBars;

impl Write for StderrAboveBars {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        crate::progress::suspend(|| std::io::stderr().write_all(buf))?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

impl<'a> MakeWriter<'a> for StderrAboveBars {
    type Writer = StderrAboveBars;
    fn make_writer(&'a self) -> Self::Writer {
        *self
    }
}

/// The filter for `level` (a `--log-level` value or any `RUST_LOG` directive), else
/// `RUST_LOG`, else `info`.
pub fn filter(level: Option<&str>) -> Result<EnvFilter, String> {
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    match level {
        // A bare word must be a level: EnvFilter would take a typo for a module name and
        // silently show nothing.
        Some(l) if !l.contains(['=', ',']) && !LEVELS.contains(&l.to_ascii_lowercase().as_str()) => {
            Err(format!("`{l}` is not a level: use one of {} (or directives such as ferrolm=debug)", LEVELS.join(", ")))
        }
        Some(l) => EnvFilter::try_new(l).map_err(|e| format!("`{l}`: {e}")),
        None => Ok(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"))),
    }
}

/// A subscriber that writes [`LineFormat`] lines to `writer` (tests pass a buffer).
pub fn subscriber<W>(filter: EnvFilter, writer: W) -> impl Subscriber + Send + Sync
where
    W: for<'a> MakeWriter<'a> + Send + Sync + 'static,
{
    tracing_subscriber::fmt().event_format(LineFormat).with_writer(writer).with_env_filter(filter).finish()
}

/// Installs the stderr logger for this process (the first call wins; later calls are no-ops,
/// so tests and tools can both call it).
pub fn init(level: Option<&str>) -> Result<(), String> {
    let f = filter(level)?;
    let _ = tracing::subscriber::set_global_default(subscriber(f, StderrAboveBars));
    Ok(())
}
