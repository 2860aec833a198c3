//! `scripts/gpu_attention_counters.sh` without a GPU: its help, its refusal of bad arguments, the
//! skip when there is no Nsight Compute, and, with a stand-in `ncu` that writes a canned raw
//! page, the whole run: six launches asked for by kernel name and shape, their counters kept in
//! `attention_ncu.csv`, and `attention_ncu.md` read from them (a launch that gives no counters is
//! a failed row and exit 1; a launch that refuses the named metrics is rerun without them).
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

#[path = "common/scripts.rs"]
mod scripts;

const KERNELS: [&str; 6] = [
    "flash_fwd_bf16_d128",
    "flash_bwd_dkdv_bf16_d128",
    "flash_bwd_dq_bf16_d128",
    "flash_fwd_bf16_d64",
    "flash_bwd_dkdv_bf16_d64",
    "flash_bwd_dq_bf16_d64",
];

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gpu_attention_counters.sh")
}

fn run(args: &[&str], out: &Path, env: &[(&str, &Path)]) -> Output {
    let mut c = Command::new("bash");
    c.arg(script()).args(args).env("OUT", out).env_remove("FERROLM_REQUIRE_GPU").env("NCU", "/nonexistent/ncu");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("bash runs")
}

fn scratch(name: &str) -> PathBuf {
    scripts::scratch("attention-counters", name)
}

/// A stand-in `ncu`: logs its arguments, and writes a raw page (header, units, one launch) for
/// the kernel its `-k regex:^NAME$` names to its `--log-file`. `mode`: `ok`; `no-metrics`
/// (fails whenever --metrics is given); `no-dq64` (writes nothing for flash_bwd_dq_bf16_d64);
/// `stdout` (prints the page among the program's output instead of to the log file).
fn fake_ncu(dir: &Path, mode: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let bin = dir.join("bench_cuda");
    std::fs::write(&bin, "#!/bin/sh\nexit 0\n").unwrap();
    let ncu = dir.join("ncu");
    let text = format!(
        r#"#!/usr/bin/env bash
echo "$*" >>"{log}"
log=""; k=""; metrics=0
while [ $# -gt 0 ]; do
    case "$1" in
        --log-file) log=$2; shift ;;
        -k) k=${{2#regex:^}}; k=${{k%$}}; shift ;;
        --metrics) metrics=1 ;;
    esac
    shift
done
[ "{mode}" = no-metrics ] && [ $metrics = 1 ] && {{ echo "==ERROR== Failed to find metric" >&2; exit 1; }}
[ "{mode}" = no-dq64 ] && [ "$k" = flash_bwd_dq_bf16_d64 ] && exit 1
{{
    echo "==PROF== Connected to process 1"
    echo '"ID","Kernel Name","gpu__time_duration.sum","launch__registers_per_thread","sm__warps_active.avg.pct_of_peak_sustained_active","sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active","l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum","l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum","smsp__inst_executed_op_ldsm.sum","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio","smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio"'
    echo '"","","nsecond","register/thread","%","%","","","inst","ratio","ratio","ratio","ratio","ratio"'
    echo "\"0\",\"$k(...)\",\"1,234,500\",\"199\",\"12.34\",\"45.6\",\"1,024\",\"0\",\"36,864\",\"0.50\",\"2.25\",\"1.75\",\"0.25\",\"9.0\""
}} >"$log.page"
if [ "{mode}" = stdout ]; then echo "bench table"; cat "$log.page"; rm -f "$log.page"; else mv "$log.page" "$log"; fi
"#,
        log = dir.join("calls.log").display()
    );
    std::fs::write(&ncu, text).unwrap();
    for f in [&ncu, &bin] {
        Command::new("chmod").arg("+x").arg(f).status().unwrap();
    }
    ncu
}

#[test]
fn help_names_every_kernel_and_output() {
    let out = scratch("help");
    let o = run(&["--help"], &out, &[]);
    assert!(o.status.success(), "--help failed: {}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    for s in ["--shape", "--help", "OUT", "NCU", "attention_ncu.csv", "attention_ncu.md", "--launch-count 1", "flash_fwd_bf16_d128"] {
        assert!(text.contains(s), "--help does not mention {s}");
    }
    assert!(!out.exists(), "--help must not write anything");
}

#[test]
fn bad_arguments_are_refused_by_name() {
    let out = scratch("bad");
    scripts::assert_refused("gpu_attention_counters.sh", |a| run(a, &out, &[]), &out.join("attention_ncu.md"));
}

#[test]
fn no_ncu_is_a_skip_unless_a_gpu_is_required() {
    let out = scratch("skip");
    let o = run(&[], &out, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("skipped: no Nsight Compute"), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!out.join("attention_ncu.md").exists());
    let o = Command::new("bash")
        .arg(script())
        .env("OUT", &out)
        .env("NCU", "/nonexistent/ncu")
        .env("FERROLM_REQUIRE_GPU", "1")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "FERROLM_REQUIRE_GPU=1 makes a missing ncu an error");
    let o = Command::new("bash").arg(script()).env("OUT", &out).env("AC_BUDGET_S", "soon").output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("AC_BUDGET_S"), "{}", String::from_utf8_lossy(&o.stderr));
}

