//! autoconfig's `--model` presets: every preset `--help` names is accepted; a GPU preset given
//! with GPU flags means `--target gpu`, and without them the error says which flag to add.
mod common;
use common::tmp;
use ferrolm::cli::autoconfig::{autoconfig, AutoconfigArgs, Target};
use ferrolm::cli::{error_report, parse_from, Tool};

/// The presets as `--help` lists them: `(cpu: tiny, small; gpu: 7b, ...)`.
fn presets_in_help() -> (Vec<String>, Vec<String>) {
    let help = AutoconfigArgs::cli().render_long_help().to_string().split_whitespace().collect::<Vec<_>>().join(" ");
    let list = |tag: &str, end: char| -> Vec<String> {
        let at = help.find(tag).unwrap_or_else(|| panic!("--help names no {tag} presets:\n{help}")) + tag.len();
        help[at..].split(end).next().unwrap().split(", ").map(str::to_string).collect()
    };
    (list("(cpu: ", ';'), list("; gpu: ", ')'))
}

fn run(flags: &[&str]) -> anyhow::Result<ferrolm::cli::autoconfig::Report> {
    let a: AutoconfigArgs = parse_from(["autoconfig"].iter().chain(flags)).unwrap();
    autoconfig(&a)
}

#[test]
fn gpu_flags_make_a_gpu_preset_a_gpu_run() {
    let out = tmp("presets-gpu");
    let o = format!("--out={}", out.display());
    let r = run(&["--model", "7b", "--gpus", "64", "--gpus-per-node", "8", "--gpu-mem-gib", "80", &o]).unwrap();
    assert_eq!(r.chosen.tp * r.chosen.dp, 64);
    let again = run(&["--model=7b", "--gpus=64", "--gpus-per-node=8", "--gpu-mem-gib=80", &o]).unwrap();
    assert_eq!(again.chosen.name(), r.chosen.name());
    let a: AutoconfigArgs = parse_from(["autoconfig", "--model=7b", "--gpu-mem-gib=40"]).unwrap();
    assert_eq!((a.gpu_flags_given(), a.resolve_target().unwrap()), (vec!["--gpu-mem-gib"], Target::Gpu));
    // Other models keep the CPU default.
    let a: AutoconfigArgs = parse_from(["autoconfig", "--model=tiny", "--gpus=4"]).unwrap();
    assert_eq!(a.resolve_target().unwrap(), Target::Cpu);
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn without_gpu_flags_the_error_says_which_flag_to_add() {
    let e = error_report(&run(&["--model", "7b"]).unwrap_err());
    assert!(e.contains("--model 7b is a GPU preset") && e.contains("add --gpus N") && e.contains("--target gpu"), "{e}");
    let e = error_report(&run(&["--model", "70b", "--target", "cpu"]).unwrap_err());
    assert!(e.contains("GPU preset") && e.contains("--target gpu with --gpus N"), "{e}");
    let e = error_report(&run(&["--model", "7b", "--target=gpu"]).unwrap_err());
    assert!(e.contains("--gpus N"), "{e}");
    let e = error_report(&run(&["--model", "8b", "--gpus=8"]).unwrap_err());
    assert!(e.contains("--model 8b: not a preset") && e.contains("tiny, small") && e.contains("gpt3-175b"), "{e}");
}

#[test]
fn every_preset_named_in_help_is_accepted() {
    let (cpu, gpu) = presets_in_help();
    assert_eq!(cpu, ferrolm::cli::autoconfig::CPU_PRESETS);
    assert_eq!(gpu, ferrolm::cli::autoconfig::GPU_PRESETS);
    let out = tmp("presets-all");
    let o = format!("--out={}", out.display());
    for p in &gpu {
        let r = run(&["--model", p, "--gpus=1024", "--gpu-mem-gib=80", &o]).unwrap_or_else(|e| panic!("{p}: {e:#}"));
        assert_eq!(r.json["train_config"].as_str().map(|s| s.ends_with("train_config.json")), Some(true), "{p}");
    }
    // The CPU presets on a modelled GPU cluster (on the CPU target they are calibrated and
    // trialled: tests/autoconfig.rs runs tiny there end to end).
    for p in &cpu {
        run(&["--model", p, "--target=gpu", "--gpus=8", "--seq-len=256", &o]).unwrap_or_else(|e| panic!("{p}: {e:#}"));
    }
    let _ = std::fs::remove_dir_all(&out);
}
