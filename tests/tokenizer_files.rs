//! A checkpoint's Hugging Face tokenizer files (`ferrolm::tokenizer_files`) against transformers:
//! `AutoTokenizer.from_pretrained(dir)` with its default `add_special_tokens=True` must give the
//! ids ferrolm feeds for a prompt (`Tokenizer::encode_as_document`: the start of a document as
//! the training data framed it), and the special ids of `tokenizer_config.json` and
//! `generation_config.json` must be the framing's.
//!
//! The fixture (tests/fixtures/tokenizer_files/, made by scripts/make_tokenizer_fixtures.py):
//! for each source tokenizer (ferrolm's own, EOS-framed; a Llama-style `<s> $A` one, EOS-framed
//! too; one whose template closes a document, `<s> $A </s>`), the files ferrolm writes
//! (`checkpoint/`, which this test regenerates with FERROLM_WRITE_FIXTURES=1 and otherwise
//! requires to be what ferrolm writes today), and what transformers 5.23 reads from them
//! (`expected.json`). Then pretrain_llama's and finetune_ladder's checkpoints carry the files.
mod common;
use common::*;
use ferrolm::data::{DocFraming, Tokenizer};
use ferrolm::tokenizer_files::{write_tokenizer_files, SpecialIds};
use serde_json::Value;
use std::path::{Path, PathBuf};

const FILES: [&str; 3] = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"];
const VARIANTS: [&str; 3] = ["ferrolm", "llama", "closed"];

fn fixture(variant: &str) -> PathBuf {
    root().join("tests/fixtures/tokenizer_files").join(variant)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn id(v: &Value, key: &str) -> Option<u32> {
    v.get(key).and_then(Value::as_u64).map(|x| x as u32)
}

#[test]
fn transformers_reads_the_ids_ferrolm_feeds() {
    let bless = std::env::var("FERROLM_WRITE_FIXTURES").is_ok_and(|v| v == "1");
    for variant in VARIANTS {
        let dir = fixture(variant);
        let source = Tokenizer::from_file(dir.join("source/tokenizer.json")).unwrap();
        let written = tmp(&format!("tokfiles-{variant}"));
        write_tokenizer_files(&written, &source, None).unwrap();
        for f in FILES {
            let (new, committed) = (written.join(f), dir.join("checkpoint").join(f));
            if bless {
                std::fs::create_dir_all(committed.parent().unwrap()).unwrap();
                std::fs::copy(&new, &committed).unwrap();
            }
            assert_eq!(read_json(&new), read_json(&committed), "{variant}: ferrolm now writes another {f} than the fixture's");
        }
        if bless {
            continue; // expected.json comes from transformers, after this
        }
        let want = read_json(&dir.join("expected.json"));
        let saved = Tokenizer::from_file(written.join("tokenizer.json")).unwrap();
        for (prompt, hf) in want["prompts"].as_array().unwrap().iter().zip(want["input_ids"].as_array().unwrap()) {
            let (prompt, hf) = (prompt.as_str().unwrap(), ids(hf));
            assert_eq!(source.encode_as_document(prompt).unwrap(), hf, "{variant}: {prompt:?}: ferrolm's prompt vs transformers'");
            assert_eq!(saved.encode(prompt, true).unwrap(), hf, "{variant}: {prompt:?}: the saved tokenizer with special tokens");
        }
        let s = SpecialIds::of(&source).unwrap();
        let config = read_json(&written.join("generation_config.json"));
        for (key, mine) in [("bos_token_id", s.bos), ("eos_token_id", s.eos), ("pad_token_id", s.pad)] {
            assert_eq!(id(&want["tokenizer"], key), mine, "{variant}: AutoTokenizer's {key}");
            assert_eq!(id(&want["generation_config"], key), mine, "{variant}: GenerationConfig's {key}");
            assert_eq!(id(&config, key), mine, "{variant}: generation_config.json's {key}");
        }
        assert!(s.pad.is_some(), "{variant}: a pad token for batched padding");
        // A framing that only puts a token after each document keeps its ids in the checkpoint's
        // tokenizer: data prepared with the source checks against it (the fingerprint).
        if DocFraming::of(&source).unwrap().prefix.is_empty() {
            assert_eq!(saved.fingerprint().unwrap(), source.fingerprint().unwrap(), "{variant}");
        }
        let _ = std::fs::remove_dir_all(&written);
    }
}

/// The files are in every checkpoint: pretrain_llama's (its config.json's special ids are the
/// generation config's), and finetune_ladder's from it.
#[test]
fn checkpoints_carry_the_tokenizer_files() {
    let at = ParallelDir::new("tokfiles-ckpt", 0.1);
    let run = at.dir.join("run");
    ferrolm::cli::pretrain::run(pretrain_args(&at.data, &at.cfg, &run, &["--steps=1", "--batch-size=2", "--eval-every=0"])).unwrap();
    let ckpt = run.join("checkpoints/step-000001");
    let bundled = Tokenizer::from_file(tokenizer_path()).unwrap();
    let check = |dir: &Path| {
        for f in FILES {
            assert!(dir.join(f).is_file(), "{} has no {f}", dir.display());
        }
        let saved = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        assert_eq!(saved.encode("Shall I", true).unwrap(), bundled.encode("Shall I", false).unwrap(), "no <|bos|> before a prompt");
        let t = read_json(&dir.join("tokenizer_config.json"));
        assert_eq!(t["tokenizer_class"], "PreTrainedTokenizerFast");
        // The bundled data puts <|eos|> after every document: it is what a document starts after.
        assert_eq!(
            (t["bos_token"].as_str(), t["eos_token"].as_str(), t["pad_token"].as_str()),
            (Some("<|eos|>"), Some("<|eos|>"), Some("<|eos|>"))
        );
        let g = read_json(&dir.join("generation_config.json"));
        let eos = bundled.eos_id();
        assert_eq!((id(&g, "bos_token_id"), id(&g, "eos_token_id"), id(&g, "pad_token_id")), (eos, eos, eos));
        g
    };
    let g = check(&ckpt);
    let config = read_json(&ckpt.join("config.json"));
    assert_eq!((id(&config, "bos_token_id"), id(&config, "eos_token_id")), (id(&g, "bos_token_id"), id(&g, "eos_token_id")));
    let out = at.dir.join("ladder");
    let flags = [flag("model", &ckpt), flag("data", &at.data), flag("out", &out)];
    let a = ferrolm::cli::parse_from(args(
        &["finetune_ladder", "--device=cpu", "--ladder-layers=all", "--steps=0", "--seq-len=16"],
        &flags,
        &[],
    ))
    .unwrap();
    ferrolm::cli::finetune_ladder::run(a).unwrap();
    check(&out.join("checkpoints/step-000000"));
}
