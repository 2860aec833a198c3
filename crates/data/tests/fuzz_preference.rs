//! Structured fuzzing of the preference data path: records of each TRL format mutated as JSON
//! trees and as bytes, parsed under every `--data-format`, tokenized through real templates with
//! and without truncation; and the UltraFeedback-style Parquet fixture damaged in its pages and
//! footer. Every case must give a pair, a counted skip or an error, never panic, hang, or
//! allocate above the cap; a pair always has a completion and fits `--max-length`.
mod common;
mod fuzzing;

use std::sync::OnceLock;

use common::{chat_tokenizer, repo_root, Scratch};
use ferrolm_data::chat::{ChatTemplate, Json};
use ferrolm_data::preference::{encode_record, Encoded, PreferenceFormat, PreferenceOptions, PREFERENCE_COLUMNS};
use ferrolm_data::Tokenizer;
use fuzzing::{config, json_mutations, mutate_json, parquet_edits};
use proptest::prelude::*;
use serde_json::{json, Value};

#[global_allocator]
static ALLOC: fuzzing::CappedAlloc = fuzzing::CappedAlloc;

struct Setup {
    tok: Tokenizer,
    templates: Vec<ChatTemplate>,
}

fn setup() -> &'static Setup {
    static S: OnceLock<Setup> = OnceLock::new();
    S.get_or_init(|| {
        let tok = chat_tokenizer();
        let templates = ["qwen2.5_instruct", "mistral_v0.3_instruct", "llama3.1_instruct"].map(common::chat_template).into();
        Setup { tok, templates }
    })
}

fn base_records() -> [Value; 4] {
    [
        json!({"prompt": "The sky is ", "chosen": "blue.<|im_end|>", "rejected": " green ☕"}),
        json!({"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Café"}]}],
               "chosen": [{"role": "assistant", "content": "Oui."}], "rejected": [{"role": "assistant", "content": "Non.", "name": "bot"}]}),
        json!({"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
               "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]}),
        json!({"chosen": "\n\nHuman: hi\n\nAssistant: hello", "rejected": "\n\nHuman: hi\n\nAssistant: go"}),
    ]
}

fn format() -> impl Strategy<Value = PreferenceFormat> {
    prop_oneof![
        4 => Just(PreferenceFormat::Auto),
        1 => Just(PreferenceFormat::Standard),
        1 => Just(PreferenceFormat::Conversational),
        1 => Just(PreferenceFormat::ImplicitPrompt),
    ]
}

proptest! {
    #![proptest_config(config(600))]

    /// One record: parse and tokenize with each template, with and without truncation.
    #[test]
    fn fuzz_preference_records(which in 0usize..4, (edits, bytes) in json_mutations(), f in format(),
                               max_length in proptest::option::of(1usize..40), max_prompt in proptest::option::of(1usize..30)) {
        let s = setup();
        let data = mutate_json(&base_records()[which], &edits, &bytes);
        let Ok(text) = std::str::from_utf8(&data) else { return Ok(()) };
        let Ok(record) = Json::parse(text) else { return Ok(()) };
        for template in &s.templates {
            let opts = PreferenceOptions { format: f, max_length, max_prompt_length: max_prompt, ..PreferenceOptions::new(&s.tok, Some(template)) };
            if let Ok(Encoded::Pair(pair, _)) = encode_record(&record, &opts) {
                prop_assert!(!pair.chosen.is_empty() && !pair.rejected.is_empty());
                if let Some(m) = max_length {
                    prop_assert!(pair.chosen_len() <= m && pair.rejected_len() <= m);
                }
                if let Some(m) = max_prompt {
                    prop_assert!(pair.prompt.len() <= m);
                }
                prop_assert!(pair.prompt.iter().chain(&pair.chosen).chain(&pair.rejected).all(|&i| (i as usize) < s.tok.vocab_size()));
            }
        }
    }
}

fn base_parquet() -> &'static [u8] {
    static B: OnceLock<Vec<u8>> = OnceLock::new();
    B.get_or_init(|| std::fs::read(repo_root().join("crates/data/tests/fixtures/preference/h4.parquet")).unwrap())
}

proptest! {
    #![proptest_config(config(300))]

    /// The UltraFeedback-style Parquet fixture, damaged: open and read every row as a record.
    #[test]
    fn fuzz_preference_parquet(edits in parquet_edits(base_parquet().len())) {
        thread_local!(static DIR: Scratch = Scratch::new("fuzz-pref-parquet"));
        DIR.with(|dir| -> Result<(), TestCaseError> {
            let s = setup();
            let path = fuzzing::damaged_copy(dir.path(), "f.parquet", base_parquet(), &edits);
            let opts = PreferenceOptions::new(&s.tok, Some(&s.templates[0]));
            fuzzing::read_damaged_records(&path, |f| ferrolm_data::chat::RecordReader::open_for(f, &PREFERENCE_COLUMNS), |rec| {
                let _ = encode_record(rec, &opts);
            })
        })?;
    }
}
