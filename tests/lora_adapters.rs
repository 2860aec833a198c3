//! A LoRA adapter beside its base (issue 50): the base's identity recorded with a run's adapter
//! (`ferrolm_base.json`) refuses `--resume` onto another base and makes `eval --lora` warn; the
//! adapter's chat template is found before the base's; `export --lora` folds an adapter into
//! its base in the base's format and dtype.
mod common;
use common::*;
use ferrolm::cli::eval::EvalArgs;
use ferrolm::cli::export::ExportArgs;
use ferrolm::cli::finetune::FinetuneArgs;
use ferrolm::cli::generate::GenerateArgs;
use ferrolm::cli::{error_report, exit_code, parse_from};
use ferrolm::nn::lora::LoraConfig;
use ferrolm::nn::safetensors_io::{load_safetensors, save_safetensors, stored_to_f32, visit_stored};
use ferrolm::{DType, Device, Llama};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A plain tiny Llama with the bundled tokenizer in `dir`, its weights drawn from `seed`.
fn base(dir: &Path, vocab: usize, seed: u64) -> PathBuf {
    Llama::new(config(vocab, 2), DType::F32, Device::Cpu, &mut ferrolm::tensor::Rng::new(seed)).unwrap().save_pretrained(dir).unwrap();
    std::fs::copy(tokenizer_path(), dir.join("tokenizer.json")).unwrap();
    dir.to_path_buf()
}

fn finetune(model: &Path, data: &Path, out: &Path, extra: &[&str]) -> anyhow::Result<()> {
    let head = ["finetune", "--device=cpu", "--seq-len=16", "--batch-size=2", "--eval-every=0", "--lr=1e-2"];
    let a: FinetuneArgs = parse_from(run_args(&head, model, data, out, extra)).unwrap();
    ferrolm::cli::finetune::finetune(a).map(drop)
}

fn eval(model: &Path, text: &Path, extra: &[&str]) -> anyhow::Result<f64> {
    let e: EvalArgs =
        parse_from(args(&["eval", "--device=cpu", "--seq-len=16"], &[flag("model", model), flag("text", text)], extra)).unwrap();
    ferrolm::cli::eval::evaluate(e).map(|s| s.loss)
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
    let (data, vocab) = token_data(&dir, 0.01);
    let a = base(&dir.join("a"), vocab, 1);
    let b = base(&dir.join("b"), vocab, 2); // the same config, other weights
    let run = dir.join("run");
    let lora = ["--lora-rank=4", "--save-every=1"];
    finetune(&a, &data, &run, &[&lora[..], &["--steps=2"]].concat()).unwrap();

    // Every checkpoint records the base beside PEFT's files (adapter_config.json is PEFT's own).
    let (step1, step2) = (run.join("checkpoints/step-000001"), run.join("checkpoints/step-000002"));
    let rec = read_json(&step1.join("ferrolm_base.json"));
    assert_eq!(PathBuf::from(rec["base_model_name_or_path"].as_str().unwrap()), std::path::absolute(&a).unwrap());
    assert_eq!(rec["weights_xxh3_128"].as_str().unwrap().len(), 32);
    assert_eq!(rec["config"]["hidden_size"], 32);
    assert!(rec["tensors"].as_u64().unwrap() > 10, "{rec}");
    assert!(read_json(&step1.join("adapter_config.json")).get("weights_xxh3_128").is_none());
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
    let text = few_sonnets(&dir, 3000);
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
    // export --lora warns the same way, and merges all the same.
    let (r, log) = capture_logs(|| export(&b, &run, &dir.join("exported")));
    r.unwrap();
    assert!(log.contains("warning:") && log.contains("was trained on the base"), "{log}");
    assert!(dir.join("exported/model.safetensors").is_file());
    // An adapter with no record (PEFT's, an older ferrolm's) is applied with an info line.
    let peft = dir.join("peft");
    copy_dir(&step2, &peft);
    std::fs::remove_file(peft.join("ferrolm_base.json")).unwrap();
    let (r, log) = capture_logs(|| eval(&b, &text, &[&flag("lora", &peft)]));
    r.unwrap();
    assert!(log.contains("has no ferrolm_base.json") && !log.contains("warning:"), "{log}");
    // A damaged record stops the adapter's use, and the error says how to go on.
    std::fs::write(peft.join("ferrolm_base.json"), "{bad").unwrap();
    let e = error_report(&eval(&b, &text, &[&flag("lora", &peft)]).unwrap_err());
    assert!(e.contains("ferrolm_base.json is not a base record") && e.contains("delete it"), "{e}");
    std::fs::remove_file(peft.join("ferrolm_base.json")).unwrap();

    // --lora-init onto another base warns and records the new base.
    let cont = dir.join("cont");
    let (r, log) = capture_logs(|| finetune(&b, &data, &cont, &["--lora-init", step2.to_str().unwrap(), "--steps=1"]));
    r.unwrap();
    assert!(log.contains("warning:") && log.contains("--lora-init") && log.contains("was trained on the base"), "{log}");
    let rec = read_json(&cont.join("checkpoints/step-000001/ferrolm_base.json"));
    assert_eq!(PathBuf::from(rec["base_model_name_or_path"].as_str().unwrap()), std::path::absolute(&b).unwrap());

    // --lora-init takes a LoRA run as --lora does: its newest complete checkpoint, logged.
    let (r, log) = capture_logs(|| finetune(&a, &data, &dir.join("cont-run"), &[&flag("lora-init", &run), "--steps=1"]));
    r.unwrap();
    assert!(log.contains(&format!("--lora-init {}: using the checkpoint", run.display())) && log.contains("step-000003"), "{log}");

    // The run's adapter given as --model: the error names the base and the flag of the tool
    // that takes an adapter (finetune has --lora-init, no --lora).
    let e = error_report(&finetune(&run, &data, &dir.join("as-model"), &["--steps=1"]).unwrap_err());
    let base_a = std::path::absolute(&a).unwrap().display().to_string();
    assert!(e.contains("not a model") && e.contains("--lora-init") && e.contains(&base_a), "{e}");
    assert!(!dir.join("as-model").exists());
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
    let chat = bundled_lines(&dir, "chat.jsonl", 4);
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

/// Every stored tensor of a model directory's model.safetensors: name -> (dtype, shape, bytes).
fn stored(dir: &Path) -> BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let mut out = BTreeMap::new();
    visit_stored(&dir.join("model.safetensors"), &mut |t| {
        out.insert(t.name.to_string(), (t.dtype.to_string(), t.shape.to_vec(), t.data.to_vec()));
        Ok(())
    })
    .unwrap();
    out
}

