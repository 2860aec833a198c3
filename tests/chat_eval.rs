//! `eval --model DIR --chat FILE` (issue 42 item 7): on a committed tiny model, its loss equals
//! transformers' loss with labels -100 outside the assistant tokens (rel 1e-5 in f32) over the
//! same number of tokens (`scripts/make_chat_loss_fixture.py` wrote tests/fixtures/chat_loss/);
//! its flags take both forms and are checked. `generate --chat` / `--messages` reply with the
//! template and stop at generation_config.json's `eos_token_id`.
mod common;
use common::*;
use ferrolm::cli::eval::EvalArgs;
use ferrolm::cli::parse_from;
use std::path::{Path, PathBuf};

/// The fixture's model directory with the bundled tokenizer copied in.
fn fixture(dir: &Path) -> PathBuf {
    let src = data_dir().parent().unwrap().join("tests/fixtures/chat_loss");
    let ck = dir.join("model");
    std::fs::create_dir_all(&ck).unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, ck.join(f.file_name().unwrap())).unwrap();
    }
    std::fs::copy(tokenizer_path(), ck.join("tokenizer.json")).unwrap();
    ck
}

fn eval(ck: &Path, extra: &[&str]) -> anyhow::Result<ferrolm::eval::Score> {
    let a: EvalArgs = parse_from(args(&["eval", "--device=cpu", "--dtype=f32"], &[flag("model", ck)], extra)).unwrap();
    ferrolm::cli::eval::evaluate(a)
}

