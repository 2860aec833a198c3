//! Hugging Face chat templates, rendered by MiniJinja in the environment transformers gives
//! Jinja2 (`_compile_jinja_template` and `apply_chat_template`):
//!
//! - `trim_blocks` and `lstrip_blocks`, a template's single trailing newline dropped, loop
//!   controls (`break`, `continue`);
//! - `raise_exception(msg)`, `strftime_now(fmt)` (local time), and transformers' `tojson`
//!   (`json.dumps` with `ensure_ascii`, `indent`, `separators`, `sort_keys`; no HTML escaping);
//! - Python's methods on strings, dicts and lists (`.strip()`, `.startswith()`, `.items()`, …)
//!   through minijinja-contrib's pycompat, and values printed as Python prints them (`None`,
//!   `True`, `1.0`, `[{'type': 'text', …}]`, see [`super::python`]);
//! - the variables `messages`, `tools` and `documents` (both `none`), `add_generation_prompt`,
//!   and the special tokens `tokenizer_config.json` names (`bos_token`, `eos_token`, …);
//! - `{% generation %}` … `{% endgeneration %}`: MiniJinja has no custom tags, so the tag is
//!   rewritten into `{% filter … %}` … `{% endfilter %}` (keeping its `-`/`+` whitespace
//!   controls, so `trim_blocks` and `lstrip_blocks` treat it as the block tag it was) with a
//!   filter that wraps the block's output in two noncharacters, U+FDD0 and U+FDD1. They are
//!   stripped from the rendered text, and their places are the character ranges transformers'
//!   `AssistantTracker` records. Inputs holding either noncharacter are refused.

use std::ops::Range;
use std::path::{Path, PathBuf};

use indexmap::IndexMap;
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind};

use super::python::{py_json, py_str, JsonOptions};
use super::Message;
use crate::error::{Error, Result};

/// The special tokens transformers passes to every template (`special_tokens_map`), when set.
pub const SPECIAL_TOKEN_NAMES: [&str; 7] = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

/// Opens and closes a generation block in the rendered text (Unicode noncharacters, reserved
/// for a program's internal use).
const GEN_OPEN: char = '\u{FDD0}';
const GEN_CLOSE: char = '\u{FDD1}';
const GEN_FILTER: &str = "__ferrolm_generation";
const TEMPLATE: &str = "chat_template";
/// Instructions one render may run (MiniJinja's fuel): far beyond any real template over a
/// long conversation, and a bound on one that loops over `range(10**9)`.
const FUEL: u64 = 200_000_000;

/// A rendered conversation: the text, and the byte ranges of its `{% generation %}` blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendered {
    pub text: String,
    pub generation: Vec<Range<usize>>,
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where it came from, for messages: a file, or `tokenizer_config.json` field `chat_template`.
    origin: String,
    specials: Vec<(String, String)>,
    has_generation: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("origin", &self.origin).field("has_generation", &self.has_generation).finish()
    }
}

/// What the search for a template found: its text, where it came from, and the raw template
/// file's text when it came from a `.jinja` file (which a checkpoint carries on).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TemplateSource {
    pub text: String,
    pub origin: String,
    pub jinja_file: Option<PathBuf>,
}

/// The template, by the search order of transformers' `apply_chat_template`:
/// 1. `explicit` (`--chat-template FILE`);
/// 2. `chat_template.jinja` in `model_dir`;
/// 3. `chat_template` in `model_dir/tokenizer_config.json`: a string, or a list of
///    `{"name", "template"}` of which the one named `default` is used.
///
/// With none of them the error names the three places.
pub fn find_template_source(model_dir: Option<&Path>, explicit: Option<&Path>) -> Result<TemplateSource> {
    find_template_source_in(model_dir.as_slice(), explicit)
}

