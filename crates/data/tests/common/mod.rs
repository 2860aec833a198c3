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

/// Every token of the shards at `paths`, in order.
#[allow(dead_code)]
pub fn read_shards(paths: &[PathBuf]) -> Vec<u32> {
    paths
        .iter()
        .flat_map(|p| {
            let s = ferrolm_data::Shard::open(p).unwrap();
            s.slice(0, s.len())
        })
        .collect()
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

/// The repository's root, from the crate's directory (where cargo runs tests) or the root.
#[allow(dead_code)]
pub fn repo_root() -> PathBuf {
    for dir in ["../..", "."] {
        if Path::new(dir).join("crates/data/tests/fixtures/chat/cases.json").is_file() {
            return PathBuf::from(dir);
        }
    }
    panic!("run from the repository root or crates/data: crates/data/tests/fixtures/chat/cases.json not found");
}

/// The chat fixtures' directory.
#[allow(dead_code)]
pub fn chat_fixtures() -> PathBuf {
    repo_root().join("crates/data/tests/fixtures/chat")
}

/// The tokenizer of the chat fixtures: data/tokenizer.json with the templates' special tokens
/// (`added_tokens` of cases.json) appended as added tokens, as scripts/chat_template_fixtures.py
/// builds it.
#[allow(dead_code)]
pub fn chat_tokenizer() -> ferrolm_data::Tokenizer {
    use serde_json::Value;
    let root = repo_root();
    let cases: Value = serde_json::from_str(&std::fs::read_to_string(chat_fixtures().join("cases.json")).unwrap()).unwrap();
    let mut tj: Value = serde_json::from_str(&std::fs::read_to_string(root.join("data/tokenizer.json")).unwrap()).unwrap();
    let vocab_max = tj["model"]["vocab"].as_object().unwrap().values().map(|v| v.as_u64().unwrap()).max().unwrap();
    let added_max = tj["added_tokens"].as_array().unwrap().iter().map(|t| t["id"].as_u64().unwrap()).max().unwrap_or(0);
    for (id, tok) in (vocab_max.max(added_max) + 1..).zip(cases["added_tokens"].as_array().unwrap()) {
        tj["added_tokens"].as_array_mut().unwrap().push(serde_json::json!({
            "id": id, "content": tok, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true
        }));
    }
    ferrolm_data::Tokenizer::from_bytes(tj.to_string().as_bytes()).unwrap()
}

/// A committed chat fixture template with its special tokens (from cases.json).
#[allow(dead_code)]
pub fn chat_template(name: &str) -> ferrolm_data::chat::ChatTemplate {
    use serde_json::Value;
    let dir = chat_fixtures();
    let cases: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let spec = &cases["templates"][name];
    let file = dir.join("templates").join(spec["file"].as_str().unwrap());
    let specials = spec["special_tokens"].as_object().unwrap().iter().map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string())).collect();
    ferrolm_data::chat::ChatTemplate::new(&std::fs::read_to_string(&file).unwrap(), &file.display().to_string(), specials).unwrap()
}
