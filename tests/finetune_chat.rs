//! The `finetune` tool end to end on chat data (issue 42): a tiny checkpoint fine-tuned on the
//! bundled chat file lowers its validation loss over assistant tokens and shows a reply before
//! and after; `--resume` continues the packed rows' order exactly; `finetune_ladder` takes the
//! same chat data; plain token data still trains; the chat flags take both forms.
mod common;
use common::*;
use ferrolm::cli::finetune::{FinetuneArgs, Outcome};
use ferrolm::cli::finetune_ladder::FinetuneLadderArgs;
use ferrolm::cli::parse_from;
use std::path::{Path, PathBuf};

/// A tiny Llama checkpoint (hidden 32, 2 layers, positions for 128-token rows) with the bundled
/// tokenizer, and the bundled chat file cut to its first `n` conversations.
fn setup(dir: &Path, n: usize) -> (PathBuf, PathBuf) {
    (chat_model(dir), bundled_lines(dir, "chat.jsonl", n))
}

const HEAD: [&str; 5] = ["finetune", "--device=cpu", "--batch-size=2", "--eval-every=0", "--lr=3e-3"];

fn finetune(ck: &Path, data: &Path, out: &Path, extra: &[&str]) -> anyhow::Result<Outcome> {
    let a: FinetuneArgs = parse_from(run_args(&HEAD, ck, data, out, extra)).unwrap();
    ferrolm::cli::finetune::finetune(a)
}

/// The validation losses of `metrics.jsonl`.
fn val_losses(run: &Path) -> Vec<f64> {
    metric(run, "val_loss")
}

