//! `eval --preference FILE` (issue 52): on the DPO fixture's tiny policy and reference
//! (tests/fixtures/dpo/, scripts/make_dpo_fixtures.py) with a word-level tokenizer of their 40
//! ids and a small preference file, both written here. The last line is
//! `dpo_loss X accuracy Y margin Z pairs N` and its values are those of `preference_loss` over
//! the same pairs computed directly; with `--lora` and no `--ref-model` the reference is the
//! base (the same numbers as `--ref-model` naming the base); without either every reward is 0,
//! with a warning; flags that do not apply exit with code 2.
mod common;
#[path = "common/tools.rs"]
mod tools;
use common::*;
use ferrolm::cli::eval::EvalArgs;
use ferrolm::cli::parse_from;
use ferrolm::data::preference::{load_preference_pairs, PreferenceOptions};
use ferrolm::data::Tokenizer;
use ferrolm::nn::objective::preference::{preference_loss, Normalizer, PreferenceConfig, ReferenceLogProbs};
use ferrolm::nn::objective::{pack_pairs, pair_logprobs};
use ferrolm::nn::{LoraConfig, Proj};
use ferrolm::{DType, Device, Llama};
use std::path::{Path, PathBuf};
use tools::{run_in, text};

#[test]
fn tool_process() {
    tools::child_entry();
}

