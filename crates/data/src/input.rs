//! What `--data` and `prepare_data --input` may name, resolved to a sorted list of input files.
//!
//! - a file: `.txt` (or any other name: read as text, as before), `.json` (a JSON array of
//!   records, or JSON Lines misnamed), `.jsonl`, `.jsonl.gz`, `.jsonl.zst`, `.parquet`;
//! - a directory: its files in those formats, by name (not recursive; hidden files skipped),
//!   except `.json` files, which in a dataset's directory are often metadata
//!   (`dataset_info.json`): name them, or match them with a glob;
//! - a glob (`data/*.parquet`, `shards/**/*.jsonl.zst`, `alpaca/*.json`): its matches in those
//!   formats.
//!
//! The order is by path, so a prepared directory is a pure function of the inputs.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::error::{Error, Result};

/// The formats, for messages.
pub const SUPPORTED: &str = ".txt, .json, .jsonl, .jsonl.gz, .jsonl.zst or .parquet";
/// The formats that hold records (everything but text), for messages.
pub const RECORD_FORMATS: &str = ".json, .jsonl, .jsonl.gz, .jsonl.zst or .parquet";
/// The formats a directory listing takes (all but `.json`), for messages.
const LISTED: &str = ".txt, .jsonl, .jsonl.gz, .jsonl.zst or .parquet";

/// How a JSON Lines file is compressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

/// The format of one input file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputFormat {
    /// The whole file is one document.
    Text,
    /// One JSON object per line; the text field of each is one document.
    Jsonl(Compression),
    /// `.json`: a JSON array whose elements are the records (read one element at a time), or,
    /// when the file starts with `{`, JSON Lines under a `.json` name.
    Json,
    /// One document per row: the text column, read one row group (and page) at a time.
    Parquet,
}

impl InputFormat {
    /// The format a file name says, `None` for names that are none of [`SUPPORTED`].
    pub fn of_name(name: &str) -> Option<Self> {
        let n = name.to_ascii_lowercase();
        let f = if n.ends_with(".jsonl.gz") {
            InputFormat::Jsonl(Compression::Gzip)
        } else if n.ends_with(".jsonl.zst") {
            InputFormat::Jsonl(Compression::Zstd)
        } else if n.ends_with(".jsonl") {
            InputFormat::Jsonl(Compression::None)
        } else if n.ends_with(".json") {
            InputFormat::Json
        } else if n.ends_with(".parquet") {
            InputFormat::Parquet
        } else if n.ends_with(".txt") {
            InputFormat::Text
        } else {
            return None;
        };
        Some(f)
    }

    /// Text files keep the behaviour they had before the other formats existed (one document
    /// per file, validation cut from the end of the token stream).
    pub fn is_text(self) -> bool {
        self == InputFormat::Text
    }
}

/// One input file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputFile {
    pub path: PathBuf,
    pub format: InputFormat,
    /// Size on disk (compressed size for compressed files): what progress counts.
    pub bytes: u64,
    pub modified: Option<SystemTime>,
}

impl InputFile {
    fn new(path: PathBuf, format: InputFormat) -> Result<Self> {
        let meta = std::fs::metadata(&path).map_err(|e| Error::io(&path, e))?;
        Ok(InputFile { path, format, bytes: meta.len(), modified: meta.modified().ok() })
    }
}

/// Whether `spec` is written as a glob pattern (and is not simply a path that exists).
fn is_glob(spec: &Path) -> bool {
    !spec.exists() && spec.to_str().is_some_and(|s| s.contains(['*', '?', '[']))
}

/// The input files `spec` names (see the module docs), sorted by path; an error names `spec`
/// when it names nothing readable.
pub fn resolve_inputs(spec: &Path) -> Result<Vec<InputFile>> {
    if is_glob(spec) {
        let pattern = spec.to_str().unwrap_or_default();
        let paths = glob::glob(pattern).map_err(|e| Error::format(spec, format!("not a valid glob pattern: {e}")))?;
        let mut files = Vec::new();
        for p in paths {
            let p = p.map_err(|e| {
                let path = e.path().to_path_buf();
                Error::io(&path, e.into())
            })?;
            let format = p.file_name().and_then(|n| n.to_str()).and_then(InputFormat::of_name);
            if let (true, Some(format)) = (p.is_file(), format) {
                files.push(InputFile::new(p, format)?);
            }
        }
        files.sort_by(|a, b| a.path.cmp(&b.path));
        if files.is_empty() {
            return Err(Error::format(spec, format!("the pattern matches no {SUPPORTED} file")));
        }
        return Ok(files);
    }
    let meta = std::fs::metadata(spec).map_err(|e| Error::io(spec, e))?;
    if meta.is_file() {
        // Any single file is accepted; a name that is no known format is read as text.
        let format = spec.file_name().and_then(|n| n.to_str()).and_then(InputFormat::of_name).unwrap_or(InputFormat::Text);
        return Ok(vec![InputFile::new(spec.to_path_buf(), format)?]);
    }
    let (mut files, mut json_files) = (Vec::new(), 0usize);
    for entry in std::fs::read_dir(spec).map_err(|e| Error::io(spec, e))? {
        let path = entry.map_err(|e| Error::io(spec, e))?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
        if name.starts_with('.') || !path.is_file() {
            continue;
        }
        match InputFormat::of_name(name) {
            Some(InputFormat::Json) => json_files += 1,
            Some(format) => files.push(InputFile::new(path, format)?),
            None => {}
        }
    }
    files.sort_by(|a, b| a.path.cmp(&b.path));
    if files.is_empty() {
        let json = if json_files > 0 {
            format!(
                " ({json_files} .json file(s) left out: a directory's .json files are often metadata; \
                 name a .json file of records itself, or match them with a quoted glob such as '{}/*.json')",
                spec.display()
            )
        } else {
            String::new()
        };
        return Err(Error::format(spec, format!("no {LISTED} files in this directory{json}")));
    }
    Ok(files)
}

/// The `.txt` files of `input` (itself, if it is a file), sorted by name: the corpus of
/// `train_tokenizer`.
pub fn text_files(input: &Path) -> Result<Vec<PathBuf>> {
    let files: Vec<PathBuf> = resolve_inputs(input)?.into_iter().filter(|f| f.format.is_text()).map(|f| f.path).collect();
    if files.is_empty() {
        return Err(Error::format(input, "no .txt files in this directory"));
    }
    Ok(files)
}
