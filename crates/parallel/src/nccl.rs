//! `NcclComm`: collectives with NCCL on the communicator's own CUDA stream, one process per GPU.
//!
//! Ordering, with no host blocking anywhere:
//! - input ready: an event recorded on the compute stream after the input was produced; the
//!   communication stream waits on it before the NCCL call;
//! - chained input: a collective whose input is another collective's result still in flight
//!   (this communicator's or another's; ZeRO's reduce-scatter -> optimizer-range reduce-scatter ->
//!   all-reduce) makes its stream wait on the producer's completion event and reads the
//!   producer's buffer; neither the host nor the compute stream waits for the producer;
//! - result: an event recorded on the communication stream after the call. The pending fill
//!   makes the compute stream wait on it, so kernels that read the result run after NCCL wrote
//!   it. The fill keeps the input and output buffers until then; if the result is dropped unread,
//!   the same wait is enqueued before they go back to the pool (the pool recycles blocks in
//!   compute-stream order, so a block NCCL still touches is never handed out early).
//!
//! Failures: a watchdog thread per communicator checks the oldest collective in flight. One
//! that has not completed within the timeout, an asynchronous NCCL error, or a failure notice
//! posted by another rank to the store aborts the communicator (`ncclCommAbort`, which makes the
//! stuck kernels return), posts the notice for the other ranks, prints the reason with the rank,
//! group, operation and sequence number, and exits the process with status 1: a thread may be
//! blocked in a CUDA synchronisation behind the hung kernel, so returning an error is not
//! possible, and continuing would compute with garbage (torch's NCCL watchdog does the same).
//! `Communicator::abort` posts a failure notice; so does a panic, once `report_panics_to_peers`
//! is installed (`init` does it).
//!
//! On the emulated CUDA device (`FERROLM_CUDA_EMULATOR=1`) the same code drives the emulated
//! NCCL (`nccl_lib::for_device`) on the emulator's streams: each collective is queued on the
//! communication stream behind an event wait on the compute stream, exactly as on a GPU, and its
//! completion is an emulated event. `FERROLM_EMU_NCCL_NULL_STREAM=1` (a debugging switch) passes
//! NULL instead: each collective then runs at call time, in issue order, and its completion is a
//! host flag that the watchdog watches as it watches an event.
//!
//! `FERROLM_COMM_CHECK=1` checks every collective's arguments and call site (`comm::call_site`)
//! against rank 0's through the store (a round trip per collective: for debugging); without it,
//! ranks that disagree get what
//! NCCL does with mismatched calls.
use crate::comm::{Collective, CommOptions, CommStats, Communicator, Completion, InFlightResult, ReduceOp};
use crate::nccl_lib::{self, NcclLib, RawComm, UniqueId};
use crate::store::Store;
use ferrolm_cuda::{CudaBackend, CudaEvent, CudaStorage, CudaStream};
use ferrolm_tensor::{bail, no_grad, DType, Device, Error, Result, Storage, Tensor};
use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn cuda_err<E: std::fmt::Debug>(op: &'static str) -> impl Fn(E) -> Error {
    move |e| Error::new(op, format!("CUDA error: {e:?}"))
}

/// The raw communicator handle. NCCL allows calls on one communicator from any thread as long
/// as they do not overlap; `Shared::launch` serialises them.
struct Handle(RawComm);
// SAFETY: see above; the handle is only used under `Shared::launch` or by the watchdog's
// thread-safe calls (ncclCommGetAsyncError, ncclCommAbort).
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

struct InFlight {
    seq: u64,
    what: String,
    launched: Instant,
    done: Done,
}

/// When a collective has completed: an event on the communication stream, or (no stream: the
/// call ran on the host) a flag set when the call returned.
#[derive(Clone)]
enum Done {
    Event(Arc<CudaEvent>),
    Host(Arc<AtomicBool>),
}

impl Done {
    fn try_is_complete(&self) -> std::result::Result<bool, String> {
        match self {
            Done::Event(e) => e.try_is_complete().map_err(|e| format!("{e:?}")),
            Done::Host(f) => Ok(f.load(Ordering::Acquire)),
        }
    }
}

