//! Chat data for the fine-tuning tools (`finetune`, `finetune_ladder`, `eval --chat`, `generate
//! --chat`): the template found by transformers' search order, the conversations of `--data`
//! read, rendered, masked (`ferrolm_data::chat`), split into training and held-out validation
//! conversations, and packed into rows; and replies generated with the template.
//!
//! Token data (a prepared shard directory, `.txt` files, or `--data-format text`) is not chat
//! data: it trains in windows, every token, as pretraining does (`is_token_data`).
use crate::data::chat::{
    self, find_template_source_in, load_examples, pack, ChatDataOptions, ChatTemplate, DataFormat, Example, LoadStats, PackOptions,
    PackStats, PackedData, TemplateSource, TrainOn,
};
use crate::data::{resolve_inputs, EpochOrder, PrepareSummary, Tokenizer};
use crate::nn::Sampling;
use crate::progress::{report, Progress};
use crate::AnyResult;
use anyhow::{bail, Context};
use std::path::Path;

/// How `--data` becomes training and validation rows (the flags, as plain values).
#[derive(Clone, Debug, PartialEq)]
pub struct ChatOptions {
    pub format: DataFormat,
    /// `--chat-template FILE` (else the model directory's template).
    pub chat_template: Option<std::path::PathBuf>,
    pub train_on: TrainOn,
    /// Best-fit decreasing packing (`--pack`), or one conversation a row (`--no-pack`).
    pub pack: bool,
    pub truncate: bool,
    /// `--val-data FILE`: validation conversations of their own.
    pub val_data: Option<std::path::PathBuf>,
    /// Else this fraction of `--data`'s conversations is held out (0: no validation).
    pub val_fraction: f64,
    pub skip_bad_records: bool,
}

/// What became of the conversations of one data set, as the tools report it (at info level,
/// and in `eval --chat`'s last line). Every record read is counted once:
/// `read = kept + dropped + held_out + bad + untrained`; `cut` counts the kept ones that
/// `--truncate` cut to `--seq-len`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChatCounts {
    /// Records read, good and bad.
    pub read: u64,
    /// Trained (fine-tuning) or scored (`eval --chat`), the cut ones included.
    pub kept: u64,
    /// Longer than `--seq-len` and dropped (without `--truncate`, or left with no trained token
    /// by the cut).
    pub dropped: u64,
    /// Kept, cut to their first `--seq-len` tokens (`--truncate`).
    pub cut: u64,
    /// Bad records skipped (`--skip-bad-records`).
    pub bad: u64,
    /// Conversations in which `--train-on` trains no token, skipped.
    pub untrained: u64,
    /// Held out as validation conversations (`--val-fraction`).
    pub held_out: u64,
    /// The `--seq-len` the lengths were held to.
    pub seq_len: usize,
}

impl ChatCounts {
    /// The counts of `stats` (what loading read) and `packed` (what fit), `held_out` of them
    /// set aside before packing.
    pub fn of(stats: &LoadStats, packed: &PackStats, held_out: u64) -> ChatCounts {
        ChatCounts {
            read: stats.records,
            kept: packed.packed,
            dropped: packed.dropped_too_long,
            cut: packed.truncated,
            bad: stats.bad_records,
            untrained: stats.no_trained_token,
            held_out,
            seq_len: packed.seq_len,
        }
    }

    /// One line for the log, `verb` saying what the kept ones are (`trained`, `scored`):
    /// `40 conversations read: 31 trained, 7 dropped (longer than --seq-len 64), 2 cut (--truncate), ...`.
    pub fn summary(&self, verb: &str) -> String {
        let held = if self.held_out > 0 { format!(", {} held out for validation", self.held_out) } else { String::new() };
        format!(
            "{} conversations read: {} {verb}, {} dropped (longer than --seq-len {}), {} cut (--truncate: their first {} tokens kept), \
             {} bad records skipped, {} with no trained token skipped{held}",
            self.read, self.kept, self.dropped, self.seq_len, self.cut, self.seq_len, self.bad, self.untrained
        )
    }
}

