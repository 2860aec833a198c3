//! The emulated NCCL (crates/parallel/emu) through the same loader and function table as
//! libnccl.so.2, with ranks as real processes: every collective × dtype × op against a reference,
//! split (keys, NOCOLOR, splits of splits), communicators interleaved on several streams, the
//! asynchronous stream path, and a few megabytes per collective. The failure cases are in
//! nccl_emu_failures.rs. Skipped (saying so) when the library was not built, unless
//! FERROLM_REQUIRE_EMU=1.
mod emu_ranks;

use emu_ranks::{child, emu, reduce_ref, run_ranks, values, Buf, Comm, Dt, Group, Rank, TestStream, ALL_DTYPES, ALL_OPS};
use ferrolm_parallel::nccl_lib::{self, UniqueId, NCCL_MAX, NCCL_SPLIT_NOCOLOR, NCCL_SUM};
use std::ptr::null_mut;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn assert_elems(got: &[u8], want: &[u8], dt: Dt, what: &str) {
    if got != want {
        let es = dt.size();
        let i = (0..want.len() / es).find(|&i| got[i * es..(i + 1) * es] != want[i * es..(i + 1) * es]).unwrap_or(0);
        panic!("{what}: element {i} is {:02x?}, expected {:02x?}", &got[i * es..(i + 1) * es], &want[i * es..(i + 1) * es]);
    }
}

#[test]
fn the_loader_opens_the_emulated_library_like_libnccl() {
    let Some(lib) = emu() else { return };
    assert!(lib.emulated, "{}", lib.path);
    assert_eq!(lib.version, 22304, "reports NCCL 2.23.4, so the 2.18 check accepts it");
    let file = std::path::Path::new(&lib.path);
    assert!(file.is_file() && file.file_name().unwrap().to_string_lossy().starts_with("libnccl-emu-"), "{}", lib.path);
    assert!(std::ptr::eq(nccl_lib::for_device(true).unwrap(), lib), "the emulated device gets the emulated NCCL");
    match nccl_lib::for_device(false) {
        Ok(real) => assert!(!real.emulated, "a GPU gets the real NCCL: {}", real.path),
        Err(e) => assert!(e.to_string().contains("libnccl.so.2"), "{e}"),
    }
    // The same resolution a path in FERROLM_NCCL_LIB gets accepts the file.
    let again = nccl_lib::open_path(&lib.path).unwrap();
    assert!(again.emulated && again.version == lib.version);
    assert!(lib.error_string(5).contains("invalid usage"), "{}", lib.error_string(5));
    assert!(lib.error_string(6).contains("remote process exited"), "{}", lib.error_string(6));
    let e = lib.check("ncclAllReduce", 2).unwrap_err().to_string();
    assert!(e.contains("NCCL error 2") && e.contains("system error"), "{e}");

    // One rank, in this process: the collectives are copies, split works, ids are checked.
    let mut id = UniqueId { internal: [0; 128] };
    // SAFETY: writes the id.
    assert_eq!(unsafe { (lib.get_unique_id)(&mut id) }, 0);
    let comm = Comm::try_init(lib, 1, id, 0).unwrap();
    assert_eq!((comm.size(), comm.rank()), (1, 0));
    let x = Buf::from_bytes(&values(Dt::Bf16, 0, 5, 1, false));
    let y = Buf::filled(10, 0);
    assert_eq!(comm.all_reduce(x.ptr(), y.ptr(), 5, Dt::Bf16, nccl_lib::NCCL_AVG, null_mut()), 0);
    assert_eq!(y.bytes(), x.bytes());
    assert!(comm.split(NCCL_SPLIT_NOCOLOR, 0).is_none());
    let sub = comm.split(3, 0).unwrap();
    assert_eq!(sub.destroy(), 0);
    assert_eq!(comm.destroy(), 0);
    let zero = UniqueId { internal: [0; 128] };
    assert_eq!(Comm::try_init(lib, 1, zero, 0).err(), Some(nccl_lib::NCCL_INVALID_ARGUMENT), "an id not made by this library");
}

