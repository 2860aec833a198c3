//! The seams of docs/ARCHITECTURE.md "One decoder, one parameter spec", checked on the source:
//! no family is named where parallelism, LoRA and the planner live (they read the parameter
//! spec), and generation and the model do not import each other.
use std::path::{Path, PathBuf};

/// The repository root, from this crate's directory.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every `.rs` file under `dir`, with its text.
fn sources(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&p).unwrap();
                out.push((p, text));
            }
        }
    }
    out
}

#[test]
fn no_family_name_in_parallelism_lora_or_the_planner() {
    let dirs = ["crates/parallel", "crates/nn/src/lora", "src/planner"];
    let mut found = Vec::new();
    let mut files = 0;
    for d in dirs {
        for (path, text) in sources(&root().join(d)) {
            files += 1;
            for (i, line) in text.lines().enumerate() {
                if ["Qwen", "Gemma", "Mistral", "Family::"].iter().any(|w| line.contains(w)) {
                    found.push(format!("{}:{}: {}", path.display(), i + 1, line.trim()));
                }
            }
        }
    }
    assert!(files > 20, "the scan read {files} files: wrong root?");
    assert!(found.is_empty(), "family names where the parameter spec should decide:\n{}", found.join("\n"));
}

#[test]
fn generate_and_the_model_do_not_import_each_other() {
    let src = root().join("crates/nn/src");
    let read = |f: &str| std::fs::read_to_string(src.join(f)).unwrap();
    let (generate, llama) = (read("generate.rs"), read("llama.rs"));
    // Generation's own code, before its tests (which build a model to generate from).
    let generate = generate.split("#[cfg(test)]").next().unwrap_or_default();
    assert!(generate.contains("CausalLm"), "generate.rs takes the model as a `CausalLm`");
    for needle in ["crate::llama", "Llama::", "&Llama", "Llama,", "Llama;", "Llama}"] {
        assert!(!generate.contains(needle), "generate.rs names `{needle}`: it should use the model through `CausalLm`");
    }
    assert!(!llama.contains("crate::generate"), "llama.rs imports crate::generate: the KV cache lives in kv_cache.rs");
}
