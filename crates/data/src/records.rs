//! Documents out of input files, one at a time and in bounded memory.
//!
//! A UTF-8 byte order mark at the start of a text, JSON Lines or `.json` file is skipped (its
//! bytes still count in byte offsets). A `.json` file is a JSON array of records, read one
//! element at a time (`record N`, counted from 0 as the array's index), or, when it starts with
//! `{`, JSON Lines under a `.json` name.
//!
//! A [`DocReader`] yields [`Piece`]s: a whole document, except for long text files, which come
//! in pieces of about [`PIECE_BYTES`] cut where the tokenizer's pre-tokenizer would cut anyway
//! (see [`safe_cut`]). Errors say where: the file, then `line N` (JSON Lines, 1-based), `row N`
//! (Parquet, 0-based) or `byte offset N`, and the field. A [`ReadError::Record`] spoils one
//! record and the reader can go on (`--skip-bad-records`); a [`ReadError::Stream`] ends the file
//! (a truncated gzip or zstd stream, a corrupt Parquet footer).

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::error::Error;
use crate::input::{Compression, InputFile, InputFormat};
use crate::parquet_reader::ParquetReader;

/// Target size of one piece of a long document (text is read, and long documents are encoded,
/// in pieces of about this size: bounded memory, and parallel work inside one document).
pub const PIECE_BYTES: usize = 1 << 20;
/// The longest JSON line (and Parquet value) accepted: a longer one is a bad record, so a
/// corrupt stream with no line breaks cannot make the reader allocate without bound.
pub const MAX_RECORD_BYTES: usize = 64 << 20;

/// Text of one document, or of one piece of it (`doc_end` on its last piece).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub text: String,
    pub doc_end: bool,
}

/// Why a read failed; see the module docs.
#[derive(Debug)]
pub enum ReadError {
    /// This record cannot be a document; the next one can still be read.
    Record(Error),
    /// The rest of the file cannot be read.
    Stream(Error),
}

impl ReadError {
    pub fn into_error(self) -> Error {
        match self {
            ReadError::Record(e) | ReadError::Stream(e) => e,
        }
    }
}

/// Reads the documents of one input file.
pub struct DocReader {
    inner: Inner,
    records: u64,
}

enum Inner {
    Text(TextReader),
    Jsonl(JsonlReader),
    Parquet(Box<ParquetReader>),
}

impl DocReader {
    /// Opens `file`; `text_field` names the JSON field or Parquet column holding the text. A
    /// Parquet file whose footer or schema is unusable fails here.
    pub fn open(file: &InputFile, text_field: &str) -> Result<Self, ReadError> {
        let inner = match file.format {
            InputFormat::Text => Inner::Text(TextReader::open(&file.path).map_err(ReadError::Stream)?),
            InputFormat::Jsonl(c) => Inner::Jsonl(JsonlReader::open(&file.path, c, text_field).map_err(ReadError::Stream)?),
            InputFormat::Json => Inner::Jsonl(JsonlReader::open_json(&file.path, text_field).map_err(ReadError::Stream)?),
            InputFormat::Parquet => Inner::Parquet(Box::new(ParquetReader::open(&file.path, file.bytes, text_field)?)),
        };
        Ok(DocReader { inner, records: 0 })
    }

    /// The next piece, `Ok(None)` at the end of the file.
    pub fn next_piece(&mut self) -> Result<Option<Piece>, ReadError> {
        let r = match &mut self.inner {
            Inner::Text(t) => t.next(),
            Inner::Jsonl(j) => j.next(),
            Inner::Parquet(p) => p.next(),
        };
        match &r {
            Ok(Some(p)) if p.doc_end => self.records += 1,
            Err(ReadError::Record(_)) => self.records += 1,
            _ => {}
        }
        r
    }

    /// Records consumed so far: whole documents and bad records (the resume position).
    pub fn records(&self) -> u64 {
        self.records
    }

    /// Bytes of the file consumed so far (compressed bytes for compressed files), for progress.
    pub fn bytes_read(&self) -> u64 {
        match &self.inner {
            Inner::Text(t) => t.offset,
            Inner::Jsonl(j) => j.compressed.load(Ordering::Relaxed),
            Inner::Parquet(p) => p.bytes_read(),
        }
    }
}