#[test]
fn eval_chat_gives_transformers_loss_over_the_assistant_tokens() {
    let dir = tmp("chat-eval-fixture");
    let ck = fixture(&dir);
    let expected: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(ck.join("expected.json")).unwrap()).unwrap();
    let (loss, tokens) = (expected["loss"].as_f64().unwrap(), expected["tokens"].as_u64().unwrap() as usize);
    let chat = ck.join("chat.jsonl");
    // Every batch size (conversations of different lengths share a forward pass, padded).
    for bs in ["1", "3"] {
        let s = eval(&ck, &["--chat", chat.to_str().unwrap(), "--batch-size", bs]).unwrap();
        assert_eq!(s.tokens, tokens, "--batch-size {bs}");
        assert!((s.loss - loss).abs() <= 1e-5 * loss, "--batch-size {bs}: loss {} vs transformers {loss}", s.loss);
    }
    // --train-on all scores every next token: more of them than the assistant's.
    let all = eval(&ck, &[&format!("--chat={}", chat.display()), "--train-on=all"]).unwrap();
    let ids: u64 = expected["per_conversation"].as_array().unwrap().iter().map(|c| c["ids"].as_u64().unwrap() - 1).sum();
    assert_eq!(all.tokens as u64, ids);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn eval_chat_flags_take_both_forms_and_a_long_conversation_is_dropped() {
    let dir = tmp("chat-eval-flags");
    let ck = fixture(&dir);
    let chat = ck.join("chat.jsonl");
    let template = ck.join("chat_template.jinja");
    let spaced = [
        "--chat",
        chat.to_str().unwrap(),
        "--chat-template",
        template.to_str().unwrap(),
        "--train-on",
        "last",
        "--data-format",
        "messages",
        "--seq-len",
        "80",
    ];
    let joined = [
        format!("--chat={}", chat.display()),
        format!("--chat-template={}", template.display()),
        "--train-on=last".into(),
        "--data-format=messages".into(),
        "--seq-len=80".into(),
    ];
    let p = |extra: &[String]| parse_from::<EvalArgs, _, _>([&["eval".to_string(), "--model".into(), "m".into()], extra].concat());
    let a = p(&spaced.map(String::from)).unwrap();
    assert_eq!(a, p(&joined).unwrap());
    // The 102-token conversation does not fit 80 tokens: the three others are scored, the last
    // assistant message of each.
    let s = eval(&ck, &spaced).unwrap();
    let e = eval(&ck, &["--chat", chat.to_str().unwrap(), "--seq-len", "80"]).unwrap();
    assert!(s.tokens > 0 && s.tokens < e.tokens, "{s:?} vs {e:?}");
    assert_eq!(e.tokens, 13 + 16 + 14, "the conversations of at most 80 tokens");
    // --text and --chat exclude each other; one of them is needed; --seq-len is needed with --text.
    let m = |x: &[&str]| parse_from::<EvalArgs, _, _>([&["eval", "--model", "m"], x].concat());
    assert!(m(&["--text", "t", "--chat", "c", "--seq-len=4"]).is_err());
    assert!(m(&["--seq-len=4"]).is_err());
    assert!(m(&["--text", "t"]).is_err());
    assert!(m(&["--chat", "c"]).is_ok());
    let bad = m(&["--chat", "c", "--train-on", "tools"]).unwrap_err().to_string();
    assert!(bad.contains("--train-on"), "{bad}");
    let text = data_path("corpus/sonnets.txt");
    let e = eval(&ck, &[&flag("text", &text), "--seq-len=8", &flag("chat-template", &template)]).unwrap_err();
    assert!(format!("{e:#}").contains("--chat-template applies to --chat"), "{e:#}");
    // A model without a template is refused, naming the three places it looks.
    std::fs::remove_file(ck.join("chat_template.jinja")).unwrap();
    let e = eval(&ck, &["--chat", chat.to_str().unwrap()]).unwrap_err();
    let msg = format!("{e:#}");
    assert!(msg.contains("--chat-template") && msg.contains("chat_template.jinja") && msg.contains("tokenizer_config.json"), "{msg}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn generate(ck: &Path, extra: &[&str]) -> anyhow::Result<String> {
    let head = ["generate", "--device=cpu", "--temperature=0"];
    let a: ferrolm::cli::generate::GenerateArgs = parse_from(args(&head, &[flag("model", ck)], extra)).unwrap();
    ferrolm::cli::generate::generate(a)
}

#[test]
fn generate_chat_and_messages_reply_with_the_template_and_stop_at_eos_token_id() {
    let dir = tmp("chat-generate");
    let ck = fixture(&dir);
    let reply = generate(&ck, &["--chat", "Who's there?", "--max-new-tokens", "12"]).unwrap();
    assert!(!reply.is_empty() && !reply.contains("Who's there?"), "the reply only: {reply:?}");
    // --messages: the same conversation as a list, or as an object with `messages`.
    let list = dir.join("list.json");
    std::fs::write(&list, r#"[{"role": "user", "content": "Who's there?"}]"#).unwrap();
    let object = dir.join("object.json");
    std::fs::write(&object, r#"{"messages": [{"role": "user", "content": "Who's there?"}]}"#).unwrap();
    assert_eq!(generate(&ck, &["--messages", list.to_str().unwrap(), "--max-new-tokens=12"]).unwrap(), reply);
    assert_eq!(generate(&ck, &[&format!("--messages={}", object.display()), "--max-new-tokens=12"]).unwrap(), reply);
    // --chat-template in both forms: the fixture's own template gives the same reply.
    let t = ck.join("chat_template.jinja");
    assert_eq!(generate(&ck, &["--chat=Who's there?", "--chat-template", t.to_str().unwrap(), "--max-new-tokens=12"]).unwrap(), reply);
    assert_eq!(generate(&ck, &["--chat=Who's there?", &flag("chat-template", &t), "--max-new-tokens=12"]).unwrap(), reply);
    // Generation stops at (and drops) an id of generation_config.json's eos_token_id list: with
    // the reply's first token there, the reply is empty.
    let first = generate(&ck, &["--chat", "Who's there?", "--max-new-tokens=1"]).unwrap();
    let tok = ferrolm::data::Tokenizer::from_file(ck.join("tokenizer.json")).unwrap();
    let id = tok.encode(&first, false).unwrap();
    assert_eq!(id.len(), 1, "{first:?}");
    std::fs::write(ck.join("generation_config.json"), format!(r#"{{"eos_token_id": [1, {}]}}"#, id[0])).unwrap();
    assert_eq!(generate(&ck, &["--chat", "Who's there?", "--max-new-tokens=12"]).unwrap(), "");
    // Bad input is refused naming the flag or file.
    let bad = dir.join("bad.json");
    std::fs::write(&bad, r#"{"turns": []}"#).unwrap();
    let e = format!("{:#}", generate(&ck, &["--messages", bad.to_str().unwrap()]).unwrap_err());
    assert!(e.contains("bad.json") && e.contains("messages"), "{e}");
    let m = |x: &[&str]| parse_from::<ferrolm::cli::generate::GenerateArgs, _, _>([&["generate", "--model", "m"], x].concat());
    assert!(m(&[]).is_err() && m(&["--prompt", "a", "--chat", "b"]).is_err() && m(&["--chat", "a", "--messages", "b"]).is_err());
    let e = format!("{:#}", generate(&ck, &["--prompt", "a", "--chat-template", t.to_str().unwrap()]).unwrap_err());
    assert!(e.contains("--chat-template applies to --chat"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