/// As [`find_template_source`], searching each of `model_dirs` in turn (2. and 3. in the first,
/// then in the next: a LoRA adapter's directory before its base model's, as transformers'
/// `AutoTokenizer.from_pretrained(adapter)` finds the adapter's template). With none, the error
/// names every place searched.
pub fn find_template_source_in(model_dirs: &[&Path], explicit: Option<&Path>) -> Result<TemplateSource> {
    if let Some(path) = explicit {
        // Every tool takes this file as --chat-template: the error names the flag.
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::invalid(format!("--chat-template {}: cannot read the template: {e}", path.display())))?;
        return Ok(TemplateSource { text, origin: path.display().to_string(), jinja_file: Some(path.to_path_buf()) });
    }
    for dir in model_dirs {
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            let text = std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?;
            return Ok(TemplateSource { text, origin: jinja.display().to_string(), jinja_file: Some(jinja) });
        }
        let config_path = dir.join("tokenizer_config.json");
        if let Some(config) = read_tokenizer_config(&config_path)? {
            if let Some(text) = template_of_config(&config, &config_path)? {
                let origin = format!("{} field `chat_template`", config_path.display());
                return Ok(TemplateSource { text, origin, jinja_file: None });
            }
        }
    }
    let dirs: Vec<String> = model_dirs.iter().map(|d| d.display().to_string()).collect();
    let (jinja, config) = match dirs.is_empty() {
        true => ("the model directory".to_string(), "the model directory/tokenizer_config.json".to_string()),
        false => (dirs.join(" or "), dirs.iter().map(|d| format!("{d}/tokenizer_config.json")).collect::<Vec<_>>().join(" or ")),
    };
    Err(Error::invalid(format!(
        "no chat template: pass --chat-template FILE, or put chat_template.jinja in {jinja}, or a `chat_template` in {config}"
    )))
}

/// `tokenizer_config.json` parsed, `None` when the file does not exist.
pub fn read_tokenizer_config(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::format(path, format!("not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(Error::format(path, "not a JSON object"));
    }
    Ok(Some(v))
}

/// The `chat_template` of a `tokenizer_config.json`: a string, or the `default` of a list of
/// named templates.
fn template_of_config(config: &serde_json::Value, path: &Path) -> Result<Option<String>> {
    match config.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Array(list)) => {
            let mut names = Vec::new();
            for item in list {
                let name = item.get("name").and_then(|n| n.as_str());
                let template = item.get("template").and_then(|t| t.as_str());
                match (name, template) {
                    (Some("default"), Some(t)) => return Ok(Some(t.to_string())),
                    (Some(n), Some(_)) => names.push(n.to_string()),
                    _ => {
                        return Err(Error::format(
                            path,
                            "field `chat_template`: each entry of the list must be {\"name\": string, \"template\": string}",
                        ))
                    }
                }
            }
            Err(Error::format(path, format!("field `chat_template`: no template named `default` (names: {})", names.join(", "))))
        }
        Some(other) => {
            Err(Error::format(path, format!("field `chat_template` is {}, not a string or a list of named templates", kind(other))))
        }
    }
}

fn kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// The special tokens of a `tokenizer_config.json` (a string, or an AddedToken object with a
/// `content`), in [`SPECIAL_TOKEN_NAMES`] order; unset and null ones are left out.
pub fn special_tokens_of_config(config: &serde_json::Value) -> Vec<(String, String)> {
    SPECIAL_TOKEN_NAMES
        .iter()
        .filter_map(|&name| {
            let v = config.get(name)?;
            let s = v.as_str().or_else(|| v.get("content").and_then(|c| c.as_str()))?;
            Some((name.to_string(), s.to_string()))
        })
        .collect()
}

/// Rewrites `{% generation %}` / `{% endgeneration %}` (any whitespace and `-`/`+` controls)
/// into a filter block; returns whether there was one.
fn rewrite_generation_tags(src: &str) -> (String, bool) {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    let mut found = false;
    while let Some(i) = rest.find("{%") {
        out.push_str(&rest[..i]);
        let tag = &rest[i..];
        let after_open = 2 + usize::from(tag[2..].starts_with(['-', '+']));
        let inner = &tag[after_open..];
        let word_at = inner.len() - inner.trim_start().len();
        let word_rest = &inner[word_at..];
        let (word, replacement) = if word_rest.starts_with("endgeneration") {
            ("endgeneration", "endfilter".to_string())
        } else if word_rest.starts_with("generation") {
            ("generation", format!("filter {GEN_FILTER}"))
        } else {
            ("", String::new())
        };
        let tail = &word_rest[word.len()..];
        let close = tail.trim_start();
        let closes = close.starts_with("%}") || close.starts_with("-%}") || close.starts_with("+%}");
        if !word.is_empty() && closes && !tail.starts_with(|c: char| c.is_alphanumeric() || c == '_') {
            found = true;
            out.push_str(&tag[..after_open + word_at]);
            out.push_str(&replacement);
            rest = &tag[after_open + word_at + word.len()..];
        } else {
            out.push_str("{%");
            rest = &tag[2..];
        }
    }
    out.push_str(rest);
    (out, found)
}

fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("{RAISED}{message}")))
}
const RAISED: &str = "raise_exception: ";

fn tojson(value: Value, ensure_ascii: Option<bool>, indent: Option<Value>, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let ensure_ascii = match kwargs.get::<Option<bool>>("ensure_ascii")? {
        Some(b) => b,
        None => ensure_ascii.unwrap_or(false),
    };
    let indent = kwargs.get::<Option<Value>>("indent")?.or(indent).filter(|v| !v.is_none());
    let indent = match indent {
        None => None,
        Some(v) if v.is_integer() => Some(" ".repeat(v.as_i64().unwrap_or(0).clamp(0, 64) as usize)),
        Some(v) if v.as_str().is_some() => Some(v.as_str().unwrap_or_default().to_string()),
        Some(v) => {
            return Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: indent must be an int or a string, not {v}")))
        }
    };
    let mut opts = JsonOptions::new(indent);
    opts.ensure_ascii = ensure_ascii;
    if let Some(seps) = kwargs.get::<Option<Value>>("separators")?.filter(|v| !v.is_none()) {
        let items: Vec<Value> = seps.try_iter()?.collect();
        match (items.first().and_then(|v| v.as_str()), items.get(1).and_then(|v| v.as_str()), items.len()) {
            (Some(a), Some(b), 2) => {
                opts.item_sep = a.to_string();
                opts.key_sep = b.to_string();
            }
            _ => return Err(minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: separators must be a pair of strings")),
        }
    }
    opts.sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    Ok(Value::from_safe_string(py_json(&value, &opts)?))
}

/// Python's `datetime.now().strftime(format)`; `now` fixes the clock (tests).
fn strftime(now: Option<chrono::NaiveDateTime>, format: &str) -> std::result::Result<Value, minijinja::Error> {
    use chrono::format::{Item, StrftimeItems};
    use std::fmt::Write;
    let items: Vec<Item> = StrftimeItems::new(format).collect();
    if items.iter().any(|i| matches!(i, Item::Error)) {
        return Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("strftime_now: invalid format {format:?}")));
    }
    let now = now.unwrap_or_else(|| chrono::Local::now().naive_local());
    let mut out = String::new();
    write!(out, "{}", now.format_with_items(items.into_iter()))
        .map_err(|_| minijinja::Error::new(ErrorKind::InvalidOperation, format!("strftime_now: cannot format {format:?}")))?;
    Ok(Value::from(out))
}

