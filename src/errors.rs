//! The run's error kinds, below every module that reports one: a [`FlagError`] (a wrong flag,
//! found after parsing: exit code 2) or any other error (exit code 1, [`exit_code`]). The CLI
//! (`cli`) re-exports them; the library modules beneath it (`parallel`, `run_dir`) build flag
//! errors from here, so nothing under src/ but the CLI and the tools imports the CLI.

/// A flag error found after parsing, against a model or the machine (a layout `--tp` cannot
/// split, more new tokens than the model has positions): printed as `error: …` and exit code 2,
/// as clap's own flag errors are. Build one with [`flag_error`]; it keeps its code through any
/// context added above it.
#[derive(Debug)]
pub struct FlagError(pub String);

impl std::fmt::Display for FlagError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for FlagError {}

/// An error in the flags (exit code 2): see [`FlagError`].
pub fn flag_error(msg: impl Into<String>) -> anyhow::Error {
    FlagError(msg.into()).into()
}

/// The exit code of a failed run: 2 when a flag was wrong ([`FlagError`] anywhere in the chain),
/// else 1.
pub fn exit_code(e: &anyhow::Error) -> i32 {
    if e.chain().any(|c| c.is::<FlagError>()) {
        2
    } else {
        1
    }
}
