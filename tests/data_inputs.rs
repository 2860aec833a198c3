//! `--data` takes what users have: a .txt file, JSON Lines (and, through the same reader,
//! compressed JSON Lines and Parquet: `crates/data/tests/formats.rs`), for pretrain_llama and
//! finetune_ladder; prepare_data's record flags in both spellings; a padded vocabulary trains and
//! samples only the tokenizer's ids.
mod common;
use common::*;
use ferrolm::cli::finetune_ladder::FinetuneLadderArgs;
use ferrolm::cli::prepare::PrepareDataArgs;
use ferrolm::cli::pretrain::PretrainArgs;
use ferrolm::cli::{error_report, parse_from};
use std::path::{Path, PathBuf};

/// A few KB of the sonnets as `TAG-notes.txt` and, paragraph by paragraph, as
/// `TAG-notes.jsonl` (the text under `field`). Named per test, so each test's runs/cache
/// entries are its own (see [`remove_cache`]).
fn notes(dir: &Path, tag: &str, field: &str) -> (PathBuf, PathBuf) {
    let text = std::fs::read_to_string(root().join("data/corpus/sonnets.txt")).unwrap();
    let text = format!("{tag}\n{}", &text[..12_000]);
    let txt = dir.join(format!("{tag}-notes.txt"));
    std::fs::write(&txt, &text).unwrap();
    let jsonl = dir.join(format!("{tag}-notes.jsonl"));
    let lines: Vec<String> =
        text.split("\n\n").filter(|p| !p.trim().is_empty()).map(|p| serde_json::json!({ field: p, "id": 1 }).to_string()).collect();
    std::fs::write(&jsonl, lines.join("\n") + "\n").unwrap();
    (txt, jsonl)
}

