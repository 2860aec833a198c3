//! QLoRA through the tools (`--quantize-base nf4` in the LoRA flag group; `eval`/`generate
//! --quantize-base`): a fine-tune over the 4-bit base lowers the validation loss and saves a
//! plain PEFT adapter, `--merge-lora` dequantizes and merges, `--tp 2`, `--dp 2` and
//! `--offload-optimizer` follow one device, ZeRO-3 and bad flags are refused by name (exit 2).
mod common;
use common::*;
use ferrolm::cli::eval::EvalArgs;
use ferrolm::cli::finetune::FinetuneArgs;
use ferrolm::cli::finetune_ladder::FinetuneLadderArgs;
use ferrolm::cli::generate::GenerateArgs;
use ferrolm::cli::{error_report, exit_code, parse_from};
use ferrolm::{DType, Device, Llama};
use ferrolm_ops::nf4::QuantSpec;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// One test at a time: a test that captures the log reads tracing's per-callsite interest,
/// which the others' uncaptured runs of the same callsites can reset meanwhile.
static SERIAL: Mutex<()> = Mutex::new(());

/// A Llama whose every linear layer splits at --tp 2 into whole blocks of 64 (hidden 128,
/// intermediate 256: o_proj's and down_proj's rows split into 64 and 128 columns), with the
/// bundled tokenizer and chat template.
fn model(dir: &Path) -> PathBuf {
    let tok = ferrolm::data::Tokenizer::from_file(tokenizer_path()).unwrap();
    let cfg = ferrolm::nn::LlamaConfig::from_json_str(&format!(
        r#"{{"model_type":"llama","vocab_size":{},"hidden_size":128,"intermediate_size":256,"num_hidden_layers":2,
            "num_attention_heads":4,"num_key_value_heads":2,"max_position_embeddings":128,"tie_word_embeddings":false}}"#,
        tok.vocab_size()
    ))
    .unwrap();
    chat_model_of(dir, cfg)
}

#[test]
fn a_qlora_finetune_trains_a_peft_adapter_over_the_4bit_base_and_merges_it() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tmp("qlora-chat");
    let ck = model(&dir);
    let data = bundled_lines(&dir, "chat.jsonl", 60);
    let out = dir.join("run");
    let head =
        ["finetune", "--device=cpu", "--batch-size=2", "--eval-every=0", "--lr=2e-2", "--seq-len=128", "--steps=6", "--val-fraction=0.1"];
    let lora = ["--lora-rank", "4", "--quantize-base", "nf4", "--merge-lora"];
    let a: FinetuneArgs = parse_from(run_args(&head, &ck, &data, &out, &lora)).unwrap();
    let (o, logs) = capture_logs(|| ferrolm::cli::finetune::finetune(a));
    let o = o.unwrap();
    assert!(logs.contains("QLoRA base: 14 linear weights") && logs.contains("4-bit nf4 with double quantization"), "{logs}");
    assert!(logs.contains("the embeddings, norms, biases and LM head stay in f32"), "{logs}");
    let (before, after) = (o.val_before.unwrap(), o.val_after.unwrap());
    assert!(after < before - 1e-3, "validation loss {before} -> {after}");

    // A plain PEFT adapter for the --model directory (no base weights in the checkpoint).
    let step = out.join("checkpoints/step-000006");
    assert!(step.join("adapter_model.safetensors").is_file() && !step.join("model.safetensors").exists());
    let c = read_json(&step.join("adapter_config.json"));
    assert_eq!(PathBuf::from(c["base_model_name_or_path"].as_str().unwrap()), std::path::absolute(&ck).unwrap());

    // The adapter over the 4-bit base (what trained) is not the adapter over the f32 base; the
    // merged checkpoint is the former, dense, in the base's f32, without quantization_config.
    let mut q = Llama::from_pretrained_quantized(&ck, DType::F32, Device::Cpu, QuantSpec::QLORA).unwrap();
    q.load_adapter(&step).unwrap();
    let qlora = sonnet_loss(&q);
    let mut dense = Llama::from_pretrained(&ck, DType::F32, Device::Cpu).unwrap();
    dense.load_adapter(&step).unwrap();
    assert!((sonnet_loss(&dense) - qlora).abs() > 1e-5, "the 4-bit base changed nothing");
    let merged_dir = out.join("merged");
    let merged = Llama::from_pretrained(&merged_dir, DType::F32, Device::Cpu).unwrap();
    assert!(merged.quant_base().is_none());
    assert!((sonnet_loss(&merged) - qlora).abs() < 1e-5 * qlora, "merged {} vs QLoRA {qlora}", sonnet_loss(&merged));
    let mc = read_json(&merged_dir.join("config.json"));
    assert!(mc.get("quantization_config").is_none());
    assert_eq!(ferrolm::nn::safetensors_io::stored_float_dtype(&merged_dir).unwrap(), Some("float32"));

    // eval and generate take --quantize-base, with and without --lora.
    let text = few_sonnets(&dir, 4000);
    for extra in [vec!["--quantize-base=nf4", "--lora", step.to_str().unwrap()], vec!["--quantize-base=nf4"]] {
        let head = ["eval", "--device=cpu", "--seq-len=16"];
        let e: EvalArgs = parse_from(args(&head, &[flag("model", &ck), flag("text", &text)], &extra)).unwrap();
        let (r, logs) = capture_logs(|| ferrolm::cli::eval::run(e));
        r.unwrap();
        assert!(logs.contains("QLoRA base: 14 linear weights"), "{logs}");
    }
    generate_a_few(&ck, &["--quantize-base=nf4", "--lora", step.to_str().unwrap(), "--tp=2"]).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

