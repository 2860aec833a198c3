//! The `dpo` tool: preference tuning on the bundled pairs (data/prefs.jsonl) with a tiny chat
//! model. A run lowers the DPO loss and raises rewards/accuracies; the reference modes agree
//! (live == precomputed, the LoRA base with adapters off == the base as a separate model);
//! `--tp 2`, `--dp 2 --zero 3` and `--offload-optimizer` follow one device; `--resume` with
//! `--precompute-ref` is exact and reuses the saved log-probs; bad flags exit 2 naming the flag.
mod common;
#[path = "common/tools.rs"]
mod tools;
use common::*;
use ferrolm::cli::dpo::{DpoArgs, Outcome};
use ferrolm::cli::{exit_code, parse_from, Tool};
use std::path::{Path, PathBuf};

#[test]
fn tool_process() {
    tools::child_entry();
}

/// The tiny chat model and the first `n` pairs of the bundled file.
fn setup(dir: &Path, n: usize) -> (PathBuf, PathBuf) {
    (chat_model(dir), bundled_lines(dir, "prefs.jsonl", n))
}

fn parse(ck: &Path, data: &Path, out: &Path, extra: &[&str]) -> DpoArgs {
    // The defaults below, each unless `extra` gives its flag.
    let name = |f: &str| f.split('=').next().unwrap().to_string();
    let given: Vec<String> = extra.iter().map(|f| name(f)).collect();
    let head: Vec<&str> = ["dpo", "--device=cpu", "--seq-len=128", "--eval-every=0", "--batch-size=2", "--lr=5e-3", "--val-fraction=0"]
        .into_iter()
        .filter(|f| !given.contains(&name(f)))
        .collect();
    parse_from(run_args(&head, ck, data, out, extra)).unwrap()
}

fn dpo(ck: &Path, data: &Path, out: &Path, extra: &[&str]) -> anyhow::Result<Outcome> {
    ferrolm::cli::dpo::dpo(parse(ck, data, out, extra))
}

/// `key` of each training line of `run`/metrics.jsonl.
fn metric(run: &Path, key: &str) -> Vec<f64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v.get("loss").is_some())
        .map(|v| v[key].as_f64().unwrap_or_else(|| panic!("no {key} in {v}")))
        .collect()
}

