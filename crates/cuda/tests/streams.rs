//! The emulated device's streams and events (src/emu_stream.rs): the `ferro_emu_stream.h`
//! contract that the emulated NCCL relies on, events between streams, and the host-wait
//! accounting. The counts are process-wide, so the tests of this file take one lock.
use ferrolm_cuda::{CudaBackend, StepScope};
use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex};

static SERIAL: Mutex<()> = Mutex::new(());

fn emulated() -> Option<Arc<CudaBackend>> {
    ferrolm_testing::gate::require(ferrolm_testing::Need::Emulator, CudaBackend::emulated(0))
}

/// `ferro_emu_stream_ops` of emu/ferro_emu_stream.h.
#[repr(C)]
struct Ops {
    magic: u32,
    enqueue: unsafe extern "C" fn(*mut c_void, Option<unsafe extern "C" fn(*mut c_void)>, *mut c_void) -> c_int,
}

struct Item {
    log: Arc<Mutex<Vec<(usize, std::thread::ThreadId)>>>,
    i: usize,
}

unsafe extern "C" fn run_item(arg: *mut c_void) {
    // SAFETY: `arg` is the Box<Item> leaked by the enqueue below; the contract calls fn once.
    let item = unsafe { Box::from_raw(arg as *mut Item) };
    std::thread::sleep(std::time::Duration::from_micros(200));
    item.log.lock().unwrap().push((item.i, std::thread::current().id()));
}

#[test]
fn the_stream_abi_runs_every_item_once_in_order_on_the_worker_and_destroy_drains() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(be) = emulated() else { return };
    be.emulator_race(Some(3));
    let s = be.new_stream().unwrap();
    let h = s.cu_stream() as *mut c_void;
    // SAFETY: an emulated stream's handle points at a struct whose first member is the ops table.
    let ops = unsafe { &**(h as *const *const Ops) };
    assert_eq!(ops.magic, 0xFE57_A300);
    let log = Arc::new(Mutex::new(Vec::new()));
    let n = 50;
    for i in 0..n {
        let arg = Box::into_raw(Box::new(Item { log: log.clone(), i })) as *mut c_void;
        // SAFETY: a live stream handle, a function of the ABI's type, and an arg it consumes.
        assert_eq!(unsafe { (ops.enqueue)(h, Some(run_item), arg) }, 0);
    }
    assert!(log.lock().unwrap().len() < n, "enqueue must not run the items on the caller's thread");
    drop(s); // destroying drains the queue
    be.emulator_race(None);
    let got = log.lock().unwrap().clone();
    assert_eq!(got.iter().map(|x| x.0).collect::<Vec<_>>(), (0..n).collect::<Vec<_>>(), "every item once, in order");
    let me = std::thread::current().id();
    assert!(got.iter().all(|x| x.1 == got[0].1 && x.1 != me), "all on the stream's one worker thread");
}

#[test]
fn an_event_orders_work_across_streams_and_host_waits_are_counted() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(be) = emulated() else { return };
    ferrolm_cuda::track_host_wait_sites(true);
    ferrolm_cuda::reset_host_waits();
    be.emulator_race(Some(5));
    let (a, b) = (be.new_stream().unwrap(), be.new_stream().unwrap());
    let (ha, hb) = (a.cu_stream() as *mut c_void, b.cu_stream() as *mut c_void);
    // SAFETY: as above.
    let ops = unsafe { &**(ha as *const *const Ops) };
    let log = Arc::new(Mutex::new(Vec::new()));
    let push = |h: *mut c_void, i: usize| {
        let arg = Box::into_raw(Box::new(Item { log: log.clone(), i })) as *mut c_void;
        // SAFETY: as above.
        assert_eq!(unsafe { (ops.enqueue)(h, Some(run_item), arg) }, 0);
    };
    for i in 0..10 {
        push(ha, i);
    }
    let ev = be.record_event(&a).unwrap();
    b.wait(&ev).unwrap();
    push(hb, 100);
    let done = be.record_event(&b).unwrap();
    {
        let _step = StepScope::begin();
        done.synchronize().unwrap();
    }
    let got: Vec<usize> = log.lock().unwrap().iter().map(|x| x.0).collect();
    assert_eq!(got.last(), Some(&100), "b's item ran before the event it waits for: {got:?}");
    assert!(ev.is_complete() && done.is_complete());
    be.synchronize().unwrap(); // outside a step
    be.emulator_race(None);
    let w = ferrolm_cuda::host_waits();
    assert_eq!((w.total, w.in_steps, w.steps), (2, 1, 1), "{w:?}");
    assert!(w.sites.iter().all(|(s, _)| s.contains("crates/cuda/tests/streams.rs")), "call sites: {:?}", w.sites);
    let report = ferrolm_cuda::format_report(&w);
    assert_eq!(report.lines().next(), Some("emulator host waits: 2 (1.00 per step)"), "{report}");
    assert_eq!(report.lines().count(), 1 + w.sites.len());
}
