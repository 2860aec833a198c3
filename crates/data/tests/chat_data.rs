//! Chat data end to end on the data side: records from every container (JSON Lines plain, gzip,
//! zstd; Parquet with nested `messages`), errors that name the file, the line or row and what
//! was found, `--skip-bad-records` and its counts, the template search order, text records, and
//! the packing invariants over random examples.
mod common;

use std::io::Write;
use std::path::Path;

use common::{chat_fixtures, chat_template, chat_tokenizer, Scratch};
use ferrolm_data::chat::{
    load_examples, pack, ChatDataOptions, ChatTemplate, DataFormat, Example, LoadStats, PackOptions, TrainOn, IGNORE_INDEX,
};
use ferrolm_data::{resolve_inputs, DocFraming, Tokenizer};
use proptest::prelude::*;

fn load(path: &Path, template: &ChatTemplate, tok: &Tokenizer, skip: bool) -> ferrolm_data::Result<(Vec<Example>, LoadStats)> {
    let opts = ChatDataOptions { format: DataFormat::Auto, train_on: TrainOn::Assistant, skip_bad_records: skip };
    load_examples(&resolve_inputs(path)?, Some(template), tok, &opts, &mut |_, _, _| {})
}

/// The Parquet fixture's rows as JSON Lines (row 3 is the bad one, a `tool` role).
const RECORDS: [&str; 5] = [
    r#"{"id": 0, "messages": [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}]}"#,
    r#"{"id": 1, "messages": [{"role": "user", "content": "Hello!  How are you?"}, {"role": "assistant", "content": " I am fine, thanks.\n"}, {"role": "user", "content": "Name a café drink ☕"}, {"role": "assistant", "content": "An espresso: strong, with “crema”."}]}"#,
    r#"{"id": 2, "prompt": "Say hi.", "completion": "Hi!"}"#,
    r#"{"id": 3, "messages": [{"role": "tool", "content": "42"}]}"#,
    r#"{"id": 4, "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "6"}]}"#,
];

#[test]
fn every_container_gives_the_same_examples() {
    let (tok, template) = (chat_tokenizer(), chat_template("qwen2.5_instruct"));
    let dir = Scratch::new("chat-containers");
    let text = RECORDS.join("\n") + "\n";
    let plain = dir.path().join("r.jsonl");
    std::fs::write(&plain, &text).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(text.as_bytes()).unwrap();
    std::fs::write(dir.path().join("r.jsonl.gz"), gz.finish().unwrap()).unwrap();
    std::fs::write(dir.path().join("r.jsonl.zst"), zstd::stream::encode_all(text.as_bytes(), 3).unwrap()).unwrap();

    let (want, stats) = load(&plain, &template, &tok, true).unwrap();
    assert_eq!((stats.records, stats.examples, stats.bad_records, want.len()), (5, 4, 1, 4), "{stats:?}");
    assert!(stats.skip_messages[0].contains("r.jsonl: line 4") && stats.skip_messages[0].contains("unknown role `tool`"), "{stats:?}");
    let e = load(&plain, &template, &tok, false).unwrap_err().to_string();
    assert!(e.contains("r.jsonl: line 4 (byte offset") && e.contains("messages[0]: unknown role `tool`"), "{e}");
    for name in ["r.jsonl.gz", "r.jsonl.zst"] {
        assert_eq!(load(&dir.path().join(name), &template, &tok, true).unwrap().0, want, "{name}");
    }
    // Parquet: the same rows, `messages` a list of structs, other forms' columns null.
    let parquet = chat_fixtures().join("records.parquet");
    let (rows, stats) = load(&parquet, &template, &tok, true).unwrap();
    assert_eq!(rows, want);
    assert!(stats.skip_messages[0].contains("records.parquet: row 3: messages[0]: unknown role `tool`"), "{stats:?}");
    let e = load(&parquet, &template, &tok, false).unwrap_err().to_string();
    assert!(e.contains("records.parquet: row 3"), "{e}");
    // A directory (and a glob) of both gives them in path order.
    let both = Scratch::new("chat-dir");
    std::fs::copy(&parquet, both.path().join("a.parquet")).unwrap();
    std::fs::copy(&plain, both.path().join("b.jsonl")).unwrap();
    let (all, stats) = load(both.path(), &template, &tok, true).unwrap();
    assert_eq!((all.len(), stats.records, stats.bad_records), (8, 10, 2));
    assert_eq!(all[..4], want[..]);
}

