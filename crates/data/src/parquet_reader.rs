//! Parquet: the text column of each row, through the `parquet` crate's low-level column reader
//! (no Arrow). Only that column is read, one row group at a time and, inside it, one page at a
//! time, so memory is a page and a batch of values whatever the file's size.

use std::fs::File;
use std::path::{Path, PathBuf};

use parquet::basic::{ConvertedType, LogicalType, Type as PhysicalType};
use parquet::column::reader::{ColumnReader, ColumnReaderImpl};
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::reader::{ChunkReader, FileReader, Length};
use parquet::file::serialized_reader::SerializedFileReader;

use crate::error::Error;
use crate::records::{Piece, ReadError, MAX_RECORD_BYTES};

/// Rows decoded per call into the column reader.
const BATCH_ROWS: usize = 1024;

/// A file whose reads are checked against its length before anything is allocated: the parquet
/// crate sizes a buffer from the footer's byte ranges, which a corrupt footer can make huge.
pub(crate) struct BoundedFile {
    pub(crate) file: File,
    pub(crate) len: u64,
}

impl Length for BoundedFile {
    fn len(&self) -> u64 {
        self.len
    }
}

impl ChunkReader for BoundedFile {
    type T = <File as ChunkReader>::T;

    fn get_read(&self, start: u64) -> parquet::errors::Result<Self::T> {
        if start > self.len {
            return Err(parquet::errors::ParquetError::EOF(format!("offset {start} is past the end of the file ({} bytes)", self.len)));
        }
        self.file.get_read(start)
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<bytes::Bytes> {
        if start.checked_add(length as u64).is_none_or(|end| end > self.len) {
            return Err(parquet::errors::ParquetError::EOF(format!(
                "bytes {start}..+{length} are past the end of the file ({} bytes)",
                self.len
            )));
        }
        self.file.get_bytes(start, length)
    }
}

pub(crate) struct ParquetReader {
    path: PathBuf,
    file: SerializedFileReader<BoundedFile>,
    column: usize,
    field: String,
    max_def: i16,
    /// Next row group to open.
    next_group: usize,
    reader: Option<ColumnReaderImpl<ByteArrayType>>,
    rows_left_in_group: u64,
    /// The current batch, in reverse (popped from the end): `None` for a null.
    batch: Vec<Option<ByteArray>>,
    values: Vec<ByteArray>,
    defs: Vec<i16>,
    /// Rows returned (or rejected) so far.
    row: u64,
    total_rows: u64,
    file_bytes: u64,
}

impl ParquetReader {
    pub(crate) fn open(path: &Path, file_bytes: u64, field: &str) -> Result<Self, ReadError> {
        let stream = |msg: String| ReadError::Stream(Error::format(path, msg));
        let file = File::open(path).map_err(|e| ReadError::Stream(Error::io(path, e)))?;
        let len = file.metadata().map_err(|e| ReadError::Stream(Error::io(path, e)))?.len();
        let file = SerializedFileReader::new(BoundedFile { file, len })
            .map_err(|e| stream(format!("not a readable Parquet file (corrupt or truncated footer?): {e}")))?;
        let schema = file.metadata().file_metadata().schema_descr_ptr();
        let columns: Vec<String> = (0..schema.num_columns()).map(|i| schema.column(i).path().string()).collect();
        let column = columns.iter().position(|c| c == field).ok_or_else(|| {
            let shown: Vec<&str> = columns.iter().take(12).map(String::as_str).collect();
            stream(format!("field `{field}`: no such column (columns: {})", shown.join(", ")))
        })?;
        let d = schema.column(column);
        if d.max_rep_level() > 0 {
            return Err(stream(format!("field `{field}`: the column is a list, not a string")));
        }
        if d.physical_type() != PhysicalType::BYTE_ARRAY {
            return Err(stream(format!("field `{field}`: the column holds {} values, not strings", d.physical_type())));
        }
        let stringy = match d.logical_type_ref() {
            Some(LogicalType::String | LogicalType::Json | LogicalType::Enum) => true,
            Some(_) => false,
            None => matches!(d.converted_type(), ConvertedType::NONE | ConvertedType::UTF8 | ConvertedType::JSON | ConvertedType::ENUM),
        };
        if !stringy {
            return Err(stream(format!("field `{field}`: the column holds {:?} values, not strings", d.logical_type_ref())));
        }
        let total_rows = file.metadata().row_groups().iter().map(|g| g.num_rows().max(0) as u64).sum();
        Ok(ParquetReader {
            path: path.to_path_buf(),
            max_def: d.max_def_level(),
            file,
            column,
            field: field.to_string(),
            next_group: 0,
            reader: None,
            rows_left_in_group: 0,
            batch: Vec::new(),
            values: Vec::new(),
            defs: Vec::new(),
            row: 0,
            total_rows,
            file_bytes,
        })
    }