/// Conversations ready to train on.
pub struct ChatData {
    pub train: PackedData,
    /// One held-out conversation a row; None with `--val-fraction 0` and no `--val-data`.
    pub val: Option<PackedData>,
    /// What became of `--data`'s conversations (`held_out` of them validate).
    pub counts: ChatCounts,
    /// What became of the validation conversations (held out of `--data`, or `--val-data`'s).
    pub val_counts: Option<ChatCounts>,
    /// The template (a checkpoint carries it on).
    pub template: TemplateSource,
    /// The first validation conversation up to its first trained token: the prompt whose reply
    /// the tools show before and after training.
    pub sample_prompt: Option<Vec<u32>>,
}

/// Whether `--data` is token data, trained in windows as pretraining trains: a directory
/// prepared by prepare_data, text files (`.txt`), any records with `--data-format text`, or,
/// under `--data-format auto`, records whose first readable one is of the `text` form (a
/// pretraining corpus in JSON Lines needs no chat template).
pub fn is_token_data(data: &Path, format: DataFormat) -> AnyResult<bool> {
    if format == DataFormat::Text || PrepareSummary::load(data)?.is_some() {
        return Ok(true);
    }
    let inputs = resolve_inputs(data).with_context(|| format!("cannot read the data {}", data.display()))?;
    if inputs.iter().all(|f| f.format.is_text()) {
        return Ok(true);
    }
    Ok(format == DataFormat::Auto && first_record_is_text(&inputs))
}

/// Whether the first record of the first record file that parses is plain text (`{"text": …}`).
/// Bad records at its head (at most 64) are passed over; errors are left to the reader proper,
/// which names the file and line.
fn first_record_is_text(inputs: &[crate::data::InputFile]) -> bool {
    let Some(file) = inputs.iter().find(|f| !f.format.is_text()) else { return false };
    let Ok(mut reader) = chat::RecordReader::open(file) else { return false };
    for _ in 0..64 {
        match reader.next_record() {
            Ok(Some((_, record))) => {
                if let Ok(sample) = chat::parse_record(&record, DataFormat::Auto) {
                    return matches!(sample, chat::Sample::Text(_));
                }
            }
            Ok(None) => return false,
            Err(_) => {}
        }
    }
    false
}

/// The special tokens a template sees: those the first `tokenizer_config.json` of `model_dirs`
/// that names any names, else the tokenizer's own BOS and EOS (a checkpoint that predates
/// tokenizer_config.json).
fn special_tokens(model_dirs: &[&Path], tokenizer: &Tokenizer) -> AnyResult<Vec<(String, String)>> {
    for config in model_dirs.iter().map(|d| d.join("tokenizer_config.json")) {
        if let Some(c) = chat::template::read_tokenizer_config(&config)? {
            let named = chat::template::special_tokens_of_config(&c);
            if !named.is_empty() {
                return Ok(named);
            }
        }
    }
    let name = |id: Option<u32>| id.and_then(|i| tokenizer.inner().id_to_token(i));
    Ok([("bos_token", name(tokenizer.bos_id())), ("eos_token", name(tokenizer.eos_id()))]
        .into_iter()
        .filter_map(|(k, v)| Some((k.to_string(), v?)))
        .collect())
}

/// The chat template by transformers' search order (`--chat-template`, `chat_template.jinja` in
/// the model directory, `chat_template` in its `tokenizer_config.json`), compiled with the
/// special tokens it may name; the error of a failed search names the three places.
pub fn template(model_dir: Option<&Path>, explicit: Option<&Path>, tokenizer: &Tokenizer) -> AnyResult<(ChatTemplate, TemplateSource)> {
    template_in(model_dir.as_slice(), explicit, tokenizer)
}

/// As [`template`], searching each of `model_dirs` in turn: with `--lora`, the adapter's
/// directory (a LoRA run's checkpoint carries the run's template) before the base model's
/// (`chat::find_template_source_in`); the error names every place searched.
pub fn template_in(model_dirs: &[&Path], explicit: Option<&Path>, tokenizer: &Tokenizer) -> AnyResult<(ChatTemplate, TemplateSource)> {
    let source = find_template_source_in(model_dirs, explicit)?;
    let t = ChatTemplate::new(&source.text, &source.origin, special_tokens(model_dirs, tokenizer)?)?;
    Ok((t, source))
}