/// Where a long text may be cut without changing its tokens: after a line break that is followed
/// by a character other than white space. Byte-level BPE pre-tokenizers (GPT-2, Llama 3 and
/// ferrolm's) always split there, so encoding the pieces apart gives the same ids; tokenizers
/// that prepend a word marker to every input (SentencePiece-style Metaspace) differ by one token
/// per cut, which happens only inside documents longer than [`PIECE_BYTES`]. Returns the cut
/// nearest below `target` (else the first above it), never 0 or `buf.len()`.
pub fn safe_cut(buf: &[u8], target: usize) -> Option<usize> {
    let ok = |i: usize| buf[i - 1] == b'\n' && !buf[i].is_ascii_whitespace() && (buf[i] & 0xC0) != 0x80;
    let top = target.min(buf.len().saturating_sub(1));
    (1..=top).rev().find(|&i| ok(i)).or_else(|| (top + 1..buf.len()).find(|&i| ok(i)))
}

/// A cut for text with no line breaks to cut at: the last start of a word, else the last
/// character boundary (tokens near it may differ from an uncut encoding; memory stays bounded).
fn fallback_cut(buf: &[u8]) -> usize {
    let boundary = |i: usize| (buf[i] & 0xC0) != 0x80;
    (1..buf.len())
        .rev()
        .find(|&i| buf[i - 1].is_ascii_whitespace() && !buf[i].is_ascii_whitespace() && boundary(i))
        .or_else(|| (1..buf.len()).rev().find(|&i| boundary(i)))
        .unwrap_or(buf.len())
}

/// A text file: one document, read in pieces. The file is checked for UTF-8 once before its
/// first piece is returned, so a bad byte spoils the document before any of it is used.
struct TextReader {
    path: PathBuf,
    file: std::fs::File,
    pending: Vec<u8>,
    /// File offset of the end of `pending` minus its length: bytes already returned.
    offset: u64,
    state: TextState,
}

#[derive(PartialEq)]
enum TextState {
    Unchecked,
    Reading { eof: bool },
    Done,
}