struct Shared {
    lib: &'static NcclLib,
    comm: Handle,
    rank: usize,
    size: usize,
    name: String,
    world_ranks: Vec<usize>,
    timeout: Duration,
    backend: Arc<CudaBackend>,
    /// The communication stream; `None` only under `FERROLM_EMU_NCCL_NULL_STREAM=1` on the
    /// emulated device (NULL is passed: collectives run at call time).
    stream: Option<Arc<CudaStream>>,
    store: Arc<Store>,
    /// Next sequence number; held across each NCCL call.
    launch: Mutex<u64>,
    inflight: Mutex<VecDeque<InFlight>>,
    failed: Mutex<Option<String>>,
    aborted: AtomicBool,
    stats: Mutex<CommStats>,
    check_args: bool,
    splits: AtomicU64,
}

/// One rank's NCCL communicator over a group of processes.
pub struct NcclComm {
    s: Arc<Shared>,
}

/// The store connection the watchdogs and the panic hook use (a second connection, so a
/// check never waits behind a blocking `get` on the main one).
static WATCH: OnceLock<Arc<Store>> = OnceLock::new();

impl NcclComm {
    /// Joins the world: rank 0 makes the NCCL unique id and publishes it through `store`, every
    /// rank reads it, meets the others at a store barrier (which bounds the wait by the store's
    /// timeout, where `ncclCommInitRank` would block forever) and initialises NCCL on `backend`'s
    /// device.
    pub fn init(
        rank: usize,
        world_size: usize,
        store: Arc<Store>,
        backend: Arc<CudaBackend>,
        options: CommOptions,
    ) -> Result<Arc<NcclComm>> {
        // The emulated NCCL for the emulated device, real NCCL on a GPU.
        let lib = nccl_lib::for_device(backend.is_emulated())?;
        let mut id = UniqueId { internal: [0; 128] };
        if rank == 0 {
            // SAFETY: writes the 128-byte id.
            lib.check("ncclGetUniqueId", unsafe { (lib.get_unique_id)(&mut id) })?;
            store.set("nccl/world/id", &id.internal)?;
        } else {
            let v = store.get("nccl/world/id")?;
            if v.len() != 128 {
                bail!("nccl", "the NCCL unique id from the store has {} bytes, not 128", v.len());
            }
            id.internal.copy_from_slice(&v);
        }
        store.barrier("nccl/world/init")?;
        bind(&backend)?;
        let mut comm: RawComm = std::ptr::null_mut();
        // SAFETY: every rank passes the same id and world size and its own rank.
        lib.check("ncclCommInitRank", unsafe { (lib.comm_init_rank)(&mut comm, world_size as i32, id, rank as i32) })?;
        if WATCH.get().is_none() {
            let _ = WATCH.set(Arc::new(store.reconnect()?));
        }
        Self::finish(lib, Handle(comm), rank, "world".into(), (0..world_size).collect(), store, backend, options.timeout)
    }

    #[allow(clippy::too_many_arguments)]
    fn finish(
        lib: &'static NcclLib,
        comm: Handle,
        rank: usize,
        name: String,
        world_ranks: Vec<usize>,
        store: Arc<Store>,
        backend: Arc<CudaBackend>,
        timeout: Duration,
    ) -> Result<Arc<NcclComm>> {
        let stream = if backend.is_emulated() && std::env::var("FERROLM_EMU_NCCL_NULL_STREAM").is_ok_and(|v| v == "1") {
            None
        } else {
            Some(backend.new_stream()?)
        };
        let s = Arc::new(Shared {
            lib,
            comm,
            rank,
            size: world_ranks.len(),
            name,
            world_ranks,
            timeout,
            backend,
            stream,
            store,
            launch: Mutex::new(0),
            inflight: Mutex::new(VecDeque::new()),
            failed: Mutex::new(None),
            aborted: AtomicBool::new(false),
            stats: Mutex::default(),
            check_args: std::env::var("FERROLM_COMM_CHECK").is_ok_and(|v| v == "1"),
            splits: AtomicU64::new(0),
        });
        let weak = Arc::downgrade(&s);
        std::thread::Builder::new()
            .name(format!("nccl-watchdog-{}", s.name))
            .spawn(move || watchdog(weak))
            .map_err(|e| Error::new("nccl", format!("cannot start the watchdog thread: {e}")))?;
        Ok(Arc::new(NcclComm { s }))
    }
}

