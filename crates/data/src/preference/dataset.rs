//! Preference records -> [`PreferencePair`]s, tokenized and truncated as TRL 1.x does, with the
//! counts a run logs ([`PreferenceStats`]).
//!
//! Tokenization (TRL's `DPOTrainer._prepare_dataset`):
//! - a text pair (standard format, or implicit-prompt strings) gets the EOS token appended to
//!   each completion that does not already end with it; `prompt`, `prompt + chosen` and
//!   `prompt + rejected` are tokenized as text with the tokenizer's special tokens (its
//!   post-processor: a BOS where it adds one), as `tokenizer(text)` does;
//! - a conversational pair renders `prompt` with the generation prompt, and `prompt + chosen`
//!   and `prompt + rejected` without, through the chat template; each rendering is tokenized
//!   without special tokens, as `apply_chat_template(..., tokenize=True)` does;
//! - the prompt is the first `min(common(prompt, prompt + chosen), common(prompt, prompt +
//!   rejected))` ids, where `common` is the length of the common prefix of two id lists; each
//!   completion is the rest of its whole. Where the rendered prompt is not a prefix of the
//!   whole (a template that renders the generation prompt differently, tokens merging across
//!   the boundary), the completion starts where they differ and the pair is counted.
//!
//! Truncation, in this order:
//! 1. `max_prompt_length` keeps the prompt's last ids (the end next to the completion), as TRL
//!    before 1.0 did (`prompt_input_ids[-max_prompt_length:]`); TRL 1.x has no such setting;
//! 2. `max_length`: a pair whose prompt has `max_length` ids or more is skipped and counted (TRL
//!    1.x drops it: no completion token would remain); otherwise `prompt + chosen` and
//!    `prompt + rejected` each keep their first `max_length` ids (TRL's `keep_start`), which
//!    cuts the end of a long completion.

use super::records::{parse_pair, PreferenceFormat, RawPair};
use super::PreferencePair;
use crate::chat::reader::{encode_records, RecordColumns, RecordEvent};
use crate::chat::{ChatTemplate, Json, Message};
use crate::error::{Error, Result};
use crate::input::InputFile;
use crate::tokenizer::Tokenizer;

/// Skip messages kept (all skips are counted).
const MAX_SKIP_MESSAGES: usize = 20;

/// The Parquet columns a preference record reads, and the words of the reader's errors.
pub const PREFERENCE_COLUMNS: RecordColumns =
    RecordColumns { keys: &["prompt", "chosen", "rejected"], data: "preference", forms: "`prompt`, `chosen`, `rejected`" };

/// How preference records become pairs.
#[derive(Clone, Copy)]
pub struct PreferenceOptions<'a> {
    /// `--data-format`: detected per record, or forced.
    pub format: PreferenceFormat,
    /// The chat template (needed by conversational and implicit-prompt conversations).
    pub template: Option<&'a ChatTemplate>,
    pub tokenizer: &'a Tokenizer,
    /// `--max-length`: the most ids of `prompt + completion` (TRL's `max_length`); `None`: no
    /// limit.
    pub max_length: Option<usize>,
    /// `--max-prompt-length`: the most ids of a prompt, its start cut; `None`: no limit.
    pub max_prompt_length: Option<usize>,
    /// The EOS text appended to text completions; `None`: the template's `eos_token`, else the
    /// tokenizer's end-of-sequence token.
    pub eos_token: Option<&'a str>,
    /// `--skip-bad-records`: count and skip a record that fails (as SFT does) instead of failing.
    pub skip_bad_records: bool,
}

impl<'a> PreferenceOptions<'a> {
    /// Auto-detected format, no truncation, no skipping of bad records.
    pub fn new(tokenizer: &'a Tokenizer, template: Option<&'a ChatTemplate>) -> Self {
        PreferenceOptions {
            format: PreferenceFormat::Auto,
            template,
            tokenizer,
            max_length: None,
            max_prompt_length: None,
            eos_token: None,
            skip_bad_records: false,
        }
    }

    /// The EOS text of text completions (see [`PreferenceOptions::eos_token`]).
    fn eos_text(&self) -> Option<String> {
        self.eos_token
            .map(str::to_string)
            .or_else(|| self.template.and_then(|t| t.special_token("eos_token")).map(str::to_string))
            .or_else(|| self.tokenizer.eos_id().and_then(|id| self.tokenizer.inner().id_to_token(id)))
    }
}

/// Why a record gave no pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreferenceSkip {
    /// Unreadable or malformed (only with `skip_bad_records`; otherwise the load fails).
    BadRecord,
    /// `chosen` equals `rejected`: the pair prefers nothing.
    Identical,
    /// `chosen` or `rejected` has no text.
    EmptyCompletion,
    /// The prompt alone has `max_length` ids or more: no completion token would remain.
    PromptTooLong,
}