/// Examples of `data` with a progress bar, and what loading found; the report line says what
/// was read and skipped.
fn examples(
    data: &Path,
    template: &ChatTemplate,
    tokenizer: &Tokenizer,
    opts: &ChatOptions,
    what: &str,
) -> AnyResult<(Vec<Example>, LoadStats)> {
    let inputs = resolve_inputs(data).with_context(|| format!("cannot read the {what} {}", data.display()))?;
    let bar = Progress::bytes(inputs.iter().map(|f| f.bytes).sum(), what);
    let o = ChatDataOptions { format: opts.format, train_on: opts.train_on, skip_bad_records: opts.skip_bad_records };
    let (ex, stats) = load_examples(&inputs, Some(template), tokenizer, &o, &mut |done, _, n| {
        bar.set_position(done);
        bar.set_message(format!("{n} conversations"));
    })
    .with_context(|| format!("cannot read the {what} {}", data.display()))?;
    drop(bar);
    report(&format!("{what} {}: {}", data.display(), stats.summary()));
    for m in &stats.skip_messages {
        report(&format!("  skipped: {m}"));
    }
    Ok((ex, stats))
}

/// Reads, renders and masks `data` (and `opts.val_data`), holds out the validation
/// conversations, and packs both for rows of `seq_len` tokens. `--val-fraction` holds out
/// max(1, round(f n)) of the n conversations (leaving at least one to train), drawn with
/// `seed`; validation conversations are never packed, and follow the same masking, length and
/// `--truncate` rules as training.
pub fn load(
    data: &Path,
    model_dir: Option<&Path>,
    tokenizer: &Tokenizer,
    opts: &ChatOptions,
    seq_len: usize,
    seed: u64,
) -> AnyResult<ChatData> {
    let (tpl, source) = template(model_dir, opts.chat_template.as_deref(), tokenizer)?;
    report(&format!("chat template: {}{}", source.origin, if tpl.has_generation() { " (with {% generation %} blocks)" } else { "" }));
    let (mut train, stats) = examples(data, &tpl, tokenizer, opts, "data")?;
    let mut held_out = 0u64;
    let val = match &opts.val_data {
        Some(v) => {
            crate::run_dir::warn_val_is_data(data, v, "conversations");
            Some(examples(v, &tpl, tokenizer, opts, "validation data")?)
        }
        None if opts.val_fraction > 0.0 && train.len() > 1 => {
            let n = train.len();
            let k = ((opts.val_fraction * n as f64).round() as usize).clamp(1, n - 1);
            // The first k of a seeded permutation, kept in data order.
            let mut order = EpochOrder::new(n as u64, seed ^ 0x7661_6c5f_7370_6c74, "conversations")?;
            let mut held = vec![false; n];
            for _ in 0..k {
                held[order.next_item() as usize] = true;
            }
            let mut val = Vec::with_capacity(k);
            let mut kept = Vec::with_capacity(n - k);
            for (ex, h) in train.into_iter().zip(held) {
                if h {
                    val.push(ex)
                } else {
                    kept.push(ex)
                }
            }
            train = kept;
            held_out = k as u64;
            report(&format!("validation: {k} of {n} conversations held out (--val-fraction {})", opts.val_fraction));
            // The held-out conversations' own counts (none of them bad or untrained: those were
            // skipped before the split).
            let own = LoadStats { records: k as u64, examples: k as u64, ..LoadStats::default() };
            Some((val, own))
        }
        None if opts.val_fraction > 0.0 => {
            // One conversation left: it trains, and none is held out whatever the fraction.
            tracing::warn!(
                "--val-fraction {} holds out none of the {} conversation(s) of --data (one must train): no validation; \
                 give more data or --val-data",
                opts.val_fraction,
                train.len()
            );
            None
        }
        None => {
            report("validation: none (--val-fraction 0 and no --val-data)");
            None
        }
    };
    let pad_id = tokenizer.eos_id().unwrap_or(0);
    let packed = pack(train, &PackOptions { seq_len, pack: opts.pack, truncate: opts.truncate, pad_id })?;
    report(&format!("{}: {}", if opts.pack { "packed" } else { "unpacked (--no-pack)" }, packed.stats().summary()));
    let counts = ChatCounts::of(&stats, packed.stats(), held_out);
    tracing::info!("data {}: {}", data.display(), counts.summary("trained"));
    if packed.num_rows() == 0 {
        bail!(
            "no conversation fits --seq-len {seq_len}: {} dropped as longer (raise --seq-len, or pass --truncate)",
            packed.stats().dropped_too_long
        );
    }
    let (val, val_counts) = match val {
        Some((v, vstats)) => {
            let rows = one_a_row(v, seq_len, opts.truncate, pad_id)?;
            let c = ChatCounts::of(&vstats, rows.stats(), 0);
            let name = match &opts.val_data {
                Some(p) => format!("validation data {}", p.display()),
                None => format!("validation (held out of {})", data.display()),
            };
            tracing::info!("{name}: {}", c.summary("scored"));
            if rows.num_rows() == 0 {
                tracing::warn!(
                    "{name}: no conversation fits --seq-len {seq_len}: the run has no validation (raise --seq-len, or pass --truncate)"
                );
            }
            (Some(rows).filter(|v| v.num_rows() > 0), Some(c))
        }
        None => (None, None),
    };
    let sample_prompt = val.as_ref().and_then(|v| v.examples().first()).and_then(prompt_of);
    Ok(ChatData { train: packed, val, counts, val_counts, template: source, sample_prompt })
}

