//! The tools' flags behave like the ecosystem's (clap): `--help` says what the tool does, lists
//! every flag with its default and the environment it reads; `--flag=value` works; typos get a
//! suggestion; unknown and repeated flags are refused with exit code 2; non-finite or negative
//! values are refused naming the flag; runtime errors exit 1 with their causes. The tools are
//! library functions (`ferrolm::cli::*`) that `examples/*.rs` wrap, so these run in-process.
mod common;
use clap::error::ErrorKind;
use common::*;
use ferrolm::cli::autoconfig::AutoconfigArgs;
use ferrolm::cli::eval::EvalArgs;
use ferrolm::cli::export::ExportArgs;
use ferrolm::cli::finetune::FinetuneArgs;
use ferrolm::cli::finetune_ladder::FinetuneLadderArgs;
use ferrolm::cli::generate::GenerateArgs;
use ferrolm::cli::launch::LaunchArgs;
use ferrolm::cli::plan::PlanArgs;
use ferrolm::cli::prepare::{PrepareDataArgs, TrainTokenizerArgs};
use ferrolm::cli::pretrain::PretrainArgs;
use ferrolm::cli::{error_report, parse_from, run_tool, BenchCudaArgs, Tool};

/// (program, its command as parsed, words its --help must contain).
fn tools() -> Vec<(&'static str, clap::Command, Vec<&'static str>)> {
    let dev = vec!["FERROLM_CUDA_EMULATOR", "RUST_LOG"];
    vec![
        (
            "pretrain_llama",
            PretrainArgs::cli(),
            [
                dev.clone(),
                vec![
                    "Pretrain a LLaMA",
                    "FERROLM_PEAK_TFLOPS",
                    "--tp",
                    "--zero",
                    "--ladder-layers",
                    "--dtype",
                    "FERROLM_EMU_RACE",
                    "FERROLM_EMU_REPORT",
                    "FERROLM_FORCE_NCCL",
                    "FERROLM_COMM_CHECK",
                ],
            ]
            .concat(),
        ),
        (
            "finetune_ladder",
            FinetuneLadderArgs::cli(),
            [dev.clone(), vec!["Ladder Transformer", "--ladder-layers", "--tp", "--train-on"]].concat(),
        ),
        (
            "finetune",
            FinetuneArgs::cli(),
            [dev.clone(), vec!["conversations", "--chat-template", "--no-pack", "--val-fraction", "--tp", "--offload-optimizer"]].concat(),
        ),
        ("eval", EvalArgs::cli(), [dev.clone(), vec!["perplexity"]].concat()),
        ("generate", GenerateArgs::cli(), [dev, vec!["Sample"]].concat()),
        ("prepare_data", PrepareDataArgs::cli(), vec!["Tokenize text", "RUST_LOG"]),
        ("train_tokenizer", TrainTokenizerArgs::cli(), vec!["byte-level BPE", "RUST_LOG"]),
        ("bench_cuda", BenchCudaArgs::cli(), vec!["Benchmark every CUDA kernel", "FERROLM_REQUIRE_GPU", "OUT"]),
        // The two tools that model a cluster take the same cluster flags and --grad-reduce-dtype.
        ("plan", PlanArgs::cli(), vec!["Rank every valid", "--inter-gb-s", "--interference", "--grad-reduce-dtype", "RUST_LOG"]),
        (
            "autoconfig",
            AutoconfigArgs::cli(),
            vec!["Pick a model size", "--inter-gb-s", "--interference", "--grad-reduce-dtype", "RUST_LOG"],
        ),
        ("export", ExportArgs::cli(), vec!["Hugging Face model", "training state", "RUST_LOG"]),
        ("launch", LaunchArgs::cli(), vec!["one process per GPU", "torchrun", "MASTER_PORT", "RUST_LOG"]),
    ]
}

