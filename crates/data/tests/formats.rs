//! Every input format on the committed fixtures (`scripts/make_data_fixtures.py`): the same
//! documents as text, JSON Lines (plain, gzip, zstd) and Parquet (snappy, zstd, gzip) give the
//! same token shards; directories and globs mix them; documents are shuffled and split whole.
mod common;

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use common::{read_shards, Scratch};
use ferrolm_data::{prepare, DocFraming, PrepareOptions, PrepareSummary, Shard, Tokenizer};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn bundled() -> Tokenizer {
    Tokenizer::from_file(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/tokenizer.json")).unwrap()
}

fn opts(val_fraction: f64) -> PrepareOptions {
    PrepareOptions { val_fraction, shard_tokens: 300, part_tokens: 500, batch_bytes: 2000, ..PrepareOptions::default() }
}

fn run(input: &Path, o: &PrepareOptions) -> (PrepareSummary, Vec<u32>, Vec<u32>, Scratch) {
    let out = Scratch::new("fmt-out");
    let s = prepare(input, &bundled(), out.path(), o, &mut |_| ControlFlow::Continue(())).unwrap();
    let (train, val) = (read_shards(&s.train_shards), read_shards(&s.val_shards));
    assert!(!out.path().join(".prepare").exists(), "the work directory is removed once the manifest is written");
    (s, train, val, out)
}

/// The documents of the fixtures, as the text files hold them.
fn docs() -> Vec<String> {
    (0..8).map(|i| std::fs::read_to_string(fixtures().join(format!("docs/txt/doc_{i}.txt"))).unwrap()).collect()
}

#[test]
fn one_document_in_every_format_gives_the_shards_text_always_gave() {
    let tok = bundled();
    let text = std::fs::read_to_string(fixtures().join("one_doc/doc.txt")).unwrap();
    // Text keeps its behaviour: the ids, then <|eos|>; the last 10% of the tokens is validation.
    let mut expected = tok.encode(&text, false).unwrap();
    expected.push(tok.eos_id().unwrap());
    let n_val = (expected.len() as f64 * 0.1).round() as usize;
    for name in ["doc.txt", "doc.jsonl", "doc.jsonl.gz", "doc.jsonl.zst", "doc.parquet"] {
        let (s, train, val, _out) = run(&fixtures().join("one_doc").join(name), &opts(0.1));
        assert_eq!(train, expected[..expected.len() - n_val], "{name}");
        assert_eq!(val, expected[expected.len() - n_val..], "{name}");
        assert_eq!((s.documents, s.split.as_deref()), (1, Some("tokens")), "{name}: one document cannot be split whole");
        assert!(s.train_shards.len() > 1, "{name}: several 300-token shards");
    }
}

#[test]
fn several_documents_in_every_format_give_the_same_shards() {
    let tok = bundled();
    let eos = tok.eos_id().unwrap();
    let framed: Vec<Vec<u32>> = docs().iter().map(|d| tok.encode(d, false).unwrap().into_iter().chain([eos]).collect()).collect();
    let all: Vec<u32> = framed.concat();
    let d = fixtures().join("docs");
    let names = [
        "docs.jsonl",
        "docs.jsonl.gz",
        "docs.jsonl.zst",
        "docs.parquet",
        "docs_zstd.parquet",
        "docs_gzip.parquet",
        "multi_member.jsonl.gz",
    ];
    // No validation: every format, text included, is the documents in order.
    let (s, train, val, _o) = run(&d.join("txt"), &opts(0.0));
    assert_eq!((train, val.len(), s.documents), (all.clone(), 0, 8));
    for name in names {
        let (s, train, val, _o) = run(&d.join(name), &opts(0.0));
        assert_eq!((&train, val.len(), s.documents), (&all, 0, 8), "{name}");
    }
    // With validation, record formats hold out whole documents, the same ones in each format.
    let (first, train0, val0, _o) = run(&d.join("docs.jsonl"), &opts(0.25));
    assert_eq!(first.split.as_deref(), Some("documents"));
    let picked = whole_documents(&framed, &train0, &val0);
    assert_eq!(picked.len() as u64, first.val_documents.unwrap());
    assert!(!picked.is_empty() && picked.len() < 8, "{picked:?}");
    let share = val0.len() as f64 / all.len() as f64;
    assert!((0.1..0.4).contains(&share), "validation holds {share} of the tokens, asked 0.25");
    for name in names {
        let (_, train, val, _o) = run(&d.join(name), &opts(0.25));
        assert_eq!((&train, &val), (&train0, &val0), "{name}");
    }
}

/// The indices of the documents in `val`, checking that `train` and `val` interleave back into
/// the documents in order, each whole on one side.
fn whole_documents(framed: &[Vec<u32>], train: &[u32], val: &[u32]) -> Vec<usize> {
    let (mut t, mut v, mut picked) = (0, 0, Vec::new());
    for (i, d) in framed.iter().enumerate() {
        // (No fixture document is a prefix of the next one, so the sides never both match.)
        if val[v..].starts_with(d) && !train[t..].starts_with(d) {
            v += d.len();
            picked.push(i);
        } else {
            assert!(train[t..].starts_with(d), "document {i} is neither whole in train nor in validation");
            t += d.len();
        }
    }
    assert_eq!((t, v), (train.len(), val.len()), "nothing but whole documents");
    picked
}

#[test]
fn a_directory_or_a_glob_mixes_formats_in_path_order() {
    let d = fixtures().join("docs");
    let (s, train, _, _o) = run(&d, &opts(0.0));
    // docs.jsonl, .gz, .zst, docs.parquet, docs_gzip, docs_zstd, multi_member (txt/ is a
    // sub-directory: not read).
    assert_eq!(s.documents, 7 * 8);
    let (one, one_train, _, _o) = run(&d.join("docs.parquet"), &opts(0.0));
    assert_eq!(train, one_train.repeat(7));
    let (g, g_train, _, _o) = run(&d.join("*.parquet"), &opts(0.0));
    assert_eq!((g.documents, g_train), (3 * one.documents, one_train.repeat(3)));
    let e = prepare(d.join("*.csv"), &bundled(), Scratch::new("glob-none").path(), &opts(0.0), &mut |_| ControlFlow::Continue(()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("*.csv") && e.contains("matches no"), "{e}");
}

#[test]
fn shuffle_docs_permutes_whole_documents_by_seed() {
    let d = fixtures().join("docs/docs.jsonl");
    let (_, plain, _, _o) = run(&d, &opts(0.0));
    let shuffled = |seed| {
        let (s, train, _, _o) = run(&d, &PrepareOptions { shuffle_docs: Some(seed), ..opts(0.0) });
        assert_eq!(s.shuffle_docs, Some(seed));
        train
    };
    let a = shuffled(7);
    assert_eq!(a, shuffled(7), "the same seed gives the same order");
    assert_ne!(a, plain);
    assert_ne!(a, shuffled(8));
    let (mut x, mut y) = (a.clone(), plain.clone());
    x.sort_unstable();
    y.sort_unstable();
    assert_eq!(x, y, "a permutation of the same tokens");
    let tok = bundled();
    let eos = tok.eos_id().unwrap();
    let mut pieces: Vec<Vec<u32>> = a.split_inclusive(|&t| t == eos).map(<[u32]>::to_vec).collect();
    let mut want: Vec<Vec<u32>> = docs().iter().map(|d| tok.encode(d, false).unwrap().into_iter().chain([eos]).collect()).collect();
    pieces.sort();
    want.sort();
    assert_eq!(pieces, want, "each document stays whole");
}

#[test]
fn the_text_field_names_the_json_field_or_parquet_column() {
    let dir = Scratch::new("field");
    let f = dir.path().join("c.jsonl");
    std::fs::write(&f, "{\"content\": \"alpha beta\", \"text\": 3}\n\n{\"content\": \"gamma\"}\n").unwrap();
    let o = PrepareOptions { text_field: "content".into(), ..opts(0.0) };
    let (s, train, _, _o) = run(&f, &o);
    let tok = bundled();
    let eos = tok.eos_id().unwrap();
    let want: Vec<u32> = ["alpha beta", "gamma"].iter().flat_map(|t| tok.encode(t, false).unwrap().into_iter().chain([eos])).collect();
    assert_eq!((s.documents, train), (2, want), "the blank line is not a record");
    let e = prepare(
        fixtures().join("docs/docs.parquet"),
        &tok,
        dir.path().join("o"),
        &PrepareOptions { text_field: "body".into(), ..opts(0.0) },
        &mut |_| ControlFlow::Continue(()),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("docs.parquet") && e.contains("field `body`") && e.contains("no such column") && e.contains("url"), "{e}");
}

#[test]
fn a_long_text_read_in_pieces_gives_the_ids_of_one_encoding() {
    // Over a piece of text; byte-level BPE cuts at line starts anyway, so the pieces change
    // nothing. The same text as one JSON record is cut at the same places.
    let corpus = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/corpus");
    let mut text = String::new();
    for name in ["hamlet.txt", "lear.txt", "othello.txt", "macbeth.txt", "tempest.txt", "sonnets.txt", "coriolanus.txt", "henry_v.txt"] {
        text.push_str(&std::fs::read_to_string(corpus.join(name)).unwrap());
    }
    assert!(text.len() > ferrolm_data::records::PIECE_BYTES);
    let dir = Scratch::new("long");
    std::fs::write(dir.path().join("long.txt"), &text).unwrap();
    std::fs::write(dir.path().join("long.jsonl"), serde_json::json!({ "text": text }).to_string()).unwrap();
    let tok = bundled();
    let mut whole = tok.encode(&text, false).unwrap();
    whole.push(tok.eos_id().unwrap());
    let o = PrepareOptions { shard_tokens: 1 << 20, ..opts(0.0) };
    let (_, from_text, _, _o) = run(&dir.path().join("long.txt"), &o);
    let (_, from_json, _, _o) = run(&dir.path().join("long.jsonl"), &o);
    assert_eq!(from_text.len(), whole.len());
    assert!(from_text == whole, "pieces encode to the ids of the whole text");
    assert!(from_json == whole);
}

#[test]
fn framing_follows_the_tokenizer() {
    let base: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/tokenizer.json")).unwrap(),
    )
    .unwrap();
    let tok = |v: &serde_json::Value| Tokenizer::from_bytes(serde_json::to_string(v).unwrap().as_bytes()).unwrap();
    // ferrolm's tokenizer (and GPT-2's, Llama's): <|eos|> after each document.
    assert_eq!(DocFraming::of(&tok(&base)).unwrap(), DocFraming { prefix: vec![], suffix: vec![1] });
    // No end-of-sequence token: the template's <|bos|> before each document (Llama-style).
    let mut no_eos = base.clone();
    let renamed = serde_json::to_string(&no_eos).unwrap().replace("<|eos|>", "<|sep|>");
    no_eos = serde_json::from_str(&renamed).unwrap();
    let t = tok(&no_eos);
    assert_eq!(t.eos_id(), None);
    assert_eq!(DocFraming::of(&t).unwrap(), DocFraming { prefix: vec![0], suffix: vec![] });
    // A template that closes the sequence: its tokens on both sides.
    let mut closing = base.clone();
    let template = &mut closing["post_processor"]["processors"][1];
    template["single"] = serde_json::json!([
        {"SpecialToken": {"id": "<|bos|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
        {"SpecialToken": {"id": "<|eos|>", "type_id": 0}}
    ]);
    template["special_tokens"]["<|eos|>"] = serde_json::json!({"id": "<|eos|>", "ids": [1], "tokens": ["<|eos|>"]});
    let t = tok(&closing);
    let f = DocFraming::of(&t).unwrap();
    assert_eq!(f, DocFraming { prefix: vec![0], suffix: vec![1] });
    assert_eq!(f.describe(&t), "<|bos|> before and <|eos|> after each document");
    // And prepare places it.
    let dir = Scratch::new("frame");
    std::fs::write(dir.path().join("a.jsonl"), "{\"text\": \"one\"}\n{\"text\": \"two\"}\n").unwrap();
    let s = prepare(dir.path().join("a.jsonl"), &t, dir.path().join("o"), &opts(0.0), &mut |_| ControlFlow::Continue(())).unwrap();
    let sh = Shard::open(&s.train_shards[0]).unwrap();
    let want: Vec<u32> = ["one", "two"].iter().flat_map(|w| [0].into_iter().chain(t.encode(w, false).unwrap()).chain([1])).collect();
    assert_eq!(sh.slice(0, sh.len()), want);
    assert_eq!(s.framing.as_deref(), Some("<|bos|> before and <|eos|> after each document"));
}
