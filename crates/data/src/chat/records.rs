//! One record (a JSON object, or a Parquet row read as one) -> a [`Sample`].
//!
//! The forms, detected from the record's keys in this order (or forced by [`DataFormat`]):
//! - `messages`: a list of `{"role", "content", ...}`; roles `system`, `user`, `assistant`;
//!   `content` a string or a list of `{"type": "text", "text": ...}` parts (any other part type
//!   is refused by name). Other non-null fields of a message go to the template unchanged, as
//!   transformers passes them; null fields are dropped, as transformers drops them.
//! - `conversations` (ShareGPT): `{"from", "value"}`, `human`/`gpt`/`system` -> user/assistant/system.
//! - Alpaca: `instruction`, optional `input`, `output` -> a user message (`instruction`, then
//!   `"\n\n"` and `input` when it is not empty) and an assistant message (`output`).
//! - `prompt` / `completion`: strings (a user and an assistant message) or message lists; the
//!   prompt's messages are never trained (see [`Conversation::prompt_len`]).
//! - `text`: plain text, every token trained, framed as pretraining frames documents.
//!
//! Errors are messages without a location: the reader prepends the file and line (or row).

use super::{DataFormat, Json, Message, Role};

/// A conversation: its messages, and how many of the first ones are prompt (never trained:
/// the `prompt` of a prompt/completion record; 0 for the other forms).
#[derive(Clone, Debug, PartialEq)]
pub struct Conversation {
    pub messages: Vec<Message>,
    pub prompt_len: usize,
}

impl Conversation {
    /// One user message (what `generate --chat TEXT` renders).
    pub fn user(text: &str) -> Self {
        Conversation { messages: vec![Message::new(Role::User, text)], prompt_len: 0 }
    }

    /// A `messages` list given as JSON text (`generate --messages FILE.json`): the list itself,
    /// or an object with a `messages` field.
    pub fn from_json(text: &str) -> Result<Self, String> {
        Self::from_value(&Json::parse(text).map_err(|e| format!("not valid JSON: {e}"))?)
    }

    /// The same from parsed JSON.
    pub fn from_value(v: &Json) -> Result<Self, String> {
        let list = match v {
            Json::Array(_) => v,
            Json::Object(_) => v.get("messages").ok_or_else(|| format!("no `messages` field (keys: {})", keys_of(v)))?,
            other => return Err(format!("expected a list of messages, found {}", other.kind())),
        };
        Ok(Conversation { messages: messages(list, "messages")?, prompt_len: 0 })
    }
}

/// What a record becomes.
#[derive(Clone, Debug, PartialEq)]
pub enum Sample {
    Chat(Conversation),
    /// Plain text, every token trained.
    Text(String),
}

pub(crate) fn keys_of(record: &Json) -> String {
    let keys = record.keys();
    if keys.is_empty() {
        return "none".into();
    }
    let mut shown: Vec<&str> = keys.iter().take(12).copied().collect();
    if keys.len() > 12 {
        shown.push("…");
    }
    shown.join(", ")
}

/// The form of `record` under `format` (`Auto`: from its keys).
fn form_of(record: &Json, format: DataFormat) -> Result<DataFormat, String> {
    if !matches!(record, Json::Object(_)) {
        return Err(format!("the record is {}, not a JSON object", record.kind()));
    }
    let has = |k: &str| record.get(k).is_some();
    if format != DataFormat::Auto {
        let needed: &[&str] = match format {
            DataFormat::Messages => &["messages"],
            DataFormat::ShareGpt => &["conversations"],
            DataFormat::Alpaca => &["instruction", "output"],
            DataFormat::PromptCompletion => &["prompt", "completion"],
            DataFormat::Text | DataFormat::Auto => &["text"],
        };
        if let Some(missing) = needed.iter().find(|k| !has(k)) {
            return Err(format!("--data-format {format}: field `{missing}` is missing (the record has keys: {})", keys_of(record)));
        }
        return Ok(format);
    }
    let form = if has("messages") {
        DataFormat::Messages
    } else if has("conversations") {
        DataFormat::ShareGpt
    } else if has("instruction") && has("output") {
        DataFormat::Alpaca
    } else if has("prompt") && has("completion") {
        DataFormat::PromptCompletion
    } else if has("text") {
        DataFormat::Text
    } else {
        // TRL's preference records are the likeliest wrong file: say which tool reads them.
        let hint = if has("chosen") && has("rejected") {
            ": `chosen` and `rejected` make it a preference record, which the dpo tool trains on (docs/PREFERENCE.md)"
        } else {
            ""
        };
        return Err(format!(
            "a record of no known form (expected `messages`, `conversations`, `instruction`/`output`, \
             `prompt`/`completion` or `text`); it has keys: {}{hint}",
            keys_of(record)
        ));
    };
    Ok(form)
}

