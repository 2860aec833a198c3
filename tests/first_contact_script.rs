//! The cheap parts of `scripts/gpu_first_contact.sh` (no GPU, no Python, no build): its help,
//! its refusal of bad arguments, and the report writer: step 1 (environment) writes one JSON
//! line with the keys `step`, `name`, `ok`, `seconds` to `$OUT/gpu_first_contact.jsonl` and a
//! Markdown table to `$OUT/gpu_first_contact.md`; a rerun appends.
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

#[path = "common/scripts.rs"]
mod scripts;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gpu_first_contact.sh")
}

fn run(args: &[&str], out: &Path) -> Output {
    Command::new("bash").arg(script()).args(args).env("OUT", out).env_remove("FERROLM_CUDA_EMULATOR").output().expect("bash runs")
}

fn scratch(name: &str) -> PathBuf {
    scripts::scratch("first-contact", name)
}

#[test]
fn help_lists_every_step_in_order() {
    let out = scratch("help");
    let steps =
        ["environment", "cuda_tests", "train_vs_cpu", "nccl_one_proc", "kernel_floors", "attention", "train_speed", "offload", "memory"];
    scripts::assert_help(&run(&["--help"], &out), &out, "step", &steps, &["--rehearse", "--steps", "OUT", "FERROLM_FORCE_NCCL"]);
}

#[test]
fn bad_arguments_are_refused_by_name() {
    let out = scratch("bad");
    scripts::assert_refused("gpu_first_contact.sh", |a| run(a, &out), &out.join("gpu_first_contact.jsonl"));
}

#[test]
fn step_one_writes_a_json_line_and_the_markdown_report() {
    let out = scratch("env");
    for round in 1..=2 {
        let o = run(&["--steps", "1"], &out);
        // Without a GPU step 1 fails, and the script still finishes and reports it.
        assert!(o.status.success(), "the script must go on past a failed step: {}", String::from_utf8_lossy(&o.stderr));
        let jsonl = std::fs::read_to_string(out.join("gpu_first_contact.jsonl")).expect("jsonl written");
        let lines: Vec<&str> = jsonl.lines().collect();
        assert_eq!(lines.len(), round, "one line per step and run, appended:\n{jsonl}");
        for l in &lines {
            let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
            assert_eq!(v["step"], 1, "{l}");
            assert_eq!(v["name"], "environment", "{l}");
            assert!(v["ok"].is_boolean(), "{l}");
            assert!(v["seconds"].as_f64().is_some_and(|s| s >= 0.0), "{l}");
            for k in ["gpu", "driver", "cuda", "cublasLt", "nvrtc", "nccl"] {
                assert!(v[k].is_string(), "figure {k} missing: {l}");
            }
            assert!(v.get("rehearsal").is_none(), "step 1 is never a rehearsal-only figure: {l}");
        }
        let md = std::fs::read_to_string(out.join("gpu_first_contact.md")).expect("md written");
        assert!(md.contains("| step | name | ok | seconds |"), "{md}");
        assert_eq!(md.matches("| 1 | environment |").count(), 1, "the last run of a step is its row:\n{md}");
    }
    std::fs::remove_dir_all(&out).unwrap();
}