#[test]
fn bad_records_name_the_file_the_line_and_what_was_found() {
    let tok = chat_tokenizer();
    let mistral = chat_template("mistral_v0.3_instruct");
    let good = RECORDS[0];
    let cases: [(&[u8], &str); 9] = [
        (br#"{"id": 7, "foo": 2, "bar": []}"#, "a record of no known form"),
        (br#"{"id": 7, "foo": 2, "bar": []}"#, "it has keys: id, foo, bar"),
        (br#"{"messages": [{"role": "robot", "content": "x"}]}"#, "messages[0]: unknown role `robot` (expected system, user or assistant)"),
        (br#"{"messages": [{"role": "user", "content": {"a": 1}}]}"#, "messages[0]: content is an object, not text"),
        (
            br#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}"#,
            "content part 0 has type `image_url`",
        ),
        (br#"{"conversations": [{"from": "bot", "value": "x"}]}"#, "unknown role `bot` in `from`"),
        (
            br#"{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}"#,
            "the chat template raised an exception: After the optional system message, conversation roles must alternate",
        ),
        (b"{\"text\": \"caf\xe9\"}", "invalid UTF-8 at byte 13 of the line"),
        (br#"{"messages": [1, 2"#, "not a JSON object"),
    ];
    let dir = Scratch::new("chat-bad");
    for (bad, want) in cases {
        let path = dir.path().join("bad.jsonl");
        let mut data = format!("{good}\n").into_bytes();
        data.extend_from_slice(bad);
        data.push(b'\n');
        std::fs::write(&path, data).unwrap();
        let e = load(&path, &mistral, &tok, false).unwrap_err().to_string();
        assert!(e.contains(&format!("{}: line 2", path.display())) && e.contains(want), "{want}: {e}");
    }
}

#[test]
fn a_record_over_the_size_limit_is_refused_and_skippable() {
    let (tok, template) = (chat_tokenizer(), chat_template("qwen2.5_instruct"));
    let dir = Scratch::new("chat-big");
    let path = dir.path().join("big.jsonl");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    writeln!(f, "{}", RECORDS[0]).unwrap();
    f.write_all(b"{\"text\": \"").unwrap();
    let chunk = vec![b'a'; 1 << 20];
    for _ in 0..=ferrolm_data::records::MAX_RECORD_BYTES >> 20 {
        f.write_all(&chunk).unwrap();
    }
    f.write_all(b"\"}\n").unwrap();
    writeln!(f, "{}", RECORDS[2]).unwrap();
    drop(f);
    let e = load(&path, &template, &tok, false).unwrap_err().to_string();
    assert!(e.contains("big.jsonl: line 2") && e.contains("longer than 64 MiB"), "{e}");
    let (ex, stats) = load(&path, &template, &tok, true).unwrap();
    assert_eq!((ex.len(), stats.bad_records, stats.records), (2, 1, 3));
}

#[test]
fn skipping_counts_and_an_empty_result_says_why() {
    let (tok, template) = (chat_tokenizer(), chat_template("qwen2.5_instruct"));
    let dir = Scratch::new("chat-skip");
    let path = dir.path().join("s.jsonl");
    let lines = [r#"{"foo": 1}"#, r#"{"messages": [{"role": "user", "content": "no answer"}]}"#, RECORDS[0], r#"{"bar": 1}"#, RECORDS[2]];
    std::fs::write(&path, lines.join("\n")).unwrap();
    let (ex, stats) = load(&path, &template, &tok, true).unwrap();
    assert_eq!((ex.len(), stats.records, stats.bad_records, stats.no_trained_token), (2, 5, 2, 1), "{stats:?}");
    assert_eq!(stats.trained_tokens, ex.iter().map(|e| e.trained_targets() as u64).sum::<u64>());
    assert!(stats.summary().contains("2 bad records skipped, 1 conversations with no trained token skipped"), "{}", stats.summary());
    std::fs::write(&path, [lines[0], lines[1], lines[3]].join("\n")).unwrap();
    let e = load(&path, &template, &tok, true).unwrap_err().to_string();
    assert!(
        e.contains("no usable example") && e.contains("3 records read, 2 bad records skipped, 1 conversations with no trained token"),
        "{e}"
    );
    assert!(e.contains("s.jsonl: line 1"), "the first bad record is shown: {e}");
    // --train-on last keeps conversations; a text file is not chat data.
    let txt = dir.path().join("a.txt");
    std::fs::write(&txt, "plain").unwrap();
    let e = load(&txt, &template, &tok, false).unwrap_err().to_string();
    assert!(e.contains("a.txt") && e.contains("chat data are records"), "{e}");
}

#[test]
fn text_records_are_framed_and_fully_trained() {
    let (tok, template) = (chat_tokenizer(), chat_template("qwen2.5_instruct"));
    let dir = Scratch::new("chat-text");
    let path = dir.path().join("t.jsonl");
    std::fs::write(&path, "{\"text\": \"To be, or not to be.\"}\n").unwrap();
    let (ex, _) = load(&path, &template, &tok, false).unwrap();
    let framing = DocFraming::of(&tok).unwrap();
    let body = tok.encode("To be, or not to be.", false).unwrap();
    let want: Vec<u32> = framing.prefix.iter().chain(&body).chain(&framing.suffix).copied().collect();
    assert!(!framing.suffix.is_empty() || !framing.prefix.is_empty());
    assert_eq!(ex[0].ids, want);
    assert!(ex[0].trained.iter().all(|&t| t));
}

#[test]
fn the_template_is_found_in_transformers_order() {
    let dir = Scratch::new("chat-find");
    let model = dir.path();
    let e = ChatTemplate::find(Some(model), None).unwrap_err().to_string();
    for place in ["--chat-template FILE", "chat_template.jinja", "tokenizer_config.json"] {
        assert!(e.contains(place), "{e}");
    }
    let render = |t: &ChatTemplate| t.render(&[], false).unwrap().text;
    let config = serde_json::json!({
        "bos_token": {"content": "<s>", "special": true}, "eos_token": "</s>", "pad_token": null,
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ bos_token }}{{ eos_token }}{{ pad_token }}"}]
    });
    std::fs::write(model.join("tokenizer_config.json"), config.to_string()).unwrap();
    let t = ChatTemplate::find(Some(model), None).unwrap();
    assert_eq!(render(&t), "D<s></s>", "the list's `default`, the special tokens of the config (pad unset)");
    std::fs::write(model.join("tokenizer_config.json"), serde_json::json!({"chat_template": [{"name": "x", "template": "X"}]}).to_string())
        .unwrap();
    let e = ChatTemplate::find(Some(model), None).unwrap_err().to_string();
    assert!(e.contains("no template named `default` (names: x)"), "{e}");
    std::fs::write(model.join("tokenizer_config.json"), serde_json::json!({"chat_template": "S", "eos_token": "</s>"}).to_string())
        .unwrap();
    assert_eq!(render(&ChatTemplate::find(Some(model), None).unwrap()), "S");
    std::fs::write(model.join("chat_template.jinja"), "J{{ eos_token }}\n").unwrap();
    let t = ChatTemplate::find(Some(model), None).unwrap();
    assert_eq!(render(&t), "J</s>", "chat_template.jinja first, its trailing newline dropped as Jinja2 does");
    let explicit = dir.path().join("mine.jinja");
    std::fs::write(&explicit, "E").unwrap();
    assert_eq!(render(&ChatTemplate::find(Some(model), Some(&explicit)).unwrap()), "E");
    std::fs::write(&explicit, "line one\nline two\n{% for %}\n").unwrap();
    let e = ChatTemplate::find(Some(model), Some(&explicit)).unwrap_err().to_string();
    assert!(e.contains(&format!("{} line 3", explicit.display())) && e.contains("syntax error"), "{e}");
}

fn examples() -> impl Strategy<Value = Vec<Example>> {
    let ex = (1usize..40).prop_flat_map(|len| {
        (proptest::collection::vec(0u32..1000, len), proptest::collection::vec(any::<bool>(), len))
            .prop_map(|(ids, trained)| Example { ids, trained })
    });
    proptest::collection::vec(ex, 0..30)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    /// Every kept example sits in exactly one row, whole (or cut to seq_len), with positions
    /// from 0, targets its own next trained tokens, and the row's segments covering it.
    #[test]
    fn packing_keeps_every_example_whole(examples in examples(), seq in 1usize..48, packed in any::<bool>(), truncate in any::<bool>()) {
        let data = pack(examples.clone(), &PackOptions { seq_len: seq, pack: packed, truncate, pad_id: 7 }).unwrap();
        // Kept, in data order: those that fit, and with `truncate` the cuts that still train.
        let kept: Vec<Example> = examples
            .iter()
            .filter_map(|e| {
                if e.len() <= seq {
                    return Some(e.clone());
                }
                let cut = Example { ids: e.ids[..seq].to_vec(), trained: e.trained[..seq].to_vec() };
                (truncate && cut.trained_targets() > 0).then_some(cut)
            })
            .collect();
        prop_assert_eq!(data.examples(), &kept[..]);
        prop_assert_eq!(data.examples().len() as u64, data.stats().packed);
        let mut seen = vec![0usize; data.examples().len()];
        let mut real = 0;
        for r in 0..data.num_rows() {
            let row = data.row(r);
            prop_assert_eq!(row.ids.len(), seq);
            prop_assert_eq!(row.targets.len(), seq);
            prop_assert_eq!(row.positions.len(), seq);
            prop_assert_eq!(row.cu_seqlens[0], 0);
            prop_assert_eq!(*row.cu_seqlens.last().unwrap() as usize, seq);
            prop_assert!(row.cu_seqlens.windows(2).all(|w| w[0] < w[1]));
            let members = data.row_members(r);
            if !packed { prop_assert_eq!(members.len(), 1); }
            for (k, &m) in members.iter().enumerate() {
                seen[m as usize] += 1;
                let ex = &data.examples()[m as usize];
                let (a, b) = (row.cu_seqlens[k] as usize, row.cu_seqlens[k + 1] as usize);
                prop_assert_eq!(&row.ids[a..b], &ex.ids[..]);
                prop_assert!(row.positions[a..b].iter().enumerate().all(|(j, &p)| p as usize == j));
                for j in 0..ex.len() {
                    let want = if j + 1 < ex.len() && ex.trained[j + 1] { ex.ids[j + 1] as i32 } else { IGNORE_INDEX };
                    prop_assert_eq!(row.targets[a + j], want);
                }
                real += ex.len();
            }
            let end = row.cu_seqlens[members.len()] as usize;
            prop_assert!(row.targets[end..].iter().all(|&t| t == IGNORE_INDEX));
            prop_assert!(row.ids[end..].iter().all(|&t| t == 7));
            prop_assert!(row.positions[end..].iter().enumerate().all(|(j, &p)| p as usize == j));
        }
        prop_assert!(seen.iter().all(|&n| n == 1));
        prop_assert_eq!(real as u64, data.stats().real_tokens);
        if packed && data.num_rows() > 1 {
            // Best fit decreasing: a row was opened only when its first example fitted no
            // earlier row, so no two rows could have been one.
            let mut used: Vec<usize> = (0..data.num_rows()).map(|r| data.row(r).cu_seqlens[data.row_members(r).len()] as usize).collect();
            used.sort();
            prop_assert!(used[0] + used[1] > seq, "{:?}", used);
        }
    }
}
