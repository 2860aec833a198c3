//! The tokenizing pass of `prepare`: inputs streamed by a reader thread in batches of about
//! `batch_bytes` of text, each batch encoded on every core, the ids appended to numbered *parts*
//! in the work directory (`OUT/.prepare/`). A part is a token shard plus a `.docs` file of
//! document end offsets (u64 LE); `journal.json` lists the finished parts and the input position
//! after them, so an interrupted run resumes at the last finished part and produces the same ids.
//!
//! Memory: two batches in the channel, one being encoded, and the writers' buffers, whatever
//! the size of the data set.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, SyncSender};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::framing::{encode_texts, DocFraming};
use crate::input::InputFile;
use crate::records::{DocReader, Piece, ReadError};
use crate::shard::{ShardWriter, TokenDtype};
use crate::tokenizer::Tokenizer;

/// Name of the work directory inside the output directory.
pub const WORK_DIR: &str = ".prepare";
const JOURNAL: &str = "journal.json";
const JOURNAL_VERSION: u32 = 1;
/// Skip messages kept for the report (all skips are counted).
pub(crate) const MAX_SKIP_EXAMPLES: usize = 20;

/// One finished part.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PartInfo {
    pub name: String,
    pub tokens: u64,
    pub documents: u64,
}

/// The tokenizing pass's state on disk.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Journal {
    pub version: u32,
    /// Hash of what determines the ids: tokenizer, framing, text field, input files.
    pub job: String,
    pub parts: Vec<PartInfo>,
    /// Input position after the last part: file index and records consumed in it.
    pub next_file: usize,
    pub next_record: u64,
    /// Input bytes consumed up to that position (for the progress bar of a resumed run).
    pub bytes_done: u64,
    pub documents: u64,
    pub tokens: u64,
    pub skipped_records: u64,
    pub skipped_examples: Vec<String>,
    /// Every input read: only the split and the final shards remain.
    pub done: bool,
}

impl Journal {
    pub(crate) fn new_for(job: String) -> Self {
        Journal {
            version: JOURNAL_VERSION,
            job,
            parts: Vec::new(),
            next_file: 0,
            next_record: 0,
            bytes_done: 0,
            documents: 0,
            tokens: 0,
            skipped_records: 0,
            skipped_examples: Vec::new(),
            done: false,
        }
    }

    /// The journal in `work` when it belongs to `job` and its parts are all there; else `None`.
    pub(crate) fn load(work: &Path, job: &str) -> Option<Self> {
        let text = std::fs::read_to_string(work.join(JOURNAL)).ok()?;
        let j: Journal = serde_json::from_str(&text).ok()?;
        let complete =
            j.parts.iter().all(|p| work.join(format!("{}.bin", p.name)).is_file() && work.join(format!("{}.docs", p.name)).is_file());
        (j.version == JOURNAL_VERSION && j.job == job && complete).then_some(j)
    }

    /// Written beside and renamed over the old one: a crash leaves the old or the new journal.
    pub(crate) fn save(&self, work: &Path) -> Result<()> {
        let (tmp, path) = (work.join(format!("{JOURNAL}.tmp")), work.join(JOURNAL));
        std::fs::write(&tmp, serde_json::to_string_pretty(self).expect("a journal serialises")).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))
    }
}

/// Where reading stands, for progress callbacks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrepareProgress {
    /// Input bytes consumed (compressed bytes for compressed files) and their total.
    pub bytes: u64,
    pub total_bytes: u64,
    pub documents: u64,
    pub tokens: u64,
    pub skipped_records: u64,
    /// Bytes, documents and tokens that a resumed run found already done.
    pub resumed_bytes: u64,
    pub resumed_documents: u64,
    pub resumed_tokens: u64,
}

/// Settings of the tokenizing pass.
pub(crate) struct TokenizePass<'a> {
    pub inputs: &'a [InputFile],
    pub tokenizer: &'a Tokenizer,
    pub framing: &'a DocFraming,
    pub text_field: &'a str,
    pub skip_bad_records: bool,
    pub dtype: TokenDtype,
    pub part_tokens: usize,
    pub batch_bytes: usize,
}

