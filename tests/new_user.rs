//! What a new user tripped over in the first hour (issue 41), each as the user met it: paths a
//! `--model` takes, where a resumed run writes, a generation longer than the context, a
//! `--config` path that does not exist, the `parallel:` line and sharding over one rank, layout
//! errors found before any rank starts (exit 2), the launcher's message without a GPU, `plan`'s
//! presets and columns, the tokenizer cache, the inference tools' `--dtype` help, and `export`.
//! The tools run in-process (`cli::*::run`) or, where the working directory, stdout or the exit
//! code matter, as child processes (`common/tools.rs`).
mod common;
#[path = "common/tools.rs"]
mod tools;
use common::*;
use ferrolm::cli::{error_report, parse_from, run_tool};
use std::path::{Path, PathBuf};

#[test]
fn tool_process() {
    tools::child_entry();
}

/// A finished 2-step run of the small config in `dir/run`, a checkpoint at each step.
fn trained_run(p: &ParallelDir) -> PathBuf {
    let run = p.dir.join("run");
    let a = pretrain_args(&p.data, &p.cfg, &run, &["--steps=2", "--batch-size=2", "--save-every=1", "--eval-every=0"]);
    ferrolm::cli::pretrain::run(a).unwrap();
    run
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Every `--model` takes what `--resume` takes: a checkpoint, a run directory (its newest
/// complete checkpoint) or `checkpoints/latest`, and says which checkpoint it chose.
#[test]
fn model_takes_a_checkpoint_a_run_directory_or_checkpoints_latest() {
    let p = ParallelDir::new("model-paths", 0.1);
    let run = trained_run(&p);
    let newest = run.join("checkpoints/step-000002");
    let text = data_path("corpus/sonnets.txt");
    for (given, says) in
        [(run.clone(), true), (run.join("checkpoints/latest"), true), (run.join("checkpoints"), true), (newest.clone(), false)]
    {
        let e: ferrolm::cli::eval::EvalArgs =
            parse_from(["eval", "--device=cpu", "--model", s(&given), "--text", s(&text), "--seq-len=16"]).unwrap();
        let (r, logs) = capture_logs(|| ferrolm::cli::eval::run(e));
        r.unwrap_or_else(|e| panic!("eval --model {}: {}", given.display(), error_report(&e)));
        let chosen = format!("using the checkpoint {}", newest.display());
        assert_eq!(logs.contains(&chosen), says, "eval --model {}: the log must name the checkpoint chosen:\n{logs}", given.display());

        let g: ferrolm::cli::generate::GenerateArgs =
            parse_from(["generate", "--device=cpu", "--model", s(&given), "--prompt", "Shall I", "--max-new-tokens=3"]).unwrap();
        ferrolm::cli::generate::run(g).unwrap_or_else(|e| panic!("generate --model {}: {}", given.display(), error_report(&e)));
    }
    // finetune_ladder converts the run's newest checkpoint (--steps 0: convert only).
    let out = p.dir.join("ladder");
    let f: ferrolm::cli::finetune_ladder::FinetuneLadderArgs = parse_from(args(
        &["finetune_ladder", "--device=cpu", "--seq-len=16", "--batch-size=2", "--ladder-layers=1", "--steps=0"],
        &[flag("model", &run.join("checkpoints/latest")), flag("data", &p.data), flag("out", &out)],
        &[],
    ))
    .unwrap();
    ferrolm::cli::finetune_ladder::run(f)
        .unwrap_or_else(|e| panic!("finetune_ladder --model RUN/checkpoints/latest: {}", error_report(&e)));
    assert!(out.join("checkpoints/step-000000/config.json").is_file());
    // finetune takes the same paths, and its resumed run continues in its own directory.
    let out = p.dir.join("sft");
    let head = ["finetune", "--device=cpu", "--seq-len=16", "--batch-size=2", "--eval-every=0"];
    let f: ferrolm::cli::finetune::FinetuneArgs = parse_from(args(
        &head,
        &[flag("model", &run.join("checkpoints/latest")), flag("data", &p.data), flag("out", &out)],
        &["--steps=1"],
    ))
    .unwrap();
    ferrolm::cli::finetune::run(f).unwrap_or_else(|e| panic!("finetune --model RUN/checkpoints/latest: {}", error_report(&e)));
    let f: ferrolm::cli::finetune::FinetuneArgs =
        parse_from(args(&head, &[flag("model", &run), flag("data", &p.data), flag("resume", &out)], &["--steps=2"])).unwrap();
    ferrolm::cli::finetune::run(f).unwrap_or_else(|e| panic!("finetune --resume RUN: {}", error_report(&e)));
    assert!(out.join("checkpoints/step-000002/config.json").is_file(), "finetune --resume did not continue in {}", out.display());
    // A path that is none of these says so.
    let e: ferrolm::cli::eval::EvalArgs =
        parse_from(["eval", "--device=cpu", "--model", s(&p.dir.join("nothing")), "--text", s(&text), "--seq-len=16"]).unwrap();
    let err = error_report(&ferrolm::cli::eval::run(e).unwrap_err());
    assert!(err.contains("--model") && err.contains("cannot open the model directory"), "{err}");
}

/// A resumed run continues in the run directory it resumed unless --out says otherwise, says
/// where it writes, and a finished run resumed says there is nothing left to train and stops.
#[test]
fn a_resumed_run_continues_in_its_own_directory_and_a_finished_one_stops() {
    let p = ParallelDir::new("resume-dir", 0.1);
    let cwd = p.dir.join("elsewhere");
    std::fs::create_dir_all(&cwd).unwrap();
    let run = p.dir.join("run");
    let flags =
        ["--device=cpu", "--seq-len=16", "--batch-size=2", "--eval-every=0", "--save-every=2", "--data", s(&p.data), "--config", s(&p.cfg)];
    let tool = |extra: &[&str]| {
        let argv: Vec<&str> = ["pretrain_llama"].iter().chain(&flags).chain(extra).copied().collect();
        let o = tools::run_in(&cwd, &[], &argv);
        let (out, err) = tools::text(&o);
        assert!(o.status.success(), "{argv:?} failed:\n{out}\n{err}");
        (out, err)
    };
    tool(&["--steps=2", "--out", s(&run)]);
    // Resumed without --out: the same run goes on, nothing lands in the working directory.
    let (_, err) = tool(&["--steps=4", "--resume", s(&run)]);
    assert!(run.join("checkpoints/step-000004").is_dir(), "the resumed run did not continue in {}", run.display());
    assert_eq!(latest(&run), "step-000004");
    assert!(!cwd.join("runs").exists(), "the resumed run wrote into the working directory: {:?}", snapshot(&cwd).len());
    assert!(err.contains(&format!("continuing the run in {}", run.display())), "{err}");
    // --out elsewhere: it goes there, and says so.
    let other = p.dir.join("other");
    let (_, err) = tool(&["--steps=6", "--resume", s(&run.join("checkpoints/latest")), "--out", s(&other)]);
    assert!(other.join("checkpoints/step-000006").is_dir());
    assert!(err.contains(&format!("this run writes to --out {} instead", other.display())), "{err}");
    // Resuming a finished run trains, validates and samples nothing, and says why.
    let before = snapshot(&run);
    let (out, _) = tool(&["--steps=4", "--resume", s(&run)]);
    assert!(out.contains("nothing left to train") && out.contains("--steps is 4"), "{out}");
    assert!(!out.contains("validation loss") && !out.contains("--- sample ---"), "{out}");
    assert!(snapshot(&run) == before, "resuming a finished run changed its files");
}

/// `generate` refuses, up front and as a flag error, more new tokens than the model has
/// positions, naming `max_position_embeddings` (the test model has 64).
#[test]
fn generate_refuses_more_tokens_than_the_context_holds() {
    let p = ParallelDir::new("gen-context", 0.1);
    let run = trained_run(&p);
    let argv = |n: &str| ["generate", "--device=cpu", "--model", s(&run), "--prompt", "Shall I", "--max-new-tokens", n].map(String::from);
    let g: ferrolm::cli::generate::GenerateArgs = parse_from(argv("1000")).unwrap();
    let err = error_report(&ferrolm::cli::generate::run(g).unwrap_err());
    assert!(err.contains("--max-new-tokens 1000") && err.contains("max_position_embeddings (64)"), "{err}");
    assert_eq!(run_tool(argv("1000"), ferrolm::cli::generate::run), 2, "a flag error exits with 2");
    // What fits runs: the prompt's tokens and the new ones, the last never fed back.
    let prompt = ferrolm::data::Tokenizer::from_file(tokenizer_path()).unwrap().encode("Shall I", false).unwrap().len();
    assert_eq!(run_tool(argv(&(65 - prompt).to_string()), ferrolm::cli::generate::run), 0);
    assert_eq!(run_tool(argv(&(66 - prompt).to_string()), ferrolm::cli::generate::run), 2);
}

/// `--config` with a path that is not a file says "no such file", not "unknown preset".
#[test]
fn config_paths_that_do_not_exist_say_so() {
    let dir = tmp("config-path");
    for bad in ["tiny.json", "my/config.json"] {
        let a: ferrolm::cli::pretrain::PretrainArgs =
            parse_from(["pretrain_llama", "--device=cpu", "--config", bad, "--out", s(&dir.join("out"))]).unwrap();
        let err = error_report(&ferrolm::cli::pretrain::run(a).unwrap_err());
        assert!(err.contains(&format!("--config {bad}: no such file")) && !err.contains("preset"), "{err}");
    }
    let a: ferrolm::cli::pretrain::PretrainArgs =
        parse_from(["pretrain_llama", "--device=cpu", "--config", "tinny", "--out", s(&dir.join("out"))]).unwrap();
    let err = error_report(&ferrolm::cli::pretrain::run(a).unwrap_err());
    assert!(err.contains("unknown preset") && err.contains("tiny"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every run prints its `parallel:` line, and sharding flags over one data-parallel rank warn
/// that they shard nothing.
#[test]
fn every_run_prints_its_layout_and_sharding_one_rank_warns() {
    let p = ParallelDir::new("parallel-line", 0.1);
    let base = ["pretrain_llama", "--device=cpu", "--seq-len=16", "--batch-size=2", "--steps=1", "--eval-every=0", "--save-every=0"];
    let cases = [(vec![], false), (vec!["--zero", "3"], true), (vec!["--shard-optim=1"], true), (vec!["--tp=2", "--zero=1"], true)];
    for (i, (extra, warns)) in cases.into_iter().enumerate() {
        let out = p.dir.join(format!("out{i}"));
        let paths = [flag("data", &p.data), flag("config", &p.cfg), flag("out", &out)];
        let argv = args(&base, &paths, &extra);
        let o = tools::run_in(&p.dir, &[], &argv.iter().map(String::as_str).collect::<Vec<_>>());
        let (stdout, stderr) = tools::text(&o);
        assert!(o.status.success(), "{argv:?}:\n{stdout}\n{stderr}");
        let tp = if extra.contains(&"--tp=2") { 2 } else { 1 };
        assert!(stdout.contains(&format!("parallel: tp {tp} x dp 1 ranks, sharding (params 1, grads 1, optim 1)")), "{extra:?}:\n{stdout}");
        assert_eq!(stderr.contains("shards nothing"), warns, "{extra:?}:\n{stderr}");
    }
}

/// A layout the model or the world cannot take is refused before any rank starts, naming the
/// flag, with exit code 2.
#[test]
fn layout_errors_are_flag_errors_found_before_any_rank_starts() {
    let p = ParallelDir::new("layout-errors", 0.1);
    let run = |extra: &[&str]| {
        let paths = [flag("data", &p.data), flag("config", &p.cfg), flag("out", &p.dir.join("out"))];
        args(&["pretrain_llama", "--device=cpu", "--seq-len=16", "--batch-size=2", "--steps=1"], &paths, extra)
    };
    // (flags, what the error names): 4 heads and 2 kv heads; 2 x 2 ranks.
    for (extra, names) in [
        (vec!["--tp=3"], vec!["--tp 3", "num_attention_heads (4)"]),
        (vec!["--tp=8"], vec!["--tp 8", "num_attention_heads (4)"]),
        (vec!["--dp=4", "--shard-params=3"], vec!["--shard-params 3"]),
        (vec!["--tp=2", "--dp=2", "--ranks-per-node=3"], vec!["--ranks-per-node 3", "--tp 2"]),
    ] {
        let a: ferrolm::cli::pretrain::PretrainArgs = parse_from(run(&extra)).unwrap();
        let err = error_report(&ferrolm::cli::pretrain::run(a).unwrap_err());
        for n in names {
            assert!(err.contains(n), "{extra:?}: {err}");
        }
        assert!(!err.contains("rank 0") && !err.contains("failed"), "{extra:?}: found inside a rank: {err}");
        assert_eq!(run_tool(run(&extra), ferrolm::cli::pretrain::run), 2, "{extra:?}");
    }
    // eval and generate check --tp against the model the same way.
    let ck = trained_run(&p);
    let g = ["generate", "--device=cpu", "--model", s(&ck), "--prompt", "Hi", "--tp=3"];
    assert_eq!(run_tool(g, ferrolm::cli::generate::run), 2);
}

/// Under a launcher (WORLD_SIZE > 1) without a GPU and without `--device cpu`, the error says
/// that CPU ranks are threads of one process, not only that cuda:0 is missing.
#[test]
fn a_launcher_without_a_gpu_says_how_a_cpu_runs() {
    if ferrolm_cuda::device_count() > 0 {
        ferrolm_testing::gate::does_not_apply("a GPU is visible, so a launcher's rank finds one");
        return;
    }
    let p = ParallelDir::new("launcher-cpu", 0.1);
    let env = [("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1")];
    let o = tools::run_in(&p.dir, &env, &["pretrain_llama", "--tp", "2", "--config", s(&p.cfg), "--data", s(&p.data)]);
    let (_, err) = tools::text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("cuda:0 is not available") && err.contains("--device cpu") && err.contains("threads"), "{err}");
}

/// `plan` takes the presets autoconfig takes, and its columns line up with 3- and 4-digit
/// layouts.
#[test]
fn plan_takes_autoconfigs_presets_and_aligns_its_columns() {
    let dir = tmp("plan-presets");
    for m in ["tiny", "small"] {
        assert_eq!(run_tool(["plan", "--model", m, "--gpus", "8"], ferrolm::cli::plan::run), 0, "plan --model {m}");
    }
    let o = tools::run_in(&dir, &[], &["plan", "--model", "7b", "--gpus", "1024", "--gpus-per-node", "8", "--top", "1000"]);
    let (out, err) = tools::text(&o);
    assert!(o.status.success(), "{err}");
    let lines: Vec<&str> = out.lines().collect();
    let h = lines.iter().position(|l| l.starts_with("spec ")).unwrap_or_else(|| panic!("no header:\n{out}"));
    let fits_end = lines[h].find("fits").unwrap() + 4;
    let rows: Vec<&str> = lines[h + 1..].iter().take_while(|l| l.starts_with('(')).copied().collect();
    assert!(rows.iter().any(|r| r.contains("optim 1024")), "no 4-digit layout among the rows:\n{out}");
    for r in &rows {
        let cell = r[..fits_end].trim_end();
        assert!(cell.ends_with(" yes") || cell.ends_with(" no"), "the fits column is not under its header:\n{}\n{r}", lines[h]);
        assert_eq!(r.len(), lines[h].len(), "row and header differ in width:\n{}\n{r}", lines[h]);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Tokenized --data goes to --cache-dir (both flag forms), not to ./runs/cache.
#[test]
fn the_tokenizer_cache_goes_where_cache_dir_says() {
    let p = ParallelDir::new("cache-dir", 0.1);
    let text = p.dir.join("text.txt");
    std::fs::copy(data_path("corpus/sonnets.txt"), &text).unwrap();
    for (i, form) in [vec!["--cache-dir", "mycache"], vec!["--cache-dir=mycache"]].into_iter().enumerate() {
        let out = format!("out{i}");
        let base = ["pretrain_llama", "--device=cpu", "--seq-len=16", "--batch-size=2", "--steps=1", "--eval-every=0", "--out", &out];
        let argv: Vec<&str> = base.iter().copied().chain(["--data", s(&text), "--config", s(&p.cfg)]).chain(form.iter().copied()).collect();
        let o = tools::run_in(&p.dir, &[], &argv);
        let (stdout, stderr) = tools::text(&o);
        assert!(o.status.success(), "{argv:?}:\n{stdout}\n{stderr}");
        let cached: Vec<_> = std::fs::read_dir(p.dir.join("mycache")).unwrap().collect();
        assert_eq!(cached.len(), 1, "one tokenized copy of the text, reused by the second run");
        assert!(!p.dir.join("runs").exists(), "{argv:?} wrote ./runs");
    }
}

/// The inference tools' `--dtype` help says nothing of optimizer state; finetune_ladder's
/// `--tokenizer` defaults to the model's.
#[test]
fn help_texts_say_what_each_tool_does_with_its_flags() {
    use ferrolm::cli::Tool;
    let flag_help = |mut cmd: clap::Command, name: &str| {
        let help = cmd.render_long_help().to_string();
        let at = help.find(&format!("--{name} ")).unwrap_or_else(|| panic!("no --{name}:\n{help}"));
        help[at..].split("\n  -").next().unwrap().to_string()
    };
    for cmd in [ferrolm::cli::eval::EvalArgs::cli(), ferrolm::cli::generate::GenerateArgs::cli()] {
        let h = flag_help(cmd, "dtype");
        assert!(!h.contains("optimizer") && h.contains("bf16"), "{h}");
    }
    let h = flag_help(ferrolm::cli::finetune_ladder::FinetuneLadderArgs::cli(), "tokenizer");
    assert!(h.contains("the model's tokenizer.json") && !h.contains("data/tokenizer.json"), "{h}");
}

/// `export` writes only the Hugging Face files of a checkpoint (the run's newest here), which
/// load as the same model, and refuses to write into a directory that holds files.
#[test]
fn export_writes_the_hugging_face_files_only() {
    let p = ParallelDir::new("export", 0.1);
    let run = trained_run(&p);
    let hf = p.dir.join("hf");
    for form in [vec!["--model".to_string(), s(&run).to_string()], vec![flag("model", &run)]] {
        let _ = std::fs::remove_dir_all(&hf);
        let argv: Vec<String> = ["export".to_string()].into_iter().chain(form).chain([flag("out", &hf)]).collect();
        assert_eq!(run_tool(argv, ferrolm::cli::export::run), 0);
        let files: Vec<String> = std::fs::read_dir(&hf).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        for f in ["config.json", "model.safetensors", "tokenizer.json"] {
            assert!(files.iter().any(|x| x == f), "{f} not exported: {files:?}");
        }
        for f in ferrolm::checkpoint::TRAINING_STATE {
            assert!(!files.iter().any(|x| x == f), "training state {f} exported: {files:?}");
        }
    }
    let a = ferrolm::Llama::from_pretrained(&hf, ferrolm::DType::F32, ferrolm::Device::Cpu).unwrap();
    let b = ferrolm::Llama::from_pretrained(&run.join("checkpoints/step-000002"), ferrolm::DType::F32, ferrolm::Device::Cpu).unwrap();
    for ((n, x), (_, y)) in a.parameters().iter().zip(b.parameters()) {
        assert_eq!(x.to_vec::<f32>().unwrap(), y.to_vec::<f32>().unwrap(), "{n}");
    }
    let again = ["export", "--model", s(&run), "--out", s(&hf)];
    let err = error_report(&ferrolm::cli::export::run(parse_from(again).unwrap()).unwrap_err());
    assert!(err.contains("not empty"), "{err}");
}
