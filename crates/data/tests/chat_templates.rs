//! Chat-template fidelity against transformers (fixtures: `scripts/chat_template_fixtures.py`):
//! the real templates of Llama 3.1 Instruct, Qwen2.5 Instruct (ChatML), Mistral Instruct v0.3,
//! TRL's Qwen2.5 training template with `{% generation %}` blocks and ferrolm's bundled one, over
//! single-turn, multi-turn and system-prompt conversations and ones that open with an assistant
//! message (with and without a system message), with `add_generation_prompt` off and on. ferrolm
//! must render byte-identical text, the same token ids, and the same assistant masks
//! (transformers' `return_assistant_tokens_mask` where the template has generation blocks),
//! and fail where Jinja2 fails (content given as text parts, added to a string).

#[allow(dead_code)]
mod common;

use ferrolm_data::chat::{encode_prompt, encode_sample, ChatTemplate, Conversation, Json, Sample, TrainOn};
use ferrolm_data::DocFraming;
use serde_json::Value;

#[test]
fn real_templates_render_tokenize_and_mask_as_transformers() {
    let dir = common::chat_fixtures();
    let text = std::fs::read_to_string(dir.join("cases.json")).unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    // The conversations as ferrolm reads records: keys in file order (serde_json's sort).
    let ordered = Json::parse(&text).unwrap();
    let tok = common::chat_tokenizer();
    let framing = DocFraming::of(&tok).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 5 * 6 * 2);
    let mut masks = 0;
    for case in cases {
        let name = case["template"].as_str().unwrap();
        let spec = &doc["templates"][name];
        let file = dir.join("templates").join(spec["file"].as_str().unwrap());
        let specials: Vec<(String, String)> =
            spec["special_tokens"].as_object().unwrap().iter().map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string())).collect();
        let template = ChatTemplate::new(&std::fs::read_to_string(&file).unwrap(), &file.display().to_string(), specials).unwrap();
        assert_eq!(template.has_generation(), name.contains("training"), "{name}");
        let conv_name = case["conversation"].as_str().unwrap();
        let conv = Conversation::from_value(ordered.get("conversations").unwrap().get(conv_name).unwrap()).unwrap();
        let gen = case["add_generation_prompt"].as_bool().unwrap();
        let what = format!("{name} / {conv_name} / add_generation_prompt={gen}");

        if let Some(error) = case.get("error") {
            // Jinja2 refused (a list of text parts added to a string): so must MiniJinja.
            let e = template.render(&conv.messages, gen).unwrap_err();
            assert!(!e.is_empty(), "{what}: transformers failed with {error}");
            continue;
        }
        let rendered = template.render(&conv.messages, gen).unwrap();
        assert_eq!(rendered.text, case["text"].as_str().unwrap(), "{what}: text");
        let want_ids: Vec<u32> = case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(tok.encode(&rendered.text, false).unwrap(), want_ids, "{what}: ids");
        if gen {
            assert_eq!(encode_prompt(&conv, &template, &tok).unwrap(), want_ids, "{what}: prompt ids");
        }

        if let Some(mask) = case.get("assistant_mask") {
            let want: Vec<bool> = mask.as_array().unwrap().iter().map(|v| v.as_u64() == Some(1)).collect();
            let ex = encode_sample(&Sample::Chat(conv.clone()), Some(&template), &tok, &framing, TrainOn::Assistant).unwrap();
            assert_eq!(ex.ids, want_ids, "{what}: example ids");
            assert_eq!(ex.trained, want, "{what}: assistant mask");
            // `last` keeps the last assistant span of `assistant`; `all` trains everything.
            let last = encode_sample(&Sample::Chat(conv.clone()), Some(&template), &tok, &framing, TrainOn::Last).unwrap();
            let trained_last: Vec<usize> = (0..want.len()).filter(|&i| last.trained[i]).collect();
            assert!(!trained_last.is_empty() && trained_last.iter().all(|&i| want[i]), "{what}: last");
            assert_eq!(trained_last.last(), want.iter().rposition(|&m| m).as_ref(), "{what}: last ends with the last span");
            if conv.messages.iter().filter(|m| m.role() == ferrolm_data::chat::Role::Assistant).count() > 1 {
                assert!(trained_last.len() < want.iter().filter(|&&m| m).count(), "{what}: last trains fewer tokens");
            }
            let all = encode_sample(&Sample::Chat(conv), Some(&template), &tok, &framing, TrainOn::All).unwrap();
            assert!(all.trained.iter().all(|&t| t), "{what}: all");
            masks += 1;
        }
    }
    assert_eq!(masks, 25);
}

#[test]
fn strftime_now_formats_as_python_under_a_fixed_clock() {
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(common::chat_fixtures().join("cases.json")).unwrap()).unwrap();
    let case = &doc["strftime_now"];
    let c: Vec<u32> = case["clock"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let now = chrono::NaiveDate::from_ymd_opt(c[0] as i32, c[1], c[2]).unwrap().and_hms_opt(c[3], c[4], c[5]).unwrap();
    let t = ChatTemplate::new(case["template"].as_str().unwrap(), "clock", vec![]).unwrap().with_fixed_time(now);
    let conv = Conversation::from_json(r#"[{"role": "user", "content": "x"}]"#).unwrap();
    assert_eq!(t.render(&conv.messages, false).unwrap().text, case["text"].as_str().unwrap());
}
