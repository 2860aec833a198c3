//! Damaged and hostile inputs to the data pipeline: each gives an error naming the file and the
//! field (or shard and position), never a panic, and a problem with prepared data is found when
//! it is opened, not at the step that first draws a bad id.
mod common;

use std::path::{Path, PathBuf};

use common::{write_shard, Scratch};
use ferrolm_data::{
    check_shard_ids, check_token_data, list_shards, prepare_text_dir, DataLoader, LoaderState, PrepareSummary, Shard, Tokenizer,
};
use serde_json::{json, Value};

fn repo_data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data")
}

fn bundled_json() -> Value {
    serde_json::from_str(&std::fs::read_to_string(repo_data().join("tokenizer.json")).unwrap()).unwrap()
}

fn bundled() -> Tokenizer {
    Tokenizer::from_file(repo_data().join("tokenizer.json")).unwrap()
}

fn write_json(dir: &Path, name: &str, v: &Value) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, serde_json::to_string(v).unwrap()).unwrap();
    p
}

fn err_of<T>(r: ferrolm_data::Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

/// A prepared directory of a few KB of the bundled corpus, in small shards.
fn prepared(tag: &str) -> (Scratch, Scratch) {
    let input = Scratch::new(&format!("{tag}-in"));
    let text = std::fs::read_to_string(repo_data().join("corpus/sonnets.txt")).unwrap();
    let cut = text.char_indices().nth(12_000).map_or(text.len(), |(i, _)| i);
    std::fs::write(input.path().join("a.txt"), &text[..cut]).unwrap();
    let out = Scratch::new(&format!("{tag}-out"));
    prepare_text_dir(input.path(), &bundled(), out.path(), 0.1, 1000).unwrap();
    (input, out)
}

/// Found by the fuzzer: a template post-processor that names a special token it does not
/// define made the tokenizers library panic ("no entry found for key") while encoding.
#[test]
fn template_with_an_undefined_special_token_is_refused() {
    let mut v = bundled_json();
    // The bundled post-processor: Sequence [ByteLevel, TemplateProcessing].
    let template = v["post_processor"]["processors"][1].clone();
    assert_eq!(template["type"], "TemplateProcessing", "{}", v["post_processor"]);
    let mut broken = template.clone();
    broken["special_tokens"] = json!({});
    v["post_processor"]["processors"][1] = broken.clone();
    let e = err_of(Tokenizer::from_bytes(serde_json::to_string(&v).unwrap().as_bytes()));
    assert!(e.contains("`post_processor.processors[1]`") && e.contains("special token"), "{e}");
    // On its own as well.
    v["post_processor"] = broken;
    let e = err_of(Tokenizer::from_bytes(serde_json::to_string(&v).unwrap().as_bytes()));
    assert!(e.contains("`post_processor`") && e.contains("special token"), "{e}");
}

/// Found by the fuzzer in CI: serde also reads a struct written as an array, so a template
/// piece `{"SpecialToken": ["<undefined>", 0]}` slipped past a check of the raw JSON and the
/// library panicked while encoding. The check now reads the library's own parse.
#[test]
fn a_template_piece_spelt_as_an_array_is_checked_too() {
    let mut v = bundled_json();
    let single = &mut v["post_processor"]["processors"][1]["single"];
    single.as_array_mut().unwrap().push(json!({"SpecialToken": ["<|undefined|>", 0]}));
    let e = err_of(Tokenizer::from_bytes(serde_json::to_string(&v).unwrap().as_bytes()));
    assert!(e.contains("`post_processor.processors[1]`") && e.contains("<|undefined|>"), "{e}");
    // A special token spelt as an array with an id outside the vocabulary, likewise.
    let mut v = bundled_json();
    v["post_processor"]["processors"][1]["special_tokens"]["<|bos|>"] = json!(["<|bos|>", [999999], ["<|bos|>"]]);
    let e = err_of(Tokenizer::from_bytes(serde_json::to_string(&v).unwrap().as_bytes()));
    assert!(e.contains("`post_processor`") && e.contains("999999"), "{e}");
}

/// Also found by the fuzzer: a continuing_subword_prefix that the second token of a merge
/// lacks (the library slices it off and panics), and special-token ids outside the vocabulary
/// (encoding would emit ids the embedding does not have).
#[test]
fn bpe_prefix_and_special_token_ids_are_checked() {
    let mut v = bundled_json();
    v["model"]["continuing_subword_prefix"] = json!("##########");
    let e = err_of(Tokenizer::from_bytes(serde_json::to_string(&v).unwrap().as_bytes()));
    assert!(e.contains("`model.merges`") && e.contains("continuing_subword_prefix"), "{e}");
    let mut v = bundled_json();
    v["post_processor"]["processors"][1]["special_tokens"]["<|bos|>"]["ids"] = json!([999999]);
    let e = err_of(Tokenizer::from_bytes(serde_json::to_string(&v).unwrap().as_bytes()));
    assert!(e.contains("`post_processor`") && e.contains("999999"), "{e}");
}

#[test]
fn tokenizer_with_truncation_is_refused_naming_file_and_field() {
    let dir = Scratch::new("tok-trunc");
    let mut v = bundled_json();
    // stride >= max_length: the tokenizers library panics while encoding such a tokenizer.
    v["truncation"] = json!({"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 8});
    let p = write_json(dir.path(), "tokenizer.json", &v);
    let e = err_of(Tokenizer::from_file(&p));
    assert!(e.contains(&p.display().to_string()) && e.contains("`truncation`") && e.contains("stride 8"), "{e}");
    // A harmless-looking truncation silently cuts documents: refused too.
    v["truncation"] = json!({"direction": "Right", "max_length": 512, "strategy": "LongestFirst", "stride": 0});
    let e = err_of(Tokenizer::from_bytes(serde_json::to_string(&v).unwrap().as_bytes()));
    assert!(e.contains("`truncation`"), "{e}");
}

#[test]
fn tokenizer_with_padding_is_refused_naming_file_and_field() {
    let dir = Scratch::new("tok-pad");
    let mut v = bundled_json();
    v["padding"] = json!({"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": null,
                          "pad_id": 0, "pad_type_id": 0, "pad_token": "<|bos|>"});
    let p = write_json(dir.path(), "tokenizer.json", &v);
    let e = err_of(Tokenizer::from_file(&p));
    assert!(e.contains(&p.display().to_string()) && e.contains("`padding`"), "{e}");
}

#[test]
fn sparse_and_huge_token_ids() {
    let mut v = bundled_json();
    v["model"]["vocab"]["<|far|>"] = json!(100_000);
    // The embedding table must cover the largest id, not just count the tokens.
    let tok = Tokenizer::from_bytes(serde_json::to_string(&v).unwrap().as_bytes()).unwrap();
    assert_eq!(tok.vocab_size(), 100_001);
    // Ids that do not fit the i32 ids of a batch are refused at load (u32::MAX would also
    // overflow inside the tokenizers library when it numbers the added tokens).
    for id in [3_000_000_000u64, u32::MAX as u64] {
        v["model"]["vocab"]["<|far|>"] = json!(id);
        let e = err_of(Tokenizer::from_bytes(serde_json::to_string(&v).unwrap().as_bytes()));
        assert!(e.contains("`model.vocab`") && e.contains("<|far|>") && e.contains(&id.to_string()), "{e}");
    }
    let mut v = bundled_json();
    v["added_tokens"][1]["id"] = json!(u64::MAX);
    let e = err_of(Tokenizer::from_bytes(serde_json::to_string(&v).unwrap().as_bytes()));
    assert!(e.contains("`added_tokens`"), "{e}");
}

#[test]
fn prepared_data_passes_its_own_check_and_records_the_tokenizer() {
    let (_in, out) = prepared("chk-ok");
    let tok = bundled();
    let data = check_token_data(out.path(), &tok).unwrap();
    assert!(data.warnings.is_empty(), "{:?}", data.warnings);
    assert!(!data.train_shards.is_empty() && !data.val_shards.is_empty());
    assert_eq!(data.summary.tokenizer_fingerprint, Some(tok.fingerprint().unwrap()));
    assert_eq!(data.summary.shards.len(), data.train_shards.len() + data.val_shards.len());
    // The fingerprint does not depend on how the file is laid out.
    let reread = Tokenizer::from_bytes(serde_json::to_string_pretty(&bundled_json()).unwrap().as_bytes()).unwrap();
    assert_eq!(reread.fingerprint().unwrap(), tok.fingerprint().unwrap());
}

/// What decides the ids is the tokenizer without its post-processor, and the framing: a
/// checkpoint's copy of the tokenizer (its post-processor rewritten to the framing's prefix)
/// checks against data prepared with the original, and so does a manifest written before the
/// fingerprint left the post-processor out (the whole canonical JSON hashed).
#[test]
fn a_checkpoints_tokenizer_and_an_old_fingerprint_match_the_data() {
    use std::hash::Hasher;
    let (_in, out) = prepared("chk-ckpt");
    let tok = bundled();
    let saved = tok.for_checkpoint().unwrap();
    assert_ne!(saved.encode("a", true).unwrap(), tok.encode("a", true).unwrap(), "the rewritten post-processor adds no <|bos|>");
    assert!(check_token_data(out.path(), &saved).unwrap().warnings.is_empty());
    let manifest = out.path().join("manifest.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
    let mut h = fnv::FnvHasher::default();
    h.write(tok.inner().to_string(false).unwrap().as_bytes());
    v["tokenizer_fingerprint"] = json!(format!("{:016x}", h.finish()));
    write_json(out.path(), "manifest.json", &v);
    assert!(check_token_data(out.path(), &tok).unwrap().warnings.is_empty());
}

#[test]
fn data_from_another_tokenizer_is_found_at_open() {
    let (_in, out) = prepared("chk-tok");
    let manifest = out.path().join("manifest.json");
    // Another vocabulary size.
    let mut v = bundled_json();
    let mut extra = v["added_tokens"][0].clone();
    extra["id"] = json!(4096);
    extra["content"] = json!("<|extra|>");
    v["added_tokens"].as_array_mut().unwrap().push(extra);
    let bigger = Tokenizer::from_bytes(serde_json::to_string(&v).unwrap().as_bytes()).unwrap();
    let e = err_of(check_token_data(out.path(), &bigger));
    assert!(e.contains(&manifest.display().to_string()) && e.contains("`vocab_size`") && e.contains("4097"), "{e}");
    // Same size, different tokenizer (a normaliser changes every id it touches).
    let mut v = bundled_json();
    v["normalizer"] = json!({"type": "Lowercase"});
    let other = Tokenizer::from_bytes(serde_json::to_string(&v).unwrap().as_bytes()).unwrap();
    assert_eq!(other.vocab_size(), 4096);
    let e = err_of(check_token_data(out.path(), &other));
    assert!(e.contains("`tokenizer_fingerprint`"), "{e}");
}

#[test]
fn old_manifest_without_fingerprint_loads_with_a_warning() {
    let (_in, out) = prepared("chk-old");
    let manifest = out.path().join("manifest.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
    let obj = v.as_object_mut().unwrap();
    obj.remove("tokenizer_fingerprint");
    obj.remove("shards");
    write_json(out.path(), "manifest.json", &v);
    let data = check_token_data(out.path(), &bundled()).unwrap();
    assert_eq!(data.warnings.len(), 1);
    assert!(data.warnings[0].contains("tokenizer_fingerprint"), "{:?}", data.warnings);
}

#[test]
fn a_shard_with_ids_outside_the_vocabulary_is_found_at_open() {
    let (_in, out) = prepared("chk-ids");
    let tok = bundled();
    let victim = list_shards(out.path(), "train").unwrap()[1].clone();
    let n = Shard::open(&victim).unwrap().len();
    let mut ids = vec![5u32; n];
    ids[n - 3] = 4096 + 7; // one past the vocabulary, still a valid u16
    std::fs::remove_file(&victim).unwrap();
    write_shard(out.path(), victim.file_name().unwrap().to_str().unwrap(), &ids);
    let e = err_of(check_token_data(out.path(), &tok));
    assert!(e.contains(&victim.display().to_string()) && e.contains("4103") && e.contains(&format!("position {}", n - 3)), "{e}");
    let e = err_of(check_shard_ids(&[&victim], tok.vocab_size()));
    assert!(e.contains("4103"), "{e}");
    assert!(check_shard_ids(&[&victim], 5000).is_ok());
}

#[test]
fn shards_come_from_the_manifest_not_a_file_pattern() {
    let (_in, out) = prepared("chk-list");
    let listed = list_shards(out.path(), "train").unwrap();
    // A stray file that matches the old pattern is not data.
    write_shard(out.path(), "train_999999.bin", &[1, 2, 3]);
    assert_eq!(list_shards(out.path(), "train").unwrap(), listed);
    assert!(list_shards(out.path(), "nonsense").is_err());
    // A directory that was never completely prepared (no manifest) has no shards.
    let bare = Scratch::new("chk-bare");
    write_shard(bare.path(), "train_000000.bin", &[1, 2, 3]);
    let e = err_of(list_shards(bare.path(), "train"));
    assert!(e.contains("manifest.json") && e.contains("prepare"), "{e}");
    let e = err_of(check_token_data(bare.path(), &bundled()));
    assert!(e.contains("manifest.json"), "{e}");
}

#[test]
fn hostile_manifests_are_errors_naming_the_field() {
    let (_in, out) = prepared("chk-man");
    let path = out.path().join("manifest.json");
    let good: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let tok = bundled();
    type Edit = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(&str, Edit)> = vec![
        ("train_shards", Box::new(|v| v["train_shards"][0] = json!("../../etc/passwd"))),
        ("train_shards", Box::new(|v| v["train_shards"][0] = json!("/abs/train_000000.bin"))),
        ("val_shards", Box::new(|v| v["val_shards"][0] = json!(".."))),
        ("listed twice", Box::new(|v| v["val_shards"][0] = v["train_shards"][0].clone())),
        ("`shards`", Box::new(|v| v["shards"].as_array_mut().unwrap().pop().map(|_| ()).unwrap())),
        ("`train_tokens`", Box::new(|v| v["train_tokens"] = json!(u64::MAX))),
        ("`vocab_size`", Box::new(|v| v["vocab_size"] = json!(0))),
        ("holds", Box::new(|v| v["shards"][0]["tokens"] = json!(1))),
        ("manifest", Box::new(|v| v["dtype"] = json!("U8"))),
        (
            "`train_shards`",
            Box::new(|v| {
                v["train_shards"] = json!([]);
                v.as_object_mut().unwrap().remove("shards");
            }),
        ),
    ];
    for (want, edit) in cases {
        let mut v = good.clone();
        edit(&mut v);
        write_json(out.path(), "manifest.json", &v);
        let e = err_of(check_token_data(out.path(), &tok));
        assert!(e.contains(want), "{want}: {e}");
    }
    std::fs::write(&path, &serde_json::to_string(&good).unwrap()[..40]).unwrap();
    let e = err_of(check_token_data(out.path(), &tok));
    assert!(e.contains(&path.display().to_string()) && e.contains("bad manifest"), "{e}");
    assert!(PrepareSummary::load(out.path()).is_err());
}

#[test]
fn batch_sizes_in_the_trillions_are_refused_before_allocating() {
    let dir = Scratch::new("ld-huge");
    let p = write_shard(dir.path(), "train_000000.bin", &(0..200).collect::<Vec<_>>());
    let e = err_of(DataLoader::open(&[&p], 1 << 40, 16, 0));
    assert!(e.contains("batch size 1099511627776"), "{e}");
    assert!(DataLoader::open(&[&p], usize::MAX, usize::MAX, 0).is_err());
    assert!(ferrolm_data::eval_batches(&[&p], 1 << 40, 16).is_err());
    let l = DataLoader::open(&[&p], 1 << 20, 16, 0).unwrap();
    assert!(l.for_rank(0, 1 << 20).is_err(), "world_size x batch overflows the per-step budget");
}

#[test]
fn loader_state_out_of_range_is_refused_naming_the_field() {
    let dir = Scratch::new("ld-state");
    let p = write_shard(dir.path(), "train_000000.bin", &(0..200).collect::<Vec<_>>());
    let mut l = DataLoader::open(&[&p], 2, 16, 0).unwrap();
    let good = l.state();
    let e = err_of(l.restore(&LoaderState { cursor: good.num_windows + 1, ..good.clone() }));
    assert!(e.contains("`cursor`"), "{e}");
    let e = err_of(l.restore(&LoaderState { num_windows: u64::MAX, ..good.clone() }));
    assert!(e.contains("`num_windows`"), "{e}");
    let e = err_of(l.restore(&LoaderState { seq_len: usize::MAX, ..good.clone() }));
    assert!(e.contains("`seq_len`"), "{e}");
    // An epoch counter no run can reach would overflow when the epoch ends.
    let e = err_of(l.restore(&LoaderState { cursor: good.num_windows, epoch: u64::MAX, ..good.clone() }));
    assert!(e.contains("`epoch`"), "{e}");
    // The last position of an epoch is valid and rolls over into the next.
    l.restore(&LoaderState { cursor: good.num_windows, epoch: 41, ..good }).unwrap();
    assert_eq!(l.next_batch().inputs.len(), 32);
    assert_eq!(l.epoch(), 42);
}