#[test]
fn help_says_what_each_tool_does_and_lists_every_flag_with_its_default_and_the_environment() {
    for (name, mut cmd, words) in tools() {
        let help = cmd.render_long_help().to_string();
        for w in words {
            assert!(help.contains(w), "{name} --help lacks {w:?}:\n{help}");
        }
        assert!(help.contains("Environment:"), "{name} --help has no Environment section");
        for arg in cmd.get_arguments().filter(|a| a.get_id() != "help" && a.get_id() != "version") {
            let flag = match arg.get_long() {
                Some(l) => format!("--{l}"),
                None => format!(
                    "<{}>",
                    arg.get_value_names().and_then(|v| v.first()).map_or(arg.get_id().as_str().to_uppercase(), |v| v.to_string())
                ),
            };
            assert!(help.contains(&flag), "{name} --help does not list {flag}");
            let defaults: Vec<String> = arg.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect();
            let takes_value = arg.get_action().takes_values();
            if let Some(d) = defaults.first().filter(|_| takes_value) {
                assert!(help.contains(&format!("[default: {d}]")), "{name} --help does not show {flag}'s default {d}");
            } else if takes_value && !arg.is_required_set() {
                // An optional flag without a fixed default says in words what happens without it.
                let doc = arg.get_long_help().or(arg.get_help()).map(|s| s.to_string()).unwrap_or_default();
                assert!(doc.contains("[default:"), "{name}: {flag} neither has a default nor says what it defaults to: {doc:?}");
            }
        }
    }
}

#[test]
fn help_exits_zero() {
    for (name, _, _) in tools() {
        let e = match name {
            "pretrain_llama" => parse_from::<PretrainArgs, _, _>([name, "--help"]).unwrap_err(),
            "eval" => parse_from::<EvalArgs, _, _>([name, "--help"]).unwrap_err(),
            "finetune_ladder" => parse_from::<FinetuneLadderArgs, _, _>([name, "--help"]).unwrap_err(),
            "finetune" => parse_from::<FinetuneArgs, _, _>([name, "--help"]).unwrap_err(),
            _ => continue,
        };
        assert_eq!(e.kind(), ErrorKind::DisplayHelp);
        assert_eq!(e.exit_code(), 0);
    }
}

#[test]
fn existing_flags_keep_their_names_and_defaults() {
    let a: PretrainArgs = parse_from(["pretrain_llama"]).unwrap();
    let t = &a.train;
    assert_eq!(a.config, "tiny");
    assert_eq!((t.steps, t.batch_size, t.seq_len, t.grad_accum, t.seed), (500, 16, 128, 1, 1337));
    assert_eq!((t.lr, t.eval_every, t.save_every), (2e-3, 100, 250));
    assert_eq!(t.out, std::path::PathBuf::from("runs/pretrain_llama"));
    assert!(t.data.is_none() && t.tokenizer.is_none() && t.resume.is_none() && t.device.device.is_none());
    assert!(!t.activation_checkpointing && !t.overwrite);
    assert_eq!((t.keep_last, t.max_skipped_steps), (0, 5));
    let o = t.options();
    assert_eq!((o.min_lr, o.warmup_steps, o.weight_decay, o.grad_clip, o.log_every), (2e-4, 25, 0.1, 1.0, 25));

    let e: EvalArgs = parse_from(["eval", "--model", "m", "--text", "t", "--seq-len", "64"]).unwrap();
    assert_eq!((e.seq_len, e.batch_size), (Some(64), 8));
    let g: GenerateArgs = parse_from(["generate", "--model", "m", "--prompt", "Hi"]).unwrap();
    assert_eq!((g.max_new_tokens, g.temperature, g.top_p, g.seed), (100, 0.8, 0.95, 0));
    let p: PrepareDataArgs = parse_from(["prepare_data", "--input", "i", "--tokenizer", "t", "--out", "o"]).unwrap();
    assert_eq!((p.val_fraction, p.shard_tokens), (0.05, 100_000_000));
    let k: TrainTokenizerArgs = parse_from(["train_tokenizer", "--corpus", "c", "--out", "o"]).unwrap();
    assert_eq!(k.vocab_size, 4096);
    let b: BenchCudaArgs = parse_from(["bench_cuda"]).unwrap();
    assert_eq!((b.reps, b.quick, b.attention.len(), b.attention_only), (20, false, 0, false));
}

