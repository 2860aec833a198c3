//! Real processes meeting through the rendezvous store: this test binary re-runs itself as the
//! ranks (`peer_process` below), started by the `launch` logic (`LocalLaunch`, also as two
//! simulated nodes), by hand with an agent's store (a test server playing torchrun's agent), and
//! by torchrun itself where it is installed. Also against PyTorch's own TCPStore where Python
//! with torch is installed; those tests say once on stderr that they skipped otherwise.
use ferrolm_parallel::launcher::LocalLaunch;
use ferrolm_parallel::store::{Store, StoreServer};
use ferrolm_parallel::tcpstore::TcpStoreClient;
use ferrolm_parallel::DistEnv;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const PEER_DIR: &str = "FERROLM_STORE_PEER_DIR";
const PEER_MODE: &str = "FERROLM_STORE_PEER_MODE";

/// The entry point of the child processes the tests below start (this binary run with
/// `--exact peer_process`, `FERROLM_STORE_PEER_DIR` set): joins the world its environment
/// describes, exchanges a value with every rank, meets them at a barrier and writes what it saw
/// to `rank{R}-{pid}.json`. In an ordinary test run (no such variable) it returns at once.
#[test]
fn peer_process() {
    let Ok(dir) = std::env::var(PEER_DIR) else { return };
    std::process::exit(run_peer(Path::new(&dir)));
}

fn run_peer(dir: &Path) -> i32 {
    let env = match DistEnv::from_env() {
        Ok(Some(e)) => e,
        Ok(None) => {
            eprintln!("peer error: no launcher environment");
            return 2;
        }
        Err(e) => {
            eprintln!("peer error: {e}");
            return 2;
        }
    };
    let store = match Store::rendezvous(&env, Duration::from_secs(30)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("peer error: {e}");
            return 3;
        }
    };
    if std::env::var(PEER_MODE).as_deref() == Ok("fail-rank-1") && env.rank == 1 {
        let _ = store.report_failure("a bad shard on rank 1 only");
        eprintln!("peer error: rank 1 fails on purpose");
        return 4;
    }
    let exchange = || -> ferrolm_tensor::Result<Vec<String>> {
        store.set(&format!("value/{}", env.rank), format!("{}x{}", env.rank, env.rank * 7).as_bytes())?;
        let values =
            (0..env.world_size).map(|p| store.get(&format!("value/{p}")).map(|v| String::from_utf8_lossy(&v).into_owned())).collect();
        store.barrier("done")?;
        values
    };
    match exchange() {
        Ok(values) => {
            let out = json!({
                "rank": env.rank, "world": env.world_size, "local_rank": env.local_rank,
                "local_world_size": env.local_world_size, "node_rank": env.node_rank,
                "host": format!("{:?}", store.host()), "is_server": store.is_server(),
                "prefix": store.prefix(), "launcher": format!("{:?}", env.launcher), "values": values,
            });
            let path = dir.join(format!("rank{}-{}.json", env.rank, std::process::id()));
            std::fs::write(&path, out.to_string()).map(|()| 0).unwrap_or_else(|e| {
                eprintln!("peer error: {}: {e}", path.display());
                6
            })
        }
        Err(e) => {
            eprintln!("peer error: {e}");
            5
        }
    }
}

fn peer_args() -> Vec<String> {
    ["--exact", "peer_process", "--nocapture", "--test-threads", "1"].map(String::from).to_vec()
}

/// A fresh directory for one test's peers.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferrolm-store-mp-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The peers' reports, by rank.
fn results(dir: &Path) -> Vec<Value> {
    let mut v: Vec<Value> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .map(|p| serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap())
        .collect();
    v.sort_by_key(|r| r["rank"].as_u64());
    v
}

/// Each of `names`.log in `dir` says `what`.
fn each_log_says(dir: &Path, names: &[&str], what: &str) {
    for name in names {
        let log = std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap();
        assert!(log.contains(what), "{name}:\n{log}");
    }
}

/// Every log under `dir`, for failure messages.
fn logs(dir: &Path) -> String {
    let mut out = String::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if e.path().extension().is_some_and(|x| x == "log") {
            out += &format!("--- {}\n{}\n", e.path().display(), std::fs::read_to_string(e.path()).unwrap_or_default());
        }
    }
    out
}