/// A part being written: token shard and document ends, both renamed into place by `finish`
/// (an unfinished part leaves nothing behind: see the `Drop`s).
struct PartWriter {
    name: String,
    shard: Option<ShardWriter>,
    docs_tmp: PathBuf,
    docs_path: PathBuf,
    docs: Option<BufWriter<File>>,
    documents: u64,
}

impl PartWriter {
    fn create(work: &Path, index: usize, dtype: TokenDtype) -> Result<Self> {
        let name = format!("part_{index:06}");
        let shard = ShardWriter::create(work.join(format!("{name}.bin")), dtype)?;
        let docs_path = work.join(format!("{name}.docs"));
        let docs_tmp = work.join(format!("{name}.docs.tmp"));
        let docs = BufWriter::new(File::create(&docs_tmp).map_err(|e| Error::io(&docs_tmp, e))?);
        Ok(PartWriter { name, shard: Some(shard), docs_tmp, docs_path, docs: Some(docs), documents: 0 })
    }

    fn write(&mut self, ids: &[u32]) -> Result<()> {
        self.shard.as_mut().expect("part finished").write(ids)
    }

    fn tokens(&self) -> u64 {
        self.shard.as_ref().map_or(0, ShardWriter::len)
    }

    fn end_document(&mut self) -> Result<()> {
        let end = self.tokens();
        let docs = self.docs.as_mut().expect("part finished");
        docs.write_all(&end.to_le_bytes()).map_err(|e| Error::io(&self.docs_tmp, e))?;
        self.documents += 1;
        Ok(())
    }

    fn finish(mut self) -> Result<PartInfo> {
        let docs = self.docs.take().expect("part finished twice");
        let file = docs.into_inner().map_err(|e| Error::io(&self.docs_tmp, e.into_error()))?;
        file.sync_all().map_err(|e| Error::io(&self.docs_tmp, e))?;
        std::fs::rename(&self.docs_tmp, &self.docs_path).map_err(|e| Error::io(&self.docs_path, e))?;
        let tokens = self.shard.take().expect("part finished twice").finish()?;
        Ok(PartInfo { name: std::mem::take(&mut self.name), tokens, documents: self.documents })
    }
}

impl Drop for PartWriter {
    fn drop(&mut self) {
        if self.docs.take().is_some() {
            let _ = std::fs::remove_file(&self.docs_tmp);
        }
    }
}

/// What the reader thread sends: text to encode, and where reading stands after it.
struct ReadBatch {
    pieces: Vec<Piece>,
    next_file: usize,
    next_record: u64,
    /// No document is open at that position, so a part may end (and a run resume) there.
    at_boundary: bool,
    bytes_done: u64,
    skipped: Vec<String>,
    skipped_count: u64,
}