/// Removes the runs/cache entries that text `--data` named `TAG-notes.*` made (tokenized on
/// first use into runs/cache under the working directory).
fn remove_cache(tag: &str) {
    for e in std::fs::read_dir("runs/cache").into_iter().flatten().flatten() {
        if e.file_name().to_string_lossy().starts_with(&format!("{tag}-notes-")) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

fn small_config(dir: &Path, vocab: usize) -> PathBuf {
    let cfg = dir.join("config.json");
    std::fs::write(&cfg, config(vocab, 2).to_json_string()).unwrap();
    cfg
}

#[test]
fn pretrain_takes_a_text_file_or_json_lines_as_data() {
    let dir = tmp("data-pretrain");
    let (txt, jsonl) = notes(&dir, "pretrain", "body");
    let cfg = small_config(&dir, 4096);
    let quick = ["--steps=2", "--batch-size=2", "--eval-every=0", "--save-every=0"];
    ferrolm::cli::pretrain::run(pretrain_args(&txt, &cfg, &dir.join("run-txt"), &quick)).unwrap();
    assert!(dir.join("run-txt/checkpoints/latest").is_file());
    // JSON Lines with the text under another field, in both spellings of the flag.
    for (i, field) in [["--text-field", "body"].as_slice(), ["--text-field=body"].as_slice()].iter().enumerate() {
        let flags: Vec<&str> = quick.iter().chain(field.iter()).copied().collect();
        ferrolm::cli::pretrain::run(pretrain_args(&jsonl, &cfg, &dir.join(format!("run-jsonl{i}")), &flags)).unwrap();
    }
    // The default field is `text`: the error names the file, the line and the field.
    let e = error_report(&ferrolm::cli::pretrain::run(pretrain_args(&jsonl, &cfg, &dir.join("run-bad"), &quick)).unwrap_err());
    assert!(e.contains("notes.jsonl: line 1") && e.contains("field `text` is missing (fields: body, id)"), "{e}");
    remove_cache("pretrain");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_missing_data_file_is_named_once_with_its_cause() {
    let dir = tmp("data-missing");
    let cfg = small_config(&dir, 4096);
    let missing = dir.join("notes.txt");
    let e = error_report(&ferrolm::cli::pretrain::run(pretrain_args(&missing, &cfg, &dir.join("run"), &["--steps=1"])).unwrap_err());
    assert_eq!(e, format!("error: cannot open data file {}: No such file or directory (os error 2)", missing.display()));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn finetune_takes_a_text_file_or_json_lines_as_data() {
    let dir = tmp("data-finetune");
    let (txt, jsonl) = notes(&dir, "finetune", "text");
    let ck = dir.join("llama");
    model(4096).save_pretrained(&ck).unwrap();
    std::fs::copy(tokenizer_path(), ck.join("tokenizer.json")).unwrap();
    for (data, out) in [(&txt, "ft-txt"), (&jsonl, "ft-jsonl")] {
        let a: FinetuneLadderArgs = parse_from([
            "finetune_ladder",
            "--device=cpu",
            "--model",
            ck.to_str().unwrap(),
            "--ladder-layers=1",
            "--data",
            data.to_str().unwrap(),
            "--out",
            dir.join(out).to_str().unwrap(),
            "--seq-len=16",
            "--batch-size=2",
            "--steps=1",
            "--eval-every=0",
            "--skip-bad-records",
        ])
        .unwrap();
        assert!(a.train.records.skip_bad_records);
        ferrolm::cli::finetune_ladder::run(a).unwrap();
        assert!(dir.join(out).join("checkpoints/latest").is_file(), "{out}");
    }
    remove_cache("finetune");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn prepare_data_takes_its_record_flags_in_both_spellings() {
    let dir = tmp("data-prepare-flags");
    let (_, jsonl) = notes(&dir, "flags", "body");
    let bad = dir.join("bad.jsonl");
    std::fs::write(&bad, "{\"body\": \"fine\"}\n{\"body\": 7}\n{\"body\": \"also fine\"}\n").unwrap();
    let (input, tok) = (dir.join("*.jsonl"), tokenizer_path());
    let args = |flags: &[&str]| -> PrepareDataArgs {
        let base = ["prepare_data", "--input", input.to_str().unwrap(), "--tokenizer", tok.to_str().unwrap()];
        parse_from(base.iter().chain(flags)).unwrap()
    };
    let d = dir.join("d");
    let spaced = args(&["--out", d.to_str().unwrap(), "--text-field", "body", "--skip-bad-records", "--shuffle-docs", "5"]);
    let equals = args(&[&format!("--out={}", d.display()), "--text-field=body", "--skip-bad-records", "--shuffle-docs=5"]);
    assert_eq!(spaced, equals);
    assert_eq!((spaced.records.text_field.as_str(), spaced.records.skip_bad_records, spaced.shuffle_docs), ("body", true, Some(5)));
    let defaults = args(&["--out", d.to_str().unwrap()]);
    assert_eq!((defaults.records.text_field.as_str(), defaults.records.skip_bad_records, defaults.shuffle_docs), ("text", false, None));
    // A glob of two files, one bad record: counted and reported with --skip-bad-records ...
    ferrolm::cli::prepare::prepare_data(spaced).unwrap();
    let m: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(d.join("manifest.json")).unwrap()).unwrap();
    assert_eq!((m["skipped_records"].as_u64(), m["shuffle_docs"].as_u64(), m["split"].as_str()), (Some(1), Some(5), Some("documents")));
    assert!(m["skipped_examples"][0].as_str().unwrap().contains("bad.jsonl: line 2"), "{m}");
    // ... and an error naming the file, line and field without it.
    let strict = args(&["--out", dir.join("strict").to_str().unwrap(), "--text-field=body"]);
    let e = error_report(&ferrolm::cli::prepare::prepare_data(strict).unwrap_err());
    assert!(e.contains("bad.jsonl: line 2") && e.contains("field `body` is a number, not a string"), "{e}");
    assert!(!dir.join("strict/manifest.json").exists());
    let _ = std::fs::remove_dir_all(&dir);
    let _ = jsonl;
}

#[test]
fn a_padded_vocabulary_trains_warns_once_and_samples_the_tokenizers_ids() {
    let dir = tmp("data-padded-vocab");
    let (txt, _) = notes(&dir, "padded", "text");
    // 8192 rows for a 4096-token tokenizer: an untrained model puts half its sampling mass on
    // rows no text uses, so an unrestricted sample would draw one and fail to decode it.
    let cfg = small_config(&dir, 8192);
    let args = pretrain_args(&txt, &cfg, &dir.join("run"), &["--steps=2", "--batch-size=2", "--eval-every=0"]);
    let (r, logs) = capture_logs(|| ferrolm::cli::pretrain::run(args));
    r.unwrap();
    assert!(!logs.contains("no sample"), "the sample drew an id the tokenizer cannot decode:\n{logs}");
    let warnings: Vec<&str> = logs.lines().filter(|l| l.contains("larger than the tokenizer's 4096 ids")).collect();
    assert_eq!(warnings.len(), 1, "{logs}");
    assert!(warnings[0].contains("8192") && warnings[0].starts_with("warning"), "{}", warnings[0]);
    // Smaller than the tokenizer's ids: refused, saying why.
    let cfg = small_config(&dir, 4000);
    let e = error_report(&ferrolm::cli::pretrain::run(pretrain_args(&txt, &cfg, &dir.join("run-small"), &["--steps=1"])).unwrap_err());
    assert!(e.contains("ids go up to 4095") && e.contains("vocab_size") && e.contains("4000"), "{e}");
    remove_cache("padded");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_training_tools_take_the_record_flags() {
    let a: PretrainArgs = parse_from(["pretrain_llama", "--text-field=content", "--skip-bad-records"]).unwrap();
    assert_eq!((a.train.records.text_field.as_str(), a.train.records.skip_bad_records), ("content", true));
    let a: PretrainArgs = parse_from(["pretrain_llama", "--text-field", "content"]).unwrap();
    assert_eq!((a.train.records.text_field.as_str(), a.train.records.skip_bad_records), ("content", false));
    let a: PretrainArgs = parse_from(["pretrain_llama"]).unwrap();
    assert_eq!(a.train.records.text_field, "text");
}
