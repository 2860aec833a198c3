//! Every command in the user documentation runs as written, so none can go stale without this
//! test failing. The commands are read from the documents themselves ([`docs`]: README.md, then
//! every page of docs/ but those of [`NOT_RUN`], so a new page is run without a word here):
//!
//! - every line of a fenced code block (a `\` at the end continues it; `#` starts a comment) that
//!   is not marked ```text, ```json, ```console, ```toml or ```python (a Python snippet: its
//!   check is a fixture test, e.g. tests/fixtures/lora_trained);
//! - every `$ ` line of an indented block (the lines after it are the output it shows);
//! - every inline code span that starts with `cargo `, `lm_eval ` or `scripts/` (inline
//!   `torchrun …` and the like are fragments that name a flag; the fences hold their commands).
//!
//! They run in order, one document after another, in one scratch folder that stands for the
//! repository root (its `data/` holds the bundled tokenizer, chat data and template, preference
//! pairs, and a shortened corpus; `scripts/`
//! is the repository's), so a command may use what an earlier one wrote, as a reader following
//! the documents would. Each tool runs as a child process of this test binary (its `tool_process`
//! test, `common/tools.rs`), not as a built example. How a command is taken:
//!
//! - `cargo run … --example TOOL -- FLAGS` of a tool (`pretrain_llama`, `finetune`, `finetune_ladder`, `dpo`, `eval`,
//!   `generate`, `export`, `plan`, `autoconfig`, `prepare_data`, `train_tokenizer`): run, with
//!   only the steps (`--steps`, autoconfig's `--trials` and `--trial-steps`) and the sizes
//!   (`--batch-size`, `--seq-len`, `--max-new-tokens`, autoconfig's batch and micro-batches)
//!   shrunk (`shrink`), and paths under `/tmp/` moved into the scratch folder. A training run's
//!   checkpoint is then named by its shrunk step: a later path to the documented step's
//!   checkpoint of that run is mapped to it. A run must exit 0 and leave the checkpoint it
//!   promises.
//! - `launch` (as `cargo run … --example launch` or a built `launch`): its flags and the tool's are
//!   parsed; run only under `FERROLM_CUDA_EMULATOR=1` (the CPU emulator of a GPU per process), as
//!   the other launch commands need GPUs.
//! - `torchrun` and `srun` (need GPUs and their launchers), and synopses with placeholders
//!   (`--model DIR`, `...`): parsed only, the tool's flags by the tool's own parser.
//! - `lm_eval` (needs Python and the harness): parsed only: its flags among the harness's, the
//!   `pretrained=` checkpoint written by an earlier command, the local tasks present.
//! - benchmarks (`bench_*`: minutes each, a table, not a check), `cargo test`/`fmt`/`clippy`
//!   (CI's own commands), `pip install`: not run; the example or script must exist.
//!
//! Anything else fails the test: teach it the new command here. A new tool is one line in
//! `common/tools.rs` (`TOOLS`, `run`, `parse`) and, if it trains or samples, its steps and
//! sizes in [`shrink`]. The whole run takes about 1-2 minutes in the dev profile on 2 cores.
mod common;
#[path = "common/tools.rs"]
mod tools;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The documents whose commands are run, in the order a reader meets them; docs/'s other pages
/// follow in name order.
const FIRST: &[&str] = &["README.md", "docs/PARALLEL.md", "docs/LADDER.md", "docs/EVALUATION.md", "docs/AUTOCONFIG.md"];

/// The pages of docs/ whose commands are not for a user to follow, and why.
const NOT_RUN: &[(&str, &str)] = &[
    ("docs/ARCHITECTURE.md", "the code's map: names scripts and tests, shows no user command"),
    ("docs/BENCHMARKS.md", "measurements: benchmarks and GPU scripts that run for minutes to hours"),
    ("docs/OFFLOAD.md", "the offload engine's design and its benchmark"),
];

/// Examples that print a table of figures they compute (not a tool a user runs on data): checked
/// to exist, as benchmarks are.
const TABLES: &[&str] = &["lora_memory"];