fn ladder(ck: &Path, data: &Path, out: &Path, extra: &[&str]) -> anyhow::Result<()> {
    let head = ["finetune_ladder", "--device=cpu", "--seq-len=16", "--eval-every=0", "--ladder-layers=1", "--lr=1e-2"];
    let a: FinetuneLadderArgs = parse_from(run_args(&head, ck, data, out, extra)).unwrap();
    ferrolm::cli::finetune_ladder::run(a)
}

#[test]
fn qlora_under_tp_dp_and_offload_follows_one_device_and_zero3_is_refused() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tmp("qlora-par");
    let ck = model(&dir);
    let (data, _) = token_data(&dir, 0.01);
    let lora = ["--lora-rank=4", "--quantize-base=nf4", "--steps=6", "--save-every=0"];
    let run = runs_in(&dir, &lora, |out, e| ladder(&ck, &data, out, e));
    layouts_follow_one_device(
        run,
        &[
            ("tp2", &["--batch-size=4", "--tp=2"]),
            ("dp2", &["--batch-size=2", "--dp=2", "--zero=2"]),
            ("offload", &["--batch-size=4", "--offload-optimizer"]),
        ],
    );
    let e =
        ladder(&ck, &data, &dir.join("z3"), &["--lora-rank=4", "--quantize-base=nf4", "--batch-size=2", "--dp=2", "--zero=3"]).unwrap_err();
    assert_eq!(exit_code(&e), 2);
    let e = error_report(&e);
    assert!(e.contains("ZeRO-3") && e.contains("4-bit base") && e.contains("--zero 2"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_qlora_flags_are_refused_naming_them() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tmp("qlora-bad");
    let ck = model(&dir);
    // --quantize-base without LoRA: both flags named, exit code 2.
    let e = ladder(&ck, &dir, &dir.join("o"), &["--quantize-base=nf4"]).unwrap_err();
    assert_eq!(exit_code(&e), 2);
    let e = error_report(&e);
    assert!(e.contains("--quantize-base") && e.contains("--lora-rank"), "{e}");
    // A checkpoint saved 4-bit trains through adapters only.
    let four = root().join("tests/fixtures/qlora/base_4bit");
    let e = ladder(&four, &dir, &dir.join("o"), &[]).unwrap_err();
    assert_eq!(exit_code(&e), 2);
    let e = error_report(&e);
    assert!(e.contains("saved 4-bit") && e.contains("--lora-rank"), "{e}");
    // --quantize-base naming another type than the checkpoint's: a flag error before any work.
    let e = ladder(&four, &dir, &dir.join("o"), &["--lora-rank=2", "--quantize-base=fp4"]).unwrap_err();
    assert_eq!(exit_code(&e), 2, "{}", error_report(&e));
    let e = error_report(&e);
    assert!(e.contains("--quantize-base fp4") && e.contains("saved 4-bit as nf4") && e.contains("config.json"), "{e}");
    // --tp 2 over the fixture's 4-bit base: o_proj's rows of 64 columns split into 32.
    let with_tok = dir.join("four");
    std::fs::create_dir_all(&with_tok).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(four.join(f), with_tok.join(f)).unwrap();
    }
    std::fs::copy(tokenizer_path(), with_tok.join("tokenizer.json")).unwrap();
    let text = data_path("corpus/README.md");
    let e: EvalArgs =
        parse_from(["eval", "--device=cpu", &flag("model", &with_tok), &flag("text", &text), "--seq-len=16", "--tp=2"]).unwrap();
    let e = ferrolm::cli::eval::run(e).unwrap_err();
    let e = error_report(&e);
    assert!(e.contains("--tp 2 over a 4-bit base") && e.contains("o_proj.weight") && e.contains("pieces of 32"), "{e}");
    // eval's --quantize-base of another type than the checkpoint's: the same flag error.
    let e: EvalArgs =
        parse_from(["eval", "--device=cpu", &flag("model", &with_tok), &flag("text", &text), "--seq-len=16", "--quantize-base=fp4"])
            .unwrap();
    let e = ferrolm::cli::eval::run(e).unwrap_err();
    assert_eq!(exit_code(&e), 2, "{}", error_report(&e));
    assert!(error_report(&e).contains("--quantize-base fp4"), "{}", error_report(&e));
    // An unknown quant type: clap's error, exit code 2, naming the flag and the types.
    for tool in ["finetune", "finetune_ladder", "eval", "generate"] {
        let err = match tool {
            "finetune" => parse_from::<FinetuneArgs, _, _>([tool, "--quantize-base", "int4"]).unwrap_err(),
            "finetune_ladder" => {
                parse_from::<FinetuneLadderArgs, _, _>([tool, "--ladder-layers=1", "--quantize-base", "int4"]).unwrap_err()
            }
            "eval" => parse_from::<EvalArgs, _, _>([tool, "--quantize-base", "int4"]).unwrap_err(),
            _ => parse_from::<GenerateArgs, _, _>([tool, "--quantize-base", "int4"]).unwrap_err(),
        };
        assert_eq!(err.exit_code(), 2, "{tool}");
        let s = err.to_string();
        assert!(s.contains("--quantize-base") && s.contains("unknown 4-bit quant type \"int4\": nf4 or fp4"), "{tool}: {s}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A corrupt checkpoint saved 4-bit, given as --model: the error names the tensor.
#[test]
fn a_corrupt_4bit_checkpoint_through_model_names_the_tensor() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tmp("qlora-corrupt");
    let src = root().join("tests/fixtures/qlora/base_4bit");
    let ck = dir.join("model");
    std::fs::create_dir_all(&ck).unwrap();
    std::fs::copy(src.join("config.json"), ck.join("config.json")).unwrap();
    std::fs::copy(tokenizer_path(), ck.join("tokenizer.json")).unwrap();
    // The quant state of one weight replaced by bytes that are not JSON (same length: the
    // safetensors header stays valid).
    let mut bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let name = "model.layers.0.self_attn.q_proj.weight.quant_state.bitsandbytes__nf4";
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let start = header[name]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[8 + n + start] = b'#';
    std::fs::write(ck.join("model.safetensors"), &bytes).unwrap();
    let text = data_path("corpus/README.md");
    let e: EvalArgs = parse_from(["eval", "--device=cpu", &flag("model", &ck), &flag("text", &text), "--seq-len=16"]).unwrap();
    let e = error_report(&ferrolm::cli::eval::run(e).unwrap_err());
    assert!(e.contains(name) && e.contains("corrupt quant_state"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `export --lora` over a checkpoint saved 4-bit (tests/fixtures/qlora/base_4bit, with the PEFT
/// adapter trained over it): dequantized, merged in f32, saved as the f32 its weights were before
/// bitsandbytes quantized them, without quantization_config; it scores as the 4-bit model with
/// its adapter.
#[test]
fn export_lora_over_a_4bit_checkpoint_dequantizes_and_merges() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tmp("qlora-export");
    let fx = root().join("tests/fixtures/qlora");
    let out = dir.join("merged");
    let x: ferrolm::cli::export::ExportArgs =
        parse_from(["export", &flag("model", &fx.join("base_4bit")), &flag("lora", &fx.join("adapter")), &flag("out", &out)]).unwrap();
    ferrolm::cli::export::run(x).unwrap();
    let c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert!(c.get("quantization_config").is_none(), "{c}");
    assert_eq!(ferrolm::nn::safetensors_io::stored_float_dtype(&out).unwrap(), Some("float32"));
    let r: std::collections::BTreeMap<String, ferrolm::Tensor> =
        ferrolm::nn::safetensors_io::load_safetensors(&fx.join("reference.safetensors"), DType::F32, Device::Cpu)
            .unwrap()
            .into_iter()
            .collect();
    let ids = &r["input_ids"];
    let labels: Vec<i32> = r["labels"].to_vec().unwrap();
    let t = ids.dim(1);
    let targets = ferrolm::Tensor::from_vec(ferrolm::nn::shift_labels(&labels, t), vec![ids.dim(0), t], Device::Cpu).unwrap();
    let merged = Llama::from_pretrained(&out, DType::F32, Device::Cpu).unwrap();
    assert!(merged.quant_base().is_none());
    let mut q = Llama::from_pretrained(&fx.join("base_4bit"), DType::F32, Device::Cpu).unwrap();
    q.load_adapter(&fx.join("adapter")).unwrap();
    let (lm, lq) = (merged.loss(ids, &targets).unwrap().to_vec_f32().unwrap()[0], q.loss(ids, &targets).unwrap().to_vec_f32().unwrap()[0]);
    assert!((lm - lq).abs() < 1e-5 * lq.abs(), "merged {lm} vs the 4-bit model with its adapter {lq}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The memory check of a QLoRA run charges the 4-bit base (`LoraArgs::memory` sets
/// `LoraMem::quantized_base` from `--quantize-base`): finetune's predicted peak (its "memory:
/// predicted peak" line) is under the same LoRA run's by most of the linear weights' f32 bytes,
/// and each prediction bounds what the run measured (`peak_tensor_mib`, with the 4-bit codes the
/// CPU holds outside tensors) within [1, 1.25].
#[test]
fn a_qlora_finetune_predicts_a_smaller_peak_than_the_same_lora_run() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tmp("qlora-predicted");
    let ck = model(&dir);
    let data = bundled_lines(&dir, "chat.jsonl", 40);
    let head = ["finetune", "--device=cpu", "--batch-size=2", "--eval-every=0", "--save-every=0", "--seq-len=128", "--steps=2"];
    let run = |name: &str, extra: &[&str]| {
        let out = dir.join(name);
        let a: FinetuneArgs = parse_from(run_args(&head, &ck, &data, &out, extra)).unwrap();
        // The peak counter is the process's: each run's own, less what was live before it.
        let before = ferrolm_tensor::live_bytes() as f64;
        ferrolm_tensor::reset_peak_bytes();
        let predicted = ferrolm::cli::finetune::finetune(a).unwrap().predicted_peak.expect("a predicted peak");
        let measured = metric(&out, "peak_tensor_mib").into_iter().fold(0.0, f64::max) * 1048576.0 - before;
        (predicted, measured)
    };
    let (lora, lora_measured) = run("lora", &["--lora-rank=4"]);
    let (qlora, qlora_measured) = run("qlora", &["--lora-rank=4", "--quantize-base=nf4"]);
    let cfg = ferrolm::nn::LlamaConfig::from_file(ck.join("config.json")).unwrap();
    let linear: usize = ferrolm::nn::qlora::linear_weights(&cfg).values().map(|s| s.iter().product::<usize>()).sum();
    let codes =
        Llama::from_pretrained_quantized(&ck, DType::F32, Device::Cpu, QuantSpec::QLORA).unwrap().quant_base().unwrap().bytes as f64;
    let qlora_measured = qlora_measured + codes;
    println!(
        "predicted peak: LoRA {lora:.0} B (measured {lora_measured:.0}), QLoRA {qlora:.0} B (measured {qlora_measured:.0} with \
         {codes:.0} B of codes); {linear} linear weights, {} B in f32",
        linear * 4
    );
    assert!(lora - qlora > 0.6 * (linear * 4) as f64, "QLoRA's predicted peak {qlora} is not under LoRA's {lora} by the 4-bit base");
    for (name, p, m) in [("LoRA", lora, lora_measured), ("QLoRA", qlora, qlora_measured)] {
        assert!((1.0..=1.25).contains(&(p / m)), "{name}: predicted {p}, measured {m} ({:.3})", p / m);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// What the tools' memory check charges the base as (`cli::lora::quant_spec`): `--quantize-base`'s
/// type quantized on load, a `--model` saved 4-bit as its `quantization_config` says (with or
/// without the flag), and nothing 4-bit otherwise.
#[test]
fn the_memory_check_learns_the_4bit_base_from_the_flag_or_the_checkpoint() {
    use ferrolm::cli::lora::quant_spec;
    use ferrolm_ops::nf4::QuantType;
    let dir = tmp("qlora-spec");
    let dense = model(&dir);
    let saved = root().join("tests/fixtures/qlora/base_4bit");
    assert_eq!(quant_spec(None, &dense).unwrap(), None);
    assert_eq!(quant_spec(Some(QuantType::Nf4), &dense).unwrap(), Some(QuantSpec::QLORA));
    assert_eq!(quant_spec(Some(QuantType::Fp4), &dense).unwrap(), Some(QuantSpec { quant_type: QuantType::Fp4, ..QuantSpec::QLORA }));
    assert_eq!(quant_spec(None, &saved).unwrap(), Some(QuantSpec::QLORA));
    assert_eq!(quant_spec(Some(QuantType::Nf4), &saved).unwrap(), Some(QuantSpec::QLORA));
    let _ = std::fs::remove_dir_all(&dir);
}