/// `examples` one a row (never packed), as validation and `eval --chat` score them; the
/// conversations dropped as longer than `seq_len`, and those cut, are in its stats.
fn one_a_row(examples: Vec<Example>, seq_len: usize, truncate: bool, pad_id: u32) -> AnyResult<PackedData> {
    Ok(pack(examples, &PackOptions { seq_len, pack: false, truncate, pad_id })?)
}

/// The conversations of `data` one a row, each to be scored alone (`eval --chat`): rendered with
/// the template of the first of `model_dirs` that has one (or `opts.chat_template`) and masked as fine-tuning masks them;
/// packing and the validation options of `opts` do not apply. Conversations longer than
/// `seq_len` are dropped (or truncated with `opts.truncate`); the counts, logged at info level,
/// say what became of every record. The template is searched in `model_dirs` in turn
/// ([`template_in`]: with `--lora`, the adapter's directory before the base's).
pub fn load_unpacked(
    data: &Path,
    model_dirs: &[&Path],
    tokenizer: &Tokenizer,
    opts: &ChatOptions,
    seq_len: usize,
) -> AnyResult<(PackedData, ChatCounts)> {
    let (tpl, source) = template_in(model_dirs, opts.chat_template.as_deref(), tokenizer)?;
    report(&format!("chat template: {}", source.origin));
    let (ex, stats) = examples(data, &tpl, tokenizer, opts, "data")?;
    let rows = one_a_row(ex, seq_len, opts.truncate, tokenizer.eos_id().unwrap_or(0))?;
    let counts = ChatCounts::of(&stats, rows.stats(), 0);
    tracing::info!("data {}: {}", data.display(), counts.summary("scored"));
    if rows.num_rows() == 0 {
        bail!(
            "{}: no conversation fits {seq_len} tokens: {} dropped as longer (raise --seq-len, or pass --truncate)",
            data.display(),
            counts.dropped
        );
    }
    Ok((rows, counts))
}

/// How [`show_examples`] marks the tokens the loss trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Marks {
    /// `[[` before and `]]` after each maximal run of trained tokens. A literal `[`, `]` or `\`
    /// of the text is written `\[`, `\]` and `\\`, so an unescaped `[[` or `]]` is always a marker.
    Brackets,
    /// Each run of trained tokens in bold green (ANSI escapes), the text as it is.
    Colour,
}

impl Marks {
    /// Colour when stdout is a terminal and `NO_COLOR` is unset or empty (no-color.org), else
    /// brackets.
    pub fn for_stdout() -> Marks {
        use std::io::IsTerminal;
        let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
        if std::io::stdout().is_terminal() && !no_color {
            Marks::Colour
        } else {
            Marks::Brackets
        }
    }
}

const GREEN: &str = "\x1b[1;32m";
const RESET: &str = "\x1b[0m";

/// Whether the loss trains token `i` of `ex`: `trained[i]`, save the first token, which no
/// position predicts (`Example::trained_targets` counts the same tokens).
fn is_trained(ex: &Example, i: usize) -> bool {
    i > 0 && ex.trained[i]
}

