//! Damaged dataset files (committed fixtures, `scripts/make_data_fixtures.py`): each gives an
//! error naming the file, where (line, row or byte offset) and the field; nothing is left that
//! reads as a prepared directory; `--skip-bad-records` counts and reports them instead.
mod common;

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use common::Scratch;
use ferrolm_data::{list_shards, prepare, PrepareOptions, PrepareSummary, Tokenizer};

fn damaged(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/damaged").join(name)
}

fn bundled() -> Tokenizer {
    Tokenizer::from_file(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/tokenizer.json")).unwrap()
}

fn prep(input: &Path, out: &Path, skip: bool) -> ferrolm_data::Result<PrepareSummary> {
    let o = PrepareOptions { val_fraction: 0.0, skip_bad_records: skip, ..PrepareOptions::default() };
    prepare(input, &bundled(), out, &o, &mut |_| ControlFlow::Continue(()))
}

/// No manifest, no shard: the directory does not read as prepared data.
fn assert_nothing_complete(out: &Path) {
    assert!(PrepareSummary::load(out).unwrap().is_none());
    assert!(list_shards(out, "train").is_err());
    for e in std::fs::read_dir(out).into_iter().flatten() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        assert!(!name.starts_with("train_") && !name.starts_with("val_"), "{name} left in {}", out.display());
    }
}

#[test]
fn each_damaged_input_names_the_file_the_place_and_the_field() {
    let cases: &[(&str, &[&str])] = &[
        ("missing_field.jsonl", &["line 3", "field `text` is missing", "fields: body, id"]),
        ("wrong_type.jsonl", &["line 2", "field `text` is a number, not a string"]),
        ("bad_utf8.jsonl", &["line 2", "invalid UTF-8 at byte 17 of the line"]),
        ("bad_utf8.txt", &["byte offset 12", "invalid UTF-8"]),
        ("truncated.jsonl.gz", &["line 4 (decompressed byte offset", "truncated or corrupt gzip stream"]),
        ("truncated.jsonl.zst", &["line 1 (decompressed byte offset 0)", "truncated or corrupt zstd stream"]),
        ("corrupt_footer.parquet", &["not a readable Parquet file", "footer"]),
        ("null_text.parquet", &["row 1", "field `text` is null"]),
        ("bad_utf8.parquet", &["row 1", "field `text`: invalid UTF-8"]),
        ("wrong_type.parquet", &["field `text`", "INT64", "not strings"]),
    ];
    for (name, words) in cases {
        let out = Scratch::new("damaged");
        let e = prep(&damaged(name), out.path(), false).unwrap_err().to_string();
        assert!(e.contains(&*damaged(name).display().to_string()), "{name}: {e}");
        for w in *words {
            assert!(e.contains(w), "{name}: {e:?} lacks {w:?}");
        }
        assert_nothing_complete(out.path());
    }
}

#[test]
fn a_bad_record_after_good_ones_leaves_no_complete_output_and_a_rerun_replaces_an_old_one() {
    // A directory prepared before, then a run that fails: the old manifest is gone first, so
    // the directory never pairs old shards with a half-finished new run.
    let dir = Scratch::new("rerun");
    let good = dir.path().join("good.jsonl");
    std::fs::write(&good, "{\"text\": \"fine\"}\n".repeat(50)).unwrap();
    let out = dir.path().join("out");
    prep(&good, &out, false).unwrap();
    assert!(PrepareSummary::load(&out).unwrap().is_some());
    let e = prep(&damaged("missing_field.jsonl"), &out, false).unwrap_err().to_string();
    assert!(e.contains("line 3"), "{e}");
    assert_nothing_complete(&out);
}

#[test]
fn skip_bad_records_counts_and_reports_skips() {
    let out = Scratch::new("skip");
    let s = prep(&damaged("missing_field.jsonl"), out.path(), true).unwrap();
    assert_eq!((s.documents, s.skipped_records), (3, 1));
    assert!(s.skipped_examples[0].contains("line 3") && s.skipped_examples[0].contains("missing"), "{:?}", s.skipped_examples);
    // The manifest keeps the count and the reasons.
    let back = PrepareSummary::load(out.path()).unwrap().unwrap();
    assert_eq!((back.skipped_records, back.skipped_examples.len()), (1, 1));

    // A truncated stream: the documents before the damage are kept, the rest of the file is
    // one skip; a whole directory of damaged files is counted file by file.
    let s = prep(&damaged("truncated.jsonl.gz"), Scratch::new("skip-gz").path(), true).unwrap();
    assert!(s.documents >= 1 && s.skipped_records == 1, "{s:?}");
    assert!(s.skipped_examples[0].contains("rest of the file is skipped"), "{:?}", s.skipped_examples);
    let s = prep(&damaged(""), Scratch::new("skip-all").path(), true).unwrap();
    // missing_field, wrong_type, bad_utf8 (jsonl): one record each; bad_utf8.txt: the file;
    // truncated .gz/.zst: the rest of each; corrupt_footer, wrong_type (parquet): the file;
    // null_text, bad_utf8 (parquet): one row each.
    assert_eq!(s.skipped_records, 10, "{:?}", s.skipped_examples);
    assert!(s.documents > 10);
}

#[test]
fn an_overlong_json_line_is_a_bad_record_read_in_bounded_memory() {
    let dir = Scratch::new("long-line");
    let f = dir.path().join("big.jsonl");
    let mut text = String::from("{\"text\": \"ok\"}\n{\"text\": \"");
    text.push_str(&"x".repeat(ferrolm_data::records::MAX_RECORD_BYTES + 10));
    text.push_str("\"}\n{\"text\": \"after\"}\n");
    std::fs::write(&f, text).unwrap();
    let e = prep(&f, &dir.path().join("o"), false).unwrap_err().to_string();
    assert!(e.contains("line 2") && e.contains("longer than 64 MiB"), "{e}");
    let s = prep(&f, &dir.path().join("o"), true).unwrap();
    assert_eq!((s.documents, s.skipped_records), (2, 1));
}

/// With --skip-bad-records, an input whose every record is bad (a Parquet text column of
/// INT64) is still an error, and it says how many records were skipped and the first reason,
/// not only that there is no text.
#[test]
fn an_input_whose_every_record_was_skipped_says_why_it_holds_no_text() {
    let out = Scratch::new("all-skipped");
    let e = prep(&damaged("wrong_type.parquet"), out.path(), true).unwrap_err().to_string();
    for w in ["holds no text", "1 record(s) were skipped", "--skip-bad-records", "field `text`", "INT64"] {
        assert!(e.contains(w), "{e:?} lacks {w:?}");
    }
    assert_nothing_complete(out.path());
}
