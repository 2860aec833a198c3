//! Test helpers: a self-deleting scratch directory (no tempfile dependency).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

pub struct Scratch(PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!("ferrolm-data-{tag}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes `tokens` as one shard and returns its path.
#[allow(dead_code)]
pub fn write_shard(dir: &Path, name: &str, tokens: &[u32]) -> PathBuf {
    let path = dir.join(name);
    let dtype = ferrolm_data::TokenDtype::U16;
    let mut w = ferrolm_data::ShardWriter::create(&path, dtype).unwrap();
    w.write(tokens).unwrap();
    w.finish().unwrap();
    path
}
