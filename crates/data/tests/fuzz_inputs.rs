//! Structured fuzzing of the dataset readers: JSON Lines records and `.json` arrays mutated as
//! JSON trees and as bytes, gzip and zstd streams with bytes flipped, spliced or cut, Parquet files damaged in
//! their pages and footer. Every case must read to the end or stop with an error naming the
//! file, never panic, and never make an allocation above the cap (see `fuzzing/`).
mod common;
mod fuzzing;

use std::io::Write;
use std::path::Path;

use common::Scratch;
use ferrolm_data::{Compression, DocReader, InputFile, InputFormat, ReadError};
use fuzzing::{apply_bytes, byte_edit, config, json_mutations, mutate_json, parquet_edits, ByteEdit};
use proptest::prelude::*;
use serde_json::json;

#[global_allocator]
static ALLOC: fuzzing::CappedAlloc = fuzzing::CappedAlloc;

/// Reads every piece of `path`; errors must name the file. Returns the pieces read.
fn read_all(path: &Path, format: InputFormat) -> Result<usize, TestCaseError> {
    let file = InputFile { path: path.to_path_buf(), format, bytes: std::fs::metadata(path).unwrap().len(), modified: None };
    let name = path.display().to_string();
    let mut r = match DocReader::open(&file, "text") {
        Ok(r) => r,
        Err(e) => {
            let e = e.into_error().to_string();
            prop_assert!(e.contains(&name), "{}", e);
            return Ok(0);
        }
    };
    let mut pieces = 0;
    // A record is at least one line or row, so a reader that loops without progress fails here.
    for _ in 0..100_000 {
        match r.next_piece() {
            Ok(Some(_)) => pieces += 1,
            Ok(None) => return Ok(pieces),
            Err(ReadError::Record(e)) => prop_assert!(e.to_string().contains(&name), "{}", e),
            Err(ReadError::Stream(e)) => {
                prop_assert!(e.to_string().contains(&name), "{}", e);
                return Ok(pieces);
            }
        }
    }
    Err(TestCaseError::fail("the reader never ended"))
}

fn compress(data: &[u8], c: Compression) -> Vec<u8> {
    match c {
        Compression::None => data.to_vec(),
        Compression::Gzip => {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            e.write_all(data).unwrap();
            e.finish().unwrap()
        }
        Compression::Zstd => zstd::stream::encode_all(data, 3).unwrap(),
    }
}

fn compression() -> impl Strategy<Value = Compression> {
    prop_oneof![Just(Compression::None), Just(Compression::Gzip), Just(Compression::Zstd)]
}

proptest! {
    #![proptest_config(config(1500))]

    /// JSON Lines: records edited as JSON (hostile values in and around the text field), lines
    /// edited as bytes, then compressed and the stream edited as bytes.
    #[test]
    fn fuzz_jsonl(
        records in proptest::collection::vec(json_mutations(), 1..4),
        c in compression(),
        stream_edits in prop_oneof![2 => Just(Vec::new()), 1 => proptest::collection::vec(byte_edit(), 1..3)],
    ) {
        thread_local!(static DIR: Scratch = Scratch::new("fuzz-jsonl"));
        DIR.with(|dir| -> Result<(), TestCaseError> {
            let base = json!({"id": 3, "text": "Café 東京 🎭 \"quoted\" \\ line\u{2028}end", "meta": {"n": [1, 2], "ok": null}});
            let mut text = Vec::new();
            for (edits, bytes) in &records {
                text.extend(mutate_json(&base, edits, bytes));
                text.push(b'\n');
            }
            let mut data = compress(&text, c);
            stream_edits.iter().for_each(|e: &ByteEdit| apply_bytes(&mut data, e));
            let ext = match c { Compression::None => "jsonl", Compression::Gzip => "jsonl.gz", Compression::Zstd => "jsonl.zst" };
            let path = dir.path().join(format!("f.{ext}"));
            fuzzing::rewrite(&path, &data);
            let pieces = read_all(&path, InputFormat::Jsonl(c))?;
            prop_assert!(pieces <= records.len() + 2 * stream_edits.len() + 1);
            Ok(())
        })?;
    }
}

proptest! {
    #![proptest_config(config(1500))]

    /// `.json` arrays: records edited as JSON, joined into an array (after a byte order mark or
    /// not), the file edited as bytes; the array is walked one element at a time.
    #[test]
    fn fuzz_json_array(
        records in proptest::collection::vec(json_mutations(), 0..4),
        bom in any::<bool>(),
        edits in prop_oneof![2 => Just(Vec::new()), 1 => proptest::collection::vec(byte_edit(), 1..3)],
    ) {
        thread_local!(static DIR: Scratch = Scratch::new("fuzz-json"));
        DIR.with(|dir| -> Result<(), TestCaseError> {
            let base = json!({"id": 3, "text": "Café [東京] {🎭} \"quoted\", \\ line\u{2028}end", "meta": {"n": [1, 2], "ok": null}});
            let mut data = if bom { "\u{FEFF}[".as_bytes().to_vec() } else { b"[".to_vec() };
            for (i, (e, bytes)) in records.iter().enumerate() {
                if i > 0 {
                    data.extend_from_slice(b",\n ");
                }
                data.extend(mutate_json(&base, e, bytes));
            }
            data.push(b']');
            edits.iter().for_each(|e: &ByteEdit| apply_bytes(&mut data, e));
            let path = dir.path().join("f.json");
            fuzzing::rewrite(&path, &data);
            let pieces = read_all(&path, InputFormat::Json)?;
            prop_assert!(pieces <= records.len() + 2 * edits.len() + 1);
            Ok(())
        })?;
    }
}

proptest! {
    #![proptest_config(config(1500))]

    /// Parquet: open (footer, schema, the text column) and read every row.
    #[test]
    fn fuzz_parquet(edits in parquet_edits(base_parquet().len())) {
        thread_local!(static DIR: Scratch = Scratch::new("fuzz-parquet"));
        DIR.with(|dir| -> Result<(), TestCaseError> {
            let path = fuzzing::damaged_copy(dir.path(), "f.parquet", base_parquet(), &edits);
            read_all(&path, InputFormat::Parquet)?;
            Ok(())
        })?;
    }
}

fn base_parquet() -> &'static [u8] {
    static B: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    B.get_or_init(|| std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/docs/docs.parquet")).unwrap())
}