/// [`FIRST`], then every other page of docs/ that [`NOT_RUN`] does not name.
fn docs() -> Vec<String> {
    let mut rest: Vec<String> = std::fs::read_dir(common::root().join("docs"))
        .unwrap()
        .map(|e| format!("docs/{}", e.unwrap().file_name().to_string_lossy()))
        .filter(|d| d.ends_with(".md") && !FIRST.contains(&d.as_str()) && !NOT_RUN.iter().any(|(n, _)| n == d))
        .collect();
    rest.sort();
    FIRST.iter().map(|d| d.to_string()).chain(rest).collect()
}

/// Bytes of the bundled sonnets the scratch corpus keeps (about 9,000 tokens).
const CORPUS_BYTES: usize = 30_000;

#[test]
fn tool_process() {
    tools::child_entry();
}

/// One command as the document writes it.
#[derive(Clone, Debug)]
struct DocCommand {
    doc: String,
    line: usize,
    text: String,
}

impl DocCommand {
    fn at(&self) -> String {
        format!("{}:{}", self.doc, self.line)
    }
}

/// The commands of `text` (see the module comment), in order.
fn extract(doc: &str, text: &str) -> Vec<DocCommand> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut prose = String::new(); // text outside fences, for inline spans; with its line numbers
    let mut prose_lines = Vec::new();
    let mut i = 0;
    // Joins `\`-continued lines from `i`; returns the command and the next line's index.
    let joined = |mut i: usize, strip: &dyn Fn(&str) -> String| -> (String, usize) {
        let mut cmd = String::new();
        loop {
            let l = strip(lines[i]);
            let l = l.trim_end();
            i += 1;
            match l.strip_suffix('\\') {
                Some(head) if i < lines.len() => {
                    cmd.push_str(head);
                    cmd.push(' ');
                }
                _ => {
                    cmd.push_str(l);
                    return (cmd, i);
                }
            }
        }
    };
    while i < lines.len() {
        let l = lines[i];
        if let Some(info) = l.trim_start().strip_prefix("```") {
            let skip = ["text", "json", "console", "toml", "python"].contains(&info.trim());
            i += 1;
            while i < lines.len() && !lines[i].trim_start().starts_with("```") {
                let t = lines[i].trim();
                if skip || t.is_empty() || t.starts_with('#') {
                    i += 1;
                    continue;
                }
                let start = i + 1;
                let (cmd, next) = joined(i, &|s: &str| s.trim().to_string());
                out.push(DocCommand { doc: doc.to_string(), line: start, text: cmd });
                i = next;
            }
            i += 1;
            continue;
        }
        if l.starts_with("    ") && l.trim_start().starts_with("$ ") {
            let start = i + 1;
            let (cmd, next) = joined(i, &|s: &str| s.trim().trim_start_matches("$ ").to_string());
            out.push(DocCommand { doc: doc.to_string(), line: start, text: cmd });
            i = next;
            continue;
        }
        prose.push_str(l);
        prose.push('\n');
        prose_lines.push((prose.len(), i + 1));
        i += 1;
    }
    // Inline spans: `…` pairs in the prose (a span may wrap lines).
    let mut rest = prose.as_str();
    let mut offset = 0;
    while let Some(a) = rest.find('`') {
        let after = &rest[a + 1..];
        if after.starts_with('`') {
            // A double-backtick span or a fence's remains: skip its marks.
            let n = after.len() - after.trim_start_matches('`').len();
            offset += a + 1 + n;
            rest = &after[n..];
            continue;
        }
        let Some(b) = after.find('`') else { break };
        let span = after[..b].split_whitespace().collect::<Vec<_>>().join(" ");
        let line = prose_lines.iter().find(|(end, _)| *end > offset + a).map_or(0, |(_, l)| *l);
        if ["cargo ", "lm_eval ", "scripts/"].iter().any(|p| span.starts_with(p)) {
            out.push(DocCommand { doc: doc.to_string(), line, text: span });
        }
        offset += a + 1 + b + 1;
        rest = &after[b + 1..];
    }
    out.sort_by_key(|c| c.line);
    out
}

