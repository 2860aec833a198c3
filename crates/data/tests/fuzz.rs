//! Structured fuzzing of every data loader: token shard headers, manifests (with
//! `check_token_data`), `tokenizer.json`, and loader state. Valid files are mutated (see
//! `fuzzing/`); every case must give `Ok` or an error naming the file, never a panic, an
//! abort or an allocation above the cap.
mod common;
mod fuzzing;

use std::path::PathBuf;
use std::sync::OnceLock;

use common::Scratch;
use ferrolm_data::{
    check_token_data, eval_batches, list_shards, prepare_text_dir, train_byte_level_bpe, DataLoader, LoaderState, PrepareSummary, Shard,
    TokenDtype, Tokenizer,
};
use fuzzing::{apply_bytes, byte_edit, config, json_mutations, mutate_json};
use proptest::prelude::*;
use serde_json::Value;

#[global_allocator]
static ALLOC: fuzzing::CappedAlloc = fuzzing::CappedAlloc;

fn repo_data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data")
}

/// A small byte-level BPE (a few hundred ids, ~10 KB of JSON), trained once: the same
/// structure as real tokenizers at a size that parses in well under a millisecond.
fn small_tokenizer() -> &'static (Tokenizer, Value) {
    static T: OnceLock<(Tokenizer, Value)> = OnceLock::new();
    T.get_or_init(|| {
        let dir = Scratch::new("fuzz-tok");
        let text = std::fs::read_to_string(repo_data().join("corpus/sonnets.txt")).unwrap();
        let file = dir.path().join("a.txt");
        std::fs::write(&file, &text[..text.len().min(20_000)]).unwrap();
        let tok = train_byte_level_bpe(std::slice::from_ref(&file), 300).unwrap();
        let json_path = dir.path().join("tokenizer.json");
        tok.save(&json_path).unwrap();
        let value = serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
        (tok, value)
    })
}

/// Tokenizer text with truncation / padding objects mixed in (including stride >= max_length,
/// which panics inside the tokenizers library when encoding).
fn tokenizer_settings() -> impl Strategy<Value = Option<(&'static str, Value)>> {
    let trunc = (0usize..10, 0usize..12, prop_oneof![Just("LongestFirst"), Just("OnlyFirst")]).prop_map(|(max, stride, strategy)| {
        ("truncation", serde_json::json!({"direction": "Right", "max_length": max, "strategy": strategy, "stride": stride}))
    });
    let pad = (0usize..8).prop_map(|n| {
        (
            "padding",
            serde_json::json!({"strategy": {"Fixed": n}, "direction": "Left", "pad_to_multiple_of": null, "pad_id": 0,
                               "pad_type_id": 0, "pad_token": "<|bos|>"}),
        )
    });
    prop_oneof![2 => Just(None), 1 => trunc.prop_map(Some), 1 => pad.prop_map(Some)]
}

proptest! {
    #![proptest_config(config(1500))]

    /// tokenizer.json: parse, and when it loads, encode/decode must work without panicking.
    #[test]
    fn fuzz_tokenizer_json(setting in tokenizer_settings(), (edits, bytes) in json_mutations(), text in "[ -~]{0,24}") {
        let (_, base) = small_tokenizer();
        let mut base = base.clone();
        if let Some((k, v)) = setting {
            base[k] = v;
        }
        let json = mutate_json(&base, &edits, &bytes);
        match Tokenizer::from_bytes(&json) {
            Ok(tok) => {
                prop_assert!(tok.vocab_size() > 0 && tok.vocab_size() <= i32::MAX as usize);
                prop_assert!(tok.inner().get_truncation().is_none() && tok.inner().get_padding().is_none());
                if let Ok(ids) = tok.encode(&text, true) {
                    prop_assert!(ids.iter().all(|&i| (i as usize) < tok.vocab_size()));
                    let _ = tok.decode(&ids);
                }
                tok.fingerprint().unwrap();
            }
            Err(e) => prop_assert!(e.to_string().contains("<tokenizer json>"), "{}", e),
        }
    }
}

/// A shard file's bytes: header + ids (built here rather than by ShardWriter, whose fsync
/// would dominate the run time).
fn shard_bytes(dtype: TokenDtype, ids: &[u32]) -> Vec<u8> {
    let mut b = Vec::with_capacity(32 + 4 * ids.len());
    b.extend_from_slice(&ferrolm_data::shard::MAGIC);
    b.extend_from_slice(&ferrolm_data::shard::VERSION.to_le_bytes());
    b.extend_from_slice(&(dtype.size() as u32).to_le_bytes());
    b.extend_from_slice(&(ids.len() as u64).to_le_bytes());
    b.extend_from_slice(&[0; 8]);
    for &i in ids {
        match dtype {
            TokenDtype::U16 => b.extend_from_slice(&(i as u16).to_le_bytes()),
            TokenDtype::U32 => b.extend_from_slice(&i.to_le_bytes()),
        }
    }
    b
}

/// Byte edits aimed at the 32-byte header as often as at the payload.
fn shard_edits() -> impl Strategy<Value = Vec<fuzzing::ByteEdit>> {
    use fuzzing::ByteEdit;
    let header = prop_oneof![
        (0usize..32, 1u8..).prop_map(|(at, xor)| ByteEdit::Flip { at, xor }),
        (
            prop_oneof![Just(8usize), Just(12), Just(16), Just(24)],
            prop_oneof![Just(u64::MAX), Just(1u64 << 62), Just(2), Just(4), Just(0), any::<u64>()]
        )
            .prop_map(|(at, value)| ByteEdit::PutU64 { at, value }),
    ];
    proptest::collection::vec(prop_oneof![header, byte_edit()], 0..4)
}

