//! `.json` files (a top-level array of records, or JSON Lines misnamed) and a UTF-8 byte order
//! mark at the start of a file, through the chat loader (`chat::load_examples`) and through
//! pretraining's `prepare`: each gives what the same records as plain JSON Lines (or text
//! without the mark) give, and errors name the file and `record N`, the array's index.
mod common;

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use common::{chat_template, chat_tokenizer, read_shards, Scratch};
use ferrolm_data::chat::{load_examples, ChatDataOptions, ChatTemplate, DataFormat, Example, LoadStats, TrainOn};
use ferrolm_data::{prepare, resolve_inputs, PrepareOptions, Tokenizer};

const BOM: &str = "\u{FEFF}";

fn load(path: &Path, template: &ChatTemplate, tok: &Tokenizer, skip: bool) -> ferrolm_data::Result<(Vec<Example>, LoadStats)> {
    let opts = ChatDataOptions { format: DataFormat::Auto, train_on: TrainOn::Assistant, skip_bad_records: skip };
    load_examples(&resolve_inputs(path)?, Some(template), tok, &opts, &mut |_, _, _| {})
}

/// Chat records; the third is bad (a `tool` role), the fourth holds brackets, quotes and commas
/// inside its strings.
const RECORDS: [&str; 4] = [
    r#"{"messages": [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}]}"#,
    r#"{"conversations": [{"from": "gpt", "value": "Hi! Ask me anything."}, {"from": "human", "value": "2 + 2?"}, {"from": "gpt", "value": "4"}]}"#,
    r#"{"messages": [{"role": "tool", "content": "42"}]}"#,
    r#"{"instruction": "Quote \"]}, {[\" back", "input": "", "output": "\"]}, {[\" \\ ,"}"#,
];

/// The records as one pretty-printed array, one element spread over lines.
fn as_array(records: &[&str]) -> String {
    let spread: Vec<String> = records.iter().map(|r| r.replace(", \"", ",\n    \"")).collect();
    format!("[\n  {}\n]\n", spread.join(",\n  "))
}

#[test]
fn a_json_array_of_chat_records_reads_as_json_lines_do() {
    let (tok, template) = (chat_tokenizer(), chat_template("qwen2.5_instruct"));
    let dir = Scratch::new("json-chat");
    let jsonl = dir.path().join("r.jsonl");
    std::fs::write(&jsonl, RECORDS.join("\n") + "\n").unwrap();
    let (want, stats) = load(&jsonl, &template, &tok, true).unwrap();
    assert_eq!((stats.records, stats.examples, want.len()), (4, 3, 3), "{stats:?}");

    // An array (with a byte order mark), JSON Lines named .json, JSON Lines with a mark.
    let array = dir.path().join("alpaca.json");
    std::fs::write(&array, format!("{BOM}{}", as_array(&RECORDS))).unwrap();
    let misnamed = dir.path().join("lines.json");
    std::fs::write(&misnamed, RECORDS.join("\n")).unwrap();
    let marked = dir.path().join("marked.jsonl");
    std::fs::write(&marked, format!("{BOM}{}\n", RECORDS.join("\n"))).unwrap();
    for path in [&array, &misnamed, &marked] {
        let (got, s) = load(path, &template, &tok, true).unwrap();
        assert_eq!(got, want, "{}", path.display());
        assert_eq!((s.records, s.bad_records), (4, 1), "{}: {s:?}", path.display());
    }
    let (_, s) = load(&array, &template, &tok, true).unwrap();
    assert!(
        s.skip_messages[0].contains("alpaca.json: record 2 (byte offset") && s.skip_messages[0].contains("unknown role `tool`"),
        "{s:?}"
    );
    let e = load(&array, &template, &tok, false).unwrap_err().to_string();
    assert!(e.contains("alpaca.json: record 2 (byte offset") && e.contains("messages[0]: unknown role `tool`"), "{e}");

    // A glob takes .json files; a directory leaves them out and says how to name them.
    let glob = dir.path().join("alpaca*.json");
    assert_eq!(load(&glob, &template, &tok, true).unwrap().0, want);
    let only_json = Scratch::new("json-dir");
    std::fs::copy(&array, only_json.path().join("train.json")).unwrap();
    let e = load(only_json.path(), &template, &tok, true).unwrap_err().to_string();
    assert!(e.contains("1 .json file(s) left out") && e.contains("/*.json"), "{e}");
}

