//! Logs and progress: on several ranks every log line carries its rank and only rank 0 draws
//! progress and prints the report lines; output into a pipe has no escape codes and still has
//! the periodic `step …` lines. (Own test binary: the rank is process-wide state.)
mod common;
use common::*;
use ferrolm::logging::{rank, set_rank};
use ferrolm::progress::{report, Progress};
use ferrolm::train::TrainOptions;

#[test]
fn each_log_line_carries_its_rank_and_only_rank_zero_shows_progress() {
    set_rank(1, 4);
    assert_eq!(rank(), (1, 4));
    let ((), logs) = capture_logs(|| tracing::warn!("disk almost full"));
    assert_eq!(logs, "[rank 1/4] warning: disk almost full\n");
    assert!(!Progress::steps(10, "train").draws(), "rank 1 drew a progress bar");
    assert!(!Progress::spinner("tokenize").draws());
    assert!(!report("step 1/10 | loss 3.0"), "rank 1 printed a report line");

    set_rank(0, 4);
    let ((), logs) = capture_logs(|| tracing::info!("hello"));
    assert_eq!(logs, "[rank 0/4] info: hello\n");
    assert!(Progress::steps(10, "train").draws(), "rank 0 must draw its progress bar");
    assert!(report("step 1/10 | loss 3.0"));

    // A single process: no rank prefix; debug lines only when asked for.
    set_rank(0, 1);
    let ((), logs) = capture_logs(|| {
        tracing::warn!("w");
        tracing::debug!("not shown at info");
    });
    assert_eq!(logs, "warning: w\n");
    assert!(ferrolm::logging::filter(Some("not a level !!")).is_err());
}

/// The child half of the pipe test: a short training run with the real stderr logger.
#[test]
fn child_training_run() {
    let Ok(dir) = std::env::var("FERROLM_PIPE_TEST_DIR") else { return };
    ferrolm::logging::init(Some("info")).unwrap();
    let dir = std::path::PathBuf::from(dir);
    let mut t = trainer(&dir, "run", TrainOptions { eval_every: 2, save_every: 2, log_every: 2, ..opts(4) });
    t.run().unwrap();
    tracing::warn!("child done");
}

#[test]
fn piped_output_has_no_escape_codes_and_keeps_the_step_lines() {
    let dir = tmp("pipe");
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_training_run", "--nocapture", "--test-threads=1"])
        .env("FERROLM_PIPE_TEST_DIR", &dir)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
    for want in ["step     1/4 | loss", "step     2/4 | loss", "step     2/4 | val loss", "saved checkpoint", "step     4/4 | loss"] {
        assert!(stdout.contains(want), "stdout lacks {want:?}:\n{stdout}");
    }
    assert!(stderr.contains("warning: child done"), "logs go to stderr:\n{stderr}");
    assert!(!stdout.contains('\x1b') && !stderr.contains('\x1b'), "escape codes in a pipe:\n{stdout:?}\n{stderr:?}");
    assert!(!stdout.contains('\r') && !stderr.contains('\r'), "carriage returns (a redrawn bar) in a pipe");
    let _ = std::fs::remove_dir_all(&dir);
}