impl ChatTemplate {
    /// Compiles `source`; `origin` names it in errors (a syntax error says its line),
    /// `specials` are the special tokens handed to every render (see
    /// [`special_tokens_of_config`]).
    pub fn new(source: &str, origin: &str, specials: Vec<(String, String)>) -> Result<Self> {
        let (rewritten, has_generation) = rewrite_generation_tags(source);
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| Error::invalid(format!("chat template syntax settings: {e}")))?;
        env.set_syntax(syntax);
        env.set_fuel(Some(FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(|out, _state, value| {
            let s = py_str(value)?;
            out.write_str(&s).map_err(|_| minijinja::Error::new(ErrorKind::WriteFailure, "cannot write the output"))
        });
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", |format: String| strftime(None, &format));
        env.add_filter("tojson", tojson);
        env.add_filter("string", |v: Value| py_str(&v).map(Value::from));
        env.add_filter(GEN_FILTER, |body: String| Value::from_safe_string(format!("{GEN_OPEN}{body}{GEN_CLOSE}")));
        env.add_template_owned(TEMPLATE, rewritten).map_err(|e| template_error(origin, &e))?;
        Ok(ChatTemplate { env, origin: origin.to_string(), specials, has_generation })
    }

    /// The template the search order finds (see [`find_template_source`]), with the special
    /// tokens of `model_dir/tokenizer_config.json`.
    pub fn find(model_dir: Option<&Path>, explicit: Option<&Path>) -> Result<Self> {
        let source = find_template_source(model_dir, explicit)?;
        let specials = match model_dir {
            Some(dir) => {
                read_tokenizer_config(&dir.join("tokenizer_config.json"))?.map(|c| special_tokens_of_config(&c)).unwrap_or_default()
            }
            None => Vec::new(),
        };
        Self::new(&source.text, &source.origin, specials)
    }

    /// Fixes the clock `strftime_now` reads (for reproducible renders and tests).
    pub fn with_fixed_time(mut self, now: chrono::NaiveDateTime) -> Self {
        self.env.add_function("strftime_now", move |format: String| strftime(Some(now), &format));
        self
    }

    /// Whether the template marks assistant text with `{% generation %}` blocks.
    pub fn has_generation(&self) -> bool {
        self.has_generation
    }

    /// Where the template came from.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The special tokens handed to the template.
    pub fn special_tokens(&self) -> &[(String, String)] {
        &self.specials
    }

    /// The value of special token `name` (`"eos_token"`), if the tokenizer config sets it.
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.specials.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    /// Renders `messages` as `apply_chat_template(messages, tokenize=False,
    /// add_generation_prompt=...)` does. The error is the message alone (the caller knows
    /// the record): a `raise_exception` shows the template's message.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> std::result::Result<Rendered, String> {
        let msgs: Vec<Value> = messages.iter().map(Message::to_value).collect();
        let mut ctx: IndexMap<Value, Value> = IndexMap::new();
        for (k, v) in &self.specials {
            ctx.insert(Value::from(k.as_str()), Value::from(v.as_str()));
        }
        ctx.insert(Value::from("messages"), Value::from(msgs));
        ctx.insert(Value::from("tools"), Value::from(()));
        ctx.insert(Value::from("documents"), Value::from(()));
        ctx.insert(Value::from("add_generation_prompt"), Value::from(add_generation_prompt));
        if self.has_generation {
            let reserved = |s: &str| s.contains([GEN_OPEN, GEN_CLOSE]);
            if messages.iter().any(|m| m.any_string(reserved)) || self.specials.iter().any(|(_, v)| reserved(v)) {
                return Err(
                    "the conversation holds U+FDD0 or U+FDD1, noncharacters ferrolm reserves to mark {% generation %} blocks".into()
                );
            }
        }
        let template = self.env.get_template(TEMPLATE).map_err(|e| render_error(&self.origin, &e))?;
        let text = template.render(Value::from(ctx)).map_err(|e| render_error(&self.origin, &e))?;
        if !self.has_generation {
            return Ok(Rendered { text, generation: Vec::new() });
        }
        strip_markers(&text)
    }
}

/// The text without the generation markers, and the ranges they enclosed. Nested blocks give
/// their outermost range (the inner ones lie within it).
fn strip_markers(marked: &str) -> std::result::Result<Rendered, String> {
    let mut text = String::with_capacity(marked.len());
    let mut generation = Vec::new();
    let mut open: Vec<usize> = Vec::new();
    for c in marked.chars() {
        match c {
            GEN_OPEN => open.push(text.len()),
            GEN_CLOSE => {
                let start = open.pop().ok_or("a {% endgeneration %} without its {% generation %}")?;
                if open.is_empty() {
                    generation.push(start..text.len());
                }
            }
            c => text.push(c),
        }
    }
    if !open.is_empty() {
        return Err("a {% generation %} block is never closed".into());
    }
    Ok(Rendered { text, generation })
}

/// A compile error: the origin, the line, what is wrong.
fn template_error(origin: &str, e: &minijinja::Error) -> Error {
    let line = e.line().map_or(String::new(), |l| format!(" line {l}"));
    let detail = e.detail().map_or_else(|| e.kind().to_string(), |d| format!("{}: {d}", e.kind()));
    Error::invalid(format!("chat template {origin}{line}: {detail}"))
}

