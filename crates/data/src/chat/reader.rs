//! Chat records out of input files, one at a time: each JSON Lines line, each element of a
//! `.json` file's array, or each Parquet row read as a JSON object, with where it is
//! (`line 12 (byte offset 4096)`, `record 3 (byte offset 812)`, `row 7`).
//!
//! A Parquet row's null columns are left out of its record (a dataset mixing forms has a column
//! for each, null where a row has another form).
//!
//! JSON Lines and `.json` arrays go through the pretraining reader's record reader (gzip, zstd,
//! the size limit, UTF-8 checks, a byte order mark skipped; an array read one element at a time). Parquet rows are assembled by the parquet crate's record API, projected onto
//! the columns a record form can use, one row group at a time. That API panics on some
//! internally inconsistent files instead of returning an error; its calls are made under
//! `catch_unwind`, so such a file ends with an error naming it like any other damaged file.

use std::fs::File;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parquet::file::reader::FileReader;
use parquet::file::serialized_reader::SerializedFileReader;
use parquet::record::reader::{ReaderIter, TreeBuilder};
use parquet::record::{Field, Row};
use parquet::schema::types::{SchemaDescriptor, Type};

use super::json::Json;
use crate::error::Error;
use crate::input::{InputFile, InputFormat, RECORD_FORMATS};
use crate::parquet_reader::BoundedFile;
use crate::records::{JsonlReader, ReadError, MAX_RECORD_BYTES};

/// The top-level keys any record form reads: the Parquet columns worth reading.
pub const RECORD_KEYS: [&str; 8] = ["messages", "conversations", "instruction", "input", "output", "prompt", "completion", "text"];

/// The records a reader is opened for: the Parquet columns worth reading, and the words its
/// errors use.
#[derive(Clone, Copy, Debug)]
pub struct RecordColumns {
    /// The top-level keys the record forms read.
    pub keys: &'static [&'static str],
    /// `chat`, `preference`: what the data are, for messages.
    pub data: &'static str,
    /// The forms, for the error of a Parquet file with none of `keys`.
    pub forms: &'static str,
}

impl RecordColumns {
    /// Chat records (SFT).
    pub const CHAT: RecordColumns = RecordColumns {
        keys: &RECORD_KEYS,
        data: "chat",
        forms: "`messages`, `conversations`, `instruction`/`output`, `prompt`/`completion`, `text`",
    };
}

/// Reads the records of one input file.
pub struct RecordReader {
    inner: Inner,
    records: u64,
}

enum Inner {
    Jsonl(Box<JsonlReader>),
    Parquet(Box<RowReader>),
}

impl RecordReader {
    /// Opens `file` (`.json`, `.jsonl`, `.jsonl.gz`, `.jsonl.zst` or `.parquet`; a text file is
    /// refused).
    pub fn open(file: &InputFile) -> Result<Self, ReadError> {
        Self::open_for(file, &RecordColumns::CHAT)
    }

