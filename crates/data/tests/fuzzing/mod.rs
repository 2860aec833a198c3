//! Structured fuzzing helpers shared by the loader fuzz tests (ferrolm-data's, and ferrolm-nn's
//! through `#[path]`): mutations of valid files (JSON trees edited with hostile values, bytes
//! flipped, numbers spliced in, files cut short) as proptest strategies, and an allocator that
//! refuses any single allocation above [`ALLOC_LIMIT`], so a loader that trusts a size from the
//! file aborts the test instead of quietly allocating terabytes.
//!
//! The oracle is proptest's own: it runs each case under `catch_unwind`, so a panic anywhere in
//! a loader fails the test with the input that caused it (shrunk).
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};

use proptest::prelude::*;
use proptest::test_runner::Config;
use serde_json::Value;

/// The largest single allocation a loader may make on fuzzed input.
pub const ALLOC_LIMIT: usize = 256 << 20;

/// [`System`], but allocations above [`ALLOC_LIMIT`] fail (the process then aborts with
/// "memory allocation of N bytes failed", which fails the test run).
pub struct CappedAlloc;

// SAFETY: forwards to the system allocator unchanged, except that it may return null (an
// allowed allocation failure) for large requests.
unsafe impl GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > ALLOC_LIMIT {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's contract for `layout` is the same as System's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc`/`realloc` above, that is from System.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > ALLOC_LIMIT {
            return std::ptr::null_mut();
        }
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > ALLOC_LIMIT {
            return std::ptr::null_mut();
        }
        // SAFETY: `ptr` came from System with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Replaces the file at `path` with `bytes`. Removing it first keeps this fast: truncating a
/// file in place makes ext4 flush it on close (auto_da_alloc), milliseconds per case.
pub fn rewrite(path: &std::path::Path, bytes: &[u8]) {
    let _ = std::fs::remove_file(path);
    std::fs::write(path, bytes).unwrap();
}

/// `cases` cases, no regression files written into the source tree, no shrinking marathons.
pub fn config(cases: u32) -> Config {
    Config { cases, failure_persistence: None, max_shrink_iters: 2000, ..Config::default() }
}

/// Values that break naive size arithmetic and type assumptions.
pub fn hostile_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::from(u64::MAX)),
        Just(Value::from(i64::MIN)),
        Just(Value::from(1u64 << 40)),
        Just(Value::from(1_000_000_000_000u64)),
        Just(Value::from(u32::MAX)),
        Just(Value::from(i32::MAX as u64 + 1)),
        Just(Value::from(-1)),
        Just(Value::from(0)),
        Just(Value::from(1)),
        Just(Value::from(3)),
        Just(serde_json::json!(1e308)),
        Just(serde_json::json!(-0.0)),
        Just(serde_json::json!(0.5)),
        Just(Value::Null),
        Just(Value::Bool(true)),
        Just(Value::String(String::new())),
        Just(Value::String("../../etc/passwd".into())),
        Just(serde_json::json!([])),
        Just(serde_json::json!({})),
        Just(serde_json::json!([u64::MAX, 0])),
        (0u64..100_000).prop_map(Value::from),
        "[a-z_]{0,12}".prop_map(Value::String),
    ]
}

/// One edit of a JSON tree; `at` picks a node (pre-order index modulo the node count).
#[derive(Clone, Debug)]
pub enum JsonEdit {
    Replace { at: usize, with: Value },
    Remove { at: usize },
    Insert { at: usize, key: String, with: Value },
}

pub fn json_edit() -> impl Strategy<Value = JsonEdit> {
    prop_oneof![
        4 => (any::<usize>(), hostile_value()).prop_map(|(at, with)| JsonEdit::Replace { at, with }),
        1 => any::<usize>().prop_map(|at| JsonEdit::Remove { at }),
        1 => (any::<usize>(), "[a-z_]{1,10}", hostile_value()).prop_map(|(at, key, with)| JsonEdit::Insert { at, key, with }),
    ]
}

/// JSON pointers of every node, in pre-order.
fn pointers(v: &Value, here: String, out: &mut Vec<String>) {
    out.push(here.clone());
    match v {
        Value::Object(m) => m.iter().for_each(|(k, c)| pointers(c, format!("{here}/{}", k.replace('~', "~0").replace('/', "~1")), out)),
        Value::Array(a) => a.iter().enumerate().for_each(|(i, c)| pointers(c, format!("{here}/{i}"), out)),
        _ => {}
    }
}

pub fn apply_json(v: &mut Value, edit: &JsonEdit) {
    let mut ptrs = Vec::new();
    pointers(v, String::new(), &mut ptrs);
    let pick = |at: usize| ptrs[at % ptrs.len()].clone();
    match edit {
        JsonEdit::Replace { at, with } => {
            if let Some(n) = v.pointer_mut(&pick(*at)) {
                *n = with.clone();
            }
        }
        JsonEdit::Remove { at } => {
            let p = pick(*at);
            let Some(cut) = p.rfind('/') else { return };
            let (parent, key) = (&p[..cut], p[cut + 1..].replace("~1", "/").replace("~0", "~"));
            match v.pointer_mut(parent) {
                Some(Value::Object(m)) => {
                    m.remove(&key);
                }
                Some(Value::Array(a)) => {
                    if let Ok(i) = key.parse::<usize>() {
                        if i < a.len() {
                            a.remove(i);
                        }
                    }
                }
                _ => {}
            }
        }
        JsonEdit::Insert { at, key, with } => match v.pointer_mut(&pick(*at)) {
            Some(Value::Object(m)) => {
                m.insert(key.clone(), with.clone());
            }
            Some(Value::Array(a)) => a.push(with.clone()),
            _ => {}
        },
    }
}

/// One edit of a byte string; positions are taken modulo the length.
#[derive(Clone, Debug)]
pub enum ByteEdit {
    Flip {
        at: usize,
        xor: u8,
    },
    Truncate {
        at: usize,
    },
    /// Inserts the text of a large or odd number (into JSON digits, or a binary header).
    Splice {
        at: usize,
        text: String,
    },
    /// Overwrites 8 bytes with a little-endian u64 (binary headers).
    PutU64 {
        at: usize,
        value: u64,
    },
}

pub fn byte_edit() -> impl Strategy<Value = ByteEdit> {
    let numbers = prop_oneof![
        Just("18446744073709551615".to_string()),
        Just("99999999999999999999999".to_string()),
        Just("1e400".to_string()),
        Just("-1".to_string()),
        Just("4294967296".to_string()),
        Just("000".to_string()),
        Just("\"".to_string()),
        Just("}".to_string()),
        Just("\\u0000".to_string()),
    ];
    let values = prop_oneof![Just(u64::MAX), Just(1u64 << 62), Just(u32::MAX as u64), Just(1u64 << 40), Just(0u64), any::<u64>()];
    prop_oneof![
        3 => (any::<usize>(), 1u8..).prop_map(|(at, xor)| ByteEdit::Flip { at, xor }),
        1 => any::<usize>().prop_map(|at| ByteEdit::Truncate { at }),
        2 => (any::<usize>(), numbers).prop_map(|(at, text)| ByteEdit::Splice { at, text }),
        2 => (any::<usize>(), values).prop_map(|(at, value)| ByteEdit::PutU64 { at, value }),
    ]
}

/// Applies `edit`; edits with a position use `at % len` (an empty string only grows).
pub fn apply_bytes(b: &mut Vec<u8>, edit: &ByteEdit) {
    let n = b.len();
    match edit {
        ByteEdit::Flip { at, xor } if n > 0 => b[at % n] ^= xor,
        ByteEdit::Truncate { at } => b.truncate(if n == 0 { 0 } else { at % n }),
        ByteEdit::Splice { at, text } => {
            let at = if n == 0 { 0 } else { at % n };
            b.splice(at..at, text.bytes());
        }
        ByteEdit::PutU64 { at, value } if n >= 8 => {
            let at = at % (n - 7);
            b[at..at + 8].copy_from_slice(&value.to_le_bytes());
        }
        _ => {}
    }
}

/// A valid JSON document mutated: tree edits (which keep it parseable, so deeper checks run),
/// then, in about half the cases, byte edits of its text.
pub fn mutate_json(base: &Value, edits: &[JsonEdit], bytes: &[ByteEdit]) -> Vec<u8> {
    let mut v = base.clone();
    edits.iter().for_each(|e| apply_json(&mut v, e));
    let mut text = serde_json::to_vec(&v).expect("a JSON value serialises");
    bytes.iter().for_each(|e| apply_bytes(&mut text, e));
    text
}

/// Edits for [`mutate_json`]: up to 3 tree edits, and byte edits in about half the cases.
pub fn json_mutations() -> impl Strategy<Value = (Vec<JsonEdit>, Vec<ByteEdit>)> {
    (proptest::collection::vec(json_edit(), 0..4), prop_oneof![Just(Vec::new()), proptest::collection::vec(byte_edit(), 1..3)])
}

/// Byte edits of a Parquet file of `len` bytes, aimed at the footer (the Thrift metadata and its
/// length) as often as at the pages.
pub fn parquet_edits(len: usize) -> impl Strategy<Value = Vec<ByteEdit>> {
    let tail = (0usize..400, 1u8..).prop_map(move |(back, xor)| ByteEdit::Flip { at: len.saturating_sub(1 + back), xor });
    let length = prop_oneof![Just(u64::MAX), Just(1u64 << 31), Just(len as u64), Just(0u64), any::<u64>()]
        .prop_map(move |value| ByteEdit::PutU64 { at: len - 12, value });
    proptest::collection::vec(prop_oneof![3 => tail, 1 => length, 3 => byte_edit()], 1..4)
}

/// Writes `base` with `edits` applied as `dir/name`; returns the path.
pub fn damaged_copy(dir: &std::path::Path, name: &str, base: &[u8], edits: &[ByteEdit]) -> std::path::PathBuf {
    let mut data = base.to_vec();
    edits.iter().for_each(|e| apply_bytes(&mut data, e));
    let path = dir.join(name);
    rewrite(&path, &data);
    path
}

/// Opens the damaged Parquet file `path` with `open` and reads every record, passing each to
/// `each`: a file that does not open, a record or a stream that fails, must say `path` in its
/// error, and the reader must end (within 100,000 records).
pub fn read_damaged_records(
    path: &std::path::Path,
    open: impl FnOnce(&ferrolm_data::InputFile) -> Result<ferrolm_data::chat::RecordReader, ferrolm_data::ReadError>,
    mut each: impl FnMut(&ferrolm_data::chat::Json),
) -> Result<(), TestCaseError> {
    use ferrolm_data::ReadError;
    let name = path.display().to_string();
    let bytes = std::fs::metadata(path).unwrap().len();
    let file = ferrolm_data::InputFile { path: path.to_path_buf(), format: ferrolm_data::InputFormat::Parquet, bytes, modified: None };
    let mut r = match open(&file) {
        Ok(r) => r,
        Err(e) => {
            let e = e.into_error().to_string();
            prop_assert!(e.contains(&name), "{}", e);
            return Ok(());
        }
    };
    for _ in 0..100_000 {
        match r.next_record() {
            Ok(Some((_, rec))) => each(&rec),
            Ok(None) => return Ok(()),
            Err(ReadError::Record(e)) => prop_assert!(e.to_string().contains(&name), "{}", e),
            Err(ReadError::Stream(e)) => {
                prop_assert!(e.to_string().contains(&name), "{}", e);
                return Ok(());
            }
        }
    }
    Err(TestCaseError::fail("the reader never ended"))
}