/// Makes the device's context current on this thread (NCCL calls need it on a GPU; the
/// emulated device has none).
fn bind(backend: &CudaBackend) -> Result<()> {
    backend.bind_to_thread()
}

impl Shared {
    /// This rank and the oldest collective it has in flight (what a failure interrupted), or
    /// just the rank and group when it is idle.
    fn doing(&self) -> String {
        match lock(&self.inflight).front() {
            Some(f) => self.context(f.seq, &f.what),
            None => format!("rank {} of group {}", self.rank, self.name),
        }
    }
    fn context(&self, seq: u64, what: &str) -> String {
        format!(
            "rank {} (world rank {}) of group {} {:?}: {what} #{seq}",
            self.rank, self.world_ranks[self.rank], self.name, self.world_ranks
        )
    }
    fn check_failed(&self, ctx: impl Fn() -> String) -> Result<()> {
        match &*lock(&self.failed) {
            Some(m) => bail!(ctx(), "{m}"),
            None => Ok(()),
        }
    }
    /// Marks the communicator failed and aborts it (the first reason wins).
    fn fail(&self, msg: String, notify: bool) {
        {
            let mut f = lock(&self.failed);
            if f.is_some() {
                return;
            }
            *f = Some(msg.clone());
        }
        if notify {
            let _ = WATCH.get().unwrap_or(&self.store).report_failure(&msg);
        }
        if !self.aborted.swap(true, Ordering::AcqRel) {
            // SAFETY: abort is safe to call from any thread, also while kernels are stuck.
            let _ = unsafe { (self.lib.comm_abort)(self.comm.0) };
        }
    }

    /// FERROLM_COMM_CHECK: this rank's arguments against rank 0's.
    fn check_agreement(&self, seq: u64, desc: &str) -> Result<()> {
        let key = |r: usize| format!("nccl/{}/check{seq}/{r}", self.name);
        self.store.set(&key(self.rank), desc.as_bytes())?;
        if self.rank != 0 {
            let theirs = String::from_utf8_lossy(&self.store.get(&key(0))?).into_owned();
            if theirs != desc {
                let msg = format!(
                    "ranks disagree on collective #{seq} of group {}: rank 0 launched {theirs}, rank {} launched {desc}",
                    self.name, self.rank
                );
                let _ = self.store.report_failure(&msg);
                bail!(self.context(seq, "collective"), "{msg}");
            }
        }
        Ok(())
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if !self.aborted.load(Ordering::Acquire) {
            let _ = bind(&self.backend);
            // SAFETY: no call on this communicator can be running: it is being dropped.
            let _ = unsafe { (self.lib.comm_destroy)(self.comm.0) };
        }
    }
}

