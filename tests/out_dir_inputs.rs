//! A run never loses work, also when `--out` is where its inputs live (issue 50): every tool
//! refuses, before it writes or deletes anything, an `--out` that is or holds its `--model`,
//! `--lora-init` adapter, `--resume` checkpoint of another run, or data, with a flag error (exit
//! code 2) naming both paths; `--overwrite` deletes only once every input is loaded. Each case
//! runs the tool's entry point and checks that nothing on disk changed.
mod common;
#[path = "common/tools.rs"]
mod tools;
use common::*;
use ferrolm::cli::{error_report, exit_code, parse_from};
use ferrolm::train::{RunSafety, TrainOptions};
use std::path::{Path, PathBuf};

#[test]
fn tool_process() {
    tools::child_entry();
}

/// `dir/run`: a finished two-step run whose checkpoint step-000002 is a complete model directory
/// (config.json, model.safetensors, tokenizer.json), and its data in `dir/shards`.
fn finished_run(dir: &Path) -> (PathBuf, PathBuf) {
    trainer(dir, "run", TrainOptions { save_every: 1, ..opts(2) }).run().unwrap();
    (dir.join("run"), dir.join("shards"))
}

/// Runs `argv` through the tool's entry point; it must be refused as a flag error (exit code 2).
/// Returns the error as the user sees it.
fn refused(argv: &[String]) -> String {
    let e = match argv[0].as_str() {
        "finetune" => ferrolm::cli::finetune::run(parse_from(argv).unwrap()),
        "finetune_ladder" => ferrolm::cli::finetune_ladder::run(parse_from(argv).unwrap()),
        "pretrain_llama" => ferrolm::cli::pretrain::run(parse_from(argv).unwrap()),
        "export" => ferrolm::cli::export::run(parse_from(argv).unwrap()),
        "prepare_data" => ferrolm::cli::prepare::prepare_data(parse_from(argv).unwrap()),
        "train_tokenizer" => ferrolm::cli::prepare::train_tokenizer(parse_from(argv).unwrap()),
        other => panic!("no tool {other}"),
    }
    .expect_err("the tool must refuse this --out");
    let text = error_report(&e);
    assert_eq!(exit_code(&e), 2, "a flag error: {text}");
    text
}

fn finetune_argv(model: &Path, data: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let head = ["finetune", "--device=cpu", "--seq-len=16", "--batch-size=2", "--steps=2"];
    args(&head, &[flag("model", model), flag("data", data), flag("out", out)], extra)
}

/// The error names `--out`'s path and the input's flag and path.
fn names_both(err: &str, out: &Path, input_flag: &str, input: &Path) {
    assert!(err.contains(&format!("--out {}", out.display())), "names --out: {err}");
    assert!(err.contains(&format!("{input_flag} {}", input.display())), "names {input_flag}: {err}");
    assert!(err.contains("nothing was written or deleted"), "{err}");
}

