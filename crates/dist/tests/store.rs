//! The TCP rendezvous store over localhost (ephemeral ports), with thread "processes".
use ferrolm_dist::store::{Store, StoreServer};
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
    let out: Vec<(Vec<u8>, Duration)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                s.spawn(move || {
                    // Rank 0 comes up last: the others retry until it listens.
                    if r == 0 {
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    let st = Store::rendezvous("127.0.0.1", port, r, n, Duration::from_secs(20)).unwrap();
                    if r == 0 {
                        st.set("nccl/world/id", b"\x01unique-id\xff").unwrap();
                    }
                    let id = st.get("nccl/world/id").unwrap();
                    std::thread::sleep(Duration::from_millis(60 * r as u64));
                    st.barrier("init").unwrap();
                    let after = t0.elapsed();
                    st.set(&format!("rank/{r}"), &[r as u8]).unwrap();
                    for p in 0..n {
                        assert_eq!(st.get(&format!("rank/{p}")).unwrap(), [p as u8]);
                    }
                    // Rank 0 keeps the server alive until everyone is done with it.
                    st.barrier("done").unwrap();
                    (id, after)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (id, after) in out {
        assert_eq!(id, b"\x01unique-id\xff");
        // The last rank reaches the barrier after ~380 ms (200 ms start + 180 ms sleep).
        assert!(after >= Duration::from_millis(370), "left the barrier at {after:?}");
    }
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
                        std::thread::sleep(Duration::from_millis(100));
                        st.report_failure("CUDA out of memory in step 12").unwrap();
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
    assert!(errs[0].contains("store get \"never-set\" (rank 0"), "{}", errs[0]);
    // Later requests fail too.
    let st = Store::connect(&addr, 1, 3, Duration::from_secs(5)).unwrap();
    assert!(st.set("k", b"v").unwrap_err().to_string().contains("rank 2 failed"));
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
    drop(server);
    std::thread::sleep(Duration::from_millis(50));
    // A stopped server takes no new connections.
    assert!(Store::connect(&addr, 1, 2, Duration::from_millis(200)).is_err());

    // A server that goes away (rank 0's process died: the OS closes its sockets).
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let h = std::thread::spawn(move || drop(l.accept().unwrap()));
    let st = Store::connect(&addr, 1, 2, Duration::from_secs(5)).unwrap();
    h.join().unwrap();
    let e = st.get("id").unwrap_err().to_string();
    assert!(e.contains("connection to the store lost (did rank 0 exit?)"), "{e}");
}