    /// Opens `file` for records of another kind: a Parquet file's columns are projected onto
    /// `columns.keys`, and the errors name `columns.data` and `columns.forms`.
    pub fn open_for(file: &InputFile, columns: &RecordColumns) -> Result<Self, ReadError> {
        let inner = match file.format {
            InputFormat::Jsonl(c) => Inner::Jsonl(Box::new(JsonlReader::open(&file.path, c, "").map_err(ReadError::Stream)?)),
            InputFormat::Json => Inner::Jsonl(Box::new(JsonlReader::open_json(&file.path, "").map_err(ReadError::Stream)?)),
            InputFormat::Parquet => Inner::Parquet(Box::new(RowReader::open(&file.path, file.bytes, columns)?)),
            InputFormat::Text => {
                let name = file.path.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned());
                let why = if name.to_ascii_lowercase().ends_with(".txt") {
                    "a .txt file is plain text".to_string()
                } else {
                    format!("`{name}` is read as plain text (its name ends in none of {RECORD_FORMATS})")
                };
                return Err(ReadError::Stream(Error::format(
                    &file.path,
                    format!("{} data are records, and {why}: give a {RECORD_FORMATS} file of records", columns.data),
                )));
            }
        };
        Ok(RecordReader { inner, records: 0 })
    }

    /// The next record and its location, `Ok(None)` at the end of the file. A line that is not
    /// a JSON object is a [`ReadError::Record`].
    pub fn next_record(&mut self) -> Result<Option<(String, Json)>, ReadError> {
        let r = match &mut self.inner {
            Inner::Jsonl(j) => {
                let (path, hint) = (j.path().to_path_buf(), j.hint());
                match j.next_json() {
                    Ok(None) => Ok(None),
                    Ok(Some((at, line))) => match Json::parse(line) {
                        Ok(v) => Ok(Some((at, v))),
                        Err(e) => Err(ReadError::Record(Error::record(&path, at, format!("not a JSON object: {e}{hint}")))),
                    },
                    Err(e) => Err(e),
                }
            }
            Inner::Parquet(p) => p.next(),
        };
        if !matches!(r, Ok(None) | Err(ReadError::Stream(_))) {
            self.records += 1;
        }
        r
    }

    /// Records consumed so far, good and bad.
    pub fn records(&self) -> u64 {
        self.records
    }

    /// Bytes of the file consumed so far, for progress.
    pub fn bytes_read(&self) -> u64 {
        match &self.inner {
            Inner::Jsonl(j) => j.bytes_read(),
            Inner::Parquet(p) => p.bytes_read(),
        }
    }
}

/// Parquet rows as JSON objects.
struct RowReader {
    path: PathBuf,
    file: SerializedFileReader<BoundedFile>,
    descr: Arc<SchemaDescriptor>,
    next_group: usize,
    rows: Option<ReaderIter>,
    row: u64,
    total_rows: u64,
    file_bytes: u64,
}

/// Runs `f`, turning a panic inside the parquet crate into an error message.
fn guarded<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        let msg = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned());
        format!("the parquet reader failed on this file: {}", msg.unwrap_or_else(|| "internal error".into()))
    })
}

impl RowReader {
    fn open(path: &Path, file_bytes: u64, columns: &RecordColumns) -> Result<Self, ReadError> {
        let stream = |msg: String| ReadError::Stream(Error::format(path, msg));
        let f = File::open(path).map_err(|e| ReadError::Stream(Error::io(path, e)))?;
        let len = f.metadata().map_err(|e| ReadError::Stream(Error::io(path, e)))?.len();
        let file = guarded(|| SerializedFileReader::new(BoundedFile { file: f, len }))
            .map_err(stream)?
            .map_err(|e| stream(format!("not a readable Parquet file (corrupt or truncated footer?): {e}")))?;
        let root = file.metadata().file_metadata().schema_descr().root_schema_ptr();
        let fields: Vec<Arc<Type>> = root.get_fields().iter().filter(|f| columns.keys.contains(&f.name())).cloned().collect();
        if fields.is_empty() {
            let names: Vec<&str> = root.get_fields().iter().take(12).map(|f| f.name()).collect();
            return Err(stream(format!("no column of a {} record form ({}); columns: {}", columns.data, columns.forms, names.join(", "))));
        }
        let projected = guarded(|| Type::group_type_builder(root.name()).with_fields(fields).build())
            .map_err(stream)?
            .map_err(|e| stream(format!("cannot read the schema: {e}")))?;
        let descr = Arc::new(SchemaDescriptor::new(Arc::new(projected)));
        let total_rows = file.metadata().row_groups().iter().map(|g| g.num_rows().max(0) as u64).sum();
        Ok(RowReader { path: path.to_path_buf(), file, descr, next_group: 0, rows: None, row: 0, total_rows, file_bytes })
    }

    fn bytes_read(&self) -> u64 {
        if self.total_rows == 0 {
            return 0;
        }
        (self.file_bytes as f64 * (self.row.min(self.total_rows) as f64 / self.total_rows as f64)) as u64
    }

    fn stream_error(&self, msg: String) -> ReadError {
        ReadError::Stream(Error::record(&self.path, format!("row {} (row group {})", self.row, self.next_group.saturating_sub(1)), msg))
    }