fn watchdog(weak: Weak<Shared>) {
    let mut last_check = Instant::now();
    // The collective that completed last: NCCL reports an error asynchronously, after the
    // failing collective's completion event may already have fired.
    let mut last_done: Option<(u64, String)> = None;
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let Some(s) = weak.upgrade() else { return };
        if lock(&s.failed).is_some() {
            return;
        }
        // Event queries need the device's context current on this thread.
        let _ = bind(&s.backend);
        let mut reason = None;
        let mut oldest = Duration::ZERO;
        let mut done_now = false;
        {
            let mut q = lock(&s.inflight);
            while let Some(f) = q.front() {
                match f.done.try_is_complete() {
                    Ok(true) => {
                        last_done = Some((f.seq, f.what.clone()));
                        done_now = true;
                        q.pop_front();
                    }
                    Ok(false) if f.launched.elapsed() > s.timeout => {
                        reason = Some(format!(
                            "{} timed out after {:.1} s waiting for the NCCL kernel to complete (a rank did not join it, or died)",
                            s.context(f.seq, &f.what),
                            s.timeout.as_secs_f64()
                        ));
                        break;
                    }
                    Ok(false) => {
                        oldest = f.launched.elapsed();
                        break;
                    }
                    Err(e) => {
                        reason = Some(format!("{}: CUDA error on the communication stream: {e}", s.context(f.seq, &f.what)));
                        break;
                    }
                }
            }
        }
        let mut async_err = 0;
        // SAFETY: ncclCommGetAsyncError is thread-safe and writes one int.
        if reason.is_none()
            && unsafe { (s.lib.comm_get_async_error)(s.comm.0, &mut async_err) } == 0
            && async_err != 0
            && async_err != nccl_lib::NCCL_IN_PROGRESS
        {
            // The failing collective: one that completed since the last poll, else the oldest in
            // flight, else the last one this rank ran.
            let empty = lock(&s.inflight).is_empty();
            let at = match &last_done {
                Some((seq, what)) if done_now || empty => s.context(*seq, what),
                _ => s.doing(),
            };
            reason = Some(format!("{at}: {}", s.lib.check("nccl", async_err).unwrap_err()));
        }
        let mut notify = true;
        if reason.is_none() && last_check.elapsed() > Duration::from_secs(1) {
            last_check = Instant::now();
            match WATCH.get().unwrap_or(&s.store).failure() {
                Ok(Some(m)) => {
                    reason = Some(format!("{}: {m}", s.doing()));
                    notify = false;
                }
                // The store's process died (rank 0, or torchrun's agent) while a collective
                // waits: its peers are gone. Idle, it may just be the end of the run.
                Err(e) if oldest > Duration::from_secs(2) => {
                    reason = Some(format!("{}: {e}", s.doing()));
                    notify = false;
                }
                _ => {}
            }
        }
        if let Some(msg) = reason {
            s.fail(msg.clone(), notify);
            eprintln!("ferrolm-parallel: {msg}; aborting this process");
            // Rank 0 serves the store: keep it until the others have read the notice.
            s.store.linger(Duration::from_secs(10));
            std::process::exit(1);
        }
    }
}

/// Makes a panic anywhere in this process post a failure notice to the store (once a
/// communicator exists), so the other ranks stop instead of waiting for this one until the
/// timeout. `init` installs it for multi-process runs; a library does not take over the panic
/// hook on its own, since a panic that is caught and handled would be reported too.
pub fn report_panics_to_peers() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            prev(info);
            if let Some(w) = WATCH.get() {
                let _ = w.report_failure(&format!("panicked: {info}"));
            }
        }));
    });
}

fn nccl_dtype(op: &str, d: DType) -> Result<i32> {
    Ok(match d {
        DType::F32 => nccl_lib::NCCL_FLOAT32,
        DType::BF16 => nccl_lib::NCCL_BFLOAT16,
        DType::F64 => nccl_lib::NCCL_FLOAT64,
        DType::I32 => nccl_lib::NCCL_INT32,
        #[allow(unreachable_patterns)]
        other => bail!(op, "{other} is not supported by NCCL here"),
    })
}

fn nccl_op(op: ReduceOp) -> i32 {
    match op {
        ReduceOp::Sum => nccl_lib::NCCL_SUM,
        ReduceOp::Avg => nccl_lib::NCCL_AVG,
        ReduceOp::Max => nccl_lib::NCCL_MAX,
    }
}

/// The buffers of one collective in flight, released only after the compute stream has been
/// made to wait for the collective (see the module doc).
struct Buffers {
    out: Option<CudaStorage>,
    input: Option<Tensor>,
    done: Done,
    /// `None` without a communication stream (the collective has run when the call returned).
    compute: Option<Arc<CudaStream>>,
}

impl Buffers {
    fn order_compute(&self) -> Result<()> {
        match (&self.compute, &self.done) {
            (Some(c), Done::Event(e)) => c.wait(e).map_err(cuda_err("nccl")),
            _ => Ok(()),
        }
    }
}

impl Drop for Buffers {
    fn drop(&mut self) {
        if self.out.is_some() {
            // Dropped unread: the pool may hand these blocks out as soon as they are released,
            // to kernels on the compute stream, which therefore must come after NCCL.
            let _ = self.order_compute();
        }
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.s.rank
    }
    fn size(&self) -> usize {
        self.s.size
    }
    fn name(&self) -> &str {
        &self.s.name
    }
    fn world_ranks(&self) -> &[usize] {
        &self.s.world_ranks
    }
    fn timeout(&self) -> Duration {
        self.s.timeout
    }

