//! `finetune --model DIR` on a Qwen2 checkpoint (issue 51): full and LoRA fine-tunes run end to
//! end, and what they save is still a Qwen2 checkpoint. The model is a tiny Qwen2 (bias on q/k/v,
//! tied embeddings) made here with the vocabulary of the tokenizer of
//! tests/fixtures/source_files (300 tokens, a chat template), whose conversations it trains on.
//! `every_command_on_FAMILY` runs each documented tool on a tiny model of each new family: an
//! exact `--resume`, `eval --text` / `--chat`, `generate --prompt` / `--chat`, `export`, LoRA, and
//! `--tp 2` and `--dp 2 --zero 3 --offload-optimizer` against one device.
mod common;
use common::*;
use ferrolm::cli::{error_report, parse_from};
use ferrolm::nn::LlamaConfig;
use ferrolm::{DType, Device, Llama};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn fixture(rel: &str) -> PathBuf {
    root().join("tests/fixtures/source_files").join(rel)
}

/// A Qwen2 source directory: a fresh model with non-zero biases, the fixture's tokenizer files.
fn qwen2_source(dir: &Path) -> PathBuf {
    source_dir(dir, "qwen2", QWEN2, |name| name.ends_with(".bias"))
}

fn run(model: &Path, out: &Path, extra: &[&str]) {
    try_run(model, out, extra).unwrap_or_else(|e| panic!("finetune --out {} {extra:?}: {}", out.display(), error_report(&e)));
}

fn try_run(model: &Path, out: &Path, extra: &[&str]) -> anyhow::Result<()> {
    let mut head = vec![
        "finetune",
        "--device=cpu",
        "--eval-every=0",
        "--lr=3e-2",
        "--seq-len=128",
        "--val-fraction=0",
        "--truncate",
        "--data-format=messages",
    ];
    if !extra.iter().any(|a| a.starts_with("--batch-size")) {
        head.push("--batch-size=1");
    }
    let paths = [flag("model", model), flag("data", &fixture("conversations.jsonl")), flag("out", out)];
    ferrolm::cli::finetune::finetune(parse_from(args(&head, &paths, extra)).unwrap()).map(drop)
}

fn biases(dir: &Path) -> HashMap<String, Vec<f32>> {
    let m = Llama::from_pretrained(dir, DType::F32, Device::Cpu).unwrap();
    assert_eq!(m.config().family, ferrolm::nn::Family::Qwen2, "{}", dir.display());
    m.parameters().into_iter().filter(|(n, _)| n.ends_with(".bias")).map(|(n, t)| (n, t.to_vec::<f32>().unwrap())).collect()
}

#[test]
fn finetune_a_qwen2_checkpoint_full_and_lora() {
    let dir = tmp("family-finetune");
    let src = qwen2_source(&dir);
    let before = biases(&src);
    assert_eq!(before.len(), 6, "q/k/v biases of two layers");

    // Full fine-tune: a Qwen2 checkpoint comes out, its config the source's, its biases trained.
    let full = dir.join("full");
    run(&src, &full, &["--steps=3"]);
    let ckpt = full.join("checkpoints/step-000003");
    assert_eq!(read_json(&ckpt.join("config.json")), read_json(&src.join("config.json")));
    let after = biases(&ckpt);
    assert!(before.iter().all(|(n, b)| after[n] != *b), "a bias was not trained");

    // LoRA: the biases stay in the frozen base (as PEFT keeps them); the merged model is the
    // source's Qwen2 with them unchanged.
    let lora = dir.join("lora");
    run(&src, &lora, &["--steps=2", "--lora-rank=4", "--merge-lora"]);
    let merged = lora.join("merged");
    assert_eq!(read_json(&merged.join("config.json"))["model_type"], "qwen2");
    assert_eq!(biases(&merged), before);
    let adapter = read_json(&lora.join("checkpoints/step-000002/adapter_config.json"));
    assert_eq!(adapter["r"], 4);
    let _ = std::fs::remove_dir_all(&dir);
}

/// One `#[test]` per family, each running `$run(family, config keys)`.
macro_rules! per_family {
    ($run:ident: $($test:ident => $family:literal, $cfg:expr;)*) => {
        $(
            #[test]
            fn $test() {
                $run($family, $cfg);
            }
        )*
    };
}