/// A word-level tokenizer for the fixture's 40 ids: `<pad>` 0, `<s>` 1, `</s>` 2 (the EOS),
/// then `w3` .. `w39`, split on whitespace.
fn tokenizer_json() -> String {
    let special = |id: u32, s: &str| {
        format!(r#"{{"id":{id},"content":"{s}","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}}"#)
    };
    let mut vocab = vec![r#""<pad>":0"#.to_string(), r#""<s>":1"#.into(), r#""</s>":2"#.into()];
    vocab.extend((3..40).map(|i| format!(r#""w{i}":{i}"#)));
    format!(
        r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[{},{},{}],"normalizer":null,
"pre_tokenizer":{{"type":"WhitespaceSplit"}},"post_processor":null,"decoder":null,
"model":{{"type":"WordLevel","vocab":{{{}}},"unk_token":"<pad>"}}}}"#,
        special(0, "<pad>"),
        special(1, "<s>"),
        special(2, "</s>"),
        vocab.join(",")
    )
}

/// The fixture's policy and reference as model directories with the tokenizer, and a
/// preference file: six standard pairs (one with chosen equal to rejected, skipped and counted;
/// one whose prompt is most of the model's 32 positions).
struct Setup {
    dir: PathBuf,
    policy: PathBuf,
    reference: PathBuf,
    prefs: PathBuf,
}

fn setup(name: &str) -> Setup {
    let dir = tmp(name);
    let src = root().join("tests/fixtures/dpo");
    let mut dirs = vec![];
    for m in ["policy", "reference"] {
        let d = dir.join(m);
        std::fs::create_dir_all(&d).unwrap();
        for f in std::fs::read_dir(src.join(m)).unwrap() {
            let f = f.unwrap().path();
            std::fs::copy(&f, d.join(f.file_name().unwrap())).unwrap();
        }
        std::fs::write(d.join("tokenizer.json"), tokenizer_json()).unwrap();
        dirs.push(d);
    }
    let prefs = dir.join("prefs.jsonl");
    let rec = |p: &str, c: &str, r: &str| format!(r#"{{"prompt": "{p}", "chosen": "{c}", "rejected": "{r}"}}"#);
    let lines = [
        rec("<s> w5 w9 w3", " w7 w8", " w11"),
        rec("<s> w4", " w20 w21 w22 w23", " w30"),
        rec("<s> w12 w13 w14 w15 w16", " w6", " w17 w18 w19"),
        rec("<s> w33", " w34 w35", " w34 w35"),
        rec("<s> w25 w26", " w27", " w28 w29 w31 w32"),
        // 20 tokens of prompt + completion in a model of 32 positions (the prompt counted twice
        // would be 36).
        rec("<s> w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17", " w18 w19", " w20 w21 w22 w23"),
    ];
    std::fs::write(&prefs, lines.join("\n") + "\n").unwrap();
    Setup { policy: dirs[0].clone(), reference: dirs[1].clone(), prefs, dir }
}

fn eval_args(s: &Setup, extra: &[&str]) -> Vec<String> {
    args(&["eval", "--device=cpu", "--dtype=f32"], &[flag("model", &s.policy), flag("preference", &s.prefs)], extra)
}

/// The tool in a child process: (exit code, stdout, stderr).
fn run_eval(s: &Setup, extra: &[&str]) -> (i32, String, String) {
    let argv = eval_args(s, extra);
    let o = run_in(&s.dir, &[], &argv.iter().map(String::as_str).collect::<Vec<_>>());
    let (out, err) = text(&o);
    (o.status.code().unwrap_or(-1), out, err)
}

/// The last line's four values, checking its words.
fn last_line(out: &str) -> (f64, f64, f64, usize) {
    let line = out.lines().last().unwrap_or("");
    let w: Vec<&str> = line.split(' ').collect();
    assert_eq!(w.len(), 8, "{line:?}");
    assert_eq!((w[0], w[2], w[4], w[6]), ("dpo_loss", "accuracy", "margin", "pairs"), "{line:?}");
    (w[1].parse().unwrap(), w[3].parse().unwrap(), w[5].parse().unwrap(), w[7].parse().unwrap())
}

/// `preference_loss` over the file's pairs in one packed batch: the policy and the reference
/// loaded directly.
fn direct(s: &Setup, cfg: &PreferenceConfig, reference: &Path) -> (f64, [(&'static str, f64); 6], usize) {
    let tok = Tokenizer::from_file(s.policy.join("tokenizer.json")).unwrap();
    let inputs = ferrolm::data::resolve_inputs(&s.prefs).unwrap();
    let (pairs, _) = load_preference_pairs(&inputs, &PreferenceOptions::new(&tok, None), &mut |_, _, _| {}).unwrap();
    let b = pack_pairs(&pairs, 32, 0).unwrap();
    let _g = ferrolm::tensor::no_grad();
    let load = |d: &Path| Llama::from_pretrained(d, DType::F32, Device::Cpu).unwrap();
    let r = ReferenceLogProbs::of(&pair_logprobs(&load(reference), &b).unwrap()).unwrap();
    let p = pair_logprobs(&load(&s.policy), &b).unwrap();
    let (loss, m) = preference_loss(cfg, &p, &r, Normalizer::default()).unwrap();
    (loss.item().unwrap(), m.means(), pairs.len())
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * b.abs().max(1.0)
}

#[test]
fn the_last_line_is_preference_loss_over_the_file() {
    let s = setup("eval-pref-line");
    let (code, out, err) = run_eval(&s, &[&flag("ref-model", &s.reference), "--batch-size=2"]);
    assert_eq!(code, 0, "{out}\n{err}");
    let (loss, acc, margin, pairs) = last_line(&out);
    let (want, means, n) = direct(&s, &PreferenceConfig::default(), &s.reference);
    assert_eq!((pairs, n), (5, 5), "the pair with chosen equal to rejected is skipped: {out}");
    let get = |k: &str| means.iter().find(|(n, _)| *n == k).unwrap().1;
    // Printed with 6 decimals.
    assert!(close(loss, want, 2e-6), "dpo_loss {loss} vs {want}");
    assert!(close(acc, get("rewards/accuracies"), 2e-6), "accuracy {acc}");
    assert!(close(margin, get("rewards/margins"), 2e-6), "margin {margin}");
    assert!(acc > 0.0 && acc < 1.0 && margin != 0.0, "the fixture's rewards differ: {out}");
    // The other metrics above it, under TRL's names, and the data's summary.
    for (k, v) in means {
        let l = out.lines().find(|l| l.starts_with(&format!("{k} "))).unwrap_or_else(|| panic!("no {k} line: {out}"));
        let got: f64 = l.split(' ').nth(1).unwrap().parse().unwrap();
        assert!(close(got, v, 2e-6), "{k} {got} vs {v}");
    }
    assert!(out.contains("6 records: 5 pairs") && out.contains("1 with chosen equal to rejected"), "{out}");
    assert!(out.contains("reference: --ref-model"), "{out}");

    // In the process: every batch size and a weighted mix with `sft` (a token mean over the
    // whole file) give preference_loss over all the pairs at once.
    let cfg = PreferenceConfig::parse(0.5, "sigmoid,sft,ipo", Some("1,0.5,0.25")).unwrap();
    let (want, means, _) = direct(&s, &cfg, &s.reference);
    // With --tp 2 (thread ranks) the vocabulary-parallel head gives the same sums.
    for (bs, tp) in [("1", "1"), ("3", "1"), ("2", "2")] {
        let extra = [flag("ref-model", &s.reference), "--beta=0.5".into(), "--loss-type=sigmoid,sft,ipo".into()];
        let extra =
            [&extra[..], &["--loss-weights".into(), "1,0.5,0.25".into(), "--batch-size".into(), bs.into(), format!("--tp={tp}")]].concat();
        let a: EvalArgs = parse_from(eval_args(&s, &extra.iter().map(String::as_str).collect::<Vec<_>>())).unwrap();
        let got = ferrolm::cli::eval::evaluate_preference(a).unwrap();
        assert!(close(got.loss, want, 1e-5), "--batch-size {bs} --tp {tp}: {} vs {want}", got.loss);
        for ((k, v), (_, w)) in got.metrics.means().iter().zip(means) {
            assert!(close(*v, w, 1e-5), "--batch-size {bs} --tp {tp}: {k} {v} vs {w}");
        }
    }
    let _ = std::fs::remove_dir_all(&s.dir);
}

/// LoRA adapters on the policy with B not zero (they change its outputs), saved in PEFT's format.
fn adapter(s: &Setup) -> PathBuf {
    let mut m = Llama::from_pretrained(&s.policy, DType::F32, Device::Cpu).unwrap();
    m.add_lora(&LoraConfig::new(2, None, 0.0, Proj::ALL.to_vec(), false).unwrap(), &mut ferrolm_tensor::Rng::new(3)).unwrap();
    let mut rng = ferrolm_tensor::Rng::new(4);
    m.visit_adapters_mut(&mut |_, t| {
        *t = ferrolm::Tensor::randn(t.dims().to_vec(), 0.5, t.dtype(), t.device(), &mut rng)?;
        Ok(())
    })
    .unwrap();
    let d = s.dir.join("adapter");
    m.save_adapter(&d, s.policy.to_str().unwrap()).unwrap();
    d
}

#[test]
fn lora_scores_against_its_base_and_no_reference_gives_zero_rewards() {
    let s = setup("eval-pref-lora");
    let ad = adapter(&s);
    let score = |extra: &[String]| {
        let a: EvalArgs = parse_from(eval_args(&s, &extra.iter().map(String::as_str).collect::<Vec<_>>())).unwrap();
        ferrolm::cli::eval::evaluate_preference(a).unwrap()
    };
    let off = score(&[flag("lora", &ad)]);
    let base = score(&[flag("lora", &ad), flag("ref-model", &s.policy)]);
    assert_eq!(off.metrics.pairs, 5);
    assert!(close(off.loss, base.loss, 1e-6), "adapters off {} vs the base as --ref-model {}", off.loss, base.loss);
    for ((k, a), (_, b)) in off.metrics.means().iter().zip(base.metrics.means()) {
        assert!(close(*a, b, 1e-6), "{k}: adapters off {a} vs the base {b}");
    }
    // The adapters move the rewards away from 0 (the reference is not the adapted model).
    assert!(off.metrics.margins.abs() > 1e-4, "{off:?}");

    // No reference: the model itself, every reward 0 (sigmoid: ln 2), and a warning says so.
    let (code, out, err) = run_eval(&s, &[]);
    assert_eq!(code, 0, "{out}\n{err}");
    let (loss, acc, margin, pairs) = last_line(&out);
    assert_eq!((acc, margin, pairs), (0.0, 0.0, 5), "{out}");
    assert!(close(loss, std::f64::consts::LN_2, 2e-6), "{loss}");
    assert!(err.contains("every reward is 0"), "{err}");
    let _ = std::fs::remove_dir_all(&s.dir);
}

#[test]
fn flags_that_do_not_apply_exit_2() {
    let s = setup("eval-pref-flags");
    let bad: [&[&str]; 8] = [
        &["--beta=0"],
        &["--loss-type=dpo"],
        &["--loss-type=sigmoid,sft", "--loss-weights=1"],
        &["--data-format=messages"],
        &["--max-length=33"],
        &["--truncate"],
        &["--seq-len=8"],
        &["--train-on=all"],
    ];
    for extra in bad {
        let (code, out, err) = run_eval(&s, extra);
        assert_eq!(code, 2, "{extra:?} exits 2\n{out}\n{err}");
        let flag = extra[extra.len() - 1].split('=').next().unwrap();
        assert!(err.contains(flag), "{extra:?}: the error names the flag: {err}");
    }
    // The preference flags need --preference.
    let p = |x: &[&str]| parse_from::<EvalArgs, _, _>([&["eval", "--model", "m", "--text", "t", "--seq-len=4"], x].concat());
    assert!(p(&[]).is_ok());
    for x in ["--ref-model=r", "--beta=0.2", "--loss-type=ipo", "--loss-weights=1", "--max-length=8", "--max-prompt-length=4"] {
        assert!(p(&[x]).is_err(), "{x} without --preference");
    }
    assert!(parse_from::<EvalArgs, _, _>(["eval", "--model", "m", "--preference", "p", "--chat", "c"]).is_err());
    // A --ref-model with another vocabulary is refused by name.
    let other = s.dir.join("other");
    std::fs::create_dir_all(&other).unwrap();
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(s.reference.join(f), other.join(f)).unwrap();
    }
    let cfg = std::fs::read_to_string(s.reference.join("config.json")).unwrap().replace("\"vocab_size\": 40", "\"vocab_size\": 48");
    std::fs::write(other.join("config.json"), cfg).unwrap();
    let (code, _, err) = run_eval(&s, &[&flag("ref-model", &other)]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--ref-model") && err.contains("vocab_size"), "{err}");
    let _ = std::fs::remove_dir_all(&s.dir);
}
