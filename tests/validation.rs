//! One validation protocol (issue 41, item 3): the in-loop validation scores the same windows,
//! and so gives the same loss, on every layout of the same global batch (one device, DP with
//! ZeRO, TP, both, on CPU thread ranks); it says in `metrics.jsonl` how many tokens it scored;
//! and the last step's validation is the whole split on the trained weights, as scoring the
//! saved checkpoint gives it (the number `final validation loss` prints).
mod common;
use common::*;
use ferrolm::data::eval_batches;
use ferrolm::nn::Llama;
use ferrolm::{DType, Device};
use std::path::Path;

/// (step, val_loss, val_tokens) of each validation line of `run`/metrics.jsonl.
fn validations(run: &Path) -> Vec<(u64, f64, u64)> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    text.lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let loss = v.get("val_loss")?.as_f64()?;
            let tokens = v.get("val_tokens").and_then(|t| t.as_u64()).unwrap_or(0);
            Some((v["step"].as_u64().unwrap(), loss, tokens))
        })
        .collect()
}

#[test]
fn validation_is_one_protocol_on_every_layout() {
    let at = ParallelDir::new("val-protocol", 0.1);
    let train = |out: &str, extra: &[&str]| {
        let flags: Vec<&str> = ["--steps=2", "--eval-every=1", "--lr=3e-3"].into_iter().chain(extra.iter().copied()).collect();
        let run = at.dir.join(out);
        ferrolm::cli::pretrain::run(pretrain_args(&at.data, &at.cfg, &run, &flags)).unwrap();
        run
    };
    let one_dir = train("one", &["--batch-size=4"]);
    let one = validations(&one_dir);
    assert_eq!(one.iter().map(|v| v.0).collect::<Vec<_>>(), [1, 2], "a validation at each step: {one:?}");

    // The last step scores the whole split: every full 17-token window of the val shards, on the
    // weights of the checkpoint of that step.
    let val = ferrolm::data::list_shards(&at.data, "val").unwrap();
    let model = Llama::from_pretrained(&one_dir.join("checkpoints/step-000002"), DType::F32, Device::Cpu).unwrap();
    let (mut sum, mut n) = (0.0, 0usize);
    let _g = ferrolm::tensor::no_grad();
    for b in eval_batches(&val, 8, 16).unwrap() {
        let (x, y) = ferrolm::train::batch_tensors(&b, Device::Cpu).unwrap();
        sum += model.loss(&x, &y).unwrap().item().unwrap() * (b.batch * b.seq) as f64;
        n += b.batch * b.seq;
    }
    let whole = sum / n as f64;
    assert_eq!(one[1].2, n as u64, "the last validation scores every window's tokens");
    assert!((one[1].1 - whole).abs() < 1e-5 * whole, "the last validation {} vs the checkpoint over the split {whole}", one[1].1);
    // The in-loop one is the first 20 global batches of 4 windows, fewer than the split holds.
    assert_eq!(one[0].2, 20 * 4 * 16, "the in-loop validation scores 80 windows of 16 tokens");
    assert!(n > 80 * 16, "the split ({n} tokens) must be larger than the in-loop subset for this test");

    // The same global batch of 4 sequences on other layouts: the same tokens, the same losses.
    for (out, flags) in [
        ("dp2-zero2", &["--batch-size=2", "--dp=2", "--zero=2"][..]),
        ("tp2", &["--batch-size=4", "--tp=2"]),
        ("dp2-tp2-zero3", &["--batch-size=2", "--dp=2", "--tp=2", "--zero=3"]),
    ] {
        let got = validations(&train(out, flags));
        assert_eq!(got.len(), one.len(), "{out}: {got:?}");
        for (g, o) in got.iter().zip(&one) {
            assert_eq!((g.0, g.2), (o.0, o.2), "{out}: step {}: the tokens scored", o.0);
            assert!((g.1 - o.1).abs() < 1e-4 * o.1, "{out}: step {}: val loss {} vs one device {}", o.0, g.1, o.1);
        }
    }
}
