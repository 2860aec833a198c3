//! LoRA through the fine-tuning tools (`finetune_ladder --lora-*`, `finetune --lora-*`):
//! checkpoints hold the adapter in PEFT's format for a linked converted base (for `finetune`, the
//! --model directory), resume is exact, `eval`/`generate --lora` and `--merge-lora` agree with
//! the adapted model, `--tp 2`, `--dp 2 --zero 3` and `--offload-optimizer` follow one device,
//! and bad input is refused naming the file and field.
mod common;
use common::*;
use ferrolm::cli::eval::EvalArgs;
use ferrolm::cli::finetune::FinetuneArgs;
use ferrolm::cli::finetune_ladder::FinetuneLadderArgs;
use ferrolm::cli::{error_report, parse_from};
use ferrolm::nn::LlamaConfig;
use ferrolm::{DType, Device, Llama};
use std::path::{Path, PathBuf};

/// A plain Llama checkpoint (untied, 2 kv heads: split at --tp 2) with tokenizer.json, and data.
fn setup(dir: &Path) -> (PathBuf, PathBuf) {
    let (data, vocab) = token_data(dir, 0.01); // a small validation split: each run scores it three times
    let ck = checkpoint(&dir.join("llama"), LlamaConfig { tie_word_embeddings: false, ..config(vocab, 2) });
    (ck, data)
}

fn finetune(ck: &Path, data: &Path, out: &Path, extra: &[&str]) -> anyhow::Result<()> {
    let mut head = vec!["finetune_ladder", "--device=cpu", "--seq-len=16", "--eval-every=0", "--ladder-layers=1", "--lr=1e-2"];
    if !extra.iter().any(|e| e.starts_with("--batch-size")) {
        head.push("--batch-size=2");
    }
    let a: FinetuneLadderArgs = parse_from(run_args(&head, ck, data, out, extra)).unwrap();
    ferrolm::cli::finetune_ladder::run(a)
}

/// The sonnet loss of the model in `base` alone and with the adapter `adapter`, which `merged`
/// (the run's --merge-lora checkpoint) scores within 1e-5 of.
fn plain_and_adapted_as_merged(base: &Path, adapter: &Path, merged: &Path) -> (f64, f64) {
    let mut adapted = Llama::from_pretrained(base, DType::F32, Device::Cpu).unwrap();
    let plain = sonnet_loss(&adapted);
    adapted.load_adapter(adapter).unwrap();
    let with_adapter = sonnet_loss(&adapted);
    let merged = sonnet_loss(&Llama::from_pretrained(merged, DType::F32, Device::Cpu).unwrap());
    assert!((merged - with_adapter).abs() < 1e-5 * with_adapter, "merged {merged} vs adapted {with_adapter}");
    (plain, with_adapter)
}

