//! Documents out of input files, one at a time and in bounded memory.
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
            self.file.seek(std::io::SeekFrom::Start(0)).map_err(|e| stream(Error::io(&self.path, e)))?;
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
/// not records.
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
        })
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
        let (path, field) = (self.path.clone(), self.field.clone());
        let Some((at, line)) = self.next_line()? else { return Ok(None) };
        match text_field(line, &field) {
            Ok(text) => Ok(Some(Piece { text, doc_end: true })),
            Err(msg) => Err(ReadError::Record(Error::record(&path, at, msg))),
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
            if self.buf.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            return match std::str::from_utf8(&self.buf) {
                Ok(line) => Ok(Some((at, line))),
                Err(e) => {
                    let k = e.valid_up_to();
                    let msg = format!("invalid UTF-8 at byte {k} of the line (byte offset {})", start + k as u64);
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