    fn launch(&self, op: Collective, x: &Tensor) -> Result<Completion> {
        let s = &self.s;
        let (n, what) = (s.size, op.to_string());
        let shape = op.output_shape(x.shape(), n)?;
        op.check_dtype(x.dtype())?;
        let (dtype, device) = (x.dtype(), x.device());
        if device != Device::Cuda(s.backend.ordinal()) {
            bail!(what, "NCCL communicator of cuda:{} got a tensor on {device}", s.backend.ordinal());
        }
        let dt = nccl_dtype(&what, dtype)?;
        // Another collective's result in flight is chained: this stream waits for its event and
        // reads its buffer, and neither the host nor the compute stream waits for it.
        let chained = s.stream.as_ref().and_then(|_| InFlightResult::device_of(x));
        let x = {
            let _g = no_grad();
            if chained.is_some() {
                x.detach()
            } else {
                x.contiguous()?.detach()
            }
        };
        let out = s.backend.alloc_storage(shape.numel(), dtype)?;
        let in_ptr = match &chained {
            Some((_, ptr)) => *ptr,
            // Reading the storage settles a pending input: its own fill orders the compute stream.
            None => x.with_storage(|(st, l)| Ok(CudaStorage::of(&what, st)?.ptr_at(l.offset)))?,
        };
        let out_ptr = out.device_ptr();
        let compute = match s.stream {
            Some(_) => Some(s.backend.compute_stream()?.clone()),
            None => None,
        };

        let mut next = lock(&s.launch);
        let seq = *next;
        s.check_failed(|| s.context(seq, &what))?;
        if s.check_args {
            let at = crate::comm::current_site().map_or(String::new(), |s| format!(" at {s}"));
            s.check_agreement(seq, &format!("{what} of {:?} {dtype}{at}", x.dims()))?;
        }
        bind(&s.backend)?;
        let (send, recv) = (in_ptr as *const c_void, out_ptr as *mut c_void);
        let (st, host_done) = match (&s.stream, &compute) {
            (Some(stream), Some(compute)) => {
                // The compute stream's work so far: it produced the input, or (chained) last used
                // the blocks of the output, which the pool recycles in compute-stream order.
                let ready = s.backend.record_event(compute)?;
                stream.wait(&ready).map_err(cuda_err("nccl"))?;
                if let Some((produced, _)) = &chained {
                    stream.wait(produced).map_err(cuda_err("nccl"))?;
                }
                (stream.cu_stream() as *mut c_void, None)
            }
            _ => {
                // No stream: the call itself runs the collective, and may wait for a peer; the
                // watchdog sees it in flight from now on.
                let flag = Arc::new(AtomicBool::new(false));
                lock(&s.inflight).push_back(InFlight { seq, what: what.clone(), launched: Instant::now(), done: Done::Host(flag.clone()) });
                (std::ptr::null_mut(), Some(flag))
            }
        };
        let lib = s.lib;
        let c = s.comm.0;
        if x.numel() > 0 {
            // SAFETY: send and recv are live device buffers of the sizes NCCL derives from these
            // counts (output_shape checked them); both stay alive in `Buffers` until the compute
            // stream has waited for the event recorded after the call.
            let r = unsafe {
                match op {
                    Collective::AllReduce(r) => (lib.all_reduce)(send, recv, x.numel(), dt, nccl_op(r), c, st),
                    Collective::AllGather => (lib.all_gather)(send, recv, x.numel(), dt, c, st),
                    Collective::ReduceScatter(r) => (lib.reduce_scatter)(send, recv, shape.numel(), dt, nccl_op(r), c, st),
                    Collective::Broadcast { root } => (lib.broadcast)(send, recv, x.numel(), dt, root as i32, c, st),
                }
            };
            if let Some(f) = &host_done {
                f.store(true, Ordering::Release);
            }
            if let Err(e) = lib.check(&what, r) {
                // The context names the operation already.
                let msg = format!("{}: {}", s.context(seq, &what), e.msg);
                s.fail(msg.clone(), true);
                bail!(s.context(seq, &what), "{}", e.msg);
            }
        }
        let done = match (&s.stream, host_done) {
            (Some(stream), _) => Done::Event(Arc::new(s.backend.record_event(stream)?)),
            (None, f) => {
                let f = f.unwrap_or_default();
                f.store(true, Ordering::Release);
                Done::Host(f)
            }
        };
        *next += 1;
        drop(next);
        lock(&s.stats).record(op, n, s.rank, x.numel() * dtype.size_in_bytes());
        if let Done::Event(_) = done {
            lock(&s.inflight).push_back(InFlight { seq, what: what.clone(), launched: Instant::now(), done: done.clone() });
        }

        let producer = match &done {
            Done::Event(e) => Some(InFlightResult::Device { event: e.clone(), ptr: out_ptr }.producer()),
            Done::Host(_) => None,
        };
        // The input (a chained result in flight included) lives until the compute stream has
        // waited for this collective.
        let bufs = Buffers { out: Some(out), input: Some(x), done: done.clone(), compute };
        let shared = self.s.clone();
        let wait = move || {
            let mut bufs = bufs;
            bufs.order_compute()?;
            shared.check_failed(|| shared.context(seq, &what))?;
            bufs.input = None;
            let out = bufs.out.take().expect("taken once");
            Ok(Storage::Device(Box::new(out)))
        };
        let backend = s.backend.clone();
        let poll = move || {
            let _ = bind(&backend);
            match &done {
                Done::Event(e) => e.is_complete(),
                Done::Host(f) => f.load(Ordering::Acquire),
            }
        };
        let c = Completion::new(shape, dtype, device, wait, poll);
        Ok(match producer {
            Some(p) => c.produced_by(p),
            None => c,
        })
    }

