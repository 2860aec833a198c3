//! Structured fuzzing of the chat data path: records of every form mutated as JSON trees and as
//! bytes, parsed under every `--data-format`, rendered by real templates (the prefix rule and
//! `{% generation %}` blocks) and masked; the nested-`messages` Parquet fixture damaged in its
//! pages and footer; and real templates with bytes edited, compiled and rendered. Every case
//! must give an example or an error, never panic, hang, or allocate above the cap.
mod common;
mod fuzzing;

use std::sync::OnceLock;

use common::{chat_fixtures, chat_template, chat_tokenizer, Scratch};
use ferrolm_data::chat::{encode_sample, parse_record, ChatTemplate, Conversation, DataFormat, Json, RecordReader, TrainOn};
use ferrolm_data::{DocFraming, Tokenizer};
use fuzzing::{apply_bytes, byte_edit, config, json_mutations, mutate_json, parquet_edits};
use proptest::prelude::*;
use serde_json::{json, Value};

#[global_allocator]
static ALLOC: fuzzing::CappedAlloc = fuzzing::CappedAlloc;

struct Setup {
    tok: Tokenizer,
    framing: DocFraming,
    templates: Vec<ChatTemplate>,
}

fn setup() -> &'static Setup {
    static S: OnceLock<Setup> = OnceLock::new();
    S.get_or_init(|| {
        let tok = chat_tokenizer();
        let framing = DocFraming::of(&tok).unwrap();
        let templates =
            ["qwen2.5_instruct", "qwen2.5_training_trl", "mistral_v0.3_instruct", "llama3.1_instruct"].map(chat_template).into();
        Setup { tok, framing, templates }
    })
}

fn base_records() -> [Value; 5] {
    [
        json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Café 東京"}, {"type": "text", "text": " 🎭"}]},
                            {"role": "assistant", "content": "Oui.\n", "name": "bot"}]}),
        json!({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}, {"from": "human", "value": "bye"}, {"from": "gpt", "value": "ciao"}]}),
        json!({"instruction": "Add", "input": "2 and 3", "output": "5", "id": 9}),
        json!({"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}]}),
        json!({"text": "plain \"text\" \\ \u{2028}", "meta": {"n": [1, 2]}}),
    ]
}

fn format() -> impl Strategy<Value = DataFormat> {
    prop_oneof![
        4 => Just(DataFormat::Auto),
        1 => Just(DataFormat::Messages),
        1 => Just(DataFormat::ShareGpt),
        1 => Just(DataFormat::Alpaca),
        1 => Just(DataFormat::PromptCompletion),
        1 => Just(DataFormat::Text),
    ]
}

fn train_on() -> impl Strategy<Value = TrainOn> {
    prop_oneof![Just(TrainOn::Assistant), Just(TrainOn::Last), Just(TrainOn::All)]
}

proptest! {
    #![proptest_config(config(800))]

    /// One record: parse, render with each template, tokenize and mask.
    #[test]
    fn fuzz_chat_records(which in 0usize..5, (edits, bytes) in json_mutations(), f in format(), t in train_on()) {
        let s = setup();
        let data = mutate_json(&base_records()[which], &edits, &bytes);
        let Ok(text) = std::str::from_utf8(&data) else { return Ok(()) };
        let Ok(record) = Json::parse(text) else { return Ok(()) };
        let Ok(sample) = parse_record(&record, f) else { return Ok(()) };
        for template in &s.templates {
            if let Ok(ex) = encode_sample(&sample, Some(template), &s.tok, &s.framing, t) {
                prop_assert_eq!(ex.ids.len(), ex.trained.len());
                prop_assert!(ex.ids.iter().all(|&i| (i as usize) < s.tok.vocab_size()));
            }
        }
        let _ = Conversation::from_json(text);
    }
}

fn base_parquet() -> &'static [u8] {
    static B: OnceLock<Vec<u8>> = OnceLock::new();
    B.get_or_init(|| std::fs::read(chat_fixtures().join("records.parquet")).unwrap())
}

proptest! {
    #![proptest_config(config(800))]

    /// The nested-`messages` Parquet fixture, damaged: open and read every row as a record.
    #[test]
    fn fuzz_chat_parquet(edits in parquet_edits(base_parquet().len())) {
        thread_local!(static DIR: Scratch = Scratch::new("fuzz-chat-parquet"));
        DIR.with(|dir| -> Result<(), TestCaseError> {
            let path = fuzzing::damaged_copy(dir.path(), "f.parquet", base_parquet(), &edits);
            fuzzing::read_damaged_records(&path, RecordReader::open, |rec| {
                let _ = parse_record(rec, DataFormat::Auto);
            })
        })?;
    }
}

fn template_source() -> &'static str {
    static T: OnceLock<String> = OnceLock::new();
    T.get_or_init(|| std::fs::read_to_string(chat_fixtures().join("templates/llama3.1_instruct.jinja")).unwrap())
}

proptest! {
    #![proptest_config(config(400))]

    /// A real template with bytes edited: compile and render, or an error naming it.
    #[test]
    fn fuzz_chat_template_text(edits in proptest::collection::vec(byte_edit(), 1..4), gen in any::<bool>()) {
        let mut bytes = template_source().as_bytes().to_vec();
        edits.iter().for_each(|e| apply_bytes(&mut bytes, e));
        let Ok(src) = String::from_utf8(bytes) else { return Ok(()) };
        match ChatTemplate::new(&src, "fuzzed.jinja", vec![("bos_token".into(), "<|begin_of_text|>".into())]) {
            Ok(t) => {
                let conv = Conversation::from_json(r#"[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]"#).unwrap();
                let _ = t.render(&conv.messages, gen);
            }
            Err(e) => prop_assert!(e.to_string().contains("fuzzed.jinja"), "{}", e),
        }
    }
}