/// Reads every input from the journal's position, sending batches; an error ends the stream.
#[allow(clippy::too_many_arguments)]
fn read_inputs(
    inputs: Vec<InputFile>,
    start: (usize, u64),
    text_field: String,
    skip_bad: bool,
    batch_bytes: usize,
    tx: SyncSender<Result<ReadBatch>>,
) {
    let mut done_before: u64 = inputs[..start.0.min(inputs.len())].iter().map(|f| f.bytes).sum();
    let fresh = |file: usize, record: u64, bytes: u64| ReadBatch {
        pieces: Vec::new(),
        next_file: file,
        next_record: record,
        at_boundary: true,
        bytes_done: bytes,
        skipped: Vec::new(),
        skipped_count: 0,
    };
    let mut batch = fresh(start.0, start.1, done_before);
    let mut text_bytes = 0usize;
    let skip = |b: &mut ReadBatch, msg: String| {
        b.skipped_count += 1;
        if b.skipped.len() < MAX_SKIP_EXAMPLES {
            b.skipped.push(msg);
        }
    };
    for (fi, file) in inputs.iter().enumerate().skip(start.0) {
        let mut reader = match DocReader::open(file, &text_field) {
            Ok(r) => Some(r),
            Err(ReadError::Stream(e) | ReadError::Record(e)) if skip_bad => {
                skip(&mut batch, format!("{e} (the whole file is skipped)"));
                None
            }
            Err(e) => return drop(tx.send(Err(e.into_error()))),
        };
        if let Some(r) = reader.as_mut().filter(|_| fi == start.0 && start.1 > 0) {
            // Resuming inside this file: pass the records already in finished parts.
            while r.records() < start.1 {
                match r.next_piece() {
                    Ok(Some(_)) | Err(ReadError::Record(_)) => {}
                    Ok(None) | Err(ReadError::Stream(_)) => {
                        let msg = format!("has fewer records than the interrupted run read ({}): it changed", start.1);
                        return drop(tx.send(Err(Error::format(&file.path, msg))));
                    }
                }
            }
        }
        let mut mid_doc = false;
        while let Some(r) = reader.as_mut() {
            match r.next_piece() {
                Ok(Some(p)) => {
                    text_bytes += p.text.len();
                    mid_doc = !p.doc_end;
                    batch.pieces.push(p);
                }
                Ok(None) => break,
                Err(ReadError::Record(e)) if skip_bad => skip(&mut batch, e.to_string()),
                Err(ReadError::Stream(e)) if skip_bad => {
                    skip(&mut batch, format!("{e} (the rest of the file is skipped)"));
                    if mid_doc {
                        // End the document read so far, so the next one does not run into it.
                        batch.pieces.push(Piece { text: String::new(), doc_end: true });
                    }
                    break;
                }
                Err(e) => return drop(tx.send(Err(e.into_error()))),
            }
            if text_bytes >= batch_bytes {
                batch.next_file = fi;
                batch.next_record = r.records();
                batch.at_boundary = !mid_doc;
                batch.bytes_done = done_before + r.bytes_read();
                let full = std::mem::replace(&mut batch, fresh(fi, r.records(), done_before + r.bytes_read()));
                text_bytes = 0;
                if tx.send(Ok(full)).is_err() {
                    return; // the receiver stopped (interrupted or failed)
                }
            }
        }
        done_before += file.bytes;
        (batch.next_file, batch.next_record, batch.at_boundary, batch.bytes_done) = (fi + 1, 0, true, done_before);
    }
    let _ = tx.send(Ok(batch));
}