/// `bench_cuda --attention B,HQ,HKV,T,D`, in both forms and repeated; a wrong shape is refused
/// by the flag's name, with what is wrong.
#[test]
fn bench_cuda_attention_shapes() {
    let b: BenchCudaArgs = parse_from(["bench_cuda", "--attention", "4,16,16,2048,128", "--attention=8,32,8,1024,64"]).unwrap();
    assert_eq!(b.attention, vec![(4, 16, 16, 2048, 128), (8, 32, 8, 1024, 64)]);
    for (bad, why) in
        [("4,16,16,2048", "five numbers"), ("4,16,0,2048,128", "at least 1"), ("1,3,2,64,64", "not a multiple"), ("a,b", "not a positive")]
    {
        let e = parse_from::<BenchCudaArgs, _, _>(["bench_cuda", "--attention", bad]).unwrap_err().to_string();
        assert!(e.contains("--attention") && e.contains(why), "{bad}: {e}");
    }
    // --attention-only: the eight default shapes, and no other kernels; not with --attention.
    assert!(parse_from::<BenchCudaArgs, _, _>(["bench_cuda", "--attention-only"]).unwrap().attention_only);
    let e = parse_from::<BenchCudaArgs, _, _>(["bench_cuda", "--attention-only", "--attention=4,16,16,2048,128"]).unwrap_err().to_string();
    assert!(e.contains("--attention-only") && e.contains("--attention"), "{e}");
}

#[test]
fn flag_equals_value_works() {
    let a: PretrainArgs =
        parse_from(["pretrain_llama", "--steps=7", "--lr=0.01", "--out=x/y", "--device=cpu", "--config=small", "--log-level=warn"])
            .unwrap();
    assert_eq!((a.train.steps, a.train.lr, a.config.as_str()), (7, 0.01, "small"));
    assert_eq!(a.train.out, std::path::PathBuf::from("x/y"));
    assert_eq!(a.train.device.device.as_deref(), Some("cpu"));
    assert_eq!(a.train.log.log_level.as_deref(), Some("warn"));
}

#[test]
fn dtype_takes_both_forms_defaults_by_device_and_refuses_others() {
    use ferrolm::cli::ComputeDtype;
    use ferrolm::{DType, Device};
    for (flag, want) in [(vec!["--dtype", "bf16"], DType::BF16), (vec!["--dtype=f32"], DType::F32), (vec![], DType::F32)] {
        let a: PretrainArgs = parse_from(["pretrain_llama"].into_iter().chain(flag.iter().copied())).unwrap();
        assert_eq!(a.train.device.dtype(Device::Cpu), want, "{flag:?} on the CPU");
    }
    // The default is bf16 (with fp32 masters) on CUDA, f32 on the CPU.
    assert_eq!(ComputeDtype::resolve(None, Device::Cuda(0)), DType::BF16);
    let e: EvalArgs = parse_from(["eval", "--model", "m", "--text", "t", "--seq-len=4", "--dtype=f32"]).unwrap();
    assert_eq!(e.run.device.dtype, Some(ComputeDtype::F32));
    let g: GenerateArgs = parse_from(["generate", "--model", "m", "--prompt", "Hi", "--dtype", "bf16"]).unwrap();
    assert_eq!(g.run.device.dtype, Some(ComputeDtype::Bf16));
    let f: FinetuneLadderArgs = parse_from(["finetune_ladder", "--model", "m", "--ladder-layers", "2", "--dtype", "f32"]).unwrap();
    assert_eq!(f.train.device.dtype, Some(ComputeDtype::F32));
    for bad in ["f64", "fp16", ""] {
        let e = parse_from::<PretrainArgs, _, _>(["pretrain_llama", "--dtype", bad]).unwrap_err();
        assert_eq!((e.kind(), e.exit_code()), (ErrorKind::InvalidValue, 2), "--dtype {bad:?}");
        assert!(e.to_string().contains("--dtype") && e.to_string().contains("bf16"), "{e}");
    }
}