#[test]
fn dpo_lowers_the_loss_and_raises_rewards_accuracies_with_trl_metrics() {
    let dir = tmp("dpo-learn");
    let (ck, data) = setup(&dir, 10);
    let out = dir.join("run");
    let o = dpo(&ck, &data, &out, &["--steps=16", "--val-fraction=0.2", "--batch-size=4"]).unwrap();
    let l = losses(&out);
    assert_eq!(l.len(), 16);
    // At step 1 the policy is the reference: the loss is ln 2, every reward 0.
    assert!((l[0] - std::f64::consts::LN_2).abs() < 1e-6, "{}", l[0]);
    assert_eq!(metric(&out, "rewards/margins")[0], 0.0);
    let tail = l[12..].iter().sum::<f64>() / 4.0;
    assert!(tail < 0.5 * l[0], "the DPO loss did not fall: {l:?}");
    let acc = metric(&out, "rewards/accuracies");
    assert!(acc[12..].iter().sum::<f64>() / 4.0 >= 0.75, "rewards/accuracies stayed low: {acc:?}");
    for k in ["rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"] {
        assert!(metric(&out, k).iter().all(|x| x.is_finite()), "{k}");
    }
    assert!(metric(&out, "rewards/margins")[15] > 0.0);
    // The validation pass reports the loss and TRL's metrics too.
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let val: serde_json::Value = serde_json::from_str(text.lines().find(|l| l.contains("val_loss")).unwrap()).unwrap();
    for k in ["val_rewards/accuracies", "val_rewards/margins", "val_logps/chosen"] {
        assert!(val[k].is_number(), "{k} missing in {val}");
    }
    let (before, after) = (o.val_before.unwrap(), o.val_after.unwrap());
    assert!((before.0 - std::f64::consts::LN_2).abs() < 1e-6 && before.1.pairs == 2, "{before:?}");
    assert!(after.0.is_finite() && after.1.pairs == 2);
    // The checkpoint is a model with the tokenizer and chat template.
    let ckpt = out.join("checkpoints/step-000016");
    for f in ["model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja", "trainer_state.json"] {
        assert!(ckpt.join(f).is_file(), "{f} missing");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn live_and_precomputed_references_agree_and_resume_is_exact() {
    let dir = tmp("dpo-ref");
    let (ck, data) = setup(&dir, 8);
    let (live, pre, resumed) = (dir.join("live"), dir.join("pre"), dir.join("resumed"));
    dpo(&ck, &data, &live, &["--steps=4"]).unwrap();
    dpo(&ck, &data, &pre, &["--steps=4", "--save-every=2", "--precompute-ref"]).unwrap();
    close(&losses(&pre), &losses(&live), 1e-5, "precomputed vs live");
    assert!(pre.join("ref_logps.json").is_file());
    // Resuming at step 2 reuses the saved log-probs and repeats the losses exactly.
    let step2 = pre.join("checkpoints/step-000002");
    // The data summary and each skip are logged at info level.
    let (r, log) = capture_logs(|| dpo(&ck, &data, &dir.join("logged"), &["--steps=1"]));
    r.unwrap();
    assert!(log.contains("training pairs") && log.contains("records:") && log.contains("(byte offset"), "{log}");
    let resume = |out: &Path| dpo(&ck, &data, out, &["--steps=4", "--precompute-ref", "--resume", step2.to_str().unwrap()]).unwrap();
    resume(&resumed);
    let bits = |v: Vec<f64>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(losses(&resumed)), bits(losses(&pre)));
    let saved = std::fs::read(pre.join("ref_logps.json")).unwrap();
    assert_eq!(std::fs::read(resumed.join("ref_logps.json")).unwrap(), saved, "the resumed run keeps the same log-probs");
    // The resumed run reads the saved log-probs rather than computing them again: shift every
    // saved reference log-prob of a chosen answer and the resumed losses move.
    let mut r: serde_json::Value = serde_json::from_slice(&saved).unwrap();
    for p in r["train"].as_array_mut().unwrap() {
        p[0] = serde_json::json!((p[0].as_str().unwrap().parse::<f64>().unwrap() - 5.0).to_string());
    }
    std::fs::write(pre.join("ref_logps.json"), r.to_string()).unwrap();
    let tampered = dir.join("tampered");
    resume(&tampered);
    let (t, p) = (losses(&tampered), losses(&pre));
    assert_eq!(t.len(), 4, "{t:?}"); // steps 1-2 carried from the resumed run's log
    assert!((t[2] - p[2]).abs() > 1e-3, "the saved log-probs were not reused: {t:?} vs {p:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `finetune` on the first `n` conversations of the bundled chat file.
fn finetune(ck: &Path, dir: &Path, n: usize, out: &Path, extra: &[&str]) -> anyhow::Result<ferrolm::cli::finetune::Outcome> {
    let text = std::fs::read_to_string(data_path("chat.jsonl")).unwrap();
    let data = dir.join("chat.jsonl");
    std::fs::write(&data, text.lines().take(n).map(|l| format!("{l}\n")).collect::<String>()).unwrap();
    let name = |f: &str| f.split('=').next().unwrap().to_string();
    let given: Vec<String> = extra.iter().map(|f| name(f)).collect();
    let head: Vec<&str> = ["finetune", "--device=cpu", "--eval-every=0", "--batch-size=2", "--val-fraction=0"]
        .into_iter()
        .filter(|f| !given.contains(&name(f)))
        .collect();
    let a = parse_from::<ferrolm::cli::finetune::FinetuneArgs, _, _>(args(
        &head,
        &[flag("model", ck), flag("data", &data), flag("out", out)],
        extra,
    ))
    .unwrap();
    ferrolm::cli::finetune::finetune(a)
}

#[test]
fn a_checkpoint_resumes_only_into_a_run_of_its_kind() {
    let dir = tmp("dpo-kind");
    let (ck, data) = setup(&dir, 4);
    let (pairs, rows) = (dir.join("pairs"), dir.join("rows"));
    dpo(&ck, &data, &pairs, &["--steps=1"]).unwrap();
    finetune(&ck, &dir, 8, &rows, &["--steps=1", "--seq-len=128"]).unwrap();
    let state = |run: &Path| std::fs::read_to_string(run.join("checkpoints/step-000001/trainer_state.json")).unwrap();
    assert!(state(&pairs).contains(r#""trains": "pairs""#) && state(&rows).contains(r#""trains": "rows""#));
    // Another --seq-len leaves the data position behind (a warning), so only the kind stops a
    // DPO run continuing as a fine-tune (its AdamW state, its metrics.jsonl mixing both losses).
    let before = snapshot(&pairs);
    let e = finetune(&ck, &dir, 8, &pairs, &["--steps=2", "--seq-len=64", &flag("resume", &pairs)]).unwrap_err();
    let msg = format!("{e:#}");
    assert!(msg.contains("trained preference pairs (dpo)") && msg.contains("`trains`") && msg.contains("--model"), "{msg}");
    assert!(snapshot(&pairs) == before, "the DPO run changed");
    let e = dpo(&ck, &data, &dir.join("dpo"), &["--steps=2", "--seq-len=64", &flag("resume", &rows)]).unwrap_err();
    let msg = format!("{e:#}");
    assert!(msg.contains("trained packed conversations (finetune, finetune_ladder)") && msg.contains("trains preference pairs"), "{msg}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn validation_that_holds_out_nothing_is_warned_about() {
    let dir = tmp("dpo-val-none");
    let (ck, data) = setup(&dir, 1);
    let (r, log) = capture_logs(|| dpo(&ck, &data, &dir.join("dpo"), &["--steps=1", "--val-fraction=0.5"]));
    r.unwrap();
    assert!(log.contains("warning:") && log.contains("--val-fraction 0.5 holds out none of the 1 pair(s)"), "{log}");
    // SFT said `validation: none (--val-fraction 0 ...)`, naming a value the user did not give.
    let (r, log) = capture_logs(|| finetune(&ck, &dir, 1, &dir.join("sft"), &["--steps=1", "--val-fraction=0.5"]));
    r.unwrap();
    assert!(log.contains("warning:") && log.contains("--val-fraction 0.5 holds out none of the 1 conversation(s)"), "{log}");
    // --val-data naming --data itself (here through another spelling of the path) validates on
    // the training examples: a warning says so.
    let same = dir.join(".").join("prefs.jsonl");
    let (r, log) = capture_logs(|| dpo(&ck, &data, &dir.join("dpo-same"), &["--steps=1", &flag("val-data", &same)]));
    r.unwrap();
    assert!(log.contains("warning:") && log.contains("the validation loss scores the pairs the run trains on"), "{log}");
    let chat = dir.join("chat.jsonl");
    let (r, log) = capture_logs(|| finetune(&ck, &dir, 2, &dir.join("sft-same"), &["--steps=1", &flag("val-data", &chat)]));
    r.unwrap();
    assert!(log.contains("the validation loss scores the conversations the run trains on"), "{log}");
    let (r, log) = capture_logs(|| dpo(&ck, &data, &dir.join("dpo-other"), &["--steps=1", &flag("val-data", &dir.join("chat.jsonl"))]));
    assert!(r.is_err() && !log.contains("trains on, not held-out"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resuming_with_another_beta_or_loss_is_warned_about() {
    let dir = tmp("dpo-resume-beta");
    let (ck, data) = setup(&dir, 4);
    let run = dir.join("run");
    dpo(&ck, &data, &run, &["--steps=1"]).unwrap();
    let state = std::fs::read_to_string(run.join("checkpoints/step-000001/trainer_state.json")).unwrap();
    assert!(state.contains(r#""loss_type": "sigmoid""#), "{state}");
    let step1 = flag("resume", &run.join("checkpoints/step-000001"));
    let (r, log) = capture_logs(|| dpo(&ck, &data, &dir.join("b"), &["--steps=2", &step1, "--beta=0.5", "--loss-type=sigmoid,sft"]));
    r.unwrap();
    for w in ["resuming with a changed option: --beta 0.1 -> 0.5", "--loss-type sigmoid -> sigmoid,sft", "--loss-weights 1 -> 1,1"] {
        assert!(log.contains(w), "{w} missing: {log}");
    }
    let (r, log) = capture_logs(|| dpo(&ck, &data, &dir.join("same"), &["--steps=2", &step1]));
    r.unwrap();
    assert!(!log.contains("--beta") && !log.contains("--loss-type"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn lora_reference_is_the_base_model() {
    let dir = tmp("dpo-lora");
    let (ck, data) = setup(&dir, 8);
    let (off, sep) = (dir.join("off"), dir.join("sep"));
    let lora = ["--steps=3", "--lora-rank=4", "--lr=2e-2"];
    dpo(&ck, &data, &off, &[&lora[..], &["--save-every=2"]].concat()).unwrap();
    let ref_flag = flag("ref-model", &ck);
    dpo(&ck, &data, &sep, &[&lora[..], &[ref_flag.as_str()]].concat()).unwrap();
    let (a, b) = (losses(&off), losses(&sep));
    assert_eq!(a.len(), 3);
    close(&a, &b, 1e-6, "adapters off vs the base as --ref-model");
    assert!(a[2] < a[0], "{a:?}");
    assert!(off.join("checkpoints/step-000003/adapter_model.safetensors").is_file());
    // A LoRA run resumes exactly from its adapter checkpoint, the reference still the base.
    let resumed = dir.join("resumed");
    let step2 = off.join("checkpoints/step-000002");
    dpo(&ck, &data, &resumed, &[&lora[..], &["--resume", step2.to_str().unwrap()]].concat()).unwrap();
    let bits = |v: Vec<f64>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(losses(&resumed)), bits(a));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn dpo_under_tp_dp_zero3_and_offload_follows_one_device() {
    let dir = tmp("dpo-parallel");
    let (ck, data) = setup(&dir, 8);
    // The loss and TRL's metrics of each step (the metrics summed over every rank's pairs).
    let run = |out: &str, extra: &[&str]| {
        let flags: Vec<&str> = ["--steps=3"].iter().chain(extra).copied().collect();
        dpo(&ck, &data, &dir.join(out), &flags).unwrap();
        let run = dir.join(out);
        (losses(&run), metric(&run, "logps/chosen"), metric(&run, "logps/rejected"), metric(&run, "rewards/accuracies"))
    };
    for lora in [&[][..], &["--lora-rank=4", "--lr=2e-2"][..]] {
        let with = |flags: &[&'static str]| [flags, lora].concat();
        let tag = if lora.is_empty() { "" } else { "-lora" };
        let one = run(&format!("one{tag}"), &with(&["--grad-accum=2"]));
        assert_eq!(one.0.len(), 3);
        assert!(one.0[2] < one.0[0], "{tag}: {:?}", one.0);
        for (out, flags) in [
            ("tp2", with(&["--tp=2", "--grad-accum=2"])),
            ("dp2-zero3", with(&["--dp=2", "--zero=3"])),
            ("offload", with(&["--offload-optimizer", "--grad-accum=2"])),
        ] {
            let what = format!("{out}{tag}");
            let got = run(&what, &flags);
            close(&got.0, &one.0, 1e-5, &what);
            close(&got.1, &one.1, 1e-5, &format!("{what} logps/chosen"));
            close(&got.2, &one.2, 1e-5, &format!("{what} logps/rejected"));
            assert_eq!(got.3, one.3, "{what} rewards/accuracies");
        }
    }
    // The sft term is a mean over the step's chosen tokens on every rank, not over a rank's.
    let mix = ["--loss-type=sigmoid,sft", "--loss-weights=1,0.5"];
    let one = run("mix-one", &[&mix[..], &["--grad-accum=2"]].concat());
    let dp = run("mix-dp2", &[&mix[..], &["--dp=2"]].concat());
    assert!(one.0[0] > std::f64::consts::LN_2 + 0.1, "the sft term is in the loss: {:?}", one.0);
    close(&dp.0, &one.0, 1e-5, "sigmoid,sft under --dp 2");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_flags_and_an_out_holding_the_reference_exit_2_naming_the_flag() {
    let dir = tmp("dpo-flags");
    let (ck, data) = setup(&dir, 4);
    let out = dir.join("run");
    for (extra, name) in [
        (vec!["--beta=0"], "--beta"),
        (vec!["--loss-type=dpo"], "--loss-type"),
        (vec!["--loss-type=sigmoid,sft", "--loss-weights=1"], "--loss-weights"),
    ] {
        let e = dpo(&ck, &data, &out, &extra).unwrap_err();
        assert_eq!(exit_code(&e), 2, "{extra:?}: {e:#}");
        assert!(format!("{e:#}").contains(name), "{extra:?}: {e:#}");
    }
    // --out holding --ref-model is refused before anything is written.
    let inside = out.join("ref");
    std::fs::create_dir_all(&inside).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(ck.join(f), inside.join(f)).unwrap();
    }
    let before = snapshot(&out);
    for extra in [&[][..], &["--overwrite"][..]] {
        let e = dpo(&ck, &data, &out, &[extra, &[flag("ref-model", &inside).as_str()]].concat()).unwrap_err();
        assert_eq!(exit_code(&e), 2, "{e:#}");
        assert!(format!("{e:#}").contains("--ref-model"), "{e:#}");
        assert!(snapshot(&out) == before, "{extra:?}: --out changed");
    }
    // A value clap rejects names its flag too.
    let e = parse_from::<DpoArgs, _, _>(["dpo", "--model=m", "--max-length=0"]).unwrap_err();
    assert!(e.to_string().contains("--max-length"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn help_lists_every_flag_with_its_default() {
    let mut cmd = DpoArgs::cli();
    let help = cmd.render_long_help().to_string();
    for w in ["--beta", "--loss-type", "--loss-weights", "--ref-model", "--precompute-ref", "--max-length", "--max-prompt-length"] {
        assert!(help.contains(w), "--help lacks {w}");
    }
    // finetune's flags: data, LoRA, parallel layouts, offload, resume, the chunked loss.
    for w in ["--chat-template", "--data-format", "--val-data", "--val-fraction", "--lora-rank", "--tp", "--dp", "--zero"] {
        assert!(help.contains(w), "--help lacks {w}");
    }
    for w in ["--offload-optimizer", "--resume", "--loss-chunk-tokens", "Environment:", "rewards/accuracies"] {
        assert!(help.contains(w), "--help lacks {w}");
    }
    for arg in cmd.get_arguments().filter(|a| a.get_id() != "help" && a.get_id() != "version") {
        let Some(long) = arg.get_long() else { continue };
        let takes_value = arg.get_action().takes_values();
        match arg.get_default_values().first().filter(|_| takes_value) {
            Some(d) => assert!(help.contains(&format!("[default: {}]", d.to_string_lossy())), "--{long}'s default is not shown"),
            None if takes_value && !arg.is_required_set() => {
                let doc = arg.get_long_help().or(arg.get_help()).map(|s| s.to_string()).unwrap_or_default();
                assert!(doc.contains("[default:"), "--{long} says nothing of its default: {doc:?}");
            }
            None => {}
        }
    }
    let a: DpoArgs = parse_from(["dpo", "--model=m"]).unwrap();
    assert_eq!((a.pref.beta, a.pref.loss_type.as_str(), a.pref.precompute_ref), (0.1, "sigmoid", false));
    assert!(a.pref.ref_model.is_none() && a.pref.max_length.is_none() && a.pref.loss_weights.is_none());
}

#[test]
fn the_tool_as_a_child_process_exits_2_on_a_bad_flag_and_trains_otherwise() {
    let dir = tmp("dpo-child");
    let (ck, data) = setup(&dir, 6);
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let (ck, data) = (s(&ck), s(&data));
    let base = ["dpo", "--device=cpu", "--seq-len=128", "--batch-size=2", "--val-fraction=0", "--model", &ck, "--data", &data];
    for (bad, name) in [(["--beta", "-1"], "--beta"), (["--loss-type", "kto"], "--loss-type"), (["--max-length", "0"], "--max-length")] {
        let argv: Vec<&str> = base.iter().chain(&bad).copied().collect();
        let o = tools::run_in(&dir, &[], &argv);
        let (out, err) = tools::text(&o);
        assert_eq!(o.status.code(), Some(2), "{bad:?}:\n{out}\n{err}");
        assert!(err.contains(name), "{bad:?}: {err}");
    }
    let run = dir.join("run");
    let argv: Vec<&str> = base.iter().copied().chain(["--steps", "2", "--out", run.to_str().unwrap()]).collect();
    let o = tools::run_in(&dir, &[], &argv);
    let (out, err) = tools::text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    // The data summary, the reference and TRL's metrics on the step line, at the default level.
    for w in ["training pairs", "skipped:", "reference: live", "rewards/accuracies", "logps/rejected"] {
        assert!(out.contains(w) || err.contains(w), "the log lacks {w:?}:\n{out}\n{err}");
    }
    assert!(run.join("checkpoints/step-000002/config.json").is_file());
    let _ = std::fs::remove_dir_all(&dir);
}
