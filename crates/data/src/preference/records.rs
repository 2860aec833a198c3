//! One record (a JSON object, or a Parquet row read as one) -> a [`RawPair`]: TRL's preference
//! formats, detected from the record's keys or forced by [`PreferenceFormat`].
//!
//! - **standard**: `{"prompt": str, "chosen": str, "rejected": str}`;
//! - **conversational**: `prompt` a list of messages, `chosen` and `rejected` lists of assistant
//!   messages (the chat forms' `messages` rules: roles `system`, `user`, `assistant`; content a
//!   string or text parts);
//! - **implicit prompt**: `{"chosen": ..., "rejected": ...}` without `prompt`, both whole
//!   conversations (or both strings); the prompt is what they share at the start, cut where
//!   TRL's `extract_prompt` cuts it. A `prompt` string beside two whole conversations, as in
//!   HuggingFaceH4/ultrafeedback_binarized (where it repeats the first user message), is not read.
//!
//! Errors are messages without a location, naming the field: the loader prepends the file and
//! line (or row).

use crate::chat::records::{keys_of, messages};
use crate::chat::{Json, Message, Role};

/// Which preference format `--data-format` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum PreferenceFormat {
    /// Detected per record: `prompt` a string (standard) or a list (conversational); no
    /// `prompt` (implicit prompt).
    #[default]
    Auto,
    /// `prompt`, `chosen`, `rejected`: strings.
    Standard,
    /// `prompt`, `chosen`, `rejected`: lists of messages.
    Conversational,
    /// `chosen`, `rejected`: whole conversations (or strings) sharing their prompt.
    ImplicitPrompt,
}

impl PreferenceFormat {
    /// Every value, as written on the command line.
    pub const NAMES: &'static [&'static str] = &["auto", "standard", "conversational", "implicit-prompt"];

    pub fn name(self) -> &'static str {
        match self {
            PreferenceFormat::Auto => "auto",
            PreferenceFormat::Standard => "standard",
            PreferenceFormat::Conversational => "conversational",
            PreferenceFormat::ImplicitPrompt => "implicit-prompt",
        }
    }
}

impl std::fmt::Display for PreferenceFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for PreferenceFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::NAMES
            .iter()
            .position(|n| *n == s)
            .map(|i| [Self::Auto, Self::Standard, Self::Conversational, Self::ImplicitPrompt][i])
            .ok_or_else(|| format!("unknown --data-format value `{s}` for preference data (expected one of {})", Self::NAMES.join(", ")))
    }
}

/// A record's pair before tokenization: text (standard, or implicit-prompt strings) or messages.
#[derive(Clone, Debug, PartialEq)]
pub enum RawPair {
    Text { prompt: String, chosen: String, rejected: String },
    Chat { prompt: Vec<Message>, chosen: Vec<Message>, rejected: Vec<Message> },
}

impl RawPair {
    /// Whether the chosen and rejected completions are the same.
    pub fn identical(&self) -> bool {
        match self {
            RawPair::Text { chosen, rejected, .. } => chosen == rejected,
            RawPair::Chat { chosen, rejected, .. } => same_messages(chosen, rejected),
        }
    }

    /// Whether the chosen or the rejected completion has no text (an empty string, or only
    /// messages whose content is empty).
    pub fn empty_completion(&self) -> bool {
        match self {
            RawPair::Text { chosen, rejected, .. } => chosen.is_empty() || rejected.is_empty(),
            RawPair::Chat { chosen, rejected, .. } => {
                let empty = |ms: &[Message]| ms.iter().all(|m| m.text().is_empty());
                empty(chosen) || empty(rejected)
            }
        }
    }
}

/// Python's dict equality for two messages: the same fields with the same values, in any order.
fn same_message(a: &Message, b: &Message) -> bool {
    let (Json::Object(fa), Json::Object(fb)) = (a.json(), b.json()) else { return false };
    fa.len() == fb.len() && fa.iter().all(|(k, v)| fb.iter().any(|(k2, v2)| k == k2 && v == v2))
}

fn same_messages(a: &[Message], b: &[Message]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| same_message(x, y))
}

