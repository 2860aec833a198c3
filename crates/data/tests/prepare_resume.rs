//! An interrupted `prepare` resumes from its finished parts and writes the same shards, byte for
//! byte, as a run that was never interrupted; a changed input starts over.
mod common;

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use common::Scratch;
use ferrolm_data::{prepare, Error, PrepareOptions, PrepareSummary, Tokenizer};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn bundled() -> Tokenizer {
    Tokenizer::from_file(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/tokenizer.json")).unwrap()
}

/// Small parts and batches, so a run of the fixtures has many places to stop.
fn opts() -> PrepareOptions {
    PrepareOptions {
        val_fraction: 0.2,
        shard_tokens: 700,
        shuffle_docs: Some(3),
        part_tokens: 300,
        batch_bytes: 1500,
        ..Default::default()
    }
}

/// The output directory's files (the manifest and every shard) with their bytes.
fn files(out: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap()))
        .collect();
    v.sort();
    v
}

/// Runs `prepare`, returning `Interrupted` at the `stop_at`-th progress call.
fn run_until(
    input: &Path,
    out: &Path,
    stop_at: Option<usize>,
) -> (ferrolm_data::Result<PrepareSummary>, Vec<ferrolm_data::PrepareProgress>) {
    let mut seen = Vec::new();
    let r = prepare(input, &bundled(), out, &opts(), &mut |p| {
        seen.push(p.clone());
        if Some(seen.len()) == stop_at {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    });
    (r, seen)
}

#[test]
fn an_interrupted_run_resumes_to_the_same_shards() {
    let input = fixtures().join("docs");
    let reference = Scratch::new("resume-ref");
    let (s, calls) = run_until(&input, reference.path(), None);
    let s = s.unwrap();
    assert!(calls.len() > 8, "enough batches to interrupt at several places ({})", calls.len());
    assert_eq!(s.documents, 56);
    let want = files(reference.path());

    for stop in [2, calls.len() / 2, calls.len() - 1] {
        let out = Scratch::new("resume");
        let (r, _) = run_until(&input, out.path(), Some(stop));
        assert!(matches!(r, Err(Error::Interrupted)), "{:?}", r.map(|_| ()));
        assert!(PrepareSummary::load(out.path()).unwrap().is_none(), "an interrupted run has no manifest");
        assert!(out.path().join(".prepare/journal.json").is_file());
        // Interrupted again during the resumed run, then finished.
        let (r, again) = run_until(&input, out.path(), Some(2));
        assert!(matches!(r, Err(Error::Interrupted)));
        let (r, resumed) = run_until(&input, out.path(), None);
        r.unwrap();
        if stop > 3 {
            assert!(resumed[0].resumed_documents > 0 && resumed[0].resumed_tokens > 0, "{:?}", resumed[0]);
            assert!(resumed[0].resumed_documents >= again[0].resumed_documents);
        }
        assert!(files(out.path()) == want, "resumed after call {stop}: the files differ from the uninterrupted run's");
    }
}

#[test]
fn a_changed_input_starts_over() {
    let dir = Scratch::new("resume-changed");
    let input = dir.path().join("in.jsonl");
    let line = |i: usize| format!("{{\"text\": \"document {i}: {}\"}}\n", "word ".repeat(40 + i % 7));
    std::fs::write(&input, (0..60).map(line).collect::<String>()).unwrap();
    let out = dir.path().join("out");
    let (r, _) = run_until(&input, &out, Some(4));
    assert!(matches!(r, Err(Error::Interrupted)));
    std::fs::write(&input, (0..61).map(line).collect::<String>()).unwrap();
    let (r, resumed) = run_until(&input, &out, None);
    assert_eq!(r.unwrap().documents, 61);
    assert_eq!(resumed[0].resumed_documents, 0, "another input: nothing is reused");
    let fresh = dir.path().join("fresh");
    run_until(&input, &fresh, None).0.unwrap();
    assert!(files(&out) == files(&fresh));
}