fn export(model: &Path, lora: &Path, out: &Path) -> anyhow::Result<()> {
    let e: ExportArgs = parse_from(["export".to_string(), flag("model", model), flag("lora", lora), flag("out", out)]).unwrap();
    ferrolm::cli::export::run(e)
}

#[test]
fn export_lora_folds_an_adapter_into_the_base_in_its_format_and_dtype() {
    let dir = tmp("lora-export");
    let fixture = root().join("tests/fixtures/llama_gqa_untied");
    let adapter = dir.join("adapter");
    copy_dir(&root().join("tests/fixtures/lora_llama"), &adapter);
    std::fs::remove_file(adapter.join("reference.safetensors")).unwrap();
    std::fs::write(adapter.join("chat_template.jinja"), "{% for m in messages %}{{ m.content }}{% endfor %}").unwrap();
    // The fixture base as it is (f32), and stored in bf16.
    let bf16 = dir.join("base-bf16");
    copy_dir(&fixture, &bf16);
    std::fs::remove_file(bf16.join("reference.safetensors")).unwrap();
    let w: Vec<(String, ferrolm::Tensor)> =
        load_safetensors(&fixture.join("model.safetensors"), DType::F32, Device::Cpu).unwrap().into_iter().collect();
    save_safetensors(&bf16.join("model.safetensors"), &w, Some(DType::BF16)).unwrap();

    let cfg = read_json(&adapter.join("adapter_config.json"));
    let scale = cfg["lora_alpha"].as_f64().unwrap() / cfg["r"].as_f64().unwrap();
    let factors = {
        let mut out = BTreeMap::new();
        visit_stored(&adapter.join("adapter_model.safetensors"), &mut |t| {
            out.insert(t.name.to_string(), (t.shape.to_vec(), stored_to_f32(t.dtype, t.data).unwrap()));
            Ok(())
        })
        .unwrap();
        out
    };
    for (base, dtype, tol) in [(&fixture, "F32", 1e-6), (&bf16, "BF16", 1.0 / 256.0)] {
        let out = dir.join(format!("merged-{dtype}"));
        export(base, &adapter, &out).unwrap();
        // The base's config as it is, its tokenizer/generation files, the adapter's template; no
        // training state and no adapter.
        assert_eq!(std::fs::read(out.join("config.json")).unwrap(), std::fs::read(base.join("config.json")).unwrap());
        assert_eq!(std::fs::read(out.join("generation_config.json")).unwrap(), std::fs::read(base.join("generation_config.json")).unwrap());
        assert_eq!(std::fs::read(out.join("chat_template.jinja")).unwrap(), std::fs::read(adapter.join("chat_template.jinja")).unwrap());
        for f in ["adapter_config.json", "optimizer.safetensors", "trainer_state.json", "reference.safetensors", "ferrolm_base.json"] {
            assert!(!out.join(f).exists(), "{f} in the export");
        }
        let (before, after) = (stored(base), stored(&out));
        assert_eq!(before.keys().collect::<Vec<_>>(), after.keys().collect::<Vec<_>>());
        let mut merged = 0;
        for (name, (dt, shape, bytes)) in &after {
            assert_eq!((dt.as_str(), shape), (dtype, &before[name].1), "{name}");
            let site = name.strip_suffix(".weight").unwrap();
            let (Some((sa, fa)), Some((sb, fb))) = (
                factors.get(&format!("base_model.model.{site}.lora_A.weight")),
                factors.get(&format!("base_model.model.{site}.lora_B.weight")),
            ) else {
                assert_eq!(bytes, &before[name].2, "{name}: not adapted, so kept bit for bit");
                continue;
            };
            // W + scale B A, from the base's stored W, in f64 here.
            let (r, inp, outf) = (sa[0], sa[1], sb[0]);
            let w = stored_to_f32(dt, &before[name].2).unwrap();
            let m = stored_to_f32(dt, bytes).unwrap();
            let mut moved = 0.0f64;
            for o in 0..outf {
                for i in 0..inp {
                    let d: f64 = (0..r).map(|k| fb[o * r + k] as f64 * fa[k * inp + i] as f64).sum::<f64>() * scale;
                    let want = w[o * inp + i] as f64 + d;
                    let got = m[o * inp + i] as f64;
                    assert!((got - want).abs() <= tol * want.abs().max(1e-2), "{name}[{o},{i}]: {got} vs {want}");
                    moved = moved.max(d.abs());
                }
            }
            assert!(moved > 1e-3, "{name}: the adapter moved nothing");
            merged += 1;
        }
        assert_eq!(merged, 14, "every projection of both blocks");
    }

    // --out may not be --model, nor hold it: a flag error naming both.
    let err = export(&bf16, &adapter, &dir).unwrap_err();
    assert_eq!(exit_code(&err), 2);
    let e = error_report(&err);
    assert!(e.contains("--out") && e.contains("--model") && e.contains(bf16.to_str().unwrap()), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `eval` of the exported model equals `eval --model BASE --lora ADAPTER` (f32).
#[test]
fn export_lora_evaluates_as_the_adapted_model() {
    let dir = tmp("lora-export-eval");
    let tok = ferrolm::data::Tokenizer::from_file(tokenizer_path()).unwrap();
    let a = base(&dir.join("base"), tok.vocab_size(), 1);
    let mut m = Llama::from_pretrained(&a, DType::F32, Device::Cpu).unwrap();
    let lc = LoraConfig::new(4, Some(16.0), 0.0, ferrolm::nn::Proj::ALL.to_vec(), false).unwrap();
    m.add_lora(&lc, &mut ferrolm::tensor::Rng::new(3)).unwrap();
    let mut rng = ferrolm::tensor::Rng::new(4);
    let _g = ferrolm::tensor::no_grad();
    m.visit_adapters_mut(&mut |p, t| {
        // B starts at zero: give it values so the adapter changes the model.
        if p.name.contains("lora_B") {
            t.assign(&ferrolm::Tensor::randn(p.shape.to_vec(), 0.05, DType::F32, Device::Cpu, &mut rng)?)?;
        }
        Ok(())
    })
    .unwrap();
    let adapter = dir.join("adapter");
    m.save_adapter(&adapter, a.to_str().unwrap()).unwrap();
    let out = dir.join("merged");
    export(&a, &adapter, &out).unwrap();
    let text = few_sonnets(&dir, 3000);
    let plain = eval(&a, &text, &[]).unwrap();
    let adapted = eval(&a, &text, &[&flag("lora", &adapter)]).unwrap();
    let merged = eval(&out, &text, &[]).unwrap();
    assert!((adapted - plain).abs() > 1e-3, "the adapter changed nothing: {adapted} vs {plain}");
    assert!((merged - adapted).abs() <= 1e-6 * adapted, "merged {merged} vs base + adapter {adapted}");
    assert_eq!(std::fs::read(out.join("tokenizer.json")).unwrap(), std::fs::read(a.join("tokenizer.json")).unwrap());
    let _ = std::fs::remove_dir_all(&dir);
}