/// The config keys of the families' tiny source models (over `family_source`'s shared shape)
/// that `every_command` and `ladder_of` both run; qwen2's differ between the two (sliding window):
/// `QWEN2` is `every_command`'s (and the LoRA test's source).
const QWEN2: &str = r#""tie_word_embeddings":true,"use_sliding_window":false,"sliding_window":32768,"max_window_layers":2"#;
const QWEN3: &str = r#""tie_word_embeddings":false,"head_dim":12,"attention_bias":true"#;
const MISTRAL: &str = r#""tie_word_embeddings":false,"head_dim":12,"sliding_window":8"#;
const GEMMA3_TEXT: &str = r#""tie_word_embeddings":true,"head_dim":12,"query_pre_attn_scalar":10,"hidden_activation":"gelu_pytorch_tanh",
    "layer_types":["sliding_attention","full_attention"],"sliding_window":8,
    "rope_parameters":{"full_attention":{"rope_type":"default","rope_theta":1000000.0},"sliding_attention":{"rope_type":"default","rope_theta":100.0}}"#;

/// A source directory of `model_type` `family` (config keys `cfg` over a tiny shared shape, 300
/// tokens), its weights fresh with non-zero biases and norms, and the fixture's tokenizer files.
fn family_source(dir: &Path, family: &str, cfg: &str) -> PathBuf {
    source_dir(dir, family, cfg, |name| name.ends_with(".bias") || name.ends_with("norm.weight"))
}

/// A source directory of `model_type` `family` (config keys `cfg` over the tiny shared shape),
/// its weights fresh, those whose names `drawn` picks drawn again with std 0.1, and the fixture's
/// tokenizer files.
fn source_dir(dir: &Path, family: &str, cfg: &str, drawn: impl Fn(&str) -> bool) -> PathBuf {
    let src = dir.join(family);
    std::fs::create_dir_all(&src).unwrap();
    let json = format!(
        r#"{{"model_type":"{family}","vocab_size":300,"hidden_size":16,"intermediate_size":32,"num_hidden_layers":2,
            "num_attention_heads":2,"num_key_value_heads":1,"max_position_embeddings":256,"bos_token_id":0,"eos_token_id":1,{cfg}}}"#
    );
    let cfg = LlamaConfig::from_json_str(&json).unwrap_or_else(|e| panic!("{family}: {e}"));
    let mut m = Llama::new(cfg, DType::F32, Device::Cpu, &mut ferrolm::tensor::Rng::new(3)).unwrap();
    let mut rng = ferrolm::tensor::Rng::new(4);
    m.visit_params_mut(&mut |p, t| {
        if drawn(p.name) {
            *t = ferrolm::Tensor::randn(p.shape.to_vec(), 0.1, DType::F32, Device::Cpu, &mut rng)?;
        }
        Ok(())
    })
    .unwrap();
    m.save_pretrained(&src).unwrap();
    for f in [fixture("model/tokenizer.json"), fixture("in_jinja/chat_template.jinja"), fixture("in_jinja/tokenizer_config.json")] {
        std::fs::copy(&f, src.join(f.file_name().unwrap())).unwrap();
    }
    src
}