proptest! {
    #![proptest_config(config(3000))]

    /// Token shard headers: open, and when it opens, read every token and feed the loaders.
    #[test]
    fn fuzz_shard_header(wide in any::<bool>(), ids in proptest::collection::vec(0u32..70_000, 0..80), edits in shard_edits()) {
        thread_local!(static DIR: Scratch = Scratch::new("fuzz-shard"));
        DIR.with(|dir| -> Result<(), TestCaseError> {
            let dtype = if wide { TokenDtype::U32 } else { TokenDtype::U16 };
            let ids: Vec<u32> = if wide { ids } else { ids.into_iter().map(|i| i & 0xffff).collect() };
            let mut bytes = shard_bytes(dtype, &ids);
            edits.iter().for_each(|e| apply_bytes(&mut bytes, e));
            let path = dir.path().join("train_000000.bin");
            fuzzing::rewrite(&path, &bytes);
            match Shard::open(&path) {
                Ok(s) => {
                    prop_assert_eq!(bytes.len(), 32 + s.len() * s.dtype().size());
                    let all = s.slice(0, s.len());
                    prop_assert_eq!(s.max_id(), all.iter().copied().max());
                    let _ = s.check_ids(1000);
                    if let Ok(mut l) = DataLoader::open(&[&path], 2, 3, 7) {
                        l.next_batch();
                        l.next_batch();
                    }
                    if let Ok(b) = eval_batches(&[&path], 3, 4) {
                        prop_assert!(b.count() > 0);
                    }
                }
                Err(e) => prop_assert!(e.to_string().contains(&path.display().to_string()), "{}", e),
            }
            Ok(())
        })?;
    }
}

/// A directory prepared with the small tokenizer; the fuzz case rewrites its manifest.
fn prepared_dir() -> Scratch {
    let (tok, _) = small_tokenizer();
    let input = Scratch::new("fuzz-man-in");
    let text = std::fs::read_to_string(repo_data().join("corpus/hamlet.txt")).unwrap();
    std::fs::write(input.path().join("a.txt"), &text[..4000]).unwrap();
    std::fs::write(input.path().join("b.txt"), &text[4000..6000]).unwrap();
    let out = Scratch::new("fuzz-man");
    prepare_text_dir(input.path(), tok, out.path(), 0.2, 300).unwrap();
    out
}

proptest! {
    #![proptest_config(config(1500))]

    /// manifest.json: PrepareSummary::load, list_shards and the full check at open.
    #[test]
    fn fuzz_manifest(edits in json_mutations()) {
        thread_local!(static DIR: (Scratch, Value) = {
            let d = prepared_dir();
            let v = serde_json::from_str(&std::fs::read_to_string(d.path().join("manifest.json")).unwrap()).unwrap();
            (d, v)
        });
        DIR.with(|(dir, base)| -> Result<(), TestCaseError> {
            let (tok, _) = small_tokenizer();
            let manifest = dir.path().join("manifest.json");
            fuzzing::rewrite(&manifest, &mutate_json(base, &edits.0, &edits.1));
            let _ = list_shards(dir.path(), "train");
            let _ = list_shards(dir.path(), "val");
            match check_token_data(dir.path(), tok) {
                Ok(d) => {
                    // Whatever passed is usable: the loader opens it and draws a batch.
                    match DataLoader::open(&d.train_shards, 2, 8, 0) {
                        Ok(mut l) => prop_assert!(l.next_batch().inputs.iter().all(|&i| (i as usize) < tok.vocab_size())),
                        Err(e) => prop_assert!(e.to_string().contains("not enough data"), "{}", e),
                    }
                }
                Err(e) => prop_assert!(e.to_string().contains(&dir.path().display().to_string()), "{}", e),
            }
            if let Ok(Some(s)) = PrepareSummary::load(dir.path()) {
                for p in s.train_shards.iter().chain(&s.val_shards) {
                    prop_assert_eq!(p.parent(), Some(dir.path()));
                }
            }
            Ok(())
        })?;
    }
}

proptest! {
    #![proptest_config(config(2000))]

    /// Loader state (the data side of trainer_state.json): parse, restore, draw batches.
    #[test]
    fn fuzz_loader_state(
        edits in json_mutations(),
        batch in prop_oneof![1usize..5, Just(0), Just(1 << 40), Just(usize::MAX)],
        seq in prop_oneof![1usize..9, Just(0), Just(usize::MAX / 2)],
        world in prop_oneof![1usize..4, Just(0), Just(usize::MAX)],
    ) {
        thread_local!(static DIR: (Scratch, PathBuf) = {
            let d = Scratch::new("fuzz-state");
            let p = common::write_shard(d.path(), "train_000000.bin", &(0..300).collect::<Vec<_>>());
            (d, p)
        });
        DIR.with(|(_, shard)| -> Result<(), TestCaseError> {
            let base = DataLoader::open(&[shard], 2, 8, 3).unwrap();
            let state = serde_json::to_value(base.state()).unwrap();
            let json = mutate_json(&state, &edits.0, &edits.1);
            let mut l = DataLoader::open(&[shard], 2, 8, 1).unwrap();
            let other = DataLoader::open(&[shard], batch, seq, 1).and_then(|l| l.for_rank(world.saturating_sub(1), world));
            let Ok(st) = serde_json::from_slice::<LoaderState>(&json) else { return Ok(()) };
            if l.restore(&st).is_ok() {
                prop_assert_eq!(l.state(), st.clone());
                prop_assert!(st.cursor <= st.num_windows);
                for _ in 0..3 {
                    prop_assert_eq!(l.next_batch().inputs.len(), 16);
                }
            }
            if let Ok(mut other) = other {
                if other.restore(&st).is_ok() {
                    prop_assert_eq!(other.next_batch().inputs.len(), batch * seq);
                }
            }
            Ok(())
        })?;
    }
}