    fn next(&mut self) -> Result<Option<(String, Json)>, ReadError> {
        loop {
            if let Some(rows) = self.rows.as_mut() {
                match guarded(|| rows.next()) {
                    Err(msg) => {
                        self.rows = None;
                        self.next_group = self.file.num_row_groups();
                        return Err(self.stream_error(msg));
                    }
                    Ok(None) => self.rows = None,
                    Ok(Some(Err(e))) => {
                        self.rows = None;
                        self.next_group = self.file.num_row_groups();
                        return Err(self.stream_error(format!("cannot read the row: {e}")));
                    }
                    Ok(Some(Ok(row))) => {
                        let at = format!("row {}", self.row);
                        self.row += 1;
                        let bad = |msg: String| ReadError::Record(Error::record(&self.path, at.clone(), msg));
                        let json = row_json(&row).map_err(bad)?;
                        if json.approx_bytes() > MAX_RECORD_BYTES {
                            return Err(bad(format!("the row is longer than {} MiB", MAX_RECORD_BYTES >> 20)));
                        }
                        return Ok(Some((at, json)));
                    }
                }
                continue;
            }
            if self.next_group >= self.file.num_row_groups() {
                return Ok(None);
            }
            let g = self.next_group;
            self.next_group += 1;
            let (file, descr) = (&self.file, self.descr.clone());
            let opened = guarded(|| {
                let group = file.get_row_group(g)?;
                TreeBuilder::new().as_iter(descr, group.as_ref())
            });
            match opened {
                Ok(Ok(iter)) => self.rows = Some(iter),
                Ok(Err(e)) => return Err(self.stream_error(format!("cannot read the row group: {e}"))),
                Err(msg) => return Err(self.stream_error(msg)),
            }
        }
    }
}

/// A row as a JSON object; a null column is left out (the row has another form).
fn row_json(row: &Row) -> Result<Json, String> {
    row.get_column_iter()
        .filter(|(_, v)| !matches!(v, Field::Null))
        .map(|(k, v)| Ok((k.clone(), field_json(v, k, 0)?)))
        .collect::<Result<Vec<_>, String>>()
        .map(Json::Object)
}

/// A Parquet value as JSON; `column` names it in errors.
fn field_json(f: &Field, column: &str, depth: usize) -> Result<Json, String> {
    if depth > 64 {
        return Err(format!("column `{column}` is nested too deeply"));
    }
    let num = |n: serde_json::Number| Ok(Json::Number(n));
    let float = |x: f64| Ok(serde_json::Number::from_f64(x).map_or(Json::Null, Json::Number));
    match f {
        Field::Null => Ok(Json::Null),
        Field::Bool(b) => Ok(Json::Bool(*b)),
        Field::Byte(n) => num((*n).into()),
        Field::Short(n) => num((*n).into()),
        Field::Int(n) => num((*n).into()),
        Field::Long(n) => num((*n).into()),
        Field::UByte(n) => num((*n).into()),
        Field::UShort(n) => num((*n).into()),
        Field::UInt(n) => num((*n).into()),
        Field::ULong(n) => num((*n).into()),
        Field::Float16(x) => float(f64::from(*x)),
        Field::Float(x) => float(f64::from(*x)),
        Field::Double(x) => float(*x),
        Field::Str(s) => Ok(Json::String(s.clone())),
        Field::Bytes(b) => match std::str::from_utf8(b.data()) {
            Ok(s) => Ok(Json::String(s.to_string())),
            Err(e) => Err(format!("column `{column}`: invalid UTF-8 at byte {} of a value", e.valid_up_to())),
        },
        Field::Group(row) => row
            .get_column_iter()
            .map(|(k, v)| Ok((k.clone(), field_json(v, column, depth + 1)?)))
            .collect::<Result<Vec<_>, String>>()
            .map(Json::Object),
        Field::ListInternal(list) => {
            list.elements().iter().map(|v| field_json(v, column, depth + 1)).collect::<Result<Vec<_>, String>>().map(Json::Array)
        }
        Field::MapInternal(map) => map
            .entries()
            .iter()
            .map(|(k, v)| {
                let key = match field_json(k, column, depth + 1)? {
                    Json::String(s) => s,
                    other => return Err(format!("column `{column}`: a map key is {}, not a string", other.kind())),
                };
                Ok((key, field_json(v, column, depth + 1)?))
            })
            .collect::<Result<Vec<_>, String>>()
            .map(Json::Object),
        other => Err(format!("column `{column}` holds a {} value, which no chat record form uses", field_kind(other))),
    }
}