fn every_command(family: &str, cfg: &str) {
    let dir = tmp(&format!("family-commands-{family}"));
    let src = family_source(&dir, family, cfg);
    let steps = ["--steps=4", "--save-every=2"];

    // Exact resume: steps 3 and 4 continued from step 2's checkpoint in another --out.
    let whole = dir.join("whole");
    run(&src, &whole, &[&steps[..], &["--batch-size=2"]].concat());
    let one = losses(&whole);
    assert_eq!(one.len(), 4, "{family}: {one:?}");
    let step2 = whole.join("checkpoints/step-000002");
    let resumed = dir.join("resumed");
    run(&src, &resumed, &[&steps[..], &["--batch-size=2", &flag("resume", &step2)]].concat());
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&losses(&resumed)), bits(&one), "{family}: resumed from step 2");

    // eval and generate read the fine-tuned checkpoint (its tokenizer and chat template).
    let ckpt = whole.join("checkpoints/step-000004");
    assert_eq!(read_json(&ckpt.join("config.json"))["model_type"], family);
    let text = dir.join("text.txt");
    std::fs::write(&text, "Who's there? Nay, answer me: stand, and unfold yourself. Long live the king!").unwrap();
    let eval = |extra: &[String]| {
        let head = ["eval", "--device=cpu", "--batch-size=2"];
        let e = parse_from(args(&head, &[flag("model", &ckpt)], &extra.iter().map(String::as_str).collect::<Vec<_>>())).unwrap();
        ferrolm::cli::eval::evaluate(e).unwrap_or_else(|e| panic!("{family} eval {extra:?}: {}", error_report(&e)))
    };
    let s = eval(&[flag("text", &text), "--seq-len=8".into()]);
    assert!(s.loss.is_finite() && s.tokens > 0, "{family} eval --text: {s:?}");
    let s = eval(&[flag("chat", &fixture("conversations.jsonl")), "--seq-len=128".into(), "--truncate".into()]);
    assert!(s.loss.is_finite() && s.tokens > 0, "{family} eval --chat: {s:?}");
    for g in ["--prompt=Who's there?", "--chat=Who's there?"] {
        let head = ["generate", "--device=cpu", g, "--max-new-tokens=6", "--temperature=0"];
        let a = parse_from(args(&head, &[flag("model", &ckpt)], &[])).unwrap();
        ferrolm::cli::generate::generate(a).unwrap_or_else(|e| panic!("{family} generate {g}: {}", error_report(&e)));
    }

    // export keeps the family.
    let exported = dir.join("exported");
    let e = parse_from(["export".to_string(), flag("model", &ckpt), flag("out", &exported)]).unwrap();
    ferrolm::cli::export::run(e).unwrap_or_else(|e| panic!("{family} export: {}", error_report(&e)));
    assert_eq!(read_json(&exported.join("config.json"))["model_type"], family);
    Llama::from_pretrained(&exported, DType::F32, Device::Cpu).unwrap();

    // LoRA: the adapter trains, and the merged model is still the family.
    let lora = dir.join("lora");
    run(&src, &lora, &["--steps=2", "--lora-rank=4", "--merge-lora"]);
    assert_eq!(read_json(&lora.join("merged/config.json"))["model_type"], family);
    assert_eq!(read_json(&lora.join("checkpoints/step-000002/adapter_config.json"))["r"], 4);

    // Tensor parallelism, and data parallelism with ZeRO-3 and the optimizer offloaded (the same
    // global batch: two ranks of one conversation), each equal one device.
    let tp = dir.join("tp2");
    run(&src, &tp, &[&steps[..], &["--batch-size=2", "--tp=2"]].concat());
    close(&losses(&tp), &one, 1e-5, &format!("{family} --tp 2"));
    let dp = dir.join("dp2");
    run(&src, &dp, &[&steps[..], &["--batch-size=1", "--dp=2", "--zero=3", "--offload-optimizer"]].concat());
    close(&losses(&dp), &one, 1e-5, &format!("{family} --dp 2 --zero 3 --offload-optimizer"));
    let _ = std::fs::remove_dir_all(&dir);
}

per_family! { every_command:
    every_command_on_qwen2 => "qwen2", QWEN2;
    every_command_on_qwen3 => "qwen3", QWEN3;
    every_command_on_mistral => "mistral", MISTRAL;
    every_command_on_gemma3_text => "gemma3_text", GEMMA3_TEXT;
}

