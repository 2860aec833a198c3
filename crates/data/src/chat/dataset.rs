//! Input files -> tokenized, masked [`Example`]s, in file and record order, with the counts a
//! run logs: records read, bad records skipped (`--skip-bad-records`, as in pretraining: a file
//! that cannot be opened is skipped whole, a damaged stream from the damage on), and
//! conversations skipped because they train no token. Records are read on this thread and
//! rendered and tokenized in batches on every core.

use super::mask::{encode_sample, Example, TrainOn};
use super::reader::{encode_records, RecordColumns, RecordEvent};
use super::records::parse_record;
use super::template::ChatTemplate;
use super::DataFormat;
use crate::error::{Error, Result};
use crate::framing::DocFraming;
use crate::input::InputFile;
use crate::tokenizer::Tokenizer;

/// Skip messages kept (all skips are counted).
const MAX_SKIP_MESSAGES: usize = 20;

/// How records become examples.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChatDataOptions {
    pub format: DataFormat,
    pub train_on: TrainOn,
    pub skip_bad_records: bool,
}

/// Why a record gave no example.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SkipReason {
    /// Unreadable, of no known form, refused by the template ... (`--skip-bad-records`).
    BadRecord,
    /// A conversation in which `--train-on` trains no token.
    NoTrainedToken,
}

/// What loading found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadStats {
    /// Records read, good and bad.
    pub records: u64,
    pub examples: u64,
    pub bad_records: u64,
    pub no_trained_token: u64,
    /// The first few bad records' errors (file, line or row, what is wrong).
    pub skip_messages: Vec<String>,
    pub tokens: u64,
    /// Tokens the loss counts (see [`Example::trained_targets`]).
    pub trained_tokens: u64,
}

impl LoadStats {
    fn skip(&mut self, reason: SkipReason, msg: String) {
        match reason {
            SkipReason::BadRecord => self.bad_records += 1,
            SkipReason::NoTrainedToken => self.no_trained_token += 1,
        }
        if reason == SkipReason::BadRecord && self.skip_messages.len() < MAX_SKIP_MESSAGES {
            self.skip_messages.push(msg);
        }
    }

    /// One line for the log: `1200 records: 1180 examples, 15 bad records skipped, ...`.
    pub fn summary(&self) -> String {
        format!(
            "{} records: {} examples ({} tokens, {} trained), {} bad records skipped, {} conversations with no trained token skipped",
            self.records, self.examples, self.tokens, self.trained_tokens, self.bad_records, self.no_trained_token
        )
    }
}

/// Reads, renders, tokenizes and masks every record of `inputs`. `template` is needed for chat
/// records (text records go without); `progress(bytes_done, total_bytes, examples)` is called
/// after each batch. A bad record fails the load naming its file and line (or row), unless
/// `skip_bad_records`; an empty result fails saying how many records were skipped and why.
pub fn load_examples(
    inputs: &[InputFile],
    template: Option<&ChatTemplate>,
    tokenizer: &Tokenizer,
    opts: &ChatDataOptions,
    progress: &mut dyn FnMut(u64, u64, u64),
) -> Result<(Vec<Example>, LoadStats)> {
    let framing = DocFraming::of(tokenizer)?;
    let mut stats = LoadStats::default();
    let mut examples = Vec::new();
    let encode = |rec: &super::Json| {
        let sample = parse_record(rec, opts.format)?;
        encode_sample(&sample, template, tokenizer, &framing, opts.train_on)
    };
    encode_records(inputs, &RecordColumns::CHAT, opts.skip_bad_records, &encode, &mut |event| match event {
        RecordEvent::Encoded(ex, _) if ex.trained_targets() == 0 => stats.skip(SkipReason::NoTrainedToken, String::new()),
        RecordEvent::Encoded(ex, _) => {
            stats.examples += 1;
            stats.tokens += ex.len() as u64;
            stats.trained_tokens += ex.trained_targets() as u64;
            examples.push(ex);
        }
        RecordEvent::Bad(msg) => stats.skip(SkipReason::BadRecord, msg),
        RecordEvent::Progress(done, total) => progress(done, total, stats.examples),
        RecordEvent::FileDone(records) => stats.records += records,
    })?;
    if examples.is_empty() {
        let first = inputs.first().map_or_else(|| "no input files".to_string(), |f| f.path.display().to_string());
        let why = stats.skip_messages.first().map_or(String::new(), |m| format!("; the first bad record: {m}"));
        return Err(Error::invalid(format!(
            "no usable example in the chat data ({} file(s) starting with {first}): {} records read, {} bad records skipped, \
             {} conversations with no trained token skipped (--train-on {}){why}",
            inputs.len(),
            stats.records,
            stats.bad_records,
            stats.no_trained_token,
            opts.train_on
        )));
    }
    Ok((examples, stats))
}
