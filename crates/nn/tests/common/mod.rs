//! Shared by the nn test binaries.
use std::path::{Path, PathBuf};

/// A scratch directory removed on drop; unique per test binary, process and name.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("ferrolm-nn-{}-{name}-{}", env!("CARGO_CRATE_NAME"), std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The repository's tests/fixtures.
#[allow(dead_code)]
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// max |a - b| / max |b| (the shared measure of `ferrolm_testing`).
#[allow(unused_imports)]
pub use ferrolm_testing::rel_err;