fn string_field<'a>(record: &'a Json, key: &str) -> Result<&'a str, String> {
    match record.get(key) {
        Some(Json::String(s)) => Ok(s),
        Some(other) => Err(format!("field `{key}` is {}, not a string", other.kind())),
        None => Err(format!("field `{key}` is missing (the record has keys: {})", keys_of(record))),
    }
}

/// `content`: a string, or a list of text parts.
fn check_content(content: &Json, what: &str) -> Result<(), String> {
    match content {
        Json::String(_) => Ok(()),
        Json::Array(parts) => {
            for (j, part) in parts.iter().enumerate() {
                let Json::Object(_) = part else {
                    return Err(format!("{what}: content part {j} is {}, not an object", part.kind()));
                };
                match part.get("type") {
                    Some(Json::String(t)) if t == "text" => match part.get("text") {
                        Some(Json::String(_)) => {}
                        Some(other) => return Err(format!("{what}: content part {j}: `text` is {}, not a string", other.kind())),
                        None => return Err(format!("{what}: content part {j} of type `text` has no `text` field")),
                    },
                    Some(Json::String(t)) => {
                        return Err(format!("{what}: content part {j} has type `{t}`; only `text` parts are supported"))
                    }
                    Some(other) => return Err(format!("{what}: content part {j}: `type` is {}, not a string", other.kind())),
                    None => return Err(format!("{what}: content part {j} has no `type` (keys: {})", keys_of(part))),
                }
            }
            Ok(())
        }
        other => Err(format!("{what}: content is {}, not text (a string or a list of text parts)", other.kind())),
    }
}

/// A `messages` list (`field` names it in errors).
pub(crate) fn messages(list: &Json, field: &str) -> Result<Vec<Message>, String> {
    let Json::Array(items) = list else { return Err(format!("field `{field}` is {}, not a list of messages", list.kind())) };
    let mut out = Vec::with_capacity(items.len());
    for (i, m) in items.iter().enumerate() {
        let what = format!("{field}[{i}]");
        let Json::Object(fields) = m else { return Err(format!("{what} is {}, not an object", m.kind())) };
        let role = match m.get("role") {
            Some(Json::String(r)) => {
                Role::parse(r).ok_or_else(|| format!("{what}: unknown role `{r}` (expected system, user or assistant)"))?
            }
            Some(other) => return Err(format!("{what}: `role` is {}, not a string", other.kind())),
            None => return Err(format!("{what} has no `role` (keys: {})", keys_of(m))),
        };
        match m.get("content") {
            Some(c) => check_content(c, &what)?,
            None => return Err(format!("{what} has no `content` (keys: {})", keys_of(m))),
        }
        let kept = fields.iter().filter(|(_, v)| *v != Json::Null).cloned().collect();
        out.push(Message::from_fields(role, kept));
    }
    Ok(out)
}

/// ShareGPT's `conversations`.
fn sharegpt(list: &Json) -> Result<Vec<Message>, String> {
    let Json::Array(items) = list else { return Err(format!("field `conversations` is {}, not a list", list.kind())) };
    items
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let what = format!("conversations[{i}]");
            let from = match m.get("from") {
                Some(Json::String(f)) => f,
                Some(other) => return Err(format!("{what}: `from` is {}, not a string", other.kind())),
                None => return Err(format!("{what} has no `from` (keys: {})", keys_of(m))),
            };
            let role = match from.as_str() {
                "human" => Role::User,
                "gpt" => Role::Assistant,
                "system" => Role::System,
                other => return Err(format!("{what}: unknown role `{other}` in `from` (expected human, gpt or system)")),
            };
            match m.get("value") {
                Some(Json::String(v)) => Ok(Message::new(role, v)),
                Some(other) => Err(format!("{what}: `value` is {}, not text", other.kind())),
                None => Err(format!("{what} has no `value` (keys: {})", keys_of(m))),
            }
        })
        .collect()
}

/// A prompt or completion: a string (one message of `role`) or a message list.
fn side(record: &Json, key: &str, role: Role) -> Result<Vec<Message>, String> {
    match record.get(key) {
        Some(Json::String(s)) => Ok(vec![Message::new(role, s)]),
        Some(list @ Json::Array(_)) => messages(list, key),
        Some(other) => Err(format!("field `{key}` is {}, not a string or a list of messages", other.kind())),
        None => Err(format!("field `{key}` is missing (the record has keys: {})", keys_of(record))),
    }
}

