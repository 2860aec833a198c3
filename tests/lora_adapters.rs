//! A LoRA adapter beside its base (issue 50): the base's identity recorded with a run's adapter
//! (`ferrolm_base.json`) refuses `--resume` onto another base and makes `eval --lora` warn; the
//! adapter's chat template is found before the base's; `export --lora` folds an adapter into
//! its base in the base's format and dtype.
mod common;
use common::*;
use ferrolm::cli::eval::EvalArgs;
use ferrolm::cli::finetune::FinetuneArgs;
use ferrolm::cli::generate::GenerateArgs;
use ferrolm::cli::{error_report, exit_code, parse_from};
use ferrolm::nn::lora::LoraConfig;
use ferrolm::{DType, Device, Llama};
use std::path::{Path, PathBuf};

/// A plain tiny Llama with the bundled tokenizer in `dir`, its weights drawn from `seed`.
fn base(dir: &Path, vocab: usize, seed: u64) -> PathBuf {
    Llama::new(config(vocab, 2), DType::F32, Device::Cpu, &mut ferrolm::tensor::Rng::new(seed)).unwrap().save_pretrained(dir).unwrap();
    std::fs::copy(tokenizer_path(), dir.join("tokenizer.json")).unwrap();
    dir.to_path_buf()
}

fn finetune(model: &Path, data: &Path, out: &Path, extra: &[&str]) -> anyhow::Result<()> {
    let head = ["finetune", "--device=cpu", "--seq-len=16", "--batch-size=2", "--eval-every=0", "--lr=1e-2"];
    let a: FinetuneArgs = parse_from(args(&head, &[flag("model", model), flag("data", data), flag("out", out)], extra)).unwrap();
    ferrolm::cli::finetune::finetune(a).map(drop)
}