#[test]
fn finetune_on_the_chat_file_lowers_the_validation_loss_and_shows_replies() {
    let dir = tmp("finetune-chat-e2e");
    let (ck, data) = setup(&dir, 120);
    let out = dir.join("run");
    let o = finetune(&ck, &data, &out, &["--steps=12", "--val-fraction=0.05", "--seq-len=128"]).unwrap();
    let (before, after) = (o.val_before.unwrap(), o.val_after.unwrap());
    assert!(after < before - 0.5, "validation loss {before} -> {after}");
    // The held-out prompt is a rendered conversation ending in the assistant's header.
    let prompt = o.prompt.unwrap();
    assert!(prompt.starts_with("<|bos|>") && prompt.ends_with("<|bos|>assistant\n"), "{prompt:?}");
    assert!(o.reply_before.is_some() && o.reply_after.is_some());
    // Every step is in the metrics, and the last validation loss is the one reported.
    assert_eq!(losses(&out).len(), 12);
    assert_eq!(val_losses(&out).last().copied(), Some(after));
    // The checkpoint carries the template (item 9) with the tokenizer's files...
    let step = out.join("checkpoints/step-000012");
    let template = std::fs::read_to_string(data_path("chat_template.jinja")).unwrap();
    assert_eq!(std::fs::read_to_string(step.join("chat_template.jinja")).unwrap(), template);
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(step.join("tokenizer_config.json")).unwrap()).unwrap();
    assert_eq!(config["chat_template"].as_str(), Some(template.as_str()));
    assert!(step.join("generation_config.json").is_file() && step.join("tokenizer.json").is_file());
    // ...so fine-tuning it again (its run directory as --model) renders the same prompt.
    let again = finetune(&out, &data, &dir.join("again"), &["--steps=1", "--val-fraction=0.05", "--seq-len=128"]).unwrap();
    assert_eq!(again.prompt.as_deref(), Some(prompt.as_str()));
    assert_eq!(again.val_before, Some(after), "the checkpoint's validation loss is the run's last");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn finetune_resume_continues_the_packed_rows_exactly() {
    let dir = tmp("finetune-chat-resume");
    let (ck, data) = setup(&dir, 60);
    let (whole, resumed) = (dir.join("whole"), dir.join("resumed"));
    let extra = ["--steps=6", "--save-every=3", "--val-fraction=0", "--seq-len=128"];
    finetune(&ck, &data, &whole, &extra).unwrap();
    let step3 = whole.join("checkpoints/step-000003");
    let mut more = extra.to_vec();
    more.extend(["--resume", step3.to_str().unwrap()]);
    let o = finetune(&ck, &data, &resumed, &more).unwrap();
    // No validation: nothing to report but the memory check's predicted peak.
    assert!(o.predicted_peak.is_some_and(|p| p > 0.0), "{o:?}");
    assert_eq!(Outcome { predicted_peak: None, ..o }, Outcome::default(), "no validation: nothing to report");
    let bits = |run: &Path| losses(run).into_iter().map(f64::to_bits).collect::<Vec<_>>();
    assert_eq!(bits(&whole).len(), 6);
    assert_eq!(bits(&whole), bits(&resumed), "the resumed run's losses differ from the whole run's");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn no_pack_truncate_train_on_last_and_val_data_run() {
    let dir = tmp("finetune-chat-flags");
    let (ck, data) = setup(&dir, 40);
    let val = dir.join("val.jsonl");
    let text = std::fs::read_to_string(data_path("chat.jsonl")).unwrap();
    std::fs::write(&val, text.lines().skip(500).take(5).map(|l| format!("{l}\n")).collect::<String>()).unwrap();
    let out = dir.join("run");
    // A template that writes the roles in capitals: the held-out prompt shows it is the one used.
    let template = dir.join("other.jinja");
    let t = std::fs::read_to_string(data_path("chat_template.jinja"))
        .unwrap()
        .replace("message['role']", "message['role'] | upper")
        .replace("<|bos|>assistant", "<|bos|>ASSISTANT");
    std::fs::write(&template, t).unwrap();
    let extra = [
        "--steps=2",
        "--no-pack",
        "--truncate",
        "--seq-len=48",
        "--train-on",
        "last",
        "--data-format=messages",
        "--val-data",
        val.to_str().unwrap(),
        "--chat-template",
        template.to_str().unwrap(),
    ];
    let o = finetune(&ck, &data, &out, &extra).unwrap();
    assert!(o.val_before.is_some() && o.val_after.is_some());
    let prompt = o.prompt.unwrap();
    assert!(prompt.starts_with("<|bos|>USER\n") && prompt.ends_with("<|bos|>ASSISTANT\n"), "{prompt:?}");
    assert_eq!(losses(&out).len(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn finetune_ladder_takes_the_same_chat_data() {
    let dir = tmp("finetune-chat-ladder");
    let (ck, data) = setup(&dir, 40);
    let out = dir.join("run");
    let head = ["finetune_ladder", "--device=cpu", "--seq-len=128", "--batch-size=2", "--eval-every=0"];
    let extra = ["--ladder-layers=1", "--steps=2", "--val-fraction=0.1", "--train-on=all", "--pack"];
    let a: FinetuneLadderArgs = parse_from(args(&head, &[flag("model", &ck), flag("data", &data), flag("out", &out)], &extra)).unwrap();
    ferrolm::cli::finetune_ladder::run(a).unwrap();
    assert_eq!(losses(&out).len(), 2);
    assert_eq!(val_losses(&out).len(), 1, "validation over the held-out conversations at the last step");
    // --val-fraction 0 (no validation, as finetune takes it): it trains, and converts only with
    // --steps 0, where it failed with "this run has no validation data" after loading the
    // model (and, with LoRA, writing OUT/base).
    for (name, steps) in [("noval", "--steps=2"), ("noval-convert", "--steps=0")] {
        let out = dir.join(name);
        let extra = ["--ladder-layers=1", steps, "--val-fraction=0", "--lora-rank=2"];
        let a: FinetuneLadderArgs = parse_from(args(&head, &[flag("model", &ck), flag("data", &data), flag("out", &out)], &extra)).unwrap();
        ferrolm::cli::finetune_ladder::run(a).unwrap();
        assert!(out.join("checkpoints/latest").is_file(), "{name}");
        if name == "noval" {
            assert!(val_losses(&out).is_empty() && losses(&out).len() == 2, "{name}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn plain_token_data_still_trains_in_windows() {
    let dir = tmp("finetune-chat-text");
    let (ck, _) = setup(&dir, 1);
    std::fs::remove_file(ck.join("chat_template.jinja")).unwrap(); // token data needs none
    let out = dir.join("run");
    let text = data_path("corpus/sonnets.txt");
    let o = finetune(&ck, &text, &out, &["--steps=2", "--seq-len=32"]).unwrap();
    assert!(o.val_after.is_some() && o.prompt.is_none());
    assert_eq!(losses(&out).len(), 2);
    // A model without a template gives checkpoints without one.
    let step = out.join("checkpoints/step-000002");
    assert!(step.join("tokenizer_config.json").is_file() && !step.join("chat_template.jinja").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn chat_flags_take_both_forms_and_bad_values_are_refused_naming_the_flag() {
    let p = |extra: &[&str]| parse_from::<FinetuneArgs, _, _>([&["finetune", "--model", "m"], extra].concat());
    let spaced = p(&[
        "--data-format",
        "sharegpt",
        "--chat-template",
        "t.jinja",
        "--train-on",
        "last",
        "--val-data",
        "v.jsonl",
        "--val-fraction",
        "0.1",
        "--no-pack",
        "--truncate",
    ])
    .unwrap();
    let joined = p(&[
        "--data-format=sharegpt",
        "--chat-template=t.jinja",
        "--train-on=last",
        "--val-data=v.jsonl",
        "--val-fraction=0.1",
        "--no-pack",
        "--truncate",
    ])
    .unwrap();
    assert_eq!(spaced, joined);
    let o = spaced.chat.options(false);
    assert!(!o.pack && o.truncate && o.val_fraction == 0.1 && o.chat_template == Some(PathBuf::from("t.jinja")));
    let d = p(&[]).unwrap().chat.options(false);
    assert!(d.pack && !d.truncate && d.val_fraction == 0.02 && d.val_data.is_none(), "defaults: {d:?}");
    assert!(p(&["--pack"]).unwrap().chat.options(false).pack);
    for (bad, flag) in
        [(["--data-format", "csv"], "--data-format"), (["--train-on", "user"], "--train-on"), (["--val-fraction", "1.5"], "--val-fraction")]
    {
        let e = p(&bad).unwrap_err().to_string();
        assert!(e.contains(flag), "{bad:?}: {e}");
    }
    assert!(p(&["--pack", "--no-pack"]).is_err(), "--pack and --no-pack conflict");
    // The same flags in finetune_ladder.
    let l: FinetuneLadderArgs =
        parse_from(["finetune_ladder", "--model", "m", "--ladder-layers", "2", "--train-on", "all", "--no-pack"]).unwrap();
    assert!(!l.chat.options(false).pack);
}

#[test]
fn finetuning_under_tp_dp_zero3_and_offload_follows_one_device() {
    let dir = tmp("finetune-chat-parallel");
    let (ck, data) = setup(&dir, 60);
    let common = ["--steps=6", "--val-fraction=0.1", "--seq-len=128"];
    let run = |out: &str, extra: &[&str]| {
        let flags: Vec<&str> = common.iter().chain(extra).copied().collect();
        let o = finetune(&ck, &data, &dir.join(out), &flags).unwrap();
        (losses(&dir.join(out)), o.val_after.unwrap())
    };
    // HEAD's --batch-size=2 per rank: one device takes the global batch of 4 through
    // --grad-accum 2 (the step-wide loss scale makes that the same step as 4 rows at once).
    let (one, val) = run("one", &["--grad-accum=2"]);
    assert_eq!(one.len(), 6);
    for (out, flags) in [
        ("tp2", vec!["--tp=2", "--grad-accum=2"]),
        ("dp2-zero3", vec!["--dp=2", "--zero=3"]),
        ("offload", vec!["--offload-optimizer", "--grad-accum=2"]),
    ] {
        let (l, v) = run(out, &flags);
        close(&l, &one, 1e-4, out);
        assert!((v - val).abs() <= 1e-4 * val, "{out}: validation {v} vs {val}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
