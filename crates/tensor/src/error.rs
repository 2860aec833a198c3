//! One error type for the engine: every failure names the op that raised it.
use std::fmt;

#[derive(Debug, Clone)]
pub struct Error {
    pub op: String,
    pub msg: String,
}

impl Error {
    pub fn new(op: impl Into<String>, msg: impl Into<String>) -> Self {
        Error { op: op.into(), msg: msg.into() }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.op, self.msg)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// `bail!(op, "fmt", args..)` returns an `Error` naming `op`.
#[macro_export]
macro_rules! bail {
    ($op:expr, $($arg:tt)*) => { return Err($crate::Error::new($op, format!($($arg)*))) };
}