/// The text of `ex` with the tokens the loss trains marked as `marks` says, each maximal run of
/// trained (or untrained) tokens decoded at once (special tokens kept).
pub fn mark_trained(ex: &Example, tokenizer: &Tokenizer, marks: Marks) -> AnyResult<String> {
    let mut out = String::new();
    let mut i = 0;
    while i < ex.len() {
        let trained = is_trained(ex, i);
        let j = (i..ex.len()).find(|&j| is_trained(ex, j) != trained).unwrap_or(ex.len());
        let text = tokenizer.decode(&ex.ids[i..j])?;
        match marks {
            Marks::Colour if trained => out.push_str(&format!("{GREEN}{text}{RESET}")),
            Marks::Colour => out.push_str(&text),
            Marks::Brackets => {
                let escaped = text.replace('\\', "\\\\").replace('[', "\\[").replace(']', "\\]");
                if trained {
                    out.push_str(&format!("[[{escaped}]]"));
                } else {
                    out.push_str(&escaped);
                }
            }
        }
        i = j;
    }
    Ok(out)
}

/// `path:N` for a record at `line N …`, else `path at` (a Parquet row).
fn record_place(path: &Path, at: &str) -> String {
    match at.strip_prefix("line ").and_then(|r| r.split_whitespace().next()) {
        Some(n) => format!("{}:{n}", path.display()),
        None => format!("{} {at}", path.display()),
    }
}

/// What `--seq-len` (and `--truncate`) do to `ex`, as [`pack`] does it.
fn fate(ex: &Example, seq_len: usize, truncate: bool) -> String {
    if ex.len() <= seq_len {
        return format!("kept (fits --seq-len {seq_len})");
    }
    if !truncate {
        return format!("dropped: longer than --seq-len {seq_len} (--truncate would keep its first {seq_len} tokens)");
    }
    let kept = (1..seq_len).filter(|&i| is_trained(ex, i)).count();
    if kept == 0 {
        format!("dropped: its first {seq_len} tokens, all that --truncate keeps, hold no trained token")
    } else {
        format!("cut: --truncate keeps its first {seq_len} tokens (--seq-len), {kept} of them trained; the rest is not trained")
    }
}

/// `--show-example N`: the first `count` records of `data`, in file order, rendered with the
/// template found in `model_dirs` (or `opts.chat_template`; [`template_in`]) and masked as fine-tuning masks them, each
/// with its place (file:line, or Parquet row), its tokens, its trained tokens (marked in the
/// text as `marks` says) and what `seq_len` and `opts.truncate` do to it: kept, cut or dropped.
/// A conversation that trains no token, and a bad record, are shown as such. Only the tokenizer,
/// the template and the data are read.
pub fn show_examples(
    data: &Path,
    model_dirs: &[&Path],
    tokenizer: &Tokenizer,
    opts: &ChatOptions,
    seq_len: usize,
    count: usize,
    marks: Marks,
) -> AnyResult<String> {
    use std::fmt::Write;
    let (tpl, source) = template_in(model_dirs, opts.chat_template.as_deref(), tokenizer)?;
    let framing = crate::data::DocFraming::of(tokenizer)?;
    let inputs = resolve_inputs(data).with_context(|| format!("cannot read the data {}", data.display()))?;
    let mut out = format!("chat template: {}\n", source.origin);
    let mut shown = 0;
    'files: for file in &inputs {
        let mut reader = match chat::RecordReader::open(file) {
            Ok(r) => r,
            Err(e) if opts.skip_bad_records => {
                writeln!(out, "{}: skipped whole (--skip-bad-records)\n", e.into_error())?;
                continue;
            }
            Err(e) => return Err(e.into_error()).with_context(|| format!("cannot read the data {}", data.display())),
        };
        while shown < count {
            let (place, encoded) = match reader.next_record() {
                Ok(None) => continue 'files,
                Ok(Some((at, rec))) => {
                    let ex = chat::parse_record(&rec, opts.format)
                        .and_then(|s| chat::encode_sample(&s, Some(&tpl), tokenizer, &framing, opts.train_on));
                    (record_place(&file.path, &at), ex)
                }
                // The error names the file and the record itself.
                Err(crate::data::ReadError::Record(e)) => (String::new(), Err(e.to_string())),
                Err(crate::data::ReadError::Stream(e)) if opts.skip_bad_records => {
                    writeln!(out, "{e}: the rest of the file is skipped (--skip-bad-records)\n")?;
                    continue 'files;
                }
                Err(crate::data::ReadError::Stream(e)) => {
                    return Err(e).with_context(|| format!("cannot read the data {}", data.display()));
                }
            };
            shown += 1;
            match encoded {
                Err(msg) => {
                    let then = if opts.skip_bad_records {
                        "skipped (--skip-bad-records)"
                    } else {
                        "a run stops at this record (fine-tuning skips it with --skip-bad-records)"
                    };
                    let place = if place.is_empty() { String::new() } else { format!("{place}: ") };
                    writeln!(out, "example {shown} of {count}: {place}bad record: {msg}: {then}\n")?;
                }
                Ok(ex) => {
                    let trained = ex.trained_targets();
                    let what = if trained == 0 {
                        format!("skipped: --train-on {} trains no token of it", opts.train_on)
                    } else {
                        fate(&ex, seq_len, opts.truncate)
                    };
                    writeln!(out, "example {shown} of {count}: {place}: {} tokens, {trained} trained: {what}", ex.len())?;
                    writeln!(out, "{}\n", mark_trained(&ex, tokenizer, marks)?)?;
                }
            }
        }
        break;
    }
    let marked = match marks {
        Marks::Brackets => "trained tokens between [[ and ]]; a literal [, ] or \\ of the text is written \\[, \\] or \\\\",
        Marks::Colour => "trained tokens in green",
    };
    if shown < count {
        writeln!(out, "{}: {shown} records, all shown ({marked}); nothing trained (--show-example)", data.display())?;
    } else {
        writeln!(out, "the first {shown} records of {} shown ({marked}); nothing trained (--show-example)", data.display())?;
    }
    Ok(out)
}

