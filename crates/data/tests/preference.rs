//! Preference data end to end on the data side: the prompt/completion split and truncation
//! against TRL's own code token for token (fixtures of scripts/make_preference_fixtures.py), every
//! container (JSON Lines plain and gzip, a directory, a glob, Parquet as
//! HuggingFaceH4/ultrafeedback_binarized stores it), and bad input: each a clear error naming the
//! file, line and field, or a counted skip.
mod common;

use std::io::Write;
use std::path::Path;

use common::{chat_tokenizer, repo_root, Scratch};
use ferrolm_data::chat::{ChatTemplate, Json};
use ferrolm_data::preference::{
    encode_record, load_preference_pairs, Encoded, PreferenceFormat, PreferenceOptions, PreferencePair, PreferenceStats,
};
use ferrolm_data::{resolve_inputs, Tokenizer};
use serde_json::Value;

fn fixtures() -> std::path::PathBuf {
    repo_root().join("crates/data/tests/fixtures/preference")
}

fn fixture_doc() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("tokenization.json")).unwrap()).unwrap()
}

fn template_of(doc: &Value, name: &str) -> ChatTemplate {
    let spec = &doc["templates"][name];
    let specials = spec["special_tokens"].as_object().unwrap().iter().map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string())).collect();
    ChatTemplate::new(spec["source"].as_str().unwrap(), name, specials).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn split_and_truncation_match_trl_token_for_token() {
    let doc = fixture_doc();
    let tok = chat_tokenizer();
    let added: Vec<&str> = doc["added_tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert!(added.iter().all(|t| tok.token_to_id(t).is_some()), "the fixture's tokenizer has tokens the test's lacks");
    let non_prefix: Vec<&str> = doc["non_prefix_cases"].as_array().unwrap().iter().map(|n| n.as_str().unwrap()).collect();
    assert!(non_prefix.iter().any(|n| n.contains("thinking")) && non_prefix.contains(&"standard/space_boundary"));
    let (mut checked, mut dropped) = (0, 0);
    for case in doc["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let template = case["template"].as_str().map(|t| template_of(&doc, t));
        // Text pairs: the EOS comes from the tokenizer itself (no template, no explicit token).
        let mut opts = PreferenceOptions::new(&tok, template.as_ref());
        opts.max_length = case["max_length"].as_u64().map(|n| n as usize);
        let record = Json::parse(&case["record"].to_string()).unwrap();
        let got = encode_record(&record, &opts).unwrap_or_else(|e| panic!("{name}: {e}"));
        match (&case["expected"], got) {
            (Value::Null, Encoded::Skip(reason)) => {
                assert_eq!(reason, ferrolm_data::preference::PreferenceSkip::PromptTooLong, "{name}");
                dropped += 1;
            }
            (Value::Null, Encoded::Pair(p, _)) => panic!("{name}: TRL drops the pair, ferrolm kept {p:?}"),
            (want, Encoded::Skip(r)) => panic!("{name}: TRL keeps {want}, ferrolm skipped it ({r:?})"),
            (want, Encoded::Pair(pair, notes)) => {
                let expected =
                    PreferencePair { prompt: ids(&want["prompt"]), chosen: ids(&want["chosen"]), rejected: ids(&want["rejected"]) };
                assert_eq!(pair, expected, "{name}");
                if case["max_length"].is_null() {
                    assert_eq!(notes.prompt_not_prefix, non_prefix.contains(&name), "{name}");
                    assert!(!notes.completion_truncated, "{name}");
                } else {
                    let full = expected.chosen_len().max(expected.rejected_len());
                    assert_eq!(full, case["max_length"].as_u64().unwrap() as usize, "{name}: the fixture truncates");
                }
                checked += 1;
            }
        }
    }
    assert!(checked >= 25 && dropped == 4, "{checked} pairs checked, {dropped} dropped");
}

fn load(inputs: &Path, opts: &PreferenceOptions) -> ferrolm_data::Result<(Vec<PreferencePair>, PreferenceStats)> {
    load_preference_pairs(&resolve_inputs(inputs)?, opts, &mut |_, _, _| {})
}

fn bundled(doc: &Value) -> ChatTemplate {
    template_of(doc, "ferrolm_bundled")
}

fn user(t: &str) -> String {
    format!(r#"{{"role": "user", "content": "{t}"}}"#)
}

fn asst(t: &str) -> String {
    format!(r#"{{"role": "assistant", "content": "{t}"}}"#)
}

fn conv(prompt: &str, chosen: &str, rejected: &str) -> String {
    format!(r#"{{"prompt": [{}], "chosen": [{}], "rejected": [{}]}}"#, user(prompt), asst(chosen), asst(rejected))
}

#[test]
fn every_container_gives_the_same_pairs() {
    let doc = fixture_doc();
    let (tok, template) = (chat_tokenizer(), bundled(&doc));
    let opts = PreferenceOptions::new(&tok, Some(&template));
    let dir = Scratch::new("pref-containers");
    let lines = [
        conv("What is the capital of France?", "Paris.", "Lyon."),
        r#"{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}"#.to_string(),
        format!(r#"{{"chosen": [{}, {}], "rejected": [{}, {}]}}"#, user("2 + 2?"), asst("4"), user("2 + 2?"), asst("5")),
    ];
    let text = lines.join("\n") + "\n";
    std::fs::create_dir(dir.path().join("d")).unwrap();
    std::fs::write(dir.path().join("d/a.jsonl"), &text).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(text.as_bytes()).unwrap();
    std::fs::write(dir.path().join("d/b.jsonl.gz"), gz.finish().unwrap()).unwrap();
    let (one, stats) = load(&dir.path().join("d/a.jsonl"), &opts).unwrap();
    assert_eq!((one.len(), stats.records, stats.pairs, stats.skipped()), (3, 3, 3, 0));
    let (gz_pairs, _) = load(&dir.path().join("d/b.jsonl.gz"), &opts).unwrap();
    assert_eq!(gz_pairs, one);
    let (both, stats) = load(&dir.path().join("d"), &opts).unwrap();
    assert_eq!((both.len(), stats.records), (6, 6));
    assert_eq!(both[3..], one[..]);
    let (globbed, _) = load(&dir.path().join("d/*.jsonl*"), &opts).unwrap();
    assert_eq!(globbed, both);
    assert!(stats.summary().starts_with("6 records: 6 pairs ("), "{}", stats.summary());
}

#[test]
fn parquet_rows_as_ultrafeedback_binarized_stores_them() {
    let doc = fixture_doc();
    let (tok, template) = (chat_tokenizer(), bundled(&doc));
    let opts = PreferenceOptions::new(&tok, Some(&template));
    let (from_parquet, stats) = load(&fixtures().join("h4.parquet"), &opts).unwrap();
    assert_eq!((stats.records, stats.pairs), (2, 2));
    // The same rows as JSON Lines, without the columns no form reads.
    let dir = Scratch::new("pref-parquet");
    let uf = &doc["cases"].as_array().unwrap().iter().find(|c| c["name"] == "implicit/ultrafeedback/ferrolm_bundled").unwrap()["record"];
    let lines = [
        serde_json::json!({"prompt": "What color is the sky?", "chosen": uf["chosen"], "rejected": uf["rejected"]}).to_string(),
        format!(r#"{{"chosen": [{}, {}], "rejected": [{}, {}]}}"#, user("2 + 2?"), asst("4"), user("2 + 2?"), asst("5")),
    ];
    std::fs::write(dir.path().join("h4.jsonl"), lines.join("\n")).unwrap();
    let (from_jsonl, _) = load(&dir.path().join("h4.jsonl"), &opts).unwrap();
    assert_eq!(from_parquet, from_jsonl);
    // And the pair TRL computed for the first conversation.
    let want =
        &doc["cases"].as_array().unwrap().iter().find(|c| c["name"] == "implicit/ultrafeedback/ferrolm_bundled").unwrap()["expected"];
    assert_eq!(from_parquet[0].chosen, ids(&want["chosen"]));
    assert_eq!(from_parquet[0].prompt, ids(&want["prompt"]));
}

/// Writes `lines` as `bad.jsonl` and loads it; the error's text, or the stats.
fn load_lines(lines: &[String], opts: &PreferenceOptions) -> Result<(Vec<PreferencePair>, PreferenceStats), String> {
    let dir = Scratch::new("pref-bad");
    let path = dir.path().join("bad.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    load(&path, opts).map_err(|e| e.to_string())
}

#[test]
fn bad_records_fail_naming_file_line_and_field() {
    let doc = fixture_doc();
    let (tok, template) = (chat_tokenizer(), bundled(&doc));
    let opts = PreferenceOptions::new(&tok, Some(&template));
    let good = conv("Hi?", "Hello.", "Go away.");
    let cases: Vec<(String, &str)> = vec![
        (r#"{"prompt": "p", "chosen": "a"}"#.into(), "field `rejected` is missing"),
        (r#"{"prompt": "p", "rejected": "a"}"#.into(), "field `chosen` is missing"),
        (format!(r#"{{"prompt": [{}], "chosen": [{}], "rejected": [{}]}}"#, user("u"), user("a"), asst("b")), "chosen[0] has role `user`"),
        (
            format!(r#"{{"prompt": [{}], "chosen": [{}], "rejected": [{}, {}]}}"#, user("u"), asst("a"), asst("b"), user("c")),
            "rejected[1] has role `user`",
        ),
        (format!(r#"{{"prompt": [{}], "chosen": [], "rejected": [{}]}}"#, user("u"), asst("b")), "field `chosen` is an empty list"),
        (format!(r#"{{"prompt": [{}], "chosen": "a", "rejected": [{}]}}"#, user("u"), asst("b")), "field `chosen` is a string"),
        (r#"{"prompt": "p", "chosen": 1, "rejected": "b"}"#.into(), "field `chosen` is a number"),
        (r#"{"prompt": "p", "chosen": "a", "rejected": "b""#.into(), "not a JSON object"),
    ];
    for (bad, want) in &cases {
        let e = load_lines(&[good.clone(), bad.clone()], &opts).unwrap_err();
        assert!(e.contains("bad.jsonl: line 2") && e.contains(want), "{want}: {e}");
    }
    // A conversational pair without a template: the error says what is needed.
    let no_template = PreferenceOptions::new(&tok, None);
    let e = load_lines(std::slice::from_ref(&good), &no_template).unwrap_err();
    assert!(e.contains("line 1") && e.contains("needs a chat template"), "{e}");
    // --skip-bad-records counts them instead, each message with its line.
    let skipping = PreferenceOptions { skip_bad_records: true, ..opts };
    let mut lines = vec![good.clone()];
    lines.extend(cases.iter().map(|(b, _)| b.clone()));
    let (pairs, stats) = load_lines(&lines, &skipping).unwrap();
    assert_eq!((pairs.len(), stats.records, stats.bad_records), (1, 9, 8));
    assert!(stats.skip_messages.iter().any(|m| m.contains("line 2") && m.contains("`rejected`")), "{:?}", stats.skip_messages);
    assert!(stats.summary().contains("8 bad records"), "{}", stats.summary());
    // Parquet rows are named by row; a text file is refused naming what preference data are.
    let e = load(&common::chat_fixtures().join("records.parquet"), &opts).unwrap_err().to_string();
    assert!(e.contains("records.parquet: row 0") && e.contains("field `chosen` is missing"), "{e}");
    let dir = Scratch::new("pref-txt");
    std::fs::write(dir.path().join("p.txt"), "prompt chosen rejected\n").unwrap();
    let e = load(&dir.path().join("p.txt"), &opts).unwrap_err().to_string();
    assert!(e.contains("p.txt") && e.contains("preference data are records"), "{e}");
    // --data-format forces a format.
    let forced = PreferenceOptions { format: PreferenceFormat::Standard, ..opts };
    let e = load_lines(std::slice::from_ref(&good), &forced).unwrap_err();
    assert!(e.contains("line 1") && e.contains("field `prompt` is a list of messages"), "{e}");
}

#[test]
fn pairs_that_prefer_nothing_or_cannot_fit_are_counted_skips() {
    let doc = fixture_doc();
    let (tok, template) = (chat_tokenizer(), bundled(&doc));
    let words = |n: usize| (0..n).map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ");
    let long_prompt = words(60);
    let lines = vec![
        conv("Hi?", "Hello.", "Go away."),
        conv("Hi?", "Same.", "Same."),
        conv("Hi?", "", "Go away."),
        r#"{"prompt": "The sky is", "chosen": "", "rejected": " green."}"#.to_string(),
        format!(r#"{{"chosen": [{}, {}], "rejected": [{}, {}]}}"#, user("u"), asst("a"), user("u"), asst("a")),
        conv(&long_prompt, "Yes.", "No."),
        conv("Hi?", &words(40), "No."),
    ];
    let opts = PreferenceOptions { max_length: Some(60), ..PreferenceOptions::new(&tok, Some(&template)) };
    let (pairs, stats) = load_lines(&lines, &opts).unwrap();
    assert_eq!(
        (stats.records, stats.pairs, stats.identical, stats.empty_completion, stats.prompt_too_long, stats.completion_truncated),
        (7, 2, 2, 2, 1, 1),
        "{}",
        stats.summary()
    );
    assert_eq!(pairs.len(), 2);
    assert_eq!(pairs[1].chosen_len(), 60);
    assert!(pairs[1].rejected_len() < 60);
    let msgs = stats.skip_messages.join("\n");
    for (line, why) in [(2, "`chosen` equals `rejected`"), (3, "an empty completion"), (6, "the prompt fills --max-length")] {
        assert!(msgs.contains(&format!("line {line} ")) && msgs.contains(why), "{why}: {msgs}");
    }
    let summary = stats.summary();
    for part in
        ["2 with chosen equal to rejected", "2 with an empty completion", "1 whose prompt fills --max-length", "1 pairs' completions"]
    {
        assert!(summary.contains(part), "{part}: {summary}");
    }
    // Nothing usable: the error says why.
    let e = load_lines(&lines[1..3], &opts).unwrap_err();
    assert!(e.contains("no usable pair") && e.contains("1 with chosen equal to rejected"), "{e}");
}

#[test]
fn max_prompt_length_keeps_the_end_of_the_prompt() {
    let doc = fixture_doc();
    let (tok, template) = (chat_tokenizer(), bundled(&doc));
    let record = Json::parse(&conv(&"word ".repeat(20), "Yes.", "No.")).unwrap();
    let full = match encode_record(&record, &PreferenceOptions::new(&tok, Some(&template))).unwrap() {
        Encoded::Pair(p, notes) => {
            assert!(!notes.prompt_truncated);
            p
        }
        other => panic!("{other:?}"),
    };
    let opts = PreferenceOptions { max_prompt_length: Some(8), max_length: Some(10), ..PreferenceOptions::new(&tok, Some(&template)) };
    let Encoded::Pair(cut, notes) = encode_record(&record, &opts).unwrap() else { panic!() };
    assert!(notes.prompt_truncated && notes.completion_truncated);
    assert_eq!(cut.prompt, full.prompt[full.prompt.len() - 8..]);
    assert_eq!(cut.chosen, full.chosen[..2]);
    assert_eq!(cut.rejected, full.rejected[..2]);
    let e = load_preference_pairs(&[], &PreferenceOptions { max_length: Some(0), ..opts }, &mut |_, _, _| {}).unwrap_err();
    assert!(e.to_string().contains("--max-length"), "{e}");
}

#[test]
fn text_pairs_take_the_eos_of_the_config_and_no_template() {
    let tok: Tokenizer = chat_tokenizer();
    let record = Json::parse(r#"{"prompt": "The sky is", "chosen": " blue.", "rejected": " green.</s>"}"#).unwrap();
    let opts = PreferenceOptions { eos_token: Some("</s>"), ..PreferenceOptions::new(&tok, None) };
    let Encoded::Pair(pair, _) = encode_record(&record, &opts).unwrap() else { panic!() };
    let eos = tok.token_to_id("</s>").unwrap();
    assert_eq!(pair.chosen.last(), Some(&eos));
    assert_eq!(pair.rejected.iter().filter(|&&i| i == eos).count(), 1, "no second EOS");
    assert_eq!(pair.prompt[0], tok.token_to_id("<|bos|>").unwrap(), "the tokenizer's BOS, as tokenizer(text) adds it");
}

#[test]
fn the_bundled_preference_file_loads_whole() {
    let root = repo_root();
    let tok = Tokenizer::from_file(root.join("data/tokenizer.json")).unwrap();
    let path = root.join("data/chat_template.jinja");
    let template = ChatTemplate::new(&std::fs::read_to_string(&path).unwrap(), "data/chat_template.jinja", Vec::new()).unwrap();
    let opts = PreferenceOptions { format: PreferenceFormat::Conversational, ..PreferenceOptions::new(&tok, Some(&template)) };
    let (pairs, stats) = load(&root.join("data/prefs.jsonl"), &opts).unwrap();
    assert_eq!((stats.records, stats.pairs, stats.skipped(), stats.prompt_not_prefix), (420, 420, 0, 0), "{}", stats.summary());
    // The chosen reply is the conversation's own (data/chat.jsonl, same order), the rejected another's.
    let chat = std::fs::read_to_string(root.join("data/chat.jsonl")).unwrap();
    for (pair, line) in pairs.iter().zip(chat.lines()).take(50) {
        let messages: Value = serde_json::from_str(line).unwrap();
        let own = messages["messages"].as_array().unwrap().last().unwrap()["content"].as_str().unwrap().trim().to_string();
        let decoded = tok.decode(&pair.chosen).unwrap();
        assert!(decoded.contains(&own), "{decoded:?} lacks {own:?}");
        assert_ne!(pair.chosen, pair.rejected);
    }
    // data/prefs_val.jsonl, the README's held-out pairs: the other conversations (less the two
    // whose reply the plays repeat in a training conversation), each own reply chosen, and held
    // out for real: no prompt and no reply (chosen or rejected) of a training pair, so preference
    // tuning cannot have raised or lowered any of them in any context.
    let (val, stats) = load(&root.join("data/prefs_val.jsonl"), &opts).unwrap();
    assert_eq!((stats.records, stats.pairs, stats.skipped()), (178, 178, 0), "{}", stats.summary());
    let own = |line: &str| {
        let messages: Value = serde_json::from_str(line).unwrap();
        messages["messages"].as_array().unwrap().last().unwrap()["content"].as_str().unwrap().trim().to_string()
    };
    let trained_replies: std::collections::HashSet<String> = chat.lines().take(420).map(own).collect();
    let held_out = chat.lines().skip(420).map(own).filter(|r| !trained_replies.contains(r));
    assert_eq!(held_out.clone().count(), val.len());
    for (pair, reply) in val.iter().zip(held_out) {
        assert!(tok.decode(&pair.chosen).unwrap().contains(&reply), "held-out pair lacks its own reply {reply:?}");
        assert_ne!(pair.chosen, pair.rejected);
    }
    let trained: std::collections::HashSet<&[u32]> = pairs.iter().flat_map(|p| [&p.chosen[..], &p.rejected[..]]).collect();
    let prompts: std::collections::HashSet<&[u32]> = pairs.iter().map(|p| &p.prompt[..]).collect();
    for (i, pair) in val.iter().enumerate() {
        assert!(!prompts.contains(&pair.prompt[..]), "held-out pair {i}'s prompt is a training prompt");
        for side in [&pair.chosen, &pair.rejected] {
            assert!(!trained.contains(&side[..]), "held-out pair {i} holds a training reply: {:?}", tok.decode(side).unwrap());
        }
    }
}