/// The README's promise, end to end through the process entry: `finetune --model RUN --out RUN
/// --overwrite` used to delete RUN's checkpoints (the model it had just loaded) and then fail at
/// the first save; it is refused, exit code 2, and RUN is byte for byte as it was.
#[test]
fn finetune_model_run_into_the_same_run_with_overwrite_is_refused_and_the_run_is_intact() {
    let dir = tmp("out-is-model");
    let (run, data) = finished_run(&dir);
    let before = snapshot(&run);
    let argv = finetune_argv(&run, &data, &run, &["--overwrite"]);
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let o = tools::run_in(&dir, &[], &argv);
    let (_, stderr) = tools::text(&o);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    names_both(&stderr, &run, "--model", &run);
    assert_eq!(snapshot(&run), before, "the run changed");
    // The same with the model named by its checkpoint, and by checkpoints/latest.
    for model in [run.join("checkpoints/step-000002"), run.join("checkpoints/latest")] {
        let err = refused(&finetune_argv(&model, &data, &run, &["--overwrite"]));
        names_both(&err, &run, "--model", &model);
        assert_eq!(snapshot(&run), before);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_out_that_holds_the_model_is_refused_by_every_tool_that_loads_one() {
    let dir = tmp("out-holds-model");
    let (run, data) = finished_run(&dir);
    let before = snapshot(&dir.join("run"));
    // --out a parent of the model: the directory a LoRA base or a downloaded model sits in.
    let err = refused(&finetune_argv(&run, &data, &dir, &["--overwrite"]));
    names_both(&err, &dir, "--model", &run);
    assert!(err.contains(" holds --model"), "{err}");
    let ladder = args(
        &["finetune_ladder", "--device=cpu", "--seq-len=16", "--ladder-layers=1"],
        &[flag("model", &run), flag("data", &data), flag("out", &run)],
        &[],
    );
    names_both(&refused(&ladder), &run, "--model", &run);
    // export's --out may not be the model either (nor hold it).
    for out in [run.join("checkpoints/step-000002"), dir.clone()] {
        let err = refused(&args(&["export"], &[flag("model", &run), flag("out", &out)], &[]));
        names_both(&err, &out, "--model", &run);
    }
    // A path spelled with `..` through a directory that does not exist, and through a symlink.
    let dotted = dir.join("nothing/..");
    let err = refused(&finetune_argv(&run, &data, &dotted, &[]));
    assert!(err.contains("--model"), "{err}");
    let link = tmp("out-holds-model-link").join("link");
    std::os::unix::fs::symlink(&dir, &link).unwrap();
    let err = refused(&finetune_argv(&run, &data, &link, &[]));
    names_both(&err, &link, "--model", &run);
    assert_eq!(snapshot(&dir.join("run")), before);
    let _ = std::fs::remove_dir_all(link.parent().unwrap());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_out_that_holds_the_lora_init_adapter_or_the_data_is_refused() {
    let dir = tmp("out-holds-inputs");
    let (run, data) = finished_run(&dir);
    let model = run.join("checkpoints/step-000002");
    let out = dir.join("out");
    // An adapter being continued, inside --out (the check comes before the adapter is read).
    let adapter = out.join("adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    std::fs::write(adapter.join("adapter_config.json"), "{}").unwrap();
    let chat = out.join("chat.jsonl");
    std::fs::copy(data_path("chat.jsonl"), &chat).unwrap();
    let template = out.join("template.jinja");
    std::fs::copy(data_path("chat_template.jinja"), &template).unwrap();
    let tokenizer = out.join("tokenizer.json");
    std::fs::copy(tokenizer_path(), &tokenizer).unwrap();
    let text = dir.join("text.txt");
    std::fs::write(&text, "some text to read\n").unwrap();
    let before = snapshot(&dir);

    let err = refused(&finetune_argv(&model, &data, &out, &["--lora-init", adapter.to_str().unwrap()]));
    names_both(&err, &out, "--lora-init", &adapter);
    // --data and --val-data inside --out.
    let err = refused(&finetune_argv(&model, &chat, &out, &[]));
    names_both(&err, &out, "--data", &chat);
    let err = refused(&finetune_argv(&model, &data_path("chat.jsonl"), &out, &[&flag("val-data", &chat)]));
    names_both(&err, &out, "--val-data", &chat);
    // A glob whose fixed part lies outside --out but which matches a file inside it.
    let glob_in = dir.join("*").join("chat.jsonl");
    let err = refused(&finetune_argv(&model, &glob_in, &out, &["--overwrite"]));
    names_both(&err, &out, "--data", &glob_in);
    // --chat-template and --tokenizer inside --out.
    let err = refused(&finetune_argv(&model, &data_path("chat.jsonl"), &out, &[&flag("chat-template", &template)]));
    names_both(&err, &out, "--chat-template", &template);
    let err = refused(&finetune_argv(&model, &data_path("chat.jsonl"), &out, &[&flag("tokenizer", &tokenizer)]));
    names_both(&err, &out, "--tokenizer", &tokenizer);
    // pretrain_llama's --data, given as a prepared directory and as a glob.
    let pre = |data: &Path, out: &Path, extra: &[&str]| {
        args(&["pretrain_llama", "--device=cpu", "--seq-len=16", "--steps=2"], &[flag("data", data), flag("out", out)], extra)
    };
    names_both(&refused(&pre(&data, &data, &[])), &data, "--data", &data);
    let glob = data.join("*.bin");
    names_both(&refused(&pre(&glob, &dir, &["--overwrite"])), &dir, "--data", &glob);
    // prepare_data's --input, train_tokenizer's --corpus (which it would have written over).
    let err = refused(&args(&["prepare_data"], &[flag("input", &text), flag("tokenizer", &tokenizer_path()), flag("out", &dir)], &[]));
    names_both(&err, &dir, "--input", &text);
    let err = refused(&args(&["train_tokenizer"], &[flag("corpus", &text), flag("out", &text)], &[]));
    names_both(&err, &text, "--corpus", &text);
    assert_eq!(snapshot(&dir), before, "a refused run changed a file");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--out` naming a file (or a path under one), such as the data file itself: a flag error
/// that says so, where it used to be "cannot list checkpoints in FILE/checkpoints".
#[test]
fn an_out_that_is_a_file_is_refused_as_not_a_directory() {
    let dir = tmp("out-is-file");
    let (run, data) = finished_run(&dir);
    let model = run.join("checkpoints/step-000002");
    let file = dir.join("notes.txt");
    std::fs::write(&file, "keep me").unwrap();
    for out in [file.clone(), file.join("run")] {
        for extra in [&[][..], &["--overwrite"][..]] {
            let e = refused(&finetune_argv(&model, &data, &out, extra));
            assert!(e.contains(&format!("--out {} is not a directory", out.display())), "{e}");
            assert!(e.contains("nothing was written or deleted") && !e.contains("cannot list"), "{e}");
        }
    }
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resume_from_another_run_inside_out_is_refused_and_in_place_resume_is_not() {
    let dir = tmp("out-holds-resume");
    shards(&dir);
    let data = dir.join("shards");
    let cfg = dir.join("config.json");
    std::fs::write(&cfg, config(ferrolm::data::Tokenizer::from_file(tokenizer_path()).unwrap().vocab_size(), 2).to_json_string()).unwrap();
    let runs = dir.join("runs");
    let run = runs.join("run");
    let head = ["pretrain_llama", "--device=cpu", "--seq-len=16", "--batch-size=2", "--eval-every=0", "--save-every=1"];
    let first = args(&head, &[flag("data", &data), flag("config", &cfg), flag("out", &run)], &["--steps=2"]);
    ferrolm::cli::pretrain::run(parse_from(first).unwrap()).unwrap();
    let before = snapshot(&dir);
    let pre = |out: &Path, extra: &[&str]| {
        let paths = [flag("data", &data), flag("config", &cfg), flag("out", out), flag("resume", &run)];
        args(&head, &paths, &[&["--steps=3"], extra].concat())
    };
    // --resume runs/run with --out runs: another run's checkpoint inside --out.
    let err = refused(&pre(&runs, &["--overwrite"]));
    names_both(&err, &runs, "--resume", &run.join("checkpoints/step-000002"));
    assert_eq!(snapshot(&dir), before);
    // In place (--resume RUN --out RUN) is the normal case and runs; with --overwrite the
    // resumed checkpoint and the ones before it are kept.
    let step1 = snapshot(&run.join("checkpoints/step-000001"));
    let step2 = snapshot(&run.join("checkpoints/step-000002"));
    let a: ferrolm::cli::pretrain::PretrainArgs = parse_from(pre(&run, &["--overwrite"])).unwrap();
    ferrolm::cli::pretrain::run(a).unwrap();
    assert_eq!(checkpoint_names(&run), ["step-000001", "step-000002", "step-000003"]);
    assert_eq!(snapshot(&run.join("checkpoints/step-000001")), step1);
    assert_eq!(snapshot(&run.join("checkpoints/step-000002")), step2, "the resumed checkpoint changed");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The trainer itself never reads an input after `--overwrite` cleared the directory: the
/// tokenizer its checkpoints carry is read before (it used to be read at each save, from a file
/// the clearing could have removed).
#[test]
fn overwrite_clears_only_after_the_tokenizer_is_read() {
    let dir = tmp("overwrite-tokenizer");
    let (run, _) = finished_run(&dir);
    let tok = run.join("checkpoints/step-000002/tokenizer.json");
    let (train, val, vocab) = shards(&dir);
    let mut t = ferrolm::train::Trainer::new(model(vocab), &train, &val, opts(1), &run)
        .unwrap()
        .with_tokenizer(&tok)
        .with_safety(RunSafety { overwrite: true, ..RunSafety::default() });
    let (res, logs) = capture_logs(|| t.run());
    res.unwrap();
    assert!(logs.contains("--overwrite: removed"), "{logs}");
    assert!(!tok.exists(), "the old checkpoint was removed");
    let saved = run.join("checkpoints/step-000001/tokenizer.json");
    let want = ferrolm::data::Tokenizer::from_file(tokenizer_path()).unwrap().vocab_size();
    assert_eq!(ferrolm::data::Tokenizer::from_file(&saved).unwrap().vocab_size(), want);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--resume` from another run with `--overwrite` replaces the run in `--out` whole, as its help
/// says: none of the old run's checkpoints is left beside the resumed run's.
#[test]
fn overwrite_with_resume_from_another_run_replaces_the_whole_run() {
    let dir = tmp("overwrite-other");
    let (run, _) = finished_run(&dir);
    let mut old = trainer(&dir, "old", TrainOptions { save_every: 1, ..opts(2) });
    old.run().unwrap();
    let mut t = trainer(&dir, "old", opts(3)).with_safety(RunSafety { overwrite: true, ..RunSafety::default() });
    t.resume(&run.join("checkpoints/step-000001")).unwrap();
    t.run().unwrap();
    assert_eq!(checkpoint_names(&dir.join("old")), ["step-000003"]);
    assert_eq!(checkpoint_names(&run), ["step-000001", "step-000002"], "the resumed run is untouched");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--seq-len` longer than the model's positions is a flag error before any data is read: the
/// text given as --data is never tokenized into --cache-dir.
#[test]
fn seq_len_over_the_model_positions_is_refused_before_the_data() {
    let dir = tmp("seq-len-first");
    let (run, _) = finished_run(&dir);
    let text = data_path("corpus/sonnets.txt");
    let cache = dir.join("cache");
    let common = [flag("data", &text), flag("cache-dir", &cache)];
    let cases = [
        args(
            &["pretrain_llama", "--device=cpu", "--seq-len=4096", "--batch-size=1"],
            &[&common[..], &[flag("out", &dir.join("a"))]].concat(),
            &[],
        ),
        args(
            &["finetune", "--device=cpu", "--seq-len=65", "--batch-size=1"],
            &[&common[..], &[flag("model", &run), flag("out", &dir.join("b"))]].concat(),
            &[],
        ),
        args(
            &["finetune_ladder", "--device=cpu", "--seq-len=65", "--batch-size=1", "--ladder-layers=1"],
            &[&common[..], &[flag("model", &run), flag("out", &dir.join("c"))]].concat(),
            &[],
        ),
    ];
    for argv in cases {
        let err = refused(&argv);
        assert!(err.contains("--seq-len") && err.contains("max_position_embeddings"), "{err}");
        assert!(!cache.exists(), "{}: the data was tokenized before the refusal", argv[0]);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