/// The tokens of `ex` before its first trained token (the conversation so far and the
/// assistant's header), if it has one after at least one token.
fn prompt_of(ex: &Example) -> Option<Vec<u32>> {
    let first = ex.trained.iter().skip(1).position(|&t| t)? + 1;
    Some(ex.ids[..first].to_vec())
}

/// The ids generation stops at: `eos_token_id` of `generation_config.json` in `model_dir` (one id
/// or a list), else the model config's, else the tokenizer's EOS.
pub fn stop_ids(model_dir: &Path, cfg: &crate::nn::LlamaConfig, tokenizer: &Tokenizer) -> AnyResult<Vec<u32>> {
    let path = model_dir.join("generation_config.json");
    if path.is_file() {
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
        let ids = match v.get("eos_token_id") {
            Some(serde_json::Value::Number(n)) => n.as_u64().into_iter().collect(),
            Some(serde_json::Value::Array(a)) => a.iter().map(|x| x.as_u64()).collect::<Option<Vec<u64>>>().unwrap_or_default(),
            _ => Vec::new(),
        };
        if !ids.is_empty() {
            return ids.into_iter().map(|i| u32::try_from(i).with_context(|| format!("{}: eos_token_id {i}", path.display()))).collect();
        }
    }
    if !cfg.eos_token_id.is_empty() {
        return Ok(cfg.eos_token_id.clone());
    }
    Ok(tokenizer.eos_id().into_iter().collect())
}

/// The reply to `prompt` (a rendered conversation ending in the assistant's header): up to
/// `max_new` tokens, stopping at (and without) a `stop` id, each drawn as `sampling` says (the
/// tokenizer's ids only). The same on every tensor-parallel rank (the same seed).
pub fn reply(
    model: &crate::Llama,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    max_new: usize,
    sampling: &Sampling,
    stop: &[u32],
    rng: &mut crate::tensor::Rng,
) -> AnyResult<String> {
    let s = Sampling { vocab_limit: sampling.vocab_limit.min(tokenizer.vocab_size()), ..*sampling };
    let mut out = crate::nn::generate_until(model, prompt, max_new, &s, stop, rng)?;
    if out.last().is_some_and(|t| stop.contains(t)) {
        out.pop();
    }
    Ok(tokenizer.decode(&out)?)
}