/// What a field holds, for format detection.
enum Side<'a> {
    Missing,
    Text(&'a str),
    List(&'a Json),
    Other(&'a Json),
}

fn side<'a>(record: &'a Json, key: &str) -> Side<'a> {
    match record.get(key) {
        None | Some(Json::Null) => Side::Missing,
        Some(Json::String(s)) => Side::Text(s),
        Some(l @ Json::Array(_)) => Side::List(l),
        Some(other) => Side::Other(other),
    }
}

fn missing(record: &Json, key: &str) -> String {
    format!("field `{key}` is missing (the record has keys: {})", keys_of(record))
}

fn text_field<'a>(record: &'a Json, key: &str, format: PreferenceFormat) -> Result<&'a str, String> {
    match side(record, key) {
        Side::Text(s) => Ok(s),
        Side::Missing => Err(missing(record, key)),
        Side::List(_) => {
            Err(format!("field `{key}` is a list of messages, but this pair's prompt is text ({format} format): give a string"))
        }
        Side::Other(v) => Err(format!("field `{key}` is {}, not a string", v.kind())),
    }
}

fn list_field(record: &Json, key: &str) -> Result<Vec<Message>, String> {
    match side(record, key) {
        Side::List(l) => {
            let ms = messages(l, key)?;
            if ms.is_empty() {
                return Err(format!("field `{key}` is an empty list of messages"));
            }
            Ok(ms)
        }
        Side::Missing => Err(missing(record, key)),
        Side::Text(_) => Err(format!(
            "field `{key}` is a string, but the conversational format takes lists of messages in `prompt`, `chosen` and \
             `rejected` (a standard record has strings in all three)"
        )),
        Side::Other(v) => Err(format!("field `{key}` is {}, not a list of messages", v.kind())),
    }
}

/// Every message of a completion is the assistant's.
fn assistant_only(ms: &[Message], key: &str) -> Result<(), String> {
    match ms.iter().position(|m| m.role() != Role::Assistant) {
        Some(i) => Err(format!(
            "{key}[{i}] has role `{}`: a completion holds assistant messages only (put the conversation before it in `prompt`)",
            ms[i].role()
        )),
        None => Ok(()),
    }
}

/// The format of `record` under `format` (`Auto`: from its keys).
fn form_of(record: &Json, format: PreferenceFormat) -> Result<PreferenceFormat, String> {
    if !matches!(record, Json::Object(_)) {
        return Err(format!("the record is {}, not a JSON object", record.kind()));
    }
    if format != PreferenceFormat::Auto {
        return Ok(format);
    }
    for key in ["chosen", "rejected"] {
        if matches!(side(record, key), Side::Missing) {
            // A fine-tuning (SFT) record is the likeliest wrong file: say which tool reads it.
            let sft = ["messages", "conversations", "completion", "output", "text"].iter().any(|k| record.get(k).is_some());
            let hint = if sft { "; its keys are those of a chat (SFT) record, which the finetune tool trains on" } else { "" };
            return Err(format!(
                "field `{key}` is missing: a preference record has `chosen` and `rejected`, and `prompt` unless they are \
                 whole conversations (the record has keys: {}){hint}",
                keys_of(record)
            ));
        }
    }
    let lists = matches!((side(record, "chosen"), side(record, "rejected")), (Side::List(_), Side::List(_)));
    Ok(match side(record, "prompt") {
        Side::Missing => PreferenceFormat::ImplicitPrompt,
        Side::List(_) => PreferenceFormat::Conversational,
        // HuggingFaceH4/ultrafeedback_binarized: whole conversations beside a `prompt` string
        // that repeats their first user message.
        Side::Text(_) if lists => PreferenceFormat::ImplicitPrompt,
        Side::Text(_) => PreferenceFormat::Standard,
        Side::Other(v) => return Err(format!("field `prompt` is {}, not a string or a list of messages", v.kind())),
    })
}

