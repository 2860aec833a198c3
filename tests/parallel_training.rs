//! The training tools on thread ranks follow the single-device run: tensor parallelism for
//! Llama and Ladder, data parallelism with ZeRO, and resuming across layouts (a tp 2 run on one
//! device and the other way round). Losses compared step by step from metrics.jsonl.
mod common;
use common::*;

const STEPS: usize = 20;

/// The runs of one test, each trained into a subfolder of a [`ParallelDir`].
struct Runs {
    at: ParallelDir,
    /// `--steps=STEPS`.
    steps: String,
}

impl Runs {
    fn new(name: &str) -> Runs {
        Runs { at: ParallelDir::new(name, 0.1), steps: format!("--steps={STEPS}") }
    }

    /// Trains into `out` with `extra` flags and returns its loss curve.
    fn pretrain(&self, out: &str, extra: &[&str]) -> Vec<f64> {
        let flags: Vec<&str> = ["--eval-every=0", "--save-every=10", "--lr=3e-3"].into_iter().chain(extra.iter().copied()).collect();
        let run = self.at.dir.join(out);
        ferrolm::cli::pretrain::run(pretrain_args(&self.at.data, &self.at.cfg, &run, &flags)).unwrap();
        losses(&run)
    }
}

#[test]
fn tensor_parallel_training_follows_one_device() {
    let runs = Runs::new("par-tp");
    for (name, ladder) in [("llama", None), ("ladder", Some("--ladder-layers=all"))] {
        let run = |out: &str, tp: &'static str| {
            let e: Vec<&str> = [Some(runs.steps.as_str()), Some(tp), ladder].into_iter().flatten().collect();
            runs.pretrain(out, &e)
        };
        let one = run(&format!("{name}-1"), "--tp=1");
        assert!(one[STEPS - 1] < one[0] - 0.5, "{name}: does not learn: {one:?}");
        for tp in ["--tp=2", "--tp=4"] {
            close(&run(&format!("{name}-{tp}"), tp), &one, 1e-4, &format!("{name} {tp}"));
        }
    }
}

#[test]
fn data_parallel_zero_training_follows_one_device() {
    let runs = Runs::new("par-zero");
    let one = runs.pretrain("one", &[&runs.steps, "--batch-size=4"]);
    // The same global batch: 2 ranks x 2 sequences.
    for (out, flags) in [("dp2-zero2", vec!["--dp=2", "--zero=2"]), ("dp2-tp2-zero3", vec!["--dp=2", "--tp=2", "--zero=3"])] {
        let args: Vec<&str> = [runs.steps.as_str(), "--batch-size=2"].into_iter().chain(flags).collect();
        close(&runs.pretrain(out, &args), &one, 1e-4, out);
    }
}

#[test]
fn resume_across_tensor_parallel_degrees() {
    let runs = Runs::new("par-resume");
    let whole = runs.pretrain("tp1", &[&runs.steps]);
    runs.pretrain("tp2", &[&runs.steps, "--tp=2"]);
    // A tp 2 run continued on one device, and a one-device run continued at tp 2.
    for (from, to, tp) in [("tp2", "from-tp2", "--tp=1"), ("tp1", "from-tp1", "--tp=2")] {
        let ck = runs.at.dir.join(from).join("checkpoints/step-000010");
        let resumed = runs.pretrain(to, &[&runs.steps, tp, "--resume", ck.to_str().unwrap()]);
        close(&resumed, &whole, 1e-4, &format!("{from} resumed with {tp}"));
    }
}