fn field_kind(f: &Field) -> &'static str {
    match f {
        Field::Decimal(_) => "decimal",
        Field::Date(_) => "date",
        Field::TimeMillis(_) | Field::TimeMicros(_) => "time",
        Field::TimestampMillis(_) | Field::TimestampMicros(_) => "timestamp",
        _ => "non-text",
    }
}

/// What [`encode_records`] reports to its loader, in file and record order.
pub(crate) enum RecordEvent<T> {
    /// A record encoded, and where it is (`FILE: line 12 (byte offset 4096)`).
    Encoded(T, String),
    /// A bad record, file or stream, skipped under `--skip-bad-records`: its message.
    Bad(String),
    /// A batch is done: bytes consumed of all the inputs, and their total.
    Progress(u64, u64),
    /// A file is read to its end (or to a skipped damage): its records, good and bad.
    FileDone(u64),
}

/// Records encoded together, in parallel.
const BATCH_RECORDS: usize = 512;

/// The loop every record loader runs (chat SFT, preference pairs): reads `inputs`' records (of
/// the kind `columns` names) on this thread, encodes each batch of them with `encode` on every
/// core, and reports each result to `on` in file and record order. A record `encode` refuses,
/// a record that is not one, a damaged stream or a file that cannot be opened fails the load
/// naming the file and where, unless `skip_bad_records`: then it is reported as
/// [`RecordEvent::Bad`] (a file skipped whole, a stream from the damage on) and the load goes on.
pub(crate) fn encode_records<T: Send>(
    inputs: &[InputFile],
    columns: &RecordColumns,
    skip_bad_records: bool,
    encode: &(dyn Fn(&Json) -> Result<T, String> + Sync),
    on: &mut dyn FnMut(RecordEvent<T>),
) -> crate::error::Result<()> {
    use rayon::prelude::*;
    let total_bytes: u64 = inputs.iter().map(|f| f.bytes).sum();
    let mut done_before = 0u64;
    for file in inputs {
        let mut reader = match RecordReader::open_for(file, columns) {
            Ok(r) => Some(r),
            Err(e) if skip_bad_records => {
                on(RecordEvent::Bad(format!("{} (the whole file is skipped)", e.into_error())));
                None
            }
            Err(e) => return Err(e.into_error()),
        };
        while let Some(r) = reader.as_mut() {
            let mut batch: Vec<(String, Json)> = Vec::with_capacity(BATCH_RECORDS);
            let mut ended = false;
            while batch.len() < BATCH_RECORDS {
                match r.next_record() {
                    Ok(Some(rec)) => batch.push(rec),
                    Ok(None) => {
                        ended = true;
                        break;
                    }
                    Err(ReadError::Record(e)) if skip_bad_records => on(RecordEvent::Bad(e.to_string())),
                    Err(ReadError::Stream(e)) if skip_bad_records => {
                        on(RecordEvent::Bad(format!("{e} (the rest of the file is skipped)")));
                        ended = true;
                        break;
                    }
                    Err(e) => return Err(e.into_error()),
                }
            }
            let encoded: Vec<Result<T, String>> = batch.par_iter().map(|(_, rec)| encode(rec)).collect();
            for ((at, _), out) in batch.iter().zip(encoded) {
                match out {
                    Ok(t) => on(RecordEvent::Encoded(t, format!("{}: {at}", file.path.display()))),
                    Err(msg) => {
                        let e = Error::record(&file.path, at.clone(), msg);
                        if !skip_bad_records {
                            return Err(e);
                        }
                        on(RecordEvent::Bad(e.to_string()));
                    }
                }
            }
            on(RecordEvent::Progress(done_before + r.bytes_read(), total_bytes));
            if ended {
                on(RecordEvent::FileDone(r.records()));
                break;
            }
        }
        done_before += file.bytes;
    }
    Ok(())
}