#[test]
fn a_broken_json_array_names_the_file_and_the_record() {
    let (tok, template) = (chat_tokenizer(), chat_template("qwen2.5_instruct"));
    let dir = Scratch::new("json-bad");
    let path = dir.path().join("bad.json");
    let fail = |text: &str, skip: bool| {
        std::fs::write(&path, text).unwrap();
        load(&path, &template, &tok, skip).unwrap_err().to_string()
    };
    let (a, b) = (RECORDS[0], RECORDS[1]);
    let cases = [
        (format!("[{a}, {{\"messages\": [1, }}, {b}]"), "bad.json: record 1 (byte offset"),
        (format!("[{a}, {b}"), "the file ends inside the JSON array, after 2 record(s)"),
        (format!("[{a}, {b},]"), "a trailing comma is not JSON"),
        (format!("[{a} {b}]"), "expected `,` or `]` after record 0, found `{`"),
        (format!("[{a}] x"), "text after the JSON array's closing `]`"),
        (format!("\"{a}\""), "must hold a JSON array of them"),
        (format!("[{a}, {{\"text\": \"a"), "the file ends inside record 1"),
        // A pretty-printed object is neither an array nor JSON Lines: the message says what is.
        ("{\n  \"data\": []\n}\n".to_string(), "one JSON object per line"),
    ];
    for (text, want) in &cases {
        let e = fail(text, false);
        assert!(e.contains(&path.display().to_string()) && e.contains(want), "{want}: {e}");
    }
    // A bad element is one bad record: the next is still read.
    std::fs::write(&path, format!("[{a}, 7, {b}]")).unwrap();
    let (ex, stats) = load(&path, &template, &tok, true).unwrap();
    assert_eq!((ex.len(), stats.records, stats.bad_records), (2, 3, 1), "{stats:?}");
    assert!(stats.skip_messages[0].contains("record 1") && stats.skip_messages[0].contains("a number, not a JSON object"), "{stats:?}");
    // An empty array is no records, as an empty JSON Lines file is.
    let e = fail(" [ ] ", true);
    assert!(e.contains("0 records read"), "{e}");
}

#[test]
fn text_files_are_not_chat_records_and_the_message_says_which_formats_are() {
    let (tok, template) = (chat_tokenizer(), chat_template("qwen2.5_instruct"));
    let dir = Scratch::new("json-txt");
    for name in ["notes.txt", "data.csv"] {
        let path = dir.path().join(name);
        std::fs::write(&path, "hello").unwrap();
        let e = load(&path, &template, &tok, false).unwrap_err().to_string();
        assert!(e.contains(name) && e.contains("chat data are records") && e.contains(".json, .jsonl"), "{e}");
        assert!(!e.contains("other than .txt"), "{e}");
    }
}

fn bundled() -> Tokenizer {
    Tokenizer::from_file(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/tokenizer.json")).unwrap()
}

/// The train and validation tokens `prepare` writes for `input`.
fn prepared(input: &Path) -> (Vec<u32>, Vec<u32>, usize) {
    let out = Scratch::new("json-prep");
    let o = PrepareOptions { val_fraction: 0.25, shard_tokens: 300, part_tokens: 500, batch_bytes: 2000, ..PrepareOptions::default() };
    let s = prepare(input, &bundled(), out.path(), &o, &mut |_| ControlFlow::Continue(())).unwrap();
    (read_shards(&s.train_shards), read_shards(&s.val_shards), s.documents)
}

#[test]
fn prepare_reads_json_arrays_and_skips_byte_order_marks() {
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let dir = Scratch::new("json-docs");
    // Text records: the fixture's JSON Lines, as an array with a mark, and as marked lines.
    let lines = std::fs::read_to_string(fixtures.join("docs/docs.jsonl")).unwrap();
    let records: Vec<&str> = lines.lines().filter(|l| !l.trim().is_empty()).collect();
    let want = prepared(&fixtures.join("docs/docs.jsonl"));
    assert_eq!(want.2, records.len());
    let array = dir.path().join("docs.json");
    std::fs::write(&array, format!("{BOM}{}", as_array(&records))).unwrap();
    let marked = dir.path().join("marked.jsonl");
    std::fs::write(&marked, format!("{BOM}{lines}")).unwrap();
    assert_eq!(prepared(&array), want, "a .json array");
    assert_eq!(prepared(&marked), want, "JSON Lines with a byte order mark");
    // A text file with a mark gives the tokens of the text without it.
    let text = std::fs::read_to_string(fixtures.join("one_doc/doc.txt")).unwrap();
    let marked_txt = dir.path().join("doc.txt");
    std::fs::write(&marked_txt, format!("{BOM}{text}")).unwrap();
    assert_eq!(prepared(&marked_txt), prepared(&fixtures.join("one_doc/doc.txt")), "text with a byte order mark");
}

#[test]
fn an_array_element_over_the_size_limit_is_refused_and_skippable() {
    use std::io::Write;
    let (tok, template) = (chat_tokenizer(), chat_template("qwen2.5_instruct"));
    let dir = Scratch::new("json-big");
    let path = dir.path().join("big.json");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    write!(f, "[{},\n{{\"text\": \"", RECORDS[0]).unwrap();
    let chunk = vec![b'a'; 1 << 20];
    for _ in 0..=ferrolm_data::records::MAX_RECORD_BYTES >> 20 {
        f.write_all(&chunk).unwrap();
    }
    write!(f, "\"}},\n{}]", RECORDS[1]).unwrap();
    drop(f);
    let e = load(&path, &template, &tok, false).unwrap_err().to_string();
    assert!(e.contains("big.json: record 1 (byte offset") && e.contains("longer than 64 MiB"), "{e}");
    let (ex, stats) = load(&path, &template, &tok, true).unwrap();
    assert_eq!((ex.len(), stats.bad_records, stats.records), (2, 1, 3), "{stats:?}");
}