fn summary_rows(md: &str) -> Vec<Vec<String>> {
    md.lines().filter(|l| l.starts_with("| flash_")).map(|l| l.split('|').map(|c| c.trim().to_string()).collect()).collect()
}

/// One run of the script against the stand-in `ncu` in `mode`: its output, its report, and the
/// folders, removed when it is dropped.
struct FakeRun {
    o: Output,
    md: String,
    out: PathBuf,
    tools: PathBuf,
}

impl FakeRun {
    fn new(name: &str, mode: &str, args: &[&str], budget: Option<&str>) -> FakeRun {
        let (out, tools) = (scratch(name), scratch(&format!("{name}-tools")));
        let ncu = fake_ncu(&tools, mode);
        let budget = budget.map(PathBuf::from);
        let mut env = vec![("NCU", ncu.as_path()), ("FERROLM_BIN_DIR", tools.as_path())];
        env.extend(budget.as_deref().map(|b| ("AC_BUDGET_S", b)));
        let o = run(args, &out, &env);
        let md = std::fs::read_to_string(out.join("attention_ncu.md")).unwrap_or_default();
        FakeRun { o, md, out, tools }
    }
    fn calls(&self) -> String {
        std::fs::read_to_string(self.tools.join("calls.log")).unwrap_or_default()
    }
    fn ok(&self) -> &Self {
        assert!(self.o.status.success(), "{}", String::from_utf8_lossy(&self.o.stderr));
        self
    }
}

impl Drop for FakeRun {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.out);
        let _ = std::fs::remove_dir_all(&self.tools);
    }
}

#[test]
fn six_launches_are_profiled_and_summarised() {
    let r = FakeRun::new("run", "ok", &["--shape", "2,8,4,512"], None);
    let calls = r.ok().calls();
    for k in KERNELS {
        let d = &k[k.len() - 3..].trim_start_matches('d');
        let call = calls.lines().find(|l| l.contains(&format!("regex:^{k}$"))).unwrap_or_else(|| panic!("{k} not profiled:\n{calls}"));
        assert!(call.contains("--launch-count 1") && call.contains("--set full"), "{call}");
        assert!(call.contains(&format!("--attention 2,8,4,512,{d}")), "{k}: {call}");
    }
    let csv = std::fs::read_to_string(r.out.join("attention_ncu.csv")).unwrap();
    assert_eq!(csv.matches("\"Kernel Name\"").count(), 6, "{csv}");
    assert!(!csv.contains("==PROF=="), "ncu's own lines are not counters");
    let md = &r.md;
    let rows = summary_rows(md);
    assert_eq!(rows.iter().map(|r| r[1].as_str()).collect::<Vec<_>>(), KERNELS, "{md}");
    for r in &rows {
        // 1,234,500 ns; 199 registers; 12.34 % occupancy; 45.6 % HMMA; conflicts 1,024 / 0; LDSM.
        assert_eq!(&r[2..8], ["1,234.5", "199", "12.3", "45.6", "1,024 / 0", "36,864"], "{md}");
        assert_eq!(r[8], "long_scoreboard 2.25, mio_throttle 1.75, barrier 0.50", "stalls largest first, not_selected left out: {md}");
    }
    let mut files: Vec<_> = std::fs::read_dir(&r.out).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    files.sort();
    assert_eq!(files, ["attention_ncu.csv", "attention_ncu.md"], "two files: the device tool brings back 8 in all");
}

#[test]
fn a_page_printed_among_the_programs_output_is_read_from_there() {
    let r = FakeRun::new("stdout", "stdout", &[], None);
    r.ok();
    assert!(summary_rows(&r.md).iter().all(|row| row[3] == "199"), "{}", r.md);
    assert!(!std::fs::read_to_string(r.out.join("attention_ncu.csv")).unwrap().contains("bench table"));
}

#[test]
fn a_launch_without_counters_fails_its_row_and_named_metrics_are_optional() {
    let r = FakeRun::new("partial", "no-dq64", &[], None);
    assert_eq!(r.o.status.code(), Some(1), "a kernel without counters fails the run");
    let rows = summary_rows(&r.md);
    assert_eq!(rows.len(), 6, "{}", r.md);
    assert_eq!(rows[5][2], "**no counters**", "{}", r.md);
    assert_eq!(rows[0][3], "199", "{}", r.md);
    assert!(r.md.contains("## flash_bwd_dq_bf16_d64: no counters"), "the failed launch's log follows the table:\n{}", r.md);

    // A spent budget: no launch runs, every row fails, and the reason is in the report.
    let r = FakeRun::new("budget", "ok", &[], Some("0"));
    assert_eq!(r.o.status.code(), Some(1));
    assert_eq!(summary_rows(&r.md).iter().filter(|row| row[2] == "**no counters**").count(), 6, "{}", r.md);
    assert!(r.md.contains("budget of 0s spent") && r.calls().is_empty(), "{}", r.md);

    let r = FakeRun::new("nometrics", "no-metrics", &[], None);
    let calls = r.ok().calls();
    assert_eq!(calls.lines().filter(|l| l.contains("--metrics")).count(), 6, "{calls}");
    assert_eq!(calls.lines().filter(|l| !l.contains("--metrics")).count(), 6, "each launch again without --metrics:\n{calls}");
    assert_eq!(summary_rows(&r.md).len(), 6);
}