impl TextReader {
    fn open(path: &Path) -> crate::Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        Ok(TextReader { path: path.to_path_buf(), file, pending: Vec::new(), offset: 0, state: TextState::Unchecked })
    }

    /// The byte offset of the first invalid UTF-8 sequence, if any (streamed: 1 MiB at a time).
    fn find_bad_utf8(&mut self) -> crate::Result<Option<u64>> {
        let mut reader = BufReader::with_capacity(1 << 20, &self.file);
        let (mut carry, mut base) = (Vec::<u8>::new(), 0u64);
        loop {
            let chunk = reader.fill_buf().map_err(|e| Error::io(&self.path, e))?;
            let eof = chunk.is_empty();
            carry.extend_from_slice(chunk);
            let n = chunk.len();
            reader.consume(n);
            match std::str::from_utf8(&carry) {
                Ok(_) => {
                    base += carry.len() as u64;
                    carry.clear();
                }
                Err(e) if e.error_len().is_none() && !eof => {
                    // An incomplete sequence at the end of this chunk: keep it for the next.
                    let keep = carry.split_off(e.valid_up_to());
                    base += carry.len() as u64;
                    carry = keep;
                }
                Err(e) => return Ok(Some(base + e.valid_up_to() as u64)),
            }
            if eof {
                return Ok(None);
            }
        }
    }

    fn next(&mut self) -> Result<Option<Piece>, ReadError> {
        let stream = |e| ReadError::Stream(e);
        if self.state == TextState::Unchecked {
            if let Some(at) = self.find_bad_utf8().map_err(stream)? {
                self.state = TextState::Done;
                return Err(ReadError::Record(Error::record(
                    &self.path,
                    format!("byte offset {at}"),
                    "invalid UTF-8 (text files must be UTF-8)",
                )));
            }
            use std::io::Seek;
            // A byte order mark is not text: skip it (offsets still count its bytes).
            let mut head = [0u8; 3];
            self.file.seek(std::io::SeekFrom::Start(0)).map_err(|e| stream(Error::io(&self.path, e)))?;
            let n = (&self.file).take(3).read(&mut head).map_err(|e| stream(Error::io(&self.path, e)))?;
            let skip = if n == 3 && head == BOM { 3 } else { 0 };
            self.file.seek(std::io::SeekFrom::Start(skip)).map_err(|e| stream(Error::io(&self.path, e)))?;
            self.offset = skip;
            self.state = TextState::Reading { eof: false };
        }
        let TextState::Reading { mut eof } = self.state else { return Ok(None) };
        loop {
            if !eof && self.pending.len() < PIECE_BYTES + 1 {
                let want = PIECE_BYTES + 1 - self.pending.len();
                let got = (&self.file).take(want as u64).read_to_end(&mut self.pending).map_err(|e| stream(Error::io(&self.path, e)))?;
                eof = got < want;
                continue;
            }
            // The same cuts as `framing::pieces` makes in a document held whole.
            let len = self.pending.len();
            let cut = match safe_cut(&self.pending, PIECE_BYTES).filter(|_| len > PIECE_BYTES) {
                Some(c) => Some(c),
                None if eof => Some(len),
                None if len >= 4 * PIECE_BYTES => Some(fallback_cut(&self.pending)),
                None => None,
            };
            let Some(cut) = cut else {
                // No cut yet: read up to four pieces' worth before falling back.
                let got =
                    (&self.file).take(PIECE_BYTES as u64).read_to_end(&mut self.pending).map_err(|e| stream(Error::io(&self.path, e)))?;
                eof = got < PIECE_BYTES;
                continue;
            };
            let rest = self.pending.split_off(cut);
            let bytes = std::mem::replace(&mut self.pending, rest);
            self.offset += bytes.len() as u64;
            let doc_end = eof && self.pending.is_empty();
            self.state = if doc_end { TextState::Done } else { TextState::Reading { eof } };
            let text = String::from_utf8(bytes).map_err(|_| {
                stream(Error::record(&self.path, format!("byte offset {}", self.offset), "the file changed while it was read"))
            })?;
            return Ok(Some(Piece { text, doc_end }));
        }
    }
}

/// The UTF-8 byte order mark.
const BOM: [u8; 3] = [0xEF, 0xBB, 0xBF];

/// Counts the bytes read through it (the compressed position, for progress).
struct CountingReader<R> {
    inner: R,
    count: Arc<AtomicU64>,
}

impl<R: Read> Read for CountingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// JSON Lines, plain or compressed: one object per line, the text in `field`. Blank lines are
/// not records. Also a `.json` file: a JSON array of records (see [`JsonlReader::open_json`]).
pub(crate) struct JsonlReader {
    path: PathBuf,
    what: &'static str,
    lines: BufReader<Box<dyn Read + Send>>,
    compressed: Arc<AtomicU64>,
    buf: Vec<u8>,
    line: u64,
    /// Bytes of the (decompressed) stream before the current line.
    decoded: u64,
    field: String,
    layout: Layout,
}

/// How the records lie in the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// One per line.
    Lines,
    /// A `.json` file starting with `{`: JSON Lines under another name.
    JsonLines,
    /// A `.json` file holding an array, at this point of it.
    Array(ArrayAt),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ArrayAt {
    /// Before the `[`.
    Start,
    /// After the `[` or a `,`: a record is next (or, after the `[`, the `]`).
    First,
    /// After a record: a `,` or the `]` is next.
    AfterRecord,
    /// After the `]`: only white space may follow.
    Closed,
    Done,
}

/// What to do with one byte of an array's record (see [`JsonlReader::scan_record`]).
#[derive(Default)]
struct Scan {
    depth: u32,
    in_string: bool,
    escaped: bool,
}

