//! One error type for the engine: every failure names the op that raised it.

/// An engine failure: `op` names the operation that raised it, `msg` says what went wrong.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{op}: {msg}")]
pub struct Error {
    pub op: String,
    pub msg: String,
}

impl Error {
    pub fn new(op: impl Into<String>, msg: impl Into<String>) -> Self {
        Error { op: op.into(), msg: msg.into() }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// `bail!(op, "fmt", args..)` returns an `Error` naming `op`.
#[macro_export]
macro_rules! bail {
    ($op:expr, $($arg:tt)*) => { return Err($crate::Error::new($op, format!($($arg)*))) };
}
