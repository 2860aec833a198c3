//! The Hugging Face tokenizer files of a checkpoint, so that `AutoTokenizer.from_pretrained(dir)`
//! and `GenerationConfig.from_pretrained(dir)` reproduce what ferrolm trained on and feeds:
//! - `tokenizer.json`: the training tokenizer with a post-processor that adds what the framing of
//!   its data puts before a document and nothing after (`Tokenizer::for_checkpoint`), so that
//!   transformers' default `add_special_tokens=True` gives ferrolm's ids of a prompt
//!   (`Tokenizer::encode_as_document`);
//! - `tokenizer_config.json`: `tokenizer_class`, `bos_token` (the token a document starts after:
//!   `DocFraming::bos`, `<|eos|>` for ferrolm's EOS-framed data, as GPT-2's `<|endoftext|>`),
//!   `eos_token`, `pad_token` (the tokenizer's own pad token, else the EOS: batched padding is
//!   masked), and the chat template when there is one;
//! - `generation_config.json`: `bos_token_id`, `eos_token_id`, `pad_token_id`;
//! - `chat_template.jinja` with a chat template.
//!
//! Every checkpoint writer calls [`write_tokenizer_files`]: the trainer's checkpoints
//! (pretrain_llama, finetune_ladder) and the chat fine-tuning tool, which passes its template.
//!
//! A fine-tune of a Hugging Face model keeps its source's files instead ([`SourceTokenizer`]):
//! when the `--model` directory has a `tokenizer_config.json` (the file that declares its
//! special tokens and template) and the run uses its `tokenizer.json`, every checkpoint holds
//! the source's tokenizer files ([`TOKENIZER_FILES`]) byte for byte, read once at start. So
//! transformers renders the fine-tuned model's chat template exactly as the source's (a
//! Mistral-like `<s>` stays `<s>`); the data framing above is for checkpoints that pretraining
//! made. The one change is a chat template the run trained with that is not the source's
//! (`--chat-template FILE`): it is written where the source kept its template, the rest of the
//! file as it was.
use crate::data::{DocFraming, Tokenizer};
use crate::AnyResult;
use anyhow::Context;
use ferrolm_nn::safetensors_io::write_atomic;
use std::path::Path;

/// Spellings of a padding token, when a tokenizer has one of its own.
const PAD_NAMES: [&str; 4] = ["<pad>", "<|pad|>", "[PAD]", "<|padding|>"];

/// The special tokens a checkpoint declares (ids of `tokenizer`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecialIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub pad: Option<u32>,
}

impl SpecialIds {
    /// Read from the framing `tokenizer` gives its data (see the module docs).
    pub fn of(tokenizer: &Tokenizer) -> AnyResult<SpecialIds> {
        let framing = DocFraming::of(tokenizer)?;
        let eos = framing.eos(tokenizer);
        let pad = PAD_NAMES.iter().find_map(|t| tokenizer.token_to_id(t)).or(eos).or(framing.bos());
        Ok(SpecialIds { bos: framing.bos(), eos, pad })
    }
}

/// Writes `tokenizer.json`, `tokenizer_config.json` and `generation_config.json` into `dir` for
/// `tokenizer` (the one the training data was prepared with), and with `chat_template` also
/// `chat_template.jinja` and the template in `tokenizer_config.json` (see the module docs).
/// Each file is written whole (fsynced, renamed into place).
pub fn write_tokenizer_files(dir: &Path, tokenizer: &Tokenizer, chat_template: Option<&str>) -> AnyResult<()> {
    let saved = tokenizer.for_checkpoint()?;
    let ids = SpecialIds::of(tokenizer)?;
    let json = saved.inner().to_string(true).map_err(|e| anyhow::anyhow!("cannot serialise the tokenizer: {e}"))?;
    write(dir, "tokenizer.json", &json)?;
    let name = |id: Option<u32>| id.and_then(|i| saved.inner().id_to_token(i));
    let mut config = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": false,
    });
    let mut generation = serde_json::Map::new();
    for (key, id) in [("bos", ids.bos), ("eos", ids.eos), ("pad", ids.pad)] {
        if let Some(n) = name(id) {
            config[format!("{key}_token")] = n.into();
        }
        if let Some(i) = id {
            generation.insert(format!("{key}_token_id"), i.into());
        }
    }
    if let Some(t) = chat_template {
        config["chat_template"] = t.into();
        write(dir, "chat_template.jinja", t)?;
    }
    write(dir, "tokenizer_config.json", &serde_json::to_string_pretty(&config)?)?;
    write(dir, "generation_config.json", &serde_json::to_string_pretty(&generation)?)
}

