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
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`; errors name the file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let json = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let inner: tokenizers::Tokenizer = json.parse().map_err(|e| Error::format(path, format!("not a valid tokenizer.json: {e}")))?;
        Ok(Tokenizer { inner })
    }

    /// Writes the tokenizer as `tokenizer.json` (pretty-printed, so diffs stay readable).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        self.inner.save(path, true).map_err(|e| Error::format(path, format!("cannot write tokenizer: {e}")))
    }

    /// Token ids of `text`. With `add_special_tokens` the tokenizer's post-processor
    /// runs (for ours: prepends `<|bos|>`); without it the ids are the plain text.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, add_special_tokens).map_err(|e| Error::Tokenizer(format!("encode failed: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`; special tokens are kept so that decode is faithful.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let vocab = self.vocab_size();
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(Error::invalid(format!("token id {bad} out of range (vocab size {vocab})")));
        }
        self.inner.decode(ids, false).map_err(|e| Error::Tokenizer(format!("decode failed: {e}")))
    }

    /// Number of ids, added/special tokens included: the embedding table size.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
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
    Ok(Tokenizer { inner })
}