impl Scan {
    /// Whether the record ends before `b` (`Some(false)`), with it (`Some(true)`), or goes on.
    fn step(&mut self, b: u8, empty: bool) -> Option<bool> {
        if self.in_string {
            if self.escaped {
                self.escaped = false;
            } else if b == b'\\' {
                self.escaped = true;
            } else if b == b'"' {
                self.in_string = false;
                if self.depth == 0 {
                    return Some(true);
                }
            }
            return None;
        }
        match b {
            b'"' => self.in_string = true,
            b'{' | b'[' => self.depth += 1,
            b'}' | b']' if self.depth == 0 => return Some(false),
            b'}' | b']' => {
                self.depth -= 1;
                if self.depth == 0 {
                    return Some(true);
                }
            }
            b',' if self.depth == 0 => return Some(false),
            b' ' | b'\t' | b'\n' | b'\r' if self.depth == 0 && !empty => return Some(false),
            _ => {}
        }
        None
    }
}

impl JsonlReader {
    pub(crate) fn open(path: &Path, compression: Compression, field: &str) -> crate::Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let compressed = Arc::new(AtomicU64::new(0));
        let counted = CountingReader { inner: file, count: compressed.clone() };
        let (stream, what): (Box<dyn Read + Send>, _) = match compression {
            Compression::None => (Box::new(counted), "JSON Lines"),
            // Multi-member: `cat a.gz b.gz` is a valid gzip file of both.
            Compression::Gzip => (Box::new(flate2::read::MultiGzDecoder::new(BufReader::new(counted))), "gzip"),
            Compression::Zstd => {
                let d = zstd::stream::read::Decoder::new(counted).map_err(|e| Error::io(path, e))?;
                (Box::new(d), "zstd")
            }
        };
        Ok(JsonlReader {
            path: path.to_path_buf(),
            what,
            lines: BufReader::with_capacity(1 << 20, stream),
            compressed,
            buf: Vec::new(),
            line: 0,
            decoded: 0,
            field: field.to_string(),
            layout: Layout::Lines,
        })
    }

    /// A `.json` file: a JSON array of records, read one element at a time in bounded memory,
    /// or, when its first character (after a byte order mark and white space) is `{`, JSON Lines.
    pub(crate) fn open_json(path: &Path, field: &str) -> crate::Result<Self> {
        let mut r = Self::open(path, Compression::None, field)?;
        r.layout = r.sniff_json().map_err(ReadError::into_error)?;
        Ok(r)
    }

    /// The next record's JSON text and where it is: a line (`line N (byte offset M)`), or an
    /// element of a `.json` file's array (`record N (byte offset M)`).
    pub(crate) fn next_json(&mut self) -> Result<Option<(String, &str)>, ReadError> {
        match self.layout {
            Layout::Array(_) => self.next_element(),
            _ => self.next_line(),
        }
    }

    /// Added to a line's parse error in a `.json` file read as JSON Lines: what such a file may be.
    pub(crate) fn hint(&self) -> &'static str {
        if self.layout == Layout::JsonLines {
            " (a .json file holds a JSON array of records, or, when it starts with `{`, one JSON object per line)"
        } else {
            ""
        }
    }

    /// Looks at the first character of a `.json` file (without consuming anything): the
    /// first buffer's worth decides (a file of only white space there is read as an array).
    fn sniff_json(&mut self) -> Result<Layout, ReadError> {
        let buf = match self.lines.fill_buf() {
            Ok(b) => b,
            Err(e) => return Err(self.stream_error(e)),
        };
        let body = buf.strip_prefix(&BOM[..]).unwrap_or(buf);
        Ok(match body.iter().find(|b| !b.is_ascii_whitespace()) {
            Some(b'{') => Layout::JsonLines,
            _ => Layout::Array(ArrayAt::Start),
        })
    }

    /// Skips white space (and, at the start, a byte order mark); the next byte, not consumed,
    /// `None` at the end.
    fn peek_past_space(&mut self) -> Result<Option<u8>, ReadError> {
        loop {
            let at_start = self.decoded == 0;
            let buf = match self.lines.fill_buf() {
                Ok(b) => b,
                Err(e) => return Err(self.stream_error(e)),
            };
            if buf.is_empty() {
                return Ok(None);
            }
            let bom = if at_start && buf.starts_with(&BOM) { BOM.len() } else { 0 };
            let space = buf[bom..].iter().take_while(|b| b.is_ascii_whitespace()).count();
            let next = buf.get(bom + space).copied();
            let used = bom + space;
            self.lines.consume(used);
            self.decoded += used as u64;
            if next.is_some() {
                return Ok(next);
            }
        }
    }

    fn consume_byte(&mut self) {
        self.lines.consume(1);
        self.decoded += 1;
    }

    fn array_error(&self, msg: String) -> ReadError {
        ReadError::Stream(Error::record(&self.path, format!("byte offset {}", self.decoded), msg))
    }

    /// The next element of the array: its text and `record N (byte offset M)`. A record over
    /// [`MAX_RECORD_BYTES`] or not UTF-8 is a bad record; a file that is no array, or ends
    /// inside one, is a stream error.
    fn next_element(&mut self) -> Result<Option<(String, &str)>, ReadError> {
        let Layout::Array(mut at) = self.layout else { return Ok(None) };
        loop {
            let next = self.peek_past_space()?;
            match (at, next) {
                (ArrayAt::Done, _) | (ArrayAt::Closed, None) => {
                    self.layout = Layout::Array(ArrayAt::Done);
                    return Ok(None);
                }
                (ArrayAt::Start, None) => {
                    self.layout = Layout::Array(ArrayAt::Done);
                    return Ok(None);
                }
                (ArrayAt::Start, Some(b'[')) => {
                    self.consume_byte();
                    at = ArrayAt::First;
                }
                (ArrayAt::Start, Some(b)) => {
                    self.layout = Layout::Array(ArrayAt::Done);
                    return Err(self.array_error(format!(
                        "a .json file of records must hold a JSON array of them (`[{{...}}, {{...}}]`), \
                         or one JSON object per line; this one starts with {}",
                        shown_byte(b)
                    )));
                }
                (ArrayAt::First, Some(b']')) | (ArrayAt::AfterRecord, Some(b']')) => {
                    self.consume_byte();
                    at = ArrayAt::Closed;
                }
                (ArrayAt::AfterRecord, Some(b',')) => {
                    self.consume_byte();
                    at = ArrayAt::First;
                    // `[1,]`: a trailing comma is not JSON.
                    if self.peek_past_space()? == Some(b']') {
                        self.layout = Layout::Array(ArrayAt::Done);
                        return Err(self.array_error(format!(
                            "a `,` after record {} and then the `]` (a trailing comma is not JSON)",
                            self.line.saturating_sub(1)
                        )));
                    }
                }
                (ArrayAt::First, Some(_)) => {
                    self.layout = Layout::Array(ArrayAt::AfterRecord);
                    return self.scan_record();
                }
                (ArrayAt::First, None) | (ArrayAt::AfterRecord, None) => {
                    self.layout = Layout::Array(ArrayAt::Done);
                    return Err(self.array_error(format!(
                        "the file ends inside the JSON array, after {} record(s), before its `]` (truncated?)",
                        self.line
                    )));
                }
                (ArrayAt::AfterRecord, Some(b)) => {
                    self.layout = Layout::Array(ArrayAt::Done);
                    return Err(self.array_error(format!(
                        "expected `,` or `]` after record {}, found {}",
                        self.line.saturating_sub(1),
                        shown_byte(b)
                    )));
                }
                (ArrayAt::Closed, Some(b)) => {
                    self.layout = Layout::Array(ArrayAt::Done);
                    return Err(self.array_error(format!("text after the JSON array's closing `]`: {}", shown_byte(b))));
                }
            }
            self.layout = Layout::Array(at);
        }
    }

    /// Reads one element of the array (its first byte is next), in bounded memory.
    fn scan_record(&mut self) -> Result<Option<(String, &str)>, ReadError> {
        let index = self.line;
        self.line += 1;
        let start = self.decoded;
        let at = format!("record {index} (byte offset {start})");
        self.buf.clear();
        let (mut scan, mut kept, mut total) = (Scan::default(), true, 0usize);
        loop {
            let chunk = match self.lines.fill_buf() {
                Ok(b) => b,
                Err(e) => return Err(self.stream_error(e)),
            };
            if chunk.is_empty() {
                self.layout = Layout::Array(ArrayAt::Done);
                return Err(self.array_error(format!("the file ends inside record {index} (truncated?)")));
            }
            let mut end = None;
            for (i, &b) in chunk.iter().enumerate() {
                if let Some(with) = scan.step(b, total + i == 0) {
                    end = Some(i + usize::from(with));
                    break;
                }
            }
            let used = end.unwrap_or(chunk.len());
            if kept && self.buf.len() + used <= MAX_RECORD_BYTES {
                self.buf.extend_from_slice(&chunk[..used]);
            } else {
                kept = false;
                self.buf.clear();
            }
            total += used;
            self.lines.consume(used);
            self.decoded += used as u64;
            if end.is_some() {
                break;
            }
        }
        if !kept {
            let msg = format!("record {index} is longer than {} MiB", MAX_RECORD_BYTES >> 20);
            return Err(ReadError::Record(Error::record(&self.path, at, msg)));
        }
        if self.buf.is_empty() {
            return Err(ReadError::Record(Error::record(&self.path, at, "an empty record (two `,` in a row, or `[,`?)")));
        }
        match std::str::from_utf8(&self.buf) {
            Ok(text) => Ok(Some((at, text))),
            Err(e) => {
                let k = e.valid_up_to();
                let msg = format!("invalid UTF-8 at byte {k} of the record (byte offset {})", start + k as u64);
                Err(ReadError::Record(Error::record(&self.path, at, msg)))
            }
        }
    }

    fn stream_error(&self, e: std::io::Error) -> ReadError {
        let (at, msg) = match self.what {
            "JSON Lines" => (format!("line {} (byte offset {})", self.line + 1, self.decoded), format!("read error: {e}")),
            what => (
                format!("line {} (decompressed byte offset {})", self.line + 1, self.decoded),
                format!("truncated or corrupt {what} stream: {e}"),
            ),
        };
        ReadError::Stream(Error::record(&self.path, at, msg))
    }

    fn next(&mut self) -> Result<Option<Piece>, ReadError> {
        let (path, field, hint) = (self.path.clone(), self.field.clone(), self.hint());
        let Some((at, line)) = self.next_json()? else { return Ok(None) };
        match text_field(line, &field) {
            Ok(text) => Ok(Some(Piece { text, doc_end: true })),
            Err(msg) => Err(ReadError::Record(Error::record(&path, at, format!("{msg}{hint}")))),
        }
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes of the file consumed so far (compressed bytes for compressed files).
    pub(crate) fn bytes_read(&self) -> u64 {
        self.compressed.load(Ordering::Relaxed)
    }

    /// The next line that is not blank, and where it is (`line N (byte offset M)`); a line over
    /// [`MAX_RECORD_BYTES`] or not UTF-8 is a bad record.
    pub(crate) fn next_line(&mut self) -> Result<Option<(String, &str)>, ReadError> {
        loop {
            self.buf.clear();
            let limit = MAX_RECORD_BYTES as u64 + 1;
            let n = match (&mut self.lines).take(limit).read_until(b'\n', &mut self.buf) {
                Ok(n) => n,
                Err(e) => return Err(self.stream_error(e)),
            };
            if n == 0 {
                return Ok(None);
            }
            self.line += 1;
            let start = self.decoded;
            self.decoded += n as u64;
            let at = format!("line {} (byte offset {start})", self.line);
            if self.buf.len() > MAX_RECORD_BYTES && self.buf.last() != Some(&b'\n') {
                self.discard_rest_of_line()?;
                let msg = format!("longer than {} MiB: not a JSON Lines record (a corrupt stream?)", MAX_RECORD_BYTES >> 20);
                return Err(ReadError::Record(Error::record(&self.path, at, msg)));
            }
            while self.buf.last().is_some_and(|&b| b == b'\n' || b == b'\r') {
                self.buf.pop();
            }
            // A byte order mark is dropped, but its bytes still count in byte offsets.
            let bom = if start == 0 && self.buf.starts_with(&BOM) { BOM.len() } else { 0 };
            self.buf.drain(..bom);
            if self.buf.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            return match std::str::from_utf8(&self.buf) {
                Ok(line) => Ok(Some((at, line))),
                Err(e) => {
                    let k = e.valid_up_to();
                    let msg = format!("invalid UTF-8 at byte {} of the line (byte offset {})", bom + k, start + (bom + k) as u64);
                    Err(ReadError::Record(Error::record(&self.path, format!("line {}", self.line), msg)))
                }
            };
        }
    }

    /// Skips to just after the next line break (or the end), in bounded memory.
    fn discard_rest_of_line(&mut self) -> Result<(), ReadError> {
        loop {
            let (used, done) = match self.lines.fill_buf() {
                Ok([]) => return Ok(()),
                Ok(buf) => match buf.iter().position(|&b| b == b'\n') {
                    Some(i) => (i + 1, true),
                    None => (buf.len(), false),
                },
                Err(e) => return Err(self.stream_error(e)),
            };
            self.lines.consume(used);
            self.decoded += used as u64;
            if done {
                return Ok(());
            }
        }
    }
}