impl TokenizePass<'_> {
    /// Runs (or resumes) the pass in `work`, updating `journal` as parts finish. `on_progress`
    /// returning `Break` stops it with [`Error::Interrupted`] after the last finished part.
    pub(crate) fn run(
        &self,
        work: &Path,
        journal: &mut Journal,
        on_progress: &mut dyn FnMut(&PrepareProgress) -> ControlFlow<()>,
    ) -> Result<()> {
        let total_bytes = self.inputs.iter().map(|f| f.bytes).sum();
        let mut progress = PrepareProgress {
            bytes: journal.bytes_done,
            total_bytes,
            documents: journal.documents,
            tokens: journal.tokens,
            skipped_records: journal.skipped_records,
            resumed_bytes: journal.bytes_done,
            resumed_documents: journal.documents,
            resumed_tokens: journal.tokens,
        };
        if on_progress(&progress).is_break() {
            return Err(Error::Interrupted);
        }
        let (tx, rx) = sync_channel::<Result<ReadBatch>>(2);
        let (inputs, field) = (self.inputs.to_vec(), self.text_field.to_string());
        let (start, skip, batch_bytes) = ((journal.next_file, journal.next_record), self.skip_bad_records, self.batch_bytes);
        let reader = std::thread::Builder::new()
            .name("prepare-read".into())
            .spawn(move || read_inputs(inputs, start, field, skip, batch_bytes, tx))
            .map_err(|e| Error::invalid(format!("cannot start the reader thread: {e}")))?;
        let result = self.consume(work, journal, &mut progress, rx, on_progress);
        // The channel is closed by now (consumed or dropped), so the reader has returned or
        // returns at its next send.
        if reader.join().is_err() && result.is_ok() {
            return Err(Error::invalid("the input reader thread panicked"));
        }
        result
    }

    fn consume(
        &self,
        work: &Path,
        journal: &mut Journal,
        progress: &mut PrepareProgress,
        rx: std::sync::mpsc::Receiver<Result<ReadBatch>>,
        on_progress: &mut dyn FnMut(&PrepareProgress) -> ControlFlow<()>,
    ) -> Result<()> {
        let mut part: Option<PartWriter> = None;
        let mut in_doc = false;
        // Counts of the open part, added to the journal when it finishes.
        let (mut part_docs, mut part_skipped, mut part_examples) = (0u64, 0u64, Vec::new());
        for batch in rx {
            let batch = batch?;
            let texts: Vec<&str> = batch.pieces.iter().map(|p| p.text.as_str()).collect();
            let ids = encode_texts(self.tokenizer, &texts)?;
            for (piece, ids) in batch.pieces.iter().zip(ids) {
                let w = match part.as_mut() {
                    Some(w) => w,
                    None => part.insert(PartWriter::create(work, journal.parts.len(), self.dtype)?),
                };
                if !in_doc {
                    w.write(&self.framing.prefix)?;
                    in_doc = true;
                }
                w.write(&ids)?;
                if piece.doc_end {
                    w.write(&self.framing.suffix)?;
                    w.end_document()?;
                    in_doc = false;
                    part_docs += 1;
                }
            }
            part_skipped += batch.skipped_count;
            let room = MAX_SKIP_EXAMPLES.saturating_sub(part_examples.len());
            part_examples.extend(batch.skipped.iter().take(room).cloned());
            let open_tokens = part.as_ref().map_or(0, PartWriter::tokens);
            progress.bytes = batch.bytes_done;
            progress.documents = journal.documents + part_docs;
            progress.tokens = journal.tokens + open_tokens;
            progress.skipped_records = journal.skipped_records + part_skipped;
            if batch.at_boundary && open_tokens >= self.part_tokens as u64 {
                let w = part.take().expect("a part with tokens is open");
                self.close_part(w, journal, &batch, (&mut part_docs, &mut part_skipped, &mut part_examples), work)?;
            }
            if on_progress(progress).is_break() {
                return Err(Error::Interrupted);
            }
            if batch.next_file >= self.inputs.len() {
                // The last batch: everything has been read.
                match part.take() {
                    Some(w) => self.close_part(w, journal, &batch, (&mut part_docs, &mut part_skipped, &mut part_examples), work)?,
                    None => {
                        (journal.next_file, journal.next_record, journal.bytes_done) = (batch.next_file, 0, batch.bytes_done);
                        journal.skipped_records += std::mem::take(&mut part_skipped);
                        absorb_examples(journal, &mut part_examples);
                    }
                }
                journal.done = true;
                journal.save(work)?;
                return Ok(());
            }
        }
        Err(Error::invalid("the input reader stopped before the end of the inputs"))
    }

    fn close_part(
        &self,
        w: PartWriter,
        journal: &mut Journal,
        at: &ReadBatch,
        open: (&mut u64, &mut u64, &mut Vec<String>),
        work: &Path,
    ) -> Result<()> {
        let info = w.finish()?;
        journal.tokens += info.tokens;
        journal.documents += std::mem::take(open.0);
        journal.skipped_records += std::mem::take(open.1);
        absorb_examples(journal, open.2);
        journal.parts.push(info);
        (journal.next_file, journal.next_record, journal.bytes_done) = (at.next_file, at.next_record, at.bytes_done);
        journal.save(work)
    }
}

fn absorb_examples(journal: &mut Journal, examples: &mut Vec<String>) {
    let room = MAX_SKIP_EXAMPLES.saturating_sub(journal.skipped_examples.len());
    journal.skipped_examples.extend(examples.drain(..).take(room));
}
