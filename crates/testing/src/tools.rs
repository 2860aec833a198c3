//! Outside programs a test may use where they are installed.
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The first of `candidates` that runs `args` and exits 0 (its output thrown away).
pub fn first_that_runs(candidates: impl IntoIterator<Item = Option<PathBuf>>, args: &[&str]) -> Option<PathBuf> {
    candidates
        .into_iter()
        .flatten()
        .find(|p| Command::new(p).args(args).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success()))
}

/// torchrun: `FERROLM_TORCHRUN`, the repository's `.venv/bin/torchrun` (below `root`), or
/// `torchrun` on PATH.
pub fn torchrun(root: &Path) -> Option<PathBuf> {
    let candidates =
        [std::env::var_os("FERROLM_TORCHRUN").map(PathBuf::from), Some(root.join(".venv/bin/torchrun")), Some("torchrun".into())];
    first_that_runs(candidates, &["--help"])
}
