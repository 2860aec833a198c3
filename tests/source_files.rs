//! A fine-tune keeps its source's files as they were (issue 50, item 9 and part of 10).
//!
//! The fixture (tests/fixtures/source_files/, made by scripts/make_source_files_fixtures.py) is a
//! tiny Mistral-like chat model as transformers saves it: bos `<s>` id 0, eos `</s>` id 1,
//! `pad_token_id` 1 in its config, bf16 weights, its chat template in `tokenizer_config.json`
//! (`in_config/`) or in `chat_template.jinja` (`in_jinja/`), and transformers' renderings of a few
//! conversations (`expected.json`). A checkpoint must hold the source's tokenizer files byte for
//! byte (so `AutoTokenizer.from_pretrained(checkpoint).apply_chat_template` is the source's), and
//! ferrolm's own rendering of the checkpoint must be transformers' rendering of the source.
mod common;
use common::*;
use ferrolm::cli::parse_from;
use ferrolm::data::chat::{ChatTemplate, Message, Role};
use ferrolm::{DType, Device};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn fixture(rel: &str) -> PathBuf {
    root().join("tests/fixtures/source_files").join(rel)
}

/// `model/` and `variant/` of the fixture joined into `dir/variant`: a source model directory.
fn source(dir: &Path, variant: &str) -> PathBuf {
    let dst = dir.join(variant);
    std::fs::create_dir_all(&dst).unwrap();
    for from in [fixture("model"), fixture(variant)] {
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            if e.file_name() != "expected.json" {
                std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
            }
        }
    }
    dst
}

/// The tokenizer files of the fixture's `variant` source (every file but the model's own).
fn tokenizer_files(variant: &str) -> Vec<String> {
    let mut names: Vec<String> = ["tokenizer.json", "generation_config.json"].map(String::from).to_vec();
    for e in std::fs::read_dir(fixture(variant)).unwrap() {
        let n = e.unwrap().file_name().to_string_lossy().into_owned();
        if n != "expected.json" {
            names.push(n);
        }
    }
    names.sort();
    names
}

const HEAD: [&str; 8] = [
    "--device=cpu",
    "--batch-size=1",
    "--eval-every=0",
    "--lr=3e-3",
    "--seq-len=128",
    "--val-fraction=0",
    "--truncate",
    "--data-format=messages",
];

/// `tool` (finetune or finetune_ladder) on the fixture's conversations.
fn run(tool: &str, model: &Path, out: &Path, extra: &[&str]) {
    // finetune_ladder reports validation losses: half the conversations are held out.
    let val = |a: &'static str| if tool != "finetune" && a == "--val-fraction=0" { "--val-fraction=0.5" } else { a };
    let head: Vec<&str> = std::iter::once(tool).chain(HEAD.map(val)).collect();
    let paths = [flag("model", model), flag("data", &fixture("conversations.jsonl")), flag("out", out)];
    let argv = args(&head, &paths, extra);
    match tool {
        "finetune" => {
            ferrolm::cli::finetune::finetune(parse_from(argv).unwrap()).unwrap();
        }
        _ => ferrolm::cli::finetune_ladder::run(parse_from(argv).unwrap()).unwrap(),
    }
}

