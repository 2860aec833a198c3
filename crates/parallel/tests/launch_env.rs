//! The launchers' environments (torchrun, srun, Open MPI, set by hand), SLURM's compact lists,
//! and every bad environment the rendezvous must refuse with the variable named.
use ferrolm_parallel::slurm::{expand_hostlist, expand_tasks_per_node, first_host};
use ferrolm_parallel::store::Store;
use ferrolm_parallel::{cuda_ordinal, DistEnv, Launcher, DEFAULT_MASTER_PORT};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::{Duration, Instant};

fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let m: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    move |k| m.get(k).cloned()
}

fn env_of(vars: &[(&str, &str)]) -> DistEnv {
    DistEnv::from_lookup(&lookup(vars)).unwrap_or_else(|e| panic!("{vars:?}: {e}")).expect("a world size is set")
}

fn err_of(vars: &[(&str, &str)]) -> String {
    match DistEnv::from_lookup(&lookup(vars)) {
        Ok(e) => panic!("{vars:?} was accepted: {e:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn hostlists_expand_as_slurm_writes_them() {
    let table: &[(&str, &[&str])] = &[
        ("node7", &["node7"]),
        ("gpu[01-04,07]", &["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
        ("a[1-2],b3", &["a1", "a2", "b3"]),
        ("n[001-003]-ib", &["n001-ib", "n002-ib", "n003-ib"]),
        ("x[8-10]", &["x8", "x9", "x10"]),
        ("x[08-10]", &["x08", "x09", "x10"]),
        ("r[1-2]-n[1,3]", &["r1-n1", "r1-n3", "r2-n1", "r2-n3"]),
        ("gpu[3],cpu[10-11],login", &["gpu3", "cpu10", "cpu11", "login"]),
        ("10.0.0.[1-2]", &["10.0.0.1", "10.0.0.2"]),
    ];
    for (list, want) in table {
        assert_eq!(expand_hostlist(list).unwrap(), *want, "{list}");
        assert_eq!(first_host(list).unwrap(), want[0], "{list}");
    }
    for bad in ["gpu[01-04", "gpu]1", "gpu[4-1]", "gpu[a-b]", "gpu[]", "", "gpu[1-2[3]]", "n[1--2]"] {
        assert!(expand_hostlist(bad).is_err(), "{bad:?} was accepted: {:?}", expand_hostlist(bad));
    }
}

#[test]
fn tasks_per_node_lists_expand() {
    let table: &[(&str, &[usize])] = &[("8", &[8]), ("4(x2),3", &[4, 4, 3]), ("2,2", &[2, 2]), ("1(x3)", &[1, 1, 1])];
    for (s, want) in table {
        assert_eq!(expand_tasks_per_node(s).unwrap(), *want, "{s}");
    }
    for bad in ["", "x", "0", "4(2)", "4(x)", "4(x0)", "-1"] {
        assert!(expand_tasks_per_node(bad).is_err(), "{bad:?} was accepted");
    }
}

#[test]
fn torchrun_static_and_c10d_environments() {
    // What torchrun's agent gives worker 5 of 8 on the second of two nodes.
    let e = env_of(&[
        ("RANK", "5"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("GROUP_RANK", "1"),
        ("GROUP_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29400"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ("TORCHELASTIC_RESTART_COUNT", "2"),
        ("TORCHELASTIC_RUN_ID", "job"),
    ]);
    assert_eq!((e.rank, e.world_size, e.local_rank, e.local_world_size, e.node_rank, e.num_nodes), (5, 8, 1, 4, 1, 2));
    assert_eq!((e.master_addr.as_str(), e.master_port), ("node0", 29400));
    assert!(e.agent_store && !e.serves_store());
    assert_eq!((e.restart_count, e.launcher), (2, Launcher::Torchrun));
    assert_eq!(e.cuda_device(), "cuda:1");
    // Without the agent flag (the `launch` example, or exported by hand) rank 0 serves.
    let e = env_of(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")]);
    assert!(!e.agent_store && e.serves_store());
    assert_eq!((e.master_port, e.local_world_size, e.node_rank, e.launcher), (DEFAULT_MASTER_PORT, 2, 0, Launcher::Env));
    let not_agent =
        [("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "a"), ("TORCHELASTIC_USE_AGENT_STORE", "False")];
    assert!(!env_of(&not_agent).agent_store);
    // No launcher: a single process.
    assert_eq!(DistEnv::from_lookup(&lookup(&[])).unwrap(), None);
    let solo = env_of(&[("WORLD_SIZE", "1"), ("RANK", "0")]);
    assert_eq!((solo.world_size, solo.local_rank, solo.cuda_ordinal), (1, 0, 0));
}

#[test]
fn srun_alone_gives_ranks_layout_and_master() {
    let srun = [
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "11"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NODEID", "1"),
        ("SLURM_TASKS_PER_NODE", "4(x2),3"),
        ("SLURM_JOB_NUM_NODES", "3"),
        ("SLURM_JOB_NODELIST", "gpu[01-02,07]"),
    ];
    let e = env_of(&srun);
    assert_eq!((e.rank, e.world_size, e.local_rank, e.local_world_size, e.node_rank, e.num_nodes), (5, 11, 1, 4, 1, 3));
    assert_eq!((e.master_addr.as_str(), e.master_port, e.launcher), ("gpu01", 29500, Launcher::Slurm));
    assert!(e.serves_store() == (e.rank == 0));
    // The third node runs 3 tasks.
    let last =
        env_of(&[("SLURM_PROCID", "9"), ("SLURM_NODEID", "2"), ("SLURM_LOCALID", "1"), ("SLURM_NTASKS", "11"), srun[4], srun[5], srun[6]]);
    assert_eq!((last.local_world_size, last.node_rank), (3, 2));
    // A step's own layout wins over the job's; SLURM_NTASKS_PER_NODE is the last resort.
    // srun's variables without SLURM_NTASKS_PER_NODE, then the case's own.
    let with = |own: &[(&'static str, &'static str)]| env_of(&[&[srun[0], srun[1], srun[2], srun[3], srun[4], srun[6]], own].concat());
    let step = with(&[("SLURM_STEP_TASKS_PER_NODE", "2(x3),5"), ("SLURM_STEP_NODELIST", "b[5-7]")]);
    assert_eq!((step.local_world_size, step.master_addr.as_str()), (2, "b5"));
    let plain = env_of(&[("SLURM_PROCID", "3"), ("SLURM_NTASKS", "8"), ("SLURM_LOCALID", "3"), ("SLURM_NTASKS_PER_NODE", "4"), srun[6]]);
    assert_eq!((plain.local_world_size, plain.node_rank, plain.num_nodes), (4, 0, 2));
    // Explicit variables win over SLURM's (torchrun under srun, or a job script's exports).
    let mixed = with(&[
        ("RANK", "2"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "0"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "10.1.1.1"),
        ("MASTER_PORT", "1234"),
    ]);
    assert_eq!((mixed.rank, mixed.world_size, mixed.local_rank, mixed.local_world_size), (2, 4, 0, 2));
    assert_eq!((mixed.master_addr.as_str(), mixed.master_port, mixed.launcher), ("10.1.1.1", 1234, Launcher::Env));
}

#[test]
fn open_mpi_ranks_are_read() {
    let e = env_of(&[
        ("OMPI_COMM_WORLD_RANK", "5"),
        ("OMPI_COMM_WORLD_SIZE", "16"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ("MASTER_ADDR", "10.0.0.1"),
    ]);
    assert_eq!((e.rank, e.world_size, e.local_rank, e.local_world_size, e.node_rank, e.launcher), (5, 16, 1, 4, 1, Launcher::OpenMpi));
}

#[test]
fn one_visible_gpu_means_cuda_0() {
    assert_eq!(cuda_ordinal(3, None).unwrap(), 3);
    assert_eq!(cuda_ordinal(3, Some("")).unwrap(), 3);
    assert_eq!(cuda_ordinal(3, Some("5")).unwrap(), 0);
    assert_eq!(cuda_ordinal(3, Some("GPU-8a1e2c3d-0000")).unwrap(), 0);
    assert_eq!(cuda_ordinal(3, Some("0,1,2,3")).unwrap(), 3);
    let e = cuda_ordinal(3, Some("0,1")).unwrap_err().to_string();
    assert!(e.contains("LOCAL_RANK=3") && e.contains("CUDA_VISIBLE_DEVICES=\"0,1\""), "{e}");
    let base = [("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "a")];
    let one = env_of(&[base[0], base[1], base[2], base[3], ("CUDA_VISIBLE_DEVICES", "1")]);
    assert_eq!(one.cuda_device(), "cuda:0");
    assert_eq!(env_of(&base).cuda_device(), "cuda:1");
}

#[test]
fn bad_environments_are_refused_naming_the_variable() {
    let base = [("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "a")];
    let with = |extra: &[(&'static str, &'static str)]| -> Vec<(&'static str, &'static str)> {
        let mut v: Vec<_> = base.iter().filter(|(k, _)| !extra.iter().any(|(e, _)| e == k)).copied().collect();
        v.extend(extra.iter().filter(|(_, val)| !val.is_empty()).copied());
        v
    };
    let cases: &[(&[(&str, &str)], &str)] = &[
        // WORLD_SIZE with no master.
        (&[("MASTER_ADDR", "")], "MASTER_ADDR is not set"),
        // Ranks out of range.
        (&[("RANK", "5")], "RANK=5 is not below WORLD_SIZE=4"),
        (&[("LOCAL_WORLD_SIZE", "2"), ("LOCAL_RANK", "2")], "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"),
        (&[("LOCAL_WORLD_SIZE", "0")], "LOCAL_WORLD_SIZE=0"),
        (&[("LOCAL_WORLD_SIZE", "8")], "LOCAL_WORLD_SIZE=8 must be between 1 and WORLD_SIZE=4"),
        (&[("GROUP_RANK", "2"), ("GROUP_WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2")], "GROUP_RANK=2 is not below the node count 2"),
        (&[("RANK", "")], "RANK is not"),
        (&[("LOCAL_RANK", "")], "LOCAL_RANK is not set"),
        (&[("WORLD_SIZE", "two")], "WORLD_SIZE=\"two\""),
        (&[("WORLD_SIZE", "0")], "WORLD_SIZE must be at least 1"),
        (&[("RANK", "-1")], "RANK=\"-1\""),
        (&[("MASTER_PORT", "99999")], "MASTER_PORT=\"99999\" is not a port number"),
        (&[("MASTER_PORT", "0")], "MASTER_PORT=\"0\""),
        (&[("TORCHELASTIC_RESTART_COUNT", "x")], "TORCHELASTIC_RESTART_COUNT=\"x\""),
        (&[("CUDA_VISIBLE_DEVICES", "0,1"), ("LOCAL_RANK", "2"), ("LOCAL_WORLD_SIZE", "4")], "CUDA_VISIBLE_DEVICES"),
    ];
    for (extra, want) in cases {
        let e = err_of(&with(extra));
        assert!(e.contains(want), "{extra:?}: {e}");
    }
    let slurm = [("SLURM_PROCID", "1"), ("SLURM_NTASKS", "4"), ("SLURM_LOCALID", "1"), ("SLURM_JOB_NODELIST", "gpu[01-02]")];
    let slurm_cases: &[(&[(&str, &str)], &str)] = &[
        (&[("SLURM_PROCID", "4")], "SLURM_PROCID=4 is not below SLURM_NTASKS=4"),
        (&[("SLURM_JOB_NODELIST", "gpu[01-")], "SLURM_JOB_NODELIST=\"gpu[01-\""),
        (&[("SLURM_TASKS_PER_NODE", "2(x2")], "SLURM_TASKS_PER_NODE"),
        (&[("SLURM_TASKS_PER_NODE", "2,2")], "SLURM_NODEID is not set"),
        (&[("SLURM_TASKS_PER_NODE", "2,2"), ("SLURM_NODEID", "5")], "this is node 5"),
        (&[("SLURM_NTASKS_PER_NODE", "1")], "SLURM_LOCALID=1 is not below SLURM_NTASKS_PER_NODE=1"),
        (&[("SLURM_JOB_NODELIST", "")], "MASTER_ADDR is not set"),
    ];
    for (extra, want) in slurm_cases {
        let mut v: Vec<_> = slurm.iter().filter(|(k, _)| !extra.iter().any(|(e, _)| e == k)).copied().collect();
        v.extend(extra.iter().filter(|(_, val)| !val.is_empty()).copied());
        let e = err_of(&v);
        assert!(e.contains(want), "{extra:?}: {e}");
    }
}

/// `DistEnv` of `rank` in a world of `world` on 127.0.0.1:`port`.
fn at(rank: usize, world: usize, port: u16, agent: bool) -> DistEnv {
    let mut e = DistEnv::local(rank, world, "127.0.0.1", port);
    e.agent_store = agent;
    e
}

/// A server on a free port that answers each connection with `answer` after reading what
/// the client sends first (None: accept and never answer).
fn impostor(answer: Option<&'static [u8]>) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut keep = Vec::new();
        for c in l.incoming() {
            let Ok(mut c) = c else { continue };
            match answer {
                Some(a) => {
                    let mut buf = [0u8; 64];
                    let _ = c.read(&mut buf);
                    let _ = c.write_all(a);
                }
                None => keep.push(c),
            }
        }
    });
    port
}

#[test]
fn a_port_held_by_something_else_is_named_quickly() {
    let http = impostor(Some(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"));
    let silent = impostor(None);
    let hangs_up = impostor(Some(b""));
    let cases = [(http, "\"HTTP/1.1 400"), (silent, "did not answer the validation handshake"), (hangs_up, "closed the connection")];
    std::thread::scope(|s| {
        for (port, says) in cases {
            for rank in [0, 1] {
                s.spawn(move || {
                    let t0 = Instant::now();
                    let e = Store::rendezvous(&at(rank, 2, port, false), Duration::from_secs(60)).err().unwrap().to_string();
                    let took = t0.elapsed();
                    assert!(took < Duration::from_secs(6), "rank {rank}: {took:?} ({e})");
                    let held = format!("MASTER_ADDR:MASTER_PORT = 127.0.0.1:{port} is held by something that is not a rendezvous store");
                    assert!(e.contains(&held), "{e}");
                    assert!(e.contains(says), "{e}");
                    if rank == 0 {
                        assert!(e.contains(&format!("rank 0 could not listen on port {port}")), "{e}");
                    }
                });
            }
        }
    });
}

#[test]
fn an_agent_store_of_another_protocol_version_is_refused_saying_which_was_expected() {
    // A TCPStore of another version: it reads the validation message, does not know the magic
    // number, and hangs up.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { continue };
            let mut hello = [0u8; 5];
            if c.read_exact(&mut hello).is_ok() && hello[1..] != 0x1234_5678u32.to_le_bytes() {
                drop(c);
            }
        }
    });
    let t0 = Instant::now();
    let e = Store::rendezvous(&at(1, 2, port, true), Duration::from_secs(60)).err().unwrap().to_string();
    assert!(t0.elapsed() < Duration::from_secs(6), "{:?}", t0.elapsed());
    assert!(e.contains("expected PyTorch's TCPStore protocol (validation magic 0x3C85F7CE"), "{e}");
    assert!(e.contains("Under torchrun the agent serves this store: its TCPStore protocol version is not the one ferrolm speaks"), "{e}");
}

#[test]
fn two_processes_with_one_rank_both_fail_naming_rank() {
    // Our own store: two rank 0s (the second finds the port taken by the first's store).
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let errs: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|i| {
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(150 * i));
                    Store::rendezvous(&at(0, 2, port, false), Duration::from_secs(20)).err().map(|e| e.to_string())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().expect("a duplicate rank was accepted")).collect()
    });
    for e in &errs {
        assert!(e.contains("RANK=0 is used by two processes"), "{e}");
    }
    // Under an agent: two rank 1s.
    let server = ferrolm_parallel::store::StoreServer::bind("127.0.0.1:0").unwrap();
    let port = server.addr().port();
    let t0 = Instant::now();
    let errs: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|_| s.spawn(move || Store::rendezvous(&at(1, 2, port, true), Duration::from_secs(20)).err().map(|e| e.to_string())))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().expect("a duplicate rank was accepted")).collect()
    });
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    for e in &errs {
        assert!(e.contains("RANK=1 is used by two processes"), "{e}");
    }
}

#[test]
fn a_rank_that_never_arrives_is_named_at_the_timeout() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let t0 = Instant::now();
    let (e0, e1) = std::thread::scope(|s| {
        // Rank 0 would wait 60 s: the first rank to time out tells it why.
        let r0 = s.spawn(|| Store::rendezvous(&at(0, 3, port, false), Duration::from_secs(60)).err().unwrap().to_string());
        std::thread::sleep(Duration::from_millis(100));
        let e1 = Store::rendezvous(&at(1, 3, port, false), Duration::from_millis(800)).err().unwrap().to_string();
        (r0.join().unwrap(), e1)
    });
    assert!(t0.elapsed() >= Duration::from_millis(850) && t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert!(e1.contains("only 2 of 3 ranks joined the rendezvous"), "{e1}");
    assert!(e1.contains("missing ranks: 2."), "{e1}");
    assert!(e0.contains("rank 1 failed: only 2 of 3 ranks joined the rendezvous") && e0.contains("missing ranks: 2."), "{e0}");
}
