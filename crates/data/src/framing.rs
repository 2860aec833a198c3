//! What goes between documents, read from the tokenizer, and the encoding of documents into ids.
//!
//! Packed training needs one boundary marker per document, and the tokenizer says which:
//! - a post-processor template that closes a sequence (`$A </s>`, `<s> $A </s>`, BERT's
//!   `[CLS] $A [SEP]`): its tokens around every document;
//! - otherwise, a tokenizer with an end-of-sequence token (GPT-2's `<|endoftext|>`, Llama's
//!   `</s>` and `<|end_of_text|>`, ferrolm's `<|eos|>`): that token after every document. This
//!   is what text files always had, and a model that sees it learns to end documents, so
//!   generation (which stops at `eos_token_id`) stops;
//! - otherwise the template's opening tokens (Llama-style `<s> $A`) before every document.
//!
//! The template is read by encoding a probe with and without special tokens, so every
//! post-processor the tokenizers library knows (template, BERT, RoBERTa, sequences of them)
//! is read the same way.

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::records::{safe_cut, PIECE_BYTES};
use crate::tokenizer::Tokenizer;

/// The ids placed before and after each document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DocFraming {
    pub prefix: Vec<u32>,
    pub suffix: Vec<u32>,
}

impl DocFraming {
    /// The framing `tokenizer` defines (see the module docs).
    pub fn of(tokenizer: &Tokenizer) -> Result<Self> {
        let (prefix, suffix) = template_tokens(tokenizer)?;
        if !suffix.is_empty() {
            return Ok(DocFraming { prefix, suffix });
        }
        if let Some(eos) = tokenizer.eos_id() {
            return Ok(DocFraming { prefix: Vec::new(), suffix: vec![eos] });
        }
        Ok(DocFraming { prefix, suffix: Vec::new() })
    }

    /// The token a document starts after in data framed this way: the last of the tokens put
    /// before it, else the last of those that ended the previous document (the separator an
    /// EOS-framed stream holds before every document but the first, as GPT-2's `<|endoftext|>`).
    /// A model trained on such data has seen this token, and only this one, before a text's start:
    /// it is the `bos_token` of the checkpoint's Hugging Face files.
    pub fn bos(&self) -> Option<u32> {
        self.prefix.last().or(self.suffix.last()).copied()
    }

    /// The token that ends a document (generation stops at it): the last of those put after it,
    /// else the tokenizer's end-of-sequence token.
    pub fn eos(&self, tokenizer: &Tokenizer) -> Option<u32> {
        self.suffix.last().copied().or_else(|| tokenizer.eos_id())
    }

    /// For the manifest and the report: `"<|eos|> after each document"`.
    pub fn describe(&self, tokenizer: &Tokenizer) -> String {
        let names =
            |ids: &[u32]| ids.iter().map(|&i| tokenizer.inner().id_to_token(i).unwrap_or_else(|| format!("#{i}"))).collect::<Vec<_>>();
        match (self.prefix.is_empty(), self.suffix.is_empty()) {
            (true, true) => "nothing between documents (the tokenizer has no end-of-sequence token or template)".into(),
            (true, false) => format!("{} after each document", names(&self.suffix).join(" ")),
            (false, true) => format!("{} before each document", names(&self.prefix).join(" ")),
            (false, false) => format!("{} before and {} after each document", names(&self.prefix).join(" "), names(&self.suffix).join(" ")),
        }
    }
}

/// The special ids the post-processor puts before and after a single sequence.
fn template_tokens(tokenizer: &Tokenizer) -> Result<(Vec<u32>, Vec<u32>)> {
    const PROBE: &str = "a";
    let plain = encode_ids(tokenizer, PROBE, false)?;
    let with = encode_ids(tokenizer, PROBE, true)?;
    let at = (0..=with.len().saturating_sub(plain.len())).find(|&k| with[k..].starts_with(&plain));
    match at {
        Some(k) if !plain.is_empty() => Ok((with[..k].to_vec(), with[k + plain.len()..].to_vec())),
        // A post-processor that rewrites the text's own ids: no template to read.
        _ => Ok((Vec::new(), Vec::new())),
    }
}

fn encode_ids(tokenizer: &Tokenizer, text: &str, special: bool) -> Result<Vec<u32>> {
    let enc = tokenizer.inner().encode_fast(text, special).map_err(|e| Error::Tokenizer(format!("encode failed: {e}")))?;
    Ok(enc.get_ids().to_vec())
}

/// Splits `text` into pieces of about [`PIECE_BYTES`] at [`safe_cut`]s (one piece when short).
pub(crate) fn pieces(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while rest.len() > PIECE_BYTES {
        match safe_cut(rest.as_bytes(), PIECE_BYTES) {
            Some(c) => {
                let (a, b) = rest.split_at(c);
                out.push(a);
                rest = b;
            }
            None => break,
        }
    }
    out.push(rest);
    out
}

/// Ids of each text (no special tokens), encoded in parallel on the rayon pool; long texts are
/// encoded in pieces (see [`pieces`]), so one long document still uses every core.
pub(crate) fn encode_texts(tokenizer: &Tokenizer, texts: &[&str]) -> Result<Vec<Vec<u32>>> {
    let split: Vec<(usize, &str)> = texts.iter().enumerate().flat_map(|(i, t)| pieces(t).into_iter().map(move |p| (i, p))).collect();
    let ids: Vec<(usize, Vec<u32>)> =
        split.par_iter().map(|&(i, p)| encode_ids(tokenizer, p, false).map(|ids| (i, ids))).collect::<Result<_>>()?;
    let mut out = vec![Vec::new(); texts.len()];
    for (i, ids) in ids {
        out[i].extend_from_slice(&ids);
    }
    Ok(out)
}
