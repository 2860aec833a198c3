//! The emulated NCCL's failure semantics, with ranks as real processes: mismatched calls are
//! detected and reported on every rank, abort unblocks a waiting collective, a killed or
//! destroyed peer gives an error instead of a hang, and init bounds its wait (NCCL_EMU_TIMEOUT).
mod emu_ranks;

use emu_ranks::{child, values, Buf, Comm, Dt, Group, TestStream};
use ferrolm_parallel::nccl_lib::{NCCL_INVALID_USAGE, NCCL_REMOTE_ERROR, NCCL_SUM, NCCL_SYSTEM_ERROR};
use std::ptr::null_mut;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn untouched(b: &Buf) -> bool {
    b.snapshot().iter().all(|&x| x == 0xAB)
}

#[test]
fn mismatched_counts_and_collectives_fail_with_invalid_usage_on_every_rank() {
    child("mismatched_counts_and_collectives_fail_with_invalid_usage_on_every_rank", |r| {
        let world = r.init();
        let other = world.split(0, 0).unwrap();
        let me = r.rank;
        let send = Buf::from_bytes(&values(Dt::F32, me, 16, 1, false));
        let recv = Buf::filled(64, 0xAB);
        // Different counts, at call time: the call and the communicator fail.
        let count = if me == 0 { 8 } else { 9 };
        assert_eq!(world.all_reduce(send.ptr(), recv.ptr(), count, Dt::F32, NCCL_SUM, null_mut()), NCCL_INVALID_USAGE);
        assert_eq!(world.async_error(), NCCL_INVALID_USAGE);
        assert!(untouched(&recv), "a failed collective left results in the output");
        assert_eq!(
            world.all_reduce(send.ptr(), recv.ptr(), 8, Dt::F32, NCCL_SUM, null_mut()),
            NCCL_INVALID_USAGE,
            "a failed comm runs nothing"
        );
        // Different collectives, on a stream: the call succeeds, the collective fails later.
        let s = TestStream::new();
        let rc = if me == 0 {
            other.all_reduce(send.ptr(), recv.ptr(), 8, Dt::F32, NCCL_SUM, s.raw())
        } else {
            other.all_gather(send.ptr(), recv.ptr(), 8, Dt::F32, s.raw())
        };
        assert_eq!(rc, 0);
        s.synchronize();
        assert_eq!(other.async_error(), NCCL_INVALID_USAGE);
        assert!(untouched(&recv));
        assert_eq!(other.abort(), 0);
        assert_eq!(world.abort(), 0);
    });
    let Some(g) = Group::spawn("mismatched_counts_and_collectives_fail_with_invalid_usage_on_every_rank", 2, &[]) else { return };
    let out = g.finish(Duration::from_secs(60));
    out.assert_ok();
    let (l0, l1) = (out.log(0), out.log(1));
    for (log, line) in [
        (
            l0,
            "rank 0 called #0 ncclAllReduce(count=8, ncclFloat32, ncclSum), rank 1 called #0 ncclAllReduce(count=9, ncclFloat32, ncclSum)",
        ),
        (
            l1,
            "rank 1 called #0 ncclAllReduce(count=9, ncclFloat32, ncclSum), rank 0 called #0 ncclAllReduce(count=8, ncclFloat32, ncclSum)",
        ),
        (l0, "rank 0 called #0 ncclAllReduce(count=8, ncclFloat32, ncclSum), rank 1 called #0 ncclAllGather(sendcount=8, ncclFloat32)"),
        (l1, "rank 1 called #0 ncclAllGather(sendcount=8, ncclFloat32), rank 0 called #0 ncclAllReduce(count=8, ncclFloat32, ncclSum)"),
    ] {
        assert!(log.lines().any(|l| l.contains("NCCL WARN") && l.contains(line)), "no NCCL WARN with {line:?} in:\n{log}");
    }
}

#[test]
fn abort_unblocks_a_collective_waiting_for_a_peer() {
    child("abort_unblocks_a_collective_waiting_for_a_peer", |r| {
        let world = r.init();
        let side = world.split(0, 0).unwrap();
        if r.rank == 1 {
            r.wait_for("done"); // never calls the collectives rank 0 waits in
            return;
        }
        let lib = world.lib;
        let world = Arc::new(world);
        let (send, recv) = (Arc::new(Buf::filled(64, 1)), Arc::new(Buf::filled(64, 0xAB)));
        let (w, s2, r2) = (world.clone(), send.clone(), recv.clone());
        let blocked = std::thread::spawn(move || w.all_reduce(s2.ptr(), r2.ptr(), 16, Dt::F32, NCCL_SUM, null_mut()));
        for _ in 0..20 {
            assert_eq!(world.async_error(), 0, "readable from another thread while a collective waits");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!blocked.is_finished());
        let t = Instant::now();
        assert_eq!(world.abort(), 0);
        assert_ne!(blocked.join().unwrap(), 0, "the aborted collective reports an error");
        assert!(t.elapsed() < Duration::from_secs(2), "abort took {:?} to unblock it", t.elapsed());
        assert!(untouched(&recv));
        // A late call on the aborted handle (a watchdog racing the abort) is refused, not a crash.
        let mut e = 0;
        // SAFETY: the handle is a tombstone after abort; the call only reads it.
        assert_eq!(unsafe { (lib.comm_get_async_error)(world.raw, &mut e) }, NCCL_INVALID_USAGE);

        // The same on a stream: abort makes the blocked work item return, so the stream moves on.
        let s = TestStream::new();
        assert_eq!(side.all_reduce(send.ptr(), recv.ptr(), 16, Dt::F32, NCCL_SUM, s.raw()), 0);
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        assert_eq!(side.abort(), 0);
        s.synchronize();
        assert!(t.elapsed() < Duration::from_secs(2), "the stream stayed blocked {:?} after abort", t.elapsed());
        assert!(untouched(&recv));
        r.signal("done");
    });
    let Some(g) = Group::spawn("abort_unblocks_a_collective_waiting_for_a_peer", 2, &[]) else { return };
    g.finish(Duration::from_secs(60)).assert_ok();
}

