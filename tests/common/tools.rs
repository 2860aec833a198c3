//! The tools as child processes of a test binary: a test runs a tool (`pretrain_llama --resume
//! …`, `launch …`) in its own working directory and environment and reads its stdout, stderr
//! and exit code, as a user would see them. The child is the test binary run again on its
//! `tool_process` test with the command line in [`ARGS_VAR`], so no example needs building; a
//! binary that uses this declares
//!
//! ```ignore
//! #[test]
//! fn tool_process() {
//!     common::tools::child_entry();
//! }
//! ```
#![allow(dead_code)]
use std::path::Path;
use std::process::{Command, Output};

/// The command line (a JSON list: the tool's name, then its flags) a child process runs.
pub const ARGS_VAR: &str = "FERROLM_TEST_TOOL_ARGS";

/// The entry point of the child processes: runs the tool [`ARGS_VAR`] names and exits with its
/// code. In an ordinary test run (the variable unset) it returns at once.
pub fn child_entry() {
    let Ok(a) = std::env::var(ARGS_VAR) else { return };
    let argv: Vec<String> = serde_json::from_str(&a).expect("the tool's command line is a JSON list of strings");
    std::process::exit(run(argv));
}

/// The tools [`run`] and [`parse`] know (each `examples/NAME.rs` wraps its `ferrolm::cli` module).
pub const TOOLS: &[&str] = &[
    "pretrain_llama",
    "finetune",
    "finetune_ladder",
    "dpo",
    "eval",
    "generate",
    "export",
    "plan",
    "autoconfig",
    "prepare_data",
    "train_tokenizer",
    "launch",
];

/// The tool `argv[0]`'s own parser on `argv`: the flag error as clap prints it.
pub fn parse(argv: &[String]) -> Result<(), String> {
    use ferrolm::cli::*;
    let e = match argv[0].as_str() {
        "pretrain_llama" => parse_from::<pretrain::PretrainArgs, _, _>(argv).err(),
        "finetune" => parse_from::<finetune::FinetuneArgs, _, _>(argv).err(),
        "finetune_ladder" => parse_from::<finetune_ladder::FinetuneLadderArgs, _, _>(argv).err(),
        "dpo" => parse_from::<dpo::DpoArgs, _, _>(argv).err(),
        "eval" => parse_from::<eval::EvalArgs, _, _>(argv).err(),
        "generate" => parse_from::<generate::GenerateArgs, _, _>(argv).err(),
        "export" => parse_from::<export::ExportArgs, _, _>(argv).err(),
        "plan" => parse_from::<plan::PlanArgs, _, _>(argv).err(),
        "autoconfig" => parse_from::<autoconfig::AutoconfigArgs, _, _>(argv).err(),
        "prepare_data" => parse_from::<prepare::PrepareDataArgs, _, _>(argv).err(),
        "train_tokenizer" => parse_from::<prepare::TrainTokenizerArgs, _, _>(argv).err(),
        "launch" => parse_from::<launch::LaunchArgs, _, _>(argv).err(),
        other => return Err(format!("no tool named {other:?}")),
    };
    e.map_or(Ok(()), |e| Err(e.to_string()))
}

/// Runs the tool `argv[0]` (a ferrolm example's name) in this process with `argv` and returns its
/// exit code (`cli::run_tool`: 0, 1 for a runtime error, 2 for a flag error). `launch` starts its
/// processes as this test binary's `tool_process`, each running the tool it was given.
pub fn run(argv: Vec<String>) -> i32 {
    use ferrolm::cli::{self, run_tool};
    match argv.first().map(String::as_str).unwrap_or("") {
        "pretrain_llama" => run_tool(argv, cli::pretrain::run),
        "finetune" => run_tool(argv, cli::finetune::run),
        "finetune_ladder" => run_tool(argv, cli::finetune_ladder::run),
        "dpo" => run_tool(argv, cli::dpo::run),
        "eval" => run_tool(argv, cli::eval::run),
        "generate" => run_tool(argv, cli::generate::run),
        "prepare_data" => run_tool(argv, cli::prepare::prepare_data),
        "train_tokenizer" => run_tool(argv, cli::prepare::train_tokenizer),
        "plan" => run_tool(argv, cli::plan::run),
        "autoconfig" => run_tool(argv, cli::autoconfig::run),
        "export" => run_tool(argv, cli::export::run),
        "launch" => run_tool(argv, |a: cli::launch::LaunchArgs| {
            let mut l = a.local_launch()?;
            l.program = std::env::current_exe()?;
            l.args = child_args();
            l.env.push((ARGS_VAR.into(), serde_json::to_string(&a.command)?));
            cli::launch::start(l)
        }),
        other => panic!("no tool named {other:?}"),
    }
}

/// The test harness's arguments that run only `tool_process`.
fn child_args() -> Vec<String> {
    ["--exact", "tool_process", "--nocapture", "--test-threads=1", "-q"].map(String::from).to_vec()
}

/// Runs `argv` (the tool's name, then its flags) in a child process in `cwd`, with `env` added to
/// this process's environment.
pub fn run_in(cwd: &Path, env: &[(&str, &str)], argv: &[&str]) -> Output {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut cmd = Command::new(exe);
    cmd.args(child_args()).current_dir(cwd).env(ARGS_VAR, serde_json::to_string(argv).unwrap());
    // Another test of this binary may have turned the emulator on for itself (`common::cuda0`).
    cmd.env_remove("FERROLM_CUDA_EMULATOR");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("the test binary runs again as the tool")
}

/// stdout and stderr of a child, for assertions and their messages.
pub fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}
