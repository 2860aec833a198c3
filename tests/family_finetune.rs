//! `finetune --model DIR` on a Qwen2 checkpoint (issue 51): full and LoRA fine-tunes run end to
//! end, and what they save is still a Qwen2 checkpoint. The model is a tiny Qwen2 (bias on q/k/v,
//! tied embeddings) made here with the vocabulary of the tokenizer of
//! tests/fixtures/source_files (300 tokens, a chat template), whose conversations it trains on.
mod common;
use common::*;
use ferrolm::cli::parse_from;
use ferrolm::nn::LlamaConfig;
use ferrolm::{DType, Device, Llama};
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn fixture(rel: &str) -> PathBuf {
    root().join("tests/fixtures/source_files").join(rel)
}

/// A Qwen2 source directory: a fresh model with non-zero biases, the fixture's tokenizer files.
fn qwen2_source(dir: &Path) -> PathBuf {
    let src = dir.join("qwen2");
    std::fs::create_dir_all(&src).unwrap();
    let cfg = LlamaConfig::from_json_str(
        r#"{"model_type":"qwen2","vocab_size":300,"hidden_size":16,"intermediate_size":32,"num_hidden_layers":2,
            "num_attention_heads":2,"num_key_value_heads":1,"max_position_embeddings":256,"tie_word_embeddings":true,
            "bos_token_id":0,"eos_token_id":1,"use_sliding_window":false,"sliding_window":32768,"max_window_layers":2}"#,
    )
    .unwrap();
    let mut m = Llama::new(cfg, DType::F32, Device::Cpu, &mut ferrolm::tensor::Rng::new(3)).unwrap();
    let mut rng = ferrolm::tensor::Rng::new(4);
    m.visit_params_mut(&mut |p, t| {
        if p.name.ends_with(".bias") {
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

fn run(model: &Path, out: &Path, extra: &[&str]) {
    let head = [
        "finetune",
        "--device=cpu",
        "--batch-size=1",
        "--eval-every=0",
        "--lr=3e-2",
        "--seq-len=128",
        "--val-fraction=0",
        "--truncate",
        "--data-format=messages",
    ];
    let paths = [flag("model", model), flag("data", &fixture("conversations.jsonl")), flag("out", out)];
    ferrolm::cli::finetune::finetune(parse_from(args(&head, &paths, extra)).unwrap()).unwrap();
}

fn json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
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
    assert_eq!(json(&ckpt.join("config.json")), json(&src.join("config.json")));
    let after = biases(&ckpt);
    assert!(before.iter().all(|(n, b)| after[n] != *b), "a bias was not trained");

    // LoRA: the biases stay in the frozen base (as PEFT keeps them); the merged model is the
    // source's Qwen2 with them unchanged.
    let lora = dir.join("lora");
    run(&src, &lora, &["--steps=2", "--lora-rank=4", "--merge-lora"]);
    let merged = lora.join("merged");
    assert_eq!(json(&merged.join("config.json"))["model_type"], "qwen2");
    assert_eq!(biases(&merged), before);
    let adapter = json(&lora.join("checkpoints/step-000002/adapter_config.json"));
    assert_eq!(adapter["r"], 4);
    let _ = std::fs::remove_dir_all(&dir);
}
