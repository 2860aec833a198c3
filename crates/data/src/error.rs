//! One error type for the whole crate.
//!
//! Every failure that a user can cause (a wrong path, a foreign or truncated
//! file, a corpus too small for the requested sequence length) comes back as an
//! [`Error`] whose message names the file or the setting to fix, never as a panic.

use std::fmt;
use std::path::{Path, PathBuf};

/// Errors of the data pipeline.
#[derive(Debug)]
pub enum Error {
    /// An operating-system error while touching `path`.
    Io { path: PathBuf, source: std::io::Error },
    /// `path` exists but its contents are not what we expect (bad magic,
    /// unsupported version, truncated, corrupt JSON ...).
    Format { path: PathBuf, msg: String },
    /// The Hugging Face tokenizers library reported a failure.
    Tokenizer(String),
    /// An invalid argument or a data set that cannot serve the request
    /// (empty, shorter than one window, mismatched loader state ...).
    Invalid(String),
    /// One record of an input file cannot be a document: `at` says where (`line 12`, `row 7`,
    /// `byte offset 4096`), `msg` what is wrong and with which field.
    Record { path: PathBuf, at: String, msg: String },
    /// Stopped on the caller's request (a progress callback); the work done so far is kept for
    /// the next run to resume from.
    Interrupted,
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        Error::Io { path: path.to_path_buf(), source }
    }

    pub(crate) fn format(path: &Path, msg: impl Into<String>) -> Self {
        Error::Format { path: path.to_path_buf(), msg: msg.into() }
    }

    pub(crate) fn invalid(msg: impl Into<String>) -> Self {
        Error::Invalid(msg.into())
    }

    pub(crate) fn record(path: &Path, at: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Record { path: path.to_path_buf(), at: at.into(), msg: msg.into() }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io { path, source } => write!(f, "{}: {source}", path.display()),
            Error::Format { path, msg } => write!(f, "{}: {msg}", path.display()),
            Error::Tokenizer(msg) => write!(f, "tokenizer: {msg}"),
            Error::Invalid(msg) => f.write_str(msg),
            Error::Record { path, at, msg } => write!(f, "{}: {at}: {msg}", path.display()),
            Error::Interrupted => f.write_str("interrupted (run again to resume)"),
        }
    }
}

/// No `source()`: the message above already ends with the operating system's reason, and a
/// chain printer (`anyhow`'s `{:#}`) would print it twice (`…: Not a directory (os error 20):
/// Not a directory (os error 20)`).
impl std::error::Error for Error {}
