//! Tokenizes text into train/val token shards.
//!
//! cargo run -p ferrolm-data --release --example prepare_data -- \
//!     --input data/corpus --tokenizer data/tokenizer.json --out runs/shakespeare \
//!     [--val-fraction 0.05] [--shard-tokens 100000000]

use std::path::PathBuf;
use std::process::ExitCode;

use ferrolm_data::{prepare_text_dir, Tokenizer};

const USAGE: &str = "usage: prepare_data --input <file or dir of .txt> --tokenizer <tokenizer.json> \
                     --out <dir> [--val-fraction 0.05] [--shard-tokens 100000000]";

fn run() -> Result<(), String> {
    let (mut input, mut tokenizer, mut out) = (None, None, None);
    let (mut val_fraction, mut shard_tokens) = (0.05f64, 100_000_000usize);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or(format!("{flag} needs a value\n{USAGE}"));
        match flag.as_str() {
            "--input" => input = Some(PathBuf::from(value()?)),
            "--tokenizer" => tokenizer = Some(PathBuf::from(value()?)),
            "--out" => out = Some(PathBuf::from(value()?)),
            "--val-fraction" => val_fraction = value()?.parse().map_err(|e| format!("--val-fraction: {e}"))?,
            "--shard-tokens" => shard_tokens = value()?.parse().map_err(|e| format!("--shard-tokens: {e}"))?,
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    let (input, tokenizer, out) = (input.ok_or(USAGE)?, tokenizer.ok_or(USAGE)?, out.ok_or(USAGE)?);
    let tok = Tokenizer::from_file(&tokenizer).map_err(|e| e.to_string())?;
    let s = prepare_text_dir(&input, &tok, &out, val_fraction, shard_tokens).map_err(|e| e.to_string())?;
    println!(
        "{} documents -> {} train tokens in {} shard(s), {} val tokens in {} shard(s) ({:?}) under {}",
        s.documents,
        s.train_tokens,
        s.train_shards.len(),
        s.val_tokens,
        s.val_shards.len(),
        s.dtype,
        out.display()
    );
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