fn check_world(dir: &Path, world: usize) -> Vec<Value> {
    let r = results(dir);
    assert_eq!(r.len(), world, "{} reports; logs:\n{}", r.len(), logs(dir));
    let want: Vec<String> = (0..world).map(|p| format!("{p}x{}", p * 7)).collect();
    for (i, x) in r.iter().enumerate() {
        assert_eq!(x["rank"], json!(i));
        assert_eq!(x["world"], json!(world));
        assert_eq!(x["values"], json!(want), "rank {i} read other values");
    }
    r
}

/// The peer process with `vars`, output to `{dir}/{name}.log`.
fn spawn_peer(dir: &Path, name: &str, vars: &[(&str, String)]) -> Child {
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(peer_args()).env(PEER_DIR, dir).stdout(log.try_clone().unwrap()).stderr(log);
    for v in ["TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"] {
        cmd.env_remove(v);
    }
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd.spawn().unwrap()
}

/// Waits for a child, killing it after `limit`.
fn wait_for(mut c: Child, limit: Duration) -> Option<i32> {
    let t0 = Instant::now();
    loop {
        if let Some(s) = c.try_wait().unwrap() {
            return s.code();
        }
        if t0.elapsed() > limit {
            let _ = c.kill();
            let _ = c.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn rank_vars(rank: usize, world: usize, port: u16) -> Vec<(&'static str, String)> {
    vec![
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", port.to_string()),
    ]
}

#[test]
fn four_processes_as_two_simulated_nodes_meet_through_rank_0s_store() {
    let dir = scratch("two-nodes");
    let port = free_port();
    let node = |node_rank| LocalLaunch {
        nnodes: 2,
        node_rank,
        env: vec![(PEER_DIR.into(), dir.display().to_string())],
        log_dir: Some(dir.clone()),
        ..LocalLaunch::one_node(std::env::current_exe().unwrap(), peer_args(), 2, port)
    };
    let t0 = Instant::now();
    let (a, b) = std::thread::scope(|s| {
        // The second node starts first: its ranks wait for global rank 0's store.
        let b = s.spawn(|| node(1).run());
        std::thread::sleep(Duration::from_millis(200));
        let a = s.spawn(|| node(0).run());
        (a.join().unwrap(), b.join().unwrap())
    });
    assert!(a.is_ok() && b.is_ok(), "{a:?} {b:?}\n{}", logs(&dir));
    let r = check_world(&dir, 4);
    let col = |k: &str| r.iter().map(|x| x[k].clone()).collect::<Vec<_>>();
    assert_eq!(col("node_rank"), [json!(0), json!(0), json!(1), json!(1)]);
    assert_eq!(col("local_rank"), [json!(0), json!(1), json!(0), json!(1)]);
    assert_eq!(col("local_world_size"), vec![json!(2); 4]);
    assert_eq!(col("is_server"), [json!(true), json!(false), json!(false), json!(false)], "global rank 0 serves");
    assert_eq!(col("host"), vec![json!("Rank0"); 4]);
    eprintln!("4 processes on 2 simulated nodes met in {:.2} s", t0.elapsed().as_secs_f64());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn children_of_an_agent_join_its_store_as_clients() {
    let dir = scratch("agent");
    // This test plays torchrun's agent: it serves the store on MASTER_PORT.
    let agent = StoreServer::bind("127.0.0.1:0").unwrap();
    let port = agent.addr().port();
    let peers: Vec<Child> = (0..3)
        .map(|r| {
            let mut v = rank_vars(r, 3, port);
            v.push(("TORCHELASTIC_USE_AGENT_STORE", "True".into()));
            v.push(("TORCHELASTIC_RESTART_COUNT", "1".into()));
            v.push(("GROUP_RANK", "0".into()));
            spawn_peer(&dir, &format!("rank{r}"), &v)
        })
        .collect();
    let codes: Vec<_> = peers.into_iter().map(|c| wait_for(c, Duration::from_secs(60))).collect();
    assert_eq!(codes, [Some(0); 3], "{}", logs(&dir));
    let r = check_world(&dir, 3);
    for x in &r {
        assert_eq!((&x["host"], &x["is_server"], &x["launcher"]), (&json!("Agent"), &json!(false), &json!("Torchrun")), "{x}");
        assert_eq!(x["prefix"], json!("/worker/attempt_1/"));
    }
    // The values are in the agent's store, under the attempt's prefix.
    let mut c = TcpStoreClient::connect(&agent.addr().to_string(), Duration::from_secs(3), 9).unwrap();
    assert_eq!(c.get(b"/worker/attempt_1/value/2", Duration::from_secs(1)).unwrap().unwrap(), b"2x14");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_that_fails_stops_the_waiting_ranks_promptly() {
    let dir = scratch("fail");
    let port = free_port();
    let t0 = Instant::now();
    let peers: Vec<Child> = (0..3)
        .map(|r| {
            let mut v = rank_vars(r, 3, port);
            v.push((PEER_MODE, "fail-rank-1".into()));
            spawn_peer(&dir, &format!("rank{r}"), &v)
        })
        .collect();
    let codes: Vec<_> = peers.into_iter().map(|c| wait_for(c, Duration::from_secs(60))).collect();
    let took = t0.elapsed();
    assert_eq!(codes, [Some(5), Some(4), Some(5)], "{}", logs(&dir));
    assert!(took < Duration::from_secs(15), "{took:?}");
    each_log_says(&dir, &["rank0", "rank2"], "rank 1 failed: a bad shard on rank 1 only");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn two_processes_with_one_rank_both_fail_naming_rank() {
    let dir = scratch("dup");
    let port = free_port();
    let a = spawn_peer(&dir, "first", &rank_vars(0, 2, port));
    std::thread::sleep(Duration::from_millis(300));
    let b = spawn_peer(&dir, "second", &rank_vars(0, 2, port));
    let codes = [wait_for(a, Duration::from_secs(60)), wait_for(b, Duration::from_secs(60))];
    assert_eq!(codes, [Some(3), Some(3)], "{}", logs(&dir));
    each_log_says(&dir, &["first", "second"], "RANK=0 is used by two processes");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn launch_stops_the_other_ranks_when_one_fails() {
    let dir = scratch("launch-fail");
    let launch = LocalLaunch {
        env: vec![(PEER_DIR.into(), dir.display().to_string()), (PEER_MODE.into(), "fail-rank-1".into())],
        log_dir: Some(dir.clone()),
        ..LocalLaunch::one_node(std::env::current_exe().unwrap(), peer_args(), 3, free_port())
    };
    let t0 = Instant::now();
    let e = launch.run().unwrap_err().to_string();
    // Rank 1 fails; the others fail on its notice or are stopped, whichever comes first.
    assert!(e.contains("exited with code") || e.contains("killed"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(15), "{:?}", t0.elapsed());
    let log = std::fs::read_to_string(dir.join("rank1.log")).unwrap();
    assert!(log.contains("rank 1 fails on purpose"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- where PyTorch is installed -------------------------------------------------------------

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Says on stderr why a live test did not run.
fn skip(why: &str) {
    eprintln!("skipped: {why}");
}

/// A Python with torch: FERROLM_PYTHON, the workspace's .venv, or python3.
fn python_with_torch() -> Option<PathBuf> {
    let candidates =
        [std::env::var_os("FERROLM_PYTHON").map(PathBuf::from), Some(workspace().join(".venv/bin/python")), Some("python3".into())];
    candidates.into_iter().flatten().find(|p| {
        Command::new(p)
            .args(["-c", "import torch.distributed"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

/// torchrun: FERROLM_TORCHRUN, the workspace's .venv, or on PATH.
fn torchrun() -> Option<PathBuf> {
    ferrolm_testing::tools::torchrun(&workspace())
}

/// Runs torchrun invocations (one per simulated node) of the peer process.
fn run_torchrun(torchrun: &Path, dir: &Path, invocations: &[Vec<String>]) -> Vec<Option<i32>> {
    let children: Vec<Child> = invocations
        .iter()
        .enumerate()
        .map(|(i, args)| {
            let log = std::fs::File::create(dir.join(format!("torchrun{i}.log"))).unwrap();
            Command::new(torchrun)
                .args(args)
                .args(["--no-python", std::env::current_exe().unwrap().to_str().unwrap()])
                .args(peer_args())
                .env(PEER_DIR, dir)
                .env("OMP_NUM_THREADS", "1")
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .unwrap()
        })
        .collect();
    children.into_iter().map(|c| wait_for(c, Duration::from_secs(120))).collect()
}

#[test]
fn torchrun_starts_ranks_that_join_the_agents_store() {
    let Some(torchrun) = torchrun() else {
        return skip("torchrun is not installed (FERROLM_TORCHRUN, .venv/bin/torchrun or PATH): the live torchrun tests did not run");
    };
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    // c10d, one node.
    let dir = scratch("torchrun-standalone");
    let codes = run_torchrun(&torchrun, &dir, &[s(&["--standalone", "--nproc-per-node", "2"])]);
    assert_eq!(codes, [Some(0)], "{}", logs(&dir));
    for x in check_world(&dir, 2) {
        assert_eq!((&x["host"], &x["is_server"]), (&json!("Agent"), &json!(false)), "{x}");
    }
    // Static rendezvous, two simulated nodes of 2.
    let dir = scratch("torchrun-static");
    let port = free_port().to_string();
    let node =
        |i: &str| s(&["--nnodes", "2", "--node-rank", i, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", &port]);
    let codes = run_torchrun(&torchrun, &dir, &[node("0"), node("1")]);
    assert_eq!(codes, [Some(0), Some(0)], "{}", logs(&dir));
    let r = check_world(&dir, 4);
    assert_eq!(r.iter().map(|x| x["node_rank"].clone()).collect::<Vec<_>>(), [json!(0), json!(0), json!(1), json!(1)]);
    assert!(r.iter().all(|x| x["host"] == json!("Agent")));
    // c10d rendezvous at an endpoint, two simulated nodes of 1.
    let dir = scratch("torchrun-c10d");
    let endpoint = format!("127.0.0.1:{}", free_port());
    let node = || {
        s(&["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", &endpoint, "--rdzv-id", "ferrolm-test"])
    };
    let codes = run_torchrun(&torchrun, &dir, &[node(), node()]);
    assert_eq!(codes, [Some(0), Some(0)], "{}", logs(&dir));
    assert!(check_world(&dir, 2).iter().all(|x| x["host"] == json!("Agent")));
    for d in ["torchrun-standalone", "torchrun-static", "torchrun-c10d"] {
        let _ = std::fs::remove_dir_all(scratch(d));
    }
}

const TORCH_SERVER: &str = r#"
import datetime, sys, time
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
print(s.port, flush=True)
# torch's client puts "/" before every key: these are "/from-rust" etc. on the wire.
s.wait(["from-rust"], datetime.timedelta(seconds=30))
assert s.get("from-rust") == b"hello torch", s.get("from-rust")
s.set("from-torch", b"hello rust")
s.wait(["bye"], datetime.timedelta(seconds=30))
"#;

const TORCH_CLIENT: &str = r#"
import datetime, sys
import torch.distributed as dist
c = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=datetime.timedelta(seconds=30))
c.set("greeting", b"from torch")
assert c.get("reply") == b"from rust", c.get("reply")
assert c.add("count", 5) == 7
assert c.compare_set("cas", b"", b"x") == b"x"
assert c.check(["greeting", "reply"]) and not c.check(["nothing"])
c.multi_set(["m1", "m2"], [b"1", b"2"])
assert c.multi_get(["m1", "m2"]) == [b"1", b"2"]
assert c.delete_key("m1") and not c.delete_key("m1")
c.set("done", b"")
print("torch client ok", flush=True)
"#;

#[test]
fn our_client_and_server_talk_to_pytorchs() {
    let Some(python) = python_with_torch() else {
        return skip("no Python with torch (FERROLM_PYTHON, .venv/bin/python or python3): the live TCPStore tests did not run");
    };
    // Our client against torch's server (the keys as torch's client would send them).
    let mut server = Command::new(&python).args(["-c", TORCH_SERVER]).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(server.stdout.take().unwrap()), &mut line).unwrap();
    let addr = format!("127.0.0.1:{}", line.trim());
    let mut c = TcpStoreClient::connect(&addr, Duration::from_secs(10), std::process::id()).unwrap();
    c.set(b"/from-rust", b"hello torch").unwrap();
    assert_eq!(c.get(b"/from-torch", Duration::from_secs(30)).unwrap().unwrap(), b"hello rust");
    assert!(!c.wait(&[b"/never"], Duration::from_millis(200)).unwrap(), "a timed-out wait");
    assert_eq!(c.add(b"/n", 2).unwrap(), 2);
    c.set(b"/bye", b"").unwrap();
    assert!(server.wait().unwrap().success(), "torch's server script failed");

    // torch's client against our server.
    let ours = StoreServer::bind("127.0.0.1:0").unwrap();
    let mut rust = TcpStoreClient::connect(&ours.addr().to_string(), Duration::from_secs(3), 1).unwrap();
    rust.set(b"/reply", b"from rust").unwrap();
    rust.add(b"/count", 2).unwrap();
    let out = Command::new(&python).args(["-c", TORCH_CLIENT, &ours.addr().port().to_string()]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(rust.get(b"/greeting", Duration::from_secs(1)).unwrap().unwrap(), b"from torch");
    assert_eq!(rust.num_keys().unwrap(), 6, "reply count greeting cas m2 done");
}