/// Shell words: whitespace-separated, '…' and "…" quoting, `#` at a word's start ends the line.
fn words(cmd: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur: Option<String> = None;
    let mut chars = cmd.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => out.extend(cur.take()),
            '#' if cur.is_none() => break,
            '\'' => {
                let w = cur.get_or_insert_with(String::new);
                for c in chars.by_ref() {
                    if c == '\'' {
                        break;
                    }
                    w.push(c);
                }
            }
            '"' => {
                let w = cur.get_or_insert_with(String::new);
                while let Some(c) = chars.next() {
                    match c {
                        '"' => break,
                        '\\' => w.extend(chars.next()),
                        c => w.push(c),
                    }
                }
            }
            c => cur.get_or_insert_with(String::new).push(c),
        }
    }
    out.extend(cur);
    out
}

/// A placeholder of a synopsis: `DIR`, `FILE|DIR|GLOB`, `N`, `[FLAGS]`, `...`.
fn is_placeholder(w: &str) -> bool {
    let w = w.strip_prefix('[').and_then(|w| w.strip_suffix(']')).unwrap_or(w);
    w == "..."
        || (w.chars().next().is_some_and(|c| c.is_ascii_uppercase())
            && w.split('|').all(|p| p.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')))
}

/// What the test did with a command.
enum Outcome {
    Ran(f64),
    Checked(&'static str),
}

/// The scratch repository root and what the runs in it wrote.
struct Sandbox {
    root: PathBuf,
    /// Documented checkpoint paths (a run's documented last step) -> the checkpoint the shrunk run
    /// wrote.
    renames: Vec<(String, String)>,
}

impl Sandbox {
    fn new() -> Sandbox {
        let root = common::tmp("documented-commands");
        let data = root.join("data");
        std::fs::create_dir_all(data.join("corpus")).unwrap();
        std::fs::copy(common::tokenizer_path(), data.join("tokenizer.json")).unwrap();
        let sonnets = std::fs::read(common::data_path("corpus/sonnets.txt")).unwrap();
        let cut = sonnets[..CORPUS_BYTES].iter().rposition(|&b| b == b'\n').unwrap() + 1;
        std::fs::write(data.join("corpus/sonnets.txt"), &sonnets[..cut]).unwrap();
        for f in ["chat.jsonl", "chat_template.jinja", "prefs.jsonl", "prefs_val.jsonl"] {
            std::os::unix::fs::symlink(std::fs::canonicalize(common::data_path(f)).unwrap(), data.join(f)).unwrap();
        }
        std::os::unix::fs::symlink(common::root().join("scripts"), root.join("scripts")).unwrap();
        Sandbox { root, renames: Vec::new() }
    }

    /// A word as it is run here: paths under /tmp/ moved into the sandbox, and a documented
    /// checkpoint of an earlier shrunk run mapped to the one it wrote.
    fn map(&self, w: &str) -> String {
        let tmp = format!("{}/tmp/", self.root.display());
        let mut w = match w.strip_prefix("/tmp/") {
            Some(rest) => format!("{tmp}{rest}"),
            None => w.to_string(),
        };
        w = w.replace("=/tmp/", &format!("={tmp}"));
        for (from, to) in &self.renames {
            w = w.replace(from, to);
        }
        w
    }
}

fn value<'a>(argv: &'a [String], flag: &str) -> Option<&'a str> {
    let eq = format!("{flag}=");
    argv.iter().enumerate().find_map(|(i, a)| if a == flag { argv.get(i + 1).map(String::as_str) } else { a.strip_prefix(&eq) })
}

/// Sets `flag` to `f(documented value)`, or to `default` when absent (`None`: leave it absent).
fn set(argv: &mut Vec<String>, flag: &str, default: Option<&str>, f: impl Fn(&str) -> String) {
    let eq = format!("{flag}=");
    for i in 0..argv.len() {
        if argv[i] == flag && i + 1 < argv.len() {
            argv[i + 1] = f(&argv[i + 1]);
            return;
        }
        if let Some(v) = argv[i].strip_prefix(&eq) {
            argv[i] = format!("{eq}{}", f(v));
            return;
        }
    }
    if let Some(d) = default {
        argv.extend([flag.to_string(), d.to_string()]);
    }
}

fn at_most(n: usize) -> impl Fn(&str) -> String {
    move |v| v.parse::<usize>().map_or(v.to_string(), |x| x.min(n).to_string())
}

/// Only the steps and the sizes of a tool's run, made small enough for the dev profile on 2 cores.
fn shrink(tool: &str, argv: &mut Vec<String>) {
    match tool {
        "pretrain_llama" | "finetune_ladder" | "finetune" => {
            set(argv, "--steps", Some("2"), at_most(2));
            set(argv, "--batch-size", Some("2"), at_most(2));
            // Token windows shrink to 16; a conversation needs a row that holds it whole.
            let records = |d: &str| [".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet"].iter().any(|e| d.ends_with(e));
            let chat = tool == "finetune" && value(argv, "--data-format") != Some("text") && value(argv, "--data").is_none_or(records);
            set(argv, "--seq-len", Some(if chat { "128" } else { "16" }), at_most(if chat { 128 } else { 16 }));
        }
        // Pairs are conversations too: a row holds a pair's two sequences.
        "dpo" => {
            set(argv, "--steps", Some("2"), at_most(2));
            set(argv, "--batch-size", Some("2"), at_most(2));
            set(argv, "--seq-len", Some("128"), at_most(128));
        }
        "eval" => {
            set(argv, "--seq-len", None, at_most(16));
            set(argv, "--batch-size", Some("4"), at_most(4));
        }
        "generate" => set(argv, "--max-new-tokens", Some("8"), at_most(8)),
        // Calibrated and trialled on this CPU (a GPU target is only modelled: nothing to shrink).
        "autoconfig" if !argv.iter().any(|a| a.starts_with("--gpus") || a.starts_with("--target")) => {
            set(argv, "--trials", None, at_most(2));
            set(argv, "--trial-steps", None, at_most(1));
            set(argv, "--seq-len", Some("16"), at_most(16));
            set(argv, "--global-batch-tokens", Some("256"), at_most(256));
            set(argv, "--micro-batches", Some("2"), |_| "2".into());
        }
        _ => {}
    }
}

/// The tool's own parser on `argv` (its name first); `bench_cuda`'s too (a benchmark, never
/// run here). A launch's tool is parsed as well.
fn parse(argv: &[String]) -> Result<(), String> {
    match argv[0].as_str() {
        "bench_cuda" => ferrolm::cli::parse_from::<ferrolm::cli::BenchCudaArgs, _, _>(argv).map(|_| ()).map_err(|e| e.to_string()),
        "launch" => {
            let l = ferrolm::cli::parse_from::<ferrolm::cli::launch::LaunchArgs, _, _>(argv).map_err(|e| e.to_string())?;
            tools::parse(&tool_argv(&l.command[0], &l.command[1..])?)
        }
        _ => tools::parse(argv),
    }
}

/// `program` (a tool's name, or a built example's path) and its flags as a tool command line.
fn tool_argv(program: &str, flags: &[String]) -> Result<Vec<String>, String> {
    let name = Path::new(program).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    if !tools::TOOLS.contains(&name.as_str()) {
        return Err(format!("{program} is not one of the tools ({})", tools::TOOLS.join(", ")));
    }
    if program.contains('/') && program != format!("target/release/examples/{name}") {
        return Err(format!("{program}: a built tool is target/release/examples/{name}"));
    }
    Ok(std::iter::once(name).chain(flags.iter().cloned()).collect())
}

/// Placeholders stand for values: what may be left out (`...`, `[FLAGS]`) goes, the others
/// (`DIR`, `N`) become `1`.
fn fill_placeholders(argv: &[String]) -> Vec<String> {
    let optional = |w: &str| w == "..." || (w.starts_with('[') && w.ends_with(']'));
    argv.iter().filter(|w| !optional(w)).map(|w| if is_placeholder(w) { "1".into() } else { w.clone() }).collect()
}

/// An example named by `cargo run [-p PKG] --example NAME` exists.
fn example_exists(pkg: Option<&str>, name: &str) -> Result<(), String> {
    let root = common::root();
    let path = match pkg {
        None | Some("ferrolm") => root.join(format!("examples/{name}.rs")),
        Some(p) => root.join(format!("crates/{}/examples/{name}.rs", p.trim_start_matches("ferrolm-"))),
    };
    if path.is_file() {
        Ok(())
    } else {
        Err(format!("no example {name}: {} does not exist", path.display()))
    }
}

impl Sandbox {
    /// Runs or checks one command.
    fn take(&mut self, c: &DocCommand) -> Result<Outcome, String> {
        let mut ws = words(&c.text);
        if ws.first().is_some_and(|w| w.contains("=$(")) {
            return Ok(Outcome::Checked("shell setup (a variable from a command's output): nothing to run"));
        }
        let mut env = Vec::new();
        while ws.first().is_some_and(|w| {
            w.split_once('=')
                .is_some_and(|(k, _)| !k.is_empty() && k.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
        }) {
            let w = ws.remove(0);
            let (k, v) = w.split_once('=').unwrap();
            env.push((k.to_string(), v.to_string()));
        }
        let Some(program) = ws.first().cloned() else { return Err("an environment assignment without a command".into()) };
        let rest = ws[1..].to_vec();
        match program.as_str() {
            "cargo" => self.cargo(&rest, &env),
            "launch" => self.tool(tool_argv("launch", &rest)?, &env),
            "torchrun" => torchrun(&rest),
            "srun" => {
                let at = rest.iter().position(|w| !w.starts_with('-')).ok_or("srun without a program")?;
                match rest[at].as_str() {
                    "torchrun" => torchrun(&rest[at + 1..]),
                    p => parse(&fill_placeholders(&tool_argv(p, &rest[at + 1..])?))
                        .map(|()| Outcome::Checked("srun needs a SLURM cluster of GPUs: flags parsed")),
                }
            }
            "lm_eval" => self.lm_eval(&rest),
            "pip" => Ok(Outcome::Checked("installs Python packages: not run")),
            p if p.starts_with("scripts/") => {
                let path = common::root().join(p.trim_end_matches('/'));
                if !path.exists() {
                    return Err(format!("{p} does not exist"));
                }
                if p.ends_with(".sh") {
                    let ok = std::process::Command::new("bash").arg("-n").arg(&path).status().map_err(|e| e.to_string())?.success();
                    if !ok {
                        return Err(format!("{p}: bash -n finds a syntax error"));
                    }
                    return Ok(Outcome::Checked("a script that builds and runs release tools for minutes: exists, bash -n clean"));
                }
                Ok(Outcome::Checked("a script or folder of the repository (Python, or data): exists"))
            }
            other => Err(format!("the test does not know how to run `{other}`: teach tests/documented_commands.rs")),
        }
    }

    fn cargo(&mut self, args: &[String], env: &[(String, String)]) -> Result<Outcome, String> {
        match args.first().map(String::as_str) {
            Some("test" | "fmt" | "clippy") => return Ok(Outcome::Checked("the project's own checks, which CI runs: not run here")),
            Some("run") => {}
            other => return Err(format!("cargo {other:?}: not a command the test knows")),
        }
        let (mut pkg, mut example, mut i) = (None, None, 1);
        while i < args.len() && args[i] != "--" {
            match args[i].as_str() {
                "--release" => {}
                "-p" | "--package" => {
                    pkg = args.get(i + 1).cloned();
                    i += 1;
                }
                "--example" => {
                    example = args.get(i + 1).cloned();
                    i += 1;
                }
                other => return Err(format!("cargo run: flag {other} unknown to the test")),
            }
            i += 1;
        }
        let name = example.ok_or("cargo run without --example")?;
        example_exists(pkg.as_deref(), &name)?;
        let flags = args.get(i + 1..).unwrap_or(&[]).to_vec();
        // A benchmark, or an example that only prints a table of what it computes.
        if name.starts_with("bench_") || TABLES.contains(&name.as_str()) {
            if name == "bench_cuda" {
                parse(&fill_placeholders(&[vec![name.clone()], flags].concat()))?;
            }
            return Ok(Outcome::Checked("a benchmark (minutes; it prints a table, it checks nothing): the example exists"));
        }
        self.tool(tool_argv(&name, &flags)?, env)
    }

    /// A tool's command line: parsed; run (shrunk) unless it is a synopsis or needs GPUs.
    fn tool(&mut self, argv: Vec<String>, env: &[(String, String)]) -> Result<Outcome, String> {
        if argv.iter().any(|w| is_placeholder(w)) {
            parse(&fill_placeholders(&argv))?;
            return Ok(Outcome::Checked("a synopsis with placeholders: flags parsed"));
        }
        parse(&argv)?;
        let mut argv: Vec<String> = argv.iter().map(|w| self.map(w)).collect();
        if argv[0] == "launch" {
            if !env.iter().any(|(k, v)| k == "FERROLM_CUDA_EMULATOR" && v == "1") {
                return Ok(Outcome::Checked("one process per GPU: needs GPUs (flags parsed)"));
            }
            let at = argv.iter().position(|w| tools::TOOLS.contains(&w.as_str()) && w != "launch").ok_or("launch without a tool")?;
            let mut inner = argv.split_off(at);
            self.run_tool(&mut inner, env, |inner| [argv.clone(), inner.to_vec()].concat())
        } else {
            self.run_tool(&mut argv, env, |a| a.to_vec())
        }
    }

    /// Runs the tool `argv` shrunk (`wrap` puts a launcher around it) and checks a training run's
    /// checkpoint; records where the checkpoint of its documented last step went.
    fn run_tool(
        &mut self,
        argv: &mut Vec<String>,
        env: &[(String, String)],
        wrap: impl Fn(&[String]) -> Vec<String>,
    ) -> Result<Outcome, String> {
        let tool = argv[0].clone();
        let documented = match tool.as_str() {
            "pretrain_llama" => Some(value(argv, "--steps").map_or(500, |s| s.parse().unwrap_or(0))),
            // --show-example prints examples and trains nothing.
            "finetune_ladder" | "finetune" if value(argv, "--show-example").is_none() => {
                Some(value(argv, "--steps").map_or(200, |s| s.parse().unwrap_or(0)))
            }
            "dpo" => Some(value(argv, "--steps").map_or(100, |s| s.parse().unwrap_or(0))),
            _ => None,
        };
        shrink(&tool, argv);
        let full = wrap(argv);
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let t = Instant::now();
        let o = tools::run_in(&self.root, &env, &full.iter().map(String::as_str).collect::<Vec<_>>());
        let secs = t.elapsed().as_secs_f64();
        let (stdout, stderr) = tools::text(&o);
        if !o.status.success() {
            return Err(format!("{full:?} exited with {:?}:\n{stdout}\n{stderr}", o.status.code()));
        }
        if let Some(doc_steps) = documented {
            let steps: usize = value(argv, "--steps").and_then(|s| s.parse().ok()).unwrap_or(0);
            let out = self.out_dir(&tool, argv, &stderr);
            let ckpt = |s: usize| format!("{out}/checkpoints/step-{s:06}");
            let written = self.root.join(ckpt(steps));
            // A model checkpoint, or a LoRA run's PEFT adapter.
            if !["config.json", "adapter_config.json"].iter().any(|f| written.join(f).is_file()) {
                return Err(format!("{full:?} wrote no checkpoint {}:\n{stdout}\n{stderr}", written.display()));
            }
            self.renames.push((ckpt(doc_steps), ckpt(steps)));
        }
        Ok(Outcome::Ran(secs))
    }

    /// The run directory a training command wrote: `--out`, else the resumed run's (the log says
    /// which), else the tool's default.
    fn out_dir(&self, tool: &str, argv: &[String], stderr: &str) -> String {
        if let Some(o) = value(argv, "--out") {
            return o.trim_end_matches('/').to_string();
        }
        if let Some(l) = stderr.lines().find_map(|l| l.split_once("continuing the run in ")) {
            return l.1.split(" (").next().unwrap_or_default().to_string();
        }
        format!("runs/{tool}")
    }

    /// lm_eval: its flags among the harness's; the checkpoint and local tasks it names exist.
    fn lm_eval(&self, args: &[String]) -> Result<Outcome, String> {
        const FLAGS: &[&str] = &[
            "--model",
            "--model_args",
            "--tasks",
            "--device",
            "--batch_size",
            "--include_path",
            "--num_fewshot",
            "--output_path",
            "--limit",
        ];
        for a in args.iter().filter(|a| a.starts_with("--")) {
            let f = a.split('=').next().unwrap();
            if !FLAGS.contains(&f) {
                return Err(format!("lm_eval has no flag {f} (the test knows {})", FLAGS.join(", ")));
            }
        }
        if let Some(m) = value(args, "--model_args") {
            let m = self.map(m);
            for kv in m.split(',') {
                if let Some(p) = kv.strip_prefix("pretrained=").filter(|p| !is_placeholder(p)) {
                    let dir = self.root.join(p);
                    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
                        if !dir.join(f).is_file() {
                            return Err(format!("pretrained={p}: no {f} there (no earlier command wrote this checkpoint)"));
                        }
                    }
                }
            }
        }
        if let (Some(inc), Some(tasks)) = (value(args, "--include_path"), value(args, "--tasks")) {
            let dir = common::root().join(inc);
            let mut known = Vec::new();
            for e in std::fs::read_dir(&dir).map_err(|e| format!("--include_path {inc}: {e}"))? {
                let text = std::fs::read_to_string(e.unwrap().path()).unwrap_or_default();
                known.extend(text.lines().filter_map(|l| l.strip_prefix("task:")).map(|t| t.trim().to_string()));
            }
            for t in tasks.split(',') {
                if !known.iter().any(|k| k == t) {
                    return Err(format!("--tasks {t}: no such task in {inc} ({known:?})"));
                }
            }
        }
        Ok(Outcome::Checked("Python's lm-evaluation-harness: flags, checkpoint and local tasks checked, not run"))
    }
}

/// torchrun's flags are its own; the program is a built tool whose flags parse.
fn torchrun(args: &[String]) -> Result<Outcome, String> {
    const FLAGS: &[&str] = &[
        "--standalone",
        "--nproc-per-node",
        "--nnodes",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--rdzv-backend",
        "--rdzv-endpoint",
        "--rdzv-id",
        "--max-restarts",
    ];
    let at = args.iter().position(|a| a == "--no-python").ok_or("torchrun without --no-python: the tool is not a Python script")?;
    for a in args[..at].iter().filter(|a| a.starts_with("--")) {
        let f = a.split('=').next().unwrap().replace('_', "-");
        if !FLAGS.contains(&f.as_str()) {
            return Err(format!("torchrun: {a} is not a flag the test knows ({})", FLAGS.join(", ")));
        }
    }
    let program = args.get(at + 1).ok_or("torchrun --no-python without a program")?;
    parse(&fill_placeholders(&tool_argv(program, &args[at + 2..])?))?;
    Ok(Outcome::Checked("torchrun on GPUs: flags parsed"))
}

#[test]
fn every_documented_command_runs_as_written() {
    let mut sb = Sandbox::new();
    let (mut failures, mut report) = (Vec::new(), BTreeMap::new());
    let start = Instant::now();
    for (doc, _) in NOT_RUN {
        assert!(common::root().join(doc).is_file(), "{doc} is in NOT_RUN but does not exist");
    }
    for doc in docs() {
        let text = std::fs::read_to_string(common::root().join(&doc)).unwrap_or_else(|e| panic!("{doc}: {e}"));
        let cmds = extract(&doc, &text);
        assert!(!cmds.is_empty(), "{doc}: no commands found: name it in NOT_RUN if it shows none, else the extraction is broken");
        for c in cmds {
            let line = match sb.take(&c) {
                Ok(Outcome::Ran(s)) => format!("ran in {s:.1} s"),
                Ok(Outcome::Checked(why)) => why.to_string(),
                Err(e) => {
                    failures.push(format!("{}: `{}`:\n{e}", c.at(), c.text));
                    "FAILED".to_string()
                }
            };
            println!("{}: {line}: {}", c.at(), c.text);
            *report.entry(line.split(" in ").next().unwrap().to_string()).or_insert(0) += 1;
        }
    }
    println!("{report:?} in {:.0} s", start.elapsed().as_secs_f64());
    assert!(failures.is_empty(), "{} documented command(s) failed:\n\n{}", failures.len(), failures.join("\n\n"));
    let _ = std::fs::remove_dir_all(&sb.root);
}

/// The extraction itself: fences (continued lines, comments, ```text skipped), `$ ` lines of
/// indented blocks, and inline spans that wrap lines.
#[test]
fn commands_are_found_in_fences_prompts_and_inline_spans() {
    let doc = "Run `cargo run --release --example plan -- --model 7b\n  --gpus 8` now, not `--flag`.\n\
               ```\ncargo run --example eval -- --model m \\\n    --seq-len 4   # a comment\n# only a comment\n```\n\
               ```text\nnot a command\n```\n    $ cargo run --example generate -- --model m\n    output line\n";
    let got: Vec<(usize, String)> = extract("x.md", doc).into_iter().map(|c| (c.line, c.text)).collect();
    assert_eq!(
        got,
        [
            (1, "cargo run --release --example plan -- --model 7b --gpus 8".to_string()),
            (4, "cargo run --example eval -- --model m  --seq-len 4   # a comment".to_string()),
            (11, "cargo run --example generate -- --model m".to_string()),
        ]
    );
    assert_eq!(words("A=1 x 'a b' \"c\\\"d\" # gone"), ["A=1", "x", "a b", "c\"d"]);
    assert!(is_placeholder("DIR") && is_placeholder("FILE|DIR|GLOB") && is_placeholder("...") && is_placeholder("[FLAGS]"));
    assert!(!is_placeholder("tiny") && !is_placeholder("Shall I"));
    let mut a: Vec<String> = ["pretrain_llama", "--steps=150", "--seq-len", "128"].map(String::from).to_vec();
    shrink("pretrain_llama", &mut a);
    assert_eq!(a, ["pretrain_llama", "--steps=2", "--seq-len", "16", "--batch-size", "2"]);
    // Conversations keep rows that hold them; token data shrinks as pretraining does.
    let mut a: Vec<String> = ["finetune", "--model", "m", "--seq-len=1024"].map(String::from).to_vec();
    shrink("finetune", &mut a);
    assert_eq!(a, ["finetune", "--model", "m", "--seq-len=128", "--steps", "2", "--batch-size", "2"]);
    let mut a: Vec<String> = ["finetune", "--data", "data/corpus"].map(String::from).to_vec();
    shrink("finetune", &mut a);
    assert_eq!(a, ["finetune", "--data", "data/corpus", "--steps", "2", "--batch-size", "2", "--seq-len", "16"]);
    // Every page of docs/ is run or named in NOT_RUN with its reason.
    let pages = docs();
    assert_eq!(pages[..FIRST.len()], FIRST.iter().map(|d| d.to_string()).collect::<Vec<_>>()[..]);
    assert!(pages.iter().all(|p| !NOT_RUN.iter().any(|(n, _)| n == p)));
}