#[test]
fn a_gpu_never_gets_the_emulated_library() {
    child("a_gpu_never_gets_the_emulated_library", |_| {
        // FERROLM_NCCL_LIB names the emulator's file: the real-NCCL search refuses it.
        let e = nccl_lib::for_device(false).err().expect("the emulated NCCL was taken for a GPU").to_string();
        assert!(e.contains("the emulated NCCL, which runs only on the emulated CUDA device"), "{e}");
    });
    let Some(lib) = emu() else { return };
    let Some(g) = Group::spawn("a_gpu_never_gets_the_emulated_library", 1, &[("FERROLM_NCCL_LIB", &lib.path)]) else { return };
    g.finish(Duration::from_secs(60)).assert_ok();
}

fn every_collective(r: &Rank) {
    const C: usize = 37; // splits unevenly over 2 and 4 ranks
    let comm = r.init();
    let (n, me) = (r.n, r.rank);
    let null = null_mut();
    for dt in ALL_DTYPES {
        let es = dt.size();
        for tiny in [false, true] {
            if tiny && !matches!(dt, Dt::F16 | Dt::Bf16) {
                continue;
            }
            for op in ALL_OPS {
                let salt = (dt.code() * 16 + op) as u64 + tiny as u64 * 1000;
                let what = format!("{dt:?} op {op}{}", if tiny { " (subnormal range)" } else { "" });
                let ins: Vec<Vec<u8>> = (0..n).map(|q| values(dt, q, C, salt, tiny)).collect();
                let want = reduce_ref(dt, op, &ins);
                let send = Buf::from_bytes(&ins[me]);
                let recv = Buf::filled(C * es, 0xAB);
                assert_eq!(comm.all_reduce(send.ptr(), recv.ptr(), C, dt, op, null), 0);
                assert_elems(recv.bytes(), &want, dt, &format!("all-reduce {what}"));
                assert_eq!(comm.all_reduce(send.ptr(), send.ptr(), C, dt, op, null), 0);
                assert_elems(send.bytes(), &want, dt, &format!("in-place all-reduce {what}"));

                let ins: Vec<Vec<u8>> = (0..n).map(|q| values(dt, q, n * C, salt ^ 0x55, tiny)).collect();
                let mine: Vec<Vec<u8>> = ins.iter().map(|v| v[me * C * es..(me + 1) * C * es].to_vec()).collect();
                let want = reduce_ref(dt, op, &mine);
                let send = Buf::from_bytes(&ins[me]);
                let recv = Buf::filled(C * es, 0xAB);
                assert_eq!(comm.reduce_scatter(send.ptr(), recv.ptr(), C, dt, op, null), 0);
                assert_elems(recv.bytes(), &want, dt, &format!("reduce-scatter {what}"));
                assert_eq!(comm.reduce_scatter(send.ptr(), send.at(me * C * es), C, dt, op, null), 0);
                assert_elems(&send.bytes()[me * C * es..(me + 1) * C * es], &want, dt, &format!("in-place reduce-scatter {what}"));
            }
        }
        let ins: Vec<Vec<u8>> = (0..n).map(|q| values(dt, q, C, 7, false)).collect();
        let want = ins.concat();
        let send = Buf::from_bytes(&ins[me]);
        let recv = Buf::filled(n * C * es, 0xAB);
        assert_eq!(comm.all_gather(send.ptr(), recv.ptr(), C, dt, null), 0);
        assert_elems(recv.bytes(), &want, dt, &format!("all-gather {dt:?}"));
        let inplace = Buf::filled(n * C * es, 0xAB);
        // SAFETY: copies this rank's block into its place in the buffer.
        unsafe { std::ptr::copy_nonoverlapping(send.ptr() as *const u8, inplace.at(me * C * es) as *mut u8, C * es) };
        assert_eq!(comm.all_gather(inplace.at(me * C * es), inplace.ptr(), C, dt, null), 0);
        assert_elems(inplace.bytes(), &want, dt, &format!("in-place all-gather {dt:?}"));
        for (root, want) in ins.iter().enumerate() {
            let recv = Buf::filled(C * es, 0xAB);
            assert_eq!(comm.broadcast(send.ptr(), recv.ptr(), C, dt, root, null), 0);
            assert_elems(recv.bytes(), want, dt, &format!("broadcast {dt:?} from {root}"));
        }
    }
    // NaN wins in max (as in the thread-rank reference), and count 0 is a collective too.
    let x = Buf::from_bytes(&(if me == 1 { f32::NAN } else { 1.0f32 }).to_le_bytes());
    assert_eq!(comm.all_reduce(x.ptr(), x.ptr(), 1, Dt::F32, NCCL_MAX, null), 0);
    assert!(f32::from_le_bytes(x.bytes().try_into().unwrap()).is_nan());
    assert_eq!(comm.all_reduce(null, null, 0, Dt::F32, NCCL_SUM, null), 0);
    assert_eq!(comm.async_error(), 0);
    assert_eq!(comm.destroy(), 0);
}