/// The sample `record` holds under `format`; the error says what is wrong, naming the field.
pub fn parse_record(record: &Json, format: DataFormat) -> Result<Sample, String> {
    let conv = |messages: Vec<Message>, prompt_len| {
        if messages.is_empty() {
            return Err("the conversation has no messages".to_string());
        }
        Ok(Sample::Chat(Conversation { messages, prompt_len }))
    };
    match form_of(record, format)? {
        DataFormat::Messages => conv(messages(record.get("messages").unwrap_or(&Json::Null), "messages")?, 0),
        DataFormat::ShareGpt => conv(sharegpt(record.get("conversations").unwrap_or(&Json::Null))?, 0),
        DataFormat::Alpaca => {
            let instruction = string_field(record, "instruction")?;
            let input = match record.get("input") {
                None | Some(Json::Null) => "",
                Some(Json::String(s)) => s,
                Some(other) => return Err(format!("field `input` is {}, not a string", other.kind())),
            };
            let output = string_field(record, "output")?;
            let user = if input.is_empty() { instruction.to_string() } else { format!("{instruction}\n\n{input}") };
            conv(vec![Message::new(Role::User, &user), Message::new(Role::Assistant, output)], 0)
        }
        DataFormat::PromptCompletion => {
            let prompt = side(record, "prompt", Role::User)?;
            let completion = side(record, "completion", Role::Assistant)?;
            if completion.is_empty() {
                return Err("field `completion` is an empty list".into());
            }
            let n = prompt.len();
            conv(prompt.into_iter().chain(completion).collect(), n)
        }
        DataFormat::Text | DataFormat::Auto => Ok(Sample::Text(string_field(record, "text")?.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str, f: DataFormat) -> Result<Sample, String> {
        parse_record(&Json::parse(s).unwrap(), f)
    }

    fn chat(s: &str) -> Conversation {
        match parse(s, DataFormat::Auto).unwrap() {
            Sample::Chat(c) => c,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn every_form_is_detected() {
        let c = chat(
            r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, {"role": "assistant", "content": "c", "name": null}]}"#,
        );
        assert_eq!((c.messages[0].text(), c.messages[1].text(), c.prompt_len), ("ab".into(), "c".into(), 0));
        assert_eq!(c.messages[1], Message::new(Role::Assistant, "c"));
        let c = chat(
            r#"{"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "h"}, {"from": "gpt", "value": "g"}]}"#,
        );
        assert_eq!(c.messages.iter().map(|m| m.role()).collect::<Vec<_>>(), [Role::System, Role::User, Role::Assistant]);
        let c = chat(r#"{"instruction": "do", "input": "this", "output": "done"}"#);
        assert_eq!((c.messages[0].text(), c.messages[1].text()), ("do\n\nthis".into(), "done".into()));
        assert_eq!(chat(r#"{"instruction": "do", "input": "", "output": "x"}"#).messages[0].text(), "do");
        let c = chat(r#"{"prompt": "p", "completion": "c"}"#);
        assert_eq!((c.messages.len(), c.prompt_len), (2, 1));
        let c = chat(
            r#"{"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], "completion": [{"role": "assistant", "content": "a"}]}"#,
        );
        assert_eq!((c.messages.len(), c.prompt_len), (3, 2));
        assert_eq!(parse(r#"{"text": "t"}"#, DataFormat::Auto).unwrap(), Sample::Text("t".into()));
    }

    #[test]
    fn errors_say_what_was_found() {
        let e = parse(r#"{"foo": 1, "bar": 2}"#, DataFormat::Auto).unwrap_err();
        assert!(e.contains("no known form") && e.contains("foo, bar") && !e.contains("dpo"), "{e}");
        // A preference record given to the SFT reader names the tool that reads it.
        let e = parse(r#"{"prompt": "p", "chosen": "a", "rejected": "b"}"#, DataFormat::Auto).unwrap_err();
        assert!(e.contains("no known form") && e.contains("preference record") && e.contains("dpo tool"), "{e}");
        let e = parse(r#"{"messages": [{"role": "tool", "content": "x"}]}"#, DataFormat::Auto).unwrap_err();
        assert!(e.contains("unknown role `tool`"), "{e}");
        let e = parse(r#"{"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]}]}"#, DataFormat::Auto).unwrap_err();
        assert!(e.contains("type `image`"), "{e}");
        let e = parse(r#"{"messages": [{"role": "user", "content": 3}]}"#, DataFormat::Auto).unwrap_err();
        assert!(e.contains("content is a number, not text"), "{e}");
        let e = parse(r#"{"conversations": [{"from": "bot", "value": "x"}]}"#, DataFormat::Auto).unwrap_err();
        assert!(e.contains("unknown role `bot`"), "{e}");
        let e = parse(r#"{"text": "t"}"#, DataFormat::Messages).unwrap_err();
        assert!(e.contains("--data-format messages: field `messages` is missing"), "{e}");
        assert!(parse(r#"{"messages": []}"#, DataFormat::Auto).unwrap_err().contains("no messages"));
        assert!(parse("[1]", DataFormat::Auto).unwrap_err().contains("not a JSON object"));
        assert_eq!("prompt-completion".parse::<DataFormat>(), Ok(DataFormat::PromptCompletion));
        assert!("chatml".parse::<DataFormat>().unwrap_err().contains("auto, messages"));
        assert!(Conversation::from_json(r#"[{"role": "user", "content": "hi"}]"#).is_ok());
    }
}