fn write(dir: &Path, name: &str, text: &str) -> AnyResult<()> {
    let path = dir.join(name);
    write_atomic(&path, text.as_bytes()).with_context(|| format!("cannot write {}", path.display()))
}

/// The files a Hugging Face tokenizer (and its generation defaults) may consist of, which a
/// fine-tune copies from its source ([`SourceTokenizer`]) and `--merge-lora` from a checkpoint.
pub const TOKENIZER_FILES: [&str; 13] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
];

const JINJA: &str = "chat_template.jinja";
const CONFIG: &str = "tokenizer_config.json";

/// The source model's tokenizer files, as they were (see the module docs): read at start, held
/// in memory (an `--overwrite` or a later change of the source cannot touch what checkpoints
/// get), and written into every checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceTokenizer {
    /// (file name, bytes), in [`TOKENIZER_FILES`] order.
    files: Vec<(String, Vec<u8>)>,
}

impl SourceTokenizer {
    /// The tokenizer files of the model directory `dir`, with `template` (the chat template the
    /// run trains with; `None`: none, or the source's) written where the source keeps its own
    /// when it differs from it. `None` when `dir` has no `tokenizer_config.json`: then
    /// [`write_tokenizer_files`] writes ferrolm's files, as for a model pretraining made.
    pub fn read(dir: &Path, template: Option<&str>) -> AnyResult<Option<SourceTokenizer>> {
        if !dir.join(CONFIG).is_file() {
            return Ok(None);
        }
        let mut files = Vec::new();
        for name in TOKENIZER_FILES {
            let path = dir.join(name);
            if path.is_file() {
                files.push((name.to_string(), std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?));
            }
        }
        let mut tok = SourceTokenizer { files };
        let theirs = crate::data::chat::find_template_source(Some(dir), None).ok().map(|t| t.text);
        if let Some(t) = template.filter(|t| Some(*t) != theirs.as_deref()) {
            tok.set_template(t, &dir.join(CONFIG))?;
        }
        Ok(Some(tok))
    }

    /// The names of the files, in the order they are written.
    pub fn names(&self) -> Vec<&str> {
        self.files.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// The bytes of file `name`, if the source has it.
    pub fn file(&self, name: &str) -> Option<&[u8]> {
        self.files.iter().find(|(n, _)| n == name).map(|(_, b)| b.as_slice())
    }

    fn put(&mut self, name: &str, bytes: Vec<u8>) {
        match self.files.iter_mut().find(|(n, _)| n == name) {
            Some((_, b)) => *b = bytes,
            None => self.files.push((name.to_string(), bytes)),
        }
    }

    /// Writes `template` where the source keeps its template: `chat_template.jinja`, and the
    /// `chat_template` of `tokenizer_config.json` (a string, or the `default` of a list of named
    /// templates) with the rest of that file's text unchanged; where it has none, into
    /// `chat_template.jinja` (where transformers 5 saves one). `path` names the config in errors.
    fn set_template(&mut self, template: &str, path: &Path) -> AnyResult<()> {
        let mut placed = false;
        if self.file(JINJA).is_some() {
            self.put(JINJA, template.as_bytes().to_vec());
            placed = true;
        }
        let text = String::from_utf8(self.file(CONFIG).unwrap_or_default().to_vec())
            .with_context(|| format!("{} is not UTF-8 text", path.display()))?;
        let config: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))?;
        let value = match config.get("chat_template") {
            Some(serde_json::Value::String(_)) => Some(serde_json::Value::from(template)),
            Some(serde_json::Value::Array(list)) => {
                let mut list = list.clone();
                let default = list.iter_mut().find(|e| e.get("name").and_then(|n| n.as_str()) == Some("default"));
                match default {
                    Some(serde_json::Value::Object(e)) => {
                        e.insert("template".into(), template.into());
                    }
                    _ => list.push(serde_json::json!({"name": "default", "template": template})),
                }
                Some(serde_json::Value::Array(list))
            }
            _ => None,
        };
        if let Some(value) = value {
            let span = top_level_value(&text, "chat_template")
                .with_context(|| format!("{}: cannot find the value of `chat_template`", path.display()))?;
            let spliced = format!("{}{}{}", &text[..span.start], serde_json::to_string(&value)?, &text[span.end..]);
            let check: serde_json::Value = serde_json::from_str(&spliced)?;
            anyhow::ensure!(check.get("chat_template") == Some(&value), "{}: the new chat_template did not fit in", path.display());
            self.put(CONFIG, spliced.into_bytes());
            placed = true;
        }
        if !placed {
            self.put(JINJA, template.as_bytes().to_vec());
        }
        Ok(())
    }

    /// Writes every file into `dir` (each whole: fsynced, renamed into place).
    pub fn write(&self, dir: &Path) -> AnyResult<()> {
        for (name, bytes) in &self.files {
            let path = dir.join(name);
            write_atomic(&path, bytes).with_context(|| format!("cannot write {}", path.display()))?;
        }
        Ok(())
    }
}

