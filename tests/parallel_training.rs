//! The training tools on thread ranks follow the single-device run: tensor parallelism for
//! Llama and Ladder, data parallelism with ZeRO, and resuming across layouts (a tp 2 run on one
//! device and the other way round). Losses compared step by step from metrics.jsonl.
mod common;
use common::*;
use std::path::Path;

const STEPS: usize = 20;

fn pretrain(dir: &Path, data: &Path, cfg: &Path, out: &str, extra: &[&str]) {
    let flags: Vec<&str> = ["--eval-every=0", "--save-every=10", "--lr=3e-3"].into_iter().chain(extra.iter().copied()).collect();
    ferrolm::cli::pretrain::run(pretrain_args(data, cfg, &dir.join(out), &flags)).unwrap();
}

fn losses(run: &Path) -> Vec<f64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?.get("loss")?.as_f64())
        .collect()
}

fn close(a: &[f64], b: &[f64], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: {a:?} vs {b:?}");
    for (s, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol * y.abs(), "{what}: step {}: {x} vs {y}", s + 1);
    }
}

/// A prepared data set and a config with 4 heads / 2 kv heads (kv < tp at tp 4).
fn setup(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let (train, _, vocab) = shards(dir);
    let data = train[0].parent().unwrap().to_path_buf();
    let cfg = dir.join("config.json");
    let mut c = config(vocab.div_ceil(4) * 4, 2);
    c.tie_word_embeddings = false;
    std::fs::write(&cfg, c.to_json_string()).unwrap();
    (data, cfg)
}

#[test]
fn tensor_parallel_training_follows_one_device() {
    let dir = tmp("par-tp");
    let (data, cfg) = setup(&dir);
    let steps = format!("--steps={STEPS}");
    for (name, ladder) in [("llama", None), ("ladder", Some("--ladder-layers=all"))] {
        let extra = |tp: &'static str| -> Vec<String> {
            [Some(steps.clone()), Some(tp.into()), ladder.map(String::from)].into_iter().flatten().collect()
        };
        let run = |out: &str, tp: &'static str| {
            let e = extra(tp);
            pretrain(&dir, &data, &cfg, out, &e.iter().map(String::as_str).collect::<Vec<_>>());
            losses(&dir.join(out))
        };
        let one = run(&format!("{name}-1"), "--tp=1");
        assert!(one[STEPS - 1] < one[0] - 0.5, "{name}: does not learn: {one:?}");
        for tp in ["--tp=2", "--tp=4"] {
            close(&run(&format!("{name}-{tp}"), tp), &one, 1e-4, &format!("{name} {tp}"));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn data_parallel_zero_training_follows_one_device() {
    let dir = tmp("par-zero");
    let (data, cfg) = setup(&dir);
    let steps = format!("--steps={STEPS}");
    pretrain(&dir, &data, &cfg, "one", &[&steps, "--batch-size=4"]);
    let one = losses(&dir.join("one"));
    // The same global batch: 2 ranks x 2 sequences.
    for (out, flags) in [("dp2-zero2", vec!["--dp=2", "--zero=2"]), ("dp2-tp2-zero3", vec!["--dp=2", "--tp=2", "--zero=3"])] {
        let args: Vec<&str> = [steps.as_str(), "--batch-size=2"].into_iter().chain(flags).collect();
        pretrain(&dir, &data, &cfg, out, &args);
        close(&losses(&dir.join(out)), &one, 1e-4, out);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resume_across_tensor_parallel_degrees() {
    let dir = tmp("par-resume");
    let (data, cfg) = setup(&dir);
    let steps = format!("--steps={STEPS}");
    pretrain(&dir, &data, &cfg, "tp1", &[&steps]);
    pretrain(&dir, &data, &cfg, "tp2", &[&steps, "--tp=2"]);
    let whole = losses(&dir.join("tp1"));
    // A tp 2 run continued on one device, and a one-device run continued at tp 2.
    for (from, to, tp) in [("tp2", "from-tp2", "--tp=1"), ("tp1", "from-tp1", "--tp=2")] {
        let ck = dir.join(from).join("checkpoints/step-000010");
        pretrain(&dir, &data, &cfg, to, &[&steps, tp, "--resume", ck.to_str().unwrap()]);
        close(&losses(&dir.join(to)), &whole, 1e-4, &format!("{from} resumed with {tp}"));
    }
    let _ = std::fs::remove_dir_all(&dir);
}
