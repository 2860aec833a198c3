//! Multi-process runs on the production path, in CI without a GPU: `pretrain_llama --device cuda`
//! on the CUDA emulator (`FERROLM_CUDA_EMULATOR=1`), one process per rank, meeting at rank 0's
//! rendezvous store and talking through `NcclComm` over the emulated NCCL (init, split, the
//! watchdog, sharded checkpoints): only the NCCL library and the kernels' hardware are emulated.
//!
//! - Equivalence: `--dtype f32` losses within 1e-4 relative of the same layout on CPU thread
//!   ranks over 6 steps, for 2 processes `--tp 2`, 4 processes `--tp 2 --dp 2 --zero 3` as two
//!   simulated nodes (two launches, `--nnodes 2`, one master port) and 2 processes `--dp 2
//!   --offload-optimizer`; checkpoints cross-resume between processes and thread ranks.
//! - Fault drills: a rank SIGKILLed mid-step, a rank returning an error (a bad shard on that rank
//!   only), a rank that never arrives, rank 0 busy before the first collective, an output
//!   directory that is not shared. Every process must exit non-zero within [`bound`] of the fault
//!   (60 s, `FERROLM_DRILL_BOUND_S` overrides it), none is left behind, the first error names
//!   the rank and what it was doing, and the newest complete checkpoint still loads.
//!
//! The ranks are this test binary run again (`rank_process` below, with `FERROLM_MP_ARGS` set),
//! so the tests need no separately built example.
mod common;
use common::*;
use ferrolm_parallel::launcher::LocalLaunch;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const ARGS_VAR: &str = "FERROLM_MP_ARGS";
const STEPS: usize = 6;

/// The entry point of the rank processes: `pretrain_llama` with the flags in `FERROLM_MP_ARGS`
/// (a JSON list), exiting with its status. In an ordinary test run it returns at once. Its last
/// line (in the rank's log) says how many offloaded gradient parts were copied behind their
/// collective's event ([`CHAINED`]).
#[test]
fn rank_process() {
    let Ok(a) = std::env::var(ARGS_VAR) else { return };
    let args: Vec<String> = serde_json::from_str(&a).expect("FERROLM_MP_ARGS is a JSON list of strings");
    let code = ferrolm::cli::run_tool(args, ferrolm::cli::pretrain::run);
    println!("{CHAINED}{}", ferrolm_parallel::offload::grad_copies_behind_events());
    std::process::exit(code);
}

const CHAINED: &str = "rank_process: offloaded gradient parts copied behind their collective's event: ";

/// Per rank log of the run `out`: the count of `rank_process`'s last line, and the CPU subgroups
/// from the offload report ("..., N subgroups, M of them updated on the device: ...") where the
/// rank prints it (rank 0).
fn chained_copies(s: &Setup, out: &str) -> Vec<(u64, Option<u64>)> {
    let mut logs: Vec<_> = std::fs::read_dir(s.dir.join(format!("{out}.logs"))).unwrap().map(|e| e.unwrap().path()).collect();
    logs.sort();
    logs.iter()
        .map(|p| {
            let text = std::fs::read_to_string(p).unwrap();
            let count = text.lines().rev().find_map(|l| l.strip_prefix(CHAINED));
            let count = count.unwrap_or_else(|| panic!("{}: no count of chained copies\n{text}", p.display()));
            let cpu = text.lines().find_map(|l| l.split_once(" in host memory, ")).map(|(_, report)| {
                let words: Vec<&str> = report.split([' ', ',']).filter(|w| !w.is_empty()).collect();
                words[0].parse::<u64>().unwrap() - words[2].parse::<u64>().unwrap()
            });
            (count.trim().parse().unwrap(), cpu)
        })
        .collect()
}