/// The byte range of the value of the top-level `key` of the JSON object `text` (valid JSON).
fn top_level_value(text: &str, key: &str) -> Option<std::ops::Range<usize>> {
    let b = text.as_bytes();
    let ws = |mut i: usize| {
        while b.get(i).is_some_and(|c| c.is_ascii_whitespace()) {
            i += 1;
        }
        i
    };
    // The index after the string that opens at `i`.
    let string_end = |i: usize| {
        let mut j = i + 1;
        while j < b.len() {
            match b[j] {
                b'\\' => j += 2,
                b'"' => return Some(j + 1),
                _ => j += 1,
            }
        }
        None
    };
    let value_end = |i: usize| -> Option<usize> {
        match *b.get(i)? {
            b'"' => string_end(i),
            b'{' | b'[' => {
                let (mut j, mut depth) = (i, 0usize);
                while j < b.len() {
                    match b[j] {
                        b'"' => {
                            j = string_end(j)?;
                            continue;
                        }
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => {
                            depth -= 1;
                            if depth == 0 {
                                return Some(j + 1);
                            }
                        }
                        _ => {}
                    }
                    j += 1;
                }
                None
            }
            _ => Some(i + b[i..].iter().position(|c| matches!(c, b',' | b'}' | b']') || c.is_ascii_whitespace()).unwrap_or(b.len() - i)),
        }
    };
    let mut i = ws(0);
    if b.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    loop {
        i = ws(i);
        if b.get(i) != Some(&b'"') {
            return None;
        }
        let k_end = string_end(i)?;
        let k: String = serde_json::from_str(&text[i..k_end]).ok()?;
        i = ws(k_end);
        if b.get(i) != Some(&b':') {
            return None;
        }
        i = ws(i + 1);
        let v_end = value_end(i)?;
        if k == key {
            return Some(i..v_end);
        }
        i = ws(v_end);
        if b.get(i) != Some(&b',') {
            return None;
        }
        i += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_value_of_a_top_level_key_is_found_whatever_comes_before_it() {
        let text = "{\n  \"a\": {\"chat_template\": [1, \"}\"]},\n  \"b\": \"x\\\"y\",\n  \"chat_template\": \"{{ '}' }}\" ,\"c\": 1}";
        let r = top_level_value(text, "chat_template").unwrap();
        assert_eq!(&text[r], "\"{{ '}' }}\"");
        assert_eq!(&text[top_level_value(text, "c").unwrap()], "1");
        assert_eq!(&text[top_level_value(text, "a").unwrap()], "{\"chat_template\": [1, \"}\"]}");
        assert!(top_level_value(text, "d").is_none());
    }
}
