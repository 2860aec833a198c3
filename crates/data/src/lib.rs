//! ferrolm-data: everything between text files and `(B, T)` token batches.
//!
//! - [`Tokenizer`]: any Hugging Face `tokenizer.json` (byte-level BPE trainer included);
//! - [`shard`]: memory-mapped binary token shards (`FRLMTOK` header + u16/u32 ids);
//! - [`resolve_inputs`] and [`DocReader`]: text, JSON Lines (plain, gzip, zstd) and Parquet
//!   inputs, read one document at a time;
//! - [`prepare`]: documents -> train/val shards and a manifest, on every core, resumable;
//! - [`check_token_data`]: a prepared directory checked against the tokenizer at open;
//! - [`DataLoader`]: seeded, resumable shuffled batches (their order an [`EpochOrder`], which
//!   the trainer also walks packed chat rows in), and [`eval_batches`];
//! - [`chat`]: chat records, Hugging Face chat templates, assistant masks and packing (SFT).
//!
//! The crate deals in plain `Vec<u32>` / `Vec<i32>` and does not depend on the
//! tensor crate, so it builds and tests on its own.

pub mod chat;
pub mod check;
pub mod error;
pub mod finalize;
pub mod framing;
pub mod input;
pub mod loader;
mod parquet_reader;
pub mod pipeline;
pub mod preference;
pub mod prepare;
pub mod records;
pub mod shard;
pub mod tokenizer;

pub use check::{check_shard_ids, check_token_data, TokenData};
pub use error::{Error, Result};
pub use finalize::SplitKind;
pub use framing::DocFraming;
pub use input::{resolve_inputs, text_files, Compression, InputFile, InputFormat};
pub use loader::{eval_batches, Batch, DataLoader, EpochOrder, EvalBatches, LoaderState, MAX_BATCH_TOKENS};
pub use pipeline::PrepareProgress;
pub use prepare::{list_shards, prepare, prepare_text_dir, prepare_text_dir_with_progress, PrepareOptions, PrepareSummary, ShardInfo};
pub use records::{DocReader, Piece, ReadError};
pub use shard::{Shard, ShardWriter, TokenDtype};
pub use tokenizer::{train_byte_level_bpe, Tokenizer, BOS_TOKEN, EOS_TOKEN};