/// A byte for a message: the character, or its value.
fn shown_byte(b: u8) -> String {
    if b.is_ascii_graphic() {
        format!("`{}`", b as char)
    } else {
        format!("byte 0x{b:02x}")
    }
}

/// The string in `field` of the JSON object `line`; the error says what is wrong with it.
pub fn text_field(line: &str, field: &str) -> Result<String, String> {
    let mut de = serde_json::Deserializer::from_str(line);
    let found = FieldSeed(field).deserialize(&mut de).map_err(|e| format!("not a JSON object: {e}"))?;
    de.end().map_err(|e| format!("text after the JSON object: {e}"))?;
    match found {
        Found::Text(t) => Ok(t),
        Found::WrongType(kind) => Err(format!("field `{field}` is {kind}, not a string")),
        Found::Missing(keys) if keys.is_empty() => Err(format!("field `{field}` is missing (the object is empty)")),
        Found::Missing(keys) => Err(format!("field `{field}` is missing (fields: {})", keys.join(", "))),
    }
}

/// What a JSON object holds under the wanted field.
enum Found {
    Text(String),
    WrongType(&'static str),
    /// The first few keys the object has, for the message.
    Missing(Vec<String>),
}

/// Walks one JSON object keeping only the wanted field (the rest is skipped without building
/// values), so long records with many fields cost no more than their text.
struct FieldSeed<'f>(&'f str);

