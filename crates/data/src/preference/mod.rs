//! Preference data for DPO and its siblings: TRL's standard, conversational and
//! implicit-prompt formats, tokenized as TRL 1.x tokenizes them.
//!
//! The seam between the data and the objective is [`PreferencePair`]: the prompt's ids and the
//! two completions' ids, split where TRL splits them. The objective concatenates
//! `prompt + chosen` and `prompt + rejected` and scores only the completion tokens.
//!
//! - [`records`]: TRL's standard, conversational and implicit-prompt records -> [`RawPair`],
//!   the format detected per record or forced by [`PreferenceFormat`] (`--data-format`);
//! - [`dataset`]: input files -> [`PreferencePair`]s, split and truncated as TRL does, with
//!   [`PreferenceStats`] (read, kept, truncated, skipped and why) for the log.
//!
//! `docs/PREFERENCE.md` describes the formats, the split rule, truncation, skips and errors.

pub mod dataset;
pub mod records;

pub use dataset::{
    common_prefix_length, encode_pair, encode_record, load_preference_pairs, Encoded, PairNotes, PreferenceOptions, PreferenceSkip,
    PreferenceStats, PREFERENCE_COLUMNS,
};
pub use records::{parse_pair, PreferenceFormat, RawPair};

/// One tokenized preference pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreferencePair {
    /// The prompt's ids, rendered with the generation prompt (chat formats) and truncated by
    /// `--max-prompt-length`.
    pub prompt: Vec<u32>,
    /// The preferred completion's ids (EOS appended to text completions that lack it).
    pub chosen: Vec<u32>,
    /// The dispreferred completion's ids.
    pub rejected: Vec<u32>,
}

impl PreferencePair {
    /// Tokens in `prompt + chosen`.
    pub fn chosen_len(&self) -> usize {
        self.prompt.len() + self.chosen.len()
    }
    /// Tokens in `prompt + rejected`.
    pub fn rejected_len(&self) -> usize {
        self.prompt.len() + self.rejected.len()
    }
}