impl PreferenceSkip {
    fn why(self) -> &'static str {
        match self {
            PreferenceSkip::BadRecord => "a bad record",
            PreferenceSkip::Identical => "`chosen` equals `rejected`",
            PreferenceSkip::EmptyCompletion => "an empty completion",
            PreferenceSkip::PromptTooLong => "the prompt fills --max-length",
        }
    }
}

/// What tokenizing one pair did beyond the plain split.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PairNotes {
    /// `max_prompt_length` cut the prompt's start.
    pub prompt_truncated: bool,
    /// `max_length` cut the end of the chosen or the rejected completion.
    pub completion_truncated: bool,
    /// The tokenized prompt is not a prefix of a tokenized whole: the completion starts earlier.
    pub prompt_not_prefix: bool,
}

/// One record's outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Encoded {
    Pair(PreferencePair, PairNotes),
    Skip(PreferenceSkip),
}

/// What loading found: the counts [`PreferenceStats::summary`] logs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PreferenceStats {
    /// Records read, good and bad.
    pub records: u64,
    /// Pairs kept.
    pub pairs: u64,
    pub bad_records: u64,
    pub identical: u64,
    pub empty_completion: u64,
    pub prompt_too_long: u64,
    /// Pairs whose prompt `max_prompt_length` cut.
    pub prompt_truncated: u64,
    /// Pairs whose chosen or rejected completion `max_length` cut.
    pub completion_truncated: u64,
    /// Pairs whose tokenized prompt is not a prefix of the tokenized whole.
    pub prompt_not_prefix: u64,
    /// The first few skips, each with its file and line (or row) and why.
    pub skip_messages: Vec<String>,
    /// Ids kept in the pairs' prompts, chosen and rejected completions.
    pub prompt_tokens: u64,
    pub chosen_tokens: u64,
    pub rejected_tokens: u64,
}

impl PreferenceStats {
    fn skip(&mut self, reason: PreferenceSkip, msg: String) {
        match reason {
            PreferenceSkip::BadRecord => self.bad_records += 1,
            PreferenceSkip::Identical => self.identical += 1,
            PreferenceSkip::EmptyCompletion => self.empty_completion += 1,
            PreferenceSkip::PromptTooLong => self.prompt_too_long += 1,
        }
        if self.skip_messages.len() < MAX_SKIP_MESSAGES {
            self.skip_messages.push(msg);
        }
    }

    fn keep(&mut self, pair: &PreferencePair, notes: PairNotes) {
        self.pairs += 1;
        self.prompt_tokens += pair.prompt.len() as u64;
        self.chosen_tokens += pair.chosen.len() as u64;
        self.rejected_tokens += pair.rejected.len() as u64;
        self.prompt_truncated += u64::from(notes.prompt_truncated);
        self.completion_truncated += u64::from(notes.completion_truncated);
        self.prompt_not_prefix += u64::from(notes.prompt_not_prefix);
    }

    /// Records skipped, for every reason.
    pub fn skipped(&self) -> u64 {
        self.bad_records + self.identical + self.empty_completion + self.prompt_too_long
    }

    /// One line for the log, every drop and cut counted:
    /// `1200 records: 1180 pairs (...); skipped: 2 bad records, 10 with chosen equal to rejected, ...`.
    pub fn summary(&self) -> String {
        format!(
            "{} records: {} pairs ({} prompt, {} chosen, {} rejected tokens); skipped: {} bad records, {} with chosen equal to \
             rejected, {} with an empty completion, {} whose prompt fills --max-length; truncated: {} prompts to \
             --max-prompt-length (their start cut), {} pairs' completions to --max-length (their end cut); {} prompts not a \
             prefix of prompt + completion (the completion starts where they differ)",
            self.records,
            self.pairs,
            self.prompt_tokens,
            self.chosen_tokens,
            self.rejected_tokens,
            self.bad_records,
            self.identical,
            self.empty_completion,
            self.prompt_too_long,
            self.prompt_truncated,
            self.completion_truncated,
            self.prompt_not_prefix
        )
    }
}

