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
