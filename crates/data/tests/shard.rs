mod common;

use common::Scratch;
use ferrolm_data::{Shard, ShardWriter, TokenDtype};

fn round_trip(dtype: TokenDtype, tokens: &[u32]) {
    let dir = Scratch::new("shard-rt");
    let path = dir.path().join("a.bin");
    let mut w = ShardWriter::create(&path, dtype).unwrap();
    w.write(&tokens[..tokens.len() / 2]).unwrap();
    w.write(&tokens[tokens.len() / 2..]).unwrap();
    assert_eq!(w.finish().unwrap(), tokens.len() as u64);
    assert!(!dir.path().join("a.bin.tmp").exists(), "temp file must be renamed away");

    let s = Shard::open(&path).unwrap();
    assert_eq!(s.dtype(), dtype);
    assert_eq!(s.len(), tokens.len());
    assert_eq!(s.slice(0, s.len()), tokens);
    assert_eq!(s.get(3), tokens[3]);
    assert_eq!(s.slice(2, 5), &tokens[2..7]);
    let file_len = std::fs::metadata(&path).unwrap().len();
    assert_eq!(file_len, 32 + (tokens.len() * dtype.size()) as u64);
}

#[test]
fn round_trip_u16() {
    let tokens: Vec<u32> = (0..1000).map(|i| (i * 7919) % 65536).collect();
    round_trip(TokenDtype::U16, &tokens);
}

#[test]
fn round_trip_u32() {
    let tokens: Vec<u32> = (0..1000u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    round_trip(TokenDtype::U32, &tokens);
}

#[test]
fn dtype_for_vocab_picks_u16_when_possible() {
    assert_eq!(TokenDtype::for_vocab(4096), TokenDtype::U16);
    assert_eq!(TokenDtype::for_vocab(65536), TokenDtype::U16);
    assert_eq!(TokenDtype::for_vocab(128_256), TokenDtype::U32);
}

#[test]
fn u16_shard_rejects_wide_ids_and_leaves_nothing() {
    let dir = Scratch::new("shard-wide");
    let path = dir.path().join("w.bin");
    let mut w = ShardWriter::create(&path, TokenDtype::U16).unwrap();
    let err = w.write(&[1, 70_000]).unwrap_err().to_string();
    assert!(err.contains("70000"), "{err}");
    drop(w);
    assert!(!path.exists());
    assert!(!dir.path().join("w.bin.tmp").exists());
}

#[test]
fn truncated_shard_is_an_error_naming_the_path() {
    let dir = Scratch::new("shard-trunc");
    let path = common::write_shard(dir.path(), "t.bin", &(0..100).collect::<Vec<_>>());
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
    let err = Shard::open(&path).err().expect("truncated shard must not open").to_string();
    assert!(err.contains(&path.display().to_string()) && err.contains("truncated"), "{err}");

    std::fs::write(&path, &bytes[..20]).unwrap(); // shorter than the header
    let err = Shard::open(&path).err().unwrap().to_string();
    assert!(err.contains(&path.display().to_string()) && err.contains("truncated"), "{err}");
}

#[test]
fn foreign_file_and_bad_version_are_errors() {
    let dir = Scratch::new("shard-foreign");
    let path = dir.path().join("notes.txt");
    std::fs::write(&path, "this is just some text, long enough to hold a header").unwrap();
    let err = Shard::open(&path).err().unwrap().to_string();
    assert!(err.contains(&path.display().to_string()), "{err}");
    assert!(err.contains("not a ferrolm token shard (bad magic)"), "{err}");

    let path = common::write_shard(dir.path(), "v.bin", &[1, 2, 3]);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8] = 9;
    std::fs::write(&path, &bytes).unwrap();
    let err = Shard::open(&path).err().unwrap().to_string();
    assert!(err.contains("unsupported token shard version 9"), "{err}");

    let missing = dir.path().join("missing.bin");
    let err = Shard::open(&missing).err().unwrap().to_string();
    assert!(err.contains("missing.bin"), "{err}");
}

#[test]
fn empty_shard_round_trips() {
    let dir = Scratch::new("shard-empty");
    let path = common::write_shard(dir.path(), "e.bin", &[]);
    let s = Shard::open(&path).unwrap();
    assert!(s.is_empty());
}