/// The length of the common prefix of `a` and `b` (TRL's `common_prefix_length`).
pub fn common_prefix_length(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn encode_text(tokenizer: &Tokenizer, text: &str) -> std::result::Result<Vec<u32>, String> {
    tokenizer.encode(text, true).map_err(|e| e.to_string())
}

fn render_ids(template: &ChatTemplate, tokenizer: &Tokenizer, messages: &[Message], gen: bool) -> std::result::Result<Vec<u32>, String> {
    let text = template.render(messages, gen)?.text;
    tokenizer.encode(&text, false).map_err(|e| e.to_string())
}

/// Tokenizes one pair (see the module docs): a pair, or why it is skipped. The error is a
/// message without the record's location.
pub fn encode_pair(raw: &RawPair, opts: &PreferenceOptions) -> std::result::Result<Encoded, String> {
    if raw.identical() {
        return Ok(Encoded::Skip(PreferenceSkip::Identical));
    }
    if raw.empty_completion() {
        return Ok(Encoded::Skip(PreferenceSkip::EmptyCompletion));
    }
    let tok = opts.tokenizer;
    let (prompt_ids, chosen_ids, rejected_ids) = match raw {
        RawPair::Text { prompt, chosen, rejected } => {
            let eos = opts.eos_text().ok_or(
                "a text pair's completions end with the EOS token, and neither the tokenizer config (`eos_token`) nor the \
                 tokenizer names one",
            )?;
            let end = |s: &str| if s.ends_with(eos.as_str()) { s.to_string() } else { format!("{s}{eos}") };
            (
                encode_text(tok, prompt)?,
                encode_text(tok, &format!("{prompt}{}", end(chosen)))?,
                encode_text(tok, &format!("{prompt}{}", end(rejected)))?,
            )
        }
        RawPair::Chat { prompt, chosen, rejected } => {
            let template = opts.template.ok_or("a conversational pair needs a chat template (--chat-template or the model's)")?;
            let whole = |c: &[Message]| prompt.iter().chain(c).cloned().collect::<Vec<_>>();
            (
                render_ids(template, tok, prompt, true)?,
                render_ids(template, tok, &whole(chosen), false)?,
                render_ids(template, tok, &whole(rejected), false)?,
            )
        }
    };
    let split = common_prefix_length(&prompt_ids, &chosen_ids).min(common_prefix_length(&prompt_ids, &rejected_ids));
    let mut notes = PairNotes { prompt_not_prefix: split < prompt_ids.len(), ..PairNotes::default() };
    let mut pair = PreferencePair {
        prompt: prompt_ids[..split].to_vec(),
        chosen: chosen_ids[split..].to_vec(),
        rejected: rejected_ids[split..].to_vec(),
    };
    if pair.chosen.is_empty() || pair.rejected.is_empty() {
        return Ok(Encoded::Skip(PreferenceSkip::EmptyCompletion));
    }
    if let Some(n) = opts.max_prompt_length {
        if pair.prompt.len() > n {
            pair.prompt.drain(..pair.prompt.len() - n);
            notes.prompt_truncated = true;
        }
    }
    if let Some(max) = opts.max_length {
        if pair.prompt.len() >= max {
            return Ok(Encoded::Skip(PreferenceSkip::PromptTooLong));
        }
        let room = max - pair.prompt.len();
        for c in [&mut pair.chosen, &mut pair.rejected] {
            if c.len() > room {
                c.truncate(room);
                notes.completion_truncated = true;
            }
        }
    }
    Ok(Encoded::Pair(pair, notes))
}

/// Parses and tokenizes one record.
pub fn encode_record(record: &Json, opts: &PreferenceOptions) -> std::result::Result<Encoded, String> {
    encode_pair(&parse_pair(record, opts.format)?, opts)
}

/// Reads, parses and tokenizes every record of `inputs` (`.jsonl`, compressed, `.json`,
/// Parquet; see [`crate::resolve_inputs`] for directories and globs), in file and record order.
/// `progress(bytes_done, total_bytes, pairs)` is called after each batch. A bad record fails
/// the load naming its file and line (or row) and the field, unless `skip_bad_records`; the
/// counted skips are in the stats; an empty result fails saying how many records were skipped
/// and why.
pub fn load_preference_pairs(
    inputs: &[InputFile],
    opts: &PreferenceOptions,
    progress: &mut dyn FnMut(u64, u64, u64),
) -> Result<(Vec<PreferencePair>, PreferenceStats)> {
    if opts.max_length == Some(0) || opts.max_prompt_length == Some(0) {
        return Err(Error::invalid("--max-length and --max-prompt-length must be at least 1"));
    }
    let mut stats = PreferenceStats::default();
    let mut pairs = Vec::new();
    let encode = |rec: &Json| encode_record(rec, opts);
    encode_records(inputs, &PREFERENCE_COLUMNS, opts.skip_bad_records, &encode, &mut |event| match event {
        RecordEvent::Encoded(Encoded::Pair(pair, notes), _) => {
            stats.keep(&pair, notes);
            pairs.push(pair);
        }
        RecordEvent::Encoded(Encoded::Skip(reason), at) => stats.skip(reason, format!("{at}: skipped: {}", reason.why())),
        RecordEvent::Bad(msg) => stats.skip(PreferenceSkip::BadRecord, msg),
        RecordEvent::Progress(done, total) => progress(done, total, stats.pairs),
        RecordEvent::FileDone(records) => stats.records += records,
    })?;
    if pairs.is_empty() {
        let first = inputs.first().map_or_else(|| "no input files".to_string(), |f| f.path.display().to_string());
        let why = stats.skip_messages.first().map_or(String::new(), |m| format!("; the first skip: {m}"));
        return Err(Error::invalid(format!(
            "no usable pair in the preference data ({} file(s) starting with {first}): {}{why}",
            inputs.len(),
            stats.summary()
        )));
    }
    Ok((pairs, stats))
}