    fn barrier(&self) -> Result<()> {
        // A one-element all-reduce, waited on by the host: every rank has launched everything
        // before it on this communicator, and it has run.
        let one = Tensor::zeros([1], DType::F32, Device::Cuda(self.s.backend.ordinal()))?;
        let y = self.all_reduce(&one, ReduceOp::Sum)?;
        y.to_vec_f32().map(|_| ())
    }

    fn split_named(&self, color: usize, key: usize, name: &str) -> Result<Arc<dyn Communicator>> {
        let s = &self.s;
        let k = s.splits.fetch_add(1, Ordering::Relaxed);
        let base = format!("nccl/{}/split{k}", s.name);
        s.store.set(&format!("{base}/{}", s.rank), format!("{color},{key},{name}").as_bytes())?;
        let mut members: Vec<(usize, usize)> = Vec::new(); // (key, parent rank) of my color
        for p in 0..s.size {
            let v = String::from_utf8_lossy(&s.store.get(&format!("{base}/{p}"))?).into_owned();
            let mut it = v.splitn(3, ',');
            let (c, kk, nm) = (it.next(), it.next(), it.next());
            let (Some(Ok(c)), Some(Ok(kk)), Some(nm)) = (c.map(str::parse::<usize>), kk.map(str::parse::<usize>), nm) else {
                bail!("split", "malformed split record {v:?} from rank {p}");
            };
            if nm != name {
                bail!("split", "ranks disagree on split #{k} of group {}: rank {p} splits {nm:?}, rank {} splits {name:?}", s.name, s.rank);
            }
            if c == color {
                members.push((kk, p));
            }
        }
        members.sort();
        let new_rank = members.iter().position(|&(_, p)| p == s.rank).expect("own record");
        let world_ranks = members.iter().map(|&(_, p)| s.world_ranks[p]).collect();
        bind(&s.backend)?;
        let mut comm: RawComm = std::ptr::null_mut();
        {
            let _serial = lock(&s.launch);
            // SAFETY: collective over the parent, called by every rank; NULL config inherits.
            s.lib.check("ncclCommSplit", unsafe {
                (s.lib.comm_split)(s.comm.0, color as i32, key as i32, &mut comm, std::ptr::null_mut())
            })?;
        }
        let c = NcclComm::finish(
            s.lib,
            Handle(comm),
            new_rank,
            format!("{}/{name}{color}", s.name),
            world_ranks,
            s.store.clone(),
            s.backend.clone(),
            s.timeout,
        )?;
        Ok(c)
    }

    fn stats(&self) -> CommStats {
        *lock(&self.s.stats)
    }

    fn abort(&self, reason: &str) {
        self.s.fail(reason.to_string(), true);
    }
}