#[test]
fn grad_reduce_dtype_takes_both_forms_defaults_to_f32_and_refuses_others() {
    for (flag, want) in [
        (vec!["--grad-reduce-dtype", "bf16"], "bf16"),
        (vec!["--grad-reduce-dtype=bf16"], "bf16"),
        (vec!["--grad-reduce-dtype=f32"], "f32"),
        (vec![], "f32"),
    ] {
        let a: PretrainArgs = parse_from(["pretrain_llama"].into_iter().chain(flag.iter().copied())).unwrap();
        assert_eq!(a.train.parallel.grad_reduce_dtype.to_string(), want, "{flag:?}");
        assert_eq!(a.train.parallel.layout().unwrap().grad_reduce.to_string(), want, "{flag:?} reaches the layout");
    }
    let f: FinetuneLadderArgs =
        parse_from(["finetune_ladder", "--model", "m", "--ladder-layers", "2", "--grad-reduce-dtype=bf16"]).unwrap();
    assert_eq!(f.train.parallel.grad_reduce_dtype.to_string(), "bf16");
    for bad in ["f16", "fp32", ""] {
        let e = parse_from::<PretrainArgs, _, _>(["pretrain_llama", "--grad-reduce-dtype", bad]).unwrap_err();
        assert_eq!((e.kind(), e.exit_code()), (ErrorKind::ValueValidation, 2), "--grad-reduce-dtype {bad:?}");
        assert!(e.to_string().contains("--grad-reduce-dtype") && e.to_string().contains("bf16"), "{e}");
    }
    let help = PretrainArgs::cli().render_long_help().to_string();
    let at = help.find("--grad-reduce-dtype").expect("--grad-reduce-dtype in --help");
    assert!(help[at..].split("\n  -").next().unwrap().contains("[default: f32]"), "{}", &help[at..]);
}

#[test]
fn typos_get_a_suggestion_and_unknown_flags_exit_2() {
    let e = parse_from::<PretrainArgs, _, _>(["pretrain_llama", "--step", "5"]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnknownArgument);
    assert_eq!(e.exit_code(), 2);
    let msg = e.to_string();
    assert!(msg.contains("--step") && msg.contains("similar argument exists: '--steps'"), "{msg}");
    let e = parse_from::<EvalArgs, _, _>(["eval", "--modle", "m", "--text", "t", "--seq-len", "4"]).unwrap_err();
    assert!(e.to_string().contains("'--model'"), "{e}");
    let e = parse_from::<PretrainArgs, _, _>(["pretrain_llama", "--frobnicate"]).unwrap_err();
    assert_eq!((e.kind(), e.exit_code()), (ErrorKind::UnknownArgument, 2));
    assert_eq!(run_tool::<PretrainArgs, _, _>(["pretrain_llama", "--frobnicate"], |_| panic!("must not run")), 2);
}

#[test]
fn repeated_flags_are_refused() {
    for args in [
        vec!["pretrain_llama", "--steps", "1", "--steps", "2"],
        vec!["pretrain_llama", "--overwrite", "--overwrite"],
        vec!["pretrain_llama", "--lr=1e-3", "--lr", "2e-3"],
    ] {
        let e = parse_from::<PretrainArgs, _, _>(args.clone()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ArgumentConflict, "{args:?}: {e}");
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("cannot be used multiple times"), "{e}");
    }
    assert_eq!(run_tool::<PretrainArgs, _, _>(["pretrain_llama", "--steps", "1", "--steps", "2"], |_| panic!("must not run")), 2);
}

#[test]
fn non_finite_negative_and_zero_values_are_refused_naming_the_flag() {
    for (bad, flag) in [("NaN", "--lr"), ("inf", "--lr"), ("-1e-3", "--lr")] {
        let e = parse_from::<PretrainArgs, _, _>(["pretrain_llama", "--lr", bad]).unwrap_err();
        assert_eq!((e.kind(), e.exit_code()), (ErrorKind::ValueValidation, 2), "{bad}");
        assert!(e.to_string().contains(flag), "{e}");
    }
    for (args, flag) in [
        (vec!["pretrain_llama", "--batch-size", "0"], "--batch-size"),
        (vec!["pretrain_llama", "--steps", "-3"], "--steps"),
        (vec!["pretrain_llama", "--max-skipped-steps", "0"], "--max-skipped-steps"),
        (vec!["pretrain_llama", "--batch-size", "99999999999999999999999"], "--batch-size"),
    ] {
        let e = parse_from::<PretrainArgs, _, _>(args.clone()).unwrap_err();
        assert_eq!(e.exit_code(), 2, "{args:?}");
        assert!(e.to_string().contains(flag), "{e}");
    }
    for (args, flag) in [
        (vec!["--temperature", "NaN"], "--temperature"),
        (vec!["--temperature", "-1"], "--temperature"),
        (vec!["--top-p", "0"], "--top-p"),
        (vec!["--top-p", "1.5"], "--top-p"),
    ] {
        let full = [vec!["generate", "--model", "m", "--prompt", "p"], args].concat();
        let e = parse_from::<GenerateArgs, _, _>(full).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains(flag), "{e}");
    }
    let e = parse_from::<PrepareDataArgs, _, _>(["prepare_data", "--input", "i", "--tokenizer", "t", "--out", "o", "--val-fraction", "1"])
        .unwrap_err();
    assert!(e.to_string().contains("--val-fraction"), "{e}");
    let e = parse_from::<EvalArgs, _, _>(["eval", "--model", "m", "--text", "t", "--seq-len", "0"]).unwrap_err();
    assert!(e.to_string().contains("--seq-len"), "{e}");
    let e = parse_from::<PretrainArgs, _, _>(["pretrain_llama", "--log-level", "verbose"]).unwrap_err();
    assert!(e.to_string().contains("--log-level") && e.to_string().contains("not a level"), "{e}");
    assert!(parse_from::<PretrainArgs, _, _>(["pretrain_llama", "--log-level", "ferrolm=debug,warn"]).is_ok());
    let e = parse_from::<BenchCudaArgs, _, _>(["bench_cuda", "--reps", "3"]).unwrap_err();
    assert!(e.to_string().contains("--reps"), "{e}");
}