/// The pair `record` holds under `format`; the error says what is wrong, naming the field.
pub fn parse_pair(record: &Json, format: PreferenceFormat) -> Result<RawPair, String> {
    match form_of(record, format)? {
        PreferenceFormat::Standard => {
            let f = PreferenceFormat::Standard;
            let prompt = text_field(record, "prompt", f)?;
            Ok(RawPair::Text {
                prompt: prompt.to_string(),
                chosen: text_field(record, "chosen", f)?.to_string(),
                rejected: text_field(record, "rejected", f)?.to_string(),
            })
        }
        PreferenceFormat::Conversational => {
            let prompt = list_field(record, "prompt")?;
            let chosen = list_field(record, "chosen")?;
            let rejected = list_field(record, "rejected")?;
            assistant_only(&chosen, "chosen")?;
            assistant_only(&rejected, "rejected")?;
            Ok(RawPair::Chat { prompt, chosen, rejected })
        }
        PreferenceFormat::ImplicitPrompt | PreferenceFormat::Auto => match side(record, "prompt") {
            Side::List(_) => Err("field `prompt` is a list of messages, but --data-format implicit-prompt takes whole \
                                  conversations in `chosen` and `rejected` and finds the prompt itself: use --data-format \
                                  conversational"
                .into()),
            Side::Text(_) if matches!(side(record, "chosen"), Side::Text(_)) => {
                Err("field `prompt` is a string beside text completions: that is the standard format (--data-format \
                     standard); an implicit-prompt record holds two whole texts or conversations in `chosen` and `rejected`"
                    .into())
            }
            // A `prompt` string beside whole conversations (HuggingFaceH4/ultrafeedback_binarized)
            // is not read: the prompt is the conversations' common start.
            _ => implicit(record),
        },
    }
}