    /// The file's bytes in proportion to the rows read.
    pub(crate) fn bytes_read(&self) -> u64 {
        if self.total_rows == 0 {
            return 0;
        }
        (self.file_bytes as f64 * (self.row.min(self.total_rows) as f64 / self.total_rows as f64)) as u64
    }

    fn group_error(&self, e: impl std::fmt::Display) -> ReadError {
        ReadError::Stream(Error::record(
            &self.path,
            format!("row {} (row group {})", self.row, self.next_group.saturating_sub(1)),
            format!("field `{}`: cannot read the column: {e}", self.field),
        ))
    }

    /// Fills `batch` from the current row group, opening the next one when it is done;
    /// false at the end of the file.
    fn refill(&mut self) -> Result<bool, ReadError> {
        loop {
            if self.rows_left_in_group > 0 {
                let Some(reader) = self.reader.as_mut() else { return Ok(false) };
                self.values.clear();
                self.defs.clear();
                let want = (self.rows_left_in_group as usize).min(BATCH_ROWS);
                let defs = if self.max_def > 0 { Some(&mut self.defs) } else { None };
                let read = reader.read_records(want, defs, None, &mut self.values);
                let (records, values, _) = read.map_err(|e| self.group_error(e))?;
                if records == 0 {
                    let left = self.rows_left_in_group;
                    return Err(self.group_error(format!("the row group ended {left} rows before the count in the footer")));
                }
                self.rows_left_in_group -= records as u64;
                let mut values = self.values.drain(..values.min(self.values.len()));
                let mut batch = Vec::with_capacity(records);
                for i in 0..records {
                    let present = self.max_def == 0 || self.defs.get(i) == Some(&self.max_def);
                    batch.push(if present { values.next() } else { None });
                }
                drop(values);
                batch.reverse();
                self.batch = batch;
                return Ok(true);
            }
            if self.next_group >= self.file.num_row_groups() {
                return Ok(false);
            }
            let g = self.next_group;
            self.next_group += 1;
            let group = self.file.get_row_group(g).map_err(|e| self.group_error(e))?;
            self.rows_left_in_group = group.metadata().num_rows().max(0) as u64;
            self.reader = match group.get_column_reader(self.column).map_err(|e| self.group_error(e))? {
                ColumnReader::ByteArrayColumnReader(r) => Some(r),
                _ => return Err(self.group_error("the column is not a byte-array column in this row group")),
            };
        }
    }

    pub(crate) fn next(&mut self) -> Result<Option<Piece>, ReadError> {
        if self.batch.is_empty() && !self.refill()? {
            return Ok(None);
        }
        let Some(value) = self.batch.pop() else { return Ok(None) };
        let row = self.row;
        self.row += 1;
        let bad = |msg: String| ReadError::Record(Error::record(&self.path, format!("row {row}"), msg));
        let Some(value) = value else { return Err(bad(format!("field `{}` is null", self.field))) };
        if value.len() > MAX_RECORD_BYTES {
            return Err(bad(format!("field `{}` is longer than {} MiB", self.field, MAX_RECORD_BYTES >> 20)));
        }
        match std::str::from_utf8(value.data()) {
            Ok(s) => Ok(Some(Piece { text: s.to_string(), doc_end: true })),
            Err(e) => Err(bad(format!("field `{}`: invalid UTF-8 at byte {} of the value", self.field, e.valid_up_to()))),
        }
    }
}