#[test]
fn a_missing_data_directory_is_an_error_with_its_cause_and_exit_code_1() {
    let dir = tmp("cli-nodata");
    let missing = dir.join("foo");
    let out = dir.join("out");
    let a: PretrainArgs =
        parse_from(["pretrain_llama", "--device", "cpu", "--data", missing.to_str().unwrap(), "--out", out.to_str().unwrap()]).unwrap();
    let err = error_report(&ferrolm::cli::pretrain::run(a).unwrap_err());
    assert_eq!(err, format!("error: cannot open data directory {}: No such file or directory (os error 2)", missing.display()));
    let code = run_tool::<PretrainArgs, _, _>(
        ["pretrain_llama", "--data", missing.to_str().unwrap(), "--out", out.to_str().unwrap()],
        ferrolm::cli::pretrain::run,
    );
    assert_eq!(code, 1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn pretrain_refuses_a_used_out_dir_before_any_work() {
    let dir = tmp("cli-used-out");
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("metrics.jsonl"), "{\"step\":1,\"loss\":3.0}\n").unwrap();
    let before = snapshot(&out);
    // --data does not exist: the refusal must come first (before any tokenizing or training).
    let a: PretrainArgs = parse_from(["pretrain_llama", "--data", "/nonexistent", "--out", out.to_str().unwrap()]).unwrap();
    let err = error_report(&ferrolm::cli::pretrain::run(a).unwrap_err());
    assert!(err.contains("already holds a run: metrics.jsonl") && err.contains("--overwrite"), "{err}");
    assert_eq!(snapshot(&out), before);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A prepared data directory and a small config.json for end-to-end runs of the tools.
fn small_setup(dir: &std::path::Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let data = dir.join("data");
    let a: PrepareDataArgs = parse_from([
        "prepare_data",
        "--input",
        root().join("data/corpus/sonnets.txt").to_str().unwrap(),
        "--tokenizer",
        tokenizer_path().to_str().unwrap(),
        "--out",
        data.to_str().unwrap(),
        "--val-fraction=0.1",
    ])
    .unwrap();
    ferrolm::cli::prepare::prepare_data(a).unwrap();
    let cfg = dir.join("config.json");
    std::fs::write(&cfg, config(4096, 2).to_json_string()).unwrap();
    (data, cfg)
}

#[test]
fn pretrain_in_bf16_on_the_cpu_follows_f32() {
    let dir = tmp("cli-bf16");
    let (data, cfg) = small_setup(&dir);
    let losses = |dtype: &str| -> Vec<f64> {
        let out = dir.join(dtype);
        let a = pretrain_args(&data, &cfg, &out, &["--steps=4", "--batch-size=2", "--eval-every=0", "--save-every=0", "--dtype", dtype]);
        ferrolm::cli::pretrain::run(a).unwrap();
        common::losses(&out)
    };
    let (f32, bf16) = (losses("f32"), losses("bf16"));
    assert_eq!((f32.len(), bf16.len()), (4, 4), "{f32:?} {bf16:?}");
    // bf16 weights and activations (8 bits of mantissa) with fp32 masters: within 2% of f32.
    for (a, b) in f32.iter().zip(&bf16) {
        assert!(b.is_finite() && (a - b).abs() <= 0.02 * a, "bf16 {bf16:?} vs f32 {f32:?}");
    }
    assert_ne!(f32, bf16, "--dtype bf16 must change the arithmetic");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--loss-chunk-tokens` on every training tool, in both forms: absent is the fused head at its
/// automatic size, 0 the unfused head, N chunks of N tokens; a value that is not a count is
/// refused naming the flag. A run in chunks of 7 tokens (not dividing the 2 x 16) follows the
/// unfused run: the same first loss to the bit (f32 on the CPU), the next within rounding.
#[test]
fn loss_chunk_tokens_takes_both_forms_and_follows_the_unfused_head() {
    use ferrolm::ops::LossChunks;
    for (flag, want) in [
        (vec!["--loss-chunk-tokens", "64"], LossChunks::Tokens(64)),
        (vec!["--loss-chunk-tokens=0"], LossChunks::Unfused),
        (vec![], LossChunks::Auto),
    ] {
        let a: PretrainArgs = parse_from(["pretrain_llama"].into_iter().chain(flag.iter().copied())).unwrap();
        assert_eq!(a.train.loss_chunks(), want, "{flag:?}");
    }
    let f: FinetuneLadderArgs = parse_from(["finetune_ladder", "--model", "m", "--ladder-layers", "2", "--loss-chunk-tokens=128"]).unwrap();
    assert_eq!(f.train.loss_chunks(), LossChunks::Tokens(128));
    for bad in ["-1", "many", "1.5"] {
        let e = parse_from::<PretrainArgs, _, _>(["pretrain_llama", "--loss-chunk-tokens", bad]).unwrap_err();
        assert_eq!(e.exit_code(), 2, "--loss-chunk-tokens {bad}");
        assert!(e.to_string().contains("--loss-chunk-tokens"), "{e}");
    }
    let dir = tmp("cli-loss-chunks");
    let (data, cfg) = small_setup(&dir);
    let losses = |chunk: &str| -> Vec<f64> {
        let out = dir.join(chunk);
        let a = pretrain_args(
            &data,
            &cfg,
            &out,
            &["--steps=3", "--batch-size=2", "--eval-every=0", "--save-every=0", "--loss-chunk-tokens", chunk],
        );
        ferrolm::cli::pretrain::run(a).unwrap();
        common::losses(&out)
    };
    let (chunked, unfused) = (losses("7"), losses("0"));
    assert_eq!((chunked.len(), unfused.len()), (3, 3), "{chunked:?} {unfused:?}");
    assert_eq!(chunked[0], unfused[0], "the first step's loss");
    for (a, b) in chunked.iter().zip(&unfused) {
        assert!((a - b).abs() <= 1e-5 * b, "chunks of 7 {chunked:?} vs unfused {unfused:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn pretrain_end_to_end_then_eval_of_its_checkpoint() {
    let dir = tmp("cli-e2e");
    let (data, cfg) = small_setup(&dir);
    let out = dir.join("run");
    let args = |extra: &[&str]| -> PretrainArgs {
        let flags: Vec<&str> = ["--eval-every=2", "--save-every=1", "--keep-last=1"].into_iter().chain(extra.iter().copied()).collect();
        pretrain_args(&data, &cfg, &out, &flags)
    };
    ferrolm::cli::pretrain::run(args(&["--steps=3", "--batch-size=2"])).unwrap();
    assert_eq!(checkpoint_names(&out), ["step-000003"], "--keep-last 1");
    assert!(out.join("loss.png").is_file() && out.join("metrics.jsonl").is_file());

    // Resume to 5 steps: the history (and the curve) continues.
    ferrolm::cli::pretrain::run(args(&["--steps=5", "--batch-size=2", "--resume", out.to_str().unwrap(), "--max-skipped-steps=2"]))
        .unwrap();
    assert_eq!(checkpoint_names(&out), ["step-000005"]);
    let lines = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().filter(|l| l.contains("\"loss\"")).count(), 5, "{lines}");

    // A batch in the trillions is refused naming the flag, and the run is left as it was.
    let before = snapshot(&out);
    let e = error_report(
        &ferrolm::cli::pretrain::run(args(&["--steps=6", "--resume", out.to_str().unwrap(), "--batch-size=1000000000000"])).unwrap_err(),
    );
    assert!(e.contains("--batch-size 1000000000000"), "{e}");
    assert_eq!(snapshot(&out), before);

    // The checkpoint is self-contained: eval reads its tokenizer and weights.
    let ck = out.join("checkpoints/step-000005");
    let text = root().join("data/corpus/sonnets.txt");
    let e: EvalArgs = parse_from(common::args(
        &["eval", "--device=cpu", "--seq-len=32", "--batch-size=64"],
        &[flag("model", &ck), flag("text", &text)],
        &[],
    ))
    .unwrap();
    ferrolm::cli::eval::run(e).unwrap();
    let e: EvalArgs = parse_from(["eval", "--model", dir.join("nope").to_str().unwrap(), "--text", "t", "--seq-len=4"]).unwrap();
    let msg = error_report(&ferrolm::cli::eval::run(e).unwrap_err());
    assert!(msg.contains("cannot open the model directory") && msg.contains("(os error 2)"), "{msg}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn data_prepared_with_another_tokenizer_is_refused_at_open() {
    let dir = tmp("cli-other-tokenizer");
    let other = dir.join("other-tokenizer.json");
    let sonnets = root().join("data/corpus/sonnets.txt");
    let t: TrainTokenizerArgs =
        parse_from(["train_tokenizer", "--corpus", sonnets.to_str().unwrap(), "--vocab-size=300", "--out", other.to_str().unwrap()])
            .unwrap();
    ferrolm::cli::prepare::train_tokenizer(t).unwrap();
    let data = dir.join("data");
    let p: PrepareDataArgs = parse_from([
        "prepare_data",
        "--input",
        sonnets.to_str().unwrap(),
        "--tokenizer",
        other.to_str().unwrap(),
        "--out",
        data.to_str().unwrap(),
    ])
    .unwrap();
    ferrolm::cli::prepare::prepare_data(p).unwrap();
    let out = dir.join("run");
    // Trained with the bundled tokenizer: the ids in these shards mean other tokens.
    let a: PretrainArgs =
        parse_from(["pretrain_llama", "--device=cpu", "--data", data.to_str().unwrap(), "--out", out.to_str().unwrap(), "--steps=1"])
            .unwrap();
    let err = error_report(&ferrolm::cli::pretrain::run(a).unwrap_err());
    assert!(err.contains("does not fit the tokenizer") && err.contains("vocab_size"), "{err}");
    assert!(!out.join("checkpoints").exists(), "a run started on mismatched data");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--profile` on both training tools (off by default; a flag, so a value or a repeat is refused),
/// and `FERROLM_PROFILE` in their help.
#[test]
fn profile_flag_on_the_training_tools() {
    let a: PretrainArgs = parse_from(["pretrain_llama"]).unwrap();
    assert!(!a.train.profile);
    let a: PretrainArgs = parse_from(["pretrain_llama", "--profile"]).unwrap();
    assert!(a.train.profile);
    let f: FinetuneLadderArgs = parse_from(["finetune_ladder", "--model", "m", "--ladder-layers", "2", "--profile"]).unwrap();
    assert!(f.train.profile);
    assert!(parse_from::<PretrainArgs, _, _>(["pretrain_llama", "--profile", "--profile"]).is_err());
    assert!(parse_from::<PretrainArgs, _, _>(["pretrain_llama", "--profile=1"]).is_err());
    let help = parse_from::<PretrainArgs, _, _>(["pretrain_llama", "--help"]).unwrap_err().to_string();
    assert!(help.contains("--profile") && help.contains("FERROLM_PROFILE"), "{help}");
}

#[test]
fn lora_flags_take_both_forms() {
    use ferrolm::cli::lora::{LoraArgs, Targets};
    use ferrolm::nn::Proj;
    // The same flags on both fine-tuning tools.
    let parse = |extra: &[&str]| -> LoraArgs {
        let ladder =
            parse_from::<FinetuneLadderArgs, _, _>(["finetune_ladder", "--model", "m", "--ladder-layers", "2"].iter().chain(extra));
        let plain = parse_from::<FinetuneArgs, _, _>(["finetune", "--model", "m"].iter().chain(extra));
        let (ladder, plain) = (ladder.unwrap().lora, plain.unwrap().lora);
        assert_eq!(ladder, plain, "{extra:?}");
        plain
    };
    let want = [
        ("--lora-rank", "8", LoraArgs { lora_rank: Some(8), ..LoraArgs::default() }),
        ("--lora-alpha", "16", LoraArgs { lora_alpha: Some(16.0), ..LoraArgs::default() }),
        ("--lora-dropout", "0.05", LoraArgs { lora_dropout: Some(0.05), ..LoraArgs::default() }),
        ("--lora-targets", "q,v", LoraArgs { lora_targets: Some(Targets(vec![Proj::Q, Proj::V])), ..LoraArgs::default() }),
        ("--lora-targets", "all-linear", LoraArgs { lora_targets: Some(Targets(Proj::ALL.to_vec())), ..LoraArgs::default() }),
        ("--lora-init", "adapter", LoraArgs { lora_init: Some("adapter".into()), ..LoraArgs::default() }),
    ];
    for (flag, value, want) in want {
        assert_eq!(parse(&[flag, value]), want, "{flag} {value}");
        assert_eq!(parse(&[&format!("{flag}={value}")]), want, "{flag}={value}");
    }
    assert!(parse(&["--rslora"]).rslora && parse(&["--merge-lora"]).merge_lora);
    assert_eq!(parse(&[]), LoraArgs::default(), "LoRA is off by default");
    for lora in [vec!["--lora", "a"], vec!["--lora=a"]] {
        let e: EvalArgs =
            parse_from(["eval", "--model", "m", "--text", "t", "--seq-len=4"].into_iter().chain(lora.iter().copied())).unwrap();
        let g: GenerateArgs = parse_from(["generate", "--model", "m", "--prompt", "Hi"].into_iter().chain(lora.iter().copied())).unwrap();
        assert_eq!((e.run.lora.as_deref(), g.run.lora.as_deref()), (Some("a".as_ref()), Some("a".as_ref())));
    }
}

/// Every LoRA flag error is a flag error, exit code 2, through the tools' process entry: a LoRA
/// flag without --lora-rank (it used to exit 1), and a --lora-* flag that disagrees with
/// --lora-init's adapter (found before the model and data are loaded, not after).
#[test]
fn lora_flag_errors_exit_2() {
    let dir = tmp("cli-lora-flags");
    let model = root().join("tests/fixtures/llama_gqa_untied"); // config.json, no tokenizer: refused before it
    let adapter = root().join("tests/fixtures/lora_llama"); // r 4, alpha 8, for that model
    let cases: [(&[&str], &str); 9] = [
        (&["--lora-alpha", "16"], "--lora-alpha"),
        (&["--lora-dropout", "0.1"], "--lora-dropout"),
        (&["--lora-targets", "q"], "--lora-targets"),
        (&["--rslora"], "--rslora"),
        (&["--merge-lora"], "--merge-lora"),
        (&["--lora-init", adapter.to_str().unwrap(), "--lora-rank", "8"], "--lora-rank 8"),
        (&["--lora-init", adapter.to_str().unwrap(), "--lora-alpha", "3"], "--lora-alpha 3"),
        (&["--lora-init", adapter.to_str().unwrap(), "--lora-targets", "gate"], "--lora-targets"),
        (&["--lora-init", adapter.to_str().unwrap(), "--rslora"], "--rslora"),
    ];
    for (extra, want) in cases {
        for tool in ["finetune", "finetune_ladder"] {
            let mut argv =
                vec![tool.to_string(), "--device=cpu".into(), "--seq-len=16".into(), flag("model", &model), flag("out", &dir.join("out"))];
            if tool == "finetune_ladder" {
                argv.push("--ladder-layers=1".into());
            }
            argv.extend(extra.iter().map(|s| s.to_string()));
            let (code, logs) = capture_logs(|| match tool {
                "finetune" => run_tool::<FinetuneArgs, _, _>(argv.clone(), ferrolm::cli::finetune::run),
                _ => run_tool::<FinetuneLadderArgs, _, _>(argv.clone(), ferrolm::cli::finetune_ladder::run),
            });
            assert_eq!(code, 2, "{tool} {extra:?}: {logs}");
            // The message itself (stderr) is checked through the library: it names the flag.
            let e = match tool {
                "finetune" => ferrolm::cli::finetune::run(parse_from(argv.clone()).unwrap()).unwrap_err(),
                _ => ferrolm::cli::finetune_ladder::run(parse_from(argv.clone()).unwrap()).unwrap_err(),
            };
            assert!(error_report(&e).contains(want), "{tool} {extra:?}: {}", error_report(&e));
        }
    }
    assert!(!dir.join("out").exists(), "a refused run wrote its output directory");
    let _ = std::fs::remove_dir_all(&dir);
}
