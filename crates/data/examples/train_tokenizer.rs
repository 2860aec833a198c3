//! Trains the byte-level BPE `tokenizer.json` shipped in `data/`.
//!
//! cargo run -p ferrolm-data --release --example train_tokenizer -- \
//!     --corpus data/corpus --vocab-size 4096 --out data/tokenizer.json

use std::path::PathBuf;
use std::process::ExitCode;

use ferrolm_data::{text_files, train_byte_level_bpe};

const USAGE: &str = "usage: train_tokenizer --corpus <file or dir of .txt> [--vocab-size 4096] --out <tokenizer.json>";

fn run() -> Result<(), String> {
    let (mut corpus, mut vocab, mut out) = (None, 4096usize, None);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or(format!("{flag} needs a value\n{USAGE}"));
        match flag.as_str() {
            "--corpus" => corpus = Some(PathBuf::from(value()?)),
            "--vocab-size" => vocab = value()?.parse().map_err(|e| format!("--vocab-size: {e}"))?,
            "--out" => out = Some(PathBuf::from(value()?)),
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    let corpus = corpus.ok_or(USAGE)?;
    let out = out.ok_or(USAGE)?;
    let files = text_files(&corpus).map_err(|e| e.to_string())?;
    let bytes: u64 = files.iter().filter_map(|f| std::fs::metadata(f).ok()).map(|m| m.len()).sum();
    eprintln!("training byte-level BPE (vocab {vocab}) on {} files, {bytes} bytes", files.len());
    let tok = train_byte_level_bpe(&files, vocab).map_err(|e| e.to_string())?;
    tok.save(&out).map_err(|e| e.to_string())?;
    println!("wrote {}: vocab_size={} bos={:?} eos={:?}", out.display(), tok.vocab_size(), tok.bos_id(), tok.eos_id());
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