/// A render error: `raise_exception`'s message, or what failed and at which line.
fn render_error(origin: &str, e: &minijinja::Error) -> String {
    let line = e.line().map_or(String::new(), |l| format!(" line {l}"));
    // The error of a call made inside the template is its source's; look through the chain.
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(mj) = err.downcast_ref::<minijinja::Error>() {
            if let Some(msg) = mj.detail().and_then(|d| d.strip_prefix(RAISED)) {
                return format!("the chat template raised an exception: {msg} ({origin}{line})");
            }
        }
        cur = err.source();
    }
    let detail = e.detail().map_or_else(|| e.kind().to_string(), |d| format!("{}: {d}", e.kind()));
    format!("chat template {origin}{line}: {detail}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::Role;

    fn msgs(pairs: &[(Role, &str)]) -> Vec<Message> {
        pairs.iter().map(|(r, t)| Message::new(*r, t)).collect()
    }

    #[test]
    fn generation_tags_become_filter_blocks() {
        let (s, found) = rewrite_generation_tags("a{%- generation -%}b{% endgeneration %}{%+generation%}{% generations %}");
        assert!(found);
        assert_eq!(s, "a{%- filter __ferrolm_generation -%}b{% endfilter %}{%+filter __ferrolm_generation%}{% generations %}");
        assert_eq!(rewrite_generation_tags("{% if x %}{{ '{%' }}"), ("{% if x %}{{ '{%' }}".to_string(), false));
    }

    #[test]
    fn renders_with_python_semantics() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{{ m.role }}={{ m.content | trim }};{% endfor %}{{ none }}{{ true }}{{ 1.0 }}{{ bos_token }}\n",
            "t",
            vec![("bos_token".into(), "<s>".into())],
        )
        .unwrap();
        let r = t.render(&msgs(&[(Role::User, " hi ")]), false).unwrap();
        assert_eq!(r.text, "user=hi;NoneTrue1.0<s>");
        let r = ChatTemplate::new("{{ messages | tojson }}|{{ {'b': 1} | tojson(indent=2) }}", "t", vec![]).unwrap();
        assert_eq!(
            r.render(&msgs(&[(Role::User, "é<")]), false).unwrap().text,
            "[{\"role\": \"user\", \"content\": \"é<\"}]|{\n  \"b\": 1\n}"
        );
    }

    #[test]
    fn generation_blocks_give_ranges() {
        let src = "{% for m in messages %}\n  {% if m.role == 'assistant' %}\n  {%- generation -%}\n{{ m.content }}!\n  {%- endgeneration %}\n  {% else %}[{{ m.content }}]{% endif %}\n{% endfor %}";
        let t = ChatTemplate::new(src, "t", vec![]).unwrap();
        assert!(t.has_generation());
        let r = t.render(&msgs(&[(Role::User, "q"), (Role::Assistant, "a")]), false).unwrap();
        assert_eq!(&r.text[r.generation[0].clone()], "a!");
        assert!(!r.text.contains(GEN_OPEN));
        let bad = t.render(&msgs(&[(Role::User, "\u{FDD0}")]), false).unwrap_err();
        assert!(bad.contains("U+FDD0"), "{bad}");
    }

    #[test]
    fn errors_name_the_template_and_show_raised_messages() {
        let e = ChatTemplate::new("a\n{% if %}", "my.jinja", vec![]).unwrap_err().to_string();
        assert!(e.contains("my.jinja line 2"), "{e}");
        let t = ChatTemplate::new("x\n{{ raise_exception('roles must alternate') }}", "my.jinja", vec![]).unwrap();
        let e = t.render(&[], false).unwrap_err();
        assert!(e.contains("raised an exception: roles must alternate"), "{e}");
        let t = ChatTemplate::new("{{ strftime_now('%d %b %Y') }}", "t", vec![]).unwrap();
        let day = chrono::NaiveDate::from_ymd_opt(2024, 7, 26).unwrap().and_hms_opt(1, 2, 3).unwrap();
        assert_eq!(t.with_fixed_time(day).render(&[], false).unwrap().text, "26 Jul 2024");
        let t = ChatTemplate::new("{{ strftime_now('%Q') }}", "t", vec![]).unwrap();
        assert!(t.render(&[], false).is_err());
        // An unreadable --chat-template (missing, a directory) names the flag and the path.
        let dir = std::env::temp_dir();
        let missing = dir.join(format!("ferrolm-no-such-template-{}.jinja", std::process::id()));
        for p in [&missing, &dir] {
            let e = find_template_source_in(&[], Some(p)).unwrap_err().to_string();
            assert!(e.starts_with(&format!("--chat-template {}: cannot read the template: ", p.display())), "{e}");
        }
    }
}