/// `pretrain_llama --config FILE.json` with the config.json transformers wrote for the family's
/// fixture `fixture` (bias, QK-norm, explicit head_dim, Gemma's sandwich norms, sliding windows),
/// its vocabulary widened to the bundled tokenizer's: it pretrains from scratch, and the
/// checkpoint reloads as the same family with the same config and the parameter `feature`. With
/// `ladder`, `--ladder-layers all` makes it a Ladder model of the family.
fn pretrain_from_config(fixture: &str, family: &str, feature: &str, ladder: bool) {
    let dir = tmp(&format!("family-pretrain-{family}"));
    let (data, vocab) = token_data(&dir, 0.1);
    let mut cfg = read_json(&root().join("tests/fixtures").join(fixture).join("config.json"));
    cfg["vocab_size"] = vocab.into();
    let file = dir.join(format!("{fixture}.json"));
    std::fs::write(&file, cfg.to_string()).unwrap();
    let mut want = LlamaConfig::from_file(&file).unwrap();
    let out = dir.join(fixture);
    let mut flags = vec!["--steps=2", "--batch-size=2", "--eval-every=0", "--save-every=2", "--lr=1e-2"];
    if ladder {
        flags.push("--ladder-layers=all");
        want.ladder_layers = Some(ferrolm::nn::LadderLayers::Last(want.num_hidden_layers));
    }
    let a = pretrain_args(&data, &file, &out, &flags);
    ferrolm::cli::pretrain::run(a).unwrap_or_else(|e| panic!("pretrain_llama --config {fixture}: {}", error_report(&e)));
    let l = losses(&out);
    assert!(l.len() == 2 && l.iter().all(|x| x.is_finite()), "{family}: {l:?}");
    let ckpt = out.join("checkpoints/step-000002");
    let c = read_json(&ckpt.join("config.json"));
    let written = if ladder { &c["ladder_source_model_type"] } else { &c["model_type"] };
    assert_eq!(written, family, "{c}");
    let m = Llama::from_pretrained(&ckpt, DType::F32, Device::Cpu).unwrap();
    let got = m.config();
    // The same model; only the special ids come from the tokenizer.
    let same = LlamaConfig { bos_token_id: got.bos_token_id, eos_token_id: got.eos_token_id.clone(), ..want };
    assert_eq!(*got, same, "{family}: the checkpoint's config");
    assert!(m.parameters().iter().any(|(n, _)| n == feature), "{family}: no {feature}");
    assert!(m.layers.iter().all(|b| b.ladder == ladder), "{family}: Ladder blocks");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn pretrain_from_a_qwen2_config() {
    pretrain_from_config("qwen2_window", "qwen2", "model.layers.0.self_attn.q_proj.bias", false);
}

#[test]
fn pretrain_from_a_qwen3_config() {
    pretrain_from_config("qwen3_qknorm_untied", "qwen3", "model.layers.0.self_attn.k_norm.weight", false);
}

#[test]
fn pretrain_from_a_mistral_config() {
    pretrain_from_config("mistral_window", "mistral", "lm_head.weight", false);
}

#[test]
fn pretrain_from_a_gemma3_text_config() {
    pretrain_from_config("gemma3_mixed_tied", "gemma3_text", "model.layers.2.post_feedforward_layernorm.weight", false);
    // A Ladder Transformer of a family from scratch.
    pretrain_from_config("gemma3_mixed_tied", "gemma3_text", "model.layers.2.post_feedforward_layernorm.weight", true);
}

fn ladder(model: &Path, out: &Path, extra: &[&str]) {
    let head = [
        "finetune_ladder",
        "--device=cpu",
        "--eval-every=0",
        "--lr=3e-2",
        "--seq-len=128",
        "--batch-size=2",
        "--val-fraction=0.5",
        "--truncate",
        "--data-format=messages",
    ];
    let paths = [flag("model", model), flag("data", &fixture("conversations.jsonl")), flag("out", out)];
    let a = parse_from(args(&head, &paths, extra)).unwrap();
    ferrolm::cli::finetune_ladder::run(a).unwrap_or_else(|e| panic!("finetune_ladder {extra:?}: {}", error_report(&e)));
}

/// The loss of `m` on a fixed batch of the fixture tokenizer's ids.
fn fixed_loss(m: &Llama) -> f32 {
    let ids: Vec<i32> = (0..2 * 24).map(|i| i * 37 % 300).collect();
    let tg: Vec<i32> = ids.iter().map(|&i| (i * 7 + 3) % 300).collect();
    let t = |v: Vec<i32>| ferrolm::Tensor::from_vec(v, vec![2, 24], Device::Cpu).unwrap();
    m.loss(&t(ids), &t(tg)).unwrap().to_vec::<f32>().unwrap()[0]
}

/// `finetune_ladder` on a model of `family`: with 0 Ladder layers the converted checkpoint is
/// the source model exactly (the same loss, bit for bit); with every layer a Ladder block it
/// trains, and the checkpoint reloads as a Ladder model of the same family (config key
/// `ladder_source_model_type`, no Llama remote code) with the same loss after another save.
fn ladder_of(family: &str, cfg: &str) {
    let dir = tmp(&format!("family-ladder-{family}"));
    let src = family_source(&dir, family, cfg);
    let source = Llama::from_pretrained(&src, DType::F32, Device::Cpu).unwrap();
    let base = fixed_loss(&source);

    let zero = dir.join("zero");
    ladder(&src, &zero, &["--ladder-layers=0", "--steps=0"]);
    let ck = zero.join("checkpoints/step-000000");
    let c = read_json(&ck.join("config.json"));
    assert_eq!((&c["model_type"], &c["ladder_source_model_type"], &c["ladder_layers"]), (&"llamaLadder".into(), &family.into(), &0.into()));
    assert!(c.get("auto_map").is_none(), "{family}: the Llama remote code does not compute this family: {c}");
    for (name, _) in ferrolm_nn::ladder_hf::FILES {
        assert!(!ck.join(name).exists(), "{family}: {name} written");
    }
    let m = Llama::from_pretrained(&ck, DType::F32, Device::Cpu).unwrap();
    assert_eq!(m.config().family.model_type(), family);
    assert_eq!(m.config().ladder_layers, Some(ferrolm::nn::LadderLayers::Last(0)));
    assert_eq!(fixed_loss(&m).to_bits(), base.to_bits(), "{family}: 0 Ladder layers is the source model");

    let all = dir.join("all");
    ladder(&src, &all, &["--ladder-layers=all", "--steps=3"]);
    let l = losses(&all);
    assert!(l.len() == 3 && l.iter().all(|x| x.is_finite()), "{family}: {l:?}");
    // Under tensor parallelism (each branch's all-reduce pending across the next branch, the
    // sandwich's post-norm after it): one device's losses.
    let tp = dir.join("tp2");
    ladder(&src, &tp, &["--ladder-layers=all", "--steps=3", "--tp=2"]);
    close(&losses(&tp), &l, 1e-5, &format!("{family} Ladder --tp 2"));
    let ck = all.join("checkpoints/step-000003");
    let mut m = Llama::from_pretrained(&ck, DType::F32, Device::Cpu).unwrap();
    assert_eq!((m.config().family.model_type(), m.layers.iter().all(|b| b.ladder)), (family, true));
    let trained = fixed_loss(&m);
    assert_ne!(trained.to_bits(), base.to_bits(), "{family}: trained");
    let again = dir.join("again");
    m.save_pretrained(&again).unwrap();
    let m2 = Llama::from_pretrained(&again, DType::F32, Device::Cpu).unwrap();
    assert_eq!(fixed_loss(&m2).to_bits(), trained.to_bits(), "{family}: reloaded");
    // The Ladder schedule is what computes it: the same weights as standard blocks give other
    // logits.
    let logits =
        |m: &Llama| m.forward(&ferrolm::Tensor::from_vec((0..24).collect::<Vec<i32>>(), vec![1, 24], Device::Cpu).unwrap()).unwrap();
    let scheduled = logits(&m).to_vec::<f32>().unwrap();
    m.set_ladder_layers(None).unwrap();
    assert_ne!(logits(&m).to_vec::<f32>().unwrap(), scheduled, "{family}: the Ladder schedule is off");

    // LoRA on the converted model: the merged model is the family's Ladder model.
    let lora = dir.join("lora");
    ladder(&src, &lora, &["--ladder-layers=1", "--steps=2", "--lora-rank=4", "--merge-lora"]);
    let merged = lora.join("merged");
    let c = read_json(&merged.join("config.json"));
    assert_eq!((&c["model_type"], &c["ladder_source_model_type"]), (&"llamaLadder".into(), &family.into()), "{family}: {c}");
    let m = Llama::from_pretrained(&merged, DType::F32, Device::Cpu).unwrap();
    assert_eq!(m.config().ladder_layers, Some(ferrolm::nn::LadderLayers::Last(1)));
    let _ = std::fs::remove_dir_all(&dir);
}

per_family! { ladder_of:
    ladder_of_qwen2 => "qwen2", r#""tie_word_embeddings":true,"use_sliding_window":true,"sliding_window":8,"max_window_layers":1"#;
    ladder_of_qwen3 => "qwen3", QWEN3;
    ladder_of_mistral => "mistral", MISTRAL;
    ladder_of_gemma3_text => "gemma3_text", GEMMA3_TEXT;
}
