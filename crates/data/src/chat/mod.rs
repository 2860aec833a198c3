//! Chat data for supervised fine-tuning: records -> conversations -> rendered, tokenized and
//! masked examples -> packed rows.
//!
//! - [`records`]: the record forms (`messages`, ShareGPT `conversations`, Alpaca,
//!   `prompt`/`completion`, `text`), detected per record or forced by [`DataFormat`];
//! - [`reader`]: records out of `.jsonl`, `.jsonl.gz`, `.jsonl.zst` and `.parquet` files, each
//!   error naming the file and line (or row);
//! - [`template`]: Hugging Face chat templates on MiniJinja, as transformers renders them;
//! - [`mask`]: which tokens are trained ([`TrainOn`]), giving an [`Example`];
//! - [`dataset`]: all of it over a list of input files, with `--skip-bad-records` and counts;
//! - [`pack`]: examples into `seq_len` rows ([`PackedRow`]), best-fit decreasing or one per
//!   row; the trainer draws rows in its seeded, resumable order.
//!
//! The example format: `Example::ids` are the token ids of one conversation and
//! `Example::trained[i]` says whether token `i` is a label (predicted from position `i - 1`).
//! Packing turns that into `targets` already shifted for next-token prediction, with
//! [`IGNORE_INDEX`] where nothing is trained.

/// A value type for the command line: each variant's name (`NAMES`, `name()`), `Display`, and
/// `FromStr` whose error names the flag and lists the values.
macro_rules! named_values {
    ($ty:ident, $flag:literal, [$($var:ident => $name:literal),+ $(,)?]) => {
        impl $ty {
            /// Every value, as written on the command line.
            pub const NAMES: &'static [&'static str] = &[$($name),+];

            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$var => $name),+
                }
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl std::str::FromStr for $ty {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($name => Ok($ty::$var),)+
                    _ => Err(format!("unknown {} value `{s}` (expected one of {})", $flag, Self::NAMES.join(", "))),
                }
            }
        }
    };
}

pub mod dataset;
pub mod json;
pub mod mask;
pub mod pack;
mod python;
pub mod reader;
pub mod records;
pub mod template;

use minijinja::Value;

pub use dataset::{load_examples, ChatDataOptions, LoadStats, SkipReason};
pub use json::Json;
pub use mask::{encode_prompt, encode_sample, Example, TrainOn};
pub use pack::{pack, PackOptions, PackStats, PackedData, PackedRow};
pub use reader::RecordReader;
pub use records::{parse_record, Conversation, Sample};
pub use template::{find_template_source, find_template_source_in, ChatTemplate, Rendered, TemplateSource};

/// The label value of a position that is not trained (transformers' and PyTorch's
/// `ignore_index`): the model's cross-entropy skips it.
pub const IGNORE_INDEX: i32 = -100;

/// Which record form `--data-format` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum DataFormat {
    /// Detected per record from its keys.
    #[default]
    Auto,
    /// `messages`: a list of `{"role", "content"}`.
    Messages,
    /// ShareGPT's `conversations`: a list of `{"from", "value"}`.
    ShareGpt,
    /// `instruction`, optional `input`, `output`.
    Alpaca,
    /// `prompt` and `completion`: strings or message lists.
    PromptCompletion,
    /// `text`: plain text, every token trained.
    Text,
}

named_values!(DataFormat, "--data-format", [
    Auto => "auto",
    Messages => "messages",
    ShareGpt => "sharegpt",
    Alpaca => "alpaca",
    PromptCompletion => "prompt-completion",
    Text => "text",
]);

/// The role of a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    System,
    User,
    Assistant,
}

named_values!(Role, "role", [System => "system", User => "user", Assistant => "assistant"]);

impl Role {
    /// `system`, `user` or `assistant`.
    pub fn parse(s: &str) -> Option<Role> {
        s.parse().ok()
    }
}

/// One message as the template sees it: its fields in record order (`role`, `content`, and
/// any other non-null field of a `messages` record), the role parsed.
#[derive(Clone, Debug, PartialEq)]
pub struct Message {
    role: Role,
    fields: Vec<(String, Json)>,
}

impl Message {
    /// `{"role": role, "content": text}`.
    pub fn new(role: Role, text: &str) -> Self {
        Message { role, fields: vec![("role".into(), Json::String(role.name().into())), ("content".into(), Json::String(text.into()))] }
    }

    /// A message from checked fields (see [`records`]).
    pub(crate) fn from_fields(role: Role, fields: Vec<(String, Json)>) -> Self {
        Message { role, fields }
    }

    pub fn role(&self) -> Role {
        self.role
    }

    /// The content's text: the string, or its text parts joined.
    pub fn text(&self) -> String {
        match self.fields.iter().find(|(k, _)| k == "content").map(|(_, v)| v) {
            Some(Json::String(s)) => s.clone(),
            Some(Json::Array(parts)) => parts.iter().filter_map(|p| p.get("text").and_then(Json::as_str)).collect(),
            _ => String::new(),
        }
    }

    /// The message as a JSON object, its fields in order.
    pub(crate) fn json(&self) -> Json {
        Json::Object(self.fields.clone())
    }

    /// The message as a template sees it (a dict in field order).
    pub fn to_value(&self) -> Value {
        Json::Object(self.fields.clone()).to_value()
    }

    /// Whether any string in the message satisfies `f`.
    pub(crate) fn any_string(&self, f: impl Fn(&str) -> bool + Copy) -> bool {
        fn walk(v: &Json, f: impl Fn(&str) -> bool + Copy) -> bool {
            match v {
                Json::String(s) => f(s),
                Json::Array(items) => items.iter().any(|i| walk(i, f)),
                Json::Object(fields) => fields.iter().any(|(k, v)| f(k) || walk(v, f)),
                _ => false,
            }
        }
        self.fields.iter().any(|(k, v)| f(k) || walk(v, f))
    }
}