#[test]
fn every_collective_dtype_and_op_on_2_ranks() {
    run_ranks("every_collective_dtype_and_op_on_2_ranks", 2, Duration::from_secs(120), every_collective);
}

#[test]
fn every_collective_dtype_and_op_on_4_ranks() {
    run_ranks("every_collective_dtype_and_op_on_4_ranks", 4, Duration::from_secs(120), every_collective);
}

fn gather_i32(comm: &Comm, v: i32) -> Vec<i32> {
    let n = comm.size();
    let send = Buf::from_bytes(&v.to_le_bytes());
    let recv = Buf::filled(4 * n, 0);
    assert_eq!(comm.all_gather(send.ptr(), recv.ptr(), 1, Dt::I32, null_mut()), 0);
    recv.bytes().chunks(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect()
}

#[test]
fn split_orders_ranks_by_key_and_nocolor_gets_no_communicator() {
    run_ranks("split_orders_ranks_by_key_and_nocolor_gets_no_communicator", 4, Duration::from_secs(60), |r| {
        let world = r.init();
        let me = r.rank as i32;
        // Parity groups with reversed keys: the new ranks run against the parent's.
        let half = world.split(me % 2, 10 - me).unwrap();
        assert_eq!((half.size(), half.rank()), (2, 1 - me as usize / 2));
        assert_eq!(gather_i32(&half, me), [me % 2 + 2, me % 2]);
        // Rank 3 opts out; equal keys keep the parent's order.
        match world.split(if me == 3 { NCCL_SPLIT_NOCOLOR } else { 5 }, 0) {
            None => assert_eq!(me, 3, "only NOCOLOR gives no communicator"),
            Some(three) => {
                assert_eq!((three.size(), three.rank()), (3, me as usize));
                assert_eq!(gather_i32(&three, me), [0, 1, 2]);
                assert_eq!(three.destroy(), 0);
            }
        }
        // A split of a split, then the parents still work.
        let again = half.split(0, 0).unwrap();
        assert_eq!(gather_i32(&again, me), [me % 2 + 2, me % 2]);
        assert_eq!(gather_i32(&world, me), [0, 1, 2, 3]);
        for c in [again, half, world] {
            assert_eq!(c.destroy(), 0);
        }
    });
}

#[test]
fn communicators_interleaved_on_streams_do_not_cross_talk() {
    run_ranks("communicators_interleaved_on_streams_do_not_cross_talk", 4, Duration::from_secs(60), |r| {
        const C: usize = 1000;
        const ITERS: u64 = 8;
        let world = r.init();
        let me = r.rank;
        let parity = world.split(me as i32 % 2, me as i32).unwrap(); // {0, 2}, {1, 3}
        let pairs = world.split(me as i32 / 2, me as i32).unwrap(); // {0, 1}, {2, 3}
        let dup = world.split(0, me as i32).unwrap(); // the world again, its own connections
        let (s1, s2) = (TestStream::new(), TestStream::new());
        let dt = Dt::F32;
        let mut checks: Vec<(String, Buf, Vec<u8>)> = Vec::new();
        let mut keep: Vec<Buf> = Vec::new();
        for it in 0..ITERS {
            let ins: Vec<Vec<u8>> = (0..4).map(|q| values(dt, q, C, it, false)).collect();
            let send = Buf::from_bytes(&ins[me]);
            let recv = Buf::filled(C * 4, 0xAB);
            assert_eq!(world.all_reduce(send.ptr(), recv.ptr(), C, dt, NCCL_SUM, s1.raw()), 0);
            checks.push((format!("world all-reduce {it}"), recv, reduce_ref(dt, NCCL_SUM, &ins)));
            keep.push(send);

            let group = [me % 2, me % 2 + 2];
            let send = Buf::from_bytes(&ins[me]);
            let recv = Buf::filled(2 * C * 4, 0xAB);
            assert_eq!(parity.all_gather(send.ptr(), recv.ptr(), C, dt, s2.raw()), 0);
            checks.push((format!("parity all-gather {it}"), recv, [ins[group[0]].clone(), ins[group[1]].clone()].concat()));
            keep.push(send);

            let group = [me / 2 * 2, me / 2 * 2 + 1];
            let big: Vec<Vec<u8>> = (0..4).map(|q| values(dt, q, 2 * C, it + 100, false)).collect();
            let mine: Vec<Vec<u8>> = group.iter().map(|&q| big[q][(me % 2) * C * 4..(me % 2 + 1) * C * 4].to_vec()).collect();
            let send = Buf::from_bytes(&big[me]);
            let recv = Buf::filled(C * 4, 0xAB);
            // At call time, while the streams' collectives are in flight on the other comms.
            assert_eq!(pairs.reduce_scatter(send.ptr(), recv.ptr(), C, dt, NCCL_MAX, null_mut()), 0);
            assert_elems(recv.bytes(), &reduce_ref(dt, NCCL_MAX, &mine), dt, &format!("pairs reduce-scatter {it}"));

            let root = it as usize % 4;
            let send = Buf::from_bytes(&ins[me]);
            let recv = Buf::filled(C * 4, 0xAB);
            assert_eq!(dup.broadcast(send.ptr(), recv.ptr(), C, dt, root, s1.raw()), 0);
            checks.push((format!("dup broadcast {it} from {root}"), recv, ins[root].clone()));
            keep.push(send);
        }
        s1.synchronize();
        s2.synchronize();
        for (what, got, want) in &checks {
            assert_elems(got.bytes(), want, dt, what);
        }
        for c in [dup, pairs, parity, world] {
            assert_eq!(c.async_error(), 0);
            assert_eq!(c.destroy(), 0);
        }
    });
}

struct Ptr(*mut std::ffi::c_void);
// SAFETY: test buffers outlive the streams that touch them.
unsafe impl Send for Ptr {}

#[test]
fn a_collective_on_a_stream_returns_at_once_and_completes_in_stream_order() {
    run_ranks("a_collective_on_a_stream_returns_at_once_and_completes_in_stream_order", 2, Duration::from_secs(60), |r| {
        const C: usize = 4096;
        let comm = r.init();
        let me = r.rank;
        let dt = Dt::F32;
        let bytes = C * 4;
        let ins: Vec<Vec<u8>> = (0..2).map(|q| values(dt, q, C, 1, false)).collect();
        let want = reduce_ref(dt, NCCL_SUM, &ins);
        let (s, s2) = (TestStream::new(), TestStream::new());
        let send = Buf::from_bytes(&ins[me]);
        let recv = Buf::filled(bytes, 0xAB);

        // The call returns before the data moves: rank 1 calls only after rank 0 has checked.
        if me == 1 {
            r.wait_for("enqueued");
        }
        let t = Instant::now();
        assert_eq!(comm.all_reduce(send.ptr(), recv.ptr(), C, dt, NCCL_SUM, s.raw()), 0);
        if me == 0 {
            assert!(t.elapsed() < Duration::from_secs(1), "the call waited {:?}", t.elapsed());
            assert!(recv.snapshot().iter().all(|&b| b == 0xAB), "the buffer changed before the peer called");
            r.signal("enqueued");
        }
        // Stream order: an item queued after the collective sees its result; a second
        // collective queued after that item is not done yet when it runs.
        let recv2 = Buf::filled(bytes, 0xAB);
        let seen: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
        let (p1, p2, s1seen) = (Ptr(recv.ptr()), Ptr(recv2.ptr()), seen.clone());
        s.push(move || {
            let (a, b) = (&p1, &p2);
            // SAFETY: both buffers live until after synchronize below.
            let read = |p: &Ptr| unsafe { std::slice::from_raw_parts(p.0 as *const u8, bytes).to_vec() };
            s1seen.lock().unwrap().extend([read(a), read(b)]);
        });
        assert_eq!(comm.all_reduce(recv.ptr(), recv2.ptr(), C, dt, NCCL_MAX, s.raw()), 0);
        s.synchronize();
        let seen = seen.lock().unwrap();
        assert_elems(&seen[0], &want, dt, "the first collective, seen by the next item");
        assert!(seen[1].iter().all(|&b| b == 0xAB), "the second collective ran before the item queued ahead of it");
        assert_elems(recv2.bytes(), &want, dt, "max over identical inputs");

        // Collectives of one communicator run in issue order across streams: one issued on s2
        // behind a closed gate holds back one issued later on s.
        let (gate_tx, gate_rx) = std::sync::mpsc::channel::<()>();
        s2.push(move || gate_rx.recv().unwrap());
        let (a, b) = (Buf::filled(bytes, 0xAB), Buf::filled(bytes, 0xAB));
        assert_eq!(comm.all_reduce(send.ptr(), a.ptr(), C, dt, NCCL_SUM, s2.raw()), 0);
        assert_eq!(comm.all_reduce(send.ptr(), b.ptr(), C, dt, NCCL_SUM, s.raw()), 0);
        let done = Arc::new(Mutex::new(false));
        let d = done.clone();
        s.push(move || *d.lock().unwrap() = true);
        std::thread::sleep(Duration::from_millis(150));
        assert!(!*done.lock().unwrap(), "a later collective overtook an earlier one of the same communicator");
        assert!(a.snapshot().iter().all(|&x| x == 0xAB) && b.snapshot().iter().all(|&x| x == 0xAB));
        gate_tx.send(()).unwrap();
        s2.synchronize();
        s.synchronize();
        assert_elems(a.bytes(), &want, dt, "gated collective");
        assert_elems(b.bytes(), &want, dt, "the collective behind it");
        assert_eq!(comm.async_error(), 0);
        drop((s, s2));
        assert_eq!(comm.destroy(), 0);
    });
}

#[test]
fn a_few_megabytes_per_collective_move_quickly() {
    child("a_few_megabytes_per_collective_move_quickly", |r| {
        const C: usize = 1 << 20; // 4 MiB of f32
        const REPS: usize = 5;
        let comm = r.init();
        let dt = Dt::F32;
        let ins: Vec<Vec<u8>> = (0..r.n).map(|q| values(dt, q, C, 3, false)).collect();
        let send = Buf::from_bytes(&ins[r.rank]);
        let recv = Buf::filled(C * 4, 0);
        let gathered = Buf::filled(r.n * C * 4, 0);
        let t = Instant::now();
        for _ in 0..REPS {
            assert_eq!(comm.all_reduce(send.ptr(), recv.ptr(), C, dt, NCCL_SUM, null_mut()), 0);
        }
        let ar = t.elapsed() / REPS as u32;
        let t = Instant::now();
        for _ in 0..REPS {
            assert_eq!(comm.all_gather(send.ptr(), gathered.ptr(), C, dt, null_mut()), 0);
        }
        let ag = t.elapsed() / REPS as u32;
        assert_elems(recv.bytes(), &reduce_ref(dt, NCCL_SUM, &ins), dt, "4 MiB all-reduce");
        assert_elems(gathered.bytes(), &ins.concat(), dt, "4 MiB x n all-gather");
        if r.rank == 0 {
            println!("\n{} ranks, 4 MiB f32: all-reduce {ar:?}, all-gather (4 MiB per rank) {ag:?}", r.n);
        }
        assert!(ar < Duration::from_secs(2) && ag < Duration::from_secs(2), "all-reduce {ar:?}, all-gather {ag:?}");
        assert_eq!(comm.destroy(), 0);
    });
    let Some(g) = Group::spawn("a_few_megabytes_per_collective_move_quickly", 4, &[]) else { return };
    let out = g.finish(Duration::from_secs(120));
    out.assert_ok();
    for line in out.log(0).lines().filter(|l| l.contains("4 MiB f32")) {
        println!("{line}");
    }
}