impl<'de> DeserializeSeed<'de> for FieldSeed<'_> {
    type Value = Found;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Found, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for FieldSeed<'_> {
    type Value = Found;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "a JSON object with a string field `{}`", self.0)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Found, A::Error> {
        let mut found = None;
        let mut keys = Vec::new();
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            if found.is_none() && key == self.0 {
                found = Some(map.next_value::<TextValue>()?.0);
            } else {
                map.next_value::<IgnoredAny>()?;
                if keys.len() < 8 {
                    keys.push(key.into_owned());
                }
            }
        }
        Ok(found.unwrap_or(Found::Missing(keys)))
    }
}

/// A field's value: the string, or the name of its JSON type.
struct TextValue(Found);

impl<'de> serde::Deserialize<'de> for TextValue {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(TextVisitor)
    }
}

struct TextVisitor;

impl<'de> Visitor<'de> for TextVisitor {
    type Value = TextValue;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_str<E>(self, v: &str) -> Result<TextValue, E> {
        Ok(TextValue(Found::Text(v.to_string())))
    }
    fn visit_string<E>(self, v: String) -> Result<TextValue, E> {
        Ok(TextValue(Found::Text(v)))
    }
    fn visit_bool<E>(self, _: bool) -> Result<TextValue, E> {
        Ok(TextValue(Found::WrongType("a boolean")))
    }
    fn visit_i64<E>(self, _: i64) -> Result<TextValue, E> {
        Ok(TextValue(Found::WrongType("a number")))
    }
    fn visit_u64<E>(self, _: u64) -> Result<TextValue, E> {
        Ok(TextValue(Found::WrongType("a number")))
    }
    fn visit_f64<E>(self, _: f64) -> Result<TextValue, E> {
        Ok(TextValue(Found::WrongType("a number")))
    }
    fn visit_unit<E>(self) -> Result<TextValue, E> {
        Ok(TextValue(Found::WrongType("null")))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TextValue, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(TextValue(Found::WrongType("an array")))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<TextValue, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(TextValue(Found::WrongType("an object")))
    }
}
