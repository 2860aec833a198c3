//! `scripts/gpu_perf.sh`: its help, its refusal of bad arguments, and its rehearsal (no GPU: the
//! CUDA emulator, tiny shapes, dev-profile binaries, PyTorch skipped when it does not import),
//! which must write `$OUT/gpu_perf.json` with every part, each marked rehearsal, the Markdown
//! report, the log archive, part 3's bench_cuda tables and part 4's profile, and nothing else.
//! The rehearsal runs every part: the determinism part's reruns and resume must give the same
//! bits on the emulator, the offload part must measure all-CPU offload and DOS with
//! bench_offload's prediction beside each, and the finetune part must time a step of each of
//! full fine-tuning, LoRA, QLoRA and DPO, with PyTorch's beside it or its skip said.
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

#[path = "common/scripts.rs"]
mod scripts;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gpu_perf.sh")
}

fn run(args: &[&str], out: &Path, work: &Path) -> Output {
    Command::new("bash")
        .arg(script())
        .args(args)
        .env("OUT", out)
        .env("GP_WORK", work)
        .env_remove("FERROLM_CUDA_EMULATOR")
        .env_remove("FERROLM_REQUIRE_GPU")
        .output()
        .expect("bash runs")
}

fn scratch(name: &str) -> PathBuf {
    scripts::scratch("gpu-perf", name)
}

#[test]
fn help_names_every_part_and_output() {
    let out = scratch("help");
    let mentions = [
        "--rehearse",
        "--parts",
        "OUT",
        "gpu_perf.md",
        "gpu_perf.json",
        "gpu_perf_logs.tar.gz",
        "profile.json",
        "GP_BUDGET_S",
        "torch.compile",
        "ours/compile",
        "same_bits_rerun",
        "same_bits_resume",
        "--offload-gpu-every inf",
        "gemm_fallbacks",
        "GP_COMMIT",
        "--loss-chunk-tokens 0",
        "fused_over_eager_peak",
        "nf4_dequant_floor_over_time",
        "bench_finetune_torch.py",
        "--quantize-base nf4",
        "lora_over_torch",
        "dpo_over_torch",
        "qlora_over_lora",
        "qlora_torch_skipped",
    ];
    let o = run(&["--help"], &out, &out.join("work"));
    scripts::assert_help(&o, &out, "part", &PARTS, &mentions);
}

#[test]
fn bad_arguments_are_refused_by_name() {
    let out = scratch("bad");
    scripts::assert_refused("gpu_perf.sh", |a| run(a, &out, &out.join("work")), &out.join("gpu_perf.json"));
}

const PARTS: [&str; 8] = ["tests", "train", "bench_cuda", "profile", "determinism", "offload", "head_memory", "finetune"];

fn positive(v: &serde_json::Value) -> bool {
    v.as_f64().is_some_and(|x| x > 0.0)
}

