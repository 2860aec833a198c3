//! A thin wrapper over Hugging Face `tokenizers`, loading `tokenizer.json`.
//!
//! Why a wrapper: the rest of ferrolm only needs ids in, text out and the ids
//! of the document delimiters; keeping the HF types behind this struct keeps
//! their error type (a boxed `dyn Error`) and generics out of our API, and lets
//! any HF `tokenizer.json` (GPT-2, Llama 3, ours) be used unchanged.

use std::path::{Path, PathBuf};

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::sequence::Sequence;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::AddedToken;

use crate::error::{Error, Result};
use crate::framing::DocFraming;

/// Beginning-of-sequence token of the tokenizers this crate trains.
pub const BOS_TOKEN: &str = "<|bos|>";
/// End-of-sequence token of the tokenizers this crate trains; separates documents.
pub const EOS_TOKEN: &str = "<|eos|>";

/// Spellings of BOS / EOS across common tokenizers (ours, Llama 1/2, Llama 3, GPT-2).
const BOS_NAMES: [&str; 3] = [BOS_TOKEN, "<s>", "<|begin_of_text|>"];
const EOS_NAMES: [&str; 4] = [EOS_TOKEN, "</s>", "<|end_of_text|>", "<|endoftext|>"];

/// A loaded tokenizer (any Hugging Face `tokenizer.json`).
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// One past the largest id (see [`Tokenizer::vocab_size`]).
    vocab_size: usize,
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`; errors name the file (and the field, for the
    /// settings refused by [`Tokenizer::from_bytes`]).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let json = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        Self::parse(&json, path)
    }

    /// Parses the text of a `tokenizer.json`. Refused, with an error naming the field:
    /// `truncation` or `padding` set (the tokenizer would silently cut documents, or pad them
    /// with ids that are not text; with `stride >= max_length` the tokenizers library panics
    /// while encoding), and ids that do not fit the i32 token ids of a batch.
    pub fn from_bytes(json: &[u8]) -> Result<Self> {
        Self::parse(json, Path::new("<tokenizer json>"))
    }

    fn parse(json: &[u8], path: &Path) -> Result<Self> {
        let bad = |e: &dyn std::fmt::Display| Error::format(path, format!("not a valid tokenizer.json: {e}"));
        let value: serde_json::Value = serde_json::from_slice(json).map_err(|e| bad(&e))?;
        check_ids(&value, path)?;
        check_bpe_merges(&value, path)?;
        let inner: tokenizers::Tokenizer = serde_json::from_value(value).map_err(|e| bad(&e))?;
        // The post-processor is checked as the library parsed it, re-serialised: serde accepts
        // several spellings of one struct (an array for a struct, for instance), and a check of
        // the raw JSON missed a template naming an undefined special token written that way,
        // which the library then panics on while encoding.
        let value_pp = inner.get_post_processor().map(serde_json::to_value).transpose().map_err(|e| bad(&e))?;
        if let Some(pp) = &value_pp {
            check_post_processor(pp, path, "post_processor")?;
        }
        if let Some(t) = inner.get_truncation() {
            return Err(Error::format(
                path,
                format!(
                    "field `truncation` is set (max_length {}, stride {}): ferrolm tokenizes whole documents and cuts \
                     training windows itself, so truncation would silently drop text; set `truncation` to null",
                    t.max_length, t.stride
                ),
            ));
        }
        if inner.get_padding().is_some() {
            return Err(Error::format(
                path,
                "field `padding` is set: padding would add ids that are not text to every encoding; set `padding` to null",
            ));
        }
        let vocab = inner.get_vocab(true);
        let max_id = vocab.values().copied().max();
        // Ids become i32 in batches and index the embedding table, so every id must be below
        // `vocab_size`, which therefore counts the holes of a sparse vocabulary too.
        let vocab_size = max_id.map_or(0, |m| m as usize + 1).max(vocab.len());
        if vocab_size == 0 {
            return Err(Error::format(path, "field `model.vocab`: the vocabulary is empty"));
        }
        if vocab_size > MAX_ID as usize + 1 {
            return Err(Error::format(path, format!("{vocab_size} tokens do not fit the i32 ids of a batch")));
        }
        // A post-processor inserts the ids its special tokens declare: they must be tokens.
        if let Some(id) = special_token_ids(value_pp.as_ref()).into_iter().find(|&id| id as usize >= vocab_size) {
            return Err(Error::format(
                path,
                format!("field `post_processor`: a special token has id {id}, outside the vocabulary of {vocab_size}"),
            ));
        }
        Ok(Tokenizer { inner, vocab_size })
    }

    /// Writes the tokenizer as `tokenizer.json` (pretty-printed, so diffs stay readable).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        self.inner.save(path, true).map_err(|e| Error::format(path, format!("cannot write tokenizer: {e}")))
    }

    /// Token ids of `text`. With `add_special_tokens` the tokenizer's post-processor
    /// runs (for ours: prepends `<|bos|>`); without it the ids are the plain text. A prompt to
    /// continue is [`Tokenizer::encode_as_document`].
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, add_special_tokens).map_err(|e| Error::Tokenizer(format!("encode failed: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Ids of `text` as the start of a document, as the model saw documents start in training
    /// data framed by this tokenizer ([`DocFraming`]): the tokens put before each document, then
    /// the text's own. For an EOS-framed tokenizer (ours) that is the plain text. A checkpoint's
    /// `tokenizer.json` ([`Tokenizer::for_checkpoint`]) gives the same ids with its
    /// post-processor, so `encode(text, true)` there, and transformers' default, agree with it.
    pub fn encode_as_document(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = DocFraming::of(self)?.prefix;
        ids.extend(self.encode(text, false)?);
        Ok(ids)
    }

    /// This tokenizer for a checkpoint: its post-processor replaced by one that adds what the
    /// framing of its training data puts before a document, and nothing after (a prompt is a
    /// document's start): `encode(text, true)` is then [`Tokenizer::encode_as_document`], and so
    /// is transformers' default (`add_special_tokens=True`). A pair is two documents as the data
    /// holds them: `prefix A suffix prefix B`. ByteLevel post-processing (offsets) is kept. The
    /// framing, and so the ids prepared data holds, is unchanged ([`Tokenizer::fingerprint`]).
    pub fn for_checkpoint(&self) -> Result<Tokenizer> {
        let framing = DocFraming::of(self)?;
        let mut v: serde_json::Value =
            serde_json::from_str(&self.canonical_json()?).map_err(|e| Error::Tokenizer(format!("cannot serialise: {e}")))?;
        let mut processors: Vec<serde_json::Value> = Vec::new();
        let pp = v.get("post_processor").cloned().unwrap_or_default();
        let members = match pp.get("type").and_then(|t| t.as_str()) {
            Some("Sequence") => pp.get("processors").and_then(|p| p.as_array()).cloned().unwrap_or_default(),
            _ => vec![pp],
        };
        processors.extend(members.into_iter().filter(|p| p.get("type").and_then(|t| t.as_str()) == Some("ByteLevel")));
        if !framing.prefix.is_empty() {
            processors.push(self.template(&framing)?);
        }
        v["post_processor"] = match processors.len() {
            0 => serde_json::Value::Null,
            1 => processors.remove(0),
            _ => serde_json::json!({"type": "Sequence", "processors": processors}),
        };
        Tokenizer::from_bytes(v.to_string().as_bytes())
    }

    /// A `TemplateProcessing` post-processor (JSON) for `framing`: single `prefix $A`, pair
    /// `prefix $A suffix prefix $B`.
    fn template(&self, framing: &DocFraming) -> Result<serde_json::Value> {
        let name = |id: u32| self.inner.id_to_token(id).ok_or_else(|| Error::Tokenizer(format!("framing token {id} has no name")));
        let special = |id: u32, type_id: u32| -> Result<serde_json::Value> {
            Ok(serde_json::json!({"SpecialToken": {"id": name(id)?, "type_id": type_id}}))
        };
        let seq = |id: &str, type_id: u32| serde_json::json!({"Sequence": {"id": id, "type_id": type_id}});
        let mut single = framing.prefix.iter().map(|&i| special(i, 0)).collect::<Result<Vec<_>>>()?;
        single.push(seq("A", 0));
        let mut pair = single.clone();
        for &i in &framing.suffix {
            pair.push(special(i, 0)?);
        }
        for &i in &framing.prefix {
            pair.push(special(i, 1)?);
        }
        pair.push(seq("B", 1));
        let mut specials = serde_json::Map::new();
        for &i in framing.prefix.iter().chain(&framing.suffix) {
            let n = name(i)?;
            specials.insert(n.clone(), serde_json::json!({"id": n, "ids": [i], "tokens": [n]}));
        }
        Ok(serde_json::json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials}))
    }

    /// Text of `ids`; special tokens are kept so that decode is faithful.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let vocab = self.vocab_size();
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(Error::invalid(format!("token id {bad} out of range (vocab size {vocab})")));
        }
        self.inner.decode(ids, false).map_err(|e| Error::Tokenizer(format!("decode failed: {e}")))
    }

    /// The embedding table size: one past the largest id, added/special tokens included (for a
    /// dense vocabulary, the number of tokens), so every id the tokenizer emits is below it.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// A stable 64-bit FNV-1a hash (16 hex digits) of what decides the ids of prepared data:
    /// the tokenizer's canonical JSON without its post-processor (documents are encoded without
    /// special tokens), and the framing the post-processor defines ([`DocFraming`]). Equal for
    /// the same vocabulary, merges, normaliser, pre-tokenizer and framing, whatever the
    /// whitespace or key order of the file, so a checkpoint's tokenizer
    /// ([`Tokenizer::for_checkpoint`]) matches data prepared with its source. Prepared data
    /// records it (see `check_token_data`).
    pub fn fingerprint(&self) -> Result<String> {
        let mut v: serde_json::Value =
            serde_json::from_str(&self.canonical_json()?).map_err(|e| Error::Tokenizer(format!("cannot serialise: {e}")))?;
        v["post_processor"] = serde_json::Value::Null;
        let f = DocFraming::of(self)?;
        Ok(fnv_hex(&[v.to_string().as_bytes(), format!("{:?} {:?}", f.prefix, f.suffix).as_bytes()]))
    }

    /// The fingerprint data prepared before 2026-11-28 recorded: the canonical JSON whole.
    pub(crate) fn legacy_fingerprint(&self) -> Result<String> {
        Ok(fnv_hex(&[self.canonical_json()?.as_bytes()]))
    }

    fn canonical_json(&self) -> Result<String> {
        self.inner.to_string(false).map_err(|e| Error::Tokenizer(format!("cannot serialise: {e}")))
    }

    /// Id of `token`, if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Beginning-of-sequence id (`<|bos|>`, `<s>` or `<|begin_of_text|>`).
    pub fn bos_id(&self) -> Option<u32> {
        BOS_NAMES.iter().find_map(|t| self.token_to_id(t))
    }

    /// End-of-sequence id (`<|eos|>`, `</s>`, `<|end_of_text|>` or `<|endoftext|>`).
    pub fn eos_id(&self) -> Option<u32> {
        EOS_NAMES.iter().find_map(|t| self.token_to_id(t))
    }

    /// The underlying Hugging Face tokenizer, for what this wrapper does not cover.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// FNV-1a over `parts` in order, as 16 hex digits.
fn fnv_hex(parts: &[&[u8]]) -> String {
    use std::hash::Hasher;
    let mut h = fnv::FnvHasher::default();
    for p in parts {
        h.write(p);
    }
    format!("{:016x}", h.finish())
}

/// Largest token id accepted: ids become i32 in batches, and `vocab_size = max id + 1` must
/// fit too.
const MAX_ID: u64 = i32::MAX as u64 - 1;

/// Refuses ids above [`MAX_ID`] in `model.vocab` and `added_tokens` before the tokenizers
/// library sees them (it numbers added tokens from the largest id with `+ 1`, which overflows).
fn check_ids(v: &serde_json::Value, path: &Path) -> Result<()> {
    let too_big = |field: &str, tok: &str, id: &serde_json::Value| {
        Error::format(path, format!("field `{field}`: token {tok:?} has id {id}, beyond the largest id ferrolm accepts ({MAX_ID})"))
    };
    if let Some(vocab) = v.pointer("/model/vocab").and_then(|x| x.as_object()) {
        if let Some((tok, id)) = vocab.iter().find(|(_, id)| id.as_u64().is_some_and(|i| i > MAX_ID)) {
            return Err(too_big("model.vocab", tok, id));
        }
    }
    for t in v.get("added_tokens").and_then(|x| x.as_array()).into_iter().flatten() {
        if let Some(id) = t.get("id").filter(|id| id.as_u64().is_some_and(|i| i > MAX_ID)) {
            return Err(too_big("added_tokens", t.get("content").and_then(|c| c.as_str()).unwrap_or("?"), id));
        }
    }
    Ok(())
}

/// Every id the `special_tokens` of a template post-processor (at any depth) declares.
fn special_token_ids(pp: Option<&serde_json::Value>) -> Vec<u64> {
    let Some(pp) = pp else { return Vec::new() };
    let mut out = Vec::new();
    for p in pp.get("processors").and_then(|x| x.as_array()).into_iter().flatten() {
        out.extend(special_token_ids(Some(p)));
    }
    for t in pp.get("special_tokens").and_then(|s| s.as_object()).into_iter().flat_map(|o| o.values()) {
        out.extend(t.get("ids").and_then(|x| x.as_array()).into_iter().flatten().map(|i| i.as_u64().unwrap_or(u64::MAX)));
    }
    // Bert/Roberta processors: `sep` and `cls` are (token, id).
    for k in ["sep", "cls"] {
        out.extend(pp.get(k).and_then(|x| x.get(1)).map(|i| i.as_u64().unwrap_or(u64::MAX)));
    }
    out
}

/// With a `continuing_subword_prefix`, the tokenizers library slices the prefix off the second
/// token of every BPE merge and panics when that token does not start with it.
fn check_bpe_merges(v: &serde_json::Value, path: &Path) -> Result<()> {
    let Some(model) = v.get("model").filter(|m| m.get("type").and_then(|t| t.as_str()) == Some("BPE")) else { return Ok(()) };
    let Some(prefix) = model.get("continuing_subword_prefix").and_then(|p| p.as_str()).filter(|p| !p.is_empty()) else { return Ok(()) };
    for (i, m) in model.get("merges").and_then(|x| x.as_array()).into_iter().flatten().enumerate() {
        let second = match m {
            serde_json::Value::String(s) => s.split_once(' ').map(|(_, b)| b.to_string()),
            serde_json::Value::Array(a) => a.get(1).and_then(|b| b.as_str()).map(str::to_string),
            _ => None,
        };
        if let Some(b) = second {
            if !b.starts_with(prefix) {
                return Err(Error::format(
                    path,
                    format!("field `model.merges`: merge {i} ends in {b:?}, which lacks the continuing_subword_prefix {prefix:?}"),
                ));
            }
        }
    }
    Ok(())
}

/// A `TemplateProcessing` post-processor must define every special token its templates name
/// (the tokenizers library panics while encoding otherwise), each with as many ids as tokens.
/// `Sequence` post-processors are checked member by member.
fn check_post_processor(pp: &serde_json::Value, path: &Path, field: &str) -> Result<()> {
    let bad = |m: String| Error::format(path, format!("field `{field}`: {m}"));
    match pp.get("type").and_then(|t| t.as_str()) {
        Some("Sequence") => {
            for (i, p) in pp.get("processors").and_then(|x| x.as_array()).into_iter().flatten().enumerate() {
                check_post_processor(p, path, &format!("{field}.processors[{i}]"))?;
            }
        }
        Some("TemplateProcessing") => {
            let specials = pp.get("special_tokens").and_then(|s| s.as_object());
            for (name, t) in specials.into_iter().flatten() {
                let len = |k: &str| t.get(k).and_then(|x| x.as_array()).map(|a| a.len());
                if len("ids") != len("tokens") {
                    return Err(bad(format!("special token {name:?} has {:?} ids for {:?} tokens", len("ids"), len("tokens"))));
                }
            }
            for template in ["single", "pair"] {
                for piece in pp.get(template).and_then(|x| x.as_array()).into_iter().flatten() {
                    if let Some(id) = piece.pointer("/SpecialToken/id").and_then(|x| x.as_str()) {
                        if !specials.is_some_and(|s| s.contains_key(id)) {
                            return Err(bad(format!(
                                "template `{template}` uses special token {id:?}, which `special_tokens` does not define"
                            )));
                        }
                    }
                }
            }
        }
        _ => {}
    }
    Ok(())
}

/// Trains a GPT-2-style byte-level BPE on `files`, with `<|bos|>` = 0 and
/// `<|eos|>` = 1 as special tokens.
///
/// Byte level means every string is encodable (no `<unk>`) and decoding is
/// lossless; there is no normaliser, for the same reason. The post-processor
/// prepends `<|bos|>` when `encode(.., add_special_tokens = true)`.
pub fn train_byte_level_bpe(files: &[PathBuf], vocab_size: usize) -> Result<Tokenizer> {
    if files.is_empty() {
        return Err(Error::invalid("train_byte_level_bpe: no input files"));
    }
    // 256 byte symbols + 2 specials is the floor for a byte-level vocabulary.
    if vocab_size < 258 {
        return Err(Error::invalid(format!("vocab size {vocab_size} is below the byte-level minimum of 258")));
    }
    for f in files {
        std::fs::metadata(f).map_err(|e| Error::io(f, e))?;
    }
    let specials = vec![AddedToken::from(BOS_TOKEN, true), AddedToken::from(EOS_TOKEN, true)];
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(vocab_size)
        .min_frequency(2)
        .special_tokens(specials)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();

    let mut inner = tokenizers::Tokenizer::new(BPE::default());
    inner.with_pre_tokenizer(Some(ByteLevel::new(false, true, true))).with_decoder(Some(ByteLevel::default()));
    let names = files.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    inner.train_from_files(&mut trainer, names).map_err(|e| Error::Tokenizer(format!("training failed: {e}")))?;

    let bos = inner.token_to_id(BOS_TOKEN).ok_or_else(|| Error::Tokenizer("trained vocabulary lacks <|bos|>".into()))?;
    let template = TemplateProcessing::builder()
        .try_single(format!("{BOS_TOKEN} $A"))
        .and_then(|b| b.try_pair(format!("{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1")))
        .map_err(|e| Error::Tokenizer(format!("template: {e}")))?
        .special_tokens(vec![(BOS_TOKEN, bos)])
        .build()
        .map_err(|e| Error::Tokenizer(format!("template: {e}")))?;
    // ByteLevel first (offset trimming, as GPT-2 / Llama 3 do), then the BOS template.
    let post =
        Sequence::new(vec![PostProcessorWrapper::ByteLevel(ByteLevel::new(false, false, true)), PostProcessorWrapper::Template(template)]);
    inner.with_post_processor(Some(post));
    let vocab_size = inner.get_vocab_size(true);
    Ok(Tokenizer { inner, vocab_size })
}