fn read(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn conversations() -> Vec<Vec<Message>> {
    std::fs::read_to_string(fixture("conversations.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            let msgs = v["messages"].as_array().unwrap();
            msgs.iter().map(|m| Message::new(Role::parse(m["role"].as_str().unwrap()).unwrap(), m["content"].as_str().unwrap())).collect()
        })
        .collect()
}

/// ferrolm's rendering of `dir`'s chat template is transformers' rendering of the source.
fn renders_as_transformers(dir: &Path, variant: &str) {
    let expected = read_json(&fixture(variant).join("expected.json"));
    let t = ChatTemplate::find(Some(dir), None).unwrap();
    for (conv, want) in conversations().iter().zip(expected["renders"].as_array().unwrap()) {
        assert_eq!(t.render(conv, false).unwrap().text, want["text"].as_str().unwrap(), "{}", dir.display());
        let prompt = t.render(&conv[..conv.len() - 1], true).unwrap().text;
        assert_eq!(prompt, want["prompt"].as_str().unwrap(), "{}", dir.display());
    }
}

#[test]
fn a_fine_tune_keeps_the_source_tokenizer_files_and_its_rendering() {
    let dir = tmp("source-files-keep");
    for variant in ["in_config", "in_jinja"] {
        let src = source(&dir, variant);
        renders_as_transformers(&src, variant); // the fixture itself, as transformers saw it
        let out = dir.join(format!("run-{variant}"));
        run("finetune", &src, &out, &["--steps=2"]);
        let ckpt = out.join("checkpoints/step-000002");
        for name in tokenizer_files(variant) {
            assert!(read(&ckpt.join(&name)) == read(&src.join(&name)), "{variant}: {name} differs from the source's");
        }
        // Nothing of ferrolm's beside them: no template file where the source had none.
        assert_eq!(ckpt.join("chat_template.jinja").is_file(), variant == "in_jinja");
        renders_as_transformers(&ckpt, variant);
        let tc = read_json(&ckpt.join("tokenizer_config.json"));
        assert_eq!((tc["bos_token"].as_str(), tc["eos_token"].as_str()), (Some("<s>"), Some("</s>")));
        assert_eq!(read_json(&ckpt.join("generation_config.json"))["bos_token_id"], 0);
    }
    // A LoRA run: its adapter checkpoints and OUT/merged keep them too, and the merged model the
    // source's config keys and bf16 weights.
    let src = dir.join("in_jinja");
    let out = dir.join("lora");
    run("finetune", &src, &out, &["--steps=1", "--lora-rank=2", "--merge-lora"]);
    for ckpt in [out.join("checkpoints/step-000001"), out.join("merged")] {
        for name in tokenizer_files("in_jinja") {
            assert!(read(&ckpt.join(&name)) == read(&src.join(&name)), "{}: {name} differs from the source's", ckpt.display());
        }
    }
    assert_eq!(read_json(&out.join("merged/config.json")), read_json(&src.join("config.json")));
    assert_eq!(ferrolm::nn::safetensors_io::stored_float_dtype(&out.join("merged")).unwrap(), Some("bfloat16"));
    // finetune_ladder (here only converting) keeps them too, and the config keys it does not change.
    let src = dir.join("in_config");
    let out = dir.join("ladder");
    run("finetune_ladder", &src, &out, &["--steps=0", "--ladder-layers=1"]);
    let ckpt = out.join("checkpoints/step-000000");
    for name in tokenizer_files("in_config") {
        assert!(read(&ckpt.join(&name)) == read(&src.join(&name)), "finetune_ladder: {name} differs from the source's");
    }
    let cfg = read_json(&ckpt.join("config.json"));
    assert_eq!((&cfg["model_type"], &cfg["ladder_layers"], &cfg["pad_token_id"]), (&"llamaLadder".into(), &1.into(), &1.into()));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn chat_template_flag_is_written_where_the_source_kept_its_template() {
    let dir = tmp("source-files-template");
    let other = dir.join("other.jinja");
    let text = std::fs::read_to_string(fixture("in_jinja/chat_template.jinja")).unwrap().replace("[INST]", "[USER]");
    std::fs::write(&other, &text).unwrap();
    let template = format!("--chat-template={}", other.display());
    // In tokenizer_config.json: that value changes, every other line of the file stays.
    let src = source(&dir, "in_config");
    run("finetune", &src, &dir.join("a"), &["--steps=1", &template]);
    let ckpt = dir.join("a/checkpoints/step-000001");
    let (theirs, ours) = (read_json(&src.join("tokenizer_config.json")), read_json(&ckpt.join("tokenizer_config.json")));
    assert_eq!(ours["chat_template"].as_str(), Some(text.as_str()));
    let mut want = theirs.clone();
    want["chat_template"] = text.clone().into();
    assert_eq!(ours, want);
    let lines = |p: &Path| -> Vec<String> {
        String::from_utf8(read(p)).unwrap().lines().filter(|l| !l.contains("\"chat_template\"")).map(String::from).collect()
    };
    assert_eq!(lines(&ckpt.join("tokenizer_config.json")), lines(&src.join("tokenizer_config.json")));
    assert!(!ckpt.join("chat_template.jinja").exists());
    let rendered = ChatTemplate::find(Some(&ckpt), None).unwrap().render(&conversations()[0], false).unwrap().text;
    assert!(rendered.starts_with("<s>[USER] "), "{rendered}");
    // In chat_template.jinja: that file changes, tokenizer_config.json stays byte for byte.
    let src = source(&dir, "in_jinja");
    run("finetune", &src, &dir.join("b"), &["--steps=1", &template]);
    let ckpt = dir.join("b/checkpoints/step-000001");
    assert_eq!(std::fs::read_to_string(ckpt.join("chat_template.jinja")).unwrap(), text);
    assert!(read(&ckpt.join("tokenizer_config.json")) == read(&src.join("tokenizer_config.json")));
    // An explicit --tokenizer (not the model's own): ferrolm writes its files for it.
    let tok = dir.join("tok.json");
    std::fs::copy(src.join("tokenizer.json"), &tok).unwrap();
    run("finetune", &src, &dir.join("c"), &["--steps=1", &format!("--tokenizer={}", tok.display())]);
    let tc = read_json(&dir.join("c/checkpoints/step-000001/tokenizer_config.json"));
    assert_eq!(tc["tokenizer_class"], "PreTrainedTokenizerFast", "{tc}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every stored dtype of `dir`'s model.safetensors.
fn stored(dir: &Path) -> Option<&'static str> {
    ferrolm::nn::safetensors_io::stored_float_dtype(dir).unwrap()
}

#[test]
fn a_bf16_source_is_saved_bf16_with_its_config_keys_and_resumes_exactly() {
    let dir = tmp("source-files-dtype");
    let src = source(&dir, "in_jinja");
    assert_eq!(stored(&src), Some("bfloat16"));
    let whole = dir.join("whole");
    run("finetune", &src, &whole, &["--steps=4", "--save-every=2"]);
    let ckpt = whole.join("checkpoints/step-000002");
    // The source's dtype and every config key: pad_token_id, transformers_version, its spelling.
    assert_eq!(stored(&ckpt), Some("bfloat16"));
    assert_eq!(read_json(&ckpt.join("config.json")), read_json(&src.join("config.json")));
    // Each weight is the training state's f32 weight rounded once, to nearest even.
    let (params, _) = ferrolm_parallel::zero::ckpt::load_full(&ckpt).unwrap();
    let saved = ferrolm::nn::safetensors_io::load_model_dir(&ckpt, DType::F32, Device::Cpu).unwrap();
    assert_eq!(params.len(), saved.len());
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    let mut rounded = 0;
    for (name, p) in &params {
        assert_eq!(p.dtype(), DType::F32);
        let want = bits(p.to_dtype(DType::BF16).unwrap().to_vec_f32().unwrap());
        assert_eq!(bits(saved[name].to_vec_f32().unwrap()), want, "{name}");
        rounded += usize::from(bits(p.to_vec_f32().unwrap()) != want);
    }
    assert!(rounded > 0, "the training state is f32, not already bf16");
    // The bf16 checkpoint loads for eval.
    let m = ferrolm::Llama::from_pretrained(&ckpt, DType::F32, Device::Cpu).unwrap();
    assert_eq!(m.config().bos_token_id, Some(0));
    // --resume reads the f32 state: the resumed run's losses are the whole run's, bit for bit.
    let resumed = dir.join("resumed");
    run("finetune", &src, &resumed, &["--steps=4", "--save-every=2", "--resume", ckpt.to_str().unwrap()]);
    let bits = |run: &Path| losses(run).into_iter().map(f64::to_bits).collect::<Vec<_>>();
    assert_eq!(bits(&whole).len(), 4);
    assert_eq!(bits(&whole), bits(&resumed));
    // --save-dtype f32: f32 weights, and the config says so in both spellings; the rest stays.
    let f32 = dir.join("f32");
    run("finetune", &src, &f32, &["--steps=1", "--save-dtype=f32"]);
    let ckpt = f32.join("checkpoints/step-000001");
    assert_eq!(stored(&ckpt), Some("float32"));
    let mut want = read_json(&src.join("config.json"));
    want["dtype"] = "float32".into();
    want["torch_dtype"] = "float32".into();
    assert_eq!(read_json(&ckpt.join("config.json")), want);
    let _ = std::fs::remove_dir_all(&dir);
}