/// `chosen` and `rejected` as whole conversations (or texts), split as TRL's `extract_prompt`
/// splits them: at the first message (character) where they differ; if neither differs from
/// the other up to the shorter one's end, one message (character) before that end. A text
/// prompt ending in a space gives the space to the completions.
fn implicit(record: &Json) -> Result<RawPair, String> {
    match (side(record, "chosen"), side(record, "rejected")) {
        (Side::Text(c), Side::Text(r)) => {
            let (c, r): (Vec<char>, Vec<char>) = (c.chars().collect(), r.chars().collect());
            let n = c.len().min(r.len());
            let idx = match (0..n).find(|&i| c[i] != r[i]) {
                Some(i) if i > 0 && c[i - 1] == ' ' => i - 1,
                Some(i) => i,
                None if c == r => c.len(),
                None => n.saturating_sub(1),
            };
            let s = |v: &[char]| v.iter().collect::<String>();
            Ok(RawPair::Text { prompt: s(&c[..idx]), chosen: s(&c[idx..]), rejected: s(&r[idx..]) })
        }
        (Side::List(_), Side::List(_)) => {
            let chosen = list_field(record, "chosen")?;
            let rejected = list_field(record, "rejected")?;
            if same_messages(&chosen, &rejected) {
                // The loader skips the pair (see `RawPair::identical`).
                return Ok(RawPair::Chat { prompt: Vec::new(), chosen, rejected });
            }
            let n = chosen.len().min(rejected.len());
            let idx = (0..n).find(|&i| !same_message(&chosen[i], &rejected[i])).unwrap_or(n - 1);
            if idx == 0 {
                return Err("`chosen` and `rejected` differ from their first message, so they share no prompt: an implicit-prompt \
                            record holds two whole conversations that start the same"
                    .into());
            }
            let prompt = chosen[..idx].to_vec();
            let (chosen, rejected) = (chosen[idx..].to_vec(), rejected[idx..].to_vec());
            assistant_only(&chosen, "chosen")?;
            assistant_only(&rejected, "rejected")?;
            Ok(RawPair::Chat { prompt, chosen, rejected })
        }
        (Side::Missing, _) => Err(missing(record, "chosen")),
        (_, Side::Missing) => Err(missing(record, "rejected")),
        (Side::Text(_), Side::List(_)) => {
            Err("field `rejected` is a list of messages but `chosen` is a string: give both as the same kind".into())
        }
        (Side::List(_), Side::Text(_)) => {
            Err("field `rejected` is a string but `chosen` is a list of messages: give both as the same kind".into())
        }
        (Side::Other(v), _) => Err(format!("field `chosen` is {}, not a string or a list of messages", v.kind())),
        (_, Side::Other(v)) => Err(format!("field `rejected` is {}, not a string or a list of messages", v.kind())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str, f: PreferenceFormat) -> Result<RawPair, String> {
        parse_pair(&Json::parse(s).unwrap(), f)
    }

    fn msgs(pairs: &[(Role, &str)]) -> Vec<Message> {
        pairs.iter().map(|(r, t)| Message::new(*r, t)).collect()
    }

    #[test]
    fn each_format_is_detected() {
        let p = parse(r#"{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}"#, PreferenceFormat::Auto).unwrap();
        assert_eq!(p, RawPair::Text { prompt: "The sky is".into(), chosen: " blue.".into(), rejected: " green.".into() });
        let p = parse(
            r#"{"prompt": [{"role": "user", "content": "Sky?"}], "chosen": [{"role": "assistant", "content": "Blue."}], "rejected": [{"role": "assistant", "content": "Green."}]}"#,
            PreferenceFormat::Auto,
        )
        .unwrap();
        assert_eq!(
            p,
            RawPair::Chat {
                prompt: msgs(&[(Role::User, "Sky?")]),
                chosen: msgs(&[(Role::Assistant, "Blue.")]),
                rejected: msgs(&[(Role::Assistant, "Green.")])
            }
        );
        // UltraFeedback-binarized: two whole conversations; the prompt is what they share.
        let p = parse(
            r#"{"chosen": [{"role": "system", "content": "S"}, {"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Blue."}],
                "rejected": [{"role": "system", "content": "S"}, {"content": "Sky?", "role": "user"}, {"role": "assistant", "content": "Green."}]}"#,
            PreferenceFormat::Auto,
        )
        .unwrap();
        let RawPair::Chat { prompt, chosen, rejected } = p else { panic!() };
        assert_eq!((prompt.len(), chosen, rejected), (2, msgs(&[(Role::Assistant, "Blue.")]), msgs(&[(Role::Assistant, "Green.")])));
        // Implicit text: the space before the difference goes to the completions (TRL's rule).
        let p = parse(r#"{"chosen": "Q: sky? A: blue", "rejected": "Q: sky? A: green"}"#, PreferenceFormat::Auto).unwrap();
        assert_eq!(p, RawPair::Text { prompt: "Q: sky? A:".into(), chosen: " blue".into(), rejected: " green".into() });
        // One a prefix of the other: TRL cuts one character (message) before the shorter's end.
        let p = parse(r#"{"chosen": "abc", "rejected": "abcd"}"#, PreferenceFormat::Auto).unwrap();
        assert_eq!(p, RawPair::Text { prompt: "ab".into(), chosen: "c".into(), rejected: "cd".into() });
    }

    #[test]
    fn explicit_formats_and_bad_records_name_the_field() {
        let conv = r#"{"prompt": [{"role": "user", "content": "u"}], "chosen": [{"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]}"#;
        let e = parse(conv, PreferenceFormat::Standard).unwrap_err();
        assert!(e.contains("field `prompt` is a list of messages"), "{e}");
        let e = parse(r#"{"prompt": "p", "chosen": "a", "rejected": "b"}"#, PreferenceFormat::Conversational).unwrap_err();
        assert!(e.contains("field `prompt` is a string"), "{e}");
        let e = parse(conv, PreferenceFormat::ImplicitPrompt).unwrap_err();
        assert!(e.contains("field `prompt` is a list of messages") && e.contains("conversational"), "{e}");
        // HuggingFaceH4/ultrafeedback_binarized: a prompt string beside whole conversations.
        let h4 = r#"{"prompt": "u", "chosen": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}], "rejected": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "b"}]}"#;
        for f in [PreferenceFormat::Auto, PreferenceFormat::ImplicitPrompt] {
            let RawPair::Chat { prompt, chosen, .. } = parse(h4, f).unwrap() else { panic!() };
            assert_eq!((prompt.len(), chosen.len()), (1, 1));
        }
        let e = parse(r#"{"prompt": "p", "chosen": "a", "rejected": "b"}"#, PreferenceFormat::ImplicitPrompt).unwrap_err();
        assert!(e.contains("that is the standard format"), "{e}");
        let e = parse(h4, PreferenceFormat::Standard).unwrap_err();
        assert!(e.contains("field `chosen` is a list of messages"), "{e}");
        let e = parse(r#"{"prompt": "p", "chosen": "a"}"#, PreferenceFormat::Auto).unwrap_err();
        assert!(e.contains("field `rejected` is missing") && e.contains("prompt, chosen") && !e.contains("finetune"), "{e}");
        // A chat record given to the preference reader names the tool that reads it.
        let e = parse(r#"{"messages": [{"role": "user", "content": "u"}]}"#, PreferenceFormat::Auto).unwrap_err();
        assert!(e.contains("field `chosen` is missing") && e.contains("chat (SFT) record") && e.contains("finetune tool"), "{e}");
        let e = parse(r#"{"prompt": "p", "chosen": "a"}"#, PreferenceFormat::Standard).unwrap_err();
        assert!(e.contains("field `rejected` is missing"), "{e}");
        let e = parse(r#"{"prompt": "p", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"}"#, PreferenceFormat::Auto)
            .unwrap_err();
        assert!(e.contains("field `chosen` is a list of messages"), "{e}");
        let e = parse(
            r#"{"prompt": [{"role": "user", "content": "u"}], "chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]}"#,
            PreferenceFormat::Auto,
        )
        .unwrap_err();
        assert!(e.contains("chosen[0] has role `user`"), "{e}");
        let e = parse(
            r#"{"prompt": [{"role": "user", "content": "u"}], "chosen": [], "rejected": [{"role": "assistant", "content": "b"}]}"#,
            PreferenceFormat::Auto,
        )
        .unwrap_err();
        assert!(e.contains("field `chosen` is an empty list"), "{e}");
        let e = parse(
            r#"{"chosen": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}], "rejected": [{"role": "user", "content": "v"}, {"role": "assistant", "content": "a"}]}"#,
            PreferenceFormat::Auto,
        )
        .unwrap_err();
        assert!(e.contains("share no prompt"), "{e}");
        // One conversation continuing the other: the cut leaves a user message in a completion.
        let e = parse(
            r#"{"chosen": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}], "rejected": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "w"}]}"#,
            PreferenceFormat::Auto,
        )
        .unwrap_err();
        assert!(e.contains("rejected[1] has role `user`"), "{e}");
        let e = parse(r#"{"chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]}"#, PreferenceFormat::Auto).unwrap_err();
        assert!(e.contains("field `rejected` is a list"), "{e}");
        let e = parse(r#"{"prompt": 3, "chosen": "a", "rejected": "b"}"#, PreferenceFormat::Auto).unwrap_err();
        assert!(e.contains("field `prompt` is a number"), "{e}");
        assert!(parse("[1]", PreferenceFormat::Auto).unwrap_err().contains("not a JSON object"));
        assert_eq!("implicit-prompt".parse::<PreferenceFormat>(), Ok(PreferenceFormat::ImplicitPrompt));
        assert!("messages".parse::<PreferenceFormat>().unwrap_err().contains("auto, standard, conversational, implicit-prompt"));
    }

    #[test]
    fn identical_and_empty_completions_are_recognised() {
        let p = parse(r#"{"prompt": "p", "chosen": "a", "rejected": "a"}"#, PreferenceFormat::Auto).unwrap();
        assert!(p.identical() && !p.empty_completion());
        let p = parse(r#"{"prompt": "p", "chosen": "", "rejected": "a"}"#, PreferenceFormat::Auto).unwrap();
        assert!(!p.identical() && p.empty_completion());
        let conv = |c: &str| {
            Json::parse(&format!(
                r#"{{"chosen": [{{"role": "user", "content": "u"}}, {{"role": "assistant", "content": "{c}"}}], "rejected": [{{"role": "user", "content": "u"}}, {{"role": "assistant", "content": "a"}}]}}"#
            ))
            .unwrap()
        };
        let p = parse_pair(&conv("a"), PreferenceFormat::Auto).unwrap();
        assert!(p.identical());
        let p = parse_pair(&conv(""), PreferenceFormat::Auto).unwrap();
        assert!(p.empty_completion() && !p.identical());
    }
}
