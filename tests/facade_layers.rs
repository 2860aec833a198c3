//! The facade's layers: the command-line tools (src/cli, and the tools in examples/) sit on top;
//! nothing else under src/ imports the CLI. Flag errors live below both (src/errors.rs).
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Whether `code` (comments removed) names the CLI module: `crate::cli`, `ferrolm::cli`, or
/// `cli` inside a `use crate::{..}` group.
fn imports_cli(code: &str) -> bool {
    let words = |s: &str| s.split(|c: char| !(c.is_alphanumeric() || c == '_')).any(|w| w == "cli");
    if ["crate::cli", "ferrolm::cli"]
        .iter()
        .any(|p| code.match_indices(p).any(|(i, _)| !code[i + p.len()..].starts_with(|c: char| c.is_alphanumeric() || c == '_')))
    {
        return true;
    }
    code.match_indices("crate::{").any(|(i, _)| words(code[i..].split('}').next().unwrap_or("")))
}

#[test]
fn the_scan_sees_an_import_of_the_cli() {
    assert!(imports_cli("use crate::cli::flag_error;"));
    assert!(imports_cli("return Err(crate::cli::flag_error(msg));"));
    assert!(imports_cli("use crate::{cli, train};"));
    assert!(!imports_cli("use crate::errors::flag_error;"));
    assert!(!imports_cli("use crate::client::X;"));
}

#[test]
fn nothing_under_src_but_the_cli_imports_the_cli() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    assert!(files.iter().any(|f| f.ends_with("parallel.rs")), "the scan found no sources under {}", src.display());
    let cli = src.join("cli");
    let mut bad = Vec::new();
    for f in files.iter().filter(|f| !f.starts_with(&cli)) {
        let text = std::fs::read_to_string(f).unwrap();
        let code: String = text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n");
        if imports_cli(&code) {
            bad.push(f.strip_prefix(&src).unwrap_or(f).display().to_string());
        }
    }
    assert!(
        bad.is_empty(),
        "these modules under src/ import the CLI (src/cli), which sits above them: {bad:?}; take flag errors from \
         crate::errors instead"
    );
}

#[test]
fn flag_errors_keep_their_exit_code_through_the_cli_re_export() {
    let e = ferrolm::errors::flag_error("--tp 3 does not divide 4 heads");
    assert_eq!(ferrolm::cli::exit_code(&e.context("while planning")), 2);
    assert_eq!(ferrolm::errors::exit_code(&anyhow::anyhow!("disk full")), 1);
    assert!(ferrolm::cli::flag_error("x").is::<ferrolm::cli::FlagError>());
}
