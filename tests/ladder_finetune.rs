//! `finetune_ladder` and `pretrain_llama --ladder-layers`: conversion-only runs write the
//! paper's checkpoint format, fine-tuning resumes exactly, eval and generate load the result,
//! and bad --ladder-layers values are refused naming the flag.
mod common;
use common::*;
use ferrolm::cli::eval::EvalArgs;
use ferrolm::cli::finetune_ladder::FinetuneLadderArgs;
use ferrolm::cli::generate::GenerateArgs;
use ferrolm::cli::pretrain::PretrainArgs;
use ferrolm::cli::{error_report, exit_code, parse_from};
use std::path::{Path, PathBuf};

/// A plain Llama checkpoint (with tokenizer.json) and prepared data.
fn setup(dir: &Path) -> (PathBuf, PathBuf) {
    let (data, vocab) = token_data(dir, 0.1);
    (checkpoint(&dir.join("llama"), config(vocab, 2)), data)
}

fn finetune(ck: &Path, data: &Path, out: &Path, extra: &[&str]) -> anyhow::Result<()> {
    let head = ["finetune_ladder", "--device=cpu", "--seq-len=16", "--batch-size=2", "--eval-every=0"];
    let a: FinetuneLadderArgs = parse_from(run_args(&head, ck, data, out, extra)).unwrap();
    ferrolm::cli::finetune_ladder::run(a)
}

/// The bits of each step's loss in `metrics.jsonl` (a missing file fails).
fn loss_bits(run: &Path) -> Vec<u64> {
    metric(run, "loss").into_iter().map(f64::to_bits).collect()
}

#[test]
fn conversion_only_writes_the_papers_format_and_loads_in_eval_and_generate() {
    let dir = tmp("ladder-convert");
    let (ck, data) = setup(&dir);
    let out = dir.join("converted");
    let (res, logs) = capture_logs(|| finetune(&ck, &data, &out, &["--ladder-layers", "0,", "--steps=0"]));
    res.unwrap();
    let step0 = out.join("checkpoints/step-000000");
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(step0.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "llamaLadder");
    assert_eq!(cfg["ladder_layers"], serde_json::json!([0]));
    // transformers loads it through auto_map: the modelling files it names are beside it (their
    // parity is checked by scripts/make_ladder_fixtures.py), and the log says how.
    for (module, class) in [
        ("AutoConfig", "configuration_llama_ladder.LlamaLadderConfig"),
        ("AutoModelForCausalLM", "modeling_llama_ladder.LlamaLadderForCausalLM"),
    ] {
        assert_eq!(cfg["auto_map"][module], class);
    }
    for (name, text) in ferrolm_nn::ladder_hf::FILES {
        assert_eq!(std::fs::read_to_string(step0.join(name)).unwrap_or_default(), text, "{name} beside the checkpoint");
    }
    assert!(logs.contains("trust_remote_code=True"), "the log says how to load it in transformers: {logs}");
    // export keeps them; a plain Llama checkpoint has none.
    let exported = dir.join("exported");
    ferrolm::checkpoint::export_model(&step0, &exported).unwrap();
    for (name, _) in ferrolm_nn::ladder_hf::FILES {
        assert!(exported.join(name).is_file(), "export keeps {name}");
        assert!(!ck.join(name).exists(), "a plain Llama has no {name}");
    }
    // The weights are the plain model's, under transformers' names.
    let a = ferrolm_nn::safetensors_io::load_safetensors(&ck.join("model.safetensors"), ferrolm::DType::F32, ferrolm::Device::Cpu).unwrap();
    let b =
        ferrolm_nn::safetensors_io::load_safetensors(&step0.join("model.safetensors"), ferrolm::DType::F32, ferrolm::Device::Cpu).unwrap();
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (k, t) in &a {
        assert_eq!(t.to_vec::<f32>().unwrap(), b[k].to_vec::<f32>().unwrap(), "{k} changed by the conversion");
    }
    // eval and generate read the config and build the Ladder model.
    let text = root().join("data/corpus/sonnets.txt");
    let e: EvalArgs =
        parse_from(["eval", "--device=cpu", "--model", step0.to_str().unwrap(), "--text", text.to_str().unwrap(), "--seq-len=16"]).unwrap();
    ferrolm::cli::eval::run(e).unwrap();
    let g: GenerateArgs =
        parse_from(["generate", "--device=cpu", "--model", step0.to_str().unwrap(), "--prompt", "Shall I", "--max-new-tokens=5", "--tp=2"])
            .unwrap();
    ferrolm::cli::generate::run(g).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn finetune_resume_is_exact() {
    let dir = tmp("ladder-resume");
    let (ck, data) = setup(&dir);
    let (whole, resumed) = (dir.join("whole"), dir.join("resumed"));
    finetune(&ck, &data, &whole, &["--ladder-layers=1", "--steps=6", "--save-every=3"]).unwrap();
    // A run stopped after step 3 (its checkpoint) and continued elsewhere.
    let step3 = whole.join("checkpoints/step-000003");
    finetune(&ck, &data, &resumed, &["--ladder-layers=1", "--steps=6", "--save-every=3", "--resume", step3.to_str().unwrap()]).unwrap();
    let (a, b) = (loss_bits(&whole), loss_bits(&resumed));
    assert_eq!(a.len(), 6);
    assert_eq!(b.len(), 6, "the resumed run starts from the checkpoint's history");
    assert_eq!(a, b, "resumed fine-tuning differs from the uninterrupted run");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_ladder_layers_are_refused_naming_the_flag() {
    let dir = tmp("ladder-bad");
    let (ck, data) = setup(&dir);
    // Out of range for the 2-layer model: a flag error (exit code 2) once its config is read.
    for bad in ["3", "0,7"] {
        let err = finetune(&ck, &data, &dir.join("out"), &["--ladder-layers", bad]).unwrap_err();
        let e = error_report(&err);
        assert!(e.contains("--ladder-layers"), "{bad}: {e}");
        assert_eq!(exit_code(&err), 2, "{bad}: {e}");
    }
    // Malformed: refused when the flags are parsed, before any work (an --out holding a run
    // would otherwise be reported first).
    for bad in ["x", "-1", "all,1", "1,1"] {
        let e = parse_from::<FinetuneLadderArgs, _, _>(["finetune_ladder", "--model", "m", "--ladder-layers", bad]).unwrap_err();
        assert!(e.to_string().contains("--ladder-layers"), "{bad}: {e}");
        let e = parse_from::<PretrainArgs, _, _>(["pretrain_llama", "--ladder-layers", bad]).unwrap_err();
        assert!(e.to_string().contains("--ladder-layers"), "{bad}: {e}");
    }
    let p: PretrainArgs =
        parse_from(["pretrain_llama", "--device=cpu", "--ladder-layers=9", "--out", dir.join("p").to_str().unwrap()]).unwrap();
    let err = ferrolm::cli::pretrain::run(p).unwrap_err();
    let e = error_report(&err);
    assert!(e.contains("--ladder-layers") && e.contains("9"), "{e}");
    assert_eq!(exit_code(&err), 2, "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