#[test]
fn lora_checkpoints_are_peft_adapters_that_resume_evaluate_and_merge() {
    let dir = tmp("lora-ft");
    let (ck, data) = setup(&dir);
    let (whole, resumed) = (dir.join("whole"), dir.join("resumed"));
    let lora = ["--lora-rank=4", "--lora-targets", "q,v,o,down", "--lora-dropout=0.1", "--steps=6", "--save-every=3"];
    finetune(&ck, &data, &whole, &[&lora[..], &["--merge-lora"]].concat()).unwrap();
    let l = losses(&whole);
    assert_eq!(l.len(), 6);

    // The checkpoint is a PEFT adapter (and the run's shards and state), not a model.
    let step6 = whole.join("checkpoints/step-000006");
    for f in ["adapter_config.json", "adapter_model.safetensors", "trainer_state.json", "tokenizer.json"] {
        assert!(step6.join(f).is_file(), "{f} missing");
    }
    assert!(!step6.join("model.safetensors").exists() && !step6.join("config.json").exists());
    let cfg = read_json(&step6.join("adapter_config.json"));
    assert_eq!(cfg["r"], 4);
    assert_eq!(cfg["lora_alpha"], 8);
    assert_eq!(cfg["lora_dropout"], 0.1);
    assert_eq!(cfg["target_modules"], serde_json::json!(["q_proj", "v_proj", "o_proj", "down_proj"]));
    // Its base is the converted Ladder model: a llamaLadder config over the Llama's weight files.
    let base = PathBuf::from(cfg["base_model_name_or_path"].as_str().unwrap());
    assert_eq!(base, std::path::absolute(whole.join("base")).unwrap());
    let base_cfg = read_json(&base.join("config.json"));
    assert_eq!((base_cfg["model_type"].as_str(), base_cfg["ladder_layers"].as_u64()), (Some("llamaLadder"), Some(1)));
    assert!(std::fs::symlink_metadata(base.join("model.safetensors")).unwrap().file_type().is_symlink());

    // Resuming at step 3 repeats the uninterrupted losses bit for bit (dropout masks included).
    let step3 = whole.join("checkpoints/step-000003");
    finetune(&ck, &data, &resumed, &[&lora[..], &["--resume", step3.to_str().unwrap()]].concat()).unwrap();
    assert_eq!(losses(&resumed).iter().map(|x| x.to_bits()).collect::<Vec<_>>(), l.iter().map(|x| x.to_bits()).collect::<Vec<_>>());

    // The adapted model, the merged checkpoint, and the tools with --lora agree.
    let (plain, with_adapter) = plain_and_adapted_as_merged(&base, &step6, &whole.join("merged"));
    assert!(with_adapter < plain - 1e-3, "the adapter learnt the sonnets: {with_adapter} vs the base's {plain}");
    let text = few_sonnets(&dir, 4000);
    for (lora, resolved) in [(&whole, true), (&step6, false)] {
        let e: EvalArgs =
            parse_from(["eval", "--device=cpu", &flag("model", &base), &flag("text", &text), "--seq-len=16", &flag("lora", lora)]).unwrap();
        let (res, logs) = capture_logs(|| ferrolm::cli::eval::run(e));
        res.unwrap();
        // A run directory: the log says which checkpoint's adapter, as --model does.
        let said = format!("--lora {}: using the checkpoint {}", whole.display(), step6.display());
        assert_eq!(logs.contains(&said), resolved, "{logs}");
        // The converted base the run recorded (its config, the Llama's weight files) is this one.
        assert!(logs.contains("was trained on this base") && !logs.contains("warning:"), "{logs}");
    }
    generate_a_few(&base, &["--lora", step6.to_str().unwrap(), "--tp=2"]).unwrap();
    // export --lora of the Ladder base: the merged model keeps the modelling code its auto_map
    // names (transformers loads it with trust_remote_code), and scores as the adapted model.
    let exported = dir.join("exported");
    let x: ferrolm::cli::export::ExportArgs =
        parse_from(["export", &flag("model", &base), &flag("lora", &step6), &flag("out", &exported)]).unwrap();
    ferrolm::cli::export::run(x).unwrap();
    for (name, text) in ferrolm_nn::ladder_hf::FILES {
        assert_eq!(std::fs::read_to_string(exported.join(name)).unwrap_or_default(), text, "{name} beside the export");
    }
    let e = sonnet_loss(&Llama::from_pretrained(&exported, DType::F32, Device::Cpu).unwrap());
    assert!((e - with_adapter).abs() < 1e-5 * with_adapter, "export --lora {e} vs adapted {with_adapter}");

    // --lora-init continues the adapter (same flags agree; a different rank is refused).
    finetune(&ck, &data, &dir.join("cont"), &["--lora-init", step6.to_str().unwrap(), "--lora-rank=4", "--steps=1"]).unwrap();
    let e = error_report(
        &finetune(&ck, &data, &dir.join("c2"), &["--lora-init", step6.to_str().unwrap(), "--lora-rank=8", "--steps=1"]).unwrap_err(),
    );
    assert!(e.contains("--lora-rank 8") && e.contains("adapter_config.json") && e.contains("r 4"), "{e}");
    // A LoRA checkpoint resumed without LoRA, and the other way round.
    let e = error_report(&finetune(&ck, &data, &dir.join("r2"), &["--steps=6", "--resume", step3.to_str().unwrap()]).unwrap_err());
    assert!(e.contains("LoRA adapter") && e.contains("--lora"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn lora_under_tp_zero3_and_offload_follows_one_device() {
    let dir = tmp("lora-par");
    let (ck, data) = setup(&dir);
    let run = runs_in(&dir, &["--lora-rank=4", "--steps=8", "--save-every=0"], |out, e| finetune(&ck, &data, out, e));
    layouts_follow_one_device(
        run,
        &[
            ("tp2", &["--batch-size=4", "--tp=2"]),
            ("dp2-zero3", &["--batch-size=2", "--dp=2", "--zero=3"]),
            ("offload", &["--batch-size=4", "--offload-optimizer"]),
        ],
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_lora_input_is_refused_naming_the_flag_file_or_field() {
    let dir = tmp("lora-bad");
    let (ck, data) = setup(&dir);
    let out = dir.join("out");
    // Flag errors: clap's, exit code 2, naming the flag.
    for bad in [["--lora-rank", "0"], ["--lora-targets", "q,qkv"], ["--lora-dropout", "1"]] {
        let head = ["finetune_ladder", "--model=m", "--ladder-layers=1"];
        let e = parse_from::<FinetuneLadderArgs, _, _>(head.iter().chain(bad.iter())).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains(bad[0]), "{e}");
    }
    let e = error_report(&finetune(&ck, &data, &out, &["--lora-alpha=16"]).unwrap_err());
    assert!(e.contains("--lora-alpha") && e.contains("--lora-rank"), "{e}");
    // A PEFT directory for another base: the fixture adapter of a 64-wide model.
    let other = root().join("tests/fixtures/lora_llama");
    let e = error_report(&finetune(&ck, &data, &out, &["--lora-init", other.to_str().unwrap()]).unwrap_err());
    assert!(e.contains("adapter_model.safetensors") && e.contains("another base") && e.contains("lora_A.weight"), "{e}");
    // --lora on a directory with no adapter.
    let text = data_path("corpus/README.md");
    let ev: EvalArgs =
        parse_from(["eval", "--device=cpu", &flag("model", &ck), &flag("text", &text), "--seq-len=16", &flag("lora", &ck)]).unwrap();
    let e = error_report(&ferrolm::cli::eval::run(ev).unwrap_err());
    assert!(e.contains("--lora") && e.contains("adapter_config.json") && e.contains(ck.to_str().unwrap()), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `finetune --lora-*` on conversations: the adapter trains (the validation loss over assistant
/// tokens drops), checkpoints are PEFT adapters for the --model directory itself and carry the
/// chat template, and --merge-lora's model is the adapted one.
#[test]
fn finetune_trains_a_peft_adapter_on_conversations_and_merges_it() {
    let dir = tmp("lora-chat");
    let ck = chat_model(&dir); // hidden 32, 2 layers of 4 heads (2 kv), positions for 128-token rows
    let data = bundled_lines(&dir, "chat.jsonl", 60);
    let out = dir.join("run");
    let head =
        ["finetune", "--device=cpu", "--batch-size=2", "--eval-every=0", "--lr=2e-2", "--seq-len=128", "--steps=6", "--val-fraction=0.1"];
    let lora = ["--lora-rank", "4", "--lora-targets=q,k,v,o,down", "--merge-lora"];
    let a: FinetuneArgs = parse_from(run_args(&head, &ck, &data, &out, &lora)).unwrap();
    let o = ferrolm::cli::finetune::finetune(a).unwrap();
    let (before, after) = (o.val_before.unwrap(), o.val_after.unwrap());
    assert!(after < before - 1e-3, "validation loss {before} -> {after}");

    let step = out.join("checkpoints/step-000006");
    assert!(step.join("adapter_model.safetensors").is_file() && step.join("chat_template.jinja").is_file());
    assert!(!step.join("model.safetensors").exists());
    let c = read_json(&step.join("adapter_config.json"));
    assert_eq!((c["r"].as_u64(), c["lora_alpha"].as_f64()), (Some(4), Some(8.0)));
    assert_eq!(c["target_modules"], serde_json::json!(["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]));
    assert_eq!(PathBuf::from(c["base_model_name_or_path"].as_str().unwrap()), std::path::absolute(&ck).unwrap());

    // The base's weights are as they were; the merged checkpoint is the adapted model.
    let (plain, with_adapter) = plain_and_adapted_as_merged(&ck, &step, &out.join("merged"));
    assert!((with_adapter - plain).abs() > 1e-6, "the adapter changed nothing: {with_adapter} vs {plain}");
    for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"] {
        assert_eq!(std::fs::read(out.join("merged").join(f)).unwrap(), std::fs::read(step.join(f)).unwrap(), "{f}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
