//! A run never loses work: each case of issue 13's "Losing work: never again", through the
//! training library (`Trainer`) the tools run on. Every test checks the error (or warning) a
//! user sees and that nothing on disk was deleted or overwritten that should not be.
mod common;
use common::*;
use ferrolm::run_dir;
use ferrolm::train::{RunSafety, Trainer};
use ferrolm::{DType, Device, Llama, Tensor};
use ferrolm_tensor::Rng;

fn poison(t: &Trainer) {
    let _g = ferrolm_tensor::no_grad();
    let (_, w) = &t.model.parameters()[1]; // the first layer's q_proj
    w.assign(&Tensor::full(w.dims().to_vec(), f64::NAN, DType::F32, Device::Cpu).unwrap()).unwrap();
}

/// Every weight's bits (NaN compares equal to itself this way).
fn weights(t: &Trainer) -> Vec<Vec<u32>> {
    t.model.parameters().iter().map(|(_, p)| p.to_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()).collect()
}

fn same(a: &[Vec<u32>], b: &[Vec<u32>]) -> bool {
    a == b
}

#[test]
fn a_new_run_into_a_used_out_dir_is_refused_and_nothing_is_touched() {
    let dir = tmp("reuse-out");
    let mut first = trainer(&dir, "run", TrainOptions { save_every: 2, ..opts(4) });
    first.run().unwrap();
    let before = snapshot(&dir.join("run"));
    assert!(before.iter().any(|(p, _)| p.ends_with("metrics.jsonl")));

    // The same step numbers would have replaced step-000002 and appended to metrics.jsonl.
    let mut second = trainer(&dir, "run", TrainOptions { save_every: 2, ..opts(2) });
    let err = format!("{:#}", second.run().unwrap_err());
    assert!(err.contains("already holds a run"), "{err}");
    assert!(err.contains("step-000002") && err.contains("metrics.jsonl"), "the message names what is there: {err}");
    assert!(err.contains("--resume") && err.contains("--out") && err.contains("--overwrite"), "the message says what to do: {err}");
    assert_eq!(second.step, 0, "no step was trained");
    assert_eq!(snapshot(&dir.join("run")), before, "the earlier run's files changed");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn overwrite_removes_the_old_run_first_and_says_so() {
    let dir = tmp("overwrite");
    let mut first = trainer(&dir, "run", TrainOptions { save_every: 2, ..opts(4) });
    first.run().unwrap();
    assert_eq!(checkpoint_names(&dir.join("run")), ["step-000002", "step-000004"]);

    let mut second = trainer(&dir, "run", opts(2)).with_safety(RunSafety { overwrite: true, ..RunSafety::default() });
    let (res, logs) = capture_logs(|| second.run());
    res.unwrap();
    assert!(logs.contains("--overwrite: removed") && logs.contains("step-000004") && logs.contains("metrics.jsonl"), "{logs}");
    // Only the new run is left: its one checkpoint, and a metrics file with its two steps.
    assert_eq!(checkpoint_names(&dir.join("run")), ["step-000002"]);
    let metrics = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
    let steps: Vec<u64> = metrics
        .lines()
        .filter(|l| l.contains("\"loss\""))
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2], "old metrics were kept or appended to: {metrics}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn non_finite_or_negative_options_never_train() {
    let dir = tmp("nan-lr");
    let (train, val, vocab) = shards(&dir);
    for (o, flag) in [
        (TrainOptions { lr: f64::NAN, ..opts(2) }, "--lr"),
        (TrainOptions { lr: f64::INFINITY, ..opts(2) }, "--lr"),
        (TrainOptions { lr: -1e-3, ..opts(2) }, "--lr"),
        (TrainOptions { weight_decay: f64::NAN, ..opts(2) }, "weight_decay"),
        (TrainOptions { batch_size: 0, ..opts(2) }, "--batch-size"),
    ] {
        let err = Trainer::new(model(vocab), &train, &val, o, &dir.join("run")).err().expect("must be refused").to_string();
        assert!(err.contains(flag), "{err}");
    }
    assert!(!dir.join("run").exists(), "a refused run wrote its output directory");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn non_finite_steps_are_skipped_before_the_update_and_the_run_stops_after_n_in_a_row() {
    let dir = tmp("skip");
    let mut t = trainer(&dir, "run", opts(20)).with_safety(RunSafety { max_skipped_steps: 3, ..RunSafety::default() });
    let clean = weights(&t);
    poison(&t);
    let poisoned = weights(&t);
    let (res, logs) = capture_logs(|| t.train_step());
    let (loss, _, _) = res.unwrap();
    assert!(!loss.is_finite());
    assert!(logs.contains("step 1") && logs.contains("skipping this update"), "{logs}");
    // No update: AdamW with weight decay would have moved every weight.
    assert!(same(&weights(&t), &poisoned), "a skipped step changed the weights");

    // A finite step in between resets the count.
    {
        let _g = ferrolm_tensor::no_grad();
        for ((_, p), w) in t.model.parameters().iter().zip(&clean) {
            let v: Vec<f32> = w.iter().map(|b| f32::from_bits(*b)).collect();
            p.assign(&Tensor::from_vec(v, p.dims().to_vec(), Device::Cpu).unwrap()).unwrap();
        }
    }
    let (loss, norm, _) = t.train_step().unwrap();
    assert!(loss.is_finite() && norm.is_finite());
    assert!(!same(&weights(&t), &clean), "a finite step must update");

    poison(&t);
    t.train_step().unwrap();
    t.train_step().unwrap();
    let err = format!("{:#}", t.train_step().unwrap_err());
    assert!(err.contains("3 steps in a row") && err.contains("--max-skipped-steps 3"), "{err}");
    assert_eq!(t.step, 5);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_run_that_only_sees_nan_stops_without_writing_a_checkpoint() {
    let dir = tmp("nan-run");
    let mut t = trainer(&dir, "run", TrainOptions { save_every: 1, ..opts(10) });
    poison(&t);
    let err = format!("{:#}", t.run().unwrap_err());
    assert!(err.contains("refusing to save checkpoint step-000001") && err.contains("NaN"), "{err}");
    assert!(checkpoint_names(&dir.join("run")).is_empty(), "a NaN checkpoint was written");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_checkpoint_is_rewritten_only_by_the_trainer_that_saved_it() {
    let dir = tmp("resave");
    let run = dir.join("run");
    let mut t = trainer(&dir, "run", opts(2));
    t.run().unwrap();
    // Saving again after run() saved the last step rewrites that same checkpoint.
    assert_eq!(t.save_checkpoint().unwrap(), run.join("checkpoints/step-000002"));
    assert_eq!(checkpoint_names(&run), ["step-000002"]);
    // Another trainer at the same step (here: a fresh one stepped by hand) may not.
    let before = snapshot(&run);
    let mut other = trainer(&dir, "run", opts(2));
    other.train_step().unwrap();
    other.train_step().unwrap();
    let err = format!("{:#}", other.save_checkpoint().unwrap_err());
    assert!(err.contains("step-000002 already exists: refusing to overwrite"), "{err}");
    assert_eq!(snapshot(&run), before);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn weights_that_are_not_finite_are_never_saved_and_latest_stays() {
    let dir = tmp("nan-save");
    let mut t = trainer(&dir, "run", opts(3));
    t.train_step().unwrap();
    t.save_checkpoint().unwrap();
    t.train_step().unwrap();
    poison(&t);
    let err = format!("{:#}", t.save_checkpoint().unwrap_err());
    assert!(err.contains("refusing to save checkpoint step-000002") && err.contains("model.layers.0.self_attn.q_proj.weight"), "{err}");
    assert_eq!(checkpoint_names(&dir.join("run")), ["step-000001"]);
    assert_eq!(latest(&dir.join("run")), "step-000001");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_validation_split_without_one_window_is_refused_when_the_run_starts() {
    let dir = tmp("small-val");
    // 0.05% of the sonnets: a handful of tokens, less than one window of 33.
    let (train, val, vocab) = shards_with(&dir, 0.0005);
    let o = TrainOptions { eval_every: 2, seq_len: 32, ..opts(4) };
    let err = format!("{:#}", Trainer::new(model(vocab), &train, &val, o, &dir.join("run")).err().unwrap());
    assert!(err.contains("validation split") && err.contains("--seq-len 32"), "{err}");
    assert!(!dir.join("run").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_error_during_validation_never_costs_the_checkpoint() {
    let dir = tmp("eval-error");
    let mut t = trainer(&dir, "run", TrainOptions { eval_every: 2, ..opts(4) });
    // The split was fine at start; it disappears mid-run (a network mount dropping, say).
    for p in ferrolm::data::list_shards(dir.join("shards"), "val").unwrap() {
        std::fs::remove_file(p).unwrap();
    }
    let err = format!("{:#}", t.run().unwrap_err());
    assert!(err.contains("validation at step 2 failed (the checkpoint of this step was saved)"), "{err}");
    assert_eq!(checkpoint_names(&dir.join("run")), ["step-000002"]);
    assert_eq!(latest(&dir.join("run")), "step-000002");
    assert_eq!(t.step, 2);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resume_rejects_a_checkpoint_of_a_different_model_and_names_the_fields() {
    let dir = tmp("resume-other-model");
    let mut t = trainer(&dir, "run", opts(2));
    t.run().unwrap();
    let (train, val, vocab) = shards(&dir);
    let deeper = Llama::new(config(vocab, 3), DType::F32, Device::Cpu, &mut Rng::new(5)).unwrap();
    let init: Vec<Vec<u32>> =
        deeper.parameters().iter().map(|(_, p)| p.to_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()).collect();
    let mut other = Trainer::new(deeper, &train, &val, opts(4), &dir.join("run")).unwrap();
    let err = format!("{:#}", other.resume(&dir.join("run")).unwrap_err());
    assert!(err.contains("different model") && err.contains("num_hidden_layers: checkpoint 2, this run 3"), "{err}");
    assert_eq!(other.step, 0);
    assert!(same(&weights(&other), &init), "a rejected resume changed the weights");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resume_warns_about_changed_options_with_old_and_new_values() {
    let dir = tmp("resume-options");
    let mut t = trainer(&dir, "run", opts(2));
    t.run().unwrap();
    let mut next = trainer(&dir, "run", ferrolm::train::TrainOptions { lr: 1e-3, batch_size: 3, ..opts(4) });
    let (res, logs) = capture_logs(|| next.resume(&dir.join("run")));
    res.unwrap();
    assert!(logs.contains("--steps 2 -> 4") && logs.contains("schedule is reshaped"), "{logs}");
    assert!(logs.contains("--lr 0.003 -> 0.001") && logs.contains("--batch-size 2 -> 3"), "{logs}");
    assert!(!logs.contains("--seq-len"), "an unchanged option was reported: {logs}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn keep_last_prunes_old_checkpoints_and_keeps_the_newest() {
    let dir = tmp("keep-last");
    let mut t =
        trainer(&dir, "run", TrainOptions { save_every: 1, ..opts(5) }).with_safety(RunSafety { keep_last: 2, ..RunSafety::default() });
    t.run().unwrap();
    assert_eq!(checkpoint_names(&dir.join("run")), ["step-000004", "step-000005"]);
    assert_eq!(latest(&dir.join("run")), "step-000005");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn prune_never_removes_the_checkpoint_latest_names() {
    let dir = tmp("prune-latest");
    let mut t = trainer(&dir, "run", TrainOptions { save_every: 1, ..opts(4) });
    t.run().unwrap();
    let root = dir.join("run/checkpoints");
    std::fs::write(root.join("latest"), "step-000001").unwrap();
    let removed = run_dir::prune(&root, 2).unwrap();
    assert_eq!(removed.len(), 1, "{removed:?}");
    assert_eq!(checkpoint_names(&dir.join("run")), ["step-000001", "step-000003", "step-000004"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn latest_naming_a_missing_or_incomplete_checkpoint_falls_back_to_the_newest_complete_one() {
    let dir = tmp("latest-fallback");
    let mut t = trainer(&dir, "run", TrainOptions { save_every: 2, ..opts(4) });
    t.run().unwrap();
    let run = dir.join("run");
    // Incomplete: trainer_state.json (written last) is gone.
    std::fs::remove_file(run.join("checkpoints/step-000004/trainer_state.json")).unwrap();
    let (got, logs) = capture_logs(|| run_dir::resolve_checkpoint(&run));
    assert_eq!(got.unwrap(), run.join("checkpoints/step-000002"));
    assert!(logs.contains("names step-000004, which is missing or incomplete"), "{logs}");
    // Missing altogether.
    std::fs::remove_dir_all(run.join("checkpoints/step-000004")).unwrap();
    assert_eq!(run_dir::resolve_checkpoint(&run).unwrap(), run.join("checkpoints/step-000002"));
    // And a resume really continues from there.
    let mut next = trainer(&dir, "run", opts(4));
    next.resume(&run).unwrap();
    assert_eq!(next.step, 2);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A full disk, for real: the test runs itself again as a child process whose files may not grow
/// past a limit (RLIMIT_FSIZE, with SIGXFSZ ignored, so a write past it fails with EFBIG). The
/// limit lets the small files of a checkpoint through and stops the shard file midway.
#[test]
fn a_save_that_fails_midway_leaves_the_previous_checkpoint_usable_and_removes_the_partial_one() {
    const CHILD: &str = "FERROLM_TEST_DISK_FULL_CHILD";
    if std::env::var(CHILD).is_ok() {
        return disk_full_child();
    }
    let name = "a_save_that_fails_midway_leaves_the_previous_checkpoint_usable_and_removes_the_partial_one";
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("disk-full child: checked"), "{text}");
}

fn set_file_size_limit(bytes: u64) {
    // SAFETY: plain system calls on this process: ignore SIGXFSZ, set the soft file-size limit.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        assert_eq!(libc::getrlimit(libc::RLIMIT_FSIZE, &mut lim), 0);
        lim.rlim_cur = bytes;
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &lim), 0);
    }
}

fn disk_full_child() {
    let dir = tmp("disk-full");
    let run = dir.join("run");
    let mut t = trainer(&dir, "run", TrainOptions { save_every: 2, ..opts(4) });
    for _ in 0..2 {
        t.train_step().unwrap();
    }
    t.save_checkpoint().unwrap();
    let before = snapshot(&run.join("checkpoints"));
    let size = |f: &str| std::fs::metadata(run.join("checkpoints/step-000002").join(f)).unwrap().len();
    let (shard, model) = (size("shards/tp0-dp0.safetensors"), size("model.safetensors"));
    assert!(shard > model + 1024, "the shard (parameters and optimizer state) is the biggest file: {shard} vs {model}");
    t.train_step().unwrap();
    set_file_size_limit((shard + model) / 2);
    let err = format!("{:#}", t.save_checkpoint().unwrap_err());
    set_file_size_limit(libc::RLIM_INFINITY);
    assert!(err.contains("saving checkpoint step-000003 failed"), "{err}");
    assert!(err.contains("latest still names step-000002"), "{err}");
    assert!(err.contains("tp0-dp0.safetensors"), "the cause names the file: {err}");
    assert_eq!(snapshot(&run.join("checkpoints")), before, "the partial checkpoint was left behind or the previous one changed");
    let mut next = trainer(&dir, "run", opts(4));
    next.resume(&run).unwrap();
    assert_eq!(next.step, 2);
    let _ = std::fs::remove_dir_all(&dir);
    println!("disk-full child: checked");
}

#[test]
fn a_batch_size_in_the_trillions_is_refused_before_anything_is_allocated() {
    let dir = tmp("huge-batch");
    let (train, val, vocab) = shards(&dir);
    for (o, want) in [
        (TrainOptions { batch_size: 1_000_000_000_000, ..opts(2) }, "--batch-size 1000000000000"),
        (TrainOptions { batch_size: usize::MAX / 2, ..opts(2) }, "overflows"),
        (TrainOptions { grad_accum: usize::MAX / 4, ..opts(2) }, "--grad-accum"),
        // No overflow, but a step of 2e12 tokens: it used to draw micro-batches until the
        // machine ran out of memory (the process was killed).
        (TrainOptions { grad_accum: 100_000_000_000, ..opts(2) }, "tokens a step may hold on a rank"),
    ] {
        let e = Trainer::new(model(vocab), &train, &val, o, &dir.join("run")).err().unwrap();
        let err = format!("{e:#}");
        assert!(err.contains(want), "{err}");
        assert_eq!(ferrolm::cli::exit_code(&e), 2, "a flag error: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--eval-every 0` means "only at the end of the run" (its help says so); it used to mean never.
#[test]
fn eval_every_zero_validates_once_at_the_end() {
    let dir = tmp("eval-zero");
    let run = dir.join("run");
    let mut t = trainer(&dir, "run", TrainOptions { eval_every: 0, ..opts(3) });
    t.run().unwrap();
    let vals: Vec<u64> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| l.contains("\"val_loss\""))
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
        .collect();
    assert_eq!(vals, [3]);
    assert_eq!(t.val_history.len(), 1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resume_restores_the_loss_history_and_drops_lines_after_the_checkpoint() {
    let dir = tmp("history");
    let run = dir.join("run");
    let mut t = trainer(&dir, "run", TrainOptions { save_every: 2, eval_every: 2, ..opts(4) });
    t.run().unwrap();
    let full = t.history.clone();
    // A crash after step 4's checkpoint: steps 5 and 6 were logged, never saved.
    let mut m = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    m.push_str("{\"step\":5,\"loss\":9.0}\n{\"step\":6,\"loss\":9.0}\n");
    std::fs::write(run.join("metrics.jsonl"), m).unwrap();

    let mut next = trainer(&dir, "run", TrainOptions { save_every: 2, eval_every: 2, ..opts(6) });
    next.resume(&run).unwrap();
    assert_eq!(next.history, full, "the history before the checkpoint is restored");
    assert_eq!(next.val_history.len(), 2);
    let (res, logs) = capture_logs(|| next.run());
    res.unwrap();
    assert!(logs.contains("dropping 2 line(s) after step 4"), "{logs}");
    let steps: Vec<u64> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| l.contains("\"loss\""))
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3, 4, 5, 6], "one line per step, none repeated");
    assert_eq!(next.history.len(), 6);
    assert!(next.history.iter().all(|h| h.1 != 9.0), "the dropped lines leaked into the curve");
    assert!(run.join("loss.png").is_file());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resuming_an_older_checkpoint_in_place_is_refused_when_newer_ones_would_be_overwritten() {
    let dir = tmp("resume-older");
    let run = dir.join("run");
    let mut t = trainer(&dir, "run", TrainOptions { save_every: 2, ..opts(4) });
    t.run().unwrap();
    let before = snapshot(&run);
    let mut again = trainer(&dir, "run", TrainOptions { save_every: 2, ..opts(4) });
    again.resume(&run.join("checkpoints/step-000002")).unwrap();
    let err = format!("{:#}", again.run().unwrap_err());
    assert!(err.contains("newer than the resumed step 2") && err.contains("step-000004"), "{err}");
    assert_eq!(snapshot(&run), before);
    let _ = std::fs::remove_dir_all(&dir);
}

use ferrolm::train::TrainOptions;