#[test]
fn a_killed_peer_fails_the_waiting_collective_with_a_remote_error() {
    child("a_killed_peer_fails_the_waiting_collective_with_a_remote_error", |r| {
        let comm = r.init();
        if r.rank == 1 {
            r.signal("ready");
            std::thread::sleep(Duration::from_secs(60)); // killed by the test meanwhile
            return;
        }
        r.wait_for("ready");
        let (send, recv) = (Buf::filled(64, 1), Buf::filled(64, 0xAB));
        r.signal("waiting");
        assert_eq!(comm.all_reduce(send.ptr(), recv.ptr(), 16, Dt::F32, NCCL_SUM, null_mut()), NCCL_REMOTE_ERROR);
        assert_eq!(comm.async_error(), NCCL_REMOTE_ERROR);
        assert!(untouched(&recv));
        assert_eq!(comm.all_reduce(send.ptr(), recv.ptr(), 16, Dt::F32, NCCL_SUM, null_mut()), NCCL_REMOTE_ERROR);
        assert_eq!(comm.abort(), 0);
    });
    let Some(mut g) = Group::spawn("a_killed_peer_fails_the_waiting_collective_with_a_remote_error", 2, &[]) else { return };
    g.wait_file("waiting");
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    g.kill(1);
    let ranks = g.finish(Duration::from_secs(30));
    assert!(t.elapsed() < Duration::from_secs(10), "rank 0 took {:?} to notice (NCCL_EMU_TIMEOUT is 60 s)", t.elapsed());
    let (_, status, log) = &ranks.ranks[0];
    assert!(status.is_some_and(|s| s.success()), "{log}");
    assert!(log.contains("NCCL WARN") && log.contains("rank 1") && log.contains("exited or was killed"), "{log}");
}

#[test]
fn a_destroyed_peer_is_reported_and_destroy_finishes_queued_work_first() {
    child("a_destroyed_peer_is_reported_and_destroy_finishes_queued_work_first", |r| {
        let comm = r.init();
        let send = Buf::from_bytes(&values(Dt::F32, r.rank, 16, 2, false));
        let recv = Buf::filled(64, 0xAB);
        if r.rank == 1 {
            // Queued, then destroyed at once: destroy waits for the collective (rank 0 joins late).
            let s = TestStream::new();
            assert_eq!(comm.all_reduce(send.ptr(), recv.ptr(), 16, Dt::F32, NCCL_SUM, s.raw()), 0);
            r.signal("queued");
            assert_eq!(comm.destroy(), 0);
            assert!(!untouched(&recv), "destroy returned before the queued collective ran");
            r.signal("destroyed");
            return;
        }
        r.wait_for("queued");
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(comm.all_reduce(send.ptr(), recv.ptr(), 16, Dt::F32, NCCL_SUM, null_mut()), 0);
        r.wait_for("destroyed");
        assert_eq!(comm.all_reduce(send.ptr(), recv.ptr(), 16, Dt::F32, NCCL_SUM, null_mut()), NCCL_REMOTE_ERROR);
        assert_eq!(comm.abort(), 0);
    });
    let Some(g) = Group::spawn("a_destroyed_peer_is_reported_and_destroy_finishes_queued_work_first", 2, &[]) else { return };
    let out = g.finish(Duration::from_secs(60));
    out.assert_ok();
    assert!(out.log(0).contains("rank 1 destroyed the communicator (ncclCommDestroy)"), "{}", out.log(0));
}

#[test]
fn init_bounds_its_wait_and_names_the_missing_ranks() {
    child("init_bounds_its_wait_and_names_the_missing_ranks", |r| {
        let id = r.unique_id();
        let t = Instant::now();
        assert_eq!(Comm::try_init(r.lib, r.n, id, r.rank).err(), Some(NCCL_SYSTEM_ERROR));
        assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
    });
    // Ranks 0 and 1 of 3; rank 2 never comes.
    let Some(g) = Group::spawn_ranks("init_bounds_its_wait_and_names_the_missing_ranks", 3, &[0, 1], &[("NCCL_EMU_TIMEOUT", "1")]) else {
        return;
    };
    let out = g.finish(Duration::from_secs(60));
    out.assert_ok();
    for r in [0, 1] {
        assert!(
            out.log(r).contains("only 2 of 3 ranks called ncclCommInitRank within 1 s (NCCL_EMU_TIMEOUT); missing ranks: 2"),
            "{}",
            out.log(r)
        );
    }
}