/// The whole rehearsal: tens of seconds once the examples are built (cargo checks them first).
#[test]
fn rehearsal_writes_every_part_marked_rehearsal() {
    let out = scratch("rehearsal");
    let work = scratch("rehearsal-work");
    let o = run(&["--rehearse"], &out, &work);
    let log = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "the rehearsal must finish past failed parts:\n{log}");

    let text = std::fs::read_to_string(out.join("gpu_perf.json")).unwrap_or_else(|e| panic!("no gpu_perf.json ({e}):\n{log}"));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("gpu_perf.json is not JSON ({e}):\n{text}"));
    assert_eq!(v["mode"], "rehearsal", "{text}");
    assert!(v["commit"].as_str().is_some_and(|c| !c.is_empty()), "no commit: {text}");
    // The emulator's GEMMs are never refused: the profile counts none, and no run warns.
    assert_eq!(v["gemm_fallbacks"]["profile_count"], 0, "{text}");
    assert_eq!(v["gemm_fallbacks"]["runs"], serde_json::json!([]), "{text}");
    for part in PARTS {
        let p = &v[part];
        assert!(p["ok"].is_boolean(), "part {part} lacks ok: {text}");
        assert!(p["seconds"].as_f64().is_some_and(|s| s >= 0.0), "part {part} lacks seconds: {text}");
        assert!(positive(&p["limit_s"]), "part {part} lacks its limit: {text}");
        assert_eq!(p["rehearsal"], true, "part {part} is not marked rehearsal: {text}");
        assert!(p["figures"].is_object(), "part {part} lacks figures: {text}");
    }
    // The parts that do not wait on pretrain_llama --profile pass in the rehearsal.
    let t = &v["tests"]["figures"];
    assert_eq!(v["tests"]["ok"], true, "{text}\n{log}");
    assert!(positive(&t["tests_passed"]) && t["tests_failed"] == 0, "{text}");
    assert_eq!(v["train"]["ok"], true, "{text}\n{log}");
    for shape in ["124m", "1b"] {
        let f = &v["train"]["figures"];
        assert!(positive(&f[format!("{shape}_ours_tokens_per_s")]), "{shape}: no tokens/s of ours: {text}");
        assert!(positive(&f[format!("{shape}_params")]), "{shape}: no parameter count: {text}");
        // PyTorch either ran (on the CPU) or is marked skipped.
        let eager = &f[format!("{shape}_eager_tokens_per_s")];
        assert!(positive(eager) || f[format!("{shape}_eager_skipped")].is_string(), "{shape}: PyTorch neither ran nor skipped: {text}");
        assert!(f["ours/eager"].get(shape).is_some(), "{shape}: no ours/eager: {text}");
    }
    // torch.compile at 124m only, with its compile time apart.
    let f = &v["train"]["figures"];
    assert!(
        positive(&f["124m_compile_tokens_per_s"]) && f["124m_compile_s"].is_number() && positive(&f["ours/compile"]["124m"])
            || f["124m_compile_skipped"].is_string(),
        "torch.compile neither ran nor skipped: {text}"
    );
    assert!(f["ours/compile"].get("1b").is_none(), "{text}");
    assert_eq!(v["bench_cuda"]["ok"], true, "{text}\n{log}");
    assert!(positive(&v["bench_cuda"]["figures"]["kernel_rows"]), "{text}");
    // QLoRA's dequantize row (issue 53): its floor over its time, here the emulator's.
    assert!(positive(&v["bench_cuda"]["figures"]["nf4_dequant_floor_over_time"]), "{text}");
    for f in ["bench_cuda.md", "bench_cuda.json", "gpu_perf.md", "gpu_perf_logs.tar.gz"] {
        assert!(out.join(f).metadata().is_ok_and(|m| m.len() > 0), "{f} missing or empty in OUT");
    }
    let md = std::fs::read_to_string(out.join("gpu_perf.md")).unwrap();
    for (i, part) in PARTS.iter().enumerate() {
        let row = format!("| {} | {part} |", i + 1);
        assert_eq!(md.matches(&row).count(), 1, "gpu_perf.md lacks the row `{row}`:\n{md}");
    }
    // The fused head's memory: both of our runs measured, PyTorch's peak or its skip said (on the
    // CPU it has no device peak), and the ratio's key present.
    let h = &v["head_memory"]["figures"];
    assert_eq!(v["head_memory"]["ok"], true, "{text}\n{log}");
    assert!(positive(&h["fused_peak_mib"]) && positive(&h["unfused_peak_mib"]), "head_memory: no peaks of ours: {text}");
    assert!(h.get("fused_over_eager_peak").is_some() && h.get("eager_peak_mib").is_some(), "head_memory: {text}");
    for table in ["ours/compile", "### determinism", "### offload", "### head_memory", "### finetune"] {
        assert!(md.contains(table), "gpu_perf.md lacks `{table}`:\n{md}");
    }
    // The device tool brings back 8 files: the script writes at most 6.
    let files = std::fs::read_dir(&out).unwrap().count();
    assert!(
        files <= 6,
        "{files} entries in OUT: {:?}",
        std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name()).collect::<Vec<_>>()
    );

    // Part 4 needs pretrain_llama --profile (profile.json in the run directory).
    let prof = &v["profile"];
    assert!(positive(&prof["figures"]["launches_per_step"]), "the profile's launches_per_step is not a positive number: {text}");
    assert_eq!(prof["figures"]["timed"], false, "the emulator's profile must say it is not timed: {text}");
    assert!(prof["figures"]["top_kernels"].as_array().is_some_and(|k| !k.is_empty()), "{text}");
    assert!(out.join("profile.json").exists(), "profile.json not copied to OUT");
    assert_eq!(prof["ok"], true, "{text}");
    assert_eq!(prof["figures"]["gemm_fallbacks"], 0, "{text}");

    // Determinism: the emulator is deterministic, so both figures must be true, over every step.
    let d = &v["determinism"];
    assert_eq!(d["ok"], true, "{text}\n{log}");
    assert_eq!(d["figures"]["same_bits_rerun"], true, "{text}");
    assert_eq!(d["figures"]["same_bits_resume"], true, "{text}");
    assert!(positive(&d["figures"]["losses_compared"]) && positive(&d["figures"]["resume_losses_compared"]), "{text}");

    // Offload: all-CPU and DOS measured, with bench_offload's prediction beside each.
    let o = &v["offload"]["figures"];
    assert_eq!(v["offload"]["ok"], true, "{text}\n{log}");
    for run in ["inf", "auto"] {
        assert!(positive(&o[format!("{run}_step_s")]), "offload {run}: no step time: {text}");
        assert!(positive(&o[format!("{run}_predicted_s")]), "offload {run}: no bench_offload prediction: {text}");
    }
    assert!(positive(&o["dos_over_all_cpu"]), "{text}");
    assert!(o["model_k"].is_string() && o["none_fits"].is_boolean(), "{text}");

    // Fine-tuning steps: each of ours timed from the one-step starting checkpoint, with its peak;
    // PyTorch's beside it (on the CPU) or its skip said; the ratios' keys present.
    let f = &v["finetune"]["figures"];
    assert_eq!(v["finetune"]["ok"], true, "{text}\n{log}");
    assert!(f.get("base_failed").is_none(), "finetune: no starting checkpoint: {text}");
    for mode in ["lora", "qlora", "dpo", "full"] {
        assert!(positive(&f[format!("{mode}_tokens_per_s")]), "finetune {mode}: no tokens/s of ours: {text}\n{log}");
        assert!(positive(&f[format!("{mode}_peak_tensor_mib")]), "finetune {mode}: no peak of ours: {text}");
        let torch = &f[format!("{mode}_torch_tokens_per_s")];
        assert!(
            positive(torch) && positive(&f[format!("{mode}_over_torch")]) || f[format!("{mode}_torch_skipped")].is_string(),
            "finetune {mode}: PyTorch neither ran nor skipped: {text}"
        );
        assert!(f["ours/torch"].get(mode).is_some(), "finetune {mode}: no ours/torch: {text}");
    }
    for ratio in ["qlora_over_lora", "qlora_over_lora_peak", "lora_over_full"] {
        assert!(positive(&f[ratio]), "finetune: {ratio} is not a positive number: {text}");
    }
    std::fs::remove_dir_all(&out).unwrap();
    std::fs::remove_dir_all(&work).unwrap();
}
