mod common;

use std::path::PathBuf;

use common::Scratch;
use ferrolm_data::{eval_batches, prepare_text_dir, prepare_text_dir_with_progress, DataLoader, PrepareSummary, Tokenizer};

fn repo_data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data")
}

fn bundled() -> Tokenizer {
    Tokenizer::from_file(repo_data().join("tokenizer.json")).unwrap()
}

/// A ~20 KB sample of the bundled corpus, cut on a char boundary.
fn sample() -> String {
    let text = std::fs::read_to_string(repo_data().join("corpus/hamlet.txt")).unwrap();
    let mut end = 20_000.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

#[test]
fn bundled_tokenizer_round_trips_corpus_text() {
    let tok = bundled();
    assert_eq!(tok.vocab_size(), 4096);
    assert_eq!((tok.bos_id(), tok.eos_id()), (Some(0), Some(1)));

    let text = sample();
    let ids = tok.encode(&text, false).unwrap();
    assert!(ids.len() * 3 < text.len(), "BPE should compress ({} ids for {} bytes)", ids.len(), text.len());
    assert!(ids.iter().all(|&i| (i as usize) < tok.vocab_size()));
    assert_eq!(tok.decode(&ids).unwrap(), text);

    // Byte level: text outside the training alphabet still round-trips.
    let odd = "naïve café — 東京 🚀\ttabs\r\n";
    assert_eq!(tok.decode(&tok.encode(odd, false).unwrap()).unwrap(), odd);

    let with_bos = tok.encode("To be, or not to be", true).unwrap();
    assert_eq!(with_bos[0], 0);
    assert_eq!(&with_bos[1..], tok.encode("To be, or not to be", false).unwrap());
    assert!(tok.decode(&[5000]).is_err());
}

#[test]
fn tokenizer_errors_name_the_file() {
    let dir = Scratch::new("tok-err");
    let missing = dir.path().join("nope.json");
    let err = Tokenizer::from_file(&missing).err().unwrap().to_string();
    assert!(err.contains("nope.json"), "{err}");
    let garbage = dir.path().join("garbage.json");
    std::fs::write(&garbage, "{\"not\": \"a tokenizer\"}").unwrap();
    let err = Tokenizer::from_file(&garbage).err().unwrap().to_string();
    assert!(err.contains("garbage.json"), "{err}");
}

#[test]
fn prepare_splits_deterministically_and_feeds_the_loader() {
    let tok = bundled();
    let input = Scratch::new("prep-in");
    let text = sample();
    let (a, b) = text.split_at(text.len() / 2);
    let (a, b) = (a.to_string(), b.to_string());
    std::fs::write(input.path().join("a.txt"), &a).unwrap();
    std::fs::write(input.path().join("b.txt"), &b).unwrap();
    std::fs::write(input.path().join("ignored.md"), "not text").unwrap();

    let out = Scratch::new("prep-out");
    let mut progress = Vec::new();
    let s = prepare_text_dir_with_progress(input.path(), &tok, out.path(), 0.1, 1000, &mut |n| progress.push(n)).unwrap();
    // The progress callback sees each text file's bytes once (the .md file is not input).
    assert_eq!(progress.iter().sum::<u64>(), (a.len() + b.len()) as u64);
    assert!(!progress.is_empty() && progress.iter().all(|&n| n > 0));
    let expected: Vec<u32> = [&a, &b].iter().flat_map(|t| tok.encode(t, false).unwrap().into_iter().chain([1])).collect();
    assert_eq!(s.documents, 2);
    assert_eq!(s.train_tokens + s.val_tokens, expected.len() as u64);
    assert_eq!(s.val_tokens, (expected.len() as f64 * 0.1).round() as u64);
    assert_eq!(s.train_shards.len(), (s.train_tokens as usize).div_ceil(1000));
    assert_eq!(PrepareSummary::load(out.path()).unwrap().as_ref(), Some(&s));

    let read: Vec<u32> = s
        .train_shards
        .iter()
        .chain(&s.val_shards)
        .flat_map(|p| {
            let sh = ferrolm_data::Shard::open(p).unwrap();
            sh.slice(0, sh.len())
        })
        .collect();
    assert_eq!(read, expected, "shards hold the token stream in order, train then val");

    let mut loader = DataLoader::open(&s.train_shards, 2, 64, 0).unwrap();
    let batch = loader.next_batch();
    assert_eq!(batch.inputs.len(), 128);
    assert!(eval_batches(&s.val_shards, 4, 64).unwrap().count() > 0);

    // A re-run with bigger shards replaces the old set instead of mixing with it.
    let s2 = prepare_text_dir(input.path(), &tok, out.path(), 0.1, 1 << 20).unwrap();
    assert_eq!(s2.train_shards.len(), 1);
    assert_eq!(ferrolm_data::list_shards(out.path(), "train").unwrap(), s2.train_shards);

    let empty = Scratch::new("prep-empty");
    assert!(prepare_text_dir(empty.path(), &tok, out.path(), 0.1, 1000).is_err());
    assert!(prepare_text_dir(input.path(), &tok, out.path(), 1.5, 1000).is_err());
}