fn eval(model: &Path, text: &Path, extra: &[&str]) -> anyhow::Result<f64> {
    let e: EvalArgs =
        parse_from(args(&["eval", "--device=cpu", "--seq-len=16"], &[flag("model", model), flag("text", text)], extra)).unwrap();
    ferrolm::cli::eval::evaluate(e).map(|s| s.loss)
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.path().is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

#[test]
fn a_lora_run_records_its_base_and_refuses_to_resume_on_another() {
    let dir = tmp("lora-base-id");
    let (train, _, vocab) = shards_with(&dir, 0.01);
    let data = train[0].parent().unwrap().to_path_buf();
    let a = base(&dir.join("a"), vocab, 1);
    let b = base(&dir.join("b"), vocab, 2); // the same config, other weights
    let run = dir.join("run");
    let lora = ["--lora-rank=4", "--save-every=1"];
    finetune(&a, &data, &run, &[&lora[..], &["--steps=2"]].concat()).unwrap();

    // Every checkpoint records the base beside PEFT's files (adapter_config.json is PEFT's own).
    let (step1, step2) = (run.join("checkpoints/step-000001"), run.join("checkpoints/step-000002"));
    let rec = json(&step1.join("ferrolm_base.json"));
    assert_eq!(PathBuf::from(rec["base_model_name_or_path"].as_str().unwrap()), std::path::absolute(&a).unwrap());
    assert_eq!(rec["weights_xxh3_128"].as_str().unwrap().len(), 32);
    assert_eq!(rec["config"]["hidden_size"], 32);
    assert!(rec["tensors"].as_u64().unwrap() > 10, "{rec}");
    assert!(json(&step1.join("adapter_config.json")).get("weights_xxh3_128").is_none());
    let peft_before = std::fs::read(step2.join("adapter_config.json")).unwrap();

    // --resume onto base B: refused before any work, naming both bases (a flag error).
    let err = finetune(&b, &data, &run, &[&lora[..], &["--steps=3", "--resume", step2.to_str().unwrap()]].concat()).unwrap_err();
    let e = error_report(&err);
    assert_eq!(exit_code(&err), 2, "{e}");
    for part in [std::path::absolute(&a).unwrap().display().to_string(), format!("--model {}", b.display())] {
        assert!(e.contains(&part), "{part} missing: {e}");
    }
    assert!(e.contains("ferrolm_base.json") && e.contains("weights") && e.contains("--lora-init"), "{e}");
    assert_eq!(std::fs::read(step2.join("adapter_config.json")).unwrap(), peft_before, "the adapter was rewritten");
    assert!(!run.join("checkpoints/step-000003").exists());
    // On its own base it resumes.
    finetune(&a, &data, &run, &[&lora[..], &["--steps=3", "--resume", step2.to_str().unwrap()]].concat()).unwrap();
    assert!(run.join("checkpoints/step-000003/ferrolm_base.json").is_file());

    // eval --lora warns when --model is not the recorded base, and not when it is.
    let text = dir.join("few_sonnets.txt");
    std::fs::write(&text, &std::fs::read_to_string(data_path("corpus/sonnets.txt")).unwrap()[..3000]).unwrap();
    let lora_flag = flag("lora", &run);
    let (r, log) = capture_logs(|| eval(&b, &text, &[&lora_flag]));
    r.unwrap();
    assert!(
        log.contains("warning:") && log.contains("was trained on the base") && log.contains(&format!("--model {}", b.display())),
        "{log}"
    );
    let (r, log) = capture_logs(|| eval(&a, &text, &[&lora_flag]));
    r.unwrap();
    assert!(!log.contains("was trained on the base") && log.contains("was trained on this base"), "{log}");
    // An adapter with no record (PEFT's, an older ferrolm's) is applied with an info line.
    let peft = dir.join("peft");
    copy_dir(&step2, &peft);
    std::fs::remove_file(peft.join("ferrolm_base.json")).unwrap();
    let (r, log) = capture_logs(|| eval(&b, &text, &[&flag("lora", &peft)]));
    r.unwrap();
    assert!(log.contains("has no ferrolm_base.json") && !log.contains("warning:"), "{log}");

    // --lora-init onto another base warns and records the new base.
    let cont = dir.join("cont");
    let (r, log) = capture_logs(|| finetune(&b, &data, &cont, &["--lora-init", step2.to_str().unwrap(), "--steps=1"]));
    r.unwrap();
    assert!(log.contains("warning:") && log.contains("--lora-init") && log.contains("was trained on the base"), "{log}");
    let rec = json(&cont.join("checkpoints/step-000001/ferrolm_base.json"));
    assert_eq!(PathBuf::from(rec["base_model_name_or_path"].as_str().unwrap()), std::path::absolute(&b).unwrap());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn lora_chat_uses_the_adapters_template_before_the_bases() {
    let dir = tmp("lora-template");
    let tok = ferrolm::data::Tokenizer::from_file(tokenizer_path()).unwrap();
    let a = base(&dir.join("base"), tok.vocab_size(), 1); // no chat template
    let mut m = Llama::from_pretrained(&a, DType::F32, Device::Cpu).unwrap();
    m.add_lora(&LoraConfig::new(2, None, 0.0, vec![ferrolm::nn::Proj::Q], false).unwrap(), &mut ferrolm::tensor::Rng::new(3)).unwrap();
    let adapter = dir.join("adapter");
    m.save_adapter(&adapter, a.to_str().unwrap()).unwrap();
    let generate = |extra: &[&str]| {
        let head = ["generate", "--device=cpu", "--chat=Hello", "--max-new-tokens=2", "--temperature=0"];
        let g: GenerateArgs = parse_from(args(&head, &[flag("model", &a), flag("lora", &adapter)], extra)).unwrap();
        ferrolm::cli::generate::run(g)
    };
    let e = error_report(&generate(&[]).unwrap_err());
    assert!(e.contains("no chat template") && e.contains(adapter.to_str().unwrap()) && e.contains(a.to_str().unwrap()), "{e}");

    // The adapter's template (as a LoRA run's checkpoint carries it) is found.
    std::fs::copy(data_path("chat_template.jinja"), adapter.join("chat_template.jinja")).unwrap();
    generate(&[]).unwrap();
    let chat = dir.join("chat.jsonl");
    let lines = std::fs::read_to_string(data_path("chat.jsonl")).unwrap();
    std::fs::write(&chat, lines.lines().take(4).map(|l| format!("{l}\n")).collect::<String>()).unwrap();
    let ev = |lora: bool| {
        let mut v = vec!["eval".to_string(), "--device=cpu".into(), flag("model", &a), flag("chat", &chat)];
        if lora {
            v.push(flag("lora", &adapter));
        }
        ferrolm::cli::eval::run(parse_from::<EvalArgs, _, _>(v).unwrap())
    };
    ev(true).unwrap();
    let e = error_report(&ev(false).unwrap_err());
    assert!(e.contains("no chat template") && !e.contains(adapter.to_str().unwrap()), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

