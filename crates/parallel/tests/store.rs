//! The rendezvous store, our client against our server over localhost (ephemeral ports), with
//! thread "processes".
use ferrolm_parallel::store::{Store, StoreHost, StoreServer};
use ferrolm_parallel::tcpstore::TcpStoreClient;
use ferrolm_parallel::DistEnv;
use std::time::{Duration, Instant};

/// A port that was free a moment ago.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn ranks_rendezvous_exchange_values_and_meet_at_barriers() {
    let port = free_port();
    let n = 4;
    let t0 = Instant::now();
    // Each thread hands its store back, so rank 0's server outlives the last request (the
    // threads are one process: the server does not linger for them as it would for others).
    let out: Vec<(Vec<u8>, Duration, bool, Store)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                s.spawn(move || {
                    // Rank 0 comes up last: the others retry until it listens.
                    if r == 0 {
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    let st = Store::rendezvous(&DistEnv::local(r, n, "127.0.0.1", port), Duration::from_secs(20)).unwrap();
                    assert_eq!(st.host(), StoreHost::Rank0);
                    if r == 0 {
                        st.set("nccl/world/id", b"\x01unique-id\xff\x00").unwrap();
                    }
                    let id = st.get("nccl/world/id").unwrap();
                    std::thread::sleep(Duration::from_millis(60 * r as u64));
                    st.barrier("init").unwrap();
                    let after = t0.elapsed();
                    st.set(&format!("rank/{r}/value"), &[r as u8]).unwrap();
                    for p in 0..n {
                        assert_eq!(st.get(&format!("rank/{p}/value")).unwrap(), [p as u8]);
                    }
                    st.barrier("done").unwrap();
                    (id, after, st.is_server(), st)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, (id, after, served, _)) in out.into_iter().enumerate() {
        assert_eq!(id, b"\x01unique-id\xff\x00");
        // The last rank reaches the barrier after ~380 ms (200 ms start + 180 ms sleep).
        assert!(after >= Duration::from_millis(370), "left the barrier at {after:?}");
        assert_eq!(served, r == 0, "rank {r}");
    }
}

#[test]
fn keys_live_under_the_attempt_prefix_as_torch_workers_put_them() {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let port = server.addr().port();
    let mut env = DistEnv::local(0, 1, "127.0.0.1", port);
    env.agent_store = true;
    env.restart_count = 2;
    let st = Store::rendezvous(&env, Duration::from_secs(10)).unwrap();
    assert!(!st.is_server(), "under an agent nobody serves");
    assert_eq!(st.prefix(), "/worker/attempt_2/");
    st.set("nccl/world/id", b"id").unwrap();
    let mut raw = TcpStoreClient::connect(&server.addr().to_string(), Duration::from_secs(3), 7).unwrap();
    assert_eq!(raw.get(b"/worker/attempt_2/nccl/world/id", Duration::from_secs(1)).unwrap().unwrap(), b"id");
    assert!(raw.check(&[b"/worker/attempt_2/rank/0"]).unwrap(), "rank 0 claimed its number");
    assert!(!raw.check(&[b"/worker/attempt_1/nccl/world/id"]).unwrap());
}

#[test]
fn a_failure_notice_fails_every_waiting_rank_promptly() {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let addr = server.addr().to_string();
    let t0 = Instant::now();
    let errs: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|r| {
                let addr = addr.clone();
                s.spawn(move || {
                    let st = Store::connect(&addr, r, 3, Duration::from_secs(30)).unwrap();
                    if r == 2 {
                        std::thread::sleep(Duration::from_millis(300));
                        st.report_failure("CUDA out of memory in step 12").unwrap();
                        // The first notice wins.
                        st.report_failure("a later, secondary error").unwrap();
                        return String::new();
                    }
                    let e = if r == 0 { st.get("never-set").unwrap_err() } else { st.barrier("b").unwrap_err() };
                    assert_eq!(st.failure().unwrap().as_deref(), Some("rank 2 failed: CUDA out of memory in step 12"));
                    e.to_string()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    for e in &errs[..2] {
        assert!(e.contains("rank 2 failed: CUDA out of memory in step 12"), "{e}");
    }
    assert!(errs[0].contains("store get \"/never-set\" (rank 0"), "{}", errs[0]);
    // Later requests fail too.
    let st = Store::connect(&addr, 1, 3, Duration::from_secs(5)).unwrap();
    assert!(st.set("k", b"v").unwrap_err().to_string().contains("rank 2 failed"));
    assert!(st.get("k").unwrap_err().to_string().contains("rank 2 failed"));
}

#[test]
fn connecting_to_nobody_fails_at_the_timeout() {
    let port = free_port();
    let t0 = Instant::now();
    let e = Store::connect(&format!("127.0.0.1:{port}"), 3, 4, Duration::from_millis(300)).err().unwrap().to_string();
    let took = t0.elapsed();
    assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(3), "{took:?}");
    assert!(e.contains(&format!("rank 3 could not reach the rendezvous store at 127.0.0.1:{port} within 0.3 s")), "{e}");
}

#[test]
fn waits_time_out_and_a_dead_server_is_reported() {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let addr = server.addr().to_string();
    let st = Store::connect(&addr, 1, 2, Duration::from_millis(200)).unwrap();
    let t0 = Instant::now();
    let e = st.get("missing").unwrap_err().to_string();
    assert!(e.contains("timed out after 0.2 s waiting for key \"missing\""), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(3));
    let e = st.barrier("half").unwrap_err().to_string();
    assert!(e.contains("(1 of 2 ranks arrived)"), "{e}");
    // The connection is still usable after timed-out waits (they were cancelled).
    st.set("k", b"v").unwrap();
    assert_eq!(st.get("k").unwrap(), b"v");
    drop(server);
    std::thread::sleep(Duration::from_millis(50));
    // A stopped server takes no new connections, and open ones are closed.
    assert!(Store::connect(&addr, 1, 2, Duration::from_millis(200)).is_err());
    let e = st.get("k").unwrap_err().to_string();
    assert!(e.contains(&format!("connection to the rendezvous store at {addr} lost")), "{e}");
    // Every later request fails at once with the same reason.
    let t0 = Instant::now();
    assert!(st.set("x", b"y").unwrap_err().to_string().contains("lost"));
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
}

#[test]
fn the_death_of_rank_0s_store_ends_a_waiting_rank_with_a_clear_error() {
    let port = free_port();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let st = Store::rendezvous(&DistEnv::local(1, 2, "127.0.0.1", port), Duration::from_secs(20)).unwrap();
        tx.send(()).unwrap();
        let t0 = Instant::now();
        (st.get_timeout("never", Duration::from_secs(60)).unwrap_err().to_string(), t0.elapsed())
    });
    let rank0 = Store::rendezvous(&DistEnv::local(0, 2, "127.0.0.1", port), Duration::from_secs(20)).unwrap();
    rx.recv().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    // Rank 0's process ends: its server stops (the waiter counts as this process's own
    // client, so the server does not linger for it).
    drop(rank0);
    let (e, took) = waiter.join().unwrap();
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert!(e.contains("lost (did rank 0, which serves it, exit?): the server closed it"), "{e}");
}

#[test]
fn a_barrier_can_wait_longer_than_the_stores_timeout() {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let addr = server.addr().to_string();
    std::thread::scope(|s| {
        s.spawn(|| {
            // Rank 0 "tokenises" for longer than the store's default timeout.
            let st = Store::connect(&addr, 0, 2, Duration::from_millis(200)).unwrap();
            std::thread::sleep(Duration::from_millis(600));
            st.barrier_timeout("prepared", Duration::from_secs(10)).unwrap();
        });
        let st = Store::connect(&addr, 1, 2, Duration::from_millis(200)).unwrap();
        let t0 = Instant::now();
        st.barrier_timeout("prepared", Duration::from_secs(10)).unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(500), "{:?}", t0.elapsed());
    });
}