fn self_args() -> Vec<String> {
    ["--exact", "rank_process", "--nocapture", "--test-threads=1"].map(String::from).to_vec()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// How long every process may take to exit after a fault.
fn bound() -> Duration {
    Duration::from_secs_f64(std::env::var("FERROLM_DRILL_BOUND_S").ok().and_then(|v| v.parse().ok()).unwrap_or(60.0))
}

/// A prepared data set and a config with 4 heads / 2 kv heads.
type Setup = ParallelDir;

/// A small validation split: the tool evaluates all of it at the end of every run.
const VAL_FRACTION: f64 = 0.01;

impl Setup {
    /// `pretrain_llama` flags for a run into `out` on `device`.
    fn args(&self, device: &str, out: &str, extra: &[&str]) -> Vec<String> {
        let out = self.dir.join(out);
        let base = [
            "pretrain_llama",
            "--device",
            device,
            "--dtype=f32",
            "--data",
            self.data.to_str().unwrap(),
            "--config",
            self.cfg.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--seq-len=16",
            "--batch-size=2",
            "--eval-every=0",
            "--lr=3e-3",
        ];
        let save = Some("--save-every=3").filter(|_| !extra.iter().any(|a| a.starts_with("--save-every")));
        base.iter().chain(extra).chain(save.as_ref()).map(|s| s.to_string()).collect()
    }

    /// The run on CPU thread ranks, in this process.
    fn threads(&self, out: &str, extra: &[&str]) -> Vec<f64> {
        let code = ferrolm::cli::run_tool(self.args("cpu", out, extra), ferrolm::cli::pretrain::run);
        assert_eq!(code, 0, "the thread-rank run {out} failed");
        losses(&self.dir.join(out))
    }

    /// One node's processes of the run into `out` (rank logs in `out.logs/`), with `env` added.
    #[allow(clippy::too_many_arguments)]
    fn node(
        &self,
        out: &str,
        extra: &[&str],
        nproc: usize,
        nnodes: usize,
        node_rank: usize,
        port: u16,
        env: &[(&str, &str)],
    ) -> LocalLaunch {
        let logs = self.dir.join(format!("{out}.logs"));
        std::fs::create_dir_all(&logs).unwrap();
        let mut l = LocalLaunch::one_node(std::env::current_exe().unwrap(), self_args(), nproc, port);
        l.nnodes = nnodes;
        l.node_rank = node_rank;
        l.log_dir = Some(logs);
        l.env = rank_env(&self.args("cuda", out, extra));
        l.env.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        l
    }

    /// The run as processes through the launcher: `nnodes` launches of `nproc` ranks each.
    fn processes(&self, out: &str, extra: &[&str], nproc: usize, nnodes: usize) -> Vec<f64> {
        self.processes_with(out, extra, nproc, nnodes, &[])
    }

    /// The run on thread ranks ("threads") and on `nproc` processes over `nnodes` simulated
    /// nodes ("procs"), whose losses must agree within 1e-4: (processes' losses, threads').
    fn processes_follow_threads(&self, flags: &[&str], nproc: usize, nnodes: usize) -> (Vec<f64>, Vec<f64>) {
        let threads = self.threads("threads", flags);
        let procs = self.processes("procs", flags, nproc, nnodes);
        close(&procs, &threads, 1e-4, &format!("{nproc} processes on {nnodes} node(s), {} vs thread ranks", flags.join(" ")));
        (procs, threads)
    }

    /// As `processes`, with more environment for the ranks.
    fn processes_with(&self, out: &str, extra: &[&str], nproc: usize, nnodes: usize, env: &[(&str, &str)]) -> Vec<f64> {
        let port = free_port();
        let nodes: Vec<LocalLaunch> = (0..nnodes).map(|i| self.node(out, extra, nproc, nnodes, i, port, env)).collect();
        let running: Vec<_> = nodes.iter().map(|n| n.spawn().unwrap()).collect();
        let results: Vec<_> = running.into_iter().map(|r| r.wait()).collect();
        for (i, r) in results.iter().enumerate() {
            assert!(r.is_ok(), "node {i} of {out}: {:?}\n{}", r.as_ref().err(), self.logs(out));
        }
        losses(&self.dir.join(out))
    }

    fn logs(&self, out: &str) -> String {
        let mut text = String::new();
        let Ok(rd) = std::fs::read_dir(self.dir.join(format!("{out}.logs"))) else { return text };
        let mut files: Vec<_> = rd.filter_map(|e| Some(e.ok()?.path())).collect();
        files.sort();
        for f in files {
            text += &format!("--- {}\n{}\n", f.display(), std::fs::read_to_string(&f).unwrap_or_default());
        }
        text
    }
}

/// The environment of a rank process: the emulated device, bounded waits, the tool's flags.
fn rank_env(args: &[String]) -> Vec<(String, String)> {
    vec![
        (ARGS_VAR.into(), serde_json::to_string(args).unwrap()),
        ("FERROLM_CUDA_EMULATOR".into(), "1".into()),
        ("NCCL_EMU_TIMEOUT".into(), "60".into()),
        ("FERROLM_COMM_TIMEOUT_S".into(), "60".into()),
        ("RUST_LOG".into(), "info".into()),
    ]
}

fn emulated() -> bool {
    let built = ferrolm_cuda::CudaBackend::emulated(0).is_ok() && ferrolm_parallel::nccl_lib::EMULATED_AVAILABLE;
    let why = "the CUDA emulator or the emulated NCCL was not built (no C++ compiler)";
    ferrolm_testing::gate::require(ferrolm_testing::Need::Emulator, if built { Ok(()) } else { Err(why) }).is_some()
}

#[test]
fn two_processes_tp2_follow_thread_ranks_and_checkpoints_cross_resume() {
    if !emulated() {
        return;
    }
    let s = Setup::new("mp-tp2", VAL_FRACTION);
    let steps = format!("--steps={STEPS}");
    let (procs, threads) = s.processes_follow_threads(&[&steps, "--tp=2"], 2, 1);
    assert!(procs[STEPS - 1] < procs[0], "does not learn: {procs:?}");
    // A checkpoint of the processes resumes on thread ranks, and the other way round.
    let ck = |run: &str| s.dir.join(run).join("checkpoints/step-000003").to_str().unwrap().to_string();
    let (from_procs, from_threads) = (ck("procs"), ck("threads"));
    let on_threads = s.threads("threads-from-procs", &[&steps, "--tp=2", "--resume", &from_procs]);
    close(&on_threads, &threads, 1e-4, "the processes' checkpoint resumed on thread ranks");
    let on_procs = s.processes("procs-from-threads", &[&steps, "--tp=2", "--resume", &from_threads], 2, 1);
    close(&on_procs, &threads, 1e-4, "the thread ranks' checkpoint resumed on processes");
}

#[test]
fn four_processes_on_two_simulated_nodes_tp2_dp2_zero3_follow_thread_ranks() {
    if !emulated() {
        return;
    }
    let s = Setup::new("mp-zero3", VAL_FRACTION);
    let flags = [format!("--steps={STEPS}"), "--tp=2".into(), "--dp=2".into(), "--zero=3".into()];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    s.processes_follow_threads(&flags, 2, 2);
}

/// ZeRO (2,2,4) on 4 processes: in the last micro-batch each bucket's gradient reduce-scatter
/// (over 2 ranks) feeds the optimizer-range reduce-scatter (over the other pair) still in flight,
/// which waits for it on its own communication stream. Race mode (a random delay before every
/// item of every emulated stream) gives the same bits as the ordered run, so that wait is there;
/// both follow thread ranks.
#[test]
fn four_processes_zero_224_chain_collectives_bitwise_in_race_mode() {
    if !emulated() {
        return;
    }
    let s = Setup::new("mp-224", VAL_FRACTION);
    let flags = ["--steps=4", "--dp=4", "--shard-params=2", "--shard-grads=2", "--shard-optim=4", "--grad-accum=2", "--save-every=0"];
    let (procs, _) = s.processes_follow_threads(&flags, 4, 1);
    let raced = s.processes_with("race", &flags, 4, 1, &[("FERROLM_EMU_RACE", "3")]);
    assert_eq!(raced, procs, "(2,2,4) in race mode (seed 3) vs the ordered run");
}

/// `--dp 2 --offload-optimizer` on 2 processes follows thread ranks. Here the reduced gradients
/// reach the offload as NCCL results in flight: each rank's log counts the parts copied behind
/// their collective's event (every CPU subgroup, every step), and race mode gives the same bits.
#[test]
fn two_processes_dp2_offload_follow_thread_ranks() {
    if !emulated() {
        return;
    }
    let s = Setup::new("mp-offload", VAL_FRACTION);
    let flags = [format!("--steps={STEPS}"), "--dp=2".into(), "--offload-optimizer".into()];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let (procs, _) = s.processes_follow_threads(&flags, 2, 1);
    // The reduced gradients reach the offload as NCCL results in flight, and leave for the host
    // behind their collectives' events: on every rank, every step's CPU subgroups. In race mode
    // (a random delay before every item of every emulated stream) the run gives the same bits.
    let chained = chained_copies(&s, "procs");
    println!("offloaded gradient parts copied behind events, per rank (count, CPU subgroups): {chained:?}");
    assert_eq!(chained.len(), 2);
    let Some(cpu) = chained[0].1 else { panic!("rank 0 printed no offload report") };
    assert!(cpu > 0 && chained[0].0 == STEPS as u64 * cpu, "rank 0: {chained:?}: every CPU subgroup of every step");
    assert!(chained[1].0 > 0 && chained[1].0.is_multiple_of(STEPS as u64), "rank 1: {chained:?}: the same parts every step");
    let raced = s.processes_with("race", &flags, 2, 1, &[("FERROLM_EMU_RACE", "5")]);
    assert_eq!(raced, procs, "dp 2 offload in race mode (seed 5) vs the ordered run");
}

// ---- fault drills ----

/// Rank processes started one by one (no launcher that would stop the others: the drills
/// check that the ranks stop themselves).
struct Ranks {
    children: Vec<Option<Child>>,
    logs: Vec<PathBuf>,
}

impl Ranks {
    /// Starts `ranks` of a `world`-process run on one node; `args(rank)` gives each its flags.
    fn start(s: &Setup, name: &str, world: usize, ranks: &[usize], env: &[(&str, &str)], args: impl Fn(usize) -> Vec<String>) -> Ranks {
        let port = free_port();
        let logs_dir = s.dir.join(format!("{name}.logs"));
        std::fs::create_dir_all(&logs_dir).unwrap();
        let l = LocalLaunch::one_node(std::env::current_exe().unwrap(), self_args(), world, port);
        let mut children = Vec::new();
        let mut logs = Vec::new();
        for r in 0..world {
            let log = logs_dir.join(format!("rank{r}.log"));
            if !ranks.contains(&r) {
                children.push(None);
                logs.push(log);
                continue;
            }
            let f = std::fs::File::create(&log).unwrap();
            let child = Command::new(&l.program)
                .args(&l.args)
                .envs(l.process_env(r))
                .envs(rank_env(&args(r)))
                .envs(env.iter().copied())
                .stdin(Stdio::null())
                .stdout(f.try_clone().unwrap())
                .stderr(f)
                .spawn()
                .unwrap();
            children.push(Some(child));
            logs.push(log);
        }
        Ranks { children, logs }
    }

    fn log(&self, rank: usize) -> String {
        std::fs::read_to_string(&self.logs[rank]).unwrap_or_default()
    }

    fn all_logs(&self) -> String {
        (0..self.logs.len()).map(|r| format!("--- rank {r}\n{}\n", self.log(r))).collect()
    }

    /// Waits until every started process has exited, at most `limit`: their exit codes (None:
    /// killed by a signal) and when the last one ended. Fails the test, killing what is left,
    /// if one is still running at the limit.
    fn wait_all(&mut self, limit: Duration) -> (Vec<Option<i32>>, Instant) {
        let t0 = Instant::now();
        let mut codes = vec![None; self.children.len()];
        let mut done: Vec<bool> = self.children.iter().map(Option::is_none).collect();
        loop {
            for (r, c) in self.children.iter_mut().enumerate() {
                if let (Some(c), false) = (c, done[r]) {
                    if let Some(st) = c.try_wait().unwrap() {
                        codes[r] = st.code();
                        done[r] = true;
                    }
                }
            }
            if done.iter().all(|&d| d) {
                return (codes, Instant::now());
            }
            if t0.elapsed() > limit {
                let still: Vec<usize> = (0..done.len()).filter(|&r| !done[r]).collect();
                self.kill_all();
                panic!("ranks {still:?} still running {:.0} s after the fault\n{}", limit.as_secs_f64(), self.all_logs());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill_all(&mut self) {
        for c in self.children.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// Every started process exited non-zero (or by a signal for one the test killed).
fn all_failed(codes: &[Option<i32>], started: &[usize], killed: Option<usize>, logs: &str) {
    for &r in started {
        if Some(r) == killed {
            assert_eq!(codes[r], None, "rank {r} was SIGKILLed\n{logs}");
        } else {
            assert!(codes[r].is_some_and(|c| c != 0), "rank {r} exited with {:?}, not an error\n{logs}", codes[r]);
        }
    }
}

/// The newest complete checkpoint of `run` loads.
fn newest_checkpoint_loads(run: &Path) -> PathBuf {
    let ck = ferrolm::train::resolve_checkpoint(run).unwrap();
    ferrolm::Llama::from_pretrained(&ck, ferrolm::DType::F32, ferrolm::Device::Cpu).unwrap();
    assert!(ck.join("trainer_state.json").is_file(), "{} is not complete", ck.display());
    ck
}

/// SIGKILLs `victim` of a 2-process run once a checkpoint exists and steps go on; the
/// survivor must stop by itself, naming itself and the collective it was in.
fn kill_drill(victim: usize) {
    if !emulated() {
        return;
    }
    let s = Setup::new(&format!("drill-kill{victim}"), VAL_FRACTION);
    let mut ranks = Ranks::start(&s, "kill", 2, &[0, 1], &[], |_| s.args("cuda", "run", &["--steps=200", "--dp=2", "--save-every=2"]));
    // Rank 0 logs each step to metrics.jsonl.
    let t0 = Instant::now();
    while losses(&s.dir.join("run")).len() < 3 {
        assert!(t0.elapsed() < Duration::from_secs(120), "no 3 steps in 120 s\n{}", ranks.all_logs());
        assert!(ranks.children[0].as_mut().unwrap().try_wait().unwrap().is_none(), "rank 0 ended early\n{}", ranks.all_logs());
        std::thread::sleep(Duration::from_millis(20));
    }
    let fault = Instant::now();
    ranks.children[victim].as_mut().unwrap().kill().unwrap();
    let (codes, end) = ranks.wait_all(bound());
    let logs = ranks.all_logs();
    all_failed(&codes, &[0, 1], Some(victim), &logs);
    eprintln!("all ranks ended {:.1} s after the SIGKILL of rank {victim}", (end - fault).as_secs_f64());
    let survivor = 1 - victim;
    let err = ranks.log(survivor);
    // ferrolm's own first error; the (emulated) library's `NCCL WARN` lines race with it and say
    // "error state" without naming a rank.
    let first = err
        .lines()
        .find(|l| !l.contains("NCCL WARN") && (l.contains("error") || l.contains("ferrolm-parallel:")))
        .unwrap_or_default()
        .to_string();
    eprintln!("rank {survivor}: {first}");
    assert!(first.contains(&format!("rank {survivor}")), "rank {survivor}'s first error does not name it: {first}\n{logs}");
    assert!(
        first.contains("training") || first.contains("all_reduce") || first.contains("all_gather") || first.contains("reduce_scatter"),
        "rank {survivor} does not say what it was doing\n{logs}"
    );
    newest_checkpoint_loads(&s.dir.join("run"));
}

#[test]
fn drill_a_rank_killed_mid_step_stops_every_process() {
    kill_drill(1);
}

/// Rank 0 also serves the store: its death must be noticed as well.
#[test]
fn drill_rank_0_killed_mid_step_stops_every_process() {
    kill_drill(0);
}

#[test]
fn drill_a_rank_returning_an_error_stops_every_process() {
    if !emulated() {
        return;
    }
    let s = Setup::new("drill-error", VAL_FRACTION);
    // Rank 1 alone reads a copy of the data whose training shard is damaged.
    let bad = s.dir.join("bad-data");
    std::fs::create_dir_all(&bad).unwrap();
    for e in std::fs::read_dir(&s.data).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, bad.join(p.file_name().unwrap())).unwrap();
    }
    let shard = std::fs::read_dir(&bad).unwrap().map(|e| e.unwrap().path()).find(|p| p.to_string_lossy().contains("train")).unwrap();
    // A valid header over token ids no vocabulary has: rank 1 fails in its first forward pass.
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[32..].fill(0xFF);
    std::fs::write(&shard, bytes).unwrap();
    let fault = Instant::now();
    let mut ranks = Ranks::start(&s, "error", 2, &[0, 1], &[], |r| {
        let mut a = s.args("cuda", "run", &["--steps=6", "--dp=2"]);
        if r == 1 {
            let i = a.iter().position(|x| x == "--data").unwrap();
            a[i + 1] = bad.to_str().unwrap().to_string();
        }
        a
    });
    let (codes, end) = ranks.wait_all(bound());
    let logs = ranks.all_logs();
    all_failed(&codes, &[0, 1], None, &logs);
    eprintln!("all ranks ended {:.1} s after the start", (end - fault).as_secs_f64());
    let first = ranks.log(1).lines().find(|l| l.starts_with("error:")).unwrap_or_default().to_string();
    eprintln!("rank 1: {first}");
    eprintln!("rank 0: {}", ranks.log(0).lines().find(|l| l.starts_with("error:") || l.contains("ferrolm-parallel:")).unwrap_or_default());
    assert!(first.contains("rank 1 of 2 failed while"), "rank 1's error does not name it and what it did: {first}\n{logs}");
    assert!(ranks.log(0).contains("rank 1 failed while"), "rank 0 does not say that rank 1 failed\n{logs}");
}

#[test]
fn drill_a_rank_that_never_arrives_stops_the_others_at_the_timeout() {
    if !emulated() {
        return;
    }
    let s = Setup::new("drill-absent", VAL_FRACTION);
    let mut ranks =
        Ranks::start(&s, "absent", 2, &[0], &[("FERROLM_COMM_TIMEOUT_S", "3")], |_| s.args("cuda", "run", &["--steps=6", "--dp=2"]));
    let t0 = Instant::now();
    let (codes, _) = ranks.wait_all(bound());
    let logs = ranks.all_logs();
    all_failed(&codes, &[0], None, &logs);
    assert!(t0.elapsed() < Duration::from_secs(3) + bound(), "{logs}");
    let err = ranks.log(0);
    assert!(err.contains("missing ranks: 1"), "rank 0 does not name the missing rank\n{logs}");
}

#[test]
fn drill_rank_0_busy_before_the_first_collective_waits_behind_the_prepare_barrier() {
    if !emulated() {
        return;
    }
    let s = Setup::new("drill-busy", VAL_FRACTION);
    // Busier than the collective timeout: the others wait at the store barrier, and the run goes on.
    let env = [("FERROLM_COMM_TIMEOUT_S", "4"), ("FERROLM_DRILL_PREPARE_DELAY_S", "6")];
    let mut ranks = Ranks::start(&s, "busy", 2, &[0, 1], &env, |_| s.args("cuda", "ok", &["--steps=2", "--dp=2"]));
    let (codes, _) = ranks.wait_all(bound() + Duration::from_secs(30));
    let logs = ranks.all_logs();
    assert_eq!(codes, vec![Some(0), Some(0)], "{logs}");
    assert_eq!(losses(&s.dir.join("ok")).len(), 2, "{logs}");
    // Busier than the preparation timeout: every rank stops, saying why.
    let env = [("FERROLM_PREPARE_TIMEOUT", "2"), ("FERROLM_DRILL_PREPARE_DELAY_S", "8")];
    let mut ranks = Ranks::start(&s, "late", 2, &[0, 1], &env, |_| s.args("cuda", "late", &["--steps=2", "--dp=2"]));
    let t0 = Instant::now();
    let (codes, _) = ranks.wait_all(bound() + Duration::from_secs(30));
    let logs = ranks.all_logs();
    all_failed(&codes, &[0, 1], None, &logs);
    assert!(ranks.log(1).contains("waiting for rank 0 to prepare the run"), "{logs}");
    assert!(ranks.log(0).contains("rank 1 failed while waiting for rank 0 to prepare the run"), "{logs}");
    eprintln!("ranks ended {:.1} s after the start (rank 0 busy 8 s, timeout 2 s)", t0.elapsed().as_secs_f64());
}

#[test]
fn drill_an_output_directory_that_is_not_shared_is_refused_at_start_up() {
    if !emulated() {
        return;
    }
    let s = Setup::new("drill-shared", VAL_FRACTION);
    let port = free_port();
    // Two simulated nodes, each given its own --out: as two hosts with local disks.
    let nodes: Vec<LocalLaunch> = (0..2).map(|i| s.node(&format!("node{i}"), &["--steps=6", "--dp=2"], 1, 2, i, port, &[])).collect();
    let t0 = Instant::now();
    let running: Vec<_> = nodes.iter().map(|n| n.spawn().unwrap()).collect();
    let results: Vec<_> = running.into_iter().map(|r| r.wait()).collect();
    let logs = s.logs("node0") + &s.logs("node1");
    assert!(results.iter().all(|r| r.is_err()), "{logs}");
    assert!(t0.elapsed() < bound(), "{logs}");
    assert!(s.logs("node1").contains("not shared with rank 0"), "{logs}");
    assert!(s.logs("node0").contains("not shared"), "{logs}");
    // Nothing was trained into either directory.
    assert!(losses(&s.dir.join("node0")).is_empty(), "{logs}");
}

// ---- torchrun, where it is installed ----

/// torchrun: FERROLM_TORCHRUN, the workspace's .venv, or on PATH.
fn torchrun() -> Option<PathBuf> {
    ferrolm_testing::tools::torchrun(&root())
}

#[test]
fn torchrun_starts_ranks_that_train_like_thread_ranks() {
    if !emulated() {
        return;
    }
    let Some(torchrun) = torchrun() else {
        eprintln!(
            "skipped: torchrun is not installed (FERROLM_TORCHRUN, .venv/bin/torchrun or PATH): the torchrun training runs did not run"
        );
        return;
    };
    let s = Setup::new("mp-torchrun", VAL_FRACTION);
    let steps = format!("--steps={STEPS}");
    let exe = std::env::current_exe().unwrap();
    let run = |out: &str, extra: &[&str], invocations: Vec<Vec<String>>| -> Vec<f64> {
        let env = rank_env(&s.args("cuda", out, extra));
        let children: Vec<(usize, Child)> = invocations
            .into_iter()
            .enumerate()
            .map(|(i, launcher)| {
                let log = std::fs::File::create(s.dir.join(format!("{out}-torchrun{i}.log"))).unwrap();
                let child = Command::new(&torchrun)
                    .args(launcher)
                    .arg("--no-python")
                    .arg(&exe)
                    .args(self_args())
                    .envs(env.iter().map(|(k, v)| (k, v)))
                    .stdin(Stdio::null())
                    .stdout(log.try_clone().unwrap())
                    .stderr(log)
                    .spawn()
                    .unwrap();
                (i, child)
            })
            .collect();
        for (i, mut c) in children {
            let st = c.wait().unwrap();
            let log = std::fs::read_to_string(s.dir.join(format!("{out}-torchrun{i}.log"))).unwrap_or_default();
            assert!(st.success(), "torchrun {i} of {out}: {st}\n{log}");
        }
        losses(&s.dir.join(out))
    };
    let a = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    // c10d rendezvous on one node: 2 processes --tp 2.
    let threads = s.threads("threads-tp2", &[&steps, "--tp=2"]);
    let procs = run("standalone-tp2", &[&steps, "--tp=2"], vec![a(&["--standalone", "--nproc-per-node", "2"])]);
    close(&procs, &threads, 1e-4, "torchrun --standalone, --tp 2 vs thread ranks");
    // Static rendezvous, two simulated nodes of one process: --dp 2.
    let threads = s.threads("threads-dp2", &[&steps, "--dp=2"]);
    let port = free_port().to_string();
    let node =
        |i: &str| a(&["--nnodes", "2", "--node-rank", i, "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", &port]);
    let procs = run("static-dp2", &[&steps, "--dp=2"], vec![node("0"), node("1")]);
    close(&procs, &threads, 1e-4, "torchrun static 2 nodes, --dp 2 vs thread ranks");
}

#[test]
fn srun_variables_set_by_hand_start_a_run() {
    if !emulated() {
        return;
    }
    let s = Setup::new("mp-srun", VAL_FRACTION);
    let steps = "--steps=2";
    let port = free_port().to_string();
    // What srun exports for `srun --nodes 1 --ntasks 2` on host "localhost": no RANK, no
    // MASTER_ADDR (the first host of the node list is the master).
    let children: Vec<Child> = (0..2)
        .map(|r| {
            let log = std::fs::File::create(s.dir.join(format!("srun{r}.log"))).unwrap();
            let r = r.to_string();
            let slurm = [
                ("SLURM_PROCID", r.as_str()),
                ("SLURM_LOCALID", r.as_str()),
                ("SLURM_NTASKS", "2"),
                ("SLURM_NODEID", "0"),
                ("SLURM_TASKS_PER_NODE", "2"),
                ("SLURM_JOB_NODELIST", "localhost"),
                ("MASTER_PORT", port.as_str()),
            ];
            Command::new(std::env::current_exe().unwrap())
                .args(self_args())
                .envs(rank_env(&s.args("cuda", "run", &[steps, "--dp=2"])))
                .envs(slurm)
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .unwrap()
        })
        .collect();
    for (r, mut c) in children.into_iter().enumerate() {
        let st = c.wait().unwrap();
        let log = std::fs::read_to_string(s.dir.join(format!("srun{r}.log"))).unwrap_or_default();
        assert!(st.success(), "srun rank {r}: {st}\n{log}");
    }
    assert_eq!(losses(&s.dir.join("run")).len(), 2);
}

#[test]
fn drill_a_rank_whose_collectives_disagree_stops_every_process() {
    if !emulated() {
        return;
    }
    let s = Setup::new("drill-mismatch", VAL_FRACTION);
    // Rank 1 alone builds a wider MLP: its gradient all-reduces disagree with rank 0's in size,
    // which the NCCL layer detects and reports on every rank.
    let wide = s.dir.join("wide.json");
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&s.cfg).unwrap()).unwrap();
    c["intermediate_size"] = serde_json::json!(96);
    std::fs::write(&wide, c.to_string()).unwrap();
    let t0 = Instant::now();
    let mut ranks = Ranks::start(&s, "mismatch", 2, &[0, 1], &[], |r| {
        let mut a = s.args("cuda", "run", &["--steps=6", "--dp=2"]);
        if r == 1 {
            let i = a.iter().position(|x| x == "--config").unwrap();
            a[i + 1] = wide.to_str().unwrap().to_string();
        }
        a
    });
    let (codes, end) = ranks.wait_all(bound());
    let logs = ranks.all_logs();
    all_failed(&codes, &[0, 1], None, &logs);
    eprintln!("all ranks ended {:.1} s after the start", (end - t0).as_secs_f64());
    for r in 0..2 {
        // The main thread's error, or a watchdog's that saw a failure notice first (this rank's or
        // the other's, whichever was posted first) and ended the process.
        let first =
            ranks.log(r).lines().find(|l| l.starts_with("error:") || l.starts_with("ferrolm-parallel:")).unwrap_or_default().to_string();
        eprintln!("rank {r}: {first}");
        assert!(
            // The collective it names is the one NCCL's asynchronous error interrupted: the
            // mismatched #1, or a later one a rank had already queued behind it on its stream
            // (the NCCL WARN line names the two mismatched calls exactly).
            first.contains(&format!("rank {r} ")) && first.contains("all_reduce(sum) #") && first.contains("invalid usage"),
            "rank {r}'s first error does not name it and its collective: {first}\n{logs}"
        );
    }
    let warn = logs.lines().find(|l| l.contains("NCCL WARN")).unwrap_or_default().to_string();
    eprintln!("{warn}");
    assert!(warn.contains("rank 0 called") && warn.contains("rank 1 called"), "the mismatch is not described\n{logs}");
}