#[test]
fn the_server_lingers_for_other_processes_clients_and_not_for_its_own() {
    let mut server = StoreServer::bind("127.0.0.1:0").unwrap();
    server.set_linger(Duration::from_secs(10));
    let addr = server.addr();
    // This process's clients do not hold the server up.
    let own = TcpStoreClient::connect(&addr.to_string(), Duration::from_secs(3), 1).unwrap();
    // A raw connection stands for another process's rank.
    let foreign = std::net::TcpStream::connect(addr).unwrap();
    let t = std::time::Instant::now();
    while server.connections() < 2 {
        assert!(t.elapsed() < Duration::from_secs(5));
        std::thread::sleep(Duration::from_millis(5));
    }
    let closer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(400));
        drop(foreign);
    });
    let t0 = Instant::now();
    drop(server);
    let took = t0.elapsed();
    closer.join().unwrap();
    assert!(took >= Duration::from_millis(350) && took < Duration::from_secs(5), "{took:?}");
    drop(own);

    let mut server = StoreServer::bind("127.0.0.1:0").unwrap();
    server.set_linger(Duration::from_millis(300));
    let _stuck = std::net::TcpStream::connect(server.addr()).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let t0 = Instant::now();
    drop(server);
    let took = t0.elapsed();
    assert!(took >= Duration::from_millis(250) && took < Duration::from_secs(3), "the linger is bounded: {took:?}");
}
